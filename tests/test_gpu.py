"""GPU-only checks (marked ``gpu``): CuPy results stay on the GPU and match NumPy.

Every test of the suite parametrized on the cupy backend is marked ``gpu``
too (tests/conftest.py). Without CuPy and a GPU these skip, or fail with
``NPATTN_REQUIRE_GPU=1``; ``scripts/gpu_check.sh`` runs them.
"""

import os
import sys

import numpy as np
import pytest

from npattn import MultiHeadAttention
from npattn import functional as F
from npattn.backend import from_numpy, to_numpy

from conftest import backend_or_skip

SCRIPTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "scripts")


@pytest.fixture
def cp_xp():
    return backend_or_skip("cupy")


@pytest.mark.gpu
def test_cupy_results_stay_on_gpu(cp_xp):
    import cupy

    rng = np.random.default_rng(0)
    with cupy.cuda.Device(0):
        q, k, v, dout = (from_numpy(rng.standard_normal(s), cp_xp)
                         for s in [(2, 4, 5, 3), (2, 2, 7, 3), (2, 2, 7, 3), (2, 4, 5, 3)])
        out, c = F.sdpa_forward(q, k, v, is_causal=True, enable_gqa=True, dropout_p=0.3, rng=1)
        grads = F.sdpa_backward(dout, c)
    for a in [out, c.probs, c.dropout.keep, *grads[:3]]:
        assert isinstance(a, cupy.ndarray) and a.device.id == 0


@pytest.mark.gpu
@pytest.mark.parametrize("dtype,rtol", [("float64", 1e-12), ("float32", 1e-5)])
def test_cupy_module_matches_numpy(cp_xp, dtype, rtol):
    rng = np.random.default_rng(1)
    host = [rng.standard_normal(s).astype(dtype) for s in [(3, 6, 16), (3, 9, 16), (3, 9, 16), (3, 6, 16)]]
    mask = rng.random((3, 1, 6, 9)) < 0.7
    keep = rng.random((3, 4, 6, 9)) >= 0.2
    res = {}
    for name in ("numpy", "cupy"):
        m = MultiHeadAttention(16, 4, dtype=dtype, backend=name, seed=2, dropout=0.2)
        xp = m.xp
        X = [from_numpy(a, xp) for a in host]
        out, _ = m(*X[:3], mask=from_numpy(mask, xp), dropout_mask=from_numpy(keep, xp))
        grads = m.backward(X[3])
        res[name] = [to_numpy(a) for a in (out, *grads)] + [to_numpy(m.grads[k]) for k in sorted(m.grads) if k != "b_k"]
    for a, b in zip(res["cupy"], res["numpy"]):
        assert np.max(np.abs(a - b)) <= rtol * np.max(np.abs(b))


@pytest.mark.gpu
def test_gpu_parity_script_first_benchmark_shape(cp_xp):
    """scripts/gpu_parity.py on the smallest benchmark shape (32, 128, 256, 8)."""
    sys.path.insert(0, SCRIPTS)
    try:
        import gpu_parity
    finally:
        sys.path.remove(SCRIPTS)
    assert gpu_parity.main(["--backend", "cupy", "--max-len", "128"]) == 0


def test_parity_script_dry_run_numpy():
    """The script's machinery without a GPU: numpy against itself is exact."""
    sys.path.insert(0, SCRIPTS)
    try:
        import gpu_parity
    finally:
        sys.path.remove(SCRIPTS)
    ref, _ = gpu_parity.run_module("numpy", "float32", (2, 8, 16, 4, True), seed=0)
    got, _ = gpu_parity.run_module("numpy", "float32", (2, 8, 16, 4, True), seed=0)
    assert all(e == 0.0 for e in gpu_parity.compare(got, ref).values())
    f64, _ = gpu_parity.run_module("numpy", "float64", (2, 8, 16, 4, True), seed=0)
    errs = gpu_parity.compare(got, f64)
    assert 0.0 < max(errs.values()) <= gpu_parity.TOLERANCE["float32"]
    assert gpu_parity.main(["--backend", "no_such_backend"]) == 2


