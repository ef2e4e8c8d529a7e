"""The module's projections through ``attention.linear_forward/backward``: on NumPy a large
GEMM runs on the tile pool (``numpy_kernel.linear_forward``); the reference
``functional.linear_*`` elsewhere. Same numbers, same checks."""

import numpy as np
import pytest

from npattn import MultiHeadAttention
from npattn import attention as A
from npattn import functional as F
from npattn import numpy_kernel
from npattn.gradcheck import gradcheck


@pytest.fixture
def pooled(monkeypatch):
    """Every projection of the tests' small sizes on the pool, with two threads."""
    monkeypatch.setattr(numpy_kernel, "POOL_MIN_LINEAR", 0)
    monkeypatch.setenv("NPATTN_NUM_THREADS", "2")


def _case(seed, lead, din, dout, bias=True, dtype=np.float64):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((*lead, din)).astype(dtype)
    w = rng.standard_normal((dout, din)).astype(dtype)
    b = rng.standard_normal(dout).astype(dtype) if bias else None
    dy = rng.standard_normal((*lead, dout)).astype(dtype)
    return x, w, b, dy


@pytest.mark.parametrize("lead", [(2, 9), (7,), (3, 2, 5)])
@pytest.mark.parametrize("bias", [True, False])
def test_pooled_projection_matches_the_reference(lead, bias, pooled):
    x, w, b, dy = _case(1, lead, 6, 5, bias)
    assert numpy_kernel.linear_applies(x, w)
    y, c = A.linear_forward(x, w, b)
    y_ref, c_ref = F.linear_forward(x, w, b)
    np.testing.assert_allclose(y, y_ref, rtol=1e-13, atol=1e-13)
    assert isinstance(c, F.LinearCache) and y.shape == y_ref.shape and y.dtype == y_ref.dtype
    for got, want in zip(A.linear_backward(dy, c), F.linear_backward(dy, c_ref)):
        if want is None:
            assert got is None
        else:
            assert got.shape == want.shape
            np.testing.assert_allclose(got, want, rtol=1e-13, atol=1e-13)


def test_the_pool_takes_a_gemm_of_exactly_pool_min_linear_multiply_adds(monkeypatch):
    """``linear_applies`` holds from ``POOL_MIN_LINEAR`` multiply-adds (rows x Din x Dout) on:
    a GEMM of 18 rows, Din 6 and Dout 5 is pooled at 540 and not at 541."""
    x, w, _, _ = _case(5, (2, 9), 6, 5)
    monkeypatch.setattr(numpy_kernel, "POOL_MIN_LINEAR", 18 * 6 * 5)
    assert numpy_kernel.linear_applies(x, w)
    monkeypatch.setattr(numpy_kernel, "POOL_MIN_LINEAR", 18 * 6 * 5 + 1)
    assert not numpy_kernel.linear_applies(x, w)


def test_a_weight_that_is_not_a_matrix_is_named_where_the_pool_would_run(pooled):
    """A ``w`` of one or three axes gets the reference's ValueError naming ``w``, also where a
    matrix of its size would be pooled."""
    x, w, _, _ = _case(4, (2, 9), 6, 5)
    for bad in (w[0], w[None]):
        for linear_forward in (A.linear_forward, F.linear_forward):
            with pytest.raises(ValueError, match=r"w: expected a 2-D weight \(Dout, Din\), got shape"):
                linear_forward(x, bad, None)


def test_a_pooled_projection_of_no_rows_gives_zero_weight_gradients(pooled):
    """x and dy of no rows ((0, 6) and (3, 0, 6)) on the pool: y and dx have no rows, and
    dw and db are zeros, as the reference's sums over no rows."""
    _, w, b, _ = _case(7, (2, 9), 6, 5)
    for lead in ((0,), (3, 0)):
        x, dy = np.ones((*lead, 6)), np.ones((*lead, 5))
        y, c = A.linear_forward(x, w, b)
        y_ref, c_ref = F.linear_forward(x, w, b)
        assert y.shape == y_ref.shape == (*lead, 5)
        for _ in range(3):  # memory freed by one call is what the next one may get
            got = A.linear_backward(dy, c)
            for name, g, want in zip(("dx", "dw", "db"), got, F.linear_backward(dy, c_ref)):
                assert g.shape == want.shape, name
                np.testing.assert_array_equal(g, want, err_msg=name)
            assert not np.any(got[1]) and not np.any(got[2])
            np.multiply(w, 3.0).sum()  # leaves freed (Dout, Din) arrays that are not zero


