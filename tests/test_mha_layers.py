"""Layer shapes beyond the core: add_bias_kv, add_zero_attn, qdim, qkv_bias/out_bias, n_kv_head.

Central differences in float64 with a random upstream gradient, on every
backend: the functional pairs ``append_kv`` and ``pad_mask``, and the module
with every parameter, the inputs and a floating mask. Plus the documented
formulas: where the extra keys sit, that they stay attendable, and what the
zero key contributes.
"""

import math
import re

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from npattn import MultiHeadAttention
from npattn import functional as F
from npattn.gradcheck import gradcheck

fixture_ok = settings(suppress_health_check=[HealthCheck.function_scoped_fixture])


# --------------------------------------------------------------------------
# functional pairs


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("zero", [False, True])
def test_append_kv_gradcheck(xp, to_xp, bias, zero):
    rng = np.random.default_rng(0)
    x = to_xp(rng.standard_normal((2, 3, 4, 5)))  # [B, H, Lk, D]: any leading axes
    b = to_xp(rng.standard_normal(5)) if bias else None

    def fwd(x, *b):
        return F.append_kv_forward(x, b[0] if b else None, add_zero_attn=zero)

    inputs = [x, b] if bias else [x]
    rep = gradcheck(fwd, F.append_kv_backward, inputs, names=["x", "bias"][: len(inputs)], mode="full")
    assert rep.ok, str(rep)


def test_append_kv_with_no_width(xp, to_xp, to_np):
    """D = 0 with a bias: the forward takes it, and so does the backward (empty gradients of
    the forward's shapes; the bias row was reshaped with a -1 beside D = 0, which is ambiguous)."""
    x, b = to_xp(np.zeros((2, 3, 0))), to_xp(np.zeros(0))
    y, cache = F.append_kv_forward(x, b, add_zero_attn=True)
    assert tuple(y.shape) == (2, 5, 0)
    dx, dbias = F.append_kv_backward(to_xp(np.zeros((2, 5, 0))), cache)
    assert to_np(dx).shape == (2, 3, 0) and to_np(dbias).shape == (0,)


def test_append_kv_layout(xp, to_xp, to_np):
    """Given keys first, then the bias row, then the zero row, as torch concatenates."""
    rng = np.random.default_rng(1)
    x = rng.standard_normal((2, 3, 4))
    b = rng.standard_normal(4)
    y = to_np(F.append_kv_forward(to_xp(x), to_xp(b), add_zero_attn=True)[0])
    assert y.shape == (2, 5, 4)
    np.testing.assert_array_equal(y[:, :3], x)
    np.testing.assert_array_equal(y[:, 3], np.broadcast_to(b, (2, 4)))
    np.testing.assert_array_equal(y[:, 4], 0.0)


@pytest.mark.parametrize("shape", [(3, 4), (2, 1, 3, 4), (2, 1, 1, 4), (2, 2, 3, 1)])
@pytest.mark.parametrize("causal", [False, True])
def test_pad_mask_gradcheck_and_values(xp, to_xp, to_np, shape, causal):
    rng = np.random.default_rng(2)
    Lq, Lk, n = 3, 4, 2
    mask = rng.standard_normal(shape)  # floating, broadcastable to [..., Lq, Lk]

    def fwd(m):
        out, cache = F.pad_mask_forward(m, Lq, Lk, n, is_causal=causal)
        # the causal -inf entries have no gradient; keep the checked sum finite
        return xp.where(out == -math.inf, xp.zeros_like(out), out), cache

    rep = gradcheck(fwd, F.pad_mask_backward, [to_xp(mask)], names=["mask"], mode="full")
    assert rep.ok, str(rep)
    out = to_np(F.pad_mask_forward(to_xp(mask), Lq, Lk, n, is_causal=causal)[0])
    assert out.shape[-1] == Lk + n
    np.testing.assert_array_equal(out[..., Lk:], 0.0)  # extra keys: nothing added
    given = np.broadcast_to(mask, np.broadcast_shapes(mask.shape, (1, Lk)) if causal is False else
                            np.broadcast_shapes(mask.shape, (Lq, Lk)))
    if causal:
        forbid = np.triu(np.ones((Lq, Lk), dtype=bool), 1)
        given = np.where(forbid, -math.inf, given)
    np.testing.assert_array_equal(out[..., :Lk], np.broadcast_to(given, out[..., :Lk].shape))


def test_pad_mask_bool_and_causal(xp, to_xp, to_np):
    """A boolean mask with ``is_causal``: attend where the mask AND the top-left causal
    mask allow (query i, given keys j <= i), then the extra keys, always attendable."""
    rng = np.random.default_rng(5)
    Lq, Lk, n = 3, 4, 2
    mask = rng.random((2, 1, Lq, Lk)) > 0.4
    out = to_np(F.pad_mask_forward(to_xp(mask), Lq, Lk, n, is_causal=True)[0])
    causal = np.arange(Lk)[None, :] <= np.arange(Lq)[:, None]  # [Lq, Lk]
    want = np.concatenate([mask & causal, np.ones((2, 1, Lq, n), dtype=bool)], axis=-1)
    np.testing.assert_array_equal(out, want)


