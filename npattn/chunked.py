"""Chunk-parallel attention for dask arrays: one task per chunk, the blocked steps inside it.

``npattn.attention`` dispatches here (``impl="chunked"``, and ``"auto"`` on
dask arrays). The arrays' own chunks are the plan:

* batch entries: the chunks of ``q`` along axis 0;
* heads: the chunks of ``k`` along axis 1 (K/V heads); under grouped-query
  attention a chunk of ``q`` holds the G query heads of each of its K/V heads;
* query rows: the chunks of ``q`` along axis 2 (*query chunking*);
* keys: the chunks of ``k`` along axis 2 (*key chunking*).

The other inputs are rechunked to that plan (nothing happens when they match
already) and the head widths are one chunk each. A task sees one chunk of
queries against one chunk of keys, as NumPy arrays, and runs
``npattn.blocked`` on them: its scores are formed one block of ``bq x bk``
per head at a time, whatever the chunk lengths. What a task forms whole is
boolean: the causal diagonal of a pair that crosses it (``ri x ck``) and its
part of a drawn dropout mask (``Bc x Hc x ri x ck``, hashed a slab of rows at
a time), a quarter of the pair's float32 scores; a floating mask arrives as a
chunk of that size (and with ``is_causal`` is combined with the diagonal into
one more array of the pair's size).

Forward. For every chunk ``(b, h, i)`` of the output and every key chunk
``j`` it meets (with ``is_causal``, the key chunks wholly above the diagonal
are left out of the graph):

1. task ``(b, h, i, j)``: the blocked forward of query chunk ``i`` against key
   chunk ``j``: ``o_ij`` (normalised by its own row sum), the row maximum
   ``m_ij`` and the row sum ``l_ij = sum_{k in j} exp(z_k - m_ij)``;
2. task ``(b, h, i)``, the blocked algorithm's merge across chunks:
   ``m = max_j m_ij`` over the chunks where the row attends something,
   ``w_ij = l_ij exp(m_ij - m)``, ``l = sum_j w_ij``,
   ``out = sum_j w_ij o_ij / l`` (0 for a row with nothing to attend).

``m`` and ``l`` are kept apart, as in ``npattn.blocked`` (exact at large
scores). Without key chunking step 2 has one pair and passes it on as it is
(the task stays in the graph).

Backward. With the merged ``out``, ``m``, ``l`` of query chunk ``i``:

3. task ``(b, h, i, j)``: the blocked backward of that pair of chunks, which
   rebuilds ``p = exp(z - m) / l`` with the *merged* row statistics, so its
   ``dq_ij``, ``dk_ij``, ``dv_ij`` are the pair's exact shares;
4. ``dq(b, h, i) = sum_j dq_ij``; ``dk(b, h, j) = sum_i dk_ij`` and
   ``dv`` likewise: one task per output chunk. A floating mask's gradient is
   the ``ds`` of each pair, summed to the mask's own shape.

The graph has ``O(chunks)`` tasks, not a layer per array operation. Dropout
from a generator draws one key on the caller's side; each task draws its own
part of the one keep-mask from ``npattn.backend.keyed_keep_mask`` with global
coordinates, so no full-size mask exists anywhere and the mask is the NumPy
run's, bit for bit, whatever the chunking (the output, merged across key
chunks, equals it to rounding). A caller's keep-mask is chunked
like the inputs.

Results are dask arrays; nothing is computed until the caller computes them.
On a threaded scheduler npattn's tasks run one at a time per process (each on
npattn's tile pool: ``npattn.backend.exclusive``); a ``dask.distributed``
cluster runs one per worker process in parallel.

Shape legend: B batch, Hq query heads, Hkv K/V heads, G = Hq // Hkv, Lq / Lk
query / key lengths, Dh key width, Dv value width; ``(b, h, i, j)`` chunk
indices along batch, K/V heads, query rows and keys.
"""

from __future__ import annotations

import functools
import math
import operator
from typing import Any, NamedTuple, Optional

import numpy as np

from . import blocked
from . import validation as V
from .backend import device_of, dropout_key, is_dask_array, keyed_keep_mask, namespace, scalar
from .functional import SDPAGrads, sum_to_shape

__all__ = ["ChunkPlan", "ChunkedSDPACache", "accepts", "sdpa_forward", "sdpa_backward", "keep_mask_of"]


