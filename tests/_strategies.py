"""Hypothesis strategies shared by the tests: shapes, masks and dropout masks.

Everything is drawn as host NumPy float64 / bool arrays; tests move them onto
the backend under test with the ``to_xp`` fixture.
"""

import numpy as np
from hypothesis import strategies as st

# Mask forms the module accepts, as shapes broadcastable to (B, H, Lq, Lk).
MASK_FORMS = ["LqLk", "11LqLk", "B1LqLk", "B11Lk", "BHLqLk"]
MASK_KINDS = ["none", "bool", "float", "float_inf", "padding"]


def mask_shape(form, B, H, Lq, Lk):
    return {
        "LqLk": (Lq, Lk),
        "11LqLk": (1, 1, Lq, Lk),
        "B1LqLk": (B, 1, Lq, Lk),
        "B11Lk": (B, 1, 1, Lk),
        "BHLqLk": (B, H, Lq, Lk),
    }[form]


@st.composite
def attention_dims(draw, max_b=3, max_h=4, max_l=7, max_dh=8):
    """(B, H, Lq, Lk, Dh), each at least 2 (Dh: unless ``max_dh`` is 1), Lq != Lk: an axis of 1
    or equal lengths would hide a transposed or mis-broadcast gradient (the derandomized
    profile drew an axis of 1 in 23 of 25 examples when 1 was allowed)."""
    assert min(max_b, max_h) >= 2 and max_l >= 3, "sizes of at least 2, Lq != Lk"
    B = draw(st.integers(2, max_b))
    H = draw(st.integers(2, max_h))
    Lq = draw(st.integers(2, max_l))
    Lk = draw(st.integers(2, max_l).filter(lambda n: n != Lq))
    Dh = draw(st.integers(min(2, max_dh), max_dh))
    return B, H, Lq, Lk, Dh


def make_mask(rng, kind, form, B, H, Lq, Lk, *, masked_row=False):
    """A host mask of ``kind`` in ``form``; ``masked_row`` blanks one whole query row."""
    if kind == "none":
        return None
    if kind == "padding":
        lengths = rng.integers(0 if masked_row else 1, Lk + 1, size=B)  # 0 = whole batch masked
        m = np.arange(Lk)[None, :] < lengths[:, None]  # [B, Lk]
        return m[:, None, None, :]  # [B, 1, 1, Lk]
    shape = mask_shape(form, B, H, Lq, Lk)
    keep = rng.random(shape) > 0.3
    if masked_row and form not in ("B11Lk",):
        keep[..., rng.integers(Lq), :] = False
    elif masked_row:
        keep[rng.integers(B)] = False  # every query row of one batch entry
    if kind == "bool":
        return keep
    m = rng.standard_normal(shape)
    if kind == "float_inf":
        m = np.where(keep, m, -np.inf)
    return m


mask_kinds = st.sampled_from(MASK_KINDS)
mask_forms = st.sampled_from(MASK_FORMS)
