"""KV-cache decoding: ``MultiHeadAttention.forward(..., kv_cache=)`` and ``npattn.KVCache``.

Decoding a sequence token by token, or in chunks of 2-3 tokens, gives the
outputs of one causal forward over the whole sequence (to 1e-12 in float64),
with grouped-query attention, sinks, softcap, windows and ALiBi, and with
batch entries of different lengths (compared with a forward of each entry
alone). What is written into the cache is the projected keys and values.
Then the failures: a full cache, a cache that does not fit the module, the
options a cache does not take, a backward after decoding; each is named and
changes neither the module nor the cache.
"""

import copy
import pickle

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import npattn
from npattn import KVCache, MultiHeadAttention
from npattn import functional as F
from npattn import positions as Pos
from npattn.kvcache import unalign_columns

D, H, HKV = 8, 4, 2
DH = D // H
RTOL = ATOL = 1e-12


def _decoder(backend, **kw):
    kw = dict(dict(n_kv_head=HKV, dtype="float64", seed=11, backend=backend), **kw)
    return MultiHeadAttention(D, H, **kw)


def _with_sinks(m, to_xp, seed=0):
    if m.sinks:
        m.params["sinks"] = to_xp(np.random.default_rng(seed).standard_normal(H))
    return m


def _kv_heads(m, x, to_np):
    """The projected keys and values of ``x`` (B, L, D), split into heads: [B, Hkv, L, Dh] each."""
    P = {n: to_np(a) for n, a in m.params.items()}
    B, L, _ = x.shape

    def heads(y):
        return y.reshape(B, L, HKV, DH).transpose(0, 2, 1, 3)

    return heads(x @ P["w_k"].T + P["b_k"]), heads(x @ P["w_v"].T + P["b_v"])


def _state(cache, to_np):
    """Everything a failed call must leave as it was: the lengths and copies of both buffers
    (a ``to_np`` of ``np.asarray`` would hand back the NumPy buffers themselves)."""
    return cache.cache_seqlens.tolist(), np.array(to_np(cache.k)), np.array(to_np(cache.v))


def _assert_state(cache, state, to_np):
    lens, k, v = state
    assert cache.cache_seqlens.tolist() == lens
    np.testing.assert_array_equal(to_np(cache.k), k)
    np.testing.assert_array_equal(to_np(cache.v), v)


OPTIONS = {
    "plain": ({}, {}),
    "sinks and softcap": (dict(sinks=True, softcap=1.5), {}),
    "window": ({}, dict(window=(2, 0))),
    "alibi": (dict(sinks=True), "alibi"),
}


def _call_options(name, to_xp, B):
    ctor, call = OPTIONS[name]
    slopes = None
    if call == "alibi":
        slopes = np.random.default_rng(1).uniform(0.2, 1.0, (B, H))
        call = {}
    return ctor, call, slopes


# --------------------------------------------------------------------------
# equal lengths: one causal forward over the whole sequence


@pytest.mark.parametrize("chunks", [[1] * 6, [2, 3, 1], [3, 3]], ids=["1x6", "2-3-1", "3-3"])
@pytest.mark.parametrize("opt", list(OPTIONS))
def test_decoding_matches_one_causal_forward(backend, to_xp, to_np, chunks, opt):
    B, L = 2, sum(chunks)
    ctor, call, slopes = _call_options(opt, to_xp, B)
    if slopes is not None:
        call = dict(alibi_slopes=to_xp(slopes))
    m = _with_sinks(_decoder(backend, **ctor).eval(), to_xp)
    x = np.random.default_rng(2).standard_normal((B, L, D))
    xa = to_xp(x)
    full, _ = m(xa, xa, xa, is_causal=True, **call)
    cache = m.new_cache(B, 8)
    outs, t = [], 0
    for n in chunks:
        xt = to_xp(x[:, t : t + n])
        out, w = m(xt, xt, xt, kv_cache=cache, is_causal=True, **call)
        assert w is None and m.cache is None
        outs.append(to_np(out))
        t += n
        assert cache.cache_seqlens.tolist() == [t] * B
    np.testing.assert_allclose(np.concatenate(outs, axis=1), to_np(full), rtol=RTOL, atol=ATOL)
    k, v = _kv_heads(m, x, to_np)  # what was written: the projected keys and values, in order
    np.testing.assert_allclose(to_np(cache.k)[:, :, :L], k, rtol=1e-14, atol=1e-14)
    np.testing.assert_allclose(to_np(cache.v)[:, :, :L], v, rtol=1e-14, atol=1e-14)
    np.testing.assert_array_equal(to_np(cache.k)[:, :, L:], 0.0)  # nothing past the end


def test_one_token_steps_need_no_causal_flag(backend, to_xp, to_np):
    """A single new query sits after every cached key: causal or not, the same output."""
    m = _decoder(backend, sinks=True)
    x = np.random.default_rng(3).standard_normal((2, 4, D))
    full, _ = m(to_xp(x), to_xp(x), to_xp(x), is_causal=True)
    cache = m.new_cache(2, 4)
    outs = [to_np(m(*(to_xp(x[:, t : t + 1]),) * 3, kv_cache=cache)[0]) for t in range(4)]
    np.testing.assert_allclose(np.concatenate(outs, axis=1), to_np(full), rtol=RTOL, atol=ATOL)


# --------------------------------------------------------------------------
# per-batch lengths: each entry compared with a forward of that entry alone


@pytest.mark.parametrize("chunks", [[1, 1, 1, 1], [2, 1, 3]], ids=["1x4", "2-1-3"])
@pytest.mark.parametrize("opt", list(OPTIONS))
def test_ragged_lengths_match_each_entry_alone(backend, to_xp, to_np, chunks, opt):
    """Prompts of lengths 2, 5 and 3, prefilled right-padded to 5 and truncated, then
    decoded together: entry b's outputs are those of a causal forward of its own sequence."""
    prompts = [2, 5, 3]
    B, P, S = len(prompts), max(prompts), sum(chunks)
    ctor, call, slopes = _call_options(opt, to_xp, B)
    m = _with_sinks(_decoder(backend, **ctor), to_xp)
    rng = np.random.default_rng(4)
    x = rng.standard_normal((B, P, D))  # prompts, entry b's beyond prompts[b] is padding
    y = rng.standard_normal((B, S, D))  # the tokens decoded afterwards
    alibi = {} if slopes is None else dict(alibi_slopes=to_xp(slopes))

    cache = m.new_cache(B, P + S)
    out, _ = m(to_xp(x), to_xp(x), to_xp(x), kv_cache=cache, is_causal=True, **call, **alibi)
    prefill = to_np(out)
    cache.truncate(prompts)  # each entry's next token goes after its own prompt
    steps, weights, t = [], [], 0
    for n in chunks:
        yt = to_xp(y[:, t : t + n])
        out, w = m(yt, yt, yt, kv_cache=cache, is_causal=True, need_weights=True,
                   average_attn_weights=False, **call, **alibi)
        steps.append(to_np(out))
        weights.append((t, to_np(w)))
        t += n
    assert cache.cache_seqlens.tolist() == [p + S for p in prompts]
    decoded = np.concatenate(steps, axis=1)  # [B, S, D]

    for b, p in enumerate(prompts):
        seq = np.concatenate([x[b, :p], y[b]])[None]  # [1, p + S, D]
        alibi_b = {} if slopes is None else dict(alibi_slopes=to_xp(slopes[b : b + 1]))
        full, w_full = m(to_xp(seq), to_xp(seq), to_xp(seq), is_causal=True, need_weights=True,
                         average_attn_weights=False, **call, **alibi_b)
        full, w_full = to_np(full)[0], to_np(w_full)[0]  # [p + S, D], [H, p + S, p + S]
        np.testing.assert_allclose(prefill[b, :p], full[:p], rtol=RTOL, atol=ATOL)
        np.testing.assert_allclose(decoded[b], full[p:], rtol=RTOL, atol=ATOL, err_msg=f"entry {b}")
        for t0, w in weights:  # column j of the weights is position j of the entry
            n = w.shape[2]
            rows = w_full[:, p + t0 : p + t0 + n]  # [H, n, p + S]
            end = p + t0 + n
            np.testing.assert_allclose(w[b, :, :, :end], rows[:, :, :end], rtol=RTOL, atol=1e-14)
            assert np.all(w[b, :, :, end:] == 0.0)  # past the entry's end
        k, v = _kv_heads(m, seq, to_np)
        np.testing.assert_allclose(to_np(cache.k)[b, :, : p + S], k[0], rtol=1e-14, atol=1e-14)
        np.testing.assert_allclose(to_np(cache.v)[b, :, : p + S], v[0], rtol=1e-14, atol=1e-14)


