"""Benchmark: ``MultiHeadAttention`` forward+backward against PyTorch.

Run ``npattn bench`` (or ``python -m npattn.tools.bench``). For each shape
(B, L, d_model, H, causal) it times one self-attention forward+backward of
the module (``out = m(x, x, x); m.backward(dout)``), median of ``--repeat``
runs after warm-up, and prints:

* ``ms``: median wall time of forward+backward;
* ``GFLOP/s``: achieved rate, counting the matmul FLOPs of forward+backward
  (see ``flops``), causal attention matmuls at half;
* ``GEMM``, ``%GEMM``: the GFLOP/s of a square ``--gemm``-sized matmul of
  the same dtype, timed in the same rounds as the shape (one GEMM per
  round), and the shape's rate as a percentage of it;
* ``peak MiB``: peak traced allocation during one forward+backward, above
  what was live before it (``tracemalloc``, which traces NumPy's array
  allocations; for CuPy the memory pool's bytes in use after the run, an
  upper bound of the cache and gradients). ``RSS MiB`` is the rise of the
  process's peak resident memory (Linux ``VmHWM``, reset through
  ``/proc/self/clear_refs`` before the run), shown when the kernel allows it;
  memory the allocator reuses without asking the kernel does not show there.
  Both are measured in a separate, untimed step that starts without the
  module's previous cache;
* with torch installed: ``torch ms``, ``torch.nn.MultiheadAttention``
  (``batch_first=True``, same weights, same input, ``need_weights=False``)
  forward+backward, timed alternately with npattn in the same loop, and
  ``ratio`` = npattn / torch of the medians; ``ratio(min)`` the same of the
  fastest runs, which a machine shared with other work disturbs least.

Shapes are written ``BxLxDxH`` with a trailing ``c`` for causal, e.g.
``--shapes 32x128x256x8,4x1024x768x12c``.
"""

from __future__ import annotations

import argparse
import gc
import inspect
import json
import math
import os
import platform
import statistics
import sys
import time
import tracemalloc
from typing import NamedTuple

import numpy as np

from ..backend import resolve_backend, backend_name, from_numpy

__all__ = ["main", "Shape", "parse_shapes", "flops", "DEFAULT_SHAPES"]


class Shape(NamedTuple):
    B: int
    L: int
    D: int
    H: int
    causal: bool

    def __str__(self):
        return f"{self.B}x{self.L}x{self.D}x{self.H}" + ("c" if self.causal else "")


DEFAULT_SHAPES = (
    Shape(32, 128, 256, 8, False),
    Shape(8, 512, 768, 12, False),
    Shape(4, 1024, 768, 12, True),
    Shape(1, 4096, 512, 8, False),
)


def parse_shapes(text: str):
    """``"32x128x256x8,4x1024x768x12c"`` -> tuple of ``Shape``."""
    shapes = []
    for item in text.split(","):
        item = item.strip().lower()
        if not item:
            continue
        causal = item.endswith("c")
        parts = item.rstrip("c").split("x")
        try:
            B, L, D, H = (int(p) for p in parts)
        except ValueError:
            raise ValueError(
                f"--shapes: expected items like 32x128x256x8 or 4x1024x768x12c, got {item!r}"
            ) from None
        if min(B, L, D, H) < 1 or D % H:
            raise ValueError(f"--shapes: {item!r} needs positive sizes and D divisible by H")
        shapes.append(Shape(B, L, D, H, causal))
    if not shapes:
        raise ValueError(f"--shapes: no shape in {text!r}")
    return tuple(shapes)


def flops(shape: Shape) -> float:
    """Matmul FLOPs of one self-attention forward+backward (2 per multiply-add).

    Projections: forward 4 GEMMs of (B*L, D) x (D, D) = 8 B L D^2; backward
    needs two per forward GEMM (input and weight gradient) = 16 B L D^2.
    Attention: forward ``q k^T`` and ``a v`` = 4 B L^2 D; backward ``dv``,
    ``da``, ``dq``, ``dk`` = 8 B L^2 D; counted at half when causal.
    Elementwise work (softmax, bias, scaling) is not counted.
    """
    B, L, D, H, causal = shape
    proj = 24.0 * B * L * D * D
    attn = 12.0 * B * L * L * D * (0.5 if causal else 1.0)
    return proj + attn


# ---------------------------------------------------------------- timing


def _sync_for(xp):
    name = backend_name(xp)
    if name == "cupy":
        import cupy

        return lambda: cupy.cuda.Device().synchronize()
    if name == "torch":
        import torch

        if torch.cuda.is_available():
            return torch.cuda.synchronize
    return lambda: None


_PAUSE = 0.0


