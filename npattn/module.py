"""``MultiHeadAttention``: a thin stateful composition of ``npattn.functional``.

The module owns its parameters, a seeded dropout generator and the cache of
its last forward; every computation is a call into the functional pairs.

Shape legend: B batch, H heads, Hkv key/value heads, Lq query length,
Lk key length, n extra keys (add_bias_kv, add_zero_attn), D = d_model,
Dh = D // H, Dkv = Hkv * Dh, Dq = qdim, Dk = kdim, Dv = vdim; with a KV
cache, Lt keys attended (``kvcache.AlignedKV``).
"""

from __future__ import annotations

import contextlib
import io
import json
import math
import os
import zipfile
from typing import Any, Iterator, NamedTuple, Optional, Sequence

import numpy as np

from . import attention as A
from . import functional as F
from . import validation as V
from .backend import (backend_from_ref, backend_name, backend_ref, device_of, exclusive, from_numpy,
                      is_dask_array, is_numpy_array, pool_threads, resolve_backend, seed_sequence,
                      to_numpy, without_empty_chunks)
from .kvcache import KVCache, unalign_columns

__all__ = [
    "MultiHeadAttention", "AttentionState", "ParameterDict", "check_module_args", "check_forward_inputs",
    "check_backward_inputs", "check_param", "check_kv_cache", "check_no_masks_with_cache", "check_softcap",
    "check_forward_impl",
]

PARAM_NAMES = ("w_q", "w_k", "w_v", "w_o", "b_q", "b_k", "b_v", "b_o", "bias_k", "bias_v", "sinks")

#: The per-call options that place queries and keys on positions; the extra keys of
#: add_bias_kv / add_zero_attn have none, so they are refused together.
POSITIONAL_OPTIONS = ("window", "align='bottom_right'", "alibi_slopes", "q_segments",
                      "k_segments", "kv_cache")


class MHACache(NamedTuple):
    """What ``MultiHeadAttention.backward`` needs from ``forward``: the caches of its steps
    (numbered as in the class's docstring)."""
    q_proj: F.LinearCache  #: 1. q = query @ w_q.T + b_q
    k_proj: F.LinearCache  #: 2. k = key @ w_k.T + b_k
    v_proj: F.LinearCache  #: 3. v = value @ w_v.T + b_v
    k_extra: F.AppendKVCache  #: 4. k = append_kv(k, bias_k, add_zero_attn)
    v_extra: F.AppendKVCache  #: 4. v = append_kv(v, bias_v, add_zero_attn)
    mask_pad: Optional[F.PadMaskCache]  #: 4. the mask padded; None when no extra keys were appended
    split: F.HeadsCache  #: 5. split_heads
    sdpa: Any  #: 6. the cache of attention.sdpa_forward (that implementation's own)
    merge: F.HeadsCache  #: 7. merge_heads
    out_proj: F.LinearCache  #: 8. out = o @ w_o.T + b_o
    out_shape: tuple  #: the output's shape: dout must have it
    out_dtype: Any  #: the output's dtype
    owner: Any = None  #: the token of the module whose forward made it (``cache =`` checks it)


class AttentionState(NamedTuple):
    """What a forward of a ``MultiHeadAttention`` leaves for ``backward``, read by
    ``forward_state`` and put back by ``restore_forward_state``."""
    owner: Any  #: the token of the module it was read from
    cache: Optional[MHACache]  #: the cache of the last forward, or None
    decoded: bool  #: the last forward used a kv_cache (backward is then an error that says so)


