"""``npattn demo --task digits``: a Transformer classifier on real data, trained with hand-derived gradients.

The data are scikit-learn's handwritten digits (``sklearn.datasets.load_digits``:
1797 images of 8 x 8 pixels, values 0..16, ten classes), which ship inside
the package: nothing is downloaded. Each image becomes a sequence of tokens,
its ``patch x patch`` pixel patches row by row (16 tokens of 4 pixels with
the default ``patch=2``), and ``npattn.classifier.TransformerClassifier``
classifies the sequence::

    1. e      = patches @ embed.weight.T + embed.bias   [B, L, D]
    2. h      = e + pos                                 [B, L, D]   learned positions
    3. h      = TransformerBlock(h)  (n_layers of them)  [B, L, D]   pre-norm by default
    4. h      = layer_norm(h)                           [B, L, D]   pre-norm only (the default, as ViT)
    5. z      = mean over the L tokens of h             [B, D]
    6. logits = z @ head.weight.T + head.bias           [B, 10]
    7. loss   = cross_entropy(logits, labels)           []

trained with Adam (``npattn.nn.adam_step``), the gradients clipped to a global
norm (``npattn.nn.clip_grad_norm``) and the learning rate decayed by a cosine.
The split into training and validation images is stratified and seeded;
pixels are scaled to [0, 1].

Shape legend: B batch, L tokens per image, P = patch * patch pixels per
token, D model width, H heads, C = 10 classes.
"""

from __future__ import annotations

import math
import numbers
import os
import time
from dataclasses import asdict, dataclass, field
from typing import Any, NamedTuple, Optional

import numpy as np

from .. import nn
from ..backend import computed, from_numpy, persisted, to_numpy
from ..classifier import TransformerClassifier
from ..validation import check_positive_int, described
from .demo import heatmap_figure
from .progress import ProgressBar

__all__ = ["DigitsConfig", "DigitsData", "DigitsResult", "load_digits_data", "image_patches",
           "stratified_split", "build_model", "train", "evaluate", "format_table", "save_attention_figures",
           "curves_figure", "IMAGE_SIZE", "N_CLASSES", "PATCHES"]

IMAGE_SIZE = 8  # the digits are 8 x 8 pixels
N_CLASSES = 10
PATCHES = (1, 2, 4)  # patch sizes that tile an 8 x 8 image into more than one token
PIXEL_MAX = 16.0  # load_digits' pixels are integers 0..16

MISSING_SKLEARN = ("the digits task needs scikit-learn, whose handwritten digits ship inside the "
                   "package (nothing is downloaded): pip install scikit-learn, or '.[demo]' from the "
                   "repository root")


@dataclass
class DigitsConfig:
    """Settings of one training run (the ``npattn demo --task digits`` options)."""

    n_head: int = 4
    d_model: int = 32
    n_layers: int = 1
    d_ff: Optional[int] = None  # the blocks' feed-forward width; None: 2 * d_model
    patch: int = 2
    epochs: int = 20
    batch: int = 32
    lr: float = 1e-2
    dropout: float = 0.1
    norm_first: bool = True  # pre-norm blocks and a final layer norm, as ViT
    clip: float = 1.0  # max global norm of the gradients
    val_fraction: float = 0.2
    dtype: str = "float32"
    backend: str = "numpy"
    seed: int = 0


# --------------------------------------------------------------------------
# the data, on the host


class DigitsData(NamedTuple):
    x_train: np.ndarray  # [N, L, P] float64 patches, pixels in [0, 1]
    y_train: np.ndarray  # [N] int64 labels 0..9
    x_val: np.ndarray  # [M, L, P]
    y_val: np.ndarray  # [M]
    images_val: np.ndarray  # [M, 8, 8] the validation images, pixels in [0, 1]
    patch: int


