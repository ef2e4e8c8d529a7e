"""``backend="jax"``: the name is accepted and the reference and blocked paths run on JAX.

JAX arrays are immutable, so this checks that nothing writes into an array
(the NumPy kernel, which does, takes NumPy arrays only). JAX is optional
(``pip install '.[jax]'``; ``.ci/run`` installs it); without it every test here is
skipped with the reason. JAX is not in the ``xp`` fixture of ``conftest.py``: these focused
tests cover it without running the whole suite a fifth time.
float64 needs JAX's x64 mode, switched on for this module's tests only.
"""

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

jax = pytest.importorskip("jax", reason="the jax backend needs JAX: pip install '.[jax]'")
jnp = pytest.importorskip("jax.numpy")

import npattn  # noqa: E402
from npattn import attention as A  # noqa: E402
from npattn import functional as F  # noqa: E402
from npattn.backend import BACKENDS, backend_name, resolve_backend  # noqa: E402
from npattn.gradcheck import gradcheck  # noqa: E402

from _attention_cases import assert_close, make_inputs, on  # noqa: E402


@pytest.fixture(autouse=True)
def x64():
    """float64 on JAX for the duration of one test (JAX's default is float32 only)."""
    previous = jax.config.jax_enable_x64
    jax.config.update("jax_enable_x64", True)
    yield
    jax.config.update("jax_enable_x64", previous)


def test_the_name_resolves_to_jax_numpy():
    assert "jax" in BACKENDS
    xp = resolve_backend("jax")
    assert xp is resolve_backend(jnp)
    assert backend_name(xp) == "jax"


