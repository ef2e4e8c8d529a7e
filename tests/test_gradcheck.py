"""The gradient checker itself: it passes correct gradients and catches wrong ones."""

import contextlib
import warnings

import numpy as np
import pytest

from npattn import MultiHeadAttention
from npattn import functional as F
from npattn.gradcheck import check_vjp, gradcheck, gradcheck_module, numerical_vjp

from reliability_helpers import raises


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
    with pytest.raises(ValueError, match="^mode: expected 'auto', 'full' or 'vjp', got 'fast'$"):
        gradcheck(F.linear_forward, F.linear_backward, [np.ones((2, 2)), np.ones((2, 2))], mode="fast")
    # not a str: a TypeError (a one-element array of a name was taken for the name)
    for mode, got in ((None, "got None"), (np.array(["full"]), "got numpy.ndarray"), (["vjp"], "got list")):
        with pytest.raises(TypeError, match=rf"^mode: expected 'auto', 'full' or 'vjp', {got}"):
            gradcheck(F.linear_forward, F.linear_backward, [np.ones((2, 2)), np.ones((2, 2))], mode=mode)
    with pytest.raises(ValueError, match="^names: expected 2 names, got 1$"):
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
        (lambda x, w: ("out", None), "got str as out"),
        (lambda x, w: (None, None), "got None as out"),
        # NumPy's scalar types carry shape as a descriptor: reading it failed naming nothing,
        # and as out it passed for an array
        (lambda x, w: np.float64, "got type numpy.float64"),
        (lambda x, w: (np.float64, None), "got type numpy.float64 as out"),
    ],
)
def test_forward_that_breaks_the_out_cache_contract_is_a_type_error(forward, got):
    x, w = np.ones((3, 4)), np.ones((2, 4))
    with pytest.raises(TypeError, match=r"forward: expected .*\(out, cache\)") as exc:
        gradcheck(forward, F.linear_backward, [x, w])
    assert str(exc.value).endswith(got), str(exc.value)


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
    with pytest.raises(ValueError, match=r"^gradient of w \(what backward returned\): expected an array "
                                         r"\(w is checked\), got None$"):
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
        (dict(n_directions=0, mode="vjp"), ValueError, "^n_directions: expected a positive int, got 0$"),
        (dict(wrt=[]), ValueError, "^wrt: expected at least one input index to check, got none$"),
        (dict(wrt=[3]), ValueError, r"^wrt: expected indices of floating array inputs \[0\], got 3$"),
        (dict(eps=0.0), ValueError, r"^eps: expected a finite number > 0, got 0\.0$"),
        (dict(eps=float("nan")), ValueError, "^eps: expected a finite number > 0, got nan$"),
        (dict(rtol=-1.0), ValueError, r"^rtol: expected a finite number >= 0, got -1\.0$"),
        (dict(atol=float("nan")), ValueError, "^atol: expected a finite number >= 0, got nan$"),
        (dict(seed="abc"), TypeError, "^seed: expected None, a non-negative int seed, a SeedSequence, a "
                                      "BitGenerator or a numpy.random.Generator, got str 'abc'$"),
    ]
    for kw, exc, match in cases:
        with pytest.raises(exc, match=match):
            gradcheck(forward, backward, [x], **kw)
    with pytest.raises(ValueError, match=r"^inputs: expected at least one floating array to check, "
                                         r"got none among 1 input$"):  # complex: nothing checked
        gradcheck(forward, backward, [x + 1j])
    with pytest.raises(TypeError, match=r"^inputs: expected a list or tuple of the function's arguments, "
                                        r"got numpy\.ndarray$"):
        gradcheck(forward, backward, x)
    with pytest.raises(TypeError, match="^backward: expected a callable, got None$"):
        gradcheck(forward, None, [x])
    with pytest.raises(TypeError, match="^forward: expected a callable, got str$"):
        gradcheck("forward", backward, [x])
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


def _module_state(m):
    """What a call may change in a MultiHeadAttention: the arrays its params hold, the cache of
    its last forward, grads, dmask and mode (the dropout generator: by the next mask drawn)."""
    return dict(m.params), m.cache, m.grads, m.dmask, m.training


def _assert_same_state(m, before):
    params, cache, grads, dmask, training = _module_state(m)
    assert params.keys() == before[0].keys()
    assert all(params[n] is before[0][n] for n in params), "params changed"
    assert cache is before[1], "the cache of the last forward changed"
    assert grads is before[2] and dmask is before[3] and training == before[4]


def test_gradcheck_module_leaves_the_module_as_it_was():
    """Before, the check left the cache of its last evaluation (a later backward differentiated
    that forward), and its grads; a bad dout was found only after a forward had run."""
    rng = np.random.default_rng(0)
    q, kv = rng.standard_normal((2, 3, 4)), rng.standard_normal((2, 5, 4))
    keep = rng.random((2, 2, 3, 5)) > 0.3
    m = MultiHeadAttention(4, 2, dtype="float64", dropout=0.3, seed=0, impl="numpy")
    m(q, kv, kv, dropout_mask=keep)
    m.backward(rng.standard_normal((2, 3, 4)))
    before = _module_state(m)
    fk = dict(dropout_mask=keep)
    for bad, exc, text in ((np.ones(3), ValueError, "(2, 3, 4)"), ([1.0], TypeError, "list"),
                           (np.ones((2, 3, 4)) + 0j, TypeError, "complex128")):
        with raises(exc, "dout", text):
            gradcheck_module(m, q, kv, kv, forward_kwargs=fk, dout=bad)
        _assert_same_state(m, before)
    assert gradcheck_module(m, q, kv, kv, forward_kwargs=fk, mode="vjp").ok
    _assert_same_state(m, before)
    with pytest.raises(ValueError, match="^mask"):  # a forward that fails inside the check
        gradcheck_module(m, q, kv, kv, forward_kwargs=dict(fk, mask=np.ones((7, 7), bool)))
    _assert_same_state(m, before)
    twin = MultiHeadAttention(4, 2, dtype="float64", dropout=0.3, seed=0, impl="numpy")
    np.testing.assert_array_equal(m(q, kv, kv)[0], twin(q, kv, kv)[0])  # the same mask drawn


def test_gradcheck_module_keeps_the_last_forward_differentiable():
    """The forwards of the check reuse the arrays of the forwards they replace (the module's
    workspace): never those of the forward the module holds, whose backward still follows."""
    rng = np.random.default_rng(1)
    q, kv, d = (rng.standard_normal(s) for s in ((2, 3, 4), (2, 5, 4), (2, 3, 4)))
    m, twin = (MultiHeadAttention(4, 2, dtype="float64", seed=0, impl="numpy") for _ in range(2))
    m(q, kv, kv)
    twin(q, kv, kv)
    for _ in range(2):  # inputs of the same shapes, other numbers: arrays the kernel may reuse
        gradcheck_module(m, q + 1.0, 0.5 * kv, 0.5 * kv, mode="vjp")
    for got, want in zip(m.backward(d), twin.backward(d)):
        np.testing.assert_array_equal(got, want)
    for name in m.grads:
        np.testing.assert_array_equal(m.grads[name], twin.grads[name])


def test_gradcheck_module_refuses_a_kv_cache():
    """Decoding appends to the cache and has no backward: before, every evaluation appended to
    the caller's cache and the check failed inside with a RuntimeError."""
    m = MultiHeadAttention(4, 2, dtype="float64", seed=0)
    x = np.random.default_rng(0).standard_normal((1, 2, 4))
    kv = m.new_cache(1, 16)
    with raises(ValueError, "forward_kwargs", "kv_cache"):
        gradcheck_module(m, x, x, x, forward_kwargs={"kv_cache": kv})
    assert list(kv.cache_seqlens) == [0] and m.cache is None
    assert gradcheck_module(m, x, x, x, forward_kwargs={"kv_cache": None}).ok  # the default


def test_bfloat16_torch_inputs_are_checked_in_float64():
    """A torch bfloat16 input is cast to float64 on torch, as every floating input: NumPy has no
    bfloat16 to copy it into first (it raised torch's 'Got unsupported ScalarType BFloat16')."""
    torch = pytest.importorskip("torch", reason="bfloat16 tensors need torch")
    from npattn import attention as A

    q = torch.tensor(np.random.default_rng(0).standard_normal((1, 2, 3, 4)), dtype=torch.bfloat16)
    report = gradcheck(A.sdpa_forward, A.sdpa_backward, [q, q, q], mode="full")
    assert report.ok, report
    assert q.dtype == torch.bfloat16