def test_pad_mask_bool_and_none(xp, to_xp, to_np):
    Lq, Lk = 3, 4
    m = np.zeros((2, 1, 1, Lk), dtype=bool)  # nothing attendable among the given keys
    out, cache = F.pad_mask_forward(to_xp(m), Lq, Lk, 1)
    out = to_np(out)
    assert out.shape == (2, 1, 1, Lk + 1) and out.dtype == bool
    assert not out[..., :Lk].any() and out[..., Lk:].all()
    assert F.pad_mask_backward(None, cache) is None
    assert F.pad_mask_forward(None, Lq, Lk, 1)[0] is None
    like = to_xp(np.zeros((1,)))
    c = to_np(F.pad_mask_forward(None, Lq, Lk, 2, is_causal=True, like=like)[0])
    expect = np.concatenate([np.tril(np.ones((Lq, Lk), dtype=bool)), np.ones((Lq, 2), dtype=bool)], 1)
    np.testing.assert_array_equal(c, expect)
    with pytest.raises(ValueError, match=r"^like: expected an array \(the namespace and device of the "
                                         r"causal mask\) with is_causal=True and mask=None, got None$"):
        F.pad_mask_forward(None, Lq, Lk, 1, is_causal=True)


def test_pad_mask_backward_of_a_bool_or_no_mask_is_none_whatever_dm(xp, to_xp, to_np):
    """A boolean mask, or none with is_causal, has no gradient: the padded mask's upstream
    gradient, given or None, gives None."""
    Lq, Lk, n = 3, 4, 2
    rng = np.random.default_rng(7)
    dm = to_xp(rng.standard_normal((2, 1, Lq, Lk + n)))
    m = rng.random((2, 1, Lq, Lk)) < 0.5
    caches = [F.pad_mask_forward(to_xp(m), Lq, Lk, n)[1],
              F.pad_mask_forward(to_xp(m), Lq, Lk, n, is_causal=True)[1],
              F.pad_mask_forward(None, Lq, Lk, n, is_causal=True, like=to_xp(np.zeros((1,))))[1]]
    for cache in caches:
        assert F.pad_mask_backward(dm, cache) is None
        assert F.pad_mask_backward(None, cache) is None


# --------------------------------------------------------------------------
# the module, by central differences on every backend


def module_pair(mha, names, **kw):
    """(forward, backward) over (query, key, value, mask, *params) for ``gradcheck``."""

    def forward(query, key, value, mask, *params):
        for n, p in zip(names, params):
            mha.params[n] = p
        return mha(query, key, value, mask=mask, **kw)[0], None

    def backward(dout, cache):
        dq, dk, dv = mha.backward(dout)
        return (dq, dk, dv, mha.dmask, *(mha.grads[n] for n in names))

    return forward, backward


@st.composite
def module_configs(draw):
    Hkv = draw(st.sampled_from([1, 2]))
    Lq = draw(st.integers(2, 3))
    return dict(
        Hkv=Hkv,
        H=Hkv * draw(st.sampled_from([1, 2])),
        Dh=2,
        Lq=Lq,
        Lk=draw(st.integers(2, 4).filter(lambda s: s != Lq)),
        qdim=draw(st.sampled_from([None, 3])),
        kdim=draw(st.sampled_from([None, 5])),
        qkv_bias=draw(st.booleans()),
        out_bias=draw(st.booleans()),
        add_bias_kv=draw(st.booleans()),
        add_zero_attn=draw(st.booleans()),
        mask=draw(st.sampled_from(["none", "bool", "float"])),
        causal=draw(st.booleans()),
        p=draw(st.sampled_from([0.0, 0.4])),
        seed=draw(st.integers(0, 2**16)),
    )


