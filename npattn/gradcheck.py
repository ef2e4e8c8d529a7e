"""Gradient checking by central finite differences, for npattn and your own code.

A hand-derived backward computes the vector-Jacobian product
``g_i = J_i^T dout`` for each input ``x_i`` of ``out = f(x_1, ..., x_n)``.
Equivalently, ``g_i`` is the gradient of the scalar ``L = <f(x), dout>``.
Two checks compare it with central differences of ``L`` in float64:

* **full** (small inputs): every entry,
  ``n_j = (L(x + eps e_j) - L(x - eps e_j)) / (2 eps)`` against ``g_j``;
* **vjp** (any size; JAX's ``check_vjp`` idea): a few random directions
  ``t``, ``<g, t>`` against ``(L(x + eps t) - L(x - eps t)) / (2 eps)``.

The upstream gradient ``dout`` is random normal by default, never all ones:
an all-ones ``dout`` makes the softmax gradient vanish and hides bugs.

Errors are reported per input. ``max_abs_err`` is the largest absolute
difference in full mode; in vjp mode it is that of the direction with the
largest relative error (each direction has its own scale). ``max_rel_err``
divides it by the gradient's scale: the largest ``|g_j|`` or ``|n_j|`` in full
mode, and ``sum_j |g_j t_j|`` in vjp mode (the size of the terms summed, which
a cancelling sum cannot make small). An input passes when the absolute error
is at most ``atol + rtol * scale``, in vjp mode in every direction. A
gradient whose scale is at most ``atol`` is numerically zero (``d b_k`` of
attention is, exactly: a bias added to every key shifts each score row by a
constant); its relative error is reported as 0 when the absolute error is
within ``atol`` too.

The differences are summed entry by entry of the output,
``<f(x + eps t) - f(x - eps t), dout>``, so the entries a step leaves as they
were add no rounding. By default each input's ``atol`` is the rounding floor of
its own differences, ``16 * 2**-52 * sum|out * dout| / eps`` over the entries of
``out`` that its steps move (the largest such sum among its steps; the whole
output's where they move none): what float64 rounding can make of a gradient
that is exactly zero. The report's ``atol`` is the floor of the whole output,
the largest an input's can be; an input that moves a small part of a large
output is held to its own (held to the whole output's, ``y`` of
``[1e8 x, x y^2]`` passed with a gradient 1 % wrong). An entry that depends on
an input so weakly that no step of ``eps`` changes its float64 value (below
half its ulp) counts as not moved and adds nothing to the differences: where
such entries carry a share of the gradient (``[1e12 + 1e-5 y, 1e-2 y]``: the
first entry's ``1e-5`` is lost), the check fails; pass ``atol=report.atol``,
the whole output's floor, which allows for it.

The default ``rtol = 1e-6`` lets through an error below it: a gradient
scaled by ``1 + 1e-7``, or one computed in float32 from the float64 inputs
(about 6e-8). Near 1 the differences are good to about 1e-9, so
``rtol=1e-8`` finds those. In vjp mode a direction sums every entry of an
input, so an error confined to a few entries counts in proportion to their
share: one entry of ``n`` wrong by a fraction ``r`` gives a relative error
of about ``r / n`` (one of 5120 entries 0.1 % wrong passes). "auto" takes
vjp mode past ``max_full_size`` entries; check a gradient that may be wrong
in a few entries (an edge, one masked row) in full mode, on a small case.

The function under test is called with arrays of the inputs' own backend and
device, cast to float64; the arithmetic of the differences is done on the host.

``eps`` is an absolute step, the same for every entry. Near 1 it leaves
the differences accurate to about 1e-9 relative; for inputs of size ``s``
far from 1, on which the function also varies at the scale ``s``, pass an
``eps`` of about ``1e-6 * s``, or check on rescaled inputs. Inputs near a
large offset that vary on a scale of 1 need a step in between: layer norm of
rows near 1e5 spread by 1 fails the default ``rtol`` at ``eps = 1e-6`` (the
step is rounded: ``x + eps`` is off by up to ``2**-53 * 1e5``, about 1e-11)
and at ``1e-6 * 1e5 = 0.1`` (the function bends within the step), and passes
at ``eps = 1e-4``; or subtract the offset first. At a kink (``relu`` at 0)
the central difference averages the two sides and the check fails there:
keep the inputs further than ``eps`` from it.

The arguments are checked before anything runs, and a check of nothing (no
floating input, ``wrt=[]``, only inputs without entries) is refused rather
than passed. The function is evaluated twice at the inputs before any
difference: a function whose two outputs there differ by more than
``eps * (rtol * scale + atol)``, ``scale`` the output's largest finite
magnitude and at least 1 (dropout drawn afresh on each call, say), is refused
with a ``ValueError``, since such a change would read as a wrong gradient; a
few float64 roundings of the scale are always let through.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Sequence

import numpy as np

from . import validation as V
from .backend import (backend_name, device_of, from_numpy, is_floating, isdtype, keeps_dtype, namespace,
                      to_numpy)

__all__ = ["GradcheckReport", "InputReport", "gradcheck", "gradcheck_module", "numerical_vjp", "check_vjp"]


@dataclass
class InputReport:
    """The comparison for one input."""

    name: str
    max_abs_err: float
    max_rel_err: float
    scale: float
    passed: bool
    where: Optional[tuple] = None
    """Full mode: the index of the entry with the largest absolute error, the first NaN one
    where ``max_abs_err`` is NaN (None in vjp mode, which compares whole directions, and for
    an input of no entries)."""
    atol: float = 0.0
    """The absolute tolerance this input was held to: the caller's ``atol``, or by default the
    rounding floor of the entries of the output that it moves."""


@dataclass
class GradcheckReport:
    """Per-input results of a gradient check; ``ok`` is True when all passed.

    ``rtol`` and ``atol`` are the tolerances the check ran with: an input
    passed when its ``max_abs_err <= atol + rtol * scale``, with its own
    ``InputReport.atol`` (the default ``atol`` is the floor of the whole output,
    the largest an input's own floor can be).
    """

    mode: str
    inputs: list = field(default_factory=list)
    rtol: float = 0.0
    atol: float = 0.0

    @property
    def ok(self) -> bool:
        return all(r.passed for r in self.inputs)

    def __bool__(self) -> bool:
        return self.ok

    def __getitem__(self, name: str) -> InputReport:
        for r in self.inputs:
            if r.name == name:
                return r
        raise KeyError(name)

    def __str__(self) -> str:
        lines = [f"{'input':<12} {'max abs err':>12} {'max rel err':>12} {'atol':>10}  result   "
                 f"({self.mode}: err <= atol + {self.rtol:.3g} * scale)"]
        for r in self.inputs:
            verdict = "pass" if r.passed else "FAIL"
            at = f" at {r.where}" if not r.passed and r.where is not None else ""
            lines.append(f"{r.name:<12} {r.max_abs_err:12.3e} {r.max_rel_err:12.3e} {r.atol:10.3g}  "
                         f"{verdict}{at}")
        return "\n".join(lines)


class _Float64Evaluator:
    """Evaluates ``L(x) = <f(x), dout>`` from host float64 copies of the inputs."""

    def __init__(self, f, inputs, dout_host):
        self.f = f
        self.like = _own_copies(inputs)
        self.host = [_host64(x) if _is_float_array(x) else None for x in inputs]
        self.dout = dout_host
        self.checked = False

    def output(self, host) -> np.ndarray:
        """``f`` at ``host``, a host float64 array; the first call checks that ``f`` left its
        arguments as they were (the others reuse them: ``host``'s arrays reach ``f`` uncopied)."""
        args = _on_backend(self.like, host)
        before = None if self.checked else _snapshot(args)
        out = _host64(_real_output("f", self.f(*args)))
        if before is not None:
            _check_untouched("f", "its arguments", args, before)
            self.checked = True
        return out

    def difference(self, plus, minus) -> tuple[float, float]:
        """``L(plus) - L(minus)``, summed entry by entry of ``out`` (``<out+ - out-, dout>``: the
        entries the step leaves as they were add nothing, where a difference of the two sums
        ``L`` would carry their rounding), and ``sum |out * dout|`` over the entries it moves
        (the larger ``|out|`` of the two), the size the rounding floor is taken of."""
        a, b = self.output(plus), self.output(minus)
        if a.shape != self.dout.shape:  # no broadcast: dout is the output's gradient
            raise ValueError(f"dout: expected shape {a.shape} (that of the function's output), "
                             f"got {self.dout.shape}")
        moved = a != b  # [*out.shape]; NaN != NaN: a NaN entry counts as moved
        step = np.subtract(a, b, out=np.zeros_like(a), where=moved)  # (inf - inf only where unmoved)
        size = np.multiply(np.maximum(np.abs(a), np.abs(b)), np.abs(self.dout), out=np.zeros_like(a),
                           where=moved)
        return float(np.sum(step * self.dout)), float(np.sum(size))


def _on_backend(like, host):
    """Host float64 arrays ``host`` back on the backend and device of ``like``.

    Masks, ``None`` and other non-floating inputs pass through untouched.
    """
    out = []
    for x, h in zip(like, host):
        if h is None or not _is_float_array(x):
            out.append(x)
        else:
            out.append(from_numpy(h, namespace(x), device_of(x)))
    return out


def _is_array(x) -> bool:
    if x is None:
        return False
    try:
        namespace(x)
    except TypeError:
        return False
    return True


def _own_copies(inputs) -> list:
    """``inputs`` with each array that is not floating (a mask, token ids) copied: the function
    under check gets those as they are, and one that writes into them must not reach the
    caller's (floating ones are copied to float64 anyway)."""
    return [namespace(x).asarray(x, copy=True)
            if _is_array(x) and not isinstance(x, np.generic) and not _is_float_array(x) else x
            for x in inputs]


def _snapshot(args) -> list:
    """Host copies of the arrays among ``args`` (None for the rest), for ``_check_untouched``."""
    return [_host_copy(a) if _is_array(a) else None for a in args]


def _host_copy(a) -> np.ndarray:
    return _host64(a) if _is_float_array(a) else np.asarray(to_numpy(a))


def _check_untouched(who: str, what: str, args, before, labels=None) -> None:
    """``ValueError`` when an array among ``args`` differs from its copy in ``before``: the
    function wrote into it, and the check would compare gradients at other values."""
    for i, (a, b) in enumerate(zip(args, before)):
        if b is not None and not np.array_equal(_host_copy(a), b, equal_nan=True):
            name = labels[i] if labels is not None else f"inputs[{i}]"
            raise ValueError(
                f"{who}: expected a function that leaves {what} as they are, got one that wrote "
                f"into {name}; copy an array before changing it in place (a gradient check "
                "evaluates the function many times at the same inputs)"
            )


def _is_float_array(x) -> bool:
    if x is None:
        return False
    try:
        xp = namespace(x)
    except TypeError:
        return False
    return is_floating(xp, x)


def _real(name: str, x: Any, what: str) -> Any:
    """``x``, checked: an array (or NumPy scalar) of a real dtype (a complex one's imaginary
    part would be dropped by the float64 copy; an object one holds no numbers)."""
    V.check_array(name, x)
    # NumPy's object, string and time kinds: no numbers (an extension float such as
    # ml_dtypes' bfloat16, kind 'V', is taken: the float64 copy reads it)
    if (isdtype(namespace(x), x.dtype, "complex floating")
            or getattr(x.dtype, "kind", None) in ("O", "U", "S", "M", "m")):
        raise TypeError(f"{name}: expected a real array ({what}), got dtype {V.dtype_name(x.dtype)}")
    return x


def _real_dout(dout: Any) -> Any:
    return _real("dout", dout, "the gradient of a real output")


def _real_output(name: str, out: Any) -> Any:
    """What the function under check returned: a real array (``L = <out, dout>`` is real)."""
    try:
        namespace(out)
    except TypeError:
        raise TypeError(f"{name}: expected a function returning an array, got one returning "
                        f"{V.type_name(out)}") from None
    return _real(name, out, "the output of a real function, whose imaginary part would be dropped")


def _host64(x) -> np.ndarray:
    """A host float64 copy of ``x``, cast on its own backend first where it has float64 (NumPy
    has no bfloat16 to copy torch's into)."""
    if _is_float_array(x):
        xp = namespace(x)
        if keeps_dtype(xp, xp.float64):
            x = xp.astype(x, xp.float64)
    return np.asarray(to_numpy(x), dtype=np.float64)


def numerical_vjp(f: Callable, inputs: Sequence, dout: Any, *, eps: float = 1e-6,
                  wrt: Optional[Sequence[int]] = None) -> list:
    """Central-difference estimate of ``J_i^T dout`` for each input in ``wrt``.

    Parameters
    ----------
    f : callable
        ``f(*inputs) -> out``, one array.
    inputs : sequence of arrays (or None, or non-floating arrays left alone)
    dout : array, shape of ``out``
    eps : float
        Step; the check is done in float64.
    wrt : sequence of int, optional
        Indices to differentiate; default every floating input.

    Returns
    -------
    list of NumPy float64 arrays (None for inputs not in ``wrt``), each of its
    input's shape. Costs two evaluations of ``f`` per entry.
    """
    wrt = _checked_wrt({"f": f}, inputs, eps=eps, rtol=0.0, atol=None, wrt=wrt, checking=False)
    return _differences(_Float64Evaluator(f, inputs, _host64(_real_dout(dout))), eps, wrt)[0]


def _differences(ev: _Float64Evaluator, eps: float, wrt: list) -> tuple[list, list]:
    """``numerical_vjp``'s gradients, and per input the largest ``sum |out * dout|`` over the
    entries of ``out`` that one of its steps moved (None for inputs not in ``wrt``)."""
    grads: list = [None] * len(ev.host)
    moved: list = [None] * len(ev.host)
    for i in wrt:
        base = ev.host[i]
        g = np.zeros_like(base)  # [*x_i.shape]
        moved[i] = 0.0
        for j in np.ndindex(base.shape):
            plus, minus = list(ev.host), list(ev.host)
            plus[i], minus[i] = base.copy(), base.copy()
            plus[i][j] += eps
            minus[i][j] -= eps
            d, size = ev.difference(plus, minus)
            g[j] = d / (2.0 * eps)
            moved[i] = max(moved[i], size)
        grads[i] = g
    return grads, moved


def _default_wrt(inputs):
    return [i for i, x in enumerate(inputs) if x is not None and _is_float_array(x)]


def _checked_wrt(functions: dict, inputs: Any, *, eps: Any, rtol: Any, atol: Any,
                 n_directions: Any = 1, seed: Any = 0, wrt: Any = None, checking: bool = True) -> list:
    """The arguments shared by the checks, before anything runs: a ``TypeError`` /
    ``ValueError`` naming the argument. Returns the indices of the inputs to check, at
    least one, and with ``checking`` (not for ``numerical_vjp``, whose differences of an
    empty input are just empty) one with entries: a check of nothing would pass whatever
    the gradients."""
    for name, fn in functions.items():
        if not callable(fn):
            raise TypeError(f"{name}: expected a callable, got {V.type_name(fn)}")
    if not isinstance(inputs, (list, tuple)):
        raise TypeError(f"inputs: expected a list or tuple of the function's arguments, got "
                        f"{V.type_name(inputs)}")
    V.check_number("eps", eps)  # the step: finite, > 0
    V.check_number("rtol", rtol, allow_zero=True)
    V.check_number("atol", atol, allow_zero=True, allow_none=True)
    V.check_positive_int("n_directions", n_directions)
    V.check_rng("seed", seed)
    floating = _default_wrt(inputs)
    for i in floating:  # every floating input is evaluated in float64, checked or not
        xp = namespace(inputs[i])
        if not keeps_dtype(xp, xp.float64):
            raise ValueError(
                f"inputs[{i}]: expected an array of a backend that makes float64 arrays (the "
                f"differences are taken in float64), got one of {backend_name(xp)!r}, which makes "
                "float32 instead (JAX: jax.config.update('jax_enable_x64', True) first)"
            )
    if wrt is None:
        if not floating:
            raise ValueError("inputs: expected at least one floating array to check, got none "
                             f"among {len(inputs)} input{'s' if len(inputs) != 1 else ''}")
        return _with_entries(inputs, floating) if checking else floating
    if isinstance(wrt, (str, bytes)) or not hasattr(wrt, "__iter__"):
        raise TypeError(f"wrt: expected a sequence of input indices, got {V.type_name(wrt)}")
    wrt = list(wrt)
    if not wrt:
        raise ValueError("wrt: expected at least one input index to check, got none")
    wrt = [V.check_size("wrt entry", i) for i in wrt]  # Python ints
    if len(set(wrt)) != len(wrt):  # each would be checked, and reported, twice
        raise ValueError(f"wrt: expected distinct input indices, got {wrt}")
    for i in wrt:
        if i >= len(inputs) or i not in floating:
            raise ValueError(f"wrt: expected indices of floating array inputs {floating}, got {i}")
    return _with_entries(inputs, wrt) if checking else wrt


def _with_entries(inputs: Any, wrt: list) -> list:
    """``wrt``, unless every input it names is empty: a check of no entries would pass
    whatever the gradients (a ``ValueError``)."""
    shapes = [V.shape_of(inputs[i]) for i in wrt]
    if all(math.prod(shape) == 0 for shape in shapes):
        raise ValueError(f"inputs: expected a checked input with at least one entry (a check of "
                         f"no entries passes whatever the gradients), got shapes "
                         f"{', '.join(str(sh) for sh in shapes)}")
    return wrt


def check_vjp(
    f: Callable,
    inputs: Sequence,
    grads: Sequence,
    dout: Any,
    *,
    names: Optional[Sequence[str]] = None,
    eps: float = 1e-6,
    n_directions: int = 3,
    rtol: float = 1e-6,
    atol: Optional[float] = None,
    seed: Any = 0,
    wrt: Optional[Sequence[int]] = None,
) -> GradcheckReport:
    """Random-direction check of analytic gradients ``grads`` of ``<f(*inputs), dout>``.

    For each checked input and each of ``n_directions`` random normal
    directions ``t`` compares ``<g, t>`` with
    ``(L(x + eps t) - L(x - eps t)) / (2 eps)``. Two evaluations of ``f`` per
    direction, whatever the input's size.

    Parameters
    ----------
    f : callable
        ``f(*inputs) -> out``, one array.
    inputs : sequence of arrays (or None, or non-floating arrays left alone)
    grads : sequence of arrays, each of its input's shape (None where not checked)
    dout : array, shape of ``out``
    names : sequence of str, optional
    eps : float
        The step along each direction.
    n_directions : int
    rtol : float
    atol : float, optional
        None: the error float64 rounding of ``<f(*inputs), dout>`` alone puts into a
        central difference.
    seed : int, numpy.random.SeedSequence, BitGenerator, Generator or None
    wrt : sequence of int, optional

    Returns
    -------
    GradcheckReport
    """
    wrt = _checked_wrt({"f": f}, inputs, eps=eps, rtol=rtol, atol=atol, n_directions=n_directions,
                       seed=seed, wrt=wrt)
    names = _names(names, len(inputs))
    if not isinstance(grads, (list, tuple)):
        raise TypeError(f"grads: expected a list or tuple of one gradient per input ({len(inputs)}; "
                        f"None for those not checked), got {V.type_name(grads)}")
    if len(grads) < len(inputs):  # (more are ignored: SDPAGrads has dsinks)
        raise ValueError(f"grads: expected a list or tuple of one gradient per input ({len(inputs)}; "
                         f"None for those not checked), got {len(grads)}")
    for i in wrt:
        if grads[i] is not None:
            _real(f"grads[{i}]", grads[i], "that of a real input")
    # read before f runs again: a gradient held in a buffer that f reuses is checked as it was given
    grads = [_host64(g) if i in wrt and g is not None else g for i, g in enumerate(grads)]
    rng = np.random.default_rng(seed)
    ev = _Float64Evaluator(f, inputs, _host64(_real_dout(dout)))
    out = ev.output(ev.host)
    _check_deterministic("f", out, ev.output(ev.host), eps=float(eps), rtol=float(rtol),
                         atol=None if atol is None else float(atol))
    if out.shape != ev.dout.shape:  # no broadcast: dout is the output's gradient
        raise ValueError(f"dout: expected shape {out.shape} (that of the function's output), "
                         f"got {ev.dout.shape}")
    whole = _rounding_floor(out, ev.dout, eps) if atol is None else atol  # the floor of the whole output
    report = GradcheckReport("vjp", rtol=rtol, atol=whole)
    for i in wrt:
        if grads[i] is None:
            raise ValueError(f"grads[{i}] ({names[i]}): expected a gradient (input {i} is checked), got None")
        g = _host64(grads[i])
        base = ev.host[i]
        if g.shape != base.shape:
            raise ValueError(
                f"grads[{i}] ({names[i]}): expected shape {base.shape}, got {g.shape}"
            )
        found, moved = [], 0.0  # (err, scale) per direction; the largest size the steps moved
        for _ in range(n_directions):
            t = rng.standard_normal(base.shape)  # [*x_i.shape]
            plus, minus = list(ev.host), list(ev.host)
            plus[i], minus[i] = base + eps * t, base - eps * t
            d, size = ev.difference(plus, minus)
            numeric = d / (2.0 * eps)
            with np.errstate(invalid="ignore"):  # +inf and -inf entries sum to NaN: a failure
                analytic = float(np.sum(g * t))  # that _within reports, not a NumPy warning
            found.append((abs(analytic - numeric), float(np.sum(np.abs(g * t)))))
            moved = max(moved, size)
        tol = report.atol if atol is not None else _floor_of(moved, report.atol, eps)
        worst_abs, worst_rel, worst_scale = 0.0, 0.0, 0.0
        for err, scale in found:
            rel = _relative(err, scale, tol)
            if rel >= worst_rel:
                worst_abs, worst_rel, worst_scale = err, rel, scale
        passed = all(_within(err, scale, tol, rtol) for err, scale in found)
        report.inputs.append(InputReport(names[i], worst_abs, worst_rel, worst_scale, passed, atol=tol))
    return report


def _check_deterministic(who: str, first: Any, again: Any, *, eps: float, rtol: float,
                         atol: Optional[float]) -> None:
    """``ValueError`` unless two evaluations at the same inputs agree. A change ``d`` of the output
    between evaluations moves a central difference by ``d / (2 eps)``: past
    ``eps * (rtol * scale + atol)`` (``scale`` the output's largest finite magnitude, at
    least 1) it would read as a wrong gradient, when the forward draws fresh randomness
    (dropout without a fixed keep-mask, say) and has none. A change of a few float64
    roundings of the scale (threads summing in another order) is always let through: the
    default ``atol`` already allows for that much rounding, and with ``rtol = 0`` any change
    at all was refused."""
    a, b = _host64(first), _host64(again)
    if a.shape != b.shape:
        raise ValueError(f"{who}: expected the same output for the same inputs, got shape {b.shape} "
                         f"after {a.shape}")
    same = (a == b) | (np.isnan(a) & np.isnan(b))
    if same.all():
        return
    d = np.abs(a - b)[~same]  # NaN where one of the two is NaN
    change = float(np.max(np.where(np.isnan(d), np.inf, d)))
    scale = float(np.max(np.abs(a[np.isfinite(a)]), initial=1.0))
    limit = eps * (rtol * scale + (atol or 0.0)) + 16 * 2.0**-52 * scale  # (as _rounding_floor)
    if change > limit:
        raise ValueError(
            f"{who}: expected the same output for the same inputs (finite differences need a "
            f"deterministic function), got two evaluations {change:.3g} apart (output scale "
            f"{scale:.3g}): fix what changes between calls (fresh dropout: pass a fixed "
            f"keep-mask; state it keeps, as a cache it appends to)")


def _rounding_floor(out, dout, eps: float) -> float:
    """Absolute error that float64 rounding of ``L = <out, dout>`` alone puts into a central difference."""
    return 16 * 2.0**-52 * float(np.sum(np.abs(_host64(out) * _host64(dout)))) / eps


def _floor_of(moved: float, whole: float, eps: float) -> float:
    """An input's own rounding floor: that of the entries of out its steps moved (``moved``, their
    ``sum |out * dout|``), never above the whole output's ``whole``. Where its steps moved no
    entry, the differences are exactly 0 and the gradient is zero up to the rounding of the
    backward, which the whole output's floor allows for (``d b_k`` of a deeper block's
    attention: its 0 had no floor, and a backward's 1e-17 failed)."""
    return whole if moved == 0.0 else min(16 * 2.0**-52 * moved / eps, whole)


def _within(err: float, scale: float, atol: float, rtol: float) -> bool:
    """``err <= atol + rtol * scale``, and never for an infinite gradient: an inf entry makes
    ``err`` and ``scale`` both inf, and ``inf <= inf`` holds."""
    return math.isfinite(scale) and err <= atol + rtol * scale


def _relative(err: float, scale: float, atol: float) -> float:
    """``err / scale``; a gradient of scale <= atol counts as zero (0 when err <= atol too).
    A NaN or infinite error (a NaN output, an inf gradient), or a NaN scale or atol unless
    ``err <= atol``, gives inf (inf / inf was NaN)."""
    if not math.isfinite(err):
        return math.inf
    if not scale > atol:
        return 0.0 if err <= atol else math.inf
    return err / scale


def _names(names, n):
    """One str per input (a str is not a sequence of names: 'xw' would name two inputs)."""
    if names is None:
        return [f"input{i}" for i in range(n)]
    if not isinstance(names, (list, tuple)) or not all(isinstance(a, str) for a in names):
        got = V.type_name(names) if not isinstance(names, (list, tuple)) else repr(list(names))
        raise TypeError(f"names: expected None or a list or tuple of str, one per input, got {got}")
    if len(names) != n:
        raise ValueError(f"names: expected {n} names, got {len(names)}")
    return list(names)


def gradcheck(
    forward: Callable,
    backward: Callable,
    inputs: Sequence,
    *,
    dout: Any = None,
    names: Optional[Sequence[str]] = None,
    mode: str = "auto",
    eps: float = 1e-6,
    rtol: float = 1e-6,
    atol: Optional[float] = None,
    n_directions: int = 3,
    max_full_size: int = 4096,
    seed: Any = 0,
    wrt: Optional[Sequence[int]] = None,
) -> GradcheckReport:
    """Check a ``(forward, backward)`` pair against central finite differences.

    Parameters
    ----------
    forward : callable
        ``forward(*inputs) -> (out, cache)``, the npattn contract.
    backward : callable
        ``backward(dout, cache) -> grads``: one gradient per input (a tuple,
        or a single array for a single input); ``None`` for inputs that are
        not differentiated (boolean masks, ``None``).
    inputs : sequence
        Arrays of any supported backend. Floating ones of any dtype (float32
        and float16 included) are cast to float64, on their own backend and
        device, and ``forward`` and ``backward`` are called with those: the
        check is of the float64 computation, never of float32 rounding (a
        forward that casts to float32 inside is checked with its rounding, and
        fails). Other inputs (masks, token ids, None) are passed as they are
        and not checked; so is a complex array, which is not a real floating
        one: pass its real and imaginary parts as two inputs to check it.
    dout : array, optional
        Upstream gradient; by default random normal from ``seed``.
    names : sequence of str, optional
        One name per input, for the report; default ``input0``, ``input1``, ...
    mode : {"auto", "full", "vjp"}
        "auto" uses "full" when the checked inputs hold at most
        ``max_full_size`` entries together, else "vjp".
    eps, rtol : float
        Step and relative tolerance (see the module docstring).
    atol : float, optional
        Absolute tolerance; by default the rounding floor of the differences.
    n_directions : int
        Random directions per input in vjp mode.
    max_full_size : int
        Entries of the checked inputs together up to which "auto" takes
        "full" (default 4096), an int >= 0; unused with another ``mode``.
    seed : int, numpy.random.SeedSequence, BitGenerator, Generator or None
        Seeds ``dout`` and the directions.
    wrt : sequence of int, optional
        Inputs to check; default every floating input.

    Returns
    -------
    GradcheckReport
        ``report.ok``, and per input ``max_abs_err`` and ``max_rel_err``;
        ``print(report)`` shows a table.

    Raises
    ------
    TypeError
        An argument of another type than the above (``inputs`` not a list or
        tuple, ``mode`` not a str, ``eps`` not a number, ``names`` not str,
        ...), named in the message, before ``forward`` runs; ``forward`` did
        not return a pair ``(out, cache)`` with ``out`` a real array, or
        ``backward`` a real array for a checked input.
    ValueError
        An argument out of its range (``mode`` none of the three, ``eps <= 0``,
        ``rtol < 0``, ``n_directions < 1``, ``max_full_size < 0``, ``wrt``
        empty or naming an input that is not a floating array), or no floating
        input to check, before ``forward`` runs; ``dout`` of another shape than
        the forward's ``out``;
        ``backward`` returned fewer gradients than the inputs it must cover,
        None for a checked input, or a gradient of another shape than its input;
        or two forwards at the inputs gave other outputs (each found before any
        difference is taken).

    Examples
    --------
    >>> import numpy as np
    >>> from npattn import functional as F
    >>> from npattn.gradcheck import gradcheck
    >>> rng = np.random.default_rng(0)
    >>> x, w = rng.standard_normal((2, 3, 4)), rng.standard_normal((5, 4))
    >>> gradcheck(F.linear_forward, F.linear_backward, [x, w]).ok
    True
    """
    V.check_choice("mode", mode, ("auto", "full", "vjp"))
    wrt = _checked_wrt({"forward": forward, "backward": backward}, inputs, eps=eps, rtol=rtol,
                       atol=atol, n_directions=n_directions, seed=seed, wrt=wrt)
    max_full_size = V.check_size("max_full_size", max_full_size)
    names = _names(names, len(inputs))
    if dout is not None:  # an array of a real dtype; its library and shape once out is known
        _real_dout(dout)
    # the inputs in float64, on their own backend and device (masks copied)
    ev_inputs = _on_backend(_own_copies(inputs), [_host64(x) if _is_float_array(x) else None for x in inputs])
    before = _snapshot(ev_inputs)
    out, cache = _forward_pair(forward(*ev_inputs))
    labels = [f"inputs[{i}] ({name})" for i, name in enumerate(names)]
    _check_untouched("forward", "its arguments", ev_inputs, before, labels)
    _real_output("forward", out)
    first, (out, cache) = out, _forward_pair(forward(*ev_inputs))  # the second evaluation's pair
    _check_deterministic("forward", first, _real_output("forward", out), eps=float(eps), rtol=float(rtol),
                         atol=None if atol is None else float(atol))
    rng = np.random.default_rng(seed)
    if dout is None:
        dout_host = rng.standard_normal(tuple(out.shape))  # [*out.shape]
        dout = from_numpy(dout_host, namespace(out), device_of(out))
    else:  # the caller's: an array of out's library and shape (its dtype may differ)
        V.check_array("dout", dout, namespace(out), device_of(out), where="that of the forward's out",
                      library="that of the forward's out")
        if V.shape_of(dout) != V.shape_of(out):
            raise ValueError(f"dout: expected shape {V.shape_of(out)} (that of the forward's out), "
                             f"got {V.shape_of(dout)}")
    dout_before = _host_copy(dout)
    grads = backward(dout, cache)
    _check_untouched("backward", "dout and its cache", ev_inputs, before, labels)  # via the cache
    _check_untouched("backward", "dout and its cache", [dout], [dout_before], ["dout"])
    if not isinstance(grads, (tuple, list)):
        grads = (grads,)
    missing = [i for i in wrt if i >= len(grads)]
    if missing:
        got = f"{len(grads)} gradient{'s' if len(grads) != 1 else ''}"
        raise ValueError(
            f"backward: expected one gradient per input ({len(inputs)}: "
            f"{', '.join(names)}; None for those not differentiated), returned {got} for "
            f"{len(inputs)} inputs, so {', '.join(names[i] for i in missing)} has none"
        )
    grads = list(grads) + [None] * (len(inputs) - len(grads))
    for i in wrt:  # before the differences, and in the same words for both modes
        if grads[i] is None:
            raise ValueError(f"gradient of {names[i]} (what backward returned): expected an array "
                             f"({names[i]} is checked), got None")
        _real(f"gradient of {names[i]} (what backward returned)", grads[i], "that of a real input")
        if V.shape_of(grads[i]) != V.shape_of(inputs[i]):
            raise ValueError(f"gradient of {names[i]}: expected shape {V.shape_of(inputs[i])}, "
                             f"got {V.shape_of(grads[i])}")
    # read as backward returned them, before the differences run the forward again (a gradient
    # held in a buffer that the forward reuses would be compared as the last step left it)
    grads = [_host64(g) if i in wrt else g for i, g in enumerate(grads)]

    def f(*a):
        return forward(*a)[0]

    if mode == "auto":
        total = sum(int(np.prod(inputs[i].shape)) for i in wrt)
        mode = "full" if total <= max_full_size else "vjp"
    if mode == "vjp":
        return check_vjp(
            f, ev_inputs, grads, dout, names=names, eps=eps, n_directions=n_directions,
            rtol=rtol, atol=atol, seed=rng, wrt=wrt,
        )

    numeric, moved = _differences(_Float64Evaluator(f, ev_inputs, _host64(dout)), eps, wrt)
    report = GradcheckReport("full", rtol=rtol, atol=_rounding_floor(out, dout, eps) if atol is None else atol)
    for i in wrt:
        tol = report.atol if atol is not None else _floor_of(moved[i], report.atol, eps)
        g, n = _host64(grads[i]), numeric[i]
        diff = np.abs(g - n)  # [*x_i.shape]
        err = float(np.max(diff, initial=0.0))  # NaN where an entry is NaN
        nan = np.isnan(diff)  # the entry of err: the first NaN one where err is NaN (not an inf before it)
        where = None if diff.size == 0 else tuple(int(j) for j in np.unravel_index(
            np.argmax(nan) if nan.any() else np.argmax(diff), diff.shape))
        scale = float(max(np.max(np.abs(g), initial=0.0), np.max(np.abs(n), initial=0.0)))
        rel = _relative(err, scale, tol)
        report.inputs.append(InputReport(names[i], err, rel, scale, _within(err, scale, tol, rtol), where,
                                         atol=tol))
    return report


def _forward_pair(result):
    """``(out, cache)`` from what a forward returned; a TypeError saying what was expected."""
    if not (isinstance(result, (tuple, list)) and len(result) == 2):
        if isinstance(result, (tuple, list)):
            n = len(result)
            got = f"a {V.type_name(result)} of {n} item{'s' if n != 1 else ''}"
        else:
            got = V.type_name(result)
            shape = None if isinstance(result, type) else getattr(result, "shape", None)
            if shape is not None:
                got += f" of shape {tuple(shape)}"
        raise TypeError(
            "forward: expected a function returning a pair (out, cache), the npattn "
            f"contract (out the output array, cache what backward needs), got {got}"
        )
    out, cache = result
    if isinstance(out, type) or not hasattr(out, "shape"):  # (NumPy's scalar types carry shape)
        raise TypeError(
            f"forward: expected (out, cache) with out an array, got {V.type_name(out)} as out"
        )
    return out, cache


def _self_attention_wrt(wrt: Any, n: int) -> Any:
    """``gradcheck_module``'s ``wrt``, indices of ``(query, key, value, *params)`` (``n`` in
    all), as indices of self-attention's inputs ``(x, *params)``: 0, 1 and 2 name ``x``, and
    a parameter's index moves down by 2. A ``wrt`` that is no sequence goes on to ``gradcheck``,
    whose ``TypeError`` names it."""
    if isinstance(wrt, (str, bytes)) or not hasattr(wrt, "__iter__"):
        return wrt
    wrt = [V.check_size("wrt entry", i) for i in wrt]  # Python ints
    if len(set(wrt)) != len(wrt):
        raise ValueError(f"wrt: expected distinct input indices, got {wrt}")
    for i in wrt:
        if i >= n:
            raise ValueError(f"wrt: expected indices of (query, key, value, *params), 0 to {n - 1}, "
                             f"got {i}")
    return list(dict.fromkeys(max(i - 2, 0) for i in wrt))  # x once, in the order given


def gradcheck_module(module: Any, query: Any, key: Any, value: Any, *,
                     forward_kwargs: Optional[dict] = None, **check_kwargs: Any) -> GradcheckReport:
    """Check a ``MultiHeadAttention``'s backward: the three inputs and every parameter.

    The module must hold float64 parameters (``dtype="float64"``): finite
    differences need them. With dropout active, pass a fixed keep-mask in
    ``forward_kwargs["dropout_mask"]`` so every evaluation drops the same
    entries; a ``kv_cache`` there is refused (decoding appends to the cache
    and has no backward). ``check_kwargs`` go to :func:`gradcheck` (``mode``,
    ``rtol``, ...). The arguments are checked before the first forward, and
    the module is left as it was, whether the check ran or failed: its
    parameters, the cache of its last forward, ``grads``, ``dmask`` and its
    dropout generator (``MultiHeadAttention.preserve_state``).

    Self-attention, ``query is key is value`` (one array passed three times), is checked as
    the module runs it, through its one-GEMM projection: one input ``x`` whose gradient is
    ``dquery + dkey + dvalue``. A ``wrt`` in ``check_kwargs`` indexes ``(query, key, value,
    *params)`` either way: there 0, 1 and 2 each select ``x``.

    Parameters
    ----------
    module : MultiHeadAttention
        With float64 parameters.
    query : array, shape (B, Lq, Dq)
    key : array, shape (B, Lk, Dk)
    value : array, shape (B, Lk, Dv)
        Cast to float64 by :func:`gradcheck`, as every floating input.
    forward_kwargs : dict, optional
        Keywords of every ``module.forward`` (``mask``, ``is_causal``,
        ``dropout_mask``, ...); no ``kv_cache``.
    **check_kwargs
        Keywords of :func:`gradcheck`; ``dout`` is (B, Lq, D).

    Returns
    -------
    report : GradcheckReport
        Entries ``query``, ``key``, ``value`` (``x`` alone for self-attention) and
        one per parameter name.
    """
    params: Any = getattr(module, "params", None)
    if not (callable(getattr(module, "backward", None)) and callable(module)
            and callable(getattr(module, "preserve_state", None))
            and params is not None and hasattr(params, "keys") and "w_q" in params):
        raise TypeError(f"module: expected an npattn MultiHeadAttention, got {V.type_name(module)}")
    if forward_kwargs is not None and not isinstance(forward_kwargs, dict):
        raise TypeError(f"forward_kwargs: expected None or a dict of forward's keywords, got "
                        f"{V.type_name(forward_kwargs)}")
    fk = dict(forward_kwargs or {})
    if fk.get("kv_cache") is not None:  # every evaluation would append to the caller's cache
        raise ValueError("forward_kwargs: expected the keywords of a forward that has a backward, "
                         "got 'kv_cache' (decoding appends to the cache and is forward only)")
    V.check_array("query", query)
    xp = namespace(query)
    if module.params["w_q"].dtype != xp.float64:
        raise ValueError(
            f"module: expected float64 parameters for a gradient check, got {module.params['w_q'].dtype}; "
            'construct it with dtype="float64"'
        )
    if module.training and module.dropout > 0 and fk.get("dropout_mask") is None:
        raise ValueError(
            "forward_kwargs: expected a fixed 'dropout_mask' while dropout is active "
            f"(dropout={module.dropout}, training mode), got none; pass one, or call module.eval() first"
        )
    dout = check_kwargs.get("dout")
    if dout is not None:  # out is (B, Lq, D), of query's library and device
        V.check_array("dout", dout, xp, device_of(query), where="that of query", library="that of query")
        _real_dout(dout)
        want = (*V.shape_of(query)[:-1], int(module.d_model))
        if query.ndim == 3 and V.shape_of(dout) != want:  # (a query of other axes: forward says so)
            raise ValueError(f"dout: expected shape {want} (that of the module's output (B, Lq, D)), "
                             f"got {V.shape_of(dout)}")
    pnames = list(module.params)
    start = dict(module.params)
    # one array as query, key and value: perturbed once, so the forward sees x three times
    acts, anames = ([query], ["x"]) if query is key and key is value else (
        [query, key, value], ["query", "key", "value"])
    if len(acts) == 1 and check_kwargs.get("wrt") is not None:  # wrt still reads (q, k, v, *params)
        check_kwargs["wrt"] = _self_attention_wrt(check_kwargs["wrt"], 3 + len(pnames))

    def forward(*args):
        n = len(acts)
        for name, p in zip(pnames, args[n:]):
            module.params[name] = p
        q, k, v = args[:n] * (3 // n)  # (x, x, x) or (query, key, value)
        out, _ = module.forward(q, k, v, **fk)
        return out, None

    def backward(dout, _cache):
        dq, dk, dv = module.backward(dout)
        dacts = (dq + dk + dv,) if len(acts) == 1 else (dq, dk, dv)
        return (*dacts, *[module.grads[name] for name in pnames])

    with module.preserve_state():
        return gradcheck(
            forward,
            backward,
            [*acts, *[start[n] for n in pnames]],
            names=[*anames, *pnames],
            **check_kwargs,
        )