@pytest.mark.parametrize("mode", ["full", "vjp"])
@pytest.mark.parametrize("bad", [np.inf, -np.inf])
def test_an_infinite_gradient_entry_fails(mode, bad):
    """One inf entry made the error and the scale both inf, and ``inf <= atol + rtol * inf``
    held: the check passed, with a relative error of NaN in full mode and of 0 in vjp mode."""
    x = np.random.default_rng(0).standard_normal((2, 3))

    def backward(d, x):
        g = 2.0 * d * x
        g[0, 1] = bad
        return g

    with warnings.catch_warnings():  # a failure reported, not a NumPy warning on the way
        warnings.simplefilter("error", RuntimeWarning)
        report = gradcheck(lambda x: (x * x, x), backward, [x], mode=mode)
        assert not report.ok
        assert report["input0"].max_rel_err == np.inf and "FAIL" in str(report)
        assert not check_vjp(lambda t: t * t, [x], [np.full_like(x, bad)], x).ok


def test_a_complex_output_or_gradient_is_refused_not_cut_to_its_real_part():
    """The float64 copies dropped the imaginary part (NumPy's ComplexWarning only): a gradient
    2 x + 1j passed as 2 x, and an output x^2 + 1j x was checked as x^2. A gradient of the wrong
    shape is found before the differences run, in the words of full mode in vjp mode too (it
    was 'grads[0] (input0)', check_vjp's argument)."""
    x = np.random.default_rng(0).standard_normal((2, 3))
    calls = []

    def forward(a):
        calls.append(1)
        return a * a, a

    for mode in ("full", "vjp"):
        with raises(TypeError, "gradient of x (what backward returned)", "real", "complex128"):
            gradcheck(forward, lambda d, a: 2.0 * d * a + 1j, [x], names=["x"], mode=mode)
        with raises(ValueError, "gradient of x", "(2, 3)", "(3, 2)"):
            gradcheck(forward, lambda d, a: (2.0 * d * a).T, [x], names=["x"], mode=mode)
        with raises(TypeError, "forward", "real", "complex128"):
            gradcheck(lambda a: (a * a + 1j * a, a), lambda d, a: 2.0 * d * a, [x], mode=mode)
    assert len(calls) == 8  # the analytic forward and its repeat (the same output?) only: nothing differenced
    with raises(TypeError, "grads[0]", "real", "complex128"):
        check_vjp(lambda a: a * a, [x], [2.0 * x + 1j], x)
    for check in (lambda f: check_vjp(f, [x], [2.0 * x], x), lambda f: numerical_vjp(f, [x], x)):
        with raises(TypeError, "f", "real", "complex128"):
            check(lambda a: a * a + 1j * a)
        with raises(TypeError, "f", "returning an array", "list"):  # was 'x: expected an array'
            check(lambda a: (a * a).tolist())


def test_names_wrt_and_dout_are_checked_before_the_forward_runs():
    """names='xw' named two inputs 'x' and 'w', names=[1] a column 1, names=3 raised Python's
    "'int' object is not iterable"; wrt=[0, 0] checked input 0 twice (two report rows); a
    dout that is no array was found after the forward had run."""
    calls = []

    def forward(x, w):
        calls.append(1)
        return x * w, (x, w)

    x = np.random.default_rng(0).standard_normal((2, 3))
    backward = lambda d, c: (d * c[1], d * c[0])  # noqa: E731
    cases = [
        (dict(names="xw"), TypeError, ("names", "list or tuple of str", "str")),
        (dict(names=[1, 2]), TypeError, ("names", "list or tuple of str", "[1, 2]")),
        (dict(names=3), TypeError, ("names", "list or tuple of str", "int")),
        (dict(wrt=[0, 0]), ValueError, ("wrt", "distinct", "[0, 0]")),
        (dict(dout=[[1.0] * 3] * 2), TypeError, ("dout", "array", "list")),
        (dict(dout=np.ones((2, 3)) + 0j), TypeError, ("dout", "real", "complex128")),
    ]
    for kw, exc, fragments in cases:
        with raises(exc, *fragments):
            gradcheck(forward, backward, [x, x], **kw)
    with raises(ValueError, "wrt", "distinct"):
        check_vjp(lambda a: 2.0 * a, [x], [2.0 * x], x, wrt=[0, 0])
    with raises(TypeError, "names", "list or tuple of str"):
        check_vjp(lambda a: 2.0 * a, [x], [2.0 * x], x, names="x")
    assert not calls
    assert gradcheck(forward, backward, [x, x], names=("x", "w"), wrt=(1,)).ok  # tuples are fine


def test_a_function_that_writes_into_its_arguments_is_named_and_the_callers_arrays_stay():
    """A forward that wrote into its mask argument wrote into the caller's mask (masks were
    passed uncopied); one that wrote into its floating input, or a backward that wrote into
    dout or (through its cache) into an input, failed with a relative error of 1 and no word
    of why: the differences were taken at the changed values, with a zeroed dout."""
    rng = np.random.default_rng(0)
    x, mask = rng.standard_normal((2, 3)), rng.random((2, 3)) > 0.3
    x0, mask0 = x.copy(), mask.copy()

    def forward(a, m):
        return a * a * m, (a, m)

    def backward(d, c):
        return 2.0 * d * c[0] * c[1], None

    assert gradcheck(forward, backward, [x, mask], wrt=[0]).ok

    def writes_mask(a, m):
        out = forward(a, m)
        m[...] = False
        return out

    def writes_x(a, m):
        out = forward(a.copy(), m)
        a *= 2.0
        return out

    def writes_dout(d, c):
        g = backward(d, c)
        d[...] = 0.0
        return g

    def writes_cache(d, c):
        g = backward(d, c)
        c[0][...] = 0.0  # the cache holds the input itself
        return g

    for mode in ("full", "vjp"):
        with raises(ValueError, "forward", "leaves its arguments", "inputs[1] (mask)"):
            gradcheck(writes_mask, backward, [x, mask], names=["x", "mask"], wrt=[0], mode=mode)
        with raises(ValueError, "forward", "inputs[0] (x)"):
            gradcheck(writes_x, backward, [x, mask], names=["x", "mask"], wrt=[0], mode=mode)
        with raises(ValueError, "backward", "dout"):
            gradcheck(forward, writes_dout, [x, mask], wrt=[0], mode=mode)
        with raises(ValueError, "backward", "inputs[0] (x)"):
            gradcheck(forward, writes_cache, [x, mask], names=["x", "mask"], wrt=[0], mode=mode)
    with raises(ValueError, "f", "leaves its arguments", "inputs[1]"):
        check_vjp(lambda a, m: writes_mask(a, m)[0], [x, mask], [2.0 * x, None], x, wrt=[0])
    with raises(ValueError, "f", "leaves its arguments", "inputs[0]"):
        numerical_vjp(lambda a, m: writes_x(a, m)[0], [x, mask], x, wrt=[0])
    np.testing.assert_array_equal(x, x0)
    np.testing.assert_array_equal(mask, mask0)


def test_a_failing_input_says_where_in_full_mode():
    """The report named the input but not the entry: one wrong sign in a 4 x 4 gradient was
    'FAIL' with no index."""
    rng = np.random.default_rng(3)
    a, x = rng.standard_normal((4, 4)), rng.standard_normal((4, 4))

    def backward(d, c):
        da, dx = d @ c[1].T, c[0].T @ d
        da[2, 1] = -da[2, 1]
        return da, dx

    report = gradcheck(lambda a, x: (a @ x, (a, x)), backward, [a, x], names=["a", "x"], mode="full")
    assert not report["a"].passed and report["a"].where == (2, 1)
    assert report["x"].passed
    assert "FAIL at (2, 1)" in str(report)
    assert gradcheck(lambda a, x: (a @ x, (a, x)), backward, [a, x], mode="vjp")["input0"].where is None


def _scaled_by_3():
    """f(x) = 3 x elementwise: with dout = d, the gradient of L = <3 x, d> is exactly 3 d."""
    x = np.arange(4.0)
    dout = np.array([1.0, -2.0, 0.5, 4.0])

    def forward(t):
        return 3.0 * t, None

    return forward, x, dout, 3.0 * dout  # true gradient [3, -6, 1.5, 12]


