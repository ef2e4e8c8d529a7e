"""``npattn demo --task gpt``: a character-level GPT trained with hand-derived gradients only.

The text is npattn's own documentation as it ships in the package: the
docstrings of its modules, classes and functions (about 300,000 characters,
95 distinct ones; it grows with the docstrings, and ``docs/gpt.md``'s run had
208,022), read with ``ast`` from the installed source files, file by file.
The last 10 % is held out for the validation loss. The model is
``npattn.gpt.GPT``; each step is ``npattn.gpt.training_step`` (forward,
cross-entropy, backward, clipping by the global norm, Adam) on a batch of
windows drawn at seeded random offsets, with a linear warm-up and a cosine
decay of the learning rate. After training the demo writes the loss curve
(``loss.png``) and generated text (``samples.txt``), sampled with the KV
cache (``GPT.generate``) from a few prompts.

Shape legend: B batch, L = block_size (context length), V vocabulary (the
characters of the text), D model width.
"""

from __future__ import annotations

import ast
import math
import os
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Optional

import numpy as np

from .. import nn
from ..backend import backend_name, from_numpy, resolve_backend, to_numpy
from ..gpt import GPT, training_step
from ..validation import check_positive_int
from .progress import ProgressBar

__all__ = ["GPTDemoConfig", "GPTHistory", "CharCodec", "corpus", "longest_context", "train",
           "generate_samples",
           "save_loss_plot", "format_summary", "PROMPTS"]

#: Prompts the samples start from.
PROMPTS = ("The ", "Parameters\n----------\n", "Returns the ")


@dataclass
class GPTDemoConfig:
    """Settings of one run (the ``npattn demo --task gpt`` options)."""

    block_size: int = 64
    d_model: int = 96
    n_layer: int = 3
    n_head: int = 4
    batch: int = 32
    steps: int = 1500
    lr: float = 3e-3
    warmup: int = 100
    max_grad_norm: float = 1.0
    dropout: float = 0.0
    eval_every: int = 100
    eval_batches: int = 8
    dtype: str = "float32"
    backend: str = "numpy"
    seed: int = 0


@dataclass
class GPTHistory:
    """What one run measured: training loss per step, validation loss every ``eval_every`` steps."""

    train_loss: list = field(default_factory=list)
    val_steps: list = field(default_factory=list)
    val_loss: list = field(default_factory=list)
    seconds: float = 0.0
    n_params: int = 0
    vocab: int = 0
    train_chars: int = 0
    val_chars: int = 0

    def asdict(self) -> dict:
        return asdict(self)


