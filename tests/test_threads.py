"""Threads, the tile pool and fork: the thread count never changes a number.

The NumPy kernel and the blocked path run independent tiles on a pool of
``npattn.backend`` with BLAS held to one thread, under one process-wide lock
(``backend.exclusive``). Here: the same results, bit for bit, for 1, 2 or 3
pool threads; two Python threads running their own modules at once get what
each would get alone; BLAS's thread count is restored afterwards; a forked
child makes its own pool and finishes; a bad ``NPATTN_NUM_THREADS`` is refused
before anything is computed; and a module whose forward or backward fails
keeps its cache, gradients and dropout generator as they were.
"""

import os
import pickle
import re
import select
import signal
import sys
import threading
import time
import traceback

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import npattn.attention
from npattn import MultiHeadAttention, blocked, numpy_kernel
from npattn import attention as A
from npattn import functional as F
from npattn.backend import blas_controller, pool_threads

from _attention_cases import make_inputs

#: The tile pool runs its tiles one after another without threadpoolctl (BLAS cannot be held
#: to one thread there): the tests that watch it split the work need it (the test extra has it).
needs_pool = pytest.mark.skipif(npattn.backend.blas_controller() is None,
                                reason="the tile pool needs threadpoolctl to run tiles on threads")

def _inputs(seed, B, Hkv, G, Lq, Lk, Dh, Dv, mask_kind="none", dropout="none", causal=False,
            dtype=np.float64):
    """The shared cases, with a (B, 1, Lq, Lk) mask (broadcast over heads) that blanks a row."""
    return make_inputs(seed, B, Hkv, G, Lq, Lk, Dh, Dv, mask_kind=mask_kind, mask_form="B1LqLk",
                       dropout=dropout, causal=causal, dtype=dtype)


class PoolRecorder:
    """Wraps ``run_tasks`` where the kernel and the blocked path call it: records
    ``(number of tasks, threads)`` per call and the threads that ran a task."""

    def __init__(self, mp, probe_blas=False):
        from npattn import backend

        self.calls, self.idents, self.blas_in_tasks = [], set(), set()
        self.where = {"numpy": [], "blocked": []}  # the calls of each caller
        real = backend.run_tasks

        def recorded(fn, tasks, threads, where):
            self.calls.append((len(tasks), threads))
            self.where[where].append((len(tasks), threads))

            def task(*a):
                self.idents.add(threading.get_ident())
                if probe_blas:  # BLAS threads as a tile sees them, of the libraries that
                    # npattn holds (NumPy's among them: checked below); one loaded after
                    # npattn first held BLAS (SciPy's own OpenBLAS, by another test) keeps its count
                    import threadpoolctl

                    held = {lc.filepath for lc in backend.blas_controller().lib_controllers
                            if lc.user_api == "blas"}
                    assert {path for path, _ in BLAS_AT_IMPORT} <= held, "NumPy's BLAS not held"
                    self.blas_in_tasks.update(p["num_threads"] for p in
                                              threadpoolctl.threadpool_info()
                                              if p["filepath"] in held)
                return fn(*a)

            return real(task, tasks, threads)

        mp.setattr(numpy_kernel, "run_tasks", lambda *a: recorded(*a, "numpy"))
        mp.setattr(blocked, "run_tasks", lambda *a: recorded(*a, "blocked"))

    def split(self, where=None):
        """Whether some call (of ``where``, or any) handed several tasks to several threads."""
        calls = self.calls if where is None else self.where[where]
        return any(n >= 2 and t >= 2 for n, t in calls)


def _run(impl, q, k, v, dout, kw, **extra):
    out, cache = A.sdpa_forward(q, k, v, impl=impl, **kw, **extra)
    return (out, *A.sdpa_backward(dout, cache))


# --------------------------------------------------------------------------
# the thread count changes nothing


@needs_pool
@given(
    seed=st.integers(0, 2**16),
    B=st.integers(1, 3),
    Hkv=st.integers(1, 3),
    G=st.integers(1, 2),
    Lq=st.integers(2, 11),
    Lk=st.integers(2, 11),
    Dv=st.integers(2, 4),
    mask_kind=st.sampled_from(["none", "bool", "float"]),
    causal=st.booleans(),
    dropout=st.sampled_from(["none", "seed", "mask"]),
)
def test_pool_threads_never_change_the_numbers(seed, B, Hkv, G, Lq, Lk, Dv, mask_kind, causal,
                                               dropout):
    """1, 2 and 3 pool threads give bitwise the results of 1; both equal the reference."""
    args = _inputs(seed, B, Hkv, G, Lq, Lk, 3, Dv, mask_kind, dropout, causal)
    q, k, v, dout, kw = args
    ref_out, ref_c = F.sdpa_forward(q, k, v, **kw)
    ref = (ref_out, *F.sdpa_backward(dout, ref_c))
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(numpy_kernel, "TILE_ELEMS", 1)  # one K/V head per tile
        mp.setattr(numpy_kernel, "POOL_MIN_SCORES", 0)  # the pool even for tiny shapes
        for impl, extra in (("numpy", {}), ("blocked", dict(block_q=3, block_k=4))):
            results = {}
            for threads in ("1", "2", "3"):
                mp.setenv("NPATTN_NUM_THREADS", threads)
                rec = PoolRecorder(mp)
                results[threads] = _run(impl, *args, **extra)
                if threads != "1" and B * Hkv >= 2 and not (impl == "blocked" and
                                                            mask_kind == "float"):
                    assert rec.split(), f"{impl}: the pool did not split the work ({rec.calls})"
                if impl == "blocked" and mask_kind == "float":
                    assert not rec.split()  # dmask sums over every slice: one piece
            for threads, res in results.items():
                for name, a, b in zip(("out", "dq", "dk", "dv", "dmask"), res, results["1"]):
                    if b is None:
                        assert a is None
                        continue
                    np.testing.assert_array_equal(a, b, err_msg=f"{impl} {name}, {threads} threads")
            for name, a, b in zip(("out", "dq", "dk", "dv", "dmask"), results["1"], ref):
                if b is not None:
                    scale = max(np.max(np.abs(b), initial=0.0), 1.0)
                    np.testing.assert_allclose(a, b, rtol=1e-12, atol=1e-12 * scale,
                                               err_msg=f"{impl} {name}")


@needs_pool
def test_blocked_segments_on_the_pool_are_each_slices_own(monkeypatch):
    """Segment ids (B, L) on the blocked path's pool: the work is split along the batch (the
    longest leading axis), and each slice reads its own batch entries' query and key segments,
    so 1 and 2 threads give bitwise the same out and gradients, equal to the reference's
    (float64, Lq != Lk, a random dout)."""
    rng = np.random.default_rng(29)
    B, H, Lq, Lk, Dh, Dv = 3, 2, 7, 6, 4, 3
    q, k, v, dout = (rng.standard_normal(s) for s in ((B, H, Lq, Dh), (B, H, Lk, Dh),
                                                      (B, H, Lk, Dv), (B, H, Lq, Dv)))
    q_seg = np.array([[0, 0, 0, 1, 1, 1, 1], [0, 0, 0, 0, 0, 0, 0], [0, 1, 1, 2, 2, 2, 2]])  # [B, Lq]
    k_seg = np.array([[0, 0, 1, 1, 1, 1], [0, 0, 0, 1, 1, 1], [0, 0, 1, 1, 2, 2]])  # [B, Lk]
    seg = dict(q_segments=q_seg, k_segments=k_seg)
    ref_out, ref_c = A.sdpa_forward(q, k, v, impl="reference", **seg)
    ref = (ref_out, *A.sdpa_backward(dout, ref_c)[:3])
    results = {}
    for threads in ("1", "2"):
        monkeypatch.setenv("NPATTN_NUM_THREADS", threads)
        rec = PoolRecorder(monkeypatch)
        out, cache = A.sdpa_forward(q, k, v, impl="blocked", block_q=3, block_k=4, **seg)
        results[threads] = (out, *A.sdpa_backward(dout, cache)[:3])
        assert rec.split() == (threads != "1"), rec.calls
    for name, a, b, r in zip(("out", "dq", "dk", "dv"), results["2"], results["1"], ref):
        np.testing.assert_array_equal(a, b, err_msg=f"{name}, 2 threads")
        np.testing.assert_allclose(b, r, rtol=1e-12, atol=1e-12, err_msg=name)


