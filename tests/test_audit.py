"""npattn.tools.audit: each configuration of the panel is what its name says, and the report
(table, summary line, JSON) says what the rows say."""

import io
import json
import re
import sys

import numpy as np
import pytest

from npattn import attention as A
from npattn.backend import namespace
from npattn.tools import audit


def _sdpa_arguments(check, dtype, monkeypatch):
    """The arguments of the first (outermost) ``attention.sdpa_forward`` or
    ``functional.sdpa_forward`` call that one forward of ``check`` makes, with the shapes of
    q and k; plus the check's input names."""
    from npattn import functional as F

    calls = []

    def recording(original):
        def sdpa_forward(q, k, v, **kw):
            calls.append(dict(kw, q_shape=tuple(q.shape), k_shape=tuple(k.shape), v_shape=tuple(v.shape)))
            return original(q, k, v, **kw)

        return sdpa_forward

    monkeypatch.setattr(A, "sdpa_forward", recording(A.sdpa_forward))
    monkeypatch.setattr(F, "sdpa_forward", recording(F.sdpa_forward))
    xp = namespace(np.zeros(1))
    args = (xp, getattr(xp, dtype), np.random.default_rng(0))
    fwd, _, inputs, names = check.build(*args) if check.impl is None else check.build(
        *args, impl=check.impl)
    fwd(*inputs)
    monkeypatch.undo()
    assert calls, check.name
    return dict(calls[0], inputs=dict(zip(names, inputs))), names


def _attends_nothing(mask):
    """True where a row of ``mask`` (bool: True = may attend, or additive float) has no key."""
    m = np.asarray(mask)
    return np.all(~m if m.dtype == bool else np.isneginf(m), axis=-1)


@pytest.mark.parametrize("dtype", ["float64", "float32"])
def test_each_attention_configuration_is_what_its_name_says(monkeypatch, dtype):
    """The panel's names are its coverage claims (docs/check.md lists them): a configuration
    named causal runs causal, one with dropout drops with a fixed keep-mask that drops
    something, one with sinks has sinks, a cross or Lq != Lk one has different lengths, a
    fully masked row is in the mask that reaches attention (the module's mask is no input of
    the check, so test_cli's look at the inputs does not see it) and more than one where it
    says rows, a padding mask pads some key, a float mask named for -inf has it beside finite
    entries of a row too, and a [blocked] one runs on blocks shorter than both lengths, in
    float32 as in float64 (where the module audited is a second one, built for float32)."""
    seen = 0
    for c in audit.panel("numpy"):
        if not c.name.startswith(("sdpa", "mha")):
            continue
        kw, names = _sdpa_arguments(c, dtype, monkeypatch)
        name, (Lq, Lk) = c.name, (kw["q_shape"][-2], kw["k_shape"][-2])
        mask = kw.get("mask")
        if "causal" in name:
            assert kw.get("is_causal") is True, name
        if "dropout" in name:
            keep = kw.get("dropout_mask")
            assert kw.get("dropout_p", 0.0) > 0.0 and keep is not None, name
            assert not np.all(np.asarray(keep)), name
        if "sinks" in name:
            sinks = kw.get("sinks")
            assert sinks is not None and "sinks" in names, name
        if "GQA" in name:
            assert kw["q_shape"][1] != kw["k_shape"][1] and kw.get("enable_gqa"), name
        if "Lq!=Lk" in name or "cross" in name:
            assert Lq != Lk, name
        if "Lq > Lk" in name:
            assert Lq > Lk, name
        if "no mask" in name:
            assert mask is None, name
        if "float mask" in name:
            assert mask is not None and np.asarray(mask).dtype.kind == "f", name
        if "bool" in name:
            assert mask is not None and np.asarray(mask).dtype == bool, name
        if "fully masked row" in name:
            assert np.sum(_attends_nothing(mask)) >= (2 if "fully masked rows" in name else 1), name
        if "padding" in name:  # a padding mask pads some key
            assert np.any(~np.asarray(mask)), name
        if "-inf" in name:  # -inf beside finite entries too, not in fully masked rows alone
            m = np.asarray(mask)
            assert np.any(np.any(np.isneginf(m), axis=-1) & np.any(np.isfinite(m), axis=-1)), name
        if c.impl == "blocked":  # blocks that split both lengths, in float32 as in float64
            assert 0 < kw["block_q"] < Lq and 0 < kw["block_k"] < Lk, name
        if "bottom-right" in name:
            assert kw.get("align") == "bottom_right", name
        if "segments" in name:  # and a query whose segment has no key
            qs, ks = np.asarray(kw["q_segments"]), np.asarray(kw["k_segments"])
            assert np.any(~np.isin(qs, ks)), name
        if c.kind == "module":
            assert ("b_q" in names) == ("no bias" not in name), name
        # the numbers a name gives: p, head counts, widths, the window
        if (p := re.search(r"p=([0-9.]+)", name)):
            assert kw.get("dropout_p") == float(p[1]), name
        if (h := re.search(r"Hq=(\d+) Hkv=(\d+)", name)):
            assert (kw["q_shape"][1], kw["k_shape"][1]) == (int(h[1]), int(h[2])), name
        if (dv := re.search(r"Dv=(\d+) != Dh", name)):
            assert kw["v_shape"][-1] == int(dv[1]) != kw["q_shape"][-1], name
        if (w := re.search(r"window \((\d+), (\d+)\)", name)):
            assert tuple(kw.get("window")) == (int(w[1]), int(w[2])), name
        elif "window" in name:
            assert kw.get("window") is not None, name
        if "softcap" in name:
            assert kw.get("softcap"), name
        if "ALiBi" in name:
            assert kw.get("alibi_slopes") is not None, name
        if (kv := re.search(r"kdim=(\d+) vdim=(\d+)", name)):
            acts = kw["inputs"]
            assert (acts["key"].shape[-1], acts["value"].shape[-1]) == (int(kv[1]), int(kv[2])), name
        seen += 1
    assert seen >= 30


