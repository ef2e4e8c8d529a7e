"""``npattn demo``: a small sequence model trained with hand-derived gradients only.

The task is to reverse a sequence of digits: for input ``x_0 ... x_{L-1}``
the target at position ``i`` is ``x_{L-1-i}``. Position ``i`` must read the
token at position ``L-1-i``, which is exactly what one attention layer with
positional information can do; the heatmaps show the learned anti-diagonal.

Model, every step a forward/backward pair of npattn::

    1. e      = embedding(ids, embed)            [B, L, D]    npattn.nn
    2. x      = e + pos                          [B, L, D]    npattn.nn (learned or sinusoidal)
    3. h      = MultiHeadAttention(x, x, x)      [B, L, D]    npattn.module
    4. logits = h @ w_out.T + b_out              [B, L, V]    npattn.functional.linear
    5. loss   = cross_entropy(logits, reversed)  []           npattn.nn

trained with Adam (``npattn.nn.adam_step``).

Shape legend: B batch, L sequence length, V vocabulary (10 digits), D model
width, H heads.
"""

from __future__ import annotations

import math
import os
import time
from dataclasses import asdict, dataclass
from typing import Any, NamedTuple

import numpy as np

from .. import functional as F
from .. import nn
from ..backend import computed, from_numpy, resolve_backend, to_numpy
from ..module import MultiHeadAttention
from ..validation import check_positive_int
from .progress import ProgressBar

__all__ = ["DemoConfig", "ReverseModel", "TrainResult", "make_batch", "train", "save_heatmaps",
           "heatmap_figure", "grid_shape"]


@dataclass
class DemoConfig:
    """Settings of one training run (the ``npattn demo`` options); the defaults are the
    command's (``npattn demo`` with no options trains ``DemoConfig()``)."""

    seq_len: int = 12
    vocab: int = 10
    d_model: int = 32
    n_head: int = 4
    batch: int = 64
    steps: int = 400
    lr: float = 1e-2
    pos: str = "sinusoidal"  # or "learned"
    dtype: str = "float32"
    backend: str = "numpy"
    seed: int = 0
    eval_size: int = 1024


def make_batch(rng: np.random.Generator, batch: int, seq_len: int, vocab: int):
    """Random digit sequences and their reversals, on the host. # -> [B, L], [B, L] int64"""
    ids = rng.integers(0, vocab, size=(batch, seq_len))  # [B, L]
    return ids, ids[:, ::-1].copy()  # [B, L]


class ModelCache(NamedTuple):
    embed: nn.EmbeddingCache
    pos: nn.PositionsCache
    out: F.LinearCache


class ReverseModel:
    """Embedding + positions + one multi-head self-attention + output projection.

    Parameters live in ``params`` (the embedding table ``embed`` (V, D), the
    learned positions ``pos`` (L, D), ``out.w`` (V, D), ``out.b`` (V,)) and in
    ``attn.params`` (``w_q`` ... ``b_o``); ``all_params()`` returns them in one
    dict with the attention ones prefixed ``attn.``.
    """

    def __init__(self, cfg: DemoConfig):
        self.cfg = cfg
        self.xp = xp = resolve_backend(cfg.backend)
        self.dtype = getattr(xp, cfg.dtype)
        init_seq, attn_seq = np.random.SeedSequence(cfg.seed).spawn(2)
        rng = np.random.default_rng(init_seq)
        V, L, D = cfg.vocab, cfg.seq_len, cfg.d_model
        self.attn = MultiHeadAttention(
            D, cfg.n_head, dtype=cfg.dtype, backend=xp, seed=int(attn_seq.generate_state(1)[0])
        )
        a = math.sqrt(6.0 / (V + D))
        self.params = {
            "embed": self._cast(rng.normal(0.0, 1.0, size=(V, D))),  # [V, D]
            "out.w": self._cast(rng.uniform(-a, a, size=(V, D))),  # [V, D]
            "out.b": self._cast(np.zeros(V)),  # [V]
        }
        if cfg.pos == "learned":
            self.params["pos"] = self._cast(rng.normal(0.0, 1.0, size=(L, D)))  # [L, D]
            self.fixed_pos = None
        elif cfg.pos == "sinusoidal":
            self.fixed_pos = nn.sinusoidal_positions(xp, L, D, dtype=self.dtype)  # [L, D]
        else:
            raise ValueError(f"pos: expected 'learned' or 'sinusoidal', got {cfg.pos!r}")
        self._cache: Any = None  # the ModelCache of the last forward

    def _cast(self, a):
        return self.xp.astype(from_numpy(a, self.xp), self.dtype)

    # parameters as one flat dict, for the optimiser
    def all_params(self) -> dict:
        out = dict(self.params)
        out.update({"attn." + k: v for k, v in self.attn.params.items()})
        return out

    def set_params(self, flat: dict):
        for k, v in flat.items():
            if k.startswith("attn."):
                self.attn.params[k[5:]] = v
            else:
                self.params[k] = v

    def n_params(self) -> int:
        return sum(math.prod(p.shape) for p in self.all_params().values())

    def forward(self, ids, *, need_weights=False):
        """Logits (B, L, V) for token ids (B, L); with ``need_weights`` also (B, H, L, L)."""
        P = self.params
        e, e_c = nn.embedding_forward(ids, P["embed"])  # 1.               [B, L, D]
        pos = P["pos"] if self.fixed_pos is None else self.fixed_pos
        x, p_c = nn.add_positions_forward(e, pos)  # 2.                    [B, L, D]
        h, w = self.attn.forward(x, x, x, need_weights=need_weights,  # 3.  [B, L, D]
                                 average_attn_weights=False)  # w: per head, or None
        logits, o_c = F.linear_forward(h, P["out.w"], P["out.b"])  # 4.    [B, L, V]
        self._cache = ModelCache(e_c, p_c, o_c)
        return (logits, w) if need_weights else logits

    def backward(self, dlogits) -> dict:
        """Gradients of every parameter (keys of ``all_params()``) from ``dlogits`` (B, L, V)."""
        c = self._cache
        # 4. logits = h @ w_out.T + b_out
        dh, dw_out, db_out = F.linear_backward(dlogits, c.out)  # [B, L, D]
        # 3. h = attn(x, x, x): x feeds query, key and value, so its gradient is the sum
        dq, dk, dv = self.attn.backward(dh)
        dx = dq + dk + dv  # [B, L, D]
        # 2. x = e + pos
        de, dpos = nn.add_positions_backward(dx, c.pos)
        # 1. e = embedding(ids, embed)
        _, dembed = nn.embedding_backward(de, c.embed)  # [V, D]
        grads = {"embed": dembed, "out.w": dw_out, "out.b": db_out}
        if self.fixed_pos is None:
            grads["pos"] = dpos
        grads.update({"attn." + k: g for k, g in self.attn.grads.items()})
        return grads


