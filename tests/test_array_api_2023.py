"""npattn on a namespace of the Array API standard's 2023.12 revision.

That revision takes Python scalars as operands of operators (``x * 0.5``) but not as
arguments of ``where`` or of elementwise functions (``minimum``, ``maximum``), which
only the 2024.12 revision allows. array_api_strict emulates 2023.12
(``ArrayAPIStrictFlags(api_version="2023.12")``); every public piece runs a forward
and a backward there in float64 and must give what the same call gives on NumPy.
"""

import math

import numpy as np
import pytest

array_api_strict = pytest.importorskip("array_api_strict")

from npattn import KVCache, MultiHeadAttention, attention, compat  # noqa: E402
from npattn import functional as F  # noqa: E402
from npattn import layers as Ly  # noqa: E402
from npattn import masks, nn, positions  # noqa: E402
from npattn.backend import from_numpy, resolve_backend, to_numpy  # noqa: E402
from npattn.classifier import TransformerClassifier  # noqa: E402
from npattn.gpt import GPT  # noqa: E402
from npattn.transformer import TransformerBlock, TransformerDecoderBlock  # noqa: E402

B, H, Lq, Lk, Dh, Dv = 2, 2, 5, 7, 4, 3
D = H * Dh


def api_2023():
    """array_api_strict emulating the 2023.12 revision, for the duration of a ``with``."""
    return array_api_strict.ArrayAPIStrictFlags(api_version="2023.12")


def both(run):
    """``run(backend, to_xp)`` (a list of arrays, or None entries) on NumPy and on
    array_api_strict under 2023.12: each result of the second equals the first's."""
    np_xp = resolve_backend("numpy")
    want = run("numpy", lambda a: from_numpy(np.asarray(a), np_xp))
    with api_2023():
        xp = resolve_backend("array_api_strict")
        got = run("array_api_strict", lambda a: from_numpy(np.asarray(a), xp))
        got = [None if g is None else to_numpy(g) for g in got]
    assert len(got) == len(want)
    for i, (g, w) in enumerate(zip(got, want)):
        if w is None:
            assert g is None, i
            continue
        w = to_numpy(w)
        assert g.shape == w.shape and g.dtype == w.dtype, (i, g.shape, w.shape, g.dtype, w.dtype)
        np.testing.assert_allclose(g, w, rtol=1e-12, atol=1e-14, err_msg=f"result {i}")
    return want


def rand(seed, *shape):
    return np.random.default_rng(seed).standard_normal(shape)


def float_mask():
    """[B, 1, Lq, Lk] additive mask with -inf entries and a row with nothing to attend."""
    m = rand(10, B, 1, Lq, Lk)
    m[np.random.default_rng(11).random(m.shape) < 0.3] = -math.inf
    m[1, 0, 2, :] = -math.inf
    return m


def bool_mask():
    """[B, H, Lq, Lk] True = may attend, with a row with nothing to attend."""
    m = np.random.default_rng(12).random((B, H, Lq, Lk)) > 0.3
    m[0, 1, 3, :] = False
    return m


def test_the_emulated_revision_refuses_python_scalars_in_where():
    with api_2023():
        xp = resolve_backend("array_api_strict")
        x = xp.asarray([1.0, -2.0], dtype=xp.float64)
        with pytest.raises((TypeError, AttributeError)):
            xp.where(x > 0.0, x, 0.0)


