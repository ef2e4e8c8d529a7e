"""The NumPy kernel's softmax without the max shift (``numpy_kernel.EXP_BOUND``) and its
row factors (``cache.exps``, ``cache.row_scale``): the reference's numbers either way."""

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


def test_probs_are_the_row_scaled_exps():
    """``cache.probs`` is ``exps * row_scale`` as a new array; rows sum to 1, an empty row to 0."""
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
