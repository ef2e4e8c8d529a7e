"""Every functional pair against central finite differences, and its invariants.

Each test body runs on every backend fixture; gradients are checked in float64
with a random upstream gradient (``gradcheck`` never uses all ones).
"""

import math

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from _strategies import attention_dims, make_mask, mask_forms, mask_kinds
from npattn import functional as F
from npattn.backend import namespace
from npattn.gradcheck import gradcheck

RTOL = 1e-6


def assert_same_namespace(xp, *arrays):
    for a in arrays:
        if a is not None:
            assert namespace(a) is xp, f"output left its namespace: {type(a)}"


def assert_ok(report):
    # every input within atol + rtol * scale, rtol = RTOL and atol float64's rounding floor
    # of a central difference (a bound on max_rel_err alone fails gradients of scale 1e-3
    # whose error is that rounding)
    assert report.ok and report.rtol <= RTOL, "\n" + str(report)


# ----------------------------------------------------------------- linear


@given(
    lead=st.lists(st.integers(2, 3), min_size=1, max_size=2),  # sizes of at least 2
    din=st.integers(2, 6),
    dout=st.integers(2, 6),
    bias=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_linear_gradients(xp, to_xp, lead, din, dout, bias, seed):
    rng = np.random.default_rng(seed)
    x = to_xp(rng.standard_normal((*lead, din)))
    w = to_xp(rng.standard_normal((dout, din)))
    b = to_xp(rng.standard_normal(dout)) if bias else None
    y, _ = F.linear_forward(x, w, b)
    assert tuple(y.shape) == (*lead, dout)
    assert_same_namespace(xp, y)
    inputs = [x, w] + ([b] if bias else [])
    report = gradcheck(F.linear_forward, F.linear_backward, inputs, names=["x", "w", "b"][: len(inputs)], seed=seed)
    assert_ok(report)


def test_linear_without_bias_gives_no_bias_gradient(xp, to_xp):
    rng = np.random.default_rng(3)
    x, w = to_xp(rng.standard_normal((2, 3, 4))), to_xp(rng.standard_normal((5, 4)))
    y, cache = F.linear_forward(x, w)
    dx, dw, db = F.linear_backward(to_xp(rng.standard_normal((2, 3, 5))), cache)
    assert db is None and tuple(dx.shape) == (2, 3, 4) and tuple(dw.shape) == (5, 4)


def test_linear_bias_gradient_of_float16_is_summed_past_2048_rows(xp, to_xp, to_np):
    # float16 counts 1 + 2048 as 2048: db summed in float16 along the rows would stop there
    if not hasattr(xp, "float16"):
        pytest.skip("this namespace has no float16")
    n = 4096
    x = to_xp(np.zeros((n, 2), dtype=np.float16))
    w = to_xp(np.ones((3, 2), dtype=np.float16))
    b = to_xp(np.zeros(3, dtype=np.float16))
    _, cache = F.linear_forward(x, w, b)
    _, _, db = F.linear_backward(to_xp(np.ones((n, 3), dtype=np.float16)), cache)
    assert db.dtype == x.dtype
    np.testing.assert_array_equal(to_np(db).astype(np.float64), float(n))


@pytest.mark.parametrize("Lq, Lk", [(3, 5), (4, 2)])
def test_causal_mask_lets_query_i_see_keys_up_to_i(xp, to_np, Lq, Lk):
    m = to_np(F.causal_mask(xp, Lq, Lk))
    assert m.shape == (Lq, Lk) and m.dtype == np.bool_
    expected = np.array([[j <= i for j in range(Lk)] for i in range(Lq)])
    np.testing.assert_array_equal(m, expected)

# --------------------------------------------------------- split / merge


@given(B=st.integers(2, 3), L=st.integers(2, 5), H=st.integers(2, 4), Dh=st.integers(2, 4), seed=st.integers(0, 2**16))
def test_split_merge_identity_and_gradients(xp, to_xp, to_np, B, L, H, Dh, seed):
    rng = np.random.default_rng(seed)
    x_host = rng.standard_normal((B, L, H * Dh))
    x = to_xp(x_host)
    xh, _ = F.split_heads_forward(x, H)
    assert tuple(xh.shape) == (B, H, L, Dh)
    # head h owns features h*Dh:(h+1)*Dh
    np.testing.assert_array_equal(to_np(xh)[:, 1 % H], x_host[:, :, (1 % H) * Dh : (1 % H + 1) * Dh])
    back, _ = F.merge_heads_forward(xh)
    np.testing.assert_array_equal(to_np(back), x_host)
    assert_same_namespace(xp, xh, back)
    assert_ok(gradcheck(lambda t: F.split_heads_forward(t, H), F.split_heads_backward, [x], seed=seed))
    assert_ok(gradcheck(F.merge_heads_forward, F.merge_heads_backward, [xh], seed=seed))


# ------------------------------------------------------------ softmax


@given(dims=attention_dims(max_dh=1), kind=mask_kinds, form=mask_forms, masked_row=st.booleans(), seed=st.integers(0, 2**16))
def test_masked_softmax_gradients_and_invariants(xp, to_xp, to_np, dims, kind, form, masked_row, seed):
    B, H, Lq, Lk, _ = dims
    rng = np.random.default_rng(seed)
    x_host = 3.0 * rng.standard_normal((B, H, Lq, Lk))
    m_host = make_mask(rng, kind, form, B, H, Lq, Lk, masked_row=masked_row)
    x, m = to_xp(x_host), to_xp(m_host)

    p, _ = F.masked_softmax_forward(x, m)
    assert_same_namespace(xp, p)
    p = to_np(p)
    assert np.all(np.isfinite(p))
    # which entries may be attended
    allowed = np.ones_like(x_host, dtype=bool)
    if m_host is not None:
        allowed = np.broadcast_to(m_host if m_host.dtype == bool else np.isfinite(m_host), x_host.shape)
    assert np.all(p[~allowed] == 0.0), "masked entries must be exactly 0"
    row_has_key = allowed.any(axis=-1)
    np.testing.assert_allclose(p.sum(-1)[row_has_key], 1.0, rtol=1e-12)
    assert np.all(p.sum(-1)[~row_has_key] == 0.0), "fully masked rows must be all zero"

    is_float = m_host is not None and m_host.dtype != bool
    inputs = [x, m] if is_float else [x]

    def fwd(x, *mask):
        return F.masked_softmax_forward(x, mask[0] if mask else m)

    def bwd(dp, cache):
        dx, dmask, _ = F.masked_softmax_backward(dp, cache)
        assert np.all(np.isfinite(to_np(dx)))
        return (dx, dmask) if is_float else dx

    assert_ok(gradcheck(fwd, bwd, inputs, names=["x", "mask"][: len(inputs)], seed=seed))


def test_softmax_backward_matches_documented_formula(xp, to_xp, to_np):
    """ds = p * (dp - sum(dp * p)), the vectorised formula of the docstring."""
    rng = np.random.default_rng(0)
    x, dp = rng.standard_normal((2, 3, 5)), rng.standard_normal((2, 3, 5))
    p, cache = F.masked_softmax_forward(to_xp(x))
    ds, _, _ = F.masked_softmax_backward(to_xp(dp), cache)
    p = to_np(p)
    # the Jacobian written out entry by entry: dp_i/dx_j = p_i (delta_ij - p_j)
    jac = np.einsum("...i,ij->...ij", p, np.eye(5)) - np.einsum("...i,...j->...ij", p, p)
    np.testing.assert_allclose(to_np(ds), np.einsum("...ij,...i->...j", jac, dp), rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("masked", [False, True], ids=["plain", "bool mask"])
def test_softmax_output_written_into_by_the_caller_leaves_the_backward(masked):
    """The caller scales p in place after the forward (NumPy's ``p *= ...``): the backward is
    still that of the forward's p, ds = p * (dp - sum(dp * p)) with p = exp(z) / sum(exp(z))
    computed here. The returned p was the array the cache kept, so the edit changed the
    gradient without a word."""
    rng = np.random.default_rng(0)
    x, dp = rng.standard_normal((2, 3, 5)), rng.standard_normal((2, 3, 5))
    mask = rng.random((2, 3, 5)) > 0.3 if masked else None
    if masked:
        mask[..., 0] = True
    z = np.where(mask, x, -np.inf) if masked else x
    e = np.exp(z - z.max(axis=-1, keepdims=True))
    p_want = e / e.sum(axis=-1, keepdims=True)
    p, cache = F.masked_softmax_forward(x.copy(), mask)
    np.testing.assert_allclose(p, p_want, rtol=1e-13)
    p *= 3.0
    p -= 1.0
    ds, _, _ = F.masked_softmax_backward(dp, cache)
    want = p_want * (dp - (dp * p_want).sum(axis=-1, keepdims=True))
    np.testing.assert_allclose(ds, want, rtol=1e-12, atol=1e-14)


def test_softmax_dlse_on_a_row_with_nothing_to_attend_does_not_matter(xp, to_xp, to_np):
    """lse = -inf on a fully masked row whatever its scores: an inf or NaN dlse there
    gives the gradient of 0 (not 0 * inf), and dlse moves the other rows by p * dlse."""
    rng = np.random.default_rng(3)
    x, dp = rng.standard_normal((3, 4)), rng.standard_normal((3, 4))
    mask = np.ones((3, 4), dtype=bool)
    mask[1] = False  # row 1 attends nothing
    p, cache = F.masked_softmax_forward(to_xp(x), to_xp(mask))
    base, _, _ = F.masked_softmax_backward(to_xp(dp), cache)
    dlse = np.array([[0.5], [0.0], [-0.2]])
    want, _, _ = F.masked_softmax_backward(to_xp(dp), cache, dlse=to_xp(dlse))
    np.testing.assert_allclose(to_np(want) - to_np(base), to_np(p) * dlse, rtol=1e-12, atol=1e-14)
    for bad in (np.inf, -np.inf, np.nan):
        dlse[1] = bad
        got, _, _ = F.masked_softmax_backward(to_xp(dp), cache, dlse=to_xp(dlse))
        np.testing.assert_array_equal(to_np(got), to_np(want))


def test_softmax_sink_gradient_matches_finite_differences(xp, to_xp, to_np):
    """The sink is an input of the pair: its gradient comes back third, in the order of the
    forward's inputs, for p and for the log-sum-exp together; a row whose keys are all masked
    belongs to the sink alone (p = 0, finite gradients)."""
    rng = np.random.default_rng(5)
    x = to_xp(rng.standard_normal((2, 3, 5)))  # [..., Lk]
    sink = to_xp(rng.standard_normal((2, 3, 1)))  # [..., 1]
    keep = rng.random((2, 3, 5)) < 0.7
    keep[1, 2] = False  # row (1, 2) attends no key
    mask = to_xp(keep)

    def fwd(x, sink):  # [..., Lk], [..., 1] -> [..., Lk + 1]: p and lse side by side
        p, cache = F.masked_softmax_forward(x, mask, sink=sink)
        return xp.concat([p, cache.lse], axis=-1), cache

    def bwd(dout, cache):
        dx, dmask, dsink = F.masked_softmax_backward(dout[..., :-1], cache, dlse=dout[..., -1:])
        assert dmask is None and tuple(dsink.shape) == (2, 3, 1)
        assert np.all(np.isfinite(to_np(dx))) and np.all(np.isfinite(to_np(dsink)))
        return dx, dsink

    assert_ok(gradcheck(fwd, bwd, [x, sink], names=["x", "sink"], seed=5))
    # without a sink there is none to differentiate
    _, cache = F.masked_softmax_forward(x, mask)
    assert F.masked_softmax_backward(to_xp(rng.standard_normal((2, 3, 5))), cache).dsink is None


def test_softmax_sink_far_above_the_scores_stays_finite(xp, to_xp, to_np):
    """A sink logit of 800 dwarfs the scores: exp(800) overflows float64, yet p, lse and
    the gradients are finite, p_j = exp(x_j - lse) with lse = sink + log(1 + sum exp(x - sink))."""
    rng = np.random.default_rng(7)
    x, dp = rng.standard_normal((2, 4)), rng.standard_normal((2, 4))
    sink = np.array([[800.0], [-3.0]])
    p, cache = F.masked_softmax_forward(to_xp(x), sink=to_xp(sink))
    lse = sink + np.log1p(np.sum(np.exp(x - sink), axis=-1, keepdims=True))
    np.testing.assert_allclose(to_np(cache.lse), lse, rtol=1e-14)
    np.testing.assert_allclose(to_np(p), np.exp(x - lse), rtol=1e-12, atol=0)
    dx, _, dsink = F.masked_softmax_backward(to_xp(dp), cache)
    assert np.all(np.isfinite(to_np(dx))) and np.all(np.isfinite(to_np(dsink)))


def test_softmax_over_rows_of_length_zero(xp, to_xp, to_np):
    """x of shape (..., 0): rows with nothing in them have nothing to attend. As torch's
    softmax, p is empty, and lse is -inf (torch.logsumexp over an empty axis); with a sink,
    the sink is the row's only logit, so p_sink = 1, lse = sink and dsink = dlse (d sink /
    d sink), while dx is empty. Every backend's max over the empty axis raised instead."""
    p, c = F.masked_softmax_forward(to_xp(np.zeros((2, 3, 0))))
    assert to_np(p).shape == (2, 3, 0)
    np.testing.assert_array_equal(to_np(c.lse), np.full((2, 3, 1), -np.inf))
    sink, dlse = np.array([[0.3], [-1.0]]), np.array([[2.0], [-3.0]])
    p, c = F.masked_softmax_forward(to_xp(np.zeros((2, 0))), sink=to_xp(sink))
    np.testing.assert_array_equal(to_np(c.p_sink), np.ones((2, 1)))
    np.testing.assert_allclose(to_np(c.lse), sink, rtol=1e-15)
    g = F.masked_softmax_backward(to_xp(np.zeros((2, 0))), c, dlse=to_xp(dlse))
    assert to_np(g.dx).shape == (2, 0)
    np.testing.assert_allclose(to_np(g.dsink), dlse, rtol=1e-15)


def test_softmax_large_scores_stable(xp, to_xp, to_np):
    x = to_xp(np.array([[1e4, -1e4, 0.0], [-1e4, -1e4, -1e4]]))
    p, cache = F.masked_softmax_forward(x)
    ds, _, _ = F.masked_softmax_backward(to_xp(np.array([[1.0, -2.0, 0.5], [0.3, 0.1, -0.2]])), cache)
    p, ds = to_np(p), to_np(ds)
    np.testing.assert_allclose(p[0], [1.0, 0.0, 0.0])
    np.testing.assert_allclose(p[1], [1 / 3] * 3)
    assert np.all(np.isfinite(ds))


# ------------------------------------------------------------ dropout


@given(shape=st.lists(st.integers(2, 4), min_size=2, max_size=4), p=st.floats(0.1, 0.9), seed=st.integers(0, 2**16))
def test_dropout_fixed_mask_gradients(xp, to_xp, to_np, shape, p, seed):
    rng = np.random.default_rng(seed)
    x_host = rng.standard_normal(shape)
    keep_host = rng.random(shape) >= p
    x, keep = to_xp(x_host), to_xp(keep_host)
    y, _ = F.dropout_forward(x, p, mask=keep)
    np.testing.assert_allclose(to_np(y), np.where(keep_host, x_host / (1 - p), 0.0), rtol=1e-15)
    assert_ok(gradcheck(lambda t: F.dropout_forward(t, p, mask=keep), F.dropout_backward, [x], seed=seed))


def test_dropout_generator_is_seeded_and_unbiased(xp, to_xp, to_np):
    x = to_xp(np.ones((200, 200)))
    y1, c1 = F.dropout_forward(x, 0.25, rng=7)
    y2, _ = F.dropout_forward(x, 0.25, rng=7)
    y3, _ = F.dropout_forward(x, 0.25, rng=8)
    y1, y2, y3 = to_np(y1), to_np(y2), to_np(y3)
    np.testing.assert_array_equal(y1, y2)
    assert not np.array_equal(y1, y3)
    kept = np.mean(to_np(c1.keep))
    assert abs(kept - 0.75) < 0.01  # 40 000 draws: 5 standard deviations is 0.011
    assert abs(y1.mean() - 1.0) < 0.02  # inverted scaling keeps the expectation


def _lowbias32(x):
    """The documented 32-bit hash, on Python ints."""
    x &= 0xFFFFFFFF
    x ^= x >> 16
    x = (x * 0x7FEB352D) & 0xFFFFFFFF
    x ^= x >> 15
    x = (x * 0x846CA68B) & 0xFFFFFFFF
    x ^= x >> 16
    return x


def _entry_hash(key, coords, i, j):
    """The hash ``u`` of keyed_keep_mask's docstring for one entry, written out on Python ints."""
    golden = 0x9E3779B9
    r = key & 0xFFFFFFFF
    for c in (*coords, i):
        r = _lowbias32(r + c * golden)
    return _lowbias32(r ^ _lowbias32((key >> 32) + j * golden))


def _keep_entry(key, p, coords, i, j):
    """keyed_keep_mask's docstring formula for one entry: kept when u >= round(p * 2^32)."""
    return _entry_hash(key, coords, i, j) >= min(round(p * 2**32), 2**32 - 1)


def test_keyed_keep_mask_at_the_threshold_keeps_u_equal_and_rounds_p():
    """The two edges of ``keep = u >= round(p * 2^32)``: with p = u / 2^32 the entry whose hash
    is u is kept (>=, not >), and with p = (u + 0.6) / 2^32 the threshold rounds up to u + 1
    and drops it (truncating to u would keep it)."""
    from npattn import backend as npb

    key = (0x0F0F_1234 << 32) | 0x5555_AAAA
    lead, rows, cols = [np.array([1])[:, None], np.array([2])[None, :]], np.array([3]), np.array([4])
    u = _entry_hash(key, (1, 2), 3, 4)
    assert 1 < u < 2**32 - 2
    assert npb.keyed_keep_mask(key, u / 2**32, lead, rows, cols)[0, 0, 0, 0]
    assert not npb.keyed_keep_mask(key, (u + 0.6) / 2**32, lead, rows, cols)[0, 0, 0, 0]
    assert npb.keyed_keep_mask(key, (u - 0.6) / 2**32, lead, rows, cols)[0, 0, 0, 0]


@pytest.mark.parametrize("slab", [1, 3, 1 << 18])
def test_keyed_keep_mask_is_the_documented_hash_at_any_slab(slab, monkeypatch):
    """Entry by entry the formula of the docstring, whatever the slab of rows its hashes are
    taken in (KEEP_SLAB bounds its temporaries) and whether it writes into ``out=``."""
    from npattn import backend as npb

    monkeypatch.setattr(npb, "KEEP_SLAB", slab)
    key, p = (0x1234_5678 << 32) | 0x9ABC_DEF0, 0.3
    lead = [np.array([3, 5])[:, None], np.array([0, 7, 2])[None, :]]  # b [2, 1], h [1, 3]
    rows, cols = np.array([0, 1, 9, 4]), np.array([2, 0, 11, 5, 6])
    got = npb.keyed_keep_mask(key, p, lead, rows, cols)
    assert got.shape == (2, 3, 4, 5) and got.dtype == np.bool_
    out = np.zeros((2, 3, 4, 5), dtype=bool)
    assert npb.keyed_keep_mask(key, p, lead, rows, cols, out=out) is out
    for b, h, ii, jj in np.ndindex(got.shape):
        want = _keep_entry(key, p, (int(lead[0][b, 0]), int(lead[1][0, h])), int(rows[ii]), int(cols[jj]))
        assert got[b, h, ii, jj] == want and out[b, h, ii, jj] == want
    with pytest.raises(ValueError, match=r"^out: expected a numpy bool array of shape \(2, 3, 4, 5\)"):
        npb.keyed_keep_mask(key, p, lead, rows, cols, out=np.zeros((2, 3, 4, 4), dtype=bool))
    with pytest.raises(ValueError, match="^cols: expected a 1-D array of coordinates, got 0 axes$"):
        npb.keyed_keep_mask(key, p, lead, rows, np.int64(3))
    with pytest.raises(ValueError, match="^rows: expected a 1-D array of coordinates, got 2 axes$"):
        npb.keyed_keep_mask(key, p, lead, rows.reshape(2, 2), cols)


def test_dropout_backward_reuses_the_forward_mask(xp, to_xp, to_np):
    """A drawn mask: the entries the forward dropped (the zeros of y, x has none) get dx = 0,
    the others dx = dy / (1 - p), for a random dy (all ones would not tell dy from 1)."""
    rng = np.random.default_rng(3)
    x, dy, p = rng.standard_normal((6, 7)), rng.standard_normal((6, 7)), 0.4
    y, cache = F.dropout_forward(to_xp(x), p, rng=3)
    kept = to_np(y) != 0.0
    assert kept.any() and not kept.all()
    dx = F.dropout_backward(to_xp(dy), cache)
    np.testing.assert_allclose(to_np(dx), np.where(kept, dy / (1.0 - p), 0.0), rtol=1e-15, atol=0)


def test_dropout_cache_holds_the_drawn_key(xp, to_xp, to_np):
    """``cache.key`` is the one key drawn from ``rng`` (``backend.dropout_key``), and the
    keep-mask is that key's (``backend.keep_mask``); a given keep-mask, or p = 0 without
    one, draws none and keeps None."""
    from npattn.backend import device_of, dropout_key, keep_mask

    x = to_xp(np.ones((4, 6)))
    _, cache = F.dropout_forward(x, 0.3, rng=5)
    assert cache.key == dropout_key(5)
    want = keep_mask(dropout_key(5), 0.3, (4, 6), xp, device_of(x))
    np.testing.assert_array_equal(to_np(cache.keep), to_np(want))
    assert F.dropout_forward(x, 0.3, mask=to_xp(np.ones((4, 6), dtype=bool)))[1].key is None
    assert F.dropout_forward(x, 0.0, rng=5)[1].key is None


@pytest.mark.parametrize("seed, kind", [(True, "bool"), (np.True_, "numpy.bool"), ([1, 2], "list"),
                                        ((3,), "tuple"), (np.array([1, 2]), "numpy.ndarray"), (1.0, "float"),
                                        ("7", "str")])
def test_the_dropout_key_takes_only_a_documented_seed(seed, kind):
    """A seed is None, an int >= 0, a SeedSequence, a BitGenerator or a Generator, on every
    public path (``check_rng``) and in ``backend.dropout_key`` and ``make_rng`` alike: a bool
    (NumPy seeds True as 1) or a sequence of ints is refused, naming the argument."""
    from npattn.backend import dropout_key, make_rng

    with pytest.raises(TypeError, match=r"^rng: expected None, a non-negative int seed, .*got " + kind):
        dropout_key(seed)
    with pytest.raises(TypeError, match=r"^seed: expected None, a non-negative int seed, .*got " + kind):
        make_rng(seed)
    with pytest.raises(TypeError, match=r"^rng: expected None, a non-negative int seed"):
        F.dropout_forward(np.ones((2, 3)), 0.5, rng=seed)


def test_the_dropout_key_takes_every_documented_seed():
    """The same key from an int, a NumPy int, its SeedSequence, BitGenerator and Generator;
    a negative int is refused by value."""
    from npattn.backend import dropout_key, make_rng

    key = dropout_key(5)
    assert dropout_key(np.int64(5)) == dropout_key(np.random.SeedSequence(5)) == key
    assert dropout_key(np.random.PCG64(5)) == dropout_key(np.random.default_rng(5)) == key
    assert isinstance(dropout_key(None), int)
    gen = np.random.default_rng(1)
    assert make_rng(gen) is gen
    with pytest.raises(ValueError, match=r"^rng: expected a non-negative int seed, got -1"):
        dropout_key(-1)


def test_a_failed_call_leaves_the_generator_as_it_was(xp, to_xp, to_np, monkeypatch):
    """dropout_forward and sdpa_forward draw their dropout key from the caller's generator
    before the mask is made; should making it fail (here a MemoryError), the generator is
    put back, and the retry draws the mask of a fresh generator of the same seed."""
    rng = np.random.default_rng(9)
    x = to_xp(rng.standard_normal((3, 4)))
    q, k, v = (to_xp(rng.standard_normal((1, 2, L, 3))) for L in (3, 4, 4))

    def out_of_memory(*args, **kwargs):
        raise MemoryError("out of memory")

    gen = np.random.default_rng(4)
    state = gen.bit_generator.state
    monkeypatch.setattr(F, "keep_mask", out_of_memory)
    with pytest.raises(MemoryError):
        F.dropout_forward(x, 0.5, rng=gen)
    assert gen.bit_generator.state == state
    with pytest.raises(MemoryError):
        F.sdpa_forward(q, k, v, dropout_p=0.5, rng=gen)
    assert gen.bit_generator.state == state
    monkeypatch.undo()
    y, _ = F.dropout_forward(x, 0.5, rng=gen)
    y0, _ = F.dropout_forward(x, 0.5, rng=np.random.default_rng(4))
    np.testing.assert_array_equal(to_np(y), to_np(y0))


def test_dropout_with_p_zero_applies_a_given_keep_mask(xp, to_xp, to_np):
    """p = 0 with a keep-mask drops the entries it drops, scaled by 1 / (1 - 0) = 1:
    y = where(keep, x, 0), dx = where(keep, dy, 0), and so do the weights of
    sdpa_forward(dropout_p=0, dropout_mask=keep). Only p = 0 without a mask is the identity."""
    rng = np.random.default_rng(6)
    x, dy, keep = rng.standard_normal((3, 4, 5)), rng.standard_normal((3, 4, 5)), rng.random((3, 4, 5)) >= 0.4
    y, cache = F.dropout_forward(to_xp(x), 0.0, mask=to_xp(keep))
    np.testing.assert_array_equal(to_np(y), np.where(keep, x, 0.0))
    np.testing.assert_array_equal(to_np(F.dropout_backward(to_xp(dy), cache)), np.where(keep, dy, 0.0))
    q, k, v = rng.standard_normal((2, 2, 3, 4)), rng.standard_normal((2, 2, 5, 4)), rng.standard_normal((2, 2, 5, 2))
    keep = rng.random((2, 2, 3, 5)) >= 0.4
    s = q @ np.swapaxes(k, -1, -2) / 2.0  # scale 1 / sqrt(4)
    p = np.exp(s - s.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    out, _ = F.sdpa_forward(to_xp(q), to_xp(k), to_xp(v), dropout_p=0.0, dropout_mask=to_xp(keep))
    np.testing.assert_allclose(to_np(out), np.where(keep, p, 0.0) @ v, rtol=1e-12, atol=1e-15)


# --------------------------------------------------------------- sdpa


def _sdpa_case(rng, dims, kind, form, masked_row):
    B, H, Lq, Lk, Dh = dims
    q = rng.standard_normal((B, H, Lq, Dh))
    k = rng.standard_normal((B, H, Lk, Dh))
    v = rng.standard_normal((B, H, Lk, Dh))
    m = make_mask(rng, kind, form, B, H, Lq, Lk, masked_row=masked_row)
    return q, k, v, m


@given(
    dims=attention_dims(),
    kind=mask_kinds,
    form=mask_forms,
    masked_row=st.booleans(),
    causal=st.booleans(),
    scale=st.one_of(st.none(), st.floats(0.1, 2.0)),
    dropout_p=st.sampled_from([0.0, 0.3]),
    seed=st.integers(0, 2**16),
)
def test_sdpa_gradients(xp, to_xp, to_np, dims, kind, form, masked_row, causal, scale, dropout_p, seed):
    rng = np.random.default_rng(seed)
    q, k, v, m = (to_xp(a) for a in _sdpa_case(rng, dims, kind, form, masked_row))
    B, H, Lq, Lk, Dh = dims
    keep = to_xp(rng.random((B, H, Lq, Lk)) >= dropout_p) if dropout_p else None
    is_float = m is not None and xp.isdtype(m.dtype, "real floating")
    kw = dict(is_causal=causal, scale=scale, dropout_p=dropout_p, dropout_mask=keep)

    out, cache = F.sdpa_forward(q, k, v, mask=m, **kw)
    assert tuple(out.shape) == (B, H, Lq, Dh)
    assert_same_namespace(xp, out)
    assert np.all(np.isfinite(to_np(out)))

    def fwd(q, k, v, *mask):
        return F.sdpa_forward(q, k, v, mask=mask[0] if mask else m, **kw)

    def bwd(dout, cache):
        dq, dk, dv, dmask, _ = F.sdpa_backward(dout, cache)
        assert_same_namespace(xp, dq, dk, dv, dmask)
        assert (dmask is None) == (not is_float)
        for g in (dq, dk, dv, dmask):
            assert g is None or np.all(np.isfinite(to_np(g)))
        return (dq, dk, dv, dmask) if is_float else (dq, dk, dv)

    inputs = [q, k, v, m] if is_float else [q, k, v]
    assert_ok(gradcheck(fwd, bwd, inputs, names=["q", "k", "v", "mask"][: len(inputs)], seed=seed))


def test_sdpa_matches_direct_formula(xp, to_xp, to_np):
    """out = softmax(q k^T / sqrt(Dh) + mask) v, written out with NumPy."""
    rng = np.random.default_rng(1)
    q, k, v = rng.standard_normal((2, 3, 4, 5)), rng.standard_normal((2, 3, 6, 5)), rng.standard_normal((2, 3, 6, 5))
    m = rng.standard_normal((4, 6))
    s = q @ np.swapaxes(k, -1, -2) / math.sqrt(5) + m
    s = np.where(np.tril(np.ones((4, 6), bool)), s, -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    out, cache = F.sdpa_forward(to_xp(q), to_xp(k), to_xp(v), mask=to_xp(m), is_causal=True)
    np.testing.assert_allclose(to_np(out), p @ v, rtol=1e-12)
    np.testing.assert_allclose(to_np(cache.probs), p, rtol=1e-12, atol=1e-15)


def test_sdpa_bool_mask_and_causal_match_direct_formula(xp, to_xp, to_np):
    """A boolean mask AND is_causal (top-left): out = softmax where both allow, written out
    with NumPy; row 0 of batch 1 keeps no key and gives zeros."""
    rng = np.random.default_rng(3)
    q, k, v = rng.standard_normal((2, 3, 4, 5)), rng.standard_normal((2, 3, 6, 5)), rng.standard_normal((2, 3, 6, 2))
    m = rng.random((2, 1, 4, 6)) > 0.3
    m[:, :, :, 0] = True  # key 0, the one every causal row sees, kept ...
    m[1, :, 0, 0] = False  # ... but by row 0 of batch 1: an empty row
    allowed = m & np.tril(np.ones((4, 6), bool))
    s = np.where(allowed, q @ np.swapaxes(k, -1, -2) / math.sqrt(5), -np.inf)
    top = s.max(-1, keepdims=True)
    e = np.exp(s - np.where(np.isfinite(top), top, 0.0))
    p = e / np.where(e.sum(-1, keepdims=True) > 0, e.sum(-1, keepdims=True), 1.0)
    out, cache = F.sdpa_forward(to_xp(q), to_xp(k), to_xp(v), mask=to_xp(m), is_causal=True)
    np.testing.assert_allclose(to_np(out), p @ v, rtol=1e-12, atol=1e-15)
    np.testing.assert_array_equal(to_np(out)[1, :, 0], 0.0)


def test_sdpa_causal_is_top_left(xp, to_xp, to_np):
    rng = np.random.default_rng(2)
    q, k, v = (to_xp(rng.standard_normal((1, 1, L, 3))) for L in (3, 5, 5))
    _, cache = F.sdpa_forward(q, k, v, is_causal=True)
    p = to_np(cache.probs)[0, 0]
    allowed = np.arange(3)[:, None] >= np.arange(5)[None, :]
    assert np.all(p[~allowed] == 0.0) and np.all(p[allowed] > 0.0)


@given(dims=attention_dims(), kind=st.sampled_from(["bool", "float_inf", "padding"]), form=mask_forms, seed=st.integers(0, 2**16))
def test_masked_keys_do_not_change_the_output(xp, to_xp, to_np, dims, kind, form, seed):
    """Changing the key/value entries that no query may see leaves the output unchanged."""
    B, H, Lq, Lk, Dh = dims
    rng = np.random.default_rng(seed)
    q, k, v = (rng.standard_normal((B, H, L, Dh)) for L in (Lq, Lk, Lk))
    m = make_mask(rng, kind, form, B, H, Lq, Lk)
    allowed = np.broadcast_to(m if m.dtype == bool else np.isfinite(m), (B, H, Lq, Lk))
    unseen = ~allowed.any(axis=2)  # [B, H, Lk] keys no query attends
    k2 = np.where(unseen[..., None], 100.0 * rng.standard_normal(k.shape), k)
    v2 = np.where(unseen[..., None], 100.0 * rng.standard_normal(v.shape), v)
    out1, _ = F.sdpa_forward(to_xp(q), to_xp(k), to_xp(v), mask=to_xp(m))
    out2, _ = F.sdpa_forward(to_xp(q), to_xp(k2), to_xp(v2), mask=to_xp(m))
    np.testing.assert_allclose(to_np(out1), to_np(out2), rtol=1e-12, atol=1e-12)


def test_sdpa_scale_zero_is_a_scale_not_the_default(xp, to_xp, to_np):
    """scale = 0 is taken as given, not as "no scale": every score is 0, so each query
    weighs the Lk keys alike (1 / Lk), out is the mean of v's rows and lse = log(Lk); the
    scores do not depend on q or k, so dq = dk = 0, and dv_j = sum_i dout_i / Lk."""
    rng = np.random.default_rng(8)
    B, H, Lq, Lk, Dh, Dv = 2, 2, 3, 5, 4, 2
    q, k = rng.standard_normal((B, H, Lq, Dh)), rng.standard_normal((B, H, Lk, Dh))
    v, dout = rng.standard_normal((B, H, Lk, Dv)), rng.standard_normal((B, H, Lq, Dv))
    out, cache = F.sdpa_forward(to_xp(q), to_xp(k), to_xp(v), scale=0.0)
    want = np.broadcast_to(np.mean(v, axis=-2, keepdims=True), (B, H, Lq, Dv))
    np.testing.assert_allclose(to_np(out), want, rtol=1e-12, atol=1e-15)
    np.testing.assert_allclose(to_np(cache.lse), np.full((B, H, Lq), math.log(Lk)), rtol=1e-12)
    dq, dk, dv, _, _ = F.sdpa_backward(to_xp(dout), cache)
    np.testing.assert_array_equal(to_np(dq), np.zeros((B, H, Lq, Dh)))
    np.testing.assert_array_equal(to_np(dk), np.zeros((B, H, Lk, Dh)))
    want_dv = np.broadcast_to(np.sum(dout, axis=-2, keepdims=True) / Lk, (B, H, Lk, Dv))
    np.testing.assert_allclose(to_np(dv), want_dv, rtol=1e-12, atol=1e-15)


def test_fully_masked_batch_gives_zeros_and_zero_gradients(xp, to_xp, to_np):
    rng = np.random.default_rng(3)
    q, k, v = (to_xp(rng.standard_normal((2, 2, L, 4))) for L in (3, 5, 5))
    m = to_xp(np.full((2, 1, 3, 5), -np.inf))
    out, cache = F.sdpa_forward(q, k, v, mask=m)
    dq, dk, dv, dmask, _ = F.sdpa_backward(to_xp(rng.standard_normal((2, 2, 3, 4))), cache)
    for a in (out, cache.probs, dq, dk, dv, dmask):
        a = to_np(a)
        assert np.all(a == 0.0) and np.all(np.isfinite(a))


def test_keep_mask_of_a_vector_is_row_0_of_the_documented_hash():
    """A 1-D shape's entries are the columns j of one row, i = 0, with no leading axes."""
    from npattn import backend as npb

    key, p = (0x0BAD_CAFE << 32) | 0x1357_9BDF, 0.5
    got = np.asarray(npb.keep_mask(key, p, (9,), np))
    assert got.shape == (9,)
    np.testing.assert_array_equal(got, [_keep_entry(key, p, (), 0, j) for j in range(9)])


def _lowbias32_inverse(x):
    """The inverse of ``_lowbias32``, its steps undone in reverse: an xorshift by 16 is its own
    inverse, one by 15 is undone by ``x ^ x >> 15 ^ x >> 30``, and a product with an odd
    constant by the product with its inverse mod 2^32."""
    x ^= x >> 16
    x = (x * pow(0x846CA68B, -1, 2**32)) & 0xFFFFFFFF
    x ^= (x >> 15) ^ (x >> 30)
    x = (x * pow(0x7FEB352D, -1, 2**32)) & 0xFFFFFFFF
    x ^= x >> 16
    return x


def test_keep_mask_at_the_edges_of_p_and_of_the_key():
    """Keys made for entry (0, 0) of a 2-D mask to hash to a chosen u: with its high half 0
    (hash(0) = 0) u = hash(hash(lo)), so lo = hash^-1(hash^-1(u)). At p = 0 the entry of
    u = 0 is kept (every entry is). At p = 1 - 2^-40, round(p 2^32) = 2^32 is clipped to
    2^32 - 1: only u = 2^32 - 1 is kept and u = 2^32 - 2 is dropped (a threshold of 2^32
    does not fit uint32; one of 2^32 - 2 would keep it). Keys up to 2^64 - 1 are taken, the
    documented hash of both halves; 2^64 is refused. A 0-d shape is entry (0, 0)."""
    from npattn import backend as npb

    assert _lowbias32(0) == 0 and all(_lowbias32(_lowbias32_inverse(u)) == u for u in (1, 2**31, 2**32 - 1))
    near_1 = 1 - 2.0**-40
    for u, p, kept in ((0, 0.0, True), (2**32 - 1, near_1, True), (2**32 - 2, near_1, False),
                       (2**32 - 1, 0.5, True), (0, 2.0**-33, True), (0, 2.0**-32, False)):
        key = _lowbias32_inverse(_lowbias32_inverse(u))
        assert _entry_hash(key, (), 0, 0) == u
        assert bool(npb.keep_mask(key, p, (1, 1), np)[0, 0]) is kept, (u, p)
        assert bool(npb.keep_mask(key, p, (), np)) is kept, (u, p)
    assert not npb.keep_mask(5, near_1, (4, 6), np).any()  # each kept with probability 2^-32
    for key in (2**63, 2**64 - 1, (0xFFFF_0000 << 32) | 7):
        want = [[_keep_entry(key, 0.4, (), i, j) for j in range(5)] for i in range(3)]
        np.testing.assert_array_equal(npb.keep_mask(key, 0.4, (3, 5), np), want)
    with pytest.raises(ValueError, match=rf"^key: expected an int in \[0, 2\*\*64\) \(from dropout_key\), "
                                         rf"got {2**64}$"):
        npb.keep_mask(2**64, 0.4, (3, 5), np)


def test_keep_mask_takes_a_shape_with_empty_axes_and_refuses_bytes():
    """A shape is a sequence of ints >= 0: a length of 0 gives a mask of that shape with no
    entries; bytes, whose items are ints, are not taken for a shape."""
    from npattn import backend as npb

    for shape in ((2, 0, 3), (0, 4), (3, 0), (0,)):
        got = npb.keep_mask(7, 0.3, shape, np)
        assert got.shape == shape and got.dtype == np.bool_
    with pytest.raises(TypeError, match=r"^shape: expected a sequence of ints >= 0, got b'\\x02\\x03'$"):
        npb.keep_mask(7, 0.3, b"\x02\x03", np)


def test_a_drop_probability_of_1_is_refused_by_the_mask_draw():
    from npattn import backend as npb

    with pytest.raises(ValueError, match=r"^p: expected a drop probability in \[0, 1\), got 1\.0"):
        npb.keyed_keep_mask(1, 1.0, [], np.arange(2), np.arange(2))


def test_dropout_keys_use_the_high_32_bits():
    """Keys are uniform in [0, 2**63): the high half is what picks the column hash, so keys all
    below 2**32 would give one column hash for every draw. Of 16 keys, all below 2**32 has
    probability 2**-496."""
    from npattn import backend as npb

    keys = [npb.dropout_key(s) for s in range(16)]
    assert all(0 <= k < 2**63 for k in keys)
    assert max(keys) >= 2**32


def test_a_seeds_key_is_the_top_63_bits_of_the_generators_next_word():
    """One seed gives one key, hence one mask, from version to version: the key is the high 63
    bits of the next 64-bit word of the caller's bit generator (NumPy's integers(0, 2**63)
    maps a word so), read here from the raw word of a twin generator, and the generator
    advances by that one word. The same for a seed, a Generator and a SeedSequence."""
    from npattn import backend as npb

    for seed in [*range(32), 2**40 + 3]:
        word = int(np.random.default_rng(seed).bit_generator.random_raw())  # [0, 2**64)
        assert npb.dropout_key(seed) == word >> 1
        assert npb.dropout_key(np.random.SeedSequence(seed)) == word >> 1
        gen, twin = np.random.default_rng(seed), np.random.default_rng(seed)
        assert npb.dropout_key(gen) == int(twin.bit_generator.random_raw()) >> 1
        assert gen.bit_generator.state == twin.bit_generator.state


def test_a_batch_of_one_broadcast_to_an_empty_batch_gets_zero_gradients_of_its_shape(xp, to_xp, to_np):
    """q and the mask have batch 1, k and v batch 0: the output has batch 0, and the gradient
    of each batch-1 input is the sum of nothing over the batch axis it was stretched along,
    zeros of that input's own shape."""
    rng = np.random.default_rng(4)
    q = to_xp(rng.standard_normal((1, 2, 3, 4)))
    k, v = (to_xp(rng.standard_normal((0, 2, 5, 4))) for _ in range(2))
    m = to_xp(rng.standard_normal((1, 1, 3, 5)))
    out, cache = F.sdpa_forward(q, k, v, mask=m)
    assert tuple(out.shape) == (0, 2, 3, 4)
    dq, dk, dv, dmask, _ = F.sdpa_backward(to_xp(np.zeros((0, 2, 3, 4))), cache)
    assert tuple(dk.shape) == tuple(dv.shape) == (0, 2, 5, 4)
    for g, want in ((dq, (1, 2, 3, 4)), (dmask, (1, 1, 3, 5))):
        assert tuple(g.shape) == want
        assert np.all(to_np(g) == 0.0)


@pytest.mark.parametrize("options", [dict(is_causal=True), dict(window=(1, 1))])
def test_dmask_of_a_broadcast_float_mask_under_causal_or_a_window_has_the_masks_shape(
        xp, to_xp, to_np, options):
    """The causal mask or the window makes the combined mask [Lq, Lk] even when the float mask
    is one row [Lk]: dmask is summed back to [Lk]. Expected: the same call with the mask
    written out to [B, H, Lq, Lk], its dmask summed here over the axes the row was broadcast
    along (the positions the causal mask or the window forbids have dmask 0 there)."""
    rng = np.random.default_rng(5)
    B, H, Lq, Lk, D = 2, 2, 3, 5, 4
    q, k, v = (rng.standard_normal((B, H, L, D)) for L in (Lq, Lk, Lk))
    row = rng.standard_normal(Lk)
    dout = rng.standard_normal((B, H, Lq, D))
    grads = []
    for m in (row, np.broadcast_to(row, (B, H, Lq, Lk)).copy()):
        _, cache = F.sdpa_forward(*(to_xp(a) for a in (q, k, v)), mask=to_xp(m), **options)
        grads.append(to_np(F.sdpa_backward(to_xp(dout), cache).dmask))
    assert grads[0].shape == (Lk,)
    np.testing.assert_allclose(grads[0], grads[1].sum(axis=(0, 1, 2)), rtol=1e-12, atol=1e-14)


def test_is_plain_only_when_the_alignment_changes_nothing():
    """Bottom-right alignment (offset Lk - Lq = 2) moves the causal diagonal, so causal
    attention with it is not the plain one; without is_causal the offset changes nothing."""
    shifted = F.PLAIN._replace(offset=2)
    assert F.is_plain(F.PLAIN, True) and F.is_plain(shifted, False)
    assert not F.is_plain(shifted, True)
    assert not F.is_plain(F.PLAIN._replace(right=1), False)