@pytest.mark.parametrize("kind", ["float", "bool"])
def test_functional_sdpa_with_masks_dropout_and_sinks(kind):
    mask = float_mask() if kind == "float" else bool_mask()

    def run(backend, to_xp):
        q, k, v = to_xp(rand(1, B, H, Lq, Dh)), to_xp(rand(2, B, H, Lk, Dh)), to_xp(rand(3, B, H, Lk, Dv))
        out, cache = F.sdpa_forward(q, k, v, mask=to_xp(mask), is_causal=True, dropout_p=0.3,
                                    rng=np.random.default_rng(4), sinks=to_xp(rand(5, H)),
                                    softcap=2.0)
        dlse = to_xp(rand(7, B, H, Lq))
        g = F.sdpa_backward(to_xp(rand(6, B, H, Lq, Dv)), cache, dlse=dlse)
        return [out, cache.softmax.lse, g.dq, g.dk, g.dv, g.dmask, g.dsinks]

    want = both(run)
    assert np.all(want[0][1, :, 2] == 0.0) if kind == "float" else np.all(want[0][0, 1, 3] == 0.0)


def test_pad_mask_of_a_float_mask_under_causal():
    def run(backend, to_xp):
        m, cache = F.pad_mask_forward(to_xp(rand(1, B, 1, Lq, Lk)), Lq, Lk, 2, is_causal=True)
        return [m, F.pad_mask_backward(to_xp(rand(2, B, 1, Lq, Lk + 2)), cache)]

    want = both(run)
    assert np.isneginf(want[0][..., 0, 1]).all() and np.all(want[0][..., Lk:] == 0.0)


@pytest.mark.parametrize("impl", ["reference", "blocked"])
def test_attention_dispatcher_with_a_float_mask_dropout_sinks_and_dlse(impl):
    def run(backend, to_xp):
        q, k, v = to_xp(rand(1, B, H, Lq, Dh)), to_xp(rand(2, B, H, Lk, Dh)), to_xp(rand(3, B, H, Lk, Dv))
        out, cache = attention.sdpa_forward(q, k, v, mask=to_xp(float_mask()), dropout_p=0.25,
                                            rng=np.random.default_rng(8), sinks=to_xp(rand(5, H)),
                                            window=(3, 1), impl=impl, block_q=2, block_k=3)
        g = attention.sdpa_backward(to_xp(rand(6, B, H, Lq, Dv)), cache, dlse=to_xp(rand(7, B, H, Lq)))
        return [out, cache.lse, g.dq, g.dk, g.dv, g.dmask, g.dsinks]

    both(run)


@pytest.mark.parametrize("impl", ["reference", "blocked"])
def test_multi_head_attention_module(impl):
    def run(backend, to_xp):
        mha = MultiHeadAttention(D, H, dropout=0.25, kdim=5, vdim=3, dtype="float64", seed=0,
                                 backend=backend, impl=impl, block_q=2, block_k=3)
        x, kv_k, kv_v = to_xp(rand(1, B, Lq, D)), to_xp(rand(2, B, Lk, 5)), to_xp(rand(3, B, Lk, 3))
        out = mha.forward(x, kv_k, kv_v, mask=to_xp(float_mask()), is_causal=True)[0]
        dx = mha.backward(to_xp(rand(4, B, Lq, D)))
        return [out, *dx] + [mha.grads[name] for name in sorted(mha.grads)]

    both(run)


def test_layers_forward_and_backward():
    def run(backend, to_xp):
        x = to_xp(rand(1, B, Lq, D) * 3.0)
        dout = to_xp(rand(2, B, Lq, D))
        res = [Ly.erf(to_xp(np.array([-12.0, -3.0, -0.5, 0.0, 1.5, 2.5, 7.0])))]
        y, c = Ly.layer_norm_forward(x, to_xp(rand(3, D)), to_xp(rand(4, D)))
        res += [y, *Ly.layer_norm_backward(dout, c)]
        y, c = Ly.layer_norm_forward(x * 1e300)  # rows whose squares overflow
        res += [y, Ly.layer_norm_backward(dout, c)[0]]
        for forward, backward in [(Ly.relu_forward, Ly.relu_backward),
                                  (Ly.gelu_forward, Ly.gelu_backward)]:
            y, c = forward(x)
            res += [y, backward(dout, c)]
        y, c = Ly.gelu_forward(x, approximate="tanh")
        res += [y, Ly.gelu_backward(dout, c)]
        w1, b1, w2, b2 = to_xp(rand(5, 6, D)), to_xp(rand(6, 6)), to_xp(rand(7, D, 6)), to_xp(rand(8, D))
        y, c = Ly.feed_forward_forward(x, w1, b1, w2, b2, activation="gelu", dropout_p=0.3,
                                       rng=np.random.default_rng(9))
        res += [y, *Ly.feed_forward_backward(dout, c)]
        y, c = Ly.residual_forward(x, dout)
        res += [y, *Ly.residual_backward(dout, c)]
        padded = np.array([[True] * Lq, [True, True] + [False] * (Lq - 2)])
        y, c = Ly.mean_pool_forward(x, to_xp(padded))
        res += [y, Ly.mean_pool_backward(to_xp(rand(10, B, D)), c)]
        y, c = F.dropout_forward(x, 0.4, rng=np.random.default_rng(11))
        res += [y, F.dropout_backward(dout, c)]
        return res

    both(run)


