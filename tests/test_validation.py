"""Every misuse is caught before any computation with a message that names the
argument, what was expected and what was received (``npattn.validation`` and
the module's own checks in ``npattn.module``)."""

import math
import numbers
import re
import sys

import numpy as np
import pytest

import npattn
from npattn import MultiHeadAttention
from npattn import functional as F
from npattn.backend import from_numpy, to_numpy
from npattn.module import ParameterDict

from reliability_helpers import host_inputs, inputs, make_mha, raises, snapshot

# --------------------------------------------------------------------------
# construction


@pytest.mark.parametrize(
    "kwargs, exc, fragments",
    [
        (dict(n_head=0), ValueError, ("n_head", "positive int", "0")),
        (dict(n_head=-2), ValueError, ("n_head", "-2")),
        (dict(n_head=2.0), TypeError, ("n_head", "float")),
        (dict(n_head="2"), TypeError, ("n_head", "str")),
        (dict(n_head=True), TypeError, ("n_head", "bool")),
        (dict(d_model=0), ValueError, ("d_model", "positive int")),
        (dict(d_model=8.0), TypeError, ("d_model", "float")),
        (dict(d_model=9), ValueError, ("d_model", "multiple of n_head=2", "9")),
        (dict(dropout=-0.1), ValueError, ("dropout", "[0, 1)", "-0.1")),
        (dict(dropout=1.0), ValueError, ("dropout", "[0, 1)", "1.0")),
        (dict(dropout=math.nan), ValueError, ("dropout", "nan")),
        (dict(dropout="0.1"), TypeError, ("dropout", "str")),
        (dict(kdim=0), ValueError, ("kdim", "positive int")),
        (dict(vdim=-3), ValueError, ("vdim", "-3")),
        (dict(kdim=2.5), TypeError, ("kdim", "float")),
        (dict(dtype="float128"), ValueError, ("dtype", "float32", "float128")),
        (dict(dtype="int32"), ValueError, ("dtype", "int32")),
        (dict(dtype=np.int32), TypeError, ("dtype", "float32")),
        (dict(dtype=3), TypeError, ("dtype", "int")),
        (dict(dtype=b"float64"), TypeError, ("dtype", "bytes")),  # np.dtype reads bytes as a name
        (dict(bias="yes"), TypeError, ("bias", "bool", "str")),
        (dict(seed=-1), ValueError, ("seed", "non-negative int", "-1")),
        (dict(seed=1.5), TypeError, ("seed", "float")),
        (dict(seed=True), TypeError, ("seed", "bool")),
        (dict(seed=[3]), TypeError, ("seed", "list")),  # SeedSequence would take it as entropy
    ],
)
def test_construction_rejects(backend, kwargs, exc, fragments):
    args = dict(d_model=8, n_head=2, backend=backend)
    args.update(kwargs)
    with raises(exc, *fragments):
        MultiHeadAttention(args.pop("d_model"), args.pop("n_head"), **args)


def test_a_scalar_type_as_dtype_is_named_as_written():
    """dtype=np.int32 (a NumPy scalar type, not a dtype object) is named 'numpy.int32' in the
    message, not by its repr "<class 'numpy.int32'>"; a built-in class by its bare name."""
    for dtype, written in ((np.int32, "numpy.int32"), (np.complex128, "numpy.complex128"), (int, "int")):
        with pytest.raises(TypeError) as info:
            MultiHeadAttention(8, 2, dtype=dtype)
        message = str(info.value)
        assert message.startswith("dtype: expected one of"), message
        assert message.endswith(f"got type {written}"), message
        assert "<class" not in message, message


def _load_digits_data(val_fraction):
    from npattn.tools.demo_digits import load_digits_data
    return load_digits_data(val_fraction=val_fraction)


def _check_supports(entry):
    from npattn.verify_cases import check_supports
    return check_supports([entry])


@pytest.mark.parametrize("call, name", [
    (lambda v: npattn.backend.make_rng(v), "seed"),
    (lambda v: npattn.backend.keep_mask(v, 0.5, (2, 3), np), "key"),
    (lambda v: npattn.backend.keep_mask(0, v, (2, 3), np), "p"),
    (lambda v: npattn.backend.limit_blas_threads(v), "n"),
    (lambda v: npattn.masks.padding(v, 4), "lengths"),
    (_check_supports, "supports"),
    (_load_digits_data, "val_fraction"),
])
def test_a_class_given_for_a_value_is_named_as_written(call, name):
    """A class passed where a value belongs (np.int32 for a seed, a key, a count) is named
    'type numpy.int32' in the message, as every other message names one, not by its repr
    "<class 'numpy.int32'>"."""
    with pytest.raises(TypeError) as info:
        call(np.int32)
    message = str(info.value)
    assert message.startswith(f"{name}: expected "), message
    assert message.endswith("got type numpy.int32"), message
    assert "<class" not in message, message


def _set_attribute(obj, name, value):
    setattr(obj, name, value)


def _torch_interop():
    from npattn import torch_interop
    return torch_interop


@pytest.mark.parametrize("call, name", [
    (lambda v: MultiHeadAttention(8, 2, backend=v), "backend"),
    (lambda v: npattn.backend.keyed_keep_mask(1, 0.1, [], np.arange(2), np.arange(3), out=v), "out"),
    # a NumPy scalar type carries __array_namespace__ as its instances do: no array all the same
    (lambda v: npattn.backend.to_numpy(v), "x"),
    (lambda v: npattn.backend.device_of(v), "x"),
    (lambda v: F.sdpa_forward(v, np.ones((2, 3, 4)), np.ones((2, 3, 4))), "q"),
    (lambda v: MultiHeadAttention(8, 2)(np.ones((2, 3, 8), np.float32), v, v), "key"),
    (lambda v: _torch_interop().host_tensor("w", v), "state_dict['w']"),
    (lambda v: npattn.verify_cases.check_supports(v), "supports"),
    (lambda v: _set_attribute(MultiHeadAttention(8, 2), "cache", v), "cache"),
    (lambda v: _set_attribute(MultiHeadAttention(8, 2), "params", v), "params"),
    (lambda v: npattn.attention.sdpa_backward(np.ones((2, 3, 4)), v), "cache"),
    (lambda v: npattn.attention.sdpa_forward(*[np.ones((2, 3, 4))] * 3, workspace=v), "workspace"),
    (lambda v: npattn.attention.dropout_keep_mask(v), "cache"),
    (lambda v: npattn.nn.clip_grad_norm(v, 1.0), "grads"),
    (lambda v: npattn.transformer.TransformerBlock(4, 2).forward(np.ones((2, 3, 4), np.float32),
                                                                 dropout_masks=v), "dropout_masks"),
    (lambda v: _torch_interop().torch_state_dict_shapes(v), "mha"),
    (lambda v: _torch_interop().check_state_dict(v), "state_dict"),
])
def test_a_class_given_for_an_object_is_named_as_written(call, name):
    """A class passed where an object belongs (a backend, an array, a cache, a dict) is named
    'type numpy.int32', as a class is named everywhere, not 'type' alone."""
    with pytest.raises((TypeError, ValueError)) as info:  # (a wrong out= is a ValueError)
        call(np.int32)
    message = str(info.value)
    assert message.startswith(f"{name}: expected "), message
    # what it got is the class itself, not another check's message quoted
    assert message.split(" got ", 1)[1].startswith("type numpy.int32"), message


@pytest.mark.parametrize(
    "backend_arg, exc, fragment",
    [("jax_or_what", ValueError, "'jax_or_what'"), (3, TypeError, "int"), (math, TypeError, "math")],
)
def test_construction_rejects_backend(backend_arg, exc, fragment):
    with raises(exc, "backend", fragment):
        MultiHeadAttention(8, 2, backend=backend_arg)


def test_a_library_module_resolves_to_its_array_api_namespace():
    """backend= a NumPy, torch or dask.array module is the array_api_compat namespace of that
    library, the one ``namespace`` gives for its arrays (NumPy's own module differs from it);
    a module missing asarray or matmul is not a namespace and is refused by name."""
    import types

    import array_api_compat

    from npattn.backend import namespace, resolve_backend

    assert resolve_backend(np) is resolve_backend("numpy") is namespace(np.zeros(2))
    assert resolve_backend(np) is not np
    for name, module in (("torch", "torch"), ("dask", "dask.array")):
        lib = pytest.importorskip(module)
        assert resolve_backend(lib) is resolve_backend(name)
        assert resolve_backend(lib).__name__ == "array_api_compat." + module
    assert array_api_compat.numpy is resolve_backend(np)
    for attrs in (("asarray",), ("matmul",)):
        fake = types.ModuleType("half_an_api")
        for a in attrs:
            setattr(fake, a, getattr(np, a))
        with raises(TypeError, "backend: expected an Array API namespace module", "half_an_api"):
            resolve_backend(fake)


def test_mixed_libraries_are_refused_naming_the_odd_array():
    """namespace(..., names=) names the first array that is not of the first array's library,
    and that library by the first array's name; without names, every library is listed."""
    torch = pytest.importorskip("torch")
    from npattn.backend import namespace

    a, t = np.zeros((2, 3)), torch.zeros((2, 3))
    with pytest.raises(TypeError, match=r"^v: expected an array of the library of q \(numpy\.ndarray\), "
                                        r"got torch\.Tensor"):
        namespace(a, None, t, names=["q", "k", "v"])
    with pytest.raises(TypeError, match="^arrays from different array libraries were mixed: "
                                        "numpy.ndarray, torch.Tensor"):
        namespace(a, t)


def test_namespace_of_no_array_or_of_no_library_says_so():
    """Nothing but None, or values of no array library, are refused as such (the message
    spoke of libraries "mixed": and an empty list, or builtins.list alone)."""
    from npattn.backend import namespace

    expected = (r"expected an array of an array library \(NumPy, CuPy, torch, dask, JAX or an Array API "
                r"one\), got ")
    with pytest.raises(TypeError, match="^arrays: " + expected + r"nothing \(or only None\)$"):
        namespace()
    with pytest.raises(TypeError, match="^arrays: " + expected + r"nothing \(or only None\)$"):
        namespace(None, None)
    with pytest.raises(TypeError, match="^arrays: " + expected + "builtins.list$"):
        namespace([1.0, 2.0])
    with pytest.raises(TypeError, match="^k: " + expected + "builtins.list$"):
        namespace(None, [1.0], [2.0], names=["q", "k", "v"])  # the first value given is named
    with pytest.raises(TypeError, match="^k: " + expected + "builtins.list$"):
        namespace(np.ones(2), [1.0], names=["q", "k"])  # the value that is no array, not q
    with pytest.raises(TypeError, match="^q: " + expected + "builtins.tuple$"):
        namespace((1.0,), np.ones(2), names=["q", "k"])  # (k, the array, was named)


def test_resolve_backend_names_the_argument_it_is_given():
    """resolve_backend speaks of the argument its caller names (``xp`` where a function
    calls it so) in each of its refusals: a module that is no namespace, a name it does
    not know, and a value that is neither."""
    import types

    from npattn.backend import resolve_backend

    fake = types.ModuleType("no_api")
    for arg, exc, fragment in ((fake, TypeError, "no_api"), ("jax_or_what", ValueError, "'jax_or_what'"),
                               (3, TypeError, "int")):
        with pytest.raises(exc, match=f"^xp: expected .*{fragment}"):
            resolve_backend(arg, name="xp")


def test_namespace_names_the_odd_array_when_the_first_argument_is_none():
    """A None first argument is skipped: the library the others must share is that of the
    first array given, named by its own name."""
    torch = pytest.importorskip("torch")
    from npattn.backend import namespace

    a, t = np.zeros((2, 3)), torch.zeros((2, 3))
    with pytest.raises(TypeError, match=r"^k: expected an array of the library of q \(numpy\.ndarray\), "
                                        r"got torch\.Tensor"):
        namespace(None, a, t, names=["mask", "q", "k"])


def test_host_copies_are_copies_and_any_layout_comes_over():
    """to_numpy of a NumPy array (or scalar) is a new array: writing into it leaves the input
    as it was. from_numpy takes a host array of any layout (reversed, transposed) to every
    library with its values, torch included, which refuses negative strides."""
    import importlib.util

    from npattn.backend import resolve_backend

    a = np.arange(6.0).reshape(2, 3)
    host = to_numpy(a)
    host[...] = -1.0
    np.testing.assert_array_equal(a, np.arange(6.0).reshape(2, 3))
    assert to_numpy(np.float32(2.5)).shape == () and to_numpy(np.float32(2.5)).dtype == np.float32
    names = ["numpy", "array_api_strict"] + (["torch"] if importlib.util.find_spec("torch") else [])
    for name in names:
        xp = resolve_backend(name)
        for view in (a[::-1], a.T, a[:, ::-2]):
            got = from_numpy(view, xp)
            assert tuple(got.shape) == view.shape
            np.testing.assert_array_equal(to_numpy(got), view)


def test_host_copies_refuse_what_numpy_cannot_hold_and_extension_dtypes_are_no_kind():
    """to_numpy of a torch bfloat16 tensor is a TypeError naming x and the cast (NumPy has no
    bfloat16); isdtype says False for ml_dtypes' bfloat16 on NumPy (NumPy's isdtype raises
    for it) whatever the kind, so it is neither floating, integral nor bool."""
    from npattn.backend import isdtype, namespace

    torch = pytest.importorskip("torch")
    with pytest.raises(TypeError, match=r"^x: expected a tensor of a dtype NumPy has, got "
                                        r"torch\.bfloat16 \(cast it first"):
        to_numpy(torch.zeros(3, dtype=torch.bfloat16))
    ml_dtypes = pytest.importorskip("ml_dtypes")
    xp, bf16 = namespace(np.zeros(1)), np.dtype(ml_dtypes.bfloat16)
    for kind in ("real floating", "integral", "bool", "numeric"):
        assert isdtype(xp, bf16, kind) is False, kind
    assert isdtype(xp, np.dtype(np.float32), "real floating") is True


def test_float16_on_a_backend_without_it():
    pytest.importorskip("array_api_strict")
    for dtype in ("float16", np.float16, np.dtype("float16")):  # a float dtype it lacks, however given
        with raises(ValueError, "dtype", "array_api_strict", "float16"):
            MultiHeadAttention(8, 2, dtype=dtype, backend="array_api_strict")


def test_dtype_accepts_dtype_objects(backend, xp):
    m = MultiHeadAttention(8, 2, dtype=xp.float64, backend=backend)
    assert m.dtype == xp.float64
    assert all(p.dtype == xp.float64 for p in m.params.values())


# --------------------------------------------------------------------------
# forward: shapes


