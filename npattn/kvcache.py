"""``KVCache``: the keys and values a decoder has already seen, in preallocated buffers.

Incremental decoding attends each new query to every earlier key. A
``KVCache`` keeps the projected keys and values of each batch entry, so a
step projects only its new tokens (``MultiHeadAttention.forward(...,
kv_cache=cache)`` appends them and attends over the whole cache).

Layout (flash-attn's ``cache_seqlens`` convention): two buffers ``k``
(B, Hkv, C, Dh) and ``v`` (B, Hkv, C, Dv) and one length per batch entry,
``cache_seqlens`` (B,). Entry ``b``'s keys are its own prefix
``k[b, :, :cache_seqlens[b]]``; what lies beyond an entry's length is not
part of the cache (``truncate`` only lowers the lengths).

Shape legend: B batch, Hkv key/value heads, C capacity (the most positions
an entry can hold), Dh key width, Dv value width, n new positions,
Lt = max_b(cache_seqlens[b] + n) the keys one step attends.
"""

from __future__ import annotations

import numbers
from typing import Any, NamedTuple, Optional, Sequence

import numpy as np

from . import validation as V
from .backend import (backend_from_ref, backend_name, backend_ref, copy_array, device_of, entry_bytes,
                      may_share_memory, namespace, persisted, resolve_backend)

__all__ = ["KVCache", "AlignedKV", "unalign_columns", "persist_with"]


class AlignedKV(NamedTuple):
    """The keys one decoding step attends, every entry's last key in the last column.

    ``k`` (B, Hkv, Lt, Dh) and ``v`` (B, Hkv, Lt, Dv) hold, for entry ``b``,
    ``shift[b]`` zero rows, then its ``cache_seqlens[b]`` cached keys, then
    the n new ones. ``key_mask`` (B, 1, 1, Lt) is True on the real keys and
    False on the zero rows (None when no entry is shifted). Column ``j``
    holds the key at position ``j - shift[b]`` of entry ``b``, so the
    distance from a query to a key is the same as in the entry's own
    sequence: ``align="bottom_right"`` with one offset ``Lt - Lq`` is right
    for every entry (causal, windows and ALiBi included), whatever its length.
    """
    k: Any  #: [B, Hkv, Lt, Dh]
    v: Any  #: [B, Hkv, Lt, Dv]
    key_mask: Any  #: [B, 1, 1, Lt] bool, or None when every shift is 0
    shift: tuple  #: (B,) Python ints: the zero rows in front of entry b