def _timed(fn, sync):
    sync()
    if _PAUSE:
        # let the previous step's BLAS/OpenMP threads stop spinning before timing
        time.sleep(_PAUSE)
    t0 = time.perf_counter()
    fn()
    sync()
    return time.perf_counter() - t0


def _gemm_step(xp, dtype: str, n: int):
    """A step that runs one (n, n) @ (n, n) matmul in ``dtype`` on ``xp``; its FLOPs."""
    rng = np.random.default_rng(1)
    a = xp.astype(from_numpy(rng.standard_normal((n, n)), xp), getattr(xp, dtype))
    b = xp.astype(from_numpy(rng.standard_normal((n, n)), xp), getattr(xp, dtype))
    return (lambda: a @ b), 2.0 * n**3


def gemm_gflops(xp, dtype: str, n: int, repeat: int, sync) -> float:
    """Median GFLOP/s of an (n, n) @ (n, n) matmul in ``dtype`` on ``xp``."""
    step, fl = _gemm_step(xp, dtype, n)
    step()  # warm-up
    times = [_timed(step, sync) for _ in range(max(repeat, 3))]
    return fl / statistics.median(times) / 1e9


def _module_supports_impl() -> bool:
    from ..module import MultiHeadAttention

    return "impl" in inspect.signature(MultiHeadAttention.__init__).parameters


def _make_npattn(shape: Shape, dtype: str, backend: str, impl: str):
    from ..module import MultiHeadAttention

    kwargs = {"seed": 0, "dtype": dtype, "backend": backend}
    if _module_supports_impl():
        kwargs["impl"] = impl
    m = MultiHeadAttention(shape.D, shape.H, **kwargs)
    xp = m.xp
    rng = np.random.default_rng(2)
    x = xp.astype(from_numpy(rng.standard_normal((shape.B, shape.L, shape.D)), xp), m.dtype)
    dout = xp.astype(from_numpy(rng.standard_normal((shape.B, shape.L, shape.D)), xp), m.dtype)

    def step():
        m(x, x, x, is_causal=shape.causal)
        m.backward(dout)

    return m, x, dout, step


def _make_torch(shape: Shape, dtype: str, m, x, dout):
    """torch.nn.MultiheadAttention with m's weights on the same data, or None."""
    try:
        import torch
    except ImportError:
        return None, "torch not installed"
    from ..backend import to_numpy

    name = backend_name(m.xp)
    device = "cpu"
    if name == "cupy":
        if not torch.cuda.is_available():
            return None, "torch has no CUDA here (backend cupy)"
        device = "cuda"
    tdtype = getattr(torch, dtype)
    D, H = shape.D, shape.H
    mha = torch.nn.MultiheadAttention(D, H, batch_first=True, device=device, dtype=tdtype)
    P = {k: to_numpy(v) for k, v in m.params.items()}
    with torch.no_grad():
        w_in = np.concatenate([P["w_q"], P["w_k"], P["w_v"]], axis=0)
        mha.in_proj_weight.copy_(torch.from_numpy(w_in))
        mha.out_proj.weight.copy_(torch.from_numpy(P["w_o"]))
        if m.bias:
            b_in = np.concatenate([P["b_q"], P["b_k"], P["b_v"]])
            mha.in_proj_bias.copy_(torch.from_numpy(b_in))
            mha.out_proj.bias.copy_(torch.from_numpy(P["b_o"]))
    tx = torch.from_numpy(to_numpy(x)).to(device=device, dtype=tdtype).requires_grad_(True)
    tdout = torch.from_numpy(to_numpy(dout)).to(device=device, dtype=tdtype)
    attn_mask = None
    if shape.causal:
        # torch's float mask: -inf above the diagonal (top-left causal), with the hint
        attn_mask = torch.nn.Transformer.generate_square_subsequent_mask(
            shape.L, device=device, dtype=tdtype
        )

    def step():
        mha.zero_grad(set_to_none=True)
        tx.grad = None
        out, _ = mha(
            tx, tx, tx, need_weights=False, attn_mask=attn_mask, is_causal=shape.causal
        )
        out.backward(tdout)

    return step, None


def _peak_traced_mib(step, sync) -> float:
    gc.collect()
    tracemalloc.start()
    try:
        tracemalloc.reset_peak()
        base = tracemalloc.get_traced_memory()[0]
        step()
        sync()
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    return (peak - base) / 2**20


def _hwm_kib():
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return None


def _rss_rise_mib(step, sync):
    """Rise of peak RSS over one step (Linux, with a resettable VmHWM), else None."""
    gc.collect()
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # resets VmHWM to the current RSS
    except OSError:
        return None
    before = _hwm_kib()
    step()
    sync()
    after = _hwm_kib()
    if before is None or after is None:
        return None
    return (after - before) / 1024.0