def _bad_forward_cases(xp):
    """(name, (query, key, value), kwargs, exception, fragments) for a module
    with d_model=8, n_head=2, kdim=6, vdim=4, float64."""
    q, k, v = inputs(xp, 2, 3, 5, 8, 6, 4)
    cases = [
        ("query 2-D", (q[0, ...], k, v), {}, ValueError, ("query", "3-D", "(3, 8)")),
        ("key 4-D", (q, xp.reshape(k, (2, 5, 6, 1)), v), {}, ValueError, ("key", "3-D", "(2, 5, 6, 1)")),
        ("query list", (to_numpy(q).tolist(), k, v), {}, TypeError, ("query", "list")),
        ("value None", (q, k, None), {}, TypeError, ("value", "None")),
        ("batch", (q, k[:1, ...], v[:1, ...]), {}, ValueError, ("key", "batch size 2", "(1, 5, 6)")),
        # a value of batch 1 alone would broadcast over the batch inside step 6.
        ("value batch", (q, k, v[:1, ...]), {}, ValueError, ("value", "batch size 2", "(1, 5, 4)")),
        ("lengths", (q, k, v[:, :4, :]), {}, ValueError, ("value", "length 5", "(2, 4, 4)")),
        ("query width", (q[..., :6], k, v), {}, ValueError, ("query", "w_q", "8", "(2, 3, 6)")),
        ("key width", (q, k[..., :4], v), {}, ValueError, ("key", "w_k", "6", "(2, 5, 4)")),
        ("value width", (q, k, v[..., :3]), {}, ValueError, ("value", "w_v", "4", "(2, 5, 3)")),
        # named as the module's inputs, not as the heads a later check would see
        ("empty query", (q[:, :0, :], k, v), {}, ValueError,
         ("query: ", "query length (axis 1)", "(2, 0, 8)")),
        ("empty keys", (q, k[:, :0, :], v[:, :0, :]), {}, ValueError,
         ("key: ", "key length (axis 1)", "(2, 0, 6)")),
        ("empty batch", (q[:0, ...], k[:0, ...], v[:0, ...]), {}, ValueError,
         ("query: ", "batch size (axis 0)", "(0, 3, 8)")),
    ]
    masks = [
        ("int mask", np.ones((3, 5), dtype=np.int64), TypeError, ("mask", "bool", "int64", "ambiguous")),
        ("3-D mask", np.ones((2, 3, 5), dtype=bool), ValueError, ("mask", "(B, 1, Lq, Lk)", "(2, 3, 5)")),
        ("1-D mask", np.ones((5,), dtype=bool), ValueError, ("mask", "2-D or 4-D", "(5,)")),
        ("5-D mask", np.ones((1, 2, 2, 3, 5), dtype=bool), ValueError, ("mask", "(1, 2, 2, 3, 5)")),
        ("mask Lk", np.ones((3, 4), dtype=bool), ValueError, ("mask", "(2, 2, 3, 5)", "(3, 4)")),
        ("mask Lq", np.ones((4, 5), dtype=bool), ValueError, ("mask", "(4, 5)")),
        ("mask batch", np.ones((3, 1, 3, 5), dtype=bool), ValueError, ("mask", "(3, 1, 3, 5)")),
        ("mask heads", np.ones((1, 3, 3, 5), dtype=bool), ValueError, ("mask", "(1, 3, 3, 5)")),
        ("float32 mask", np.zeros((3, 5), dtype=np.float32), TypeError, ("mask", "float64", "float32")),
    ]
    for name, m, exc, frag in masks:
        cases.append((name, (q, k, v), dict(mask=from_numpy(m, xp)), exc, frag))
    cases += [
        ("dropout_mask float", (q, k, v), dict(dropout_mask=from_numpy(np.ones((3, 5)), xp)),
         TypeError, ("dropout_mask", "bool", "float64")),
        ("dropout_mask shape", (q, k, v), dict(dropout_mask=from_numpy(np.ones((5, 3), dtype=bool), xp)),
         ValueError, ("dropout_mask", "(5, 3)")),
        ("dropout_mask 3-D", (q, k, v), dict(dropout_mask=from_numpy(np.ones((2, 3, 5), dtype=bool), xp)),
         ValueError, ("dropout_mask", "(2, 3, 5)")),
        ("mask list", (q, k, v), dict(mask=[[True] * 5] * 3), TypeError, ("mask", "list")),
        ("is_causal", (q, k, v), dict(is_causal="yes"), TypeError, ("is_causal", "bool", "str")),
        ("need_weights", (q, k, v), dict(need_weights=1), TypeError, ("need_weights", "bool", "int")),
        ("check_finite", (q, k, v), dict(check_finite=None), TypeError, ("check_finite", "None")),
        ("average_attn_weights", (q, k, v), dict(need_weights=True, average_attn_weights="no"),
         TypeError, ("average_attn_weights", "bool", "str")),
        ("dtype", (xp.astype(q, xp.float32), k, v), {}, TypeError, ("query", "float64", "float32")),
        ("key dtype", (q, xp.astype(k, xp.float32), v), {}, TypeError, ("key", "float64", "float32")),
    ]
    return cases


def test_forward_rejects(backend, xp):
    m = make_mha(backend, kdim=6, vdim=4)
    for name, (q, k, v), kwargs, exc, fragments in _bad_forward_cases(xp):
        with raises(exc, *fragments):
            m(q, k, v, **kwargs)
        assert m._cache is None, name  # nothing was computed or stored


def test_forward_accepts_documented_mask_shapes(backend, xp):
    m = make_mha(backend)
    q, k, v = inputs(xp, 2, 3, 5, 8)
    shapes = [(3, 5), (1, 5), (3, 1), (1, 1, 3, 5), (2, 1, 3, 5), (2, 1, 1, 5), (2, 2, 3, 5),
              (1, 2, 1, 1)]
    for shape in shapes:
        mask = from_numpy(np.ones(shape, dtype=bool), xp)
        out, _ = m(q, k, v, mask=mask)
        assert tuple(out.shape) == (2, 3, 8)
        fmask = from_numpy(np.zeros(shape), xp)
        # the same softmax to rounding (the NumPy kernel skips the max shift where the
        # scores are bounded, and a floating mask always takes it)
        np.testing.assert_allclose(to_numpy(m(q, k, v, mask=fmask)[0]), to_numpy(out),
                                   rtol=1e-12, atol=1e-14)


# --------------------------------------------------------------------------
# backends and devices


def _other_backends():
    import importlib.util

    names = ["numpy", "array_api_strict", "torch"]
    return [n for n in names if importlib.util.find_spec(n) is not None]


def test_a_list_for_an_array_names_the_backend_with_its_article():
    pytest.importorskip("array_api_strict")
    for backend, want in (("numpy", "a numpy array"), ("array_api_strict", "an array_api_strict array")):
        m = make_mha(backend)
        x = inputs(m.xp, 2, 3, 5, 8)[0]
        with pytest.raises(TypeError, match=rf"^query: expected {want}, got list$"):
            m([[0.0] * 8] * 3, x, x)


@pytest.mark.parametrize(
    "module_backend, input_backend",
    [(a, b) for a in _other_backends() for b in _other_backends() if a != b],
)
def test_mixing_backends_is_a_type_error(module_backend, input_backend):
    from npattn import nn

    m = make_mha(module_backend)
    mine = inputs(m.xp, 2, 3, 5, 8)
    theirs = inputs(make_mha(input_backend).xp, 2, 3, 5, 8)
    for i, name in enumerate(("query", "key", "value")):
        args = list(mine)
        args[i] = theirs[i]
        with raises(TypeError, name, module_backend, input_backend, "build the module with that backend"):
            m(*args)
    # the message reads as English: 'an array_api_strict array', 'a numpy array'
    with pytest.raises(TypeError) as info:
        m(theirs[0], *mine[1:])
    want, have = (("an " if n == "array_api_strict" else "a ") + n + " array"
                  for n in (module_backend, input_backend))
    assert f"expected {want} (" in str(info.value) and f"got {have} (" in str(info.value), str(info.value)
    other = make_mha(input_backend).xp
    mask = from_numpy(np.ones((3, 5), dtype=bool), other)
    with raises(TypeError, "mask", module_backend, input_backend):
        m(*mine, mask=mask)
    with raises(TypeError, "dropout_mask", module_backend):
        m(*mine, dropout_mask=mask)
    with raises(TypeError, "params['w_k']", module_backend, input_backend):
        m.params["w_k"] = from_numpy(to_numpy(m.params["w_k"]), other)
    out, _ = m(*mine)
    with raises(TypeError, "dout", module_backend, input_backend):
        m.backward(from_numpy(to_numpy(out), other))
    with raises(TypeError, "v", module_backend, input_backend, "that of q",
                "pass every array from one library"):
        F.sdpa_forward(*(from_numpy(np.ones((1, 1, 2, 2)), x) for x in (m.xp, m.xp, other)))
    # a functional call names the array the others follow, and speaks of no module
    with pytest.raises(TypeError, match=r"^pos: expected an? \S+ array \(that of x\).*one library$"):
        nn.add_positions_forward(from_numpy(np.ones((1, 2, 2)), m.xp), from_numpy(np.ones((2, 2)), other))


def test_mixing_devices_is_a_value_error():
    aas = pytest.importorskip("array_api_strict")
    m = make_mha("array_api_strict")
    q, k, v = inputs(aas, 2, 3, 5, 8)
    dev = aas.Device("device1")
    k1 = aas.asarray(k, device=dev)
    with raises(ValueError, "key", "device1", "device"):
        m(q, k1, v)
    with raises(ValueError, "mask", "device1"):
        m(q, k, v, mask=aas.ones((3, 5), dtype=aas.bool, device=dev))
    with raises(ValueError, "params['w_q']", "device1"):
        m.params["w_q"] = aas.asarray(m.params["w_q"], device=dev)
    out, _ = m(q, k, v)
    with raises(ValueError, "dout", "device1"):
        m.backward(aas.asarray(out, device=dev))
    with raises(ValueError, "k", "device1"):
        F.sdpa_forward(*(aas.ones((1, 1, 2, 2), dtype=aas.float64, device=d)
                         for d in (q.device, dev, q.device)))


# --------------------------------------------------------------------------
# check_finite


@pytest.mark.filterwarnings("ignore::RuntimeWarning")
def test_check_finite_names_the_argument(backend, xp):
    m = make_mha(backend)
    hq, hk, hv = host_inputs(2, 3, 5, 8)
    for i, name in enumerate(("query", "key", "value")):
        for bad in (math.nan, math.inf, -math.inf):
            arrays = [hq.copy(), hk.copy(), hv.copy()]
            arrays[i][1, 0, 2] = bad
            args = [from_numpy(a, xp) for a in arrays]
            with raises(ValueError, name, "finite", "1 entries"):
                m(*args, check_finite=True)
            arrays[i][0, 1, 0] = bad
            with raises(ValueError, name, "finite", "2 entries"):  # counted, not only found
                m(*(from_numpy(a, xp) for a in arrays), check_finite=True)
            m(*args)  # opt-in: without the flag nothing reads the data
    q, k, v = (from_numpy(a, xp) for a in (hq, hk, hv))
    mask = np.zeros((3, 5))
    mask[0, 1] = -math.inf  # allowed: a masked entry
    m(q, k, v, mask=from_numpy(mask, xp), check_finite=True)
    m(q, k, v, mask=from_numpy(mask == 0, xp), check_finite=True)  # a bool mask has nothing to check
    for bad in (math.nan, math.inf):
        mask[2, 2] = bad
        with raises(ValueError, "mask", "+inf"):
            m(q, k, v, mask=from_numpy(mask, xp), check_finite=True)
    slopes = np.array([0.5, 0.25])  # (H,)
    m(q, k, v, alibi_slopes=from_numpy(slopes, xp), check_finite=True)
    for bad in (math.nan, math.inf):
        slopes[1] = bad
        with raises(ValueError, "alibi_slopes", "finite", "1 entries"):
            m(q, k, v, alibi_slopes=from_numpy(slopes, xp), check_finite=True)
    w = to_numpy(m.params["w_v"])
    w[0, 0] = math.nan
    m.params["w_v"] = from_numpy(w, xp)
    with raises(ValueError, "params['w_v']", "finite"):
        m(q, k, v, check_finite=True)


def test_a_kv_cache_that_does_not_fit_the_module_is_named_with_what_it_is(backend, xp):
    """Each refusal of a kv_cache names kv_cache, what the module needs and what the cache
    is: the type given, the cache's backend, device, dtype, or its whole layout; the cache and
    the module's state are as before."""
    from npattn import KVCache

    m = MultiHeadAttention(8, 4, n_kv_head=2, dtype="float64", backend=backend, seed=0)  # Dh 2
    x = from_numpy(np.random.default_rng(3).standard_normal((2, 1, 8)), xp)
    other = "array_api_strict" if backend == "numpy" else "numpy"
    cases = [
        ("a cache", TypeError, r"^kv_cache: expected an npattn\.KVCache \(module\.new_cache\(batch_size, "
                               r"capacity\)\), got str$"),
        (KVCache(2, 6, 2, 2, dtype="float32", backend=backend), TypeError,
         r"^kv_cache: expected dtype float64 \(the parameters' dtype\), got float32$"),
        (KVCache(3, 6, 2, 2, dtype="float64", backend=backend), ValueError,
         r"^kv_cache: expected batch_size=2, num_kv_heads=2, head_dim=2, value_dim=2 \(the query's "
         r"batch size and the module's heads\), got KVCache\(batch_size=3, capacity=6, num_kv_heads=2, "
         r"head_dim=2, value_dim=2, .*\)$"),
        (KVCache(2, 6, 4, 2, dtype="float64", backend=backend), ValueError,
         r"^kv_cache: expected batch_size=2, num_kv_heads=2, .* got KVCache\(batch_size=2, capacity=6, "
         r"num_kv_heads=4, "),
        (KVCache(2, 6, 2, 2, 3, dtype="float64", backend=backend), ValueError,
         r"^kv_cache: expected .*value_dim=2 .* got KVCache\(.*, value_dim=3, "),
        (KVCache(2, 6, 2, 2, dtype="float64", backend=other), TypeError,
         rf"^kv_cache: expected a cache of the module's backend '{backend}', got one of '{other}'$"),
    ]
    if backend == "torch":  # a device the parameters are not on
        cases.append((KVCache(2, 6, 2, 2, dtype="float64", backend=backend, device="meta"), ValueError,
                      r"^kv_cache: expected a cache on device device\(type='cpu'\) \(where the "
                      r"parameters live\), got one on device device\(type='meta'\)$"))
    for bad, exc, match in cases:
        lens = None if isinstance(bad, str) else list(bad.cache_seqlens.tolist())
        with pytest.raises(exc, match=match):
            m(x, x, x, kv_cache=bad)
        assert m.cache is None
        if lens is not None:
            assert list(bad.cache_seqlens.tolist()) == lens  # nothing was written