def test_full_mode_reports_the_largest_error_and_scale_and_fails_just_past_rtol():
    """One entry off by 1e-4 in a gradient whose largest entry is 12: the error is that 1e-4
    (the largest, not the mean 2.5e-5), the scale 12 (the largest |g|), and with rtol = 1e-6
    the bound is 1.2e-5, so the check fails (a bound 100 times looser would pass it)."""
    forward, x, dout, true = _scaled_by_3()
    wrong = true.copy()
    wrong[0] += 1e-4

    report = gradcheck(forward, lambda d, c: (wrong,), [x], dout=dout, mode="full", rtol=1e-6, atol=0.0)
    r = report["input0"]
    assert not r.passed and r.where == (0,)
    np.testing.assert_allclose(r.max_abs_err, 1e-4, rtol=1e-4)
    np.testing.assert_allclose(r.scale, 12.0, rtol=1e-8)
    np.testing.assert_allclose(r.max_rel_err, 1e-4 / 12.0, rtol=1e-4)
    # within the bound: off by 5e-6 <= 1e-6 * 12 passes
    close = true.copy()
    close[0] += 5e-6
    assert gradcheck(forward, lambda d, c: (close,), [x], dout=dout, mode="full", rtol=1e-6, atol=0.0).ok


def test_vjp_mode_scale_is_the_sum_of_the_terms_of_the_product():
    """vjp mode's scale is sum_j |g_j t_j| for the direction t it took, not |<g, t>|: t is read
    back from the points the function was evaluated at, x +- eps t."""
    forward, x, dout, true = _scaled_by_3()
    seen = []

    def f(t):
        seen.append(np.array(t))
        return forward(t)[0]

    eps = 1e-3
    report = check_vjp(f, [x], [true], dout, eps=eps, n_directions=1, atol=0.0, seed=3)
    plus, minus = seen[-2:]
    t = (plus - minus) / (2 * eps)
    # terms of both signs: the sum of their sizes is not the size of their sum
    assert np.sum(np.abs(true * t)) > 1.5 * abs(np.sum(true * t))
    np.testing.assert_allclose(report["input0"].scale, np.sum(np.abs(true * t)), rtol=1e-9)
    assert report.ok


@pytest.mark.parametrize("bad_direction", [0, 2])
def test_vjp_mode_fails_when_any_one_of_the_directions_fails(bad_direction):
    """A function whose slope is 2 instead of 3 for the evaluations of one direction only:
    the check of that direction fails, so the input fails, whether it is the first or the
    last of the three."""
    _, x, dout, true = _scaled_by_3()
    calls = []

    def f(t):
        calls.append(None)
        # two calls at x (is f deterministic?), then two calls a direction
        slope = 2.0 if (len(calls) - 3) // 2 == bad_direction else 3.0
        return slope * t

    report = check_vjp(f, [x], [true], dout, n_directions=3, atol=1e-8)
    assert len(calls) == 2 + 6
    assert not report.ok


def test_a_tiny_wrong_gradient_of_an_unused_input_fails_at_the_default_atol():
    """y does not enter f, so its gradient is exactly 0; a backward that returns 1e-6 for it is
    wrong. The default atol is the float64 rounding floor of the differences, about
    16 * 2**-52 * sum|out * dout| / eps = 4e-9 here, far below 1e-6."""
    x, y = np.array([0.5, -0.25]), np.array([1.0, 2.0])
    dout = np.array([1.0, 1.0])  # sum |out * dout| = 0.75

    def forward(a, b):
        return a + 0.0, None

    report = gradcheck(forward, lambda d, c: (d, np.full(2, 1e-6)), [x, y], dout=dout, mode="full",
                       names=["x", "y"])
    assert report["x"].passed
    assert not report["y"].passed
    assert report.atol < 1e-8


def test_a_zero_gradient_where_there_is_one_is_infinitely_wrong_in_vjp_mode():
    """A gradient of all zeros has scale 0 in vjp mode; the difference is of order 1, past atol,
    so its relative error is inf, not 0."""
    _, x, dout, _ = _scaled_by_3()
    report = check_vjp(lambda t: 3.0 * t, [x], [np.zeros(4)], dout, atol=1e-8)
    assert not report.ok
    assert report["input0"].max_rel_err == np.inf


def test_auto_mode_counts_the_entries_of_all_checked_inputs_together():
    """x (2, 3, 4), w (5, 4), b (5,): 24 + 20 + 5 = 49 entries; full up to max_full_size = 49."""
    inputs = list(_case(np.asarray))
    assert gradcheck(F.linear_forward, F.linear_backward, inputs, max_full_size=49).mode == "full"
    assert gradcheck(F.linear_forward, F.linear_backward, inputs, max_full_size=48).mode == "vjp"


def test_wrt_of_a_mask_input_is_refused_naming_wrt():
    x, mask = np.ones((2, 3)), np.ones((2, 3), dtype=bool)
    with raises(ValueError, "wrt", "[0]", "1"):
        gradcheck(lambda a, m: (a * m, None), lambda d, c: (d, None), [x, mask], wrt=[1])


def test_gradcheck_module_names_key_and_value_by_their_own_gradients():
    """kdim 3, vdim 5: each report's scale is the largest entry of that input's gradient, as
    the module's backward gives it for the same dout (key and value not swapped)."""
    rng = np.random.default_rng(4)
    mha = MultiHeadAttention(4, 2, kdim=3, vdim=5, dtype="float64", seed=1)
    q, k, v = rng.standard_normal((1, 2, 4)), rng.standard_normal((1, 3, 3)), 10.0 * rng.standard_normal((1, 3, 5))
    dout = rng.standard_normal((1, 2, 4))
    mha.forward(q, k, v)
    _, dk, dv = mha.backward(dout)
    report = gradcheck_module(mha, q, k, v, dout=dout, mode="full")
    assert report.ok, str(report)
    np.testing.assert_allclose(report["key"].scale, np.max(np.abs(dk)), rtol=1e-6)
    np.testing.assert_allclose(report["value"].scale, np.max(np.abs(dv)), rtol=1e-6)


def test_gradcheck_module_checks_self_attention_through_its_one_gemm_path(monkeypatch):
    """gradcheck_module(m, x, x, x): one input x whose gradient is dquery + dkey + dvalue, run
    through the module's one-GEMM projection (a (3 D, D) weight reaches linear_forward). It
    perturbed three copies of x, which never took that path: a forward of it gone wrong (its
    output 1 % off, the backward unchanged) passed; now it fails."""
    from npattn import attention as A

    rng = np.random.default_rng(9)
    D = 4
    mha = MultiHeadAttention(D, 2, dtype="float64", seed=3)
    mha.params = {n: a + 0.3 * rng.standard_normal(a.shape) for n, a in mha.params.items()}
    x = rng.standard_normal((2, 3, D))
    original, widths = A.linear_forward, []

    def recording(inp, w, b=None):
        widths.append(int(w.shape[0]))
        return original(inp, w, b)

    monkeypatch.setattr(A, "linear_forward", recording)
    report = gradcheck_module(mha, x, x, x, forward_kwargs=dict(is_causal=True), mode="full")
    assert report.ok, str(report)
    assert [r.name for r in report.inputs] == ["x", *mha.params] and 3 * D in widths

    def off(inp, w, b=None):  # the fused projection's output 1 % off
        out, cache = original(inp, w, b)
        return (out * 1.01 if w.shape[0] == 3 * D else out), cache

    monkeypatch.setattr(A, "linear_forward", off)
    assert not gradcheck_module(mha, x, x, x, forward_kwargs=dict(is_causal=True), mode="full").ok
    assert gradcheck_module(mha, x, x.copy(), x.copy(), mode="full").ok  # three arrays: not that path


def test_gradcheck_module_wrt_names_the_same_inputs_for_self_attention():
    """wrt indexes (query, key, value, *params) whether or not the three are one array: with
    x passed three times, wrt=[3] is w_q and wrt=[1] is x (key's array), not w_q. It indexed
    the list (x, *params), so the same wrt checked another parameter than the user named."""
    rng = np.random.default_rng(2)
    mha = MultiHeadAttention(4, 2, dtype="float64", seed=0)
    x = rng.standard_normal((2, 3, 4))
    names = ["query", "key", "value", *mha.params]  # the module's parameter order, as documented
    last = len(names) - 1  # the last parameter
    for wrt in ([3], [4, 6], [1], [0, 2, 5], [last], [5, 1]):  # [5, 1]: reported in that order
        three = gradcheck_module(mha, x, x.copy(), x.copy(), wrt=wrt, mode="vjp")
        one = gradcheck_module(mha, x, x, x, wrt=wrt, mode="vjp")
        assert [r.name for r in three.inputs] == [names[i] for i in wrt]
        want = list(dict.fromkeys("x" if i < 3 else names[i] for i in wrt))
        assert [r.name for r in one.inputs] == want and one.ok, str(one)
    past = rf"^wrt: expected indices of \(query, key, value, \*params\), 0 to {last}, got {last + 1}"
    for wrt, match in (([3, 3], r"^wrt: expected distinct input indices, got \[3, 3\]$"), ([last + 1], past)):
        with pytest.raises(ValueError, match=match):
            gradcheck_module(mha, x, x, x, wrt=wrt)