def accepts(q, k, v, mask=None, dropout_mask=None) -> bool:
    """Whether this implementation takes these arguments: dask arrays q (B, Hq, Lq, Dh),
    k (B, Hkv, Lk, Dh), v (B, Hkv, Lk, Dv) of one B and known chunk sizes, and masks
    that broadcast to (B, Hq, Lq, Lk) without growing it."""
    arrays = (q, k, v, mask, dropout_mask)
    if not all(a is None or is_dask_array(a) for a in arrays):
        return False
    if any(math.isnan(n) for a in arrays if a is not None for n in a.shape):
        return False  # unknown chunk sizes
    return V.heads_layout(q, k, v, mask, dropout_mask)


# ------------------------------------------------------------------ the plan


class ChunkPlan(NamedTuple):
    """Chunk boundaries along (B, Hkv, Lq, Lk) and the group size G."""

    b: tuple  #: chunk lengths along the batch
    h: tuple  #: along the K/V heads
    i: tuple  #: along the query rows
    j: tuple  #: along the keys
    G: int  #: query heads per K/V head

    def starts(self, axis: str) -> list:
        """Where the chunks along ``axis`` ("b", "h", "i" or "j") start, and the end."""
        sizes = getattr(self, axis)
        return [0, *np.cumsum(sizes).tolist()]


def _nonempty(chunks) -> tuple:
    """Chunk lengths without empty chunks (dask allows them; a pair of them has no rows)."""
    kept = tuple(int(n) for n in chunks if n)
    return kept or tuple(int(n) for n in chunks[:1])


def _plan(q, k, G) -> ChunkPlan:
    return ChunkPlan(b=_nonempty(q.chunks[0]), h=_nonempty(k.chunks[1]), i=_nonempty(q.chunks[2]),
                     j=_nonempty(k.chunks[2]), G=G)


def _rechunk(a, plan: ChunkPlan, kinds: tuple):
    """``a`` (4-D) rechunked to the plan: ``kinds[axis]`` is ``"b"``, ``"hq"`` (query
    heads), ``"hk"`` (K/V heads), ``"i"`` or ``"j"``, or None for one chunk; an axis of
    size 1 (a broadcast mask axis) stays one chunk."""
    sizes = {"b": plan.b, "hq": tuple(plan.G * n for n in plan.h), "hk": plan.h, "i": plan.i,
             "j": plan.j}
    return a.rechunk(tuple((n,) if kind is None or n == 1 else sizes[kind]
                           for n, kind in zip(a.shape, kinds)))


_MASK = ("b", "hq", "i", "j")  # how a mask over (B, Hq, Lq, Lk) is chunked


def _pad4(a):
    """``a`` with leading 1-axes up to 4 axes (a mask that broadcasts).

    New axes by indexing, not ``reshape``: dask's reshape fails on an axis of
    length 1 chunked ``(1, 0)`` (an IndexError, or a graph with a missing key)."""
    return a if a.ndim == 4 else a[(None,) * (4 - a.ndim)]


def _causal_skip(i0, i1, j0) -> bool:
    """Key chunk starting at ``j0`` lies wholly above the diagonal of query rows ``i0:i1``."""
    return j0 > i1 - 1


def _mask_key(mask4, b, h, i, j):
    """Key of the mask chunk that pair ``(b, h, i, j)`` reads (0 on a broadcast axis)."""
    idx = [b, h, i, j]
    return (mask4.name, *(0 if mask4.numblocks[a] == 1 else idx[a] for a in range(4)))


# ------------------------------------------------------------------ one task


class _Pair(NamedTuple):
    """What a task needs beyond its arrays: where its chunks lie and the options."""

    b0: int  #: first batch entry
    h0: int  #: first query head
    i0: int  #: first query row
    j0: int  #: first key
    is_causal: bool  #: causal attention (top-left)
    scale: float  #: the factor of the scores
    dropout_p: float  #: the drop probability
    key: Optional[int]  #: dropout key (a generated keep-mask), or None
    G: int  #: query heads per K/V head
    block_q: Optional[int]  #: the blocked algorithm's block sizes inside the task, or None
    block_k: Optional[int]  #: (its defaults)


