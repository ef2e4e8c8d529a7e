"""Ablation of the dense-path techniques (docs/performance.md).

Times module forward+backward of self-attention, float32, for several
variants in one process, round-robin (each round runs every variant once),
and prints median and fastest ms per variant. Variants:

* ref:       reference functional code (NPATTN_FAST off), three projections
* ref+qkv:   reference code, one (3D, D) projection GEMM
* fast1:     fast path, tiles run one after another (pool of 1)
* fast2:     fast path, tiles on a pool of 2 threads, BLAS held to 1 inside
* fast2-sep: fast2 with three separate projections (query, key, value copies)

Usage: PYTHONPATH=. python docs/bench/ablation.py 8x512x768x12 [rounds]
"""

import os
import statistics
import sys
import time

import numpy as np

from npattn import _fast
from npattn.tools import bench


def main():
    shape = bench.parse_shapes(sys.argv[1])[0]
    rounds = int(sys.argv[2]) if len(sys.argv) > 2 else 5
    m, x, dout, _ = bench._make_npattn(shape, "float32", "numpy", "dense")
    xk, xv = x.copy(), x.copy()

    def step(fused):
        kv = (x, x) if fused else (xk, xv)
        m(x, *kv, is_causal=shape.causal)
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
            with _fast.fast_path(fast):
                t0 = time.perf_counter()
                step(fused)
                dt = time.perf_counter() - t0
            if r:  # round 0 is the warm-up
                times[name].append(dt * 1e3)
    print(f"{shape}: median / fastest ms over {rounds} rounds")
    for name, ts in times.items():
        print(f"  {name:>10} {statistics.median(ts):9.1f} {min(ts):9.1f}")


if __name__ == "__main__":
    main()
