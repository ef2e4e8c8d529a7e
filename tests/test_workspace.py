"""Reused arrays (``npattn.attention.Workspace``): the same numbers as fresh ones, and never
an array that somebody can still read."""

import copy
import tracemalloc

import numpy as np
import pytest

from _attention_cases import make_inputs
from npattn import MultiHeadAttention
from npattn import attention as A
from npattn import numpy_kernel

CASES = {
    "plain": dict(),
    "causal": dict(causal=True),
    "bool mask, empty row, dropout": dict(mask_kind="bool", dropout="seed"),
    "causal, dropout": dict(causal=True, dropout="seed"),
}


def _forward_backward(q, k, v, dout, kw, **extra):
    out, cache = A.sdpa_forward(q, k, v, impl="numpy", **kw, **extra)
    grads = A.sdpa_backward(dout, cache)
    return out, cache, grads


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("window", [None, (3, 1)])
def test_a_reused_array_gives_the_numbers_of_a_fresh_one(case, window, monkeypatch):
    """The second forward writes into the first one's arrays (filled with NaN and True to
    show anything it leaves unwritten) and gives, bit for bit, the first forward's
    results on the same inputs: weights (zero where the window or causal mask leaves keys
    out), keep-mask, lse, output and gradients."""
    monkeypatch.setattr(numpy_kernel, "TILE_ELEMS", 64)  # several row blocks
    q, k, v, dout, kw = make_inputs(3, 2, 2, 1, 19, 23, 3, 4, **CASES[case])
    if window is not None:
        kw["window"] = window
    ref_out, ref_c, ref_g = _forward_backward(q, k, v, dout, kw)
    ws = A.Workspace()
    first_out, first_c, _ = _forward_backward(q, k, v, dout, kw, workspace=ws)
    exps, keep = first_c.exps, A.dropout_keep_mask(first_c)  # e: the weights before 1 / rowsum
    ws.give(first_c)
    assert len(ws.spares) == (2 if kw.get("rng") is not None else 1)
    exps[...] = np.nan  # what a reused array holds is stale
    if keep is not None and first_c.dropout_key is not None and not first_c.causal:
        keep[...] = True
    out, c, g = _forward_backward(q, k, v, dout, kw, workspace=ws)
    assert np.shares_memory(c.exps, exps) and not ws.spares
    np.testing.assert_array_equal(A.weights(c), A.weights(ref_c))
    np.testing.assert_array_equal(A.dropout_keep_mask(c), A.dropout_keep_mask(ref_c))
    np.testing.assert_array_equal(c.lse, ref_c.lse)
    np.testing.assert_array_equal(out, ref_out)
    for got, want in zip(g[:3], ref_g[:3]):
        np.testing.assert_array_equal(got, want)
    if kw.get("is_causal") or window is not None:  # keys left out have weight 0, not NaN
        assert np.any(A.weights(c) == 0.0) and not np.any(np.isnan(A.weights(c)))


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("window", [None, (3, 1)])
@pytest.mark.parametrize("change", ["factor 2", "factor 4", "tiles grown after the forward"])
def test_backward_blocks_unlike_the_forwards_read_only_what_it_wrote(case, window, change,
                                                                     monkeypatch):
    """The backward's own block size (``BACKWARD_TILE_FACTOR``, or ``TILE_ELEMS`` changed
    between the calls) on a forward that wrote into stale arrays (NaN, and True for a
    drawn keep-mask): where a window or causal mask cuts the blocks, columns the forward
    left unwritten are never read; the gradients are the reference's."""
    monkeypatch.setattr(numpy_kernel, "TILE_ELEMS", 16 * 23)  # blocks of 16 of the 40 rows
    q, k, v, dout, kw = make_inputs(5, 2, 2, 1, 40, 23, 3, 4, **CASES[case])
    if window is not None:
        kw["window"] = window
    _, ref_c = A.sdpa_forward(q, k, v, impl="reference", **kw)
    ref_g = A.sdpa_backward(dout, ref_c)
    ws = A.Workspace()
    _, stale = A.sdpa_forward(q, k, v, impl="numpy", **{**kw, "is_causal": False, "window": None})
    stale.exps[...] = np.nan
    if stale.keep is not None and stale.dropout_key is not None:
        stale.keep[...] = True
    ws.give(stale)
    _, c = A.sdpa_forward(q, k, v, impl="numpy", workspace=ws, **kw)
    assert np.shares_memory(c.exps, stale.exps)
    if change.startswith("factor"):
        monkeypatch.setattr(numpy_kernel, "BACKWARD_TILE_FACTOR", int(change.split()[1]))
    else:
        monkeypatch.setattr(numpy_kernel, "TILE_ELEMS", 64 * 23)
    g = A.sdpa_backward(dout, c)
    for name, got, want in zip(("dq", "dk", "dv"), g[:3], ref_g[:3]):
        assert not np.any(np.isnan(got)), name
        np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12, err_msg=name)


