"""Numerics at the edges: huge scores, half precision, -inf masks, fully masked
rows, length-1 sequences, one query against many keys."""

import math
import re

import numpy as np
import pytest

from npattn import functional as F
from npattn.backend import from_numpy, to_numpy
from npattn.gradcheck import check_vjp, gradcheck

from reliability_helpers import host_inputs, inputs, make_mha, module_pair, ref_mha, ref_sdpa


def _finite(*arrays):
    for a in arrays:
        if a is not None:
            assert np.all(np.isfinite(to_numpy(a))), "non-finite values"


def _half_or_skip(xp):
    if not hasattr(xp, "float16"):
        pytest.skip(f"{xp.__name__} has no float16 (not in the Array API standard)")
    return xp.float16


# --------------------------------------------------------------------------
# float32 scores up to +-1e4


def _large_score_qkv(rng, B=2, H=2, Lq=4, Lk=6, Dh=4, target=1e4):
    """q, k, v (float64, host) whose scaled scores reach |s| = target; in half
    of the rows every score is close to -target, in the other half to +target."""
    u = rng.standard_normal(Dh)
    k = u + 0.1 * rng.standard_normal((B, H, Lk, Dh))  # [B, H, Lk, Dh]
    sign = np.where(np.arange(Lq) % 2 == 0, 1.0, -1.0)[:, None]  # [Lq, 1]
    q = sign * u + 0.3 * rng.standard_normal((B, H, Lq, Dh))  # [B, H, Lq, Dh]
    s = q @ np.swapaxes(k, -1, -2) / math.sqrt(Dh)
    q = q * (target / np.max(np.abs(s)))
    v = rng.standard_normal((B, H, Lk, Dh))
    return q, k, v


def test_float32_scores_1e4_sdpa(xp):
    rng = np.random.default_rng(0)
    q, k, v = (a.astype(np.float32) for a in _large_score_qkv(rng))
    s = q.astype(np.float64) @ np.swapaxes(k, -1, -2).astype(np.float64) / 2.0
    assert 0.99e4 < np.max(np.abs(s)) <= 1.01e4
    assert np.max(s) > 5e3 and np.min(s) < -5e3  # rows of huge positive and huge negative scores
    mask = rng.random((4, 6)) > 0.3
    mask[:, 0] = True
    for kwargs, ref_kwargs in [({}, {}), ({"mask": mask}, {"allowed": mask})]:
        args = {key: from_numpy(val, xp) for key, val in kwargs.items()}
        out, cache = F.sdpa_forward(*(from_numpy(a, xp) for a in (q, k, v)), **args)
        assert out.dtype == xp.float32
        ref, _ = ref_sdpa(*(a.astype(np.float64) for a in (q, k, v)), **ref_kwargs)
        np.testing.assert_allclose(to_numpy(out), ref, atol=2e-2, rtol=0)
        dout = rng.standard_normal(out.shape).astype(np.float32)
        grads = F.sdpa_backward(from_numpy(dout, xp), cache)
        _finite(out, *grads)
        # against the same backward in float64
        out64, cache64 = F.sdpa_forward(*(from_numpy(a.astype(np.float64), xp) for a in (q, k, v)),
                                        **args)
        grads64 = F.sdpa_backward(from_numpy(dout.astype(np.float64), xp), cache64)
        for g, g64 in zip(grads[:3], grads64[:3]):
            g64 = to_numpy(g64)
            np.testing.assert_allclose(to_numpy(g), g64, atol=2e-2 * np.max(np.abs(g64)) + 1e-6)


