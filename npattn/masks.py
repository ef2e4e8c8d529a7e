"""Mask builders and adapters, all in npattn's convention.

npattn's masks (see ``docs/conventions.md``):

* **boolean**: True = may attend (as SDPA and ``jax.nn.dot_product_attention``);
* **floating**: added to the scaled scores; ``-inf`` forbids a key;
* any shape that broadcasts to (B, H, Lq, Lk).

This module builds such masks (``causal``, ``window``, ``segments``,
``padding``) and converts the
masks of ``torch.nn.MultiheadAttention``, whose booleans mean the opposite
(True = ignore), with ``from_torch_mha``. Nothing here imports torch: torch
tensors are handled through array-api-compat like any other backend.

Shape legend: B batch (torch's N), H heads, Lq query length (torch's L),
Lk key length (torch's S).
"""

from __future__ import annotations

import math
import numbers
from typing import Any, Optional

from . import validation as V
from .backend import (
    backend_name,
    device_of,
    entry_bytes,
    from_numpy,
    is_bool,
    is_floating,
    isdtype,
    namespace,
    resolve_backend,
    scalar,
    to_numpy,
    widest_int,
)

__all__ = ["causal", "window", "segments", "padding", "from_torch_mha"]


def _namespace_or(xp):
    """``xp=`` as a namespace: None means NumPy, a string is a backend name."""
    return resolve_backend("numpy" if xp is None else xp, "xp")


def _check_length(name: str, n: Any, *, axis: bool = True) -> int:
    """A length: an int (Python or NumPy, not a bool) >= 0, and <= ``MAX_AXIS`` when it is
    the length of an ``axis`` (a window side is not), returned as a Python int (NumPy's
    unsigned ones would wrap in ``Lk - Lq``); ``TypeError`` / ``ValueError`` otherwise."""
    return V.check_size(name, n, maximum=V.MAX_AXIS if axis else None)


def _index_dtype(xp: Any, **lengths: int) -> Any:
    """The dtype of the positions ``arange(L)`` on ``xp`` (``widest_int``: int64, int32 on JAX
    without x64), after a ``ValueError`` naming a length it cannot hold: an ``arange`` past its
    largest value would wrap, and the mask would be wrong without a word."""
    index = widest_int(xp)
    top = int(xp.iinfo(index).max)
    for name, n in lengths.items():
        if n > top:
            raise ValueError(f"{name}: expected a length of at most {top}, the largest "
                             f"{V.dtype_name(index)} (the positions' dtype on backend "
                             f"{backend_name(xp)!r}; on JAX, jax_enable_x64 gives int64), got {n}")
    return index


def causal(Lq: int, Lk: int, align: str = "top_left", *, xp: Any = None, device: Any = None) -> Any:
    """Causal mask, True = may attend.  # -> [Lq, Lk] bool

    * ``align="top_left"`` (SDPA's ``is_causal``, npattn's ``is_causal``):
      query ``i`` sees keys ``j <= i``.
    * ``align="bottom_right"`` (flash-attn's ``causal=True`` when
      ``Lq != Lk``, i.e. the last query is aligned with the last key, as when
      ``Lq`` new queries attend to a cache of ``Lk`` keys): query ``i`` sees
      keys ``j <= i + Lk - Lq``. With ``Lq > Lk`` the first ``Lq - Lk`` rows
      see nothing; npattn gives them zero weights and zero output.

    The two agree when ``Lq == Lk``.

    Parameters
    ----------
    Lq, Lk : int
        Query and key lengths.
    align : {"top_left", "bottom_right"}
    xp : namespace or backend name, optional
        Where to create the mask; default NumPy.
    device : optional
        Device of the mask, as the Array API's ``device=``.

    Returns
    -------
    mask : bool array, shape (Lq, Lk); broadcasts to (B, H, Lq, Lk).
    """
    return window(Lq, Lk, None, 0, align, xp=xp, device=device)  # j <= i + offset  [Lq, Lk]


