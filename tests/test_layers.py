"""The Transformer pieces of ``npattn.layers`` against finite differences, torch, and their invariants.

Every gradient is checked in float64 by central differences with a random
upstream gradient (``gradcheck`` never uses all ones), on every backend
fixture, for inputs and parameters alike; dropout runs at p > 0 with a fixed
keep-mask.
"""

import decimal
import math
import re

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from npattn import layers as L
from npattn.backend import dropout_key, keep_mask, namespace
from npattn.gradcheck import gradcheck

RTOL = 1e-6


def assert_ok(report):
    # every input within atol + rtol * scale, rtol = RTOL and atol float64's rounding floor
    # of a central difference (a bound on max_rel_err alone fails gradients of scale 1e-3
    # whose error is that rounding)
    assert report.ok and report.rtol <= RTOL, "\n" + str(report)
    for r in report.inputs:
        assert r.scale > 0.0, f"{r.name}: a zero gradient checks nothing\n{report}"


def assert_same_namespace(xp, *arrays):
    for a in arrays:
        if a is not None:
            assert namespace(a) is xp, f"output left its namespace: {type(a)}"


# ------------------------------------------------------------------ erf


def test_erf_accuracy_float64_against_math_erf(xp, to_xp, to_np):
    xs = np.linspace(-10.0, 10.0, 100_001)
    ref = np.array([math.erf(v) for v in xs])
    got = to_np(L.erf(to_xp(xs)))
    abs_err = np.abs(got - ref)
    assert abs_err.max() <= 2e-15, abs_err.max()
    rel = abs_err / np.maximum(np.abs(ref), np.finfo(np.float64).tiny)
    assert rel.max() <= 2e-15, rel.max()


def test_erf_special_values_and_oddness(xp, to_xp, to_np):
    x = np.array([0.0, 1e-300, 2.5, 2.5 - 1e-12, 30.0, np.inf, -np.inf, np.nan])
    got = to_np(L.erf(to_xp(x)))
    np.testing.assert_allclose(got[:7], [math.erf(v) for v in x[:7]], rtol=2e-15, atol=0.0)
    assert np.isnan(got[7])
    rng = np.random.default_rng(0)
    y = 4.0 * rng.standard_normal(1000)
    np.testing.assert_array_equal(to_np(L.erf(to_xp(-y))), -to_np(L.erf(to_xp(y))))


def test_erf_is_odd_at_zero_too(xp, to_xp, to_np):
    """erf(-0.0) = -0.0 and erf(+0.0) = +0.0, as math.erf: the sign was set by x < 0, which
    -0.0 is not, so erf(-0.0) came out +0.0."""
    y = to_np(L.erf(to_xp(np.array([-0.0, 0.0, -1e-300, 1e-300]))))
    assert math.copysign(1.0, math.erf(-0.0)) == -1.0
    np.testing.assert_array_equal(np.signbit(y), [True, False, True, False])
    np.testing.assert_array_equal(y[:2], [0.0, 0.0])


def test_erf_float32_keeps_dtype(xp, to_xp, to_np):
    xs = np.linspace(-6.0, 6.0, 2001)
    e = L.erf(to_xp(xs.astype(np.float32)))
    assert e.dtype == xp.float32
    ref = np.array([math.erf(float(v)) for v in xs.astype(np.float32)])
    np.testing.assert_allclose(to_np(e), ref, atol=1e-6)


def test_erf_half_precision_keeps_dtype(xp, to_xp, to_np, backend):
    """float16 is computed in float32 and rounded once, back to float16."""
    if not hasattr(xp, "float16"):
        pytest.skip(f"{backend} has no float16")
    x16 = np.linspace(-4.0, 4.0, 81).astype(np.float16)
    e = L.erf(xp.astype(to_xp(x16.astype(np.float64)), xp.float16))
    assert e.dtype == xp.float16
    ref = np.array([math.erf(float(v)) for v in x16])
    np.testing.assert_allclose(to_np(xp.astype(e, xp.float64)), ref, atol=1e-3)


def test_erf_branches_never_divide_by_zero():
    """The series and the continued fraction are each fed only |x| they are finite for (the
    other entries get 2.5, the split, not 0): no division by zero, overflow or invalid operation
    anywhere, even in the entries the other branch gives (underflow of the series' tail is fine)."""
    x = np.concatenate([np.linspace(-3.0, 3.0, 61), [0.0, -0.0, 1e-300, 40.0, -np.inf, np.inf],
                        [1e200, -np.finfo(np.float64).max]])  # squares past float64's range
    with np.errstate(divide="raise", over="raise", invalid="raise", under="ignore"):
        got = L.erf(x)
    np.testing.assert_allclose(got, [math.erf(v) for v in x], rtol=2e-15, atol=0.0)


# ----------------------------------------------------------- layer norm


@pytest.mark.parametrize("affine", [True, False])
def test_layer_norm_gradients(xp, to_xp, affine):
    rng = np.random.default_rng(1)
    x = to_xp(1.5 * rng.standard_normal((2, 3, 5)) + 0.7)
    w = to_xp(rng.standard_normal(5))
    b = to_xp(rng.standard_normal(5))
    if affine:
        report = gradcheck(lambda x, w, b: L.layer_norm_forward(x, w, b, eps=1e-5), L.layer_norm_backward,
                           [x, w, b], names=["x", "weight", "bias"], seed=1)
    else:
        report = gradcheck(lambda x: L.layer_norm_forward(x, None, None),
                           lambda d, c: L.layer_norm_backward(d, c)[0], [x], names=["x"], seed=2)
    assert_ok(report)


def test_layer_norm_output_written_into_by_the_caller_leaves_the_backward():
    """Without weight and bias y is xhat, which the backward reads: the caller adding to y in
    place (``y += residual``) changed the gradient without a word. The backward is still
    dx = rstd (dy - mean(dy) - xhat mean(dy xhat)), with xhat and rstd computed here."""
    rng = np.random.default_rng(0)
    x, dy = rng.standard_normal((2, 3, 6)), rng.standard_normal((2, 3, 6))
    eps = 1e-5
    rstd = 1.0 / np.sqrt(x.var(axis=-1, keepdims=True) + eps)
    xhat = (x - x.mean(axis=-1, keepdims=True)) * rstd
    y, cache = L.layer_norm_forward(x.copy(), eps=eps)
    np.testing.assert_allclose(y, xhat, rtol=1e-12, atol=1e-14)
    y += rng.standard_normal(y.shape)
    dx, dw, db = L.layer_norm_backward(dy, cache)
    want = rstd * (dy - dy.mean(axis=-1, keepdims=True) - xhat * (dy * xhat).mean(axis=-1, keepdims=True))
    np.testing.assert_allclose(dx, want, rtol=1e-10, atol=1e-12)
    assert dw is None and db is None


def test_layer_norm_gradients_of_rows_whose_squares_overflow(xp, to_xp, to_np):
    # float64 rows of 1e160s (xc^2 ~ 1e320 overflows): a step of 1e-6 of the row's scale
    rng = np.random.default_rng(11)
    x1 = 1.5 * rng.standard_normal((2, 3, 5)) + 0.7  # [2, 3, 5]
    x, w, b = to_xp(1e160 * x1), to_xp(rng.standard_normal(5)), to_xp(rng.standard_normal(5))
    report = gradcheck(lambda x, w, b: L.layer_norm_forward(x, w, b, eps=1e-5), L.layer_norm_backward,
                       [x, w, b], names=["x", "weight", "bias"], seed=11, eps=1e154)
    assert_ok(report)
    # and the values are those of x / 1e160, with eps / 1e320 (below any rounding of var ~ 1)
    y, _ = L.layer_norm_forward(x, w, b, eps=1e-5)
    y1, _ = L.layer_norm_forward(to_xp(x1), w, b, eps=1e-300)
    np.testing.assert_allclose(to_np(y), to_np(y1), rtol=1e-15, atol=1e-15)


def test_layer_norm_of_a_rescaled_row_adds_eps_in_x_units(xp, to_xp, to_np):
    """A row past the overflow threshold is computed in units of s = max|xc| with eps / s^2:
    the float32 row [1, -1, 3, 0] * 1e19 with eps = 1e36 is the row [1, -1, 3, 0] with
    eps = 1e36 / 1e38 = 0.01 (eps / s, say, would be 4e16 there and flatten the row)."""
    base = np.array([[1.0, -1.0, 3.0, 0.0]])
    y, _ = L.layer_norm_forward(to_xp((base * 1e19).astype(np.float32)), eps=1e36)
    xc = base - base.mean()
    np.testing.assert_allclose(to_np(xp.astype(y, xp.float64)), xc / np.sqrt((xc * xc).mean() + 0.01), rtol=1e-5)