@fixture_ok
@given(cfg=module_configs())
def test_module_gradcheck(backend, to_xp, cfg):
    c = cfg
    B, H, Lq, Lk = 2, c["H"], c["Lq"], c["Lk"]
    D = H * c["Dh"]
    rng = np.random.default_rng(c["seed"])
    mha = MultiHeadAttention(
        D, H, n_kv_head=c["Hkv"], qdim=c["qdim"], kdim=c["kdim"], qkv_bias=c["qkv_bias"],
        out_bias=c["out_bias"], add_bias_kv=c["add_bias_kv"], add_zero_attn=c["add_zero_attn"],
        dropout=c["p"], dtype="float64", seed=c["seed"], backend=backend,
    )
    names = list(mha.params)
    params = [to_xp(rng.standard_normal(tuple(mha.params[n].shape))) for n in names]
    query = rng.standard_normal((B, Lq, mha.qdim))
    key = rng.standard_normal((B, Lk, mha.kdim))
    value = rng.standard_normal((B, Lk, mha.vdim))
    mask = None
    if c["mask"] == "bool":
        mask = rng.random((B, 1, Lq, Lk)) < 0.6
        mask[0, 0, 0, :] = False  # a query row with no given key to attend
    elif c["mask"] == "float":
        mask = rng.standard_normal((Lq, Lk))
        mask[0, :] = -math.inf  # likewise
    n_extra = c["add_bias_kv"] + c["add_zero_attn"]
    keep = to_xp(rng.random((B, H, Lq, Lk + n_extra)) >= c["p"]) if c["p"] else None
    fwd, bwd = module_pair(mha, names, is_causal=c["causal"], dropout_mask=keep)
    inputs = [to_xp(query), to_xp(key), to_xp(value), to_xp(mask), *params]
    # atol: b_k's gradient is 0 in exact arithmetic without extra keys (softmax ignores a
    # shift shared by a row), so only the differences' rounding is compared: ~1e-9 for most
    # draws, 1.4e-8 for seed 0 with Hkv=2, H=4, Lq=3, Lk=2, p=0.4 (a wrong db_k is O(1))
    rep = gradcheck(
        fwd, bwd, inputs, names=["query", "key", "value", "mask", *names], mode="vjp", atol=5e-8
    )
    assert rep.ok, str(rep)
    assert set(mha.grads) == set(mha.params)
    for n in names:
        assert tuple(mha.grads[n].shape) == tuple(mha.params[n].shape)


# --------------------------------------------------------------------------
# documented behaviour


def test_param_shapes_and_flags():
    m = MultiHeadAttention(
        6, 3, n_kv_head=1, qdim=4, kdim=5, vdim=7, qkv_bias=False, out_bias=True,
        add_bias_kv=True, dtype="float64", seed=0,
    )
    shapes = {k: tuple(v.shape) for k, v in m.params.items()}
    assert shapes == {
        "w_q": (6, 4), "w_k": (2, 5), "w_v": (2, 7), "w_o": (6, 6),
        "b_o": (6,), "bias_k": (2,), "bias_v": (2,),
    }
    m2 = MultiHeadAttention(6, 3, bias=False, out_bias=True)
    assert set(m2.params) == {"w_q", "w_k", "w_v", "w_o", "b_o"}
    m3 = MultiHeadAttention(6, 3, qkv_bias=True, out_bias=False)
    assert set(m3.params) == {"w_q", "w_k", "w_v", "w_o", "b_q", "b_k", "b_v"}


def test_each_bias_flag_defaults_to_bias_not_to_the_other_flag():
    """qkv_bias and out_bias each default to ``bias``: setting one of them leaves the other at
    ``bias``, so ``qkv_bias=False`` alone keeps ``b_o`` and ``out_bias=False`` alone keeps
    ``b_q b_k b_v``."""
    weights, qkv, out = {"w_q", "w_k", "w_v", "w_o"}, {"b_q", "b_k", "b_v"}, {"b_o"}
    for kwargs, biases in [(dict(qkv_bias=False), out), (dict(out_bias=False), qkv),
                           (dict(bias=False, qkv_bias=True), qkv), (dict(bias=False, out_bias=True), out)]:
        m = MultiHeadAttention(6, 3, **kwargs)
        assert set(m.params) == weights | biases, kwargs
        assert (m.qkv_bias, m.out_bias) == (biases == qkv, biases == out), kwargs


def test_same_seed_same_weights_with_or_without_bias_kv():
    """bias_k/bias_v are drawn after the weights, so they do not shift them."""
    a = MultiHeadAttention(4, 2, seed=3, dtype="float64")
    b = MultiHeadAttention(4, 2, seed=3, dtype="float64", add_bias_kv=True)
    for n in a.params:
        np.testing.assert_array_equal(a.params[n], b.params[n])