def window(Lq: int, Lk: int, left: Optional[int], right: Optional[int],
           align: str = "top_left", *, xp: Any = None, device: Any = None) -> Any:
    """Sliding-window mask, True = may attend.  # -> [Lq, Lk] bool

    Query ``i`` sits at key position ``i + o`` (``o = 0`` top-left,
    ``o = Lk - Lq`` bottom-right) and may attend key ``j`` when
    ``i + o - left <= j <= i + o + right``; a side that is None is unbounded.
    The mask that ``sdpa_forward(..., window=(left, right), align=align)``
    applies (``window=(None, 0)`` is ``causal``). ``xp`` and ``device``: where
    to create the mask, as ``causal``'s (default NumPy).

    Parameters
    ----------
    Lq, Lk : int
        Query and key lengths.
    left, right : int >= 0 or None
        Keys attended before and after the query's own position; None: unbounded.
    align : {"top_left", "bottom_right"}
    xp : namespace or backend name, optional
        Where to create the mask; default NumPy.
    device : optional
        Device of the mask, as the Array API's ``device=``.

    Returns
    -------
    mask : bool array, shape (Lq, Lk); broadcasts to (B, H, Lq, Lk).
    """
    Lq, Lk = _check_length("Lq", Lq), _check_length("Lk", Lk)
    # |j - (i + o)| < max(Lq, Lk) in both aligns, so a side of max(Lq, Lk) or more leaves
    # nothing out: capped there, a length the index dtype holds (checked below), so that
    # the comparison stays within that dtype on every library (Lq + Lk may not)
    left, right = (None if side is None else min(_check_length(name, side, axis=False), max(Lq, Lk))
                   for name, side in (("left", left), ("right", right)))
    V.check_choice("align", align, V.ALIGNS)
    xp = _namespace_or(xp)
    V.check_device(xp, device)
    index = _index_dtype(xp, Lq=Lq, Lk=Lk)
    V.check_array_bytes(["Lq", "Lk"], (Lq, Lk), entry_bytes(xp, index),
                        "the mask's position differences j - i")  # the largest array made below
    offset = 0 if align == "top_left" else Lk - Lq
    i = xp.arange(Lq, dtype=index, device=device)  # [Lq]
    j = xp.arange(Lk, dtype=index, device=device)  # [Lk]
    d = xp.expand_dims(j, axis=0) - xp.expand_dims(i, axis=1) - offset  # [Lq, Lk]: j - (i + o)
    allowed = xp.ones((Lq, Lk), dtype=xp.bool, device=device)
    if right is not None:
        allowed = xp.logical_and(allowed, d <= right)
    if left is not None:
        allowed = xp.logical_and(allowed, d >= -left)
    return allowed  # [Lq, Lk]


def segments(q_segments: Any, k_segments: Any) -> Any:
    """Packed-sequence mask, True = may attend.  # [B, Lq], [B, Lk] -> [B, 1, Lq, Lk] bool

    Query ``i`` of batch entry ``b`` may attend key ``j`` when
    ``q_segments[b, i] == k_segments[b, j]`` (the same document): the mask that
    ``sdpa_forward(..., q_segments=, k_segments=)`` applies. Sizes whose mask could not
    exist at all (more bytes than the largest array) are a ``ValueError`` naming both.

    Parameters
    ----------
    q_segments : integer array, shape (B, Lq)
        The segment (document) id of each query.
    k_segments : integer array, shape (B, Lk)
        The segment id of each key, of q_segments' library and a dtype it compares with.

    Returns
    -------
    mask : bool array, shape (B, 1, Lq, Lk); broadcasts to (B, H, Lq, Lk).
    """
    for name, a in (("q_segments", q_segments), ("k_segments", k_segments)):
        V.check_array(name, a)
    xp = namespace(q_segments, k_segments, names=("q_segments", "k_segments"))
    for name, a in (("q_segments", q_segments), ("k_segments", k_segments)):
        if not isdtype(xp, a.dtype, "integral"):
            raise TypeError(f"{name}: expected an integer array, got dtype {a.dtype}")
        if a.ndim != 2:
            raise ValueError(f"{name}: expected shape (B, L), got shape {tuple(a.shape)}")
    if q_segments.shape[0] != k_segments.shape[0]:
        raise ValueError(
            f"k_segments: expected {q_segments.shape[0]} batch entries like q_segments, got "
            f"shape {tuple(k_segments.shape)}"
        )
    V.check_segment_dtypes(xp, q_segments, k_segments)
    V.check_array_bytes(["q_segments", "k_segments"], (int(q_segments.shape[0]), 1, int(q_segments.shape[1]),
                                                       int(k_segments.shape[1])), 1, "the mask")
    same = xp.expand_dims(q_segments, axis=2) == xp.expand_dims(k_segments, axis=1)  # [B, Lq, Lk]
    return xp.expand_dims(same, axis=1)  # [B, 1, Lq, Lk]