@st.composite
def _decoding_cases(draw, numpy_kernel):
    """A module, its per-call options and a decoding schedule: ragged prompts of 1-4 tokens,
    then chunks of 1-3 new tokens, whose queries are all of them or the last one."""
    H = draw(st.sampled_from([2, 4]))
    impl = draw(st.sampled_from(["reference", "blocked", "dense"] + (["numpy"] if numpy_kernel else [])))
    rich = impl != "numpy"  # the NumPy kernel takes window and align, nothing else
    window = draw(st.none() | st.tuples(st.sampled_from([None, 0, 1, 3]), st.sampled_from([None, 0, 2])))
    B = draw(st.integers(1, 3))
    return dict(
        H=H, Hkv=draw(st.sampled_from([h for h in (1, 2, H) if H % h == 0])), Dh=draw(st.sampled_from([2, 3])),
        impl=impl, block=draw(st.sampled_from([None, 1, 2])),
        sinks=rich and draw(st.booleans()), softcap=draw(st.sampled_from([None, 0.7])) if rich else None,
        alibi=draw(st.sampled_from([None, "H", "BH"])) if rich else None, window=window,
        causal=draw(st.booleans()), prompts=draw(st.lists(st.integers(1, 4), min_size=B, max_size=B)),
        chunks=draw(st.lists(st.integers(1, 3), min_size=1, max_size=3)), last_query_only=draw(st.booleans()),
        seed=draw(st.integers(0, 2**16)),
    )


@given(data=st.data())
def test_decoding_with_any_options_equals_a_forward_of_each_entry_alone(backend, to_xp, to_np, data):
    """Ragged prompts prefilled right-padded and truncated, then chunks of 1-3 tokens (all
    their queries, or the last one only), any impl, GQA, sinks, softcap, ALiBi, a window of
    either or both sides, causal or not: at every step entry b's outputs are the last rows of
    a bottom-right forward over its own tokens so far, with the reference impl."""
    c = data.draw(_decoding_cases(numpy_kernel=backend == "numpy"))
    H, Hkv, Dh = c["H"], c["Hkv"], c["Dh"]
    kw = dict(n_kv_head=Hkv, dtype="float64", seed=c["seed"], backend=backend, sinks=c["sinks"],
              softcap=c["softcap"])
    m = MultiHeadAttention(H * Dh, H, impl=c["impl"], block_q=c["block"], block_k=c["block"], **kw).eval()
    ref = MultiHeadAttention(H * Dh, H, impl="reference", **kw).eval()
    rng = np.random.default_rng(c["seed"])
    if c["sinks"]:
        m.params["sinks"] = to_xp(rng.standard_normal(H))
    ref.params = m.params
    prompts, chunks = c["prompts"], c["chunks"]
    B, P, S = len(prompts), max(prompts), sum(chunks)
    x = rng.standard_normal((B, P, H * Dh))  # entry b's prompt is x[b, :prompts[b]]
    y = rng.standard_normal((B, S, H * Dh))  # the tokens decoded after it
    slopes = {None: None, "H": rng.uniform(0.1, 1.0, H), "BH": rng.uniform(0.1, 1.0, (B, H))}[c["alibi"]]

    def options(b=None):
        if slopes is None:
            return dict(window=c["window"])
        own = slopes if b is None or slopes.ndim == 1 else slopes[b:b + 1]
        return dict(window=c["window"], alibi_slopes=to_xp(own))

    cache = m.new_cache(B, P + S)
    prefill = to_np(m(*(to_xp(x),) * 3, kv_cache=cache, is_causal=True, **options())[0])
    cache.truncate(prompts)
    steps, t = [], 0
    for n in chunks:
        nq = 1 if c["last_query_only"] else n  # the queries: the last nq of the n new tokens
        new = to_xp(y[:, t:t + n])
        out, _ = m(to_xp(y[:, t + n - nq:t + n]), new, new, kv_cache=cache, is_causal=c["causal"],
                   **options())
        steps.append((t + n, nq, to_np(out)))
        t += n
    assert cache.cache_seqlens.tolist() == [p + S for p in prompts]
    for b, p in enumerate(prompts):
        seq = np.concatenate([x[b, :p], y[b]])[None]  # [1, p + S, D]
        full = to_np(ref(*(to_xp(seq),) * 3, is_causal=True, **options(b))[0])
        np.testing.assert_allclose(prefill[b, :p], full[0, :p], rtol=RTOL, atol=ATOL)
        for end, nq, out in steps:  # the tokens so far: p + end; the queries: their last nq
            so_far = to_xp(seq[:, : p + end])
            want, _ = ref(to_xp(seq[:, p + end - nq:p + end]), so_far, so_far, is_causal=c["causal"],
                          align="bottom_right", **options(b))
            np.testing.assert_allclose(out[b], to_np(want)[0], rtol=RTOL, atol=ATOL,
                                       err_msg=f"entry {b}, tokens {p + end}")


def kvcache_attention_by_hand(P, cached, new, query, *, H, Hkv, causal, window, slopes, softcap, sinks):
    """One entry's decoding step as ``flash_attn_with_kvcache`` defines it, in NumPy float64:
    the keys are the entry's cached tokens then the ``n`` new ones (``Lk = len(cached) + n``),
    query ``i`` stands at position ``Lk - Lq + i`` (bottom-right), ``causal`` keeps keys up to
    it, ``window = (left, right)`` keeps ``[pos - left, pos + right]`` (None unbounded), ALiBi
    adds ``-slope * |pos - j|`` after the softcap, and a sink is one more logit in the
    denominator with no value (gpt-oss). Returns the output [Lq, D] and the weights [H, Lq, Lk]."""
    seq = np.concatenate([cached, new])  # [Lk, D]
    Lq, Lk, Dh = len(query), len(seq), P["w_q"].shape[0] // H
    q = (query @ P["w_q"].T + P["b_q"]).reshape(Lq, H, Dh)
    k = (seq @ P["w_k"].T + P["b_k"]).reshape(Lk, Hkv, Dh)
    v = (seq @ P["w_v"].T + P["b_v"]).reshape(Lk, Hkv, Dh)
    pos = np.arange(Lq)[:, None] + Lk - Lq  # [Lq, 1]
    j = np.arange(Lk)[None, :]
    allowed = np.ones((Lq, Lk), dtype=bool)
    if causal:
        allowed &= j <= pos
    if window is not None and window[0] is not None:
        allowed &= j >= pos - window[0]
    if window is not None and window[1] is not None:
        allowed &= j <= pos + window[1]
    heads, weights = [], []
    for h in range(H):
        g = h // (H // Hkv)  # the K/V head of query head h
        s = q[:, h] @ k[:, g].T / np.sqrt(Dh)
        if softcap is not None:
            s = softcap * np.tanh(s / softcap)
        if slopes is not None:
            s = s - slopes[h] * np.abs(pos - j)
        e = np.where(allowed, np.exp(s), 0.0)  # the scores are small: no shift needed
        den = e.sum(axis=1, keepdims=True) + (0.0 if sinks is None else np.exp(sinks[h]))
        w = np.divide(e, den, out=np.zeros_like(e), where=den > 0)
        heads.append(w @ v[:, g])
        weights.append(w)
    o = np.concatenate(heads, axis=1)  # [Lq, H * Dh]
    return o @ P["w_o"].T + P["b_o"], np.stack(weights)


