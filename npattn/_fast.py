"""Fast dense scaled dot-product attention for NumPy: the same math, tiled.

``npattn.functional.sdpa_forward`` / ``sdpa_backward`` are the readable
reference. For NumPy arrays they hand the work to this module through one
hook (``_fast.applies`` at the top of ``functional.sdpa_forward``; the backward
follows its cache type); every other backend, and NumPy with the
fast path switched off (``fast_path(False)`` or ``NPATTN_FAST=0``), runs the
reference. Both give the same numbers up to rounding; ``tests/test_fast.py``
checks that in float64.

What is different from the reference, and why it is faster:

* **Tiles.** The work is split into independent tiles of one batch entry, a
  group of heads and a block of query rows, sized so that one tile of scores
  (about ``TILE_ELEMS`` entries) stays in cache while the softmax passes
  over it. Tiles of different (batch, head group) run on a small thread pool
  (NumPy releases the GIL in ufuncs and BLAS) when one head's score matrix
  has at least ``POOL_MIN_SCORES`` entries, else in order; BLAS is held to one
  thread while the pool runs, so pool and BLAS threads do not oversubscribe
  the cores.
* **Row sums by BLAS.** The softmax denominator is ``e @ ones``, a
  matrix-vector product, instead of ``sum(e, axis=-1)`` (4-5x faster on rows
  of 128 entries, which NumPy reduces one short row at a time).
* **In place.** The scores are computed straight into the probability array
  that the cache keeps (``matmul(..., out=)``) and every softmax step updates
  it in place: no temporaries of shape (B, H, Lq, Lk).
* **Scale folded into q.** ``s = (q * scale) @ k^T``: one pass over (Lq, Dh)
  instead of one over (Lq, Lk).
* **dv in one GEMM.** Without dropout and causal mask, ``dv = p^T dout`` is one
  GEMM over all query rows of a tile (inner size Lq) instead of a sum of
  per-block GEMMs of inner size r.
* **Causal blocks skipped.** A block of query rows ``i0:i1`` only meets keys
  ``0:i1``; the blocks above the diagonal are never computed.
* **Lean cache.** Only the probabilities (before dropout), the keep-mask and
  a copy of the output are kept. The dropped probabilities are recomputed in
  the backward, tile by tile, and the softmax backward uses
  ``rowsum(dp * p) = rowsum(dout * out)`` (true with or without dropout,
  since ``out = a @ v``), a pass over (Lq, Dh) instead of (Lq, Lk).
* **No head copies.** Outputs and gradients are written in the merged
  (B, L, H, Dh) layout, so ``merge_heads`` is a reshape and not a copy;
  inputs are read through strided views that BLAS takes as they are.

Shape legend: B batch, H heads, Lq/Lk query/key lengths, Dh head width,
hg heads in a tile, r query rows in a block, c keys a block meets.
"""

from __future__ import annotations

import contextlib
import math
import os
import threading
from concurrent.futures import ThreadPoolExecutor, wait
from typing import Any, NamedTuple, Optional

import numpy as np

from .backend import blas_controller, keep_mask, limit_blas_threads, make_rng

__all__ = [
    "FastSDPACache",
    "applies",
    "fast_path",
    "pool_threads",
    "sdpa_forward",
    "sdpa_backward",
    "TILE_ELEMS",
    "POOL_MIN_SCORES",
]

#: Target number of score entries in one tile (float32: 1 MiB).
TILE_ELEMS = 1 << 18

#: The tile pool is used only when one head's score matrix has at least this
#: many entries (``Lq * Lk``); smaller problems run their tiles in order, with
#: BLAS at its default threads. Measured on a 2-core machine
#: (docs/performance.md): at 32x128x256x8 the pool made the step 13 % slower
#: (63 against 55.5 ms), at 8x512x768x12 it was within noise or slower, at
#: 1x4096x512x8 it was 1.2x faster.
POOL_MIN_SCORES = 1 << 20

_enabled = os.environ.get("NPATTN_FAST", "1") != "0"


@contextlib.contextmanager
def fast_path(enabled: bool = True):
    """Context manager: switch the NumPy fast path on or off inside the block.

    ``with fast_path(False): ...`` runs the reference code of
    ``npattn.functional`` (and the blocked path of ``npattn.blocked`` in one
    piece, without the tile pool); the environment variable ``NPATTN_FAST=0``
    does the same for a whole process.
    """
    global _enabled
    old, _enabled = _enabled, bool(enabled)
    try:
        yield
    finally:
        _enabled = old