def _pair_masks(pair: _Pair, q, k, mask, keep):
    """The pair's mask (the caller's, with the causal diagonal at global positions) and keep-mask."""
    ri, ck = q.shape[2], k.shape[2]
    if pair.is_causal and pair.j0 + ck - 1 > pair.i0:  # the pair crosses the diagonal
        allowed = (pair.i0 + np.arange(ri))[:, None] >= (pair.j0 + np.arange(ck))[None, :]
        if mask is None:
            mask = allowed
        elif mask.dtype == np.bool_:
            mask = np.logical_and(mask, allowed)
        else:
            mask = np.where(allowed, mask, -math.inf).astype(mask.dtype, copy=False)  # [.., ri, ck]
    if pair.key is not None:  # this pair's part of the one mask: global coordinates
        Bc, Hc = q.shape[0], q.shape[1]
        lead = [np.arange(pair.b0, pair.b0 + Bc)[:, None], np.arange(pair.h0, pair.h0 + Hc)[None, :]]
        keep = keyed_keep_mask(pair.key, pair.dropout_p, lead, pair.i0 + np.arange(ri),
                               pair.j0 + np.arange(ck))  # [Bc, Hc, ri, ck]
    return mask, keep


def _pair_cache(pair: _Pair, q, k, v, mask, keep):
    mask, keep = _pair_masks(pair, q, k, mask, keep)
    return blocked.blocked_cache(q, k, v, mask=mask, is_causal=False, scale=pair.scale,
                                 dropout_p=pair.dropout_p if keep is not None else 0.0,
                                 dropout_mask=keep, groups=pair.G, block_q=pair.block_q,
                                 block_k=pair.block_k)


def _pair_forward(pair: _Pair, q, k, v, mask, keep):
    """1. One query chunk against one key chunk: ``(o_ij, m_ij, l_ij)`` (compute dtype)."""
    # [Bc, Hc, ri, Dh], [Bc, Hkc, ck, Dh], [Bc, Hkc, ck, Dv] -> [Bc, Hc, ri, Dv], [.., 1], [.., 1]
    mask, keep = _pair_masks(pair, q, k, mask, keep)
    _, c = blocked.sdpa_blocked_forward_core(
        q, k, v, mask=mask, is_causal=False, scale=pair.scale,
        dropout_p=pair.dropout_p if keep is not None else 0.0, dropout_mask=keep, rng=None,
        groups=pair.G, block_q=pair.block_q, block_k=pair.block_k)
    return blocked.rows_of(c)


def _merge(parts):
    """2. The merge across key chunks: ``(out, m, l)`` of the whole row from its pairs."""
    if len(parts) == 1:
        return parts[0]
    # a pair where the row attends nothing has l = 0 (and m = 0): it must not set the maximum
    ms = [np.where(l == 0.0, -np.inf, m) for _, m, l in parts]
    m = functools.reduce(np.maximum, ms)  # [Bc, Hc, ri, 1]
    m = np.where(m == -np.inf, 0.0, m).astype(parts[0][1].dtype)
    w = [l * np.exp(mj - m) for (_, _, l), mj in zip(parts, ms)]  # exp(-inf) = 0
    l = functools.reduce(operator.add, w)
    acc = functools.reduce(operator.add, [wj * o for wj, (o, _, _) in zip(w, parts)])
    out = acc / np.where(l == 0.0, 1.0, l)
    return out.astype(parts[0][0].dtype), m, l.astype(parts[0][2].dtype)


def _pair_backward(pair: _Pair, q, k, v, mask, keep, dout, out, m, l, dlse, mask_shape):
    """3. The pair's shares ``(dq_ij, dk_ij, dv_ij, dmask_ij)`` from the merged row statistics
    (and the rows' ``dlse``, [Bc, Hc, ri, 1], or None)."""
    c = blocked.with_rows(_pair_cache(pair, q, k, v, mask, keep), out, m, l)
    dq, dk, dv, dmask, _ = blocked.sdpa_blocked_backward(dout, c, dlse=dlse)
    if dmask is not None:  # the causal diagonal may have broadcast the caller's mask chunk
        dmask = sum_to_shape(np, dmask, mask_shape)
    return dq, dk, dv, dmask


def _sum(parts, field, shape, dtype):
    """4. The sum of one field of the pairs' gradients (zeros when no pair met the chunk)."""
    if not parts:
        return np.zeros(shape, dtype=dtype)
    return functools.reduce(operator.add, [p[field] for p in parts])


def _keep_chunk(key, p, b0, h0, i0, j0, shape):
    """One chunk (Bc, Hc, ri, ck) of the generated keep-mask."""
    lead = [np.arange(b0, b0 + shape[0])[:, None], np.arange(h0, h0 + shape[1])[None, :]]
    return keyed_keep_mask(key, p, lead, i0 + np.arange(shape[2]), j0 + np.arange(shape[3]))