@pytest.mark.parametrize("backend", ["jax", jnp])
def test_module_forward_backward_matches_numpy(backend):
    rng = np.random.default_rng(0)
    ref = npattn.MultiHeadAttention(8, 2, dtype="float64", seed=3)
    mha = npattn.MultiHeadAttention(8, 2, dtype="float64", seed=3, backend=backend)
    x = rng.standard_normal((2, 4, 8))
    dout = rng.standard_normal((2, 4, 8))
    out_ref, _ = ref(x, x, x, is_causal=True)
    dx_ref = ref.backward(dout)
    xj = jnp.asarray(x)
    out, _ = mha(xj, xj, xj, is_causal=True)
    assert isinstance(out, jax.Array)
    np.testing.assert_allclose(np.asarray(out), out_ref, rtol=1e-12, atol=1e-12)
    dx = mha.backward(jnp.asarray(dout))
    for a, b in zip(dx, dx_ref):
        np.testing.assert_allclose(np.asarray(a), b, rtol=1e-12, atol=1e-12)
    for name, g in ref.grads.items():
        np.testing.assert_allclose(np.asarray(mha.grads[name]), g, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("impl", ["reference", "blocked", "auto", "dense"])
def test_sdpa_on_jax_with_dropout_and_mask(impl):
    rng = np.random.default_rng(1)
    q, k, v = (jnp.asarray(rng.standard_normal(s)) for s in ((2, 2, 5, 3), (2, 2, 7, 3), (2, 2, 7, 4)))
    mask = jnp.asarray(rng.random((5, 7)) > 0.3)
    args = dict(mask=mask, is_causal=True, dropout_p=0.25, rng=7)
    out_ref, c_ref = A.sdpa_forward(*(np.asarray(t) for t in (q, k, v)), impl="reference",
                                    **{**args, "mask": np.asarray(mask)})
    out, cache = A.sdpa_forward(q, k, v, impl=impl, block_q=2, block_k=3, **args)
    np.testing.assert_allclose(np.asarray(out), out_ref, rtol=1e-12, atol=1e-12)
    dout = rng.standard_normal(out_ref.shape)
    grads_ref = A.sdpa_backward(dout, c_ref)
    grads = A.sdpa_backward(jnp.asarray(dout), cache)
    for a, b in zip(grads[:3], grads_ref[:3]):
        np.testing.assert_allclose(np.asarray(a), b, rtol=1e-10, atol=1e-12)


def test_numpy_kernel_refuses_jax_with_a_clear_error():
    """impl='numpy' on JAX arrays: the refusal says what the kernel takes, what it got (JAX's
    array type and the three shapes) and what to use instead."""
    q, k, v = jnp.zeros((2, 1, 2, 3)), jnp.zeros((2, 1, 4, 3)), jnp.zeros((2, 1, 4, 5))
    with pytest.raises(ValueError, match=r"^impl='numpy': the NumPy kernel takes NumPy arrays .*; got "
                                         r"\S*jax\S* of shapes \(2, 1, 2, 3\), \(2, 1, 4, 3\), "
                                         r"\(2, 1, 4, 5\); use impl='reference' or 'blocked'$"):
        A.sdpa_forward(q, k, v, impl="numpy")


def test_functional_gradients_on_jax():
    rng = np.random.default_rng(2)
    q, k, v = (jnp.asarray(rng.standard_normal(s)) for s in ((1, 2, 3, 2), (1, 2, 4, 2), (1, 2, 4, 2)))
    mask = jnp.asarray(rng.standard_normal((3, 4)))
    report = gradcheck(lambda q, k, v, mask: F.sdpa_forward(q, k, v, mask=mask), F.sdpa_backward,
                       [q, k, v, mask],
                       names=["q", "k", "v", "mask"], seed=0)
    assert report.ok, str(report)


# one shape (and mask form) for the finite differences and every drawn case: JAX compiles
# each operation once per shape (seconds for a new one), so the draws vary values and options
_JAX_DIMS = (2, 1, 2, 5, 7, 3, 4)  # B, Hkv, G (4 query heads on 2 K/V heads), Lq, Lk, Dh, Dv


@pytest.mark.parametrize("impl", ["reference", "blocked"])
def test_gradcheck_reference_and_blocked_on_jax(impl):
    """Finite differences through the dispatcher on JAX, as test_attention's
    test_gradcheck_every_impl on the fixture's backends: GQA, Lq != Lk, Dv != Dh, a float
    mask with -inf and a fully masked row, causal, dropout p > 0 with a fixed keep-mask;
    random upstream gradient and directions."""
    q, k, v, _, kw = make_inputs(9, *_JAX_DIMS, mask_kind="float", mask_form="B1LqLk",
                                 dropout="mask", causal=True)
    mask = kw.pop("mask")
    kwx = on(jnp.asarray, kw)

    def forward(q, k, v, mask):
        return A.sdpa_forward(q, k, v, mask=mask, impl=impl, block_q=2, block_k=3, **kwx)

    report = gradcheck(forward, A.sdpa_backward, [jnp.asarray(a) for a in (q, k, v, mask)],
                       names=["q", "k", "v", "mask"], mode="vjp", rtol=1e-6, seed=3)
    assert report.ok, str(report)
    assert all(r.scale > 0 for r in report.inputs)  # nothing vanished


@settings(suppress_health_check=[HealthCheck.function_scoped_fixture])  # x64: a config switch
@given(seed=st.integers(0, 2**16), mask_kind=st.sampled_from(["none", "bool", "float"]),
       causal=st.booleans(), dropout=st.sampled_from(["none", "seed", "mask"]))
def test_reference_and_blocked_on_jax_equal_numpy_for_drawn_cases(seed, mask_kind, causal, dropout):
    """Outputs, the four gradients and the keep-mask on JAX equal NumPy's reference run,
    with query row 0 fully masked whenever there is a mask."""
    q, k, v, dout, kw = make_inputs(seed, *_JAX_DIMS, mask_kind=mask_kind, mask_form="B1LqLk",
                                    dropout=dropout, causal=causal)
    out0, c0 = F.sdpa_forward(q, k, v, **kw)
    grads0 = F.sdpa_backward(dout, c0)
    keep0 = A.dropout_keep_mask(c0)
    kwx = on(jnp.asarray, kw)
    for impl in ("reference", "blocked"):
        out, c = A.sdpa_forward(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), impl=impl,
                                block_q=2, block_k=3, **kwx)
        grads = A.sdpa_backward(jnp.asarray(dout), c)
        assert isinstance(out, jax.Array), impl
        assert_close(out, out0, np.asarray, f"{impl}: out")
        for name, g, g0 in zip(("dq", "dk", "dv", "dmask"), grads, grads0):
            assert_close(g, g0, np.asarray, f"{impl}: {name}")
        keep = A.dropout_keep_mask(c)
        assert (keep is None) == (keep0 is None), impl
        if keep0 is not None:
            np.testing.assert_array_equal(np.asarray(keep), keep0, err_msg=impl)
        if mask_kind != "none":  # row 0 attends nothing: a zero row and a zero dq row
            assert np.all(np.asarray(out)[:, :, 0] == 0.0), impl
            assert np.all(np.asarray(grads.dq)[:, :, 0] == 0.0), impl


