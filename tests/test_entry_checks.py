"""Public entry points that took bad input without a check of their own: each raises a
TypeError or ValueError that names the argument before any computation, and a failed call
leaves the caller's arrays and the cache as they were."""

import re

import array_api_strict
import numpy as np
import pytest

from npattn import blocked
from npattn import functional as F

B, H, LQ, LK, DH, DV = 2, 3, 4, 5, 6, 7


def _rand(*shape, seed=0):
    return np.random.default_rng(seed).standard_normal(shape)


def _copies(tree):
    return [np.array(a, copy=True) if isinstance(a, np.ndarray) else a for a in tree]


def _same(a, b):
    return all((x is y) if not isinstance(x, np.ndarray) else np.array_equal(x, y, equal_nan=True)
               for x, y in zip(a, b))


@pytest.fixture
def blocked_pair():
    q, k, v = _rand(B, H, LQ, DH, seed=1), _rand(B, H, LK, DH, seed=2), _rand(B, H, LK, DV, seed=3)
    out, cache = blocked.sdpa_blocked_forward(q, k, v, is_causal=True, block_q=2, block_k=2)
    return out, cache


@pytest.mark.parametrize("make, exc, pattern", [
    (lambda out, c: [out.tolist(), c], TypeError, r"^dout: expected .*array.*got list"),
    (lambda out, c: [out[..., :-1], c], ValueError,
     rf"^dout: expected shape \({B}, {H}, {LQ}, {DV}\) \(that of the forward's out\), "
     rf"got \({B}, {H}, {LQ}, {DV - 1}\)"),
    (lambda out, c: [out[0], c], ValueError, r"^dout: expected shape .* got \(3, 4, 7\)"),
    (lambda out, c: [np.ones(out.shape, dtype=np.int64), c], TypeError,
     r"^dout: expected dtype float64 .* got int64"),
    (lambda out, c: [out.astype(np.complex128), c], TypeError, r"^dout: expected dtype float64"),
    (lambda out, c: [out.astype(np.float32), c], TypeError, r"^dout: expected dtype float64 .*float32"),
    (lambda out, c: [array_api_strict.asarray(out), c], TypeError, r"^dout: expected"),
    (lambda out, c: [out, None], TypeError,
     r"^cache: expected a BlockedSDPACache \(the cache sdpa_blocked_forward returns\), got None"),
    (lambda out, c: [out, tuple(c)], TypeError, r"^cache: expected a BlockedSDPACache"),
    # the reference's cache, from the same q, k, v: another implementation's
    (lambda out, c: [out, F.sdpa_forward(c.q, c.k, c.v)[1]], TypeError,
     r"^cache: expected a BlockedSDPACache .* got npattn\.SDPACache"),
    (lambda out, c: [out, c, [0.0] * (B * H * LQ)], TypeError, r"^dlse: expected .*array.*got list"),
    (lambda out, c: [out, c, np.zeros((B, H, LQ, 1))], ValueError,
     rf"^dlse: expected shape \({B}, {H}, {LQ}\) \(that of cache\.lse\), got \({B}, {H}, {LQ}, 1\)"),
    (lambda out, c: [out, c, np.zeros((B, H, LQ), dtype=np.float32)], TypeError,
     r"^dlse: expected dtype float64 .*float32"),
])
def test_blocked_backward_checks_its_arguments(blocked_pair, make, exc, pattern):
    # sdpa_blocked_backward had no check of its own (only the dispatcher checked): a cache
    # of another function gave an AttributeError, a dout of the wrong shape NumPy's reshape
    # message, an int or complex dout and a float32 dlse ran without a word
    out, cache = blocked_pair
    args = make(out, cache)
    dout, c = args[0], args[1]
    kwargs = {"dlse": args[2]} if len(args) > 2 else {}
    before, cache_before = _copies(args), _copies(cache)
    with pytest.raises(exc, match=pattern):
        blocked.sdpa_blocked_backward(dout, c, **kwargs)
    assert _same(before, args) and _same(cache_before, cache)


