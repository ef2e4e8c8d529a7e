"""Every implementation of ``npattn.attention`` against the readable reference.

``impl="reference"`` runs ``npattn.functional`` as written; ``"blocked"`` the
FlashAttention-2 style algorithm; ``"numpy"`` the tiled NumPy kernel (NumPy
arrays only); ``"dense"`` and ``"auto"`` resolve to one of those. All of them
must compute the same function: the same outputs, weights and four
gradients in float64 to 1e-12 of each tensor's scale, and the *same* dropout
keep-mask, bit for bit, from one seed.

The kernel's tile size is shrunk (``TILE_ELEMS``) and its pool forced on
(``POOL_MIN_SCORES = 0``) so that the small test shapes still split into
several tiles and pool tasks; blocked runs with blocks of 1, 2, 3 and larger
than the lengths. Upstream gradients are random, never all ones.
"""

import math
import re

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from npattn import MultiHeadAttention, blocked, numpy_kernel
from npattn import backend as npb
from npattn import attention as A
from npattn import functional as F
from npattn.gradcheck import gradcheck

from _attention_cases import MASK_FORMS, P_DROP, assert_close, make_inputs, make_mask, on, one_kv_head_case

fixture_ok = settings(suppress_health_check=[HealthCheck.function_scoped_fixture])

SMALL_TILES = 16  # score entries per kernel tile: one head (or less) per tile
BLOCKS = [(1, 1), (2, 3), (3, 2), (16, 16)]  # (block_q, block_k); 16 is larger than any L here
CACHES = {"reference": F.SDPACache, "blocked": blocked.BlockedSDPACache,
          "numpy": numpy_kernel.NumpySDPACache}  # the cache type tells which implementation ran

def run(impl, q, k, v, dout, kw, **extra):
    """Forward and backward of one implementation: ``(out, cache, (dq, dk, dv, dmask))``."""
    out, cache = A.sdpa_forward(q, k, v, impl=impl, **kw, **extra)
    return out, cache, A.sdpa_backward(dout, cache)


def assert_same_results(got, ref, to_np, what):
    """Output and the four gradients of one run against the reference run."""
    out, _, grads = got
    ref_out, _, ref_grads = ref
    assert_close(out, ref_out, to_np, f"{what}: out")
    for name, g, gr in zip(("dq", "dk", "dv", "dmask"), grads, ref_grads):
        assert_close(g, gr, to_np, f"{what}: {name}")


def variants(backend_name, mp):
    """(label, impl, extra kwargs) of every implementation to compare on this backend.

    On NumPy the kernel's tiles are shrunk and its pool forced on through ``mp``.
    """
    vs = [("reference", "reference", {}), ("dense", "dense", {}), ("auto", "auto", {})]
    vs += [(f"blocked{bq}x{bk}", "blocked", dict(block_q=bq, block_k=bk)) for bq, bk in BLOCKS]
    if backend_name == "numpy":
        mp.setattr(numpy_kernel, "TILE_ELEMS", SMALL_TILES)
        mp.setattr(numpy_kernel, "POOL_MIN_SCORES", 0)
        vs += [(f"numpy/{n} threads", "numpy", dict(threads=n)) for n in ("1", "2")]
    return vs


def run_variant(mp, impl, q, k, v, dout, kw, extra):
    extra = dict(extra)
    threads = extra.pop("threads", None)
    if threads is not None:
        mp.setenv("NPATTN_NUM_THREADS", threads)
    try:
        return run(impl, q, k, v, dout, kw, **extra)
    finally:
        if threads is not None:
            mp.delenv("NPATTN_NUM_THREADS")


# --------------------------------------------------------------------------
# every implementation == the reference, float64


@st.composite
def cases(draw):
    Lq = draw(st.integers(2, 9))
    return dict(
        seed=draw(st.integers(0, 2**16)),
        B=draw(st.integers(1, 2)),
        Hkv=draw(st.integers(1, 2)),
        G=draw(st.integers(1, 3)),
        Lq=Lq,
        Lk=draw(st.integers(2, 9).filter(lambda n: n != Lq)),
        Dh=draw(st.integers(2, 4)),
        Dv=draw(st.integers(2, 5)),
        mask_kind=draw(st.sampled_from(["none", "bool", "float"])),
        mask_form=draw(st.sampled_from(sorted(MASK_FORMS))),
        causal=draw(st.booleans()),
        dropout=draw(st.sampled_from(["none", "seed", "mask"])),
    )


@fixture_ok
@given(case=cases())
def test_every_impl_matches_the_reference(case, backend, xp, to_xp, to_np):
    case = dict(case)  # the drawn dict stays as hypothesis reports it
    seed = case.pop("seed")
    dims = [case.pop(n) for n in ("B", "Hkv", "G", "Lq", "Lk", "Dh", "Dv")]
    q, k, v, dout, kw = make_inputs(seed, *dims, **case)
    q, k, v, dout, kw = to_xp(q), to_xp(k), to_xp(v), to_xp(dout), on(to_xp, kw)
    # the reference as a reader finds it in npattn.functional, called directly
    ref_out, ref_cache = F.sdpa_forward(q, k, v, **kw)
    ref = (ref_out, ref_cache, F.sdpa_backward(dout, ref_cache))
    ref_keep = A.dropout_keep_mask(ref_cache)
    ref_w = to_np(A.weights(ref_cache))
    if case["dropout"] == "none":
        assert ref_keep is None
    else:
        ref_keep = to_np(ref_keep)
        assert ref_keep.shape == ref_w.shape and ref_keep.dtype == np.bool_
    if case["dropout"] == "seed":  # the documented draw: one key, a hash of the coordinates
        expected = npb.keep_mask(npb.dropout_key(seed), P_DROP, ref_w.shape, np)
        np.testing.assert_array_equal(ref_keep, expected)
    with pytest.MonkeyPatch.context() as mp:
        for label, impl, extra in variants(backend, mp):
            got = run_variant(mp, impl, q, k, v, dout, kw, extra)
            assert type(got[0]) is type(q), label  # array type in, array type out
            resolved = impl if impl in CACHES else ("numpy" if backend == "numpy" else "reference")
            assert isinstance(got[1], CACHES[resolved]), f"{label}: {type(got[1]).__name__}"
            assert_same_results(got, ref, to_np, label)
            keep = A.dropout_keep_mask(got[1])
            if ref_keep is None:
                assert keep is None, label
            else:
                np.testing.assert_array_equal(to_np(keep), ref_keep, err_msg=f"{label}: keep-mask")
            if impl != "blocked":
                assert_close(A.weights(got[1]), ref_w, to_np, f"{label}: weights")


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("mask_kind", ["none", "bool", "float"])
def test_kernel_row_blocks_and_causal_skips_match_the_reference(mask_kind, causal, monkeypatch):
    """Lengths past the kernel's 16-row minimum block: several row blocks, and with
    ``is_causal`` blocks that meet only the keys left of the diagonal (Lq > Lk and Lq < Lk)."""
    monkeypatch.setattr(numpy_kernel, "TILE_ELEMS", 64)
    monkeypatch.setattr(numpy_kernel, "POOL_MIN_SCORES", 0)
    monkeypatch.setenv("NPATTN_NUM_THREADS", "2")
    for Lq, Lk in ((41, 23), (35, 50)):
        q, k, v, dout, kw = make_inputs(Lq + Lk, 2, 2, 2, Lq, Lk, 3, 5, mask_kind=mask_kind,
                                        mask_form="B1LqLk", dropout="seed", causal=causal)
        ref_out, ref_c = F.sdpa_forward(q, k, v, **kw)
        ref = (ref_out, ref_c, F.sdpa_backward(dout, ref_c))
        for impl, extra in (("numpy", {}), ("blocked", dict(block_q=7, block_k=16))):
            got = run(impl, q, k, v, dout, kw, **extra)
            assert_same_results(got, ref, np.asarray, f"{impl} {Lq}x{Lk}")
            np.testing.assert_array_equal(A.dropout_keep_mask(got[1]),
                                          A.dropout_keep_mask(ref_c))
        if mask_kind != "none":  # query row 0 attends nothing: zeros
            assert np.all(ref_out[:, :, 0] == 0.0) and np.all(ref[2][0][:, :, 0] == 0.0)
        assert np.any(ref_out[:, :, 1:] != 0.0)


@pytest.mark.parametrize("mask_form", sorted(MASK_FORMS))
def test_dmask_has_the_mask_shape_on_every_impl(mask_form, backend, xp, to_xp, to_np):
    """A float mask of every broadcast form gets a gradient of its own shape, summed over the
    broadcast axes; a fully masked row gets zero weights and a zero dq row."""
    q, k, v, dout, kw = make_inputs(1, 2, 1, 3, 7, 5, 4, 3, mask_kind="float",
                                    mask_form=mask_form, causal=True)
    q, k, v, dout, kw = to_xp(q), to_xp(k), to_xp(v), to_xp(dout), on(to_xp, kw)
    ref = run("reference", q, k, v, dout, kw)
    impls = [("blocked", dict(block_q=3, block_k=2))]
    if backend == "numpy":
        impls.append(("numpy", {}))
    for impl, extra in impls:
        got = run(impl, q, k, v, dout, kw, **extra)
        assert tuple(got[2][3].shape) == tuple(kw["mask"].shape), impl
        assert_same_results(got, ref, to_np, impl)
    if MASK_FORMS[mask_form](1, 1, 7, 5)[-2:-1] == (7,):  # row 0 of the mask is -inf
        w = to_np(A.weights(ref[1]))
        assert np.all(w[:, :, 0] == 0.0) and np.all(to_np(ref[2][0])[:, :, 0] == 0.0)