def test_float64_without_x64_is_a_clear_error():
    jax.config.update("jax_enable_x64", False)
    refused = (r"^{}: expected one of \[.*'float32'.*\] that backend 'jax' keeps, got 'float64', which it "
               r"turns into another dtype \(JAX: float64 needs jax\.config\.update\('jax_enable_x64', "
               r"True\) first\)$")
    with pytest.raises(ValueError, match=refused.format("dtype")):
        npattn.MultiHeadAttention(8, 2, dtype="float64", backend="jax")
    # the message names the argument float_dtype_name reads, as its other refusals do
    from npattn.backend import resolve_backend
    from npattn.validation import float_dtype_name

    with pytest.raises(ValueError, match=refused.format("cache_dtype")):
        float_dtype_name(resolve_backend("jax"), "float64", name="cache_dtype")
    m = npattn.MultiHeadAttention(8, 2, dtype="float32", backend="jax")
    assert m.params["w_q"].dtype == jnp.float32


def test_mask_lengths_past_int32_without_x64_are_refused_before_any_array_is_made():
    """Without x64 JAX's positions are int32: arange(2**31) would wrap and the mask would be
    wrong without a word. A length past 2**31 - 1 is refused by name, before anything is made
    (the lengths here fail the size check as well, were this check gone: nothing is allocated);
    with x64 the positions are int64 and the same lengths fail only as arrays that cannot exist."""
    from npattn import masks

    jax.config.update("jax_enable_x64", False)
    past = 2**31  # one past int32's largest value
    for build, name in ((lambda: masks.causal(past, past, xp="jax"), "Lq"),
                        (lambda: masks.window(2, 2**61, 1, 1, xp="jax"), "Lk"),
                        (lambda: masks.padding([0, 1], 2**61, xp="jax"), "Lk"),
                        (lambda: masks.padding(jnp.asarray([0, 1]), 2**61), "Lk")):
        with pytest.raises(ValueError, match=rf"^{name}: expected a length of at most {2**31 - 1}, the "
                                             rf"largest int32 .*jax_enable_x64.*, got \d+$"):
            build()
    jax.config.update("jax_enable_x64", True)
    # refused by the size check alone: lengths whose positions alone cannot be mapped, so that
    # without the check the call fails at once instead of filling memory
    with pytest.raises(ValueError, match=r"^Lq and Lk: expected sizes for which .* \(8 bytes an entry\)"):
        masks.causal(2**56, 2**56, xp="jax")
    assert masks.causal(3, 4, xp="jax").shape == (3, 4)