def test_a_forward_that_draws_fresh_randomness_is_refused_by_name():
    """Dropout drawn from a generator that moves between calls: two evaluations at the same
    inputs differ, so finite differences of it mean nothing; gradcheck and check_vjp say so
    (it was a failing report, read as a wrong backward). A change below eps * rtol of the
    output's scale (1e-12 here) cannot move a central difference past rtol, and passes."""
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((1, 2, 3, 4)) for _ in range(3))
    moving = np.random.default_rng(1)
    with raises(ValueError, "forward", "same output for the same inputs", "apart"):
        gradcheck(lambda q, k, v: F.sdpa_forward(q, k, v, dropout_p=0.3, rng=moving), F.sdpa_backward,
                  [q, k, v])
    # the same dropout from a seed (the same mask each call) is deterministic, and checks
    assert gradcheck(lambda q, k, v: F.sdpa_forward(q, k, v, dropout_p=0.3, rng=5), F.sdpa_backward,
                     [q, k, v]).ok
    x = rng.standard_normal((3, 4))
    calls = []

    def wobbly(size):
        def f(a):  # a * 2 plus +-size on alternate calls
            calls.append(1)
            return a * 2.0 + (size if len(calls) % 2 else -size)
        return f

    with raises(ValueError, "f", "same output for the same inputs", "2e-09 apart"):
        check_vjp(wobbly(1e-9), [x], [2.0 * np.ones_like(x)], np.ones_like(x), rtol=1e-6)
    dout = rng.standard_normal((3, 4))
    assert check_vjp(wobbly(1e-16), [x], [2.0 * dout], dout).ok  # d<2a, dout>/da = 2 dout


def test_a_change_of_a_few_roundings_is_not_refused_with_rtol_0():
    """rtol = 0 with an atol: two evaluations one float64 rounding apart (threads summing in
    another order) were refused as nondeterministic, the limit being eps * rtol * scale = 0;
    they pass the check, whose own atol covers far more. A change of 1e-9 is still refused."""
    x = np.random.default_rng(5).standard_normal((3, 4))
    dout = np.random.default_rng(6).standard_normal((3, 4))

    def wobbly(size):
        calls = []

        def f(a):  # 2 a, +-size on alternate calls
            calls.append(1)
            return a * 2.0 + (size if len(calls) % 2 else -size)
        return f

    for atol in (1e-8, None):
        assert check_vjp(wobbly(2.0**-52), [x], [2.0 * dout], dout, rtol=0.0, atol=atol).ok
        f = wobbly(2.0**-52)
        assert gradcheck(lambda a: (f(a), None), lambda d, c: (2.0 * d,), [x], rtol=0.0, atol=atol).ok
        with raises(ValueError, "f", "same output for the same inputs"):
            check_vjp(wobbly(1e-9), [x], [2.0 * dout], dout, rtol=0.0, atol=atol)


def test_a_forward_whose_nan_comes_and_goes_is_refused():
    """An entry NaN on one evaluation and a number on the next (its other entries unchanged)
    is a change of the output, read as an infinite one; NaN in the same entries both times,
    or the same inf, is no change."""
    x = np.random.default_rng(3).standard_normal((3, 4))
    calls = []

    def flicker(a):  # 2 a, with entry [0, 0] NaN on every other call
        calls.append(1)
        out = a * 2.0
        if len(calls) % 2:
            out[0, 0] = np.nan
        return out

    with raises(ValueError, "f", "same output for the same inputs", "inf apart"):
        check_vjp(flicker, [x], [2.0 * np.ones_like(x)], np.ones_like(x))
    with raises(ValueError, "forward", "same output for the same inputs", "inf apart"):
        gradcheck(lambda a: (flicker(a), None), lambda d, c: (2.0 * d,), [x])
    for fixed in (np.nan, np.inf):  # the same non-finite entry each time: not refused
        def steady(a, fixed=fixed):
            out = a * 2.0
            out[0, 0] = fixed
            return out
        report = check_vjp(steady, [x], [2.0 * np.ones_like(x)], np.ones_like(x))
        assert not report.ok  # a NaN / inf loss fails the check itself, after the refusal's test


def test_a_check_of_empty_inputs_only_is_refused():
    """Inputs with no entries have no differences to compare: a gradient 5x where 2x is right
    passed, for gradcheck and check_vjp alike. Refused when every checked input is empty; an
    empty input beside one with entries is checked (the other is), and numerical_vjp of an
    empty input is an empty gradient."""
    empty, x = np.zeros((0, 3)), np.random.default_rng(0).standard_normal((2, 3))
    for mode in ("full", "vjp"):
        with raises(ValueError, "inputs", "at least one entry", "(0, 3)"):
            gradcheck(lambda a: (2.0 * a, None), lambda d, c: 5.0 * d, [empty], mode=mode)
    with raises(ValueError, "inputs", "at least one entry", "(0, 3)"):
        check_vjp(lambda a: 2.0 * a, [empty], [5.0 * empty], empty)
    with raises(ValueError, "inputs", "at least one entry", "(0, 3), (0, 3)"):
        gradcheck(lambda a, b: (a + b, None), lambda d, c: (d, d), [empty, empty])

    def forward(a, b):  # [0, 3], [2, 3] -> [2, 3]
        return 2.0 * b + a.sum(), None

    report = gradcheck(forward, lambda d, c: (np.zeros((0, 3)), 2.0 * d), [empty, x], names=["a", "b"])
    assert report.ok and report["b"].scale > 0.0
    assert not gradcheck(forward, lambda d, c: (np.zeros((0, 3)), 5.0 * d), [empty, x]).ok
    # wrt that names only the empty input checks nothing either, whatever the other's gradient
    with raises(ValueError, "inputs", "at least one entry", "(0, 3)"):
        gradcheck(forward, lambda d, c: (np.zeros((0, 3)), 5.0 * d), [empty, x], wrt=[0])
    with raises(ValueError, "inputs", "at least one entry", "(0, 3)"):
        check_vjp(lambda a, b: 2.0 * b + a.sum(), [empty, x], [empty, 5.0 * x], x, wrt=[0])
    assert numerical_vjp(lambda a: 2.0 * a, [empty], empty)[0].shape == (0, 3)


def test_an_object_array_dout_is_refused_by_name():
    """dout of dtype object holds Python objects, not a gradient: each checker names dout (it
    was a bare "ufunc 'isnan' not supported" from gradcheck, and taken by the other two)."""
    x = np.random.default_rng(0).standard_normal((3, 4))
    bad = (x * 0.5).astype(object)

    def f(a):
        return a * a

    with raises(TypeError, "dout", "object"):
        gradcheck(lambda a: (f(a), a), lambda d, a: (2 * a * d,), [x], dout=bad)
    with raises(TypeError, "dout", "object"):
        numerical_vjp(f, [x], bad)
    with raises(TypeError, "dout", "object"):
        check_vjp(f, [x], [x], bad)
    assert gradcheck(lambda a: (f(a), a), lambda d, a: (2 * a * d,), [x],
                     dout=np.ones((3, 4), dtype=np.int64)).ok  # an integer dout is a real one


def test_check_vjp_catches_a_gradient_of_the_wrong_sign():
    """For f(x) = x, J^T dout = dout; -dout has the same size of <g, t> in every direction,
    so only the sign tells them apart (comparing |<g, t>| with |numeric| passed it)."""
    dout = np.random.default_rng(3).standard_normal((2, 3))
    x = np.zeros((2, 3))
    assert check_vjp(lambda t: t, [x], [dout], dout).ok
    assert not check_vjp(lambda t: t, [x], [-dout], dout).ok


def test_check_vjp_catches_a_gradient_right_only_in_its_sum():
    """A permuted gradient has the right sum: an all-ones direction t gives <g, t> = sum(g),
    the same for dout and its reversal. Random directions tell them apart."""
    dout = np.arange(1.0, 7.0).reshape(2, 3)
    x = np.zeros((2, 3))
    assert not check_vjp(lambda t: t, [x], [dout[::-1, ::-1].copy()], dout, n_directions=3).ok


@pytest.mark.parametrize("mode", ["full", "vjp"])
def test_tolerances_are_absolute_and_relative_as_documented(mode):
    """An input passes when err <= atol + rtol * scale. For f(x) = x with one entry and dout
    = 1e-3, a gradient (1 + d) * dout has err = d * |dout t| and scale (1 + d) * |dout t|:
    with atol = 0 it passes exactly when d / (1 + d) <= rtol, whatever t (atol and rtol
    swapped, it passed d = 0.1 at rtol = 0.01: err ~ 1e-4 <= 0.01)."""
    x, dout = np.zeros(1), np.full(1, 1e-3)
    f = (lambda t: (t, None)) if mode == "full" else None

    def check(d):
        g = (1.0 + d) * dout
        if mode == "full":
            return gradcheck(f, lambda dy, c: g, [x], dout=dout, mode="full", rtol=0.01, atol=0.0)
        return check_vjp(lambda t: t, [x], [g], dout, rtol=0.01, atol=0.0, n_directions=2)

    assert not check(0.1).ok
    assert check(0.005).ok


