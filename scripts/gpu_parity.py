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
from npattn.attention import IMPLS
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


#: option cases: the module's constructor options and a function of (rng, B, L, H) that
#: draws the forward's keyword arguments on the host (the same on every backend)
def _bool_mask(rng, B, L, H):
    keep = rng.random((B, 1, L, L)) < 0.8  # [B, 1, Lq, Lk], True = may attend
    keep[0, 0, L // 2] = False  # one query row with nothing to attend
    return {"mask": keep}


def _float_mask(rng, B, L, H):
    bias = rng.standard_normal((L, L))  # [Lq, Lk], added to the scaled scores
    bias[rng.random((L, L)) < 0.2] = -np.inf
    bias[L // 3] = -np.inf  # an empty row
    return {"mask": bias}


def _segments(rng, B, L, H):
    seg = np.sort(rng.integers(0, 3, size=(B, L)), axis=1)  # [B, L], packed sequences
    return {"q_segments": seg, "k_segments": seg}


CASES = {
    "plain": ({}, lambda rng, B, L, H: {}),
    "bool_mask": ({}, _bool_mask),
    "float_mask": ({}, _float_mask),
    "gqa": ({"n_kv_head": 2}, lambda rng, B, L, H: {}),
    "dropout": ({"dropout": 0.1}, lambda rng, B, L, H: {}),
    "window": ({}, lambda rng, B, L, H: {"window": (min(64, L // 2), 0)}),
    "alibi": ({}, lambda rng, B, L, H: {"alibi_slopes": 2.0 ** (-8.0 * np.arange(1, H + 1) / H)}),
    "softcap": ({"softcap": 30.0}, lambda rng, B, L, H: {}),
    "sinks": ({"sinks": True}, lambda rng, B, L, H: {}),
    "segments": ({}, _segments),
}


def run_module(backend: str, dtype: str, shape, seed: int, impl: str = "auto", case: str = "plain"):
    """Forward + backward of one self-attention module; host float64 copies of every result.

    ``impl`` is the module's attention implementation, ``case`` a key of
    CASES: its options, masks and positions are drawn on the host from
    ``seed``, so every backend and implementation gets the same ones (and,
    with dropout, the same keep-mask: it is a function of the seed).
    """
    B, L, D, H, causal = shape
    xp = resolve_backend(backend)
    rng = np.random.default_rng(seed)
    options, draw = CASES[case]
    m = MultiHeadAttention(D, H, dtype=dtype, backend=backend, seed=seed, impl=impl, **options)
    # random biases as well as weights, drawn on the host so every backend gets the same
    host_params = {k: rng.uniform(-0.05, 0.05, size=tuple(v.shape)) if k.startswith("b_")
                   else to_numpy(v).astype(np.float64) for k, v in m.params.items()}
    m.params = {k: xp.astype(from_numpy(v, xp), getattr(xp, dtype)) for k, v in host_params.items()}
    x = xp.astype(from_numpy(rng.standard_normal((B, L, D)), xp), getattr(xp, dtype))  # [B, L, D]
    dout = xp.astype(from_numpy(rng.standard_normal((B, L, D)), xp), getattr(xp, dtype))  # [B, L, D]
    kwargs = {}
    for name, a in draw(rng, B, L, H).items():
        if isinstance(a, np.ndarray):  # floating masks and slopes in the compute dtype
            a = from_numpy(a.astype(dtype) if a.dtype.kind == "f" else a, xp)
        kwargs[name] = a
    t0 = time.perf_counter()
    out, _ = m(x, x, x, is_causal=causal, **kwargs)
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


def _refused_on_numpy(dtype: str, shape, seed: int, impl: str, case: str) -> bool:
    """Whether NumPy refuses this implementation and case too (a TypeError or ValueError)."""
    try:
        run_module("numpy", dtype, shape, seed, impl, case)
    except (TypeError, ValueError):
        return True
    return False


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description="CuPy-vs-NumPy parity on the benchmark shapes")
    ap.add_argument("--backend", default="cupy", help="backend compared with numpy (default cupy)")
    ap.add_argument("--dtype", default="float32", choices=sorted(TOLERANCE))
    ap.add_argument("--tol", type=float, default=None, help="override the tolerance")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--max-len", type=int, default=None, help="skip shapes with L above this (quick runs)")
    ap.add_argument("--min-len", type=int, default=None, help="skip shapes with L below this")
    ap.add_argument("--reference", action="store_true", help="also compare both against numpy float64")
    ap.add_argument("--impl", default="auto",
                    help="comma-separated implementations run on the backend (default auto); "
                         "numpy's side always runs impl='auto'")
    ap.add_argument("--cases", default="plain",
                    help=f"comma-separated option cases, or 'all' (default plain): {', '.join(CASES)}")
    ap.add_argument("--json", default=None, help="write every tensor's error to this JSON file")
    args = ap.parse_args(argv)
    tol = TOLERANCE[args.dtype] if args.tol is None else args.tol
    impls = args.impl.split(",")
    cases = list(CASES) if args.cases == "all" else args.cases.split(",")
    unknown = [c for c in cases if c not in CASES]
    if unknown:
        print(f"--cases: unknown case {unknown[0]!r}; expected 'all' or some of {', '.join(CASES)}",
              file=sys.stderr)
        return 2
    unknown = [i for i in impls if i not in IMPLS]  # the module's impl= choices
    if unknown:
        print(f"--impl: unknown implementation {unknown[0]!r}; expected some of {', '.join(IMPLS)}",
              file=sys.stderr)
        return 2

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
    header = (f"{'B':>3} {'L':>5} {'D':>4} {'H':>3} {'causal':>6} {'case':<10} {'impl':<9}"
              f"  {'max rel err':>11}  {'worst':<6}  {'t_numpy':>7} {'t_' + args.backend:>9}")
    if args.reference:
        header += f"  {'numpy vs f64':>12} {args.backend + ' vs f64':>14}"
    print(header)
    failed = False
    records = []
    for shape in shapes:
        B, L, D, H, causal = shape
        for case in cases:
            ref, t_ref = run_module("numpy", args.dtype, shape, args.seed, "auto", case)
            r64 = run_module("numpy", "float64", shape, args.seed, "auto", case)[0] if args.reference else None
            for impl in impls:
                line = f"{B:>3} {L:>5} {D:>4} {H:>3} {str(causal):>6} {case:<10} {impl:<9}"
                try:
                    got, t_got = run_module(args.backend, args.dtype, shape, args.seed, impl, case)
                except (TypeError, ValueError) as exc:
                    # a refusal by the dispatcher passes where NumPy refuses the same call too
                    # (the NumPy kernel and the kernel options); anything else is a failure
                    ok = _refused_on_numpy(args.dtype, shape, args.seed, impl, case)
                    failed |= not ok
                    print(f"{line}  {'refused' if ok else 'raised'}: {exc}"
                          + ("" if ok else "   FAIL"), flush=True)
                    records.append({"shape": shape, "case": case, "impl": impl, "ok": ok,
                                    "refused" if ok else "raised": str(exc)})
                    continue
                errs = compare(got, ref)
                worst = max(errs, key=errs.get)
                ok = all(np.isfinite(v).all() for v in got.values()) and errs[worst] <= tol
                failed |= not ok
                line += f"  {errs[worst]:>11.3e}  {worst:<6}  {t_ref:>6.2f}s {t_got:>8.2f}s"
                record = {"shape": shape, "case": case, "impl": impl, "errors": errs, "ok": ok,
                          "t_numpy_s": t_ref, "t_backend_s": t_got}
                if r64 is not None:
                    e_ref, e_got = compare(ref, r64), compare(got, r64)
                    line += f"  {max(e_ref.values()):>12.3e} {max(e_got.values()):>14.3e}"
                    record.update(errors_numpy_vs_f64=e_ref, errors_vs_f64=e_got)
                records.append(record)
                print(line + ("" if ok else "   FAIL"), flush=True)
    if args.json:
        import json

        with open(args.json, "w") as f:
            json.dump({"backend": args.backend, "dtype": args.dtype, "tolerance": tol,
                       "records": records}, f, indent=1)
    print("parity: FAIL" if failed else "parity: ok")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