def test_float32_scores_1e4_module(backend, xp):
    m = make_mha(backend, dtype="float32")
    hq, hk, hv = host_inputs(2, 4, 6, 8, dtype="float32")
    # scale w_q so the largest score |q_h . k_h| / sqrt(Dh) is 1e4
    _, p = ref_mha(m.params, hq, hk, hv, 2)
    P = {n: to_numpy(a).astype(np.float64) for n, a in m.params.items()}
    q = (hq @ P["w_q"].T + P["b_q"]).reshape(2, 4, 2, 4).transpose(0, 2, 1, 3)
    k = (hk @ P["w_k"].T + P["b_k"]).reshape(2, 6, 2, 4).transpose(0, 2, 1, 3)
    c = 1e4 / np.max(np.abs(q @ np.swapaxes(k, -1, -2) / 2.0))
    m.params["w_q"] = from_numpy((P["w_q"] * c).astype(np.float32), xp)
    m.params["b_q"] = from_numpy((P["b_q"] * c).astype(np.float32), xp)
    query, key, value = (from_numpy(a, xp) for a in (hq, hk, hv))
    out, w = m(query, key, value, need_weights=True)
    ref, ref_w = ref_mha(m.params, hq, hk, hv, 2)
    assert np.max(ref_w) > 0.999  # the softmax is saturated
    np.testing.assert_allclose(to_numpy(out), ref, atol=5e-2 * np.max(np.abs(ref)))
    dout = from_numpy(np.random.default_rng(1).standard_normal((2, 4, 8)).astype(np.float32), xp)
    _finite(out, w, *m.backward(dout), *m.grads.values())


# --------------------------------------------------------------------------
# float16: scores, softmax and its sums in float32


def test_float16_sdpa_is_the_float32_computation(xp):
    f16 = _half_or_skip(xp)
    rng = np.random.default_rng(2)
    q, k, v = (from_numpy(rng.standard_normal(s).astype(np.float16), xp)
               for s in ((2, 2, 3, 4), (2, 2, 5, 4), (2, 2, 5, 4)))
    add = rng.standard_normal((3, 5))
    add[1] = -np.inf  # a fully masked row
    add[0, 2] = -np.inf
    dout = from_numpy(rng.standard_normal((2, 2, 3, 4)).astype(np.float16), xp)
    for mask in (None, add.astype(np.float16), add > 0):
        m16 = None if mask is None else from_numpy(mask, xp)
        m32 = None if mask is None or mask.dtype == bool else from_numpy(mask.astype(np.float32), xp)
        if mask is not None and mask.dtype == bool:
            m32 = m16
        out, cache = F.sdpa_forward(q, k, v, mask=m16, dropout_p=0.25, rng=7)
        out32, cache32 = F.sdpa_forward(*(xp.astype(t, xp.float32) for t in (q, k, v)), mask=m32,
                                        dropout_p=0.25, rng=7)
        assert out.dtype == f16
        np.testing.assert_array_equal(to_numpy(out), to_numpy(xp.astype(out32, f16)))
        grads = F.sdpa_backward(dout, cache)
        grads32 = F.sdpa_backward(xp.astype(dout, xp.float32), cache32)
        for g, g32 in zip(grads, grads32):
            if g32 is None:
                assert g is None
                continue
            assert g.dtype == f16
            np.testing.assert_array_equal(to_numpy(g), to_numpy(xp.astype(g32, f16)))


def test_float16_scores_beyond_float16_range(xp):
    """Scores of 8e4 overflow float16 (max 65504) but not the float32 computation."""
    _half_or_skip(xp)
    rng = np.random.default_rng(3)
    q, k, v = _large_score_qkv(rng, target=8e4)
    q, k, v = (a.astype(np.float16) for a in (q, k, v))
    out, cache = F.sdpa_forward(*(from_numpy(a, xp) for a in (q, k, v)))
    ref, _ = ref_sdpa(*(a.astype(np.float64) for a in (q, k, v)))
    np.testing.assert_allclose(to_numpy(out).astype(np.float64), ref, atol=2e-2)
    dout = from_numpy(rng.standard_normal(out.shape).astype(np.float16), xp)
    _finite(out, *F.sdpa_backward(dout, cache))


