"""Print the measured maximum error against float64 per backend and dtype.

The table in docs/dtypes.md comes from this script; it uses the measurement
code of tests/test_dtypes.py on the test shapes plus larger ones. Run from the
repository root::

    PYTHONPATH=$PWD python scripts/dtype_errors.py [--backends numpy,torch] [--seeds 3]
"""

import argparse
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))

import test_dtypes as T  # noqa: E402

from npattn.backend import resolve_backend  # noqa: E402

EXTRA_SDPA = [(1, 8, 256, 256, 64, True), (2, 4, 100, 300, 32, False)]
EXTRA_MODULE = [(2, 128, 128, 128, 8, True)]


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--backends", default="numpy,array_api_strict,torch")
    ap.add_argument("--seeds", type=int, default=3)
    args = ap.parse_args()
    print(f"{'backend':<18}{'dtype':<10}{'SDPA max':>10}{'bound':>10}{'module max':>12}{'bound':>10}")
    ok = True
    for backend in args.backends.split(","):
        try:
            xp = resolve_backend(backend)
        except ImportError as exc:
            print(f"{backend:<18}skipped ({exc})")
            continue
        for name in ("float64", "float32", "float16", "bfloat16"):
            if not hasattr(xp, name):
                continue
            dtype = getattr(xp, name)
            s = max(max(T.sdpa_errors(xp, dtype, shape, seed).values())
                    for shape in T.SDPA_SHAPES + EXTRA_SDPA for seed in range(args.seeds))
            m = max(max(T.module_errors(backend, xp, name, shape, seed).values())
                    for shape in T.MODULE_SHAPES + EXTRA_MODULE for seed in range(args.seeds))
            ok &= s <= T.SDPA_BOUND[name] and m <= T.MODULE_BOUND[name]
            print(f"{backend:<18}{name:<10}{s:>10.2e}{T.SDPA_BOUND[name]:>10.1e}"
                  f"{m:>12.2e}{T.MODULE_BOUND[name]:>10.1e}")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
