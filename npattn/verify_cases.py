"""The cases of ``npattn.verify``: what the panel holds, and each case's inputs.

A ``Case`` is a specification (shapes, the options it turns on, the score
magnitude); ``case_inputs(case, seed)`` makes its arrays, as host NumPy
float64 / bool / int32 arrays in npattn's (B, H, L, D) layout. The same
``(case, seed)`` gives the same arrays on every machine: the generator is
seeded with ``seed`` and the case's name, so one case of a panel can be
rerun alone (``npattn verify ... --case NAME``).

``panel(supports, align)`` draws the default panel from the options a kernel
declares (``SUPPORTS``): cases without options over lengths that are not
multiples of the usual block sizes (1, 64, 65, 127, 128, 129, 257) with
``Lq != Lk``; each declared option alone, twice; pairs of options; and all of
them together. Tens of cases, each small enough for a NumPy kernel on a CPU.

Shape legend: B batch, Hq query heads, Hkv key/value heads, Lq/Lk query/key
lengths, Dh key width, Dv value width.
"""

from __future__ import annotations

import collections.abc
import difflib
import itertools
import math
import numbers
import zlib
from dataclasses import dataclass, replace
from typing import Any, Iterable, Optional, Sequence

import numpy as np

from .validation import ALIGNS, check_choice, described, type_name

__all__ = [
    "SUPPORTS",
    "OPTION_KEYWORDS",
    "EXCLUSIVE",
    "Case",
    "CaseInputs",
    "check_supports",
    "did_you_mean",
    "panel",
    "case_inputs",
    "conflicts",
    "fit_lengths",
    "case_align",
    "offset",
    "STRUCTURAL",
    "PERMISSIONS",
    "Packing",
    "packing",
]

#: Option tokens a kernel may declare in ``supports=``, and what each turns on.
SUPPORTS = {
    "causal": "is_causal=True, top-left: query i attends keys j <= i",
    "causal_bottom_right": "is_causal=True, align='bottom_right': keys j <= i + Lk - Lq",
    "window": "window=(left, right), a side None when unbounded (align as verify's align=)",
    "softcap": "softcap=c > 0: scores c * tanh(s / c)",
    "alibi": "alibi_slopes, (Hq,) or (B, Hq) float32 (float64 for float64): -slope * |i + o - j|",
    "sinks": "sinks, (Hq,) in the kernel's dtype: one more logit in each row's denominator",
    "gqa": "enable_gqa=True; k and v have Hkv < Hq heads, query head h uses h // (Hq // Hkv)",
    "segments": "q_segments (B, Lq), k_segments (B, Lk) int32: attend only equal ids",
    "dropout_mask": "dropout_p=p > 0 and dropout_mask (B, Hq, Lq, Lk) bool, True = keep",
    "dv_ne_dk": "no keyword: v's head width Dv differs from Dh",
    "mask_bool": "mask (B, 1 or Hq, Lq, Lk) bool, True = may attend",
    "mask_float": "mask (B, 1 or Hq, Lq, Lk) in the kernel's dtype, added to the scores, -inf allowed",
    "scale": "scale=float, not 1/sqrt(Dh) (without it no scale is passed)",
    "empty_rows": "no keyword: some rows have nothing to attend; zeros expected there",
}

#: The keywords each option passes to ``fn`` (npattn's names). ``align`` is
#: passed only when it is ``"bottom_right"`` (npattn's default is top-left).
OPTION_KEYWORDS = {
    "causal": ("is_causal",),
    "causal_bottom_right": ("is_causal", "align"),
    "window": ("window", "align"),
    "softcap": ("softcap",),
    "alibi": ("alibi_slopes", "align"),
    "sinks": ("sinks",),
    "gqa": ("enable_gqa",),
    "segments": ("q_segments", "k_segments"),
    "dropout_mask": ("dropout_p", "dropout_mask"),
    "dv_ne_dk": (),
    "mask_bool": ("mask",),
    "mask_float": ("mask",),
    "scale": ("scale",),
    "empty_rows": (),
}

#: Options that one call cannot hold together (one mask; one causal alignment).
EXCLUSIVE = (("mask_bool", "mask_float"), ("causal", "causal_bottom_right"))

#: Options that follow the alignment of verify's ``align=``.
ALIGNED = ("window", "alibi")

