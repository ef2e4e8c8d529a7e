"""Attention cases shared by the tests of every implementation (test_attention, test_dask):
host inputs with masks, GQA and dropout, the kernel options alone (``make_option_case``)
or drawn together (``joint_cases``), and a closeness check scaled to each tensor."""

import math

import numpy as np
from hypothesis import strategies as st

P_DROP = 0.3
# mask shapes, relative to the scores (B, Hq, Lq, Lk); each broadcasts to them
MASK_FORMS = {
    "full": lambda B, H, Lq, Lk: (B, H, Lq, Lk),
    "LqLk": lambda B, H, Lq, Lk: (Lq, Lk),
    "B1LqLk": lambda B, H, Lq, Lk: (B, 1, Lq, Lk),
    "1HLqLk": lambda B, H, Lq, Lk: (1, H, Lq, Lk),
    "B11Lk": lambda B, H, Lq, Lk: (B, 1, 1, Lk),
    "HLq1": lambda B, H, Lq, Lk: (H, Lq, 1),
    "Lk": lambda B, H, Lq, Lk: (Lk,),
}


def make_mask(rng, kind, shape, empty_row=True):
    """A bool mask, or a float mask with -inf where not allowed; ``empty_row`` blanks query row 0.

    For a shape without a query axis, ``empty_row`` blanks batch entry 0
    (every row of it) where the shape has a batch axis.
    """
    if kind == "none":
        return None
    allowed = rng.random(shape) > 0.3  # [shape]
    if empty_row and len(shape) >= 2 and shape[-2] > 1:
        allowed[..., 0, :] = False  # query row 0 attends nothing
    elif empty_row and len(shape) == 4 and shape[0] > 1:
        allowed[0] = False  # batch entry 0 attends nothing
    if kind == "bool":
        return allowed
    return np.where(allowed, rng.standard_normal(shape), -np.inf)  # [shape] float, -inf = masked


def make_inputs(seed, B, Hkv, G, Lq, Lk, Dh, Dv, *, mask_kind="none", mask_form="full",
                dropout="none", causal=False, dtype=np.float64, empty_row=True):
    """Host arrays q, k, v, dout and the keyword arguments of ``attention.sdpa_forward``."""
    rng = np.random.default_rng(seed)
    Hq = G * Hkv
    q = rng.standard_normal((B, Hq, Lq, Dh)).astype(dtype)
    k = rng.standard_normal((B, Hkv, Lk, Dh)).astype(dtype)
    v = rng.standard_normal((B, Hkv, Lk, Dv)).astype(dtype)
    dout = rng.standard_normal((B, Hq, Lq, Dv)).astype(dtype)
    kw = dict(is_causal=causal, enable_gqa=G > 1)
    mask = make_mask(rng, mask_kind, MASK_FORMS[mask_form](B, Hq, Lq, Lk), empty_row)
    if mask is not None:
        kw["mask"] = mask if mask.dtype == bool else mask.astype(dtype)
    if dropout == "seed":
        kw.update(dropout_p=P_DROP, rng=seed)
    elif dropout == "mask":
        kw.update(dropout_p=P_DROP, dropout_mask=rng.random((1, Hq, Lq, Lk)) >= P_DROP)
    return q, k, v, dout, kw


def on(to_xp, kw):
    """``kw`` with its arrays moved to the backend under test."""
    return {n: (to_xp(a) if isinstance(a, np.ndarray) else a) for n, a in kw.items()}



def assert_close(a, ref, to_np, what, rtol=1e-12):
    """``a`` equals ``ref`` to ``rtol`` of each entry plus ``rtol * max|ref|`` (the tensor's scale).

    The scale is at least 1, the size of the unit-normal inputs: a gradient
    that is exactly 0 in the reference (one attendable key: ``ds = dp - dp``)
    is a difference of O(1) terms elsewhere, and rounds to ~1e-16 there.
    """
    if ref is None:
        assert a is None, f"{what}: expected None"
        return
    a, ref = to_np(a), to_np(ref)
    assert a.shape == ref.shape, f"{what}: shapes {a.shape} vs {ref.shape}"
    assert a.dtype == ref.dtype, f"{what}: dtypes {a.dtype} vs {ref.dtype}"
    assert np.all(np.isfinite(a)), f"{what}: not finite"
    atol = rtol * max(float(np.max(np.abs(ref), initial=0.0)), 1.0)
    np.testing.assert_allclose(a, ref, rtol=rtol, atol=atol, err_msg=what)


