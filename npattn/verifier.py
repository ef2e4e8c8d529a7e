"""``npattn.verify``: check an attention kernel against npattn over a panel of cases.

``verify(fn, layout=, dtype=, supports=, ...)`` calls your attention
``fn(q, k, v, **options)`` on every case of a panel drawn from the options it
declares (``npattn.verify_cases``), compares its output, its log-sum-exp and
its gradients with npattn's, and returns a ``VerifyReport``: a table per
tensor and option, JSON, a picture, and for each failing case a hint at the
first step that went wrong and a one-line reproducer.

**How a tensor passes.** For each case the inputs are drawn in float64, rounded to the kernel's
``dtype``, and handed to three computations:

* **truth**: npattn's reference (``impl="reference"``) in float64 on the
  rounded inputs;
* **npattn in the kernel's dtype**: the same reference on the same inputs in
  ``dtype`` (float16 and bfloat16 are computed in float32 and the results
  rounded back, as npattn does);
* **the kernel**.

With ``e_npattn = max|npattn_dtype - truth|`` and ``e = max|kernel - truth|``
(over all entries), a tensor passes when::

    e <= budget = budget_factor * e_npattn + floor
    floor = FLOORS[dtype of npattn's tensor] * terms

so a kernel may be ``budget_factor`` times less accurate than npattn's own
computation in its dtype, plus a few units of rounding (``FLOORS``: 2**-40
for float64, where npattn's error is 0 by construction; 2**-20 for float32;
2**-10 for float16; 2**-7 for bfloat16; ``lse`` is float32 for
half-precision inputs, and so is its floor). ``terms`` is the size of what
the tensor sums, the largest entry of the same sums over absolute values,
as in the rounding bound of a dot product ``|fl(x.y) - x.y| <= n eps |x|.|y|``:
``|A| @ |v|`` for out, ``|A|^T @ |dout|`` for dv, ``p (|dp| + |delta|) @ |k| * scale``
for dq (and ``^T @ |q|`` for dk), ``p (|dp| + |delta|)`` summed over the
mask's broadcast axes for dmask, ``sum p_sink |delta|`` for dsinks,
``max(|lse|, 1)`` for lse (A the weights after dropout, p before; with
``lse_grad`` ``|delta|`` becomes ``|delta| + |dlse|``). A gradient that
cancels to nearly zero (dq of a row with one key is exactly zero) is still
measured against the rounding of its terms.

**The rounding of lse.** The gradients add to their floor::

    floor = FLOORS[dtype] * terms + u_lse * terms_lse

``u_lse`` the unit roundoff of lse's dtype (``lse_unit``: 2**-24 for float32,
lse's dtype for float16 and bfloat16 too; 2**-53 for float64) and
``terms_lse`` the largest entry of ``sum_i |lse_i| |g_i|``, ``g_i`` the part
of the gradient that row i's probabilities give (``lse_scales``). Why: a
FlashAttention backward saves one log-sum-exp per row, in lse's dtype, and
rebuilds ``p_ij = exp(s_ij - lse_i)`` from it. Rounding lse to its dtype
moves it by ``d_i``, ``|d_i| <= u_lse |lse_i|``, and so every rebuilt
probability of row i by the same factor ``exp(-d_i) = 1 - d_i + O(d_i^2)``;
what the backward computes from them moves with it: ``ds_ij = p_ij (dp_ij -
delta_i + dlse_i)`` by ``-d_i ds_ij``, so ``dq_i`` by exactly ``-d_i dq_i``,
``dv_j = sum_i a_ij dout_i`` by ``-sum_i d_i a_ij dout_i``, ``dk_j`` by
``-sum_i d_i ds_ij q_i * scale``, dmask by ``-d_i ds_ij`` (summed over its
broadcast axes) and ``dsinks`` by ``sum_i d_i p_sink_i (delta_i - dlse_i)``:
at most ``u_lse * terms_lse``. npattn keeps its probabilities (``p = e /
sum(e)``, a relative rounding of a few ``u`` whatever lse is) and does not
make this error, so ``budget_factor * e_npattn`` does not hold it, and the
FLOORS term (16 ``u`` of sums of the same kind, for float32) holds it only while
``|lse|`` stays under about 16: in the panel's case of scores shifted by an
offset of std 100 (``SCORE_SHIFT``; ``|lse|`` up to ~400, ``|d_i|`` up to 2.4e-5) a
correct FlashAttention kernel's dv or dq was up to 1.37x over the budget
without it. The bound takes every ``|d_i|`` at its largest and with the
worst signs, as the floor takes the rounding of a dot product, so no factor
multiplies it; ``floors=`` does not change it. It matters for float32 alone
(below 2**-40 of the terms for float64 at ``|lse| < 1e3``, far below 2**-10
for half precision). lse's own rounding is in its floor already (``FLOORS *
max(|lse|, 1)``).

**The merge of partial results.** out adds a term of the same kind, and the
gradients a second one::

    floor = FLOORS[dtype] * terms + u_lse * (terms_lse + terms_merge)

``terms_merge`` from ``merge_scales``. Why: a split-KV (flash-decoding) or
ring forward attends to each range s of the keys apart, keeps a partial
``out_s`` and ``lse_s`` in lse's dtype, and merges them: ``lse =
logsumexp_s(lse_s)``, ``out = sum_s w_s out_s``, ``w_s = exp(lse_s - lse)``.
Rounding ``lse_s`` moves it by ``d_s``, ``|d_s| <= u_lse |lse_s|``, and the
merged lse is rounded too, by ``c``, ``|c| <= u_lse |lse|``: lse moves by
``sum_t w_t d_t + c``, each ``w_s`` by ``w_s (d_s - sum_t w_t d_t - c)``, and
out by ``e = sum_s d_s w_s (out_s - out) - c out`` (to first order; ``sum_s
w_s = 1``).
With ``w_s out_s = sum_{j in s} a_j v_j`` and ``w_s = sum_{j in s} p_j``,
``w_s (out_s - out) = sum_{j in s} (a_j v_j - p_j out)``; and ``lse_s`` lies
between the score ``s_j`` of any of its keys and lse (``s_j <= lse_s <=
lse``), so ``|lse_s| <= m_j = max(|lse|, |s_j|)`` whatever the splits:
``|e_i| <= u_lse E_i``, ``E_i = sum_j m_ij |a_ij v_j - p_ij out_i| + |lse_i|
|out_i|`` (the sink counts as a key that carries no value: ``+ max(|lse_i|,
|sink|) p_sink_i |out_i|``), whose largest entry is out's ``terms_merge``. A
backward that takes this out computes ``delta_i = dout_i . out_i`` off by
``dout_i . e_i = sum_s d_s sum_{j in s} (a_ij dout_i . v_j - p_ij delta_i) -
c delta_i``, at most ``u_lse D_i``, ``D_i = sum_j m_ij |a_ij dout_i . v_j -
p_ij delta_i| + |lse_i| |delta_i|`` (and the sink's ``max(|lse_i|, |sink|)
p_sink_i |delta_i|``), and ``ds_ij`` by ``-p_ij dout_i . e_i``: dq, dk, dmask and dsinks take the
``delta`` part of their sums with ``D_i`` for ``|delta_i|`` (``merge_scales``
lists them); dv does not read out. npattn does not merge, and the FLOORS
term holds this only while ``|lse|`` stays under a few units: in the case of
shifted rows (``|lse|`` up to ~400) a correct split-KV forward
(``examples/verify/kernels.py:attention_split_kv``, 2 to 4 splits, float32
partials) was up to 1.40 budgets over in out at float32 over seeds 0..19,
and, through delta, up to 2.55 in dq with the FlashAttention backward. The
bound takes every ``|d_s|`` at its largest with the worst signs; no factor
multiplies it. lse needs nothing more: its error, ``|sum_s w_s d_s|`` and
its own rounding, is at most ``u_lse (2 |lse| + sum_j p_j |log p_j|)``
(``m_j <= |lse| + |log p_j|``); with ``sum_j p_j |log p_j| <= log n`` for n keys,
that is under its float32 floor of 16 ``u_lse max(|lse|, 1)`` while ``log n <= 16
max(|lse|, 1) - 2 |lse|``, at least 14 (at ``|lse| = 1``): for rows of fewer than
``e**14`` (about 1.2 million) keys. A kernel that does not
merge (npattn; a FlashAttention forward, which divides by its running row
sum and rounds no lse on the way) makes neither error.

**Recomputed scores.** The gradients add a third term::

    floor = FLOORS[dtype] * terms
            + u_lse * (terms_lse + terms_merge + SCORE_ROUNDINGS * terms_scores)

``terms_scores`` from ``score_scales``. Why: a FlashAttention backward
recomputes each score ``s_ij = scale * q_i . k_j`` and takes ``p_ij =
exp(s_ij - lse_i)`` against the lse that its forward summed from scores of its
own. Where the two compute the dot product in another order (other tile
shapes, a split-KV forward's ranges of keys, a BLAS whose kernels differ with
the shape) they round it otherwise: the scores differ by ``e_ij``, and each
rebuilt ``p_ij``, with what the backward computes from it, moves by the factor
``1 - e_ij``, as under the rounding of lse but entry by entry. Each rounding
is a few units of ``t_ij = scale * |q_i| . |k_j|``, the sum of absolute values
the dot product rounds in: float32 products of head width 8 to 256 were up to
5.8 ``u t_ij`` from the exact, and two orders of the same product up to 7.6
apart. ``SCORE_ROUNDINGS`` (8) takes ``|e_ij| <= 8 u_lse t_ij`` (lse's dtype
is the one the scores are computed in), and ``terms_scores`` is the largest
entry of ``sum t_ij |g_ij|``, ``g_ij`` the part of the gradient that ``p_ij``
gives, summed as the gradient sums (``ds_ij k_j * scale`` over j for dq_i,
``a_ij dout_i`` and ``ds_ij q_i * scale`` over i and the group for dv_j and
dk_j, ``ds_ij`` over the broadcast axes for dmask; under softcap c, dq and dk
times ``1 + 2 / c``, for the factor ``tanh'`` they take moves too). dsinks
gets none: the sink's logit is no dot product, and ``delta = dout . out`` is
taken from the forward's out, as FlashAttention-2 does (a backward that sums
delta from its rebuilt p moves it too). npattn's softmax, and a forward's,
divide by the row sum of the very scores they rounded, so the p-weighted mean
of a row's roundings cancels; a backward against a saved lse has no such sum.
The term matters where ``t_ij`` is large, in the case of shifted rows (``|s|``
up to ~400): there the example's split-KV forward computes its scores in
ranges of keys and its backward in tiles, and with OpenBLAS's Haswell kernels,
whose float32 products round with the shape of the product, about 16% of those
scores differed, and without the term it failed on 3 of seeds 0..19 with 3
splits (dq up to 1.02 budgets, dv up to 1.09), where with the SkylakeX kernels
they agreed bit for bit; a kernel whose forward sums the head axis in reverse
failed on 6 of 20 (8 of 20 with the SkylakeX kernels; dv up to 2.25 budgets).
With the term both pass on seeds 0..19 under either kernel, at 0.21 budgets at
worst. The bound takes every ``e_ij`` at the largest rounding measured (not a
proven bound: that grows with the head width) with the worst signs, and is
taken whether or not a kernel recomputes: at float32 it raises the budgets of
dq and dk by a factor of 1.75 in the median case of the panel, dv's by 2.3 and
dmask's by 1.5 (in the shifted case dq's up to 8.7, dk's 5.0 and dv's 15.8;
the largest rises are dq's 10.5 and dk's 11.0, in a case with softcap and
scale, and dmask's 3.3); the mistakes of ``examples/verify/kernels.py`` are
still told. At float64 and float16 the budgets move little (median 1.002 and
1.001 over the panel at seed 0, the largest rise 1.24 and 1.08, in the shifted
case).

A tensor that passes is reported **degenerate** instead when the check could
not have told a wrong kernel from a right one:

* its truth is smaller than ``DEGENERATE_RATIO`` (10) budgets, so even a zero
  tensor would come close to passing; or
* (``dq``, ``dk``, ``dmask``, ``dsinks``) the softmax is saturated: in more
  than half the attended rows one key takes more than 0.999 of the weight,
  and the softmax gradient that these tensors go through vanishes.

The tensors are ``out``, ``lse`` (with ``returns_lse=True``), ``dq``, ``dk``,
``dv``, ``dmask`` (with a float mask) and ``dsinks`` (with sinks), the last
five when gradients are given (``backward=`` or ``autograd=``). ``lse`` is
not compared on rows with nothing to attend: npattn writes ``-inf`` there,
flash-attn ``+inf``.

**dmask** is the gradient with respect to the additive float mask, in the
mask's shape as given (summed over the axes it was broadcast along), npattn's
``SDPAGrads.dmask``. It is compared on the mask's finite entries only (both
sides are zero where the mask is ``-inf``; what a kernel writes there is
ignored). With ``mask_grad=None`` (the default) it is compared where the
backward returns one and skipped where it returns none; ``mask_grad=True``
requires it (``autograd=``: the mask is then a leaf that requires grad);
``False`` never compares it.

**dlse.** With ``lse_grad=True`` (and ``returns_lse=True``) the gradients are
those of ``sum(out * dout) + sum(lse * dlse)``: a random normal ``dlse``
(B, Hq, Lq) in the layout of lse, zero on the rows whose lse is not finite,
is passed as ``backward(dout, *saved, dlse=dlse)``, as the cotangent of lse
under autograd, and to npattn's ``sdpa_backward(dout, cache, dlse=dlse)``.
Its values are exact in ``dtype``; it is float32 for float16 and bfloat16
(the dtype of their lse), else ``dtype``.

Shape legend: B batch, Hq query heads, Hkv key/value heads, Lq/Lk query/key
lengths, Dh key width, Dv value width.
"""

from __future__ import annotations

import json
import math
import numbers
import shlex
import time
import traceback
import types
import warnings
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Iterable, Iterator, Mapping, Optional

import numpy as np

from . import attention as A
from .backend import backend_name, is_array, resolve_backend, to_numpy
from .validation import (ALIGNS, check_choice, check_size, described, dtype_name, real_text,
                         real_value, type_name)
from .verify_cases import (OPTION_KEYWORDS, Case, CaseInputs, Packing, case_inputs,
                           check_head_dims, check_supports, conflicts, did_you_mean, packing, panel)

__all__ = [
    "verify",
    "VerifyReport",
    "CaseResult",
    "TensorResult",
    "FLOORS",
    "DTYPES",
    "LAYOUTS",
    "TENSORS",
    "DEGENERATE_RATIO",
    "FLOOR_SCALE",
    "plan",
    "did_you_mean",
    "term_scales",
    "lse_scales",
    "lse_unit",
    "merge_scales",
    "score_scales",
    "SCORE_ROUNDINGS",
    "round_to_bfloat16",
    "case_hint",
    "panel_hints",
    "near_miss",
    "MISS_SEPARATION",
    "plot_report",
]

#: Relative rounding floor of a tensor, by the dtype of npattn's tensor in the kernel's dtype.
FLOORS = {"float64": 2.0**-40, "float32": 2.0**-20, "float16": 2.0**-10, "bfloat16": 2.0**-7}
DTYPES = tuple(FLOORS)
#: "bhsd": (B, H, L, D), torch's; "bshd": (B, L, H, D), flash-attn's, lse (B, H, Lq);
#: "bthd": JAX's (B, T, N, H), the same axes as "bshd", lse (B, T, N); "thd": flash-attn's
#: varlen kernels, B sequences of different lengths packed one after another, (total, H, D),
#: lse (H, total_q) (``npattn.verify_cases.packing``).
LAYOUTS = ("bhsd", "bshd", "bthd", "thd")
#: The options that a varlen kernel cannot take with its sequences packed (layout "thd"):
#: they are arrays over the batch's (Lq, Lk) grid, which the packed form does not have.
UNPACKED_OPTIONS = ("mask_bool", "mask_float", "segments")
TENSORS = ("out", "lse", "dq", "dk", "dv", "dmask", "dsinks")
#: The gradients, in the order of npattn's ``SDPAGrads`` (the forward's inputs).
GRADS = ("dq", "dk", "dv", "dmask", "dsinks")
#: The tensors that go through the softmax's gradient (degenerate when it is saturated).
SOFTMAX_GRADS = ("dq", "dk", "dmask", "dsinks")
#: The smallest ``terms`` a floor is relative to (an all-zero tensor still has a floor).
FLOOR_SCALE = 1e-6
#: The tensors whose floor holds the rounding of lse (module docstring): the gradients, which
#: a FlashAttention backward computes from probabilities rebuilt from the saved lse, and out,
#: which a split-KV forward merges from partial results through their lse.
LSE_ROUNDED = ("out",) + GRADS
#: How many units of the scores' dtype a recomputed score may differ from the forward's by,
#: relative to ``scale * |q_i| . |k_j|`` (module docstring, "Recomputed scores"): two orders
#: of one float32 dot product were measured up to 7.6 units apart, head widths 8 to 256.
SCORE_ROUNDINGS = 8.0
#: A tensor whose largest truth entry is below this many budgets is degenerate.
DEGENERATE_RATIO = 10.0
#: The softmax is saturated when more than SATURATED_ROWS of the attended rows put more
#: than SATURATED_WEIGHT on one key.
SATURATED_WEIGHT = 0.999
SATURATED_ROWS = 0.5
AUTOGRADS = (None, "torch", "jax")
LIBRARIES = ("numpy", "torch", "cupy", "jax")
#: The names ``backend=`` takes (the module of any other Array API namespace is taken too).
BACKEND_NAMES = LIBRARIES + ("array_api_strict",)


# --------------------------------------------------------------------------
# results


@dataclass
class TensorResult:
    """One tensor of one case.

    ``error`` is ``max|kernel - truth|`` (inf for a NaN, a wrong shape or a
    missing tensor), ``npattn_error`` npattn's own in the kernel's dtype,
    ``floor`` and ``budget`` as in the module docstring, ``magnitude`` is
    ``max|truth|``; ``status`` is "pass", "fail" or "degenerate", ``note``
    why (a wrong shape, NaN, a saturated softmax...).
    """

    name: str
    error: float
    budget: float
    npattn_error: float
    floor: float
    magnitude: float
    status: str
    note: str = ""
    #: where a failing tensor is wrong: how many entries are over budget, the worst one's
    #: index (named axes, (B, H, L, D) whatever the layout) and the rows (queries or keys)
    where: str = ""

    @property
    def ratio(self) -> float:
        """``error / budget``: at most 1 passes."""
        if self.budget > 0.0:
            return self.error / self.budget
        return 0.0 if self.error == 0.0 else math.inf

    def to_dict(self) -> dict:
        return {"error": _num(self.error), "budget": _num(self.budget), "ratio": _num(self.ratio),
                "npattn_error": _num(self.npattn_error), "floor": _num(self.floor),
                "magnitude": _num(self.magnitude), "status": self.status, "note": self.note,
                "where": self.where}