# --------------------------------------------------------------------------
# dropout: one mask per seed, whatever the blocks, tiles and threads


def test_dropout_mask_is_the_same_for_every_block_size_tile_and_thread_count(monkeypatch):
    monkeypatch.setattr(numpy_kernel, "POOL_MIN_SCORES", 0)
    q, k, v, dout, kw = make_inputs(2, 2, 2, 3, 11, 13, 3, 4, mask_kind="bool",
                                    mask_form="B1LqLk", dropout="seed", causal=True)
    ref_out, ref_c = F.sdpa_forward(q, k, v, **kw)
    ref_keep = A.dropout_keep_mask(ref_c)
    assert 0.6 < ref_keep.mean() < 0.8  # about 1 - p kept
    outs = {}
    for threads in ("1", "2", "3"):
        monkeypatch.setenv("NPATTN_NUM_THREADS", threads)
        for bq, bk in BLOCKS + [(4, 5), (11, 1)]:
            out, c, grads = run("blocked", q, k, v, dout, kw, block_q=bq, block_k=bk)
            np.testing.assert_array_equal(A.dropout_keep_mask(c), ref_keep,
                                          err_msg=f"blocked {bq}x{bk}, {threads} threads")
            np.testing.assert_array_equal(blocked.blocked_keep_mask(c), ref_keep)
            assert_close(out, ref_out, np.asarray, f"blocked {bq}x{bk}")
            outs.setdefault(("blocked", bq, bk), []).append((out, *grads[:3]))
        for tile in (8, 64, 1 << 18):
            monkeypatch.setattr(numpy_kernel, "TILE_ELEMS", tile)
            out, c, grads = run("numpy", q, k, v, dout, kw)
            np.testing.assert_array_equal(A.dropout_keep_mask(c), ref_keep,
                                          err_msg=f"numpy tile {tile}, {threads} threads")
            assert_close(out, ref_out, np.asarray, f"numpy tile {tile}")
            outs.setdefault(("numpy", tile), []).append((out, *grads[:3]))
    for key, runs in outs.items():  # thread count changes nothing, not even the last bit
        for other in runs[1:]:
            for a, b in zip(runs[0], other):
                np.testing.assert_array_equal(a, b, err_msg=str(key))


def test_dropout_mask_is_the_same_on_every_backend(backend, xp, to_xp, to_np):
    q, k, v, dout, kw = make_inputs(4, 2, 2, 2, 6, 9, 3, 2, dropout="seed", causal=True)
    ref_keep = A.dropout_keep_mask(F.sdpa_forward(q, k, v, **kw)[1])  # NumPy
    qx, kx, vx = to_xp(q), to_xp(k), to_xp(v)
    for impl, extra in (("reference", {}), ("blocked", dict(block_q=4, block_k=2))):
        c = A.sdpa_forward(qx, kx, vx, impl=impl, **kw, **extra)[1]
        np.testing.assert_array_equal(to_np(A.dropout_keep_mask(c)), ref_keep, err_msg=impl)
    # another seed, another mask; a Generator seeded alike, the same mask
    other = A.dropout_keep_mask(F.sdpa_forward(q, k, v, **{**kw, "rng": 5})[1])
    assert np.any(other != ref_keep)
    gen = np.random.default_rng(4)
    again = A.dropout_keep_mask(F.sdpa_forward(q, k, v, **{**kw, "rng": gen})[1])
    np.testing.assert_array_equal(again, ref_keep)


def _oracle(q, k, v, mask, keep, p, scale, causal):
    """Dense attention with an explicit keep-mask, in NumPy with the heads repeated (no npattn)."""
    G = q.shape[1] // k.shape[1]
    k, v = np.repeat(k, G, axis=1), np.repeat(v, G, axis=1)
    s = q @ np.swapaxes(k, -1, -2) * scale  # [B, Hq, Lq, Lk]
    allowed = np.ones(s.shape, dtype=bool)
    if mask is not None and mask.dtype == bool:
        allowed &= mask
    elif mask is not None:
        s = s + mask
    if causal:
        allowed &= np.tril(np.ones(s.shape[-2:], dtype=bool))
    s = np.where(allowed, s, -np.inf)
    m = np.max(s, axis=-1, keepdims=True)
    e = np.exp(s - np.where(np.isfinite(m), m, 0.0))
    den = np.sum(e, axis=-1, keepdims=True)
    probs = e / np.where(den == 0.0, 1.0, den)
    return np.where(keep, probs / (1.0 - p), 0.0) @ v


@pytest.mark.parametrize("keep_shape", ["full", "1HLqLk", "LqLk"])
def test_a_callers_dropout_mask_is_used_as_given(keep_shape, backend, xp, to_xp, to_np):
    q, k, v, dout, kw = make_inputs(5, 2, 2, 2, 5, 7, 3, 4, mask_kind="float",
                                    mask_form="B1LqLk", causal=True)
    B, Hq, Lq, Lk = 2, 4, 5, 7
    keep = np.random.default_rng(6).random(MASK_FORMS[keep_shape](B, Hq, Lq, Lk)) >= P_DROP
    expected = _oracle(q, k, v, kw["mask"], keep, P_DROP, 1 / math.sqrt(3), True)
    kwx = on(to_xp, dict(kw, dropout_p=P_DROP, dropout_mask=keep, rng=123))
    qx, kx, vx, dx = to_xp(q), to_xp(k), to_xp(v), to_xp(dout)
    ref = run("reference", qx, kx, vx, dx, kwx)
    impls = [("reference", {}), ("blocked", dict(block_q=2, block_k=3))]
    if backend == "numpy":
        impls.append(("numpy", {}))
    for impl, extra in impls:
        got = run(impl, qx, kx, vx, dx, kwx, **extra)
        np.testing.assert_allclose(to_np(got[0]), expected, rtol=1e-12,
                                   atol=1e-12 * np.abs(expected).max(), err_msg=impl)
        np.testing.assert_array_equal(to_np(A.dropout_keep_mask(got[1])),
                                      np.broadcast_to(keep, (B, Hq, Lq, Lk)), err_msg=impl)
        assert_same_results(got, ref, to_np, impl)


@pytest.mark.parametrize("impl", ["numpy", "reference", "blocked"])
def test_a_callers_dropout_mask_is_returned_as_it_was_broadcast(impl):
    """``dropout_keep_mask`` of a forward given a (1, Hq, Lq, Lk) keep-mask is that mask
    broadcast to (B, Hq, Lq, Lk): a view of the caller's array, not a copy (GQA, Lq != Lk)."""
    q, k, v, _, kw = make_inputs(8, 2, 2, 2, 5, 7, 3, 4, dropout="mask")
    _, c = A.sdpa_forward(q, k, v, impl=impl, **kw)
    got = A.dropout_keep_mask(c)
    assert got.shape == (2, 4, 5, 7)
    np.testing.assert_array_equal(got, np.broadcast_to(kw["dropout_mask"], got.shape))
    assert np.shares_memory(got, kw["dropout_mask"])


# --------------------------------------------------------------------------
# large scores


@pytest.mark.parametrize("magnitude, block_k", [(1e17, None), (1e300, 1)])
def test_large_scores_float64(magnitude, block_k, backend, xp, to_xp, to_np):
    """Two equal scores of 1e17 (or 1e300): p = [1/2, 1/2] exactly, so dv = [1/2, 1/2].

    With one log-sum-exp ``m + log(l)`` instead of ``m`` and ``l`` kept apart,
    ``log(2)`` rounds away against 1e17 and dv comes out [1, 1].
    """
    q = to_xp(np.ones((1, 1, 1, 1)))
    k = to_xp(np.full((1, 1, 2, 1), magnitude))
    v = to_xp(np.array([[[[1.0], [3.0]]]]))
    dout = to_xp(np.ones((1, 1, 1, 1)))
    impls = [("reference", {}), ("blocked", dict(block_k=block_k or 512)),
             ("blocked", dict(block_q=1, block_k=2))]
    if backend == "numpy":
        impls.append(("numpy", {}))
    for impl, extra in impls:
        out, c, (dq, dk, dv, _, _) = run(impl, q, k, v, dout, dict(scale=1.0), **extra)
        np.testing.assert_allclose(to_np(out), [[[[2.0]]]], rtol=1e-15, err_msg=impl)
        np.testing.assert_allclose(to_np(dv), [[[[0.5], [0.5]]]], rtol=1e-15, err_msg=impl)
        # ds = p * (dp - delta) = [1/2 (1 - 2), 1/2 (3 - 2)], dk = ds * q
        np.testing.assert_allclose(to_np(dk), [[[[-0.5], [0.5]]]], rtol=1e-15, err_msg=impl)
        assert np.all(np.isfinite(to_np(dq))), impl


