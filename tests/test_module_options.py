"""MultiHeadAttention's attention options: scale, softcap and learned sinks (constructor),
window, align, ALiBi and packed-sequence segments (per call).

Each is checked against attention written out by hand in NumPy float64 from
the module's parameters (projections, heads, scores, softmax with a sink),
and the gradients, ``grads["sinks"]`` included, against central differences
with a random upstream gradient, on every backend. Then the bad arguments
(named in the error, nothing changed), copies and the save format with the
new options, and the torch conversions.
"""

import copy
import functools
import json
import math
import pickle

import numpy as np
import pytest

import npattn
from npattn import MultiHeadAttention
from npattn.backend import from_numpy
from npattn.gradcheck import gradcheck_module
from npattn.module import SAVE_LATER_OPTIONS

B, LQ, LK, D, H, HKV = 2, 3, 5, 8, 4, 2


# --------------------------------------------------------------------------
# attention written out by hand


def reference(P, query, key, value, *, n_head, n_kv_head, scale=None, softcap=None,
              is_causal=False, align="top_left", window=None, alibi=None, q_seg=None,
              k_seg=None):
    """The module's forward in NumPy: ``(out [B, Lq, D], weights [B, H, Lq, Lk])``.

    Query i sits at key position ``i + o`` (``o = Lk - Lq`` bottom-right); a
    key j is allowed when ``i + o - left <= j <= i + o + right`` (causal:
    right = 0) and the segment ids agree; ALiBi adds ``-slope * |i + o - j|``;
    a sink adds ``exp(sinks[h])`` to each row's denominator.
    """
    Bq, Lq, _ = query.shape
    Lk = key.shape[1]
    Dm = P["w_q"].shape[0]
    Dh = Dm // n_head
    G = n_head // n_kv_head

    def project(x, w, b):
        return x @ P[w].T + (P[b] if b in P else 0.0)

    def heads(x, n):
        return x.reshape(Bq, x.shape[1], n, Dh).transpose(0, 2, 1, 3)  # [B, n, L, Dh]

    qh = heads(project(query, "w_q", "b_q"), n_head)
    kh = np.repeat(heads(project(key, "w_k", "b_k"), n_kv_head), G, axis=1)  # [B, H, Lk, Dh]
    vh = np.repeat(heads(project(value, "w_v", "b_v"), n_kv_head), G, axis=1)
    s = qh @ kh.transpose(0, 1, 3, 2) * (1.0 / math.sqrt(Dh) if scale is None else scale)
    if softcap is not None:
        s = softcap * np.tanh(s / softcap)
    o = Lk - Lq if align == "bottom_right" else 0
    d = np.arange(Lk)[None, :] - (np.arange(Lq)[:, None] + o)  # j - (i + o)
    if alibi is not None:
        slopes = np.broadcast_to(alibi, (Bq, n_head))[:, :, None, None]
        s = s - slopes * np.abs(d)
    left, right = (None, None) if window is None else window
    if is_causal:
        right = 0 if right is None else min(right, 0)
    allowed = np.ones((Bq, 1, Lq, Lk), dtype=bool)
    if right is not None:
        allowed &= d <= right
    if left is not None:
        allowed &= d >= -left
    if q_seg is not None:
        allowed &= q_seg[:, None, :, None] == k_seg[:, None, None, :]
    s = np.where(allowed, s, -np.inf)
    sink = P["sinks"][None, :, None, None] if "sinks" in P else None
    m = s.max(-1, keepdims=True)
    if sink is not None:
        m = np.maximum(m, sink)
    e = np.where(allowed, np.exp(s - m), 0.0)
    denom = e.sum(-1, keepdims=True) + (0.0 if sink is None else np.exp(sink - m))
    p = e / denom  # [B, H, Lq, Lk]
    oh = p @ vh  # [B, H, Lq, Dh]
    out = oh.transpose(0, 2, 1, 3).reshape(Bq, Lq, Dm) @ P["w_o"].T + P.get("b_o", 0.0)
    return out, p


def _host_params(m, to_np):
    return {n: to_np(a) for n, a in m.params.items()}


def _inputs(rng, m, Lq=LQ, Lk=LK):
    return (rng.standard_normal((B, Lq, m.qdim)), rng.standard_normal((B, Lk, m.kdim)),
            rng.standard_normal((B, Lk, m.vdim)))


def _module(backend, **kw):
    kw = dict(dict(n_kv_head=HKV, dtype="float64", seed=7, backend=backend), **kw)
    return MultiHeadAttention(D, H, **kw)


