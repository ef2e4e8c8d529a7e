"""The gradient audit behind ``npattn check``: every backward against finite differences.

A fixed panel of configurations covers every primitive of
``npattn.functional`` and the ``MultiHeadAttention`` module: self- and
cross-attention (Lq != Lk), kdim/vdim, bias on and off, boolean and floating
masks (with ``-inf``), padding and causal masks, fully masked rows, and
dropout with p > 0 and a fixed keep-mask; and the backward passes around
attention (``npattn.layers``, ``npattn.nn``, ``npattn.positions``) and of the
models built of them (the Transformer blocks, GPT). For every (configuration, tensor)
it reports the largest absolute and relative error of the hand-derived
gradient.

How one check works
-------------------
1. Inputs are drawn in float64 on the host from a fixed seed, cast to the
   audited dtype and moved to the audited backend.
2. The analytic gradient is the backward of the pair, run in the audited
   dtype and backend, for a random normal upstream gradient ``dout`` (never
   all ones).
3. The reference is ``npattn.gradcheck.numerical_vjp``: central differences
   of ``<f(x), dout>`` with step 1e-6, always evaluated in float64 (from the
   very same, float32-representable, input values in float32 mode).
4. ``max_abs_err = max |g - n|`` and ``max_rel_err = max_abs_err / scale``
   with ``scale = max(max|g|, max|n|, FLOOR * S)``, where ``S`` is the largest
   gradient entry of any tensor in the same configuration. A tensor passes
   when ``max_abs_err <= atol + rtol * scale``.

   The floor is there for gradients that are exactly zero in exact
   arithmetic: ``b_k`` shifts every score of a row by the same ``q . b_k``,
   which softmax ignores, so ``d b_k = 0`` and both sides are pure round-off
   that no relative error can judge. A wrong ``d b_k`` would be of the size
   of the other gradients and still fail.
5. A tensor whose gradient is exactly 0 everywhere on both sides fails: the
   configuration does not exercise it (say every row attends one key, so the
   softmax is constant), and a backward that returned zeros would pass it.

So in float32 mode the audit checks that the backward computed *in float32*
agrees with the exact derivative (float64 differences) up to float32
round-off; in float64 mode it checks the derivation itself up to the
truncation error of the differences. Tolerances are in ``TOLERANCES``.

Shape legend: B batch, H heads, Lq/Lk query/key lengths, D model width,
Dh head width.
"""

from __future__ import annotations

import contextlib
import math
import time
from dataclasses import asdict, dataclass
from typing import Any, Callable, Optional

import numpy as np

from .. import attention as A
from .. import functional as F
from .. import layers as Ly
from .. import nn
from .. import positions as Pos
from ..backend import from_numpy, resolve_backend, to_numpy
from ..gpt import GPT
from ..gradcheck import numerical_vjp
from ..module import PARAM_NAMES, MultiHeadAttention
from ..transformer import (DECODER_DROPOUT_SITES, ENCODER_DROPOUT_SITES, TransformerBlock,
                           TransformerDecoderBlock)
from ..validation import check_choice

__all__ = [
    "TOLERANCES", "Check", "Row", "AuditResult", "panel", "run_check", "run_audit",
    "format_table", "summary_line",
]

#: (rtol, atol) per audited dtype; see the module docstring for what is compared.
#: float64: central differences with eps = 1e-6 are accurate to about 1e-9
#: relative, so 1e-6 leaves room only for round-off, not for a wrong formula.
#: float32: the analytic gradient carries float32 round-off (unit 6e-8) through
#: a few matmuls and a softmax; 1e-4 relative is ~1000 units, far below the
#: O(1) relative error of any wrong term.
TOLERANCES = {"float64": (1e-6, 1e-12), "float32": (1e-4, 1e-7)}
#: Step of the central differences.
EPS = 1e-6
#: Error scale floor, as a fraction of the configuration's largest gradient entry.
FLOOR = 1e-2


@dataclass
class Check:
    """One configuration of the panel.

    ``build(xp, dtype, rng)`` returns ``(forward, backward, inputs, names, wrt)``
    with ``inputs`` already on the backend, in the audited dtype.
    """

    name: str
    kind: str  # "primitive", "module" (attention), "layer" (around attention) or "model"
    build: Callable
    impl: Optional[str] = None  # sdpa/module: the implementation audited (None: the reference)


@dataclass
class Row:
    """The result for one (configuration, tensor)."""

    config: str
    tensor: str
    max_abs_err: float
    max_rel_err: float
    passed: bool
    error: Optional[str] = None  # an exception raised by the check, if any


@dataclass
class AuditResult:
    """A whole audit: its settings, one ``Row`` per (configuration, tensor), and the time taken.

    ``ok`` is True when at least one row was checked and none failed;
    ``to_dict()`` is what ``npattn check --json`` prints.
    """

    backend: str
    dtype: str
    rtol: float
    atol: float
    rows: list
    seconds: float

    @property
    def n_failed(self) -> int:
        return sum(not r.passed for r in self.rows)

    @property
    def ok(self) -> bool:
        return self.n_failed == 0 and len(self.rows) > 0

    def to_dict(self) -> dict:
        def clean(x):
            return x if isinstance(x, float) and math.isfinite(x) else None

        rows = []
        for r in self.rows:
            d = asdict(r)
            d["max_abs_err"] = clean(r.max_abs_err)
            d["max_rel_err"] = clean(r.max_rel_err)
            rows.append(d)
        return {
            "backend": self.backend,
            "dtype": self.dtype,
            "rtol": self.rtol,
            "atol": self.atol,
            "eps": EPS,
            "n_checked": len(self.rows),
            "n_failed": self.n_failed,
            "ok": self.ok,
            "seconds": round(self.seconds, 3),
            "rows": rows,
        }


