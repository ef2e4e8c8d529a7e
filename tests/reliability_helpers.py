"""Helpers shared by the reliability tests (validation, numerics, robustness, fuzz)."""

from __future__ import annotations

import re

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
    if isinstance(obj, tuple) and not hasattr(obj, "shape"):
        fields = getattr(obj, "_fields", None) or [str(i) for i in range(len(obj))]
        out = []
        for name, item in zip(fields, obj):
            out += cache_arrays(item, f"{prefix}.{name}")
        return out
    if hasattr(obj, "shape") and hasattr(obj, "dtype"):
        return [(prefix, obj)]
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
