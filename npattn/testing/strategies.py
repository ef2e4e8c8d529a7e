"""Hypothesis strategies for attention cases: shapes, masks and options.

``attention_cases(supports=...)`` draws ``npattn.verify_cases.Case`` objects
that ``npattn.verify`` (or ``npattn.testing.assert_attention_close``) runs
with ``cases=[case]``; every array of a case comes from its own drawn seed,
so a failing example is reproduced by the case hypothesis prints. The
options of a case are a subset of ``supports`` that one call can hold, and,
unless "empty_rows" is declared, no row is left with nothing to attend.

Needs hypothesis (``pip install hypothesis``, or ``'.[test]'`` from the repository root);
without it the import raises ``ImportError`` saying so.

Shape legend: B batch, Hq query heads, Hkv key/value heads, Lq/Lk query/key
lengths, Dh key width, Dv value width.
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Iterable

try:
    from hypothesis import strategies as st
except ImportError as exc:  # hypothesis is a test dependency, not npattn's
    raise ImportError("npattn.testing.strategies needs hypothesis: pip install hypothesis, or '.[test]' "
                      "from the repository root") from exc

from ..validation import ALIGNS, check_choice, check_positive_int, described
from ..verify_cases import (PERMISSIONS, Case, check_supports, conflicts, fit_lengths)

__all__ = ["attention_cases", "option_sets"]


def option_sets(supports: Iterable[str] = (), align: str = "top_left") -> st.SearchStrategy:
    """Sorted tuples of options of ``supports`` that one call can hold (maybe empty).

    About half of the draws hold no option or one (each option alone as often as the
    others); the rest take each option with probability 1/2, so that every pair one call
    can hold comes together, less the sets that cannot be one call.
    """
    check_choice("align", align, ALIGNS)
    opts = [s for s in check_supports(supports) if s not in PERMISSIONS]
    if not opts:
        return st.just(())
    alone = st.sampled_from([()] + [(s,) for s in opts])  # none or one: no conflict possible
    each = st.tuples(*(st.booleans() for _ in opts)).map(
        lambda keep: tuple(s for s, k in zip(opts, keep) if k))  # sorted, as opts is
    return st.one_of(alone, each.filter(lambda t: not conflicts(t, align)))


def attention_cases(supports: Iterable[str] = (), *, align: str = "top_left",
                    max_batch: int = 2, max_heads: int = 4, max_len: int = 70,
                    max_dim: int = 16, options=None) -> st.SearchStrategy:
    """``Case`` objects for a kernel that declares ``supports``.

    Parameters
    ----------
    supports : iterable of str
        As ``npattn.verify``'s; "empty_rows" lets masks and segments blank rows.
    align : {"top_left", "bottom_right"}
        verify's ``align`` (the case's window and ALiBi follow it).
    max_batch, max_heads, max_len, max_dim : int
        Upper bounds of B, Hq, Lq and Lk, Dh and Dv (lower bounds are 1), but
        for the two options that need two values: a "gqa" case has Hq >= 2
        (Hq = 2 over Hkv = 1 with ``max_heads=1``) and a "dv_ne_dk" one
        Dv != Dh (Dv = 2 with ``max_dim=1``).
    options : strategy of option tuples, optional
        Default ``option_sets(supports, align)``. Each tuple it draws must hold options
        of ``supports`` that one call can hold (a ``ValueError`` naming it otherwise).

    Arguments are checked when it is called: ``TypeError`` / ``ValueError`` naming one.
    """
    supports = check_supports(supports)
    check_choice("align", align, ALIGNS)
    max_batch = check_positive_int("max_batch", max_batch)
    max_heads = check_positive_int("max_heads", max_heads)
    max_len = check_positive_int("max_len", max_len)
    max_dim = check_positive_int("max_dim", max_dim)
    if options is not None and not isinstance(options, st.SearchStrategy):
        raise TypeError(f"options: expected None or a hypothesis strategy of option tuples, "
                        f"got {described(options)}")
    return _cases(supports, align, max_batch, max_heads, max_len, max_dim, options)


def _checked_options(opts, supports: tuple, align: str) -> tuple:
    """A tuple drawn by a caller's ``options`` strategy, sorted, after a ``ValueError`` unless
    it holds options of ``supports`` that one call can hold."""
    allowed = [s for s in supports if s not in PERMISSIONS]
    if (not isinstance(opts, (tuple, list)) or not all(isinstance(o, str) and o in allowed for o in opts)
            or len(set(opts)) != len(opts) or conflicts(opts, align)):
        raise ValueError(f"options: expected tuples of distinct options of {allowed} that one call "
                         f"can hold (align={align!r}), got {opts!r}")
    return tuple(sorted(opts))


@st.composite
def _cases(draw, supports: tuple, align: str, max_batch: int, max_heads: int, max_len: int,
           max_dim: int, options) -> Case:
    """The strategy of ``attention_cases``, on checked arguments."""
    empty_ok = "empty_rows" in supports
    if options is None:
        opts = draw(option_sets(supports, align))
    else:
        opts = _checked_options(draw(options), supports, align)
    B = draw(st.integers(1, max_batch))
    Hkv = draw(st.integers(1, max_heads))
    Hq = Hkv
    if "gqa" in opts:
        Hkv = draw(st.integers(1, max(1, max_heads // 2)))
        Hq = Hkv * draw(st.integers(2, max(2, max_heads // Hkv)))
    Lq, Lk = draw(st.integers(1, max_len)), draw(st.integers(1, max_len))
    Lq, Lk = fit_lengths(Lq, Lk, opts, empty_ok)
    Dh = draw(st.integers(1, max_dim))
    Dv = Dh
    if "dv_ne_dk" in opts:
        Dv = draw(st.integers(1, max_dim).filter(lambda d: d != Dh)) if max_dim > 1 else Dh + 1
    kw: dict = {}
    # a side of 0 as often as an unbounded one (right = 0 is the causal sliding window), and
    # bounded sides within the lengths: drawn up to max_len, most windows left every key in
    side = st.one_of(st.none(), st.just(0), st.integers(1, max(Lq, Lk)))
    if "window" in opts:
        kw["window"] = (draw(side), draw(side))
    if "softcap" in opts:
        kw["softcap"] = draw(st.sampled_from([1.0, 2.0, 5.0, 20.0]))
    if "scale" in opts:
        kw["scale"] = draw(st.sampled_from([0.3, 0.5, 1.7])) / math.sqrt(Dh)
    if "dropout_mask" in opts:
        kw["dropout_p"] = draw(st.sampled_from([0.1, 0.3, 0.6]))
    masky = bool({"mask_bool", "mask_float", "segments"} & set(opts))
    case = Case(
        name="drawn", B=B, Hq=Hq, Hkv=Hkv, Lq=Lq, Lk=Lk, Dh=Dh, Dv=Dv, options=opts,
        score_std=draw(st.sampled_from([0.3, 1.0, 3.0])),
        full_heads=draw(st.booleans()),
        empty_rows=bool(empty_ok and masky and draw(st.booleans())),
        seed=draw(st.integers(0, 2**32 - 1)), **kw)
    tag = "+".join(opts) or "base"
    return replace(case, name=f"drawn-{tag}-{Lq}x{Lk}-s{case.seed}")
