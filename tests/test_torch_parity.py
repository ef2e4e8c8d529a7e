"""npattn against torch autograd, in float64, within 1e-9 relative.

Three references:

* ``torch.nn.MultiheadAttention`` itself, loaded with npattn's weights
  through ``npattn.torch_interop`` (every layer torch can express);
* torch ops composed by hand, projections and ``F.scaled_dot_product_attention``
  (layers torch MHA cannot express: qdim, separate bias flags, GQA), or an
  explicit softmax times npattn's dropout keep-mask (dropout with p > 0: torch
  cannot take a keep-mask);
* ``F.scaled_dot_product_attention`` against ``npattn.functional.sdpa_*``.

Every output and every gradient is compared: the inputs, all parameters
(bias_k/bias_v included) and a floating mask's gradient at the mask's own
shape. torch MHA's masks (True = ignore) go through
``npattn.masks.from_torch_mha``, so its conversion is checked against torch
too. npattn runs on every backend fixture.
"""

import math

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

torch = pytest.importorskip("torch")
TF = torch.nn.functional

from npattn import MultiHeadAttention  # noqa: E402
from npattn import functional as F  # noqa: E402
from npattn.backend import from_numpy, resolve_backend, to_numpy  # noqa: E402
from npattn.masks import from_torch_mha  # noqa: E402

RTOL = 1e-9
fixture_ok = settings(suppress_health_check=[HealthCheck.function_scoped_fixture])


def _np(a):
    return a.detach().numpy() if isinstance(a, torch.Tensor) else np.asarray(to_numpy(a))


def assert_close(got, want, name, floor=0.0):
    """max |got - want| <= 1e-9 * max(max |want|, floor).

    Relative to the array's scale. ``floor`` is for gradients that vanish in
    exact arithmetic (``b_k``: softmax ignores a shift shared by a row's
    scores) and so are pure rounding noise: the tests pass 1e-3 of the
    largest gradient of the same backward, an absolute 1e-12 of it.
    """
    got = np.asarray(_np(got), dtype=np.float64)
    want = _np(want)
    assert got.shape == want.shape, f"{name}: shape {got.shape} != torch {want.shape}"
    assert np.all(np.isfinite(got)), f"{name}: npattn has non-finite entries"
    scale = max(float(np.max(np.abs(want), initial=0.0)), floor)
    err = float(np.max(np.abs(got - want), initial=0.0))
    assert err <= RTOL * scale + 1e-300, f"{name}: max abs err {err:.3e}, scale {scale:.3e}"


def grad_floor(*grads):
    """1e-3 of the largest entry among torch gradients (see ``assert_close``)."""
    return 1e-3 * max(float(np.max(np.abs(_np(g)), initial=0.0)) for g in grads if g is not None)


def t64(a, grad=True):
    return torch.tensor(a, dtype=torch.float64, requires_grad=grad)


def on(backend, a):
    return None if a is None else from_numpy(np.asarray(a), resolve_backend(backend))


# --------------------------------------------------------------------------
# torch MHA-style masks (True = ignore) and their npattn equivalent


def draw_torch_masks(rng, kind, B, H, Lq, S, causal):
    """torch attn_mask / key_padding_mask of ``kind``; key 0 is always attendable.

    (torch MHA gives NaN for a query row with nothing to attend; npattn gives
    zeros. That convention is tested elsewhere; here every row has a key.)
    """
    attn_mask = kpm = None
    if "padding" in kind:
        lengths = rng.integers(1, S + 1, size=B)  # [B], >= 1 key each
        kpm = np.arange(S)[None, :] >= lengths[:, None]  # [B, S] True = ignore
    if "bool" in kind:
        shape = (Lq, S) if "3d" not in kind else (B * H, Lq, S)
        attn_mask = rng.random(shape) < 0.4  # True = ignore
        attn_mask[..., 0] = False
    if "float" in kind:
        shape = (Lq, S) if "3d" not in kind else (B * H, Lq, S)
        attn_mask = rng.standard_normal(shape)
        attn_mask[..., 1:][rng.random(attn_mask[..., 1:].shape) < 0.2] = -math.inf
    return attn_mask, kpm


