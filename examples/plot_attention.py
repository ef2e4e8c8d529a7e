"""Plot the attention weights of every head as heatmaps.

Uses ``need_weights=True`` (weights before dropout, shape (B, H, Lq, Lk)) with
a causal mask and a padding mask, so the masked entries show as exact zeros.
Needs matplotlib (from the repository root, ``pip install '.[plot]'``);
without it, says so and exits 0::

    python examples/plot_attention.py [--out attention.png]
"""

import argparse
import sys

import numpy as np

from npattn import MultiHeadAttention
from npattn.nn import sinusoidal_positions


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="attention.png", help="PNG file to write")
    args = parser.parse_args(argv)
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("plot_attention: skipped, matplotlib is not installed "
              "(from the npattn checkout: pip install '.[plot]')")
        return 0

    L, D, H = 10, 16, 4
    rng = np.random.default_rng(0)
    # tokens plus sinusoidal positions, so that the heads show positional patterns
    x = rng.standard_normal((1, L, D)) * 0.5 + sinusoidal_positions(np, L, D)[None]  # [1, L, D]
    mha = MultiHeadAttention(D, H, dtype="float64", seed=1)
    padding = (np.arange(L) < 8)[None, None, None, :]  # [1, 1, 1, L]: the last 2 are padding
    _, w = mha(x, x, x, mask=padding, is_causal=True, need_weights=True)  # w: [1, H, L, L]

    fig, axes = plt.subplots(1, H, figsize=(3.2 * H, 3.4))
    for h, ax in enumerate(axes):
        im = ax.imshow(w[0, h], vmin=0.0, vmax=1.0, cmap="viridis")
        ax.set_title(f"head {h}")
        ax.set_xticks(range(L))
        ax.set_yticks(range(L))
        ax.set_xlabel("key position")
        if h == 0:
            ax.set_ylabel("query position")
    fig.colorbar(im, ax=list(axes), fraction=0.02)
    fig.suptitle("causal + padding mask: masked weights are exactly 0")
    fig.savefig(args.out, dpi=100, bbox_inches="tight")
    plt.close(fig)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