@needs_pool
def test_blocked_half_precision_on_the_pool_keeps_float32_rows(monkeypatch):
    """float16 inputs on the blocked path's pool: each slice's output and row statistics are
    float32 (the compute dtype) where the tasks write them, as on one thread, so out and every
    gradient are bitwise those of one thread (delta = rowsum(dout * out) reads the saved out).
    The backward hands its slices to the pool as the forward does."""
    rng = np.random.default_rng(17)
    B, H, Lq, Lk, Dh = 2, 3, 7, 6, 4
    q, k, v, dout = (rng.standard_normal(s).astype(np.float16)
                     for s in ((B, H, Lq, Dh), (B, H, Lk, Dh), (B, H, Lk, Dh), (B, H, Lq, Dh)))
    mask = rng.random((B, 1, Lq, Lk)) > 0.3  # bool: the pool splits (a float mask would not)
    results = {}
    for threads in ("1", "2"):
        monkeypatch.setenv("NPATTN_NUM_THREADS", threads)
        rec = PoolRecorder(monkeypatch)
        out, cache = blocked.sdpa_blocked_forward(q, k, v, mask=mask, is_causal=True,
                                                  block_q=3, block_k=4)
        assert rec.split() == (threads != "1"), rec.calls
        assert out.dtype == np.float16
        assert cache.out.dtype == cache.m.dtype == cache.l.dtype == np.float32, threads
        rec = PoolRecorder(monkeypatch)  # the backward's calls alone
        results[threads] = (out, *blocked.sdpa_blocked_backward(dout, cache)[:3])
        assert rec.split() == (threads != "1"), f"backward: {rec.calls}"
    for name, a, b in zip(("out", "dq", "dk", "dv"), results["2"], results["1"]):
        np.testing.assert_array_equal(a, b, err_msg=f"{name}, 2 threads")


def _in_layout(a, layout):
    """``a`` (B, H, L, D) with the same values in another memory layout (a view)."""
    if layout == "fortran":  # batch fastest: no unit stride in the last two axes
        return np.asfortranarray(a)
    if layout == "transposed":  # each matrix stored column by column
        return np.ascontiguousarray(np.swapaxes(a, -1, -2)).swapaxes(-1, -2)
    if layout == "reversed":  # rows in reverse order (negative row stride)
        return np.ascontiguousarray(a[..., ::-1, :])[..., ::-1, :]
    if layout == "strided":  # every other element of a wider array
        wide = np.zeros(a.shape[:-1] + (2 * a.shape[-1],))
        wide[..., ::2] = a
        return wide[..., ::2]
    if layout == "heads_first":  # (H, B, L, D) in memory: leading axes only
        return np.ascontiguousarray(a.transpose(1, 0, 2, 3)).transpose(1, 0, 2, 3)
    raise AssertionError(layout)


@needs_pool
@pytest.mark.parametrize("layout", ["fortran", "transposed", "reversed", "strided", "heads_first"])
@pytest.mark.parametrize("Dh", [1, 4])
@pytest.mark.parametrize("impl", ["numpy", "blocked"])
def test_any_memory_layout_gets_the_bits_of_c_order_on_any_pool(impl, Dh, layout, monkeypatch):
    """The same values in another memory layout (which NumPy's matmul would hand to another
    BLAS routine or its own loop, adding in another order) give bitwise the results of
    C-ordered inputs, on 1 and 2 pool threads, causal and not."""
    monkeypatch.setattr(numpy_kernel, "TILE_ELEMS", 1)  # one K/V head per tile
    monkeypatch.setattr(numpy_kernel, "POOL_MIN_SCORES", 0)
    extra = dict(block_q=5, block_k=7) if impl == "blocked" else {}
    rng = np.random.default_rng(2)
    B, H, Lq, Lk, Dv = 3, 2, 33, 11, 3
    c_args = (rng.standard_normal((B, H, Lq, Dh)), rng.standard_normal((B, H, Lk, Dh)),
              rng.standard_normal((B, H, Lk, Dv)), rng.standard_normal((B, H, Lq, Dv)))
    args = tuple(_in_layout(a, layout) for a in c_args)
    assert all(np.array_equal(a, c) for a, c in zip(args, c_args))
    assert not any(a.flags.c_contiguous for a in args[2:])  # (Dh = 1: q, k may still be)
    for causal in (False, True):
        kw = dict(is_causal=causal)
        monkeypatch.setenv("NPATTN_NUM_THREADS", "1")
        want = _run(impl, *c_args, kw, **extra)
        for threads in ("1", "2"):
            monkeypatch.setenv("NPATTN_NUM_THREADS", threads)
            rec = PoolRecorder(monkeypatch)
            got = _run(impl, *args, kw, **extra)
            if threads == "2":
                assert rec.split(), f"{impl}: the pool did not split the work ({rec.calls})"
            for name, a, b in zip(("out", "dq", "dk", "dv"), got, want):
                np.testing.assert_array_equal(a, b, err_msg=f"{impl} {name}, causal={causal}, "
                                                            f"{threads} threads")


def test_row_major_copies_any_matrix_that_is_not_row_major_two_axes_included():
    """row_major looks at the last two axes only: a (Lq, Dh) matrix with no leading axes
    (which every implementation takes) is copied when it is not row-major, like one of
    (B, H, Lq, Dh); a row-major one, a vector and a broadcast batch are left as they are.
    Rows that overlap (each one entry after the last, unit stride along them) are not apart:
    copied too."""
    from numpy.lib.stride_tricks import as_strided

    from npattn.backend import row_major

    a = np.arange(12.0).reshape(3, 4)
    overlapping = as_strided(np.arange(6.0), shape=(3, 4), strides=(8, 8), writeable=False)
    for name, m in (("fortran", np.asfortranarray(a)), ("reversed", a[::-1]),
                    ("strided", np.repeat(a, 2, axis=1)[:, ::2]), ("overlapping", overlapping)):
        got = row_major(m)
        assert got.flags.c_contiguous and np.array_equal(got, m), name
    rows_apart = np.zeros((3, 6))[:, :4]  # unit stride along the rows, the rows 6 apart: row-major
    assert row_major(rows_apart) is rows_apart
    assert row_major(a) is a
    vector = np.arange(8.0)[::2]
    assert row_major(vector) is vector
    batch = np.broadcast_to(a, (2, 3, 4))  # leading stride 0, row-major matrices
    assert row_major(batch) is batch


# --------------------------------------------------------------------------
# fork


# JAX, once an earlier test has used it, warns at every fork that its threads could deadlock
# the child; the children here use neither JAX nor its threads, and _in_forked_child kills a
# child that does not finish, failing the test rather than hanging it.
FORK_UNDER_JAX = "ignore:os.fork\\(\\) was called.*JAX:RuntimeWarning"
# Python 3.12 and later warn at a fork in a process with threads, which these tests make on
# purpose: the tile pool's, and the threads inside npattn or holding BLAS while the fork happens.
FORK_WITH_THREADS = "ignore:This process .* is multi-threaded, use of fork\\(\\):DeprecationWarning"


def _in_forked_child(fn, timeout=60.0):
    """Run ``fn()`` in a forked child; its pickled result comes back through a pipe.

    Fails the test when the child does not finish within ``timeout`` seconds
    (it is killed), dies, or raises (its traceback is shown).
    """
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: never return into pytest
        code = 1
        try:
            os.close(r)
            try:
                payload = ("ok", fn())
            except BaseException:
                payload = ("error", traceback.format_exc())
            data = pickle.dumps(payload)
            view = memoryview(data)
            while view:
                view = view[os.write(w, view):]
            os.close(w)
            code = 0
        finally:
            os._exit(code)
    os.close(w)
    deadline = time.monotonic() + timeout
    chunks = []
    try:
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
                pytest.fail(f"the forked child did not finish within {timeout:.0f} s (killed)")
            ready, _, _ = select.select([r], [], [], left)
            if ready:
                chunk = os.read(r, 1 << 20)
                if not chunk:
                    break
                chunks.append(chunk)
    finally:
        os.close(r)
    while True:  # the pipe is closed: the child is exiting
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        if time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            pytest.fail("the forked child closed its pipe but did not exit (killed)")
        time.sleep(0.01)
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0, f"child status {status}"
    kind, value = pickle.loads(b"".join(chunks))
    assert kind == "ok", f"the forked child raised:\n{value}"
    return value


