"""The one attention dispatcher: one checked call, one implementation chosen per call.

``sdpa_forward(q, k, v, ..., impl=)`` / ``sdpa_backward(dout, cache)`` take the
arguments of ``npattn.functional.sdpa_forward`` and compute the same
function with the implementation ``impl`` names:

``"reference"``
    ``npattn.functional``, the readable reference, as written, on any backend.
``"blocked"``
    ``npattn.blocked``, the FlashAttention-2 style algorithm on any backend:
    online softmax, no (Lq, Lk) array, causal blocks skipped. No weights.
``"numpy"``
    ``npattn.numpy_kernel``, the reference's dense steps tiled and in place
    for NumPy arrays (the fast dense path on the CPU). NumPy arrays only.
``"chunked"``
    ``npattn.chunked``, for dask arrays: one task per pair of (batch, head,
    query, key) chunks, the blocked algorithm inside each task and its
    merge across key chunks; dask arrays in, dask arrays out. No weights.
``"dense"``
    The fastest dense implementation for the arrays: ``"numpy"`` for NumPy
    arrays of the kernel's layout, else ``"reference"``.
``"auto"`` (default)
    On dask arrays ``"chunked"`` unless weights are needed; otherwise
    ``"blocked"`` when no weights are needed and the dense probabilities
    would be large (``select_impl``; on a CUDA device, large for its
    memory), else ``"dense"``.

Every implementation takes the same arguments (masks, causal, scale,
dropout, GQA, a value width unlike the key width) and gives the same outputs,
``cache.lse`` and gradients to rounding (the tiled ones take the softmax backward's
row sum as ``rowsum(dout * out)``, whose rounding, of the size of
``|dout| |v| |k| scale``, is all of dq and dk where a row's weights sit on one key;
docs/derivations.md). The kernel options (``align``,
``window``, ``softcap``, ``alibi_slopes``, ``sinks``, segments) run on the
reference, the blocked and the chunked paths, and broadcast leading axes on the
first two; the NumPy kernel takes ``window`` and ``align`` (its tiles meet only
the keys the window leaves). With the others ``"dense"`` is the reference and
``"numpy"`` (and ``"chunked"`` for broadcast leading axes) a ``ValueError``; a
dropout generator draws one key per forward and
every implementation derives the same keep-mask from it
(``dropout_keep_mask`` returns it). The arguments are checked once, here,
before anything is computed; then the implementation's unchecked core runs
under ``npattn.backend.exclusive()`` (see "Threads and fork" there).

Shape legend: B batch, Hq query heads, Hkv key/value heads, Lq/Lk query/key
lengths, Dh key width, Dv value width.
"""

from __future__ import annotations

import math
from typing import Any, Optional

from . import blocked, chunked
from . import functional as F
from . import numpy_kernel
from . import validation as V
from .backend import (accelerator_memory, device_of, exclusive, generator_kept_on_failure,
                      is_dask_array, namespace, pool_threads, without_empty_chunks)

__all__ = [
    "IMPLS",
    "AUTO_BLOCKED_MIN_SCORES",
    "AUTO_BLOCKED_MAX_DENSE_SCORES",
    "AUTO_DEVICE_DENSE_SHARE",
    "DENSE_PEAK_ARRAYS",
    "auto_blocked",
    "select_impl",
    "check_impl",
    "check_impl_takes",
    "check_forward",
    "sdpa_forward",
    "sdpa_backward",
    "dropout_keep_mask",
    "weights",
    "Workspace",
    "linear_forward",
    "linear_backward",
    "linear_backwards",
]

Workspace = numpy_kernel.Workspace

IMPLS = ("auto", "dense", "reference", "numpy", "blocked", "chunked")

#: ``impl="auto"`` takes the blocked path when one head has this many scores
#: (``Lq * Lk``; 2**25 = 33.5 M, e.g. 8192 x 4096): past it the dense path's
#: arrays grow large, and the blocked one needs a fraction of their memory (it
#: is slower in time: docs/performance.md).
AUTO_BLOCKED_MIN_SCORES = 2**25

