"""CuPy-vs-NumPy parity of MultiHeadAttention on the benchmark shapes.

For each (B, L, D, H, causal) builds the same self-attention module (same
seeded parameters, random biases) on NumPy and on the backend under test,
runs forward and backward with the same input and upstream gradient, and
prints the maximum relative error ``max|x - x_numpy| / max|x_numpy|`` over
the output, dx and every parameter gradient. Exits 1 when any error exceeds
the tolerance, 2 when the backend is not usable.

    python scripts/gpu_parity.py                    # cupy vs numpy, float32
    python scripts/gpu_parity.py --backend numpy    # dry run without a GPU
    python scripts/gpu_parity.py --reference        # also print errors against float64

Run from the repository root with npattn installed or ``PYTHONPATH=$PWD``.
"""

from __future__ import annotations

import argparse
import sys
import time

import numpy as np

from npattn import MultiHeadAttention
from npattn.backend import from_numpy, resolve_backend, to_numpy

#: (B, L, D, H, causal): the benchmark shapes
BENCHMARK_SHAPES = [
    (32, 128, 256, 8, False),
    (8, 512, 768, 12, False),
    (4, 1024, 768, 12, True),
    (1, 4096, 512, 8, False),
]

#: default tolerance on max|x - x_numpy| / max|x_numpy|, per dtype
TOLERANCE = {"float32": 1e-4, "float64": 1e-11, "float16": 3e-2}


def run_module(backend: str, dtype: str, shape, seed: int):
    """Forward + backward of one self-attention module; host float64 copies of every result."""
    B, L, D, H, causal = shape
    xp = resolve_backend(backend)
    rng = np.random.default_rng(seed)
    m = MultiHeadAttention(D, H, dtype=dtype, backend=backend, seed=seed)
    # random biases as well as weights, drawn on the host so every backend gets the same
    host_params = {k: rng.uniform(-0.05, 0.05, size=tuple(v.shape)) if k.startswith("b_")
                   else to_numpy(v).astype(np.float64) for k, v in m.params.items()}
    m.params = {k: xp.astype(from_numpy(v, xp), getattr(xp, dtype)) for k, v in host_params.items()}
    x = xp.astype(from_numpy(rng.standard_normal((B, L, D)), xp), getattr(xp, dtype))  # [B, L, D]
    dout = xp.astype(from_numpy(rng.standard_normal((B, L, D)), xp), getattr(xp, dtype))  # [B, L, D]
    t0 = time.perf_counter()
    out, _ = m(x, x, x, is_causal=causal)
    dq, dk, dv = m.backward(dout)
    dx = dq + dk + dv  # self-attention: query, key and value are the same array
    res = {"out": out, "dx": dx, **m.grads}
    res = {k: np.asarray(to_numpy(v), dtype=np.float64) for k, v in res.items()}  # syncs the device
    return res, time.perf_counter() - t0


def compare(a: dict, ref: dict):
    """Per-array relative errors; db_k (exactly 0 in exact arithmetic) on dw_k's scale."""
    errs = {}
    for k, r in ref.items():
        scale = np.max(np.abs(ref["w_k" if k == "b_k" else k]))
        errs[k] = float(np.max(np.abs(a[k] - r)) / scale) if scale > 0 else float(np.max(np.abs(a[k])))
    return errs


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description="CuPy-vs-NumPy parity on the benchmark shapes")
    ap.add_argument("--backend", default="cupy", help="backend compared with numpy (default cupy)")
    ap.add_argument("--dtype", default="float32", choices=sorted(TOLERANCE))
    ap.add_argument("--tol", type=float, default=None, help="override the tolerance")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--max-len", type=int, default=None, help="skip shapes with L above this (quick runs)")
    ap.add_argument("--min-len", type=int, default=None, help="skip shapes with L below this")
    ap.add_argument("--reference", action="store_true", help="also compare both against numpy float64")
    args = ap.parse_args(argv)
    tol = TOLERANCE[args.dtype] if args.tol is None else args.tol

    try:
        resolve_backend(args.backend)
        if args.backend == "cupy":
            import cupy

            n = cupy.cuda.runtime.getDeviceCount()
            name = cupy.cuda.runtime.getDeviceProperties(0)["name"].decode()
            print(f"cupy {cupy.__version__}, {n} device(s), device 0: {name}")
    except Exception as exc:  # no cupy, no driver, no GPU
        print(f"backend {args.backend!r} is not usable: {exc}", file=sys.stderr)
        return 2

    shapes = [s for s in BENCHMARK_SHAPES
              if (args.max_len is None or s[1] <= args.max_len)
              and (args.min_len is None or s[1] >= args.min_len)]
    print(f"{args.backend} vs numpy, {args.dtype}, tolerance {tol:.1e} on max|x - x_numpy| / max|x_numpy|")
    header = f"{'B':>3} {'L':>5} {'D':>4} {'H':>3} {'causal':>6}  {'max rel err':>11}  {'worst':<6}"
    header += f"  {'t_numpy':>7} {'t_' + args.backend:>9}"
    if args.reference:
        header += f"  {'numpy vs f64':>12} {args.backend + ' vs f64':>14}"
    print(header)
    failed = False
    for shape in shapes:
        ref, t_ref = run_module("numpy", args.dtype, shape, args.seed)
        got, t_got = run_module(args.backend, args.dtype, shape, args.seed)
        errs = compare(got, ref)
        worst = max(errs, key=errs.get)
        ok = all(np.isfinite(v).all() for v in got.values()) and errs[worst] <= tol
        failed |= not ok
        B, L, D, H, causal = shape
        line = f"{B:>3} {L:>5} {D:>4} {H:>3} {str(causal):>6}  {errs[worst]:>11.3e}  {worst:<6}"
        line += f"  {t_ref:>6.2f}s {t_got:>8.2f}s"
        if args.reference:
            r64, _ = run_module("numpy", "float64", shape, args.seed)
            e_ref, e_got = compare(ref, r64), compare(got, r64)
            line += f"  {max(e_ref.values()):>12.3e} {max(e_got.values()):>14.3e}"
        print(line + ("" if ok else "   FAIL"), flush=True)
    print("parity: FAIL" if failed else "parity: ok")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