def test_parity_script_every_impl_and_case_on_numpy(tmp_path, monkeypatch):
    """Every option case and implementation runs through the script (numpy against numpy);
    the NumPy kernel's refusals are reported, and a zero tolerance fails on rounding alone."""
    sys.path.insert(0, SCRIPTS)
    try:
        import gpu_parity
    finally:
        sys.path.remove(SCRIPTS)
    import json

    monkeypatch.setattr(gpu_parity, "BENCHMARK_SHAPES", [(2, 16, 32, 4, True)])  # small, causal
    out = tmp_path / "parity.json"
    argv = ["--backend", "numpy", "--dtype", "float64", "--max-len", "128",
            "--impl", "blocked,numpy", "--cases", "all", "--json", str(out)]
    assert gpu_parity.main(argv) == 0
    records = json.loads(out.read_text())["records"]
    assert {(r["case"], r["impl"]) for r in records} == {
        (c, i) for c in gpu_parity.CASES for i in ("blocked", "numpy")}
    ran = [r for r in records if "errors" in r]
    assert all(max(r["errors"].values()) <= 1e-13 for r in ran)
    refused = {r["case"] for r in records if "refused" in r}
    assert refused == {"alibi", "softcap", "sinks", "segments"}  # the kernel's documented refusals
    # the reference against the NumPy kernel differs by rounding: a zero tolerance fails
    assert gpu_parity.main(["--backend", "numpy", "--dtype", "float64", "--max-len", "128",
                            "--impl", "reference", "--tol", "0"]) == 1
    assert gpu_parity.main(["--backend", "numpy", "--cases", "plain,nope"]) == 2
    assert gpu_parity.main(["--backend", "numpy", "--impl", "blokced"]) == 2  # a typo: no run


def test_parity_script_fails_an_error_numpy_does_not_raise(monkeypatch, capsys):
    """A ValueError on the backend under test is a refusal only where NumPy refuses the same
    implementation and case; else it fails the run (a bug raising on the GPU alone)."""
    sys.path.insert(0, SCRIPTS)
    try:
        import gpu_parity
    finally:
        sys.path.remove(SCRIPTS)
    monkeypatch.setattr(gpu_parity, "BENCHMARK_SHAPES", [(2, 16, 32, 4, False)])
    real, calls = gpu_parity.run_module, []

    def flaky(backend, dtype, shape, seed, impl="auto", case="plain"):
        calls.append(impl)
        if impl == "blocked" and calls.count("blocked") == 1:  # the backend's run, not NumPy's
            raise ValueError("blocked: a bug of the backend under test")
        return real(backend, dtype, shape, seed, impl, case)

    monkeypatch.setattr(gpu_parity, "run_module", flaky)
    assert gpu_parity.main(["--backend", "numpy", "--dtype", "float64", "--impl", "dense,blocked"]) == 1
    assert "raised: blocked: a bug of the backend under test   FAIL" in capsys.readouterr().out


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [(2, 3, 5, 7), (1, 8, 300, 260), (4, 1000)])
def test_cupy_keep_mask_is_drawn_on_the_device_with_the_host_bits(cp_xp, shape, monkeypatch):
    """keep_mask on CuPy hashes on the device: a CuPy array with exactly NumPy's bits, at the
    default slab and at slabs of a few rows."""
    import cupy

    from npattn import backend as npb

    key = (0x1234_5678 << 32) | 0x9ABC_DEF0
    host = npb.keep_mask(key, 0.3, shape, np)
    for slab in (npb.DEVICE_KEEP_SLAB, 3 * shape[-1]):
        monkeypatch.setattr(npb, "DEVICE_KEEP_SLAB", slab)
        got = npb.keep_mask(key, 0.3, shape, cp_xp, cupy.cuda.Device(0))
        assert isinstance(got, cupy.ndarray) and got.dtype == cupy.bool_ and got.device.id == 0
        np.testing.assert_array_equal(got.get(), host)


def test_the_device_branch_of_keep_mask_with_numpy_standing_in_for_cupy(monkeypatch):
    """No GPU needed: keep_mask's CuPy branch run with NumPy in CuPy's place (the same array
    calls) draws keyed_keep_mask's bits, at the default slab and at slabs of a few rows, and
    enters the device it is given."""
    import contextlib
    import types

    from npattn import backend as npb

    entered = []

    @contextlib.contextmanager
    def device(n=None):
        entered.append(n)
        yield

    fake = types.SimpleNamespace(**{n: getattr(np, n) for n in (
        "empty", "bool_", "full", "uint32", "asarray", "bitwise_xor", "greater_equal")})
    fake.cuda = types.SimpleNamespace(Device=device)
    monkeypatch.setitem(sys.modules, "cupy", fake)
    monkeypatch.setattr(npb, "backend_name", lambda xp: "cupy")
    key, shape = (0x0BAD_CAFE << 32) | 0xDEAD_BEEF, (2, 3, 9, 4)
    lead = [np.arange(2)[:, None], np.arange(3)[None, :]]
    host = npb.keyed_keep_mask(key, 0.45, lead, np.arange(9), np.arange(4))
    for slab in (npb.DEVICE_KEEP_SLAB, 2 * 3 * 4 * 2):  # the whole mask; two rows at a time
        monkeypatch.setattr(npb, "DEVICE_KEEP_SLAB", slab)
        np.testing.assert_array_equal(npb.keep_mask(key, 0.45, shape, np, types.SimpleNamespace(id=1)), host)
    assert npb.keep_mask(key, 0.45, shape, np).shape == shape
    assert entered == [1, 1, None]
