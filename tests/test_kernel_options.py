"""The kernel options of the attention core: align, window, softcap, ALiBi, sinks,
segments, broadcast leading axes, cache.lse and its gradient dlse.

Each case is checked three ways on every backend and on the reference and the
blocked implementation:

* the forward (out and lse) against ``oracle`` below, written here from the
  documented semantics (flash-attn's window, softcap and ALiBi, gpt-oss's
  sinks), not from npattn's code;
* every gradient (q, k, v, a floating mask, sinks) against central finite
  differences of the loss ``<out, dout> + <lse, dlse>`` along a random
  direction, in float64, with random upstream gradients;
* blocked against the reference to 1e-12.

``_attention_cases.joint_cases`` draws the options together with GQA, masks, dropout
and a scale, and checks every implementation against the oracle and the reference,
and, in half precision, against its own float32 run rounded once.
"""

import math
import warnings

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import npattn
from npattn import attention as A
from npattn import functional as F
from npattn import masks, numpy_kernel
from npattn.backend import from_numpy, to_numpy

from _attention_cases import assert_close, joint_cases, joint_inputs
from _attention_cases import OPTION_CASES as CASES
from _attention_cases import make_option_case as make_case
from conftest import backend_or_skip

# --------------------------------------------------------------------------
# the oracle: the documented semantics, written out on NumPy float64


def oracle(q, k, v, *, mask=None, is_causal=False, scale=None, dropout_p=0.0, dropout_mask=None,
           enable_gqa=False, align="top_left", window=None, softcap=None, alibi_slopes=None,
           sinks=None, q_segments=None, k_segments=None):
    """``(out, lse)`` of attention with the kernel options, from their definitions."""
    G = q.shape[-3] // k.shape[-3] if enable_gqa else 1
    k, v = np.repeat(k, G, axis=-3), np.repeat(v, G, axis=-3)  # K/V head h // G for query head h
    Lq, Lk = q.shape[-2], k.shape[-2]
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    s = (q @ np.swapaxes(k, -1, -2)) * scale
    if softcap is not None:
        s = softcap * np.tanh(s / softcap)
    o = 0 if align == "top_left" else Lk - Lq
    i = np.arange(Lq)[:, None]
    j = np.arange(Lk)[None, :]
    if alibi_slopes is not None:  # flash-attn: -slope * |i + Lk - Lq - j| bottom-right
        slopes = alibi_slopes[..., None, None] if alibi_slopes.ndim == 2 else alibi_slopes[:, None, None]
        s = s - slopes * np.abs(i + o - j)
    allowed = np.ones(s.shape, dtype=bool)
    if is_causal:
        allowed &= j <= i + o
    if window is not None:
        left, right = window
        if left is not None:
            allowed &= j >= i + o - left
        if right is not None:
            allowed &= j <= i + o + right
    if q_segments is not None:
        allowed &= q_segments[:, None, :, None] == k_segments[:, None, None, :]
    if mask is not None:
        if mask.dtype == bool:
            allowed &= mask
        else:
            s = s + mask
    s = np.where(allowed, s, -np.inf)
    if sinks is not None:  # one more logit per row, with no value
        s = np.concatenate([s, np.broadcast_to(sinks[:, None, None], s.shape[:-1] + (1,))], axis=-1)
    top = np.max(s, axis=-1, keepdims=True)
    top = np.where(np.isfinite(top), top, 0.0)
    e = np.exp(s - top)
    Z = np.sum(e, axis=-1, keepdims=True)
    p = np.where(Z > 0, e / np.where(Z > 0, Z, 1.0), 0.0)
    lse = np.where(Z[..., 0] > 0, np.log(np.where(Z > 0, Z, 1.0))[..., 0] + top[..., 0], -np.inf)
    if sinks is not None:
        p = p[..., :-1]
    if dropout_mask is not None:
        p = np.where(dropout_mask, p / (1.0 - dropout_p), 0.0)
    return p @ v, lse


# --------------------------------------------------------------------------
# cases

SHAPES = [(5, 7), (6, 4)]  # Lq < Lk and Lq > Lk
IMPLS = ["reference", "blocked"]
BLOCKS = dict(block_q=2, block_k=3)  # blocks cross every boundary of these small shapes


def run(xp_kw, impl, q, k, v, kw):
    extra = BLOCKS if impl == "blocked" else {}
    return A.sdpa_forward(q, k, v, impl=impl, **extra, **xp_kw(kw))


@pytest.fixture
def on_backend(to_xp):
    def convert(kw):
        return {n: (to_xp(a) if isinstance(a, np.ndarray) else a) for n, a in kw.items()}
    return convert


def loss(to_np, out, lse, dout, dlse):
    lse = to_np(lse)
    return float(np.sum(to_np(out) * dout) + np.sum(np.where(np.isfinite(lse), lse, 0.0) * dlse))


# --------------------------------------------------------------------------
# the forward against the oracle


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("Lq,Lk", SHAPES)
@pytest.mark.parametrize("name", CASES)
def test_forward_and_lse_match_the_oracle(xp, to_xp, to_np, on_backend, name, Lq, Lk, impl):
    q, k, v, _, _, kw = make_case(name, Lq, Lk)
    out, cache = run(on_backend, impl, to_xp(q), to_xp(k), to_xp(v), kw)
    want_out, want_lse = oracle(q, k, v, **kw)
    np.testing.assert_allclose(to_np(out), want_out, rtol=1e-12, atol=1e-12)
    lse = to_np(cache.lse)
    assert lse.shape == want_lse.shape
    np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(want_lse))
    fin = np.isfinite(want_lse)
    np.testing.assert_allclose(lse[fin], want_lse[fin], rtol=1e-12, atol=1e-12)
    if name in ("segments", "all") or (name == "causal_bottom_right" and Lq > Lk):
        empty = ~np.any(np.abs(want_out) > 0, axis=-1)
        assert empty.any(), "the case should leave some row with nothing to attend"
        np.testing.assert_array_equal(to_np(out)[empty], 0.0)
        if "sinks" not in kw:
            assert np.isneginf(lse[empty]).all()


# --------------------------------------------------------------------------
# gradients: central finite differences of <out, dout> + <lse, dlse>


def _inputs(q, k, v, kw):
    """The differentiable inputs: name -> host array (the mask only when floating)."""
    d = {"q": q, "k": k, "v": v}
    if kw.get("mask") is not None and kw["mask"].dtype != bool:
        d["mask"] = kw["mask"]
    if kw.get("sinks") is not None:
        d["sinks"] = kw["sinks"]
    return d


@pytest.mark.parametrize("with_dlse", [True, False])
@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("Lq,Lk", SHAPES)
@pytest.mark.parametrize("name", CASES)
def test_gradients_match_finite_differences(xp, to_xp, to_np, on_backend, name, Lq, Lk, impl,
                                            with_dlse):
    q, k, v, dout, dlse, kw = make_case(name, Lq, Lk, seed=1)
    if not with_dlse:
        dlse = np.zeros_like(dlse)
    x0 = _inputs(q, k, v, kw)

    def f(x):
        kw2 = dict(kw, **{n: a for n, a in x.items() if n in ("mask", "sinks")})
        out, cache = run(on_backend, impl, to_xp(x["q"]), to_xp(x["k"]), to_xp(x["v"]), kw2)
        return out, cache

    out, cache = f(x0)
    grads = A.sdpa_backward(to_xp(dout), cache, dlse=to_xp(dlse) if with_dlse else None)
    assert isinstance(grads, F.SDPAGrads)
    got = {"q": grads.dq, "k": grads.dk, "v": grads.dv, "mask": grads.dmask, "sinks": grads.dsinks}
    if "sinks" not in kw:
        assert grads.dsinks is None
    rng = np.random.default_rng(2)
    eps = 1e-6
    for n, a in x0.items():
        g = to_np(got[n])
        assert g.shape == a.shape, n
        assert np.all(np.isfinite(g)), n
        t = rng.standard_normal(a.shape)
        t = np.where(np.isfinite(a), t, 0.0)  # -inf mask entries stay -inf
        plus = loss(to_np, *_out_lse(f, dict(x0, **{n: a + eps * t})), dout, dlse)
        minus = loss(to_np, *_out_lse(f, dict(x0, **{n: a - eps * t})), dout, dlse)
        numeric = (plus - minus) / (2 * eps)
        analytic = float(np.sum(np.where(np.isfinite(a), g * t, 0.0)))
        assert abs(numeric - analytic) <= 1e-6 * max(1.0, abs(numeric)), (n, numeric, analytic)
        assert abs(analytic) > 1e-8, f"{n}: a zero gradient would pass this check"