# --------------------------------------------------------------------------
# building blocks of the panel


class _Maker:
    """Draws host float64 arrays from a seeded generator and puts them on the backend."""

    def __init__(self, xp, dtype, rng):
        self.xp, self.dtype, self.rng = xp, dtype, rng

    def normal(self, *shape):
        return self.put(self.rng.standard_normal(shape))

    def put(self, a):
        return self.xp.astype(from_numpy(np.asarray(a, dtype=np.float64), self.xp), self.dtype)

    def bool(self, a):
        return from_numpy(np.asarray(a, dtype=bool), self.xp)

    def keep(self, shape, p):
        return self.bool(self.rng.random(shape) >= p)


def _padding_keep(B, Lk, lengths):
    """Boolean (B, Lk): key j of batch b is real when j < lengths[b]."""
    return np.arange(Lk)[None, :] < np.asarray(lengths)[:, None]


def _float_mask(rng, shape, *, neg_inf_frac=0.3, full_rows=()):
    """Finite random values with some ``-inf`` entries; rows in ``full_rows`` all ``-inf``."""
    m = 0.5 * rng.standard_normal(shape)
    m[rng.random(shape) < neg_inf_frac] = -np.inf
    m[..., 0] = np.where(np.isinf(m[..., 0]), 0.3, m[..., 0])  # keep most rows alive
    for idx in full_rows:
        m[idx] = -np.inf
    return m


def _pair(forward_name, backward_name, **kwargs):
    """``(forward, backward)`` looking the functions up at call time in ``npattn.functional``.

    Late binding lets a test swap a backward and watch the audit fail.
    """

    def forward(*args):
        return getattr(F, forward_name)(*args, **kwargs)

    def backward(dout, cache):
        return getattr(F, backward_name)(dout, cache)

    return forward, backward


#: Block sizes of the audited blocked implementation: small and dividing
#: nothing, so every configuration crosses several blocks.
AUDIT_BLOCKS = {"block_q": 2, "block_k": 3}


#: Chunk lengths of the audited chunked implementation (dask arrays), along
#: (batch, heads, query rows, keys): every configuration splits into several
#: pairs of query and key chunks.
AUDIT_CHUNKS = (1, 1, 2, 3)


def _chunked(a, sizes):
    """Dask array ``a`` with the chunk lengths ``sizes`` on its trailing axes (-1: one chunk)."""
    return None if a is None else a.rechunk(tuple(sizes[len(sizes) - a.ndim:]))


def _sdpa_pair(impl=None, **kwargs):
    """``functional``'s sdpa pair (``impl`` None), or the dispatcher's with ``impl``.

    The forward takes ``(q, k, v, mask=None, sinks=None)``: the arrays whose
    gradients are audited.
    """
    if impl is not None:
        blocks: dict[str, Any] = AUDIT_BLOCKS if impl == "blocked" else {}

        def dispatched_forward(q, k, v, mask=None, sinks=None):
            if impl == "chunked":
                b, h, i, j = AUDIT_CHUNKS
                q, k, v = (_chunked(q, (b, h, i, -1)), _chunked(k, (b, h, j, -1)),
                           _chunked(v, (b, h, j, -1)))
                mask = _chunked(mask, AUDIT_CHUNKS)
            return A.sdpa_forward(q, k, v, mask=mask, sinks=sinks, impl=impl, **blocks, **kwargs)

        return dispatched_forward, A.sdpa_backward

    def reference_forward(q, k, v, mask=None, sinks=None):
        return F.sdpa_forward(q, k, v, mask=mask, sinks=sinks, **kwargs)

    def reference_backward(dout, cache):
        return F.sdpa_backward(dout, cache)

    return reference_forward, reference_backward