class MultiHeadAttention:
    """Multi-head attention with a hand-derived backward.

    Forward, for query (B, Lq, Dq), key (B, Lk, Dk), value (B, Lk, Dv)::

        1. q  = query @ w_q.T + b_q                  [B, Lq, D]
        2. k  = key   @ w_k.T + b_k                  [B, Lk, Dkv]
        3. v  = value @ w_v.T + b_v                  [B, Lk, Dkv]
        4. k  = append_kv(k, bias_k, add_zero_attn)  [B, Lk + n, Dkv]
           v  = append_kv(v, bias_v, add_zero_attn)  (and the mask padded
           with attendable columns, see below)
        5. qh, kh, vh = split_heads(q, k, v)         [B, H, Lq, Dh], [B, Hkv, Lk + n, Dh]
        6. oh = sdpa(qh, kh, vh, mask)               [B, H, Lq, Dh]
           (scale, softcap and the learned sinks of the constructor, the
           window, align, alibi_slopes and segments of the call)
        7. o  = merge_heads(oh)                      [B, Lq, D]
        8. out = o @ w_o.T + b_o                     [B, Lq, D]

    Step 4 is torch's ``add_bias_kv`` (a learned key ``bias_k`` and value
    ``bias_v`` appended after the projection) then ``add_zero_attn`` (a zero
    key and value appended last), in torch's order. The user's mask and
    ``is_causal`` cover the Lk given keys; the n extra keys are always
    attendable (a boolean mask is padded with True, a floating one with 0.0),
    as torch pads its own masks. With ``n_kv_head < n_head`` (grouped-query
    attention) query head h uses key/value head ``h // (n_head // n_kv_head)``.

    With ``forward(..., kv_cache=cache)`` (incremental decoding, forward
    only) steps 2.-3. project the new tokens only, step 6. attends over the
    cache's keys followed by them, and they are appended to the cache (see
    ``forward`` and ``npattn.KVCache``).

    Parameters
    ----------
    d_model : int
        Model width D; must be divisible by ``n_head``.
    n_head : int
        Number of heads H.
    dropout : float
        Drop probability on the attention probabilities, in [0, 1).
    bias : bool
        Default of ``qkv_bias`` and ``out_bias``.
    qkv_bias, out_bias : bool, optional
        Whether the Q/K/V projections (``b_q b_k b_v``) and the output
        projection (``b_o``) have biases; each defaults to ``bias``.
    kdim, vdim : int, optional
        Feature sizes of key and value; default ``d_model``.
    qdim : int, optional
        Feature size of the query; default ``d_model``. The output is always
        ``d_model`` wide.
    add_bias_kv : bool
        Append the learned ``bias_k``/``bias_v`` as an extra key/value (torch's
        ``add_bias_kv``; initialised normal with std ``1/sqrt(Dkv)``, as torch's
        Xavier-normal on its (1, 1, D) shape).
    add_zero_attn : bool
        Append a zero key/value after everything else (torch's ``add_zero_attn``).
    n_kv_head : int, optional
        Number of key/value heads Hkv for grouped-query attention; must divide
        ``n_head``. Default ``n_head`` (standard multi-head attention).
    dtype : str or dtype
        Parameter dtype, a name or a dtype object: "float32" (default),
        "float64", "float16", or "bfloat16" on a backend that has it (torch, JAX).
    seed : int or numpy.random.SeedSequence, optional
        Seeds the Xavier-uniform initialisation and the dropout generator:
        None (fresh entropy), an int >= 0 or a ``numpy.random.SeedSequence``
        (spawned from as it stands, on a copy: the one given is not advanced),
        as every constructor's seed (``validation.check_seed``).
    backend : str or namespace module
        "numpy", "cupy", "array_api_strict", "torch", "jax", "dask"
        (``backend.BACKENDS``), or an Array API namespace.
    impl : {"auto", "dense", "reference", "numpy", "blocked", "chunked"}
        Implementation of step 6, chosen per call by ``npattn.attention``:
        "reference" runs ``npattn.functional`` as written; "numpy" the NumPy
        kernel; "dense" the faster of those two for the arrays; "blocked" the
        FlashAttention-2 style algorithm (memory linear in L, no weights);
        "chunked" its dask form (dask arrays, no weights); "auto" takes
        "chunked" for dask arrays and "blocked" for others when weights are
        not requested and the dense probabilities would be large (on a CUDA
        device, for its memory: ``attention.select_impl``), else "dense". All give the same numbers
        to rounding, dropout included.
    block_q, block_k : int, optional
        Query / key block lengths of the blocked and chunked implementations
        (default ``blocked.DEFAULT_BLOCK_Q`` / ``DEFAULT_BLOCK_K``, and
        ``WINDOW_BLOCK_K`` keys when a ``window`` bounds the left side).
    scale : float, optional
        The score scale of step 6., ``s = (q @ k^T) * scale``; default
        ``1 / sqrt(Dh)``.
    softcap : float > 0, optional
        Step 6. caps the scaled scores, ``softcap * tanh(s / softcap)``
        (Gemma 2, flash-attn's ``softcap``).
    sinks : bool
        A learned parameter ``sinks`` (H,), initialised to zeros: head h adds
        ``exp(sinks[h])`` to every row's softmax denominator, a key that
        carries no value (gpt-oss's attention sinks). Its gradient is
        ``grads["sinks"]``.

    Attributes
    ----------
    grads : dict
        Filled by ``backward`` with the same keys as ``params``.
    dmask : array or None
        Filled by ``backward``: the gradient with respect to a floating
        ``mask``, of the mask's own shape; None for a boolean or no mask.
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
        qdim=None,
        qkv_bias=None,
        out_bias=None,
        add_bias_kv: bool = False,
        add_zero_attn: bool = False,
        n_kv_head=None,
        dtype: str = "float32",
        seed=None,
        backend="numpy",
        impl: str = "auto",
        block_q=None,
        block_k=None,
        scale=None,
        softcap=None,
        sinks: bool = False,
    ):
        self.xp = xp = resolve_backend(backend)
        dtype = check_module_args(
            xp, d_model=d_model, n_head=n_head, dropout=dropout, bias=bias, kdim=kdim, vdim=vdim,
            dtype=dtype, seed=seed, qdim=qdim, n_kv_head=n_kv_head, qkv_bias=qkv_bias,
            out_bias=out_bias, add_bias_kv=add_bias_kv, add_zero_attn=add_zero_attn,
            scale=scale, softcap=softcap, sinks=sinks,
        )
        A.check_impl(impl)
        block_q = V.check_positive_int("block_q", block_q, allow_none=True)
        block_k = V.check_positive_int("block_k", block_k, allow_none=True)
        # the sizes, checked, as Python ints: a NumPy int would wrap in the arithmetic on them
        # (fan_in + fan_out of np.uint8(200) and np.uint8(128) is 72)
        d_model, n_head = int(d_model), int(n_head)
        kdim, vdim, qdim, n_kv_head = (None if n is None else int(n)
                                       for n in (kdim, vdim, qdim, n_kv_head))
        self.impl = impl
        self.block_q, self.block_k = block_q, block_k
        self.d_model = d_model
        self.n_head = n_head
        self.head_dim = d_model // n_head
        self.kdim = d_model if kdim is None else kdim
        self.vdim = d_model if vdim is None else vdim
        self.qdim = d_model if qdim is None else qdim
        self.n_kv_head = n_head if n_kv_head is None else n_kv_head
        self.dropout = float(dropout)
        self.bias = bool(bias)
        self.qkv_bias = self.bias if qkv_bias is None else bool(qkv_bias)
        self.out_bias = self.bias if out_bias is None else bool(out_bias)
        self.add_bias_kv = bool(add_bias_kv)
        self.add_zero_attn = bool(add_zero_attn)
        self.scale = None if scale is None else float(scale)
        self.softcap = None if softcap is None else float(softcap)
        self.sinks = bool(sinks)
        self.dtype = getattr(xp, dtype)
        self.training = True
        init_seq, dropout_seq = seed_sequence(seed).spawn(2)
        self._rng = np.random.default_rng(dropout_seq)
        self._params = ParameterDict(self._init_params(np.random.default_rng(init_seq)), xp=xp)
        self.grads: dict = {}
        self.dmask = None
        self._cache: Optional[MHACache] = None
        self._decoded = False  # the last forward used a kv_cache: it has nothing to differentiate
        self._cache_lent = False  # the cache was read through .cache: never given back
        self._workspace = A.Workspace()  # arrays of finished forwards, for the next ones
        self._token = object()  # this module's, in the caches its forwards make (a copy's is new)

    # ------------------------------------------------------------------ setup

    def _init_params(self, rng: np.random.Generator) -> dict:
        """Xavier/Glorot uniform weights, U(-a, a) with a = sqrt(6 / (fan_in + fan_out)); zero biases.

        Drawn in float64 on the host, then cast, so one seed gives the same
        parameters on every backend.
        """
        D, Dkv = self.d_model, self.n_kv_head * self.head_dim
        shapes = {
            "w_q": (D, self.qdim),
            "w_k": (Dkv, self.kdim),
            "w_v": (Dkv, self.vdim),
            "w_o": (D, D),
        }
        params = {}
        for name, (fan_out, fan_in) in shapes.items():
            a = math.sqrt(6.0 / (fan_in + fan_out))
            params[name] = self._asparam(rng.uniform(-a, a, size=(fan_out, fan_in)))
        if self.qkv_bias:
            params["b_q"] = self._asparam(np.zeros(D))
            params["b_k"] = self._asparam(np.zeros(Dkv))
            params["b_v"] = self._asparam(np.zeros(Dkv))
        if self.out_bias:
            params["b_o"] = self._asparam(np.zeros(D))
        if self.add_bias_kv:  # drawn last, so the weights above do not depend on it
            params["bias_k"] = self._asparam(rng.normal(0.0, 1.0 / math.sqrt(Dkv), size=Dkv))
            params["bias_v"] = self._asparam(rng.normal(0.0, 1.0 / math.sqrt(Dkv), size=Dkv))
        if self.sinks:  # zeros: no draw, so the seed gives the same weights with or without
            params["sinks"] = self._asparam(np.zeros(self.n_head))
        return {name: params[name] for name in PARAM_NAMES if name in params}

    @property
    def params(self) -> dict:
        """The parameters, a dict whose assignments are checked (``ParameterDict``).

        ``w_q`` (D, Dq), ``w_k`` (Dkv, Dk), ``w_v`` (Dkv, Dv), ``w_o`` (D, D)
        in PyTorch's (out, in) layout; ``b_q`` (D,), ``b_k b_v`` (Dkv,) with
        ``qkv_bias``; ``b_o`` (D,) with ``out_bias``; ``bias_k bias_v`` (Dkv,)
        with ``add_bias_kv``; ``sinks`` (H,) with ``sinks=True``. Dkv = D
        unless ``n_kv_head`` is set. Assigning
        an array to a key replaces that parameter.
        """
        return self._params

    @params.setter
    def params(self, new: dict):
        # every array is checked (names, library, device, dtype, shape) before any is assigned
        self._params.replace_all(new)

    def _asparam(self, a: np.ndarray):
        return self.xp.astype(from_numpy(a, self.xp), self.dtype)

    def train(self, mode: bool = True) -> "MultiHeadAttention":
        """Training mode: dropout acts (when ``dropout > 0``). Returns self.

        ``mode`` must be a bool (``TypeError`` otherwise: ``train("no")``
        would otherwise mean training).

        Parameters
        ----------
        mode : bool
            True (default) for training, False for evaluation (``eval``).

        Returns
        -------
        self : MultiHeadAttention
        """
        V.check_bool("mode", mode)
        self.training = bool(mode)
        return self

    def eval(self) -> "MultiHeadAttention":
        """Evaluation mode: dropout is off. Returns self."""
        return self.train(False)

    @contextlib.contextmanager
    def preserve_state(self) -> Iterator["MultiHeadAttention"]:
        """Forwards and backwards on the side: on leaving (by an exception too) the module is
        as it was on entering.

        Kept and put back: the arrays ``params`` holds (an array assigned inside is dropped),
        the cache of the last forward (what ``backward`` differentiates), ``grads``,
        ``dmask``, the mode and the dropout generator's state. A ``KVCache`` passed to a
        forward inside is the caller's, not the module's: what is appended to it stays. The
        gradient checker runs in one (``gradcheck.gradcheck_module``).
        """
        params = dict(self._params)
        cache, decoded, lent = self._cache, self._decoded, self._cache_lent
        grads, dmask, training = self.grads, self.dmask, self.training
        rng_state = self._rng.bit_generator.state
        self._cache_lent = True  # the forwards inside must not reuse the kept cache's arrays
        try:
            yield self
        finally:
            self._params.update(params)  # the arrays it held: their checks pass
            self._cache, self._decoded, self._cache_lent = cache, decoded, lent
            self.grads, self.dmask, self.training = grads, dmask, training
            self._rng.bit_generator.state = rng_state

    # ---------------------------------------------------------------- forward

    def __call__(self, query, key, value, **kwargs):
        """``forward(query, key, value, **kwargs)``, as a torch module is called."""
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
        check_finite: bool = False,
        impl=None,
        average_attn_weights: bool = True,
        window=None,
        align=None,
        alibi_slopes=None,
        q_segments=None,
        k_segments=None,
        kv_cache=None,
    ):
        """Attend from ``query`` to ``key``/``value``.

        Parameters
        ----------
        query : array, shape (B, Lq, Dq)
        key : array, shape (B, Lk, Dk)
        value : array, shape (B, Lk, Dv)
        mask : array, optional
            Boolean (True = may attend) or floating (added to the scaled
            scores, ``-inf`` allowed), of a shape broadcastable to
            (B, H, Lq, Lk): (Lq, Lk), (1, 1, Lq, Lk), (B, 1, Lq, Lk),
            (B, 1, 1, Lk) or (B, H, Lq, Lk). It covers the Lk given keys
            only; the extra keys of ``add_bias_kv``/``add_zero_attn`` are
            always attendable.
        is_causal : bool
            Query i attends given keys j <= i + o (``o`` from ``align``);
            ANDed with ``mask``.
        dropout_mask : bool array broadcastable to (B, H, Lq, Lk + n), optional
            Keep-mask used instead of the generator; it covers the n extra
            keys too. Dropout, and so this mask, acts only in training mode
            with ``dropout > 0``.
        need_weights : bool
            Also return the attention weights, before dropout, the extra keys
            last; otherwise ``weights`` is None. Not available with
            ``impl="blocked"`` or ``"chunked"`` (ValueError); "auto" then uses the dense path.
        check_finite : bool
            Also check that the inputs and parameters hold no NaN or inf (and
            the mask no NaN or +inf); reads the data, so it is opt-in.
        impl : {"auto", "dense", "reference", "numpy", "blocked", "chunked"}, optional
            Overrides the module's ``impl`` for this call. The options below
            run on "reference" and "blocked"; ``window`` and ``align`` on
            "numpy" too. With ``alibi_slopes``, segments, ``softcap`` or
            ``sinks``, "dense" is the reference and "numpy" a ValueError.
        average_attn_weights : bool
            With ``need_weights``: the weights averaged over the heads,
            (B, Lq, Lk + n), as torch's default; False gives them per head,
            (B, H, Lq, Lk + n). Ignored without ``need_weights``.
        window : (left, right), optional
            Query i attends key j only if ``i + o - left <= j <= i + o + right``
            (each side an int >= 0 or None, unbounded).
        align : {"top_left", "bottom_right"}, optional
            Where query i sits among the keys: at ``i + o``, ``o = 0``
            (top-left, the default) or ``o = Lk - Lq`` (bottom-right). With
            ``kv_cache`` it is bottom-right (None or "bottom_right").
        alibi_slopes : array, shape (H,) or (B, H), optional
            Adds ``-slope * |i + o - j|`` to the scores (ALiBi).
        q_segments, k_segments : integer arrays (B, Lq) and (B, Lk), optional
            Packed sequences: query i attends key j only when their ids are equal.
        kv_cache : KVCache, optional
            Incremental decoding (self-attention), forward only. ``key`` and
            ``value`` hold the n new tokens (``query`` usually the same ones);
            they are projected, and entry b's queries attend its
            ``cache_seqlens[b]`` cached keys followed by the n new ones,
            bottom-right: query i sits at position ``cache_seqlens[b] + n -
            Lq + i`` of entry b, for causal, ``window`` and ALiBi alike, even
            when the entries' lengths differ (``KVCache.right_aligned``).
            Once the forward has succeeded the new keys and values are
            appended to the cache. The cache must match the module
            (``new_cache``); no ``mask``, ``dropout_mask`` or segments, and
            no dropout: a module in training mode with ``dropout > 0`` is a
            ``ValueError`` (call ``eval()`` first).
            ``backward`` after such a forward is a ``RuntimeError``.

        With ``add_bias_kv`` or ``add_zero_attn`` the positional options
        (``window``, ``align="bottom_right"``, ``alibi_slopes``, the
        segments, ``kv_cache``) are a ``ValueError``: the extra keys have no
        position among the given ones.

        Returns
        -------
        out : array, shape (B, Lq, D)
        weights : array or None
            None unless ``need_weights``. Always a pair, as torch's
            ``MultiheadAttention``: write ``out, _ = mha(x, x, x)``. With
            ``kv_cache``, (B, [H,] Lq, Lt): column j is position j of each
            entry, Lt = max_b(cache_seqlens[b] + n), zeros past an entry's end.

        Raises
        ------
        TypeError, ValueError
            Before any computation, for inputs of the wrong kind, library,
            device, dtype or shape (see ``npattn.validation``), a full
            ``kv_cache``, or an ``impl`` that cannot run the call
            (``check_forward_impl``); the module and the cache are left as
            they were.
        """
        check_forward_inputs(self, query, key, value, mask=mask, dropout_mask=dropout_mask,
                             is_causal=is_causal, need_weights=need_weights,
                             check_finite=check_finite, average_attn_weights=average_attn_weights,
                             window=window, align=align, alibi_slopes=alibi_slopes,
                             q_segments=q_segments, k_segments=k_segments, kv_cache=kv_cache)
        if kv_cache is not None and self.training and self.dropout > 0.0:
            # as the blocks and GPT: a decoded token would otherwise be dropped from a mask
            # drawn for its chunk, unlike the one a full forward draws for its position
            raise ValueError("kv_cache: decoding is forward only, without dropout; call eval() "
                             f"first (the module is in training mode with dropout {self.dropout})")
        impl = self.impl if impl is None else impl
        check_forward_impl(self, impl, (query, key, value, mask, dropout_mask),
                           lengths=(query.shape[0], query.shape[1], key.shape[1]),
                           need_weights=need_weights, alibi_slopes=alibi_slopes,
                           segments=q_segments is not None, kv_cache=kv_cache)
        if align is None:
            align = "top_left" if kv_cache is None else "bottom_right"
        options = dict(window=window, align=align, alibi_slopes=alibi_slopes,
                       q_segments=q_segments, k_segments=k_segments)
        # The generator is advanced, the KV cache appended to and the cache of
        # this forward kept only when the whole forward succeeds: a failed call
        # changes nothing.
        # dask allows chunks of length 0, and its reshape (the heads' split) fails on some
        same = {id(a): without_empty_chunks(a) for a in (query, key, value)}  # keeps `is`
        query, key, value = same[id(query)], same[id(key)], same[id(value)]
        mask, dropout_mask = without_empty_chunks(mask), without_empty_chunks(dropout_mask)
        options = {n: without_empty_chunks(a) for n, a in options.items()}
        rng_state = self._rng.bit_generator.state
        try:
            with exclusive():
                out, cache, aligned, new_kv = self._forward(
                    query, key, value, mask, is_causal, dropout_mask, impl, need_weights,
                    options, kv_cache)
            weights = None  # formed before anything is kept: a failure here changes nothing too
            if need_weights:
                weights = self._weights(cache, aligned, average_attn_weights, out.dtype)
            if kv_cache is not None:
                kv_cache.append(*new_kv)  # checked before the forward: it does not fail
        except BaseException:
            self._rng.bit_generator.state = rng_state
            raise
        old, lent = self._cache, self._cache_lent
        self._cache = None if kv_cache is not None else cache
        self._decoded = kv_cache is not None
        self._cache_lent = False
        if old is not None and not lent:  # nothing reads the previous cache again: lend its arrays
            self._workspace.give(old.sdpa)
        return out, weights

    def _weights(self, cache: MHACache, aligned: Any, average: bool, dtype: Any) -> Any:
        """The attention weights of a forward's ``cache``, as ``forward`` returns them."""
        w = A.weights(cache.sdpa)  # [B, H, Lq, Lk + n] ([B, H, Lq, Lt] with a KV cache)
        if aligned is not None:
            w = unalign_columns(w, aligned.shift)  # column j: position j of each entry
        if average:
            w = self.xp.mean(w, axis=1)  # [B, Lq, Lk + n], in the weights' own precision
        return self.xp.astype(w, dtype)

    def new_cache(self, batch_size: int, capacity: int) -> KVCache:
        """An empty ``KVCache`` for this module: ``batch_size`` sequences of up to ``capacity``
        positions, ``n_kv_head`` heads of width ``head_dim``, the module's dtype, backend and device.

        Parameters
        ----------
        batch_size : int
            B, the sequences the cache holds.
        capacity : int
            The most positions each sequence may hold.

        Returns
        -------
        cache : KVCache
            Empty; its keys and values (B, Hkv, capacity, Dh).
        """
        return KVCache(batch_size, capacity, self.n_kv_head, self.head_dim, dtype=self.dtype,
                       backend=self.xp, device=device_of(self.params["w_q"]))

    @property
    def cache(self):
        """The cache of the last successful forward (an ``MHACache``), or None.

        None after a forward with ``kv_cache`` (decoding keeps nothing to
        differentiate). Assigning a cache that an earlier forward of this
        module returned makes ``backward`` differentiate that forward (the
        gradient checker does this); anything else is a ``TypeError``.
        Assigning back the value read here changes nothing: after decoding,
        None keeps ``backward``'s error saying so (a block puts its modules
        back this way when a forward fails).
        A cache read here is never reused for a later forward's arrays (see
        ``clear_cache``), so it stays valid for as long as it is held.
        """
        self._cache_lent = True
        return self._cache

    @cache.setter
    def cache(self, value):
        if value is not None and not isinstance(value, MHACache):
            raise TypeError(f"cache: expected an MHACache or None, got {V.type_name(value)}")
        if value is not None and value.owner is not self._token:
            raise TypeError("cache: expected a cache of this module's own forwards (or None), got "
                            "one another module made (its backward would differentiate that "
                            "module's forward with this module's parameters)")
        self._cache = value
        if value is not None:  # a forward's cache: backward differentiates it, decoded or not before
            self._decoded = False
        self._cache_lent = True

    def forward_state(self) -> AttentionState:
        """The cache of the last forward and whether that forward decoded, as they are now.

        ``restore_forward_state`` puts them back: a block reads them before its forward and
        puts them back should a later step fail, which ``cache =`` cannot do after decoding
        (None then says nothing of it). The cache read is never reused for a later forward's
        arrays, as one read through ``cache``.
        """
        self._cache_lent = True
        return AttentionState(self._token, self._cache, self._decoded)

    def restore_forward_state(self, state: AttentionState) -> None:
        """Put back a ``forward_state`` of this module; a ``TypeError`` for anything else.

        Parameters
        ----------
        state : AttentionState
            What this module's ``forward_state()`` returned.
        """
        if not isinstance(state, AttentionState) or state.owner is not self._token:
            got = "one of another module" if isinstance(state, AttentionState) else V.type_name(state)
            raise TypeError(f"state: expected an AttentionState read from this module's "
                            f"forward_state(), got {got}")
        self._cache, self._decoded, self._cache_lent = state.cache, state.decoded, True

    def clear_cache(self) -> None:
        """Drop the cache of the last forward (its arrays are freed); ``backward`` then needs a new forward.

        A forward keeps the previous cache until it has succeeded, so two
        caches are alive while it runs. On NumPy the module then keeps the
        previous forward's probabilities (and a dropout keep-mask it drew)
        for the next forward of the same size to write into
        (``npattn.attention.Workspace``; fresh memory costs page faults),
        unless that cache was read through ``cache``. So the module holds up
        to two forwards' (B, H, Lq, Lk) arrays between calls; this frees
        them too. Call it first where memory is tight.
        """
        self._cache = None
        self._decoded = False
        self._cache_lent = False
        self._workspace.clear()

    def _forward(self, query, key, value, mask, is_causal, dropout_mask, impl, need_weights,
                 options, kv_cache):
        """Steps 1.-8. on checked arguments: ``(out, MHACache, aligned, new_kv)``; changes no
        state but the generator.

        With ``kv_cache``, ``aligned`` is the ``AlignedKV`` that step 6. attended and
        ``new_kv`` the new heads ``(kh, vh)`` to append; both None without one.
        """
        P = self.params
        H = self.n_head
        use_dropout = self.training and self.dropout > 0.0

        if query is key and key is value:  # self-attention: 1.-3. as one GEMM
            q, k, v, q_c, k_c, v_c = self._project_self(query)
        else:
            q, q_c = A.linear_forward(query, P["w_q"], P.get("b_q"))  # 1.   [B, Lq, D]
            k, k_c = A.linear_forward(key, P["w_k"], P.get("b_k"))  # 2.     [B, Lk, Dkv]
            v, v_c = A.linear_forward(value, P["w_v"], P.get("b_v"))  # 3.   [B, Lk, Dkv]
        Lq, Lk = q.shape[1], k.shape[1]
        zero = self.add_zero_attn
        k, k_extra_c = F.append_kv_forward(k, P.get("bias_k"), add_zero_attn=zero)  # 4. [B, Lk + n, Dkv]
        v, v_extra_c = F.append_kv_forward(v, P.get("bias_v"), add_zero_attn=zero)  # [B, Lk + n, Dkv]
        n_extra = k.shape[1] - Lk
        mask_c = None
        if n_extra:  # the extra keys stay attendable: is_causal is folded into the padded mask
            mask, mask_c = F.pad_mask_forward(mask, Lq, Lk, n_extra, is_causal=is_causal, like=q)
            is_causal = False  # mask: [..., Lk + n]
        qh, split_c = F.split_heads_forward(q, H)  # 5.                  [B, H, Lq, Dh]
        kh, _ = F.split_heads_forward(k, self.n_kv_head)  # [B, Hkv, Lk + n, Dh]
        vh, _ = F.split_heads_forward(v, self.n_kv_head)  # [B, Hkv, Lk + n, Dh]
        aligned = new_kv = None
        if kv_cache is not None:  # the cached keys, then the new ones, each entry right-aligned
            new_kv = (kh, vh)  # [B, Hkv, Lk, Dh] each, appended once the forward succeeded
            aligned = kv_cache.right_aligned(kh, vh)
            kh, vh, mask = aligned.k, aligned.v, aligned.key_mask  # [B, Hkv, Lt, Dh], [B, 1, 1, Lt]
        oh, sdpa_c = A.sdpa_forward(  # 6.                             [B, H, Lq, Dh]
            qh,
            kh,
            vh,
            impl=impl,
            need_weights=need_weights,
            block_q=self.block_q,
            block_k=self.block_k,
            mask=mask,
            is_causal=is_causal,
            scale=self.scale,
            dropout_p=self.dropout if use_dropout else 0.0,
            dropout_mask=dropout_mask if use_dropout else None,
            rng=self._rng,
            enable_gqa=self.n_kv_head != H,
            softcap=self.softcap,
            sinks=P.get("sinks"),
            workspace=self._workspace,
            **options,
        )
        o, merge_c = F.merge_heads_forward(oh)  # 7.                     [B, Lq, D]
        out, o_c = A.linear_forward(o, P["w_o"], P.get("b_o"))  # 8.     [B, Lq, D]

        cache = MHACache(
            q_c, k_c, v_c, k_extra_c, v_extra_c, mask_c, split_c, sdpa_c, merge_c, o_c,
            tuple(out.shape), out.dtype, self._token,
        )
        return out, cache, aligned, new_kv

    def _project_self(self, x):
        """Steps 1.-3. for query = key = value = x, with one (D + 2 Dkv, D) weight.

        ``[q | k | v] = x @ [w_q; w_k; w_v].T + [b_q | b_k | b_v]`` is one GEMM
        instead of three. The caches are those of the three separate
        projections (same input, own weight), so the backward is unchanged.
        """
        xp, P, D = self.xp, self.params, self.d_model
        Dkv = P["w_k"].shape[0]
        w = xp.concat([P["w_q"], P["w_k"], P["w_v"]], axis=0)  # [D + 2 Dkv, D]
        b = xp.concat([P["b_q"], P["b_k"], P["b_v"]]) if self.qkv_bias else None  # [D + 2 Dkv]
        qkv, _ = A.linear_forward(x, w, b)  # [B, L, D + 2 Dkv]
        q = qkv[..., :D]  # [B, L, D] view
        k = qkv[..., D : D + Dkv]  # [B, L, Dkv] view
        v = qkv[..., D + Dkv :]  # [B, L, Dkv] view
        caches = (F.LinearCache(x, P[n], self.qkv_bias) for n in ("w_q", "w_k", "w_v"))
        return (q, k, v, *caches)

    # --------------------------------------------------------------- backward

    def backward(self, dout: Any) -> tuple[Any, Any, Any]:
        """Backpropagate ``dout`` (B, Lq, D) through the last forward.

        Fills ``self.grads`` (same keys and shapes as ``params``) and
        ``self.dmask`` (floating mask only), and returns
        ``(dquery, dkey, dvalue)``. In self-attention the caller sums the three.
        Raises ``RuntimeError`` before any forward or after a forward with
        ``kv_cache`` (decoding is forward only), and ``ValueError`` /
        ``TypeError`` when ``dout`` does not match the output's shape / dtype.

        Parameters
        ----------
        dout : array, shape (B, Lq, D)

        Returns
        -------
        dquery : array, shape (B, Lq, Dq)
        dkey : array, shape (B, Lk, Dk)
        dvalue : array, shape (B, Lk, Dv)
        """
        check_backward_inputs(self, dout)
        dout = without_empty_chunks(dout)  # as in the forward
        with exclusive():
            grads, dmask, dinputs = self._backward(dout, self._cache)
        self.grads = grads  # assigned only once the whole backward has succeeded
        self.dmask = dmask
        return dinputs

    def _backward(self, dout, c):
        """The backward of the forward that made ``c``: ``(grads, dmask, (dquery, dkey, dvalue))``."""
        # 8. out = o @ w_o.T + b_o
        do, dw_o, db_o = A.linear_backward(dout, c.out_proj)  # [B, Lq, D]
        # 7. o = merge_heads(oh)
        doh = F.merge_heads_backward(do, c.merge)  # [B, H, Lq, Dh]
        # 6. oh = sdpa(qh, kh, vh, mask, sinks); dk, dv summed over each query group under GQA
        dqh, dkh, dvh, dmask, dsinks = A.sdpa_backward(doh, c.sdpa)  # ..., dsinks [H] or None
        # 5. qh, kh, vh = split_heads(q), split_heads(k), split_heads(v)
        dq = F.split_heads_backward(dqh, c.split)  # [B, Lq, D]
        kv_split = F.HeadsCache(self.n_kv_head)  # k and v were split into Hkv heads
        dk = F.split_heads_backward(dkh, kv_split)  # [B, Lk + n, Dkv]
        dv = F.split_heads_backward(dvh, kv_split)  # [B, Lk + n, Dkv]
        # 4. k = append_kv(k, bias_k), v = append_kv(v, bias_v), mask = pad_mask(mask)
        dk, dbias_k = F.append_kv_backward(dk, c.k_extra)  # [B, Lk, Dkv], [Dkv]
        dv, dbias_v = F.append_kv_backward(dv, c.v_extra)  # [B, Lk, Dkv], [Dkv]
        if c.mask_pad is not None:
            dmask = F.pad_mask_backward(dmask, c.mask_pad)  # mask's own shape
        # 3.-1. v = value @ w_v.T + b_v, and so on
        (dvalue, dw_v, db_v), (dkey, dw_k, db_k), (dquery, dw_q, db_q) = A.linear_backwards(
            [(dv, c.v_proj), (dk, c.k_proj), (dq, c.q_proj)]
        )  # [B, Lk, Dv], [B, Lk, Dk], [B, Lq, Dq]: one run of the tile pool for the three

        grads = {"w_q": dw_q, "w_k": dw_k, "w_v": dw_v, "w_o": dw_o}
        if self.qkv_bias:
            grads.update(b_q=db_q, b_k=db_k, b_v=db_v)
        if self.out_bias:
            grads["b_o"] = db_o
        if self.add_bias_kv:
            grads.update(bias_k=dbias_k, bias_v=dbias_v)
        if self.sinks:  # sdpa_backward gives dsinks in q's dtype, the module's
            grads["sinks"] = dsinks
        grads = {name: grads[name] for name in PARAM_NAMES if name in grads}
        return grads, dmask, (dquery, dkey, dvalue)

    def __repr__(self):
        return (
            f"MultiHeadAttention(d_model={self.d_model}, n_head={self.n_head}, "
            f"dropout={self.dropout}, bias={self.bias}, kdim={self.kdim}, vdim={self.vdim}, "
            f"qdim={self.qdim}, qkv_bias={self.qkv_bias}, out_bias={self.out_bias}, "
            f"add_bias_kv={self.add_bias_kv}, add_zero_attn={self.add_zero_attn}, "
            f"n_kv_head={self.n_kv_head}, scale={self.scale}, softcap={self.softcap}, "
            f"sinks={self.sinks}, impl={self.impl!r}, block_q={self.block_q}, block_k={self.block_k}, "
            f"dtype={V.dtype_name(self.dtype)!r}, backend={backend_name(self.xp)!r})"
        )

    # ----------------------------------------------------------- torch interop

    @classmethod
    def from_torch(cls, module: Any, *, backend: Any = "numpy") -> "MultiHeadAttention":
        """A copy of a ``torch.nn.MultiheadAttention``: its layout, weights, dtype, dropout and mode.

        Only the weights are converted: npattn takes (B, L, D) inputs, torch
        takes (L, B, D) unless ``batch_first=True``. See ``npattn.torch_interop``.

        Parameters
        ----------
        module : torch.nn.MultiheadAttention
        backend : str or namespace module
            npattn backend of the copy. A bfloat16 module needs a backend with
            bfloat16 (torch).
        """
        from . import torch_interop

        mha = cls(**torch_interop.config_from_torch(module), backend=backend)
        # its weights held otherwise (a parametrization, pruning) give other keys: named as the module's
        with V.argument_names({"state_dict": "module.state_dict()"}):
            torch_interop.load_torch_state_dict(mha, module.state_dict())
        return mha.train(module.training)

    def load_torch_state_dict(self, state_dict: Any) -> "MultiHeadAttention":
        """Load a ``torch.nn.MultiheadAttention`` state dict into ``params`` (cast to ``self.dtype``).

        Parameters
        ----------
        state_dict : mapping of str to tensor or array
            The keys and shapes of a ``torch.nn.MultiheadAttention`` of this module's
            layout (``torch_interop.load_torch_state_dict``).

        Returns
        -------
        self : MultiHeadAttention
        """
        from .torch_interop import load_torch_state_dict

        load_torch_state_dict(self, state_dict)
        return self

    def torch_state_dict(self) -> Any:
        """``params`` as a ``torch.nn.MultiheadAttention`` state dict of CPU tensors."""
        from .torch_interop import torch_state_dict

        return torch_state_dict(self)

    # ------------------------------------------------------ copy, pickle, save

    def __getstate__(self) -> dict:
        """What ``pickle`` and ``copy.deepcopy`` keep: everything but the namespace and the cache.

        The backend travels by name (``"numpy"``, ``"torch"``, ... or the
        importable name of a namespace module, such as ``"jax.numpy"``) and is
        resolved again on load. Parameters, ``grads``, ``dmask``, the mode,
        the configuration and the dropout generator's state are kept, so a
        copy draws the same next dropout mask as the original. The cache of
        the last forward is dropped: it holds that forward's activations, up
        to a (B, H, Lq, Lk) array, so ``backward`` on a copy needs a forward
        first.
        """
        state = dict(self.__dict__)
        state["xp"] = backend_ref(self.xp)
        state["dtype"] = V.dtype_name(self.dtype)
        state["_params"] = dict(self._params)
        state["_cache"] = None
        state["_cache_lent"] = False
        state["_workspace"] = None  # made again on load
        return state

    def __setstate__(self, state: dict) -> None:
        state = dict(state)
        for name, default in _LATER_ATTRIBUTES.items():  # a pickle of an older npattn
            state.setdefault(name, default)
        xp = backend_from_ref(state["xp"])
        state["xp"] = xp
        state["dtype"] = getattr(xp, state["dtype"])
        state["_params"] = ParameterDict(state["_params"], xp=xp)
        state["_workspace"] = A.Workspace()
        state.setdefault("_token", object())  # a pickle of an older npattn
        self.__dict__.update(state)

    def save(self, path) -> None:
        """Write the parameters and the configuration to ``path``, a portable ``.npz`` file.

        One array per parameter (``param/w_q``, ...; bfloat16 stored as
        float32) and an entry ``config`` holding a JSON string: the format
        name and version (``SAVE_FORMAT``, ``SAVE_VERSION``), the constructor
        arguments, the mode and the dropout generator's state. Nothing is
        pickled. ``scale``, ``softcap`` and ``sinks`` are in the
        configuration only when set (``SAVE_LATER_OPTIONS``), so files that do
        not use them stay readable by older npattn, and older files load
        with their defaults; ``sinks=True`` adds ``param/sinks``. The file is
        written at ``path`` exactly (NumPy's ``savez``
        would append ``.npz`` to a name without it); ``path`` may also be a
        binary file object. Read it back with ``MultiHeadAttention.load``.

        Parameters
        ----------
        path : str, os.PathLike or binary file object
            A file name (not a directory's), or an object with ``write``.
        """
        check_path(path)
        header = {
            "format": SAVE_FORMAT,
            "format_version": SAVE_VERSION,
            "config": self._config(),
            "training": self.training,
            "rng_state": self._rng.bit_generator.state,
            "saved_from_backend": backend_name(self.xp),
        }
        write_save_file(path, header, self.params, xp=self.xp, dtype=self.dtype)

    @classmethod
    def load(cls, path, *, backend="numpy"):
        """A module rebuilt from a file of ``save``, on ``backend`` (any backend, not only the saving one).

        Reads with ``np.load(..., allow_pickle=False)``. Raises ``ValueError``
        naming what is wrong when the file is not such a file: no or a
        malformed ``config`` entry, another format or a ``format_version``
        other than the JSON integer ``SAVE_VERSION`` (a newer file is said to
        be newer), a configuration the constructor rejects, a parameter
        missing, unexpected, of the wrong shape or not floating point, a
        malformed generator state. A ``path`` that names a directory is an
        ``IsADirectoryError``, a missing file a ``FileNotFoundError``.

        Parameters
        ----------
        path : str, os.PathLike or binary file object
            A file written by ``save``, or an object with ``read``.
        backend : str or namespace module
            npattn backend of the module (default "numpy").

        Returns
        -------
        module : MultiHeadAttention
            The saved configuration, parameters (in the saved dtype), mode and
            dropout generator state.

        Raises
        ------
        ValueError
            For a file that is not one ``save`` wrote, as above.
        IsADirectoryError, FileNotFoundError
            For a ``path`` that names a directory, or no file.
        """
        check_path(path, load_of="MultiHeadAttention.save")
        label = save_file_label(path)
        entries = read_npz(label, path)
        header = read_save_header(label, entries.get("config"))
        mha = model_from_config(label, cls, header["config"], backend)
        # the dtype the constructor made of the configuration (its default when the file has none)
        mha.params = params_from_save_file(label, entries, mha.params, xp=mha.xp, dtype=mha.dtype,
                                           saved_dtype=V.dtype_name(mha.dtype))
        mha.train(header["training"])
        set_rng_state(f"{label}: rng_state", mha._rng, header.get("rng_state"))  # None: no state saved
        return mha

    def _config(self) -> dict:
        """The constructor arguments that rebuild this module's layout (not its parameters or backend).

        The arguments added after format version 1 was defined (``SAVE_LATER_OPTIONS``) are
        written only when they differ from their defaults: a file that does not use them
        is read by an npattn that does not know them, and a file without them loads with
        the defaults.
        """
        config = dict(
            d_model=self.d_model, n_head=self.n_head, dropout=self.dropout, bias=self.bias,
            kdim=self.kdim, vdim=self.vdim, qdim=self.qdim, qkv_bias=self.qkv_bias,
            out_bias=self.out_bias, add_bias_kv=self.add_bias_kv, add_zero_attn=self.add_zero_attn,
            n_kv_head=self.n_kv_head, dtype=V.dtype_name(self.dtype), impl=self.impl,
            block_q=self.block_q, block_k=self.block_k,
        )
        for name, default in SAVE_LATER_OPTIONS.items():
            if getattr(self, name) != default:
                config[name] = getattr(self, name)
        return config


