"""Helpers shared by the reliability tests (validation, numerics, robustness, fuzz)."""

from __future__ import annotations

import re

import array_api_compat
import numpy as np
import pytest

from npattn import MultiHeadAttention
from npattn.backend import from_numpy, to_numpy


def make_mha(backend, d_model=8, n_head=2, *, dtype="float64", kdim=None, vdim=None,
             dropout=0.0, seed=0, random_bias=True, bias=True):
    """A module whose biases are random (nonzero), so a test can tell them apart from zeros."""
    m = MultiHeadAttention(d_model, n_head, kdim=kdim, vdim=vdim, dtype=dtype,
                           dropout=dropout, seed=seed, backend=backend, bias=bias)
    if random_bias and bias:
        rng = np.random.default_rng(1000 + seed)
        for name in ("b_q", "b_k", "b_v", "b_o"):
            m.params[name] = from_numpy(rng.standard_normal(d_model).astype(dtype), m.xp)
    return m


def host_inputs(B=2, Lq=3, Lk=5, D=8, Dk=None, Dv=None, *, dtype="float64", seed=1):
    """query (B, Lq, D), key (B, Lk, Dk), value (B, Lk, Dv) as NumPy arrays."""
    rng = np.random.default_rng(seed)
    Dk = D if Dk is None else Dk
    Dv = D if Dv is None else Dv
    return (
        rng.standard_normal((B, Lq, D)).astype(dtype),
        rng.standard_normal((B, Lk, Dk)).astype(dtype),
        rng.standard_normal((B, Lk, Dv)).astype(dtype),
    )


def inputs(xp, *args, **kwargs):
    return tuple(from_numpy(a, xp) for a in host_inputs(*args, **kwargs))


def cache_arrays(obj, prefix="cache"):
    """(path, array) for every array inside a (nested) NamedTuple cache."""
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return []
    if array_api_compat.is_array_api_obj(obj):  # (not an ArraySpec: a tuple with shape, dtype)
        return [(prefix, obj)]
    if isinstance(obj, tuple):
        fields = getattr(obj, "_fields", None) or [str(i) for i in range(len(obj))]
        out = []
        for name, item in zip(fields, obj):
            out += cache_arrays(item, f"{prefix}.{name}")
        return out
    return []  # dtypes and other scalars


def snapshot(arrays):
    """Host copies of a dict or list of (name, array) pairs."""
    items = arrays.items() if isinstance(arrays, dict) else arrays
    return {name: to_numpy(a) for name, a in items if a is not None}


def assert_unchanged(before, arrays):
    now = snapshot(arrays)
    assert before.keys() == now.keys()
    for name in before:
        np.testing.assert_array_equal(now[name], before[name], err_msg=f"{name} was modified")


def raises(exc, *fragments):
    """pytest.raises(exc) whose message must contain each fragment, 'expected' and 'got'."""
    pattern = "".join(f"(?=[\\s\\S]*{re.escape(f)})" for f in fragments + ("expected", "got"))
    return pytest.raises(exc, match=pattern)


# --------------------------------------------------------------------------
# an independent float64 reference on the host, written from the formulas


def ref_softmax(s):
    """Softmax over the last axis; a row that is all -inf gives zeros."""
    with np.errstate(invalid="ignore"):
        m = np.max(s, axis=-1, keepdims=True)
        m = np.where(np.isneginf(m), 0.0, m)
        e = np.exp(s - m)
        z = np.sum(e, axis=-1, keepdims=True)
    return e / np.where(z == 0.0, 1.0, z)


def ref_sdpa(q, k, v, *, allowed=None, additive=None):
    s = q @ np.swapaxes(k, -1, -2) / np.sqrt(q.shape[-1])
    if additive is not None:
        s = s + additive
    if allowed is not None:
        s = np.where(allowed, s, -np.inf)
    p = ref_softmax(s)
    return p @ v, p


def ref_mha(params, query, key, value, n_head, *, allowed=None, additive=None):
    """out (B, Lq, D) and weights (B, H, Lq, Lk) of multi-head attention, host float64."""
    P = {n: np.asarray(to_numpy(a), dtype=np.float64) for n, a in params.items()}
    query, key, value = (np.asarray(to_numpy(a), dtype=np.float64) for a in (query, key, value))

    def proj(x, n):
        y = x @ P["w_" + n].T
        return y + P["b_" + n] if "b_" + n in P else y

    def split(x):
        B, L, D = x.shape
        return x.reshape(B, L, n_head, D // n_head).transpose(0, 2, 1, 3)

    oh, p = ref_sdpa(split(proj(query, "q")), split(proj(key, "k")), split(proj(value, "v")),
                     allowed=allowed, additive=additive)
    B, H, Lq, Dh = oh.shape
    return proj(oh.transpose(0, 2, 1, 3).reshape(B, Lq, H * Dh), "o"), p


def module_pair(m, wrt_params=(), **kwargs):
    """(forward, backward) in gradcheck's contract for the module, over
    (query, key, value, *params in wrt_params)."""

    def forward(query, key, value, *params):
        for name, p in zip(wrt_params, params):
            m.params[name] = p
        return m(query, key, value, **kwargs)[0], None

    def backward(dout, cache):
        return (*m.backward(dout), *(m.grads[n] for n in wrt_params))

    return forward, backward


def count_forward_runs(monkeypatch, cls) -> list:
    """Make ``cls.forward``'s output, where a dask array, a task that records each of its runs
    in the list returned: one entry per pass over a graph that needs it (run the graphs on the
    sync scheduler, so that the runs are in this process)."""
    from npattn.backend import is_dask_array

    calls: list = []

    def counted(block):
        calls.append(block.shape)
        return block

    forward = cls.forward

    def forward_counted(self, *args, **kwargs):
        out = forward(self, *args, **kwargs)
        return out.map_blocks(counted, meta=np.asarray(out)[:0]) if is_dask_array(out) else out

    monkeypatch.setattr(cls, "forward", forward_counted)
    return calls