def test_options_a_forward_cannot_combine_are_refused_naming_the_ones_given():
    """Positional options with add_bias_kv (its extra key has no position) name each one given;
    a mask, keep-mask or segment ids with kv_cache name the argument and what was given. Nothing
    is written to the cache."""
    rng = np.random.default_rng(4)
    x = rng.standard_normal((2, 3, 8))
    m = MultiHeadAttention(8, 2, add_bias_kv=True, dtype="float64", seed=0)
    listed = r"\(window, align='bottom_right', alibi_slopes, q_segments, k_segments, kv_cache\)"
    for kw, given in ((dict(window=(1, 0)), "window"),
                      (dict(window=(1, 0), alibi_slopes=np.array([0.5, 0.25])), "window, alibi_slopes"),
                      (dict(alibi_slopes=np.array([0.5, 0.25]), align="bottom_right"),
                       "align='bottom_right', alibi_slopes")):
        first = given.split(",")[0].split("=")[0]
        with pytest.raises(ValueError, match=rf"^{first}: expected none of the positional options {listed} "
                                             rf"with add_bias_kv / add_zero_attn, .*; got {given}$"):
            m(x, x, x, **kw)
    m = MultiHeadAttention(8, 2, dtype="float64", seed=0)
    cache = m.new_cache(2, 6)
    x1 = x[:, :1]
    for name, a in (("mask", np.ones((1, 1), bool)), ("dropout_mask", np.ones((2, 2, 1, 1), bool)),
                    ("q_segments", np.zeros((2, 1), np.int64))):
        kw = {name: a, **({"k_segments": np.zeros((2, 1), np.int64)} if name == "q_segments" else {})}
        with pytest.raises(ValueError, match=rf"^{name}: expected None with kv_cache \(entry b attends its "
                                             r"cache_seqlens\[b\] cached keys and the new ones\), got "
                                             r"numpy\.ndarray$"):
            m(x1, x1, x1, kv_cache=cache, **kw)
    assert cache.cache_seqlens.tolist() == [0, 0]


# --------------------------------------------------------------------------
# backward


def test_backward_before_forward(backend, xp):
    m = make_mha(backend)
    with pytest.raises(RuntimeError, match="forward"):
        m.backward(from_numpy(np.ones((2, 3, 8)), xp))
    # a failed forward does not count as a forward
    with pytest.raises(ValueError):
        m(*inputs(xp, 2, 3, 5, 8, Dk=7))
    with pytest.raises(RuntimeError, match="forward"):
        m.backward(from_numpy(np.ones((2, 3, 8)), xp))


def test_backward_rejects_bad_dout(backend, xp):
    m = make_mha(backend)
    out, _ = m(*inputs(xp, 2, 3, 5, 8))
    d = np.random.default_rng(0).standard_normal((2, 3, 8))
    with raises(ValueError, "dout", "(2, 3, 8)", "(2, 4, 8)"):
        m.backward(from_numpy(np.ones((2, 4, 8)), xp))
    with raises(ValueError, "dout", "(2, 3, 8)", "(3, 8)"):
        m.backward(from_numpy(d[0], xp))
    with raises(TypeError, "dout", "float64", "float32"):
        m.backward(from_numpy(d.astype(np.float32), xp))
    with raises(TypeError, "dout", "list"):
        m.backward(d.tolist())
    # the failed calls changed nothing: backward still works
    dq, dk, dv = m.backward(from_numpy(d, xp))
    assert tuple(dq.shape) == (2, 3, 8) and tuple(dk.shape) == (2, 5, 8)
    assert tuple(out.shape) == (2, 3, 8)


def test_failed_forward_leaves_module_as_it_was(backend, xp):
    """A rejected call keeps the previous cache and does not advance the dropout generator."""
    m = make_mha(backend, dropout=0.3, kdim=6, vdim=4)
    twin = make_mha(backend, dropout=0.3, kdim=6, vdim=4)
    q, k, v = inputs(xp, 2, 3, 5, 8, 6, 4)
    d = from_numpy(np.random.default_rng(3).standard_normal((2, 3, 8)), xp)
    m(q, k, v)
    twin(q, k, v)
    for name, args, kwargs, exc, fragments in _bad_forward_cases(xp):
        with raises(exc, *fragments):
            m(*args, **kwargs)
    g1 = snapshot(zip(("dq", "dk", "dv"), m.backward(d)))
    g2 = snapshot(zip(("dq", "dk", "dv"), twin.backward(d)))
    for name in g1:
        np.testing.assert_array_equal(g1[name], g2[name])
    # the next forward draws the same dropout mask in both
    np.testing.assert_array_equal(to_numpy(m(q, k, v)[0]), to_numpy(twin(q, k, v)[0]))



def test_a_failure_after_the_dropout_draw_leaves_the_generator(monkeypatch):
    """Step 7. fails (memory, say) after step 6. has drawn its dropout mask: the generator is
    put back, so the next forward draws the mask a twin that never failed draws; the cache
    of the previous forward stays the one backward differentiates."""
    m = make_mha("numpy", dropout=0.5, kdim=6, vdim=4)
    twin = make_mha("numpy", dropout=0.5, kdim=6, vdim=4)
    q, k, v = host_inputs(2, 3, 5, 8, 6, 4)
    d = np.random.default_rng(3).standard_normal((2, 3, 8))
    m(q, k, v)
    twin(q, k, v)
    with monkeypatch.context() as patch:
        def out_of_memory(*args, **kwargs):
            raise MemoryError("step 7.")

        patch.setattr(F, "merge_heads_forward", out_of_memory)
        with pytest.raises(MemoryError, match="step 7."):
            m(q, k, v)
    for got, want in zip(m.backward(d), twin.backward(d)):
        np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(m(q, k, v)[0], twin(q, k, v)[0])  # the same next mask



@pytest.mark.parametrize("impl", ["numpy", "reference"])
def test_a_failure_after_step_6_leaves_the_last_forward_differentiable(impl, monkeypatch):
    """Step 7. fails after step 6. has written its probabilities (on NumPy into the arrays
    of the forward before last, lent to the workspace): backward still differentiates the
    last forward, with its own numbers; the arrays of the module's cache are never lent."""
    m = make_mha("numpy", dropout=0.0, kdim=6, vdim=4)
    m.impl = impl
    q, k, v = host_inputs(2, 3, 5, 8, 6, 4)
    q2, k2, v2 = host_inputs(2, 3, 5, 8, 6, 4, seed=2)
    d = np.random.default_rng(3).standard_normal((2, 3, 8))
    m(q2, k2, v2)  # its arrays are lent once the next forward has succeeded
    m(q, k, v)
    want = [g.copy() for g in m.backward(d)]
    with monkeypatch.context() as patch:
        def out_of_memory(*args, **kwargs):
            raise MemoryError("step 7.")

        patch.setattr(F, "merge_heads_forward", out_of_memory)
        for _ in range(2):
            with pytest.raises(MemoryError, match="step 7."):
                m(q2, k2, v2)
    for got, w in zip(m.backward(d), want):
        np.testing.assert_array_equal(got, w)


# --------------------------------------------------------------------------
# parameters


def test_param_assignment_is_checked(backend, xp):
    m = make_mha(backend, kdim=6)
    before = snapshot(m.params)
    good = np.random.default_rng(0).standard_normal((8, 6))
    with raises(ValueError, "params['w_k']", "(8, 6)", "(6, 8)"):
        m.params["w_k"] = from_numpy(good.T, xp)
    with raises(TypeError, "params['w_k']", "float64", "float32"):
        m.params["w_k"] = from_numpy(good.astype(np.float32), xp)
    with raises(TypeError, "params['w_k']", "list"):
        m.params["w_k"] = good.tolist()
    with raises(ValueError, "params", "w_x"):
        m.params["w_x"] = from_numpy(good, xp)
    names = ", ".join(m.params)
    for remove, call in ((lambda: m.params.__delitem__("w_q"), "del params['w_q']"),
                         (lambda: m.params.pop("b_q"), "params.pop('b_q')"),
                         (lambda: m.params.pop("b_q", None), "params.pop('b_q', None)"),
                         (m.params.clear, "params.clear()"), (m.params.popitem, "params.popitem()")):
        with pytest.raises(TypeError, match=rf"^params: expected every parameter to stay \(the names are "
                                            rf"fixed: {names}\), got {re.escape(call)}; parameters cannot "
                                            rf"be removed, assign a new array instead$"):
            remove()
    assert list(m.params) == ["w_q", "w_k", "w_v", "w_o", "b_q", "b_k", "b_v", "b_o"]
    # update checks every value before assigning any
    with raises(ValueError, "params['b_o']", "(8,)", "(7,)"):
        m.params.update(w_k=from_numpy(good, xp), b_o=from_numpy(np.zeros(7), xp))
    with raises(ValueError, "params['b_o']", "(8,)", "(7,)"):  # so does |=
        m.params |= {"w_k": from_numpy(good, xp), "b_o": from_numpy(np.zeros(7), xp)}
    with raises(ValueError, "params", "w_x"):  # the names are fixed for setdefault too
        m.params.setdefault("w_x", from_numpy(good, xp))
    assert "w_x" not in m.params
    with raises(ValueError, "params: expected exactly the names ['b_k', ", "got ['w_q']"):
        m.params = {"w_q": m.params["w_q"]}
    with raises(TypeError, "params", "list"):
        m.params = [1, 2]
    assert isinstance(m.params, dict)
    for name, value in snapshot(m.params).items():
        np.testing.assert_array_equal(value, before[name], err_msg=name)

    m.params["w_k"] = from_numpy(good, xp)  # a valid assignment takes effect
    np.testing.assert_array_equal(to_numpy(m.params["w_k"]), good)
    new = dict(m.params)
    new["b_q"] = from_numpy(np.full(8, 0.5), xp)
    m.params = new
    np.testing.assert_array_equal(to_numpy(m.params["b_q"]), np.full(8, 0.5))
    b_o = from_numpy(np.full(8, -0.5), xp)
    m.params |= {"b_o": b_o}  # a valid |= takes effect and leaves the checked dict in place
    assert isinstance(m.params, ParameterDict) and m.params["b_o"] is b_o
    for default in (None, b_o):  # setdefault of a name there gives its array, as dict's does
        assert m.params.setdefault("w_k", default) is m.params["w_k"]


# --------------------------------------------------------------------------
# functional.sdpa_forward


def test_sdpa_rejects(backend, xp):
    rng = np.random.default_rng(0)

    def a(*shape, dtype=np.float64):
        return from_numpy(rng.standard_normal(shape).astype(dtype), xp)

    q, k, v = a(2, 2, 3, 4), a(2, 2, 5, 4), a(2, 2, 5, 6)
    F.sdpa_forward(q, k, v)  # valid, and v may have its own width
    cases = [
        ((q, a(2, 2, 5, 4, dtype=np.float32), v), {}, TypeError, ("k", "float64", "float32")),
        ((q, a(3, 2, 5, 4), a(3, 2, 5, 6)), {}, ValueError, ("k", "leading axes", "(3, 2, 5, 4)")),
        ((q, a(2, 2, 5, 3), v), {}, ValueError, ("k", "last axis 4", "(2, 2, 5, 3)")),
        ((q, k, a(2, 2, 4, 6)), {}, ValueError, ("v", "length 5", "(2, 2, 4, 6)")),
        ((q, k, a(3, 5, 6)), {}, ValueError, ("v", "(3, 5, 6)")),  # (3,) does not broadcast with (2, 2)
        ((a(4), a(4), a(4)), {}, ValueError, ("q", "at least 2 axes", "(4,)")),
        ((from_numpy(np.ones((2, 3), dtype=np.int64), xp),) * 3, {}, TypeError, ("q", "floating", "int64")),
        (([[1.0]], k, v), {}, TypeError, ("q", "list")),
        ((q, k, v), dict(mask=from_numpy(np.ones((3, 5), dtype=np.int32), xp)), TypeError, ("mask", "int32")),
        ((q, k, v), dict(mask=from_numpy(np.ones((3, 4), dtype=bool), xp)), ValueError, ("mask", "(3, 4)")),
        ((q, k, v), dict(mask=from_numpy(np.ones((3, 2, 3, 5), dtype=bool), xp)), ValueError,
         ("mask", "(3, 2, 3, 5)")),
        ((q, k, v), dict(mask=a(3, 5, dtype=np.float32)), TypeError, ("mask", "float64", "float32")),
        ((q, k, v), dict(dropout_mask=a(3, 5)), TypeError, ("dropout_mask", "bool", "float64")),
        ((q, k, v), dict(dropout_mask=from_numpy(np.ones((2, 5), dtype=bool), xp)), ValueError,
         ("dropout_mask", "(2, 5)")),
        ((q, k, v), dict(dropout_p=1.0), ValueError, ("dropout_p", "[0, 1)", "1.0")),
        ((q, k, v), dict(dropout_p=-0.5), ValueError, ("dropout_p", "-0.5")),
        ((q, k, v), dict(dropout_p=None), TypeError, ("dropout_p", "None")),
        ((q, k, v), dict(scale=math.nan), ValueError, ("scale", "finite", "nan")),
        ((q, k, v), dict(scale="1"), TypeError, ("scale", "str")),
        ((q, k, v), dict(is_causal=1), TypeError, ("is_causal", "bool", "int")),
        ((q, k, a(2, 2, 5, 6, dtype=np.float32)), {}, TypeError, ("v", "float64", "float32")),
        ((q, a(4), v), {}, ValueError, ("k", "at least 2 axes", "(4,)")),
        ((q, k, a(6)), {}, ValueError, ("v", "at least 2 axes", "(6,)")),
        # the seed is checked even where no dropout draws from it
        ((q, k, v), dict(rng=-1), ValueError, ("rng", "non-negative", "-1")),
        ((q, k, v), dict(rng="seed"), TypeError, ("rng", "str")),
        # a mask may not add axes to the scores (2, 2, 3, 5), not even one of length 1 ...
        ((q, k, v), dict(mask=from_numpy(np.ones((1, 2, 2, 3, 5), dtype=bool), xp)), ValueError,
         ("mask", "(2, 2, 3, 5)", "(1, 2, 2, 3, 5)")),
        # ... nor grow an axis of length 1 of them: the scores of one head are (2, 1, 3, 5)
        ((a(2, 1, 3, 4), a(2, 1, 5, 4), a(2, 1, 5, 6)),
         dict(mask=from_numpy(np.ones((2, 2, 3, 5), dtype=bool), xp)), ValueError,
         ("mask", "(2, 1, 3, 5)", "(2, 2, 3, 5)")),
    ]
    for args, kwargs, exc, fragments in cases:
        with raises(exc, *fragments):
            F.sdpa_forward(*args, **kwargs)
    with pytest.raises(ValueError, match=r"^q: expected shape \(\.\.\., H, L, Dh\), with a head axis "
                                         r"for enable_gqa, got shape \(3, 4\)$"):
        F.sdpa_forward(a(3, 4), a(5, 4), a(5, 6), enable_gqa=True)
    # v has the heads of k, and k has at least one head, under enable_gqa
    with pytest.raises(ValueError, match=r"^v: expected 2 heads like k with enable_gqa, got shape "
                                         r"\(1, 1, 5, 6\)$"):
        F.sdpa_forward(a(1, 4, 3, 4), a(1, 2, 5, 4), a(1, 1, 5, 6), enable_gqa=True)
    with pytest.raises(ValueError, match=r"^k: with enable_gqa the query heads Hq=4 must be a "
                                         r"multiple of the key/value heads, got Hkv=0$"):
        F.sdpa_forward(a(1, 4, 3, 4), a(1, 0, 5, 4), a(1, 0, 5, 6), enable_gqa=True)


