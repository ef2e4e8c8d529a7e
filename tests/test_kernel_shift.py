"""The NumPy kernel's softmax without the max shift (``numpy_kernel.EXP_BOUND``) and its
row factors (``cache.exps``, ``cache.row_scale``): the reference's numbers either way."""

import warnings

import numpy as np
import pytest

from _attention_cases import assert_close, make_inputs
from npattn import attention as A
from npattn import functional as F
from npattn import numpy_kernel

CASES = {
    "plain": dict(),
    "causal, Lq != Lk": dict(causal=True),
    "bool mask, empty row": dict(mask_kind="bool"),
    "float mask": dict(mask_kind="float"),
    "dropout from a seed": dict(dropout="seed"),
    "bool mask, dropout mask": dict(mask_kind="bool", dropout="mask"),
}


def _all(q, k, v, dout, kw, impl):
    out, cache = A.sdpa_forward(q, k, v, impl=impl, **kw)
    dlse = np.random.default_rng(5).standard_normal(cache.lse.shape).astype(cache.lse.dtype)
    grads = A.sdpa_backward(dout, cache, dlse=dlse)
    return {"out": out, "weights": A.weights(cache), "lse": cache.lse, "dq": grads[0],
            "dk": grads[1], "dv": grads[2], "dmask": grads[3]}


def _boost_rows(q, rows, factor):
    """q with some query rows scaled, so that those rows' scores exceed EXP_BOUND."""
    q = q.copy()
    q[..., rows, :] *= factor
    return q


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("bound", [None, 0.0, np.inf])
def test_kernel_equals_reference_with_and_without_the_shift(case, bound, monkeypatch):
    """float64, GQA, Lq != Lk, random dout and dlse; blocks of a few rows, some of whose scores
    reach 40 (shifted) next to bounded ones; EXP_BOUND 0 shifts every block, inf none."""
    monkeypatch.setattr(numpy_kernel, "TILE_ELEMS", 64)  # blocks of a few rows: both kinds
    monkeypatch.setattr(numpy_kernel, "POOL_MIN_SCORES", 0)
    if bound is not None:
        monkeypatch.setattr(numpy_kernel, "EXP_BOUND", bound)
    q, k, v, dout, kw = make_inputs(11, 2, 2, 2, 21, 17, 4, 3, **CASES[case])
    q = _boost_rows(q, slice(8, 12), 12.0)  # |s| up to ~40 in these rows
    s = np.einsum("bhgid,bhjd->bhgij", q.reshape(2, 2, 2, 21, 4), k) / 2.0  # scale 1 / sqrt(4)
    assert np.abs(s[..., 8:12, :]).max() > 16 and np.abs(s[..., :8, :]).max() < 16
    ref = _all(q, k, v, dout, kw, "reference")
    got = _all(q, k, v, dout, kw, "numpy")
    empty = ref["lse"] == -np.inf  # rows with nothing to attend: lse = -inf in both
    np.testing.assert_array_equal(got["lse"] == -np.inf, empty)
    got["lse"], ref["lse"] = got["lse"][~empty], ref["lse"][~empty]
    for name in ref:
        assert_close(got[name], ref[name], np.asarray, f"{case}, bound {bound}: {name}")


def test_bounded_rows_near_the_bound_keep_float32_precision(monkeypatch):
    """float32 scores up to just under EXP_BOUND take exp(s) unshifted: e up to e**16 and row
    sums up to L e**16, with the float32 rounding of the shifted softmax (float64 reference)."""
    monkeypatch.setattr(numpy_kernel, "POOL_MIN_SCORES", 0)
    rng = np.random.default_rng(3)
    B, H, L, D = 2, 2, 33, 8
    q = rng.standard_normal((B, H, L, D))
    k = rng.standard_normal((B, H, L, D))
    q /= np.linalg.norm(q, axis=-1, keepdims=True)
    k /= np.linalg.norm(k, axis=-1, keepdims=True)
    k[..., 0, :] = q[..., 0, :]  # row 0 has a score at its bound
    q *= 15.9 * np.sqrt(D)  # |q * scale| = 15.9, |k| = 1: every bound 15.9 < EXP_BOUND
    v = rng.standard_normal((B, H, L, D))
    dout = rng.standard_normal((B, H, L, D))
    args64 = [a.astype(np.float64) for a in (q, k, v)]
    ref = _all(*args64, dout, {}, "reference")
    got = _all(*(a.astype(np.float32) for a in (q, k, v)), dout.astype(np.float32), {}, "numpy")
    assert float(ref["lse"].max()) > 15.0  # scores near the bound, unshifted
    for name in ("out", "weights", "lse", "dv"):
        err = np.max(np.abs(got[name] - ref[name])) / np.max(np.abs(ref[name]))
        assert got[name].dtype == np.float32 and err < 2e-6, f"{name}: {err:.2e}"


