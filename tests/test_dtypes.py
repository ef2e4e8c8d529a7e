"""Dtypes and backends: one body, every backend; the documented error bounds.

* float64 and float32 on every backend; float16 where the backend has it,
  bfloat16 on torch; half precision computes scores and softmax in float32.
* Maximum error against float64, per dtype, for SDPA and the module, within
  the bounds documented in docs/dtypes.md (``SDPA_BOUND`` / ``MODULE_BOUND``).
* torch CPU tensors through array-api-compat give the numbers of npattn on NumPy.
* array-api-strict's second device: results stay on the input device, and
  mixing devices raises.

Errors are ``max|x - x64| / max|x64|`` per array, with the inputs first
rounded to the dtype under test, so that only the computation is measured.
"""

import re

import numpy as np
import pytest

from npattn import MultiHeadAttention
from npattn import functional as F
from npattn.backend import device_of, from_numpy, to_numpy
from npattn.gradcheck import gradcheck

from conftest import backend_or_skip

#: Documented maximum error against float64 (docs/dtypes.md), relative to the
#: largest magnitude of the float64 result, for unit-normal inputs.
SDPA_BOUND = {"float64": 1e-13, "float32": 2e-6, "float16": 1e-3, "bfloat16": 8e-3}
MODULE_BOUND = {"float64": 1e-13, "float32": 1e-5, "float16": 1.5e-2, "bfloat16": 1.5e-1}

# (B, H, Lq, Lk, Dh, causal)
SDPA_SHAPES = [(2, 4, 16, 24, 16, False), (1, 8, 64, 64, 32, True), (2, 2, 7, 5, 8, False)]
# (B, Lq, Lk, D, H, causal)
MODULE_SHAPES = [(2, 5, 7, 16, 4, False), (2, 64, 48, 64, 4, True)]

HALF_CASES = [
    ("numpy", "float16"),
    ("torch", "float16"),
    ("torch", "bfloat16"),
    ("array_api_strict", "float16"),
    ("cupy", "float16"),
]


def _dtype_or_skip(xp, backend, dtype):
    if not hasattr(xp, dtype):
        pytest.skip(f"{backend} has no {dtype}")
    return getattr(xp, dtype)


def _host64(xp, x):
    """Host float64 copy (via float32 for dtypes NumPy lacks, which is exact for halves)."""
    if x.dtype != xp.float64:
        x = xp.astype(x, xp.float32)
    return np.asarray(to_numpy(x), dtype=np.float64)


def _rel(a, b):
    return float(np.max(np.abs(a - b)) / np.max(np.abs(b)))


def sdpa_errors(xp, dtype, shape, seed=0):
    """Max relative errors of out, dq, dk, dv, dmask in ``dtype`` against float64."""
    B, H, Lq, Lk, Dh, causal = shape
    rng = np.random.default_rng(seed)
    host = [rng.standard_normal(s) for s in [(B, H, Lq, Dh), (B, H, Lk, Dh), (B, H, Lk, Dh), (B, H, Lq, Dh)]]
    X = [xp.astype(from_numpy(a, xp), dtype) for a in host]  # rounded to dtype
    X64 = [_host64(xp, x) for x in X]
    fmask = rng.standard_normal((1, H, Lq, Lk))
    fmask[..., 1:, -1] = -np.inf
    M = xp.astype(from_numpy(fmask, xp), dtype)
    M64 = _host64(xp, M)
    out, c = F.sdpa_forward(*X[:3], mask=M, is_causal=causal)
    assert out.dtype == dtype
    grads = F.sdpa_backward(X[3], c)[:4]  # dq, dk, dv, dmask (no sinks)
    assert all(g.dtype == dtype for g in grads)
    rout, rc = F.sdpa_forward(*X64[:3], mask=M64, is_causal=causal)
    rgrads = F.sdpa_backward(X64[3], rc)[:4]
    names = ["out", "dq", "dk", "dv", "dmask"]
    return {n: _rel(_host64(xp, a), b) for n, a, b in zip(names, [out, *grads], [rout, *rgrads])}