def test_a_window_side_past_int32_without_x64_is_capped_within_the_positions_dtype():
    """A window side of any size leaves out nothing a side of max(Lq, Lk) would not, and is
    capped there: within int32 for lengths that are (a cap of Lq + Lk, 2**31 here, overflowed
    into JAX's OverflowError naming nothing). Traced with eval_shape: nothing is made."""
    from npattn import masks

    previous = jax.config.jax_enable_x64
    jax.config.update("jax_enable_x64", False)
    try:
        for Lq, Lk, align in ((1, 2**31 - 1, "top_left"), (2**31 - 1, 1, "bottom_right")):
            made = jax.eval_shape(lambda: masks.window(Lq, Lk, 2**40, 2**40, align, xp="jax"))
            assert made.shape == (Lq, Lk) and made.dtype == jnp.bool_
        np.testing.assert_array_equal(np.asarray(masks.window(3, 5, 2**40, 1, xp="jax")),
                                      masks.window(3, 5, None, 1))
        # sdpa_forward's window= caps its sides the same way (the reference: the blocked one
        # would trace a loop over 2**31 keys)
        q = jax.ShapeDtypeStruct((1, 1, 1, 1), jnp.float32)
        k = jax.ShapeDtypeStruct((1, 1, 2**31 - 1, 1), jnp.float32)
        made = jax.eval_shape(
            lambda q, k: A.sdpa_forward(q, k, k, window=(2**40, 2**40), impl="reference")[0], q, k)
        assert made.shape == (1, 1, 1, 1)
    finally:
        jax.config.update("jax_enable_x64", previous)


def test_relative_positions_past_int32_without_x64_are_refused_by_name():
    """Without x64 the relative positions t - (Lq - 1 + offset) are int32: an offset or lengths
    that take them past its range are refused naming Lq, Lk and offset (an offset of 2**40 was
    JAX's OverflowError naming nothing), before anything is made; positions at its very end
    are still made, exactly."""
    from npattn import positions as P

    jax.config.update("jax_enable_x64", False)
    match = r"^Lq, Lk and offset: expected .* within \[-2147483648, 2147483647\] \(int32, .*offset=OFF$"
    table, bias_table = jnp.zeros((5, 2)), jnp.zeros((32, 2))
    for call, offset in ((lambda: P.relative_distances("jax", 3, 4, offset=2**40), 2**40),
                         (lambda: P.relative_distances("jax", 2**61, 2**61), 0),
                         (lambda: P.relative_bias_forward(bias_table, 3, 4, offset=-(2**40)), -(2**40)),
                         (lambda: P.relative_embedding_forward(table, 3, 4, offset=2**31), 2**31)):
        with pytest.raises(ValueError, match=match.replace("OFF", str(offset))):
            call()
    rel = P.relative_distances("jax", 3, 4, offset=5 - 2**31)  # t - (7 - 2**31): up to 2**31 - 2
    assert rel.dtype == jnp.int32
    np.testing.assert_array_equal(np.asarray(rel), np.arange(6) - (7 - 2**31))


def test_positions_without_x64_take_their_angles_in_float64():
    """JAX without x64 has no float64: rope's and the sinusoidal encoding's angles are taken
    on the host in float64, so float32 results are as close as NumPy's float32 ones (in
    float32 the angle of position 100000 is off by about 4e-3 rad)."""
    from npattn import nn
    from npattn import positions as P

    jax.config.update("jax_enable_x64", False)
    x = np.random.default_rng(4).standard_normal((1, 2, 16, 64)).astype(np.float32)
    for start in (None, 100_000):
        exact, _ = P.rope_forward(x.astype(np.float64), start)
        out, cache = P.rope_forward(jnp.asarray(x), start)
        assert out.dtype == jnp.float32
        np.testing.assert_allclose(np.asarray(out), exact, rtol=0, atol=1e-5)
        dx, _ = P.rope_backward(out, cache)  # the rotation back by -theta
        np.testing.assert_allclose(np.asarray(dx), x, rtol=0, atol=1e-5)
    theta = P.rope_angles("jax", jnp.arange(100_000, 100_004), 8)
    assert theta.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(theta), P.rope_angles("numpy", np.arange(100_000, 100_004), 8),
                               rtol=1e-7)
    pe = nn.sinusoidal_positions("jax", 4096, 32)
    assert pe.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(pe), nn.sinusoidal_positions("numpy", 4096, 32), rtol=0, atol=1e-7)