@needs_pool
@pytest.mark.filterwarnings(FORK_UNDER_JAX)
@pytest.mark.filterwarnings(FORK_WITH_THREADS)
def test_a_forked_child_runs_the_pool_and_gets_the_same_numbers(monkeypatch):
    monkeypatch.setattr(numpy_kernel, "TILE_ELEMS", 64)
    monkeypatch.setattr(numpy_kernel, "POOL_MIN_SCORES", 0)
    monkeypatch.setenv("NPATTN_NUM_THREADS", "2")
    rec = PoolRecorder(monkeypatch)
    args = _inputs(1, 2, 2, 2, 40, 33, 8, 4, "bool", "seed", causal=True, dtype=np.float32)

    def work():
        rec.calls.clear()
        rec.idents.clear()
        res = [_run("numpy", *args), _run("blocked", *args, block_q=16, block_k=8)]
        pool_used = (rec.split("numpy") and rec.split("blocked")
                     and bool(rec.idents - {threading.get_ident()}))
        return res, pool_used, os.getpid()

    parent, used, pid = work()  # the pool and its threads now exist in the parent
    assert used, "the parent did not run tiles on the pool"
    child, used_in_child, child_pid = _in_forked_child(work)
    assert child_pid != pid
    assert used_in_child, "the child did not run tiles on a pool of its own"
    for res_p, res_c in zip(parent, child):
        for a, b in zip(res_p, res_c):
            if a is None:
                assert b is None
            else:
                np.testing.assert_array_equal(a, b)
    again, _, _ = work()  # and the parent's pool still works after the fork
    for a, b in zip(again[0], parent[0]):
        if a is not None:
            np.testing.assert_array_equal(a, b)


@pytest.mark.filterwarnings(FORK_UNDER_JAX)
@pytest.mark.filterwarnings(FORK_WITH_THREADS)
def test_fork_while_another_thread_is_inside_npattn(monkeypatch):
    """A thread holds npattn's lock (it is computing) when the process forks: the child has no
    such thread, so it must not inherit the lock held; its forward finishes."""
    from npattn.backend import exclusive

    monkeypatch.setattr(numpy_kernel, "TILE_ELEMS", 64)
    monkeypatch.setattr(numpy_kernel, "POOL_MIN_SCORES", 0)
    monkeypatch.setenv("NPATTN_NUM_THREADS", "2")
    args = _inputs(4, 2, 2, 1, 24, 20, 4, 4, dropout="seed")
    expected = _run("numpy", *args)
    inside, release = threading.Event(), threading.Event()

    def hold():
        with exclusive():
            inside.set()
            release.wait(120)

    t = threading.Thread(target=hold)
    t.start()
    try:
        assert inside.wait(30)
        child = _in_forked_child(lambda: _run("numpy", *args), timeout=60)
    finally:
        release.set()
        t.join(30)
    for a, b in zip(child, expected):
        if b is not None:
            np.testing.assert_array_equal(a, b)


@pytest.mark.filterwarnings(FORK_UNDER_JAX)
@pytest.mark.filterwarnings(FORK_WITH_THREADS)
def test_fork_while_another_thread_holds_blas_gives_the_child_its_blas_threads(monkeypatch):
    """A thread inside npattn holds BLAS to one thread when the process forks: that thread is
    not in the child and never gives the count back, so the child restores it; its BLAS
    runs with the parent's threads (the count may change the last bits of BLAS's results)."""
    from npattn.backend import exclusive, limit_blas_threads

    pytest.importorskip("threadpoolctl", reason="BLAS thread counts need threadpoolctl")
    monkeypatch.setattr(numpy_kernel, "TILE_ELEMS", 64)
    monkeypatch.setattr(numpy_kernel, "POOL_MIN_SCORES", 0)
    monkeypatch.setenv("NPATTN_NUM_THREADS", "2")
    before = _blas_threads()
    if all(n == 1 for _, n in before):
        pytest.skip("BLAS runs on one thread here: a hold to one thread changes nothing")
    args = _inputs(2, 2, 2, 1, 24, 20, 4, 4, dropout="seed")
    expected = _run("numpy", *args)
    inside, release = threading.Event(), threading.Event()

    def hold():
        with exclusive(), limit_blas_threads(1):
            inside.set()
            release.wait(120)

    def child():
        out = _run("numpy", *args)
        return out, dict(_blas_info())

    t = threading.Thread(target=hold)
    t.start()
    try:
        assert inside.wait(30)
        out, blas = _in_forked_child(child, timeout=60)
    finally:
        release.set()
        t.join(30)
    assert [(path, blas.get(path)) for path, _ in before] == before
    for a, b in zip(out, expected):
        if b is not None:
            np.testing.assert_array_equal(a, b)
    assert _blas_threads() == before


@pytest.mark.filterwarnings(FORK_UNDER_JAX)
@pytest.mark.filterwarnings(FORK_WITH_THREADS)
def test_fork_while_another_thread_is_inside_nested_holds():
    """Another thread is inside two nested BLAS holds at the fork: the child restores the
    counts from before the outer one (the inner one found them at 1), and gives up
    threadpoolctl's control of OpenBLAS, so that a hold a new thread takes in the child holds."""
    from npattn.backend import limit_blas_threads

    before = _blas_threads()
    if all(n == 1 for _, n in before):
        pytest.skip("BLAS runs on one thread here: a hold to one thread changes nothing")
    inside, release = threading.Event(), threading.Event()

    def hold():
        with limit_blas_threads(1), limit_blas_threads(1):
            inside.set()
            release.wait(120)

    def child():
        after_fork, seen = dict(_blas_info()), []

        def held():
            with limit_blas_threads(1):
                seen.append(dict(_blas_info()))

        t = threading.Thread(target=held)
        t.start()
        t.join(30)
        return after_fork, seen[0], dict(_blas_info())

    t = threading.Thread(target=hold)
    t.start()
    try:
        assert inside.wait(30)
        after_fork, in_hold, after = _in_forked_child(child, timeout=60)
    finally:
        release.set()
        t.join(30)
    assert [(path, after_fork.get(path)) for path, _ in before] == before
    assert [(path, in_hold.get(path)) for path, _ in before] == [(path, 1) for path, _ in before]
    assert [(path, after.get(path)) for path, _ in before] == before
    assert _blas_threads() == before


@pytest.mark.filterwarnings(FORK_UNDER_JAX)
@pytest.mark.filterwarnings(FORK_WITH_THREADS)
@pytest.mark.parametrize("another", [False, True], ids=["alone", "another thread holds too"])
def test_fork_from_inside_a_hold_of_its_own_keeps_it_in_the_child(another):
    """The forking thread is inside a BLAS hold (alone, or while another thread holds): in the
    child that hold stands, BLAS at one thread, and ends as it began; no count is restored
    under it."""
    from npattn.backend import limit_blas_threads

    before = _blas_threads()
    if all(n == 1 for _, n in before):
        pytest.skip("BLAS runs on one thread here: a hold to one thread changes nothing")
    inside, release = threading.Event(), threading.Event()

    def hold():
        with limit_blas_threads(1):
            inside.set()
            release.wait(120)

    t = threading.Thread(target=hold)
    if another:
        t.start()
        assert inside.wait(30)
    try:
        with limit_blas_threads(1):
            counts = _in_forked_child(lambda: dict(_blas_info()), timeout=60)
    finally:
        release.set()
        if another:
            t.join(30)
    assert [(path, counts.get(path)) for path, _ in before] == [(path, 1) for path, _ in before]
    assert _blas_threads() == before


def test_a_thread_that_held_blas_leaves_the_hold_to_others():
    """A thread that held BLAS and lives on (a dask worker, say) must not keep threadpoolctl's
    control of OpenBLAS's count: another thread's hold afterwards holds."""
    from npattn.backend import limit_blas_threads

    threadpoolctl = pytest.importorskip("threadpoolctl", reason="BLAS thread counts need threadpoolctl")
    before = _blas_threads()
    if all(n == 1 for _, n in before):
        pytest.skip("BLAS runs on one thread here: a hold to one thread changes nothing")
    held, done = threading.Event(), threading.Event()
    counts = []

    def hold_once_and_live_on():
        with limit_blas_threads(1):
            pass
        held.set()
        done.wait(60)

    def hold_and_look():  # a thread that has not held before (nor has any other test run in it)
        with limit_blas_threads(1):
            counts.extend(p["num_threads"] for p in threadpoolctl.threadpool_info()
                          if p["filepath"] in {path for path, _ in before})

    t = threading.Thread(target=hold_once_and_live_on)
    t.start()
    try:
        assert held.wait(30)
        other = threading.Thread(target=hold_and_look)
        other.start()
        other.join(30)
    finally:
        done.set()
        t.join(30)
    assert counts and set(counts) == {1}
    assert _blas_threads() == before