def _module_pair(mha: MultiHeadAttention, self_attention: bool, **fwd_kwargs):
    """The module as a pure pair over (inputs, parameters).

    Self-attention feeds one ``x`` as query, key and value, so its gradient is
    ``dquery + dkey + dvalue``: the check covers that sum too.
    """
    names = [n for n in PARAM_NAMES if n in mha.params]
    xp = mha.xp
    modules = {}  # one module per dtype: parameters and inputs never mix dtypes

    def module_for(dtype):
        if dtype == mha.dtype:
            return mha
        if dtype not in modules:
            modules[dtype] = MultiHeadAttention(
                mha.d_model, mha.n_head, bias=mha.bias, kdim=mha.kdim, vdim=mha.vdim,
                dropout=mha.dropout, backend=xp, dtype=dtype, impl=mha.impl,
                block_q=mha.block_q, block_k=mha.block_k).train(mha.training)
        return modules[dtype]

    def forward(*args):
        n_in = 1 if self_attention else 3
        acts, ps = args[:n_in], args[n_in:]
        m = module_for(acts[0].dtype)
        for n, p in zip(names, ps):
            m.params[n] = p
        if m.impl == "chunked":  # dask: batch entries, and query and key positions, in chunks
            # (self-attention's x gives the queries, keys and values their chunks alike)
            acts = ((_chunked(acts[0], (1, 3 if self_attention else 2, -1)),)
                    + tuple(_chunked(a, (1, 3, -1)) for a in acts[1:]))
        q, k, v = (acts[0],) * 3 if self_attention else acts
        kw = {key: xp.astype(val, m.dtype) if key == "mask" and val is not None
              and xp.isdtype(val.dtype, "real floating") else val for key, val in fwd_kwargs.items()}
        out, _ = m.forward(q, k, v, **kw)
        return out, (m, m.cache)

    def backward(dout, cache):
        m, m.cache = cache
        dq, dk, dv = m.backward(dout)
        g = [m.grads[n] for n in names]
        return ((dq + dk + dv,) if self_attention else (dq, dk, dv)) + tuple(g)

    return forward, backward, names


# --------------------------------------------------------------------------
# the panel


def _linear(bias):
    def build(xp, dtype, rng):
        m = _Maker(xp, dtype, rng)
        x, w = m.normal(2, 3, 5), m.normal(4, 5)
        inputs = [x, w] + ([m.normal(4)] if bias else [])
        names = ["x", "w"] + (["b"] if bias else [])
        return (*_pair("linear_forward", "linear_backward"), inputs, names)

    return build


def _split(xp, dtype, rng):
    m = _Maker(xp, dtype, rng)
    return (*_pair("split_heads_forward", "split_heads_backward", n_head=2),
            [m.normal(2, 3, 6)], ["x"])


def _merge(xp, dtype, rng):
    m = _Maker(xp, dtype, rng)
    return (*_pair("merge_heads_forward", "merge_heads_backward"), [m.normal(2, 3, 4, 2)], ["x"])


def _softmax(mask_kind):
    def build(xp, dtype, rng):
        m = _Maker(xp, dtype, rng)
        x = m.normal(2, 3, 5)  # [B, Lq, Lk]
        fwd, bwd = _pair("masked_softmax_forward", "masked_softmax_backward")
        if mask_kind is None:
            return fwd, bwd, [x], ["x"]
        if mask_kind == "bool":
            keep = rng.random((2, 3, 5)) < 0.6
            keep[..., 0] = True
            keep[1, 2, :] = False  # a fully masked row
            return fwd, bwd, [x, m.bool(keep)], ["x", "mask"]
        if mask_kind == "float":
            mask = _float_mask(rng, (3, 5), full_rows=[(1,)])  # broadcast over B
            return fwd, bwd, [x, m.put(mask)], ["x", "mask"]
        # "padding": additive (B, 1, Lk) mask, -inf on padded keys, one sequence empty
        pad = np.where(_padding_keep(2, 5, [3, 0]), 0.2 * rng.standard_normal((2, 5)), -np.inf)
        return fwd, bwd, [x, m.put(pad[:, None, :])], ["x", "mask"]

    return build


def _softmax_sink(xp, dtype, rng):
    """The softmax with a sink (one more logit per row, carrying no value) and a boolean
    mask with a fully masked row, which the sink then takes alone: gradients of x and sink."""
    m = _Maker(xp, dtype, rng)
    x, sink = m.normal(2, 3, 5), m.normal(2, 3, 1)  # [B, Lq, Lk], [B, Lq, 1]
    keep = rng.random((2, 3, 5)) < 0.6
    keep[..., 0] = True
    keep[1, 2, :] = False  # a fully masked row
    mask = m.bool(keep)

    def forward(x, sink):
        return F.masked_softmax_forward(x, mask, sink=sink)

    def backward(dp, cache):
        dx, _, dsink = F.masked_softmax_backward(dp, cache)  # looked up at call time
        return dx, dsink

    return forward, backward, [x, sink], ["x", "sink"]


def _dropout(xp, dtype, rng):
    m = _Maker(xp, dtype, rng)
    x = m.normal(2, 3, 4)
    keep = m.keep((2, 3, 4), 0.3)
    return (*_pair("dropout_forward", "dropout_backward", p=0.3, mask=keep), [x], ["x"])