# ------------------------------------------------------------------ forward


class ChunkedSDPACache(NamedTuple):
    """What the chunked ``sdpa_backward`` needs from ``sdpa_forward``: dask arrays of the
    inputs, the merged output and row statistics, and the plan of chunk pairs."""
    q: Any  #: [B, Hq, Lq, Dh] dask, compute dtype, rechunked to the plan
    k: Any  #: [B, Hkv, Lk, Dh]
    v: Any  #: [B, Hkv, Lk, Dv]
    mask: Any  #: [B|1, Hq|1, Lq|1, Lk|1] dask, chunked to the plan, or None
    keep: Any  #: the caller's keep-mask likewise, or None
    out: Any  #: [B, Hq, Lq, Dv] dask, compute dtype: the merged output
    m: Any  #: [B, Hq, Lq, 1] merged row maximum
    l: Any  #: [B, Hq, Lq, 1] merged row sum
    plan: ChunkPlan  #: the chunks of the forward, which the backward takes again
    is_causal: bool  #: causal attention (top-left)
    scale: float  #: the factor of the scores
    dropout_p: float  #: the drop probability
    dropout_key: Optional[int]  #: key of the drawn keep-mask, or None
    mask_shape: Optional[tuple]  #: shape of a floating mask as given, for dmask
    in_dtype: Any  #: dtype of q, k, v; gradients are cast back to it
    block_q: Optional[int]  #: the blocked algorithm's block sizes inside each task, or None
    block_k: Optional[int]  #: (its defaults)

    @property
    def lse(self) -> Any:
        """[B, Hq, Lq] dask: natural log-sum-exp of each row, ``m + log(l)``; -inf for a row
        with nothing to attend."""
        xp = namespace(self.m)
        empty = self.l == 0.0
        l_safe = xp.where(empty, scalar(xp, 1.0, self.l), self.l)
        lse = xp.where(empty, scalar(xp, -math.inf, self.l), self.m + xp.log(l_safe))
        return xp.reshape(lse, tuple(self.m.shape[:-1]))


def _pairs(plan: ChunkPlan, is_causal: bool):
    """``(b, h, i, j)`` of every pair of chunks in the graph, in order."""
    si, sj = plan.starts("i"), plan.starts("j")
    for b in range(len(plan.b)):
        for h in range(len(plan.h)):
            for i in range(len(plan.i)):
                for j in range(len(plan.j)):
                    if not (is_causal and _causal_skip(si[i], si[i + 1], sj[j])):
                        yield b, h, i, j


def _pair_of(c, b, h, i, j) -> _Pair:
    plan = c.plan
    return _Pair(b0=plan.starts("b")[b], h0=plan.G * plan.starts("h")[h], i0=plan.starts("i")[i],
                 j0=plan.starts("j")[j], is_causal=c.is_causal, scale=c.scale,
                 dropout_p=c.dropout_p, key=c.dropout_key, G=plan.G, block_q=c.block_q,
                 block_k=c.block_k)


def _array(graph, name, deps, chunks, dtype):
    import dask.array as da
    from dask.highlevelgraph import HighLevelGraph

    hlg = HighLevelGraph.from_collections(name, graph, dependencies=[d for d in deps if d is not None])
    return da.Array(hlg, name, chunks, dtype=dtype, meta=np.empty((0,) * len(chunks), dtype=dtype))


def _inputs(c, b, h, i, j):
    """Keys of the chunks that pair ``(b, h, i, j)`` reads: q, k, v, mask, keep."""
    return ((c.q.name, b, h, i, 0), (c.k.name, b, h, j, 0), (c.v.name, b, h, j, 0),
            None if c.mask is None else _mask_key(c.mask, b, h, i, j),
            None if c.keep is None else _mask_key(c.keep, b, h, i, j))