def test_give_keeps_only_the_kernels_own_arrays():
    """A caller's dropout mask is never handed out again; other implementations' caches are
    ignored; a different size or dtype allocates anew; at most ``SPARES`` are kept."""
    q, k, v, dout, kw = make_inputs(4, 1, 2, 1, 5, 6, 3, 3, dropout="mask")
    ws = A.Workspace()
    _, c = A.sdpa_forward(q, k, v, impl="numpy", workspace=ws, **kw)
    ws.give(c)
    assert len(ws.spares) == 1 and np.shares_memory(ws.spares[0], c.exps)
    assert not any(np.shares_memory(a, kw["dropout_mask"]) for a in ws.spares)
    _, c_ref = A.sdpa_forward(q, k, v, impl="reference", **kw)
    _, c_blk = A.sdpa_forward(q, k, v, impl="blocked", **kw)
    ws.give(c_ref)
    ws.give(c_blk)
    assert len(ws.spares) == 1
    assert ws.take((2, 5, 6), np.float32) is None and ws.take((2, 5, 7), np.float64) is None
    for _ in range(3):
        _, cc = A.sdpa_forward(q, k, v, impl="numpy", **kw)
        ws.give(cc)
    assert len(ws.spares) == A.Workspace.SPARES
    ws.clear()
    assert ws.spares == []
    refused = r"^workspace: expected an npattn\.attention\.Workspace or None, got list$"
    with pytest.raises(TypeError, match=refused):
        A.sdpa_forward(q, k, v, impl="numpy", workspace=[], **kw)


def test_a_cache_given_twice_is_kept_once():
    """Giving the same cache back twice keeps its array once: the two forwards that follow
    get arrays of their own, and each keeps the numbers of a fresh forward."""
    q, k, v, _, kw = make_inputs(5, 2, 2, 1, 7, 9, 3, 3)
    q2 = q[::-1].copy()  # other inputs, other probabilities
    ws = A.Workspace()
    _, c = A.sdpa_forward(q, k, v, impl="numpy", workspace=ws, **kw)
    ws.give(c)
    ws.give(c)
    assert len(ws.spares) == 1
    _, c1 = A.sdpa_forward(q, k, v, impl="numpy", workspace=ws, **kw)
    _, c2 = A.sdpa_forward(q2, k, v, impl="numpy", workspace=ws, **kw)
    assert not np.shares_memory(c1.exps, c2.exps)
    _, fresh1 = A.sdpa_forward(q, k, v, impl="numpy", **kw)
    np.testing.assert_array_equal(c1.exps, fresh1.exps)


def test_the_arrays_given_last_are_kept_first():
    """Past ``SPARES`` arrays the newest given back are kept: after the caches of a forward of
    one size and then of another (each with a drawn keep-mask, two arrays), a forward of the
    second size takes the second cache's arrays instead of allocating."""
    q1, k1, v1, _, kw1 = make_inputs(6, 2, 2, 1, 5, 6, 3, 3, dropout="seed")
    q2, k2, v2, _, kw2 = make_inputs(7, 2, 2, 1, 7, 9, 3, 3, dropout="seed")
    _, c1 = A.sdpa_forward(q1, k1, v1, impl="numpy", **kw1)
    _, c2 = A.sdpa_forward(q2, k2, v2, impl="numpy", **kw2)
    ws = A.Workspace()
    ws.give(c1)
    ws.give(c2)
    assert len(ws.spares) == 2
    _, c = A.sdpa_forward(q2, k2, v2, impl="numpy", workspace=ws, **kw2)
    assert np.shares_memory(c.exps, c2.exps) and np.shares_memory(c.keep, c2.keep)
    assert not ws.spares