@dataclass
class CaseResult:
    """One case: its tensors, or the exception ``fn`` raised; the hint and the reproducer."""

    case: Case
    tensors: dict = field(default_factory=dict)
    error: Optional[str] = None
    hint: str = ""
    reproducer: str = ""
    seconds: float = 0.0
    traceback: str = ""  # where fn (or backward) raised: the traceback, as Python prints it
    #: the inputs the kernel wrote into (q, k, ..., an option's name): the case fails whatever
    #: its tensors' numbers
    written: list = field(default_factory=list)
    #: layout "thd": the (Lq_b, Lk_b) of each packed sequence; None in the other layouts
    sequences: Optional[list] = None

    @property
    def raised_at(self) -> str:
        """The innermost frame of ``traceback`` (``file:line in function``), or ''."""
        frames = [line.strip() for line in self.traceback.splitlines()
                  if line.strip().startswith("File ")]
        if not frames:
            return ""
        # 'File "path", line N, in name' -> 'path:N in name'
        head = frames[-1][len("File "):]
        path, _, rest = head.partition(", line ")
        line_no, _, func = rest.partition(", in ")
        return f"{path.strip(chr(34))}:{line_no} in {func}"

    @property
    def status(self) -> str:
        """"fail" (an exception or a failing tensor), "degenerate" (one tensor is), or "pass"."""
        if self.error is not None or any(t.status == "fail" for t in self.tensors.values()):
            return "fail"
        if any(t.status == "degenerate" for t in self.tensors.values()):
            return "degenerate"
        return "pass"

    @property
    def failing(self) -> list:
        """Names of the failing tensors (all of them when ``fn`` raised)."""
        return [n for n, t in self.tensors.items() if t.status == "fail"]

    def to_dict(self) -> dict:
        c = self.case
        return {"name": c.name, "options": list(c.options), "description": c.describe(),
                "shapes": {"B": c.B, "Hq": c.Hq, "Hkv": c.Hkv, "Lq": c.Lq, "Lk": c.Lk,
                           "Dh": c.Dh, "Dv": c.Dv},
                "status": self.status, "error": self.error, "hint": self.hint,
                "written": list(self.written),
                "sequences": None if self.sequences is None else [list(x) for x in self.sequences],
                "traceback": self.traceback or None,
                "reproducer": self.reproducer, "seconds": round(self.seconds, 4),
                "tensors": {n: t.to_dict() for n, t in self.tensors.items()}}


def _unmeasured(t: TensorResult) -> bool:
    """Whether ``t`` has no numbers: ``fn`` raised, or what it returned could not be read."""
    return t.note == "raised"


def _wrong_type(t: TensorResult) -> bool:
    """Whether ``t`` fails for its dtype or array library (its numbers may be right)."""
    return t.note.startswith(("dtype:", "library:"))


def _failed_as(r: CaseResult) -> str:
    """How the failing cases' list sums up a failing case: its failing tensors with their
    ratios, or what failed where a ratio does not tell it (an error, a wrong shape, dtype or
    library, NaN, a write into the inputs)."""
    if r.error is not None and r.failing and all(r.tensors[n].note == "raised" for n in r.failing):
        return "raised" if r.traceback else "what it returned could not be read"
    parts = []
    for n in r.failing:
        t = r.tensors[n]
        if math.isfinite(t.ratio) and t.ratio > 1.0 and not _wrong_type(t):
            parts.append(f"{n} {t.ratio:.3g}x")
        else:  # "shape: expected ...": the note's head; "3 NaN/inf entries" whole
            parts.append(f"{n} ({t.note.split(':')[0] if t.note else 'fails'})")
    if r.written:
        parts.append(f"wrote into {', '.join(r.written)}")
    if r.written and not r.failing:
        parts.append("its numbers pass")
    return ", ".join(parts) or "fails"


def _num(x: float) -> Any:
    """A float for JSON: finite as is, else the string 'inf', '-inf' or 'nan'."""
    x = float(x)
    return x if math.isfinite(x) else str(x)


@dataclass
class VerifyReport:
    """What ``verify`` found. ``ok``: no case failed (degenerate ones do not fail).

    ``str(report)`` is the table, the failing cases with their hints and
    reproducers, and a summary line; ``to_dict()`` / ``to_json()`` the same for
    CI; ``plot(path)`` the picture (needs matplotlib).
    """

    config: dict
    results: list
    #: verify's ``flags``: the summary names the command's flags, not the keywords
    flags: Optional[Mapping] = field(default=None, repr=False)

    @property
    def ok(self) -> bool:
        return all(r.status != "fail" for r in self.results)

    @property
    def failures(self) -> list:
        """The failing case results (``CaseResult`` objects)."""
        return [r for r in self.results if r.status == "fail"]

    def table_rows(self) -> list:
        """One row per option (cases holding it; "(none)" for none) and tensor: cases,
        failures, degenerate ones, and the worst ratio with its error and budget.

        A case whose kernel wrote into its inputs fails in each of its rows, its tensors'
        numbers right or not (``wrote``: how many such cases a row counts); ``wrong_type``
        counts the tensors that fail for their dtype or array library, whatever their error;
        ``raised`` the cases with no numbers (``fn`` raised, or what it returned could not be
        read), which the worst ratio is taken without where a case has numbers."""
        groups: dict = {}
        for r in self.results:
            for opt in (r.case.options or ("(none)",)):
                groups.setdefault(opt, []).append(r)
        rows = []
        for opt in sorted(groups, key=lambda o: (o != "(none)", o)):
            for t in TENSORS:
                items = [(r, r.tensors[t]) for r in groups[opt] if t in r.tensors]
                if not items:
                    continue
                measured = [it for it in items if not _unmeasured(it[1])]
                worst_r, worst = max(measured or items, key=lambda it: (it[1].ratio, it[1].error))
                n_fail = sum(1 for r, x in items if x.status == "fail" or r.written)
                n_deg = sum(1 for r, x in items if x.status == "degenerate" and not r.written)
                n_wrote = sum(1 for r, _ in items if r.written)
                n_type = sum(1 for _, x in items if x.status == "fail" and _wrong_type(x))
                rows.append({"option": opt, "tensor": t, "cases": len(items), "failed": n_fail,
                             "degenerate": n_deg, "wrote": n_wrote, "wrong_type": n_type,
                             "raised": len(items) - len(measured),
                             "worst_case": worst_r.case.name,
                             "error": worst.error, "budget": worst.budget, "ratio": worst.ratio,
                             "status": "FAIL" if n_fail else "pass"})
        return rows

    def table(self) -> str:
        """The table per option and tensor, as text."""
        head = (f"{'option':<20} {'tensor':<7} {'cases':>5} {'worst err':>10} {'budget':>10} "
                f"{'ratio':>8}  status")
        lines = [head, "-" * len(head)]
        for row in self.table_rows():
            status = f"FAIL {row['failed']}/{row['cases']}" if row["failed"] else "pass"
            if row["wrote"]:
                status += f" ({row['wrote']} wrote into its inputs)"
            if row["wrong_type"]:
                status += f" ({row['wrong_type']} of another dtype or library)"
            if row["degenerate"]:
                status += f" ({row['degenerate']} degenerate)"
            if row["raised"]:
                status += f" ({row['raised']} raised or unreadable)"
            numbers = (f"{'-':>10} {'-':>10} {'-':>8}" if row["raised"] == row["cases"] else
                       f"{row['error']:>10.2e} {row['budget']:>10.2e} {row['ratio']:>8.3g}")
            lines.append(f"{row['option']:<20} {row['tensor']:<7} {row['cases']:>5} {numbers}  {status}")
        return "\n".join(lines)

    def hints(self) -> list:
        """Hints across the panel: the option every failing case holds, the commonest case hint."""
        return panel_hints(self.results)

    def summary(self) -> str:
        """One line: cases passed, failed and degenerate."""
        n = len(self.results)
        n_fail = len(self.failures)
        n_deg = sum(1 for r in self.results if r.status == "degenerate")
        c = self.config
        what = "out" + (", lse" if c.get("returns_lse") else "") + \
            (", gradients" if c.get("gradients") else
             f" (no gradients: give {_setting('backward', ..., self.flags)} or "
             f"{_setting('autograd', ..., self.flags)})")
        if c.get("lse_grad"):
            what += " with dlse"
        n_mask = sum(1 for r in self.results if "mask_float" in r.case.options)
        if c.get("gradients") and n_mask:
            n_dmask = sum(1 for r in self.results if "dmask" in r.tensors)
            if n_dmask:
                what += f", dmask in {n_dmask}/{n_mask} float-mask cases"
            elif c.get("mask_grad") is False:
                what += ", no dmask (mask_grad=False)"
            else:
                what += (f", no dmask (none given; {_setting('mask_grad', True, self.flags)} "
                         f"requires it)")
        verdict = "FAILED" if n_fail else "passed"
        return (f"{c.get('target', 'fn')}: {verdict}: {n - n_fail}/{n} cases pass ({n_deg} with a "
                f"degenerate tensor), {what}; {c.get('layout')} {c.get('dtype')} on "
                f"{c.get('backend')}, seed {c.get('seed')}, budget {c.get('budget_factor')} x npattn "
                f"+ floor")

    def format(self, *, max_failures: int = 20) -> str:
        """The table, the failing cases (hint and reproducer each) and the summary.

        Parameters
        ----------
        max_failures : int
            Failing cases shown in full; the others are counted in one line (the JSON
            has them all). Default 20, as ``str(report)``.

        Returns
        -------
        str
            Also the degenerate cases, between the failing ones and the summary.
        """
        parts = [self.table()]
        fails = self.failures
        if fails:
            parts.append("")
            parts.append(f"failing cases ({len(fails)}):")
            for r in fails[:max_failures]:
                bad = _failed_as(r)
                parts.append(f"  {r.case.describe()}: {bad}")
                if r.sequences is not None:
                    pairs = ", ".join(f"({a}, {b})" for a, b in r.sequences)
                    parts.append(f"    sequences (Lq, Lk): {pairs}")
                if r.error:
                    parts.append(f"    error: {r.error}")
                if r.raised_at:
                    parts.append(f"    at: {r.raised_at}")
                for n in r.failing:
                    if r.tensors[n].where:
                        parts.append(f"    where: {n}: {r.tensors[n].where}")
                parts.append(f"    hint: {r.hint}")
                parts.append(f"    rerun: {r.reproducer}")
            if len(fails) > max_failures:
                parts.append(f"  ... and {len(fails) - max_failures} more (see the JSON)")
            hints = self.hints()
            if hints:
                parts.append("")
                parts.extend(f"hint: {h}" for h in hints)
        deg = [r for r in self.results if r.status == "degenerate"]
        if deg:
            parts.append("")
            parts.append("degenerate (passed, but could not tell right from wrong):")
            for r in deg:
                d = [f"{n} ({t.note})" for n, t in r.tensors.items() if t.status == "degenerate"]
                parts.append(f"  {r.case.name}: {', '.join(d)}")
        parts.append("")
        parts.append(self.summary())
        return "\n".join(parts)

    __str__ = format

    def to_dict(self) -> dict:
        rows = [{**row, "error": _num(row["error"]), "budget": _num(row["budget"]),
                 "ratio": _num(row["ratio"])} for row in self.table_rows()]
        return {"ok": self.ok, "config": self.config, "floors": dict(FLOORS),
                "degenerate_ratio": DEGENERATE_RATIO, "summary": self.summary(),
                "n_cases": len(self.results), "n_failed": len(self.failures),
                "n_degenerate": sum(1 for r in self.results if r.status == "degenerate"),
                "hints": self.hints() if not self.ok else [], "table": rows,
                "cases": [r.to_dict() for r in self.results]}

    def to_json(self, **kw: Any) -> str:
        return json.dumps(self.to_dict(), indent=kw.pop("indent", 2), **kw)

    def plot(self, path: str) -> str:
        """Save the error/budget picture to ``path`` (PNG); see ``plot_report``.

        Parameters
        ----------
        path : str

        Returns
        -------
        str
            ``path``.

        Raises
        ------
        ImportError
            Without matplotlib.
        """
        return plot_report(self, path)


# --------------------------------------------------------------------------
# hints: the first step that went wrong


def _constant_factor(got: np.ndarray, truth: np.ndarray) -> Optional[float]:
    """``c`` when ``got`` is ``c * truth`` to 1 % of its size and ``c`` is not 1, else None."""
    tt = float(np.sum(truth * truth))
    if not (np.all(np.isfinite(got)) and tt > 0.0):
        return None
    c = float(np.sum(got * truth)) / tt
    resid = float(np.max(np.abs(got - c * truth)))
    if abs(c - 1.0) > 1e-3 and resid <= 1e-2 * max(float(np.max(np.abs(got))), 1e-300):
        return c
    return None


def case_hint(case: Case, tensors: dict, factors: dict, notes: dict, *,
              lse_grad: bool = False, miss: str = "") -> str:
    """The likeliest first failing step of one case, from which of its tensors fail.

    ``factors`` maps a failing tensor to the constant it is off by, when it is
    (``_constant_factor``); ``notes`` to what went wrong with it (NaN, shape);
    ``lse_grad``: the backward was given a ``dlse``; ``miss``: the common mistake that the
    failing out (or lse) is exactly (``near_miss``), which the hint then names.
    """
    bad = {n for n, t in tensors.items() if t.status == "fail"}
    opts = set(case.options)
    # ds = p * (dp - delta), plus dlse with lse_grad
    ds = "p * (dp - delta + dlse)" if lse_grad else "p * (dp - delta)"
    for n in TENSORS:
        note = notes.get(n, "")
        if n in bad and "NaN" in note and "empty" in note:
            return (f"{n} has NaN on rows with nothing to attend, where npattn gives zeros: guard "
                    "fully masked rows (or declare the kernel without 'empty_rows')")
        if n in bad and "NaN/inf" in note and n in ("out", "lse") and case.score_shift:
            return (f"{n} has inf or NaN where the scores are large (each row shifted by an "
                    f"offset of std {case.score_shift:g}, which the softmax does not see): exp "
                    "overflows or underflows; subtract each row's maximum before exp")
        if n in bad and note == "not zero on empty rows" and not (miss and "out" in bad):
            # (a mistake that leaves these rows keys, such as a flipped alignment, gives the
            # same pattern, in dq too; where out is exactly that mistake's, the miss names it)
            return (f"{n} is not zero on rows with nothing to attend, where npattn gives zeros, "
                    "and right elsewhere: guard fully masked rows (a large negative number in "
                    "place of -inf gives each masked key the same weight there), or declare the "
                    "kernel without 'empty_rows'")
        if n in bad and note.startswith(("shape", "missing", "dtype")):
            return f"{n}: {note}"
    if ("out" in bad or "lse" in bad) and miss:
        return f"{' and '.join(n for n in ('out', 'lse') if n in bad)} wrong: {miss}"
    if "out" in bad or "lse" in bad:
        where = "the scores or the softmax"
        if "softcap" in opts and opts & {"mask_float", "alibi"}:
            where += (" (the order: softcap * tanh(s / softcap) of the scaled scores first, "
                      "then the float mask and ALiBi added)")
        if "out" in bad and "lse" in bad:
            return f"out and lse wrong: {where}"
        if "lse" in bad:
            return ("lse wrong, out right: the log-sum-exp itself (natural log, the row max added "
                    "back, the sink's term) or its precision (the scores q @ k^T rounded to the "
                    "inputs' low precision, or a row sum accumulated in it, show in lse "
                    "first: flash-attn keeps both in float32)")
        if "lse" in tensors:
            return ("lse right, out wrong: after the softmax: the dropout keep-mask or its 1/(1-p), "
                    "or P @ V")
        return f"out wrong: the forward ({where}, or P @ V)"
    grads = [n for n in ("dq", "dk", "dv") if n in bad]
    scaled = [n for n in grads if n in factors]
    gqa = "dv" in bad and "gqa" in opts and "dq" not in bad
    G = case.Hq // case.Hkv
    if gqa and (not scaled or all(abs(factors[n] * G - 1.0) < 1e-2 for n in scaled)):
        why = (f" ({', '.join(f'{n} x 1/{G}' for n in scaled)}: a mean over the group, not the "
               "sum)" if scaled else "")
        return ("dk and dv wrong, dq right, under GQA: each K/V head's gradient is the sum over "
                f"its group of query heads{why}" if "dk" in bad else
                f"dv wrong under GQA: the sum over each K/V head's group of query heads{why}")
    if scaled and set(scaled) == set(grads):
        f = ", ".join(f"{n} x {factors[n]:.4g}" for n in scaled)
        return f"a constant factor ({f}): the scale (applied twice, or missing) or 1/(1-p)"
    if not grads and "dmask" in bad:
        if factors.get("dmask") is not None and abs(factors["dmask"] + 1.0) < 1e-2:
            return ("dmask has the wrong sign (dmask = -1 x npattn's): the mask is added to the "
                    f"scores, so dmask = +ds = {ds}")
        return (f"dmask wrong, the rest right: dmask = ds = {ds} (before softcap's "
                "derivative), summed over the axes the mask was broadcast along")
    if not grads and "dsinks" in bad:
        if lse_grad:
            return ("dsinks wrong, the rest right: dsink = sum over rows of p_sink * "
                    "(dlse - delta)")
        return "dsinks wrong, the rest right: dsink = -sum over rows of p_sink * delta"
    if "dv" in bad:
        if "dropout_mask" in opts:
            return ("dv wrong with dropout: dv = A^T @ dout with A the weights after dropout "
                    "(the keep-mask and 1/(1-p) belong in the backward too)")
        return "dv wrong: dv = A^T @ dout, A the attention weights after dropout"
    if "dq" in bad or "dk" in bad:
        extra = ", softcap's derivative 1 - tanh^2" if "softcap" in opts else ""
        if "dq" in bad and "dk" in bad:
            lse = " (dlse: the upstream gradient of lse, lse_grad=True)" if lse_grad else ""
            return (f"dv right, dq/dk wrong: below the softmax: ds = {ds} with "
                    f"delta = rowsum(dout * out){lse}{extra}, then dq = ds @ k * scale, "
                    "dk = ds^T @ q * scale")
        if "dk" in bad:
            return "dq right, dk wrong: dk = ds^T @ q * scale (a transpose, or the GQA sum)"
        return "dk right, dq wrong: dq = ds @ k * scale"
    return "; ".join(f"{n}: {notes[n]}" for n in bad if notes.get(n)) or "see the table"


def _cases_pass(n: int, between: str = "") -> str:
    """``n`` cases passing, the verb agreeing: "1 case passes", "2 cases pass" (``between``
    before the verb: "1 case with it passes")."""
    return f"{n} case {between}passes" if n == 1 else f"{n} cases {between}pass"


