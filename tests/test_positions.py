"""npattn.positions: RoPE, Shaw's relative embeddings and T5's bucketed bias.

Every pair is checked against central finite differences in float64 with a
random upstream gradient, on every backend fixture, with Lq != Lk where the
op has two lengths; forwards against references written here from the
formulas (and against torch code for ``rotate_half`` and T5's buckets).
"""

import importlib.util
import math
import warnings

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from npattn import functional as F
from npattn import positions as P
from npattn.backend import namespace
from npattn.gradcheck import gradcheck

from reliability_helpers import raises

RTOL = 1e-6


def assert_ok(report):
    # every input within atol + rtol * scale, rtol = RTOL and atol float64's rounding floor
    # of a central difference (a bound on max_rel_err alone fails gradients of scale 1e-3
    # whose error is that rounding)
    assert report.ok and report.rtol <= RTOL, "\n" + str(report)


# --------------------------------------------------------------------------
# references written from the formulas, in NumPy float64


def rope_reference(x, pos, base=10000.0, interleaved=False):
    """Loop over pairs: (a, b) -> (a cos - b sin, b cos + a sin), theta = p * base^(-2c/Dh)."""
    x = np.asarray(x, dtype=np.float64)
    Dh = x.shape[-1]
    pos = np.broadcast_to(np.asarray(pos, dtype=np.float64), x.shape[:-1])
    out = np.empty_like(x)
    for c in range(Dh // 2):
        a, b = (2 * c, 2 * c + 1) if interleaved else (c, c + Dh // 2)
        theta = pos * base ** (-2.0 * c / Dh)
        out[..., a] = x[..., a] * np.cos(theta) - x[..., b] * np.sin(theta)
        out[..., b] = x[..., b] * np.cos(theta) + x[..., a] * np.sin(theta)
    return out


def shaw_reference(table, Lq, Lk, offset=0):
    K = (table.shape[0] - 1) // 2
    out = np.empty((Lq, Lk, table.shape[1]))
    for i in range(Lq):
        for j in range(Lk):
            out[i, j] = table[min(max(j - i - offset, -K), K) + K]
    return out


def t5_bucket_reference(n_rel, bidirectional=True, num_buckets=32, max_distance=128):
    """T5's formula for one relative position, its log step in float32 as T5 and HF do."""
    bucket = 0
    if bidirectional:
        num_buckets //= 2
        bucket += num_buckets if n_rel > 0 else 0
        n = abs(n_rel)
    else:
        n = max(-n_rel, 0)
    max_exact = num_buckets // 2
    if n < max_exact:
        return bucket + n
    ratio = np.float32(n) / np.float32(max_exact)
    val = np.float32(np.log(ratio)) / np.float32(math.log(max_distance / max_exact))
    large = max_exact + int(np.float32(val * np.float32(num_buckets - max_exact)))
    return bucket + min(large, num_buckets - 1)


# --------------------------------------------------------------------------
# RoPE


@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("positions", [None, 5, "array"])
def test_rope_gradcheck(xp, to_xp, interleaved, positions):
    rng = np.random.default_rng(1)
    x = to_xp(rng.standard_normal((2, 3, 4, 6)))
    if positions == "array":  # per-sequence offsets, (B, 1, L), and not integers
        positions = to_xp(np.array([[[0.0, 1.0, 2.0, 3.0]], [[7.5, 8.5, 9.5, 10.5]]]))
    report = gradcheck(lambda t: P.rope_forward(t, positions, interleaved=interleaved),
                       lambda d, c: P.rope_backward(d, c)[0], [x], names=["x"], mode="full")
    assert_ok(report)


@pytest.mark.parametrize("interleaved", [False, True])
def test_rope_matches_the_formula(xp, to_xp, to_np, interleaved):
    rng = np.random.default_rng(2)
    x = rng.standard_normal((2, 5, 8))
    for positions, pos in [(None, np.arange(5)), (3, 3 + np.arange(5)),
                           (to_xp(np.array([4, 0, 9, 2, 2])), np.array([4, 0, 9, 2, 2]))]:
        out, _ = P.rope_forward(to_xp(x), positions, base=500.0, interleaved=interleaved)
        assert namespace(out) is xp
        np.testing.assert_allclose(to_np(out), rope_reference(x, pos, 500.0, interleaved),
                                   rtol=1e-12, atol=1e-12)


def test_rope_offset_equals_the_slice_of_a_longer_sequence(xp, to_xp, to_np):
    """Decoding with a KV cache: the last 2 positions of 7, rotated with positions=5."""
    x = np.random.default_rng(3).standard_normal((1, 2, 7, 4))
    full, _ = P.rope_forward(to_xp(x))
    tail, _ = P.rope_forward(to_xp(x[:, :, 5:]), 5)
    np.testing.assert_allclose(to_np(tail), to_np(full)[:, :, 5:], rtol=1e-13, atol=1e-13)


def test_rope_positions_past_the_integers_of_float32(xp, to_xp, to_np):
    """The angles are computed from float64 positions: past 2**24, where float32 rounds
    neighbouring positions to one value, each position keeps its own rotation."""
    x = np.random.default_rng(18).standard_normal((1, 3, 4))
    start = 2**24 + 1
    for positions in (start, to_xp(start + np.arange(3))):
        out, _ = P.rope_forward(to_xp(x), positions)
        np.testing.assert_allclose(to_np(out), rope_reference(x, start + np.arange(3)), rtol=0, atol=1e-6)


def test_rope_int_start_at_the_ends_of_int64(xp, to_xp, to_np):
    """An int start works while start + L fits int64, on every library, and past it is a
    ValueError naming positions (torch raised OverflowError or RuntimeError, NumPy made an
    object array)."""
    x = to_xp(np.random.default_rng(4).standard_normal((1, 1, 3, 4)))
    for start in (2**63 - 4, -(2**63)):
        out, _ = P.rope_forward(x, start)
        assert np.all(np.isfinite(to_np(out)))
    for start in (2**63 - 3, 2**70, -(2**63) - 1, np.uint64(2**63)):
        with pytest.raises(ValueError, match="^positions: expected an int start with start \\+ L "
                                             "within int64 \\(L = 3\\)"):
            P.rope_forward(x, start)


def test_rope_positions_broadcast_along_the_sequence_are_refused(xp, to_xp, to_np):
    """A start per sequence given as an array of shape (B, 1, 1) (or a 0-d array) would put
    every token of a row at that one position, where an int start counts up from it: refused by
    name where L > 1; the per-token positions start[..., None] + arange(L) rotate as the
    loop over pairs does, and with L = 1 one position per row is what it says (L = 2 is refused:
    a bound of L > 2 let two tokens sit at one position)."""
    rng = np.random.default_rng(7)
    x = rng.standard_normal((2, 1, 3, 4))
    starts = np.array([4, 9])
    for x_in, positions in ((to_xp(x), to_xp(starts[:, None, None])), (to_xp(x), to_xp(np.array(4))),
                            (x, np.float64(4.0))):  # NumPy's float scalar is a 0-d array to it
        with pytest.raises(ValueError, match=r"^positions: expected one position per token \(a last "
                                             r"axis of L = 3\), got shape \((2, 1, 1|)\)"):
            P.rope_forward(x_in, positions)
    with pytest.raises(ValueError, match=r"^positions: expected one position per token \(a last "
                                         r"axis of L = 2\), got shape \(2, 1, 1\)"):
        P.rope_forward(to_xp(x[:, :, :2]), to_xp(starts[:, None, None]))  # L = 2, the least refused
    per_token = starts[:, None, None] + np.arange(3)  # [2, 1, 3]
    out, _ = P.rope_forward(to_xp(x), to_xp(per_token))
    np.testing.assert_allclose(to_np(out), rope_reference(x, per_token), rtol=0, atol=1e-12)
    one = rng.standard_normal((2, 1, 1, 4))
    out, _ = P.rope_forward(to_xp(one), to_xp(starts[:, None, None]))
    np.testing.assert_allclose(to_np(out), rope_reference(one, starts[:, None, None]), rtol=0, atol=1e-12)
    # one position for every token, meant (flash-attn's non-causal rotary): broadcast explicitly
    same = np.broadcast_to(starts[:, None, None], (2, 1, 3))
    out, _ = P.rope_forward(to_xp(x), to_xp(np.ascontiguousarray(same)))
    np.testing.assert_allclose(to_np(out), rope_reference(x, same), rtol=0, atol=1e-12)


@pytest.mark.parametrize("interleaved", [False, True])
def test_rope_backward_is_the_rotation_by_minus_theta(xp, to_xp, to_np, interleaved):
    rng = np.random.default_rng(4)
    pos = np.array([0, 3, 1, 8])
    dout = rng.standard_normal((3, 4, 6))
    _, cache = P.rope_forward(to_xp(rng.standard_normal((3, 4, 6))), to_xp(pos), interleaved=interleaved)
    dx, dpos = P.rope_backward(to_xp(dout), cache)
    assert dpos is None
    back, _ = P.rope_forward(to_xp(dout), to_xp(-pos), interleaved=interleaved)
    np.testing.assert_allclose(to_np(dx), to_np(back), rtol=1e-13, atol=1e-13)


@pytest.mark.parametrize("base, start", [(10000.0, 4), (10000.0, 0), (500000.0, 1021), (37.5, 9)])
@pytest.mark.parametrize("interleaved", [False, True])
def test_rope_matches_torch_rotate_half(interleaved, base, start):
    """HF LLaMA's rotate_half (half-split) and GPT-J's rotate_every_two (interleaved), in torch,
    with LLaMA 3's base and another, from positions 0 and past 1000."""
    torch = pytest.importorskip("torch")
    if importlib.util.find_spec("transformers") is not None:
        from transformers.models.llama.modeling_llama import rotate_half  # the library's own
    else:
        def rotate_half(x):
            x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2:]
            return torch.cat((-x2, x1), dim=-1)

    def rotate_every_two(x):
        x1, x2 = x[..., ::2], x[..., 1::2]
        return torch.stack((-x2, x1), dim=-1).flatten(-2)

    B, H, L, Dh = 2, 3, 5, 8
    q = torch.randn(B, H, L, Dh, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    inv_freq = 1.0 / (base ** (torch.arange(0, Dh, 2, dtype=torch.float64) / Dh))
    t = torch.arange(start, start + L, dtype=torch.float64)
    freqs = torch.outer(t, inv_freq)  # [L, Dh/2]
    if interleaved:
        emb = torch.repeat_interleave(freqs, 2, dim=-1)
        expected = q * emb.cos() + rotate_every_two(q) * emb.sin()
    else:
        emb = torch.cat((freqs, freqs), dim=-1)
        expected = q * emb.cos() + rotate_half(q) * emb.sin()
    out, _ = P.rope_forward(q, start, base=base, interleaved=interleaved)
    torch.testing.assert_close(out, expected, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("interleaved", [False, True])
def test_rope_in_attention_backward_by_central_differences(interleaved):
    """Queries at odd positions 5, 7, 9 (the last of Lk = 8 keys, at positions -3, -1, ..., 11:
    an offset to each side) and keys at their own; rotated, then causal bottom-right attention.
    The gradients of q and k through rope_backward, contracted with a random direction, match
    float64 central differences of <out, dout> for a random dout."""
    rng = np.random.default_rng(21)
    Lq, Lk, Dh = 3, 8, 6
    q, k, v = (rng.standard_normal((2, 2, n, Dh)) for n in (Lq, Lk, Lk))
    dout = rng.standard_normal((2, 2, Lq, Dh))
    pq, pk = np.array([5, 7, 9]), np.arange(-3, 13, 2)  # [Lq], [Lk]
    rot = dict(interleaved=interleaved, base=100.0)

    def forward(q, k):
        qr, q_c = P.rope_forward(q, pq, **rot)
        kr, k_c = P.rope_forward(k, pk, **rot)
        out, c = F.sdpa_forward(qr, kr, v, is_causal=True, align="bottom_right")
        return out, (q_c, k_c, c)

    out, (q_c, k_c, c) = forward(q, k)
    dqr, dkr = F.sdpa_backward(dout, c)[:2]
    dq, dk = P.rope_backward(dqr, q_c)[0], P.rope_backward(dkr, k_c)[0]
    tq, tk, eps = rng.standard_normal(q.shape), rng.standard_normal(k.shape), 1e-6
    plus = np.sum(forward(q + eps * tq, k + eps * tk)[0] * dout)
    minus = np.sum(forward(q - eps * tq, k - eps * tk)[0] * dout)
    np.testing.assert_allclose(np.sum(dq * tq) + np.sum(dk * tk), (plus - minus) / (2 * eps), rtol=1e-8)
    assert np.abs(dq).max() > 1e-3 and np.abs(dk).max() > 1e-3


def test_rope_float32_stays_float32(xp, to_xp):
    x = to_xp(np.random.default_rng(5).standard_normal((2, 3, 4)).astype(np.float32))
    out, cache = P.rope_forward(x, 1000)
    assert out.dtype == xp.float32
    assert P.rope_backward(out, cache)[0].dtype == xp.float32


def test_rope_half_precision_comes_back_in_half_precision(xp, to_xp, to_np):
    """float16 is rotated in float32 and rounded once, to float16, forward and backward: out
    and dx are float16, within float16's rounding of the float64 rotations (by theta, and by
    -theta for the gradient)."""
    if not hasattr(xp, "float16"):
        pytest.skip("the backend has no float16")
    rng = np.random.default_rng(15)
    x = rng.standard_normal((2, 5, 8)).astype(np.float16)
    dout = rng.standard_normal((2, 5, 8)).astype(np.float16)
    pos = 3 + np.arange(5)
    out, cache = P.rope_forward(to_xp(x), 3)
    dx, _ = P.rope_backward(to_xp(dout), cache)
    assert out.dtype == dx.dtype == xp.float16
    for got, exact in ((out, rope_reference(x, pos)), (dx, rope_reference(dout, -pos))):
        # rounded once: within half a float16 spacing of the exact rotation, plus float32's
        # error (rotating in float16 rounds cos, sin, the products and the sums on top)
        half_ulp = 0.5 * np.spacing(np.abs(exact).astype(np.float16)).astype(np.float64)
        err = np.abs(to_np(got).astype(np.float64) - exact)
        assert np.all(err <= half_ulp + 1e-6 * np.abs(exact)), (err / half_ulp).max()


def test_the_default_base_is_10000(xp, to_xp, to_np):
    """RoFormer's and LLaMA's base, 10000, when none is given: theta = p * 10000^(-2c/Dh)."""
    x = np.random.default_rng(16).standard_normal((2, 5, 8))
    out, _ = P.rope_forward(to_xp(x))
    np.testing.assert_allclose(to_np(out), rope_reference(x, np.arange(5), 10000.0), rtol=1e-12, atol=1e-12)
    pos = np.array([0.0, 1.0, 7.0, 1000.0])
    c = np.arange(4)
    want = pos[:, None] * 10000.0 ** (-2.0 * c[None, :] / 8)  # [4, Dh/2]
    got = P.rope_angles(xp, to_xp(pos), 8, dtype="float32")
    np.testing.assert_allclose(to_np(got), want, rtol=1e-6)


def test_relative_forms_keep_float32(xp, to_xp):
    rng = np.random.default_rng(14)
    q = to_xp(rng.standard_normal((2, 3, 4)).astype(np.float32))
    table = to_xp(rng.standard_normal((5, 4)).astype(np.float32))
    bias, cache = P.relative_scores_forward(q, table, 6)
    dq, dtable, _ = P.relative_scores_backward(bias, cache)
    assert bias.dtype == dq.dtype == dtable.dtype == xp.float32
    # a NumPy float64 scale multiplies as a Python float would: float32 stays float32
    bias, cache = P.relative_scores_forward(q, table, 6, scale=np.float64(0.5))
    dq, dtable, _ = P.relative_scores_backward(bias, cache)
    assert bias.dtype == dq.dtype == dtable.dtype == xp.float32
    out, cache = P.relative_bias_forward(to_xp(rng.standard_normal((8, 2)).astype(np.float32)), 3, 5,
                                         max_distance=6)
    assert out.dtype == P.relative_bias_backward(out, cache)[0].dtype == xp.float32


@given(seed=st.integers(0, 2**16), interleaved=st.booleans(), half=st.integers(1, 6),
       i=st.integers(-50, 500), j=st.integers(-50, 500), shift=st.integers(-1000, 1000))
def test_rope_preserves_norms_and_scores_depend_on_the_difference(seed, interleaved, half, i, j, shift):
    rng = np.random.default_rng(seed)
    q, k = rng.standard_normal((1, 2 * half)), rng.standard_normal((1, 2 * half))

    def rot(x, p):
        return P.rope_forward(x, np.array([float(p)]), interleaved=interleaved)[0]

    qi, kj = rot(q, i), rot(k, j)
    assert np.linalg.norm(qi) == pytest.approx(np.linalg.norm(q), rel=1e-12)
    assert np.linalg.norm(kj) == pytest.approx(np.linalg.norm(k), rel=1e-12)
    moved = float(np.sum(rot(q, i + shift) * rot(k, j + shift)))
    assert moved == pytest.approx(float(np.sum(qi * kj)), rel=1e-9, abs=1e-9)
    # and only through i - j: q at i - j, k at 0
    assert float(np.sum(rot(q, i - j) * k)) == pytest.approx(float(np.sum(qi * kj)), rel=1e-9, abs=1e-9)


# --------------------------------------------------------------------------
# the diagonals


@pytest.mark.parametrize("Lq,Lk", [(1, 4), (3, 5), (5, 2), (4, 4)])
def test_diagonal_sums_and_spread(xp, to_xp, to_np, Lq, Lk):
    rng = np.random.default_rng(6)
    a = rng.standard_normal((2, Lq, Lk))
    sums = to_np(P.diagonal_sums(xp, to_xp(a)))
    expected = np.zeros((2, Lq + Lk - 1))
    for i in range(Lq):
        for j in range(Lk):
            expected[:, j - i + Lq - 1] += a[:, i, j]
    np.testing.assert_allclose(sums, expected, rtol=1e-13, atol=1e-13)
    rows = rng.standard_normal((Lq + Lk - 1, 3))
    spread = to_np(P.diagonal_spread(xp, to_xp(rows), Lq, Lk))
    for i in range(Lq):
        for j in range(Lk):
            np.testing.assert_array_equal(spread[i, j], rows[j - i + Lq - 1])


def test_half_precision_diagonal_sums_run_in_float32():
    """The diagonals of a float16 array are summed in float32 and rounded once (NumPy adds
    float16 along an axis in float16, where a sum of ones stops at 2048): the relative
    biases' and embeddings' table gradients over long sequences."""
    L = 2100
    sums = P.diagonal_sums(np, np.ones((L, L), dtype=np.float16))
    assert sums.dtype == np.float16
    expected = L - np.abs(np.arange(2 * L - 1) - (L - 1))  # diagonal t has L - |t - (L - 1)| ones
    np.testing.assert_array_equal(sums, expected.astype(np.float16))
    _, cache = P.relative_bias_forward(np.zeros((32, 1), dtype=np.float16), L, L)
    # the far bucket gathers 2019045 positions, past float16's largest value (65504): its
    # gradient is inf, as the exact sum rounded to float16 is, and NumPy says so
    with pytest.warns(RuntimeWarning, match="overflow"):
        dtable = P.relative_bias_backward(np.ones((1, 1, L, L), dtype=np.float16), cache)[0]
    assert float(dtable[0, 0]) == L  # bucket 0: the L positions with j = i
    _, cache64 = P.relative_bias_forward(np.zeros((32, 1)), L, L)
    exact = P.relative_bias_backward(np.ones((1, 1, L, L)), cache64)[0]  # integers, exact
    with np.errstate(over="ignore"):
        np.testing.assert_array_equal(dtable, exact.astype(np.float16))  # each rounded once


def test_an_infinite_table_entry_is_read_only_where_it_is_looked_up(xp, to_xp, to_np):
    """A -inf bias of one bucket is a mask (sdpa takes -inf in a float mask): the lookup is
    ``table[bucket]``, so the other buckets' entries stay finite. As the product
    ``one_hot @ table`` it was 0 * -inf = NaN in every entry of that head."""
    Lq, Lk = 3, 5
    table = np.arange(16.0).reshape(8, 2)  # bidirectional: buckets 0-3 for j <= i, 4-7 for j > i
    table[0, 0] = -np.inf  # head 0 does not attend to its own position (j - i = 0)
    out = to_np(P.relative_bias_forward(to_xp(table), Lq, Lk, max_distance=10)[0])
    buckets = np.array([[t5_bucket_reference(j - i, True, 8, 10) for j in range(Lk)]
                        for i in range(Lq)])
    np.testing.assert_array_equal(out, table[buckets].transpose(2, 0, 1)[None])
    assert np.isneginf(out[0, 0]).sum() == Lq and not np.isnan(out).any()
    shaw = np.arange(10.0).reshape(5, 2)
    shaw[0, 1] = np.inf  # the clipped far row, read by j - i <= -2 only
    emb = to_np(P.relative_embedding_forward(to_xp(shaw), Lq, Lk)[0])
    np.testing.assert_array_equal(emb, shaw_reference(shaw, Lq, Lk))
    assert not np.isnan(emb).any()


def test_half_precision_table_gradients_are_rounded_once():
    """The table gradients of half-precision relative biases and embeddings are computed in
    float32 and rounded once. Rounded per diagonal first, a diagonal of 40000 + 40000
    overflowed float16 although its bucket's total, with -60000 from the next diagonal, is
    20000; then 0 * inf in ``C^T @ drows`` made every other bucket NaN."""
    dout = np.zeros((1, 1, 3, 3), dtype=np.float16)
    dout[0, 0, 0, 1] = dout[0, 0, 1, 2] = 40000.0  # j - i = 1
    dout[0, 0, 0, 2] = -60000.0  # j - i = 2, the same bucket (3) of 4 buckets
    _, cache = P.relative_bias_forward(np.zeros((4, 1), dtype=np.float16), 3, 3, max_distance=10)
    dtable = P.relative_bias_backward(dout, cache)[0]
    assert dtable.dtype == np.float16
    np.testing.assert_array_equal(dtable[:, 0], [0.0, 0.0, 0.0, 20000.0])
    # Shaw's table of 3 rows: j - i = 1 and 2 both read the clipped row 2
    _, cache = P.relative_embedding_forward(np.zeros((3, 1), dtype=np.float16), 3, 3)
    dtable = P.relative_embedding_backward(np.moveaxis(dout[0], 0, -1), cache)[0]
    np.testing.assert_array_equal(dtable[:, 0], [0.0, 0.0, 20000.0])
    # random data: each entry is the float64 gradient rounded once to float16
    rng = np.random.default_rng(4)
    L = 40
    table = rng.standard_normal((32, 4)).astype(np.float16)
    d = (100 * rng.standard_normal((2, 4, L, L))).astype(np.float16)
    got = P.relative_bias_backward(d, P.relative_bias_forward(table, L, L)[1])[0]
    exact = P.relative_bias_backward(d.astype(np.float64),
                                     P.relative_bias_forward(table.astype(np.float64), L, L)[1])[0]
    np.testing.assert_array_equal(got, exact.astype(np.float16))
    shaw = rng.standard_normal((9, 8)).astype(np.float16)
    d = (100 * rng.standard_normal((L, L, 8))).astype(np.float16)
    got = P.relative_embedding_backward(d, P.relative_embedding_forward(shaw, L, L)[1])[0]
    exact = P.relative_embedding_backward(
        d.astype(np.float64), P.relative_embedding_forward(shaw.astype(np.float64), L, L)[1])[0]
    np.testing.assert_array_equal(got, exact.astype(np.float16))


def test_half_precision_relative_scores_gradients_scale_in_float32():
    """A float16 dbias is scaled in float32: with scale 4, a dbias of 30000 is 120000 there,
    past float16's largest value (65504), while dq and dtable (2400 each here) fit. Scaled
    in float16 it was inf, and so were both gradients."""
    q = np.full((1, 1, 2, 1), 0.01, dtype=np.float16)  # [B, H, Lq, E]
    table = np.full((3, 1), 0.01, dtype=np.float16)  # rows for j - i = -1, 0, 1
    dbias = np.full((1, 1, 2, 2), 30000.0, dtype=np.float16)
    bias, cache = P.relative_scores_forward(q, table, 2, scale=4.0)
    dq, dtable, _ = P.relative_scores_backward(dbias, cache)
    q64, t64, d64 = (a.astype(np.float64) for a in (q, table, dbias))
    # the bias comes back in q's dtype too: every entry is 4 * q_i * table[r] = 4 * 0.01 * 0.01
    assert bias.dtype == np.float16
    np.testing.assert_allclose(bias.astype(np.float64), np.full((1, 1, 2, 2), 4.0 * q64[0, 0, 0, 0] * t64[0, 0]),
                               rtol=2e-3)
    # bias[i, j] = 4 q_i . table[j - i + 1]: dq_i = 4 sum_j dbias_ij table[j - i + 1],
    # dtable[r] = 4 sum over the pairs with j - i + 1 = r of dbias_ij q_i
    want_dq = 4.0 * np.einsum("bhij,ije->bhie", d64, shaw_reference(t64, 2, 2))
    want_dtable = np.zeros((3, 1))
    for i in range(2):
        for j in range(2):
            want_dtable[j - i + 1] += 4.0 * d64[0, 0, i, j] * q64[0, 0, i]
    assert dq.dtype == dtable.dtype == np.float16
    np.testing.assert_allclose(dq.astype(np.float64), want_dq, rtol=2e-3)
    np.testing.assert_allclose(dtable.astype(np.float64), want_dtable, rtol=2e-3)


# --------------------------------------------------------------------------
# Shaw et al.


@pytest.mark.parametrize("Lq,Lk,offset", [(3, 5, 0), (5, 3, 0), (2, 6, 4), (4, 4, -1)])
def test_relative_embedding_forward_and_gradcheck(xp, to_xp, to_np, Lq, Lk, offset):
    rng = np.random.default_rng(7)
    table = rng.standard_normal((7, 3))  # M = 4: the distances beyond +-3 are clipped
    out, _ = P.relative_embedding_forward(to_xp(table), Lq, Lk, offset=offset)
    np.testing.assert_array_equal(to_np(out), shaw_reference(table, Lq, Lk, offset))
    report = gradcheck(lambda t: P.relative_embedding_forward(t, Lq, Lk, offset=offset),
                       lambda d, c: P.relative_embedding_backward(d, c)[0], [to_xp(table)],
                       names=["table"], mode="full")
    assert_ok(report)


def test_relative_embedding_backward_is_a_scatter_add(xp, to_xp, to_np):
    rng = np.random.default_rng(8)
    Lq, Lk, M = 4, 6, 3
    table = rng.standard_normal((2 * M - 1, 2))
    dout = rng.standard_normal((Lq, Lk, 2))
    _, cache = P.relative_embedding_forward(to_xp(table), Lq, Lk)
    dtable = to_np(P.relative_embedding_backward(to_xp(dout), cache)[0])
    expected = np.zeros_like(table)
    rows = np.clip(np.arange(Lk)[None, :] - np.arange(Lq)[:, None], -(M - 1), M - 1) + M - 1
    np.add.at(expected, rows, dout)
    np.testing.assert_allclose(dtable, expected, rtol=1e-13, atol=1e-13)


@pytest.mark.parametrize("Lq,Lk", [(3, 5), (5, 3)])
def test_relative_scores_forward_and_gradcheck(xp, to_xp, to_np, Lq, Lk):
    rng = np.random.default_rng(9)
    q = rng.standard_normal((2, 3, Lq, 4))
    table = rng.standard_normal((9, 4))
    bias, _ = P.relative_scores_forward(to_xp(q), to_xp(table), Lk)
    rel = shaw_reference(table, Lq, Lk)
    expected = np.einsum("bhie,ije->bhij", q, rel) / math.sqrt(4)
    np.testing.assert_allclose(to_np(bias), expected, rtol=1e-12, atol=1e-12)
    # query i at key position i + offset: the same table, read at j - i - offset
    shifted, _ = P.relative_scores_forward(to_xp(q), to_xp(table), Lk, offset=2)
    expected = np.einsum("bhie,ije->bhij", q, shaw_reference(table, Lq, Lk, offset=2)) / math.sqrt(4)
    np.testing.assert_allclose(to_np(shifted), expected, rtol=1e-12, atol=1e-12)
    square, _ = P.relative_scores_forward(to_xp(q), to_xp(table))  # Lk defaults to Lq
    expected = np.einsum("bhie,ije->bhij", q, shaw_reference(table, Lq, Lq)) / math.sqrt(4)
    np.testing.assert_allclose(to_np(square), expected, rtol=1e-12, atol=1e-12)
    report = gradcheck(lambda a, t: P.relative_scores_forward(a, t, Lk, offset=1, scale=0.7),
                       lambda d, c: P.relative_scores_backward(d, c)[:2],
                       [to_xp(q), to_xp(table)], names=["q", "table"], mode="full")
    assert_ok(report)


def _relative_sdpa(q, k, v, table):
    """Shaw's attention: sdpa with the relative term as its floating mask (a composition of pairs)."""
    bias, rel_cache = P.relative_scores_forward(q, table, k.shape[-2])  # [B, H, Lq, Lk]
    out, sdpa_cache = F.sdpa_forward(q, k, v, mask=bias)  # [B, H, Lq, Dh]
    return out, (rel_cache, sdpa_cache)


def _relative_sdpa_backward(dout, cache):
    rel_cache, sdpa_cache = cache
    dq, dk, dv, dmask, _ = F.sdpa_backward(dout, sdpa_cache)  # dmask: [B, H, Lq, Lk]
    dq_rel, dtable, _ = P.relative_scores_backward(dmask, rel_cache)
    return dq + dq_rel, dk, dv, dtable  # q is used twice: its gradients add


def test_relative_scores_through_sdpa_mask(xp, to_xp, to_np):
    rng = np.random.default_rng(10)
    B, H, Lq, Lk, Dh = 2, 2, 3, 5, 4
    q, k, v = (to_xp(rng.standard_normal(s)) for s in [(B, H, Lq, Dh), (B, H, Lk, Dh), (B, H, Lk, Dh)])
    table = to_xp(rng.standard_normal((2 * 4 - 1, Dh)))
    report = gradcheck(_relative_sdpa, _relative_sdpa_backward, [q, k, v, table],
                       names=["q", "k", "v", "table"], mode="full")
    assert_ok(report)
    # Shaw's formula, written out: e_ij = q_i . (k_j + r_{j-i}) / sqrt(Dh)
    qn, kn, vn, tn = (to_np(a) for a in (q, k, v, table))
    e = (qn @ np.swapaxes(kn, -1, -2) + np.einsum("bhie,ije->bhij", qn, shaw_reference(tn, Lq, Lk))) / 2.0
    p = np.exp(e - e.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    np.testing.assert_allclose(to_np(_relative_sdpa(q, k, v, table)[0]), p @ vn, rtol=1e-12, atol=1e-12)


# --------------------------------------------------------------------------
# T5


# (False, 9, 128) and (True, 18, 128): log(8 / 4) / log(128 / 4) * 5 is 1 exactly, which the
# float32 log step rounds up (bucket 5 at distance 8) and a float64 one down (bucket 4);
# (True, 33, 128): an odd number both ways is halved down, 16 buckets a side (the 33rd unused)
T5_CONFIGS = [(True, 32, 128), (False, 32, 128), (True, 8, 20), (False, 6, 9), (True, 64, 256),
              (False, 9, 128), (True, 18, 128), (True, 33, 128)]


@pytest.mark.parametrize("bidirectional,num_buckets,max_distance", T5_CONFIGS)
def test_t5_bucket_matches_the_formula(xp, to_xp, to_np, bidirectional, num_buckets, max_distance):
    rel = np.arange(-400, 401)
    got = to_np(P.t5_bucket(to_xp(rel), bidirectional, num_buckets, max_distance))
    expected = [t5_bucket_reference(int(n), bidirectional, num_buckets, max_distance) for n in rel]
    np.testing.assert_array_equal(got, expected)
    assert got.min() >= 0 and got.max() < num_buckets


def test_t5_bucket_takes_no_log_of_a_small_distance(xp, to_xp, to_np):
    """The double where: the log step reads max_exact in place of the distances below it, so
    log(0) = -inf, cast to an integer, is never computed (NumPy warned of both)."""
    rel = np.arange(-12, 13)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        got = to_np(P.t5_bucket(to_xp(rel), True, 8, 20))
    np.testing.assert_array_equal(got, [t5_bucket_reference(int(n), True, 8, 20) for n in rel])


@pytest.mark.parametrize("bidirectional,num_buckets,max_distance", T5_CONFIGS)
def test_t5_bucket_matches_hf_code_in_torch(bidirectional, num_buckets, max_distance):
    """HF transformers' T5Attention._relative_position_bucket, as written there."""
    torch = pytest.importorskip("torch")

    def _relative_position_bucket(relative_position, bidirectional=True, num_buckets=32, max_distance=128):
        relative_buckets = 0
        if bidirectional:
            num_buckets //= 2
            relative_buckets += (relative_position > 0).to(torch.long) * num_buckets
            relative_position = torch.abs(relative_position)
        else:
            relative_position = -torch.min(relative_position, torch.zeros_like(relative_position))
        max_exact = num_buckets // 2
        is_small = relative_position < max_exact
        relative_position_if_large = max_exact + (
            torch.log(relative_position.float() / max_exact)
            / math.log(max_distance / max_exact)
            * (num_buckets - max_exact)
        ).to(torch.long)
        relative_position_if_large = torch.min(
            relative_position_if_large, torch.full_like(relative_position_if_large, num_buckets - 1)
        )
        relative_buckets += torch.where(is_small, relative_position, relative_position_if_large)
        return relative_buckets

    memory = torch.arange(300)[None, :]
    query = torch.arange(200)[:, None]
    rel = memory - query  # [200, 300], as T5's compute_bias
    expected = _relative_position_bucket(rel, bidirectional, num_buckets, max_distance)
    got = P.t5_bucket(rel, bidirectional, num_buckets, max_distance)
    assert torch.equal(got, expected)


@pytest.mark.parametrize("Lq,Lk,offset,bidirectional", [(3, 5, 0, True), (5, 3, 0, False), (2, 7, 5, False),
                                                        (4, 6, 0, True)])
def test_relative_bias_forward_and_gradcheck(xp, to_xp, to_np, Lq, Lk, offset, bidirectional):
    rng = np.random.default_rng(11)
    NB, H, maxd = 8, 3, 6  # small buckets so that several distances share one
    table = rng.standard_normal((NB, H))
    out, _ = P.relative_bias_forward(to_xp(table), Lq, Lk, bidirectional=bidirectional,
                                     max_distance=maxd, offset=offset)
    expected = np.empty((1, H, Lq, Lk))
    for i in range(Lq):
        for j in range(Lk):
            expected[0, :, i, j] = table[t5_bucket_reference(j - i - offset, bidirectional, NB, maxd)]
    np.testing.assert_array_equal(to_np(out), expected)
    report = gradcheck(lambda t: P.relative_bias_forward(t, Lq, Lk, bidirectional=bidirectional,
                                                         max_distance=maxd, offset=offset),
                       lambda d, c: P.relative_bias_backward(d, c)[0], [to_xp(table)],
                       names=["table"], mode="full")
    assert_ok(report)


def test_relative_bias_defaults_are_t5s(xp, to_xp, to_np):
    """Without the keywords: bidirectional buckets with max_distance 128 (T5's) and offset 0.
    150 keys reach distances that a smaller max_distance puts in other buckets."""
    rng = np.random.default_rng(17)
    NB, H, Lq, Lk = 32, 2, 3, 150
    table = rng.standard_normal((NB, H))
    out, _ = P.relative_bias_forward(to_xp(table), Lq, Lk)
    expected = np.empty((1, H, Lq, Lk))
    for i in range(Lq):
        for j in range(Lk):
            expected[0, :, i, j] = table[t5_bucket_reference(j - i, True, NB, 128)]
    np.testing.assert_array_equal(to_np(out), expected)


def test_relative_bias_takes_as_few_buckets_as_t5_bucket(xp, to_xp, to_np):
    """The table may be as short as t5_bucket allows, max_exact = 1: 2 buckets one way, 4 both
    ways. One bucket fewer, or a max_distance that is not past max_exact, is refused naming the
    table (its number of rows is num_buckets)."""
    rng = np.random.default_rng(19)
    Lq, Lk = 3, 5
    for bidirectional, NB in ((False, 2), (True, 4)):
        table = rng.standard_normal((NB, 2))
        out, _ = P.relative_bias_forward(to_xp(table), Lq, Lk, bidirectional=bidirectional, max_distance=2)
        expected = np.empty((1, 2, Lq, Lk))
        for i in range(Lq):
            for j in range(Lk):
                expected[0, :, i, j] = table[t5_bucket_reference(j - i, bidirectional, NB, 2)]
        np.testing.assert_array_equal(to_np(out), expected)
        with pytest.raises(ValueError, match=rf"^table: expected enough rows .* got shape \({NB - 1}, 2\)"):
            P.relative_bias_forward(to_xp(table[:-1]), Lq, Lk, bidirectional=bidirectional, max_distance=2)
        with pytest.raises(ValueError, match="^table: expected enough rows .* < max_distance = 1, got shape"):
            P.relative_bias_forward(to_xp(table), Lq, Lk, bidirectional=bidirectional, max_distance=1)


def test_relative_bias_backward_sums_a_batched_dmask(xp, to_xp, to_np):
    rng = np.random.default_rng(12)
    table = rng.standard_normal((8, 2))
    _, cache = P.relative_bias_forward(to_xp(table), 3, 4, max_distance=6)
    dmask = rng.standard_normal((3, 2, 3, 4))
    got = to_np(P.relative_bias_backward(to_xp(dmask), cache)[0])
    summed = to_np(P.relative_bias_backward(to_xp(dmask.sum(0, keepdims=True)), cache)[0])
    np.testing.assert_allclose(got, summed, rtol=1e-13, atol=1e-13)
    expected = np.zeros_like(table)
    for i in range(3):
        for j in range(4):
            expected[t5_bucket_reference(j - i, True, 8, 6)] += dmask[:, :, i, j].sum(0)
    np.testing.assert_allclose(got, expected, rtol=1e-13, atol=1e-13)


def test_t5_bias_through_sdpa_mask(xp, to_xp):
    rng = np.random.default_rng(13)
    B, H, Lq, Lk, Dh = 2, 2, 4, 6, 3
    q, k, v = (to_xp(rng.standard_normal(s)) for s in [(B, H, Lq, Dh), (B, H, Lk, Dh), (B, H, Lk, Dh)])
    table = to_xp(rng.standard_normal((8, H)))

    def fwd(q, k, v, table):
        bias, bias_cache = P.relative_bias_forward(table, Lq, Lk, max_distance=6)  # [1, H, Lq, Lk]
        out, cache = F.sdpa_forward(q, k, v, mask=bias, scale=1.0)  # T5 does not scale
        return out, (bias_cache, cache)

    def bwd(dout, caches):
        dq, dk, dv, dmask, _ = F.sdpa_backward(dout, caches[1])  # dmask: [1, H, Lq, Lk]
        return dq, dk, dv, P.relative_bias_backward(dmask, caches[0])[0]

    assert_ok(gradcheck(fwd, bwd, [q, k, v, table], names=["q", "k", "v", "table"], mode="full"))


# --------------------------------------------------------------------------
# bad input: the message names the argument


@given(L=st.integers(1, 8), n=st.integers(1, 3), M=st.integers(1, 5), bidirectional=st.booleans(),
       max_distance=st.integers(5, 20), seed=st.integers(0, 2**16))
def test_relative_positions_of_decoded_queries_are_the_last_rows_of_the_full_grid(
        L, n, M, bidirectional, max_distance, seed):
    """Decoding n queries after L cached positions (offset = Lk - Lq = L): T5's bias and Shaw's
    embeddings and scores are the last n rows of those of the whole Lk = L + n grid, each row
    the formula's (T5's bucket and Shaw's clipped lookup of j - (L + i))."""
    rng = np.random.default_rng(seed)
    Lk = L + n
    table = rng.standard_normal((8, 2))
    bias, _ = P.relative_bias_forward(table, n, Lk, bidirectional=bidirectional, max_distance=max_distance,
                                      offset=L)
    full, _ = P.relative_bias_forward(table, Lk, Lk, bidirectional=bidirectional, max_distance=max_distance)
    np.testing.assert_array_equal(bias, full[:, :, L:])
    for i in range(n):
        for j in range(Lk):
            b = t5_bucket_reference(j - (L + i), bidirectional, 8, max_distance)
            np.testing.assert_array_equal(bias[0, :, i, j], table[b])
    shaw = rng.standard_normal((2 * M - 1, 3))
    emb, _ = P.relative_embedding_forward(shaw, n, Lk, offset=L)
    np.testing.assert_array_equal(emb, shaw_reference(shaw, Lk, Lk)[L:])
    q = rng.standard_normal((2, 2, Lk, 3))
    scores, _ = P.relative_scores_forward(q[:, :, L:], shaw, Lk, offset=L)
    whole, _ = P.relative_scores_forward(q, shaw, Lk)
    np.testing.assert_allclose(scores, whole[:, :, L:], rtol=1e-13, atol=1e-13)


def test_offsets_at_the_ends_of_their_range():
    """Offsets within +-2**62 are taken, the ends included, and give the distances
    j - (i + offset) exactly; one past either end is refused by name."""
    for offset in (2**62, -(2**62)):
        rel = P.relative_distances("numpy", 2, 3, offset=offset)
        assert rel.dtype == np.int64
        assert rel.tolist() == [t - 1 - offset for t in range(4)]
        out, _ = P.relative_embedding_forward(np.arange(10.0).reshape(5, 2), 2, 3, offset=offset)
        far_row = [8.0, 9.0] if offset < 0 else [0.0, 1.0]  # every distance is clipped to one end
        np.testing.assert_array_equal(out, np.broadcast_to(far_row, (2, 3, 2)))
    for offset in (2**62 + 1, -(2**62) - 1):
        with pytest.raises(ValueError, match=r"^offset: expected an int within \+-2\*\*62"):
            P.relative_distances("numpy", 2, 3, offset=offset)


def test_t5_bucket_at_the_ends_of_small_integer_types():
    """|position| of the type's minimum does not overflow: its bucket is that of the same
    distance in int64, in range, in the input's dtype."""
    for dtype in (np.int8, np.int16, np.int32, np.int64):
        lo, hi = np.iinfo(dtype).min, np.iinfo(dtype).max
        rp = np.array([lo, lo + 1, -1, 0, 1, hi], dtype=dtype)
        for bidirectional in (True, False):
            got = P.t5_bucket(rp, bidirectional=bidirectional)
            want = P.t5_bucket(rp.astype(np.int64), bidirectional=bidirectional)
            assert got.dtype == dtype
            # int64's minimum (whose abs overflowed to a negative bucket) is past max_distance
            # like its neighbour: the last bucket of its side
            assert got[0] == got[1] == (15 if bidirectional else 31)
            np.testing.assert_array_equal(got, want)
            assert np.all((got >= 0) & (got < 32))
    # the log step's bucket before its cap, max_exact + log(n / 32) / log(33 / 32) * 32, is
    # about 1465 at n = 127: past int8's range, it is capped at the last bucket, not wrapped
    rp = np.array([-128, -40, 31, 32, 40, 100, 127], dtype=np.int8)
    got = P.t5_bucket(rp, True, 128, 33)
    assert got.dtype == np.int8
    np.testing.assert_array_equal(got, [t5_bucket_reference(int(n), True, 128, 33) for n in rp])
    np.testing.assert_array_equal(got, [63, 63, 95, 96, 127, 127, 127])
    # every int8 position, in a configuration where the distances 127 and 128 fall in different
    # buckets (125 and 126): -128 keeps its own bucket, as in int64, not that of -127
    rp = np.arange(-128, 128, dtype=np.int8)
    got = P.t5_bucket(rp, False, 128, 130)
    np.testing.assert_array_equal(got, P.t5_bucket(rp.astype(np.int64), False, 128, 130))
    np.testing.assert_array_equal(got, [t5_bucket_reference(int(n), False, 128, 130) for n in rp])
    assert got[0] == 126 and got[1] == 125


def test_errors_name_the_argument():
    x = np.zeros((2, 3, 4))
    cases = [
        (lambda: P.rope_forward(np.zeros((2, 3, 5))), ValueError,
         r"^x: expected an even last axis Dh >= 2 \(pairs of coordinates\), got shape \(2, 3, 5\)$"),
        (lambda: P.rope_forward(np.zeros((3, 0))), ValueError,
         r"^x: expected an even last axis Dh >= 2 .*, got shape \(3, 0\)$"),
        (lambda: P.relative_embedding_backward(np.zeros((3, 3, 5)),
                                               P.relative_embedding_forward(np.zeros((5, 2)), 3, 3)[1]),
         ValueError, r"^dout: expected shape \(3, 3, 2\) \(that of the forward's out\), got \(3, 3, 5\)$"),
        (lambda: P.t5_bucket(np.arange(3, dtype=np.int8), num_buckets=300), ValueError,
         "^num_buckets: expected at most 128, the buckets a relative_position of dtype int8 can hold, "
     "got 300$"),
        (lambda: P.rope_forward(np.zeros((2, 3, 4), dtype=np.int64)), TypeError,
         "^x: expected a real floating dtype, got int64$"),
        (lambda: P.rope_forward(x, np.zeros(4)), ValueError,
         r"^positions: expected a shape that broadcasts to x\.shape\[:-1\] = \(\.\.\., L\) = \(2, 3\) .*, "
         r"got shape \(4,\)$"),
        (lambda: P.rope_forward(x, np.zeros(3, dtype=bool)), TypeError,
         "^positions: expected integer or real floating positions, got bool$"),
        (lambda: P.rope_forward(x, 1.5), TypeError, "^positions: expected a numpy array, got float$"),
        # a bool is no int start (True would shift every position by one) and no base
        (lambda: P.rope_forward(x, True), TypeError, "^positions: expected a numpy array, got bool$"),
        (lambda: P.rope_forward(x, base=True), TypeError, "^base: expected a float > 1, got bool True$"),
        (lambda: P.rope_forward(x, base=0.5), ValueError, r"^base: expected a finite float > 1, got 0\.5$"),
        # a base of 1 is no frequency base either (every angle would be the position itself)
        (lambda: P.rope_forward(x, base=1.0), ValueError, r"^base: expected a finite float > 1, got 1\.0$"),
        (lambda: P.rope_angles(np, np.arange(3), 4, base=1), ValueError,
         "^base: expected a finite float > 1, got 1$"),
        # one axis is no (..., L, Dh): named, not an IndexError from reading L
        (lambda: P.rope_forward(np.zeros(4)), ValueError,
         r"^x: expected an array of shape \(\.\.\., L, Dh\), got shape \(4,\)$"),
        # an infinite base is no frequency base (every angle but the first would be 0)
        (lambda: P.rope_forward(x, base=math.inf), ValueError,
         "^base: expected a finite float > 1, got inf$"),
        (lambda: P.rope_forward(x, interleaved=1), TypeError, "^interleaved: expected a bool, got int 1$"),
        (lambda: P.rope_backward(x, None), TypeError,
         r"^cache: expected a RopeCache \(the cache rope_forward returns\), got None$"),
        # each backward takes its own forward's cache only (another's has fields of the same names)
        (lambda: P.relative_embedding_backward(np.zeros((3, 3, 2)), None), TypeError,
         r"^cache: expected a RelativeEmbeddingCache .*, got None$"),
        (lambda: P.relative_scores_backward(np.zeros((2, 3, 3)),
                                            P.relative_embedding_forward(np.zeros((5, 4)), 3, 3)[1]),
         TypeError, r"^cache: expected a RelativeScoresCache .*, got npattn\.RelativeEmbeddingCache$"),
        (lambda: P.relative_bias_backward(np.zeros((1, 2, 3, 3)),
                                          P.relative_embedding_forward(np.zeros((5, 2)), 3, 3)[1]),
         TypeError, r"^cache: expected a RelativeBiasCache .*, got npattn\.RelativeEmbeddingCache$"),
        (lambda: P.rope_backward(x.astype(np.float32), P.rope_forward(x)[1]), TypeError,
         r"^dout: expected dtype float64 \(that of the forward's out\), got float32 \(no silent "
         r"promotion\)$"),
        (lambda: P.rope_backward(np.zeros((2, 3, 2)), P.rope_forward(x)[1]), ValueError,
         r"^dout: expected shape \(2, 3, 4\) \(that of the forward's out\), got \(2, 3, 2\)$"),
        (lambda: P.relative_embedding_forward(np.zeros((6, 2)), 3, 3), ValueError,
         r"^table: expected an odd number of rows, 2 \* max_len - 1, got shape \(6, 2\)$"),
        (lambda: P.relative_embedding_forward(np.zeros(5), 3, 3), ValueError,
         r"^table: expected a 2-D array, got shape \(5,\)$"),
        # an integer table would give integer embeddings and biases, and no gradient
        (lambda: P.relative_embedding_forward(np.zeros((5, 2), np.int64), 3, 3), TypeError,
         "^table: expected a real floating dtype, got int64$"),
        (lambda: P.relative_bias_forward(np.zeros((8, 2), np.int64), 3, 3, max_distance=6), TypeError,
         "^table: expected a real floating dtype, got int64$"),
        # the gradient comes in the forward's dtype (no silent promotion or rounding)
        (lambda: P.relative_embedding_backward(np.zeros((3, 3, 2), np.float32),
                                               P.relative_embedding_forward(np.zeros((5, 2)), 3, 3)[1]),
         TypeError, r"^dout: expected dtype float64 .*, got float32 \(no silent promotion\)$"),
        (lambda: P.relative_bias_backward(np.zeros((1, 3, 3, 3), np.float32),
                                          P.relative_bias_forward(np.zeros((8, 3)), 3, 3, max_distance=6)[1]),
         TypeError, r"^dout: expected dtype float64 .*, got float32 \(no silent promotion\)$"),
        # more axes than (rows, E) are refused by name too, not looked up as rows of a 3-D array
        (lambda: P.relative_embedding_forward(np.zeros((5, 2, 1)), 3, 3), ValueError,
         r"^table: expected a 2-D array, got shape \(5, 2, 1\)$"),
        (lambda: P.relative_bias_forward(np.zeros((8, 3, 1)), 3, 3, max_distance=6), ValueError,
         r"^table: expected a 2-D array, got shape \(8, 3, 1\)$"),
        (lambda: P.relative_embedding_forward(np.zeros((5, 2)), 0, 3), ValueError,
         "^Lq: expected a positive int, got 0$"),
        (lambda: P.relative_embedding_forward(np.zeros((5, 2)), 3, 2.0), TypeError,
         r"^Lk: expected a positive int, got float 2\.0$"),
        (lambda: P.relative_embedding_forward(np.zeros((5, 2)), 3, 2, offset=0.5), TypeError,
         "^offset: expected an int, got float 0.5$"),
        # a bool is no offset (True would shift every distance by one)
        (lambda: P.relative_embedding_forward(np.zeros((5, 2)), 3, 2, offset=True), TypeError,
         "^offset: expected an int, got bool True$"),
        (lambda: P.relative_bias_forward(np.zeros((8, 2)), 3, 2, max_distance=6, offset=np.bool_(True)),
         TypeError, "^offset: expected an int, got numpy.bool"),
        # offsets are summed with the lengths in int64: past 2**62 they are refused by name (a
        # NumPy OverflowError naming nothing, or a wrapped distance, otherwise)
        (lambda: P.relative_distances("numpy", 3, 2, offset=2**63 - 1), ValueError,
         r"^offset: expected an int within \+-2\*\*62 \(positions are int64\), got 9223372036854775807$"),
        (lambda: P.relative_bias_forward(np.zeros((8, 1)), 3, 2, max_distance=6, offset=-(2**62) - 1),
         ValueError, r"^offset: expected an int within \+-2\*\*62 .*, got -4611686018427387905$"),
        (lambda: P.relative_embedding_backward(np.zeros((3, 4, 2)),
                                               P.relative_embedding_forward(np.zeros((5, 2)), 3, 3)[1]),
         ValueError, r"^dout: expected shape \(3, 3, 2\) \(that of the forward's out\), got \(3, 4, 2\)$"),
        (lambda: P.relative_scores_forward(np.zeros((2, 3, 4)), np.zeros((5, 3))), ValueError,
         r"^table: expected 4 columns \(E, the last axis of q\), got shape \(5, 3\)$"),
        # E = 0: a ZeroDivisionError from the default scale 1 / sqrt(E), or with scale=1.0 a
        # NumPy reshape error in the backward, before
        (lambda: P.relative_scores_forward(np.zeros((2, 3, 0)), np.zeros((5, 0))), ValueError,
         r"^q: expected shape \(\.\.\., Lq, E\) with E >= 1, got \(2, 3, 0\)$"),
        (lambda: P.relative_scores_forward(np.zeros((2, 3, 0)), np.zeros((5, 0)), scale=1.0), ValueError,
         r"^q: expected shape \(\.\.\., Lq, E\) with E >= 1, got \(2, 3, 0\)$"),
        # Lq = 0 (q's own axis): "Lq: expected a positive int", an argument it does not have, before
        (lambda: P.relative_scores_forward(np.zeros((2, 0, 4)), np.zeros((5, 4)), 3), ValueError,
         r"^q: expected shape \(\.\.\., Lq, E\) with Lq >= 1, got \(2, 0, 4\)$"),
        # Lk = 0 is refused, not read as "Lk not given" (Lk = Lq)
        (lambda: P.relative_scores_forward(x, np.zeros((5, 4)), 0), ValueError,
         "^Lk: expected a positive int, got 0$"),
        (lambda: P.relative_scores_forward(np.zeros((2, 3, 4)), np.zeros((5, 4), np.float32)), TypeError,
         r"^table: expected dtype float64 \(that of q\), got float32 \(no silent promotion\)$"),
        # the scale is checked as sdpa's: a NaN or infinite factor, or a str, is refused by name
        (lambda: P.relative_scores_forward(x, np.zeros((5, 4)), scale=math.nan), ValueError,
         "^scale: expected a finite float, got nan$"),
        (lambda: P.relative_scores_forward(x, np.zeros((5, 4)), scale=math.inf), ValueError,
         "^scale: expected a finite float, got inf$"),
        (lambda: P.relative_scores_forward(x, np.zeros((5, 4)), scale="1"), TypeError,
         "^scale: expected None or a float, got str '1'$"),
        (lambda: P.relative_scores_backward(np.zeros((2, 3, 3)),
                                            P.relative_scores_forward(x, np.zeros((5, 4)), 4)[1]),
         ValueError, r"^dbias: expected shape \(2, 3, 4\) \(that of the forward's bias\), got \(2, 3, 3\)$"),
        (lambda: P.t5_bucket(np.zeros(3)), TypeError,
         "^relative_position: expected a signed integer array, got float64$"),
        # unsigned positions have no negative side (and uint64's top half would wrap in int64)
        (lambda: P.t5_bucket(np.arange(3, dtype=np.uint8)), TypeError,
         "^relative_position: expected a signed integer array, got uint8$"),
        (lambda: P.t5_bucket(np.arange(3), num_buckets=2), ValueError,
         r"^num_buckets: expected at least 4 \(max_exact = num_buckets // 2 // 2 >= 1\), got 2$"),
        (lambda: P.t5_bucket(np.arange(3), max_distance=5), ValueError,
         "^max_distance: expected an int > max_exact = 8, got 5$"),
        (lambda: P.t5_bucket(np.arange(3), bidirectional="yes"), TypeError,
         "^bidirectional: expected a bool, got str 'yes'$"),
        # checked before the table's rows are counted with it (one way: 2 rows are enough)
        (lambda: P.relative_bias_forward(np.zeros((2, 2)), 3, 3, bidirectional="yes"), TypeError,
         "^bidirectional: expected a bool, got str 'yes'$"),
        # an int beyond the float range (OverflowError from the log step, before)
        (lambda: P.t5_bucket(np.arange(3), max_distance=10**400), ValueError,
         r"^max_distance: expected a positive int that a float holds, got an int too large .*\(1329 bits\)$"),
        (lambda: P.relative_bias_forward(np.zeros((32, 2)), 3, 3, max_distance=10**400), ValueError,
         r"^max_distance: expected a positive int that a float holds, got an int too large .*\(1329 bits\)$"),
        # the helpers that take a backend check it and their arrays (an AttributeError or an
        # IndexError from inside, or an error naming x, before)
        (lambda: P.rope_angles("nump", np.arange(3), 4), ValueError,
         r"^xp: expected one of \[.*'numpy'.*\], got 'nump'$"),
        (lambda: P.rope_angles(np, [0, 1, 2], 4), TypeError, "^positions: expected a numpy array, got list$"),
        (lambda: P.rope_angles(np, np.zeros(3, bool), 4), TypeError,
         "^positions: expected an integer or real floating array, got dtype bool$"),
        # an odd Dh gave floor(Dh/2) angles with the step 2/Dh, which no rope_forward uses (it
        # refuses an odd last axis) and which is not HF's arange(0, Dh, 2) / Dh, ceil(Dh/2) of them
        (lambda: P.rope_angles(np, np.arange(3), 5), ValueError, r"^Dh: expected an even int .*, got 5$"),
        (lambda: P.relative_distances(3, 3, 1), TypeError,
         r"^xp: expected one of \[.*'numpy'.*\] or a namespace module, got int$"),
        (lambda: P.relative_distances("numpy", 3, 3, device="elsewhere"), ValueError,
         "^device: expected a device of the numpy backend, got 'elsewhere'"),
        (lambda: P.diagonal_sums(np, np.zeros(3)), ValueError,
         r"^a: expected shape \(\.\.\., Lq, Lk\) with Lq, Lk >= 1, got \(3,\)$"),
        (lambda: P.diagonal_sums(np, [[1.0]]), TypeError, "^a: expected a numpy array, got list$"),
        (lambda: P.diagonal_spread(np, [[1.0]], 1, 1), TypeError, "^rows: expected a numpy array, got list$"),
        (lambda: P.diagonal_spread(np, np.zeros((3, 2)), 2, 3), ValueError,
         r"^rows: expected shape \(Lq \+ Lk - 1, E\) = \(4, E\), got \(3, 2\)$"),
        (lambda: P.diagonal_spread(np, np.zeros((4, 2, 1)), 2, 3), ValueError,
         r"^rows: expected shape \(Lq \+ Lk - 1, E\) = \(4, E\), got \(4, 2, 1\)$"),
        (lambda: P.diagonal_spread(np, np.zeros((4, 2)), 0, 5), ValueError,
         "^Lq: expected a positive int, got 0$"),
        (lambda: P.diagonal_spread(np, np.zeros((4, 2)), 2, 0), ValueError,
         "^Lk: expected a positive int, got 0$"),
        # an empty grid has no diagonals: refused by name, not summed to zeros
        (lambda: P.diagonal_sums(np, np.zeros((2, 0, 3))), ValueError,
         r"^a: expected shape \(\.\.\., Lq, Lk\) with Lq, Lk >= 1, got \(2, 0, 3\)$"),
        (lambda: P.diagonal_sums(np, np.zeros((2, 3, 0))), ValueError,
         r"^a: expected shape \(\.\.\., Lq, Lk\) with Lq, Lk >= 1, got \(2, 3, 0\)$"),
        (lambda: P.relative_bias_forward(np.zeros((2, 3)), 3, 3), ValueError,
         r"^table: expected enough rows \(num_buckets\) for .*, got shape \(2, 3\)$"),
        (lambda: P.relative_bias_backward(np.zeros((1, 2, 3, 3)),
                                          P.relative_bias_forward(np.zeros((8, 3)), 3, 3, max_distance=6)[1]),
         ValueError, r"^dout: expected shape \(1, 3, 3, 3\) or \(B, 3, 3, 3\) .*, got \(1, 2, 3, 3\)$"),
        # a dout of (H, Lq, Lk) or of more leading axes than (B, H, Lq, Lk) is refused by name, not
        # summed over the heads or given a table gradient of another shape
        (lambda: P.relative_bias_backward(np.zeros((3, 3, 4)),
                                          P.relative_bias_forward(np.zeros((8, 3)), 3, 4, max_distance=6)[1]),
         ValueError, r"^dout: expected shape \(1, 3, 3, 4\) or \(B, 3, 3, 4\).*got \(3, 3, 4\)$"),
        (lambda: P.relative_bias_backward(np.zeros((2, 1, 3, 3, 4)),
                                          P.relative_bias_forward(np.zeros((8, 3)), 3, 4, max_distance=6)[1]),
         ValueError, r"^dout: expected shape \(1, 3, 3, 4\) or \(B, 3, 3, 4\).*got \(2, 1, 3, 3, 4\)$"),
    ]
    for call, exc, text in cases:
        with pytest.raises(exc, match=text):
            call()


def test_rope_positions_of_another_library_are_refused(backend, to_xp):
    """Positions are an array of x's library: NumPy positions with x of another library are a
    TypeError naming them, not copied over through the host."""
    if backend == "numpy":
        pytest.skip("NumPy positions are of x's library here")
    x = to_xp(np.zeros((2, 3, 4)))
    with pytest.raises(TypeError, match=r"^positions: expected an? \S+ array \(that of x\), got a numpy array"):
        P.rope_forward(x, np.arange(3))


def test_rope_angles_take_the_base(xp, to_xp, to_np):
    """theta = p * base^(-2c/Dh) with the base given, not the default 10000."""
    pos = np.array([0.0, 1.0, 7.0, 1000.0])
    c = np.arange(4)
    want = pos[:, None] * 500.0 ** (-2.0 * c[None, :] / 8)  # [4, Dh/2]
    got = P.rope_angles(xp, to_xp(pos), 8, base=500.0, dtype="float32")
    np.testing.assert_allclose(to_np(got), want, rtol=1e-6)


def test_rope_angles_default_to_float64(xp, to_xp, to_np):
    """Without ``dtype`` the angles are float64 on a backend that has it: a position past 2**24
    keeps its own angle, where float32 would round it to a neighbour's."""
    pos = np.array([2**24 + 1, 3])
    got = P.rope_angles(xp, to_xp(pos), 4)
    assert got.dtype == xp.float64
    want = pos[:, None].astype(np.float64) * 10000.0 ** (-2.0 * np.arange(2)[None, :] / 4)  # [2, Dh/2]
    np.testing.assert_allclose(to_np(got), want, rtol=1e-15, atol=0)


def test_rope_angles_are_within_two_ulps_of_the_exact_angle(xp, to_xp, to_np):
    """theta = p * base^(-2c/Dh) against the exact value (Python's decimal, 50 digits), at the
    bases of RoFormer (10000), LLaMA 3 (500000) and a small one, Dh = 128 and positions up to
    32767: within 2 ** -52 relative (a rounded base^(-2c/Dh) times p, rounded again). As
    exp(-2c ln(base) / Dh) the frequencies were up to 1.6e-15 off at base 10000."""
    from decimal import Decimal, localcontext
    pos = np.array([1, 3, 1000, 32767])
    Dh = 128
    for base in (10000.0, 500000.0, 10.0):
        with localcontext() as ctx:
            ctx.prec = 50
            want = np.array([[float(Decimal(int(p)) * Decimal(base) ** (Decimal(-2 * c) / Decimal(Dh)))
                              for c in range(Dh // 2)] for p in pos])  # [4, Dh/2]
        got = P.rope_angles(xp, to_xp(pos), Dh, base=base)
        if got.dtype != xp.float64:
            pytest.skip("the backend has no float64")
        np.testing.assert_allclose(to_np(got), want, rtol=2.0 ** -52, atol=0)


def test_rope_angles_dtype_is_a_float_dtype_of_the_backend(xp, to_xp, to_np):
    """As the constructors' dtype=. Before, an integer dtype truncated the angles and an unknown
    name raised NumPy's "data type 'nope' not understood", naming no argument."""
    pos = to_xp(np.arange(3))
    for bad, exc in ((np.int8, TypeError), (np.dtype(np.int64), TypeError), ("int8", ValueError),
                     ("nope", ValueError)):
        with raises(exc, "dtype", "float32"):
            P.rope_angles(xp, pos, 4, dtype=bad)
    got = P.rope_angles(xp, pos, 4, dtype="float32")  # a name, resolved in the backend
    assert got.dtype == xp.float32
    np.testing.assert_allclose(to_np(got), P.rope_angles(np, np.arange(3), 4), rtol=1e-6)


def test_helpers_take_a_backend_by_name_or_module():
    """``xp`` as ``backend=`` takes it: a name or a namespace module, with the same numbers."""
    torch = pytest.importorskip("torch")
    pos = np.arange(5)
    for xp in ("numpy", np):
        np.testing.assert_array_equal(P.rope_angles(xp, pos, 4), P.rope_angles(np, pos, 4))
        np.testing.assert_array_equal(P.relative_distances(xp, 2, 3), [-1, 0, 1, 2])
    got = P.rope_angles(torch, torch.arange(5), 4)
    assert isinstance(got, torch.Tensor)
    np.testing.assert_array_equal(got.numpy(), P.rope_angles(np, pos, 4))


def test_float64_result_keeps_float64_where_the_backend_has_it(xp, to_np):
    """A float64 step's result on the host goes to a backend with float64 as float64: only a
    backend without it (JAX without x64) gets float32."""
    from npattn.backend import float64_result

    host = np.array([1.0 + 2.0**-40, 3.0])
    got = float64_result(host, xp)
    assert got.dtype == xp.float64
    np.testing.assert_array_equal(to_np(got), host)
    assert float64_result(host, xp, xp.float32).dtype == xp.float32


def test_results_stay_on_the_device_of_the_inputs():
    """On array_api_strict's second device every forward and backward returns arrays there,
    with positions given as None, an int start or an array (strict refuses to mix devices)."""
    xps = pytest.importorskip("array_api_strict")
    dev = xps.Device("device1")
    rng = np.random.default_rng(20)

    def put(a):
        return xps.asarray(a, device=dev)

    pos = put(np.array([3, 0, 2]))
    assert P.rope_angles(xps, pos, 4).device == dev
    x = put(rng.standard_normal((2, 3, 4)))
    for positions in (None, 5, pos):
        out, cache = P.rope_forward(x, positions)
        dx, _ = P.rope_backward(put(rng.standard_normal((2, 3, 4))), cache)
        assert out.device == dx.device == dev
    assert P.relative_distances(xps, 2, 3, device=dev).device == dev
    bias, cache = P.relative_scores_forward(x, put(rng.standard_normal((5, 4))), 4)
    dq, dtable, _ = P.relative_scores_backward(put(rng.standard_normal((2, 3, 4))), cache)
    assert bias.device == dq.device == dtable.device == dev
    out, cache = P.relative_bias_forward(put(rng.standard_normal((8, 2))), 3, 4, max_distance=6)
    dtable, _, _ = P.relative_bias_backward(put(rng.standard_normal((1, 2, 3, 4))), cache)
    assert out.device == dtable.device == dev


@pytest.mark.parametrize("call, match", [
    # NumPy's arange(2**63 - 1) is empty: the relative positions came back with no entry at all
    (lambda: P.relative_distances(np, 2**62, 2**62),
     rf"^Lq and Lk: expected sizes for which the relative positions, an array of shape \({2**63 - 1},\) "
     rf"\(8 bytes an entry\), .*got {(2**63 - 1) * 8} bytes$"),
    (lambda: P.relative_embedding_forward(np.zeros((5, 2)), 2**39, 2**39),
     rf"^Lq and Lk: expected sizes for which the spread rows, an array of shape \({2**39}, {2**39}, 2\) "
     rf"\(8 bytes an entry\)"),
    (lambda: P.relative_bias_forward(np.zeros((32, 3), np.float32), 2**39, 2**39),
     rf"^Lq and Lk: expected sizes for which the spread rows, an array of shape \({2**39}, {2**39}, 3\) "
     rf"\(4 bytes an entry\)"),
    (lambda: P.relative_scores_forward(np.zeros((1, 3, 2), np.float32), np.zeros((2**21 + 1, 2), np.float32),
                                       2**41),  # (Lq = 3 is q's)
     rf"^q and Lk: expected sizes for which the one-hot rows C, "
     rf"an array of shape \({2**41 + 2}, {2**21 + 1}\)"),
])
def test_relative_positions_that_cannot_exist_are_refused_naming_the_lengths(call, match):
    """Lengths whose relative positions, one-hot rows or spread rows would be larger than the
    largest array (sys.maxsize bytes) are refused by name before anything is made: NumPy named
    nothing, or made no relative position at all."""
    import sys

    with pytest.raises(ValueError, match=match) as info:
        call()
    assert f"fits in {sys.maxsize} bytes (the largest array)" in str(info.value)


def test_the_spread_s_gather_indices_are_held_to_the_largest_array_too(monkeypatch):
    """The spread's gather indices [Lq, Lk] are int64, larger than the spread rows themselves
    when a row is narrower than 8 bytes (one head of T5's bias in float32): they are checked as
    well. Shown with the largest array made small, so that nothing large is made either way:
    at 500 bytes the 10 x 10 indices (800 bytes) cannot exist, the rows (400) and the rest can."""
    import npattn.backend

    table = np.zeros((4, 1), np.float32)  # 4 buckets, one head
    monkeypatch.setattr(npattn.backend, "MAX_BYTES", 500)
    with pytest.raises(ValueError, match=r"^Lq and Lk: expected sizes for which the gather indices of the "
                                         r"spread, an array of shape \(10, 10\) \(8 bytes an entry\), fits "
                                         r"in 500 bytes .*got 800 bytes$"):
        P.relative_bias_forward(table, 10, 10, max_distance=3)
    out, _ = P.relative_bias_forward(table, 10, 6, max_distance=3)  # 480 bytes of indices
    assert out.shape == (1, 1, 10, 6)


@pytest.mark.parametrize("dtype, E, match", [
    ("float32", 1, rf"^Lq, Lk and rows: expected sizes for which the spread rows, an array of shape "
                   rf"\({2**56}, {2**56}, 1\) \(4 bytes an entry\)"),
    ("bool", 1, rf"^Lq, Lk and rows: expected sizes for which the spread rows, an array of shape "
                rf"\({2**56}, {2**56}, 1\) \(1 byte an entry\)"),
    # rows of no width: nothing to spread, but the [Lq, Lk] gather indices are made all the same
    ("float32", 0, rf"^Lq and Lk: expected sizes for which the gather indices of the spread, an array "
                   rf"of shape \({2**56}, {2**56}\) \(8 bytes an entry\)"),
])
def test_a_diagonal_spread_that_cannot_exist_is_refused_naming_its_sizes(xp, dtype, E, match):
    """diagonal_spread of rows (Lq + Lk - 1, E), a broadcast view in no memory, to (Lq, Lk, E)
    larger than the largest array (sys.maxsize bytes): refused by name before anything is made
    (the library's own error came from its first index array, Lq long)."""
    import sys

    L = 2**56
    one = xp.zeros((1, min(E, 1)), dtype=getattr(xp, dtype))
    rows = xp.broadcast_to(one, (2 * L - 1, E))  # [T, E]
    with pytest.raises(ValueError, match=match) as info:
        P.diagonal_spread(xp, rows, L, L)
    assert f"fits in {sys.maxsize} bytes (the largest array)" in str(info.value)


def test_a_sinusoidal_encoding_that_cannot_exist_is_refused_naming_l_and_d():
    """An encoding (L, D) of float64 larger than the largest array is refused by name (NumPy's
    "array is too big" named neither)."""
    import sys

    from npattn import nn

    with pytest.raises(ValueError, match=rf"^L and D: expected sizes for which the float64 encoding, "
                                         rf"an array of "
                                         rf"shape \({2**61}, 1\) \(8 bytes an entry\), fits in {sys.maxsize} "
                                         rf"bytes \(the largest array\), got {2**64} bytes$"):
        nn.sinusoidal_positions("numpy", 2**61, 1)
    assert nn.sinusoidal_positions("numpy", 3, 4).shape == (3, 4)