def sdpa_forward(q: Any, k: Any, v: Any, *, mask: Any, is_causal: bool, scale: Optional[float],
                 dropout_p: float, dropout_mask: Any, rng: Any, groups: int,
                 block_q: Optional[int] = None, block_k: Optional[int] = None
                 ) -> tuple[Any, ChunkedSDPACache]:
    """Chunk-parallel ``softmax(q k^T * scale + mask) v`` on checked dask arguments (``accepts``).

    The arguments are those of ``functional.sdpa_forward_core`` plus the
    blocked algorithm's block lengths inside each task. Returns
    ``(out, ChunkedSDPACache)``; ``out`` is a dask array chunked like ``q``
    (its last axis one chunk).
    """
    # [B, Hq, Lq, Dh], [B, Hkv, Lk, Dh], [B, Hkv, Lk, Dv] -> [B, Hq, Lq, Dv]
    from dask.base import tokenize

    G = groups
    in_dtype = q.dtype
    work = np.dtype(np.float32) if in_dtype in (np.float16,) else np.dtype(in_dtype)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    plan = _plan(q, k, G)
    q = _rechunk(q.astype(work), plan, ("b", "hq", "i", None))  # [B, Hq, Lq, Dh]
    k = _rechunk(k.astype(work), plan, ("b", "hk", "j", None))  # [B, Hkv, Lk, Dh]
    v = _rechunk(v.astype(work), plan, ("b", "hk", "j", None))  # [B, Hkv, Lk, Dv]
    mask_shape = None
    if mask is not None:
        if mask.dtype != np.bool_:
            mask_shape = tuple(mask.shape)
            mask = mask.astype(work)
        mask = _rechunk(_pad4(mask), plan, _MASK)
    keep = None if dropout_mask is None else _rechunk(_pad4(dropout_mask), plan, _MASK)
    key = dropout_key(rng) if dropout_p != 0.0 and dropout_mask is None else None
    c = ChunkedSDPACache(q=q, k=k, v=v, mask=mask, keep=keep, out=None, m=None, l=None, plan=plan,
                         is_causal=bool(is_causal), scale=scale, dropout_p=float(dropout_p),
                         dropout_key=key, mask_shape=mask_shape, in_dtype=in_dtype,
                         block_q=block_q, block_k=block_k)

    token = tokenize(q, k, v, mask, keep, is_causal, scale, dropout_p, key, G, block_q, block_k)
    part, rows = "npattn-pair-forward-" + token, "npattn-merge-" + token
    names = {x: f"npattn-{x}-" + token for x in ("out", "m", "l")}
    graph: dict = {}
    parts: dict = {}
    for b, h, i, j in _pairs(plan, c.is_causal):
        graph[(part, b, h, i, j)] = (functools.partial(_pair_forward, _pair_of(c, b, h, i, j)),
                                     *_inputs(c, b, h, i, j))
        parts.setdefault((b, h, i), []).append((part, b, h, i, j))
    for (b, h, i), keys in parts.items():
        graph[(rows, b, h, i)] = (_merge, keys)
        for field, x in enumerate(("out", "m", "l")):
            graph[(names[x], b, h, i, 0)] = (operator.getitem, (rows, b, h, i), field)
    deps = [q, k, v, mask, keep]
    lead = (plan.b, tuple(G * n for n in plan.h), plan.i)
    out = _array(graph, names["out"], deps, lead + ((v.shape[3],),), work)
    m = _array(graph, names["m"], deps, lead + ((1,),), work)
    l = _array(graph, names["l"], deps, lead + ((1,),), work)
    c = c._replace(out=out, m=m, l=l)
    return (out if work == in_dtype else out.astype(in_dtype)), c


def keep_mask_of(cache: ChunkedSDPACache) -> Any:
    """The keep-mask (B, Hq, Lq, Lk) a forward used, as a dask array, or None without dropout."""
    import dask.array as da
    from dask.base import tokenize

    c = cache
    full = tuple(c.q.shape[:3]) + (c.k.shape[2],)
    if c.keep is not None:
        return da.broadcast_to(c.keep, full)
    if c.dropout_key is None:
        return None
    plan = c.plan
    name = "npattn-keep-" + tokenize(c.dropout_key, c.dropout_p, plan)
    hq = tuple(plan.G * n for n in plan.h)
    sb, sh, si, sj = plan.starts("b"), [0, *np.cumsum(hq).tolist()], plan.starts("i"), plan.starts("j")
    graph = {(name, b, h, i, j): (_keep_chunk, c.dropout_key, c.dropout_p, sb[b], sh[h], si[i], sj[j],
                                  (plan.b[b], hq[h], plan.i[i], plan.j[j]))
             for b, h, i, j in np.ndindex(len(plan.b), len(hq), len(plan.i), len(plan.j))}
    return _array(graph, name, [], (plan.b, hq, plan.i, plan.j), np.dtype(np.bool_))


# ------------------------------------------------------------------ backward


