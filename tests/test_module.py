"""MultiHeadAttention: gradients of inputs and parameters, masks, dropout, invariants."""

import copy
import math

import numpy as np
import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from _strategies import MASK_FORMS, make_mask
from npattn import MultiHeadAttention
from npattn.backend import namespace
from npattn.gradcheck import gradcheck_module

RTOL = 1e-6


@st.composite
def module_cases(draw):
    # every size at least 2 and, across, Lq != Lk: an axis of 1 or equal lengths would hide a
    # transposed or mis-broadcast gradient (self-attention has Lk = Lq by definition)
    B = draw(st.integers(2, 3))
    H = draw(st.integers(2, 3))
    Dh = draw(st.integers(2, 4))
    Lq = draw(st.integers(2, 6))
    Lk = draw(st.integers(2, 6).filter(lambda n: n != Lq))
    cross = draw(st.booleans())
    kdim = draw(st.integers(2, 6)) if cross and draw(st.booleans()) else None
    vdim = draw(st.integers(2, 6)) if cross and draw(st.booleans()) else None
    return dict(
        B=B, H=H, Dh=Dh, Lq=Lq, Lk=Lk if cross else Lq, cross=cross, kdim=kdim, vdim=vdim,
        bias=draw(st.booleans()),
        kind=draw(st.sampled_from(["none", "bool", "float", "float_inf", "padding"])),
        form=draw(st.sampled_from(MASK_FORMS)),
        masked_row=draw(st.booleans()),
        causal=draw(st.booleans()),
        dropout=draw(st.sampled_from([0.0, 0.25])),
        seed=draw(st.integers(0, 2**16)),
    )


def _make(xp_name, c):
    D = c["H"] * c["Dh"]
    mha = MultiHeadAttention(
        D, c["H"], dropout=c["dropout"], bias=c["bias"], kdim=c["kdim"], vdim=c["vdim"],
        dtype="float64", seed=c["seed"], backend=xp_name,
    )
    rng = np.random.default_rng(c["seed"])
    query = rng.standard_normal((c["B"], c["Lq"], D))
    if c["cross"]:
        key = rng.standard_normal((c["B"], c["Lk"], mha.kdim))
        value = rng.standard_normal((c["B"], c["Lk"], mha.vdim))
    else:
        key = value = query
    mask = make_mask(rng, c["kind"], c["form"], c["B"], c["H"], c["Lq"], c["Lk"], masked_row=c["masked_row"])
    keep = rng.random((c["B"], c["H"], c["Lq"], c["Lk"])) >= 0.25 if c["dropout"] else None
    return mha, query, key, value, mask, keep


# Always run, whatever hypothesis draws: every size >= 2, Lq != Lk, kdim/vdim,
# an additive mask with -inf and a fully masked row, causal, dropout p > 0.
EXPLICIT = dict(
    B=2, H=2, Dh=3, Lq=3, Lk=5, cross=True, kdim=4, vdim=2, bias=True, kind="float_inf",
    form="B1LqLk", masked_row=True, causal=True, dropout=0.25, seed=5,
)


@given(c=module_cases())
@example(c=EXPLICIT)
def test_module_gradients_inputs_and_parameters(backend, to_xp, c):
    mha, query, key, value, mask, keep = _make(backend, c)
    fk = dict(mask=to_xp(mask), is_causal=c["causal"], dropout_mask=to_xp(keep))
    q, k, v = to_xp(query), to_xp(key), to_xp(value)
    report = gradcheck_module(mha, q, k, v, forward_kwargs=fk, seed=c["seed"])
    # every input within atol + rtol * scale, rtol = RTOL and atol float64's rounding floor
    # of a central difference (a bound on max_rel_err alone fails gradients of scale 1e-3
    # whose error is that rounding)
    assert report.ok and report.rtol <= RTOL, "\n" + str(report)
    # one array passed three times is self-attention, checked as one input x
    acts = {"x"} if q is k and k is v else {"query", "key", "value"}
    assert {r.name for r in report.inputs} >= acts | {"w_q", "w_k", "w_v", "w_o"}


