"""The blocked (FlashAttention-2 style) path against the dense path and finite differences.

Every test runs on every backend fixture. Inputs are float64 unless a test
says otherwise; block sizes are drawn smaller than, and not dividing, Lq / Lk.
"""

import math

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import npattn
from npattn import attention as A
from npattn import blocked as Bk
from npattn import functional as F
from npattn import MultiHeadAttention
from npattn.gradcheck import gradcheck

fixture_ok = settings(suppress_health_check=[HealthCheck.function_scoped_fixture])

# mask shapes, relative to (B, H, Lq, Lk); each broadcasts to it
MASK_SHAPES = {
    "full": lambda B, H, Lq, Lk: (B, H, Lq, Lk),
    "2d": lambda B, H, Lq, Lk: (Lq, Lk),
    "1,1,Lq,Lk": lambda B, H, Lq, Lk: (1, 1, Lq, Lk),
    "B,1,Lq,Lk": lambda B, H, Lq, Lk: (B, 1, Lq, Lk),
    "B,1,1,Lk": lambda B, H, Lq, Lk: (B, 1, 1, Lk),
    "H,Lq,1": lambda B, H, Lq, Lk: (H, Lq, 1),
    "Lk": lambda B, H, Lq, Lk: (Lk,),
}


def make_mask(rng, kind, shape, empty_row):
    """A boolean or floating (-inf) mask of ``shape``; ``empty_row`` masks all of query row 0."""
    if kind == "none":
        return None
    allowed = rng.random(shape) > 0.3  # [shape] bool
    if empty_row and len(shape) >= 2 and shape[-2] > 1:
        allowed[..., 0, :] = False  # query row 0 attends nothing
    if kind == "bool":
        return allowed
    return np.where(allowed, rng.standard_normal(shape), -np.inf)  # [shape] float, -inf = masked


@st.composite
def cases(draw):
    B = draw(st.integers(1, 2))
    H = draw(st.integers(2, 3))
    Lq = draw(st.integers(2, 9))
    Lk = draw(st.integers(2, 9).filter(lambda n: n != Lq))
    Dh = draw(st.integers(2, 4))
    return dict(
        B=B,
        H=H,
        Lq=Lq,
        Lk=Lk,
        Dh=Dh,
        block_q=draw(st.integers(1, max(1, Lq - 1))),
        block_k=draw(st.integers(1, max(1, Lk - 1))),
        mask_kind=draw(st.sampled_from(["none", "bool", "float"])),
        mask_shape=draw(st.sampled_from(sorted(MASK_SHAPES))),
        empty_row=draw(st.booleans()),
        is_causal=draw(st.booleans()),
        dropout=draw(st.sampled_from(["none", "full", "1,H,Lq,Lk"])),
        seed=draw(st.integers(0, 2**16)),
    )


def build(case, to_xp, dtype=np.float64):
    """q, k, v, dout and the keyword arguments of one case, on the backend under test."""
    rng = np.random.default_rng(case["seed"])
    B, H, Lq, Lk, Dh = (case[n] for n in ("B", "H", "Lq", "Lk", "Dh"))
    q = rng.standard_normal((B, H, Lq, Dh)).astype(dtype)
    k = rng.standard_normal((B, H, Lk, Dh)).astype(dtype)
    v = rng.standard_normal((B, H, Lk, Dh)).astype(dtype)
    dout = rng.standard_normal((B, H, Lq, Dh)).astype(dtype)
    mask_shape = MASK_SHAPES[case["mask_shape"]](B, H, Lq, Lk)
    mask = make_mask(rng, case["mask_kind"], mask_shape, case["empty_row"])
    kw = dict(is_causal=case["is_causal"])
    if mask is not None:
        kw["mask"] = to_xp(mask if mask.dtype == bool else mask.astype(dtype))
    if case["dropout"] != "none":
        shape = (B, H, Lq, Lk) if case["dropout"] == "full" else (1, H, Lq, Lk)
        kw["dropout_p"] = 0.3
        kw["dropout_mask"] = to_xp(rng.random(shape) >= 0.3)
    return to_xp(q), to_xp(k), to_xp(v), to_xp(dout), kw


def assert_close(a, b, to_np, what, rtol=1e-10, atol=1e-12):
    a, b = to_np(a), to_np(b)
    assert a.shape == b.shape, f"{what}: shapes {a.shape} vs {b.shape}"
    assert np.all(np.isfinite(a)), f"{what}: not finite"
    np.testing.assert_allclose(a, b, rtol=rtol, atol=atol, err_msg=what)


# --------------------------------------------------------------------------
# blocked == dense


@fixture_ok
@given(case=cases())
def test_blocked_matches_dense(case, xp, to_xp, to_np):
    q, k, v, dout, kw = build(case, to_xp)
    out_d, cache_d = F.sdpa_forward(q, k, v, **kw)
    out_b, cache_b = Bk.sdpa_blocked_forward(
        q, k, v, block_q=case["block_q"], block_k=case["block_k"], **kw
    )
    assert_close(out_b, out_d, to_np, "out")
    grads_d = F.sdpa_backward(dout, cache_d)
    grads_b = Bk.sdpa_blocked_backward(dout, cache_b)
    for name, gb, gd in zip(("dq", "dk", "dv", "dmask"), grads_b, grads_d):
        if gd is None:
            assert gb is None, f"{name}: expected None"
        else:
            assert_close(gb, gd, to_np, name)
    # a float mask gets a gradient of its own shape; the dense path says so too
    if "mask" in kw and case["mask_kind"] == "float":
        assert tuple(grads_b[3].shape) == tuple(kw["mask"].shape)