def test_layer_norm_eps_must_be_held_by_the_compute_dtype(xp, to_xp, to_np):
    """float32 holds positive numbers from 2^-149 (1.4e-45) to (2 - 2^-23) * 2^127 (3.4e38):
    an eps past that rounds to inf (every row becomes 0) and one below it to 0 (a constant
    row becomes 0 * inf = NaN), so both are refused by name; eps = 3e38 is held and the row
    [1, -1] (mean 0, var 1) normalises to +-1 / sqrt(1 + 3e38); float64 holds 1e39."""
    x32 = to_xp(np.array([[1.0, -1.0]], dtype=np.float32))
    for eps in (1e39, 1e-46, 1.4e-45):  # 1.4e-45 lies below 2^-149 = 1.401298464324817e-45
        with pytest.raises(ValueError, match=r"^eps: .*float32's range \[1\.401298464324817e-45, "
                                             r"3\.4028234663852886e\+38\], got " + re.escape(repr(eps)) + "$"):
            L.layer_norm_forward(x32, eps=eps)
    for eps in (3e38, float(np.finfo(np.float32).max), 2.0 ** -149):  # both ends held
        y, _ = L.layer_norm_forward(x32, eps=eps)
        np.testing.assert_allclose(to_np(y), [[1.0, -1.0]] / np.sqrt(1.0 + eps), rtol=1e-6)
    y, _ = L.layer_norm_forward(to_xp(np.full((1, 3), 2.0, dtype=np.float32)), eps=2.0 ** -149)
    np.testing.assert_array_equal(to_np(y), np.zeros((1, 3)))  # 0 / sqrt(2^-149), not NaN
    y, _ = L.layer_norm_forward(to_xp(np.array([[1.0, -1.0]])), eps=1e39)
    np.testing.assert_allclose(to_np(y), [[1.0, -1.0]] / np.sqrt(1.0 + 1e39), rtol=1e-12)


def test_eps_that_is_not_positive_and_finite_is_refused_as_such():
    """eps <= 0, inf and NaN are refused as not a positive finite float, with a dtype (as
    layer_norm_forward checks it) or without one, before any dtype's range is looked at."""
    x = np.array([[1.0, -1.0, 0.5]])
    for eps in (0.0, -1e-5, math.inf, -math.inf, math.nan):
        expected = r"^eps: expected a positive finite float, got " + re.escape(repr(eps)) + "$"
        with pytest.raises(ValueError, match=expected):
            L.check_eps("eps", eps)
        with pytest.raises(ValueError, match=expected):
            L.layer_norm_forward(x, eps=eps)
    L.check_eps("eps", 1e-300)  # positive and finite: no dtype, no range to hold it in


def test_an_int_eps_past_the_float_range_is_named_by_its_size():
    """An int too large for a float is refused as not a positive finite float, said by its
    bit length rather than its hundreds of digits."""
    for eps, sign in ((2**1100, "an"), (-(2**1100), "a negative")):
        with pytest.raises(ValueError, match=rf"^eps: expected a positive finite float, got {sign} int too "
                                             rf"large for a float \(1101 bits\)$"):
            L.check_eps("eps", eps)
    with pytest.raises(ValueError, match=r"^eps: expected a positive finite float, got -3$"):
        L.check_eps("eps", -3)


def test_layer_norm_eps_of_half_precision_is_held_by_float32():
    """float16 computes layer norm in float32, so an eps of 1e6 (past float16's 65504, where
    it would round to inf and give 0) is fine, and 1e39 is refused naming both dtypes."""
    y, _ = L.layer_norm_forward(np.array([[3.0, -3.0]], dtype=np.float16), eps=1e6)
    np.testing.assert_allclose(y.astype(np.float64), [[3.0, -3.0]] / np.sqrt(9.0 + 1e6), rtol=1e-3)
    expected = r"^eps: .*float32's range .*\(float16 computes layer norm in float32\)"
    with pytest.raises(ValueError, match=expected):
        L.layer_norm_forward(np.array([[3.0, -3.0]], dtype=np.float16), eps=1e39)


def test_layer_norm_of_a_wide_float32_row_of_large_entries(xp, to_xp, to_np):
    """Whether a row is rescaled depends on D: 64 entries of +-5e18 have squares of 2.5e37,
    each below float32's largest value (3.4e38), but summed to 1.6e39 past it. The row is
    the row of +-1 times 5e18, so y = +-1 / sqrt(1 + eps / 2.5e37) = +-1 (not 0 from an
    infinite variance)."""
    x = np.tile(np.array([5e18, -5e18], dtype=np.float32), (2, 32))  # [2, 64]
    y, _ = L.layer_norm_forward(to_xp(x))
    np.testing.assert_allclose(to_np(y), np.sign(x), rtol=1e-6)


@pytest.mark.parametrize("scale", [1e20, 1e36])
def test_layer_norm_of_huge_float32_rows_is_that_of_the_rows_rescaled(xp, to_xp, to_np, scale):
    # a row normalises as the row / scale with eps / scale^2 (which is what layer norm is,
    # up to rounding); the reference runs in float64 on rows of ordinary size
    rng = np.random.default_rng(12)
    base = np.array([[1.0, -1.0, 3.0, 0.0], [2.0, 2.0, 2.0, 2.0],
                     [0.5, -4.0, 1.25, 7.0], [-1e-3, 2e-3, 0.0, 1e-3]])  # [4, 4], one constant row
    dtype = np.float32
    x = (base * scale).astype(dtype)  # [4, 4]
    w, b, dout = (rng.standard_normal(n).astype(dtype) for n in (4, 4, (4, 4)))
    eps = 1e-5
    y, cache = L.layer_norm_forward(to_xp(x), to_xp(w), to_xp(b), eps=eps)
    dx, dw, db = L.layer_norm_backward(to_xp(dout), cache)
    x1, w1, b1, dout1 = (a.astype(np.float64) for a in (x, w, b, dout))
    y1, c1 = L.layer_norm_forward(to_xp(x1 / scale), to_xp(w1), to_xp(b1), eps=eps / scale**2)
    dx1, dw1, db1 = L.layer_norm_backward(to_xp(dout1), c1)
    tol = 8 * 2.0**-23  # 8 float32 ulps
    np.testing.assert_allclose(to_np(y), to_np(y1), rtol=tol, atol=tol)
    np.testing.assert_allclose(to_np(cache.rstd).astype(np.float64) * scale, to_np(c1.rstd), rtol=tol)
    dx, dx1 = to_np(dx).astype(np.float64) * scale, to_np(dx1)  # [4, 4] each
    assert np.all(np.abs(dx - dx1) <= tol * np.abs(dx1).max(axis=-1, keepdims=True)), (dx, dx1)
    np.testing.assert_allclose(to_np(dw), to_np(dw1), rtol=tol, atol=tol)
    np.testing.assert_allclose(to_np(db), to_np(db1), rtol=tol, atol=tol)
    # a NaN or inf in a row still gives NaN, in that row only
    for bad in (np.nan, np.inf):
        xb = x.copy()
        xb[1, 2] = bad
        with np.errstate(invalid="ignore"):  # inf - inf in that row's xc
            yb = to_np(L.layer_norm_forward(to_xp(xb), eps=eps)[0])
        assert np.isnan(yb[1]).all() and np.isfinite(np.delete(yb, 1, axis=0)).all()


@pytest.mark.parametrize("sign", [1.0, -1.0])
def test_layer_norm_of_a_float32_row_with_one_huge_entry(xp, to_xp, to_np, sign):
    """x = (sign * 3e19, 0, ..., 0), D = 16: xc = sign * 3e19 * (15/16, -1/16, ...), whose
    squares overflow float32 from the big entry's side only. Either sign normalises as the
    float64 row does: xhat = xc / sqrt(mean(xc^2) + eps)."""
    D = 16
    x = np.zeros((1, D))
    x[0, 0] = sign * 3e19
    y, _ = L.layer_norm_forward(to_xp(x.astype(np.float32)), None, None, eps=1e-5)
    xc = x - x.mean(axis=-1, keepdims=True)  # float64 (its squares are finite)
    want = xc / np.sqrt((xc * xc).mean(axis=-1, keepdims=True) + 1e-5)
    np.testing.assert_allclose(to_np(y), want, rtol=1e-6, atol=1e-6)

    rng = np.random.default_rng(2)
    x, w, b = to_xp(rng.standard_normal((4, 6))), to_xp(rng.standard_normal(6)), to_xp(rng.standard_normal(6))
    y, cache = L.layer_norm_forward(x, w, b)
    dx, dw, db = L.layer_norm_backward(to_xp(rng.standard_normal((4, 6))), cache)
    assert_same_namespace(xp, y, dx, dw, db)
    assert tuple(dx.shape) == (4, 6) and tuple(dw.shape) == (6,) and tuple(db.shape) == (6,)
    _, cache = L.layer_norm_forward(x)
    dx, dw, db = L.layer_norm_backward(to_xp(rng.standard_normal((4, 6))), cache)
    assert dw is None and db is None


def test_layer_norm_against_torch():
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(3)
    x = torch.from_numpy(rng.standard_normal((3, 4, 7))).requires_grad_()
    w = torch.from_numpy(rng.standard_normal(7)).requires_grad_()
    b = torch.from_numpy(rng.standard_normal(7)).requires_grad_()
    dout = torch.from_numpy(rng.standard_normal((3, 4, 7)))
    ref = torch.nn.functional.layer_norm(x, (7,), w, b, eps=1e-5)
    ref.backward(dout)
    y, cache = L.layer_norm_forward(x.detach(), w.detach(), b.detach(), eps=1e-5)
    dx, dw, db = L.layer_norm_backward(dout, cache)
    torch.testing.assert_close(y, ref.detach(), rtol=1e-12, atol=1e-12)
    for got, want in ((dx, x.grad), (dw, w.grad), (db, b.grad)):
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