def padding(lengths: Any, Lk: int, *, xp: Any = None, device: Any = None) -> Any:
    """Key padding mask from sequence lengths, True = may attend.  # [B] -> [B, 1, 1, Lk] bool

    Key ``j`` of batch entry ``b`` may be attended when ``j < lengths[b]``;
    the keys from ``lengths[b]`` on are padding. A length of 0 leaves every
    query of that entry with nothing to attend (zero weights and output).

    Parameters
    ----------
    lengths : integer array of shape (B,), or a sequence of ints
        An array keeps its own backend and device (``xp`` and ``device``, when
        given, must be its own); a sequence (a list, a tuple, a range) is
        created with ``xp`` on ``device``.
    Lk : int
        Key length; every length must lie in ``[0, Lk]``.
    xp : namespace or backend name, optional
        Where to create the mask from a sequence; default NumPy.
    device : optional
        Device of the mask, as the Array API's ``device=``.

    Returns
    -------
    mask : bool array, shape (B, 1, 1, Lk)
    """
    Lk = _check_length("Lk", Lk)
    given_xp = None if xp is None else _namespace_or(xp)
    try:
        lxp = namespace(lengths)
    except TypeError:
        lxp = None
    if lxp is None:
        if not isinstance(lengths, (list, tuple, range)):  # a set or a dict has no order
            raise TypeError(f"lengths: expected an integer array of shape (B,) or a sequence of "
                            f"ints (list, tuple, range), got {V.described(lengths)}")
        seq = list(lengths)
        if not all(isinstance(n, numbers.Integral) and not isinstance(n, bool) for n in seq):
            raise TypeError(f"lengths: expected ints, got {seq!r}")
        seq = [int(n) for n in seq]
        if any(n < 0 or n > Lk for n in seq):  # (before asarray: 10**30 would overflow it)
            raise ValueError(f"lengths: expected values in [0, Lk={Lk}], got {seq}")
        xp = _namespace_or(given_xp)
        V.check_device(xp, device)
        lengths = xp.asarray(seq, dtype=_index_dtype(xp, Lk=Lk), device=device)  # [B]
    else:
        V.check_array("lengths", lengths)  # (a masked array's mask would be ignored)
        if given_xp is not None and backend_name(given_xp) != backend_name(lxp):
            raise TypeError(f"xp: expected None or the library of lengths "
                            f"({backend_name(lxp)}), got {backend_name(given_xp)}")
        if device is not None and device != device_of(lengths):
            raise ValueError(f"device: expected None or the device of lengths "
                             f"({device_of(lengths)!r}), got {device!r}")
        xp = lxp
        if not isdtype(xp, lengths.dtype, "integral"):
            raise TypeError(f"lengths: expected an integer array, got dtype {lengths.dtype}")
        device = device_of(lengths)
    if lengths.ndim != 1:
        raise ValueError(f"lengths: expected shape (B,), got shape {tuple(lengths.shape)}")
    index = _index_dtype(xp, Lk=Lk)
    V.check_array_bytes(["Lk"], (Lk,), entry_bytes(xp, index), "the key positions")
    V.check_array_bytes(["lengths", "Lk"], (int(lengths.shape[0]), 1, 1, Lk), 1, "the mask")
    host = to_numpy(lengths)
    if host.size and (host.min() < 0 or host.max() > Lk):
        raise ValueError(f"lengths: expected values in [0, Lk={Lk}], got {host.tolist()}")
    lengths = xp.astype(lengths, index)  # a small integer dtype would wrap in arange(Lk)
    j = xp.arange(Lk, dtype=index, device=device)  # [Lk]
    keep = xp.expand_dims(j, axis=0) < xp.expand_dims(lengths, axis=1)  # [B, Lk]
    return xp.reshape(keep, (lengths.shape[0], 1, 1, Lk))  # [B, 1, 1, Lk]


