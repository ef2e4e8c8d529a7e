"""Grouped-query attention in ``sdpa_forward(..., enable_gqa=True)``.

Query head h uses K/V head h // G with G = Hq // Hkv (SDPA's semantics); the
backward sums dk and dv over each group. Checked by central differences on
every backend, against an explicit repeat of K/V, and against torch's
``F.scaled_dot_product_attention(..., enable_gqa=True)``.
"""

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from npattn import MultiHeadAttention
from npattn import attention as A
from npattn import functional as F
from npattn.gradcheck import gradcheck


def _inputs(rng, B=2, Hq=4, Hkv=2, Lq=3, Lk=5, Dh=3, Dv=None):
    Dv = Dh if Dv is None else Dv
    q = rng.standard_normal((B, Hq, Lq, Dh))
    k = rng.standard_normal((B, Hkv, Lk, Dh))
    v = rng.standard_normal((B, Hkv, Lk, Dv))
    return q, k, v


def _bool_mask_with_empty_row(rng, shape):
    m = rng.random(shape) < 0.7  # [..., Lq, Lk]
    m[..., 0, :] = False  # query 0: nothing to attend, in every head
    return m


@pytest.mark.parametrize("mask_kind", ["none", "bool_per_qhead", "float_lq_lk", "padding"])
def test_gqa_gradcheck_every_backend(xp, to_xp, to_np, mask_kind):
    rng = np.random.default_rng(1)
    B, Hq, Hkv, Lq, Lk = 2, 4, 2, 3, 5
    q, k, v = _inputs(rng, B, Hq, Hkv, Lq, Lk)
    if mask_kind == "none":
        mask = None
    elif mask_kind == "bool_per_qhead":
        mask = _bool_mask_with_empty_row(rng, (B, Hq, Lq, Lk))
    elif mask_kind == "float_lq_lk":
        mask = rng.standard_normal((Lq, Lk))
        mask[1, 2:] = -math.inf
    else:
        mask = np.ones((B, 1, 1, Lk), dtype=bool)
        mask[1, ..., 3:] = False
    keep = rng.random((B, Hq, Lq, Lk)) >= 0.3  # p > 0 with a fixed keep-mask
    keep_x = to_xp(keep)
    mask_x = to_xp(mask)
    float_mask = mask is not None and mask.dtype != bool

    def fwd(q, k, v, *m):
        return F.sdpa_forward(
            q, k, v, mask=m[0] if m else mask_x, enable_gqa=True,
            dropout_p=0.3, dropout_mask=keep_x,
        )

    def bwd(dout, cache):
        dq, dk, dv, dmask, _ = F.sdpa_backward(dout, cache)
        return (dq, dk, dv, dmask) if float_mask else (dq, dk, dv)

    inputs = [to_xp(q), to_xp(k), to_xp(v)] + ([mask_x] if float_mask else [])
    if float_mask:
        # finite differences cannot step a -inf entry; check the mask only where finite
        report = gradcheck(fwd, bwd, inputs, names=["q", "k", "v", "mask"], wrt=[0, 1, 2], seed=3)
    else:
        report = gradcheck(fwd, bwd, inputs, names=["q", "k", "v"], seed=3)
    assert report.ok, str(report)

    out, cache = fwd(*inputs)
    assert tuple(out.shape) == (B, Hq, Lq, 3)
    assert tuple(cache.probs.shape) == (B, Hq, Lq, Lk)
    dq, dk, dv, _, _ = F.sdpa_backward(to_xp(rng.standard_normal((B, Hq, Lq, 3))), cache)
    assert tuple(dk.shape) == (B, Hkv, Lk, 3) and tuple(dv.shape) == (B, Hkv, Lk, 3)
    if mask_kind == "bool_per_qhead":
        # a query with nothing to attend: zero weights, zero output, zero dq
        assert np.all(to_np(cache.probs)[:, :, 0, :] == 0.0)
        assert np.all(to_np(out)[:, :, 0, :] == 0.0)
        assert np.all(to_np(dq)[:, :, 0, :] == 0.0)
        assert np.all(np.isfinite(to_np(dk))) and np.all(np.isfinite(to_np(dv)))