def test_float16_masked_softmax_is_the_float32_computation(xp):
    f16 = _half_or_skip(xp)
    rng = np.random.default_rng(4)
    x = from_numpy((3.0 * rng.standard_normal((2, 3, 4096))).astype(np.float16), xp)
    add = np.zeros((3, 4096), dtype=np.float16)
    add[1, ::3] = -np.inf
    dp = from_numpy(rng.standard_normal((2, 3, 4096)).astype(np.float16), xp)
    for mask in (None, from_numpy(add, xp)):
        p, cache = F.masked_softmax_forward(x, mask)
        m32 = None if mask is None else xp.astype(mask, xp.float32)
        p32, cache32 = F.masked_softmax_forward(xp.astype(x, xp.float32), m32)
        assert p.dtype == f16
        np.testing.assert_array_equal(to_numpy(p), to_numpy(xp.astype(p32, f16)))
        # the float32 probabilities sum to 1 (a float16 running sum over 4096 would drift)
        np.testing.assert_allclose(np.sum(to_numpy(cache.p).astype(np.float64), axis=-1), 1.0,
                                   rtol=1e-5)
        dx, dmask, _ = F.masked_softmax_backward(dp, cache)
        dx32, dmask32, _ = F.masked_softmax_backward(xp.astype(dp, xp.float32), cache32)
        assert dx.dtype == f16
        np.testing.assert_array_equal(to_numpy(dx), to_numpy(xp.astype(dx32, f16)))
        if mask is not None:
            np.testing.assert_array_equal(to_numpy(dmask), to_numpy(xp.astype(dmask32, f16)))
    # a sink (of x's dtype) and dlse (of lse's, float32): p, dx and dsink come back float16,
    # the float32 computation rounded once
    sink = from_numpy((2.0 * rng.standard_normal((2, 3, 1))).astype(np.float16), xp)
    dlse = from_numpy(rng.standard_normal((2, 3, 1)).astype(np.float32), xp)
    p, cache = F.masked_softmax_forward(x, sink=sink)
    p32, cache32 = F.masked_softmax_forward(xp.astype(x, xp.float32), sink=xp.astype(sink, xp.float32))
    assert p.dtype == f16 and cache.lse.dtype == xp.float32
    np.testing.assert_array_equal(to_numpy(p), to_numpy(xp.astype(p32, f16)))
    grads = F.masked_softmax_backward(dp, cache, dlse=dlse)
    grads32 = F.masked_softmax_backward(xp.astype(dp, xp.float32), cache32, dlse=dlse)
    for name in ("dx", "dsink"):
        g, g32 = getattr(grads, name), getattr(grads32, name)
        assert g.dtype == f16, name
        np.testing.assert_array_equal(to_numpy(g), to_numpy(xp.astype(g32, f16)))


def test_float16_module(backend, xp):
    f16 = _half_or_skip(xp)
    m = make_mha(backend, dtype="float16")
    hq, hk, hv = host_inputs(2, 3, 5, 8, dtype="float16")
    out, w = m(*(from_numpy(a, xp) for a in (hq, hk, hv)), need_weights=True,
               average_attn_weights=False)
    assert out.dtype == f16 and w.dtype == f16
    ref, ref_w = ref_mha(m.params, hq, hk, hv, 2)
    np.testing.assert_allclose(to_numpy(out).astype(np.float64), ref, atol=2e-2)
    np.testing.assert_allclose(to_numpy(w).astype(np.float64), ref_w, atol=2e-3)
    dout = from_numpy(np.random.default_rng(5).standard_normal((2, 3, 8)).astype(np.float16), xp)
    grads = m.backward(dout)
    assert all(g.dtype == f16 for g in (*grads, *m.grads.values()))
    _finite(*grads, *m.grads.values())


# --------------------------------------------------------------------------
# additive masks with -inf


def _inf_mask(rng, shape):
    add = rng.standard_normal(shape)
    allowed = rng.random(shape) > 0.4
    allowed[..., 1, :] = False  # a fully masked query row
    allowed[..., 0, 0] = True
    return np.where(allowed, add, -np.inf), allowed


def test_inf_additive_mask_sdpa(xp):
    rng = np.random.default_rng(6)
    q, k, v = (from_numpy(rng.standard_normal(s), xp) for s in ((2, 2, 3, 4), (2, 2, 5, 4), (2, 2, 5, 4)))
    add, allowed = _inf_mask(rng, (2, 1, 3, 5))
    dout = from_numpy(rng.standard_normal((2, 2, 3, 4)), xp)

    out_f, c_f = F.sdpa_forward(q, k, v, mask=from_numpy(np.where(allowed, 0.0, -np.inf), xp))
    out_b, c_b = F.sdpa_forward(q, k, v, mask=from_numpy(allowed, xp))
    # a -inf / 0 additive mask is the boolean mask, bit for bit
    np.testing.assert_array_equal(to_numpy(out_f), to_numpy(out_b))
    g_f, g_b = F.sdpa_backward(dout, c_f), F.sdpa_backward(dout, c_b)
    for a, b in zip(g_f[:3], g_b[:3]):
        np.testing.assert_array_equal(to_numpy(a), to_numpy(b))
    dmask = to_numpy(g_f[3])
    assert dmask.shape == (2, 1, 3, 5)
    assert np.all(np.isfinite(dmask)) and np.all(dmask[~allowed] == 0.0)

    out, cache = F.sdpa_forward(q, k, v, mask=from_numpy(add, xp))
    ref, _ = ref_sdpa(*(to_numpy(t) for t in (q, k, v)), additive=add)
    np.testing.assert_allclose(to_numpy(out), ref, rtol=1e-12, atol=1e-14)
    assert np.all(to_numpy(out)[:, :, 1] == 0.0)
    _finite(out, *F.sdpa_backward(dout, cache))
    report = gradcheck(
        lambda q, k, v, mask: F.sdpa_forward(q, k, v, mask=mask),
        F.sdpa_backward,
        [q, k, v, from_numpy(add, xp)],
        names=["q", "k", "v", "mask"],
    )
    assert report.ok, str(report)