def test_keys_shorter_than_1_bound_the_scores_by_their_norm_not_its_square(monkeypatch):
    """Cauchy-Schwarz bounds |s_ij| by |q_i * scale| |k_j|: with keys of norm 0.1 and
    |q * scale| = 1000 the scores reach 100, past float32's exp (88.7), so these rows are
    shifted (|k|^2 would bound them by 10, under EXP_BOUND, and exp(s) would overflow).
    float32 out, weights, lse and the gradients against the float64 reference."""
    monkeypatch.setattr(numpy_kernel, "POOL_MIN_SCORES", 0)
    rng = np.random.default_rng(8)
    B, H, Lq, Lk, D = 2, 2, 9, 7, 8
    q = rng.standard_normal((B, H, Lq, D))
    k = rng.standard_normal((B, H, Lk, D))
    q /= np.linalg.norm(q, axis=-1, keepdims=True)
    k /= np.linalg.norm(k, axis=-1, keepdims=True)
    k[..., 0, :] = q[..., 0, :]  # row 0 scores 100 against key 0
    q *= 1000.0 * np.sqrt(D)  # |q * scale| = 1000
    k *= 0.1  # |k| = 0.1
    v, dout = rng.standard_normal((B, H, Lk, 3)), rng.standard_normal((B, H, Lq, 3))
    ref = _all(q, k, v, dout, {}, "reference")
    assert float(ref["lse"].max()) > 99.0  # scores of 100: exp overflows float32 unshifted
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no overflow, no NaN
        got = _all(*(a.astype(np.float32) for a in (q, k, v)), dout.astype(np.float32), {}, "numpy")
    for name in ("out", "weights", "lse", "dq", "dk", "dv"):
        assert got[name].dtype == np.float32 and np.all(np.isfinite(got[name])), name
        err = np.max(np.abs(got[name] - ref[name])) / np.max(np.abs(ref[name]))
        assert err < 1e-4, f"{name}: {err:.2e}"


def test_probs_are_the_row_scaled_exps():
    """``cache.probs`` is ``exps * row_scale`` as a new array; rows sum to 1, an empty row to 0.
    ``row_scale`` is ``1 / rowsum(exps)``, and 1 on an empty row (as its field documents)."""
    q, k, v, dout, kw = make_inputs(2, 1, 2, 1, 6, 5, 3, 3, mask_kind="bool")
    _, c = A.sdpa_forward(q, k, v, impl="numpy", **kw)
    p = c.probs
    assert not np.shares_memory(p, c.exps)
    _, ref_c = F.sdpa_forward(q, k, v, mask=kw["mask"])
    np.testing.assert_allclose(p, ref_c.probs, rtol=1e-12, atol=1e-15)
    sums = p.sum(axis=-1)
    empty = ~np.broadcast_to(kw["mask"], p.shape).any(axis=-1)
    assert empty.any()
    np.testing.assert_allclose(sums[~empty], 1.0, rtol=1e-12)
    assert np.all(sums[empty] == 0.0)
    ps = c.row_scale.reshape(sums.shape)  # [B, Hq, Lq]
    np.testing.assert_allclose(ps[~empty], 1.0 / c.exps.sum(axis=-1)[~empty], rtol=1e-12)
    assert np.all(ps[empty] == 1.0)


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("min_tasks", [1, 2])
def test_tiles_spanning_batch_entries_equal_the_reference(case, min_tasks, monkeypatch):
    """Small heads share a tile across batch entries (B = 5: tiles of 5, or of 2, 2 and 1
    entries); float64, GQA, Lq != Lk, random dout and dlse, on the pool and in order."""
    monkeypatch.setattr(numpy_kernel, "TILE_MIN_TASKS", min_tasks)
    monkeypatch.setattr(numpy_kernel, "POOL_MIN_SCORES", 0)
    q, k, v, dout, kw = make_inputs(13, 5, 2, 2, 9, 7, 4, 3, **CASES[case])
    ref = _all(q, k, v, dout, kw, "reference")
    got = _all(q, k, v, dout, kw, "numpy")
    empty = ref["lse"] == -np.inf
    np.testing.assert_array_equal(got["lse"] == -np.inf, empty)
    got["lse"], ref["lse"] = got["lse"][~empty], ref["lse"][~empty]
    for name in ref:
        assert_close(got[name], ref[name], np.asarray, f"{case}, min_tasks {min_tasks}: {name}")
    if kw.get("rng") is not None:  # the one mask, whatever the tiles
        _, c = A.sdpa_forward(q, k, v, impl="numpy", **kw)
        _, ref_c = A.sdpa_forward(q, k, v, impl="reference", **kw)
        np.testing.assert_array_equal(A.dropout_keep_mask(c), A.dropout_keep_mask(ref_c))