@given(data=st.data())
def test_ragged_decoding_matches_flash_attn_with_kvcache_by_hand(data):
    """Entries with 0-4 cached tokens each decode n = 1-3 new ones with Lq = 1-3 queries (not
    always n): each entry's output and per-head weights are ``kvcache_attention_by_hand`` on its
    own tokens, the weights' column j at position j and zero past the entry's end (reference
    impl; the blocked one keeps none). The tests
    above compare decoding with npattn's own forward; this one with the definition."""
    H = data.draw(st.sampled_from([2, 4]), label="H")
    Hkv = data.draw(st.sampled_from([h for h in (1, 2, H) if H % h == 0]), label="Hkv")
    Dh, B = 2, data.draw(st.integers(1, 3), label="B")
    lens = data.draw(st.lists(st.integers(0, 4), min_size=B, max_size=B), label="cached")
    n, Lq = data.draw(st.integers(1, 3), label="n"), data.draw(st.integers(1, 3), label="Lq")
    softcap = data.draw(st.sampled_from([None, 0.7]), label="softcap")
    sinks = data.draw(st.booleans(), label="sinks")
    causal = data.draw(st.booleans(), label="causal")
    window = data.draw(st.none() | st.tuples(st.sampled_from([None, 0, 1, 3]), st.sampled_from([None, 0, 2])),
                       label="window")
    alibi = data.draw(st.sampled_from([None, "H", "BH"]), label="alibi")
    impl = data.draw(st.sampled_from(["reference", "blocked"]), label="impl")
    seed = data.draw(st.integers(0, 2**16), label="seed")
    rng = np.random.default_rng(seed)
    m = MultiHeadAttention(H * Dh, H, n_kv_head=Hkv, dtype="float64", seed=seed, softcap=softcap,
                           sinks=sinks, impl=impl, block_q=2, block_k=2).eval()
    if sinks:
        m.params["sinks"] = rng.standard_normal(H)
    slopes = {None: None, "H": rng.uniform(0.1, 1.0, H), "BH": rng.uniform(0.1, 1.0, (B, H))}[alibi]
    x = rng.standard_normal((B, max(lens), H * Dh))  # entry b's cached tokens: x[b, :lens[b]]
    new, query = rng.standard_normal((B, n, H * Dh)), rng.standard_normal((B, Lq, H * Dh))
    cache = m.new_cache(B, max(lens) + n)
    if max(lens) > 0:
        m(x, x, x, kv_cache=cache)
        cache.truncate(lens)
    call = dict(is_causal=causal, window=window)
    if slopes is not None:
        call["alibi_slopes"] = slopes
    out, w = m(query, new, new, kv_cache=cache, need_weights=impl == "reference", average_attn_weights=False,
               **call)  # (the blocked path keeps no weights)
    P = {name: np.asarray(a) for name, a in m.params.items()}
    for b, length in enumerate(lens):
        own = None if slopes is None else (slopes if slopes.ndim == 1 else slopes[b])
        want, want_w = kvcache_attention_by_hand(P, x[b, :length], new[b], query[b], H=H, Hkv=Hkv,
                                                 causal=causal, window=window, slopes=own,
                                                 softcap=softcap, sinks=P.get("sinks"))
        end = length + n
        np.testing.assert_allclose(out[b], want, rtol=RTOL, atol=ATOL, err_msg=f"entry {b}")
        if w is not None:
            np.testing.assert_allclose(w[b, :, :, :end], want_w, rtol=RTOL, atol=1e-14, err_msg=f"entry {b}")
            assert np.all(w[b, :, :, end:] == 0.0)


@given(prompts=st.lists(st.integers(1, 4), min_size=1, max_size=3), went=st.integers(1, 3),
       data=st.data(), impl=st.sampled_from(["reference", "blocked", "numpy"]))
def test_a_cache_truncated_and_appended_again_equals_one_that_never_went_past(prompts, went, data, impl):
    """Decoding ``went`` tokens, truncating below them and appending others: the same outputs and
    cached keys as a cache truncated straight to those lengths (the stale rows past an
    entry's length are never read)."""
    B, P = len(prompts), max(prompts)
    back = [data.draw(st.integers(0, p), label=f"back[{b}]") for b, p in enumerate(prompts)]
    m = _decoder("numpy", impl=impl, block_k=2, sinks=impl != "numpy").eval()  # (the kernel takes none)
    rng = np.random.default_rng(sum(prompts) + went)
    if m.sinks:
        m.params["sinks"] = rng.standard_normal(H)
    x, past, y = (rng.standard_normal((B, n, D)) for n in (P, went, 3))
    went_past, fresh = m.new_cache(B, P + went + 3), m.new_cache(B, P + 3)
    m(x, x, x, kv_cache=went_past, is_causal=True)
    went_past.truncate(prompts)
    m(past, past, past, kv_cache=went_past, is_causal=True)
    went_past.truncate(back)
    m(x, x, x, kv_cache=fresh, is_causal=True)
    fresh.truncate(back)
    out, _ = m(y, y, y, kv_cache=went_past, is_causal=True)
    want, _ = m(y, y, y, kv_cache=fresh, is_causal=True)
    np.testing.assert_array_equal(out, want)
    assert went_past.cache_seqlens.tolist() == fresh.cache_seqlens.tolist() == [s + 3 for s in back]
    for b, s in enumerate(back):
        np.testing.assert_array_equal(went_past.k[b, :, : s + 3], fresh.k[b, :, : s + 3])
        np.testing.assert_array_equal(went_past.v[b, :, : s + 3], fresh.v[b, :, : s + 3])
    for b, p in enumerate(back):  # and a forward of the entry's own tokens
        seq = np.concatenate([x[b, :p], y[b]])[None]
        full, _ = m(seq, seq, seq, is_causal=True)
        np.testing.assert_allclose(out[b], full[0, p:], rtol=RTOL, atol=ATOL)


@given(interleaved=st.booleans(), base=st.sampled_from([10000.0, 100.0]), prompt=st.integers(1, 3),
       chunks=st.lists(st.integers(1, 3), min_size=1, max_size=3), gqa=st.booleans(),
       seed=st.integers(0, 2**16))
def test_rope_keys_cached_at_their_positions_decode_as_the_full_sequence(interleaved, base, prompt, chunks,
                                                                         gqa, seed):
    """RoPE with a KV cache: each chunk's queries and keys rotated with ``positions`` = the
    cached length, the rotated keys appended; the outputs are those of causal attention over
    the whole rotated sequence."""
    rng = np.random.default_rng(seed)
    B, Hq, Hkv, Dh, L = 2, 2, 1 if gqa else 2, 4, prompt + sum(chunks)
    q = rng.standard_normal((B, Hq, L, Dh))
    k, v = rng.standard_normal((B, Hkv, L, Dh)), rng.standard_normal((B, Hkv, L, Dh))
    rot = dict(base=base, interleaved=interleaved)
    full, _ = F.sdpa_forward(Pos.rope_forward(q, **rot)[0], Pos.rope_forward(k, **rot)[0], v,
                             is_causal=True, enable_gqa=gqa)
    cache = KVCache(B, L, Hkv, Dh, dtype="float64")
    outs, t = [], 0
    for n in [prompt] + chunks:
        qt, _ = Pos.rope_forward(q[:, :, t:t + n], t, **rot)
        kt, _ = Pos.rope_forward(k[:, :, t:t + n], t, **rot)
        view = cache.right_aligned(kt, v[:, :, t:t + n])
        out, _ = F.sdpa_forward(qt, view.k, view.v, is_causal=True, align="bottom_right", enable_gqa=gqa)
        cache.append(kt, v[:, :, t:t + n])
        outs.append(out)
        t += n
    np.testing.assert_allclose(np.concatenate(outs, axis=2), full, rtol=RTOL, atol=ATOL)


def _right_aligned_entries(old, new, lens, Lt):
    """Entry b of a right-aligned view, every head: Lt - (lens[b] + n) zero rows, then the
    entry's first lens[b] cached rows, then its n new ones."""
    B, H, n, X = new.shape
    return np.stack([np.concatenate([np.zeros((H, Lt - L - n, X)), old[b, :, :L], new[b]], axis=1)
                     for b, L in enumerate(lens)])  # [B, H, Lt, X]


def test_ragged_view_is_right_aligned(backend, xp, to_xp, to_np):
    """``right_aligned``: every entry's newest key in the last column, zero rows in front hidden
    by the key mask; ``unalign_columns`` puts columns back at the entries' positions. Two heads,
    and values of another width and other numbers than the keys: keys and values, and the heads,
    each stay in their own place."""
    cache = KVCache(3, 6, 2, 2, 3, dtype="float64", backend=backend)
    rng = np.random.default_rng(5)
    first_k, first_v = rng.standard_normal((3, 2, 4, 2)), rng.standard_normal((3, 2, 4, 3))
    cache.append(to_xp(first_k), to_xp(first_v))
    cache.truncate([1, 4, 0])
    new_k, new_v = rng.standard_normal((3, 2, 2, 2)), rng.standard_normal((3, 2, 2, 3))
    view = cache.right_aligned(to_xp(new_k), to_xp(new_v))
    assert view.shift == (3, 0, 4)  # Lt = 4 + 2
    k, v, mask = to_np(view.k), to_np(view.v), to_np(view.key_mask)
    assert k.shape == (3, 2, 6, 2) and v.shape == (3, 2, 6, 3) and mask.shape == (3, 1, 1, 6)
    np.testing.assert_array_equal(mask[:, 0, 0], np.arange(6)[None] >= np.array([[3], [0], [4]]))
    np.testing.assert_array_equal(k, _right_aligned_entries(first_k, new_k, [1, 4, 0], 6))
    np.testing.assert_array_equal(v, _right_aligned_entries(first_v, new_v, [1, 4, 0], 6))
    assert cache.cache_seqlens.tolist() == [1, 4, 0]  # the view changes nothing
    cols = to_xp(np.broadcast_to(np.arange(6.0), (3, 2, 6)).copy())
    back = to_np(unalign_columns(cols, view.shift))
    np.testing.assert_array_equal(back[0, 0], [3, 4, 5, 0, 0, 0])
    np.testing.assert_array_equal(back[1, 0], np.arange(6.0))
    np.testing.assert_array_equal(back[2, 0], [4, 5, 0, 0, 0, 0])


