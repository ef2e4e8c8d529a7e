"""npattn.verify: the panel, the budgets, the degenerate rule, the report, and the proof.

The proof is examples/verify/kernels.py: its blocked NumPy kernel passes at
float64, float32 and float16 (with dmask and dlse), and each of its sixteen
seeded mistakes fails, with the tensor that the mistake breaks named and
only in the cases that hold the option it is about (the dlse one only with
lse_grad, the dmask one only with a float mask). torch's SDPA (autograd,
with mask gradients too) and npattn.compat's flash_attn_func pass with the
options they declare, and its flash_attn_varlen_func in layout "thd", the
sequences packed (where a kernel that attends across them fails).
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import re
from dataclasses import replace

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import npattn
from npattn import compat
from npattn import functional as F
from npattn import verifier as VF
from npattn import verify_cases as VC
from npattn.testing import assert_attention_close
from npattn.testing import strategies as S

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the project: docs, examples
# the folder holding the npattn under test (the project, or site-packages when installed),
# put on a child process's path so that it imports the same npattn (CI's second stage sets
# PYTHONSAFEPATH, so that a child's current folder, the checkout, does not come before it)
IMPORT_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(npattn.__file__)))
KERNELS = os.path.join(ROOT, "examples", "verify", "kernels.py")
ALL = tuple(VC.SUPPORTS)


def _load_kernels():
    spec = importlib.util.spec_from_file_location("verify_example_kernels", KERNELS)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


K = _load_kernels()


def run_kernel(fn, dtype="float64", **kw):
    kw.setdefault("supports", ALL)
    kw.setdefault("backward", K.attention_backward)
    return VF.verify(fn, dtype=dtype, returns_lse=True, **kw)


def failing(report, tensor):
    """Names of the cases where ``tensor`` fails."""
    return [r.case.name for r in report.results if r.tensors.get(tensor) is not None
            and r.tensors[tensor].status == "fail"]


def npattn_kernel(q, k, v, **options):
    """npattn itself, as a user kernel on (B, H, L, D) arrays: (out, lse, cache)."""
    out, cache = F.sdpa_forward(q, k, v, **options)
    return out, cache.lse, cache


def npattn_backward(dout, cache, dlse=None):
    return F.sdpa_backward(dout, cache, dlse=dlse)  # SDPAGrads: dq, dk, dv, dmask, dsinks


# --------------------------------------------------------------------------
# the panel


def test_panel_covers_lengths_shapes_and_each_option():
    cases = VC.panel(ALL)
    assert 30 <= len(cases) <= 60 and len({c.name for c in cases}) == len(cases)
    lengths = {c.Lq for c in cases} | {c.Lk for c in cases}
    assert {1, 64, 65, 127, 128, 129, 257} <= lengths
    for c in cases:
        assert c.Lq != c.Lk and c.B >= 2 and c.Hq >= 2
        assert c.Lq * c.Lk <= 257 * 257 and c.Dh <= 64
    for opt in ALL:
        if opt in VC.PERMISSIONS:
            continue
        alone = [c for c in cases if c.options == (opt,)]
        assert len(alone) == 2, opt
        assert any(opt in c.options and len(c.options) > 1 for c in cases), opt
    assert any(len(c.options) >= 10 for c in cases)  # all together
    assert any(c.Hkv == 1 for c in cases) and any(c.Dv != c.Dh for c in cases)
    # no option declared: the cases without options only
    assert all(not c.options for c in VC.panel(()))


def test_panel_tells_the_group_size_from_the_kv_heads_and_the_batch_from_the_heads():
    """A GQA case whose group G = Hq // Hkv differs from Hkv > 1 (with Hq = 4, Hkv = 2
    alone, G = Hkv and a kernel that confuses them is right), and, among the cases every
    panel holds, one whose B differs from its H (B = H = 2 hides a batch stride taken for a
    head stride)."""
    gqa = [c for c in VC.panel(ALL) if "gqa" in c.options]
    assert any(c.Hkv > 1 and c.Hq // c.Hkv != c.Hkv for c in gqa), [(c.Hq, c.Hkv) for c in gqa]
    assert any(c.Hkv == 1 for c in gqa)
    base = VC.panel(())
    assert any(c.B != c.Hq for c in base), [(c.B, c.Hq) for c in base]


def dense_gqa(q, k, v, *, enable_gqa=False, is_causal=False, repeats=None):
    """Dense attention on (B, H, L, D) NumPy arrays, GQA by repeating each K/V head ``repeats``
    times (default Hq // Hkv; NumPy broadcasts a single head that is left): (out, lse)."""
    Hq, Hkv = q.shape[1], k.shape[1]
    if enable_gqa:
        n = Hq // Hkv if repeats is None else repeats
        k, v = np.repeat(k, n, axis=1), np.repeat(v, n, axis=1)  # [B, Hkv * n, Lk, D]
    s = q @ np.swapaxes(k, -1, -2) / math.sqrt(q.shape[-1])  # [B, Hq, Lq, Lk]
    if is_causal:
        s = np.where(np.tril(np.ones(s.shape[-2:], dtype=bool)), s, -np.inf)
    return softmax_times(s, v)


def softmax_times(s, v):
    """(softmax(s) @ v, the rows' log-sum-exp) of scores s [..., Lq, Lk] with no empty row."""
    m = np.max(s, axis=-1, keepdims=True)
    e = np.exp(s - m)
    total = np.sum(e, axis=-1, keepdims=True)
    return e / total @ v, (m + np.log(total))[..., 0]


def test_a_gqa_kernel_that_repeats_each_kv_head_hkv_times_fails():
    """Repeating each K/V head Hkv times (the count of K/V heads where the group size
    Hq // Hkv belongs) is right when the two are equal (Hq = 4, Hkv = 2) and when one K/V head
    is left to broadcast (Hkv = 1): it passed every case of the panel when its GQA cases were
    (4, 2) and (4, 1). It fails the GQA cases with Hkv = 2, now of 6 query heads."""
    kw = dict(returns_lse=True, dtype="float64", supports="gqa,causal")
    good = VF.verify(dense_gqa, **kw)
    assert good.ok, good.format()

    def by_kv_heads(q, k, v, **options):
        return dense_gqa(q, k, v, repeats=k.shape[1], **options)

    bad = VF.verify(by_kv_heads, **kw)
    want = {r.case.name for r in bad.results if "gqa" in r.case.options and r.case.Hkv > 1}
    assert want and {r.case.name for r in bad.failures} == want, bad.format()


def flat_attention(q, k, v, *, is_causal=False, mask=None, batch_stride=None):
    """Dense attention as a kernel over (b, h) programs on flat buffers, as a Triton grid
    runs it: program (b, h) reads row ``b * batch_stride + h`` of q, k, v viewed as
    (B * H, L, D) (``batch_stride`` H; the mistake: B) -> (out, lse)."""
    B, H, Lq, D = q.shape
    Lk = k.shape[2]
    stride = H if batch_stride is None else batch_stride
    qf, kf, vf = (x.reshape(B * H, x.shape[2], x.shape[3]) for x in (q, k, v))  # [B * H, L, D]
    out, lse = np.zeros((B * H, Lq, v.shape[3])), np.zeros((B * H, Lq))
    for b in range(B):
        for h in range(H):
            i, at = b * H + h, b * stride + h  # where the program writes, and where it reads
            s = qf[at] @ kf[at].T / math.sqrt(D)  # [Lq, Lk]
            allowed = np.tril(np.ones((Lq, Lk), dtype=bool)) if is_causal else np.ones((Lq, Lk), dtype=bool)
            if mask is not None:
                allowed &= mask[b, 0 if mask.shape[1] == 1 else h]
            out[i], lse[i] = softmax_times(np.where(allowed, s, -np.inf), vf[at])
    return out.reshape(B, H, Lq, -1), lse.reshape(B, H, Lq)


def test_a_kernel_that_takes_the_batch_count_for_the_head_stride_fails():
    """Reading row b * B + h of the flattened (B * H) heads, where b * H + h belongs, is right
    whenever B = H: it passed every case while all of them had B = H = 2 (GQA aside). It
    fails, out and lse, in the case without options that has 3 heads, and only there."""
    kw = dict(returns_lse=True, dtype="float64", supports="causal,mask_bool")
    good = VF.verify(flat_attention, **kw)
    assert good.ok, good.format()

    def batch_stride_of_b(q, k, v, **options):
        return flat_attention(q, k, v, batch_stride=q.shape[0], **options)

    bad = VF.verify(batch_stride_of_b, **kw)
    assert [(r.case.name, r.failing) for r in bad.failures] == [("base-127x64", ["out", "lse"])], \
        bad.format()


def test_lse_is_compared_on_a_row_whose_only_logit_is_its_sink():
    """A row with no key to attend but a sink has lse = sink (finite): npattn's, and the
    log of exp(sink) alone. A kernel that gives -inf there, as if the sink were not in the
    row, passed when lse was never compared on rows with no key; it fails lse in the cases
    with sinks and such a row, and only lse."""
    supports = "sinks,mask_bool,empty_rows"
    good = VF.verify(npattn_kernel, backward=npattn_backward, returns_lse=True,
                     dtype="float64", supports=supports)
    assert good.ok, good.format()

    def sink_forgotten_on_empty_rows(q, k, v, **options):
        out, lse, cache = npattn_kernel(q, k, v, **options)
        no_key = ~np.any(cache.probs != 0.0, axis=-1)  # [B, H, Lq]: every key's weight 0
        return out, np.where(no_key, -np.inf, lse), cache

    bad = VF.verify(sink_forgotten_on_empty_rows, backward=npattn_backward, returns_lse=True,
                    dtype="float64", supports=supports)
    want = [r.case.name for r in bad.results if "sinks" in r.case.options and r.case.empty_rows]
    assert want and [(r.case.name, r.failing) for r in bad.failures] == [(n, ["lse"]) for n in want], \
        bad.format()
    # without sinks such a row's lse is -inf (flash-attn: +inf) and still not compared
    plain = VF.verify(sink_forgotten_on_empty_rows, backward=npattn_backward, returns_lse=True,
                      dtype="float64", supports="mask_bool,empty_rows")
    assert plain.ok, plain.format()


def test_panel_draws_only_declared_options_and_respects_exclusions():
    cases = VC.panel("causal,mask_bool,mask_float,gqa", combos=True)
    for c in cases:
        assert set(c.options) <= {"causal", "mask_bool", "mask_float", "gqa"}
        assert not {"mask_bool", "mask_float"} <= set(c.options)
    only = VC.panel("causal,gqa", combos=[("causal", "gqa")])
    assert [c.options for c in only if len(c.options) > 1] == [("causal", "gqa")]
    alone = VC.panel("causal,gqa", combos=False)
    assert all(len(c.options) <= 1 for c in alone) and any(c.options for c in alone)
    assert VC.panel("causal,gqa", combos=None) == alone  # None: each option alone, as documented
    with pytest.raises(ValueError, match="combos: .* 'window', which supports does not declare"):
        VC.panel("causal", combos=[("causal", "window")])
    with pytest.raises(ValueError, match="supports: expected names from"):
        VC.panel("causal,sliding")


def test_an_unknown_supports_name_is_told_with_its_close_matches():
    """A misspelt option ('casual') names the options it is close to; a name close to none
    gets the list alone."""
    with pytest.raises(ValueError, match=r"got 'casual' \(did you mean 'causal'\?\)$"):
        VC.check_supports("gqa,casual")
    with pytest.raises(ValueError, match=r"got 'mask_boo' \(did you mean 'mask_bool' or 'mask_float'\?\)$"):
        VF.verify(lambda q, k, v: q, supports=["mask_boo"])
    with pytest.raises(ValueError, match=r"'window'\], got 'zzz'$"):
        VC.check_supports("zzz")


def test_the_pairs_cover_every_option_even_past_max_pairs(monkeypatch):
    """Each declared option is in a pair at least, even where that takes more than
    MAX_PAIRS pairs."""
    supports = ("causal", "window", "softcap", "sinks", "gqa")
    monkeypatch.setattr(VC, "MAX_PAIRS", 1)
    pairs = [c.options for c in VC.panel(supports) if len(c.options) == 2]
    assert 1 < len(pairs) < 10 and set().union(*map(set, pairs)) == set(supports), pairs


def test_case_inputs_are_seeded_controlled_and_never_all_ones():
    case = next(c for c in VC.panel(ALL) if c.options == ("mask_bool",))
    a, b = VC.case_inputs(case, seed=3), VC.case_inputs(case, seed=3)
    assert np.array_equal(a.q, b.q) and np.array_equal(a.options["mask"], b.options["mask"])
    assert not np.array_equal(a.q, VC.case_inputs(case, seed=4).q)
    assert 0.8 < a.dout.std() < 1.2 and np.unique(a.dout).size == a.dout.size
    s = (a.q @ np.swapaxes(a.k, -1, -2)) / math.sqrt(case.Dh)
    assert 0.8 < s.std() < 1.25  # the scores have the case's std (1)
    big = replace(case, score_std=8.0)
    s8 = VC.case_inputs(big).q @ np.swapaxes(VC.case_inputs(big).k, -1, -2) / math.sqrt(case.Dh)
    assert 6.0 < s8.std() < 10.0
    m = a.options["mask"]
    assert m.any(axis=-1).sum() < m.shape[0] * m.shape[1] * m.shape[2]  # fully masked rows
    assert 0.6 < m.mean() < 0.85  # and partly masked ones
    # the rows not blanked keep about 3/4 of their keys (docs/verify.md), the diagonal key
    # always: 1/4 of the others dropped, ~16,000 draws
    kept = m[m.any(axis=-1)]  # [rows, Lk]
    assert kept.shape[-1] == case.Lk and abs(kept.mean() - (0.75 + 0.25 / case.Lk)) < 0.02


def test_fit_lengths_swaps_only_where_empty_rows_are_not_declared():
    """Lq > Lk under a window (bottom-right causal, segments) leaves rows empty by structure:
    the lengths are swapped without 'empty_rows', kept with it; without such an option never."""
    assert VC.fit_lengths(128, 65, ("window",), empty_ok=False) == (65, 128)
    assert VC.fit_lengths(128, 65, ("window",), empty_ok=True) == (128, 65)
    assert VC.fit_lengths(128, 65, ("softcap",), empty_ok=False) == (128, 65)
    assert VC.fit_lengths(65, 128, ("segments",), empty_ok=False) == (65, 128)
    assert any(c.Lq > c.Lk for c in VC.panel("window,empty_rows") if c.options == ("window",))


@pytest.mark.parametrize("align", ["top_left", "bottom_right"])
def test_without_empty_rows_every_row_attends_something(align):
    """Masks keep each query's diagonal key, i + Lk - Lq bottom-right, which the window
    around it always allows."""
    supports = tuple(s for s in ALL if s != "empty_rows")
    for c in VC.panel(supports, align):
        inp = VC.case_inputs(c, align=align)
        out, cache = F.sdpa_forward(inp.q, inp.k, inp.v, **inp.options)
        assert np.all(cache.probs.sum(axis=-1) > 0), c.name


def test_panel_plan_and_case_inputs_refuse_an_unknown_align():
    """align is 'top_left' or 'bottom_right' here as in verify: another str, None or an
    array was taken (panel and plan dropped the causal cases next to a window as for
    neither alignment, case_inputs took it for 'top_left')."""
    case = VC.panel(("window",))[-1]
    for call in (lambda a: VC.panel(("causal", "window"), a), lambda a: VF.plan(("window",), align=a),
                 lambda a: VC.case_inputs(case, align=a)):
        with pytest.raises(ValueError, match=r"^align: expected 'top_left' or 'bottom_right', got 'bottom'"):
            call("bottom")
        for bad, got in ((None, "got None"), (np.array(["top_left"]), "got numpy.ndarray")):
            with pytest.raises(TypeError, match=rf"^align: expected 'top_left' or 'bottom_right', {got}"):
                call(bad)


def test_dropout_cases_drop_a_fraction_p_and_undeclared_empty_rows_are_refused():
    """dropout_p is the probability to drop: about 1 - p of the keep-mask is True. A case
    that leaves rows with nothing to attend runs only for a kernel that declares
    'empty_rows' (it is told before the kernel is called, not failed for the rows)."""
    for p in (0.2, 0.5):
        case = VC.Case("dropout", Lq=65, Lk=129, options=("dropout_mask",), dropout_p=p)
        inp = VC.case_inputs(case)
        keep = inp.options["dropout_mask"]  # [B, Hq, Lq, Lk], True = keep
        assert inp.options["dropout_p"] == p and keep.dtype == bool
        assert abs(keep.mean() - (1.0 - p)) < 0.02, (p, keep.mean())  # ~33,000 draws
    called = []

    def kernel(q, k, v, **options):
        called.append(1)
        return npattn_kernel(q, k, v, **options)[0]

    blank = VC.Case("blank", Lq=9, Lk=13, Dh=8, Dv=8, options=("mask_bool",), empty_rows=True)
    with pytest.raises(ValueError, match="supports does not declare 'empty_rows'"):
        VF.verify(kernel, dtype="float64", supports="mask_bool", cases=[blank])
    assert not called
    assert VF.verify(kernel, dtype="float64", supports="mask_bool,empty_rows", cases=[blank]).ok


# --------------------------------------------------------------------------
# the proof: the example kernel and its mutants


@pytest.mark.parametrize("dtype", ["float64", "float32", "float16"])
def test_the_example_kernel_passes(dtype):
    report = run_kernel(K.attention, dtype, mask_grad=True, lse_grad=True)
    assert report.ok, report.format()
    assert len(report.results) == len(VC.panel(ALL))
    for t in VF.TENSORS:  # every tensor is tested, not only degenerate, somewhere
        assert any(r.tensors[t].status == "pass" for r in report.results if t in r.tensors), t
    float_mask = [r for r in report.results if "mask_float" in r.case.options]
    assert float_mask and all("dmask" in r.tensors for r in float_mask)
    assert not any("dmask" in r.tensors for r in report.results if r not in float_mask)
    assert "with dlse, dmask in 6/6 float-mask cases" in report.summary()
    worst = max(t.ratio for r in report.results for t in r.tensors.values())
    assert worst < 0.7, worst


# mutant -> (dtype, tensors it must break, tensors it must not, the option every catch holds,
#            a phrase of the hint[, verify's keywords])
MUTANTS = {
    "bug_softmax_no_rowsum": ("float64", {"dq", "dk"}, {"out", "lse", "dv"}, None, "below the softmax"),
    "bug_transposed_scores": ("float64", {"out", "lse"}, set(), None, "the scores or the softmax"),
    "bug_scale_twice": ("float64", {"dq", "dk"}, {"out", "lse", "dv"}, None, "a constant factor"),
    "bug_window_off_by_one": ("float64", {"out", "lse"}, set(), "window",
                              "the window's left edge off by one"),
    "bug_causal_swapped": ("float64", {"out", "lse"}, set(), "causal*",
                           "causal aligned top_left where bottom_right is asked"),
    "bug_dropout_forward_only": ("float64", {"dv"}, {"out", "lse"}, "dropout_mask", "dropout"),
    "bug_alibi_sign": ("float64", {"out", "lse"}, set(), "alibi", "scores or the softmax"),
    "bug_sink_dropped": ("float64", {"out", "lse", "dsinks"}, set(), "sinks", "sinks ignored"),
    "bug_gqa_no_sum": ("float64", {"dk", "dv"}, {"out", "lse", "dq"}, "gqa", "group of query heads"),
    "bug_gqa_mean": ("float64", {"dk", "dv"}, {"out", "lse", "dq"}, "gqa", "a mean over the group"),
    "bug_empty_rows_uniform": ("float64", {"out"}, {"lse"}, None,  # (masks, causal, windows)
                               "out is not zero on rows with nothing to attend"),
    "bug_float16_sum": ("float16", {"lse"}, set(), None, "precision"),
    "bug_no_row_max": ("float32", {"out", "lse"}, set(), None, "subtract each row's maximum"),
    "bug_dlse_ignored": ("float64", {"dq", "dk", "dmask", "dsinks"}, {"out", "lse", "dv"}, None,
                         "+ dlse", {"lse_grad": True}),
    "bug_dmask_sign": ("float64", {"dmask"}, {"out", "lse", "dq", "dk", "dv", "dsinks"},
                       "mask_float", "dmask has the wrong sign"),
    "bug_softcap_last": ("float64", {"out", "lse", "dq", "dk", "dv"}, set(), "softcap",
                         "the order: softcap"),
}


@pytest.mark.parametrize("name", sorted(MUTANTS))
def test_each_mutant_is_caught_with_its_tensor_named(name):
    dtype, broken, intact, option, phrase = MUTANTS[name][:5]
    kw = MUTANTS[name][5] if len(MUTANTS[name]) > 5 else {}
    with np.errstate(all="ignore"):  # (bug_no_row_max overflows, as it is meant to)
        report = run_kernel(getattr(K, name), dtype, **kw)
    assert not report.ok
    caught = {t: failing(report, t) for t in VF.TENSORS}
    print(f"{name} ({dtype}) caught by: " + "; ".join(
        f"{t} in {len(c)} case(s) ({', '.join(c[:4])}{', ...' if len(c) > 4 else ''})"
        for t, c in caught.items() if c))
    for t in broken:
        assert caught[t], f"{name}: {t} never fails"
    for t in intact:
        assert not caught[t], f"{name}: {t} fails in {caught[t]}"
    for r in report.failures:
        if option == "causal*":
            assert {"causal", "causal_bottom_right"} & set(r.case.options), r.case.name
        elif option is not None:
            assert option in r.case.options, r.case.name
    if option == "causal*":  # both alignments catch the swap
        assert any("causal" in r.case.options for r in report.failures)
        assert any("causal_bottom_right" in r.case.options for r in report.failures)
    assert any(phrase in r.hint for r in report.failures), [r.hint for r in report.failures]
    text = report.format()
    assert "FAIL" in text and "rerun: print(npattn.verify(" in text


@pytest.mark.parametrize("name, off", [("bug_dlse_ignored", {}),
                                       ("bug_dmask_sign", {"mask_grad": False}),
                                       ("bug_dmask_sign", {"supports": "mask_bool,gqa,sinks"})])
def test_the_dlse_and_dmask_mutants_hide_without_their_check(name, off):
    """Ignoring dlse is right when no dlse is given; a wrong dmask is seen only when dmask is
    compared, in the cases with a float mask."""
    report = run_kernel(getattr(K, name), "float64", **off)
    assert report.ok, report.format()
    if name == "bug_dmask_sign":
        assert not any("dmask" in r.tensors for r in report.results)


def test_float16_sum_is_caught_by_out_alone_without_lse():
    def out_only(q, k, v, **options):
        out, lse, saved = K.bug_float16_sum(q, k, v, **options)
        return (out, saved)

    report = VF.verify(out_only, dtype="float16", supports=ALL, backward=K.attention_backward)
    assert failing(report, "out") and not report.ok


def test_scores_rounded_to_float16_are_named_in_the_lse_hint():
    # q @ k^T taken in float16 (as a float16 matmul returns it), the softmax in float32:
    # lse moves by about |s| 2^-11, hundreds of its budgets, while out stays within its
    # own in the cases without large scores. The hint must point at the scores too, not
    # only at a row sum accumulated in low precision (this kernel's row sum is float32)
    def scores_in_float16(q, k, v, **options):
        s = (q @ np.swapaxes(k, -1, -2)).astype(np.float32) / math.sqrt(q.shape[-1])
        m = np.max(s, axis=-1, keepdims=True)  # [B, H, Lq, 1]
        e = np.exp(s - m)
        rowsum = np.sum(e, axis=-1, keepdims=True)
        out = (e / rowsum) @ v.astype(np.float32)
        return out.astype(q.dtype), (m + np.log(rowsum))[..., 0]

    report = VF.verify(scores_in_float16, dtype="float16", supports="", returns_lse=True)
    assert failing(report, "lse") and not report.ok
    lse_only = [r for r in report.failures if r.failing == ["lse"]]
    assert lse_only, report.format()
    for r in lse_only:
        assert "lse wrong, out right" in r.hint and "the scores" in r.hint, r.hint


def test_a_backward_of_zeros_fails_everywhere_it_could():
    def zeros(dout, saved, dlse=None):
        g = K.attention_backward(dout, saved, dlse=dlse)
        return g._replace(dq=np.zeros_like(g.dq), dk=np.zeros_like(g.dk), dv=np.zeros_like(g.dv),
                          dmask=None if g.dmask is None else np.zeros_like(g.dmask))

    report = run_kernel(K.attention, "float32", backward=zeros, lse_grad=True)
    for r in report.results:
        for t in ("dq", "dk", "dv") + (("dmask",) if "mask_float" in r.case.options else ()):
            # a zero gradient passes only where the check says it cannot tell
            assert r.tensors[t].status in ("fail", "degenerate"), (r.case.name, t)
    assert len(failing(report, "dq")) >= len(report.results) - 4


# --------------------------------------------------------------------------
# near misses: the hint names a common mistake that a failing out or lse is exactly


def dense_attention(q, k, v, *, mistake=None, mask=None, is_causal=False, align="top_left",
                    window=None, scale=None, alibi_slopes=None, sinks=None, enable_gqa=False,
                    dropout_p=0.0, dropout_mask=None):
    """Attention as one dense NumPy computation, ``(out, lse)``, written apart from npattn,
    with one common mistake made on purpose (``mistake``, a key of ``NEAR_MISSES``)."""
    # [B, Hq, Lq, Dh], [B, Hkv, Lk, Dh], [B, Hkv, Lk, Dv] -> [B, Hq, Lq, Dv], [B, Hq, Lq]
    B, Hq, Lq, Dh = q.shape
    Hkv, Lk = k.shape[1], k.shape[2]
    heads = np.arange(Hq) % Hkv if mistake == "gqa_h_mod_hkv" else np.arange(Hq) // (Hq // Hkv)
    k, v = k[:, heads], v[:, heads]  # [B, Hq, Lk, *]
    if scale is None or mistake == "scale_ignored":
        scale = {"scale_1/Dh": 1.0 / Dh, "scale_1": 1.0}.get(mistake, 1.0 / math.sqrt(Dh))
    s = (q @ np.swapaxes(k, -1, -2)) * scale  # [B, Hq, Lq, Lk]
    bottom = (align == "bottom_right") != str(mistake).startswith("align_flipped")
    i = np.arange(Lq)[:, None] + (Lk - Lq if bottom else 0)  # [Lq, 1] query i's diagonal key
    j = np.arange(Lk)[None, :]  # [1, Lk]
    allowed = np.ones((Lq, Lk), dtype=bool)
    if is_causal:
        allowed &= j <= i
    if window is not None:
        left, right = window
        if mistake == "window_left_long" and left is not None:
            left += 1
        if mistake == "window_right_short" and right is not None:
            right -= 1
        if left is not None:
            allowed &= j >= i - left
        if right is not None:
            allowed &= j <= i + right
    if alibi_slopes is not None:
        a = np.asarray(alibi_slopes)
        s = s - a.reshape((1,) * (2 - a.ndim) + a.shape + (1, 1)) * np.abs(i - j)
    allowed = np.broadcast_to(allowed, s.shape)  # [B, Hq, Lq, Lk]
    if mask is not None and mask.dtype == bool:
        allowed = allowed & (~mask if mistake == "mask_inverted" else mask)
    elif mask is not None:
        s = s + mask
        allowed = allowed & (mask > -np.inf)
    s = np.where(allowed, s, -np.inf)
    m = np.max(s, axis=-1, keepdims=True)  # [B, Hq, Lq, 1]
    sink = None
    if sinks is not None and mistake != "sinks_ignored":
        sink = np.asarray(sinks)[None, :, None, None]  # [1, Hq, 1, 1]
        m = np.maximum(m, sink)
    m = np.where(np.isfinite(m), m, 0.0)
    e = np.where(allowed, np.exp(s - m), 0.0)  # [B, Hq, Lq, Lk]
    rowsum = np.sum(e, axis=-1, keepdims=True)  # [B, Hq, Lq, 1]
    if sink is not None:
        rowsum = rowsum + np.exp(sink - m)
    p = e / np.where(rowsum > 0.0, rowsum, 1.0)  # [B, Hq, Lq, Lk]
    with np.errstate(divide="ignore"):  # -inf on rows with nothing to attend
        lse = np.log(rowsum[..., 0]) if mistake == "lse_no_max" else (m + np.log(rowsum))[..., 0]
    if mistake == "lse_base2":
        lse = lse / math.log(2.0)
    if dropout_mask is not None and mistake != "dropout_not_applied":
        factor = {"dropout_times_1-p": 1.0 - dropout_p, "dropout_unscaled": 1.0}.get(
            mistake, 1.0 / (1.0 - dropout_p))
        p = p * dropout_mask * factor
    return p @ v, lse


# mistake -> (supports, verify's align, a phrase that the hint of every failing case holds)
NEAR_MISSES = {
    "scale_1/Dh": ("", "top_left", "the default scale taken as 1/Dh"),
    "scale_1": ("", "top_left", "the scores not scaled"),
    "scale_ignored": ("scale", "top_left", "scale= ignored"),
    "align_flipped": ("causal_bottom_right", "top_left",
                      "causal aligned top_left where bottom_right is asked"),
    "align_flipped_window": ("window", "bottom_right",
                             "window aligned top_left where bottom_right is asked"),
    "align_flipped_alibi": ("alibi", "top_left",
                            "ALiBi aligned bottom_right where top_left is asked"),
    "window_left_long": ("window", "top_left", "the window's left edge off by one (left +1)"),
    "window_right_short": ("window", "bottom_right",
                           "the window's right edge off by one (right -1)"),
    "gqa_h_mod_hkv": ("gqa", "top_left", "query head h reads K/V head h % Hkv"),
    "sinks_ignored": ("sinks", "top_left", "sinks ignored"),
    "mask_inverted": ("mask_bool,empty_rows", "top_left", "the boolean mask's sense inverted"),
    "dropout_not_applied": ("dropout_mask", "top_left", "the dropout keep-mask not applied"),
    "dropout_times_1-p": ("dropout_mask", "top_left",
                          "dropout scaled by (1 - p) where 1/(1 - p) belongs"),
    "dropout_unscaled": ("dropout_mask", "top_left", "dropout's 1/(1 - p) left out"),
    "lse_base2": ("", "top_left", "lse wrong: lse in base 2"),
    "lse_no_max": ("sinks", "top_left", "lse wrong: lse without the row max"),
}


def near_miss_report(mistake, supports, align="top_left", dtype="float64", kernel=None):
    fn = kernel or (lambda q, k, v, **o: dense_attention(q, k, v, mistake=mistake, **o))
    return VF.verify(fn, dtype=dtype, supports=supports, align=align, returns_lse=True,
                     combos=False)


def test_the_dense_kernel_of_the_near_misses_passes():
    supports = ",".join({s for v in NEAR_MISSES.values() for s in v[0].split(",") if s})
    for align in ("top_left", "bottom_right"):
        report = near_miss_report(None, supports, align)
        assert report.ok, report.format()


@pytest.mark.parametrize("mistake", sorted(NEAR_MISSES))
def test_a_common_mistake_is_named_in_the_hint(mistake):
    supports, align, phrase = NEAR_MISSES[mistake]
    report = near_miss_report(mistake, supports, align)
    assert report.failures
    for r in report.failures:  # (one mistake, so never "one of these")
        assert phrase in r.hint and "one of these" not in r.hint, (r.case.name, r.hint)


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_a_common_mistake_is_named_in_low_precision_too(dtype):
    def kernel(q, k, v, **options):  # computed in float32, out in the inputs' dtype
        up = {n: a.astype(np.float32) if getattr(a, "dtype", None) == q.dtype else a
              for n, a in options.items()}
        out, lse = dense_attention(q.astype(np.float32), k.astype(np.float32),
                                   v.astype(np.float32), mistake="scale_1/Dh", **up)
        return out.astype(q.dtype), lse.astype(np.float32)

    report = near_miss_report(None, "", dtype=dtype, kernel=kernel)
    assert report.failures
    assert all("the default scale taken as 1/Dh" in r.hint for r in report.failures)


@pytest.mark.parametrize("mistake, supports", [(None, ""), ("scale_1/Dh", ""),
                                               ("sinks_ignored", "sinks"),
                                               ("lse_base2", "")])
def test_a_kernel_wrong_otherwise_gets_no_mistake_named(mistake, supports):
    """Noise of 1e-3 on top of the right out, or of a common mistake's out or lse, matches
    none of them: the hint names none."""
    rng = np.random.default_rng(0)

    def noisy(q, k, v, **options):
        out, lse = dense_attention(q, k, v, mistake=mistake, **options)
        if mistake == "lse_base2":
            return out, lse + 1e-3 * rng.standard_normal(lse.shape)
        return out + 1e-3 * rng.standard_normal(out.shape), lse

    report = near_miss_report(mistake, supports, kernel=noisy)
    assert report.failures
    phrases = [v[2].removeprefix("lse wrong: ") for v in NEAR_MISSES.values()]
    for r in report.failures:
        assert not any(p in r.hint for p in phrases), (r.case.name, r.hint)
        assert ("the scores or the softmax" in r.hint or "after the softmax" in r.hint
                or "the log-sum-exp itself" in r.hint), r.hint


def test_two_mistakes_that_give_the_same_numbers_are_named_both():
    # window (None, 7) with Lk - Lq = 1: bottom-right moves the right edge by one key, and
    # the left edge is unbounded, so a flipped alignment is a right edge one key long
    case = VC.Case("window-64x65", Lq=64, Lk=65, options=("window",), window=(None, 7))
    report = VF.verify(lambda q, k, v, **o: dense_attention(q, k, v, mistake="align_flipped", **o),
                       dtype="float64", supports="window", returns_lse=True, cases=[case])
    (r,) = report.failures
    assert "one of these, which give the same numbers here" in r.hint, r.hint
    assert "window aligned bottom_right where top_left is asked" in r.hint
    assert "the window's right edge off by one (right +1)" in r.hint


def test_a_mistake_that_empties_no_row_is_named_before_the_empty_rows_guard():
    # Lq = 5, Lk = 1, bottom-right causal: rows 0-3 have no key, row 4 sees key 0. Aligned
    # top-left, every row sees key 0: out is not zero on the empty rows and right on row 4,
    # which looks like a missing guard, but it is exactly the flipped alignment
    case = VC.Case("causal_bottom_right-5x1", Lq=5, Lk=1, options=("causal_bottom_right",))
    report = VF.verify(lambda q, k, v, **o: dense_attention(q, k, v, mistake="align_flipped", **o),
                       dtype="float64", supports="causal_bottom_right,empty_rows",
                       returns_lse=True, cases=[case])
    (r,) = report.failures
    assert r.tensors["out"].note == "not zero on empty rows"
    assert "causal aligned top_left where bottom_right is asked" in r.hint, r.hint
    assert "guard fully masked rows" not in r.hint, r.hint


def test_a_failing_search_for_the_mistake_leaves_the_generic_hint(monkeypatch):
    def broken(inp, pack=None):
        raise RuntimeError("a variant that cannot be built")

    monkeypatch.setattr(VF, "forward_variants", broken)
    report = near_miss_report("scale_1/Dh", "")
    assert report.failures
    assert all(r.hint == "out and lse wrong: the scores or the softmax" for r in report.failures)


# --------------------------------------------------------------------------
# budgets, floors and the degenerate rule


def test_budget_is_factor_times_npattn_error_plus_floor():
    report = VF.verify(npattn_kernel, dtype="float32", supports=ALL, backward=npattn_backward,
                       returns_lse=True, budget_factor=3.0, mask_grad=True, lse_grad=True)
    assert report.ok, report.format()
    assert sum("dmask" in r.tensors for r in report.results) == 6  # the float-mask cases of the panel
    for r in report.results:
        for t in r.tensors.values():
            assert t.budget == pytest.approx(3.0 * t.npattn_error + t.floor, rel=1e-12)
            floor_dtype = "float32"
            assert t.floor >= VF.FLOORS[floor_dtype] * VF.FLOOR_SCALE
            # npattn in float32 is the kernel: its error is exactly npattn's, under 1/3 budget
            assert t.error <= t.budget / 3.0 + 1e-300
    # at float64 npattn's error is zero by construction: the budget is the floor
    r64 = VF.verify(npattn_kernel, dtype="float64", backward=npattn_backward, returns_lse=True,
                    cases=["base-65x128"])
    t = r64.results[0].tensors["out"]
    assert t.npattn_error == 0.0 and t.budget == t.floor and t.error == 0.0


def test_floor_follows_the_terms_of_the_tensor():
    case = VC.Case("one-key", Lq=5, Lk=1, Dh=8, Dv=8)  # a row with one key: dq = dk = 0
    inp = VC.case_inputs(case)
    out, cache = F.sdpa_forward(inp.q, inp.k, inp.v)
    truth = {"out": out, "lse": cache.lse, "weights": cache.probs}
    terms = VF.term_scales(inp, truth, np.zeros(cache.lse.shape, dtype=bool))
    assert terms["out"] == pytest.approx(np.abs(inp.v).max(axis=(2, 3)).max(), rel=1e-12)
    assert terms["dq"] > 0.1 and terms["lse"] >= 1.0
    report = run_kernel(K.attention, "float32", cases=[case], supports=())
    r = report.results[0]
    assert r.tensors["dq"].magnitude == 0.0 and r.tensors["dq"].status == "degenerate"
    assert r.tensors["dv"].status == "pass"


def test_a_tensor_whose_terms_are_zero_keeps_a_floor():
    """Scores of zero (q = k = 0) make dq and dk exactly zero, and their terms too: the floor
    is then relative to FLOOR_SCALE, so that a dq off by far less than any rounding is
    degenerate, not failed."""
    flat = VC.Case(name="flat", Lq=9, Lk=17, score_std=0.0)

    def backward(dout, cache):
        g = F.sdpa_backward(dout, cache)
        return g.dq + 1e-30, g.dk, g.dv

    r = VF.verify(npattn_kernel, backward=backward, returns_lse=True, dtype="float64",
                  cases=[flat]).results[0]
    t = r.tensors["dq"]
    assert t.magnitude == 0.0 and t.floor == VF.FLOORS["float64"] * VF.FLOOR_SCALE, t
    assert t.status == "degenerate" and r.status == "degenerate", r.tensors


def test_dmask_and_dlse_floors_follow_ds():
    """dmask's terms are p (|dp| + |delta|) summed over the heads a (B, 1, Lq, Lk) mask was
    broadcast along; dlse adds |dlse| to |delta| (in dq, dk, dmask and dsinks)."""
    case = next(c for c in VC.panel("mask_float") if c.options == ("mask_float",))
    inp = VC.case_inputs(case)
    assert inp.options["mask"].shape == (case.B, 1, case.Lq, case.Lk) and case.Hq == 2
    assert inp.dlse.shape == (case.B, case.Hq, case.Lq) and 0.8 < inp.dlse.std() < 1.2
    out, cache = F.sdpa_forward(inp.q, inp.k, inp.v, **inp.options)
    truth = {"out": out, "lse": cache.lse, "weights": cache.probs}
    empty = np.zeros(cache.lse.shape, dtype=bool)
    p = cache.probs
    dp = np.abs(inp.dout @ np.swapaxes(inp.v, -1, -2))
    delta = np.abs(np.sum(inp.dout * out, axis=-1, keepdims=True))
    plain = VF.term_scales(inp, truth, empty)
    want = (p * (dp + delta)).sum(axis=1, keepdims=True).max()
    assert plain["dmask"] == pytest.approx(want, rel=1e-12)
    with_dlse = VF.term_scales(inp, truth, empty, inp.dlse)
    want = (p * (dp + delta + np.abs(inp.dlse)[..., None])).sum(axis=1, keepdims=True).max()
    assert with_dlse["dmask"] == pytest.approx(want, rel=1e-12)
    assert with_dlse["dq"] > plain["dq"] and with_dlse["out"] == plain["out"]
    # the other arrays of a case do not depend on dlse being drawn last
    assert np.array_equal(VC.case_inputs(case).dout, inp.dout)


def test_floors_under_gqa_and_dropout_follow_each_query_heads_own_sums():
    """Query head h reads K/V head h // G, dv and dk of a K/V head sum over its G query
    heads, and out and dv take the weights after dropout (npattn's cache.attn): the terms,
    head by head in loops, from the module docstring's formulas."""
    case = VC.Case("gqa-dropout", Hq=4, Hkv=2, Lq=9, Lk=13, Dh=8, Dv=6, dropout_p=0.3,
                   options=("dropout_mask", "gqa", "sinks"))
    inp = VC.case_inputs(case, seed=3)
    out, cache = F.sdpa_forward(inp.q, inp.k, inp.v, **inp.options)
    truth = {"out": out, "lse": np.asarray(cache.lse), "weights": cache.probs}
    terms = VF.term_scales(inp, truth, np.zeros(truth["lse"].shape, dtype=bool))
    G, scale = case.Hq // case.Hkv, 1.0 / math.sqrt(case.Dh)
    want = {"out": 0.0, "dq": 0.0}
    dsinks = np.zeros(case.Hq)  # [Hq]: sum over rows of p_sink |delta|
    dv = np.zeros(inp.v.shape)  # [B, Hkv, Lk, Dv]
    dk = np.zeros(inp.k.shape)  # [B, Hkv, Lk, Dh]
    for b in range(case.B):
        for h in range(case.Hq):
            g = h // G  # the K/V head of query head h
            k, v, q, dout = inp.k[b, g], inp.v[b, g], inp.q[b, h], inp.dout[b, h]
            a, p = np.abs(cache.attn[b, h]), cache.probs[b, h]  # [Lq, Lk] after / before dropout
            keep = np.abs(cache.attn[b, h]) / np.where(p > 0.0, p, 1.0)  # mask / (1 - p)
            dp = np.abs(dout @ v.T) * keep  # [Lq, Lk]
            delta = np.abs(np.sum(dout * out[b, h], axis=-1))[:, None]  # [Lq, 1]
            ds = p * (dp + delta)  # [Lq, Lk]
            want["out"] = max(want["out"], (a @ np.abs(v)).max())
            want["dq"] = max(want["dq"], (ds @ np.abs(k)).max() * scale)
            dv[b, g] += a.T @ np.abs(dout)
            dk[b, g] += ds.T @ np.abs(q) * scale
            p_sink = 1.0 - p.sum(axis=-1)  # [Lq]: the weight the sink takes from each row
            dsinks[h] += np.sum(p_sink * delta[:, 0])
    want["dv"], want["dk"], want["dsinks"] = dv.max(), dk.max(), dsinks.max()
    for n in want:
        assert terms[n] == pytest.approx(want[n], rel=1e-12), n
    assert terms["lse"] == pytest.approx(np.abs(truth["lse"]).max(), rel=1e-12)
    # lse's terms are at least 1: a row of one key with a small score has |lse| < 1
    one = VC.case_inputs(VC.Case("one-key", Lq=5, Lk=1, Dh=8, Dv=8, score_std=0.1), seed=3)
    out, cache = F.sdpa_forward(one.q, one.k, one.v)
    assert np.abs(cache.lse).max() < 0.5
    small = {"out": out, "lse": np.asarray(cache.lse), "weights": cache.probs}
    assert VF.term_scales(one, small, np.zeros(cache.lse.shape, dtype=bool))["lse"] == 1.0


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_npattn_error_is_npattn_in_dtype_against_float64_on_the_same_rounded_inputs(dtype):
    """The truth is npattn in float64 on the inputs rounded to dtype (q, k, v, dout, the float
    mask, sinks, dlse; ALiBi slopes to float32, here 2**(-8/3) and its powers, which float32
    rounds), not on the inputs before rounding: each tensor's npattn_error is
    max|npattn in dtype - that truth|, bfloat16 computed in float32 and the results (not lse)
    rounded back; an npattn_error measured from the unrounded inputs would hold the
    rounding of the inputs and widen every budget."""
    from npattn import attention as A

    if dtype == "bfloat16":  # NumPy's bfloat16 is ml_dtypes' (the jax extra installs it)
        pytest.importorskip("ml_dtypes")

    def kernel(q, k, v, mask, sinks, alibi_slopes):  # npattn in float32, out in q's dtype
        up = [x.astype(np.float32) for x in (q, k, v, mask, sinks)]
        out, lse, cache = npattn_kernel(*up[:3], mask=up[3], sinks=up[4],
                                        alibi_slopes=alibi_slopes)
        return out.astype(q.dtype), lse, cache, q.dtype

    def backward(dout, cache, dtype, dlse):
        g = npattn_backward(dout.astype(np.float32), cache, dlse=dlse)
        return tuple(x.astype(dtype) for x in g)

    case = VC.Case("rounded", Hq=3, Hkv=3, Lq=9, Lk=13, Dh=8, Dv=8,
                   options=("alibi", "mask_float", "sinks"))
    report = VF.verify(kernel, backward=backward, dtype=dtype, returns_lse=True, lse_grad=True,
                       mask_grad=True, supports="alibi,mask_float,sinks", cases=[case])
    assert report.ok, report.format()
    got = report.results[0].tensors
    inp = VC.case_inputs(case)
    if dtype == "bfloat16":
        def rounded(x):
            return VF.round_to_bfloat16(x).astype(np.float64)
    else:
        def rounded(x):
            return np.asarray(x, dtype=np.float32).astype(np.float64)
    mask = np.where(np.isfinite(inp.options["mask"]), rounded(inp.options["mask"]), -np.inf)
    args = {"q": rounded(inp.q), "k": rounded(inp.k), "v": rounded(inp.v), "mask": mask,
            "sinks": rounded(inp.options["sinks"]), "dout": rounded(inp.dout),
            "dlse": rounded(inp.dlse),
            "alibi_slopes": inp.options["alibi_slopes"].astype(np.float32).astype(np.float64)}

    def npattn_in(work):
        a = {n: x.astype(work) for n, x in args.items()}
        out, cache = A.sdpa_forward(a["q"], a["k"], a["v"], mask=a["mask"], sinks=a["sinks"],
                                    alibi_slopes=a["alibi_slopes"], impl="reference")
        g = A.sdpa_backward(a["dout"], cache, dlse=a["dlse"])
        res = {"out": out, "lse": cache.lse, "dq": g.dq, "dk": g.dk, "dv": g.dv,
               "dmask": g.dmask, "dsinks": g.dsinks}
        return {n: np.asarray(x, dtype=np.float64) for n, x in res.items()}

    truth, ref = npattn_in(np.float64), npattn_in(np.float32)
    if dtype == "bfloat16":  # the results back in bfloat16; lse stays float32
        ref = {n: (x if n == "lse" else rounded(x)) for n, x in ref.items()}
    finite = np.isfinite(mask)  # dmask is compared where the mask is finite
    for n in VF.TENSORS:
        diff = np.abs(ref[n] - truth[n])
        want = float(np.max(diff[finite] if n == "dmask" else diff))
        assert want > 0.0 and got[n].npattn_error == pytest.approx(want, rel=1e-9), n


@pytest.mark.parametrize("seed, lse_grad", [(16, False), (8, True)])
def test_a_flash_backward_passes_where_lse_is_large(seed, lse_grad):
    """The example kernel rebuilds p = exp(s - lse) from a float32 lse of ~300 in the case of
    shifted rows: its dv (dq with dlse) was 1.27 (1.37) budgets over npattn's own error and
    the floor, which do not hold the rounding of lse; the floor's lse term does."""
    report = run_kernel(K.attention, "float32", lse_grad=lse_grad, seed=seed, head_dims=(8, 16),
                        cases=["base-scores8-shift-65x127"])
    assert report.ok, report.format()
    r = report.results[0]
    for n in ("dq", "dk", "dv"):
        t = r.tensors[n]
        assert t.status == "pass" and t.ratio < 0.7, (n, t.ratio)
    inp = VC.case_inputs(r.case, seed)
    _, cache = F.sdpa_forward(inp.q, inp.k, inp.v)
    assert np.abs(cache.lse).max() > 200.0  # the case this is about: a large lse


def test_lse_unit_is_the_unit_roundoff_of_lse_s_dtype():
    """Half precision keeps lse in float32: its unit roundoff is float32's."""
    assert VF.lse_unit("float64") == 2.0**-53
    assert VF.lse_unit("float32") == VF.lse_unit("float16") == VF.lse_unit("bfloat16") == 2.0**-24


@pytest.mark.parametrize("dtype, phi", [("float64", 2.0**-40), ("float32", 2.0**-20),
                                        ("float16", 2.0**-10), ("bfloat16", 2.0**-7)])
def test_the_default_floor_is_the_documented_unit_of_the_dtype_times_the_terms(dtype, phi):
    """floor = phi_dtype * terms + the rounding of lse, with phi 2**-40 for float64, 2**-20 for
    float32, 2**-10 for float16 and 2**-7 for bfloat16 (docs/verify.md): floors= of 0 leaves
    the lse part alone and floors= of 1 adds the terms to it, so the default floor gives phi."""
    if dtype == "bfloat16":  # NumPy's bfloat16 is ml_dtypes' (the jax extra installs it)
        pytest.importorskip("ml_dtypes")

    def kernel(q, k, v, **options):  # npattn in float32, out in q's dtype
        up = (x.astype(np.float32) for x in (q, k, v))
        return F.sdpa_forward(*up, **options)[0].astype(q.dtype)

    kw = dict(dtype=dtype, cases=["base-65x128"])
    default, zero, one = (VF.verify(kernel, floors=floors, **kw).results[0].tensors["out"].floor
                          for floors in (None, {dtype: 0.0}, {dtype: 1.0}))
    terms = one - zero
    assert terms > 0.5 and zero < phi * terms
    assert (default - zero) / terms == pytest.approx(phi, rel=1e-9, abs=0.0)  # 2**-40 < 1e-12


def test_the_lse_floor_bounds_a_rounded_lse():
    """Rebuilding p from lse + d, |d_i| <= u |lse_i|, moves each gradient by at most
    u * terms_lse; dq_i by exactly -d_i dq_i, so with every d_i = +u |lse_i| dq reaches it."""
    case = VC.Case("lse", Lq=33, Lk=70, Dh=8, Dv=8, options=("mask_float", "sinks", "gqa"),
                   Hq=4, Hkv=2, score_std=4.0, score_shift=50.0)
    inp = VC.case_inputs(case, seed=1)
    out, cache = F.sdpa_forward(inp.q, inp.k, inp.v, **inp.options)
    lse = np.asarray(cache.lse)  # [B, Hq, Lq]
    g = F.sdpa_backward(inp.dout, cache, dlse=inp.dlse)
    truth = {"out": out, "lse": lse, "weights": cache.probs, "dq": g.dq}
    bound = VF.lse_scales(inp, truth, inp.dlse)
    assert set(bound) == {"dq", "dk", "dv", "dmask", "dsinks"}
    u = VF.lse_unit("float32")
    assert u == 2.0**-24 and VF.lse_unit("bfloat16") == u and VF.lse_unit("float64") == 2.0**-53
    # the example's FlashAttention backward in float64, from its saved lse moved by d
    _, _, saved = K.attention(inp.q, inp.k, inp.v, **inp.options)
    exact = K.attention_backward(inp.dout, saved, dlse=inp.dlse)
    rng = np.random.default_rng(0)
    for d in (u * np.abs(lse), u * np.abs(lse) * rng.choice([-1.0, 1.0], size=lse.shape)):
        moved = K.attention_backward(inp.dout, saved._replace(lse=saved.lse + d), dlse=inp.dlse)
        for n in bound:
            change = float(np.max(np.abs(getattr(moved, n) - getattr(exact, n))))
            assert 0.0 < change <= u * bound[n] * (1.0 + 1e-3), (n, change, u * bound[n])
        if d.min() > 0.0:  # dq_i moves by -d_i dq_i
            np.testing.assert_allclose(moved.dq - exact.dq, -d[..., None] * exact.dq,
                                       rtol=1e-3, atol=1e-12 * np.abs(exact.dq).max())
            change = float(np.max(np.abs(moved.dq - exact.dq)))
            assert change == pytest.approx(u * bound["dq"], rel=1e-3)
    # dsinks = sum_i p_sink_i (dlse_i - delta_i) moves by -sum_i d_i p_sink_i (dlse_i - delta_i):
    # d_i = u |lse_i| of the sign of delta_i - dlse_i reaches the bound
    delta = np.sum(inp.dout * out, axis=-1)  # [B, Hq, Lq]
    d = u * np.abs(lse) * np.sign(delta - inp.dlse)
    moved = K.attention_backward(inp.dout, saved._replace(lse=saved.lse + d), dlse=inp.dlse)
    change = float(np.max(np.abs(moved.dsinks - exact.dsinks)))
    assert change == pytest.approx(u * bound["dsinks"], rel=1e-3)


@pytest.mark.parametrize("seed, head_dims, splits", [(13, None, 3), (7, (8, 16), 2)])
def test_a_split_kv_forward_passes_where_lse_is_large(seed, head_dims, splits):
    """A flash-decoding forward merges partial outputs through their float32 lse_s: in the
    case of shifted rows (|lse| ~ 400) its out was 1.40 (seed 13, 3 splits; 1.29 seed 7 with
    head widths 8, 16 and 2 splits) budgets over npattn's error and the floor, and with the
    FlashAttention backward, which reads that out in delta, dq 1.62 (1.72); the floor's merge
    term holds both."""
    def split_kv(q, k, v, **options):
        return K.attention_split_kv(q, k, v, splits=splits, **options)

    report = run_kernel(split_kv, "float32", mask_grad=True, lse_grad=True, seed=seed,
                        head_dims=head_dims)
    assert report.ok, report.format()
    assert len(report.results) == len(VC.panel(ALL))
    worst = max(t.ratio for r in report.results for t in r.tensors.values())
    assert worst < 0.95, worst
    shifted = next(r for r in report.results if r.case.name == "base-scores8-shift-65x127")
    inp = VC.case_inputs(shifted.case, seed)
    _, cache = F.sdpa_forward(inp.q, inp.k, inp.v)
    assert np.abs(cache.lse).max() > 200.0  # the case this is about: a large lse
    # a split kernel is not the example's: the same case, other numbers
    one, _, _ = K.attention(*(t.astype(np.float32) for t in (inp.q, inp.k, inp.v)))
    split, lse, _ = split_kv(*(t.astype(np.float32) for t in (inp.q, inp.k, inp.v)))
    assert not np.array_equal(one, split) and lse.dtype == np.float32


def test_a_backward_that_rounds_its_scores_otherwise_than_its_forward_passes(monkeypatch):
    """A FlashAttention backward recomputes the scores, and where it sums q_i . k_j in another
    order than its forward did, its p = exp(s - lse) is off by the difference of the two
    roundings, which npattn (whose softmax divides by the row sum of its own scores) does not
    make. Here the forward sums the head axis in reverse: in the case of shifted rows (|s| up
    to ~400) dv is over the budget without the floor's term for recomputed scores, and well
    within it with the term."""
    def reordered(q, k, v, **options):
        out, lse, saved = K.attention(q[..., ::-1], k[..., ::-1], v, **options)
        return out, lse, saved._replace(q=np.asarray(q, saved.q.dtype), k=np.asarray(k, saved.k.dtype))

    kw = dict(dtype="float32", mask_grad=True, lse_grad=True, seed=5, cases=["base-scores8-shift-65x127"])
    report = run_kernel(reordered, **kw)
    assert report.ok, report.format()
    worst = max(t.ratio for t in report.results[0].tensors.values())
    assert worst < 0.5, worst
    monkeypatch.setattr(VF, "SCORE_ROUNDINGS", 0.0)  # the floor without the term
    without = run_kernel(reordered, **kw)
    assert not without.ok and without.results[0].tensors["dv"].status == "fail", without.format()


def test_the_split_kv_example_passes_at_float16_and_equals_the_one_split_kernel():
    report = run_kernel(K.attention_split_kv, "float16", mask_grad=True, lse_grad=True)
    assert report.ok, report.format()
    inp = VC.case_inputs(VC.panel(ALL)[-1])
    a = K.attention(inp.q, inp.k, inp.v, **inp.options)
    b = K.attention_split_kv(inp.q, inp.k, inp.v, splits=1, **inp.options)
    assert np.array_equal(a[0], b[0]) and np.array_equal(a[1], b[1])
    with pytest.raises(ValueError, match="splits: expected an int >= 1, got 0"):
        K.attention_split_kv(inp.q, inp.k, inp.v, splits=0)


def test_the_merge_floor_bounds_rounded_partial_lses():
    """Merging partials whose lse_s are moved by d_s, |d_s| <= u |lse_s|, through a merged
    lse moved by c, |c| <= u |lse|, moves out by at most u * merge_scales()["out"], whatever
    the splits (the sink one more partial, out_s = 0); a backward that reads the moved out
    moves each gradient by at most u * its entry."""
    case = VC.Case("merge", Lq=33, Lk=70, Dh=8, Dv=8, Hq=4, Hkv=2, score_std=4.0,
                   score_shift=50.0, dropout_p=0.2,
                   options=("mask_float", "sinks", "gqa", "dropout_mask"))
    inp = VC.case_inputs(case, seed=1)
    out, cache = F.sdpa_forward(inp.q, inp.k, inp.v, **inp.options)
    lse, p = np.asarray(cache.lse), cache.probs  # [B, Hq, Lq], [B, Hq, Lq, Lk]
    g = F.sdpa_backward(inp.dout, cache, dlse=inp.dlse)
    bound = VF.merge_scales(inp, {"out": out, "lse": lse, "weights": p, "dq": g.dq})
    assert bound["dv"] == 0.0 and set(bound) == {"out", "dq", "dk", "dv", "dmask", "dsinks"}
    u = VF.lse_unit("float32")
    vr = np.repeat(inp.v, 2, axis=1)  # [B, Hq, Lk, Dv]
    a = p * inp.options["dropout_mask"] / (1.0 - inp.options["dropout_p"])  # after dropout
    sink = np.broadcast_to(inp.options["sinks"][None, :, None], lse.shape)  # [B, Hq, Lq]
    _, _, saved = K.attention(inp.q, inp.k, inp.v, **inp.options)
    exact = K.attention_backward(inp.dout, saved, dlse=inp.dlse)
    rng = np.random.default_rng(0)
    largest = 0.0
    for cuts in ([0, 35, 70], [0, 23, 47, 70], list(range(0, 71, 10))):
        lses, outs = [sink], [np.zeros_like(out)]
        for c0, c1 in zip(cuts[:-1], cuts[1:]):
            w = p[..., c0:c1].sum(axis=-1)  # [B, Hq, Lq] = exp(lse_s - lse)
            with np.errstate(divide="ignore"):
                lses.append(lse + np.log(w))
            safe = np.where(w > 0.0, w, 1.0)[..., None]
            outs.append(np.where(w[..., None] > 0.0, a[..., c0:c1] @ vr[:, :, c0:c1] / safe, 0.0))
        L, O = np.stack(lses), np.stack(outs)  # [S, B, Hq, Lq], [S, B, Hq, Lq, Dv]
        for _ in range(3):
            d = u * np.where(np.isfinite(L), np.abs(L), 0.0) * rng.choice([-1.0, 1.0], L.shape)
            top = (L + d).max(axis=0)
            merged_lse = top + np.log(np.sum(np.exp(L + d - top), axis=0))
            merged_lse += u * np.abs(merged_lse) * rng.choice([-1.0, 1.0], lse.shape)  # c
            merged = np.sum(np.exp(L + d - merged_lse)[..., None] * O, axis=0)  # [B, Hq, Lq, Dv]
            change = float(np.max(np.abs(merged - out)))
            assert change <= u * bound["out"] * (1.0 + 1e-3), (cuts, change, u * bound["out"])
            largest = max(largest, change / (u * bound["out"]))
            moved = K.attention_backward(inp.dout, saved._replace(out=merged), dlse=inp.dlse)
            for n in ("dq", "dk", "dmask", "dsinks"):
                change = float(np.max(np.abs(getattr(moved, n) - getattr(exact, n))))
                assert 0.0 < change <= u * bound[n] * (1.0 + 1e-3), (n, change, u * bound[n])
            assert np.array_equal(moved.dv, exact.dv)
    assert largest > 0.5  # the bound is near what random signs reach


def test_a_saturated_softmax_makes_dq_and_dk_degenerate():
    case = VC.Case("saturated", Lq=33, Lk=47, Dh=16, Dv=16, score_std=200.0)
    report = run_kernel(K.attention, "float64", cases=[case], supports=())
    r = report.results[0]
    assert r.status == "degenerate" and report.ok
    assert r.tensors["dq"].status == r.tensors["dk"].status == "degenerate"
    assert "saturated softmax" in r.tensors["dq"].note
    assert r.tensors["out"].status == r.tensors["dv"].status == "pass"
    with pytest.raises(AssertionError, match="allow_degenerate=False"):
        assert_attention_close(K.attention, backward=K.attention_backward, returns_lse=True,
                               dtype="float64", cases=[case], allow_degenerate=False)


def test_the_saturated_share_counts_the_rows_that_attend_something():
    """Two of each head's three rows blanked, the third saturated: all the attended rows put
    > 0.999 on one key (a third of all rows), and dq and dk are degenerate."""
    case = VC.Case("few-rows", B=1, Lq=3, Lk=4, Dh=8, Dv=8, score_std=30.0,
                   options=("mask_bool",), empty_rows=True)
    inp = VC.case_inputs(case, seed=2)
    _, cache = F.sdpa_forward(inp.q, inp.k, inp.v, **inp.options)
    attended = cache.probs.sum(axis=-1) > 0.0  # [B, Hq, Lq]
    top = cache.probs.max(axis=-1) > 0.999  # [B, Hq, Lq]
    assert np.all(top[attended]) and top.mean() < 0.5  # saturated when empty rows are left out
    report = run_kernel(K.attention, "float64", cases=[case], supports="mask_bool,empty_rows",
                        seed=2)
    r = report.results[0]
    assert report.ok and r.status == "degenerate"
    for n in ("dq", "dk"):
        assert r.tensors[n].status == "degenerate" and "100% of rows" in r.tensors[n].note, n
    assert r.tensors["dv"].status == r.tensors["out"].status == "pass"


def test_bfloat16_rounding_is_round_to_nearest_even():
    x = np.array([1.0, 1.0 + 2**-8, 1.0 + 3 * 2**-8, -2.5e-3, 3.0e38, np.inf, -np.inf])
    got = VF.round_to_bfloat16(x)
    # by hand: bfloat16 keeps 7 fraction bits, spacing 2^-7 at 1; ties go to the even neighbour
    assert got[0] == 1.0 and got[1] == 1.0 and got[2] == 1.0 + 2**-6
    assert got[5] == np.inf and got[6] == -np.inf
    ml_dtypes = pytest.importorskip("ml_dtypes", reason="the reference bfloat16 comes from ml_dtypes")

    want = x.astype(np.float32).astype(ml_dtypes.bfloat16).astype(np.float32)
    assert np.array_equal(got, want)


# --------------------------------------------------------------------------
# other kernels: torch's SDPA, npattn.compat.flash_attn_func, layouts


TORCH_COMBOS = [("causal", "gqa"), ("gqa", "mask_bool"), ("gqa", "mask_float"),
                ("causal", "dv_ne_dk"), ("dv_ne_dk", "mask_float"), ("dv_ne_dk", "gqa", "mask_bool"),
                ("mask_float", "scale"), ("causal", "scale")]


def torch_sdpa(q, k, v, mask=None, is_causal=False, scale=None, enable_gqa=False):
    import torch

    return torch.nn.functional.scaled_dot_product_attention(
        q, k, v, attn_mask=mask, is_causal=is_causal, scale=scale, enable_gqa=enable_gqa)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_torch_sdpa_passes_with_its_options(dtype):
    pytest.importorskip("torch")
    report = VF.verify(torch_sdpa, dtype=dtype, backend="torch", autograd="torch",
                       supports="causal,gqa,mask_bool,mask_float,dv_ne_dk,scale,empty_rows",
                       combos=TORCH_COMBOS)
    assert report.ok, report.format()
    assert report.config["gradients"] and len(report.results) >= 25


def test_torch_sdpa_passes_with_mask_grads():
    """A float mask that requires grad: torch's SDPA gives dmask, within npattn's budget."""
    pytest.importorskip("torch")
    report = VF.verify(torch_sdpa, dtype="float32", backend="torch", autograd="torch",
                       mask_grad=True, supports="gqa,mask_float,dv_ne_dk,scale,empty_rows",
                       combos=[("gqa", "mask_float"), ("dv_ne_dk", "mask_float"),
                               ("mask_float", "scale")])
    assert report.ok, report.format()
    masked = [r for r in report.results if "mask_float" in r.case.options]
    assert len(masked) == 5 and all("dmask" in r.tensors for r in masked)
    assert sum(r.tensors["dmask"].status == "pass" for r in masked) >= 4
    assert any(r.case.empty_rows for r in masked)  # fully masked rows: -inf entries skipped
    # the same kernel with its mask detached gives no dmask: required, it fails as missing
    def detached(q, k, v, mask=None, **kw):
        return torch_sdpa(q, k, v, mask=None if mask is None else mask.detach(), **kw)

    bad = VF.verify(detached, dtype="float32", backend="torch", autograd="torch",
                    mask_grad=True, supports="mask_float", cases=["mask_float-65x129"])
    assert not bad.ok and "missing" in bad.results[0].tensors["dmask"].note
    # with autograd="torch", out as a NumPy array or a tensor outside autograd is named as
    # what fn returned (torch's own AssertionError / RuntimeError came through as "fn raised")
    def as_numpy(q, k, v, **kw):
        return torch_sdpa(q, k, v, **kw).detach().numpy()

    def no_graph(q, k, v, **kw):
        return torch_sdpa(q.detach(), k.detach(), v.detach(), **kw)

    for fn, text in ((as_numpy, "fn: expected out as a torch.Tensor with autograd='torch', got "
                                "numpy.ndarray"),
                     (no_graph, "fn: expected out computed from q, k, v by torch's autograd")):
        r = VF.verify(fn, dtype="float32", backend="torch", autograd="torch",
                      cases=["base-65x128"]).results[0]
        assert r.status == "fail" and text in r.error, r.error
        assert "not what verify reads" in r.hint


def torch_dense(q, k, v, mask=None, is_causal=False, scale=None, sinks=None):
    """Dense attention in torch ops that returns (out, lse), for autograd with dlse; a sink
    is one more score in each row, of a key that carries no value."""
    import torch

    scale = q.shape[-1] ** -0.5 if scale is None else scale
    s = (q @ k.transpose(-1, -2)) * scale  # [B, H, Lq, Lk]
    if mask is not None:
        s = s + mask
    if is_causal:
        keep = torch.ones(s.shape[-2:], dtype=torch.bool).tril()
        s = s.masked_fill(~keep, float("-inf"))
    if sinks is not None:  # [H] -> one more column: [B, H, Lq, Lk + 1]
        s = torch.cat([s, sinks[None, :, None, None].expand(*s.shape[:-1], 1)], dim=-1)
    p = torch.softmax(s, dim=-1)[..., :v.shape[-2]]  # [B, H, Lq, Lk]: the sink's weight dropped
    return p @ v, torch.logsumexp(s, dim=-1)


def test_torch_autograd_with_dlse_and_dmask():
    pytest.importorskip("torch")
    kw = dict(dtype="float32", backend="torch", autograd="torch", returns_lse=True,
              supports="causal,mask_float,scale", combos=[("mask_float", "scale")])
    report = VF.verify(torch_dense, lse_grad=True, mask_grad=True, **kw)
    assert report.ok, report.format()
    assert report.config["lse_grad"] and all("dmask" in r.tensors for r in report.results
                                             if "mask_float" in r.case.options)

    def lse_detached(q, k, v, **options):  # lse carries no gradient: dlse is lost
        out, lse = torch_dense(q, k, v, **options)
        return out, lse.detach() * 1.0 + 0.0 * q.sum()

    lost = VF.verify(lse_detached, lse_grad=True, **kw)
    assert not lost.ok and "+ dlse" in lost.failures[0].hint
    assert VF.verify(lse_detached, **kw).ok  # without lse_grad it cannot be seen
    # mask_grad=None: the mask is no leaf of autograd, and no dmask is compared
    plain = VF.verify(torch_dense, **kw)
    assert plain.ok and not any("dmask" in r.tensors for r in plain.results)


def test_torch_autograd_gives_dsinks():
    """Under autograd the sinks are a leaf too: their gradient is compared with npattn's."""
    pytest.importorskip("torch")
    report = VF.verify(torch_dense, dtype="float32", backend="torch", autograd="torch",
                       returns_lse=True, lse_grad=True, supports="sinks,causal",
                       combos=[("causal", "sinks")])
    assert report.ok, report.format()
    sinks = [r for r in report.results if "sinks" in r.case.options]
    assert len(sinks) == 3 and all(r.tensors["dsinks"].status == "pass" for r in sinks)


@pytest.mark.parametrize("supports", [ALL, ("softcap", "mask_float"), ("alibi", "softcap", "causal")])
def test_the_order_of_softcap_and_the_additive_terms_has_its_own_pairs(supports, monkeypatch):
    """softcap before the float mask and ALiBi is a convention: its pairs are in every panel
    that declares both options, over several keys and rows (one key has weight 1 either way),
    and they come after the other combinations, which keep their cases."""
    cases = VC.panel(supports)
    for pair in VC.ORDER_PAIRS:
        held = [c for c in cases if set(c.options) == set(pair)]
        assert len(held) == int(set(pair) <= set(supports)), (pair, [c.name for c in cases])
        assert all(c.Lq > 1 and c.Lk > 1 for c in held)
    monkeypatch.setattr(VC, "ORDER_PAIRS", ())
    without = VC.panel(supports)
    if supports == ALL:  # the pairs are added after the panel's own cases, which stay as they were
        assert len(cases) == len(without) + 2 and cases[:len(without)] == without


@pytest.mark.parametrize("other", ["alibi", "mask_float"])
def test_the_hint_of_softcap_applied_last_names_the_order_with_alibi_and_a_float_mask(other):
    """softcap applied after the additive terms is wrong in the cases of softcap with ALiBi
    and with a float mask alike; the hint names the order in both."""
    supports = ("softcap", other)
    name = next(c.name for c in VC.panel(supports) if set(c.options) == set(supports))
    r = run_kernel(K.bug_softcap_last, supports=supports, cases=[name]).results[0]
    assert "out" in r.failing, r.failing
    assert "(the order: softcap * tanh(s / softcap) of the scaled scores first" in r.hint, r.hint


def test_failures_in_the_all_options_cases_alone_give_one_hint_not_one_per_option():
    def wrong_with_many_options(q, k, v, **options):
        out, lse, saved = K.attention(q, k, v, **options)
        many = {"sinks", "window", "softcap"} <= set(options)  # no pair holds all three
        return (out * 1.01 if many else out), lse, saved

    report = VF.verify(wrong_with_many_options, supports=ALL, returns_lse=True,
                       backward=K.attention_backward)
    assert {r.case.name for r in report.failures} == {c.name for c in VC.panel(ALL)
                                                      if c.name.startswith("all")}
    hints = report.hints()
    assert not any(h.startswith("every failing case holds") for h in hints), hints
    assert any(h.startswith("only cases holding") and "options together fail" in h for h in hints)


def test_torch_sdpa_fails_where_it_does_not_implement_the_option():
    pytest.importorskip("torch")

    def ignores_window(q, k, v, window=None, **kw):
        return torch_sdpa(q, k, v, **kw)

    report = VF.verify(ignores_window, dtype="float32", backend="torch", autograd="torch",
                       supports="window", combos=False)
    assert {r.case.name for r in report.failures} <= {c.name for c in VC.panel("window")
                                                      if "window" in c.options}
    assert report.failures and "every failing case holds 'window'" in report.format()


def flash(q, k, v, *, is_causal=False, align=None, window=None, softcap=None, alibi_slopes=None,
          dropout_p=0.0, dropout_mask=None, scale=None, enable_gqa=False):
    """npattn.compat.flash_attn_func in verify's terms: (out, lse, pullback)."""
    ws = (-1, -1) if window is None else tuple(-1 if w is None else w for w in window)
    (out, lse, _), pullback = compat.vjp(
        compat.flash_attn_func, q, k, v, dropout_p=dropout_p, softmax_scale=scale,
        causal=is_causal, window_size=ws, softcap=softcap or 0.0, alibi_slopes=alibi_slopes,
        return_attn_probs=True, dropout_mask=dropout_mask)
    return out, lse, pullback


def flash_backward(dout, pullback):
    return pullback(dout)[:3]


@pytest.mark.parametrize("dtype,backend", [("float64", "numpy"), ("float32", "numpy"),
                                           ("float16", "numpy"), ("bfloat16", "torch")])
def test_compat_flash_attn_func_passes(dtype, backend):
    if backend == "torch":
        pytest.importorskip("torch")
    report = VF.verify(flash, layout="bshd", dtype=dtype, backend=backend, backward=flash_backward,
                       returns_lse=True, align="bottom_right",
                       supports="causal_bottom_right,window,softcap,alibi,gqa,dv_ne_dk,"
                                "dropout_mask,scale,empty_rows")
    assert report.ok, report.format()
    # rows with nothing to attend (bottom-right causal, Lq > Lk): flash-attn's lse is +inf there
    assert any("causal_bottom_right" in r.case.options and r.case.Lq > r.case.Lk
               for r in report.results)


@pytest.mark.parametrize("layout", ["bshd", "bthd"])
def test_layouts(layout):
    def kernel(q, k, v, **options):
        out, lse, cache = npattn_kernel(*(np.swapaxes(t, 1, 2) for t in (q, k, v)), **options)
        lse = np.swapaxes(lse, 1, 2) if layout == "bthd" else lse  # JAX's (B, T, N)
        return np.swapaxes(out, 1, 2), lse, cache

    seen = []

    def backward(dout, cache, dlse):
        seen.append(dlse.shape)
        dlse = np.swapaxes(dlse, 1, 2) if layout == "bthd" else dlse  # lse's layout
        g = F.sdpa_backward(np.swapaxes(dout, 1, 2), cache, dlse=dlse)
        # a 5-tuple in npattn's order; dmask keeps the mask's (B, H, Lq, Lk) in every layout
        return tuple(np.swapaxes(t, 1, 2) for t in (g.dq, g.dk, g.dv)) + (g.dmask, g.dsinks)

    report = VF.verify(kernel, layout=layout, dtype="float32", backward=backward,
                       returns_lse=True, lse_grad=True, supports="gqa,dv_ne_dk,sinks,mask_float",
                       combos=False)
    assert report.ok, report.format()
    assert sum("dmask" in r.tensors for r in report.results) == 2
    c = report.results[0].case
    assert seen[0] == ((c.B, c.Lq, c.Hq) if layout == "bthd" else (c.B, c.Hq, c.Lq))
    # the same kernel read in the wrong layout fails
    wrong = VF.verify(kernel, layout="bhsd", dtype="float32", returns_lse=True,
                      cases=["base-65x128"])
    assert not wrong.ok and wrong.results[0].error is not None  # npattn refuses the shapes


# --------------------------------------------------------------------------
# layout "thd": flash-attn's varlen kernels, the sequences packed one after another


def flash_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *,
                 is_causal=False, align=None, window=None, softcap=None, alibi_slopes=None,
                 dropout_p=0.0, dropout_mask=None, scale=None, enable_gqa=False):
    """npattn.compat.flash_attn_varlen_func in verify's terms: (out, lse, pullback)."""
    ws = (-1, -1) if window is None else tuple(-1 if w is None else w for w in window)
    (out, lse, _), pullback = compat.vjp(
        compat.flash_attn_varlen_func, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
        max_seqlen_k, dropout_p=dropout_p, softmax_scale=scale, causal=is_causal,
        window_size=ws, softcap=softcap or 0.0, alibi_slopes=alibi_slopes,
        return_attn_probs=True, dropout_mask=dropout_mask)
    return out, lse, pullback


