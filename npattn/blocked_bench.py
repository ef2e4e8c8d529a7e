"""Long-sequence measurement of the blocked attention path: time and peak memory.

Each measurement runs ``MultiHeadAttention`` forward+backward (self-attention,
NumPy backend) in a **fresh Python subprocess**, so that the peak resident
memory it reports (``ru_maxrss``, the same number as ``VmHWM`` in
``/proc/self/status``) belongs to that one shape and path alone. The child
prints one JSON line; the parent collects them.

Usage::

    python -m npattn.blocked_bench                       # the default plan below
    python -m npattn.blocked_bench --shapes 1,16384,512,8 --impl blocked --runs 1
    python -m npattn.blocked_bench --markdown docs/performance-blocked.md

Nothing here is asserted in tests: timings depend on the machine and its load.

FLOP count (the usual "model FLOPs"; the blocked backward's recomputation of
the scores is not counted): forward = ``8 B L D^2`` (four projections) +
``4 B L^2 D`` (``q k^T`` and ``p v``; half of it with ``--causal``), and
forward+backward = 3 x forward.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import time

__all__ = ["measure", "machine_info", "main"]

#: (B, L, d_model, H, impl, runs): the long sequence on the blocked path, and a
#: shorter one on both paths to compare their speed where dense still fits.
DEFAULT_PLAN = [
    (1, 4096, 512, 8, "dense", 3),
    (1, 4096, 512, 8, "blocked", 3),
    (1, 16384, 512, 8, "blocked", 1),
]


def _model_flops(B, L, D, causal):
    attn = 4.0 * B * L * L * D * (0.5 if causal else 1.0)
    return 3.0 * (8.0 * B * L * D * D + attn)


def _rss_mib():
    """(current VmRSS, peak VmHWM) of this process in MiB, from /proc (Linux); ru_maxrss otherwise."""
    cur = peak = None
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    cur = int(line.split()[1]) / 1024.0
                elif line.startswith("VmHWM:"):
                    peak = int(line.split()[1]) / 1024.0
    except OSError:
        pass
    if peak is None:
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0  # KiB on Linux
    return cur, peak


def _gemm_gflops(n=2048, reps=3):
    """Measured float32 GEMM throughput (n x n x n), best of ``reps``, in GFLOP/s."""
    import numpy as np

    a = np.random.default_rng(0).standard_normal((n, n), dtype=np.float32)
    a @ a  # warm-up
    best = min(_timed(lambda: a @ a) for _ in range(reps))
    return 2.0 * n**3 / best / 1e9


def _timed(f):
    t = time.perf_counter()
    f()
    return time.perf_counter() - t


def _child(args):
    """Runs in the subprocess: one shape, one path; prints a JSON line."""
    import numpy as np

    from npattn import MultiHeadAttention

    B, L, D, H = args.shape
    limits = None
    if args.blas_threads:
        from threadpoolctl import threadpool_limits

        limits = threadpool_limits(args.blas_threads)
    rng = np.random.default_rng(0)
    mha = MultiHeadAttention(D, H, seed=0, dtype="float32", impl=args.impl)
    if args.impl == "blocked":
        from npattn import blocked

        blocked.DEFAULT_BLOCK_Q, blocked.DEFAULT_BLOCK_K = (
            args.block_q,
            args.block_k,
        )  # read per call
    x = rng.standard_normal((B, L, D), dtype=np.float32)  # [B, L, D]
    dout = rng.standard_normal((B, L, D), dtype=np.float32)  # [B, L, D]
    rss_before, _ = _rss_mib()

    def step():
        mha(x, x, x, is_causal=args.causal)
        mha.backward(dout)

    if args.warmup:
        step()
    times = [_timed(step) for _ in range(args.runs)]
    rss_after, peak = _rss_mib()
    gemm = _gemm_gflops() if args.gemm else None
    ms = 1e3 * statistics.median(times)
    res = dict(
        shape=[B, L, D, H],
        causal=args.causal,
        impl=args.impl,
        runs=args.runs,
        warmup=args.warmup,
        blas_threads=args.blas_threads or "default",
        block_q=args.block_q if args.impl == "blocked" else None,
        block_k=args.block_k if args.impl == "blocked" else None,
        ms_median=ms,
        ms_all=[1e3 * t for t in times],
        gflops=_model_flops(B, L, D, args.causal) / (ms / 1e3) / 1e9,
        gemm_gflops=gemm,
        rss_before_mib=rss_before,
        peak_rss_mib=peak,
        loadavg=os.getloadavg(),
    )
    if limits is not None:
        limits.restore_original_limits()
    print(json.dumps(res))


def measure(
    B,
    L,
    D,
    H,
    *,
    impl="blocked",
    causal=False,
    runs=1,
    warmup=False,
    block_q=None,
    block_k=None,
    blas_threads=None,
    gemm=True,
    timeout=3600,
):
    """Time forward+backward of one shape in a fresh subprocess; returns a dict.

    Keys: ``ms_median`` (ms), ``gflops`` (model FLOPs, see the module
    docstring), ``gemm_gflops`` (float32 GEMM in the same process),
    ``peak_rss_mib`` (VmHWM / ru_maxrss of the child, MiB, including the
    interpreter, NumPy and the inputs), ``rss_before_mib`` (resident memory
    just before the first forward), ``loadavg`` (1, 5, 15 min, at the end).
    """
    from npattn import blocked

    cmd = [
        sys.executable,
        "-m",
        "npattn.blocked_bench",
        "--child",
        "--shapes",
        f"{B},{L},{D},{H}",
        "--impl",
        impl,
        "--runs",
        str(runs),
        "--block-q",
        str(block_q or blocked.DEFAULT_BLOCK_Q),
        "--block-k",
        str(block_k or blocked.DEFAULT_BLOCK_K),
    ]
    if causal:
        cmd.append("--causal")
    if warmup:
        cmd.append("--warmup")
    if blas_threads:
        cmd += ["--blas-threads", str(blas_threads)]
    if not gemm:
        cmd.append("--no-gemm")
    env = dict(os.environ)
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env["PYTHONPATH"] = here + os.pathsep + env.get("PYTHONPATH", "")
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout)
    if proc.returncode != 0:
        raise RuntimeError(f"benchmark child failed ({proc.returncode}):\n{proc.stderr[-4000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def machine_info():
    """CPU model, core count, BLAS (threadpoolctl), NumPy and Python versions."""
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    import numpy as np

    blas = []
    try:
        from threadpoolctl import threadpool_info

        for p in threadpool_info():
            blas.append(
                f"{p.get('internal_api')} {p.get('version')} ({p.get('threading_layer')}, "
                f"{p.get('architecture')}, {p.get('num_threads')} threads)"
            )
    except ImportError:
        blas.append("unknown (threadpoolctl not installed)")
    mem = None
    try:
        with open("/proc/meminfo") as f:
            mem = f"{int(f.readline().split()[1]) / 2**20:.1f} GiB"
    except OSError:
        pass
    return dict(
        cpu=cpu,
        cores=os.cpu_count(),
        memory=mem,
        blas="; ".join(blas),
        numpy=np.__version__,
        python=platform.python_version(),
    )


def _markdown(info, results):
    lines = [
        f"- CPU: {info['cpu']}, {info['cores']} cores, {info['memory']} RAM",
        f"- BLAS: {info['blas']}",
        f"- NumPy {info['numpy']}, Python {info['python']}",
        "",
        "| B, L, D, H | impl | blocks (q, k) | BLAS threads | runs | ms (median) | GFLOP/s | GEMM GFLOP/s | peak RSS MiB | RSS before fwd MiB | load avg (1 min) |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        blocks = f"{r['block_q']}, {r['block_k']}" if r["block_q"] else "-"
        gemm = f"{r['gemm_gflops']:.0f}" if r["gemm_gflops"] else "-"
        lines.append(
            f"| {', '.join(map(str, r['shape']))}{' causal' if r['causal'] else ''} | {r['impl']} "
            f"| {blocks} | {r['blas_threads']} | {r['runs']} | {r['ms_median']:.0f} | {r['gflops']:.1f} "
            f"| {gemm} | {r['peak_rss_mib']:.0f} | {r['rss_before_mib']:.0f} | {r['loadavg'][0]:.1f} |"
        )
    return "\n".join(lines) + "\n"


def main(argv=None):
    ap = argparse.ArgumentParser(
        prog="python -m npattn.blocked_bench", description=__doc__.split("\n\n")[0]
    )
    ap.add_argument("--shapes", help="B,L,D,H[;B,L,D,H...]; default: the built-in plan")
    ap.add_argument("--impl", default="blocked", choices=["auto", "dense", "blocked"])
    ap.add_argument("--runs", type=int, default=1)
    ap.add_argument("--warmup", action="store_true", help="one untimed run first")
    ap.add_argument("--causal", action="store_true")
    ap.add_argument("--block-q", type=int, default=None)
    ap.add_argument("--block-k", type=int, default=None)
    ap.add_argument(
        "--blas-threads",
        type=int,
        default=None,
        help="limit BLAS threads with threadpoolctl (default: BLAS's own setting)",
    )
    ap.add_argument("--no-gemm", dest="gemm", action="store_false")
    ap.add_argument("--markdown", help="append a results table to this file")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)

    if args.child:
        args.shape = tuple(int(s) for s in args.shapes.split(","))
        _child(args)
        return

    if args.shapes:
        plan = [
            tuple(int(s) for s in sh.split(",")) + (args.impl, args.runs)
            for sh in args.shapes.split(";")
        ]
    else:
        plan = DEFAULT_PLAN
    info = machine_info()
    print(json.dumps(info))
    results = []
    for B, L, D, H, impl, runs in plan:
        r = measure(
            B,
            L,
            D,
            H,
            impl=impl,
            causal=args.causal,
            runs=runs,
            warmup=args.warmup,
            block_q=args.block_q,
            block_k=args.block_k,
            blas_threads=args.blas_threads,
            gemm=args.gemm,
        )
        print(json.dumps(r), flush=True)
        results.append(r)
    table = _markdown(info, results)
    print(table)
    if args.markdown:
        with open(args.markdown, "a") as f:
            f.write(table + "\n")


if __name__ == "__main__":
    main()