def test_the_pool_takes_numpy_arrays_only(backend, to_xp, pooled):
    """``linear_applies`` is true of NumPy ``x`` and ``w`` alone: one array of another library
    is the reference's (which names it), even where the GEMM is large enough for the pool."""
    x, w, _, _ = _case(3, (2, 9), 6, 5)
    assert numpy_kernel.linear_applies(x, w)
    if backend == "numpy":
        return
    assert not any(numpy_kernel.linear_applies(*a) for a in ((to_xp(x), w), (x, to_xp(w)),
                                                             (to_xp(x), to_xp(w))))

@pytest.mark.parametrize("lead", [(2, 9), (4, 256), (64, 64)])
def test_pooled_half_precision_dw_is_rounded_once(lead, pooled):
    """In float16 the pool's dw sums its blocks' terms in float32 and rounds once, as the
    reference's single GEMM does: within one float16 ulp of the reference's dw (rounding each
    block's term to float16 and adding them in float16 put it many ulps off)."""
    x, w, _, dy = _case(2, lead, 6, 5, bias=False, dtype=np.float16)
    _, c = A.linear_forward(x, w)
    got = A.linear_backward(dy, c)[1]
    want = F.linear_backward(dy, c)[1]
    assert got.dtype == want.dtype == np.float16
    ulp = np.spacing(np.abs(want)).astype(np.float64)
    assert np.all(np.abs(got.astype(np.float64) - want) <= ulp)


def test_pooled_projection_finite_differences(pooled):
    x, w, b, dy = _case(2, (3, 4), 5, 6)
    dout = np.random.default_rng(3).standard_normal((3, 4, 6))
    report = gradcheck(A.linear_forward, A.linear_backward, [x, w, b], dout=dout)
    assert report.ok, report


@pytest.mark.parametrize("size", [(37, 3, 11, 13), (3, 200, 300, 190)], ids=["small", "multithreaded BLAS"])
def test_pooled_projection_does_not_depend_on_the_thread_count(size, monkeypatch):
    """NPATTN_NUM_THREADS=1 runs the same blocks in order, BLAS held to one thread: bit for bit
    the numbers of 2 and 3 threads, also at a size where BLAS itself would use threads."""
    monkeypatch.setattr(numpy_kernel, "POOL_MIN_LINEAR", 0)
    x, w, b, dy = _case(4, size[:2], size[2], size[3], dtype=np.float32)
    runs = []
    for threads in ("2", "3", "1"):
        monkeypatch.setenv("NPATTN_NUM_THREADS", threads)
        y, c = A.linear_forward(x, w, b)
        runs.append((y, *A.linear_backward(dy, c)))
    for other in runs[1:]:
        for a, b_ in zip(runs[0], other):
            np.testing.assert_array_equal(a, b_)


#: the reference's refusals of a dy of (2, 2, 5) after a forward of y (2, 3, 5), and of a tuple for a cache
DY_SHAPE = r"^dy: expected shape \(2, 3, 5\) \(that of the forward's y\), got \(2, 2, 5\)$"
NOT_A_CACHE = r"^cache: expected a LinearCache \(the cache linear_forward returns\), got tuple$"