@given(c=module_cases())
@example(c=EXPLICIT)
def test_module_gradients_random_direction_check(backend, to_xp, c):
    """The same gradients through the cheap random-direction (vjp) check."""
    mha, query, key, value, mask, keep = _make(backend, c)
    fk = dict(mask=to_xp(mask), is_causal=c["causal"], dropout_mask=to_xp(keep))
    report = gradcheck_module(mha, to_xp(query), to_xp(key), to_xp(value), forward_kwargs=fk, mode="vjp", seed=c["seed"])
    assert report.ok, "\n" + str(report)


@pytest.mark.parametrize("impl", ["reference", "numpy", "blocked", "auto"])
def test_module_gradients_on_every_impl(backend, to_xp, impl):
    """The module over each attention implementation, by central differences (random
    directions, random dout): GQA (4 query heads on 2 K/V heads), kdim/vdim, Lq != Lk, a float
    mask with -inf and a fully masked query row, causal, dropout p > 0 on a fixed keep-mask;
    the blocked path with blocks smaller than the lengths."""
    if impl == "numpy" and backend != "numpy":
        pytest.skip("the NumPy kernel takes NumPy arrays only")
    B, H, Hkv, Lq, Lk = 2, 4, 2, 3, 5
    mha = MultiHeadAttention(8, H, n_kv_head=Hkv, kdim=4, vdim=3, dropout=0.25, dtype="float64",
                             seed=6, backend=backend, impl=impl, block_q=2, block_k=2)
    rng = np.random.default_rng(6)
    mha.params = {n: a + to_xp(0.2 * rng.standard_normal(tuple(a.shape))) for n, a in mha.params.items()}
    query = rng.standard_normal((B, Lq, 8))
    key, value = rng.standard_normal((B, Lk, 4)), rng.standard_normal((B, Lk, 3))
    mask = np.where(rng.random((B, 1, Lq, Lk)) > 0.3, rng.standard_normal((B, 1, Lq, Lk)), -np.inf)
    mask[1, 0, 2, :] = -np.inf  # query 2 of entry 1 attends nothing
    keep = rng.random((B, H, Lq, Lk)) >= 0.25
    fk = dict(mask=to_xp(mask), is_causal=True, dropout_mask=to_xp(keep))
    report = gradcheck_module(mha, to_xp(query), to_xp(key), to_xp(value), forward_kwargs=fk,
                              mode="vjp", seed=6)
    assert report.ok and report.rtol <= RTOL, "\n" + str(report)
    assert {r.name for r in report.inputs} == {"query", "key", "value", *mha.params}


def test_outputs_and_gradients_stay_in_their_namespace(xp, backend, to_xp):
    mha = MultiHeadAttention(8, 2, kdim=3, vdim=5, seed=0, backend=backend)
    rng = np.random.default_rng(0)
    q = to_xp(rng.standard_normal((2, 3, 8)).astype(np.float32))
    k = to_xp(rng.standard_normal((2, 4, 3)).astype(np.float32))
    v = to_xp(rng.standard_normal((2, 4, 5)).astype(np.float32))
    out, w = mha(q, k, v, need_weights=True, average_attn_weights=False)
    assert tuple(out.shape) == (2, 3, 8) and tuple(w.shape) == (2, 2, 3, 4)
    grads = mha.backward(to_xp(rng.standard_normal((2, 3, 8)).astype(np.float32)))
    for a in (out, w, *grads, *mha.grads.values(), *mha.params.values()):
        assert namespace(a) is xp
        assert a.dtype == xp.float32
    assert set(mha.grads) == set(mha.params)
    assert [tuple(g.shape) for g in grads] == [(2, 3, 8), (2, 4, 3), (2, 4, 5)]


