"""The NumPy fast path (npattn/_fast.py) against the readable reference.

Every test runs the same call twice, ``fast_path(True)`` and
``fast_path(False)``, and compares in float64; tile sizes are shrunk so that
the small test shapes still split into several tiles, row blocks and pool
tasks. Gradients of the fast path are also checked directly against central
differences, and the fused self-attention projection of the module against
the three separate ones on every backend.
"""

import numpy as np
import pytest
from hypothesis import given, strategies as st

from npattn import MultiHeadAttention, _fast
from npattn import functional as F
from npattn.gradcheck import gradcheck


@pytest.fixture(autouse=True)
def small_tiles(monkeypatch):
    """Tiles of 64 score entries: several heads groups, row blocks and pool tasks."""
    monkeypatch.setattr(_fast, "TILE_ELEMS", 64)
    monkeypatch.setattr(_fast, "POOL_MIN_SCORES", 0)  # the pool even for tiny shapes


def _inputs(seed, B, H, Lq, Lk, Dh, mask_kind, p, dtype=np.float64):
    r = np.random.default_rng(seed)
    q, k, v = (r.standard_normal((B, H, L, Dh)).astype(dtype) for L in (Lq, Lk, Lk))
    mask = None
    if mask_kind == "bool":
        mask = r.random((B, 1, Lq, Lk)) > 0.3  # [B, 1, Lq, Lk]
        mask[0, 0, 1] = False  # a fully masked row
    elif mask_kind == "float":
        mask = r.standard_normal((Lq, Lk)).astype(dtype)  # [Lq, Lk]
        mask[r.random((Lq, Lk)) < 0.3] = -np.inf
        mask[1] = -np.inf  # a fully masked row
    keep = r.random((B, H, Lq, Lk)) >= p if p > 0 else None
    dout = r.standard_normal((B, H, Lq, Dh)).astype(dtype)
    return q, k, v, mask, keep, dout


def _run(fast, q, k, v, mask, keep, dout, causal, p, rng=None):
    with _fast.fast_path(fast):
        out, cache = F.sdpa_forward(
            q, k, v, mask=mask, is_causal=causal, dropout_p=p, dropout_mask=keep, rng=rng
        )
        grads = F.sdpa_backward(dout, cache)
    expected = _fast.FastSDPACache if fast else F.SDPACache
    assert isinstance(cache, expected)
    return (out, cache.probs) + tuple(grads)


def _assert_same(a, b, rtol=1e-10, atol=1e-12):
    names = ("out", "probs", "dq", "dk", "dv", "dmask")
    for name, x, y in zip(names, a, b):
        if y is None:
            assert x is None, name
            continue
        assert x.shape == y.shape and x.dtype == y.dtype, name
        assert not np.isnan(x).any(), name
        np.testing.assert_allclose(x, y, rtol=rtol, atol=atol, err_msg=name)


@given(
    seed=st.integers(0, 2**16),
    B=st.integers(1, 3),
    H=st.integers(1, 3),
    Lq=st.integers(2, 13),
    Lk=st.integers(2, 13),
    Dh=st.integers(2, 5),
    mask_kind=st.sampled_from([None, "bool", "float"]),
    causal=st.booleans(),
    p=st.sampled_from([0.0, 0.4]),
    threads=st.sampled_from(["1", "2"]),
)
def test_fast_matches_reference(seed, B, H, Lq, Lk, Dh, mask_kind, causal, p, threads):
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("NPATTN_NUM_THREADS", threads)
        args = _inputs(seed, B, H, Lq, Lk, Dh, mask_kind, p)
        _assert_same(_run(True, *args, causal, p), _run(False, *args, causal, p))


@pytest.mark.parametrize("mask_shape", [(7, 5), (2, 1, 7, 5), (1, 3, 1, 5), (2, 3, 7, 5)])
def test_fast_dmask_broadcast_shapes(mask_shape):
    q, k, v, _, _, dout = _inputs(1, 2, 3, 7, 5, 4, None, 0.0)
    mask = np.random.default_rng(2).standard_normal(mask_shape)
    mask[..., 0, :] = -np.inf  # fully masked first row (every broadcast copy)
    a = _run(True, q, k, v, mask, None, dout, True, 0.0)
    b = _run(False, q, k, v, mask, None, dout, True, 0.0)
    assert a[-1].shape == mask_shape
    _assert_same(a, b)
    assert np.all(a[1][:, :, 0] == 0.0) and np.all(a[2][:, :, 0] == 0.0)


def test_fast_dropout_from_generator_draws_the_reference_mask():
    q, k, v, mask, _, dout = _inputs(3, 2, 2, 6, 9, 3, "bool", 0.0)
    a = _run(True, q, k, v, mask, None, dout, False, 0.5, rng=11)
    b = _run(False, q, k, v, mask, None, dout, False, 0.5, rng=11)
    _assert_same(a, b)


@pytest.mark.parametrize("mask_kind", [None, "bool", "float"])
@pytest.mark.parametrize("causal", [False, True])
def test_fast_gradients_finite_differences(mask_kind, causal):
    q, k, v, mask, keep, _ = _inputs(4, 2, 2, 5, 4, 3, mask_kind, 0.3)
    with _fast.fast_path(True):

        def forward(q, k, v, mask):
            return F.sdpa_forward(q, k, v, mask=mask, is_causal=causal, dropout_p=0.3,
                                  dropout_mask=keep)

        assert isinstance(forward(q, k, v, mask)[1], _fast.FastSDPACache)
        report = gradcheck(forward, F.sdpa_backward, [q, k, v, mask], mode="vjp",
                           rtol=1e-6, names=["q", "k", "v", "mask"])
    assert report.ok, str(report)