def module_errors(backend, xp, dtype_name, shape, seed=0):
    """Max relative errors of the module's output and every gradient against float64."""
    B, Lq, Lk, D, H, causal = shape
    rng = np.random.default_rng(seed)
    m = MultiHeadAttention(D, H, dtype=dtype_name, backend=backend, seed=seed)
    dtype = getattr(xp, dtype_name)
    # random biases too (the initial ones are zero, which would hide their errors)
    m.params = {k: xp.astype(from_numpy(rng.standard_normal(tuple(v.shape)) * 0.3, xp), dtype)
                for k, v in m.params.items()}
    ref = MultiHeadAttention(D, H, dtype="float64", backend="numpy")
    ref.params = {k: _host64(xp, v) for k, v in m.params.items()}
    X = [xp.astype(from_numpy(rng.standard_normal(s), xp), dtype)
         for s in [(B, Lq, D), (B, Lk, D), (B, Lk, D), (B, Lq, D)]]
    X64 = [_host64(xp, x) for x in X]
    out, _ = m(*X[:3], is_causal=causal)
    assert out.dtype == dtype
    grads = m.backward(X[3])
    rout, _ = ref(*X64[:3], is_causal=causal)
    rgrads = ref.backward(X64[3])
    errs = {"out": _rel(_host64(xp, out), rout)}
    errs.update({n: _rel(_host64(xp, a), b) for n, a, b in zip(["dquery", "dkey", "dvalue"], grads, rgrads)})
    for n, g in m.grads.items():
        assert g.dtype == dtype, n
        if n == "b_k":
            # d/db_k is exactly 0: a key bias adds q . b_k to every score of a row,
            # which the softmax cancels. Only check that it is small.
            assert np.max(np.abs(_host64(xp, g))) <= MODULE_BOUND[dtype_name] * np.max(np.abs(rgrads[0]))
            continue
        errs[n] = _rel(_host64(xp, g), ref.grads[n])
    return errs


# --------------------------------------------------------------------------
# float64 and float32 everywhere


@pytest.mark.parametrize("dtype_name", ["float64", "float32"])
def test_full_precision_error_bounds(backend, xp, dtype_name):
    dtype = getattr(xp, dtype_name)
    for shape in SDPA_SHAPES:
        errs = sdpa_errors(xp, dtype, shape)
        assert max(errs.values()) <= SDPA_BOUND[dtype_name], (shape, errs)
    for shape in MODULE_SHAPES:
        errs = module_errors(backend, xp, dtype_name, shape)
        assert max(errs.values()) <= MODULE_BOUND[dtype_name], (shape, errs)


# --------------------------------------------------------------------------
# half precision: float32 inside, bounded error outside


@pytest.mark.parametrize("backend_name,dtype_name", HALF_CASES, ids=[f"{b}-{d}" for b, d in HALF_CASES])
def test_half_precision_error_bounds(backend_name, dtype_name):
    xp = backend_or_skip(backend_name)
    dtype = _dtype_or_skip(xp, backend_name, dtype_name)
    for shape in SDPA_SHAPES:
        errs = sdpa_errors(xp, dtype, shape)
        assert max(errs.values()) <= SDPA_BOUND[dtype_name], (shape, errs)
        # a non-zero error: the results really are in half precision
        assert max(errs.values()) > 0.0
    for shape in MODULE_SHAPES:
        errs = module_errors(backend_name, xp, dtype_name, shape)
        assert max(errs.values()) <= MODULE_BOUND[dtype_name], (shape, errs)


