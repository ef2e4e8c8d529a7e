"""GPU-only checks (marked ``gpu``): CuPy results stay on the GPU and match NumPy.

Every test of the suite parametrized on the cupy backend is marked ``gpu``
too (tests/conftest.py). Without CuPy and a GPU these skip, or fail with
``NPATTN_REQUIRE_GPU=1``; ``scripts/gpu_check.sh`` runs them.
"""

import math
import os
import sys

import numpy as np
import pytest

from npattn import MultiHeadAttention
from npattn import functional as F
from npattn.backend import backend_name, from_numpy, to_numpy

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


@pytest.fixture
def numpy_as_cupy(monkeypatch):
    """NumPy standing in for CuPy in npattn.backend: the device branch of the keep-mask draw
    is taken for every namespace (``backend_name`` says "cupy") and runs the same array calls
    on NumPy. Returns the list of devices entered (``cupy.cuda.Device(n)``), one per draw."""
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
    return entered


def test_the_device_branch_of_keep_mask_with_numpy_standing_in_for_cupy(numpy_as_cupy, monkeypatch):
    """No GPU needed: keep_mask's CuPy branch run with NumPy in CuPy's place (the same array
    calls) draws keyed_keep_mask's bits, at the default slab and at slabs of a few rows, and
    enters the device it is given."""
    import types

    from npattn import backend as npb

    key, shape = (0x0BAD_CAFE << 32) | 0xDEAD_BEEF, (2, 3, 9, 4)
    lead = [np.arange(2)[:, None], np.arange(3)[None, :]]
    host = npb.keyed_keep_mask(key, 0.45, lead, np.arange(9), np.arange(4))
    for slab in (npb.DEVICE_KEEP_SLAB, 2 * 3 * 4 * 2):  # the whole mask; two rows at a time
        monkeypatch.setattr(npb, "DEVICE_KEEP_SLAB", slab)
        np.testing.assert_array_equal(npb.keep_mask(key, 0.45, shape, np, types.SimpleNamespace(id=1)), host)
    assert npb.keep_mask(key, 0.45, shape, np).shape == shape
    assert numpy_as_cupy == [1, 1, None]


def test_keyed_keep_mask_on_a_block_with_numpy_standing_in_for_cupy(numpy_as_cupy, monkeypatch):
    """keyed_keep_mask_on's device branch draws the bits of keyed_keep_mask for a block that
    starts inside the grid (rows 5..11, cols 3..8), at any slab; a 2-D ``rows`` is refused,
    naming it, before any device is entered."""
    from npattn import backend as npb

    key = (0x0123_4567 << 32) | 0x89AB_CDEF
    lead = [np.arange(1, 3)[:, None], np.arange(4)[None, :]]  # b in 1..2, h in 0..3
    rows, cols = np.arange(5, 12), np.arange(3, 9)
    host = npb.keyed_keep_mask(key, 0.3, lead, rows, cols)  # [2, 4, 7, 6]
    assert 0 < host.mean() < 1
    for slab in (npb.DEVICE_KEEP_SLAB, 2 * 4 * 6 * 3):  # whole; three rows at a time
        monkeypatch.setattr(npb, "DEVICE_KEEP_SLAB", slab)
        got = npb.keyed_keep_mask_on(key, 0.3, lead, rows, cols, np, 2)
        assert got.dtype == np.bool_ and got.shape == host.shape
        np.testing.assert_array_equal(got, host)
    assert numpy_as_cupy == [2, 2]
    with pytest.raises(ValueError, match="rows: expected a 1-D array"):
        npb.keyed_keep_mask_on(key, 0.3, lead, rows[None, :], cols, np)
    assert numpy_as_cupy == [2, 2]


# (Hkv, G, Lq, Lk, block_q, block_k): blocks that do not divide the lengths, Lq != Lk, GQA
BLOCKED_DROPOUT_CASES = [(2, 1, 7, 11, 3, 4), (2, 3, 10, 6, 4, 5), (1, 2, 9, 13, 9, 5)]