def test_each_primitive_configuration_is_what_its_name_says(monkeypatch):
    """The primitives' names are coverage claims too: "linear, bias" has a bias and "no bias"
    none, "split_heads, H=2" splits into 2 heads, "merge_heads, H=3" merges 3, "no mask" has
    none, "sink" has a sink, "dropout p=0.3, fixed keep-mask" drops with p = 0.3 and a
    keep-mask that drops something (a dropout keeping everything checks only a copy)."""
    from npattn import functional as F

    calls = []

    def recording(fn_name):
        original = getattr(F, fn_name)

        def fn(*args, **kw):
            calls.append((fn_name, args, kw))
            return original(*args, **kw)

        return fn

    for fn_name in ("linear_forward", "split_heads_forward", "merge_heads_forward",
                    "masked_softmax_forward", "dropout_forward"):
        monkeypatch.setattr(F, fn_name, recording(fn_name))
    xp = namespace(np.zeros(1))
    primitives = [c for c in audit.panel("numpy") if c.kind == "primitive"
                  and not c.name.startswith("sdpa")]
    seen = set()
    for c in primitives:
        calls.clear()
        fwd, _, inputs, names = c.build(xp, xp.float64, np.random.default_rng(0))
        fwd(*inputs)
        (fn_name, args, kw), name = calls[0], c.name
        assert name.startswith(fn_name.removesuffix("_forward")), name
        seen.add(fn_name)
        if fn_name == "linear_forward":
            has_bias = len(args) > 2 and args[2] is not None or kw.get("b") is not None
            assert has_bias == ("no bias" not in name) and ("bias" in name), name
        if (h := re.search(r"H=(\d+)", name)):
            if fn_name == "split_heads_forward":
                assert kw.get("n_head") == int(h[1]), name
            else:  # merge: x is (B, H, L, d)
                assert args[0].shape[1] == int(h[1]), name
        if fn_name == "masked_softmax_forward":
            mask = args[1] if len(args) > 1 else kw.get("mask")
            assert (mask is None) == ("no mask" in name), name
            assert (kw.get("sink") is not None) == ("sink" in name), name
        if (p := re.search(r"p=([0-9.]+)", name)):
            assert fn_name == "dropout_forward" and kw.get("p") == float(p[1]), name
            keep = np.asarray(kw.get("mask"))
            assert keep.dtype == bool and not keep.all() and keep.any(), name
    assert seen == {"linear_forward", "split_heads_forward", "merge_heads_forward",
                    "masked_softmax_forward", "dropout_forward"}, seen


