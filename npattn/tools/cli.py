"""The ``npattn`` command (also ``python -m npattn``).

* ``npattn check``: audit every hand-derived gradient against finite differences;
* ``npattn demo``: train a small attention model with hand-derived gradients and save
  its pictures: ``--task reverse`` (digit reversal, the default; attention heatmaps),
  ``--task digits`` (a Transformer classifier on scikit-learn's handwritten digits) or
  ``--task gpt`` (a character-level GPT on npattn's docstrings; loss curve, samples);
* ``npattn bench``: timings (provided by ``npattn.tools.bench`` when installed);
* ``npattn verify``: check your attention kernel against npattn (``npattn.tools.verify``).

``main(argv)`` returns the exit status: 0 success, 1 a failed check, 2 a usage
error or a missing dependency.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import math
import os
import sys
import tempfile

from .. import __version__
from .limits import MAX_THREADS, SKIP_MEMORY_CHECK, SKIP_MEMORY_CHECK_HELP, repeated_entry

__all__ = ["main", "build_parser"]

BACKEND_CHOICES = ["numpy", "array_api_strict", "cupy", "torch", "dask"]
CHECK_BACKENDS = BACKEND_CHOICES + ["jax"]  # check runs JAX in x64 mode (tools.audit.run_audit)

#: ``npattn demo --task``: each task's own options (argparse dests) with their defaults.
#: An option that is some task's own but not the chosen one's is a usage error; a
#: shared option with a per-task default (``batch``, ``lr``, ``out``) is listed by
#: every task. A new task is one more entry here and one more branch in ``_demo``.
DEMO_TASKS = {
    "reverse": {"steps": 400, "seq_len": 12, "pos": "sinusoidal", "d_model": 32, "batch": 64,
                "lr": 1e-2, "out": "npattn-demo"},
    "digits": {"epochs": 20, "layers": 1, "patch": 2, "dropout": 0.1, "d_model": 32, "batch": 32,
               "lr": 1e-2, "out": "npattn-digits"},
    "gpt": {"steps": 1500, "seq_len": 64, "layers": 3, "dropout": 0.0, "d_model": 96, "batch": 32,
            "lr": 3e-3, "out": "npattn-gpt", "skip_memory_check": False},
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="npattn",
        description="Multi-head attention with hand-derived gradients: audit them, or watch "
        "them train a model.",
        epilog="Each command has its own options: npattn COMMAND --help (npattn bench --backend "
        "dask --help and npattn bench --model gpt --help for bench's other modes).",
    )
    parser.add_argument("--version", action="version", version=f"npattn {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="{check,demo,bench,verify}")

    check = sub.add_parser(
        "check",
        help="audit every backward against finite differences",
        description="Check the gradient of every primitive (linear, split/merge heads, "
        "masked softmax, dropout, sdpa), of MultiHeadAttention (inputs and every "
        "parameter), of the layers, embeddings, positions and losses around attention and "
        "of the models built of them (the Transformer blocks, GPT) against central finite "
        "differences in float64, over a fixed panel of "
        "configurations, sdpa and the module on every attention implementation the arrays "
        "take (reference and blocked; the NumPy kernel on numpy, chunked on dask). Exit "
        "status 1 if any check fails.",
    )
    check.add_argument("--backend", choices=CHECK_BACKENDS, default="numpy",
                       help="the arrays' library (default numpy); jax runs with jax_enable_x64 "
                       "switched on")
    check.add_argument(
        "--dtype", choices=["float64", "float32"], default="float64",
        help="dtype of inputs, parameters and the analytic backward (finite differences "
        "are always float64); default float64",
    )
    check.add_argument("--json", action="store_true",
                       help="print the results as JSON on stdout, in place of the table")
    check.add_argument("--no-progress", action="store_true",
                       help="no progress bar (it is shown only when stderr is a terminal)")
    _threads_option(check)
    check.set_defaults(command_parser=check)

    demo = sub.add_parser(
        "demo",
        help="train a small attention model (digit reversal, handwritten digits, or a "
        "character-level GPT), save its pictures",
        description=("Train a small model whose every gradient is derived by hand, and save its pictures "
                     "(PNG, needs matplotlib: pip install matplotlib, or '.[plot]' from the repository "
                     "root): attention heatmaps, or gpt's loss curve. --task reverse (the default): "
                     "embedding + positional encoding + multi-head self-attention + output projection, "
                     "with softmax cross-entropy and Adam, learns to reverse digit sequences. --task "
                     "digits: a TransformerClassifier (patch embedding, learned positions, Transformer "
                     "blocks, mean pooling, a linear head) learns scikit-learn's handwritten digits (pip "
                     "install scikit-learn, or '.[demo]' from the repository root: scikit-learn ships "
                     "them, nothing is downloaded). --task gpt: a character-level GPT (npattn.gpt) trained "
                     "on npattn's own docstrings, with a loss curve and generated samples. Options marked "
                     "with tasks belong to those tasks only; giving one to another task is a usage error."),
    )
    demo.add_argument("--task", choices=list(DEMO_TASKS), default="reverse",
                      help="what to train (default reverse): reverse (digit reversal), digits "
                      "(classify handwritten digits) or gpt (a character-level language model); "
                      "an option marked (TASK, ...) belongs to those tasks only")
    demo.add_argument("--heads", default="4", metavar="H[,H...]",
                      help="heads per attention layer, a divisor of --d-model; reverse and digits "
                      "also take a comma list such as 1,2,4,8, one model per count, to compare "
                      "them at the same width (default 4)")
    demo.add_argument("--steps", type=positive_int, default=None, metavar="N",
                      help="(reverse, gpt) training steps (default 400; gpt: 1500)")
    demo.add_argument("--seq-len", type=positive_int, default=None, metavar="N",
                      help="(reverse, gpt) digits per sequence (default 12); gpt: the context "
                      "length, block_size, from 2 to what the held-out text holds (default 64)")
    demo.add_argument("--pos", choices=["sinusoidal", "learned"], default=None,
                      help="(reverse) positional encoding (default sinusoidal)")
    demo.add_argument("--epochs", type=positive_int, default=None, metavar="N",
                      help="(digits) passes over the training images (default 20)")
    demo.add_argument("--layers", type=positive_int, default=None, metavar="N",
                      help="(digits, gpt) Transformer blocks (default 1; gpt: 3)")
    demo.add_argument("--patch", type=int, choices=[1, 2, 4], default=None,
                      help="(digits) side of the square pixel patches that are the tokens: "
                      "2 gives 16 tokens of 4 pixels (default 2)")
    demo.add_argument("--dropout", type=probability, default=None, metavar="P",
                      help="(digits, gpt) drop probability at every dropout site of the "
                      "blocks, in [0, 1) (default 0.1; gpt: 0)")
    demo.add_argument("--d-model", type=positive_int, default=None, metavar="N",
                      help="model width (default 32; gpt: 96)")
    demo.add_argument("--batch", type=positive_int, default=None, metavar="N",
                      help="sequences per step (default 64; digits: 32 images; gpt: 32 windows)")
    demo.add_argument("--lr", type=positive_float, default=None, metavar="RATE",
                      help="Adam learning rate, a positive finite number (default 1e-2; gpt: 3e-3)")
    demo.add_argument("--backend", choices=BACKEND_CHOICES, default="numpy",
                      help="the arrays' library (default numpy)")
    demo.add_argument("--dtype", choices=["float32", "float64"], default="float32",
                      help="dtype of the parameters and the training (default float32)")
    demo.add_argument("--seed", type=non_negative_int, default=0, metavar="N",
                      help="seed of every random draw (initial weights, batches, dropout, "
                      "digits' validation split, gpt's samples), an integer >= 0 (default 0)")
    demo.add_argument("--out", default=None, metavar="DIR",
                      help="folder for the pictures, and gpt's samples.txt (default ./npattn-demo; "
                      "digits: ./npattn-digits; gpt: ./npattn-gpt)")
    demo.add_argument("--no-plots", action="store_true",
                      help="write no pictures (gpt still writes samples.txt)")
    demo.add_argument("--no-progress", action="store_true",
                      help="no progress bar (it is shown only when stderr is a terminal)")
    demo.add_argument(SKIP_MEMORY_CHECK, action="store_const", const=True, default=None,
                      help="(gpt) " + SKIP_MEMORY_CHECK_HELP)
    _threads_option(demo)
    demo.set_defaults(command_parser=demo)

    sub.add_parser("bench", add_help=False, help="time forward/backward (npattn.tools.bench)")
    sub.add_parser("verify", add_help=False,
                   help="check your attention kernel against npattn (npattn.tools.verify)")
    return parser


def positive_int(text: str) -> int:
    """argparse type: an integer >= 1."""
    return _integer(text, 1, "a positive integer")


def thread_count(text: str) -> int:
    """argparse type: a number of threads, 1 .. MAX_THREADS."""
    value = _integer(text, 1, f"a number of threads in [1, {MAX_THREADS}]")
    if value > MAX_THREADS:
        raise argparse.ArgumentTypeError(f"expected a number of threads in [1, {MAX_THREADS}], "
                                         f"got {text!r}")
    return value


def non_negative_int(text: str) -> int:
    """argparse type: an integer >= 0."""
    return _integer(text, 0, "a non-negative integer")


def _integer(text, low, what):
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}") from None
    if value < low:
        raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}")
    return value


def probability(text: str) -> float:
    """argparse type: a drop probability, a number in [0, 1)."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not 0.0 <= value < 1.0:
        raise argparse.ArgumentTypeError(f"expected a number in [0, 1), got {text!r}")
    return value