@pytest.mark.parametrize("inf_at, nan_at", [(1, 3), (3, 1), (0, 2)])
def test_full_mode_says_where_the_nan_is_when_the_largest_error_is_nan(inf_at, nan_at):
    """A gradient with an inf entry and a NaN entry: max_abs_err is NaN, and the entry
    reported is the NaN one, wherever the inf stands (before it, the inf was reported)."""
    forward, x, dout, true = _scaled_by_3()
    wrong = true.copy()
    wrong[inf_at], wrong[nan_at] = np.inf, np.nan
    r = gradcheck(forward, lambda d, c: (wrong,), [x], dout=dout, mode="full")["input0"]
    assert not r.passed and np.isnan(r.max_abs_err)
    assert r.where == (nan_at,)
    wrong[nan_at] = true[nan_at] + 1.0  # the inf alone: the largest error is the inf's
    r = gradcheck(forward, lambda d, c: (wrong,), [x], dout=dout, mode="full")["input0"]
    assert not r.passed and r.max_abs_err == np.inf and r.where == (inf_at,)


def test_full_mode_scale_and_relative_error_are_those_documented():
    """scale is the largest |g_j| or |n_j|, max_rel_err = max_abs_err / scale. For f(x) = x,
    n = dout = [1, -3]; g = 2 dout = [2, -6] gives err = 3 and scale 6 (from g, not n), so
    rel = 0.5 (with atol = 1 as well: atol does not enter the quotient)."""
    x, dout = np.zeros(2), np.array([1.0, -3.0])
    r = gradcheck(lambda t: (t, None), lambda dy, c: 2.0 * dy, [x], dout=dout, mode="full",
                  atol=1.0)["input0"]
    np.testing.assert_allclose([r.max_abs_err, r.scale, r.max_rel_err], [3.0, 6.0, 0.5], rtol=1e-8)
    assert r.where == (1,)


def test_default_atol_is_the_rounding_floor_of_the_documented_formula():
    """atol = 16 * 2**-52 * sum|out * dout| / eps, by hand for out = x = [1, 2], dout = [3, -1],
    eps = 1e-5: 16 * 2**-52 * 5 / 1e-5 (the product of the sums was 8 / 1e-5 times that)."""
    x, dout = np.array([1.0, 2.0]), np.array([3.0, -1.0])
    want = 16 * 2.0**-52 * 5.0 / 1e-5
    for mode in ("full", "vjp"):
        r = gradcheck(lambda t: (t, None), lambda dy, c: dy, [x], dout=dout, mode=mode, eps=1e-5)
        assert r.ok and r.atol == pytest.approx(want, rel=1e-12)
    assert check_vjp(lambda t: t, [x], [dout], dout, eps=1e-5).atol == pytest.approx(want, rel=1e-12)


def test_check_vjp_and_numerical_vjp_refuse_mismatched_shapes():
    """A gradient of shape (1, 3) for an input (3,) has its size, and <g, t> broadcast to the
    right number: check_vjp passed it. A dout of shape (1,) broadcast against the output in
    numerical_vjp (and check_vjp with an atol), and a None gradient for a checked input was
    not named."""
    x = np.array([1.0, 2.0, 3.0])
    with raises(ValueError, "grads[0]", "(3,)", "(1, 3)"):
        check_vjp(lambda t: t, [x], [np.ones((1, 3))], np.ones(3))
    with raises(ValueError, "grads[0]", "None"):
        check_vjp(lambda t: t, [x], [None], np.ones(3))
    with raises(ValueError, "dout", "(3,)", "(1,)"):
        numerical_vjp(lambda t: t, [x], np.ones(1))
    with raises(ValueError, "dout", "(3,)", "(1,)"):
        check_vjp(lambda t: t, [x], [np.ones(3)], np.ones(1), atol=1e-8)


def test_more_names_than_inputs_are_refused():
    x = np.ones(2)
    with raises(ValueError, "names", "1", "2"):
        gradcheck(lambda t: (t, None), lambda dy, c: dy, [x], names=["x", "y"])


@pytest.mark.parametrize("mode", ["full", "vjp"])
def test_a_numerically_zero_gradient_has_relative_error_zero(mode):
    """A gradient whose scale is at most atol counts as zero, its relative error 0 when the
    error is within atol too. f(x) = 1e-12 x with a backward returning zeros: n = 1e-12 dout
    and g = 0 differ by about 1e-12 <= atol = 1e-9, so rel = 0 (err / scale was 1)."""
    x, dout = np.array([0.5, 0.5]), np.array([1.0, -2.0])
    r = gradcheck(lambda t: (1e-12 * t, None), lambda dy, c: 0.0 * dy, [x], dout=dout, mode=mode,
                  atol=1e-9)
    assert r.ok and 0.0 < r["input0"].max_abs_err <= 1e-9
    assert r["input0"].max_rel_err == 0.0


def test_gradcheck_module_asks_a_training_module_with_dropout_for_a_fixed_mask_before_any_forward():
    """In training mode with dropout > 0 every forward would draw another mask: without a
    fixed 'dropout_mask' in forward_kwargs the check is refused by name, saying what it
    expected and what it got, before the first forward (a None mask counts as none)."""
    x = np.random.default_rng(0).standard_normal((2, 3, 4))
    m = MultiHeadAttention(4, 2, dtype="float64", dropout=0.5, seed=0)
    calls = []
    m.forward = lambda *a, **k: calls.append(1)
    for fk in (None, {"dropout_mask": None, "is_causal": True}):
        with pytest.raises(ValueError, match=r"^forward_kwargs: expected a fixed 'dropout_mask' while "
                                             r"dropout is active \(dropout=0\.5, training mode\), got none; "
                                             r"pass one, or call module\.eval\(\) first$"):
            gradcheck_module(m, x, x, x, forward_kwargs=fk)
    assert calls == []


def test_gradcheck_module_refuses_float32_and_checks_an_eval_module_with_dropout():
    """A float32 module is refused (its differences would be taken of float32 parameters
    cast up, not of the module the caller holds); dropout > 0 needs a fixed mask only in
    training mode: after eval() no mask is asked for. A dout of the wrong shape is named
    against the module's output (B, Lq, D) before the first forward."""
    x = np.random.default_rng(0).standard_normal((2, 3, 4))
    with raises(ValueError, "module", "float64", "float32"):
        gradcheck_module(MultiHeadAttention(4, 2, dtype="float32", seed=0), x, x, x)
    m = MultiHeadAttention(4, 2, dtype="float64", dropout=0.5, seed=0)
    m.eval()
    assert gradcheck_module(m, x, x, x, mode="vjp").ok
    calls = []
    m.forward = lambda *a, **k: calls.append(1)  # not reached: dout is refused first
    with raises(ValueError, "dout", "(2, 3, 4)", "(B, Lq, D)", "(2, 3, 5)"):
        gradcheck_module(m, x, x, x, dout=np.ones((2, 3, 5)))
    assert calls == []


def test_a_nan_input_fails_the_check_and_is_not_taken_for_a_write():
    """An input holding NaN compares unequal to its copy unless NaNs are taken as equal: the
    check must report the failure, not claim that forward wrote into its argument."""
    x = np.array([1.0, np.nan, 2.0])
    for mode in ("full", "vjp"):
        r = gradcheck(lambda t: (t * t, None), lambda d, c: 2.0 * d * x, [x], mode=mode)
        assert not r.ok and r["input0"].max_rel_err == np.inf


def test_max_full_size_and_a_bytes_wrt_are_refused():
    """bytes iterate as ints: wrt=b'\\x00' was a valid [0]; max_full_size is an int >= 0."""
    x = np.ones(3)

    def check(**kw):
        return gradcheck(lambda t: (t * t, None), lambda d, c: 2.0 * d * x, [x], **kw)

    with raises(TypeError, "wrt", "bytes"):
        check(wrt=b"\x00")
    with raises(ValueError, "max_full_size", "-1"):
        check(max_full_size=-1)
    with raises(TypeError, "max_full_size", "2.5"):
        check(max_full_size=2.5)


