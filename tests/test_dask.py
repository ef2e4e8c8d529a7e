"""npattn on dask arrays: the chunk-parallel implementation against the NumPy one.

``impl="chunked"`` (what ``"auto"`` picks for dask arrays) runs one task per
pair of (batch, head, query, key) chunks with the blocked algorithm inside
and merges across key chunks. In float64 its outputs and gradients equal the
NumPy kernel's to 1e-12 for every chunking, and the dropout keep-mask drawn
from a seed is the same, bit for bit. Most tests use dask's synchronous and
threaded schedulers; ``client`` starts a ``dask.distributed`` LocalCluster of
two worker processes for the tests that must see real workers.
"""

import json
import math
import warnings

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

da = pytest.importorskip("dask.array", reason="the dask tests need the dask extra")
dask = pytest.importorskip("dask")
distributed = pytest.importorskip("distributed")

from npattn import MultiHeadAttention, blocked, chunked  # noqa: E402
from npattn import attention as A  # noqa: E402
from npattn import functional as F  # noqa: E402
from npattn.backend import backend_name, resolve_backend, to_numpy  # noqa: E402
from npattn.gradcheck import gradcheck  # noqa: E402

from _attention_cases import (MASK_FORMS, OPTION_CASES, assert_close, joint_cases,  # noqa: E402
                              joint_inputs, make_inputs, make_option_case, one_kv_head_case)

# (batch, query heads, query rows, keys) chunk lengths; K/V heads are chunked as the
# query heads divided by G. Lengths 7 and 9: chunks of 2, 3, 4 leave short last chunks.
CHUNKINGS = {
    "one chunk": (8, 8, 99, 99),
    "batch": (1, 8, 99, 99),
    "batch+heads": (1, 1, 99, 99),
    "queries": (8, 8, 3, 99),
    "keys": (8, 8, 99, 2),
    "everything": (1, 1, 2, 4),
}