def test_a_mask_takes_the_batch_that_only_k_and_v_carry():
    """q (1, 2, 3, 4) against k, v (2, 2, 5, .): the scores are (2, 2, 3, 5) and so may
    a mask be, one per batch element (the float64 formula of reliability_helpers)."""
    from reliability_helpers import ref_sdpa

    rng = np.random.default_rng(3)
    q = rng.standard_normal((1, 2, 3, 4))
    k, v = rng.standard_normal((2, 2, 5, 4)), rng.standard_normal((2, 2, 5, 6))
    allowed = rng.random((2, 2, 3, 5)) < 0.6
    allowed[..., 0] = True
    out, _ = F.sdpa_forward(q, k, v, mask=allowed)
    np.testing.assert_allclose(out, ref_sdpa(q, k, v, allowed=allowed)[0], rtol=1e-12, atol=1e-12)


def test_a_grouped_query_mask_takes_the_batch_that_only_k_and_v_carry():
    """With enable_gqa, q (1, 4, 3, 4) against k, v (2, 2, 5, .): the scores are
    (2, 4, 3, 5), and a mask may hold one per batch element; each kv head serves two
    query heads in turn (k repeated along the heads, as torch's repeat_interleave)."""
    from reliability_helpers import ref_sdpa

    rng = np.random.default_rng(4)
    q = rng.standard_normal((1, 4, 3, 4))
    k, v = rng.standard_normal((2, 2, 5, 4)), rng.standard_normal((2, 2, 5, 6))
    allowed = rng.random((2, 1, 3, 5)) < 0.6
    allowed[..., 0] = True
    out, _ = F.sdpa_forward(q, k, v, mask=allowed, enable_gqa=True)
    want = ref_sdpa(q, np.repeat(k, 2, axis=1), np.repeat(v, 2, axis=1), allowed=allowed)[0]
    assert out.shape == (2, 4, 3, 6)
    np.testing.assert_allclose(out, want, rtol=1e-12, atol=1e-12)


def test_an_int_softcap_is_the_float_of_it():
    """softcap takes any real number > 0, as scale does: 2 caps as 2.0 does."""
    rng = np.random.default_rng(5)
    q, k, v = (rng.standard_normal(s) * 3.0 for s in ((1, 2, 3, 4), (1, 2, 5, 4), (1, 2, 5, 6)))
    out_int, _ = F.sdpa_forward(q, k, v, softcap=2)
    out_float, _ = F.sdpa_forward(q, k, v, softcap=2.0)
    np.testing.assert_array_equal(out_int, out_float)


def test_alibi_slopes_per_batch_follow_the_axis_before_the_heads():
    """q (3, 2, 4, Lq, Dh): the scores lead (3, 2, 4) ends in B=2, H=4, so per-batch slopes
    are (2, 4), each slice of the first axis taking them as a 4-D call does."""
    rng = np.random.default_rng(4)
    q, k, v = (rng.standard_normal((3, 2, 4, 5 + i, 8)) for i in (0, 1, 1))
    slopes = rng.uniform(0.1, 1.0, (2, 4))
    out, _ = F.sdpa_forward(q, k, v, alibi_slopes=slopes)
    for i in range(3):
        np.testing.assert_allclose(out[i], F.sdpa_forward(q[i], k[i], v[i], alibi_slopes=slopes)[0],
                                   rtol=1e-13, atol=1e-13)
    with raises(ValueError, "alibi_slopes", "(4,) or (2, 4)", "(3, 4)"):
        F.sdpa_forward(q, k, v, alibi_slopes=rng.uniform(0.1, 1.0, (3, 4)))


@pytest.mark.parametrize(
    "kwargs, exc, fragments",
    [
        (dict(qdim=0), ValueError, ("qdim", "positive int")),
        (dict(qdim=2.5), TypeError, ("qdim", "float")),
        (dict(n_kv_head=3), ValueError, ("n_kv_head", "divisor of n_head=4", "3")),
        (dict(n_kv_head=True), TypeError, ("n_kv_head", "bool")),
        (dict(add_bias_kv="no"), TypeError, ("add_bias_kv", "bool", "str")),
        (dict(qkv_bias=1), TypeError, ("qkv_bias", "bool", "int")),
        (dict(qdims=4), TypeError, ("check_module_args", "unexpected argument 'qdims'")),
    ],
)
def test_layer_shape_arguments(kwargs, exc, fragments):
    """The optional layer-shape arguments a module may pass on (qdim, n_kv_head, flags)."""
    from npattn.backend import resolve_backend
    from npattn.module import check_module_args

    args = dict(d_model=8, n_head=4, dropout=0.0, bias=True, kdim=None, vdim=None,
                dtype="float32", seed=None)
    assert check_module_args(resolve_backend("numpy"), **args, qdim=None, n_kv_head=2,
                             add_bias_kv=True, qkv_bias=None) == "float32"
    with raises(exc, *fragments):
        check_module_args(resolve_backend("numpy"), **args, **kwargs)


def test_params_snapshot_and_restore(backend, xp):
    """copy.deepcopy(params) is a plain dict of copies; assigning it back restores the module."""
    import copy

    m = make_mha(backend)
    q, k, v = inputs(xp, 2, 3, 5, 8)
    saved = copy.deepcopy(m.params)
    assert type(saved) is dict
    out = to_numpy(m(q, k, v)[0])
    m.params["w_o"] = from_numpy(np.zeros((8, 8)), xp)
    assert not np.array_equal(to_numpy(m(q, k, v)[0]), out)
    m.params = saved
    np.testing.assert_array_equal(to_numpy(m(q, k, v)[0]), out)


# --------------------------------------------------------------------------
# inputs the validation used to miss (issue 13, item 8): NumPy-specific
# arrays, empty axes, huge ints, non-bool flags, and the functional primitives


def _big_endian(a):
    return a.astype(a.dtype.newbyteorder(">"))


def _np_inputs():
    return host_inputs(2, 3, 5, 8)


def _module_call(arg):
    """A forward of a float64 module with one argument replaced (via ``arg(q, k, v) -> kwargs``)."""
    def run():
        m = make_mha("numpy")
        q, k, v = _np_inputs()
        call = dict(query=q, key=k, value=v)
        call.update(arg(q, k, v))
        m(call.pop("query"), call.pop("key"), call.pop("value"), **call)
    return run


def _set_param():
    m = make_mha("numpy")
    m.params["w_q"] = _big_endian(np.zeros((8, 8)))


def _sdpa(**replace):
    def run():
        rng = np.random.default_rng(0)
        args = dict(q=rng.standard_normal((2, 2, 3, 4)), k=rng.standard_normal((2, 2, 5, 4)),
                    v=rng.standard_normal((2, 2, 5, 6)))
        args.update(replace)
        F.sdpa_forward(args.pop("q"), args.pop("k"), args.pop("v"), **args)
    return run


@pytest.mark.parametrize(
    "call, exc, fragments",
    [
        (_module_call(lambda q, k, v: dict(query=_big_endian(q))), TypeError,
         ("query", "byte order", "float64")),
        (_module_call(lambda q, k, v: dict(mask=_big_endian(np.zeros((3, 5))))), TypeError,
         ("mask", "byte order")),
        (_set_param, TypeError, ("params['w_q']", "byte order")),
        (_sdpa(k=_big_endian(np.ones((2, 2, 5, 4)))), TypeError, ("k", "byte order")),
        (_module_call(lambda q, k, v: dict(query=np.ma.array(q))), TypeError,
         ("query", "MaskedArray")),
        (_module_call(lambda q, k, v: dict(mask=np.ma.array(np.ones((3, 5), bool)))), TypeError,
         ("mask", "MaskedArray")),
        (_sdpa(q=np.ma.array(np.ones((2, 2, 3, 4)), mask=np.zeros((2, 2, 3, 4), bool))), TypeError,
         ("q", "MaskedArray")),
        (lambda: _sdpa(q=np.matrix(np.ones((3, 4))))(), TypeError,
         ("q", "plain numpy.ndarray", "numpy.matrix", "np.asarray")),
        (_module_call(lambda q, k, v: dict(mask=np.matrix(np.ones((3, 5), bool)))), TypeError,
         ("mask", "plain numpy.ndarray", "numpy.matrix")),
        (_sdpa(q=np.ones((2, 2, 3, 0)), k=np.ones((2, 2, 5, 0))), ValueError,
         ("q", "Dh (axis -1)", "(2, 2, 3, 0)")),
        (_sdpa(q=np.ones((2, 2, 0, 4))), ValueError, ("q", "Lq (axis -2)", "(2, 2, 0, 4)")),
        (_sdpa(k=np.ones((2, 2, 0, 4)), v=np.ones((2, 2, 0, 6))), ValueError,
         ("k", "Lk (axis -2)", "(2, 2, 0, 4)")),
        (_sdpa(scale=2**1100), ValueError, ("scale", "finite", "int too large for a float (1101 bits)")),
        (_sdpa(dropout_p=2**1100), ValueError, ("dropout_p", "[0, 1)")),
        (_sdpa(enable_gqa=None), TypeError, ("enable_gqa", "bool")),
    ],
    ids=["big-endian query", "big-endian mask", "big-endian param", "big-endian k",
         "masked query", "masked mask", "masked q", "matrix q", "matrix mask", "Dh=0", "Lq=0", "Lk=0",
         "scale=2**1100", "dropout_p=2**1100", "enable_gqa=None"],
)
@pytest.mark.filterwarnings("ignore:the matrix subclass:PendingDeprecationWarning")
def test_numpy_special_arrays_and_empty_axes_are_rejected(call, exc, fragments):
    with raises(exc, *fragments):
        call()


@pytest.mark.parametrize("impl", ["reference", "numpy", "blocked", "auto"])
@pytest.mark.parametrize(
    "enable_gqa, Hkv",
    [(np.ones((2, 2), bool), 4), (np.array([True, True]), 2), (None, 2), (0, 2)],
    ids=["2x2 array, Hkv = Hq", "2-array, Hkv < Hq", "None, Hkv < Hq", "0, Hkv < Hq"],
)
def test_enable_gqa_is_checked_before_it_picks_the_rule_for_the_heads(impl, enable_gqa, Hkv):
    """enable_gqa decides whether the head axes of k and v may be fewer than q's, so it is
    checked before that rule is applied: an array of two entries failed with NumPy's "truth
    value ... is ambiguous", and None or 0 with Hkv < Hq blamed k's shape."""
    from npattn import attention as A

    rng = np.random.default_rng(0)
    q = rng.standard_normal((1, 4, 3, 4))  # Hq = 4
    k, v = rng.standard_normal((1, Hkv, 5, 4)), rng.standard_normal((1, Hkv, 5, 4))
    with raises(TypeError, "enable_gqa", "a bool"):
        A.sdpa_forward(q, k, v, enable_gqa=enable_gqa, impl=impl)


@pytest.mark.parametrize("impl", ["reference", "numpy", "blocked", "auto"])
@pytest.mark.parametrize(
    "shapes, fragments",
    [
        (((1, 1, 3, 0), (1, 1, 5, 0), (1, 1, 5, 2)), ("q", "Dh")),
        (((1, 1, 0, 2), (1, 1, 5, 2), (1, 1, 5, 2)), ("q", "Lq")),
        (((1, 1, 3, 2), (1, 1, 0, 2), (1, 1, 0, 2)), ("k", "Lk")),
    ],
    ids=["Dh=0", "Lq=0", "Lk=0"],
)
def test_dispatcher_rejects_empty_axes_on_every_impl(impl, shapes, fragments):
    from npattn import attention as A

    q, k, v = (np.ones(s) for s in shapes)
    with raises(ValueError, *fragments):
        A.sdpa_forward(q, k, v, impl=impl)


def test_a_big_endian_array_converted_to_native_works():
    q, k, v = _np_inputs()
    m = make_mha("numpy")
    native = _big_endian(q).astype(_big_endian(q).dtype.newbyteorder("="))
    np.testing.assert_array_equal(m(native, k, v)[0], m(q, k, v)[0])


def test_sdpa_errors_do_not_speak_of_a_module():
    xps = pytest.importorskip("array_api_strict")
    q = np.ones((1, 1, 2, 2))
    with pytest.raises(TypeError) as info:
        F.sdpa_forward(q, xps.ones((1, 1, 2, 2), dtype=xps.float64), q)
    message = str(info.value)
    assert "k:" in message and "that of q" in message, message
    assert "module" not in message, message
    with pytest.raises(TypeError) as info:
        F.sdpa_forward(q, q, q, mask=xps.ones((2, 2), dtype=xps.bool))
    assert "mask:" in str(info.value) and "module" not in str(info.value)


@pytest.mark.parametrize("dtype", ["int64", "object", "str"])
def test_the_dtype_hint_never_suggests_a_non_floating_module_dtype(dtype):
    m = make_mha("numpy")
    q, k, v = _np_inputs()
    bad = q.astype(dtype)
    with raises(TypeError, "query", "float64") as info:
        m(bad, k, v)
    assert "build the module with" not in str(info.value), str(info.value)
    assert "cast the input to float64" in str(info.value)


def test_the_dtype_hint_suggests_no_module_dtype_the_backend_lacks():
    """A bfloat16 NumPy array (ml_dtypes) is floating, but a NumPy module cannot be bfloat16:
    the hint says to cast the input, not to build a module of that dtype."""
    ml_dtypes = pytest.importorskip("ml_dtypes")
    m = make_mha("numpy")
    q, k, v = _np_inputs()
    with raises(TypeError, "query", "float64", "bfloat16") as info:
        m(q.astype(ml_dtypes.bfloat16), k, v)
    assert "build the module with" not in str(info.value), str(info.value)
    assert "cast the input to float64" in str(info.value)


def test_the_dtype_hint_suggests_a_floating_module_dtype():
    m = make_mha("numpy")
    q, k, v = _np_inputs()
    with raises(TypeError, "query", "dtype='float32'"):
        m(q.astype(np.float32), k, v)


@pytest.mark.parametrize(
    "kwargs, fragments",
    [
        (dict(dtype=None), ("dtype", "None")),
        (dict(add_bias_kv=None), ("add_bias_kv", "bool", "None")),
        (dict(add_zero_attn=None), ("add_zero_attn", "bool", "None")),
    ],
)
def test_none_is_not_a_default_where_the_signature_has_none(kwargs, fragments):
    with raises(TypeError, *fragments):
        MultiHeadAttention(8, 2, **kwargs)