#: ``impl="auto"`` also takes the blocked path when the dense probabilities of
#: all heads, ``B * H * Lq * Lk`` entries, would reach this (1 GiB in float32).
AUTO_BLOCKED_MAX_DENSE_SCORES = 2**28

#: On an accelerator (a CUDA device under CuPy or torch), ``impl="auto"`` keeps
#: the dense path while its ``(B, H, Lq, Lk)`` arrays at their peak fit in this
#: share of the device's memory. There the blocked path runs its blocks from a
#: Python loop, a few dozen small kernels each, and is many times slower than the
#: dense one (docs/gpu.md has the measurement); the CPU thresholds above do not
#: apply.
AUTO_DEVICE_DENSE_SHARE = 0.5

#: The dense path's ``(B, H, Lq, Lk)`` arrays counted alive at once at its peak
#: (in the backward: the kept probabilities and the gradients of the dropped
#: probabilities, the probabilities and the scores).
DENSE_PEAK_ARRAYS = 4


def auto_blocked(lead: int, Lq: int, Lk: int, *, device_memory: Optional[int] = None,
                 itemsize: int = 4) -> bool:
    """Whether ``impl="auto"`` takes the blocked path for ``lead`` heads (all leading axes)
    of ``Lq x Lk`` scores, weights not requested.

    In host memory (``device_memory`` None): a head past ``AUTO_BLOCKED_MIN_SCORES``,
    or all the heads' dense probabilities past ``AUTO_BLOCKED_MAX_DENSE_SCORES``. On an
    accelerator of ``device_memory`` bytes (``npattn.backend.accelerator_memory``): the
    dense path's ``DENSE_PEAK_ARRAYS`` arrays of ``lead * Lq * Lk`` entries of
    ``itemsize`` bytes (at least 4: float16 computes in float32) past
    ``AUTO_DEVICE_DENSE_SHARE`` of it.

    Parameters
    ----------
    lead : int
        The product of the scores' leading axes (B * Hq).
    Lq, Lk : int
        Query and key lengths.
    device_memory : int, optional
        The accelerator's memory in bytes; None (default) for host memory.
    itemsize : int
        Bytes per entry of the inputs' dtype (default 4); read only with ``device_memory``.

    Returns
    -------
    blocked : bool
        True where ``"auto"`` takes the blocked path.
    """
    if device_memory is not None:
        dense = DENSE_PEAK_ARRAYS * lead * Lq * Lk * max(itemsize, 4)
        return dense > AUTO_DEVICE_DENSE_SHARE * device_memory
    return Lq * Lk >= AUTO_BLOCKED_MIN_SCORES or lead * Lq * Lk >= AUTO_BLOCKED_MAX_DENSE_SCORES


def check_impl(impl, *, need_weights: bool = False) -> None:
    """Raise ``TypeError`` for an ``impl`` that is not a str, ``ValueError`` for an unknown one,
    or ``"blocked"``/``"chunked"`` with weights requested."""
    V.check_choice("impl", impl, IMPLS)
    V.check_bool("need_weights", need_weights)
    if impl in ("blocked", "chunked") and need_weights:
        raise ValueError(
            f"impl={impl!r} cannot return attention weights (it never forms them); "
            "use need_weights=False, or impl='dense', 'reference', 'numpy' or 'auto'"
        )