def one_kv_head_case(seed):
    """q of 4 heads against k and v of one head, (B, 1, Lk, D), which broadcast to q's heads
    without GQA: (q, k, v, want, dout), ``want`` softmax(q k^T / sqrt(Dh)) v written out with
    the one K/V head, ``dout`` a random upstream gradient."""
    r = np.random.default_rng(seed)
    q = r.standard_normal((2, 4, 5, 3))  # [B, H, Lq, Dh]
    k, v = r.standard_normal((2, 1, 6, 3)), r.standard_normal((2, 1, 6, 2))  # [B, 1, Lk, D]
    s = np.einsum("bhid,bjd->bhij", q, k[:, 0]) / math.sqrt(3)  # [B, H, Lq, Lk]
    p = np.exp(s - s.max(axis=-1, keepdims=True))
    want = np.einsum("bhij,bjd->bhid", p / p.sum(axis=-1, keepdims=True), v[:, 0])  # [B, H, Lq, Dv]
    return q, k, v, want, r.standard_normal(want.shape)


#: the kernel-option cases of make_option_case
OPTION_CASES = ["window", "window_left", "causal_bottom_right", "softcap", "alibi", "alibi_bh",
                "sinks", "segments", "broadcast", "all"]


def make_option_case(name, Lq, Lk, seed=0):
    """Host q, k, v, dout, dlse and the keyword arguments of the kernel-option case ``name``
    (``OPTION_CASES``): (B, H, Dh, Dv) = (2, 4, 3, 2), 2 K/V heads under GQA ("all")."""
    rng = np.random.default_rng(seed)
    B, H, Dh, Dv = 2, 4, 3, 2
    Hkv = H // 2 if name == "all" else H
    q_lead, k_lead = (B, H), (B, Hkv)
    if name == "broadcast":  # leading axes broadcast: q over the batch, k and v over heads
        q_lead, k_lead = (1, H), (B, 1)
    q = rng.standard_normal(q_lead + (Lq, Dh))
    k = rng.standard_normal(k_lead + (Lk, Dh))
    v = rng.standard_normal(k_lead + (Lk, Dv))
    out_lead = (B, H)
    dout = rng.standard_normal(out_lead + (Lq, Dv))
    dlse = rng.standard_normal(out_lead + (Lq,))
    qseg = np.stack([np.repeat([0, 1], [2, Lq - 2]), np.repeat([3, 5], [Lq - 1, 1])])  # [B, Lq]
    kseg = np.stack([np.repeat([0, 1], [Lk - 2, 2]), np.repeat([3, 4], [Lk - 1, 1])])  # [B, Lk]
    # batch 1's last query (segment 5) has no key: a row with nothing to attend
    kw = {
        "window": dict(window=(2, 1)),
        "window_left": dict(window=(1, None), align="bottom_right"),
        "causal_bottom_right": dict(is_causal=True, align="bottom_right"),
        "softcap": dict(softcap=1.5, scale=2.0),
        "alibi": dict(alibi_slopes=rng.random(H)),
        "alibi_bh": dict(alibi_slopes=rng.random((B, H)), align="bottom_right"),
        "sinks": dict(sinks=rng.standard_normal(H),
                      mask=np.where(rng.random((B, 1, Lq, Lk)) > 0.3, 0.0, -np.inf)),
        "segments": dict(q_segments=qseg, k_segments=kseg),
        "broadcast": dict(is_causal=True),
        "all": dict(window=(3, 1), align="bottom_right", is_causal=True, softcap=2.0,
                    alibi_slopes=rng.random(H), sinks=rng.standard_normal(H),
                    q_segments=qseg, k_segments=kseg, enable_gqa=True, dropout_p=0.25,
                    dropout_mask=rng.random((B, H, Lq, Lk)) >= 0.25,
                    mask=np.where(rng.random((B, H, Lq, Lk)) > 0.2,
                                  rng.standard_normal((B, H, Lq, Lk)), -np.inf)),
    }[name]
    if "mask" in kw:
        kw["mask"][0, :, 1, :] = -np.inf  # query row 1 of batch 0 attends nothing
    return q, k, v, dout, dlse, kw


