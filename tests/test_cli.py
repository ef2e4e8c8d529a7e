"""The npattn command: check (the gradient audit), demo, bench."""

import argparse
import importlib.util
import io
import json
import os
import re
import subprocess
import sys
import types

import numpy as np
import pytest

import npattn
from npattn.tools import audit, cli
from npattn.tools import demo as demo_mod
from npattn import attention as A
from npattn import functional as F
from npattn.backend import namespace

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the project: docs, examples
# the folder holding the npattn under test (the project, or site-packages when installed),
# put on a child process's path so that it imports the same npattn (CI's second stage sets
# PYTHONSAFEPATH, so that a child's current folder, the checkout, does not come before it)
IMPORT_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(npattn.__file__)))


def _env():
    env = dict(os.environ)
    env["PYTHONPATH"] = IMPORT_ROOT + os.pathsep + env.get("PYTHONPATH", "")
    return env


def _has_matplotlib():
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


# ------------------------------------------------------------------ check


def test_python_m_npattn_check_passes_and_prints_table():
    proc = subprocess.run(
        [sys.executable, "-m", "npattn", "check"], capture_output=True, text=True, env=_env(),
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = proc.stdout
    assert "max abs err" in out and "max rel err" in out
    checks = audit.panel("numpy")
    for c in checks:
        assert c.name in out
    assert f"passed over {len(checks)} configurations (numpy, float64" in out
    assert "FAIL" not in out
    assert "%|" not in proc.stderr  # no progress bar into a pipe


def test_check_rows_cover_the_panel(capsys):
    assert cli.main(["check", "--json", "--no-progress"]) == 0
    res = json.loads(capsys.readouterr().out)
    assert res["ok"] and res["n_failed"] == 0 and res["dtype"] == "float64"
    rows = res["rows"]
    assert res["n_checked"] == len(rows)
    configs = {r["config"] for r in rows}
    assert configs == {c.name for c in audit.panel("numpy")}
    tensors = {r["tensor"] for r in rows}
    # inputs of every primitive, the module's inputs and all eight parameters, and dmask
    for name in ("x", "w", "b", "q", "k", "v", "mask", "query", "key", "value", "x (q=k=v)",
                 "w_q", "w_k", "w_v", "w_o", "b_q", "b_k", "b_v", "b_o"):
        assert name in tensors, name
    for r in rows:
        assert r["passed"] and r["max_abs_err"] is not None
        assert r["max_rel_err"] <= res["rtol"]


def _panel_counts(backend, impl):
    """(configurations, rows) of the panel of ``backend`` that run ``impl`` (None: the reference)."""
    xp = namespace(np.zeros(1))
    checks = [c for c in audit.panel(backend) if c.impl == impl]
    rows = 0
    for c in checks:
        args = (xp, xp.float64, np.random.default_rng(0))
        inputs = (c.build(*args) if c.impl is None else c.build(*args, impl=c.impl))[2]
        rows += sum(xp.isdtype(x.dtype, "real floating") for x in inputs)
    return len(checks), rows


def test_the_counts_of_docs_check_md_are_the_panels():
    text = " ".join(open(os.path.join(ROOT, "docs", "check.md")).read().split())
    n_ref, rows_ref = _panel_counts("numpy", None)
    n_blocked, rows_blocked = _panel_counts("numpy", "blocked")
    n_kernel, rows_kernel = _panel_counts("numpy", "numpy")
    n_chunked = _panel_counts("dask", "chunked")[0]
    n_sdpa = sum(c.name.startswith("sdpa") for c in audit.panel("numpy") if c.impl is None)
    n_mha = sum(c.name.startswith("mha") for c in audit.panel("numpy") if c.impl is None)
    n_total, rows_total = n_ref + n_blocked + n_kernel, rows_ref + rows_blocked + rows_kernel
    for phrase in (f"whose first {n_ref} configurations, {rows_ref} rows",
                   f"the {n_sdpa} sdpa and {n_mha} module configurations run again on the blocked",
                   f"({n_ref + n_blocked} configurations, {rows_ref + rows_blocked} rows)",
                   f"and window ones ({n_kernel}) run a third time",
                   f"({n_total} configurations, {rows_total} rows)",
                   f"the {n_chunked - n_mha} sdpa and {n_mha} module configurations run on the chunked",
                   f"{rows_total}/{rows_total} passed over {n_total} configurations (numpy, float64"):
        assert phrase in text, phrase


def test_the_sample_table_of_docs_check_md_has_the_layout_check_prints():
    """Every line of the page's sample (header, rules, rows, summary; "..." stands for rows
    left out) is a line of format_table for the numpy panel's rows, given the sample's
    numbers: the column widths come from the longest configuration and tensor names."""
    text = open(os.path.join(ROOT, "docs", "check.md")).read()
    block = text.split("$ npattn check ", 1)[1].split("\n```", 1)[0]
    sample = [line for line in block.splitlines()[1:] if line != "..."]
    assert len(sample) >= 6, sample  # header, rule, rows, rule, summary
    numbers = {}  # (config, tensor) -> (abs, rel) of the sample's rows
    for line in sample[2:-2]:
        config, tensor, abs_err, rel_err, verdict = re.split(r"  +", line)
        numbers[config, tensor] = (float(abs_err), float(rel_err))
    xp = namespace(np.zeros(1))
    rows = []
    for c in audit.panel("numpy"):
        args = (xp, xp.float64, np.random.default_rng(0))
        _, _, inputs, names = c.build(*args) if c.impl is None else c.build(*args, impl=c.impl)
        for x, name in zip(inputs, names):
            if xp.isdtype(x.dtype, "real floating"):
                rows.append(audit.Row(c.name, name, *numbers.pop((c.name, name), (0.0, 0.0)), True))
    assert not numbers, f"sample rows that are not in the panel: {sorted(numbers)}"
    seconds = float(re.search(r" in ([0-9.]+)s: ", sample[-1]).group(1))
    table = audit.format_table(audit.AuditResult("numpy", "float64", 1e-6, 1e-12, rows, seconds))
    lines = table.splitlines()
    assert sample[:2] == lines[:2] and sample[-2:] == lines[-2:]
    for line in sample[2:-2]:
        assert line in lines, (line, lines[0])


def test_check_float32(capsys):
    assert cli.main(["check", "--dtype", "float32", "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert "(numpy, float32, rtol=0.0001" in out


def test_audit_on_every_backend(backend):
    """A part of the panel (primitives, module, layers and models) on each backend, in float32."""
    checks = audit.panel()[::4]
    assert {c.kind for c in checks} == {"primitive", "module", "layer", "model"}
    result = audit.run_audit(backend, "float32", checks=checks)
    assert result.ok, audit.format_table(result)


def _zeros_softmax_backward(dp, cache, *, dlse=None):
    return dp * 0.0, None, None


def _linear_backward_off_by_a_bit(dy, cache):
    dx, dw, db = _ORIG["linear_backward"](dy, cache)
    return dx, dw * 1.001, db


def _dropout_backward_without_scale(dy, cache):
    if cache.keep is None:
        return dy
    return namespace(dy).where(cache.keep, dy, 0.0)


def _sdpa_backward_wrong_dmask(dout, cache, *, dlse=None):
    g = _ORIG["sdpa_backward"](dout, cache, dlse=dlse)
    return g._replace(dmask=None if g.dmask is None else -g.dmask)


_ORIG = {name: getattr(F, name) for name in ("linear_backward", "sdpa_backward")}


@pytest.mark.parametrize(
    "name, broken, must_fail",
    [
        ("masked_softmax_backward", _zeros_softmax_backward, ["masked_softmax", "sdpa", "mha"]),
        ("linear_backward", _linear_backward_off_by_a_bit, ["linear, bias", "mha"]),
        ("dropout_backward", _dropout_backward_without_scale, ["dropout", "p=0.25", "p=0.2"]),
        ("sdpa_backward", _sdpa_backward_wrong_dmask, ["sdpa, float mask", "sdpa, causal + float"]),
    ],
)
def test_broken_backward_fails_the_audit(monkeypatch, capsys, name, broken, must_fail):
    monkeypatch.setattr(F, name, broken)
    assert cli.main(["check", "--no-progress"]) == 1
    out = capsys.readouterr().out
    assert "FAILED" in out.splitlines()[-1]
    failed = [line for line in out.splitlines() if line.rstrip().endswith("FAIL")]
    for key in must_fail:
        assert any(key in line for line in failed), (key, out)


def test_a_tensor_the_configuration_does_not_exercise_fails_the_audit():
    """A mask that leaves each row one key makes the softmax constant: its gradient is 0 on
    both sides, which a backward returning zeros would match; the row fails and says why."""
    from npattn.backend import resolve_backend
    from npattn.tools import audit

    def build(xp, dtype, rng):
        x = xp.asarray(rng.standard_normal((2, 3, 4)), dtype=dtype)  # [B, Lq, Lk]
        keep = np.zeros((2, 3, 4), dtype=bool)
        keep[..., 1] = True  # one key per row
        return (F.masked_softmax_forward, F.masked_softmax_backward, [x, xp.asarray(keep)],
                ["x", "mask"])

    xp = resolve_backend("numpy")
    (row,) = audit.run_check(audit.Check("one key per row", "primitive", build), xp, "float64")
    assert row.tensor == "x" and not row.passed
    assert "0 both ways" in row.error
    # the same mask with two keys per row is a real check, and passes
    def build2(xp, dtype, rng):
        fwd, bwd, (x, _), names = build(xp, dtype, rng)
        keep = np.zeros((2, 3, 4), dtype=bool)
        keep[..., 1:3] = True
        return fwd, bwd, [x, xp.asarray(keep)], names

    (row2,) = audit.run_check(audit.Check("two keys per row", "primitive", build2), xp, "float64")
    assert row2.passed and row2.error is None and row2.max_abs_err < 1e-8


def test_crashing_backward_is_reported_not_raised(monkeypatch, capsys):
    def boom(dout, cache):
        raise RuntimeError("no backward today")

    monkeypatch.setattr(F, "split_heads_backward", boom)
    assert cli.main(["check", "--json", "--no-progress"]) == 1
    captured = capsys.readouterr()
    res = json.loads(captured.out)
    bad = [r for r in res["rows"] if not r["passed"]]
    assert any("no backward today" in (r["error"] or "") for r in bad)
    assert all(r["max_abs_err"] is None for r in bad if r["error"])
    # the verdict fields agree with the rows, and the summary goes to stderr
    assert res["ok"] is False and res["n_failed"] == len(bad) > 0
    assert f"{len(bad)} FAILED" in captured.err


def _linear_check():
    return next(c for c in audit.panel() if c.name == "linear, bias")


@pytest.mark.parametrize("dtype, off", [("float64", 3e-6), ("float32", 3e-4)])
def test_a_backward_off_by_three_times_the_tolerance_fails(monkeypatch, dtype, off):
    """dw off by a factor 1 + 3 rtol fails: float64 central differences are good to about
    1e-9 relative and float32 round-off through one matmul is about 1e-7, so the tolerance
    (1e-6 in float64, 1e-4 in float32, docs/check.md) is all the room a backward gets."""
    xp = namespace(np.zeros(1))
    rows = {r.tensor: r for r in audit.run_check(_linear_check(), xp, dtype)}
    assert all(r.passed for r in rows.values()), rows

    def off_dw(dy, cache):
        dx, dw, db = _ORIG["linear_backward"](dy, cache)
        return dx, dw * (1.0 + off), db

    monkeypatch.setattr(F, "linear_backward", off_dw)
    rows = {r.tensor: r for r in audit.run_check(_linear_check(), xp, dtype)}
    assert not rows["w"].passed and rows["w"].max_rel_err > 2 * off / 3, rows["w"]
    assert rows["x"].passed and rows["b"].passed


def _documented_tolerances():
    """{dtype: (rtol, atol)} of the table in docs/check.md."""
    text = open(os.path.join(ROOT, "docs", "check.md"), encoding="utf-8").read()
    rows = re.findall(r"^\| (float64|float32) \| ([0-9.e+-]+) \| ([0-9.e+-]+) \|", text, re.M)
    assert len(rows) == 2, rows
    return {dtype: (float(rtol), float(atol)) for dtype, rtol, atol in rows}


@pytest.mark.parametrize("dtype", ["float64", "float32"])
def test_a_row_passes_within_the_documented_rtol_and_fails_past_it(monkeypatch, dtype):
    """docs/check.md's rtol is the bound itself: dw off by a factor 1 + rtol / 2 passes and by
    1 + 3 rtol / 2 fails (float64 differences are good to about 1e-9 relative and float32
    round-off through one matmul is about 1e-7, far inside rtol / 2). A comparison against a
    multiple of rtol, or a TOLERANCES entry other than the page's, would pass both."""
    rtol, atol = _documented_tolerances()[dtype]
    assert audit.TOLERANCES[dtype] == (rtol, atol)
    xp = namespace(np.zeros(1))
    for factor, passes in ((0.5, True), (1.5, False)):
        def off_dw(dy, cache):
            dx, dw, db = _ORIG["linear_backward"](dy, cache)
            return dx, dw * (1.0 + factor * rtol), db

        monkeypatch.setattr(F, "linear_backward", off_dw)
        rows = {r.tensor: r for r in audit.run_check(_linear_check(), xp, dtype)}
        assert rows["w"].passed is passes, (factor, rows["w"])
        assert rows["w"].max_rel_err == pytest.approx(factor * rtol, rel=0.1), (factor, rows["w"])
        assert rows["x"].passed and rows["b"].passed


def _two_scales(wrong_small=0.0, small_grad=None):
    """A check of f(x, y) = [x, 1e-3 y]: y's gradient is 1e-3 of x's. ``wrong_small`` is added
    to y's gradient; ``small_grad`` replaces it (a function of it, or "left out": the backward
    returns dx alone)."""

    def build(xp, dtype, rng):
        x = xp.asarray(rng.standard_normal((3, 4)), dtype=dtype)
        y = xp.asarray(rng.standard_normal((3, 4)), dtype=dtype)

        def forward(x, y):
            return xp.concat([x, 1e-3 * y], axis=0), None

        def backward(dout, cache):
            dy = 1e-3 * dout[3:] + wrong_small
            if small_grad == "left out":
                return (dout[:3],)
            return dout[:3], (dy if small_grad is None else small_grad(dy))

        return forward, backward, [x, y], ["x", "y"]

    return audit.Check("two scales", "primitive", build)


@pytest.mark.parametrize("dtype, wrong", [("float64", 1e-7), ("float32", 1e-5)])
def test_the_floor_is_a_hundredth_of_the_configuration_s_largest_gradient(dtype, wrong):
    """y's gradient is about 1e-3 of the largest one S (about 2 here); an error ``wrong`` in
    it, 1e-4 (float64) or 1e-2 (float32) of y's own size, is judged against rtol times the
    floor 1e-2 S (module docstring), 2e-8 or 2e-6, and fails; a floor of S, or float32's
    atol raised to 1e-3, would have passed it."""
    xp = namespace(np.zeros(1))
    rows = {r.tensor: r for r in audit.run_check(_two_scales(), xp, dtype)}
    assert rows["x"].passed and rows["y"].passed, rows
    rows = {r.tensor: r for r in audit.run_check(_two_scales(wrong), xp, dtype)}
    assert rows["x"].passed and not rows["y"].passed, rows
    assert rows["y"].max_abs_err == pytest.approx(wrong, rel=1e-2)


@pytest.mark.parametrize("broken, error", [
    (lambda dy: dy * np.nan, None),
    (lambda dy: None, "backward returned None"),
    ("left out", "backward returned None"),
    (lambda dy: dy[:1], "gradient shape (1, 4), expected (3, 4)"),
    # as many entries as the input, laid out otherwise: an axis of 1 not summed away, a transpose
    (lambda dy: dy[None], "gradient shape (1, 3, 4), expected (3, 4)"),
    (lambda dy: dy.T, "gradient shape (4, 3), expected (3, 4)"),
])
def test_a_nan_missing_or_misshapen_gradient_fails(broken, error):
    xp = namespace(np.zeros(1))
    rows = {r.tensor: r for r in audit.run_check(_two_scales(small_grad=broken), xp, "float64")}
    assert rows["x"].passed and not rows["y"].passed, rows
    assert rows["y"].error == error
    if error is not None:  # the numbers are not said, as for a crash
        assert np.isnan(rows["y"].max_abs_err)


def test_a_backward_right_only_for_a_constant_upstream_gradient_fails(monkeypatch):
    """dx from each row's mean of dy in place of dy agrees with the true dx when dy is
    constant along the row (all ones): the audit's dout is random (never all ones)."""

    def mean_dy(dy, cache):
        dx, dw, db = _ORIG["linear_backward"](dy, cache)
        mean = np.mean(dy, axis=-1, keepdims=True) * np.ones_like(dy)
        return _ORIG["linear_backward"](mean, cache)[0], dw, db

    monkeypatch.setattr(F, "linear_backward", mean_dy)
    xp = namespace(np.zeros(1))
    rows = {r.tensor: r for r in audit.run_check(_linear_check(), xp, "float64")}
    assert not rows["x"].passed and rows["w"].passed and rows["b"].passed, rows


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_the_audit_runs_the_backward_in_its_dtype(monkeypatch, dtype):
    """--dtype float32 audits the backward computed in float32 (the differences alone are
    float64): the backward receives dout and its cache in the audited dtype."""
    seen = []

    def recording(dy, cache):
        seen.append((dy.dtype, cache.x.dtype, cache.w.dtype))
        return _ORIG["linear_backward"](dy, cache)

    monkeypatch.setattr(F, "linear_backward", recording)
    result = audit.run_audit("numpy", dtype, checks=[_linear_check()])
    assert result.ok and result.dtype == dtype
    assert seen == [(np.dtype(dtype),) * 3]


def test_an_audit_of_no_configuration_is_not_a_pass():
    """An audit that checked nothing is not ok, and its table says so (format_table raised a
    TypeError on no rows, and the summary said all gradients match)."""
    result = audit.run_audit("numpy", "float64", checks=[])
    assert not result.ok and result.to_dict()["ok"] is False
    assert result.to_dict()["n_checked"] == 0
    table = audit.format_table(result)
    assert table.splitlines()[0].split() == ["configuration", "tensor", "max", "abs", "err",
                                             "max", "rel", "err", "result"]
    assert table.endswith(": nothing was checked") and "match" not in table
    assert "0/0 passed over 0 configurations" in audit.summary_line(result)


def test_run_check_draws_from_its_seed():
    xp = namespace(np.zeros(1))
    errs = [[r.max_abs_err for r in audit.run_check(_linear_check(), xp, "float64", seed=s)]
            for s in (0, 1)]
    assert errs[0] != errs[1]


def test_a_configuration_named_for_fully_masked_rows_has_them():
    """The guarded case of every masked softmax (a row with nothing to attend gives zeros and
    zero gradients) is in the panel where its name says so: each configuration that names a
    fully masked row, or an empty sequence, and takes its mask as an input has a row of the
    mask that attends nothing (all False, or all -inf)."""
    xp = namespace(np.zeros(1))
    named = 0
    for c in audit.panel("numpy"):
        if not ("fully masked row" in c.name or "empty sequence" in c.name):
            continue
        args = (xp, xp.float64, np.random.default_rng(0))
        fwd, bwd, inputs, names = c.build(*args) if c.impl is None else c.build(*args, impl=c.impl)
        if "mask" not in names:  # the module's and the sink's masks are not inputs
            continue
        mask = np.asarray(inputs[names.index("mask")])
        nothing = ~mask if mask.dtype == bool else np.isneginf(mask)
        assert np.all(nothing, axis=-1).any(), c.name
        named += 1
    assert named >= 5


def test_each_implementation_s_configuration_runs_on_it_across_blocks(monkeypatch):
    """A configuration marked [blocked] or [numpy kernel] runs sdpa (the module: its attention)
    on that implementation, in the forward and in the differences, the blocked one in blocks
    that split both lengths (the blocked steps across block edges are what it audits); the
    reference configurations on the reference."""
    seen = []
    original = A.sdpa_forward

    def recording(q, k, v, **kw):
        seen.append((kw.get("impl"), kw.get("block_q"), kw.get("block_k"), q.shape[-2],
                     k.shape[-2]))
        return original(q, k, v, **kw)

    def one_evaluation(f, inputs, dout, *, eps, wrt):  # the differences' own calls: one here
        f(*inputs)
        return [np.zeros(tuple(x.shape)) if i in wrt else None for i, x in enumerate(inputs)]

    monkeypatch.setattr(A, "sdpa_forward", recording)
    monkeypatch.setattr(audit, "numerical_vjp", one_evaluation)
    xp = namespace(np.zeros(1))
    checks = audit.panel("numpy")
    assert {c.impl for c in checks} == {None, "blocked", "numpy"}
    for c in checks:
        if not c.name.startswith(("sdpa", "mha")):
            continue
        seen.clear()
        rows = audit.run_check(c, xp, "float64")
        assert rows and all(r.error is None for r in rows), rows
        if c.impl is None and c.kind == "primitive":  # functional's reference, not the dispatcher
            assert seen == [], c.name
            continue
        assert len(seen) > 1 and {s[0] for s in seen} == {c.impl or "reference"}, c.name
        if c.impl == "blocked":
            assert all(bq < Lq and bk < Lk for _, bq, bk, Lq, Lk in seen), (c.name, seen[0])


def test_check_on_jax_runs_in_x64_and_puts_it_back(monkeypatch, capsys):
    """`npattn check --backend jax`: the finite differences need float64, so the audit runs
    with JAX's x64 mode on (float64 inputs stay float64) and puts the mode back. A part of
    the panel, the reference and the blocked implementation."""
    jax = pytest.importorskip("jax", reason="the jax backend needs JAX: pip install '.[jax]'")
    from npattn.tools import audit

    full = audit.panel("jax")
    part = [c for c in full if c.name.startswith("sdpa, float mask")]
    assert any("[blocked]" in c.name for c in part) and len(part) >= 2
    monkeypatch.setattr(audit, "panel", lambda backend=None: part)
    previous = jax.config.jax_enable_x64
    jax.config.update("jax_enable_x64", False)
    try:
        assert cli.main(["check", "--backend", "jax", "--json", "--no-progress"]) == 0
        assert jax.config.jax_enable_x64 is False
    finally:
        jax.config.update("jax_enable_x64", previous)
    res = json.loads(capsys.readouterr().out)
    assert res["backend"] == "jax" and res["rows"] and all(r["passed"] for r in res["rows"])
    assert {r["config"] for r in res["rows"]} == {c.name for c in part}


def test_no_command_prints_the_help_and_exits_2(capsys):
    assert cli.main([]) == 2
    out = capsys.readouterr().out
    assert out.startswith("usage: npattn") and "{check,demo,bench,verify}" in out


def test_threads_reach_the_blas_while_the_audit_runs(monkeypatch, capsys):
    """--threads N limits BLAS to N threads while the checks run (the audit is replaced by one
    that reads the limit), and the library's own setting is back afterwards."""
    threadpoolctl = pytest.importorskip("threadpoolctl")

    def blas_threads():
        return [p["num_threads"] for p in threadpoolctl.threadpool_info()
                if p["user_api"] == "blas"]

    if not blas_threads():
        pytest.skip("threadpoolctl finds no BLAS here")
    before = blas_threads()
    seen = []

    def reading_audit(backend, dtype, *, progress=None, checks=None):
        seen.append(blas_threads())
        rows = [audit.Row("c", "x", 0.0, 0.0, True)]
        return audit.AuditResult(backend, dtype, 1e-6, 1e-12, rows, 0.0)

    monkeypatch.setattr(audit, "run_audit", reading_audit)
    assert cli.main(["check", "--threads", "3", "--no-progress"]) == 0
    assert seen and all(n == 3 for n in seen[0])
    assert blas_threads() == before
    assert "1/1 passed" in capsys.readouterr().out


def test_the_most_threads_are_taken_and_one_more_is_refused(capsys):
    """The bound of --threads is in: 4096 (the help's [1, 4096]) parses, 4097 exits 2."""
    parse = cli.build_parser().parse_args
    assert parse(["check", "--threads", "4096"]).threads == 4096
    assert parse(["demo", "--threads", "4096"]).threads == 4096
    with pytest.raises(SystemExit) as exc:
        parse(["check", "--threads", "4097"])
    assert exc.value.code == 2
    assert "expected a number of threads in [1, 4096], got '4097'" in capsys.readouterr().err


def test_a_failed_check_prints_its_summary_once(monkeypatch, capsys):
    """A failed audit prints its summary line once: as the table's last line, or with --json
    on standard error (standard output holding the JSON alone)."""
    def failing_audit(backend, dtype, *, progress=None, checks=None):
        rows = [audit.Row("c", "x", 1.0, 1.0, False), audit.Row("c", "w", 0.0, 0.0, True)]
        return audit.AuditResult(backend, dtype, 1e-6, 1e-12, rows, 0.0)

    monkeypatch.setattr(audit, "run_audit", failing_audit)
    assert cli.main(["check", "--no-progress"]) == 1
    captured = capsys.readouterr()
    assert captured.out.splitlines()[-1].startswith("1/2 passed") and captured.err == ""
    assert cli.main(["check", "--json", "--no-progress"]) == 1
    captured = capsys.readouterr()
    assert json.loads(captured.out)["n_failed"] == 1
    assert captured.err.startswith("1/2 passed") and captured.err.count("\n") == 1


def test_unavailable_backend_exits_2(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "cupy", None)  # import cupy -> ImportError
    assert cli.main(["check", "--backend", "cupy", "--no-progress"]) == 2
    assert "backend 'cupy' is not usable" in capsys.readouterr().err


def test_bad_option_exits_2():
    with pytest.raises(SystemExit) as exc:
        cli.main(["check", "--dtype", "float16"])
    assert exc.value.code == 2


# ------------------------------------------------------------------- demo


def _demo_args(tmp_path, *extra):
    return ["demo", "--steps", "3", "--seq-len", "4", "--d-model", "8", "--batch", "4",
            "--no-progress", "--out", str(tmp_path / "out"), *extra]


def test_demo_writes_heatmaps_and_compares_heads(tmp_path, capsys):
    assert cli.main(_demo_args(tmp_path, "--heads", "1,2")) == 0
    out = capsys.readouterr()
    lines = out.out.splitlines()
    header = next(i for i, line in enumerate(lines) if line.split()[:1] == ["heads"])
    table = lines[header + 1:]
    assert [row.split()[0] for row in table] == ["1", "2"]
    assert [row.split()[1] for row in table] == ["8", "4"]  # head dims at d_model 8
    if _has_matplotlib():
        for H in (1, 2):
            d = tmp_path / "out" / f"heads{H}"
            pngs = sorted(p.name for p in d.iterdir())
            assert pngs == sorted([f"attention_head{h}.png" for h in range(H)]
                                  + ["attention_heads.png"])
            for p in d.iterdir():
                assert p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        assert str(tmp_path / "out") in out.out
    else:
        assert "matplotlib is not installed" in out.err


def test_demo_without_matplotlib_says_so(tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    assert cli.main(_demo_args(tmp_path)) == 0
    assert "matplotlib is not installed" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


class _FakeTerminal(io.StringIO):
    def isatty(self):
        return True


def test_demo_progress_bar_shows_the_training_batch_loss(tmp_path, capsys, monkeypatch):
    term = _FakeTerminal()
    monkeypatch.setattr(sys, "stderr", term)
    args = [a for a in _demo_args(tmp_path, "--no-plots") if a != "--no-progress"]
    assert cli.main(args) == 0
    err = term.getvalue()
    assert "batch loss" in err and "batch acc" in err and "3/3" in err
    summary = [line for line in capsys.readouterr().out.splitlines() if line.startswith("heads=")]
    assert len(summary) == 1 and "held-out token accuracy" in summary[0]
    assert "held-out loss" in summary[0]


def test_demo_progress_bar_is_silent_into_a_pipe(tmp_path, capsys):
    args = [a for a in _demo_args(tmp_path, "--no-plots") if a != "--no-progress"]
    args = args[:args.index("--out")] + args[args.index("--out") + 2:]  # --out: a warning
    assert cli.main(args) == 0
    assert capsys.readouterr().err == ""


def test_demo_out_with_no_plots_is_said_to_be_unused(tmp_path, capsys):
    """--no-plots with an --out that cannot be written trained and exited 0 in silence (with
    plots such an --out is refused before training, exit 2): --task reverse then writes nothing
    there, so the run goes on with a warning that --out is unused; the folder is not made."""
    out = tmp_path / "afile"
    out.write_text("")
    args = ["demo", "--steps", "1", "--seq-len", "2", "--d-model", "4", "--heads", "1",
            "--batch", "1", "--no-progress", "--no-plots", "--out", str(out / "sub")]
    assert cli.main(args) == 0
    err = capsys.readouterr().err
    assert f"npattn demo: warning: --out {str(out / 'sub')!r} is unused: with --no-plots" in err
    assert out.read_text() == ""
    # without --out nothing is said
    assert cli.main(args[:-2]) == 0
    assert capsys.readouterr().err == ""


@pytest.mark.parametrize("heads, message", [
    ("3", "expected divisors of --d-model 8, got '3', where 3 does not divide it"),
    ("2,3,4,6", "expected divisors of --d-model 8, got '2,3,4,6', where 3, 6 do not divide it"),
    ("0", "expected positive integers, got '0'"),
    ("2,-1", "expected positive integers, got '2,-1'"),
    ("a,b", "expected integers separated by commas, got 'a,b'"),
    # trained twice, the second writing over the first's heads2 pictures
    ("2,1,2", "expected each head count once, got 2 more than once in '2,1,2'"),
    (",", "expected integers separated by commas, got ','"),
    ("2,", "expected integers separated by commas, got '2,'"),
    ("1,,2", "expected integers separated by commas, got '1,,2'"),
    ("", "expected integers separated by commas, got ''"),
])
def test_demo_rejects_bad_heads(heads, message, tmp_path, capsys):
    """The error names --heads, what it takes and the value given (the head counts that do
    not divide --d-model, the one given twice)."""
    with pytest.raises(SystemExit) as exc:
        cli.main(_demo_args(tmp_path, "--heads", heads))
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("usage: npattn demo")  # the demo's usage, not npattn's
    assert err.endswith(f"npattn demo: error: --heads: {message}\n"), err


@pytest.mark.parametrize(
    "option, value",
    [("--lr", "-1"), ("--lr", "0"), ("--lr", "nan"), ("--lr", "inf"), ("--lr", "x"),
     ("--steps", "0"), ("--steps", "-3"), ("--seq-len", "0"), ("--d-model", "-8"),
     ("--batch", "0"), ("--seed", "-1"), ("--threads", "0"), ("--steps", "x"), ("--seed", "1.5")],
)
def test_demo_rejects_non_positive_or_non_finite_numbers(option, value, tmp_path, capsys,
                                                         monkeypatch):
    monkeypatch.setattr(demo_mod, "train", _must_not_train)
    with pytest.raises(SystemExit) as exc:
        cli.main(_demo_args(tmp_path) + [option, value])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "usage: npattn demo" in err
    assert f"argument {option}" in err and repr(value) in err


@pytest.mark.parametrize("extra, message", [
    (["--seq-len", "1"],
     "--seq-len: expected at least 2 with --task gpt (a context of 2 characters or more), got 1"),
    (["--heads", "1,2"], "--heads: --task gpt trains one model, expected one head count, got 1,2"),
])
def test_a_gpt_demo_it_cannot_train_is_refused_naming_the_value(extra, message, tmp_path, capsys,
                                                                monkeypatch):
    from npattn.tools import demo_gpt

    monkeypatch.setattr(demo_gpt, "train", _must_not_train)
    out = str(tmp_path / "g")
    with pytest.raises(SystemExit) as exc:
        cli.main(["demo", "--task", "gpt", "--no-progress", "--no-plots", "--out", out, *extra])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("usage: npattn demo") and err.endswith(f"npattn demo: error: {message}\n"), err
    assert not (tmp_path / "g").exists()


def test_check_option_errors_print_the_check_usage(capsys):
    with pytest.raises(SystemExit) as exc:
        cli.main(["check", "--threads", "-2"])
    assert exc.value.code == 2
    assert "usage: npattn check" in capsys.readouterr().err


@pytest.mark.parametrize("command", ["check", "demo"])
def test_an_unknown_option_is_told_by_its_subcommand(command, capsys):
    """A misspelt flag prints the subcommand's usage (which lists its flags), not npattn's."""
    with pytest.raises(SystemExit) as exc:
        cli.main([command, "--jsn"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert f"usage: npattn {command}" in err
    assert f"npattn {command}: error: unrecognized arguments: --jsn" in err


def _must_not_train(*args, **kwargs):
    raise AssertionError("the demo trained before its arguments were checked")


def _unwritable_outs(tmp_path):
    a_file = tmp_path / "a_file.png"
    a_file.write_bytes(b"not a folder")
    outs = [str(a_file), str(a_file / "sub")]
    if os.path.isdir("/proc/self"):
        outs.append("/proc/x")
    return outs


@pytest.mark.skipif(not _has_matplotlib(), reason="--out is used only with matplotlib")
def test_demo_checks_out_before_training(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(demo_mod, "train", _must_not_train)
    for out in _unwritable_outs(tmp_path):
        args = _demo_args(tmp_path)
        args[args.index("--out") + 1] = out
        assert cli.main(args) == 2, out
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "Traceback" not in err, err  # one line
        assert err.startswith("npattn demo: --out ") and repr(out) in err, err
        if out == str(tmp_path / "a_file.png"):  # what is wrong with it, not only that it is
            assert "expected a folder for the heatmaps, got an existing file" in err, err
    assert (tmp_path / "a_file.png").read_bytes() == b"not a folder"


@pytest.mark.parametrize("task, extra, what", [
    ("reverse", [], "the heatmaps"),
    ("digits", ["--epochs", "1"], "the pictures"),
    ("gpt", ["--steps", "1"], "samples.txt and the loss curve"),
    ("gpt", ["--steps", "1", "--no-plots"], "samples.txt"),
])
def test_demo_out_errors_name_what_the_task_writes(task, extra, what, tmp_path, capsys, monkeypatch):
    """gpt writes samples.txt (and its loss curve), digits its pictures: a message about
    "the heatmaps" there sent the reader to look for an option of another task."""
    from npattn.tools import demo_digits, demo_gpt

    if "--no-plots" not in extra and not _has_matplotlib():
        pytest.skip("--out is used for pictures only with matplotlib")
    if task == "digits" and importlib.util.find_spec("sklearn") is None:
        pytest.skip("--task digits needs scikit-learn")
    for module in (demo_mod, demo_digits, demo_gpt):
        monkeypatch.setattr(module, "train", _must_not_train)
    a_file = tmp_path / "a_file"
    a_file.write_bytes(b"not a folder")
    for out, said in ((a_file, f"expected a folder for {what}, got an existing file"),
                      (a_file / "sub", f"cannot write {what} there")):
        assert cli.main(["demo", "--task", task, *extra, "--no-progress", "--out", str(out)]) == 2
        err = capsys.readouterr().err
        assert err == f"npattn demo: --out {str(out)!r}: " + err.split(": ", 2)[2], err
        assert said in err and err.count("\n") == 1, err


class _Stop(Exception):
    pass


def test_demo_hands_its_options_to_the_reverse_task(tmp_path, monkeypatch, capsys):
    """--lr, --seed and --pos reach the config and the heatmaps' sequence; "reached 95 %" is said
    of an accuracy of 0.95 and not of 0.949."""
    from npattn.tools.demo import DemoConfig, ReverseModel, TrainResult

    seen, drawn = [], []
    accuracies = iter([0.949, 0.95])

    def train(cfg, **kwargs):
        seen.append(cfg)
        return ReverseModel(DemoConfig(seq_len=4, d_model=8, n_head=1)), TrainResult(
            cfg.n_head, 0.5, next(accuracies), 1.0, 10, cfg.steps)

    def save_heatmaps(model, out, *, seed):
        drawn.append(seed)
        return []

    monkeypatch.setattr(demo_mod, "train", train)
    monkeypatch.setattr(demo_mod, "save_heatmaps", save_heatmaps)
    argv = _demo_args(tmp_path, "--lr", "0.05", "--seed", "3", "--heads", "1,2", "--pos", "learned")
    if not _has_matplotlib():
        argv.append("--no-plots")
    assert cli.main(argv) == 0
    assert [(c.lr, c.seed, c.n_head, c.pos) for c in seen] == [(0.05, 3, 1, "learned"),
                                                               (0.05, 3, 2, "learned")]
    assert drawn == ([3, 3] if _has_matplotlib() else [])
    out = [line for line in capsys.readouterr().out.splitlines() if line.startswith("heads=")]
    assert "(below 95 %)" in out[0] and "(reached 95 %)" in out[1], out


def test_demo_with_one_head_count_draws_into_out_itself(tmp_path, monkeypatch):
    """With one head count the heatmaps go into --out itself; with several, each count has its
    own heads{H} folder under it."""
    from npattn.tools.demo import DemoConfig, ReverseModel, TrainResult

    drawn = []

    def train(cfg, **kwargs):
        return ReverseModel(DemoConfig(seq_len=4, d_model=8, n_head=1)), TrainResult(
            cfg.n_head, 0.5, 0.5, 1.0, 10, cfg.steps)

    monkeypatch.setattr(demo_mod, "have_matplotlib", lambda: True)
    monkeypatch.setattr(demo_mod, "train", train)
    monkeypatch.setattr(demo_mod, "save_heatmaps", lambda model, out, *, seed: drawn.append(out) or [])
    out = str(tmp_path / "out")
    assert cli.main(_demo_args(tmp_path, "--heads", "2")) == 0
    assert cli.main(_demo_args(tmp_path, "--heads", "1,2")) == 0
    assert drawn == [out, os.path.join(out, "heads1"), os.path.join(out, "heads2")]


def test_demo_hands_its_options_to_the_digits_task(monkeypatch):
    """--lr, --dropout and --seed reach the config, and --seed the validation split."""
    from npattn.tools import demo_digits as dd

    split, seen = [], []
    images = np.random.default_rng(0).random((4, 8, 8))
    x = dd.image_patches(images, 2)
    fake = dd.DigitsData(x, np.arange(4), x, np.arange(4), images, 2)

    def load(patch, val_fraction, seed):
        split.append(seed)
        return fake

    def train(cfg, data, **kwargs):
        seen.append(cfg)
        raise _Stop

    monkeypatch.setattr(dd, "load_digits_data", load)
    monkeypatch.setattr(dd, "train", train)
    with pytest.raises(_Stop):
        cli.main(["demo", "--task", "digits", "--lr", "0.05", "--dropout", "0.3", "--seed", "3",
                  "--no-plots", "--no-progress"])
    assert split == [3]
    assert [(c.lr, c.dropout, c.seed) for c in seen] == [(0.05, 0.3, 3)]
    # the lower bounds are in: --dropout 0 (not replaced by the task's 0.1) and --seed 0
    with pytest.raises(_Stop):
        cli.main(["demo", "--task", "digits", "--dropout", "0", "--seed", "0", "--no-plots",
                  "--no-progress"])
    assert split == [3, 0]
    assert (seen[-1].dropout, seen[-1].seed) == (0.0, 0)


def test_demo_hands_its_options_to_the_gpt_task(tmp_path, monkeypatch, capsys):
    """--lr, --dropout and --seed reach the config, and --seed the samples (their other
    settings are the heading's, tests/test_demo_gpt.py). --out with --no-plots is no warning
    for gpt, which writes its samples.txt there."""
    from npattn.gpt import GPT
    from npattn.tools import demo_gpt as dg

    seen, sampled = [], []

    def train(cfg, **kwargs):
        seen.append(cfg)
        codec = dg.CharCodec("abc")
        hist = dg.GPTHistory(train_loss=[1.0], val_steps=[1], val_loss=[1.0], vocab=3)
        return GPT(3, 4, 8, 1, 2, seed=0), codec, hist

    def generate_samples(model, codec, *, seed, **settings):
        sampled.append(seed)
        return [("a", "abc")]

    monkeypatch.setattr(dg, "train", train)
    monkeypatch.setattr(dg, "generate_samples", generate_samples)
    assert cli.main(["demo", "--task", "gpt", "--lr", "0.05", "--dropout", "0.3", "--seed", "3",
                     "--no-plots", "--no-progress", "--out", str(tmp_path / "g")]) == 0
    assert [(c.lr, c.dropout, c.seed) for c in seen] == [(0.05, 0.3, 3)]
    assert sampled == [3]
    assert "unused" not in capsys.readouterr().err
    assert (tmp_path / "g" / "samples.txt").read_text(encoding="utf-8").count("abc") == 1


def test_a_gpt_demo_whose_loss_is_not_finite_says_it_diverged(tmp_path, monkeypatch, capsys):
    """A last training loss of NaN is a diverged run even where the weights are still finite:
    exit 1, no samples and no folder."""
    from npattn.gpt import GPT
    from npattn.tools import demo_gpt as dg

    def train(cfg, **kwargs):
        hist = dg.GPTHistory(train_loss=[1.0, float("nan")], val_steps=[1], val_loss=[1.0], vocab=3)
        return GPT(3, 4, 8, 1, 2, seed=0), dg.CharCodec("abc"), hist

    monkeypatch.setattr(dg, "train", train)
    monkeypatch.setattr(dg, "generate_samples", lambda *a, **k: pytest.fail("sampled"))
    out = tmp_path / "g"
    assert cli.main(["demo", "--task", "gpt", "--no-plots", "--no-progress", "--out", str(out)]) == 1
    err = capsys.readouterr().err
    assert "training diverged (last training loss nan, finite parameters)" in err, err
    assert not out.exists()


# ------------------------------------------------------------------ bench


def test_bench_float16_on_array_api_strict_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as exc:
        cli.main(["bench", "--dtype", "float16", "--backend", "array_api_strict",
                  "--shapes", "1x4x4x2", "--no-torch"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "usage: npattn bench" in err and "Traceback" not in err
    assert "--dtype float16: the array_api_strict backend has no float16" in err


def test_bench_missing_module_exits_2(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "npattn.tools.bench", None)
    assert cli.main(["bench", "--anything"]) == 2
    assert "npattn.tools.bench" in capsys.readouterr().err


@pytest.mark.parametrize("model", [["--model", "gpt"], ["--model=gpt"]])
def test_bench_model_in_either_spelling_runs_the_model_benchmark(model, monkeypatch):
    """--model gpt and --model=gpt both go to the model's benchmark (bench_gpt), with every
    argument after "bench"."""
    from npattn.tools import bench_gpt

    seen = []
    monkeypatch.setattr(bench_gpt, "main", lambda argv: seen.append(argv) or 0)
    monkeypatch.setitem(sys.modules, "npattn.tools.bench", None)  # not the kernels' benchmark
    assert cli.main(["bench", *model, "--batch", "2"]) == 0
    assert seen == [[*model, "--batch", "2"]]


def test_bench_missing_a_dependency_of_its_own_is_not_said_to_be_missing(monkeypatch):
    """Only npattn.tools.bench itself missing is "not part of this installation"; a module that
    it imports and that is missing is raised as such, with its name."""
    def import_module(name):
        raise ModuleNotFoundError("No module named 'a_dependency'", name="a_dependency")

    monkeypatch.setattr(cli, "importlib", types.SimpleNamespace(import_module=import_module))
    with pytest.raises(ModuleNotFoundError, match="a_dependency"):
        cli.main(["bench", "--shapes", "1x4x4x2"])


def test_bench_passes_the_remaining_arguments(monkeypatch):
    seen = []
    fake = types.ModuleType("npattn.tools.bench")
    fake.main = lambda argv: seen.append(argv) or 3
    monkeypatch.setitem(sys.modules, "npattn.tools.bench", fake)
    assert cli.main(["bench", "--sizes", "small", "--json"]) == 3
    assert seen == [["--sizes", "small", "--json"]]


@pytest.mark.skipif(importlib.util.find_spec("torch") is None, reason="needs torch")
@pytest.mark.parametrize("threadpoolctl", ["installed", "missing"])
def test_threads_option_limits_and_restores_torch_threads(threadpoolctl, monkeypatch):
    """torch's own pool is put back by blas_threads itself, with threadpoolctl (an optional
    dependency; leaving its limit put torch's count back too, which hid a missing restore)
    or without it."""
    import torch

    if threadpoolctl == "missing":
        monkeypatch.setitem(sys.modules, "threadpoolctl", None)  # import -> ImportError
    before = torch.get_num_threads()
    target = 1 if before != 1 else 2
    with cli.blas_threads(target, "torch"):
        assert torch.get_num_threads() == target
    assert torch.get_num_threads() == before


def test_threads_must_be_positive():
    with pytest.raises(SystemExit) as exc:
        cli.main(["check", "--threads", "0"])
    assert exc.value.code == 2


def test_threads_past_a_c_int_are_a_usage_error(capsys):
    """--threads 99999999999999999999 reached the BLAS call and ended in a ctypes traceback."""
    with pytest.raises(SystemExit) as exc:
        cli.main(["check", "--threads", "99999999999999999999"])
    assert exc.value.code == 2
    assert "--threads: expected a number of threads in [1, 4096]" in capsys.readouterr().err


def test_sizes_past_the_memory_are_a_usage_error_without_a_traceback(monkeypatch, capsys):
    """A MemoryError (here from the GPT step's benchmark, as --seq-len 99999999999 gives) is one
    line and exit 2, not a traceback and exit 1 (which says a check failed)."""
    from npattn.tools import bench_gpt

    def too_big(argv):
        raise MemoryError("Unable to allocate 93.1 TiB")

    monkeypatch.setattr(bench_gpt, "main", too_big)
    assert cli.main(["bench", "--model", "gpt", "--seq-len", "99999999999"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("npattn bench: not enough memory for the sizes asked for") and "93.1 TiB" in err


def test_the_command_starts_without_the_benchmark_module():
    """check, demo and verify run where npattn.tools.bench is missing (its flags' limits
    once came from there, and every command died at import)."""
    code = ("import sys; sys.modules['npattn.tools.bench'] = None\n"
            "from npattn.tools import cli\n"
            "sys.exit(cli.main(['bench', '--shapes', '1x8x8x2']))\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.returncode == 2, proc.stderr
    assert "npattn.tools.bench" in proc.stderr and "Traceback" not in proc.stderr


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # the overflow that makes the NaN
def test_a_gpt_demo_that_diverges_says_so_and_leaves_no_folder(tmp_path, capsys):
    """An lr of 1e300 made NaN weights, and sampling from them ended in a traceback after
    the folder had been made."""
    out = tmp_path / "new" / "gpt"
    assert cli.main(["demo", "--task", "gpt", "--steps", "2", "--lr", "1e300", "--seq-len", "4",
                     "--d-model", "8", "--heads", "1", "--layers", "1", "--batch", "2",
                     "--no-plots", "--no-progress", "--out", str(out)]) == 1
    err = capsys.readouterr().err
    assert "training diverged" in err and "smaller --lr" in err and "Traceback" not in err
    assert not (tmp_path / "new").exists()


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # the overflow that makes the NaN
@pytest.mark.parametrize("task", ["reverse", "digits"])
def test_a_demo_that_diverges_exits_1_and_draws_nothing(task, tmp_path, capsys):
    """The reverse and digits demos finished a run whose loss was NaN with status 0 and drew
    its pictures; as the GPT demo, they say the run diverged and exit 1."""
    if task == "digits":
        pytest.importorskip("sklearn")
    length = ["--steps", "2", "--seq-len", "4"] if task == "reverse" else ["--epochs", "1"]
    out = tmp_path / "new" / task
    assert cli.main(["demo", "--task", task, *length, "--lr", "1e300", "--d-model", "8",
                     "--heads", "2", "--batch", "8", "--no-progress", "--out", str(out)]) == 1
    captured = capsys.readouterr()
    assert "nan" in captured.out  # the run's own line, as printed before
    assert "training diverged (last loss nan)" in captured.err and "smaller --lr" in captured.err
    assert not (tmp_path / "new").exists()


def test_a_setting_the_gpt_demo_refuses_late_is_not_blamed_on_seq_len(tmp_path, capsys, monkeypatch):
    """A ValueError from training was printed as "--seq-len N: ..." whatever setting it named
    (an lr that overflowed to inf read "--seq-len 64: lr: ..."); the message is its own now."""
    from npattn.tools import demo_gpt

    def refuse(*args, **kwargs):
        raise ValueError("lr: expected a finite number >= 0, got inf")

    monkeypatch.setattr(demo_gpt, "train", refuse)
    assert cli.main(["demo", "--task", "gpt", "--steps", "2", "--seq-len", "4", "--d-model", "8",
                     "--heads", "1", "--layers", "1", "--batch", "2", "--no-plots", "--no-progress",
                     "--out", str(tmp_path / "gpt")]) == 2
    err = capsys.readouterr().err
    assert "npattn demo: lr: expected a finite number >= 0, got inf" in err
    assert "--seq-len" not in err and "Traceback" not in err


def test_a_reader_that_goes_away_gives_the_status_of_a_broken_pipe(monkeypatch):
    """`npattn ... | head`: when the pipe's reader is gone the command stops quietly with 141 (a
    process that SIGPIPE ends), not 1, which says a check failed."""
    import os

    from npattn.tools import cli

    kernels = os.path.join(os.path.dirname(__file__), "..", "examples", "verify", "kernels.py")
    r, w = os.pipe()
    os.close(r)  # the reader went away: every write raises BrokenPipeError
    gone = os.fdopen(w, "w", buffering=1)  # line-buffered: the first line's write fails
    monkeypatch.setattr("sys.stdout", gone)
    status = cli.main(["verify", f"{kernels}:attention", "--supports", "all", "--list"])
    assert status == 141
    gone.close()  # its file descriptor now writes to os.devnull


# ------------------------------------------------------------------ --help of every parser

#: ``npattn`` and each command (or mode of bench) whose --help a newcomer reads, with the
#: docs pages that list its options.
HELP_PAGES = {
    "npattn": ((), ()),
    "check": (("check",), ("docs/check.md",)),
    "demo": (("demo",), ("docs/demo.md", "docs/digits.md", "docs/gpt.md")),
    "bench": (("bench",), ("docs/performance.md",)),
    "bench-dask": (("bench", "--backend", "dask"), ("docs/dask.md",)),
    "bench-gpt": (("bench", "--model", "gpt"), ("docs/gpt.md",)),
}


class _Parsed(Exception):
    pass


def _parser_of(argv, monkeypatch):
    """The argparse parser that reads ``npattn ARGV``; bench's are built inside its ``main``,
    caught at their ``parse_args``."""
    if not argv:
        return cli.build_parser()
    if argv[0] in ("check", "demo"):
        return cli.build_parser().parse_known_args(list(argv))[0].command_parser

    def caught(self, args=None, namespace=None):
        raise _Parsed(self)

    with monkeypatch.context() as m:
        m.setattr(argparse.ArgumentParser, "parse_args", caught)
        with pytest.raises(_Parsed) as exc:
            cli.main(list(argv))
    return exc.value.args[0]


def _help_entries(text):
    """``{head: help}`` of every option entry of a --help text, in every section (``--dtype
    {float32,float64}`` -> its help, continuation lines joined)."""
    entries, head = {}, None
    for line in text.splitlines():
        if line.startswith("  -"):  # an option's entry: its head, then its help on this line or the next
            head, _, rest = line.strip().partition("  ")
            entries[head] = rest.strip()
        elif head is not None and line.startswith("   "):
            entries[head] = (entries[head] + " " + line.strip()).strip()
        else:  # a section's title, a blank line, the epilog
            head = None
    return entries


@pytest.mark.parametrize("name", list(HELP_PAGES))
def test_every_flag_says_what_it_takes_and_its_default(name, monkeypatch):
    """--threads THREADS, --heads HEADS, --seq-len SEQ_LEN, ... (argparse's metavar: the
    flag's own name) said nothing of the values; demo's --backend, --dtype and --seed had no
    help; check's --backend, demo's --dtype and --seed, bench's --dtype and --gemm, the dask
    mode's --dtype and bench --model gpt's --dtype did not say their default."""
    monkeypatch.setenv("COLUMNS", "100")
    parser = _parser_of(HELP_PAGES[name][0], monkeypatch)
    entries = _help_entries(parser.format_help())
    assert len(entries) >= 2
    for head, text in entries.items():
        if head.startswith("-h"):
            continue
        assert text, f"{name}: {head}: no help"
        flag, _, metavar = head.partition(" ")
        if not metavar:  # a switch
            continue
        assert metavar != flag.lstrip("-").upper().replace("-", "_"), \
            f"{name}: {head}: the metavar does not say what it takes"
        assert "default" in text or "required" in text, f"{name}: {head}: its default is not said"
    if name == "npattn":
        assert "npattn COMMAND --help" in parser.format_help()


def test_an_option_of_some_tasks_or_of_isolated_mode_says_so(monkeypatch, capsys):
    """Each demo option of some tasks only is marked with them in --help (as DEMO_TASKS has
    it). --block-q, --block-k, --markdown and --scope, refused without --isolated, did not say
    so: each option of bench's isolated-mode group says it needs --isolated, and is refused
    without it."""
    monkeypatch.setenv("COLUMNS", "100")
    demo = _help_entries(_parser_of(("demo",), monkeypatch).format_help())
    for dest in {d for options in cli.DEMO_TASKS.values() for d in options}:
        owners = [t for t, options in cli.DEMO_TASKS.items() if dest in options]
        if len(owners) == len(cli.DEMO_TASKS):
            continue
        text = next(t for h, t in demo.items() if h.split()[0] == "--" + dest.replace("_", "-"))
        assert text.startswith(f"({', '.join(owners)})"), (dest, text)
    bench = _parser_of(("bench",), monkeypatch)
    group = next(g for g in bench._action_groups if g.title == "isolated mode")
    # small sizes, in case an option ran without --isolated after all
    tiny = ["bench", "--shapes", "1x2x2x1", "--repeat", "5", "--gemm", "1", "--no-torch",
            "--no-memory", "--no-progress", "--pause", "0", "--min-sample", "0"]
    needs = [a for a in group._group_actions
             if a.help != argparse.SUPPRESS and "--isolated" not in a.option_strings]
    assert needs
    for action in needs:
        flag = action.option_strings[0]
        assert "needs --isolated" in action.help, f"{flag}: its help does not say it needs --isolated"
        value = ([c for c in action.choices if c != action.default][0] if action.choices
                 else os.devnull if action.metavar == "PATH" else "2")
        with pytest.raises(SystemExit) as exc:
            cli.main([*tiny, flag, value])
        assert exc.value.code == 2
        assert f"{flag}: needs --isolated" in capsys.readouterr().err


def _doc_flags(page):
    with open(os.path.join(ROOT, page), encoding="utf-8") as f:
        return set(re.findall(r"(?<![\w-])--[a-z][a-z0-9-]*", f.read()))


def test_the_docs_list_every_flag_and_no_other(monkeypatch):
    """docs/dask.md listed none of bench --backend dask's options, docs/performance.md left out
    --dtype, --gemm, --threads, --blas-threads, --warmup, --no-torch, --no-memory, --block-q,
    --block-k and --markdown, docs/gpt.md bench --model gpt's sizes, docs/demo.md --no-plots
    and --no-progress."""
    from npattn.tools import verify

    every = {f for a in verify.build_parser()._actions for f in a.option_strings}
    for name, (argv, pages) in HELP_PAGES.items():
        parser = _parser_of(argv, monkeypatch)
        flags = {f for a in parser._actions for f in a.option_strings if f.startswith("--")}
        every |= flags
        if not pages:
            continue
        shown = {f for a in parser._actions if a.help != argparse.SUPPRESS
                 for f in a.option_strings if f.startswith("--")} - {"--help"}
        documented = set().union(*(_doc_flags(p) for p in pages))
        assert not shown - documented, f"{name}: not in {', '.join(pages)}: {sorted(shown - documented)}"
    for page in {p for _, pages in HELP_PAGES.values() for p in pages}:
        assert not _doc_flags(page) - every, f"{page}: no such flag: {sorted(_doc_flags(page) - every)}"


def test_an_output_path_under_a_file_is_told_as_such(tmp_path, capsys):
    """--json FILE/x.json, FILE an existing file, said "the directory 'FILE' does not exist";
    it exists, as a file."""
    from npattn.tools.outputs import output_error

    (tmp_path / "afile").write_text("kept")
    path = str(tmp_path / "afile" / "x.json")
    want = f"--json: expected a path in a directory, got {path!r}, whose {str(tmp_path / 'afile')!r} is a file"
    assert output_error("--json", path) == want
    with pytest.raises(SystemExit) as exc:
        cli.main(["bench", "--backend", "dask", "--json", path])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert err.endswith(f"error: {want}\n") and "Traceback" not in err
    assert (tmp_path / "afile").read_text() == "kept"


def test_an_output_path_that_cannot_be_made_names_the_option_and_the_path(tmp_path, monkeypatch):
    """A path in a folder that does not exist names the folder and the path given; one the
    user may not write (os.access says no, as it does for a user who is not root) names the
    path; in both cases nothing is made."""
    from npattn.tools import outputs

    path = str(tmp_path / "missing" / "x.json")
    assert outputs.output_error("--json", path) == (
        f"--json: the directory {str(tmp_path / 'missing')!r} does not exist (path {path!r})")
    path = str(tmp_path / "x.json")
    monkeypatch.setattr(outputs.os, "access", lambda *args, **kwargs: False)
    assert outputs.output_error("--markdown", path) == (
        f"--markdown: {path!r} cannot be written (no permission)")
    assert list(tmp_path.iterdir()) == []


def test_two_outputs_on_standard_output_are_refused():
    """Where two options may each be '-', both on standard output would interleave."""
    from npattn.tools.outputs import outputs_error

    assert outputs_error(("--a", "-"), ("--b", "-"), stdout=("--a", "--b")) == (
        "--a and --b: expected two different outputs, got '-' for both (one would overwrite "
        "the other)")
    assert outputs_error(("--a", "-"), ("--b", None), stdout=("--a", "--b")) is None


def test_a_dash_is_standard_output_not_a_file_of_that_name(tmp_path, monkeypatch):
    """``-`` is standard output: no file named '-' is looked at, made or refused (a folder of
    that name in the working directory would have been taken for the output)."""
    from npattn.tools.outputs import output_error, outputs_error

    monkeypatch.chdir(tmp_path)
    (tmp_path / "-").mkdir()
    assert output_error("--json", "-") is None
    assert outputs_error(("--json", "-")) is None
    assert sorted(p.name for p in tmp_path.iterdir()) == ["-"]


def test_checking_an_output_path_leaves_the_file_system_as_it_was(tmp_path):
    """The check opens the path to learn that it can be written: a file there keeps its
    contents (the run may still fail before it writes), and a new one is removed again."""
    from npattn.tools.outputs import output_error

    kept, new = tmp_path / "kept.json", tmp_path / "new.json"
    kept.write_text("earlier results")
    assert output_error("--json", str(kept)) is None
    assert output_error("--json", str(new)) is None
    assert kept.read_text() == "earlier results"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["kept.json"]


def test_one_file_named_two_ways_is_refused_as_two_outputs(tmp_path, monkeypatch):
    """'r.json' and './sub/../r.json' are one file: the later output would overwrite the
    earlier one, so the pair is refused as two identical paths are."""
    from npattn.tools.outputs import outputs_error

    monkeypatch.chdir(tmp_path)
    (tmp_path / "sub").mkdir()
    assert outputs_error(("--json", "r.json"), ("--markdown", "./sub/../r.json")) == (
        "--json and --markdown: expected two different outputs, got 'r.json' for both (one would "
        "overwrite the other)")
    assert outputs_error(("--json", "r.json"), ("--markdown", "sub/r.json")) is None


def test_json_output_writes_what_the_body_filled_into_its_file(tmp_path, capsys):
    """json_output(PATH): the dict the body fills is written to PATH as JSON at the end, and
    what the body prints stays on standard output; with None nothing is written."""
    from npattn.tools.outputs import json_output

    path = tmp_path / "r.json"
    with json_output(str(path)) as result:
        result["rows"] = [1, 2]
        print("a table")
    assert json.loads(path.read_text()) == {"rows": [1, 2]}
    assert capsys.readouterr().out == "a table\n"
    with json_output(None) as result:
        result["rows"] = [3]
    assert list(tmp_path.iterdir()) == [path] and capsys.readouterr().out == ""