@pytest.mark.parametrize("causal", [False, True], ids=["plain", "causal"])
def test_a_drawn_keep_mask_outlives_its_cache_given_back(causal):
    """``dropout_keep_mask`` of a cache stays the mask that forward used after the cache goes
    back to a workspace and a later forward draws another mask into its arrays."""
    q, k, v, _, kw = make_inputs(4, 2, 2, 2, 64, 64, 8, 8, dropout="seed", causal=causal)
    ws = A.Workspace()
    _, c1 = A.sdpa_forward(q, k, v, impl="numpy", workspace=ws, **kw)
    mask1 = A.dropout_keep_mask(c1)
    saved = mask1.copy()
    ws.give(c1)
    kw2 = dict(kw, rng=np.random.default_rng(12345))
    _, c2 = A.sdpa_forward(q, k, v, impl="numpy", workspace=ws, **kw2)
    assert np.shares_memory(c2.keep, c1.keep)  # the arrays were reused ...
    assert not np.array_equal(A.dropout_keep_mask(c2), saved)  # ... for another mask
    np.testing.assert_array_equal(mask1, saved)


def _step(m, x, dout, **kw):
    out, w = m(x, x, x, need_weights=True, average_attn_weights=False, **kw)
    return out, w, m.backward(dout)[0], dict(m.grads)


@pytest.mark.parametrize("kw", [dict(), dict(is_causal=True)], ids=["plain", "causal"])
def test_module_steps_reuse_arrays_and_match_a_fresh_module(kw):
    """Steps of one module (which lends each finished forward's arrays to the next) equal,
    bit for bit, the same steps on a fresh copy (which allocates everything), dropout
    included; the weights a step returned are not overwritten by later steps."""
    m = MultiHeadAttention(8, 2, dropout=0.3, dtype="float64", seed=1)
    rng = np.random.default_rng(2)
    xs = [rng.standard_normal((2, 37, 8)) for _ in range(3)]
    dout = rng.standard_normal((2, 37, 8))
    returned = []
    for x in xs + xs[:1]:
        twin = copy.deepcopy(m)  # a copy has an empty workspace
        got, want = _step(m, x, dout, **kw), _step(twin, x, dout, **kw)
        for a, b in zip(got[:3], want[:3]):
            np.testing.assert_array_equal(a, b)
        for name in want[3]:
            np.testing.assert_array_equal(got[3][name], want[3][name])
        returned.append((got[1], got[1].copy()))
    for w, saved in returned:
        np.testing.assert_array_equal(w, saved)


def module_and_peak(monkeypatch):
    """A float64 module on the NumPy kernel (tiles of 2**14 scores), its input x (1, 256, 16),
    the bytes of one (B, H, Lq, Lk) array, and a function giving the peak of the memory that
    tracemalloc sees allocated during one ``m(x, x, x)``."""
    monkeypatch.setattr(numpy_kernel, "TILE_ELEMS", 1 << 14)
    B, H, L, D = 1, 2, 256, 16
    m = MultiHeadAttention(D, H, dtype="float64", impl="numpy")
    x = np.random.default_rng(3).standard_normal((B, L, D))

    def peak_of_forward():
        tracemalloc.start()
        try:
            tracemalloc.reset_peak()
            m(x, x, x)
            return tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()

    return m, x, B * H * L * L * 8, peak_of_forward


def test_module_second_forward_allocates_no_new_probabilities(monkeypatch):
    """The reuse is real: the previous cache is lent once a new forward has succeeded, so
    from the third forward on each one allocates less than one (B, H, Lq, Lk) array
    (it writes into the forward before last's); after ``clear_cache`` it allocates again.
    (Tiles of 2**14 scores: each tile's scratch array is small next to the weights.)"""
    m, x, probs_bytes, peak_of_forward = module_and_peak(monkeypatch)

    assert peak_of_forward() >= probs_bytes
    assert peak_of_forward() >= probs_bytes  # the first forward's cache is still the cache
    assert peak_of_forward() < probs_bytes / 2
    assert peak_of_forward() < probs_bytes / 2
    m.clear_cache()
    assert peak_of_forward() >= probs_bytes