def test_run_audit_refuses_an_unknown_dtype_before_running_a_check():
    ran = []

    def build(xp, dtype, rng):
        ran.append(dtype)
        raise AssertionError("ran")

    with pytest.raises(ValueError, match=r"^dtype: expected 'float64' or 'float32', got 'float16'$"):
        audit.run_audit("numpy", "float16", checks=[audit.Check("c", "primitive", build)])
    # not a name: a TypeError naming the argument (a list was an unhashable-type error)
    for dtype, got in ((None, r"got None"), (["float64"], r"got list \['float64'\]"),
                       (np.float64, r"got type numpy\.float64")):
        with pytest.raises(TypeError, match=rf"^dtype: expected 'float64' or 'float32', {got}$"):
            audit.run_audit("numpy", dtype, checks=[audit.Check("c", "primitive", build)])
    assert ran == []


def _times_three(wrong):
    """f(x) = 3 x on a (2, 3) array, whose backward returns ``wrong(3 dy)``."""

    def build(xp, dtype, rng):
        x = xp.asarray(rng.standard_normal((2, 3)), dtype=dtype)
        return (lambda x: (3.0 * x, None)), (lambda dy, cache: wrong(3.0 * dy)), [x], ["x"]

    return audit.Check("3 x", "primitive", build)


def _one_entry_changed(value):
    def wrong(g):
        g = np.array(g)
        g[1, 2] = value if value is not None else g[1, 2] + 0.5
        return g

    return wrong


def test_the_errors_of_a_row_are_the_largest_entry_error_and_it_over_the_scale():
    """One entry of the gradient off by 0.5: max_abs_err is 0.5 (the differences of a linear
    function are exact to round-off) and max_rel_err is 0.5 / max(max|g|, max|n|), with the
    true gradient 3 dout recomputed here from the check's own seed."""
    xp = namespace(np.zeros(1))
    (row,) = audit.run_check(_times_three(_one_entry_changed(None)), xp, "float64", seed=5)
    rng = np.random.default_rng(5)
    rng.standard_normal((2, 3))  # x
    n = 3.0 * rng.standard_normal((2, 3))  # 3 dout: the exact gradient
    g = n.copy()
    g[1, 2] += 0.5
    scale = max(np.abs(g).max(), np.abs(n).max())
    assert not row.passed and row.error is None
    assert row.max_abs_err == pytest.approx(0.5, rel=1e-8)
    assert row.max_rel_err == pytest.approx(0.5 / scale, rel=1e-8)
    (right,) = audit.run_check(_times_three(lambda g: g), xp, "float64", seed=5)
    assert right.passed and right.max_abs_err < 1e-8


def test_a_float64_row_passes_up_to_1e_12_plus_1e_6_of_its_scale_and_fails_beyond():
    """float64's tolerances are rtol 1e-6 and atol 1e-12 (docs/check.md): one entry of the
    gradient of 3 x off by half the bound atol + rtol * scale passes, off by twice it fails,
    and the result and its summary carry those tolerances."""
    rng = np.random.default_rng(5)
    rng.standard_normal((2, 3))  # x
    n = 3.0 * rng.standard_normal((2, 3))  # 3 dout: the exact gradient
    at = np.unravel_index(np.argmin(np.abs(n)), n.shape)  # not the largest entry: the scale stays
    bound = 1e-12 + 1e-6 * np.abs(n).max()

    def off_by(delta):
        def wrong(g):
            g = np.array(g)
            g[at] += delta
            return g

        return wrong

    xp = namespace(np.zeros(1))
    for factor, passed in ((0.5, True), (2.0, False)):
        (row,) = audit.run_check(_times_three(off_by(factor * bound)), xp, "float64", seed=5)
        assert row.passed is passed and row.error is None, (factor, row)
        assert row.max_abs_err == pytest.approx(factor * bound, rel=1e-3)  # differences: ~1e-10
    result = audit.run_audit("numpy", "float64", checks=[_times_three(lambda g: g)])
    assert (result.rtol, result.atol) == (1e-6, 1e-12)
    assert "(numpy, float64, rtol=1e-06, atol=1e-12)" in audit.summary_line(result)