@pytest.mark.parametrize("backend_name,dtype_name", HALF_CASES, ids=[f"{b}-{d}" for b, d in HALF_CASES])
def test_half_precision_is_float32_rounded_once(backend_name, dtype_name):
    """Half inputs: scores, softmax and every product in float32; only the
    results are rounded. So they equal the float32 computation on the upcast
    inputs, rounded to half, exactly."""
    xp = backend_or_skip(backend_name)
    dtype = _dtype_or_skip(xp, backend_name, dtype_name)
    rng = np.random.default_rng(5)
    X = [xp.astype(from_numpy(rng.standard_normal(s), xp), dtype)
         for s in [(2, 4, 6, 3), (2, 2, 5, 3), (2, 2, 5, 3), (2, 4, 6, 3), (2, 1, 6, 5)]]
    mask, keep = X[4], from_numpy(rng.random((2, 4, 6, 5)) >= 0.25, xp)
    kw = dict(is_causal=True, enable_gqa=True, dropout_p=0.25, dropout_mask=keep)
    out, c = F.sdpa_forward(*X[:3], mask=mask, **kw)
    assert c.probs.dtype == xp.float32  # the returned weights keep float32
    grads = F.sdpa_backward(X[3], c)[:4]  # dq, dk, dv, dmask (no sinks)
    X32 = [xp.astype(x, xp.float32) for x in X]
    rout, rc = F.sdpa_forward(*X32[:3], mask=X32[4], **kw)
    rgrads = F.sdpa_backward(X32[3], rc)[:4]
    for a, r in zip([out, *grads], [rout, *rgrads]):
        assert a.dtype == dtype
        np.testing.assert_array_equal(_host64(xp, a), _host64(xp, xp.astype(r, dtype)))



@pytest.mark.parametrize("backend_name,dtype_name", HALF_CASES, ids=[f"{b}-{d}" for b, d in HALF_CASES])
def test_half_precision_module_weights_have_the_module_dtype(backend_name, dtype_name):
    """The module returns ``need_weights``' weights in its own dtype (step 6. keeps them in
    float32), per head and averaged, within the half bound of a float64 module's."""
    xp = backend_or_skip(backend_name)
    dtype = _dtype_or_skip(xp, backend_name, dtype_name)
    B, Lq, Lk, D, H = 2, 3, 5, 8, 2
    rng = np.random.default_rng(7)
    m = MultiHeadAttention(D, H, dtype=dtype_name, backend=backend_name, seed=7)
    ref = MultiHeadAttention(D, H, dtype="float64", backend="numpy")
    ref.params = {k: _host64(xp, v) for k, v in m.params.items()}
    X = [xp.astype(from_numpy(rng.standard_normal(s), xp), dtype) for s in [(B, Lq, D), (B, Lk, D)]]
    X64 = [_host64(xp, x) for x in X]
    for average in (False, True):
        _, w = m(X[0], X[1], X[1], need_weights=True, average_attn_weights=average)
        _, w64 = ref(X64[0], X64[1], X64[1], need_weights=True, average_attn_weights=average)
        assert w.dtype == dtype and tuple(w.shape) == w64.shape
        assert _rel(_host64(xp, w), w64) <= SDPA_BOUND[dtype_name]


# --------------------------------------------------------------------------
# torch CPU through array-api-compat == npattn on NumPy

TORCH_VS_NUMPY_RTOL = {"float64": 1e-13, "float32": 2e-6}


@pytest.mark.parametrize("dtype_name", ["float64", "float32"])
def test_torch_cpu_equals_numpy(dtype_name):
    xt = backend_or_skip("torch")
    xn = backend_or_skip("numpy")
    rng = np.random.default_rng(7)
    host = [rng.standard_normal(s).astype(dtype_name)
            for s in [(2, 6, 5, 4), (2, 3, 7, 4), (2, 3, 7, 4), (2, 6, 5, 4), (2, 1, 5, 7)]]
    keep = rng.random((2, 6, 5, 7)) >= 0.3
    results = {}
    for name, xp in (("numpy", xn), ("torch", xt)):
        X = [from_numpy(a, xp) for a in host]
        out, c = F.sdpa_forward(*X[:3], mask=X[4], is_causal=True, enable_gqa=True,
                                dropout_p=0.3, dropout_mask=from_numpy(keep, xp), scale=0.4)
        res = dict(zip(["out", "probs", "dq", "dk", "dv", "dmask"], [out, c.probs, *F.sdpa_backward(X[3], c)]))
        m = MultiHeadAttention(12, 3, dtype=dtype_name, backend=name, seed=3, dropout=0.2)
        Y = [from_numpy(a, xp) for a in _module_inputs(dtype_name)]
        mkeep = from_numpy(np.random.default_rng(8).random((2, 3, 4, 6)) >= 0.2, xp)
        res["mha_out"], _ = m(*Y[:3], mask=Y[4], dropout_mask=mkeep)
        res.update(zip(["dquery", "dkey", "dvalue"], m.backward(Y[3])))
        res.update(m.grads)
        results[name] = {n: to_numpy(r) for n, r in res.items()}
    for n, b in results["numpy"].items():
        a = results["torch"][n]
        assert a.dtype == b.dtype, n
        # db_k is exactly 0 in exact arithmetic (the softmax cancels a key bias): measure it on w_k's scale
        scale = np.max(np.abs(results["numpy"]["w_k" if n == "b_k" else n]))
        assert np.max(np.abs(a - b)) <= TORCH_VS_NUMPY_RTOL[dtype_name] * scale, n