def corpus() -> str:
    """npattn's docstrings (modules, classes, functions), file by file in sorted order."""
    root = Path(__file__).resolve().parent.parent  # the npattn package
    parts = []
    for path in sorted(root.rglob("*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for node in ast.walk(tree):
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                doc = ast.get_docstring(node)
                if doc:
                    parts.append(doc)
    return "\n\n".join(parts) + "\n"


def longest_context(n_chars: int) -> int:
    """The longest ``block_size`` whose windows the held-out 10 % of an ``n_chars`` text holds:
    a window of ``block_size`` characters and its targets, shifted by one. (``train`` takes a
    longer one by holding out more than 10 %; the ``npattn demo`` command does not.)"""
    return n_chars // 10 - 1


class CharCodec:
    """Characters <-> token ids: the sorted distinct characters of a text."""

    def __init__(self, text: str):
        self.chars = sorted(set(text))
        self.index = {c: i for i, c in enumerate(self.chars)}

    @property
    def vocab_size(self) -> int:
        return len(self.chars)

    def encode(self, text: str) -> np.ndarray:
        unknown = sorted(set(text) - set(self.index))
        if unknown:
            raise ValueError(f"text: expected characters of the training text, got {unknown!r}")
        return np.array([self.index[c] for c in text], dtype=np.int64)

    def decode(self, ids) -> str:
        return "".join(self.chars[int(i)] for i in np.asarray(ids).reshape(-1))


def _windows(data: np.ndarray, rng: np.random.Generator, batch: int, L: int):
    """``batch`` windows of ``L`` tokens at random offsets and the same shifted by one. # -> [B, L] x 2"""
    starts = rng.integers(0, len(data) - L, size=batch)  # the last target is data[-1]
    idx = starts[:, None] + np.arange(L)[None, :]  # [B, L]
    return data[idx], data[idx + 1]


def _lr(cfg: GPTDemoConfig, step: int) -> float:
    """Linear warm-up over ``warmup`` steps, then a cosine decay to 10 % of ``lr``."""
    if step < cfg.warmup:
        return cfg.lr * ((step + 1) / cfg.warmup)  # a fraction of lr: lr * (step + 1) can overflow
    t = (step - cfg.warmup) / max(1, cfg.steps - cfg.warmup)
    return cfg.lr * (0.1 + 0.45 * (1.0 + math.cos(math.pi * t)))


def train(cfg: GPTDemoConfig, *, text: Optional[str] = None, progress: bool = True, stream=None):
    """Train a character GPT on ``text`` (default: ``corpus()``); returns ``(model, codec, history)``.

    ``cfg.block_size``, ``steps``, ``eval_every``, ``eval_batches`` and ``batch`` are positive
    ints (else ``TypeError`` / ``ValueError`` naming the field, before the text is read).
    """
    for name in ("block_size", "steps", "eval_every", "eval_batches", "batch"):
        check_positive_int(f"cfg.{name}", getattr(cfg, name))
    text = corpus() if text is None else text
    codec = CharCodec(text)
    data = codec.encode(text)
    n_val = max(len(data) // 10, cfg.block_size + 1)
    train_data, val_data = data[:-n_val], data[-n_val:]
    if len(train_data) < cfg.block_size + 1:
        raise ValueError(f"text: expected at least {cfg.block_size + 1 + n_val} characters for "
                         f"block_size {cfg.block_size} (a window and its shifted targets in each "
                         f"part), got {len(data)}")
    xp = resolve_backend(cfg.backend)
    init_seq, data_seq, val_seq = np.random.SeedSequence(cfg.seed).spawn(3)
    model = GPT(codec.vocab_size, cfg.block_size, cfg.d_model, cfg.n_layer, cfg.n_head,
                dropout=cfg.dropout, dtype=cfg.dtype, backend=xp,
                seed=int(init_seq.generate_state(1)[0]))
    rng = np.random.default_rng(data_seq)
    # the validation windows are drawn once, so every evaluation sees the same ones
    val_batches = [_windows(val_data, np.random.default_rng(val_seq.spawn(1)[0]), cfg.batch,
                            cfg.block_size) for _ in range(cfg.eval_batches)]
    hist = GPTHistory(n_params=model.n_params(), vocab=codec.vocab_size, train_chars=len(train_data),
                      val_chars=len(val_data))
    state = nn.adam_init(model.params)
    bar = ProgressBar(cfg.steps, "gpt", stream=stream, enabled=progress)
    start = time.perf_counter()
    for step in range(cfg.steps):
        x_h, y_h = _windows(train_data, rng, cfg.batch, cfg.block_size)
        loss, _, state = training_step(model, state, from_numpy(x_h, xp), from_numpy(y_h, xp),
                                       lr=_lr(cfg, step), max_grad_norm=cfg.max_grad_norm)
        hist.train_loss.append(loss)
        last = step == cfg.steps - 1
        if (step + 1) % cfg.eval_every == 0 or last:
            hist.val_steps.append(step + 1)
            hist.val_loss.append(evaluate(model, val_batches))
            bar.update(0, f"train {np.mean(hist.train_loss[-20:]):.3f}  val {hist.val_loss[-1]:.3f}")
        bar.update(1)
    hist.seconds = time.perf_counter() - start
    bar.close()
    return model, codec, hist


def evaluate(model: GPT, batches) -> float:
    """Mean cross-entropy (nats per character) over ``batches``, dropout off."""
    mode = model.training
    model.eval()
    xp = model.xp
    try:
        losses = [model.loss(from_numpy(x, xp), from_numpy(y, xp))[0] for x, y in batches]
    finally:
        model.train(mode)
    return float(np.mean(losses))


def generate_samples(model: GPT, codec: CharCodec, *, prompts=PROMPTS, length: int = 300,
                     temperature: float = 0.8, top_k: Optional[int] = 10, seed: int = 0) -> list:
    """``(prompt, text)`` pairs: each prompt continued by ``length`` characters.

    ``GPT.generate`` fills the context (``block_size``) with its KV caches;
    a longer sample goes on from its last ``max(1, block_size // 2)``
    characters as a new prompt (fresh caches: the learned positions start at
    0 again), and so on until ``length`` characters are generated. ``top_k``
    is capped at the vocabulary.

    A model on dask samples from a NumPy copy of itself (``save`` and ``load``:
    the parameters bit for bit): on dask each token is a graph of its own to
    build and compute, and the demo's 900 characters took minutes there.
    """
    if backend_name(model.xp) == "dask":
        with tempfile.TemporaryDirectory() as folder:
            path = os.path.join(folder, "model.npz")
            model.save(path)
            model = GPT.load(path, backend="numpy")
    out = []
    rng = np.random.default_rng(seed)
    T = model.block_size
    keep = max(1, T // 2)
    top_k = None if top_k is None else min(top_k, codec.vocab_size)
    for prompt in prompts:
        ids = codec.encode(prompt)[-keep:]  # host [L0], L0 <= T // 2 or 1
        text = prompt
        left = length
        while left > 0:
            n = min(left, T - len(ids) + 1)  # >= 1: generate feeds L0 + n - 1 <= T tokens
            gen = model.generate(from_numpy(ids[None, :], model.xp), n, temperature=temperature,
                                 top_k=top_k, seed=rng)
            new = to_numpy(gen)[0, len(ids):]
            text += codec.decode(new)
            left -= n
            ids = np.concatenate([ids, new])[-keep:]
        out.append((prompt, text))
    return out


def save_loss_plot(hist: GPTHistory, path: str, *, title: Optional[str] = None) -> str:
    """The training loss (each step, and a 50-step running mean) and the validation loss, as a PNG."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(7.0, 4.2), layout="constrained")
    ax = fig.subplots()
    steps = np.arange(1, len(hist.train_loss) + 1)
    ax.plot(steps, hist.train_loss, color="0.8", lw=0.8, label="training batch")
    w = min(50, len(hist.train_loss))
    if w > 1:
        run = np.convolve(hist.train_loss, np.ones(w) / w, mode="valid")
        ax.plot(steps[w - 1:], run, color="C0", lw=1.6, label=f"training, {w}-step mean")
    ax.plot(hist.val_steps, hist.val_loss, "o-", color="C1", ms=3.5, label="validation (held-out 10 %)")
    ax.axhline(math.log(hist.vocab), color="0.5", ls=":", lw=1, label=f"uniform, ln {hist.vocab}")
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy (nats per character)")
    ax.set_ylim(0.0, math.log(hist.vocab) + 0.3)
    ax.grid(alpha=0.3)
    ax.legend()
    ax.set_title(title or "Character-level GPT on npattn's docstrings")
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=100)
    return path


def format_summary(cfg: GPTDemoConfig, hist: GPTHistory) -> str:
    steps = len(hist.train_loss)
    return (f"{steps} steps in {hist.seconds:.1f}s ({1e3 * hist.seconds / max(steps, 1):.0f} ms/step), "
            f"{hist.n_params} parameters; final validation loss {hist.val_loss[-1]:.3f} nats/char "
            f"(uniform {math.log(hist.vocab):.3f}), training loss (last {min(steps, 50)} steps) "
            f"{np.mean(hist.train_loss[-50:]):.3f}")