def chunk(q, k, v, mask, keep, dout, sizes, G):
    """Host arrays as dask arrays with the chunk lengths ``sizes`` (clipped to each axis)."""
    cb, ch, cq, ck = sizes
    hk = max(1, ch // G)

    def arr(a, chunks):
        return None if a is None else da.from_array(a, chunks=tuple(min(c, n) for c, n in zip(chunks, a.shape)))

    def mask_chunks(a):  # a mask of up to 4 axes, chunked like the scores it broadcasts to
        return tuple((cb, ch, cq, ck)[4 - a.ndim:])

    return (arr(q, (cb, ch, cq, 99)), arr(k, (cb, hk, ck, 99)), arr(v, (cb, hk, ck, 99)),
            None if mask is None else arr(mask, mask_chunks(mask)),
            None if keep is None else arr(keep, mask_chunks(keep)), arr(dout, (cb, ch, cq, 99)))


def host(x):
    return None if x is None else to_numpy(x)


# the cache type tells which implementation ran on dask
DASK_CACHES = {"auto": chunked.ChunkedSDPACache, "chunked": chunked.ChunkedSDPACache,
               "reference": F.SDPACache, "blocked": blocked.BlockedSDPACache}


def run_both(q, k, v, dout, kw, sizes, G, scheduler="sync", impl="auto"):
    """(out, grads, keep) on NumPy (the kernel) and on dask (``impl``; auto: chunked), computed."""
    out0, c0 = A.sdpa_forward(q, k, v, impl="numpy", **kw)
    grads0 = A.sdpa_backward(dout, c0)
    keep0 = A.dropout_keep_mask(c0)
    dq, dk, dv, dmask, dkeep, ddout = chunk(q, k, v, kw.get("mask"), kw.get("dropout_mask"), dout, sizes, G)
    dkw = dict(kw, mask=dmask, dropout_mask=dkeep)
    if impl != "auto":
        dkw.update(impl=impl, block_q=2, block_k=3)
    out, c = A.sdpa_forward(dq, dk, dv, **dkw)
    assert isinstance(c, DASK_CACHES[impl]), f"impl={impl!r} on dask: {type(c).__name__}"
    grads = A.sdpa_backward(ddout, c)
    assert all(isinstance(g, da.Array) for g in (out, *grads) if g is not None)
    keep = A.dropout_keep_mask(c)
    computed = dask.compute(out, grads, keep, scheduler=scheduler)
    return (out0, grads0, keep0), computed


def assert_same(ref, got, what):
    (out0, grads0, keep0), (out, grads, keep) = ref, got
    assert_close(out, out0, host, f"{what}: out")
    for name, g, g0 in zip(("dq", "dk", "dv", "dmask"), grads, grads0):
        assert_close(g, g0, host, f"{what}: {name}")
    if keep0 is None:
        assert keep is None
    else:
        assert np.array_equal(np.broadcast_to(keep0, keep.shape), keep), f"{what}: keep-mask differs"


# --------------------------------------------------------------------------
# the same numbers as NumPy


@pytest.mark.parametrize("chunking", sorted(CHUNKINGS))
@pytest.mark.parametrize("case", [
    dict(mask_kind="none", causal=False, dropout="none"),
    dict(mask_kind="bool", mask_form="B11Lk", causal=False, dropout="seed"),  # padding
    dict(mask_kind="float", mask_form="LqLk", causal=True, dropout="none"),  # -inf, an empty row
    dict(mask_kind="bool", mask_form="full", causal=True, dropout="mask"),
    dict(mask_kind="float", mask_form="B1LqLk", causal=False, dropout="seed"),
], ids=["plain", "padding+seed", "float+causal", "bool+causal+keep", "float+seed"])
@pytest.mark.parametrize("G", [1, 2])
def test_chunked_equals_numpy(chunking, case, G):
    q, k, v, dout, kw = make_inputs(7, 2, 2, G, 7, 9, 4, 3, **case)
    ref, got = run_both(q, k, v, dout, kw, CHUNKINGS[chunking], G)
    assert_same(ref, got, f"{chunking} {case} G={G}")


@st.composite
def chunked_cases(draw):
    Lq = draw(st.integers(2, 9))
    G = draw(st.integers(1, 2))
    return dict(
        seed=draw(st.integers(0, 2**16)), B=draw(st.integers(1, 3)), Hkv=draw(st.integers(1, 2)),
        G=G, Lq=Lq, Lk=draw(st.integers(2, 9).filter(lambda n: n != Lq)),
        Dh=draw(st.integers(2, 4)), Dv=draw(st.integers(2, 4)),
        mask_kind=draw(st.sampled_from(["none", "bool", "float"])),
        mask_form=draw(st.sampled_from(sorted(MASK_FORMS))),
        causal=draw(st.booleans()), dropout=draw(st.sampled_from(["none", "seed", "mask"])),
        sizes=(draw(st.integers(1, 3)), G * draw(st.integers(1, 2)), draw(st.integers(1, 9)),
               draw(st.integers(1, 9))),
    )


@given(case=chunked_cases())
def test_chunked_equals_numpy_for_drawn_cases(case):
    """Shapes, chunk lengths, mask kinds and forms, causal, GQA and dropout drawn together."""
    case = dict(case)
    sizes, G = case.pop("sizes"), case["G"]
    seed, dims = case.pop("seed"), [case.pop(n) for n in ("B", "Hkv", "G", "Lq", "Lk", "Dh", "Dv")]
    q, k, v, dout, kw = make_inputs(seed, *dims, **case)
    ref, got = run_both(q, k, v, dout, kw, sizes, G)
    assert_same(ref, got, f"{case} dims={dims} chunks={sizes}")


@given(case=chunked_cases(), impl=st.sampled_from(["reference", "blocked"]))
def test_reference_and_blocked_on_dask_equal_numpy_for_drawn_cases(case, impl):
    """The other two implementations on chunked dask arrays: the same drawn cases, the same
    numbers and keep-mask as the NumPy kernel."""
    case = dict(case)
    sizes, G = case.pop("sizes"), case["G"]
    seed, dims = case.pop("seed"), [case.pop(n) for n in ("B", "Hkv", "G", "Lq", "Lk", "Dh", "Dv")]
    q, k, v, dout, kw = make_inputs(seed, *dims, **case)
    ref, got = run_both(q, k, v, dout, kw, sizes, G, impl=impl)
    assert_same(ref, got, f"{impl} {case} dims={dims} chunks={sizes}")


@pytest.mark.parametrize("Lq,Lk", [(9, 7), (7, 9)])
def test_causal_chunks_above_the_diagonal_are_left_out(Lq, Lk):
    """Top-left causal: a key chunk wholly above a query chunk's rows has no task, forward or
    backward, and the key chunks that no query row reaches (Lk > Lq) get zero gradients."""
    q, k, v, dout, kw = make_inputs(3, 1, 2, 1, Lq, Lk, 4, 4, causal=True)
    ref, got = run_both(q, k, v, dout, kw, (1, 2, 2, 2), 1)
    assert_same(ref, got, "causal")
    dq, dk, dv, _, _, ddout = chunk(q, k, v, None, None, dout, (1, 2, 2, 2), 1)
    out, c = A.sdpa_forward(dq, dk, dv, is_causal=True)
    grads = A.sdpa_backward(ddout, c)
    starts_i, starts_j = range(0, Lq, 2), range(0, Lk, 2)
    expected = sum(1 for i0 in starts_i for j0 in starts_j if j0 <= min(i0 + 2, Lq) - 1)
    for step, arrays in (("forward", [out]), ("backward", grads[:3])):
        pairs = [key for key in graph_of(*arrays) if isinstance(key, tuple)
                 and key[0].startswith("npattn-pair-" + step)]
        assert len(pairs) == expected < len(starts_i) * len(starts_j), step


# --------------------------------------------------------------------------
# the kernel options on chunks


def to_dask_options(kw):
    """``kw`` with its arrays as dask arrays in chunks of 1 on every axis but the last (2 there):
    unlike any plan, so the chunked path rechunks them."""
    def arr(a):
        return da.from_array(a, chunks=(1,) * (a.ndim - 1) + (2,)) if isinstance(a, np.ndarray) else a
    return {n: arr(a) for n, a in kw.items()}


def run_options(q, k, v, dout, dlse, kw, sizes):
    """(out, lse, grads, keep) of NumPy's reference and of dask ("auto", which must be the
    chunked path) with q, k, v, dout, dlse chunked by ``sizes`` (batch, query heads, query
    rows, keys; K/V heads as the query heads divided by G), computed."""
    out0, c0 = A.sdpa_forward(q, k, v, impl="reference", **kw)
    ref = (out0, c0.lse, A.sdpa_backward(dout, c0, dlse=dlse), A.dropout_keep_mask(c0))
    G = q.shape[1] // k.shape[1]
    dq, dk, dv, _, _, ddout = chunk(q, k, v, None, None, dout, sizes, G)
    ddlse = da.from_array(dlse, chunks=tuple(min(c, n) for c, n in zip(sizes[:3], dlse.shape)))
    out, c = A.sdpa_forward(dq, dk, dv, **to_dask_options(kw))
    assert isinstance(c, chunked.ChunkedSDPACache), type(c).__name__
    got = dask.compute(out, c.lse, A.sdpa_backward(ddout, c, dlse=ddlse), A.dropout_keep_mask(c),
                       scheduler="sync")
    return ref, got


def assert_same_options(ref, got, what):
    """out, the finite lse (and -inf at the same rows), dq, dk, dv, dmask, dsinks to 1e-12, and
    the keep-mask bit for bit."""
    (out0, lse0, grads0, keep0), (out, lse, grads, keep) = ref, got
    assert_close(out, out0, host, f"{what}: out")
    assert np.array_equal(np.isfinite(lse), np.isfinite(lse0)), f"{what}: rows of lse -inf"
    assert_close(np.where(np.isfinite(lse0), lse, 0.0), np.where(np.isfinite(lse0), lse0, 0.0),
                 host, f"{what}: lse")
    for name, g, g0 in zip(("dq", "dk", "dv", "dmask", "dsinks"), grads, grads0):
        assert_close(g, g0, host, f"{what}: {name}")
    if keep0 is None:
        assert keep is None, what
    else:
        assert np.array_equal(np.broadcast_to(keep0, keep.shape), keep), f"{what}: keep-mask differs"


# (batch, query heads, query rows, keys) chunk lengths: every pair small and uneven; keys in
# chunks of one (every pair a single key); queries in chunks of one
OPTION_CHUNKINGS = {"small": (1, 1, 2, 3), "keys of 1": (2, 2, 99, 1), "rows of 1": (1, 2, 1, 99)}


@pytest.mark.parametrize("chunking", sorted(OPTION_CHUNKINGS))
@pytest.mark.parametrize("Lq,Lk", [(5, 7), (6, 4)])
@pytest.mark.parametrize("name", [n for n in OPTION_CASES if n != "broadcast"])
def test_kernel_options_on_chunks_equal_numpys_reference(name, Lq, Lk, chunking):
    """Every kernel option (a window, bottom-right causal, softcap, ALiBi (H) and (B, H),
    sinks with a floating mask and an empty row, segments with a query that has no key, and
    all of them with GQA and a keep-mask) on the chunked path: out, lse and every gradient
    (dlse random) equal NumPy's reference in float64 to 1e-12."""
    q, k, v, dout, dlse, kw = make_option_case(name, Lq, Lk)
    ref, got = run_options(q, k, v, dout, dlse, kw, OPTION_CHUNKINGS[chunking])
    assert_same_options(ref, got, f"{name} {Lq}x{Lk} {chunking}")


@st.composite
def option_cases(draw):
    Lq = draw(st.integers(2, 9))
    G = draw(st.integers(1, 2))
    B, Hkv = draw(st.integers(1, 2)), draw(st.integers(1, 2))
    window = draw(st.one_of(st.none(), st.tuples(st.one_of(st.none(), st.integers(0, 4)),
                                                 st.one_of(st.none(), st.integers(0, 4)))))
    return dict(
        seed=draw(st.integers(0, 2**16)), B=B, Hkv=Hkv, G=G, Lq=Lq,
        Lk=draw(st.integers(2, 9).filter(lambda n: n != Lq)),
        window=window, align=draw(st.sampled_from(["top_left", "bottom_right"])),
        causal=draw(st.booleans()), softcap=draw(st.one_of(st.none(), st.floats(0.5, 5.0))),
        alibi=draw(st.sampled_from([None, "H", "BH"])), sinks=draw(st.booleans()),
        segments=draw(st.booleans()), mask=draw(st.sampled_from(["none", "bool", "float"])),
        dropout=draw(st.sampled_from(["none", "seed", "mask"])),
        sizes=(draw(st.integers(1, 2)), G * draw(st.integers(1, 2)), draw(st.integers(1, 9)),
               draw(st.integers(1, 9))),
    )


@given(case=option_cases())
def test_kernel_options_on_chunks_for_drawn_cases(case):
    """Options, shapes (Lq != Lk), GQA, masks with an empty row, dropout from a seed or a
    keep-mask and chunk lengths drawn together: the chunked path equals NumPy's reference
    to 1e-12, with the same keep-mask."""
    c = case
    r = np.random.default_rng(c["seed"])
    B, Hq, Hkv, Lq, Lk = c["B"], c["G"] * c["Hkv"], c["Hkv"], c["Lq"], c["Lk"]
    q, k = r.standard_normal((B, Hq, Lq, 3)), r.standard_normal((B, Hkv, Lk, 3))
    v = r.standard_normal((B, Hkv, Lk, 2))
    dout, dlse = r.standard_normal((B, Hq, Lq, 2)), r.standard_normal((B, Hq, Lq))
    kw = dict(is_causal=c["causal"], enable_gqa=c["G"] > 1, window=c["window"], align=c["align"],
              softcap=c["softcap"])
    if c["alibi"]:
        kw["alibi_slopes"] = r.random(Hq if c["alibi"] == "H" else (B, Hq))
    if c["sinks"]:
        kw["sinks"] = r.standard_normal(Hq)
    if c["segments"]:
        kw["q_segments"], kw["k_segments"] = r.integers(0, 2, (B, Lq)), r.integers(0, 2, (B, Lk))
    if c["mask"] != "none":
        allowed = r.random((B, 1, Lq, Lk)) > 0.3
        allowed[0, 0, 0] = False  # query 0 of batch 0 attends nothing by the mask
        kw["mask"] = (allowed if c["mask"] == "bool"
                      else np.where(allowed, r.standard_normal(allowed.shape), -np.inf))
    if c["dropout"] == "seed":
        kw.update(dropout_p=0.3, rng=c["seed"])
    elif c["dropout"] == "mask":
        kw.update(dropout_p=0.3, dropout_mask=r.random((B, Hq, Lq, Lk)) >= 0.3)
    ref, got = run_options(q, k, v, dout, dlse, kw, c["sizes"])
    assert_same_options(ref, got, str(case))


@given(case=joint_cases(), sizes=st.tuples(*(st.integers(1, 3) for _ in range(4))))
def test_options_drawn_together_on_chunks(case, sizes):
    """The draws of ``joint_cases`` (every option at once, sinks of +-1e4, a keep-mask at
    p = 0, a scale, an axis of 1 now and then) on chunks of 1 to 3 along (batch, query
    heads, query rows, keys): the chunked path equals NumPy's reference to 1e-12, with the
    same keep-mask; inf or NaN in dlse on the rows with nothing to attend changes nothing."""
    q, k, v, dout, dlse, kw = joint_inputs(case)
    G = q.shape[1] // k.shape[1]
    lse = A.sdpa_forward(q, k, v, impl="reference", **kw)[1].lse
    dlse = np.where(np.isneginf(lse), case["dlse_empty"], dlse)
    ref, got = run_options(q, k, v, dout, dlse, kw, (sizes[0], G * sizes[1], *sizes[2:]))
    assert_same_options(ref, got, f"{case} chunks={sizes}")
    for g in ref[2]:
        assert g is None or np.all(np.isfinite(g))


@st.composite
def chunk_lengths(draw, n):
    """Chunk lengths along an axis of length ``n``: one chunk, chunks of 1, or uneven cuts
    such as (3, 1, 5), sometimes with an empty chunk among them."""
    kind = draw(st.sampled_from(["one", "ones", "cuts"]))
    if kind == "one" or n == 1:
        lengths = [n]
    elif kind == "ones":
        lengths = [1] * n
    else:
        cuts = sorted(draw(st.sets(st.integers(1, n - 1), max_size=n - 1)))
        lengths = [b - a for a, b in zip([0, *cuts], [*cuts, n])]
    if draw(st.integers(0, 4)) == 0:
        lengths.insert(draw(st.integers(0, len(lengths))), 0)
    return tuple(lengths)


@st.composite
def independently_chunked_cases(draw):
    G, Hkv, B = draw(st.integers(1, 3)), draw(st.integers(1, 2)), draw(st.integers(1, 3))
    Lq, Lk, Dh, Dv = (draw(st.integers(1, n)) for n in (10, 10, 3, 3))
    shapes = dict(q=(B, G * Hkv, Lq, Dh), k=(B, Hkv, Lk, Dh), v=(B, Hkv, Lk, Dv),
                  dout=(B, G * Hkv, Lq, Dv), dlse=(B, G * Hkv, Lq))
    return dict(
        seed=draw(st.integers(0, 2**16)), G=G, shapes=shapes,
        # every axis of every array chunked on its own, the head widths too
        chunks={name: tuple(draw(chunk_lengths(n)) for n in shape) for name, shape in shapes.items()},
        dtype=draw(st.sampled_from([np.float64, np.float64, np.float32])),
        magnitude=draw(st.sampled_from([1.0, 1.0, 30.0])),  # large scores across the merge
        causal=draw(st.booleans()), align=draw(st.sampled_from(["top_left", "bottom_right"])),
        window=draw(st.one_of(st.none(), st.tuples(st.one_of(st.none(), st.integers(0, 4)),
                                                   st.one_of(st.none(), st.integers(0, 4))))),
        softcap=draw(st.one_of(st.none(), st.floats(0.5, 5.0))),
        scale=draw(st.one_of(st.none(), st.floats(0.1, 3.0))),
        alibi=draw(st.sampled_from([None, "H", "BH"])),
        sinks=draw(st.sampled_from([None, "drawn", "head 0 -inf"])),
        segments=draw(st.booleans()), mask=draw(st.sampled_from(["none", "bool", "float"])),
        mask_form=draw(st.sampled_from(sorted(MASK_FORMS))),
        fill=draw(st.sampled_from([-math.inf, -1e30, "min"])),  # a float mask's "not allowed"
        dropout=draw(st.sampled_from(["none", "seed", "mask"])),
        blocks=draw(st.sampled_from([(None, None), (1, 1), (2, 3)])),
        dlse=draw(st.booleans()),
    )


@given(case=independently_chunked_cases())
def test_every_input_chunked_on_its_own_equals_numpys_reference(case):
    """q, k, v, dout, dlse, the masks and the option arrays each chunked on its own (uneven
    chunks, chunks of 1, an empty chunk, the head widths split; a mask unlike the scores'
    plan), with every kernel option, a float mask whose "not allowed" is -inf or a large
    finite number, a fully masked row and a masked block, float32 and float64: out, lse and
    every gradient equal NumPy's reference (1e-12 in float64), and the keep-mask is the same."""
    c = case
    r = np.random.default_rng(c["seed"])
    dt = np.dtype(c["dtype"])
    B, Hq, Lq = c["shapes"]["q"][:3]
    Lk = c["shapes"]["k"][2]
    q, k, v, dout, dlse = (r.standard_normal(c["shapes"][n]).astype(dt)
                           for n in ("q", "k", "v", "dout", "dlse"))
    q = q * dt.type(c["magnitude"])
    kw = dict(is_causal=c["causal"], enable_gqa=c["G"] > 1, align=c["align"], window=c["window"],
              softcap=c["softcap"], scale=c["scale"])
    arrays = {}
    if c["alibi"]:
        arrays["alibi_slopes"] = r.random(Hq if c["alibi"] == "H" else (B, Hq)).astype(dt)
    if c["sinks"] is not None:
        arrays["sinks"] = r.standard_normal(Hq).astype(dt)
        if c["sinks"] == "head 0 -inf":
            arrays["sinks"][0] = -np.inf  # no sink on head 0
    if c["segments"]:
        arrays["q_segments"], arrays["k_segments"] = r.integers(0, 2, (B, Lq)), r.integers(0, 2, (B, Lk))
    if c["mask"] != "none":
        shape = MASK_FORMS[c["mask_form"]](B, Hq, Lq, Lk)
        allowed = r.random(shape) > 0.3
        if len(shape) >= 2:
            allowed[..., 0, :] = shape[-2] == 1  # query row 0 attends nothing (with a query axis)
            allowed[..., 2:5, 1:4] = False  # a block masked whole: whole pairs of small chunks
        fill = np.finfo(dt).min if c["fill"] == "min" else c["fill"]
        arrays["mask"] = allowed if c["mask"] == "bool" else np.where(
            allowed, r.standard_normal(shape), fill).astype(dt)
    if c["dropout"] == "seed":
        kw.update(dropout_p=0.3, rng=c["seed"])
    elif c["dropout"] == "mask":
        kw["dropout_p"], arrays["dropout_mask"] = 0.3, r.random((1, Hq, Lq, Lk)) >= 0.3
    dlse = dlse if c["dlse"] else None
    out0, c0 = A.sdpa_forward(q, k, v, impl="reference", **kw, **arrays)
    want = (out0, c0.lse, *A.sdpa_backward(dout, c0, dlse=dlse), A.dropout_keep_mask(c0))

    def own_chunks(a):  # a mask or an option array: cuts of its own, unlike q's and k's
        cuts = [np.unique(r.integers(0, n + 1, size=n)) for n in a.shape]
        return da.from_array(a, chunks=tuple(tuple(np.diff([0, *x, n]).tolist())
                                             for x, n in zip(cuts, a.shape)))

    dd = {n: None if a is None else da.from_array(a, chunks=c["chunks"][n])
          for n, a in (("q", q), ("k", k), ("v", v), ("dout", dout), ("dlse", dlse))}
    out, cache = A.sdpa_forward(dd["q"], dd["k"], dd["v"], block_q=c["blocks"][0], block_k=c["blocks"][1],
                                **kw, **{n: own_chunks(a) for n, a in arrays.items()})
    assert isinstance(cache, chunked.ChunkedSDPACache), type(cache).__name__
    got = dask.compute(out, cache.lse, *A.sdpa_backward(dd["dout"], cache, dlse=dd["dlse"]),
                       A.dropout_keep_mask(cache), scheduler="sync")
    # float32: rounding of the scores grows with their size (a gradient that is 0 exactly came
    # out 1e-5 at magnitude 30, as a difference of two rounded sums)
    rtol = 1e-12 if dt == np.float64 else 1e-5 * c["magnitude"]
    for name, a, b in zip(("out", "lse", "dq", "dk", "dv", "dmask", "dsinks"), got, want):
        if name == "lse":  # -inf on the rows with nothing to attend, on both
            assert np.array_equal(np.isfinite(a), np.isfinite(b)), f"{case}: rows of lse -inf"
            a, b = np.where(np.isfinite(b), a, 0.0).astype(dt), np.where(np.isfinite(b), b, 0.0).astype(dt)
        assert_close(a, b, host, f"{case}: {name}", rtol=rtol)  # finite, where the reference is
    keep, keep0 = got[-1], want[-1]
    assert (keep is None) == (keep0 is None), str(case)
    if keep0 is not None:
        assert np.array_equal(np.broadcast_to(keep0, keep.shape), keep), f"{case}: keep-mask differs"


@pytest.mark.parametrize("window,align", [((1, 0), "top_left"), ((0, 2), "top_left"),
                                          ((1, 1), "bottom_right")])
def test_pairs_outside_a_window_are_left_out(window, align):
    """The pairs of chunks where no query may attend any key by the window (counted here
    position by position: |window| keys about j = i + offset) have no task, forward or
    backward; the keys no query reaches get zero gradients (NumPy's reference)."""
    Lq, Lk, n = 8, 10, 2
    r = np.random.default_rng(31)
    q, k, v = (r.standard_normal(shape) for shape in ((1, 1, Lq, 3), (1, 1, Lk, 3), (1, 1, Lk, 2)))
    dout, dlse = r.standard_normal((1, 1, Lq, 2)), r.standard_normal((1, 1, Lq))
    kw = dict(window=window, align=align)
    ref, got = run_options(q, k, v, dout, dlse, kw, (1, 1, n, n))
    assert_same_options(ref, got, f"{window} {align}")
    offset = Lk - Lq if align == "bottom_right" else 0
    i, j = np.arange(Lq)[:, None], np.arange(Lk)[None, :]
    seen = (j - (i + offset) >= -window[0]) & (j - (i + offset) <= window[1])  # [Lq, Lk]
    expected = sum(bool(seen[a:a + n, b:b + n].any()) for a in range(0, Lq, n) for b in range(0, Lk, n))
    dq, dk, dv, _, _, ddout = chunk(q, k, v, None, None, dout, (1, 1, n, n), 1)
    out, c = A.sdpa_forward(dq, dk, dv, **kw)
    for step, arrays in (("forward", [out]), ("backward", A.sdpa_backward(ddout, c)[:3])):
        pairs = [key for key in graph_of(*arrays) if isinstance(key, tuple)
                 and key[0].startswith("npattn-pair-" + step)]
        assert len(pairs) == expected < (Lq // n) * (Lk // n), (step, len(pairs), expected)


def test_a_sink_alone_on_query_chunks_that_meet_no_key():
    """Bottom-right causal with Lq > Lk leaves the first Lq - Lk queries nothing to attend:
    with the queries in chunks of 2 the first chunk meets no key chunk at all. Its rows give
    out 0; with sinks their lse is the sink and dsinks gets their dlse (d lse / d sink = 1),
    as on NumPy's reference; a sink of -inf is no sink (lse -inf, dsinks 0 from those rows)."""
    r = np.random.default_rng(32)
    q, k, v = (r.standard_normal(shape) for shape in ((1, 2, 6, 3), (1, 2, 3, 3), (1, 2, 3, 2)))
    dout, dlse = r.standard_normal((1, 2, 6, 2)), r.standard_normal((1, 2, 6))
    sinks = np.array([0.7, -np.inf])
    kw = dict(is_causal=True, align="bottom_right", sinks=sinks)
    ref, got = run_options(q, k, v, dout, dlse, kw, (1, 2, 2, 3))
    assert_same_options(ref, got, "sink alone")
    out, lse, grads, _ = got
    assert np.array_equal(out[0, :, :3], np.zeros((2, 3, 2)))  # rows 0-2 see no key (offset -3)
    assert np.array_equal(lse[0, 0, :3], np.full(3, 0.7)) and np.all(lse[0, 1, :3] == -np.inf)


# query and key chunk lengths (the batch and heads one chunk each, or one per chunk):
# short last chunks on both axes (Lq = 7, Lk = 9), and key chunks longer than query chunks
UNEVEN_CHUNKINGS = [(2, 2, 3, 2), (1, 2, 2, 4), (2, 1, 4, 3), (1, 1, 5, 9)]


@pytest.mark.parametrize("sizes", UNEVEN_CHUNKINGS, ids=str)
def test_lse_of_the_merged_rows_equals_the_reference(sizes):
    """``cache.lse`` (m + log(l) of the merged rows; -inf for a row with nothing to attend)
    equals the reference's, with key chunks, causal rows, a float mask blanking row 0 and
    grouped heads (the other tests compare out and the gradients, which use the merged m and
    l but not lse). The empty rows' -inf comes without a RuntimeWarning of log(0)."""
    q, k, v, dout, kw = make_inputs(12, 2, 2, 2, 7, 9, 4, 3, mask_kind="float", mask_form="B1LqLk",
                                    causal=True)
    _, c0 = A.sdpa_forward(q, k, v, impl="reference", **kw)
    want = c0.lse  # [B, Hq, Lq]
    assert np.isneginf(want[:, :, 0]).all() and np.isfinite(want[:, :, 1:]).all()
    dq, dk, dv, dm, _, _ = chunk(q, k, v, kw.pop("mask"), None, dout, sizes, 2)
    _, c = A.sdpa_forward(dq, dk, dv, mask=dm, impl="chunked", block_q=2, block_k=3, **kw)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # no log(0) on the empty rows
        got = c.lse.compute(scheduler="sync")
    assert got.shape == want.shape and got.dtype == want.dtype
    np.testing.assert_array_equal(np.isneginf(got), np.isneginf(want))
    np.testing.assert_allclose(got[:, :, 1:], want[:, :, 1:], rtol=1e-12, atol=1e-12)



@pytest.mark.parametrize("sizes", UNEVEN_CHUNKINGS, ids=str)
def test_lse_of_rows_whose_largest_score_is_0(sizes):
    """A query row of zeros scores 0 against every key: its row maximum is m = 0 and its
    causal row i attends i + 1 keys, so lse = log(i + 1) (by hand), not the -inf of a row
    with nothing to attend (whose merged m is 0 as well). A float mask of 0 on row 0 keeps
    the scores of the other rows as they are."""
    q, k, v, dout, kw = make_inputs(15, 2, 2, 1, 7, 9, 4, 3, causal=True)
    q[1, 0] = 0.0  # [Lq, Dh]: batch entry 1, head 0 scores 0 everywhere
    dq, dk, dv, _, _, _ = chunk(q, k, v, None, None, dout, sizes, 1)
    _, c = A.sdpa_forward(dq, dk, dv, impl="chunked", block_q=2, block_k=3, **kw)
    got = c.lse.compute(scheduler="sync")  # [B, Hq, Lq]
    np.testing.assert_allclose(got[1, 0], np.log(np.arange(1, 8)), rtol=1e-14)
    assert np.isfinite(got).all()

@pytest.mark.parametrize("sizes", UNEVEN_CHUNKINGS, ids=str)
def test_rows_of_very_negative_scores_merge_across_key_chunks(sizes):
    """A float mask of -1000 everywhere (a shift the softmax ignores) with causal rows and a
    padded key: the rows' scores are near -1000 where they attend, and a key chunk where a row
    attends nothing must not set the row's maximum (its m = 0 would weigh the other chunks by
    exp(-1000) = 0 and leave the row empty). Out and every gradient equal the reference's."""
    q, k, v, dout, kw = make_inputs(13, 2, 2, 1, 7, 9, 4, 3, causal=True)
    rng = np.random.default_rng(13)
    mask = -1000.0 + 0.5 * rng.standard_normal((2, 1, 7, 9))  # [B, 1, Lq, Lk]
    mask[1, :, :, 3] = -np.inf  # a padded key
    out0, c0 = A.sdpa_forward(q, k, v, mask=mask, impl="reference", **kw)
    grads0 = A.sdpa_backward(dout, c0)
    dq, dk, dv, dm, _, ddout = chunk(q, k, v, mask, None, dout, sizes, 1)
    out, c = A.sdpa_forward(dq, dk, dv, mask=dm, impl="chunked", block_q=2, block_k=3, **kw)
    out, grads = dask.compute(out, A.sdpa_backward(ddout, c), scheduler="sync")
    assert_close(out, out0, host, f"{sizes}: out")
    for name, g, g0 in zip(("dq", "dk", "dv", "dmask"), grads, grads0):
        assert_close(g, g0, host, f"{sizes}: {name}")


@pytest.mark.parametrize("sizes", [(2, 2, 3, 2), (1, 1, 5, 3)], ids=str)
def test_rows_masked_by_the_most_negative_finite_number_merge_across_key_chunks(sizes):
    """A float mask of float64's most negative finite number (-1.8e308, as some callers mask
    with) is not -inf: a row attends the keys that get it, evenly (q k^T rounds away next to
    it). Row 1 gets it on every key; row 3 only on keys 4 and 5, -inf elsewhere, so some of
    its key chunks attend nothing and one attends only scores near -1.8e308: those empty
    chunks must not set the row's maximum. Rows 1 and 3 are the means of their values, lse
    is the number itself, and out and every gradient equal the reference's."""
    rng = np.random.default_rng(23)
    B, H, Lq, Lk, Dh, Dv = 2, 2, 5, 7, 3, 2
    q, k = rng.standard_normal((B, H, Lq, Dh)), rng.standard_normal((B, H, Lk, Dh))
    v, dout = rng.standard_normal((B, H, Lk, Dv)), rng.standard_normal((B, H, Lq, Dv))
    low = float(np.finfo(np.float64).min)
    mask = 0.5 * rng.standard_normal((Lq, Lk))  # [Lq, Lk]
    mask[1] = low
    mask[3] = -np.inf
    mask[3, [4, 5]] = low
    out0, c0 = A.sdpa_forward(q, k, v, mask=mask, impl="reference")
    grads0 = A.sdpa_backward(dout, c0)
    dq, dk, dv, dm, _, ddout = chunk(q, k, v, mask, None, dout, sizes, 1)
    out, c = A.sdpa_forward(dq, dk, dv, mask=dm, impl="chunked", block_q=2, block_k=3)
    out, lse, grads = dask.compute(out, c.lse, A.sdpa_backward(ddout, c), scheduler="sync")
    np.testing.assert_allclose(out[:, :, 1], np.broadcast_to(v.mean(axis=2), (B, H, Dv)), rtol=1e-12)
    np.testing.assert_allclose(out[:, :, 3], np.broadcast_to(v[:, :, 4:6].mean(axis=2), (B, H, Dv)),
                               rtol=1e-12)
    np.testing.assert_array_equal(lse[:, :, [1, 3]], np.full((B, H, 2), low))
    assert_close(out, out0, host, f"{sizes}: out")
    for name, g, g0 in zip(("dq", "dk", "dv", "dmask"), grads, grads0):
        assert_close(g, g0, host, f"{sizes}: {name}")


@pytest.mark.parametrize("form", sorted(MASK_FORMS))
def test_every_mask_form_on_key_chunks(form):
    """Masks of 1 to 4 axes (each broadcast to the scores) are padded to 4 axes and chunked like
    the scores: bool and float, with key chunks, grouped heads, causal rows and dropout from a
    seed. Out, the gradients (dmask of the mask's own shape) and the keep-mask equal the
    reference's."""
    for kind in ("bool", "float"):
        q, k, v, dout, kw = make_inputs(14, 2, 2, 2, 7, 9, 4, 3, mask_kind=kind, mask_form=form,
                                        causal=True, dropout="seed")
        out0, c0 = A.sdpa_forward(q, k, v, impl="reference", **kw)
        ref = (out0, A.sdpa_backward(dout, c0), A.dropout_keep_mask(c0))
        for sizes in ((1, 2, 3, 4), (2, 4, 4, 2)):
            got = run_both(q, k, v, dout, kw, sizes, 2, impl="chunked")[1]
            assert_same(ref, got, f"{form} {kind} {sizes}")



@pytest.mark.parametrize("form", ["full", "B11Lk"])
def test_uneven_chunks_that_start_with_a_length_1_chunk(form):
    """Chunks of unequal lengths, the first of length 1 on the heads, rows and keys: a pair
    sums its ``ds`` to the shape of the mask chunk it reads (the causal diagonal broadcasts a
    B11Lk chunk to the pair's rows), and that shape differs from chunk to chunk; a chunk of
    length 1 is not a broadcast axis. The batch chunks (2, 1) start the second at entry 2, not
    at chunk index 1 (the dropout's coordinates). Out, the gradients (dmask of the mask's
    shape) and the keep-mask equal the NumPy kernel's."""
    q, k, v, dout, kw = make_inputs(21, 3, 2, 1, 7, 6, 4, 3, mask_kind="float", mask_form=form,
                                    causal=True, dropout="seed")
    out0, c0 = A.sdpa_forward(q, k, v, impl="numpy", **kw)
    ref = (out0, A.sdpa_backward(dout, c0), A.dropout_keep_mask(c0))
    rows, keys = (1, 4, 2), (1, 3, 2)
    dq = da.from_array(q, chunks=((2, 1), (1, 1), rows, (4,)))  # [B, Hq, Lq, Dh]
    dk = da.from_array(k, chunks=((2, 1), (1, 1), keys, (4,)))  # [B, Hkv, Lk, Dh]
    dv = da.from_array(v, chunks=((2, 1), (1, 1), keys, (3,)))  # [B, Hkv, Lk, Dv]
    mask = kw.pop("mask")
    dm = da.from_array(mask, chunks=((2, 1), (1, 1), rows, keys) if form == "full"
                       else ((2, 1), (1,), (1,), keys))
    out, c = A.sdpa_forward(dq, dk, dv, mask=dm, impl="chunked", **kw)
    grads = A.sdpa_backward(da.from_array(dout, chunks=((2, 1), (1, 1), rows, (3,))), c)
    got = dask.compute(out, grads, A.dropout_keep_mask(c), scheduler="sync")
    assert_same(ref, got, form)


def test_large_scores_stay_exact_across_key_chunks():
    """Scores of 1e17 (float64) on two equal keys in two key chunks: p = [0.5, 0.5].
    A merged log-sum-exp m + log(l) would round log(2) away against 1e17."""
    q = np.full((1, 1, 1, 1), 1e9)
    k = np.full((1, 1, 2, 1), 1e8)
    v = np.array([[[[1.0], [3.0]]]])
    dout = np.ones((1, 1, 1, 1))
    dq, dk, dv, _, _, ddout = chunk(q, k, v, None, None, dout, (1, 1, 1, 1), 1)
    out, c = A.sdpa_forward(dq, dk, dv, scale=1.0)
    grads = A.sdpa_backward(ddout, c)
    out, (_, _, gv, _, _) = dask.compute(out, grads, scheduler="sync")
    assert out[0, 0, 0, 0] == 2.0
    np.testing.assert_array_equal(gv[0, 0, :, 0], [0.5, 0.5])


def test_calls_that_differ_only_in_is_causal_or_scale_computed_together():
    """Three calls on the same dask arrays that differ only in ``is_causal`` or only in an
    explicit ``scale``, forward and backward computed in one ``dask.compute``: each gives the
    NumPy reference's numbers of its own options (their tasks must not share names), and an
    explicit scale reaches the backward's pairs (the other tests use the default 1/sqrt(Dh))."""
    q, k, v, dout, kw = make_inputs(15, 2, 2, 2, 7, 9, 4, 3)
    dq, dk, dv, _, _, ddout = chunk(q, k, v, None, None, dout, (1, 2, 3, 4), 2)
    options = [dict(is_causal=False, scale=None), dict(is_causal=True, scale=None),
               dict(is_causal=True, scale=0.3)]
    lazy = []
    for opt in options:
        out, c = A.sdpa_forward(dq, dk, dv, impl="chunked", **dict(kw, **opt))
        lazy.append((out, A.sdpa_backward(ddout, c)[:3]))
    got = dask.compute(lazy, scheduler="sync")[0]
    for opt, (out, grads) in zip(options, got):
        out0, c0 = A.sdpa_forward(q, k, v, impl="reference", **dict(kw, **opt))
        assert_close(out, out0, host, f"{opt}: out")
        for name, g, g0 in zip(("dq", "dk", "dv"), grads, A.sdpa_backward(dout, c0)):
            assert_close(g, g0, host, f"{opt}: {name}")



def test_calls_that_differ_only_in_a_mask_or_a_keep_mask_computed_together():
    """Forward calls on the same dask arrays that differ only in their mask (bool or float)
    or only in the caller's keep-mask, forward and backward computed in one ``dask.compute``:
    each gives the NumPy kernel's numbers and keep-mask of its own arguments (the names of
    their tasks must tell them apart)."""
    q, k, v, dout, kw = make_inputs(17, 2, 2, 1, 7, 9, 4, 3, causal=True)
    rng = np.random.default_rng(17)
    shape = (2, 2, 7, 9)  # [B, Hq, Lq, Lk]
    calls = [dict(mask=rng.random(shape) > 0.3), dict(mask=rng.random(shape) > 0.3),
             dict(mask=rng.standard_normal(shape)), dict(mask=rng.standard_normal(shape)),
             dict(dropout_p=0.3, dropout_mask=rng.random(shape) > 0.3),
             dict(dropout_p=0.3, dropout_mask=rng.random(shape) > 0.3)]
    dq, dk, dv, _, _, ddout = chunk(q, k, v, None, None, dout, (1, 2, 3, 4), 1)
    lazy = []
    for call in calls:
        dcall = {n: da.from_array(a, chunks=(1, 2, 3, 4)) if isinstance(a, np.ndarray) else a
                 for n, a in call.items()}
        out, c = A.sdpa_forward(dq, dk, dv, impl="chunked", **dict(kw, **dcall))
        lazy.append((out, A.sdpa_backward(ddout, c), A.dropout_keep_mask(c)))
    got = dask.compute(lazy, scheduler="sync")[0]
    for n, (call, (out, grads, keep)) in enumerate(zip(calls, got)):
        out0, c0 = A.sdpa_forward(q, k, v, impl="numpy", **dict(kw, **call))
        assert_same((out0, A.sdpa_backward(dout, c0), A.dropout_keep_mask(c0)), (out, grads, keep),
                    f"call {n}")

def test_calls_that_differ_only_in_dropout_dout_or_dlse_computed_together():
    """Forward calls on the same dask arrays that differ only in the drop probability or only
    in the seed, and backward calls of one forward that differ only in dout or in dlse
    (chunked unlike the rows), all computed in one ``dask.compute``: each gives the NumPy
    reference's numbers and keep-mask of its own arguments."""
    q, k, v, dout, kw = make_inputs(16, 2, 2, 2, 7, 9, 4, 3, causal=True)
    rng = np.random.default_rng(16)
    dout2, dlse = rng.standard_normal(dout.shape), rng.standard_normal(dout.shape[:3])
    dq, dk, dv, _, _, ddout = chunk(q, k, v, None, None, dout, (1, 2, 3, 4), 2)
    ddout2 = da.from_array(dout2, chunks=(1, 2, 3, 3))
    ddlse = da.from_array(dlse, chunks=(2, 1, 4))
    # (forward options, [(dout, dlse) of each backward call])
    calls = [(dict(dropout_p=0.2, rng=1), [(dout, ddout, None, None), (dout2, ddout2, None, None),
                                           (dout, ddout, dlse, ddlse)]),
             (dict(dropout_p=0.4, rng=1), [(dout, ddout, None, None)]),
             (dict(dropout_p=0.2, rng=2), [(dout, ddout, None, None)])]
    lazy, want = [], []
    for opt, backwards in calls:
        out, c = A.sdpa_forward(dq, dk, dv, impl="chunked", **dict(kw, **opt))
        out0, c0 = A.sdpa_forward(q, k, v, impl="reference", **dict(kw, **opt))
        lazy.append((out, A.dropout_keep_mask(c)))
        want.append((out0, A.dropout_keep_mask(c0)))
        for g, dg, l, dl in backwards:
            lazy.append(A.sdpa_backward(dg, c, dlse=dl)[:3])
            want.append(A.sdpa_backward(g, c0, dlse=l)[:3])
    got = dask.compute(lazy, scheduler="sync")[0]
    for n, (a, b) in enumerate(zip(got, want)):
        if len(a) == 2:  # out and keep-mask
            assert_close(a[0], b[0], host, f"call {n}: out")
            assert np.array_equal(a[1], b[1]), f"call {n}: keep-mask differs"
        else:
            for name, g, g0 in zip(("dq", "dk", "dv"), a, b):
                assert_close(g, g0, host, f"call {n}: {name}")


def test_without_key_chunks_each_pair_passes_on_bit_for_bit():
    """Without key chunking step 2 has one pair per row and passes it on as it is, and each
    task runs the blocked steps with the block lengths asked for: on dask arrays chunked along
    the batch and the heads only, out and every gradient (dmask too) of impl="chunked" are bit
    for bit those of impl="blocked" on the NumPy arrays with the same block_q and block_k,
    under a float mask and dropout from a seed. The blocked path's numbers do not depend on
    how the leading axes are split, while its key blocks set how each row's sums are rounded."""
    q, k, v, dout, kw = make_inputs(19, 2, 2, 1, 7, 9, 4, 3, mask_kind="float", mask_form="B1LqLk",
                                    dropout="seed")
    blocks = dict(block_q=2, block_k=3)
    out0, c0 = A.sdpa_forward(q, k, v, impl="blocked", **blocks, **kw)
    grads0 = A.sdpa_backward(dout, c0)
    other = A.sdpa_forward(q, k, v, impl="blocked", block_q=2, block_k=2, **kw)[0]
    assert not np.array_equal(other, out0)  # the key blocks do change the bits
    dq, dk, dv, dm, _, ddout = chunk(q, k, v, kw.pop("mask"), None, dout, (1, 1, 7, 9), 1)
    out, c = A.sdpa_forward(dq, dk, dv, mask=dm, impl="chunked", **blocks, **kw)
    out, grads = dask.compute(out, A.sdpa_backward(ddout, c), scheduler="sync")
    np.testing.assert_array_equal(out, out0, err_msg="out")
    for name, g, g0 in zip(("dq", "dk", "dv", "dmask"), grads, grads0):
        np.testing.assert_array_equal(g, g0, err_msg=name)


def test_calls_that_differ_only_in_block_lengths_computed_together():
    """Two chunked calls on the same dask arrays that differ only in the block lengths the
    tasks run with (which set how each row's sums are rounded), forward and backward computed
    in one ``dask.compute``: each gives bit for bit what it gives computed alone (their tasks
    must not share names)."""
    q, k, v, dout, kw = make_inputs(18, 2, 2, 1, 7, 9, 4, 3, causal=True)
    dq, dk, dv, _, _, ddout = chunk(q, k, v, None, None, dout, (1, 2, 3, 4), 1)
    blocks = [dict(block_q=2, block_k=3), dict(block_q=3, block_k=1)]

    def call(b):
        out, c = A.sdpa_forward(dq, dk, dv, impl="chunked", **b, **kw)
        return out, A.sdpa_backward(ddout, c)[:3]

    alone = [dask.compute(call(b), scheduler="sync")[0] for b in blocks]
    assert not np.array_equal(alone[0][0], alone[1][0])  # the block lengths change the bits
    together = dask.compute([call(b) for b in blocks], scheduler="sync")[0]
    for b, (out, grads), (out1, grads1) in zip(blocks, together, alone):
        np.testing.assert_array_equal(out, out1, err_msg=f"{b}: out")
        for name, g, g1 in zip(("dq", "dk", "dv"), grads, grads1):
            np.testing.assert_array_equal(g, g1, err_msg=f"{b}: {name}")


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_low_precision_dtypes(dtype):
    """float32 stays float32 (also inside: its lse is float32, as the kernel's); float16 is
    computed in float32 and cast back, like the kernel.
    Every chunk of the gradients has that dtype, also the zeros of key chunk 8, which no query
    row reaches (causal, Lq = 7): dask's concatenate takes the dtype of one of the chunks."""
    q, k, v, dout, kw = make_inputs(5, 2, 2, 1, 7, 9, 4, 3, mask_kind="float", mask_form="LqLk",
                                    causal=True, dtype=dtype)
    (out0, grads0, _), (out, grads, _) = run_both(q, k, v, dout, kw, CHUNKINGS["everything"], 1)
    dq, dk, dv, dm, _, ddout = chunk(q, k, v, kw["mask"], None, dout, CHUNKINGS["everything"], 1)
    _, c = A.sdpa_forward(dq, dk, dv, **dict(kw, mask=dm))
    lse = c.lse.compute(scheduler="sync")  # [B, Hq, Lq]
    assert lse.dtype == np.float32  # float32 is computed in float32, not in float64
    lazy = A.sdpa_backward(ddout, c)
    for name, g in zip(("dq", "dk", "dv", "dmask"), lazy):
        blocks = dask.compute(*g.to_delayed().ravel(), scheduler="sync")
        assert {b.dtype for b in blocks} == {np.dtype(dtype)}, name
    tol = 1e-5 if dtype == np.float32 else 2e-3
    for a, b in zip((out, *grads), (out0, *grads0)):
        if b is None:
            continue
        assert a.dtype == b.dtype == dtype
        scale = max(float(np.max(np.abs(b.astype(np.float64)))), 1.0)
        np.testing.assert_allclose(a.astype(np.float64), b.astype(np.float64), atol=tol * scale)


@pytest.mark.parametrize("impl", ["reference", "blocked", "chunked"])
def test_float16_on_dask_is_computed_in_float32(impl):
    """Every implementation on dask float16 computes its scores and softmax in float32, as on
    NumPy: the same numbers as NumPy's float16 call to float32 rounding, and an lse in float32.
    (dask's namespace has no float16 attribute; the check compared with one.)"""
    rng = np.random.default_rng(3)
    q, k, v, dout = (rng.standard_normal(s).astype(np.float16) * 3
                     for s in ((1, 2, 64, 16), (1, 2, 48, 16), (1, 2, 48, 16), (1, 2, 64, 16)))
    out0, c0 = A.sdpa_forward(q, k, v, impl="reference")  # NumPy: float32 inside
    grads0 = A.sdpa_backward(dout, c0)
    chunks = (1, 1, 32, 16)
    out, c = A.sdpa_forward(*(da.from_array(t, chunks=chunks) for t in (q, k, v)), impl=impl)
    grads = A.sdpa_backward(da.from_array(dout, chunks=chunks), c)
    out, dq, dk, dv, lse = dask.compute(out, grads.dq, grads.dk, grads.dv, c.lse, scheduler="sync")
    assert lse.dtype == np.float32
    for got, want in zip((out, dq, dk, dv), (out0, grads0.dq, grads0.dk, grads0.dv)):
        assert got.dtype == np.float16
        err = np.max(np.abs(got.astype(np.float64) - want.astype(np.float64)))
        # float16 compute is off by ~2e-2 here; float32 compute by float16's last bits
        assert err <= 4e-3 * max(float(np.max(np.abs(want.astype(np.float64)))), 1.0)


@pytest.mark.parametrize("chunks", [(1, 4, 6, 4), (2, 2, 3, 4), (1, 1, 2, 4)],
                         ids=["batch", "heads-rows", "all"])
@pytest.mark.parametrize("impl", ["reference", "auto-weights"])
def test_grouped_heads_on_the_reference_path_with_chunked_q(chunks, impl):
    """GQA on the reference path reshapes query heads into their K/V heads' rows; dask
    reshapes a chunked array only one split or merge at a time (it refused before)."""
    rng = np.random.default_rng(5)
    q, dout = rng.standard_normal((2, 4, 6, 4)), rng.standard_normal((2, 4, 6, 3))
    k, v = rng.standard_normal((2, 2, 7, 4)), rng.standard_normal((2, 2, 7, 3))
    kw = dict(enable_gqa=True, is_causal=True)
    if impl == "reference":
        kw["impl"] = "reference"
    else:  # "auto" takes the reference for the weights
        kw["need_weights"] = True
    out0, c0 = A.sdpa_forward(q, k, v, **kw)
    g0 = A.sdpa_backward(dout, c0)
    kv_chunks = (chunks[0], max(1, chunks[1] // 2), 7, 4)
    out, c = A.sdpa_forward(da.from_array(q, chunks=chunks), da.from_array(k, chunks=kv_chunks),
                            da.from_array(v, chunks=kv_chunks[:3] + (3,)), **kw)
    g = A.sdpa_backward(da.from_array(dout, chunks=chunks[:3] + (3,)), c)
    got = dask.compute(out, g.dq, g.dk, g.dv, scheduler="sync")
    for a, b in zip(got, (out0, g0.dq, g0.dk, g0.dv)):
        np.testing.assert_allclose(a, b, rtol=1e-12, atol=1e-13)


@pytest.mark.parametrize("impl", ["reference", "blocked", "chunked"])
def test_dlse_on_rows_with_nothing_to_attend_does_not_matter_on_dask(impl):
    """An empty row's lse is -inf whatever its scores: +inf or NaN as its dlse gives the
    gradients of 0 there (flash-attn's lse holds +inf on such rows), on every dask path."""
    rng = np.random.default_rng(7)
    q, k, v, dout = (rng.standard_normal(s) for s in ((2, 2, 6, 4), (2, 2, 7, 4), (2, 2, 7, 3),
                                                      (2, 2, 6, 3)))
    mask = rng.random((2, 1, 6, 7)) > 0.3
    mask[0, :, 1] = False  # an empty row
    empty = np.zeros((2, 2, 6), bool)
    empty[0, :, 1] = True
    dlse = np.where(empty, 0.0, rng.standard_normal((2, 2, 6)))
    g0 = A.sdpa_backward(dout, A.sdpa_forward(q, k, v, mask=mask, impl="reference")[1], dlse=dlse)
    chunks = (1, 2, 3, 4)
    out, c = A.sdpa_forward(*(da.from_array(t, chunks=chunks) for t in (q, k, v)),
                            mask=da.from_array(mask, chunks=(1, 1, 3, 7)), impl=impl)
    for bad in (np.inf, np.nan):
        g = A.sdpa_backward(da.from_array(dout, chunks=chunks), c,
                            dlse=da.from_array(np.where(empty, bad, dlse), chunks=(1, 2, 3)))
        for got, want in zip(dask.compute(g.dq, g.dk, g.dv, scheduler="sync"), g0[:3]):
            assert np.isfinite(got).all()
            np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-13)



@pytest.mark.parametrize("lead", [(0, 2), (2, 0)])
@pytest.mark.parametrize("impl", ["reference", "blocked", "auto"])
def test_an_empty_batch_or_head_axis_on_dask_is_empty_results(impl, lead):
    """q, k, v with no batch entries (or no heads) give empty outputs, lse and gradients of
    their inputs' shapes on dask, as on NumPy: dask's max of a zero-size array fails at
    compute, even over the non-empty key axis."""
    rng = np.random.default_rng(8)
    shapes = [lead + s for s in ((3, 4), (5, 4), (5, 2))]
    q, k, v = (rng.standard_normal(s) for s in shapes)
    mask = rng.random(lead[:1] + (1, 3, 5)) > 0.3
    want_out, want_c = A.sdpa_forward(q, k, v, mask=mask, dropout_p=0.2, rng=3, impl="reference")
    out, c = A.sdpa_forward(*(da.from_array(t) for t in (q, k, v)), mask=da.from_array(mask),
                            dropout_p=0.2, rng=3, impl=impl)
    dout = np.zeros(lead + (3, 2))
    g = A.sdpa_backward(da.from_array(dout), c)
    got = dask.compute(out, c.lse, g.dq, g.dk, g.dv, scheduler="sync")
    want = (want_out, want_c.lse) + tuple(A.sdpa_backward(dout, want_c)[:3])
    for a, b in zip(got, want):
        assert a.shape == b.shape and a.shape[:2] == lead and a.dtype == b.dtype

def test_grouped_query_module_with_weights_on_batch_chunks():
    """docs/dask.md's usage (batch chunks) with n_kv_head between 1 and n_head and weights."""
    x = np.random.default_rng(6).standard_normal((2, 6, 8))
    ref = MultiHeadAttention(8, 4, n_kv_head=2, dtype="float64", seed=0)
    m = MultiHeadAttention(8, 4, n_kv_head=2, dtype="float64", seed=0, backend="dask")
    out0, w0 = ref(x, x, x, need_weights=True)
    xd = da.from_array(x, chunks=(1, 6, 8))
    out, w = m(xd, xd, xd, need_weights=True)
    out, w = dask.compute(out, w, scheduler="sync")
    np.testing.assert_allclose(out, out0, rtol=1e-12, atol=1e-13)
    np.testing.assert_allclose(w, w0, rtol=1e-12, atol=1e-13)


def test_layer_norm_of_float16_on_dask_is_computed_in_float32():
    from npattn import layers
    x = (np.random.default_rng(4).standard_normal((2, 4, 64)) * 50 + 300).astype(np.float16)
    y0, _ = layers.layer_norm_forward(x)
    y, _ = layers.layer_norm_forward(da.from_array(x, chunks=(1, 4, 64)))
    y = y.compute(scheduler="sync")
    assert y.dtype == np.float16
    np.testing.assert_array_equal(y, y0)  # a float16 mean of values near 300 overflows its sum


# --------------------------------------------------------------------------
# finite differences through the dask graph (chunked, and the reference and blocked paths)


# impl: (chunk lengths, block sizes, random directions). The reference and blocked paths build
# a graph of many small operations per call: rows and keys split (short last chunks) and
# 3 directions keep each check near a second
GRADCHECK_RUNS = {"chunked": ((1, 2, 2, 4), {}, 6),
                  "reference": ((2, 4, 3, 4), {}, 3),
                  "blocked": ((2, 4, 3, 4), dict(block_q=3, block_k=4), 3)}


@pytest.mark.parametrize("impl, dropout", [("chunked", "mask"), ("chunked", "seed"),
                                           ("reference", "mask"), ("blocked", "mask")])
def test_gradcheck_chunked(impl, dropout):
    """GQA, Dv != Dh, float mask with -inf and an empty row, causal, dropout, Lq != Lk,
    every axis split into chunks; random upstream gradient and random directions (each
    evaluation builds and runs a graph: the "full" mode would take a minute). The reference
    and blocked paths run on the same chunked arrays."""
    q, k, v, _, kw = make_inputs(9, 2, 2, 2, 5, 6, 3, 2, mask_kind="float", mask_form="B1LqLk",
                                 dropout=dropout, causal=True)
    mask = kw.pop("mask")
    keep = kw.pop("dropout_mask", None)
    sizes, blocks, n_directions = GRADCHECK_RUNS[impl]

    def forward(q, k, v, mask):
        dq, dk, dv, dm, dkeep, _ = chunk(host(q), host(k), host(v), host(mask), keep, None, sizes, 2)
        out, c = A.sdpa_forward(dq, dk, dv, mask=dm, dropout_mask=dkeep, impl=impl, **blocks,
                                **kw)
        assert isinstance(c, DASK_CACHES[impl])
        return out, c

    report = gradcheck(forward, A.sdpa_backward, [da.from_array(a) for a in (q, k, v, mask)],
                       names=["q", "k", "v", "mask"], mode="vjp", n_directions=n_directions,
                       rtol=1e-6, seed=3)
    assert report.ok, str(report)
    assert all(r.scale > 0 for r in report.inputs)  # nothing vanished


def test_gradcheck_chunked_kernel_options():
    """Every kernel option at once on the chunked path: a window, bottom-right causal with
    Lq > Lk (whole query chunks that see no key), softcap, ALiBi (B, H), segments, sinks,
    GQA, Dv != Dh, a float mask with -inf and a keep-mask; q, k, v, the mask and the sinks
    against central differences in float64 along random directions, random upstream gradient."""
    q, k, v, _, _, kw = make_option_case("all", 6, 4, seed=5)
    mask, sinks, keep = kw.pop("mask"), kw.pop("sinks"), kw.pop("dropout_mask")
    options = to_dask_options(kw)

    def forward(q, k, v, mask, sinks):
        dq, dk, dv, dm, dkeep, _ = chunk(host(q), host(k), host(v), host(mask), keep, None,
                                         (1, 2, 2, 3), 2)
        out, c = A.sdpa_forward(dq, dk, dv, mask=dm, dropout_mask=dkeep, sinks=da.from_array(host(sinks)),
                                **options)
        assert isinstance(c, chunked.ChunkedSDPACache)
        return out, c

    report = gradcheck(forward, A.sdpa_backward, [da.from_array(a) for a in (q, k, v, mask, sinks)],
                       names=["q", "k", "v", "mask", "sinks"], mode="vjp", n_directions=3,
                       rtol=1e-6, seed=4)
    assert report.ok, str(report)
    assert all(r.scale > 0 for r in report.inputs)  # nothing vanished


# --------------------------------------------------------------------------
# the graph: one task per pair of chunks


def graph_of(*arrays):
    """The tasks of the dask arrays ``arrays``, merged."""
    graph = {}
    for a in arrays:
        graph.update(dict(a.__dask_graph__()))
    return graph


def test_graph_grows_with_chunks_not_with_array_operations():
    q, k, v, dout, kw = make_inputs(1, 4, 2, 1, 8, 8, 4, 4, mask_kind="bool", mask_form="B11Lk",
                                    dropout="seed")
    sizes_tasks = []
    for sizes in [(4, 2, 8, 8), (2, 2, 4, 8), (1, 1, 4, 4), (1, 1, 2, 2)]:
        dq, dk, dv, dm, _, ddout = chunk(q, k, v, kw["mask"], None, dout, sizes, 1)
        out, c = A.sdpa_forward(dq, dk, dv, mask=dm, dropout_p=kw["dropout_p"], rng=kw["rng"])
        grads = A.sdpa_backward(ddout, c)
        graph = graph_of(out, *grads[:3])
        inputs = graph_of(dq, dk, dv, dm, ddout)
        ours = [key for key in graph if key not in inputs]
        npairs = math.prod(math.ceil(n / s) for n, s in zip((4, 2, 8, 8), sizes))
        pair_tasks = [key for key in ours if key[0].startswith("npattn-pair-")]
        assert len(pair_tasks) == 2 * npairs  # one forward and one backward task per pair
        assert len(ours) <= 10 * npairs + 20  # rechunks, merges, sums: a few per chunk
        sizes_tasks.append(len(ours))
    assert sizes_tasks == sorted(sizes_tasks)


def test_dropout_draws_no_full_size_mask():
    """The generated keep-mask is drawn inside each pair's task: the graph holds no
    array of the scores' shape, and the mask the cache reports is built lazily."""
    q, k, v, dout, kw = make_inputs(2, 2, 2, 1, 6, 6, 4, 4, dropout="seed")
    dq, dk, dv, *_ = chunk(q, k, v, None, None, dout, (1, 1, 3, 3), 1)
    out, c = A.sdpa_forward(dq, dk, dv, dropout_p=kw["dropout_p"], rng=kw["rng"])
    assert c.keep is None and c.dropout_key is not None
    for task in dict(out.__dask_graph__()).values():
        arrays = [a for a in getattr(task, "args", ()) if isinstance(a, np.ndarray)]
        assert all(a.size < 2 * 2 * 6 * 6 for a in arrays)
    keep = A.dropout_keep_mask(c)
    assert isinstance(keep, da.Array) and keep.shape == (2, 2, 6, 6)


def test_a_pairs_dropout_mask_costs_its_bytes_not_its_hashes():
    """A task's part of a drawn mask is one byte per entry: the 32-bit hashes behind it are
    taken a slab of rows at a time (they made a task's peak 8x the mask, twice the pair's
    float32 scores). One pair of 2048 x 2048, one head: the mask is 4 MiB."""
    import tracemalloc

    rng = np.random.default_rng(0)
    q, k, v = (da.from_array(rng.standard_normal((1, 1, 2048, 8)).astype(np.float32),
                             chunks=(1, 1, 2048, 8)) for _ in range(3))
    out, _ = A.sdpa_forward(q, k, v, dropout_p=0.2, rng=1)
    tracemalloc.start()
    try:
        got = out.compute(scheduler="sync")
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert np.isfinite(got).all()
    mask_bytes = 2048 * 2048
    assert peak < 2.5 * mask_bytes, peak / mask_bytes  # the mask, one block's scores, small arrays


def test_blocked_with_segments_on_dask_stays_lazy():
    """Skipping blocks whose segments never meet asked the lazy segment ids, one compute per
    block pair inside the call: on dask no block is skipped, and nothing is computed."""
    rng = np.random.default_rng(1)
    arrays = [rng.standard_normal((1, 2, 8, 4)) for _ in range(3)]
    dout = rng.standard_normal((1, 2, 8, 4))  # random, never all ones
    seg = np.array([[0, 0, 0, 0, 1, 1, 1, 1]])
    q, k, v = (da.from_array(a, chunks=(1, 1, 4, 4)) for a in arrays)
    computes = []

    def counting(dsk, keys, **kw):
        computes.append(1)
        return dask.get(dsk, keys, **kw)

    with dask.config.set(scheduler=counting):
        dseg = da.from_array(seg, chunks=(1, 4))
        out, c = A.sdpa_forward(q, k, v, q_segments=dseg, k_segments=dseg, impl="blocked",
                                block_q=2, block_k=2)
        grads = A.sdpa_backward(da.from_array(dout, chunks=(1, 1, 4, 4)), c)
        assert computes == []
    want, c0 = A.sdpa_forward(*arrays, q_segments=seg, k_segments=seg, impl="reference")
    want_grads = A.sdpa_backward(dout, c0)
    got, gq, gk, gv = dask.compute(out, grads.dq, grads.dk, grads.dv, scheduler="sync")
    for a, b in ((got, want), (gq, want_grads.dq), (gk, want_grads.dk), (gv, want_grads.dv)):
        np.testing.assert_allclose(a, b, rtol=1e-12, atol=1e-12)


# --------------------------------------------------------------------------
# choosing the implementation, bad input


def test_backend_name_and_impl_choice():
    xp = resolve_backend("dask")
    assert backend_name(xp) == "dask"
    q, k, v, dout, kw = make_inputs(1, 2, 2, 1, 4, 5, 3, 3)
    dq, dk, dv, *_ = chunk(q, k, v, None, None, dout, (1, 1, 2, 2), 1)
    assert A.select_impl("auto", dq, dk, dv) == "chunked"
    assert A.select_impl("auto", dq, dk, dv, need_weights=True) == "reference"
    assert A.select_impl("dense", dq, dk, dv) == "reference"
    assert A.select_impl("blocked", dq, dk, dv) == "blocked"
    # a call the chunked path does not take stays on the reference however large (the blocked
    # loops would build a graph of their blocks), as a NumPy call of that size would not
    big = da.zeros((1, 1, 8192, 8), chunks=(1, 1, 1024, 8))  # 2**26 scores a head, lazily
    assert A.select_impl("auto", big, big, big) == "chunked"
    assert A.select_impl("auto", big, big, big, same_lead=False) == "reference"
    assert A.select_impl("auto", *[np.broadcast_to(0.0, big.shape)] * 3, plain=False) == "blocked"
    # kernel options (plain=False) run on the chunked path, as sdpa_forward takes them there
    assert A.select_impl("auto", big, big, big, plain=False) == "chunked"
    assert A.select_impl("chunked", big, big, big, plain=False) == "chunked"
    assert isinstance(A.sdpa_forward(big, big, big, softcap=2.0)[1], chunked.ChunkedSDPACache)
    with pytest.raises(ValueError, match=r"impl='chunked': the chunked implementation takes dask arrays.*numpy"):
        A.sdpa_forward(q, k, v, impl="chunked")
    with pytest.raises(ValueError, match=r"impl='chunked' cannot return attention weights"):
        A.sdpa_forward(dq, dk, dv, impl="chunked", need_weights=True)
    # the chunked path forms no weights: asking its cache for them is refused by name
    _, c = A.sdpa_forward(dq, dk, dv)
    assert isinstance(c, chunked.ChunkedSDPACache)
    no_weights = (r"^cache: expected the cache of a dense implementation .*, got ChunkedSDPACache: "
                  r"the chunked implementation keeps no attention weights$")
    with pytest.raises(ValueError, match=no_weights):
        A.weights(c)
    # weights on dask arrays come from the reference, lazily
    out, c = A.sdpa_forward(dq, dk, dv, need_weights=True)
    w = A.weights(c)
    assert isinstance(w, da.Array)
    np.testing.assert_allclose(w.compute(), A.weights(A.sdpa_forward(q, k, v, impl="numpy")[1]),
                               atol=1e-15)


def test_bottom_right_causal_on_dask_runs_chunked_on_the_bottom_right_diagonal():
    """is_causal with align="bottom_right" and Lq != Lk on dask arrays: "auto" takes the chunked
    path, which gives query i the keys j <= i + Lk - Lq (softmax written out below), as
    impl="chunked" does; the gradients are those of NumPy's reference."""
    r = np.random.default_rng(21)
    q, k, v = r.standard_normal((1, 2, 3, 4)), r.standard_normal((1, 2, 5, 4)), r.standard_normal((1, 2, 5, 2))
    dout = r.standard_normal((1, 2, 3, 2))
    i, j = np.arange(3)[:, None], np.arange(5)[None, :]
    s = np.where(j <= i + 5 - 3, q @ np.swapaxes(k, -1, -2) / 2.0, -np.inf)  # [1, 2, 3, 5], 1/sqrt(4)
    p = np.exp(s - s.max(axis=-1, keepdims=True))
    want = (p / p.sum(axis=-1, keepdims=True)) @ v
    grads0 = A.sdpa_backward(dout, A.sdpa_forward(q, k, v, is_causal=True, align="bottom_right",
                                                  impl="reference")[1])
    dq, dk, dv, ddout = (da.from_array(a, chunks=(1, 1, 2, 4)) for a in (q, k, v, dout))
    for impl in ("auto", "chunked"):
        out, c = A.sdpa_forward(dq, dk, dv, is_causal=True, align="bottom_right", impl=impl)
        assert isinstance(c, chunked.ChunkedSDPACache), impl
        out, grads = dask.compute(out, A.sdpa_backward(ddout, c), scheduler="sync")
        np.testing.assert_allclose(out, want, rtol=1e-12, atol=1e-12)
        for name, g, g0 in zip(("dq", "dk", "dv"), grads, grads0):
            np.testing.assert_allclose(g, g0, rtol=1e-12, atol=1e-12, err_msg=f"{impl} {name}")


def test_chunked_refuses_leading_axes_that_broadcast_by_name():
    """impl="chunked" takes every kernel option; what it refuses is leading axes that
    broadcast: k and v of one head for q's many without enable_gqa (its layout has the K/V
    heads dividing q's only under GQA), or of one batch entry for q's many (the message
    named only the heads, also for a call whose heads were GQA's), and the message says so
    whole."""
    q = da.zeros((1, 2, 4, 2), chunks=(1, 1, 2, 2))
    with pytest.raises(ValueError) as info:
        A.sdpa_forward(q, q[:, :1], q[:, :1], window=(1, 0), impl="chunked")
    assert str(info.value) == (
        "impl='chunked': leading axes of q, k and v that broadcast (k and v of one batch entry "
        "for q's many, or of one head for many query heads without enable_gqa) run on "
        "impl='reference' or 'blocked'")
    # k and v of one batch entry against q's two, with GQA: the same refusal, by the batch
    q2 = da.zeros((2, 2, 4, 2), chunks=(1, 1, 2, 2))
    with pytest.raises(ValueError, match=r"^impl='chunked': .*\(k and v of one batch entry for q's many"):
        A.sdpa_forward(q2, q2[:1, :1], q2[:1, :1], enable_gqa=True, impl="chunked")


def test_the_numpy_kernel_on_dask_arrays_points_to_the_chunked_path():
    """impl="numpy" on dask arrays that the chunked path takes names it first among the
    implementations to use (it named only 'reference' and 'blocked'); NumPy arrays the
    kernel does not take (3 axes) are pointed to those two alone."""
    q = da.zeros((1, 2, 4, 2), chunks=(1, 1, 2, 2))
    with pytest.raises(ValueError) as info:
        A.sdpa_forward(q, q, q, impl="numpy")
    assert str(info.value) == (
        "impl='numpy': the NumPy kernel takes NumPy arrays q (B, Hq, Lq, Dh), k (B, Hkv, Lk, Dh), "
        "v (B, Hkv, Lk, Dv) with Hkv >= 1 dividing Hq, and masks broadcastable to (B, Hq, Lq, Lk); "
        "got dask.array.core.Array of shapes (1, 2, 4, 2), (1, 2, 4, 2), (1, 2, 4, 2); "
        "use impl='chunked', 'reference' or 'blocked'")
    x = np.zeros((2, 4, 2))
    with pytest.raises(ValueError, match=r"\(2, 4, 2\); use impl='reference' or 'blocked'$"):
        A.sdpa_forward(x, x, x, impl="numpy")


def test_a_nan_hidden_by_is_causal_or_a_window_on_dask():
    """docs/conventions.md: the chunked path skips the chunk pairs that is_causal or a window
    leaves out, so a NaN in a value that no row of a query chunk may see stays out of those
    rows; the reference reads every key, so there the NaN reaches every row (0 * NaN is NaN)."""
    rng = np.random.default_rng(23)
    q, k, v = (rng.standard_normal((1, 1, 8, 2)) for _ in range(3))
    v[0, 0, 7] = np.nan  # the last key: causal hides it from rows 0-6, the window (2, 0) from rows 0-4
    dq, dk, dv = (da.from_array(a, chunks=(1, 1, 4, 2)) for a in (q, k, v))
    for kw in (dict(is_causal=True), dict(window=(2, 0))):
        out, c = A.sdpa_forward(dq, dk, dv, **kw)
        assert isinstance(c, chunked.ChunkedSDPACache)
        # rows 0-3 meet only the first key chunk (keys 0-3); rows 4-7 meet the chunk holding key 7
        assert np.isnan(out.compute()[0, 0, :, 0]).tolist() == [False] * 4 + [True] * 4, kw
        out, c = A.sdpa_forward(dq, dk, dv, impl="reference", **kw)
        assert np.isnan(out.compute()).all(), kw


def test_keys_and_values_broadcast_over_the_heads_on_dask():
    """k and v of one head, (B, 1, Lk, D), broadcast to q's heads without GQA, as on NumPy
    (test_attention): the chunked path's layout is (B, Hkv, ...) with Hkv dividing Hq only
    under GQA, so "auto" takes the reference (softmax written out below) and impl="chunked"
    is refused by name; the gradients are those of NumPy's reference."""
    q, k, v, want, dout = one_kv_head_case(22)
    grads0 = A.sdpa_backward(dout, A.sdpa_forward(q, k, v, impl="reference")[1])
    dq, dk, dv, ddout = (da.from_array(a, chunks=(1, 2, 3, a.shape[-1])) for a in (q, k, v, dout))
    out, c = A.sdpa_forward(dq, dk, dv)
    assert not isinstance(c, chunked.ChunkedSDPACache)
    out, grads = dask.compute(out, A.sdpa_backward(ddout, c), scheduler="sync")
    np.testing.assert_allclose(out, want, rtol=1e-12, atol=1e-12)
    for name, g, g0 in zip(("dq", "dk", "dv"), grads, grads0):
        np.testing.assert_allclose(g, g0, rtol=1e-12, atol=1e-12, err_msg=name)
    with pytest.raises(ValueError, match=r"^impl='chunked': leading axes of q, k and v that broadcast"):
        A.sdpa_forward(dq, dk, dv, impl="chunked")


def test_masks_that_would_grow_the_scores_are_not_the_chunked_implementations():
    """A mask or a keep-mask with a leading axis of its own (3, B, Hq, Lq, Lk) would grow the
    scores beyond (B, Hq, Lq, Lk): on dask arrays select_impl("auto") answers "reference" for
    it, as on NumPy it does not answer "numpy", and the call refuses it by name."""
    q, k, v, dout, _ = make_inputs(5, 2, 2, 1, 4, 5, 3, 2)
    rng = np.random.default_rng(5)
    mask = da.from_array(rng.random((3, 2, 2, 4, 5)) > 0.2, chunks=(1, 1, 1, 2, 2))
    keep = da.from_array(rng.random((3, 2, 2, 4, 5)) >= 0.3, chunks=(1, 1, 1, 2, 2))
    dq, dk, dv, *_ = chunk(q, k, v, None, None, dout, (1, 1, 2, 2), 1)
    assert A.select_impl("auto", dq, dk, dv, mask=mask[0]) == "chunked"  # (B, Hq, Lq, Lk) fits
    assert A.select_impl("auto", dq, dk, dv, dropout_mask=keep[0]) == "chunked"
    assert A.select_impl("auto", dq, dk, dv, mask=mask) == "reference"
    assert A.select_impl("auto", dq, dk, dv, dropout_mask=keep) == "reference"
    with pytest.raises(ValueError, match=r"^mask: expected a shape .* got shape \(3, 2, 2, 4, 5\)"):
        A.sdpa_forward(dq, dk, dv, mask=mask)
    with pytest.raises(ValueError, match=r"^dropout_mask: .* got shape \(3, 2, 2, 4, 5\)"):
        A.sdpa_forward(dq, dk, dv, dropout_p=0.3, dropout_mask=keep)


def test_mixing_dask_and_numpy_is_refused_before_anything_runs():
    q, k, v, dout, kw = make_inputs(1, 2, 2, 1, 4, 5, 3, 3, mask_kind="bool")
    dq, dk, dv, *_ = chunk(q, k, v, None, None, dout, (1, 1, 2, 2), 1)
    with pytest.raises(TypeError, match=r"mask: expected a dask array \(that of q\), got a numpy array"):
        A.sdpa_forward(dq, dk, dv, mask=kw["mask"])


def _unknown_along(a, axis):
    """``a`` as a dask array whose length along ``axis`` is unknown (NaN) until computed."""
    keep = [slice(None)] * a.ndim
    keep[axis] = da.from_array(np.ones(a.shape[axis], bool), chunks=2)
    return da.from_array(a, chunks=2)[tuple(keep)]


@pytest.mark.parametrize("bad,error,message", [
    (dict(v=(2, 2, 7, 3)), ValueError, r"^v: expected length 6 \(that of k\)"),
    (dict(mask=(2, 2, 5, 7)), ValueError, r"^mask: expected a shape that broadcasts to the scores"),
    (dict(mask="int"), TypeError, r"^mask: expected dtype bool"),
    (dict(mask="unknown"), ValueError, r"^mask: expected an array of known shape, got shape \(2, 2, nan, 6\)"),
    (dict(dropout_mask="float"), TypeError, r"^dropout_mask: expected a bool keep-mask"),
    (dict(dropout_mask="unknown"), ValueError, r"^dropout_mask: expected an array of known shape"),
    (dict(sinks="unknown"), ValueError, r"^sinks: expected an array of known shape, got shape \(nan,\)"),
    (dict(alibi_slopes=(3, 2)), ValueError, r"^alibi_slopes: expected shape \(2,\) or \(2, 2\)"),
    (dict(q_segments="unknown"), ValueError, r"^q_segments: expected an array of known shape"),
    (dict(k="float32"), TypeError, r"^k: expected dtype float64 \(that of q\), got float32"),
], ids=lambda x: str(x) if isinstance(x, dict) else "")
def test_bad_dask_arguments_are_refused_by_name_before_anything_is_computed(bad, error, message):
    """Each bad argument of a dask call (q, k, v in uneven chunks) is named in a TypeError or
    ValueError raised at the call, and no task of any input's graph runs to find it: the
    scheduler is never asked."""
    r = np.random.default_rng(5)
    B, H, Lq, Lk, D = 2, 2, 5, 6, 3
    host_arrays = dict(q=r.standard_normal((B, H, Lq, D)), k=r.standard_normal((B, H, Lk, D)),
                       v=r.standard_normal((B, H, Lk, D)), mask=r.random((B, H, Lq, Lk)) > 0.3,
                       dropout_mask=r.random((B, H, Lq, Lk)) > 0.3, sinks=r.standard_normal(H),
                       alibi_slopes=r.random(H), q_segments=r.integers(0, 2, (B, Lq)),
                       k_segments=r.integers(0, 2, (B, Lk)))
    (name, how), = bad.items()
    a = host_arrays[name]
    if isinstance(how, tuple):
        a = r.standard_normal(how) if a.dtype != bool else r.random(how) > 0.3
    elif how in ("int", "float", "float32"):
        a = a.astype({"int": np.int64, "float": np.float64, "float32": np.float32}[how])
    args = {n: da.from_array(x, chunks=(1, 1, 2, 3)[4 - x.ndim:] if x.ndim > 1 else 1)
            for n, x in dict(host_arrays, **{name: a}).items()}
    if how == "unknown":
        args[name] = _unknown_along(a, 2 if a.ndim == 4 else a.ndim - 1)
    kw = {n: args[n] for n in (name, "k_segments" if name == "q_segments" else name)
          if n not in ("q", "k", "v")}
    if name == "dropout_mask":
        kw["dropout_p"] = 0.3
    computes = []

    def counting(dsk, keys, **kwargs):
        computes.append(keys)
        return dask.get(dsk, keys, **kwargs)

    with dask.config.set(scheduler=counting):
        with pytest.raises(error, match=message):
            A.sdpa_forward(args["q"], args["k"], args["v"], **kw)
    assert computes == []


def test_unknown_chunk_sizes_and_bad_block_lengths_are_refused_at_the_call():
    """Both were accepted into the graph and failed in a task (an unnamed int(nan) error, or
    the block check on a worker)."""
    q = da.from_array(np.ones((2, 1, 5, 3)), chunks=(1, 1, 2, 3))
    unknown = q[da.from_array(np.array([True, True]))]  # shape (nan, 1, 5, 3)
    for impl in ("chunked", "auto", "reference"):
        with pytest.raises(ValueError, match=r"^q: expected an array of known shape, got shape "
                                             r"\(nan, 1, 5, 3\) \(a dask array of unknown chunk sizes: "
                                             r"call its compute_chunk_sizes\(\) first\)$"):
            A.sdpa_forward(unknown, q, q, impl=impl)
    # the chunked module's own test of its arguments, also with the rows or keys unknown
    rows = q[:, :, da.from_array(np.ones(5, bool))]  # shape (2, 1, nan, 3)
    assert chunked.accepts(q, q, q)
    assert not any(chunked.accepts(*a) for a in ((unknown, q, q), (rows, q, q), (q, rows, rows)))
    # and NumPy arrays among dask ones are not its call either (the dispatcher's input check
    # refuses such a mix before it asks: only a direct call sees this answer)
    n = np.ones((2, 1, 5, 3))
    assert not any(chunked.accepts(*a) for a in ((n, q, q), (q, n, q), (q, q, n), (n, n, n)))
    assert not chunked.accepts(q, q, q, np.ones((5, 5), bool))
    assert not chunked.accepts(q, q, q, None, np.ones((5, 5), bool))
    for bad, exc in ((0, ValueError), (-1, ValueError), (2.5, TypeError), ("x", TypeError)):
        with pytest.raises(exc, match="^block_q: expected a positive int"):
            A.sdpa_forward(q, q, q, block_q=bad)
        with pytest.raises(exc, match="^block_k: expected a positive int"):
            A.sdpa_forward(q, q, q, impl="chunked", block_k=bad)
    # NumPy ints are the Python ints they hold, also in the cache that keeps them for the tasks
    _, c = A.sdpa_forward(q, q, q, impl="chunked", block_q=np.uint8(2), block_k=np.int16(3))
    assert (type(c.block_q), type(c.block_k), c.block_q, c.block_k) == (int, int, 2, 3)


# --------------------------------------------------------------------------
# the module on dask inputs


@pytest.mark.parametrize("cross", [False, True])
def test_module_on_dask_equals_numpy(cross):
    """Forward and backward of MultiHeadAttention(backend="dask") give dask arrays; the
    parameter gradients (reduced over batch chunks) equal the NumPy module's."""
    rng = np.random.default_rng(0)
    B, Lq, Lk, E = 4, 6, 9 if cross else 6, 8
    x = rng.standard_normal((B, Lq, E))
    y = rng.standard_normal((B, Lk, E)) if cross else x
    dout = rng.standard_normal((B, Lq, E))
    pad = rng.random((B, Lk)) > 0.2
    pad[0] = False  # batch entry 0 attends nothing
    kwargs = dict(seed=1, dtype="float64", n_kv_head=2, dropout=0.2)
    m0 = MultiHeadAttention(E, 4, **kwargs)
    out0, _ = m0(x, y, y, mask=pad[:, None, None, :], is_causal=not cross)
    g0 = m0.backward(dout)
    m = MultiHeadAttention(E, 4, backend="dask", **kwargs)
    dx = da.from_array(x, chunks=(1, Lq, E))
    dy = dx if not cross else da.from_array(y, chunks=(2, 3, E))  # key chunks from the sequence
    dpad = da.from_array(pad[:, None, None, :], chunks=(1, 1, 1, 3))
    out, _ = m(dx, dy, dy, mask=dpad, is_causal=not cross)
    assert isinstance(m.cache.sdpa, chunked.ChunkedSDPACache)
    grads = m.backward(da.from_array(dout, chunks=(1, Lq, E)))
    assert isinstance(out, da.Array) and all(isinstance(g, da.Array) for g in grads)
    assert all(isinstance(g, da.Array) for g in m.grads.values())
    out, grads, pgrads = dask.compute(out, grads, dict(m.grads))
    assert_close(out, out0, host, "out")
    for name, g, gr in zip(("dquery", "dkey", "dvalue"), grads, g0):
        assert_close(g, gr, host, name)
    for name in m0.grads:
        assert_close(pgrads[name], m0.grads[name], host, name)


def test_module_with_kernel_options_on_dask_equals_numpy():
    """MultiHeadAttention(backend="dask") with softcap and sinks, called with a window,
    bottom-right causal, ALiBi slopes and segments, GQA and dropout: the chunked path runs
    step 6. and the outputs, input gradients and parameter gradients (the sinks' included)
    equal the NumPy module's in float64."""
    rng = np.random.default_rng(7)
    B, Lq, Lk, E, H = 2, 5, 7, 8, 4
    x, y = rng.standard_normal((B, Lq, E)), rng.standard_normal((B, Lk, E))
    dout = rng.standard_normal((B, Lq, E))
    seg_q, seg_k = rng.integers(0, 2, (B, Lq)), rng.integers(0, 2, (B, Lk))
    call = dict(window=(3, 0), align="bottom_right", is_causal=True,
                alibi_slopes=rng.random(H), q_segments=seg_q, k_segments=seg_k)
    kwargs = dict(seed=3, dtype="float64", n_kv_head=2, dropout=0.2, softcap=2.5, sinks=True)
    m0 = MultiHeadAttention(E, H, **kwargs)
    out0, _ = m0(x, y, y, **call)
    g0 = m0.backward(dout)
    m = MultiHeadAttention(E, H, backend="dask", **kwargs)
    dx, dy = da.from_array(x, chunks=(1, 2, E)), da.from_array(y, chunks=(1, 3, E))
    dcall = dict(call, alibi_slopes=da.from_array(call["alibi_slopes"], chunks=2),
                 q_segments=da.from_array(seg_q, chunks=(1, 2)),
                 k_segments=da.from_array(seg_k, chunks=(1, 3)))
    out, _ = m(dx, dy, dy, **dcall)
    assert isinstance(m.cache.sdpa, chunked.ChunkedSDPACache)
    grads = m.backward(da.from_array(dout, chunks=(1, 2, E)))
    out, grads, pgrads = dask.compute(out, grads, dict(m.grads))
    assert_close(out, out0, host, "out")
    for name, g, gr in zip(("dquery", "dkey", "dvalue"), grads, g0):
        assert_close(g, gr, host, name)
    assert "sinks" in m0.grads
    for name in m0.grads:
        assert_close(pgrads[name], m0.grads[name], host, name)


# --------------------------------------------------------------------------
# a real scheduler: a LocalCluster of two worker processes


@pytest.fixture(scope="module")
def client():
    """Two worker processes of one thread, without distributed's MALLOC_TRIM_THRESHOLD_
    (docs/dask.md); this process's environment is restored afterwards (a nanny writes
    its pre-spawn variables into it)."""
    import os

    environ = dict(os.environ)
    with dask.config.set({"distributed.nanny.pre-spawn-environ.MALLOC_TRIM_THRESHOLD_": None}):
        cluster = distributed.LocalCluster(n_workers=2, threads_per_worker=1, processes=True,
                                           dashboard_address=":0", scheduler_kwargs={"dashboard": False}, memory_limit="2GiB")
    c = distributed.Client(cluster)
    try:
        yield c
    finally:
        c.close()
        cluster.close()
        os.environ.clear()
        os.environ.update(environ)


@pytest.mark.parametrize("case", [
    dict(mask_kind="float", mask_form="LqLk", causal=True, dropout="seed"),
    dict(mask_kind="bool", mask_form="B11Lk", causal=False, dropout="mask"),
], ids=["float+causal+seed", "padding+keep"])
def test_on_a_local_cluster(client, case):
    """The same numbers on two worker processes, and both workers ran pair tasks."""
    q, k, v, dout, kw = make_inputs(11, 4, 2, 2, 7, 9, 4, 3, **case)
    with distributed.get_task_stream(client) as stream:
        ref, got = run_both(q, k, v, dout, kw, (1, 2, 3, 4), 2, scheduler=None)
    assert_same(ref, got, f"cluster {case}")
    workers = {t["worker"] for t in stream.data if "npattn-pair" in str(t["key"])}
    assert len(workers) == 2, workers


def test_module_on_a_local_cluster(client):
    rng = np.random.default_rng(4)
    x = rng.standard_normal((4, 8, 8))
    dout = rng.standard_normal((4, 8, 8))
    m0 = MultiHeadAttention(8, 2, seed=3, dtype="float64", dropout=0.1)
    m = MultiHeadAttention(8, 2, seed=3, dtype="float64", dropout=0.1, backend="dask")
    out0, _ = m0(x, x, x, is_causal=True)
    g0 = m0.backward(dout)
    dx = da.from_array(x, chunks=(1, 8, 8))
    out, _ = m(dx, dx, dx, is_causal=True)
    grads = m.backward(da.from_array(dout, chunks=(1, 8, 8)))
    out, grads, pgrads = client.compute([out, grads, dict(m.grads)], sync=True)
    assert_close(out, out0, host, "out")
    for g, gr in zip(grads, g0):
        assert_close(g, gr, host, "grad")
    for name in m0.grads:
        assert_close(pgrads[name], m0.grads[name], host, name)


def test_persisting_the_cache_runs_each_forward_pair_once_on_a_local_cluster(client):
    """docs/dask.md, "Computing the forward once": ``dask.persist(out, cache)`` (and for the
    module ``mha.cache`` persisted and assigned back) keeps the forward's results, so the
    backward runs no forward task again; persisting ``out`` alone leaves them in the backward's
    graph. Counted on the workers' task stream; the gradients are NumPy's."""
    def forward_tasks(stream):
        return sum("npattn-pair-forward" in str(t["key"]) for t in stream.data)

    def graph_has_forward(a):
        return any("npattn-pair-forward" in str(key) for key in dict(a.__dask_graph__()))

    q, k, v, dout, kw = make_inputs(13, 2, 2, 1, 7, 9, 4, 3, mask_kind="bool", mask_form="B11Lk",
                                    causal=True, dropout="seed")
    out0, c0 = A.sdpa_forward(q, k, v, impl="numpy", **kw)
    grads0 = A.sdpa_backward(dout, c0)
    dq, dk, dv, dmask, _, ddout = chunk(q, k, v, kw["mask"], None, dout, (1, 2, 3, 4), 1)
    dkw = dict(kw, mask=dmask)
    out, c = A.sdpa_forward(dq, dk, dv, **dkw)
    out = out.persist()
    distributed.wait(out)  # (its tasks ended: none is counted in the task stream below)
    assert graph_has_forward(A.sdpa_backward(ddout, c).dk)  # out alone: the cache is still lazy
    out, c = A.sdpa_forward(dq, dk, dv, **dkw)
    # chunks (1, 2, 3, 4) of (B, H, Lq, Lk) = (2, 2, 7, 9): query rows 0-2, 3-5, 6 against keys
    # 0-3, 4-7, 8; causal leaves out the key chunks that start past a chunk's last row: 1 + 2 + 2
    # pairs per batch entry
    pairs = 2 * (1 + 2 + 2)
    with distributed.get_task_stream(client) as stream:
        out, c = dask.persist(out, c)
        distributed.wait([out, c.out, c.m, c.l])
        grads = A.sdpa_backward(ddout, c)
        assert not graph_has_forward(grads.dk)
        out, grads = dask.compute(out, grads)
    assert forward_tasks(stream) == pairs
    assert_close(out, out0, host, "out")
    for name, g, g0 in zip(("dq", "dk", "dv"), grads, grads0):
        assert_close(g, g0, host, name)

    x = np.random.default_rng(14).standard_normal((4, 6, 8))
    m0 = MultiHeadAttention(8, 2, seed=3, dtype="float64", dropout=0.2)
    m = MultiHeadAttention(8, 2, seed=3, dtype="float64", dropout=0.2, backend="dask")
    out0, _ = m0(x, x, x, is_causal=True)
    g0 = m0.backward(x)
    dx = da.from_array(x, chunks=(1, 6, 8))
    with distributed.get_task_stream(client) as stream:
        out, _ = m(dx, dx, dx, is_causal=True)
        out, m.cache = dask.persist(out, m.cache)
        distributed.wait(out)
        grads = m.backward(dx)
        assert not graph_has_forward(grads[1])
        out, grads, pgrads = dask.compute(out, grads, dict(m.grads))
    assert forward_tasks(stream) == 4  # one pair per batch entry
    assert_close(out, out0, host, "module out")
    for g, gr in zip(grads, g0):
        assert_close(g, gr, host, "module grad")
    for name in m0.grads:
        assert_close(pgrads[name], m0.grads[name], host, name)


# --------------------------------------------------------------------------
# the benchmark (no timing assertions)


def test_bench_counts_one_forward_and_one_backward_task_per_pair(tmp_path, capsys):
    from npattn.tools import bench

    path = tmp_path / "dask.json"
    assert bench.main(["--backend", "dask", "--shape", "3x64x16x2c", "--q-chunk", "16",
                       "--k-chunk", "32", "--graph-only", "--json", str(path)]) == 0
    result = json.loads(path.read_text())
    rows = {(r["q_chunk"], r["k_chunk"]): r for r in result["graph"]}
    # causal, top-left: query chunk i (16 rows) meets key chunk j (32 keys) when 32 j <= 16 i + 15
    pairs = sum(1 for i in range(4) for j in range(2) if 32 * j <= 16 * i + 15)
    assert rows[(16, 32)]["pairs"] == 3 * pairs and rows[(16, 32)]["pair_tasks"] == 6 * pairs
    assert rows[(64, 64)]["pairs"] == 3
    assert "pairs" in capsys.readouterr().out
    # chunks longer than the sequence: the header and the JSON give the chunks used (64)
    assert bench.main(["--backend", "dask", "--shape", "2x64x16x2", "--graph-only",
                       "--json", str(path)]) == 0
    result = json.loads(path.read_text())
    assert (result["q_chunk"], result["k_chunk"]) == (64, 64)
    assert "2 heads x 64 queries x 64 keys" in capsys.readouterr().out


def test_bench_runs_on_clusters_of_one_and_two_workers(tmp_path):
    from npattn.tools import bench_dask

    path = tmp_path / "dask.json"
    assert bench_dask.main(["--shape", "2x32x8x2", "--q-chunk", "16", "--k-chunk", "16",
                            "--no-local", "--json", str(path)]) == 0
    result = json.loads(path.read_text())
    assert [r["workers"] for r in result["workers"]] == [1, 2]
    assert all(len(r["peak_mib"]) == r["workers"] for r in result["workers"])
    assert all("MALLOC_TRIM_THRESHOLD_" not in r["malloc_env"] for r in result["workers"])
    # the sums of out, dq, dk, dv agree between the two clusters
    np.testing.assert_allclose(result["workers"][0]["checks"], result["workers"][1]["checks"], rtol=1e-5)


@pytest.mark.parametrize("args,message", [
    (["--workers", "0"], "--workers: expected a positive integer, got 0"),
    (["--workers", "a,b"], "--workers: expected comma-separated positive integers, got 'a,b'"),
    (["--shape", "2x4x6x4"], "--shape: expected positive sizes with H dividing D, got '2x4x6x4'"),
    (["--shape", "0x4x8x4"], "--shape: expected positive sizes with H dividing D, got '0x4x8x4'"),
    (["--shape", "1x4x2x4"], "--shape: expected positive sizes with H dividing D, got '1x4x2x4'"),
    (["--workers", "1,0"], "--workers: expected a positive integer, got 0"),
    (["--q-chunk", "0"], "--q-chunk: expected a positive integer, got 0"),
    (["--k-chunk", "0"], "--k-chunk: expected a positive integer, got 0"),
    (["--repeat", "0"], "--repeat: expected a positive integer, got 0"),
    (["--shape", "2x3"], "--shape: expected BxLxDxH[c][wN] with positive integers, got '2x3'"),
    (["--shape", "2x4x8x2x"], "--shape: expected BxLxDxH[c][wN] with positive integers, got '2x4x8x2x'"),
    (["--shape", "2x4x8x2cc"], "--shape: expected BxLxDxH[c][wN] with positive integers, got '2x4x8x2cc'"),
    (["--shape", "2x+4x8x2"], "--shape: expected BxLxDxH[c][wN] with positive integers, got '2x+4x8x2'"),
    (["--shape", "2x1_0x8x2"], "--shape: expected BxLxDxH[c][wN] with positive integers, got '2x1_0x8x2'"),
])
def test_bench_rejects_bad_options(args, message, capsys):
    from npattn.tools import bench

    with pytest.raises(SystemExit) as exc:
        bench.main(["--backend", "dask", *args])
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


def test_bench_dask_reads_a_shape_as_npattn_bench_reads_its_items():
    """Either case and surrounding spaces, as ``npattn bench --shapes``; a c (or C) is
    causal, wN a window of N keys back, as in npattn bench."""
    from npattn.tools import bench_dask

    assert bench_dask.parse_shape("2X4X8X2C") == bench_dask.parse_shape(" 2x4x8x2c ") == \
        (2, 4, 8, 2, True, None)
    assert bench_dask.parse_shape("2x4x8x2") == (2, 4, 8, 2, False, None)
    assert bench_dask.parse_shape("1x64x8x2w16") == (1, 64, 8, 2, False, 16)
    assert bench_dask.parse_shape("1x64x8x2CW0") == (1, 64, 8, 2, True, 0)
    for bad in ("1x64x8x2w", "1x64x8x2wc", "1x64x8x2w-1"):
        with pytest.raises(ValueError, match=r"^--shape: expected BxLxDxH\[c\]\[wN\]"):
            bench_dask.parse_shape(bad)


@pytest.mark.parametrize("causal, window", [(False, None), (True, None), (False, 5), (True, 12),
                                            (False, 0), (False, 100)])
def test_bench_dask_visible_pairs_are_the_pairs_of_the_graph(causal, window):
    """visible_pairs (the memory check's count) is the number of pair tasks the chunked graph
    holds, and the count by brute force over every (query, key) of the chunks: a pair is in
    the graph when one of its queries may attend one of its keys."""
    from npattn.tools import bench_dask

    text = "2x30x4x2" + ("c" if causal else "") + ("" if window is None else f"w{window}")
    shape = bench_dask.parse_shape(text)
    for qc, kc in ((7, 4), (30, 30), (1, 3), (10, 10)):
        i, j = np.arange(30)[:, None], np.arange(30)[None, :]
        may = np.ones((30, 30), dtype=bool)
        if causal or window is not None:
            may &= j <= i
        if window is not None:
            may &= j >= i - window
        brute = sum(may[i0:i0 + qc, j0:j0 + kc].any() for i0 in range(0, 30, qc)
                    for j0 in range(0, 30, kc))
        assert bench_dask.visible_pairs(30, qc, kc, causal, window) == brute
        (row,) = bench_dask.graph_sizes(shape, np.dtype("float64"), [(qc, kc)])
        assert row["pairs"] == 2 * brute  # two batch entries


def test_bench_dask_visible_pairs_by_brute_force_and_at_sizes_too_large_to_build():
    """Over small lengths, chunkings and windows the count is the brute-force one; at L = 2e9
    (the memory check's refusal of such a shape must come at once) causal in square chunks
    is the triangle n (n + 1) / 2 of n chunks a side, and a window within one chunk two
    chunks a row but the first."""
    from npattn.tools import bench_dask

    rng = np.random.default_rng(5)
    for _ in range(300):
        L, qc, kc = (int(x) for x in rng.integers(1, 40, size=3))
        causal = bool(rng.integers(2))
        window = None if rng.integers(3) == 0 else int(rng.integers(0, 45))
        i, j = np.arange(L)[:, None], np.arange(L)[None, :]
        may = np.ones((L, L), dtype=bool)
        if causal or window is not None:
            may &= j <= i
        if window is not None:
            may &= j >= i - window
        brute = sum(may[i0:i0 + qc, j0:j0 + kc].any() for i0 in range(0, L, qc)
                    for j0 in range(0, L, kc))
        assert bench_dask.visible_pairs(L, qc, kc, causal, window) == brute, (L, qc, kc, causal, window)
    n = -(-2 * 10**9 // 1024)
    assert bench_dask.visible_pairs(2 * 10**9, 1024, 1024, True) == n * (n + 1) // 2
    assert bench_dask.visible_pairs(2 * 10**9, 1024, 1024, False, 1000) == 2 * n - 1
    assert bench_dask.visible_pairs(2 * 10**9, 1024, 1024) == n * n


@pytest.mark.parametrize("text, largest", [
    ("1x1x99999999999x1", 99999999999),
    ("2147483648x4x8x2c", 2**31),
    ("1x4x4294967296x2", 2**32),
])
def test_bench_refuses_a_shape_past_the_largest_size_before_any_graph(text, largest, capsys, monkeypatch):
    """Each size at most 2**31 - 1, as npattn bench --shapes takes them; refused by name even
    with --skip-memory-check and --graph-only, where no memory estimate would stop the run."""
    from npattn.tools import bench, bench_dask

    def no_graph(*args, **kwargs):
        raise AssertionError("a graph was built for an oversized shape")

    monkeypatch.setattr(bench_dask, "graph_sizes", no_graph)
    with pytest.raises(ValueError) as exc:
        bench_dask.parse_shape(text)
    assert str(exc.value) == (f"--shape: {text!r} needs sizes of at most 2147483647 (BLAS takes 32-bit "
                              f"sizes), got {largest}")
    with pytest.raises(SystemExit) as stop:
        bench.main(["--backend", "dask", "--shape", text, "--skip-memory-check", "--graph-only"])
    assert stop.value.code == 2
    assert str(exc.value) in capsys.readouterr().err
    assert bench_dask.parse_shape("1x1x2147483647x1") == (1, 1, 2**31 - 1, 1, False, None)  # the largest


def test_bench_run_bytes_by_hand():
    """L = 20 in chunks of 3 queries and 1 key: ceil(20 / 3) = 7 query chunks by 20 key chunks,
    140 pairs, more than the finest chunking the command adds (L // 8 = 2 a side: 10 x 10);
    at D = 4096 the in-process run's 8 arrays of B L D float32 values weigh more."""
    from npattn.tools import bench_dask

    per_pair = bench_dask.GRAPH_BYTES_PER_PAIR
    need, what = bench_dask.run_bytes((1, 20, 4, 2, False), 4, 3, 1, local=False)
    assert need == 140 * per_pair and "140 chunk pairs" in what
    need, what = bench_dask.run_bytes((1, 20, 4096, 2, False), 4, 3, 1)
    assert need == 8 * 20 * 4096 * 4 > 140 * per_pair and "8 B*L*D arrays" in what
    need, what = bench_dask.run_bytes((3, 20, 4, 2, False), 8, 3, 1, local=False)  # 3 entries
    assert need == 420 * per_pair and "a graph of 420 chunk pairs" in what


def test_bench_graph_bytes_per_pair_is_a_lower_bound_of_a_graph_built():
    """The memory check counts GRAPH_BYTES_PER_PAIR for each chunk pair of the graph: a graph
    of 256 pairs (256 rows in chunks of 16, 16 x 16 pairs), built and held as graph_sizes
    holds it, takes at least that much per pair (about 4 KiB in 2026). It measures dask's own
    graph, so a dask that stores graphs in less than half the memory fails it with npattn
    unchanged: then GRAPH_BYTES_PER_PAIR is to be measured again and lowered."""
    import gc
    import tracemalloc

    from npattn.tools import bench_dask

    shape = bench_dask.parse_shape("1x256x8x2")
    bench_dask.graph_sizes(shape, np.dtype("float32"), [(16, 16)])  # its imports, before measuring
    gc.collect()
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        _, results = bench_dask._graph(shape, np.dtype("float32"), 16, 16)
        tasks = bench_dask._tasks(*results)
        held = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert sum(1 for key in tasks if str(key[0]).startswith("npattn-pair-")) == 2 * 256
    assert held >= bench_dask.GRAPH_BYTES_PER_PAIR * 256


def test_bench_chunks_the_inputs_as_documented(monkeypatch):
    """One batch entry and all heads per chunk; q and dout by --q-chunk query rows, k and v by
    --k-chunk keys."""
    from npattn.tools import bench_dask

    seen = []
    forward, backward = A.sdpa_forward, A.sdpa_backward

    def recording_forward(q, k, v, **kwargs):
        seen.extend([("q", q.chunks), ("k", k.chunks), ("v", v.chunks)])
        return forward(q, k, v, **kwargs)

    def recording_backward(dout, cache):
        seen.append(("dout", dout.chunks))
        return backward(dout, cache)

    monkeypatch.setattr(A, "sdpa_forward", recording_forward)
    monkeypatch.setattr(A, "sdpa_backward", recording_backward)
    bench_dask.graph_sizes(bench_dask.parse_shape("2x6x4x2"), np.dtype("float64"), [(4, 3)])
    queries = ((1, 1), (2,), (4, 2), (2,))  # B = 2 entries, H = 2 heads, L = 6 rows, Dh = 2
    keys = ((1, 1), (2,), (3, 3), (2,))
    assert dict(seen) == {"q": queries, "k": keys, "v": keys, "dout": queries}


class _Clock:
    """perf_counter of a clock that moves only when told to."""

    def __init__(self):
        self.now = 0.0

    def perf_counter(self):
        return self.now


def _status(rss_mib, hwm_mib):
    return f"Name:\tpython\nVmHWM:\t{hwm_mib * 1024} kB\nVmRSS:\t{rss_mib * 1024} kB\n"


def test_bench_run_workers_times_the_whole_computation_and_reads_the_peaks(monkeypatch):
    """With a stand-in cluster (no processes) and clock: each cluster is made with n workers of
    one thread in processes of their own, pinned to one core; each timed run computes the sums
    of out, dq, dk and dv (a forward and a backward task per chunk pair), its time the clock's
    advance during the compute; the reported time is the median of the runs, the speed-up the
    first count's time over each; the peak per worker is VmHWM after the runs and the base VmRSS
    before, in MiB. Each cluster has no memory limit of distributed's (which would pause or
    restart a worker and change its peak) and a scratch folder of its own, removed afterwards;
    a MALLOC_TRIM_THRESHOLD_ of this process's is kept from the workers unless
    malloc_trim, and is this process's again afterwards."""
    import io
    import os

    from npattn.tools import bench_dask

    clock = _Clock()
    advances = iter([4.0, 1.0, 6.0, 2.0, 3.0, 1.0, 1.0])  # two clusters, three runs each; one
    made, computed, spawned, ran = [], [], [], []
    reads = iter(range(1, 100))
    for name in [n for n in os.environ if n.startswith("MALLOC_")]:
        monkeypatch.delenv(name)
    monkeypatch.setenv("MALLOC_TRIM_THRESHOLD_", "131072")
    monkeypatch.setenv("MALLOC_ARENA_MAX", "2")

    class Cluster:
        def __init__(self, **kwargs):
            self.n = kwargs["n_workers"]
            made.append((kwargs, dict(dask.config.get("distributed.nanny.pre-spawn-environ"))))
            spawned.append((os.environ.get("MALLOC_TRIM_THRESHOLD_"), dask.config.get("temporary-directory")))

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

    class Client(Cluster):
        def __init__(self, cluster):
            self.n = cluster.n

        @classmethod
        def current(cls, allow_global=True):  # asked by dask.compute: there is no client
            raise ValueError("no client")

        def run(self, fn):
            ran.append(fn.__name__)
            return {f"tcp://w{i}": fn() for i in range(self.n)}

        def compute(self, sums, sync):
            assert sync
            keys = set().union(*(dict(x.__dask_graph__()) for x in sums))
            computed.append((len(sums), sum(1 for k in keys if isinstance(k, tuple)
                                            and str(k[0]).startswith("npattn-pair-"))))
            clock.now += next(advances)
            return dask.compute(*sums, scheduler="sync")

    real_open = open

    def fake_open(path, *args, **kwargs):
        if path == "/proc/self/status":  # the k-th read: RSS 100 k MiB, peak 100 k + 50 MiB
            k = next(reads)
            return io.StringIO(_status(100 * k, 100 * k + 50))
        return real_open(path, *args, **kwargs)

    monkeypatch.setattr(distributed, "LocalCluster", Cluster)
    monkeypatch.setattr(distributed, "Client", Client)
    monkeypatch.setattr(bench_dask, "time", clock)
    monkeypatch.setattr(bench_dask, "open", fake_open, raising=False)
    shape = bench_dask.parse_shape("1x8x4x2")
    printed = io.StringIO()
    rows = bench_dask.run_workers(shape, np.dtype("float64"), 4, 4, [1, 2], 3, out=printed)
    for (kwargs, spawn), n, (trim, scratch) in zip(made, (1, 2), spawned):
        assert (kwargs["n_workers"], kwargs["threads_per_worker"], kwargs["processes"]) == (n, 1, True)
        assert kwargs["memory_limit"] == 0 and trim is None
        assert os.path.basename(scratch).startswith("npattn-dask-") and not os.path.exists(scratch)
        assert kwargs["env"]["NPATTN_NUM_THREADS"] == "1"
        assert all(kwargs["env"][f"{name}_NUM_THREADS"] == "1" for name in ("OMP", "OPENBLAS", "MKL"))
        assert spawn["MALLOC_TRIM_THRESHOLD_"] is None
    # each cluster: its malloc settings, then npattn imported and run once before the baseline
    assert ran == ["_malloc_env", "_warm_up", "_worker_rss_mib", "_worker_rss_mib"] * 2
    assert [r["malloc_env"] for r in rows] == [{"MALLOC_ARENA_MAX": "2"}] * 2
    # 2 x 2 chunk pairs of 4 queries and 4 keys: 4 forward and 4 backward tasks
    assert computed == [(4, 8)] * 6
    assert [r["times"] for r in rows] == [[4.0, 1.0, 6.0], [2.0, 3.0, 1.0]]
    assert [(r["seconds"], r["speedup"]) for r in rows] == [(4.0, 1.0), (2.0, 2.0)]
    assert all(len(r["checks"]) == 4 for r in rows)
    # reads 1 (before) and 2 (after) for the one worker, then 3, 4 (before) and 5, 6 (after)
    assert (rows[0]["base_mib"], rows[0]["peak_mib"]) == ([100.0], [250.0])
    assert (rows[1]["base_mib"], rows[1]["peak_mib"]) == ([300.0, 400.0], [550.0, 650.0])
    assert printed.getvalue().splitlines() == [
        "  1 worker(s): 4.00 s (runs 4.00, 1.00, 6.00); peak RSS per worker 250 MiB "
        "(before the run 100 MiB)",
        "  2 worker(s): 2.00 s (runs 2.00, 3.00, 1.00); peak RSS per worker 550, 650 MiB "
        "(before the run 300, 400 MiB)"]
    assert os.environ["MALLOC_TRIM_THRESHOLD_"] == "131072"
    (row,) = bench_dask.run_workers(shape, np.dtype("float64"), 4, 4, [1], 1, malloc_trim=True,
                                    out=io.StringIO())
    assert made[-1][1]["MALLOC_TRIM_THRESHOLD_"] is not None  # distributed's own setting kept
    assert spawned[-1][0] == "131072" and row["speedup"] == 1.0


def test_bench_counts_the_tasks_beyond_the_inputs_however_they_are_made(monkeypatch):
    """The tasks of a graph row are those of the forward+backward: inputs made with more
    tasks (here each one scaled and shifted) leave the count as it was."""
    from npattn.tools import bench_dask

    shape = bench_dask.parse_shape("2x8x4x2c")
    (plain,) = bench_dask.graph_sizes(shape, np.dtype("float64"), [(4, 2)])
    made = bench_dask._inputs
    monkeypatch.setattr(bench_dask, "_inputs", lambda *a, **k: tuple(x * 2.0 + 1.0 for x in made(*a, **k)))
    (scaled,) = bench_dask.graph_sizes(shape, np.dtype("float64"), [(4, 2)])
    assert scaled == plain and plain["tasks"] >= plain["pair_tasks"] > 0


def test_bench_sequences_shorter_than_eight_have_chunks_of_one(tmp_path, monkeypatch):
    """The finest chunking is an eighth of the sequence, and at least one query or key: a
    sequence of 4 is built in chunks of 1 (an eighth of it is 0)."""
    from npattn.tools import bench_dask

    asked = []
    monkeypatch.setattr(bench_dask, "graph_sizes", lambda shape, dtype, chunkings: asked.append(
        list(chunkings)) or [])
    assert bench_dask.main(["--shape", "1x4x8x2", "--q-chunk", "2", "--k-chunk", "3",
                            "--graph-only", "--json", str(tmp_path / "r.json")]) == 0
    assert asked == [[(4, 4), (4, 3), (2, 3), (1, 1)]]


def test_bench_without_distributed_says_so_and_exits_2(monkeypatch, capsys):
    import sys

    from npattn.tools import bench_dask

    monkeypatch.setitem(sys.modules, "distributed", None)  # import distributed raises ImportError
    assert bench_dask.main(["--shape", "1x8x16x2", "--graph-only"]) == 2
    err = capsys.readouterr().err
    # the packages first (a wheel has no repository root), then the checkout's extra
    assert "needs dask and distributed (pip install 'dask[array,distributed]', or '.[dask]'" in err
    assert "Traceback" not in err


def test_bench_run_local_times_forward_and_backward(monkeypatch):
    """The in-process run: the blocked forward of the shape's q, k, v (B, H, L, D / H), causal
    as asked, and its backward, both inside each timed run; the median is reported."""
    from npattn.tools import bench_dask

    clock = _Clock()
    forward_times = iter([1.0, 5.0, 9.0])
    seen = []
    forward, backward = A.sdpa_forward, A.sdpa_backward

    def timed_forward(q, k, v, **kwargs):
        seen.append((q.shape, q.dtype, kwargs))
        clock.now += next(forward_times)
        return forward(q, k, v, **kwargs)

    def timed_backward(dout, cache):
        clock.now += 2.0
        return backward(dout, cache)

    monkeypatch.setattr(A, "sdpa_forward", timed_forward)
    monkeypatch.setattr(A, "sdpa_backward", timed_backward)
    monkeypatch.setattr(bench_dask, "time", clock)
    result = bench_dask.run_local(bench_dask.parse_shape("2x8x12x3c"), np.dtype("float64"), 3)
    assert seen == [((2, 3, 8, 4), np.float64, {"is_causal": True, "window": None,
                                                "impl": "blocked"})] * 3
    assert result["times"] == [3.0, 7.0, 11.0] and result["seconds"] == 7.0
    from npattn import backend

    monkeypatch.setattr(backend, "pool_threads", lambda: 5)  # the pool's threads are reported
    forward_times = iter([1.0])
    assert bench_dask.run_local(bench_dask.parse_shape("1x4x2x1"), np.dtype("float64"), 1)["threads"] == 5
    seen.clear()
    forward_times = iter([1.0])
    bench_dask.run_local(bench_dask.parse_shape("1x4x2x1w3"), np.dtype("float64"), 1)  # wN: (N, 0)
    assert seen[0][2] == {"is_causal": False, "window": (3, 0), "impl": "blocked"}


def test_bench_main_passes_its_options_on(tmp_path, monkeypatch):
    """The command hands its shape, dtype, chunks (at most L), workers, repeat and
    --dask-malloc-trim to the cluster runs and the in-process run, leaves out what --no-local
    and --graph-only leave out, and reports one score matrix's MiB: 1024 x 1024 float32 is
    4 MiB, 8 MiB for the 2 heads of one batch entry."""
    from npattn.tools import bench_dask, limits

    calls = []

    def run_workers(shape, dtype, q_chunk, k_chunk, workers, repeat, malloc_trim=False):
        calls.append(("workers", shape, dtype, q_chunk, k_chunk, workers, repeat, malloc_trim))
        return [dict(workers=n, seconds=1.0, speedup=1.0) for n in workers]

    def run_local(shape, dtype, repeat):
        calls.append(("local", shape, dtype, repeat))
        return dict(seconds=1.0, threads=1)

    monkeypatch.setattr(bench_dask, "run_workers", run_workers)
    monkeypatch.setattr(bench_dask, "run_local", run_local)
    path = tmp_path / "r.json"
    common = ["--shape", "3x1024x16x2c", "--dtype", "float32", "--q-chunk", "2048", "--k-chunk",
              "256", "--json", str(path)]
    assert bench_dask.main([*common, "--workers", "3", "--repeat", "2", "--dask-malloc-trim"]) == 0
    shape = (3, 1024, 16, 2, True, None)
    assert calls == [("workers", shape, np.float32, 1024, 256, [3], 2, True),
                     ("local", shape, np.float32, 2)]
    result = json.loads(path.read_text())
    assert (result["scores_one_head_mib"], result["scores_one_entry_mib"]) == (4.0, 8.0)
    assert result["malloc_trim"] is True and "local" in result
    calls.clear()
    assert bench_dask.main([*common, "--no-local"]) == 0
    assert [c[0] for c in calls] == ["workers"] and calls[0][-1] is False
    assert "local" not in json.loads(path.read_text())
    # --graph-only runs nothing, and its memory estimate counts the graph alone: 1 MiB holds
    # this graph but not the in-process run's eight 3 x 1024 x 16 float32 arrays (1.5 MiB)
    calls.clear()
    monkeypatch.setattr(limits, "available_memory", lambda: 2**20)
    assert bench_dask.main([*common, "--graph-only"]) == 0
    assert calls == []
    result = json.loads(path.read_text())
    assert "workers" not in result and "local" not in result


# --------------------------------------------------------------------------
# npattn check --backend dask


def test_the_audit_covers_the_chunked_implementation():
    from npattn.tools import audit

    xp = resolve_backend("dask")
    checks = audit.panel("dask")
    names = [c.name for c in checks]
    assert any(n.endswith("[chunked]") and n.startswith("sdpa") for n in names)
    assert any(n.endswith("[chunked]") and n.startswith("mha") for n in names)
    assert not any("[blocked]" in n for n in names)
    wanted = ("sdpa, Lq!=Lk, causal [chunked]",
              "mha self, no bias, causal [chunked]")
    with dask.config.set(scheduler="sync"):
        for check in (c for c in checks if c.name in wanted):
            rows = audit.run_check(check, xp, "float64")
            assert rows and all(r.passed for r in rows), [str(r) for r in rows]
            assert {r.tensor for r in rows} >= ({"q", "k", "v"} if check.name.startswith("sdpa")
                                                else {"x (q=k=v)", "w_q"})


def _chunked_audit_calls(monkeypatch, prefix):
    """(name, (q, k, v, mask)) of the one ``attention.sdpa_forward`` call that the forward of
    each [chunked] configuration of the dask audit whose name starts with ``prefix`` makes."""
    from npattn.tools import audit

    seen = []
    original = A.sdpa_forward

    def recording(q, k, v, mask=None, **kw):
        seen.append((q, k, v, mask))
        return original(q, k, v, mask=mask, **kw)

    monkeypatch.setattr(A, "sdpa_forward", recording)
    xp = resolve_backend("dask")
    calls = []
    for check in audit.panel("dask"):
        if check.impl != "chunked" or not check.name.startswith(prefix):
            continue
        seen.clear()
        fwd, bwd, inputs, names = check.build(xp, xp.float64, np.random.default_rng(0),
                                              impl=check.impl)
        fwd(*inputs)
        (call,) = seen
        calls.append((check.name, call))
    return calls


def test_the_audit_s_chunked_configurations_split_every_array_they_take(monkeypatch):
    """Each [chunked] sdpa configuration hands the chunked implementation q, k, v and its mask
    in several chunks along the query rows and the keys (a mask's query axis of length 1
    broadcasts), so that the audit crosses chunk edges in every array (a mask in one chunk
    would leave its split untested)."""
    masked = 0
    for name, (q, k, v, mask) in _chunked_audit_calls(monkeypatch, "sdpa"):
        assert q.numblocks[-2] > 1 and k.numblocks[-2] > 1 and v.numblocks[-2] > 1, name
        if mask is not None:
            assert mask.numblocks[-1] > 1, (name, mask.chunks)
            assert mask.shape[-2] == 1 or mask.numblocks[-2] > 1, (name, mask.chunks)
            masked += 1
    assert masked >= 2


def test_without_empty_chunks_drops_them_and_an_empty_axis_keeps_one():
    """without_empty_chunks leaves out the chunks of length 0 of a dask array, keeps one chunk
    (of length 0) on an axis of length 0 however many it had, changes no value, and returns
    anything else (an array without such chunks, a NumPy array, None) as it is."""
    from npattn.backend import without_empty_chunks

    host = np.arange(12.0).reshape(4, 3)
    x = da.from_array(host, chunks=((2, 0, 2), (0, 2, 1)))
    got = without_empty_chunks(x)
    assert got.chunks == ((2, 2), (2, 1))
    np.testing.assert_array_equal(got.compute(), host)
    empty = da.concatenate([x[:0], x[:0]], axis=0)  # an axis of length 0 in two chunks
    assert empty.chunks[0] == (0, 0)
    got = without_empty_chunks(empty)
    assert got.chunks == ((0,), (2, 1)) and got.compute().shape == (0, 3)
    plain = da.from_array(host, chunks=2)
    assert without_empty_chunks(plain) is plain
    assert without_empty_chunks(host) is host and without_empty_chunks(None) is None


def test_empty_chunks_and_a_bad_dout():
    """dask allows chunks of length 0: they are left out of the plan, also when
    ``chunked.sdpa_forward`` is called directly (the blocked loops inside a pair task need
    a row). A dout of the wrong dtype or shape is refused before a graph is built, as by
    the reference."""
    q, k, v, dout, kw = make_inputs(6, 2, 2, 1, 5, 7, 3, 4, causal=True)
    for causal in (False, True):
        out0, c0 = A.sdpa_forward(q, k, v, is_causal=causal, impl="numpy")
        dq = da.from_array(q, chunks=((2,), (2,), (0, 3, 2), (3,)))
        dk = da.from_array(k, chunks=((2,), (2,), (0, 3, 4), (3,)))
        dv = da.from_array(v, chunks=(1, 1, 3, 4))
        out, c = A.sdpa_forward(dq, dk, dv, is_causal=causal)
        grads = A.sdpa_backward(da.from_array(dout, chunks=2), c)
        # the chunked module's own entry points (the dispatcher drops such chunks before)
        out1, c1 = chunked.sdpa_forward(dq, dk, dv, mask=None, is_causal=causal, scale=None,
                                        dropout_p=0.0, dropout_mask=None, rng=None, groups=1)
        grads1 = chunked.sdpa_backward(da.from_array(dout, chunks=2), c1)
        got = dask.compute([(out, grads), (out1, grads1)], scheduler="sync")[0]
        for (out, grads), what in zip(got, ("attention", "chunked")):
            assert_close(out, out0, host, f"{what}: out")
            for g, g0 in zip(grads, A.sdpa_backward(dout, c0)):
                assert_close(g, g0, host, f"{what}: grad")
    for backward in (A.sdpa_backward, chunked.sdpa_backward):  # the module's own checks too
        with pytest.raises(TypeError, match=r"dout: expected dtype float64 .*got float32"):
            backward(da.from_array(dout.astype(np.float32)), c)
        with pytest.raises(ValueError, match=r"dout: expected shape \(2, 2, 5, 4\)"):
            backward(da.from_array(dout[:, :, :4]), c)


def test_a_mask_of_fewer_axes_with_an_empty_chunk_on_a_length_1_axis():
    """A mask or keep-mask (Lq, 1) or (1,) chunked ``(0, 1)`` on its length-1 axis: its leading
    axes were added by dask's reshape, which failed on such chunks (an IndexError, or "Missing
    dependency" when computed)."""
    q, k, v, dout, _ = make_inputs(7, 2, 1, 2, 5, 7, 3, 2)
    rng = np.random.default_rng(7)
    for shape, chunks in (((5, 1), ((2, 3), (0, 1))), ((1,), ((1, 0),)), ((1, 1), ((0, 1), (1,)))):
        for kind in ("bool", "float"):
            allowed = rng.random(shape) > 0.3
            mask = allowed if kind == "bool" else np.where(allowed, rng.standard_normal(shape), -np.inf)
            keep = rng.random(shape) > 0.3
            kw = dict(mask=mask, is_causal=True, enable_gqa=True, dropout_p=0.3, dropout_mask=keep)
            out0, c0 = A.sdpa_forward(q, k, v, impl="reference", **kw)
            grads0 = A.sdpa_backward(dout, c0)
            dq, dk, dv, _, _, ddout = chunk(q, k, v, None, None, dout, (1, 2, 2, 3), 2)
            out, c = A.sdpa_forward(dq, dk, dv, **dict(kw, mask=da.from_array(mask, chunks=chunks),
                                                       dropout_mask=da.from_array(keep, chunks=chunks)))
            out, grads = dask.compute(out, A.sdpa_backward(ddout, c), scheduler="sync")
            assert_close(out, out0, host, f"{shape} {kind}: out")
            for name, g, g0 in zip(("dq", "dk", "dv", "dmask"), grads, grads0):
                assert_close(g, g0, host, f"{shape} {kind}: {name}")


def _unknown_rows_with_an_empty_chunk():
    """A dask array (1, 1, nan, 3) whose rows are three chunks of unknown, 0 and unknown
    length: map_blocks keeps the rows > 0 of each block of (1, 1, 4, 3) and declares so."""
    known = da.from_array(np.arange(12.0).reshape(1, 1, 4, 3) - 5.0, chunks=((1,), (1,), (2, 0, 2), (3,)))
    unknown = da.map_blocks(lambda b: b[:, :, b[0, 0, :, 0] > 0], known,
                            chunks=((1,), (1,), (math.nan, 0, math.nan), (3,)), dtype=known.dtype)
    return known, unknown


def test_an_array_of_unknown_chunk_sizes_keeps_its_chunks():
    """without_empty_chunks leaves an array of unknown chunk sizes as it is, a chunk of
    length 0 among the unknown ones too (dask refuses to rechunk an axis of unknown sizes:
    "Chunks must be unchanging along dimensions with missing values")."""
    from npattn.backend import without_empty_chunks

    known, unknown = _unknown_rows_with_an_empty_chunk()
    assert unknown.chunks[2][1] == 0 and math.isnan(unknown.shape[2])
    assert without_empty_chunks(unknown) is unknown
    np.testing.assert_array_equal(unknown.compute(), known.compute()[:, :, 2:])
    assert without_empty_chunks(known).chunks[2] == (2, 2)  # known sizes: the 0 left out


@pytest.mark.parametrize("impl", ["auto", "reference", "blocked", "chunked"])
def test_unknown_chunk_sizes_with_an_empty_chunk_are_refused_by_name(impl):
    """Such an array reaches the call's check, which names q and the way out, not dask's
    error from a rechunk before it."""
    known, unknown = _unknown_rows_with_an_empty_chunk()
    k = da.from_array(np.ones((1, 1, 5, 3)), chunks=(1, 1, 5, 3))
    with pytest.raises(ValueError, match=r"^q: expected an array of known shape, got shape \(1, 1, nan, 3\) "
                                         r"\(a dask array .*compute_chunk_sizes"):
        A.sdpa_forward(unknown, k, k, impl=impl)
    with pytest.raises(ValueError, match=r"^query: expected an array of known shape, got shape \(1, nan, 3\) "
                                         r"\(a dask array .*compute_chunk_sizes"):
        MultiHeadAttention(3, 1, dtype="float64", backend="dask", seed=0)(unknown[0], unknown[0], unknown[0])


@pytest.mark.parametrize("impl", ["auto", "reference", "blocked", "functional"])
def test_empty_chunks_on_the_reference_and_blocked_paths(impl):
    """Chunks of length 0 in q, k, v, dout and the option arrays: dask's reshape failed on
    them in the reference and the blocked algorithm ("Missing dependency", an IndexError,
    or an output of the wrong shape); they are dropped before the call runs, also by the
    reference's own entry points (impl "functional": functional.sdpa_forward/backward
    called directly, which failed with a ValueError from dask's concatenate)."""
    q, k, v, dout, kw = make_inputs(4, 2, 1, 2, 5, 6, 3, 2, mask_kind="float", mask_form="B11Lk")
    rng = np.random.default_rng(4)
    kw.update(window=(2, 1), alibi_slopes=rng.random((2, 2)), sinks=rng.standard_normal(2),
              q_segments=np.sort(rng.integers(0, 2, (2, 5))), k_segments=np.sort(rng.integers(0, 2, (2, 6))))
    out0, c0 = A.sdpa_forward(q, k, v, impl="reference", **kw)
    grads0 = A.sdpa_backward(dout, c0)
    empty = dict(q=((0, 2), (1, 0, 1), (2, 0, 3), (3,)), k=((2, 0), (1,), (0, 6), (1, 2)),
                 v=((1, 1, 0), (1,), (3, 3, 0), (2,)), dout=((2,), (0, 2), (5, 0), (1, 1)),
                 mask=((1, 0, 1), (1,), (1,), (0, 6)), alibi_slopes=((2, 0), (1, 1)),
                 sinks=((0, 2),), q_segments=((2,), (0, 5)), k_segments=((1, 0, 1), (6,)))
    arrays = dict(kw, q=q, k=k, v=v, dout=dout)
    dkw = {n: da.from_array(arrays[n], chunks=c) for n, c in empty.items()}
    dq, dk, dv, ddout = (dkw.pop(n) for n in ("q", "k", "v", "dout"))
    if impl == "functional":
        out, c = F.sdpa_forward(dq, dk, dv, **dict(kw, **dkw))
        out, grads = dask.compute(out, F.sdpa_backward(ddout, c), scheduler="sync")
    else:
        out, c = A.sdpa_forward(dq, dk, dv, impl=impl, **dict(kw, **dkw))
        out, grads = dask.compute(out, A.sdpa_backward(ddout, c), scheduler="sync")
    assert_close(out, out0, host, f"{impl}: out")
    for name, g, g0 in zip(("dq", "dk", "dv", "dmask", "dsinks"), grads, grads0):
        assert_close(g, g0, host, f"{impl}: {name}")


def test_empty_chunks_in_the_module_on_dask():
    """The module's head split (a reshape) failed on inputs with chunks of length 0."""
    rng = np.random.default_rng(2)
    B, Lq, Lk, E = 2, 5, 6, 4
    x, y, dout = (rng.standard_normal(s) for s in ((B, Lq, E), (B, Lk, E), (B, Lq, E)))
    pad = rng.random((B, 1, 1, Lk)) > 0.3
    kwargs = dict(seed=3, dtype="float64", n_kv_head=2, dropout=0.2)
    m0 = MultiHeadAttention(E, 4, **kwargs)
    out0, _ = m0(x, y, y, mask=pad)
    g0 = m0.backward(dout)
    m = MultiHeadAttention(E, 4, backend="dask", **kwargs)
    dy = da.from_array(y, chunks=((0, 2), (3, 0, 3), (4,)))
    out, _ = m(da.from_array(x, chunks=((2,), (5, 0), (2, 2))), dy, dy,
               mask=da.from_array(pad, chunks=((1, 1), 1, 1, (6, 0))))
    grads = m.backward(da.from_array(dout, chunks=((1, 0, 1), (5,), (4,))))
    out, grads, pgrads = dask.compute(out, grads, dict(m.grads), scheduler="sync")
    assert_close(out, out0, host, "out")
    for name, g, gr in zip(("dquery", "dkey", "dvalue"), grads, g0):
        assert_close(g, gr, host, name)
    for name in m0.grads:
        assert_close(pgrads[name], m0.grads[name], host, name)


def _with_empty_chunks(x, seed):
    """``x`` as a dask array whose every axis of length >= 2 has a chunk of length 0 inside."""
    rng = np.random.default_rng(seed)
    chunks = []
    for n in x.shape:
        cut = int(rng.integers(1, n)) if n >= 2 else n
        chunks.append((cut, 0, n - cut) if n >= 2 else (n,))
    return da.from_array(x, chunks=tuple(chunks))


def test_empty_chunks_in_the_primitives_and_the_models():
    """dask's reshape and its max and min fail on some chunks of length 0 (a ValueError from
    its concatenate at compute, or 'cannot reshape'): the reference's masked softmax, linear,
    layer norm, cross-entropy and embedding, called directly, and GPT's forward and backward
    failed on such inputs; each now gives NumPy's numbers (forward and backward)."""
    from npattn import layers as Ly
    from npattn import nn
    from npattn.gpt import GPT
    rng = np.random.default_rng(5)
    s, ds = rng.standard_normal((2, 3, 4, 5)), rng.standard_normal((2, 3, 4, 5))
    x, dx = rng.standard_normal((3, 4, 6)), rng.standard_normal((3, 4, 6))
    w, b, dy = rng.standard_normal((5, 6)), rng.standard_normal(5), rng.standard_normal((3, 4, 5))
    gamma, beta, table = rng.standard_normal(6), rng.standard_normal(6), rng.standard_normal((5, 6))
    ids = rng.integers(0, 5, (3, 4))

    def pair(forward, backward, inputs, grad):  # f: host arrays as they are, or on dask
        return lambda f: (lambda y, c: (y, *backward(f(grad, 9), c)))(
            *forward(*(f(a, n) for n, a in enumerate(inputs))))

    cases = {
        "masked_softmax": pair(F.masked_softmax_forward, F.masked_softmax_backward, [s], ds),
        "linear": pair(F.linear_forward, F.linear_backward, [x, w, b], dy),
        "layer_norm": pair(Ly.layer_norm_forward, Ly.layer_norm_backward, [x, gamma, beta], dx),
        "cross_entropy": lambda f: (lambda y, c: (y, *nn.cross_entropy_backward(0.7, c)))(
            *nn.cross_entropy_forward(f(dy, 0), f(ids, 1))),
        "embedding": pair(nn.embedding_forward, nn.embedding_backward, [ids, table], dx),
    }
    for name, call in cases.items():
        ref = call(lambda a, n: a)
        got = dask.compute(call(_with_empty_chunks), scheduler="sync")[0]
        assert len(got) == len(ref)
        for i, (g, r) in enumerate(zip(got, ref)):
            assert_close(g, r, host, f"{name}: output {i}")
    model = dict(vocab_size=7, block_size=6, d_model=8, n_layer=2, n_head=2, seed=4, dtype="float64")
    ids, dlogits = rng.integers(0, 7, (3, 6)), rng.standard_normal((3, 6, 7))
    m0, m = GPT(**model), GPT(**model, backend="dask")
    logits0, logits = m0.forward(ids), m.forward(_with_empty_chunks(ids, 2))
    m0.backward(dlogits)
    m.backward(_with_empty_chunks(dlogits, 3))
    logits, grads = dask.compute(logits, dict(m.grads), scheduler="sync")
    assert_close(logits, logits0, host, "GPT logits")
    for name in m0.grads:
        assert_close(grads[name], m0.grads[name], host, f"GPT {name}")


@pytest.mark.parametrize("norm_first", [False, True])
def test_empty_chunks_in_the_transformer_blocks_and_the_classifier(norm_first):
    """The encoder and decoder blocks (causal, dropout 0.2 from a seed) and the classifier
    (a padding mask) on dask inputs and upstream gradients with chunks of length 0 give
    NumPy's outputs and gradients."""
    from npattn.classifier import TransformerClassifier
    from npattn.transformer import TransformerBlock, TransformerDecoderBlock
    rng = np.random.default_rng(1)
    x, memory, dout = (rng.standard_normal(s) for s in ((3, 5, 8), (3, 6, 8), (3, 5, 8)))
    kw = dict(d_ff=12, dropout=0.2, norm_first=norm_first, seed=3, dtype="float64")
    for cls, args in ((TransformerBlock, (x,)), (TransformerDecoderBlock, (x, memory))):
        b0, b = cls(8, 2, **kw), cls(8, 2, backend="dask", **kw)
        y0 = b0.forward(*args, is_causal=True)
        g0 = b0.backward(dout)
        y = b.forward(*(_with_empty_chunks(a, i) for i, a in enumerate(args)), is_causal=True)
        g = b.backward(_with_empty_chunks(dout, 7))
        y, g, grads = dask.compute(y, g, dict(b.grads), scheduler="sync")
        assert_close(y, y0, host, f"{cls.__name__}: out")
        for i, (a, r) in enumerate(zip(g if isinstance(g, tuple) else (g,),
                                       g0 if isinstance(g0, tuple) else (g0,))):
            assert_close(a, r, host, f"{cls.__name__}: input gradient {i}")
        for name in b0.grads:
            assert_close(grads[name], b0.grads[name], host, f"{cls.__name__}: {name}")
    xc, pad = rng.standard_normal((4, 5, 3)), rng.random((4, 5)) > 0.3
    pad[1] = False  # an entry that is all padding
    kw = dict(d_model=8, n_head=2, norm_first=norm_first, seed=2, dtype="float64")
    c0, c = TransformerClassifier(3, 5, 4, **kw), TransformerClassifier(3, 5, 4, backend="dask", **kw)
    logits0 = c0.forward(xc, pad)
    dlogits = rng.standard_normal(logits0.shape)
    c0.backward(dlogits)
    logits = c.forward(_with_empty_chunks(xc, 1), _with_empty_chunks(pad, 2))
    c.backward(_with_empty_chunks(dlogits, 3))
    logits, grads = dask.compute(logits, dict(c.grads), scheduler="sync")
    assert_close(logits, logits0, host, "classifier logits")
    for name in c0.grads:
        assert_close(grads[name], c0.grads[name], host, f"classifier {name}")


def test_the_dask_array_module_is_a_backend_like_its_name():
    """``xp=dask.array`` (the module) is the namespace of ``"dask"``: the array API's
    ``arange(..., device=)`` of the compat layer (dask's own has no ``device``)."""
    assert resolve_backend(da) is resolve_backend("dask")
    from npattn import masks
    m = masks.causal(3, 2, xp=da)
    assert isinstance(m, da.Array)
    np.testing.assert_array_equal(m.compute(), np.tril(np.ones((3, 2), bool)))


@pytest.mark.parametrize("kwargs,error,message", [
    ({"repeat": 0}, ValueError, "repeat: expected a positive int, got 0"),
    ({"repeat": 1.5}, TypeError, "repeat: expected a positive int, got float 1.5"),
    ({"workers": [1, 0]}, ValueError, r"workers\[1\]: expected a positive int, got 0"),
])
def test_bench_functions_refuse_a_bad_repeat_or_worker_count(kwargs, error, message, monkeypatch):
    """``run_workers`` and ``run_local`` (public, as the command's ``--repeat`` and
    ``--workers``) refuse what the command refuses, before a cluster starts: repeat=0 ran
    no timed run and failed on the median of none (and left the sums undefined)."""
    from npattn.tools import bench_dask

    shape = bench_dask.parse_shape("1x8x4x2")
    args = {"workers": [1], "repeat": 1, **kwargs}
    monkeypatch.setattr(distributed, "LocalCluster", None)  # no cluster may start
    with pytest.raises(error, match=message):
        bench_dask.run_workers(shape, np.dtype("float32"), 4, 4, args["workers"], args["repeat"])
    if "repeat" in kwargs:
        with pytest.raises(error, match=message):
            bench_dask.run_local(shape, np.dtype("float32"), args["repeat"])


def test_bench_main_s_chunkings_defaults_and_speed_ups(tmp_path, monkeypatch, capsys):
    """The graph rows, coarsest first: at L = 64 with --q-chunk 16 --k-chunk 32, whole rows
    (64, 64), whole query rows by the key chunk (64, 32), the chunks asked for (16, 32) and
    eighths (8, 8), in the dtype asked for. By default the shape is docs/dask.md's
    8x4096x512x8 (not causal), queries and keys come in chunks of 1024, one run on 1 and on
    2 workers, and the speed-up line shows the first count's seconds over each count's (only
    where there are two counts)."""
    from npattn.tools import bench_dask

    asked = []

    def graph_sizes(shape, dtype, chunkings):
        asked.append((shape, dtype, list(chunkings)))
        return [dict(q_chunk=q, k_chunk=k, pairs=0, tasks=0, pair_tasks=0) for q, k in chunkings]

    monkeypatch.setattr(bench_dask, "graph_sizes", graph_sizes)
    path = tmp_path / "r.json"
    assert bench_dask.main(["--shape", "1x64x8x2", "--q-chunk", "16", "--k-chunk", "32",
                            "--dtype", "float32", "--graph-only", "--json", str(path)]) == 0
    assert asked[-1] == ((1, 64, 8, 2, False, None), np.float32, [(64, 64), (64, 32), (16, 32), (8, 8)])
    assert bench_dask.main(["--graph-only", "--json", str(path)]) == 0
    result = json.loads(path.read_text())
    assert (result["shape"], result["q_chunk"], result["k_chunk"]) == ("8x4096x512x8", 1024, 1024)
    assert asked[-1][0] == (8, 4096, 512, 8, False, None) and (1024, 1024) in asked[-1][2]

    calls = []

    def run_workers(shape, dtype, q_chunk, k_chunk, workers, repeat, malloc_trim=False):
        calls.append((workers, repeat))
        return [dict(workers=n, seconds=8.0 / n, speedup=float(n)) for n in workers]

    monkeypatch.setattr(bench_dask, "run_workers", run_workers)
    capsys.readouterr()
    assert bench_dask.main(["--shape", "1x8x4x2", "--no-local"]) == 0
    assert calls[-1] == ([1, 2], 1)
    assert "  speed-up over 1 worker(s): 1: 1.00x, 2: 2.00x" in capsys.readouterr().out.splitlines()
    assert bench_dask.main(["--shape", "1x8x4x2", "--no-local", "--workers", "2"]) == 0
    assert "speed-up" not in capsys.readouterr().out


def test_bench_main_s_memory_check_counts_the_dtype_and_leaves_out_what_is_not_run(monkeypatch, capsys):
    """3 x 1024 x 16 in chunks of 256 keys: the finest graph (eighths, 128 a side) has
    3 * 8 * 8 = 192 pairs, 384 KiB; the in-process run's eight arrays are 1.5 MiB in float32
    and 3 MiB in float64 (and its scores 8 MiB a head). In 2 MiB, float32 runs and float64 is
    refused, unless the in-process run is left out (--no-local)."""
    from npattn.tools import bench_dask, limits

    monkeypatch.setattr(bench_dask, "run_workers", lambda *a, **k: [])
    monkeypatch.setattr(bench_dask, "run_local", lambda *a, **k: dict(seconds=1.0, threads=1))
    monkeypatch.setattr(bench_dask, "graph_sizes", lambda *a: [])
    monkeypatch.setattr(limits, "available_memory", lambda: 2 * 2**20)
    common = ["--shape", "3x1024x16x2", "--k-chunk", "256", "--workers", "1"]
    assert bench_dask.main([*common, "--dtype", "float32"]) == 0
    with pytest.raises(SystemExit) as exc:
        bench_dask.main([*common, "--dtype", "float64"])
    assert exc.value.code == 2 and "needs at least 3.0 MiB" in capsys.readouterr().err
    assert bench_dask.main([*common, "--dtype", "float64", "--no-local", "--json", "-"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert (result["scores_one_head_mib"], result["scores_one_entry_mib"]) == (8.0, 16.0)


def test_the_audit_s_chunked_attention_splits_the_queries_and_the_keys(monkeypatch):
    """Each [chunked] module configuration, self- and cross-attention, hands the chunked
    implementation its queries, keys and values in several chunks along the positions (and one
    batch entry per chunk), so that the module's audit crosses chunk edges on both sides."""
    crossed = set()
    for name, (q, k, v, _) in _chunked_audit_calls(monkeypatch, "mha "):
        assert q.numblocks[-2] > 1, (name, q.chunks)
        assert k.numblocks[-2] > 1 and v.numblocks[-2] > 1, (name, k.chunks)
        assert q.numblocks[0] == k.numblocks[0] == q.shape[0], (name, q.chunks)
        crossed.add(name.split(",")[0])
    assert crossed == {"mha self", "mha cross"}


def test_dask_arrays_of_masked_chunks_are_refused_by_name_not_their_masks_dropped():
    """dask.array.ma's arrays (chunks of numpy.ma.MaskedArray) went through every entry point,
    their masks ignored: a q whose every entry is masked attended as if none were. Refused
    by name, as NumPy's masked arrays are, before anything runs; the data alone is taken."""
    rng = np.random.default_rng(3)
    q, k, v = (rng.standard_normal((1, 2, s, 4)) for s in (3, 5, 5))
    masked = da.ma.masked_array(da.from_array(q, chunks=2), mask=da.ones(q.shape, dtype=bool, chunks=2))
    message = (r"^q: expected a dask array of plain numpy\.ndarray chunks, got a dask array of "
               r"numpy\.ma\.MaskedArray chunks \(npattn would ignore its mask\); pass its data, "
               r"dask\.array\.ma\.getdata\(a\)")
    for forward in (A.sdpa_forward, F.sdpa_forward):
        with pytest.raises(TypeError, match=message):
            forward(masked, da.from_array(k), da.from_array(v))
    out, _ = A.sdpa_forward(da.ma.getdata(masked), da.from_array(k), da.from_array(v))
    want, _ = F.sdpa_forward(q, k, v)
    np.testing.assert_allclose(to_numpy(out), want, rtol=1e-12, atol=1e-14)