class KVCache:
    """Preallocated keys and values of B sequences, each with its own length.

    Parameters
    ----------
    batch_size : int
        B, the number of sequences.
    capacity : int
        C, the most positions each sequence can hold.
    num_kv_heads : int
        Hkv, key/value heads (``MultiHeadAttention.n_kv_head``).
    head_dim : int
        Dh, the width of one key head.
    value_dim : int, optional
        Dv, the width of one value head; default ``head_dim``.
    dtype : str or dtype
        "float16", "bfloat16", "float32" or "float64" (a name or a dtype of
        any library); the keys and values written must have it exactly.
    backend : str or namespace module
        As ``MultiHeadAttention(backend=)``. The buffers are written in place
        (Array API slice assignment); on a backend of immutable arrays (JAX)
        ``append`` makes new buffers with the new keys in place instead, so
        ``k`` and ``v`` read before an ``append`` keep their old contents.
    device : optional
        Device of the buffers; default the backend's default device.

    The buffers ``k`` (B, Hkv, C, Dh) and ``v`` (B, Hkv, C, Dv) are zeros
    where nothing was written; read them, write through ``append`` only.
    ``cache_seqlens`` is a host copy of the lengths.

    ``copy.deepcopy`` and ``pickle`` give a cache with buffers of its own
    (the backend travels by name and is resolved again): fork a prefilled
    cache with ``copy.deepcopy`` to decode two continuations of one prompt.
    ``copy.copy`` is shallow, as Python's convention is: the copy has its own
    lengths but shares the buffers, so an ``append`` to one writes into the
    other's buffers on a backend that writes in place (NumPy, torch, ...).

    Examples
    --------
    >>> import numpy as np
    >>> from npattn import KVCache
    >>> cache = KVCache(2, 8, 1, 4, dtype="float64")
    >>> cache.append(np.ones((2, 1, 3, 4)), np.ones((2, 1, 3, 4)))
    >>> cache.cache_seqlens.tolist()
    [3, 3]
    >>> cache.truncate([1, 3])
    >>> cache.cache_seqlens.tolist()
    [1, 3]
    """

    def __init__(self, batch_size: int, capacity: int, num_kv_heads: int, head_dim: int,
                 value_dim: Optional[int] = None, *, dtype: Any, backend: Any = "numpy",
                 device: Any = None):
        xp = resolve_backend(backend)
        # Python ints from here on (a NumPy int would wrap in the arithmetic below); no bound
        # here: the buffer-size checks below name the sizes of a buffer that cannot exist
        batch_size = V.check_positive_int("batch_size", batch_size, maximum=None)
        capacity = V.check_positive_int("capacity", capacity, maximum=None)
        num_kv_heads = V.check_positive_int("num_kv_heads", num_kv_heads, maximum=None)
        head_dim = V.check_positive_int("head_dim", head_dim, maximum=None)
        value_dim = V.check_positive_int("value_dim", value_dim, allow_none=True, maximum=None)
        name = V.float_dtype_name(xp, dtype)  # a float dtype xp has and keeps
        self.xp = xp
        self.dtype = getattr(xp, name)
        self.batch_size, self.capacity = batch_size, capacity
        self.num_kv_heads, self.head_dim = num_kv_heads, head_dim
        self.value_dim = self.head_dim if value_dim is None else value_dim
        B, Hkv, C = self.batch_size, self.num_kv_heads, self.capacity
        itemsize, sizes = entry_bytes(xp, self.dtype), ["batch_size", "num_kv_heads", "capacity"]
        V.check_array_bytes(sizes + ["head_dim"], (B, Hkv, C, self.head_dim), itemsize, "the key buffer")
        V.check_array_bytes(sizes + ["head_dim" if value_dim is None else "value_dim"],
                            (B, Hkv, C, self.value_dim), itemsize, "the value buffer")
        V.check_device(xp, device)  # a device the backend lacks: named, before the buffers are made
        self._k = xp.zeros((B, Hkv, C, self.head_dim), dtype=self.dtype, device=device)  # [B, Hkv, C, Dh]
        self._v = xp.zeros((B, Hkv, C, self.value_dim), dtype=self.dtype, device=device)  # [B, Hkv, C, Dv]
        self._in_place = _writes_in_place(self._k[0, 0, 0, :1])  # False: JAX's immutable arrays
        self.device = device_of(self._k)
        self._lens = (0,) * B  # Python ints: entry b holds keys [0, _lens[b])

    # ------------------------------------------------------------ reading

    @property
    def k(self) -> Any:
        """The key buffer (B, Hkv, C, Dh); entry ``b``'s keys are ``k[b, :, :cache_seqlens[b]]``."""
        return self._k

    @property
    def v(self) -> Any:
        """The value buffer (B, Hkv, C, Dv); entry ``b``'s values are ``v[b, :, :cache_seqlens[b]]``."""
        return self._v

    @property
    def cache_seqlens(self) -> np.ndarray:
        """(B,) int64 NumPy array, a copy: how many positions each entry holds.

        The lengths decide slices and shapes, so they live on the host as
        Python ints, like an array's shape.
        """
        return np.array(self._lens, dtype=np.int64)

    def __repr__(self) -> str:
        return (
            f"KVCache(batch_size={self.batch_size}, capacity={self.capacity}, "
            f"num_kv_heads={self.num_kv_heads}, head_dim={self.head_dim}, "
            f"value_dim={self.value_dim}, dtype={V.dtype_name(self.dtype)!r}, "
            f"backend={backend_name(self.xp)!r}, cache_seqlens={list(self._lens)})"
        )

    # ------------------------------------------------------------ copies

    def __getstate__(self) -> dict:
        """What ``pickle`` and ``copy.deepcopy`` keep: the buffers, the lengths and the layout.

        The namespace and the dtype travel by name (``backend.backend_ref``) and are
        resolved again on load; the device is read again from the buffers.
        """
        state = dict(self.__dict__)
        state["xp"] = backend_ref(self.xp)
        state["dtype"] = V.dtype_name(self.dtype)
        del state["device"]  # a device object need not pickle (JAX's); the buffers know it
        return state

    def __setstate__(self, state: dict) -> None:
        state = dict(state)
        xp = backend_from_ref(state["xp"])
        state["xp"], state["dtype"] = xp, getattr(xp, state["dtype"])
        self.__dict__.update(state)
        self.device = device_of(self._k)

    # ------------------------------------------------------------ checks

    def check_room(self, n: int, *, name: str = "kv_cache") -> None:
        """``ValueError`` (naming ``name``) unless every entry has room for ``n`` more positions
        (``TypeError``/``ValueError`` naming ``n`` unless it is an int >= 0, ``TypeError``
        unless ``name`` is a str)."""
        if not isinstance(name, str):
            raise TypeError(f"name: expected a str (the argument the message names), got "
                            f"{V.described(name)}")
        n = V.check_size("n", n, maximum=None)  # a Python int: a NumPy one would wrap in L + n
        for b, L in enumerate(self._lens):
            if L + n > self.capacity:
                raise ValueError(
                    f"{name}: expected room for {n} new position{'s' if n != 1 else ''} in every "
                    f"batch entry, but entry {b} holds {L} of capacity {self.capacity} "
                    f"({L} + {n} = {L + n} > {self.capacity}); nothing was written"
                )

    def check_new(self, k_new: Any, v_new: Any) -> None:
        """Check new keys (B, Hkv, n, Dh) and values (B, Hkv, n, Dv) for ``append``: the
        cache's backend, device and dtype, its layout, n >= 1, and room for them."""
        want = {"k_new": (self.batch_size, self.num_kv_heads, None, self.head_dim),
                "v_new": (self.batch_size, self.num_kv_heads, None, self.value_dim)}
        for name, x in (("k_new", k_new), ("v_new", v_new)):
            V.check_floating_array(name, x, self.xp, self.device, dtype=self.dtype,
                                   like="the cache")
            B, Hkv, _, D = want[name]
            text = f"(B, Hkv, n, {'Dh' if name == 'k_new' else 'Dv'}) = ({B}, {Hkv}, n, {D})"
            shape = V.shape_of(x)
            if len(shape) != 4 or shape[:2] != (B, Hkv) or shape[3] != D:
                raise ValueError(f"{name}: expected shape {text}, got {shape}")
        n = int(k_new.shape[2])
        if n == 0:
            raise ValueError("k_new: expected at least 1 new position, got 0")
        if int(v_new.shape[2]) != n:
            raise ValueError(f"v_new: expected {n} position{'s' if n != 1 else ''} (those of "
                             f"k_new), got shape {V.shape_of(v_new)}")
        self.check_room(n)

    # ------------------------------------------------------------ writing

    def append(self, k_new: Any, v_new: Any) -> None:
        """Write ``k_new`` (B, Hkv, n, Dh) and ``v_new`` (B, Hkv, n, Dv) at each entry's length.

        Entry ``b``'s new keys land in ``k[b, :, L_b : L_b + n]`` with
        ``L_b = cache_seqlens[b]``, and its length becomes ``L_b + n``.
        Everything is checked first (``check_new``: a full entry is a
        ``ValueError`` naming ``kv_cache``); a failed call writes nothing.
        ``k_new`` and ``v_new`` may be views of the cache's own buffers: they
        are read before anything is written.

        Parameters
        ----------
        k_new : array, shape (B, Hkv, n, Dh)
        v_new : array, shape (B, Hkv, n, Dv)
            n >= 1 new positions of every entry, of the cache's dtype, backend and device.
        """
        # [B, Hkv, n, Dh], [B, Hkv, n, Dv] -> k[b, :, L_b : L_b + n], v[b, :, L_b : L_b + n]
        self.check_new(k_new, v_new)
        n = int(k_new.shape[2])
        lens = self._lens
        if not self._in_place:
            self._k, self._v = (_written(self.xp, buf, new, lens)
                                for buf, new in ((self._k, k_new), (self._v, v_new)))
            self._lens = tuple(L + n for L in lens)
            return
        # new keys that are a view of the buffers themselves (their unused tail included) are
        # copied first: torch refuses a write whose source overlaps it, NumPy copies one itself
        k_new, v_new = (copy_array(self.xp, a) if may_share_memory(a, self._k)
                        or may_share_memory(a, self._v) else a for a in (k_new, v_new))
        if len(set(lens)) == 1:  # one slice for the whole batch
            L = lens[0]
            self._k[:, :, L : L + n, :] = k_new  # [B, Hkv, n, Dh]
            self._v[:, :, L : L + n, :] = v_new  # [B, Hkv, n, Dv]
        else:
            for b, L in enumerate(lens):
                self._k[b, :, L : L + n, :] = k_new[b, ...]  # [Hkv, n, Dh]
                self._v[b, :, L : L + n, :] = v_new[b, ...]  # [Hkv, n, Dv]
        self._lens = tuple(L + n for L in lens)

    def persist(self) -> None:
        """On dask, compute the buffers now and keep them computed (``dask.persist``); on
        other backends nothing happens.

        Each ``append`` on dask adds a step to the buffers' task graph, so a decoding
        loop that computes every token (sampling reads the logits) would compute
        every earlier token's keys again at each step, quadratic in the tokens; call
        this after each step (``GPT.generate`` does). The contents do not change.
        """
        self._k, self._v = persisted(self._k, self._v)

    def truncate(self, seqlens: Any) -> None:
        """Shorten the entries to ``seqlens``: one int for all, or B ints (a list, tuple or
        range, or a 1-D NumPy array), each between 0 and the entry's current length.

        Ragged prompts: prefill them right-padded to one length, then
        ``truncate(prompt_lengths)``; each entry's next token is written
        after its own prompt. Checked before anything changes.

        Parameters
        ----------
        seqlens : int, or list, tuple, range or 1-D NumPy array of B ints
            The new lengths, each in [0, cache_seqlens[b]].
        """
        B = self.batch_size
        if isinstance(seqlens, numbers.Integral) and not isinstance(seqlens, (bool, np.bool_)):
            given: list = [seqlens] * B
        elif isinstance(seqlens, (list, tuple, range)) or (isinstance(seqlens, np.ndarray)
                                                            and seqlens.ndim == 1):
            given = list(seqlens)
        else:
            shape = f" of shape {V.shape_of(seqlens)}" if isinstance(seqlens, np.ndarray) else ""
            raise TypeError(f"seqlens: expected an int or {B} ints (a list, tuple, range or 1-D "
                            f"NumPy array), got {V.type_name(seqlens)}{shape}")
        if len(given) != B:
            raise ValueError(f"seqlens: expected {B} lengths (one per batch entry), got {len(given)}")
        new = [V.check_size(f"seqlens[{b}]", s) for b, s in enumerate(given)]  # Python ints
        for b, (s, L) in enumerate(zip(new, self._lens)):
            if s > L:
                raise ValueError(f"seqlens[{b}]: expected at most {L} (entry {b}'s length; "
                                 f"truncate cannot lengthen), got {s}")
        self._lens = tuple(new)

    def reset(self) -> None:
        """Empty every entry (``truncate(0)``)."""
        self.truncate(0)

    # ------------------------------------------------------------ attending

    def right_aligned(self, k_new: Any, v_new: Any) -> AlignedKV:
        """The cached keys and values of every entry followed by ``k_new`` / ``v_new``,
        right-aligned (``AlignedKV``); the cache is not changed.

        With equal lengths this is ``concat([k[:, :, :L], k_new])``; otherwise
        entry ``b`` gets ``shift[b] = Lt - (cache_seqlens[b] + n)`` zero rows in
        front, which ``key_mask`` hides.

        Parameters
        ----------
        k_new : array, shape (B, Hkv, n, Dh)
        v_new : array, shape (B, Hkv, n, Dv)
            Checked as ``append``'s (room in the cache included).

        Returns
        -------
        aligned : AlignedKV
            ``k`` (B, Hkv, Lt, Dh), ``v`` (B, Hkv, Lt, Dv), ``key_mask`` (B, 1, 1, Lt) or
            None, ``shift`` (B ints).
        """
        # [B, Hkv, n, Dh], [B, Hkv, n, Dv] -> [B, Hkv, Lt, Dh], [B, Hkv, Lt, Dv], [B, 1, 1, Lt]
        self.check_new(k_new, v_new)
        xp = self.xp
        n = int(k_new.shape[2])
        total = [L + n for L in self._lens]
        Lt = max(total)
        shift = tuple(Lt - t for t in total)
        if not any(shift):
            L = self._lens[0]
            if L == 0:
                return AlignedKV(k_new, v_new, None, shift)
            k = xp.concat([self._k[:, :, :L, :], k_new], axis=2)  # [B, Hkv, Lt, Dh]
            v = xp.concat([self._v[:, :, :L, :], v_new], axis=2)  # [B, Hkv, Lt, Dv]
            return AlignedKV(k, v, None, shift)
        k = xp.concat([self._entry(self._k, k_new, b, s) for b, s in enumerate(shift)], axis=0)
        v = xp.concat([self._entry(self._v, v_new, b, s) for b, s in enumerate(shift)], axis=0)
        cols = xp.arange(Lt, device=self.device)  # [Lt]
        first = xp.asarray(list(shift), device=self.device)  # [B] first real column of entry b
        key_mask = xp.expand_dims(cols, axis=0) >= xp.expand_dims(first, axis=1)  # [B, Lt]
        key_mask = xp.reshape(key_mask, (self.batch_size, 1, 1, Lt))  # [B, 1, 1, Lt]
        return AlignedKV(k, v, key_mask, shift)

    def _entry(self, buf: Any, new: Any, b: int, shift: int) -> Any:
        """Entry ``b`` of ``right_aligned``: [1, Hkv, shift + L_b + n, X]."""
        xp, L = self.xp, self._lens[b]
        parts = []
        if shift:
            parts.append(xp.zeros((1, buf.shape[1], shift, buf.shape[3]), dtype=self.dtype,
                                  device=self.device))  # [1, Hkv, shift, X]
        if L:
            parts.append(buf[b : b + 1, :, :L, :])  # [1, Hkv, L_b, X]
        parts.append(new[b : b + 1, ...])  # [1, Hkv, n, X]
        return xp.concat(parts, axis=2) if len(parts) > 1 else parts[0]


