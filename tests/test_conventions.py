"""The claims of docs/conventions.md that can be checked here.

flash-attn's documented causal examples, and torch 2.13's behaviour where
the page contrasts it with npattn's (returned weights, dropout, fully
masked rows, state_dict names). If torch changes, these fail and the page
needs updating.
"""

import math

import numpy as np
import pytest

from npattn import MultiHeadAttention, masks
from npattn import functional as F


def test_bottom_right_matches_flash_attn_documented_examples():
    # flash_attn_func's docstring: "if seqlen_q = 2 and seqlen_k = 5, the causal mask is ..."
    np.testing.assert_array_equal(
        masks.causal(2, 5, "bottom_right"), np.array([[1, 1, 1, 1, 0], [1, 1, 1, 1, 1]], dtype=bool)
    )
    np.testing.assert_array_equal(
        masks.causal(5, 2, "bottom_right"),
        np.array([[0, 0], [0, 0], [0, 0], [1, 0], [1, 1]], dtype=bool),
    )
    # the page's top-left example next to it
    np.testing.assert_array_equal(
        masks.causal(2, 5), np.array([[1, 0, 0, 0, 0], [1, 1, 0, 0, 0]], dtype=bool)
    )


def test_npattn_weights_before_dropout_and_empty_rows():
    rng = np.random.default_rng(0)
    mha = MultiHeadAttention(8, 2, dropout=0.5, dtype="float64", seed=0)
    x, y = rng.standard_normal((2, 3, 8)), rng.standard_normal((2, 5, 8))
    mask = np.ones((3, 5), dtype=bool)
    mask[1] = False
    out, w = mha(x, y, y, mask=mask, need_weights=True, average_attn_weights=False)
    sums = w.sum(axis=-1)
    np.testing.assert_allclose(np.delete(sums, 1, axis=-1), 1.0, rtol=1e-12)
    assert np.all(w[:, :, 1] == 0.0) and np.all(np.isfinite(out))
    # the empty row attends nothing: its heads are zeros, so its output is the output bias
    np.testing.assert_allclose(out[:, 1], np.broadcast_to(mha.params["b_o"], (2, 8)), rtol=0, atol=1e-15)
    dq, dk, dv = mha.backward(rng.standard_normal(out.shape))
    assert all(np.all(np.isfinite(g)) for g in (dq, dk, dv))
    # ... and its query gets a zero gradient (the others do not)
    assert np.all(dq[:, 1] == 0.0) and np.all(np.abs(np.delete(dq, 1, axis=1)).sum(axis=-1) > 0)


def test_torch_behaviour_documented_on_the_page():
    torch = pytest.importorskip("torch")
    torch.manual_seed(0)
    tm = torch.nn.MultiheadAttention(8, 2, batch_first=True, dtype=torch.float64, dropout=0.5)
    x, y = torch.randn(2, 3, 8, dtype=torch.float64), torch.randn(2, 5, 8, dtype=torch.float64)
    # weights after dropout in training: rows no longer sum to 1; averaged over heads by default
    tm.train()
    _, w = tm(x, y, y)
    assert tuple(w.shape) == (2, 3, 5)
    _, w = tm(x, y, y, average_attn_weights=False)
    assert not torch.allclose(w.sum(-1), torch.ones(()).double())
    # a fully masked row (True = ignore): NaN with need_weights=True ...
    tm.eval()
    ignore = torch.zeros(3, 5, dtype=torch.bool)
    ignore[1] = True
    out, w = tm(x, y, y, attn_mask=ignore)
    assert torch.isnan(out[:, 1]).all() and torch.isnan(w[:, 1]).all()
    # ... zeros on the SDPA path, and in SDPA itself (CPU)
    with torch.no_grad():
        out, _ = tm(x, y, y, attn_mask=ignore, need_weights=False)
    assert (out[:, 1] == 0).all()
    # ... NaN on the inference fast path, which takes self-attention only (query is key is value)
    mask = torch.zeros(3, 3, dtype=torch.bool)
    mask[1] = True
    with torch.no_grad():
        cross, _ = tm(x, x.clone(), x.clone(), attn_mask=mask, need_weights=False)
        fast, _ = tm(x, x, x, attn_mask=mask, need_weights=False)
    assert (cross[:, 1] == 0).all() and torch.isnan(fast[:, 1]).all()
    q = torch.randn(1, 2, 3, 4, dtype=torch.float64)
    k = torch.randn(1, 2, 5, 4, dtype=torch.float64)
    out = torch.nn.functional.scaled_dot_product_attention(q, k, k, attn_mask=~ignore)
    assert (out[:, :, 1] == 0).all()
    ref, _ = F.sdpa_forward(q.numpy(), k.numpy(), k.numpy(), mask=(~ignore).numpy())
    np.testing.assert_allclose(ref, out.numpy(), rtol=1e-12, atol=1e-15)