def test_layer_norm_of_tiny_rows_is_centering_over_sqrt_eps(xp, to_xp, to_np):
    """A row whose variance is far below eps (entries of 1e-200 in float64, 1e-30 in float32)
    is normalised as the quoted steps say: rstd = 1 / sqrt(var + eps) -> 1 / sqrt(eps), so
    y = (x - mean(x)) / sqrt(eps) * weight, and the backward is that linear map's:
    dx = (g - mean(g)) / sqrt(eps) with g = dout * weight, dweight = sum(dout * y_hat).
    Such rows are not rescaled by max|x - mean(x)|: there eps / s^2 overflows, and y and
    dx came out 0."""
    rng = np.random.default_rng(15)
    eps = 1e-5
    for dtype, scale, tol in ((np.float64, 1e-200, 1e-12), (np.float32, 1e-30, 1e-5)):
        x = (scale * rng.standard_normal((3, 6))).astype(dtype)
        w, dout = rng.standard_normal(6).astype(dtype), rng.standard_normal((3, 6)).astype(dtype)
        y, cache = L.layer_norm_forward(to_xp(x), to_xp(w), None, eps=eps)
        dx, dw, _ = L.layer_norm_backward(to_xp(dout), cache)
        x64, w64, d64 = x.astype(np.float64), w.astype(np.float64), dout.astype(np.float64)
        xhat = (x64 - x64.mean(axis=-1, keepdims=True)) / math.sqrt(eps)  # [3, 6]
        g = d64 * w64
        want = {"y": xhat * w64, "dx": (g - g.mean(axis=-1, keepdims=True)) / math.sqrt(eps),
                "dw": (d64 * xhat).sum(axis=0)}
        for name, got in (("y", y), ("dx", dx), ("dw", dw)):
            ref = want[name]
            np.testing.assert_allclose(to_np(got), ref, rtol=tol, atol=tol * np.abs(ref).max(),
                                       err_msg=f"{name}, {dtype.__name__}")


@given(rows=st.integers(1, 4), D=st.integers(2, 9), shift=st.floats(-100.0, 100.0),
       scale=st.floats(0.1, 10.0), seed=st.integers(0, 2**16))
def test_layer_norm_rows_have_zero_mean_unit_variance(xp, to_xp, to_np, rows, D, shift, scale, seed):
    rng = np.random.default_rng(seed)
    x = scale * rng.standard_normal((rows, D)) + shift
    y, cache = L.layer_norm_forward(to_xp(x), None, None, eps=1e-12)
    y = to_np(y)
    np.testing.assert_allclose(y.mean(axis=-1), 0.0, atol=1e-9)
    var = x.var(axis=-1)  # y's variance is var / (var + eps): 1 but for rows of near-equal values
    np.testing.assert_allclose(y.var(axis=-1), var / (var + 1e-12), rtol=1e-6)
    # the compact backward is orthogonal to 1: dx sums to 0; and sum(dx * xhat) =
    # rstd * sum(g * xhat) * (1 - mean(xhat^2)), which eps alone keeps from 0
    g = rng.standard_normal((rows, D))
    dx, _, _ = L.layer_norm_backward(to_xp(g), cache)
    dx, rstd = to_np(dx), to_np(cache.rstd)[:, 0]
    # rounding: xhat carries ~2^-52 |mu| / std of error, and dx is rstd times that much of g
    cond = 1.0 + np.abs(x.mean(axis=-1)) * rstd
    tol = 1e-13 * rstd * np.abs(g).sum(axis=-1) * cond + 1e-12
    assert np.all(np.abs(dx.sum(axis=-1)) <= tol)
    expected = rstd * (g * y).sum(axis=-1) * (1.0 - (y * y).mean(axis=-1))
    assert np.all(np.abs((dx * y).sum(axis=-1) - expected) <= tol)


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_layer_norm_low_precision(xp, to_xp, to_np, backend, dtype):
    if not hasattr(xp, dtype):
        pytest.skip(f"{backend} has no {dtype}")
    dt = getattr(xp, dtype)
    rng = np.random.default_rng(4)
    x64, w64 = rng.standard_normal((3, 8)) + 3.0, rng.standard_normal(8)
    x, w = xp.astype(to_xp(x64), dt), xp.astype(to_xp(w64), dt)
    y, cache = L.layer_norm_forward(x, w, None)
    assert y.dtype == dt
    dout_h = xp.astype(to_xp(rng.standard_normal((3, 8))), dt)
    dx, dw, db = L.layer_norm_backward(dout_h, cache)
    assert dx.dtype == dt and dw.dtype == dt and db is None
    # dx and dw from the formulas in float64 at the inputs as rounded to dt (eps = 1e-5)
    xh, wh, dh = (to_np(xp.astype(a, xp.float64)) for a in (x, w, dout_h))
    xc = xh - xh.mean(axis=-1, keepdims=True)  # [3, 8]
    rstd = 1.0 / np.sqrt((xc * xc).mean(axis=-1, keepdims=True) + 1e-5)  # [3, 1]
    xhat, g = xc * rstd, dh * wh  # [3, 8]
    gc = g - g.mean(axis=-1, keepdims=True)
    want_dx = rstd * (gc - xhat * (gc * xhat).mean(axis=-1, keepdims=True))  # [3, 8]
    want_dw = (dh * xhat).sum(axis=0)  # [8]
    # Computed in float32 and rounded to dt once: within half an ulp of dt at the value, plus
    # float32's own error, measured up to 5 float32 ulps (torch) of the terms' size (a row's
    # largest |dx|; the sum of |dout * xhat| for dw): x - mean cancels mean(x) = 3 against std 1;
    # eight of them. For half precision that is far below its ulps; an intermediate rounded to dt
    # (a second rounding), a step taken in dt, or a term left out, does not fit
    eps = {"float32": 2.0**-23, "float16": 2.0**-10, "bfloat16": 2.0**-7}[dtype]
    for got, want, size in ((dx, want_dx, np.abs(want_dx).max(axis=-1, keepdims=True)),
                            (dw, want_dw, np.abs(dh * xhat).sum(axis=0))):
        half_ulp = 0.5 * eps * 2.0 ** np.floor(np.log2(np.abs(want)))  # of dt at each value
        tol = half_ulp + 8.0 * 2.0**-23 * size
        err = np.abs(to_np(xp.astype(got, xp.float64)) - want)
        assert np.all(err <= tol), (dtype, np.max(err / tol))
    # with a bias, dbias = sum(dout) over the rows, in x's dtype as well
    dout = xp.astype(to_xp(np.full((3, 8), 0.5)), dt)
    _, db = L.layer_norm_backward(dout, L.layer_norm_forward(x, w, w)[1])[1:]
    assert db.dtype == dt
    np.testing.assert_array_equal(to_np(xp.astype(db, xp.float64)), np.full(8, 1.5))
    ref, _ = L.layer_norm_forward(to_xp(to_np(xp.astype(x, xp.float64))), to_xp(to_np(xp.astype(w, xp.float64))))
    tol = {"float32": 1e-5, "float16": 1e-2, "bfloat16": 5e-2}[dtype]
    np.testing.assert_allclose(to_np(xp.astype(y, xp.float64)), to_np(ref), atol=tol * 4, rtol=tol)


# ---------------------------------------------------------- activations


def test_relu_gradients_and_values(xp, to_xp, to_np):
    rng = np.random.default_rng(5)
    x_host = rng.standard_normal((3, 4))
    x = to_xp(x_host)
    y, _ = L.relu_forward(x)
    np.testing.assert_array_equal(to_np(y), np.maximum(x_host, 0.0))
    assert_ok(gradcheck(L.relu_forward, L.relu_backward, [x], seed=5))
    y, _ = L.relu_forward(to_xp(np.array([np.nan, -1.0])))
    assert np.isnan(to_np(y)[0])


def test_relu_of_minus_inf_and_negatives_is_plus_zero(xp, to_xp, to_np):
    """ReLU selects 0 where x <= 0 (no product with a 0/1 mask, which makes -inf * 0 = NaN and
    -1 * 0 = -0.0): -inf and every negative give +0.0, +inf stays inf and NaN stays NaN."""
    x = np.array([-np.inf, -1.0, -1e-300, np.inf, np.nan, 2.0])
    y = to_np(L.relu_forward(to_xp(x))[0])
    np.testing.assert_array_equal(y, [0.0, 0.0, 0.0, np.inf, np.nan, 2.0])
    assert not np.signbit(y[:3]).any()


def test_relu_derivative_at_zero_is_zero(xp, to_xp, to_np):
    """At x = 0 (and -0.0) ReLU's derivative is taken as 0, as torch's relu backward
    (grad where x > 0); finite differences cannot see the kink."""
    x = np.array([-1.0, -0.0, 0.0, 2.0])
    y, cache = L.relu_forward(to_xp(x))
    np.testing.assert_array_equal(to_np(y), [0.0, 0.0, 0.0, 2.0])
    dx = L.relu_backward(to_xp(np.array([3.0, 5.0, 7.0, 11.0])), cache)
    np.testing.assert_array_equal(to_np(dx), [0.0, 0.0, 0.0, 11.0])


@pytest.mark.parametrize("approximate", ["none", "tanh"])
def test_gelu_gradients(xp, to_xp, approximate):
    rng = np.random.default_rng(6)
    x = to_xp(2.5 * rng.standard_normal((3, 5)))  # reaches both sides of erf's split
    report = gradcheck(lambda t: L.gelu_forward(t, approximate), L.gelu_backward, [x], seed=6)
    assert_ok(report)