@needs_pool
def test_a_pool_call_holds_blas_while_another_thread_is_inside_its_own_limit(monkeypatch):
    """The caller's thread holds BLAS at n threads (``threadpool_limits``, which from
    threadpoolctl 3.8 on makes it the one thread allowed to change OpenBLAS's count) and runs
    npattn in a worker thread: the tiles still run with BLAS at one thread (a hold that did
    nothing ran them on n, whose last bits can differ), the numbers are those of the call
    alone, the caller's count is n again after it, and the caller's own limit restores the
    count it found when it ends."""
    threadpoolctl = pytest.importorskip("threadpoolctl", reason="BLAS thread counts need threadpoolctl")
    before = _blas_threads()
    paths = {path for path, _ in before}

    def counts():
        return {p["num_threads"] for p in threadpoolctl.threadpool_info() if p["filepath"] in paths}

    monkeypatch.setattr(numpy_kernel, "POOL_MIN_SCORES", 0)
    monkeypatch.setattr(numpy_kernel, "TILE_ELEMS", 256)
    monkeypatch.setenv("NPATTN_NUM_THREADS", "2")
    q, k, v, dout, kw = _inputs(7, 2, 2, 1, 9, 11, 4, 3, mask_kind="bool", causal=True)
    rec = PoolRecorder(monkeypatch, probe_blas=True)
    alone = _run("numpy", q, k, v, dout, kw)
    assert rec.split("numpy") and rec.blas_in_tasks == {1}
    rec.blas_in_tasks.clear()
    got, errors = [], []

    def worker():
        try:
            got.append(_run("numpy", q, k, v, dout, kw))
        except BaseException:
            errors.append(traceback.format_exc())

    n = max(n for _, n in before) + 1  # a count npattn does not hold at, nor BLAS has at start
    with threadpoolctl.threadpool_limits(limits=n, user_api="blas"):
        if counts() != {n}:
            pytest.skip(f"BLAS does not take {n} threads here")
        t = threading.Thread(target=worker)
        t.start()
        t.join(60)
        assert not t.is_alive(), "the worker did not finish"
        assert counts() == {n}, "the caller's count was not given back"
    assert not errors, "\n".join(errors)
    assert rec.blas_in_tasks == {1}, "tiles ran on the caller's BLAS threads"
    for i, (a, b) in enumerate(zip(got[0], alone)):
        np.testing.assert_array_equal(a, b, err_msg=f"output/gradient #{i}")
    assert _blas_threads() == before


def _turns():
    """threadpoolctl from 3.8 on (one thread at a time has the turn to change OpenBLAS's
    count; skipped before), the BLAS counts at the start, their libraries' paths, and a reader
    of those libraries' counts now."""
    threadpoolctl = pytest.importorskip("threadpoolctl", reason="BLAS thread counts need threadpoolctl")
    if getattr(threadpoolctl, "CONTROLLING_THREAD_OWNERSHIP", None) is None:
        pytest.skip("threadpoolctl before 3.8 lets every thread change the count: no turn to keep")
    before = _blas_threads()
    paths = {path for path, _ in before}

    def counts():
        return {p["num_threads"] for p in threadpoolctl.threadpool_info() if p["filepath"] in paths}

    return threadpoolctl, before, paths, counts


def _seen_by_another_thread(threadpoolctl, counts, limit):
    """What the counts are inside ``threadpool_limits(limit)`` in a new thread: ``[{limit}]``
    where that thread gets the turn, the counts as they were where another thread has it."""
    seen = []

    def other():
        with threadpoolctl.threadpool_limits(limits=limit, user_api="blas"):
            seen.append(counts())

    o = threading.Thread(target=other)
    o.start()
    o.join(30)
    return seen


@needs_pool
def test_a_limit_that_ends_while_npattn_holds_blas_leaves_the_count_to_other_threads():
    """The caller's threadpool_limits ends while a worker thread's npattn call holds BLAS (its
    restore is ignored then, as documented). The caller has left its limit, so it has no turn
    to keep: another thread's threadpool_limits(n) afterwards holds BLAS at n, as it would had
    npattn not run. Handing the turn back to the caller's thread after the call kept it there
    for the rest of the process (the main thread never ends), and every other thread's limit
    did nothing without a word."""
    from npattn import backend

    threadpoolctl, before, paths, counts = _turns()
    n = max(m for _, m in before) + 1
    inside, release, errors = threading.Event(), threading.Event(), []

    def task(i):
        inside.set()
        release.wait(10)

    def worker():
        try:
            with backend.exclusive():
                backend.run_tasks(task, [(0,), (1,)], 2)
        except BaseException:
            errors.append(traceback.format_exc())

    with threadpoolctl.threadpool_limits(limits=n, user_api="blas"):
        if counts() != {n}:
            pytest.skip(f"BLAS does not take {n} threads here")
        t = threading.Thread(target=worker)
        t.start()
        assert inside.wait(10), "the worker's tiles did not start"
    release.set()
    t.join(30)
    assert not t.is_alive() and not errors, errors
    try:
        seen = _seen_by_another_thread(threadpoolctl, counts, n + 1)
        assert seen == [{n + 1}], f"another thread's limit of {n + 1} was ignored: {seen}"
    finally:  # the counts at start again (the caller's restore was ignored), and no turn kept
        for lib in backend.blas_controller().lib_controllers:
            if lib.filepath in paths:
                lib.set_num_threads(dict(before)[lib.filepath])
        threadpoolctl.OpenBLASController.clear_controlling_thread()
    assert _blas_threads() == before


def test_a_hold_inside_the_callers_own_limit_leaves_the_caller_its_turn():
    """The caller's thread is inside its own threadpool_limits (from threadpoolctl 3.8 on, the
    one thread whose changes to OpenBLAS's count take effect) and runs npattn's tasks in that
    thread: afterwards the caller still has that turn, as threadpoolctl gave it, so another
    thread's limit is ignored as it is without npattn, and the caller's limit restores the count
    it found. A hold that gave up a turn it had not taken let the other thread's limit through
    in the middle of the caller's."""
    from npattn import backend

    threadpoolctl, before, paths, counts = _turns()
    n = max(m for _, m in before) + 1

    with threadpoolctl.threadpool_limits(limits=n, user_api="blas"):
        if counts() != {n}:
            pytest.skip(f"BLAS does not take {n} threads here")
        assert _seen_by_another_thread(threadpoolctl, counts, n + 1) == [{n}]  # threadpoolctl's rule
        with backend.exclusive():
            backend.run_tasks(lambda i: None, [(0,), (1,)], 2)
        assert counts() == {n}
        seen = _seen_by_another_thread(threadpoolctl, counts, n + 1)
        assert seen == [{n}], "npattn's hold gave up the caller's turn"
    assert _blas_threads() == before


def test_a_hold_in_a_thread_inside_its_own_ignored_limit_gives_up_the_turn_it_took():
    """A worker thread inside its own threadpool_limits (ignored: the caller's thread, inside its
    limit, has the turn to change OpenBLAS's count) runs npattn's tasks, whose hold takes the turn
    from the caller. The hold gives it up when it ends although the worker is still inside its
    own limit (which does not give it up until it ends): the caller's limit then restores the
    count it found, and a third thread's limit takes effect. A hold that left the turn with the
    worker ignored the caller's restore and every other thread's limit until the worker's ended."""
    from npattn import backend

    threadpoolctl, before, paths, counts = _turns()
    n = max(m for _, m in before) + 1
    ran, release, errors = threading.Event(), threading.Event(), []

    def worker():
        try:
            with threadpoolctl.threadpool_limits(limits=n + 1, user_api="blas"):  # ignored
                with backend.exclusive():
                    backend.run_tasks(lambda i: None, [(0,), (1,)], 2)
                ran.set()
                release.wait(10)
        except BaseException:
            errors.append(traceback.format_exc())

    w = threading.Thread(target=worker)
    try:
        with threadpoolctl.threadpool_limits(limits=n, user_api="blas"):
            if counts() != {n}:
                pytest.skip(f"BLAS does not take {n} threads here")
            w.start()
            assert ran.wait(10), "the worker's tasks did not run"
            assert counts() == {n}  # the worker's own limit was ignored; its hold restored n
        assert _blas_threads() == before, "the caller's limit did not restore the count it found"
        seen = _seen_by_another_thread(threadpoolctl, counts, n + 2)
        assert seen == [{n + 2}], f"another thread's limit of {n + 2} was ignored: {seen}"
    finally:  # the worker's limit restores the count it found (n) when it ends: put back the one
        release.set()  # at start, and leave no turn behind
        w.join(30)
        for lib in backend.blas_controller().lib_controllers:
            if lib.filepath in paths:
                lib.set_num_threads(dict(before)[lib.filepath])
        threadpoolctl.OpenBLASController.clear_controlling_thread(force=True)
    assert not w.is_alive() and not errors, errors
    assert _blas_threads() == before


