"""JAX's float64 ``dot_product_attention`` against npattn's, gradients included (docs/compat.md).

JAX computes the softmax in float32 whatever the input dtype, so with float64
inputs (x64 on) its output and gradients carry float32 rounding; npattn computes
float64 in float64. For each standard deviation of the scores (1, 3 and 9) and
each of three seeds this draws N random configurations: B in [1, 3], T and S in
[2, 16], K in {1, 2} key/value heads and N = K or 2K query heads, head width H in
[2, 16]; q and k of standard deviation sqrt(std), so the scores q.k / sqrt(H)
have that deviation, v standard normal; ``is_causal`` on in about half (T <= S
only); a standard normal upstream gradient. For each configuration it takes,
per array (out, dq, dk, dv), the largest entry of |jax - npattn| / (1 + |npattn|),
and prints the median and the largest of them over the N configurations.

Usage: PYTHONPATH=. python docs/bench/jax_float64_dq.py [N]   (default 25)
"""

import sys

import numpy as np

import jax

jax.config.update("jax_enable_x64", True)
import jax.numpy as jnp  # noqa: E402

from npattn import compat as C  # noqa: E402


def rel(x, ref):
    """The largest entry of |x - ref| / (1 + |ref|)."""
    return float(np.max(np.abs(np.asarray(x) - ref) / (1.0 + np.abs(ref))))


def one(rng, std):
    """(out, dq, dk, dv) differences of one random configuration with scores of deviation std."""
    B, T, S = (int(n) for n in (rng.integers(1, 4), rng.integers(2, 17), rng.integers(2, 17)))
    K = int(rng.integers(1, 3))
    N, H = K * int(rng.integers(1, 3)), int(rng.integers(2, 17))
    a = np.sqrt(std)
    q = rng.standard_normal((B, T, N, H)) * a  # [B, T, N, H]
    k = rng.standard_normal((B, S, K, H)) * a  # [B, S, K, H]
    v = rng.standard_normal((B, S, K, H))  # [B, S, K, H]
    causal = bool(rng.integers(0, 2)) and T <= S
    out, pullback = C.vjp(C.dot_product_attention, q, k, v, is_causal=causal)
    ct = rng.standard_normal(out.shape)  # [B, T, N, H]
    grads = pullback(ct)
    j_out, j_vjp = jax.vjp(lambda x, y, z: jax.nn.dot_product_attention(x, y, z, is_causal=causal),
                           jnp.asarray(q), jnp.asarray(k), jnp.asarray(v))
    assert j_out.dtype == jnp.float64
    j_grads = j_vjp(jnp.asarray(ct))
    return (rel(j_out, out),) + tuple(rel(j, g) for j, g in zip(j_grads, grads[:3]))


def main(n):
    print(f"jax {jax.__version__}, numpy {np.__version__}; N = {n} configurations per line")
    print("                 median: out     dq      dk      dv   | largest: out     dq      dk      dv")
    for std in (1, 3, 9):
        for seed in range(3):
            rng = np.random.default_rng([seed, std])
            r = np.array([one(rng, float(std)) for _ in range(n)])
            print(f"std {std} seed {seed}:       " + "  ".join(f"{x:.1e}" for x in np.median(r, axis=0))
                  + " | " + "  ".join(f"{x:.1e}" for x in r.max(axis=0)), flush=True)


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 25)