def test_a_small_gradient_is_judged_against_1e_2_of_the_configuration_s_largest():
    """f(x, y) = [3 x, 1e-4 y]: y's gradient is far smaller than x's, so its scale is the floor
    1e-2 S, S the largest gradient entry of the configuration (x's): an error in y's gradient
    of 0.5e-6 of the floor passes, 2e-6 of it fails, and the relative error is over the floor."""
    def build_with(delta):
        def build(xp, dtype, rng):
            x = xp.asarray(rng.standard_normal((2, 3)), dtype=dtype)
            y = xp.asarray(rng.standard_normal((2, 3)), dtype=dtype)

            def backward(dout, cache):
                dy = np.array(1e-4 * dout[2:])
                dy[0, 1] += delta
                return 3.0 * dout[:2], dy

            forward = (lambda x, y: (xp.concat([3.0 * x, 1e-4 * y], axis=0), None))
            return forward, backward, [x, y], ["x", "y"]

        return audit.Check("[3 x, 1e-4 y]", "primitive", build)

    rng = np.random.default_rng(2)
    rng.standard_normal((2, 3)), rng.standard_normal((2, 3))  # x, y
    dout = rng.standard_normal((4, 3))
    floor = 1e-2 * np.abs(3.0 * dout[:2]).max()
    xp = namespace(np.zeros(1))
    for factor, passed in ((0.5, True), (2.0, False)):
        rows = audit.run_check(build_with(factor * 1e-6 * floor), xp, "float64", seed=2)
        assert [r.tensor for r in rows] == ["x", "y"] and rows[0].passed, rows
        assert rows[1].passed is passed, (factor, rows[1])
        assert rows[1].max_rel_err == pytest.approx(factor * 1e-6, rel=5e-2), rows[1]  # round-off


@pytest.mark.parametrize("value", [np.inf, -np.inf, np.nan])
def test_a_gradient_with_an_infinite_or_nan_entry_fails(value):
    """An infinite entry makes both the error and the scale infinite, and inf <= rtol * inf
    holds: the row must still fail."""
    xp = namespace(np.zeros(1))
    (row,) = audit.run_check(_times_three(_one_entry_changed(value)), xp, "float64")
    assert not row.passed and np.isnan(row.max_abs_err) and np.isnan(row.max_rel_err)


def _result():
    rows = [audit.Row("conf A", "x", 1.5e-9, 2.5e-10, True),
            audit.Row("conf A", "w", 3.25e-3, 4.5e-2, False),
            audit.Row("conf B, longer", "q", float("nan"), float("nan"), False,
                      "RuntimeError: boom")]
    return audit.AuditResult("torch", "float32", 1e-4, 1e-7, rows, 1.25)


def test_the_table_and_the_summary_say_what_the_rows_say():
    table = audit.format_table(_result()).splitlines()  # header, rule, 3 rows, rule, summary
    a_x, a_w = table[2].split(), table[3].split()
    assert a_x[:3] == ["conf", "A", "x"] and a_x[-1] == "pass"
    assert (float(a_x[3]), float(a_x[4])) == (1.5e-9, 2.5e-10)  # abs, then rel
    assert a_w[:3] == ["conf", "A", "w"] and a_w[-1] == "FAIL"
    assert (float(a_w[3]), float(a_w[4])) == (3.25e-3, 4.5e-2)
    assert table[4].startswith("conf B, longer  q")
    assert table[4].endswith("FAIL  (RuntimeError: boom)")
    assert table[-1] == ("1/3 passed over 2 configurations (torch, float32, rtol=0.0001, "
                         "atol=1e-07) in 1.2s: 2 FAILED")
    one_failure = audit.AuditResult("numpy", "float64", 1e-6, 1e-12, _result().rows[:2], 0.0)
    assert audit.summary_line(one_failure) == (
        "1/2 passed over 1 configurations (numpy, float64, rtol=1e-06, atol=1e-12) in 0.0s: "
        "1 FAILED")


