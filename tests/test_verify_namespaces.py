"""npattn.verify on an Array API namespace other than NumPy, torch, CuPy and JAX: a kernel
written with the standard's functions alone, checked on array_api_strict."""

from __future__ import annotations

import inspect
import math
import re
import sys
import types

import pytest

from npattn import functional as F
from npattn import verifier as VF
from npattn.tools import cli

xs = pytest.importorskip("array_api_strict")

SUPPORTS = "causal,mask_bool,scale,empty_rows"


def attention(q, k, v, *, is_causal=False, mask=None, scale=None):
    """Softmax attention with the Array API's functions only: (out, *saved for backward)."""
    # [B, H, Lq, Dh], [B, H, Lk, Dh], [B, H, Lk, Dv] -> [B, H, Lq, Dv]
    xp = q.__array_namespace__()
    Lq, Lk = q.shape[-2], k.shape[-2]
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    s = xp.matmul(q, xp.matrix_transpose(k)) * scale  # [B, H, Lq, Lk]
    allowed = xp.ones((Lq, Lk), dtype=xp.bool, device=q.device)  # [Lq, Lk]
    if is_causal:  # top-left: query i attends keys j <= i
        allowed = xp.arange(Lk, device=q.device)[None, :] <= xp.arange(Lq, device=q.device)[:, None]
    if mask is not None:
        allowed = xp.logical_and(allowed, mask)  # [B, H or 1, Lq, Lk]
    s = xp.where(allowed, s, -math.inf)
    m = xp.max(s, axis=-1, keepdims=True)  # [B, H, Lq, 1]
    m = xp.where(xp.isfinite(m), m, 0.0)  # a row with nothing to attend
    e = xp.where(allowed, xp.exp(s - m), 0.0)
    total = xp.sum(e, axis=-1, keepdims=True)
    p = e / xp.where(total > 0.0, total, 1.0)  # [B, H, Lq, Lk]; zeros on empty rows
    return xp.matmul(p, v), q, k, v, p, scale


def backward(dout, q, k, v, p, scale):
    """(dq, dk, dv) of ``attention``."""
    # [B, H, Lq, Dv] -> [B, H, Lq, Dh], [B, H, Lk, Dh], [B, H, Lk, Dv]
    xp = q.__array_namespace__()
    dv = xp.matmul(xp.matrix_transpose(p), dout)
    dp = xp.matmul(dout, xp.matrix_transpose(v))
    ds = p * (dp - xp.sum(dp * p, axis=-1, keepdims=True))
    return xp.matmul(ds, k) * scale, xp.matmul(xp.matrix_transpose(ds), q) * scale, dv


def default_scale(q, k, v, *, scale=None, **options):
    """``attention`` that ignores a given scale."""
    return attention(q, k, v, **options)


def ignores_mask(q, k, v, *, mask=None, **options):
    """``attention`` that ignores the boolean mask."""
    return attention(q, k, v, **options)


def never_called(q, k, v, **options):
    raise AssertionError("the kernel ran")


def run(fn, dtype="float64", **kw):
    kw.setdefault("supports", SUPPORTS)
    return VF.verify(fn, backward=backward, dtype=dtype, backend="array_api_strict", combos=False,
                     **kw)


@pytest.mark.parametrize("dtype", ["float64", "float32"])
def test_portable_kernel_passes_on_array_api_strict(dtype):
    seen = set()

    def recorded(q, k, v, **options):
        seen.update(type(a).__module__.split(".")[0] for a in (q, k, v, *options.values())
                    if hasattr(a, "shape"))
        return attention(q, k, v, **options)

    report = run(recorded, dtype)
    assert report.ok, report.format()
    assert seen == {"array_api_strict"}, seen
    assert report.config["backend"] == "array_api_strict"
    assert {r.case.options for r in report.results} >= {("causal",), ("mask_bool",), ("scale",)}
    gradient_cases = [r for r in report.results if {"dq", "dk", "dv"} <= set(r.tensors)]
    assert len(gradient_cases) == len(report.results)


def test_npattn_functional_on_array_api_strict_passes():
    def kernel(q, k, v, **options):
        out, cache = F.sdpa_forward(q, k, v, **options)
        return out, cache.lse, cache

    report = VF.verify(kernel, backward=lambda dout, cache: F.sdpa_backward(dout, cache),
                       returns_lse=True, dtype="float32", backend=xs, supports="causal,sinks",
                       combos=False)
    assert report.ok, report.format()