def persist_with(caches: Sequence[KVCache], *arrays: Any) -> tuple:
    """``arrays`` computed with the buffers of every cache in ``caches``, in one
    ``dask.persist``, and kept computed (``KVCache.persist`` for each cache); on other
    backends everything is left as it is and ``arrays`` come back as given.

    A decoding step's logits and the keys of block ``n`` share the blocks before ``n``:
    a persist per cache and then a read of the logits compute those blocks once for each
    (a 2-block GPT: the first block's attention twice a step, its keys three times).

    Parameters
    ----------
    caches : sequence of KVCache
    *arrays : array
        Arrays to compute with the buffers (a step's logits).

    Returns
    -------
    arrays : tuple
        ``arrays`` in their order: dask arrays persisted (still dask arrays, their
        chunks computed), the others as given.
    """
    if isinstance(caches, (str, bytes)) or not isinstance(caches, Sequence):
        raise TypeError(f"caches: expected a sequence of npattn.KVCache, got {V.type_name(caches)}")
    for i, cache in enumerate(caches):
        if not isinstance(cache, KVCache):
            raise TypeError(f"caches[{i}]: expected an npattn.KVCache, got {V.type_name(cache)}")
    done = persisted(*(buf for cache in caches for buf in (cache._k, cache._v)), *arrays)
    for i, cache in enumerate(caches):
        cache._k, cache._v = done[2 * i], done[2 * i + 1]
    return done[2 * len(caches):]