def test_a_scale_equal_to_atol_counts_as_numerically_zero():
    """'At most atol' includes equality: for f(x) = 0.5 x, dout = [1], a gradient [1] has
    n = 0.5, scale = max(1, 0.5) = 1 = atol and err = 0.5 <= atol, so rel = 0 (it was 0.5)."""
    r = gradcheck(lambda t: (0.5 * t, None), lambda dy, c: 1.0 * dy, [np.zeros(1)],
                  dout=np.ones(1), mode="full", atol=1.0)
    assert r.ok and r["input0"].scale == 1.0 and r["input0"].max_rel_err == 0.0


def test_a_report_is_false_when_an_input_fails_and_names_only_its_inputs():
    """bool(report) is report.ok, report[name] is that input's entry and a name not checked is a
    KeyError; str(report) says where only for an input that failed."""
    inputs = list(_case(np.asarray))

    def backward(dy, cache):  # dw off by 0.1 %, dx and db right
        dx, dw, db = F.linear_backward(dy, cache)
        return dx, dw * 1.001, db

    bad = gradcheck(F.linear_forward, backward, inputs, names=["x", "w", "b"], mode="full")
    good = gradcheck(F.linear_forward, F.linear_backward, inputs, names=["x", "w", "b"], mode="full")
    assert not bad and not bad.ok and good and good.ok
    assert bad["w"] is bad.inputs[1] and not bad["w"].passed and bad["x"].passed
    with pytest.raises(KeyError):
        bad["input0"]
    lines = str(bad).splitlines()
    assert f"FAIL at {bad['w'].where}" in lines[2]
    assert " at " not in lines[1] and " at " not in lines[3] and lines[1].rstrip().endswith("pass")


def test_the_default_tolerance_step_count_and_full_size_are_those_documented():
    """rtol = 1e-6 by default: a gradient 1e-5 off (relative) fails and one 1e-7 off passes,
    in gradcheck's two modes and in check_vjp; vjp mode takes 3 directions by default (two
    evaluations each, after the two at the inputs); auto mode is full up to 4096 entries."""
    x, dout = np.array([0.5]), np.array([-1.5])  # one entry: err / scale is the relative error

    def forward(t):
        return 3.0 * t, None

    for off, ok in ((1e-5, False), (1e-7, True)):
        g = 3.0 * dout * (1.0 + off)
        for mode in ("full", "vjp"):
            assert gradcheck(forward, lambda d, c: g, [x], dout=dout, mode=mode).ok is ok
        assert check_vjp(lambda t: 3.0 * t, [x], [g], dout).ok is ok
    calls = []

    def counted(t):
        calls.append(1)
        return 3.0 * t

    check_vjp(counted, [x], [3.0 * dout], dout)
    assert len(calls) == 2 + 2 * 3
    calls.clear()
    gradcheck(lambda t: (counted(t), None), lambda d, c: 3.0 * d, [x], mode="vjp")
    assert len(calls) == 2 + 2 + 2 * 3  # gradcheck's two forwards, then check_vjp's
    for n, mode in ((4096, "full"), (4097, "vjp")):
        y = np.linspace(-1.0, 1.0, n)
        assert gradcheck(lambda t: (2.0 * t, None), lambda d, c: 2.0 * d, [y]).mode == mode


def test_the_seed_draws_dout_and_each_direction_afresh():
    """dout comes from seed (the same seed, the same dout; another seed, another dout), and
    each of vjp mode's directions is a draw of its own: the points x +- eps t of three
    directions give three different t, and another seed other ones."""
    x = np.random.default_rng(0).standard_normal((2, 3))
    seen = []

    def backward(d, c):
        seen.append(np.array(d))
        return 2.0 * d

    for seed in (1, 1, 2):
        assert gradcheck(lambda t: (2.0 * t, None), backward, [x], seed=seed).ok
    assert np.array_equal(seen[0], seen[1]) and not np.allclose(seen[0], seen[2])
    eps, dout = 1e-3, np.random.default_rng(1).standard_normal((2, 3))

    def directions(seed):
        points = []

        def f(t):
            points.append(np.array(t))
            return 2.0 * t

        assert check_vjp(f, [x], [2.0 * dout], dout, eps=eps, n_directions=3, seed=seed).ok
        return [(points[2 + 2 * k] - points[3 + 2 * k]) / (2 * eps) for k in range(3)]

    t = directions(5)
    assert not any(np.allclose(t[a], t[b]) for a, b in ((0, 1), (0, 2), (1, 2)))
    assert not np.allclose(t[0], directions(6)[0])


def _alternating(bump):
    """f(a) = 2 a, plus ``bump`` (an array of the output's shape) on every second call."""
    calls = []

    def f(a):
        calls.append(1)
        return 2.0 * a + (0.0 if len(calls) % 2 else bump)
    return f


def test_the_change_let_through_between_two_evaluations_is_the_documented_one():
    """Two evaluations at the inputs may differ by eps * (rtol * scale + atol) plus 16
    roundings of the scale (the largest |output|, at least 1). With rtol = atol = 0 a change of
    exactly 16 * 2**-52 is let through ("more than" is refused) and twice that is not; an atol
    widens the limit (a change of 2e-9 passes with atol = 1e-2, eps * atol = 1e-8); and an
    output that is 0 on one evaluation and one rounding of 1 on the next (a sum of terms of
    order 1 that cancels, summed in another order) is not refused."""
    x, dout = np.array([1.0, 0.0]), np.array([0.5, -1.0])
    step = np.array([0.0, 16 * 2.0**-52])  # the output [2, 0]: scale 2, limit 32 * 2**-52
    check_vjp(_alternating(2.0 * step), [x], [2.0 * dout], dout, rtol=0.0, atol=0.0)  # not refused
    with raises(ValueError, "f", "same output for the same inputs"):
        check_vjp(_alternating(4.0 * step), [x], [2.0 * dout], dout, rtol=0.0, atol=0.0)
    y = np.random.default_rng(5).standard_normal((3, 4))
    dy = np.random.default_rng(6).standard_normal((3, 4))
    wobble = np.full((3, 4), 2e-9)
    with raises(ValueError, "f", "same output for the same inputs"):
        check_vjp(_alternating(wobble), [y], [2.0 * dy], dy)
    assert check_vjp(_alternating(wobble), [y], [2.0 * dy], dy, atol=1e-2).ok
    f = _alternating(wobble)
    assert gradcheck(lambda a: (f(a), None), lambda d, c: 2.0 * d, [y], atol=1e-2).ok
    zero = np.zeros(3)
    rounding = np.array([2.0**-52, 0.0, 0.0])
    assert check_vjp(_alternating(rounding), [zero], [2.0 * dy[0, :3]], dy[0, :3]).ok
    f = _alternating(rounding)
    assert gradcheck(lambda a: (f(a), None), lambda d, c: 2.0 * d, [zero]).ok


def test_a_forward_whose_output_changes_shape_between_calls_is_refused_by_name():
    """A forward that appends to state it keeps returns a longer output each call: refused as
    not deterministic, with both shapes, not a broadcasting error of NumPy's."""
    x = np.random.default_rng(0).standard_normal(3)

    def growing():
        calls = []

        def f(a):
            calls.append(1)
            return np.concatenate([2.0 * a, np.zeros(len(calls))])
        return f

    with raises(ValueError, "f", "same output for the same inputs", "(5,)", "(4,)"):
        check_vjp(growing(), [x], [np.ones(3)], np.ones(4))
    f = growing()
    with raises(ValueError, "forward", "same output for the same inputs", "(5,)", "(4,)"):
        gradcheck(lambda a: (f(a), None), lambda d, c: 2.0 * d[:3], [x])


def test_the_bounds_are_inclusive():
    """err <= atol + rtol * scale passes, and a scale <= atol is numerically zero. Dyadic
    numbers keep every difference exact: f(x) = 2 x with eps = 2**-10 gives n = 2 dout
    exactly, so a gradient one entry off by 2**-8 has err = 2**-8: it passes at atol = 2**-8
    (rtol 0) and fails at atol = 2**-9. For f(x) = 0 x (n = 0) a gradient [2**-8, 0] has scale
    2**-8 = atol and err = atol: numerically zero, rel 0."""
    x, dout = np.array([0.5, -0.25]), np.array([1.0, -2.0])
    g = 2.0 * dout
    g[0] += 2.0**-8

    def check(forward, grad, atol):
        return gradcheck(forward, lambda d, c: grad, [x], dout=dout, mode="full", eps=2.0**-10,
                         rtol=0.0, atol=atol)

    r = check(lambda t: (2.0 * t, None), g, 2.0**-8)
    assert r.ok and r["input0"].max_abs_err == 2.0**-8
    assert not check(lambda t: (2.0 * t, None), g, 2.0**-9).ok
    r = check(lambda t: (0.0 * t, None), np.array([2.0**-8, 0.0]), 2.0**-8)["input0"]
    assert r.passed and r.scale == 2.0**-8 and r.max_abs_err == 2.0**-8 and r.max_rel_err == 0.0