@pytest.mark.parametrize("Hkv,G,Lq,Lk,bq,bk", BLOCKED_DROPOUT_CASES)
def test_the_blocked_path_draws_its_tiles_with_the_device_branch(numpy_as_cupy, monkeypatch,
                                                                 Hkv, G, Lq, Lk, bq, bk):
    """No GPU needed: with the device branch of the keep-mask draw forced (NumPy standing in for
    CuPy), the blocked forward and backward draw every tile through it, one draw per tile, and
    give bitwise the results of the host draw; dropout_keep_mask (one more draw) and
    blocked_keep_mask are bitwise the reference's host mask."""
    from npattn import attention as A
    from npattn import backend as npb
    from npattn import blocked

    rng = np.random.default_rng(Hkv * 100 + G * 10 + Lq)
    B, Dh = 2, 3
    q = rng.standard_normal((B, Hkv * G, Lq, Dh))  # [B, Hq, Lq, Dh]
    k, v = rng.standard_normal((B, Hkv, Lk, Dh)), rng.standard_normal((B, Hkv, Lk, Dh))
    dout = rng.standard_normal((B, Hkv * G, Lq, Dh))
    kw = dict(dropout_p=0.35, rng=17, enable_gqa=G > 1, impl="blocked", block_q=bq, block_k=bk)
    monkeypatch.setattr(npb, "backend_name", backend_name)  # the host draw first (NumPy's own)
    ref_keep = A.dropout_keep_mask(F.sdpa_forward(q, k, v, dropout_p=0.35, rng=17,
                                                  enable_gqa=G > 1)[1])  # [B, Hq, Lq, Lk]
    assert 0 < ref_keep.mean() < 1
    ref_out, ref_c = A.sdpa_forward(q, k, v, **kw)
    ref_grads = A.sdpa_backward(dout, ref_c)
    np.testing.assert_array_equal(A.dropout_keep_mask(ref_c), ref_keep)
    assert numpy_as_cupy == []
    monkeypatch.setattr(npb, "backend_name", lambda xp: "cupy")  # now the device branch
    tiles = math.ceil(Lq / bq) * math.ceil(Lk / bk)
    for threads in ("1", "3"):  # the whole leading axes, and the tile pool's slices of them
        monkeypatch.setenv("NPATTN_NUM_THREADS", threads)
        numpy_as_cupy.clear()
        out, c = A.sdpa_forward(q, k, v, **kw)
        grads = A.sdpa_backward(dout, c)
        if threads == "1":
            assert len(numpy_as_cupy) == 2 * tiles  # each tile once in the forward, once in the backward
        assert numpy_as_cupy and set(numpy_as_cupy) == {"cpu"}  # on the device of q
        np.testing.assert_array_equal(out, ref_out)
        for name, g, ref in zip(("dq", "dk", "dv"), grads[:3], ref_grads[:3]):
            np.testing.assert_array_equal(g, ref, err_msg=f"{name}, {threads} threads")
        n = len(numpy_as_cupy)
        keep = A.dropout_keep_mask(c)
        assert len(numpy_as_cupy) == n + 1  # the whole mask: one draw
        assert keep.shape == (B, Hkv * G, Lq, Lk)
        np.testing.assert_array_equal(keep, ref_keep)
        np.testing.assert_array_equal(blocked.blocked_keep_mask(c), ref_keep)


@pytest.mark.gpu
@pytest.mark.parametrize("Hkv,G,Lq,Lk,bq,bk", BLOCKED_DROPOUT_CASES)
def test_cupy_blocked_path_draws_its_keep_mask_on_the_device_with_the_host_bits(
        cp_xp, monkeypatch, Hkv, G, Lq, Lk, bq, bk):
    """The blocked path on CuPy hashes every tile's keep-mask on the device (CuPy's draw, once
    per tile in forward and backward); its mask is a CuPy array with exactly NumPy's bits, and
    its output matches NumPy's."""
    import cupy

    from npattn import attention as A
    from npattn import backend as npb

    libs = []
    draw = npb._draw_keep

    def counted(lib, *args):
        libs.append(lib)
        return draw(lib, *args)

    rng = np.random.default_rng(Hkv * 100 + G * 10 + Lq)
    B, Dh = 2, 3
    host = [rng.standard_normal(s) for s in [(B, Hkv * G, Lq, Dh), (B, Hkv, Lk, Dh), (B, Hkv, Lk, Dh),
                                             (B, Hkv * G, Lq, Dh)]]
    kw = dict(dropout_p=0.35, rng=17, enable_gqa=G > 1, impl="blocked", block_q=bq, block_k=bk)
    ref_out, ref_c = A.sdpa_forward(*host[:3], **kw)
    ref_keep = A.dropout_keep_mask(ref_c)
    ref_grads = A.sdpa_backward(host[3], ref_c)
    monkeypatch.setattr(npb, "_draw_keep", counted)
    with cupy.cuda.Device(0):
        q, k, v, dout = (from_numpy(a, cp_xp) for a in host)
        out, c = A.sdpa_forward(q, k, v, **kw)
        grads = A.sdpa_backward(dout, c)
        keep = A.dropout_keep_mask(c)
    tiles = math.ceil(Lq / bq) * math.ceil(Lk / bk)
    assert len(libs) == 2 * tiles + 1 and all(lib is cupy for lib in libs)
    assert isinstance(keep, cupy.ndarray) and keep.dtype == cupy.bool_ and keep.device.id == 0
    np.testing.assert_array_equal(keep.get(), ref_keep)
    for got, ref in zip((out, *grads[:3]), (ref_out, *ref_grads[:3])):
        assert np.max(np.abs(to_numpy(got) - ref)) <= 1e-12 * max(1.0, np.max(np.abs(ref)))


@pytest.mark.gpu
def test_cupy_auto_stays_dense_while_the_device_has_room(cp_xp):
    """impl="auto" on a CUDA device: the dense path while its (B, H, Lq, Lk) arrays fit in
    a share of the device's total memory (the blocked path is launch-bound there)."""
    import cupy as cp
    from npattn import attention as A
    from npattn.backend import accelerator_memory

    total = cp.cuda.Device().mem_info[1]
    q = cp.zeros((1, 1, 8192, 8), cp.float32)  # 2**26 scores: blocked on the CPU
    assert accelerator_memory(q) == total
    fits = A.DENSE_PEAK_ARRAYS * 8192 * 8192 * 4 <= A.AUTO_DEVICE_DENSE_SHARE * total
    assert A.select_impl("auto", q, q, q) == ("reference" if fits else "blocked")
    huge = cp.zeros((1, 1, 2**20, 1), cp.float32)  # 2**40 scores: past any device
    assert A.select_impl("auto", huge, huge, huge) == "blocked"