#: Options whose structure (not a mask) can leave a row with nothing to attend
#: when Lq > Lk; without "empty_rows" their cases keep Lq <= Lk.
STRUCTURAL = ("causal_bottom_right", "window", "segments")

#: Options that are permissions, not calls: they never make a case of their own.
PERMISSIONS = ("empty_rows",)


def check_supports(supports: Any) -> tuple:
    """``supports`` (an iterable of tokens, or a comma-separated string) as a sorted tuple;
    ``ValueError`` naming an unknown token, ``TypeError`` one that is not a str."""
    if isinstance(supports, str):
        text = supports
        entries = [s.strip() for s in supports.split(",")]
        supports = [] if entries == [""] else entries  # '' (or blanks) names no option
        if "" in supports:  # 'causal,,gqa' or 'causal,' is a typing slip, not one option fewer
            raise ValueError(f"supports: expected comma-separated option names, got {text!r}, "
                             f"whose entry {supports.index('') + 1} of {len(supports)} is empty")
        if supports == ["all"]:
            supports = list(SUPPORTS)
        elif "all" in supports:  # 'all,causal' was told 'all' is not a name
            raise ValueError(f"supports: expected 'all' alone or names from {sorted(SUPPORTS)}, "
                             f"got 'all' with others in {text!r}")
    try:
        items = list(supports)
    except TypeError:
        raise TypeError(f"supports: expected an iterable of option names, got "
                        f"{type_name(supports)}") from None
    for s in items:
        if not isinstance(s, str):
            raise TypeError(f"supports: expected names from {sorted(SUPPORTS)}, got {described(s)}")
        if s not in SUPPORTS:
            maybe = did_you_mean(s, SUPPORTS).strip()  # 'casual': did you mean 'causal'?
            raise ValueError(f"supports: expected names from {sorted(SUPPORTS)}, got {s!r}"
                             + (f" ({maybe})" if maybe else ""))
    return tuple(sorted(set(items)))


def did_you_mean(name: str, names: Any) -> str:
    """The start of an unknown name's hint: ``"did you mean 'a', 'b' or 'c'? "`` with the (up
    to three) ``names`` closest to ``name`` (``difflib``), or ``""`` when none is close."""
    told = [repr(n) for n in difflib.get_close_matches(name, list(names), n=3)]
    if not told:
        return ""
    told = [", ".join(told[:-1]), told[-1]] if len(told) > 1 else told
    return f"did you mean {' or '.join(told)}? "


def conflicts(options: Iterable[str], align: str = "top_left") -> bool:
    """Whether ``options`` cannot be one call: an ``EXCLUSIVE`` pair, or a causal alignment
    unlike ``align`` next to a window or ALiBi (one call has one ``align``)."""
    opts = set(options)
    for group in EXCLUSIVE:
        if len(opts & set(group)) > 1:
            return True
    if opts & set(ALIGNED):
        if "causal" in opts and align != "top_left":
            return True
        if "causal_bottom_right" in opts and align != "bottom_right":
            return True
    return False