@pytest.mark.parametrize("where", ["setting", "restoring"])
def test_an_interrupt_inside_threadpoolctl_leaves_blas_as_it_was(where, monkeypatch):
    """Ctrl-C lands inside threadpoolctl while a hold sets BLAS to one thread (once the count is
    set, before the limiter comes back) or while it restores it (before the count is set back):
    the KeyboardInterrupt comes out, and BLAS's count is the one before the call, not one
    thread for the rest of the process; another thread's limit takes effect afterwards (the hold
    keeps no turn to change the count: one that kept it ignored every other thread's limit); the
    next hold holds and restores as before."""
    from npattn import backend

    threadpoolctl = pytest.importorskip("threadpoolctl", reason="BLAS thread counts need threadpoolctl")
    before = _blas_threads()
    if all(n == 1 for _, n in before):
        pytest.skip("BLAS runs on one thread here: a count left at one is not told apart")
    ctl = backend.blas_controller()
    real_limit = ctl.limit

    def interrupted_limit(*a, **kw):
        limiter = real_limit(*a, **kw)  # the count is one thread from here
        if where == "setting":
            raise KeyboardInterrupt

        def restore():  # interrupted before it sets anything back
            raise KeyboardInterrupt

        monkeypatch.setattr(limiter, "restore_original_limits", restore)
        return limiter

    monkeypatch.setattr(ctl, "limit", interrupted_limit)
    ran = []
    with pytest.raises(KeyboardInterrupt):
        backend.run_tasks(lambda i: ran.append(i), [(0,), (1,)], 2)
    assert sorted(ran) == ([] if where == "setting" else [0, 1])  # the tasks run inside the hold
    assert _blas_threads() == before
    paths = {path for path, _ in before}

    def counts():
        return {p["num_threads"] for p in threadpoolctl.threadpool_info() if p["filepath"] in paths}

    # the interrupted hold kept no turn to change the count: another thread's limit holds
    seen = _seen_by_another_thread(threadpoolctl, counts, 1)
    assert seen == [{1}], f"another thread's limit of 1 was ignored after the interrupt: {seen}"
    assert _blas_threads() == before
    monkeypatch.setattr(ctl, "limit", real_limit)
    ownership = getattr(threadpoolctl, "CONTROLLING_THREAD_OWNERSHIP", None)  # (3.8 on)
    if where == "restoring" and ownership is not None:  # the interrupted exit skipped its count
        ownership.decrement()  # of this thread's limits: put it right for the tests after this
    with backend.limit_blas_threads(1):
        assert counts() == {1}
    assert _blas_threads() == before


def test_a_hold_sets_the_count_it_is_given_and_restores_the_one_before():
    """limit_blas_threads(n) holds BLAS at n threads, not at one whatever n: inside a hold of
    one, a hold of two gives two threads back, and each hold restores on leaving the count it
    found."""
    from npattn.backend import limit_blas_threads

    threadpoolctl = pytest.importorskip("threadpoolctl", reason="BLAS thread counts need threadpoolctl")
    before = _blas_threads()
    if any(n < 2 for _, n in before):
        pytest.skip("BLAS runs on one thread here: a hold of two is not told from one of one")
    paths = {path for path, _ in before}

    def counts():
        return {p["num_threads"] for p in threadpoolctl.threadpool_info() if p["filepath"] in paths}

    with limit_blas_threads(1):
        assert counts() == {1}
        with limit_blas_threads(2):
            assert counts() == {2}
        assert counts() == {1}
    assert _blas_threads() == before


# --------------------------------------------------------------------------
# two Python threads at once


def _module_steps(impl, seed, steps=4):
    """A module's forward + backward on ``steps`` inputs: every output and gradient, in order."""
    m = MultiHeadAttention(32, 4, n_kv_head=2, dropout=0.2, seed=seed, impl=impl)  # float32
    rng = np.random.default_rng(seed + 100)
    mask = rng.random((2, 1, 24, 20)) > 0.2  # [B, 1, Lq, Lk] bool: the blocked path splits
    results = []
    for _ in range(steps):
        x = rng.standard_normal((2, 24, 32)).astype(np.float32)
        mem = rng.standard_normal((2, 20, 32)).astype(np.float32)
        dout = rng.standard_normal((2, 24, 32)).astype(np.float32)
        out, _ = m(x, mem, mem, mask=mask, is_causal=True)
        results.append([out, *m.backward(dout), *(m.grads[n] for n in sorted(m.grads))])
    return results


def _blas_info():
    try:
        import threadpoolctl
    except ImportError:
        return None
    return sorted((p["filepath"], p["num_threads"]) for p in threadpoolctl.threadpool_info()
                  if p["user_api"] == "blas")


#: BLAS thread counts when this file is imported (at collection, before any test has run)
BLAS_AT_IMPORT = _blas_info()


def _blas_threads():
    """BLAS thread counts now; they must be those at import (npattn restores what it holds)."""
    pytest.importorskip("threadpoolctl", reason="BLAS thread counts need threadpoolctl")
    assert BLAS_AT_IMPORT, "threadpoolctl saw no BLAS library at import"
    now = dict(_blas_info())  # libraries loaded since (torch's) are not compared
    found = [(path, now.get(path)) for path, _ in BLAS_AT_IMPORT]
    assert found == BLAS_AT_IMPORT, f"BLAS threads {found}, {BLAS_AT_IMPORT} at import"
    return found


def test_two_threads_get_what_each_gets_alone(monkeypatch):
    """Four threads each run their own module (two on the NumPy kernel, two on the blocked
    path, all on the pool) at the same time, repeatedly: bitwise the single-threaded
    results. BLAS's thread count is the same afterwards as before."""
    monkeypatch.setattr(numpy_kernel, "TILE_ELEMS", 256)
    monkeypatch.setattr(numpy_kernel, "POOL_MIN_SCORES", 0)
    monkeypatch.setenv("NPATTN_NUM_THREADS", "2")
    blas_before = _blas_threads()
    jobs = [("numpy", 1), ("blocked", 2), ("numpy", 3), ("blocked", 4)]
    rec = PoolRecorder(monkeypatch, probe_blas=True)
    alone = {job: _module_steps(*job) for job in jobs}
    assert rec.split("numpy") and rec.split("blocked"), f"not on the pool: {rec.where}"
    assert rec.blas_in_tasks == {1}, "tiles ran without BLAS held to one thread"
    assert _blas_threads() == blas_before
    for _ in range(2):
        together, errors = {}, []
        barrier = threading.Barrier(len(jobs))

        def worker(job):
            try:
                barrier.wait()
                together[job] = _module_steps(*job)
            except BaseException:
                errors.append(traceback.format_exc())

        threads = [threading.Thread(target=worker, args=(job,)) for job in jobs]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        assert not any(t.is_alive() for t in threads), "a thread did not finish"
        assert not errors, "\n".join(errors)
        for job in jobs:
            for step, (a_step, b_step) in enumerate(zip(together[job], alone[job])):
                for i, (a, b) in enumerate(zip(a_step, b_step)):
                    np.testing.assert_array_equal(a, b, err_msg=f"{job}, step {step}, #{i}")
        assert _blas_threads() == blas_before


def test_a_failing_tile_releases_the_pool_blas_and_the_lock(monkeypatch):
    """A tile that raises: the error comes out, BLAS's thread count is restored, and another
    thread can then compute (the lock was released)."""
    blas_before = _blas_threads()
    monkeypatch.setattr(numpy_kernel, "TILE_ELEMS", 16)
    monkeypatch.setattr(numpy_kernel, "POOL_MIN_SCORES", 0)
    monkeypatch.setenv("NPATTN_NUM_THREADS", "2")
    args = _inputs(2, 2, 2, 1, 6, 5, 3, 3, dropout="seed")
    expected = _run("numpy", *args)
    calls = []

    def failing(key, p, lead, rows, cols, **kw):
        calls.append(1)
        if len(calls) == 2:
            raise MemoryError("a tile failed")
        return real(key, p, lead, rows, cols, **kw)

    real = numpy_kernel.keyed_keep_mask
    monkeypatch.setattr(numpy_kernel, "keyed_keep_mask", failing)
    with pytest.raises(MemoryError, match="a tile failed"):
        _run("numpy", *args)
    assert _blas_threads() == blas_before
    monkeypatch.setattr(numpy_kernel, "keyed_keep_mask", real)
    result = []
    t = threading.Thread(target=lambda: result.append(_run("numpy", *args)))
    t.start()
    t.join(60)
    assert not t.is_alive(), "the lock was not released"
    for a, b in zip(result[0], expected):
        if b is not None:
            np.testing.assert_array_equal(a, b)


# --------------------------------------------------------------------------
# NPATTN_NUM_THREADS