def test_fast_never_writes_into_inputs_dout_or_cache():
    q, k, v, mask, keep, dout = _inputs(5, 2, 3, 6, 7, 4, "float", 0.3)
    before = [x.copy() for x in (q, k, v, mask, keep, dout)]
    with _fast.fast_path(True):
        out, cache = F.sdpa_forward(q, k, v, mask=mask, dropout_p=0.3, dropout_mask=keep)
        saved = [np.array(x, copy=True) for x in cache if isinstance(x, np.ndarray)]
        out[...] = 7.0  # a caller writing into the output must not change the gradients
        g1 = F.sdpa_backward(dout, cache)
        g2 = F.sdpa_backward(dout, cache)
    for x, y in zip(before, (q, k, v, mask, keep, dout)):
        np.testing.assert_array_equal(x, y)
    for x, y in zip(saved, [x for x in cache if isinstance(x, np.ndarray)]):
        np.testing.assert_array_equal(x, y)
    for x, y in zip(g1, g2):
        np.testing.assert_array_equal(x, y)
    with _fast.fast_path(False):
        ref = F.sdpa_backward(dout, F.sdpa_forward(q, k, v, mask=mask, dropout_p=0.3,
                                                   dropout_mask=keep)[1])
    for x, y in zip(g1, ref):
        np.testing.assert_allclose(x, y, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("mask_kind", [None, "bool", "float"])
def test_fast_float16_upcast(mask_kind):
    args64 = _inputs(6, 2, 2, 8, 6, 4, mask_kind, 0.0)
    args16 = [None if a is None else (a if a.dtype == bool else a.astype(np.float16))
              for a in args64]
    a = _run(True, *args16, True, 0.0)
    b = _run(False, *args16, True, 0.0)
    for x, y in zip(a, b):
        if y is not None:
            assert x.dtype == y.dtype
            assert not np.isnan(x).any()
            np.testing.assert_allclose(x.astype(np.float64), y.astype(np.float64),
                                       rtol=2e-3, atol=2e-3)
    assert a[1].dtype == np.float32  # scores and softmax in float32


def test_fast_path_only_for_numpy_and_switchable():
    q, k, v, *_ = _inputs(7, 1, 2, 3, 4, 2, None, 0.0)
    assert _fast.applies(q, k, v)
    assert not _fast.applies(q, k[:, :1], v[:, :1])  # broadcasting heads: reference
    with _fast.fast_path(False):
        assert not _fast.applies(q, k, v)
    torch = pytest.importorskip("torch")
    assert not _fast.applies(*(torch.from_numpy(t) for t in (q, k, v)))


def test_module_self_attention_fused_projection(xp, to_xp, to_np):
    """query is key is value: one (3D, D) GEMM; same numbers as three projections."""
    m = MultiHeadAttention(12, 3, dtype="float64", seed=0, backend=xp)
    r = np.random.default_rng(8)
    for name, val in m.params.items():  # non-zero biases, so that they are tested
        if name.startswith("b_"):
            m.params[name] = to_xp(r.standard_normal(val.shape))
    x_np = r.standard_normal((2, 5, 12))
    dout = to_xp(r.standard_normal((2, 5, 12)))
    x = to_xp(x_np)
    out_fused = to_np(m(x, x, x, is_causal=True))
    d_fused = [to_np(g) for g in m.backward(dout)]
    g_fused = {k: to_np(g) for k, g in m.grads.items()}
    out_sep = to_np(m(x, to_xp(x_np), to_xp(x_np), is_causal=True))  # three projections
    d_sep = [to_np(g) for g in m.backward(dout)]
    np.testing.assert_allclose(out_fused, out_sep, rtol=1e-12, atol=1e-12)
    for a, b in zip(d_fused, d_sep):
        np.testing.assert_allclose(a, b, rtol=1e-12, atol=1e-12)
    for name, g in m.grads.items():
        np.testing.assert_allclose(g_fused[name], to_np(g), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("causal", [False, True])
def test_module_fast_matches_reference_with_dropout_and_mask(causal):
    """Whole module, seeded dropout drawn by the generator, boolean mask, weights."""
    r = np.random.default_rng(9)
    x = r.standard_normal((2, 6, 12))
    mem = r.standard_normal((2, 5, 12))
    mask = r.random((2, 1, 6, 5)) > 0.3
    mask[1, 0, 2] = False  # a fully masked row
    dout = r.standard_normal((2, 6, 12))
    results = []
    for fast in (True, False):
        m = MultiHeadAttention(12, 3, dropout=0.3, dtype="float64", seed=4)
        with _fast.fast_path(fast):
            out, w = m(x, mem, mem, mask=mask, is_causal=causal, need_weights=True)
            grads = m.backward(dout)
        results.append((out, w, *grads, *(m.grads[k] for k in sorted(m.grads))))
    for a, b in zip(*results):
        assert not np.isnan(a).any()
        np.testing.assert_allclose(a, b, rtol=1e-10, atol=1e-12)