def test_inf_additive_mask_module(backend, xp):
    m = make_mha(backend)
    rng = np.random.default_rng(7)
    add, allowed = _inf_mask(rng, (2, 1, 3, 5))
    query, key, value = inputs(xp, 2, 3, 5, 8)
    out, _ = m(query, key, value, mask=from_numpy(add, xp))
    ref, _ = ref_mha(m.params, query, key, value, 2, additive=add)
    np.testing.assert_allclose(to_numpy(out), ref, rtol=1e-12, atol=1e-12)
    report = gradcheck(*module_pair(m, mask=from_numpy(add, xp)), [query, key, value],
                       names=["query", "key", "value"])
    assert report.ok, str(report)


# --------------------------------------------------------------------------
# fully masked rows and fully masked batches


def _masks(kind, allowed):
    if kind == "bool":
        return allowed
    return np.where(allowed, 0.0, -np.inf)


@pytest.mark.parametrize("kind", ["bool", "additive"])
@pytest.mark.parametrize("dropout", [0.0, 0.3])
def test_fully_masked_rows(backend, xp, kind, dropout):
    """Row 1 of batch 0 and every row of batch 1 see nothing: out = b_o there,
    their input gradients are exactly zero, and everything is finite."""
    m = make_mha(backend, dropout=dropout)
    allowed = np.random.default_rng(8).random((2, 1, 3, 5)) > 0.3
    allowed[0, :, 0, :] = True
    allowed[0, :, 1, :] = False
    allowed[1] = False
    mask = from_numpy(_masks(kind, allowed), xp)
    query, key, value = inputs(xp, 2, 3, 5, 8)
    out, w = m(query, key, value, mask=mask, need_weights=True, average_attn_weights=False)
    b_o = to_numpy(m.params["b_o"])
    o = to_numpy(out)
    np.testing.assert_array_equal(o[0, 1], b_o)
    np.testing.assert_array_equal(o[1], np.broadcast_to(b_o, (3, 8)))
    w = to_numpy(w)
    assert np.all(w[0, :, 1] == 0.0) and np.all(w[1] == 0.0)
    np.testing.assert_allclose(w[0, :, 0].sum(-1), 1.0, rtol=1e-12)

    dout = from_numpy(np.random.default_rng(9).standard_normal((2, 3, 8)), xp)
    dq, dk, dv = (to_numpy(g) for g in m.backward(dout))
    _finite(dq, dk, dv, *m.grads.values())
    assert np.all(dq[0, 1] == 0.0) and np.all(dq[1] == 0.0)
    assert np.all(dk[1] == 0.0) and np.all(dv[1] == 0.0)
    assert np.any(dq[0, 0] != 0.0) and np.any(dk[0] != 0.0)  # the rest is not trivially zero

    if dropout == 0.0:
        ref, _ = ref_mha(m.params, query, key, value, 2, allowed=allowed)
        np.testing.assert_allclose(o, ref, rtol=1e-12, atol=1e-12)
        report = gradcheck(*module_pair(m, mask=mask), [query, key, value],
                           names=["query", "key", "value"])
        assert report.ok, str(report)