def test_full_mode_scale_is_the_numerical_gradients_when_backward_returns_zeros():
    """scale is the largest |g_j| or |n_j|: for f(x) = x, dout = [1, -3], a backward of zeros
    has err 3 and scale 3 (from n), so rel = 1, not an infinite error over scale 0."""
    x, dout = np.zeros(2), np.array([1.0, -3.0])
    r = gradcheck(lambda t: (t, None), lambda dy, c: 0.0 * dy, [x], dout=dout, mode="full")["input0"]
    assert not r.passed
    np.testing.assert_allclose([r.max_abs_err, r.scale, r.max_rel_err], [3.0, 3.0, 1.0], rtol=1e-8)


def test_a_dout_of_another_library_is_refused_by_name():
    """dout must be of the output's library: gradcheck names it (before backward runs), and
    gradcheck_module names it against query's library before the module's first forward."""
    xps = pytest.importorskip("array_api_strict")
    rng = np.random.default_rng(0)
    x, d = rng.standard_normal((2, 3, 4)), rng.standard_normal((2, 3, 4))
    called = []

    def backward(dy, c):
        called.append(1)
        return 2.0 * dy

    with raises(TypeError, "dout", "numpy", "array_api_strict"):
        gradcheck(lambda t: (2.0 * t, None), backward, [x], dout=xps.asarray(d))
    assert called == []
    m = MultiHeadAttention(4, 2, dtype="float64", seed=0)
    m.forward = lambda *a, **k: called.append(1)  # not reached
    with raises(TypeError, "dout", "numpy", "array_api_strict", "that of query"):
        gradcheck_module(m, x, x, x, dout=xps.asarray(d))
    assert called == []


def test_check_vjp_takes_more_gradients_than_inputs():
    """sdpa_backward's SDPAGrads ends with dmask and dsinks: a grads longer than the inputs is
    taken, its extra entries not checked (Lq = 3, Lk = 5)."""
    rng = np.random.default_rng(7)
    q = rng.standard_normal((1, 2, 3, 4))
    k, v = rng.standard_normal((1, 2, 5, 4)), rng.standard_normal((1, 2, 5, 4))
    dout = rng.standard_normal((1, 2, 3, 4))
    grads = F.sdpa_backward(dout, F.sdpa_forward(q, k, v)[1])
    assert len(grads) > 3
    report = check_vjp(lambda q, k, v: F.sdpa_forward(q, k, v)[0], [q, k, v], grads, dout,
                       names=["q", "k", "v"])
    assert report.ok and [r.name for r in report.inputs] == ["q", "k", "v"]


def test_gradcheck_module_refuses_a_lookalike_module_and_keywords_that_are_no_dict():
    """A module must be an npattn MultiHeadAttention (parameters with w_q), and forward_kwargs a
    dict: a list of pairs, which dict() would take, is refused naming it."""
    x = np.random.default_rng(0).standard_normal((2, 3, 4))

    class Lookalike:
        params = {"weight": np.ones((4, 4))}
        training = False

        def __call__(self, *a, **k):
            return self.forward(*a, **k)

        def forward(self, *a, **k):
            return np.zeros((2, 3, 4)), None

        def backward(self, dout):
            return dout, dout, dout

        def preserve_state(self):
            return contextlib.nullcontext()

    with raises(TypeError, "module", "MultiHeadAttention", "Lookalike"):
        gradcheck_module(Lookalike(), x, x, x)
    mha = MultiHeadAttention(4, 2, dtype="float64", seed=0)
    with raises(TypeError, "forward_kwargs", "dict", "list"):
        gradcheck_module(mha, x, x, x, forward_kwargs=[("is_causal", True)])


def test_gradcheck_module_checks_query_as_key_with_another_value_as_three_inputs():
    """Only query is key is value is self-attention: x as query and key with another value is
    three inputs, the value's gradient its own (taken for x, the value was never checked)."""
    rng = np.random.default_rng(3)
    mha = MultiHeadAttention(4, 2, dtype="float64", seed=1)
    x, v = rng.standard_normal((2, 3, 4)), rng.standard_normal((2, 3, 4))
    report = gradcheck_module(mha, x, x, v, mode="vjp")
    assert report.ok, str(report)
    assert [r.name for r in report.inputs] == ["query", "key", "value", *mha.params]


def test_inputs_of_a_backend_that_makes_no_float64_are_refused_before_any_call():
    """JAX without x64 turns float64 requests into float32: the differences could not be taken
    in float64, so numerical_vjp, check_vjp and gradcheck name the input and call nothing."""
    jax = pytest.importorskip("jax", reason="the jax backend needs JAX: pip install '.[jax]'")
    import jax.numpy as jnp

    rng = np.random.default_rng(3)
    calls = []

    def f(t):
        calls.append("f")
        return t * t

    def backward(d, t):
        calls.append("backward")
        return [2.0 * t * d]

    previous = jax.config.jax_enable_x64
    jax.config.update("jax_enable_x64", False)
    try:
        x = jnp.asarray(rng.standard_normal((2, 3)), dtype=jnp.float32)
        dout = jnp.asarray(rng.standard_normal((2, 3)), dtype=jnp.float32)
        checks = [lambda: numerical_vjp(f, [x], dout),
                  lambda: check_vjp(f, [x], [2.0 * x * dout], dout),
                  lambda: gradcheck(lambda t: (f(t), t), backward, [x])]
        for check in checks:
            with raises(ValueError, "inputs[0]", "float64", "got one of 'jax', which makes float32",
                        "jax_enable_x64"):
                check()
    finally:
        jax.config.update("jax_enable_x64", previous)
    assert calls == []


def test_the_default_step_is_1e_6_in_every_check():
    """eps = 1e-6 unless given: at x = 0, numerical_vjp and gradcheck's full mode evaluate the
    function at +-1e-6 in one entry at a time, and check_vjp's default atol is the rounding
    floor 16 * 2**-52 * sum|out * dout| / eps at that step (out = 2 x = [2, -4], dout = [3, 1]:
    sum = 10)."""
    points = []

    def f(t):
        points.append(np.array(t))
        return 2.0 * t

    zero, dout = np.zeros(2), np.array([3.0, 1.0])
    numerical_vjp(f, [zero], dout)
    assert {float(np.max(np.abs(p))) for p in points} == {1e-6} and len(points) == 4
    points.clear()
    assert gradcheck(lambda t: (f(t), None), lambda d, c: 2.0 * d, [zero], dout=dout, mode="full").ok
    assert {float(np.max(np.abs(p))) for p in points} == {0.0, 1e-6}  # the inputs, twice; then the steps
    x = np.array([1.0, -2.0])
    r = check_vjp(lambda t: 2.0 * t, [x], [2.0 * dout], dout)
    assert r.ok and r.atol == pytest.approx(16 * 2.0**-52 * 10.0 / 1e-6, rel=1e-12)


def test_vjp_mode_draws_its_directions_after_dout_not_the_same_numbers_again():
    """gradcheck's default dout and vjp mode's directions come from one generator seeded once:
    the first direction is a draw of its own, not dout's numbers drawn again (an integer seed
    handed on to check_vjp as it was restarted the stream, and for a function whose output has
    the input's shape, the first direction was dout itself)."""
    eps, x = 1e-3, np.random.default_rng(0).standard_normal((2, 3))
    points, seen = [], []

    def forward(t):
        points.append(np.array(t))
        return 2.0 * t, None

    def backward(d, c):
        seen.append(np.array(d))
        return 2.0 * d

    assert gradcheck(forward, backward, [x], mode="vjp", eps=eps, seed=4).ok
    # two forwards at x (gradcheck's), two at x (check_vjp's), then x + eps t and x - eps t per direction
    t = [(points[4 + 2 * k] - points[5 + 2 * k]) / (2 * eps) for k in range(3)]
    assert not any(np.allclose(d, seen[0], rtol=1e-3) for d in t)


def test_the_change_let_through_grows_with_the_output_scale():
    """The limit on the change between two evaluations is eps * (rtol * scale + atol) plus 16
    roundings of the scale, the scale being the output's largest magnitude: for the output
    [2000, 0] with rtol = 1e-6 and atol = 0, 1e-6 * 1e-6 * 2000 = 2e-9 (and 16 * 2**-52 * 2000,
    about 7e-12): a change of 1.9e-9 is let through and one of 2.1e-9 is refused (with rtol
    not multiplied by the scale the limit was about 8e-12, and both were refused)."""
    x, dout = np.array([1000.0, 0.0]), np.array([0.5, -1.0])
    for change, refused in ((1.9e-9, False), (2.1e-9, True)):
        f = _alternating(np.array([0.0, change]))
        with pytest.raises(ValueError, match="same output") if refused else contextlib.nullcontext():
            check_vjp(f, [x], [2.0 * dout], dout, rtol=1e-6, atol=0.0)