@pytest.mark.parametrize("fn,option", [(default_scale, "scale"), (ignores_mask, "mask_bool")])
def test_planted_mistakes_fail_in_the_cases_of_their_option(fn, option):
    report = run(fn)
    failed = {r.case.name for r in report.results if r.status == "fail"}
    assert failed, report.format()
    assert failed == {r.case.name for r in report.results if option in r.case.options}
    for r in report.results:
        if r.case.name in failed:
            assert r.tensors["out"].status == "fail", r.case.name


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_a_dtype_the_namespace_lacks_is_refused_before_any_case(dtype):
    with pytest.raises(ValueError, match=rf"^dtype: expected a dtype that backend='array_api_strict' "
                                         rf"has \(float64, float32\), got '{dtype}'$"):
        run(never_called, dtype)


def test_arrays_are_on_the_device_given():
    devices = set()

    def on_device(q, k, v, **options):
        devices.update(a.device for a in (q, k, v, *options.values()) if hasattr(a, "device"))
        return attention(q, k, v, **options)

    device1 = xs.Device("device1")
    for device in (device1, str(device1)):  # the object, or as the report writes it
        devices.clear()
        report = run(on_device, "float32", device=device, cases=["causal-65x129", "mask_bool-65x129"])
        assert report.ok, report.format()
        assert devices == {device1}, devices
        assert report.config["device"] == str(device1)


def strict_device(name):
    """array_api_strict's device of that name, or None where this version has none."""
    try:
        return xs.Device(name)
    except ValueError:  # "no_float64" came after array_api_strict 2.5
        return None


@pytest.mark.parametrize("device,why", [
    ("cpu", "Unsupported device 'cpu'"),
    (0, "Unsupported device 0"),
    pytest.param(strict_device("no_float64"), "does not support dtype=array_api_strict.float64",
                 marks=pytest.mark.skipif(strict_device("no_float64") is None,
                                          reason="this array_api_strict has no 'no_float64' device"),
                 id="no_float64"),
])
def test_a_device_the_namespace_cannot_use_is_refused_before_any_case(device, why):
    with pytest.raises(ValueError) as info:
        run(never_called, "float64", device=device)
    msg = str(info.value)
    assert msg.startswith("device: expected a device that backend='array_api_strict' can use "
                          "(one of array_api_strict.Device('CPU_DEVICE'), "), msg
    assert f"got {device!r} (ValueError: " in msg and why in msg, msg


def test_autograd_needs_its_own_library():
    for autograd in ("torch", "jax"):
        with pytest.raises(ValueError, match=rf"^autograd: '{autograd}' needs backend='{autograd}', "
                                             r"got backend='array_api_strict'$"):
            VF.verify(never_called, autograd=autograd, backend="array_api_strict")


def portable_namespace(name):
    """A namespace module of another name: array_api_strict's functions on a module of its own,
    as a library verify knows nothing of would be (its arrays are array_api_strict's)."""
    ns = types.ModuleType(name)
    for attr in dir(xs):
        if not attr.startswith("_") or attr in ("__array_api_version__", "__array_namespace_info__"):
            setattr(ns, attr, getattr(xs, attr))
    sys.modules[name] = ns  # importable by its name, as a namespace module is
    return ns


def test_a_namespace_verify_does_not_know_is_taken_and_named_as_given():
    """A kernel on an Array API namespace module that is none of verify's names passes, runs on
    that module's arrays, and its failures' rerun lines name the module as it was given."""
    ns = portable_namespace("portable_ns")
    try:
        seen = set()

        def kernel(q, k, v, **options):
            seen.add(type(q).__module__.split(".")[0])
            return attention(q, k, v, **options)

        report = VF.verify(kernel, backward=backward, backend=ns, dtype="float64", supports=SUPPORTS,
                           combos=False)
        assert report.ok, report
        assert seen == {"array_api_strict"}
        report = VF.verify(ignores_mask, backward=backward, backend=ns, dtype="float64",
                           supports=SUPPORTS, cases=["mask_bool-65x129"])
        assert not report.ok
        line = report.results[0].reproducer
        assert re.search(r"\bbackend=portable_ns\b", line) and "array_api_strict" not in line, line
    finally:
        del sys.modules["portable_ns"]