def image_patches(images: np.ndarray, patch: int) -> np.ndarray:
    """Square images as sequences of their ``patch x patch`` patches, row by row. # [N, S, S] -> [N, L, P]

    Token ``t = r * (S / patch) + c`` holds the pixels of patch row ``r`` and
    patch column ``c``, themselves row by row: ``L = (S / patch)^2``,
    ``P = patch^2``.
    """
    if isinstance(patch, bool) or not isinstance(patch, (int, np.integer)) or patch < 1:
        raise ValueError(f"patch: expected an int >= 1, got {patch!r}")
    N, S = images.shape[0], images.shape[-1]
    if images.ndim != 3 or images.shape[1] != S or S % patch:
        raise ValueError(f"images: expected shape (N, S, S) with S divisible by patch {patch}, "
                         f"got shape {images.shape}")
    g = S // patch  # patches per side
    blocks = images.reshape(N, g, patch, g, patch)  # [N, r, i, c, j]
    return blocks.transpose(0, 1, 3, 2, 4).reshape(N, g * g, patch * patch)  # [N, L, P]


def stratified_split(labels: np.ndarray, val_fraction: float, rng: np.random.Generator):
    """Indices ``(train, val)``: each class's examples shuffled, ``round(val_fraction * n)`` of them validation."""
    train, val = [], []
    for c in np.unique(labels):
        idx = rng.permutation(np.flatnonzero(labels == c))
        k = int(round(val_fraction * idx.size))
        val.append(idx[:k])
        train.append(idx[k:])
    return np.sort(np.concatenate(train)), np.sort(np.concatenate(val))


def load_digits_data(patch: int = 2, val_fraction: float = 0.2, seed: int = 0) -> DigitsData:
    """scikit-learn's digits as patch sequences, split into training and validation by ``seed``.

    Raises ``ImportError`` naming ``pip install scikit-learn`` (or ``'.[demo]'``) without
    scikit-learn.
    """
    if patch not in PATCHES:
        raise ValueError(f"patch: expected one of {list(PATCHES)}, got {patch!r}")
    if isinstance(val_fraction, (bool, np.bool_)) or not isinstance(val_fraction, numbers.Real):
        raise TypeError(f"val_fraction: expected a number in (0, 1), got {described(val_fraction)}")
    if not 0.0 < val_fraction < 1.0:
        raise ValueError(f"val_fraction: expected a number in (0, 1), got {val_fraction!r}")
    try:
        from sklearn.datasets import load_digits
    except ImportError as exc:
        raise ImportError(MISSING_SKLEARN) from exc
    digits = load_digits()
    images = np.asarray(digits.images, dtype=np.float64) / PIXEL_MAX  # [1797, 8, 8] in [0, 1]
    labels = np.asarray(digits.target, dtype=np.int64)  # [1797]
    split_seq = np.random.SeedSequence(seed).spawn(3)[0]
    tr, va = stratified_split(labels, val_fraction, np.random.default_rng(split_seq))
    if tr.size == 0 or va.size == 0:  # each class's share rounds to all or none of it
        raise ValueError(f"val_fraction: expected a share that leaves training and validation "
                         f"images, got {val_fraction!r} ({tr.size} training, {va.size} validation "
                         f"of {labels.size})")
    x = image_patches(images, patch)  # [1797, L, P]
    return DigitsData(x[tr], labels[tr], x[va], labels[va], images[va], patch)


# --------------------------------------------------------------------------
# training


@dataclass
class DigitsResult:
    n_head: int
    d_model: int
    train_loss: float  # mean cross-entropy over the last epoch's training batches
    val_accuracy: float  # after the last epoch
    val_loss: float
    seconds_per_epoch: float  # mean wall time of an epoch's training steps
    n_params: int
    epochs: int
    history: dict = field(default_factory=dict)  # per epoch: train_loss, val_loss, val_accuracy, seconds

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_head

    def asdict(self):
        return asdict(self)