def test_t5_buckets_without_x64():
    """Without x64 JAX's widest integer is int32: its minimum gets a bucket (it raised an
    OverflowError comparing with -2**63), and the buckets equal NumPy's."""
    from npattn import positions as P

    jax.config.update("jax_enable_x64", False)
    r = np.array([-2**31, -300, -5, 0, 7, 129, 2**31 - 1])
    np.testing.assert_array_equal(np.asarray(P.t5_bucket(jnp.asarray(r, dtype=jnp.int32))), P.t5_bucket(r))
    out, _ = P.relative_bias_forward(jnp.zeros((32, 2), jnp.float32), 4, 6)
    assert out.shape == (1, 2, 4, 6)


def test_a_float64_result_without_x64_is_the_float32_rounding_of_the_host_values():
    """A step run in float64 on the host comes back to JAX without x64 as float32, each value
    rounded once to nearest (1 + 2**-30 to 1, 0.1 to float32's 0.1), without a warning; with
    dtype= it is then cast (bfloat16: from those float32 values)."""
    import warnings

    from npattn.backend import float64_namespace, float64_result

    jax.config.update("jax_enable_x64", False)
    assert float64_namespace(jnp) is not jnp  # the host's: JAX makes no float64 here
    a = np.array([[1.0 + 2.0**-30, 0.1], [-3.0, 2.0**-140]])  # float64 [2, 2]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out = float64_result(a, jnp)
        low = float64_result(a, jnp, jnp.bfloat16)
    assert out.dtype == jnp.float32 and low.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(out), np.array([[1.0, 0.1], [-3.0, 2.0**-140]], np.float32))
    np.testing.assert_array_equal(np.asarray(low), np.asarray(out.astype(jnp.bfloat16)))


class _NoFloat64:
    """A namespace that makes no float64 arrays and refuses float64 data outright (as a
    device without float64 does), where JAX without x64 converts it quietly."""

    float32, float64 = np.float32, np.float64

    @staticmethod
    def zeros(shape, dtype=None):
        return np.zeros(shape, np.float32 if dtype == np.float64 else dtype)

    @staticmethod
    def asarray(a, device=None):
        if np.asarray(a).dtype == np.float64:
            raise TypeError("no float64 on this device")
        return np.asarray(a)


def test_a_float64_result_is_rounded_to_float32_before_it_reaches_a_namespace_without_float64():
    """float64_result promises xp's widest float where xp has no float64: the host values are
    rounded to float32 before xp sees them, so a library that refuses float64 data gets a
    float32 array rather than raising."""
    from npattn.backend import float64_result, keeps_dtype

    assert not keeps_dtype(_NoFloat64, _NoFloat64.float64)
    a = np.array([1.0 + 2.0**-30, 0.1, -3.0])
    out = float64_result(a, _NoFloat64)
    assert out.dtype == np.float32
    np.testing.assert_array_equal(out, np.array([1.0, 0.1, -3.0], np.float32))


def test_gradient_checks_without_x64_are_refused():
    """The differences are taken in float64; without x64 JAX would run them in float32 and
    report correct gradients wrong: a ValueError naming the input and the switch."""
    from npattn import layers as Ly

    jax.config.update("jax_enable_x64", False)
    x = jnp.asarray(np.random.default_rng(0).standard_normal((2, 3)), dtype=jnp.float32)
    with pytest.raises(ValueError, match=r"inputs\[0\]: .*float64.*jax_enable_x64"):
        npattn.check_gradients(Ly.gelu_forward, Ly.gelu_backward, [x])