def _sdpa(Lq, Lk, mask_kind=None, is_causal=False, dropout_p=0.0, gqa=False, Dv=3):
    def build(xp, dtype, rng, impl=None):
        m = _Maker(xp, dtype, rng)
        B, H, Hkv, Dh = 2, (4 if gqa else 2), 2, 3
        q, k, v = m.normal(B, H, Lq, Dh), m.normal(B, Hkv, Lk, Dh), m.normal(B, Hkv, Lk, Dv)
        kwargs = {"is_causal": is_causal, "enable_gqa": H != Hkv}
        if dropout_p:
            kwargs.update(dropout_p=dropout_p, dropout_mask=m.keep((B, H, Lq, Lk), dropout_p))
        fwd, bwd = _sdpa_pair(impl, **kwargs)
        inputs, names = [q, k, v], ["q", "k", "v"]
        if mask_kind == "bool_padding":  # (B, 1, 1, Lk), True = real key
            inputs.append(m.bool(_padding_keep(B, Lk, [Lk - 2, Lk])[:, None, None, :]))
            names.append("mask")
        elif mask_kind == "bool_full_rows":  # (B, H, Lq, Lk) with fully masked rows
            keep = rng.random((B, H, Lq, Lk)) < 0.6
            keep[..., 0] = True
            keep[0, 1, 1, :] = False
            keep[1, 0, Lq - 1, :] = False
            inputs.append(m.bool(keep))
            names.append("mask")
        elif mask_kind == "float":  # (B, 1, Lq, Lk), -inf entries, one fully masked row
            inputs.append(m.put(_float_mask(rng, (B, 1, Lq, Lk), full_rows=[(1, 0, 0)])))
            names.append("mask")
        return fwd, bwd, inputs, names

    return build


def _sdpa_options(Lq, Lk, *, align, sinks, window_only=False):
    """Every kernel option at once: window, softcap, ALiBi (B, H), segments with a query that
    has no key of its own, GQA, a fixed dropout keep-mask, a float mask with -inf, and sinks;
    ``window_only``: of the options only the window and the alignment (the NumPy kernel's)."""
    def build(xp, dtype, rng, impl=None):
        m = _Maker(xp, dtype, rng)
        B, H, Hkv, Dh, Dv = 2, 4, 2, 3, 2
        q, k, v = m.normal(B, H, Lq, Dh), m.normal(B, Hkv, Lk, Dh), m.normal(B, Hkv, Lk, Dv)
        seg_q = np.repeat([[0, 1]], B, axis=0).repeat([2, Lq - 2], axis=1)  # [B, Lq]
        seg_k = np.repeat([[0, 1]], B, axis=0).repeat([2, Lk - 2], axis=1)  # [B, Lk]
        seg_q[1, -1] = 7  # a query whose segment has no key
        ints = xp.int64
        kwargs = dict(window=(2, 1), align=align, is_causal=True, softcap=1.5,
                      alibi_slopes=m.put(rng.random((B, H))), enable_gqa=True,
                      q_segments=xp.asarray(from_numpy(seg_q, xp), dtype=ints),
                      k_segments=xp.asarray(from_numpy(seg_k, xp), dtype=ints),
                      dropout_p=0.25, dropout_mask=m.keep((B, H, Lq, Lk), 0.25))
        if window_only:
            for name in ("softcap", "alibi_slopes", "q_segments", "k_segments"):
                del kwargs[name]
        fwd, bwd = _sdpa_pair(impl, **kwargs)
        inputs = [q, k, v, m.put(_float_mask(rng, (B, 1, Lq, Lk), full_rows=[(0, 0, 1)]))]
        names = ["q", "k", "v", "mask"]
        if sinks:
            inputs.append(m.normal(H))
            names.append("sinks")
        return fwd, bwd, inputs, names

    return build


def _mha(self_attention, *, bias=True, kdim=None, vdim=None, mask_kind=None, is_causal=False,
         dropout_p=0.0):
    def build(xp, dtype, rng, impl=None):
        m = _Maker(xp, dtype, rng)
        B, Lq, Lk, D, H = 2, 4, (4 if self_attention else 5), 8, 2
        blocks: dict[str, Any] = AUDIT_BLOCKS if impl == "blocked" else {}
        mha = MultiHeadAttention(D, H, bias=bias, kdim=kdim, vdim=vdim, dropout=dropout_p,
                                 backend=xp, dtype="float64", impl=impl or "reference", **blocks)
        kwargs = {"is_causal": is_causal}
        if mask_kind == "bool_padding":
            kwargs["mask"] = m.bool(_padding_keep(B, Lk, [Lk - 1, 2])[:, None, None, :])
        elif mask_kind == "float":
            kwargs["mask"] = m.put(_float_mask(rng, (Lq, Lk), full_rows=[(1,)]))
        elif mask_kind == "bool_full_rows":
            keep = rng.random((B, 1, Lq, Lk)) < 0.7
            keep[..., 0] = True
            keep[1, 0, 2, :] = False
            kwargs["mask"] = m.bool(keep)
        if dropout_p:
            kwargs["dropout_mask"] = m.keep((B, H, Lq, Lk), dropout_p)
        fwd, bwd, pnames = _module_pair(mha.train(), self_attention, **kwargs)
        if self_attention:
            acts, anames = [m.normal(B, Lq, D)], ["x (q=k=v)"]
        else:
            acts = [m.normal(B, Lq, D), m.normal(B, Lk, mha.kdim), m.normal(B, Lk, mha.vdim)]
            anames = ["query", "key", "value"]
        params = [m.normal(*mha.params[n].shape) for n in pnames]
        return fwd, bwd, acts + params, anames + pnames

    return build


# -------------------------------------------------------------------- the layers around attention


def _layer_norm(xp, dtype, rng):
    m = _Maker(xp, dtype, rng)
    x, w, b = m.normal(2, 3, 5), m.normal(5), m.normal(5)  # [B, L, D], [D], [D]
    return (lambda x, w, b: Ly.layer_norm_forward(x, w, b, eps=1e-5), Ly.layer_norm_backward,
            [x, w, b], ["x", "weight", "bias"])


