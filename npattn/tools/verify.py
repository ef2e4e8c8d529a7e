"""``npattn verify``: check your attention kernel against npattn from the command line.

::

    npattn verify package.module:function --layout bshd --dtype float16 \\
        --supports causal,window,gqa [--backward NAME | --autograd torch] \\
        [--returns-lse] [--json out.json] [--plot out.png] [--case NAME]

The target is ``module:attribute`` (an importable module) or
``path/to/file.py:attribute``; ``--backward`` and ``--adapter`` take the same
forms, or a bare attribute of the target's module (``--adapter`` also takes a
JSON mapping such as ``'{"mask": "attn_mask"}'``). It prints the table per
option and tensor, the failing cases with a hint and a command that reruns
each, and a summary line; ``--json`` writes the report for CI (``-``: to
stdout, the table then goes to stderr), ``--plot`` the picture. A progress bar
is drawn on stderr when it is a terminal.

Exit status: 0 every case passes (degenerate ones included), 1 a case fails,
2 a usage error (a target that does not load, an unknown option...).
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import importlib
import importlib.util
import json
import math
import os
import shlex
import sys
from typing import Any, Optional

from .. import verifier as VF
from ..validation import argument_names
from ..verify_cases import (MAX_HEAD_DIM, SUPPORTS, check_each_head_dim_once, check_supports,
                            packing)
from .limits import repeated_entry
from .outputs import outputs_error
from .progress import ProgressBar

__all__ = ["main", "build_parser", "load_object"]


def build_parser() -> argparse.ArgumentParser:
    tokens = ", ".join(SUPPORTS)
    p = argparse.ArgumentParser(
        prog="npattn verify",
        description="Check an attention kernel fn(q, k, v, **options) against npattn over a "
        "seeded panel of cases: out, lse and gradients against npattn's float64 reference, "
        "each within budget_factor x npattn's own error in the kernel's dtype plus a floor. "
        "Exit status 1 if a case fails, 2 on a usage error.",
    )
    p.add_argument("target", help="the kernel: module:function or path/to/file.py:function")
    p.add_argument("--layout", choices=VF.LAYOUTS, default="bhsd",
                   help="the kernel's axes: bhsd (B, H, L, D; the default), bshd (B, L, H, D, "
                        "flash-attn), bthd (JAX's B, T, N, H), thd (flash-attn's varlen: the "
                        "sequences, of different lengths, packed (total, H, D), lse (H, total_q), called with "
                        "cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k; no masks nor "
                        "segments)")
    p.add_argument("--dtype", choices=VF.DTYPES, default="float32",
                   help="dtype of the kernel's inputs (default float32); npattn's truth is "
                        "float64 whatever it is")
    p.add_argument("--supports", default="", metavar="OPT[,OPT...]",
                   help=f"the options the kernel implements, comma-separated, or 'all': {tokens} "
                        "(default: none, the base cases alone)")
    p.add_argument("--backend", choices=VF.BACKEND_NAMES, default="numpy",
                   help="the array library of the kernel's arrays (default numpy); "
                        "array_api_strict: the Array API standard alone, float32 and float64")
    p.add_argument("--device", default=None,
                   help="where the arrays live: a torch device (cpu, cuda, cuda:1), a cupy "
                        "device id, a jax PLATFORM or PLATFORM:N (cpu, gpu, gpu:1, tpu:0: "
                        "jax.devices(PLATFORM)[N]), or an array_api_strict device as Python "
                        "prints it (\"array_api_strict.Device('device1')\") (default: the "
                        "library's own, torch's cpu); not with numpy")
    p.add_argument("--align", choices=("top_left", "bottom_right"), default="top_left",
                   help="the diagonal of the window and ALiBi cases (default top_left; "
                        "flash-attn: bottom_right)")
    grads = p.add_mutually_exclusive_group()
    grads.add_argument("--backward", default=None, metavar="NAME",
                       help="the kernel's backward, named as the target is or by a bare name of "
                       "the target's module: backward(dout, *saved) -> (dq, dk, dv[, dsinks]) or "
                       "(dq, dk, dv, dmask, dsinks); fn then returns (out[, lse], *saved) "
                       "(default: none; without it or --autograd the forward alone is checked)")
    grads.add_argument("--autograd", choices=("torch", "jax"), default=None,
                       help="gradients by torch.autograd.grad or jax.vjp (default: none)")
    p.add_argument("--returns-lse", action="store_true",
                   help="fn returns (out, lse), lse (B, H, Lq) ((B, T, N) for bthd, (H, total_q) "
                        "for thd)")
    p.add_argument("--mask-grad", action="store_true", default=None,
                   help="require and check dmask, the gradient of a float mask (with --autograd "
                   "the mask requires grad); without it dmask is checked where the backward "
                   "returns one")
    p.add_argument("--lse-grad", action="store_true",
                   help="the backward takes an upstream gradient of lse: backward(dout, *saved, "
                   "dlse=...), or lse's cotangent under --autograd (needs --returns-lse)")
    p.add_argument("--adapter", default=None, metavar="JSON|NAME",
                   help="rename/drop npattn's keywords: a JSON mapping such as "
                   "'{\"mask\": \"attn_mask\", \"align\": null}', or a mapping or "
                   "callable(options) -> keywords named as --backward is (default: none, the "
                   "kernel takes npattn's keywords)")
    p.add_argument("--seed", type=int, default=0, metavar="N",
                   help="an int >= 0 that seeds every case's inputs, with the case's name "
                   "(default 0)")
    p.add_argument("--head-dims", metavar="D[,D...]",
                   help=f"the head widths the kernel takes, ints from 1 to {MAX_HEAD_DIM} each "
                        "once, e.g. 64,128: the panel's cases use them in turn as Dh, two "
                        "different ones or more with dv_ne_dk (default: the panel's own 8, 16, "
                        "32, 64)")
    p.add_argument("--budget-factor", default="2", metavar="F",
                   help="how many times npattn's own error in the dtype the kernel may make, "
                   "a number >= 1 (default 2)")
    p.add_argument("--combos", choices=("pairs", "none"), default="pairs",
                   help="cases of several options besides each option alone: pairs, and all "
                   "together (pairs, the default), or none")
    p.add_argument("--case", action="append", default=None, metavar="NAME",
                   help="run only the case of this name, as --list names it (repeatable, each "
                   "name once; default: the whole panel); a failure's rerun line uses it")
    p.add_argument("--list", action="store_true",
                   help="list the panel's cases (with --case, those), a line each: name and "
                   "shapes, and exit")
    p.add_argument("--json", default=None, metavar="PATH",
                   help="write the JSON report there ('-': stdout, the table then goes to stderr; "
                   "default: none)")
    p.add_argument("--plot", default=None, metavar="PATH",
                   help="write a PNG of error/budget per case there (needs matplotlib; "
                   "default: none)")
    p.add_argument("--no-progress", action="store_true",
                   help="draw no progress bar (one is drawn on stderr when it is a terminal)")
    return p


class UsageError(Exception):
    """A problem with the command line: exit status 2."""


def _load_file(path: str) -> Any:
    """The module of the Python file ``path`` (its folder joins ``sys.path`` first, so that
    its own imports resolve)."""
    if not os.path.isfile(path):
        raise UsageError(f"target: no such file {path!r}")
    folder = os.path.dirname(os.path.abspath(path))
    if folder not in sys.path:
        sys.path.insert(0, folder)
    # one module per file: two files of one name (a kernel's and a backward's) are two modules
    stem = "".join(c if c.isalnum() else "_" for c in os.path.splitext(os.path.basename(path))[0])
    digest = hashlib.sha1(os.path.realpath(path).encode()).hexdigest()[:12]
    name = f"npattn_verify_target_{stem}_{digest}"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise UsageError(f"target: cannot load {path!r} as a Python module")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except (Exception, SystemExit) as exc:  # sys.exit at import ended verify with status 0
        del sys.modules[name]
        raise UsageError(f"target: importing {path!r} failed: {type(exc).__name__}: {exc}") from exc
    return module


def _label(module: Any) -> str:
    """A name for ``module``: its file (absolute) for one ``_load_file`` loaded, else its name."""
    name = getattr(module, "__name__", str(module))
    if name.startswith("npattn_verify_target_") and getattr(module, "__file__", None):
        return module.__file__
    return name


def load_object(spec: str, *, base: Any = None, what: str = "target",
                base_label: Optional[str] = None) -> Any:
    """``module:attr``, ``path/file.py:attr`` or (with ``base``, a module) a bare ``attr``.
    A missing attribute is said to be missing from the file as ``spec`` spells it, or from
    ``base_label`` (how the user named ``base``; default its file or name)."""
    if ":" not in spec:
        if base is None:
            raise UsageError(f"{what}: expected module:attribute or path/to/file.py:attribute, "
                             f"got {spec!r}")
        module, attr = base, spec
        label = base_label or _label(base)
    else:
        mod_name, attr = spec.rsplit(":", 1)
        label = mod_name  # as the user typed it: relative stays relative, absolute absolute
        if mod_name.endswith(".py") or os.sep in mod_name or "/" in mod_name:
            module = _load_file(mod_name)
        else:
            try:
                module = importlib.import_module(mod_name)
            except (Exception, SystemExit) as exc:
                raise UsageError(f"{what}: cannot import {mod_name!r}: {type(exc).__name__}: "
                                 f"{exc}") from exc
    obj = module
    for part in attr.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            raise UsageError(f"{what}: {label!r} has no attribute {attr!r}") from None
    return obj


def _module_of(spec: str) -> Any:
    """The module that the target ``spec`` names."""
    mod_name = spec.rsplit(":", 1)[0]
    if mod_name.endswith(".py") or "/" in mod_name or os.sep in mod_name:
        return _load_file(mod_name)
    return importlib.import_module(mod_name)


def _adapter(text: Optional[str], base: Any, base_label: Optional[str] = None) -> Any:
    if text is None:
        return None
    if text.lstrip().startswith(("{", "[")):  # JSON, not a name ('[1]' was looked up as one)
        try:
            value = json.loads(text)
        except json.JSONDecodeError as exc:
            raise UsageError(f"--adapter: expected a JSON mapping, got {text!r} ({exc})") from None
        if not isinstance(value, dict):
            raise UsageError(f"--adapter: expected a JSON mapping, got a JSON "
                             f"{type(value).__name__}: {text!r}")
        return value
    return load_object(text, base=base, what="--adapter", base_label=base_label)


def _named(spec: Optional[str], target: str) -> Optional[str]:
    """How the report names ``--backward`` / ``--adapter`` ``spec``: as the user gave it, a bare
    attribute of the target's module with that module's part of ``target`` in front (a
    file target's path, not the name it is loaded under)."""
    if spec is None:
        return None
    return spec if ":" in spec else f"{target.rsplit(':', 1)[0]}:{spec}"


def _command(args) -> str:
    """The command line that reruns one case, with ``{case}`` for its name."""
    parts = ["npattn", "verify", args.target, "--layout", args.layout, "--dtype", args.dtype]
    if args.supports:
        parts += ["--supports", args.supports]
    for flag, value, default in (("--backend", args.backend, "numpy"),
                                 ("--device", args.device, None),
                                 ("--align", args.align, "top_left"),
                                 ("--backward", args.backward, None),
                                 ("--autograd", args.autograd, None),
                                 ("--adapter", args.adapter, None),
                                 ("--budget-factor", args.budget_factor, 2.0),
                                 ("--combos", args.combos, "pairs"),
                                 ("--head-dims", args.head_dims, None)):
        if value != default:
            parts += [flag, str(value)]
    for flag, on in (("--returns-lse", args.returns_lse), ("--mask-grad", args.mask_grad),
                     ("--lse-grad", args.lse_grad)):
        if on:
            parts.append(flag)
    parts += ["--seed", str(args.seed)]
    return " ".join(shlex.quote(p) for p in parts) + " --case {case}"


def main(argv=None) -> int:
    """Run ``npattn verify`` with ``argv``; returns the exit status."""
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # argparse's own usage errors exit 2, --help 0
        return int(exc.code or 0)
    # the current folder on sys.path while the command runs, as ``python -m`` has it (the
    # installed ``npattn`` script has its own folder there instead): module:function of a
    # module here imports either way
    here = os.getcwd()
    added = "" not in sys.path and here not in sys.path
    if added:
        sys.path.insert(0, here)
    try:
        return _run(args)
    except UsageError as exc:
        print(f"npattn verify: {exc}", file=sys.stderr)
        return 2
    finally:
        if added and here in sys.path:
            sys.path.remove(here)


#: The keywords of ``verify`` as the command's flags: its errors name the flags.
FLAGS = {name: "--" + name.replace("_", "-") for name in (
    "layout", "dtype", "supports", "backward", "autograd", "returns_lse", "mask_grad", "lse_grad",
    "backend", "device", "align", "adapter", "seed", "budget_factor", "combos", "head_dims")}
FLAGS["cases"] = "--case"


def _once(flag: str, text: str, items) -> None:
    """A ``UsageError`` naming ``flag`` and the first entry that ``items`` (the entries of the
    comma-separated ``text``) repeats (``limits.repeated_entry``)."""
    item = repeated_entry(items)
    if item is not None:
        raise UsageError(f"{flag}: expected each entry once, got {item!r} more than once in {text!r}")


def _budget_factor(text: str) -> float:
    """``--budget-factor``'s ``text`` as a float, a finite one >= 1 (``verify``'s rule), told
    as typed ('0', not 0.0)."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value >= 1.0):
        raise UsageError(f"--budget-factor: expected a finite number >= 1, got {text!r}")
    return value


def _head_dims(text: str, supports: tuple) -> tuple:
    """``--head-dims``'s ``text`` as a tuple of ints, each checked as typed ('0', not (0,)):
    ints from 1 to ``MAX_HEAD_DIM``, each once and two different ones under dv_ne_dk (the rules
    of ``verify_cases.check_head_dims``; the once rule is its ``check_each_head_dim_once``)."""
    entries = [e.strip() for e in text.split(",")]
    try:
        dims = tuple(int(e) for e in entries)
    except ValueError:
        raise UsageError(f"--head-dims: expected ints like 64,128, got {text!r}") from None
    try:
        with argument_names(FLAGS):
            check_each_head_dim_once(dims, text)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    within = f" in {text!r}" if len(entries) > 1 else ""
    for e, d in zip(entries, dims):
        if not 1 <= d <= MAX_HEAD_DIM:
            raise UsageError(f"--head-dims: expected ints from 1 to {MAX_HEAD_DIM}, got "
                             f"{e!r}{within}")
    if "dv_ne_dk" in supports and len(dims) < 2:
        raise UsageError(f"--head-dims: expected two widths or more with --supports dv_ne_dk (its "
                         f"cases take a Dv unlike Dh, both from --head-dims), got {text!r}")
    return dims


def _chosen(names: list, cases: list) -> list:
    """The cases of the panel ``cases`` that ``--case`` ``names``, each named once. A name the
    panel does not hold is told with its close matches (a typo, a reproducer's name under
    other flags) and how to list the panel's names: ``--list`` with the same flags."""
    item = repeated_entry(names)
    if item is not None:
        raise UsageError(f"--case: expected each case once, got {item!r} more than once")
    by_name = {c.name: c for c in cases}
    for name in names:
        if name not in by_name:
            maybe = VF.did_you_mean(name, by_name)
            raise UsageError(f"--case: expected a case name of this panel, got {name!r} ({maybe}"
                             f"run with --list in place of --case to list its {len(by_name)} "
                             "cases)")
    return [by_name[n] for n in names]


def _run(args) -> int:
    if args.seed < 0:
        raise UsageError(f"--seed: expected an int >= 0, got {args.seed}")
    args.budget_factor = _budget_factor(args.budget_factor)
    _once("--supports", args.supports, [t.strip() for t in args.supports.split(",") if t.strip()])
    try:
        with argument_names(FLAGS):  # check_supports names 'supports': told once, as the flag
            supports = check_supports(args.supports)
            VF.check_layout_supports(args.layout, supports, FLAGS)  # --list too
    except (ValueError, TypeError) as exc:
        raise UsageError(str(exc)) from None
    combos = args.combos == "pairs"
    head_dims = None if args.head_dims is None else _head_dims(args.head_dims, supports)
    try:
        with argument_names(FLAGS):
            cases = VF.plan(supports, align=args.align, combos=combos, head_dims=head_dims)
    except (ValueError, TypeError) as exc:
        raise UsageError(str(exc)) from None
    if args.case is not None:
        cases = _chosen(args.case, cases)
    if args.list:
        for c in cases:
            line = c.describe()
            if args.layout == "thd":  # the packed sequences' own lengths
                pack = packing(c, args.align)
                line += " sequences (Lq, Lk) " + ", ".join(f"({a}, {b})"
                                                           for a, b in zip(pack.lq, pack.lk))
            print(line)
        return 0
    if args.plot is not None and importlib.util.find_spec("matplotlib") is None:
        raise UsageError("--plot needs matplotlib: pip install matplotlib, or '.[plot]' from the "
                         "repository root")
    why = outputs_error(("--json", args.json), ("--plot", args.plot))
    if why:
        raise UsageError(why)
    # with --json - standard output holds the JSON alone: what the kernel's file prints, at
    # its import or in a case, goes to standard error
    quiet = contextlib.redirect_stdout(sys.stderr) if args.json == "-" else contextlib.nullcontext()
    with quiet:
        fn = load_object(args.target)
        base = _module_of(args.target)
        given = args.target.rsplit(":", 1)[0]  # the target's module as the user gave it
        backward = None if args.backward is None else load_object(args.backward, base=base,
                                                                    what="--backward",
                                                                    base_label=given)
        adapter = _adapter(args.adapter, base, given)
        bar = ProgressBar(len(cases), "verify", enabled=not args.no_progress, unit="case")

        def progress(done, total, name):
            bar.update(1, name)

        try:
            with argument_names({**FLAGS, "fn": "target"}):  # verify's fn is the target
                report = VF.verify(fn, layout=args.layout, dtype=args.dtype, supports=supports,
                                   backward=backward, autograd=args.autograd,
                                   returns_lse=args.returns_lse, mask_grad=args.mask_grad,
                                   lse_grad=args.lse_grad, backend=args.backend, device=args.device,
                                   align=args.align, adapter=adapter, seed=args.seed,
                                   budget_factor=args.budget_factor, combos=combos,
                                   head_dims=head_dims, cases=args.case, progress=progress,
                                   command=_command(args), target=args.target,
                                   backward_target=_named(args.backward, args.target),
                                   adapter_target=None if isinstance(adapter, dict)
                                   else _named(args.adapter, args.target), flags=FLAGS)
        except ImportError as exc:  # the library of --backend (or of --autograd) is missing
            needs = f"--backend {args.backend}" + (f", --autograd {args.autograd}" if args.autograd else "")
            raise UsageError(f"{needs}: {type(exc).__name__}: {exc}") from None
        except (ValueError, TypeError) as exc:  # its message names the flag: no class name
            raise UsageError(str(exc)) from None
        finally:
            bar.close()
    text = report.format()
    if args.json == "-":
        print(report.to_json())
        print(text, file=sys.stderr)
    else:
        print(text)
        if args.json is not None:
            with open(args.json, "w") as f:
                f.write(report.to_json())
                f.write("\n")
    if args.plot is not None:
        report.plot(args.plot)
        print(f"plot: {os.path.abspath(args.plot)}", file=sys.stderr)
    return 0 if report.ok else 1