@dataclass(frozen=True)
class Case:
    """One case of the panel: shapes, the options turned on, and how the inputs are drawn.

    Attributes
    ----------
    name : str
        Unique within a panel; ``cases=[name]`` / ``--case NAME`` reruns it.
    B, Hq, Hkv, Lq, Lk, Dh, Dv : int
        q (B, Hq, Lq, Dh), k (B, Hkv, Lk, Dh), v (B, Hkv, Lk, Dv).
    options : tuple of str
        Tokens of ``SUPPORTS`` this case turns on.
    score_std : float
        Standard deviation of the scaled scores ``q k^T * scale`` (q and k are
        drawn normal with the std that gives it).
    score_shift : float
        Standard deviation of an offset added to all scores of a row (one
        vector added to every key of a head), which the softmax ignores and
        ``exp`` does not (``SCORE_SHIFT``); 0: none.
    window : (left, right) or None
        With "window" (None: ``WINDOWS[0]``).
    softcap, scale, dropout_p : float or None
        With "softcap", "scale", "dropout_mask" (None: 2.0, 1/sqrt(Dh), 0.2).
    full_heads : bool
        Masks of shape (B, Hq, Lq, Lk) rather than (B, 1, Lq, Lk); ALiBi slopes
        (B, Hq) rather than (Hq,).
    empty_rows : bool
        Blank some rows of the mask, or give some queries a segment no key has.
    seed : int or None
        Overrides verify's ``seed`` for this case (hypothesis draws one).
    """

    name: str
    B: int = 2
    Hq: int = 2
    Hkv: int = 2
    Lq: int = 65
    Lk: int = 129
    Dh: int = 16
    Dv: int = 16
    options: tuple = ()
    score_std: float = 1.0
    score_shift: float = 0.0
    window: Optional[tuple] = None
    softcap: Optional[float] = None
    scale: Optional[float] = None
    dropout_p: Optional[float] = None
    full_heads: bool = False
    empty_rows: bool = False
    seed: Optional[int] = None

    @property
    def shapes(self) -> str:
        """``"B=2 Hq=6 Hkv=2 Lq=65 Lk=129 Dh=16 Dv=16"``."""
        return (f"B={self.B} Hq={self.Hq} Hkv={self.Hkv} Lq={self.Lq} Lk={self.Lk} "
                f"Dh={self.Dh} Dv={self.Dv}")

    def describe(self) -> str:
        """One line: the name, the shapes and the option values."""
        extra = []
        if self.window is not None:
            extra.append(f"window={self.window}")
        for name in ("softcap", "scale", "dropout_p"):
            if getattr(self, name) is not None:
                extra.append(f"{name}={getattr(self, name)}")
        if self.score_std != 1.0:
            extra.append(f"score_std={self.score_std}")
        if self.score_shift:
            extra.append(f"score_shift={self.score_shift}")
        if self.empty_rows:
            extra.append("empty rows")
        return " ".join([self.name, self.shapes] + extra)


@dataclass
class CaseInputs:
    """The arrays of one case, host NumPy, npattn's layout.

    ``q`` (B, Hq, Lq, Dh), ``k`` (B, Hkv, Lk, Dh), ``v`` (B, Hkv, Lk, Dv) and
    ``dout`` (B, Hq, Lq, Dv) are float64; ``options`` holds the keywords of
    npattn's ``sdpa_forward`` that the case turns on (arrays as host NumPy);
    ``dlse`` (B, Hq, Lq) float64 is the upstream gradient of lse that verify
    passes with ``lse_grad=True``.
    """

    q: np.ndarray
    k: np.ndarray
    v: np.ndarray
    dout: np.ndarray
    options: dict
    dlse: Optional[np.ndarray] = None


# --------------------------------------------------------------------------
# the panel


#: The std of the per-row offset that the base case with large scores adds to each row's
#: scores (the same for every key of the row: the softmax does not see it, lse does). At
#: 100, about a third of its rows lie beyond exp's float32 range (|s| > 88): a kernel that
#: takes exp of the scores without subtracting each row's maximum gives inf or NaN there.
SCORE_SHIFT = 100.0

#: (Lq, Lk, Dh) of the cases without options.
BASE_SHAPES = ((1, 65, 16), (64, 129, 32), (65, 128, 16), (127, 64, 8), (129, 257, 16),
               (257, 127, 64))
#: (Lq, Lk, Dh) of the case without options that has 3 heads, not 2: everywhere else B = Hq = 2
#: (Hq = 6 or 4 under GQA), and a kernel that takes the batch's stride for the heads' (reads row
#: b * B + h of q viewed as (B * H, L, D), where b * H + h belongs) is right wherever B = H.
THREE_HEADS = (127, 64, 8)
#: (Lq, Lk, Dh) of an option alone: the first and the second case.
ALONE_SHAPES = ((65, 129, 16), (128, 65, 8))
#: (Lq, Lk, Dh) cycled through by the pairs and the all-options cases.
PAIR_SHAPES = ((64, 127, 16), (129, 65, 8), (1, 128, 16), (127, 257, 8), (65, 1, 16),
               (128, 129, 32))
ALL_SHAPES = ((65, 128, 16), (257, 129, 8))
#: Windows (left, right) cycled through by the window cases.
WINDOWS = ((None, 7), (5, None), (13, 4), (20, 0))
#: At most this many pairs of options (each option in one at least, when possible).
MAX_PAIRS = 10