def flash_varlen_backward(dout, pullback, dlse=None):
    return pullback(dout, dlse=dlse)[:3]


VARLEN_SUPPORTS = "causal_bottom_right,window,softcap,alibi,gqa,dv_ne_dk,dropout_mask,scale,empty_rows"


@pytest.mark.parametrize("dtype,backend", [("float64", "numpy"), ("float16", "numpy"),
                                           ("bfloat16", "torch")])
def test_compat_flash_attn_varlen_func_passes_in_layout_thd(dtype, backend):
    """npattn.compat's varlen kernel, called on each case's B sequences packed, passes the
    panel of every option it takes, its lse (H, total_q) and dlse too; and it was called as
    flash-attn's varlen kernels are: (B * L, H, D) arrays, int32 cumulative lengths of the
    kernel's library."""
    if backend == "torch":
        pytest.importorskip("torch")
    calls = []

    def kernel(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, **options):
        host = [c.numpy().copy() if hasattr(c, "numpy") else c.copy()  # (torch's, on the CPU)
                for c in (cu_seqlens_q, cu_seqlens_k)]
        assert all(type(c) is type(q) for c in (cu_seqlens_q, cu_seqlens_k))
        calls.append((tuple(q.shape), tuple(k.shape), tuple(v.shape), *host, max_seqlen_q,
                      max_seqlen_k))
        return flash_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                            **options)

    report = VF.verify(kernel, layout="thd", dtype=dtype, backend=backend, returns_lse=True,
                       lse_grad=True, backward=flash_varlen_backward, align="bottom_right",
                       supports=VARLEN_SUPPORTS)
    assert report.ok, report.format()
    options = {o for r in report.results for o in r.case.options}
    assert options == set(VARLEN_SUPPORTS.split(",")) - {"empty_rows"}
    assert all(set(r.tensors) == {"out", "lse", "dq", "dk", "dv"} for r in report.results)
    # rows with nothing to attend (bottom-right causal, Lq > Lk): +inf in the varlen lse
    assert any("causal_bottom_right" in r.case.options and r.case.Lq > r.case.Lk
               for r in report.results)
    offsets_differ = 0
    for r, (qs, ks, vs, cq, ck, mq, mk) in zip(report.results, calls):
        c = r.case
        assert c.B == 2
        # two sequences of their own lengths: the first shorter by Lq // 4 queries and half
        # as many keys (at least one key left), the second of the case's (Lq, Lk)
        lq = [c.Lq - c.Lq // 4, c.Lq]
        lk = [c.Lk - min(c.Lq // 8, c.Lk - 1), c.Lk]
        assert (qs, ks, vs) == ((sum(lq), c.Hq, c.Dh), (sum(lk), c.Hkv, c.Dh),
                                (sum(lk), c.Hkv, c.Dv))
        assert cq.dtype == np.int32 and ck.dtype == np.int32
        assert cq.tolist() == [0, lq[0], lq[0] + lq[1]]
        assert ck.tolist() == [0, lk[0], lk[0] + lk[1]]
        assert (mq, mk) == (c.Lq, c.Lk)
        # the bottom-right offsets Lk_b - Lq_b differ wherever a query is taken off
        assert (lk[0] - lq[0] != lk[1] - lq[1]) == (c.Lq >= 4)
        offsets_differ += c.Lq >= 4
    assert offsets_differ >= len(report.results) // 2


def test_layout_thd_under_jax_vjp_with_dlse():
    """Under autograd="jax" the packed q, k, v are the primals and dlse, lse's cotangent, is
    in varlen's (H, total_q); the varlen keywords pass through jax.vjp as constants."""
    pytest.importorskip("jax")

    def kernel(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *,
               is_causal=False, align=None, enable_gqa=False):
        out, lse, _ = compat.flash_attn_varlen_func(
            q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal=is_causal,
            return_attn_probs=True)
        return out, lse

    report = VF.verify(kernel, layout="thd", dtype="float32", backend="jax", autograd="jax",
                       returns_lse=True, lse_grad=True, align="bottom_right",
                       supports="causal_bottom_right,gqa", cases=["gqa-128x65"])
    assert report.ok and set(report.results[0].tensors) == {"out", "lse", "dq", "dk", "dv"}, \
        report.format()

    def lse_per_batch(q, k, v, **layout):  # flash_attn_func's (B, H, Lq): of another shape
        out, lse = kernel(q, k, v, **layout)
        B = layout["cu_seqlens_q"].shape[0] - 1
        return out, lse.reshape(lse.shape[0], B, -1).swapaxes(0, 1)

    bad = VF.verify(lse_per_batch, layout="thd", dtype="float32", backend="jax", autograd="jax",
                    returns_lse=True, supports="gqa", cases=["gqa-128x65"])
    assert bad.results[0].failing == ["lse"], bad.format()


def numpy_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *,
                 per_sequence=True):
    """Dense attention on packed sequences, in NumPy: q (T, H, Dh), k (S, H, Dh), v (S, H, Dv)
    -> out (T, H, Dv), lse (H, T). Query t attends the keys of its own sequence (its index in
    cu_seqlens); with per_sequence False every key of the packed batch, cu_seqlens ignored."""
    T, S = q.shape[0], k.shape[0]
    s = np.einsum("thd,shd->hts", q, k) / math.sqrt(q.shape[-1])  # [H, T, S]
    if per_sequence:
        seq_q = np.searchsorted(cu_seqlens_q, np.arange(T), side="right")  # [T]
        seq_k = np.searchsorted(cu_seqlens_k, np.arange(S), side="right")  # [S]
        s = np.where(seq_q[:, None] == seq_k[None, :], s, -np.inf)  # [H, T, S]
    m = np.max(s, axis=-1, keepdims=True)  # [H, T, 1]
    e = np.exp(s - m)  # [H, T, S]
    total = np.sum(e, axis=-1, keepdims=True)  # [H, T, 1]
    out = np.einsum("hts,shd->thd", e / total, v)  # [T, H, Dv]
    return out, (m + np.log(total))[..., 0]  # [T, H, Dv], [H, T]


def numpy_varlen_options(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *,
                         is_causal=False, align=None, window=None, softcap=None,
                         alibi_slopes=None, dropout_p=0.0, dropout_mask=None, scale=None,
                         enable_gqa=False, offset="own", keep_at="start"):
    """flash-attn's varlen semantics in plain NumPy, one packed sequence at a time: causal,
    the window and ALiBi bottom-right on the sequence's own (Lq_b, Lk_b) (top-left when
    align is not "bottom_right"), the keep-mask of sequence b in dropout_mask[b, :, :Lq_b,
    :Lk_b] -> out (T, Hq, Dv), lse (Hq, T).

    The mistakes it can make: ``offset="max"`` aligns every sequence by max_seqlen_k -
    max_seqlen_q; ``keep_at="end"`` reads the keep-mask in [b, :, -Lq_b:, -Lk_b:]."""
    T, Hq, Dh = q.shape
    Hkv, Dv = k.shape[1], v.shape[2]
    scale = 1.0 / math.sqrt(Dh) if scale is None else scale
    out, lse = np.zeros((T, Hq, Dv)), np.full((Hq, T), -np.inf)
    heads = np.arange(Hq) // (Hq // Hkv)  # [Hq]: the K/V head of each query head
    for b in range(len(cu_seqlens_q) - 1):
        q0, q1, k0, k1 = cu_seqlens_q[b], cu_seqlens_q[b + 1], cu_seqlens_k[b], cu_seqlens_k[b + 1]
        lq, lk = q1 - q0, k1 - k0
        o = lk - lq if offset == "own" else max_seqlen_k - max_seqlen_q
        o = o if align == "bottom_right" else 0  # top-left: verify's align="top_left" cases
        qb = np.swapaxes(q[q0:q1], 0, 1)  # [Hq, lq, Dh]
        kb, vb = (np.swapaxes(t[k0:k1], 0, 1)[heads] for t in (k, v))  # [Hq, lk, D]
        s = qb @ np.swapaxes(kb, 1, 2) * scale  # [Hq, lq, lk]
        if softcap:
            s = softcap * np.tanh(s / softcap)
        d = np.arange(lq)[:, None] + o - np.arange(lk)[None, :]  # [lq, lk]: i + o - j
        if alibi_slopes is not None:
            slopes = alibi_slopes if alibi_slopes.ndim == 1 else alibi_slopes[b]  # [Hq]
            s = s - slopes[:, None, None] * np.abs(d)
        allowed = np.ones((lq, lk), dtype=bool)  # [lq, lk]
        if is_causal:
            allowed &= d >= 0
        if window is not None:
            left, right = window
            allowed &= (d <= left if left is not None else True) & (-d <= right if right is not None else True)
        s = np.where(allowed, s, -np.inf)  # [Hq, lq, lk]
        m = np.max(s, axis=-1, keepdims=True, initial=-np.inf)  # [Hq, lq, 1]
        m = np.where(np.isfinite(m), m, 0.0)
        e = np.exp(s - m)  # [Hq, lq, lk]
        total = np.sum(e, axis=-1, keepdims=True)  # [Hq, lq, 1]
        p = np.divide(e, total, out=np.zeros_like(e), where=total > 0)
        if dropout_mask is not None:
            keep = dropout_mask[b, :, :lq, :lk] if keep_at == "start" else \
                dropout_mask[b, :, dropout_mask.shape[2] - lq:, dropout_mask.shape[3] - lk:]
            p = p * keep / (1.0 - dropout_p)
        out[q0:q1] = np.swapaxes(p @ vb, 0, 1)
        with np.errstate(divide="ignore"):
            lse[:, q0:q1] = (m + np.log(total))[..., 0]
    return out, lse


VARLEN_FORWARD = "causal_bottom_right,window,softcap,alibi,gqa,dv_ne_dk,dropout_mask,scale,empty_rows"


@given(case=S.attention_cases(supports=VARLEN_FORWARD, align="bottom_right", max_batch=3,
                              max_len=40))
def test_hypothesis_layout_thd_packs_sequences_of_their_own_lengths(case):
    """Sequences of different lengths, each aligned on its own: a NumPy varlen kernel written
    from flash-attn's semantics passes every case (so no row that verify asks about is empty
    where the case's own lengths are not: the kernel declares empty rows, and a case whose
    packing blanked a row it should not would fail on verify's refusal with the next test)."""
    report = VF.verify(numpy_varlen_options, layout="thd", dtype="float64", returns_lse=True,
                       supports=VARLEN_FORWARD, align="bottom_right", cases=[case])
    assert report.ok, report.format()


@pytest.mark.parametrize("align,supports", [("bottom_right", "causal_bottom_right,window,alibi"),
                                            ("top_left", "causal,window,alibi")])
@given(data=st.data())
def test_hypothesis_layout_thd_leaves_no_row_empty_that_the_case_does_not(align, supports, data):
    """Without "empty_rows" declared the packing keeps every query's diagonal key, in either
    alignment: verify does not refuse the case (it would, naming the rows), and the kernel
    passes."""
    case = data.draw(S.attention_cases(supports=supports, align=align, max_batch=3, max_len=40))
    report = VF.verify(numpy_varlen_options, layout="thd", dtype="float64", returns_lse=True,
                       supports=supports, align=align, cases=[case])
    assert report.ok, report.format()


@given(case=S.attention_cases(supports=VARLEN_SUPPORTS, align="bottom_right", max_batch=3,
                              max_len=40))
def test_hypothesis_layout_thd_gradients_of_sequences_of_their_own_lengths(case):
    """npattn.compat's varlen kernel and its pullback, with dlse, pass every drawn case: the
    gradients of B <= 3 packed sequences of different lengths (dq of each sequence's queries,
    dk and dv of its keys, none of another's) are compared where each lies in the packing."""
    report = VF.verify(flash_varlen, layout="thd", dtype="float64", returns_lse=True,
                       lse_grad=True, backward=flash_varlen_backward, align="bottom_right",
                       supports=VARLEN_SUPPORTS, cases=[case])
    assert report.ok, report.format()
    assert set(report.results[0].tensors) == {"out", "lse", "dq", "dk", "dv"}


def test_layout_thd_fails_an_offset_of_the_longest_sequences():
    """Aligning every packed sequence by max_seqlen_k - max_seqlen_q, not its own
    Lk_b - Lq_b, fails out in the cases of causal, a window or ALiBi whose sequences'
    offsets differ; and passes the others."""
    kw = dict(layout="thd", dtype="float64", returns_lse=True, align="bottom_right",
              supports="causal_bottom_right,window,alibi,scale")
    good = VF.verify(numpy_varlen_options, **kw)
    assert good.ok, good.format()
    bad = VF.verify(lambda q, k, v, **o: numpy_varlen_options(q, k, v, **o, offset="max"), **kw)
    aligned = {"causal_bottom_right", "window", "alibi"}
    for r in bad.results:
        shifted = bool(aligned & set(r.case.options)) and r.case.Lq >= 4  # offsets differ
        assert ("out" in r.failing) == shifted, (r.case.describe(), r.failing)
    assert sum("out" in r.failing for r in bad.results) >= 5
    # the report names each sequence's lengths, and the worst token by sequence and position
    text = bad.format()
    assert "    sequences (Lq, Lk): (49, 121), (65, 129)\n" in text, text  # Lq 65 - 16, Lk 129 - 8
    first = next(r for r in bad.results if r.case.name == "causal_bottom_right-65x129")
    where = first.tensors["out"].where
    assert "token rows 0-48 (49 of 114)" in where and "(sequence 0, its query " in where, where
    assert first.to_dict()["sequences"] == [[49, 121], [65, 129]]
    # and the hint names the mistake in each failing case
    assert all("aligned by max_seqlen_k - max_seqlen_q" in r.hint for r in bad.failures), \
        [r.hint for r in bad.failures]


@pytest.mark.parametrize("align,supports", [("bottom_right", "causal_bottom_right,window,alibi"),
                                            ("top_left", "causal,window,alibi")])
def test_layout_thd_names_each_sequence_aligned_the_other_way(align, supports):
    """A varlen kernel that aligns causal, the window and ALiBi the other way, each sequence
    on its own (Lq_b, Lk_b), fails out and lse, and the hint names the flipped alignment, as
    it does in the other layouts, though the sequences' offsets Lk_b - Lq_b differ."""
    other = "top_left" if align == "bottom_right" else "bottom_right"

    def flipped(q, k, v, align=None, **options):
        return numpy_varlen_options(q, k, v, align=None if other == "top_left" else other,
                                    **options)

    report = VF.verify(flipped, layout="thd", dtype="float64", returns_lse=True,
                       supports=supports, align=align)
    differ = [r for r in report.results if len({b - a for a, b in r.sequences}) > 1
              and {"causal", "causal_bottom_right", "window", "alibi"} & set(r.case.options)]
    assert len(differ) >= 5
    # Lq = Lk: the padded batch's two alignments agree, its sequences' (Lk_b - Lq_b = 3, 1, 0) not
    square = VC.Case("window+alibi-16x16", B=3, Lq=16, Lk=16, options=("window", "alibi"),
                     window=(2, 0))
    differ += VF.verify(flipped, layout="thd", dtype="float64", returns_lse=True,
                        supports=supports, align=align, cases=[square]).results
    assert differ[-1].sequences == [(11, 14), (14, 15), (16, 16)]
    for r in differ:
        assert set(r.failing) == {"out", "lse"}, (r.case.name, r.failing)
        assert f"aligned {other} where {align} is asked" in r.hint, (r.case.name, r.hint)


def test_layout_thd_fails_a_keep_mask_read_at_the_wrong_corner():
    """Sequence b's keep-mask is dropout_mask[b, :, :Lq_b, :Lk_b]: read at the grid's far
    corner it fails out in the dropout cases whose first sequence is shorter."""
    kw = dict(layout="thd", dtype="float64", returns_lse=True, align="bottom_right",
              supports="dropout_mask,causal_bottom_right")
    good = VF.verify(numpy_varlen_options, **kw)
    assert good.ok, good.format()
    bad = VF.verify(lambda q, k, v, **o: numpy_varlen_options(q, k, v, **o, keep_at="end"), **kw)
    dropout = [r for r in bad.results if "dropout_mask" in r.case.options]
    assert dropout and all("out" in r.failing for r in dropout if r.case.Lq >= 4), bad.format()
    assert all(not r.failing for r in bad.results if "dropout_mask" not in r.case.options)


def test_layout_thd_fails_a_kernel_that_attends_across_the_packed_sequences():
    """The same NumPy kernel passes when each query attends its own sequence, and fails, out
    and lse, in every case when it ignores cu_seqlens and attends the whole packed batch."""
    good = VF.verify(numpy_varlen, layout="thd", dtype="float64", returns_lse=True)
    assert good.ok, good.format()

    def across(q, k, v, **layout):
        return numpy_varlen(q, k, v, **layout, per_sequence=False)

    bad = VF.verify(across, layout="thd", dtype="float64", returns_lse=True)
    assert len(bad.failures) == len(bad.results) == len(good.results) >= 7
    assert all(set(r.failing) == {"out", "lse"} for r in bad.results), bad.format()


def per_sequence_lse(lse, cu_seqlens_q, max_seqlen_q):
    """Varlen's lse (H, T) -> flash_attn_func's (B, H, max_seqlen_q), zeros past each end."""
    cu = np.asarray(cu_seqlens_q)
    out = np.zeros((len(cu) - 1, lse.shape[0], max_seqlen_q))  # [B, H, Lq]
    for b in range(len(cu) - 1):
        out[b, :, :cu[b + 1] - cu[b]] = lse[:, cu[b]:cu[b + 1]]
    return out


def test_layout_thd_fails_an_lse_in_another_layout():
    """lse is flash-attn varlen's (H, total_q): transposed, in flash_attn_func's (B, H, Lq), or
    a (total_q, H) array reshaped (not transposed) to (H, total_q), it fails; out passes each
    time."""
    case = VC.panel()[2]  # base-65x128
    H, Lq = case.Hq, case.Lq
    T = (Lq - Lq // 4) + Lq  # the two packed sequences' queries

    def kernel_with(lse_of):
        def kernel(q, k, v, **layout):
            out, lse = numpy_varlen(q, k, v, **layout)  # [T, H, Dv], [H, T]
            return out, lse_of(lse, layout)
        return kernel

    wrong = {"transposed": lambda lse, _: lse.T,
             "bshd": lambda lse, kw: per_sequence_lse(lse, kw["cu_seqlens_q"], kw["max_seqlen_q"]),
             "reshaped": lambda lse, _: np.ascontiguousarray(lse.T).reshape(H, T)}
    for name, lse_of in wrong.items():
        r = VF.verify(kernel_with(lse_of), layout="thd", dtype="float64", returns_lse=True,
                      cases=[case.name]).results[0]
        assert r.failing == ["lse"], (name, r.failing)
        assert r.tensors["out"].status == "pass"
    r = VF.verify(kernel_with(lambda lse, _: lse.T), layout="thd", dtype="float64",
                  returns_lse=True, cases=[case.name]).results[0]
    assert r.tensors["lse"].note == (
        f"shape: expected ({H}, {T}) (H, total_q) in layout 'thd', got ({T}, {H}) "
        "(axes swapped: flash-attn's varlen lse is (H, total_q))")


def test_layout_thd_names_an_unpacked_out_a_write_into_cu_seqlens_and_its_keywords():
    case = VC.panel()[2]  # base-65x128
    B, H, Lq, Dv = case.B, case.Hq, case.Lq, case.Dv
    T = (Lq - Lq // 4) + Lq  # the two packed sequences' queries

    def unpacked(q, k, v, cu_seqlens_q, max_seqlen_q, **layout):
        out, lse = numpy_varlen(q, k, v, cu_seqlens_q=cu_seqlens_q, max_seqlen_q=max_seqlen_q,
                                **layout)
        padded = np.zeros((B, max_seqlen_q, H, Dv))  # flash_attn_func's (B, Lq, H, Dv)
        for b in range(B):
            n = cu_seqlens_q[b + 1] - cu_seqlens_q[b]
            padded[b, :n] = out[cu_seqlens_q[b]:cu_seqlens_q[b + 1]]
        return padded, lse

    r = VF.verify(unpacked, layout="thd", dtype="float64", returns_lse=True,
                  cases=[case.name]).results[0]
    assert r.failing == ["out"] and r.tensors["out"].note == (
        f"shape: expected ({T}, {H}, {Dv}) (total_q, H, D) in layout 'thd', got "
        f"({B}, {Lq}, {H}, {Dv})")

    def writes(q, k, v, cu_seqlens_q, **layout):
        result = numpy_varlen(q, k, v, cu_seqlens_q=cu_seqlens_q, **layout)
        cu_seqlens_q[-1] += 1
        return result

    r = VF.verify(writes, layout="thd", dtype="float64", returns_lse=True,
                  cases=[case.name]).results[0]
    assert r.status == "fail" and r.written == ["cu_seqlens_q"] and not r.failing

    def dense(q, k, v):  # a kernel of another layout: the call of "thd" names what it lacks
        raise AssertionError("not called")

    r = VF.verify(dense, layout="thd", cases=[case.name]).results[0]
    assert "unexpected keyword argument 'cu_seqlens_q'" in r.error, r.error
    assert r.hint == ("fn does not take the keywords of layout='thd': it is called fn(q, k, v, "
                      "cu_seqlens_q=, cu_seqlens_k=, max_seqlen_q=, max_seqlen_k=, **options), "
                      "flash-attn's varlen names")


def test_layout_thd_compares_each_sequences_gradients():
    """A backward that gives dk of the two sequences in each other's place fails dk alone."""
    def swapped_dk(dout, pullback, dlse=None):
        dq, dk, dv = flash_varlen_backward(dout, pullback, dlse)
        return dq, np.roll(dk, dk.shape[0] // 2, axis=0), dv  # B = 2: the sequences swapped

    report = VF.verify(flash_varlen, layout="thd", dtype="float64", returns_lse=True,
                       backward=swapped_dk, align="bottom_right", supports="gqa", combos=False)
    assert report.results and all(r.failing == ["dk"] for r in report.results), report.format()


def numpy_varlen_sinks(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *,
                       sinks=None):
    """Packed sequences with a sink per head, in plain NumPy, one sequence at a time:
    -> (out (T, H, Dv), lse (H, T), what the backward needs). Row i's softmax denominator
    gains exp(sink_h - m_i)."""
    T, H, _ = q.shape
    given, sinks = sinks, np.full(H, -np.inf) if sinks is None else sinks  # [H]
    out, lse = np.zeros((T, H, v.shape[2])), np.zeros((H, T))
    for b in range(len(cu_seqlens_q) - 1):
        rq = slice(cu_seqlens_q[b], cu_seqlens_q[b + 1])
        rk = slice(cu_seqlens_k[b], cu_seqlens_k[b + 1])
        s = np.einsum("thd,shd->hts", q[rq], k[rk]) / math.sqrt(q.shape[-1])  # [H, lq, lk]
        m = np.maximum(np.max(s, axis=-1), sinks[:, None])  # [H, lq]
        total = np.sum(np.exp(s - m[..., None]), axis=-1) + np.exp(sinks[:, None] - m)  # [H, lq]
        lse[:, rq] = m + np.log(total)
        out[rq] = np.einsum("hts,shd->thd", np.exp(s - lse[:, rq, None]), v[rk])
    return out, lse, (q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, given)


def numpy_varlen_sinks_backward(dout, saved, dlse=None):
    """dq, dk, dv, dsinks of sum(out * dout) + sum(lse * dlse): ds = p (dp - delta + dlse),
    delta_i = dout_i . out_i, and d lse_i / d sink = p_sink_i = exp(sink - lse_i)."""
    q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, given = saved
    sinks = np.full(q.shape[1], -np.inf) if given is None else given  # [H]
    dlse = np.zeros_like(lse) if dlse is None else dlse  # [H, T]
    dq, dk, dv = np.zeros_like(q), np.zeros_like(k), np.zeros_like(v)
    dsinks = np.zeros(q.shape[1])  # [H]
    scale = 1.0 / math.sqrt(q.shape[-1])
    for b in range(len(cu_seqlens_q) - 1):
        rq = slice(cu_seqlens_q[b], cu_seqlens_q[b + 1])
        rk = slice(cu_seqlens_k[b], cu_seqlens_k[b + 1])
        p = np.exp(np.einsum("thd,shd->hts", q[rq], k[rk]) * scale - lse[:, rq, None])  # [H, lq, lk]
        dp = np.einsum("thd,shd->hts", dout[rq], v[rk])  # [H, lq, lk]
        delta = np.einsum("thd,thd->ht", dout[rq], out[rq])  # [H, lq]
        ds = p * (dp - delta[..., None] + dlse[:, rq, None])  # [H, lq, lk]
        dq[rq] = np.einsum("hts,shd->thd", ds, k[rk]) * scale
        dk[rk] = np.einsum("hts,thd->shd", ds, q[rq]) * scale
        dv[rk] = np.einsum("hts,thd->shd", p, dout[rq])
        dsinks += np.sum(np.exp(sinks[:, None] - lse[:, rq]) * (dlse[:, rq] - delta), axis=1)
    return dq, dk, dv, (None if given is None else dsinks)


def test_layout_thd_sinks_with_dlse_count_only_the_sequences_rows():
    """With sinks and lse_grad, dsinks sums p_sink (dlse - delta) over the packed sequences'
    query rows alone: a NumPy kernel written so passes. (A padding row of the padded truth
    attends no key, but its lse is the sink's, finite: given a dlse there, the truth's dsinks
    counted rows the kernel never has.)"""
    report = VF.verify(numpy_varlen_sinks, layout="thd", dtype="float64", returns_lse=True,
                       lse_grad=True, backward=numpy_varlen_sinks_backward, supports="sinks")
    sinks = [r for r in report.results if "sinks" in r.case.options]
    assert sinks and all("dsinks" in r.tensors for r in sinks)
    assert any(len(set(r.sequences)) > 1 for r in sinks)  # sequences of different lengths
    assert report.ok, report.format()


@pytest.mark.parametrize("supports,refused", [
    ("causal,mask_bool,segments", "'mask_bool', 'segments'"),
    ("all", "'mask_bool', 'mask_float', 'segments'"),
    ("mask_float", "'mask_float'")])
def test_layout_thd_refuses_masks_and_segments(supports, refused):
    """A varlen kernel takes no mask nor segment ids with its sequences packed: declared with
    layout='thd' they are refused before any case runs."""
    def never(*args, **kw):
        raise AssertionError("called")

    message = ("supports: expected options that layout='thd' can pass, not 'mask_bool', "
               "'mask_float' or 'segments' (a varlen kernel takes its sequences packed one after "
               f"another, each attending its own keys, with no mask nor segment ids), got {refused}")
    with pytest.raises(ValueError) as info:
        VF.verify(never, layout="thd", supports=supports)
    assert str(info.value) == message
    assert VF.verify(numpy_varlen, layout="thd", dtype="float64", returns_lse=True,
                     supports="causal", cases=["base-1x65"]).ok  # what the layout can pass


def test_jax_dot_product_attention_passes():
    jax = pytest.importorskip("jax")
    import jax.numpy as jnp

    def jattn(q, k, v, mask=None, is_causal=False, enable_gqa=False):
        return jax.nn.dot_product_attention(q, k, v, mask=mask, is_causal=is_causal)

    report = VF.verify(jattn, layout="bthd", dtype="float32", backend="jax", autograd="jax",
                       supports="causal,gqa,mask_bool", cases=["causal-128x65", "gqa-65x129"])
    assert report.ok, report.format()
    assert isinstance(jnp.zeros(1), jax.Array)


def test_backend_is_a_name_or_the_module():
    """backend= takes the library's module as well as its name: numpy, jax and jax.numpy."""
    jax = pytest.importorskip("jax")
    import jax.numpy as jnp

    def jattn(q, k, v):
        return jax.nn.dot_product_attention(q, k, v)

    for backend in (jax, jnp, "jax"):
        report = VF.verify(jattn, layout="bthd", dtype="float32", backend=backend,
                           cases=["base-65x128"])
        assert report.ok and report.config["backend"] == "jax", (backend, report.format())

    def forward(q, k, v):
        return F.sdpa_forward(q, k, v)[0]

    report = VF.verify(forward, dtype="float64", backend=np, cases=["base-65x128"])
    assert report.ok and report.config["backend"] == "numpy", report.format()


def test_jax_vjp_with_dlse_and_dmask():
    jax = pytest.importorskip("jax")
    import jax.numpy as jnp

    def dense(q, k, v, mask=None):
        # [B, T, N, H] -> [B, T, N, H], [B, T, N]
        s = jnp.einsum("btnh,bsnh->bnts", q, k) / np.sqrt(q.shape[-1])  # [B, N, T, S]
        s = s if mask is None else s + mask
        out = jnp.einsum("bnts,bsnh->btnh", jax.nn.softmax(s, axis=-1), v)
        return out, jnp.swapaxes(jax.nn.logsumexp(s, axis=-1), 1, 2)

    kw = dict(layout="bthd", dtype="float32", backend="jax", autograd="jax", returns_lse=True,
              supports="mask_float", cases=["mask_float-65x129", "mask_float-128x65"])
    report = VF.verify(dense, lse_grad=True, mask_grad=True, **kw)
    assert report.ok, report.format()
    assert all(r.tensors["dmask"].status == "pass" for r in report.results)

    def wrong_sign(q, k, v, mask=None):
        m = jax.lax.stop_gradient(mask)  # the same values, the gradient negated
        return dense(q, k, v, mask=jnp.where(jnp.isfinite(m), 2.0 * m - mask, m))

    bad = VF.verify(wrong_sign, mask_grad=True, **kw)
    assert [r.failing for r in bad.results] == [["dmask"], ["dmask"]]
    assert "wrong sign" in bad.results[0].hint


def _jax_kernel_on(seen):
    """jax.nn.dot_product_attention in (B, T, N, H) that adds to ``seen`` the devices of every
    array it is given and of its output (the forward only: under jax.vjp they are tracers)."""
    import jax

    def jattn(q, k, v, mask=None, is_causal=False):
        for t in (q, k, v) + (() if mask is None else (mask,)):
            seen.update(t.devices())
        out = jax.nn.dot_product_attention(q, k, v, mask=mask, is_causal=is_causal)
        seen.update(out.devices())
        return out

    return jattn


def test_torch_device_0_is_cuda_0_not_the_cpu():
    """torch's device 0 is cuda:0; the inputs went to the CPU instead ('0 or "cpu"'), so on
    a machine without CUDA device=0 passed silently on the CPU. Now it is placed as given:
    refused where there is no CUDA device, before any case."""
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("a CUDA device is there: device=0 is valid")
    with pytest.raises(ValueError, match=r"^device: expected a device that backend='torch' can "
                                         r"use, got 0 \("):
        VF.verify(_never_called, backend="torch", device=0, cases=["base-1x65"])


def test_jax_device_is_a_device_or_its_platform_and_index():
    """device= with backend='jax' was handed to jax.device_put as given, which takes no
    strings: 'cpu' failed (ValueError from jax.device_put, told as 'a device that
    backend='jax' can use'). Now a jax.Device as it is, 'PLATFORM' / 'PLATFORM:N' as
    jax.devices(PLATFORM)[N], and the kernel's arrays are on it; a name of no device jax
    reports is a ValueError naming device, what it takes, the devices there are and what it
    got, before any case."""
    jax = pytest.importorskip("jax")
    cpu0 = jax.devices("cpu")[0]
    kw = dict(layout="bthd", dtype="float32", backend="jax", supports="causal,mask_bool",
              cases=["causal-128x65", "mask_bool-65x129"])
    # (JAX 0.12 deprecates constructing SingleDeviceSharding: its maker where there is one)
    maker = "make_single_device_sharding"
    sharding = (getattr(jax.sharding, maker) if hasattr(jax.sharding, maker)
                else jax.sharding.SingleDeviceSharding)
    for device in ("cpu", "cpu:0", cpu0, sharding(cpu0)):
        seen: set = set()
        report = VF.verify(_jax_kernel_on(seen), device=device, **kw)
        assert report.ok, report.format()
        assert seen == {cpu0}, (device, seen)
        assert report.config["device"] == str(device)
    n_cpu = len(jax.devices("cpu"))
    platforms = {d.platform for d in jax.devices()} | {"cpu"}
    wrong = [f"cpu:{n_cpu}", "cpu:", "cpu:-1", "cpu:x", "", "CPU", "cpu:0:0"]
    wrong += [p for p in ("gpu", "tpu") if p not in platforms]
    for device in wrong:
        with pytest.raises(ValueError) as info:
            VF.verify(_never_called, device=device, **kw)
        msg = str(info.value)
        assert msg.startswith("device: expected a jax.Device, or 'PLATFORM' or 'PLATFORM:N' "
                              "naming one of the devices jax reports ("), msg
        assert "cpu:0" in msg.split("(", 1)[1].split(")", 1)[0], msg  # the devices there are
        assert f", got {device!r}" in msg, msg
    with pytest.raises(TypeError, match=r"device: expected a jax\.Device, or 'PLATFORM' or "
                                        r"'PLATFORM:N' with backend='jax', got int 0"):
        VF.verify(_never_called, device=0, **kw)


def test_jax_device_by_index_puts_the_arrays_there():
    """device='cpu:1' with two host devices (XLA's forced count, in a fresh process): every
    array the kernel gets, and so its output, is on jax.devices('cpu')[1], not the default
    device 0 (the string was refused before)."""
    pytest.importorskip("jax")
    import subprocess
    import sys

    script = (
        "import jax\n"
        "from npattn import verifier as VF\n"
        "seen = set()\n"
        "def jattn(q, k, v, mask=None, is_causal=False):\n"
        "    for t in (q, k, v) + (() if mask is None else (mask,)):\n"
        "        seen.update(t.devices())\n"
        "    out = jax.nn.dot_product_attention(q, k, v, mask=mask, is_causal=is_causal)\n"
        "    seen.update(out.devices())\n"
        "    return out\n"
        "r = VF.verify(jattn, layout='bthd', backend='jax', device='cpu:1',\n"
        "              supports='causal,mask_bool', cases=['causal-128x65', 'mask_bool-65x129'])\n"
        "assert r.ok, r.format()\n"
        "print(sorted(d.id for d in seen), jax.devices('cpu')[1].id)\n")
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=2",
               JAX_PLATFORMS="cpu",
               PYTHONPATH=IMPORT_ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["[1]", "1"], proc.stdout


# --------------------------------------------------------------------------
# adapters, errors, hints


def test_adapter_mapping_and_callable():
    def renamed(q, k, v, causal=False, **kw):
        return npattn_kernel(q, k, v, is_causal=causal, **kw)[0]

    ok = VF.verify(renamed, dtype="float64", supports="causal", combos=False,
                   adapter={"is_causal": "causal"})
    assert ok.ok
    raised = VF.verify(renamed, dtype="float64", supports="causal", combos=False,
                       cases=["causal-65x129"])
    r = raised.results[0]
    assert r.status == "fail" and r.error.startswith("TypeError") and "adapter=" in r.hint
    dropped = VF.verify(lambda q, k, v: npattn_kernel(q, k, v, is_causal=True)[0],
                        dtype="float64", supports="causal", adapter=lambda opts: {},
                        cases=["causal-65x129", "base-65x128"])
    assert [r.status for r in dropped.results] == ["pass", "fail"]


def test_a_mapping_adapter_drops_the_keywords_it_maps_to_none():
    seen = []

    def kernel(q, k, v, **options):
        seen.append(sorted(options))
        return npattn_kernel(q, k, v, align="bottom_right", **options)[0]

    report = VF.verify(kernel, dtype="float64", supports="causal_bottom_right", combos=False,
                       adapter={"align": None}, cases=["causal_bottom_right-65x129"])
    assert report.ok, report.format()
    assert seen == [["is_causal"]]


def test_nan_on_empty_rows_is_named():
    def no_guard(q, k, v, mask=None):
        s = q @ np.swapaxes(k, -1, -2) / math.sqrt(q.shape[-1])
        s = s if mask is None else np.where(mask, s, -np.inf)
        with np.errstate(invalid="ignore"):
            p = np.exp(s - s.max(axis=-1, keepdims=True))
            return (p / p.sum(axis=-1, keepdims=True)) @ v

    report = VF.verify(no_guard, dtype="float64", supports="mask_bool,empty_rows", combos=False,
                       cases=["mask_bool-65x129"])
    r = report.results[0]
    assert r.status == "fail" and "NaN on rows with nothing to attend" in r.hint
    assert r.tensors["out"].note == "NaN on empty rows"

    def nan_elsewhere_too(q, k, v, mask=None):  # and on a row that has keys to attend
        out = no_guard(q, k, v, mask)
        attended = np.argwhere(mask.any(axis=-1))[0]  # (b, h, i) of a row with keys
        out[tuple(attended)] = np.nan
        return out

    r = VF.verify(nan_elsewhere_too, dtype="float64", supports="mask_bool,empty_rows",
                  combos=False, cases=["mask_bool-65x129"]).results[0]
    assert r.status == "fail" and "nothing to attend" not in r.hint
    assert r.tensors["out"].note.endswith("NaN/inf entries")
    ok = VF.verify(no_guard, dtype="float64", supports="mask_bool", combos=False)
    assert ok.ok, ok.format()  # declared without empty_rows, it is not given any


def test_a_nan_out_without_large_scores_is_not_told_of_exp_overflow():
    """The hint of an out with NaN in a case without shifted rows (nothing for exp to overflow
    on, no empty rows) does not blame large scores; in the case of shifted rows it does."""
    def nan_out(q, k, v, **options):
        out, lse, cache = npattn_kernel(q, k, v, **options)
        out = out.copy()
        out[0, 0, 0, 0] = np.nan
        return out, lse, cache

    kw = dict(backward=npattn_backward, returns_lse=True, dtype="float64")
    plain = VF.verify(nan_out, cases=["base-65x128"], **kw).results[0]
    assert plain.failing == ["out"] and plain.tensors["out"].note == "1 NaN/inf entries"
    assert "large" not in plain.hint and "row's maximum" not in plain.hint, plain.hint
    c = plain.case  # the NaN entry is where the tensor is over budget
    assert plain.tensors["out"].where == (f"1 of {c.B * c.Hq * c.Lq * c.Dv} entries over budget, "
                                          f"the worst at b=0, h=0, query=0, d=0; query rows 0 "
                                          f"(1 of {c.Lq})"), plain.tensors["out"].where
    shifted = VF.verify(nan_out, cases=["base-scores8-shift-65x127"], **kw).results[0]
    assert shifted.hint.startswith("out has inf or NaN where the scores are large"), shifted.hint


def test_dmask_is_compared_when_given_required_with_mask_grad_and_finite_entries_only():
    def kernel(q, k, v, **options):
        out, lse, cache = npattn_kernel(q, k, v, **options)
        return out, lse, cache, options.get("mask")

    def no_dmask(dout, cache, mask):
        return F.sdpa_backward(dout, cache)[:3]

    def noisy_dmask(dout, cache, mask):  # garbage where the mask is -inf: not compared
        g = F.sdpa_backward(dout, cache)
        if mask is None or mask.dtype == bool:
            return g
        return {"dq": g.dq, "dk": g.dk, "dv": g.dv,
                "dmask": np.where(np.isfinite(mask), g.dmask, np.nan)}

    kw = dict(dtype="float64", returns_lse=True, supports="mask_float,empty_rows", combos=False)
    quiet = VF.verify(kernel, backward=no_dmask, **kw)
    assert quiet.ok and not any("dmask" in r.tensors for r in quiet.results)
    assert "no dmask (none given; mask_grad=True requires it)" in quiet.summary()
    required = VF.verify(kernel, backward=no_dmask, mask_grad=True, **kw)
    masked = [r for r in required.results if "mask_float" in r.case.options]
    assert not required.ok and {r.case.name for r in required.failures} == {r.case.name for r in masked}
    assert all(r.hint == "dmask: missing: no dmask was returned" for r in masked)
    noisy = VF.verify(kernel, backward=noisy_dmask, **kw)
    assert noisy.ok, noisy.format()
    assert any(r.case.empty_rows for r in masked)
    assert all(r.tensors["dmask"].status == "pass" for r in noisy.results if "dmask" in r.tensors)
    off = VF.verify(kernel, backward=noisy_dmask, mask_grad=False, **kw)
    assert off.ok and "no dmask (mask_grad=False)" in off.summary()


def test_a_backward_of_four_gradients_gives_dsinks():
    """(dq, dk, dv, dsinks): the fourth is read as dsinks, and compared in the sinks cases."""
    def four(dout, cache):
        g = npattn_backward(dout, cache)
        return g.dq, g.dk, g.dv, g.dsinks

    report = VF.verify(npattn_kernel, backward=four, returns_lse=True, dtype="float64",
                       supports="sinks", combos=False)
    assert report.ok, report.format()
    sinks = [r for r in report.results if "sinks" in r.case.options]
    assert sinks and all(r.tensors["dsinks"].status == "pass" for r in sinks)


def test_dlse_is_zero_on_rows_with_nothing_to_attend_and_float32_for_half():
    got = []

    def backward(dout, cache, dlse):
        got.append(dlse)
        return F.sdpa_backward(dout, cache, dlse=dlse)

    for dtype, want in (("float64", np.float64), ("float16", np.float32)):
        got.clear()
        report = VF.verify(npattn_kernel, backward=backward, returns_lse=True, lse_grad=True,
                           dtype=dtype, supports="mask_bool,empty_rows", cases=["mask_bool-65x129"])
        assert report.ok, report.format()
        case = report.results[0].case
        inp = VC.case_inputs(case)
        empty = ~inp.options["mask"].any(axis=-1)  # [B, 1, Lq]
        empty = np.broadcast_to(empty, (case.B, case.Hq, case.Lq))
        (dlse,) = got
        assert dlse.dtype == want and dlse.shape == (case.B, case.Hq, case.Lq)
        assert empty.any() and np.all(dlse[empty] == 0.0) and np.all(dlse[~empty] != 0.0)
        assert np.allclose(dlse[~empty], inp.dlse[~empty], rtol=1e-3)
        assert np.array_equal(dlse.astype(dtype).astype(want), dlse)  # exact in dtype


def test_a_backward_without_dlse_is_told_how_it_is_called():
    report = VF.verify(npattn_kernel, backward=lambda dout, cache: F.sdpa_backward(dout, cache),
                       returns_lse=True, lse_grad=True, dtype="float64", cases=["base-65x128"])
    r = report.results[0]
    assert r.error is not None and "backward(dout, *saved, dlse=dlse)" in r.hint


def test_window_cases_alone_cover_each_unbounded_side():
    """With 'window' declared alone, a kernel that reads an unbounded side as 0 fails: the
    two window cases hold (None, right) and (left, None)."""
    windows = {c.window for c in VC.panel("window") if "window" in c.options}
    assert any(w[0] is None for w in windows) and any(w[1] is None for w in windows)
    for side in (0, 1):
        def bounded(q, k, v, window=None, **kw):
            if window is not None and window[side] is None:
                window = (0, window[1]) if side == 0 else (window[0], 0)
            return npattn_kernel(q, k, v, window=window, **kw)

        report = VF.verify(bounded, backward=npattn_backward, returns_lse=True, dtype="float64",
                           supports="window")
        assert not report.ok
        assert all(r.case.window[side] is None for r in report.failures)


def test_align_is_passed_only_with_the_options_it_aligns():
    """verify(align='bottom_right'): the window and ALiBi cases and the bottom-right causal
    ones get align='bottom_right'; the others (no option, a mask, top-left causal) get no
    align, which a kernel without a window need not take."""
    given = {}

    def kernel(q, k, v, **options):
        given[len(given)] = set(options)
        return npattn_kernel(q, k, v, **options)[0]

    report = VF.verify(kernel, dtype="float64", align="bottom_right",
                       supports="window,alibi,mask_bool,causal_bottom_right")
    assert report.ok, report.format()
    for r, keys in zip(report.results, given.values()):
        aligned = {"window", "alibi", "causal_bottom_right"} & set(r.case.options)
        assert ("align" in keys) == bool(aligned), (r.case.name, keys)
    assert any(not r.case.options for r in report.results)


def test_softcap_cases_have_scores_past_the_cap():
    """tanh saturates past the cap: the softcap cases' scaled scores have a std above it."""
    cases = [c for c in VC.panel(ALL) if "softcap" in c.options]
    assert len(cases) >= 3
    for c in cases:
        inp = VC.case_inputs(c)
        k = np.repeat(inp.k, c.Hq // c.Hkv, axis=1)  # [B, Hq, Lk, Dh]
        s = inp.q @ np.swapaxes(k, -1, -2) * inp.options.get("scale", 1.0 / math.sqrt(c.Dh))
        assert s.std() > inp.options["softcap"], c.name


def test_npattn_itself_passes_sinks_in_bfloat16():
    """dsinks comes back in the input dtype: the budget's floor is bfloat16's (it was
    float32's, and a correct kernel failed its sinks cases)."""
    pytest.importorskip("torch")
    from npattn import attention as A

    def fwd(q, k, v, **kw):
        out, cache = A.sdpa_forward(q, k, v, impl="reference", **kw)
        return out, cache.lse, cache

    report = VF.verify(fwd, backward=lambda dout, cache: A.sdpa_backward(dout, cache),
                       returns_lse=True, backend="torch", dtype="bfloat16", supports="sinks",
                       combos=False)
    assert report.ok, report.format()
    assert any("dsinks" in r.tensors for r in report.results)


def test_the_python_reproducer_reruns_a_case_of_ones_own():
    """A user's Case is written out whole (its name is not in the panel), and the adapter and
    budget factor come along: the line evaluates to the same case and budgets."""
    import npattn

    def kernel(q, k, v, **kw):
        return F.sdpa_forward(q, k, v, **kw)[0]

    case = VC.Case("mine", Lq=3, Lk=5, options=("window",), window=(1, 1))
    report = VF.verify(kernel, dtype="float64", supports="window", cases=[case],
                       adapter={"align": "align"}, budget_factor=3.0)
    line = report.results[0].reproducer
    assert "npattn.verify_cases.Case(name='mine'" in line and "budget_factor=3.0" in line
    assert "adapter={'align': 'align'}" in line
    # a local function has no importable name: the line calls it by its own name, and a
    # comment says which object that is; with the name bound, the line runs as printed
    call, comment = line.split("  # ")
    assert call.startswith("print(npattn.verify(kernel, ") and comment.startswith("kernel: <function")
    again = eval(call[len("print("):-1], {"npattn": npattn, "kernel": kernel})
    assert again.results[0].case == case
    assert again.results[0].tensors["out"].budget == report.results[0].tensors["out"].budget
    with pytest.raises(ValueError, match="^cases: case 'e' leaves rows with nothing to attend"):
        VF.verify(kernel, dtype="float64", supports="window",
                  cases=[VC.Case("e", Lq=129, Lk=65, options=("window",), window=(5, 0))])


def test_the_python_reproducer_names_lambdas_for_the_caller_to_bind():
    """A lambda kernel and a lambda backward get the names fn and backward, which the line's
    comment explains; with them bound, the line reruns the same failing case."""
    import npattn

    fn = lambda q, k, v, **kw: F.sdpa_forward(q, k, v, **kw)  # noqa: E731
    wrong = lambda dout, cache: F.sdpa_backward(2.0 * dout, cache)  # noqa: E731
    report = VF.verify(fn, backward=wrong, dtype="float64", combos=False, cases=["base-1x65"])
    assert not report.ok
    call, comment = report.results[0].reproducer.split("  # ")
    assert call.startswith("print(npattn.verify(fn, ") and "backward=backward" in call
    assert re.fullmatch(r"backward: <function .*<lambda> at 0x\w+>; fn: <function .*<lambda> at 0x\w+>",
                        comment)
    again = eval(call[len("print("):-1], {"npattn": npattn, "fn": fn, "backward": wrong})
    assert again.results[0].case == report.results[0].case
    assert again.results[0].failing == report.results[0].failing == ["dq", "dk", "dv"]
    # a function of the user's own script (module __main__) is bound there by its name
    main_backward = lambda dout, cache: F.sdpa_backward(2.0 * dout, cache)  # noqa: E731
    main_backward.__module__, main_backward.__qualname__ = "__main__", "main_backward"
    line = VF.verify(fn, backward=main_backward, dtype="float64", combos=False,
                     cases=["base-1x65"]).results[0].reproducer
    assert "backward=main_backward," in line and line.endswith("  # fn: " + comment.split("; fn: ")[1])


def test_malformed_returns_are_named():
    def pair(q, k, v, **kw):  # (out, lse) without returns_lse
        return npattn_kernel(q, k, v, **kw)[:2]

    def nothing(q, k, v, **kw):
        return None

    def a_class(q, k, v, **kw):  # NumPy's scalar types carry shape and dtype as descriptors
        return np.float64

    def four(dout, cache):  # (dq, dk, dv, dmask): four are read as (dq, dk, dv, dsinks)
        return tuple(npattn_backward(dout, cache))[:4]

    for fn, kw, text in ((pair, {}, "got a tuple of 2; a kernel that returns (out, lse) needs returns_lse=True"),
                         (nothing, {}, "fn: expected out to be an array, got None"),
                         (a_class, {}, "fn: expected out to be an array, got type numpy.float64"),
                         (npattn_kernel, dict(backward=four, returns_lse=True, supports="mask_float",
                                              cases=["mask_float-65x129"]),
                          "backward: returned 4 gradients in a case without sinks")):
        kw.setdefault("cases", ["base-65x128"])
        r = VF.verify(fn, dtype="float64", **kw).results[0]
        assert r.status == "fail" and text in r.error, r.error
        assert "not what verify reads" in r.hint


def test_a_kernel_s_own_error_worded_as_verify_s_keeps_its_traceback():
    """Only verify's own check of what was returned, raised in verify, has no traceback: a
    backward that raises a TypeError starting 'backward: ' itself is shown where it raised."""
    def backward(dout, cache):
        raise TypeError("backward: no gradient of this case here")

    r = VF.verify(npattn_kernel, backward=backward, returns_lse=True, dtype="float64",
                  cases=["base-65x128"]).results[0]
    assert r.error == "TypeError: backward: no gradient of this case here"
    assert r.traceback and r.raised_at.endswith(" in backward"), (r.raised_at, r.traceback)


def test_a_kernel_s_own_error_worded_as_verify_s_gets_the_hint_of_an_error_raised():
    """The hint that what was returned is not what verify reads belongs to verify's own
    checks: a TypeError the kernel raises itself, starting 'backward: ' or 'fn: expected',
    is hinted as the kernel's error, with its traceback."""
    def backward(dout, cache):
        raise TypeError("backward: no gradient of this case here")

    def fn(q, k, v, **kw):
        raise TypeError("fn: expected a contiguous q")

    for kw, text in ((dict(fn=npattn_kernel, backward=backward, returns_lse=True),
                      "TypeError: backward: no gradient of this case here"),
                     (dict(fn=fn), "TypeError: fn: expected a contiguous q")):
        report = VF.verify(dtype="float64", cases=["base-65x128"], **kw)
        r = report.results[0]
        assert r.error == text and r.traceback
        assert "not what verify reads" not in r.hint and r.hint.startswith("fn raised"), r.hint
        assert not any("not what verify reads" in h for h in report.hints()), report.hints()


def test_a_return_verify_cannot_read_in_every_failing_case_is_not_said_to_be_raised():
    """fn returning (out, cache) without returns_lse fails each case with verify's own
    TypeError and no traceback: the panel hints do not say that fn raised."""
    def unreadable(q, k, v, **kw):
        return F.sdpa_forward(q, k, v, **kw)

    report = VF.verify(unreadable, dtype="float64", cases=["base-1x65", "base-65x128"])
    assert len(report.failures) == 2
    assert all(r.error.startswith("TypeError: fn: expected") and not r.traceback
               for r in report.failures)
    assert not any(h.startswith("fn raised") for h in report.hints()), report.hints()


def test_a_kernel_that_writes_into_its_inputs_fails_and_the_budgets_stand():
    """A kernel that overwrites q and the dropout keep-mask after computing: the case fails
    naming them, and its outputs are still compared (the budgets come from the case's own
    arrays: the same ratios as a kernel that writes nothing)."""
    def writes(q, k, v, **options):
        keep = options.get("dropout_mask")
        if keep is not None:
            options["dropout_mask"] = keep.copy()
        out = npattn_kernel(q.copy(), k, v, **options)  # copies: its cache keeps the values
        q *= 2.0
        if keep is not None:
            keep[...] = True
        return out

    kw = dict(backward=npattn_backward, returns_lse=True, dtype="float64", supports="dropout_mask",
              combos=False)
    clean, dirty = VF.verify(npattn_kernel, **kw), VF.verify(writes, **kw)
    assert clean.ok and not dirty.ok
    for a, b in zip(clean.results, dirty.results):
        assert b.error is not None and b.error.startswith("fn wrote into its inputs q")
        assert ("dropout_mask" in b.error) == ("dropout_mask" in b.case.options)
        assert {n: t.budget for n, t in a.tensors.items()} == {n: t.budget for n, t in b.tensors.items()}
        assert all(t.status != "fail" for t in b.tensors.values())
        assert b.hint.startswith("fn wrote into q") and not b.traceback
    # told as a write, not as an exception (it was 'raised', with an empty hint)
    text = dirty.format()
    assert ": wrote into q" in text and ", its numbers pass" in text
    assert "fn raised" not in text and "hint: \n" not in text + "\n"
    assert dirty.hints() and dirty.hints()[0].startswith("fn wrote into its inputs in every failing case")


def test_a_backward_that_writes_into_dout_fails_as_a_write():
    """dout is the kernel's input too: a backward that overwrites it after use is told so."""
    def backward(dout, cache):
        g = F.sdpa_backward(dout.copy(), cache)
        dout[...] = 0.0
        return g

    r = VF.verify(npattn_kernel, backward=backward, returns_lse=True, dtype="float64",
                  cases=["base-65x128"]).results[0]
    assert r.written == ["dout"] and r.status == "fail" and r.failing == [], r.written
    assert r.hint.startswith("fn wrote into dout:"), r.hint


def test_an_adapter_that_converts_an_option_in_place_is_a_write_into_the_inputs():
    """An adapter that turns the boolean mask into the kernel's convention (True = masked)
    by writing into it: the numbers are right, and the case's mask is changed all the same
    (the kernel's own copies, taken after the adapter, cannot show it)."""
    def masked_is_true(q, k, v, mask):
        return npattn_kernel(q, k, v, mask=~mask)[0]

    def in_place(options):
        np.logical_not(options["mask"], out=options["mask"])
        return options

    def copying(options):
        return {**options, "mask": ~options["mask"]}

    kw = dict(dtype="float64", supports="mask_bool", cases=["mask_bool-65x129"])
    r = VF.verify(masked_is_true, adapter=in_place, **kw).results[0]
    assert r.written == ["mask"] and r.status == "fail"
    assert all(t.status == "pass" for t in r.tensors.values())
    assert VF.verify(masked_is_true, adapter=copying, **kw).ok


def test_the_table_row_of_a_case_that_wrote_into_its_inputs_does_not_say_pass():
    """A kernel that wrote into q in its causal cases, its numbers right: the failing cases
    named them, and the table said 'pass' on every row (its tensors pass); now each row of
    such a case fails and says why, as the failing cases' line does."""
    def writes_when_causal(q, k, v, **options):
        result = npattn_kernel(q.copy(), k, v, **options)
        if options.get("is_causal"):
            q[...] = 0.0
        return result

    names = ["base-1x65", "causal-65x129", "causal-128x65"]
    report = VF.verify(writes_when_causal, backward=npattn_backward, returns_lse=True,
                       dtype="float64", supports="causal", combos=False, cases=names)
    assert [r.case.name for r in report.failures] == names[1:]
    rows = report.table_rows()
    for row in rows:
        if row["option"] == "causal":
            assert row["status"] == "FAIL" and row["failed"] == row["wrote"] == 2, row
        else:
            assert row["status"] == "pass" and row["failed"] == row["wrote"] == 0, row
    causal = [line for line in report.table().splitlines() if line.startswith("causal ")]
    assert len(causal) == 5  # out, lse, dq, dk, dv
    assert all(line.endswith("FAIL 2/2 (2 wrote into its inputs)") for line in causal), causal
    assert "causal-65x129 B=2" in report.format()
    assert ": wrote into q, its numbers pass" in report.format()
    assert {r["tensor"]: r["wrote"] for r in json.loads(report.to_json())["table"]
            if r["option"] == "causal"} == dict.fromkeys(("out", "lse", "dq", "dk", "dv"), 2)


def test_a_failure_its_ratio_does_not_tell_is_said_by_what_failed():
    """The right numbers in float64 for float32 inputs fail out: the failing case's line read
    'out 0.0161x' (under the budget, as if it passed) and its table row 'FAIL 3/3' beside a
    ratio under 1; now 'out (dtype)', and the row says why. A kernel that raised reads
    'raised' (it read 'out infx')."""
    def float64_when_causal(q, k, v, **options):
        out, lse, cache = npattn_kernel(q, k, v, **options)
        return (out.astype(np.float64) if options.get("is_causal") else out), lse, cache

    def raises_when_causal(q, k, v, **options):
        if options.get("is_causal"):
            raise NotImplementedError("causal")
        return npattn_kernel(q, k, v, **options)

    names = ["base-1x65", "causal-65x129", "causal-128x65"]
    kw = dict(backward=npattn_backward, returns_lse=True, dtype="float32", supports="causal",
              combos=False, cases=names)
    report = VF.verify(float64_when_causal, **kw)
    text = report.format()
    assert [r.case.name for r in report.failures] == names[1:]
    assert "causal-65x129 B=2 Hq=2 Hkv=2 Lq=65 Lk=129 Dh=16 Dv=16: out (dtype)\n" in text, text
    row = next(r for r in report.table_rows() if (r["option"], r["tensor"]) == ("causal", "out"))
    assert row["ratio"] < 1.0 and row["wrong_type"] == 2
    assert "FAIL 2/2 (2 of another dtype or library)" in report.table()
    text = VF.verify(raises_when_causal, **kw).format()
    assert "Dh=16 Dv=16: raised\n" in text and "infx" not in text, text


def _off_everywhere(q, k, v, **options):
    """npattn with out 1 % off: wrong in every case, whatever its options."""
    out, lse, cache = npattn_kernel(q, k, v, **options)
    return out * 1.01, lse, cache


def test_the_panel_hints_say_what_the_failing_cases_do_not():
    """'every failing case holds X' was said of the one case --case ran, and of the one case
    that failed (all its options), and '1 case(s): <hint>' repeated that case's own hint;
    now an option is named only where two cases or more fail and a case that ran lacks it."""
    kw = dict(backward=npattn_backward, returns_lse=True, dtype="float64", supports="causal",
              combos=False)
    one = VF.verify(_off_everywhere, cases=["causal-65x129"], **kw)
    assert not one.ok and one.hints() == [] and "\nhint: " not in one.format(), one.hints()
    # every case that ran holds causal: it tells nothing
    both = VF.verify(_off_everywhere, cases=["causal-65x129", "causal-128x65"], **kw)
    assert len(both.failures) == 2
    assert not any("every failing case holds" in h for h in both.hints()), both.hints()
    assert both.hints() == [f"2 cases: {both.failures[0].hint}"]

    def off_in_one_case(q, k, v, **options):
        wrong = options.get("is_causal") and q.shape[2] == 65
        return (_off_everywhere if wrong else npattn_kernel)(q, k, v, **options)

    single = VF.verify(off_in_one_case, cases=["base-1x65", "causal-65x129", "causal-128x65"], **kw)
    assert [r.case.name for r in single.failures] == ["causal-65x129"]
    assert single.hints() == [], single.hints()

    def off_when_causal(q, k, v, **options):
        return (_off_everywhere if options.get("is_causal") else npattn_kernel)(q, k, v, **options)

    told = VF.verify(off_when_causal, cases=["base-1x65", "causal-65x129", "causal-128x65"], **kw)
    assert len(told.failures) == 2
    assert "every failing case holds 'causal'" in told.hints()[0], told.hints()


def test_the_panel_hints_count_the_three_commonest_case_hints():
    """Three mistakes, each in the two cases of one option: each case hint shared by two
    cases is told with its count, all three."""
    def kernel(q, k, v, **options):
        out, lse, _ = npattn_kernel(q, k, v, **options)
        if options.get("is_causal"):  # out wrong, lse right
            out = out * 1.01
        if "window" in options:  # lse wrong, out right
            lse = lse * 1.01
        if "softcap" in options:  # both wrong
            out, lse = out * 1.01, lse * 1.01
        return out, lse

    report = VF.verify(kernel, returns_lse=True, dtype="float64", supports="causal,window,softcap",
                       combos=False)
    assert len(report.failures) == 6
    hints = [h for h in report.hints() if h.startswith("2 cases: ")]
    assert len(hints) == 3 and len({r.hint for r in report.failures}) == 3, report.hints()


def test_the_many_options_hint_needs_two_failing_cases_and_counts_passes_in_words():
    """'only cases holding 4 options together fail' was said when only all4-65x128 failed
    (the one failing case holds its options trivially), with '(1 case(s) pass)'; now it
    needs two failing cases, as the option hints do, and says '1 case passes'."""
    def off_with_all_four(q, k, v, **options):
        wrong = {"is_causal", "softcap", "scale", "enable_gqa"} <= set(options)
        return (_off_everywhere if wrong else npattn_kernel)(q, k, v, **options)

    kw = dict(backward=npattn_backward, returns_lse=True, dtype="float64",
              supports="causal,softcap,gqa,scale")
    names = ["base-1x65", "gqa-65x129", "scale-65x129", "all4-65x128"]
    one = VF.verify(off_with_all_four, cases=names, **kw)
    assert [r.case.name for r in one.failures] == ["all4-65x128"]
    assert one.hints() == [], one.hints()
    all4 = next(c for c in VF.plan(kw["supports"]) if c.name == "all4-65x128")
    two = VF.verify(off_with_all_four, cases=names + [replace(all4, name="all4-again")], **kw)
    assert len(two.failures) == 2
    many = [h for h in two.hints() if "options together fail" in h]
    assert len(many) == 1 and "'gqa' (1 case passes)" in many[0], two.hints()
    assert "'causal' (0 cases pass)" in many[0] and "case(s)" not in "".join(two.hints())


def test_a_write_into_the_kernel_s_own_float_mask_or_out_of_another_library_fails():
    """A float mask reaches the kernel as a copy in its dtype, which shares no memory with the
    case's: a write into it passed unseen (the docs promise it fails). The right numbers as
    an array of another library than q's passed too."""
    def clamps_mask(q, k, v, **options):
        out = npattn_kernel(q, k, v, **options)
        mask = options.get("mask")
        if mask is not None and mask.dtype != bool:
            mask[mask == -np.inf] = -1e4  # after use: the outputs stay right
        return out

    kw = dict(backward=npattn_backward, returns_lse=True, dtype="float64", combos=False)
    r = VF.verify(clamps_mask, supports="mask_float", **kw)
    assert not r.ok
    for c in r.results:  # the cases with a float mask fail, the others pass
        assert (c.error is not None and c.error.startswith("fn wrote into its inputs mask")) == \
            ("mask_float" in c.case.options), c.case.name
    assert any("mask_float" in c.case.options for c in r.results)
    torch = pytest.importorskip("torch")
    def as_torch(q, k, v, **options):
        out, *rest = npattn_kernel(q, k, v, **options)
        return (torch.from_numpy(out), *rest)

    r = VF.verify(as_torch, **kw)
    assert not r.ok
    for c in r.results:
        assert c.tensors["out"].status == "fail"
        assert c.tensors["out"].note.startswith("library: expected a numpy array (as q), got torch.Tensor")


def test_argument_errors_name_the_argument():
    with pytest.raises(ValueError, match=r"layout: expected 'bhsd', .*got 'bhds'"):
        VF.verify(npattn_kernel, layout="bhds")
    with pytest.raises(ValueError, match=r"dtype: expected 'float.*, got 'half'"):
        VF.verify(npattn_kernel, dtype="half")
    with pytest.raises(ValueError, match="backward, autograd: expected one source"):
        VF.verify(npattn_kernel, backward=npattn_backward, autograd="torch")
    with pytest.raises(ValueError, match="autograd: 'torch' needs backend='torch'"):
        VF.verify(npattn_kernel, autograd="torch")
    with pytest.raises(ValueError, match="budget_factor: expected a finite number >= 1"):
        VF.verify(npattn_kernel, budget_factor=0.5)
    with pytest.raises(ValueError, match="budget_factor: expected a finite number >= 1"):
        VF.verify(npattn_kernel, budget_factor=2**1100)  # an int no float holds
    with pytest.raises(ValueError, match="floors: expected finite numbers >= 0 as values, got -1"):
        VF.verify(npattn_kernel, floors={"float32": -1})
    with pytest.raises(ValueError, match="floors: expected finite numbers >= 0 as values"):
        VF.verify(npattn_kernel, floors={"float32": 2**1100})
    with pytest.raises(ValueError, match="cases: expected names of the panel's cases"):
        VF.verify(npattn_kernel, cases=["no-such-case"])
    with pytest.raises(ValueError, match=r"cases: case 'x' turns on \['window'\]"):
        VF.verify(npattn_kernel, cases=[VC.Case("x", options=("window",))])
    with pytest.raises(TypeError, match="fn: expected a callable"):
        VF.verify("attention")
    for flags in (["--returns-lse"], {"returns_lse": 1}):
        with pytest.raises(TypeError, match="flags: expected None or a mapping of keyword names"):
            VF.verify(npattn_kernel, flags=flags)
    with pytest.raises(ValueError, match="lse_grad: True needs returns_lse=True"):
        VF.verify(npattn_kernel, backward=npattn_backward, lse_grad=True)
    with pytest.raises(ValueError, match="lse_grad: True passes dlse to the gradients"):
        VF.verify(npattn_kernel, returns_lse=True, lse_grad=True)
    with pytest.raises(ValueError, match="mask_grad: True checks the dmask of float masks"):
        VF.verify(npattn_kernel, backward=npattn_backward, mask_grad=True, supports="mask_bool")
    with pytest.raises(ValueError, match="mask_grad: True checks the gradient of the mask"):
        VF.verify(npattn_kernel, mask_grad=True, supports="mask_float")
    with pytest.raises(TypeError, match="mask_grad: expected None, True or False"):
        VF.verify(npattn_kernel, mask_grad="yes")
    with pytest.raises(ValueError, match="device: expected None with backend='numpy'"):
        VF.verify(npattn_kernel, device="cuda")


def _never_called(q, k, v, **options):
    raise AssertionError("a bad argument reached the kernel")


def test_numpy_numbers_are_numbers_for_budget_factor_and_floors():
    """As elsewhere in npattn, a NumPy float or int is a number (it was refused), held as a
    Python float: the report's JSON and reproducer hold it."""
    report = VF.verify(npattn_kernel, cases=["base-1x65"], dtype="float64", returns_lse=True,
                       backward=npattn_backward, budget_factor=np.float32(2.5),
                       floors={"float64": np.float64(4e-16), "float32": np.int64(1)})
    assert report.ok, str(report)
    config = json.loads(report.to_json())["config"]
    assert config["budget_factor"] == 2.5 and config["floors"]["float32"] == 1.0
    assert type(report.config["budget_factor"]) is float


@pytest.mark.parametrize("kwargs, error, received", [
    # 'head_dims: ... (its cases take Dv unlike Dh, both of head_dims), got (64,)': 'both of'
    # one width, and the tuple verify made of the caller's list
    ({"supports": "dv_ne_dk", "head_dims": [64]}, ValueError, "[64]"),
    ({"head_dims": [64, 0]}, ValueError, "0 in [64, 0]"),  # was 'got (64, 0)'
    ({"head_dims": [64.0]}, TypeError, "64.0 in [64.0]"),
    ({"returns_lse": "yes"}, TypeError, "str 'yes'"),  # was taken as True
    ({"seed": -1}, ValueError, "-1"),  # numpy's 'expected non-negative integer' from a case
    ({"seed": 1.5}, TypeError, "float 1.5"),  # was taken as 1
    ({"floors": {"float32": "a"}}, TypeError, "str 'a' for 'float32'"),  # "can't multiply sequence"
    ({"floors": {"float32": -1.0}}, ValueError, "-1.0 for 'float32'"),
    ({"floors": ["float32"]}, TypeError, "list ['float32']"),
    # a wrong type is a TypeError, a wrong value of the right type a ValueError: these were
    # all ValueError
    ({"mask_grad": "yes"}, TypeError, "str 'yes'"),
    ({"mask_grad": 1}, TypeError, "int 1"),
    ({"lse_grad": 1}, TypeError, "int 1"),
    ({"layout": 3}, TypeError, "int 3"),
    ({"layout": "bhds"}, ValueError, "'bhds'"),
    ({"dtype": np.float32}, TypeError, "type numpy.float32"),  # was "type <class 'numpy.float32'>"
    ({"autograd": 1}, TypeError, "int 1"),
    ({"align": True}, TypeError, "bool True"),
    ({"budget_factor": "2"}, TypeError, "str '2'"),
    ({"budget_factor": 0.5}, ValueError, "0.5"),
    ({"backend": 5}, TypeError, "int 5"),
    ({"backend": "nump"}, ValueError, "'nump'"),
    ({"cases": [5]}, TypeError, "int 5"),
    ({"supports": [5]}, TypeError, "int 5"),
    ({"adapter": {5: "x"}}, TypeError, "int 5"),
    ({"combos": "pairs"}, TypeError, "'pairs'"),  # "combos: ('p',) holds 'p'"
    ({"combos": 5}, TypeError, "5"),  # "'int' object is not iterable"
    ({"cases": 5}, TypeError, "int 5"),  # "'int' object is not iterable"
    ({"progress": 5}, TypeError, "int 5"),  # "'int' object is not callable" after a case
    ({"command": 5}, TypeError, "int 5"),  # "'int' object has no attribute 'replace'"
    ({"command": "npattn verify x"}, ValueError, "'npattn verify x'"),  # each rerun that line
    ({"target": 5}, TypeError, "int 5"),
    ({"backward_target": 5, "backward": npattn_backward}, TypeError, "int 5"),
])
def test_a_bad_argument_is_told_by_its_keyword_with_what_was_expected_and_received(
        kwargs, error, received):
    """Each keyword of ``verify`` with a bad value: 'KEYWORD: expected ..., got VALUE', the
    keyword as the Python caller wrote it and the value as given, raised before any case."""
    keyword = next((k for k in kwargs if k not in ("supports", "backward")), next(iter(kwargs)))
    with pytest.raises(error) as info:
        VF.verify(_never_called, **{"cases": ["base-1x65"], **kwargs})
    message = str(info.value)
    assert message.startswith(f"{keyword}: expected "), message
    assert message.endswith(f", got {received}") or f", got {received} (" in message, message
    assert "both of" not in message


def test_did_you_mean_names_up_to_three_close_names():
    names = ["base-64x129", "base-65x128", "base-65x127", "base-127x64", "causal-65x129"]
    assert VF.did_you_mean("base-65x12", names) == \
        "did you mean 'base-65x128', 'base-65x127' or 'base-64x129'? "
    assert VF.did_you_mean("causal-65x12", ["causal-65x129"]) == "did you mean 'causal-65x129'? "
    assert VF.did_you_mean("zzz", names) == ""


def test_an_unknown_case_name_is_told_with_its_close_matches_and_how_to_list_the_panel():
    """'cases: ... got 'base-1x6' (the panel has 7: base-127x64, ...; list them with npattn
    verify ... --list)': the first six names by alphabet, and a command-line flag to a Python
    caller."""
    with pytest.raises(ValueError) as info:
        VF.verify(_never_called, cases=["base-1x6"])
    message = str(info.value)
    assert message.startswith("cases: expected names of the panel's cases or Case objects, got "
                              "'base-1x6' (did you mean 'base-1x65'"), message
    assert "--list" not in message and "npattn verify" not in message
    n = len(VF.plan())
    assert f"npattn.verifier.plan(supports, align=..., combos=..., head_dims=...) returns the " \
           f"panel's {n} cases" in message


@pytest.mark.parametrize("adapter, error, message", [
    ({"is_casual": "causal"}, ValueError, r"adapter: expected keys from npattn's keywords .*'is_casual'"),
    ({"is_causal": 1}, TypeError, r"adapter: expected each value to be a keyword name \(str\) or None"),
    ({"is_causal": "mask"}, ValueError, "adapter: expected each keyword to keep a name of its own, got 'mask'"),
])
def test_adapter_mapping_is_checked(adapter, error, message):
    """A misspelt key would rename nothing and the kernel would see its default (not causal)."""
    with pytest.raises(error, match=message):
        VF.verify(npattn_kernel, supports="causal", adapter=adapter)
    # dropping two keywords (None) is not a clash
    assert VF.plan("causal") and VF.verify(
        lambda q, k, v, **kw: npattn_kernel(q, k, v)[0], dtype="float64", supports="causal",
        adapter={"is_causal": None, "align": None}, cases=["base-65x128"]).ok


@pytest.mark.parametrize("options, align", [
    (("causal", "causal_bottom_right"), "top_left"),
    (("mask_bool", "mask_float"), "top_left"),
    (("causal_bottom_right", "window"), "top_left"),  # one call has one align: the window's
    (("causal", "alibi"), "bottom_right"),
])
def test_a_case_with_options_one_call_cannot_hold_is_refused(options, align):
    """A Case of the caller's own with both causal alignments ran as bottom-right alone and was
    reported as a pass under "causal" and "causal_bottom_right" both; such a case (and the other
    sets no call can hold) is a ValueError naming it, before the kernel runs."""
    calls = []

    def kernel(q, k, v, **kw):
        calls.append(kw)
        return npattn_kernel(q, k, v, **kw)[0]

    supports = ",".join(options)
    case = VF.Case(name="mine", B=1, Hq=1, Hkv=1, Lq=4, Lk=6, Dh=4, Dv=4, options=options, seed=1)
    message = (rf"^cases: expected options that one call can hold \(align='{align}'\), got case 'mine' "
               rf"with {re.escape(str(sorted(options)))}$")
    with pytest.raises(ValueError, match=message):
        VF.plan(supports, align=align, cases=[case])
    with pytest.raises(ValueError, match=message):
        VF.verify(kernel, supports=supports, align=align, cases=[case])
    assert calls == []


@pytest.mark.parametrize("cases", [[], (), iter([])])
def test_an_empty_selection_of_cases_is_refused(cases):
    """cases=[] ran no case and reported "passed: 0/0 cases pass" (ok True) whatever the kernel
    does; as head_dims=[], an empty selection is a ValueError naming cases, before any case."""
    def wrong(q, k, v, **kw):
        return q * 0.0
    with pytest.raises(ValueError, match=r"^cases: expected one case or more"):
        VF.plan("causal", cases=cases)
    with pytest.raises(ValueError, match=r"^cases: expected one case or more"):
        VF.verify(wrong, supports="causal", cases=cases)


def test_a_name_given_twice_runs_once():
    names = [c.name for c in VF.plan("causal", cases=["base-65x128", "base-65x128"])]
    assert names == ["base-65x128"]


@pytest.mark.parametrize("wrong", ["out", "dq", "dk", "dv"])
def test_outputs_in_another_dtype_fail(wrong):
    """The right numbers in float64 for float32 inputs are not the kernel's contract."""
    def kernel(q, k, v, **kw):
        out, cache = F.sdpa_forward(q, k, v, **kw)
        return (out.astype(np.float64) if wrong == "out" else out), cache

    def backward(dout, cache):
        g = F.sdpa_backward(dout, cache)
        return tuple(x.astype(np.float64) if n == wrong else x
                     for n, x in zip(("dq", "dk", "dv"), (g.dq, g.dk, g.dv)))

    report = VF.verify(kernel, backward=backward, dtype="float32", cases=["base-65x128"])
    r = report.results[0]
    assert r.failing == [wrong]
    of = {"out": "q", "dq": "q", "dk": "k", "dv": "v"}[wrong]  # the input it takes its dtype from
    assert r.tensors[wrong].note == f"dtype: expected float32 (as {of}), got float64"
    assert r.hint == f"{wrong}: {r.tensors[wrong].note}"
    assert r.tensors[wrong].error <= r.tensors[wrong].budget  # the numbers themselves are right


@pytest.mark.parametrize("layout", ["bhsd", "bshd", "bthd"])
def test_a_wrong_shape_is_told_in_the_kernels_layout(layout):
    """The shapes in the note are the kernel's own: a (B, L, H, D) kernel that returns
    (B, H, L, D) reads 'expected (B, L, H, D), got (B, H, L, D)', not the other way round;
    an out that is not 4-D is a wrong shape, not an error of verify's own."""
    c = VF.plan("", cases=["base-65x128"])[0]
    want = (c.B, c.Hq, c.Lq, c.Dv) if layout == "bhsd" else (c.B, c.Lq, c.Hq, c.Dv)
    swapped = (want[0], want[2], want[1], want[3])

    def kernel(q, k, v, **kw):
        return np.zeros(swapped, dtype=q.dtype)

    def flat(q, k, v, **kw):
        return np.zeros((q.shape[0], 7), dtype=q.dtype)

    r = VF.verify(kernel, layout=layout, dtype="float64", cases=[c.name]).results[0]
    assert r.error is None and r.failing == ["out"]
    assert r.tensors["out"].note.startswith(f"shape: expected {want} ")
    assert f"got {swapped} (axes 1 and 2 swapped" in r.tensors["out"].note
    r = VF.verify(flat, layout=layout, dtype="float64", cases=[c.name]).results[0]
    assert r.error is None and r.failing == ["out"]
    assert r.tensors["out"].note.startswith(f"shape: expected {want} ")
    assert r.tensors["out"].note.endswith(f"got {(c.B, 7)}")

    def lse_swapped(q, k, v, **kw):  # out right, lse (B, Lq, H) for (B, H, Lq) and back
        q, k, v = (t if layout == "bhsd" else np.swapaxes(t, 1, 2) for t in (q, k, v))
        out, cache = F.sdpa_forward(q, k, v, **kw)
        lse = np.asarray(cache.lse)  # [B, H, Lq]
        return (out if layout == "bhsd" else np.swapaxes(out, 1, 2),
                lse if layout == "bthd" else np.swapaxes(lse, 1, 2))

    r = VF.verify(lse_swapped, layout=layout, returns_lse=True, dtype="float64",
                  cases=[c.name]).results[0]
    assert r.error is None and r.failing == ["lse"], r.failing
    want_lse = (c.B, c.Lq, c.Hq) if layout == "bthd" else (c.B, c.Hq, c.Lq)
    assert r.tensors["lse"].note.startswith(f"shape: expected {want_lse} "), r.tensors["lse"].note
    assert r.tensors["lse"].note.endswith(" (axes 1 and 2 swapped)"), r.tensors["lse"].note


def test_a_failing_tensor_says_where():
    """One query row of one head wrong: the report counts its entries, names the worst one
    and the row, in (B, H, L, D) terms whatever the layout."""
    c = VF.plan("", cases=["base-65x128"])[0]
    row = 40

    def kernel(q, k, v, **kw):  # (B, L, H, D)
        out, _ = F.sdpa_forward(*(np.swapaxes(t, 1, 2) for t in (q, k, v)), **kw)
        out = np.swapaxes(out, 1, 2).copy()
        out[1, row, 0, :] += np.linspace(0.1, 1.0, out.shape[-1])  # b=1, h=0: worst at the last d
        out[0, [row + 1, row + 2, row + 10], 1, 0] += 0.05           # b=0, h=1: one entry each
        return out

    report = VF.verify(kernel, layout="bshd", dtype="float64", cases=[c.name])
    t = report.results[0].tensors["out"]
    assert t.status == "fail"
    assert t.where == (f"{c.Dv + 3} of {c.B * c.Hq * c.Lq * c.Dv} entries over budget, the worst "
                       f"at b=1, h=0, query={row}, d={c.Dv - 1}; query rows {row}-{row + 2}, "
                       f"{row + 10} (4 of {c.Lq})")
    assert f"    where: out: {t.where}" in report.format()
    assert json.loads(report.to_json())["cases"][0]["tensors"]["out"]["where"] == t.where


@pytest.mark.parametrize("n_runs", [6, 7])
def test_where_lists_six_runs_of_rows_and_elides_the_rest(n_runs):
    """The rows over budget are listed as runs, the first six of them; '...' only when there
    are more."""
    rows = [3 * i for i in range(n_runs)]

    def kernel(q, k, v, **kw):
        out = F.sdpa_forward(q, k, v, **kw)[0].copy()
        out[0, 0, rows, 0] += 0.5
        return out

    t = VF.verify(kernel, dtype="float64", cases=["base-65x128"]).results[0].tensors["out"]
    listed = ", ".join(str(r) for r in rows[:6]) + (", ..." if n_runs > 6 else "")
    assert t.where.endswith(f"; query rows {listed} ({n_runs} of 65)"), t.where


def test_report_json_and_table_and_plot(tmp_path):
    pytest.importorskip("matplotlib")
    report = run_kernel(K.bug_gqa_no_sum, "float64", supports="gqa,causal", combos=False)
    data = json.loads(report.to_json())
    assert data["ok"] is False and data["n_failed"] == len(report.failures) > 0
    assert {"option", "tensor", "cases", "error", "budget", "ratio", "status"} <= set(data["table"][0])
    rows = {(r["option"], r["tensor"]): r for r in data["table"]}
    assert rows[("gqa", "dk")]["status"] == "FAIL" and rows[("gqa", "dq")]["status"] == "pass"
    assert rows[("causal", "dk")]["status"] == "pass"
    case = next(c for c in data["cases"] if c["status"] == "fail")
    assert case["tensors"]["dk"]["status"] == "fail" and case["reproducer"] and case["hint"]
    assert data["hints"] and "gqa" in data["hints"][0]
    path = report.plot(str(tmp_path / "r.png"))
    assert open(path, "rb").read(8) == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("cases", [["base-1x65"], ["base-1x65", "base-64x129"]])
def test_the_plot_of_a_few_cases_keeps_its_budget_label_in_the_axes(tmp_path, monkeypatch, cases):
    # a failing case's rerun line runs one case (--case NAME): its plot's x-axis once hugged the
    # one point, so the "budget" label fell outside the axes and tight_layout warned
    import warnings

    plt = pytest.importorskip("matplotlib.pyplot")
    figures = []
    close = plt.close
    monkeypatch.setattr(plt, "close", lambda fig=None: (figures.append(fig), close(fig)))
    report = run_kernel(K.attention, "float64", supports="", cases=cases)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        report.plot(str(tmp_path / "r.png"))
    (ax,) = figures[0].axes
    (label,) = [t for t in ax.texts if t.get_text() == "budget"]
    lo, hi = ax.get_xlim()
    assert (lo, hi) == (-0.5, len(cases) - 0.5)
    assert lo <= label.get_position()[0] <= hi


def test_the_python_reproducer_reruns_the_case():
    report = run_kernel(K.bug_scale_twice, "float64", supports="causal", combos=False)
    r = report.failures[0]
    # the reproducer names the kernel by its module, here loaded as verify_example_kernels
    call = r.reproducer.replace("verify_example_kernels.", "kernels.").replace(
        "print(npattn.verify(", "npattn.verify(")[:-1]
    again = eval(call, {"npattn": npattn, "kernels": K})
    assert [x.case.name for x in again.results] == [r.case.name]
    assert again.results[0].tensors["dq"].error == r.tensors["dq"].error


def test_the_python_reproducer_gives_a_case_changed_under_a_panel_name_as_the_case():
    """A Case that bears a panel case's name but other values is rerun as the Case itself:
    the name alone would rerun the panel's case."""
    import npattn

    def kernel(q, k, v, **kw):
        return F.sdpa_forward(q, k, v, **kw)[0] * 1.01

    panel_case = VF.plan("", cases=["base-65x128"])[0]
    changed = replace(panel_case, score_std=3.0)
    same = VF.verify(kernel, dtype="float64", cases=[panel_case]).results[0].reproducer
    assert "cases=['base-65x128']" in same, same
    rep = VF.verify(kernel, dtype="float64", cases=[changed]).results[0].reproducer
    assert "cases=[npattn.verify_cases.Case(name='base-65x128'" in rep and "score_std=3.0" in rep, rep
    again = eval(rep.split("  # ")[0][len("print("):-1], {"npattn": npattn, "kernel": kernel})
    assert again.results[0].case == changed


# --------------------------------------------------------------------------
# npattn.testing


@given(case=S.attention_cases(supports=ALL, max_len=40))
def test_hypothesis_cases_pass_the_example_kernel(case):
    assert set(case.options) <= set(ALL)
    report = assert_attention_close(K.attention, backward=K.attention_backward, returns_lse=True,
                                    supports=ALL, dtype="float64", cases=[case])
    assert report.results[0].case == case


@given(case=S.attention_cases(supports="causal,window,segments,mask_float,causal_bottom_right",
                              max_len=40))
def test_hypothesis_cases_leave_no_empty_row_unless_declared(case):
    inp = VC.case_inputs(case)
    opts = dict(inp.options)
    out, cache = F.sdpa_forward(inp.q, inp.k, inp.v, **opts)
    assert np.all(cache.probs.sum(axis=-1) > 0)


def test_assert_attention_close_raises_with_the_table():
    with pytest.raises(AssertionError) as info:
        assert_attention_close(K.bug_softmax_no_rowsum, backward=K.attention_backward,
                               returns_lse=True, dtype="float64", cases=["base-65x128"])
    text = str(info.value)
    assert "disagrees with npattn" in text and "worst err" in text and "below the softmax" in text


def test_head_dims_draw_the_panel_at_the_widths_a_kernel_takes():
    """A kernel that takes only Dh in {32, 64} fails the default panel (its Dh of 8 and 16)
    and passes with head_dims=(32, 64); Dv follows, dv_ne_dk takes the other width."""
    def only_32_64(q, k, v, **options):
        if q.shape[-1] not in (32, 64) or v.shape[-1] not in (32, 64):
            raise ValueError(f"head width {q.shape[-1]}/{v.shape[-1]} not supported")
        return npattn_kernel(q, k, v, **options)

    supports = "causal,dv_ne_dk,scale"
    cases = VF.plan(supports, head_dims=(32, 64))
    assert {c.Dh for c in cases} == {32, 64} and all(c.Dv in (32, 64) for c in cases)
    assert any(c.Dv != c.Dh for c in cases if "dv_ne_dk" in c.options)
    for c in cases:
        if "scale" in c.options:  # the same multiple of 1/sqrt(Dh) as the panel's own
            assert any(math.isclose(c.scale * math.sqrt(c.Dh), f) for f in (0.5, 1.7))
    report = VF.verify(only_32_64, supports=supports, backward=npattn_backward, returns_lse=True,
                       head_dims=(32, 64))
    assert report.ok, report.format()
    assert report.config["head_dims"] == [32, 64]
    default = VF.verify(only_32_64, supports=supports, backward=npattn_backward, returns_lse=True)
    assert not default.ok and "head width" in default.format()
    with pytest.raises(ValueError, match="head_dims"):
        VF.plan(supports, head_dims=(0,))
    # dv_ne_dk needs a second width: one alone gave Dv = Dh + 8, a width the kernel never named
    with pytest.raises(ValueError, match="head_dims: expected two different widths"):
        VF.plan(supports, head_dims=(64,))
    assert VF.plan("causal,scale", head_dims=(64,))  # one width is enough without dv_ne_dk
    dv_cases = [c for c in cases if "dv_ne_dk" in c.options]
    assert dv_cases and all(c.Dv != c.Dh and {c.Dh, c.Dv} == {32, 64} for c in dv_cases)


def test_the_dv_ne_dk_cases_take_a_wider_and_a_narrower_dv():
    """A kernel may break on a value head wider than the key head or on one narrower: the
    option's cases hold both."""
    cases = [c for c in VC.panel("dv_ne_dk") if "dv_ne_dk" in c.options]
    assert any(c.Dv > c.Dh for c in cases) and any(c.Dv < c.Dh for c in cases), cases


def test_under_dv_ne_dk_dv_is_the_next_head_width():
    """With head_dims, a dv_ne_dk case takes as Dv the width after its Dh in head_dims (the
    first after the last), not the first width unlike Dh."""
    dims = (8, 16, 32)
    cases = [c for c in VC.panel("dv_ne_dk", head_dims=dims) if "dv_ne_dk" in c.options]
    assert cases
    for c in cases:
        assert c.Dv == dims[(dims.index(c.Dh) + 1) % len(dims)], (c.name, c.Dh, c.Dv)


@pytest.mark.parametrize("head_dims, supports", [((64, 64), "causal"), ([32, 64, 32], "causal"),
                                                 ((64, 64), "causal,dv_ne_dk")])
def test_a_head_width_given_twice_is_refused_as_the_command_refuses_it(head_dims, supports, capsys):
    """``npattn verify --head-dims 64,64`` is a usage error; ``npattn.verify(head_dims=(64, 64))``
    ran, the repeated width taking more of the panel's turns. Both now say so, in the same
    words (one check), the Python call before any case runs."""
    calls = []

    def kernel(q, k, v, **options):
        calls.append(q.shape)
        return npattn_kernel(q, k, v, **options)

    repeated = next(d for i, d in enumerate(head_dims) if d in head_dims[:i])
    words = f"expected each entry once, got {repeated} more than once in "
    with pytest.raises(ValueError, match=re.escape(f"head_dims: {words}{head_dims!r}")):
        VF.verify(kernel, supports=supports, head_dims=head_dims, combos=False)
    with pytest.raises(ValueError, match=re.escape(f"head_dims: {words}{head_dims!r}")):
        VF.plan(supports, head_dims=head_dims)
    assert not calls
    from npattn.tools import cli

    text = ",".join(str(d) for d in head_dims)
    assert cli.main(["verify", f"{KERNELS}:attention", "--supports", supports,
                     "--head-dims", text, "--no-progress"]) == 2
    assert capsys.readouterr().err == f"npattn verify: --head-dims: {words}{text!r}\n"


def test_a_kernel_that_raises_shows_where():
    """The report says where fn raised (its innermost frame) and keeps the whole traceback in
    the case and the JSON; the hint sent the reader to a rerun that printed no traceback."""
    def helper(q):
        raise RuntimeError("boom")

    def raises(q, k, v, **kw):
        return helper(q)

    report = VF.verify(raises, dtype="float64", combos=False, cases=["base-1x65"])
    r = report.failures[0]
    assert r.error == "RuntimeError: boom"
    assert "in helper" in r.traceback and 'raise RuntimeError("boom")' in r.traceback
    assert r.raised_at.endswith(" in helper") and r.raised_at.split(":")[0].endswith("test_verify.py")
    assert f"    at: {r.raised_at}" in report.format() and "traceback" in r.hint
    assert json.loads(report.to_json())["cases"][0]["traceback"] == r.traceback
    assert report.hints() == []  # one failing case: its own lines say it raised
    both = VF.verify(raises, dtype="float64", combos=False, cases=["base-1x65", "base-65x128"])
    assert both.hints()[0] == "fn raised in every failing case (RuntimeError: boom)", both.hints()


def test_the_python_reproducer_gives_two_local_functions_of_one_name_two_names():
    import npattn

    def make_fn():
        def f(q, k, v, **kw):
            return F.sdpa_forward(q, k, v, **kw)
        return f

    def make_bwd():
        def f(dout, cache):
            return F.sdpa_backward(2.0 * dout, cache)
        return f

    fn, bwd = make_fn(), make_bwd()
    report = VF.verify(fn, backward=bwd, dtype="float64", combos=False, cases=["base-1x65"])
    call, comment = report.results[0].reproducer.split("  # ")
    assert call.startswith("print(npattn.verify(fn, ") and "backward=f," in call
    assert comment.startswith("f: <function") and "; fn: <function" in comment
    again = eval(call[len("print("):-1], {"npattn": npattn, "fn": fn, "f": bwd})
    assert again.results[0].failing == report.results[0].failing == ["dq", "dk", "dv"]

    def make_named_fn(scale):
        def fn(dout, cache):
            return F.sdpa_backward(scale * dout, cache)
        return fn

    def make_kernel_fn():
        def fn(q, k, v, **kw):
            return F.sdpa_forward(q, k, v, **kw)
        return fn

    fn, bwd = make_kernel_fn(), make_named_fn(2.0)  # both named fn, the default name of fn too
    report = VF.verify(fn, backward=bwd, dtype="float64", combos=False, cases=["base-1x65"])
    call, comment = report.results[0].reproducer.split("  # ")
    assert call.startswith("print(npattn.verify(fn_, ") and "backward=fn," in call, call
    again = eval(call[len("print("):-1], {"npattn": npattn, "fn_": fn, "fn": bwd})
    assert again.results[0].failing == report.results[0].failing == ["dq", "dk", "dv"]


def test_the_example_kernel_backward_at_saturated_softcaps_and_with_inf_dlse_on_empty_rows():
    """The example kernel's softcap derivative is 1/cosh(u)^2, which does not cancel where
    tanh(u) rounds to 1 (1 - tanh^2 gave float32 dq off by 0.4 of its scale at 7-9 softcaps), and a
    dlse of inf on a row with nothing to attend changes nothing (0 * inf gave NaN)."""
    from npattn import attention as A

    rng = np.random.default_rng(3)
    # every score between 7 and 9 softcaps: q = (a_i, 0), k = (b_j, 0), a and b in [2.65, 3]
    q = np.zeros((1, 2, 5, 2))
    k = np.zeros((1, 2, 6, 2))
    q[..., 0] = rng.uniform(2.65, 3.0, (1, 2, 5))
    k[..., 0] = rng.uniform(2.65, 3.0, (1, 2, 6))
    v = rng.standard_normal((1, 2, 6, 2))
    dout = rng.standard_normal((1, 2, 5, 2))
    f32 = [t.astype(np.float32) for t in (q, k, v)]
    q64, k64, v64 = (t.astype(np.float64) for t in f32)  # the float32 inputs, exactly
    _, c = A.sdpa_forward(q64, k64, v64, softcap=1.0, scale=1.0, impl="reference")
    want = A.sdpa_backward(dout.astype(np.float32).astype(np.float64), c)
    _, _, saved = K.attention(*f32, softcap=1.0, scale=1.0)
    got = K.attention_backward(dout.astype(np.float32), saved)
    for g, w in ((got.dq, want.dq), (got.dk, want.dk)):
        assert np.abs(g - w).max() <= 1e-3 * np.abs(w).max()
    rng = np.random.default_rng(4)
    q, k, v = (rng.standard_normal((1, 2, 5, 4)) for _ in range(3))
    dout = rng.standard_normal((1, 2, 5, 4))
    mask = np.ones((5, 5), bool)
    mask[1] = False  # row 1 attends nothing
    out, lse, saved = K.attention(q, k, v, mask=mask)
    dlse = rng.standard_normal(lse.shape)
    dlse[..., 1] = np.inf
    g = K.attention_backward(dout, saved, dlse=dlse)
    dlse[..., 1] = 0.0
    g0 = K.attention_backward(dout, saved, dlse=dlse)
    for a, b in zip(g[:3], g0[:3]):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("lib", ["torch", "cupy"])
def test_npattn_passes_and_a_mutant_fails_on_a_device_library(lib):
    """verify with backend= torch or CuPy (a GPU): the panel's arrays are made in that library
    and npattn itself, given them, passes with every tensor checked; the same kernel with its
    output off by 0.1 % fails on out. (CuPy runs where a GPU is, with the gpu mark.)"""
    from conftest import backend_or_skip

    backend_or_skip(lib)

    def off(q, k, v, **options):
        out, lse, cache = npattn_kernel(q, k, v, **options)
        return out * 1.001, lse, cache

    supports = "causal,mask_bool,mask_float,gqa,dv_ne_dk,dropout_mask,scale,empty_rows"
    report = run_kernel(npattn_kernel, "float64", backend=lib, backward=npattn_backward,
                        supports=supports, mask_grad=True, lse_grad=True)
    assert report.ok, report.format()
    assert report.config["backend"] == lib
    bad = run_kernel(off, "float64", backend=lib, backward=npattn_backward, supports=supports)
    assert not bad.ok and failing(bad, "out")


# --------------------------------------------------------------------------
# the report: ratios, the table, the summary, the JSON


def test_a_tensor_of_a_kernel_that_raised_has_an_infinite_ratio():
    """A kernel that raised has no budget (0) and an infinite error: its ratio is inf, in the
    table and the JSON, not 0 (which reads as an exact match). A budget of 0 with no error is
    an exact match, ratio 0."""
    assert VF.TensorResult("out", math.inf, 0.0, 0.0, 0.0, 0.0, "fail").ratio == math.inf
    assert VF.TensorResult("out", 1e-300, 0.0, 0.0, 0.0, 0.0, "fail").ratio == math.inf
    assert VF.TensorResult("out", 0.0, 0.0, 0.0, 0.0, 0.0, "pass").ratio == 0.0
    assert VF.TensorResult("out", 3.0, 2.0, 0.0, 0.0, 0.0, "fail").ratio == 1.5

    def raises(q, k, v, **kw):
        raise RuntimeError("boom")

    report = VF.verify(raises, dtype="float64", combos=False, cases=["base-1x65"])
    data = json.loads(report.to_json())
    assert data["cases"][0]["tensors"]["out"]["ratio"] == "inf"
    assert [row["ratio"] for row in data["table"]] == ["inf"]


def test_a_wrong_dtype_is_said_even_where_the_numbers_are_wrong_too():
    """A tensor in another dtype fails for its dtype whatever its numbers: the failing case's
    line says 'out (dtype)', not a ratio (the ratio would send the reader to the math)."""
    def float64_and_off(q, k, v, **options):
        out, lse, cache = npattn_kernel(q, k, v, **options)
        return out.astype(np.float64) * 1.5, lse, cache

    report = VF.verify(float64_and_off, backward=npattn_backward, returns_lse=True,
                       dtype="float32", combos=False, cases=["base-1x65"])
    r = report.results[0]
    assert r.tensors["out"].ratio > 1.0 and r.tensors["out"].note.startswith("dtype:")
    assert "Dh=16 Dv=16: out (dtype)\n" in report.format(), report.format()


def test_an_output_of_another_library_is_counted_in_the_table_as_such():
    torch = pytest.importorskip("torch")

    def as_torch(q, k, v, **options):
        out, *rest = npattn_kernel(q, k, v, **options)
        return (torch.from_numpy(out), *rest)

    report = VF.verify(as_torch, backward=npattn_backward, returns_lse=True, dtype="float64",
                       combos=False, cases=["base-1x65"])
    row = next(r for r in report.table_rows() if r["tensor"] == "out")
    assert row["failed"] == 1 and row["wrong_type"] == 1
    assert "FAIL 1/1 (1 of another dtype or library)" in report.table()


def test_a_case_that_passes_with_a_degenerate_tensor_has_no_failing_tensor_and_no_hint():
    """A degenerate tensor passes: the case lists no failing tensor and gives no hint (a
    hint is the first step that went wrong)."""
    case = VC.Case(name="saturated", Lq=9, Lk=17, score_std=40.0)
    report = VF.verify(npattn_kernel, backward=npattn_backward, returns_lse=True,
                       dtype="float64", cases=[case])
    r = report.results[0]
    assert r.status == "degenerate" and report.ok
    assert {n for n, t in r.tensors.items() if t.status == "degenerate"} >= {"dq", "dk"}
    assert r.failing == [] and r.hint == "" and r.to_dict()["hint"] == ""


def _off_when_causal(q, k, v, **options):
    """npattn with out 1 % off in the causal cases."""
    out, lse, cache = npattn_kernel(q, k, v, **options)
    return (out * 1.01 if options.get("is_causal") else out), lse, cache


def test_the_table_summary_and_json_add_up_the_cases():
    """Two causal cases fail (out 1 % off), two base cases pass and a saturated case without
    options passes with dq and dk degenerate: the table has a '(none)' row for the cases
    without options, each row names its worst case with that case's ratio, counts the
    failures and the degenerate tensors; the summary and the JSON count the same."""
    saturated = VC.Case(name="saturated", Lq=9, Lk=17, score_std=40.0)
    cases = VF.plan("causal", combos=False, cases=["base-1x65", "base-64x129", "causal-65x129",
                                                  "causal-128x65"]) + [saturated]
    report = VF.verify(_off_when_causal, backward=npattn_backward, returns_lse=True,
                       dtype="float64", supports="causal", cases=cases)
    status = {r.case.name: r.status for r in report.results}
    assert status == {"base-1x65": "pass", "base-64x129": "pass", "causal-65x129": "fail",
                      "causal-128x65": "fail", "saturated": "degenerate"}
    rows = {(row["option"], row["tensor"]): row for row in report.table_rows()}
    assert set(rows) == {(o, t) for o in ("(none)", "causal")
                         for t in ("out", "lse", "dq", "dk", "dv")}
    out = rows[("causal", "out")]
    ratios = {r.case.name: r.tensors["out"].ratio for r in report.results if r.case.options}
    assert min(ratios.values()) > 1.0
    assert out["worst_case"] == max(ratios, key=ratios.get) and out["ratio"] == max(ratios.values())
    assert (out["cases"], out["failed"], out["status"], out["wrong_type"]) == (2, 2, "FAIL", 0)
    assert (rows[("causal", "lse")]["failed"], rows[("causal", "lse")]["status"]) == (0, "pass")
    none_dq = rows[("(none)", "dq")]
    assert (none_dq["cases"], none_dq["failed"], none_dq["degenerate"]) == (3, 0, 1)
    assert rows[("(none)", "dv")]["degenerate"] == 0
    assert "FAIL 2/2" in report.table() and "pass (1 degenerate)" in report.table()
    assert ": FAILED: 3/5 cases pass (1 with a degenerate tensor), out, lse, gradients;" in \
        report.summary(), report.summary()
    data = json.loads(report.to_json())
    assert (data["ok"], data["n_cases"], data["n_failed"], data["n_degenerate"]) == (False, 5, 2, 1)
    assert data["hints"] == report.hints() and data["hints"]
    assert [(row["option"], row["tensor"], row["ratio"]) for row in data["table"]] == \
        [(row["option"], row["tensor"], row["ratio"]) for row in report.table_rows()]


def test_cases_without_numbers_are_counted_apart_in_the_table():
    """A case whose kernel raised, or returned what verify cannot read, has no numbers: its
    row showed an error of inf against a budget of 0 (ratio inf), and the hint blamed the
    core. Now the row counts such cases apart, prints no numbers when every case is one,
    takes the worst ratio from the cases that have numbers, and blames the core only for
    a case without options that has numbers and fails."""
    cases = ["base-1x65", "base-64x129"]

    def pair(q, k, v, **options):  # (out, lse) without returns_lse: unreadable
        return q, q[..., 0]

    report = VF.verify(pair, dtype="float64", cases=VF.plan(cases=cases))
    (row,) = report.table_rows()
    assert (row["option"], row["tensor"], row["cases"], row["failed"], row["raised"]) == \
        ("(none)", "out", 2, 2, 2)
    line = report.table().splitlines()[2]
    assert line.split()[3:6] == ["-", "-", "-"] and line.endswith("FAIL 2/2 (2 raised or unreadable)"), line
    assert not any("the core" in h for h in report.hints()), report.hints()

    def raises_on_one_query(q, k, v, **options):  # raises at Lq = 1, 2 % off elsewhere
        if q.shape[-2] == 1:
            raise RuntimeError("no single-query path")
        out, lse, _ = npattn_kernel(q, k, v, **options)
        return out * 1.02, lse

    report = VF.verify(raises_on_one_query, returns_lse=True, dtype="float64",
                       cases=VF.plan(cases=cases))
    rows = {row["tensor"]: row for row in report.table_rows()}
    measured = next(r for r in report.results if r.case.name == "base-64x129")
    assert measured.tensors["out"].ratio > 1.0  # out is 2 % off: more than its budget
    assert (rows["out"]["raised"], rows["out"]["worst_case"], rows["out"]["ratio"]) == \
        (1, "base-64x129", measured.tensors["out"].ratio)
    out_line = next(ln for ln in report.table().splitlines() if ln.split()[1:2] == ["out"])
    assert float(out_line.split()[5]) == pytest.approx(measured.tensors["out"].ratio, rel=1e-2), out_line
    assert "FAIL 2/2 (1 raised or unreadable)" in report.table()
    assert any(h.startswith("cases without options fail: the core") for h in report.hints()), \
        report.hints()


def test_the_failing_cases_are_listed_up_to_max_failures():
    def off(q, k, v, **options):
        out, lse, cache = npattn_kernel(q, k, v, **options)
        return out * 1.01, lse, cache

    names = ["base-1x65", "base-64x129", "base-65x128", "base-127x64"]
    report = VF.verify(off, backward=npattn_backward, returns_lse=True, dtype="float64",
                       cases=names)
    assert [r.case.name for r in report.failures] == names
    text = report.format()
    assert text.count("\n    rerun: ") == 4 and "more (see the JSON)" not in text
    short = report.format(max_failures=2)
    assert short.count("\n    rerun: ") == 2 and "  ... and 2 more (see the JSON)" in short
    exact = report.format(max_failures=4)
    assert exact.count("\n    rerun: ") == 4 and "more (see the JSON)" not in exact


def test_a_failing_cases_line_gives_each_failing_tensors_ratio_to_three_digits():
    """'dk 304x, dv 306x' (docs/verify.md): the line of a failing case names its failing
    tensors with their ratios, error / budget, to three significant digits."""
    def off(q, k, v, **options):
        out, lse, cache = npattn_kernel(q, k, v, **options)
        return out * 1.01, lse * 1.001, cache

    report = VF.verify(off, backward=npattn_backward, returns_lse=True, dtype="float32",
                       cases=["base-65x128", "base-127x64"])
    text = report.format()
    assert len(report.failures) == 2, text
    for r in report.failures:
        line = next(ln for ln in text.splitlines() if ln.startswith(f"  {r.case.name} B="))
        listed = dict(part.split(" ") for part in line.rsplit(": ", 1)[1].split(", "))
        assert set(listed) == set(r.failing) == {"out", "lse"}, line
        for n, shown in listed.items():
            ratio = r.tensors[n].ratio
            unit = 10.0 ** (math.floor(math.log10(ratio)) - 2)  # of the third significant digit
            assert shown.endswith("x") and abs(float(shown[:-1]) - ratio) <= 0.5001 * unit, (line, ratio)


def test_a_degenerate_case_that_wrote_into_its_inputs_is_counted_failed_not_degenerate():
    def writes_q(q, k, v, **options):
        res = npattn_kernel(q, k, v, **options)
        q[...] = 0.0  # after use: the outputs stay right
        return res

    saturated = VC.Case(name="saturated", Lq=9, Lk=17, score_std=40.0)
    report = VF.verify(writes_q, backward=npattn_backward, returns_lse=True, dtype="float64",
                       cases=[saturated])
    r = report.results[0]
    assert r.written == ["q"] and r.status == "fail" and r.tensors["dq"].status == "degenerate"
    row = next(row for row in report.table_rows() if row["tensor"] == "dq")
    assert (row["failed"], row["degenerate"], row["wrote"]) == (1, 0, 1)
    assert "FAIL 1/1 (1 wrote into its inputs)" in report.table()


def test_the_summary_says_what_was_compared():
    kw = dict(dtype="float64", cases=["base-1x65"])
    forward = VF.verify(lambda q, k, v, **o: F.sdpa_forward(q, k, v, **o)[0], **kw).summary()
    assert ": passed: 1/1 cases pass (0 with a degenerate tensor), out (no gradients: give " \
        "backward= or autograd=); bhsd float64 on numpy, seed 0," in forward, forward
    with_dlse = VF.verify(npattn_kernel, backward=npattn_backward, returns_lse=True,
                          lse_grad=True, **kw).summary()
    assert "1/1 cases pass (0 with a degenerate tensor), out, lse, gradients with dlse; " in \
        with_dlse, with_dlse

    def dmask_of_one_case(dout, cache):  # a dmask for the (B, 1, Lq, Lk) mask only
        g = npattn_backward(dout, cache)
        return g.dq, g.dk, g.dv, (g.dmask if g.dmask.shape[1] == 1 else None), g.dsinks

    masks = dict(dtype="float64", supports="mask_float", returns_lse=True,
                 cases=["mask_float-65x129", "mask_float-128x65"])
    for backward, counted in ((npattn_backward, "2/2"), (dmask_of_one_case, "1/2")):
        line = VF.verify(npattn_kernel, backward=backward, **masks).summary()
        assert f"2/2 cases pass (0 with a degenerate tensor), out, lse, gradients, dmask in {counted} " \
               "float-mask cases; " in line, line


# --------------------------------------------------------------------------
# hints, and what reaches the kernel


def _dq_hint(wrong_dq):
    """The hint of base-65x128 at float64 with npattn's gradients, dq replaced by
    ``wrong_dq(dq)``."""
    def backward(dout, cache):
        g = F.sdpa_backward(dout, cache)
        return wrong_dq(g.dq), g.dk, g.dv

    r = VF.verify(npattn_kernel, backward=backward, returns_lse=True, dtype="float64",
                  cases=["base-65x128"]).results[0]
    assert r.failing == ["dq"], r.failing
    return r.hint


def test_the_constant_factor_hint_needs_a_factor_and_a_constant():
    """'a constant factor (dq x c)' is said of dq = c * npattn's, c away from 1; not of a dq
    wrong by a part that is not a multiple (2 dq plus 20 % of its size in one column), nor
    of a dq off by a factor within 1e-3 of 1 (that is no factor of the scale or 1/(1-p))."""
    assert _dq_hint(lambda dq: 2.0 * dq).startswith("a constant factor (dq x 2):")

    def twice_and_a_column(dq):
        bad = 2.0 * dq
        bad[..., 0] += 0.2 * np.max(np.abs(dq))
        return bad

    plain = "dk right, dq wrong: dq = ds @ k * scale"
    assert _dq_hint(twice_and_a_column) == plain
    assert _dq_hint(lambda dq: dq * (1.0 + 1e-6)) == plain
    assert _dq_hint(lambda dq: dq * 1.01).startswith("a constant factor (dq x 1.01):")

    def twice_and_a_smaller_column(dq):  # 5 % of its size: still over 1 % of the largest entry
        bad = 2.0 * dq
        bad[..., 0] += 0.05 * np.max(np.abs(dq))
        return bad

    assert _dq_hint(twice_and_a_smaller_column) == plain


def _gqa_hint(wrong):
    """The hint of the first GQA case alone at float64, npattn's gradients passed through
    ``wrong(dq, dk, dv) -> (dq, dk, dv)``."""
    def backward(dout, cache):
        g = F.sdpa_backward(dout, cache)
        return wrong(g.dq, g.dk, g.dv)

    r = VF.verify(npattn_kernel, backward=backward, returns_lse=True, dtype="float64",
                  supports="gqa", combos=False, cases=["gqa-65x129"]).results[0]
    assert r.case.Hq // r.case.Hkv == 3
    return r


def test_the_gqa_hint_needs_dq_right_and_a_factor_of_one_over_the_group():
    """Under GQA, dk and dv x 1/G is a mean over the group; dk and dv x 0.1 (G = 3) is a
    constant factor, not a mean; dq, dk and dv all wrong is not 'dq right'."""
    mean = _gqa_hint(lambda dq, dk, dv: (dq, dk / 3.0, dv / 3.0))
    assert set(mean.failing) == {"dk", "dv"} and "a mean over the group" in mean.hint, mean.hint
    tenth = _gqa_hint(lambda dq, dk, dv: (dq, dk * 0.1, dv * 0.1))
    assert tenth.hint.startswith("a constant factor (dk x 0.1, dv x 0.1)"), tenth.hint

    def all_off(dq, dk, dv):  # wrong by a part that is not a multiple of any
        return tuple(g + 0.1 * np.max(np.abs(g)) * (np.arange(g.shape[-1]) == 0) for g in (dq, dk, dv))

    off = _gqa_hint(all_off)
    assert set(off.failing) == {"dq", "dk", "dv"}
    assert "dq right" not in off.hint and "GQA" not in off.hint, off.hint


def _off_out(q, k, v, **options):
    out, lse, cache = npattn_kernel(q, k, v, **options)
    return out * 1.01, lse, cache


def test_an_out_wrong_with_lse_right_is_told_after_the_softmax():
    """out 1 % off (no common mistake): with lse compared and right the hint points after
    the softmax; without lse it cannot tell, and names the whole forward."""
    kw = dict(backward=npattn_backward, dtype="float64", cases=["base-65x128"])
    r = VF.verify(_off_out, returns_lse=True, **kw).results[0]
    assert r.failing == ["out"] and r.tensors["lse"].status == "pass"
    assert r.hint.startswith("lse right, out wrong: after the softmax"), r.hint

    def out_only(q, k, v, **options):
        out, _, cache = _off_out(q, k, v, **options)
        return out, cache

    r = VF.verify(out_only, **kw).results[0]
    assert r.failing == ["out"] and r.hint.startswith("out wrong: the forward ("), r.hint


def _grad_hint(name, wrong, case="base-65x128", lse_grad=False, **kw):
    """The hint of ``case`` at float64 with npattn's gradients, ``name`` replaced by
    ``wrong(g)`` (g npattn's SDPAGrads)."""
    def backward(dout, cache, **dl):
        g = F.sdpa_backward(dout, cache, **dl)
        grads = {n: getattr(g, n) for n in ("dq", "dk", "dv", "dmask", "dsinks")}
        grads[name] = wrong(g)
        return grads

    r = VF.verify(npattn_kernel, backward=backward, returns_lse=True, dtype="float64",
                  lse_grad=lse_grad, cases=[case], **kw).results[0]
    assert r.failing == [name], r.failing
    return r.hint


def _plus_a_column(x):
    bad = x.copy()
    bad[..., 0] += 0.2 * np.max(np.abs(x))
    return bad


def test_a_wrong_dk_alone_is_told_by_its_own_formula():
    assert _grad_hint("dk", lambda g: _plus_a_column(g.dk)) == \
        "dq right, dk wrong: dk = ds^T @ q * scale (a transpose, or the GQA sum)"
    assert _grad_hint("dq", lambda g: _plus_a_column(g.dq)) == \
        "dk right, dq wrong: dq = ds @ k * scale"


def test_the_dsinks_hint_follows_lse_grad():
    """With lse_grad the sink's gradient takes dlse too: the hint gives the formula that
    the backward was asked for."""
    kw = dict(case="sinks-65x129", supports="sinks")
    wrong = lambda g: g.dsinks + 0.5
    assert _grad_hint("dsinks", wrong, **kw) == \
        "dsinks wrong, the rest right: dsink = -sum over rows of p_sink * delta"
    assert _grad_hint("dsinks", wrong, lse_grad=True, **kw) == \
        "dsinks wrong, the rest right: dsink = sum over rows of p_sink * (dlse - delta)"


def test_the_constant_factor_hint_needs_every_wrong_gradient_scaled():
    """dq x 2 with dk wrong by a part that is no multiple is not 'a constant factor': dq and
    dk wrong together point below the softmax."""
    def backward(dout, cache):
        g = F.sdpa_backward(dout, cache)
        return g.dq * 2.0, _plus_a_column(g.dk), g.dv

    r = VF.verify(npattn_kernel, backward=backward, returns_lse=True, dtype="float64",
                  cases=["base-65x128"]).results[0]
    assert r.failing == ["dq", "dk"]
    assert r.hint.startswith("dv right, dq/dk wrong: below the softmax"), r.hint


def test_a_wrong_dv_is_told_with_the_dropout_of_its_case():
    """dv wrong in a case with dropout points at the keep-mask and 1/(1-p) in the backward;
    in a case without dropout at dv = A^T @ dout alone."""
    def wrong(g):
        return _plus_a_column(g.dv)

    assert _grad_hint("dv", wrong) == \
        "dv wrong: dv = A^T @ dout, A the attention weights after dropout"
    hint = _grad_hint("dv", wrong, case="dropout_mask-65x129", supports="dropout_mask")
    assert hint.startswith("dv wrong with dropout: dv = A^T @ dout with A the weights after "
                           "dropout (the keep-mask and 1/(1-p) belong in the backward too)"), hint


def test_an_option_every_failing_case_holds_is_told_with_the_cases_holding_it_that_pass():
    """'every failing case holds X' counts the cases with X that pass, in words, and says
    nothing of them when there are none."""
    kw = dict(backward=npattn_backward, returns_lse=True, dtype="float64", supports="causal",
              combos=False)
    causal_65 = next(c for c in VF.plan("causal", combos=False) if c.name == "causal-65x129")
    again = replace(causal_65, name="causal-65x129-again")

    def off_when_causal_65(q, k, v, **options):
        wrong = options.get("is_causal") and q.shape[2] == 65
        return (_off_everywhere if wrong else npattn_kernel)(q, k, v, **options)

    report = VF.verify(off_when_causal_65, cases=["base-1x65", "causal-65x129", "causal-128x65",
                                                  again], **kw)
    assert [r.case.name for r in report.failures] == ["causal-65x129", "causal-65x129-again"]
    assert report.hints()[0] == ("every failing case holds 'causal' (and 1 case with it passes): "
                                 "look at how causal is applied"), report.hints()
    report = VF.verify(off_when_causal_65, cases=["base-1x65", "causal-65x129", again], **kw)
    assert report.hints()[0] == "every failing case holds 'causal': look at how causal is applied", \
        report.hints()


def test_three_options_every_failing_case_holds_are_named_each():
    """Two cases holding the same three options fail: each option gets its line (a hint for
    'many options together' starts at four, where a line per option says nothing)."""
    supports = "causal,scale,softcap"

    def off_with_all_three(q, k, v, **options):
        wrong = {"is_causal", "softcap", "scale"} <= set(options)
        return (_off_out if wrong else npattn_kernel)(q, k, v, **options)

    panel = VF.plan(supports)
    all3 = next(c for c in panel if len(c.options) == 3)
    cases = [c for c in panel if c.name in ("base-1x65", "causal-65x129")]
    report = VF.verify(off_with_all_three, backward=npattn_backward, returns_lse=True,
                       dtype="float64", supports=supports,
                       cases=cases + [all3, replace(all3, name="all3-again")])
    assert [r.case.name for r in report.failures] == [all3.name, "all3-again"]
    hints = report.hints()
    assert not any("options together fail" in h for h in hints), hints
    for opt in ("causal", "scale", "softcap"):
        assert any(h.startswith(f"every failing case holds {opt!r}") for h in hints), hints


def _empty_rows_of(cache):
    """Bool [B, H, Lq]: the rows with nothing to attend."""
    return np.asarray(cache.probs).sum(axis=-1) == 0


def test_a_dq_wrong_only_on_the_empty_rows_is_told_so():
    """dq NaN, or not zero, on the rows with nothing to attend and right elsewhere is named
    as such (out's notes, for dq), also where the softmax is saturated."""
    kw = dict(supports="mask_bool,empty_rows")
    case = "mask_bool-65x129"

    def backward_with(fill):
        def backward(dout, cache):
            g = F.sdpa_backward(dout, cache)
            empty = _empty_rows_of(cache)[..., None]  # [B, H, Lq, 1]
            return np.where(empty, fill, g.dq), g.dk, g.dv
        return backward

    saturated = VC.Case(name="saturated-empty", Lq=9, Lk=17, options=("mask_bool",),
                        empty_rows=True, score_std=40.0)
    for fill, name, note, start in (
            (np.nan, case, "NaN on empty rows", "dq has NaN on rows with nothing to attend"),
            (1.0, case, "not zero on empty rows", "dq is not zero on rows with nothing to attend"),
            (1.0, saturated, "not zero on empty rows", "dq is not zero on rows")):
        r = VF.verify(npattn_kernel, backward=backward_with(fill), returns_lse=True,
                      dtype="float64", cases=[name], **kw).results[0]
        assert r.failing == ["dq"] and r.tensors["dq"].note == note, (r.failing, r.tensors["dq"])
        assert r.hint.startswith(start), r.hint


def test_a_failing_case_that_wrote_into_its_inputs_is_hinted_at_its_failure():
    """The hint of a case that wrote into its inputs and fails is its failing step; a case
    whose numbers are right is told to leave its inputs alone."""
    def writes_q(fn):
        def kernel(q, k, v, **options):
            res = fn(q.copy(), k, v, **options)  # the outputs do not see the write
            q[...] = 0.0
            return res
        return kernel

    kw = dict(backward=npattn_backward, returns_lse=True, dtype="float64", cases=["base-65x128"])
    report = VF.verify(writes_q(_off_out), **kw)
    r = report.results[0]
    assert r.written == ["q"] and r.failing == ["out"]
    assert r.hint.startswith("lse right, out wrong"), r.hint
    line = next(s for s in report.format().splitlines() if s.startswith("  base-65x128 "))
    assert line.endswith(f"out {r.tensors['out'].ratio:.3g}x, wrote into q"), line
    report = VF.verify(writes_q(npattn_kernel), **kw)
    r = report.results[0]
    assert r.written == ["q"] and r.failing == [] and r.hint.startswith("fn wrote into q:")
    line = next(s for s in report.format().splitlines() if s.startswith("  base-65x128 "))
    assert line.endswith(": wrote into q, its numbers pass"), line


def test_round_to_bfloat16_keeps_nan_and_inf():
    x = np.array([np.inf, -np.inf, np.nan, 1.0, 3.0e38], dtype=np.float32)
    payload = np.array([0x7F800001, 0xFF800001], dtype=np.uint32).view(np.float32)  # NaNs
    y = VF.round_to_bfloat16(np.concatenate([x, payload]))
    assert y[0] == np.inf and y[1] == -np.inf and y[3] == 1.0
    assert y[4] == np.float32(np.uint32(0x7F620000).view(np.float32))  # 3.0e38 rounded
    assert np.isnan(y[2]) and np.isnan(y[5]) and np.isnan(y[6])


@pytest.mark.parametrize("dtype, slopes", [("float16", "float32"), ("float32", "float32"),
                                           ("float64", "float64")])
def test_the_option_arrays_reach_the_kernel_in_their_documented_dtypes(dtype, slopes):
    """A float mask and sinks in the kernel's dtype, ALiBi slopes in float32 (float64 for
    float64), the dropout keep-mask bool and the segment ids int32 (SUPPORTS)."""
    seen = {}

    def records(q, k, v, **options):
        for name, x in options.items():
            if hasattr(x, "dtype"):
                seen.setdefault(name, set()).add(str(x.dtype))
        return np.zeros(q.shape[:3] + v.shape[3:], dtype=q.dtype)

    VF.verify(records, dtype=dtype, supports="alibi,sinks,mask_float,dropout_mask,segments",
              combos=[("alibi", "sinks", "mask_float", "dropout_mask", "segments")],
              cases=["all5-65x128"])
    assert seen == {"alibi_slopes": {slopes}, "sinks": {dtype}, "mask": {dtype},
                    "dropout_mask": {"bool"}, "q_segments": {"int32"},
                    "k_segments": {"int32"}}, seen


@pytest.mark.parametrize("dtype", ["float16", "float64"])
def test_alibi_slopes_that_float32_rounds_reach_the_kernel_and_the_truth_in_their_dtype(dtype):
    """With three heads the slopes 2**(-8 h / 3) are not exact in float32: the kernel gets
    them rounded to float32 (float16 does not round them further), float64 as drawn at
    float64, and npattn's truth takes the same values, so npattn itself passes."""
    alibi = next(c for c in VF.plan("alibi", combos=False) if "alibi" in c.options)
    case = replace(alibi, name="alibi-three-heads", Hq=3, Hkv=3)
    seen = []

    def kernel(q, k, v, **options):
        seen.append(np.array(options["alibi_slopes"]))
        return npattn_kernel(q, k, v, **options)

    report = VF.verify(kernel, backward=npattn_backward, returns_lse=True, dtype=dtype,
                       supports="alibi", cases=[case])
    assert report.ok, report.format()
    drawn = VC.case_inputs(case).options["alibi_slopes"]
    want = drawn if dtype == "float64" else drawn.astype(np.float32)
    assert not np.array_equal(drawn.astype(np.float32), drawn)  # float32 rounds them
    if dtype == "float16":
        assert not np.array_equal(drawn.astype(np.float16).astype(np.float32), want)
    np.testing.assert_array_equal(seen[0], want)


# --------------------------------------------------------------------------
# what verify reads, and the floors of half precision


def test_an_lse_kept_in_float16_fails():
    """lse is float32 for float16 inputs (npattn's), and so is its floor: an lse rounded to
    float16 is off by up to half its spacing there (2**-9 at
    |lse| ~ 4 for float16), far over a float32 floor of 2**-20 |lse| (and npattn's float32
    error), and fails; out, right, passes."""
    def half_lse(q, k, v, **options):
        out, lse, _ = npattn_kernel(q, k, v, **options)
        return out, np.asarray(lse).astype(q.dtype)

    report = VF.verify(half_lse, dtype="float16", returns_lse=True, cases=["base-65x128"])
    r = report.results[0]
    assert r.tensors["out"].status == "pass" and r.tensors["lse"].status == "fail", r.tensors
    assert r.tensors["lse"].floor <= 2.0**-20 * 10 and r.tensors["lse"].error > 1e-4


def test_a_mapping_adapter_passes_the_keywords_it_does_not_name_as_they_are():
    def renamed(q, k, v, causal=False, **kw):
        return npattn_kernel(q, k, v, is_causal=causal, **kw)[0]

    report = VF.verify(renamed, dtype="float64", supports="causal,scale",
                       adapter={"is_causal": "causal"},
                       cases=["scale-65x129", "causal-65x129"])
    assert report.ok, report.format()


def test_what_fn_backward_and_a_callable_adapter_return_is_read_as_documented():
    """A backward may return a list, or an object with attributes dq, dk and dv alone; fn
    returning more than (out, lse) without a backward, and an adapter returning no mapping,
    fail the case with what was expected."""
    import types

    def namespace_backward(dout, cache):
        g = F.sdpa_backward(dout, cache)
        return types.SimpleNamespace(dq=g.dq, dk=g.dk, dv=g.dv)

    kw = dict(dtype="float64", cases=["base-65x128"])
    assert VF.verify(npattn_kernel, backward=namespace_backward, returns_lse=True, **kw).ok
    as_list = lambda dout, cache: list(F.sdpa_backward(dout, cache))[:3]  # [dq, dk, dv]
    assert VF.verify(npattn_kernel, backward=as_list, returns_lse=True, **kw).ok
    r = VF.verify(npattn_kernel, returns_lse=True, **kw).results[0]
    assert r.error == ("TypeError: fn: expected it to return (out, lse) with returns_lse=True, "
                       "got a tuple of 3"), r.error
    r = VF.verify(npattn_kernel, returns_lse=True, backward=npattn_backward,
                  adapter=lambda options: [("scale", 0.5)], **kw).results[0]
    assert r.error == "TypeError: adapter: expected it to return a mapping of keywords, got list"


def test_every_tensor_checked_fails_as_raised_when_fn_raises():
    def raises(q, k, v, **options):
        raise TypeError("fn: expected a kernel of its own")  # worded like verify's own checks

    r = VF.verify(raises, backward=npattn_backward, returns_lse=True, dtype="float64",
                  supports="sinks", cases=["sinks-65x129"]).results[0]
    assert list(r.tensors) == ["out", "lse", "dq", "dk", "dv", "dsinks"]
    assert all(t.status == "fail" and t.note == "raised" for t in r.tensors.values())
    assert r.failing == list(r.tensors)
    # the kernel's own TypeError keeps its traceback, however it is worded
    assert "in raises" in r.traceback and r.raised_at.endswith(" in raises")


def test_the_magnitude_of_lse_is_taken_over_the_rows_it_is_compared_on():
    """lse is -inf on the rows with nothing to attend and not compared there: its magnitude
    (the degenerate rule's, and the JSON's) is the largest |lse| of the other rows."""
    case = next(c for c in VF.plan("mask_bool,empty_rows") if c.name == "mask_bool-65x129")
    inp = VC.case_inputs(case, 0)
    _, cache = F.sdpa_forward(inp.q, inp.k, inp.v, **inp.options)
    lse = np.asarray(cache.lse)
    assert np.isinf(lse).any()
    report = VF.verify(npattn_kernel, backward=npattn_backward, returns_lse=True,
                       dtype="float64", supports="mask_bool,empty_rows", cases=[case])
    t = report.results[0].tensors["lse"]
    assert t.status == "pass"
    assert t.magnitude == pytest.approx(np.max(np.abs(lse[np.isfinite(lse)])))
    data = json.loads(report.to_json())
    assert isinstance(data["cases"][0]["tensors"]["lse"]["magnitude"], float)


def test_a_tensor_under_ten_budgets_is_degenerate_and_one_over_them_passes():
    """With a float64 floor of 0.05 (floors=) the budgets are a few percent of the tensors:
    npattn passes every tensor, and each is degenerate exactly when its largest entry is
    under DEGENERATE_RATIO = 10 budgets, also where it is over one budget."""
    report = VF.verify(npattn_kernel, backward=npattn_backward, returns_lse=True,
                       dtype="float64", floors={"float64": 0.05}, cases=["base-65x128"])
    tensors = report.results[0].tensors
    assert VF.DEGENERATE_RATIO == 10.0
    kinds = set()
    for n, t in tensors.items():
        assert t.error <= t.budget
        under = t.magnitude < 10.0 * t.budget
        assert t.status == ("degenerate" if under else "pass"), (n, t)
        if under:
            assert t.note == (f"max|{n}| {t.magnitude:.2g} < 10 budgets: a zero {n} would "
                              "nearly pass")
        kinds.add((under, t.magnitude > t.budget))
    assert kinds == {(True, True), (False, True)}, kinds
    assert report.ok and report.results[0].status == "degenerate"


def test_a_failing_dk_or_dv_says_its_key_rows():
    """dk and dv are per key: where they are wrong is told in key rows (of Lk)."""
    c = VF.plan("", cases=["base-65x128"])[0]

    def backward(dout, cache):
        g = F.sdpa_backward(dout, cache)
        dk, dv = g.dk.copy(), g.dv.copy()
        dk[0, 1, 100, 3] += 1.0
        dv[1, 0, [7, 8], :] += 1.0
        return g.dq, dk, dv

    report = VF.verify(npattn_kernel, backward=backward, returns_lse=True, dtype="float64",
                       cases=[c.name])
    t = report.results[0].tensors
    assert t["dk"].where == (f"1 of {c.B * c.Hkv * c.Lk * c.Dh} entries over budget, the worst "
                             f"at b=0, h=1, key=100, d=3; key rows 100 (1 of {c.Lk})")
    assert t["dv"].where.endswith(f"; key rows 7-8 (2 of {c.Lk})"), t["dv"].where


def test_a_wrong_lse_fails_in_a_case_with_empty_rows():
    """The -inf of lse on the rows with nothing to attend stays out of its floor (an infinite
    floor passed any lse there): lse 1e-3 off fails, with a finite budget."""
    def lse_off(q, k, v, **options):
        out, lse, cache = npattn_kernel(q, k, v, **options)
        return out, lse + 1e-3, cache

    report = VF.verify(lse_off, backward=npattn_backward, returns_lse=True, dtype="float32",
                       supports="mask_bool,empty_rows", cases=["mask_bool-65x129"])
    t = report.results[0].tensors["lse"]
    assert t.status == "fail" and math.isfinite(t.budget) and t.budget < 1e-4, t


def test_the_lse_merge_and_score_terms_follow_their_formulas_head_by_head():
    """lse_scales, merge_scales and score_scales, head by head in loops from the module docstring's
    formulas, under GQA, dropout, a float mask, sinks, dlse and a scale not 1/sqrt(Dh)
    (the bound tests check they hold; these, that they are not larger or smaller)."""
    case = VC.Case("terms", Hq=4, Hkv=2, Lq=7, Lk=11, Dh=8, Dv=6, dropout_p=0.3, scale=0.9,
                   score_std=1.0, score_shift=3.0,
                   options=("dropout_mask", "gqa", "mask_float", "scale", "sinks"))
    inp = VC.case_inputs(case, seed=5)
    o = inp.options
    assert o["scale"] == 0.9 and o["mask"].shape == (case.B, 1, case.Lq, case.Lk)
    out, cache = F.sdpa_forward(inp.q, inp.k, inp.v, **o)
    lse, p, attn = np.asarray(cache.lse), cache.probs, cache.attn  # p before, attn after dropout
    g = F.sdpa_backward(inp.dout, cache, dlse=inp.dlse)
    truth = {"out": out, "lse": lse, "weights": p, "dq": g.dq}
    got_lse = VF.lse_scales(inp, truth, inp.dlse)
    got_merge = VF.merge_scales(inp, truth)
    got_score = VF.score_scales(inp, truth, inp.dlse)
    G, scale = case.Hq // case.Hkv, 0.9
    s_dk, s_dv = np.zeros(inp.k.shape), np.zeros(inp.v.shape)  # [B, Hkv, Lk, *]
    s_dmask = np.zeros(o["mask"].shape)  # [B, 1, Lq, Lk]
    s_dq = 0.0
    lse_dk, lse_dv = np.zeros(inp.k.shape), np.zeros(inp.v.shape)  # [B, Hkv, Lk, *]
    lse_dmask = np.zeros(o["mask"].shape)  # [B, 1, Lq, Lk]
    lse_dsinks, m_dsinks = np.zeros(case.Hq), np.zeros(case.Hq)
    m_dk = np.zeros(inp.k.shape)
    m_dmask = np.zeros(o["mask"].shape)
    m_out = m_dq = lse_dq = 0.0
    for b in range(case.B):
        for h in range(case.Hq):
            j = h // G  # the K/V head of query head h
            q, k, v, dout = inp.q[b, h], inp.k[b, j], inp.v[b, j], inp.dout[b, h]
            P, A, L, dl = p[b, h], attn[b, h], lse[b, h], inp.dlse[b, h]  # [Lq, Lk], [Lq]
            keep = o["dropout_mask"][b, h] / (1.0 - o["dropout_p"])  # [Lq, Lk]
            w = np.abs(L)  # [Lq]: no empty row here
            delta = np.sum(dout * out[b, h], axis=-1)  # [Lq]
            p_sink = np.exp(o["sinks"][h] - L)  # [Lq]
            # lse: ds = p (dp - delta + dlse); the row's |lse_i| times each row's part
            ds = P * ((dout @ v.T) * keep - delta[:, None] + dl[:, None])  # [Lq, Lk]
            lse_dq = max(lse_dq, np.max(w[:, None] * np.abs(g.dq[b, h])))
            lse_dv[b, j] += (np.abs(A) * w[:, None]).T @ np.abs(dout)
            lse_dk[b, j] += (np.abs(ds) * w[:, None]).T @ np.abs(q) * scale
            lse_dmask[b, 0] += np.abs(ds) * w[:, None]
            lse_dsinks[h] += np.sum(p_sink * np.abs(delta - dl) * w)
            # scores: t_ij = scale |q_i| . |k_j| for each entry, in place of the row's |lse_i|
            t = scale * (np.abs(q) @ np.abs(k).T)  # [Lq, Lk]
            s_dq = max(s_dq, np.max((np.abs(ds) * t) @ np.abs(k)) * scale)
            s_dv[b, j] += (np.abs(A) * t).T @ np.abs(dout)
            s_dk[b, j] += (np.abs(ds) * t).T @ np.abs(q) * scale
            s_dmask[b, 0] += np.abs(ds) * t
            # merge: m_ij = max(|lse_i|, |s_ij|), s_ij = lse_i + log p_ij where p_ij > 0
            with np.errstate(divide="ignore"):
                s = L[:, None] + np.log(P)  # [Lq, Lk]
            m = np.where(P > 0.0, np.maximum(w[:, None], np.abs(s)), 0.0)  # [Lq, Lk]
            ms = np.maximum(w, abs(o["sinks"][h])) * p_sink  # [Lq]
            E = (np.einsum("ij,ijd->id", m, np.abs(A[:, :, None] * v[None] -
                                                   P[:, :, None] * out[b, h][:, None]))
                 + (w + ms)[:, None] * np.abs(out[b, h]))  # [Lq, Dv]
            D = np.sum(m * np.abs(A * (dout @ v.T) - P * delta[:, None]), axis=-1) \
                + (w + ms) * np.abs(delta)  # [Lq]
            m_out = max(m_out, E.max())
            m_dq = max(m_dq, np.max(D[:, None] * (P @ np.abs(k))) * scale)
            m_dk[b, j] += (P * D[:, None]).T @ np.abs(q) * scale
            m_dmask[b, 0] += P * D[:, None]
            m_dsinks[h] += np.sum(p_sink * D)
    want_lse = {"dq": lse_dq, "dv": lse_dv.max(), "dk": lse_dk.max(), "dmask": lse_dmask.max(),
                "dsinks": lse_dsinks.max()}
    want_merge = {"out": m_out, "dq": m_dq, "dk": m_dk.max(), "dv": 0.0, "dmask": m_dmask.max(),
                  "dsinks": m_dsinks.max()}
    want_score = {"dq": s_dq, "dv": s_dv.max(), "dk": s_dk.max(), "dmask": s_dmask.max(), "dsinks": 0.0}
    assert set(got_lse) == set(want_lse) and set(got_merge) == set(want_merge)
    assert set(got_score) == set(want_score)
    for n in want_score:
        assert got_score[n] == pytest.approx(want_score[n], rel=1e-12), n
    for n in want_lse:
        assert got_lse[n] == pytest.approx(want_lse[n], rel=1e-12), n
    for n in want_merge:
        assert got_merge[n] == pytest.approx(want_merge[n], rel=1e-12), n


def test_the_score_term_under_softcap_carries_tanh_s_factor_for_dq_and_dk():
    """Under softcap c a score rounded otherwise by e moves s = c tanh(r / c) by T' e and the
    factor T' = 1 - tanh^2 that dq and dk take by -2 T' tanh / c * e: score_scales gives dq and
    dk 1 + 2 / c times the bound without softcap (which bounds |T' (T' - 2 tanh / c)|), dv
    and dmask the same bound (T' <= 1)."""
    x = np.linspace(-20.0, 20.0, 400001)  # r / c
    for c in (0.5, 2.0, 5.0):
        th = np.tanh(x)
        assert np.max(np.abs((1.0 - th**2) * (1.0 - th**2 - 2.0 * th / c))) <= 1.0 + 2.0 / c
    case = VC.Case("terms", Hq=2, Hkv=2, Lq=5, Lk=7, Dh=4, Dv=3, softcap=2.0, score_std=1.0,
                   options=("softcap", "mask_float"))
    inp = VC.case_inputs(case, seed=1)
    o = inp.options
    assert o["softcap"] == 2.0
    out, cache = F.sdpa_forward(inp.q, inp.k, inp.v, **o)
    g = F.sdpa_backward(inp.dout, cache)
    truth = {"out": out, "lse": np.asarray(cache.lse), "weights": cache.probs, "dq": g.dq}
    capped = VF.score_scales(inp, truth)
    plain = VF.score_scales(replace(inp, options={n: o[n] for n in o if n != "softcap"}), truth)
    assert set(capped) == {"dq", "dk", "dv", "dmask"}
    for n in ("dq", "dk"):
        assert capped[n] == pytest.approx(2.0 * plain[n], rel=1e-14), n
    for n in ("dv", "dmask"):
        assert capped[n] == plain[n], n


def test_a_mistake_is_named_only_within_one_budget_of_it():
    """An out of the scores left unscaled (scale=1) is named so; the same out moved by 3
    budgets in one entry is not that mistake any more (within 10 budgets is not within 1)."""
    def unscaled(shift):
        def kernel(q, k, v, **options):
            out = F.sdpa_forward(q, k, v, scale=1.0, **options)[0].copy()
            out[0, 0, 0, 0] += shift
            return out
        return kernel

    kw = dict(dtype="float64", cases=["base-65x128"])
    exact = VF.verify(unscaled(0.0), **kw).results[0]
    assert exact.hint.startswith("out wrong: the scores not scaled"), exact.hint
    budget = exact.tensors["out"].budget
    near = VF.verify(unscaled(3.0 * budget), **kw).results[0]
    assert near.tensors["out"].budget == budget
    assert near.hint == "out wrong: the forward (the scores or the softmax, or P @ V)", near.hint


def test_a_window_edge_off_by_one_to_zero_is_named():
    """A left edge of 1 taken as 0 is the window's off-by-one too (the edge may reach 0)."""
    case = VC.Case("window-1", Lq=9, Lk=17, window=(1, 3), options=("window",))

    def kernel(q, k, v, window, **options):
        return F.sdpa_forward(q, k, v, window=(window[0] - 1, window[1]), **options)[0]

    r = VF.verify(kernel, dtype="float64", supports="window", cases=[case]).results[0]
    assert r.hint.startswith("out wrong: the window's left edge off by one (left -1)"), r.hint


def test_a_mistake_is_named_whatever_lse_holds_on_the_rows_npattn_leaves_empty():
    """lse is compared with the mistake's on the rows where both attend something: a kernel
    that inverts the boolean mask and writes +inf (flash-attn's) on the rows npattn leaves
    empty, which its inverted mask fills, is still named."""
    def inverted(q, k, v, mask, **options):
        out, cache = F.sdpa_forward(q, k, v, mask=~mask, **options)
        npattn_empty = ~np.broadcast_to(mask, cache.probs.shape).any(axis=-1)  # [B, H, Lq]
        return out, np.where(npattn_empty, np.inf, cache.lse)

    r = VF.verify(inverted, dtype="float64", returns_lse=True, supports="mask_bool,empty_rows",
                  cases=["mask_bool-65x129"]).results[0]
    assert "the boolean mask's sense inverted" in r.hint, r.hint


def test_a_mistake_is_named_only_more_than_ten_budgets_from_the_truth():
    """out_misses names the mistake that an out is exactly only where that mistake lies more
    than MISS_SEPARATION (10) budgets from the truth: the unscaled scores' out, 5 budgets
    away with a larger budget, is not named; 20 budgets away it is."""
    case = VF.plan("", cases=["base-65x128"])[0]
    inp = VC.case_inputs(case, 0)
    out, cache = F.sdpa_forward(inp.q, inp.k, inp.v)
    truth = {"out": out, "lse": np.asarray(cache.lse), "weights": cache.probs}
    alt = F.sdpa_forward(inp.q, inp.k, inp.v, scale=1.0)[0]
    apart = float(np.max(np.abs(alt - out)))
    assert VF.MISS_SEPARATION == 10.0 and apart > 0.1
    named = []
    for budgets in (5.0, 20.0):
        budget = apart / budgets
        t = VF.TensorResult("out", apart, budget, 0.0, budget, 1.0, "fail")
        named.append(VF.out_misses(inp, {"out": alt}, truth, {"out": t}))
    assert named[0] == [] and len(named[1]) == 1, named
    assert named[1][0].startswith("the scores not scaled"), named


def test_the_seed_draws_the_inputs_and_progress_counts_the_cases():
    seen, calls = [], []

    def records(q, k, v, **options):
        seen.append(q.copy())
        return F.sdpa_forward(q, k, v, **options)[0]

    names = ["base-1x65", "base-64x129", "base-65x128"]
    for seed in (0, 1):
        VF.verify(records, dtype="float64", cases=names[:1], seed=seed)
    assert not np.array_equal(seen[0], seen[1])
    VF.verify(records, dtype="float64", cases=names,
              progress=lambda done, total, name: calls.append((done, total, name)))
    assert calls == [(1, 3, names[0]), (2, 3, names[1]), (3, 3, names[2])]


def test_the_python_reproducer_keeps_floors_and_combos():
    """A case of a panel drawn with combos=False and checked with floors= reruns with both:
    the rerun gives the same budget (the default floor gives another)."""
    def off(q, k, v, **options):
        return F.sdpa_forward(q, k, v, **options)[0] * (1.0 + 1e-9)

    report = VF.verify(off, dtype="float64", supports="causal", combos=False, target="off",
                       floors={"float64": 2.0**-30}, cases=["causal-65x129"])
    r = report.failures[0]
    call = r.reproducer
    assert "combos=False" in call and "floors={" in call, call
    again = eval(call[len("print("):-1], {"npattn": npattn, "off": off})
    assert again.results[0].tensors["out"].budget == r.tensors["out"].budget
    default = VF.verify(off, dtype="float64", supports="causal", cases=["causal-65x129"])
    assert default.results[0].tensors["out"].budget < r.tensors["out"].budget


def test_the_bounds_of_budget_factor_and_floors_are_taken_and_a_floor_of_no_dtype_refused():
    """budget_factor 1 (as accurate as npattn) and a floor of 0 are the bounds, taken; a
    floors key that is not a dtype is a ValueError naming floors (it would change nothing)."""
    kernel = lambda q, k, v, **options: F.sdpa_forward(q, k, v, **options)[0]
    kw = dict(dtype="float32", cases=["base-1x65"])
    report = VF.verify(kernel, budget_factor=1, floors={"float32": 0}, **kw)
    assert report.config["budget_factor"] == 1.0 and report.config["floors"]["float32"] == 0.0
    t = report.results[0].tensors["out"]
    default = VF.verify(kernel, **kw).results[0].tensors["out"]
    assert t.budget == t.npattn_error + t.floor and t.npattn_error > 0.0
    assert t.floor < default.floor  # what remains is the rounding of lse, not floors='s
    with pytest.raises(ValueError, match=r"floors: expected a mapping with keys from .*'fp32'"):
        VF.verify(kernel, floors={"fp32": 1e-6}, **kw)


def test_an_error_equal_to_its_budget_passes():
    """A tensor passes when its error is at most its budget: npattn itself at float64 with a
    floor of 0 gives lse an error and a budget of exactly 0 (npattn's own error is 0), and
    it passes."""
    report = VF.verify(npattn_kernel, backward=npattn_backward, dtype="float64", returns_lse=True,
                       floors={"float64": 0.0}, cases=["base-65x128"])
    t = report.results[0].tensors["lse"]
    assert (t.error, t.npattn_error, t.budget) == (0.0, 0.0, 0.0)
    assert t.status == "pass" and t.ratio == 0.0 and report.ok, report.format()


# --------------------------------------------------------------------------
# the panel and its inputs


def test_a_case_name_alone_is_one_case():
    assert [c.name for c in VF.plan("", cases="base-1x65")] == ["base-1x65"]
    report = VF.verify(lambda q, k, v, **o: F.sdpa_forward(q, k, v, **o)[0], dtype="float64",
                       cases="base-1x65")
    assert [r.case.name for r in report.results] == ["base-1x65"]


def test_all_declares_every_option_and_the_permission_of_empty_rows():
    assert VC.check_supports("all") == tuple(sorted(VC.SUPPORTS))
    assert "empty_rows" in VC.check_supports(" all ")
    assert any(c.empty_rows for c in VC.panel("all"))


def test_supports_refuses_an_empty_entry_and_takes_no_text_as_no_option():
    assert VC.check_supports("") == () and VC.check_supports("  ") == ()
    assert VC.check_supports(" causal , gqa ") == ("causal", "gqa")
    for text, where in (("causal,,gqa", "2 of 3"), ("causal,", "2 of 2"), (",causal", "1 of 2"),
                        (" , ", "1 of 2")):
        with pytest.raises(ValueError) as info:
            VC.check_supports(text)
        assert str(info.value) == (f"supports: expected comma-separated option names, got {text!r}, "
                                   f"whose entry {where} is empty")
    with pytest.raises(ValueError, match="is empty"):
        VF.plan("causal,,gqa")


def test_a_causal_alignment_unlike_align_conflicts_with_window_and_alibi():
    for aligned in ("window", "alibi"):
        assert VC.conflicts(("causal", aligned), "bottom_right")
        assert not VC.conflicts(("causal", aligned), "top_left")
        assert VC.conflicts(("causal_bottom_right", aligned), "top_left")
        assert not VC.conflicts(("causal_bottom_right", aligned), "bottom_right")
    assert not VC.conflicts(("causal", "softcap"), "bottom_right")
    for c in VC.panel("causal,window,alibi,softcap", "bottom_right"):
        assert not {"causal", "window"} <= set(c.options), c.name
        assert not {"causal", "alibi"} <= set(c.options), c.name


def test_segment_cases_leave_rows_empty_when_declared():
    """With 'empty_rows' a segment case gives some queries an id that no key has."""
    cases = [c for c in VC.panel("segments,empty_rows") if "segments" in c.options]
    assert cases and all(c.empty_rows for c in cases)
    for c in cases:
        o = VC.case_inputs(c).options
        qs, ks = o["q_segments"], o["k_segments"]  # [B, Lq], [B, Lk]
        alone = [(b, i) for b in range(c.B) for i in range(c.Lq) if qs[b, i] not in ks[b]]
        assert alone, c.name
    assert not any(c.empty_rows for c in VC.panel("segments"))


def test_only_cases_with_a_mask_or_segments_have_empty_rows():
    """With 'empty_rows' declared, the cases that blank rows are those of a mask or segments
    (the options that can blank one); the others do not say they have empty rows."""
    cases = VC.panel(ALL)
    blanking = {"mask_bool", "mask_float", "segments"}
    assert any(c.empty_rows for c in cases)
    for c in cases:
        assert c.empty_rows == bool(blanking & set(c.options)), c.name
        assert ("empty rows" in c.describe()) == c.empty_rows


def test_an_options_second_case_has_masks_and_slopes_per_head():
    """The second case of an option holds a (B, Hq, Lq, Lk) mask and (B, Hq) ALiBi slopes;
    the first a (B, 1, Lq, Lk) mask broadcast over the heads and (Hq,) slopes."""
    for option, name in (("mask_bool", "mask"), ("mask_float", "mask"),
                         ("alibi", "alibi_slopes")):
        first, second = [c for c in VC.panel(option) if c.options == (option,)]
        a, b = VC.case_inputs(first).options[name], VC.case_inputs(second).options[name]
        if name == "mask":
            assert a.shape == (first.B, 1, first.Lq, first.Lk)
            assert b.shape == (second.B, second.Hq, second.Lq, second.Lk)
        else:
            assert a.shape == (first.Hq,) and b.shape == (second.B, second.Hq)
            assert not np.array_equal(b[0], b[1])  # a slope per batch entry too
            heads = np.arange(1, first.Hq + 1)
            assert np.allclose(a, [2.0 ** (-8.0 * h / first.Hq) for h in heads], rtol=1e-15, atol=0)


def test_an_options_two_cases_alone_take_two_values_of_it():
    """Each option alone runs twice, with two values of it (docs/verify.md): two softcaps, and
    two scales, one below the default 1/sqrt(Dh) and one above it, so that a kernel that
    ignores scale= fails both."""
    caps = [VC.case_inputs(c).options["softcap"] for c in VC.panel("softcap")
            if c.options == ("softcap",)]
    assert len(caps) == 2 and len(set(caps)) == 2 and min(caps) > 0.0, caps
    factors = sorted(VC.case_inputs(c).options["scale"] * math.sqrt(c.Dh) for c in VC.panel("scale")
                     if c.options == ("scale",))
    assert len(factors) == 2 and factors[0] < 1.0 < factors[1], factors


def test_the_all_options_cases_take_each_side_of_an_exclusive_pair():
    for align in ("top_left", "bottom_right"):
        sets = [set(c.options) for c in VC.panel("all", align) if len(c.options) > 3]
        assert len(sets) == 2
        masks = [("mask_bool" in s, "mask_float" in s) for s in sets]
        assert masks == [(True, False), (False, True)]
        causal = "causal" if align == "top_left" else "causal_bottom_right"  # align allows it
        assert any(causal in s for s in sets), sets


def test_combos_that_cannot_be_one_call_are_refused():
    with pytest.raises(ValueError, match=r"combos: \('mask_bool', 'mask_float'\) cannot be one"):
        VC.panel("mask_bool,mask_float", combos=[("mask_bool", "mask_float")])
    with pytest.raises(ValueError, match=r"combos: \('causal', 'window'\) cannot be one call"):
        VC.panel("causal,window", "bottom_right", combos=[("causal", "window")])


def test_the_panel_s_dropout_cases_take_two_probabilities():
    """A kernel that takes the drop probability as 0.2 whatever dropout_p says fails the
    panel: its two dropout cases draw p = 0.2 and 0.5."""
    cases = [c for c in VC.panel("dropout_mask") if c.options == ("dropout_mask",)]
    assert [c.dropout_p for c in cases] == [0.2, 0.5]

    def fixed_p(q, k, v, dropout_p=None, **options):
        if dropout_p is not None:
            options["dropout_p"] = 0.2
        return F.sdpa_forward(q, k, v, **options)[0]

    report = VF.verify(fixed_p, dtype="float64", supports="dropout_mask", combos=False)
    assert [r.case.name for r in report.failures] == [cases[1].name]


def test_head_dims_of_zero_are_refused():
    with pytest.raises(ValueError, match=r"head_dims: expected ints from 1 to 16384, got 0 in "):
        VF.plan("", head_dims=(0, 64))
    with pytest.raises(TypeError, match=r"head_dims: expected ints from 1 to 16384, got True in "):
        VF.plan("", head_dims=(True, 64))  # a bool is not a width, though it is an int


def test_a_repeated_combination_gets_names_of_its_own():
    """Seven cases of one pair cycle back to the first shape: the seventh is named '.2'."""
    cases = [c for c in VC.panel("causal,softcap", combos=[("causal", "softcap")] * 7)
             if len(c.options) == 2]
    names = [c.name for c in cases]
    assert len(names) == 7 and len(set(names)) == 7
    assert names[6] == names[0] + ".2"


def test_a_case_of_three_options_is_named_by_them_and_of_more_by_their_count():
    threes = [c for c in VC.panel(("causal", "softcap", "window")) if len(c.options) == 3]
    assert threes and all(c.name.startswith("causal+softcap+window-") for c in threes), threes
    fours = [c for c in VC.panel(("causal", "sinks", "softcap", "window")) if len(c.options) == 4]
    assert fours and all(c.name.startswith("all4-") for c in fours), fours


def test_each_case_draws_its_own_inputs_from_its_name():
    """Two cases of the same shapes and another name get other arrays for one seed; a case's
    own seed overrides verify's."""
    a, b = VC.Case("a"), VC.Case("b")
    assert not np.array_equal(VC.case_inputs(a, 0).q, VC.case_inputs(b, 0).q)
    assert np.array_equal(VC.case_inputs(a, 0).q, VC.case_inputs(VC.Case("a"), 0).q)
    own = VC.Case("a", seed=7)
    assert np.array_equal(VC.case_inputs(own, 0).q, VC.case_inputs(own, 1).q)


def test_the_shifted_case_moves_each_row_by_an_offset_of_std_score_shift():
    """The rows' offsets (lse minus the lse of the same scores without the vector added to
    the keys) have a std near SCORE_SHIFT = 100, and about a third of the rows lie beyond
    exp's float32 range."""
    case = next(c for c in VC.panel("") if c.score_shift)
    assert case.score_shift == VC.SCORE_SHIFT == 100.0
    inp = VC.case_inputs(case, 0)
    plain = VC.case_inputs(replace(case, score_shift=0.0), 0)
    assert np.array_equal(inp.q, plain.q) and not np.array_equal(inp.k, plain.k)
    lse = np.asarray(F.sdpa_forward(inp.q, inp.k, inp.v)[1].lse)
    base = np.asarray(F.sdpa_forward(plain.q, plain.k, plain.v)[1].lse)
    offset = lse - base  # [B, Hq, Lq]
    assert 60.0 < offset.std() < 160.0, offset.std()
    assert 0.15 < np.mean(np.abs(lse) > 88.0) < 0.6


def test_causal_is_top_left_whatever_align_is():
    """'causal' is top-left (SUPPORTS): align='bottom_right' aligns the window and ALiBi,
    not it."""
    case = next(c for c in VC.panel("causal", "bottom_right") if c.options == ("causal",))
    assert VC.case_align(case, "bottom_right") == "top_left"
    # beside a window too (a case the panel does not draw, where one call has one align)
    assert VC.case_align(replace(case, options=("causal", "window")), "bottom_right") == "top_left"
    assert "align" not in VC.case_inputs(case, 0, "bottom_right").options
    seen = []
    VF.verify(lambda q, k, v, **o: seen.append(o) or F.sdpa_forward(q, k, v, **o)[0],
              dtype="float64", supports="causal", align="bottom_right", cases=[case.name])
    assert seen == [{"is_causal": True}]


def test_a_kernel_that_reads_a_float_mask_as_a_boolean_one_fails():
    """A float mask adds values to the scores (normal where finite): a kernel that only masks
    where it is -inf fails every float-mask case."""
    def as_bool(q, k, v, mask=None, **options):
        if mask is not None:
            mask = np.isfinite(mask)
        return F.sdpa_forward(q, k, v, mask=mask, **options)[0]

    report = VF.verify(as_bool, dtype="float64", supports="mask_float", combos=False)
    failed = [r.case.name for r in report.failures]
    assert failed and failed == [r.case.name for r in report.results
                                 if "mask_float" in r.case.options]


def test_empty_rows_are_blanked_in_the_first_row_and_the_middle():
    """The first query row (where a kernel's running maximum starts) and the middle one."""
    case = next(c for c in VC.panel("mask_bool,empty_rows") if c.options == ("mask_bool",))
    keep = VC.case_inputs(case, 0).options["mask"]  # [B, 1|Hq, Lq, Lk]
    empty = ~keep.any(axis=-1)  # [B, 1|Hq, Lq]
    rows = sorted({(b, i) for b, _, i in zip(*np.nonzero(empty))})
    assert rows == [(case.B - 1, 0), (case.B - 1, case.Lq // 2)], rows
    for Lq, want in ((3, [0, 1]), (2, [1])):  # (two rows: the middle alone, one attends)
        few = replace(case, name=f"few-{Lq}", Lq=Lq)
        empty = ~VC.case_inputs(few, 0).options["mask"].any(axis=-1)  # [B, 1|Hq, Lq]
        assert sorted({i for b, _, i in zip(*np.nonzero(empty))}) == want, (Lq, empty)


def test_the_python_reproducer_gives_a_budget_factor_other_than_the_default():
    def off(q, k, v, **options):
        return F.sdpa_forward(q, k, v, **options)[0] * (1.0 + 1e-9)

    kw = dict(dtype="float64", target="off", cases=["base-1x65"])
    assert "budget_factor=" not in VF.verify(off, **kw).failures[0].reproducer
    for factor in (1, 3):
        call = VF.verify(off, budget_factor=factor, **kw).failures[0].reproducer
        assert f"budget_factor={float(factor)}," in call, call


def test_a_tensor_of_exactly_ten_budgets_is_not_degenerate():
    """Degenerate is under DEGENERATE_RATIO budgets, strictly: npattn's own lse at float64 (its
    error 0) with a floor of 1/10 has a budget of a tenth of its largest entry (over 1), ten
    budgets exactly, and it passes."""
    def forward(q, k, v, **options):
        return npattn_kernel(q, k, v, **options)[:2]

    report = VF.verify(forward, returns_lse=True, dtype="float64", floors={"float64": 0.1},
                       cases=["base-65x128"])
    t = report.results[0].tensors["lse"]
    assert t.npattn_error == 0.0 and t.magnitude > 1.0
    assert t.magnitude == VF.DEGENERATE_RATIO * t.budget, (t.magnitude, t.budget)
    assert t.status == "pass" and t.note == "", t


def test_where_counts_only_the_entries_over_budget_not_those_at_it():
    """With a floor of 0 npattn's own lse at float64 has a budget of exactly 0 and every
    entry at it; one entry off is the one entry over budget."""
    row = 3

    def one_lse_off(q, k, v, **options):
        out, lse, _ = npattn_kernel(q, k, v, **options)
        lse = np.array(lse)
        lse[1, 0, row] += 0.25
        return out, lse

    c = VF.plan("", cases=["base-65x128"])[0]
    report = VF.verify(one_lse_off, returns_lse=True, dtype="float64", floors={"float64": 0.0},
                       cases=[c.name])
    t = report.results[0].tensors["lse"]
    assert t.status == "fail" and t.budget == 0.0
    assert t.where == (f"1 of {c.B * c.Hq * c.Lq} entries over budget, the worst at b=1, h=0, "
                       f"query={row}; query rows {row} (1 of {c.Lq})"), t.where


def test_a_softmax_saturated_in_half_the_rows_is_not_saturated():
    """Saturated means more than half the attended rows put over 0.999 on one key: in a case
    where exactly half of them do, dq and dk pass, not degenerate."""
    case = VC.Case("half-saturated", B=2, Hq=2, Hkv=2, Lq=2, Lk=3, Dh=8, Dv=8, score_std=10.0)
    inp = VC.case_inputs(case, seed=8)
    _, cache = F.sdpa_forward(inp.q, inp.k, inp.v, **inp.options)
    assert np.mean(cache.probs.max(axis=-1) > 0.999) == 0.5  # 4 rows of 8
    r = VF.verify(npattn_kernel, backward=npattn_backward, returns_lse=True, dtype="float64",
                  cases=[case], seed=8).results[0]
    for n in ("dq", "dk"):
        assert r.tensors[n].status == "pass" and r.tensors[n].note == "", (n, r.tensors[n])


def test_the_merge_term_of_a_sink_takes_its_logit_where_it_is_larger_than_lse():
    """A split that holds only the sink has the sink's logit as its partial lse: where
    |sink| > |lse_i| (a float mask pulls every score down, so lse is near -1, and the sinks
    are -3 and -4) out's merge term takes max(|lse_i|, |sink|) p_sink_i |out_i|."""
    case = VC.Case("sink-merge", Hq=2, Hkv=2, Lq=5, Lk=6, Dh=8, Dv=4, options=("sinks",))
    inp = VC.case_inputs(case, seed=1)
    sinks = np.array([-3.0, -4.0])  # [Hq]
    opts = {"mask": np.full((case.B, 1, case.Lq, case.Lk), -math.log(case.Lk) - 1.0),
            "sinks": sinks}
    out, cache = F.sdpa_forward(inp.q, inp.k, inp.v, **opts)
    lse, p = np.asarray(cache.lse), cache.probs  # [B, Hq, Lq], [B, Hq, Lq, Lk]
    assert np.all(np.abs(sinks)[None, :, None] > np.abs(lse))
    got = VF.merge_scales(VC.CaseInputs(inp.q, inp.k, inp.v, inp.dout, opts, None),
                          {"out": out, "lse": lse, "weights": p})["out"]
    s = lse[..., None] + np.log(p)  # [B, Hq, Lq, Lk]: every key attended
    m = np.maximum(np.abs(lse)[..., None], np.abs(s))  # [B, Hq, Lq, Lk]
    parts = np.abs(p[..., None] * (inp.v[:, :, None] - out[:, :, :, None]))  # [B, Hq, Lq, Lk, Dv]
    p_sink = np.exp(sinks[None, :, None] - lse)  # [B, Hq, Lq]
    E = (np.einsum("bhij,bhijd->bhid", m, parts)
         + (np.abs(lse) + np.abs(sinks)[None, :, None] * p_sink)[..., None] * np.abs(out))
    assert got == pytest.approx(float(E.max()), rel=1e-12)