def test_training_steps_reuse_arrays_too(monkeypatch):
    """A backward between the forwards (a training step) reads the module's cache without
    keeping it from being lent: from the third step on each forward allocates less than one
    (B, H, Lq, Lk) array, as without the backwards."""
    m, x, probs_bytes, peak_of_forward = module_and_peak(monkeypatch)
    dout = np.random.default_rng(4).standard_normal(x.shape)
    peaks = []
    for _ in range(4):
        peaks.append(peak_of_forward())
        m.backward(dout)
    assert min(peaks[:2]) >= probs_bytes
    assert max(peaks[2:]) < probs_bytes / 2


def test_reading_the_cache_keeps_only_that_cache_from_the_workspace(monkeypatch):
    """The cache read through ``module.cache`` is never lent, but the forwards after it are
    lent again: from the fourth forward on (the third's cache lends the second's arrays)
    each allocates less than one (B, H, Lq, Lk) array, as without the read."""
    m, x, probs_bytes, peak_of_forward = module_and_peak(monkeypatch)

    m(x, x, x)
    held = m.cache  # read, and held to the end
    assert peak_of_forward() >= probs_bytes  # the held cache is not lent
    assert peak_of_forward() >= probs_bytes  # the second's is still the cache
    assert peak_of_forward() < probs_bytes / 2
    assert peak_of_forward() < probs_bytes / 2
    del held


def _a_held_step(seed):
    """A module after one forward and backward on x1, its cache read through ``module.cache``:
    the module, x1, x2, dout, dquery of that step, the held cache and a copy of its weights."""
    m = MultiHeadAttention(8, 2, dtype="float64", seed=4)
    rng = np.random.default_rng(seed)
    x1, x2, dout = (rng.standard_normal((2, 9, 8)) for _ in range(3))
    m(x1, x1, x1)
    want = m.backward(dout)[0]
    held = m.cache
    return m, x1, x2, dout, want, held, A.weights(held.sdpa).copy()


def test_a_cache_read_through_the_module_is_never_reused():
    """``module.cache`` hands out the cache: its arrays stay its own after later forwards, and
    assigning it back makes backward differentiate that forward (the gradient checker's use)."""
    m, x1, x2, dout, want, held, probs = _a_held_step(5)
    for x in (x2, x2, x1 + 1.0):
        m(x, x, x)
    np.testing.assert_array_equal(A.weights(held.sdpa), probs)
    m.cache = held
    np.testing.assert_array_equal(m.backward(dout)[0], want)


def test_a_cache_read_through_forward_state_is_never_reused():
    """``forward_state`` hands out the cache as ``cache`` does, and ``restore_forward_state``
    puts it back still handed out: the forwards after either never lend its arrays to the
    workspace, so its weights and its backward stay those of its own forward."""
    m = MultiHeadAttention(8, 2, dtype="float64", seed=4)
    rng = np.random.default_rng(9)
    x1, x2, dout = (rng.standard_normal((2, 9, 8)) for _ in range(3))
    m(x1, x1, x1)
    want = m.backward(dout)[0]
    state = m.forward_state()
    probs = A.weights(state.cache.sdpa).copy()
    for put_back in (False, True):
        if put_back:
            m.restore_forward_state(state)
        for x in (x2, x2 + 1.0, x2 - 1.0):  # the first would lend its arrays, the next reuse them
            m(x, x, x)
        np.testing.assert_array_equal(A.weights(state.cache.sdpa), probs)
    m.restore_forward_state(state)
    np.testing.assert_array_equal(m.backward(dout)[0], want)


def test_a_cache_read_after_forwards_that_lent_arrays_is_never_reused():
    """The same after several forwards, when the workspace already holds arrays: each forward
    lends the previous cache's arrays, never its own, so the cache read after the third
    stays that forward's through the forwards after it (which take the second's)."""
    m = MultiHeadAttention(8, 2, dtype="float64", seed=4, impl="numpy")
    rng = np.random.default_rng(7)
    x1, x2, dout = (rng.standard_normal((2, 9, 8)) for _ in range(3))
    for x in (x2, x2 + 1.0, x1):  # the second lends the first's arrays, the third the second's
        m(x, x, x)
    want = m.backward(dout)[0]
    held = m.cache
    probs = A.weights(held.sdpa).copy()
    for x in (x2, x2 - 1.0, x2 + 2.0):
        m(x, x, x)
    np.testing.assert_array_equal(A.weights(held.sdpa), probs)
    m.cache = held
    np.testing.assert_array_equal(m.backward(dout)[0], want)