#: Pairs whose order is a convention (softcap before the additive mask and ALiBi, as
#: flash-attn and Gemma 2): kept whenever both are declared, beyond ``MAX_PAIRS``.
ORDER_PAIRS = (("mask_float", "softcap"), ("alibi", "softcap"))


def fit_lengths(Lq: int, Lk: int, options: Iterable[str], empty_ok: bool) -> tuple:
    """(Lq, Lk), swapped when the options would leave rows empty by structure (Lq > Lk
    under bottom-right causal, a window or segments) and ``empty_ok`` is False: with
    Lq <= Lk every query's diagonal key exists, and the structure always allows it."""
    if not empty_ok and Lq > Lk and set(options) & set(STRUCTURAL):
        return Lk, Lq
    return Lq, Lk


def _make_case(name: str, options: tuple, Lq: int, Lk: int, Dh: int, *, index: int,
               empty_ok: bool, **extra: Any) -> Case:
    """A case with the option values of its ``index``-th use (windows, softcaps... cycle)."""
    opts = tuple(sorted(options))
    Lq, Lk = fit_lengths(Lq, Lk, opts, empty_ok)
    Hq, Hkv = 2, 2
    if "gqa" in opts:
        # groups of G = 3 query heads over Hkv = 2 K/V heads, then all 4 over one: with G = Hkv
        # (4 over 2) a kernel that repeats each K/V head Hkv times, or maps query head h to
        # h // Hkv, where G = Hq // Hkv belongs, would be right
        Hq, Hkv = (6, 2) if index % 2 == 0 else (4, 1)
    Dv = Dh
    if "dv_ne_dk" in opts:
        Dv = Dh + 8 if index % 2 == 0 else max(Dh // 2 + 1, 1)
    kw: dict = dict(extra)
    if "window" in opts:
        kw["window"] = WINDOWS[index % len(WINDOWS)]
    if "softcap" in opts:
        kw["softcap"] = (2.0, 5.0)[index % 2]
        kw.setdefault("score_std", (3.0, 6.0)[index % 2])
    if "scale" in opts:
        kw["scale"] = (0.5, 1.7)[index % 2] / math.sqrt(Dh)
    if "dropout_mask" in opts:
        kw["dropout_p"] = (0.2, 0.5)[index % 2]
    masky = {"mask_bool", "mask_float", "segments"} & set(opts)
    kw["empty_rows"] = bool(empty_ok and masky)
    kw["full_heads"] = index % 2 == 1
    return Case(name=name, Hq=Hq, Hkv=Hkv, Lq=Lq, Lk=Lk, Dh=Dh, Dv=Dv, options=opts, **kw)


def _pairs(options: tuple, align: str) -> list:
    """Up to ``MAX_PAIRS`` compatible pairs, each option in one at least where it can be.

    The pairs are taken in a fixed pseudo-random order (a hash of their names),
    first those that bring an option not yet covered: the panel depends on the
    declared options only, not on the seed.
    """
    pairs = [p for p in itertools.combinations(options, 2) if not conflicts(p, align)]
    pairs.sort(key=lambda p: zlib.crc32("+".join(p).encode()))
    chosen: list = []
    covered: set = set()
    for p in pairs:
        if not set(p) <= covered:
            chosen.append(p)
            covered |= set(p)
    n_cover = len(chosen)
    chosen += [p for p in pairs if p not in chosen]
    return chosen[:max(MAX_PAIRS, n_cover)]


def _order_pairs(options: tuple, align: str, taken: list) -> list:
    """The ``ORDER_PAIRS`` of ``options`` that ``taken`` lacks, in the order of ``options``."""
    pairs = [tuple(o for o in options if o in p) for p in ORDER_PAIRS if set(p) <= set(options)]
    return [p for p in pairs if not any(set(p) == set(t) for t in taken) and not conflicts(p, align)]


def _all_sets(options: tuple, align: str) -> list:
    """Two option sets holding every declared option, one side of each exclusive group in
    each (the second set takes the other side), minus what conflicts with ``align``."""
    sets = []
    for side in (0, 1):
        chosen = []
        for o in options:
            group = next((g for g in EXCLUSIVE if o in g), None)
            if group is not None:
                present = [g for g in group if g in options]
                if o != present[side % len(present)]:
                    continue
            chosen.append(o)
        while conflicts(chosen, align):  # an alignment conflict: the causal side yields
            chosen = [o for o in chosen if o not in ("causal", "causal_bottom_right")]
        if tuple(chosen) not in sets and len(chosen) >= 2:
            sets.append(tuple(chosen))
    return sets


def panel(supports: Iterable[str] = (), align: str = "top_left", *, combos: Any = True,
          head_dims: Optional[Iterable[int]] = None) -> list:
    """The default panel for a kernel that declares ``supports``.

    Parameters
    ----------
    supports : iterable of str
        Tokens of ``SUPPORTS``.
    align : {"top_left", "bottom_right"}
        The alignment of the window and ALiBi cases.
    combos : bool, None or iterable of tuples
        True: pairs of options and all options together; False (or None):
        each option alone only; an iterable of option tuples: exactly those combinations
        (each must be declared and compatible).
    head_dims : iterable of int, optional
        The head widths the kernel takes (e.g. ``(64, 128)``): the cases use
        them in turn as Dh in place of the panel's own (8, 16, 32, 64). Dv is
        Dh too, except under "dv_ne_dk" where it is the next width in
        ``head_dims``, which must then hold two different widths.

    Returns
    -------
    list of Case, names unique.
    """
    supports = check_supports(supports)
    check_choice("align", align, ALIGNS)
    dims = check_head_dims(head_dims, supports)
    empty_ok = "empty_rows" in supports
    options = tuple(s for s in supports if s not in PERMISSIONS)
    cases: list = []
    for i, (Lq, Lk, Dh) in enumerate(BASE_SHAPES):
        H = 3 if (Lq, Lk, Dh) == THREE_HEADS else 2
        cases.append(Case(name=f"base-{Lq}x{Lk}", Hq=H, Hkv=H, Lq=Lq, Lk=Lk, Dh=Dh, Dv=Dh))
    cases.append(Case(name="base-scores8-shift-65x127", Lq=65, Lk=127, Dh=16, Dv=16, score_std=8.0,
                      score_shift=SCORE_SHIFT))
    for o in options:
        for i, (Lq, Lk, Dh) in enumerate(ALONE_SHAPES):
            c = _make_case("", (o,), Lq, Lk, Dh, index=i, empty_ok=empty_ok)
            cases.append(replace(c, name=f"{o}-{c.Lq}x{c.Lk}"))
    if combos is True:
        pairs = _pairs(options, align)
        combo_sets = pairs + [t for t in _all_sets(options, align) if t not in pairs]
        combo_sets += _order_pairs(options, align, combo_sets)  # last: the cases before keep
        # their index, and the window, masks and shapes it draws
    elif combos is False or combos is None:
        combo_sets = []
    else:
        expected = ("combos: expected True, False or an iterable of option tuples such as "
                    "[('causal', 'window')]")
        if isinstance(combos, (str, bytes)) or not isinstance(combos, collections.abc.Iterable):
            raise TypeError(f"{expected}, got {combos!r}")
        combo_sets = []
        for t in combos:
            if isinstance(t, (str, bytes)) or not isinstance(t, collections.abc.Iterable):
                raise TypeError(f"{expected}, got {t!r} in {combos!r}")
            t = tuple(sorted(set(t)))
            for o in t:
                if o not in options:
                    raise ValueError(f"combos: {t} holds {o!r}, which supports does not declare")
            if conflicts(t, align):
                raise ValueError(f"combos: {t} cannot be one call (exclusive options, or a "
                                 f"causal alignment unlike align={align!r})")
            combo_sets.append(t)
    for i, opts in enumerate(combo_sets):
        shapes = PAIR_SHAPES if len(opts) == 2 else ALL_SHAPES
        Lq, Lk, Dh = shapes[i % len(shapes)]
        if tuple(sorted(opts)) in ORDER_PAIRS and min(Lq, Lk) == 1:  # an order shows in the
            # softmax across several keys (one key gets weight 1 either way)
            Lq, Lk, Dh = next(s for s in shapes[i % len(shapes):] + shapes if min(s[:2]) > 1)
        c = _make_case("", opts, Lq, Lk, Dh, index=i, empty_ok=empty_ok)
        label = "+".join(opts) if len(opts) <= 3 else f"all{len(opts)}"
        cases.append(replace(c, name=f"{label}-{c.Lq}x{c.Lk}"))
    if dims is not None:
        cases = [_with_head_dim(c, dims, i) for i, c in enumerate(cases)]
    return _unique(cases)


#: The widest head a case takes (flash-attn's kernels go to 256; at 2**16 the float64 q of a
#: panel case is up to 1 GiB, and its q, k, v and dout together up to 2.3 GiB).
MAX_HEAD_DIM = 2**14


def check_head_dims(head_dims: Optional[Iterable[int]],
                    supports: Iterable[str] = ()) -> Optional[tuple]:
    """``head_dims`` as a tuple of ints in [1, MAX_HEAD_DIM] (None stays None), each once
    (``check_each_head_dim_once``), two different ones when ``supports`` holds "dv_ne_dk";
    ``ValueError``/``TypeError`` telling a list or tuple as the caller wrote it."""
    if head_dims is None:
        return None
    if isinstance(head_dims, (str, bytes)) or not isinstance(head_dims, collections.abc.Iterable):
        raise TypeError(f"head_dims: expected an iterable of ints from 1 to {MAX_HEAD_DIM}, such "
                        f"as (64, 128), got {head_dims!r}")
    dims = tuple(head_dims)
    given = head_dims if isinstance(head_dims, (list, tuple)) else dims  # a generator is spent
    if not dims:
        raise ValueError(f"head_dims: expected one int or more, got {given!r}")
    for d in dims:
        if isinstance(d, bool) or not isinstance(d, numbers.Integral):
            raise TypeError(f"head_dims: expected ints from 1 to {MAX_HEAD_DIM}, got {d!r} in "
                            f"{given!r}")
        if not 1 <= d <= MAX_HEAD_DIM:  # the float64 truth of a case grows with Dh
            raise ValueError(f"head_dims: expected ints from 1 to {MAX_HEAD_DIM}, got {d!r} in "
                             f"{given!r}")
    check_each_head_dim_once(dims, given)
    if "dv_ne_dk" in supports and len(set(dims)) < 2:
        raise ValueError(f"head_dims: expected two different widths or more when supports holds "
                         f"'dv_ne_dk' (its cases take Dh and a different Dv, both from head_dims), "
                         f"got {given!r}")
    return tuple(int(d) for d in dims)


def check_each_head_dim_once(dims: Sequence[int], given: Any) -> None:
    """``ValueError`` naming ``head_dims`` and the first width that ``dims`` repeats (a repeat
    only weighted the panel's turns towards it), in ``given``: head_dims as the caller wrote
    it (``npattn verify --head-dims`` gives its text, and names its flag)."""
    for i, d in enumerate(dims):
        if d in dims[:i]:
            raise ValueError(f"head_dims: expected each entry once, got {d!r} more than once in "
                             f"{given!r}")


def _with_head_dim(case: Case, dims: tuple, index: int) -> Case:
    """``case`` with Dh = ``dims[index % len(dims)]`` (Dv, and a given scale, follow)."""
    Dh = dims[index % len(dims)]
    Dv = Dh
    if case.Dv != case.Dh:  # dv_ne_dk: another width the kernel takes (panel checks there is one)
        Dv = next(d for d in dims[index % len(dims) + 1:] + dims if d != Dh)
    scale = case.scale
    if scale is not None:  # the same multiple of 1/sqrt(Dh)
        scale = scale * math.sqrt(case.Dh) / math.sqrt(Dh)
    return replace(case, Dh=Dh, Dv=Dv, scale=scale)


def _unique(cases: list) -> list:
    """``cases`` with repeated names suffixed ``.2``, ``.3``..."""
    seen: dict = {}
    out = []
    for c in cases:
        n = seen.get(c.name, 0) + 1
        seen[c.name] = n
        out.append(c if n == 1 else replace(c, name=f"{c.name}.{n}"))
    return out


# --------------------------------------------------------------------------
# one case's arrays


def _rng(case: Case, seed: int) -> np.random.Generator:
    """The generator of ``case``: its own seed, or ``seed`` with the case's name."""
    if case.seed is not None:
        return np.random.default_rng(case.seed)
    return np.random.default_rng([int(seed), zlib.crc32(case.name.encode())])


def offset(case: Case, align: str) -> int:
    """Key position of query 0 on the diagonal: 0 top-left, Lk - Lq bottom-right."""
    return case.Lk - case.Lq if align == "bottom_right" else 0


def case_align(case: Case, align: str) -> str:
    """The ``align`` of the call: bottom-right causal forces it, top-left causal too."""
    if "causal_bottom_right" in case.options:
        return "bottom_right"
    if "causal" in case.options:
        return "top_left"
    return align if set(case.options) & set(ALIGNED) else "top_left"


def _diagonal(case: Case, o: int) -> np.ndarray:
    """Key index on each query's diagonal, clipped into the keys: [Lq]."""
    return np.clip(np.arange(case.Lq) + o, 0, case.Lk - 1)


def _blank_rows(case: Case) -> list:
    """(batch, query row) pairs that a case with empty rows blanks."""
    rows = [(case.B - 1, case.Lq // 2)]
    if case.Lq > 2:
        rows.append((case.B - 1, 0))
    return rows


@dataclass(frozen=True)
class Packing:
    """Layout "thd": where each of a case's B packed sequences lies in its (B, H, L, D) arrays.

    Sequence b has ``lq[b]`` queries and ``lk[b]`` keys. Its rows are the first ones of
    batch entry b (``left`` False) or the last ones (``left`` True, for bottom-right
    alignment): either way the alignment offset of the padded (Lq, Lk) problem,
    0 or Lk - Lq, puts every sequence's diagonal where its own (Lq_b, Lk_b) put it
    (0 or Lk_b - Lq_b), so npattn's reference on the padded arrays, with the padding
    masked out, is each sequence's attention.
    """

    lq: tuple
    lk: tuple
    Lq: int
    Lk: int
    left: bool

    @staticmethod
    def _rows(lengths: tuple, L: int, left: bool) -> np.ndarray:
        at = np.arange(L)[None, :]  # [1, L]
        n = np.array(lengths)[:, None]  # [B, 1]
        return at >= L - n if left else at < n  # [B, L]

    @property
    def q_rows(self) -> np.ndarray:
        """[B, Lq] bool: the query rows of each sequence."""
        return self._rows(self.lq, self.Lq, self.left)

    @property
    def k_rows(self) -> np.ndarray:
        """[B, Lk] bool: the key rows of each sequence."""
        return self._rows(self.lk, self.Lk, self.left)

    def pad_mask(self) -> np.ndarray:
        """[B, 1, Lq, Lk] bool: True where query and key belong to the same sequence (the
        padding's query rows attend nothing)."""
        return self.q_rows[:, None, :, None] & self.k_rows[:, None, None, :]


def packing(case: Case, align: str = "top_left") -> Packing:
    """The packed sequences of ``case`` in layout "thd": lengths that differ from sequence
    to sequence, and so do their alignment offsets ``Lk_b - Lq_b``.

    The last sequence has the case's (Lq, Lk); sequence b < B - 1 is shorter by
    ``d = Lq (B - 1 - b) // (2 B)`` queries and ``min(d // 2, Lk - 1)`` keys. Fewer keys
    go than queries, from the end that the alignment keeps away from the diagonal, so a
    query that the case's structure (causal, a window) lets see a key sees one in its
    sequence too: no row becomes empty that the case's own lengths do not leave empty.
    """
    check_choice("align", align, ALIGNS)
    B, Lq, Lk = case.B, case.Lq, case.Lk
    lq, lk = [], []
    for b in range(B):
        d = Lq * (B - 1 - b) // (2 * B)
        lq.append(Lq - d)
        lk.append(Lk - min(d // 2, Lk - 1))
    return Packing(tuple(lq), tuple(lk), Lq, Lk, case_align(case, align) == "bottom_right")


def case_inputs(case: Case, seed: int = 0, align: str = "top_left") -> CaseInputs:
    """The arrays of ``case`` for verify's ``seed`` and ``align``.

    q and k are normal with std ``sqrt(score_std / (scale * sqrt(Dh)))``, so
    that the scaled scores have std ``score_std``; v and the upstream gradients
    ``dout`` and ``dlse`` are standard normal (never all ones; ``dlse`` is drawn
    last, so the other arrays do not depend on whether it is used). Masks keep about 3/4 of the
    entries; without ``case.empty_rows`` every row keeps its diagonal key
    (which the causal, window and segment structure always allows), with it
    a few rows are blanked.
    """
    # -> [B, Hq, Lq, Dh], [B, Hkv, Lk, Dh], [B, Hkv, Lk, Dv], [B, Hq, Lq, Dv], options, [B, Hq, Lq]
    check_choice("align", align, ALIGNS)
    rng = _rng(case, seed)
    B, Hq, Hkv, Lq, Lk, Dh, Dv = case.B, case.Hq, case.Hkv, case.Lq, case.Lk, case.Dh, case.Dv
    scale = 1.0 / math.sqrt(Dh) if case.scale is None or "scale" not in case.options else case.scale
    std = math.sqrt(case.score_std / (scale * math.sqrt(Dh)))
    q = rng.standard_normal((B, Hq, Lq, Dh)) * std  # [B, Hq, Lq, Dh]
    k = rng.standard_normal((B, Hkv, Lk, Dh)) * std  # [B, Hkv, Lk, Dh]
    v = rng.standard_normal((B, Hkv, Lk, Dv))  # [B, Hkv, Lk, Dv]
    dout = rng.standard_normal((B, Hq, Lq, Dv))  # [B, Hq, Lq, Dv]
    if case.score_shift:  # one vector c added to every key of a head: row i's scores move by
        # q_i . c * scale (std score_shift), which the softmax does not see
        c = rng.standard_normal((B, Hkv, 1, Dh))
        c *= case.score_shift / (std * scale * np.linalg.norm(c, axis=-1, keepdims=True))
        k = k + c  # [B, Hkv, Lk, Dh]
    opts: dict = {}
    a = case_align(case, align)
    o = offset(case, a)
    if "causal" in case.options or "causal_bottom_right" in case.options:
        opts["is_causal"] = True
    if a == "bottom_right":
        opts["align"] = "bottom_right"
    if "window" in case.options:
        opts["window"] = tuple(WINDOWS[0] if case.window is None else case.window)
    if "softcap" in case.options:
        opts["softcap"] = float(2.0 if case.softcap is None else case.softcap)
    if "scale" in case.options:
        opts["scale"] = scale
    if "gqa" in case.options:
        opts["enable_gqa"] = True
    if "alibi" in case.options:
        slopes = 2.0 ** (-8.0 * np.arange(1, Hq + 1) / Hq)  # ALiBi's geometric slopes, [Hq]
        if case.full_heads:
            slopes = slopes[None, :] * np.array([1.0, 0.5] * B)[:B, None]  # [B, Hq]
        opts["alibi_slopes"] = slopes
    if "sinks" in case.options:
        opts["sinks"] = rng.standard_normal(Hq) + 1.0  # [Hq]
    diag = _diagonal(case, o)  # [Lq]
    if "segments" in case.options:
        n_seg = 3 if Lq >= 3 else 1
        qs = np.sort(rng.integers(0, n_seg, size=(B, Lq)), axis=-1)  # [B, Lq]
        ks = qs[:, np.clip(np.arange(Lk) - o, 0, Lq - 1)]  # [B, Lk]: each diagonal key shares its id
        if case.empty_rows:
            for b, i in _blank_rows(case):
                qs[b, i] = n_seg + 1  # an id no key has
        opts["q_segments"], opts["k_segments"] = qs.astype(np.int32), ks.astype(np.int32)
    if "mask_bool" in case.options or "mask_float" in case.options:
        shape = (B, Hq if case.full_heads else 1, Lq, Lk)
        keep = rng.random(shape) < 0.75  # [B, 1|Hq, Lq, Lk]
        keep[..., np.arange(Lq), diag] = True
        if case.empty_rows:
            for b, i in _blank_rows(case):
                keep[b, :, i, :] = False
        if "mask_bool" in case.options:
            opts["mask"] = keep
        else:
            opts["mask"] = np.where(keep, rng.standard_normal(shape), -np.inf)
    if "dropout_mask" in case.options:
        p = float(0.2 if case.dropout_p is None else case.dropout_p)
        opts["dropout_p"] = p
        opts["dropout_mask"] = rng.random((B, Hq, Lq, Lk)) >= p  # True = keep
    dlse = rng.standard_normal((B, Hq, Lq))  # [B, Hq, Lq]
    return CaseInputs(q, k, v, dout, opts, dlse)