def build_model(cfg: DigitsConfig, data: DigitsData) -> TransformerClassifier:
    """The untrained ``TransformerClassifier`` of ``cfg`` for ``data``'s tokens, seeded by ``cfg.seed``."""
    _, L, P = data.x_train.shape
    model_seed = int(np.random.SeedSequence(cfg.seed).spawn(3)[1].generate_state(1)[0])
    return TransformerClassifier(
        P, L, N_CLASSES, cfg.d_model, cfg.n_head, cfg.n_layers,
        2 * cfg.d_model if cfg.d_ff is None else cfg.d_ff, dropout=cfg.dropout,
        norm_first=cfg.norm_first, dtype=cfg.dtype, backend=cfg.backend, seed=model_seed,
    )


def evaluate(model: TransformerClassifier, x: np.ndarray, y: np.ndarray, *, batch: int = 512):
    """``(mean cross-entropy, accuracy)`` of ``model`` in evaluation mode on host arrays ``x`` (N, L, P), ``y`` (N,)."""
    xp, was_training = model.xp, model.training
    model.eval()
    total, correct = 0.0, 0
    try:
        for i in range(0, x.shape[0], batch):
            xb = xp.astype(from_numpy(x[i:i + batch], xp), model.dtype)  # [b, L, P]
            yb = from_numpy(y[i:i + batch], xp)  # [b]
            logits = model.forward(xb)  # [b, C]
            loss, _ = nn.cross_entropy_forward(logits, yb)
            loss, pred = computed(loss, xp.argmax(logits, axis=-1))  # dask: one forward for both
            total += float(loss) * yb.shape[0]
            correct += int(np.sum(to_numpy(pred) == y[i:i + batch]))
    finally:
        model.train(was_training)
    return total / x.shape[0], correct / x.shape[0]


