"""Benchmark of attention on dask: graph size, time on 1 and 2 workers, peak memory per worker.

Run ``npattn bench --backend dask`` (or ``python -m npattn.tools.bench_dask``).
It measures ``attention.sdpa_forward`` + ``sdpa_backward`` (``impl="chunked"``)
on dask arrays of q, k, v (B, H, L, Dh), drawn on the workers, chunked by one
batch entry, ``--q-chunk`` query rows and ``--k-chunk`` keys:

* **graph**: for several chunkings of the same shape (no computing), the
  number of chunk pairs, the tasks of the forward+backward graph beyond its
  inputs, and how many of them are pair tasks;
* **workers**: for each count in ``--workers``, a fresh ``LocalCluster`` of
  that many worker processes with one thread each (npattn's tile pool and
  BLAS at one thread, ``NPATTN_NUM_THREADS=1``, so that a worker is one
  core), the wall time of computing the forward+backward (the sums of out,
  dq, dk and dv are brought back, not the arrays), its speed-up over the
  first count, and each worker's peak resident memory (``VmHWM``) against
  its resident memory before the run;
* **in one process**: the same attention on NumPy arrays in this process,
  ``impl="blocked"`` on the tile pool (the usable CPUs, at most 8; ``--no-local``
  leaves it out).

For scale it prints the size of one (Lq, Lk) score matrix of one head and of
one batch entry's heads: a worker never holds either (the blocked algorithm
inside each task works on blocks of ``block_q x block_k``).
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import re
import statistics
import sys
import tempfile
import time
from typing import Optional

import numpy as np

from ..validation import check_positive_int
from .limits import MAX_SIZE, SKIP_MEMORY_CHECK, SKIP_MEMORY_CHECK_HELP, memory_error, repeated_entry
from .outputs import json_output, output_error

__all__ = ["main", "parse_shape", "graph_sizes", "run_workers", "run_local", "run_bytes",
           "visible_pairs"]

DEFAULT_SHAPE = "8x4096x512x8"  # B x L x d_model x H, as npattn bench
ONE_CORE = {"NPATTN_NUM_THREADS": "1", "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1",
            "MKL_NUM_THREADS": "1"}


def parse_shape(text: str) -> tuple:
    """``BxLxDxH`` with an optional ``c`` (causal) and ``wN`` (a sliding window of N keys
    back, ``window=(N, 0)``) -> (B, L, D, H, causal, N or None); in either case and with
    surrounding spaces, each size at most ``limits.MAX_SIZE``, as ``npattn bench --shapes``
    reads its items."""
    match = re.fullmatch(r"([0-9]+)x([0-9]+)x([0-9]+)x([0-9]+)(c?)(?:w([0-9]+))?", text.strip().lower())
    if match is None:
        raise ValueError(f"--shape: expected BxLxDxH[c][wN] with positive integers, got {text!r}")
    B, L, D, H = (int(g) for g in match.groups()[:4])
    causal = match.group(5) == "c"
    window = None if match.group(6) is None else int(match.group(6))
    if min(B, L, D, H) < 1 or D % H:
        raise ValueError(f"--shape: expected positive sizes with H dividing D, got {text!r}")
    if max(B, L, D, H) > MAX_SIZE:  # as npattn bench --shapes: refused before any graph is built
        raise ValueError(f"--shape: {text!r} needs sizes of at most {MAX_SIZE} (BLAS takes 32-bit "
                         f"sizes), got {max(B, L, D, H)}")
    if window is not None and window > MAX_SIZE:
        raise ValueError(f"--shape: {text!r} needs a window of at most {MAX_SIZE} keys, got {window}")
    return B, L, D, H, causal, window


def _window(shape: tuple) -> Optional[tuple]:
    """The ``window=`` of a parsed shape: (N, 0) for ``wN``, None without."""
    return None if len(shape) < 6 or shape[5] is None else (shape[5], 0)


def _floor_sum(n: int, m: int, a: int, b: int) -> int:
    """sum over i = 0 .. n - 1 of floor((a i + b) / m), for n >= 0, m >= 1, a, b >= 0, in
    O(log m) steps (the Euclid-like reduction of floor sums)."""
    total = 0
    while True:
        if a >= m:
            total += n * (n - 1) // 2 * (a // m)
            a %= m
        if b >= m:
            total += n * (b // m)
            b %= m
        y_max = a * n + b
        if y_max < m:
            return total
        n, b = divmod(y_max, m)
        m, a = a, m


def visible_pairs(L: int, q_chunk: int, k_chunk: int, causal: bool = False,
                  window: Optional[int] = None) -> int:
    """The (query chunk, key chunk) pairs of one batch entry that hold a key some query may
    attend: all of them, or with causal those at or below the diagonal, with a window of N
    keys back those that reach back at most N keys as well.

    Query chunk c (rows c q_chunk .. hi_c) sees the key chunks from lo_c // k_chunk to
    hi_c // k_chunk, lo_c = max(0, c q_chunk - N) (0 without a window); the sums over c are
    floor sums, so the count takes no time at any L (the memory check runs it on shapes
    too large to build)."""
    n_q, n_k = -(-L // q_chunk), -(-L // k_chunk)
    if not causal and window is None:
        return n_q * n_k
    # sum of hi_c // k_chunk: hi_c = c q_chunk + q_chunk - 1 but for the last chunk, L - 1
    his = _floor_sum(n_q - 1, k_chunk, q_chunk, q_chunk - 1) + (L - 1) // k_chunk
    los = 0
    if window is not None:  # lo_c > 0 from c0 = N // q_chunk + 1 on
        c0 = window // q_chunk + 1
        if c0 < n_q:
            los = _floor_sum(n_q - c0, k_chunk, q_chunk, q_chunk * c0 - window)
    return his - los + n_q


#: Bytes of graph per chunk pair, at least: each pair is two tasks (forward and backward),
#: and a task of dask's graph takes more than 1 KiB (docs/dask.md has a measurement).
GRAPH_BYTES_PER_PAIR = 2048


def _chunkings(L, q_chunk, k_chunk):
    """The (q_chunk, k_chunk) chunkings whose graphs ``main`` builds, coarsest first."""
    return sorted({(L, L), (L, k_chunk), (q_chunk, k_chunk), (max(L // 8, 1), max(L // 8, 1))},
                  reverse=True)


def run_bytes(shape, itemsize, q_chunk, k_chunk, local=True) -> tuple[int, str]:
    """A lower bound of the bytes ``main`` holds at once in this process, and what it counts.

    The largest graph it builds (``GRAPH_BYTES_PER_PAIR`` for each of its
    chunk pairs: ``B * ceil(L / q_chunk) * ceil(L / k_chunk)``, fewer with causal or a
    window, which leave pairs out of the graph: ``visible_pairs``) and, with the
    in-process run (``local``), that run's NumPy arrays: q, k, v, dout, out,
    dq, dk, dv, ``8 B L D`` values. The workers' memory is not counted.
    """
    B, L, D, _, causal = shape[:5]
    window = shape[5] if len(shape) > 5 else None
    pairs = max(B * visible_pairs(L, qc, kc, causal, window)
                for qc, kc in _chunkings(L, q_chunk, k_chunk))
    graph = GRAPH_BYTES_PER_PAIR * pairs
    arrays = 8 * B * L * D * itemsize if local else 0
    what = (f"a graph of {pairs} chunk pairs at {GRAPH_BYTES_PER_PAIR} bytes each"
            + (", or the in-process run's 8 B*L*D arrays" if local else ""))
    return max(graph, arrays), what


def _inputs(shape, dtype, q_chunk, k_chunk, seed=0):
    """q, k, v, dout as dask arrays drawn chunk by chunk (on the workers when there is a client)."""
    import dask.array as da

    B, L, D, H = shape[:4]
    Dh = D // H
    rng = da.random.default_rng(seed)
    q_chunks = (1, H, min(q_chunk, L), Dh)
    k_chunks = (1, H, min(k_chunk, L), Dh)
    q = rng.standard_normal((B, H, L, Dh), chunks=q_chunks, dtype=dtype)
    k = rng.standard_normal((B, H, L, Dh), chunks=k_chunks, dtype=dtype)
    v = rng.standard_normal((B, H, L, Dh), chunks=k_chunks, dtype=dtype)
    dout = rng.standard_normal((B, H, L, Dh), chunks=q_chunks, dtype=dtype)
    return q, k, v, dout


def _graph(shape, dtype, q_chunk, k_chunk):
    """The forward+backward of the chunked attention, as dask arrays (nothing computed)."""
    from .. import attention as A

    q, k, v, dout = _inputs(shape, dtype, q_chunk, k_chunk)
    out, cache = A.sdpa_forward(q, k, v, is_causal=shape[4], window=_window(shape), impl="chunked")
    dq, dk, dv, _, _ = A.sdpa_backward(dout, cache)
    return (q, k, v, dout), (out, dq, dk, dv)


def _tasks(*arrays) -> dict:
    graph: dict = {}
    for a in arrays:
        graph.update(dict(a.__dask_graph__()))
    return graph


def graph_sizes(shape, dtype, chunkings) -> list:
    """Rows (q_chunk, k_chunk, pairs, tasks, pair tasks) for each (q_chunk, k_chunk)."""
    rows = []
    for qc, kc in chunkings:
        inputs, results = _graph(shape, dtype, qc, kc)
        ours = set(_tasks(*results)) - set(_tasks(*inputs))
        pair = [key for key in ours if isinstance(key, tuple) and str(key[0]).startswith("npattn-pair-")]
        rows.append(dict(q_chunk=qc, k_chunk=kc, pairs=len(pair) // 2, tasks=len(ours),
                         pair_tasks=len(pair)))
    return rows


def _worker_rss_mib() -> dict:
    """Current and peak resident memory of this process (Linux /proc), MiB."""
    out = {}
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(("VmRSS:", "VmHWM:")):
                    out[line.split(":")[0]] = int(line.split()[1]) / 1024
    except OSError:
        pass
    return out


def _warm_up():
    """Import npattn and run a tiny attention on the worker, so its baseline includes them."""
    from .. import attention as A

    x = np.ones((1, 1, 2, 2))
    out, c = A.sdpa_forward(x, x, x, impl="blocked")
    A.sdpa_backward(out, c)
    return True


def _compute(results, client):
    sums = [r.sum() for r in results]
    t0 = time.perf_counter()
    values = client.compute(sums, sync=True)
    return time.perf_counter() - t0, [float(v) for v in values]


def _malloc_env() -> dict:
    """glibc's malloc settings of this process's environment (a worker's, when run there)."""
    return {k: v for k, v in os.environ.items() if k.startswith("MALLOC_")}


@contextlib.contextmanager
def _environ_without(names):
    """This process's environment without ``names`` while workers are spawned, then as it was.

    A nanny copies its pre-spawn variables into the environment of the process
    that runs it, so an earlier cluster in this process would otherwise pass them on."""
    saved = {n: os.environ.pop(n) for n in names if n in os.environ}
    try:
        yield
    finally:
        os.environ.update(saved)


def run_workers(shape, dtype, q_chunk, k_chunk, workers, repeat, malloc_trim=False,
                out=None) -> list:
    """One fresh LocalCluster per worker count: time and peak memory per worker.

    ``workers`` holds positive ints, ``repeat`` (the timed runs per cluster, whose median is
    reported) is a positive int; anything else is refused before a cluster starts."""
    repeat = check_positive_int("repeat", repeat)
    workers = [check_positive_int(f"workers[{i}]", n) for i, n in enumerate(workers)]
    import dask

    out = sys.stdout if out is None else out
    from distributed import Client, LocalCluster

    spawn = {} if malloc_trim else {"distributed.nanny.pre-spawn-environ.MALLOC_TRIM_THRESHOLD_": None}
    rows = []
    for n in workers:
        # dask's scratch space (workers, scheduler) in a folder of its own, removed afterwards
        # (the default left its lock files in the system's temporary folder)
        with tempfile.TemporaryDirectory(prefix="npattn-dask-") as scratch, \
                dask.config.set({**spawn, "temporary-directory": scratch}), \
                _environ_without(() if malloc_trim else ("MALLOC_TRIM_THRESHOLD_",)), \
                LocalCluster(n_workers=n, threads_per_worker=1, processes=True,
                             dashboard_address=":0", scheduler_kwargs={"dashboard": False}, env=ONE_CORE,
                             memory_limit=0) as cluster, \
                Client(cluster) as client:
            malloc = next(iter(client.run(_malloc_env).values()))
            client.run(_warm_up)
            before = client.run(_worker_rss_mib)
            _, results = _graph(shape, dtype, q_chunk, k_chunk)
            runs = [_compute(results, client) for _ in range(repeat)]  # (seconds, sums) each
            times, checks = [seconds for seconds, _ in runs], runs[-1][1]
            after = client.run(_worker_rss_mib)
        peaks = [after[w].get("VmHWM", math.nan) for w in sorted(after)]
        bases = [before[w].get("VmRSS", math.nan) for w in sorted(after)]
        row = dict(workers=n, seconds=statistics.median(times), times=times,
                   peak_mib=peaks, base_mib=bases, checks=checks, malloc_env=malloc)
        rows.append(row)
        print(f"  {n} worker(s): {row['seconds']:.2f} s (runs {', '.join(f'{t:.2f}' for t in times)}); "
              f"peak RSS per worker {', '.join(f'{p:.0f}' for p in peaks)} MiB "
              f"(before the run {', '.join(f'{b:.0f}' for b in bases)} MiB)", file=out, flush=True)
    if rows:
        for r in rows:
            r["speedup"] = rows[0]["seconds"] / r["seconds"]
    return rows


def run_local(shape, dtype, repeat) -> dict:
    """The same attention on NumPy arrays in this process (impl="blocked", the tile pool);
    ``repeat`` (a positive int) timed runs, their median reported."""
    repeat = check_positive_int("repeat", repeat)
    from .. import attention as A
    from ..backend import pool_threads

    B, L, D, H, causal = shape[:5]
    rng = np.random.default_rng(0)
    q, k, v, dout = (rng.standard_normal((B, H, L, D // H), dtype=np.float32).astype(dtype)
                     for _ in range(4))
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        o, c = A.sdpa_forward(q, k, v, is_causal=causal, window=_window(shape), impl="blocked")
        A.sdpa_backward(dout, c)
        times.append(time.perf_counter() - t0)
        del o, c
    return dict(seconds=statistics.median(times), times=times, threads=pool_threads())


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        prog="npattn bench --backend dask",
        description="Attention on dask (impl='chunked'): graph size against chunk count, time on "
                    "LocalClusters of single-threaded worker processes (1 and 2 by default: "
                    "--workers), peak memory per worker.")
    parser.add_argument("--backend", choices=["dask"], default="dask", help=argparse.SUPPRESS)
    parser.add_argument("--shape", default=DEFAULT_SHAPE, metavar="BxLxDxH[c][wN]",
                        help="batch x sequence length x model width x heads (H dividing D), then "
                             "c for causal attention, wN for a sliding window of N keys back "
                             "(window=(N, 0)) (default: %(default)s)")
    parser.add_argument("--dtype", default="float32", choices=["float32", "float64"],
                        help="dtype of the inputs (default float32)")
    parser.add_argument("--q-chunk", type=int, default=1024, metavar="N",
                        help="query rows per chunk, >= 1 (default: %(default)s)")
    parser.add_argument("--k-chunk", type=int, default=1024, metavar="N",
                        help="keys per chunk (key chunking), >= 1 (default: %(default)s)")
    parser.add_argument("--workers", default="1,2", metavar="N[,N...]",
                        help="worker counts, one LocalCluster each, each count once "
                             "(default: %(default)s)")
    parser.add_argument("--repeat", type=int, default=1, metavar="N",
                        help="timed runs per cluster, >= 1 (default: 1)")
    parser.add_argument("--graph-only", action="store_true", help="only the graph sizes")
    parser.add_argument("--no-local", action="store_true", help="leave out the in-process run")
    parser.add_argument("--dask-malloc-trim", action="store_true",
                        help="keep distributed's MALLOC_TRIM_THRESHOLD_=65536 in the workers "
                             "(default: unset, glibc's own trimming)")
    parser.add_argument("--json", metavar="PATH",
                        help="also write the results as JSON; '-': the JSON alone on stdout, "
                             "the rest on stderr (default: none)")
    parser.add_argument(SKIP_MEMORY_CHECK, action="store_true", help=SKIP_MEMORY_CHECK_HELP)
    # taken as `npattn bench` takes it, so one command line serves every mode
    parser.add_argument("--no-progress", action="store_true",
                        help="accepted as in npattn bench; this mode draws no progress bar")
    args = parser.parse_args(argv)
    why = output_error("--json", args.json)
    if why:
        parser.error(why)
    try:
        shape = parse_shape(args.shape)
    except ValueError as exc:
        parser.error(str(exc))
    try:
        workers = [int(w) for w in args.workers.split(",")]
    except ValueError:
        parser.error(f"--workers: expected comma-separated positive integers, got {args.workers!r}")
    repeated = repeated_entry(workers)
    if repeated is not None:
        parser.error(f"--workers: expected each worker count once, got {repeated} more than once "
                     f"in {args.workers!r}")
    for name, value in (("q-chunk", args.q_chunk), ("k-chunk", args.k_chunk),
                        ("repeat", args.repeat), *(("workers", w) for w in workers)):
        if value < 1:
            parser.error(f"--{name}: expected a positive integer, got {value}")
    if not args.skip_memory_check:
        need, what = run_bytes(shape, np.dtype(args.dtype).itemsize, min(args.q_chunk, shape[1]),
                               min(args.k_chunk, shape[1]), local=not (args.no_local or args.graph_only))
        why = memory_error("--shape", args.shape, need, what)
        if why:
            parser.error(why)
    try:
        import dask
        import distributed
    except ImportError as exc:
        print(("npattn bench --backend dask: needs dask and distributed (pip install "
               f"'dask[array,distributed]', or '.[dask]' from the repository root): {exc}"),
              file=sys.stderr)
        return 2
    with json_output(args.json) as result:  # --json -: the JSON alone on stdout
        B, L, D, H, causal, window = shape
        itemsize = np.dtype(args.dtype).itemsize
        q_chunk, k_chunk = min(args.q_chunk, L), min(args.k_chunk, L)  # as the inputs are chunked
        result.update(
            shape=args.shape, dtype=args.dtype, q_chunk=q_chunk, k_chunk=k_chunk,
            causal=causal, window=_window(shape),
            dask=dask.__version__, distributed=distributed.__version__, cpus=os.cpu_count(),
            scores_one_head_mib=L * L * itemsize / 2**20, scores_one_entry_mib=H * L * L * itemsize / 2**20)
        what = ("causal, " if causal else "") + (f"window ({window}, 0), " if window is not None else "")
        print(f"npattn bench --backend dask: shape {args.shape} ({what}{args.dtype}), "
              f"chunks: 1 batch entry x {H} heads x {q_chunk} queries x {k_chunk} keys; "
              f"dask {dask.__version__}, {os.cpu_count()} CPUs")
        print(f"one head's (Lq, Lk) scores: {result['scores_one_head_mib']:.0f} MiB; one batch entry's "
              f"heads: {result['scores_one_entry_mib']:.0f} MiB")
        chunkings = _chunkings(L, q_chunk, k_chunk)
        result["graph"] = graph_sizes(shape, np.dtype(args.dtype), chunkings)
        print("graph of forward+backward (tasks beyond the inputs):")
        print(f"  {'q chunk':>8} {'k chunk':>8} {'pairs':>6} {'tasks':>7} {'pair tasks':>11}")
        for r in result["graph"]:
            print(f"  {r['q_chunk']:>8} {r['k_chunk']:>8} {r['pairs']:>6} {r['tasks']:>7} {r['pair_tasks']:>11}")
        if not args.graph_only:
            print("LocalCluster, worker processes of one thread each"
                  + (" (MALLOC_TRIM_THRESHOLD_=65536, distributed's default):" if args.dask_malloc_trim
                     else " (MALLOC_TRIM_THRESHOLD_ unset):"))
            result["malloc_trim"] = bool(args.dask_malloc_trim)
            result["workers"] = run_workers(shape, np.dtype(args.dtype), q_chunk, k_chunk,
                                            workers, args.repeat, malloc_trim=args.dask_malloc_trim)
            if len(result["workers"]) > 1:
                print("  speed-up over " + f"{workers[0]} worker(s): "
                      + ", ".join(f"{r['workers']}: {r['speedup']:.2f}x" for r in result["workers"]))
            if not args.no_local:
                result["local"] = run_local(shape, np.dtype(args.dtype), args.repeat)
                print(f"in this process (NumPy, impl='blocked', {result['local']['threads']} pool threads): "
                      f"{result['local']['seconds']:.2f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