def select_impl(impl: str, q: Any, k: Any, v: Any, *, mask: Any = None,
                dropout_mask: Any = None, need_weights: bool = False, plain: bool = True,
                positional: Optional[bool] = None, same_lead: Optional[bool] = None) -> str:
    """The implementation ``impl`` resolves to for these arrays: ``"reference"``, ``"numpy"``,
    ``"blocked"`` or ``"chunked"``.

    ``"auto"`` picks ``"chunked"`` for dask arrays that it takes when no
    weights are needed, and the reference for any other dask call (weights, leading
    axes that broadcast, a layout the chunked path does not take), whatever its size. Otherwise
    it picks ``"blocked"`` when no weights are needed and either ``Lq * Lk >=
    AUTO_BLOCKED_MIN_SCORES`` or ``B * H * Lq * Lk >= AUTO_BLOCKED_MAX_DENSE_SCORES``,
    B and H those of the scores, q's, k's and v's leading axes broadcast together
    (on a CUDA device: the dense arrays past ``AUTO_DEVICE_DENSE_SHARE`` of its
    memory, ``auto_blocked``); otherwise, like ``"dense"``, the NumPy kernel when it
    takes the arrays, else the reference. ``"numpy"`` and ``"chunked"`` on
    arrays they do not take are a ``ValueError``; so are ``"numpy"`` for a call that is not
    ``positional`` (kernel options beyond a window and ``align``:
    ``functional.is_positional``, or leading axes that broadcast) and ``"chunked"`` for
    leading axes of q, k and v that broadcast (``same_lead`` False). ``plain``: a call
    without kernel options, the default of ``positional``; ``same_lead``: q, k and v
    with the same leading axes (default True: the chunked path takes every kernel option).

    Parameters
    ----------
    impl : {"auto", "dense", "reference", "numpy", "blocked", "chunked"}
    q : array, shape (B, Hq, Lq, Dh)
    k : array, shape (B, Hkv, Lk, Dh)
    v : array, shape (B, Hkv, Lk, Dv)
    mask, dropout_mask : array, optional
        Only their types and layouts are read (whether the NumPy kernel or the
        chunked path takes them).
    need_weights : bool
        The weights will be read from the cache: neither ``"blocked"`` nor ``"chunked"``.
    plain : bool
        A call without kernel options (default True); the default of ``positional``.
    positional : bool, optional
        The NumPy kernel may run the call (no kernel options beyond a window and
        ``align``, leading axes that do not broadcast); None: ``plain``.
    same_lead : bool, optional
        q, k and v have the same leading axes; None: True.

    Returns
    -------
    impl : {"reference", "numpy", "blocked", "chunked"}
    """
    positional = plain if positional is None else positional
    same_lead = True if same_lead is None else same_lead
    check_impl(impl, need_weights=need_weights)
    for name, a in (("q", q), ("k", k), ("v", v)):  # (the forwards check them before; called alone)
        V.check_array(name, a)
        if len(a.shape) < 2:
            raise ValueError(f"{name}: expected an array of shape (..., L, D), got shape {V.shape_of(a)}")
    chunks = chunked.accepts(q, k, v, mask, dropout_mask)
    kernel = numpy_kernel.accepts(q, k, v, mask, dropout_mask)
    check_impl_takes(impl, positional=positional, same_lead=same_lead, takes_chunks=chunks,
                     takes_kernel=kernel,
                     got=_arrays_in_words(q, k, v, mask, dropout_mask))
    if impl == "auto" and same_lead and chunks and not need_weights:
        return "chunked"
    if impl == "chunked":
        return impl
    if impl == "auto" and is_dask_array(q):
        impl = "dense"  # weights, or a layout the chunked path does not take: the reference
    if impl == "auto":
        large = auto_blocked(math.prod(_scores_lead(q, k, v)), q.shape[-2], k.shape[-2],
                             device_memory=accelerator_memory(q),
                             itemsize=getattr(q.dtype, "itemsize", 4))
        impl = "blocked" if large and not need_weights else "dense"
    if impl == "dense":
        return "numpy" if positional and kernel else "reference"
    return impl