def _module_inputs(dtype_name):
    rng = np.random.default_rng(9)
    mask = rng.random((2, 1, 4, 6)) < 0.8
    mask[0, 0, 1] = False  # an empty row
    return [rng.standard_normal(s).astype(dtype_name) for s in [(2, 4, 12), (2, 6, 12), (2, 6, 12), (2, 4, 12)]] + [mask]


# --------------------------------------------------------------------------
# devices: array-api-strict's simulated second device


@pytest.fixture
def strict_device1():
    xps = backend_or_skip("array_api_strict")
    return xps, xps.Device("device1")


def test_results_stay_on_input_device(strict_device1):
    xps, dev = strict_device1
    rng = np.random.default_rng(0)
    q, k, v = (xps.asarray(rng.standard_normal(s), device=dev) for s in [(2, 4, 3, 2), (2, 2, 5, 2), (2, 2, 5, 2)])
    mask = xps.asarray(rng.standard_normal((3, 5)), device=dev)
    out, c = F.sdpa_forward(q, k, v, mask=mask, is_causal=True, dropout_p=0.5, rng=1, enable_gqa=True)
    grads = F.sdpa_backward(xps.asarray(rng.standard_normal((2, 4, 3, 2)), device=dev), c)
    for a in [out, c.probs, c.attn, c.dropout.keep, *grads[:3]]:
        assert a.device == dev
    # the finite-difference checker keeps the device too
    report = gradcheck(lambda q, k, v: F.sdpa_forward(q, k, v, is_causal=True, enable_gqa=True),
                       F.sdpa_backward, [q, k, v], names=["q", "k", "v"])
    assert report.ok, str(report)


def test_mixing_devices_raises(strict_device1):
    xps, dev = strict_device1
    rng = np.random.default_rng(0)
    a = rng.standard_normal((2, 2, 3, 2))
    q1, k1, v1 = (xps.asarray(a, device=dev) for _ in range(3))
    k0 = xps.asarray(a)
    cpu = k0.device  # the default device
    like_q = rf"{re.escape(repr(dev))} \(like q\), got one on device {re.escape(repr(cpu))}$"
    with pytest.raises(ValueError, match=rf"^k: expected an array on device {like_q}"):
        F.sdpa_forward(q1, k0, v1)
    with pytest.raises(ValueError, match=rf"^mask: expected an array on device {like_q}"):
        F.sdpa_forward(q1, k1, v1, mask=xps.asarray(np.ones((3, 3), dtype=bool)))
    with pytest.raises(ValueError, match=rf"^dropout_mask: expected an array on device {like_q}"):
        F.sdpa_forward(q1, k1, v1, dropout_p=0.5, dropout_mask=xps.asarray(np.ones((3, 3), dtype=bool)))
    _, c = F.sdpa_forward(q1, k1, v1)
    with pytest.raises(ValueError, match=rf"^dout: expected an array on device {re.escape(repr(dev))} "
                                         rf"\(that of the forward's out\), got one on device "
                                         rf"{re.escape(repr(cpu))}$"):
        F.sdpa_backward(xps.asarray(a), c)
    # the module's parameters live on the default device: device1 inputs are refused, not copied
    m = MultiHeadAttention(4, 2, backend="array_api_strict")
    x1 = xps.asarray(rng.standard_normal((2, 3, 4)), dtype=xps.float32, device=dev)
    with pytest.raises(ValueError, match=rf"^query: expected an array on device {re.escape(repr(cpu))} "
                                         rf"\(where the parameters live\), got one on device "
                                         rf"{re.escape(repr(dev))}$"):
        m(x1, x1, x1)
    assert device_of(m.params["w_q"]) != dev