@pytest.mark.parametrize("approximate", ["none", "tanh"])
def test_gelu_against_torch(approximate):
    torch = pytest.importorskip("torch")
    x = torch.linspace(-12.0, 12.0, 20_001, dtype=torch.float64).requires_grad_()
    dout = torch.from_numpy(np.random.default_rng(7).standard_normal(20_001))
    ref = torch.nn.functional.gelu(x, approximate=approximate)
    ref.backward(dout)
    y, cache = L.gelu_forward(x.detach(), approximate)
    dx = L.gelu_backward(dout, cache)
    torch.testing.assert_close(y, ref.detach(), rtol=1e-14, atol=1e-14)
    torch.testing.assert_close(dx, x.grad, rtol=1e-13, atol=1e-14)


@given(approximate=st.sampled_from(["none", "tanh"]),
       x=st.lists(st.floats(-50.0, 50.0, allow_nan=False), min_size=1, max_size=20))
def test_gelu_odd_part_is_identity(xp, to_xp, to_np, approximate, x):
    # x Phi(x) - (-x) Phi(-x) = x (Phi(x) + Phi(-x)) = x, and likewise with tanh (an odd function)
    a = np.asarray(x, dtype=np.float64)
    y_pos, _ = L.gelu_forward(to_xp(a), approximate)
    y_neg, _ = L.gelu_forward(to_xp(-a), approximate)
    np.testing.assert_allclose(to_np(y_pos) - to_np(y_neg), a, rtol=1e-14, atol=1e-300)


@pytest.mark.parametrize("approximate", ["none", "tanh"])
def test_gelu_half_precision_computes_in_float32(xp, to_xp, to_np, backend, approximate):
    if not hasattr(xp, "float16"):
        pytest.skip(f"{backend} has no float16")
    x = xp.astype(to_xp(np.linspace(-4.0, 4.0, 41)), xp.float16)
    y, cache = L.gelu_forward(x, approximate)
    assert y.dtype == xp.float16
    dout = xp.astype(to_xp(np.random.default_rng(12).standard_normal(41)), xp.float16)
    dx = L.gelu_backward(dout, cache)
    assert dx.dtype == xp.float16
    ref, _ = L.gelu_forward(xp.astype(x, xp.float64), approximate)
    np.testing.assert_allclose(to_np(xp.astype(y, xp.float64)), to_np(ref), rtol=1e-3, atol=1e-3)
    # dx = dout * GELU'(x), the slope from its formula in float64 at the float16 inputs
    xh, dh = (to_np(xp.astype(a, xp.float64)) for a in (x, dout))
    if approximate == "none":
        slope = np.array([0.5 * (1.0 + math.erf(v / math.sqrt(2.0)))
                          + v * math.exp(-0.5 * v * v) / math.sqrt(2.0 * math.pi) for v in xh])
    else:
        k = math.sqrt(2.0 / math.pi)
        t = np.tanh(k * (xh + 0.044715 * xh**3))
        slope = 0.5 * (1.0 + t) + 0.5 * xh * (1.0 - t * t) * k * (1.0 + 3.0 * 0.044715 * xh**2)
    want = dh * slope  # [41]
    # computed in float32 and rounded to float16 once: within half a float16 ulp of want, plus
    # the float32 slope's own error, a few float32 ulps (6e-8) of its terms (up to about 5 at
    # |x| <= 4, where 1 - t^2 cancels): 2e-6 of |dout| covers it. A slope or product taken in
    # float16, or rounded twice, is off by up to a float16 ulp (1e-3 relative)
    half_ulp = 0.5 * np.spacing(np.abs(want).astype(np.float16)).astype(np.float64)
    err = np.abs(to_np(xp.astype(dx, xp.float64)) - want)
    assert np.all(err <= half_ulp + 2e-6 * np.abs(dh)), np.max(err / (half_ulp + 2e-6 * np.abs(dh)))
    # far from 0 the slope is 0 (x -> -inf) or 1 (x -> +inf); the backward squares x, which in
    # float16 overflows past 256 (then 0 * inf = NaN in the tanh form): it squares in float32
    big = xp.astype(to_xp(np.array([-1000.0, -300.0, 300.0, 1000.0])), xp.float16)
    dbig = L.gelu_backward(xp.astype(to_xp(np.ones(4)), xp.float16), L.gelu_forward(big, approximate)[1])
    np.testing.assert_array_equal(to_np(xp.astype(dbig, xp.float64)), [0.0, 0.0, 1.0, 1.0])


@pytest.mark.parametrize("dtype", ["float64", "float32", "float16"])
def test_elementwise_layers_keep_a_0_d_array_an_array(xp, to_xp, to_np, backend, dtype):
    """A 0-d array in gives a 0-d array of its library and dtype out, forward and backward:
    NumPy's arithmetic on 0-d arrays gives a NumPy scalar (np.float64), which GELU and the
    residual connection returned in place of the array."""
    if not hasattr(xp, dtype):
        pytest.skip(f"{backend} has no {dtype}")
    dt = getattr(xp, dtype)
    x, d = (xp.astype(to_xp(np.asarray(v)), dt) for v in (0.75, -1.25))
    tol = {"float64": 1e-14, "float32": 1e-6, "float16": 2e-3}[dtype]

    def check(a, expected):
        assert type(a) is type(x) and tuple(a.shape) == () and a.dtype == dt, (type(a), a)
        assert abs(float(to_np(a)) - expected) <= tol * abs(expected), (float(to_np(a)), expected)

    # the textbook forms at x = 0.75 (Hendrycks & Gimpel): Phi, phi the normal CDF and density
    phi_cdf = 0.5 * (1.0 + math.erf(0.75 / math.sqrt(2.0)))
    pdf = math.exp(-0.5 * 0.75**2) / math.sqrt(2.0 * math.pi)
    c, u = math.sqrt(2.0 / math.pi), math.sqrt(2.0 / math.pi) * (0.75 + 0.044715 * 0.75**3)
    t = math.tanh(u)
    slope_tanh = 0.5 * (1.0 + t) + 0.5 * 0.75 * (1.0 - t * t) * c * (1.0 + 3.0 * 0.044715 * 0.75**2)
    for approximate, value, slope in (("none", 0.75 * phi_cdf, phi_cdf + 0.75 * pdf),
                                      ("tanh", 0.375 * (1.0 + t), slope_tanh)):
        y, cache = L.gelu_forward(x, approximate)
        check(y, value)
        check(L.gelu_backward(d, cache), -1.25 * slope)
    y, cache = L.relu_forward(x)
    check(y, 0.75)
    check(L.relu_backward(d, cache), -1.25)
    check(L.erf(x), math.erf(0.75))
    out, cache = L.residual_forward(x, d)
    check(out, -0.5)
    for g in L.residual_backward(d, cache):
        check(g, -1.25)
    # a 0-d x against a (2, 3) y: dx is dout summed to shape ()
    dout_host = np.random.default_rng(15).standard_normal((2, 3))
    _, cache = L.residual_forward(x, xp.astype(to_xp(np.ones((2, 3))), dt))
    dx, _ = L.residual_backward(xp.astype(to_xp(dout_host), dt), cache)
    check(dx, float(np.sum(dout_host.astype(dtype).astype(np.float64))))


# x^3 (the tanh form's u) and x^2 (both slopes) would overflow to inf there; tanh and exp take
# inf to the same limits as the clipped powers, but NumPy warns as they overflow: no warning now
@pytest.mark.filterwarnings("error::RuntimeWarning")
@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_gelu_tanh_slope_is_0_or_1_at_finite_inputs_whose_square_overflows(xp, to_xp, to_np, dtype):
    """x = +-1e13 and +-3e38 in float32 (x^3 past 7e12 overflows) and +-1e160, +-1e300 in float64
    are finite, but x^2 or x^3 overflows: the tanh slope was 0 * inf = NaN there, and NumPy
    warned of the overflow in both forms. GELU is x past +1e4 and -0 past -1e4, its slope 1
    and 0, as at x = +-1e4, where nothing overflows, and the random upstream gradient passes
    through (or not) unchanged, without a warning."""
    if dtype == "float64" and not hasattr(xp, "float64"):
        pytest.skip("no float64 on this backend")
    big = [1e13, 3e38] if dtype == "float32" else [1e13, 1e160, 1e300]
    x_host = np.array([-v for v in big[::-1]] + [-1e4, 1e4] + big, dtype=dtype)
    n = len(big)
    x = xp.astype(to_xp(x_host), getattr(xp, dtype))
    dout_host = np.random.default_rng(8).standard_normal(x_host.size).astype(dtype)
    for approximate in ("none", "tanh"):
        y, cache = L.gelu_forward(x, approximate)
        np.testing.assert_array_equal(to_np(y), np.where(x_host > 0, x_host, 0.0))
        assert not np.signbit(to_np(y)[x_host > 0]).any()
        dx = to_np(L.gelu_backward(xp.astype(to_xp(dout_host), getattr(xp, dtype)), cache))
        np.testing.assert_array_equal(dx, np.where(x_host > 0, dout_host, 0.0))
        assert dx.size == 2 * n + 2