def _activation(name):
    def build(xp, dtype, rng):
        x = _Maker(xp, dtype, rng).normal(2, 3, 5)  # (no entry at relu's kink 0: a normal draw)
        if name == "relu":
            return Ly.relu_forward, Ly.relu_backward, [x], ["x"]
        return (lambda x: Ly.gelu_forward(x, approximate=name), Ly.gelu_backward, [x], ["x"])

    return build


def _feed_forward(xp, dtype, rng):
    m = _Maker(xp, dtype, rng)
    D, FF = 4, 6
    x = m.normal(2, 3, D)  # [B, L, D]
    w1, b1, w2, b2 = m.normal(FF, D), m.normal(FF), m.normal(D, FF), m.normal(D)
    keep = m.keep((2, 3, FF), 0.25)

    def forward(x, w1, b1, w2, b2):
        return Ly.feed_forward_forward(x, w1, b1, w2, b2, activation="gelu", dropout_p=0.25,
                                       dropout_mask=keep)

    return forward, Ly.feed_forward_backward, [x, w1, b1, w2, b2], ["x", "w1", "b1", "w2", "b2"]


def _residual(xp, dtype, rng):
    m = _Maker(xp, dtype, rng)
    return Ly.residual_forward, Ly.residual_backward, [m.normal(2, 3, 4), m.normal(2, 3, 4)], ["x", "y"]


def _mean_pool(xp, dtype, rng):
    m = _Maker(xp, dtype, rng)
    keep = m.bool(_padding_keep(3, 4, [4, 2, 0]))  # [B, L]: one sequence has no token
    return (lambda x: Ly.mean_pool_forward(x, keep), Ly.mean_pool_backward, [m.normal(3, 4, 5)], ["x"])


def _embedding(xp, dtype, rng):
    m = _Maker(xp, dtype, rng)
    ids = from_numpy(np.array([[0, 3, 3], [5, 1, 0]]), xp)  # [B, L]: token 3 twice, 2 and 4 absent
    table = m.normal(6, 4)  # [V, D]
    return (lambda table: nn.embedding_forward(ids, table),
            lambda d, c: nn.embedding_backward(d, c)[1], [table], ["table"])


def _add_positions(xp, dtype, rng):
    m = _Maker(xp, dtype, rng)
    return (nn.add_positions_forward, nn.add_positions_backward, [m.normal(2, 3, 4), m.normal(3, 4)],
            ["x", "pos"])


def _cross_entropy(weight=None, **options):
    def build(xp, dtype, rng):
        m = _Maker(xp, dtype, rng)
        t = np.array([[0, 4, 2], [2, 1, 4]])  # [B, L]; 2 (a class id) is ignored with ignore_index=2
        targets = from_numpy(t, xp)
        w = None if weight is None else m.put(weight)  # [V] class weights, constants

        def forward(z):  # the weights in the dtype of the logits (the differences run in float64)
            return nn.cross_entropy_forward(z, targets, **options,
                                            weight=None if w is None else xp.astype(w, z.dtype))

        return (forward, lambda d, c: nn.cross_entropy_backward(d, c)[0], [m.normal(2, 3, 5)], ["logits"])

    return build


def _rope(xp, dtype, rng):
    x = _Maker(xp, dtype, rng).normal(2, 2, 3, 4)  # [B, H, L, Dh]
    return (lambda x: Pos.rope_forward(x, base=100.0), lambda d, c: Pos.rope_backward(d, c)[0], [x], ["x"])


def _relative_scores(xp, dtype, rng):
    m = _Maker(xp, dtype, rng)
    q, table = m.normal(2, 2, 3, 4), m.normal(5, 4)  # [B, H, Lq, Dh], [2 M - 1, Dh], M = 3
    return (lambda q, table: Pos.relative_scores_forward(q, table, 4),
            lambda d, c: Pos.relative_scores_backward(d, c)[:2], [q, table], ["q", "table"])


def _relative_bias(xp, dtype, rng):
    table = _Maker(xp, dtype, rng).normal(6, 2)  # [num_buckets, H]
    return (lambda table: Pos.relative_bias_forward(table, 3, 5, max_distance=8),
            lambda d, c: Pos.relative_bias_backward(d, c)[0], [table], ["table"])


def _model_pair(make, call, backward_acts):
    """A block or a model as a pure pair over (inputs, parameters), one model per dtype (the
    differences run in float64). ``call(model, *acts)`` is its forward; ``backward_acts(model,
    dout)`` the gradients of ``acts`` from its backward (which fills ``model.grads``)."""
    models: dict = {}

    def model_for(dtype):
        if dtype not in models:
            models[dtype] = make(dtype)
        return models[dtype]

    def pair(n_acts, pnames):
        def forward(*args):
            model = model_for(args[-1].dtype)
            model.params = dict(zip(pnames, args[n_acts:]))
            return call(model, *args[:n_acts]), model

        def backward(dout, model):
            dacts = backward_acts(model, dout)
            return (*dacts, *[model.grads[n] for n in pnames])

        return forward, backward

    return model_for, pair