def test_the_pool_is_the_usable_cpus_at_most_8_unless_the_variable_says(monkeypatch):
    """Without NPATTN_NUM_THREADS (or with it blank) the pool has as many threads as the
    process may use CPUs, at most 8; the variable overrides the cap."""
    from npattn import backend

    if backend.blas_controller() is None:
        pytest.skip("without threadpoolctl the pool has one thread")
    monkeypatch.delenv("NPATTN_NUM_THREADS", raising=False)
    for cpus, threads in ((1, 1), (3, 3), (8, 8), (9, 8), (64, 8)):
        monkeypatch.setattr(os, "sched_getaffinity", lambda pid, n=cpus: set(range(n)), raising=False)
        assert backend.pool_threads() == threads, cpus
        monkeypatch.setenv("NPATTN_NUM_THREADS", " ")
        assert backend.pool_threads() == threads, cpus
        monkeypatch.delenv("NPATTN_NUM_THREADS")
    monkeypatch.setenv("NPATTN_NUM_THREADS", "12")
    assert backend.pool_threads() == 12


@needs_pool
def test_the_kernel_takes_the_pool_from_2_to_the_21_scores_on(monkeypatch):
    """The NumPy kernel's tiles go to the pool when the call has at least POOL_MIN_SCORES =
    2**21 scores in all (B * Hq * Lq * Lk, as docs/performance.md states) and run in order
    below (a tile per batch entry here): 2 x 1024 x 1024 scores go to the pool, 2 x 1023 x 1024
    do not."""
    monkeypatch.setenv("NPATTN_NUM_THREADS", "2")
    rng = np.random.default_rng(8)
    k, v = rng.standard_normal((2, 1, 1024, 2)), rng.standard_normal((2, 1, 1024, 3))
    for Lq, pooled in ((1024, True), (1023, False)):
        rec = PoolRecorder(monkeypatch)
        A.sdpa_forward(rng.standard_normal((2, 1, Lq, 2)), k, v, impl="numpy")
        assert bool(rec.where["numpy"]) is pooled, (Lq, rec.calls)
        if pooled:
            assert rec.split("numpy"), rec.calls


def test_limit_blas_threads_refusals_name_what_they_got():
    """limit_blas_threads(n) refuses what is no int >= 1 (or None) with the argument, what was
    expected and the value given: its type as well for a TypeError."""
    from npattn.backend import limit_blas_threads

    for n, exc, got in (("x", TypeError, "str 'x'"), (True, TypeError, "bool True"),
                        (1.5, TypeError, "float 1.5"), (0, ValueError, "0"), (-3, ValueError, "-3")):
        with pytest.raises(exc, match=re.escape(f"n: expected None or an int >= 1 (BLAS threads), got {got}")
                           + "$"):
            limit_blas_threads(n)


def test_run_tasks_runs_each_task_once_on_as_many_threads_as_asked():
    """run_tasks calls fn once per task, at any thread count. Three tasks that each wait for
    the other two (a barrier of 3) finish only on three threads at once: after a run on two
    threads the pool is made anew for three, and the old pool's threads end."""
    from npattn import backend

    done = []
    lock = threading.Lock()

    def record(i):
        with lock:
            done.append(i)

    with backend.exclusive():
        for threads in (1, 2, 3):
            done.clear()
            backend.run_tasks(record, [(i,) for i in range(7)], threads)
            assert sorted(done) == list(range(7)), threads
        backend.run_tasks(record, [(0,), (1,)], 2)
        two = {t for t in threading.enumerate() if t.name.startswith("npattn")}
        barrier = threading.Barrier(3, timeout=30)
        met = []
        backend.run_tasks(lambda i: met.append(barrier.wait()), [(i,) for i in range(3)], 3)
        assert sorted(met) == [0, 1, 2]
    for t in two:
        t.join(30)
        assert not t.is_alive(), "a pool of an earlier thread count was left running"


@needs_pool
def test_an_interrupt_while_run_tasks_waits_leaves_no_task_behind(monkeypatch):
    """Ctrl-C reaches the thread that waits for the pool (``wait`` raises KeyboardInterrupt):
    run_tasks raises it only once the running tasks have ended, and the tasks not started
    never start. Tasks left on the pool ran after the call had released BLAS and the lock,
    on the caller's BLAS threads, and kept the interpreter from exiting until all of them
    had run. Then the pool runs the next call's tasks."""
    from npattn import backend

    before = _blas_threads()
    real_wait = backend.wait
    calls = []

    release, both_busy = threading.Event(), threading.Event()

    def interrupted(futures, *a, **kw):
        calls.append(len(futures))
        if len(calls) == 1:
            both_busy.wait(10)  # the interrupt lands while both workers run a task
            raise KeyboardInterrupt
        release.set()  # run_tasks waits again once it has cancelled: the running tasks may end
        return real_wait(futures, *a, **kw)

    monkeypatch.setattr(backend, "wait", interrupted)
    lock = threading.Lock()
    started, ended = [], []

    def task(i):
        with lock:
            started.append(i)
            if len(started) == 2:
                both_busy.set()
        release.wait(10)  # held until the tasks not started are cancelled: no race with them
        with lock:
            ended.append(i)

    with pytest.raises(KeyboardInterrupt):
        backend.run_tasks(task, [(i,) for i in range(8)], 2)
    with lock:
        at_return = (sorted(started), sorted(ended))
    assert at_return[0] == at_return[1], f"tasks still running after the call: {at_return}"
    assert at_return[0] == [0, 1], f"expected the two running tasks alone to have run, got {at_return[0]}"
    with lock:
        assert sorted(started) == [0, 1], f"tasks started after the call: {started}"
    assert _blas_threads() == before
    seen = []
    backend.run_tasks(lambda i: seen.append(i), [(i,) for i in range(3)], 2)
    assert sorted(seen) == [0, 1, 2]


def test_an_interrupt_while_run_tasks_hands_out_tasks_leaves_no_task_behind(monkeypatch):
    """Ctrl-C lands while run_tasks hands the tasks to the pool (the third ``submit`` raises
    KeyboardInterrupt once the first two run): run_tasks raises it only once those two have
    ended, as for an interrupt while it waits, and no other task starts. Handing the tasks out
    before the cancelling took effect left the two running after the call had released BLAS
    and the lock."""
    from npattn import backend

    before = _blas_threads()
    backend.run_tasks(lambda i: None, [(0,), (1,)], 2)  # the pool at 2 threads: the call below makes one
    lock, both_busy, release = threading.Lock(), threading.Event(), threading.Event()
    started, ended = [], []
    real_wait = backend.wait

    class InterruptedPool(backend.ThreadPoolExecutor):
        handed = 0

        def submit(self, *a, **kw):
            type(self).handed += 1
            if type(self).handed == 3:  # once: a later call on this pool is not interrupted
                both_busy.wait(10)
                raise KeyboardInterrupt
            return super().submit(*a, **kw)

    def waiting(futures, *a, **kw):  # run_tasks waits for what it handed out: those may end now
        release.set()
        return real_wait(futures, *a, **kw)

    def task(i):
        with lock:
            started.append(i)
            if len(started) == 2:
                both_busy.set()
        release.wait(10)
        with lock:
            ended.append(i)

    monkeypatch.setattr(backend, "ThreadPoolExecutor", InterruptedPool)
    monkeypatch.setattr(backend, "wait", waiting)
    try:
        with pytest.raises(KeyboardInterrupt):
            backend.run_tasks(task, [(i,) for i in range(6)], 3)
        with lock:
            at_return = (sorted(started), sorted(ended))
    finally:
        release.set()
    assert at_return == ([0, 1], [0, 1]), f"tasks still running after the call (started, ended): {at_return}"
    assert _blas_threads() == before
    monkeypatch.undo()  # the next call, at 2 threads, makes a plain pool and runs every task
    seen = []
    backend.run_tasks(lambda i: seen.append(i), [(i,) for i in range(3)], 2)
    assert sorted(seen) == [0, 1, 2]


@needs_pool
def test_the_kernel_and_the_blocked_path_share_one_pool(monkeypatch):
    """The blocked path hands the pool fewer slices than it has threads (3 pool threads, a
    leading axis of 2): it runs them on the pool that the kernel uses, rather than making a
    pool of 2 threads and, at the kernel's next call, one of 3 again (a pool made anew at
    each call, its threads started and stopped every time)."""
    from npattn import backend

    monkeypatch.setattr(numpy_kernel, "POOL_MIN_SCORES", 0)
    monkeypatch.setattr(numpy_kernel, "TILE_ELEMS", 256)
    monkeypatch.setenv("NPATTN_NUM_THREADS", "3")
    q, k, v, dout, kw = _inputs(3, 1, 2, 1, 24, 20, 4, 4)  # (1, 2, L, D): two blocked slices
    rec = PoolRecorder(monkeypatch)
    _run("numpy", q, k, v, dout, kw)  # the pool of 3, made now if it was not
    made = []
    real = backend.ThreadPoolExecutor

    class Counted(real):
        def __init__(self, *a, **kw):
            made.append(kw.get("max_workers"))
            super().__init__(*a, **kw)

    monkeypatch.setattr(backend, "ThreadPoolExecutor", Counted)
    for _ in range(2):
        _run("blocked", q, k, v, dout, kw)
        _run("numpy", q, k, v, dout, kw)
    assert rec.split("numpy") and rec.split("blocked"), rec.where
    assert made == [], f"pools made anew: {made}"