def test_parameter_layout_and_init(xp, backend, to_np):
    mha = MultiHeadAttention(12, 3, kdim=5, vdim=7, seed=1, dtype="float64", backend=backend)
    shapes = {k: tuple(v.shape) for k, v in mha.params.items()}
    assert shapes == {
        "w_q": (12, 12), "w_k": (12, 5), "w_v": (12, 7), "w_o": (12, 12),
        "b_q": (12,), "b_k": (12,), "b_v": (12,), "b_o": (12,),
    }
    # Xavier/Glorot uniform U(-a, a), a = sqrt(6 / (fan_in + fan_out)), each weight its own a
    for name, (fan_out, fan_in) in (("w_q", (12, 12)), ("w_k", (12, 5)), ("w_v", (12, 7)),
                                    ("w_o", (12, 12))):
        w, bound = to_np(mha.params[name]), math.sqrt(6 / (fan_in + fan_out))
        assert np.all(np.abs(w) <= bound), name
        assert w.max() > 0.8 * bound and w.min() < -0.8 * bound, name  # both ends of (-a, a)
    for name in ("b_q", "b_k", "b_v", "b_o"):  # zero biases, as torch's
        assert np.all(to_np(mha.params[name]) == 0.0), name
    no_bias = MultiHeadAttention(12, 3, bias=False, seed=1, backend=backend)
    assert set(no_bias.params) == {"w_q", "w_k", "w_v", "w_o"}
    same = MultiHeadAttention(12, 3, kdim=5, vdim=7, seed=1, dtype="float64", backend=backend)
    for name in mha.params:
        np.testing.assert_array_equal(to_np(mha.params[name]), to_np(same.params[name]))


def test_assigning_a_parameter_replaces_it(backend, to_xp, to_np):
    mha = MultiHeadAttention(4, 2, dtype="float64", seed=0, backend=backend)
    mha.params["w_o"] = to_xp(np.zeros((4, 4)))
    mha.params["b_o"] = to_xp(np.arange(4.0))
    out, _ = mha(*(to_xp(np.ones((2, 3, 4))),) * 3)
    np.testing.assert_array_equal(to_np(out), np.broadcast_to(np.arange(4.0), (2, 3, 4)))