@pytest.mark.parametrize("how", ["assigned back", "preserve_state"])
def test_a_held_cache_stays_its_own_after_it_is_the_module_s_again(how):
    """A cache read through ``module.cache`` stays held when it becomes the module's cache
    again (assigned back, or put back on leaving ``preserve_state``): the forwards after it
    do not lend its arrays to the workspace, so its weights and backward stay those of
    its own forward."""
    m, x1, x2, dout, want, held, probs = _a_held_step(6)
    if how == "assigned back":
        m(x2, x2, x2)
        m.cache = held
    else:
        with m.preserve_state():
            m(x2, x2, x2)
    for x in (x2, x2 + 1.0, x2 - 1.0):  # the first would lend held's arrays, the next reuse them
        m(x, x, x)
    np.testing.assert_array_equal(A.weights(held.sdpa), probs)
    m.cache = held
    np.testing.assert_array_equal(m.backward(dout)[0], want)


#: The refusal of a cache that another module's forward made: what is expected, and what was given.
ANOTHER_MODULES_CACHE = (r"^cache: expected a cache of this module's own forwards \(or None\), got one "
                         r"another module made \(its backward would differentiate that module's forward "
                         r"with this module's parameters\)$")


def test_a_cache_of_another_module_is_refused():
    """``cache =`` takes this module's caches only, as its docstring says: another module's
    (even one of the same shapes, or this module's copy) would have its backward differentiate
    that forward with this module's parameters, or fail deep inside."""
    import copy

    a = MultiHeadAttention(8, 2, dtype="float64", seed=0)
    twin = MultiHeadAttention(8, 2, dtype="float64", seed=1)
    other = MultiHeadAttention(4, 1, dtype="float64", seed=1)
    x = np.random.default_rng(0).standard_normal((2, 3, 8))
    a(x, x, x)
    held = a.cache
    for m in (twin, other, copy.deepcopy(a)):
        with pytest.raises(TypeError, match=ANOTHER_MODULES_CACHE):
            m.cache = held
        assert m.cache is None
    a.cache = held  # its own: taken
    assert a.backward(np.ones((2, 3, 8)))[0].shape == (2, 3, 8)


@pytest.mark.parametrize("how", ["deepcopy", "pickle"])
def test_copies_refuse_each_other_s_caches(how):
    """Each copy is a module of its own: a cache one copy's forward made is refused by the
    other copy of the same module, as by the original."""
    import pickle

    a = MultiHeadAttention(8, 2, dtype="float64", seed=0)
    x = np.random.default_rng(0).standard_normal((2, 3, 8))
    c1, c2 = (copy.deepcopy(a) if how == "deepcopy" else pickle.loads(pickle.dumps(a))
              for _ in range(2))
    c1(x, x, x)
    held = c1.cache
    for m in (c2, a):
        with pytest.raises(TypeError, match=ANOTHER_MODULES_CACHE):
            m.cache = held
    c1.cache = held  # its own: taken


def test_only_a_cache_or_none_is_taken():
    """``cache =`` with anything but an ``MHACache`` or None is a TypeError naming ``cache``
    and what it got, and the module keeps its cache."""
    m = MultiHeadAttention(8, 2, dtype="float64", seed=0)
    x = np.random.default_rng(0).standard_normal((2, 3, 8))
    m(x, x, x)
    held = m.cache
    for bad, got in ((tuple(held), "tuple"), ("cache", "str"), (0, "int")):
        with pytest.raises(TypeError, match=f"^cache: expected an MHACache or None, got {got}$"):
            m.cache = bad
        assert m.cache is held


def test_clear_cache_drops_the_cache():
    """After ``clear_cache`` there is no cache and ``backward`` needs a new forward, as after
    no forward at all."""
    m = MultiHeadAttention(8, 2, dtype="float64", seed=0)
    x = np.random.default_rng(0).standard_normal((2, 3, 8))
    m(x, x, x)
    m.clear_cache()
    assert m.cache is None
    with pytest.raises(RuntimeError, match="^backward: expected a forward call first"):
        m.backward(np.ones((2, 3, 8)))
    m(x, x, x)
    assert m.backward(np.ones((2, 3, 8)))[0].shape == (2, 3, 8)