@pytest.mark.parametrize("kind", ["bool", "additive"])
def test_every_row_masked(backend, xp, kind):
    """Nothing to attend anywhere: out = b_o everywhere and every gradient is
    exactly zero, except db_o = sum of dout (out = 0 @ w_o.T + b_o)."""
    m = make_mha(backend, dropout=0.2)
    mask = from_numpy(_masks(kind, np.zeros((3, 5), dtype=bool)), xp)
    query, key, value = inputs(xp, 2, 3, 5, 8)
    out, _ = m(query, key, value, mask=mask, is_causal=True)
    np.testing.assert_array_equal(to_numpy(out), np.broadcast_to(to_numpy(m.params["b_o"]), (2, 3, 8)))
    d = np.random.default_rng(10).standard_normal((2, 3, 8))
    grads = m.backward(from_numpy(d, xp))
    for name, g in [*zip(("dquery", "dkey", "dvalue"), grads), *m.grads.items()]:
        g = to_numpy(g)
        assert np.all(np.isfinite(g)), name
        if name == "b_o":
            np.testing.assert_allclose(g, d.sum(axis=(0, 1)), rtol=1e-12)
        else:
            assert np.all(g == 0.0), name


# --------------------------------------------------------------------------
# length-1 sequences; one query, many keys


@pytest.mark.parametrize("Lq, Lk", [(1, 1), (1, 3), (3, 1)])
def test_length_one(backend, xp, Lq, Lk):
    m = make_mha(backend, kdim=6, vdim=4)
    query, key, value = inputs(xp, 2, Lq, Lk, 8, 6, 4)
    out, w = m(query, key, value, need_weights=True)
    ref, ref_w = ref_mha(m.params, query, key, value, 2)
    np.testing.assert_allclose(to_numpy(out), ref, rtol=1e-12, atol=1e-12)
    if Lk == 1:
        assert np.all(to_numpy(w) == 1.0)
    report = gradcheck(*module_pair(m, wrt_params=("w_k", "b_q")),
                       [query, key, value, m.params["w_k"], m.params["b_q"]],
                       names=["query", "key", "value", "w_k", "b_q"])
    assert report.ok, str(report)


@pytest.mark.parametrize("dtype", ["float64", "float32"])
def test_one_query_many_keys(backend, xp, dtype):
    Lk = 2048
    m = make_mha(backend, dtype=dtype)
    query, key, value = inputs(xp, 2, 1, Lk, 8, dtype=dtype)
    allowed = np.random.default_rng(11).random((2, 1, 1, Lk)) > 0.5
    mask = from_numpy(allowed, xp)
    out, w = m(query, key, value, mask=mask, need_weights=True)
    ref, ref_w = ref_mha(m.params, query, key, value, 2, allowed=allowed)
    tol = 1e-12 if dtype == "float64" else 1e-5
    np.testing.assert_allclose(to_numpy(out), ref, rtol=tol, atol=tol)
    np.testing.assert_allclose(to_numpy(w).astype(np.float64).sum(-1), 1.0, rtol=tol)
    dout = from_numpy(np.random.default_rng(12).standard_normal((2, 1, 8)).astype(dtype), xp)
    grads = m.backward(dout)
    _finite(*grads, *m.grads.values())
    if dtype == "float64":
        f, _ = module_pair(m, mask=mask)
        report = check_vjp(lambda *a: f(*a)[0], [query, key, value], grads, dout,
                           names=["query", "key", "value"], rtol=1e-6)
        assert report.ok, str(report)


