"""Benchmark: ``MultiHeadAttention`` forward+backward against PyTorch.

Run ``npattn bench`` (or ``python -m npattn.tools.bench``). For each shape
(B, L, d_model, H, causal) it times one self-attention forward+backward of
the module (``out, _ = m(x, x, x); m.backward(dout)``), median of ``--repeat``
runs after warm-up, and prints:

* ``ms``: median over ``--repeat`` samples (after warm-up) of the mean wall
  time of one forward+backward. A sample runs the step ``n`` times back to
  back, ``n`` the least of 1, 2, 5, 10, 20, ... that makes it last at least
  ``--min-sample`` seconds (0.2; the autorange of ``timeit`` and
  ``torch.utils.benchmark``), so that a small shape is not timed one
  cold call at a time; torch and the GEMM are timed the same way, and
  ``--pause`` rests before each sample, not each step;
* ``n``: npattn's steps per sample (torch's and the GEMM's are in the JSON);
* ``GFLOP/s``: achieved rate, counting the matmul FLOPs of forward+backward
  (see ``flops``), causal attention matmuls at half;
* ``GEMM``, ``%GEMM``: the GFLOP/s of a square ``--gemm``-sized matmul of
  the same dtype, timed in the same rounds as the shape (one GEMM sample
  per round), and the shape's rate as a percentage of it; above 100 the
  GEMM was slowed by other load, and the row says so;
* ``peak MiB``: peak traced allocation during one forward+backward, above
  what was live before it (``tracemalloc``, which traces NumPy's array
  allocations; on CuPy the most bytes the memory pool handed out to arrays
  during the step, followed with a ``cupy.cuda.MemoryHook``, where the table
  shows torch's ``max_memory_allocated`` as ``torch MiB`` in place of
  ``RSS MiB``). ``RSS MiB`` is the rise of the
  process's peak resident memory (Linux ``VmHWM``, reset through
  ``/proc/self/clear_refs`` before the run), shown when the kernel allows it;
  memory the allocator reuses without asking the kernel does not show there,
  and a rise below 0.05 MiB is printed ``<0.1`` with a note saying so; a
  missing value is a ``-``. Both are measured in a separate, untimed step that starts without the
  module's previous cache;
* with torch installed: ``torch ms``, ``torch.nn.MultiheadAttention``
  (``batch_first=True``, same weights, same input, ``need_weights=False``)
  forward+backward, timed alternately with npattn in the same loop, and
  ``ratio`` = npattn / torch of the medians; ``ratio(min)`` the same of the
  fastest samples, which a machine shared with other work disturbs least.

``--json PATH`` writes the results as JSON; ``--json -`` prints the JSON
alone on stdout and the table on stderr. A progress bar runs on stderr when
it is a terminal.

Shapes are written ``BxLxDxH`` with optional suffixes: ``c`` causal, ``wN`` a
window of N keys back, ``dP`` dropout with drop probability P, e.g.
``--shapes 32x128x256x8,4x1024x768x12c,8x512x768x12d0.1``.

Isolated mode (``--isolated``) runs each case in a fresh Python process
(``python -m npattn.tools.bench --child SPEC``, which prints one JSON line),
so that the peak resident memory it reports belongs to that one shape and
path alone: ``peak RSS`` is the child's Linux ``VmHWM`` (``ru_maxrss``
elsewhere), which includes the interpreter, NumPy, the parameters and the
inputs; ``RSS before`` is the same number just before the first forward.
It times ``--repeat`` runs (default 1) after ``--warmup`` (default 0), with
no torch comparison and no traced-memory step, and takes ``--block-q`` /
``--block-k`` for the blocked path and ``--markdown PATH`` to append a table.
A case whose child fails (out of memory, say) is reported on standard error;
the others still run and are written, and the exit status is then 1.
Without ``--shapes`` it runs ``ISOLATED_PLAN``. For example::

    npattn bench --isolated --shapes 1x16384x512x8 --impl blocked
    npattn bench --isolated --shapes 1x4096x512x8 --impl dense --repeat 3 --warmup 1

GFLOP/s counts model FLOPs (``flops``); the blocked backward's recomputation
of the scores is not counted.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import importlib.util
import json
import math
import os
import platform
import re
import statistics
import subprocess
import sys
import time
import tracemalloc
from pathlib import Path
from typing import Any, NamedTuple, Optional

import numpy as np

from .. import validation as V
from ..backend import accelerator_memory, resolve_backend, backend_name, from_numpy
from .limits import (MAX_SIZE, MAX_THREADS, SKIP_MEMORY_CHECK, SKIP_MEMORY_CHECK_HELP,
                     dense_probabilities, memory_error)
from .outputs import outputs_error

__all__ = [
    "main", "run", "run_isolated", "measure_here", "measure_isolated", "markdown_table",
    "case_blocks", "isolated_widths", "format_isolated_header", "format_isolated_row",
    "environment_info", "cpu_text", "Shape", "parse_shapes", "flops", "step_bytes",
    "memory_refusal", "gemm_refusal", "DEFAULT_SHAPES", "ISOLATED_PLAN",
]


class Shape(NamedTuple):
    B: int
    L: int
    D: int
    H: int
    causal: bool
    dropout: float = 0.0  # drop probability of the attention weights, both libraries in training
    window: Optional[int] = None  # sliding window: query i attends keys i - window .. i

    def __str__(self):  # parse_shapes reads it back: the dropout in all its digits, no exponent
        drop = f"d{np.format_float_positional(float(self.dropout), trim='-')}" if self.dropout else ""
        win = f"w{self.window}" if self.window is not None else ""
        return f"{self.B}x{self.L}x{self.D}x{self.H}" + ("c" if self.causal else "") + win + drop


DEFAULT_SHAPES = (
    Shape(32, 128, 256, 8, False),
    Shape(8, 512, 768, 12, False),
    Shape(4, 1024, 768, 12, True),
    Shape(1, 4096, 512, 8, False),
    Shape(8, 512, 768, 12, False, 0.1),  # the cost of dropout: against the second row
)

#: ``--isolated`` without ``--shapes``: (shape, impl) cases; a shorter sequence on
#: both paths, to compare their speed where dense still fits, and a long one on
#: the blocked path.
ISOLATED_PLAN = (
    (Shape(1, 4096, 512, 8, False), "dense"),
    (Shape(1, 4096, 512, 8, False), "blocked"),
    (Shape(1, 16384, 512, 8, False), "blocked"),
    (Shape(1, 16384, 512, 8, True), "blocked"),
    (Shape(1, 16384, 512, 8, False, window=256), "blocked"),
)


def parse_shapes(text: str):
    """``"32x128x256x8,4x1024x768x12c,8x512x768x12d0.1,1x16384x512x8w256"`` -> tuple of ``Shape``.

    A trailing ``c`` means causal, ``wN`` a sliding window of N keys back
    (``window=(N, 0)``: query i attends keys i - N .. i), ``dP`` dropout with
    drop probability P. Every item must be a shape: an empty one (``a,,b``, a trailing
    comma) is refused, as is a text without any shape.
    """
    items = [item.strip().lower() for item in text.split(",")]
    if not any(items):
        raise ValueError(f"--shapes: no shape in {text!r}")
    if not all(items):  # "a,,b" or "a,": a shape left out by mistake, not a shorter run
        raise ValueError(f"--shapes: expected comma-separated shapes such as 32x128x256x8,4x1024x768x12c, "
                         f"got an empty item (number {items.index('') + 1} of {len(items)}) in {text!r}")
    shapes = []
    for item in items:
        match = re.fullmatch(r"([0-9]+)x([0-9]+)x([0-9]+)x([0-9]+)(c?)(?:w([0-9]+))?(?:d([0-9.]+))?", item)
        if match is None:
            raise ValueError(
                f"--shapes: expected items like 32x128x256x8, 4x1024x768x12c, "
                f"1x16384x512x8w256 or 8x512x768x12d0.1, got {item!r}"
            )
        B, L, D, H = (int(g) for g in match.groups()[:4])
        try:
            p = float(match.group(7)) if match.group(7) else 0.0
        except ValueError:
            p = -1.0
        if min(B, L, D, H) < 1 or D % H:
            raise ValueError(f"--shapes: {item!r} needs positive sizes and D divisible by H")
        if max(B, L, D, H) > MAX_SIZE:
            raise ValueError(f"--shapes: {item!r} needs sizes of at most {MAX_SIZE} (BLAS "
                             f"takes 32-bit sizes), got {max(B, L, D, H)}")
        if not 0.0 <= p < 1.0:
            raise ValueError(f"--shapes: {item!r}: the dropout after d must be in [0, 1)")
        window = int(match.group(6)) if match.group(6) else None
        shapes.append(Shape(B, L, D, H, bool(match.group(5)), p, window))
    return tuple(shapes)


def flops(shape: Shape) -> float:
    """Matmul FLOPs of one self-attention forward+backward (2 per multiply-add).

    Projections: forward 4 GEMMs of (B*L, D) x (D, D) = 8 B L D^2; backward
    needs two per forward GEMM (input and weight gradient) = 16 B L D^2.
    Attention: forward ``q k^T`` and ``a v`` = 4 B L^2 D; backward ``dv``,
    ``da``, ``dq``, ``dk`` = 8 B L^2 D; counted at half when causal, and for a
    window of w keys back over the ``L (w + 1) - w (w + 1) / 2`` attended pairs.
    Elementwise work (softmax, bias, scaling) is not counted.
    """
    B, L, D, H, causal = shape[:5]
    proj = 24.0 * B * L * D * D
    pairs = L * L * (0.5 if causal else 1.0)
    if shape.window is not None:
        w = min(shape.window, L - 1)
        pairs = L * (w + 1) - w * (w + 1) / 2
    attn = 12.0 * B * pairs * D
    return proj + attn


def step_bytes(shape: Shape, impl: str = "dense", dtype: str = "float32",
               scope: str = "module") -> tuple[int, str]:
    """A lower bound of the bytes one benchmarked step holds at its peak, and what it counts.

    The module's step (``scope="module"``) holds its input ``x`` and ``dout``, the
    projected ``q``, ``k``, ``v`` and the attention output kept for the backward
    (``6 B L D``) and the four ``D x D`` weights; the core alone
    (``scope="attention"``) its ``q``, ``k``, ``v``, ``dout`` and output
    (``5 B L D``). The dense paths (``impl`` dense, reference, numpy, and auto
    where it stays dense) keep the attention probabilities, ``B H L L``.
    Temporaries, gradients and the torch side are not counted.
    """
    B, L, D, H = shape.B, shape.L, shape.D, shape.H
    itemsize = np.dtype(dtype).itemsize
    probs = dense_probabilities(B, H, L, L, impl)
    acts, weights = (6 * B * L * D, 4 * D * D) if scope == "module" else (5 * B * L * D, 0)
    what = (f"{'6' if scope == 'module' else '5'} B*L*D activations"
            + (" and 4 D*D weights" if weights else "")
            + (f" and {B}*{H}*{L}*{L} attention probabilities of impl {impl}" if probs else "")
            + f", {dtype}")
    return itemsize * (acts + weights + probs), what


def memory_refusal(cases, dtype: str = "float32", scope: str = "module",
                   available: Optional[int] = None, gemm_n: int = 0) -> Optional[str]:
    """The usage error for the first ``(shape, impl)`` case whose step cannot fit in memory
    (``step_bytes`` against ``limits.available_memory()``), or None. ``gemm_n``: the size of
    a GEMM whose inputs and product are held while each step runs (``run`` times the two in
    turn), counted with every step."""
    held = 3 * gemm_n * gemm_n * np.dtype(dtype).itemsize
    for shape, impl in cases:
        need, what = step_bytes(shape, impl, dtype, scope)
        if held:
            need, what = need + held, f"{what}, and the --gemm {gemm_n}'s three arrays held beside"
        why = memory_error("--shapes", f"{shape} (--impl {impl})", need, what, available)
        if why:
            return why
    return None


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


#: Shortest sample: each timed sample runs a step back to back as many times
#: (1, 2, 5, 10, 20, 50, ...) as it takes to last this long, the autorange of
#: ``timeit`` and ``torch.utils.benchmark``.
MIN_SAMPLE_S = 0.2


def _timed(fn, sync, number=1, pause=0.0):
    """Seconds per call of one sample: ``number`` back-to-back calls of ``fn``, after ``pause``."""
    sync()
    if pause:
        # let the previous step's BLAS/OpenMP threads stop spinning before timing
        time.sleep(pause)
    t0 = time.perf_counter()
    for _ in range(number):
        fn()
    sync()
    return (time.perf_counter() - t0) / number


def autorange(fn, sync, min_time=MIN_SAMPLE_S, max_number=10**6) -> int:
    """Calls of ``fn`` per sample so that one sample lasts at least ``min_time`` seconds.

    Tries 1, 2, 5, 10, 20, 50, ... back-to-back calls, as ``timeit.Timer.autorange``
    does; a step that alone takes ``min_time`` or more gets 1.
    """
    i = 1
    while True:
        for j in (1, 2, 5):
            number = i * j
            if number >= max_number or _timed(fn, sync, number) * number >= min_time:
                return number
        i *= 10


def _gemm_step(xp, dtype: str, n: int):
    """A step that runs one (n, n) @ (n, n) matmul in ``dtype`` on ``xp``; its FLOPs."""
    rng = np.random.default_rng(1)
    a = xp.astype(from_numpy(rng.standard_normal((n, n)), xp), getattr(xp, dtype))
    b = xp.astype(from_numpy(rng.standard_normal((n, n)), xp), getattr(xp, dtype))
    return (lambda: a @ b), 2.0 * n**3


def gemm_refusal(n: int, dtype: str = "float32", available: Optional[int] = None) -> Optional[str]:
    """The usage error of a ``--gemm n`` whose arrays cannot fit in memory, or None: the
    float64 draw ``_gemm_step`` makes each input from, and the two inputs and the product in
    ``dtype``."""
    itemsize = np.dtype(dtype).itemsize
    return memory_error("--gemm", str(n), n * n * (8 + 3 * itemsize),
                        f"a float64 draw and three {n}x{n} {dtype} arrays", available)


def gemm_gflops(xp, dtype: str, n: int, repeat: int, sync, min_time=0.0) -> float:
    """Median GFLOP/s of an (n, n) @ (n, n) matmul in ``dtype`` on ``xp``.

    Each of ``max(repeat, 3)`` samples lasts at least ``min_time`` seconds (``autorange``).
    """
    step, fl = _gemm_step(xp, dtype, n)
    step()  # warm-up
    number = autorange(step, sync, min_time) if min_time else 1
    times = [_timed(step, sync, number) for _ in range(max(repeat, 3))]
    return fl / statistics.median(times) / 1e9


def check_dtype(xp, dtype: str):
    """The dtype object ``dtype`` of namespace ``xp``; a ValueError naming both when it has none."""
    value = getattr(xp, dtype, None)
    if value is None:
        name = backend_name(xp)
        extra = (" (the Array API standard defines float32 and float64, not float16)"
                 if name == "array_api_strict" else "")
        raise ValueError(f"--dtype {dtype}: the {name} backend has no {dtype}{extra}; "
                         "choose float32 or float64")
    return value


def _make_npattn(shape: Shape, dtype: str, backend: str, impl: str, block_q=None, block_k=None):
    from ..module import MultiHeadAttention

    m = MultiHeadAttention(shape.D, shape.H, seed=0, dtype=dtype, backend=backend, impl=impl,
                           dropout=shape.dropout, block_q=block_q, block_k=block_k)
    xp = m.xp
    rng = np.random.default_rng(2)
    x = xp.astype(from_numpy(rng.standard_normal((shape.B, shape.L, shape.D)), xp), m.dtype)
    dout = xp.astype(from_numpy(rng.standard_normal((shape.B, shape.L, shape.D)), xp), m.dtype)

    extra: dict[str, Any] = {} if shape.window is None else {"window": (shape.window, 0)}

    def step():  # as a training loop runs it: the next forward reuses this one's arrays
        m(x, x, x, is_causal=shape.causal, **extra)
        m.backward(dout)

    return m, x, dout, step


def _make_core(shape: Shape, dtype: str, backend: str, impl: str, block_q=None, block_k=None):
    """One step of the attention core alone (``attention.sdpa_forward`` + ``sdpa_backward``) on
    q, k, v of shape (B, H, L, D / H): the projections of the module left out."""
    from .. import attention as A

    xp = resolve_backend(backend)
    rng = np.random.default_rng(2)
    Dh = shape.D // shape.H
    q, k, v, dout = (xp.astype(from_numpy(rng.standard_normal((shape.B, shape.H, shape.L, Dh)), xp),
                               getattr(xp, dtype)) for _ in range(4))
    extra: dict[str, Any] = {} if shape.window is None else {"window": (shape.window, 0)}
    blocks: dict[str, Any] = {"block_q": block_q, "block_k": block_k} if impl in ("blocked", "auto") else {}

    def step():
        _, cache = A.sdpa_forward(q, k, v, is_causal=shape.causal, impl=impl, dropout_p=shape.dropout,
                                  rng=0 if shape.dropout else None, **extra, **blocks)
        A.sdpa_backward(dout, cache)

    return xp, step


def _make_torch(shape: Shape, dtype: str, m, x, dout):
    """torch.nn.MultiheadAttention with m's weights on the same data, or None."""
    try:
        import torch
    except ImportError:
        return None, "torch not installed"
    from ..backend import to_numpy

    name = backend_name(m.xp)
    device: Any = "cpu"  # a str or a torch.device
    if name == "cupy":
        if not torch.cuda.is_available():
            return None, "torch has no CUDA here (backend cupy)"
        device = "cuda"
    tdtype = getattr(torch, dtype)
    D, H = shape.D, shape.H
    mha = torch.nn.MultiheadAttention(D, H, batch_first=True, device=device, dtype=tdtype,
                                      dropout=shape.dropout)
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
    if shape.window is not None:  # torch has no window: an explicit float mask, -inf outside
        i = torch.arange(shape.L, device=device)
        d = i[None, :] - i[:, None]  # j - i
        attn_mask = torch.zeros((shape.L, shape.L), device=device, dtype=tdtype)
        attn_mask.masked_fill_((d > 0) | (d < -shape.window), float("-inf"))
    elif shape.causal:
        # torch's float mask: -inf above the diagonal (top-left causal), with the hint
        attn_mask = torch.nn.Transformer.generate_square_subsequent_mask(
            shape.L, device=device, dtype=tdtype
        )

    def step():
        mha.zero_grad(set_to_none=True)
        tx.grad = None
        out, _ = mha(
            tx, tx, tx, need_weights=False, attn_mask=attn_mask,
            is_causal=shape.causal and shape.window is None
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


def _cupy_peak_mib(step, sync):
    """Peak device memory of one step, MiB: the most bytes CuPy's pool had handed out to
    arrays during the step, above what it had handed out before (torch's
    ``max_memory_allocated`` likewise), followed allocation by allocation with a
    ``cupy.cuda.MemoryHook``. The pool's held bytes are no measure: blocks freed before the
    step can stay held, in segments that an array still alive shares."""
    import cupy

    class Peak(cupy.cuda.MemoryHook):
        name = "npattn_bench_peak"

        def __init__(self):
            self.now = self.peak = 0

        def malloc_postprocess(self, **kw):
            self.now += kw["mem_size"]
            self.peak = max(self.peak, self.now)

        def free_postprocess(self, **kw):
            self.now -= kw["mem_size"]

    gc.collect()
    sync()
    hook = Peak()
    with hook:
        step()
        sync()
    return hook.peak / 2**20


def _torch_cuda_peak_mib(step, sync):
    """Peak device memory torch allocated during one step, MiB (its caching allocator's count)."""
    import torch

    gc.collect()
    sync()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    step()
    sync()
    return (torch.cuda.max_memory_allocated() - before) / 2**20


# ---------------------------------------------------------------- report


def environment_info(xp) -> dict:
    info: dict = {
        "python": platform.python_version(),
        "numpy": np.__version__,
        "platform": platform.platform(),
        "cpu": _cpu_model(),
        "cpu_id": _cpu_id(),
        "cpu_count": os.cpu_count(),
        "backend": backend_name(xp),
    }
    try:
        info["sched_affinity"] = len(os.sched_getaffinity(0))
    except AttributeError:
        pass
    try:
        with open("/proc/meminfo") as f:
            info["memory_gib"] = int(f.readline().split()[1]) / 2**20  # MemTotal, KiB
    except (OSError, ValueError, IndexError):
        info["memory_gib"] = None
    try:
        import threadpoolctl

        info["threadpools"] = [
            {k: p.get(k) for k in ("user_api", "internal_api", "version", "num_threads",
                                   "architecture", "threading_layer", "prefix")}
            for p in threadpoolctl.threadpool_info()
        ]
    except ImportError:
        info["threadpools"] = ("threadpoolctl not installed (a dependency of npattn: "
                               "pip install threadpoolctl)")
    info["OPENBLAS_CORETYPE"] = os.environ.get("OPENBLAS_CORETYPE")
    try:
        import torch

        info["torch"] = torch.__version__
        info["torch_threads"] = torch.get_num_threads()
    except ImportError:
        info["torch"] = None
    from ..backend import pool_threads

    info["npattn_pool_threads"] = pool_threads()
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


def _cpu_id() -> Optional[str]:
    """The first CPU's family and model numbers from /proc/cpuinfo ("family 25 model 17"), or
    None: a VM often names only the vendor's line ("AMD EPYC") for CPUs of several
    generations, and these numbers tell them apart."""
    fields: dict = {}
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if not line.strip() and fields:  # the end of the first processor's block
                    break
                key, _, value = line.partition(":")
                if key.strip() in ("cpu family", "model"):
                    fields[key.strip()] = value.strip()
    except OSError:
        pass
    if len(fields) < 2:
        return None
    return f"family {fields['cpu family']} model {fields['model']}"


def cpu_text(env) -> str:
    """The CPU as the reports print it: its name, and its family and model where known."""
    cpu_id = env.get("cpu_id")
    return env["cpu"] if cpu_id is None else f"{env['cpu']}, {cpu_id}"


def _print_env(env, settings, dtype, out):
    print(f"npattn bench: backend={env['backend']} dtype={dtype} {settings}", file=out)
    print(f"cpu: {cpu_text(env)} ({env['cpu_count']} logical cpus)", file=out)
    if isinstance(env["threadpools"], list):
        for p in env["threadpools"]:
            print(f"threadpool: {p['internal_api']} {p['version']} arch={p['architecture']} "
                  f"threads={p['num_threads']} ({p['prefix']})", file=out)
    else:
        print(f"threadpool: {env['threadpools']}", file=out)
    if env.get("torch"):
        print(f"torch {env['torch']} threads={env['torch_threads']}", file=out)
    if "npattn_pool_threads" in env:
        print(f"npattn tile pool threads: {env['npattn_pool_threads']}", file=out)


def _fmt(v, spec):
    """``format(v, spec)``, or a ``-`` right-aligned to the spec's width when ``v`` is None."""
    return format("-", ">" + spec.split(".")[0]) if v is None else format(v, spec)


def format_mib(v) -> str:
    """Megabytes with one decimal; ``<0.1`` for a rise that rounds to 0.0; ``-`` for None."""
    if v is None:
        return "-"
    return "<0.1" if v < 0.05 else f"{v:.1f}"


#: The table of ``run``: (header, row key, width, format spec or function of the value).
COLUMNS = (
    ("shape", "shape", 18, "s"),
    ("ms", "ms", 9, ".2f"),
    ("n", "number", 6, "d"),
    ("GFLOP/s", "gflops", 8, ".1f"),
    ("GEMM", "gemm_gflops", 6, ".1f"),
    ("%GEMM", "pct_gemm", 6, ".1f"),
    ("peak MiB", "peak_mib", 9, ".1f"),
    ("RSS MiB", "rss_mib", 8, format_mib),
    ("torch ms", "torch_ms", 9, ".2f"),
    ("ratio", "ratio", 6, ".2f"),
    ("ratio(min)", "ratio_min", 10, ".2f"),
)

#: on the GPU (backend cupy): peak MiB is the most device memory npattn's step had in arrays at
#: once, and the host RSS column gives way to torch's step's peak device memory
GPU_COLUMNS = tuple(("torch MiB", "torch_peak_mib", 9, ".1f") if col[1] == "rss_mib" else col
                    for col in COLUMNS)

GEMM_WARNING = ("%GEMM > 100: the reference GEMM was slowed by load (it cannot be slower "
                "than attention's own matmuls); rerun")
RSS_NOTE = ("RSS MiB <0.1: the peak resident memory did not rise, because the allocator "
            "reused memory the process already held; peak MiB is what the step allocated")


def _cell(value, width, spec) -> str:
    if callable(spec):
        text = spec(value)
    else:
        text = "-" if value is None else format(value, spec)
    return text.rjust(width)


def format_header(columns=COLUMNS) -> str:
    """The table's header line; every cell right-aligned in its column."""
    return " ".join(title.rjust(width) for title, _, width, _ in columns)


def format_row(row: dict, columns=COLUMNS) -> str:
    """One result row as a table line; a missing value (None) is a ``-`` at its column's right edge."""
    return " ".join(_cell(row.get(key), width, spec) for _, key, width, spec in columns)


def row_notes(row: dict) -> list:
    """Warnings and explanations that belong under a row of the table."""
    notes = []
    if row.get("pct_gemm") is not None and row["pct_gemm"] > 100.0:
        notes.append(GEMM_WARNING)
    if row.get("rss_mib") is not None and row["rss_mib"] < 0.05:
        notes.append(RSS_NOTE)
    if row.get("torch_note"):
        notes.append(f"torch: {row['torch_note']}")
    return notes


def _row_lines(row: dict, columns=COLUMNS) -> list:
    """A row's line and its notes under it (the RSS note, the same for every row, is left out)."""
    indent = " " * columns[0][2]
    return [format_row(row, columns)] + [f"{indent} ({note})" for note in row_notes(row)
                                          if note != RSS_NOTE]


def _footnotes(rows) -> list:
    return [f"note: {RSS_NOTE}"] if any(RSS_NOTE in row_notes(r) for r in rows) else []


def format_table(rows, columns=COLUMNS) -> str:
    """Header, a line per row with its notes under it, and the RSS note once at the end."""
    lines = [format_header(columns)]
    for row in rows:
        lines += _row_lines(row, columns)
    return "\n".join(lines + _footnotes(rows))


def run(shapes, *, dtype="float32", backend="numpy", impl="dense", repeat=7, warmup=2,
        gemm_n=2048, torch_compare=True, memory=True, pause=0.1, min_sample=MIN_SAMPLE_S,
        out=None, progress=True):
    """Run the benchmark and return a dict of results (also printed to ``out``).

    Each of the ``repeat`` samples of a library runs its step back to back
    ``n`` times (``autorange``: the least of 1, 2, 5, 10, ... that lasts
    ``min_sample`` seconds, found per library and shape) and records the mean
    time per step; npattn, torch and the reference GEMM are timed alike and
    alternately, sample by sample, after ``pause`` seconds of rest each. The
    table goes to ``out`` (default stdout), a progress bar to stderr when it
    is a terminal.
    """
    from .progress import ProgressBar

    out = sys.stdout if out is None else out
    # before the GEMM is timed: a median of no samples failed after it (main checks them too)
    repeat = V.check_positive_int("repeat", repeat)
    warmup = V.check_size("warmup", warmup)
    xp = resolve_backend(backend)
    check_dtype(xp, dtype)
    sync = _sync_for(xp)
    env = environment_info(xp)
    env["impl"] = impl
    _print_env(env, f"impl={impl} repeat={repeat} warmup={warmup} pause={pause}s "
               f"min_sample={min_sample}s", dtype, out)

    gemm = gemm_gflops(xp, dtype, gemm_n, repeat, sync, min_sample)
    print(f"GEMM {gemm_n}^3 {dtype}: {gemm:.1f} GFLOP/s at the start; %GEMM uses the GEMM "
          "timed in the same rounds as each shape (column GEMM)", file=out)
    print(f"ms: median over {repeat} samples of the mean time per step; each sample runs "
          f"n steps back to back (n chosen so that it lasts >= {min_sample:g} s, torch's "
          "and the GEMM's likewise)", file=out)
    gemm_step, gemm_flops = _gemm_step(xp, dtype, gemm_n)
    columns = GPU_COLUMNS if backend_name(xp) == "cupy" else COLUMNS
    print(format_header(columns), file=out, flush=True)

    rows = []
    bar = ProgressBar(len(shapes) * repeat, "bench", enabled=progress, unit="sample")
    for shape in shapes:
        bar.update(0, f"{shape}: warm-up")
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
        number = autorange(step, sync, min_sample)
        tnumber = autorange(tstep, sync, min_sample) if tstep else None
        gnumber = autorange(gemm_step, sync, min_sample)
        ts, tt, tg = [], [], []
        for i in range(repeat):  # alternate, so that machine noise hits all alike
            ts.append(_timed(step, sync, number, pause))
            if tstep:
                tt.append(_timed(tstep, sync, tnumber, pause))
            tg.append(_timed(gemm_step, sync, gnumber, pause))
            bar.update(1, f"{shape}: sample {i + 1}/{repeat}")
        ms = statistics.median(ts) * 1e3
        torch_ms = statistics.median(tt) * 1e3 if tt else None
        rate = flops(shape) / (ms * 1e-3) / 1e9
        gemm_here = gemm_flops / statistics.median(tg) / 1e9
        peak = rss = torch_peak = None
        if memory:
            bar.update(0, f"{shape}: memory")
            m.clear_cache()  # the last timed step's cache: not part of the next step's peak
            if backend_name(xp) == "cupy":
                peak = _cupy_peak_mib(step, sync)
                if tstep:
                    torch_peak = _torch_cuda_peak_mib(tstep, sync)
            else:
                peak = _peak_traced_mib(step, sync)
                m.clear_cache()
                rss = _rss_rise_mib(step, sync)
        row = {
            "shape": str(shape), "B": shape.B, "L": shape.L, "D": shape.D, "H": shape.H,
            "causal": shape.causal, "window": shape.window, "dropout": shape.dropout, "ms": ms,
            "ms_all": [t * 1e3 for t in ts],
            "number": number, "torch_number": tnumber, "gemm_number": gnumber,
            "gflops": rate, "gemm_gflops": gemm_here, "pct_gemm": 100.0 * rate / gemm_here,
            "peak_mib": peak,
            "rss_mib": rss, "torch_ms": torch_ms, "torch_peak_mib": torch_peak,
            "torch_ms_all": [t * 1e3 for t in tt],
            "ratio": ms / torch_ms if torch_ms else None,
            "ms_min": min(ts) * 1e3,
            "torch_ms_min": min(tt) * 1e3 if tt else None,
            "ratio_min": min(ts) / min(tt) if tt else None,
            "torch_note": None if (tstep or not torch_compare) else why_not,
        }
        row["notes"] = row_notes(row)
        rows.append(row)
        for line in _row_lines(row, columns):
            bar.write(line, file=out)
        del m, x, dout, step, tstep
        gc.collect()
    bar.close()
    for line in _footnotes(rows):
        print(line, file=out)
    return {"env": env, "gemm_gflops": gemm, "gemm_n": gemm_n, "dtype": dtype,
            "min_sample_s": min_sample, "pause_s": pause, "rows": rows}


# ---------------------------------------------------------------- isolated mode


def _blas_limit(n):
    """Hold BLAS to ``n`` threads inside the block (threadpoolctl); None: BLAS's own setting."""
    if n is None:
        return contextlib.nullcontext()
    from threadpoolctl import threadpool_limits

    return threadpool_limits(limits=n, user_api="blas")


def _peak_rss_mib() -> float:
    """Peak resident memory of this process so far, MiB.

    Linux ``VmHWM``, else ``ru_maxrss`` (KiB on Linux, bytes on macOS). On
    Linux ``ru_maxrss`` is no substitute: it keeps the parent's resident size
    at the fork that started this process.
    """
    kib = _hwm_kib()
    if kib is None:
        import resource

        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        kib = peak / 1024 if sys.platform == "darwin" else peak
    return kib / 1024


def measure_here(shape: Shape, *, impl="dense", dtype="float32", backend="numpy", repeat=1,
                 warmup=0, gemm_n=2048, block_q=None, block_k=None, blas_threads=None,
                 scope="module") -> dict:
    """Time one case in this process and read its peak RSS: the body of an isolated child.

    Meant for a process that runs this one case: the peak RSS is that of the
    whole process. The block sizes go to the module (blocked implementation).
    ``scope="attention"`` times the attention core alone (no projections).
    """
    xp = resolve_backend(backend)
    probe = xp.zeros((1,), dtype=check_dtype(xp, dtype))  # the device and entry size auto's rule reads
    block_q, block_k = case_blocks(shape, impl, block_q, block_k, device_memory=accelerator_memory(probe),
                                   itemsize=getattr(probe.dtype, "itemsize", 4))
    del probe
    with _blas_limit(blas_threads):
        if scope == "attention":
            xp, step = _make_core(shape, dtype, backend, impl, block_q, block_k)
        else:
            m, x, dout, step = _make_npattn(shape, dtype, backend, impl, block_q, block_k)
            xp = m.xp
        sync = _sync_for(xp)
        rss_before = _peak_rss_mib()  # interpreter, libraries, parameters and inputs
        for _ in range(warmup):
            step()
        ts = [_timed(step, sync) for _ in range(repeat)]
        peak = _peak_rss_mib()
        gemm = gemm_gflops(xp, dtype, gemm_n, 3, sync) if gemm_n else None
    ms = statistics.median(ts) * 1e3
    rate = (flops(shape) - (24.0 * shape.B * shape.L * shape.D**2 if scope == "attention" else 0.0)
            ) / (ms * 1e-3) / 1e9
    return {
        "shape": str(shape), "B": shape.B, "L": shape.L, "D": shape.D, "H": shape.H,
        "causal": shape.causal, "window": shape.window, "dropout": shape.dropout, "impl": impl,
        "dtype": dtype,
        "backend": backend_name(xp), "scope": scope,
        "block_q": block_q, "block_k": block_k, "blas_threads": blas_threads,
        "repeat": repeat, "warmup": warmup,
        "ms": ms, "ms_all": [t * 1e3 for t in ts], "ms_min": min(ts) * 1e3, "gflops": rate,
        "gemm_gflops": gemm, "pct_gemm": 100.0 * rate / gemm if gemm else None,
        "rss_before_mib": rss_before, "peak_rss_mib": peak, "loadavg": list(os.getloadavg()),
    }


def case_blocks(shape: Shape, impl: str, block_q=None, block_k=None, *,
                device_memory: Optional[int] = None, itemsize: int = 4) -> tuple:
    """The (block_q, block_k) a case runs with: those given, else the blocked path's defaults,
    for the blocked impl and for an auto one that takes the blocked path
    (``attention.auto_blocked`` for the case's scores, on an accelerator of
    ``device_memory`` bytes, None in host memory, with entries of ``itemsize`` bytes);
    (None, None) for the dense ones."""
    from .. import attention, blocked

    if impl == "auto":
        large = attention.auto_blocked(shape.B * shape.H, shape.L, shape.L,
                                       device_memory=device_memory, itemsize=itemsize)
        impl = "blocked" if large else "dense"
    if impl != "blocked":
        return None, None

    return blocked.default_blocks(block_q, block_k, shape.window)  # window=(shape.window, 0)


def _blocks_text(block_q, block_k) -> str:
    return f"{block_q},{block_k}" if block_q else "-"


def isolated_widths(plan, block_q=None, block_k=None) -> dict:
    """Widths of the isolated table's text columns (shape, impl, blocks): each fits its header
    and the longest entry of ``plan``'s ``(shape, impl)`` cases."""
    return {
        "shape": max([len("shape")] + [len(str(s)) for s, _ in plan]),
        "impl": max([len("impl")] + [len(impl) for _, impl in plan]),
        "blocks": max([len("blocks")]  # auto as blocked: it may take the blocked path on a device
                      + [len(_blocks_text(*case_blocks(s, "blocked" if impl == "auto" else impl,
                                                       block_q, block_k))) for s, impl in plan]),
    }


def format_isolated_header(widths: dict) -> str:
    """The header line of ``run_isolated``'s table (``isolated_widths``)."""
    return (f"{'shape':>{widths['shape']}} {'impl':>{widths['impl']}} "
            f"{'blocks':>{widths['blocks']}} {'ms':>9} {'GFLOP/s':>8} {'GEMM':>6} {'%GEMM':>6} "
            f"{'RSS before':>10} {'peak RSS':>9} {'load':>5}")


def format_isolated_row(r: dict, widths: dict) -> str:
    """One case of ``run_isolated``'s table, a result of ``measure_here``, under its header."""
    return (f"{r['shape']:>{widths['shape']}} {r['impl']:>{widths['impl']}} "
            f"{_blocks_text(r['block_q'], r['block_k']):>{widths['blocks']}} {r['ms']:9.2f} "
            f"{r['gflops']:8.1f} {_fmt(r['gemm_gflops'], '6.1f')} {_fmt(r['pct_gemm'], '6.1f')} "
            f"{r['rss_before_mib']:10.1f} {r['peak_rss_mib']:9.1f} {r['loadavg'][0]:5.1f}")


def measure_isolated(shape: Shape, *, timeout=3600, **case) -> dict:
    """``measure_here(shape, **case)`` in a fresh Python process, so that its peak RSS is its own."""
    root = str(Path(__file__).resolve().parents[2])  # the folder holding this npattn
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
    spec = json.dumps(dict(case, shape=str(shape)))
    proc = subprocess.run([sys.executable, "-m", "npattn.tools.bench", "--child", spec],
                          capture_output=True, text=True, env=env, timeout=timeout)
    if proc.returncode != 0:
        raise RuntimeError(f"npattn bench: the child for {shape} ({case.get('impl')}) failed "
                           f"with status {proc.returncode}:\n{proc.stderr[-4000:]}")
    lines = proc.stdout.strip().splitlines()
    try:
        result = json.loads(lines[-1]) if lines else None
    except ValueError:  # json.JSONDecodeError
        result = None
    if not isinstance(result, dict):  # a failed case, as above, not the end of the run
        raise RuntimeError(f"npattn bench: the child for {shape} ({case.get('impl')}) exited "
                           f"0 without a result on its last line of output; its last lines:\n"
                           + "\n".join(lines[-5:]) + f"\nits standard error:\n{proc.stderr[-4000:]}")
    return result


def run_isolated(plan, *, dtype="float32", backend="numpy", repeat=1, warmup=0, gemm_n=2048,
                 block_q=None, block_k=None, blas_threads=None, scope="module", out=None) -> dict:
    """Run each ``(shape, impl)`` of ``plan`` in its own process; a dict of results (also printed).

    ``scope="attention"``: the attention core's forward and backward alone on
    (B, H, L, D / H), without the module's projections."""
    plan = list(plan)
    out = sys.stdout if out is None else out
    env = environment_info(resolve_backend(backend))
    _print_env(env, f"isolated repeat={repeat} warmup={warmup} blas_threads={blas_threads} "
               f"scope={scope}", dtype, out)
    widths = isolated_widths(plan, block_q, block_k)
    print(format_isolated_header(widths), file=out)
    rows, failed = [], []
    for shape, impl in plan:
        try:
            r = measure_isolated(shape, impl=impl, dtype=dtype, backend=backend, repeat=repeat,
                                 warmup=warmup, gemm_n=gemm_n, block_q=block_q, block_k=block_k,
                                 blas_threads=blas_threads, scope=scope)
        except (RuntimeError, subprocess.TimeoutExpired) as exc:  # this case only: go on
            print(str(exc).rstrip(), file=sys.stderr, flush=True)
            failed.append({"shape": str(shape), "impl": impl, "error": str(exc)})
            continue
        rows.append(r)
        print(format_isolated_row(r, widths), file=out, flush=True)
    return {"env": env, "dtype": dtype, "gemm_n": gemm_n, "rows": rows, "failed": failed}


def markdown_table(result) -> str:
    """The machine and the rows of ``run_isolated``'s result as Markdown (RSS in MiB)."""
    env = result["env"]
    pools = env["threadpools"]
    if isinstance(pools, list):
        pools = "; ".join(f"{p['internal_api']} {p['version']} ({p['threading_layer']}, "
                          f"{p['architecture']}, {p['num_threads']} threads)" for p in pools)
    lines = [
        f"- CPU: {cpu_text(env)}, {env['cpu_count']} logical cpus, "
        + ("RAM unknown" if env.get("memory_gib") is None else f"{env['memory_gib']:.1f} GiB RAM"),
        f"- BLAS: {pools}",
        f"- NumPy {env['numpy']}, Python {env['python']}, backend {env['backend']}, "
        f"{result['dtype']}",
        "",
        "| shape | impl | blocks (q, k) | BLAS threads | runs | ms (median) | GFLOP/s "
        "| GEMM GFLOP/s | peak RSS MiB | RSS before fwd MiB | load (1 min) |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in result["rows"]:
        blocks = f"{r['block_q']}, {r['block_k']}" if r["block_q"] else "-"
        runs = f"{r['repeat']}" + (f" (+{r['warmup']} warm-up)" if r["warmup"] else "")
        lines.append(
            f"| {r['shape']} | {r['impl']} | {blocks} | {r['blas_threads'] or 'default'} "
            f"| {runs} | {r['ms']:.0f} | {r['gflops']:.1f} | {_fmt(r['gemm_gflops'], '.0f')} "
            f"| {r['peak_rss_mib']:.0f} | {r['rss_before_mib']:.0f} | {r['loadavg'][0]:.1f} |"
        )
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--backend")
    known, _ = pre.parse_known_args(sys.argv[1:] if argv is None else argv)
    if known.backend == "dask":  # a benchmark of its own: graph, workers, memory per worker
        from . import bench_dask

        return bench_dask.main(argv)
    from .. import blocked  # the default blocks, said in --help

    parser = argparse.ArgumentParser(
        prog="npattn bench",
        description="Time MultiHeadAttention forward+backward (self-attention) against torch, "
                    "or each case alone in a fresh process with its peak RSS (--isolated).",
        epilog="A whole model's training step: npattn bench --model gpt (npattn.tools.bench_gpt; "
               "npattn bench --model gpt --help).",
    )
    parser.add_argument("--shapes", metavar="SHAPE[,SHAPE...]",
                        help="comma-separated BxLxDxH with optional suffixes: c causal, wN a "
                             "window of N keys back, dP dropout with drop probability P (e.g. "
                             "4x1024x768x12c, 8x512x768x12d0.1); default: "
                             f"{','.join(str(s) for s in DEFAULT_SHAPES)} (--isolated: its own "
                             "plan of cases, each with its impl)")
    parser.add_argument("--dtype", default="float32", choices=["float32", "float64", "float16"],
                        help="dtype of the inputs and parameters (default float32; float16: "
                             "not on array_api_strict)")
    parser.add_argument("--backend", default="numpy",
                        choices=["numpy", "cupy", "torch", "array_api_strict", "dask"],
                        help="array library (default: numpy); dask runs the dask benchmark "
                             "(npattn bench --backend dask --help)")
    parser.add_argument("--impl", choices=["auto", "dense", "reference", "numpy", "blocked"],
                        help="attention implementation passed to the module (default: dense); "
                             "numpy needs --backend numpy; with --isolated, give --shapes too")
    parser.add_argument("--repeat", type=int, metavar="N",
                        help="timed runs per shape, at least 5 (default 7; --isolated: at least "
                             "1, default 1)")
    parser.add_argument("--warmup", type=int, metavar="N",
                        help="untimed runs first, >= 0 (default 2; --isolated: default 0)")
    parser.add_argument("--gemm", type=int, default=2048, metavar="N",
                        help="size n of the n^3 reference GEMM, >= 1 (default %(default)s; "
                             "--isolated: 0 = none)")
    parser.add_argument("--threads", type=int, metavar="N",
                        help=f"threads of npattn's tile pool, in [1, {MAX_THREADS}] (sets "
                             "NPATTN_NUM_THREADS; default: the usable CPUs, at most 8)")
    parser.add_argument("--blas-threads", type=int, metavar="N",
                        help=f"hold BLAS to N threads, in [1, {MAX_THREADS}] (threadpoolctl; "
                             "default: BLAS's own setting)")
    parser.add_argument("--pause", type=float, default=0.1, metavar="S",
                        help="seconds of rest before each timed sample, so that one library's "
                             "spinning worker threads do not slow the next, a number >= 0; unused "
                             "with --isolated "
                             "(default: %(default)s)")
    parser.add_argument("--min-sample", type=float, default=MIN_SAMPLE_S, metavar="S",
                        help="shortest timed sample: each runs a step back to back as often as "
                             "it takes to last S seconds, npattn, torch and the GEMM alike, >= 0; "
                             "unused with --isolated (default: %(default)s)")
    parser.add_argument("--no-progress", action="store_true",
                        help="no progress bar (it is shown only when stderr is a terminal; "
                             "--isolated draws none)")
    parser.add_argument("--no-torch", action="store_true",
                        help="skip the torch comparison (--isolated runs none)")
    parser.add_argument("--no-memory", action="store_true",
                        help="skip the peak-memory run (--isolated reads each process's peak RSS "
                             "instead)")
    parser.add_argument(SKIP_MEMORY_CHECK, action="store_true", help=SKIP_MEMORY_CHECK_HELP)
    parser.add_argument("--json", metavar="PATH",
                        help="also write the results as JSON; '-': the JSON alone on stdout, "
                             "the table on stderr (default: none)")
    iso = parser.add_argument_group("isolated mode")
    iso.add_argument("--isolated", action="store_true",
                     help="run each case in a fresh process and report its peak RSS "
                          "(no torch, no traced memory)")
    iso.add_argument("--block-q", type=int, metavar="N",
                     help=f"query block of the blocked and auto impls, a positive integer "
                          f"(needs --isolated; default {blocked.DEFAULT_BLOCK_Q})")
    iso.add_argument("--block-k", type=int, metavar="N",
                     help=f"key block of the blocked and auto impls, a positive integer (needs "
                          f"--isolated; default {blocked.DEFAULT_BLOCK_K}, or "
                          f"{blocked.WINDOW_BLOCK_K} for a shape with a window wN)")
    iso.add_argument("--markdown", metavar="PATH",
                     help="append the results as a Markdown table (needs --isolated; default: none)")
    iso.add_argument("--scope", choices=("module", "attention"), default="module",
                     help="what one step times: the module's forward+backward (default), or the "
                          "attention core's alone on (B, H, L, D/H), without the projections "
                          "(needs --isolated)")
    iso.add_argument("--child", metavar="SPEC", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:  # one isolated case, in the process the parent started for it
        spec = json.loads(args.child)
        spec["shape"] = parse_shapes(spec["shape"])[0]
        print(json.dumps(measure_here(**spec)))
        return 0
    isolated = args.isolated
    repeat = (1 if isolated else 7) if args.repeat is None else args.repeat
    warmup = (0 if isolated else 2) if args.warmup is None else args.warmup
    if repeat < (1 if isolated else 5):
        parser.error(f"--repeat: expected at least {1 if isolated else 5}, got {repeat}")
    if warmup < 0:
        parser.error(f"--warmup: expected a non-negative integer, got {warmup}")
    for name in ("pause", "min_sample"):
        value = getattr(args, name)
        if not (math.isfinite(value) and value >= 0.0):
            parser.error(f"--{name.replace('_', '-')}: expected a finite number of seconds "
                         f">= 0, got {value}")
    if args.gemm < (0 if isolated else 1) or args.gemm > MAX_SIZE:
        parser.error(f"--gemm: expected {'0 or ' if isolated else ''}a positive size of at most "
                     f"{MAX_SIZE}, got {args.gemm}")
    for name, top in (("threads", MAX_THREADS), ("blas_threads", MAX_THREADS),
                      ("block_q", MAX_SIZE), ("block_k", MAX_SIZE)):
        if getattr(args, name) is not None and not 1 <= getattr(args, name) <= top:
            parser.error(f"--{name.replace('_', '-')}: expected an integer in [1, {top}], "
                         f"got {getattr(args, name)}")
    if not isolated:
        if args.scope != "module":
            parser.error("--scope: needs --isolated")
        for name in ("block_q", "block_k", "markdown"):
            if getattr(args, name) is not None:
                parser.error(f"--{name.replace('_', '-')}: needs --isolated")
    if isolated and args.shapes is None and args.impl is not None:
        parser.error("--impl: with --isolated, expected --shapes too (ISOLATED_PLAN sets the impl "
                     f"of each of its cases), got --impl {args.impl} without --shapes")
    impl = args.impl or "dense"
    if impl == "numpy" and args.backend != "numpy":
        parser.error(f"--impl numpy: the NumPy kernel needs --backend numpy, got --backend {args.backend}")
    try:
        shapes = parse_shapes(args.shapes) if args.shapes is not None else DEFAULT_SHAPES
    except ValueError as exc:
        parser.error(str(exc))
    if args.blas_threads is not None and importlib.util.find_spec("threadpoolctl") is None:
        print("npattn bench: --blas-threads needs threadpoolctl (a dependency of npattn: "
              "pip install threadpoolctl)", file=sys.stderr)
        return 2
    if args.threads is not None:
        os.environ["NPATTN_NUM_THREADS"] = str(args.threads)
    try:
        xp = resolve_backend(args.backend)
    except ImportError as exc:
        print(f"npattn bench: {exc}", file=sys.stderr)
        return 2
    try:
        check_dtype(xp, args.dtype)
    except ValueError as exc:
        parser.error(str(exc))
    why = outputs_error(("--json", args.json), ("--markdown", args.markdown))
    if why:
        parser.error(why)
    plan = (ISOLATED_PLAN if isolated and args.shapes is None else [(s, impl) for s in shapes])
    if args.backend != "cupy" and not args.skip_memory_check:  # the device's memory is its own
        why = (gemm_refusal(args.gemm, args.dtype)  # the GEMM alone, then with each step
               or memory_refusal(plan, args.dtype, args.scope, gemm_n=0 if isolated else args.gemm))
        # (an isolated child times the GEMM apart from its step)
        if why:
            parser.error(why)
    table_out = sys.stderr if args.json == "-" else sys.stdout  # stdout: the JSON alone
    if isolated:
        result = run_isolated(plan, dtype=args.dtype, backend=args.backend, repeat=repeat,
                              warmup=warmup, gemm_n=args.gemm, block_q=args.block_q,
                              block_k=args.block_k, blas_threads=args.blas_threads,
                              scope=args.scope, out=table_out)
        if args.markdown:
            with open(args.markdown, "a") as f:
                f.write(markdown_table(result) + "\n")
    else:
        with _blas_limit(args.blas_threads):
            result = run(shapes, dtype=args.dtype, backend=args.backend, impl=impl,
                         repeat=repeat, warmup=warmup, gemm_n=args.gemm,
                         torch_compare=not args.no_torch, memory=not args.no_memory,
                         pause=args.pause, min_sample=args.min_sample, out=table_out,
                         progress=not args.no_progress)
    if args.json:
        text = json.dumps(result, indent=1, default=str)
        if args.json == "-":
            print(text)
        else:
            with open(args.json, "w") as f:
                f.write(text + "\n")
    if result.get("failed"):  # the cases that ran are written above; the failures are in stderr
        print(f"npattn bench: {len(result['failed'])} of the cases failed: "
              + ", ".join(f"{f['shape']} ({f['impl']})" for f in result["failed"]), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
