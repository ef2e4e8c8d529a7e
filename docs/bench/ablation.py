"""Ablation of the dense-path techniques (docs/performance.md).

Times module forward+backward of self-attention, float32, for several
variants in one process, round-robin (each round runs every variant once),
and prints median and fastest ms per variant. Variants:

* ref:       reference functional code (impl="reference"), three projections
* ref+qkv:   reference code, one (3D, D) projection GEMM
* fast1:     the NumPy kernel (impl="numpy"), a pool of 1 (tiles in order)
* fast2:     the NumPy kernel, a pool of 2 threads (BLAS held to 1 inside when
             a head has at least numpy_kernel.POOL_MIN_SCORES scores)
* fast2-sep: fast2 with three separate projections (query, key, value copies)

Usage: PYTHONPATH=. python docs/bench/ablation.py 8x512x768x12 [rounds]
"""

import os
import statistics
import sys
import time

import numpy as np

from npattn import MultiHeadAttention
from npattn.tools import bench


def main():
    shape = bench.parse_shapes(sys.argv[1])[0]
    rounds = int(sys.argv[2]) if len(sys.argv) > 2 else 5
    m = MultiHeadAttention(shape.D, shape.H, seed=0)
    rng = np.random.default_rng(2)
    x = rng.standard_normal((shape.B, shape.L, shape.D)).astype(np.float32)
    dout = rng.standard_normal((shape.B, shape.L, shape.D)).astype(np.float32)
    xk, xv = x.copy(), x.copy()

    def step(fast, fused):
        kv = (x, x) if fused else (xk, xv)
        m(x, *kv, is_causal=shape.causal, impl="numpy" if fast else "reference")
        m.backward(dout)

    variants = {
        "ref": (False, "1", False),
        "ref+qkv": (False, "1", True),
        "fast1": (True, "1", True),
        "fast2": (True, "2", True),
        "fast2-sep": (True, "2", False),
    }
    times = {k: [] for k in variants}
    for r in range(rounds + 1):
        for name, (fast, threads, fused) in variants.items():
            os.environ["NPATTN_NUM_THREADS"] = threads
            t0 = time.perf_counter()
            step(fast, fused)
            dt = time.perf_counter() - t0
            if r:  # round 0 is the warm-up
                times[name].append(dt * 1e3)
    print(f"{shape}: median / fastest ms over {rounds} rounds")
    for name, ts in times.items():
        print(f"  {name:>10} {statistics.median(ts):9.1f} {min(ts):9.1f}")


if __name__ == "__main__":
    main()