def _arrays_in_words(q: Any, k: Any, v: Any, mask: Any, dropout_mask: Any) -> str:
    """q, k and v in words for ``select_impl``'s refusals: their type and shapes, and each
    array's own type (masks included) where they differ: a refusal for the type of one
    names that one, not q's."""
    given = {"q": q, "k": k, "v": v, "mask": mask, "dropout_mask": dropout_mask}
    types = {name: f"{type(a).__module__}.{type(a).__name__}" for name, a in given.items() if a is not None}
    shapes = f"of shapes {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}"
    if len(set(types.values())) == 1:
        return f"{types['q']} {shapes}"
    return ", ".join(f"{name} {kind}" for name, kind in types.items()) + f"; q, k, v {shapes}"


def _scores_lead(q: Any, k: Any, v: Any) -> tuple:
    """The leading axes of the scores, ``(B, Hq)`` in the kernel's layout: those of q, k and v
    broadcast together (a q of one batch entry against k and v of many has the scores of
    many), or under grouped-query attention, whose head axes do not broadcast, the batch
    axes broadcast and q's heads. q's own leading axes where neither holds (a call that
    the checks refuse)."""
    # [..., Lq, Dh], [..., Lk, Dh], [..., Lk, Dv] -> the shape of [...] of the scores
    for enable_gqa in (False, True):
        try:
            return V.scores_lead(q, k, v, enable_gqa=enable_gqa)
        except ValueError:
            pass
    return tuple(q.shape[:-2])


def check_impl_takes(impl: str, *, positional: bool, same_lead: bool, takes_chunks: bool,
                     takes_kernel: bool, got: str) -> None:
    """The ``ValueError`` of ``select_impl`` for an ``impl`` that cannot run the call, from
    what is known of it: ``positional`` / ``same_lead`` as there, whether ``chunked.accepts`` /
    ``numpy_kernel.accepts`` would take its arrays, and ``got``, the arrays in words.

    Apart so that a caller that makes q, k and v itself (``npattn.module``) can refuse
    the call before it computes them.
    """
    if impl == "numpy" and not positional:
        raise ValueError(
            "impl='numpy': the kernel options softcap, alibi_slopes, sinks, "
            "q_segments/k_segments and leading axes that broadcast run on impl='reference' "
            "or 'blocked'"
        )
    if impl == "chunked" and not same_lead:
        raise ValueError(
            "impl='chunked': leading axes of q, k and v that broadcast (k and v of one batch "
            "entry for q's many, or of one head for many query heads without enable_gqa) run "
            "on impl='reference' or 'blocked'"
        )
    if impl == "chunked" and not takes_chunks:
        raise ValueError(
            "impl='chunked': the chunked implementation takes dask arrays q (B, Hq, Lq, Dh), "
            "k (B, Hkv, Lk, Dh), v (B, Hkv, Lk, Dv) with known chunk sizes, and dask masks "
            f"broadcastable to (B, Hq, Lq, Lk); got {got}; use impl='reference' or 'blocked'"
        )
    if impl == "numpy" and not takes_kernel:
        instead = "'chunked', 'reference' or 'blocked'" if takes_chunks else "'reference' or 'blocked'"
        raise ValueError(
            "impl='numpy': the NumPy kernel takes NumPy arrays q (B, Hq, Lq, Dh), "
            "k (B, Hkv, Lk, Dh), v (B, Hkv, Lk, Dv) with Hkv >= 1 dividing Hq, and masks "
            f"broadcastable to (B, Hq, Lq, Lk); got {got}; use impl={instead}"
        )