# --------------------------------------------------------------------------
# checks of the module's own arguments, in the vocabulary of npattn.validation:
# construction


def check_module_args(xp: Any, *, d_model: Any, n_head: Any, dropout: Any, bias: Any, kdim: Any,
                      vdim: Any, dtype: Any, seed: Any, **layer_args: Any) -> str:
    """Check the arguments of ``MultiHeadAttention(...)``; ``backend`` was resolved to ``xp``.

    ``layer_args`` may hold the optional layer-shape arguments ``qdim`` and
    ``n_kv_head`` (None or a positive int; ``n_kv_head`` divides ``n_head``)
    and the flags ``qkv_bias``, ``out_bias`` (None or bool), ``add_bias_kv``,
    ``add_zero_attn`` (bool); and the attention options ``scale`` (None or a
    finite float), ``softcap`` (None or a finite float > 0) and ``sinks`` (bool).

    Returns the name of the parameter dtype ("float32", ...), which may be
    given as a string or as a dtype object of any library.
    """
    V.check_positive_int("d_model", d_model)
    V.check_positive_int("n_head", n_head)
    if d_model % n_head != 0:
        raise ValueError(
            f"d_model: expected a multiple of n_head={n_head}, got d_model={d_model} "
            f"(d_model % n_head = {d_model % n_head})"
        )
    V.check_probability("dropout", dropout)
    V.check_bool("bias", bias)
    V.check_positive_int("kdim", kdim, allow_none=True)
    V.check_positive_int("vdim", vdim, allow_none=True)
    for name, value in layer_args.items():
        if name in ("qdim", "n_kv_head"):
            V.check_positive_int(name, value, allow_none=True)
        elif name in ("qkv_bias", "out_bias"):  # None: follow bias
            if value is not None:
                V.check_bool(name, value)
        elif name in ("add_bias_kv", "add_zero_attn", "sinks"):
            V.check_bool(name, value)
        elif name == "scale":
            V.check_scale(name, value)
        elif name == "softcap":
            check_softcap(value)
        else:
            raise TypeError(f"check_module_args: expected layer arguments among qdim, n_kv_head, "
                            f"qkv_bias, out_bias, add_bias_kv, add_zero_attn, scale, softcap "
                            f"and sinks, got the unexpected argument {name!r}")
    n_kv_head = layer_args.get("n_kv_head")
    if n_kv_head is not None and n_head % n_kv_head != 0:
        raise ValueError(f"n_kv_head: expected a divisor of n_head={n_head}, got {n_kv_head}")
    V.check_seed("seed", seed)  # as the blocks' and models' seeds
    check_weight_sizes(d_model=d_model, n_head=n_head, kdim=kdim, vdim=vdim,
                       qdim=layer_args.get("qdim"), n_kv_head=n_kv_head)
    return V.float_dtype_name(xp, dtype)