def _cupy_pool_mib(step, sync):
    import cupy

    pool = cupy.get_default_memory_pool()
    gc.collect()
    pool.free_all_blocks()
    before = pool.used_bytes()
    step()
    sync()
    return (pool.used_bytes() - before) / 2**20


# ---------------------------------------------------------------- report


def environment_info(xp) -> dict:
    info = {
        "python": platform.python_version(),
        "numpy": np.__version__,
        "platform": platform.platform(),
        "cpu": _cpu_model(),
        "cpu_count": os.cpu_count(),
        "backend": backend_name(xp),
    }
    try:
        info["sched_affinity"] = len(os.sched_getaffinity(0))
    except AttributeError:
        pass
    try:
        import threadpoolctl

        info["threadpools"] = [
            {k: p.get(k) for k in ("user_api", "internal_api", "version", "num_threads",
                                   "architecture", "threading_layer", "prefix")}
            for p in threadpoolctl.threadpool_info()
        ]
    except ImportError:
        info["threadpools"] = "threadpoolctl not installed (pip install npattn[bench])"
    info["OPENBLAS_CORETYPE"] = os.environ.get("OPENBLAS_CORETYPE")
    try:
        import torch

        info["torch"] = torch.__version__
        info["torch_threads"] = torch.get_num_threads()
    except ImportError:
        info["torch"] = None
    try:
        from .. import _fast

        info["npattn_pool_threads"] = _fast.pool_threads()
    except (ImportError, AttributeError):
        pass
    return info


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def _fmt(v, spec):
    return "-" if v is None else format(v, spec)


