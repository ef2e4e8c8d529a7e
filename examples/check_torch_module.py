"""Check a PyTorch ``nn.MultiheadAttention`` against npattn, forward and backward.

The weights are copied by hand: torch stacks the three input projections in
``in_proj_weight`` (3D, D), rows ``[0:D]`` = ``w_q``, ``[D:2D]`` = ``w_k``,
``[2D:3D]`` = ``w_v`` (the same (out, in) layout as npattn), and likewise
``in_proj_bias``; ``out_proj`` holds ``w_o`` and ``b_o``.

Masks: torch's boolean masks mean True = *ignore*, npattn's True = *may
attend*, so they are negated. (A query row with nothing to attend is NaN in
torch but an all-zero row in npattn, so this example avoids it.)

Needs torch: ``pip install torch==2.13.0``, the CPU build (a plain
``pip install torch`` pulls a multi-GB CUDA build). Without torch it says so
and exits 0::

    python examples/check_torch_module.py
"""

import sys

import numpy as np

from npattn import MultiHeadAttention


def main():
    try:
        import torch
    except ImportError:
        print("check_torch_module: skipped, PyTorch is not installed")
        return 0

    torch.manual_seed(0)
    rng = np.random.default_rng(0)
    B, Lq, Lk, D, H = 2, 4, 6, 8, 2

    ref = torch.nn.MultiheadAttention(D, H, batch_first=True, dtype=torch.float64)
    with torch.no_grad():  # non-zero biases, so their gradients are checked too
        ref.in_proj_bias.normal_()
        ref.out_proj.bias.normal_()

    ours = MultiHeadAttention(D, H, dtype="float64")
    W, b = ref.in_proj_weight.detach().numpy(), ref.in_proj_bias.detach().numpy()
    ours.params.update(
        w_q=W[0:D].copy(), w_k=W[D:2 * D].copy(), w_v=W[2 * D:3 * D].copy(),
        b_q=b[0:D].copy(), b_k=b[D:2 * D].copy(), b_v=b[2 * D:3 * D].copy(),
        w_o=ref.out_proj.weight.detach().numpy().copy(),
        b_o=ref.out_proj.bias.detach().numpy().copy(),
    )

    query = rng.standard_normal((B, Lq, D))  # [B, Lq, D]
    key = rng.standard_normal((B, Lk, D))  # [B, Lk, D]
    value = rng.standard_normal((B, Lk, D))  # [B, Lk, D]
    dout = rng.standard_normal((B, Lq, D))  # [B, Lq, D], random, never all ones
    ignore_key = np.arange(Lk)[None, :] >= np.array([6, 4])[:, None]  # [B, Lk] True = padding

    # torch: True = ignore
    tq, tk, tv = (torch.tensor(a, requires_grad=True) for a in (query, key, value))
    t_out, t_w = ref(tq, tk, tv, key_padding_mask=torch.tensor(ignore_key),
                     need_weights=True, average_attn_weights=False)
    t_out.backward(torch.tensor(dout))

    # npattn: True = may attend, broadcast over heads and queries
    mask = ~ignore_key[:, None, None, :]  # [B, 1, 1, Lk]
    out, w = ours(query, key, value, mask=mask, need_weights=True, average_attn_weights=False)
    dquery, dkey, dvalue = ours.backward(dout)

    g = ours.grads
    pairs = {
        "out": (out, t_out),
        "weights": (w, t_w),
        "dquery": (dquery, tq.grad),
        "dkey": (dkey, tk.grad),
        "dvalue": (dvalue, tv.grad),
        "d in_proj_weight": (np.concatenate([g["w_q"], g["w_k"], g["w_v"]]),
                             ref.in_proj_weight.grad),
        "d in_proj_bias": (np.concatenate([g["b_q"], g["b_k"], g["b_v"]]), ref.in_proj_bias.grad),
        "d out_proj.weight": (g["w_o"], ref.out_proj.weight.grad),
        "d out_proj.bias": (g["b_o"], ref.out_proj.bias.grad),
    }
    worst = 0.0
    for name, (a, t) in pairs.items():
        err = float(np.max(np.abs(a - t.detach().numpy())))
        worst = max(worst, err)
        print(f"{name:<18} max |npattn - torch| = {err:.2e}")
    if worst > 1e-10:
        print("npattn and torch disagree", file=sys.stderr)
        return 1
    print("npattn and torch.nn.MultiheadAttention agree (float64)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