def _out_lse(f, x):
    out, cache = f(x)
    return out, cache.lse


# --------------------------------------------------------------------------
# blocked == reference


@pytest.mark.parametrize("Lq,Lk", SHAPES)
@pytest.mark.parametrize("name", CASES)
def test_blocked_equals_reference(xp, to_xp, to_np, on_backend, name, Lq, Lk):
    q, k, v, dout, dlse, kw = make_case(name, Lq, Lk, seed=3)
    res = {}
    for impl in IMPLS:
        out, cache = run(on_backend, impl, to_xp(q), to_xp(k), to_xp(v), kw)
        grads = A.sdpa_backward(to_xp(dout), cache, dlse=to_xp(dlse))
        res[impl] = [to_np(out), to_np(cache.lse)] + [None if g is None else to_np(g) for g in grads]
    for a, b in zip(res["reference"], res["blocked"]):
        assert (a is None) == (b is None)
        if a is not None:
            np.testing.assert_allclose(b, a, rtol=1e-12, atol=1e-12)


@given(Lq=st.integers(2, 9), Lk=st.integers(2, 9), left=st.one_of(st.none(), st.integers(0, 4)),
       right=st.one_of(st.none(), st.integers(0, 4)), align=st.sampled_from(["top_left", "bottom_right"]),
       softcap=st.one_of(st.none(), st.floats(0.5, 5.0)), use_alibi=st.booleans(),
       use_sinks=st.booleans(), causal=st.booleans(), bq=st.integers(1, 4), bk=st.integers(1, 4),
       seed=st.integers(0, 2**16))