@pytest.mark.filterwarnings("ignore:invalid value encountered in multiply:RuntimeWarning")  # the NaNs
def test_gelu_at_infinities_is_torch_s():
    """GELU(+inf) = +inf and GELU(-inf) = -inf * Phi(-inf) = NaN in both forms, as torch's
    float64 gelu; the exact form's slope at +-inf is NaN (inf * pdf = inf * 0), as torch's,
    and the tanh form's 1 and 0, its limits (torch's is NaN)."""
    torch = pytest.importorskip("torch")
    x = torch.tensor([-math.inf, -1.0, 2.0, math.inf], dtype=torch.float64)
    dout = torch.tensor([0.5, -1.5, 2.5, 0.75], dtype=torch.float64)
    for approximate in ("none", "tanh"):
        ref = torch.nn.functional.gelu(x, approximate=approximate)
        y, cache = L.gelu_forward(x.numpy(), approximate)
        np.testing.assert_array_equal(y[[0, 3]], ref.numpy()[[0, 3]])
        np.testing.assert_allclose(y[1:3], ref.numpy()[1:3], rtol=1e-14, atol=0.0)
        assert np.isnan(y[0]) and y[3] == math.inf
        dx = L.gelu_backward(dout.numpy(), cache)
        if approximate == "none":
            assert np.isnan(dx[[0, 3]]).all()
        else:
            np.testing.assert_array_equal(dx[[0, 3]], [0.0, 0.75])
        assert np.isfinite(dx[1:3]).all()


# -------------------------------------------------------- feed-forward


@pytest.mark.parametrize("activation", ["relu", "gelu", "gelu_tanh"])
@pytest.mark.parametrize("bias", [True, False])
def test_feed_forward_gradients_with_dropout(xp, to_xp, activation, bias):
    rng = np.random.default_rng(8)
    B, Lq, D, Fw = 2, 3, 4, 6
    x = to_xp(rng.standard_normal((B, Lq, D)))
    w1, w2 = to_xp(0.5 * rng.standard_normal((Fw, D))), to_xp(0.5 * rng.standard_normal((D, Fw)))
    b1, b2 = to_xp(rng.standard_normal(Fw)), to_xp(rng.standard_normal(D))
    keep_host = rng.random((B, Lq, Fw)) >= 0.3
    assert keep_host.any() and not keep_host.all()
    keep = to_xp(keep_host)

    if bias:
        def fwd(x, w1, b1, w2, b2):
            return L.feed_forward_forward(x, w1, b1, w2, b2, activation=activation, dropout_p=0.3,
                                          dropout_mask=keep)

        report = gradcheck(fwd, L.feed_forward_backward, [x, w1, b1, w2, b2],
                           names=["x", "w1", "b1", "w2", "b2"], seed=8)
    else:
        def fwd(x, w1, w2):
            return L.feed_forward_forward(x, w1, None, w2, None, activation=activation, dropout_p=0.3,
                                          dropout_mask=keep)

        def bwd(dout, cache):
            dx, dw1, db1, dw2, db2 = L.feed_forward_backward(dout, cache)
            assert db1 is None and db2 is None
            return dx, dw1, dw2

        report = gradcheck(fwd, bwd, [x, w1, w2], names=["x", "w1", "w2"], seed=8)
    assert_ok(report)