def test_small_heads_share_tiles_while_the_call_keeps_tile_min_tasks_tiles(monkeypatch):
    """B = 8 entries whose heads all fit in one tile: a tile takes B // TILE_MIN_TASKS = 2
    batch entries (all their heads), so the pool gets 4 tiles, not 8 nor 1; forward and
    backward alike, with the reference's numbers."""
    monkeypatch.setattr(numpy_kernel, "POOL_MIN_SCORES", 0)
    spans = []
    real = numpy_kernel.run_tasks

    def recorded(fn, tasks, threads):
        spans.append(sorted(tasks))  # (b0, b1, h0, h1) each
        return real(fn, tasks, threads)

    monkeypatch.setattr(numpy_kernel, "run_tasks", recorded)
    q, k, v, dout, kw = make_inputs(19, 8, 2, 2, 5, 7, 4, 3)
    got = _all(q, k, v, dout, kw, "numpy")
    assert spans == [[(0, 2, 0, 2), (2, 4, 0, 2), (4, 6, 0, 2), (6, 8, 0, 2)]] * 2
    ref = _all(q, k, v, dout, kw, "reference")
    for name in ref:
        assert_close(got[name], ref[name], np.asarray, name)


@pytest.mark.parametrize("case", sorted(CASES))
def test_tiles_of_unequal_head_counts_equal_the_reference(case, monkeypatch):
    """Three K/V heads in tiles of two heads and one (``TILE_ELEMS`` fits two heads' scores):
    the last tile holds fewer heads than the others. float64, GQA, Lq != Lk, random dout and
    dlse, on the pool and in order."""
    monkeypatch.setattr(numpy_kernel, "TILE_ELEMS", 160)  # per K/V head 2 * 5 * 7 = 70 scores
    q, k, v, dout, kw = make_inputs(17, 2, 3, 2, 5, 7, 4, 3, **CASES[case])
    ref = _all(q, k, v, dout, kw, "reference")
    empty = ref["lse"] == -np.inf
    ref["lse"] = ref["lse"][~empty]
    for pool_min in (0, 1 << 40):
        monkeypatch.setattr(numpy_kernel, "POOL_MIN_SCORES", pool_min)
        got = _all(q, k, v, dout, kw, "numpy")
        np.testing.assert_array_equal(got["lse"] == -np.inf, empty)
        got["lse"] = got["lse"][~empty]
        for name in ref:
            assert_close(got[name], ref[name], np.asarray, f"{case}, pool min {pool_min}: {name}")


def test_a_query_whose_squared_norm_overflows_float32_warns_nothing():
    """Queries of norm ~1e20 in float32 (their squared norms overflow) against keys of zeros:
    the bound on the scores is not finite, so the scores are shifted; the weights are the
    reference's uniform rows, and no RuntimeWarning is raised (the reference raises none)."""
    rng = np.random.default_rng(6)
    q = (1e20 * rng.standard_normal((2, 2, 5, 4))).astype(np.float32)
    k = np.zeros((2, 2, 7, 4), dtype=np.float32)
    v = rng.standard_normal((2, 2, 7, 3)).astype(np.float32)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out, c = A.sdpa_forward(q, k, v, impl="numpy")
    np.testing.assert_allclose(A.weights(c), 1.0 / 7.0, rtol=1e-6)
    np.testing.assert_allclose(out, np.broadcast_to(v.mean(axis=-2, keepdims=True), out.shape),
                               rtol=1e-5, atol=1e-6)