def train(cfg: DigitsConfig, data: Optional[DigitsData] = None, *, progress: bool = True,
          stream: Any = None):
    """Train a ``TransformerClassifier`` on ``data`` (default: ``load_digits_data`` of ``cfg``); returns ``(model, DigitsResult)``.

    Each epoch visits the training images once in a seeded random order, in
    batches of ``cfg.batch``; validation loss and accuracy are measured after
    every epoch in evaluation mode. The progress bar (on a terminal) shows
    the epoch, the last training batch's loss and the last validation
    accuracy. ``cfg.epochs`` and ``cfg.batch`` are positive ints and ``data`` has
    training and validation images (else ``TypeError`` / ``ValueError``, before training).
    """
    check_positive_int("cfg.epochs", cfg.epochs)
    check_positive_int("cfg.batch", cfg.batch)
    if data is None:
        data = load_digits_data(cfg.patch, cfg.val_fraction, cfg.seed)
    for name, x in (("data.x_train", data.x_train), ("data.x_val", data.x_val)):
        if x.shape[0] == 0:
            raise ValueError(f"{name}: expected at least one image, got shape {x.shape}")
    model = build_model(cfg, data)
    xp = model.xp
    order_rng = np.random.default_rng(np.random.SeedSequence(cfg.seed).spawn(3)[2])
    N = data.x_train.shape[0]
    n_batches = -(-N // cfg.batch)
    total_steps = cfg.epochs * n_batches
    params = model.params
    state = nn.adam_init(params)
    history: dict = {"train_loss": [], "val_loss": [], "val_accuracy": [], "seconds": []}
    bar = ProgressBar(total_steps, f"digits H={cfg.n_head}", stream=stream, enabled=progress)
    step, val_acc, batch_loss = 0, float("nan"), float("nan")
    for epoch in range(cfg.epochs):
        order = order_rng.permutation(N)
        loss_sum = 0.0
        start = time.perf_counter()
        for i in range(0, N, cfg.batch):
            idx = order[i:i + cfg.batch]
            x = xp.astype(from_numpy(data.x_train[idx], xp), model.dtype)  # [B, L, P]
            y = from_numpy(data.y_train[idx], xp)  # [B]
            logits = model.forward(x)  # [B, C]
            loss, ce_c = nn.cross_entropy_forward(logits, y)
            dlogits, _ = nn.cross_entropy_backward(1.0, ce_c)  # [B, C]
            grads = model.backward(dlogits)
            # dask: the loss computed with the gradients, in one graph (read after the step, it
            # ran the forward again)
            loss, *values = persisted(loss, *grads.values())
            grads, _ = nn.clip_grad_norm(dict(zip(grads, values)), cfg.clip)
            # cosine decay of the learning rate to 10 % over the run
            lr = cfg.lr * (0.55 + 0.45 * math.cos(math.pi * step / total_steps))
            params, state = nn.adam_step(params, grads, state, lr=lr)
            model.params = params
            batch_loss = float(loss)
            loss_sum += batch_loss * idx.size
            step += 1
            note = (f"epoch {epoch + 1}/{cfg.epochs}  batch loss {batch_loss:.4f}  "
                    f"val acc {val_acc:.3f}")
            bar.update(1, note if step % 5 == 0 or step == total_steps else None)
        seconds = time.perf_counter() - start
        val_loss, val_acc = evaluate(model, data.x_val, data.y_val)
        history["train_loss"].append(loss_sum / N)
        history["val_loss"].append(val_loss)
        history["val_accuracy"].append(val_acc)
        history["seconds"].append(seconds)
        bar.update(0, f"epoch {epoch + 1}/{cfg.epochs}  batch loss {batch_loss:.4f}  "
                      f"val acc {val_acc:.3f}")
    bar.close()
    result = DigitsResult(
        cfg.n_head, cfg.d_model, history["train_loss"][-1], history["val_accuracy"][-1],
        history["val_loss"][-1], float(np.mean(history["seconds"])), model.n_params(), cfg.epochs,
        history,
    )
    return model, result


def format_table(results) -> str:
    """The ``--heads`` comparison as a text table (the reverse demo's, with per-epoch time)."""
    lines = [f"{'heads':>5} {'head dim':>8} {'train loss':>10} {'val accuracy':>12} "
             f"{'s/epoch':>8} {'params':>7}"]
    for r in results:
        lines.append(f"{r.n_head:>5} {r.head_dim:>8} {r.train_loss:>10.4f} {r.val_accuracy:>12.4f} "
                     f"{r.seconds_per_epoch:>8.2f} {r.n_params:>7}")
    return "\n".join(lines)


# --------------------------------------------------------------------------
# pictures (matplotlib's Figure, never pyplot: the caller's backend is left alone)


def _attention_on_image_figure(weights: np.ndarray, image: np.ndarray, patch: int, title: str):
    """The image, then per head the attention each patch receives (mean over the queries) under the digit's outline."""
    from matplotlib.figure import Figure

    H, L = weights.shape[0], weights.shape[-1]  # [H, L, L]
    g = IMAGE_SIZE // patch
    received = weights.mean(axis=1).reshape(H, g, g)  # [H, g, g] column means: what each patch gets
    cols = min(H + 1, 5)  # the image, then the heads: one row up to 4 heads, then rows of 5 panels
    rows = -(-(H + 1) // cols)
    fig = Figure(figsize=(2.2 * cols + 0.9, 2.3 * rows + 0.6), layout="constrained")
    axes = fig.subplots(rows, cols, squeeze=False)
    ax = axes.flat[0]
    ax.imshow(image, cmap="gray_r", vmin=0.0, vmax=1.0)
    for t in range(L):  # number the patches: the token order of the heatmaps
        r, c = divmod(t, g)
        ax.text(c * patch + (patch - 1) / 2, r * patch + (patch - 1) / 2, str(t), ha="center",
                va="center", fontsize=7 if patch > 1 else 5, color="tab:red",
                bbox={"boxstyle": "round,pad=0.1", "fc": "white", "ec": "none", "alpha": 0.7})
    ax.set_title("image, patch numbers")
    vmax = max(float(np.max(received)), 1e-12)
    im = None
    for h, ax in enumerate(list(axes.flat)[1:]):
        if h >= H:
            ax.set_axis_off()
            continue
        big = np.kron(received[h], np.ones((patch, patch)))  # [8, 8]
        im = ax.imshow(big, cmap="viridis", vmin=0.0, vmax=vmax)
        ax.contour(image, levels=[0.5], colors="white", linewidths=1.2)  # the digit's outline
        ax.set_title(f"head {h}")
    for ax in axes.flat:
        ax.set_xticks([])
        ax.set_yticks([])
    if im is not None:
        fig.colorbar(im, ax=axes, shrink=0.85, label="mean attention received")
    fig.suptitle(title)
    return fig


def save_attention_figures(model: TransformerClassifier, data: DigitsData, out_dir: str, *,
                           index: int = 0) -> list:
    """Attention pictures of validation image ``index`` (the first block's heads), PNG files in ``out_dir``.

    ``attention_heads.png``: per head the (L, L) attention weights, queries
    by keys, tokens numbered row by row over the image (``demo.heatmap_figure``);
    ``attention_on_image.png``: the image with its patches numbered, and per
    head the attention each patch receives (averaged over the queries)
    drawn over it. Returns the paths. Needs matplotlib.
    """
    xp = model.xp
    x = xp.astype(from_numpy(data.x_val[index:index + 1], xp), model.dtype)  # [1, L, P]
    was_training = model.training
    model.eval()
    try:
        logits, weights = model.forward(x, need_weights=True)
    finally:
        model.train(was_training)
    w = np.asarray(to_numpy(weights[0]), dtype=np.float64)[0]  # [H, L, L]
    label, pred = int(data.y_val[index]), int(np.argmax(to_numpy(logits)[0]))
    H, L = w.shape[0], w.shape[-1]
    os.makedirs(out_dir, exist_ok=True)
    about = f"a {label}, predicted {pred}"
    paths = []
    fig = heatmap_figure(w, list(range(L)), title=(
        f"Attention weights per head, validation image {index} ({about}); "
        f"token t = patch t, row by row"))
    path = os.path.join(out_dir, "attention_heads.png")
    fig.savefig(path, dpi=80)
    paths.append(path)
    fig = _attention_on_image_figure(w, data.images_val[index], data.patch,
                                     f"Where each head looks, validation image {index} ({about})")
    path = os.path.join(out_dir, "attention_on_image.png")
    fig.savefig(path, dpi=80)
    paths.append(path)
    return paths


def curves_figure(results):
    """Training loss and validation accuracy per epoch, one line per head count."""
    from matplotlib.figure import Figure
    from matplotlib.ticker import FuncFormatter, LogLocator, MaxNLocator

    fig = Figure(figsize=(9.0, 3.4), layout="constrained")
    ax_loss, ax_acc = fig.subplots(1, 2)
    for r in results:
        epochs = np.arange(1, len(r.history["train_loss"]) + 1)
        label = f"{r.n_head} head{'s' if r.n_head > 1 else ''} (dim {r.head_dim})"
        ax_loss.plot(epochs, r.history["train_loss"], marker=".", label=label)
        ax_acc.plot(epochs, r.history["val_accuracy"], marker=".", label=label)
    ax_loss.set_yscale("log")
    plain = FuncFormatter(lambda v, _: f"{v:g}")
    ax_loss.yaxis.set_minor_locator(LogLocator(subs=(2.0, 5.0)))
    ax_loss.yaxis.set_major_formatter(plain)
    ax_loss.yaxis.set_minor_formatter(plain)
    for ax in (ax_loss, ax_acc):
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax_loss.set_xlabel("epoch")
    ax_loss.set_ylabel("training loss (mean over the epoch)")
    ax_acc.set_xlabel("epoch")
    ax_acc.set_ylabel("validation accuracy")
    ax_acc.legend(loc="lower right", fontsize=8)
    ax_loss.grid(alpha=0.3)
    ax_acc.grid(alpha=0.3)
    fig.suptitle("Handwritten digits: TransformerClassifier at equal d_model")
    return fig
