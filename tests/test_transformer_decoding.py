"""TransformerBlock.forward(kv_cache=): decoding token by token equals one causal forward."""

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from npattn import KVCache
from npattn.transformer import TransformerBlock

B, L, D, H = 2, 7, 12, 3


def _block(xp, **kw):
    return TransformerBlock(D, H, 20, norm_first=True, activation="gelu_tanh", dtype="float64",
                            backend=xp, seed=5, **kw).eval()


def test_decoding_with_a_kv_cache_equals_the_causal_forward(xp, to_xp, to_np):
    block = _block(xp)
    x = np.random.default_rng(0).standard_normal((B, L, D))
    full = to_np(block.forward(to_xp(x), is_causal=True))
    cache = KVCache(B, L + 2, H, D // H, dtype="float64", backend=xp)
    pieces = [to_np(block.forward(to_xp(x[:, :3]), is_causal=True, kv_cache=cache))]  # a prompt of 3
    for t in range(3, L):  # then one token at a time
        pieces.append(to_np(block.forward(to_xp(x[:, t:t + 1]), is_causal=True, kv_cache=cache)))
    np.testing.assert_allclose(np.concatenate(pieces, axis=1), full, rtol=0, atol=1e-12)
    assert list(cache.cache_seqlens) == [L, L]


def test_backward_after_a_decoding_forward_is_a_runtime_error(xp, to_xp):
    block = _block(xp)
    x = to_xp(np.random.default_rng(1).standard_normal((B, 2, D)))
    cache = KVCache(B, 4, H, D // H, dtype="float64", backend=xp)
    out = block.forward(x, is_causal=True, kv_cache=cache)
    before = dict(block.grads)
    used_kv_cache = (r"^backward: the last forward used kv_cache, and decoding is forward only "
                     r"\(it keeps nothing to differentiate\); run a forward without kv_cache "
                     r"before backward$")
    with pytest.raises(RuntimeError, match=used_kv_cache):
        block.backward(out * 0.5)
    with pytest.raises(RuntimeError, match=used_kv_cache):  # not a shape error: no dout would do
        block.backward(to_xp(np.zeros((B, 3, D))))
    assert block.grads == before


def test_backward_after_a_decoding_forward_is_refused_before_it_computes(monkeypatch):
    """The block refuses it up front, with its own message: the feed-forward network's
    backward does not run first."""
    import npattn.layers as Ly

    block = _block(np)
    x = np.random.default_rng(7).standard_normal((B, 2, D))
    out = block.forward(x, is_causal=True, kv_cache=KVCache(B, 4, H, D // H, dtype="float64"))
    calls = []
    real = Ly.feed_forward_backward

    def spy(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(Ly, "feed_forward_backward", spy)
    with pytest.raises(RuntimeError, match=r"^backward: the last forward used kv_cache, .*\(it keeps nothing "
                                           r"to differentiate\); run a forward without kv_cache"):
        block.backward(0.5 * out)
    assert calls == []
    block.forward(x, is_causal=True)  # a forward without kv_cache: backward runs again
    block.backward(0.5 * out)
    assert calls


def test_a_full_cache_is_a_value_error_and_changes_nothing(xp, to_xp, to_np):
    block = _block(xp)
    x = to_xp(np.random.default_rng(2).standard_normal((B, 3, D)))
    cache = KVCache(B, 2, H, D // H, dtype="float64", backend=xp)
    full = (r"^kv_cache: expected room for 3 new positions in every batch entry, "
            r"but entry 0 holds 0 of capacity 2 \(0 \+ 3 = 3 > 2\); nothing was written$")
    with pytest.raises(ValueError, match=full):
        block.forward(x, is_causal=True, kv_cache=cache)
    assert list(cache.cache_seqlens) == [0, 0]


def test_decoding_in_training_mode_with_dropout_says_call_eval_and_changes_nothing():
    """A block in training mode with dropout > 0 and a kv_cache: a ValueError that says to
    call eval() (not one about a dropout mask the caller never gave); the cache's lengths
    and the block's generator are unchanged."""
    from npattn.transformer import TransformerBlock

    blk = TransformerBlock(8, 2, 16, dropout=0.1, dtype="float64", seed=0)
    x = np.random.default_rng(0).standard_normal((2, 3, 8))
    cache = blk.self_attn.new_cache(2, 10)
    state = blk.rng_state
    with pytest.raises(ValueError, match=r"kv_cache: decoding is forward only.*call eval\(\)"):
        blk(x, is_causal=True, kv_cache=cache)
    assert list(cache.cache_seqlens) == [0, 0] and blk.rng_state == state
    blk.eval()
    out = blk(x, is_causal=True, kv_cache=cache)
    assert out.shape == x.shape and list(cache.cache_seqlens) == [3, 3]


def test_need_weights_with_a_kv_cache_is_refused_and_changes_nothing():
    """A decoding forward keeps no attention cache (self_attn.cache is None after it), so the
    weights need_weights asks to keep could never be read: a ValueError naming need_weights,
    before anything runs; the cache's lengths, the block's cache and its generator are
    unchanged, and the same call without need_weights decodes."""
    block = _block(np)
    x = np.random.default_rng(8).standard_normal((B, 3, D))
    block.forward(x, is_causal=True)
    cached, state = block.self_attn.cache, block.rng_state
    cache = KVCache(B, 4, H, D // H, dtype="float64")
    with pytest.raises(ValueError, match=r"^need_weights: expected False with kv_cache .*got True"):
        block.forward(x, is_causal=True, kv_cache=cache, need_weights=True)
    assert list(cache.cache_seqlens) == [0, 0]
    assert block.self_attn.cache is cached and block.rng_state == state
    out = block.forward(x, is_causal=True, kv_cache=cache)
    np.testing.assert_allclose(out, block.forward(x, is_causal=True), rtol=0, atol=1e-12)


def test_decoding_in_training_mode_without_dropout_is_allowed(xp, to_xp, to_np):
    """Only dropout stops decoding: a block in training mode with dropout 0 decodes, and
    gives what it gives in eval mode."""
    block = TransformerBlock(D, H, 20, dtype="float64", backend=xp, seed=5)
    assert block.training and block.dropout == 0.0
    x = np.random.default_rng(6).standard_normal((B, 3, D))
    cache = KVCache(B, 4, H, D // H, dtype="float64", backend=xp)
    out = to_np(block.forward(to_xp(x), is_causal=True, kv_cache=cache))
    assert list(cache.cache_seqlens) == [3, 3]
    full = to_np(block.eval().forward(to_xp(x), is_causal=True))
    np.testing.assert_allclose(out, full, rtol=0, atol=1e-12)


def test_a_forward_that_fails_after_self_attention_leaves_the_cache(monkeypatch):
    """A failure past every check (here a MemoryError in the feed-forward network, after
    self-attention appended the new keys): the cache keeps its lengths, and the next
    decoding step gives what it gives without the failed one."""
    import npattn.layers as Ly

    x = np.random.default_rng(3).standard_normal((B, 3, D))
    blocks = [_block(np) for _ in range(2)]
    caches = [KVCache(B, 6, H, D // H, dtype="float64") for _ in range(2)]
    for blk, cache in zip(blocks, caches):
        blk.forward(x[:, :2], is_causal=True, kv_cache=cache)
    real = Ly.feed_forward_forward

    def fails(*args, **kwargs):
        raise MemoryError("no memory")

    monkeypatch.setattr(Ly, "feed_forward_forward", fails)
    with pytest.raises(MemoryError):
        blocks[0].forward(x[:, 2:], is_causal=True, kv_cache=caches[0])
    monkeypatch.setattr(Ly, "feed_forward_forward", real)
    assert list(caches[0].cache_seqlens) == [2, 2]
    a = blocks[0].forward(x[:, 2:], is_causal=True, kv_cache=caches[0])
    b = blocks[1].forward(x[:, 2:], is_causal=True, kv_cache=caches[1])
    np.testing.assert_array_equal(a, b)


def test_block_argument_errors_name_the_argument():
    torch = pytest.importorskip("torch")
    for seed, exc in ((-1, ValueError), (1.5, TypeError), ("s", TypeError)):
        with pytest.raises(exc, match="^seed: expected (None, )?a non-negative int seed"):
            TransformerBlock(4, 2, seed=seed)
    blk = TransformerBlock(4, 2, dtype="float64", seed=0)
    before = {k: np.array(v) for k, v in blk.params.items()}
    sd = blk.torch_state_dict()
    with pytest.raises(TypeError, match="^state_dict: expected a mapping"):
        blk.load_torch_state_dict(5)
    with pytest.raises(TypeError, match=r"^state_dict\['norm1.weight'\]: expected a tensor or array, got str"):
        blk.load_torch_state_dict({**sd, "norm1.weight": "abc"})
    with pytest.raises(TypeError, match=r"^state_dict\['norm1.weight'\]: expected a floating tensor"):
        blk.load_torch_state_dict({**sd, "norm1.weight": torch.ones(4, dtype=torch.int64)})
    state = blk.rng_state
    with pytest.raises(TypeError, match="^rng_state: expected a dict read from rng_state, got None$"):
        blk.rng_state = None
    assert blk.rng_state == state
    for k, v in blk.params.items():
        np.testing.assert_array_equal(v, before[k])


def _count_steps(monkeypatch):
    """The calls of the layer norm and of the attention projections: the first steps of a
    block's forward, pre-norm or post-norm."""
    import npattn.attention as A
    import npattn.layers as Ly

    calls = []
    for module, name in ((Ly, "layer_norm_forward"), (A, "linear_forward")):
        real = getattr(module, name)

        def spy(*args, _real=real, _name=name, **kwargs):
            calls.append(_name)
            return _real(*args, **kwargs)

        monkeypatch.setattr(module, name, spy)
    return calls


@pytest.mark.parametrize("norm_first", [True, False])
@pytest.mark.parametrize("decoding", [True, False])
def test_an_attention_impl_that_cannot_run_is_refused_before_the_block_computes(
        monkeypatch, norm_first, decoding):
    """self_attn.impl = "chunked" on NumPy arrays: the dispatcher's ValueError came from
    inside the self-attention, after norm1 (pre-norm) and the projections had run; it is
    now raised before anything is computed, and the cache keeps its lengths."""
    blk = TransformerBlock(D, H, 20, norm_first=norm_first, dtype="float64", seed=5).eval()
    x = np.random.default_rng(4).standard_normal((B, 3, D))
    cache = KVCache(B, 6, H, D // H, dtype="float64") if decoding else None
    blk.self_attn.impl = "chunked"
    calls = _count_steps(monkeypatch)
    with pytest.raises(ValueError, match="impl='chunked'"):
        blk.forward(x, is_causal=True, kv_cache=cache)
    assert calls == []
    assert cache is None or list(cache.cache_seqlens) == [0, 0]
    blk.self_attn.impl = "auto"
    blk.forward(x, is_causal=True, kv_cache=cache)
    assert calls


@pytest.mark.parametrize("attn", ["self_attn", "multihead_attn"])
def test_a_decoder_block_refuses_an_attention_impl_before_it_computes(monkeypatch, attn):
    """Either attention's impl is checked up front: "chunked" for the cross-attention was
    refused after the whole self-attention sublayer had run."""
    from npattn.transformer import TransformerDecoderBlock

    blk = TransformerDecoderBlock(D, H, 20, dtype="float64", seed=5)
    rng = np.random.default_rng(5)
    x, memory = rng.standard_normal((B, 3, D)), rng.standard_normal((B, 4, D))
    getattr(blk, attn).impl = "chunked"
    calls = _count_steps(monkeypatch)
    Lk = 4 if attn == "multihead_attn" else 3  # the cross-attention's keys are memory's positions
    heads = rf"\(2, {H}, 3, {D // H}\), \(2, {H}, {Lk}, {D // H}\), \(2, {H}, {Lk}, {D // H}\)"
    with pytest.raises(ValueError, match=rf"^impl='chunked': .*got numpy.ndarray of shapes {heads};"):
        blk.forward(x, memory)
    assert calls == []


def test_masks_with_a_kv_cache_are_refused_as_such_whatever_their_shape():
    """A mask, keep-mask or segments with kv_cache: 'expected None with kv_cache', also for a
    mask over the cached and the new keys (its shape was checked first, against the new keys
    alone, so the message asked for another shape that was then refused too); the block's
    and the model's dropout_masks the same. Nothing is written to the caches."""
    from npattn import MultiHeadAttention
    from npattn.gpt import GPT

    rng = np.random.default_rng(8)
    mha = MultiHeadAttention(D, H, dtype="float64", seed=1).eval()
    cache = mha.new_cache(B, 6)
    mha(*(rng.standard_normal((B, 2, D)),) * 3, kv_cache=cache)  # 2 cached keys, then 1 new one
    y = rng.standard_normal((B, 1, D))
    none = (r"expected None with kv_cache \(entry b attends its cache_seqlens\[b\] cached keys and the "
            r"new ones\), ")
    for name, kw in (("mask", {"mask": np.ones((1, 3), bool)}),  # the cached and the new keys
                     ("mask", {"mask": np.zeros((1, 1))}),  # the new key alone
                     ("dropout_mask", {"dropout_mask": np.ones((B, H, 1, 3), bool)}),
                     ("q_segments", {"q_segments": np.zeros((B, 1), int),
                                     "k_segments": np.zeros((B, 3), int)}),
                     ("k_segments", {"k_segments": np.zeros((B, 3), int)})):
        with pytest.raises(ValueError, match=rf"^{name}: {none}got numpy.ndarray$"):
            mha(y, y, y, kv_cache=cache, **kw)
    assert list(cache.cache_seqlens) == [2, 2]
    with pytest.raises(TypeError, match=r"^kv_cache: expected an npattn.KVCache .*, got str$"):
        mha(y, y, y, kv_cache="cache", mask=np.ones((1, 1), bool))  # the cache is the bad argument

    block, x = _block(np), rng.standard_normal((B, 2, D))
    cache = KVCache(B, 6, H, D // H, dtype="float64")
    block.forward(x, is_causal=True, kv_cache=cache)
    with pytest.raises(ValueError, match=rf"^mask: {none}got numpy.ndarray$"):
        block.forward(x[:, :1], mask=np.ones((1, 3), bool), kv_cache=cache)
    drop = r"expected None with kv_cache \(decoding is forward only, without dropout\), got dict$"
    for masks in ({"self_attn": np.ones((B, H, 1, 3), bool)}, {}):
        with pytest.raises(ValueError, match=rf"^dropout_masks: {drop}"):
            block.forward(x[:, :1], dropout_masks=masks, kv_cache=cache)
    assert list(cache.cache_seqlens) == [2, 2]

    model = GPT(11, 8, D, 2, H, dtype="float64", seed=2).eval()
    caches = model.new_caches(B)
    ids = rng.integers(0, 11, (B, 2))
    model.forward(ids, kv_caches=caches)
    with pytest.raises(ValueError, match=r"^dropout_masks: expected None with kv_caches \(decoding is "
                                         r"forward only, without dropout\), got list$"):
        model.forward(ids[:, :1], dropout_masks=[{}, {}], kv_caches=caches)
    assert [list(c.cache_seqlens) for c in caches] == [[2, 2], [2, 2]]


@given(norm_first=st.booleans(), activation=st.sampled_from(["relu", "gelu", "gelu_tanh"]), bias=st.booleans(),
       impl=st.sampled_from(["reference", "blocked", "numpy", "dense"]),
       prompts=st.lists(st.integers(1, 4), min_size=1, max_size=3),
       chunks=st.lists(st.integers(1, 3), min_size=1, max_size=3), seed=st.integers(0, 2**16))
def test_decoding_ragged_entries_in_chunks_equals_each_entry_alone(norm_first, activation, bias, impl,
                                                                   prompts, chunks, seed):
    """Post- or pre-norm, any activation, with or without biases, any attention impl: prompts
    of 1-4 tokens prefilled right-padded and truncated, then chunks of 1-3 tokens; entry b's
    outputs are those of a causal forward of its own tokens with the reference impl."""
    block = TransformerBlock(D, H, 20, norm_first=norm_first, activation=activation, bias=bias,
                             dtype="float64", seed=seed).eval()
    rng = np.random.default_rng(seed)
    B, P, S = len(prompts), max(prompts), sum(chunks)
    x, y = rng.standard_normal((B, P, D)), rng.standard_normal((B, S, D))
    cache = KVCache(B, P + S, H, D // H, dtype="float64")
    block.self_attn.impl = impl
    prefill = block.forward(x, is_causal=True, kv_cache=cache)
    cache.truncate(prompts)
    steps, t = [], 0
    for n in chunks:
        steps.append(block.forward(y[:, t:t + n], is_causal=True, kv_cache=cache))
        t += n
    decoded = np.concatenate(steps, axis=1)  # [B, S, D]
    block.self_attn.impl = "reference"
    for b, p in enumerate(prompts):
        full = block.forward(np.concatenate([x[b, :p], y[b]])[None], is_causal=True)[0]  # [p + S, D]
        np.testing.assert_allclose(prefill[b, :p], full[:p], rtol=0, atol=1e-12)
        np.testing.assert_allclose(decoded[b], full[p:], rtol=0, atol=1e-12, err_msg=f"entry {b}")
