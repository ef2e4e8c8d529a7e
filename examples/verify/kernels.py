"""User-style attention kernels for ``npattn verify``: two right, sixteen wrong.

``attention`` is a blocked (FlashAttention-2 style) NumPy kernel: the keys
are visited in tiles of ``BLOCK`` with an online softmax, and the backward
(``attention_backward``) recomputes each tile's probabilities from the saved
log-sum-exp. It takes every option of ``npattn.verify``'s panel (causal
top-left and bottom-right, windows, softcap, ALiBi, sinks, GQA, packed
segments, a dropout keep-mask, Dv != Dh, bool and float masks, a scale,
rows with nothing to attend) on (B, H, L, D) arrays, and returns
``(out, lse, saved)``: the verify protocol with ``returns_lse=True`` and
``backward=attention_backward``. The backward also gives the gradient of a
float mask (``dmask``) and takes an upstream gradient of lse (``dlse=``), so
it passes with ``mask_grad=True`` and ``lse_grad=True``. float16 inputs are
computed in float32.

Check it::

    npattn verify examples/verify/kernels.py:attention --backward attention_backward \\
        --returns-lse --supports all --mask-grad --lse-grad

``attention_split_kv`` is its split-KV (flash-decoding) forward: the keys cut
into ``SPLITS`` ranges, each giving a partial output and log-sum-exp in the
work dtype, merged through their log-sum-exps; same ``saved``, same backward::

    npattn verify examples/verify/kernels.py:attention_split_kv \\
        --backward attention_backward --returns-lse --supports all --mask-grad --lse-grad

Each ``bug_*`` function is the same kernel with one seeded mistake (see
``MUTANTS``); ``npattn verify`` names the tensor it breaks. They share
``attention_backward``: the mistake travels in ``saved``. ``bug_dlse_ignored``
is caught only with ``lse_grad=True``, ``bug_dmask_sign`` only in the cases
with a float mask (and ``mask_grad`` not False).

Shape legend: B batch, Hq query heads, Hkv key/value heads, Lq/Lk query/key
lengths, Dh key width, Dv value width; bq/bk the rows/columns of a tile.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple, Optional

import numpy as np

BLOCK = 64

#: The seeded mistakes, by function name: what each one does.
MUTANTS = {
    "bug_softmax_no_rowsum": "softmax backward without the row-sum term: ds = p * dp",
    "bug_transposed_scores": "each score tile transposed (k q^T read as q k^T)",
    "bug_scale_twice": "the scale applied twice in dq and dk",
    "bug_window_off_by_one": "the window's left edge one key short",
    "bug_causal_swapped": "causal alignment swapped: bottom-right for top-left and back",
    "bug_dropout_forward_only": "the dropout keep-mask applied in the forward, not the backward",
    "bug_alibi_sign": "ALiBi's bias added with the wrong sign",
    "bug_sink_dropped": "the sink left out of the softmax denominator",
    "bug_gqa_no_sum": "dk and dv of a K/V head taken from its first query head, not summed",
    "bug_gqa_mean": "dk and dv of a K/V head the mean over its query heads, not the sum",
    "bug_empty_rows_uniform": "a row with nothing to attend gets the mean of v (uniform weights, as "
                              "a large negative number in place of -inf gives), not zeros",
    "bug_float16_sum": "the softmax row sum accumulated in float16",
    "bug_no_row_max": "exp of the scores without subtracting each row's maximum",
    "bug_dlse_ignored": "the backward drops dlse, the upstream gradient of lse",
    "bug_dmask_sign": "dmask, the float mask's gradient, returned with the wrong sign",
    "bug_softcap_last": "the softcap taken after the float mask and ALiBi are added, not before",
}


class Options(NamedTuple):
    """What the tiles need to know of the call, and the seeded mistake (None: right)."""

    scale: float
    offset: int  # key position of query 0's diagonal: 0 top-left, Lk - Lq bottom-right
    causal_offset: int
    causal: bool
    left: Optional[int]
    right: Optional[int]
    softcap: Optional[float]
    alibi: Any  # [B|1, Hq, 1, 1] or None
    q_segments: Any  # [B, nq] padded with -1, or None
    k_segments: Any  # [B, nk] padded with -2, or None
    mask: Any  # [B|1, Hq|1, nq, nk] bool or float, or None
    mask_shape: Optional[tuple]  # a float mask's shape as given, for dmask; else None
    keep: Any  # [B, Hq, nq, nk] bool dropout keep-mask, or None
    dropout_p: float
    Lq: int
    Lk: int
    bug: Optional[str]


class Saved(NamedTuple):
    """What the backward needs: the inputs in the work dtype, out, lse, the options."""

    q: Any  # [B, Hq, Lq, Dh]
    k: Any  # [B, Hkv, Lk, Dh]
    v: Any  # [B, Hkv, Lk, Dv]
    out: Any  # [B, Hq, Lq, Dv] in the work dtype
    lse: Any  # [B, Hq, Lq]
    sinks: Any  # [Hq] or None
    opts: Options
    in_dtype: Any


def _pad(x: np.ndarray, axes: tuple, sizes: tuple, value: Any) -> np.ndarray:
    """``x`` padded at the end of ``axes`` up to ``sizes`` with ``value``."""
    widths = [(0, 0)] * x.ndim
    for a, n in zip(axes, sizes):
        widths[a] = (0, n - x.shape[a])
    return np.pad(x, widths, constant_values=value)


def _up(n: int) -> int:
    return max(BLOCK, -(-n // BLOCK) * BLOCK)


def _tile(q_t, k_t, rows, cols, o: Options):
    """Scores of one tile, with what may be attended: (s, allowed, s / softcap or None).

    s [B, Hq, bq, bk] (-inf where not allowed), allowed bool of the same shape.
    """
    # [B, Hq, bq, Dh], [B, Hq, bk, Dh] -> [B, Hq, bq, bk]
    s = (q_t @ np.swapaxes(k_t, -1, -2)) * o.scale  # [B, Hq, bq, bk]
    if o.bug == "transposed":
        s = np.swapaxes(s, -1, -2)  # square tiles: the shapes still agree
    u = None
    if o.softcap is not None and o.bug != "softcap_last":
        u = s / o.softcap
        s = o.softcap * np.tanh(u)
    d = cols[None, :] - (rows[:, None] + o.offset)  # [bq, bk] j - (i + o)
    if o.alibi is not None:
        sign = 1.0 if o.bug == "alibi_sign" else -1.0
        s = s + sign * o.alibi * np.abs(d).astype(s.dtype)
    allowed = (rows[:, None] < o.Lq) & (cols[None, :] < o.Lk)  # [bq, bk] padding
    if o.causal:
        allowed = allowed & (cols[None, :] - (rows[:, None] + o.causal_offset) <= 0)
    if o.right is not None:
        allowed = allowed & (d <= o.right)
    if o.left is not None:
        allowed = allowed & (d >= -o.left + (1 if o.bug == "window" else 0))
    allowed = np.broadcast_to(allowed, s.shape)
    if o.q_segments is not None:
        same = o.q_segments[:, None, rows, None] == o.k_segments[:, None, None, cols]
        allowed = allowed & same  # [B, 1, bq, bk]
    if o.mask is not None:
        m = o.mask[..., rows[0]:rows[-1] + 1, cols[0]:cols[-1] + 1]
        if m.dtype == bool:
            allowed = allowed & m
        else:
            s = s + m
            allowed = allowed & (m > -np.inf)
    if o.softcap is not None and o.bug == "softcap_last":
        u = np.where(allowed, s, 0.0) / o.softcap
        s = o.softcap * np.tanh(u)
    s = np.where(allowed, s, -np.inf)
    return s, allowed, u


def _options(q, k, *, mask, is_causal, align, window, scale, softcap, alibi_slopes,
             q_segments, k_segments, dropout_p, dropout_mask, bug, work) -> Options:
    B, Hq, Lq, Dh = q.shape
    Lk = k.shape[2]
    nq, nk = _up(Lq), _up(Lk)
    o = Lk - Lq if align == "bottom_right" else 0
    co = o
    if bug == "causal_swapped":
        co = 0 if align == "bottom_right" else Lk - Lq
    left, right = (None, None) if window is None else window
    alibi = None
    if alibi_slopes is not None:
        a = np.asarray(alibi_slopes, dtype=work)
        alibi = a.reshape((1,) * (2 - a.ndim) + a.shape + (1, 1))  # [B|1, Hq, 1, 1]
    qs = ks = None
    if q_segments is not None:
        qs = _pad(np.asarray(q_segments), (1,), (nq,), -1)
        ks = _pad(np.asarray(k_segments), (1,), (nk,), -2)
    m = mask_shape = None
    if mask is not None:
        m = np.asarray(mask)
        mask_shape = None if m.dtype == bool else m.shape
        m = m.reshape((1,) * (4 - m.ndim) + m.shape)
        m = m if m.dtype == bool else m.astype(work)
        m = _pad(np.broadcast_to(m, m.shape[:2] + (Lq, Lk)), (2, 3), (nq, nk),
                 False if m.dtype == bool else -np.inf)
    keep = None
    if dropout_mask is not None and dropout_p > 0:
        keep = _pad(np.broadcast_to(np.asarray(dropout_mask), (B, Hq, Lq, Lk)), (2, 3), (nq, nk), False)
    return Options(1.0 / math.sqrt(Dh) if scale is None else float(scale), o, co, bool(is_causal),
                   left, right, softcap, alibi, qs, ks, m, mask_shape, keep, float(dropout_p),
                   Lq, Lk, bug)


def _row_block(q_t, kp, vp, rows, c0, c1, o: Options, work):
    """One block of query rows over the keys [c0, c1), in tiles of at most BLOCK, with an
    online softmax: (running max m, running sum l, unnormalised output acc)."""
    # [B, Hq, bq, Dh], [B, Hq, nk, Dh], [B, Hq, nk, Dv] -> [B, Hq, bq], [B, Hq, bq], [B, Hq, bq, Dv]
    B, Hq, bq = q_t.shape[:3]
    half = o.bug == "float16_sum"
    m = np.full((B, Hq, bq), -np.inf, dtype=work)  # running row max
    l = np.zeros((B, Hq, bq), dtype=np.float16 if half else work)  # running row sum
    acc = np.zeros((B, Hq, bq, vp.shape[-1]), dtype=work)
    i0 = int(rows[0])
    for j0 in range(c0, c1, BLOCK):
        j1 = min(j0 + BLOCK, c1)
        cols = np.arange(j0, j1)
        s, allowed, _ = _tile(q_t, kp[:, :, j0:j1], rows, cols, o)
        m_new = np.maximum(m, s.max(axis=-1))
        if o.bug == "no_row_max":  # exp of the scores themselves
            m_new = np.zeros_like(m_new)
        m_safe = np.where(m_new == -np.inf, 0.0, m_new)  # no -inf - -inf
        p = np.where(allowed, np.exp(s - m_safe[..., None]), 0.0)  # [B, Hq, bq, bk]
        alpha = np.exp(m - m_safe)  # rescales what was summed under the old max
        if half:
            l = (l * alpha.astype(np.float16)).astype(np.float16)
            l = (l + np.cumsum(p.astype(np.float16), axis=-1, dtype=np.float16)[..., -1])
        else:
            l = l * alpha + p.sum(axis=-1)
        a = p
        if o.keep is not None:
            a = p * o.keep[:, :, i0:i0 + bq, j0:j1] / (1.0 - o.dropout_p)
        acc = acc * alpha[..., None] + a @ vp[:, :, j0:j1]
        m = m_new
    return m, l, acc


def _forward(q, k, v, *, mask=None, is_causal=False, align="top_left", window=None, scale=None,
             softcap=None, alibi_slopes=None, sinks=None, q_segments=None, k_segments=None,
             dropout_p=0.0, dropout_mask=None, enable_gqa=False, bug=None, splits=1):
    # [B, Hq, Lq, Dh], [B, Hkv, Lk, Dh], [B, Hkv, Lk, Dv] -> [B, Hq, Lq, Dv], [B, Hq, Lq], Saved
    in_dtype = q.dtype
    work = np.float32 if in_dtype == np.float16 else in_dtype
    q, k, v = (np.asarray(t, dtype=work) for t in (q, k, v))
    B, Hq, Lq, Dh = q.shape
    Hkv, Lk, Dv = k.shape[1], k.shape[2], v.shape[3]
    G = Hq // Hkv
    o = _options(q, k, mask=mask, is_causal=is_causal, align=align, window=window, scale=scale,
                 softcap=softcap, alibi_slopes=alibi_slopes, q_segments=q_segments,
                 k_segments=k_segments, dropout_p=dropout_p, dropout_mask=dropout_mask, bug=bug,
                 work=work)
    nq, nk = _up(Lq), _up(Lk)
    qp = _pad(q, (2,), (nq,), 0.0)  # [B, Hq, nq, Dh]
    kp = _pad(np.repeat(k, G, axis=1), (2,), (nk,), 0.0)  # [B, Hq, nk, Dh]
    vp = _pad(np.repeat(v, G, axis=1), (2,), (nk,), 0.0)  # [B, Hq, nk, Dv]
    out = np.zeros((B, Hq, nq, Dv), dtype=work)  # [B, Hq, nq, Dv]
    lse = np.zeros((B, Hq, nq), dtype=work)  # [B, Hq, nq]
    sink = None
    if sinks is not None and bug != "sink_dropped":  # one more logit, carrying no value
        sink = np.asarray(sinks, dtype=work)[None, :, None]  # [1, Hq, 1]
    # split-KV: the keys [0, Lk) cut into `splits` contiguous ranges; 1: all keys at once
    bounds = [0, nk] if splits == 1 else [round(s * Lk / splits) for s in range(splits + 1)]
    for i0 in range(0, nq, BLOCK):
        rows = np.arange(i0, i0 + BLOCK)
        q_t = qp[:, :, i0:i0 + BLOCK]
        if splits == 1:
            m, l, acc = _row_block(q_t, kp, vp, rows, 0, nk, o, work)
            l = l.astype(work)
            m_safe = np.where(m == -np.inf, 0.0, m)
            if sink is not None:
                m_tot = np.maximum(m, sink)
                shift = np.exp(m - m_tot)  # 0 for a row with nothing attended
                l = l * shift + np.exp(sink - m_tot)
                acc = acc * shift[..., None]
                m_safe = m_tot
            out[:, :, i0:i0 + BLOCK] = acc / np.where(l > 0, l, 1.0)[..., None]
            lse[:, :, i0:i0 + BLOCK] = np.where(l > 0, m_safe + np.log(np.where(l > 0, l, 1.0)),
                                                -np.inf)
            continue
        # flash-decoding: each split's partial out_s and lse_s in the work dtype ...
        outs, lses = [], []
        for c0, c1 in zip(bounds[:-1], bounds[1:]):
            m, l, acc = _row_block(q_t, kp, vp, rows, c0, c1, o, work)
            l = l.astype(work)
            m_safe = np.where(m == -np.inf, 0.0, m)
            outs.append(acc / np.where(l > 0, l, 1.0)[..., None])  # [B, Hq, bq, Dv]
            lses.append(np.where(l > 0, m_safe + np.log(np.where(l > 0, l, 1.0)), -np.inf))
        if sink is not None:  # the sink: one more partial, lse_s = sink and out_s = 0
            lses.append(np.broadcast_to(sink, lses[0].shape).astype(work))
            outs.append(np.zeros_like(outs[0]))
        # ... merged: lse = logsumexp_s(lse_s), out = sum_s exp(lse_s - lse) out_s
        ls = np.stack(lses)  # [S, B, Hq, bq]
        top = ls.max(axis=0)  # [B, Hq, bq]
        top_safe = np.where(top == -np.inf, 0.0, top)
        total = np.exp(ls - top_safe).sum(axis=0)  # [B, Hq, bq], 0 for a row with nothing attended
        lse_t = np.where(total > 0, top_safe + np.log(np.where(total > 0, total, 1.0)), -np.inf)
        w = np.exp(ls - np.where(total > 0, lse_t, np.inf))  # [S, B, Hq, bq]
        out[:, :, i0:i0 + BLOCK] = np.sum(w[..., None] * np.stack(outs), axis=0)
        lse[:, :, i0:i0 + BLOCK] = lse_t
    out, lse = out[:, :, :Lq], lse[:, :, :Lq]
    if bug == "empty_rows_uniform":  # every key the same weight on a row with none to attend
        out = np.where((lse == -np.inf)[..., None], vp[:, :, :Lk].mean(axis=2, keepdims=True), out)
    sinks_w = None if sinks is None else np.asarray(sinks, dtype=work)
    saved = Saved(q, k, v, out, lse, sinks_w, o, in_dtype)
    return out.astype(in_dtype), lse, saved


class Grads(NamedTuple):
    """The gradients of ``attention``, in the order of its inputs (npattn's ``SDPAGrads``)."""

    dq: Any  # [B, Hq, Lq, Dh]
    dk: Any  # [B, Hkv, Lk, Dh]
    dv: Any  # [B, Hkv, Lk, Dv]
    dmask: Any  # a float mask's shape, or None
    dsinks: Any  # [Hq] or None


def attention_backward(dout, saved: Saved, dlse=None) -> Grads:
    """``Grads(dq, dk, dv, dmask, dsinks)`` of ``attention`` (or of a ``bug_*``),
    FlashAttention-2 style.

    delta = rowsum(dout * out); for each tile p = exp(s - lse) is recomputed,
    dv += a^T dout, dp = dout v^T (times the keep-mask / (1 - p)),
    ds = p * (dp - delta + dlse), where ``dlse`` (B, Hq, Lq) is an upstream
    gradient of lse (d lse / d s_j = p_j; zero when not given); dmask = ds
    (the mask is added to the scores after the softcap), summed over the axes
    the mask was broadcast along; then ds times tanh'(u) = 1 / cosh(u)^2 under
    softcap (u = s / softcap; 1 - tanh(u)^2 would cancel where tanh rounds to 1),
    dq += ds k * scale, dk += ds^T q * scale; GQA sums dk and dv over each
    K/V head's query heads; dsinks = sum over rows of p_sink * (dlse - delta).
    """
    # [B, Hq, Lq, Dv], Saved, [B, Hq, Lq] -> [B, Hq, Lq, Dh], [B, Hkv, Lk, Dh], [B, Hkv, Lk, Dv],
    #                                        mask shape, [Hq]
    q, k, v, out, lse, sinks, o, in_dtype = saved
    work = q.dtype
    dout = np.asarray(dout, dtype=work)
    B, Hq, Lq, Dh = q.shape
    Hkv, Lk, Dv = k.shape[1], k.shape[2], v.shape[3]
    G = Hq // Hkv
    nq, nk = _up(Lq), _up(Lk)
    delta = np.sum(dout * out, axis=-1)  # [B, Hq, Lq]
    if o.bug == "no_rowsum":
        delta = np.zeros_like(delta)
    if dlse is not None and o.bug != "dlse_ignored":
        # lse = log(sum_j exp(s_j)) adds d lse / d s_j = p_j: ds = p * (dp - (delta - dlse))
        # (a row with nothing to attend has lse = -inf whatever its scores: its dlse does
        # not matter, and an inf there would give 0 * inf)
        delta = delta - np.where(lse == -np.inf, 0.0, np.asarray(dlse, dtype=work))  # [B, Hq, Lq]
    qp = _pad(q, (2,), (nq,), 0.0)
    kp = _pad(np.repeat(k, G, axis=1), (2,), (nk,), 0.0)
    vp = _pad(np.repeat(v, G, axis=1), (2,), (nk,), 0.0)
    dop = _pad(dout, (2,), (nq,), 0.0)
    lse_p = _pad(np.where(lse == -np.inf, np.inf, lse), (2,), (nq,), np.inf)  # exp(s - inf) = 0
    delta_p = _pad(delta, (2,), (nq,), 0.0)
    dq = np.zeros_like(qp)
    dkh = np.zeros_like(kp)
    dvh = np.zeros_like(vp)
    dsm = None if o.mask_shape is None else np.zeros((B, Hq, nq, nk), dtype=work)  # ds, for dmask
    factor = o.scale * (o.scale if o.bug == "scale_twice" else 1.0)
    for i0 in range(0, nq, BLOCK):
        rows = np.arange(i0, i0 + BLOCK)
        q_t, do_t = qp[:, :, i0:i0 + BLOCK], dop[:, :, i0:i0 + BLOCK]
        for j0 in range(0, nk, BLOCK):
            cols = np.arange(j0, j0 + BLOCK)
            k_t, v_t = kp[:, :, j0:j0 + BLOCK], vp[:, :, j0:j0 + BLOCK]
            s, allowed, u = _tile(q_t, k_t, rows, cols, o)
            p = np.where(allowed, np.exp(s - lse_p[:, :, i0:i0 + BLOCK, None]), 0.0)
            a = p
            dp = do_t @ np.swapaxes(v_t, -1, -2)  # [B, Hq, bq, bk]
            if o.keep is not None and o.bug != "dropout_forward_only":
                kd = o.keep[:, :, i0:i0 + BLOCK, j0:j0 + BLOCK] / (1.0 - o.dropout_p)
                a = p * kd
                dp = dp * kd
            dvh[:, :, j0:j0 + BLOCK] += np.swapaxes(a, -1, -2) @ do_t
            ds = p * (dp - delta_p[:, :, i0:i0 + BLOCK, None])
            if dsm is not None:  # in the forward: s = s + mask, so dmask = ds
                dsm[:, :, i0:i0 + BLOCK, j0:j0 + BLOCK] = ds
            if u is not None:  # cosh stays finite up to |u| = 88 in float32
                ds = ds * (1.0 / np.cosh(np.minimum(np.abs(u), 80.0))) ** 2
            if o.bug == "transposed":
                ds = np.swapaxes(ds, -1, -2)
            dq[:, :, i0:i0 + BLOCK] += (ds @ k_t) * factor
            dkh[:, :, j0:j0 + BLOCK] += (np.swapaxes(ds, -1, -2) @ q_t) * factor
    dq, dkh, dvh = dq[:, :, :Lq], dkh[:, :, :Lk], dvh[:, :, :Lk]
    if o.bug == "gqa_no_sum":
        dk, dv = dkh[:, ::G], dvh[:, ::G]  # one query head per group: the others are lost
    elif o.bug == "gqa_mean":
        dk = dkh.reshape(B, Hkv, G, Lk, Dh).mean(axis=2)
        dv = dvh.reshape(B, Hkv, G, Lk, Dv).mean(axis=2)
    else:
        dk = dkh.reshape(B, Hkv, G, Lk, Dh).sum(axis=2)
        dv = dvh.reshape(B, Hkv, G, Lk, Dv).sum(axis=2)
    dmask = None
    if dsm is not None:  # summed over the axes the mask was broadcast along
        shape4 = (1,) * (4 - len(o.mask_shape)) + tuple(o.mask_shape)
        axes = tuple(i for i in range(4) if shape4[i] == 1)
        dmask = dsm[:, :, :Lq, :Lk].sum(axis=axes, keepdims=True).reshape(o.mask_shape)
        if o.bug == "dmask_sign":
            dmask = -dmask
        dmask = dmask.astype(in_dtype)
    dsinks = None
    if sinks is not None:
        p_sink = np.exp(sinks[None, :, None] - np.where(lse == -np.inf, np.inf, lse))  # [B, Hq, Lq]
        dsinks = -np.sum(p_sink * delta, axis=(0, 2))  # [Hq]
    return Grads(dq.astype(in_dtype), dk.astype(in_dtype), dv.astype(in_dtype), dmask, dsinks)


def attention(q, k, v, **options):
    """Blocked attention with an online softmax: ``(out, lse, saved)`` (see the module)."""
    # [B, Hq, Lq, Dh], [B, Hkv, Lk, Dh], [B, Hkv, Lk, Dv] -> [B, Hq, Lq, Dv], [B, Hq, Lq], Saved
    return _forward(q, k, v, **options)


#: The key splits of ``attention_split_kv``.
SPLITS = 3


def attention_split_kv(q, k, v, *, splits: int = SPLITS, **options):
    """Split-KV (flash-decoding) attention: ``(out, lse, saved)`` as ``attention``.

    The keys are cut into ``splits`` contiguous ranges; each range gives a partial output
    ``out_s`` and log-sum-exp ``lse_s`` in the work dtype (float32 for float16 inputs), as
    a flash-decoding kernel keeps them between its two launches, and these are merged:
    ``lse = logsumexp_s(lse_s)``, ``out = sum_s exp(lse_s - lse) out_s`` (the sink, when
    given, is one more partial with ``lse_s = sink`` and ``out_s = 0``). ``saved`` is
    ``attention``'s, so ``attention_backward`` is its backward.
    """
    # [B, Hq, Lq, Dh], [B, Hkv, Lk, Dh], [B, Hkv, Lk, Dv] -> [B, Hq, Lq, Dv], [B, Hq, Lq], Saved
    if isinstance(splits, bool) or not isinstance(splits, int) or splits < 1:
        raise ValueError(f"splits: expected an int >= 1, got {splits!r}")
    return _forward(q, k, v, splits=splits, **options)


def _mutant(bug: str, name: str):
    def fn(q, k, v, **options):
        return _forward(q, k, v, bug=bug, **options)

    fn.__name__ = fn.__qualname__ = name
    fn.__doc__ = f"``attention`` with a seeded mistake: {MUTANTS[name]}."
    return fn


bug_softmax_no_rowsum = _mutant("no_rowsum", "bug_softmax_no_rowsum")
bug_transposed_scores = _mutant("transposed", "bug_transposed_scores")
bug_scale_twice = _mutant("scale_twice", "bug_scale_twice")
bug_window_off_by_one = _mutant("window", "bug_window_off_by_one")
bug_causal_swapped = _mutant("causal_swapped", "bug_causal_swapped")
bug_dropout_forward_only = _mutant("dropout_forward_only", "bug_dropout_forward_only")
bug_alibi_sign = _mutant("alibi_sign", "bug_alibi_sign")
bug_sink_dropped = _mutant("sink_dropped", "bug_sink_dropped")
bug_gqa_no_sum = _mutant("gqa_no_sum", "bug_gqa_no_sum")
bug_gqa_mean = _mutant("gqa_mean", "bug_gqa_mean")
bug_empty_rows_uniform = _mutant("empty_rows_uniform", "bug_empty_rows_uniform")
bug_float16_sum = _mutant("float16_sum", "bug_float16_sum")
bug_no_row_max = _mutant("no_row_max", "bug_no_row_max")
bug_dlse_ignored = _mutant("dlse_ignored", "bug_dlse_ignored")
bug_dmask_sign = _mutant("dmask_sign", "bug_dmask_sign")
bug_softcap_last = _mutant("softcap_last", "bug_softcap_last")