def positive_float(text: str) -> float:
    """argparse type: a finite number > 0 (not nan, not inf)."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value > 0.0):
        raise argparse.ArgumentTypeError(f"expected a positive finite number, got {text!r}")
    return value


def _threads_option(parser):
    parser.add_argument(
        "--threads", type=thread_count, default=1, metavar="N",
        help=f"BLAS threads while it runs, and torch's own with --backend torch, in [1, "
        f"{MAX_THREADS}] (default 1: the arrays are tiny, and extra threads only contend); BLAS "
        "needs threadpoolctl, else the library's own setting is kept",
    )


@contextlib.contextmanager
def blas_threads(n, backend="numpy"):
    """Limit BLAS threads to ``n`` inside the block, when threadpoolctl is installed.

    The torch backend has its own intra-op thread pool, limited with
    ``torch.set_num_threads`` and restored afterwards.
    """
    with contextlib.ExitStack() as stack:
        try:
            from threadpoolctl import threadpool_limits

            stack.enter_context(threadpool_limits(limits=n, user_api="blas"))
        except ImportError:
            pass
        if backend == "torch":
            try:
                import torch
            except ImportError:
                pass
            else:
                before = torch.get_num_threads()
                torch.set_num_threads(n)
                stack.callback(torch.set_num_threads, before)
        yield


def main(argv=None) -> int:
    """Run the ``npattn`` command with ``argv`` (default ``sys.argv[1:]``); returns the exit status."""
    try:
        return _main(argv)
    except MemoryError as exc:  # sizes past this machine's memory: say so, without a traceback
        command = next((a for a in (sys.argv[1:] if argv is None else argv) if not a.startswith("-")),
                       "")
        print(f"npattn {command}: not enough memory for the sizes asked for "
              f"({type(exc).__name__}: {exc}); choose smaller ones", file=sys.stderr)
        return 2
    except BrokenPipeError:  # e.g. `npattn check --json | head`: stop quietly, with the status of a
        # process that SIGPIPE ended (128 + 13), not 1, which says a check failed
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 141


def _main(argv) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "bench":  # everything after "bench" belongs to npattn.tools.bench
        return _bench(argv[1:])
    if argv and argv[0] == "verify":  # and after "verify" to npattn.tools.verify
        from .verify import main as verify_main

        return verify_main(argv[1:])
    parser = build_parser()
    args, unknown = parser.parse_known_args(argv)
    if unknown:  # said by the subcommand's parser, with its usage, not by the top-level one
        getattr(args, "command_parser", parser).error(f"unrecognized arguments: {' '.join(unknown)}")
    if args.command in ("check", "demo"):
        if args.command == "demo":
            _check_demo_args(args, args.command_parser)
        with blas_threads(args.threads, args.backend):
            return _check(args) if args.command == "check" else _demo(args)
    parser.print_help()
    return 2


# --------------------------------------------------------------------------


def _backend_or_exit(name):
    """Resolve backend ``name``; on failure print why and return None."""
    from ..backend import resolve_backend

    try:
        xp = resolve_backend(name)
        if name == "cupy":
            import cupy

            cupy.cuda.runtime.getDeviceCount()
        return xp
    except Exception as exc:  # ImportError, or a CUDA runtime error without a GPU
        print(f"npattn: backend {name!r} is not usable here: {exc}", file=sys.stderr)
        return None


def _check(args) -> int:
    from .audit import format_table, panel, run_audit, summary_line
    from .progress import ProgressBar

    if _backend_or_exit(args.backend) is None:
        return 2
    checks = panel(args.backend)
    bar = ProgressBar(len(checks), "check", enabled=not args.no_progress)

    def progress(i, n, name):
        if i:
            bar.update(1)
        bar.note = name

    result = run_audit(args.backend, args.dtype, progress=progress, checks=checks)
    bar.close()
    if args.json:
        print(json.dumps(result.to_dict(), indent=2))
    else:
        print(format_table(result))
    if not result.ok and args.json:
        print(summary_line(result), file=sys.stderr)
    return 0 if result.ok else 1


def _parse_heads(text, d_model, parser: argparse.ArgumentParser):
    try:
        heads = [int(h) for h in text.split(",")]  # an empty entry ('4,' or '1,,2') is an error
    except ValueError:
        parser.error(f"--heads: expected integers separated by commas, got {text!r}")
    if any(h < 1 for h in heads):
        parser.error(f"--heads: expected positive integers, got {text!r}")
    repeated = repeated_entry(heads)
    if repeated is not None:  # the second run wrote over the first's heads{H} pictures
        parser.error(f"--heads: expected each head count once, got {repeated} more than once in {text!r}")
    bad = [h for h in heads if d_model % h]
    if bad:
        parser.error(f"--heads: expected divisors of --d-model {d_model}, got {text!r}, where "
                     f"{', '.join(map(str, bad))} {'does' if len(bad) == 1 else 'do'} not divide it")
    return heads


def _check_demo_args(args, parser):
    """The demo's checks that need several options; errors print ``npattn demo``'s usage.

    Refuses an option of another task than ``--task``, then fills in the
    task's defaults (``DEMO_TASKS``).
    """
    own = DEMO_TASKS[args.task]
    for options in DEMO_TASKS.values():
        for dest in options:
            if dest not in own and getattr(args, dest) is not None:
                flag = "--" + dest.replace("_", "-")
                owners = " and ".join(f"--task {t}" for t, o in DEMO_TASKS.items() if dest in o)
                parser.error(f"{flag}: an option of {owners}, not of --task {args.task}")
    if args.no_plots and args.out is not None and args.task != "gpt":  # gpt: samples.txt
        # a warning, not an error: a script that keeps --out and toggles --no-plots still runs
        print(f"npattn demo: warning: --out {args.out!r} is unused: with --no-plots, --task "
              f"{args.task} writes no files", file=sys.stderr)
    for dest, default in own.items():
        if getattr(args, dest) is None:
            setattr(args, dest, default)
    args.heads = _parse_heads(args.heads, args.d_model, parser)
    if args.task == "gpt" and len(args.heads) != 1:
        parser.error(f"--heads: --task gpt trains one model, expected one head count, got "
                     f"{','.join(str(h) for h in args.heads)}")
    if args.task == "gpt" and args.seq_len < 2:
        parser.error(f"--seq-len: expected at least 2 with --task gpt (a context of 2 characters or "
                     f"more), got {args.seq_len}")
    if args.task == "gpt":
        _check_gpt_demo_sizes(args, parser)


def _check_gpt_demo_sizes(args, parser):
    """``--task gpt``: a context that fits in the held-out tenth of the text, and a training step
    that fits in the host's memory (``limits.gpt_training_bytes``; not checked for CuPy, whose
    arrays live on the device, nor with ``--skip-memory-check``)."""
    from . import demo_gpt as dg
    from .limits import gpt_training_bytes, memory_error

    text = dg.corpus()
    longest = dg.longest_context(len(text))
    if args.seq_len > longest:
        parser.error(f"--seq-len: --task gpt validates on the last 10 % of its {len(text)}-character "
                     f"text, which must hold a window and its shifted targets; expected at most "
                     f"{longest}, got {args.seq_len}")
    if args.backend == "cupy" or args.skip_memory_check:  # cupy: the device's memory is its own,
        return  # as in npattn bench
    need = gpt_training_bytes(args.batch, args.seq_len, args.seq_len, args.d_model, args.layers,
                              args.heads[0], len(set(text)), 4 if args.dtype == "float32" else 8)
    why = memory_error("--batch, --seq-len, --d-model, --layers",
                       f"--batch {args.batch} --seq-len {args.seq_len} --d-model {args.d_model} "
                       f"--layers {args.layers}", need,
                       "the training step's weights with their gradients and Adam's moments, "
                       "the logits and the activations")
    if why:
        parser.error(why)


#: What each ``npattn demo --task`` writes into ``--out``, as its messages say it.
DEMO_OUTPUTS = {"reverse": "the heatmaps", "digits": "the pictures",
                "gpt": "samples.txt and the loss curve"}


def _output_folder_error(path, what: str = "the heatmaps") -> str | None:
    """Why ``what`` (the demo's files) cannot be written into folder ``path``, or None. A
    folder that is missing is made for the probe and removed again (the demo makes it when it
    writes: a failed run leaves no empty folder behind)."""
    if os.path.exists(path) and not os.path.isdir(path):
        return f"--out {path!r}: expected a folder for {what}, got an existing file"
    missing = []  # the folders the probe makes, deepest first
    folder = os.path.abspath(path)
    while not os.path.exists(folder) and os.path.dirname(folder) != folder:
        missing.append(folder)
        folder = os.path.dirname(folder)
    try:
        os.makedirs(path, exist_ok=True)
        with tempfile.TemporaryFile(dir=path):
            pass
    except OSError as exc:
        return (f"--out {path!r}: cannot write {what} there "
                f"({exc.strerror or type(exc).__name__})")
    finally:
        for made in missing:
            try:
                os.rmdir(made)
            except OSError:
                break
    return None


def _demo(args) -> int:
    if _backend_or_exit(args.backend) is None:
        return 2
    plots = _demo_plots(args)
    if plots is None:
        return 2
    if args.task == "digits":
        return _demo_digits(args, plots)
    if args.task == "gpt":
        return _demo_gpt(args, plots)
    return _demo_reverse(args, plots)


def _demo_plots(args) -> bool | None:
    """Whether the demo draws its pictures; None (after saying why) when ``--out`` is unusable."""
    from .demo import have_matplotlib

    if args.no_plots:
        return False
    if not have_matplotlib():
        print("npattn demo: matplotlib is not installed, so no pictures are saved "
              "(pip install matplotlib, or '.[plot]' from the repository root)", file=sys.stderr)
        return False
    why = _output_folder_error(args.out, DEMO_OUTPUTS[args.task])  # before training, not after
    if why is not None:
        print(f"npattn demo: {why}", file=sys.stderr)
        return None
    return True


def _demo_reverse(args, plots: bool) -> int:
    from .demo import DemoConfig, format_table, save_heatmaps, train

    heads = args.heads
    print(f"Reversing {args.seq_len}-digit sequences; d_model={args.d_model}, "
          f"{args.pos} positions, {args.steps} Adam steps of {args.batch}, lr={args.lr}, "
          f"{args.backend} {args.dtype}, seed {args.seed}")
    results = []
    for H in heads:
        cfg = DemoConfig(
            seq_len=args.seq_len, d_model=args.d_model, n_head=H, batch=args.batch,
            steps=args.steps, lr=args.lr, pos=args.pos, dtype=args.dtype,
            backend=args.backend, seed=args.seed,
        )
        model, r = train(cfg, progress=not args.no_progress)
        results.append((r, args.d_model))
        reached = "reached" if r.accuracy >= 0.95 else "below"
        print(f"heads={H}: held-out token accuracy {r.accuracy:.4f} ({reached} 95 %), "
              f"held-out loss {r.final_loss:.4f}, {r.seconds:.1f}s, {r.n_params} parameters")
        if not math.isfinite(r.final_loss):
            return _diverged(r.final_loss, args.lr)
        if plots:
            out = args.out if len(heads) == 1 else os.path.join(args.out, f"heads{H}")
            paths = save_heatmaps(model, out, seed=args.seed)
            print(f"  attention heatmaps ({len(paths)} PNG) in {os.path.abspath(out)}: "
                  + ", ".join(os.path.basename(p) for p in paths))
    if len(heads) > 1:
        print()
        print(format_table(results))
    return 0


def _demo_digits(args, plots: bool) -> int:
    from . import demo_digits as dd

    try:
        data = dd.load_digits_data(args.patch, dd.DigitsConfig().val_fraction, args.seed)
    except ImportError as exc:  # no scikit-learn
        print(f"npattn demo: {exc}", file=sys.stderr)
        return 2
    n_train, L, P = data.x_train.shape
    print(f"Handwritten digits (scikit-learn, {n_train + data.x_val.shape[0]} images of 8x8): "
          f"{n_train} training / {data.x_val.shape[0]} validation images, {L} tokens of "
          f"{args.patch}x{args.patch} pixels; d_model={args.d_model}, {args.layers} pre-norm "
          f"block(s), dropout {args.dropout}, {args.epochs} epochs of batches of {args.batch}, "
          f"Adam lr={args.lr}, {args.backend} {args.dtype}, seed {args.seed}")
    results = []
    for H in args.heads:
        cfg = dd.DigitsConfig(
            n_head=H, d_model=args.d_model, n_layers=args.layers, patch=args.patch,
            epochs=args.epochs, batch=args.batch, lr=args.lr, dropout=args.dropout,
            dtype=args.dtype, backend=args.backend, seed=args.seed,
        )
        model, r = dd.train(cfg, data, progress=not args.no_progress)
        results.append(r)
        print(f"heads={H}: validation accuracy {r.val_accuracy:.4f}, training loss "
              f"{r.train_loss:.4f}, {r.seconds_per_epoch:.2f} s/epoch, {r.n_params} parameters")
        if not math.isfinite(r.train_loss):
            return _diverged(r.train_loss, args.lr)
        if plots:
            out = args.out if len(args.heads) == 1 else os.path.join(args.out, f"heads{H}")
            paths = dd.save_attention_figures(model, data, out)
            print(f"  attention pictures ({len(paths)} PNG) in {os.path.abspath(out)}: "
                  + ", ".join(os.path.basename(p) for p in paths))
    if plots:
        path = os.path.join(args.out, "training_curves.png")
        dd.curves_figure(results).savefig(path, dpi=80)
        print(f"training loss and validation accuracy per epoch: {os.path.abspath(path)}")
    if len(args.heads) > 1:
        print()
        print(dd.format_table(results))
    return 0


def _diverged(loss: float, lr: float) -> int:
    """Say that a demo's training diverged (a loss that is not finite); the exit status, 1,
    as the GPT demo's (which also checks its weights, since it samples from them)."""
    print(f"npattn demo: training diverged (last loss {loss}): no pictures; try a smaller --lr "
          f"than {lr}", file=sys.stderr)
    return 1


def _demo_gpt(args, plots: bool) -> int:
    from . import demo_gpt as dg

    # samples.txt is written even without plots
    why = _output_folder_error(args.out, DEMO_OUTPUTS["gpt"] if plots else "samples.txt")
    if why is not None:
        print(f"npattn demo: {why}", file=sys.stderr)
        return 2
    cfg = dg.GPTDemoConfig(block_size=args.seq_len, d_model=args.d_model, n_layer=args.layers,
                           n_head=args.heads[0], batch=args.batch, steps=args.steps, lr=args.lr,
                           dropout=args.dropout, dtype=args.dtype, backend=args.backend,
                           seed=args.seed)
    text = dg.corpus()
    print(f"Character-level GPT on npattn's docstrings ({len(text)} characters, "
          f"{len(set(text))} distinct; the last 10 % held out): block_size={cfg.block_size}, "
          f"d_model={cfg.d_model}, {cfg.n_layer} blocks of {cfg.n_head} heads, dropout "
          f"{cfg.dropout}, {cfg.steps} Adam steps of {cfg.batch} windows, lr={cfg.lr} (warm-up, "
          f"cosine), clipping at {cfg.max_grad_norm}, {args.backend} {args.dtype}, seed {args.seed}")
    try:
        model, codec, hist = dg.train(cfg, text=text, progress=not args.no_progress)
    except ValueError as exc:  # a setting train refuses that the checks above let through
        # (they refuse a --seq-len too long for the text): its message names the setting
        print(f"npattn demo: {exc}", file=sys.stderr)
        return 2
    print(dg.format_summary(cfg, hist))
    params_finite = all(math.isfinite(float(model.xp.sum(p))) for p in model.params.values())
    if not (params_finite and math.isfinite(hist.train_loss[-1])):
        # NaN weights give NaN logits, which nothing can sample from
        print(f"npattn demo: training diverged (last training loss {hist.train_loss[-1]}, "
              f"{'finite' if params_finite else 'non-finite'} parameters): no samples; try a "
              f"smaller --lr than {cfg.lr}", file=sys.stderr)
        return 1
    temperature, top_k = 0.8, 10  # the samples' settings, given to generate and named in each heading
    samples = dg.generate_samples(model, codec, temperature=temperature, top_k=top_k, seed=args.seed)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "samples.txt"), "w", encoding="utf-8") as f:
        for prompt, sample in samples:
            heading = f"--- prompt {prompt!r} (temperature {temperature}, top-k {top_k}):"
            print(f"{heading}\n{sample}\n")
            f.write(f"{heading}\n{sample}\n\n")
    print(f"samples: {os.path.abspath(os.path.join(args.out, 'samples.txt'))}")
    if plots:
        path = dg.save_loss_plot(hist, os.path.join(args.out, "loss.png"))
        print(f"loss curve: {os.path.abspath(path)}")
    return 0


def _bench(rest) -> int:
    if "--model" in rest or any(a.startswith("--model=") for a in rest):
        from . import bench_gpt  # one training step of a whole model

        return int(bench_gpt.main(rest) or 0)
    try:
        bench = importlib.import_module("npattn.tools.bench")
    except ModuleNotFoundError as exc:
        if exc.name not in ("npattn.tools.bench",):
            raise
        print("npattn bench: the benchmark module npattn.tools.bench is not part of this "
              "installation", file=sys.stderr)
        return 2
    status = bench.main(rest)
    return 0 if status is None else int(status)