def test_ints_beyond_the_float_range_are_value_errors():
    """An int such as 2**1100 where a finite float is expected: a ValueError naming the
    argument, what was expected and the int received, by its size rather than its 332 digits
    (float() raised OverflowError out of the checks)."""
    from npattn import attention as A, compat as C, gradcheck as G, layers as Ly, nn
    from npattn import positions as P
    from npattn.module import MultiHeadAttention
    from npattn.verifier import verify

    huge = 2**1100
    x = np.ones((1, 1, 2, 4))
    bits = "an int too large for a float (1101 bits)"

    def kernel(q, k, v, **kw):  # never called: the options are checked first
        raise AssertionError("the kernel ran")

    calls = [
        ("softcap: expected a finite float > 0", bits, lambda: A.sdpa_forward(x, x, x, softcap=huge)),
        ("softcap: expected a finite float > 0", bits, lambda: MultiHeadAttention(8, 2, softcap=huge)),
        ("softcap: expected 0.0 (off) or a finite float > 0", bits,
         lambda: C.flash_attn_func(x, x, x, softcap=huge)),
        ("eps: expected a positive finite float", bits,
         lambda: Ly.layer_norm_forward(np.ones((2, 4)), np.ones(4), np.zeros(4), eps=huge)),
        ("base: expected a finite float > 1", bits, lambda: P.rope_forward(np.ones((2, 4)), base=huge)),
        ("offset: expected an int within +-2**62 (positions are int64)", str(2**70),
         lambda: P.relative_embedding_forward(np.ones((5, 2)), 2, 2, offset=2**70)),
        ("max_norm: expected a finite number > 0", bits,
         lambda: nn.clip_grad_norm({"a": np.ones(2)}, huge)),
        ("lr: expected a finite number >= 0", bits,
         lambda: nn.adam_step({"a": np.ones(2)}, {"a": np.ones(2)}, nn.adam_init({"a": np.ones(2)}),
                              lr=huge)),
        ("label_smoothing: expected a real number in [0, 1]", bits,
         lambda: nn.cross_entropy_forward(np.ones((2, 3)), np.array([0, 1]), label_smoothing=huge)),
        ("eps: expected a finite number > 0", bits,
         lambda: G.gradcheck(lambda a: (a * 2.0, None), lambda d, c: (2.0 * d,), [np.ones(2)],
                             eps=huge)),
        ("budget_factor: expected a finite number >= 1", bits, lambda: verify(kernel, budget_factor=huge)),
        ("softcap: expected a finite float > 0", "a negative " + bits[3:],
         lambda: A.sdpa_forward(x, x, x, softcap=-huge)),
        ("dropout_p: expected a drop probability in [0, 1)", bits,
         lambda: A.sdpa_forward(x, x, x, dropout_p=huge)),
        ("max_norm: expected a finite number > 0", "a negative " + bits[3:],
         lambda: nn.clip_grad_norm({"a": np.ones(2)}, -huge)),
        ("floors: expected finite numbers >= 0 as values", bits + " for 'float64'",
         lambda: verify(kernel, floors={"float64": huge})),
    ]
    for expected, got, call in calls:
        with pytest.raises(ValueError, match=f"^{re.escape(expected)}, got {re.escape(got)}$"):
            call()


@pytest.mark.parametrize("impl", ["reference", "blocked", "numpy"])
def test_scores_near_the_float64_threshold_are_exact_or_nan_never_a_wrong_number(impl):
    """docs/derivations.md: the implementations apply the scale at different points (the
    product, q, k), so with a scale far from 1 and operands within a factor of it of the
    float64 threshold one may overflow where another does not; the result is then NaN, never
    a finite wrong number. Scores 5e299 and 1e300 (weights 0, 1: out 3, dv [0, 1]); and
    scores 1e150 twice (weights 1/2 each: out 2, dv [0.5, 0.5]); worked by hand."""
    from npattn import attention as A

    v = np.array([1.0, 3.0]).reshape(1, 1, 2, 1)
    cases = [(np.full((1, 1, 1, 1), 1e306), np.array([5e-10, 1e-9]).reshape(1, 1, 2, 1), 1e3, 3.0, [0.0, 1.0]),
             (np.full((1, 1, 1, 1), 1e200), np.full((1, 1, 2, 1), 1e200), 1e-250, 2.0, [0.5, 0.5])]
    for q, k, scale, want_out, want_dv in cases:
        with np.errstate(all="ignore"):
            out, cache = A.sdpa_forward(q, k, v, scale=scale, impl=impl)
            dv = A.sdpa_backward(np.ones((1, 1, 1, 1)), cache).dv
        if np.isnan(out).any():
            assert np.isnan(out).all() and np.isnan(dv).all(), (scale, out, dv)
        else:
            np.testing.assert_allclose(out.ravel(), [want_out], rtol=1e-15)
            np.testing.assert_allclose(dv.ravel(), want_dv, rtol=1e-15, atol=0)
    # the default scale (1/sqrt(Dh) <= 1) with finite products: exact on every implementation
    q, k = np.full((1, 1, 1, 1), 1e153), np.array([5e146, 1e147]).reshape(1, 1, 2, 1)
    out, cache = A.sdpa_forward(q, k, v, impl=impl)  # scores 5e299, 1e300
    dv = A.sdpa_backward(np.ones((1, 1, 1, 1)), cache).dv
    np.testing.assert_allclose(out.ravel(), [3.0], rtol=1e-15)
    np.testing.assert_allclose(dv.ravel(), [0.0, 1.0], rtol=1e-15, atol=0)
