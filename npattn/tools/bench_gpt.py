"""``npattn bench --model gpt``: one GPT training step, npattn against the same model in torch eager.

One step is the whole loop on one batch: forward, mean cross-entropy,
backward, gradient clipping by the global norm (1.0) and an Adam update,
in float32 on the CPU. The torch model is ``npattn.gpt.GPT.to_torch()``
(torch's own ``nn.Embedding``, ``nn.TransformerEncoderLayer`` and
``nn.LayerNorm``, the same weights) with ``torch.optim.Adam`` and
``torch.nn.utils.clip_grad_norm_``. The two are timed in alternation, one
sample of each per round, so that a noisy shared machine slows both alike;
the ratio quoted is npattn's median over torch's median, with each round's
ratio listed too.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from typing import Any

import numpy as np

from .. import nn
from ..backend import from_numpy, resolve_backend
from ..gpt import GPT, training_step
from .bench import autorange, cpu_text, environment_info
from .limits import SKIP_MEMORY_CHECK, SKIP_MEMORY_CHECK_HELP, gpt_training_bytes, memory_error
from .outputs import json_output, output_error

__all__ = ["GPTBenchConfig", "make_steps", "run", "main"]


class GPTBenchConfig:
    """The benchmarked model and batch (the issue's shape by default)."""

    def __init__(self, batch=16, seq_len=128, d_model=128, n_layer=4, n_head=4, vocab=96,
                 dtype="float32", seed=0):
        self.batch, self.seq_len, self.d_model = batch, seq_len, d_model
        self.n_layer, self.n_head, self.vocab = n_layer, n_head, vocab
        self.dtype, self.seed = dtype, seed

    def asdict(self) -> dict:
        return dict(vars(self))

    def __str__(self):
        return (f"B={self.batch} L={self.seq_len} d_model={self.d_model} layers={self.n_layer} "
                f"heads={self.n_head} vocab={self.vocab} {self.dtype}")


def make_steps(cfg: GPTBenchConfig, *, torch_side: bool = True):
    """``(npattn_step, torch_step or None, model)``: closures that each run one training step."""
    xp = resolve_backend("numpy")
    model = GPT(cfg.vocab, cfg.seq_len, cfg.d_model, cfg.n_layer, cfg.n_head, dtype=cfg.dtype,
                backend=xp, seed=cfg.seed)
    rng = np.random.default_rng(cfg.seed)
    ids_h = rng.integers(0, cfg.vocab, size=(cfg.batch, cfg.seq_len))
    tgt_h = rng.integers(0, cfg.vocab, size=(cfg.batch, cfg.seq_len))
    ids, tgt = from_numpy(ids_h, xp), from_numpy(tgt_h, xp)
    torch_model = model.to_torch() if torch_side else None  # before any npattn step: same weights
    box: dict[str, Any] = {"state": nn.adam_init(model.params)}

    def npattn_step():
        _, _, box["state"] = training_step(model, box["state"], ids, tgt, lr=1e-4, max_grad_norm=1.0)

    if torch_model is None:
        return npattn_step, None, model
    import torch

    opt = torch.optim.Adam(torch_model.parameters(), lr=1e-4)
    t_ids, t_tgt = torch.from_numpy(ids_h), torch.from_numpy(tgt_h).reshape(-1)

    def torch_step():
        opt.zero_grad(set_to_none=True)
        logits = torch_model(t_ids)
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, cfg.vocab), t_tgt)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(torch_model.parameters(), 1.0)
        opt.step()

    return npattn_step, torch_step, model


def _sample(step, number: int) -> float:
    t0 = time.perf_counter()
    for _ in range(number):
        step()
    return (time.perf_counter() - t0) / number


def run(cfg: GPTBenchConfig, *, repeat: int = 7, warmup: int = 2, torch_compare: bool = True,
        out=None) -> dict:
    """Time both steps in alternation; returns the samples (ms per step) and the ratio of medians.
    The lines go to ``out`` (default: ``sys.stdout`` at the call)."""
    out = sys.stdout if out is None else out
    env = environment_info(resolve_backend("numpy"))
    print(f"npattn bench --model gpt: {cfg}; {cpu_text(env)}, {env.get('sched_affinity')} CPUs, "
          f"numpy {env['numpy']}, torch {env.get('torch')} ({env.get('torch_threads')} threads)",
          file=out)
    if isinstance(env.get("threadpools"), list):
        for p in env["threadpools"]:
            print(f"  BLAS: {p.get('internal_api')} {p.get('version')} {p.get('architecture')} "
                  f"threads={p.get('num_threads')} ({p.get('prefix')})", file=out)
    steps = make_steps(cfg, torch_side=torch_compare)
    npattn_step, torch_step, model = steps
    print(f"  model: {model.n_params()} parameters", file=out)
    sides = [("npattn", npattn_step)] + ([("torch", torch_step)] if torch_step else [])
    numbers = {}
    for name, step in sides:
        for _ in range(warmup):
            step()
        numbers[name] = autorange(step, lambda: None)
    samples: dict[str, list] = {name: [] for name, _ in sides}
    for r in range(repeat):
        for name, step in sides:
            samples[name].append(1e3 * _sample(step, numbers[name]))
        line = "  ".join(f"{n} {samples[n][-1]:8.1f} ms" for n, _ in sides)
        if torch_step:
            line += f"  ratio {samples['npattn'][-1] / samples['torch'][-1]:.2f}"
        print(f"  round {r + 1}: {line}", file=out)
    result = {"config": cfg.asdict(), "env": env, "n_params": model.n_params(),
              "numbers": numbers, "samples_ms": samples,
              "median_ms": {n: statistics.median(s) for n, s in samples.items()},
              "loadavg": list(_loadavg())}
    if torch_step:
        result["ratio"] = result["median_ms"]["npattn"] / result["median_ms"]["torch"]
        result["round_ratios"] = [a / b for a, b in zip(samples["npattn"], samples["torch"])]
        print(f"median: npattn {result['median_ms']['npattn']:.1f} ms, torch "
              f"{result['median_ms']['torch']:.1f} ms per step: ratio {result['ratio']:.2f} "
              f"(rounds {min(result['round_ratios']):.2f} .. {max(result['round_ratios']):.2f})",
              file=out)
    else:
        print(f"median: npattn {result['median_ms']['npattn']:.1f} ms per step", file=out)
    return result