def test_ragged_view_when_the_first_entry_is_the_longest(backend, xp, to_xp, to_np):
    """Entry 0 unshifted does not make the lengths equal: entries 1 and 2 still get zero rows
    in front and a key mask, and none of the stale keys or values past their lengths; two heads,
    values of their own width and numbers."""
    cache = KVCache(3, 6, 2, 2, 3, dtype="float64", backend=backend)
    rng = np.random.default_rng(17)
    first_k, first_v = rng.standard_normal((3, 2, 4, 2)), rng.standard_normal((3, 2, 4, 3))
    cache.append(to_xp(first_k), to_xp(first_v))
    cache.truncate([4, 1, 0])
    new_k, new_v = rng.standard_normal((3, 2, 2, 2)), rng.standard_normal((3, 2, 2, 3))
    view = cache.right_aligned(to_xp(new_k), to_xp(new_v))
    assert view.shift == (0, 3, 4) and view.key_mask is not None  # Lt = 4 + 2
    k, v, mask = to_np(view.k), to_np(view.v), to_np(view.key_mask)
    np.testing.assert_array_equal(mask[:, 0, 0], np.arange(6)[None] >= np.array([[0], [3], [4]]))
    np.testing.assert_array_equal(k, _right_aligned_entries(first_k, new_k, [4, 1, 0], 6))
    np.testing.assert_array_equal(v, _right_aligned_entries(first_v, new_v, [4, 1, 0], 6))


# --------------------------------------------------------------------------
# failures: named, and nothing changes


def _decoding_setup(backend, to_xp, lens=(3, 1), capacity=4):
    # dropout 0.2 in eval mode (decoding runs without dropout): a failed call must keep the
    # generator's state as well as the cache's
    m = _decoder(backend, dropout=0.2).eval()
    cache = m.new_cache(len(lens), capacity)
    rng = np.random.default_rng(6)
    x = to_xp(rng.standard_normal((len(lens), max(lens), D)))
    m(x, x, x, kv_cache=cache, is_causal=True)
    cache.truncate(list(lens))
    return m, cache, rng


def _expect_unchanged(m, cache, call, exc, match, to_np):
    state = _state(cache, to_np)
    module_cache, rng_state, decoded = m.cache, m._rng.bit_generator.state, m._decoded
    with pytest.raises(exc, match=match):
        call()
    _assert_state(cache, state, to_np)
    assert m.cache is module_cache and m._rng.bit_generator.state == rng_state
    assert m._decoded == decoded


def test_a_full_cache_is_refused_before_anything_is_written(backend, to_xp, to_np):
    m, cache, rng = _decoding_setup(backend, to_xp)
    x2 = to_xp(rng.standard_normal((2, 2, D)))
    _expect_unchanged(m, cache, lambda: m(x2, x2, x2, kv_cache=cache, is_causal=True),
                      ValueError, r"kv_cache: .*entry 0 holds 3 of capacity 4", to_np)
    x1 = to_xp(rng.standard_normal((2, 1, D)))
    m(x1, x1, x1, kv_cache=cache)  # one more fits
    assert cache.cache_seqlens.tolist() == [4, 2]
    _expect_unchanged(m, cache, lambda: m(x1, x1, x1, kv_cache=cache), ValueError,
                      r"^kv_cache: expected room for 1 new position in every batch entry, but entry 0 "
                      r"holds 4 of capacity 4 \(4 \+ 1 = 5 > 4\); nothing was written$", to_np)
    k = to_xp(rng.standard_normal((2, HKV, 1, DH)))
    with pytest.raises(ValueError, match=r"^kv_cache: expected room for 1 new position .*, but entry 0 "
                       r"holds 4 of capacity 4 \(4 \+ 1 = 5 > 4\)"):  # append itself checks first too
        cache.append(k, k)
    assert cache.cache_seqlens.tolist() == [4, 2]


def test_a_cache_without_room_is_refused_before_the_projections(monkeypatch):
    """Room for fewer positions than the new tokens (entry 0 holds 3 of 4, two new tokens)
    is the cache's ValueError before step 1. projects anything, not after the forward."""
    m, cache, rng = _decoding_setup("numpy", np.asarray)
    x2 = rng.standard_normal((2, 2, D))
    calls = []
    linear = npattn.attention.linear_forward
    monkeypatch.setattr(npattn.attention, "linear_forward",
                        lambda *a, **kw: calls.append(1) or linear(*a, **kw))
    _expect_unchanged(m, cache, lambda: m(x2, x2, x2, kv_cache=cache, is_causal=True),
                      ValueError, r"kv_cache: expected room for 2 new positions", np.asarray)
    assert calls == []


def test_a_failure_inside_the_forward_leaves_the_cache(monkeypatch):
    """The cache is written only once the forward has succeeded: step 6. fails (memory, say)
    after the projections have run."""
    m, cache, rng = _decoding_setup("numpy", np.asarray, lens=(1, 1), capacity=6)
    x = rng.standard_normal((2, 2, D))

    def out_of_memory(*args, **kwargs):
        raise MemoryError("step 6.")

    monkeypatch.setattr(npattn.attention, "sdpa_forward", out_of_memory)
    _expect_unchanged(m, cache, lambda: m(x, x, x, kv_cache=cache, is_causal=True),
                      MemoryError, "step 6.", np.asarray)


def test_an_impl_that_cannot_run_the_call_is_refused_before_the_projections(monkeypatch):
    """impl="numpy" with ALiBi and a KV cache, impl="chunked" on NumPy arrays: the
    dispatcher's ValueError before step 1. projects anything (it came from inside step 6.)."""
    m, cache, rng = _decoding_setup("numpy", np.asarray, lens=(1, 1), capacity=6)
    x = rng.standard_normal((2, 2, D))
    calls = []
    linear = npattn.attention.linear_forward
    monkeypatch.setattr(npattn.attention, "linear_forward",
                        lambda *a, **kw: calls.append(1) or linear(*a, **kw))
    for kwargs, match in [(dict(impl="numpy", alibi_slopes=np.ones(H)), "impl='numpy'"),
                          (dict(impl="chunked"), "impl='chunked'")]:
        _expect_unchanged(m, cache, lambda: m(x, x, x, kv_cache=cache, is_causal=True, **kwargs),
                          ValueError, match, np.asarray)
        assert calls == []
    m(x, x, x, kv_cache=cache, is_causal=True, impl="numpy")  # the same call without them runs
    assert calls


def test_an_impl_is_judged_on_the_longest_entry(monkeypatch):
    """With lengths (0, 3) a one-token step attends Lt = 3 + 1 keys (the shortest entry alone
    would give 0 + 1): impl="numpy" on dask arrays is refused before step 1. projects anything,
    with k and v of 4 keys in its message; impl="chunked" runs the step (causal bottom-right,
    offset 3 for entry 1) and gives the NumPy module's output."""
    pytest.importorskip("dask")
    from npattn.backend import from_numpy, resolve_backend, to_numpy

    def to_dask(a):
        return from_numpy(a, resolve_backend("dask"))

    m, cache, rng = _decoding_setup("dask", to_dask, lens=(0, 3), capacity=6)
    m0, cache0, rng0 = _decoding_setup("numpy", np.asarray, lens=(0, 3), capacity=6)
    x0 = rng0.standard_normal((2, 1, D))
    x = to_dask(rng.standard_normal((2, 1, D)))
    calls = []
    linear = npattn.attention.linear_forward
    monkeypatch.setattr(npattn.attention, "linear_forward",
                        lambda *a, **kw: calls.append(1) or linear(*a, **kw))
    _expect_unchanged(m, cache, lambda: m(x, x, x, kv_cache=cache, is_causal=True, impl="numpy"),
                      ValueError, r"^impl='numpy': .*got dask\.array\.core\.Array of shapes "
                      r"\(2, 4, 1, 2\), \(2, 2, 4, 2\), \(2, 2, 4, 2\); use impl='chunked', "
                      r"'reference' or 'blocked'$", to_numpy)
    assert calls == []
    out, _ = m(x, x, x, kv_cache=cache, is_causal=True, impl="chunked")
    out0, _ = m0(x0, x0, x0, kv_cache=cache0, is_causal=True)
    np.testing.assert_allclose(to_numpy(out), out0, rtol=1e-12, atol=1e-12)
    assert calls and cache.cache_seqlens.tolist() == [1, 4]