def check_forward(q: Any, k: Any, v: Any, *, mask: Any = None, is_causal: bool = False,
                  scale: Optional[float] = None, dropout_p: float = 0.0, dropout_mask: Any = None,
                  rng: Any = None, enable_gqa: bool = False, align: str = "top_left",
                  window: Any = None, softcap: Optional[float] = None, alibi_slopes: Any = None,
                  sinks: Any = None, q_segments: Any = None, k_segments: Any = None,
                  impl: str = "auto", need_weights: bool = False,
                  block_q: Optional[int] = None, block_k: Optional[int] = None,
                  workspace: Optional[numpy_kernel.Workspace] = None) -> tuple[int, Any, str]:
    """The checks of ``sdpa_forward`` on the same arguments, with nothing computed and nothing
    drawn from ``rng``: a ``TypeError`` / ``ValueError`` naming the argument.

    For callers that must refuse a call before they change anything (``npattn.compat``'s
    in-place KV cache). Returns ``(G, options, impl)``: the query heads per K/V head, the
    checked ``functional.ScoreOptions`` and the implementation the call takes.
    """
    # [B, Hq, Lq, Dh], [B, Hkv, Lk, Dh], [B, Hkv, Lk, Dv]
    V.check_sdpa_inputs(q, k, v, mask=mask, dropout_mask=dropout_mask, dropout_p=dropout_p,
                        scale=scale, is_causal=is_causal, enable_gqa=enable_gqa, rng=rng)
    if workspace is not None and not isinstance(workspace, numpy_kernel.Workspace):
        raise TypeError(f"workspace: expected an npattn.attention.Workspace or None, "
                        f"got {V.type_name(workspace)}")
    V.check_positive_int("block_q", block_q, allow_none=True)  # the blocked and chunked paths';
    V.check_positive_int("block_k", block_k, allow_none=True)  # chunked's tasks run them later
    G = F.gqa_groups(q, k, v, enable_gqa)
    options = F.checked_options(q, k, v, enable_gqa=enable_gqa, align=align, window=window,
                                softcap=softcap, alibi_slopes=alibi_slopes, sinks=sinks,
                                q_segments=q_segments, k_segments=k_segments)
    cut = -3 if G > 1 else -2  # the axes that broadcast: all leading ones, or the batch under GQA
    same_lead = tuple(q.shape[:cut]) == tuple(k.shape[:cut]) == tuple(v.shape[:cut])
    plain = same_lead and F.is_plain(options, is_causal)
    positional = same_lead and F.is_positional(options)
    path = select_impl(impl, q, k, v, mask=mask, dropout_mask=dropout_mask,
                       need_weights=need_weights, plain=plain, positional=positional,
                       same_lead=same_lead)
    pool_threads()  # a bad NPATTN_NUM_THREADS fails here, before anything is computed
    return G, options, path