def run(shapes, *, dtype="float32", backend="numpy", impl="dense", repeat=7, warmup=2,
        gemm_n=2048, torch_compare=True, memory=True, pause=0.1, out=None):
    """Run the benchmark and return a dict of results (also printed to ``out``)."""
    global _PAUSE
    _PAUSE = pause
    out = sys.stdout if out is None else out
    xp = resolve_backend(backend)
    sync = _sync_for(xp)
    env = environment_info(xp)
    env["impl"] = impl
    print(f"npattn bench: backend={env['backend']} dtype={dtype} impl={impl} "
          f"repeat={repeat} warmup={warmup} pause={pause}s", file=out)
    print(f"cpu: {env['cpu']} ({env['cpu_count']} logical cpus)", file=out)
    if isinstance(env["threadpools"], list):
        for p in env["threadpools"]:
            print(f"threadpool: {p['internal_api']} {p['version']} arch={p['architecture']} "
                  f"threads={p['num_threads']} ({p['prefix']})", file=out)
    else:
        print(f"threadpool: {env['threadpools']}", file=out)
    if env.get("torch"):
        print(f"torch {env['torch']} threads={env['torch_threads']}", file=out)
    if "npattn_pool_threads" in env:
        print(f"npattn elementwise pool threads: {env['npattn_pool_threads']}", file=out)

    gemm = gemm_gflops(xp, dtype, gemm_n, repeat, sync)
    print(f"GEMM {gemm_n}^3 {dtype}: {gemm:.1f} GFLOP/s at the start; %GEMM uses the GEMM "
          "timed in the same rounds as each shape (column GEMM)", file=out)
    gemm_step, gemm_flops = _gemm_step(xp, dtype, gemm_n)
    header = (f"{'shape':>18} {'ms':>9} {'GFLOP/s':>8} {'GEMM':>6} {'%GEMM':>6} {'peak MiB':>9} "
              f"{'RSS MiB':>8} {'torch ms':>9} {'ratio':>6} {'ratio(min)':>10}")
    print(header, file=out)

    rows = []
    for shape in shapes:
        m, x, dout, step = _make_npattn(shape, dtype, backend, impl)
        tstep, why_not = (None, "disabled")
        if torch_compare:
            try:
                tstep, why_not = _make_torch(shape, dtype, m, x, dout)
            except Exception as exc:  # torch may lack a kernel for this dtype/device
                tstep, why_not = None, f"{type(exc).__name__}: {exc}"
        for _ in range(warmup):
            step()
            if tstep:
                tstep()
        ts, tt, tg = [], [], []
        for _ in range(repeat):  # alternate, so that machine noise hits all alike
            ts.append(_timed(step, sync))
            if tstep:
                tt.append(_timed(tstep, sync))
            tg.append(_timed(gemm_step, sync))
        ms = statistics.median(ts) * 1e3
        torch_ms = statistics.median(tt) * 1e3 if tt else None
        rate = flops(shape) / (ms * 1e-3) / 1e9
        gemm_here = gemm_flops / statistics.median(tg) / 1e9
        peak = rss = None
        if memory:
            m._cache = None  # the last timed step's cache: not part of the next step's peak
            if backend_name(xp) == "cupy":
                peak = _cupy_pool_mib(step, sync)
            else:
                peak = _peak_traced_mib(step, sync)
                m._cache = None
                rss = _rss_rise_mib(step, sync)
        row = {
            "shape": str(shape), "B": shape.B, "L": shape.L, "D": shape.D, "H": shape.H,
            "causal": shape.causal, "ms": ms, "ms_all": [t * 1e3 for t in ts],
            "gflops": rate, "gemm_gflops": gemm_here, "pct_gemm": 100.0 * rate / gemm_here,
            "peak_mib": peak,
            "rss_mib": rss, "torch_ms": torch_ms,
            "torch_ms_all": [t * 1e3 for t in tt],
            "ratio": ms / torch_ms if torch_ms else None,
            "ms_min": min(ts) * 1e3,
            "torch_ms_min": min(tt) * 1e3 if tt else None,
            "ratio_min": min(ts) / min(tt) if tt else None,
            "torch_note": None if tstep else why_not,
        }
        rows.append(row)
        print(f"{str(shape):>18} {ms:9.2f} {rate:8.1f} {gemm_here:6.1f} {row['pct_gemm']:6.1f} "
              f"{_fmt(peak, '9.1f')} {_fmt(rss, '8.1f')} {_fmt(torch_ms, '9.2f')} "
              f"{_fmt(row['ratio'], '6.2f')} {_fmt(row['ratio_min'], '10.2f')}", file=out)
        if not tstep and torch_compare:
            print(f"{'':>18} (torch: {why_not})", file=out)
        del m, x, dout, step, tstep
        gc.collect()
    return {"env": env, "gemm_gflops": gemm, "gemm_n": gemm_n, "dtype": dtype, "rows": rows}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        prog="npattn bench",
        description="Time MultiHeadAttention forward+backward (self-attention) against torch.",
    )
    parser.add_argument("--shapes", default=",".join(str(s) for s in DEFAULT_SHAPES),
                        help="comma-separated BxLxDxH[c] (c = causal); default: %(default)s")
    parser.add_argument("--dtype", default="float32", choices=["float32", "float64", "float16"])
    parser.add_argument("--backend", default="numpy",
                        choices=["numpy", "cupy", "torch", "array_api_strict"])
    parser.add_argument("--impl", default="dense", choices=["auto", "dense", "blocked"],
                        help="attention implementation passed to the module (default: dense)")
    parser.add_argument("--repeat", type=int, default=7, help="timed runs per shape (>= 5)")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--gemm", type=int, default=2048, help="size n of the n^3 reference GEMM")
    parser.add_argument("--threads", type=int, metavar="N",
                        help="threads of npattn's tile pool (sets NPATTN_NUM_THREADS; "
                             "default: the usable CPUs)")
    parser.add_argument("--pause", type=float, default=0.1, metavar="S",
                        help="seconds of rest before each timed step, so that one library's "
                             "spinning worker threads do not slow the next (default: %(default)s)")
    parser.add_argument("--no-torch", action="store_true", help="skip the torch comparison")
    parser.add_argument("--no-memory", action="store_true", help="skip the peak-memory run")
    parser.add_argument("--json", metavar="PATH", help="also write the results as JSON ('-' = stdout)")
    args = parser.parse_args(argv)
    if args.repeat < 5:
        parser.error(f"--repeat: expected at least 5, got {args.repeat}")
    try:
        shapes = parse_shapes(args.shapes)
    except ValueError as exc:
        parser.error(str(exc))
    if args.impl == "auto" and not _module_supports_impl():
        print("npattn bench: MultiHeadAttention has no impl argument; --impl auto runs "
              "the dense path", file=sys.stderr)
    elif args.impl != "dense" and not _module_supports_impl():
        print(f"npattn bench: --impl {args.impl} is not available in this npattn "
              "(MultiHeadAttention has no impl argument; only the dense path exists)",
              file=sys.stderr)
        return 2
    if args.threads is not None:
        if args.threads < 1:
            parser.error(f"--threads: expected a positive integer, got {args.threads}")
        os.environ["NPATTN_NUM_THREADS"] = str(args.threads)
    try:
        resolve_backend(args.backend)
    except ImportError as exc:
        print(f"npattn bench: {exc}", file=sys.stderr)
        return 2
    result = run(shapes, dtype=args.dtype, backend=args.backend, impl=args.impl,
                 repeat=args.repeat, warmup=args.warmup, gemm_n=args.gemm,
                 torch_compare=not args.no_torch, memory=not args.no_memory,
                 pause=args.pause)
    if args.json:
        text = json.dumps(result, indent=1, default=str)
        if args.json == "-":
            print(text)
        else:
            with open(args.json, "w") as f:
                f.write(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