def panel_hints(results: list) -> list:
    """Hints across the panel: the options that every failing case holds (or a pair of
    options one of which each holds), whether cases without options fail, and the three
    commonest case hints with their counts.

    A hint is given only where it says more than the failing cases' own lines: an option
    (or pair) that every failing case holds only when two cases or more fail and a case
    that ran lacks it (else it holds for every case, or names the one failing case's
    options); the options that only the cases holding many together fail with, only when
    two cases or more fail and a case that ran lacks one of them; a case hint only when two
    cases or more share it.
    """
    fails = [r for r in results if r.status == "fail"]
    if not fails:
        return []
    several = len(fails) > 1
    hints = []
    raised = [r for r in fails if r.traceback]
    if several and len(raised) == len(fails):
        hints.append(f"fn raised in every failing case ({raised[0].error.splitlines()[0]})")
    if all(r.written and not r.failing for r in fails):
        return [] if not several else [
            f"fn wrote into its inputs in every failing case, its numbers right: a kernel "
            f"must leave q, k, v, dout and the options as they were ({len(fails)} cases)"]

    def lacking(*opts: str) -> bool:
        """Whether a case that ran holds none of ``opts`` (it passes: every failing case
        holds one)."""
        return any(not set(opts) & set(r.case.options) for r in results)

    common = set.intersection(*(set(r.case.options) for r in fails))
    n_pass = {opt: sum(1 for r in results if opt in r.case.options and r.status != "fail")
              for opt in common}
    if several and len(common) > 3:  # all-options cases alone: a line per option says nothing
        if any(not common <= set(r.case.options) for r in results):
            least = sorted(common, key=lambda o: (n_pass[o], o))[:3]
            hints.append(f"only cases holding {len(common)} options together fail: two options "
                         "meet wrongly (an order of steps), or a step they share; the options "
                         "least often passing elsewhere: "
                         + ", ".join(f"{o!r} ({_cases_pass(n_pass[o])})" for o in least))
    elif several:  # (one failing case holds its options trivially: its own line names them)
        for opt in sorted(common):
            if not lacking(opt):  # every case that ran holds it
                continue
            note = "" if not n_pass[opt] else f" (and {_cases_pass(n_pass[opt], 'with it ')})"
            hints.append(f"every failing case holds {opt!r}{note}: look at how {opt} is applied")
    if not common:
        held = sorted(set().union(*(set(r.case.options) for r in fails)))
        for a, b in ((a, b) for i, a in enumerate(held) for b in held[i + 1:]):
            if all(a in r.case.options or b in r.case.options for r in fails) and lacking(a, b):
                hints.append(f"every failing case holds {a!r} or {b!r}: look at what they share")
                break
        else:
            # (a case without numbers says nothing about the core: its own line says why)
            if any(not r.case.options and r.failing and not all(_unmeasured(r.tensors[n]) for n in r.failing)
                   for r in fails):
                too = " too" if any(r.case.options for r in fails) else ""
                hints.append(f"cases without options fail{too}: the core (scores, softmax, "
                             "P @ V) or its gradient")
    counts: dict = {}
    for r in fails:
        counts[r.hint] = counts.get(r.hint, 0) + 1
    for h, n in sorted(counts.items(), key=lambda kv: -kv[1])[:3]:
        if n > 1:  # a hint of one case is its own line in the failing cases
            hints.append(f"{n} cases: {h}")
    return hints


# --------------------------------------------------------------------------
# arrays: rounding to the kernel's dtype, the kernel's library and layout


def round_to_bfloat16(x: np.ndarray) -> np.ndarray:
    """``x`` rounded to bfloat16 (round to nearest even), held in float32."""
    x32 = np.ascontiguousarray(x, dtype=np.float32)
    u = x32.view(np.uint32).astype(np.uint64)  # room for the carry
    rounded = (u + np.uint64(0x7FFF) + ((u >> np.uint64(16)) & np.uint64(1))) & np.uint64(0xFFFF0000)
    out = rounded.astype(np.uint32).view(np.float32)
    return np.where(np.isfinite(x32), out, x32)


def _round(x: np.ndarray, dtype: str) -> np.ndarray:
    """``x`` rounded to ``dtype``, as float64 values (exact in ``dtype``)."""
    if dtype == "bfloat16":
        return round_to_bfloat16(x).astype(np.float64)
    return np.asarray(x, dtype=dtype).astype(np.float64)


def _host_dtype(dtype: str) -> Any:
    """The NumPy dtype that npattn's run in ``dtype`` computes in (bfloat16: float32)."""
    return np.float32 if dtype == "bfloat16" else np.dtype(dtype)


def _to_layout(x: np.ndarray, layout: str, rows: Optional[np.ndarray] = None) -> np.ndarray:
    """(B, H, L, D) -> the kernel's layout; "thd": the B sequences packed, (total, H, D), the
    rows of each sequence those of ``rows`` [B, L] (``Packing.q_rows`` or ``k_rows``)."""
    if layout == "thd":
        return np.swapaxes(x, 1, 2)[rows]  # [B, L, H, D] -> [total, H, D]
    return x if layout == "bhsd" else np.swapaxes(x, 1, 2)


def _from_layout(x: np.ndarray, layout: str, shape: tuple,
                 rows: Optional[np.ndarray] = None) -> np.ndarray:
    """The kernel's layout -> (B, H, L, D), ``shape`` the one verify expects, zeros in the
    padding of "thd" (its sequences' rows ``rows`` [B, L], None: all); an array not 4-D
    (not (total, H, D) for "thd") as it is (its shape is wrong whatever the layout, and
    ``_compare`` says so)."""
    if layout == "thd":
        B, H, L, D = shape
        assert rows is not None  # "thd" is read with its packing's rows
        if x.shape != (int(rows.sum()), H, D):
            return x
        out = np.zeros((B, L, H, D), dtype=x.dtype)
        out[rows] = x
        return np.swapaxes(out, 1, 2)  # [B, H, L, D]
    return x if layout == "bhsd" or x.ndim != 4 else np.swapaxes(x, 1, 2)


def _lse_to_layout(x: np.ndarray, layout: str, rows: Optional[np.ndarray] = None) -> np.ndarray:
    """(B, H, Lq) -> lse's layout in the kernel's: JAX's (B, T, N), flash-attn varlen's
    (H, total_q) (the query rows of each sequence ``rows`` [B, Lq])."""
    if layout == "thd":
        return np.swapaxes(x, 0, 1)[:, rows]  # [H, B, Lq] -> [H, total_q]
    return np.swapaxes(x, 1, 2) if layout == "bthd" else x


def _lse_from_layout(x: np.ndarray, layout: str, shape: tuple,
                     rows: Optional[np.ndarray] = None) -> np.ndarray:
    """lse's layout in the kernel's -> (B, H, Lq), ``shape``, -inf in the padding of "thd"
    (not compared: those rows attend nothing); an array not of the layout's shape as it is."""
    if layout == "thd":
        B, H, L = shape
        assert rows is not None  # "thd" is read with its packing's rows
        if x.shape != (H, int(rows.sum())):
            return x
        out = np.full((H, B, L), -np.inf, dtype=x.dtype)
        out[:, rows] = x
        return np.swapaxes(out, 0, 1)  # [B, H, Lq]
    return np.swapaxes(x, 1, 2) if layout == "bthd" and x.ndim == 3 else x


def _varlen_keywords(pack: Packing, lib: "_Library") -> dict:
    """Layout "thd": the keywords of flash-attn's varlen kernels that say where each packed
    sequence lies: ``cu_seqlens_q`` [0, Lq_0, Lq_0 + Lq_1, ...] and ``cu_seqlens_k`` (int32
    arrays of the kernel's library), ``max_seqlen_q``, ``max_seqlen_k`` (ints)."""
    cu_q = np.concatenate([[0], np.cumsum(pack.lq)]).astype(np.int32)  # [B + 1]
    cu_k = np.concatenate([[0], np.cumsum(pack.lk)]).astype(np.int32)  # [B + 1]
    return {"cu_seqlens_q": lib.array(cu_q), "cu_seqlens_k": lib.array(cu_k),
            "max_seqlen_q": int(max(pack.lq)), "max_seqlen_k": int(max(pack.lk))}


def _packed_inputs(inp: CaseInputs, pack: Packing) -> tuple:
    """Layout "thd": (the inputs npattn's reference runs on, the kernel's). The reference's
    mask is the packing's (each sequence attends itself; the padding's rows nothing), so its
    tensors are each sequence's own; its dlse is zero on the padding's rows, whose lse is
    finite with sinks (the sink's) and which the kernel does not have; the kernel's dropout
    keep-mask is in varlen's layout."""
    dlse = None if inp.dlse is None else np.where(pack.q_rows[:, None, :], inp.dlse, 0.0)
    truth = CaseInputs(inp.q, inp.k, inp.v, inp.dout, {**inp.options, "mask": pack.pad_mask()},
                       dlse)  # [B, Hq, Lq] dlse
    opts = dict(inp.options)
    if "dropout_mask" in opts:  # sequence b's in [b, :, :Lq_b, :Lk_b], False elsewhere
        opts["dropout_mask"] = _moved_keep(opts["dropout_mask"], pack, replace(pack, left=False))
    return truth, CaseInputs(inp.q, inp.k, inp.v, inp.dout, opts, inp.dlse)


class _Library:
    """The kernel's array library: host NumPy arrays in, its arrays out, and back.

    torch, CuPy and JAX have branches of their own (torch's autograd, CuPy's and JAX's
    devices); NumPy and every other Array API namespace (array_api_strict, ...) share one:
    ``xp.asarray(host, dtype=xp.<dtype>, device=...)``."""

    mod: Any
    jax: Any

    def __init__(self, name: str, namespace: Any = None):
        self.name = name
        self.device: Any = None  # the library's own; ``place`` sets ``device=``
        if name == "torch":
            import torch

            self.mod = torch
        elif name == "cupy":
            import cupy

            self.mod = cupy
        elif name == "jax":
            import jax
            import jax.numpy as jnp

            self.mod, self.jax = jnp, jax
        elif name == "numpy":
            self.mod = np
        else:  # an Array API namespace: the module given, or the one BACKENDS names
            self.mod = resolve_backend(name if namespace is None else namespace)

    def dtype(self, dtype: str, flags: Optional[Mapping] = None) -> Any:
        """The library's ``dtype``; a ``ValueError`` naming dtype and backend (as ``flags`` name
        them) where it has none."""
        if self.name in ("torch", "jax"):
            return getattr(self.mod, dtype)
        if self.name in ("numpy", "cupy") and dtype == "bfloat16":
            try:
                import ml_dtypes
            except ImportError:
                raise ValueError(f"dtype: bfloat16 on backend {self.name!r} needs ml_dtypes "
                                 "(or use backend='torch' or 'jax')") from None
            return ml_dtypes.bfloat16
        if self.name in ("numpy", "cupy"):
            return np.dtype(dtype)
        if not hasattr(self.mod, dtype):  # array_api_strict has neither float16 nor bfloat16
            has = [d for d in DTYPES if hasattr(self.mod, d)]
            raise ValueError(f"dtype: expected a dtype that {_setting('backend', self.name, flags)} has "
                             f"({', '.join(has) or 'none of ' + ', '.join(DTYPES)}), got {dtype!r}")
        return getattr(self.mod, dtype)

    def array(self, a: np.ndarray, dtype: Optional[str] = None, grad: bool = False) -> Any:
        """Host ``a`` as the library's array, floats in ``dtype`` (exact: ``a`` is rounded);
        ``a``'s memory where the library shares it (NumPy's for a mask or ids: a write into
        them is seen in the case's arrays)."""
        a = np.ascontiguousarray(a)
        if dtype is not None:
            a = a.astype(np.float32 if dtype in ("bfloat16", "float16") else np.dtype(dtype))
        if self.name == "torch":
            t = self.mod.from_numpy(a)
            t = t.to(device="cpu" if self.device is None else self.device,  # (0: cuda:0)
                     dtype=None if dtype is None else self.dtype(dtype))
            return t.requires_grad_(True) if grad else t
        if self.name == "jax":
            x = self.mod.asarray(a, dtype=None if dtype is None else self.dtype(dtype))
            return x if self.device is None else self.jax.device_put(x, self.device)
        if self.name == "cupy":
            if dtype is not None:
                a = a.astype(self.dtype(dtype))
            if self.device is None:
                return self.mod.asarray(a)
            with self.mod.cuda.Device(self.device):
                return self.mod.asarray(a)
        where = {} if self.device is None else {"device": self.device}
        return self.mod.asarray(a, dtype=None if dtype is None else self.dtype(dtype), **where)

    def place(self, device: Any, dtype: str, flags: Optional[Mapping] = None) -> None:
        """Make the arrays from here on in ``device`` (verify's ``device=``), resolved as this
        library takes it: torch a device or its name ("cpu", "cuda:1"), CuPy a device id, JAX a
        ``jax.Device`` or "PLATFORM" / "PLATFORM:N" (``jax.devices(PLATFORM)[N]``, N 0 by
        default), NumPy none, another namespace what its ``asarray(device=)`` takes (one of
        its ``__array_namespace_info__().devices()``). One array in ``dtype`` is placed there
        first: a device the library cannot use is a ``ValueError`` naming ``device`` before any
        case runs (every case failing as "fn raised" told the user nothing), and nothing
        changes."""
        if device is None:
            return
        backend = _setting("backend", self.name, flags)
        if self.name == "numpy":
            raise ValueError(f"device: expected {'none' if flags else 'None'} with {backend} "
                             f"(NumPy arrays live on the host), got {device!r}")
        resolved = self._jax_device(device, backend, flags) if self.name == "jax" else device
        if self.name not in LIBRARIES and isinstance(device, str):  # as the report writes it
            resolved = next((d for d in self._namespace_devices() if str(d) == device), device)
        before, self.device = self.device, resolved
        try:
            x = self.array(np.zeros(1), dtype)
            want = getattr(resolved, "device_set", {resolved})  # a jax Sharding: its devices
            if self.name == "jax" and set(x.devices()) != set(want):
                raise RuntimeError(f"the array landed on {sorted(map(str, x.devices()))}")
        except Exception as exc:
            self.device = before
            raise ValueError(f"device: expected a device that {backend} can use{self._devices()}, "
                             f"got {device!r} ({type(exc).__name__}: {exc})") from exc

    def _namespace_devices(self) -> list:
        """The devices an Array API namespace reports (none where it has no inspection API)."""
        try:
            return list(self.mod.__array_namespace_info__().devices())
        except Exception:
            return []

    def _devices(self) -> str:
        """' (one of ...)': the devices an Array API namespace reports, or ''."""
        devices = self._namespace_devices() if self.name not in LIBRARIES else []
        return f" (one of {', '.join(map(repr, devices))})" if devices else ""

    def _jax_device(self, device: Any, backend: str, flags: Optional[Mapping]) -> Any:
        """Where ``device`` puts jax arrays: a ``jax.Device`` or ``Sharding`` as it is (as
        ``jax.device_put`` takes them), "PLATFORM" / "PLATFORM:N" as ``jax.devices(PLATFORM)[N]``
        (``jax.device_put`` takes no names)."""
        jax = self.jax
        if isinstance(device, (jax.Device, jax.sharding.Sharding)):  # as jax.device_put takes them
            return device
        form = "'PLATFORM' or 'PLATFORM:N'"  # the command line has no jax.Device to give
        form = form if flags else f"a jax.Device, or {form}"
        if not isinstance(device, str):
            raise TypeError(f"device: expected {form} with {backend}, got "
                            f"{described(device)}")
        platform, sep, index = device.partition(":")
        found: list = []
        error = ""
        if platform and (not sep or index.isdecimal()):  # jax.devices("") is the default's
            try:
                found = jax.devices(platform)
            except Exception as exc:  # no such platform here: jax says which there are
                error = f" ({type(exc).__name__}: {exc})"
        n = int(index) if sep and index.isdecimal() else 0
        if n < len(found):
            return found[n]
        # what jax reports: the default platform's devices, and the host's, which it always has
        available = []
        for name in dict.fromkeys((jax.devices()[0].platform, "cpu")):
            try:
                available += [f"{name}:{i}" for i in range(len(jax.devices(name)))]
            except Exception:
                pass
        raise ValueError(f"device: expected {form} naming one of the devices jax reports "
                         f"({', '.join(available)}), got {device!r}{error}")

    def host(self, x: Any) -> np.ndarray:
        """A float64 host copy of the kernel's array ``x`` (any library it may return)."""
        if type(x).__module__.startswith("torch"):
            x = x.detach()
            if x.is_floating_point():
                x = x.double()  # bfloat16 has no NumPy dtype
            return x.cpu().numpy().astype(np.float64)
        if isinstance(x, np.ndarray) or not is_array(x):  # a Python number, a list, ...
            return np.asarray(x).astype(np.float64)
        # CuPy's, JAX's and other namespaces' arrays, through DLPack (array_api_strict's have no
        # __array__ off its CPU device); an array without DLPack through __array__
        try:
            return to_numpy(x).astype(np.float64)
        except (TypeError, AttributeError, BufferError):
            return np.asarray(x).astype(np.float64)


def _library_name(backend: Any) -> str:
    """The name of the kernel's array library from ``backend=``: one of ``BACKEND_NAMES``
    (a name, or the module: numpy, torch, cupy, jax or jax.numpy, their array_api_compat
    namespaces, array_api_strict), or the ``__name__`` of another Array API namespace module."""
    if not isinstance(backend, (str, types.ModuleType)):
        raise TypeError(f"backend: expected one of {BACKEND_NAMES} or an Array API namespace "
                        f"module, got {described(backend)}")
    if isinstance(backend, str):
        if backend not in BACKEND_NAMES:
            raise ValueError(f"backend: expected one of {BACKEND_NAMES} or an Array API namespace "
                             f"module, got {backend!r}")
        return backend
    if backend.__name__ in ("jax", "jax.numpy"):
        return "jax"
    name = backend.__name__
    name = name.split(".")[-1] if name.startswith("array_api_compat.") else name
    if name in LIBRARIES:
        return name
    xp = resolve_backend(backend)  # a module that is no namespace: a TypeError
    # another namespace by the name it was given as (the name a rerun line writes)
    return backend_name(xp) if backend_name(xp) in BACKEND_NAMES else backend.__name__


# --------------------------------------------------------------------------
# the three computations of a case


def _npattn(inp: CaseInputs, dtype: str, *, grads: bool, weights: bool = False,
            dlse: Optional[np.ndarray] = None) -> dict:
    """npattn's reference on host arrays in ``dtype`` (float16 / bfloat16 as npattn computes
    them: in float32, the results rounded back): host float64 copies of its tensors.

    ``dlse`` (B, Hq, Lq), the upstream gradient of lse, goes to the backward with its rows
    of non-finite lse zeroed; ``res["dlse"]`` is what it got."""
    work = _host_dtype(dtype)
    opts = dict(inp.options)
    if "mask" in opts and opts["mask"].dtype != bool:
        opts["mask"] = opts["mask"].astype(work)
    if "sinks" in opts:
        opts["sinks"] = opts["sinks"].astype(work)
    if "alibi_slopes" in opts:
        opts["alibi_slopes"] = opts["alibi_slopes"].astype(np.float64 if dtype == "float64"
                                                           else np.float32)
    q, k, v, dout = (t.astype(work) for t in (inp.q, inp.k, inp.v, inp.dout))
    out, cache = A.sdpa_forward(q, k, v, impl="reference", need_weights=weights, **opts)
    res = {"out": out, "lse": cache.lse}
    if grads:
        d = None
        if dlse is not None:
            lse = np.asarray(cache.lse)  # [B, Hq, Lq]
            d = np.where(np.isfinite(lse), dlse, 0.0).astype(lse.dtype)  # [B, Hq, Lq]
            res["dlse"] = d
        g = A.sdpa_backward(dout, cache, dlse=d)
        res.update(dq=g.dq, dk=g.dk, dv=g.dv)
        if g.dmask is not None:
            res["dmask"] = g.dmask
        if g.dsinks is not None:
            res["dsinks"] = g.dsinks
    dtypes = {n: str(np.asarray(t).dtype) for n, t in res.items()}
    res = {n: np.asarray(t, dtype=np.float64) for n, t in res.items()}
    if dtype == "bfloat16":  # npattn casts these back to the input dtype; lse stays float32
        for n in ("out", "dq", "dk", "dv", "dmask", "dsinks"):
            if n in res:
                res[n] = _round(res[n], "bfloat16")
                dtypes[n] = "bfloat16"
    if weights:
        res["weights"] = np.asarray(A.weights(cache), dtype=np.float64)
    res["dtypes"] = dtypes
    return res


