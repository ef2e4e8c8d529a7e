"""The NumPy example on the GPU with CuPy, compared with NumPy.

Needs CuPy and a CUDA GPU (from the repository root, ``pip install '.[cupy]'``);
without them it says so and exits with status 0::

    python examples/cupy_forward_backward.py
"""

import sys

import numpy as np

from npattn import MultiHeadAttention
from npattn.backend import to_numpy


def gpu_or_none():
    try:
        import cupy

        if cupy.cuda.runtime.getDeviceCount() < 1:
            return None
        return cupy
    except Exception:  # not installed, or no driver / device
        return None


def main():
    cp = gpu_or_none()
    if cp is None:
        print("cupy_forward_backward: skipped, CuPy with a CUDA GPU is not available here")
        return 0
    rng = np.random.default_rng(0)
    B, Lq, Lk, D, H = 2, 3, 5, 8, 2
    query = rng.standard_normal((B, Lq, D))  # [B, Lq, D]
    key = rng.standard_normal((B, Lk, D))  # [B, Lk, D]
    value = rng.standard_normal((B, Lk, D))  # [B, Lk, D]
    mask = (np.arange(Lk)[None, :] < np.array([5, 3])[:, None])[:, None, None, :]  # [B,1,1,Lk]
    dout = rng.standard_normal((B, Lq, D))  # [B, Lq, D]

    results = {}
    for name, lib in (("numpy", np), ("cupy", cp)):
        # the same seed gives the same parameters on every backend
        mha = MultiHeadAttention(D, H, dtype="float64", seed=0, backend=name)
        arrays = [lib.asarray(a) for a in (query, key, value, mask, dout)]
        out, _ = mha(*arrays[:3], mask=arrays[3])
        grads = mha.backward(arrays[4])
        results[name] = [to_numpy(out), *(to_numpy(g) for g in grads),
                         *(to_numpy(mha.grads[k]) for k in sorted(mha.grads))]
        print(f"{name}: out {type(out).__module__}.{type(out).__name__} {tuple(out.shape)}")

    worst = max(float(np.max(np.abs(a - b))) for a, b in zip(results["numpy"], results["cupy"]))
    print(f"max |numpy - cupy| over the output and every gradient: {worst:.2e}")
    if worst > 1e-10:
        print("mismatch between NumPy and CuPy", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
