"""The gradient checker itself: it passes correct gradients and catches wrong ones."""

import numpy as np
import pytest

from npattn import functional as F
from npattn.gradcheck import check_vjp, gradcheck, numerical_vjp


def _case(to_xp):
    rng = np.random.default_rng(0)
    return to_xp(rng.standard_normal((2, 3, 4))), to_xp(rng.standard_normal((5, 4))), to_xp(rng.standard_normal(5))


@pytest.mark.parametrize("mode", ["full", "vjp"])
def test_correct_backward_passes(to_xp, mode):
    report = gradcheck(F.linear_forward, F.linear_backward, list(_case(to_xp)), names=["x", "w", "b"], mode=mode)
    assert report.ok, str(report)
    assert [r.name for r in report.inputs] == ["x", "w", "b"]
    assert report["w"].max_rel_err < 1e-6


@pytest.mark.parametrize("mode", ["full", "vjp"])
@pytest.mark.parametrize(
    "wrong",
    [
        lambda dx, dw, db: (dx * 0.0, dw, db),  # a backward that returns zeros
        lambda dx, dw, db: (dx, dw * 1.001, db),  # off by 0.1 %
        lambda dx, dw, db: (dx, dw, db + 1e-3),
    ],
    ids=["zeros", "scaled", "shifted"],
)
def test_wrong_backward_fails(to_xp, mode, wrong):
    def bad_backward(dy, cache):
        return wrong(*F.linear_backward(dy, cache))

    report = gradcheck(F.linear_forward, bad_backward, list(_case(to_xp)), names=["x", "w", "b"], mode=mode)
    assert not report.ok
    assert "FAIL" in str(report)


def test_numerical_vjp_matches_a_known_gradient():
    """For f(x) = x**3 elementwise, J^T dout = 3 x**2 dout."""
    rng = np.random.default_rng(1)
    x, dout = rng.standard_normal((3, 4)), rng.standard_normal((3, 4))
    (g,) = numerical_vjp(lambda t: t**3, [x], dout)
    np.testing.assert_allclose(g, 3 * x**2 * dout, rtol=1e-7, atol=1e-8)


def test_check_vjp_catches_a_transposed_gradient():
    rng = np.random.default_rng(2)
    a = rng.standard_normal((4, 4))
    x, dout = rng.standard_normal((4, 3)), rng.standard_normal((4, 3))
    good = check_vjp(lambda t: a @ t, [x], [a.T @ dout], dout)
    bad = check_vjp(lambda t: a @ t, [x], [a @ dout], dout)
    assert good.ok and not bad.ok


def test_default_upstream_gradient_is_random_not_ones(to_xp, to_np):
    seen = []

    def backward(dy, cache):
        seen.append(to_np(dy))
        return F.linear_backward(dy, cache)

    gradcheck(F.linear_forward, backward, list(_case(to_xp)))
    assert len(np.unique(seen[0])) == seen[0].size


def test_bad_arguments_are_reported():
    with pytest.raises(ValueError, match="mode"):
        gradcheck(F.linear_forward, F.linear_backward, [np.ones((2, 2)), np.ones((2, 2))], mode="fast")
    with pytest.raises(ValueError, match="names"):
        gradcheck(F.linear_forward, F.linear_backward, [np.ones((2, 2)), np.ones((2, 2))], names=["x"])


def test_check_gradients_is_the_plain_function_and_gradcheck_the_module(to_xp):
    import types

    import npattn
    import npattn.gradcheck as module

    assert npattn.check_gradients is module.gradcheck
    assert type(npattn.gradcheck) is types.ModuleType and not callable(npattn.gradcheck)
    report = npattn.check_gradients(F.linear_forward, F.linear_backward, list(_case(to_xp)))
    assert report.ok and report.mode == "full"


@pytest.mark.parametrize(
    "forward, got",
    [
        (lambda x, w: x @ w.T, "ndarray of shape (3, 2)"),  # unpacking would split its rows
        (lambda x, w: (x @ w.T,), "a tuple of 1 item"),
        (lambda x, w: (x @ w.T, None, None), "a tuple of 3 items"),
        (lambda x, w: ("out", None), "out of type str"),
    ],
)
def test_forward_that_breaks_the_out_cache_contract_is_a_type_error(forward, got):
    x, w = np.ones((3, 4)), np.ones((2, 4))
    with pytest.raises(TypeError, match=r"forward: expected .*\(out, cache\)") as exc:
        gradcheck(forward, F.linear_backward, [x, w])
    assert got in str(exc.value)