def check_weight_sizes(*, d_model: int, n_head: int, kdim: Optional[int], vdim: Optional[int],
                       qdim: Optional[int], n_kv_head: Optional[int]) -> None:
    """A ``ValueError`` naming the sizes of a weight that would be an array that cannot exist
    (``V.check_array_bytes``; drawn in float64, 8 bytes an entry). The sizes are checked ints."""
    D = int(d_model)
    Dkv = D if n_kv_head is None else int(n_kv_head) * (D // int(n_head))
    kv = ["d_model"] if n_kv_head is None else ["d_model", "n_kv_head"]  # what Dkv comes from
    for weight, rows, row_names, width, width_name in (("w_q", D, ["d_model"], qdim, "qdim"),
                                                       ("w_k", Dkv, kv, kdim, "kdim"),
                                                       ("w_v", Dkv, kv, vdim, "vdim"),
                                                       ("w_o", D, ["d_model"], None, "")):
        names = row_names if width is None else row_names + [width_name]
        shape = (rows, D if width is None else int(width))  # [out, in]
        V.check_array_bytes(names, shape, 8, f"the weight {weight}")


# the kernel options' own check (npattn.validation), also for a module's softcap attribute
check_softcap = V.check_softcap


# --------------------------------------------------------------------------
# parameters


def check_param(name: str, value: Any, *, like: Any, xp: Any) -> None:
    """Check ``value`` as a replacement for parameter ``name`` currently holding ``like``.

    Same library, device, dtype and shape as the array it replaces.
    """
    label = f"params[{name!r}]"
    V.check_array(label, value, xp, device_of(like))
    if value.dtype != like.dtype:
        raise TypeError(
            f"{label}: expected dtype {V.dtype_name(like.dtype)} (the module's dtype), "
            f"got {V.dtype_name(value.dtype)}; cast it first (no silent promotion)"
        )
    if V.shape_of(value) != V.shape_of(like):
        raise ValueError(f"{label}: expected shape {V.shape_of(like)}, got {V.shape_of(value)}")


class ParameterDict(dict):
    """The module's ``params``: a ``dict`` whose keys are fixed and whose values are checked.

    Assigning ``params[name] = array`` goes through ``check_param``: the array
    must have the library, device, dtype and shape of the one it replaces, or
    ``TypeError``/``ValueError`` is raised and nothing changes. Unknown names
    raise ``ValueError``; parameters cannot be deleted (``TypeError``).
    ``update`` checks every value before assigning any. Copies
    (``copy.copy``, ``copy.deepcopy``, ``pickle``, ``.copy()``) are plain
    dicts, ready to be assigned back with ``module.params = saved``.
    """

    def __init__(self, params, *, xp):
        super().__init__(params)
        self._xp = xp

    def _check_item(self, name, value):
        if name not in self:
            raise ValueError(
                f"params: expected one of the names {sorted(self)}, got {name!r}"
            )
        check_param(name, value, like=dict.__getitem__(self, name), xp=self._xp)

    def __setitem__(self, name, value):
        self._check_item(name, value)
        super().__setitem__(name, value)

    def update(self, *args, **kwargs):
        """``dict.update``, checked: every value (as ``params[name] = array``), then all assigned."""
        new = dict(*args, **kwargs)
        for name, value in new.items():
            self._check_item(name, value)
        super().update(new)  # one call: all assigned, or (an interrupt before it) none

    def __ior__(self, other):  # type: ignore[misc]
        self.update(other)
        return self

    def setdefault(self, name, default=None):
        """``params[name]``; the names are fixed, so another ``name`` is a ``ValueError``."""
        if name in self:
            return self[name]
        self._check_item(name, default)  # raises: the names are fixed

    def _refuse_removal(self, call: str) -> None:
        """Always ``TypeError``: parameters cannot be removed (``del``, ``pop``, ``popitem``,
        ``clear``); assign a new array instead."""
        raise TypeError(f"params: expected every parameter to stay (the names are fixed: "
                        f"{', '.join(self)}), got {call}; parameters cannot be removed, assign a "
                        f"new array instead")

    def __delitem__(self, name):
        """Always ``TypeError``: ``del params[name]`` would remove a parameter; assign a new array instead."""
        self._refuse_removal(f"del params[{name!r}]")

    def pop(self, name, *default):
        """Always ``TypeError``: ``params.pop(name)`` would remove a parameter; assign a new array instead."""
        given = ", ".join(repr(a) for a in (name, *default))
        self._refuse_removal(f"params.pop({given})")

    def popitem(self):
        """Always ``TypeError``: ``params.popitem()`` would remove a parameter; assign a new array instead."""
        self._refuse_removal("params.popitem()")

    def clear(self):
        """Always ``TypeError``: ``params.clear()`` would remove a parameter; assign a new array instead."""
        self._refuse_removal("params.clear()")

    def replace_all(self, new: Any) -> None:
        """``module.params = new``: ``new`` must hold exactly the same names; all checked first."""
        if not isinstance(new, dict):
            raise TypeError(f"params: expected a dict of arrays, got {V.type_name(new)}")
        if set(new) != set(self):
            raise ValueError(
                f"params: expected exactly the names {sorted(self)}, got {sorted(map(str, new))}"
            )
        self.update(new)

    def __reduce__(self):
        return (dict, (dict(self),))


# --------------------------------------------------------------------------
# forward / backward


def check_forward_inputs(module: Any, query: Any, key: Any, value: Any, *, mask: Any,
                         dropout_mask: Any, is_causal: Any, need_weights: Any,
                         check_finite: Any = False, average_attn_weights: Any = True,
                         window: Any = None, align: Any = None, alibi_slopes: Any = None,
                         q_segments: Any = None, k_segments: Any = None,
                         kv_cache: Any = None) -> None:
    """Check the arguments of ``MultiHeadAttention.forward`` against ``module``.

    query (B, Lq, D), key (B, Lk, Dk), value (B, Lk, Dv): arrays of the
    module's backend and device, of the parameters' dtype exactly; masks of
    2 or 4 axes broadcasting to (B, H, Lq, Lk). The kernel options (``window``,
    ``align``, ``alibi_slopes``, segments) in the vocabulary of
    ``validation.check_kernel_options``; no positional option with extra keys
    (``POSITIONAL_OPTIONS``); ``kv_cache`` by ``check_kv_cache``.
    """
    V.check_bool("is_causal", is_causal)
    V.check_bool("need_weights", need_weights)
    V.check_bool("check_finite", check_finite)
    V.check_bool("average_attn_weights", average_attn_weights)
    xp = module.xp
    device = device_of(module.params["w_q"])
    dtype = module.dtype
    # input widths are those of the weights (PyTorch layout: (out, in))
    widths = {n: int(module.params[w].shape[1]) for n, w in
              (("query", "w_q"), ("key", "w_k"), ("value", "w_v"))}
    inputs = {"query": query, "key": key, "value": value}
    for name, x in inputs.items():
        V.check_array(name, x, xp, device)
        if x.ndim != 3:
            raise ValueError(
                f"{name}: expected a 3-D array (B, L, {widths[name]}), got shape {V.shape_of(x)}"
            )
    for name, x in inputs.items():
        if x.dtype != dtype:
            got = V.dtype_name(x.dtype)
            # suggest a module dtype only when there is one: never dtype='int64' or 'object'
            hint = (f"cast the input or build the module with dtype={got!r}"
                    if got in V.FLOAT_DTYPES and hasattr(xp, got) else
                    f"cast the input to {V.dtype_name(dtype)}")
            raise TypeError(
                f"{name}: expected dtype {V.dtype_name(dtype)} (the parameters' dtype), got "
                f"{got}; {hint} (no silent promotion)"
            )
    B, Lq, _ = V.shape_of(query)
    for name, x in inputs.items():
        if x.shape[0] != B:
            raise ValueError(
                f"{name}: expected batch size {B} (that of query), got shape {V.shape_of(x)}"
            )
        if x.shape[-1] != widths[name]:
            w = {"query": "w_q", "key": "w_k", "value": "w_v"}[name]
            raise ValueError(
                f"{name}: expected last axis {widths[name]} (the input width of {w}), "
                f"got shape {V.shape_of(x)}"
            )
    Lk = int(key.shape[1])
    if value.shape[1] != Lk:
        raise ValueError(
            f"value: expected length {Lk} (that of key), got shape {V.shape_of(value)}"
        )
    # "name: ..." first, so that a wrapper's argument_names renames it (a block's x, memory)
    for name, x, axis, what in (("query", query, 0, "batch size"), ("query", query, 1, "query length"),
                                ("key", key, 1, "key length")):
        if x.shape[axis] == 0:
            raise ValueError(f"{name}: expected a {what} (axis {axis}) of at least 1, "
                             f"got shape {V.shape_of(x)}")
    if isinstance(kv_cache, KVCache):  # before the masks' shapes, which would ask for the new keys' alone
        check_no_masks_with_cache(mask=mask, dropout_mask=dropout_mask, q_segments=q_segments,
                                  k_segments=k_segments)
    target = (B, module.n_head, Lq, Lk)
    V.check_mask("mask", mask, xp, target=target, target_text="(B, H, Lq, Lk)", dtype=dtype,
               device=device, ndims=(2, 4))
    # the keep-mask also covers the extra keys of add_bias_kv / add_zero_attn, if any
    n_extra = int(bool(getattr(module, "add_bias_kv", False))) + int(
        bool(getattr(module, "add_zero_attn", False)))
    V.check_mask("dropout_mask", dropout_mask, xp, target=(B, module.n_head, Lq, Lk + n_extra),
               target_text="(B, H, Lq, Lk + n)" if n_extra else "(B, H, Lq, Lk)",
               dtype=dtype, device=device, ndims=(2, 4), bool_only=True)
    _check_forward_options(module, query, key, n_extra=n_extra, mask=mask,
                           dropout_mask=dropout_mask, window=window, align=align,
                           alibi_slopes=alibi_slopes, q_segments=q_segments,
                           k_segments=k_segments, kv_cache=kv_cache)
    if check_finite:  # (dask: every count in one graph)
        V.check_finite_arrays([(name, x, False) for name, x in inputs.items()]
                              + [("mask", mask, True), ("alibi_slopes", alibi_slopes, False)]
                              + [(f"params[{name!r}]", p, False) for name, p in module.params.items()], xp)


def _check_forward_options(module: Any, query: Any, key: Any, *, n_extra: int, mask: Any,
                           dropout_mask: Any, window: Any, align: Any, alibi_slopes: Any,
                           q_segments: Any, k_segments: Any, kv_cache: Any) -> None:
    """The per-call kernel options and ``kv_cache`` of ``forward`` (see ``check_forward_inputs``)."""
    B, Lk = int(query.shape[0]), int(key.shape[1])
    resolved = align
    if align is None:
        resolved = "top_left" if kv_cache is None else "bottom_right"
    # query (B, Lq, Dq) and key (B, Lk, Dk) have the lengths and the library of the heads
    V.check_kernel_options(query, key, lead=(B, module.n_head), align=resolved, window=window,
                           alibi_slopes=alibi_slopes, q_segments=q_segments,
                           k_segments=k_segments)
    if n_extra:
        given = {"window": window is not None, "align='bottom_right'": align == "bottom_right",
                 "alibi_slopes": alibi_slopes is not None, "q_segments": q_segments is not None,
                 "k_segments": k_segments is not None, "kv_cache": kv_cache is not None}
        used = [name for name in POSITIONAL_OPTIONS if given[name]]
        if used:
            raise ValueError(
                f"{used[0].split('=')[0]}: expected none of the positional options "
                f"({', '.join(POSITIONAL_OPTIONS)}) with add_bias_kv / add_zero_attn, whose "
                f"extra keys have no position among the given keys; got {', '.join(used)}"
            )
    if kv_cache is None:
        return
    check_kv_cache(module, kv_cache, batch_size=B, n_new=Lk)
    if align == "top_left":
        raise ValueError("align: expected None or 'bottom_right' with kv_cache (the new queries "
                         "are the last positions of each entry), got 'top_left'")


def check_no_masks_with_cache(**given: Any) -> None:
    """The ``ValueError`` for a mask, keep-mask or segments given with ``kv_cache``: entry b
    attends its ``cache_seqlens[b]`` cached keys and the new ones, nothing else."""
    for name, a in given.items():
        if a is not None:
            raise ValueError(
                f"{name}: expected None with kv_cache (entry b attends its cache_seqlens[b] "
                f"cached keys and the new ones), got {V.type_name(a)}"
            )


def check_forward_impl(module: Any, impl: Any, arrays: Sequence[Any], *, lengths: tuple,
                       need_weights: bool = False, alibi_slopes: Any = None,
                       segments: bool = False, kv_cache: Any = None) -> None:
    """That ``impl`` can run step 6. of a forward of ``module`` with these checked arguments,
    refused before steps 1.-5. compute the heads it would be given.

    ``attention.check_impl``, then ``attention.check_impl_takes`` (the refusals of
    ``attention.select_impl``) for the heads q (B, H, Lq, Dh), k and v (B, Hkv, Lk', Dh)
    that step 6. gets: Lk' counts the extra keys of ``add_bias_kv`` / ``add_zero_attn``, or
    with ``kv_cache`` the longest entry's cached keys and the new ones. ``arrays``: the
    inputs the heads are computed from (query, key, value, masks; a model's token ids),
    None skipped; ``lengths``: (B, Lq, Lk) of the call; ``segments``: whether
    ``q_segments`` / ``k_segments`` are given. A bad ``NPATTN_NUM_THREADS`` fails here too.
    """
    A.check_impl(impl, need_weights=need_weights)
    B, Lq, Lk = lengths
    H, Hkv, P = module.n_head, module.n_kv_head, module.params
    n_extra = int(module.add_bias_kv) + int(module.add_zero_attn)
    if kv_cache is not None:
        Lk = max(int(n) for n in kv_cache.cache_seqlens) + Lk  # Lt = max_b(cache_seqlens[b] + n)
    Lk += n_extra
    # the options step 6. passes, as far as the dispatcher reads them (functional.is_positional:
    # the NumPy kernel takes a window and an alignment, the other paths every option): which
    # are set, not their arrays (``an_array`` stands for one)
    an_array = object()
    options = F.PLAIN._replace(softcap=module.softcap,
                               alibi=None if alibi_slopes is None else an_array,
                               sinks=an_array if module.sinks else None,
                               q_segments=an_array if segments else None,
                               k_segments=an_array if segments else None)
    positional = F.is_positional(options)
    given = [a for a in arrays if a is not None]
    known = all(not math.isnan(n) for a in given for n in a.shape)  # dask: known chunk sizes
    shapes = ((B, H, Lq, P["w_q"].shape[0] // H), (B, Hkv, Lk, P["w_k"].shape[0] // Hkv),
              (B, Hkv, Lk, P["w_v"].shape[0] // Hkv))
    kind = type(given[0])
    A.check_impl_takes(impl, positional=positional, same_lead=True,  # q (B, H), k, v (B, Hkv)
                       takes_chunks=known and all(is_dask_array(a) for a in given),
                       takes_kernel=all(is_numpy_array(a) for a in given),
                       got=f"{kind.__module__}.{kind.__name__} of shapes "
                           f"{', '.join(str(tuple(s)) for s in shapes)}")
    pool_threads()


def check_kv_cache(module: Any, kv_cache: Any, *, batch_size: int, n_new: int) -> None:
    """``kv_cache`` for ``module.forward``: a ``KVCache`` of the module's backend, device,
    dtype and heads, of the query's batch size, with room for ``n_new`` positions per entry."""
    if not isinstance(kv_cache, KVCache):
        raise TypeError(f"kv_cache: expected an npattn.KVCache (module.new_cache(batch_size, "
                        f"capacity)), got {V.type_name(kv_cache)}")
    if backend_name(kv_cache.xp) != backend_name(module.xp):
        raise TypeError(f"kv_cache: expected a cache of the module's backend "
                        f"{backend_name(module.xp)!r}, got one of {backend_name(kv_cache.xp)!r}")
    device = device_of(module.params["w_q"])
    if kv_cache.device != device:
        raise ValueError(f"kv_cache: expected a cache on device {device!r} (where the parameters "
                         f"live), got one on device {kv_cache.device!r}")
    if kv_cache.dtype != module.dtype:
        raise TypeError(f"kv_cache: expected dtype {V.dtype_name(module.dtype)} (the parameters' "
                        f"dtype), got {V.dtype_name(kv_cache.dtype)}")
    want = dict(batch_size=batch_size, num_kv_heads=module.n_kv_head,
                head_dim=module.head_dim, value_dim=module.head_dim)
    got = {name: getattr(kv_cache, name) for name in want}
    if got != want:
        text = ", ".join(f"{n}={v}" for n, v in want.items())
        raise ValueError(f"kv_cache: expected {text} (the query's batch size and the module's "
                         f"heads), got {kv_cache!r}")
    kv_cache.check_room(n_new)


def check_backward_inputs(module: Any, dout: Any) -> None:
    """Check ``MultiHeadAttention.backward(dout)``: a forward ran, ``dout`` matches its output."""
    cache = module._cache
    if cache is None and getattr(module, "_decoded", False):
        raise RuntimeError(
            "backward: the last forward used kv_cache, and decoding is forward only (it keeps "
            "nothing to differentiate); run a forward without kv_cache before backward"
        )
    if cache is None:
        raise RuntimeError(
            "backward: expected a forward call first (there is no cached forward to "
            "differentiate); call module(query, key, value) and then backward(dout)"
        )
    V.check_array("dout", dout, module.xp, device_of(cache.out_proj.w))
    if V.shape_of(dout) != tuple(cache.out_shape):
        raise ValueError(
            f"dout: expected shape {tuple(cache.out_shape)} (that of the last forward's "
            f"output), got {V.shape_of(dout)}"
        )
    if dout.dtype != cache.out_dtype:
        raise TypeError(
            f"dout: expected dtype {V.dtype_name(cache.out_dtype)} (that of the last forward's "
            f"output), got {V.dtype_name(dout.dtype)}"
        )


# --------------------------------------------------------------------------
# copy, pickle, save: the backend by name, and the .npz format of save / load

#: ``MultiHeadAttention.save`` files: the ``format`` and ``format_version`` of
#: their ``config`` entry, and the prefix of their parameter entries.
SAVE_FORMAT = "npattn.MultiHeadAttention"
SAVE_VERSION = 1
SAVE_PARAM_PREFIX = "param/"

#: Constructor arguments added within format version 1, with their defaults: written to
#: the ``config`` only when set, and defaulted when a file has none.
SAVE_LATER_OPTIONS = {"scale": None, "softcap": None, "sinks": False}

#: Attributes a pickle of an older npattn lacks, with the values that keep its behaviour.
_LATER_ATTRIBUTES = {**SAVE_LATER_OPTIONS, "_decoded": False, "_cache_lent": False}


def check_path(path: Any, *, load_of: Optional[str] = None) -> None:
    """``TypeError`` unless ``path`` is a file name or a binary file object (with ``read`` for
    ``load``, ``write`` for ``save``); ``IsADirectoryError``
    (an ``OSError``, as a missing file's ``FileNotFoundError``) for the name of a directory.

    ``load_of`` is the ``save`` whose files ``load`` reads (``"GPT.save"``); None for ``save``.
    """
    if isinstance(path, (str, os.PathLike)):
        if os.path.isdir(path):  # raised here: NumPy's own error names neither path nor save
            expected = f"a file written by {load_of}" if load_of else "a file name to write"
            raise IsADirectoryError(f"path: expected {expected}, got the directory "
                                    f"{os.fspath(path)!r}")
        return
    method = "read" if load_of else "write"  # what load and save call on a file object
    if hasattr(path, method):
        return
    raise TypeError(f"path: expected a file name (str or os.PathLike) or a binary file object "
                    f"with {method}(), got {V.type_name(path)}")


def picklable_state(obj: Any) -> dict:
    """``obj.__dict__`` for ``pickle`` and ``copy.deepcopy``: the namespace ``xp`` and ``dtype`` by name, no ``_cache``.

    The ``__getstate__`` of npattn's stateful models (the blocks, GPT, the
    classifier); ``restore_state`` is its ``__setstate__``.
    """
    state = dict(obj.__dict__)
    state["xp"] = backend_ref(state["xp"])
    state["dtype"] = V.dtype_name(state["dtype"])
    state["_cache"] = None
    return state


def restore_state(obj: Any, state: dict) -> None:
    """Set ``obj.__dict__`` from ``picklable_state``'s dict, resolving the namespace and the dtype again."""
    state = dict(state)
    xp = backend_from_ref(state["xp"])
    state["xp"] = xp
    state["dtype"] = getattr(xp, state["dtype"])
    obj.__dict__.update(state)


def check_params_assignment(new: Any, current: dict, xp: Any) -> None:
    """A whole ``params`` dict ``new`` checked against ``current``: the same keys, each array like its own.

    ``check_param`` for every entry (library, device, dtype, shape), all before
    any is assigned, so a failed assignment changes nothing.
    """
    if not isinstance(new, dict):
        raise TypeError(f"params: expected a dict of arrays with the keys {list(current)}, got "
                        f"{V.type_name(new)}")
    if set(new) != set(current):
        missing = [k for k in current if k not in new]
        unexpected = sorted(set(new) - set(current), key=str)  # key=str: a key may be no string
        raise ValueError(f"params: expected the keys {list(current)}, got {sorted(new, key=str)} "
                         f"(missing {missing}, unexpected {unexpected})")
    for name, like in current.items():
        check_param(name, new[name], like=like, xp=xp)


def model_from_save_file(cls: Any, path: Any, *, backend: Any, fmt: str, version: int,
                         config_keys: Sequence[str]) -> tuple[Any, dict, str]:
    """Rebuild a ``cls`` from a save file: ``(model, header, label)``, its generators left to the caller.

    The file read without pickle, its header checked (format ``fmt``,
    ``version``), the configuration's keys exactly ``config_keys``, the
    constructor called with them and ``backend`` (its error becomes a
    ``ValueError`` about the file), the parameters set from the file and the
    mode from the header. ``label`` starts the caller's own error messages.
    """
    writer = f"{cls.__name__}.save"
    check_path(path, load_of=writer)
    label = save_file_label(path)
    entries = read_npz(label, path, writer=writer)
    header = read_save_header(label, entries.get("config"), fmt=fmt, version=version, writer=writer)
    config = header["config"]
    missing = [k for k in config_keys if k not in config]
    unexpected = sorted(set(config) - set(config_keys))
    if missing or unexpected:
        raise ValueError(f"{label}: expected the configuration keys {list(config_keys)}, "
                         f"missing {missing}, unexpected {unexpected}")
    model = model_from_config(label, cls, config, backend)
    model.params = params_from_save_file(label, entries, model.params, xp=model.xp, dtype=model.dtype,
                                         saved_dtype=config["dtype"])
    model.train(bool(header.get("training", True)))
    return model, header, label


def model_from_config(label: str, cls: Any, config: dict, backend: Any) -> Any:
    """``cls(**config, backend=backend)``; its error a ``ValueError`` about the file, naming the argument.

    The constructors' checks name the argument (a size past the longest array axis too,
    ``validation.MAX_AXIS``); their message follows the file's label.
    """
    try:
        return cls(**config, backend=backend)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"{label}: the saved configuration is not valid: {exc}") from exc


def save_file_label(path: Any) -> str:
    """The prefix of ``load``'s error messages: the file's name when it has one."""
    return f"load: {os.fspath(path)!r}" if isinstance(path, (str, os.PathLike)) else "load"


def write_save_file(path: Any, header: dict, params: dict, *, xp: Any, dtype: Any) -> None:
    """Write ``params`` (entries ``param/<name>``) and ``header`` (entry ``config``, JSON) to ``path``.

    bfloat16 parameters are stored as float32, which holds them exactly
    (NumPy has no bfloat16). The file is written at ``path`` exactly (NumPy's
    ``savez`` would append ``.npz`` to a name without it), or into a binary
    file object (``write`` is all it needs).
    """
    bf16 = V.dtype_name(dtype) == "bfloat16"
    # Any values: NumPy's stubs type savez's **kwds as arrays or as its allow_pickle flag,
    # depending on the NumPy version
    arrays: dict[str, Any] = {SAVE_PARAM_PREFIX + name: to_numpy(xp.astype(p, xp.float32) if bf16 else p)
                              for name, p in params.items()}
    arrays["config"] = np.array(json.dumps(header))
    if isinstance(path, (str, os.PathLike)):
        with open(path, "wb") as f:
            np.savez(f, **arrays)
    else:  # NumPy takes a file object only if it has read(): any file object gets the bytes
        buf = io.BytesIO()
        np.savez(buf, **arrays)
        path.write(buf.getvalue())


def read_npz(label: str, path: Any, *, writer: str = "MultiHeadAttention.save") -> dict:
    """Every entry of the .npz file at ``path`` as a NumPy array, read without pickle."""
    expected = f"expected an .npz file written by {writer}"
    try:
        npz = np.load(path, allow_pickle=False)
    except (ValueError, EOFError, zipfile.BadZipFile) as exc:
        raise ValueError(f"{label}: {expected}, could not read it ({exc})") from exc
    if not hasattr(npz, "files"):
        raise ValueError(f"{label}: {expected}, got a single .npy array")
    with npz:
        try:
            return {name: npz[name] for name in npz.files}
        except (ValueError, EOFError, zipfile.BadZipFile, KeyError) as exc:
            raise ValueError(f"{label}: {expected}, could not read its entries ({exc})") from exc


def read_save_header(label: str, entry: Any, *, fmt: str = SAVE_FORMAT, version: int = SAVE_VERSION,
                     writer: str = "MultiHeadAttention.save") -> dict:
    """The checked JSON header of a save file: format ``fmt``, version ``version``, config, training, rng_state."""
    if entry is None:
        raise ValueError(f"{label}: expected a 'config' entry (a file of {writer}), found none")
    if entry.ndim != 0 or entry.dtype.kind != "U":
        raise ValueError(f"{label}: expected the 'config' entry to be one JSON string, got an "
                         f"array of dtype {entry.dtype} and shape {entry.shape}")
    try:
        header = json.loads(str(entry))
    except ValueError as exc:
        raise ValueError(f"{label}: expected the 'config' entry to be JSON, could not parse it "
                         f"({exc})") from exc
    if not isinstance(header, dict) or header.get("format") != fmt:
        got = header.get("format") if isinstance(header, dict) else V.type_name(header)
        raise ValueError(f"{label}: expected format {fmt!r} (a file of {writer}), got {got!r}")
    got_version = header.get("format_version")
    if type(got_version) is not int:  # JSON 1.0 is a float and true a bool, both equal to 1
        raise ValueError(f"{label}: expected format_version {version} (a JSON integer, the one this "
                         f"npattn reads), got {got_version!r} ({V.type_name(got_version)})")
    if got_version > version:
        raise ValueError(f"{label}: expected format_version {version} (the one this npattn reads), "
                         f"got {got_version}: the file is newer than this npattn; load it with the "
                         f"npattn that wrote it, or a later one")
    if got_version != version:
        raise ValueError(f"{label}: expected format_version {version} (the one this npattn reads), "
                         f"got {got_version}, which no npattn writes")
    for key, kind in (("config", dict), ("training", bool), ("rng_state", (dict, type(None)))):
        if not isinstance(header.get(key), kind):
            raise ValueError(f"{label}: expected {key!r} in the header to be "
                             f"{getattr(kind, '__name__', 'a dict or null')}, got {header.get(key)!r}")
    return header


def params_from_save_file(label: str, entries: dict, current: dict, *, xp: Any, dtype: Any,
                          saved_dtype: str) -> dict:
    """The ``param/<name>`` entries of a save file as new parameters like ``current`` (all checked first).

    Every name of ``current`` must be there and no other entry but ``config``; each array
    must have the dtype the file stores for ``saved_dtype`` (float32 for bfloat16) and its
    parameter's shape. Returns arrays of ``xp`` in ``dtype`` on the parameters' device.
    """
    saved = {k[len(SAVE_PARAM_PREFIX):]: a for k, a in entries.items() if k.startswith(SAVE_PARAM_PREFIX)}
    unknown = sorted(set(entries) - {"config"} - {SAVE_PARAM_PREFIX + n for n in saved})
    missing = [n for n in current if n not in saved]
    extra = sorted(set(saved) - set(current))
    if missing or extra or unknown:
        raise ValueError(
            f"{label}: expected the parameters {list(current)} of the saved configuration, "
            f"missing {missing}, unexpected {extra + unknown}"
        )
    stored = "float32" if saved_dtype == "bfloat16" else saved_dtype
    new = {}
    for name, like in current.items():
        a = saved[name]
        if a.dtype != np.dtype(stored):
            raise ValueError(f"{label}: parameter {name!r}: expected dtype {stored} (that of "
                             f"the saved configuration), got {a.dtype}")
        if a.shape != V.shape_of(like):
            raise ValueError(f"{label}: parameter {name!r}: expected shape {V.shape_of(like)}, "
                             f"got {a.shape}")
        new[name] = xp.astype(from_numpy(a, xp, device_of(like)), dtype)
    return new


def set_rng_state(label: str, rng: np.random.Generator, state: Any) -> None:
    """Restore a saved dropout generator state (None: leave ``rng`` as it is); ``ValueError`` if
    NumPy refuses it, naming ``label``, the generator and the state received."""
    if state is None:
        return
    try:
        rng.bit_generator.state = state
    except (TypeError, ValueError, KeyError, OverflowError) as exc:  # integers out of range: OverflowError
        got = repr(state) if isinstance(state, dict) else V.type_name(state)
        raise ValueError(f"{label}: expected a state of the dropout generator "
                         f"({type(rng.bit_generator).__name__}, as rng_state reads it), got {got}, "
                         f"which NumPy refuses: {exc}") from exc
