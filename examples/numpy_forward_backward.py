"""Forward and backward of multi-head attention on NumPy, checked by finite differences.

Run from anywhere after ``pip install .`` in the repository root (or with the
repository on ``PYTHONPATH``)::

    python examples/numpy_forward_backward.py
"""

import numpy as np

from npattn import MultiHeadAttention
from npattn import functional as F
from npattn.gradcheck import gradcheck


def main():
    rng = np.random.default_rng(0)
    B, Lq, Lk, D, H = 2, 3, 5, 8, 2

    # 1. The module: cross-attention from 3 queries to 5 keys, with a padding mask
    #    (True = may attend): the second sequence has only 3 real keys.
    mha = MultiHeadAttention(D, H, dtype="float64", seed=0)
    query = rng.standard_normal((B, Lq, D))  # [B, Lq, D]
    key = rng.standard_normal((B, Lk, D))  # [B, Lk, D]
    value = rng.standard_normal((B, Lk, D))  # [B, Lk, D]
    real = np.arange(Lk)[None, :] < np.array([5, 3])[:, None]  # [B, Lk]
    mask = real[:, None, None, :]  # [B, 1, 1, Lk], broadcast over heads and queries

    out, weights = mha(query, key, value, mask=mask, need_weights=True, average_attn_weights=False)
    print(f"out {out.shape}, attention weights {weights.shape}")
    print("weights of batch 1, head 0 (padded keys 3 and 4 get exactly 0):")
    print(np.round(weights[1, 0], 3))

    # 2. The backward, for a random upstream gradient (never all ones).
    dout = rng.standard_normal(out.shape)  # [B, Lq, D]
    dquery, dkey, dvalue = mha.backward(dout)
    print(f"dquery {dquery.shape}, dkey {dkey.shape}, dvalue {dvalue.shape}")
    print("parameter gradients:", {k: g.shape for k, g in mha.grads.items()})
    print("dkey of the padded keys is zero:", bool(np.all(dkey[1, 3:] == 0.0)))

    # 3. One functional pair checked against central finite differences.
    q = rng.standard_normal((B, H, Lq, 4))  # [B, H, Lq, Dh]
    k = rng.standard_normal((B, H, Lk, 4))  # [B, H, Lk, Dh]
    v = rng.standard_normal((B, H, Lk, 4))  # [B, H, Lk, Dh]
    float_mask = np.where(rng.random((Lq, Lk)) < 0.3, -np.inf, 0.0)  # additive, with -inf
    report = gradcheck(
        lambda q, k, v, m: F.sdpa_forward(q, k, v, mask=m),
        F.sdpa_backward,
        [q, k, v, float_mask],
        names=["q", "k", "v", "mask"],
    )
    print(report)
    if not report.ok:
        raise SystemExit("gradient check failed")


if __name__ == "__main__":
    main()