def test_check_same_device_names_each_array_off_the_first_ones_device(strict_device1):
    """check_same_device compares every array after the first (None skipped) with the first
    one's device and names the first that differs, the second included."""
    from npattn.backend import check_same_device

    xps, dev = strict_device1
    cpu, other = xps.asarray([1.0, 2.0]), xps.asarray([1.0, 2.0], device=dev)
    check_same_device(a=cpu, b=None, c=cpu)
    check_same_device(a=other, b=other)
    for arrays, name in ((dict(a=cpu, b=other), "b"), (dict(a=other, b=cpu), "b"),
                         (dict(a=cpu, b=None, c=cpu, d=other), "d")):
        first, bad = arrays["a"].device, arrays[name].device
        with pytest.raises(ValueError, match=rf"^{name}: expected an array on device "
                                             rf"{re.escape(repr(first))} \(like a\), got one on device "
                                             rf"{re.escape(repr(bad))}$"):
            check_same_device(**arrays)


@pytest.mark.parametrize("p", [np.float64(0.25), np.float32(0.25)], ids=["np.float64", "np.float32"])
@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_a_numpy_scalar_dropout_p_keeps_the_dtype(p, dtype):
    """Under NumPy 2 a NumPy float64 scalar upcasts a float32 array: the dropout scale
    1/(1-p) is taken as a Python float, and the results are those of p = 0.25."""
    from npattn import attention as A
    from npattn import compat

    rng = np.random.default_rng(1)
    q, k, v, dout = (rng.standard_normal(s).astype(dtype)
                     for s in ((2, 2, 5, 4), (2, 2, 7, 4), (2, 2, 7, 4), (2, 2, 5, 4)))
    y, c = F.dropout_forward(q, p, rng=3)
    y0, _ = F.dropout_forward(q, 0.25, rng=3)
    assert y.dtype == dtype and F.dropout_backward(dout, c).dtype == dtype
    np.testing.assert_array_equal(y, y0)
    for impl in ("reference", "blocked", "numpy"):
        cap = 5.0 if impl == "reference" else None  # the kernel options' path too
        out, cache = A.sdpa_forward(q, k, v, impl=impl, dropout_p=p, rng=3, softcap=cap)
        out0, cache0 = A.sdpa_forward(q, k, v, impl=impl, dropout_p=0.25, rng=3, softcap=cap)
        grads, grads0 = A.sdpa_backward(dout, cache), A.sdpa_backward(dout, cache0)
        assert out.dtype == dtype, impl
        np.testing.assert_array_equal(out, out0)
        for n in ("dq", "dk", "dv"):
            assert getattr(grads, n).dtype == dtype, (impl, n)
            np.testing.assert_array_equal(getattr(grads, n), getattr(grads0, n))
    b = np.swapaxes(q, 1, 2).copy()
    kb, vb = np.swapaxes(k, 1, 2).copy(), np.swapaxes(v, 1, 2).copy()
    assert compat.flash_attn_func(b, kb, vb, dropout_p=p, softcap=5.0, rng=3).dtype == dtype