def applies(q, k, v, mask=None, dropout_mask=None) -> bool:
    """True when the fast path is on and takes these arguments.

    It takes NumPy arrays q, k, v of shape (B, H, L, Dh) with the same B and H
    (no broadcasting between them) and masks broadcastable to (B, H, Lq, Lk).
    """
    if not _enabled:
        return False
    arrays = (q, k, v, mask, dropout_mask)
    if not all(a is None or type(a) is np.ndarray for a in arrays):
        return False
    if not (q.ndim == k.ndim == v.ndim == 4 and q.shape[:2] == k.shape[:2] == v.shape[:2]):
        return False
    if k.shape[-2] != v.shape[-2] or not q.shape[-1] == k.shape[-1] == v.shape[-1] or k.shape[-2] == 0:
        return False
    full = q.shape[:3] + (k.shape[-2],)
    for m in (mask, dropout_mask):
        if m is not None:
            try:
                if np.broadcast_shapes(m.shape, full) != full:
                    return False
            except ValueError:
                return False
    return True


# ------------------------------------------------------------------ threads

_pool = None
_pool_lock = threading.Lock()


def pools(x) -> bool:
    """Whether the tile pool may run work on array ``x``: the fast path is on and ``x`` is NumPy's."""
    return _enabled and type(x) is np.ndarray


def pool_threads() -> int:
    """Threads of the tile pool: ``NPATTN_NUM_THREADS``, else the usable CPUs.

    Without ``threadpoolctl`` BLAS threads cannot be held to one inside the
    pool, so tiles then run one after another (1).
    """
    env = os.environ.get("NPATTN_NUM_THREADS")
    if env:
        return max(1, int(env))
    if blas_controller() is None:
        return 1
    try:
        n = len(os.sched_getaffinity(0))
    except AttributeError:
        n = os.cpu_count() or 1
    return max(1, min(n, 8))


def _run_tiles(fn, tasks, parallel=True):
    """``fn(*task)`` for every task: on the pool with BLAS at one thread, or in order.

    In order when ``parallel`` is false, the pool has one thread or there is
    one task. Each task must write only its own output slices, so the result
    does not depend on the order the tasks run in.
    """
    global _pool
    n = pool_threads()
    if not parallel or n <= 1 or len(tasks) <= 1:
        for t in tasks:
            fn(*t)
        return
    with _pool_lock:
        if _pool is None or _pool._max_workers != n:
            _pool = ThreadPoolExecutor(max_workers=n, thread_name_prefix="npattn")
        pool = _pool
    with limit_blas_threads(1):
        futures = [pool.submit(fn, *t) for t in tasks]
        wait(futures)  # all of them, even when one fails, before BLAS threads come back
    for f in futures:
        f.result()  # raises a tile's exception


