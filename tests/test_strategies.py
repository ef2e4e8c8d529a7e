"""What ``npattn.testing.strategies`` draws, counted over a few hundred cases.

A strategy that seldom draws what it promises makes a user's ``@given`` test weaker than
it reads: each test here draws a fixed (derandomized) run of cases and counts the options,
pairs of options and windows that users rely on. The expectations come from the
definitions written out here (which options one call cannot hold; the window rule
``i + o - left <= j <= i + o + right``), not from npattn's own helpers.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from npattn.testing import strategies as S

ALL = ("alibi", "causal", "causal_bottom_right", "dropout_mask", "dv_ne_dk", "gqa", "mask_bool",
       "mask_float", "scale", "segments", "sinks", "softcap", "window")
#: Pairs one top-left call cannot hold: one mask, one causal alignment, and bottom-right
#: causal beside a window or ALiBi that follow align="top_left".
CANNOT_TOP_LEFT = {("mask_bool", "mask_float"), ("causal", "causal_bottom_right"),
                   ("causal_bottom_right", "window"), ("alibi", "causal_bottom_right")}


def drawn(strategy, n):
    """``n`` examples of ``strategy``, the same ones on every run."""
    out = []

    @settings(max_examples=n, derandomize=True, database=None, deadline=None,
              suppress_health_check=[HealthCheck.too_slow])
    @given(strategy)
    def collect(x):
        out.append(x)

    collect()
    return out


def test_attention_cases_draw_each_option_alone_and_every_pair_one_call_can_hold():
    """supports="all": lists of options drew no option in 37-57 % of 1000 cases (hypothesis
    6.100 and 6.170), and some pairs (bottom-right causal with GQA, GQA with a boolean mask)
    in fewer than 1 in 100; here under 30 % hold none, each option comes up alone (18 times
    at least in both versions) and the pairs a top-left call can hold come up (all of them in
    both versions; 95 % is asked, as how often hypothesis draws each is its own choice)."""
    cases = drawn(S.attention_cases(supports="all", max_len=12, max_dim=4), 1000)
    sets = [c.options for c in cases]
    for opts in sets:
        assert not {p for p in itertools.combinations(opts, 2)} & CANNOT_TOP_LEFT, opts
    alone = {o[0] for o in sets if len(o) == 1}
    assert alone == set(ALL)
    pairs = {p for o in sets for p in itertools.combinations(o, 2)}
    want = set(itertools.combinations(ALL, 2)) - CANNOT_TOP_LEFT
    assert len(want & pairs) >= 0.95 * len(want), sorted(want - pairs)
    assert sum(not o for o in sets) < 0.3 * len(sets)


@pytest.mark.parametrize("align", ["top_left", "bottom_right"])
def test_attention_cases_draw_windows_that_leave_keys_out(align):
    """Window sides were drawn up to max_len whatever the lengths, so most drawn windows
    left every key in, and a causal sliding window (left bounded, right = 0) came up in
    about 1 case in 100; here most windows hide some key (by the rule written out), and a
    tenth at least are causal sliding windows."""
    windows = drawn(S.attention_cases(supports="window", align=align, options=st.just(("window",))), 200)
    hiding = sliding = 0
    for c in windows:
        left, right = c.window
        o = c.Lk - c.Lq if align == "bottom_right" else 0
        i, j = np.arange(c.Lq)[:, None], np.arange(c.Lk)[None, :]  # [Lq, 1], [1, Lk]
        allowed = np.ones((c.Lq, c.Lk), dtype=bool)  # [Lq, Lk]
        if left is not None:
            allowed &= j >= i + o - left
        if right is not None:
            allowed &= j <= i + o + right
        assert allowed.any(axis=-1).all(), c.describe()  # no empty row without "empty_rows"
        hiding += not allowed.all()
        sliding += left is not None and right == 0
    assert hiding > len(windows) / 2
    assert sliding > len(windows) / 10


def test_attention_cases_check_their_arguments():
    """Bounds, align and options= were used unchecked: max_len=0 raised hypothesis's
    "Cannot have max_value=0 < min_value=1" at the first draw, naming no argument; an align
    of "bottom-right" drew cases as if it were not top-left; and a caller's options strategy
    gave cases holding options beyond supports, or both causal alignments (a case verify ran
    as bottom-right alone and reported under both)."""
    with pytest.raises(ValueError, match=r"^max_len: expected a positive int, got 0$"):
        S.attention_cases("causal", max_len=0)
    with pytest.raises(TypeError, match=r"^max_dim: expected a positive int, got float"):
        S.attention_cases("causal", max_dim=2.5)
    for make in (S.attention_cases, S.option_sets):
        with pytest.raises(ValueError,
                           match=r"^align: expected 'top_left' or 'bottom_right', got 'bottom-right'$"):
            make("causal,window", align="bottom-right")
    with pytest.raises(TypeError, match=r"^options: expected None or a hypothesis strategy"):
        S.attention_cases("causal", options=("causal",))
    for supports, opts in [("causal,causal_bottom_right", ("causal", "causal_bottom_right")),
                           ("causal", ("mask_bool",)), ("causal,mask_bool,empty_rows", ("empty_rows",)),
                           ("causal", ("causal", "causal"))]:
        with pytest.raises(ValueError, match=r"^options: expected tuples of distinct options of"):
            drawn(S.attention_cases(supports, options=st.just(opts)), 1)
    # what options= may draw: options of supports that one call holds, in any order
    cases = drawn(S.attention_cases("causal,mask_bool,window", options=st.just(("window", "causal"))), 5)
    assert {c.options for c in cases} == {("causal", "window")}