@pytest.mark.parametrize("norm_first", [False, True])
def test_transformer_encoder_and_decoder_blocks(norm_first):
    def run(backend, to_xp):
        enc = TransformerBlock(D, H, 12, dropout=0.2, activation="gelu", norm_first=norm_first,
                               dtype="float64", backend=backend, seed=1)
        dec = TransformerDecoderBlock(D, H, 12, dropout=0.2, norm_first=norm_first,
                                      dtype="float64", backend=backend, seed=2)
        x, memory = to_xp(rand(1, B, Lq, D)), to_xp(rand(2, B, Lk, D))
        y = enc.forward(x, is_causal=True)
        dx = enc.backward(to_xp(rand(3, B, Lq, D)))
        z = dec.forward(x, memory, is_causal=True, memory_mask=to_xp(float_mask()))
        dz = dec.backward(to_xp(rand(4, B, Lq, D)))
        grads = [g[name] for g in (enc.grads, dec.grads) for name in sorted(g)]
        return [y, dx, z, *dz, *grads]

    both(run)


def test_gpt_forward_backward_loss_and_decoding():
    V_, T = 11, 9

    def run(backend, to_xp):
        model = GPT(V_, T, D, 2, H, 12, dropout=0.2, dtype="float64", backend=backend, seed=3)
        ids = to_xp(np.random.default_rng(1).integers(0, V_, size=(B, Lq)))
        targets = to_xp(np.random.default_rng(2).integers(0, V_, size=(B, Lq)))
        logits = model.forward(ids)
        loss, c = nn.cross_entropy_forward(logits, targets, label_smoothing=0.1, ignore_index=3)
        dlogits, _ = nn.cross_entropy_backward(to_xp(np.array(1.7)), c)
        grads = model.backward(dlogits)
        model.eval()
        caches = [KVCache(B, T, H, Dh, dtype="float64", backend=backend) for _ in range(2)]
        step = [model.forward(ids[:, :3], kv_caches=caches), model.forward(ids[:, 3:], kv_caches=caches)]
        return [logits, loss, dlogits, *step] + [grads[name] for name in sorted(grads)]

    both(run)


def test_transformer_classifier_with_padding():
    def run(backend, to_xp):
        model = TransformerClassifier(3, Lq, 4, d_model=D, n_head=H, n_layers=2, dropout=0.2,
                                      activation="gelu", dtype="float64", backend=backend, seed=1)
        tokens = np.array([[True] * Lq, [True, True] + [False] * (Lq - 2)])
        logits = model.forward(to_xp(rand(1, B, Lq, 3)), mask=to_xp(tokens))
        grads = model.backward(to_xp(rand(2, B, 4)))
        return [logits] + [grads[name] for name in sorted(grads)]

    both(run)