def _block(decoder, *, norm_first, activation, is_causal):
    def build(xp, dtype, rng):
        m = _Maker(xp, dtype, rng)
        B, L, Lm, D, H, FF, p = 2, 3, 4, 4, 2, 6, 0.2
        kind = TransformerDecoderBlock if decoder else TransformerBlock

        def make(dt):
            return kind(D, H, FF, dropout=p, activation=activation, norm_first=norm_first,
                        dtype="float64" if dt == xp.float64 else "float32", backend=xp, seed=0)

        shapes = {"self_attn": (B, H, L, L), "multihead_attn": (B, H, L, Lm), "dropout": (B, L, FF)}
        sites = DECODER_DROPOUT_SITES if decoder else ENCODER_DROPOUT_SITES
        keeps = {s: m.keep(shapes.get(s, (B, L, D)), p) for s in sites}
        pad = m.bool(_padding_keep(B, Lm if decoder else L, [2, Lm if decoder else L])[:, None, None, :])

        def call(block, *acts):  # (x, memory) for the decoder, (x,) for the encoder
            if decoder:
                return block.forward(*acts, memory_mask=pad, is_causal=is_causal, dropout_masks=keeps)
            return block.forward(*acts, mask=pad, is_causal=is_causal, dropout_masks=keeps)

        def backward_acts(block, dout):  # (dx, dmemory), or dx alone
            return block.backward(dout) if decoder else (block.backward(dout),)
        model_for, pair = _model_pair(make, call, backward_acts)
        pnames = list(model_for(xp.float64).params)
        acts, anames = ([m.normal(B, L, D), m.normal(B, Lm, D)], ["x", "memory"]) if decoder else (
            [m.normal(B, L, D)], ["x"])
        params = [m.normal(*model_for(xp.float64).params[n].shape) for n in pnames]
        return (*pair(len(acts), pnames), acts + params, anames + pnames)

    return build


def _gpt(xp, dtype, rng):
    m = _Maker(xp, dtype, rng)
    ids = from_numpy(np.array([[1, 0, 4, 4], [2, 6, 3, 1]]), xp)  # [B, L], vocabulary of 7

    def make(dt):
        return GPT(7, 5, 4, 1, 2, 6, dtype="float64" if dt == xp.float64 else "float32", backend=xp,
                   seed=0)

    def backward_acts(model, dlogits):  # fills model.grads; ids have no gradient
        model.backward(dlogits)
        return ()

    model_for, pair = _model_pair(make, lambda model: model.forward(ids), backward_acts)
    pnames = list(model_for(xp.float64).params)
    params = [m.normal(*model_for(xp.float64).params[n].shape) for n in pnames]
    return (*pair(0, pnames), params, pnames)


def panel(backend: Optional[str] = None) -> list:
    """The fixed list of ``Check`` configurations that ``npattn check`` runs.

    Every configuration runs the reference code of ``npattn.functional``
    (the module with ``impl="reference"``). Then each sdpa and module
    configuration runs again on every other implementation of attention
    (``npattn.attention``): the blocked one, with blocks of 2 x 3 so that every
    case crosses blocks, marked "[blocked]", on every backend but dask; for
    ``backend="numpy"`` the NumPy kernel, marked "[numpy kernel]"; and for
    ``backend="dask"`` the chunked implementation with chunks ``AUDIT_CHUNKS``,
    marked "[chunked]", in place of the blocked one (the blocked loops run on
    dask arrays as written, but their graph is so large that each row takes
    minutes; the chunked implementation runs the blocked steps inside its tasks).
    """
    checks = _reference_panel()
    if backend == "dask":  # blocked's loops on dask arrays build huge graphs (minutes per row)
        impls = [("chunked", "chunked")]
    else:
        impls = [("blocked", "blocked")] + ([("numpy", "numpy kernel")] if backend == "numpy" else [])
    for impl, label in impls:
        takes_options = impl != "numpy"  # the NumPy kernel takes the window ones
        checks += [Check(f"{c.name} [{label}]", c.kind, c.build, impl=impl)
                   for c in _reference_panel() if c.name.startswith(("sdpa", "mha"))
                   and (takes_options or not c.name.startswith("sdpa options"))]
    return checks