def causal_ignore(Lq, S):
    return torch.ones(Lq, S, dtype=torch.bool).triu(1)  # True = ignore, top-left


# --------------------------------------------------------------------------
# 1. the module against torch.nn.MultiheadAttention


@st.composite
def mha_configs(draw):
    H = draw(st.sampled_from([1, 2, 3]))
    cross = draw(st.booleans())
    Lq = draw(st.integers(2, 4))
    return dict(
        H=H,
        D=H * draw(st.integers(1, 3)),
        B=draw(st.integers(2, 3)),
        Lq=Lq,
        S=draw(st.integers(2, 5).filter(lambda s: s != Lq)) if cross else Lq,
        cross=cross,
        kdim=draw(st.sampled_from([None, 2, 5])) if cross else None,
        vdim=draw(st.sampled_from([None, 3])) if cross else None,
        bias=draw(st.booleans()),
        add_bias_kv=draw(st.booleans()),
        add_zero_attn=draw(st.booleans()),
        mask=draw(st.sampled_from(
            ["none", "bool", "bool3d", "float", "float3d", "padding", "bool+padding", "float+padding"]
        )),
        causal=draw(st.booleans()),
        need_weights=draw(st.booleans()),
        average=draw(st.booleans()),
        seed=draw(st.integers(0, 2**16)),
    )


@fixture_ok
@given(cfg=mha_configs())
def test_module_matches_torch_mha(backend, cfg):
    c = cfg
    B, H, D, Lq, S = c["B"], c["H"], c["D"], c["Lq"], c["S"]
    rng = np.random.default_rng(c["seed"])
    torch.manual_seed(c["seed"])
    tm = torch.nn.MultiheadAttention(
        D, H, bias=c["bias"], add_bias_kv=c["add_bias_kv"], add_zero_attn=c["add_zero_attn"],
        kdim=c["kdim"], vdim=c["vdim"], batch_first=True, dtype=torch.float64,
    )
    with torch.no_grad():  # non-zero biases, so their gradients matter
        for p in tm.parameters():
            p.copy_(torch.randn_like(p))
    mha = MultiHeadAttention.from_torch(tm, backend=backend)
    Dk, Dv = c["kdim"] or D, c["vdim"] or D

    query = rng.standard_normal((B, Lq, D))
    key = rng.standard_normal((B, S, Dk)) if c["cross"] else query
    value = rng.standard_normal((B, S, Dv)) if c["cross"] else query
    attn_mask, kpm = draw_torch_masks(rng, c["mask"], B, H, Lq, S, c["causal"])
    mask = from_torch_mha(attn_mask, kpm, n_head=H, batch_size=B)  # True = attend, or additive

    # torch: self-attention passes one tensor three times, so its grad is the sum
    tq = t64(query)
    tk, tv = (t64(key), t64(value)) if c["cross"] else (tq, tq)
    t_am = None if attn_mask is None else torch.tensor(attn_mask, requires_grad=attn_mask.dtype != bool)
    am_in = t_am
    if c["causal"]:  # torch MHA needs the causal mask spelled out (is_causal is only a hint)
        cm = causal_ignore(Lq, S)
        if am_in is None:
            am_in = cm
        elif am_in.dtype == torch.bool:
            am_in = am_in | cm
        else:
            am_in = am_in.masked_fill(cm, -math.inf)
    t_kpm = None if kpm is None else torch.tensor(kpm)
    t_out, t_w = tm(
        tq, tk, tv, attn_mask=am_in, key_padding_mask=t_kpm,
        need_weights=c["need_weights"], average_attn_weights=c["average"],
    )
    dout = rng.standard_normal(t_out.shape)
    t_out.backward(torch.tensor(dout))

    out, w = mha(
        on(backend, query), on(backend, key), on(backend, value), mask=on(backend, mask),
        is_causal=c["causal"], need_weights=c["need_weights"], average_attn_weights=c["average"],
    )
    assert_close(out, t_out, "out")
    if c["need_weights"]:
        assert_close(w, t_w, "weights")
    else:
        assert w is None and t_w is None
    dq, dk, dv = mha.backward(on(backend, dout))
    t_grads = {k: p.grad for k, p in tm.named_parameters()}
    floor = grad_floor(tq.grad, tk.grad, tv.grad, *t_grads.values())
    if c["cross"]:
        assert_close(dq, tq.grad, "dquery", floor)
        assert_close(dk, tk.grad, "dkey", floor)
        assert_close(dv, tv.grad, "dvalue", floor)
    else:
        assert_close(to_numpy(dq) + to_numpy(dk) + to_numpy(dv), tq.grad, "dx (self-attention)", floor)
    from npattn.torch_interop import torch_state_dict_shapes

    assert set(torch_state_dict_shapes(mha)) == set(t_grads)
    for name, g in MultiHeadAttention.torch_state_dict(_with_params(mha, mha.grads)).items():
        assert_close(g, t_grads[name], "grad " + name, floor)
    if t_am is not None and t_am.requires_grad:
        dmask = to_numpy(mha.dmask)  # [1 or B, 1 or H, Lq, S], the adapter's shape
        assert dmask.shape == tuple(mask.shape)
        if attn_mask.ndim == 2:  # npattn's mask was attn_mask (+ padding): sum the broadcast
            dmask = dmask.sum(axis=(0, 1))
        else:
            dmask = dmask.reshape(B * H, Lq, S)
        assert_close(dmask, t_am.grad, "dmask", floor)
    else:
        assert mha.dmask is None


