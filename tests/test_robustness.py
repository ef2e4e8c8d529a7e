"""Nothing the caller passes in is written to; results repeat bit for bit;
repeated steps do not grow memory."""

import gc
import tracemalloc

import numpy as np
import pytest

from npattn import functional as F
from npattn.backend import from_numpy, to_numpy

from reliability_helpers import (
    assert_unchanged,
    cache_arrays,
    host_inputs,
    inputs,
    make_mha,
    snapshot,
)


def _readonly(a):
    a = np.array(a, copy=True)
    a.setflags(write=False)
    return a


def _all_masks(rng):
    add = rng.standard_normal((2, 1, 3, 5))
    add[0, 0, 1, :] = -np.inf
    return {
        "bool": rng.random((3, 5)) > 0.3,
        "additive": add,
        "none": None,
    }


# --------------------------------------------------------------------------
# read-only NumPy arrays


@pytest.mark.parametrize("mask_kind", ["bool", "additive", "none"])
@pytest.mark.parametrize("dropout", [0.0, 0.4])
def test_readonly_numpy_arrays(mask_kind, dropout):
    """Inputs, masks, dout and parameters may all be read-only; nothing is written."""
    rng = np.random.default_rng(0)
    m = make_mha("numpy", dropout=dropout, kdim=6, vdim=4)
    for name in list(m.params):
        m.params[name] = _readonly(m.params[name])  # read-only parameters are accepted
    query, key, value = (_readonly(a) for a in host_inputs(2, 3, 5, 8, 6, 4))
    mask = _all_masks(rng)[mask_kind]
    mask = None if mask is None else _readonly(mask)
    keep = _readonly(rng.random((2, 2, 3, 5)) > 0.4)
    dout = _readonly(rng.standard_normal((2, 3, 8)))
    given = {"query": query, "key": key, "value": value, "mask": mask, "dropout_mask": keep,
             "dout": dout, **{f"params[{n}]": p for n, p in m.params.items()}}
    before = snapshot(given)

    for dropout_mask in (None, keep):
        out, w = m(query, key, value, mask=mask, dropout_mask=dropout_mask, need_weights=True)
        cached = cache_arrays(m._cache)
        cache_before = snapshot(cached)
        grads = m.backward(dout)
        assert_unchanged(cache_before, cached)  # backward does not write into the cache
        assert all(np.all(np.isfinite(g)) for g in (*grads, *m.grads.values()))
    assert_unchanged(before, given)
    for a in given.values():
        if a is not None:
            assert not a.flags.writeable


def test_readonly_functional_pairs():
    """Every functional pair accepts read-only arrays, and its backward leaves dout and cache alone."""
    rng = np.random.default_rng(1)
    x = _readonly(rng.standard_normal((2, 2, 3, 4)))
    k = _readonly(rng.standard_normal((2, 2, 5, 4)))
    v = _readonly(rng.standard_normal((2, 2, 5, 4)))
    add = _readonly(np.where(rng.random((3, 5)) > 0.3, rng.standard_normal((3, 5)), -np.inf))
    keep = _readonly(rng.random((2, 2, 3, 5)) > 0.5)
    w = _readonly(rng.standard_normal((6, 4)))
    b = _readonly(rng.standard_normal(6))
    cases = [
        (F.linear_forward, (x, w, b), {}),
        (F.masked_softmax_forward, (_readonly(rng.standard_normal((2, 3, 5))), add), {}),
        (F.dropout_forward, (x, 0.3), dict(mask=keep[..., :4])),
        (F.sdpa_forward, (x, k, v), dict(mask=add, dropout_p=0.3, dropout_mask=keep, is_causal=True)),
        (F.sdpa_forward, (x, k, v), dict(mask=add > 0, dropout_p=0.3, rng=3)),
    ]
    backward = {F.linear_forward: F.linear_backward, F.masked_softmax_forward: F.masked_softmax_backward,
                F.dropout_forward: F.dropout_backward, F.sdpa_forward: F.sdpa_backward}
    for fwd, args, kwargs in cases:
        given = [(f"arg{i}", a) for i, a in enumerate(args) if isinstance(a, np.ndarray)]
        given += [(n, a) for n, a in kwargs.items() if isinstance(a, np.ndarray)]
        before = snapshot(given)
        out, cache = fwd(*args, **kwargs)
        dout = _readonly(rng.standard_normal(out.shape))
        cached = cache_arrays(cache)
        cache_before = snapshot(cached + [("dout", dout)])
        backward[fwd](dout, cache)
        assert_unchanged(cache_before, cached + [("dout", dout)])
        assert_unchanged(before, given)