def test_mask_builders():
    def run(backend, to_xp):
        xp = resolve_backend(backend)
        key_padding = np.array([[False] * (Lk - 2) + [True, True], [False] * Lk])
        attn_mask = np.random.default_rng(1).random((Lq, Lk)) > 0.7
        return [
            masks.causal(Lq, Lk, "bottom_right", xp=xp),
            masks.window(Lq, Lk, 2, 1, xp=xp),
            masks.segments(to_xp(np.array([[0, 0, 1, 1, 1]])), to_xp(np.array([[0, 1, 1, 1, 2, 2, 2]]))),
            masks.padding(to_xp(np.array([3, Lk])), Lk),
            masks.from_torch_mha(to_xp(attn_mask), to_xp(key_padding), n_head=H, dtype=xp.float64),
            masks.from_torch_mha(to_xp(rand(2, Lq, Lk)), to_xp(key_padding), n_head=H),
        ]

    both(run)


def test_positions_and_embeddings():
    def run(backend, to_xp):
        xp = resolve_backend(backend)
        x = to_xp(rand(1, B, H, Lq, Dh))
        res = []
        for interleaved in (False, True):
            y, c = positions.rope_forward(x, to_xp(np.arange(2, 2 + Lq)), interleaved=interleaved)
            res += [y, positions.rope_backward(to_xp(rand(2, B, H, Lq, Dh)), c)[0]]
        y, c = positions.relative_embedding_forward(to_xp(rand(3, 7, Dh)), Lq, Lk, offset=1)
        res += [y, positions.relative_embedding_backward(to_xp(rand(4, Lq, Lk, Dh)), c)[1]]
        y, c = positions.relative_scores_forward(x, to_xp(rand(5, 9, Dh)), Lk, offset=-1)
        res += [y, *positions.relative_scores_backward(to_xp(rand(6, B, H, Lq, Lk)), c)[:2]]
        y, c = positions.relative_bias_forward(to_xp(rand(7, 8, H)), Lq, Lk, max_distance=4)
        res += [y, positions.relative_bias_backward(to_xp(rand(8, 1, H, Lq, Lk)), c)[0]]
        res += [positions.t5_bucket(positions.relative_distances(xp, Lq, Lk, offset=-2),
                                    bidirectional=False, num_buckets=6, max_distance=5)]
        ids = to_xp(np.random.default_rng(9).integers(0, 6, size=(B, Lq)))
        y, c = nn.embedding_forward(ids, to_xp(rand(10, 6, D)))
        res += [y, nn.embedding_backward(to_xp(rand(11, B, Lq, D)), c)[1]]
        res += [nn.sinusoidal_positions(xp, Lq, D, dtype=xp.float64)]
        return res

    both(run)


def test_flash_attn_and_torch_sdpa_entry_points():
    def run(backend, to_xp):
        q, k, v = to_xp(rand(1, B, Lq, H, Dh)), to_xp(rand(2, B, Lk, 1, Dh)), to_xp(rand(3, B, Lk, 1, Dv))
        out, lse, s_dmask = compat.flash_attn_func(q, k, v, dropout_p=0.2, causal=True, window_size=(2, 0),
                                                   return_attn_probs=True, rng=np.random.default_rng(4))
        mask = to_xp(float_mask())
        qt, kt, vt = (to_xp(rand(s, B, H, L, d)) for s, L, d in [(5, Lq, Dh), (6, Lk, Dh), (7, Lk, Dv)])
        y = compat.scaled_dot_product_attention(qt, kt, vt, attn_mask=mask)
        qj, kj, vj = (to_xp(rand(s, B, L, H, Dh)) for s, L in [(8, Lq), (9, Lk), (10, Lk)])
        (z, lse_j), pullback = compat.vjp(compat.dot_product_attention, qj, kj, vj, to_xp(float_mask()),
                                          to_xp(bool_mask()), key_value_seq_lengths=to_xp(np.array([4, Lk])),
                                          return_residual=True)
        grads = pullback(to_xp(rand(11, B, Lq, H, Dh)), dlse=to_xp(rand(12, B, Lq, H)))
        return [out, lse, s_dmask, y, z, lse_j, *grads]

    both(run)