def test_the_table_s_columns_line_up_under_their_headings():
    """Each row's tensor, errors and verdict start where their headings do, whatever the
    lengths of the configuration and tensor names (a module's input is named "x (q=k=v)")."""
    rows = [audit.Row("c", "x (q=k=v)", 1.5e-9, 2.5e-10, True),
            audit.Row("a longer configuration", "w", 3.25e-3, 4.5e-2, False)]
    head, _, *lines = audit.format_table(audit.AuditResult("numpy", "float64", 1e-6, 1e-12, rows,
                                                           0.5)).splitlines()
    for line, r in zip(lines, rows):
        assert line.index(r.tensor, len(r.config)) == head.index("tensor"), (head, line)
        verdict = "pass" if r.passed else "FAIL"
        assert line.index(verdict) == head.index("result"), (head, line)
        rel = f"{r.max_rel_err:.2e}"  # right-aligned under its heading
        assert line.index(rel) + len(rel) == head.index("max rel err") + len("max rel err"), (head, line)


def test_the_json_of_a_result_says_its_settings_and_verdict():
    d = _result().to_dict()
    assert {k: d[k] for k in ("backend", "dtype", "rtol", "atol", "eps", "n_checked",
                              "n_failed", "ok", "seconds")} == {
        "backend": "torch", "dtype": "float32", "rtol": 1e-4, "atol": 1e-7, "eps": 1e-6,
        "n_checked": 3, "n_failed": 2, "ok": False, "seconds": 1.25}
    assert d["rows"][2]["max_abs_err"] is None and d["rows"][2]["error"] == "RuntimeError: boom"
    assert d["rows"][2]["max_rel_err"] is None  # NaN is no JSON: both errors become null
    json.loads(json.dumps(d, allow_nan=False))
    assert d["rows"][1]["max_rel_err"] == 4.5e-2 and d["rows"][0]["passed"] is True


def _linear_only(monkeypatch):
    linear = next(c for c in audit.panel() if c.name == "linear, bias")
    monkeypatch.setattr(audit, "panel", lambda backend=None: [linear])


def test_check_of_a_passing_panel_prints_json_alone_and_exits_0(monkeypatch, capsys):
    """--json: stdout is the JSON and nothing else goes out (the summary goes to stderr only
    when the audit failed); the dtype asked for is the dtype audited, with its tolerances."""
    from npattn.tools import cli

    _linear_only(monkeypatch)
    assert cli.main(["check", "--json", "--no-progress", "--dtype", "float32"]) == 0
    captured = capsys.readouterr()
    res = json.loads(captured.out)
    assert res["ok"] is True and res["dtype"] == "float32" and res["n_checked"] == 3
    assert (res["rtol"], res["atol"]) == (1e-4, 1e-7)  # float32's, as docs/check.md gives them
    assert captured.err == ""


@pytest.mark.parametrize("as_json", [False, True])
def test_check_of_an_empty_panel_is_no_pass(monkeypatch, capsys, as_json):
    """A panel that checks nothing (say a filter that matched no configuration) exits 1, as a
    failure, and says so: no rows have not failed, but nothing was shown to pass."""
    from npattn.tools import cli

    monkeypatch.setattr(audit, "panel", lambda backend=None: [])
    assert cli.main(["check", "--no-progress"] + (["--json"] if as_json else [])) == 1
    captured = capsys.readouterr()
    if as_json:
        assert json.loads(captured.out)["ok"] is False
        (summary,) = captured.err.splitlines()  # the summary line alone, not the table
        assert summary.startswith("0/0 passed") and summary.endswith("nothing was checked")
    else:
        assert captured.out.rstrip().endswith("nothing was checked")


def test_a_backward_that_returns_zeros_is_a_wrong_gradient_not_an_unexercised_one():
    """Zeros where the exact gradient 3 dout is not zero: the row fails with its numbers (abs
    error max|3 dout|, relative error 1), not as a configuration that does not exercise the
    tensor, which is said only when both sides are zero."""
    xp = namespace(np.zeros(1))
    (row,) = audit.run_check(_times_three(lambda g: 0.0 * g), xp, "float64", seed=5)
    rng = np.random.default_rng(5)
    rng.standard_normal((2, 3))  # x
    n = 3.0 * rng.standard_normal((2, 3))  # 3 dout: the exact gradient
    assert not row.passed and row.error is None
    assert row.max_abs_err == pytest.approx(np.abs(n).max(), rel=1e-8)
    assert row.max_rel_err == pytest.approx(1.0, rel=1e-8)


