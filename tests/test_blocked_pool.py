"""The blocked path on the tile pool (NumPy): the same numbers as in one piece.

``npattn.blocked`` runs independent slices of the leading (batch, head) axes
on ``npattn._fast``'s tile pool for NumPy arrays. Each slice is computed by
the same loops as the whole array, so the results must be *equal* (not just
close) to the sequential run, for any number of threads, and close to the
dense path.
"""

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from npattn import _fast
from npattn import blocked as Bk
from npattn import functional as F


def _inputs(seed, B, H, Lq, Lk, Dh, mask_kind, p):
    r = np.random.default_rng(seed)
    q, k, v = (r.standard_normal((B, H, L, Dh)) for L in (Lq, Lk, Lk))
    mask = None
    if mask_kind == "bool":
        mask = r.random((B, 1, Lq, Lk)) > 0.3  # [B, 1, Lq, Lk]: broadcast over heads
        mask[0, 0, 1] = False  # a fully masked row
    keep = r.random((B, H, Lq, Lk)) >= p if p > 0 else None
    dout = r.standard_normal((B, H, Lq, Dh))
    return q, k, v, mask, keep, dout


def _blocked(threads, q, k, v, mask, keep, dout, causal, p, monkeypatch):
    monkeypatch.setenv("NPATTN_NUM_THREADS", str(threads))
    out, cache = Bk.sdpa_blocked_forward(q, k, v, mask=mask, is_causal=causal, dropout_p=p,
                                         dropout_mask=keep, block_q=3, block_k=4)
    return (out, cache.lse) + tuple(Bk.sdpa_blocked_backward(dout, cache)[:3])


@given(
    seed=st.integers(0, 2**16),
    B=st.integers(1, 3),
    H=st.integers(1, 4),
    Lq=st.integers(2, 11),
    Lk=st.integers(2, 11),
    mask_kind=st.sampled_from([None, "bool"]),
    causal=st.booleans(),
    p=st.sampled_from([0.0, 0.4]),
)
def test_blocked_pool_equals_sequential_and_dense(seed, B, H, Lq, Lk, mask_kind, causal, p):
    args = _inputs(seed, B, H, Lq, Lk, 3, mask_kind, p)
    calls = []
    with pytest.MonkeyPatch.context() as mp:
        run_tiles = _fast._run_tiles
        mp.setattr(_fast, "_run_tiles", lambda fn, tasks, **kw: (calls.append(len(tasks)),
                                                               run_tiles(fn, tasks, **kw)))
        results = {n: _blocked(n, *args, causal, p, mp) for n in (1, 2, 3)}
        with _fast.fast_path(False):  # no pool: the loops run once over all slices
            seq = _blocked(2, *args, causal, p, mp)
    if max(B, H) >= 2:
        assert max(calls) >= 2  # the pool really split the work
    for n, res in results.items():
        for name, a, b in zip(("out", "lse", "dq", "dk", "dv"), res, seq):
            np.testing.assert_array_equal(a, b, err_msg=f"{name}, {n} threads")
    q, k, v, mask, keep, dout = args
    ref_out, ref_c = F.sdpa_forward(q, k, v, mask=mask, is_causal=causal, dropout_p=p,
                                    dropout_mask=keep)
    ref = (ref_out,) + tuple(F.sdpa_backward(dout, ref_c)[:3])
    for name, a, b in zip(("out", "dq", "dk", "dv"), (seq[0],) + seq[2:], ref):
        np.testing.assert_allclose(a, b, rtol=1e-10, atol=1e-12, err_msg=name)


def test_blocked_pool_not_used_for_generator_dropout_or_floating_mask(monkeypatch):
    """Those two run in one piece: the block keep-mask and dmask span every slice."""
    q, k, v, _, _, dout = _inputs(1, 2, 3, 7, 6, 3, None, 0.0)
    monkeypatch.setenv("NPATTN_NUM_THREADS", "2")
    fmask = np.random.default_rng(2).standard_normal((7, 6))
    _, c = Bk.sdpa_blocked_forward(q, k, v, mask=fmask, block_q=3, block_k=4)
    assert Bk._pool_split(np, c) is None
    _, c = Bk.sdpa_blocked_forward(q, k, v, dropout_p=0.3, rng=5, block_q=3, block_k=4)
    assert Bk._pool_split(np, c) is None
    _, c = Bk.sdpa_blocked_forward(q, k, v, block_q=3, block_k=4)
    assert len(Bk._pool_split(np, c)) == 2  # split along the 3 heads into 2 tasks