def _tiling(B, H, Lq, Lk, causal):
    """Tasks (b, h0, h1) and the query-block height r."""
    per_head = Lq * Lk
    hg = max(1, min(H, TILE_ELEMS // max(per_head, 1)))
    r = max(16, TILE_ELEMS // (hg * Lk))
    if causal:
        r = min(r, max(64, Lq // 8))  # finer blocks skip more of the upper triangle
    r = min(r, Lq)
    tasks = [(b, h0, min(h0 + hg, H)) for b in range(B) for h0 in range(0, H, hg)]
    return tasks, r


def _blocks(Lq, Lk, r, causal):
    """(i0, i1, c): query rows i0:i1 meet keys 0:c (c < Lk only when causal)."""
    for i0 in range(0, Lq, r):
        i1 = min(i0 + r, Lq)
        yield i0, i1, (min(i1, Lk) if causal else Lk)


def _merged(B, L, H, Dh, dtype):
    """A (B, L, H*Dh) array and its (B, H, L, Dh) head view (no copy between them)."""
    m = np.empty((B, L, H * Dh), dtype=dtype)
    return m, m.reshape(B, L, H, Dh).transpose(0, 2, 1, 3)


# ------------------------------------------------------------------ forward


class FastSDPACache(NamedTuple):
    q: Any  # [B, H, Lq, Dh]  compute dtype
    k: Any  # [B, H, Lk, Dh]
    v: Any  # [B, H, Lk, Dh]
    probs: Any  # [B, H, Lq, Lk] softmax output before dropout (the returned weights)
    out: Any  # [B, H, Lq, Dh] output in the compute dtype (a copy), for rowsum(dout * out)
    keep: Any  # bool keep-mask broadcastable to probs, or None
    drop_scale: float  # 1 / (1 - p)
    causal: bool
    scale: float
    mask_shape: Optional[tuple]  # shape of a floating mask, for dmask
    in_dtype: Any


def sdpa_forward(q, k, v, *, mask, is_causal, scale, dropout_p, dropout_mask, rng, in_dtype):
    """Tiled ``softmax(q k^T * scale + mask) v``, called by ``functional.sdpa_forward``.

    ``q, k, v`` come already in the compute dtype and ``scale`` resolved;
    ``in_dtype`` is the callers' dtype. The keep-mask is drawn exactly as
    ``functional.dropout_forward`` draws it. Returns ``(out, FastSDPACache)``.
    """
    work = q.dtype
    B, H, Lq, Dh = q.shape
    Lk = k.shape[-2]
    full = (B, H, Lq, Lk)
    keep = dropout_mask
    if keep is None and dropout_p != 0.0:  # the same draw as functional.dropout_forward
        keep = keep_mask(make_rng(rng), full, dropout_p, np)
    fmask = bmask = None
    mask_shape = None
    if mask is not None:
        if mask.dtype == np.bool_:
            bmask = np.broadcast_to(mask, full)
        else:
            mask_shape = tuple(mask.shape)
            fmask = np.broadcast_to(mask.astype(work, copy=False), full)
    keep_b = None if keep is None else np.broadcast_to(keep, full)
    drop_scale = 1.0 / (1.0 - dropout_p) if keep is not None else 1.0

    probs = (np.zeros if is_causal else np.empty)(full, dtype=work)  # [B, H, Lq, Lk]
    out_m, out = _merged(B, Lq, H, Dh, work)  # [B, Lq, D], [B, H, Lq, Dh] view
    kT = np.swapaxes(k, -1, -2)  # [B, H, Dh, Lk] view
    ones = np.ones((Lk, 1), dtype=work)  # [Lk, 1]: row sums as a matrix-vector product
    tasks, r = _tiling(B, H, Lq, Lk, is_causal)
    neg_inf = -math.inf

    def tile(b, h0, h1):
        qs = q[b, h0:h1] * scale  # [hg, Lq, Dh]
        for i0, i1, c in _blocks(Lq, Lk, r, is_causal):
            p = probs[b, h0:h1, i0:i1, :c]  # [hg, r, c] view, filled in place
            np.matmul(qs[:, i0:i1], kT[b, h0:h1, :, :c], out=p)  # 1. s = q k^T * scale
            if fmask is not None:  # 2. floating mask: s + mask
                np.add(p, fmask[b, h0:h1, i0:i1, :c], out=p)
            if bmask is not None:  # 2. boolean mask: where(mask, s, -inf)
                np.copyto(p, neg_inf, where=~bmask[b, h0:h1, i0:i1, :c])
            if is_causal and c - 1 > i0:  # 2. the block meets the diagonal
                i = np.arange(i0, i1)[:, None]
                np.copyto(p, neg_inf, where=np.arange(c)[None, :] > i)
            m = np.max(p, axis=-1, keepdims=True)  # 3.            [hg, r, 1]
            m[m == neg_inf] = 0.0  # fully masked row: no -inf - -inf
            np.subtract(p, m, out=p)
            np.exp(p, out=p)  # 4.
            s = np.matmul(p, ones[:c])  # 5. rowsum(e), by BLAS    [hg, r, 1]
            s[s == 0.0] = 1.0  # rows with nothing to attend stay 0
            np.multiply(p, np.reciprocal(s, out=s), out=p)  # one divide per row, not per entry
            a = p
            if keep_b is not None:  # 4. a = where(keep, p / (1 - p_drop), 0)
                a = np.multiply(p, keep_b[b, h0:h1, i0:i1, :c])
                a *= drop_scale
            np.matmul(a, v[b, h0:h1, :c], out=out[b, h0:h1, i0:i1])  # 5. out = a v

    _run_tiles(tile, tasks, parallel=Lq * Lk >= POOL_MIN_SCORES)

    result = out if work == in_dtype else out.astype(in_dtype)
    saved = out_m.copy().reshape(B, Lq, H, Dh).transpose(0, 2, 1, 3) if work == in_dtype else out
    cache = FastSDPACache(q, k, v, probs, saved, keep, drop_scale, is_causal, scale,
                          mask_shape, in_dtype)
    return result, cache


# ------------------------------------------------------------------ backward


def sdpa_backward(dout, cache: FastSDPACache):
    """Gradients ``(dq, dk, dv, dmask)`` of ``sdpa_forward``, tile by tile."""
    q, k, v, probs = cache.q, cache.k, cache.v, cache.probs
    work = q.dtype
    if dout.dtype != work:
        dout = dout.astype(work)
    B, H, Lq, Dh = q.shape
    Lk = k.shape[-2]
    full = (B, H, Lq, Lk)
    keep_b = None if cache.keep is None else np.broadcast_to(cache.keep, full)
    ds_full = None
    if cache.mask_shape is not None:  # dmask needs every ds; keep them
        ds_full = (np.zeros if cache.causal else np.empty)(full, dtype=work)
    _, dq = _merged(B, Lq, H, Dh, work)
    _, dk = _merged(B, Lk, H, Dh, work)
    _, dv = _merged(B, Lk, H, Dh, work)
    vT = np.swapaxes(v, -1, -2)  # [B, H, Dh, Lk] view
    tasks, r = _tiling(B, H, Lq, Lk, cache.causal)
    scale, drop_scale = cache.scale, cache.drop_scale

    def tile(b, h0, h1):
        do = dout[b, h0:h1]  # [hg, Lq, Dh]
        # 3. softmax backward: rowsum(dp * p) = rowsum(dout * out), as out = a v
        delta = np.sum(do * cache.out[b, h0:h1], axis=-1, keepdims=True)  # [hg, Lq, 1]
        dk_acc = np.zeros((h1 - h0, Lk, Dh), dtype=work)  # [hg, Lk, Dh]
        whole_dv = keep_b is None and not cache.causal
        if whole_dv:  # 5. dv = p^T dout in one GEMM over all query rows
            np.matmul(np.swapaxes(probs[b, h0:h1], -1, -2), do, out=dv[b, h0:h1])
        else:  # accumulated block by block below
            dv_acc = np.zeros((h1 - h0, Lk, Dh), dtype=work)
        for i0, i1, c in _blocks(Lq, Lk, r, cache.causal):
            p = probs[b, h0:h1, i0:i1, :c]  # [hg, r, c]
            do_blk = do[:, i0:i1]  # [hg, r, Dh]
            if ds_full is not None:
                da = ds_full[b, h0:h1, i0:i1, :c]
                np.matmul(do_blk, vT[b, h0:h1, :, :c], out=da)  # 5. da = dout v^T
            else:
                da = np.matmul(do_blk, vT[b, h0:h1, :, :c])  # [hg, r, c]
            if whole_dv:
                pass
            elif keep_b is None:
                dv_acc[:, :c] += np.matmul(np.swapaxes(p, -1, -2), do_blk)  # 5. dv = a^T dout
            else:
                kp = keep_b[b, h0:h1, i0:i1, :c]
                a = np.multiply(p, kp)  # recompute a = dropout(p)
                a *= drop_scale
                dv_acc[:, :c] += np.matmul(np.swapaxes(a, -1, -2), do_blk)
                np.multiply(da, kp, out=da)  # 4. dp = where(keep, da / (1 - p), 0)
                da *= drop_scale
            np.subtract(da, delta[:, i0:i1], out=da)  # 3. ds = p * (dp - rowsum(dp p))
            np.multiply(da, p, out=da)
            np.matmul(da, k[b, h0:h1, :c], out=dq[b, h0:h1, i0:i1])  # 1. dq = ds k * scale
            dq[b, h0:h1, i0:i1] *= scale
            dk_acc[:, :c] += np.matmul(np.swapaxes(da, -1, -2), q[b, h0:h1, i0:i1])
        dk_acc *= scale  # 1. dk = ds^T q * scale
        dk[b, h0:h1] = dk_acc
        if not whole_dv:
            dv[b, h0:h1] = dv_acc

    _run_tiles(tile, tasks, parallel=Lq * Lk >= POOL_MIN_SCORES)

    dmask = None
    if ds_full is not None:
        from .functional import sum_to_shape

        dmask = sum_to_shape(np, ds_full, cache.mask_shape)
    if cache.in_dtype != work:
        dq, dk, dv = (t.astype(cache.in_dtype) for t in (dq, dk, dv))
        if dmask is not None:
            dmask = dmask.astype(cache.in_dtype)
    return dq, dk, dv, dmask