def unalign_columns(x: Any, shift: Sequence[int]) -> Any:
    """Undo ``right_aligned`` on the last axis: column ``j`` of the result is position
    ``j`` of entry ``b``; the ``shift[b]`` columns freed at the end are zeros.

    ``x`` has shape (B, ..., Lt), e.g. attention weights (B, H, Lq, Lt);
    ``shift`` holds B ints in [0, Lt] (``AlignedKV.shift``).
    """
    # [B, ..., Lt] -> [B, ..., Lt]
    V.check_array("x", x)
    if x.ndim < 2:
        raise ValueError(f"x: expected shape (B, ..., Lt), at least 2-D, got shape {tuple(x.shape)}")
    B, Lt = x.shape[0], x.shape[-1]
    if isinstance(shift, np.ndarray) and shift.ndim == 1:  # NumPy ints on the host
        shift = shift.tolist()
    if isinstance(shift, (str, bytes)) or not isinstance(shift, Sequence):
        raise TypeError(f"shift: expected a sequence of {B} ints, got {V.type_name(shift)}")
    if len(shift) != B:
        raise ValueError(f"shift: expected {B} ints (x's batch), got {len(shift)}")
    shift = [V.check_size(f"shift[{b}]", n) for b, n in enumerate(shift)]  # Python ints
    for b, n in enumerate(shift):
        if n > Lt:
            raise ValueError(f"shift[{b}]: expected an int in [0, Lt={Lt}], got {n}")
    if not any(shift):
        return x
    xp = namespace(x)
    rows = []
    for b, s in enumerate(shift):
        row = x[b : b + 1, ..., s:]  # [1, ..., Lt - s]
        if s:
            pad = xp.zeros(tuple(row.shape[:-1]) + (s,), dtype=x.dtype, device=device_of(x))
            row = xp.concat([row, pad], axis=-1)  # [1, ..., Lt]
        rows.append(row)
    return xp.concat(rows, axis=0)


def _written(xp: Any, buf: Any, new: Any, lens: Sequence[int]) -> Any:
    """A copy of ``buf`` with ``new`` written at each entry's length, for immutable arrays.
    # [B, Hkv, C, D], [B, Hkv, n, D] -> [B, Hkv, C, D]: buf[b, :, L_b : L_b + n] = new[b]"""
    n = new.shape[2]
    if len(set(lens)) == 1:  # one concatenation for the whole batch
        L = lens[0]
        return xp.concat([buf[:, :, :L, :], new, buf[:, :, L + n:, :]], axis=2)
    rows = [xp.concat([buf[b:b + 1, :, :L, :], new[b:b + 1, ...], buf[b:b + 1, :, L + n:, :]], axis=2)
            for b, L in enumerate(lens)]  # [1, Hkv, C, D] each
    return xp.concat(rows, axis=0)


def _writes_in_place(x: Any) -> bool:
    """Whether ``x`` (one element) takes a slice assignment, as the Array API allows."""
    try:
        x[0:1] = x[0:1]
    except (TypeError, ValueError, NotImplementedError):
        return False
    return True