def test_run_tasks_on_one_thread_runs_them_in_order_on_the_calling_thread():
    """With one thread no pool is involved: the tasks run in the order given, on the thread
    that calls run_tasks."""
    from npattn import backend

    seen = []
    with backend.exclusive():
        backend.run_tasks(lambda i: seen.append((i, threading.current_thread())), [(i,) for i in range(5)], 1)
    assert [i for i, _ in seen] == list(range(5))
    assert all(t is threading.current_thread() for _, t in seen)


def test_the_pool_is_made_once_and_kept_for_its_thread_count():
    """The tile pool is made on first use and kept: a second run at the same thread count runs
    on the threads of the first (a pool made anew for every run would start its threads
    again at every call). Two tasks that wait for each other run on both threads."""
    from npattn import backend

    barrier = threading.Barrier(2, timeout=30)

    def meet(seen):
        barrier.wait()
        seen.append(threading.current_thread())

    first, second = [], []
    with backend.exclusive():
        backend.run_tasks(meet, [(first,), (first,)], 2)
        backend.run_tasks(meet, [(second,), (second,)], 2)
    assert len(set(first)) == 2 and all(t.name.startswith("npattn") for t in first)
    assert set(second) == set(first)


@pytest.mark.parametrize("impl, module, forward, backward", [
    ("reference", F, "sdpa_forward_core", "sdpa_backward"),
    ("numpy", numpy_kernel, "sdpa_forward", "sdpa_backward"),
    ("blocked", blocked, "sdpa_blocked_forward_core", "sdpa_blocked_backward_core")])
def test_every_forward_and_backward_runs_under_the_lock(impl, module, forward, backward,
                                                        monkeypatch):
    """The dispatcher runs each implementation's forward and backward inside exclusive(): a
    thread that asks for the lock meanwhile waits until they return."""
    from npattn.backend import exclusive

    q, k, v, dout, kw = _inputs(4, 1, 2, 1, 3, 5, 2, 2)
    got_in, threads = [], []

    def probed(real):
        def probe(*a, **kw):
            entered = threading.Event()

            def other():
                with exclusive():
                    entered.set()

            t = threading.Thread(target=other)
            t.start()
            threads.append(t)
            got_in.append(entered.wait(0.5))  # False while the call holds the lock
            return real(*a, **kw)
        return probe

    for name in (forward, backward):
        monkeypatch.setattr(module, name, probed(getattr(module, name)))
    _, cache = A.sdpa_forward(q, k, v, impl=impl, **kw)
    A.sdpa_backward(dout, cache)
    for t in threads:
        t.join(30)
    assert got_in == [False, False]


def test_pooled_projections_run_on_the_pool_under_the_lock(monkeypatch):
    """``attention.linear_forward`` and ``linear_backward`` of a GEMM large enough for the
    pool (called directly, outside any module) hand their row blocks to the pool inside
    exclusive(): another thread cannot take the lock meanwhile (a non-blocking try, made
    and finished while the pool's tasks are handed over)."""
    from npattn import backend

    monkeypatch.setattr(numpy_kernel, "POOL_MIN_LINEAR", 0)
    monkeypatch.setenv("NPATTN_NUM_THREADS", "2")
    rng = np.random.default_rng(8)
    x, w, b = rng.standard_normal((3, 7, 6)), rng.standard_normal((5, 6)), rng.standard_normal(5)
    dy = rng.standard_normal((3, 7, 5))
    got_in = []
    real = numpy_kernel.run_tasks

    def probe(*a, **kw):
        tried = []

        def other():
            got = backend._lock.acquire(blocking=False)  # the lock exclusive() holds
            if got:
                backend._lock.release()
            tried.append(got)

        t = threading.Thread(target=other)
        t.start()
        t.join(30)
        got_in.extend(tried)  # False while the call holds the lock
        return real(*a, **kw)

    monkeypatch.setattr(numpy_kernel, "run_tasks", probe)
    y, c = A.linear_forward(x, w, b)
    grads = A.linear_backward(dy, c)
    assert got_in == [False, False]
    y_ref, c_ref = F.linear_forward(x, w, b)
    np.testing.assert_allclose(y, y_ref, rtol=1e-13, atol=1e-13)
    for got, want in zip(grads, F.linear_backward(dy, c_ref)):
        np.testing.assert_allclose(got, want, rtol=1e-13, atol=1e-13)


@pytest.mark.parametrize("value", ["0", "x", "-2", "1.5", "+2", "1_0", "\u0663", "00"])
def test_bad_num_threads_is_refused_before_computing(value, monkeypatch):
    q, k, v, dout, kw = _inputs(3, 2, 2, 2, 5, 6, 3, 2, "float", "none", causal=True)
    gen = np.random.default_rng(0)
    state = gen.bit_generator.state
    monkeypatch.setenv("NPATTN_NUM_THREADS", value)
    for impl in ("auto", "dense", "reference", "numpy", "blocked"):
        with pytest.raises(ValueError, match=re.escape(
                "NPATTN_NUM_THREADS: expected a positive integer (threads of npattn's tile pool), "
                f"got {value!r}") + "$"):
            A.sdpa_forward(q, k, v, impl=impl, dropout_p=0.5, rng=gen, **kw)
    assert gen.bit_generator.state == state  # no dropout key was drawn
    monkeypatch.setenv("NPATTN_NUM_THREADS", "")  # empty: the default
    A.sdpa_forward(q, k, v, impl="numpy", **kw)


@pytest.mark.parametrize("value, want", [("2", 2), (" 3 ", 3), ("007", 7), ("\t1\n", 1)])
def test_num_threads_reads_ascii_digits(value, want, monkeypatch):
    monkeypatch.setenv("NPATTN_NUM_THREADS", value)
    if blas_controller() is None:
        pytest.skip("without a BLAS threadpoolctl finds, the pool runs one thread")
    assert pool_threads() == want


def _module_pair(impl, **kw):
    """Two modules alike (same seed, parameters and generator)."""
    return [MultiHeadAttention(12, 4, n_kv_head=2, dropout=0.3, dtype="float64", seed=5,
                               impl=impl, **kw) for _ in range(2)]


def _module_data(n=3):
    rng = np.random.default_rng(21)
    mask = np.where(rng.random((2, 1, 6, 5)) > 0.3, rng.standard_normal((2, 1, 6, 5)), -np.inf)
    return mask, [(rng.standard_normal((2, 6, 12)), rng.standard_normal((2, 5, 12)),
                   rng.standard_normal((2, 6, 12))) for _ in range(n)]


def _step(m, x, mem, mask):
    return m(x, mem, mem, mask=mask, is_causal=True)[0]


def _grads(m, dout):
    dinputs = m.backward(dout)
    return [*dinputs, m.dmask, *(m.grads[n] for n in sorted(m.grads))]


def _assert_all_equal(a, b, what):
    assert len(a) == len(b)
    for i, (x, y) in enumerate(zip(a, b)):
        np.testing.assert_array_equal(x, y, err_msg=f"{what} #{i}")


@pytest.mark.parametrize("impl", ["reference", "numpy", "blocked"])
@pytest.mark.parametrize("value", ["0", "x", "-2"])
def test_bad_num_threads_in_the_module_keeps_its_state(value, impl, monkeypatch):
    """The module refuses a bad NPATTN_NUM_THREADS (ValueError naming it); its previous
    cache still gives the previous backward and its generator has not moved."""
    monkeypatch.setattr(numpy_kernel, "POOL_MIN_SCORES", 0)
    mask, data = _module_data()
    m, twin = _module_pair(impl)
    (x1, mem1, d1), (x2, mem2, _), (x3, mem3, d3) = data
    _step(m, x1, mem1, mask)
    _step(twin, x1, mem1, mask)
    monkeypatch.setenv("NPATTN_NUM_THREADS", value)
    with pytest.raises(ValueError, match="NPATTN_NUM_THREADS"):
        _step(m, x2, mem2, mask)
    if impl == "numpy":  # the kernel's backward reads it too (pool): if it fails, atomically
        try:
            m.backward(d1)
        except ValueError as exc:
            assert "NPATTN_NUM_THREADS" in str(exc)
            assert m.grads == {} and m.dmask is None  # nothing assigned
    monkeypatch.delenv("NPATTN_NUM_THREADS")
    _assert_all_equal(_grads(m, d1), _grads(twin, d1), "backward of the previous forward")
    _assert_all_equal([_step(m, x3, mem3, mask)], [_step(twin, x3, mem3, mask)],
                      "next forward (same dropout mask)")
    _assert_all_equal(_grads(m, d3), _grads(twin, d3), "next backward")