def _rounded_inputs(inp: CaseInputs, dtype: str) -> CaseInputs:
    """``inp`` with q, k, v, dout, dlse, a float mask and sinks rounded to ``dtype`` (ALiBi
    slopes to float32 unless float64): the values the kernel receives exactly."""
    opts = dict(inp.options)
    if "mask" in opts and opts["mask"].dtype != bool:
        opts["mask"] = _round(opts["mask"], dtype)
    if "sinks" in opts:
        opts["sinks"] = _round(opts["sinks"], dtype)
    if "alibi_slopes" in opts and dtype != "float64":
        opts["alibi_slopes"] = _round(opts["alibi_slopes"], "float32")
    dlse = None if inp.dlse is None else _round(inp.dlse, dtype)
    return CaseInputs(_round(inp.q, dtype), _round(inp.k, dtype), _round(inp.v, dtype),
                      _round(inp.dout, dtype), opts, dlse)


@dataclass
class _Config:
    fn: Callable
    layout: str
    dtype: str
    backward: Optional[Callable]
    autograd: Optional[str]
    returns_lse: bool
    lib: _Library
    align: str
    adapter: Any
    seed: int
    budget_factor: float
    floors: dict
    supports: tuple = ()
    mask_grad: Optional[bool] = None
    lse_grad: bool = False
    flags: Optional[Mapping] = None  # verify's flags=: how messages name its keywords

    @property
    def gradients(self) -> bool:
        return self.backward is not None or self.autograd is not None

    @property
    def lse_dtype(self) -> str:
        """The dtype of the dlse passed to the kernel: float32 for half precision (as lse)."""
        return "float32" if self.dtype in ("float16", "bfloat16") else self.dtype


def _kernel_options(inp: CaseInputs, cfg: _Config, sinks: Any, mask: Any = None) -> dict:
    """The case's npattn keywords with arrays of the kernel's library, then the adapter;
    ``sinks`` and a float ``mask`` (when not None) are the arrays made for autograd."""
    lib, dtype = cfg.lib, cfg.dtype
    kw: dict = {}
    for name, val in inp.options.items():
        if name == "mask" and mask is not None:
            kw[name] = mask
        elif name == "mask":
            kw[name] = lib.array(val, None if val.dtype == bool else dtype)
        elif name == "sinks":
            kw[name] = sinks
        elif name == "alibi_slopes":
            kw[name] = lib.array(val, "float64" if dtype == "float64" else "float32")
        elif name in ("q_segments", "k_segments", "dropout_mask"):
            kw[name] = lib.array(val)
        else:
            kw[name] = val
    adapter = cfg.adapter
    if adapter is None:
        return kw
    if callable(adapter):
        out = adapter(kw)
        if not isinstance(out, Mapping):
            raise TypeError(f"adapter: expected it to return a mapping of keywords, got "
                            f"{type_name(out)}")
        return dict(out)
    renamed = {}
    for name, val in kw.items():
        new = adapter.get(name, name)
        if new is not None:
            renamed[new] = val
    return renamed


def _split_result(result: Any, cfg: _Config) -> tuple:
    """(out, lse or None, saved) from what ``fn`` returned."""
    n_head = 2 if cfg.returns_lse else 1
    if cfg.backward is None and not cfg.returns_lse:
        if isinstance(result, (tuple, list)):
            raise TypeError(f"fn: expected it to return out, an array, got a "
                            f"{type_name(result)} of {len(result)}; "
                            "a kernel that returns (out, lse) needs "
                            f"{_setting('returns_lse', True, cfg.flags)}")
        return _checked_out(result), None, ()
    if not isinstance(result, (tuple, list)) or len(result) < n_head:
        want = "(out, lse" if cfg.returns_lse else "(out"
        want += ", *saved)" if cfg.backward is not None else ")"
        raise TypeError(f"fn: expected it to return {want}, got {type_name(result)}")
    saved = tuple(result[n_head:])
    if cfg.backward is None and saved:
        raise TypeError(f"fn: expected it to return (out, lse) with "
                        f"{_setting('returns_lse', True, cfg.flags)}, got a "
                        f"{type_name(result)} of {len(result)}")
    return _checked_out(result[0]), (result[1] if cfg.returns_lse else None), saved


def _checked_out(out: Any) -> Any:
    """``out`` when it is an array, else a ``TypeError`` that says what ``fn`` returned."""
    # a class is none (NumPy's scalar types carry shape and dtype as descriptors)
    if isinstance(out, type) or not (hasattr(out, "shape") and hasattr(out, "dtype")):
        raise TypeError(f"fn: expected out to be an array, got {type_name(out)}")
    return out


def _grads_of(g: Any) -> dict:
    """{dq, dk, dv, dmask, dsinks} (None where not given) from a backward's return: a tuple
    (dq, dk, dv), (dq, dk, dv, dsinks) or (dq, dk, dv, dmask, dsinks) (npattn's order), a
    mapping, or an object with those attributes (npattn's ``SDPAGrads``)."""
    if isinstance(g, Mapping):
        return {n: g.get(n) for n in GRADS}
    if all(hasattr(g, n) for n in GRADS[:3]):
        return {n: getattr(g, n, None) for n in GRADS}
    if isinstance(g, (tuple, list)) and len(g) in (3, 4, 5):
        names = {3: GRADS[:3], 4: ("dq", "dk", "dv", "dsinks"), 5: GRADS}[len(g)]
        return {**dict.fromkeys(GRADS), **dict(zip(names, g))}
    raise TypeError("backward: expected (dq, dk, dv), (dq, dk, dv, dsinks), (dq, dk, dv, dmask, "
                    "dsinks), a mapping or an object with attributes dq, dk, dv, got "
                    f"{type_name(g)}")


def _run_kernel(inp: CaseInputs, cfg: _Config, dlse: Optional[np.ndarray] = None,
                pack: Optional[Packing] = None) -> dict:
    """Call the kernel on the case; host float64 (B, H, L, D) copies of what it gives.

    ``dlse`` (B, Hq, Lq), with ``lse_grad``, is the upstream gradient of lse (zero on rows
    whose lse is not finite); ``pack``, in layout "thd", where the packed sequences lie."""
    lib, L = cfg.lib, cfg.layout
    grad = cfg.autograd == "torch"
    # [B, Lq], [B, Lk]: each packed sequence's rows ("thd"; None: every row)
    rows = {"q": None, "k": None} if pack is None else {"q": pack.q_rows, "k": pack.k_rows}
    rows_of = {"q": rows["q"], "k": rows["k"], "v": rows["k"], "dout": rows["q"], "out": rows["q"],
               "lse": rows["q"], "dq": rows["q"], "dk": rows["k"], "dv": rows["k"]}
    q, k, v = (lib.array(_to_layout(getattr(inp, n), L, rows_of[n]), cfg.dtype, grad=grad)
               for n in ("q", "k", "v"))
    sinks = None
    if "sinks" in inp.options:
        sinks = lib.array(inp.options["sinks"], cfg.dtype, grad=grad)
    float_mask = "mask" in inp.options and inp.options["mask"].dtype != bool
    mask = None  # a float mask as a leaf of autograd, with mask_grad=True
    if float_mask and cfg.autograd is not None and cfg.mask_grad is True:
        mask = lib.array(inp.options["mask"], cfg.dtype, grad=grad)
    kw = _kernel_options(inp, cfg, sinks, mask)
    if pack is not None:  # where each packed sequence lies, by flash-attn's names (no adapter)
        kw.update(_varlen_keywords(pack, lib))
    # the kernel's own copies of the option arrays (a float mask, sinks, slopes), as they were:
    # a write into them shares no memory with the case's arrays, so it is seen only here
    before = {n: (x, lib.host(x)) for n, x in kw.items() if hasattr(x, "shape") and hasattr(x, "dtype")}
    dout = lib.array(_to_layout(inp.dout, L, rows["q"]), cfg.dtype)
    dlse_k: Any = None
    if dlse is not None:  # lse's layout: (B, H, Lq), JAX's (B, T, N), varlen's (H, total_q)
        dlse_k = lib.array(_lse_to_layout(dlse, L, rows["q"]), cfg.lse_dtype)
    # what autograd differentiates with respect to, beyond q, k, v: [(name, array)]
    leaves = [("dsinks", sinks)] if sinks is not None else []
    leaves += [("dmask", mask)] if mask is not None else []
    res: dict = {}
    grads: dict = {}
    if cfg.autograd == "jax":
        jax = lib.jax
        prims = [q, k, v] + [x for _, x in leaves]
        # the keyword that holds each leaf (found by identity, after the adapter)
        keys = {i: next((n for n in kw if kw[n] is x), None) for i, (_, x) in enumerate(leaves, 3)}

        def f(*p):
            extra = dict(kw)
            for i, name in keys.items():
                if name is not None:
                    extra[name] = p[i]
            return cfg.fn(p[0], p[1], p[2], **extra)

        if cfg.lse_grad:  # the cotangent of (out, lse) is (dout, dlse)
            (out, lse), pull = jax.vjp(lambda *p: tuple(f(*p)), *prims)
            g = pull((dout, dlse_k.astype(lse.dtype)))
        elif cfg.returns_lse:
            out, pull, lse = jax.vjp(lambda *p: tuple(f(*p)), *prims, has_aux=True)
            g = pull(dout)
        else:
            out, pull = jax.vjp(f, *prims)
            lse = None
            g = pull(dout)
        grads = dict(zip(["dq", "dk", "dv"] + [n for n, _ in leaves], g))
    else:
        result = cfg.fn(q, k, v, **kw)
        out, lse, saved = _split_result(result, cfg)
        if cfg.autograd == "torch":
            torch = lib.mod
            outs, cots = [out], [dout]
            if cfg.lse_grad:  # d/d(inputs) of sum(out * dout) + sum(lse * dlse)
                outs.append(lse)
                cots.append(dlse_k.to(lse.dtype) if isinstance(lse, torch.Tensor) else dlse_k)
            for name, t in zip(("out", "lse"), outs):  # what torch.autograd.grad can follow
                if not isinstance(t, torch.Tensor):
                    raise TypeError(f"fn: expected {name} as a torch.Tensor with autograd='torch', "
                                    f"got {type(t).__module__}.{type(t).__name__}")
                if not t.requires_grad:
                    raise TypeError(f"fn: expected {name} computed from q, k, v by torch's autograd "
                                    "(autograd='torch'), got a tensor that does not require grad "
                                    "(detached, or computed outside autograd)")
            prims = [q, k, v] + [x for _, x in leaves]
            g = torch.autograd.grad(outs, prims, grad_outputs=cots, allow_unused=True)
            grads = dict(zip(["dq", "dk", "dv"] + [n for n, _ in leaves], g))
        elif cfg.backward is not None:
            extra = {"dlse": dlse_k} if cfg.lse_grad else {}
            raw = cfg.backward(dout, *saved, **extra)
            if isinstance(raw, (tuple, list)) and len(raw) == 4 and sinks is None and raw[3] is not None:
                raise TypeError("backward: returned 4 gradients in a case without sinks; four are "
                                "read as (dq, dk, dv, dsinks): return (dq, dk, dv, dmask, None) for dmask")
            grads = _grads_of(raw)
    # q, k, v and dout as the kernel holds them after its calls: the case's values still
    res["written"] = [n for n, x, want in (("q", q, inp.q), ("k", k, inp.k), ("v", v, inp.v),
                                           ("dout", dout, inp.dout))
                      if not np.array_equal(lib.host(x), _to_layout(want, L, rows_of[n]),
                                            equal_nan=True)]
    res["written"] += [n for n, (x, was) in before.items()
                       if not np.array_equal(lib.host(x), was, equal_nan=True)]
    # {name: note} for out, dq, dk, dv of another library or dtype than q (k, v) as the kernel got them
    res["dtypes"] = {}
    for n, t, x, of in (("out", out, q, "q"), ("dq", grads.get("dq"), q, "q"),
                        ("dk", grads.get("dk"), k, "k"), ("dv", grads.get("dv"), v, "v")):
        got_dtype = getattr(t, "dtype", None)
        if got_dtype is None:
            continue
        got_lib, want_lib = (type(a).__module__.split(".")[0].replace("jaxlib", "jax") for a in (t, x))
        if got_lib != want_lib:  # the right numbers in another library: not the kernel's contract
            res["dtypes"][n] = (f"library: expected a {want_lib} array (as {of}), got "
                                f"{type(t).__module__}.{type(t).__name__}")
        elif dtype_name(got_dtype) != dtype_name(x.dtype):
            res["dtypes"][n] = f"dtype: expected {dtype_name(x.dtype)} (as {of}), got {dtype_name(got_dtype)}"
    # "thd": {name: shape} of a tensor not of the packed shape, as the kernel gave it (read as
    # it is, such a tensor could have the shape of verify's own (B, H, L, D))
    res["shapes"] = {}

    def read(name: str, x: Any, shape: tuple) -> np.ndarray:
        h = lib.host(x)
        if L == "thd" and tuple(h.shape) != _kernel_shape(name, shape, L, pack):
            res["shapes"][name] = tuple(h.shape)
        if name == "lse":
            return _lse_from_layout(h, L, shape, rows_of[name])
        return _from_layout(h, L, shape, rows_of[name])

    res["out"] = read("out", out, inp.dout.shape)
    if cfg.returns_lse:
        res["lse"] = read("lse", lse, inp.dout.shape[:3])
    for n, t in grads.items():
        if (n == "dsinks" and sinks is None) or (n == "dmask" and not float_mask) or \
                (n == "dmask" and cfg.mask_grad is False):
            continue
        if t is None:
            res[n] = None
        elif n in ("dsinks", "dmask"):  # (Hq,); the mask's own shape, in every layout
            res[n] = lib.host(t)
        else:  # dq, dk, dv: the shapes of q, k, v
            res[n] = read(n, t, getattr(inp, n[1:]).shape)
    return res


def _compare(name: str, got: Any, truth: np.ndarray, ref: np.ndarray, floor_dtype: str,
             terms: float, cfg: _Config, skip: Optional[np.ndarray],
             saturated: Optional[str], lse_floor: float = 0.0,
             shape: Optional[tuple] = None, pack: Optional[Packing] = None) -> tuple:
    """The ``TensorResult`` of one tensor, and its constant factor (or None) and note.

    ``shape``: the kernel gave the tensor in this shape, not its layout's (``got`` is None;
    ``pack``: in layout "thd", the case's packed sequences, which the note's shape counts).

    ``skip`` (bool, ``truth``'s shape) marks the entries not compared (lse on rows with
    nothing to attend, dmask where the mask is -inf); ``lse_floor`` is ``u_lse * (terms_lse +
    terms_merge + SCORE_ROUNDINGS * terms_scores)``, what the rounding of lse, of a merge's
    partial lse and of recomputed scores may move the tensor by (module docstring)."""
    keep = np.ones(truth.shape, dtype=bool) if skip is None else ~skip
    t = np.where(keep, truth, 0.0)
    magnitude = float(np.max(np.abs(t))) if t.size else 0.0
    npattn_err = float(np.max(np.abs(np.where(keep, ref, 0.0) - t))) if t.size else 0.0
    floor = cfg.floors[floor_dtype] * max(terms, FLOOR_SCALE) + lse_floor
    budget = cfg.budget_factor * npattn_err + floor
    note = where = ""
    factor = None
    if shape is not None:
        err, note = math.inf, _shape_note(name, tuple(truth.shape), shape, cfg.layout, pack)
    elif got is None:
        err, note = math.inf, f"missing: no {name} was returned"
    elif tuple(got.shape) != tuple(truth.shape):
        err, note = math.inf, _shape_note(name, tuple(truth.shape), tuple(got.shape), cfg.layout,
                                          pack)
    else:
        g = np.where(keep, got, 0.0)
        bad = ~np.isfinite(g)
        if bad.any():
            err = math.inf
            note = f"{int(bad.sum())} NaN/inf entries"
        else:
            err = float(np.max(np.abs(g - t))) if g.size else 0.0
            factor = _constant_factor(g, t)
        if err > budget:
            where = _where(name, g, t, budget, pack)
    if err <= budget:
        status = "pass"
        if magnitude < DEGENERATE_RATIO * budget:
            status, note = "degenerate", (f"max|{name}| {magnitude:.2g} < {DEGENERATE_RATIO:g} "
                                          f"budgets: a zero {name} would nearly pass")
        elif saturated and name in SOFTMAX_GRADS:
            status, note = "degenerate", saturated
    else:
        status = "fail"
    return TensorResult(name, err, budget, npattn_err, floor, magnitude, status, note,
                        where), factor


#: the axes of each tensor as verify holds it ((B, H, L, D) whatever the layout)
_AXES = {"out": ("b", "h", "query", "d"), "dq": ("b", "h", "query", "d"),
         "dk": ("b", "h", "key", "d"), "dv": ("b", "h", "key", "d"),
         "lse": ("b", "h", "query"), "dmask": ("b", "h", "query", "key"), "dsinks": ("h",)}
#: the same in the kernel's layout, for a message about the shape it returned
_LAYOUT_AXES = {"bhsd": "(B, H, L, D)", "bshd": "(B, L, H, D)", "bthd": "(B, T, N, H)",
                "thd": "(total, H, D)"}
#: lse's axes in the kernel's layout
_LSE_AXES = {"bhsd": "(B, H, Lq)", "bshd": "(B, H, Lq)", "bthd": "(B, T, N)", "thd": "(H, total_q)"}


def _kernel_shape(name: str, shape: tuple, layout: str, pack: Optional[Packing] = None) -> tuple:
    """``shape`` as verify holds it -> as the kernel gives it (``_run_kernel``'s swaps undone).
    For "thd" only the shape verify expects (``pack``: the case's sequences): one that
    ``_from_layout`` read is that shape, any other was left as the kernel gave it."""
    if layout == "thd" and pack is not None and len(shape) in (3, 4):
        total = sum(pack.lk if name in ("dk", "dv") else pack.lq)
        if name in ("out", "dq", "dk", "dv") and len(shape) == 4:
            return (total, shape[1], shape[3])
        if name == "lse" and len(shape) == 3:
            return (shape[1], total)
    swap = ((name in ("out", "dq", "dk", "dv") and layout not in ("bhsd", "thd") and len(shape) == 4)
            or (name == "lse" and layout == "bthd" and len(shape) == 3))
    return (shape[0], shape[2], shape[1], *shape[3:]) if swap else shape