def test_decoding_in_training_mode_with_dropout_says_call_eval(backend, to_xp, to_np):
    """As the blocks and GPT refuse it: decoding is forward only, without dropout. The module,
    its generator and the cache are unchanged; after eval() the same call decodes."""
    m = _decoder(backend, dropout=0.5)
    cache = m.new_cache(2, 4)
    x = to_xp(np.random.default_rng(9).standard_normal((2, 1, D)))
    _expect_unchanged(m, cache, lambda: m(x, x, x, kv_cache=cache), ValueError,
                      r"kv_cache: decoding is forward only.*call eval\(\).*dropout 0.5", to_np)
    m.eval()
    m(x, x, x, kv_cache=cache)
    assert to_np(cache.cache_seqlens).tolist() == [1, 1]


def test_backward_after_decoding_is_an_error(backend, to_xp):
    m = _decoder(backend)
    x = to_xp(np.random.default_rng(7).standard_normal((2, 3, D)))
    dout = to_xp(np.random.default_rng(8).standard_normal((2, 3, D)))
    m(x, x, x)
    m.backward(dout)  # a plain forward differentiates
    m(x, x, x, kv_cache=m.new_cache(2, 3))
    assert m.cache is None
    with pytest.raises(RuntimeError, match="kv_cache"):
        m.backward(dout)
    with m.preserve_state():  # a plain forward on the side: the decoding is the last one again
        m(x, x, x)
    with pytest.raises(RuntimeError, match="the last forward used kv_cache"):
        m.backward(dout)
    m(x, x, x)
    m.backward(dout)  # and again after a plain forward


def test_assigning_back_the_cache_read_after_decoding_changes_nothing(backend, to_xp):
    """``m.cache = m.cache`` after a decoding forward, as a block puts its attention modules
    back when a forward fails: backward still says that the last forward decoded. Assigning
    None made it 'expected a forward call first', as if the module had never run."""
    m = _decoder(backend)
    x = to_xp(np.random.default_rng(7).standard_normal((2, 3, D)))
    dout = to_xp(np.random.default_rng(8).standard_normal((2, 3, D)))
    m(x, x, x)
    held = m.cache
    m(x, x, x, kv_cache=m.new_cache(2, 3))
    m.cache = m.cache
    with pytest.raises(RuntimeError, match="the last forward used kv_cache"):
        m.backward(dout)
    m.cache = held  # a forward's cache assigned back is differentiated, decoded or not since
    m.backward(dout)


def test_a_cache_assigned_or_cleared_after_decoding_ends_the_decoded_state(backend, to_xp):
    """After decoding, assigning a plain forward's cache makes that forward the last one, and
    ``clear_cache`` drops everything: either way ``forward_state`` no longer reports a decoded
    forward, and once there is no cache backward asks for a forward instead of saying that
    the last forward decoded."""
    m = _decoder(backend)
    x = to_xp(np.random.default_rng(7).standard_normal((2, 3, D)))
    dout = to_xp(np.random.default_rng(8).standard_normal((2, 3, D)))
    for how in ("assigned", "cleared"):
        m(x, x, x)
        held = m.cache
        m(x, x, x, kv_cache=m.new_cache(2, 3))
        assert m.forward_state().decoded
        if how == "assigned":
            m.cache = held
            assert not m.forward_state().decoded and m.forward_state().cache is held
            m.cache = None
        else:
            m.clear_cache()
        assert not m.forward_state().decoded, how
        with pytest.raises(RuntimeError, match="^backward: expected a forward call first"):
            m.backward(dout)


def test_new_cache_fits_the_module(backend, xp, to_xp, to_np):
    """``new_cache`` makes the cache the module's forward takes: its batch size and capacity,
    the module's key/value heads and head width, and the parameters' dtype (a float32 module,
    not the float64 of the tests above)."""
    m = _decoder(backend, dtype="float32").eval()
    cache = m.new_cache(3, 7)
    assert (cache.batch_size, cache.capacity, cache.num_kv_heads, cache.head_dim,
            cache.value_dim) == (3, 7, HKV, DH, DH)
    assert cache.dtype == m.dtype == xp.float32 and cache.k.dtype == xp.float32
    x = to_xp(np.random.default_rng(2).standard_normal((3, 2, D)).astype(np.float32))
    out, _ = m(x, x, x, is_causal=True, kv_cache=cache)
    assert out.dtype == xp.float32 and cache.cache_seqlens.tolist() == [2, 2, 2]


def test_caches_that_do_not_fit_the_module(backend, xp, to_xp, to_np):
    m, cache, rng = _decoding_setup(backend, to_xp, lens=(1, 1), capacity=6)
    x = to_xp(rng.standard_normal((2, 1, D)))
    other = "numpy" if backend != "numpy" else "array_api_strict"
    cases = [
        ("not a cache", TypeError, "kv_cache: expected an npattn.KVCache"),
        (KVCache(2, 6, HKV, DH, dtype="float32", backend=backend), TypeError,
         "kv_cache: expected dtype float64"),
        (KVCache(2, 6, H, DH, dtype="float64", backend=backend), ValueError,
         "kv_cache: expected batch_size=2, num_kv_heads=2"),
        (KVCache(3, 6, HKV, DH, dtype="float64", backend=backend), ValueError, "batch_size=2"),
        (KVCache(2, 6, HKV, DH, 3, dtype="float64", backend=backend), ValueError, "value_dim=2"),
        (KVCache(2, 6, HKV, 3, DH, dtype="float64", backend=backend), ValueError, "head_dim=2"),
        (KVCache(2, 6, HKV, DH, dtype="float64", backend=other), TypeError,
         "kv_cache: expected a cache of the module's backend"),
    ]
    for bad, exc, match in cases:
        _expect_unchanged(m, cache, lambda: m(x, x, x, kv_cache=bad), exc, match, to_np)


def test_options_a_cache_does_not_take(backend, to_xp, to_np):
    m, cache, rng = _decoding_setup(backend, to_xp, lens=(1, 1), capacity=6)
    x = to_xp(rng.standard_normal((2, 2, D)))
    seg = to_xp(np.zeros((2, 2), dtype=np.int64))
    cases = [
        (dict(mask=to_xp(np.ones((2, 2), dtype=bool))), "mask"),
        (dict(dropout_mask=to_xp(np.ones((2, H, 2, 2), dtype=bool))), "dropout_mask"),
        (dict(q_segments=seg, k_segments=seg), "q_segments"),
        (dict(align="top_left"), "align"),
        (dict(window=(-1, 0)), r"window\[0\]"),
    ]
    for kwargs, name in cases:
        _expect_unchanged(m, cache, lambda: m(x, x, x, kv_cache=cache, **kwargs), ValueError,
                          f"^{name}", to_np)
    out, _ = m(x, x, x, kv_cache=cache, align="bottom_right", is_causal=True)  # said explicitly
    assert cache.cache_seqlens.tolist() == [3, 3]
    m2 = _decoder(backend, add_zero_attn=True)
    with pytest.raises(ValueError, match="^kv_cache: .*add_zero_attn"):
        m2(x, x, x, kv_cache=m2.new_cache(2, 4))


# --------------------------------------------------------------------------
# KVCache on its own


def test_kvcache_layout_and_appends(backend, xp, to_xp, to_np):
    cache = KVCache(2, 5, 3, 4, value_dim=2, dtype="float64", backend=backend)
    assert npattn.KVCache is KVCache
    assert tuple(cache.k.shape) == (2, 3, 5, 4) and tuple(cache.v.shape) == (2, 3, 5, 2)
    assert cache.k.dtype == xp.float64 and cache.cache_seqlens.dtype == np.int64
    assert cache.cache_seqlens.tolist() == [0, 0]
    assert not to_np(cache.k).any() and not to_np(cache.v).any()  # zeros where nothing was written
    rng = np.random.default_rng(9)
    k1, v1 = rng.standard_normal((2, 3, 2, 4)), rng.standard_normal((2, 3, 2, 2))
    cache.append(to_xp(k1), to_xp(v1))
    cache.truncate([1, 2])
    k2, v2 = rng.standard_normal((2, 3, 2, 4)), rng.standard_normal((2, 3, 2, 2))
    cache.append(to_xp(k2), to_xp(v2))  # each entry at its own length
    assert cache.cache_seqlens.tolist() == [3, 4]
    K, Vv = to_np(cache.k), to_np(cache.v)
    np.testing.assert_array_equal(K[0, :, :3], np.concatenate([k1[0, :, :1], k2[0]], axis=1))
    np.testing.assert_array_equal(K[1, :, :4], np.concatenate([k1[1], k2[1]], axis=1))
    np.testing.assert_array_equal(Vv[1, :, :4], np.concatenate([v1[1], v2[1]], axis=1))
    for b, L in enumerate([3, 4]):  # zeros past each entry's length, never written
        assert not K[b, :, L:].any() and not Vv[b, :, L:].any()
    lens = cache.cache_seqlens
    lens[0] = 0  # a copy
    assert cache.cache_seqlens.tolist() == [3, 4]
    assert repr(cache) == (f"KVCache(batch_size=2, capacity=5, num_kv_heads=3, head_dim=4, "
                           f"value_dim=2, dtype='float64', backend={backend!r}, cache_seqlens=[3, 4])")
    cache.truncate(np.array([2, 4]))
    assert cache.cache_seqlens.tolist() == [2, 4]
    cache.truncate(range(1, 3))  # a range is a sequence of ints, as masks.padding reads one
    assert cache.cache_seqlens.tolist() == [1, 2]
    cache.truncate(1)  # one int: every entry
    assert cache.cache_seqlens.tolist() == [1, 1]
    cache.reset()
    assert cache.cache_seqlens.tolist() == [0, 0]