def test_flash_attn_varlen_and_kvcache_entry_points():
    def run(backend, to_xp):
        q, k, v = to_xp(rand(1, 7, H, Dh)), to_xp(rand(2, 9, H, Dh)), to_xp(rand(3, 9, H, Dv))
        cu_q, cu_k = to_xp(np.array([0, 3, 7], dtype=np.int32)), to_xp(np.array([0, 4, 9], dtype=np.int32))
        (out, lse, s_dmask), pullback = compat.vjp(
            compat.flash_attn_varlen_func, q, k, v, cu_q, cu_k, 4, 5, dropout_p=0.2, causal=True,
            softcap=3.0, return_attn_probs=True, rng=np.random.default_rng(4))
        grads = pullback(to_xp(rand(5, 7, H, Dv)), dlse=to_xp(rand(6, H, 7)))
        k_cache, v_cache = to_xp(rand(7, B, 8, H, Dh)), to_xp(rand(8, B, 8, H, Dv))
        o, lse_c = compat.flash_attn_with_kvcache(
            to_xp(rand(9, B, 3, H, Dh)), k_cache, v_cache, to_xp(rand(10, B, 3, H, Dh)),
            to_xp(rand(11, B, 3, H, Dv)), cache_seqlens=to_xp(np.array([1, 4], dtype=np.int32)),
            causal=True, softcap=2.0, return_softmax_lse=True)
        return [out, lse, s_dmask, *grads[:3], o, lse_c, k_cache, v_cache]

    both(run)


def test_flash_attn_packed_entry_points():
    """The packed forms unpack by indexing and stack their gradients with the namespace's
    stack, on 2023.12 as on NumPy."""
    def run(backend, to_xp):
        qkv = to_xp(rand(1, B, Lq, 3, H, Dh))
        (out, lse, s_dmask), pullback = compat.vjp(
            compat.flash_attn_qkvpacked_func, qkv, 0.2, causal=True, window_size=(2, 0),
            return_attn_probs=True, rng=np.random.default_rng(4))
        grads = pullback(to_xp(rand(2, B, Lq, H, Dh)), dlse=to_xp(rand(3, B, H, Lq)))
        q, kv = to_xp(rand(4, 7, H, Dh)), to_xp(rand(5, 9, 2, 1, Dh))
        cu_q, cu_k = to_xp(np.array([0, 3, 7], dtype=np.int32)), to_xp(np.array([0, 4, 9], dtype=np.int32))
        o, pullback_v = compat.vjp(compat.flash_attn_varlen_kvpacked_func, q, kv, cu_q, cu_k, 4, 5,
                                   causal=True, softcap=3.0)
        grads_v = pullback_v(to_xp(rand(6, 7, H, Dh)))
        return [out, lse, s_dmask, grads[0], o, *grads_v[:2]]

    both(run)


def test_a_constant_is_a_python_float_from_2024_12_and_a_0d_array_before():
    """backend.scalar hands a namespace of 2024.12 or later the float itself (nothing made,
    nothing copied to a device per call) and an older one a 0-d array of the other
    operand's dtype; where() gives the same either way."""
    from npattn.backend import namespace, scalar

    x = np.asarray([1.0, -2.0], np.float32)
    for version in ("2024.12", "2023.12"):
        with array_api_strict.ArrayAPIStrictFlags(api_version=version):
            xs = array_api_strict.asarray(x)
            xp = namespace(xs)
            c = scalar(xp, 0.5, xs)
            if version == "2024.12":
                assert type(c) is float and c == 0.5
            else:
                assert c.shape == () and c.dtype == array_api_strict.float32 and float(c) == 0.5
            got = xp.where(xs > 0, xs, scalar(xp, 0.0, xs))
            assert got.dtype == array_api_strict.float32, version
            np.testing.assert_array_equal(to_numpy(got), np.where(x > 0, x, 0.0))