def _random_sinks(m, rng, to_xp):
    m.params["sinks"] = to_xp(rng.standard_normal(m.n_head) * 1.5)


# --------------------------------------------------------------------------
# the constructor's options


@pytest.mark.parametrize("opts", [
    dict(scale=0.3),
    dict(softcap=0.8),
    dict(sinks=True),
    dict(scale=1.7, softcap=2.0, sinks=True),
])
def test_constructor_options_match_attention_by_hand(backend, to_xp, to_np, opts):
    rng = np.random.default_rng(1)
    m = _module(backend, **opts)
    if m.sinks:
        _random_sinks(m, rng, to_xp)
    q, k, v = _inputs(rng, m)
    out, w = m(to_xp(q), to_xp(k), to_xp(v), is_causal=True, need_weights=True,
               average_attn_weights=False)
    ref_out, ref_w = reference(_host_params(m, to_np), q, k, v, n_head=H, n_kv_head=HKV,
                               scale=opts.get("scale"), softcap=opts.get("softcap"),
                               is_causal=True)
    np.testing.assert_allclose(to_np(out), ref_out, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(to_np(w), ref_w, rtol=1e-12, atol=1e-14)
    # the options change the result: a reference without them differs
    plain_out, _ = reference({n: a for n, a in _host_params(m, to_np).items() if n != "sinks"},
                             q, k, v, n_head=H, n_kv_head=HKV, is_causal=True)
    assert not np.allclose(to_np(out), plain_out, rtol=1e-6, atol=1e-6)


def test_sinks_take_weight_out_of_every_row(backend, to_xp, to_np):
    """With a sink each row's weights sum to ``1 - exp(sink_h) / (exp(sink_h) + sum_j exp(z_j))``,
    less than 1; the sinks start at zero."""
    rng = np.random.default_rng(2)
    m = _module(backend, sinks=True)
    assert tuple(m.params["sinks"].shape) == (H,)
    np.testing.assert_array_equal(to_np(m.params["sinks"]), np.zeros(H))
    _random_sinks(m, rng, to_xp)
    q, k, v = _inputs(rng, m)
    _, w = m(to_xp(q), to_xp(k), to_xp(v), need_weights=True, average_attn_weights=False)
    P = _host_params(m, to_np)
    Dh = D // H
    qh = (q @ P["w_q"].T + P["b_q"]).reshape(B, LQ, H, Dh).transpose(0, 2, 1, 3)
    kh = (k @ P["w_k"].T + P["b_k"]).reshape(B, LK, HKV, Dh).transpose(0, 2, 1, 3)
    z = qh @ np.repeat(kh, H // HKV, axis=1).transpose(0, 1, 3, 2) / math.sqrt(Dh)
    es = np.exp(P["sinks"])[None, :, None]
    expected = 1.0 - es / (es + np.exp(z).sum(-1))
    np.testing.assert_allclose(to_np(w).sum(-1), expected, rtol=1e-12)
    assert np.all(to_np(w).sum(-1) < 1.0)


def test_same_seed_same_weights_with_or_without_the_options():
    a = MultiHeadAttention(8, 2, seed=3, dtype="float64")
    b = MultiHeadAttention(8, 2, seed=3, dtype="float64", sinks=True, softcap=3.0, scale=0.5)
    assert list(b.params) == list(a.params) + ["sinks"]
    for n in a.params:
        np.testing.assert_array_equal(a.params[n], b.params[n])



def test_bias_kv_are_drawn_at_the_scale_of_the_kv_width():
    """add_bias_kv draws bias_k and bias_v normal with std 1/sqrt(Dkv): torch's Xavier-normal
    on its (1, 1, Dkv) shape, sqrt(2 / (fan_in + fan_out)) with fan_in = fan_out = Dkv. With
    n_kv_head < n_head, Dkv = 16 is not D = 64 (whose scale would be half as large); 40
    seeds give 1280 draws, whose std is within a few percent of the true one."""
    D, H, HKV = 64, 4, 1
    Dkv = HKV * D // H
    draws = np.concatenate([
        np.concatenate([m.params["bias_k"], m.params["bias_v"]])
        for m in (MultiHeadAttention(D, H, n_kv_head=HKV, add_bias_kv=True, dtype="float64",
                                     seed=s) for s in range(40))
    ])
    assert draws.shape == (40 * 2 * Dkv,)
    np.testing.assert_allclose(draws.std(), math.sqrt(2.0 / (Dkv + Dkv)), rtol=0.1)  # 0.25


# --------------------------------------------------------------------------
# the per-call options


def _call_options(rng, to_xp):
    """Each per-call option (and two together) with what ``reference`` takes for it."""
    slopes_h = rng.uniform(0.1, 1.0, H)
    slopes_bh = rng.uniform(0.1, 1.0, (B, H))
    q_seg = np.array([[0, 0, 1], [0, 1, 1]])
    k_seg = np.array([[0, 0, 1, 1, 1], [0, 0, 0, 1, 1]])
    return {
        "window": (dict(window=(1, 1)), dict(window=(1, 1))),
        "window one side": (dict(window=(None, 2)), dict(window=(None, 2))),
        "bottom_right causal": (dict(align="bottom_right", is_causal=True),
                                dict(align="bottom_right", is_causal=True)),
        "bottom_right window": (dict(align="bottom_right", window=(2, 0)),
                                dict(align="bottom_right", window=(2, 0))),
        "alibi (H,)": (dict(alibi_slopes=to_xp(slopes_h)), dict(alibi=slopes_h)),
        "alibi (B, H) bottom_right causal": (
            dict(alibi_slopes=to_xp(slopes_bh), align="bottom_right", is_causal=True),
            dict(alibi=slopes_bh, align="bottom_right", is_causal=True)),
        "segments": (dict(q_segments=to_xp(q_seg), k_segments=to_xp(k_seg)),
                     dict(q_seg=q_seg, k_seg=k_seg)),
    }


CALL_CASES = ["window", "window one side", "bottom_right causal", "bottom_right window",
              "alibi (H,)", "alibi (B, H) bottom_right causal", "segments"]


@pytest.mark.parametrize("case", CALL_CASES)
@pytest.mark.parametrize("impl", ["auto", "blocked"])
def test_call_options_match_attention_by_hand(backend, to_xp, to_np, case, impl):
    rng = np.random.default_rng(3)
    m = _module(backend, softcap=4.0, sinks=True)
    _random_sinks(m, rng, to_xp)
    fk, rk = _call_options(rng, to_xp)[case]
    q, k, v = _inputs(rng, m)
    out, w = m(to_xp(q), to_xp(k), to_xp(v), impl=impl, need_weights=impl != "blocked",
               average_attn_weights=False, **fk)
    ref_out, ref_w = reference(_host_params(m, to_np), q, k, v, n_head=H, n_kv_head=HKV,
                               softcap=4.0, **rk)
    np.testing.assert_allclose(to_np(out), ref_out, rtol=1e-12, atol=1e-12)
    if w is not None:
        np.testing.assert_allclose(to_np(w), ref_w, rtol=1e-12, atol=1e-14)
    # the option acts: without it the output differs
    plain, _ = reference(_host_params(m, to_np), q, k, v, n_head=H, n_kv_head=HKV, softcap=4.0)
    assert not np.allclose(to_np(out), plain, rtol=1e-6, atol=1e-6)


def test_self_attention_path_takes_the_options(backend, to_xp, to_np):
    """query is key is value (the one-GEMM projection) passes the options on too."""
    rng = np.random.default_rng(4)
    m = _module(backend, sinks=True, scale=0.4)
    _random_sinks(m, rng, to_xp)
    x = rng.standard_normal((B, 4, D))
    slopes = rng.uniform(0.1, 1.0, H)
    xa = to_xp(x)
    out, _ = m(xa, xa, xa, is_causal=True, window=(1, None), alibi_slopes=to_xp(slopes))
    ref, _ = reference(_host_params(m, to_np), x, x, x, n_head=H, n_kv_head=HKV, scale=0.4,
                       is_causal=True, window=(1, None), alibi=slopes)
    np.testing.assert_allclose(to_np(out), ref, rtol=1e-12, atol=1e-12)


# --------------------------------------------------------------------------
# gradients


GRAD_CASES = {
    "softcap, sinks, scale": (dict(softcap=1.5, sinks=True, scale=0.6), {}),
    # no biases: the sinks' gradient must not depend on them
    "window bottom_right causal": (dict(sinks=True, bias=False),
                                   dict(window=(2, None), align="bottom_right", is_causal=True)),
    "alibi, segments": (dict(softcap=3.0), "alibi+segments"),
}


@pytest.mark.parametrize("case", list(GRAD_CASES))
@pytest.mark.parametrize("impl", ["reference", "blocked"])
def test_module_gradients_with_the_options(backend, to_xp, case, impl):
    """Central differences of ``<out, dout>`` (random dout) for the inputs and every
    parameter, ``sinks`` included."""
    rng = np.random.default_rng(5)
    opts, fk = GRAD_CASES[case]
    m = _module(backend, block_k=2, **opts)  # several key blocks on the blocked path
    if m.sinks:
        _random_sinks(m, rng, to_xp)
    if fk == "alibi+segments":
        fk = dict(alibi_slopes=to_xp(rng.uniform(0.1, 1.0, (B, H))),
                  q_segments=to_xp(np.array([[0, 0, 1], [0, 1, 1]])),
                  k_segments=to_xp(np.array([[0, 0, 1, 1, 1], [0, 0, 0, 1, 1]])))
    q, k, v = (to_xp(a) for a in _inputs(rng, m))
    # every entry on the reference; random directions (cheaper) on the blocked path
    mode = "full" if impl == "reference" else "vjp"
    report = gradcheck_module(m, q, k, v, forward_kwargs=dict(fk, impl=impl), mode=mode, seed=5)
    assert report.ok and report.rtol <= 1e-6, "\n" + str(report)  # atol: the rounding floor
    names = {r.name for r in report.inputs}
    assert names == {"query", "key", "value", *m.params}
    if m.sinks:
        assert report["sinks"].scale > 1e-3  # a gradient that is really there, and was checked


def test_sinks_gradient_formula(backend, to_xp, to_np):
    """``dsinks[h] = -sum_{b,i} p_sink * delta`` with ``p_sink = exp(sink_h - lse)`` and
    ``delta = rowsum(dp * p)``: written out from the weights and checked against
    ``grads["sinks"]``."""
    rng = np.random.default_rng(6)
    m = _module(backend, sinks=True)
    _random_sinks(m, rng, to_xp)
    q, k, v = _inputs(rng, m)
    _, w = m(to_xp(q), to_xp(k), to_xp(v), need_weights=True, average_attn_weights=False)
    dout = rng.standard_normal((B, LQ, D))
    m.backward(to_xp(dout))
    P = _host_params(m, to_np)
    p = to_np(w)  # [B, H, Lq, Lk]
    Dh = D // H
    vh = np.repeat((v @ P["w_v"].T + P["b_v"]).reshape(B, LK, HKV, Dh).transpose(0, 2, 1, 3),
                   H // HKV, axis=1)
    doh = (dout @ P["w_o"]).reshape(B, LQ, H, Dh).transpose(0, 2, 1, 3)  # [B, H, Lq, Dh]
    dp = doh @ vh.transpose(0, 1, 3, 2)  # [B, H, Lq, Lk]
    p_sink = 1.0 - p.sum(-1)  # the sink's share of each row
    expected = -(p_sink * (dp * p).sum(-1)).sum(axis=(0, 2))  # [H]
    np.testing.assert_allclose(to_np(m.grads["sinks"]), expected, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_sinks_gradient_has_the_parameter_dtype(dtype):
    m = MultiHeadAttention(8, 2, sinks=True, dtype=dtype, seed=0)
    rng = np.random.default_rng(0)
    x = rng.standard_normal((2, 3, 8)).astype(dtype)
    out, _ = m(x, x, x)
    m.backward(rng.standard_normal(out.shape).astype(dtype))
    assert m.grads["sinks"].dtype == np.dtype(dtype) and m.grads["sinks"].shape == (2,)
    assert set(m.grads) == set(m.params)


# --------------------------------------------------------------------------
# bad arguments: the argument is named, nothing changes


@pytest.mark.parametrize("kwargs, exc, name", [
    (dict(scale="0.5"), TypeError, "scale"),
    (dict(scale=True), TypeError, "scale"),
    (dict(scale=math.inf), ValueError, "scale"),
    (dict(softcap=0.0), ValueError, "softcap"),
    (dict(softcap=-1.0), ValueError, "softcap"),
    (dict(softcap=math.nan), ValueError, "softcap"),
    (dict(softcap=math.inf), ValueError, "softcap"),  # inf * tanh(s / inf) would be NaN
    (dict(softcap=2**1100), ValueError, "softcap"),
    (dict(softcap=True), TypeError, "softcap"),
    (dict(softcap="1"), TypeError, "softcap"),
    (dict(sinks=1), TypeError, "sinks"),
    (dict(sinks=None), TypeError, "sinks"),
    (dict(impl="fast"), ValueError, "impl"),  # at construction, not at the first forward
    (dict(impl=None), TypeError, "impl"),
])
def test_bad_constructor_options(kwargs, exc, name):
    with pytest.raises(exc, match=name) as info:
        MultiHeadAttention(8, 2, **kwargs)
    value = list(kwargs.values())[0]
    got = "an int too large for a float (1101 bits)" if value == 2**1100 else repr(value)[:6]
    assert got in str(info.value)  # says what it got (2**1100 by its size, not its 332 digits)


def _bad_calls(to_xp):
    good_seg = to_xp(np.zeros((B, LQ), dtype=np.int64))
    return [
        (dict(window=3), TypeError,
         r"^window: expected None or a pair \(left, right\) of ints >= 0 or None, got int 3$"),
        (dict(window=(-1, 0)), ValueError, r"^window\[0\] \(left\): expected None or an int >= 0, got -1$"),
        (dict(window=(0, 1.5)), TypeError,
         r"^window\[1\] \(right\): expected None or an int >= 0, got float 1\.5$"),
        (dict(align="left"), ValueError, r"^align: expected 'top_left' or 'bottom_right', got 'left'$"),
        (dict(alibi_slopes=to_xp(np.ones(H + 1))), ValueError,
         rf"^alibi_slopes: expected shape \({H},\) or \({B}, {H}\) \(H heads of q\), got \({H + 1},\)$"),
        (dict(alibi_slopes=np.ones(H).tolist()), TypeError,
         r"^alibi_slopes: expected an? .*array.*, got list"),
        (dict(q_segments=good_seg), ValueError,
         r"^q_segments: packed sequences need both q_segments and k_segments, got only q_segments$"),
        (dict(q_segments=good_seg, k_segments=to_xp(np.zeros((B, LK)))), TypeError,
         r"^k_segments: expected an integer array of segment ids, got dtype float64$"),
        (dict(q_segments=good_seg, k_segments=to_xp(np.zeros((B, LK + 1), dtype=np.int64))),
         ValueError, rf"^k_segments: expected shape \(B, {LK}\) = \({B}, {LK}\), got \({B}, {LK + 1}\)$"),
        # the NumPy kernel takes windows but no ALiBi (test_an_impl_that_cannot_run_the_call_...)
        (dict(alibi_slopes=to_xp(np.ones(H)), impl="numpy"), ValueError, "impl"),
    ]


def _expect_unchanged_failure(m, call, exc, match):
    cache, rng_state = m.cache, m._rng.bit_generator.state
    params = dict(m.params)
    with pytest.raises(exc, match=match):
        call()
    assert m.cache is cache and m._rng.bit_generator.state == rng_state
    assert all(m.params[n] is p for n, p in params.items())


def test_bad_call_options(backend, to_xp):
    rng = np.random.default_rng(8)
    m = _module(backend, dropout=0.2)
    q, k, v = (to_xp(a) for a in _inputs(rng, m))
    m(q, k, v)  # a cache and a generator state that a failed call must keep
    for kwargs, exc, match in _bad_calls(to_xp):
        if kwargs.get("impl") == "numpy" and backend != "numpy":
            continue
        _expect_unchanged_failure(m, lambda: m(q, k, v, **kwargs), exc, match)


def _count_projections(monkeypatch):
    """The calls of ``attention.linear_forward``: steps 1.-3. (and 8.) of every forward."""
    calls = []
    linear = npattn.attention.linear_forward

    def spy(*args, **kwargs):
        calls.append(1)
        return linear(*args, **kwargs)

    monkeypatch.setattr(npattn.attention, "linear_forward", spy)
    return calls


# an option, the module's constructor options it needs, and whether it runs on the NumPy
# kernel (the chunked path, with dask arrays, takes every option)
IMPL_OPTIONS = {
    "none": (dict(), dict(), True),
    "causal": (dict(is_causal=True), dict(), True),
    "window": (dict(window=(1, 0)), dict(), True),
    "bottom_right": (dict(align="bottom_right"), dict(), True),
    "bottom_right_causal": (dict(align="bottom_right", is_causal=True), dict(), True),
    "alibi": (dict(alibi_slopes=np.linspace(0.25, 1.0, H)), dict(), False),
    "segments": (dict(q_segments=np.zeros((B, LQ), dtype=np.int64),
                      k_segments=np.zeros((B, LK), dtype=np.int64)), dict(), False),
    "softcap": (dict(), dict(softcap=2.0), False),
    "sinks": (dict(), dict(sinks=True), False),
    "extra_keys_causal": (dict(is_causal=True), dict(add_zero_attn=True), True),
    "kv_cache": (dict(kv_cache=True), dict(), True),
    "kv_cache_causal": (dict(kv_cache=True, is_causal=True), dict(), True),
    "kv_cache_alibi": (dict(kv_cache=True, alibi_slopes=np.linspace(0.25, 1.0, H)), dict(), False),
}


@pytest.mark.parametrize("backend_name", ["numpy", "dask"])
@pytest.mark.parametrize("impl", ["numpy", "chunked"])
@pytest.mark.parametrize("option", list(IMPL_OPTIONS))
def test_an_impl_that_cannot_run_the_call_is_refused_before_the_projections(
        monkeypatch, backend_name, impl, option):
    """impl="numpy" with ALiBi, segments, softcap or sinks (KV cache or not) or on dask arrays,
    impl="chunked" on NumPy arrays: the dispatcher's ValueError, with its message, before
    step 1. projects anything (it was raised inside step 6., after the projections). Every
    option runs on impl="chunked" with dask arrays. A call either runs or is refused with
    nothing computed."""
    if backend_name == "dask":
        pytest.importorskip("dask.array", reason="the chunked path needs dask")
    kwargs, ctor, on_kernel = IMPL_OPTIONS[option]
    m = _module(backend_name, **ctor).eval()
    to_xp = functools.partial(from_numpy, xp=m.xp)
    kwargs = {n: to_xp(a) if isinstance(a, np.ndarray) else a for n, a in kwargs.items()}
    rng = np.random.default_rng(10)
    if kwargs.get("kv_cache"):  # self-attention after a cached prompt of 2
        kwargs["kv_cache"] = m.new_cache(B, 8)
        prompt = to_xp(rng.standard_normal((B, 2, D)))
        m(prompt, prompt, prompt, kv_cache=kwargs["kv_cache"])
        q = k = v = to_xp(rng.standard_normal((B, LQ, D)))
    else:
        q, k, v = (to_xp(a) for a in _inputs(rng, m))
    takes_options = on_kernel or impl == "chunked"
    takes_arrays = (impl == "numpy") == (backend_name == "numpy")
    calls = _count_projections(monkeypatch)
    if takes_options and takes_arrays:
        m(q, k, v, impl=impl, **kwargs)
        assert calls
        return
    match = (f"impl='{impl}': the kernel options" if not takes_options
             else f"impl='{impl}': the .* takes {'NumPy' if impl == 'numpy' else 'dask'} arrays")
    with pytest.raises(ValueError, match=match):
        m(q, k, v, impl=impl, **kwargs)
    assert calls == []


def test_a_bad_thread_count_is_refused_before_the_projections(monkeypatch):
    """NPATTN_NUM_THREADS=0 is the dispatcher's ValueError; the module raised it from step 6.,
    after the projections."""
    m = _module("numpy")
    q, k, v = _inputs(np.random.default_rng(11), m)
    monkeypatch.setenv("NPATTN_NUM_THREADS", "0")
    calls = _count_projections(monkeypatch)
    with pytest.raises(ValueError, match=r"^NPATTN_NUM_THREADS: expected a positive integer \(threads of "
                                         r"npattn's tile pool\), got '0'$"):
        m(q, k, v)
    assert calls == []


@pytest.mark.parametrize("flag", ["is_causal", "need_weights", "check_finite", "average_attn_weights"])
@pytest.mark.parametrize("self_attention", [False, True], ids=["cross", "self"])
def test_a_flag_that_is_no_bool_is_refused_before_the_projections(monkeypatch, flag, self_attention):
    """forward's flags take bools only: "yes" is a TypeError naming the flag before step 1.
    projects anything (a later check of the same flag would come after the projections)."""
    m = _module("numpy")
    q, k, v = _inputs(np.random.default_rng(14), m)
    if self_attention:
        k = v = q
    calls = _count_projections(monkeypatch)
    with pytest.raises(TypeError, match=f"^{flag}: expected a bool"):
        m(q, k, v, **{flag: "yes"})
    assert calls == []


@pytest.mark.parametrize("impl", [None, "blocked"], ids=["module's impl", "call's impl"])
def test_weights_of_the_blocked_path_are_refused_before_the_projections(monkeypatch, impl):
    """need_weights=True where step 6. would run the blocked path, which keeps no weights:
    the dispatcher's ValueError before step 1. projects anything, for the module's impl
    ("blocked") and a call's."""
    m = _module("numpy", impl="blocked" if impl is None else "auto")
    q, k, v = _inputs(np.random.default_rng(12), m)
    calls = _count_projections(monkeypatch)
    with pytest.raises(ValueError, match="^impl='blocked' cannot return attention weights"):
        m(q, k, v, need_weights=True, impl=impl)
    assert calls == []
    m(q, k, v, impl=impl)  # the same call without weights runs
    assert calls


@pytest.mark.parametrize("extra", [0, 1], ids=["given keys", "a zero key appended"])
def test_a_refused_impl_names_the_heads_it_would_get(extra):
    """The refusal names the heads step 6. would get: q (B, H, Lq, Dh), k and v
    (B, Hkv, Lk + n, Dh), with Lq != Lk, the appended zero key counted."""
    m = _module("numpy", add_zero_attn=bool(extra))
    q, k, v = _inputs(np.random.default_rng(13), m)
    kv = (B, HKV, LK + extra, D // H)
    with pytest.raises(ValueError) as info:
        m(q, k, v, impl="chunked")
    assert f"got numpy.ndarray of shapes {(B, H, LQ, D // H)}, {kv}, {kv};" in str(info.value)


@pytest.mark.parametrize("extra", [dict(add_bias_kv=True), dict(add_zero_attn=True)])
@pytest.mark.parametrize("kwargs, name", [
    (dict(window=(1, 1)), "window"),
    (dict(align="bottom_right"), "align"),
    (dict(alibi_slopes="slopes"), "alibi_slopes"),
    (dict(q_segments="q", k_segments="k"), "q_segments"),
    (dict(kv_cache="cache"), "kv_cache"),
])
def test_positional_options_are_refused_with_extra_keys(backend, to_xp, to_np, extra, kwargs, name):
    """The extra keys of add_bias_kv / add_zero_attn have no position: a ValueError naming
    the option, before anything is computed."""
    rng = np.random.default_rng(9)
    m = _module(backend, **extra)
    q, k, v = (to_xp(a) for a in _inputs(rng, m))
    real = {"alibi_slopes": to_xp(np.ones(H)),
            "q_segments": to_xp(np.zeros((B, LQ), dtype=np.int64)),
            "k_segments": to_xp(np.zeros((B, LK), dtype=np.int64)),
            "kv_cache": m.new_cache(B, 8)}
    kwargs = {n: real.get(n, a) if isinstance(a, str) and n != "align" else a
              for n, a in kwargs.items()}
    with pytest.raises(ValueError, match=rf"^{name}: .*add_bias_kv / add_zero_attn"):
        m(q, k, v, **kwargs)
    assert m.cache is None
    # the options that place nothing are fine with extra keys: softcap, sinks, scale, and
    # align="top_left", the default, given by name
    m2 = _module(backend, softcap=2.0, sinks=True, scale=0.5, **extra)
    out, _ = m2(q, k, v, is_causal=True)
    assert tuple(out.shape) == (B, LQ, D)
    out_top_left, _ = m2(q, k, v, is_causal=True, align="top_left")
    np.testing.assert_array_equal(to_np(out_top_left), to_np(out))


# --------------------------------------------------------------------------
# copies, pickles, the save format, torch


def _sinks_module(backend, to_xp, rng):
    m = _module(backend, softcap=2.5, scale=0.7, sinks=True, dropout=0.2)
    _random_sinks(m, rng, to_xp)
    return m


def _same_step(a, b, arrays, to_np):
    q, k, v, dout = arrays
    for m in (a, b):
        m.eval()
    outs = [to_np(m(q, k, v, is_causal=True)[0]) for m in (a, b)]
    np.testing.assert_array_equal(outs[0], outs[1])
    for m in (a, b):
        m.backward(dout)
    for n in a.params:
        np.testing.assert_array_equal(to_np(a.grads[n]), to_np(b.grads[n]), err_msg=n)


@pytest.mark.parametrize("how", ["deepcopy", "pickle", "save"])
def test_copies_and_files_keep_the_options(backend, to_xp, to_np, tmp_path, how):
    rng = np.random.default_rng(10)
    m = _sinks_module(backend, to_xp, rng)
    arrays = [to_xp(a) for a in (*_inputs(rng, m), rng.standard_normal((B, LQ, D)))]
    if how == "deepcopy":
        c = copy.deepcopy(m)
    elif how == "pickle":
        c = pickle.loads(pickle.dumps(m))
    else:
        m.save(tmp_path / "m.npz")
        with np.load(tmp_path / "m.npz", allow_pickle=False) as npz:
            config = json.loads(str(npz["config"]))["config"]
            assert "param/sinks" in npz.files
        assert (config["scale"], config["softcap"], config["sinks"]) == (0.7, 2.5, True)
        c = MultiHeadAttention.load(tmp_path / "m.npz", backend=backend)
    assert (c.scale, c.softcap, c.sinks) == (0.7, 2.5, True)
    assert repr(c) == repr(m) and "softcap=2.5" in repr(m) and "sinks=True" in repr(m)
    assert list(c.params) == list(m.params)
    np.testing.assert_array_equal(to_np(c.params["sinks"]), to_np(m.params["sinks"]))
    _same_step(m, c, arrays, to_np)


def test_files_without_the_new_options_load_with_the_defaults(tmp_path):
    """Format version 1 is unchanged: a module that does not use the options writes no key for
    them (an older npattn reads the file), and a file without them loads with the defaults."""
    plain = MultiHeadAttention(8, 2, seed=0)
    plain.save(tmp_path / "plain.npz")
    with np.load(tmp_path / "plain.npz", allow_pickle=False) as npz:
        header = json.loads(str(npz["config"]))
        entries = {n: npz[n] for n in npz.files}
    assert header["format_version"] == 1
    assert not set(SAVE_LATER_OPTIONS) & set(header["config"])
    r = MultiHeadAttention.load(tmp_path / "plain.npz")
    assert (r.scale, r.softcap, r.sinks) == (None, None, False) and "sinks" not in r.params

    # a file of a module with sinks, its new keys and parameter removed: an older file
    m = MultiHeadAttention(8, 2, seed=0, sinks=True, softcap=1.0)
    m.save(tmp_path / "new.npz")
    with np.load(tmp_path / "new.npz", allow_pickle=False) as npz:
        entries = {n: npz[n] for n in npz.files}
    header = json.loads(str(entries["config"]))
    for name in SAVE_LATER_OPTIONS:
        header["config"].pop(name, None)
    entries["config"] = np.array(json.dumps(header))
    entries.pop("param/sinks")
    with open(tmp_path / "old.npz", "wb") as f:
        np.savez(f, **entries)
    old = MultiHeadAttention.load(tmp_path / "old.npz")
    assert (old.scale, old.softcap, old.sinks) == (None, None, False)

    # the sinks parameter without sinks=True in the configuration is named
    entries["param/sinks"] = np.zeros(2)
    with open(tmp_path / "bad.npz", "wb") as f:
        np.savez(f, **entries)
    with pytest.raises(ValueError, match=r"^load: '.*bad\.npz': expected the parameters \['w_q', .*'b_o'\] "
                                         r"of the saved configuration, missing \[\], "
                                         r"unexpected \['sinks'\]$"):
        MultiHeadAttention.load(tmp_path / "bad.npz")
    header["config"]["softcap"] = -1.0
    entries["config"] = np.array(json.dumps(header))
    with open(tmp_path / "bad2.npz", "wb") as f:
        np.savez(f, **entries)
    with pytest.raises(ValueError, match=r"^load: '.*bad2\.npz': the saved configuration is not valid: "
                                         r"softcap: expected a finite float > 0, got -1\.0$"):
        MultiHeadAttention.load(tmp_path / "bad2.npz")


def test_a_pickle_of_an_older_module_unpickles_with_the_defaults():
    m = MultiHeadAttention(8, 2, seed=0)
    state = m.__getstate__()
    for name in ("scale", "softcap", "sinks", "_decoded"):
        del state[name]
    old = MultiHeadAttention.__new__(MultiHeadAttention)
    old.__setstate__(state)
    assert (old.scale, old.softcap, old.sinks) == (None, None, False)
    x = np.ones((1, 2, 8), dtype=np.float32)
    np.testing.assert_array_equal(old(x, x, x)[0], m(x, x, x)[0])


def test_torch_conversions():
    torch = pytest.importorskip("torch")
    tm = torch.nn.MultiheadAttention(8, 2, batch_first=True)
    m = MultiHeadAttention.from_torch(tm)
    assert (m.scale, m.softcap, m.sinks) == (None, None, False) and "sinks" not in m.params
    no_sinks = r"^sinks: expected a module without attention sinks \(.*\), got sinks=True$"
    with pytest.raises(ValueError, match=no_sinks):
        MultiHeadAttention(8, 2, sinks=True).torch_state_dict()
    with pytest.raises(ValueError, match=no_sinks):
        MultiHeadAttention(8, 2, sinks=True).load_torch_state_dict(tm.state_dict())
    # scale and softcap change no parameter: the weights convert both ways
    capped = MultiHeadAttention(8, 2, softcap=2.0, scale=0.5).load_torch_state_dict(tm.state_dict())
    for name, t in capped.torch_state_dict().items():
        torch.testing.assert_close(t, tm.state_dict()[name], rtol=0, atol=0)