def _shape_note(name: str, want: tuple, got: tuple, layout: str,
                pack: Optional[Packing] = None) -> str:
    """The note of a tensor of the wrong shape, both shapes in the kernel's layout."""
    want = _kernel_shape(name, want, layout, pack)
    got = got if layout == "thd" else _kernel_shape(name, got, layout)  # "thd": as given
    axes = ""
    if name in ("out", "dq", "dk", "dv"):
        axes = f" {_LAYOUT_AXES[layout]}"
        if layout == "thd":
            axes = " (total_k, H, D)" if name in ("dk", "dv") else " (total_q, H, D)"
    elif name == "lse":
        axes = f" {_LSE_AXES[layout]}"
    note = f"shape: expected {want}{axes} in layout {layout!r}, got {got}"
    if len(got) == len(want) >= 3 and got == (want[0], want[2], want[1], *want[3:]) and got != want:
        note += " (axes 1 and 2 swapped" + (
            f": is the kernel's layout not {layout!r}?)" if len(want) == 4 else ")")
    elif layout == "thd" and name == "lse" and len(want) == 2 and got == want[::-1] != want:
        note += " (axes swapped: flash-attn's varlen lse is (H, total_q))"
    return note


def _ranges(idx: np.ndarray, limit: int = 6) -> str:
    """Sorted ints -> '0-31, 64, 96-127' (the first ``limit`` runs, then '...')."""
    runs: list = []
    for i in (int(x) for x in idx):
        if runs and i == runs[-1][1] + 1:
            runs[-1][1] = i
        else:
            runs.append([i, i])
    text = ", ".join(f"{a}" if a == b else f"{a}-{b}" for a, b in runs[:limit])
    return text + (", ..." if len(runs) > limit else "")


def _where(name: str, got: np.ndarray, truth: np.ndarray, budget: float,
           pack: Optional[Packing] = None) -> str:
    """Where ``got`` is over budget (or not finite): how many entries, the worst one's
    index by axis name, and which rows (queries, or keys for dk and dv). With ``pack``
    (layout "thd") out, lse and the gradients are told in the kernel's packed layout: the
    token, and the worst one's sequence and position in it."""
    axes = _AXES.get(name, tuple(f"axis{i}" for i in range(got.ndim)))[:got.ndim]
    lengths = None
    if pack is not None and name in ("out", "dq", "dk", "dv", "lse"):
        lengths = pack.lk if name in ("dk", "dv") else pack.lq
        rows = pack.k_rows if name in ("dk", "dv") else pack.q_rows
        if name == "lse":  # [B, H, Lq] -> [H, total_q]
            got, truth = (_lse_to_layout(x, "thd", rows) for x in (got, truth))
            axes = ("h", "token")
        else:  # [B, H, L, D] -> [total, H, D]
            got, truth = (_to_layout(x, "thd", rows) for x in (got, truth))
            axes = ("token", "h", "d")
    with np.errstate(invalid="ignore"):
        diff = np.abs(got - truth)
    over = ~np.isfinite(diff) | (diff > budget)
    if not over.any():
        return ""
    worst = np.unravel_index(int(np.argmax(np.where(np.isfinite(diff), diff, np.inf))), diff.shape)
    text = (f"{int(over.sum())} of {over.size} entries over budget, the worst at "
            + ", ".join(f"{a}={int(i)}" for a, i in zip(axes, worst)))
    if lengths is not None:  # the worst token's sequence, and its place there
        token = int(worst[axes.index("token")])
        starts = np.concatenate([[0], np.cumsum(lengths)])  # [B + 1]
        b = int(np.searchsorted(starts, token, side="right")) - 1
        what = "key" if name in ("dk", "dv") else "query"
        text += f" (sequence {b}, its {what} {token - int(starts[b])} of {lengths[b]})"
    row_axis = next((i for i, a in enumerate(axes) if a in ("query", "key", "token")), None)
    if row_axis is not None:
        rows = np.nonzero(over.any(axis=tuple(i for i in range(over.ndim) if i != row_axis)))[0]
        text += (f"; {axes[row_axis]} rows {_ranges(rows)} ({len(rows)} of "
                 f"{over.shape[row_axis]})")
    return text