def _reference_panel() -> list:
    P, M, Lr, Md = "primitive", "module", "layer", "model"
    return [
        Check("linear, bias", P, _linear(True)),
        Check("linear, no bias", P, _linear(False)),
        Check("split_heads, H=2", P, _split),
        Check("merge_heads, H=3", P, _merge),
        Check("masked_softmax, no mask", P, _softmax(None)),
        Check("masked_softmax, bool mask, fully masked row", P, _softmax("bool")),
        Check("masked_softmax, float mask -inf, fully masked row", P, _softmax("float")),
        Check("masked_softmax, float padding mask, empty sequence", P, _softmax("padding")),
        Check("masked_softmax, sink, fully masked row", P, _softmax_sink),
        Check("dropout p=0.3, fixed keep-mask", P, _dropout),
        Check("sdpa, Lq=Lk, no mask", P, _sdpa(4, 4)),
        Check("sdpa, Lq!=Lk, bool padding mask", P, _sdpa(3, 5, "bool_padding")),
        Check("sdpa, Lq!=Lk, causal", P, _sdpa(4, 6, is_causal=True)),
        Check("sdpa, float mask -inf, fully masked row", P, _sdpa(3, 5, "float")),
        Check("sdpa, causal + float mask", P, _sdpa(4, 4, "float", is_causal=True)),
        Check("sdpa, bool mask, fully masked rows, dropout p=0.25", P,
              _sdpa(3, 5, "bool_full_rows", dropout_p=0.25)),
        Check("sdpa, GQA Hq=4 Hkv=2, Dv=5 != Dh, causal + float mask", P,
              _sdpa(4, 6, "float", is_causal=True, gqa=True, Dv=5)),
        Check("sdpa options: window, softcap, ALiBi, segments, GQA, dropout, float mask", P,
              _sdpa_options(5, 7, align="top_left", sinks=False)),
        Check("sdpa options, bottom-right, Lq > Lk, + sinks", P,
              _sdpa_options(6, 4, align="bottom_right", sinks=True)),
        Check("sdpa window (2, 1) + causal, bottom-right, Lq > Lk, GQA, dropout, float mask", P,
              _sdpa_options(6, 4, align="bottom_right", sinks=False, window_only=True)),
        Check("mha self, bias, no mask", M, _mha(True)),
        Check("mha self, no bias, causal", M, _mha(True, bias=False, is_causal=True)),
        Check("mha cross, kdim=5 vdim=3, bool padding mask", M,
              _mha(False, kdim=5, vdim=3, mask_kind="bool_padding")),
        Check("mha cross, no bias, float mask -inf, fully masked row", M,
              _mha(False, bias=False, mask_kind="float")),
        Check("mha self, causal + bool mask, fully masked row, dropout p=0.2", M,
              _mha(True, mask_kind="bool_full_rows", is_causal=True, dropout_p=0.2)),
        # the layers, embeddings, positions and loss around attention, and the models
        Check("layer_norm, weight and bias", Lr, _layer_norm),
        Check("relu", Lr, _activation("relu")),
        Check("gelu, exact", Lr, _activation("none")),
        Check("gelu, tanh", Lr, _activation("tanh")),
        Check("feed_forward, gelu, dropout p=0.25, fixed keep-mask", Lr, _feed_forward),
        Check("residual", Lr, _residual),
        Check("mean_pool, bool mask, a sequence without tokens", Lr, _mean_pool),
        Check("embedding, repeated and absent ids", Lr, _embedding),
        Check("add_positions", Lr, _add_positions),
        Check("cross_entropy", Lr, _cross_entropy()),
        Check("cross_entropy, class weights with a 0, ignore_index=2 (a class id), label_smoothing=0.1, "
              "reduction='none'", Lr, _cross_entropy(weight=[0.5, 2.0, 1.0, 0.0, 1.5], ignore_index=2,
                                                     label_smoothing=0.1, reduction="none")),
        Check("rope", Lr, _rope),
        Check("relative_scores (Shaw), Lq != Lk", Lr, _relative_scores),
        Check("relative_bias (T5), Lq != Lk", Lr, _relative_bias),
        Check("encoder block, post-norm, relu, padding mask, dropout p=0.2, fixed keep-masks", Md,
              _block(False, norm_first=False, activation="relu", is_causal=False)),
        Check("encoder block, pre-norm, gelu, causal + padding mask, dropout p=0.2, fixed keep-masks", Md,
              _block(False, norm_first=True, activation="gelu", is_causal=True)),
        Check("decoder block, post-norm, gelu, causal, memory padding mask, dropout p=0.2, fixed keep-masks",
              Md, _block(True, norm_first=False, activation="gelu", is_causal=True)),
        Check("gpt, 1 layer, tied head", Md, _gpt),
    ]


# --------------------------------------------------------------------------
# running it


def _scale(g, n) -> float:
    return float(max(np.max(np.abs(g), initial=0.0), np.max(np.abs(n), initial=0.0)))


def _compare(g, n, floor, rtol, atol):
    err = float(np.max(np.abs(g - n), initial=0.0))
    scale = max(_scale(g, n), floor)
    if not math.isfinite(err) or not math.isfinite(scale):
        return math.nan, math.nan, False
    rel = err / scale if scale > 0 else (0.0 if err == 0 else math.inf)
    return err, rel, err <= atol + rtol * scale


def run_check(check: Check, xp, dtype: str, *, seed: int = 0) -> list:
    """Rows for one configuration: one per differentiable input (masks with a float dtype included)."""
    return _run_check(check, xp, dtype, seed)