def test_averaged_weights_match_torch_default(backend):
    """torch's defaults (``need_weights=True, average_attn_weights=True``) against npattn's
    ``need_weights=True`` (averaged by default), with extra keys and a padding mask; and
    ``need_weights=False`` gives None on both sides."""
    rng = np.random.default_rng(7)
    B, L, S, D, H = 2, 3, 5, 6, 3
    torch.manual_seed(7)
    tm = torch.nn.MultiheadAttention(D, H, add_bias_kv=True, add_zero_attn=True,
                                     batch_first=True, dtype=torch.float64).eval()
    mha = MultiHeadAttention.from_torch(tm, backend=backend)
    query, key = rng.standard_normal((B, L, D)), rng.standard_normal((B, S, D))
    kpm = np.arange(S)[None, :] >= np.array([5, 2])[:, None]  # [B, S] True = padding
    t_out, t_w = tm(t64(query), t64(key), t64(key), key_padding_mask=torch.tensor(kpm))
    assert tuple(t_w.shape) == (B, L, S + 2)
    out, w = mha(on(backend, query), on(backend, key), on(backend, key),
                 mask=on(backend, ~kpm[:, None, None, :]), need_weights=True)
    assert_close(out, t_out, "out")
    assert_close(w, t_w, "averaged weights")
    _, t_none = tm(t64(query), t64(key), t64(key), need_weights=False)
    _, none = mha(on(backend, query), on(backend, key), on(backend, key))
    assert t_none is None and none is None


def _with_params(mha, params):
    """A shallow copy of ``mha`` whose params are ``params`` (to export gradients by torch name)."""
    clone = object.__new__(type(mha))
    clone.__dict__.update(mha.__dict__)
    clone.params = params
    return clone


# --------------------------------------------------------------------------
# 2. layers beyond torch MHA, and dropout with a keep-mask, against torch by hand