@pytest.mark.parametrize("mode", ["no", 0.0, None, 1, "True"])
def test_train_takes_a_bool_only(mode):
    m = MultiHeadAttention(8, 2, dropout=0.1)
    m.eval()
    with raises(TypeError, "mode", "bool"):
        m.train(mode)
    assert m.training is False  # unchanged
    assert m.train(np.True_).training is True
    assert m.train(False).training is False


def test_numpy_integer_sizes_are_accepted_everywhere():
    from npattn import attention as A
    from npattn import masks

    n = np.int64
    np.testing.assert_array_equal(masks.causal(n(3), n(4)), masks.causal(3, 4))
    np.testing.assert_array_equal(masks.padding([n(1), n(2)], n(3)), masks.padding([1, 2], 3))
    np.testing.assert_array_equal(masks.padding(np.array([1, 2]), n(3)), masks.padding([1, 2], 3))
    q = np.random.default_rng(0).standard_normal((1, 1, 5, 2))
    out, _ = A.sdpa_forward(q, q, q, impl="blocked", block_q=n(2), block_k=np.int32(3))
    np.testing.assert_allclose(out, A.sdpa_forward(q, q, q, impl="reference")[0], rtol=1e-12)
    m = MultiHeadAttention(n(8), n(2), block_q=n(2), kdim=n(8), impl="blocked")
    x = np.ones((1, 3, 8), np.float32)
    assert m(x, x, x)[0].shape == (1, 3, 8)


@pytest.mark.parametrize(
    "call, exc, fragments",
    [
        (lambda: __import__("npattn").masks.causal(2.0, 3), TypeError, ("Lq", "int", "float")),
        (lambda: __import__("npattn").masks.causal(2, True), TypeError, ("Lk", "int", "bool")),
        (lambda: __import__("npattn").masks.padding([1.5], 3), TypeError, ("lengths", "ints")),
    ],
)
def test_mask_builders_reject_non_int_sizes(call, exc, fragments):
    with raises(exc, *fragments):
        call()


# the functional primitives: each public pair checks its arguments


def _x(*shape, dtype=np.float64, seed=0):
    return np.random.default_rng(seed).standard_normal(shape).astype(dtype)


def _cache(fwd):
    return fwd()[1]


FUNCTIONAL_CASES = [
    # linear
    ("linear x list", lambda: F.linear_forward([[1.0]], _x(2, 1)), TypeError, ("x", "list")),
    ("linear x int", lambda: F.linear_forward(np.ones((2, 3), np.int64), _x(4, 3)), TypeError,
     ("x", "floating", "int64")),
    ("linear x complex", lambda: F.linear_forward(np.ones((2, 3), np.complex128), _x(4, 3)), TypeError,
     ("x", "real floating", "complex128")),
    ("linear w dtype", lambda: F.linear_forward(_x(2, 3), _x(4, 3, dtype=np.float32)), TypeError,
     ("w", "float64", "float32")),
    ("linear w 1-D", lambda: F.linear_forward(_x(2, 3), _x(3)), ValueError, ("w", "2-D", "(3,)")),
    ("linear x width", lambda: F.linear_forward(_x(2, 3), _x(4, 5)), ValueError,
     ("x", "(..., 5)", "(2, 3)")),
    ("linear b shape", lambda: F.linear_forward(_x(2, 3), _x(4, 3), _x(3)), ValueError,
     ("b", "(4,)", "(3,)")),
    ("linear dy shape", lambda: F.linear_backward(_x(2, 5), _cache(lambda: F.linear_forward(_x(2, 3), _x(4, 3)))),
     ValueError, ("dy", "(2, 4)", "(2, 5)")),
    ("linear dy dtype", lambda: F.linear_backward(_x(2, 4, dtype=np.float32),
                                                  _cache(lambda: F.linear_forward(_x(2, 3), _x(4, 3)))),
     TypeError, ("dy", "float64", "float32")),
    ("linear cache", lambda: F.linear_backward(_x(2, 4), None), TypeError, ("cache", "LinearCache", "None")),
    # heads
    ("split 2-D", lambda: F.split_heads_forward(_x(3, 4), 2), ValueError, ("x", "3-D", "(3, 4)")),
    ("split n_head", lambda: F.split_heads_forward(_x(1, 3, 4), 3), ValueError, ("n_head", "divisor", "3")),
    ("split n_head 0", lambda: F.split_heads_forward(_x(1, 3, 4), 0), ValueError, ("n_head", "positive")),
    ("split n_head float", lambda: F.split_heads_forward(_x(1, 3, 4), 2.0), TypeError, ("n_head", "float")),
    ("split dout", lambda: F.split_heads_backward(_x(1, 3, 2, 2), F.HeadsCache(2)), ValueError,
     ("dout", "(B, 2, L, Dh)", "(1, 3, 2, 2)")),
    ("merge 3-D", lambda: F.merge_heads_forward(_x(1, 3, 4)), ValueError, ("x", "4-D", "(1, 3, 4)")),
    ("merge dout", lambda: F.merge_heads_backward(_x(1, 3, 5), F.HeadsCache(2)), ValueError,
     ("dout", "2 heads", "(1, 3, 5)")),
    ("merge cache", lambda: F.merge_heads_backward(_x(1, 3, 4), 2), TypeError, ("cache", "HeadsCache", "int")),
    # softmax
    ("softmax int mask", lambda: F.masked_softmax_forward(_x(2, 3), np.ones((2, 3), np.int64)), TypeError,
     ("mask", "bool", "int64", "ambiguous")),
    ("softmax mask dtype", lambda: F.masked_softmax_forward(_x(2, 3), _x(2, 3, dtype=np.float32)), TypeError,
     ("mask", "float64", "float32")),
    ("softmax mask shape", lambda: F.masked_softmax_forward(_x(2, 3), np.ones((2, 4), bool)), ValueError,
     ("mask", "(2, 4)")),
    ("softmax x int", lambda: F.masked_softmax_forward(np.ones((2, 3), np.int32)), TypeError,
     ("x", "floating", "int32")),
    ("softmax sink shape", lambda: F.masked_softmax_forward(_x(2, 3), sink=_x(2, 3)), ValueError,
     ("sink", "(2, 1)", "(2, 3)")),
    ("softmax sink dtype", lambda: F.masked_softmax_forward(_x(2, 3), sink=_x(2, 1, dtype=np.float32)),
     TypeError, ("sink", "float64", "float32")),
    ("softmax dlse shape", lambda: F.masked_softmax_backward(_x(2, 3), _cache(lambda: F.masked_softmax_forward(_x(2, 3))),
                                                             dlse=_x(2, 3)),
     ValueError, ("dlse", "(2, 1)", "(2, 3)")),
    ("softmax dp shape", lambda: F.masked_softmax_backward(_x(2, 4), _cache(lambda: F.masked_softmax_forward(_x(2, 3)))),
     ValueError, ("dp", "(2, 3)", "(2, 4)")),
    # dropout
    ("dropout p=1", lambda: F.dropout_forward(_x(2, 3), 1), ValueError, ("p", "[0, 1)", "1")),
    ("dropout p=1.5", lambda: F.dropout_forward(_x(2, 3), 1.5), ValueError, ("p", "[0, 1)", "1.5")),
    ("dropout p str", lambda: F.dropout_forward(_x(2, 3), "0.1"), TypeError, ("p", "str")),
    # with a keep-mask nothing is drawn, so no draw checks p for the forward
    ("dropout p=1 with a mask", lambda: F.dropout_forward(_x(2, 3), 1.0, mask=np.ones((2, 3), bool)),
     ValueError, ("p", "[0, 1)", "1.0")),
    ("dropout p<0 with a mask", lambda: F.dropout_forward(_x(2, 3), -0.5, mask=np.ones((2, 3), bool)),
     ValueError, ("p", "[0, 1)", "-0.5")),
    ("dropout p str with a mask", lambda: F.dropout_forward(_x(2, 3), "0.1", mask=np.ones((2, 3), bool)),
     TypeError, ("p", "str")),
    ("dropout float mask", lambda: F.dropout_forward(_x(2, 3), 0.5, mask=_x(2, 3)), TypeError,
     ("mask", "bool", "float64")),
    ("dropout mask shape", lambda: F.dropout_forward(_x(2, 3), 0.5, mask=np.ones((3,), bool).reshape(3, 1)),
     ValueError, ("mask", "(3, 1)")),
    ("dropout rng", lambda: F.dropout_forward(_x(2, 3), 0.5, rng="seed"), TypeError, ("rng", "str")),
    ("dropout rng < 0", lambda: F.dropout_forward(_x(2, 3), 0.5, rng=-1), ValueError, ("rng", "-1")),
    ("dropout rng float", lambda: F.dropout_forward(_x(2, 3), 0.5, rng=1.5), TypeError,
     ("rng", "seed", "float 1.5")),
    ("dropout cache", lambda: F.dropout_backward(_x(2, 3), F.SoftmaxCache(None, None)), TypeError,
     ("cache", "DropoutCache", "SoftmaxCache")),
    ("dropout keep of a cache made by hand", lambda: F.dropout_backward(_x(3, 1), F.DropoutCache(np.ones((3, 4), bool), 2.0)),
     ValueError, ("cache.keep", "(3, 1)", "(3, 4)")),
    ("dropout dy shape", lambda: F.dropout_backward(_x(2, 2), _cache(lambda: F.dropout_forward(_x(2, 3), 0.5, rng=0))),
     ValueError, ("dy", "(2, 3)", "(2, 2)")),
    # the upstream gradient against the forward: not broadcast, not of another dtype or library
    ("dropout dy broadcast", lambda: F.dropout_backward(_x(4, 2, 3), _cache(lambda: F.dropout_forward(_x(2, 3), 0.5, rng=0))),
     ValueError, ("dy", "expected shape (2, 3)", "(4, 2, 3)")),
    ("dropout dy dtype", lambda: F.dropout_backward(_x(2, 3).astype(np.float32), _cache(lambda: F.dropout_forward(_x(2, 3), 0.5, rng=0))),
     TypeError, ("dy", "float64", "float32")),
    ("dropout p=0 dy dtype", lambda: F.dropout_backward(_x(2, 3).astype(np.float32), _cache(lambda: F.dropout_forward(_x(2, 3), 0.0))),
     TypeError, ("dy", "float64", "float32")),
    ("split dout batch", lambda: F.split_heads_backward(_x(5, 2, 3, 2), _cache(lambda: F.split_heads_forward(_x(1, 3, 4), 2))),
     ValueError, ("dout", "(1, 2, 3, 2)", "(5, 2, 3, 2)")),
    ("split dout dtype", lambda: F.split_heads_backward(_x(1, 2, 3, 2).astype(np.int64), _cache(lambda: F.split_heads_forward(_x(1, 3, 4), 2))),
     TypeError, ("dout", "float64", "int64")),
    ("merge dout length", lambda: F.merge_heads_backward(_x(1, 7, 4), _cache(lambda: F.merge_heads_forward(_x(1, 2, 3, 2)))),
     ValueError, ("dout", "(1, 3, 4)", "(1, 7, 4)")),
    ("append dy shape", lambda: F.append_kv_backward(_x(3, 5, 4), _cache(lambda: F.append_kv_forward(_x(1, 3, 4), _x(4)))),
     ValueError, ("dy", "(1, 4, 4)", "(3, 5, 4)")),
    # sdpa backward
    ("sdpa dout shape", lambda: F.sdpa_backward(_x(1, 1, 3, 4), _cache(lambda: F.sdpa_forward(_x(1, 1, 3, 2), _x(1, 1, 5, 2), _x(1, 1, 5, 6)))),
     ValueError, ("dout", "(1, 1, 3, 6)", "(1, 1, 3, 4)")),
    ("sdpa dout dtype", lambda: F.sdpa_backward(_x(1, 1, 3, 2, dtype=np.float32), _cache(lambda: F.sdpa_forward(_x(1, 1, 3, 2), _x(1, 1, 5, 2), _x(1, 1, 5, 2)))),
     TypeError, ("dout", "float64", "float32")),
    ("sdpa cache", lambda: F.sdpa_backward(_x(1, 1, 3, 2), {}), TypeError, ("cache", "SDPACache", "dict")),
    # extra keys
    ("append bias shape", lambda: F.append_kv_forward(_x(1, 3, 4), _x(3)), ValueError, ("bias", "(4,)", "(3,)")),
    ("append zero_attn", lambda: F.append_kv_forward(_x(1, 3, 4), add_zero_attn=1), TypeError,
     ("add_zero_attn", "bool", "int")),
    ("append x 1-D", lambda: F.append_kv_forward(_x(4)), ValueError, ("x", "2 axes", "(4,)")),
    ("append dy short", lambda: F.append_kv_backward(_x(1, 3, 4), F.AppendKVCache(3, True)), ValueError,
     ("dy", ">= 4", "(1, 3, 4)")),
    ("append dy 1-D", lambda: F.append_kv_backward(_x(4), F.AppendKVCache(3, False)), ValueError,
     ("dy", "(..., Lk + n, D)", "(4,)")),
    ("pad Lk 0", lambda: F.pad_mask_forward(None, 2, 0, 1), ValueError, ("Lk", ">= 1", "0")),
    ("pad Lq 0", lambda: F.pad_mask_forward(None, 0, 3, 1, is_causal=True, like=_x(1, 1, 2)), ValueError,
     ("Lq", ">= 1", "0")),
    ("pad mask 0-d", lambda: F.pad_mask_forward(np.array(True), 3, 5, 1), ValueError,
     ("mask", "(..., Lk)", "()")),
    ("pad n_extra float", lambda: F.pad_mask_forward(np.ones((2, 3), bool), 2, 3, 1.0), TypeError,
     ("n_extra", "int", "float")),
    ("pad int mask", lambda: F.pad_mask_forward(np.ones((2, 3), np.int8), 2, 3, 1), TypeError,
     ("mask", "bool", "int8")),
    ("pad mask shape", lambda: F.pad_mask_forward(np.ones((2, 4), bool), 2, 3, 1), ValueError,
     ("mask", "(2, 4)")),
    ("pad is_causal", lambda: F.pad_mask_forward(np.ones((2, 3), bool), 2, 3, 1, is_causal="yes"), TypeError,
     ("is_causal", "bool", "str")),
    ("pad dm cache", lambda: F.pad_mask_backward(_x(2, 4), None), TypeError, ("cache", "PadMaskCache", "None")),
    ("pad dm narrower than the given keys",
     lambda: F.pad_mask_backward(_x(3, 3), _cache(lambda: F.pad_mask_forward(_x(3, 4), 3, 4, 2))),
     ValueError, ("dm", ">= 4", "(3, 3)")),
]