def test_backend_takes_namespace_modules_and_refuses_other_modules():
    compat = pytest.importorskip("array_api_compat.numpy")  # NumPy's namespace: verify's "numpy"
    report = VF.verify(ignores_mask, backward=backward, backend=compat, dtype="float64",
                       supports=SUPPORTS, cases=["mask_bool-65x129"])
    assert not report.ok
    assert "backend=" not in report.results[0].reproducer  # numpy, the default, goes unwritten
    with pytest.raises(TypeError, match=r"^backend: expected an Array API namespace module, got "
                                        r"module 'math'$"):
        VF.verify(never_called, backend=math)
    with pytest.raises(ValueError, match=r"^backend: expected one of \('numpy', 'torch', 'cupy', "
                                         r"'jax', 'array_api_strict'\) or an Array API namespace "
                                         r"module, got 'strict'$"):
        VF.verify(never_called, backend="strict")


def test_reproducer_reruns_the_case_on_the_namespace():
    report = run(ignores_mask, cases=["mask_bool-65x129"])
    line = report.results[0].reproducer
    assert "backend='array_api_strict'" in line, line
    # verify(module.ignores_mask, ..., backward=module.backward, ...)
    call = line[len("print(npattn."):-1].replace(ignores_mask.__module__ + ".", "")
    again = eval(call, {"verify": VF.verify, "ignores_mask": ignores_mask, "backward": backward})
    assert again.results[0].status == "fail" and again.config["backend"] == "array_api_strict"
    assert again.results[0].tensors["out"].error == report.results[0].tensors["out"].error


def test_command_line_takes_array_api_strict(tmp_path, capsys):
    path = tmp_path / "portable.py"
    kernels = (attention, backward, ignores_mask)
    path.write_text("import math\n\n" + "\n".join(inspect.getsource(f) for f in kernels))
    flags = ["--backend", "array_api_strict", "--backward", "backward", "--supports", "mask_bool",
             "--combos", "none", "--no-progress"]
    assert cli.main(["verify", f"{path}:attention", "--dtype", "float32", *flags]) == 0, \
        capsys.readouterr().out
    capsys.readouterr()
    assert cli.main(["verify", f"{path}:ignores_mask", "--dtype", "float32", *flags]) == 1
    reruns = [ln.split("rerun: ", 1)[1] for ln in capsys.readouterr().out.splitlines() if "rerun: " in ln]
    assert reruns and all("--backend array_api_strict" in r for r in reruns), reruns
    device = "array_api_strict.Device('device1')"  # as the report and its rerun lines write it
    assert cli.main(["verify", f"{path}:attention", "--device", device, *flags]) == 0
    capsys.readouterr()
    assert cli.main(["verify", f"{path}:attention", "--device", "device1", *flags]) == 2
    assert "--device: expected a device that --backend array_api_strict can use (one of " \
           f"array_api_strict.Device('CPU_DEVICE'), {device}, " in capsys.readouterr().err
    assert cli.main(["verify", f"{path}:attention", "--dtype", "float16", *flags]) == 2
    assert "dtype: expected a dtype that --backend array_api_strict has (float64, float32), got " \
           "'float16'" in capsys.readouterr().err


class HostOnly:
    """An array that speaks the Array API's namespace but has no DLPack: ``__array__`` only."""

    def __init__(self, a):
        self.a, self.shape, self.dtype = a, a.shape, a.dtype

    def __array_namespace__(self, api_version=None):
        import numpy
        return numpy

    def __array__(self, dtype=None, copy=None):
        return self.a if dtype is None else self.a.astype(dtype)


def test_an_output_without_dlpack_is_read_through_its_array_method():
    """verify reads a kernel's output through DLPack, and through ``__array__`` where it has no
    DLPack: its values are compared (exact here), and it fails only as an array of another
    library than the inputs', not as an error in reading it."""
    import numpy as np

    def kernel(q, k, v, **options):
        out = F.sdpa_forward(q, k, v, **options)[0]
        return HostOnly(np.asarray(out))

    report = VF.verify(kernel, dtype="float64", supports="causal", combos=False)
    for r in report.results:
        out = r.tensors["out"]
        assert out.error == 0.0 and out.status == "fail" and "library" in out.note, (r.case.name, out)