def test_pooled_projection_checks_like_the_reference(pooled):
    """Bad input gets the reference's error, naming the argument, and changes nothing."""
    x, w, b, dy = _case(5, (2, 3), 4, 5)
    x0 = x.copy()
    with pytest.raises(TypeError, match=r"^b: expected dtype float64 \(that of x\), got float32 "
                                        r"\(no silent promotion\)$"):
        A.linear_forward(x, w, b.astype(np.float32))
    with pytest.raises(ValueError, match=r"^b: expected shape \(5,\) \(Dout, the output width of w\), "
                                         r"got shape \(2,\)$"):
        A.linear_forward(x, w, b[:2])
    with pytest.raises(ValueError, match=r"^x: expected shape \(\.\.\., 3\) \(Din, the input width of w\), "
                                         r"got shape \(2, 3, 4\)$"):
        A.linear_forward(x, w[:, :3], b)
    np.testing.assert_array_equal(x, x0)
    _, c = A.linear_forward(x, w, b)
    with pytest.raises(ValueError, match=DY_SHAPE):
        A.linear_backward(dy[:, :2], c)
    with pytest.raises(TypeError, match=NOT_A_CACHE):
        A.linear_backward(dy, (x, w, True))


def test_module_on_the_pool_matches_the_reference_module(monkeypatch):
    """A module whose projections run on the pool gives the reference module's output and
    gradients (self- and cross-attention), to rounding in float64."""
    rng = np.random.default_rng(6)
    q_in, kv_in = rng.standard_normal((2, 7, 8)), rng.standard_normal((2, 5, 8))
    dout = rng.standard_normal((2, 7, 8))
    results = []
    for pool_min in (0, 1 << 62):
        monkeypatch.setattr(numpy_kernel, "POOL_MIN_LINEAR", pool_min)
        monkeypatch.setenv("NPATTN_NUM_THREADS", "2")
        m = MultiHeadAttention(8, 2, dtype="float64", seed=7)
        per = []
        for key in (q_in, kv_in):
            out, _ = m(q_in, key, key)
            per.append((out, *m.backward(dout), *m.grads.values()))
        results.append(per)
    for got, want in zip(*results):
        for a, b in zip(got, want):
            np.testing.assert_allclose(a, b, rtol=1e-13, atol=1e-13)


def test_several_projections_in_one_run_match_one_at_a_time(monkeypatch):
    """``linear_backwards`` (the module's q, k, v projections in one run of the pool) gives,
    for each pair, bit for bit what ``linear_backward`` gives for it alone, pooled or not,
    and the reference's numbers to rounding."""
    monkeypatch.setattr(numpy_kernel, "POOL_MIN_LINEAR", 50)  # the (7, 3) x (3, 2) pair stays off
    monkeypatch.setenv("NPATTN_NUM_THREADS", "2")
    cases = [_case(10, (2, 9), 6, 5), _case(11, (7,), 3, 2, bias=False), _case(12, (3, 2, 5), 6, 4)]
    pairs = []
    for x, w, b, dy in cases:
        _, c = A.linear_forward(x, w, b)
        pairs.append((dy, c))
    pooled = [numpy_kernel.linear_applies(c.x, c.w) for _, c in pairs]
    assert pooled == [True, False, True]
    together = A.linear_backwards(pairs)
    assert len(together) == len(pairs)
    for (dy, c), got in zip(pairs, together):
        alone = A.linear_backward(dy, c)
        ref = F.linear_backward(dy, c)
        for g, a, r in zip(got, alone, ref):
            if r is None:
                assert g is None and a is None
                continue
            np.testing.assert_array_equal(g, a)
            np.testing.assert_allclose(g, r, rtol=1e-13, atol=1e-13)


def test_several_projections_are_all_checked_before_any_runs(pooled, monkeypatch):
    """A bad second pair is the reference's error naming ``dy``, raised before the pool runs."""
    x, w, b, dy = _case(13, (2, 3), 4, 5)
    _, c = A.linear_forward(x, w, b)
    ran = []
    real = numpy_kernel.linear_backwards
    monkeypatch.setattr(numpy_kernel, "linear_backwards", lambda p: ran.append(p) or real(p))
    with pytest.raises(ValueError, match=DY_SHAPE):
        A.linear_backwards([(dy, c), (dy[:, :2], c)])
    with pytest.raises(TypeError, match=NOT_A_CACHE):
        A.linear_backwards([(dy, c), (dy, (x, w, True))])
    assert ran == []
    assert len(A.linear_backwards([(dy, c), (dy, c)])) == 2 and len(ran) == 1