def _group_sum(x: np.ndarray, G: int) -> np.ndarray:
    """[B, Hq, L, X] -> [B, Hkv, L, X]: the sum over each K/V head's G query heads."""
    B, Hq = x.shape[:2]
    return x.reshape((B, Hq // G, G) + x.shape[2:]).sum(axis=2)


def _sum_to(x: np.ndarray, shape: tuple) -> np.ndarray:
    """``x`` summed over the axes along which an array of ``shape`` was broadcast to it."""
    lead = x.ndim - len(shape)
    axes = tuple(range(lead)) + tuple(lead + i for i, n in enumerate(shape)
                                      if n == 1 and x.shape[lead + i] != 1)
    return np.sum(x, axis=axes, keepdims=True).reshape(shape)


def _case_scale(inp: CaseInputs) -> float:
    """The case's score scale: its ``scale`` option, else 1/sqrt(Dh)."""
    return inp.options.get("scale", 1.0 / math.sqrt(inp.q.shape[-1]))


def _dropped(x: Any, opts: dict) -> Any:
    """``x`` through the case's dropout, ``x * mask / (1 - p)`` (True = keep), or ``x`` when
    it has none; ``_dropped(1.0, opts)`` is the factor alone, [B, Hq, Lq, Lk] or 1.0."""
    if "dropout_mask" not in opts:
        return x
    return x * opts["dropout_mask"] / (1.0 - opts["dropout_p"])


def term_scales(inp: CaseInputs, truth: dict, empty: np.ndarray,
                dlse: Optional[np.ndarray] = None) -> dict:
    """The ``terms`` of each tensor (module docstring): the largest entry of its sums taken
    over absolute values, from the float64 truth of the case; ``dlse`` (B, Hq, Lq), the
    upstream gradient of lse with ``lse_grad``, adds to ``|delta|``."""
    # host float64: q [B, Hq, Lq, Dh], k [B, Hkv, Lk, Dh], v [B, Hkv, Lk, Dv], weights [B, Hq, Lq, Lk]
    q, k, v, dout, opts = inp.q, inp.k, inp.v, inp.dout, inp.options
    G = q.shape[1] // k.shape[1]
    kr, vr = np.repeat(k, G, axis=1), np.repeat(v, G, axis=1)  # [B, Hq, Lk, *]
    p = truth["weights"]  # [B, Hq, Lq, Lk] before dropout
    scale = _case_scale(inp)
    keep = _dropped(1.0, opts)  # [B, Hq, Lq, Lk] or 1.0
    a = np.abs(p * keep)  # [B, Hq, Lq, Lk]
    dp = np.abs((dout @ np.swapaxes(vr, -1, -2)) * keep)  # [B, Hq, Lq, Lk]
    delta = np.abs(np.sum(dout * truth["out"], axis=-1, keepdims=True))  # [B, Hq, Lq, 1]
    if dlse is not None:  # ds = p * (dp - delta + dlse)
        delta = delta + np.abs(dlse)[..., None]  # [B, Hq, Lq, 1]
    ds = p * (dp + delta)  # [B, Hq, Lq, Lk]
    lse = truth["lse"][~empty]
    res = {"out": float(np.max(a @ np.abs(vr), initial=0.0)),
           "lse": max(float(np.max(np.abs(lse), initial=0.0)), 1.0),
           "dv": float(np.max(_group_sum(np.swapaxes(a, -1, -2) @ np.abs(dout), G), initial=0.0)),
           "dq": float(np.max(ds @ np.abs(kr), initial=0.0)) * scale,
           "dk": float(np.max(_group_sum(np.swapaxes(ds, -1, -2) @ np.abs(q), G), initial=0.0)) * scale}
    mask = opts.get("mask")
    if mask is not None and mask.dtype != bool:  # dmask = ds summed to the mask's shape
        res["dmask"] = float(np.max(_sum_to(ds, mask.shape), initial=0.0))
    if "sinks" in opts:
        p_sink = np.exp(opts["sinks"][None, :, None] - truth["lse"])  # [B, Hq, Lq]
        res["dsinks"] = float(np.max(np.sum(p_sink * delta[..., 0], axis=(0, 2)), initial=0.0))
    return res


def _weighted_parts(inp: CaseInputs, truth: dict, dlse: Optional[np.ndarray], w: np.ndarray) -> tuple:
    """``(|ds| w, |a| w, delta - dlse)``: the parts of the gradients that the probabilities
    give, ``ds = p (dp - delta + dlse)`` and ``a`` the weights after dropout, each entry
    weighted by ``w`` (its row's ``|lse_i|`` or its own ``t_ij``), from the float64 truth."""
    # [B, Hq, Lq, 1] or [B, Hq, Lq, Lk] -> [B, Hq, Lq, Lk], [B, Hq, Lq, Lk], [B, Hq, Lq, 1]
    dout, opts = inp.dout, inp.options
    vr = np.repeat(inp.v, inp.q.shape[1] // inp.v.shape[1], axis=1)  # [B, Hq, Lk, Dv]
    p = truth["weights"]  # [B, Hq, Lq, Lk] before dropout
    keep = _dropped(1.0, opts)  # [B, Hq, Lq, Lk] or 1.0
    delta = np.sum(dout * truth["out"], axis=-1, keepdims=True)  # [B, Hq, Lq, 1]
    if dlse is not None:  # ds = p * (dp - delta + dlse)
        delta = delta - dlse[..., None]  # [B, Hq, Lq, 1]
    ds = np.abs(p * ((dout @ np.swapaxes(vr, -1, -2)) * keep - delta)) * w  # [B, Hq, Lq, Lk]
    a = np.abs(p * keep) * w  # [B, Hq, Lq, Lk]
    return ds, a, delta


def lse_scales(inp: CaseInputs, truth: dict, dlse: Optional[np.ndarray] = None) -> dict:
    """The ``terms_lse`` of each gradient (module docstring): the largest entry of
    ``sum_i |lse_i| |g_i|``, ``g_i`` the part of the gradient that row i's probabilities
    give, from the float64 truth of the case and its gradients.

    Rebuilding row i's probabilities from an lse off by ``d_i`` scales them, and so ``g_i``,
    by ``1 - d_i``: ``|d_i| <= u_lse |lse_i|`` bounds the change by ``u_lse * terms_lse``.
    ``g_i`` is ``dq_i`` for dq, ``a_ij dout_i`` for dv_j,
    ``ds_ij q_i * scale`` for dk_j (``ds = p (dp - delta + dlse)``; under softcap its
    factor ``tanh' <= 1`` is left out, an upper bound), ``ds_ij`` for dmask and
    ``p_sink_i (dlse_i - delta_i)`` for dsinks; dv, dk and dmask sum theirs over the
    rows of a K/V head's group and the mask's broadcast axes.
    """
    # host float64: q [B, Hq, Lq, Dh], k [B, Hkv, Lk, Dh], v [B, Hkv, Lk, Dv], weights [B, Hq, Lq, Lk]
    q, dout, opts = inp.q, inp.dout, inp.options
    G = q.shape[1] // inp.v.shape[1]
    lse = truth["lse"]  # [B, Hq, Lq], -inf on rows with nothing to attend
    w = np.where(np.isfinite(lse), np.abs(lse), 0.0)[..., None]  # [B, Hq, Lq, 1] |lse_i|
    scale = _case_scale(inp)
    ds, a, delta = _weighted_parts(inp, truth, dlse, w)  # [B, Hq, Lq, Lk] (2), [B, Hq, Lq, 1]
    dv = _group_sum(np.swapaxes(a, -1, -2) @ np.abs(dout), G)  # [B, Hkv, Lk, Dv]
    dk = _group_sum(np.swapaxes(ds, -1, -2) @ np.abs(q), G) * scale  # [B, Hkv, Lk, Dh]
    res = {"dq": float(np.max(w * np.abs(truth["dq"]), initial=0.0)),
           "dv": float(np.max(dv, initial=0.0)), "dk": float(np.max(dk, initial=0.0))}
    mask = opts.get("mask")
    if mask is not None and mask.dtype != bool:
        res["dmask"] = float(np.max(_sum_to(ds, mask.shape), initial=0.0))
    if "sinks" in opts:
        finite = np.isfinite(lse)
        p_sink = np.exp(opts["sinks"][None, :, None] - np.where(finite, lse, 0.0))  # [B, Hq, Lq]
        g = np.where(finite, p_sink * np.abs(delta[..., 0]) * w[..., 0], 0.0)  # [B, Hq, Lq]
        res["dsinks"] = float(np.max(np.sum(g, axis=(0, 2)), initial=0.0))
    return res


def score_scales(inp: CaseInputs, truth: dict, dlse: Optional[np.ndarray] = None) -> dict:
    """The ``terms_scores`` of each gradient (module docstring, "Recomputed scores"): the
    largest entry of ``sum t_ij |g_ij|``, ``t_ij = scale * |q_i| . |k_j|`` (the sum of
    absolute values that the score ``s_ij`` rounds in), ``g_ij`` the part of the gradient that
    the probability ``p_ij`` gives, from the float64 truth of the case and its gradients.

    Rebuilding ``p_ij = exp(s_ij - lse_i)`` from a score whose rounding differs from the
    forward's by ``e_ij`` scales it, and so ``g_ij``, by ``1 - e_ij``. ``g_ij`` is
    ``ds_ij k_j * scale`` for dq_i, ``a_ij dout_i`` for dv_j, ``ds_ij q_i * scale`` for dk_j
    (``ds = p (dp - delta + dlse)``) and ``ds_ij`` for dmask; dv, dk and dmask sum theirs
    over the rows of a K/V head's group and the mask's broadcast axes. Under softcap the
    rounding ``e`` of the scaled score r moves ``s = c tanh(r / c)`` by ``T' e`` and the
    factor ``T' = 1 - tanh^2`` that dq and dk take by ``-2 T' tanh / c * e``: dq and dk
    carry ``|T' (T' - 2 tanh / c)| <= 1 + 2 / c``, dv and dmask ``T' <= 1``. dsinks gets
    none: the sink's logit is no dot product, ``p_sink = exp(sink - lse)``, and ``delta =
    dout . out`` is the forward's (a backward that sums delta from its rebuilt p moves
    it too).
    """
    # host float64: q [B, Hq, Lq, Dh], k [B, Hkv, Lk, Dh], v [B, Hkv, Lk, Dv], weights [B, Hq, Lq, Lk]
    q, dout, opts = inp.q, inp.dout, inp.options
    G = q.shape[1] // inp.k.shape[1]
    kr = np.repeat(inp.k, G, axis=1)  # [B, Hq, Lk, Dh]
    scale = _case_scale(inp)
    t = (np.abs(q) @ np.swapaxes(np.abs(kr), -1, -2)) * scale  # [B, Hq, Lq, Lk] t_ij
    ds, a, _ = _weighted_parts(inp, truth, dlse, t)  # [B, Hq, Lq, Lk] each
    soft = 1.0 + 2.0 / float(opts["softcap"]) if opts.get("softcap") is not None else 1.0
    res = {"dq": float(np.max(ds @ np.abs(kr), initial=0.0)) * scale * soft,
           "dv": float(np.max(_group_sum(np.swapaxes(a, -1, -2) @ np.abs(dout), G), initial=0.0)),
           "dk": float(np.max(_group_sum(np.swapaxes(ds, -1, -2) @ np.abs(q), G), initial=0.0))
           * scale * soft}
    mask = opts.get("mask")
    if mask is not None and mask.dtype != bool:
        res["dmask"] = float(np.max(_sum_to(ds, mask.shape), initial=0.0))
    if "sinks" in opts:
        res["dsinks"] = 0.0
    return res


def merge_scales(inp: CaseInputs, truth: dict) -> dict:
    """The ``terms_lse`` of a split-KV merge (module docstring, "The merge of partial
    results"): what rounding each partial log-sum-exp ``lse_s`` by at most ``u_lse |lse_s|``
    moves out by, and, through ``delta = rowsum(dout * out)``, the gradients of a backward
    that takes that out; from the float64 truth of the case.

    out: the largest entry of ``E_i = sum_j m_ij |a_ij v_j - p_ij out_i| + |lse_i| |out_i| +
    m_i,sink p_sink_i |out_i|``, ``m_ij = max(|lse_i|, |s_ij|)`` (``s_ij = lse_i + log p_ij``)
    bounding the ``|lse_s|`` of any split that holds key j (the sink: a key that carries no
    value), ``|lse_i|`` the rounding of the merged lse. With ``D_i = sum_j m_ij |a_ij dout_i
    . v_j - p_ij delta_i| + |lse_i| |delta_i| + m_i,sink p_sink_i |delta_i|``,
    ``delta_i = dout_i . out_i``, which bounds ``|dout_i . e_i| / u_lse`` (``e_i`` the change
    of ``out_i``): ``D_i (p_i |k|) * scale`` for dq, ``sum_i p_ij D_i |q_i| * scale``
    for dk_j (summed over the group), ``p_ij D_i`` summed over the mask's broadcast axes for
    dmask, ``sum_i p_sink_i D_i`` for dsinks; dv does not read out and gets none.
    """
    # host float64: q [B, Hq, Lq, Dh], k [B, Hkv, Lk, Dh], v [B, Hkv, Lk, Dv], weights [B, Hq, Lq, Lk]
    q, k, v, dout, opts = inp.q, inp.k, inp.v, inp.dout, inp.options
    G = q.shape[1] // k.shape[1]
    kr, vr = np.repeat(k, G, axis=1), np.repeat(v, G, axis=1)  # [B, Hq, Lk, *]
    p = truth["weights"]  # [B, Hq, Lq, Lk] before dropout
    out = truth["out"]  # [B, Hq, Lq, Dv]
    lse = truth["lse"]  # [B, Hq, Lq], -inf on rows with nothing to attend
    finite = np.isfinite(lse)
    lse_abs = np.where(finite, np.abs(lse), 0.0)  # [B, Hq, Lq]
    attended = p > 0.0
    s_abs = np.abs(np.where(finite, lse, 0.0)[..., None]
                   + np.log(np.where(attended, p, 1.0)))  # [B, Hq, Lq, Lk] |s_ij|
    m = np.where(attended, np.maximum(lse_abs[..., None], s_abs), 0.0)  # [B, Hq, Lq, Lk]
    a = _dropped(p, opts)  # [B, Hq, Lq, Lk]
    # sum_j m_ij |a_ij v_jd - p_ij out_id|, over chunks of Dv (it does not factor)
    E = np.zeros(out.shape)  # [B, Hq, Lq, Dv]
    Dv = out.shape[-1]
    step = max(1, (1 << 22) // max(p.size, 1))
    for d0 in range(0, Dv, step):
        d1 = min(d0 + step, Dv)
        diff = (a[..., None] * vr[:, :, None, :, d0:d1]
                - p[..., None] * out[:, :, :, None, d0:d1])  # [B, Hq, Lq, Lk, d]
        E[..., d0:d1] = np.sum(m[..., None] * np.abs(diff), axis=3)
    sink_w = p_sink = None  # max(|lse_i|, |sink|) p_sink_i, and p_sink_i
    if "sinks" in opts:  # the sink: a key carrying no value, s = sink
        sink = opts["sinks"][None, :, None]  # [1, Hq, 1]
        p_sink = np.where(finite, np.exp(sink - np.where(finite, lse, 0.0)), 0.0)  # [B, Hq, Lq]
        sink_w = np.maximum(lse_abs, np.abs(sink)) * p_sink  # [B, Hq, Lq]
        E += sink_w[..., None] * np.abs(out)
    # the merged lse, rounded by at most u_lse |lse_i|, in every w_s = exp(lse_s - lse)
    E += lse_abs[..., None] * np.abs(out)
    res = {"out": float(np.max(E, initial=0.0))}
    if "dq" not in truth:
        return res
    scale = _case_scale(inp)
    # dout_i . e_i = sum_s d_s sum_{j in s} (a_ij dout_i . v_j - p_ij delta_i), delta_i = dout_i . out_i
    dpv = a * (dout @ np.swapaxes(vr, -1, -2))  # [B, Hq, Lq, Lk] a_ij dout_i . v_j
    delta = np.sum(dout * out, axis=-1)  # [B, Hq, Lq]
    D = np.sum(m * np.abs(dpv - p * delta[..., None]), axis=-1)  # [B, Hq, Lq]
    D += lse_abs * np.abs(delta)  # the merged lse's own rounding
    if sink_w is not None:
        D += sink_w * np.abs(delta)
    D = D[..., None]  # [B, Hq, Lq, 1] bounds |dout_i . e_i| / u_lse
    pd = p * D  # [B, Hq, Lq, Lk]
    res["dq"] = float(np.max(D * (p @ np.abs(kr)), initial=0.0)) * scale
    res["dk"] = float(np.max(_group_sum(np.swapaxes(pd, -1, -2) @ np.abs(q), G), initial=0.0)) * scale
    res["dv"] = 0.0
    mask = opts.get("mask")
    if mask is not None and mask.dtype != bool:
        res["dmask"] = float(np.max(_sum_to(pd, mask.shape), initial=0.0))
    if sink_w is not None:
        res["dsinks"] = float(np.max(np.sum(p_sink * D[..., 0], axis=(0, 2)), initial=0.0))
    return res


def lse_unit(dtype: str) -> float:
    """The unit roundoff of lse's dtype (``"float32"`` or ``"float64"``; float16 and bfloat16
    give lse in float32): half the spacing of the numbers at 1, so that rounding lse to it
    moves it by at most ``lse_unit * |lse|`` (2**-24 for float32, 2**-53 for float64)."""
    return float(np.finfo("float32" if dtype in ("float16", "bfloat16") else dtype).eps) / 2.0


def _empty_rows(weights: np.ndarray) -> np.ndarray:
    """Bool (B, Hq, Lq): rows with nothing to attend (all weights zero)."""
    return ~np.any(weights != 0.0, axis=-1)


def _saturation(weights: np.ndarray, empty: np.ndarray) -> Optional[str]:
    """A note when the softmax is saturated (see ``SATURATED_ROWS``), else None."""
    rows = ~empty
    if not rows.any():
        return None
    top = np.max(weights, axis=-1)[rows]
    frac = float(np.mean(top > SATURATED_WEIGHT))
    if frac > SATURATED_ROWS:
        return (f"saturated softmax: {frac:.0%} of rows put > {SATURATED_WEIGHT} on one key, "
                "so the softmax gradient vanishes")
    return None


def _nan_note(name: str, got: Any, empty: np.ndarray) -> str:
    """"NaN on empty rows" when every non-finite entry of ``got`` (out or dq, (B, Hq, Lq, D))
    lies on a row with nothing to attend, else ""."""
    if got is None or name not in ("out", "dq") or not empty.any():
        return ""
    bad = ~np.isfinite(got)
    if bad.ndim == 4:
        bad = bad.any(axis=-1)
    if bad.shape == empty.shape and bad.any() and not (bad & ~empty).any():
        return "NaN on empty rows"
    return ""


# --------------------------------------------------------------------------
# near misses: the common mistake that a failing out (or lse) is, exactly

#: A mistake is named only when what it gives lies more than this many budgets from npattn's
#: truth: a kernel within one budget of it is then more than ``MISS_SEPARATION - 1`` budgets
#: from the truth, and a mistake that moves the case by less (a window edge past the ends of
#: the keys, a scale in a row of one key) is never named for an output that is wrong otherwise.
MISS_SEPARATION = 10.0
#: npattn's keywords whose effect depends on the alignment of queries and keys
_ALIGNED_KEYWORDS = ("is_causal", "window", "alibi_slopes")


def forward_variants(inp: CaseInputs, pack: Optional[Packing] = None) -> list:
    """``(mistake, inputs)`` pairs: npattn inputs whose forward is what a kernel making that
    common mistake gives for the case ``inp`` (the keys of ``inp.options`` are npattn's:
    scale, is_causal, align, window, alibi_slopes, enable_gqa, sinks, mask, dropout_p,
    dropout_mask). The mistakes: scale= ignored, or, without it, a default scale of 1/Dh or
    1; causal, window and ALiBi aligned the other way (when Lq != Lk); a window edge off by
    one; query head h reading K/V head h % Hkv under GQA; sinks ignored; a boolean mask's
    sense inverted; the dropout keep-mask not applied. The texts hold no number of the
    case, so that the cases making one mistake share one hint (``panel_hints`` counts them).
    ``pack``: layout "thd"'s sequences, whose own Lq_b != Lk_b also make the alignment count.
    """
    o = inp.options
    Hq, Lq = inp.q.shape[1], inp.q.shape[2]
    Hkv, Lk = inp.k.shape[1], inp.k.shape[2]
    found: list = []

    def variant(mistake: str, drop: tuple = (), q: Any = None, k: Any = None, v: Any = None,
                **changes: Any) -> None:
        """The case with the options ``drop`` removed, ``changes`` set, q, k, v replaced."""
        opts = {n: a for n, a in o.items() if n not in drop}
        opts.update(changes)
        found.append((mistake, CaseInputs(inp.q if q is None else q, inp.k if k is None else k,
                                          inp.v if v is None else v, inp.dout, opts, inp.dlse)))

    if "scale" in o:
        variant("scale= ignored: out is npattn's with the default scale 1/sqrt(Dh), not the "
                "scale passed", drop=("scale",))
    else:
        Dh = inp.q.shape[3]
        variant("the default scale taken as 1/Dh: out is npattn's with scale=1/Dh; without "
                "scale= it is 1/sqrt(Dh)", scale=1.0 / Dh)
        variant("the scores not scaled: out is npattn's with scale=1; without scale= the "
                "scale is 1/sqrt(Dh)", scale=1.0)
    aligned = [n for n in _ALIGNED_KEYWORDS if n in o]  # options set
    if aligned and (Lq != Lk or (pack is not None and pack.lq != pack.lk)):
        asked = o.get("align", "top_left")
        other = "top_left" if asked == "bottom_right" else "bottom_right"
        what = " and ".join({"is_causal": "causal", "alibi_slopes": "ALiBi"}.get(n, n)
                            for n in aligned)
        flip = {"align": other} if other == "bottom_right" else {}
        variant(f"{what} aligned {other} where {asked} is asked: out is npattn's with "
                f"align={other!r}; query i's diagonal is key i top_left, key i + Lk - Lq "
                "bottom_right", drop=("align",), **flip)
    if "window" in o:
        left, right = o["window"]
        for side, w in (("left", left), ("right", right)):
            for d in (-1, 1):
                if w is None or w + d < 0:
                    continue
                new = (w + d, right) if side == "left" else (left, w + d)
                variant(f"the window's {side} edge off by one ({side} {d:+d}): query i attends "
                        "keys j with i + o - left <= j <= i + o + right, both ends included",
                        window=new)
    if o.get("enable_gqa") and 1 < Hkv < Hq and Hq % Hkv == 0:
        idx = np.arange(Hq) % Hkv  # [Hq]: the mistaken map, the K/V heads tiled
        variant("query head h reads K/V head h % Hkv (the K/V heads tiled): under GQA it "
                "reads head h // G, G = Hq / Hkv query heads per K/V head (repeated)",
                drop=("enable_gqa",), k=inp.k[:, idx], v=inp.v[:, idx])
    if "sinks" in o:
        variant("sinks ignored: out is npattn's without them; each row's softmax denominator "
                "gains exp(sink - m), a term that carries no value", drop=("sinks",))
    mask = o.get("mask")
    if mask is not None and mask.dtype == bool:
        variant("the boolean mask's sense inverted: out is npattn's with ~mask; True = may "
                "attend", mask=~mask)
    if "dropout_mask" in o:
        variant("the dropout keep-mask not applied: out is npattn's without dropout; A = P * "
                "keep / (1 - p)", drop=("dropout_p", "dropout_mask"))
    return found


def _within(got: np.ndarray, want: np.ndarray, rows: np.ndarray, budget: float) -> bool:
    """Whether ``got`` is finite and within ``budget`` of ``want`` on ``rows`` (bool, the
    leading axes of both: (B, Hq, Lq))."""
    g, w = got[rows], want[rows]
    return bool(np.all(np.isfinite(g)) and np.max(np.abs(g - w), initial=0.0) <= budget)


def _apart(want: np.ndarray, truth: np.ndarray, rows: np.ndarray, budget: float) -> bool:
    """Whether ``want`` lies more than ``MISS_SEPARATION`` budgets from ``truth`` on ``rows``."""
    w, t = want[rows], truth[rows]
    return bool(np.any(np.abs(w - t) > MISS_SEPARATION * budget))


def _moved(x: np.ndarray, src: np.ndarray, dst: np.ndarray, fill: Any, axis: int = 2) -> np.ndarray:
    """Layout "thd": each packed sequence's rows of ``x`` [B, H, L, ...] on ``axis`` moved from
    ``src`` [B, L] to ``dst`` [B, L] (the same count in each batch entry), ``fill`` elsewhere."""
    out = np.full_like(x, fill)
    np.moveaxis(out, axis, 1)[dst] = np.moveaxis(x, axis, 1)[src]  # [total, H, ...]
    return out


def _moved_keep(keep: np.ndarray, pack: Packing, there: Packing) -> np.ndarray:
    """Layout "thd": a keep-mask [B, Hq, Lq, Lk] with each sequence's block moved from the
    rows and keys of ``pack`` to those of ``there``, False elsewhere."""
    keep = _moved(keep, pack.q_rows, there.q_rows, False)  # the queries' axis
    return _moved(keep, pack.k_rows, there.k_rows, False, axis=3)  # the keys'


def _repacked(inp: CaseInputs, pack: Packing, there: Packing) -> CaseInputs:
    """Layout "thd": the reference's inputs ``inp`` of the packing ``pack`` with each sequence
    moved to the rows of ``there`` (the other end of its batch entry), masked by its own."""
    q_at, k_at = (pack.q_rows, there.q_rows), (pack.k_rows, there.k_rows)
    opts = {**inp.options, "mask": there.pad_mask()}
    if "dropout_mask" in opts:
        opts["dropout_mask"] = _moved_keep(opts["dropout_mask"], pack, there)
    return CaseInputs(_moved(inp.q, *q_at, 0.0), _moved(inp.k, *k_at, 0.0),
                      _moved(inp.v, *k_at, 0.0), _moved(inp.dout, *q_at, 0.0), opts, inp.dlse)


def _out_candidates(inp: CaseInputs, truth: dict, pack: Optional[Packing] = None) -> Iterator[tuple]:
    """``(mistake, out, lse, empty)`` for each mistake that ``out_misses`` tries: its out
    (B, Hq, Lq, Dv), lse (B, Hq, Lq) and rows with nothing to attend (B, Hq, Lq), computed
    one at a time as they are read; a variant npattn refuses is left out (that mistake is
    not the kernel's). ``pack``, in layout "thd": a variant aligned the other way aligns
    each sequence on its own lengths, computed with the sequences at the other end of their
    batch entries (where the padded diagonal is theirs in that alignment)."""
    empty = _empty_rows(truth["weights"])  # [B, Hq, Lq]
    p = inp.options.get("dropout_p")
    if inp.options.get("dropout_mask") is not None and p:  # lse does not see dropout
        why = "; A = P * keep / (1 - p)"
        yield ("dropout scaled by (1 - p) where 1/(1 - p) belongs: out is npattn's x "
               "(1 - p)^2" + why, truth["out"] * (1.0 - p) ** 2, truth["lse"], empty)
        yield ("dropout's 1/(1 - p) left out: out is npattn's x (1 - p)" + why,
               truth["out"] * (1.0 - p), truth["lse"], empty)
    # (mistake, its inputs, the packing they are computed in: None, ``pack``'s own)
    variants: list[tuple[str, CaseInputs, Optional[Packing]]] = [
        (mistake, var, None) for mistake, var in forward_variants(inp, pack)]
    aligned = [n for n in _ALIGNED_KEYWORDS if n in inp.options]
    offsets = set() if pack is None else {k - q for q, k in zip(pack.lq, pack.lk)}
    if pack is not None and pack.left and aligned and len(offsets) > 1:
        # bottom-right on the longest lengths: the padding at the end, the padded diagonal
        # (offset max_seqlen_k - max_seqlen_q) each sequence's
        variants.append(("every packed sequence aligned by max_seqlen_k - max_seqlen_q: "
                         "bottom-right aligns each on its own lengths, query i's diagonal key "
                         "i + Lk_b - Lq_b", inp, replace(pack, left=False)))
    for mistake, var, there in variants:
        if pack is not None and there is None and var.options.get("align") != inp.options.get("align"):
            there = replace(pack, left=not pack.left)
        if pack is not None and there is not None:
            var = _repacked(var, pack, there)
        try:
            res = _npattn(var, "float64", grads=False, weights=True)
        except Exception:
            continue
        out, lse, empty = res["out"], res["lse"], _empty_rows(res["weights"])
        if pack is not None and there is not None:  # back to the rows of ``pack``
            out, lse, empty = (_moved(x, there.q_rows, pack.q_rows, fill)
                               for x, fill in ((out, 0.0), (lse, -np.inf), (empty, True)))
        yield mistake, out, lse, empty


def out_misses(inp: CaseInputs, got: dict, truth: dict, tensors: dict,
               pack: Optional[Packing] = None) -> list:
    """The mistakes whose forward the kernel's failing out is, exactly: within out's budget
    of it, and of lse's too when lse is compared (on the rows where the mistake and npattn
    have something to attend; a row with nothing to attend under the mistake may hold
    anything); only mistakes more than ``MISS_SEPARATION`` budgets from the truth count.

    ``got`` and ``truth`` hold host float64 tensors, (B, Hq, Lq, Dv) out and (B, Hq, Lq) lse
    (``truth`` also the weights); the mistakes are ``forward_variants`` and, with dropout, an
    out of npattn's x (1 - p) (1/(1 - p) left out) or x (1 - p)^2 ((1 - p) for 1/(1 - p)).
    ``pack``: in layout "thd", where the packed sequences lie (``_out_candidates``)."""
    out, t_out = got.get("out"), tensors["out"]
    if out is None or out.shape != truth["out"].shape:
        return []
    t_lse = tensors.get("lse")
    lse = None if t_lse is None else got.get("lse")  # compared too, when the kernel gives it
    if t_lse is not None and (lse is None or lse.shape != truth["lse"].shape):
        return []
    empty = _empty_rows(truth["weights"])  # [B, Hq, Lq]
    found = []
    for mistake, alt_out, alt_lse, alt_empty in _out_candidates(inp, truth, pack):
        rows = ~alt_empty  # [B, Hq, Lq]
        if not (_apart(alt_out, truth["out"], rows, t_out.budget)
                and _within(out, alt_out, rows, t_out.budget)):
            continue
        if (lse is not None and t_lse is not None
                and not _within(lse, alt_lse, rows & ~empty, t_lse.budget)):
            continue
        found.append(mistake)
    return found


def lse_misses(inp: CaseInputs, got: dict, truth: dict, tensors: dict) -> list:
    """The mistakes that the kernel's failing lse (out right) is, exactly: lse in base 2
    (``lse / ln 2``), or the log of the row sum without the row max added back (``lse - m``,
    m the row's largest score, ``lse - m = -log(max_j p_ij)``; with sinks m may hold the sink
    too, ``max(m, sink)``); within lse's budget on the rows with something to attend, and
    more than ``MISS_SEPARATION`` budgets from npattn's."""
    lse, t_lse = got.get("lse"), tensors["lse"]
    truth_lse = truth["lse"]  # [B, Hq, Lq], -inf on rows with nothing to attend
    if lse is None or lse.shape != truth_lse.shape:
        return []
    rows = ~_empty_rows(truth["weights"])  # [B, Hq, Lq]
    t = np.where(rows, truth_lse, 0.0)  # [B, Hq, Lq]
    m = t + np.log(np.where(rows, np.max(truth["weights"], axis=-1), 1.0))  # [B, Hq, Lq]
    maxes = [m]
    sinks = inp.options.get("sinks")
    if sinks is not None:  # the sink counted as a score of the row
        maxes.append(np.maximum(m, np.asarray(sinks, dtype=np.float64)[None, :, None]))
    candidates = [(t / math.log(2.0), "lse in base 2: lse is npattn's / ln 2 (log2 of the row "
                   "sum, as exp2-based kernels keep it); npattn's is the natural log: multiply "
                   "by ln 2")]
    candidates += [(t - mx, "lse without the row max: lse is log(l), l = sum_j exp(s_ij - m_i); "
                    "lse = m_i + log(l)") for mx in maxes]
    found: list = []
    for alt, mistake in candidates:
        if (mistake not in found and _apart(alt, t, rows, t_lse.budget)
                and _within(lse, alt, rows, t_lse.budget)):
            found.append(mistake)
    return found


def near_miss(inp: CaseInputs, got: dict, truth: dict, tensors: dict,
              pack: Optional[Packing] = None) -> str:
    """The common mistake that a failing case's out (``out_misses``) or, out right, lse
    (``lse_misses``) is exactly, for the hint; "" when none is, or when the search itself
    fails (it only diagnoses: the case has failed already). Two mistakes that give the same
    numbers here (a flipped alignment and a window edge off by one, when Lk - Lq = 1) are
    named both."""
    try:
        with np.errstate(all="ignore"), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            t_out, t_lse = tensors.get("out"), tensors.get("lse")
            found: list = []
            if t_out is not None and t_out.status == "fail":
                found = out_misses(inp, got, truth, tensors, pack)
            elif t_lse is not None and t_lse.status == "fail":
                found = lse_misses(inp, got, truth, tensors)
    except Exception:
        return ""
    if len(found) > 1:
        return "one of these, which give the same numbers here: " + "; or ".join(found)
    return found[0] if found else ""


def _copied(inp: CaseInputs) -> CaseInputs:
    """``inp`` with every array copied."""
    copy = (lambda a: a.copy() if isinstance(a, np.ndarray) else a)
    return CaseInputs(copy(inp.q), copy(inp.k), copy(inp.v), copy(inp.dout),
                      {n: copy(a) for n, a in inp.options.items()}, copy(inp.dlse))


def _written(inp: CaseInputs, given: CaseInputs) -> list:
    """The names of the arrays of ``given`` (copies of ``inp``'s) that are no longer equal."""
    pairs: list = [("q", inp.q, given.q), ("k", inp.k, given.k), ("v", inp.v, given.v),
                   ("dout", inp.dout, given.dout), ("dlse", inp.dlse, given.dlse)]
    pairs += [(n, a, given.options[n]) for n, a in inp.options.items()]
    return [n for n, a, b in pairs if isinstance(a, np.ndarray)
            and not np.array_equal(a, b, equal_nan=a.dtype.kind == "f")]


def _run_case(case: Case, cfg: _Config, reproducer: str) -> CaseResult:
    start = time.perf_counter()
    raw = case_inputs(case, cfg.seed, cfg.align)
    inp = _rounded_inputs(raw, cfg.dtype)
    kernel_inp, pack = inp, None  # what the kernel is given; "thd": where its sequences lie
    padding = np.zeros((case.B, 1, case.Lq), dtype=bool)  # [B, 1, Lq]: rows of no sequence
    if cfg.layout == "thd":
        pack = packing(case, cfg.align)
        inp, kernel_inp = _packed_inputs(inp, pack)
        padding = ~pack.q_rows[:, None, :]
    dlse = inp.dlse if cfg.lse_grad else None
    truth = _npattn(inp, "float64", grads=cfg.gradients, weights=True, dlse=dlse)
    dlse = truth.get("dlse")  # zero on rows whose lse is not finite
    ref = _npattn(inp, cfg.dtype, grads=cfg.gradients, dlse=dlse)
    empty = _empty_rows(truth["weights"])  # [B, Hq, Lq]
    if (empty & ~padding).any() and "empty_rows" not in cfg.supports:
        raise ValueError(f"cases: case {case.name!r} leaves rows with nothing to attend, but "
                         "supports does not declare 'empty_rows' (the kernel is not asked to "
                         "handle them): declare it, or change the case")
    result = CaseResult(case, reproducer=reproducer)
    if pack is not None:
        result.sequences = list(zip(pack.lq, pack.lk))
    given = _copied(kernel_inp)  # the kernel's own arrays: what it writes cannot change the budgets
    try:
        got = _run_kernel(given, cfg, dlse, pack)
    except (Exception, SystemExit) as exc:  # the kernel's failure (sys.exit too) is this case's result
        result.error = f"{type(exc).__name__}: {exc}"
        if not _rejected_return(exc):  # verify's own frames say nothing about the kernel
            result.traceback = "".join(traceback.format_exception(exc))
        result.hint = _raise_hint(exc, cfg.flags)
        result.tensors = {n: TensorResult(n, math.inf, 0.0, 0.0, 0.0, 0.0, "fail", "raised")
                          for n in _checked(cfg, case)}
        result.seconds = time.perf_counter() - start
        return result
    dtypes = got.pop("dtypes")
    written = got.pop("written")
    shapes = got.pop("shapes")  # not of the layout's shape: compared as missing, told by shape
    for n in shapes:
        got.pop(n)
    written += [n for n in _written(kernel_inp, given) if n not in written]
    if written:  # options: the kernel's own copies, and the case's arrays where they share memory
        result.written = list(written)
        result.error = (f"fn wrote into its inputs {', '.join(written)}: a kernel must leave them "
                        "as they were (its outputs are compared all the same)")
    saturated = _saturation(truth["weights"], empty)
    terms = term_scales(inp, truth, empty, dlse)
    # the rounding of lse in its dtype, through p = exp(s - lse) (module docstring)
    lse_terms = lse_scales(inp, truth, dlse) if cfg.gradients else {}
    # and of the scores a backward recomputes, rounded otherwise than the forward's
    score_terms = score_scales(inp, truth, dlse) if cfg.gradients else {}
    # and of the partial lse of a split-KV merge, into out and through delta the gradients
    merge_terms = merge_scales(inp, truth)
    u_lse = lse_unit(ref["dtypes"]["lse"])
    factors, notes = {}, {}
    for n in _checked(cfg, case, got):
        skip = None
        if n == "lse":  # a row with no key but a sink has lse = sink, finite: compared
            # (but for the padding of "thd", which is no query's row)
            skip = empty & (padding | ~np.isfinite(truth["lse"]))
        elif n == "dmask":  # -inf entries: zero gradient on both sides, not compared
            skip = ~np.isfinite(inp.options["mask"])
        floor_dtype = ref["dtypes"][n] if ref["dtypes"][n] in FLOORS else cfg.dtype
        lse_floor = 0.0
        if n in LSE_ROUNDED:
            lse_floor = u_lse * (lse_terms.get(n, 0.0) + merge_terms.get(n, 0.0)
                                 + SCORE_ROUNDINGS * score_terms.get(n, 0.0))
        tr, factor = _compare(n, got.get(n), truth[n], ref[n], floor_dtype, terms[n], cfg, skip,
                              saturated, lse_floor, shapes.get(n), pack)
        nan = _nan_note(n, got.get(n), empty)
        if nan and tr.status == "fail":
            tr.note = nan
        elif tr.status == "fail" and n in ("out", "dq") and empty.any() and not tr.note:
            # right but for the rows with nothing to attend (where npattn gives zeros)?
            rows = np.broadcast_to(empty[..., None], truth[n].shape)
            rest, _ = _compare(n, got[n], truth[n], ref[n], floor_dtype, terms[n], cfg, rows,
                               saturated, lse_floor)
            if rest.status != "fail":
                tr.note = "not zero on empty rows"
        if n in dtypes:  # the right numbers in another dtype or library are still not the contract
            tr.status = "fail"
            tr.note = dtypes[n]
        result.tensors[n] = tr
        notes[n] = tr.note
        if factor is not None:
            factors[n] = factor
    # the common mistake that a failing out (or lse) is exactly: for failing cases only
    miss = near_miss(inp, got, truth, result.tensors, pack) if result.failing else ""
    result.hint = (case_hint(case, result.tensors, factors, notes, lse_grad=cfg.lse_grad,
                             miss=miss) if result.failing else "")
    if written and not result.failing:  # right numbers, but the caller's arrays changed
        result.hint = (f"fn wrote into {', '.join(written)}: compute on new arrays (or copies) "
                       "and leave the inputs as they were")
    result.seconds = time.perf_counter() - start
    return result


def _checked(cfg: _Config, case: Case, got: Optional[dict] = None) -> list:
    """The tensors checked in ``case``, given what the kernel returned (``got``; None when it
    raised): dmask with a float mask when ``mask_grad`` is True, or None and one was given."""
    names = ["out"] + (["lse"] if cfg.returns_lse else [])
    if cfg.gradients:
        names += ["dq", "dk", "dv"]
        if "mask_float" in case.options and (cfg.mask_grad is True or (
                cfg.mask_grad is None and got is not None and got.get("dmask") is not None)):
            names.append("dmask")
        names += ["dsinks"] if "sinks" in case.options else []
    return names


def _rejected_return(exc: BaseException) -> bool:
    """Whether ``exc`` is verify's own check of what ``fn`` or ``backward`` returned (raised
    in this module after the kernel returned), not an error of the kernel."""
    frames = traceback.extract_tb(exc.__traceback__)
    return (isinstance(exc, TypeError) and str(exc).startswith(("fn: expected", "backward: "))
            and bool(frames) and frames[-1].filename == __file__)


def _raise_hint(exc: BaseException, flags: Optional[Mapping] = None) -> str:
    text = str(exc)
    if isinstance(exc, TypeError) and "'dlse'" in text:
        return (f"backward does not take dlse=: with {_setting('lse_grad', True, flags)} it is "
                "called as backward(dout, *saved, dlse=dlse)")
    if isinstance(exc, TypeError) and "keyword" in text and ("cu_seqlens" in text or "max_seqlen" in text):
        return (f"fn does not take the keywords of {_setting('layout', 'thd', flags)}: it is called "
                "fn(q, k, v, cu_seqlens_q=, cu_seqlens_k=, max_seqlen_q=, max_seqlen_k=, "
                "**options), flash-attn's varlen names")
    if isinstance(exc, TypeError) and "keyword" in text:
        example = {"is_causal": "causal", "align": None}
        return ("fn does not take a keyword of this case: rename or drop it with "
                f"{_setting('adapter', ..., flags)} (e.g. {_setting('adapter', example, flags)})")
    if _rejected_return(exc):  # verify's own check, not a TypeError the kernel raised in those words
        return "what fn or backward returned is not what verify reads: see the error"
    frames = traceback.extract_tb(exc.__traceback__)
    if isinstance(exc, TypeError) and "positional argument" in text and frames and \
            frames[-1].filename == __file__:  # the call itself failed, not a call in fn's code
        return ("fn's signature does not take the call verify makes, fn(q, k, v, **options), "
                "or backward's, backward(dout, *saved) (docs/verify.md, 'What your "
                "function receives and returns'); 'at' is verify's call")
    if isinstance(exc, SystemExit):
        return "fn called sys.exit (SystemExit): a kernel must return or raise, not exit"
    return ("fn raised: 'at' is the innermost frame; the whole traceback is the case's "
            "traceback (report.failures[i].traceback, and in the JSON)")


# --------------------------------------------------------------------------
# the entry point


def _setting(name: str, value: Any, flags: Optional[Mapping] = None) -> str:
    """How a message names verify's keyword ``name`` set to ``value`` (``...``: the keyword
    alone): ``name=value`` for Python callers; with ``flags`` (verify's ``flags=``, the
    command line's) the flag: ``--name`` for a switch or the keyword alone, else
    ``--name value`` as a shell would take it."""
    flag = (flags or {}).get(name)
    if flag is None:
        return f"{name}=" if value is ... else f"{name}={value!r}"
    if value is ... or value is True:
        return flag
    if isinstance(value, Mapping):
        value = json.dumps(value)
    elif isinstance(value, (list, tuple)):
        value = ",".join(map(str, value))
    return f"{flag} {shlex.quote(str(value))}"


def _describe_callable(f: Any) -> str:
    """``module:qualname`` of ``f``, or its repr."""
    mod, qual = getattr(f, "__module__", None), getattr(f, "__qualname__", None)
    if mod and qual and "<" not in qual:
        return f"{mod}:{qual}"
    return repr(f)


def _is_number(x: Any) -> bool:
    """A real number (a Python or NumPy int or float), not a bool; ``verify`` holds it as a
    Python float (the report's JSON)."""
    return isinstance(x, numbers.Real) and not isinstance(x, (bool, np.bool_))


def _check_args(layout: Any, dtype: Any, backward: Any, autograd: Any, budget_factor: Any,
                align: Any, adapter: Any, floors: Any) -> None:
    check_choice("layout", layout, LAYOUTS)
    check_choice("dtype", dtype, DTYPES)
    check_choice("autograd", autograd, AUTOGRADS)
    if backward is not None and not callable(backward):
        raise TypeError(f"backward: expected a callable backward(dout, *saved), got "
                        f"{type_name(backward)}")
    if backward is not None and autograd is not None:
        raise ValueError(f"backward, autograd: expected one source of gradients, got both "
                         f"(backward={_describe_callable(backward)}, autograd={autograd!r})")
    if not _is_number(budget_factor):
        raise TypeError(f"budget_factor: expected a finite number >= 1, got "
                        f"{described(budget_factor)}")
    if not (math.isfinite(real_value(budget_factor)) and budget_factor >= 1.0):  # 2**1100: inf
        raise ValueError(f"budget_factor: expected a finite number >= 1, got {real_text(budget_factor)}")
    check_choice("align", align, ALIGNS)
    if adapter is not None and not callable(adapter) and not isinstance(adapter, Mapping):
        raise TypeError(f"adapter: expected None, a mapping {{npattn name: kernel name or None}} "
                        f"or a callable(options) -> keywords, got {type_name(adapter)}")
    if isinstance(adapter, Mapping):
        _check_adapter_mapping(adapter)
    if floors is not None:
        if not isinstance(floors, Mapping):
            raise TypeError(f"floors: expected a mapping with keys from {DTYPES}, got "
                            f"{described(floors)}")
        if any(k not in FLOORS for k in floors):
            raise ValueError(f"floors: expected a mapping with keys from {DTYPES}, got {floors!r}")
        for k, v in floors.items():
            if not _is_number(v):
                raise TypeError(f"floors: expected finite numbers >= 0 as values, got "
                                f"{described(v)} for {k!r}")
            if not (math.isfinite(real_value(v)) and v >= 0.0):
                raise ValueError(f"floors: expected finite numbers >= 0 as values, got {real_text(v)} for "
                                 f"{k!r}")


def _check_adapter_mapping(adapter: Mapping) -> None:
    """A mapping adapter renames npattn's keywords (the panel's, ``OPTION_KEYWORDS``) to names
    that are strings, or drops them (None); no two keep one name. A misspelt key would
    otherwise rename nothing, silently."""
    names = sorted({n for kws in OPTION_KEYWORDS.values() for n in kws})
    not_str = [k for k in adapter if not isinstance(k, str)]
    if not_str:
        raise TypeError(f"adapter: expected keys from npattn's keywords {names} (str), got "
                        f"{', '.join(f'{described(k)}' for k in not_str)}")
    unknown = [k for k in adapter if k not in names]
    if unknown:
        raise ValueError(f"adapter: expected keys from npattn's keywords {names}, got "
                         f"{', '.join(map(repr, unknown))}")
    bad = {k: v for k, v in adapter.items() if v is not None and not isinstance(v, str)}
    if bad:
        raise TypeError(f"adapter: expected each value to be a keyword name (str) or None, got "
                        f"{bad!r}")
    targets = [adapter.get(n, n) for n in names if adapter.get(n, n) is not None]
    twice = sorted({t for t in targets if targets.count(t) > 1})
    if twice:
        raise ValueError(f"adapter: expected each keyword to keep a name of its own, got "
                         f"{', '.join(map(repr, twice))} for two of them")


def check_layout_supports(layout: str, supports: tuple, flags: Optional[Mapping] = None) -> None:
    """Layout "thd" passes the batch's sequences packed one after another, as flash-attn's
    varlen kernels take them: a mask over each sequence's (Lq, Lk) grid or segment ids over
    its positions have no place in that call. A ``ValueError`` names them before any case
    runs (a panel that left their cases out would check less than ``supports`` declares)."""
    refused = [s for s in supports if s in UNPACKED_OPTIONS]
    if layout == "thd" and refused:
        listed = ", ".join(map(repr, UNPACKED_OPTIONS[:-1])) + f" or {UNPACKED_OPTIONS[-1]!r}"
        raise ValueError(f"supports: expected options that {_setting('layout', 'thd', flags)} can "
                         f"pass, not {listed} (a varlen kernel takes its sequences packed one "
                         "after another, each attending its own keys, with no mask nor segment "
                         f"ids), got {', '.join(map(repr, refused))}")


def _check_grad_args(mask_grad: Any, lse_grad: Any, returns_lse: Any, gradients: bool,
                     supports: tuple, flags: Optional[Mapping] = None) -> None:
    if not (mask_grad is None or isinstance(mask_grad, bool)):
        raise TypeError(f"mask_grad: expected None, True or False, got {type_name(mask_grad)} "
                        f"{mask_grad!r}")
    if not isinstance(returns_lse, bool):
        raise TypeError(f"returns_lse: expected True or False, got {type_name(returns_lse)} "
                        f"{returns_lse!r}")
    if not isinstance(lse_grad, bool):
        raise TypeError(f"lse_grad: expected True or False, got {type_name(lse_grad)} "
                        f"{lse_grad!r}")
    on = "" if flags else "True "  # "mask_grad: True checks...", "--mask-grad: checks..."
    gradients_from = f"{_setting('backward', ..., flags)} or {_setting('autograd', ..., flags)}"
    if mask_grad is True and not gradients:
        raise ValueError(f"mask_grad: {on}checks the gradient of the mask, which needs "
                         f"gradients (give {gradients_from})")
    if mask_grad is True and "mask_float" not in supports:
        raise ValueError(f"mask_grad: {on}checks the dmask of float masks, but "
                         f"{(flags or {}).get('supports', 'supports')} does "
                         f"not declare 'mask_float' ({_setting('supports', list(supports), flags)})")
    if lse_grad and not gradients:
        raise ValueError(f"lse_grad: {on}passes dlse to the gradients, which needs "
                         f"{gradients_from}")
    if lse_grad and not returns_lse:
        raise ValueError(f"lse_grad: {on}needs {_setting('returns_lse', True, flags)} (dlse is "
                         "the gradient of the lse your function returns)")


def plan(supports: Iterable[str] = (), *, align: str = "top_left", combos: Any = True,
         cases: Any = None, head_dims: Optional[Iterable[int]] = None) -> list:
    """The cases ``verify`` runs: the panel of ``supports`` (``npattn.verify_cases.panel``),
    or the ``cases`` chosen from it by name, or ``Case`` objects as given.

    ``align``, ``combos`` and ``head_dims`` shape the panel as ``verify``'s
    arguments of those names do.

    ``ValueError`` for a name the panel does not hold, a ``Case`` with an
    option that ``supports`` does not declare or with options that one call
    cannot hold (both causal alignments, both kinds of mask, a causal
    alignment unlike ``align`` beside a window or ALiBi), or ``cases`` that hold none (a
    verification of no case would pass whatever the kernel does); ``TypeError`` for
    an entry that is neither a name (str) nor a ``Case``.
    """
    supports = check_supports(supports)
    full = panel(supports, align, combos=combos, head_dims=head_dims)
    if cases is None:
        return full
    if isinstance(cases, (str, Case)):
        cases = [cases]
    if not isinstance(cases, Iterable):
        raise TypeError(f"cases: expected None, a case name, a Case or an iterable of them, got "
                        f"{described(cases)}")
    by_name = {c.name: c for c in full}
    chosen = []
    for c in cases:
        if isinstance(c, Case):
            extra = sorted(set(c.options) - set(supports))
            if extra:
                raise ValueError(f"cases: case {c.name!r} turns on {extra}, which supports "
                                 f"does not declare (supports={list(supports)})")
            if conflicts(c.options, align):  # both causal alignments ran as one, and passed as both
                raise ValueError(f"cases: expected options that one call can hold (align={align!r}), "
                                 f"got case {c.name!r} with {sorted(c.options)}")
            chosen.append(c)
        elif not isinstance(c, str):
            raise TypeError(f"cases: expected names of the panel's cases or Case objects, got "
                            f"{described(c)}")
        elif c in by_name:
            if by_name[c] not in chosen:  # a name given twice runs once
                chosen.append(by_name[c])
        else:
            maybe = did_you_mean(c, by_name)
            raise ValueError(f"cases: expected names of the panel's cases or Case objects, got "
                             f"{c!r} ({maybe}npattn.verifier.plan(supports, align=..., combos=..., "
                             f"head_dims=...) returns the panel's {len(by_name)} cases)")
    if not chosen:  # as head_dims: a verification of no case would pass whatever the kernel does
        raise ValueError("cases: expected one case or more (None for the panel), got none")
    return chosen


def verify(
    fn: Callable,
    *,
    layout: str = "bhsd",
    dtype: str = "float32",
    supports: Iterable[str] = (),
    backward: Optional[Callable] = None,
    autograd: Optional[str] = None,
    returns_lse: bool = False,
    mask_grad: Optional[bool] = None,
    lse_grad: bool = False,
    backend: Any = "numpy",
    device: Any = None,
    align: str = "top_left",
    adapter: Any = None,
    seed: int = 0,
    budget_factor: float = 2.0,
    floors: Optional[Mapping] = None,
    combos: Any = True,
    head_dims: Optional[Iterable[int]] = None,
    cases: Any = None,
    progress: Optional[Callable] = None,
    command: Optional[str] = None,
    target: Optional[str] = None,
    backward_target: Optional[str] = None,
    adapter_target: Optional[str] = None,
    flags: Optional[Mapping] = None,
) -> VerifyReport:
    """Check the attention ``fn`` against npattn over a panel of cases.

    Parameters
    ----------
    fn : callable
        ``fn(q, k, v, **options)``, your attention. q (B, Hq, Lq, Dh),
        k (B, Hkv, Lk, Dh), v (B, Hkv, Lk, Dv) in ``layout``, arrays of
        ``backend`` in ``dtype``. ``options`` are npattn's keywords for what
        the case turns on (``npattn.verify_cases.SUPPORTS``): ``is_causal``,
        ``align`` (only when "bottom_right"), ``window``, ``softcap``,
        ``alibi_slopes``, ``sinks``, ``enable_gqa``, ``q_segments`` /
        ``k_segments``, ``dropout_p`` with ``dropout_mask`` (True = keep),
        ``mask`` (B, 1 or Hq, Lq, Lk) in every layout, ``scale``. Returns
        ``out`` in ``layout``, or ``(out, lse)`` with ``returns_lse``; with
        ``backward`` a tuple ``(out, *saved)`` / ``(out, lse, *saved)``.
    layout : {"bhsd", "bshd", "bthd", "thd"}
        (B, H, L, D); (B, L, H, D) with lse (B, H, Lq) (flash-attn); JAX's
        (B, T, N, H) with lse (B, T, N); "thd", flash-attn's varlen kernels:
        the B sequences, of lengths that differ (``npattn.verify_cases.packing``:
        the last of the case's (Lq, Lk), the others shorter), packed one after
        another, q (total_q, Hq, Dh), k and v (total_k, Hkv, D), lse and dlse
        (Hq, total_q), ``dropout_mask`` (B, Hq, Lq, Lk) with sequence b's keep
        decisions in ``[b, :, :Lq_b, :Lk_b]``; ``fn`` also gets ``cu_seqlens_q``
        [0, Lq_0, Lq_0 + Lq_1, ..., total_q] and ``cu_seqlens_k`` (int32 arrays
        of ``backend``), ``max_seqlen_q=Lq``, ``max_seqlen_k=Lk`` (by those
        names, whatever ``adapter``); ``supports`` may not hold
        "mask_bool", "mask_float" or "segments" there (a ``ValueError``).
    dtype : {"float64", "float32", "float16", "bfloat16"}
        Of q, k, v, dout, a float mask and sinks (ALiBi slopes are float32,
        float64 for float64).
    supports : iterable of str, or a comma-separated string
        The options ``fn`` implements; the panel is drawn from them ("all":
        every one). "empty_rows" declares that rows with nothing to attend
        give zeros (and zero gradients).
    backward : callable, optional
        ``backward(dout, *saved) -> (dq, dk, dv)``, ``(dq, dk, dv, dsinks)`` or
        ``(dq, dk, dv, dmask, dsinks)`` (npattn's order; or a mapping, or an
        object with those attributes such as npattn's ``SDPAGrads``), where
        ``saved`` is what ``fn`` returned after ``out`` (and ``lse``). ``dout``
        is random normal, in ``layout`` and ``dtype``. With ``lse_grad`` it is
        called ``backward(dout, *saved, dlse=dlse)``.
    autograd : {None, "torch", "jax"}
        Gradients by ``torch.autograd.grad`` or ``jax.vjp`` instead (with
        ``backend`` "torch" or "jax"; ``backward`` serves every library).
    returns_lse : bool
        ``fn`` returns the natural log-sum-exp of each row too.
    mask_grad : {None, True, False}
        Check ``dmask``, the gradient of a float mask, in the mask's shape
        (compared where the mask is finite). None: where the backward returns
        one (a kernel that returns none is not failed); True: required (with
        ``autograd`` the mask requires grad); False: never.
    lse_grad : bool
        The backward takes an upstream gradient of lse too (ring / split-KV
        attention): a random normal ``dlse`` (B, Hq, Lq) in lse's layout, zero
        on rows whose lse is not finite, float32 for half precision, goes to
        ``backward(dout, *saved, dlse=dlse)`` or is lse's cotangent under
        autograd; npattn's gradients are ``sdpa_backward(dout, cache,
        dlse=dlse)``'s. Needs ``returns_lse``.
    backend : {"numpy", "torch", "cupy", "jax", "array_api_strict"} or a module
        The array library of ``fn``'s arrays: one of those names, its module,
        or any other Array API namespace module (e.g. ``array_api_compat.numpy``,
        whose arrays are NumPy's), whose inputs are made as
        ``xp.asarray(host, dtype=xp.<dtype>, device=device)``. A ``dtype`` the
        namespace does not have (array_api_strict has no float16 nor bfloat16)
        is a ``ValueError`` before any case runs.
    device : optional
        Where the arrays live (torch: "cpu" by default, e.g. "cuda"; cupy: a
        device id; jax: a ``jax.Device``, or "PLATFORM" / "PLATFORM:N" for
        ``jax.devices(PLATFORM)[N]`` such as "cpu", "gpu:1", "tpu:0"; numpy:
        None; another namespace: what its ``asarray(device=)`` takes, one of
        its ``__array_namespace_info__().devices()``, such as
        ``array_api_strict.Device("device1")``). A device the library cannot
        use (or not in ``dtype``) is a ``ValueError`` before any case runs.
    align : {"top_left", "bottom_right"}
        Where the window's and ALiBi's diagonal lies in their cases (passed as
        ``align`` when "bottom_right"); causal cases carry their own.
    adapter : mapping or callable, optional
        ``{npattn name: your name, or None to drop it}``, or
        ``adapter(options) -> keywords`` for any other conversion.
    seed : int >= 0
        Seeds every case's inputs (with the case's name).
    budget_factor : float >= 1
        The kernel may be this many times less accurate than npattn in ``dtype``.
    floors : mapping, optional
        Overrides of ``FLOORS`` (by dtype).
    combos : bool or iterable of tuples
        Option combinations of the panel (``npattn.verify_cases.panel``).
    head_dims : iterable of int, optional
        The head widths the kernel takes, e.g. ``(64, 128)``, each once and from 1
        to ``npattn.verify_cases.MAX_HEAD_DIM``: the panel's cases use them in
        turn (``npattn.verify_cases.panel``); two different ones or more when
        ``supports`` holds "dv_ne_dk".
    cases : optional
        Names of panel cases (``plan(supports, ...)`` returns the panel), or
        ``Case`` objects (e.g. from ``npattn.testing.strategies.attention_cases()``),
        instead of the panel; one or more (none is a ``ValueError``: it would pass
        whatever ``fn`` does).
    progress : callable, optional
        ``progress(done, total, case_name)`` after each case.
    command : str, optional
        A reproducer template holding ``{case}`` (the CLI gives its own
        command line); else a Python call is printed.
    target : str, optional
        How to name ``fn`` in the report (default ``module:qualname``).
    backward_target, adapter_target : str, optional
        How to name ``backward`` and a callable ``adapter`` in the report
        (default ``module:qualname``; the CLI gives them as its user wrote them,
        a file's path included). A mapping adapter is reported as the mapping.
    flags : mapping, optional
        How messages name verify's keywords, e.g. ``{"returns_lse": "--returns-lse"}``
        (the CLI gives its flags): "needs --returns-lse" where a Python caller reads
        "needs returns_lse=True". Messages name the keywords by default.

    Returns
    -------
    VerifyReport
        ``report.ok``; ``print(report)``; ``report.to_json()``; ``report.plot(path)``.
    """
    _check_args(layout, dtype, backward, autograd, budget_factor, align, adapter, floors)
    budget_factor = float(budget_factor)  # checked numbers, as Python floats from here on
    floors = None if floors is None else {k: float(v) for k, v in floors.items()}
    if not callable(fn):
        raise TypeError(f"fn: expected a callable fn(q, k, v, **options), got {type_name(fn)}")
    if flags is not None and not (isinstance(flags, Mapping)
                                  and all(isinstance(v, str) for v in flags.values())):
        raise TypeError(f"flags: expected None or a mapping of keyword names to flag strings, "
                        f"got {flags!r}")
    supports = check_supports(supports)
    check_layout_supports(layout, supports, flags)
    head_dims = check_head_dims(head_dims, supports)  # a tuple: it is read more than once
    seed = check_size("seed", seed, maximum=None)
    if progress is not None and not callable(progress):
        raise TypeError(f"progress: expected None or a callable progress(done, total, case_name), "
                        f"got {described(progress)}")
    if command is not None and not isinstance(command, str):
        raise TypeError(f"command: expected None or a str holding '{{case}}', got "
                        f"{described(command)}")
    if command is not None and "{case}" not in command:  # each case's rerun would be this line
        raise ValueError(f"command: expected a str holding '{{case}}', got {command!r}")
    for key, value in (("target", target), ("backward_target", backward_target),
                       ("adapter_target", adapter_target)):
        if value is not None and not isinstance(value, str):
            raise TypeError(f"{key}: expected None or a str, got {described(value)}")
    _check_grad_args(mask_grad, lse_grad, returns_lse,
                     backward is not None or autograd is not None, supports, flags)
    lib_name = _library_name(backend)
    for library in ("torch", "jax"):
        if autograd == library and lib_name != library:
            head = "" if flags else f"{library!r} "  # "autograd: 'torch' needs", "--autograd: needs"
            raise ValueError(f"autograd: {head}needs {_setting('backend', library, flags)}, got "
                             f"{_setting('backend', lib_name, flags)}")
    lib = _Library(lib_name, backend if isinstance(backend, types.ModuleType) else None)
    lib.dtype(dtype, flags)  # bfloat16 on NumPy without ml_dtypes, float16 on array_api_strict fail here
    lib.place(device, dtype, flags)  # a device the library cannot use: told before any case
    chosen = plan(supports, align=align, combos=combos, cases=cases, head_dims=head_dims)
    cfg = _Config(fn, layout, dtype, backward, autograd, bool(returns_lse), lib, align, adapter,
                  int(seed), float(budget_factor), {**FLOORS, **dict(floors or {})}, supports,
                  mask_grad, lse_grad, flags)
    name = target or _describe_callable(fn)
    config = {"target": name, "layout": layout, "dtype": dtype, "supports": list(supports),
              "backend": lib_name, "device": None if device is None else str(device),
              "align": align, "autograd": autograd,
              "backward": None if backward is None else (backward_target
                                                          or _describe_callable(backward)),
              "adapter": (dict(adapter) if isinstance(adapter, Mapping) else None
                          if adapter is None else adapter_target or _describe_callable(adapter)),
              "returns_lse": bool(returns_lse), "gradients": cfg.gradients,
              "mask_grad": mask_grad, "lse_grad": lse_grad, "seed": int(seed),
              "budget_factor": float(budget_factor), "floors": cfg.floors,
              "head_dims": None if head_dims is None else list(head_dims)}
    results = []
    by_name = {c.name: c for c in plan(supports, align=align, combos=combos, head_dims=head_dims)}
    for i, case in enumerate(chosen):
        rep = _reproducer(command, case, name, config, combos=combos, adapter=adapter,
                          in_panel=by_name.get(case.name) == case,
                          callables={"fn": None if target else fn, "backward": backward})
        results.append(_run_case(case, cfg, rep))
        if progress is not None:
            progress(i + 1, len(chosen), case.name)
    return VerifyReport(config, results, flags)


def _python_ref(desc: str, f: Any, default: str, unbound: list) -> str:
    """How a Python rerun line names the callable ``f`` described by ``desc``: its dotted
    ``module.qualname`` when it has one (its ``qualname`` in ``__main__``); else (a lambda, a local function, a callable object)
    a bare name for the caller to bind, its description added to ``unbound``."""
    if f is None or "<" not in desc:
        if f is not None and desc.startswith("__main__:"):  # a script's or notebook's own
            return desc[len("__main__:"):]  # function: bound there by its name
        return desc.replace(":", ".")
    taken = {entry.split(": ", 1)[0] for entry in unbound}  # names given to other callables
    ref = getattr(f, "__name__", "")
    ref = ref if ref.isidentifier() and ref not in taken else default
    while ref in taken:  # two callables of one name (or one named like the default)
        ref += "_"
    unbound.append(f"{ref}: {desc}")
    return ref


def _reproducer(command: Optional[str], case: Case, name: str, config: dict, *, combos: Any = True,
                adapter: Any = None, in_panel: bool = True, callables: Optional[dict] = None) -> str:
    """One line that reruns ``case``: the command with ``{case}``, or a Python call (the case
    by name when the panel holds it, else the ``Case`` itself). ``callables`` holds ``fn`` and
    ``backward`` (the objects; None for one named by ``target``): a callable without an
    importable name (a lambda, a local function) is called by a bare name, and a comment at the
    end of the line says which object each such name stands for."""
    if command is not None:
        return command.replace("{case}", case.name)
    callables = callables or {}
    unbound: list = []
    args = [f"layout={config['layout']!r}", f"dtype={config['dtype']!r}"]
    if config["supports"]:
        args.append(f"supports={','.join(config['supports'])!r}")
    default = {"backend": "numpy", "device": None, "align": "top_left", "autograd": None,
               "returns_lse": False, "mask_grad": None, "lse_grad": False, "head_dims": None,
               "budget_factor": 2.0}
    for key in default:
        if key == "backend" and config[key] not in BACKEND_NAMES:  # a namespace: its module
            args.append(f"backend={config[key]}")
        elif config[key] != default[key]:
            args.append(f"{key}={config[key]!r}")
    if config["floors"] != FLOORS:
        args.append(f"floors={config['floors']!r}")
    if config["backward"]:
        args.append("backward=" + _python_ref(config["backward"], callables.get("backward"),
                                              "backward", unbound))
    if adapter is not None:
        args.append("adapter=" + (repr(dict(adapter)) if isinstance(adapter, Mapping)
                                  else _python_ref(_describe_callable(adapter), adapter, "adapter",
                                                   unbound)))
    if combos is not True:
        args.append(f"combos={combos!r}")
    chosen = repr(case.name) if in_panel else f"npattn.verify_cases.{case!r}"
    args += [f"seed={config['seed']}", f"cases=[{chosen}]"]
    fn = _python_ref(name, callables.get("fn"), "fn", unbound)
    line = f"print(npattn.verify({fn}, {', '.join(args)}))"
    return line + ("  # " + "; ".join(unbound) if unbound else "")


# --------------------------------------------------------------------------
# the picture


def plot_report(report: VerifyReport, path: str) -> str:
    """Save a PNG of error / budget for every tensor of every case, failing ones marked.

    One column per case (in panel order), the ratio on a log axis, a line at 1
    (the budget); a red cross is a failing tensor (drawn at the top beyond
    1e8), a hollow grey marker a degenerate one; ratios below 1e-4 (an exact match among them)
    are drawn at 1e-4. Needs matplotlib
    (``pip install matplotlib``, or ``'.[plot]'`` from the repository root).
    Returns ``path``.

    Parameters
    ----------
    report : VerifyReport
    path : str
        Where the PNG is written, whatever its suffix.

    Returns
    -------
    str
        ``path``.

    Raises
    ------
    ImportError
        Without matplotlib.
    """
    try:
        import matplotlib

        matplotlib.use("Agg", force=False)
        import matplotlib.pyplot as plt
    except ImportError:
        raise ImportError("plot_report needs matplotlib: pip install matplotlib, or '.[plot]' from the "
                          "repository root") from None
    res = report.results
    markers = {"out": "o", "lse": "s", "dq": "^", "dk": "v", "dv": "D", "dmask": "*", "dsinks": "P"}
    finite = [t.ratio for r in res for t in r.tensors.values() if math.isfinite(t.ratio)]
    lo = 1e-4
    hi = min(1e8, max(10.0, 2.0 * max(finite, default=1.0)))  # beyond 1e8: at the top
    fig, ax = plt.subplots(figsize=(max(8.0, 0.22 * len(res) + 3.0), 4.8))
    for t, m in markers.items():
        xs: list = []
        ys: list = []
        fx: list = []
        fy: list = []
        dx: list = []
        dy: list = []
        for i, r in enumerate(res):
            tr = r.tensors.get(t)
            if tr is None:
                continue
            y = min(max(tr.ratio, lo), hi) if math.isfinite(tr.ratio) else hi
            (fx if tr.status == "fail" else dx if tr.status == "degenerate" else xs).append(i)
            (fy if tr.status == "fail" else dy if tr.status == "degenerate" else ys).append(y)
        if xs:
            ax.scatter(xs, ys, marker=m, s=22, label=t, alpha=0.85)
        if dx:
            ax.scatter(dx, dy, marker=m, s=30, facecolors="none", edgecolors="0.5")
        if fx:
            ax.scatter(fx, fy, marker="x", s=60, color="red", linewidths=2)
    ax.axhline(1.0, color="k", lw=1, ls="--")
    # one slot per case: with a single case matplotlib's own limits hug its point, and the
    # label below (and tight_layout, with a warning) would fall outside the axes
    ax.set_xlim(-0.5, len(res) - 0.5)
    ax.text(len(res) - 0.5, 1.15, "budget", ha="right", va="bottom", fontsize=8)
    ax.set_yscale("log")
    ax.set_ylim(lo / 2, hi * 2)
    ax.set_xticks(range(len(res)))
    ax.set_xticklabels([r.case.name for r in res], rotation=90, fontsize=6)
    for i, r in enumerate(res):
        if r.status == "fail":
            ax.get_xticklabels()[i].set_color("red")
    ax.set_ylabel("error / budget")
    c = report.config
    n_fail = len(report.failures)
    ax.set_title(f"{c.get('target')} ({c.get('layout')}, {c.get('dtype')}): "
                 f"{len(res) - n_fail}/{len(res)} cases pass", fontsize=10)
    from matplotlib.lines import Line2D

    handles, labels = ax.get_legend_handles_labels()
    handles += [Line2D([], [], marker="x", color="red", lw=0, markersize=7, mew=2),
                Line2D([], [], marker="o", color="0.5", lw=0, markerfacecolor="none")]
    labels += ["fail", "degenerate"]
    ax.legend(handles, labels, fontsize=7, ncol=4, loc="upper left")
    fig.tight_layout()
    fig.savefig(path, dpi=110, format="png")  # a PNG at exactly path, whatever its suffix
    plt.close(fig)
    return path