@pytest.mark.parametrize(
    "kwargs,expected",
    [
        ({}, {"in_proj_weight": (24, 8), "in_proj_bias": (24,), "out_proj.weight": (8, 8), "out_proj.bias": (8,)}),
        ({"kdim": 5, "vdim": 3}, {"q_proj_weight": (8, 8), "k_proj_weight": (8, 5), "v_proj_weight": (8, 3),
                                  "in_proj_bias": (24,), "out_proj.weight": (8, 8), "out_proj.bias": (8,)}),
        ({"bias": False}, {"in_proj_weight": (24, 8), "out_proj.weight": (8, 8)}),
        ({"add_bias_kv": True, "add_zero_attn": True},
         {"in_proj_weight": (24, 8), "in_proj_bias": (24,), "bias_k": (1, 1, 8), "bias_v": (1, 1, 8),
          "out_proj.weight": (8, 8), "out_proj.bias": (8,)}),
    ],
)
def test_torch_state_dict_names_in_the_table(kwargs, expected):
    torch = pytest.importorskip("torch")
    sd = torch.nn.MultiheadAttention(8, 2, **kwargs).state_dict()
    assert {k: tuple(v.shape) for k, v in sd.items()} == expected


def test_default_scale_is_inverse_sqrt_head_width():
    rng = np.random.default_rng(1)
    q, k, v = rng.standard_normal((1, 1, 2, 9)), rng.standard_normal((1, 1, 3, 9)), rng.standard_normal((1, 1, 3, 9))
    a, _ = F.sdpa_forward(q, k, v)
    b, _ = F.sdpa_forward(q, k, v, scale=1.0 / math.sqrt(9))
    np.testing.assert_array_equal(a, b)


def test_npattn_parameter_shapes_in_the_table():
    # D=8, H=4 so Dh=2; n_kv_head=2 so Dkv=4; Dq=5, Dk=3, Dv=7
    mha = MultiHeadAttention(8, 4, n_kv_head=2, qdim=5, kdim=3, vdim=7, add_bias_kv=True, seed=0)
    shapes = {k: tuple(v.shape) for k, v in mha.params.items()}
    assert list(shapes.items()) == [
        ("w_q", (8, 5)), ("w_k", (4, 3)), ("w_v", (4, 7)), ("w_o", (8, 8)),
        ("b_q", (8,)), ("b_k", (4,)), ("b_v", (4,)), ("b_o", (8,)),
        ("bias_k", (4,)), ("bias_v", (4,)),
    ]
    # qkv_bias and out_bias separately: only the parameters that exist
    gpt = MultiHeadAttention(8, 2, qkv_bias=False, out_bias=True, seed=0)
    assert list(gpt.params) == ["w_q", "w_k", "w_v", "w_o", "b_o"]


@pytest.mark.parametrize("kwargs,setting", [({"qdim": 5}, "qdim"), ({"n_kv_head": 1}, "n_kv_head"),
                                            ({"qkv_bias": False, "out_bias": True}, "qkv_bias")])
def test_npattn_only_options_have_no_torch_state_dict(kwargs, setting):
    from npattn.torch_interop import torch_state_dict_shapes

    with pytest.raises(ValueError, match=setting):
        torch_state_dict_shapes(MultiHeadAttention(8, 2, **kwargs))