@pytest.mark.parametrize("call, exc, fragments", [c[1:] for c in FUNCTIONAL_CASES],
                         ids=[c[0] for c in FUNCTIONAL_CASES])
def test_functional_primitives_check_their_arguments(call, exc, fragments):
    with raises(exc, *fragments):
        call()


def test_dropout_p_just_below_one_still_works():
    y, cache = F.dropout_forward(_x(4, 4), 0.999, rng=0)
    assert y.shape == (4, 4) and F.dropout_backward(_x(4, 4), cache).shape == (4, 4)


def test_public_helpers_check_their_arguments():
    """The helpers in the modules' __all__ name a bad argument (a p of 1.5 overflowed keep_mask's
    uint32 threshold, Dh=0 divided by zero in rope_angles, a negative size made an empty mask
    or one-hot, and limit_blas_threads took a string)."""
    from npattn import attention as A
    from npattn import backend as B
    from npattn import nn
    from npattn import positions as P

    cases = [
        (lambda: B.keep_mask(1, 1.5, (2, 3), np), ValueError, r"^p: expected a drop probability in \[0, 1\), got 1.5"),
        (lambda: F.gqa_groups(_x(2, 4, 3, 5), _x(3, 2, 6, 5), _x(3, 2, 6, 5), True), ValueError,
         r"^q, k, v: expected batch axes .* that broadcast .* with enable_gqa, got shapes .*"
         r"\(2, 4, 3, 5\), \(3, 2, 6, 5\)"),
        (lambda: B.keep_mask(1, -0.1, (2, 3), np), ValueError, "^p: expected a drop probability"),
        (lambda: B.keep_mask(1, 2**1100, (2, 3), np), ValueError,
         r"^p: expected a drop probability in \[0, 1\), got an int too large for a float \(1101 bits\)$"),
        (lambda: B.keep_mask(1, math.nan, (2, 3), np), ValueError, "^p: expected a drop probability"),
        (lambda: B.keep_mask(-1, 0.1, (2, 3), np), ValueError,
         r"^key: expected an int in \[0, 2\*\*64\) \(from dropout_key\), got -1$"),
        (lambda: B.keep_mask("k", 0.1, (2, 3), np), TypeError, "^key: expected an int"),
        (lambda: B.keep_mask(True, 0.1, (2, 3), np), TypeError, "^key: expected an int .*got bool True"),
        (lambda: B.keep_mask(np.True_, 0.1, (2, 3), np), TypeError, "^key: expected an int .*got numpy.bool"),
        (lambda: B.keyed_keep_mask(1, 0.1, [], np.arange(2), np.arange(3), out=np.empty((2, 3), np.uint8)),
         ValueError, r"^out: expected a numpy bool array of shape \(2, 3\), got dtype uint8 and shape "
                     r"\(2, 3\)$"),
        (lambda: B.keep_mask(1, 0.1, (2, -3), np), ValueError,
         r"^shape: expected a sequence of ints >= 0, got \(2, -3\)$"),
        (lambda: B.keep_mask(1, 0.1, 5, np), TypeError, "^shape: expected a sequence of ints >= 0, got 5$"),
        (lambda: B.keep_mask(1, 0.1, (2, -1), np), ValueError,
         r"^shape: expected a sequence of ints >= 0, got \(2, -1\)$"),
        (lambda: B.keep_mask(1, 0.1, (True, 3), np), TypeError,
         r"^shape: expected a sequence of ints >= 0, got \(True, 3\)$"),
        # a mask, or coordinates of an axis, larger than the largest array (NumPy named nothing)
        (lambda: B.keep_mask(1, 0.1, (2**56, 2**56), np), ValueError,
         rf"^shape: expected sizes for which the keep-mask, "
         rf"an array of shape \({2**56}, {2**56}\) \(1 byte an entry\), "
         rf"fits in {sys.maxsize} bytes \(the largest array\), got {2**112} bytes$"),
        (lambda: B.keep_mask(1, 0.1, (0, 2**61), np), ValueError,
         rf"^shape: expected sizes for which the coordinates of its longest axis, "
         rf"an array of shape \({2**61},\)"),
        (lambda: B.keep_mask(1, False, (2, 3), np), TypeError, r"^p: expected a drop probability in \[0, 1\), got bool"),
        (lambda: B.keep_mask(1, True, (2, 3), np), TypeError, r"^p: expected a drop probability in \[0, 1\), got bool"),
        (lambda: B.keyed_keep_mask(1, 2.0, [], np.arange(2), np.arange(3)), ValueError, "^p: expected"),
        (lambda: B.limit_blas_threads("x"), TypeError, "^n: expected None or an int >= 1"),
        (lambda: B.limit_blas_threads(0), ValueError, "^n: expected None or an int >= 1"),
        (lambda: B.limit_blas_threads(True), TypeError, "^n: expected None or an int >= 1"),
        (lambda: F.causal_mask(np, -2, 3), ValueError, "^Lq: expected an int >= 0, got -2"),
        (lambda: P.rope_angles(np, np.arange(3), 0), ValueError, "^Dh: expected a positive int, got 0"),
        (lambda: P.rope_angles(np, np.arange(3), 4, base="x"), TypeError, "^base: expected a float > 1"),
        (lambda: nn.one_hot(np, np.arange(2), -3, np.float64), ValueError, "^n: expected a positive int"),
    ]
    for call, exc, match in cases:
        with pytest.raises(exc, match=match):
            call()
    # the right arguments still give the one mask: the same entries whatever the key's type
    np.testing.assert_array_equal(B.keep_mask(np.uint64(5), np.float32(0.25), (2, 3), np),
                                  B.keep_mask(5, 0.25, (2, 3), np))
    # a float16 p (p * 2**32 overflowed float16: OverflowError on the reference and numpy paths)
    np.testing.assert_array_equal(B.keep_mask(5, np.float16(0.25), (2, 3), np),
                                  B.keep_mask(5, 0.25, (2, 3), np))
    q = np.ones((1, 1, 3, 4))
    for impl in ("reference", "numpy", "blocked"):
        want = A.sdpa_forward(q, q, q, dropout_p=0.25, rng=0, impl=impl)[0]
        got = A.sdpa_forward(q, q, q, dropout_p=np.float16(0.25), rng=0, impl=impl)[0]
        np.testing.assert_array_equal(got, want)


def test_to_numpy_and_device_of_name_a_non_array():
    from npattn.backend import device_of, to_numpy

    for call in (lambda: to_numpy(None), lambda: to_numpy([1.0, 2.0]), lambda: device_of(None)):
        with pytest.raises(TypeError, match="^x: expected an array, got"):
            call()


def test_to_numpy_copies_an_array_whose_library_refuses_to_export_it(monkeypatch):
    """NumPy before 2.1 exports no read-only array through DLPack (BufferError), and
    array_api_strict's broadcast views wrap one: to_numpy takes a writable copy of it in its own
    library instead. Here NumPy's refusal is played by from_dlpack refusing the array itself."""
    xps = pytest.importorskip("array_api_strict")
    x = xps.broadcast_to(xps.asarray([[1.0, 2.0, 3.0]]), (2, 3))
    real = np.from_dlpack
    refused = []

    def from_dlpack(obj, *args, **kwargs):
        if obj is x:
            refused.append(obj)
            raise BufferError("Cannot export readonly array since signalling readonly is "
                              "unsupported by DLPack.")
        return real(obj, *args, **kwargs)

    monkeypatch.setattr(np, "from_dlpack", from_dlpack)
    got = to_numpy(x)
    assert refused == [x]
    np.testing.assert_array_equal(got, [[1.0, 2.0, 3.0], [1.0, 2.0, 3.0]])
    got[0, 0] = 7.0  # a copy of its own, writable
    assert float(x[0, 0]) == 1.0 and float(x[1, 0]) == 1.0


def test_caches_do_not_keep_the_forward_input_alive():
    """The caches that check an upstream gradient keep the input's spec (shape, dtype, library,
    device), not the input: an activation the caller drops is freed before the backward."""
    import gc
    import weakref

    from npattn import layers as Ly
    from npattn import nn

    forwards = [
        lambda x: F.dropout_forward(x, 0.5, rng=0),
        lambda x: F.dropout_forward(x, 0.0),
        lambda x: F.append_kv_forward(x, np.ones(4), add_zero_attn=True),
        lambda x: Ly.residual_forward(x, np.ones(4)),
        lambda x: Ly.mean_pool_forward(x),
        lambda x: nn.add_positions_forward(x, np.zeros((3, 4))),
    ]
    for fwd in forwards:
        x = np.ones((2, 3, 4))
        ref = weakref.ref(x)
        out, cache = fwd(x)
        if out is x:  # dropout with p = 0 returns x itself
            del out
        del x
        gc.collect()
        assert ref() is None, fwd


def test_upstream_gradients_and_masks_of_another_library_are_refused():
    """A torch dy for a NumPy dropout forward, a torch dout for NumPy heads, a torch mask with a
    NumPy like in pad_mask_forward: TypeErrors naming them (they were taken)."""
    torch = pytest.importorskip("torch")
    x = _x(2, 3, 4)
    _, dc = F.dropout_forward(x, 0.5, rng=0)
    with pytest.raises(TypeError, match="^dy: expected a numpy array"):
        F.dropout_backward(torch.from_numpy(x), dc)
    _, hc = F.split_heads_forward(x, 2)
    with pytest.raises(TypeError, match="^dout: expected a numpy array"):
        F.split_heads_backward(torch.zeros(2, 2, 3, 2, dtype=torch.float64), hc)
    _, ac = F.append_kv_forward(x, _x(4))
    with pytest.raises(TypeError, match="^dy: expected a numpy array"):
        F.append_kv_backward(torch.zeros(2, 4, 4, dtype=torch.float64), ac)
    with pytest.raises(TypeError, match="^mask: expected a numpy array \\(that of like\\)"):
        F.pad_mask_forward(torch.ones(3, 5, dtype=torch.bool), 3, 5, 1, like=_x(1, 3, 4))


def test_numpy_extension_dtypes_are_named_not_crashed_on():
    # NumPy's isdtype raises its own TypeError for a dtype outside the standard's (ml_dtypes'
    # bfloat16, which JAX brings): npattn says which argument and what it expected
    ml_dtypes = pytest.importorskip("ml_dtypes")
    from npattn import attention as A, compat, masks

    bf = np.zeros((2, 2, 3, 4), dtype=ml_dtypes.bfloat16)
    x = np.ones((2, 2, 3, 4))
    with raises(TypeError, "q", "real floating", "bfloat16", "extension dtype", "float32", "on torch or JAX"):
        A.sdpa_forward(bf, x, x, impl="auto")
    with raises(TypeError, "q", "real floating", "bfloat16"):
        compat.flash_attn_func(bf.transpose(0, 2, 1, 3), x.transpose(0, 2, 1, 3), x.transpose(0, 2, 1, 3))
    with raises(TypeError, "mask", "bfloat16"):
        F.sdpa_forward(x, x, x, mask=np.zeros((3, 3), dtype=ml_dtypes.bfloat16))
    with raises(TypeError, "lengths"):
        masks.padding(np.array([1, 2], dtype=ml_dtypes.bfloat16), 3)
    m = make_mha("numpy")
    with raises(TypeError, "query", "bfloat16"):
        m(np.zeros((2, 3, 8), dtype=ml_dtypes.bfloat16), np.ones((2, 3, 8)), np.ones((2, 3, 8)))


def test_a_float8_extension_dtype_is_not_sent_to_bfloat16():
    # ml_dtypes' float8 types are extension dtypes too, but neither torch nor JAX runs
    # npattn in them: the refusal names NumPy's dtypes without the bfloat16 pointer
    ml_dtypes = pytest.importorskip("ml_dtypes")
    from npattn import attention as A

    x = np.ones((2, 2, 3, 4))
    f8 = np.zeros((2, 2, 3, 4), dtype=ml_dtypes.float8_e4m3fn)
    with pytest.raises(TypeError, match=re.escape(
            "q: expected a real floating dtype, got float8_e4m3fn (a NumPy extension dtype: on NumPy "
            "npattn takes float16, float32 and float64)") + "$"):
        A.sdpa_forward(f8, x, x)


def test_a_structured_or_void_dtype_is_not_called_an_extension_dtype():
    """A structured array (or raw bytes, 'V8') is of kind 'V' as ml_dtypes' bfloat16 is, but no
    extension dtype: its refusal says what was expected and what came, without the hint that
    points a bfloat16 user to torch or JAX."""
    from npattn import attention as A

    x = np.ones((2, 2, 3, 4))
    for dtype in (np.dtype([("a", "f8")]), np.dtype("V8")):
        a = np.zeros((2, 2, 3, 4), dtype=dtype)
        with pytest.raises(TypeError, match=r"^q: expected a real floating dtype, got \S+$"):
            A.sdpa_forward(a, x, x)


# --------------------------------------------------------------------------
# device= of the array builders


def _builders(xp_name):
    from npattn import masks, nn, positions

    return {
        "masks.causal": lambda d: masks.causal(3, 4, xp=xp_name, device=d),
        "masks.window": lambda d: masks.window(3, 4, 1, 1, xp=xp_name, device=d),
        "masks.padding": lambda d: masks.padding([1, 2], 4, xp=xp_name, device=d),
        "masks.from_torch_mha": lambda d: masks.from_torch_mha(
            key_padding_mask=np.zeros((2, 4), bool), xp=xp_name, device=d),
        "nn.sinusoidal_positions": lambda d: nn.sinusoidal_positions(xp_name, 3, 4, device=d),
        "positions.relative_distances": lambda d: positions.relative_distances(xp_name, 3, 4, device=d),
    }


@pytest.mark.parametrize("device", ["gpu9", "cuda:7"])
def test_a_device_the_backend_lacks_is_named(backend, xp, device):
    """Each library refuses a device it lacks in its own words (torch with a RuntimeError,
    or an AssertionError without CUDA), none of which names the argument; a device the
    backend has is taken (that of an array it made)."""
    if backend == "cupy":
        pytest.skip("a CUDA device name is one CuPy may have")
    here = getattr(xp.zeros(1), "device", None)
    for name, build in _builders(backend).items():
        with pytest.raises(ValueError, match=rf"^device: expected a device of the {backend} backend, "
                                             rf"got '{device}'"):
            build(device)
        assert getattr(build(here), "device", None) == here, name


# --------------------------------------------------------------------------
# the shared checks of npattn.validation at their edges, called directly