def test_append_writes_each_entry_at_its_own_length(backend, xp, to_xp, to_np):
    """Lengths [1, 3, 1]: the first and last entries agree and the middle one does not; each
    entry's new position lands at its own length."""
    cache = KVCache(3, 5, 1, 2, dtype="float64", backend=backend)
    k1 = np.arange(18.0).reshape(3, 1, 3, 2)
    cache.append(to_xp(k1), to_xp(-k1))
    cache.truncate([1, 3, 1])
    k2 = 100.0 + np.arange(6.0).reshape(3, 1, 1, 2)
    cache.append(to_xp(k2), to_xp(-k2))
    assert cache.cache_seqlens.tolist() == [2, 4, 2]
    K, Vv = to_np(cache.k), to_np(cache.v)
    for b, L in enumerate([1, 3, 1]):
        want = np.concatenate([k1[b, :, :L], k2[b]], axis=1)  # [1, L + 1, 2]
        np.testing.assert_array_equal(K[b, :, :L + 1], want)
        np.testing.assert_array_equal(Vv[b, :, :L + 1], -want)


@pytest.mark.parametrize("lens", [[2, 2], [1, 3]], ids=["equal", "ragged"])
def test_new_keys_that_are_views_of_the_cache_itself_are_written_as_they_were(backend, xp, to_xp, to_np, lens):
    """New keys and values read from the cache's own key buffer, overlapping the positions
    the keys are written to: each entry gets what the views held before the call, as a copy
    would give. torch refused the write from overlapping memory with a RuntimeError naming
    nothing; a view of the keys as the values would also have read the keys just written."""
    cache = KVCache(2, 8, 1, 2, dtype="float64", backend=backend)
    k1 = np.arange(16.0).reshape(2, 1, 4, 2)
    cache.append(to_xp(k1), to_xp(-k1))
    cache.truncate(lens)
    # [2, 1, 3, 2] views of the key buffer: k_new overlaps the keys' destination, v_new the
    # keys' destination too, which is written before the values
    k_new, v_new = cache.k[:, :, 1:4, :], cache.k[:, :, 0:3, :]
    want_k, want_v = to_np(k_new).copy(), to_np(v_new).copy()  # what they hold before the call
    K0, V0 = to_np(cache.k).copy(), to_np(cache.v).copy()
    cache.append(k_new, v_new)
    assert cache.cache_seqlens.tolist() == [L + 3 for L in lens]
    K, Vv = to_np(cache.k), to_np(cache.v)
    for b, L in enumerate(lens):
        np.testing.assert_array_equal(K[b, :, :L], K0[b, :, :L])  # the entry's old keys stay
        np.testing.assert_array_equal(Vv[b, :, :L], V0[b, :, :L])
        np.testing.assert_array_equal(K[b, :, L:L + 3], want_k[b])
        np.testing.assert_array_equal(Vv[b, :, L:L + 3], want_v[b])


def test_new_keys_that_are_a_view_of_the_value_buffer_are_written_as_they_were(backend, xp, to_xp, to_np):
    """New keys read from the cache's value buffer, both entries from entry 0's values
    (broadcast along the batch), entries of different lengths: entry 0's values are written
    before entry 1's keys are read, so the keys must be read first. Each entry gets what the
    view held before the call, as a copy would give; copying only views of the key buffer
    wrote entry 0's new values into entry 1's keys."""
    cache = KVCache(2, 8, 1, 2, dtype="float64", backend=backend)
    k1 = np.arange(16.0).reshape(2, 1, 4, 2)
    cache.append(to_xp(k1), to_xp(-k1))
    cache.truncate([1, 3])
    k_new = xp.broadcast_to(cache.v[0:1, :, 0:3, :], (2, 1, 3, 2))  # [2, 1, 3, 2]: entry 0's values
    v_new = to_xp(100.0 + np.arange(12.0).reshape(2, 1, 3, 2))
    want_k, want_v = to_np(k_new).copy(), to_np(v_new).copy()
    assert (want_k[1] == -k1[0, :, 0:3]).all()  # the values appended above, before the call
    cache.append(k_new, v_new)
    K, Vv = to_np(cache.k), to_np(cache.v)
    for b, L in enumerate([1, 3]):
        np.testing.assert_array_equal(K[b, :, L:L + 3], want_k[b])
        np.testing.assert_array_equal(Vv[b, :, L:L + 3], want_v[b])


@pytest.mark.parametrize("args, kwargs, exc, match", [
    ((0, 4, 1, 2), {}, ValueError, "^batch_size: expected a positive int, got 0$"),
    ((1, True, 1, 2), {}, TypeError, "^capacity: expected a positive int, got bool True$"),
    ((1, 4, 1.0, 2), {}, TypeError, "^num_kv_heads: expected a positive int, got float 1.0$"),
    ((1, 4, 1, -2), {}, ValueError, "^head_dim: expected a positive int, got -2$"),
    ((1, 4, 1, 2, 0), {}, ValueError, "^value_dim: expected a positive int, got 0$"),
    ((1, 4, 1, 2), dict(dtype="int32"), ValueError,
     r"^dtype: expected one of \['float16', 'float32', 'float64'\] for backend 'numpy', got 'int32'$"),
    ((1, 4, 1, 2), dict(dtype=None), TypeError,
     r"^dtype: expected one of \['float16', 'float32', 'float64'\] \(a name or a dtype\), got None$"),
    ((1, 4, 1, 2), dict(backend="nope"), ValueError,
     r"^backend: expected one of \[.*'numpy'.*\], got 'nope'$"),
    # a buffer larger than the largest array (sys.maxsize bytes): NumPy's own messages named nothing
    ((1, 2**70, 1, 2), {}, ValueError, r"^batch_size, num_kv_heads, capacity and head_dim: expected "
     r"sizes for which the key buffer, "
     r"an array of shape \(1, 1, 1180591620717411303424, 2\) \(4 bytes an entry\)"),
    ((1, 2**60, 1, 4), {}, ValueError, r"^batch_size, .*key buffer, .*got 18446744073709551616 bytes$"),
    # 2**61 float32 entries are 2**63 bytes, one too many (fewer than 2**62 entries was let through)
    ((1, 2**61, 1, 1), {}, ValueError, r"^batch_size, .*key buffer, .*got 9223372036854775808 bytes$"),
    ((1, 2**59, 1, 2), dict(dtype="float64"), ValueError, r"key buffer, .*\(8 bytes an entry\)"),
    ((1, 4, 1, 2**70), {}, ValueError, r"^batch_size, num_kv_heads, capacity and head_dim: .*key buffer"),
    ((1, 4, 1, 2, 2**70), {}, ValueError, r"^batch_size, num_kv_heads, capacity and value_dim: .*value "),
    ((1, 4, 1, 2), dict(device="cuda"), ValueError, r"^device: expected a device of the numpy backend, got 'cuda'"),
])
def test_kvcache_bad_construction(args, kwargs, exc, match):
    kwargs = dict(dict(dtype="float32"), **kwargs)
    with pytest.raises(exc, match=match):
        KVCache(*args, **kwargs)