def sdpa_backward(dout: Any, cache: ChunkedSDPACache, *, dlse: Any = None) -> SDPAGrads:
    """Gradients ``SDPAGrads(dq, dk, dv, dmask, None)`` of ``sdpa_forward`` as dask arrays,
    pair by pair; ``dlse`` [B, Hq, Lq] is an upstream gradient of ``cache.lse``."""
    # [B, Hq, Lq, Dv] -> [B, Hq, Lq, Dh], [B, Hkv, Lk, Dh], [B, Hkv, Lk, Dv], mask shape
    from dask.base import tokenize

    c = cache
    V.check_grad("dout", dout, shape=tuple(c.out.shape), dtype=c.in_dtype, xp=namespace(c.q),
                 device=device_of(c.q), of="the forward's out")
    plan = c.plan
    work = c.q.dtype
    dout = dout.astype(work).rechunk(c.out.chunks)  # [B, Hq, Lq, Dv]
    if dlse is not None:
        dlse = dlse.astype(work).reshape(tuple(c.m.shape)).rechunk(c.m.chunks)  # [B, Hq, Lq, 1]
    token = tokenize(dout, c.out, c.q, c.k, c.v, c.mask, c.keep, c.dropout_key, dlse)
    part = "npattn-pair-backward-" + token
    names = {x: f"npattn-{x}-" + token for x in ("dq", "dk", "dv", "dmask")}
    graph: dict = {}
    to_dq: dict = {}
    to_dkv: dict = {}
    to_dmask: dict = {}
    for b, h, i, j in _pairs(plan, c.is_causal):
        qk, kk, vk, mk, kp = _inputs(c, b, h, i, j)
        mask_chunk = None
        if c.mask_shape is not None:
            mask_chunk = tuple(c.mask.chunks[a][mk[1 + a]] for a in range(4))
        row = ((dout.name, b, h, i, 0), (c.out.name, b, h, i, 0), (c.m.name, b, h, i, 0),
               (c.l.name, b, h, i, 0), None if dlse is None else (dlse.name, b, h, i, 0))
        graph[(part, b, h, i, j)] = (
            functools.partial(_pair_backward, _pair_of(c, b, h, i, j), mask_shape=mask_chunk),
            qk, kk, vk, mk, kp, *row)
        to_dq.setdefault((b, h, i), []).append((part, b, h, i, j))
        to_dkv.setdefault((b, h, j), []).append((part, b, h, i, j))
        if mask_chunk is not None:
            to_dmask.setdefault(mk[1:], []).append((part, b, h, i, j))
    Dh, Dv = c.q.shape[3], c.v.shape[3]
    hq = tuple(plan.G * n for n in plan.h)
    for b in range(len(plan.b)):
        for h in range(len(plan.h)):
            for i in range(len(plan.i)):
                graph[(names["dq"], b, h, i, 0)] = (_sum, to_dq.get((b, h, i), []), 0,
                                                    (plan.b[b], hq[h], plan.i[i], Dh), work)
            for j in range(len(plan.j)):
                kv = to_dkv.get((b, h, j), [])
                graph[(names["dk"], b, h, j, 0)] = (_sum, kv, 1, (plan.b[b], plan.h[h], plan.j[j], Dh), work)
                graph[(names["dv"], b, h, j, 0)] = (_sum, kv, 2, (plan.b[b], plan.h[h], plan.j[j], Dv), work)
    deps = [dout, c.out, c.m, c.l, c.q, c.k, c.v, c.mask, c.keep, dlse]
    dq = _array(graph, names["dq"], deps, (plan.b, hq, plan.i, (Dh,)), work)
    dk = _array(graph, names["dk"], deps, (plan.b, plan.h, plan.j, (Dh,)), work)
    dv = _array(graph, names["dv"], deps, (plan.b, plan.h, plan.j, (Dv,)), work)
    dmask = None
    if c.mask_shape is not None:
        mchunks = c.mask.chunks
        for idx in np.ndindex(*c.mask.numblocks):
            shape = tuple(mchunks[a][idx[a]] for a in range(4))
            graph[(names["dmask"],) + idx] = (_sum, to_dmask.get(idx, []), 3, shape, work)
        dmask = _array(graph, names["dmask"], deps, mchunks, work).reshape(c.mask_shape)
    grads = [dq, dk, dv, dmask]
    if c.in_dtype != work:
        grads = [None if g is None else g.astype(c.in_dtype) for g in grads]
    return SDPAGrads(grads[0], grads[1], grads[2], grads[3], None)
