"""npattn.transformer: the encoder and decoder blocks against torch and finite differences.

Torch parity (float64, 1e-10): outputs, input gradients and every parameter
gradient by torch autograd, for post-norm and pre-norm, ReLU and GELU, a
padding mask and causal attention. With dropout p > 0 torch's layer runs with
its own dropout modules replaced by ones that apply npattn's keep-masks, and
its self-attention by a re-statement in torch ops (projections, softmax,
keep-mask / (1 - p), output projection) whose autograd differentiates it:
torch's ``MultiheadAttention`` cannot replay a given keep-mask on the
probabilities. Finite differences (float64, random dout, every parameter,
masks, fixed keep-masks at p = 0.3) run on every backend.
"""

import functools
import math
import re

import numpy as np
import pytest

from reliability_helpers import raises

from npattn.gradcheck import check_vjp
from npattn.transformer import (
    DECODER_DROPOUT_SITES,
    ENCODER_DROPOUT_SITES,
    TransformerBlock,
    TransformerDecoderBlock,
    sublayer_backward,
    sublayer_forward,
)
from npattn import layers as Ly

B, L, LM, D, H, FF = 2, 5, 4, 8, 2, 12


def assert_ok(report):
    assert report.ok, str(report)


def torch_named(grads, attns):
    """npattn block gradients under the torch layer's parameter names (in_proj packed)."""
    out = {}
    for a in attns:
        g = {k.split(".", 1)[1]: np.asarray(v) for k, v in grads.items() if k.startswith(a + ".")}
        out[f"{a}.in_proj_weight"] = np.concatenate([g["w_q"], g["w_k"], g["w_v"]])
        out[f"{a}.out_proj.weight"] = g["w_o"]
        if "b_q" in g:
            out[f"{a}.in_proj_bias"] = np.concatenate([g["b_q"], g["b_k"], g["b_v"]])
            out[f"{a}.out_proj.bias"] = g["b_o"]
    for k, v in grads.items():
        if not k.startswith(tuple(a + "." for a in attns)):
            out[k] = np.asarray(v)
    return out


def assert_torch_grads(layer, block, attns, tol=1e-10):
    ours = torch_named({k: np.asarray(v) for k, v in block.grads.items()}, attns)
    theirs = {k: p.grad.numpy() for k, p in layer.named_parameters()}
    assert set(ours) == set(theirs)
    for k, g in theirs.items():
        np.testing.assert_allclose(ours[k], g, rtol=0, atol=tol, err_msg=k)


def masks_for(kind, rng):
    """(npattn mask, torch key-padding mask, torch attn_mask, is_causal) for self-attention."""
    import torch

    if kind == "padding":
        pad = np.zeros((B, L), dtype=bool)
        pad[1, 3:] = True
        return ~pad[:, None, None, :], torch.from_numpy(pad), None, False
    causal = np.triu(np.ones((L, L), dtype=bool), 1)  # torch: True = may not attend
    return None, None, torch.from_numpy(causal), True


# ------------------------------------------------------------- torch parity, p = 0


@pytest.mark.parametrize("norm_first", [False, True])
@pytest.mark.parametrize("activation", ["relu", "gelu", "gelu_tanh", "gelu_tanh_partial"])
@pytest.mark.parametrize("kind", ["padding", "causal"])
def test_encoder_matches_torch(norm_first, activation, kind):
    torch = pytest.importorskip("torch")
    torch.manual_seed(0)
    act = {"gelu_tanh": torch.nn.GELU(approximate="tanh"),  # the function is what GPT.to_torch builds
           "gelu_tanh_partial": functools.partial(torch.nn.functional.gelu, approximate="tanh")
           }.get(activation, activation)
    layer = torch.nn.TransformerEncoderLayer(D, H, FF, dropout=0.0, activation=act,
                                             norm_first=norm_first, batch_first=True,
                                             dtype=torch.float64)
    with torch.no_grad():  # non-trivial norms
        for n in (layer.norm1, layer.norm2):
            n.weight.add_(0.3 * torch.randn(D, dtype=torch.float64))
            n.bias.add_(0.3 * torch.randn(D, dtype=torch.float64))
    block = TransformerBlock.from_torch(layer)
    assert block.activation == activation.replace("_partial", "")
    rng = np.random.default_rng(1)
    mask, kpm, attn_mask, causal = masks_for(kind, rng)
    x = torch.randn(B, L, D, dtype=torch.float64, requires_grad=True)
    y = layer(x, src_mask=attn_mask, src_key_padding_mask=kpm, is_causal=causal)
    dout = torch.randn_like(y)
    y.backward(dout)
    out = block.forward(x.detach().numpy(), mask=mask, is_causal=causal)
    dx = block.backward(dout.numpy())
    np.testing.assert_allclose(out, y.detach().numpy(), rtol=0, atol=1e-10)
    np.testing.assert_allclose(dx, x.grad.numpy(), rtol=0, atol=1e-10)
    assert_torch_grads(layer, block, ("self_attn",))


@pytest.mark.parametrize("norm_first", [False, True])
@pytest.mark.parametrize("activation", ["relu", "gelu"])
def test_decoder_matches_torch(norm_first, activation):
    torch = pytest.importorskip("torch")
    torch.manual_seed(2)
    layer = torch.nn.TransformerDecoderLayer(D, H, FF, dropout=0.0, activation=activation,
                                             norm_first=norm_first, batch_first=True,
                                             dtype=torch.float64)
    block = TransformerDecoderBlock.from_torch(layer)
    x = torch.randn(B, L, D, dtype=torch.float64, requires_grad=True)
    memory = torch.randn(B, LM, D, dtype=torch.float64, requires_grad=True)
    mpad = np.zeros((B, LM), dtype=bool)
    mpad[0, 2:] = True  # memory padding
    causal = torch.from_numpy(np.triu(np.ones((L, L), dtype=bool), 1))
    y = layer(x, memory, tgt_mask=causal, memory_key_padding_mask=torch.from_numpy(mpad),
              tgt_is_causal=True)
    dout = torch.randn_like(y)
    y.backward(dout)
    out = block.forward(x.detach().numpy(), memory.detach().numpy(), is_causal=True,
                        memory_mask=~mpad[:, None, None, :])
    dx, dmemory = block.backward(dout.numpy())
    np.testing.assert_allclose(out, y.detach().numpy(), rtol=0, atol=1e-10)
    np.testing.assert_allclose(dx, x.grad.numpy(), rtol=0, atol=1e-10)
    np.testing.assert_allclose(dmemory, memory.grad.numpy(), rtol=0, atol=1e-10)
    assert_torch_grads(layer, block, ("self_attn", "multihead_attn"))



@pytest.mark.parametrize("norm_first", [False, True])
@pytest.mark.parametrize("mask_kind", ["float", "bool"])
def test_blocks_match_torch_without_bias_with_eps_and_2d_masks(norm_first, mask_kind):
    """The torch options the tests above leave at their defaults: bias=False, layer_norm_eps,
    a 2-D attn_mask (float added; bool inverted: torch's True = may not attend), one head in the
    decoder's layers, Lm != L; outputs, input gradients and every parameter gradient."""
    torch = pytest.importorskip("torch")
    torch.manual_seed(5)
    rng = np.random.default_rng(5)

    def attn_mask(Lq, Lk):  # (npattn mask, torch attn_mask)
        if mask_kind == "float":
            f = rng.standard_normal((Lq, Lk))
            return f, torch.from_numpy(f)
        allow = rng.random((Lq, Lk)) < 0.6
        allow[:, 0] = True  # no row with nothing to attend (the test below has them)
        return allow, torch.from_numpy(~allow)

    kw = dict(dropout=0.0, norm_first=norm_first, bias=False, layer_norm_eps=1e-3, batch_first=True,
              dtype=torch.float64)
    enc = torch.nn.TransformerEncoderLayer(D, H, FF, activation="gelu", **kw)
    block = TransformerBlock.from_torch(enc)
    assert (block.bias, block.layer_norm_eps) == (False, 1e-3)
    mask, tmask = attn_mask(L, L)
    x = torch.randn(B, L, D, dtype=torch.float64, requires_grad=True)
    y = enc(x, src_mask=tmask)
    dout = torch.randn_like(y)
    y.backward(dout)
    np.testing.assert_allclose(block.forward(x.detach().numpy(), mask=mask), y.detach().numpy(),
                               rtol=0, atol=1e-10)
    np.testing.assert_allclose(block.backward(dout.numpy()), x.grad.numpy(), rtol=0, atol=1e-10)
    assert_torch_grads(enc, block, ("self_attn",))

    dec = torch.nn.TransformerDecoderLayer(D, 1, FF, **kw)
    block = TransformerDecoderBlock.from_torch(dec)
    (mask, tmask), (mmask, tmmask) = attn_mask(L, L), attn_mask(L, LM)
    x = torch.randn(B, L, D, dtype=torch.float64, requires_grad=True)
    memory = torch.randn(B, LM, D, dtype=torch.float64, requires_grad=True)
    y = dec(x, memory, tgt_mask=tmask, memory_mask=tmmask)
    dout = torch.randn_like(y)
    y.backward(dout)
    out = block.forward(x.detach().numpy(), memory.detach().numpy(), mask=mask, memory_mask=mmask)
    dx, dmemory = block.backward(dout.numpy())
    np.testing.assert_allclose(out, y.detach().numpy(), rtol=0, atol=1e-10)
    np.testing.assert_allclose(dx, x.grad.numpy(), rtol=0, atol=1e-10)
    np.testing.assert_allclose(dmemory, memory.grad.numpy(), rtol=0, atol=1e-10)
    assert_torch_grads(dec, block, ("self_attn", "multihead_attn"))


@pytest.mark.parametrize("norm_first", [False, True])
def test_rows_with_nothing_to_attend_match_torchs_autograd_path(norm_first):
    """Query rows with nothing to attend: in the encoder, an entry whose keys are all padded
    and a 2-D mask with a fully masked row; in the decoder, an entry whose memory is all
    padded (Lm != L) and a target row masked entirely. torch's autograd path gives them
    zeros from attention (torch 2.13; a torch that gives NaN there is skipped), as npattn's
    convention does: outputs, input gradients and every parameter gradient agree, all
    finite."""
    torch = pytest.importorskip("torch")
    torch.manual_seed(7)
    rng = np.random.default_rng(7)
    kw = dict(dropout=0.0, norm_first=norm_first, batch_first=True, dtype=torch.float64)
    pad = np.zeros((B, L), dtype=bool)
    pad[1] = True  # entry 1: every key padded
    allow = rng.random((L, L)) < 0.6
    allow[:, 0] = True
    allow[2] = False  # row 2: nothing to attend
    enc = torch.nn.TransformerEncoderLayer(D, H, FF, **kw)
    block = TransformerBlock.from_torch(enc)
    x = torch.randn(B, L, D, dtype=torch.float64, requires_grad=True)
    y = enc(x, src_mask=torch.from_numpy(~allow), src_key_padding_mask=torch.from_numpy(pad))
    if not torch.isfinite(y).all():
        pytest.skip(f"torch {torch.__version__} gives NaN for a row with nothing to attend")
    dout = torch.randn_like(y)
    y.backward(dout)
    out = block.forward(x.detach().numpy(), mask=allow & ~pad[:, None, None, :])
    dx = block.backward(dout.numpy())
    assert np.isfinite(out).all() and np.isfinite(dx).all()
    np.testing.assert_allclose(out, y.detach().numpy(), rtol=0, atol=1e-10)
    np.testing.assert_allclose(dx, x.grad.numpy(), rtol=0, atol=1e-10)
    assert_torch_grads(enc, block, ("self_attn",))

    dec = torch.nn.TransformerDecoderLayer(D, H, FF, **kw)
    block = TransformerDecoderBlock.from_torch(dec)
    mpad = np.zeros((B, LM), dtype=bool)
    mpad[0] = True  # entry 0: all of its memory padded
    mpad[1, 2:] = True
    tallow = np.tril(np.ones((L, L), dtype=bool))
    tallow[3] = False  # target row 3: nothing to attend
    x = torch.randn(B, L, D, dtype=torch.float64, requires_grad=True)
    memory = torch.randn(B, LM, D, dtype=torch.float64, requires_grad=True)
    y = dec(x, memory, tgt_mask=torch.from_numpy(~tallow), memory_key_padding_mask=torch.from_numpy(mpad))
    dout = torch.randn_like(y)
    y.backward(dout)
    out = block.forward(x.detach().numpy(), memory.detach().numpy(), mask=tallow,
                        memory_mask=~mpad[:, None, None, :])
    dx, dmemory = block.backward(dout.numpy())
    assert np.isfinite(out).all() and np.isfinite(dx).all() and np.isfinite(dmemory).all()
    np.testing.assert_allclose(out, y.detach().numpy(), rtol=0, atol=1e-10)
    np.testing.assert_allclose(dx, x.grad.numpy(), rtol=0, atol=1e-10)
    np.testing.assert_allclose(dmemory, memory.grad.numpy(), rtol=0, atol=1e-10)
    assert_torch_grads(dec, block, ("self_attn", "multihead_attn"))


