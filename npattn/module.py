"""``MultiHeadAttention``: a thin stateful composition of ``npattn.functional``.

The module owns its parameters, a seeded dropout generator and the cache of
its last forward; every computation is a call into the functional pairs.

Shape legend: B batch, H heads, Lq query length, Lk key length,
D = d_model, Dh = D // H, Dk = kdim, Dv = vdim.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import numpy as np

from . import functional as F
from .backend import from_numpy, resolve_backend

__all__ = ["MultiHeadAttention"]

PARAM_NAMES = ("w_q", "w_k", "w_v", "w_o", "b_q", "b_k", "b_v", "b_o")


class MHACache(NamedTuple):
    q_proj: F.LinearCache
    k_proj: F.LinearCache
    v_proj: F.LinearCache
    split: F.HeadsCache
    sdpa: F.SDPACache
    merge: F.HeadsCache
    out_proj: F.LinearCache
    out_shape: tuple
    out_dtype: Any


class MultiHeadAttention:
    """Multi-head attention with a hand-derived backward.

    Forward, for query (B, Lq, D), key (B, Lk, Dk), value (B, Lk, Dv)::

        1. q  = query @ w_q.T + b_q          [B, Lq, D]
        2. k  = key   @ w_k.T + b_k          [B, Lk, D]
        3. v  = value @ w_v.T + b_v          [B, Lk, D]
        4. qh, kh, vh = split_heads(q, k, v) [B, H, L, Dh]
        5. oh = sdpa(qh, kh, vh, mask)       [B, H, Lq, Dh]
        6. o  = merge_heads(oh)              [B, Lq, D]
        7. out = o @ w_o.T + b_o             [B, Lq, D]

    Parameters
    ----------
    d_model : int
        Model width D; must be divisible by ``n_head``.
    n_head : int
        Number of heads H.
    dropout : float
        Drop probability on the attention probabilities, in [0, 1).
    bias : bool
        Whether the four projections have biases.
    kdim, vdim : int, optional
        Feature sizes of key and value; default ``d_model``.
    dtype : str
        Parameter dtype, "float32" (default), "float64" or "float16".
    seed : int, optional
        Seeds the Xavier-uniform initialisation and the dropout generator.
    backend : str or namespace module
        "numpy", "cupy", "array_api_strict", "torch", or an Array API namespace.

    Attributes
    ----------
    params : dict
        ``w_q`` (D, D), ``w_k`` (D, Dk), ``w_v`` (D, Dv), ``w_o`` (D, D) in
        PyTorch's (out, in) layout, and ``b_q b_k b_v b_o`` (D,) when bias is
        on. Assigning an array to a key replaces that parameter.
    grads : dict
        Filled by ``backward`` with the same keys as ``params``.
    training : bool
        True after ``train()`` (the default), False after ``eval()``.
    """

    def __init__(
        self,
        d_model: int,
        n_head: int,
        *,
        dropout: float = 0.0,
        bias: bool = True,
        kdim=None,
        vdim=None,
        dtype: str = "float32",
        seed=None,
        backend="numpy",
    ):
        self.xp = xp = resolve_backend(backend)
        self.d_model = d_model
        self.n_head = n_head
        self.head_dim = d_model // n_head
        self.kdim = d_model if kdim is None else kdim
        self.vdim = d_model if vdim is None else vdim
        self.dropout = float(dropout)
        self.bias = bool(bias)
        self.dtype = getattr(xp, dtype)
        self.training = True
        init_seq, dropout_seq = np.random.SeedSequence(seed).spawn(2)
        self._rng = np.random.default_rng(dropout_seq)
        self.params = self._init_params(np.random.default_rng(init_seq))
        self.grads: dict = {}
        self._cache = None

    # ------------------------------------------------------------------ setup

    def _init_params(self, rng: np.random.Generator) -> dict:
        """Xavier/Glorot uniform weights, U(-a, a) with a = sqrt(6 / (fan_in + fan_out)); zero biases.

        Drawn in float64 on the host, then cast, so one seed gives the same
        parameters on every backend.
        """
        D = self.d_model
        shapes = {"w_q": (D, D), "w_k": (D, self.kdim), "w_v": (D, self.vdim), "w_o": (D, D)}
        params = {}
        for name, (fan_out, fan_in) in shapes.items():
            a = math.sqrt(6.0 / (fan_in + fan_out))
            params[name] = self._asparam(rng.uniform(-a, a, size=(fan_out, fan_in)))
        if self.bias:
            for name in ("b_q", "b_k", "b_v", "b_o"):
                params[name] = self._asparam(np.zeros(D))
        return params

    def _asparam(self, a: np.ndarray):
        return self.xp.astype(from_numpy(a, self.xp), self.dtype)

    def train(self, mode: bool = True):
        """Training mode: dropout acts (when ``dropout > 0``). Returns self."""
        self.training = bool(mode)
        return self

    def eval(self):
        """Evaluation mode: dropout is off. Returns self."""
        return self.train(False)

    # ---------------------------------------------------------------- forward

    def __call__(self, query, key, value, **kwargs):
        return self.forward(query, key, value, **kwargs)

    def forward(
        self,
        query,
        key,
        value,
        *,
        mask=None,
        is_causal: bool = False,
        dropout_mask=None,
        need_weights: bool = False,
    ):
        """Attend from ``query`` to ``key``/``value``.

        Parameters
        ----------
        query : array, shape (B, Lq, D)
        key : array, shape (B, Lk, Dk)
        value : array, shape (B, Lk, Dv)
        mask : array, optional
            Boolean (True = may attend) or floating (added to the scaled
            scores, ``-inf`` allowed), of a shape broadcastable to
            (B, H, Lq, Lk): (Lq, Lk), (1, 1, Lq, Lk), (B, 1, Lq, Lk),
            (B, 1, 1, Lk) or (B, H, Lq, Lk).
        is_causal : bool
            Query i attends keys j <= i (top-left); ANDed with ``mask``.
        dropout_mask : bool array broadcastable to (B, H, Lq, Lk), optional
            Keep-mask used instead of the generator. Dropout, and so this
            mask, acts only in training mode with ``dropout > 0``.
        need_weights : bool
            Also return the attention weights (B, H, Lq, Lk), before dropout.

        Returns
        -------
        out : array, shape (B, Lq, D), or ``(out, weights)`` with ``need_weights``.
        """
        P = self.params
        H = self.n_head
        use_dropout = self.training and self.dropout > 0.0
        self._cache = None  # free the last forward's cache before this one builds its own

        if query is key and key is value:  # self-attention: 1.-3. as one GEMM
            q, k, v, q_c, k_c, v_c = self._project_self(query)
        else:
            q, q_c = F.linear_forward(query, P["w_q"], P.get("b_q"))  # 1.   [B, Lq, D]
            k, k_c = F.linear_forward(key, P["w_k"], P.get("b_k"))  # 2.     [B, Lk, D]
            v, v_c = F.linear_forward(value, P["w_v"], P.get("b_v"))  # 3.   [B, Lk, D]
        qh, split_c = F.split_heads_forward(q, H)  # 4.                  [B, H, Lq, Dh]
        kh, _ = F.split_heads_forward(k, H)  # [B, H, Lk, Dh]
        vh, _ = F.split_heads_forward(v, H)  # [B, H, Lk, Dh]
        oh, sdpa_c = F.sdpa_forward(  # 5.                               [B, H, Lq, Dh]
            qh,
            kh,
            vh,
            mask=mask,
            is_causal=is_causal,
            dropout_p=self.dropout if use_dropout else 0.0,
            dropout_mask=dropout_mask if use_dropout else None,
            rng=self._rng,
        )
        o, merge_c = F.merge_heads_forward(oh)  # 6.                     [B, Lq, D]
        out, o_c = F.linear_forward(o, P["w_o"], P.get("b_o"))  # 7.     [B, Lq, D]

        self._cache = MHACache(
            q_c, k_c, v_c, split_c, sdpa_c, merge_c, o_c, tuple(out.shape), out.dtype
        )
        if need_weights:
            return out, self.xp.astype(sdpa_c.probs, out.dtype)  # [B, H, Lq, Lk]
        return out

    def _project_self(self, x):
        """Steps 1.-3. for query = key = value = x, with one (3D, D) weight.

        ``[q | k | v] = x @ [w_q; w_k; w_v].T + [b_q | b_k | b_v]`` is one GEMM
        instead of three. The caches are those of the three separate
        projections (same input, own weight), so the backward is unchanged.
        """
        xp, P, D = self.xp, self.params, self.d_model
        w = xp.concat([P["w_q"], P["w_k"], P["w_v"]], axis=0)  # [3D, D]
        b = xp.concat([P["b_q"], P["b_k"], P["b_v"]]) if self.bias else None  # [3D]
        qkv, _ = F.linear_forward(x, w, b)  # [B, L, 3D]
        q, k, v = qkv[..., :D], qkv[..., D : 2 * D], qkv[..., 2 * D :]  # [B, L, D] views
        caches = (F.LinearCache(x, P[n], self.bias) for n in ("w_q", "w_k", "w_v"))
        return (q, k, v, *caches)

    # --------------------------------------------------------------- backward

    def backward(self, dout):
        """Backpropagate ``dout`` (B, Lq, D) through the last forward.

        Fills ``self.grads`` (same keys as ``params``) and returns
        ``(dquery, dkey, dvalue)``. In self-attention the caller sums the three.
        """
        c = self._cache
        # 7. out = o @ w_o.T + b_o
        do, dw_o, db_o = F.linear_backward(dout, c.out_proj)  # [B, Lq, D]
        # 6. o = merge_heads(oh)
        doh = F.merge_heads_backward(do, c.merge)  # [B, H, Lq, Dh]
        # 5. oh = sdpa(qh, kh, vh, mask)
        dqh, dkh, dvh, _ = F.sdpa_backward(doh, c.sdpa)
        # 4. qh, kh, vh = split_heads(q), split_heads(k), split_heads(v)
        dq = F.split_heads_backward(dqh, c.split)  # [B, Lq, D]
        dk = F.split_heads_backward(dkh, c.split)  # [B, Lk, D]
        dv = F.split_heads_backward(dvh, c.split)  # [B, Lk, D]
        # 3.-1. v = value @ w_v.T + b_v, and so on
        dvalue, dw_v, db_v = F.linear_backward(dv, c.v_proj)  # [B, Lk, Dv]
        dkey, dw_k, db_k = F.linear_backward(dk, c.k_proj)  # [B, Lk, Dk]
        dquery, dw_q, db_q = F.linear_backward(dq, c.q_proj)  # [B, Lq, D]

        grads = {"w_q": dw_q, "w_k": dw_k, "w_v": dw_v, "w_o": dw_o}
        if self.bias:
            grads.update(b_q=db_q, b_k=db_k, b_v=db_v, b_o=db_o)
        self.grads = grads
        return dquery, dkey, dvalue

    def __repr__(self):
        return (
            f"MultiHeadAttention(d_model={self.d_model}, n_head={self.n_head}, "
            f"dropout={self.dropout}, bias={self.bias}, kdim={self.kdim}, vdim={self.vdim}, "
            f"dtype={self.dtype}, backend={self.xp.__name__!r})"
        )