@dataclass
class TrainResult:
    n_head: int
    final_loss: float  # mean cross-entropy on the held-out batch
    accuracy: float  # token accuracy on the held-out batch
    seconds: float  # wall time of training
    n_params: int
    steps: int

    def asdict(self):
        return asdict(self)


def _loss_and_accuracy(xp, loss, logits, targets) -> tuple[float, float]:
    """The loss and the token accuracy of ``logits``, as numbers: on dask, one forward for both."""
    loss, pred = computed(loss, xp.argmax(logits, axis=-1))
    return float(loss), float(np.mean(to_numpy(pred) == to_numpy(targets)))


def train(cfg: DemoConfig, *, progress: bool = True, stream=None):
    """Train a ``ReverseModel`` with Adam; returns ``(model, TrainResult)``.

    The progress bar (on a terminal) shows the loss and token accuracy of the
    last training batch ("batch loss", "batch acc"); the result is measured
    on a fresh held-out batch of ``cfg.eval_size`` sequences. ``cfg.seq_len``, ``vocab``,
    ``steps``, ``batch`` and ``eval_size`` are positive ints (else ``TypeError`` /
    ``ValueError`` naming the field, before a model is built).
    """
    for name in ("seq_len", "vocab", "steps", "batch", "eval_size"):
        check_positive_int(f"cfg.{name}", getattr(cfg, name))
    model = ReverseModel(cfg)
    xp = model.xp
    data_rng = np.random.default_rng(np.random.SeedSequence(cfg.seed).spawn(3)[2])
    params = model.all_params()
    state = nn.adam_init(params)
    bar = ProgressBar(cfg.steps, f"demo H={cfg.n_head}", stream=stream, enabled=progress)  # on a tty
    start = time.perf_counter()
    for step in range(cfg.steps):
        ids_h, tgt_h = make_batch(data_rng, cfg.batch, cfg.seq_len, cfg.vocab)
        ids, tgt = from_numpy(ids_h, xp), from_numpy(tgt_h, xp)
        logits = model.forward(ids)
        loss, ce_c = nn.cross_entropy_forward(logits, tgt)
        dlogits, _ = nn.cross_entropy_backward(1.0, ce_c)
        grads = model.backward(dlogits)
        # cosine decay of the learning rate to 10 % over the run
        lr = cfg.lr * (0.55 + 0.45 * math.cos(math.pi * step / cfg.steps))
        params, state = nn.adam_step(params, grads, state, lr=lr)
        model.set_params(params)
        if step % 10 == 0 or step == cfg.steps - 1:
            batch_loss, acc = _loss_and_accuracy(xp, loss, logits, tgt)
            bar.update(0, f"batch loss {batch_loss:.4f}  batch acc {acc:.3f}")
        bar.update(1)
    seconds = time.perf_counter() - start
    bar.close()

    ids_h, tgt_h = make_batch(data_rng, cfg.eval_size, cfg.seq_len, cfg.vocab)
    ids, tgt = from_numpy(ids_h, xp), from_numpy(tgt_h, xp)
    logits = model.forward(ids)
    loss, _ = nn.cross_entropy_forward(logits, tgt)
    result = TrainResult(cfg.n_head, *_loss_and_accuracy(xp, loss, logits, tgt), seconds, model.n_params(),
                         cfg.steps)
    return model, result


