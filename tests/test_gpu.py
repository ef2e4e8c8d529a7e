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