def test_nothing_passed_in_is_written(backend, xp):
    """On every backend: inputs, masks, dout and parameters have the same values
    after forward and backward, and writing into the returned arrays does not
    change a later backward."""
    rng = np.random.default_rng(2)
    m = make_mha(backend, dropout=0.3)
    query, key, value = inputs(xp, 2, 3, 5, 8)
    mask = from_numpy(_all_masks(rng)["additive"], xp)
    dout = from_numpy(rng.standard_normal((2, 3, 8)), xp)
    given = {"query": query, "key": key, "value": value, "mask": mask, "dout": dout,
             **{f"params[{n}]": p for n, p in m.params.items()}}
    before = snapshot(given)
    out, w = m(query, key, value, mask=mask, need_weights=True)
    cached = cache_arrays(m._cache)
    cache_before = snapshot(cached)
    first = snapshot(zip(("dq", "dk", "dv"), m.backward(dout)))
    first_params = snapshot(m.grads)
    # the caller owns what comes back: scribbling on it must not reach the cache
    if backend == "numpy" or backend == "torch":
        for a in (out, w, *[g for g in m.grads.values()]):
            a[...] = 123.0
    again = snapshot(zip(("dq", "dk", "dv"), m.backward(dout)))
    assert_unchanged(cache_before, cached)
    assert_unchanged(before, given)
    for name in first:
        np.testing.assert_array_equal(again[name], first[name])
    for name, g in snapshot(m.grads).items():
        np.testing.assert_array_equal(g, first_params[name])


@pytest.mark.parametrize("impl", ["reference", "numpy"])
def test_weights_per_head_are_the_callers_own(impl):
    """The weights returned per head (``average_attn_weights=False``), as the averaged ones,
    are an array of the caller's: writing into them changes neither the weights a second
    forward returns nor the gradients of a later backward (the reference keeps the weights
    themselves in its cache)."""
    rng = np.random.default_rng(3)
    m = make_mha("numpy", dropout=0.3)
    query, key, value = host_inputs(2, 3, 5, 8)
    keep = rng.random((2, 2, 3, 5)) > 0.3
    dout = rng.standard_normal((2, 3, 8))
    _, w = m(query, key, value, dropout_mask=keep, need_weights=True, average_attn_weights=False, impl=impl)
    want_w = w.copy()
    want = [g.copy() for g in m.backward(dout)]
    w[...] = 123.0
    for got, ref in zip(m.backward(dout), want):
        np.testing.assert_array_equal(got, ref)
    _, again = m(query, key, value, dropout_mask=keep, need_weights=True, average_attn_weights=False,
                 impl=impl)
    np.testing.assert_array_equal(again, want_w)


# --------------------------------------------------------------------------
# determinism


def _run(backend, xp, seed, steps=2, dropout_mask=None):
    m = make_mha(backend, dropout=0.4, seed=seed, kdim=6)
    rng = np.random.default_rng(99)
    results = []
    for step in range(steps):
        query, key, value = inputs(xp, 2, 3, 5, 8, 6, seed=step)
        mask = from_numpy(_all_masks(rng)["additive"], xp)
        out, w = m(query, key, value, mask=mask, need_weights=True, dropout_mask=dropout_mask,
                   average_attn_weights=False)
        dout = from_numpy(rng.standard_normal((2, 3, 8)), xp)
        grads = m.backward(dout)
        results.append({"out": out, "weights": w, **dict(zip(("dq", "dk", "dv"), grads)),
                        **{f"grad {n}": g for n, g in m.grads.items()}})
    return [snapshot(r) for r in results]