def torch_by_hand(query, key, value, P, *, H, Hkv, mask, is_causal, add_zero_attn, keep, p):
    """torch ops composed like npattn's forward; every tensor in P, mask may require grad.

    ``mask``: npattn convention (True = attend, or additive) over the S given
    keys; the extra keys are padded attendable, as torch pads its masks.
    Without dropout the attention itself is ``F.scaled_dot_product_attention``.
    """
    B, Lq, S = query.shape[0], query.shape[1], key.shape[1]
    q = TF.linear(query, P["w_q"], P.get("b_q"))  # [B, Lq, D]
    k = TF.linear(key, P["w_k"], P.get("b_k"))  # [B, S, Dkv]
    v = TF.linear(value, P["w_v"], P.get("b_v"))
    if "bias_k" in P:
        k = torch.cat([k, P["bias_k"].expand(B, 1, -1)], dim=1)
        v = torch.cat([v, P["bias_v"].expand(B, 1, -1)], dim=1)
    if add_zero_attn:
        k = torch.cat([k, k.new_zeros(B, 1, k.shape[-1])], dim=1)
        v = torch.cat([v, v.new_zeros(B, 1, v.shape[-1])], dim=1)
    n = k.shape[1] - S
    m = torch.zeros(Lq, S, dtype=torch.float64)
    if mask is not None:
        m = m + (mask if mask.dtype != torch.bool else torch.zeros_like(m).masked_fill(~mask, -math.inf))
    if is_causal:
        m = m.masked_fill(causal_ignore(Lq, S), -math.inf)
    m = TF.pad(m, (0, n))  # extra keys attendable, [..., Lq, S + n]
    Dh = q.shape[-1] // H
    qh = q.view(B, Lq, H, Dh).transpose(1, 2)
    kh = k.view(B, S + n, Hkv, Dh).transpose(1, 2)
    vh = v.view(B, S + n, Hkv, Dh).transpose(1, 2)
    if keep is None:
        oh = TF.scaled_dot_product_attention(qh, kh, vh, attn_mask=m, enable_gqa=Hkv != H)
    else:
        kh, vh = (t.repeat_interleave(H // Hkv, dim=1) for t in (kh, vh))
        probs = torch.softmax(qh @ kh.transpose(-1, -2) / math.sqrt(Dh) + m, dim=-1)
        oh = (probs * keep / (1.0 - p)) @ vh
    o = oh.transpose(1, 2).reshape(B, Lq, H * Dh)
    return TF.linear(o, P["w_o"], P.get("b_o"))


@st.composite
def layer_configs(draw):
    Hkv = draw(st.sampled_from([1, 2]))
    H = Hkv * draw(st.sampled_from([1, 2]))
    Lq = draw(st.integers(2, 4))
    return dict(
        H=H,
        Hkv=Hkv,
        Dh=draw(st.integers(1, 3)),
        B=draw(st.integers(2, 3)),
        Lq=Lq,
        S=draw(st.integers(2, 5).filter(lambda s: s != Lq)),
        qdim=draw(st.sampled_from([None, 3, 7])),
        kdim=draw(st.sampled_from([None, 2, 5])),
        vdim=draw(st.sampled_from([None, 3])),
        qkv_bias=draw(st.booleans()),
        out_bias=draw(st.booleans()),
        add_bias_kv=draw(st.booleans()),
        add_zero_attn=draw(st.booleans()),
        mask=draw(st.sampled_from(["none", "bool", "float", "padding"])),
        causal=draw(st.booleans()),
        p=draw(st.sampled_from([0.0, 0.3, 0.5])),
        seed=draw(st.integers(0, 2**16)),
    )


@fixture_ok
@given(cfg=layer_configs())
def test_module_matches_torch_by_hand(backend, cfg):
    c = cfg
    B, H, Hkv, Lq, S = c["B"], c["H"], c["Hkv"], c["Lq"], c["S"]
    D = H * c["Dh"]
    rng = np.random.default_rng(c["seed"])
    mha = MultiHeadAttention(
        D, H, n_kv_head=Hkv, qdim=c["qdim"], kdim=c["kdim"], vdim=c["vdim"],
        qkv_bias=c["qkv_bias"], out_bias=c["out_bias"], add_bias_kv=c["add_bias_kv"],
        add_zero_attn=c["add_zero_attn"], dropout=c["p"], dtype="float64", backend=backend,
    )
    params = {k: rng.standard_normal(tuple(v.shape)) for k, v in mha.params.items()}
    for k, a in params.items():
        mha.params[k] = on(backend, a)
    query = rng.standard_normal((B, Lq, mha.qdim))
    key = rng.standard_normal((B, S, mha.kdim))
    value = rng.standard_normal((B, S, mha.vdim))
    if c["mask"] == "bool":
        mask = rng.random((Lq, S)) < 0.7
        mask[:, 0] = True
    elif c["mask"] == "float":
        mask = rng.standard_normal((B, 1, Lq, S))
        mask[..., 1:][rng.random((B, 1, Lq, S - 1)) < 0.2] = -math.inf
    elif c["mask"] == "padding":
        mask = np.arange(S)[None, None, None, :] < rng.integers(1, S + 1, size=(B, 1, 1, 1))
    else:
        mask = None
    n_extra = c["add_bias_kv"] + c["add_zero_attn"]
    keep = rng.random((B, H, Lq, S + n_extra)) >= c["p"] if c["p"] > 0 else None

    tP = {k: t64(a) for k, a in params.items()}
    tq, tk, tv = t64(query), t64(key), t64(value)
    t_mask = None
    if mask is not None:
        t_mask = torch.tensor(mask, requires_grad=mask.dtype != bool)
    t_out = torch_by_hand(
        tq, tk, tv, tP, H=H, Hkv=Hkv, mask=t_mask, is_causal=c["causal"],
        add_zero_attn=c["add_zero_attn"], keep=None if keep is None else torch.tensor(keep), p=c["p"],
    )
    dout = rng.standard_normal(tuple(t_out.shape))
    t_out.backward(torch.tensor(dout))

    out, _ = mha(
        on(backend, query), on(backend, key), on(backend, value), mask=on(backend, mask),
        is_causal=c["causal"], dropout_mask=on(backend, keep),
    )
    assert_close(out, t_out, "out")
    dq, dk, dv = mha.backward(on(backend, dout))
    floor = grad_floor(tq.grad, tk.grad, tv.grad, *(t.grad for t in tP.values()))
    assert_close(dq, tq.grad, "dquery", floor)
    assert_close(dk, tk.grad, "dkey", floor)
    assert_close(dv, tv.grad, "dvalue", floor)
    assert set(mha.grads) == set(tP)
    for name, g in mha.grads.items():
        assert_close(g, tP[name].grad, "grad " + name, floor)
    if t_mask is not None and t_mask.requires_grad:
        assert_close(mha.dmask, t_mask.grad, "dmask", floor)
    else:
        assert mha.dmask is None


# --------------------------------------------------------------------------
# 3. functional sdpa against F.scaled_dot_product_attention


@st.composite
def sdpa_configs(draw):
    Hkv = draw(st.sampled_from([1, 2]))
    Lq = draw(st.integers(2, 4))
    return dict(
        B=draw(st.integers(2, 3)),
        Hkv=Hkv,
        H=Hkv * draw(st.sampled_from([1, 2, 3])),
        Lq=Lq,
        Lk=draw(st.integers(2, 5).filter(lambda s: s != Lq)),
        Dh=draw(st.integers(1, 4)),
        Dv=draw(st.integers(1, 4)),
        mask=draw(st.sampled_from(
            ["none", "bool_lq_lk", "bool_b1qk", "float_lq_lk", "float_bhqk", "float_b11k"]
        )),
        causal=draw(st.booleans()),
        scale=draw(st.sampled_from([None, 0.3, 2.0])),
        empty_row=draw(st.booleans()),
        seed=draw(st.integers(0, 2**16)),
    )


@fixture_ok
@given(cfg=sdpa_configs())
def test_sdpa_matches_torch_sdpa(backend, cfg):
    c = cfg
    B, H, Hkv, Lq, Lk = c["B"], c["H"], c["Hkv"], c["Lq"], c["Lk"]
    rng = np.random.default_rng(c["seed"])
    q = rng.standard_normal((B, H, Lq, c["Dh"]))
    k = rng.standard_normal((B, Hkv, Lk, c["Dh"]))
    v = rng.standard_normal((B, Hkv, Lk, c["Dv"]))
    kind = c["mask"]
    mask = None
    if kind != "none":
        shape = {"lq_lk": (Lq, Lk), "b1qk": (B, 1, Lq, Lk), "bhqk": (B, H, Lq, Lk),
                 "b11k": (B, 1, 1, Lk)}[kind.split("_", 1)[1]]
        if kind.startswith("bool"):
            mask = rng.random(shape) < 0.7
            mask[..., 0] = True
            if c["empty_row"]:  # torch's SDPA also gives a zero row here
                mask[..., -1, :] = False
        else:
            mask = rng.standard_normal(shape)
            mask[..., 1:][rng.random(mask[..., 1:].shape) < 0.2] = -math.inf
    gqa = Hkv != H

    tq, tk, tv = t64(q), t64(k), t64(v)
    t_mask = None if mask is None else torch.tensor(mask, requires_grad=mask.dtype != bool)
    am = t_mask
    if c["causal"] and am is not None:  # torch refuses attn_mask with is_causal: spell it out
        cm = ~causal_ignore(Lq, Lk)
        am = am & cm if am.dtype == torch.bool else am.masked_fill(~cm, -math.inf)
    t_out = TF.scaled_dot_product_attention(
        tq, tk, tv, attn_mask=am, is_causal=c["causal"] and am is None, scale=c["scale"],
        enable_gqa=gqa,
    )
    dout = rng.standard_normal(tuple(t_out.shape))
    t_out.backward(torch.tensor(dout))

    out, cache = F.sdpa_forward(
        on(backend, q), on(backend, k), on(backend, v), mask=on(backend, mask),
        is_causal=c["causal"], scale=c["scale"], enable_gqa=gqa,
    )
    assert_close(out, t_out, "out")
    dq, dk, dv, dmask, _ = F.sdpa_backward(on(backend, dout), cache)
    floor = grad_floor(tq.grad, tk.grad, tv.grad)
    assert_close(dq, tq.grad, "dq", floor)
    assert_close(dk, tk.grad, "dk", floor)
    assert_close(dv, tv.grad, "dv", floor)
    if t_mask is not None and t_mask.requires_grad:
        assert_close(dmask, t_mask.grad, "dmask", floor)
    else:
        assert dmask is None


@fixture_ok
@given(
    p=st.sampled_from([0.1, 0.5]),
    causal=st.booleans(),
    float_mask=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_sdpa_dropout_matches_torch_with_same_keep_mask(backend, p, causal, float_mask, seed):
    """p > 0: npattn with a keep-mask against torch's softmax * keep / (1 - p), by hand."""
    rng = np.random.default_rng(seed)
    B, H, Lq, Lk, Dh = 2, 3, 3, 4, 2
    q, k, v = (rng.standard_normal((B, H, L, Dh)) for L in (Lq, Lk, Lk))
    mask = rng.standard_normal((Lq, Lk)) if float_mask else None
    keep = rng.random((B, H, Lq, Lk)) >= p
    scale = 0.7

    tq, tk, tv = t64(q), t64(k), t64(v)
    t_mask = None if mask is None else t64(mask)
    s = tq @ tk.transpose(-1, -2) * scale
    if t_mask is not None:
        s = s + t_mask
    if causal:
        s = s.masked_fill(causal_ignore(Lq, Lk), -math.inf)
    probs = torch.softmax(s, dim=-1)
    t_out = (probs * torch.tensor(keep) / (1.0 - p)) @ tv
    dout = rng.standard_normal(tuple(t_out.shape))
    t_out.backward(torch.tensor(dout))

    out, cache = F.sdpa_forward(
        on(backend, q), on(backend, k), on(backend, v), mask=on(backend, mask), is_causal=causal,
        scale=scale, dropout_p=p, dropout_mask=on(backend, keep),
    )
    assert_close(out, t_out, "out")
    assert_close(cache.probs, probs, "probs (returned weights, before dropout)")
    dq, dk, dv, dmask, _ = F.sdpa_backward(on(backend, dout), cache)
    floor = grad_floor(tq.grad, tk.grad, tv.grad)
    assert_close(dq, tq.grad, "dq", floor)
    assert_close(dk, tk.grad, "dk", floor)
    assert_close(dv, tv.grad, "dv", floor)
    if t_mask is not None:
        assert_close(dmask, t_mask.grad, "dmask", floor)