def test_check_room_and_unalign_columns_check_their_arguments():
    cache = KVCache(2, 5, 1, 2, dtype="float32")
    for n, exc in ((None, TypeError), (1.5, TypeError), (True, TypeError), (-5, ValueError)):
        with pytest.raises(exc, match=r"^n: expected an int >= 0, got"):  # (-5 was accepted)
            cache.check_room(n)
    cache.check_room(5)
    # NumPy ints are counted as ints: 3 + np.uint8(255) wrapped to 2 in uint8 and passed
    cache.append(np.ones((2, 1, 3, 2), np.float32), np.ones((2, 1, 3, 2), np.float32))
    for n in (np.uint8(255), np.int64(2**63 - 1), np.uint64(2**64 - 1)):
        with pytest.raises(ValueError, match=rf"^kv_cache: .* entry 0 holds 3 of capacity 5 "
                                             rf"\(3 \+ {int(n)} = {3 + int(n)} > 5\)"):
            cache.check_room(n)
    cache.check_room(np.uint8(2))
    for name in (None, 5, b"kv"):  # (taken, and put at the head of the message: "5: expected room")
        with pytest.raises(TypeError, match=r"^name: expected a str .*, got"):
            cache.check_room(1, name=name)
        with pytest.raises(TypeError, match=r"^name: expected a str"):
            cache.check_room(3, name=name)  # no room either: the name is checked first
    with pytest.raises(ValueError, match=r"^kv_caches\[0\]: expected room for 3"):
        cache.check_room(3, name="kv_caches[0]")
    x = np.arange(12.0).reshape(2, 1, 6)
    bad = [((1,), ValueError, r"^shift: expected 2 ints \(x's batch\), got 1"),  # a batch of 1 came back
           (None, TypeError, r"^shift: expected a sequence of 2 ints, got None"),
           ("ab", TypeError, r"^shift: expected a sequence of 2 ints, got str"),
           ((1, -1), ValueError, r"^shift\[1\]: expected an int >= 0, got -1"),
           ((1, 7), ValueError, r"^shift\[1\]: expected an int in \[0, Lt=6\], got 7")]
    for shift, exc, match in bad:
        with pytest.raises(exc, match=match):
            unalign_columns(x, shift)
    with pytest.raises(ValueError, match=r"^x: expected shape \(B, ..., Lt\), at least 2-D"):
        unalign_columns(np.ones(3), (1, 0, 0))  # (an IndexError from inside)
    np.testing.assert_array_equal(unalign_columns(x, np.array([2, 0])),
                                  [[[2.0, 3, 4, 5, 0, 0]], [[6.0, 7, 8, 9, 10, 11]]])
    np.testing.assert_array_equal(unalign_columns(x, (1, 3)),  # one column freed, and three
                                  [[[1.0, 2, 3, 4, 5, 0]], [[9.0, 10, 11, 0, 0, 0]]])
    np.testing.assert_array_equal(unalign_columns(x, (6, 0)),  # shift = Lt: [0, Lt] is allowed
                                  [[[0.0] * 6], [[6.0, 7, 8, 9, 10, 11]]])
    np.testing.assert_array_equal(unalign_columns(x, (0, 0)),  # nothing shifted: x as it is
                                  [[[0.0, 1, 2, 3, 4, 5]], [[6.0, 7, 8, 9, 10, 11]]])


def test_kvcache_bad_appends_and_truncates(backend, xp, to_xp, to_np):
    cache = KVCache(2, 4, 1, 2, dtype="float64", backend=backend)
    cache.append(to_xp(np.ones((2, 1, 2, 2))), to_xp(np.ones((2, 1, 2, 2))))
    good = np.zeros((2, 1, 1, 2))
    bad_appends = [
        ((np.zeros((2, 1, 1, 3)), good), ValueError,
         r"^k_new: expected shape \(B, Hkv, n, Dh\) = \(2, 1, n, 2\), got \(2, 1, 1, 3\)$"),
        ((good, np.zeros((2, 2, 1, 2))), ValueError,
         r"^v_new: expected shape \(B, Hkv, n, Dv\) = \(2, 1, n, 2\), got \(2, 2, 1, 2\)$"),
        # three axes, and five: the new positions' axis is the third of four
        ((np.zeros((2, 1, 2)), good), ValueError,
         r"^k_new: expected shape \(B, Hkv, n, Dh\) = \(2, 1, n, 2\), got \(2, 1, 2\)$"),
        ((good, np.zeros((2, 1, 1, 2, 1))), ValueError, r"^v_new: expected shape .*, got \(2, 1, 1, 2, 1\)$"),
        # a batch of 1 would broadcast over the cache's 2 in a slice assignment
        ((np.zeros((1, 1, 1, 2)),) * 2, ValueError,
         r"^k_new: expected shape \(B, Hkv, n, Dh\) = \(2, 1, n, 2\), got \(1, 1, 1, 2\)$"),
        ((np.zeros((2, 1, 0, 2)), np.zeros((2, 1, 0, 2))), ValueError,
         "^k_new: expected at least 1 new position, got 0$"),
        ((good, np.zeros((2, 1, 2, 2))), ValueError,
         r"^v_new: expected 1 position \(those of k_new\), got shape \(2, 1, 2, 2\)$"),
        ((good.astype(np.float32), good), TypeError,
         r"^k_new: expected dtype float64 \(that of the cache\), got float32 .*$"),
        ((np.zeros((2, 1, 3, 2)),) * 2, ValueError,
         r"^kv_cache: expected room for 3 new positions .*, but entry 0 holds 2 of capacity 4 "
         r"\(2 \+ 3 = 5 > 4\); nothing was written$"),
    ]
    for (k, v), exc, match in bad_appends:
        for method in (cache.append, cache.right_aligned):  # the view checks what append does
            state = _state(cache, to_np)
            with pytest.raises(exc, match=match):
                method(to_xp(k), to_xp(v))
            _assert_state(cache, state, to_np)
    with pytest.raises(TypeError, match=r"^k_new: expected an? \S+ array, got list$"):
        cache.append(good.tolist(), good)
    if backend != "numpy":  # keys of another library are refused by name, not copied in
        state = _state(cache, to_np)
        with pytest.raises(TypeError, match=r"^k_new: expected an? \S+ array \(that of the cache\), got a numpy array"):
            cache.append(good, good)
        _assert_state(cache, state, to_np)
    bad_truncates = [
        ([1, 3], ValueError,
         r"^seqlens\[1\]: expected at most 2 \(entry 1's length; truncate cannot lengthen\), got 3$"),
        ([1], ValueError, r"^seqlens: expected 2 lengths \(one per batch entry\), got 1$"),
        ([-1, 0], ValueError, r"^seqlens\[0\]: expected an int >= 0, got -1$"),
        ([1.0, 0], TypeError, r"^seqlens\[0\]: expected an int >= 0, got float 1\.0$"),
        (True, TypeError, r"^seqlens: expected an int or 2 ints .*, got bool$"),  # not a length of 1
        ("1", TypeError, r"^seqlens: expected an int or 2 ints .*, got str$"),
        (np.zeros((2, 1), dtype=int), TypeError,
         r"^seqlens: expected an int or 2 ints .*, got numpy\.ndarray of shape \(2, 1\)$"),
        ({1, 2}, TypeError, r"^seqlens: expected an int or 2 ints .*, got set$"),  # a set has no order
    ]
    for seqlens, exc, match in bad_truncates:
        with pytest.raises(exc, match=match):
            cache.truncate(seqlens)
        assert cache.cache_seqlens.tolist() == [2, 2]
    # every entry needs room, not only the first: entry 0 has room for 3 more, entry 1 does not
    cache.truncate([0, 2])
    three = to_xp(np.zeros((2, 1, 3, 2)))
    for method in (cache.append, cache.right_aligned):
        state = _state(cache, to_np)
        with pytest.raises(ValueError, match=r"^kv_cache: .* entry 1 holds 2 of capacity 4 \(2 \+ 3 = 5 > 4\)"):
            method(three, three)
        _assert_state(cache, state, to_np)


def test_equal_lengths_view_is_a_concatenation_without_key_mask(backend, to_xp, to_np):
    """Equal lengths shift nothing: the view is the cached keys followed by the new ones, and
    ``key_mask`` is None (as documented), so the module adds no mask."""
    cache = KVCache(2, 5, 1, 2, dtype="float64", backend=backend)
    rng = np.random.default_rng(23)
    first, new = rng.standard_normal((2, 1, 2, 2)), rng.standard_normal((2, 1, 1, 2))
    cache.append(to_xp(first), to_xp(first))
    view = cache.right_aligned(to_xp(new), to_xp(2.0 * new))
    assert view.shift == (0, 0) and view.key_mask is None
    np.testing.assert_array_equal(to_np(view.k), np.concatenate([first, new], axis=2))
    np.testing.assert_array_equal(to_np(view.v), np.concatenate([first, 2.0 * new], axis=2))


def test_ragged_views_keep_the_cache_dtype(backend, xp, to_xp, to_np):
    """The zero rows in front of a shorter entry (``right_aligned``) and the zero columns
    ``unalign_columns`` frees are of the cache's dtype: a float32 cache's view and weights
    stay float32 (zeros of the library's default dtype would promote them)."""
    cache = KVCache(2, 5, 1, 2, dtype="float32", backend=backend)
    ones = to_xp(np.ones((2, 1, 3, 2), np.float32))
    cache.append(ones, ones)
    cache.truncate([1, 3])
    new = to_xp(np.full((2, 1, 1, 2), 2.0, np.float32))
    view = cache.right_aligned(new, new)
    assert view.shift == (2, 0)
    assert view.k.dtype == view.v.dtype == xp.float32
    np.testing.assert_array_equal(to_np(view.k)[0, 0], [[0, 0], [0, 0], [1, 1], [2, 2]])
    w = to_xp(np.arange(8, dtype=np.float32).reshape(2, 1, 4))
    back = unalign_columns(w, view.shift)
    assert back.dtype == xp.float32
    np.testing.assert_array_equal(to_np(back)[:, 0], [[2, 3, 0, 0], [4, 5, 6, 7]])