def _wide_and_small(dy_factor=1.0):
    """out = [1e8 x, x y^2] for x, y of shape (3, 4): y moves only the second half of the
    output, of size 1 next to the first half's 1e8. Its backward: dx = 1e8 dout1 + y^2 dout2,
    dy = 2 x y dout2, times ``dy_factor`` (1.01: wrong by 1 %)."""
    def forward(a, b):
        return np.concatenate([1e8 * a, a * b**2]), (a, b)  # [6, 4]

    def backward(d, cache):
        a, b = cache
        return 1e8 * d[:3] + d[3:] * b**2, dy_factor * 2.0 * a * b * d[3:]

    return forward, backward


@pytest.mark.parametrize("mode", ["full", "vjp"])
def test_a_wrong_gradient_of_an_input_that_moves_a_small_part_of_the_output_fails(mode):
    """A dy 1 % too large fails, and only y. The floor of the whole output, 16 * 2**-52 *
    sum|out * dout| / eps (about 1 here, from the 1e8 half), held y to that and let its 1 % error
    pass; y's own differences round to about 1e-9, so y is held to the floor of the entries of
    out that it moves, and report.atol stays the whole output's, the largest an input's can be."""
    rng = np.random.default_rng(5)
    inputs = [rng.standard_normal((3, 4)), rng.standard_normal((3, 4))]
    good = gradcheck(*_wide_and_small(), inputs, names=["x", "y"], mode=mode)
    assert good.ok, str(good)
    bad = gradcheck(*_wide_and_small(1.01), inputs, names=["x", "y"], mode=mode)
    assert bad["x"].passed and not bad["y"].passed, str(bad)
    assert bad["y"].atol < 1e-6 < bad.atol and bad["x"].atol <= bad.atol


def test_numerical_vjp_of_an_input_beside_a_large_output_is_not_lost_in_its_rounding():
    """numerical_vjp of out = [1e8 x, x y^2] with respect to y is 2 x y dout2 to 1e-7: the
    differences are taken entry by entry of out, so the 1e8 half, which y does not move, adds
    no rounding (as a difference of the two sums <out, dout> it was off by about 1e-2)."""
    rng = np.random.default_rng(6)
    x, y, dout = rng.standard_normal((3, 4)), rng.standard_normal((3, 4)), rng.standard_normal((6, 4))
    forward, _ = _wide_and_small()
    _, g = numerical_vjp(lambda a, b: forward(a, b)[0], [x, y], dout)
    np.testing.assert_allclose(g, 2.0 * x * y * dout[3:], rtol=1e-7, atol=1e-9)


def _attention_case():
    """q (2, 2, 3, 4), k and v (2, 2, 5, 4), a boolean mask whose row (1, :, 2) is all False."""
    rng = np.random.default_rng(8)
    q, k, v = (rng.standard_normal((2, 2, n, 4)) for n in (3, 5, 5))
    mask = rng.random((2, 1, 3, 5)) > 0.3
    mask[..., 0] = True
    mask[1, :, 2] = False
    return [q, k, v, mask]


def _with_masked_row_dq(g):
    dq = np.array(g.dq, copy=True)
    dq[1, :, 2] = 1e-3  # the row attends to nothing: its output is 0 whatever q, so dq is 0 there
    return dq, g.dk, g.dv, None


@pytest.mark.parametrize("wrong, bad", [
    (lambda g, d, c: (g.dq, g.dv, g.dk, None), {"k", "v"}),  # two gradients of one shape swapped
    (lambda g, d, c: _with_masked_row_dq(g), {"q"}),
    (lambda g, d, c: (g.dq, g.dk, np.concatenate([g.dv[:1], 0.9 * g.dv[1:]]), None), {"v"}),  # batch 0 only
    (lambda g, d, c: (F.sdpa_backward(np.ones_like(d), c).dq, g.dk, g.dv, None), {"q"}),  # right for dout = 1
], ids=["dk-dv-swapped", "fully-masked-row", "first-batch-only", "all-ones-dout-only"])
def test_attention_mistakes_fail_and_name_only_the_wrong_inputs(wrong, bad):
    """Each backward is sdpa_backward's with one mistake; the report fails exactly the inputs it
    made wrong (the mask is not checked)."""
    def forward(q, k, v, mask):
        return F.sdpa_forward(q, k, v, mask=mask)

    def backward(d, cache):
        return wrong(F.sdpa_backward(d, cache), d, cache)

    report = gradcheck(forward, backward, _attention_case(), names=["q", "k", "v", "mask"])
    assert {r.name for r in report.inputs if not r.passed} == bad, str(report)
    assert [r.name for r in report.inputs] == ["q", "k", "v"]


class _SquareWithWorkspace:
    """out = x^2, whose forward keeps 2 x in one preallocated buffer and whose backward scales
    that buffer by dout in place and returns it: the gradient 2 x dout, right when returned,
    which the next forward overwrites (kernels reuse their buffers so)."""

    def __init__(self, shape):
        self.ws = np.zeros(shape)

    def forward(self, x):
        np.multiply(x, 2.0, out=self.ws)  # [*x.shape]
        return x * x, None

    def backward(self, d, cache):
        self.ws *= d
        return self.ws


@pytest.mark.parametrize("mode", ["full", "vjp"])
def test_a_gradient_in_a_buffer_the_forward_reuses_is_read_when_returned(mode):
    """The gradients are read as backward returns them, before the differences call the forward
    again: read after them, this right gradient was 2 x at the last step's x, and failed."""
    rng = np.random.default_rng(9)
    x, dout = rng.standard_normal((2, 3)), rng.standard_normal((2, 3))
    square = _SquareWithWorkspace(x.shape)
    assert gradcheck(square.forward, square.backward, [x], mode=mode).ok
    square.forward(x)
    grads = [square.backward(dout, None)]
    assert check_vjp(lambda t: square.forward(t)[0], [x], grads, dout).ok


def test_an_output_entry_that_is_inf_wherever_the_inputs_are_is_not_a_nan_difference():
    """Masked scores, where(mask, x y, -inf): a -inf entry stays -inf at every step, and adds
    nothing to the differences taken entry by entry (as a difference of two sums <out, dout>,
    -inf - -inf was NaN, and a right gradient failed for every input); a dy 1 % wrong fails."""
    rng = np.random.default_rng(11)
    x, y = rng.standard_normal((3, 4)), rng.standard_normal((3, 4))
    mask = rng.random((3, 4)) > 0.4

    def forward(a, b, m):
        return np.where(m, a * b, -np.inf), m

    def backward(d, m, dy_factor=1.0):
        return np.where(m, d * y, 0.0), np.where(m, dy_factor * d * x, 0.0), None

    assert gradcheck(forward, backward, [x, y, mask], names=["x", "y", "mask"]).ok
    bad = gradcheck(forward, lambda d, m: backward(d, m, 1.01), [x, y, mask], names=["x", "y", "mask"])
    assert bad["x"].passed and not bad["y"].passed


def test_an_input_whose_steps_move_nothing_is_held_to_the_whole_outputs_floor():
    """f(x, c) = x + (c - c) x: a step in c moves no entry of the output, so its difference is
    exactly 0, and dc = 0. A backward that forms it as ((0.1 + 0.2) - 0.3) <dout, x>, zero up to
    its rounding (5.6e-17 <dout, x>, as d b_k of a deeper block's attention is), passes: held to
    the floor of the entries it moves, none, it failed. A dc of 1e-6 fails."""
    rng = np.random.default_rng(12)
    x, c, dout = rng.standard_normal((3, 4)), np.array([0.5]), rng.standard_normal((3, 4))

    def forward(a, b):
        return a + (b - b) * a, a

    def backward(d, a, dc=None):
        return d.copy(), np.array([((0.1 + 0.2) - 0.3) * float(np.sum(d * a)) if dc is None else dc])

    for mode in ("full", "vjp"):
        report = gradcheck(forward, backward, [x, c], dout=dout, names=["x", "c"], mode=mode)
        assert report.ok and report["c"].atol == report.atol, str(report)
        wrong = gradcheck(forward, lambda d, a: backward(d, a, 1e-6), [x, c], dout=dout, names=["x", "c"],
                          mode=mode)
        assert wrong["x"].passed and not wrong["c"].passed