def test_blocked_backward_with_its_checks_still_gives_the_reference_gradients():
    q, k, v = _rand(B, H, LQ, DH, seed=1), _rand(B, H, LK, DH, seed=2), _rand(B, H, LK, DV, seed=3)
    dout, dlse = _rand(B, H, LQ, DV, seed=4), _rand(B, H, LQ, seed=5)
    _, cache = blocked.sdpa_blocked_forward(q, k, v, is_causal=True, block_q=2, block_k=2)
    _, ref_cache = F.sdpa_forward(q, k, v, is_causal=True)
    got = blocked.sdpa_blocked_backward(dout, cache, dlse=dlse)
    want = F.sdpa_backward(dout, ref_cache, dlse=dlse)
    for g, w in zip(got[:3], want[:3]):
        np.testing.assert_allclose(g, w, rtol=1e-10, atol=1e-12)


def test_split_and_merge_heads_backward_refuse_each_others_cache():
    # both return a HeadsCache; the other function's cache gave Python's "too many values
    # to unpack" (split) or "not enough values to unpack" (merge), naming nothing
    x = _rand(B, LQ, H * DH)
    xh, split_cache = F.split_heads_forward(x, H)
    merged, merge_cache = F.merge_heads_forward(xh)
    with pytest.raises(TypeError, match=re.escape(
            f"cache: expected the HeadsCache split_heads_forward returns (of an x (B, L, D)), "
            f"got one of an x of shape {(B, H, LQ, DH)}")):
        F.split_heads_backward(xh, merge_cache)
    with pytest.raises(TypeError, match=re.escape(
            f"cache: expected the HeadsCache merge_heads_forward returns (of an x (B, H, L, Dh)), "
            f"got one of an x of shape {(B, LQ, H * DH)}")):
        F.merge_heads_backward(merged, split_cache)
    # each with its own cache: the inverse reshapes, by hand
    np.testing.assert_array_equal(F.split_heads_backward(xh, split_cache), x)
    np.testing.assert_array_equal(F.merge_heads_backward(merged, merge_cache), xh)


@pytest.mark.parametrize("x", [np.array(1.5), np.float64(1.5)])
def test_masked_softmax_refuses_an_x_without_axes(x):
    # the softmax runs over the last axis: a 0-d x gave an IndexError from row_max
    with pytest.raises(ValueError, match=re.escape("x: expected an array of shape (..., Lk), got shape ()")):
        F.masked_softmax_forward(x)
    with pytest.raises(ValueError, match="^x: expected an array of shape"):
        F.masked_softmax_forward(x, np.array(True))


@pytest.mark.parametrize("value, got", [("no", "str 'no'"), (0, "int 0"), (None, "None")])
def test_assert_attention_close_checks_allow_degenerate_before_verifying(value, got):
    # allow_degenerate went unchecked: "no" (truthy) allowed degenerate cases, and a bad
    # value was only read after every case of verify had run
    from npattn.testing import assert_attention_close

    calls = []

    def fn(q, k, v, **options):
        calls.append(1)
        return F.sdpa_forward(q, k, v, **options)[0]

    with pytest.raises(TypeError, match=re.escape(f"allow_degenerate: expected a bool, got {got}")):
        assert_attention_close(fn, allow_degenerate=value, dtype="float64", cases=["base-1x65"])
    assert calls == []


@pytest.mark.parametrize("caches, pattern", [
    ([1.0, 2.0], r"^caches\[0\]: expected an npattn\.KVCache, got float$"),
    (None, r"^caches: expected a sequence of npattn\.KVCache, got None"),
    ("kv", r"^caches: expected a sequence of npattn\.KVCache, got str"),
])
def test_persist_with_names_caches_that_are_not_kv_caches(caches, pattern):
    # each entry's buffers were read first: an AttributeError ('float' object has no
    # attribute '_k'), or a TypeError about iterating None that named nothing
    from npattn.kvcache import persist_with

    with pytest.raises(TypeError, match=pattern):
        persist_with(caches, np.ones(3))