def test_scalar_checks_refuse_a_bool_and_an_infinity():
    """A bool is no number, seed or probability; an infinite scale is refused with either sign."""
    from npattn import validation as V

    with raises(TypeError, "n", "positive int", "None"):
        V.check_positive_int("n", None)  # None only under allow_none
    assert V.check_positive_int("n", None, allow_none=True) is None
    with raises(TypeError, "scale", "float", "bool"):
        V.check_scale("scale", True)
    with raises(ValueError, "scale", "finite", "-inf"):
        V.check_scale("scale", -math.inf)
    with raises(TypeError, "p", "drop probability", "bool"):
        V.check_probability("p", False)
    with raises(TypeError, "rng", "seed", "bool"):
        V.check_rng("rng", True)
    for seed in (0, np.random.default_rng(0), np.random.SeedSequence(0), np.random.PCG64(0)):
        V.check_rng("rng", seed)  # all of what numpy.random.default_rng takes
    # an int beyond the float range is an infinity of its own sign
    assert V.real_value(2**1100) == math.inf and V.real_value(-(2**1100)) == -math.inf


def test_check_broadcasts_to_neither_adds_nor_grows_an_axis():
    from npattn import validation as V

    V.check_broadcasts_to("a", (3, 1), (2, 3, 5), "t")  # right-aligned; a 1 stretches
    with raises(ValueError, "a", "(2, 3, 5)", "(1, 2, 3, 5)"):
        V.check_broadcasts_to("a", (1, 2, 3, 5), (2, 3, 5), "t")
    with raises(ValueError, "a", "(2, 1, 5)", "(2, 3, 5)"):
        V.check_broadcasts_to("a", (2, 3, 5), (2, 1, 5), "t")


def test_the_namespace_is_compared_by_library():
    """numpy itself and the namespace array_api_compat gives a NumPy array are one library."""
    import array_api_compat

    from npattn import validation as V

    x = np.ones(2)
    assert array_api_compat.array_namespace(x) is not np
    V.check_array("x", x, np)


def test_heads_layout_is_that_of_its_docstring():
    """q (B, Hq, Lq, Dh), k (B, Hkv, Lk, Dh), v (B, Hkv, Lk, Dv), Hkv dividing Hq, masks
    broadcasting to (B, Hq, Lq, Lk) without growing it: what the NumPy kernel takes."""
    from npattn import validation as V

    q, k, v = np.ones((2, 4, 3, 8)), np.ones((2, 2, 5, 8)), np.ones((2, 2, 5, 6))
    assert V.heads_layout(q, k, v, np.ones((1, 1, 3, 5), bool), None)
    assert not V.heads_layout(q, np.ones((2, 3, 5, 8)), np.ones((2, 3, 5, 6)))  # 3 does not divide 4
    assert not V.heads_layout(q, k[:1], v[:1])  # another B
    assert not V.heads_layout(q, k, v[:, :1])  # k and v of other head counts
    assert not V.heads_layout(q[:1], k[:1], v[:1], np.ones((2, 1, 3, 5), bool))  # the mask grows B
    assert not V.heads_layout(q[:, :1], k[:, :0], v[:, :0])  # no kv head: nothing divides, no ZeroDivisionError
    assert not V.heads_layout(q, k, v, np.ones((3, 1, 1, 1), bool))  # a mask that does not broadcast


@pytest.mark.parametrize(
    "block, exc, fragments",
    [
        (dict(block_q=0), ValueError, ("block_q", "positive int", "0")),
        (dict(block_k=-1), ValueError, ("block_k", "positive int", "-1")),
        (dict(block_q="2"), TypeError, ("block_q", "positive int", "str")),
        (dict(block_k=2.0), TypeError, ("block_k", "positive int", "float")),
        (dict(block_q=True), TypeError, ("block_q", "positive int", "bool")),
    ],
    ids=["block_q=0", "block_k=-1", "block_q='2'", "block_k=2.0", "block_q=True"],
)
def test_blocked_forward_checks_its_block_sizes_before_the_dropout_draw(block, exc, fragments):
    """A bad block size is refused before rng is drawn from: the generator the caller
    passed is where it was, so the next call draws the mask it would have drawn."""
    from npattn import blocked

    q, k, v = (np.random.default_rng(0).standard_normal(s) for s in
               ((2, 2, 3, 4), (2, 2, 5, 4), (2, 2, 5, 6)))
    rng = np.random.default_rng(7)
    state = rng.bit_generator.state
    with raises(exc, *fragments):
        blocked.sdpa_blocked_forward(q, k, v, dropout_p=0.5, rng=rng, **block)
    assert rng.bit_generator.state == state


def _huge_size_calls():
    from npattn import masks
    from npattn import positions as P
    from npattn.classifier import TransformerClassifier
    from npattn.gpt import GPT
    from npattn.transformer import TransformerBlock

    big = 2**70  # beyond any array axis (2**63 - 1)
    return {
        "kdim": lambda: MultiHeadAttention(8, 2, kdim=big),
        "d_ff": lambda: TransformerBlock(8, 2, d_ff=big),
        "n_layer": lambda: GPT(vocab_size=5, block_size=4, d_model=4, n_layer=big, n_head=1),
        "vocab_size": lambda: GPT(vocab_size=big, block_size=4, d_model=4, n_layer=1, n_head=1),
        "n_layers": lambda: TransformerClassifier(2, 3, 2, d_model=4, n_head=1, n_layers=big),
        "Lq": lambda: masks.causal(big, 3),
        "Lk": lambda: P.relative_distances("numpy", 3, big),
        "n_extra": lambda: F.pad_mask_forward(None, 3, 5, big),
    }


@pytest.mark.parametrize("name", sorted(_huge_size_calls()))
def test_a_size_beyond_the_longest_array_axis_is_named(name):
    """2**70 passes as an int but no axis is that long: NumPy would say only 'Maximum allowed
    dimension exceeded' (or SeedSequence.spawn raise OverflowError); the check names it."""
    with raises(ValueError, name, str(2**63 - 1), "(the longest array axis)", str(2**70)):
        _huge_size_calls()[name]()


def test_a_seed_beyond_the_longest_array_axis_still_seeds():
    """Seeds are no sizes: SeedSequence takes any int >= 0, and so do the blocks and models."""
    from npattn.classifier import TransformerClassifier
    from npattn.transformer import TransformerBlock

    TransformerBlock(4, 1, seed=2**70)
    TransformerClassifier(2, 3, 2, d_model=4, n_head=1, seed=2**70)


def test_a_missing_array_is_called_none():
    """None where an array belongs is named as the caller wrote it, not as NoneType."""
    with pytest.raises(TypeError, match=r"^q: expected an array, got None$"):
        F.sdpa_forward(None, np.ones((2, 3)), np.ones((2, 3)))


def test_the_longest_array_axis_itself_is_a_size():
    """The bound is inclusive: 2**63 - 1 passes the size checks, 2**63 is refused by a
    public call that takes a size (NumPy has no axis that long)."""
    from npattn import validation as V

    longest = 2**63 - 1
    assert V.check_positive_int("n", longest) == longest
    assert V.check_size("n", longest) == longest
    with raises(ValueError, "n_extra", str(longest), str(2**63)):
        F.pad_mask_forward(None, 3, 5, 2**63)


def test_a_python_type_numpy_reads_as_a_dtype_is_a_dtype():
    """dtype=float is NumPy's float64, as np.zeros(..., dtype=float) reads it."""
    m = MultiHeadAttention(8, 2, dtype=float, backend="numpy")
    assert all(p.dtype == np.float64 for p in m.params.values())


def test_scores_lead_refuses_leading_axes_that_do_not_broadcast():
    """Its docstring's ValueError, with and without grouped-query heads."""
    from npattn import validation as V

    q, k, v = np.ones((2, 4, 3, 8)), np.ones((3, 2, 5, 8)), np.ones((3, 2, 5, 6))
    assert V.scores_lead(q, k[:1], v[:1], enable_gqa=True) == (2, 4)
    with pytest.raises(ValueError, match=r"^q, k, v: expected leading axes that broadcast against "
                                         r"each other, got shapes \(2, 4, 3, 8\), \(3, 2, 5, 8\), "
                                         r"\(3, 2, 5, 6\)$"):
        V.scores_lead(q, k, v)
    with pytest.raises(ValueError, match=r"^q, k, v: expected batch axes .* with enable_gqa, got shapes "
                                         r"\(2, 4, 3, 8\), \(3, 2, 5, 8\), \(3, 2, 5, 6\)$"):
        V.scores_lead(q, k, v, enable_gqa=True)


def test_arrays_beside_x_on_another_device_are_named():
    """Weights, upstream gradients, ids, a dropout keep-mask and the kernel options' arrays
    are checked for the device of the array they go with (array_api_strict's second
    device), not only the library: a ValueError naming each."""
    aas = pytest.importorskip("array_api_strict")
    from npattn import nn

    dev = aas.Device("device1")

    def ones(shape, dtype=aas.float64, device=None):
        return aas.ones(shape, dtype=dtype, device=device)

    x, w = ones((2, 3)), ones((4, 3))
    q, k, v = ones((2, 2, 3, 4)), ones((2, 2, 5, 4)), ones((2, 2, 5, 4))
    seg_q, seg_k = ones((2, 3), aas.int64), ones((2, 5), aas.int64)
    calls = {
        "w": lambda: F.linear_forward(x, ones((4, 3), device=dev)),
        "dy": lambda: F.linear_backward(ones((2, 4), device=dev), F.linear_forward(x, w)[1]),
        "ids": lambda: nn.embedding_forward(aas.asarray([0, 1], device=dev), ones((5, 2))),
        "alibi_slopes": lambda: F.sdpa_forward(q, k, v, alibi_slopes=ones((2,), device=dev)),
        "sinks": lambda: F.sdpa_forward(q, k, v, sinks=ones((2,), device=dev)),
        "dropout_mask": lambda: F.sdpa_forward(q, k, v, dropout_p=0.5,
                                               dropout_mask=ones((3, 5), aas.bool, device=dev)),
        "k_segments": lambda: F.sdpa_forward(q, k, v, q_segments=seg_q,
                                             k_segments=ones((2, 5), aas.int64, device=dev)),
        "mask": lambda: F.sdpa_forward(q, k, v, mask=ones((3, 5), aas.bool, device=dev)),
    }
    for name, call in calls.items():
        with raises(ValueError, f"{name}: ", "on device", "device1"):
            call()
    # an upstream gradient goes with the forward's input, whose spec the cache keeps (p = 0:
    # no keep-mask to take the device from)
    _, cache = F.dropout_forward(x, 0.0)
    with raises(ValueError, "dy: ", "on device", "device1"):
        F.dropout_backward(ones((2, 3), device=dev), cache)
    # the kernel options' arrays go with q: the message says so
    for name in ("alibi_slopes", "sinks"):
        with raises(ValueError, f"{name}: ", "(like q)"):
            calls[name]()


def test_keys_of_three_axes_against_queries_of_four_take_the_general_path():
    """q (2, 2, 3, 8) against k, v (2, 2, 8): k's leading axis broadcasts against q's heads
    (the scores (2, 2, 3, 2)); the dispatcher's default matches the float64 formula."""
    from npattn import attention as A
    from npattn import validation as V
    from reliability_helpers import ref_sdpa

    rng = np.random.default_rng(6)
    q, k, v = rng.standard_normal((2, 2, 3, 8)), rng.standard_normal((2, 2, 8)), rng.standard_normal((2, 2, 8))
    assert not V.heads_layout(q, k, v)  # the kernel takes q, k, v of 4 axes only
    out, _ = A.sdpa_forward(q, k, v)
    np.testing.assert_allclose(out, ref_sdpa(q, k, v)[0], rtol=1e-12, atol=1e-12)


def test_only_a_3d_mask_gets_the_batch_or_heads_hint():
    m = make_mha("numpy")
    q, k, v = inputs(np, 2, 3, 5, 8)
    with pytest.raises(ValueError, match="mask") as info:
        m(q, k, v, mask=np.ones((1, 2, 2, 3, 5), dtype=bool))
    assert "ambiguous" not in str(info.value)


@pytest.mark.parametrize("call,name,choices", [
    (lambda v: npattn.masks.causal(3, 4, align=v), "align", "'top_left' or 'bottom_right'"),
    (lambda v: npattn.layers.gelu_forward(np.ones(3), v), "approximate", "'none' or 'tanh'"),
    (lambda v: npattn.layers.feed_forward_forward(np.ones((2, 3)), np.ones((4, 3)), None,
                                                  np.ones((3, 4)), None, activation=v),
     "activation", "'relu', 'gelu' or 'gelu_tanh'"),
    (lambda v: npattn.transformer.TransformerBlock(4, 2, activation=v), "activation",
     "'relu', 'gelu' or 'gelu_tanh'"),
])
def test_a_choice_of_strings_is_checked_by_type_then_value(call, name, choices):
    """A string option: TypeError for anything not a str (None, an int, bytes, a NumPy
    string array), ValueError for a str not among the choices (no case folding); both
    messages list the choices."""
    for bad in (None, 3, b"tanh", np.array(["tanh"])):
        got = "got None" if bad is None else type(bad).__name__
        with raises(TypeError, f"{name}: expected {choices}, got", got):
            call(bad)
    for bad in ("", "TANH", "Bottom_Right", "relu "):
        with raises(ValueError, f"{name}: expected {choices}, got {bad!r}"):
            call(bad)


def test_message_pieces_name_types_values_and_dtypes_as_documented():
    """type_name: a class by its top-level package ('numpy.Generator', not the private module
    it is defined in), a builtin by its name, None as 'None'; described: the type and the
    repr, or 'None'; dtype_name: the bare name of a NumPy dtype of either byte order, of a
    NumPy scalar type and of another library's dtype."""
    from npattn import validation as V

    assert V.type_name(np.random.default_rng(0)) == "numpy.Generator"
    assert V.type_name(np.ones(2)) == "numpy.ndarray"
    assert V.type_name([1]) == "list" and V.type_name(None) == "None"
    assert V.type_name(np.int32) == "type numpy.int32" and V.type_name(int) == "type int"  # classes
    # a class by its module path up to the first private part, public parts after it dropped
    nested = type("Kind", (), {"__module__": "pkg.sub._impl.more"})
    assert V.type_name(nested) == "type pkg.sub.Kind" and V.described(nested) == "type pkg.sub.Kind"
    assert V.described(3) == "int 3" and V.described("a") == "str 'a'" and V.described(None) == "None"
    with pytest.raises(TypeError, match=r"^is_causal: expected a bool, got None$"):
        V.check_bool("is_causal", None)
    assert V.dtype_name(np.dtype(">f8")) == "float64"  # str() of it is '>f8'
    assert V.dtype_name(np.dtype("<f4")) == "float32"
    assert V.dtype_name(np.float32) == "float32"
    aas = pytest.importorskip("array_api_strict")
    assert V.dtype_name(aas.float32) == "float32"