def test_zero_attn_row_with_no_given_key(xp, to_xp, to_np):
    """A query that may attend none of the given keys attends only the zero key: out = b_o.

    With a bias key too it attends bias_k alone (weight 1): out = (bias_v split
    by head, merged) @ w_o.T + b_o. The extra keys are never masked.
    """
    rng = np.random.default_rng(4)
    B, Lq, Lk, D, H = 2, 3, 4, 4, 2
    q, k, v = (rng.standard_normal((B, L, D)) for L in (Lq, Lk, Lk))
    mask = np.ones((B, 1, Lq, Lk), dtype=bool)
    mask[1, 0, 2, :] = False  # batch 1, query 2: no given key
    m = MultiHeadAttention(D, H, add_zero_attn=True, dtype="float64", seed=0, backend=xp)
    m.params["b_o"] = to_xp(rng.standard_normal(D))
    out, w = m(to_xp(q), to_xp(k), to_xp(v), mask=to_xp(mask), need_weights=True,
               average_attn_weights=False)
    out, w = to_np(out), to_np(w)
    assert w.shape == (B, H, Lq, Lk + 1)
    np.testing.assert_allclose(w[1, :, 2, -1], 1.0, rtol=0, atol=1e-15)
    np.testing.assert_allclose(out[1, 2], to_np(m.params["b_o"]), rtol=1e-13, atol=1e-13)
    np.testing.assert_allclose(w.sum(-1), 1.0, rtol=1e-13)

    m2 = MultiHeadAttention(D, H, add_bias_kv=True, dtype="float64", seed=1, backend=xp)
    m2.params["b_o"] = to_xp(rng.standard_normal(D))
    out2 = to_np(m2(to_xp(q), to_xp(k), to_xp(v), mask=to_xp(mask))[0])
    P = {n: to_np(a) for n, a in m2.params.items()}
    np.testing.assert_allclose(out2[1, 2], P["bias_v"] @ P["w_o"].T + P["b_o"], rtol=1e-12, atol=1e-13)


def test_causal_never_hides_the_extra_keys(xp, to_xp, to_np):
    rng = np.random.default_rng(6)
    B, L, D, H = 2, 3, 4, 2
    x = to_xp(rng.standard_normal((B, L, D)))
    m = MultiHeadAttention(D, H, add_bias_kv=True, add_zero_attn=True, dtype="float64", seed=0, backend=xp)
    _, w = m(x, x, x, is_causal=True, need_weights=True, average_attn_weights=False)
    w = to_np(w)  # [B, H, L, L + 2]
    forbid = np.triu(np.ones((L, L), dtype=bool), 1)
    assert np.all(w[..., :L][..., forbid] == 0.0)
    assert np.all(w[..., L:] > 0.0)


def test_bool_mask_gives_no_dmask_float_mask_does(xp, to_xp):
    rng = np.random.default_rng(5)
    q = to_xp(rng.standard_normal((2, 3, 4)))
    m = MultiHeadAttention(4, 2, add_bias_kv=True, dtype="float64", backend=xp)
    m(q, q, q, mask=to_xp(rng.random((3, 3)) < 0.5))
    m.backward(to_xp(rng.standard_normal((2, 3, 4))))
    assert m.dmask is None
    m(q, q, q, mask=to_xp(rng.standard_normal((2, 1, 1, 3))))
    m.backward(to_xp(rng.standard_normal((2, 3, 4))))
    assert tuple(m.dmask.shape) == (2, 1, 1, 3)


@pytest.mark.parametrize(
    "kwargs, exc, message",
    [
        (dict(qdim=0), ValueError, "qdim: expected a positive int, got 0"),
        (dict(qdim=2.5), TypeError, "qdim: expected a positive int, got float 2.5"),
        (dict(n_kv_head=3), ValueError, "n_kv_head: expected a divisor of n_head=4, got 3"),
        (dict(n_kv_head=0), ValueError, "n_kv_head: expected a positive int, got 0"),
        (dict(n_kv_head=True), TypeError, "n_kv_head: expected a positive int, got bool True"),
    ],
)
def test_bad_layer_arguments(kwargs, exc, message):
    """Each message names the argument, what was expected and the value received, whole."""
    with pytest.raises(exc, match=f"^{re.escape(message)}$"):
        MultiHeadAttention(8, 4, **kwargs)


def test_extra_kv_pairs_stay_on_the_input_device():
    """array-api-strict's simulated second device: nothing is created on the default one."""
    from conftest import backend_or_skip

    xps = backend_or_skip("array_api_strict")
    dev = xps.Device("device1")
    rng = np.random.default_rng(7)
    x = xps.asarray(rng.standard_normal((2, 3, 4)), device=dev)
    b = xps.asarray(rng.standard_normal(4), device=dev)
    y, c = F.append_kv_forward(x, b, add_zero_attn=True)
    dx, db = F.append_kv_backward(xps.asarray(rng.standard_normal((2, 5, 4)), device=dev), c)
    fm = xps.asarray(rng.standard_normal((2, 1, 3, 3)), device=dev)
    m, mc = F.pad_mask_forward(fm, 3, 3, 2, is_causal=True)
    dm = F.pad_mask_backward(xps.asarray(rng.standard_normal((2, 1, 3, 5)), device=dev), mc)
    bm, _ = F.pad_mask_forward(None, 3, 3, 1, is_causal=True, like=x)
    for a in (y, dx, db, m, dm, bm):
        assert a.device == dev