def sdpa_forward(
    q: Any,
    k: Any,
    v: Any,
    *,
    mask: Any = None,
    is_causal: bool = False,
    scale: Optional[float] = None,
    dropout_p: float = 0.0,
    dropout_mask: Any = None,
    rng: Any = None,
    enable_gqa: bool = False,
    align: str = "top_left",
    window: Any = None,
    softcap: Optional[float] = None,
    alibi_slopes: Any = None,
    sinks: Any = None,
    q_segments: Any = None,
    k_segments: Any = None,
    impl: str = "auto",
    need_weights: bool = False,
    block_q: Optional[int] = None,
    block_k: Optional[int] = None,
    workspace: Optional[numpy_kernel.Workspace] = None,
) -> tuple[Any, Any]:
    """Scaled dot-product attention on the implementation ``impl`` (see the module docstring).

    Parameters
    ----------
    q, k, v, mask, is_causal, scale, dropout_p, dropout_mask, rng, enable_gqa
        As ``npattn.functional.sdpa_forward``.
    align, window, softcap, alibi_slopes, sinks, q_segments, k_segments
        The kernel options of ``npattn.functional.sdpa_forward``.
    impl : {"auto", "dense", "reference", "numpy", "blocked", "chunked"}
    need_weights : bool
        The weights will be read from the cache (``weights(cache)``): a dense
        implementation is used.
    block_q, block_k : int, optional
        Block lengths of the blocked implementation (and of the blocked steps inside each
        task of the chunked one).
    workspace : Workspace, optional
        Arrays of finished forwards that the NumPy kernel may reuse instead
        of allocating (``numpy_kernel.Workspace``); the other implementations
        ignore it. The numbers do not depend on it.

    Returns
    -------
    out : array, shape (B, Hq, Lq, Dv)
    cache : the implementation's cache; pass it to ``sdpa_backward``.
        ``cache.lse`` (B, Hq, Lq) is the log-sum-exp of each row on every
        implementation.
    """
    # [B, Hq, Lq, Dh], [B, Hkv, Lk, Dh], [B, Hkv, Lk, Dv] -> [B, Hq, Lq, Dv]
    # dask allows chunks of length 0, and its reshape fails on some: none reach the paths
    q, k, v, mask, dropout_mask, alibi_slopes, sinks, q_segments, k_segments = (
        without_empty_chunks(a) for a in (q, k, v, mask, dropout_mask, alibi_slopes, sinks,
                                          q_segments, k_segments))
    G, options, path = check_forward(
        q, k, v, mask=mask, is_causal=is_causal, scale=scale, dropout_p=dropout_p,
        dropout_mask=dropout_mask, rng=rng, enable_gqa=enable_gqa, align=align, window=window,
        softcap=softcap, alibi_slopes=alibi_slopes, sinks=sinks, q_segments=q_segments,
        k_segments=k_segments, impl=impl, need_weights=need_weights, block_q=block_q,
        block_k=block_k, workspace=workspace)
    # checked there; as Python ints for the tasks and caches that keep them
    block_q, block_k = (None if n is None else int(n) for n in (block_q, block_k))
    args = dict(mask=mask, is_causal=is_causal, scale=scale, dropout_p=dropout_p,
                dropout_mask=dropout_mask, rng=rng, groups=G)
    # a call that fails after it drew its dropout key leaves the caller's generator as it was
    with generator_kept_on_failure(rng), exclusive():
        if path == "reference":
            return F.sdpa_forward_core(q, k, v, options=options, **args)
        if path == "numpy":
            return numpy_kernel.sdpa_forward(q, k, v, options=options, workspace=workspace, **args)
        if path == "chunked":
            return chunked.sdpa_forward(q, k, v, block_q=block_q, block_k=block_k,
                                        options=options, **args)
        return blocked.sdpa_blocked_forward_core(q, k, v, block_q=block_q, block_k=block_k,
                                                 options=options, **args)