def _check_mask_dtype(xp, name, m):
    if not (is_bool(xp, m) or is_floating(xp, m)):
        raise TypeError(f"{name}: expected a bool or real floating array, got dtype {m.dtype}")


def from_torch_mha(
    attn_mask: Any = None,
    key_padding_mask: Any = None,
    *,
    n_head: Optional[int] = None,
    batch_size: Optional[int] = None,
    dtype: Any = None,
    xp: Any = None,
    device: Any = None,
) -> Any:
    """Convert the masks of ``torch.nn.MultiheadAttention`` into one npattn mask.

    torch's conventions, as ``nn.MultiheadAttention.forward`` reads them:

    * a **boolean** ``attn_mask`` or ``key_padding_mask`` is True where a key
      is **ignored** (the opposite of npattn and SDPA);
    * a **floating** one is **added** to the scaled scores (``-inf`` ignores);
    * ``attn_mask`` is (L, S), the same for every batch entry and head, or
      (N*H, L, S), one per batch entry and head, with entry ``n*H + h``;
    * ``key_padding_mask`` is (N, S) (or (S,) for unbatched inputs);
    * torch adds the two (as floats) when both are given.

    The result, broadcastable to (B, H, Lq, Lk):

    * all given masks boolean and ``dtype`` None: a **boolean** mask,
      True = may attend (``not attn_mask and not key_padding_mask``);
    * otherwise a **floating** additive mask: each boolean becomes 0 / ``-inf``
      and the masks are summed, as torch does. Its dtype is ``dtype``, or that
      of the floating inputs.

    Shapes out: attn_mask (L, S) -> (1, 1, L, S); (N*H, L, S) -> (N, H, L, S);
    key_padding_mask (N, S) -> (N, 1, 1, S); both -> their broadcast.

    Parameters
    ----------
    attn_mask : array, shape (L, S) or (N*H, L, S), bool or floating, optional
    key_padding_mask : array, shape (N, S) or (S,), bool or floating, optional
    n_head : int, optional
        H; needed to split a 3-D ``attn_mask`` unless ``batch_size`` is given.
    batch_size : int, optional
        N; checked against the masks when given.
    dtype : floating dtype of the masks' library, or its name, optional
        Force a floating additive mask of this dtype (torch itself always
        works with a float mask of the query's dtype).
    xp : namespace or backend name, optional
        Move the result to this backend (through the host); default: the
        backend of the inputs. A bfloat16 result needs a backend with
        bfloat16 (torch, JAX): a ``TypeError`` otherwise.
    device : optional
        Device for the result, on ``xp``'s backend or, without ``xp``, on that of
        the inputs.

    Returns
    -------
    mask : array broadcastable to (B, H, Lq, Lk), or None when both inputs are None.

    Notes
    -----
    A query row whose keys are all ignored gives NaN weights in torch and
    all-zero weights and output in npattn.
    """
    if attn_mask is None and key_padding_mask is None:
        return None
    for name, m in (("attn_mask", attn_mask), ("key_padding_mask", key_padding_mask)):
        if m is not None:
            V.check_array(name, m)
    src = namespace(attn_mask, key_padding_mask, names=("attn_mask", "key_padding_mask"))
    target = None if xp is None else resolve_backend(xp, "xp")
    if target is None and device is not None:  # a device alone: the masks' own backend, there
        target = src
    if target is not None:
        V.check_device(target, device)
    for name, m in (("attn_mask", attn_mask), ("key_padding_mask", key_padding_mask)):
        if m is not None:
            _check_mask_dtype(src, name, m)
    n_head = V.check_positive_int("n_head", n_head, allow_none=True)  # Python ints
    batch_size = V.check_positive_int("batch_size", batch_size, allow_none=True)
    if dtype is not None:  # a dtype of the masks' library: where(ignore, -inf, 0) must hold -inf
        given = dtype
        if isinstance(dtype, str):  # a name, as npattn's modules take: "float32"
            dtype = getattr(src, dtype, given)
        try:
            floating = bool(isdtype(src, dtype, "real floating"))
        except (TypeError, ValueError, AttributeError):
            floating = False
        if not floating:
            raise TypeError(f"dtype: expected None or a real floating dtype of the masks' library "
                            f"({backend_name(src)}) or its name, got {given!r}")

    parts = []  # (array in 4-D npattn shape, torch's polarity)
    if attn_mask is not None:
        parts.append(_attn_mask_4d(src, attn_mask, n_head, batch_size))
    if key_padding_mask is not None:
        parts.append(_key_padding_4d(src, key_padding_mask, batch_size))
    if len(parts) == 2:
        S_a, S_k = parts[0].shape[-1], parts[1].shape[-1]
        if S_a != S_k:
            raise ValueError(
                f"key_padding_mask: expected S={S_a} keys like attn_mask, got {S_k}"
            )
        N_a, N_k = parts[0].shape[0], parts[1].shape[0]
        if N_a != 1 and N_k != 1 and N_a != N_k:
            raise ValueError(
                f"key_padding_mask: expected N={N_a} like attn_mask, got {N_k}"
            )

    if dtype is None and all(is_bool(src, m) for m in parts):
        # True = ignore in torch; npattn keeps what no mask ignores
        keep = src.logical_not(parts[0])
        for m in parts[1:]:
            keep = src.logical_and(keep, src.logical_not(m))  # broadcast [B, H, Lq, Lk]
        out = keep
    else:
        if dtype is None:
            dtype = src.result_type(*[m.dtype for m in parts if is_floating(src, m)])
        if target is not None and V.dtype_name(dtype) == "bfloat16" and not hasattr(target, "bfloat16"):
            raise TypeError(f"xp: expected a backend with bfloat16 for a bfloat16 mask, got "
                            f"{backend_name(target)}; pass dtype= a dtype it has (float32)")
        out = None
        for m in parts:
            if is_bool(src, m):
                zeros = src.zeros(m.shape, dtype=dtype, device=device_of(m))
                add = src.where(m, scalar(src, -math.inf, zeros), zeros)  # True = ignore -> -inf
            else:
                add = src.astype(m, dtype)
            out = add if out is None else out + add  # broadcast [B, H, Lq, Lk]

    if target is not None:
        out = _moved(src, out, target, device)
    return out