@pytest.mark.parametrize("mask_kind", ["bool", "float"])
@pytest.mark.parametrize("mask_shape", sorted(MASK_SHAPES))
def test_every_mask_shape(mask_shape, mask_kind, xp, to_xp, to_np):
    """Each broadcast form, with several blocks along every axis (dmask summed across blocks)."""
    case = dict(
        B=2,
        H=2,
        Lq=7,
        Lk=8,
        Dh=3,
        block_q=3,
        block_k=3,
        mask_kind=mask_kind,
        mask_shape=mask_shape,
        empty_row=True,
        is_causal=True,
        dropout="full",
        seed=10,
    )
    q, k, v, dout, kw = build(case, to_xp)
    out_d, cache_d = F.sdpa_forward(q, k, v, **kw)
    out_b, cache_b = Bk.sdpa_blocked_forward(q, k, v, block_q=3, block_k=3, **kw)
    assert_close(out_b, out_d, to_np, "out")
    grads_b = Bk.sdpa_blocked_backward(dout, cache_b)
    grads_d = F.sdpa_backward(dout, cache_d)
    for name, gb, gd in zip(("dq", "dk", "dv", "dmask"), grads_b, grads_d):
        if mask_kind == "bool" and name == "dmask":
            assert gb is None and gd is None
        else:
            assert_close(gb, gd, to_np, name)


@pytest.mark.parametrize("is_causal", [False, True])
def test_fully_masked_rows_are_zero_without_nan(is_causal, xp, to_xp, to_np):
    rng = np.random.default_rng(3)
    B, H, Lq, Lk, Dh = 2, 2, 7, 5, 3
    q, k, v, dout = (
        to_xp(rng.standard_normal(s))
        for s in [(B, H, Lq, Dh), (B, H, Lk, Dh), (B, H, Lk, Dh), (B, H, Lq, Dh)]
    )
    mask = np.where(rng.random((B, 1, Lq, Lk)) > 0.3, 0.5, -np.inf)
    mask[:, :, 1, :] = -np.inf  # row 1 attends nothing
    mask[1, :, 4:, :] = -np.inf  # rows 4.. of batch 1 (a whole block of 3) attend nothing
    with np.errstate(all="raise"):  # no transient inf - inf, 0 / 0 or log(0) on NumPy
        out, cache = Bk.sdpa_blocked_forward(
            q, k, v, mask=to_xp(mask), is_causal=is_causal, block_q=3, block_k=2
        )
        dq, dk, dv, dmask, _ = Bk.sdpa_blocked_backward(dout, cache)
        lse = to_np(cache.lse)  # -inf on the empty rows, without log(0)
    out, dq, dmask = to_np(out), to_np(dq), to_np(dmask)
    for a in (out, dq, to_np(dk), to_np(dv), dmask, to_np(cache.m), to_np(cache.l)):
        assert np.all(np.isfinite(a))
    assert np.all(to_np(cache.l)[:, :, 1] == 0.0) and np.all(to_np(cache.m)[:, :, 1] == 0.0)
    assert np.all(out[:, :, 1] == 0.0) and np.all(dq[:, :, 1] == 0.0)
    assert np.all(out[1, :, 4:] == 0.0) and np.all(dq[1, :, 4:] == 0.0)
    assert np.all(dmask[:, :, 1] == 0.0)
    assert np.any(out[0, :, 0] != 0.0)  # the others are not all zero
    ref, cache_ref = F.sdpa_forward(q, k, v, mask=to_xp(mask), is_causal=is_causal)
    assert_close(out, ref, to_np, "out")
    lse_ref = to_np(cache_ref.lse)  # [B, H, Lq]
    assert np.all(lse[:, :, 1] == -np.inf) and np.all(lse[1, :, 4:] == -np.inf)
    np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(lse_ref))
    ok = np.isfinite(lse_ref)
    np.testing.assert_allclose(lse[ok], lse_ref[ok], rtol=1e-12)