def test_gqa_float_mask_gradient(xp, to_xp):
    """dmask of a per-query-head float mask, by central differences (finite entries)."""
    rng = np.random.default_rng(2)
    q, k, v = _inputs(rng, B=2, Hq=6, Hkv=2, Lq=2, Lk=3)
    mask = rng.standard_normal((1, 6, 2, 3))

    def fwd(q, k, v, m):
        return F.sdpa_forward(q, k, v, mask=m, enable_gqa=True, is_causal=True)

    report = gradcheck(fwd, F.sdpa_backward, [to_xp(q), to_xp(k), to_xp(v), to_xp(mask)],
                       names=["q", "k", "v", "mask"], seed=4)
    assert report.ok, str(report)


@settings(max_examples=15)
@given(
    # sizes of at least 2 (G: grouped), MQA's Hkv = 1 kept
    Hkv=st.integers(1, 3), G=st.integers(2, 3), Lq=st.integers(2, 5), Lk=st.integers(2, 5),
    Dh=st.integers(2, 4), Dv=st.integers(2, 4), causal=st.booleans(), seed=st.integers(0, 2**16),
)
def test_gqa_equals_repeated_kv(Hkv, G, Lq, Lk, Dh, Dv, causal, seed):
    """enable_gqa equals plain attention with K/V heads repeated (repeat_interleave),
    and its dk/dv equal the repeated gradients summed over each group."""
    Lk += Lk == Lq  # Lq != Lk
    rng = np.random.default_rng(seed)
    Hq = Hkv * G
    q, k, v = _inputs(rng, 2, Hq, Hkv, Lq, Lk, Dh, Dv)
    mask = rng.random((2, Hq, Lq, Lk)) < 0.6
    out, cache = F.sdpa_forward(q, k, v, mask=mask, is_causal=causal, enable_gqa=True)
    kr, vr = np.repeat(k, G, axis=1), np.repeat(v, G, axis=1)  # [B, Hq, Lk, .]
    ref, ref_cache = F.sdpa_forward(q, kr, vr, mask=mask, is_causal=causal)
    np.testing.assert_allclose(out, ref, rtol=1e-12, atol=1e-14)
    np.testing.assert_allclose(cache.probs, ref_cache.probs, rtol=1e-12, atol=1e-14)
    dout = rng.standard_normal(out.shape)
    dq, dk, dv, _, _ = F.sdpa_backward(dout, cache)
    rq, rk, rv, _, _ = F.sdpa_backward(dout, ref_cache)
    np.testing.assert_allclose(dq, rq, rtol=1e-12, atol=1e-13)
    np.testing.assert_allclose(dk, rk.reshape(2, Hkv, G, Lk, Dh).sum(axis=2), rtol=1e-12, atol=1e-13)
    np.testing.assert_allclose(dv, rv.reshape(2, Hkv, G, Lk, Dv).sum(axis=2), rtol=1e-12, atol=1e-13)