def test_progress_is_told_of_each_configuration_and_of_the_end():
    """progress(i, n, name) before configuration i, then progress(n, n, "") when all are done:
    the command's bar counts a configuration as done at the next call, so without the last
    one it would stop one short."""
    calls = []
    checks = [_times_three(lambda g: g), _times_three(lambda g: g)]
    checks[1].name = "3 x again"
    audit.run_audit("numpy", "float64", checks=checks, progress=lambda *a: calls.append(a))
    assert calls == [(0, 2, "3 x"), (1, 2, "3 x again"), (2, 2, "")]


def test_each_softmax_configuration_named_for_an_empty_row_has_one(monkeypatch):
    """The masked softmax configurations' masks as the softmax receives them (the sink's is no
    input of its check): where the name says a fully masked row or an empty sequence, some
    row attends nothing."""
    from npattn import functional as F

    masks = []
    original = F.masked_softmax_forward

    def recording(x, mask=None, **kw):
        masks.append(mask)
        return original(x, mask, **kw)

    monkeypatch.setattr(F, "masked_softmax_forward", recording)
    xp = namespace(np.zeros(1))
    named = [c for c in audit.panel("numpy") if c.name.startswith("masked_softmax")
             and ("fully masked row" in c.name or "empty sequence" in c.name)]
    assert len(named) >= 4
    for c in named:
        masks.clear()
        fwd, _, inputs, _ = c.build(xp, xp.float64, np.random.default_rng(0))
        fwd(*inputs)
        assert masks and masks[0] is not None and np.any(_attends_nothing(masks[0])), c.name


class _Terminal(io.StringIO):
    def isatty(self):
        return True


@pytest.mark.parametrize("no_progress", [False, True])
def test_check_counts_its_configurations_on_a_terminal_bar(monkeypatch, capsys, no_progress):
    """On a terminal `npattn check` shows a bar that ends at n/n configurations (one step each,
    the last at the end); --no-progress shows none."""
    from npattn.tools import cli

    two = [_times_three(lambda g: g), _times_three(lambda g: g)]
    monkeypatch.setattr(audit, "panel", lambda backend=None: two)
    term = _Terminal()
    monkeypatch.setattr(sys, "stderr", term)
    assert cli.main(["check"] + (["--no-progress"] if no_progress else [])) == 0
    written = term.getvalue()
    if no_progress:
        assert written == ""
    else:
        assert "check: 100%" in written and "2/2" in written and "3/2" not in written, written


def _off(fn, index=None, factor=1.001):
    """``fn``'s backward with one gradient (``index`` of a tuple, or the only one) 0.1 % off."""
    def wrong(*args, **kwargs):
        g = fn(*args, **kwargs)
        if index is None:
            return g * factor
        return tuple(x * factor if i == index else x for i, x in enumerate(g))

    return wrong


@pytest.mark.parametrize("module_name, fn_name, index, failing", [
    # a layer's own row, and the models built on it (their parameters' rows)
    ("layers", "layer_norm_backward", 1, {"layer_norm, weight and bias": {"weight"}}),
    ("layers", "gelu_backward", None, {"gelu, exact": {"x"}, "gelu, tanh": {"x"}}),
    ("nn", "embedding_backward", 1, {"embedding, repeated and absent ids": {"table"}}),
    ("nn", "cross_entropy_backward", 0, {
        "cross_entropy": {"logits"},
        "cross_entropy, class weights with a 0, ignore_index=2 (a class id), label_smoothing=0.1, "
        "reduction='none'": {"logits"}}),
    ("positions", "rope_backward", 0, {"rope": {"x"}}),
    ("positions", "relative_bias_backward", 0, {"relative_bias (T5), Lq != Lk": {"table"}}),
    ("layers", "feed_forward_backward", 3, {
        "feed_forward, gelu, dropout p=0.25, fixed keep-mask": {"w2"},
        "encoder block, post-norm, relu, padding mask, dropout p=0.2, fixed keep-masks": {"linear2.weight"},
        "gpt, 1 layer, tied head": {"blocks.0.linear2.weight"}}),
])
def test_a_layer_or_model_backward_off_by_a_bit_fails_its_rows(monkeypatch, module_name, fn_name, index,
                                                               failing):
    """One gradient of a layer's backward 0.1 % off (1000 x the float64 tolerance): the rows of
    that tensor fail in the layer's configuration and in the models that use the layer (a
    block's linear2.weight is the feed-forward's w2), and the other rows still pass."""
    import importlib

    module = importlib.import_module(f"npattn.{module_name}")
    xp = namespace(np.zeros(1))
    checks = {c.name: c for c in audit.panel("numpy")}
    monkeypatch.setattr(module, fn_name, _off(getattr(module, fn_name), index))
    for config, tensors in failing.items():
        rows = {r.tensor: r for r in audit.run_check(checks[config], xp, "float64")}
        assert {t for t, r in rows.items() if not r.passed} == tensors, (config, rows)