def test_persist_with_names_the_entry_after_a_good_cache():
    from npattn.kvcache import KVCache, persist_with

    good = KVCache(1, 4, 1, 2, dtype="float64")
    k_before = np.array(good.k, copy=True)
    with pytest.raises(TypeError, match=r"^caches\[1\]: expected an npattn\.KVCache, got dict$"):
        persist_with([good, {}], np.ones(3))
    np.testing.assert_array_equal(good.k, k_before)
    # with caches only: the arrays come back as given on NumPy
    x = np.arange(3.0)
    (y,) = persist_with([good], x)
    assert y is x


def test_rope_angles_names_a_head_width_no_array_can_hold():
    # Dh passed the positive-even check and its frequencies were built as a Python list,
    # one float at a time, before any array: Dh = 2**62 grew it until the process ran out
    # of memory (killed, no exception) where theta (3, 2**61) cannot exist at all
    from npattn import positions as P

    with pytest.raises(ValueError, match=re.escape(
            f"Dh: expected sizes for which theta, an array of shape (3, {2**61}) (8 bytes an "
            f"entry), fits in")):
        P.rope_angles(np, np.arange(3), 2**62)
    # a head width that fits: theta[l, c] = l * base^(-2c/Dh), by Python's pow
    Dh, base = 6, 500.0
    want = np.array([[pos * base ** (-2.0 * c / Dh) for c in range(Dh // 2)] for pos in range(4)])
    np.testing.assert_array_equal(P.rope_angles(np, np.arange(4), Dh, base=base), want)


@pytest.mark.parametrize("xp, exc, pattern", [
    ("nump", ValueError, r"^xp: expected one of \[.*'numpy'.*\], got 'nump'"),
    (1, TypeError, r"^xp: expected one of \[.*\] or a namespace module, got int"),
])
def test_causal_mask_names_an_xp_that_is_no_backend(xp, exc, pattern):
    # xp was used as a namespace at once: a str gave "'str' object has no attribute 'arange'"
    with pytest.raises(exc, match=pattern):
        F.causal_mask(xp, 2, 3)


def test_causal_mask_takes_a_backend_name_as_relative_distances_does():
    want = np.array([[True, False, False], [True, True, False]])  # j <= i
    np.testing.assert_array_equal(F.causal_mask("numpy", 2, 3), want)
    got = F.causal_mask("array_api_strict", 2, 3)
    assert isinstance(got, type(array_api_strict.asarray(True)))
    np.testing.assert_array_equal(np.asarray(got), want)


@pytest.mark.parametrize("which, bad, exc, pattern", [
    ("q", lambda a: a.tolist(), TypeError, r"^q: expected an array, got list"),
    ("k", lambda a: None, TypeError, r"^k: expected an array, got None"),
    ("v", lambda a: a[0, 0, 0], ValueError,
     r"^v: expected an array of shape \(\.\.\., L, D\), got shape \(7,\)"),
    ("q", lambda a: array_api_strict.asarray(a[0, 0, 0, 0]), ValueError,
     r"^q: expected an array of shape \(\.\.\., L, D\), got shape \(\)"),
])
def test_select_impl_names_what_is_no_attention_input(which, bad, exc, pattern):
    # select_impl read q.shape[-2] and the others' at once: a list gave AttributeError
    from npattn import attention as A

    args = {"q": _rand(B, H, LQ, DH, seed=1), "k": _rand(B, H, LK, DH, seed=2),
            "v": _rand(B, H, LK, DV, seed=3)}
    assert A.select_impl("auto", **args) == "numpy"  # the arrays as given: the NumPy kernel
    args[which] = bad(args[which])
    with pytest.raises(exc, match=pattern):
        A.select_impl("auto", **args)