def test_gqa_bad_head_counts():
    """Each refusal names the argument, what was expected and what was received."""
    rng = np.random.default_rng(0)
    q, k, v = _inputs(rng, Hq=4, Hkv=3)
    with pytest.raises(ValueError, match=r"^k: with enable_gqa the query heads Hq=4 must be a multiple of "
                                         r"the key/value heads, got Hkv=3$"):
        F.sdpa_forward(q, k, v, enable_gqa=True)
    q, k, v = _inputs(rng, Hq=4, Hkv=2)
    with pytest.raises(ValueError, match=r"^q: expected at least one query head per key/value head "
                                         r"with enable_gqa \(Hkv=2\), got Hq=0$"):
        F.sdpa_forward(q[:, :0], k, v, enable_gqa=True)  # (0 is a multiple of 2, but G = 0)
    q, k, v = _inputs(rng, Hq=4, Hkv=2, Dv=2)  # v's shape differs from k's: the message names both
    with pytest.raises(ValueError, match=r"^v: expected 2 heads like k with enable_gqa, got shape "
                                         r"\(2, 1, 5, 2\)$"):
        F.sdpa_forward(q, k, v[:, :1], enable_gqa=True)
    with pytest.raises(ValueError, match=r"^q, k, v: expected batch axes \(before the head axis\) that "
                                         r"broadcast against each other with enable_gqa, got shapes "
                                         r"\(2, 4, 3, 3\), \(3, 2, 5, 3\), \(3, 2, 5, 2\)$"):
        F.sdpa_forward(q, np.concatenate([k, k[:1]]), np.concatenate([v, v[:1]]), enable_gqa=True)  # 2 vs 3
    # fewer K/V heads without enable_gqa: 2 heads do not broadcast to 4, and the error names k
    for sdpa in (F.sdpa_forward, A.sdpa_forward):
        with pytest.raises(ValueError, match=r"^k: expected leading axes that broadcast with those "
                                             r"of q \(2, 4\) \(and k\), got shape \(2, 2, 5, 3\); "
                                             r"with enable_gqa=True, 2 key/value heads would serve 4 "
                                             r"query heads$"):
            sdpa(q, k, v)
    # heads that do not divide q's: no such hint (3 heads cannot serve 4)
    with pytest.raises(ValueError, match=r"^k: expected leading axes that broadcast with those "
                                         r"of q \(2, 4\) \(and k\), got shape \(2, 3, 5, 3\)$"):
        F.sdpa_forward(q, np.concatenate([k, k[:, :1]], axis=1), np.concatenate([v, v[:, :1]], axis=1))
    # ... nor heads of k and v that differ, or v's batch axes that do not broadcast
    for k2, v2 in ((np.concatenate([k, k], axis=1), v), (k, np.concatenate([v, v], axis=1)),
                   (k[:, :1], v), (k, np.concatenate([v, v[:1]]))):
        with pytest.raises(ValueError, match=r"^[kv]: expected leading axes that broadcast with those "
                                             r"of q \(2, 4\) \(and k\), got shape \([0-9, ]+\)$"):
            F.sdpa_forward(q, k2, v2)
    # ... nor batch axes that do not broadcast (enable_gqa would not help)
    with pytest.raises(ValueError, match=r"^k: expected leading axes that broadcast with those "
                                         r"of q \(2, 4\) \(and k\), got shape \(3, 2, 5, 3\)$"):
        F.sdpa_forward(q, np.concatenate([k, k[:1]]), np.concatenate([v, v[:1]]))


# --------------------------------------------------------------------------
# parity with torch's SDPA


def _rel(a, b):
    a, b = np.asarray(a), np.asarray(b)
    return float(np.max(np.abs(a - b)) / max(np.max(np.abs(b)), 1e-300))


@settings(max_examples=10)
@given(
    Hkv=st.integers(1, 3), G=st.integers(2, 3), Lq=st.integers(2, 5), Lk=st.integers(2, 5),
    mask_kind=st.sampled_from(["none", "bool", "float", "causal"]),
    use_scale=st.booleans(), seed=st.integers(0, 2**16),
)
def test_gqa_torch_parity(Hkv, G, Lq, Lk, mask_kind, use_scale, seed):
    torch = pytest.importorskip("torch")
    Lk += Lk == Lq  # Lq != Lk
    rng = np.random.default_rng(seed)
    Hq, Dh = Hkv * G, 4
    q, k, v = _inputs(rng, 2, Hq, Hkv, Lq, Lk, Dh)
    mask, is_causal = None, False
    if mask_kind == "bool":
        mask = rng.random((2, 1, Lq, Lk)) < 0.7
        mask[..., 0] = True  # torch gives NaN on a fully masked row; npattn gives 0
    elif mask_kind == "float":
        mask = rng.standard_normal((Hq, Lq, Lk))
    elif mask_kind == "causal":
        is_causal = True  # top-left: every row sees key 0, so no row is empty
    scale = 0.37 if use_scale else None
    out, cache = F.sdpa_forward(q, k, v, mask=mask, is_causal=is_causal, scale=scale, enable_gqa=True)
    dout = rng.standard_normal(out.shape)
    dq, dk, dv, dmask, _ = F.sdpa_backward(dout, cache)

    tq, tk, tv = (torch.tensor(a, requires_grad=True) for a in (q, k, v))
    tm = None if mask is None else torch.tensor(mask, requires_grad=mask.dtype != bool)
    tout = torch.nn.functional.scaled_dot_product_attention(
        tq, tk, tv, attn_mask=tm, is_causal=is_causal, scale=scale, enable_gqa=True
    )
    tout.backward(torch.tensor(dout))
    assert np.isfinite(tout.detach().numpy()).all()
    assert _rel(out, tout.detach().numpy()) < 1e-9
    assert _rel(dq, tq.grad.numpy()) < 1e-9
    assert _rel(dk, tk.grad.numpy()) < 1e-9
    assert _rel(dv, tv.grad.numpy()) < 1e-9
    if mask_kind == "float":
        assert _rel(dmask, tm.grad.numpy()) < 1e-9