def test_dtype_probes_leave_the_warning_filters_alone(monkeypatch):
    """Whether JAX keeps a dtype is asked of JAX without making an array (which warns when
    x64 is off): npattn never changes the process's warning filters to silence it
    (``warnings.catch_warnings`` is not thread-safe; a thread's "ignore" could stay for
    good, and other threads' warnings are lost meanwhile)."""
    import warnings

    from npattn import backend

    def refuse(*args, **kwargs):
        raise AssertionError("npattn changed the process's warning filters")

    for x64 in (False, True):
        jax.config.update("jax_enable_x64", x64)
        with monkeypatch.context() as m:
            m.setattr(warnings, "catch_warnings", refuse)
            m.setattr(warnings, "simplefilter", refuse)
            m.setattr(warnings, "filterwarnings", refuse)
            kept = [backend.keeps_dtype(jnp, t) for t in (jnp.float64, jnp.int64, jnp.float32)]
            widest = backend.widest_int(jnp)
        assert kept == [x64, x64, True]
        assert widest == (jnp.int64 if x64 else jnp.int32)


def test_bfloat16_arrays_reach_the_host_and_torch():
    """DLPack carries no bfloat16: a JAX bfloat16 array is copied to the host by JAX itself
    (as ml_dtypes' bfloat16), so the torch state dicts of bfloat16 layers on JAX, a state
    dict of JAX bfloat16 arrays and bfloat16 rope positions without x64 work (each raised
    RuntimeError 'Unsupported dtype in DLTensor')."""
    torch = pytest.importorskip("torch", reason="torch state dicts need torch")
    from npattn import positions as P
    from npattn.backend import to_numpy
    from npattn.transformer import TransformerBlock

    x = jnp.asarray([1.5, -2.0, 3.0], dtype=jnp.bfloat16)
    host = to_numpy(x)
    assert host.dtype == x.dtype and host.tolist() == [1.5, -2.0, 3.0]

    mha = npattn.MultiHeadAttention(8, 2, dtype="bfloat16", backend="jax", seed=0)
    sd = mha.torch_state_dict()
    assert sd["in_proj_weight"].dtype == torch.bfloat16
    np.testing.assert_array_equal(sd["out_proj.weight"].float().numpy(),
                                  np.asarray(mha.params["w_o"], dtype=np.float32))
    as_jax = {k: jnp.asarray(v.float().numpy(), dtype=jnp.bfloat16) for k, v in sd.items()}
    back = npattn.MultiHeadAttention(8, 2, dtype="bfloat16", backend="jax", seed=1)
    back.load_torch_state_dict(as_jax)
    for name, p in mha.params.items():
        assert back.params[name].dtype == jnp.bfloat16 and bool((back.params[name] == p).all()), name
    block = TransformerBlock(8, 2, 16, dtype="bfloat16", backend="jax", seed=0)
    layer = torch.nn.TransformerEncoderLayer(8, 2, 16, batch_first=True, dtype=torch.bfloat16)
    layer.load_state_dict(block.torch_state_dict())
    np.testing.assert_array_equal(layer.norm1.weight.detach().float().numpy(),
                                  np.asarray(block.params["norm1.weight"], dtype=np.float32))

    jax.config.update("jax_enable_x64", False)
    q = jnp.asarray(np.random.default_rng(0).standard_normal((1, 1, 4, 8)), dtype=jnp.bfloat16)
    out, _ = P.rope_forward(q, jnp.arange(4, dtype=jnp.bfloat16))
    ref, _ = P.rope_forward(q, jnp.arange(4))
    assert out.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(out, dtype=np.float32), np.asarray(ref, dtype=np.float32))


def test_to_numpy_of_a_jax_array_is_a_writable_copy():
    """JAX arrays are immutable and ``np.asarray`` of one is a read-only view; ``to_numpy``
    promises a host copy, which the caller may write into."""
    from npattn.backend import to_numpy

    host = to_numpy(jnp.zeros(3))
    host[0] = 1.0
    assert host.tolist() == [1.0, 0.0, 0.0]