@pytest.mark.parametrize("impl", ["reference", "blocked"])
def test_float64_slopes_and_a_numpy_softcap_keep_float32(impl):
    """ALiBi slopes are constants of any real floating dtype, used in the dtype of the
    scores, and softcap is any real number: float64 slopes and a NumPy float64 softcap
    (NumPy 2 promotes float32 with either to float64) leave out, lse and the gradients
    float32, equal to the call with float32 slopes and the Python float."""
    from npattn import attention as A

    rng = np.random.default_rng(12)
    q, k, v, dout = (rng.standard_normal(s).astype(np.float32)
                     for s in ((2, 2, 3, 4), (2, 2, 5, 4), (2, 2, 5, 4), (2, 2, 3, 4)))
    slopes = rng.uniform(0.1, 1.0, 2)  # float64
    got = A.sdpa_forward(q, k, v, impl=impl, alibi_slopes=slopes, softcap=np.float64(2.0))
    want = A.sdpa_forward(q, k, v, impl=impl, alibi_slopes=slopes.astype(np.float32), softcap=2.0)
    for (out, cache), name in ((got, "got"), (want, "want")):
        assert out.dtype == cache.lse.dtype == np.float32, name
    np.testing.assert_array_equal(got[0], want[0])
    np.testing.assert_array_equal(got[1].lse, want[1].lse)
    for g, g0 in zip(A.sdpa_backward(dout, got[1])[:3], A.sdpa_backward(dout, want[1])[:3]):
        assert g.dtype == np.float32
        np.testing.assert_array_equal(g, g0)


@pytest.mark.parametrize("backend_name,dtype_name", HALF_CASES, ids=[f"{b}-{d}" for b, d in HALF_CASES])
def test_half_precision_sums_over_rows_run_in_float32(backend_name, dtype_name, monkeypatch):
    """A bias gradient (a linear layer's, or ``append_kv``'s bias key) and a gradient summed
    back over broadcast axes add thousands of rows:
    in float32, rounded once (NumPy adds float16 along an axis in float16, where a sum of
    ones stops at 2048). 4096 rows of ones give 4096, which float16 and bfloat16 hold; the
    module's bias gradients over B * L = 5000 rows stay within the module bound."""
    from npattn import attention as A
    from npattn import layers as Ly
    from npattn import nn, numpy_kernel

    xp = backend_or_skip(backend_name)
    dtype = _dtype_or_skip(xp, backend_name, dtype_name)
    ones = xp.ones((4096, 3), dtype=dtype)
    _, c = F.linear_forward(ones, xp.ones((3, 3), dtype=dtype), xp.zeros(3, dtype=dtype))
    sums = [F.linear_backward(ones, c)[2],
            nn.add_positions_backward(xp.reshape(ones, (4096, 1, 3)),
                                      nn.add_positions_forward(xp.reshape(ones, (4096, 1, 3)),
                                                               ones[:1])[1])[1][0],
            Ly.residual_backward(ones, Ly.residual_forward(ones, ones[:1])[1])[1][0],
            F.append_kv_backward(xp.ones((4096, 2, 3), dtype=dtype),  # the bias key's row
                                 F.append_kv_forward(xp.ones((4096, 1, 3), dtype=dtype),
                                                     ones[0])[1])[1]]
    if backend_name == "numpy":
        monkeypatch.setattr(numpy_kernel, "POOL_MIN_LINEAR", 0)
        sums.append(A.linear_backward(ones, c)[2])  # the pool's
        monkeypatch.undo()
    for s in sums:
        assert s.dtype == dtype
        np.testing.assert_array_equal(_host64(xp, s), [4096.0] * 3)
    rng = np.random.default_rng(0)
    m = MultiHeadAttention(8, 2, dtype=dtype_name, backend=backend_name, seed=0)
    ref = MultiHeadAttention(8, 2, dtype="float64", backend="numpy")
    ref.params = {k: _host64(xp, v) for k, v in m.params.items()}
    x = xp.astype(from_numpy(rng.standard_normal((2, 2500, 8)), xp), dtype)
    dout = xp.astype(from_numpy(1.0 + 0.1 * rng.standard_normal((2, 2500, 8)), xp), dtype)
    m(x, x, x)
    m.backward(dout)
    ref(_host64(xp, x), _host64(xp, x), _host64(xp, x))
    ref.backward(_host64(xp, dout))
    for n in ("b_q", "b_v", "b_o"):
        assert _rel(_host64(xp, m.grads[n]), ref.grads[n]) <= MODULE_BOUND[dtype_name], n