def _planted(case):
    """float32 q, k, v [2, 4, 40, Dh] / [2, 2, 9, Dh] (GQA, G = 2) of small scores, the scale,
    and the rows that a planted large score or a NaN of ``case`` puts in the block of rows
    16:32 (of TILE_ELEMS = 64: blocks 0:16, 16:32, 32:40, one tile per batch entry and K/V
    head). The planted score is past float32's exp (88.7) and not the block's first row."""
    rng = np.random.default_rng(21)
    Dh = 64 if case == "an outlier key spread over every dimension" else 4
    q = 0.1 * rng.standard_normal((2, 4, 40, Dh))
    k = 0.1 * rng.standard_normal((2, 2, 9, Dh))
    v = rng.standard_normal((2, 2, 9, 3))
    scale = None
    u = np.ones(Dh) / np.sqrt(Dh)  # a unit direction
    if case == "a large score mid-block":  # row 20 of head 3 (K/V head 1): s = 100
        q[1, 3, 20] = 100.0 * np.sqrt(Dh) * u  # |q * scale| = 100
        k[1, 1, 5] = u
    elif case == "an outlier key spread over every dimension":  # |k| = 8 but 1 in each coordinate
        q[1, 3, 20] = 12.5 * np.sqrt(Dh) * u
        k[1, 1, 5] = 8.0 * u  # s = 12.5 * 8 = 100
    elif case == "a short query row against a long key":  # |q * scale| = 0.1, |k| = 1000
        q[1, 2:] *= 0.01  # the block's other rows: |q * scale| about 1e-3
        q[1, 3, 20] = 0.1 * np.sqrt(Dh) * u  # s = 100, though |q * scale|**2 |k| = 10
        k[1, 1, 5] = 1000.0 * u
    elif case == "scale > 1":  # |q| |k| = 12, and with the scale s = 96
        scale = 8.0
        q[1, 3, 20] = 4.0 * u
        k[1, 1, 5] = 3.0 * u
    else:  # "a NaN query row": row 18 of head 0 is NaN; row 20 of head 1 (same K/V head) s = 100
        q[0, 0, 18] = np.nan
        q[0, 1, 20] = 100.0 * np.sqrt(Dh) * u
        k[0, 0, 5] = u
    return [a.astype(np.float32) for a in (q, k, v)], scale


@pytest.mark.parametrize("case", ["a large score mid-block", "an outlier key spread over every dimension",
                                  "a short query row against a long key", "scale > 1",
                                  "a NaN query row"])
def test_the_bound_of_a_block_covers_every_score_in_it(case, monkeypatch):
    """A block takes exp(s) unshifted only if |q_i * scale| max_j |k_j| <= EXP_BOUND for every
    row i of it: a score of ~100 (exp overflows float32) in a row that is not the block's
    first, behind a key whose norm is spread over 64 coordinates, from a short query row
    (|q * scale| = 0.1: the bound is the norm, not its square), behind a scale of 8, or in
    the block of a NaN row (a NaN bound shifts) must be shifted. float32 against the
    reference in float64 on the same numbers: out, lse and (NaN aside) the gradients."""
    monkeypatch.setattr(numpy_kernel, "TILE_ELEMS", 64)  # blocks of 16 rows
    monkeypatch.setattr(numpy_kernel, "POOL_MIN_SCORES", 0)
    monkeypatch.setenv("NPATTN_NUM_THREADS", "2")
    (q, k, v), scale = _planted(case)
    q64, k64, v64 = (a.astype(np.float64) for a in (q, k, v))
    s = np.einsum("bhgid,bhjd->bhgij", q64.reshape(2, 2, 2, 40, -1), k64)
    s *= 1.0 / np.sqrt(q.shape[-1]) if scale is None else scale
    assert np.nanmax(s[..., 16:32, :]) > 89.0 and np.nanmax(s[..., 16, :]) < 16.0  # not row 16
    dout = np.random.default_rng(4).standard_normal((2, 4, 40, 3))
    kw = dict(scale=scale, enable_gqa=True)
    ref_out, ref_c = A.sdpa_forward(q64, k64, v64, impl="reference", **kw)
    out, c = A.sdpa_forward(q, k, v, impl="numpy", **kw)
    nan = np.isnan(ref_out)  # the NaN row alone, as in the reference
    np.testing.assert_array_equal(np.isnan(out), nan)
    np.testing.assert_array_equal(np.isnan(c.lse), np.isnan(ref_c.lse))
    got = {"out": out[~nan], "lse": c.lse[~np.isnan(ref_c.lse)]}
    want = {"out": ref_out[~nan], "lse": ref_c.lse[~np.isnan(ref_c.lse)]}
    if not nan.any():
        for name, g, gr in zip(("dq", "dk", "dv"), A.sdpa_backward(dout.astype(np.float32), c),
                               A.sdpa_backward(dout, ref_c)):
            got[name], want[name] = g, gr
    for name in want:
        assert np.all(np.isfinite(got[name])), f"{case}: {name} not finite"
        err = np.max(np.abs(got[name] - want[name])) / max(np.max(np.abs(want[name])), 1.0)
        assert err < 1e-4, f"{case}: {name} off by {err:.1e}"