@pytest.mark.parametrize("is_causal", [False, True])
def test_need_weights_matches_direct_recomputation(backend, to_xp, to_np, is_causal):
    """The weights against attention computed by hand, Lq = 3 != Lk = 5; with is_causal, query
    i sees keys j <= i (top-left, SDPA's default: bottom-right would let it see j <= i + 2)."""
    D, H = 8, 2
    mha = MultiHeadAttention(D, H, dtype="float64", seed=3, backend=backend)
    rng = np.random.default_rng(3)
    x, y = rng.standard_normal((2, 3, D)), rng.standard_normal((2, 5, D))
    m = rng.random((3, 5)) > 0.3
    m[:, 0] = True  # every query keeps key 0, causal or not
    _, w = mha(to_xp(x), to_xp(y), to_xp(y), mask=to_xp(m), is_causal=is_causal, need_weights=True,
               average_attn_weights=False)
    allowed = m & np.tril(np.ones((3, 5), dtype=bool)) if is_causal else m  # [Lq, Lk]
    P = {k: to_np(v) for k, v in mha.params.items()}
    q = (x @ P["w_q"].T + P["b_q"]).reshape(2, 3, H, D // H).transpose(0, 2, 1, 3)
    k = (y @ P["w_k"].T + P["b_k"]).reshape(2, 5, H, D // H).transpose(0, 2, 1, 3)
    s = np.where(allowed, q @ k.transpose(0, 1, 3, 2) / math.sqrt(D // H), -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    np.testing.assert_allclose(to_np(w), p, rtol=1e-12, atol=1e-15)


def test_the_default_impl_is_auto(monkeypatch):
    """Without impl=, the module dispatches per call ("auto"): small NumPy inputs run on the NumPy
    kernel, and past AUTO_BLOCKED_MIN_SCORES scores per head on the blocked path."""
    from npattn import attention as A
    from npattn.blocked import BlockedSDPACache
    from npattn.numpy_kernel import NumpySDPACache

    mha = MultiHeadAttention(8, 2, dtype="float64", seed=0)
    assert mha.impl == "auto"
    x = np.random.default_rng(0).standard_normal((2, 3, 8))
    mha(x, x, x)
    assert type(mha.cache.sdpa) is NumpySDPACache
    monkeypatch.setattr(A, "AUTO_BLOCKED_MIN_SCORES", 9)  # 3 x 3 scores per head
    mha(x, x, x)
    assert type(mha.cache.sdpa) is BlockedSDPACache


@given(seed=st.integers(0, 2**16), B=st.integers(1, 3), L=st.integers(2, 6))
def test_self_attention_is_permutation_equivariant(backend, to_xp, to_np, seed, B, L):
    mha = MultiHeadAttention(6, 3, dtype="float64", seed=seed, backend=backend)
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((B, L, 6))
    perm = rng.permutation(L)
    out = to_np(mha(*(to_xp(x),) * 3)[0])
    out_perm = to_np(mha(*(to_xp(x[:, perm]),) * 3)[0])
    np.testing.assert_allclose(out_perm, out[:, perm], rtol=1e-10, atol=1e-12)


def test_fully_masked_rows_give_output_bias_and_zero_gradients(backend, to_xp, to_np):
    mha = MultiHeadAttention(6, 2, dtype="float64", seed=0, backend=backend)
    rng = np.random.default_rng(0)
    mha.params["b_o"] = to_xp(rng.standard_normal(6))
    x = to_xp(rng.standard_normal((2, 3, 6)))
    mask = np.ones((2, 1, 3, 4), bool)
    mask[0, 0, 1] = False  # one query row has nothing to attend
    mask[1] = False  # nor any row of the second batch entry
    y = to_xp(rng.standard_normal((2, 4, 6)))
    out = to_np(mha(x, y, y, mask=to_xp(mask))[0])
    b_o = to_np(mha.params["b_o"])
    np.testing.assert_array_equal(out[0, 1], b_o)
    np.testing.assert_array_equal(out[1], np.broadcast_to(b_o, (3, 6)))
    dq, dk, dv = mha.backward(to_xp(rng.standard_normal((2, 3, 6))))
    dq, dk, dv = to_np(dq), to_np(dk), to_np(dv)
    assert np.all(dq[0, 1] == 0.0) and np.all(dq[1] == 0.0)
    assert np.all(dk[1] == 0.0) and np.all(dv[1] == 0.0)
    for g in mha.grads.values():
        assert np.all(np.isfinite(to_np(g)))


def test_train_eval_and_seeded_dropout(backend, to_xp, to_np):
    rng = np.random.default_rng(0)
    x = to_xp(rng.standard_normal((2, 5, 8)))
    a = MultiHeadAttention(8, 2, dropout=0.5, dtype="float64", seed=11, backend=backend)
    b = MultiHeadAttention(8, 2, dropout=0.5, dtype="float64", seed=11, backend=backend)
    assert a.training
    out_a, w_a = a(x, x, x, need_weights=True, average_attn_weights=False)
    out_b, _ = b(x, x, x)
    np.testing.assert_array_equal(to_np(out_a), to_np(out_b))  # same seed, same masks
    out_a2, _ = a(x, x, x)
    assert not np.array_equal(to_np(out_a), to_np(out_a2))  # a fresh mask each call
    assert a.eval() is a and not a.training  # returns self, as train() does
    e1, w_e = a(x, x, x, need_weights=True, average_attn_weights=False)
    e2, _ = a(x, x, x)
    np.testing.assert_array_equal(to_np(e1), to_np(e2))  # no dropout in eval
    np.testing.assert_allclose(to_np(w_a), to_np(w_e), rtol=1e-14)  # weights are before dropout
    assert a.train() is a and a.training


def test_given_keep_mask_replaces_the_generator(backend, to_xp, to_np):
    rng = np.random.default_rng(0)
    x = to_xp(rng.standard_normal((2, 4, 6)))
    keep = to_xp(rng.random((2, 3, 4, 4)) > 0.4)
    a = MultiHeadAttention(6, 3, dropout=0.4, dtype="float64", seed=1, backend=backend)
    b = MultiHeadAttention(6, 3, dropout=0.4, dtype="float64", seed=2, backend=backend)
    b.params.update(a.params)
    np.testing.assert_array_equal(to_np(a(x, x, x, dropout_mask=keep)[0]),
                                  to_np(b(x, x, x, dropout_mask=keep)[0]))


@pytest.mark.parametrize("dropout, training", [(0.4, False), (0.0, True)], ids=["eval", "p=0"])
def test_given_keep_mask_acts_only_in_training_with_dropout(backend, to_xp, to_np, dropout,
                                                            training):
    """A keep-mask that drops keys changes nothing in eval mode, nor in training with
    dropout 0: output and gradients are those of the call without it."""
    rng = np.random.default_rng(4)
    B, Lq, Lk, D, H = 2, 3, 5, 6, 3
    q, kv = to_xp(rng.standard_normal((B, Lq, D))), to_xp(rng.standard_normal((B, Lk, D)))
    keep = to_xp(rng.random((B, H, Lq, Lk)) > 0.5)
    d = to_xp(rng.standard_normal((B, Lq, D)))
    mha = MultiHeadAttention(D, H, dropout=dropout, dtype="float64", seed=4, backend=backend)
    mha.train(training)
    want = to_np(mha(q, kv, kv)[0]), *(to_np(g) for g in mha.backward(d))
    got = to_np(mha(q, kv, kv, dropout_mask=keep)[0]), *(to_np(g) for g in mha.backward(d))
    for a, b in zip(got, want):
        np.testing.assert_array_equal(a, b)


def test_preserve_state_puts_everything_back(backend, to_xp, to_np):
    """What runs inside (the gradient checker's forwards and backwards) leaves no trace: the
    params' arrays, the last forward's cache, grads, dmask, the mode and the generator."""
    rng = np.random.default_rng(0)
    x, d = to_xp(rng.standard_normal((2, 4, 6))), to_xp(rng.standard_normal((2, 4, 6)))
    bias = to_xp(rng.standard_normal((4, 4)))  # a floating mask: dmask is an array, not None
    a, b = (MultiHeadAttention(6, 3, dropout=0.4, dtype="float64", seed=1, backend=backend)
            for _ in range(2))
    for m in (a, b):
        m(x, x, x, mask=bias)
        m.backward(d)
    params, cache, grads, dmask = dict(a.params), a.cache, a.grads, a.dmask
    grad_values = {n: np.array(to_np(g)) for n, g in grads.items()}  # copies: the dict's contents
    assert dmask is not None
    with pytest.raises(RuntimeError, match="inside"):
        with a.preserve_state() as same:
            assert same is a
            a.params["w_q"] = a.params["w_q"] * 2.0
            for _ in range(2):  # draws two masks; the first forward's arrays are reused
                a(x, x, x)
                a.backward(d)
            a.eval()
            raise RuntimeError("inside")
    assert all(a.params[n] is params[n] for n in params)
    assert a.cache is cache and a.grads is grads and a.dmask is dmask and a.training
    assert set(a.grads) == set(grad_values)  # the same dict, holding what it held
    for n, g in a.grads.items():
        np.testing.assert_array_equal(to_np(g), grad_values[n], err_msg=n)
    np.testing.assert_array_equal(to_np(a(x, x, x)[0]), to_np(b(x, x, x)[0]))  # the same next mask
    for got, want in zip(a.backward(d), b.backward(d)):
        np.testing.assert_array_equal(to_np(got), to_np(want))


@pytest.mark.parametrize("error", [MemoryError, KeyboardInterrupt])
def test_a_forward_that_fails_after_drawing_its_mask_changes_nothing(backend, to_xp, to_np,
                                                                      monkeypatch, error):
    """Step 7. fails (memory, or Ctrl-C) after step 6. drew its dropout mask: the generator
    is put back, so the next forward draws the mask an untouched twin draws, and the cache
    and grads are those of the forward before."""
    import npattn.functional

    rng = np.random.default_rng(3)
    x, d = to_xp(rng.standard_normal((2, 4, 6))), to_xp(rng.standard_normal((2, 4, 6)))
    a = MultiHeadAttention(6, 3, dropout=0.5, dtype="float64", seed=2, backend=backend)
    a(x, x, x)
    a.backward(d)
    b = copy.deepcopy(a)  # the same generator state, parameters and grads
    cache, grads = a.cache, a.grads

    def fails(*args, **kwargs):
        raise error("step 7.")

    with monkeypatch.context() as patch:
        patch.setattr(npattn.functional, "merge_heads_forward", fails)
        with pytest.raises(error, match="step 7."):
            a(x, x, x)
    assert a.cache is cache and a.grads is grads
    np.testing.assert_array_equal(to_np(a(x, x, x)[0]), to_np(b(x, x, x)[0]))
    for got, want in zip(a.backward(d), b.backward(d)):
        np.testing.assert_array_equal(to_np(got), to_np(want))


@pytest.mark.parametrize("decoding", [False, True])
def test_a_forward_whose_weights_fail_changes_nothing(backend, to_xp, to_np, monkeypatch, decoding):
    """need_weights: the weights are formed after the attention ran; should that fail (memory),
    the module keeps the forward before (its cache, its generator) and a KV cache its lengths
    and keys, so that the next calls give what an untouched twin gives."""
    import npattn.attention

    rng = np.random.default_rng(4)
    x, d = to_xp(rng.standard_normal((2, 3, 6))), to_xp(rng.standard_normal((2, 3, 6)))
    y = to_xp(rng.standard_normal((2, 1, 6)))
    a = MultiHeadAttention(6, 3, dropout=0.0 if decoding else 0.5, dtype="float64", seed=2,
                           backend=backend)
    kv = kv_b = None
    if decoding:
        a.eval()
        kv = a.new_cache(2, 4)
        a(x, x, x, kv_cache=kv)
        b, kv_b = copy.deepcopy((a, kv))  # the same parameters and keys
    else:
        a(x, x, x)
        a.backward(d)
        b = copy.deepcopy(a)  # the same generator state, parameters and grads (a copy has no cache)
        a(x, x, x)  # a cache to keep
        b(x, x, x)
    cache, lens = a.cache, None if kv is None else kv.cache_seqlens
    keys = None if kv is None else to_np(kv.k)[:, :, :3]

    def fails(*args, **kwargs):
        raise MemoryError("weights")

    with monkeypatch.context() as patch:
        patch.setattr(npattn.attention, "weights", fails)
        with pytest.raises(MemoryError, match="weights"):
            a(y if decoding else x, y if decoding else x, y if decoding else x, need_weights=True,
              kv_cache=kv)
    assert a.cache is cache
    if decoding:
        np.testing.assert_array_equal(kv.cache_seqlens, lens)
        np.testing.assert_array_equal(to_np(kv.k)[:, :, :3], keys)
        got, want = a(y, y, y, kv_cache=kv), b(y, y, y, kv_cache=kv_b)
        np.testing.assert_array_equal(to_np(got[0]), to_np(want[0]))
        np.testing.assert_array_equal(kv.cache_seqlens, kv_b.cache_seqlens)
        return
    for got, want in zip(a.backward(d), b.backward(d)):  # the forward before, differentiated
        np.testing.assert_array_equal(to_np(got), to_np(want))
    np.testing.assert_array_equal(to_np(a(x, x, x)[0]), to_np(b(x, x, x)[0]))  # the same next mask


def test_forward_always_returns_out_and_weights(backend, to_xp, to_np):
    """torch's habit ``out, _ = mha(x, x, x)`` gives the output, not a split batch axis."""
    B, L, D, H = 2, 5, 16, 4
    mha = MultiHeadAttention(D, H, dtype="float64", seed=0, backend=backend)
    x = to_xp(np.random.default_rng(0).standard_normal((B, L, D)))
    res = mha(x, x, x)
    assert isinstance(res, tuple) and len(res) == 2
    out, weights = res
    assert tuple(out.shape) == (B, L, D) and weights is None
    out_f, w_f = mha.forward(x, x, x, is_causal=True, impl="blocked")  # forward, too; no weights
    assert tuple(out_f.shape) == (B, L, D) and w_f is None
    _, w = mha(x, x, x, need_weights=True)
    assert tuple(w.shape) == (B, L, L)  # averaged over the heads by default, as torch


def test_the_block_lengths_reach_the_blocked_kernel(backend, to_xp):
    """``block_q`` and ``block_k`` are the blocked kernel's query and key block lengths, each
    its own (the output cannot show them: every split gives the same numbers to rounding)."""
    mha = MultiHeadAttention(4, 2, dtype="float64", seed=0, backend=backend, impl="blocked",
                             block_q=2, block_k=3)
    x = to_xp(np.random.default_rng(0).standard_normal((2, 5, 4)))
    mha(x, x, x)
    sdpa = mha.cache.sdpa
    assert (sdpa.block_q, sdpa.block_k) == (2, 3)


@pytest.mark.parametrize("dtype", ["float64", "float32"])
def test_average_attn_weights_is_the_mean_over_heads(backend, to_xp, to_np, dtype):
    """``average_attn_weights`` (default True) is the mean over heads of the per-head weights,
    extra keys of add_bias_kv / add_zero_attn included; the output does not depend on it."""
    B, Lq, Lk, D, H = 2, 3, 4, 8, 4
    mha = MultiHeadAttention(D, H, add_bias_kv=True, add_zero_attn=True, dtype=dtype, seed=2,
                             backend=backend)
    rng = np.random.default_rng(2)
    q = to_xp(rng.standard_normal((B, Lq, D)).astype(dtype))
    kv = to_xp(rng.standard_normal((B, Lk, D)).astype(dtype))
    mask = rng.random((B, H, Lq, Lk)) > 0.4  # per-head masks: the heads' weights differ
    out_h, w_h = mha(q, kv, kv, mask=to_xp(mask), need_weights=True, average_attn_weights=False)
    out_a, w_a = mha(q, kv, kv, mask=to_xp(mask), need_weights=True)
    assert tuple(w_h.shape) == (B, H, Lq, Lk + 2) and tuple(w_a.shape) == (B, Lq, Lk + 2)
    assert w_a.dtype == w_h.dtype == mha.dtype
    w_h, w_a = to_np(w_h), to_np(w_a)
    assert not np.allclose(w_h[:, 0], w_h[:, 1])  # a mean over equal heads would prove nothing
    tol = 1e-15 if dtype == "float64" else 1e-7
    np.testing.assert_allclose(w_a, w_h.mean(axis=1), rtol=tol, atol=tol)
    np.testing.assert_array_equal(to_np(out_a), to_np(out_h))
    _, w_none = mha(q, kv, kv, average_attn_weights=False)
    assert w_none is None


def _central_differences(loss, x, eps=1e-6):
    """d loss / d x by central differences, one element at a time (float64)."""
    grad = np.zeros_like(x)
    for i in np.ndindex(x.shape):
        old = x[i]
        x[i] = old + eps
        up = loss()
        x[i] = old - eps
        down = loss()
        x[i] = old
        grad[i] = (up - down) / (2 * eps)
    return grad


def test_query_as_key_with_another_value_projects_the_value():
    """forward(x, x, value): query is key but value is another array, so the value projection
    must read ``value``, not x (the one-GEMM path is for query is key is value only).
    Checked against central differences with a random upstream gradient: d/dx is
    dquery + dkey, d/dvalue is dvalue (Lq = Lk here: the query is the key)."""
    B, L, D, H = 2, 3, 4, 2
    mha = MultiHeadAttention(D, H, dtype="float64", seed=7)
    rng = np.random.default_rng(7)
    mha.params = {n: a + 0.3 * rng.standard_normal(a.shape) for n, a in mha.params.items()}
    x, value = rng.standard_normal((B, L, D)), rng.standard_normal((B, L, D))
    g = rng.standard_normal((B, L, D))

    def loss():
        return float(np.sum(mha(x, x, value)[0] * g))

    want_dx = _central_differences(loss, x)
    want_dvalue = _central_differences(loss, value)
    mha(x, x, value)
    dquery, dkey, dvalue = mha.backward(g)
    np.testing.assert_allclose(dvalue, want_dvalue, rtol=1e-6, atol=1e-8)
    np.testing.assert_allclose(dquery + dkey, want_dx, rtol=1e-6, atol=1e-8)


def test_self_attention_gradients_against_central_differences():
    """forward(x, x, x) (the one-GEMM path): d/dx is dquery + dkey + dvalue, and every
    parameter's gradient, biases of the fused projection included, matches central
    differences with a random upstream gradient (random nonzero parameters; written out here,
    independent of gradcheck_module, which takes this path too for one array passed thrice)."""
    B, L, D, H = 2, 3, 4, 2
    mha = MultiHeadAttention(D, H, dtype="float64", seed=8)
    rng = np.random.default_rng(8)
    mha.params = {n: a + 0.3 * rng.standard_normal(a.shape) for n, a in mha.params.items()}
    x = rng.standard_normal((B, L, D))
    g = rng.standard_normal((B, L, D))

    def loss():
        return float(np.sum(mha(x, x, x, is_causal=True)[0] * g))

    want = {"x": _central_differences(loss, x)}
    want.update({n: _central_differences(loss, p) for n, p in mha.params.items()})
    mha(x, x, x, is_causal=True)
    dquery, dkey, dvalue = mha.backward(g)
    np.testing.assert_allclose(dquery + dkey + dvalue, want["x"], rtol=1e-6, atol=1e-8)
    assert set(mha.grads) == set(mha.params)
    for name in mha.params:
        np.testing.assert_allclose(mha.grads[name], want[name], rtol=1e-6, atol=1e-8,
                                   err_msg=name)


def test_check_finite_on_dask_reads_every_array_in_one_graph():
    """check_finite on dask read one count per array, each in a graph of its own: 11 for a
    self-attention call (query, key and value, each a pass over x, and 8 parameters; 45 ms
    where the forward's graph takes 7 ms). Now one graph and one pass over each chunk of x;
    the output is NumPy's, and a NaN is still named."""
    da = pytest.importorskip("dask.array", reason="needs dask: pip install '.[dask]'")
    import dask

    rng = np.random.default_rng(14)
    host = rng.standard_normal((4, 5, 8))
    calls, runs = [], []

    def counted(block):
        calls.append(block.shape)
        return block

    def counting_scheduler(dsk, keys, **kwargs):
        runs.append(keys)
        return dask.get(dsk, keys, **kwargs)

    want, _ = MultiHeadAttention(8, 2, dtype="float64", seed=3).forward(host, host, host)
    mha = MultiHeadAttention(8, 2, dtype="float64", seed=3, backend="dask")
    x = da.from_array(host, chunks=(2, 5, 8)).map_blocks(counted, meta=host[:0])  # 2 chunks
    with dask.config.set(scheduler=counting_scheduler):
        out, _ = mha.forward(x, x, x, check_finite=True)
        assert (len(runs), len(calls)) == (1, 2), (runs, calls)
        np.testing.assert_allclose(out.compute(), want, rtol=1e-12, atol=1e-14)
        bad = da.from_array(np.where(np.arange(8) == 3, np.nan, host), chunks=(2, 5, 8))
        with pytest.raises(ValueError, match=r"value: expected finite values, got 20 entries that are NaN"):
            mha.forward(x, x, bad, check_finite=True)