@st.composite
def joint_cases(draw):
    """Every option of the dispatcher drawn together, where the fixed cases take a few at a
    time: GQA, masks of every form with an empty row, dropout from a seed, a keep-mask or a
    keep-mask at p = 0, a scale, and the kernel options, on shapes with Lq > Lk and Lq < Lk.
    Now and then one of Lq, Lk, Dh, Dv is 1 (``one``; None, the first, is what the
    derandomized profile draws most), and sinks as large as 1e4 either way."""
    Lq, Lk = draw(st.integers(2, 7)), draw(st.integers(2, 6))
    return dict(
        seed=draw(st.integers(0, 2**16)), B=draw(st.integers(1, 2)), Hkv=draw(st.integers(1, 2)),
        G=draw(st.integers(1, 3)), Lq=Lq, Lk=Lk + (Lk >= Lq),  # 2 to 7, not Lq
        Dh=draw(st.integers(2, 4)), Dv=draw(st.integers(2, 4)),
        one=draw(st.sampled_from([None, "Lq", "Lk", "Dh", "Dv"])),
        mask=draw(st.sampled_from(["none", "bool", "float"])),
        mask_form=draw(st.sampled_from(sorted(MASK_FORMS))),
        causal=draw(st.booleans()), align=draw(st.sampled_from(["top_left", "bottom_right"])),
        window=draw(st.one_of(st.none(), st.tuples(st.one_of(st.none(), st.integers(0, 3)),
                                                   st.one_of(st.none(), st.integers(0, 3))))),
        softcap=draw(st.one_of(st.none(), st.floats(0.5, 5.0))),
        alibi=draw(st.sampled_from([None, "H", "BH"])),
        sinks=draw(st.sampled_from([None, "drawn", "head 0 none", "+1e4", "-1e4"])),
        segments=draw(st.booleans()),
        dropout=draw(st.sampled_from(["none", "seed", "mask", "mask at p = 0"])),
        scale=draw(st.one_of(st.none(), st.floats(0.25, 2.0))),
        blocks=(draw(st.sampled_from([None, 1, 2, 3, 8])), draw(st.sampled_from([None, 1, 2, 3, 8]))),
        dlse_empty=draw(st.sampled_from([0.0, math.inf, -math.inf, math.nan])),
    )


def joint_inputs(c):
    """Host q, k, v, dout, dlse and the keyword arguments of case ``c`` (``joint_cases``)."""
    dims = {n: c[n] for n in ("B", "Hkv", "G", "Lq", "Lk", "Dh", "Dv")}
    if c["one"] is not None:
        dims[c["one"]] = 1
    B, Hq, Lq, Lk = dims["B"], dims["Hkv"] * dims["G"], dims["Lq"], dims["Lk"]
    dropout = "mask" if c["dropout"] == "mask at p = 0" else c["dropout"]
    q, k, v, dout, kw = make_inputs(c["seed"], *dims.values(), mask_kind=c["mask"],
                                    mask_form=c["mask_form"], dropout=dropout, causal=c["causal"])
    if c["dropout"] == "mask at p = 0":  # a keep-mask applies at p = 0 too, with scale 1
        del kw["dropout_p"]
    r = np.random.default_rng(c["seed"] + 1)
    dlse = r.standard_normal((B, Hq, Lq))
    kw.update(align=c["align"], window=c["window"], softcap=c["softcap"], scale=c["scale"])
    if c["alibi"]:
        kw["alibi_slopes"] = r.random(Hq if c["alibi"] == "H" else (B, Hq))
    if c["sinks"] is not None:
        kw["sinks"] = {"drawn": r.standard_normal(Hq), "+1e4": np.full(Hq, 1e4),
                       "-1e4": np.full(Hq, -1e4),
                       "head 0 none": np.concatenate([[-np.inf], r.standard_normal(Hq - 1)])}[c["sinks"]]
    if c["segments"]:
        kw["q_segments"], kw["k_segments"] = r.integers(0, 2, (B, Lq)), r.integers(0, 2, (B, Lk))
    return q, k, v, dout, dlse, kw