def test_backward_with_too_few_gradients_says_how_many():
    rng = np.random.default_rng(0)
    x, w = rng.standard_normal((3, 4)), rng.standard_normal((3, 4))

    def forward(x, w):
        return x * w, (x, w)

    with pytest.raises(ValueError, match="returned 1 gradient for 2 inputs, so w has none"):
        gradcheck(forward, lambda d, c: d * c[1], [x, w], names=["x", "w"])
    with pytest.raises(ValueError, match="returned 1 gradient for 2 inputs"):
        gradcheck(forward, lambda d, c: (d * c[1],), [x, w], mode="vjp")
    # a trailing None, and more entries than inputs, are still fine (linear's db for no bias)
    assert gradcheck(forward, lambda d, c: (d * c[1], d * c[0], None), [x, w]).ok
    with pytest.raises(ValueError, match="backward returned None for w"):
        gradcheck(forward, lambda d, c: (d * c[1], None), [x, w], names=["x", "w"])
    # a gradient that is no array is named as such (the message named an internal 'x')
    with pytest.raises(TypeError, match=r"^gradient of w \(what backward returned\): expected an array, got list"):
        gradcheck(forward, lambda d, c: (d * c[1], [1.0]), [x, w], names=["x", "w"])


def _square(x):  # out = x^2 summed to a NumPy scalar (np.sum's result): the pair's forward
    return np.sum(x * x), x


def test_numpy_scalars_as_outputs_inputs_and_gradients():
    """np.sum returns a NumPy scalar, and a 0-d input stays 0-d on its way to the function
    (it became shape (1,)); a wrong factor is still caught."""
    x = np.random.default_rng(0).standard_normal(3)
    assert gradcheck(_square, lambda d, x: 2.0 * d * x, [x]).ok
    assert not gradcheck(_square, lambda d, x: 3.0 * d * x, [x]).ok
    t = np.float64(0.7)  # a NumPy scalar input, and a 0-d array
    for scalar in (t, np.asarray(t)):
        r = gradcheck(lambda a, s: (a * s, s), lambda d, s: (None, np.sum(d * x)), [x, scalar], wrt=[1])
        assert r.ok, r


def test_a_check_of_nothing_or_with_bad_settings_is_refused_before_any_call():
    calls = []

    def forward(x):
        calls.append(1)
        return 2.0 * x, None

    x = np.ones((2, 3))
    backward = lambda d, c: 2.0 * d  # noqa: E731
    cases = [
        (dict(n_directions=0, mode="vjp"), ValueError, "n_directions"),
        (dict(wrt=[]), ValueError, "wrt: expected at least one"),
        (dict(wrt=[3]), ValueError, r"wrt: expected indices of floating array inputs \[0\], got 3"),
        (dict(eps=0.0), ValueError, "eps"), (dict(eps=float("nan")), ValueError, "eps"),
        (dict(rtol=-1.0), ValueError, "rtol"), (dict(atol=float("nan")), ValueError, "atol"),
        (dict(seed="abc"), TypeError, "seed"),
    ]
    for kw, exc, match in cases:
        with pytest.raises(exc, match=match):
            gradcheck(forward, backward, [x], **kw)
    with pytest.raises(ValueError, match="at least one floating array"):  # complex: nothing checked
        gradcheck(forward, backward, [x + 1j])
    with pytest.raises(TypeError, match="inputs: expected a list or tuple"):
        gradcheck(forward, backward, x)
    with pytest.raises(TypeError, match="backward: expected a callable"):
        gradcheck(forward, None, [x])
    assert not calls
    with pytest.raises(ValueError, match=r"dout: expected shape \(2, 3\)"):  # it broadcast
        gradcheck(forward, backward, [x], dout=np.ones(3))
    with pytest.raises(ValueError, match=r"dout: expected shape \(2, 3\)"):
        check_vjp(lambda a: 2.0 * a, [x], [2.0 * x], np.ones(3))
    # the other public checks name their arguments too (AttributeError, IndexError, NumPy's
    # broadcast error, or a complex dout's imaginary part dropped, before)
    from npattn.gradcheck import gradcheck_module, numerical_vjp

    f = lambda a: 2.0 * a  # noqa: E731
    more = [
        (lambda: numerical_vjp(f, [x], None), TypeError, "^dout: expected an array, got None"),
        (lambda: check_vjp(f, [x], [2.0 * x], np.ones(4)), ValueError,
         r"^dout: expected shape \(2, 3\) \(that of the function's output\), got \(4,\)"),
        (lambda: check_vjp(lambda a, b: a + b, [x, x], [x], x), ValueError,
         r"^grads: expected a list or tuple of one gradient per input \(2"),
        (lambda: check_vjp(f, [x], [(2.0 * x).tolist()], x), TypeError, r"^grads\[0\]: expected an array"),
        (lambda: check_vjp(f, [x], {"x": 2.0 * x}, x), TypeError, r"^grads: expected a list or tuple"),
        (lambda: check_vjp(f, [x], [2.0 * x], x + 0j), TypeError, "^dout: expected a real array"),
        (lambda: gradcheck(lambda a: (2.0 * a, None), lambda d, c: 2.0 * d, [x], dout=x + 0j), TypeError,
         "^dout: expected a real array"),
        (lambda: gradcheck_module(None, x, x, x), TypeError, "^module: expected an npattn MultiHeadAttention"),
    ]
    for call, exc, match in more:
        with pytest.raises(exc, match=match):
            call()


def test_an_all_nan_output_fails_without_dividing_by_zero():
    r = gradcheck(lambda x: (x * np.nan, None), lambda d, c: 0.0 * d, [np.ones(3)])
    assert not r.ok