# ------------------------------------------------ torch parity with dropout p > 0


def _replay_modules(torch):
    class Replay(torch.nn.Module):
        """nn.Dropout with a fixed keep-mask: where(keep, x / (1 - p), 0)."""

        def __init__(self, keep, p):
            super().__init__()
            self.keep, self.p = torch.from_numpy(keep), p

        def forward(self, x):
            return torch.where(self.keep, x / (1.0 - self.p), torch.zeros_like(x))

    class ReplayAttention(torch.nn.Module):
        """torch MHA's math in torch ops, its weights, a fixed keep-mask on the probabilities."""

        def __init__(self, mha, keep, p, mask):
            super().__init__()
            self.mha, self.p = mha, p
            self.keep = torch.from_numpy(keep)
            self.mask = None if mask is None else torch.from_numpy(mask)  # npattn: True = may attend
            self.batch_first = True

        def forward(self, q, k, v, **_ignored):  # the layer's masks: self.mask replaces them
            m = self.mha
            E, Hh = m.embed_dim, m.num_heads
            wq, wk, wv = m.in_proj_weight.split(E)
            bq, bk, bv = m.in_proj_bias.split(E)

            def heads(t):
                return t.reshape(t.shape[0], t.shape[1], Hh, E // Hh).transpose(1, 2)

            qh, kh, vh = heads(q @ wq.T + bq), heads(k @ wk.T + bk), heads(v @ wv.T + bv)
            s = qh @ kh.transpose(-1, -2) / (E // Hh) ** 0.5
            if self.mask is not None:
                s = s.masked_fill(~self.mask, float("-inf"))
            pr = torch.softmax(s, dim=-1)
            pr = torch.where(self.keep, pr / (1.0 - self.p), torch.zeros_like(pr))
            o = (pr @ vh).transpose(1, 2).reshape(q.shape[0], q.shape[1], E)
            return m.out_proj(o), None

    return Replay, ReplayAttention


@pytest.mark.parametrize("norm_first", [False, True])
def test_encoder_dropout_matches_torch_with_replayed_masks(norm_first):
    torch = pytest.importorskip("torch")
    Replay, ReplayAttention = _replay_modules(torch)
    p = 0.3
    torch.manual_seed(3)
    layer = torch.nn.TransformerEncoderLayer(D, H, FF, dropout=p, activation="gelu",
                                             norm_first=norm_first, batch_first=True,
                                             dtype=torch.float64)
    block = TransformerBlock.from_torch(layer)
    rng = np.random.default_rng(4)
    keeps = {"self_attn": rng.random((B, H, L, L)) > p, "dropout1": rng.random((B, L, D)) > p,
             "dropout": rng.random((B, L, FF)) > p, "dropout2": rng.random((B, L, D)) > p}
    mask = np.tril(np.ones((L, L), dtype=bool))  # causal, as a bool mask
    layer.self_attn = ReplayAttention(layer.self_attn, keeps["self_attn"], p, mask)
    layer.dropout1, layer.dropout = Replay(keeps["dropout1"], p), Replay(keeps["dropout"], p)
    layer.dropout2 = Replay(keeps["dropout2"], p)
    x = torch.randn(B, L, D, dtype=torch.float64, requires_grad=True)
    y = layer(x)
    dout = torch.randn_like(y)
    y.backward(dout)
    out = block.forward(x.detach().numpy(), mask=mask, dropout_masks=keeps)
    dx = block.backward(dout.numpy())
    np.testing.assert_allclose(out, y.detach().numpy(), rtol=0, atol=1e-10)
    np.testing.assert_allclose(dx, x.grad.numpy(), rtol=0, atol=1e-10)
    layer.self_attn = layer.self_attn.mha  # the original names for the gradient comparison
    assert_torch_grads(layer, block, ("self_attn",))


def test_decoder_dropout_matches_torch_with_replayed_masks():
    torch = pytest.importorskip("torch")
    Replay, ReplayAttention = _replay_modules(torch)
    p = 0.25
    torch.manual_seed(5)
    layer = torch.nn.TransformerDecoderLayer(D, H, FF, dropout=p, batch_first=True, dtype=torch.float64)
    block = TransformerDecoderBlock.from_torch(layer)
    rng = np.random.default_rng(6)
    keeps = {"self_attn": rng.random((B, H, L, L)) > p, "multihead_attn": rng.random((B, H, L, LM)) > p,
             "dropout1": rng.random((B, L, D)) > p, "dropout2": rng.random((B, L, D)) > p,
             "dropout3": rng.random((B, L, D)) > p, "dropout": rng.random((B, L, FF)) > p}
    mem_mask = np.ones((B, 1, 1, LM), dtype=bool)
    mem_mask[1, ..., 3:] = False
    layer.self_attn = ReplayAttention(layer.self_attn, keeps["self_attn"], p, None)
    layer.multihead_attn = ReplayAttention(layer.multihead_attn, keeps["multihead_attn"], p, mem_mask)
    for site in ("dropout1", "dropout2", "dropout3", "dropout"):
        setattr(layer, site, Replay(keeps[site], p))
    x = torch.randn(B, L, D, dtype=torch.float64, requires_grad=True)
    memory = torch.randn(B, LM, D, dtype=torch.float64, requires_grad=True)
    y = layer(x, memory)
    dout = torch.randn_like(y)
    y.backward(dout)
    out = block.forward(x.detach().numpy(), memory.detach().numpy(), memory_mask=mem_mask,
                        dropout_masks=keeps)
    dx, dmemory = block.backward(dout.numpy())
    np.testing.assert_allclose(out, y.detach().numpy(), rtol=0, atol=1e-10)
    np.testing.assert_allclose(dx, x.grad.numpy(), rtol=0, atol=1e-10)
    np.testing.assert_allclose(dmemory, memory.grad.numpy(), rtol=0, atol=1e-10)
    layer.self_attn, layer.multihead_attn = layer.self_attn.mha, layer.multihead_attn.mha
    assert_torch_grads(layer, block, ("self_attn", "multihead_attn"))


# ------------------------------------------------------- finite differences


def _fd_check(block, f_out, backward, inputs_np, to_xp, names, seed):
    """check_vjp over the block's inputs and every parameter, with a random dout."""
    pnames = list(block.params)
    inputs = [to_xp(a) for a in inputs_np] + [block.params[k] for k in pnames]
    n_in = len(inputs_np)

    def f(*a):
        block.params = dict(zip(pnames, a[n_in:]))
        return f_out(*a[:n_in])

    out = f(*inputs)
    dout = to_xp(np.random.default_rng(seed).standard_normal(tuple(out.shape)))
    dinputs = backward(dout)
    dinputs = dinputs if isinstance(dinputs, tuple) else (dinputs,)
    grads = list(dinputs) + [block.grads[k] for k in pnames]
    report = check_vjp(f, inputs, grads, dout, names=list(names) + pnames, n_directions=2, seed=seed)
    assert_ok(report)
    for g in grads:  # a backward that returns zeros fails here too
        assert float(np.max(np.abs(np.asarray(_host(g))))) > 0.0


def _host(a):
    from npattn.backend import to_numpy

    return to_numpy(a)


def _set_impl(block, impl):
    """Every attention module of ``block`` on ``impl``; the blocked one with blocks smaller than
    the lengths, so that its online softmax merges several key blocks."""
    attns = ("self_attn", "multihead_attn") if isinstance(block, TransformerDecoderBlock) else ("self_attn",)
    for name in attns:
        attn = getattr(block, name)
        attn.impl = impl
        if impl == "blocked":
            attn.block_q, attn.block_k = 2, 3


# each norm placement once, and each on one attention implementation (the blocks' own steps
# do not depend on it): post-norm on the default, pre-norm on the blocked one
NORM_IMPL = [(False, "auto"), (True, "blocked")]


@pytest.mark.parametrize("norm_first, impl", NORM_IMPL)
def test_encoder_finite_differences_with_dropout(xp, to_xp, backend, norm_first, impl):
    p = 0.3
    block = TransformerBlock(D, H, FF, dropout=p, activation="gelu" if norm_first else "relu",
                             norm_first=norm_first, dtype="float64", backend=backend, seed=7)
    _set_impl(block, impl)
    rng = np.random.default_rng(8)
    block.params = {k: v + to_xp(0.2 * rng.standard_normal(tuple(v.shape))) for k, v in block.params.items()}
    keeps = {"self_attn": rng.random((B, H, L, L)) > p, "dropout1": rng.random((B, L, D)) > p,
             "dropout": rng.random((B, L, FF)) > p, "dropout2": rng.random((B, L, D)) > p}
    keeps = {k: to_xp(v) for k, v in keeps.items()}
    mask = rng.standard_normal((B, 1, L, L))  # a float additive mask, with causal on top
    mask[1, 0, 2, :] = -np.inf  # query 2 of entry 1 attends nothing: zero row, zero gradients
    mask = to_xp(mask)
    x = rng.standard_normal((B, L, D))
    _fd_check(block, lambda x: block.forward(x, mask=mask, is_causal=True, dropout_masks=keeps),
              block.backward, [x], to_xp, ["x"], seed=9)


@pytest.mark.parametrize("norm_first, impl", NORM_IMPL)
def test_decoder_finite_differences_with_dropout(xp, to_xp, backend, norm_first, impl):
    p = 0.3
    block = TransformerDecoderBlock(D, H, FF, dropout=p, activation="relu" if norm_first else "gelu",
                                    norm_first=norm_first, dtype="float64", backend=backend, seed=10)
    _set_impl(block, impl)
    rng = np.random.default_rng(11)
    block.params = {k: v + to_xp(0.2 * rng.standard_normal(tuple(v.shape))) for k, v in block.params.items()}
    shapes = {"self_attn": (B, H, L, L), "multihead_attn": (B, H, L, LM), "dropout1": (B, L, D),
              "dropout2": (B, L, D), "dropout3": (B, L, D), "dropout": (B, L, FF)}
    keeps = {k: to_xp(rng.random(s) > p) for k, s in shapes.items()}
    mem_mask = np.ones((B, 1, 1, LM), dtype=bool)
    mem_mask[0, ..., 1:] = False  # entry 0 sees one memory position
    mem_mask = to_xp(mem_mask)
    self_mask = rng.random((B, 1, L, L)) > 0.3  # with causal on top
    self_mask[0, 0, 3, :] = False  # query 3 of entry 0 attends nothing: zero row, zero gradients
    self_mask = to_xp(self_mask)
    x, memory = rng.standard_normal((B, L, D)), rng.standard_normal((B, LM, D))
    _fd_check(block, lambda x, m: block.forward(x, m, mask=self_mask, memory_mask=mem_mask, is_causal=True,
                                                dropout_masks=keeps),
              block.backward, [x, memory], to_xp, ["x", "memory"], seed=12)


# ------------------------------------------------------------ behaviour


def test_sublayer_forward_is_the_documented_formula(xp, to_xp, to_np):
    rng = np.random.default_rng(13)
    x = to_xp(rng.standard_normal((B, L, D)))
    w, b = to_xp(rng.standard_normal(D)), to_xp(rng.standard_normal(D))

    def core(n):
        return 2.0 * n * n, None

    post, _ = sublayer_forward(x, core, norm_weight=w, norm_bias=b, eps=1e-5, norm_first=False, dropout_p=0.0)
    pre, _ = sublayer_forward(x, core, norm_weight=w, norm_bias=b, eps=1e-5, norm_first=True, dropout_p=0.0)
    ln = lambda t: Ly.layer_norm_forward(t, w, b, 1e-5)[0]  # noqa: E731
    np.testing.assert_allclose(to_np(post), to_np(ln(x + core(x)[0])), rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(to_np(pre), to_np(x + core(ln(x))[0]), rtol=1e-12, atol=1e-12)


def test_sublayer_pair_checks_its_core_and_names_its_own_arguments(xp, to_xp, to_np):
    """A core's output of another shape was broadcast into the residual, a bare array unpacked
    along axis 0, norm_first="no" taken as True and a core_backward of another shape broadcast
    into dx; a bad norm_weight, dropout_p or dropout_mask was named weight, p or mask."""
    rng = np.random.default_rng(30)
    x = to_xp(rng.standard_normal((B, L, D)))
    w = to_xp(rng.standard_normal(D))
    calls = []

    def core(n):
        calls.append(1)
        return 2.0 * n, None

    def sub(c=core, **kw):
        args = {"norm_weight": w, "norm_bias": w, "eps": 1e-5, "norm_first": False, "dropout_p": 0.0, **kw}
        return sublayer_forward(x, c, **args)

    for norm_first in (False, True):
        with raises(ValueError, "core", f"shape {(B, L, D)} (that of x)", f"got {(B, 1, D)}"):
            sub(lambda n: (n[:, :1, :], None), norm_first=norm_first)
        with raises(TypeError, "core", "pair (out, cache)", f"of shape {(B, L, D)}"):
            sub(lambda n: 2.0 * n, norm_first=norm_first)
        with raises(TypeError, "core", "pair (out, cache)", "a tuple of 3 items"):
            sub(lambda n: (n, None, None), norm_first=norm_first)
        with raises(TypeError, "core", "dtype float64 (that of x)", "float32"):
            sub(lambda n: (xp.astype(n, xp.float32), None), norm_first=norm_first)
        with raises(TypeError, "core", "array", "float"):
            sub(lambda n: (1.0, None), norm_first=norm_first)
    calls.clear()
    bad = [({"norm_first": "no"}, TypeError, "norm_first", "bool", "str 'no'"),
           ({"norm_weight": to_xp(np.ones(D + 1))}, ValueError, "norm_weight", f"({D},)", f"({D + 1},)"),
           ({"norm_bias": xp.astype(w, xp.float32)}, TypeError, "norm_bias", "float64", "float32"),
           ({"dropout_p": 1.5}, ValueError, "dropout_p", "[0, 1)", "1.5"),
           ({"dropout_p": 0.5, "dropout_mask": to_xp(np.ones((L + 1, D), bool))}, ValueError,
            "dropout_mask", f"{(B, L, D)}", f"{(L + 1, D)}"),
           ({"dropout_p": 0.5, "dropout_mask": to_xp(np.ones((B, L, D)))}, TypeError,
            "dropout_mask", "bool", "float64"),
           ({"dropout_p": 0.5, "rng": "seed"}, TypeError, "rng", "Generator", "str")]
    for kw, exc, *fragments in bad:
        for norm_first in (False, True):
            with raises(exc, *fragments) as info:
                sub(**{"norm_first": norm_first, **kw})
            for internal in ("weight", "bias", "p", "mask"):
                assert not str(info.value).startswith(internal + ":"), str(info.value)
    with raises(TypeError, "core", "callable", "str"):
        sub("core")
    assert not calls  # every argument was checked before the core ran
    # core_backward's gradient is x's shape and dtype, as the core's output
    d = to_xp(rng.standard_normal((B, L, D)))
    for norm_first in (False, True):
        _, cache = sub(norm_first=norm_first)
        with raises(ValueError, "core_backward", f"shape {(B, L, D)} (that of x)", f"got {(B, 1, D)}"):
            sublayer_backward(d, cache, lambda dc, c: dc[:, :1, :])
        with raises(TypeError, "core_backward", "dtype float64 (that of x)", "float32"):
            sublayer_backward(d, cache, lambda dc, c: xp.astype(dc, xp.float32))
        dx, _, _ = sublayer_backward(d, cache, lambda dc, c: 2.0 * dc)  # a good core still works
        assert tuple(dx.shape) == (B, L, D)


def test_dropout_from_the_seed_is_replayable_and_off_in_eval(xp, to_xp, to_np, backend):
    x = to_xp(np.random.default_rng(14).standard_normal((B, L, D)))
    a = TransformerBlock(D, H, FF, dropout=0.4, dtype="float64", backend=backend, seed=15)
    b = TransformerBlock(D, H, FF, dropout=0.4, dtype="float64", backend=backend, seed=15)
    ya, yb = to_np(a(x)), to_np(b(x))
    np.testing.assert_array_equal(ya, yb)
    assert not np.allclose(ya, to_np(a(x)))  # the generator moved on
    e1, e2 = to_np(a.eval()(x)), to_np(a(x))
    np.testing.assert_array_equal(e1, e2)
    assert not np.allclose(e1, ya)
    # the masks drawn are kept for backward: its gradient is that of the forward with those
    # masks (the same draws, replayed from the generator's state), and a second backward
    # gives the same gradients
    a.train()
    state = a.rng_state
    a(x)
    d = to_xp(np.random.default_rng(16).standard_normal((B, L, D)))
    g1 = a.backward(d)
    np.testing.assert_array_equal(to_np(g1), to_np(a.backward(d)))

    def replayed(x):
        a.rng_state = state  # every site draws what the forward above drew
        return a(x)

    assert_ok(check_vjp(replayed, [x], [g1], d, names=["x"], seed=17))


@pytest.mark.parametrize("kind", [TransformerBlock, TransformerDecoderBlock])
def test_keep_masks_do_nothing_without_dropout(kind):
    """dropout_masks act only in training mode with dropout > 0: with dropout 0 in training
    mode, or in eval mode, keep-masks that drop everything change nothing."""
    rng = np.random.default_rng(40)
    x, memory = rng.standard_normal((B, L, D)), rng.standard_normal((B, LM, D))
    args = (x,) if kind is TransformerBlock else (x, memory)
    sites = ENCODER_DROPOUT_SITES if kind is TransformerBlock else DECODER_DROPOUT_SITES
    shapes = {"self_attn": (B, H, L, L), "multihead_attn": (B, H, L, LM), "dropout": (B, L, FF)}
    drop_all = {s: np.zeros(shapes.get(s, (B, L, D)), dtype=bool) for s in sites}
    for dropout, training in ((0.0, True), (0.3, False)):
        block = kind(D, H, FF, dropout=dropout, dtype="float64", seed=41).train(training)
        want = block(*args)
        assert np.all(np.isfinite(want)) and np.any(want != 0.0)
        np.testing.assert_array_equal(block(*args, dropout_masks=drop_all), want)


def test_params_names_mirror_torch_and_state_dict_round_trips():
    torch = pytest.importorskip("torch")
    dec = TransformerDecoderBlock(D, H, FF, dtype="float64", seed=16)
    layer = torch.nn.TransformerDecoderLayer(D, H, FF, batch_first=True, dtype=torch.float64)
    sd = dec.torch_state_dict()
    assert list(sd) == list(layer.state_dict())
    layer.load_state_dict(sd)
    again = TransformerDecoderBlock.from_torch(layer)
    for k, v in dec.params.items():
        np.testing.assert_array_equal(np.asarray(v), np.asarray(again.params[k]))
    enc = TransformerBlock(D, H, bias=False, seed=17)
    assert enc.d_ff == 4 * D
    assert list(enc.params) == ["self_attn.w_q", "self_attn.w_k", "self_attn.w_v", "self_attn.w_o",
                                "linear1.weight", "linear2.weight", "norm1.weight", "norm2.weight"]
    assert list(dec.params) == [f"{a}.{k}" for a in ("self_attn", "multihead_attn")
                                for k in ("w_q", "w_k", "w_v", "w_o", "b_q", "b_k", "b_v", "b_o")] + [
        "linear1.weight", "linear1.bias", "linear2.weight", "linear2.bias",
        "norm1.weight", "norm1.bias", "norm2.weight", "norm2.bias", "norm3.weight", "norm3.bias"]
    tl = torch.nn.TransformerEncoderLayer(D, H, 4 * D, bias=False, batch_first=True)
    tl.load_state_dict(enc.torch_state_dict())
    with pytest.raises(ValueError, match=r"^layer: expected batch_first=True \(npattn takes \(B, L, D\) "
                                         r"inputs\), got batch_first=False$"):
        TransformerBlock.from_torch(torch.nn.TransformerEncoderLayer(D, H, FF))


@pytest.mark.parametrize("kind", ["encoder", "decoder"])
def test_from_torch_refuses_a_layer_whose_modules_differ(kind):
    """npattn's block has one layer_norm_eps, one dropout and one n_head: a torch layer whose
    norm2.eps, dropout2.p (or an attention's dropout, num_heads, batch_first) differ from the
    first one's was copied from norm1 / dropout alone and computed other numbers."""
    torch = pytest.importorskip("torch")
    cls, torch_cls = ((TransformerBlock, torch.nn.TransformerEncoderLayer) if kind == "encoder"
                      else (TransformerDecoderBlock, torch.nn.TransformerDecoderLayer))
    norms = "norm1, norm2" if kind == "encoder" else "norm1, norm2, norm3"

    def layer(**changes):
        t = torch_cls(D, H, FF, dropout=0.1, batch_first=True, dtype=torch.float64)
        for path, value in changes.items():
            module, attr = path.rsplit("__", 1)
            setattr(getattr(t, module), attr, value)
        return t

    last = "norm2" if kind == "encoder" else "norm3"
    with raises(ValueError, "layer", f"one eps for {norms}", "layer_norm_eps", "1e-05", "0.5"):
        cls.from_torch(layer(**{f"{last}__eps": 0.5}))
    sites = ("dropout", "dropout2", "self_attn") + (("dropout3", "multihead_attn") if kind == "decoder" else ())
    for site in sites:
        attr = "dropout" if site in ("self_attn", "multihead_attn") else "p"
        with raises(ValueError, "layer", "one drop probability for", "dropout", "0.1", "0.3"):
            cls.from_torch(layer(**{f"{site}__{attr}": 0.3}))
    if kind == "decoder":
        with raises(ValueError, "layer", "one num_heads for self_attn, multihead_attn", "n_head", "2, 4"):
            cls.from_torch(layer(multihead_attn__num_heads=4))
        with raises(ValueError, "layer", "batch_first=True", "batch_first=False in multihead_attn"):
            cls.from_torch(layer(multihead_attn__batch_first=False))
    block = cls.from_torch(layer())  # one value everywhere: copied
    assert block.dropout == 0.1 and block.layer_norm_eps == 1e-5 and block.n_head == H


@pytest.mark.parametrize("kind", ["encoder", "decoder"])
def test_from_torch_refuses_attention_options_the_block_lacks(kind):
    """A torch layer whose attention module was replaced by one with add_zero_attn=True (which
    has no parameter, so the state dict matched) was copied without it: the block's output
    differed from the layer's by 0.157 (encoder, D=4, H=2). add_bias_kv and kdim were refused
    only as a key or shape mismatch of the state dict, without naming the setting."""
    torch = pytest.importorskip("torch")
    cls, torch_cls = ((TransformerBlock, torch.nn.TransformerEncoderLayer) if kind == "encoder"
                      else (TransformerDecoderBlock, torch.nn.TransformerDecoderLayer))
    sites = ("self_attn",) if kind == "encoder" else ("self_attn", "multihead_attn")
    for site in sites:
        for option, text in ((dict(add_zero_attn=True), "add_zero_attn=True"),
                             (dict(add_bias_kv=True), "add_bias_kv=True"),
                             (dict(kdim=3), "kdim=3")):
            t = torch_cls(D, H, FF, dropout=0.0, batch_first=True, dtype=torch.float64)
            setattr(t, site, torch.nn.MultiheadAttention(D, H, batch_first=True, dtype=torch.float64,
                                                         **option))
            with raises(ValueError, "layer", site, "add_zero_attn", text, f"in {site}"):
                cls.from_torch(t)


@pytest.mark.parametrize("kind", ["encoder", "decoder"])
def test_from_torch_refuses_a_layer_whose_modules_were_replaced(kind):
    """A bias=False torch layer whose norms were replaced by nn.RMSNorm(D, eps=1e-5) (a weight
    of the same shape, so the state dict matched) was copied into a block that ran layer norm
    there: outputs 1.68 apart (encoder, D=4). An RMSNorm of eps=None raised float()'s TypeError,
    a Dropout replaced by nn.Identity an AttributeError, neither naming the layer."""
    torch = pytest.importorskip("torch")
    cls, torch_cls = ((TransformerBlock, torch.nn.TransformerEncoderLayer) if kind == "encoder"
                      else (TransformerDecoderBlock, torch.nn.TransformerDecoderLayer))
    norms = ("norm1", "norm2") if kind == "encoder" else ("norm1", "norm2", "norm3")
    for replace, name, want in (
            ({n: torch.nn.RMSNorm(D, eps=1e-5, dtype=torch.float64) for n in norms}, "norm1", "LayerNorm"),
            ({"norm2": torch.nn.RMSNorm(D, dtype=torch.float64)}, "norm2", "LayerNorm"),
            ({"dropout2": torch.nn.Identity()}, "dropout2", "Dropout"),
            ({"linear1": torch.nn.Bilinear(D, D, FF, bias=False, dtype=torch.float64)}, "linear1", "Linear"),
    ):
        t = torch_cls(D, H, FF, dropout=0.0, bias=False, batch_first=True, dtype=torch.float64)
        for n, m in replace.items():
            setattr(t, n, m)
        got = type(replace[name]).__name__
        with raises(ValueError, "layer", f"{name} a torch.nn.{want}", got):
            cls.from_torch(t)


@pytest.mark.parametrize("kind", ["encoder", "decoder"])
def test_from_torch_names_a_sub_module_built_with_other_sizes_or_biases(kind):
    """A layer with one sub-module built otherwise (linear1 without a bias among biases, a norm
    without a weight or bias, linear2 of another width) failed while its state dict was read,
    with 'state_dict: expected keys ...' or a shape, an argument the caller never passed: now
    the layer's sub-module and the setting are named, before any block is built."""
    torch = pytest.importorskip("torch")
    cls, torch_cls = ((TransformerBlock, torch.nn.TransformerEncoderLayer) if kind == "encoder"
                      else (TransformerDecoderBlock, torch.nn.TransformerDecoderLayer))
    last = "norm2" if kind == "encoder" else "norm3"
    f64 = dict(dtype=torch.float64)
    cases = [  # (the layer's bias, the sub-modules replaced, the fragments of the message)
        (True, {"linear1": torch.nn.Linear(D, FF, bias=False, **f64)},
         ("with a bias or none with one", "bias", "linear1 without a bias and self_attn.in_proj, ")),
        (False, {"linear2": torch.nn.Linear(FF, D, **f64)},
         ("with a bias or none with one", ", linear1, norm1, ", "without a bias and linear2 with one")),
        (True, {last: torch.nn.LayerNorm(D, bias=False, **f64)}, (f"got {last} without a bias and ",)),
        (True, {"norm1": torch.nn.LayerNorm(D, elementwise_affine=False, **f64)},
         ("norm1 with a weight", "elementwise_affine=True", "norm1.weight None")),
        (False, {last: torch.nn.LayerNorm(D, elementwise_affine=False, bias=False, **f64)},
         (f"{last} with a weight", "elementwise_affine=True", f"{last}.weight None")),
        (True, {"linear2": torch.nn.Linear(FF + 1, D, **f64)},
         (f"linear2 with in_features {FF} (linear1's out_features)", f"got {FF + 1}")),
        (True, {"linear2": torch.nn.Linear(FF, D + 1, **f64)},
         (f"linear2 with out_features {D} (self_attn's embed_dim)", f"got {D + 1}")),
        (True, {"linear1": torch.nn.Linear(D + 1, FF, **f64)},
         (f"linear1 with in_features {D}", f"got {D + 1}")),
        (True, {"norm2": torch.nn.LayerNorm(D + 1, **f64)}, (f"norm2 with normalized_shape ({D},)",)),
    ]
    if kind == "decoder":
        cases += [
            (True, {"multihead_attn": torch.nn.MultiheadAttention(D, H, bias=False, batch_first=True, **f64)},
             ("got multihead_attn.in_proj, multihead_attn.out_proj without a bias and self_attn.in_proj",)),
            (True, {"multihead_attn": torch.nn.MultiheadAttention(2 * D, H, batch_first=True, **f64)},
             (f"multihead_attn with embed_dim {D} (self_attn's embed_dim)", f"got {2 * D}")),
        ]
    for bias, replace, fragments in cases:
        t = torch_cls(D, H, FF, dropout=0.0, bias=bias, batch_first=True, **f64)
        for n, m in replace.items():
            setattr(t, n, m)
        with raises(ValueError, "layer: expected ", *fragments) as info:
            cls.from_torch(t)
        assert "state_dict" not in str(info.value), str(info.value)
    t = torch_cls(D, H, FF, dropout=0.0, batch_first=True, **f64)
    t.self_attn.out_proj.bias = None  # one bias removed from a module torch built
    with raises(ValueError, "layer: expected ",
                "got self_attn.out_proj without a bias and self_attn.in_proj"):
        cls.from_torch(t)
    for bias in (True, False):  # a layer as torch builds it: copied
        assert cls.from_torch(torch_cls(D, H, FF, bias=bias, batch_first=True, **f64)).bias is bias


@pytest.mark.parametrize("kind", ["encoder", "decoder"])
def test_from_torch_refuses_a_layer_or_sub_module_that_computes_otherwise(kind):
    """A subclass of the torch layer with its own _ff_block, or a sub-module of the right kind with
    its own forward (an nn.Linear subclass adding a low-rank term, a LayerNorm or Dropout that
    scales, a MultiheadAttention that doubles, an nn.ReLU activation that leaks), passed every
    check and was copied as torch's computation: the block's output differed from the layer's,
    without a word. A subclass that only changes the constructor's defaults computes as torch
    does, and is copied."""
    torch = pytest.importorskip("torch")
    torch_cls = torch.nn.TransformerEncoderLayer if kind == "encoder" else torch.nn.TransformerDecoderLayer
    cls = TransformerBlock if kind == "encoder" else TransformerDecoderBlock
    f64 = dict(dtype=torch.float64)

    class OwnFF(torch_cls):
        def _ff_block(self, x):
            return 2.0 * super()._ff_block(x)

    class LowRank(torch.nn.Linear):
        def forward(self, x):
            return super().forward(x) + 0.5 * x[..., :1]

    class Scaled(torch.nn.LayerNorm):
        def forward(self, x):
            return 3.0 * super().forward(x)

    class Scaling(torch.nn.Dropout):
        def forward(self, x):
            return 1.5 * super().forward(x)

    class Leaky(torch.nn.ReLU):
        def forward(self, x):
            return torch.nn.functional.leaky_relu(x, 0.5)

    class Doubled(torch.nn.MultiheadAttention):
        def forward(self, *args, **kwargs):
            out, weights = super().forward(*args, **kwargs)
            return 2.0 * out, weights

    class Defaults(torch_cls):  # torch's computation, other defaults
        def __init__(self, d_model, nhead, **kwargs):
            super().__init__(d_model, nhead, FF, dropout=0.0, batch_first=True, **kwargs)

    def run(t):
        torch.manual_seed(1)
        x, memory = torch.randn(B, L, D, **f64), torch.randn(B, LM, D, **f64)
        return (t(x) if kind == "encoder" else t(x, memory)).detach().numpy(), x.numpy(), memory.numpy()

    torch.manual_seed(0)
    cases = [(OwnFF(D, H, FF, dropout=0.0, batch_first=True, **f64), {}, "_ff_block", "OwnFF"),
             (None, {"linear1": LowRank(D, FF, **f64)}, "linear1 with torch.nn.Linear's forward", "LowRank"),
             (None, {"norm2": Scaled(D, **f64)}, "norm2 with torch.nn.LayerNorm's forward", "Scaled"),
             (None, {"dropout2": Scaling(0.0)}, "dropout2 with torch.nn.Dropout's forward", "Scaling"),
             (None, {"self_attn": Doubled(D, H, batch_first=True, **f64)},
              "self_attn with torch.nn.MultiheadAttention's forward", "Doubled"),
             (None, {"activation": Leaky()}, "activation with torch.nn.ReLU's forward", "Leaky")]
    for t, replace, what, name in cases:
        t = t if t is not None else torch_cls(D, H, FF, dropout=0.0, batch_first=True, **f64)
        for n, m in replace.items():
            setattr(t, n, m)
        t.eval()
        plain = torch_cls(D, H, FF, dropout=0.0, batch_first=True, **f64).eval()
        plain.load_state_dict(t.state_dict())
        assert np.abs(run(t)[0] - run(plain)[0]).max() > 1e-3  # the layer does compute otherwise
        with raises(ValueError, "layer: expected ", what, "got a test_transformer.", f".{name} with its own"):
            cls.from_torch(t)

    t = Defaults(D, H, **f64).eval()
    want, x, memory = run(t)
    block = cls.from_torch(t)
    got = block(x) if kind == "encoder" else block(x, memory)
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-12)


@pytest.mark.parametrize("kind", ["encoder", "decoder"])
def test_from_torch_names_the_layers_state_dict_when_weights_are_held_otherwise(kind):
    """A layer whose linear1 has weight_norm keeps its weight under other keys: from_torch refused
    it as 'state_dict: expected keys ...', an argument its caller never passed; the message now
    names the layer's state dict."""
    torch = pytest.importorskip("torch")
    torch_cls = torch.nn.TransformerEncoderLayer if kind == "encoder" else torch.nn.TransformerDecoderLayer
    cls = TransformerBlock if kind == "encoder" else TransformerDecoderBlock
    t = torch_cls(D, H, FF, dropout=0.0, batch_first=True, dtype=torch.float64)
    torch.nn.utils.parametrizations.weight_norm(t.linear1)
    with raises(ValueError, "layer.state_dict(): expected keys", "missing ['linear1.weight']",
                "'linear1.parametrizations.weight.original0', 'linear1.parametrizations.weight.original1'"):
        cls.from_torch(t)


@pytest.mark.parametrize("kind", ["encoder", "decoder"])
def test_from_torch_refuses_a_layer_of_mixed_dtypes(kind):
    """The block took the dtype of linear1.weight and cast every other parameter to it: a float64
    layer whose linear1 was float32 became a float32 block, rounding the rest silently."""
    torch = pytest.importorskip("torch")
    cls, torch_cls = ((TransformerBlock, torch.nn.TransformerEncoderLayer) if kind == "encoder"
                      else (TransformerDecoderBlock, torch.nn.TransformerDecoderLayer))
    t = torch_cls(D, H, FF, batch_first=True, dtype=torch.float64)
    t.linear1 = torch.nn.Linear(D, FF, dtype=torch.float32)
    with raises(ValueError, "layer", "parameters of one dtype", "float64 (self_attn.in_proj_weight",
                "float32 (linear1.weight, linear1.bias)"):
        cls.from_torch(t)


@pytest.mark.parametrize("kind", ["encoder", "decoder"])
def test_from_torch_names_a_mixed_dtype_inside_an_attention_module_by_its_path(kind):
    """The blocks read their attention modules' options with options_from_torch, not
    config_from_torch, whose dtype check names the attention module alone ("module: ...
    (out_proj.weight, ...)"): a mixed dtype there is the layer's, named by its path."""
    torch = pytest.importorskip("torch")
    cls, torch_cls = ((TransformerBlock, torch.nn.TransformerEncoderLayer) if kind == "encoder"
                      else (TransformerDecoderBlock, torch.nn.TransformerDecoderLayer))
    t = torch_cls(D, H, FF, batch_first=True, dtype=torch.float64)
    t.self_attn.out_proj.float()
    with raises(ValueError, "layer: ", "parameters of one dtype", "float64 (self_attn.in_proj_weight",
                "float32 (self_attn.out_proj.weight, self_attn.out_proj.bias)"):
        cls.from_torch(t)


def test_load_torch_state_dict_names_the_key_as_given():
    """An attention entry's error named the key without its module (state_dict['in_proj_weight'],
    for self_attn's and for multihead_attn's alike)."""
    torch = pytest.importorskip("torch")
    for block, attns in ((TransformerBlock(D, H, FF, dtype="float64", seed=31), ("self_attn",)),
                         (TransformerDecoderBlock(D, H, FF, dtype="float64", seed=31),
                          ("self_attn", "multihead_attn"))):
        before = {k: np.array(v) for k, v in block.params.items()}
        sd = block.torch_state_dict()
        for a in attns:
            with raises(ValueError, f"state_dict['{a}.in_proj_weight']", f"({3 * D}, {D})", "(3, 3)"):
                block.load_torch_state_dict({**sd, f"{a}.in_proj_weight": torch.zeros(3, 3)})
            with raises(TypeError, f"state_dict['{a}.out_proj.bias']", "tensor or array", "str"):
                block.load_torch_state_dict({**sd, f"{a}.out_proj.bias": "abc"})
        for k, v in block.params.items():  # nothing was assigned
            np.testing.assert_array_equal(np.asarray(v), before[k])


@pytest.mark.parametrize("kind", ["encoder", "decoder"])
def test_load_torch_state_dict_names_the_keys_expected_received_missing_and_unexpected(kind):
    """A state dict with a key dropped and one added is refused with the torch layer's keys in
    its order, the keys received (sorted), and the ones missing and unexpected; nothing is set."""
    torch = pytest.importorskip("torch")
    cls, torch_cls = ((TransformerBlock, torch.nn.TransformerEncoderLayer) if kind == "encoder"
                      else (TransformerDecoderBlock, torch.nn.TransformerDecoderLayer))
    block = cls(D, H, FF, dtype="float64", seed=33)
    want = list(torch_cls(D, H, FF, batch_first=True, dtype=torch.float64).state_dict())
    before = {k: np.array(v) for k, v in block.params.items()}
    sd = {k: v for k, v in block.torch_state_dict().items() if k != "norm2.bias"}
    sd["norm9.bias"] = torch.zeros(D, dtype=torch.float64)
    got = sorted(sd)
    with pytest.raises(ValueError, match="^" + re.escape(
            f"state_dict: expected keys {want}, got {got} (missing ['norm2.bias'], "
            "unexpected ['norm9.bias'])") + "$"):
        block.load_torch_state_dict(sd)
    for k, v in block.params.items():
        np.testing.assert_array_equal(np.asarray(v), before[k])


def test_a_key_that_is_no_string_is_named():
    """A key such as 0 in a state dict, a params dict or dropout_masks stopped sorted() with
    "'<' not supported between instances of 'str' and 'int'"."""
    torch = pytest.importorskip("torch")
    block = TransformerDecoderBlock(D, H, FF, dtype="float64", seed=32)
    x, memory = np.ones((B, L, D)), np.ones((B, LM, D))
    with raises(ValueError, "state_dict", "unexpected [0]"):
        block.load_torch_state_dict({**block.torch_state_dict(), 0: torch.zeros(1)})
    with raises(ValueError, "params", "unexpected [0]"):
        block.params = {**block.params, 0: np.zeros(1)}
    with raises(ValueError, "dropout_masks", "keys among", "[0, 'a']"):
        block(x, memory, dropout_masks={0: None, "a": None})


def test_a_failed_call_changes_nothing(xp, to_xp, to_np, backend):
    block = TransformerBlock(D, H, FF, dropout=0.2, dtype="float64", backend=backend, seed=18)
    x = to_xp(np.random.default_rng(19).standard_normal((B, L, D)))
    block(x)
    d = to_xp(np.random.default_rng(20).standard_normal((B, L, D)))
    dx = to_np(block.backward(d))
    twin = TransformerBlock(D, H, FF, dropout=0.2, dtype="float64", backend=backend, seed=18)
    twin(x)  # the same successful history, none of the failures below
    with pytest.raises(ValueError, match=r"^dropout_masks: expected keys among \['self_attn', 'dropout1', "
                                         r"'dropout', 'dropout2'\], got \['dropout7'\]$"):
        block(x, dropout_masks={"dropout7": None})
    with pytest.raises(ValueError, match=r"^dropout_masks\['dropout1'\]: expected a shape that broadcasts to "
                                         r"\(B, L, D\) = \(2, 5, 8\) .*, got shape \(2, 5, 9\)$"):
        block(x, dropout_masks={"dropout1": to_xp(np.ones((B, L, D + 1), dtype=bool))})
    with pytest.raises(ValueError, match=r"^mask: expected a shape that broadcasts to \(B, H, Lq, Lk\) = "
                                         r"\(2, 2, 5, 5\) .*, got shape \(3, 3\)$"):
        block(x, mask=to_xp(np.ones((3, 3), dtype=bool)))
    with pytest.raises(ValueError, match=r"^dout: expected shape \(2, 5, 8\) \(that of the last forward's "
                                         r"output\), got \(2, 6, 8\)$"):
        block.backward(to_xp(np.ones((B, L + 1, D))))
    np.testing.assert_array_equal(dx, to_np(block.backward(d)))  # the cache is the last success's
    np.testing.assert_array_equal(to_np(block(x)), to_np(twin(x)))  # the generator did not move
    with pytest.raises(ValueError, match="^activation: expected 'relu', 'gelu' or 'gelu_tanh', got 'swish'$"):
        TransformerBlock(D, H, activation="swish")
    with pytest.raises(ValueError, match=r"^layer_norm_eps: expected a positive finite float, got 0\.0$"):
        TransformerBlock(D, H, layer_norm_eps=0.0)
    with pytest.raises(ValueError, match=r"^layer_norm_eps: expected a positive float within float32's range "
                                         r"\[.*\], got 1e\+39$"):
        TransformerBlock(D, H, layer_norm_eps=1e39)  # rounds to inf in the model's float32
    with pytest.raises(ValueError, match=r"^params: expected the keys \['self_attn\.w_q', .*'norm2\.bias'\], "
                                         r"got \['linear1\.weight'\] \(missing \[.*\], unexpected \[\]\)$"):
        block.params = {"linear1.weight": block.params["linear1.weight"]}


@pytest.mark.parametrize("kind", [TransformerBlock, TransformerDecoderBlock])
@pytest.mark.parametrize("eps, error, message", [
    (None, TypeError, "expected a positive float, got None"),
    ("1e-5", TypeError, "expected a positive float, got str '1e-5'"),
    (True, TypeError, "expected a positive float, got bool True"),
    (0.0, ValueError, "expected a positive finite float, got 0.0"),
    (-1, ValueError, "expected a positive finite float, got -1"),
    (math.inf, ValueError, "expected a positive finite float, got inf"),
    (math.nan, ValueError, "expected a positive finite float, got nan"),
    (2**1100, ValueError, "expected a positive finite float, got an int too large for a float (1101 bits)"),
], ids=["None", "str", "bool", "zero", "negative", "inf", "nan", "huge-int"])
def test_a_layer_norm_eps_that_is_no_positive_float_is_refused_by_name(kind, eps, error, message):
    """The blocks check layer_norm_eps as layer norm checks its eps, naming the argument: a
    str or None is a TypeError that does not offer None (it said 'expected None or a float'
    for a str, and a ValueError for None)."""
    with pytest.raises(error) as exc:
        kind(D, H, layer_norm_eps=eps)
    assert str(exc.value) == f"layer_norm_eps: {message}"


@pytest.mark.parametrize("kind", [TransformerBlock, TransformerDecoderBlock])
def test_a_failed_params_assignment_changes_nothing(kind):
    """Every array is checked before any is assigned: a dict whose attention arrays are fine
    but whose norm1.weight has the wrong shape leaves every parameter as it was, the
    attention modules' too."""
    block = kind(D, H, FF, dtype="float64", seed=30)
    before = {k: np.array(v) for k, v in block.params.items()}  # copies
    bad = {k: 2.0 * v for k, v in block.params.items()}
    bad["norm1.weight"] = np.ones(D + 1)
    with raises(ValueError, "params['norm1.weight']", f"({D},)", f"({D + 1},)"):
        block.params = bad
    for k, v in block.params.items():
        np.testing.assert_array_equal(v, before[k], err_msg=k)


def test_a_params_assignment_interrupted_between_the_attention_modules_changes_nothing(monkeypatch):
    """The decoder block assigns its self-attention's parameters, then its cross-attention's;
    should the second fail all the same (an interrupt, after every check passed), the
    self-attention's are put back: every parameter is the one before the call."""
    block = TransformerDecoderBlock(D, H, FF, dtype="float64", seed=30)
    before = {k: np.array(v) for k, v in block.params.items()}  # copies
    new = {k: 2.0 * v for k, v in block.params.items()}

    def fails(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(block.multihead_attn.params, "replace_all", fails)
    with pytest.raises(KeyboardInterrupt):
        block.params = new
    monkeypatch.undo()
    for k, v in block.params.items():
        np.testing.assert_array_equal(v, before[k], err_msg=k)
    block.params = new  # and the block takes the assignment afterwards
    for k, v in block.params.items():
        np.testing.assert_array_equal(v, 2.0 * before[k], err_msg=k)


@pytest.mark.parametrize("error", [MemoryError, KeyboardInterrupt])
@pytest.mark.parametrize("norm_first", [False, True])
def test_a_forward_that_fails_after_self_attention_changes_nothing(norm_first, error, monkeypatch):
    """Self-attention has run (its dropout drawn, its module's cache replaced), then the
    feed-forward fails (a MemoryError, or Ctrl-C: no Exception): the block alone, with no
    model around it to put it back, keeps its cache, its attention module's cache and its
    generator, so backward differentiates the last successful forward and the next forward
    draws what a block that never failed draws."""
    rng = np.random.default_rng(28)
    x, d = rng.standard_normal((B, L, D)), rng.standard_normal((B, L, D))
    block, twin = (TransformerBlock(D, H, FF, dropout=0.2, dtype="float64", seed=29,
                                    norm_first=norm_first) for _ in range(2))
    for b in (block, twin):
        b(x)
    attn_cache = block.self_attn.cache

    def fails(*args, **kwargs):
        raise error("no memory")

    monkeypatch.setattr(Ly, "feed_forward_forward", fails)
    with pytest.raises(error):
        block(2.0 * x)
    monkeypatch.undo()
    assert block.self_attn.cache is attn_cache
    np.testing.assert_array_equal(block.backward(d), twin.backward(d))
    for k in twin.grads:
        np.testing.assert_array_equal(block.grads[k], twin.grads[k], err_msg=k)
    np.testing.assert_array_equal(block(x), twin(x))  # the generators did not move


@pytest.mark.parametrize("error", [MemoryError, KeyboardInterrupt])
@pytest.mark.parametrize("norm_first", [False, True])
def test_a_backward_that_fails_midway_keeps_the_attention_modules_grads(norm_first, error, monkeypatch):
    """The cross-attention's backward runs, then the self-attention's fails (a MemoryError,
    or Ctrl-C: no Exception):
    the block's grads and both attention modules' grads, dmask and cache are those of the
    last successful backward (the block's docstring: the modules' grads are its last
    backward's), the cross-attention's cache is the one of the forward run on it alone (the
    block's backward handed it the block's forward's), and the next backward gives what a
    block that never failed gives."""
    rng = np.random.default_rng(26)
    x, memory = rng.standard_normal((B, L, D)), rng.standard_normal((B, LM, D))
    d1, d2 = rng.standard_normal((B, L, D)), rng.standard_normal((B, L, D))
    mem_mask = np.where(rng.random((B, 1, L, LM)) > 0.3, rng.standard_normal((B, 1, L, LM)), -np.inf)
    block, twin = (TransformerDecoderBlock(D, H, FF, dropout=0.2, dtype="float64", seed=27,
                                           norm_first=norm_first) for _ in range(2))
    for b in (block, twin):
        b(x, memory, memory_mask=mem_mask)
        b.backward(d1)
        b(2.0 * x, memory, memory_mask=mem_mask)
    block.multihead_attn(x, memory, memory)  # on its own: its cache is not the block's forward's
    before = {a: (m.grads, m.dmask, m.cache) for a, m in (("self", block.self_attn),
                                                          ("cross", block.multihead_attn))}
    block_grads = block.grads

    def fails(dout):
        raise error("no memory")

    monkeypatch.setattr(block.self_attn, "backward", fails)
    with pytest.raises(error):
        block.backward(d2)
    monkeypatch.undo()
    assert block.grads is block_grads
    for a, m in (("self", block.self_attn), ("cross", block.multihead_attn)):
        grads, dmask, cache = before[a]
        assert m.grads is grads and m.dmask is dmask and m.cache is cache, a
    for a, b in zip(block.backward(d2), twin.backward(d2)):
        np.testing.assert_array_equal(a, b)
    for k in twin.grads:
        np.testing.assert_array_equal(block.grads[k], twin.grads[k], err_msg=k)
    with pytest.raises(TypeError, match=r"^state: expected a BlockGradState .* got one of another block"):
        block.restore_backward_state(twin.backward_state())


def test_a_forward_state_put_back_undoes_a_forward(xp, to_xp, to_np, backend):
    """restore_forward_state puts back the cache (backward differentiates the earlier forward),
    the attention modules' caches and the generator; it takes only this block's own states."""
    block = TransformerDecoderBlock(D, H, FF, dropout=0.2, dtype="float64", backend=backend, seed=24)
    twin = TransformerDecoderBlock(D, H, FF, dropout=0.2, dtype="float64", backend=backend, seed=24)
    rng = np.random.default_rng(25)
    x, memory = to_xp(rng.standard_normal((B, L, D))), to_xp(rng.standard_normal((B, LM, D)))
    d = to_xp(rng.standard_normal((B, L, D)))
    block(x, memory)
    twin(x, memory)
    state = block.forward_state()
    block(2.0 * x, memory)  # a forward undone below
    block.restore_forward_state(state)
    assert block.self_attn.cache is state.attn_caches["self_attn"]
    assert block.multihead_attn.cache is state.attn_caches["multihead_attn"]
    for a, b in zip(block.backward(d), twin.backward(d)):
        np.testing.assert_array_equal(to_np(a), to_np(b))
    np.testing.assert_array_equal(to_np(block(x, memory)), to_np(twin(x, memory)))  # same draw
    with pytest.raises(TypeError, match=r"^state: expected a BlockState .* got one of another block"):
        block.restore_forward_state(twin.forward_state())
    with pytest.raises(TypeError, match=r"^state: expected a BlockState .* got dict"):
        block.restore_forward_state({})


@pytest.mark.parametrize("before", ["decoded", "never ran"])
def test_a_failed_forward_leaves_what_the_attention_backward_reports(monkeypatch, before):
    """A block forward that fails in its feed-forward (a MemoryError) after its self-attention
    ran puts the module back as it was, whether its last forward decoded or it never ran: its
    backward is the RuntimeError of before. Putting back through ``cache =`` could not tell
    the two apart (None either way), so one of them came back as the other."""
    block = TransformerBlock(D, H, FF, dtype="float64", seed=26).eval()
    x = np.random.default_rng(27).standard_normal((B, 3, D))
    if before == "decoded":
        block(x, is_causal=True, kv_cache=block.self_attn.new_cache(B, 8))
        match = "the last forward used kv_cache"
    else:
        match = "expected a forward call first"

    def fails(*args, **kwargs):
        raise MemoryError("no memory")

    monkeypatch.setattr(Ly, "feed_forward_forward", fails)
    for kv_cache in (None, block.self_attn.new_cache(B, 8)):  # a plain forward, a decoding one
        with pytest.raises(MemoryError):
            block(x, is_causal=True, kv_cache=kv_cache)
        with pytest.raises(RuntimeError, match=match):
            block.self_attn.backward(x)
    monkeypatch.undo()
    other = TransformerBlock(D, H, FF, dtype="float64", seed=26)
    with pytest.raises(TypeError, match=r"^state: expected an AttentionState .* got one of another module"):
        block.self_attn.restore_forward_state(other.self_attn.forward_state())
    with pytest.raises(TypeError, match=r"^state: expected an AttentionState .* got None$"):
        block.self_attn.restore_forward_state(None)


def test_dropout_sites_are_torchs_module_names():
    torch = pytest.importorskip("torch")
    enc = torch.nn.TransformerEncoderLayer(D, H, FF, batch_first=True)
    dec = torch.nn.TransformerDecoderLayer(D, H, FF, batch_first=True)
    for sites, layer in ((ENCODER_DROPOUT_SITES, enc), (DECODER_DROPOUT_SITES, dec)):
        for s in sites:
            m = getattr(layer, s)
            assert isinstance(m, (torch.nn.Dropout, torch.nn.MultiheadAttention)), s


def test_decoder_memory_fully_masked_entry_gives_zeros_not_nan(xp, to_xp, to_np, backend):
    """Entry 1 may attend no memory position: cross-attention gives zeros there, and zero dmemory."""
    block = TransformerDecoderBlock(D, H, FF, dtype="float64", backend=backend, seed=21)
    rng = np.random.default_rng(22)
    mem_mask = np.ones((B, 1, 1, LM), dtype=bool)
    mem_mask[1] = False
    mem_mask = to_xp(mem_mask)
    x, memory = rng.standard_normal((B, L, D)), rng.standard_normal((B, LM, D))

    def f(x, m):
        return block.forward(x, m, memory_mask=mem_mask, is_causal=True)

    out = f(to_xp(x), to_xp(memory))
    dout = to_xp(rng.standard_normal((B, L, D)))
    dx, dmemory = block.backward(dout)
    assert np.all(np.isfinite(to_np(out))) and np.all(np.isfinite(to_np(dx)))
    np.testing.assert_array_equal(to_np(dmemory)[1], 0.0)
    assert np.max(np.abs(to_np(dmemory)[0])) > 0.0
    assert_ok(check_vjp(f, [to_xp(x), to_xp(memory)], [dx, dmemory], dout, names=["x", "memory"],
                        n_directions=2, seed=23))


def test_block_errors_name_the_blocks_arguments():
    """A block's argument errors name x, memory and memory_mask, not the attention module's
    query, key and mask (a float32 memory was reported as 'key', a bad memory_mask as 'mask')."""
    x = np.ones((2, 3, 8))
    enc = TransformerBlock(8, 2, 16, dtype="float64", seed=0)
    with pytest.raises(TypeError, match="^x: expected dtype float64"):
        enc.forward(x.astype(np.float32))
    dec = TransformerDecoderBlock(8, 2, 16, dtype="float64", seed=0)
    memory = np.ones((2, 4, 8))
    with pytest.raises(TypeError, match="^memory: expected dtype float64"):
        dec.forward(x, memory.astype(np.float32))
    with pytest.raises(ValueError, match=r"^memory_mask: expected a shape that broadcasts to .* \(2, 2, 3, 4\)"):
        dec.forward(x, memory, memory_mask=np.ones((5, 5), bool))
    with pytest.raises(ValueError, match=r"^mask: expected a shape that broadcasts to .* \(2, 2, 3, 3\)"):
        dec.forward(x, memory, mask=np.ones((5, 5), bool))
    with pytest.raises(ValueError, match=r"^memory: expected a 3-D array"):
        dec.forward(x, memory[0])
    with pytest.raises(ValueError, match=r"^memory: expected batch size 2 \(that of x\)"):
        dec.forward(x, np.ones((3, 4, 8)))


def test_empty_inputs_are_named_as_the_blocks_arguments():
    """An empty x or memory is named so: the attention check said 'query length: expected at
    least 1, got 0' and 'key length: ...', which no wrapper could rename to x or memory."""
    x = np.ones((2, 3, 8))
    enc = TransformerBlock(8, 2, 16, dtype="float64", seed=0)
    with pytest.raises(ValueError, match=r"^x: expected a query length \(axis 1\) of at least 1, "
                                         r"got shape \(2, 0, 8\)"):
        enc.forward(x[:, :0])
    with pytest.raises(ValueError, match=r"^x: expected a batch size \(axis 0\) of at least 1, "
                                         r"got shape \(0, 3, 8\)"):
        enc.forward(x[:0])
    dec = TransformerDecoderBlock(8, 2, 16, dtype="float64", seed=0)
    with pytest.raises(ValueError, match=r"^memory: expected a key length \(axis 1\) of at least 1, "
                                         r"got shape \(2, 0, 8\)"):
        dec.forward(x, np.ones((2, 0, 8)))


@pytest.mark.parametrize("kind", [TransformerBlock, TransformerDecoderBlock])
def test_a_backward_state_put_back_restores_the_blocks_grads(kind):
    """restore_backward_state puts back the block's own grads, not only its attention
    modules': a model made of blocks relies on it for the blocks whose backward ran before
    another block's failed."""
    rng = np.random.default_rng(28)
    x, memory = rng.standard_normal((B, L, D)), rng.standard_normal((B, LM, D))
    d1, d2 = rng.standard_normal((B, L, D)), rng.standard_normal((B, L, D))
    block = kind(D, H, FF, dtype="float64", seed=29)
    args = (x,) if kind is TransformerBlock else (x, memory)
    block(*args)
    block.backward(d1)
    first = {k: v.copy() for k, v in block.grads.items()}
    state = block.backward_state()
    block.backward(d2)  # a backward undone below
    assert not np.array_equal(block.grads["linear1.weight"], first["linear1.weight"])
    block.restore_backward_state(state)
    assert block.grads is state.grads
    for k, g in first.items():
        np.testing.assert_array_equal(block.grads[k], g, err_msg=k)


@pytest.mark.parametrize("kind", [TransformerBlock, TransformerDecoderBlock])
def test_backward_names_a_dout_of_another_dtype_or_shape_and_changes_nothing(kind):
    """A float32 dout for a float64 block is a TypeError naming dout, and a dout of another
    shape a ValueError naming the output's shape, both before any gradient is formed: dout is
    never promoted nor broadcast."""
    rng = np.random.default_rng(30)
    x, memory = rng.standard_normal((B, L, D)), rng.standard_normal((B, LM, D))
    d = rng.standard_normal((B, L, D))
    block = kind(D, H, FF, dtype="float64", seed=31)
    block(*((x,) if kind is TransformerBlock else (x, memory)))
    block.backward(d)
    grads = block.grads
    assert list(grads) == list(block.params)  # the same keys, in the same order
    with raises(TypeError, "dout", "numpy array", "list"):
        block.backward(d.tolist())
    with pytest.raises(TypeError, match=r"^dout: expected dtype float64 \(that of the last "
                                        r"forward's output\), got float32"):
        block.backward(d.astype(np.float32))
    with pytest.raises(ValueError, match=r"^dout: expected shape \(2, 5, 8\) \(that of the last "
                                         r"forward's output\), got \(1, 5, 8\)"):
        block.backward(d[:1])
    assert block.grads is grads


@pytest.mark.parametrize("kind", [TransformerBlock, TransformerDecoderBlock])
def test_fresh_parameters_follow_torchs_initialisation(kind):
    """torch's defaults: a LayerNorm starts at weight 1, bias 0; an nn.Linear(fan_in, fan_out)
    draws weight and bias from U(-b, b) with b = 1/sqrt(fan_in) (kaiming_uniform_ with
    a = sqrt(5): gain sqrt(2 / (1 + 5)) times sqrt(3 / fan_in)). linear1 maps D -> F and
    linear2 F -> D, so their bounds differ; with F * D = 1024 draws each, the largest
    magnitude comes within 5% of its bound."""
    d_model, d_ff = 16, 64
    block = kind(d_model, 2, d_ff, dtype="float64", seed=32)
    p = {k: np.asarray(v) for k, v in block.params.items()}
    for n in (("norm1", "norm2") if kind is TransformerBlock else ("norm1", "norm2", "norm3")):
        np.testing.assert_array_equal(p[f"{n}.weight"], np.ones(d_model), err_msg=n)
        np.testing.assert_array_equal(p[f"{n}.bias"], np.zeros(d_model), err_msg=n)
    for name, fan_in in (("linear1", d_model), ("linear2", d_ff)):
        bound = 1.0 / np.sqrt(fan_in)
        w, b = p[f"{name}.weight"], p[f"{name}.bias"]
        assert np.abs(w).max() <= bound and np.abs(w).max() >= 0.95 * bound, name
        assert np.abs(b).max() <= bound, name
        # symmetric about 0: both signs reach past half the bound (of 16 or 64 draws)
        for a in (w, b):
            assert a.min() < -0.5 * bound and a.max() > 0.5 * bound, name


def test_sublayer_backward_names_a_cache_that_is_not_sublayer_forwards(xp, to_xp):
    """A cache of another pair (a layer norm's), a plain tuple or None is a TypeError naming
    cache, not an AttributeError from reading its fields."""
    x = to_xp(np.random.default_rng(40).standard_normal((B, L, D)))
    w = to_xp(np.ones(D))
    _, cache = sublayer_forward(x, lambda n: (2.0 * n, None), norm_weight=w, norm_bias=w, eps=1e-5,
                                norm_first=False, dropout_p=0.0)
    _, ln_cache = Ly.layer_norm_forward(x, w, w, 1e-5)
    for bad, got in ((ln_cache, "LayerNormCache"), (tuple(cache), "tuple"), (None, "None")):
        with raises(TypeError, "cache", "SublayerCache", got):
            sublayer_backward(x, bad, lambda dc, c: dc)


@pytest.mark.parametrize("kind", [TransformerBlock, TransformerDecoderBlock])
def test_train_with_a_mode_that_is_no_bool_is_a_type_error_and_changes_nothing(kind):
    """train("no") is refused before anything changes: a block that set its own flag before
    its attention modules refused the mode would be left in training mode."""
    block = kind(D, H, FF, dropout=0.2, seed=41).eval()
    attns = [block.self_attn] + ([block.multihead_attn] if kind is TransformerDecoderBlock else [])
    for mode in ("no", 1, 0.0, None):
        with raises(TypeError, "mode", "bool"):
            block.train(mode)
        assert block.training is False and not any(m.training for m in attns), mode


def test_from_torch_names_a_layer_of_the_other_kind_or_no_layer():
    """An encoder layer's modules are all in a decoder layer too: the encoder block takes only
    a TransformerEncoderLayer, the decoder block only a TransformerDecoderLayer, by type."""
    torch = pytest.importorskip("torch")
    enc = torch.nn.TransformerEncoderLayer(D, H, FF, batch_first=True, dtype=torch.float64)
    dec = torch.nn.TransformerDecoderLayer(D, H, FF, batch_first=True, dtype=torch.float64)
    cases = [(TransformerBlock, dec, "TransformerEncoderLayer", "TransformerDecoderLayer"),
             (TransformerDecoderBlock, enc, "TransformerDecoderLayer", "TransformerEncoderLayer"),
             (TransformerBlock, "layer", "TransformerEncoderLayer", "str")]
    for cls, layer, expected, got in cases:
        with pytest.raises(TypeError, match=rf"^layer: expected a torch\.nn\..*\.{expected}, got {got}$"):
            cls.from_torch(layer)


@pytest.mark.parametrize("kind", ["encoder", "decoder"])
def test_from_torch_copies_the_layers_mode(kind):
    """The block has the layer's mode: a layer in eval mode copied into a block in training
    mode would compute other outputs with dropout > 0."""
    torch = pytest.importorskip("torch")
    cls, torch_cls = ((TransformerBlock, torch.nn.TransformerEncoderLayer) if kind == "encoder"
                      else (TransformerDecoderBlock, torch.nn.TransformerDecoderLayer))
    layer = torch_cls(D, H, FF, dropout=0.3, batch_first=True, dtype=torch.float64)
    for training in (False, True, False):
        block = cls.from_torch(layer.train(training))
        assert block.training is training
        attns = [block.self_attn] + ([block.multihead_attn] if kind == "decoder" else [])
        assert all(m.training is training for m in attns)


@pytest.mark.parametrize("kind", ["encoder", "decoder"])
def test_from_torch_copies_an_attention_modules_mode_set_apart(kind):
    """torch's layer drops on an attention module's probabilities in that module's mode, so an
    attention module set apart (``layer.self_attn.eval()``) is one in the block too; a dropout
    module set apart has no place in the block (one mode for its other sites) and is refused by
    name, unless it drops nothing."""
    torch = pytest.importorskip("torch")
    cls, torch_cls = ((TransformerBlock, torch.nn.TransformerEncoderLayer) if kind == "encoder"
                      else (TransformerDecoderBlock, torch.nn.TransformerDecoderLayer))
    attns = ["self_attn"] + (["multihead_attn"] if kind == "decoder" else [])
    for training in (True, False):
        for apart in attns:
            layer = torch_cls(D, H, FF, dropout=0.3, batch_first=True, dtype=torch.float64).train(training)
            getattr(layer, apart).train(not training)
            block = cls.from_torch(layer)
            assert block.modes == {"training": training,
                                   **{a: (not training) if a == apart else training for a in attns}}
        sites = ["dropout", "dropout1", "dropout2"] + (["dropout3"] if kind == "decoder" else [])
        for site in sites:
            layer = torch_cls(D, H, FF, dropout=0.3, batch_first=True, dtype=torch.float64).train(training)
            getattr(layer, site).train(not training)
            match = (rf"^layer: expected {site} in the layer's mode \(training={training}; "
                     rf".*got {site}\.training={not training}$")
            with pytest.raises(ValueError, match=match):
                cls.from_torch(layer)
            layer = torch_cls(D, H, FF, dropout=0.0, batch_first=True, dtype=torch.float64).train(training)
            getattr(layer, site).train(not training)  # drops nothing in either mode
            assert cls.from_torch(layer).modes == {"training": training, **{a: training for a in attns}}


@pytest.mark.parametrize("kind", [TransformerBlock, TransformerDecoderBlock])
def test_a_float_keep_mask_is_named_by_its_site(kind):
    """A keep-mask of 0.0 / 1.0 floats is refused by the block under its site's name, before
    it computes (the dropout inside would call it 'dropout_mask')."""
    rng = np.random.default_rng(43)
    block = kind(D, H, FF, dropout=0.3, dtype="float64", seed=43)
    x, memory = rng.standard_normal((B, L, D)), rng.standard_normal((B, LM, D))
    args = (x,) if kind is TransformerBlock else (x, memory)
    shapes = {"self_attn": (B, H, L, L), "multihead_attn": (B, H, L, LM), "dropout": (B, L, FF)}
    for site in ENCODER_DROPOUT_SITES if kind is TransformerBlock else DECODER_DROPOUT_SITES:
        keep = np.ones(shapes.get(site, (B, L, D)))  # float64: 1.0 = keep
        with raises(TypeError, f"dropout_masks['{site}']", "bool", "float64"):
            block(*args, dropout_masks={site: keep})


@pytest.mark.parametrize("kind", [TransformerBlock, TransformerDecoderBlock])
def test_a_keep_mask_of_another_shape_is_named_with_its_site_shape_in_letters_and_numbers(kind):
    """A keep-mask one wider than its site: the message says the site's shape by its letters
    and its numbers, (B, L, F) = (2, 3, 12), and the shape it got, before the block computes."""
    rng = np.random.default_rng(45)
    block = kind(D, H, FF, dropout=0.3, dtype="float64", seed=45)
    x, memory = rng.standard_normal((B, L, D)), rng.standard_normal((B, LM, D))
    args = (x,) if kind is TransformerBlock else (x, memory)
    shapes = {"self_attn": ("(B, H, L, L)", (B, H, L, L)), "multihead_attn": ("(B, H, L, Lm)", (B, H, L, LM)),
              "dropout": ("(B, L, F)", (B, L, FF))}
    state = block.rng_state
    for site in ENCODER_DROPOUT_SITES if kind is TransformerBlock else DECODER_DROPOUT_SITES:
        letters, shape = shapes.get(site, ("(B, L, D)", (B, L, D)))
        wrong = shape[:-1] + (shape[-1] + 1,)
        with pytest.raises(ValueError, match=re.escape(f"dropout_masks[{site!r}]: expected a shape that "
                                                       f"broadcasts to {letters} = {shape} ")
                           + f".* got shape {re.escape(str(wrong))}$"):
            block(*args, dropout_masks={site: np.ones(wrong, dtype=bool)})
    assert block.rng_state == state


@pytest.mark.parametrize("kind", [TransformerBlock, TransformerDecoderBlock])
def test_torch_state_dict_of_a_torch_block_holds_copies(kind):
    """On the torch backend every entry is a copy (detach() alone would share the block's
    storage): writing into the state dict leaves the block as it was."""
    pytest.importorskip("torch")
    block = kind(D, H, FF, dtype="float64", backend="torch", seed=44)
    before = {k: v.detach().cpu().numpy().copy() for k, v in block.params.items()}
    sd = block.torch_state_dict()
    for v in sd.values():
        v.add_(1.0)
    for k, v in block.params.items():
        np.testing.assert_array_equal(v.detach().cpu().numpy(), before[k], err_msg=k)


@pytest.mark.parametrize("kind", [TransformerBlock, TransformerDecoderBlock])
def test_load_torch_state_dict_names_an_entry_of_another_shape(kind):
    """A linear layer's or a norm's entry of another shape is named as the state dict's key,
    not as the params key the assignment would name, and nothing is assigned."""
    torch = pytest.importorskip("torch")
    block = kind(D, H, FF, dtype="float64", seed=45)
    before = {k: np.array(v) for k, v in block.params.items()}
    sd = block.torch_state_dict()
    for key, shape in (("linear1.weight", (FF, D)), ("linear2.bias", (D,)), ("norm2.weight", (D,))):
        with raises(ValueError, f"state_dict['{key}']", f"{shape}", "(3, 2)"):
            block.load_torch_state_dict({**sd, key: torch.zeros(3, 2, dtype=torch.float64)})
    for k, v in block.params.items():  # nothing was assigned
        np.testing.assert_array_equal(np.asarray(v), before[k])


@pytest.mark.parametrize("kind", [TransformerBlock, TransformerDecoderBlock])
def test_dropout_masks_that_are_no_dict_are_a_type_error(kind):
    """A list or tuple for dropout_masks is a TypeError naming it (not set()'s 'unhashable
    type')."""
    rng = np.random.default_rng(46)
    block = kind(D, H, FF, dropout=0.3, dtype="float64", seed=46)
    x, memory = rng.standard_normal((B, L, D)), rng.standard_normal((B, LM, D))
    args = (x,) if kind is TransformerBlock else (x, memory)
    for bad, got in (([np.ones((B, L, D), bool)], "list"), ((("dropout1", None),), "tuple")):
        with raises(TypeError, "dropout_masks", "dict", got):
            block(*args, dropout_masks=bad)


@pytest.mark.parametrize("site", ["self_attn", "dropout1", "dropout", "dropout2"])
def test_each_site_without_a_keep_mask_draws_afresh_from_the_blocks_generator(site):
    """With the keep-masks of every other site given, each keeping everything,
    two training forwards differ: ``site``'s mask is a new draw from the block's generator
    each time, putting the generator's state back replays it, and another seed draws another."""
    rng = np.random.default_rng(49)
    block = TransformerBlock(D, H, FF, dropout=0.5, dtype="float64", seed=49)
    x = rng.standard_normal((B, L, D))
    shapes = {"self_attn": (B, H, L, L), "dropout1": (B, L, D), "dropout": (B, L, FF), "dropout2": (B, L, D)}
    others = {s: np.ones(shape, bool) for s, shape in shapes.items() if s != site}
    state = block.rng_state
    y1 = np.asarray(block(x, dropout_masks=others))
    y2 = np.asarray(block(x, dropout_masks=others))
    assert not np.allclose(y1, y2)
    block.rng_state = state
    np.testing.assert_array_equal(np.asarray(block(x, dropout_masks=others)), y1)
    other = TransformerBlock(D, H, FF, dropout=0.5, dtype="float64", seed=50)
    other.params = block.params
    assert not np.allclose(np.asarray(other(x, dropout_masks=others)), y1)


@pytest.mark.parametrize("kind", [TransformerBlock, TransformerDecoderBlock])
def test_constructor_flags_that_are_no_bool_are_named(kind):
    """norm_first and bias are bools: a string "no" is not False (bool("no") is True, a
    pre-norm block), nor 1 or None a choice."""
    for name, bad, got in (("norm_first", "no", "str 'no'"), ("norm_first", None, "None"),
                           ("bias", 1, "int 1"), ("bias", "False", "str 'False'")):
        with raises(TypeError, f"{name}: expected a bool", got):
            kind(D, H, **{name: bad})


def test_decoder_attention_modules_start_from_independent_draws():
    """The decoder's self-attention and cross-attention have the same shapes, so one seed
    handed to both would start them as copies of each other; each gets its own."""
    block = TransformerDecoderBlock(D, H, FF, dtype="float64", seed=50)
    p = {k: np.asarray(v) for k, v in block.params.items()}
    names = [k.split(".", 1)[1] for k in p if k.startswith("self_attn.")]
    assert names and all(f"multihead_attn.{k}" in p for k in names)
    for k in names:
        if not np.all(p[f"self_attn.{k}"] == 0):  # (biases start at zero in both)
            assert not np.allclose(p[f"self_attn.{k}"], p[f"multihead_attn.{k}"]), k


def test_attention_dropout_drawn_by_the_block_is_unbiased():
    """Inverted dropout keeps each probability with chance 1 - p and scales it by 1 / (1 - p),
    so the expected output equals the output without dropout. Pre-norm, with linear2 zero,
    out = x + dropout1(self_attn(norm1(x))), linear in the attention keep-mask; with the
    other sites' keep-masks all True, dropout1 only scales by 1 / (1 - p). Averaged over many
    copies of one sequence (each copy draws its own mask) the output comes within a few
    standard errors of x + a / (1 - p), a the attention's part of the eval output. Keeping
    with chance 1 - p/2 instead would overshoot a by half."""
    p, n = 0.5, 3200
    block = TransformerBlock(D, H, FF, dropout=p, norm_first=True, dtype="float64", seed=51)
    params = block.params
    params["linear2.weight"] = params["linear2.weight"] * 0.0
    params["linear2.bias"] = params["linear2.bias"] * 0.0
    block.params = params
    x1 = np.random.default_rng(52).standard_normal((1, L, D))
    x = np.repeat(x1, n, axis=0)  # [n, L, D]
    keep_all = {"dropout1": np.ones((n, L, D), bool), "dropout": np.ones((n, L, FF), bool),
                "dropout2": np.ones((n, L, D), bool)}
    mean = np.asarray(block(x, dropout_masks=keep_all)).mean(axis=0)  # [L, D]
    ref = np.asarray(block.eval()(x1))[0]  # [L, D]
    attn = ref - x1[0]  # a, the attention's part of the output
    assert np.linalg.norm(attn) > 0.1
    expected = x1[0] + attn / (1.0 - p)  # dropout1 keeps all and scales
    assert np.linalg.norm(mean - expected) < 0.1 * np.linalg.norm(attn)


@pytest.mark.parametrize("kind", [TransformerBlock, TransformerDecoderBlock])
def test_a_keep_mask_on_another_device_is_named_by_its_site(kind):
    """A torch keep-mask on another device than the parameters ("meta" stands in for a GPU
    here) is refused under its site's name before the block computes: the generator and the
    cached forward stay as they were."""
    torch = pytest.importorskip("torch")
    gen = torch.Generator().manual_seed(53)
    block = kind(D, H, FF, dropout=0.3, dtype="float64", backend="torch", seed=53)
    x = torch.randn((B, L, D), dtype=torch.float64, generator=gen)
    memory = torch.randn((B, LM, D), dtype=torch.float64, generator=gen)
    args = (x,) if kind is TransformerBlock else (x, memory)
    block(*args)
    cache, state = block.forward_state().cache, block.rng_state
    for site in ("dropout1", "dropout"):
        shape = (B, L, FF) if site == "dropout" else (B, L, D)
        keep = torch.ones(shape, dtype=torch.bool, device="meta")
        with raises(ValueError, f"dropout_masks[{site!r}]", "device(type='cpu')", "meta"):
            block(*args, dropout_masks={site: keep})
        assert block.forward_state().cache is cache and block.rng_state == state


@pytest.mark.parametrize("error", [MemoryError, KeyboardInterrupt])
def test_an_encoder_backward_that_fails_in_self_attention_changes_nothing(error, monkeypatch):
    """The feed-forward's backward runs, then the self-attention's fails: the block's grads
    and its attention module's grads, dmask and cache are those from before the call (the
    cache the module's own last forward left, not the block's forward's, which the block's
    backward handed it), and the next backward gives what a block that never failed gives."""
    rng = np.random.default_rng(54)
    x, d1, d2 = (rng.standard_normal((B, L, D)) for _ in range(3))
    block, twin = (TransformerBlock(D, H, FF, dropout=0.2, dtype="float64", seed=54) for _ in range(2))
    for b in (block, twin):
        b(x)
        b.backward(d1)
        b(2.0 * x)
    m = block.self_attn
    m(x, x, x)  # on its own: its cache is not the block's forward's
    before = (block.grads, m.grads, m.dmask, m.cache)

    def fails(dout):
        raise error("no memory")

    monkeypatch.setattr(m, "backward", fails)
    with pytest.raises(error):
        block.backward(d2)
    monkeypatch.undo()
    after = (block.grads, m.grads, m.dmask, m.cache)
    for name, a, b in zip(("grads", "self_attn.grads", "self_attn.dmask", "self_attn.cache"), after, before):
        assert a is b, name
    np.testing.assert_array_equal(block.backward(d2), twin.backward(d2))
    for k in twin.grads:
        np.testing.assert_array_equal(block.grads[k], twin.grads[k], err_msg=k)


@pytest.mark.parametrize("norm_first", [False, True])
def test_need_weights_with_the_blocked_impl_is_refused_before_the_block_computes(
        monkeypatch, norm_first):
    """self_attn.impl = "blocked" forms no weights: need_weights=True is refused up front,
    before norm1 (pre-norm) or the projections run, not from inside the self-attention."""
    import npattn.attention as A

    block = TransformerBlock(D, H, FF, norm_first=norm_first, dtype="float64", seed=55)
    x = np.random.default_rng(55).standard_normal((B, L, D))
    block.self_attn.impl = "blocked"
    calls = []
    for module, name in ((Ly, "layer_norm_forward"), (A, "linear_forward")):
        monkeypatch.setattr(module, name, lambda *a, _real=getattr(module, name), _name=name, **k:
                            calls.append(_name) or _real(*a, **k))
    with pytest.raises(ValueError, match="impl='blocked' cannot return attention weights"):
        block(x, need_weights=True)
    assert calls == []
    block(x)  # without weights the blocked impl runs
    assert calls


def test_need_weights_keeps_the_weights_where_auto_would_take_the_blocked_path(monkeypatch):
    """need_weights=True at sizes where impl="auto" takes the blocked implementation (here the
    threshold is lowered instead of the sizes raised): the block asks its self-attention for
    the weights, so auto keeps them. They are softmax(q k^T / sqrt(Dh)) per head, computed
    here from the parameters (post-norm: self-attention reads x itself)."""
    import npattn.attention as A

    monkeypatch.setattr(A, "AUTO_BLOCKED_MAX_DENSE_SCORES", 16)
    block = TransformerBlock(D, H, FF, dtype="float64", seed=56).eval()
    x = np.random.default_rng(56).standard_normal((B, L, D))
    block(x, need_weights=True)
    w = np.asarray(A.weights(block.self_attn.cache.sdpa))  # [B, H, L, L]
    p = {k: np.asarray(v) for k, v in block.params.items()}
    dh = D // H
    q = (x @ p["self_attn.w_q"].T + p["self_attn.b_q"]).reshape(B, L, H, dh).transpose(0, 2, 1, 3)
    k = (x @ p["self_attn.w_k"].T + p["self_attn.b_k"]).reshape(B, L, H, dh).transpose(0, 2, 1, 3)
    s = q @ k.transpose(0, 1, 3, 2) / np.sqrt(dh)  # [B, H, L, L]
    e = np.exp(s - s.max(axis=-1, keepdims=True))
    np.testing.assert_allclose(w, e / e.sum(axis=-1, keepdims=True), rtol=1e-10, atol=1e-14)


def test_from_torch_reads_every_form_of_the_activation():
    """A torch layer's activation may be the function, the module or a functools.partial of
    F.gelu (what GPT.to_torch builds): torch.relu (the function F.relu calls, not the same
    object) and nn.ReLU() are relu, a partial without approximate= is
    the exact gelu (F.gelu's default 'none'), with approximate='tanh' the tanh form. The
    copy's output is the layer's."""
    torch = pytest.importorskip("torch")
    tf = torch.nn.functional
    forms = [(tf.relu, "relu"), (torch.relu, "relu"), (torch.nn.ReLU(), "relu"), (tf.gelu, "gelu"),
             (torch.nn.GELU(), "gelu"), (torch.nn.GELU(approximate="tanh"), "gelu_tanh"),
             (functools.partial(tf.gelu), "gelu"),
             (functools.partial(tf.gelu, approximate="none"), "gelu"),
             (functools.partial(tf.gelu, approximate="tanh"), "gelu_tanh")]
    x = np.random.default_rng(57).standard_normal((B, L, D))
    for act, name in forms:
        torch.manual_seed(57)
        layer = torch.nn.TransformerEncoderLayer(D, H, FF, dropout=0.0, activation=act, batch_first=True,
                                                 dtype=torch.float64).eval()
        block = TransformerBlock.from_torch(layer)
        assert block.activation == name, act
        # (with grad enabled: torch's eval fast path runs the exact gelu for any nn.GELU)
        ref = layer(torch.from_numpy(x)).detach().numpy()
        np.testing.assert_allclose(np.asarray(block(x)), ref, rtol=1e-10, atol=1e-12, err_msg=repr(act))


@pytest.mark.parametrize("cls", [TransformerBlock, TransformerDecoderBlock])
def test_from_torch_refuses_another_activation_listing_the_forms_it_reads(cls):
    """torch.relu is read in the decoder too; torch.tanh, a function torch's layer takes, is
    refused naming activation and the forms from_torch reads."""
    torch = pytest.importorskip("torch")
    torch_cls = {TransformerBlock: torch.nn.TransformerEncoderLayer,
                 TransformerDecoderBlock: torch.nn.TransformerDecoderLayer}[cls]
    layer = torch_cls(D, H, FF, activation=torch.relu, batch_first=True, dtype=torch.float64)
    assert cls.from_torch(layer).activation == "relu"
    layer.activation = torch.tanh
    with pytest.raises(ValueError) as info:
        cls.from_torch(layer)
    msg = str(info.value)
    assert msg.startswith("layer: expected activation 'relu', 'gelu', torch.nn.functional.relu, "
                          "torch.relu, a torch.nn.ReLU, "), msg
    assert msg.endswith(f"got {torch.tanh!r}"), msg