def test_same_seed_same_bits(backend, xp):
    """Same seed, same inputs: bitwise identical outputs and gradients, dropout included."""
    a = _run(backend, xp, seed=5)
    b = _run(backend, xp, seed=5)
    for ra, rb in zip(a, b):
        assert ra.keys() == rb.keys()
        for name in ra:
            np.testing.assert_array_equal(ra[name], rb[name], err_msg=name)
    # the dropout did act: another seed gives other outputs (and the test can fail)
    c = _run(backend, xp, seed=6)
    assert any(not np.array_equal(a[0][n], c[0][n]) for n in ("out", "dq"))


def test_given_keep_mask_same_bits(backend, xp):
    """With the caller's keep-mask the generator is not used: one module called
    twice gives the same bits, and the mask really acts."""
    keep = from_numpy(np.random.default_rng(4).random((2, 2, 3, 5)) > 0.4, xp)
    m = make_mha(backend, dropout=0.4)
    query, key, value = inputs(xp, 2, 3, 5, 8)
    dout = from_numpy(np.random.default_rng(5).standard_normal((2, 3, 8)), xp)

    def once(**kwargs):
        out, _ = m(query, key, value, **kwargs)
        return snapshot({"out": out, **dict(zip(("dq", "dk", "dv"), m.backward(dout))),
                         **m.grads})

    a, b = once(dropout_mask=keep), once(dropout_mask=keep)
    for name in a:
        np.testing.assert_array_equal(a[name], b[name], err_msg=name)
    assert not np.array_equal(a["out"], once()["out"])  # the generator's mask differs


def test_same_seed_same_bits_across_backends():
    """One seed gives the same parameters and the same dropout keep-mask on every backend."""
    import importlib.util

    names = [n for n in ("numpy", "array_api_strict", "torch") if importlib.util.find_spec(n)]
    from npattn.backend import resolve_backend

    runs = {n: _run(n, resolve_backend(n), seed=3, steps=1)[0] for n in names}
    ref = runs["numpy"]
    for n, r in runs.items():
        for name in ("weights", "out"):
            # the keep-mask is identical: zeros of the dropped weights in the same places
            np.testing.assert_allclose(r[name], ref[name], rtol=1e-12, atol=1e-14, err_msg=f"{n} {name}")


# --------------------------------------------------------------------------
# memory


def _nbytes(arrays):
    return sum(to_numpy(a).nbytes for _, a in arrays)


@pytest.mark.parametrize("backend_name", ["numpy", "array_api_strict"])
def test_repeated_steps_do_not_grow_memory(backend_name):
    """The cache of the previous step is replaced, not accumulated (tracemalloc
    sees NumPy's allocations, and so array_api_strict's; torch's are invisible to it).

    The interpreter and NumPy keep caches of their own (freed small buffers, strings)
    that tracemalloc counts as live: they grow by up to about 35 kB over the first
    thousand steps and then stop. The bound is two caches over 300 steps, above that
    noise, while one cache kept per step would be 300 of them and a leak of 250 bytes
    a step would already cross it."""
    pytest.importorskip(backend_name)
    m = make_mha(backend_name, dropout=0.2)
    xp = m.xp
    query, key, value = inputs(xp, 2, 16, 24, 8)
    mask = from_numpy(np.random.default_rng(0).random((16, 24)) > 0.2, xp)
    dout = from_numpy(np.random.default_rng(1).standard_normal((2, 16, 8)), xp)

    def step():
        m(query, key, value, mask=mask, need_weights=True)
        m.backward(dout)

    for _ in range(3):
        step()
    per_step = _nbytes(cache_arrays(m._cache))
    assert per_step > 20_000  # big enough that an accumulated cache would show
    steps = 300
    gc.collect()
    tracemalloc.start()
    try:
        for _ in range(3):
            step()
        gc.collect()
        start, _ = tracemalloc.get_traced_memory()
        for _ in range(steps):
            step()
        gc.collect()
        end, _ = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    growth = end - start
    assert growth < 2 * per_step, f"memory grew by {growth} bytes over {steps} steps (one cache: {per_step})"