@pytest.fixture
def jax_x64():
    """JAX (immutable arrays) with float64 for one test."""
    jax = pytest.importorskip("jax", reason="the jax backend needs JAX: pip install '.[jax]'")
    previous = jax.config.jax_enable_x64
    jax.config.update("jax_enable_x64", True)
    yield jax
    jax.config.update("jax_enable_x64", previous)


@pytest.mark.parametrize("ragged", [False, True])
def test_kvcache_on_immutable_arrays_makes_new_buffers(jax_x64, ragged):
    """JAX's arrays refuse slice assignment: each append makes new buffers with the same
    contents as NumPy's in-place writes, and a buffer read before the append keeps its
    contents. Ragged: lengths [1, 3, 1], whose first and last entries agree and middle one
    does not, so each entry must be written at its own length."""
    jnp = jax_x64.numpy
    rng = np.random.default_rng(5)
    frozen = KVCache(3, 7, 2, 3, value_dim=4, dtype="float64", backend="jax")
    plain = KVCache(3, 7, 2, 3, value_dim=4, dtype="float64")
    for n in (3, 2, 1):
        k_new, v_new = rng.standard_normal((3, 2, n, 3)), rng.standard_normal((3, 2, n, 4))
        before = frozen.k
        snapshot = np.asarray(before).copy()
        frozen.append(jnp.asarray(k_new), jnp.asarray(v_new))
        plain.append(k_new, v_new)
        np.testing.assert_array_equal(np.asarray(before), snapshot)
        np.testing.assert_array_equal(np.asarray(frozen.k), plain.k)
        np.testing.assert_array_equal(np.asarray(frozen.v), plain.v)
        if ragged and n == 3:
            for c in (frozen, plain):
                c.truncate([1, 3, 1])
    assert frozen.cache_seqlens.tolist() == plain.cache_seqlens.tolist() == ([4, 6, 4] if ragged
                                                                             else [6, 6, 6])


def test_generate_on_jax_equals_numpy(jax_x64):
    """GPT.generate keeps one KVCache per block: on JAX the same tokens and logits as on
    NumPy."""
    from npattn.gpt import GPT

    ids = np.array([[1, 2, 3], [4, 5, 6]])
    ref = GPT(11, 8, 8, 1, 2, dtype="float64", seed=0)
    on_jax = GPT(11, 8, 8, 1, 2, dtype="float64", seed=0, backend="jax")
    want, want_logits = ref.generate(ids, 4, seed=3, return_logits=True)
    got, logits = on_jax.generate(jax_x64.numpy.asarray(ids), 4, seed=3, return_logits=True)
    assert isinstance(got, jax_x64.Array)
    np.testing.assert_array_equal(np.asarray(got), want)
    np.testing.assert_allclose(np.asarray(logits), want_logits, rtol=1e-12, atol=1e-12)


def test_kvcache_on_a_device_torch_lacks():
    """torch without CUDA raises AssertionError for device='cuda': named as device."""
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("this torch has CUDA")
    with pytest.raises(ValueError, match="^device: expected a device of the torch backend, got 'cuda'"):
        KVCache(1, 4, 1, 4, dtype="float32", backend="torch", device="cuda")


def test_persist_keeps_a_dask_cache_from_growing_a_step_per_token():
    """On dask each append adds to the buffers' graph; persist computes them and keeps the
    results, so a graph read after n appends is as small as after one (the contents kept)."""
    da = pytest.importorskip("dask.array", reason="needs dask: pip install '.[dask]'")
    rng = np.random.default_rng(5)
    lazy = KVCache(2, 12, 2, 3, value_dim=4, dtype="float64", backend="dask")
    host = KVCache(2, 12, 2, 3, value_dim=4, dtype="float64")
    grown, kept = [], []
    for t in range(6):
        k, v = rng.standard_normal((2, 2, 1 + t % 2, 3)), rng.standard_normal((2, 2, 1 + t % 2, 4))
        lazy.append(da.from_array(k), da.from_array(v))
        host.append(k, v)
        grown.append(len(lazy.k.__dask_graph__()))
        lazy.persist()
        kept.append(len(lazy.k.__dask_graph__()))
    assert grown[-1] == grown[1] and len(set(kept)) == 1, (grown, kept)
    np.testing.assert_array_equal(lazy.k.compute(), host.k)
    np.testing.assert_array_equal(lazy.v.compute(), host.v)
    assert lazy.cache_seqlens.tolist() == host.cache_seqlens.tolist()
    before = host.k
    host.persist()  # NumPy: nothing to do
    assert host.k is before


# --------------------------------------------------------------------------
# copies: a prefilled cache forked to decode two continuations


COPIES = {"deepcopy": copy.deepcopy, "pickle": lambda c: pickle.loads(pickle.dumps(c))}


def _check_forked_continuations(backend, to_xp, to_np, how):
    """Prompts of lengths 3 and 1 prefilled, the cache forked, each copy extended by other
    tokens (2 then 1): each copy's outputs and keys are those of one causal forward of its own
    sequence, entry by entry, so neither write reached the other's buffers."""
    m = _decoder(backend).eval()
    rng = np.random.default_rng(6)
    prompts, S = [3, 1], 3
    x = rng.standard_normal((2, 3, D))
    ys = [rng.standard_normal((2, S, D)) for _ in range(2)]  # the two continuations
    cache = m.new_cache(2, 3 + S)
    m(to_xp(x), to_xp(x), to_xp(x), kv_cache=cache, is_causal=True)
    cache.truncate(prompts)
    fork = COPIES[how](cache)
    assert type(fork) is KVCache and repr(fork) == repr(cache) and fork.xp is cache.xp
    assert fork.dtype == cache.dtype and fork.device == cache.device
    outs = {0: [], 1: []}
    for t0, n in ((0, 2), (2, 1)):  # interleaved: each step of one copy, then the other's
        for i, c in ((0, cache), (1, fork)):
            yt = to_xp(ys[i][:, t0:t0 + n])
            outs[i].append(to_np(m(yt, yt, yt, kv_cache=c, is_causal=True)[0]))
    for i, c in ((0, cache), (1, fork)):
        assert c.cache_seqlens.tolist() == [p + S for p in prompts]
        decoded = np.concatenate(outs[i], axis=1)  # [B, S, D]
        for b, p in enumerate(prompts):
            seq = np.concatenate([x[b, :p], ys[i][b]])[None]  # [1, p + S, D]
            full, _ = m(to_xp(seq), to_xp(seq), to_xp(seq), is_causal=True)
            np.testing.assert_allclose(decoded[b], to_np(full)[0, p:], rtol=RTOL, atol=ATOL,
                                       err_msg=f"copy {i}, entry {b}")
            k, v = _kv_heads(m, seq, to_np)
            np.testing.assert_allclose(to_np(c.k)[b, :, : p + S], k[0], rtol=1e-14, atol=1e-14)
            np.testing.assert_allclose(to_np(c.v)[b, :, : p + S], v[0], rtol=1e-14, atol=1e-14)


@pytest.mark.parametrize("how", sorted(COPIES))
def test_a_copied_cache_decodes_its_own_continuation(backend, to_xp, to_np, how):
    _check_forked_continuations(backend, to_xp, to_np, how)


@pytest.mark.parametrize("how", sorted(COPIES))
def test_a_copied_cache_decodes_its_own_continuation_on_jax(jax_x64, how):
    _check_forked_continuations("jax", jax_x64.numpy.asarray, np.asarray, how)


@pytest.mark.parametrize("how", sorted(COPIES))
def test_a_copied_cache_decodes_its_own_continuation_on_dask(how):
    da = pytest.importorskip("dask.array", reason="needs dask: pip install '.[dask]'")
    _check_forked_continuations("dask", da.from_array, lambda a: np.asarray(a.compute()), how)


def test_a_shallow_copy_of_a_cache_shares_its_buffers():
    """copy.copy is shallow (the class docstring says so): its own lengths, the same buffers."""
    cache = KVCache(2, 4, 1, 3, dtype="float64")
    cache.append(np.ones((2, 1, 1, 3)), np.ones((2, 1, 1, 3)))
    twin = copy.copy(cache)
    assert twin.k is cache.k and twin.v is cache.v
    twin.append(np.full((2, 1, 1, 3), 2.0), np.full((2, 1, 1, 3), 2.0))
    assert twin.cache_seqlens.tolist() == [2, 2] and cache.cache_seqlens.tolist() == [1, 1]
    np.testing.assert_array_equal(cache.k[:, 0, 1], 2.0)  # written through the copy