def test_feed_forward_matches_torch_sequential():
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(9)
    x = torch.from_numpy(rng.standard_normal((2, 3, 4))).requires_grad_()
    w1 = torch.from_numpy(rng.standard_normal((8, 4))).requires_grad_()
    b1 = torch.from_numpy(rng.standard_normal(8)).requires_grad_()
    w2 = torch.from_numpy(rng.standard_normal((4, 8))).requires_grad_()
    b2 = torch.from_numpy(rng.standard_normal(4)).requires_grad_()
    keep = torch.from_numpy(rng.random((2, 3, 8)) >= 0.25)
    dout = torch.from_numpy(rng.standard_normal((2, 3, 4)))
    tF = torch.nn.functional
    h = tF.gelu(tF.linear(x, w1, b1), approximate="tanh")
    ref = tF.linear(torch.where(keep, h / 0.75, 0.0), w2, b2)
    ref.backward(dout)
    y, cache = L.feed_forward_forward(*(t.detach() for t in (x, w1, b1, w2, b2)), activation="gelu_tanh",
                                      dropout_p=0.25, dropout_mask=keep)
    torch.testing.assert_close(y, ref.detach(), rtol=1e-12, atol=1e-12)
    for got, t in zip(L.feed_forward_backward(dout, cache), (x, w1, b1, w2, b2)):
        torch.testing.assert_close(got, t.grad, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("activation", ["relu", "gelu", "gelu_tanh"])
def test_feed_forward_runs_the_activation_it_names(xp, to_xp, to_np, activation):
    """y = act(x @ w1.T + b1) @ w2.T + b2 with act written out: max(h, 0), the exact
    h Phi(h) with math.erf, or the tanh form (here the two GELUs differ by up to 5e-4, y by 1e-3)."""
    rng = np.random.default_rng(16)
    x, w1, b1 = rng.standard_normal((2, 3, 4)), rng.standard_normal((6, 4)), rng.standard_normal(6)
    w2, b2 = rng.standard_normal((4, 6)), rng.standard_normal(4)
    h = x @ w1.T + b1  # [2, 3, 6]
    act = {
        "relu": lambda h: np.maximum(h, 0.0),
        "gelu": lambda h: h * 0.5 * (1.0 + np.vectorize(math.erf)(h / math.sqrt(2.0))),
        "gelu_tanh": lambda h: 0.5 * h * (1.0 + np.tanh(math.sqrt(2.0 / math.pi) * (h + 0.044715 * h**3))),
    }[activation]
    y, _ = L.feed_forward_forward(*map(to_xp, (x, w1, b1, w2, b2)), activation=activation)
    np.testing.assert_allclose(to_np(y), act(h) @ w2.T + b2, rtol=1e-12, atol=1e-12)


def test_feed_forward_of_zero_width_runs_both_ways(xp, to_xp, to_np):
    """A hidden width F = 0 gives y = b2 (torch's Linear(3, 0) then Linear(0, 3) does), and a
    model width D = 0 an empty y; both have gradients of their shapes. The linear steps
    reshaped to (-1, 0), which NumPy refuses ('cannot reshape array of size 0 into shape
    (0)', naming no argument)."""
    rng = np.random.default_rng(8)
    b2 = rng.standard_normal(3)
    for x, (w1, b1, w2, b2) in (
        (rng.standard_normal((2, 4, 3)), (np.zeros((0, 3)), np.zeros(0), np.zeros((3, 0)), b2)),
        (np.zeros((2, 4, 0)), (np.ones((5, 0)), rng.standard_normal(5), np.ones((0, 5)), np.zeros(0))),
    ):
        y, cache = L.feed_forward_forward(*map(to_xp, (x, w1, b1, w2, b2)), activation="gelu",
                                          dropout_p=0.5, rng=3)
        np.testing.assert_array_equal(to_np(y), np.broadcast_to(b2, y.shape))
        grads = L.feed_forward_backward(to_xp(rng.standard_normal(y.shape)), cache)
        assert [tuple(g.shape) for g in grads] == [a.shape for a in (x, w1, b1, w2, b2)]
        np.testing.assert_array_equal(to_np(grads[0]), np.zeros(x.shape))


def test_feed_forward_dropout_from_rng_is_reused(xp, to_xp, to_np):
    rng = np.random.default_rng(10)
    x = to_xp(rng.standard_normal((2, 5, 4)))
    w1, w2 = to_xp(rng.standard_normal((6, 4))), to_xp(rng.standard_normal((4, 6)))
    y1, c1 = L.feed_forward_forward(x, w1, None, w2, None, dropout_p=0.5, rng=3)
    y2, _ = L.feed_forward_forward(x, w1, None, w2, None, dropout_p=0.5, rng=3)
    np.testing.assert_array_equal(to_np(y1), to_np(y2))
    keep = c1.drop.keep
    y3, _ = L.feed_forward_forward(x, w1, None, w2, None, dropout_p=0.5, dropout_mask=keep)
    np.testing.assert_array_equal(to_np(y1), to_np(y3))
    assert 0 < int(to_np(keep).sum()) < 60
    # the mask is keep_mask of the one key drawn from rng = 3, and y is the formula: the kept
    # ReLU activations scaled by 1 / (1 - p) = 2, through w2
    want_keep = keep_mask(dropout_key(3), 0.5, (2, 5, 6), np)  # [2, 5, 6]
    np.testing.assert_array_equal(to_np(keep), want_keep)
    xh, w1h, w2h = to_np(x), to_np(w1), to_np(w2)
    hidden = np.maximum(xh @ w1h.T, 0.0) * want_keep / (1.0 - 0.5)  # [2, 5, 6]
    np.testing.assert_allclose(to_np(y1), hidden @ w2h.T, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("activation", ["relu", "gelu", "gelu_tanh"])
def test_feed_forward_float32_follows_float64(xp, to_xp, to_np, activation):
    rng = np.random.default_rng(14)
    host = [rng.standard_normal(s) for s in ((2, 3, 4), (6, 4), (6,), (4, 6), (4,))]
    keep = to_xp(rng.random((2, 3, 6)) >= 0.5)
    y64, c64 = L.feed_forward_forward(*(to_xp(a) for a in host), activation=activation,
                                      dropout_p=0.5, dropout_mask=keep)
    args32 = [xp.astype(to_xp(a), xp.float32) for a in host]
    y32, c32 = L.feed_forward_forward(*args32, activation=activation, dropout_p=0.5, dropout_mask=keep)
    assert y32.dtype == xp.float32
    np.testing.assert_allclose(to_np(y32), to_np(y64), rtol=1e-4, atol=1e-4)
    dout = rng.standard_normal((2, 3, 4))
    g64 = L.feed_forward_backward(to_xp(dout), c64)
    g32 = L.feed_forward_backward(xp.astype(to_xp(dout), xp.float32), c32)
    for a, b in zip(g32, g64):
        assert a.dtype == xp.float32
        np.testing.assert_allclose(to_np(a), to_np(b), rtol=1e-4, atol=1e-4)


# ------------------------------------------------------------- residual


@pytest.mark.parametrize("y_shape", [(2, 3, 4), (4,), (1, 3, 1)])
def test_residual_gradients_with_broadcasting(xp, to_xp, y_shape):
    rng = np.random.default_rng(11)
    x, y = to_xp(rng.standard_normal((2, 3, 4))), to_xp(rng.standard_normal(y_shape))
    assert_ok(gradcheck(L.residual_forward, L.residual_backward, [x, y], names=["x", "y"], seed=11))
    assert_ok(gradcheck(L.residual_forward, L.residual_backward, [y, x], names=["x", "y"], seed=12))


def test_residual_broadcasts_a_zero_length_axis_against_a_one(xp, to_xp, to_np):
    """An axis of 0 against an axis of 1 broadcasts to 0 (NumPy's rule): out, and so dout,
    are (0, 3); dy, summed over that empty axis, is zeros of y's shape (1, 3)."""
    x, y = to_xp(np.zeros((0, 3))), to_xp(np.ones((1, 3)))
    out, cache = L.residual_forward(x, y)
    assert tuple(out.shape) == (0, 3)
    dx, dy = L.residual_backward(to_xp(np.zeros((0, 3))), cache)
    assert tuple(dx.shape) == (0, 3)
    np.testing.assert_array_equal(to_np(dy), np.zeros((1, 3)))
    # but 0 against 2 does not broadcast: refused by name (not the library's own error)
    with pytest.raises(ValueError, match=r"^y: expected a shape that broadcasts with x's \(0, 3\), got shape \(2, 3\)"):
        L.residual_forward(x, to_xp(np.ones((2, 3))))


def test_residual_gradients_are_new_arrays_of_dout_s_kind(xp, to_xp, to_np):
    """dx and dy are not dout itself (adding into one changed the other and the caller's
    dout), and dout must be of out's library and dtype (a float32 one came back float32)."""
    rng = np.random.default_rng(13)
    x, y = to_xp(rng.standard_normal((2, 3))), to_xp(rng.standard_normal((2, 3)))
    dout_host = rng.standard_normal((2, 3))
    dout = to_xp(dout_host.copy())  # (to_xp may share the host array's memory)
    _, cache = L.residual_forward(x, y)
    dx, dy = L.residual_backward(dout, cache)
    dx[0, 0] = 100.0
    np.testing.assert_array_equal(to_np(dy), dout_host)
    np.testing.assert_array_equal(to_np(dout), dout_host)
    with pytest.raises(TypeError, match=r"^dout: expected dtype float64 \(that of the forward's out\)"):
        L.residual_backward(xp.astype(dout, xp.float32), cache)
    with pytest.raises(TypeError, match=r"^dout: expected a"):
        L.residual_backward(dout_host.tolist(), cache)


def test_backwards_name_dout_s_library():
    torch = pytest.importorskip("torch")
    x = np.random.default_rng(14).standard_normal((2, 5, 3))
    for forward, backward, dout in ((L.mean_pool_forward, L.mean_pool_backward, np.ones((2, 3))),
                                    (lambda a: L.residual_forward(a, a), L.residual_backward, np.ones(x.shape))):
        _, cache = forward(x)
        with pytest.raises(TypeError, match=r"^dout: expected a numpy array .*got a torch array"):
            backward(torch.from_numpy(dout), cache)


# ---------------------------------------------------------- mean pooling


def _padding_mask(rng, shape):
    """A bool (..., L) mask with a padded tail per row; row 0 keeps one token, the last row none."""
    lengths = rng.integers(1, shape[-1] + 1, size=shape[:-1])
    flat = lengths.reshape(-1)
    flat[0], flat[-1] = 1, 0
    return np.arange(shape[-1]) < lengths[..., None]  # [..., L]


@pytest.mark.parametrize("shape, masked", [((2, 5, 4), False), ((2, 3, 5, 4), False),
                                           ((3, 5, 4), True), ((2, 2, 6, 3), True)])
def test_mean_pool_gradients(xp, to_xp, shape, masked):
    rng = np.random.default_rng(15)
    x = to_xp(rng.standard_normal(shape))
    mask = to_xp(_padding_mask(rng, shape[:-1])) if masked else None
    report = gradcheck(lambda x: L.mean_pool_forward(x, mask), L.mean_pool_backward, [x],
                       names=["x"], seed=15)
    assert_ok(report)


def test_mean_pool_is_the_masked_mean_and_an_empty_row_gives_zeros(xp, to_xp, to_np):
    rng = np.random.default_rng(16)
    x = rng.standard_normal((4, 6, 3))
    m = _padding_mask(rng, (4, 6))
    out, cache = L.mean_pool_forward(to_xp(x), to_xp(m))
    out = to_np(out)
    for b in range(3):
        np.testing.assert_allclose(out[b], x[b][m[b]].mean(axis=0), rtol=1e-14, atol=1e-15)
    np.testing.assert_array_equal(out[3], 0.0)  # nothing to average: zeros, not NaN
    dout = rng.standard_normal((4, 3))
    dx = to_np(L.mean_pool_backward(to_xp(dout), cache))
    np.testing.assert_array_equal(dx[3], 0.0)
    np.testing.assert_array_equal(dx[~m], 0.0)  # padding gets no gradient
    np.testing.assert_allclose(dx.sum(axis=1)[:3], dout[:3], rtol=1e-14)  # the shares add up to dout
    plain, _ = L.mean_pool_forward(to_xp(x))
    np.testing.assert_allclose(to_np(plain), x.mean(axis=1), rtol=1e-14, atol=1e-15)


def test_mean_pool_gradient_is_a_new_writable_array(xp, to_xp, to_np):
    rng = np.random.default_rng(12)
    _, cache = L.mean_pool_forward(to_xp(rng.standard_normal((2, 3, 4))))
    dout = rng.standard_normal((2, 4))
    dx = L.mean_pool_backward(to_xp(dout), cache)
    dx[0, 0, 0] = 5.0  # one entry: a broadcast view would refuse it or change every row
    got = to_np(dx)
    assert got[0, 0, 0] == 5.0
    np.testing.assert_allclose(got[0, 1:, 0], np.full(2, dout[0, 0] / 3), rtol=1e-15)


def test_mean_pool_float32_stays_float32(xp, to_xp, to_np):
    rng = np.random.default_rng(17)
    x = xp.astype(to_xp(rng.standard_normal((2, 5, 3))), xp.float32)
    mask = to_xp(_padding_mask(rng, (2, 5)))
    out, cache = L.mean_pool_forward(x, mask)
    dx = L.mean_pool_backward(xp.astype(to_xp(rng.standard_normal((2, 3))), xp.float32), cache)
    assert out.dtype == xp.float32 and dx.dtype == xp.float32
    assert tuple(dx.shape) == (2, 5, 3)
    assert_same_namespace(xp, out, dx)


@pytest.mark.parametrize("masked", [False, True])
def test_mean_pool_half_precision_keeps_dtype(xp, to_xp, to_np, backend, masked):
    """float16 is averaged in float32 and rounded once: out and dx are float16. A row of
    four 30000s averages to 30000 (summed in float16 it would overflow to inf first); dx is
    each token's weight times a random dout."""
    if not hasattr(xp, "float16"):
        pytest.skip(f"{backend} has no float16")
    x = xp.astype(to_xp(np.full((2, 4, 3), 30000.0)), xp.float16)
    mask = to_xp(np.array([[True] * 4, [True, True, False, False]])) if masked else None
    out, cache = L.mean_pool_forward(x, mask)
    assert out.dtype == xp.float16
    np.testing.assert_array_equal(to_np(xp.astype(out, xp.float64)), np.full((2, 3), 30000.0))
    dout = xp.astype(to_xp(np.random.default_rng(13).standard_normal((2, 3))), xp.float16)
    dx = L.mean_pool_backward(dout, cache)
    assert dx.dtype == xp.float16
    # dx[b, i, :] = w[b, i] * dout[b, :]: the weights are 1/4 and 1/2, powers of two, so the
    # products of float16 numbers are float16 numbers, exactly
    w = np.array([[0.25] * 4, [0.5, 0.5, 0.0, 0.0]]) if masked else np.full((2, 4), 0.25)
    want = w[..., None] * to_np(xp.astype(dout, xp.float64))[:, None, :]  # [2, 4, 3]
    np.testing.assert_array_equal(to_np(xp.astype(dx, xp.float64)), want)


def test_mean_pool_bad_arguments_name_the_argument(xp, to_xp):
    x = to_xp(np.random.default_rng(18).standard_normal((2, 5, 3)))
    with pytest.raises(TypeError, match=r"^x: expected an array"):
        L.mean_pool_forward([[1.0]])
    with pytest.raises(TypeError, match=r"^x: expected a real floating dtype"):
        L.mean_pool_forward(to_xp(np.arange(6).reshape(2, 3)))
    with pytest.raises(ValueError, match=r"^x: expected shape \(\.\.\., L, D\)"):
        L.mean_pool_forward(to_xp(np.ones(3)))
    # no tokens to average: refused, not 0 / 0 = NaN
    with pytest.raises(ValueError, match=r"^x: expected shape \(\.\.\., L, D\) with L >= 1, got shape \(2, 0, 3\)"):
        L.mean_pool_forward(to_xp(np.ones((2, 0, 3))))
    for dtype in (np.float64, np.float32, np.int64, np.uint8):  # 1 = a token is spelled True
        with pytest.raises(TypeError, match=r"^mask: expected a bool mask .*got dtype "):
            L.mean_pool_forward(x, to_xp(np.ones((2, 5), dtype=dtype)))
    with pytest.raises(ValueError, match=r"^mask: expected shape \(2, 5\)"):
        L.mean_pool_forward(x, to_xp(np.ones((2, 3), dtype=bool)))
    with pytest.raises(TypeError, match=r"^mask: expected a"):
        L.mean_pool_forward(x, [[True] * 5] * 2)
    if namespace(x) is not namespace(np.ones(1)):  # a mask of another library is named
        with pytest.raises(TypeError, match=r"^mask: expected an? \S+ array \(that of x\), got a numpy array"):
            L.mean_pool_forward(x, np.ones((2, 5), dtype=bool))
    _, cache = L.mean_pool_forward(x)
    with pytest.raises(ValueError, match=r"^dout: expected shape \(2, 3\)"):
        L.mean_pool_backward(to_xp(np.ones((2, 5))), cache)
    with pytest.raises(TypeError, match=r"^dout: expected dtype float64"):
        L.mean_pool_backward(xp.astype(to_xp(np.ones((2, 3))), xp.float32), cache)
    with pytest.raises(TypeError, match=r"^cache: expected a MeanPoolCache"):
        L.mean_pool_backward(to_xp(np.ones((2, 3))), L.relu_forward(x)[1])


# --------------------------------------------------------- bad arguments


def test_bad_arguments_name_the_argument(xp, to_xp):
    rng = np.random.default_rng(12)
    x = to_xp(rng.standard_normal((2, 3, 4)))
    w4 = to_xp(rng.standard_normal(4))
    w5 = to_xp(rng.standard_normal(5))
    with pytest.raises(ValueError, match=r"^weight: expected shape \(4,\)"):
        L.layer_norm_forward(x, w5, None)
    with pytest.raises(ValueError, match=r"^bias: expected shape \(4,\)"):
        L.layer_norm_forward(x, w4, w5)
    with pytest.raises(ValueError, match=r"^eps: expected a positive"):
        L.layer_norm_forward(x, w4, w4, eps=0.0)
    with pytest.raises(TypeError, match=r"^eps: expected a positive float"):
        L.layer_norm_forward(x, w4, w4, eps="1e-5")
    with pytest.raises(TypeError, match=r"^eps: expected a positive float, got bool True"):
        L.layer_norm_forward(x, w4, w4, eps=True)  # (taken as 1.0 otherwise)
    with pytest.raises(TypeError, match=r"^x: expected a real floating dtype"):
        L.layer_norm_forward(to_xp(np.arange(4)), None, None)
    for shape in ((2, 0), ()):  # no entries to normalise (NumPy's max of none named nothing)
        with pytest.raises(ValueError, match=r"^x: expected shape \(\.\.\., D\) with D >= 1"):
            L.layer_norm_forward(to_xp(np.zeros(shape)), None, None)
    with pytest.raises(TypeError, match=r"^weight: expected dtype float32"):
        L.layer_norm_forward(xp.astype(x, xp.float32), w4, None)
    with pytest.raises(ValueError, match=r"^approximate: expected 'none' or 'tanh', got 'exact'"):
        L.gelu_forward(x, "exact")
    with pytest.raises(TypeError, match=r"^x: expected an array"):
        L.relu_forward([1.0, 2.0])
    with pytest.raises(TypeError, match=r"^x: expected an array"):
        L.erf(1.0)
    w1, w2 = to_xp(rng.standard_normal((6, 4))), to_xp(rng.standard_normal((4, 6)))
    with pytest.raises(ValueError, match=r"^w1: expected shape \(n, 4\)"):
        L.feed_forward_forward(x, w2, None, w2, None)
    with pytest.raises(ValueError, match=r"^w2: expected shape \(n, 6\)"):
        L.feed_forward_forward(x, w1, None, w1, None)
    for w in (w4, to_xp(rng.standard_normal((1, 6, 4)))):  # a weight is a matrix (n, D)
        with pytest.raises(ValueError, match=r"^w1: expected shape \(n, 4\) .*got shape " + re.escape(
                str(tuple(w.shape)))):
            L.feed_forward_forward(x, w, None, w2, None)
    with pytest.raises(ValueError, match=r"^b1: expected shape \(6,\)"):
        L.feed_forward_forward(x, w1, w4, w2, None)
    with pytest.raises(ValueError, match=r"^b2: expected shape \(4,\)"):
        L.feed_forward_forward(x, w1, None, w2, w5)
    with pytest.raises(TypeError, match=r"^w1: expected dtype float64"):
        L.feed_forward_forward(x, xp.astype(w1, xp.float32), None, w2, None)
    with pytest.raises(ValueError, match=r"^x: expected shape \(\.\.\., D\), got shape \(\)"):
        L.feed_forward_forward(to_xp(np.array(1.0)), w1, None, w2, None)
    with pytest.raises(ValueError, match=r"^activation: expected 'relu', 'gelu' or 'gelu_tanh'"):
        L.feed_forward_forward(x, w1, None, w2, None, activation="swish")
    with pytest.raises(ValueError, match=r"^dropout_p: expected a drop probability"):
        L.feed_forward_forward(x, w1, None, w2, None, dropout_p=1.0)
    with pytest.raises(TypeError, match=r"^dropout_mask: expected a bool keep-mask"):
        L.feed_forward_forward(x, w1, None, w2, None, dropout_p=0.5, dropout_mask=to_xp(np.ones((2, 3, 6))))
    with pytest.raises(ValueError, match=r"^dropout_mask"):
        L.feed_forward_forward(x, w1, None, w2, None, dropout_p=0.5,
                               dropout_mask=to_xp(np.ones((2, 3, 5), dtype=bool)))
    with pytest.raises(ValueError, match=r"^y: expected a shape that broadcasts with x's \(2, 3, 4\)"):
        L.residual_forward(x, w5)
    with pytest.raises(TypeError, match=r"^y: expected dtype float64"):
        L.residual_forward(x, xp.astype(w4, xp.float32))
    _, cache = L.layer_norm_forward(x, w4, w4)
    with pytest.raises(ValueError, match=r"^dout: expected shape \(2, 3, 4\)"):
        L.layer_norm_backward(w4, cache)
    with pytest.raises(TypeError, match=r"^cache: expected a LayerNormCache"):
        L.layer_norm_backward(x, L.relu_forward(x)[1])
    _, cache = L.gelu_forward(x)
    with pytest.raises(ValueError, match=r"^dout: expected shape \(2, 3, 4\)"):
        L.gelu_backward(w4, cache)
    _, cache = L.relu_forward(x)
    with pytest.raises(TypeError, match=r"^dout: expected dtype float64"):
        L.relu_backward(xp.astype(x, xp.float32), cache)
    _, cache = L.residual_forward(x, w4)
    with pytest.raises(ValueError, match=r"^dout: expected shape \(2, 3, 4\)"):
        L.residual_backward(w4, cache)
    _, cache = L.feed_forward_forward(x, w1, None, w2, None)  # its dout was named dy, linear_backward's
    with pytest.raises(ValueError, match=r"^dout: expected shape \(2, 3, 4\) .*got \(2, 3, 6\)"):
        L.feed_forward_backward(to_xp(np.ones((2, 3, 6))), cache)
    with pytest.raises(TypeError, match=r"^dout: expected dtype float64 .*got float32"):
        L.feed_forward_backward(xp.astype(x, xp.float32), cache)


def test_backward_leaves_inputs_alone(xp, to_xp, to_np):
    rng = np.random.default_rng(13)
    x_host, d_host = rng.standard_normal((3, 4)), rng.standard_normal((3, 4))
    x, d = to_xp(x_host.copy()), to_xp(d_host.copy())  # (to_xp may share the host memory)
    w = to_xp(np.ones(4) * 1.5)
    mask1 = to_xp(np.ones((3, 1), dtype=bool))
    for fwd, bwd in ((lambda t: L.layer_norm_forward(t, w, w), L.layer_norm_backward),
                     (L.relu_forward, L.relu_backward), (L.gelu_forward, L.gelu_backward),
                     (lambda t: L.residual_forward(t, t), L.residual_backward),
                     (lambda t: L.mean_pool_forward(xp.reshape(t, (3, 1, 4)), mask1), L.mean_pool_backward)):
        _, cache = fwd(x)
        bwd(d, cache)
        np.testing.assert_array_equal(to_np(x), x_host)
        np.testing.assert_array_equal(to_np(d), d_host)


def test_half_precision_layer_norm_of_a_row_whose_mean_float16_cannot_hold():
    """x = [1000, 1000.5] in float16: its mean 1000.25 lies halfway between two float16s
    (spacing 0.5 there), so the mean must be taken in float32, not rounded to float16 (1000
    would make xc = [0, 0.5]); likewise the backward's mean of dout = [1, 1 + 2^-10],
    1 + 2^-11. For D = 2, with h = (x0 - x1) / 2: y0 = h / sqrt(h^2 + eps) = -y1 and
    dx0 = -dx1 = (dout0 - dout1) / 2 * eps / (h^2 + eps)^1.5 (no weight: dxhat = dout);
    eps = 1/16 = h^2 keeps dx away from the cancellation of a negligible eps."""
    eps = 0.0625
    x = np.array([[1000.0, 1000.5]], dtype=np.float16)
    y, cache = L.layer_norm_forward(x, eps=eps)
    h = -0.25
    y0 = h / math.sqrt(h * h + eps)  # -1 / sqrt(2)
    np.testing.assert_allclose(y.astype(np.float64), [[y0, -y0]], rtol=1e-3)
    dout = np.array([[1.0, 1.0 + 2.0 ** -10]], dtype=np.float16)
    dx, _, _ = L.layer_norm_backward(dout, cache)
    dx0 = -(2.0 ** -10) / 2.0 * eps / (h * h + eps) ** 1.5  # -2^-11 sqrt(2)
    np.testing.assert_allclose(dx.astype(np.float64), [[dx0, -dx0]], rtol=2e-3)


def test_relu_gradient_where_x_is_off_is_plus_zero(xp, to_xp, to_np):
    """Where x <= 0 the gradient is +0.0 whatever dout's sign, as torch's relu backward
    (threshold_backward selects a +0): not -0.0, which prints "-0." and flips signbit."""
    x = np.array([-1.0, -0.0, 0.0, 2.0])
    _, cache = L.relu_forward(to_xp(x))
    dx = to_np(L.relu_backward(to_xp(np.array([-3.0, -5.0, 7.0, -11.0])), cache))
    np.testing.assert_array_equal(dx, [0.0, 0.0, 0.0, -11.0])
    assert not np.any(np.signbit(dx[:3])), dx


def test_half_precision_masked_mean_pool_rounds_once():
    """A masked mean of float16 tokens is computed in float32 and rounded to float16 once: the
    weights 1/3 in float16 (0.33325, 2.4e-4 low) would move the mean of [1, 1, 1 + 2^-9],
    1 + (2/3) 2^-10, from two thirds of a float16 step above 1 to below the half step, so it
    would round to 1.0 instead of 1 + 2^-10."""
    x = np.array([[[1.0], [1.0], [1.0 + 2.0 ** -9]]], dtype=np.float16)  # (1, 3, 1)
    out, _ = L.mean_pool_forward(x, np.ones((1, 3), dtype=bool))
    exact = 1.0 + (2.0 / 3.0) * 2.0 ** -10  # the mean, in float64
    assert out.dtype == np.float16 and out[0, 0] == np.float16(exact) == 1.0 + 2.0 ** -10


def test_layer_norm_backward_with_a_large_common_part_of_dout(xp, to_xp, to_np):
    """Rows [a, a + d] with dout = x, in float32: for D = 2 the closed form is
    dx = -+(d / 2) eps r^3, r = 1 / sqrt(d^2 / 4 + eps) (the xhat-term cancels all of g but
    eps r^2 of it). mean(g * xhat) of the uncentred g lost that to rounding at a = 1000
    (dx came out at half its value; torch's float32 is off by half the other way)."""
    eps = 1e-5
    for a, d in ((1000.0, 0.5), (-3000.0, 0.25), (10000.0, 1.0)):
        x = np.array([[a, a + d]], dtype=np.float32)
        _, cache = L.layer_norm_forward(to_xp(x), None, None, eps=eps)
        dx = to_np(L.layer_norm_backward(to_xp(x.copy()), cache)[0])
        dd = float(x[0, 1]) - float(x[0, 0])
        r = 1.0 / math.sqrt(dd * dd / 4.0 + eps)
        want = (dd / 2.0) * eps * r ** 3
        np.testing.assert_allclose(dx[0], [-want, want], rtol=1e-2)


def _layer_norm_in_decimal(x, w, b, eps, dout):
    """Layer norm of one float64 row and its backward in 60-digit decimal arithmetic (a float
    converts to a Decimal exactly): the quoted steps, then dx = r (g - mean(g) - xhat mean(g xhat))."""
    with decimal.localcontext() as ctx:
        ctx.prec = 60
        X, W, Bs, G = ([decimal.Decimal(float(v)) for v in a] for a in (x, w, b, dout))
        n = decimal.Decimal(len(X))
        mu = sum(X) / n
        xc = [v - mu for v in X]
        r = 1 / (sum(v * v for v in xc) / n + decimal.Decimal(eps)).sqrt()
        xhat = [v * r for v in xc]
        g = [d * wi for d, wi in zip(G, W)]
        mg, mgx = sum(g) / n, sum(gi * h for gi, h in zip(g, xhat)) / n
        y = [h * wi + bi for h, wi, bi in zip(xhat, W, Bs)]
        dx = [r * (gi - mg - h * mgx) for gi, h in zip(g, xhat)]
        return np.array([float(v) for v in y]), np.array([float(v) for v in dx])


def test_layer_norm_of_rows_with_a_large_common_offset_against_decimal_arithmetic(xp, to_xp, to_np):
    """Rows 1e8 + N(0, 1), 1e8 + N(0, 1e-3^2), a constant row of 1e8 and a constant row with
    eps 1e-300, in float64, against the same steps in 60-digit decimals: y and dx within 1e-7
    of each row's largest entry (a variance taken as mean(x^2) - mean(x)^2 loses all of the
    spread), but for y of the second row, within 1e-5: its float64 mean is off by up to half
    an ulp of 1e8 (7e-9), which shifts xhat by 7e-9 / 1e-3, in torch as here. torch's float64
    dx is off by 6e-7 on that row (its backward takes x, not xhat) and NaN on the last
    (0 * 1e150^3)."""
    rng = np.random.default_rng(21)
    D = 16
    rows = [(1e8 + rng.standard_normal(D), 1e-5, 1e-7), (1e8 + 1e-3 * rng.standard_normal(D), 1e-5, 1e-5),
            (np.full(D, 1e8), 1e-5, 1e-7), (np.full(D, 3.7), 1e-300, 1e-7)]
    for i, (x, eps, tol_y) in enumerate(rows):
        w, b, dout = 1.0 + 0.3 * rng.standard_normal(D), rng.standard_normal(D), rng.standard_normal(D)
        y, cache = L.layer_norm_forward(to_xp(x[None]), to_xp(w), to_xp(b), eps=eps)
        dx = L.layer_norm_backward(to_xp(dout[None]), cache)[0]
        want_y, want_dx = _layer_norm_in_decimal(x, w, b, eps, dout)
        for name, got, want, tol in (("y", y, want_y, tol_y), ("dx", dx, want_dx, 1e-7)):
            got = to_np(got)[0]
            assert np.all(np.isfinite(got)), (i, name, got)
            assert np.abs(got - want).max() <= tol * np.abs(want).max(), (i, name, got, want)


def test_defaults_are_torchs(xp, to_xp, to_np):
    """Called without them, the options take torch's defaults: layer norm's eps = 1e-5 (rows
    of entries +-1e-3, whose variance 1e-6 eps changes by a tenth), GELU's exact form
    x Phi(x), and the feed-forward network's ReLU; each against its formula."""
    rng = np.random.default_rng(21)
    x = 1e-3 * np.array([[1.0, -1.0, 1.0, -1.0], [2.0, -2.0, 0.0, 0.0]])  # [2, 4], mean 0
    y, _ = L.layer_norm_forward(to_xp(x))
    want = x / np.sqrt((x * x).mean(axis=-1, keepdims=True) + 1e-5)
    np.testing.assert_allclose(to_np(y), want, rtol=1e-12, atol=0)

    h = np.array([-3.0, -0.5, 0.0, 0.7, 2.5])
    g, _ = L.gelu_forward(to_xp(h))
    exact = [v * 0.5 * (1.0 + math.erf(v / math.sqrt(2.0))) for v in h]
    np.testing.assert_allclose(to_np(g), exact, rtol=1e-12, atol=1e-14)  # tanh form: ~1e-4 off

    D, F_ = 3, 4
    xs = rng.standard_normal((2, 5, D))
    w1, b1 = rng.standard_normal((F_, D)), rng.standard_normal(F_)
    w2, b2 = rng.standard_normal((D, F_)), rng.standard_normal(D)
    out, _ = L.feed_forward_forward(*(to_xp(a) for a in (xs, w1, b1, w2, b2)))
    want = np.maximum(xs @ w1.T + b1, 0.0) @ w2.T + b2  # [2, 5, D]
    assert (xs @ w1.T + b1 < 0).any() and (xs @ w1.T + b1 > 0).any()  # ReLU cuts somewhere
    np.testing.assert_allclose(to_np(out), want, rtol=1e-12, atol=1e-12)