def have_matplotlib() -> bool:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


def grid_shape(n_head: int) -> tuple:
    """(rows, columns) of the per-head grid: one row up to 4 heads, then rows of 4."""
    n_head = check_positive_int("n_head", n_head)
    cols = min(n_head, 4)
    return -(-n_head // cols), cols


def heatmap_figure(weights, digits, *, title=None):
    """One matplotlib ``Figure`` with a heatmap per head, in a grid, and one colorbar.

    ``weights`` (H, L, L) are the attention weights of one sequence whose
    tokens are ``digits`` (L,). Rows are query positions, columns key
    positions, both ticked with the position ``0 .. L-1``; the digits are in
    the title. Built without pyplot, so the caller's matplotlib backend is
    left alone.
    """
    shape = tuple(weights.shape)
    if len(shape) != 3 or shape[0] == 0 or shape[1] != shape[2]:
        raise ValueError(f"weights: expected shape (H, L, L) with H >= 1, got shape {shape}")
    from matplotlib.figure import Figure

    H, L = weights.shape[0], weights.shape[-1]  # [H, L, L]
    rows, cols = grid_shape(H)
    fig = Figure(figsize=(2.6 * cols + 1.0, 2.6 * rows + 0.8), layout="constrained")
    axes = fig.subplots(rows, cols, squeeze=False)
    ticks = range(0, L, 1 if L <= 12 else 2)
    images = []  # one per head, all on the colour scale [0, 1]
    for h, ax in enumerate(axes.flat):
        if h >= H:
            ax.set_axis_off()
            continue
        images.append(ax.imshow(weights[h], vmin=0.0, vmax=1.0, cmap="viridis"))
        ax.set_title(f"head {h}")
        ax.set_xticks(ticks)
        ax.set_yticks(ticks)
        ax.tick_params(labelsize=8)
        if h // cols == rows - 1 or h + cols >= H:
            ax.set_xlabel("key position")
        if h % cols == 0:
            ax.set_ylabel("query position")
    fig.colorbar(images[0], ax=axes, shrink=0.9 if rows > 1 else 0.8, label="attention weight")
    sequence = " ".join(str(d) for d in digits)
    fig.suptitle(title or f"Attention weights per head; input digits by position: {sequence}")
    return fig


def save_heatmaps(model: ReverseModel, out_dir: str, *, seed: int = 0) -> list:
    """Per-head attention heatmaps of one held-out sequence, as PNG files in ``out_dir``.

    Writes ``attention_head{h}.png`` for each head and ``attention_heads.png``
    with all heads in a grid (rows of at most 4) and one colorbar. Axes are
    ticked with positions; the sequence's digits are in the titles. Returns
    the paths. Needs matplotlib (the ``plot`` extra); does not touch pyplot
    or the matplotlib backend.
    """
    cfg = model.cfg
    ids_h, _ = make_batch(np.random.default_rng(seed), 1, cfg.seq_len, cfg.vocab)
    _, w = model.forward(from_numpy(ids_h, model.xp), need_weights=True)
    w = to_numpy(w)[0]  # [H, L, L]
    digits = [int(t) for t in ids_h[0]]
    os.makedirs(out_dir, exist_ok=True)
    paths = []
    H = w.shape[0]
    sequence = " ".join(str(d) for d in digits)
    for h in range(H):
        fig = heatmap_figure(w[h:h + 1], digits, title=f"head {h} of {H}; digits {sequence}")
        fig.axes[0].set_title("")
        path = os.path.join(out_dir, f"attention_head{h}.png")
        fig.savefig(path, dpi=100)
        paths.append(path)
    path = os.path.join(out_dir, "attention_heads.png")
    heatmap_figure(w, digits).savefig(path, dpi=100)
    paths.append(path)
    return paths


def format_table(results) -> str:
    """The ``--heads`` comparison as a text table."""
    lines = [f"{'heads':>5} {'head dim':>8} {'final loss':>11} {'accuracy':>9} {'time (s)':>9} "
             f"{'params':>7}"]
    for r, d_model in results:
        lines.append(
            f"{r.n_head:>5} {d_model // r.n_head:>8} {r.final_loss:>11.4f} {r.accuracy:>9.4f} "
            f"{r.seconds:>9.1f} {r.n_params:>7}"
        )
    return "\n".join(lines)