def test_one_hot_rows_with_large_values_round_by_the_size_of_the_terms(backend, to_xp, to_np):
    """Rows whose weight sits on one key (query i meets key i 750 or more above the rest) and
    values of 1e3: dq and dk are 0. The reference's row sum sum_j dp_j p_j is formed
    from the dp it is subtracted from and leaves them; the tiled implementations' rowsum(dout
    * out) is dp summed in another order, and its rounding, at most a few eps |dout| |v| |k|
    scale, is all of their dq and dk. dv is p^T dout, the same on every path."""
    rng = np.random.default_rng(0)
    u = np.linalg.qr(rng.standard_normal((2, 1, 16, 16)))[0][..., :3, :]  # 3 orthonormal rows
    q, k = 60 * u, np.concatenate([60 * u, -60 * u, rng.standard_normal((2, 1, 1, 16))], axis=2)
    v = 1e3 * rng.standard_normal((2, 1, 7, 16))
    dout = rng.standard_normal((2, 1, 3, 16))
    s = np.einsum("bhid,bhjd->bhij", q, k) / 4
    top2 = np.sort(s, axis=-1)[..., -2:]
    assert np.all(top2[..., 1] - top2[..., 0] > 750)  # exp(-750) is 0: p is one-hot exactly
    bound = 16 * np.finfo(np.float64).eps * np.abs(dout).max() * np.abs(v).max() * np.abs(k).max() / 4
    impls = [("reference", {}), ("blocked", {}), ("blocked", dict(block_q=2, block_k=3))]
    if backend == "numpy":
        impls.append(("numpy", {}))
    ref = None
    for impl, extra in impls:
        _, _, (dq, dk, dv, _, _) = run(impl, to_xp(q), to_xp(k), to_xp(v), to_xp(dout), {}, **extra)
        dq, dk, dv = to_np(dq), to_np(dk), to_np(dv)
        if ref is None:
            ref = dv
            assert not np.any(dq) and not np.any(dk), impl
        else:
            assert np.abs(dq).max() < bound and np.abs(dk).max() < bound, impl
            np.testing.assert_allclose(dv, ref, rtol=1e-13, err_msg=impl)