def test_blocked_equals_reference_property(Lq, Lk, left, right, align, softcap, use_alibi, use_sinks,
                                           causal, bq, bk, seed):
    rng = np.random.default_rng(seed)
    B, H = 2, 2
    q, k = rng.standard_normal((B, H, Lq, 3)), rng.standard_normal((B, H, Lk, 3))
    v, dout = rng.standard_normal((B, H, Lk, 2)), rng.standard_normal((B, H, Lq, 2))
    dlse = rng.standard_normal((B, H, Lq))
    kw = dict(window=(left, right), align=align, softcap=softcap, is_causal=causal,
              alibi_slopes=rng.random(H) if use_alibi else None,
              sinks=rng.standard_normal(H) if use_sinks else None)
    out_r, c_r = A.sdpa_forward(q, k, v, impl="reference", **kw)
    out_b, c_b = A.sdpa_forward(q, k, v, impl="blocked", block_q=bq, block_k=bk, **kw)
    want, want_lse = oracle(q, k, v, **kw)
    np.testing.assert_allclose(out_r, want, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(out_b, want, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(c_b.lse, want_lse, rtol=1e-12, atol=1e-12)
    for g_r, g_b in zip(A.sdpa_backward(dout, c_r, dlse=dlse), A.sdpa_backward(dout, c_b, dlse=dlse)):
        assert (g_r is None) == (g_b is None)
        if g_r is not None:
            np.testing.assert_allclose(g_b, g_r, rtol=1e-12, atol=1e-12)


@given(case=joint_cases())
def test_every_impl_equals_the_oracle_and_the_reference_with_options_drawn_together(case):
    """The reference's out and lse against the oracle; then the dense, auto, blocked (drawn
    blocks, and blocks of 1) and, where the call holds no option beyond a window, the NumPy
    kernel's (1 and 2 threads, tiles of 16 scores): out, lse, every gradient and the weights
    to 1e-12 of their scale, the same keep-mask, and finite gradients whatever dlse holds on
    the rows with nothing to attend (inf and NaN there do not count)."""
    q, k, v, dout, dlse, kw = joint_inputs(case)
    out, cache = A.sdpa_forward(q, k, v, impl="reference", **kw)
    keep = A.dropout_keep_mask(cache)
    drawn = {n: a for n, a in kw.items() if n != "rng"}  # the oracle takes the keep-mask drawn
    want, want_lse = oracle(q, k, v, **dict(drawn, dropout_mask=keep))
    np.testing.assert_allclose(out, want, rtol=1e-12, atol=1e-12)
    np.testing.assert_array_equal(np.isneginf(cache.lse), np.isneginf(want_lse))
    fin = np.isfinite(want_lse)
    np.testing.assert_allclose(cache.lse[fin], want_lse[fin], rtol=1e-12, atol=1e-12)
    dlse = np.where(fin, dlse, case["dlse_empty"])
    grads = A.sdpa_backward(dout, cache, dlse=dlse)
    for g in grads:
        assert g is None or np.all(np.isfinite(g))
    bq, bk = case["blocks"]
    variants = [("dense", {}, None), ("auto", {}, None), ("blocked", dict(block_q=bq, block_k=bk), "2"),
                ("blocked", dict(block_q=1, block_k=1), "1")]
    if not any(kw.get(n) is not None for n in ("softcap", "alibi_slopes", "sinks", "q_segments")):
        variants += [("numpy", {}, "1"), ("numpy", {}, "2")]
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(numpy_kernel, "TILE_ELEMS", 16)
        mp.setattr(numpy_kernel, "POOL_MIN_SCORES", 0)
        for impl, extra, threads in variants:
            what = f"{impl} {extra} {threads} threads"
            if threads is not None:
                mp.setenv("NPATTN_NUM_THREADS", threads)
            got, c = A.sdpa_forward(q, k, v, impl=impl, **extra, **kw)
            got_grads = A.sdpa_backward(dout, c, dlse=dlse)
            mp.delenv("NPATTN_NUM_THREADS", raising=False)
            assert_close(got, out, np.asarray, f"{what}: out")
            np.testing.assert_array_equal(np.isneginf(c.lse), np.isneginf(cache.lse), err_msg=what)
            np.testing.assert_allclose(c.lse[fin], cache.lse[fin], rtol=1e-12, atol=1e-12, err_msg=what)
            for name, g, g_ref in zip(F.SDPAGrads._fields, got_grads, grads):
                assert_close(g, g_ref, np.asarray, f"{what}: {name}")
            got_keep = A.dropout_keep_mask(c)
            assert (got_keep is None) == (keep is None), what
            if keep is not None:
                np.testing.assert_array_equal(np.broadcast_to(got_keep, keep.shape), keep, err_msg=what)
            if impl != "blocked":
                assert_close(A.weights(c), A.weights(cache), np.asarray, f"{what}: weights")


def torch_attention(torch, *, q, k, v, mask=None, is_causal=False, scale=None, dropout_p=0.0,
                    dropout_mask=None, enable_gqa=False, align="top_left", window=None, softcap=None,
                    alibi_slopes=None, sinks=None, q_segments=None, k_segments=None):
    """``(out, weights, lse)`` in torch float64, differentiable, from the options' sources:
    flash-attn's ``tests/test_flash_attn.py::attention_ref`` (scaled scores, softcap, positions
    that may not attend set to -inf, then the bias ``-slope * |i + Lk - Lq - j|`` of its
    ``attn_bias_from_alibi_slopes``), gpt-oss's ``sdpa`` (the sink a last softmax column,
    dropped after the softmax) and SDPA's ``enable_gqa`` (``repeat_interleave`` of k and v).
    A row with nothing to attend gets weights 0 and lse -inf."""
    G = q.shape[-3] // k.shape[-3] if enable_gqa else 1
    k, v = k.repeat_interleave(G, dim=-3), v.repeat_interleave(G, dim=-3)
    Lq, Lk = q.shape[-2], k.shape[-2]
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    s = q @ k.transpose(-1, -2) * scale
    if softcap is not None:
        s = torch.tanh(s / softcap) * softcap
    o = Lk - Lq if align == "bottom_right" else 0
    i, j = torch.arange(Lq)[:, None] + o, torch.arange(Lk)[None, :]  # i: the query's key position
    allowed = torch.ones(Lq, Lk, dtype=torch.bool)
    if is_causal:
        allowed = allowed & (j <= i)
    if window is not None and window[0] is not None:
        allowed = allowed & (j >= i - window[0])
    if window is not None and window[1] is not None:
        allowed = allowed & (j <= i + window[1])
    if q_segments is not None:
        allowed = allowed & (q_segments[:, None, :, None] == k_segments[:, None, None, :])
    if mask is not None and mask.dtype == torch.bool:
        allowed = allowed & mask
    s = torch.where(allowed, s, -math.inf)
    if alibi_slopes is not None:
        slopes = alibi_slopes[..., None, None]  # (H,) or (B, H) -> (..., H, 1, 1)
        s = s - slopes * (i - j).abs().to(s.dtype)
    if mask is not None and mask.dtype != torch.bool:
        s = s + mask
    if sinks is not None:
        s = torch.cat([s, sinks[:, None, None].expand(s.shape[:-1] + (1,))], dim=-1)
    empty = torch.isneginf(s).all(dim=-1, keepdim=True)
    s = torch.where(empty, 0.0, s)  # a finite row, so that nothing below is NaN; zeroed after
    lse = torch.logsumexp(s, dim=-1, keepdim=True)
    p = torch.where(empty, 0.0, torch.exp(s - lse))
    lse = torch.where(empty, -math.inf, lse)[..., 0]
    if sinks is not None:
        p = p[..., :-1]
    a = p if dropout_mask is None else torch.where(dropout_mask, p / (1.0 - dropout_p), 0.0)
    return a @ v, p, lse


@given(case=joint_cases(), impl=st.sampled_from(["reference", "blocked"]))
def test_options_drawn_together_match_torch_autograd_of_their_definitions(case, impl):
    """Out, weights, lse and every gradient (q, k, v, a floating mask, sinks), with a random
    upstream gradient of out and of lse, against ``torch_attention`` and torch's autograd.
    The joint test above checks the implementations against the reference; this checks the
    reference's gradients with the options together (sinks next to masks, dropout, GQA, ALiBi)
    against definitions written apart from it."""
    torch = pytest.importorskip("torch")
    q, k, v, dout, dlse, kw = joint_inputs(case)
    bq, bk = case["blocks"]
    extra = dict(block_q=bq, block_k=bk) if impl == "blocked" else {}
    out, cache = A.sdpa_forward(q, k, v, impl=impl, **extra, **kw)
    keep = A.dropout_keep_mask(cache)  # the oracle takes the keep-mask a seed drew
    empty = np.isneginf(cache.lse)  # anything on these rows' dlse is ignored, NaN and inf included
    grads = A.sdpa_backward(dout, cache, dlse=np.where(empty, case["dlse_empty"], dlse))

    # the arrays as torch tensors; q, k, v, a floating mask and the sinks are differentiated
    tkw = {n: a for n, a in dict(kw, q=q, k=k, v=v, dropout_mask=keep).items() if n != "rng"}
    leaves = {}
    for name, a in tkw.items():
        if isinstance(a, np.ndarray):
            tkw[name] = torch.tensor(a)
            if name in ("q", "k", "v", "mask", "sinks") and a.dtype != bool:
                leaves[name] = tkw[name].requires_grad_()
    t_out, t_p, t_lse = torch_attention(torch, **tkw)
    finite = torch.isfinite(t_lse)
    loss = (t_out * torch.from_numpy(dout)).sum()
    loss = loss + torch.where(finite, t_lse * torch.from_numpy(dlse), 0.0).sum()
    loss.backward()

    np.testing.assert_allclose(out, t_out.detach().numpy(), rtol=1e-11, atol=1e-11)
    np.testing.assert_array_equal(empty, ~finite.numpy())
    np.testing.assert_allclose(cache.lse[~empty], t_lse.detach().numpy()[~empty], rtol=1e-12, atol=1e-11)
    if impl == "reference":
        np.testing.assert_allclose(A.weights(cache), t_p.detach().numpy(), rtol=1e-11, atol=1e-13)
    want = dict(dq=leaves["q"].grad, dk=leaves["k"].grad, dv=leaves["v"].grad,
                dmask=leaves["mask"].grad if "mask" in leaves else None,
                dsinks=leaves["sinks"].grad if "sinks" in leaves else None)
    for name, g in want.items():
        got = getattr(grads, name)
        assert (got is None) == (g is None), name
        if g is not None:
            scale = max(1.0, float(g.abs().max()))
            np.testing.assert_allclose(got, g.numpy(), rtol=1e-10, atol=1e-10 * scale, err_msg=name)


HALVES = [("numpy", "float16"), ("torch", "float16"), ("torch", "bfloat16")]


@pytest.mark.parametrize("backend_name,dtype_name", HALVES, ids=[f"{b}-{d}" for b, d in HALVES])
@given(case=joint_cases())
def test_half_precision_with_options_drawn_together_is_float32_rounded_once(backend_name, dtype_name,
                                                                            case):
    """Half-precision inputs with the options of ``joint_cases``: each implementation's out
    and gradients are, bit for bit, its own float32 run on the upcast inputs rounded once
    (docs/dtypes.md), its lse that run's float32 lse, and its keep-mask the reference's."""
    xp = backend_or_skip(backend_name)
    half = getattr(xp, dtype_name)
    q, k, v, dout, dlse, kw = joint_inputs(case)
    floating = ("q", "k", "v", "dout", "mask", "sinks")

    def on(a, name):  # float64 host -> the backend, rounded to half where it is an input
        a = from_numpy(a, xp)
        return xp.astype(a, half) if name in floating and a.dtype == xp.float64 else a

    args = {n: on(a, n) for n, a in dict(kw, q=q, k=k, v=v, dout=dout).items()
            if isinstance(a, np.ndarray)}
    up = {n: xp.astype(a, xp.float32) if a.dtype == half else a for n, a in args.items()}
    dlse = from_numpy(dlse.astype(np.float32), xp)
    bq, bk = case["blocks"]
    impls = [("reference", {}), ("blocked", dict(block_q=bq, block_k=bk))]
    if backend_name == "numpy" and not any(n in args for n in ("alibi_slopes", "sinks", "q_segments")) \
            and kw["softcap"] is None:
        impls.append(("numpy", {}))
    keeps = []
    for impl, extra in impls:
        runs = []
        for arrays in (args, up):
            call = dict(kw, **{n: a for n, a in arrays.items() if n in kw})
            out, c = A.sdpa_forward(arrays["q"], arrays["k"], arrays["v"], impl=impl, **extra, **call)
            runs.append((out, c.lse, *A.sdpa_backward(arrays["dout"], c, dlse=dlse)))
            keeps.append(A.dropout_keep_mask(c))
        for name, a, a32 in zip(("out", "lse") + F.SDPAGrads._fields, *runs):
            if a32 is None:
                assert a is None, f"{impl}: {name}"
                continue
            want = a32 if name == "lse" else xp.astype(a32, half)
            assert a.dtype == want.dtype, f"{impl}: {name}"
            # via float32, exact for halves: NumPy holds no bfloat16
            np.testing.assert_array_equal(to_numpy(xp.astype(a, xp.float32)),
                                          to_numpy(xp.astype(want, xp.float32)),
                                          err_msg=f"{impl}: {name} is not float32 rounded once")
    for keep in keeps[1:]:
        assert (keep is None) == (keeps[0] is None)
        if keep is not None:
            first = to_numpy(keeps[0])
            np.testing.assert_array_equal(np.broadcast_to(to_numpy(keep), first.shape), first)


# --------------------------------------------------------------------------
# the NumPy kernel's window: tiles that meet only the keys the window leaves

POSITIONAL = ["window", "window_left", "causal_bottom_right"]


@pytest.mark.parametrize("dropout", [None, "mask", "seed"])
@pytest.mark.parametrize("Lq,Lk", SHAPES + [(300, 280)])  # 300 rows: several tiles per head
@pytest.mark.parametrize("name", POSITIONAL)
def test_numpy_kernel_window_matches_oracle_and_reference(name, Lq, Lk, dropout):
    q, k, v, dout, dlse, kw = make_case(name, Lq, Lk, seed=11)
    rng = np.random.default_rng(12)
    if dropout == "mask":
        kw.update(dropout_p=0.25, dropout_mask=rng.random((2, 4, Lq, Lk)) >= 0.25)
    elif dropout == "seed":
        kw.update(dropout_p=0.25, rng=5)
    out, c = A.sdpa_forward(q, k, v, impl="numpy", **kw)
    assert isinstance(c, numpy_kernel.NumpySDPACache)
    ref_out, ref_c = A.sdpa_forward(q, k, v, impl="reference", **kw)
    np.testing.assert_array_equal(A.dropout_keep_mask(c), A.dropout_keep_mask(ref_c))
    if dropout != "seed":
        want, want_lse = oracle(q, k, v, **kw)
        np.testing.assert_allclose(out, want, rtol=1e-12, atol=1e-12)
        np.testing.assert_allclose(c.lse, want_lse, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(out, ref_out, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(A.weights(c), A.weights(ref_c), rtol=1e-12, atol=1e-14)
    for g, g_ref in zip(A.sdpa_backward(dout, c, dlse=dlse), A.sdpa_backward(dout, ref_c, dlse=dlse)):
        assert (g is None) == (g_ref is None)
        if g is not None:
            np.testing.assert_allclose(g, g_ref, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("L,window,tile_elems", [
    (18, (3, 0), 1),  # blocks of 16 rows: the last, rows 16:18, cuts one key (13) for row 17
    (20, (18, 0), None),  # one block of 20 rows, where row 19 alone must not see key 0
])
def test_numpy_kernel_window_that_cuts_one_key_of_a_block(L, window, tile_elems, monkeypatch):
    """A block whose rows differ by one key on the window's left edge: the kernel must still
    leave that key out of the later row (out and lse from their definitions, gradients
    against the reference)."""
    if tile_elems is not None:
        monkeypatch.setattr(numpy_kernel, "TILE_ELEMS", tile_elems)
    rng = np.random.default_rng(21)
    q, k = rng.standard_normal((1, 2, L, 3)), rng.standard_normal((1, 2, L, 3))
    v, dout = rng.standard_normal((1, 2, L, 2)), rng.standard_normal((1, 2, L, 2))
    out, c = A.sdpa_forward(q, k, v, impl="numpy", window=window)
    want, want_lse = oracle(q, k, v, window=window)
    np.testing.assert_allclose(out, want, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(c.lse, want_lse, rtol=1e-12, atol=1e-12)
    ref_out, ref_c = A.sdpa_forward(q, k, v, impl="reference", window=window)
    for g, g_ref in zip(A.sdpa_backward(dout, c)[:3], A.sdpa_backward(dout, ref_c)[:3]):
        np.testing.assert_allclose(g, g_ref, rtol=1e-12, atol=1e-12)


def test_numpy_kernel_window_with_a_float_mask_and_empty_rows():
    """Bottom-right window with Lq > Lk: the first rows see no key (their tiles are
    skipped, and the cache's row factors there are 1, as documented for an empty row); a
    floating mask's gradient is summed in the tiles the window leaves."""
    rng = np.random.default_rng(13)
    Lq, Lk = 300, 100  # tiles of 64 rows: the first three see no key at all
    q, k, v, dout = (rng.standard_normal(s) for s in [(2, 2, Lq, 3), (2, 2, Lk, 3), (2, 2, Lk, 2),
                                                       (2, 2, Lq, 2)])
    mask = np.where(rng.random((2, 1, Lq, Lk)) > 0.2, rng.standard_normal((2, 1, Lq, Lk)), -np.inf)
    kw = dict(mask=mask, window=(1, 0), align="bottom_right")
    out, c = A.sdpa_forward(q, k, v, impl="numpy", **kw)
    ref_out, ref_c = A.sdpa_forward(q, k, v, impl="reference", **kw)
    assert np.all(out[:, :, :Lq - Lk] == 0) and np.isneginf(c.lse[:, :, :Lq - Lk]).all()
    assert np.all(c.row_scale.reshape(c.lse.shape)[:, :, :Lq - Lk] == 1.0)  # [B, Hq, Lq]
    np.testing.assert_allclose(out, ref_out, rtol=1e-12, atol=1e-13)
    for g, g_ref in zip(A.sdpa_backward(dout, c)[:4], A.sdpa_backward(dout, ref_c)[:4]):
        np.testing.assert_allclose(g, g_ref, rtol=1e-12, atol=1e-13)


# --------------------------------------------------------------------------
# lse and dlse on the implementations without options (the NumPy kernel, plain calls)


@pytest.mark.parametrize("impl", ["reference", "numpy", "blocked"])
def test_lse_and_dlse_on_plain_calls(impl):
    rng = np.random.default_rng(4)
    q, k = rng.standard_normal((2, 4, 5, 3)), rng.standard_normal((2, 2, 7, 3))
    v, dout = rng.standard_normal((2, 2, 7, 2)), rng.standard_normal((2, 4, 5, 2))
    dlse = rng.standard_normal((2, 4, 5))
    mask = np.where(rng.random((2, 1, 5, 7)) > 0.3, 0.5, -np.inf)
    mask[0, :, 2] = -np.inf  # an empty row
    kw = dict(mask=mask, is_causal=True, enable_gqa=True)
    out, cache = A.sdpa_forward(q, k, v, impl=impl, **kw)
    _, want_lse = oracle(q, k, v, **kw)
    np.testing.assert_allclose(cache.lse, want_lse, rtol=1e-12, atol=1e-12)
    assert np.isneginf(cache.lse[0, :, 2]).all()
    g = A.sdpa_backward(dout, cache, dlse=dlse)
    g0 = A.sdpa_backward(dout, cache)
    ref = A.sdpa_backward(dout, A.sdpa_forward(q, k, v, impl="reference", **kw)[1], dlse=dlse)
    for a, b in zip(g, ref):
        if a is not None:
            np.testing.assert_allclose(a, b, rtol=1e-12, atol=1e-12)
    assert not np.allclose(g.dq, g0.dq), "dlse must change dq"


def test_sech_squared_is_the_derivative_of_tanh_without_cancelling():
    u = np.array([-1e4, -30.0, -8.0, -1.0, 0.0, 0.5, 3.0, 8.0, 30.0, 1e4, np.inf])
    with np.errstate(all="raise"):  # no overflow on the way, underflow to 0 allowed below
        with np.errstate(under="ignore"):
            got = F.sech_squared(np, u)
    want = (1.0 / np.cosh(np.clip(u, -700, 700))) ** 2  # float64: cosh(700) is finite
    # beyond the clamp (abs(u) > 354): about 4 x the smallest normal float64 instead of less
    np.testing.assert_allclose(got, want, rtol=1e-14, atol=5 * np.finfo(np.float64).smallest_normal)
    np.testing.assert_allclose(F.sech_squared(np, u[3:8]), 1.0 - np.tanh(u[3:8]) ** 2, rtol=1e-9)
    u32 = np.float32([6.0, 8.0, 9.5])  # tanh rounds to 1 in float32 from about 9
    exact = 1.0 / np.cosh(u32.astype(np.float64)) ** 2
    np.testing.assert_allclose(F.sech_squared(np, u32), exact, rtol=1e-6)
    assert np.max(np.abs(1.0 - np.tanh(u32) ** 2 - exact) / exact) > 0.1  # what it avoids


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_sech_squared_beyond_its_clamp_is_four_times_the_smallest_normal_number(dtype):
    """Past ``C = -log(tiny) / 2`` the value is ``sech^2(C) = 4 tiny / (1 + tiny)^2``, a normal
    positive number, where the exact ``sech^2(u)`` would underflow to 0."""
    tiny = float(np.finfo(dtype).smallest_normal)
    u = np.array([-1e4, -200.0, 60.0, 400.0, 1e4], dtype=dtype)
    u = u[np.abs(u) > -0.5 * np.log(tiny) + 1.0]  # every entry beyond the clamp of dtype
    assert u.size >= 2
    with np.errstate(under="ignore"):
        got = F.sech_squared(np, u)
    assert got.dtype == dtype
    np.testing.assert_allclose(got.astype(np.float64), np.full(u.shape, 4.0 * tiny), rtol=1e-4)


@pytest.mark.parametrize("impl", ["reference", "blocked"])
@pytest.mark.parametrize("lo", [4.0, 7.0])
def test_softcap_gradients_in_float32_where_tanh_saturates(xp, to_xp, to_np, impl, lo):
    """Scores of ``lo`` to ``lo + 2.3`` softcaps: 1 - tanh^2 in float32 lost dq and dk
    (relative errors of 6e-4 at 4 softcaps, 0.4 at 7); sech^2 of s / softcap keeps them to
    float32's rounding of the float64 computation on the same inputs."""
    rng = np.random.default_rng(14)
    B, H, L, D, cap = 1, 2, 16, 1, 30.0
    q = rng.uniform(lo, lo + 2, (B, H, L, D)) * rng.choice([-1, 1], (B, H, L, D))
    k = cap * rng.uniform(1.0, 1.1, (B, H, L, D))  # D = 1, scale 1: s = q k
    v, dout = rng.standard_normal((B, H, L, D)), rng.standard_normal((B, H, L, D))
    q, k, v, dout = (a.astype(np.float32) for a in (q, k, v, dout))
    _, c64 = A.sdpa_forward(*(a.astype(np.float64) for a in (q, k, v)), softcap=cap, impl="reference")
    want = A.sdpa_backward(dout.astype(np.float64), c64)
    extra = BLOCKS if impl == "blocked" else {}
    _, c = A.sdpa_forward(to_xp(q), to_xp(k), to_xp(v), softcap=cap, impl=impl, **extra)
    got = A.sdpa_backward(to_xp(dout), c)
    for name in ("dq", "dk", "dv"):
        g, w = to_np(getattr(got, name)).astype(np.float64), getattr(want, name)
        assert np.max(np.abs(g - w)) <= 2e-5 * np.max(np.abs(w)), name


@pytest.mark.parametrize("impl", ["reference", "blocked"])
def test_softcap_as_small_as_a_float_gets_without_a_warning(impl):
    """``softcap`` = 5e-324 (the least subnormal, a finite float > 0 as the docs allow):
    s / softcap overflows to +-inf and tanh of it is +-1, so every capped score is
    +-5e-324, the weights are uniform over the keys, out is the mean of v and dv is the
    sum of dout over the queries / Lk; dq and dk are 0 to 1e-300 (sech^2 at its clamp).
    NumPy's overflow warning there was a false alarm (an error under -W error)."""
    rng = np.random.default_rng(15)
    q, k = rng.standard_normal((2, 2, 3, 4)), rng.standard_normal((2, 2, 5, 4))
    v = rng.standard_normal((2, 2, 5, 2))
    dout = rng.standard_normal((2, 2, 3, 2))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out, c = A.sdpa_forward(q, k, v, softcap=5e-324, impl=impl, **(BLOCKS if impl == "blocked" else {}))
        g = A.sdpa_backward(dout, c)
    np.testing.assert_allclose(out, np.broadcast_to(v.mean(axis=-2, keepdims=True), out.shape), rtol=1e-13)
    dv = np.broadcast_to(dout.sum(axis=-2, keepdims=True) / 5, v.shape)  # [B, H, Lk, Dv]
    np.testing.assert_allclose(g.dv, dv, rtol=1e-13)
    assert np.max(np.abs(g.dq)) < 1e-300 and np.max(np.abs(g.dk)) < 1e-300


@pytest.mark.parametrize("block_q", [1, 2, 5])
def test_no_sink_on_rows_whose_blocks_are_all_skipped(xp, to_xp, to_np, block_q):
    """A sink of -inf is no sink: a row that a bottom-right causal call (Lq > Lk) leaves
    nothing, and whose key blocks the blocked path skips, is empty as on the reference
    (zero output, lse -inf, finite dsinks); it kept the sink's l = 1 and gave NaN."""
    rng = np.random.default_rng(13)
    q, k, v = rng.standard_normal((2, 2, 5, 3)), rng.standard_normal((2, 2, 3, 3)), rng.standard_normal((2, 2, 3, 2))
    dout, dlse = rng.standard_normal((2, 2, 5, 2)), rng.standard_normal((2, 2, 5))
    kw = dict(is_causal=True, align="bottom_right", sinks=np.array([-np.inf, 0.4]))
    _, ref = A.sdpa_forward(q, k, v, impl="reference", **kw)
    g_ref = A.sdpa_backward(dout, ref, dlse=dlse)
    out, c = A.sdpa_forward(to_xp(q), to_xp(k), to_xp(v), impl="blocked", block_q=block_q, block_k=2,
                            **{**kw, "sinks": to_xp(kw["sinks"])})
    g = A.sdpa_backward(to_xp(dout), c, dlse=to_xp(dlse))
    assert np.isneginf(to_np(c.lse)[:, 0, :2]).all() and np.all(to_np(out)[:, 0, :2] == 0)
    np.testing.assert_array_equal(to_np(c.lse) == -np.inf, ref.lse == -np.inf)
    for name in ("dq", "dk", "dv", "dsinks"):
        np.testing.assert_allclose(to_np(getattr(g, name)), getattr(g_ref, name), rtol=1e-12, atol=1e-12,
                                   err_msg=name)


@pytest.mark.parametrize("impl", ["reference", "blocked", "numpy"])
def test_dlse_on_rows_with_nothing_to_attend_does_not_matter(backend, xp, to_xp, to_np, on_backend,
                                                            impl):
    """A row with nothing to attend has lse = -inf whatever its scores (p = 0 there), so its
    dlse entry moves no gradient: +inf (what flash-attn's lse holds there), -inf or NaN give
    the same finite gradients as 0, and the row's dq is 0. With sinks a head whose sink is
    -inf ("no sink") has such rows too, and dsinks stays finite."""
    if impl == "numpy" and backend != "numpy":
        pytest.skip("the NumPy kernel takes NumPy arrays")
    rng = np.random.default_rng(12)
    q, k = rng.standard_normal((2, 4, 5, 3)), rng.standard_normal((2, 2, 7, 3))
    v, dout = rng.standard_normal((2, 2, 7, 2)), rng.standard_normal((2, 4, 5, 2))
    mask = rng.random((2, 1, 5, 7)) > 0.3
    mask[0, :, 2] = False  # empty rows, in a block with other rows (blocked skips no block)
    mask[1, :, 4] = False
    cases = [dict(mask=mask, is_causal=True, enable_gqa=True)]
    if impl != "numpy":  # the kernel takes no sinks
        cases.append(dict(mask=mask, enable_gqa=True, sinks=np.array([-np.inf, 0.3, -np.inf, -1.0])))
    for kw in cases:
        _, cache = run(on_backend, impl, to_xp(q), to_xp(k), to_xp(v), kw)
        _, ref_cache = A.sdpa_forward(q, k, v, impl="reference", **kw)
        empty = np.isneginf(to_np(cache.lse))  # [B, Hq, Lq]
        assert empty[0, :, 2].all() or "sinks" in kw
        assert empty[0, 0, 2] and empty[1, 2, 4] and not empty.all()
        dlse = np.where(empty, 0.0, rng.standard_normal(empty.shape))
        base = A.sdpa_backward(to_xp(dout), cache, dlse=to_xp(dlse))
        ref = A.sdpa_backward(dout, ref_cache, dlse=dlse)
        for name in ("dq", "dk", "dv", "dsinks"):
            g, g_ref = to_np(getattr(base, name)), getattr(ref, name)
            if g_ref is None:
                continue
            assert np.isfinite(g).all(), name
            np.testing.assert_allclose(g, g_ref, rtol=1e-12, atol=1e-12, err_msg=name)
        assert np.all(to_np(base.dq)[empty] == 0.0)
        for bad in (np.inf, -np.inf, np.nan):
            g = A.sdpa_backward(to_xp(dout), cache, dlse=to_xp(np.where(empty, bad, dlse)))
            for name in ("dq", "dk", "dv", "dsinks"):
                if getattr(base, name) is not None:
                    np.testing.assert_array_equal(to_np(getattr(g, name)), to_np(getattr(base, name)),
                                                  err_msg=f"{name}, dlse = {bad} on empty rows")


# --------------------------------------------------------------------------
# options of the public API: masks builders, dispatcher, errors


@pytest.mark.parametrize("impl", ["reference", "blocked", "numpy"])
@pytest.mark.parametrize("align", ["top_left", "bottom_right"])
def test_windows_wider_than_any_distance_are_unbounded_on_every_backend(backend, to_xp, to_np,
                                                                          impl, align):
    """A window side of 10**30 (past int64) allows what no bound allows: (10**30, 0) is the
    causal mask and (10**30, 10**30) no window, on every backend (torch compared its int64
    positions with -10**30 and raised OverflowError)."""
    if impl == "numpy" and backend != "numpy":
        pytest.skip("the NumPy kernel takes NumPy arrays")
    rng = np.random.default_rng(31)
    q, k, v = (rng.standard_normal(s) for s in ((2, 3, 5, 4), (2, 3, 7, 4), (2, 3, 7, 2)))
    dout = rng.standard_normal((2, 3, 5, 2))
    huge = 10**30
    for window, same in (((huge, 0), dict(is_causal=True)), ((huge, huge), {}),
                         ((2**70, 1), dict(window=(None, 1)))):
        out, cache = run(lambda kw: kw, impl, to_xp(q), to_xp(k), to_xp(v),
                         dict(window=window, align=align))
        ref, ref_cache = A.sdpa_forward(q, k, v, impl="reference", align=align, **same)
        np.testing.assert_allclose(to_np(out), ref, rtol=1e-12, atol=1e-12, err_msg=str(window))
        grads = A.sdpa_backward(to_xp(dout), cache)
        for g, g_ref in zip(grads[:3], A.sdpa_backward(dout, ref_cache)[:3]):
            np.testing.assert_allclose(to_np(g), g_ref, rtol=1e-12, atol=1e-12, err_msg=str(window))


@pytest.mark.parametrize("align", ["top_left", "bottom_right"])
@pytest.mark.parametrize("left,right", [(2, 1), (None, 0), (0, None), (1, 3)])
def test_window_mask_builder_equals_the_option(left, right, align):
    rng = np.random.default_rng(5)
    q, k, v = (rng.standard_normal(s) for s in [(2, 2, 6, 3), (2, 2, 4, 3), (2, 2, 4, 3)])
    built = masks.window(6, 4, left, right, align)
    i, j = np.arange(6)[:, None], np.arange(4)[None, :]
    o = 0 if align == "top_left" else 4 - 6
    want = np.ones((6, 4), bool)
    if left is not None:
        want &= j >= i + o - left
    if right is not None:
        want &= j <= i + o + right
    np.testing.assert_array_equal(built, want)
    a, _ = F.sdpa_forward(q, k, v, window=(left, right), align=align)
    b, _ = F.sdpa_forward(q, k, v, mask=built)
    np.testing.assert_allclose(a, b, rtol=1e-14, atol=1e-14)


def test_segments_mask_builder_equals_the_option():
    rng = np.random.default_rng(6)
    q, k, v = (rng.standard_normal(s) for s in [(2, 2, 5, 3), (2, 2, 7, 3), (2, 2, 7, 3)])
    _, _, _, _, _, kw = make_case("segments", 5, 7)
    built = masks.segments(kw["q_segments"], kw["k_segments"])
    assert built.shape == (2, 1, 5, 7)
    assert built[0, 0, 0, 0] and not built[0, 0, 0, 6] and not built[1, 0, 4].any()
    a, _ = F.sdpa_forward(q, k, v, **kw)
    b, _ = F.sdpa_forward(q, k, v, mask=built)
    np.testing.assert_allclose(a, b, rtol=1e-14, atol=1e-14)


def test_is_plain_and_is_positional_by_their_definitions():
    """What the dispatcher reads to refuse the NumPy kernel and the chunked path: plain is
    no option at all (an alignment counts only with is_causal, the one diagonal it moves
    without a window); positional allows a window and an alignment, nothing else."""
    q, k = np.zeros((2, 2, 3, 4)), np.zeros((2, 2, 5, 4))
    seg = dict(q_segments=np.zeros((2, 3), np.int64), k_segments=np.zeros((2, 5), np.int64))
    plain, bottom = F.score_options(q, k), F.score_options(q, k, align="bottom_right")
    assert F.is_plain(plain, False) and F.is_plain(plain, True) and F.is_plain(bottom, False)
    assert not F.is_plain(bottom, True)
    assert F.is_positional(plain) and F.is_positional(bottom)
    for kw in (dict(window=(1, None)), dict(window=(None, 1))):
        o = F.score_options(q, k, **kw)
        assert not F.is_plain(o, False) and F.is_positional(o), kw
    for kw in (dict(softcap=1.0), dict(alibi_slopes=np.ones(2)), dict(sinks=np.zeros(2)), seg):
        o = F.score_options(q, k, **kw)
        assert not F.is_plain(o, False) and not F.is_positional(o), kw


def test_a_window_given_as_a_list_is_the_pair():
    rng = np.random.default_rng(12)
    q, k, v = (rng.standard_normal((2, 2, 4, 3)) for _ in range(3))
    np.testing.assert_array_equal(F.sdpa_forward(q, k, v, window=[1, 0])[0],
                                  F.sdpa_forward(q, k, v, window=(1, 0))[0])


def test_slopes_and_sinks_of_another_library_are_named():
    xps = pytest.importorskip("array_api_strict")
    rng = np.random.default_rng(13)
    q, k, v = (rng.standard_normal((2, 2, 4, 3)) for _ in range(3))
    for name in ("alibi_slopes", "sinks"):
        with pytest.raises(TypeError,
                           match=rf"^{name}: expected an? \S+ array \(that of q\), got an array_api_strict"):
            F.sdpa_forward(q, k, v, **{name: xps.ones(2, dtype=xps.float64)})


def test_dispatcher_runs_options_on_reference_and_blocked():
    rng = np.random.default_rng(7)
    q, k, v = (rng.standard_normal((2, 2, 4, 3)) for _ in range(3))
    _, c = A.sdpa_forward(q, k, v, softcap=2.0)
    assert isinstance(c, F.SDPACache)  # the NumPy kernel takes no softcap
    _, c = A.sdpa_forward(q, k, v, window=(1, 0), align="bottom_right")
    assert isinstance(c, numpy_kernel.NumpySDPACache)  # ... but a window, and plain calls
    _, c = A.sdpa_forward(q, k, v)
    assert isinstance(c, numpy_kernel.NumpySDPACache)
    for impl in ("numpy",):
        with pytest.raises(ValueError, match="impl='numpy'.*reference.*blocked"):
            A.sdpa_forward(q, k, v, softcap=3.0, impl=impl)
    # need_weights with options: the reference returns them
    _, c = A.sdpa_forward(q, k, v, sinks=np.zeros(2), need_weights=True)
    w = A.weights(c)
    assert np.all(np.sum(w, axis=-1) < 1.0)  # the sink takes its share of every row


@pytest.mark.parametrize("impl", ["reference", "blocked"])
def test_half_precision_sinks_and_slopes(impl):
    """Sinks are of q's dtype and so is dsinks; float16 q also takes float32 slopes
    (flash-attn's), computed in float32 like the scores: the float64 computation of the
    float16-rounded values, within float16's rounding."""
    rng = np.random.default_rng(11)
    q, k, v = (rng.standard_normal((2, 2, 4 + i, 8)).astype(np.float16) for i in (0, 1, 1))
    sinks = rng.standard_normal(2).astype(np.float16)
    slopes = rng.uniform(0.1, 1.0, 2).astype(np.float32)
    dout = rng.standard_normal((2, 2, 4, 8)).astype(np.float16)
    kw = dict(sinks=sinks, alibi_slopes=slopes, is_causal=True)
    o, c = A.sdpa_forward(q, k, v, impl=impl, **kw)
    g = A.sdpa_backward(dout, c)
    assert o.dtype == g.dq.dtype == g.dsinks.dtype == np.float16
    o64, c64 = F.sdpa_forward(*(t.astype(np.float64) for t in (q, k, v)), sinks=sinks.astype(np.float64),
                              alibi_slopes=slopes.astype(np.float64), is_causal=True)
    g64 = F.sdpa_backward(dout.astype(np.float64), c64)
    np.testing.assert_allclose(o.astype(np.float64), o64, rtol=0, atol=4e-3)
    np.testing.assert_allclose(g.dsinks.astype(np.float64), g64.dsinks, rtol=1e-2, atol=4e-3)
    with pytest.raises(TypeError, match=r"sinks: expected dtype float16 \(that of q\), got float32"):
        A.sdpa_forward(q, k, v, impl=impl, sinks=sinks.astype(np.float32))


@pytest.mark.parametrize("kw,err,match", [
    (dict(align="bottom"), ValueError, "^align: expected 'top_left' or 'bottom_right', got 'bottom'$"),
    (dict(window=3), TypeError,
     r"^window: expected None or a pair \(left, right\) of ints >= 0 or None, got int 3$"),
    (dict(window=(-1, 0)), ValueError, r"^window\[0\] \(left\): expected None or an int >= 0, got -1$"),
    (dict(window=(0, 1.5)), TypeError,
     r"^window\[1\] \(right\): expected None or an int >= 0, got float 1\.5$"),
    (dict(softcap=0.0), ValueError, r"^softcap: expected a finite float > 0, got 0\.0$"),
    # softcap * tanh(s / softcap) is even in softcap: -1 computes what 1 does, and is refused
    (dict(softcap=-1.0), ValueError, r"^softcap: expected a finite float > 0, got -1\.0$"),
    (dict(softcap="1"), TypeError, "^softcap: expected None or a float > 0, got str '1'$"),
    (dict(softcap=math.inf), ValueError, "^softcap: expected a finite float > 0, got inf$"),
    (dict(softcap=True), TypeError, "^softcap: expected None or a float > 0, got bool True$"),
    (dict(window=(True, 0)), TypeError,
     r"^window\[0\] \(left\): expected None or an int >= 0, got bool True$"),
    (dict(window=(1, 0, 0)), TypeError,
     r"^window: expected None or a pair \(left, right\) .*, got tuple \(1, 0, 0\)$"),
    (dict(align=np.array(["top_left", "bottom_right"])), TypeError,
     r"^align: expected 'top_left' or 'bottom_right', got numpy\.ndarray "
     r"array\(\['top_left', 'bottom_right'\]"),
    (dict(alibi_slopes=np.ones(3)), ValueError,
     r"^alibi_slopes: expected shape \(2,\) or \(2, 2\) \(H heads of q\), got \(3,\)$"),
    (dict(alibi_slopes=np.ones(2, dtype=np.int64)), TypeError,
     "^alibi_slopes: expected a real floating dtype, got int64$"),
    (dict(sinks=np.ones((2, 2))), ValueError,
     r"^sinks: expected shape \(2,\) \(H heads of q\), got \(2, 2\)$"),
    (dict(sinks=np.ones(2, dtype=np.float32)), TypeError,
     r"^sinks: expected dtype float64 \(that of q\), got float32 \(no silent promotion\)$"),
    (dict(align="Bottom_Right"), ValueError,  # no case folding
     "^align: expected 'top_left' or 'bottom_right', got 'Bottom_Right'$"),
    (dict(q_segments=np.zeros((2, 4), dtype=np.int64)), ValueError,
     "^q_segments: packed sequences need both q_segments and k_segments, got only q_segments$"),
    (dict(k_segments=np.zeros((2, 5), dtype=np.int64)), ValueError,
     "^k_segments: packed sequences need both q_segments and k_segments, got only k_segments$"),
    (dict(q_segments=np.zeros((2, 4), dtype=bool), k_segments=np.zeros((2, 5), dtype=bool)), TypeError,
     "^q_segments: expected an integer array of segment ids, got dtype bool$"),
    (dict(q_segments=np.zeros((2, 4)), k_segments=np.zeros((2, 5))), TypeError,
     "^q_segments: expected an integer array of segment ids, got dtype float64$"),
    (dict(q_segments=np.zeros((2, 3), dtype=np.int64), k_segments=np.zeros((2, 5), dtype=np.int64)),
     ValueError, r"^q_segments: expected shape \(B, 4\) = \(2, 4\), got \(2, 3\)$"),
    (dict(q_segments=np.zeros((3, 4), dtype=np.int64), k_segments=np.zeros((2, 5), dtype=np.int64)),
     ValueError, r"^q_segments: expected shape \(B, 4\) = \(2, 4\), got \(3, 4\)$"),
    (dict(q_segments=[[0] * 4] * 2, k_segments=np.zeros((2, 5), dtype=np.int64)), TypeError,
     r"^q_segments: expected an? \w+ array, got list$"),
])
@pytest.mark.parametrize("entry", ["functional", "attention", "blocked"])
def test_bad_options_are_named_before_any_computation(kw, err, match, entry):
    rng = np.random.default_rng(8)
    q, k, v = rng.standard_normal((2, 2, 4, 3)), rng.standard_normal((2, 2, 5, 3)), rng.standard_normal((2, 2, 5, 3))
    before = [a.copy() for a in (q, k, v)]
    fn = {"functional": F.sdpa_forward, "attention": A.sdpa_forward,
          "blocked": npattn.blocked.sdpa_blocked_forward}[entry]
    with pytest.raises(err, match=match):
        fn(q, k, v, **kw)
    for a, b in zip((q, k, v), before):
        np.testing.assert_array_equal(a, b)


def test_segments_need_q_k_v_of_four_axes():
    """Segment ids are (B, L): with a 5-D q (A, B, H, L, Dh) whose lead (A, B, H) ends in a
    B of their length, they are still refused, not read as one batch axis of several."""
    rng = np.random.default_rng(8)
    q, k, v = (rng.standard_normal((1, 2, 2, n, 3)) for n in (4, 5, 5))
    seg_q, seg_k = np.zeros((2, 4), dtype=np.int64), np.zeros((2, 5), dtype=np.int64)
    for fn in (F.sdpa_forward, A.sdpa_forward):
        with pytest.raises(ValueError, match=r"^q_segments: expected shape \(B, L\) with q, k, v of 4 axes"):
            fn(q, k, v, q_segments=seg_q, k_segments=seg_k)


def test_segment_ids_torch_cannot_compare_name_k_segments():
    """torch promotes no int64 with uint64 (a RuntimeError of its own): a TypeError naming
    k_segments, before any computation."""
    torch = pytest.importorskip("torch")
    q, k, v = (torch.zeros((2, 2, n, 3), dtype=torch.float64) for n in (4, 5, 5))
    seg_q = torch.zeros((2, 4), dtype=torch.int64)
    seg_k = torch.zeros((2, 5), dtype=torch.uint64)
    with pytest.raises(TypeError, match=r"^k_segments: expected an integer dtype that .* compares with "
                                        r"q_segments' int64, got uint64$"):
        F.sdpa_forward(q, k, v, q_segments=seg_q, k_segments=seg_k)


def test_dlse_is_checked():
    rng = np.random.default_rng(9)
    q, k, v = (rng.standard_normal((2, 2, 4, 3)) for _ in range(3))
    for impl in ("reference", "numpy", "blocked"):
        out, c = A.sdpa_forward(q, k, v, impl=impl)
        with pytest.raises(ValueError, match="dlse"):
            A.sdpa_backward(np.ones_like(out), c, dlse=np.ones((2, 2, 3)))
        with pytest.raises(TypeError, match="dlse"):
            A.sdpa_backward(np.ones_like(out), c, dlse=np.ones((2, 2, 4), dtype=np.float32))


def test_broadcast_leading_axes_match_explicit_broadcast():
    """q (1, H, ...) against k, v (B, 1, ...): the same as broadcasting them by hand,
    with each gradient summed back to its input's shape."""
    q, k, v, dout, dlse, kw = make_case("broadcast", 5, 7, seed=10)
    full = [np.broadcast_to(a, (2, 4) + a.shape[2:]).copy() for a in (q, k, v)]
    for impl in IMPLS:
        out, c = run(lambda d: d, impl, q, k, v, kw)
        out_f, c_f = run(lambda d: d, impl, *full, kw)
        np.testing.assert_allclose(out, out_f, rtol=1e-13, atol=1e-13)
        g = A.sdpa_backward(dout, c, dlse=dlse)
        g_f = A.sdpa_backward(dout, c_f, dlse=dlse)
        for a, b, x in zip(g[:3], g_f[:3], (q, k, v)):
            assert a.shape == x.shape
            axes = tuple(i for i, n in enumerate(x.shape) if n == 1)
            np.testing.assert_allclose(a, np.sum(b, axis=axes, keepdims=True), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("gqa", [False, True])
@pytest.mark.parametrize("wide", ["q", "k", "v"])
def test_one_input_alone_carries_the_batch(xp, to_xp, to_np, wide, gqa):
    """One of q, k, v has B = 2 where the other two have 1: the output, lse and weights
    have the batch, a dout of the output's shape is taken, and each gradient is summed
    back to its input's shape (the same as broadcasting by hand), on every impl and backend."""
    rng = np.random.default_rng(11)
    Hq, Hkv = (4, 2) if gqa else (2, 2)
    shapes = {"q": (1, Hq, 5, 3), "k": (1, Hkv, 6, 3), "v": (1, Hkv, 6, 2)}
    shapes[wide] = (2,) + shapes[wide][1:]
    q, k, v = (rng.standard_normal(shapes[n]) for n in ("q", "k", "v"))
    dout = rng.standard_normal((2, Hq, 5, 2))
    full = [np.broadcast_to(a, (2,) + a.shape[1:]).copy() for a in (q, k, v)]
    kw = dict(enable_gqa=gqa, is_causal=True)
    for impl in IMPLS:
        out, c = run(lambda d: d, impl, to_xp(q), to_xp(k), to_xp(v), kw)
        out_f, c_f = run(lambda d: d, impl, *(to_xp(a) for a in full), kw)
        out, out_f = to_np(out), to_np(out_f)
        assert out.shape == (2, Hq, 5, 2) and c.lse.shape == (2, Hq, 5)
        np.testing.assert_allclose(out, out_f, rtol=1e-13, atol=1e-13)
        np.testing.assert_allclose(to_np(c.lse), to_np(c_f.lse), rtol=1e-13, atol=1e-13)
        if impl == "reference":  # (blocked keeps no weights)
            assert tuple(A.weights(c).shape) == (2, Hq, 5, 6)
            np.testing.assert_allclose(to_np(A.weights(c)), to_np(A.weights(c_f)), rtol=1e-13,
                                       atol=1e-13)
        g, g_f = A.sdpa_backward(to_xp(dout), c), A.sdpa_backward(to_xp(dout), c_f)
        for a, b, x in zip(map(to_np, g[:3]), map(to_np, g_f[:3]), (q, k, v)):
            assert a.shape == x.shape
            want = b if x.shape[0] == 2 else np.sum(b, axis=0, keepdims=True)
            np.testing.assert_allclose(a, want, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("impl", IMPLS)
def test_slopes_and_sinks_of_shape_h_without_a_batch_axis(xp, to_xp, to_np, impl):
    """q, k, v of 3 axes (H, L, Dh) take alibi_slopes and sinks of shape (H,), as with
    a batch axis: the forward matches the oracle and the gradients those of the same
    call with a batch of one (a (B, H) slope needs the batch axis and is refused)."""
    rng = np.random.default_rng(12)
    H, Lq, Lk = 2, 5, 7
    q, k, v = rng.standard_normal((H, Lq, 3)), rng.standard_normal((H, Lk, 3)), rng.standard_normal((H, Lk, 2))
    slopes, sinks = rng.random(H), rng.standard_normal(H)
    dout, dlse = rng.standard_normal((H, Lq, 2)), rng.standard_normal((H, Lq))
    kw = dict(alibi_slopes=slopes, sinks=sinks, is_causal=True, align="bottom_right")
    want_out, want_lse = oracle(q, k, v, **kw)
    xkw = {n: to_xp(a) if isinstance(a, np.ndarray) else a for n, a in kw.items()}
    out, c = run(lambda d: d, impl, to_xp(q), to_xp(k), to_xp(v), xkw)
    np.testing.assert_allclose(to_np(out), want_out, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(to_np(c.lse), want_lse, rtol=1e-12, atol=1e-12)
    out_b, c_b = run(lambda d: d, impl, to_xp(q[None]), to_xp(k[None]), to_xp(v[None]), xkw)
    g = A.sdpa_backward(to_xp(dout), c, dlse=to_xp(dlse))
    g_b = A.sdpa_backward(to_xp(dout[None]), c_b, dlse=to_xp(dlse[None]))
    for name in ("dq", "dk", "dv"):
        np.testing.assert_allclose(to_np(getattr(g, name)), to_np(getattr(g_b, name))[0],
                                   rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(to_np(g.dsinks), to_np(g_b.dsinks), rtol=1e-12, atol=1e-12)
    with pytest.raises(ValueError, match=r"alibi_slopes: expected shape \(2,\) \(H heads of q\), got \(1, 2\)"):
        run(lambda d: d, impl, to_xp(q), to_xp(k), to_xp(v), dict(alibi_slopes=to_xp(slopes[None])))


@pytest.mark.parametrize("dtype,sink", [(np.float32, 100.0), (np.float64, 800.0)])
@pytest.mark.parametrize("impl", ["reference", "blocked"])
def test_a_sink_far_above_every_score_takes_the_whole_row(impl, dtype, sink):
    """A sink logit S far above the scores z (S - z beyond the exponent range: exp(S - z)
    overflows) takes the whole row: p = exp(z - S) / (1 + sum exp(z - S)) underflows to 0, so
    out = 0 (to float32's subnormals), lse = S + log(1 + sum exp(z - S)) = S, and with delta = sum(dp * p) = 0 the
    sink's gradient is p_sink * dlse = dlse, summed over (b, i): dsinks[h] = sum dlse[:, h].
    A softmax that did not take the sink into the row's maximum shift overflowed to inf/inf."""
    rng = np.random.default_rng(14)
    B, H, Lq, Lk, Dh, Dv = 2, 3, 4, 5, 3, 2
    q, k = rng.standard_normal((B, H, Lq, Dh)), rng.standard_normal((B, H, Lk, Dh))
    v, dout = rng.standard_normal((B, H, Lk, Dv)), rng.standard_normal((B, H, Lq, Dv))
    dlse = rng.standard_normal((B, H, Lq))
    sinks = np.array([sink, sink + 1.0, sink + 2.0])  # [H]
    q, k, v, dout, dlse, sinks = (t.astype(dtype) for t in (q, k, v, dout, dlse, sinks))
    out, cache = A.sdpa_forward(q, k, v, sinks=sinks, is_causal=True, impl=impl,
                                **(BLOCKS if impl == "blocked" else {}))
    g = A.sdpa_backward(dout, cache, dlse=dlse)
    np.testing.assert_allclose(out, 0.0, rtol=0, atol=1e-30)  # float32's subnormals: exp(-100)
    np.testing.assert_allclose(cache.lse, np.broadcast_to(sinks[:, None], (B, H, Lq)), rtol=1e-6)
    np.testing.assert_allclose(g.dsinks, dlse.sum(axis=(0, 2), dtype=np.float64), rtol=1e-5)
    for d in (g.dq, g.dk, g.dv):
        np.testing.assert_allclose(d, 0.0, rtol=0, atol=1e-30)


@pytest.mark.parametrize("impl", ["reference", "blocked"])
def test_a_sink_of_minus_inf_is_no_sink_on_rows_with_nothing_to_attend(impl):
    """A sink of -inf is no sink (exp(-inf) = 0 joins the denominator), also on the rows a
    bottom-right causal call with Lq > Lk leaves nothing: head 0 gives what the call without
    sinks gives (zero output and lse -inf on those rows), its dsinks is 0, and nothing is NaN.
    A sink share e_sink / s divided by the row sum s = 0 there gave 0 / 0."""
    rng = np.random.default_rng(15)
    B, H, Lq, Lk = 2, 2, 5, 3  # rows 0 and 1 attend nothing (keys j <= i - 2)
    q, k = rng.standard_normal((B, H, Lq, 3)), rng.standard_normal((B, H, Lk, 3))
    v, dout = rng.standard_normal((B, H, Lk, 2)), rng.standard_normal((B, H, Lq, 2))
    dlse = rng.standard_normal((B, H, Lq))
    kw = dict(is_causal=True, align="bottom_right")
    extra = BLOCKS if impl == "blocked" else {}
    out, c = A.sdpa_forward(q, k, v, impl=impl, sinks=np.array([-np.inf, 0.4]), **kw, **extra)
    g = A.sdpa_backward(dout, c, dlse=dlse)
    for t in (out, g.dq, g.dk, g.dv, g.dsinks):
        assert np.all(np.isfinite(t))
    assert g.dsinks[0] == 0.0
    h0 = (slice(None), slice(0, 1))  # head 0, without sinks
    out0, c0 = F.sdpa_forward(q[h0], k[h0], v[h0], **kw)
    g0 = F.sdpa_backward(dout[h0], c0, dlse=dlse[h0])
    np.testing.assert_allclose(out[h0], out0, rtol=1e-12, atol=1e-12)
    np.testing.assert_array_equal(c.lse[h0] == -np.inf, c0.lse == -np.inf)
    assert np.isneginf(c0.lse[:, :, :2]).all()
    for a, b in zip(g[:3], g0[:3]):
        np.testing.assert_allclose(a[h0], b, rtol=1e-12, atol=1e-12)