@pytest.mark.parametrize("broken", ["an infinite entry", "missing"])
def test_a_broken_gradient_fails_its_own_row_and_the_rows_keep_the_input_order(broken):
    """f(x, y) = 3 [x, y] with y's gradient broken (one entry infinite, or None): y's row
    fails and x's, exact, still passes; an infinite entry is no largest gradient of the
    configuration to take the floor from (1e-2 * inf would fail every row). The rows come
    in the order of the inputs, x then y, whichever of them failed."""
    def build(xp, dtype, rng):
        x = xp.asarray(rng.standard_normal((2, 3)), dtype=dtype)
        y = xp.asarray(rng.standard_normal((2, 3)), dtype=dtype)

        def backward(dout, cache):
            dy = np.array(3.0 * dout[2:])
            dy[1, 2] = np.inf
            return 3.0 * dout[:2], (dy if broken == "an infinite entry" else None)

        return (lambda x, y: (3.0 * xp.concat([x, y], axis=0), None)), backward, [x, y], ["x", "y"]

    xp = namespace(np.zeros(1))
    rows = audit.run_check(audit.Check("3 [x, y]", "primitive", build), xp, "float64", seed=2)
    assert [r.tensor for r in rows] == ["x", "y"]
    assert rows[0].passed and rows[0].max_abs_err < 1e-8, rows[0]
    assert not rows[1].passed and np.isnan(rows[1].max_abs_err), rows[1]


def test_a_jax_audit_puts_x64_back_as_it_found_it():
    """The checks run with jax_enable_x64 on; afterwards it is what it was before, on as well
    as off."""
    jax = pytest.importorskip("jax")
    before = bool(jax.config.jax_enable_x64)
    seen = []

    def build(xp, dtype, rng):
        seen.append(bool(jax.config.jax_enable_x64))
        raise RuntimeError("only the setting is looked at")

    try:
        for setting in (True, False):
            jax.config.update("jax_enable_x64", setting)
            result = audit.run_audit("jax", "float64", checks=[audit.Check("c", "primitive", build)])
            assert not result.ok and bool(jax.config.jax_enable_x64) is setting
    finally:
        jax.config.update("jax_enable_x64", before)
    assert seen == [True, True]