# --------------------------------------------------------------------------
# a failed forward or backward changes nothing


@pytest.mark.parametrize("error", [MemoryError, KeyboardInterrupt])
@pytest.mark.parametrize("when", ["before", "after"])
@pytest.mark.parametrize("impl", ["reference", "numpy", "blocked"])
def test_a_failed_forward_keeps_cache_grads_and_generator(impl, when, error, monkeypatch):
    """sdpa fails (before, or after it drew its dropout key): the module's backward still
    gives the previous forward's gradients, its grads are untouched, and the next forward
    draws the mask it would have drawn without the failed call."""
    mask, data = _module_data()
    m, twin = _module_pair(impl)
    (x1, mem1, d1), (x2, mem2, d2), (x3, mem3, d3) = data
    out1 = _step(m, x1, mem1, mask)
    _step(twin, x1, mem1, mask)
    g1 = _grads(m, d1)
    grads_before, dmask_before = dict(m.grads), m.dmask
    real = npattn.attention.sdpa_forward

    def failing(*a, **kw):
        if when == "after":
            real(*a, **kw)  # the dropout key is drawn, then the call fails
        raise error("out of memory in sdpa")

    monkeypatch.setattr(npattn.attention, "sdpa_forward", failing)
    with pytest.raises(error, match="out of memory in sdpa"):
        _step(m, x2, mem2, mask)
    monkeypatch.setattr(npattn.attention, "sdpa_forward", real)
    assert m.grads.keys() == grads_before.keys() and m.dmask is dmask_before
    assert all(m.grads[n] is grads_before[n] for n in grads_before)
    _assert_all_equal(_grads(m, d2), _grads(twin, d2),
                      "backward after the failed forward = backward of the previous forward")
    _assert_all_equal(_grads(m, d1), g1, "the same as before the failed forward")
    _assert_all_equal([_step(m, x3, mem3, mask)], [_step(twin, x3, mem3, mask)],
                      "next forward: the generator was not advanced by the failed call")
    _assert_all_equal(_grads(m, d3), _grads(twin, d3), "next backward")
    assert not np.array_equal(out1, _step(twin, x1, mem1, mask))  # another mask: dropout acts


@pytest.mark.parametrize("impl", ["reference", "numpy", "blocked"])
def test_a_failed_backward_keeps_grads(impl, monkeypatch):
    mask, data = _module_data(2)
    m, twin = _module_pair(impl)
    (x1, mem1, d1), (x2, mem2, d2) = data
    _step(m, x1, mem1, mask)
    _grads(m, d1)
    grads_before, dmask_before = dict(m.grads), m.dmask
    _step(m, x2, mem2, mask)
    real = npattn.attention.sdpa_backward

    def failing(dout, cache):
        real(dout, cache)
        raise MemoryError("out of memory in the backward")

    monkeypatch.setattr(npattn.attention, "sdpa_backward", failing)
    with pytest.raises(MemoryError):
        m.backward(d2)
    monkeypatch.setattr(npattn.attention, "sdpa_backward", real)
    assert all(m.grads[n] is grads_before[n] for n in grads_before) and m.dmask is dmask_before
    for x, mem, d in data:
        _step(twin, x, mem, mask)
    _assert_all_equal(_grads(m, d2), _grads(twin, d2), "the backward, once it succeeds")


def test_without_threadpoolctl_tiles_run_in_order_whatever_the_variable_says(monkeypatch):
    """BLAS cannot be held to one thread without threadpoolctl: one pool thread, even with
    NPATTN_NUM_THREADS=2; a bad value is still refused, naming the variable."""
    from npattn import backend

    monkeypatch.setattr(backend, "blas_controller", lambda: None)
    monkeypatch.setenv("NPATTN_NUM_THREADS", "2")
    assert backend.pool_threads() == 1
    monkeypatch.setenv("NPATTN_NUM_THREADS", "two")
    with pytest.raises(ValueError, match="NPATTN_NUM_THREADS"):
        backend.pool_threads()
    monkeypatch.undo()
    if backend.blas_controller() is not None:  # with threadpoolctl the variable is obeyed
        monkeypatch.setenv("NPATTN_NUM_THREADS", "3")
        assert backend.pool_threads() == 3


def test_a_threadpoolctl_that_finds_no_blas_is_as_no_threadpoolctl(monkeypatch):
    """threadpoolctl installed but seeing no BLAS library (an unknown BLAS, or a version too
    old for NumPy's) cannot hold BLAS to one thread: no controller, one pool thread whatever
    NPATTN_NUM_THREADS says, and limit_blas_threads changes nothing, as without threadpoolctl.
    The stand-in sees only an OpenMP library, and fails the test if asked to limit anything."""
    import types

    from npattn import backend

    class OpenMPOnly:
        user_api, internal_api, filepath = "openmp", "openmp", "/lib/libgomp.so.1"

    class SeesNoBlas:
        def __init__(self):
            self.lib_controllers = [OpenMPOnly()]

        def limit(self, *args, **kwargs):
            raise AssertionError(f"limit({args}, {kwargs}) on a controller that holds no BLAS")

    monkeypatch.setitem(sys.modules, "threadpoolctl", types.SimpleNamespace(ThreadpoolController=SeesNoBlas))
    monkeypatch.setattr(backend, "_blas_controller", None)  # made anew, from the stand-in
    assert backend.blas_controller() is None
    monkeypatch.setenv("NPATTN_NUM_THREADS", "2")
    assert backend.pool_threads() == 1
    with backend.limit_blas_threads(1):
        pass
    ran = []
    backend.run_tasks(lambda i: ran.append((i, threading.get_ident())), [(0,), (1,), (2,)],
                      backend.pool_threads())
    assert ran == [(i, threading.get_ident()) for i in range(3)]  # in order, on this thread


def _fail_after_the_draw(monkeypatch, module, name, error=MemoryError):
    """Make ``module.name`` (a step that runs once the dropout key is drawn) raise ``error``."""
    def failing(*a, **kw):
        raise error("out of memory after the draw")

    monkeypatch.setattr(module, name, failing)


# each implementation's step that runs after the forward drew its dropout key
_AFTER_THE_DRAW = {"reference": (F, "keep_mask"), "numpy": (numpy_kernel, "keyed_keep_mask"),
                   "blocked": (blocked, "keyed_keep_mask_on")}


@pytest.mark.parametrize("error", [MemoryError, KeyboardInterrupt])
@pytest.mark.parametrize("rng_kind", ["generator", "bit_generator"])
@pytest.mark.parametrize("entry, impl", [("attention", "reference"), ("attention", "numpy"),
                                         ("attention", "blocked"), ("functional", "reference"),
                                         ("dropout", "reference")])
def test_a_failed_forward_leaves_the_callers_generator_as_it_was(entry, impl, rng_kind, error,
                                                                 monkeypatch):
    """The caller's generator is the state of a functional call: a forward that fails after
    it drew its dropout key (memory) puts the generator back, so a retry draws the mask the
    failed call would have used; an interrupt (not an Exception) too. ``entry``:
    ``attention.sdpa_forward``, ``functional.sdpa_forward`` or ``functional.dropout_forward``."""
    r = np.random.default_rng(3)
    q, k, v = (r.standard_normal(s) for s in ((2, 2, 9, 4), (2, 2, 11, 4), (2, 2, 11, 3)))
    gen = np.random.default_rng(21) if rng_kind == "generator" else np.random.PCG64(21)
    twin = np.random.default_rng(21) if rng_kind == "generator" else np.random.PCG64(21)

    def forward(g):  # (out, keep-mask)
        if entry == "dropout":
            out, cache = F.dropout_forward(q, 0.4, rng=g)
            return out, cache.keep
        if entry == "functional":
            out, cache = F.sdpa_forward(q, k, v, dropout_p=0.4, rng=g, is_causal=True)
        else:
            out, cache = A.sdpa_forward(q, k, v, dropout_p=0.4, rng=g, is_causal=True, impl=impl,
                                        **({"block_q": 4, "block_k": 3} if impl == "blocked" else {}))
        return out, A.dropout_keep_mask(cache)

    with monkeypatch.context() as mp:
        _fail_after_the_draw(mp, *_AFTER_THE_DRAW[impl], error=error)
        with pytest.raises(error, match="after the draw"):
            forward(gen)
    state = (gen.bit_generator if rng_kind == "generator" else gen).state
    assert state == (twin.bit_generator if rng_kind == "generator" else twin).state
    (out, keep), (out_twin, keep_twin) = forward(gen), forward(twin)
    assert np.array_equal(keep, keep_twin) and not keep.all()  # the mask drops entries
    assert np.array_equal(out, out_twin)
