"""Plot the attention weights of every head as heatmaps.

Uses ``need_weights=True, average_attn_weights=False`` (weights per head, before
dropout, shape (B, H, Lq, Lk)) with a causal mask and a padding mask. The
masked entries are exact zeros; they are drawn hatched in grey (not in the
colormap's dark end), so they do not look like small weights. Needs matplotlib
(from the repository root, ``pip install '.[plot]'``); without it, says so and
exits 0::

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
        from matplotlib.figure import Figure  # no pyplot: the caller's backend is left alone
        from matplotlib.patches import Patch, Rectangle
    except ImportError:
        print("plot_attention: skipped, matplotlib is not installed "
              "(pip install matplotlib, or '.[plot]' from the npattn checkout)")
        return 0

    L, D, H = 10, 16, 4
    rng = np.random.default_rng(0)
    # tokens plus sinusoidal positions, so that the heads show positional patterns
    x = rng.standard_normal((1, L, D)) * 0.5 + sinusoidal_positions(np, L, D)[None]  # [1, L, D]
    mha = MultiHeadAttention(D, H, dtype="float64", seed=1)
    padding = (np.arange(L) < 8)[None, None, None, :]  # [1, 1, 1, L]: the last 2 are padding
    _, w = mha(x, x, x, mask=padding, is_causal=True, need_weights=True,
               average_attn_weights=False)  # w: [1, H, L, L]
    allowed = np.tril(np.ones((L, L), dtype=bool)) & padding[0, 0]  # [L, L]: may attend
    assert np.all(w[0][:, ~allowed] == 0.0)  # masked weights are exact zeros

    fig = Figure(figsize=(3.0 * H + 1.0, 3.8), layout="constrained")
    axes = fig.subplots(1, H)
    for h, ax in enumerate(axes):
        shown = np.ma.masked_array(w[0, h], mask=~allowed)  # [L, L]
        im = ax.imshow(shown, vmin=0.0, vmax=1.0, cmap="viridis")
        for i, j in zip(*np.nonzero(~allowed)):  # hatch the masked cells
            ax.add_patch(Rectangle((j - 0.5, i - 0.5), 1.0, 1.0, facecolor="0.85",
                                   edgecolor="0.55", hatch="///", linewidth=0.0))
        ax.set_title(f"head {h}")
        ax.set_xticks(range(L))
        ax.set_yticks(range(L))
        ax.set_xlabel("key position")
        if h == 0:
            ax.set_ylabel("query position")
    fig.colorbar(im, ax=list(axes), fraction=0.02, label="attention weight")
    fig.legend(handles=[Patch(facecolor="0.85", edgecolor="0.55", hatch="///",
                              label="masked (causal or padding): weight exactly 0")],
               loc="outside lower center")
    fig.suptitle("Attention weights with a causal and a padding mask (keys 8, 9 are padding)")
    try:  # a PNG at exactly --out, whatever its suffix (matplotlib would add .png to "attn")
        fig.savefig(args.out, dpi=100, format="png")
    except OSError as e:
        parser.error(f"--out {args.out!r}: cannot write the picture there ({e.strerror or e})")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