def test_each_layer_and_model_configuration_is_what_its_name_says(monkeypatch):
    """The names of the configurations around attention are coverage claims too: "gelu, tanh"
    runs the tanh form and "gelu, exact" the exact one, the feed-forward runs the activation
    and dropout p its name gives with a keep-mask that drops about a share p, the mean pool's mask
    leaves a sequence without tokens, the embedding's ids repeat one id and leave another out,
    the cross-entropy with options receives each option its name lists (and the plain one
    none), the relative positions have Lq != Lk, and each block is the kind, norm placement
    and activation its name says, causal when named so, with a padding mask that pads and
    dropout p with keep-masks that drop about a share p."""
    import importlib

    from npattn import transformer

    calls = []

    def recording(module, fn_name):
        original = getattr(module, fn_name)

        def fn(*args, **kw):
            calls.append((fn_name, args, kw))
            return original(*args, **kw)

        monkeypatch.setattr(module, fn_name, fn)

    for module_name, fn_names in (
            ("layers", ("relu_forward", "gelu_forward", "feed_forward_forward", "mean_pool_forward")),
            ("nn", ("embedding_forward", "cross_entropy_forward")),
            ("positions", ("relative_scores_forward", "relative_bias_forward"))):
        for fn_name in fn_names:
            recording(importlib.import_module(f"npattn.{module_name}"), fn_name)
    for kind in (transformer.TransformerBlock, transformer.TransformerDecoderBlock):
        original_forward = kind.forward

        def block_forward(self, *args, _original=original_forward, **kw):
            calls.append((type(self).__name__, (self,) + args, kw))
            return _original(self, *args, **kw)

        monkeypatch.setattr(kind, "forward", block_forward)
    xp = namespace(np.zeros(1))
    seen = set()
    for c in audit.panel("numpy"):
        if c.kind not in ("layer", "model") or c.name.startswith("gpt"):
            continue
        calls.clear()
        fwd, _, inputs, _ = c.build(xp, xp.float64, np.random.default_rng(0))
        fwd(*inputs)
        if not calls:  # layer_norm, residual, add_positions, rope: their names claim no options
            continue
        (fn_name, args, kw), name = calls[0], c.name
        seen.add(fn_name)
        if name.startswith(("relu", "gelu")):
            assert fn_name == name.split(",")[0] + "_forward", name
        if name.startswith("gelu"):
            assert kw.get("approximate", "none") == ("tanh" if "tanh" in name else "none"), name
        if fn_name == "feed_forward_forward":
            assert name.startswith("feed_forward") and kw["activation"] in name, name
            p = float(re.search(r"p=([0-9.]+)", name)[1])
            keep = np.asarray(kw["dropout_mask"])
            assert kw["dropout_p"] == p and abs(1.0 - keep.mean() - p) < 0.2 and keep.any(), name
        if fn_name == "mean_pool_forward":
            assert name.startswith("mean_pool") and "without tokens" in name, name
            keep = np.asarray(args[1])
            assert keep.dtype == bool and np.any(~keep.any(axis=-1)) and keep.any(), name
        if fn_name == "embedding_forward":
            ids, table = np.asarray(args[0]), args[1]
            counts = np.bincount(ids.ravel(), minlength=table.shape[0])
            assert counts.max() > 1 and np.any(counts == 0), name  # repeated and absent ids
        if fn_name == "cross_entropy_forward":
            options = {k: v for k, v in kw.items() if v is not None}
            if name == "cross_entropy":
                assert options == {}, name
            else:
                targets = np.asarray(args[1])
                assert np.any(np.asarray(options["weight"]) == 0.0), name  # "class weights with a 0"
                ignored = options["ignore_index"]
                assert f"ignore_index={ignored} (a class id)" in name and np.any(targets == ignored), name
                assert f"label_smoothing={options['label_smoothing']}" in name, name
                assert f"reduction={options['reduction']!r}" in name, name
        if fn_name == "relative_scores_forward":
            assert "Lq != Lk" in name and args[0].shape[-2] != args[2], name
        if fn_name == "relative_bias_forward":
            assert "Lq != Lk" in name and args[1] != args[2], name
        if fn_name.endswith("Block"):
            block = args[0]
            assert name.startswith("decoder" if "Decoder" in fn_name else "encoder"), name
            assert block.norm_first == ("pre-norm" in name) != ("post-norm" in name), name
            assert block.activation in name and bool(kw.get("is_causal")) == ("causal" in name), name
            pad = np.asarray(kw["memory_mask" if "Decoder" in fn_name else "mask"])
            assert pad.dtype == bool and not pad.all() and "padding mask" in name, name
            p = float(re.search(r"p=([0-9.]+)", name)[1])
            keeps = [np.asarray(k) for k in kw["dropout_masks"].values()]
            assert block.dropout == p and keeps and all(abs(1.0 - k.mean() - p) < 0.2 for k in keeps), name
    assert seen >= {"relu_forward", "gelu_forward", "feed_forward_forward", "mean_pool_forward",
                    "embedding_forward", "cross_entropy_forward", "relative_scores_forward",
                    "relative_bias_forward", "TransformerBlock", "TransformerDecoderBlock"}, seen