def sdpa_backward(dout: Any, cache: Any, *, dlse: Any = None) -> F.SDPAGrads:
    """Gradients ``SDPAGrads(dq, dk, dv, dmask, dsinks)`` of ``sdpa_forward``, by the
    implementation that made ``cache``.

    ``dk`` and ``dv`` have the K/V heads' shape under GQA; ``dmask`` is None
    unless the mask was floating; ``dsinks`` None without sinks. ``dlse``
    (B, Hq, Lq), in the dtype of ``cache.lse``, is an upstream gradient of
    ``cache.lse``; its entries on rows with nothing to attend and no sink (lse =
    -inf, a constant there) do not matter, inf and NaN included (with ``sinks``
    such a row's lse is its sink's, and its dlse reaches ``dsinks``).

    Parameters
    ----------
    dout : array, shape (B, Hq, Lq, Dv)
        Upstream gradient of ``out``, in its dtype.
    cache : SDPACache, NumpySDPACache, BlockedSDPACache or ChunkedSDPACache
        The cache ``sdpa_forward`` returned.
    dlse : array, shape (B, Hq, Lq), optional
        Upstream gradient of ``cache.lse``, as above; None: zero.

    Returns
    -------
    grads : SDPAGrads
        ``dq``, ``dk``, ``dv`` of the shapes of q, k and v; ``dmask`` of the floating
        mask's shape or None; ``dsinks`` (Hq,) or None.
    """
    # [B, Hq, Lq, Dv] -> [B, Hq, Lq, Dh], [B, Hkv, Lk, Dh], [B, Hkv, Lk, Dv], mask shape, [H]
    kinds = (numpy_kernel.NumpySDPACache, blocked.BlockedSDPACache, chunked.ChunkedSDPACache,
             F.SDPACache)
    if not isinstance(cache, kinds):
        raise TypeError(f"cache: expected the cache of an sdpa_forward, got {V.type_name(cache)}")
    dout, dlse = without_empty_chunks(dout), without_empty_chunks(dlse)  # as in the forward
    if isinstance(cache, F.SDPACache):  # the reference checks its own arguments
        with exclusive():
            return F.sdpa_backward(dout, cache, dlse=dlse)
    lse = cache.lse
    V.check_grad("dout", dout, shape=tuple(lse.shape) + (cache.v.shape[-1],),
                 dtype=cache.in_dtype, xp=namespace(cache.q), device=device_of(cache.q),
                 of="the forward's out")
    if dlse is not None:
        V.check_grad("dlse", dlse, shape=tuple(lse.shape), dtype=lse.dtype,
                     xp=namespace(cache.q), device=device_of(cache.q), of="cache.lse")
    with exclusive():
        if isinstance(cache, numpy_kernel.NumpySDPACache):
            return numpy_kernel.sdpa_backward(dout, cache, dlse=dlse)
        if isinstance(cache, blocked.BlockedSDPACache):
            return blocked.sdpa_blocked_backward_core(dout, cache, dlse=dlse)  # (checked above)
        return chunked.sdpa_backward(dout, cache, dlse=dlse)


def weights(cache: Any) -> Any:
    """The attention weights (B, Hq, Lq, Lk) before dropout, from a dense implementation's cache.

    For the reference's cache, the cache's own array, which ``sdpa_backward`` reads: write into
    a copy of it. The NumPy kernel keeps ``e`` and its row factors, and forms a new array at
    each call (``NumpySDPACache.probs``).

    Parameters
    ----------
    cache : SDPACache or NumpySDPACache
        The cache of a dense forward (``impl`` "reference" or "numpy"); a blocked or
        chunked cache is a ``ValueError``.

    Returns
    -------
    weights : array, shape (B, Hq, Lq, Lk)
    """
    for kind, name in ((blocked.BlockedSDPACache, "blocked"), (chunked.ChunkedSDPACache, "chunked")):
        if isinstance(cache, kind):
            raise ValueError(f"cache: expected the cache of a dense implementation (it keeps the "
                             f"attention weights), got {type(cache).__name__}: the {name} "
                             "implementation keeps no attention weights")
    if not isinstance(cache, (F.SDPACache, numpy_kernel.NumpySDPACache)):
        raise TypeError(f"cache: expected the cache of an sdpa_forward, got {V.type_name(cache)}")
    return cache.probs


def dropout_keep_mask(cache: Any) -> Any:
    """The bool keep-mask (B, Hq, Lq, Lk) that the forward of ``cache`` used, or None without dropout.

    The same array for every implementation given the same generator state:
    entry ``(b, h, i, j)`` depends only on the drawn key and its coordinates.
    A caller's ``dropout_mask`` is returned as it was broadcast; a drawn mask
    is an array of its own, which a later forward does not change.

    Parameters
    ----------
    cache : SDPACache, NumpySDPACache, BlockedSDPACache or ChunkedSDPACache
        The cache ``sdpa_forward`` returned.

    Returns
    -------
    keep : bool array, shape (B, Hq, Lq, Lk), or None
        True = kept; a dask array for a chunked cache.
    """
    if isinstance(cache, numpy_kernel.NumpySDPACache):
        return numpy_kernel.keep_mask_of(cache)
    if isinstance(cache, chunked.ChunkedSDPACache):
        return chunked.keep_mask_of(cache)
    if isinstance(cache, blocked.BlockedSDPACache):
        if cache.dropout_key is not None:
            return blocked.blocked_keep_mask(cache)
        if cache.dropout_mask is None:
            return None
        xp = namespace(cache.q)
        shape = tuple(cache.lead_shape) + (cache.q.shape[-2], cache.k.shape[-2])
        full = xp.broadcast_to(cache.dropout_mask, tuple(cache.q.shape[:-2]) + shape[-2:])
        return xp.reshape(full, shape)
    if isinstance(cache, F.SDPACache):
        keep = cache.dropout.keep
        if keep is None:
            return None
        xp = namespace(cache.probs)
        return xp.broadcast_to(keep, tuple(cache.probs.shape))
    raise TypeError(f"cache: expected the cache of an sdpa_forward, got {V.type_name(cache)}")