def test_a_bound_is_named_as_the_bound_it_is():
    """One choice is listed alone; a size above the longest array axis says that is the bound,
    one above a maximum of the caller's own gives that maximum alone."""
    from npattn import validation as V

    with pytest.raises(ValueError, match=r"^mode: expected 'full', got 'vjp'$"):
        V.check_choice("mode", "vjp", ("full",))
    with pytest.raises(TypeError, match=r"^mode: expected 'full', got int 3$"):
        V.check_choice("mode", 3, ("full",))
    with pytest.raises(ValueError, match=r"^n: expected a positive int <= 4, got 5$"):
        V.check_positive_int("n", 5, maximum=4)
    with pytest.raises(ValueError, match=r"^n: expected an int <= 6, got 7$"):
        V.check_size("n", 7, maximum=6)
    with pytest.raises(ValueError, match=rf"^n: expected an int <= {V.MAX_AXIS} \(the longest array "
                                         rf"axis\), got {V.MAX_AXIS + 1}$"):
        V.check_size("n", V.MAX_AXIS + 1)
    with pytest.raises(ValueError, match=r"^eps: expected a finite number > 0, got 0.0$"):
        V.check_number("eps", 0.0)
    with pytest.raises(ValueError, match=r"^lr: expected a finite number >= 0, got -1.0$"):
        V.check_number("lr", -1.0, allow_zero=True)
    # a number beyond the float range by its size or type, not its hundreds of digits
    from fractions import Fraction
    for value, got in ((10**400, "an int too large for a float (1329 bits)"),
                       (-(10**400), "a negative int too large for a float (1329 bits)"),
                       (Fraction(10**400, 3), "a fractions.Fraction too large for a float"),
                       (Fraction(-(10**400), 3), "a negative fractions.Fraction too large for a float")):
        with pytest.raises(ValueError, match=rf"^lr: expected a finite number > 0, got {re.escape(got)}$"):
            V.check_number("lr", value)
    assert V.real_text(Fraction(1, 3)) == "Fraction(1, 3)"  # one a float holds: as written


def test_an_array_that_cannot_exist_is_told_from_one_that_does_not_fit_in_memory():
    """The largest array holds sys.maxsize bytes: up to it an array can exist (2**20 x 2**20
    float64, 8 TiB, is left to the library's MemoryError), one byte more is refused, naming
    the sizes, the shape, the bytes asked for and the limit."""
    import sys

    from npattn import validation as V

    assert V.MAX_BYTES == sys.maxsize
    V.check_array_bytes(["n"], (sys.maxsize,), 1, "a byte array")
    V.check_array_bytes(["Lq", "Lk"], (2**20, 2**20), 8, "a float64 array")
    with pytest.raises(ValueError, match=rf"^a, b and c: expected sizes for which the buffer, "
                                         rf"an array of shape "
                                         rf"\(2, 1, {2**62}\) \(1 byte an entry\), fits in {sys.maxsize} "
                                         rf"bytes \(the largest array\), got {2**63} bytes$"):
        V.check_array_bytes(["a", "b", "c"], (2, 1, 2**62), 1, "the buffer")


@pytest.mark.parametrize("call, names, nbytes", [
    (lambda: MultiHeadAttention(2**32, 1), "d_model", 2**32 * 2**32 * 8),  # w_q (D, D)
    (lambda: MultiHeadAttention(8, 2, qdim=2**62), "d_model and qdim", 8 * 2**62 * 8),
    (lambda: MultiHeadAttention(8, 2, kdim=2**62), "d_model and kdim", 8 * 2**62 * 8),
    (lambda: MultiHeadAttention(8, 4, n_kv_head=2, vdim=2**62), "d_model, n_kv_head and vdim",
     4 * 2**62 * 8),  # w_v (n_kv_head * Dh, vdim)
    (lambda: npattn.transformer.TransformerBlock(8, 2, 2**61), "d_model and d_ff", 2**61 * 8 * 8),
    (lambda: npattn.transformer.TransformerDecoderBlock(2**31, 2), "d_model",
     4 * 2**31 * 2**31 * 8),  # linear1 (4 D, D)
    (lambda: npattn.gpt.GPT(2**61, 4, 8, 1, 2), "vocab_size and d_model", 2**61 * 8 * 8),
    (lambda: npattn.gpt.GPT(4, 2**61, 8, 1, 2), "block_size and d_model", 2**61 * 8 * 8),
    (lambda: npattn.classifier.TransformerClassifier(2**61, 4, 2, 8, 2), "d_model and n_features",
     8 * 2**61 * 8),
    (lambda: npattn.classifier.TransformerClassifier(4, 2**61, 2, 8, 2), "seq_len and d_model",
     2**61 * 8 * 8),
    (lambda: npattn.classifier.TransformerClassifier(4, 4, 2**61, 8, 2), "n_classes and d_model",
     2**61 * 8 * 8),
])
def test_sizes_whose_parameters_cannot_exist_are_named(call, names, nbytes):
    """A constructor whose parameters (drawn in float64) would be an array larger than the
    largest one names the sizes, the bytes and the limit, before it makes anything (NumPy's
    "array is too big" named no argument)."""
    import sys

    with pytest.raises(ValueError, match=rf"^{names}: expected sizes for which .* \(8 bytes an entry\), "
                                         rf"fits in {sys.maxsize} bytes \(the largest array\), "
                                         rf"got {nbytes} bytes$"):
        call()


def test_a_wrong_cache_names_the_forward_that_makes_it():
    """A backward given something else than its cache says which cache it takes and which
    forward returns it, and what it got."""
    from npattn import layers as Ly

    _, cache = Ly.relu_forward(np.ones((2, 3)))
    with pytest.raises(TypeError, match=r"^cache: expected a ReluCache \(the cache relu_forward returns\), "
                                        r"got tuple$"):
        Ly.relu_backward(np.ones((2, 3)), tuple(cache))


def test_slopes_and_sinks_without_a_head_axis_say_what_q_needs():
    """q, k, v of 2 axes (L, Dh) have no head axis for alibi_slopes or sinks of shape (H,):
    the refusal says q needs at least 3 axes and gives q's shape."""
    q, k = np.ones((3, 4)), np.ones((5, 4))
    for name in ("alibi_slopes", "sinks"):
        with raises(ValueError, f"{name}: ", "(H,) with q of at least 3 axes", "(q has shape (3, 4))",
                    "(1,)"):
            F.sdpa_forward(q, k, k, **{name: np.ones(1)})


def test_namespace_and_device_of_numpy_arrays_are_array_api_compats_answers():
    # plain NumPy arrays take a shortcut in backend.namespace and device_of: it must give what
    # array_api_compat gives, and leave subclasses, scalars and mixed libraries to it
    import array_api_compat
    import array_api_strict

    from npattn.backend import device_of, namespace

    class Sub(np.ndarray):
        pass

    cases = [np.ones((2, 3)), np.ones((), np.float32), np.zeros((2, 0), bool),
             np.ones(3).view(Sub), np.ma.masked_array(np.ones(2)), np.float64(1.5)]
    for x in cases:
        assert namespace(x) is array_api_compat.array_namespace(x), type(x)
        assert namespace(None, x, None) is array_api_compat.array_namespace(x), type(x)
        assert device_of(x) == array_api_compat.device(x), type(x)
    assert namespace(cases[0], cases[1]) is array_api_compat.array_namespace(cases[0], cases[1])
    with pytest.raises(TypeError, match="different array libraries"):
        namespace(np.ones(2), array_api_strict.asarray([1.0, 2.0]))
    with pytest.raises(TypeError, match="b: expected an array of the library of a"):
        namespace(np.ones(2), array_api_strict.asarray([1.0]), names=["a", "b"])
    with pytest.raises(TypeError, match="x: expected an array, got list"):
        device_of([1.0])
    for x in cases:
        shape = npattn.validation.shape_of(x)
        assert shape == tuple(np.shape(x)) and all(type(n) is int for n in shape), type(x)


def _seeded_models():
    """Every constructor that takes ``seed=``, with small float64 shapes, as (name, make)."""
    from npattn.classifier import TransformerClassifier
    from npattn.gpt import GPT
    from npattn.transformer import TransformerBlock, TransformerDecoderBlock

    return [
        ("MultiHeadAttention",
         lambda seed: MultiHeadAttention(8, 2, dropout=0.5, dtype="float64", seed=seed)),
        ("TransformerBlock", lambda seed: TransformerBlock(8, 2, dropout=0.5, dtype="float64", seed=seed)),
        ("TransformerDecoderBlock",
         lambda seed: TransformerDecoderBlock(8, 2, dropout=0.5, dtype="float64", seed=seed)),
        ("TransformerClassifier",
         lambda seed: TransformerClassifier(3, 4, 2, 8, 2, dropout=0.5, dtype="float64", seed=seed)),
        ("GPT", lambda seed: GPT(5, 4, 8, 2, 2, dropout=0.5, dtype="float64", seed=seed)),
    ]


def _seed_digest(model):
    """A digest of a model's parameters and its blocks' dropout generator states."""
    import hashlib
    import json

    h = hashlib.sha256()
    for name, value in model.params.items():
        h.update(name.encode())
        h.update(np.ascontiguousarray(to_numpy(value), dtype=np.float64).tobytes())
    for block in getattr(model, "blocks", [model]):
        if hasattr(block, "rng_state"):
            h.update(json.dumps(block.rng_state, sort_keys=True, default=int).encode())
    return h.hexdigest()[:16]


#: The digests of seed=3 and seed=np.uint8(200), as the constructors have drawn them since their
#: seeds were ints only: accepting more kinds of seed must not change what an int gives.
_INT_SEED_DIGESTS = {
    "MultiHeadAttention": ("26c98e3858c264a3", "7fe55a793b67cc22"),
    "TransformerBlock": ("e10a3b2abcf4ec70", "7f6e38d7576cf7aa"),
    "TransformerDecoderBlock": ("f5fa0ef678cfc887", "560fb31d7029441d"),
    "TransformerClassifier": ("328f904327e3f0a4", "a91d22eb862980c6"),
    "GPT": ("9113fb5e0607850f", "e1e64b014f48e341"),
}


@pytest.mark.parametrize("name, make", _seeded_models(), ids=[n for n, _ in _seeded_models()])
def test_every_constructor_takes_an_int_or_a_seed_sequence_as_seed(name, make):
    """MultiHeadAttention, both blocks, the classifier and the GPT take the same seeds: None,
    an int >= 0 (Python or NumPy) and a SeedSequence, which seeds as its entropy does while
    the one given is not advanced. An int seeds as it always has (the digests), and the
    dropout generators agree too (the model's next training forward)."""
    seq = np.random.SeedSequence(3)
    models = [make(s) for s in (3, np.int64(3), seq, seq)]
    assert seq.n_children_spawned == 0
    assert {_seed_digest(m) for m in models} == {_INT_SEED_DIGESTS[name][0]}
    assert _seed_digest(make(np.uint8(200))) == _INT_SEED_DIGESTS[name][1]
    assert _seed_digest(make(None)) != _seed_digest(make(None))  # fresh entropy
    child = np.random.SeedSequence(3).spawn(2)[1]  # spawned from as it stands
    assert _seed_digest(make(child)) == _seed_digest(make(copy_of_seq(child)))
    assert _seed_digest(make(child)) != _INT_SEED_DIGESTS[name][0]
    rng = np.random.default_rng(0)
    if name == "MultiHeadAttention":
        x = rng.standard_normal((2, 3, 8))
        outs = [to_numpy(m.forward(x, x, x)[0]) for m in models]
    elif name == "TransformerDecoderBlock":
        x, memory = rng.standard_normal((2, 3, 8)), rng.standard_normal((2, 5, 8))
        outs = [to_numpy(m.forward(x, memory)) for m in models]
    elif name == "TransformerClassifier":
        x = rng.standard_normal((2, 4, 3))
        outs = [to_numpy(m.forward(x)) for m in models]
    elif name == "GPT":
        ids = rng.integers(0, 5, size=(2, 4))
        outs = [to_numpy(m.forward(ids)) for m in models]
    else:
        x = rng.standard_normal((2, 3, 8))
        outs = [to_numpy(m.forward(x)) for m in models]
    for out in outs[1:]:
        np.testing.assert_array_equal(out, outs[0])


class _Integral:
    """An integer type of another library (registered as ``numbers.Integral``, as sympy's and
    gmpy2's are): it converts with ``int()`` but is no Python or NumPy int."""

    def __init__(self, n):
        self.n = n

    def __int__(self):
        return self.n

    __index__ = __int__

    def __lt__(self, other):
        return self.n < other

    def __repr__(self):
        return f"_Integral({self.n})"


numbers.Integral.register(_Integral)


@pytest.mark.parametrize("name, make", _seeded_models(), ids=[n for n, _ in _seeded_models()])
def test_every_constructor_seeds_any_integral_as_its_int(name, make):
    """A ``numbers.Integral`` of another library seeds every constructor as the int it stands
    for (NumPy's SeedSequence refused it with a message that named no argument), and seeds a
    dropout function's rng= as that int does."""
    assert _seed_digest(make(_Integral(3))) == _INT_SEED_DIGESTS[name][0]
    x = np.random.default_rng(0).standard_normal((2, 3, 4))
    want, _ = F.dropout_forward(x, 0.5, rng=3)
    got, _ = F.dropout_forward(x, 0.5, rng=_Integral(3))
    np.testing.assert_array_equal(got, want)


def copy_of_seq(seq):
    """A new SeedSequence in the state of ``seq`` (entropy, spawn key, children spawned)."""
    import copy

    return copy.deepcopy(seq)


@pytest.mark.parametrize("name, make", _seeded_models(), ids=[n for n, _ in _seeded_models()])
def test_every_constructor_refuses_the_same_seeds_in_the_same_words(name, make):
    """A bool (NumPy would seed True as 1), a float, a list (SeedSequence's entropy), a string,
    a Generator and a BitGenerator (streams, which only the functions that draw take) are a
    TypeError, and a negative int a ValueError, in one message form on every constructor."""
    bad = [(True, "bool"), (np.False_, "numpy.bool"), (1.5, "float"), ([3], "list"), ("3", "str"),
           (np.random.default_rng(0), "numpy.Generator"), (np.random.PCG64(0), "numpy.PCG64")]
    for seed, kind in bad:
        with pytest.raises(TypeError, match=r"^seed: expected None, a non-negative int seed or a "
                                            r"SeedSequence, got " + kind):
            make(seed)
    for seed in (-1, np.int8(-1)):
        with pytest.raises(ValueError, match=r"^seed: expected a non-negative int seed, got (np.int8\()?-1"):
            make(seed)


def test_check_device_lets_a_memory_error_through(monkeypatch):
    """check_device makes a one-entry array on the device to see that the backend has it; a
    MemoryError there is no fault of the device and goes on as it is, not as a ValueError
    that blames the argument."""
    from npattn import validation
    from npattn.backend import namespace

    xp = namespace(np.zeros(1))

    def fails(*args, **kwargs):
        raise MemoryError("no memory")

    monkeypatch.setattr(xp, "zeros", fails)
    with pytest.raises(MemoryError, match="no memory"):
        validation.check_device(xp, "cpu")