def _moved(src, out, target, device):
    """``out`` as an array of ``target`` on ``device``, through the host; bfloat16 through
    float32, which holds it exactly (NumPy has no bfloat16)."""
    if V.dtype_name(out.dtype) != "bfloat16":
        return from_numpy(to_numpy(out), target, device)
    host = to_numpy(src.astype(out, src.float32))
    return target.astype(from_numpy(host, target, device), target.bfloat16)


def _attn_mask_4d(xp, m, n_head, batch_size):
    """torch's (L, S) or (N*H, L, S) attn_mask as (1, 1, L, S) or (N, H, L, S)."""
    if m.ndim == 2:
        return xp.reshape(m, (1, 1, *m.shape))  # [1, 1, L, S]
    if m.ndim != 3:
        raise ValueError(
            f"attn_mask: expected shape (L, S) or (N*H, L, S), got shape {tuple(m.shape)}"
        )
    NH, L, S = m.shape
    if n_head is None and batch_size is None:
        if NH != 1:
            raise ValueError(
                f"attn_mask: a 3-D mask of shape {tuple(m.shape)} needs n_head= "
                "(or batch_size=) to split its first axis N*H"
            )
        return xp.reshape(m, (1, 1, L, S))
    H = n_head if n_head is not None else NH // batch_size
    N = batch_size if batch_size is not None else NH // n_head
    if N * H != NH:
        raise ValueError(
            f"attn_mask: expected first axis N*H = {N}*{H} = {N * H}, got shape {tuple(m.shape)}"
        )
    return xp.reshape(m, (N, H, L, S))  # [N, H, L, S], entry n*H + h -> [n, h]


def _key_padding_4d(xp, m, batch_size):
    """torch's (N, S) or (S,) key_padding_mask as (N, 1, 1, S)."""
    if m.ndim == 1:
        m = xp.reshape(m, (1, m.shape[0]))  # [1, S]
    if m.ndim != 2:
        raise ValueError(
            f"key_padding_mask: expected shape (N, S) or (S,), got shape {tuple(m.shape)}"
        )
    N, S = m.shape
    if batch_size is not None and N != batch_size:
        raise ValueError(f"key_padding_mask: expected N=batch_size={batch_size}, got shape {tuple(m.shape)}")
    return xp.reshape(m, (N, 1, 1, S))  # [N, 1, 1, S]
