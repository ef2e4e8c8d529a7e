"""NumPy's BLAS against torch's, one thread, on the GEMMs of npattn's step (docs/performance.md).

For each benchmark shape ``BxLxDxH`` (self-attention, float32, not causal) it
times, side by side and alternated, NumPy's ``matmul`` and torch's on the
GEMMs that one forward+backward of ``MultiHeadAttention`` runs on the tile
pool (BLAS at one thread per task):

* the projections, by the pool's row blocks of ``B*L / LINEAR_PARTS`` rows:
  ``qkv`` (rows, D) x (D, 3D) and ``out`` (rows, D) x (D, D) forward; ``dx``
  (rows, D) x (D, D) and ``dw`` (D, rows) x (rows, D) backward, four each;
* the attention core, by the NumPy kernel's blocks of ``r = TILE_ELEMS // L``
  query rows (a stack of heads when a head has fewer than ``TILE_ELEMS``
  scores): ``q kᵀ`` (r, Dh) x (Dh, L) and ``e v`` (r, L) x (L, Dh) forward;
  ``da = do' vᵀ`` as ``q kᵀ`` (one column more), ``dq = ds k`` as ``e v``,
  ``dk = dsᵀ q`` (L, r) x (r, Dh) and ``dv = eᵀ do'`` (L, L) x (L, Dh)
  backward.

and prints each GEMM's GFLOP/s on both, their ratio, and the ratio of the
whole step's GEMM time: what npattn/torch would be if both steps were their
GEMMs and nothing else. Elementwise work, the pool's overhead and torch's own
(fused) kernels are not in it.

Usage: PYTHONPATH=. python docs/bench/blas_shapes.py [shapes] [rounds]
"""

import statistics
import sys
import time

import numpy as np
import torch
from threadpoolctl import threadpool_limits

from npattn import numpy_kernel
from npattn.tools import bench


def gemms(shape):
    """[(name, a_shape, b_shape, transpose_a, stack, calls per step)] of one step."""
    B, L, D, H = shape.B, shape.L, shape.D, shape.H
    Dh = D // H
    rows = B * L // numpy_kernel.LINEAR_PARTS
    parts = numpy_kernel.LINEAR_PARTS
    r = max(1, min(L, numpy_kernel.TILE_ELEMS // L))  # query rows per block
    stack = max(1, numpy_kernel.TILE_ELEMS // (L * L))  # heads per call when a head is small
    calls = B * H * (L // r) // stack  # calls of each attention GEMM per step
    return [
        ("qkv proj", (rows, D), (D, 3 * D), False, 1, parts),
        ("out proj", (rows, D), (D, D), False, 1, parts),
        ("dx", (rows, D), (D, D), False, 1, 4 * parts),
        ("dw", (D, rows), (rows, D), True, 1, 4 * parts),
        ("q kT, da", (r, Dh), (Dh, L), False, stack, 2 * calls),
        ("e v, dq", (r, L), (L, Dh), False, stack, 2 * calls),
        ("dk = dsT q", (L, r), (r, Dh), True, stack, calls),
        ("dv = eT do", (L, L), (L, Dh), True, stack, B * H // stack),
    ]


def operands(a_shape, b_shape, transpose_a, stack, rng):
    a = rng.standard_normal((stack, *a_shape[::-1]) if transpose_a else (stack, *a_shape),
                            dtype=np.float32)
    a = np.swapaxes(a, -1, -2) if transpose_a else a  # a transposed view, as the kernel's
    b = rng.standard_normal((stack, *b_shape), dtype=np.float32)
    if stack == 1:
        a, b = a[0], b[0]
    return a, b


def main():
    shapes = bench.parse_shapes(sys.argv[1]) if len(sys.argv) > 1 else bench.DEFAULT_SHAPES[:4]
    rounds = int(sys.argv[2]) if len(sys.argv) > 2 else 7
    rng = np.random.default_rng(0)
    torch.set_num_threads(1)
    print(f"numpy {np.__version__}, torch {torch.__version__}, one thread each, float32, "
          f"median of {rounds} alternated rounds")
    with threadpool_limits(1, user_api="blas"):
        for shape in shapes:
            print(f"\n{shape}")
            step_np = step_torch = 0.0
            for name, a_shape, b_shape, ta, stack, calls in gemms(shape):
                a, b = operands(a_shape, b_shape, ta, stack, rng)
                out = np.empty(np.matmul(a, b).shape, dtype=np.float32)
                tout = torch.from_numpy(out.copy())
                at, bt = torch.from_numpy(a), torch.from_numpy(b)
                n = max(1, int(0.05 / max(_time(lambda: np.matmul(a, b, out=out)), 1e-6)))
                tn, tt = [], []
                for _ in range(rounds):
                    tn.append(_time(lambda: np.matmul(a, b, out=out), n))
                    tt.append(_time(lambda: torch.matmul(at, bt, out=tout), n))
                tn, tt = statistics.median(tn), statistics.median(tt)
                flop = 2.0 * stack * a_shape[0] * a_shape[1] * b_shape[1]
                step_np += calls * tn
                step_torch += calls * tt
                label = f"{stack} x " if stack > 1 else ""
                print(f"  {name:11s} {label}{a_shape} x {b_shape}{' (A a transposed view)' if ta else ''}: "
                      f"numpy {flop / tn / 1e9:6.1f}  torch {flop / tt / 1e9:6.1f} GFLOP/s  "
                      f"ratio {tn / tt:.2f}  ({calls} per step)")
            print(f"  the step's GEMMs: numpy {step_np * 1e3:.1f} ms, torch {step_torch * 1e3:.1f} ms "
                  f"on one thread, ratio {step_np / step_torch:.2f}")


def _time(fn, n=1):
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - t0) / n


if __name__ == "__main__":
    main()