def test_row_max_and_row_sum_are_saved(xp, to_xp, to_np):
    """The documented step 9: per row m = max_j z_j and l = sum_j exp(z_j - m), kept apart
    (m + log(l) is the log-sum-exp); both 0 for a row with nothing to attend."""
    rng = np.random.default_rng(4)
    B, H, Lq, Lk, Dh = 2, 2, 6, 9, 3
    q, k, v = (rng.standard_normal(s) for s in [(B, H, Lq, Dh), (B, H, Lk, Dh), (B, H, Lk, Dh)])
    mask = rng.random((Lq, Lk)) > 0.4
    mask[2] = False
    _, cache = Bk.sdpa_blocked_forward(
        to_xp(q), to_xp(k), to_xp(v), mask=to_xp(mask), scale=0.7, block_q=4, block_k=2
    )
    z = np.where(mask, q @ np.swapaxes(k, -1, -2) * 0.7, -np.inf)  # [B, H, Lq, Lk]
    m = np.max(z, axis=-1, keepdims=True)  # [B, H, Lq, 1]
    m[:, :, 2] = 0.0
    l = np.sum(np.exp(z - m), axis=-1, keepdims=True)  # [B, H, Lq, 1]; 0 for row 2
    assert np.all(l[:, :, 2] == 0.0)
    np.testing.assert_allclose(to_np(cache.m), m, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(to_np(cache.l), l, rtol=1e-12, atol=1e-12)
    with np.errstate(divide="ignore"):
        lse = np.log(np.sum(np.exp(z), axis=-1, keepdims=True))  # [B, H, Lq, 1]
    ok = l > 0
    np.testing.assert_allclose((to_np(cache.m) + np.log(np.where(ok, to_np(cache.l), 1.0)))[ok],
                               lse[ok], rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("impl", ["blocked", "reference", "numpy"])
@pytest.mark.parametrize("with_sinks", [False, True])
def test_a_row_whose_scores_are_all_zero_keeps_its_lse_and_dlse(with_sinks, impl, backend,
                                                                to_xp, to_np):
    """A query of zeros scores 0 against every key: its row maximum m is 0, yet it attends all
    Lk keys (l = Lk, plus exp(sink) beside a sink <= 0). Its lse is log(l), not the -inf of a row
    with nothing to attend, and dlse reaches the gradients: lse against log-sum-exp of the
    scores (and sink), the gradients (dsinks too) against central differences of
    <out, dout> + <lse, dlse> along a random direction, in float64. On every implementation
    that takes the case (the NumPy kernel: NumPy arrays, no sinks)."""
    if impl == "numpy" and (with_sinks or backend != "numpy"):
        pytest.skip("the NumPy kernel takes NumPy arrays without kernel options")
    rng = np.random.default_rng(14)
    B, H, Lq, Lk, Dh, Dv = 2, 2, 5, 7, 3, 2
    q = rng.standard_normal((B, H, Lq, Dh))
    q[:, :, 2] = 0.0  # query row 2 scores exactly 0 against every key
    k, v = rng.standard_normal((B, H, Lk, Dh)), rng.standard_normal((B, H, Lk, Dv))
    sinks = np.array([0.0, -0.5]) if with_sinks else None  # [H]: row 2's m is 0 in both heads
    dout, dlse = rng.standard_normal((B, H, Lq, Dv)), rng.standard_normal((B, H, Lq))

    def forward(q, k, v, sinks):
        blocks = dict(block_q=2, block_k=3) if impl == "blocked" else {}
        return A.sdpa_forward(to_xp(q), to_xp(k), to_xp(v), impl=impl, **blocks,
                              sinks=None if sinks is None else to_xp(sinks))

    def loss(q, k, v, sinks):
        out, cache = forward(q, k, v, sinks)
        return float(np.sum(to_np(out) * dout) + np.sum(to_np(cache.lse) * dlse))

    _, cache = forward(q, k, v, sinks)
    s = q @ np.swapaxes(k, -1, -2) / math.sqrt(Dh)  # [B, H, Lq, Lk]
    assert np.all(s[:, :, 2] == 0.0)
    e_sink = np.zeros((H, 1)) if sinks is None else np.exp(sinks)[:, None]  # [H, 1]
    lse = np.log(np.sum(np.exp(s), axis=-1) + e_sink)  # [B, H, Lq]
    np.testing.assert_allclose(to_np(cache.lse), lse, rtol=1e-12)
    row2 = np.broadcast_to(np.log(Lk + e_sink[:, 0]), (B, H))  # log(l) with m = 0
    np.testing.assert_allclose(to_np(cache.lse)[:, :, 2], row2, rtol=1e-12)
    g = A.sdpa_backward(to_xp(dout), cache, dlse=to_xp(dlse))
    args, grads = [q, k, v], [g.dq, g.dk, g.dv]
    if with_sinks:
        args, grads = args + [sinks], grads + [g.dsinks]
    t = [rng.standard_normal(a.shape) for a in args]  # the direction

    def loss_at(h):  # the loss at args + h * t
        moved = [a + h * d for a, d in zip(args, t)]
        return loss(*moved[:3], moved[3] if with_sinks else None)

    eps = 1e-6
    numeric = (loss_at(eps) - loss_at(-eps)) / (2 * eps)
    analytic = sum(float(np.sum(to_np(gr) * d)) for gr, d in zip(grads, t))
    assert abs(analytic - numeric) <= 1e-7 * max(1.0, abs(numeric)), (analytic, numeric)


# --------------------------------------------------------------------------
# finite differences on the blocked pair itself


@pytest.mark.parametrize("mask_kind", ["float", "bool"])
def test_blocked_gradcheck(mask_kind, xp, to_xp, to_np):
    rng = np.random.default_rng(5)
    B, H, Lq, Lk, Dh = 2, 2, 5, 4, 3
    q, k, v = (
        to_xp(rng.standard_normal(s)) for s in [(B, H, Lq, Dh), (B, H, Lk, Dh), (B, H, Lk, Dh)]
    )
    allowed = rng.random((B, 1, Lq, Lk)) > 0.3
    allowed[0, 0, 3] = False  # a row with nothing to attend
    if mask_kind == "float":
        mask = to_xp(np.where(allowed, rng.standard_normal((B, 1, Lq, Lk)), -np.inf))
    else:
        mask = to_xp(allowed)
    keep = to_xp(rng.random((B, H, Lq, Lk)) >= 0.25)

    def forward(q, k, v, mask):
        return Bk.sdpa_blocked_forward(
            q,
            k,
            v,
            mask=mask,
            is_causal=True,
            dropout_p=0.25,
            dropout_mask=keep,
            block_q=2,
            block_k=3,
        )

    report = gradcheck(
        forward,
        Bk.sdpa_blocked_backward,
        [q, k, v, mask],
        names=["q", "k", "v", "mask"],
        mode="full",
        rtol=1e-6,
        atol=1e-9,
    )
    assert report.ok, str(report)
    assert {r.name for r in report.inputs} == (
        {"q", "k", "v", "mask"} if mask_kind == "float" else {"q", "k", "v"}
    )


# --------------------------------------------------------------------------
# dropout drawn from a generator, block by block


def test_generator_dropout_is_deterministic_and_matches_dense_with_its_mask(xp, to_xp, to_np):
    rng = np.random.default_rng(6)
    B, H, Lq, Lk, Dh = 2, 2, 7, 5, 3
    q, k, v, dout = (
        to_xp(rng.standard_normal(s))
        for s in [(B, H, Lq, Dh), (B, H, Lk, Dh), (B, H, Lk, Dh), (B, H, Lq, Dh)]
    )
    kw = dict(is_causal=True, dropout_p=0.4, block_q=3, block_k=2)
    out1, cache1 = Bk.sdpa_blocked_forward(q, k, v, rng=11, **kw)
    out2, _ = Bk.sdpa_blocked_forward(q, k, v, rng=np.random.default_rng(11), **kw)
    assert_close(out1, out2, to_np, "same seed", rtol=0, atol=0)
    keep = Bk.blocked_keep_mask(cache1)
    kept = to_np(keep)
    assert kept.shape == (B, H, Lq, Lk) and 0 < kept.mean() < 1  # some kept, some dropped
    # the reference draws the same mask from the same seed, whatever the block sizes
    out_r, cache_r = F.sdpa_forward(q, k, v, is_causal=True, dropout_p=0.4, rng=11)
    np.testing.assert_array_equal(to_np(A.dropout_keep_mask(cache_r)), kept)
    np.testing.assert_array_equal(to_np(A.dropout_keep_mask(cache1)), kept)
    assert_close(out1, out_r, to_np, "out, reference from the seed")
    _, cache4 = Bk.sdpa_blocked_forward(q, k, v, rng=11, **{**kw, "block_q": 7, "block_k": 1})
    np.testing.assert_array_equal(to_np(Bk.blocked_keep_mask(cache4)), kept)
    out_d, cache_d = F.sdpa_forward(q, k, v, is_causal=True, dropout_p=0.4, dropout_mask=keep)
    assert_close(out1, out_d, to_np, "out")
    for name, gb, gd in zip(
        "qkv", Bk.sdpa_blocked_backward(dout, cache1), F.sdpa_backward(dout, cache_d)
    ):
        assert_close(gb, gd, to_np, "d" + name)
    out3, _ = Bk.sdpa_blocked_forward(q, k, v, rng=12, **kw)
    assert not np.allclose(to_np(out3), to_np(out1))  # another seed, another mask

    # the gradient of the generator path, by finite differences (an int seed redraws the same mask)
    report = gradcheck(
        lambda q, k, v: Bk.sdpa_blocked_forward(q, k, v, rng=11, **kw),
        lambda d, c: Bk.sdpa_blocked_backward(d, c)[:3],
        [q, k, v],
        mode="vjp",
    )
    assert report.ok, str(report)


def test_blocked_keep_mask_is_none_unless_the_forward_drew_one(xp, to_xp, to_np):
    """``blocked_keep_mask`` returns the mask a forward drew from its generator, and None for a
    forward without dropout or with the caller's own ``dropout_mask`` (it drew nothing)."""
    rng = np.random.default_rng(29)
    q, k = to_xp(rng.standard_normal((2, 2, 4, 3))), to_xp(rng.standard_normal((2, 2, 5, 3)))
    keep = to_xp(rng.random((2, 2, 4, 5)) >= 0.5)
    _, plain = Bk.sdpa_blocked_forward(q, k, k, block_q=3, block_k=2)
    _, given = Bk.sdpa_blocked_forward(q, k, k, dropout_p=0.5, dropout_mask=keep, block_q=3,
                                       block_k=2)
    _, drawn = Bk.sdpa_blocked_forward(q, k, k, dropout_p=0.5, rng=3, block_q=3, block_k=2)
    assert Bk.blocked_keep_mask(plain) is None
    assert Bk.blocked_keep_mask(given) is None
    assert tuple(Bk.blocked_keep_mask(drawn).shape) == (2, 2, 4, 5)


@pytest.mark.parametrize("q_lead", [(1, 2), (2,)], ids=["batch-of-1", "no-batch-axis"])
def test_generator_dropout_over_broadcast_leading_axes_is_the_references(q_lead, xp, to_xp, to_np):
    """q broadcast over the batch (k and v carry it): the keep-mask is drawn over the scores'
    leading axes (B, H), one mask per batch entry, as the reference draws it from the same
    seed, and out and every gradient are the reference's."""
    rng = np.random.default_rng(13)
    B, H, Lq, Lk, Dh, Dv = 3, 2, 5, 7, 3, 2
    q = to_xp(rng.standard_normal(q_lead + (Lq, Dh)))  # [1, H, Lq, Dh] or [H, Lq, Dh]
    k, v = (to_xp(rng.standard_normal((B, H, Lk, d))) for d in (Dh, Dv))  # [B, H, Lk, D]
    dout = to_xp(rng.standard_normal((B, H, Lq, Dv)))  # [B, H, Lq, Dv]
    out_b, cache_b = Bk.sdpa_blocked_forward(q, k, v, dropout_p=0.4, rng=11, block_q=2, block_k=3)
    out_r, cache_r = F.sdpa_forward(q, k, v, dropout_p=0.4, rng=11)
    kept = to_np(A.dropout_keep_mask(cache_r))  # [B, H, Lq, Lk]
    assert kept.shape == (B, H, Lq, Lk) and not np.array_equal(kept[0], kept[1])
    assert_close(out_b, out_r, to_np, "out")
    np.testing.assert_array_equal(to_np(Bk.blocked_keep_mask(cache_b)), kept)
    grads_r = F.sdpa_backward(dout, cache_r)
    for name, gb, gr in zip(("dq", "dk", "dv"), Bk.sdpa_blocked_backward(dout, cache_b), grads_r):
        assert_close(gb, gr, to_np, name)


def test_a_failed_forward_leaves_the_callers_generator_as_it_was(monkeypatch):
    """sdpa_blocked_forward draws its dropout key before the blocks run; should a block fail
    (here a MemoryError from making its keep-mask), the caller's generator is put back, as
    ``functional.sdpa_forward`` and the dispatcher put it back, and the retry draws the mask
    and gives the output of a fresh generator of the same seed."""
    rng = np.random.default_rng(33)
    q, k, v = (rng.standard_normal(s) for s in ((2, 2, 5, 3), (2, 2, 7, 3), (2, 2, 7, 2)))
    kw = dict(dropout_p=0.5, block_q=2, block_k=3)

    def out_of_memory(*args, **kwargs):
        raise MemoryError("out of memory")

    gen = np.random.default_rng(4)
    state = gen.bit_generator.state
    monkeypatch.setattr(Bk, "keyed_keep_mask_on", out_of_memory)
    with pytest.raises(MemoryError):
        Bk.sdpa_blocked_forward(q, k, v, rng=gen, **kw)
    assert gen.bit_generator.state == state
    monkeypatch.undo()
    out, _ = Bk.sdpa_blocked_forward(q, k, v, rng=gen, **kw)
    out_fresh, _ = Bk.sdpa_blocked_forward(q, k, v, rng=np.random.default_rng(4), **kw)
    np.testing.assert_array_equal(out, out_fresh)


# --------------------------------------------------------------------------
# half precision


def test_float16_is_computed_in_float32(xp, to_xp, to_np, backend):
    if not hasattr(xp, "float16"):
        pytest.skip(f"{backend} has no float16")
    rng = np.random.default_rng(7)
    B, H, Lq, Lk, Dh = 2, 2, 9, 6, 4
    arrays = [
        rng.standard_normal(s)
        for s in [(B, H, Lq, Dh), (B, H, Lk, Dh), (B, H, Lk, Dh), (B, H, Lq, Dh)]
    ]
    q, k, v, dout = (to_xp(a.astype(np.float16)) for a in arrays)
    mask = to_xp(np.where(rng.random((Lq, Lk)) > 0.3, 0.25, -np.inf).astype(np.float16))
    out_b, cb = Bk.sdpa_blocked_forward(q, k, v, mask=mask, is_causal=True, block_q=4, block_k=4)
    out_d, cd = F.sdpa_forward(q, k, v, mask=mask, is_causal=True)
    assert out_b.dtype == xp.float16 and cb.m.dtype == xp.float32 and cb.l.dtype == xp.float32
    assert cb.q.dtype == xp.float32 and cb.out.dtype == xp.float32
    np.testing.assert_allclose(
        to_np(out_b).astype(np.float64), to_np(out_d).astype(np.float64), atol=2e-3
    )
    for gb, gd in zip(Bk.sdpa_blocked_backward(dout, cb)[:4], F.sdpa_backward(dout, cd)[:4]):
        assert gb.dtype == xp.float16
        np.testing.assert_allclose(
            to_np(gb).astype(np.float64), to_np(gd).astype(np.float64), atol=5e-3
        )


def test_float16_softmax_gradient_cancels_in_float32(xp, to_xp, to_np, backend):
    """Values that share an offset (v = 4 + 0.01 noise) make ``dp - delta`` cancel: both are
    about ``dout . 4``, their difference hundreds of times smaller. ``delta = rowsum(dout * out)``
    must use the float32 out the forward saved: from out rounded to float16 (spacing 2^-8 at
    4) the error of delta is as large as ``dp - delta`` itself. dq, dk and dv are checked
    against float64 attention of the same float16 values, to float16's rounding."""
    if not hasattr(xp, "float16"):
        pytest.skip(f"{backend} has no float16")
    rng = np.random.default_rng(31)
    B, H, Lq, Lk, Dh, Dv = 2, 2, 6, 7, 4, 4
    q, k, dout = (rng.standard_normal(s).astype(np.float16)
                  for s in ((B, H, Lq, Dh), (B, H, Lk, Dh), (B, H, Lq, Dv)))
    v = (4.0 + 0.01 * rng.standard_normal((B, H, Lk, Dv))).astype(np.float16)  # [B, H, Lk, Dv]
    _, cache = Bk.sdpa_blocked_forward(to_xp(q), to_xp(k), to_xp(v), block_q=4, block_k=3)
    grads = Bk.sdpa_blocked_backward(to_xp(dout), cache)
    _, c64 = F.sdpa_forward(*(a.astype(np.float64) for a in (q, k, v)))
    for name, g, g64 in zip(("dq", "dk", "dv"), grads, F.sdpa_backward(dout.astype(np.float64), c64)):
        assert g.dtype == xp.float16
        err = np.max(np.abs(to_np(g).astype(np.float64) - g64)) / np.max(np.abs(g64))
        assert err < 2e-3, f"{name}: relative error {err:.2g}"


# --------------------------------------------------------------------------
# choosing the path, and the module

# impl='blocked' with need_weights=True: the message whole (argument, value received, what to pass)
BLOCKED_KEEPS_NO_WEIGHTS = (r"^impl='blocked' cannot return attention weights \(it never forms them\); "
                            r"use need_weights=False, or impl='dense', 'reference', 'numpy' or 'auto'$")


def test_select_impl():
    """The rule of ``impl="auto"``, on arrays that hold no memory (broadcast views)."""

    def big(*shape):
        return np.broadcast_to(np.zeros((), dtype=np.float32), shape)

    def select(impl, shape, **kw):
        return A.select_impl(impl, big(*shape), big(*shape), big(*shape), **kw)

    n = math.isqrt(A.AUTO_BLOCKED_MIN_SCORES) + 1
    assert select("auto", (1, 1, 512, 8)) == "numpy"  # dense: the NumPy kernel for NumPy arrays
    assert select("auto", (1, 1, n, 8)) == "blocked"
    assert select("auto", (1, 1, n, 8), need_weights=True) == "numpy"
    many = A.AUTO_BLOCKED_MAX_DENSE_SCORES // (512 * 512)  # heads of 512 x 512 scores
    assert select("auto", (1, many - 1, 512, 8)) == "numpy"
    assert select("auto", (1, many, 512, 8)) == "blocked"
    assert select("auto", (1, many, 512, 8), need_weights=True) == "numpy"
    assert select("dense", (1, 1, n, 8)) == "numpy"
    assert select("auto", (1, 512, 8)) == "reference"  # 3-D: not the kernel's layout
    assert select("blocked", (2, 3)) == "blocked"
    with pytest.raises(ValueError, match="^impl: expected 'auto', 'dense', 'reference', 'numpy', 'blocked' "
                                         "or 'chunked', got 'flash'$"):
        select("flash", (2, 3))
    with pytest.raises(ValueError, match=BLOCKED_KEEPS_NO_WEIGHTS):
        select("blocked", (2, 3), need_weights=True)


def test_module_blocked_matches_dense(xp, backend, to_xp, to_np):
    rng = np.random.default_rng(8)
    mha = npattn.MultiHeadAttention(12, 3, dtype="float64", seed=1, backend=backend, impl="blocked")
    x = to_xp(rng.standard_normal((2, 7, 12)))
    kv = to_xp(rng.standard_normal((2, 5, 12)))
    dout = to_xp(rng.standard_normal((2, 7, 12)))
    mask = to_xp(np.where(rng.random((2, 1, 7, 5)) > 0.3, 0.0, -np.inf))
    out_b, _ = mha(x, kv, kv, mask=mask, is_causal=True)
    assert isinstance(mha._cache.sdpa, Bk.BlockedSDPACache)
    no_weights = (r"^cache: expected the cache of a dense implementation .*, got BlockedSDPACache: "
                  r"the blocked implementation keeps no attention weights$")
    with pytest.raises(ValueError, match=no_weights):
        A.weights(mha._cache.sdpa)
    grads_b = mha.backward(dout)
    params_b = dict(mha.grads)
    out_d, _ = mha(x, kv, kv, mask=mask, is_causal=True, impl="dense")
    assert not isinstance(mha._cache.sdpa, Bk.BlockedSDPACache)  # dense (reference or fast)
    grads_d = mha.backward(dout)
    assert_close(out_b, out_d, to_np, "out")
    for gb, gd in zip(grads_b, grads_d):
        assert_close(gb, gd, to_np, "input grad")
    for name in params_b:
        assert_close(params_b[name], mha.grads[name], to_np, name)
    with pytest.raises(ValueError, match=BLOCKED_KEEPS_NO_WEIGHTS):
        mha(x, kv, kv, need_weights=True)
    out_w, w = mha(x, kv, kv, need_weights=True, impl="auto", average_attn_weights=False)  # auto: dense
    assert tuple(w.shape) == (2, 3, 7, 5)
    with pytest.raises(ValueError, match="^impl: expected 'auto', 'dense', 'reference', 'numpy', 'blocked' "
                                         "or 'chunked', got 'fast'$"):
        npattn.MultiHeadAttention(12, 3, impl="fast")


def test_bad_arguments_name_themselves():
    rng = np.random.default_rng(9)
    q, k = rng.standard_normal((2, 2, 4, 3)), rng.standard_normal((2, 2, 5, 3))
    with pytest.raises(ValueError, match="^block_q: expected a positive int, got 0$"):
        Bk.sdpa_blocked_forward(q, k, k, block_q=0)
    # a float is the wrong kind, as in the dispatcher
    with pytest.raises(TypeError, match=r"^block_k: expected a positive int, got float 2\.5$"):
        Bk.sdpa_blocked_forward(q, k, k, block_k=2.5)
    with pytest.raises(ValueError, match=r"^mask: expected a shape that broadcasts to the scores "
                                         r".*= \(2, 2, 4, 5\) .*got shape \(4, 4\)$"):
        Bk.sdpa_blocked_forward(q, k, k, mask=np.ones((4, 4), dtype=bool))
    with pytest.raises(ValueError, match=r"^dropout_mask: expected a shape that broadcasts to the scores "
                                         r".*= \(2, 2, 4, 5\) .*got shape \(3, 4, 5\)$"):
        Bk.sdpa_blocked_forward(q, k, k, dropout_p=0.1, dropout_mask=np.ones((3, 4, 5), dtype=bool))
    with pytest.raises(TypeError, match=r"^dropout_mask: expected a bool keep-mask \(True = keep\), "
                                        r"got dtype float64$"):
        Bk.sdpa_blocked_forward(q, k, k, dropout_p=0.1, dropout_mask=np.ones((4, 5)))
    with pytest.raises(ValueError, match=r"^dropout_p: expected a drop probability in \[0, 1\), got 1\.0$"):
        Bk.sdpa_blocked_forward(q, k, k, dropout_p=1.0)
    with pytest.raises(ValueError, match=r"^k: expected last axis 3 \(that of q\), "
                                         r"got shape \(2, 2, 5, 2\)$"):
        Bk.sdpa_blocked_forward(q, k[..., :2], k)


def test_bool_block_lengths_are_refused():
    """True is an int to Python but no block length: a TypeError names the argument (the
    wrong kind, as n_head=True to the module)."""
    rng = np.random.default_rng(9)
    q, k = rng.standard_normal((2, 2, 4, 3)), rng.standard_normal((2, 2, 5, 3))
    for name in ("block_q", "block_k"):
        with pytest.raises(TypeError, match=f"{name}: expected a positive int, got bool True"):
            Bk.sdpa_blocked_forward(q, k, k, **{name: True})


def test_blocked_cache_checks_block_lengths_as_the_public_entry_does():
    """``blocked_cache`` (for callers that run the blocked steps on pieces, as npattn.chunked)
    refuses a bool block length with the public entry's TypeError and a zero with its
    ValueError, and uses a NumPy int as a Python int: in int8, 100 + np.int8(100) wraps to
    -56, which would leave query rows 100..149 (and keys 100..149) out of every block."""
    rng = np.random.default_rng(23)
    B, H, L, Dh = 1, 2, 150, 2
    q, k, v, dout = (rng.standard_normal((B, H, L, Dh)) for _ in range(4))
    kw = dict(mask=None, is_causal=False, scale=None, dropout_p=0.0, dropout_mask=None, groups=1)
    with pytest.raises(TypeError, match=r"^block_q: expected a positive int, got bool True"):
        Bk.blocked_cache(q, k, v, block_q=True, **kw)
    with pytest.raises(ValueError, match=r"^block_k: expected a positive int, got 0"):
        Bk.blocked_cache(q, k, v, block_k=0, **kw)
    out_r, cache_r = F.sdpa_forward(q, k, v)
    _, cache_b = Bk.sdpa_blocked_forward(q, k, v)
    c = Bk.with_rows(Bk.blocked_cache(q, k, v, block_q=np.int8(100), block_k=np.int8(100), **kw),
                     *Bk.rows_of(cache_b))
    assert type(c.block_q) is int and type(c.block_k) is int
    for name, gb, gr in zip(("dq", "dk", "dv"), Bk.sdpa_blocked_backward(dout, c),
                            F.sdpa_backward(dout, cache_r)):
        assert_close(gb, gr, to_np=np.asarray, what=name)


def test_isolated_bench_smoke():
    """``npattn bench --isolated`` runs a blocked case in a child process with the block sizes asked for."""
    from npattn.tools.bench import Shape, measure_isolated

    r = measure_isolated(Shape(1, 40, 16, 2, True), impl="blocked", block_q=16, block_k=24,
                         gemm_n=0)
    assert (r["shape"], r["impl"], r["block_q"], r["block_k"]) == ("1x40x16x2c", "blocked", 16, 24)
    assert r["ms"] > 0 and r["peak_rss_mib"] >= r["rss_before_mib"] > 0
    assert r["gemm_gflops"] is None


def test_default_blocks_are_the_blocks_a_call_and_the_bench_run_with():
    """default_blocks states the blocked path's choice once: a call's cache holds its pair for
    every window and given block, and bench's case_blocks reports the same."""
    from npattn.tools.bench import Shape, case_blocks

    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((1, 2, 9, 4)) for _ in range(3))
    for window, left in ((None, None), ((3, 0), 3), ((None, 2), None), ((2, None), 2)):
        for bq, bk in ((None, None), (4, None), (None, 5), (4, 5)):
            _, cache = Bk.sdpa_blocked_forward(q, k, v, window=window, block_q=bq, block_k=bk)
            assert (cache.block_q, cache.block_k) == Bk.default_blocks(bq, bk, left)
    assert Bk.default_blocks(None, None, None) == (Bk.DEFAULT_BLOCK_Q, Bk.DEFAULT_BLOCK_K)
    assert Bk.default_blocks(None, None, 0) == (Bk.DEFAULT_BLOCK_Q, Bk.WINDOW_BLOCK_K)
    for window in (None, 3):
        for shape, impls in ((Shape(1, 40, 16, 2, False, window=window), ("blocked",)),
                             (Shape(1, 2**13, 16, 2, False, window=window), ("blocked", "auto"))):
            for impl in impls:  # auto: where it takes the blocked path
                assert case_blocks(shape, impl) == Bk.default_blocks(None, None, window)
                assert case_blocks(shape, impl, 16, None) == Bk.default_blocks(16, None, window)
            assert case_blocks(shape, "dense") == (None, None)


def test_default_blocks_are_the_documented_ones():
    """128 query rows by 512 keys per block, 128 by 128 with a bounded window (the sizes
    docs/dask.md gives), as a call's cache records them."""
    rng = np.random.default_rng(1)
    q, k, v = (rng.standard_normal((1, 1, 4, 2)) for _ in range(3))
    assert Bk.default_blocks(None, None, None) == (128, 512)
    assert Bk.default_blocks(None, None, 3) == (128, 128)
    _, cache = Bk.sdpa_blocked_forward(q, k, v)
    assert (cache.block_q, cache.block_k) == (128, 512)
    _, cache = Bk.sdpa_blocked_forward(q, k, v, window=(3, 0))
    assert (cache.block_q, cache.block_k) == (128, 128)


@pytest.mark.parametrize("is_causal", [False, True])
def test_memory_is_linear_in_length(is_causal):
    """No [B, H, Lq, Lk] array: NumPy reports its allocations to tracemalloc.

    With L = 2048 one float64 score tensor of 2 heads is 64 MiB; the blocked
    forward+backward (64 x 256 blocks, a floating (B, 1, 1, Lk) mask) must
    peak far below it. NumPy only: other libraries do not report to tracemalloc.
    """
    import tracemalloc

    rng = np.random.default_rng(12)
    B, H, L, Dh = 1, 2, 2048, 8
    q, k, v, dout = (rng.standard_normal((B, H, L, Dh)) for _ in range(4))
    mask = np.where(rng.random((B, 1, 1, L)) > 0.1, 0.0, -np.inf)  # [B, 1, 1, Lk]
    score_bytes = B * H * L * L * 8
    # once untraced and small, so that first-call imports are not counted
    Bk.sdpa_blocked_backward(
        dout[..., :3, :], Bk.sdpa_blocked_forward(q[..., :3, :], k, v, mask=mask)[1]
    )
    tracemalloc.start()
    try:
        out, cache = Bk.sdpa_blocked_forward(
            q, k, v, mask=mask, is_causal=is_causal, block_q=64, block_k=256
        )
        grads = Bk.sdpa_blocked_backward(dout, cache)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert grads[3].shape == mask.shape
    assert (
        peak < score_bytes / 8
    ), f"peak {peak / 2**20:.1f} MiB against {score_bytes / 2**20:.0f} MiB of scores"


def test_limit_blas_threads():
    """limit_blas_threads holds the BLAS libraries of npattn's controller (NumPy's among them)
    and restores their counts; a BLAS loaded after the controller was made (SciPy's own
    OpenBLAS, by an earlier test) is not among them and keeps its count, so it is not read."""
    pytest.importorskip("threadpoolctl", reason="limit_blas_threads needs threadpoolctl")
    from npattn.backend import blas_controller, limit_blas_threads

    def blas_threads():
        return {p["num_threads"] for p in blas_controller().info() if p["user_api"] == "blas"}

    before = blas_threads()
    with limit_blas_threads(1):
        assert blas_threads() <= {1}
    with limit_blas_threads(None):
        assert blas_threads() == before
    assert blas_threads() == before


@pytest.mark.parametrize("n_kv_head", [1, 2, 4])
def test_module_blocked_matches_dense_with_gqa_and_extra_keys(backend, to_xp, to_np, n_kv_head):
    """GQA (K/V heads broadcast over their query heads, never repeated), bias_k/bias_v, a zero
    key, causal and an additive mask with -inf: blocked and dense agree in every gradient."""
    rng = np.random.default_rng(n_kv_head)
    B, Lq, Lk, D, H = 2, 5, 7, 8, 4
    kw = dict(n_kv_head=n_kv_head, add_bias_kv=True, add_zero_attn=True, kdim=3, vdim=5,
              dtype="float64", seed=n_kv_head, backend=backend)
    dense, blk = MultiHeadAttention(D, H, impl="dense", **kw), MultiHeadAttention(D, H, impl="blocked", **kw)
    query = to_xp(rng.standard_normal((B, Lq, D)))
    key, value = to_xp(rng.standard_normal((B, Lk, 3))), to_xp(rng.standard_normal((B, Lk, 5)))
    mask_host = np.where(rng.random((B, 1, Lq, Lk)) > 0.3, rng.standard_normal((B, 1, Lq, Lk)), -np.inf)
    mask = to_xp(mask_host)
    dout = to_xp(rng.standard_normal((B, Lq, D)))
    results = []
    for mha in (dense, blk):
        out, _ = mha(query, key, value, mask=mask, is_causal=True)
        grads = mha.backward(dout)
        results.append([out, *grads, mha.dmask, *(mha.grads[n] for n in sorted(mha.grads))])
    for a, b in zip(*results):
        np.testing.assert_allclose(to_np(b), to_np(a), rtol=1e-10, atol=1e-12)


def test_blocked_gqa_module_passes_finite_differences(backend, to_xp):
    from npattn.gradcheck import gradcheck_module

    rng = np.random.default_rng(0)
    mha = MultiHeadAttention(8, 4, n_kv_head=2, dtype="float64", seed=0, backend=backend, impl="blocked")
    x = to_xp(rng.standard_normal((2, 3, 8)))
    y = to_xp(rng.standard_normal((2, 5, 8)))
    report = gradcheck_module(mha, x, y, y, forward_kwargs=dict(is_causal=True), mode="vjp")
    assert report.ok, str(report)


@pytest.mark.parametrize("kw", [dict(is_causal=True, align="bottom_right"), dict(window=(1, 0))],
                         ids=["causal-bottom-right", "window-top-left"])
def test_gqa_query_block_that_meets_no_key_block(kw, xp, to_xp, to_np):
    """Grouped-query attention (Hkv = 2 K/V heads, G = 3 query heads each) where whole query
    blocks attend nothing: bottom-right causal with Lq > Lk leaves rows 0..2 without keys, a
    top-left window (1, 0) rows 5..6. Every key block of those query blocks is skipped; their
    rows are zero and out and the gradients are the reference's."""
    rng = np.random.default_rng(21)
    B, Hkv, G, Lq, Lk, Dh, Dv = 2, 2, 3, 7, 4, 3, 2
    q = to_xp(rng.standard_normal((B, Hkv * G, Lq, Dh)))  # [B, Hq, Lq, Dh]
    k = to_xp(rng.standard_normal((B, Hkv, Lk, Dh)))  # [B, Hkv, Lk, Dh]
    v = to_xp(rng.standard_normal((B, Hkv, Lk, Dv)))  # [B, Hkv, Lk, Dv]
    dout = to_xp(rng.standard_normal((B, Hkv * G, Lq, Dv)))  # [B, Hq, Lq, Dv]
    out_b, cache_b = Bk.sdpa_blocked_forward(q, k, v, enable_gqa=True, block_q=2, block_k=2, **kw)
    out_r, cache_r = F.sdpa_forward(q, k, v, enable_gqa=True, **kw)
    # the rows with no key: by hand from the offset j <= i + (Lk - Lq) or j >= i - 1
    empty = [0, 1, 2] if kw.get("is_causal") else [5, 6]
    assert np.all(to_np(out_b)[:, :, empty] == 0.0)
    assert_close(out_b, out_r, to_np, "out")
    for name, gb, gr in zip(("dq", "dk", "dv"), Bk.sdpa_blocked_backward(dout, cache_b),
                            F.sdpa_backward(dout, cache_r)):
        assert_close(gb, gr, to_np, name)