def _numpy_equals_reference(q, k, v, mask=None, scale=None):
    """The NumPy kernel's out and lse against the reference's on the same float32 call."""
    ref_out, ref_c = A.sdpa_forward(q, k, v, mask=mask, scale=scale, impl="reference")
    out, c = A.sdpa_forward(q, k, v, mask=mask, scale=scale, impl="numpy")
    assert np.all(np.isfinite(out)) and np.all(np.isfinite(c.lse))
    np.testing.assert_allclose(out, ref_out, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(c.lse, ref_c.lse, rtol=1e-6)
    return c


def test_the_kernels_shortcut_past_the_row_maximum_holds_only_where_exp_is_safe():
    """The kernel skips subtracting a row's maximum where Cauchy-Schwarz bounds every score by
    EXP_BOUND: scores of 90 (past float32's exp), a row of 16384 scores of 79.9 (each exp
    fits, their sum does not), one key of norm 100 among small ones (the bound needs the
    largest |k|, not a typical one) and a float mask of -1000 on a whole row (the mask, not
    q and k, sets the scores) must all take the shift and equal the reference."""
    f32 = np.float32
    # scores of 90: q k^T * scale with scale 1/sqrt(2)
    q = np.array([[[[90.0 * math.sqrt(2.0), 0.0]]]], f32)
    k = np.array([[[[1.0, 0.0], [0.5, 0.0]]]], f32)
    v = np.array([[[[1.0], [2.0]]]], f32)
    assert abs(float(_numpy_equals_reference(q, k, v).lse[0, 0, 0]) - 90.0 - math.log1p(math.exp(-45))) < 1e-3
    # 16384 equal scores of 79.9 in one row: the row sum of exp(79.9) overflows float32
    L = 16384
    q = np.array([[[[79.9, 0.0]]]], f32)
    k = np.broadcast_to(np.array([1.0, 0.0], f32), (1, 1, L, 2))
    v = np.broadcast_to(np.arange(L, dtype=f32)[:, None] / L, (1, 1, L, 1))
    c = _numpy_equals_reference(q, k, v, scale=1.0)
    assert abs(float(c.lse[0, 0, 0]) - (79.9 + math.log(L))) < 1e-3
    # one outlier key: 63 keys of norm 0.01 and one of 100, |q * scale| = 1
    k = np.zeros((1, 1, 64, 2), f32)
    k[..., 0] = 0.01
    k[0, 0, 17, 0] = 100.0
    q = np.array([[[[1.0, 0.0]]]], f32)
    v = np.random.default_rng(0).standard_normal((1, 1, 64, 3)).astype(f32)
    _numpy_equals_reference(q, k, v, scale=1.0)
    # a float mask that moves a whole row by -1000 (float64: exp(-1000) underflows to 0)
    r = np.random.default_rng(1)
    q, k, v = (r.standard_normal(s) for s in ((1, 2, 3, 4), (1, 2, 5, 4), (1, 2, 5, 4)))
    mask = np.zeros((3, 5))
    mask[1] = -1000.0
    mask[2, :2] = 95.0  # float32 would overflow here; float64 does not, and must match
    ref_out, ref_c = A.sdpa_forward(q, k, v, mask=mask, impl="reference")
    out, c = A.sdpa_forward(q, k, v, mask=mask, impl="numpy")
    np.testing.assert_allclose(out, ref_out, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(c.lse, ref_c.lse, rtol=1e-12)
    assert np.all(np.abs(out[0, :, 1]) > 0)  # the row moved by -1000 still attends
    _numpy_equals_reference(*(a.astype(f32) for a in (q, k, v)), mask=np.where(mask == 95.0, 95.0, 0.0).astype(f32))


def test_lse_is_float32_for_half_inputs_on_every_implementation():
    """The saved log-sum-exp is in the compute dtype (float32) whatever the implementation, so
    one float32 dlse serves them all."""
    r = np.random.default_rng(2)
    q, k, v = (r.standard_normal((2, 2, 5, 4)).astype(np.float16) for _ in range(3))
    for impl in ("reference", "blocked", "numpy"):
        out, c = A.sdpa_forward(q, k, v, impl=impl)
        assert out.dtype == np.float16 and c.lse.dtype == np.float32, impl
        A.sdpa_backward(np.ones_like(out), c, dlse=np.ones((2, 2, 5), np.float32))


def test_auto_on_an_accelerator_keeps_dense_while_its_arrays_fit(monkeypatch):
    """On a CUDA device (accelerator_memory not None) the CPU thresholds do not apply: auto
    stays dense while DENSE_PEAK_ARRAYS arrays of B H Lq Lk entries, at least 4 bytes
    each, fit in AUTO_DEVICE_DENSE_SHARE of the device's memory."""
    gib = 2**30
    # 1x16384x512x8 in float32 on an H200 (141 GiB): 4 arrays of 8 GiB fit in half of it
    assert not A.auto_blocked(8, 16384, 16384, device_memory=141 * gib)
    assert A.auto_blocked(8, 16384, 16384)  # in host memory the same call is blocked
    assert A.auto_blocked(8, 65536, 65536, device_memory=141 * gib)  # 4 x 128 GiB
    # the boundary: the arrays of 1 x 10 x 100 float32 entries fill the share exactly
    mem = int(A.DENSE_PEAK_ARRAYS * 1000 * 4 / A.AUTO_DEVICE_DENSE_SHARE)
    assert not A.auto_blocked(1, 10, 100, device_memory=mem)
    assert A.auto_blocked(1, 10, 101, device_memory=mem)
    assert A.auto_blocked(2, 10, 100, device_memory=mem)
    assert not A.auto_blocked(1, 10, 100, device_memory=mem, itemsize=2)  # float16: in float32
    assert A.auto_blocked(1, 10, 101, device_memory=mem, itemsize=2)  # (at 2 bytes it would fit)
    assert A.auto_blocked(1, 10, 100, device_memory=mem, itemsize=8)
    # host arrays have no accelerator memory; select_impl asks the array's device
    from npattn.backend import accelerator_memory
    q = np.broadcast_to(np.zeros((), np.float32), (1, 1, 8192, 8))  # 2**26 scores a head
    assert accelerator_memory(q) is None
    assert A.select_impl("auto", q, q, q) == "blocked"
    monkeypatch.setattr(A, "accelerator_memory", lambda x: 141 * gib)
    assert A.select_impl("auto", q, q, q) == "numpy"
    monkeypatch.setattr(A, "accelerator_memory", lambda x: gib)  # 4 x 256 MiB > half a GiB
    assert A.select_impl("auto", q, q, q) == "blocked"
    # the dtype counts: 4 arrays of 2**26 entries are 1 GiB in float32 and float16 (computed in
    # float32), 2 GiB in float64
    monkeypatch.setattr(A, "accelerator_memory", lambda x: 3 * gib)  # a share of 1.5 GiB
    assert A.select_impl("auto", q, q, q) == "numpy"
    q64 = np.broadcast_to(np.zeros((), np.float64), q.shape)
    assert A.select_impl("auto", q64, q64, q64) == "blocked"
    monkeypatch.setattr(A, "accelerator_memory", lambda x: 3 * gib // 2)  # a share of 0.75 GiB
    q16 = np.broadcast_to(np.zeros((), np.float16), q.shape)
    assert A.select_impl("auto", q16, q16, q16) == "blocked"


def test_auto_picks_blocked_exactly_at_its_thresholds_and_keeps_block_sizes():
    """select_impl's thresholds count the query heads (under GQA K/V have fewer) and are
    inclusive; blocked keeps the block sizes it was given (q's first)."""
    small = np.broadcast_to(np.zeros((), np.float32), (1, 1, 8, 8))
    n = A.AUTO_BLOCKED_MIN_SCORES
    q = np.broadcast_to(np.zeros((), np.float32), (1, 1, 2 * 4096, 8))
    kv = np.broadcast_to(np.zeros((), np.float32), (1, 1, n // (2 * 4096), 8))
    assert A.select_impl("auto", q, kv, kv) == "blocked"  # Lq Lk == the threshold
    kv1 = np.broadcast_to(np.zeros((), np.float32), (1, 1, n // (2 * 4096) - 1, 8))
    assert A.select_impl("auto", q, kv1, kv1) == "numpy"
    # 16 query heads on 2 K/V heads: B Hq Lq Lk = 2**28 dense scores, whatever Hkv
    Lq = int(math.isqrt(A.AUTO_BLOCKED_MAX_DENSE_SCORES // 16))
    assert Lq * Lq < n  # below the per-head threshold: only the total counts here
    q = np.broadcast_to(np.zeros((), np.float32), (1, 16, Lq, 8))
    kv = np.broadcast_to(np.zeros((), np.float32), (1, 2, Lq, 8))
    assert A.select_impl("auto", q, kv, kv) == "blocked"
    assert A.select_impl("auto", small, small, small) == "numpy"
    r = np.random.default_rng(3)
    q, k, v = (r.standard_normal((1, 1, 7, 4)) for _ in range(3))
    _, c = A.sdpa_forward(q, k, v, impl="blocked", block_q=2, block_k=5)
    assert (c.block_q, c.block_k) == (2, 5)


def test_auto_counts_the_scores_of_leading_axes_that_broadcast():
    """AUTO_BLOCKED_MAX_DENSE_SCORES counts the dense scores, whose leading axes are q's, k's
    and v's broadcast together: q of one batch entry against k and v of n entries (leading
    axes broadcast as in torch's SDPA) has n x 512 x 512 scores, as many as the call with q
    broadcast by hand, and "auto" takes the blocked path for both (counting q's axes alone
    it took the dense one, whose arrays are of n entries too); so do heads that broadcast.
    Under GQA the batch axes broadcast and the query heads count."""
    n = A.AUTO_BLOCKED_MAX_DENSE_SCORES // (512 * 512)  # batch entries of one 512 x 512 head
    one, many, fewer = _big(1, 1, 512, 8), _big(n, 1, 512, 8), _big(n - 1, 1, 512, 8)
    assert A.select_impl("auto", many, many, many) == "blocked"
    assert A.select_impl("auto", one, many, many) == "blocked"
    assert A.select_impl("auto", many, one, one) == "blocked"
    assert A.select_impl("auto", one, fewer, fewer) == "reference"  # one entry short: dense
    heads = _big(1, n, 512, 8)  # q's one head broadcast over n K/V heads (no GQA): n heads
    assert A.select_impl("auto", one, heads, heads) == "blocked"
    q = _big(1, 4, 512, 8)  # 4 query heads on 2 K/V heads of n / 4 batch entries: n heads
    assert A.select_impl("auto", q, _big(n // 4, 2, 512, 8), _big(n // 4, 2, 512, 8)) == "blocked"
    assert A.select_impl("auto", q, _big(n // 4 - 1, 2, 512, 8), _big(n // 4 - 1, 2, 512, 8)) == "reference"


def test_keys_and_values_broadcast_over_the_heads_without_gqa():
    """k and v of one head, (B, 1, Lk, D), broadcast to q's heads as any leading axis does
    (enable_gqa off): every implementation that takes it gives softmax(q k^T / sqrt(Dh)) v with
    the one K/V head, written out below, and dk, dv of that head (the sum over the query
    heads). The NumPy kernel's layout is (B, Hkv, ...) with Hkv dividing Hq only under GQA:
    "auto" must not take the kernel here (it did fail with a reshape error when the
    broadcast was not noticed), and impl="numpy" is refused by name."""
    q, k, v, want, dout = one_kv_head_case(12)
    k4, v4 = np.repeat(k, 4, axis=1), np.repeat(v, 4, axis=1)  # the heads made explicit
    _, c4 = A.sdpa_forward(q, k4, v4, impl="reference")
    dk4, dv4 = A.sdpa_backward(dout, c4)[1:3]
    for impl in ("auto", "dense", "reference", "blocked"):
        out, cache = A.sdpa_forward(q, k, v, impl=impl)
        np.testing.assert_allclose(out, want, rtol=1e-12, atol=1e-12, err_msg=impl)
        dk, dv = A.sdpa_backward(dout, cache)[1:3]
        np.testing.assert_allclose(dk, dk4.sum(axis=1, keepdims=True), rtol=1e-12, atol=1e-12)
        np.testing.assert_allclose(dv, dv4.sum(axis=1, keepdims=True), rtol=1e-12, atol=1e-12)
    with pytest.raises(ValueError, match="^impl='numpy'"):
        A.sdpa_forward(q, k, v, impl="numpy")
    # v alone of one head: its leading axes broadcast too, and the refusal says so
    with pytest.raises(ValueError, match="^impl='numpy': the kernel options .*leading axes that broadcast"):
        A.sdpa_forward(q, k4, v, impl="numpy")


def test_a_large_sink_is_exact_on_the_reference_and_blocked():
    """A sink logit of 100 in float32 (800 in float64) sets the row maximum: exp of the sink
    taken without it overflows (lse inf, p_sink NaN). In head 0 the sink takes all the mass
    (to rounding): lse = big, out = 0, and dsink = sum_i p_sink (dlse_i - delta_i) = sum_i dlse_i
    for random dout and dlse."""
    r = np.random.default_rng(4)
    for dtype, big in ((np.float32, 100.0), (np.float64, 800.0)):
        q, k, v = (r.standard_normal((1, 2, 3, 4)).astype(dtype) for _ in range(3))
        dout, dlse = r.standard_normal((1, 2, 3, 4)).astype(dtype), r.standard_normal((1, 2, 3)).astype(dtype)
        sinks = np.array([big, 0.0], dtype)
        results = {}
        for impl in ("reference", "blocked"):
            out, c = A.sdpa_forward(q, k, v, sinks=sinks, impl=impl)
            g = A.sdpa_backward(dout, c, dlse=dlse)
            assert np.all(np.isfinite(c.lse)) and np.all(np.isfinite(g.dsinks)), (impl, dtype)
            results[impl] = (out, c.lse, g.dsinks)
            np.testing.assert_allclose(c.lse[0, 0], big, rtol=1e-6)
            np.testing.assert_allclose(out[0, 0], 0.0, atol=1e-30)
            np.testing.assert_allclose(g.dsinks[0], dlse[0, 0].sum(dtype=np.float64), rtol=1e-6)
        for a, b in zip(results["reference"], results["blocked"]):
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def _large_score_inputs(seed, B=2, H=2, Lq=6, Lk=9, Dh=4, Dv=3):
    """float32 inputs whose scores are about 1e4 and exact in float32, spread by O(1) in a row.

    q = 1 + n/8 and k = 2500 + m/4 (n, m small integers): every product and
    partial sum is a multiple of 1/32 below 2**14, so float32 computes the
    scores exactly and what is left is the softmax's own rounding. The rows
    differ by O(1): the softmax is not saturated.
    """
    r = np.random.default_rng(seed)
    q = 1.0 + r.integers(-2, 3, size=(B, H, Lq, Dh)) / 8.0
    k = 2500.0 + r.integers(-4, 5, size=(B, H, Lk, Dh)) / 4.0
    v = r.standard_normal((B, H, Lk, Dv))
    dout = r.standard_normal((B, H, Lq, Dv))
    return [a.astype(np.float32) for a in (q, k, v, dout)]


def test_large_scores_float32_keep_float32_precision(backend, xp, to_xp, to_np):
    q, k, v, dout = _large_score_inputs(7)
    s = (q.astype(np.float64) @ np.swapaxes(k, -1, -2).astype(np.float64))
    assert 8e3 < s.min() and s.max() < 1.4e4  # scores around 1e4 ...
    p = np.exp(s - s.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    assert p.max() < 0.99  # ... and a softmax that is not saturated
    ref_out, ref_c = F.sdpa_forward(*(a.astype(np.float64) for a in (q, k, v)), scale=1.0)
    ref = (ref_out, *F.sdpa_backward(dout.astype(np.float64), ref_c)[:3])
    impls = [("reference", {}), ("blocked", dict(block_q=4, block_k=2)), ("blocked", {})]
    if backend == "numpy":
        impls.append(("numpy", {}))
    for impl, extra in impls:
        out, _, (dq, dk, dv, _, _) = run(impl, to_xp(q), to_xp(k), to_xp(v), to_xp(dout),
                                      dict(scale=1.0), **extra)
        # dq = ds @ k sums +-2500 * ds to O(ds): cancellation in any float32 code; not checked
        for name, a, b in (("out", out, ref[0]), ("dk", dk, ref[2]), ("dv", dv, ref[3])):
            a = to_np(a).astype(np.float64)
            assert a.dtype == np.float64 and to_np(out).dtype == np.float32
            err = np.max(np.abs(a - b)) / np.max(np.abs(b))
            # 2e-6: the float32 SDPA bound of docs/dtypes.md; one log-sum-exp m + log(l)
            # rounded to float32 at 1e4 gives 5e-4 here
            assert err < 2e-6, f"{impl} {extra}: {name} error {err:.2e}, expected float32 rounding"


# --------------------------------------------------------------------------
# half precision


def _err(x, x64):
    """err(x) = max |x - x64| / max |x64| (docs/dtypes.md)."""
    return float(np.max(np.abs(x.astype(np.float64) - x64)) / np.max(np.abs(x64)))


def test_float16_is_computed_in_float32_on_every_impl(backend, xp, to_xp, to_np):
    """float16 in: each implementation computes in float32 and rounds once (bit for bit the
    float32 run on the upcast inputs, rounded), within the documented SDPA bound of 1e-3."""
    if not hasattr(xp, "float16"):
        pytest.skip(f"{backend} has no float16")
    q, k, v, dout, kw = make_inputs(8, 2, 2, 2, 9, 6, 4, 3, mask_kind="float",
                                    mask_form="LqLk", causal=True, dtype=np.float16)
    up = [a.astype(np.float32) for a in (q, k, v, dout)]
    kw32 = dict(kw, mask=kw["mask"].astype(np.float32))
    out64, c64 = F.sdpa_forward(*(a.astype(np.float64) for a in (q, k, v)),
                                **dict(kw, mask=kw["mask"].astype(np.float64)))
    ref64 = (out64, *F.sdpa_backward(dout.astype(np.float64), c64))
    impls = [("reference", {}), ("blocked", dict(block_q=4, block_k=4))]
    if backend == "numpy":
        impls.append(("numpy", {}))
    for impl, extra in impls:
        out, c, grads = run(impl, *(to_xp(a) for a in (q, k, v, dout)), on(to_xp, kw), **extra)
        out32, c32, grads32 = run(impl, *(to_xp(a) for a in up), on(to_xp, kw32), **extra)
        if impl == "blocked":
            assert c.m.dtype == xp.float32 and c.l.dtype == xp.float32
        else:
            assert A.weights(c).dtype == xp.float32, impl  # softmax in float32
        for name, a, a32, a64 in zip(("out", "dq", "dk", "dv", "dmask"), (out, *grads),
                                     (out32, *grads32), ref64):
            assert a.dtype == xp.float16, f"{impl}: {name}"
            a = to_np(a)
            np.testing.assert_array_equal(a, to_np(a32).astype(np.float16),
                                          err_msg=f"{impl}: {name} not float32 rounded once")
            assert _err(a, a64) < 1e-3, f"{impl}: {name} error {_err(a, a64):.1e}"


# --------------------------------------------------------------------------
# finite differences on the dispatcher's pairs


@pytest.mark.parametrize("dropout", ["mask", "seed"])
@pytest.mark.parametrize("impl", ["reference", "blocked", "numpy"])
def test_gradcheck_every_impl(impl, dropout, backend, xp, to_xp, monkeypatch):
    """GQA (4 query heads on 2 K/V heads), Dv != Dh, float mask with -inf and an empty row,
    causal, dropout (a fixed keep-mask, or an int seed that redraws the same one)."""
    if impl == "numpy" and backend != "numpy":
        pytest.skip("the NumPy kernel takes NumPy arrays only")
    monkeypatch.setattr(numpy_kernel, "TILE_ELEMS", SMALL_TILES)
    q, k, v, _, kw = make_inputs(9, 2, 2, 2, 5, 4, 3, 2, mask_kind="float",
                                 mask_form="B1LqLk", dropout=dropout, causal=True)
    mask = kw.pop("mask")
    kwx = on(to_xp, kw)

    def forward(q, k, v, mask):
        return A.sdpa_forward(q, k, v, mask=mask, impl=impl, block_q=2, block_k=3, **kwx)

    report = gradcheck(forward, A.sdpa_backward, [to_xp(a) for a in (q, k, v, mask)],
                       names=["q", "k", "v", "mask"], mode="full" if backend == "numpy" else "vjp",
                       rtol=1e-6, seed=3)
    assert report.ok, str(report)
    assert {r.name for r in report.inputs} == {"q", "k", "v", "mask"}
    assert all(r.scale > 0 for r in report.inputs)  # nothing vanished


# --------------------------------------------------------------------------
# choosing the implementation


def test_check_impl():
    for impl in A.IMPLS:
        A.check_impl(impl)
    with pytest.raises(ValueError, match=r"impl: expected 'auto', .*'blocked'.* or 'chunked', got 'flash'"):
        A.check_impl("flash")
    # not a str: a TypeError, as for any argument of the wrong type (a one-element array
    # of a name is not the name)
    for impl, got in ((None, "got None"), (1, "got int 1"), (b"dense", "got bytes b'dense'"),
                      (np.array(["dense"]), "got numpy.ndarray")):
        with pytest.raises(TypeError, match=rf"impl: expected 'auto', .* or 'chunked', {got}"):
            A.check_impl(impl)
    with pytest.raises(ValueError, match="impl='blocked' cannot return attention weights"):
        A.check_impl("blocked", need_weights=True)
    for impl in ("auto", "dense", "reference", "numpy"):
        A.check_impl(impl, need_weights=True)


def _big(*shape):
    """A NumPy array of ``shape`` that holds no memory (a broadcast view), for select_impl."""
    return np.broadcast_to(np.zeros((), dtype=np.float32), shape)


# impl='blocked' with need_weights=True: the message whole (argument, value received, what to pass)
BLOCKED_KEEPS_NO_WEIGHTS = (r"^impl='blocked' cannot return attention weights \(it never forms them\); "
                            r"use need_weights=False, or impl='dense', 'reference', 'numpy' or 'auto'$")


def test_select_impl():
    small = _big(2, 4, 8, 8)
    assert A.select_impl("auto", small, small, small) == "numpy"
    assert A.select_impl("dense", small, small, small) == "numpy"
    assert A.select_impl("reference", small, small, small) == "reference"
    assert A.select_impl("blocked", small, small, small) == "blocked"
    assert A.select_impl("numpy", small, small, small) == "numpy"
    three = _big(4, 8, 8)  # not the kernel's 4-D layout: the reference
    assert A.select_impl("auto", three, three, three) == "reference"
    with pytest.raises(ValueError, match="impl='numpy'"):
        A.select_impl("numpy", three, three, three)
    wide = _big(2, 4, 8, 8)  # a mask that would grow the scores is not the kernel's
    assert A.select_impl("auto", small, small, small, mask=_big(3, 2, 4, 8, 8)) == "reference"
    assert A.select_impl("auto", small, small, small, mask=wide[0, 0] > 0) == "numpy"
    n = math.isqrt(A.AUTO_BLOCKED_MIN_SCORES) + 1  # one head with that many scores
    big = _big(1, 1, n, 8)
    assert A.select_impl("auto", big, big, big) == "blocked"
    assert A.select_impl("auto", big, big, big, need_weights=True) == "numpy"
    assert A.select_impl("dense", big, big, big) == "numpy"
    heads = A.AUTO_BLOCKED_MAX_DENSE_SCORES // (512 * 512)  # heads of 512 x 512 scores
    assert A.select_impl("auto", *[_big(1, heads - 1, 512, 8)] * 3) == "numpy"
    assert A.select_impl("auto", *[_big(1, heads, 512, 8)] * 3) == "blocked"
    assert A.select_impl("auto", *[_big(2, heads // 2, 512, 8)] * 3) == "blocked"
    assert A.select_impl("auto", *[_big(1, heads, 512, 8)] * 3, need_weights=True) == "numpy"
    with pytest.raises(ValueError, match=BLOCKED_KEEPS_NO_WEIGHTS):
        A.select_impl("blocked", small, small, small, need_weights=True)
    with pytest.raises(ValueError, match="^impl: expected 'auto', 'dense', 'reference', 'numpy', 'blocked' "
                                         "or 'chunked', got 'fast'$"):
        A.select_impl("fast", small, small, small)
    # a dropout mask that would grow the scores is not the kernel's either
    assert A.select_impl("auto", small, small, small, dropout_mask=_big(3, 2, 4, 8, 8) > 0) == "reference"
    # kernel options (plain=False): positional defaults to plain, so the kernel is not taken ...
    assert A.select_impl("auto", small, small, small, plain=False) == "reference"
    with pytest.raises(ValueError, match="^impl='numpy': the kernel options"):
        A.select_impl("numpy", small, small, small, plain=False)
    # ... unless they are a window or align only (positional), which the kernel takes
    assert A.select_impl("auto", small, small, small, plain=False, positional=True) == "numpy"


def test_select_impl_on_other_backends(backend, xp, to_xp):
    q = to_xp(np.zeros((1, 2, 3, 4)))
    if backend == "numpy":
        assert A.select_impl("auto", q, q, q) == "numpy"
        return
    assert A.select_impl("auto", q, q, q) == "reference"
    assert A.select_impl("dense", q, q, q) == "reference"
    with pytest.raises(ValueError, match="impl='numpy'.*NumPy arrays"):
        A.select_impl("numpy", q, q, q)
    with pytest.raises(ValueError, match="impl='numpy'"):
        A.sdpa_forward(q, q, q, impl="numpy")
    mask = np.ones((3, 3), dtype=bool)  # NumPy arrays with a NumPy mask: the kernel
    assert A.select_impl("auto", *[np.zeros((1, 2, 3, 4))] * 3, mask=mask) == "numpy"
    # NumPy arrays among the backend's are not the kernel's (sdpa_forward's input check refuses
    # such a mix first; select_impl and the kernel's accepts give their own answer)
    n = np.zeros((1, 2, 3, 4))
    with pytest.raises(ValueError, match="impl='numpy'"):
        A.select_impl("numpy", n, q, q)
    assert not any(numpy_kernel.accepts(*a) for a in ((n, q, q), (q, n, n), (n, n, q)))
    assert not numpy_kernel.accepts(n, n, n, to_xp(mask))
    assert not numpy_kernel.accepts(n, n, n, None, to_xp(mask))


def test_a_numpy_subclass_is_not_the_kernels(tmp_path):
    """The NumPy kernel and its tile pool take plain numpy.ndarray only (is_numpy_array): an
    ndarray subclass runs on the reference under "auto" and "dense", and impl="numpy" is
    refused by name."""
    Sub = type("Sub", (np.ndarray,), {})
    q = np.zeros((1, 2, 3, 4))
    sub = q.view(Sub)
    assert npb.is_numpy_array(q) and not npb.is_numpy_array(sub)
    assert A.select_impl("auto", q, q, q) == "numpy"
    for impl in ("auto", "dense"):
        assert A.select_impl(impl, sub, q, q) == "reference"
        assert A.select_impl(impl, q, q, q, mask=np.ones((3, 3), bool).view(Sub)) == "reference"
    with pytest.raises(ValueError, match="^impl='numpy': the NumPy kernel takes NumPy arrays"):
        A.sdpa_forward(q, q, sub, impl="numpy")
    # the refusal names the array of the other type (it said "got numpy.ndarray of shapes ...",
    # q's type, for a memmap k or a subclass mask)
    mm = np.memmap(tmp_path / "k.dat", dtype=q.dtype, mode="w+", shape=q.shape)
    with pytest.raises(ValueError, match=r"got q numpy\.ndarray, k numpy\.memmap, v numpy\.ndarray; q, k, v "
                                         r"of shapes \(1, 2, 3, 4\), \(1, 2, 3, 4\), \(1, 2, 3, 4\); use"):
        A.sdpa_forward(q, mm, q, impl="numpy")
    with pytest.raises(ValueError, match=r"got q numpy\.ndarray, k numpy\.ndarray, v numpy\.ndarray, "
                                         r"mask \S*Sub; q, k, v of shapes"):
        A.sdpa_forward(q, q, q, mask=np.ones((3, 3), bool).view(Sub), impl="numpy")
    keep = np.ones((1, 2, 3, 3), bool).view(Sub)  # a dropout_mask of the other type is named as well
    with pytest.raises(ValueError, match=r"got q numpy\.ndarray, k numpy\.ndarray, v numpy\.ndarray, "
                                         r"dropout_mask \S*Sub; q, k, v of shapes"):
        A.sdpa_forward(q, q, q, dropout_p=0.5, dropout_mask=keep, impl="numpy")


def test_numpy_kernel_refusal_names_the_head_count():
    """Zero heads run on the other implementations (empty outputs); impl="numpy" needs at least
    one K/V head, and its refusal says so rather than list a layout the arrays already have."""
    q, k = np.zeros((2, 0, 3, 4)), np.zeros((2, 0, 5, 4))
    for impl in ("reference", "dense", "blocked"):
        assert A.sdpa_forward(q, k, k, impl=impl)[0].shape == (2, 0, 3, 4)
    with pytest.raises(ValueError, match=r"^impl='numpy': .* with Hkv >= 1 dividing Hq, .*"
                       r"got numpy\.ndarray of shapes \(2, 0, 3, 4\), \(2, 0, 5, 4\)"):
        A.sdpa_forward(q, k, k, impl="numpy")


def test_dout_is_checked_on_every_implementation():
    """sdpa_backward takes the dout of the forward's out, (B, Hq, Lq, Dv) in its dtype, whichever
    implementation made the cache: the NumPy kernel's and the blocked backward (which the
    dispatcher checks for them) promoted a float32 or int64 dout silently and failed on a wrong
    shape with a NumPy broadcast or reshape error that named nothing."""
    r = np.random.default_rng(13)
    q, k, v = r.standard_normal((2, 2, 5, 3)), r.standard_normal((2, 2, 6, 3)), r.standard_normal((2, 2, 6, 4))
    for impl in ("numpy", "blocked", "reference"):
        out, cache = A.sdpa_forward(q, k, v, impl=impl)
        for bad in (out.astype(np.float32), np.ones(out.shape, dtype=np.int64)):
            with pytest.raises(TypeError, match=f"^dout: expected dtype float64 .*got {bad.dtype}"):
                A.sdpa_backward(bad, cache)
        for bad in (out[:, :, :4], out[:1], out[..., :3]):
            with pytest.raises(ValueError, match=r"^dout: expected shape \(2, 2, 5, 4\) .*got "
                                                 + re.escape(str(bad.shape))):
                A.sdpa_backward(bad, cache)
        with pytest.raises(TypeError, match="^dout: expected a numpy array, got list"):
            A.sdpa_backward(out.tolist(), cache)


def test_dlse_is_checked_on_every_implementation():
    """sdpa_backward takes a dlse of cache.lse's shape (B, Hq, Lq) and dtype whichever
    implementation made the cache, and names it otherwise, as it does dout."""
    r = np.random.default_rng(14)
    q, k, v = (r.standard_normal(s) for s in ((2, 2, 5, 3), (2, 2, 6, 3), (2, 2, 6, 4)))
    for impl in ("numpy", "blocked", "reference"):
        out, cache = A.sdpa_forward(q, k, v, impl=impl)
        dout, dlse = r.standard_normal(out.shape), r.standard_normal((2, 2, 5))
        for bad in (dlse[:, :, :4], dlse[:1], dlse[..., None]):
            with pytest.raises(ValueError, match=r"^dlse: expected shape \(2, 2, 5\) .*got "
                                                 + re.escape(str(bad.shape))):
                A.sdpa_backward(dout, cache, dlse=bad)
        with pytest.raises(TypeError, match="^dlse: expected dtype float64 .*got float32"):
            A.sdpa_backward(dout, cache, dlse=dlse.astype(np.float32))
        with pytest.raises(TypeError, match="^dlse: expected a numpy array, got list"):
            A.sdpa_backward(dout, cache, dlse=dlse.tolist())


def test_dispatcher_refuses_before_computing(backend, xp, to_xp, to_np):
    q, k, v, dout, kw = make_inputs(10, 1, 2, 1, 3, 4, 2, 2, dropout="seed")
    q, k, v, dout = to_xp(q), to_xp(k), to_xp(v), to_xp(dout)
    with pytest.raises(ValueError, match=BLOCKED_KEEPS_NO_WEIGHTS):
        A.sdpa_forward(q, k, v, impl="blocked", need_weights=True, **kw)
    with pytest.raises(ValueError, match="^impl: expected 'auto', 'dense', 'reference', 'numpy', 'blocked' "
                                         "or 'chunked', got 'flash'$"):
        A.sdpa_forward(q, k, v, impl="flash", **kw)
    gen = np.random.default_rng(1)
    state = gen.bit_generator.state
    with pytest.raises(ValueError, match=BLOCKED_KEEPS_NO_WEIGHTS):
        A.sdpa_forward(q, k, v, impl="blocked", need_weights=True, dropout_p=0.5, rng=gen)
    assert gen.bit_generator.state == state  # refused before the dropout key was drawn
    _, c = A.sdpa_forward(q, k, v, impl="blocked", **kw)
    no_weights = (r"^cache: expected the cache of a dense implementation \(it keeps the attention "
                  r"weights\), got BlockedSDPACache: the blocked implementation keeps no attention weights$")
    with pytest.raises(ValueError, match=no_weights):
        A.weights(c)
    for impl in ("reference", "dense", "auto"):
        _, c = A.sdpa_forward(q, k, v, impl=impl, **kw)
        assert tuple(A.weights(c).shape) == (1, 2, 3, 4)
    softmax_cache = F.SoftmaxCache(None, None, None)
    for bad, name in ((None, "None"), ((1, 2), "tuple"), (softmax_cache, "npattn.SoftmaxCache")):
        expected = "^cache: expected the cache of an sdpa_forward, got " + re.escape(name) + "$"
        with pytest.raises(TypeError, match=expected):
            A.sdpa_backward(dout, bad)
        with pytest.raises(TypeError, match=expected):
            A.dropout_keep_mask(bad)
        with pytest.raises(TypeError, match=expected):  # (None.probs raised AttributeError)
            A.weights(bad)
    _, c = A.sdpa_forward(q, k, v, impl="blocked")
    assert A.dropout_keep_mask(c) is None
    with pytest.raises(TypeError, match="^need_weights: expected a bool, got str 'no'"):
        A.sdpa_forward(q, k, v, need_weights="no")  # (taken as True where impl="auto" chose)
    # k or v of fewer than 2 axes: named (k.shape[-1] and v.shape[-2] raised IndexError)
    for impl in ("reference", "blocked", "auto"):
        with pytest.raises(ValueError, match=r"^k: expected at least 2 axes \(\.\.\., Lk, Dh\), got shape \(2,\)"):
            A.sdpa_forward(q, k[0, 0, 0, ...], v, impl=impl)
        with pytest.raises(ValueError, match=r"^v: expected at least 2 axes \(\.\.\., Lk, Dv\), got shape \(\)"):
            A.sdpa_forward(q, k, v[0, 0, 0, 0], impl=impl)


@pytest.mark.parametrize("impl", ["reference", "numpy", "blocked"])
def test_dispatcher_names_a_bad_rng_or_dropout_p_and_draws_nothing(impl):
    """A bad rng or dropout_p is refused by the dispatcher's checks, naming the argument,
    before the dropout key is drawn: not later by NumPy's seeding (a message that names
    nothing) or by the keep-mask draw (which names ``p``)."""
    r = np.random.default_rng(2)
    q, k, v = (r.standard_normal(s) for s in ((1, 2, 3, 4), (1, 2, 5, 4), (1, 2, 5, 3)))
    with pytest.raises(TypeError, match="^rng: expected None, a non-negative int seed"):
        A.sdpa_forward(q, k, v, impl=impl, dropout_p=0.5, rng="seed")
    with pytest.raises(TypeError, match="^rng: expected None"):  # whatever dropout_p
        A.sdpa_forward(q, k, v, impl=impl, rng=1.5)
    gen = np.random.default_rng(1)
    state = gen.bit_generator.state
    for p in (1.5, 1.0, -0.1):
        with pytest.raises(ValueError, match=r"^dropout_p: expected .*\[0, 1\)"):
            A.sdpa_forward(q, k, v, impl=impl, dropout_p=p, rng=gen)
    assert gen.bit_generator.state == state


@pytest.mark.parametrize("impl", ["reference", "numpy", "blocked", "auto"])
def test_block_sizes_are_checked_on_every_impl_before_the_draw(impl):
    """block_q and block_k are checked by the dispatcher whatever implementation runs (those
    that do not use them included), naming the argument, before the dropout key is drawn."""
    r = np.random.default_rng(3)
    q, k, v = (r.standard_normal(s) for s in ((1, 2, 3, 4), (1, 2, 5, 4), (1, 2, 5, 3)))
    gen = np.random.default_rng(1)
    state = gen.bit_generator.state
    for name in ("block_q", "block_k"):
        for bad, exc in ((0, ValueError), (-2, ValueError), (2.5, TypeError), (True, TypeError)):
            with pytest.raises(exc, match=f"^{name}: expected"):
                A.sdpa_forward(q, k, v, impl=impl, dropout_p=0.5, rng=gen, **{name: bad})
    assert gen.bit_generator.state == state


@pytest.mark.parametrize("impl", ["reference", "numpy", "blocked"])
def test_a_forward_with_dropout_takes_one_64_bit_word_from_the_generator(impl):
    """One key per forward (docs/conventions.md), a 63-bit integer: one 64-bit word of the
    caller's bit generator, whichever implementation runs, so the caller's later draws do not
    depend on it. A forward without dropout takes nothing."""
    r = np.random.default_rng(6)
    q, k, v = (r.standard_normal(s) for s in ((2, 2, 5, 3), (2, 2, 7, 3), (2, 2, 7, 4)))
    gen, twin = np.random.default_rng(8), np.random.default_rng(8)
    blocks = dict(block_q=2, block_k=3) if impl == "blocked" else {}
    A.sdpa_forward(q, k, v, impl=impl, dropout_p=0.3, rng=gen, **blocks)
    twin.bit_generator.random_raw()  # one word
    assert gen.bit_generator.state == twin.bit_generator.state
    A.sdpa_forward(q, k, v, impl=impl, rng=gen, **blocks)
    assert gen.bit_generator.state == twin.bit_generator.state


def test_linear_backwards_hands_the_pooled_pairs_to_the_pool_once_and_the_rest_to_functional(
        monkeypatch):
    """Of several projections, those large enough for the tile pool go to it together, in one
    hand-off, and only the others to ``functional.linear_backward``; every pair's gradients
    are dx = dy w, dw = dy^T x over all rows, db = the sum of dy over them (by hand)."""
    monkeypatch.setattr(numpy_kernel, "POOL_MIN_LINEAR", 60)  # x.size * out features
    r = np.random.default_rng(9)
    shapes = [((2, 3, 5), 4), ((1, 2, 5), 3), ((4, 4, 5), 2)]  # 120 and 24 and 160 multiply-adds
    pairs, hand = [], []
    for xs, n in shapes:
        x, w, b = r.standard_normal(xs), r.standard_normal((n, 5)), r.standard_normal(n)
        y, cache = A.linear_forward(x, w, b)
        dy = r.standard_normal(y.shape)
        pairs.append((dy, cache))
        dy2, x2 = dy.reshape(-1, n), x.reshape(-1, 5)
        hand.append((dy @ w, dy2.T @ x2, dy2.sum(axis=0)))
    to_functional, to_pool = [], []
    real_f, real_pool = F.linear_backward, numpy_kernel.linear_backwards
    monkeypatch.setattr(F, "linear_backward", lambda dy, c: to_functional.append(c.x.shape) or real_f(dy, c))
    monkeypatch.setattr(numpy_kernel, "linear_backwards",
                        lambda ps: to_pool.append([c.x.shape for _, c in ps]) or real_pool(ps))
    got = A.linear_backwards(pairs)
    assert to_pool == [[(2, 3, 5), (4, 4, 5)]] and to_functional == [(1, 2, 5)]
    for g, h in zip(got, hand):
        for a, e in zip(g, h):
            np.testing.assert_allclose(a, e, rtol=1e-12, atol=1e-12)


def test_linear_backwards_names_what_is_not_a_pair(monkeypatch):
    """What is not an iterable of (dy, cache) pairs is refused by name, before any pair is
    computed (a 3-tuple raised Python's "too many values to unpack")."""
    r = np.random.default_rng(10)
    y, cache = A.linear_forward(r.standard_normal((2, 3)), r.standard_normal((4, 3)))
    ran = []
    monkeypatch.setattr(F, "linear_backward", lambda dy, c: ran.append(c))
    good = (r.standard_normal(y.shape), cache)
    for pairs, expected in ((None, r"^pairs: expected an iterable of \(dy, cache\) pairs, got None$"),
                            ([good, good + (1,)], r"^pairs\[1\]: expected a \(dy, cache\) pair, got tuple "
                                                  r"of length 3$"),
                            ([good, y], r"^pairs\[1\]: expected a \(dy, cache\) pair, got numpy.ndarray")):
        with pytest.raises(TypeError, match=expected):
            A.linear_backwards(pairs)
    assert ran == []


# --------------------------------------------------------------------------
# the NumPy kernel's hygiene


def _arrays(cache):
    return [(n, a) for n, a in cache._asdict().items() if isinstance(a, np.ndarray)]


def _hygiene_inputs(dropout, monkeypatch):
    monkeypatch.setattr(numpy_kernel, "TILE_ELEMS", SMALL_TILES)
    monkeypatch.setattr(numpy_kernel, "POOL_MIN_SCORES", 0)
    monkeypatch.setenv("NPATTN_NUM_THREADS", "2")
    return make_inputs(11, 2, 2, 2, 6, 7, 4, 3, mask_kind="float", mask_form="B1LqLk",
                       dropout=dropout, causal=True)


@pytest.mark.parametrize("dropout", ["mask", "seed"])
@pytest.mark.parametrize("impl", ["numpy", "blocked", "reference"])
def test_never_writes_into_inputs_dout_or_cache(impl, dropout, monkeypatch):
    """Read-only inputs and dout work; backward leaves the cache as the forward made it (read-only
    too), gives bitwise the same gradients twice, and none of them alias another."""
    q, k, v, dout, kw = _hygiene_inputs(dropout, monkeypatch)
    given_ = [q, k, v, dout] + [a for a in kw.values() if isinstance(a, np.ndarray)]
    before = [a.copy() for a in given_]
    for a in given_:
        a.setflags(write=False)  # any write into them raises
    out, cache = A.sdpa_forward(q, k, v, impl=impl, block_q=4, block_k=3, **kw)
    saved = [(n, a.copy()) for n, a in _arrays(cache)]
    for _, a in _arrays(cache):
        a.setflags(write=False)
    g1 = A.sdpa_backward(dout, cache)
    g1_copy = [None if g is None else g.copy() for g in g1]
    for g in g1:
        if g is not None:
            g[...] = -3.0  # the caller owns the gradients
    g2 = A.sdpa_backward(dout, cache)
    for a, b in zip(before, given_):
        np.testing.assert_array_equal(a, b)
    for (n, a), (_, b) in zip(saved, _arrays(cache)):
        np.testing.assert_array_equal(a, b, err_msg=f"cache.{n}")
    for a, b in zip(g1_copy, g2):
        np.testing.assert_array_equal(a, b)
    ref_out, ref_c = F.sdpa_forward(q, k, v, **kw)
    assert_close(out, ref_out, np.asarray, "out")
    for name, a, b in zip(("dq", "dk", "dv", "dmask"), g2, F.sdpa_backward(dout, ref_c)):
        assert_close(a, b, np.asarray, name)


@pytest.mark.parametrize("impl", ["numpy", "reference", "blocked"])
def test_writing_into_the_output_changes_no_gradient(impl, monkeypatch):
    q, k, v, dout, kw = _hygiene_inputs("seed", monkeypatch)
    out, cache = A.sdpa_forward(q, k, v, impl=impl, block_q=4, block_k=3, **kw)
    expected = A.sdpa_backward(dout, A.sdpa_forward(q, k, v, impl=impl, block_q=4, block_k=3,
                                                    **kw)[1])
    out[...] = 7.0  # the caller owns the output
    for a, b in zip(A.sdpa_backward(dout, cache), expected):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("dtype", [np.float64, np.float16])
def test_the_kernel_returns_out_and_gradients_in_the_merged_layout(dtype):
    """The NumPy kernel writes out, dq, dk and dv in the merged (B, L, H, D) layout of the
    heads (GQA, Lq != Lk, float64 and float16): merging their heads is a reshape that shares
    their memory, not a copy."""
    q, k, v, dout, kw = make_inputs(9, 2, 2, 2, 5, 7, 4, 3, mask_kind="bool", dtype=dtype)
    out, cache = A.sdpa_forward(q, k, v, impl="numpy", **kw)
    dq, dk, dv = A.sdpa_backward(dout, cache)[:3]
    for name, a in (("out", out), ("dq", dq), ("dk", dk), ("dv", dv)):
        assert a.dtype == dtype, name
        merged, _ = F.merge_heads_forward(a)  # [B, L, H * D]
        assert np.shares_memory(merged, a), name


# --------------------------------------------------------------------------
# the module on every implementation


def _module_impls(backend_name):
    names = ["reference", "dense", "auto", "blocked"]
    return names + (["numpy"] if backend_name == "numpy" else [])


@pytest.mark.parametrize("mask_kind", ["bool", "float"])
def test_module_every_impl_matches_reference(mask_kind, backend, xp, to_xp, to_np, monkeypatch):
    """Dropout from the module's seeded generator (two steps: the generator moves on alike),
    GQA (n_kv_head), a mask with a fully masked row, causal; weights where the impl has them."""
    monkeypatch.setattr(numpy_kernel, "TILE_ELEMS", SMALL_TILES)
    monkeypatch.setattr(numpy_kernel, "POOL_MIN_SCORES", 0)
    r = np.random.default_rng(12)
    x, mem = to_xp(r.standard_normal((2, 6, 12))), to_xp(r.standard_normal((2, 5, 12)))
    mask = to_xp(make_mask(r, mask_kind, (2, 1, 6, 5)))
    douts = [to_xp(r.standard_normal((2, 6, 12))) for _ in range(2)]
    params = {}

    def steps(impl, dropout=0.3):
        m = MultiHeadAttention(12, 4, n_kv_head=2, dropout=dropout, dtype="float64", seed=4,
                               backend=backend, impl=impl)
        if not params:  # non-zero biases, the same for every module
            r2 = np.random.default_rng(13)
            params.update({n: r2.standard_normal(tuple(a.shape)) * 0.5
                           for n, a in m.params.items()})
        m.params = {n: to_xp(a) for n, a in params.items()}
        res = []
        for step, dout in enumerate(douts):
            weights = impl != "blocked"
            out, w = m(x, mem, mem, mask=mask, is_causal=step == 0, need_weights=weights,
                       average_attn_weights=False)
            dinputs = m.backward(dout)
            res.append(dict(out=out, w=w, dmask=m.dmask, **dict(zip(("dq", "dk", "dv"), dinputs)),
                            **{"d" + n: g for n, g in m.grads.items()}))
        return res

    ref = steps("reference")
    for impl in _module_impls(backend)[1:]:
        for step, (got, want) in enumerate(zip(steps(impl), ref)):
            assert got.keys() == want.keys()
            for name in want:
                if name == "w" and got["w"] is None:  # blocked: no weights
                    continue
                assert_close(got[name], want[name], to_np, f"{impl}, step {step}: {name}")
    # dropout acted (the two steps are not those without dropout)
    for got, want in zip(steps("reference", dropout=0.0), ref):
        assert not np.allclose(to_np(got["out"]), to_np(want["out"]))


@pytest.mark.parametrize("impl", ["reference", "blocked", "dense"])
def test_module_self_attention_fused_projection(impl, backend, xp, to_xp, to_np):
    """query is key is value: one (3D, D) GEMM; the same numbers as three projections."""
    m = MultiHeadAttention(12, 3, dtype="float64", seed=0, backend=xp, impl=impl)
    r = np.random.default_rng(8)
    for name, val in m.params.items():  # non-zero biases, so that they are tested
        if name.startswith("b_"):
            m.params[name] = to_xp(r.standard_normal(val.shape))
    x_np = r.standard_normal((2, 5, 12))
    dout = to_xp(r.standard_normal((2, 5, 12)))
    x = to_xp(x_np)
    out_fused = to_np(m(x, x, x, is_causal=True)[0])
    d_fused = [to_np(g) for g in m.backward(dout)]
    g_fused = {k: to_np(g) for k, g in m.grads.items()}
    out_sep = to_np(m(x, to_xp(x_np), to_xp(x_np), is_causal=True)[0])  # three projections
    d_sep = [to_np(g) for g in m.backward(dout)]
    assert_close(out_fused, out_sep, np.asarray, "out")
    for a, b in zip(d_fused, d_sep):
        assert_close(a, b, np.asarray, "dinput")
    for name, g in m.grads.items():
        assert_close(g_fused[name], to_np(g), np.asarray, name)


@pytest.mark.parametrize("impl", ["reference", "numpy", "blocked"])
def test_dropout_without_a_generator_still_drops(impl):
    """``dropout_p > 0`` with ``rng=None`` draws a mask from fresh entropy: some entries are
    dropped, and out and dv are those of that mask, by the formula written out here:
    ``a = where(keep, p / (1 - p_drop), 0)``, ``out = a v``, ``dv = a^T dout``."""
    gen = np.random.default_rng(11)
    q = gen.standard_normal((2, 2, 5, 3))  # [B, H, Lq, Dh]
    k = gen.standard_normal((2, 2, 6, 3))  # [B, H, Lk, Dh]
    v = gen.standard_normal((2, 2, 6, 4))  # [B, H, Lk, Dv]
    dout = gen.standard_normal((2, 2, 5, 4))  # [B, H, Lq, Dv]
    extra = dict(block_q=2, block_k=4) if impl == "blocked" else {}
    out, cache = A.sdpa_forward(q, k, v, impl=impl, dropout_p=0.5, rng=None, **extra)
    keep = A.dropout_keep_mask(cache)  # [B, H, Lq, Lk]
    # 120 entries at p = 0.5: all kept (or all dropped) has probability 2**-120
    assert keep is not None and keep.any() and not keep.all()
    s = q @ np.swapaxes(k, -1, -2) / math.sqrt(3)  # [B, H, Lq, Lk]
    p = np.exp(s - s.max(axis=-1, keepdims=True))
    p /= p.sum(axis=-1, keepdims=True)
    a = np.where(keep, p / 0.5, 0.0)  # [B, H, Lq, Lk]
    np.testing.assert_allclose(out, a @ v, rtol=1e-12, atol=1e-12)
    dv = A.sdpa_backward(dout, cache).dv
    np.testing.assert_allclose(dv, np.swapaxes(a, -1, -2) @ dout, rtol=1e-12, atol=1e-12)