def _run_check(check: Check, xp, dtype: str, seed: int) -> list:
    rtol, atol = TOLERANCES[dtype]
    rng = np.random.default_rng(seed)
    try:
        build_args = (xp, getattr(xp, dtype), rng)
        built = check.build(*build_args) if check.impl is None else check.build(*build_args,
                                                                                 impl=check.impl)
        fwd, bwd, inputs, names = built
        wrt = [i for i, x in enumerate(inputs) if xp.isdtype(x.dtype, "real floating")]
        out, cache = fwd(*inputs)
        dout = xp.astype(from_numpy(rng.standard_normal(tuple(out.shape)), xp), out.dtype)
        grads = bwd(dout, cache)
        grads = grads if isinstance(grads, (tuple, list)) else (grads,)
        numeric = numerical_vjp(lambda *a: fwd(*a)[0], inputs, dout, eps=EPS, wrt=wrt)
    except Exception as exc:  # a crash is a failure of the whole configuration
        return [Row(check.name, "(all)", math.nan, math.nan, False,
                    f"{type(exc).__name__}: {exc}")]
    rows, pairs = {}, {}
    for i in wrt:
        g = grads[i] if i < len(grads) else None
        if g is None:
            rows[i] = Row(check.name, names[i], math.nan, math.nan, False,
                          "backward returned None")
        elif tuple(g.shape) != numeric[i].shape:
            rows[i] = Row(check.name, names[i], math.nan, math.nan, False,
                          f"gradient shape {tuple(g.shape)}, expected {numeric[i].shape}")
        else:
            pairs[i] = (np.asarray(to_numpy(g), dtype=np.float64), numeric[i])
    # the configuration's gradient scale S, for the floor (see the module docstring)
    S = max((_scale(g, n) for g, n in pairs.values()), default=0.0)
    floor = FLOOR * S if math.isfinite(S) else 0.0
    for i, (g, n) in pairs.items():
        if _scale(g, n) == 0.0:  # nothing to compare: the configuration does not test it
            rows[i] = Row(check.name, names[i], 0.0, math.nan, False,
                          "the gradient is 0 both ways: this configuration does not exercise it")
        else:
            rows[i] = Row(check.name, names[i], *_compare(g, n, floor, rtol, atol))
    return [rows[i] for i in wrt]


def _scheduler(backend: str):
    """dask's synchronous scheduler for a dask audit (thousands of tiny graphs: no thread pool);
    JAX's x64 mode for a JAX audit (the finite differences run in float64), restored after."""
    if backend == "jax":
        return _jax_x64()
    if backend != "dask":
        return contextlib.nullcontext()
    import dask

    return dask.config.set(scheduler="synchronous")


@contextlib.contextmanager
def _jax_x64():
    import jax

    # (getattr: jax adds the documented attribute at run time, where type checkers do not see it)
    previous = bool(getattr(jax.config, "jax_enable_x64"))
    jax.config.update("jax_enable_x64", True)
    try:
        yield
    finally:
        jax.config.update("jax_enable_x64", previous)


def run_audit(backend: str = "numpy", dtype: str = "float64", *, progress=None,
              checks=None) -> AuditResult:
    """Run the panel on ``backend`` in ``dtype``.

    Parameters
    ----------
    backend : str
        "numpy", "array_api_strict", "torch", "cupy", "dask" or "jax" (JAX's
        ``jax_enable_x64`` is switched on while the audit runs, then put back).
    dtype : {"float64", "float32"}
    progress : callable, optional
        Called as ``progress(i, n, check_name)`` before each configuration, and
        as ``progress(n, n, "")`` once all are done.
    checks : list of Check, optional
        Default ``panel()``.

    Returns
    -------
    AuditResult
    """
    check_choice("dtype", dtype, tuple(TOLERANCES))
    xp = resolve_backend(backend)
    checks = panel(backend) if checks is None else checks
    rtol, atol = TOLERANCES[dtype]
    start = time.perf_counter()
    rows = []
    with _scheduler(backend):
        for i, check in enumerate(checks):
            if progress is not None:
                progress(i, len(checks), check.name)
            rows.extend(run_check(check, xp, dtype, seed=i))
    if progress is not None:
        progress(len(checks), len(checks), "")
    return AuditResult(backend, dtype, rtol, atol, rows, time.perf_counter() - start)


def format_table(result: AuditResult) -> str:
    """The audit as a text table, one row per (configuration, tensor), and a summary line."""
    cw = max([len("configuration"), *(len(r.config) for r in result.rows)])
    tw = max([len("tensor"), *(len(r.tensor) for r in result.rows)])
    head = f"{'configuration':<{cw}}  {'tensor':<{tw}}  {'max abs err':>11}  {'max rel err':>11}  result"
    lines = [head, "-" * len(head)]
    for r in result.rows:
        verdict = "pass" if r.passed else "FAIL"
        lines.append(
            f"{r.config:<{cw}}  {r.tensor:<{tw}}  {r.max_abs_err:11.2e}  {r.max_rel_err:11.2e}  {verdict}"
            + (f"  ({r.error})" if r.error else "")
        )
    lines.append("-" * len(head))
    lines.append(summary_line(result))
    return "\n".join(lines)


def summary_line(result: AuditResult) -> str:
    n, bad = len(result.rows), result.n_failed
    n_cfg = len({r.config for r in result.rows})
    if bad:
        verdict = f"{bad} FAILED"
    elif n:
        verdict = "all gradients match finite differences"
    else:  # no rows: not ok either (AuditResult.ok)
        verdict = "nothing was checked"
    return (
        f"{n - bad}/{n} passed over {n_cfg} configurations ({result.backend}, {result.dtype}, "
        f"rtol={result.rtol:g}, atol={result.atol:g}) in {result.seconds:.1f}s: {verdict}"
    )