@pytest.mark.parametrize("causal", [False, True])
def test_numpy_kernel_gqa_backward_keeps_no_per_query_head_copy_of_dk(causal):
    """The kernel sums a K/V head's G query heads' dk (and dv) terms one at a time: its
    backward never holds a G-fold, (G, Lk, Dh)-sized temporary, whose size here would be
    16 K-sized tensors. Its equality with the reference is checked elsewhere; here, memory."""
    import tracemalloc

    from npattn import attention as A

    B, Hq, Hkv, Lq, Lk, Dh = 1, 16, 1, 2, 2048, 64
    rng = np.random.default_rng(0)
    q, k, v = _inputs(rng, B=B, Hq=Hq, Hkv=Hkv, Lq=Lq, Lk=Lk, Dh=Dh)
    dout = rng.standard_normal(q.shape)
    _, cache = A.sdpa_forward(q, k, v, enable_gqa=True, impl="numpy", is_causal=causal,
                              align="bottom_right")
    tracemalloc.start()
    try:
        base, _ = tracemalloc.get_traced_memory()
        dq, dk, dv, _, _ = A.sdpa_backward(dout, cache)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    k_sized = k.nbytes
    assert (peak - base) < Hq // Hkv * k_sized, (peak - base) / k_sized
    ref = F.sdpa_backward(dout, F.sdpa_forward(q, k, v, enable_gqa=True, is_causal=causal,
                                               align="bottom_right")[1])
    np.testing.assert_allclose(dk, ref.dk, rtol=1e-12, atol=1e-12 * np.abs(ref.dk).max())


def test_module_takes_a_mask_per_query_head():
    """MultiHeadAttention with n_kv_head < n_head: a mask of shape (B, H, Lq, Lk) (one per
    query head, not per key/value head) is taken, and its weights and output are those
    computed by hand, query head h reading key/value head h // G."""
    B, H, Hkv, Lq, Lk, D = 2, 4, 2, 3, 5, 8
    Dh, G = D // H, H // Hkv
    m = MultiHeadAttention(D, H, n_kv_head=Hkv, dtype="float64", seed=3)
    rng = np.random.default_rng(3)
    m.params = {n: a + 0.3 * rng.standard_normal(a.shape) for n, a in m.params.items()}
    x, y = rng.standard_normal((B, Lq, D)), rng.standard_normal((B, Lk, D))
    mask = rng.random((B, H, Lq, Lk)) < 0.7
    mask[..., 0] = True  # every row attends something
    out, w = m(x, y, y, mask=mask, need_weights=True, average_attn_weights=False)

    P = m.params
    q = (x @ P["w_q"].T + P["b_q"]).reshape(B, Lq, H, Dh).transpose(0, 2, 1, 3)
    k = (y @ P["w_k"].T + P["b_k"]).reshape(B, Lk, Hkv, Dh).transpose(0, 2, 1, 3)
    v = (y @ P["w_v"].T + P["b_v"]).reshape(B, Lk, Hkv, Dh).transpose(0, 2, 1, 3)
    k, v = np.repeat(k, G, axis=1), np.repeat(v, G, axis=1)  # [B, H, Lk, Dh]
    s = np.where(mask, q @ k.transpose(0, 1, 3, 2) / math.sqrt(Dh), -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)  # [B, H, Lq, Lk]
    o = (p @ v).transpose(0, 2, 1, 3).reshape(B, Lq, D)
    np.testing.assert_allclose(w, p, rtol=1e-12, atol=1e-15)
    np.testing.assert_allclose(out, o @ P["w_o"].T + P["b_o"], rtol=1e-12, atol=1e-14)