def _loadavg():
    try:
        import os

        return os.getloadavg()
    except (AttributeError, OSError):
        return (float("nan"),) * 3


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        prog="npattn bench --model gpt",
        description="Time one GPT training step (forward, loss, backward, clipping, Adam) in npattn "
                    "against the same model in torch eager, alternating, on the CPU.")
    parser.add_argument("--model", choices=["gpt"], required=True,
                        help="the model whose training step is timed (required: it selects this "
                             "mode of npattn bench)")
    d = GPTBenchConfig()
    for name, help_ in (("batch", "B"), ("seq_len", "L"), ("d_model", "width"),
                        ("n_layer", "blocks"), ("n_head", "heads, a divisor of --d-model"),
                        ("vocab", "vocabulary size")):
        parser.add_argument("--" + name.replace("_", "-"), type=int, default=getattr(d, name),
                            metavar="N", help=f"{help_}, >= 1 (default {getattr(d, name)})")
    parser.add_argument("--dtype", choices=["float32", "float64"], default="float32",
                        help="dtype of the model and its step, in npattn and torch (default "
                             "float32)")
    parser.add_argument("--repeat", type=int, default=7, metavar="N",
                        help="rounds, >= 1 (default 7)")
    parser.add_argument("--warmup", type=int, default=2, metavar="N",
                        help="untimed steps of each first, >= 0 (default 2)")
    parser.add_argument("--no-torch", action="store_true", help="skip the torch side")
    parser.add_argument("--json", metavar="PATH",
                        help="write the results as JSON; '-': the JSON alone on stdout, the rest "
                             "on stderr (default: none)")
    parser.add_argument(SKIP_MEMORY_CHECK, action="store_true", help=SKIP_MEMORY_CHECK_HELP)
    # taken as `npattn bench` takes it, so one command line serves every mode
    parser.add_argument("--no-progress", action="store_true",
                        help="accepted as in npattn bench; this mode draws no progress bar")
    args = parser.parse_args(argv)
    why = output_error("--json", args.json)
    if why:
        parser.error(why)
    for name in ("batch", "seq_len", "d_model", "n_layer", "n_head", "vocab", "repeat"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')}: expected a positive integer, got {getattr(args, name)}")
    if args.warmup < 0:
        parser.error(f"--warmup: expected a non-negative integer, got {args.warmup}")
    if args.d_model % args.n_head:
        parser.error(f"--n-head: expected a divisor of --d-model {args.d_model}, got {args.n_head}")
    if not args.skip_memory_check:
        need = gpt_training_bytes(args.batch, args.seq_len, args.seq_len, args.d_model, args.n_layer,
                                  args.n_head, args.vocab, np.dtype(args.dtype).itemsize)
        names = ("batch", "seq_len", "d_model", "n_layer", "n_head", "vocab")
        flags = [f"--{n.replace('_', '-')}" for n in names]
        why = memory_error(", ".join(flags),
                           " ".join(f"{f} {getattr(args, n)}" for f, n in zip(flags, names)), need,
                           "npattn's training step: the weights with their gradients and Adam's "
                           "moments, the logits and the activations; the torch side not counted")
        if why:
            parser.error(why)
    torch_compare = not args.no_torch
    if torch_compare:
        try:
            import torch  # noqa: F401
        except ImportError:
            print("npattn bench --model gpt: torch is not installed; install its CPU build (pip install "
                  "torch==2.13.0; a plain 'pip install torch' pulls a multi-GB CUDA build) or pass "
                  "--no-torch", file=sys.stderr)
            return 2
    cfg = GPTBenchConfig(args.batch, args.seq_len, args.d_model, args.n_layer, args.n_head,
                         args.vocab, args.dtype)
    with json_output(args.json) as result:  # --json -: the JSON alone on stdout
        result.update(run(cfg, repeat=args.repeat, warmup=args.warmup, torch_compare=torch_compare))
    return 0