def linear_forward(x: Any, w: Any, b: Any = None) -> tuple[Any, F.LinearCache]:
    """``functional.linear_forward`` (``y = x @ w.T + b``), checked; a large GEMM on NumPy
    arrays runs on the tile pool (``numpy_kernel.linear_forward``), the same numbers to
    rounding. The module's projections go through here.

    Parameters
    ----------
    x : array, shape (..., Din)
    w : array, shape (Dout, Din)
    b : array, shape (Dout,), optional

    Returns
    -------
    y : array, shape (..., Dout)
    cache : LinearCache
    """
    if not numpy_kernel.linear_applies(x, w):
        return F.linear_forward(x, w, b)
    F.check_linear_inputs(x, w, b)
    return numpy_kernel.linear_forward(x, w, b)


def linear_backward(dy: Any, cache: F.LinearCache) -> tuple[Any, Any, Any]:
    """``functional.linear_backward``: ``(dx, dw, db)``, on the tile pool where
    ``linear_forward`` would run there.

    Parameters
    ----------
    dy : array, shape (..., Dout)
    cache : LinearCache

    Returns
    -------
    dx : array, shape (..., Din)
    dw : array, shape (Dout, Din)
    db : array, shape (Dout,) or None
        None without bias.
    """
    return linear_backwards([(dy, cache)])[0]


def linear_backwards(pairs: Any) -> list:
    """``linear_backward`` of several projections, ``[(dy, cache), ...]``: a list of
    ``(dx, dw, db)``, each the numbers ``linear_backward`` gives for its pair.

    Every pair is checked before anything is computed. The pairs whose GEMMs
    run on the tile pool run there together, in one run (the module's q, k and
    v projections: one hand-off to the pool instead of three); the others run
    ``functional.linear_backward``.

    Parameters
    ----------
    pairs : iterable of (dy, LinearCache)
        Each ``dy`` of shape (..., Dout) of its cache's forward.

    Returns
    -------
    grads : list of (dx, dw, db)
        In the order of ``pairs``, each as ``linear_backward`` returns it.
    """
    if isinstance(pairs, (str, bytes)) or not hasattr(pairs, "__iter__"):
        raise TypeError(f"pairs: expected an iterable of (dy, cache) pairs, got {V.type_name(pairs)}")
    pairs = list(pairs)
    for i, pair in enumerate(pairs):  # the reference's own checks, all before anything is computed
        if not isinstance(pair, (tuple, list)) or len(pair) != 2:
            raise TypeError(f"pairs[{i}]: expected a (dy, cache) pair, got {V.type_name(pair)}"
                            + (f" of length {len(pair)}" if isinstance(pair, (tuple, list)) else ""))
        F.check_linear_grad(*pair)
    pooled = [i for i, (_, c) in enumerate(pairs) if numpy_kernel.linear_applies(c.x, c.w)]
    results: list = [None] * len(pairs)
    for i, grads in zip(pooled, numpy_kernel.linear_backwards([pairs[i] for i in pooled])):
        results[i] = grads
    for i, (dy, cache) in enumerate(pairs):
        if results[i] is None:
            results[i] = F.linear_backward(dy, cache)
    return results
