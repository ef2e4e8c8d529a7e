"""npattn.compat: flash-attn's, torch SDPA's and JAX's entry points on npattn.

Each function is checked against ``ref`` below, a dense float64 NumPy
attention written here from the documented semantics of the original (not
from npattn's code): flash-attn's bottom-right causal mask and window, its
softcap and ALiBi, packed sequences, the in-place KV-cache append; torch's
and JAX's top-left masks, JAX's sequence lengths. Where the original is
installed, the forward and gradients are compared with it too
(``torch.nn.functional.scaled_dot_product_attention`` in float64,
``jax.nn.dot_product_attention`` in float32). Gradients through ``vjp`` are
checked against central finite differences in float64 along a random
direction with a random upstream gradient, with Lq != Lk, dropout p > 0 on
a fixed keep-mask, and rows with nothing to attend.
"""

import inspect
import math
import re

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from npattn import compat as C
from npattn import masks
from npattn import positions as P
from npattn.gradcheck import check_vjp as gradcheck_vjp

RNG = np.random.default_rng(20240611)


def randn(*shape):
    return RNG.standard_normal(shape)


#: The JAX releases whose ``jax.nn.dot_product_attention`` the JAX comparisons need: 0.8.1 added
#: ``return_residual``; before 0.8.2 JAX ignored ``local_window_size`` when no mask, ``is_causal`` or
#: sequence length was given (jax-ml/jax#32300). Older releases skip these comparisons.
JAX_RESIDUAL = (0, 8, 1)
JAX_WINDOW_ALONE = (0, 8, 2)


def jax_since(release, what):
    """``jax``, or a skip that names ``what`` and the release it needs."""
    jax = pytest.importorskip("jax", reason=f"{what} needs JAX")
    found = tuple(int(n) for n in re.findall(r"\d+", jax.__version__)[:3])
    if found < release:
        pytest.skip(f"{what} needs JAX {'.'.join(map(str, release))} or later, found {jax.__version__}")
    return jax


# --------------------------------------------------------------------------
# the reference: documented semantics on NumPy float64, layout (B, H, L, D)


def ref(q, k, v, *, scale=None, offset=0, causal=False, window=(None, None), softcap=None,
        alibi=None, bias=None, allowed=None, keep=None, p=0.0):
    """``(out, lse, probs)`` of attention; query ``i`` sits at key position ``i + offset``.

    ``window = (left, right)``: key ``j`` is visible when ``i + offset - left <= j <=
    i + offset + right`` (None unbounded); ``causal`` is ``right = 0``. ``alibi``
    (H,) or (B, H) adds ``-slope * |i + offset - j|`` after the softcap; ``bias`` is
    added; ``allowed`` (bool) is ANDed. A row with nothing visible gives zero
    probabilities, zero output and ``lse = -inf``. ``keep`` with ``p`` is inverted dropout.
    """
    G = q.shape[1] // k.shape[1]
    k, v = np.repeat(k, G, axis=1), np.repeat(v, G, axis=1)  # query head h uses K/V head h // G
    Lq, Lk = q.shape[2], k.shape[2]
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    s = np.einsum("bhid,bhjd->bhij", q, k) * scale
    if softcap is not None:
        s = softcap * np.tanh(s / softcap)
    i = np.arange(Lq)[:, None] + offset
    j = np.arange(Lk)[None, :]
    if alibi is not None:
        slopes = alibi.reshape((1,) * (2 - alibi.ndim) + alibi.shape + (1, 1))
        s = s - slopes * np.abs(i - j)
    if bias is not None:
        s = s + bias
    ok = np.ones(s.shape, dtype=bool)
    left, right = window
    if causal:
        right = 0 if right is None else min(right, 0)
    if left is not None:
        ok &= j >= i - left
    if right is not None:
        ok &= j <= i + right
    if allowed is not None:
        ok &= allowed
    s = np.where(ok, s, -np.inf)
    m = s.max(axis=-1, keepdims=True)
    m = np.where(np.isfinite(m), m, 0.0)
    e = np.exp(s - m)
    z = e.sum(axis=-1, keepdims=True)
    probs = np.where(z > 0, e / np.where(z > 0, z, 1.0), 0.0)
    with np.errstate(divide="ignore"):
        lse = np.where(z[..., 0] > 0, np.log(z[..., 0]) + m[..., 0], -np.inf)
    a = probs if keep is None else np.where(keep, probs / (1.0 - p), 0.0)
    return a @ v, lse, probs


def to_bhld(x):
    return np.swapaxes(x, 1, 2)


def flash_ref(q, k, v, *, causal=False, window_size=(-1, -1), softcap=0.0, alibi=None, keep=None,
              p=0.0, scale=None):
    """flash-attn's documented semantics on (B, L, H, D): bottom-right, -1 unbounded, 0.0 off."""
    left, right = (None if w < 0 else w for w in window_size)
    o, lse, probs = ref(to_bhld(q), to_bhld(k), to_bhld(v), scale=scale,
                        offset=k.shape[1] - q.shape[1], causal=causal, window=(left, right),
                        softcap=softcap if softcap > 0 else None, alibi=alibi, keep=keep, p=p)
    return to_bhld(o), np.where(np.isneginf(lse), np.inf, lse), probs  # flash-attn: +inf


# --------------------------------------------------------------------------
# gradients: <J^T ct, t> against <(f(x + e t) - f(x - e t)) / 2e, ct>


def check_vjp(f, xs, grads, ct, *, ct_lse=None, eps=1e-6, rtol=1e-6, atol=1e-9):
    """``f(*xs)`` returns ``out`` (or ``(out, lse)`` with ``ct_lse``); ``grads`` are the
    pullback's gradients of ``xs`` for the upstream gradients ``ct`` (and ``ct_lse``)."""
    def loss(*args):
        r = f(*args)
        if ct_lse is None:
            return float(np.sum(np.asarray(r) * ct))
        out, lse = r
        return float(np.sum(out * ct) + np.sum(np.where(np.isfinite(lse), lse, 0.0) * ct_lse))

    assert len(xs) == len(grads)
    for n, (x, g) in enumerate(zip(xs, grads)):
        assert g is not None and g.shape == x.shape, f"argument {n}: gradient shape"
        t = RNG.standard_normal(x.shape)
        plus = [a if m != n else a + eps * t for m, a in enumerate(xs)]
        minus = [a if m != n else a - eps * t for m, a in enumerate(xs)]
        fd = (loss(*plus) - loss(*minus)) / (2 * eps)
        an = float(np.sum(g * t))
        assert abs(an) > 1e-3, f"argument {n}: a vanishing directional derivative tests nothing"
        assert abs(fd - an) <= rtol * abs(an) + atol + 1e-4 * eps, (n, fd, an)


# --------------------------------------------------------------------------
# flash_attn_func

FLASH_CASES = {
    "gqa_dv": dict(shape=(2, 3, 4, 5, 2, 5, 3)),
    "causal_lq_lt_lk": dict(shape=(2, 3, 2, 4, 2, 5, 4), causal=True),
    "causal_lq_gt_lk_empty_rows": dict(shape=(2, 5, 2, 4, 2, 3, 4), causal=True),
    "window_softcap_alibi": dict(shape=(2, 4, 4, 4, 2, 6, 3), window_size=(1, 2), softcap=2.0,
                                 alibi="h"),
    "left_window_alibi_bh": dict(shape=(2, 4, 2, 4, 1, 6, 4), window_size=(2, -1), alibi="bh"),
    "causal_window_dropout": dict(shape=(2, 4, 2, 4, 2, 6, 4), causal=True, window_size=(3, 5),
                                  p=0.3),
}


def flash_inputs(shape, alibi=None, p=0.0, **_):
    B, Lq, Hq, Dh, Hkv, Lk, Dv = shape
    q, k, v = randn(B, Lq, Hq, Dh), randn(B, Lk, Hkv, Dh), randn(B, Lk, Hkv, Dv)
    slopes = None
    if alibi == "h":
        slopes = RNG.uniform(0.1, 1.0, Hq)
    elif alibi == "bh":
        slopes = RNG.uniform(0.1, 1.0, (B, Hq))
    keep = RNG.random((B, Hq, Lq, Lk)) >= p if p else None
    return q, k, v, slopes, keep


def flash_kwargs(case):
    return {n: case[n] for n in ("causal", "window_size", "softcap") if n in case}


@pytest.mark.parametrize("name", FLASH_CASES)
def test_flash_attn_func_forward_lse_and_probs(name):
    case = FLASH_CASES[name]
    q, k, v, slopes, keep = flash_inputs(**case)
    p = case.get("p", 0.0)
    out, lse, S = C.flash_attn_func(q, k, v, p, None, alibi_slopes=slopes, return_attn_probs=True,
                                    dropout_mask=keep, **flash_kwargs(case))
    r_out, r_lse, r_probs = flash_ref(q, k, v, alibi=slopes, keep=keep, p=p, **flash_kwargs(case))
    np.testing.assert_allclose(out, r_out, rtol=1e-12, atol=1e-12)
    assert lse.shape == (q.shape[0], q.shape[2], q.shape[1])
    np.testing.assert_array_equal(np.isposinf(lse), np.isposinf(r_lse))
    np.testing.assert_allclose(lse[np.isfinite(r_lse)], r_lse[np.isfinite(r_lse)], rtol=1e-12)
    # S_dmask: the probabilities before dropout, negated where dropped
    np.testing.assert_allclose(np.abs(S), r_probs, rtol=1e-12, atol=1e-15)
    dropped = np.zeros(S.shape, bool) if keep is None else ~keep
    np.testing.assert_array_equal(np.signbit(S), dropped)
    if name == "causal_lq_gt_lk_empty_rows":  # Lq - Lk = 2 rows see no key
        assert np.all(np.isposinf(lse[:, :, :2])) and np.all(out[:, :2] == 0) and np.all(S[:, :, :2] == 0)


@pytest.mark.parametrize("name", ["gqa_dv", "causal_lq_gt_lk_empty_rows", "window_softcap_alibi",
                                  "left_window_alibi_bh", "causal_window_dropout"])
def test_flash_attn_func_gradients_match_finite_differences(name):
    case = FLASH_CASES[name]
    q, k, v, slopes, keep = flash_inputs(**case)
    p = case.get("p", 0.0)
    kw = dict(alibi_slopes=slopes, dropout_mask=keep, **flash_kwargs(case))
    out, pullback = C.vjp(C.flash_attn_func, q, k, v, p, **kw)
    ct = randn(*out.shape)
    grads = pullback(ct)
    assert len(grads) == 4 and grads[3] is None  # dropout_p, passed positionally, has none
    check_vjp(lambda a, b, c: C.flash_attn_func(a, b, c, p, **kw), [q, k, v], grads[:3], ct)


def test_flash_attn_func_dlse_gradient():
    case = FLASH_CASES["causal_lq_gt_lk_empty_rows"]
    q, k, v, slopes, _ = flash_inputs(**case)
    kw = dict(causal=True, softcap=1.5, return_attn_probs=True)
    (out, lse, _), pullback = C.vjp(C.flash_attn_func, q, k, v, **kw)
    ct, ct_lse = randn(*out.shape), randn(*lse.shape)
    grads = pullback(ct, dlse=ct_lse)

    def f(a, b, c):
        o, l_, _ = C.flash_attn_func(a, b, c, **kw)
        return o, l_

    check_vjp(f, [q, k, v], grads, ct, ct_lse=ct_lse)


def test_flash_attn_func_dropout_replays_and_draws():
    q, k, v, _, keep = flash_inputs((2, 4, 2, 4, 2, 6, 4), p=0.4)
    # a kernel's S_dmask is rounded up to multiples of 128: the leading block is used
    big = np.ones((2, 2, 128, 128), bool)
    big[:, :, :4, :6] = keep
    a = C.flash_attn_func(q, k, v, 0.4, causal=True, dropout_mask=big)
    b = C.flash_attn_func(q, k, v, 0.4, causal=True, dropout_mask=keep)
    np.testing.assert_array_equal(a, b)
    # one row and one column longer: trimmed as well
    np.testing.assert_array_equal(
        C.flash_attn_func(q, k, v, 0.4, causal=True, dropout_mask=big[:, :, :5, :7]), b)
    # a keep-mask of one axis, (Lk,), broadcasts: the same keys dropped in every row
    cols = np.array([True, False, True, True, False, True])
    np.testing.assert_allclose(C.flash_attn_func(q, k, v, 0.4, causal=True, dropout_mask=cols),
                               flash_ref(q, k, v, causal=True, keep=np.broadcast_to(cols, keep.shape),
                                         p=0.4)[0], rtol=1e-12, atol=1e-12)
    # drawn: a seed gives one mask, and S_dmask's sign is the mask that was applied
    out, _, S = C.flash_attn_func(q, k, v, 0.4, causal=True, return_attn_probs=True, rng=7)
    again = C.flash_attn_func(q, k, v, 0.4, causal=True, rng=7)
    np.testing.assert_array_equal(out, again)
    drawn = ~np.signbit(S)
    assert 0 < drawn.mean() < 1
    np.testing.assert_allclose(out, flash_ref(q, k, v, causal=True, keep=drawn, p=0.4)[0],
                               rtol=1e-12, atol=1e-12)


def test_flash_attn_func_attention_probabilities_of_dask_arrays():
    """S_dmask and softmax_lse of dask arrays are those of the reference, as on NumPy: the
    weights are asked for (a plain dask call otherwise goes to an implementation that keeps
    none)."""
    da = pytest.importorskip("dask.array")
    g = np.random.default_rng(15)  # its own numbers: the later tests' draws stay as they were
    q, k, v = (g.standard_normal(s) for s in ((2, 3, 4, 4), (2, 5, 2, 4), (2, 5, 2, 3)))
    out, lse, S = C.flash_attn_func(*(da.from_array(t, chunks=(1,) + t.shape[1:]) for t in (q, k, v)),
                                    return_attn_probs=True)
    r_out, r_lse, r_probs = flash_ref(q, k, v)
    np.testing.assert_allclose(np.asarray(out), r_out, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(np.asarray(lse), r_lse, rtol=1e-12)
    np.testing.assert_allclose(np.asarray(S), r_probs, rtol=1e-12, atol=1e-15)


def test_flash_attn_func_half_precision_dtypes():
    q, k, v, _, _ = flash_inputs((2, 3, 2, 8, 2, 5, 8))
    out, lse, S = C.flash_attn_func(*(t.astype(np.float16) for t in (q, k, v)), causal=True,
                                    return_attn_probs=True)
    assert out.dtype == np.float16 and S.dtype == np.float16 and lse.dtype == np.float32
    np.testing.assert_allclose(out, flash_ref(q, k, v, causal=True)[0], atol=5e-3)


def test_flash_attn_func_deterministic_and_scale():
    q, k, v, _, _ = flash_inputs((2, 3, 2, 4, 2, 5, 4))
    a = C.flash_attn_func(q, k, v, softmax_scale=0.3, deterministic=True)
    np.testing.assert_allclose(a, flash_ref(q, k, v, scale=0.3)[0], rtol=1e-12)
    np.testing.assert_array_equal(a, C.flash_attn_func(q, k, v, 0.0, 0.3))


@pytest.mark.parametrize("kwargs, exc, name", [
    (dict(window_size=(1,)), TypeError, r"^window_size: expected a pair \(left, right\) of ints, -1 for "
                                        r"an unbounded side, got tuple \(1,\)$"),
    (dict(window_size="local"), TypeError, r"^window_size: expected a pair .*, got str 'local'$"),
    (dict(window_size=(1.5, 2)), TypeError, r"^window_size: expected a pair .*, got tuple \(1\.5, 2\)$"),
    (dict(window_size=(True, -1)), TypeError, "^window_size: expected a pair"),  # a bool is no int
    (dict(softcap=-1.0), ValueError, r"^softcap: expected 0\.0 \(off\) or a finite float > 0, got -1\.0$"),
    (dict(softcap=float("inf")), ValueError, r"^softcap: expected 0.0 \(off\) or a finite float"),
    (dict(softcap="on"), TypeError, "^softcap: expected a float, 0.0 for off, got str 'on'$"),
    (dict(softcap=True), TypeError, "^softcap: expected a float, 0.0 for off, got bool"),  # not 1.0
    (dict(causal=1), TypeError, "^causal: expected a bool, got int 1$"),
    (dict(dropout_p=1.5), ValueError, r"^dropout_p: expected a drop probability in \[0, 1\), got 1\.5$"),
    (dict(alibi_slopes=np.ones(3)), ValueError, r"^alibi_slopes: expected shape \(\d+,\) or .*, got \(3,\)$"),
    (dict(return_attn_probs="yes"), TypeError, "^return_attn_probs: expected a bool, got str 'yes'$"),
    (dict(softmax_scale="x"), TypeError, "^softmax_scale: expected None or a float"),
    (dict(softmax_scale=float("nan")), ValueError, "^softmax_scale: expected a finite float"),
    (dict(dropout_p=0.1, rng="x"), TypeError, "^rng: expected None, a non-negative int seed"),
    (dict(deterministic="yes"), TypeError, "^deterministic: expected a bool"),
    (dict(deterministic=None), TypeError, "^deterministic: expected a bool"),
])
def test_flash_attn_func_bad_options_name_the_argument(kwargs, exc, name):
    q, k, v, _, _ = flash_inputs((2, 3, 2, 4, 2, 5, 4))
    with pytest.raises(exc, match=name):
        C.flash_attn_func(q, k, v, **kwargs)


def test_arrays_of_two_libraries_name_the_argument():
    """A K of another library is named (the message named no argument: "arrays from different
    array libraries were mixed")."""
    xps = pytest.importorskip("array_api_strict")
    q, k, v, _, _ = flash_inputs((2, 3, 2, 4, 2, 5, 4))
    ks = xps.asarray(k)
    with pytest.raises(TypeError, match=r"^k: expected an array of the library of q \(numpy.ndarray\), got"):
        C.flash_attn_func(q, ks, v)
    with pytest.raises(TypeError, match=r"^v: expected an array of the library of q"):
        C.flash_attn_varlen_func(q[0], k[0], xps.asarray(v[0]), np.array([0, 3], np.int32),
                                 np.array([0, 5], np.int32), 3, 5)
    with pytest.raises(TypeError, match=r"^key: expected an array of the library of query"):
        C.dot_product_attention(q, ks, v)
    # the masks too, with their own names (not the dtype check's: "got bool")
    mask = xps.asarray(np.ones((3, 5), bool))
    with pytest.raises(TypeError, match=r"^mask: expected a numpy array \(that of query\), "
                                        r"got an array_api_strict"):
        C.dot_product_attention(q, k, v, mask=mask)
    with pytest.raises(TypeError, match=r"^attn_mask: expected a numpy array \(that of query\), got an "
                                        r"array_api_strict"):
        C.scaled_dot_product_attention(to_bhld(q), to_bhld(k), to_bhld(v), mask)
    with pytest.raises(TypeError, match=r"^k_segments: expected an array of the library of q_segments"):
        masks.segments(np.zeros((2, 3), np.int64), xps.zeros((2, 5), dtype=xps.int64))


def test_flash_attn_func_bad_shapes_name_the_argument():
    q, k, v, _, _ = flash_inputs((2, 3, 4, 4, 2, 5, 4))
    with pytest.raises(ValueError, match=r"^q: expected 4 axes \(batch, seqlen, nheads, headdim\)"):
        C.flash_attn_func(q[0], k, v)
    with pytest.raises(ValueError, match=r"^k: expected key/value heads \(axis 2 of \(batch, seqlen, "
                                         r"nheads, headdim\)\) that divide the query heads \(3, axis 2 "
                                         r"of q\), got 2 in shape \(2, 5, 2, 4\)$"):
        C.flash_attn_func(q[:, :, :3], k, v)
    # arrays in torch's (B, H, L, D): the lengths were read as heads, and the message says which
    # axis it read ("got 5" alone named no axis, and 5 is no head count of these arrays)
    with pytest.raises(ValueError, match=r"^k: expected key/value heads \(axis 2 of \(batch, seqlen, "
                                         r"nheads, headdim\)\) that divide the query heads \(3, axis 2 "
                                         r"of q\), got 5 in shape \(2, 2, 5, 4\)$"):
        C.flash_attn_func(to_bhld(q), to_bhld(k), to_bhld(v))
    with pytest.raises(ValueError, match=r"^k: expected the batch of q = 2"):
        C.flash_attn_func(q, k[:1], v)
    with pytest.raises(ValueError, match=r"^v: expected the key length of k = 5"):
        C.flash_attn_func(q, k, v[:, :4])
    # the head width of k, named in flash's layout (not the core's (B, H, L, D))
    with pytest.raises(ValueError, match=r"^k: expected the head width of q = 4 on axis 3, "
                                         r"got shape \(2, 5, 2, 3\)"):
        C.flash_attn_func(q, k[..., :3], v)
    with pytest.raises(TypeError, match=r"^q: expected an array"):
        C.flash_attn_func(q.tolist(), k, v)
    # sizes named in the function's own layout (batch, seqlen, nheads, headdim)
    with pytest.raises(ValueError, match=r"^k: expected a seqlen \(axis 1\) of at least 1, got shape \(2, 0, 2, 4\)"):
        C.flash_attn_func(q, k[:, :0], v[:, :0])
    with pytest.raises(ValueError, match=r"^q: expected a seqlen \(axis 1\)"):
        C.flash_attn_func(q[:, :0], k, v)
    # no query heads: it was the core's message, in (B, H, L, D) and naming "q, k, v"
    with pytest.raises(ValueError, match=r"^q: expected a nheads \(axis 2\) of at least 1, got shape \(2, 3, 0, 4\)"):
        C.flash_attn_func(q[:, :, :0], k, v)
    # an axis too many, and v's batch, heads and width, each named as given
    with pytest.raises(ValueError, match=r"^q: expected 4 axes \(batch, seqlen, nheads, headdim\), "
                                         r"got shape \(1, 2, 3, 4, 4\)$"):
        C.flash_attn_func(q[None], k, v)
    with pytest.raises(ValueError, match=r"^v: expected the batch of q = 2 on axis 0, "
                                         r"got shape \(1, 5, 2, 4\)$"):
        C.flash_attn_func(q, k, v[:1])
    with pytest.raises(ValueError, match=r"^v: expected the heads of k = 2 on axis 2, "
                                         r"got shape \(2, 5, 1, 4\)$"):
        C.flash_attn_func(q, k, v[:, :, :1])
    with pytest.raises(ValueError, match=r"^v: expected a headdim \(axis 3\) of at least 1, "
                                         r"got shape \(2, 5, 2, 0\)$"):
        C.flash_attn_func(q, k, v[..., :0])


# --------------------------------------------------------------------------
# flash_attn_varlen_func

# sequences: Lq < Lk; Lq > Lk with causal (empty rows); Lk = 0 (zero output); Lq = 0
LENS_Q, LENS_K = [2, 4, 1, 0], [3, 2, 0, 2]


def varlen_inputs(Hq=4, Hkv=2, Dh=4, Dv=3, p=0.0, maxq=5, maxk=4):
    cq, ck = np.cumsum([0] + LENS_Q), np.cumsum([0] + LENS_K)
    q, k, v = randn(cq[-1], Hq, Dh), randn(ck[-1], Hkv, Dh), randn(ck[-1], Hkv, Dv)
    keep = RNG.random((len(LENS_Q), Hq, maxq, maxk)) >= p if p else None
    return q, k, v, cq.astype(np.int32), ck.astype(np.int32), keep


def varlen_ref(q, k, v, cq, ck, *, alibi=None, keep=None, p=0.0, **kw):
    """Each sequence on its own by ``flash_ref``: (out, lse (H, total_q), probs per sequence)."""
    outs, lses, probs = [], [], []
    for b in range(len(cq) - 1):
        qb, kb, vb = q[cq[b]:cq[b + 1]][None], k[ck[b]:ck[b + 1]][None], v[ck[b]:ck[b + 1]][None]
        lq, lk = qb.shape[1], kb.shape[1]
        if lk == 0:  # nothing to attend
            outs.append(np.zeros((lq, q.shape[1], v.shape[2])))
            lses.append(np.full((q.shape[1], lq), np.inf))
            probs.append(np.zeros((q.shape[1], lq, 0)))
            continue
        a = None if alibi is None else alibi[b]
        kb_keep = None if keep is None else keep[b:b + 1, :, :lq, :lk]
        o, l_, pr = flash_ref(qb, kb, vb, alibi=a, keep=kb_keep, p=p, **kw)
        outs.append(o[0])
        lses.append(l_[0])
        probs.append(pr[0])
    return np.concatenate(outs), np.concatenate(lses, axis=1), probs


def test_flash_attn_varlen_func_forward_each_sequence_attends_itself():
    q, k, v, cq, ck, keep = varlen_inputs(p=0.25)
    slopes = RNG.uniform(0.1, 1.0, (4, 4))
    kw = dict(causal=True, softcap=3.0)
    out, lse, S = C.flash_attn_varlen_func(q, k, v, cq, ck, 5, 4, 0.25, alibi_slopes=slopes,
                                           return_attn_probs=True, dropout_mask=keep, **kw)
    r_out, r_lse, r_probs = varlen_ref(q, k, v, cq, ck, alibi=slopes, keep=keep, p=0.25, **kw)
    np.testing.assert_allclose(out, r_out, rtol=1e-12, atol=1e-12)
    assert lse.shape == (4, q.shape[0]) and S.shape == (4, 4, 5, 4)
    np.testing.assert_array_equal(np.isposinf(lse), np.isposinf(r_lse))
    fin = np.isfinite(r_lse)
    np.testing.assert_allclose(lse[fin], r_lse[fin], rtol=1e-12)
    assert np.isposinf(lse[:, 2:4]).all()  # sequence 1 (Lq 4, Lk 2), causal: first 2 rows empty
    for b, (lq, lk) in enumerate(zip(LENS_Q, LENS_K)):
        np.testing.assert_allclose(np.abs(S[b, :, :lq, :lk]), r_probs[b], rtol=1e-12, atol=1e-15)
        np.testing.assert_array_equal(np.signbit(S[b, :, :lq, :lk]), ~keep[b, :, :lq, :lk])
        assert not S[b, :, lq:].any() and not S[b, :, :, lk:].any()
    assert not out[cq[2]:cq[3]].any()  # the sequence without keys


def test_flash_attn_varlen_func_gradients_match_finite_differences():
    q, k, v, cq, ck, keep = varlen_inputs(p=0.3)
    kw = dict(causal=True, window_size=(1, -1), alibi_slopes=RNG.uniform(0.1, 1.0, 4),
              dropout_mask=keep)
    out, pullback = C.vjp(C.flash_attn_varlen_func, q, k, v, cq, ck, 5, 4, 0.3, **kw)
    ct = randn(*out.shape)
    grads = pullback(ct)
    assert len(grads) == 8 and all(g is None for g in grads[3:])  # cu_seqlens, lengths, p
    check_vjp(lambda a, b, c: C.flash_attn_varlen_func(a, b, c, cq, ck, 5, 4, 0.3, **kw),
              [q, k, v], grads[:3], ct)
    assert not grads[0][cq[2]:cq[3]].any()  # no keys: no gradient


def test_flash_attn_varlen_func_dlse_gradient():
    q, k, v, cq, ck, _ = varlen_inputs()
    kw = dict(causal=True, return_attn_probs=True)
    (out, lse, _), pullback = C.vjp(C.flash_attn_varlen_func, q, k, v, cq, ck, 4, 3, **kw)
    ct, ct_lse = randn(*out.shape), randn(*lse.shape)
    grads = pullback(ct, dlse=ct_lse)[:3]

    def f(a, b, c):
        o, l_, _ = C.flash_attn_varlen_func(a, b, c, cq, ck, 4, 3, **kw)
        return o, l_

    check_vjp(f, [q, k, v], grads, ct, ct_lse=ct_lse)


def test_flash_attn_varlen_func_without_sequences_keeps_the_lse_dtype():
    """No sequence at all (B = 0): softmax_lse is float32 for float16 inputs, as with sequences."""
    q = np.zeros((0, 2, 4), np.float16)
    none = np.array([0], np.int32)
    out, lse, S = C.flash_attn_varlen_func(q, q, q, none, none, 1, 1, return_attn_probs=True)
    assert (out.shape, out.dtype) == ((0, 2, 4), np.float16)
    assert (lse.shape, lse.dtype) == ((2, 0), np.float32)
    assert (S.shape, S.dtype) == ((0, 2, 1, 1), np.float16)


def test_flash_attn_varlen_func_int_seed_draws_each_sequence_in_turn():
    """An int ``rng`` makes one generator for all sequences: two sequences of the same lengths
    get different drop patterns (a generator made per sequence from the seed repeats one)."""
    g = np.random.default_rng(11)  # its own numbers: the later tests' draws stay as they were
    q, k, v = (g.standard_normal(s) for s in ((8, 2, 4), (12, 2, 4), (12, 2, 4)))
    cq, ck = np.array([0, 4, 8], np.int32), np.array([0, 6, 12], np.int32)
    _, _, S = C.flash_attn_varlen_func(q, k, v, cq, ck, 4, 6, 0.5, return_attn_probs=True, rng=0)
    dropped = np.signbit(S)  # [2, 2, 4, 6]
    assert dropped.any() and not dropped.all()
    assert (dropped[0] != dropped[1]).any()


def test_flash_attn_varlen_func_long_max_seqlen_with_a_broadcast_keep_mask():
    """The grid bound is that of int64 indexing: a (1, 2, 2**20, 2**12) keep-mask grid
    (2**33 entries), broadcast from one entry, is never materialised and is accepted."""
    g = np.random.default_rng(12)
    q, k, v = (g.standard_normal(s) for s in ((3, 2, 4), (5, 2, 4), (5, 2, 4)))
    cq, ck = np.array([0, 3], np.int32), np.array([0, 5], np.int32)
    out = C.flash_attn_varlen_func(q, k, v, cq, ck, 2**20, 2**12, 0.5,
                                   dropout_mask=np.ones((1, 1, 1, 1), bool))
    # every entry kept: the attention scaled by 1 / (1 - 0.5)
    np.testing.assert_allclose(out, 2.0 * flash_ref(q[None], k[None], v[None])[0][0],
                               rtol=1e-12)


def test_flash_attn_varlen_func_keep_mask_longer_than_the_grid_uses_its_leading_block():
    """A keep-mask as flash-attn's S_dmask gives it, its last two axes rounded up past
    (max_seqlen_q, max_seqlen_k): sequence b uses its leading [b, :, :Lq_b, :Lk_b] block, as
    with a mask of exactly that grid."""
    g = np.random.default_rng(13)  # its own numbers: the later tests' draws stay as they were
    cq, ck = np.cumsum([0] + LENS_Q).astype(np.int32), np.cumsum([0] + LENS_K).astype(np.int32)
    q, k, v = (g.standard_normal(s) for s in ((cq[-1], 4, 4), (ck[-1], 2, 4), (ck[-1], 2, 3)))
    keep = g.random((4, 4, 8, 8)) >= 0.4  # the grid is (4, 4, 5, 4)
    out, _, S = C.flash_attn_varlen_func(q, k, v, cq, ck, 5, 4, 0.4, return_attn_probs=True,
                                         dropout_mask=keep)
    np.testing.assert_allclose(out, varlen_ref(q, k, v, cq, ck, keep=keep, p=0.4)[0],
                               rtol=1e-12, atol=1e-12)
    exact = C.flash_attn_varlen_func(q, k, v, cq, ck, 5, 4, 0.4, return_attn_probs=True,
                                     dropout_mask=keep[:, :, :5, :4])
    np.testing.assert_array_equal(out, exact[0])
    assert S.shape == (4, 4, 5, 4)
    np.testing.assert_array_equal(S, exact[2])
    for b, (lq, lk) in enumerate(zip(LENS_Q, LENS_K)):
        np.testing.assert_array_equal(np.signbit(S[b, :, :lq, :lk]), ~keep[b, :, :lq, :lk])


def test_flash_attn_varlen_func_keep_mask_broadcasts_over_the_sequences():
    """A keep-mask of one sequence's grid, (1, Hq, max_seqlen_q, max_seqlen_k), is every
    sequence's: the result of that mask repeated for each of the B sequences."""
    g = np.random.default_rng(14)  # its own numbers: the later tests' draws stay as they were
    cq, ck = np.cumsum([0] + LENS_Q).astype(np.int32), np.cumsum([0] + LENS_K).astype(np.int32)
    q, k, v = (g.standard_normal(s) for s in ((cq[-1], 4, 4), (ck[-1], 2, 4), (ck[-1], 2, 3)))
    keep = g.random((1, 4, 5, 4)) >= 0.4
    out = C.flash_attn_varlen_func(q, k, v, cq, ck, 5, 4, 0.4, dropout_mask=keep)
    every = np.repeat(keep, len(LENS_Q), axis=0)  # [B, Hq, max_q, max_k]
    np.testing.assert_allclose(out, varlen_ref(q, k, v, cq, ck, keep=every, p=0.4)[0],
                               rtol=1e-12, atol=1e-12)


def test_flash_attn_varlen_func_matches_flash_attn_func_on_equal_lengths():
    q, k, v = randn(3, 4, 2, 4), randn(3, 6, 2, 4), randn(3, 6, 2, 4)
    dense = C.flash_attn_func(q, k, v, causal=True, window_size=(2, 0))
    packed = C.flash_attn_varlen_func(q.reshape(12, 2, 4), k.reshape(18, 2, 4), v.reshape(18, 2, 4),
                                      np.arange(0, 13, 4), np.arange(0, 19, 6), 4, 6, causal=True,
                                      window_size=(2, 0))
    np.testing.assert_allclose(packed.reshape(3, 4, 2, 4), dense, rtol=1e-13, atol=1e-13)


@pytest.mark.parametrize("change, exc, match", [
    (dict(cu_seqlens_q=np.array([1, 3, 7, 8, 8])), ValueError,
     r"^cu_seqlens_q: expected cumulative lengths, non-decreasing from 0 to 7 \(the tokens of q\), "
     r"got \[1, 3, 7, 8, 8\]$"),
    (dict(cu_seqlens_q=np.array([0, 3, 2, 7, 7])), ValueError,
     r"^cu_seqlens_q: expected cumulative lengths, .*, got \[0, 3, 2, 7, 7\]$"),
    # a column of the right entries is not the 1-D array flash-attn takes
    (dict(cu_seqlens_q=np.array([[0], [2], [6], [7], [7]], np.int32)), ValueError,
     r"^cu_seqlens_q: expected cumulative sequence lengths \(B \+ 1,\), a 1-D integer array, "
     r"got shape \(5, 1\)$"),
    # ends at total_q = 7 and never decreases, but skips token 0
    (dict(cu_seqlens_q=np.array([1, 3, 6, 7, 7])), ValueError,
     r"^cu_seqlens_q: expected cumulative lengths, .*, got \[1, 3, 6, 7, 7\]$"),
    (dict(cu_seqlens_k=np.array([0, 3, 5, 5, 6])), ValueError,
     r"^cu_seqlens_k: expected cumulative lengths, non-decreasing from 0 to 7 \(the tokens of k\), "
     r"got \[0, 3, 5, 5, 6\]$"),
    (dict(cu_seqlens_k=np.array([0, 7])), ValueError,
     r"^cu_seqlens_k: expected B \+ 1 = 5 entries like cu_seqlens_q, got 2$"),
    (dict(cu_seqlens_k=np.array([0, 3, 5, 5, 7, 7])), ValueError,
     r"^cu_seqlens_k: expected B \+ 1 = 5 entries like cu_seqlens_q, got 6$"),
    (dict(cu_seqlens_q=np.array([0.0, 2, 6, 7, 7])), TypeError,
     r"^cu_seqlens_q: expected an integer dtype \(cumulative sequence lengths \(B \+ 1,\)\), got float64$"),
    (dict(max_seqlen_q=3), ValueError, r"^max_seqlen_q: expected at least the longest sequence, 4, got 3$"),
    (dict(max_seqlen_k=2.0), TypeError, r"^max_seqlen_k: expected an int >= 0, got float 2\.0$"),
    (dict(block_table=np.zeros((4, 1), np.int32)), NotImplementedError, r"^block_table"),
    (dict(alibi_slopes=np.ones((3, 4))), ValueError,
     r"^alibi_slopes: expected the number of sequences B = 4 on axis 0, got shape \(3, 4\)$"),
    (dict(alibi_slopes=np.ones(5)), ValueError,
     r"^alibi_slopes: expected shape \(4,\) or \(4, 4\) \(nheads of q, or batch and nheads\), got \(5,\)$"),
    (dict(softmax_scale="x"), TypeError, r"^softmax_scale: expected None or a float, got str 'x'$"),
    (dict(dropout_p=1.5), ValueError, r"^dropout_p: expected a drop probability in \[0, 1\), got 1\.5$"),
    (dict(deterministic="yes"), TypeError, r"^deterministic: expected a bool, got str 'yes'$"),
    # a grid no library indexes, before any sequence is computed (NumPy's message came after)
    (dict(max_seqlen_q=10**30, return_attn_probs=True), ValueError,
     r"^max_seqlen_q, max_seqlen_k: expected a \(B, Hq, max_seqlen_q, max_seqlen_k\) grid of fewer "
     rf"than 2\*\*62 entries \(S_dmask, dropout_mask\), got \(4, 4, {10**30}, 3\)$"),
    # a keep-mask spans that grid too, and exactly 2**62 entries (B Hq = 16 = 2**4) is refused
    (dict(max_seqlen_q=10**30, dropout_p=0.5, dropout_mask=np.ones((1, 1, 1, 1), bool)), ValueError,
     r"^max_seqlen_q, max_seqlen_k: expected a \(B, Hq, max_seqlen_q, max_seqlen_k\) grid of fewer "
     rf"than 2\*\*62 entries \(S_dmask, dropout_mask\), got \(4, 4, {10**30}, 3\)$"),
    (dict(max_seqlen_q=2**29, max_seqlen_k=2**29, dropout_p=0.5, dropout_mask=np.ones((1, 1, 1, 1), bool)),
     ValueError, r"^max_seqlen_q, max_seqlen_k: .* fewer than 2\*\*62 entries .* "
                 r"got \(4, 4, 536870912, 536870912\)$"),
    # the keep-mask itself, before the sequences take their blocks of it
    (dict(dropout_p=0.5, dropout_mask=np.ones((3, 4, 4, 3), bool)), ValueError,
     r"^dropout_mask: expected a shape that broadcasts to \(B, Hq, max_seqlen_q, max_seqlen_k\) "
     r"= \(4, 4, 4, 3\) \(each axis 1 or equal to it\), got shape \(3, 4, 4, 3\)$"),
    (dict(dropout_p=0.5, dropout_mask=np.ma.masked_array(np.ones((4, 4, 4, 3), bool))), TypeError,
     r"^dropout_mask: expected a plain numpy.ndarray, got numpy.ma.MaskedArray"),
    # a list of lengths holds ints (2.0 is no token count)
    (dict(cu_seqlens_q=[0, 2.0, 6, 7, 7]), TypeError,
     r"^cu_seqlens_q: expected cumulative sequence lengths \(B \+ 1,\) as ints, got \[0, 2\.0, 6, 7, 7\]$"),
    (dict(cu_seqlens_k=np.array(7, np.int32)), ValueError,
     r"^cu_seqlens_k: expected cumulative sequence lengths \(B \+ 1,\), a 1-D integer array, "
     r"got shape \(\)$"),
])
def test_flash_attn_varlen_func_bad_input_names_the_argument(change, exc, match):
    q, k, v, cq, ck, _ = varlen_inputs()
    args = dict(cu_seqlens_q=cq, cu_seqlens_k=ck, max_seqlen_q=4, max_seqlen_k=3)
    args.update(change)
    with pytest.raises(exc, match=match):
        C.flash_attn_varlen_func(q, k, v, **args)


def test_flash_attn_varlen_func_names_shapes_in_its_own_layout():
    """k and v are checked as given, (total_tokens, nheads, headdim), before any sequence is
    computed: the attention core sees only one sequence's (1, H, L, D) view, and no view at
    all of v's tokens past cu_seqlens_k[-1]."""
    q, k, v, cq, ck, _ = varlen_inputs()  # q (7, 4, 4), k (7, 2, 4), v (7, 2, 3)

    def call(**change):
        args = dict(q=q, k=k, v=v, cu_seqlens_q=cq, cu_seqlens_k=ck, max_seqlen_q=4, max_seqlen_k=3)
        return C.flash_attn_varlen_func(**{**args, **change})

    with pytest.raises(ValueError, match=r"^k: expected the head width of q = 4 on axis 2, "
                                         r"got shape \(7, 2, 3\)$"):
        call(k=k[..., :3])
    with pytest.raises(ValueError, match=r"^v: expected the tokens of k = 7 on axis 0, "
                                         r"got shape \(8, 2, 3\)$"):
        call(v=np.concatenate([v, v[:1]]))
    with pytest.raises(ValueError, match=r"^v: expected the heads of k = 2 on axis 1, "
                                         r"got shape \(7, 1, 3\)$"):
        call(v=v[:, :1])
    with pytest.raises(ValueError, match=r"^v: expected a headdim \(axis 2\) of at least 1, "
                                         r"got shape \(7, 2, 0\)$"):
        call(v=v[..., :0])
    # heads that do not divide q's, named by the axis read in this layout
    with pytest.raises(ValueError, match=r"^k: expected key/value heads \(axis 1 of \(total_tokens, "
                                         r"nheads, headdim\)\) that divide the query heads \(4, axis 1 "
                                         r"of q\), got 3 in shape \(7, 3, 4\)$"):
        call(k=np.ones((7, 3, 4)), v=np.ones((7, 3, 3)))


def test_flash_attn_varlen_func_lse_dtype_when_no_sequence_has_keys():
    """Sequences whose queries have no key at all: zero output, softmax_lse +inf in float32 for
    float16 inputs (the compute dtype, as when a sequence is computed), S_dmask zero."""
    q, k = np.ones((3, 2, 4), np.float16), np.ones((0, 2, 4), np.float16)
    out, lse, S = C.flash_attn_varlen_func(q, k, k, np.array([0, 1, 3], np.int32),
                                           np.array([0, 0, 0], np.int32), 2, 1, return_attn_probs=True)
    assert (out.shape, out.dtype) == ((3, 2, 4), np.float16) and not out.any()
    assert (lse.shape, lse.dtype) == ((2, 3), np.float32) and np.isposinf(lse).all()
    assert (S.shape, S.dtype) == ((2, 2, 2, 1), np.float16) and not S.any()


@pytest.mark.parametrize("change, exc, match", [
    (dict(q=np.ones((2, 2, 3), np.int64)), TypeError, r"^q: expected a real floating dtype, got int64$"),
    (dict(k=np.ones((2, 2, 3), np.float32)), TypeError,
     r"^k: expected dtype float64 \(that of q\), got float32 \(no silent promotion\)$"),
    (dict(softmax_scale=float("inf")), ValueError, r"^softmax_scale: expected a finite float, got inf$"),
    (dict(dropout_p=7.0), ValueError, r"^dropout_p: expected a drop probability in \[0, 1\), got 7\.0$"),
])
def test_flash_attn_varlen_func_checks_without_any_sequence_to_compute(change, exc, match):
    # sequence 0 has no queries and sequence 1 no keys: nothing is computed, all is checked
    args = dict(q=np.ones((2, 2, 3)), k=np.ones((2, 2, 3)), v=np.ones((2, 2, 3)),
                cu_seqlens_q=np.array([0, 0, 2]), cu_seqlens_k=np.array([0, 2, 2]),
                max_seqlen_q=2, max_seqlen_k=2)
    out = C.flash_attn_varlen_func(**args)
    np.testing.assert_array_equal(out, np.zeros((2, 2, 3)))  # rows with no keys: zeros
    args.update(change)
    with pytest.raises(exc, match=match):
        C.flash_attn_varlen_func(**args)


# --------------------------------------------------------------------------
# flash_attn_with_kvcache


def kvcache_inputs(B=2, Lq=3, Hq=4, Hkv=2, Dh=4, Dv=3, Lc=8, Lnew=2):
    q = randn(B, Lq, Hq, Dh)
    k_cache, v_cache = randn(B + 1, Lc, Hkv, Dh), randn(B + 1, Lc, Hkv, Dv)  # one spare row
    k_new = None if Lnew == 0 else randn(B, Lnew, Hkv, Dh)
    v_new = None if Lnew == 0 else randn(B, Lnew, Hkv, Dv)
    return q, k_cache, v_cache, k_new, v_new


def kvcache_ref(q, k_cache, v_cache, k_new, seqlens, **kw):
    """Attention of batch b over the first seqlens[b] + Lnew keys of the cache after the append."""
    Lnew = 0 if k_new is None else k_new.shape[1]
    outs, lses = [], []
    for b in range(q.shape[0]):
        L = seqlens[b] + Lnew
        o, l_, _ = flash_ref(q[b:b + 1], k_cache[b:b + 1, :L], v_cache[b:b + 1, :L], **kw)
        outs.append(o)
        lses.append(l_)
    return np.concatenate(outs), np.concatenate(lses)


def appended(cache, new, seqlens):
    after = cache.copy()
    for b, s in enumerate(seqlens):
        after[b, s:s + new.shape[1]] = new[b]
    return after


@pytest.mark.parametrize("seqlens, causal, extra", [
    ([2, 5], True, {}),
    ([0, 3], True, dict(softcap=2.0)),  # batch 0: Lk = 2 < Lq = 3, its first row sees nothing
    ([4, 1], False, dict(window_size=(1, 1))),
])
def test_flash_attn_with_kvcache_appends_in_place_then_attends(seqlens, causal, extra):
    q, k_cache, v_cache, k_new, v_new = kvcache_inputs()
    k_before, v_before = k_cache.copy(), v_cache.copy()
    out, lse = C.flash_attn_with_kvcache(q, k_cache, v_cache, k_new, v_new,
                                         cache_seqlens=np.array(seqlens, np.int32), causal=causal,
                                         return_softmax_lse=True, **extra)
    np.testing.assert_array_equal(k_cache, appended(k_before, k_new, seqlens))
    np.testing.assert_array_equal(v_cache, appended(v_before, v_new, seqlens))
    r_out, r_lse = kvcache_ref(q, k_cache, v_cache, k_new, seqlens, causal=causal, **extra)
    np.testing.assert_allclose(out, r_out, rtol=1e-12, atol=1e-12)
    assert lse.shape == (2, 4, 3)
    np.testing.assert_array_equal(np.isposinf(lse), np.isposinf(r_lse))
    fin = np.isfinite(r_lse)
    np.testing.assert_allclose(lse[fin], r_lse[fin], rtol=1e-12)
    if seqlens[0] == 0:
        assert np.isposinf(lse[0, :, 0]).all() and not out[0, 0].any()


def kvcache_visible_keys(p, Lk_b, left, right):
    """The keys a query at key position ``p`` attends among ``Lk_b``, as docs/compat.md states
    flash-attn's rule (a side of -1 unbounded), written as a loop."""
    return [j for j in range(Lk_b)
            if (left < 0 or j >= p - left) and (right < 0 or j <= p + right)]


@pytest.mark.parametrize("seqlens, Lq, Lnew, causal, window_size", [
    ([3, 0, 6], 1, 1, True, (2, -1)),  # one decoding step with a window of 3 keys
    ([3, 0, 5], 2, 2, False, (1, 0)),  # Lq = Lnew: query i at cache_seqlens[b] + i
    ([4, 1, 2], 3, 2, False, (1, 1)),  # Lq != Lnew: query i at cache_seqlens[b] + Lnew - Lq + i
    ([5, 3, 1], 2, 1, False, (0, 2)),  # the right side reaches past the keys: not the free space
    ([2, 6, 0], 3, 0, True, (1, -1)),  # no new keys; batch 2 holds no key at all
    ([0, 2, 5], 4, 1, True, (-1, -1)),  # Lq > Lk_b: the top rows see nothing
])
def test_flash_attn_with_kvcache_window_counts_from_the_cache_after_the_append(
        seqlens, Lq, Lnew, causal, window_size):
    """Batch b's query i stands at key position p = cache_seqlens[b] + Lnew - Lq + i and attends
    the keys j < Lk_b = cache_seqlens[b] + Lnew with p - left <= j <= p + right (causal: right = 0),
    flash-attn's rule (its kernel's actual_seqlen_k). With q = 0 every key scores 0, so the
    weights are uniform over the keys seen; value j is the one-hot e_j (the cache's free space
    and what the append overwrites hold -e_j), so each output row names the keys it saw."""
    B, Lc, Hq, Hkv = 3, 8, 4, 2
    q = np.zeros((B, Lq, Hq, 4))
    k_cache, k_new = randn(B, Lc, Hkv, 4), randn(B, Lnew, Hkv, 4)
    eye = np.eye(Lc)  # [position, Dv = Lc]
    v_cache = -np.repeat(eye[None, :, None, :], Hkv, axis=2).repeat(B, axis=0)  # [B, Lc, Hkv, Lc]
    for b, s in enumerate(seqlens):
        v_cache[b, :s] *= -1.0  # the keys already in the cache: +e_j
    v_new = np.stack([np.repeat(eye[s:s + Lnew, None, :], Hkv, axis=1) for s in seqlens])
    kw = dict(k=k_new, v=v_new) if Lnew else {}
    out, lse = C.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=np.array(seqlens, np.int32),
                                         causal=causal, window_size=window_size,
                                         return_softmax_lse=True, **kw)
    left, right = window_size
    if causal:
        right = 0
    for b, s in enumerate(seqlens):
        Lk_b = s + Lnew
        for i in range(Lq):
            seen = kvcache_visible_keys(s + Lnew - Lq + i, Lk_b, left, right)
            want = np.zeros(Lc)
            want[seen] = 1.0 / max(len(seen), 1)
            for h in range(Hq):
                np.testing.assert_allclose(out[b, i, h], want, rtol=1e-14, atol=1e-15,
                                           err_msg=f"batch {b}, query {i}, head {h}")
            # log-sum-exp of len(seen) scores of 0; +inf (flash-attn's) where nothing is seen
            np.testing.assert_allclose(lse[b, :, i], np.log(len(seen)) if seen else np.inf,
                                       rtol=1e-14)


def test_flash_attn_with_kvcache_without_new_keys_and_int_seqlens():
    q, k_cache, v_cache, _, _ = kvcache_inputs(Lnew=0)
    before = k_cache.copy()
    slopes = RNG.uniform(0.1, 1.0, 4)
    out = C.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=5, alibi_slopes=slopes)
    np.testing.assert_array_equal(k_cache, before)
    r = flash_ref(q, k_cache[:2, :5], v_cache[:2, :5], alibi=slopes)[0]
    np.testing.assert_allclose(out, r, rtol=1e-12, atol=1e-12)
    full = C.flash_attn_with_kvcache(q, k_cache[:2], v_cache[:2])  # no seqlens: the whole cache
    np.testing.assert_allclose(full, flash_ref(q, k_cache[:2], v_cache[:2])[0], rtol=1e-12)
    empty, lse = C.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=0,
                                           return_softmax_lse=True)
    assert not empty.any() and np.isposinf(lse).all()


def test_flash_attn_with_kvcache_alibi_slopes_per_batch_entry():
    """ALiBi slopes of shape (B, Hq): batch b's queries use row b, over its own Lk_b keys."""
    g = np.random.default_rng(15)  # its own numbers: the later tests' draws stay as they were
    q, k_new, v_new = (g.standard_normal(s) for s in ((2, 3, 4, 4), (2, 2, 2, 4), (2, 2, 2, 3)))
    k_cache, v_cache = g.standard_normal((2, 8, 2, 4)), g.standard_normal((2, 8, 2, 3))
    slopes = g.uniform(0.1, 1.0, (2, 4))
    seqlens = [2, 5]
    out = C.flash_attn_with_kvcache(q, k_cache, v_cache, k_new, v_new,
                                    cache_seqlens=np.array(seqlens, np.int32), causal=True,
                                    alibi_slopes=slopes)
    for b, s in enumerate(seqlens):
        L = s + 2  # the cache after the append
        want = flash_ref(q[b:b + 1], k_cache[b:b + 1, :L], v_cache[b:b + 1, :L], causal=True,
                         alibi=slopes[b])[0]
        np.testing.assert_allclose(out[b:b + 1], want, rtol=1e-12, atol=1e-12, err_msg=f"batch {b}")


def test_flash_attn_with_kvcache_writes_into_views_whose_entries_have_their_own_memory():
    """Only an axis of more than one entry with stride 0 makes entries share memory: a cache of
    one batch entry with stride 0 on that axis, or one whose length axis is reversed (a negative
    stride), is appended in place like any other."""
    g = np.random.default_rng(16)
    q, k_new, v_new = (g.standard_normal(s) for s in ((1, 2, 2, 4), (1, 1, 2, 4), (1, 1, 2, 3)))
    k_base, v_base = g.standard_normal((1, 6, 2, 4)), g.standard_normal((1, 6, 2, 3))
    k_cache = np.lib.stride_tricks.as_strided(k_base, k_base.shape, (0,) + k_base.strides[1:],
                                              writeable=True)  # batch axis of one entry: stride 0
    v_cache = v_base[:, ::-1]  # a writable view: position j is v_base's 5 - j
    k_after, v_after = appended(k_cache, k_new, [3]), appended(v_cache, v_new, [3])
    out = C.flash_attn_with_kvcache(q, k_cache, v_cache, k_new, v_new, cache_seqlens=3)
    np.testing.assert_array_equal(k_base, k_after)
    np.testing.assert_array_equal(v_base[:, ::-1], v_after)
    np.testing.assert_allclose(out, flash_ref(q, k_after[:, :4], v_after[:, :4])[0], rtol=1e-12, atol=1e-12)


def test_flash_attn_with_kvcache_gradients_match_finite_differences():
    q, k_cache, v_cache, k_new, v_new = kvcache_inputs()
    seqlens = np.array([2, 4], np.int32)
    kw = dict(cache_seqlens=seqlens, causal=True, window_size=(3, -1), return_softmax_lse=True)

    def f(a, kc, vc, kn, vn):  # a fresh copy of the caches each time: the call writes into them
        return C.flash_attn_with_kvcache(a, kc.copy(), vc.copy(), kn, vn, **kw)

    k0, v0 = k_cache.copy(), v_cache.copy()
    (out, lse), pullback = C.vjp(C.flash_attn_with_kvcache, q, k_cache, v_cache, k_new, v_new, **kw)
    ct, ct_lse = randn(*out.shape), randn(*lse.shape)
    grads = pullback(ct, dlse=ct_lse)
    assert len(grads) == 5
    check_vjp(f, [q, k0, v0, k_new, v_new], grads, ct, ct_lse=ct_lse)
    # what was overwritten, never read, or in the spare row has no gradient
    for b, s in enumerate(seqlens):
        assert not grads[1][b, s:].any() and not grads[2][b, s:].any()
    assert not grads[1][2].any()


def test_flash_attn_with_kvcache_pullback_outlives_a_later_write_into_the_cache():
    """The forward keeps its own copy of the keys and values it read: a later call that
    writes over the same cache rows (here from position 0) leaves the first call's output
    and gradients as they were."""
    q, k_cache, v_cache, k_new, v_new = kvcache_inputs()
    kw = dict(cache_seqlens=np.array([2, 4], np.int32), causal=True)
    out, pullback = C.vjp(C.flash_attn_with_kvcache, q, k_cache, v_cache, k_new, v_new, **kw)
    ct = randn(*out.shape)
    before = pullback(ct)
    out0 = out.copy()
    C.flash_attn_with_kvcache(q, k_cache, v_cache, 10.0 * randn(*k_new.shape),
                              10.0 * randn(*v_new.shape), cache_seqlens=0)
    np.testing.assert_array_equal(out, out0)
    for g0, g1 in zip(before, pullback(ct)):
        np.testing.assert_array_equal(g1, g0)


@pytest.mark.parametrize("name", ["rotary_cos", "rotary_sin", "cache_batch_idx", "cache_leftpad",
                                  "block_table"])
def test_flash_attn_with_kvcache_unimplemented_options_say_so(name):
    q, k_cache, v_cache, k_new, v_new = kvcache_inputs()
    before = k_cache.copy()
    with pytest.raises(NotImplementedError, match=f"^{name}: .* not implemented"):
        C.flash_attn_with_kvcache(q, k_cache, v_cache, k_new, v_new, cache_seqlens=1,
                                  **{name: np.zeros(2, np.int32)})
    np.testing.assert_array_equal(k_cache, before)


# flash-attn's own reference for flash_attn_with_kvcache, transcribed to NumPy from its
# tests/test_flash_attn.py (construct_local_mask, attn_bias_from_alibi_slopes, attention_ref with
# upcast off, and test_flash_attn_kvcache's key_padding_mask and apply_rotary_emb offsets)


def fa_local_mask(Lq, Lk, window_size, key_padding_mask):
    """construct_local_mask: True where query row i may not attend key column j."""
    row, col = np.arange(Lq)[:, None], np.arange(Lk)
    sk = key_padding_mask.sum(-1)[:, None, None, None]  # "b -> b 1 1 1"
    if window_size[0] < 0:
        return col > row + sk - Lq + window_size[1]
    return np.logical_or(col > np.minimum(row + sk - Lq + window_size[1], sk),
                         col < row + sk - Lq - window_size[0])


def fa_alibi_bias(slopes, Lq, Lk, key_padding_mask, causal):
    """attn_bias_from_alibi_slopes, slopes (b, h)."""
    slopes = slopes[:, :, None, None]
    if causal:
        return np.arange(-Lk + 1, 1, dtype=np.float64) * slopes
    row, col = np.arange(Lq)[:, None], np.arange(Lk)
    sk = key_padding_mask.sum(-1)[:, None, None, None]
    return -slopes * np.abs(row + sk - Lq - col)


def fa_attention_ref(q, k, v, key_padding_mask, attn_bias=None, causal=False, window_size=(-1, -1),
                     softcap=0.0):
    """attention_ref on (b, s, h, d); also the log-sum-exp of each row's masked scores."""
    if causal:
        window_size = (window_size[0], 0)
    Lq, Lk, g = q.shape[1], k.shape[1], q.shape[2] // k.shape[2]
    k, v = np.repeat(k, g, axis=2), np.repeat(v, g, axis=2)  # "b s h d -> b s (h g) d"
    scores = np.einsum("bthd,bshd->bhts", q / math.sqrt(q.shape[-1]), k)
    if softcap > 0:
        scores = np.tanh(scores / softcap) * softcap
    scores = np.where(key_padding_mask[:, None, None, :], scores, -np.inf)
    local = None
    if window_size[0] >= 0 or window_size[1] >= 0:
        local = fa_local_mask(Lq, Lk, window_size, key_padding_mask)
        scores = np.where(local, -np.inf, scores)
    if attn_bias is not None:
        scores = scores + attn_bias
    with np.errstate(invalid="ignore"):  # a row with nothing to attend: NaN, then zeros
        top = scores.max(-1, keepdims=True)
        e = np.exp(scores - top)
        attention = e / e.sum(-1, keepdims=True)
        lse = np.where(np.isneginf(top), -np.inf, top + np.log(e.sum(-1, keepdims=True)))[..., 0]
    if local is not None:
        attention = np.where(np.all(local, axis=-1, keepdims=True), 0.0, attention)
    return np.einsum("bhts,bshd->bthd", attention, v), lse


def fa_rotate_half(x, interleaved):
    if not interleaved:
        x1, x2 = np.split(x, 2, axis=-1)
        return np.concatenate([-x2, x1], axis=-1)
    x1, x2 = x[..., ::2], x[..., 1::2]
    return np.stack([-x2, x1], axis=-1).reshape(x.shape)  # "... d two -> ... (d two)"


def fa_apply_rotary_emb(x, cos, sin, seqlen_offsets, interleaved):
    """apply_rotary_emb on x (b, s, h, d): position seqlen_offsets[b] + s reads row of cos, sin."""
    rows = seqlen_offsets[:, None] + np.arange(x.shape[1])  # [b, s]
    c, si = cos[rows], sin[rows]  # [b, s, d/2]
    if interleaved:
        c, si = np.repeat(c, 2, axis=-1), np.repeat(si, 2, axis=-1)  # "... d -> ... 1 (d 2)"
    else:
        c, si = np.concatenate([c, c], axis=-1), np.concatenate([si, si], axis=-1)  # "(2 d)"
    return x * c[:, :, None] + fa_rotate_half(x, interleaved) * si[:, :, None]


@st.composite
def kvcache_cases(draw):
    Hkv, B, Lc = draw(st.sampled_from([1, 2])), draw(st.integers(1, 3)), draw(st.integers(1, 6))
    Lnew = draw(st.integers(0, min(3, Lc)))
    seqlens = draw(st.lists(st.integers(0 if Lnew else 1, Lc - Lnew), min_size=B, max_size=B))
    local = draw(st.booleans())  # flash-attn's test: (-1, -1), or both sides drawn >= 0
    return dict(
        Hkv=Hkv, Hq=Hkv * draw(st.sampled_from([1, 2])), B=B, Bc=B + draw(st.integers(0, 2)), Lc=Lc,
        Lnew=Lnew, seqlens=seqlens,
        Lq=Lnew if Lnew and draw(st.booleans()) else draw(st.integers(1, Lc + 1)),  # (Lq <= Lc + 1)
        causal=draw(st.booleans()),
        window=(draw(st.integers(0, 4)), draw(st.integers(0, 4))) if local else (-1, -1),
        softcap=draw(st.sampled_from([0.0, 0.8])), alibi=draw(st.sampled_from([None, "H", "BH"])),
        seed=draw(st.integers(0, 2**16)),
    )


@given(c=kvcache_cases())
def test_flash_attn_with_kvcache_equals_flash_attns_own_reference(c):
    """flash-attn's test_flash_attn_kvcache, in float64: the cache after the append and the
    output equal attention_ref over the whole cache with key_padding_mask = arange(Lc) <
    cache_seqlens + Lnew (and the ALiBi bias, the window and the softcap of that test), for
    ragged lengths, GQA, spare cache rows and more queries than new keys; softmax_lse is the
    log-sum-exp of each row's scores (+inf for a row with nothing to attend)."""
    rng = np.random.default_rng(c["seed"])
    B, Bc, Lq, Hq, Hkv, Lc, Lnew, Dh = c["B"], c["Bc"], c["Lq"], c["Hq"], c["Hkv"], c["Lc"], c["Lnew"], 3
    seqlens = np.array(c["seqlens"], dtype=np.int32)
    q = rng.standard_normal((B, Lq, Hq, Dh))
    k_cache, v_cache = rng.standard_normal((Bc, Lc, Hkv, Dh)), rng.standard_normal((Bc, Lc, Hkv, Dh))
    k_new = v_new = None
    if Lnew:
        k_new, v_new = rng.standard_normal((B, Lnew, Hkv, Dh)), rng.standard_normal((B, Lnew, Hkv, Dh))
    slopes = {None: None, "H": rng.uniform(0.1, 1.0, Hq), "BH": rng.uniform(0.1, 1.0, (B, Hq))}[c["alibi"]]
    k_ref, v_ref = k_cache[:B].copy(), v_cache[:B].copy()  # k_cache_ref: the cache after the append
    for b, s in enumerate(seqlens):
        if Lnew:
            k_ref[b, s:s + Lnew], v_ref[b, s:s + Lnew] = k_new[b], v_new[b]
    key_padding_mask = np.arange(Lc)[None] < (seqlens + Lnew)[:, None]  # [B, Lc]
    bias = None
    if slopes is not None:
        bias = fa_alibi_bias(np.broadcast_to(slopes, (B, Hq)), Lq, Lc, key_padding_mask, c["causal"])
    want, want_lse = fa_attention_ref(q, k_ref, v_ref, key_padding_mask, bias, c["causal"], c["window"],
                                      c["softcap"])
    spare = k_cache[B:].copy()
    out, lse = C.flash_attn_with_kvcache(q, k_cache, v_cache, k_new, v_new, cache_seqlens=seqlens,
                                         causal=c["causal"], window_size=c["window"], softcap=c["softcap"],
                                         alibi_slopes=slopes, return_softmax_lse=True)
    np.testing.assert_array_equal(k_cache[:B], k_ref)
    np.testing.assert_array_equal(v_cache[:B], v_ref)
    np.testing.assert_array_equal(k_cache[B:], spare)
    np.testing.assert_allclose(out, want, rtol=1e-12, atol=1e-12)
    if slopes is None:  # (the reference's causal ALiBi bias is its own shifted by a constant per row)
        np.testing.assert_allclose(lse, np.where(np.isneginf(want_lse), np.inf, want_lse), rtol=1e-12,
                                   atol=1e-12)


@given(B=st.integers(1, 3), Lc=st.integers(2, 7), data=st.data(), causal=st.booleans(),
       interleaved=st.booleans(), seed=st.integers(0, 2**16))
def test_rope_at_each_entrys_length_then_kvcache_equals_flash_attns_rotary_reference(
        B, Lc, data, causal, interleaved, seed):
    """flash_attn_with_kvcache takes no rotary_cos/sin; rope_forward with each entry's positions
    does what they do. flash-attn's test rotates the new keys, and the queries when causal, at
    cache_seqlens[b] + s, and every query at cache_seqlens[b] otherwise, reading the rows of a
    cos/sin table; with the table of angles p * 10000^(-2c/Dh), rope_forward at those positions
    then flash_attn_with_kvcache equals its attention_ref of the rotated inputs."""
    Lnew = data.draw(st.integers(1, min(3, Lc)), label="Lnew")
    seqlens = np.array(data.draw(st.lists(st.integers(0, Lc - Lnew), min_size=B, max_size=B), label="seqlens"))
    rng = np.random.default_rng(seed)
    H, Dh = 2, 4
    q, k_new, v_new = (rng.standard_normal((B, Lnew, H, Dh)) for _ in range(3))
    k_cache, v_cache = rng.standard_normal((B, Lc, H, Dh)), rng.standard_normal((B, Lc, H, Dh))
    angle = np.arange(Lc)[:, None] * 10000.0 ** (-np.arange(0, Dh, 2) / Dh)  # [Lc, Dh/2]
    cos, sin = np.cos(angle), np.sin(angle)
    if causal:
        q_ro = fa_apply_rotary_emb(q, cos, sin, seqlens, interleaved)
    else:  # "b s h d -> b 1 (s h) d": every query at cache_seqlens[b]
        q_ro = fa_apply_rotary_emb(q.reshape(B, 1, Lnew * H, Dh), cos, sin, seqlens, interleaved)
        q_ro = q_ro.reshape(B, Lnew, H, Dh)
    k_ro = fa_apply_rotary_emb(k_new, cos, sin, seqlens, interleaved)
    k_ref, v_ref = k_cache.copy(), v_cache.copy()
    for b, s in enumerate(seqlens):
        k_ref[b, s:s + Lnew], v_ref[b, s:s + Lnew] = k_ro[b], v_new[b]
    key_padding_mask = np.arange(Lc)[None] < (seqlens + Lnew)[:, None]
    want, _ = fa_attention_ref(q_ro, k_ref, v_ref, key_padding_mask, causal=causal)

    def rotated(x, positions):  # (B, L, H, Dh) -> rope on (B, H, L, Dh) -> (B, L, H, Dh)
        out, _ = P.rope_forward(x.transpose(0, 2, 1, 3), positions, interleaved=interleaved)
        return np.ascontiguousarray(out.transpose(0, 2, 1, 3))

    steps = np.arange(Lnew) if causal else np.zeros(Lnew, dtype=np.int64)
    q_pos, k_pos = seqlens[:, None, None] + steps, seqlens[:, None, None] + np.arange(Lnew)  # [B, 1, Lnew]
    out = C.flash_attn_with_kvcache(rotated(q, q_pos), k_cache, v_cache, rotated(k_new, k_pos), v_new,
                                    cache_seqlens=seqlens, causal=causal)
    np.testing.assert_allclose(k_cache, k_ref, rtol=1e-13, atol=1e-13)
    np.testing.assert_allclose(out, want, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("change, exc, match", [
    (dict(cache_seqlens=np.array([2, 7], np.int32)), ValueError,
     r"^cache_seqlens: expected 0 <= cache_seqlens\[b\] <= Lc - Lnew = 8 - 2, got \[2, 7\]$"),
    # a negative count would write before the cache's start (NumPy wraps the slice)
    (dict(cache_seqlens=np.array([-1, 3], np.int32)), ValueError,
     r"^cache_seqlens: expected 0 <= cache_seqlens\[b\] <= Lc - Lnew = 8 - 2, got \[-1, 3\]$"),
    (dict(cache_seqlens=np.array([2], np.int32)), ValueError,
     r"^cache_seqlens: expected B = 2 entries \(the batch of q\), got 1$"),
    # a count per batch entry: one more is refused, not ignored
    (dict(cache_seqlens=np.array([2, 3, 1], np.int32)), ValueError,
     r"^cache_seqlens: expected B = 2 entries \(the batch of q\), got 3$"),
    (dict(cache_seqlens=None), ValueError,
     r"^cache_seqlens: expected the cache's lengths with k and v \(where to write them\), got None$"),
    (dict(v=None), ValueError, r"^k: expected k and v together \(new keys and values\), got only k$"),
    (dict(k=None), ValueError, r"^v: expected k and v together \(new keys and values\), got only v$"),
    (dict(k=np.zeros((2, 2, 2, 5))), ValueError,
     r"^k: expected the head width of q = 4 on axis 3, got shape \(2, 2, 2, 5\)$"),
    (dict(k_cache=np.zeros((1, 8, 2, 4))), ValueError,
     r"^k_cache: expected at least the batch of q, 2, on axis 0, got shape \(1, 8, 2, 4\)$"),
    (dict(k=np.zeros((2, 2, 2, 4), np.float32)), TypeError,
     r"^k: expected the dtype of q, float64, got float32 \(no silent promotion\)$"),
    # an integer q is q's error (it was blamed on k_cache: "expected the dtype of q, int64")
    (dict(q=np.zeros((2, 3, 4, 4), np.int64)), TypeError, r"^q: expected a real floating dtype, got int64$"),
    # no queries: named in flash's layout (batch, seqlen, nheads, headdim), before the append
    (dict(q=np.zeros((2, 0, 4, 4))), ValueError, r"^q: expected a seqlen \(axis 1\) of at least 1, "
                                                 r"got shape \(2, 0, 4, 4\)$"),
    # a value width of 0, refused as flash_attn_func's headdim of 0 (it gave an empty output)
    (dict(v_cache="no width"), ValueError, r"^v_cache: expected a headdim \(axis 3\) of at least 1, "
                                          r"got shape \(3, 8, 2, 0\)$"),
    (dict(window_size=(-1, -1, 0)), TypeError,
     r"^window_size: expected a pair \(left, right\) of ints, -1 for an unbounded side, "
     r"got tuple \(-1, -1, 0\)$"),
    # checked by the dispatcher: before the append, not after it
    (dict(alibi_slopes=np.ones(5)), ValueError,
     r"^alibi_slopes: expected shape \(4,\) or \(2, 4\) \(nheads of q, or batch and nheads\), got \(5,\)$"),
    # slopes per cache row (Bc = 3) rather than per batch entry of q (B = 2)
    (dict(alibi_slopes=np.ones((3, 4))), ValueError,
     r"^alibi_slopes: expected the batch of q = 2 on axis 0, got shape \(3, 4\)$"),
    (dict(softmax_scale=float("nan")), ValueError, r"^softmax_scale: expected a finite float, got nan$"),
    (dict(softmax_scale="x"), TypeError, r"^softmax_scale: expected None or a float, got str 'x'$"),
    (dict(num_splits="x"), TypeError, r"^num_splits: expected an int >= 0, got str 'x'$"),
    (dict(rotary_interleaved="x"), TypeError, r"^rotary_interleaved: expected a bool, got str 'x'$"),
    (dict(v_cache="read-only"), TypeError,
     r"^v_cache: expected an array that can be written in place \(.*\), got a read-only numpy\.ndarray$"),
    # the arrays themselves: checked before the append, not by the attention after it
    (dict(q="masked"), TypeError, r"^q: expected a plain numpy.ndarray, got numpy.ma.MaskedArray"),
    (dict(v="masked"), TypeError, r"^v: expected a plain numpy.ndarray, got numpy.ma.MaskedArray"),
    # a writable view whose batch entries share memory: entry 1's append would land in entry 0's
    (dict(v_cache="expanded"), TypeError, r"^v_cache: expected an array whose entries have memory "
                                          r"of their own .* strides \(0, "),
    # the caches' heads (none, or not dividing q's), named k_cache, the cache's own name
    (dict(k_cache=np.zeros((3, 8, 3, 4)), v_cache=np.zeros((3, 8, 3, 3))), ValueError,
     r"^k_cache: expected key/value heads \(axis 2 of \(batch_cache, seqlen_cache, nheads_k, headdim\)\) "
     r"that divide the query heads \(4, axis 2 of q\), got 3 in shape \(3, 8, 3, 4\)$"),
    (dict(k_cache=np.zeros((3, 8, 0, 4)), v_cache=np.zeros((3, 8, 0, 3))), ValueError,
     r"^k_cache: expected key/value heads \(axis 2 of \(batch_cache, seqlen_cache, nheads_k, headdim\)\) "
     r"that divide the query heads \(4, axis 2 of q\), got 0 in shape \(3, 8, 0, 4\)$"),
    # every shape against the one it must match, before the append writes into either cache
    (dict(k_cache=np.zeros((3, 8, 2, 5))), ValueError,
     r"^k_cache: expected the head width of q = 4 on axis 3, got shape \(3, 8, 2, 5\)$"),
    (dict(v_cache=np.zeros((2, 8, 2, 3))), ValueError,
     r"^v_cache: expected the batch of k_cache = 3 on axis 0, got shape \(2, 8, 2, 3\)$"),
    (dict(v_cache=np.zeros((3, 7, 2, 3))), ValueError,
     r"^v_cache: expected the length of k_cache = 8 on axis 1, got shape \(3, 7, 2, 3\)$"),
    (dict(k=np.zeros((3, 2, 2, 4))), ValueError,
     r"^k: expected the batch of q = 2 on axis 0, got shape \(3, 2, 2, 4\)$"),
    # fewer heads than the cache: refused, not broadcast into every head of it
    (dict(k=np.zeros((2, 2, 1, 4))), ValueError,
     r"^k: expected the heads of k_cache = 2 on axis 2, got shape \(2, 2, 1, 4\)$"),
    (dict(v=np.zeros((2, 2, 1, 3))), ValueError,
     r"^v: expected the heads of k_cache = 2 on axis 2, got shape \(2, 2, 1, 3\)$"),
    (dict(v=np.zeros((2, 1, 2, 3))), ValueError,
     r"^v: expected the new length of k = 2 on axis 1, got shape \(2, 1, 2, 3\)$"),
    (dict(v=np.zeros((2, 2, 2, 4))), ValueError,
     r"^v: expected the value width of v_cache = 3 on axis 3, got shape \(2, 2, 2, 4\)$"),
    (dict(v=np.zeros((2, 2, 2, 3), np.float32)), TypeError,
     r"^v: expected the dtype of q, float64, got float32 \(no silent promotion\)$"),
    (dict(return_softmax_lse="yes"), TypeError, r"^return_softmax_lse: expected a bool, got str 'yes'$"),
    # 2.5 keys is no position to write at: refused, not rounded
    (dict(cache_seqlens=[2.5, 3]), TypeError,
     r"^cache_seqlens: expected keys in the cache per batch entry \(B,\) as ints, got \[2\.5, 3\]$"),
])
def test_flash_attn_with_kvcache_bad_input_leaves_the_cache_alone(change, exc, match):
    q, k_cache, v_cache, k_new, v_new = kvcache_inputs()
    special = change.get("v_cache") if isinstance(change.get("v_cache"), str) else None
    if special == "read-only":
        v_cache.flags.writeable = False
        change = {}
    if special == "expanded":
        v_cache = np.lib.stride_tricks.as_strided(v_cache[:1], v_cache.shape,
                                                  (0,) + v_cache.strides[1:], writeable=True)
        change = {}
    if special == "no width":
        v_cache, v_new = v_cache[..., :0], v_new[..., :0]
        change = {}
    for name in ("q", "v"):
        if isinstance(change.get(name), str) and change[name] == "masked":
            change = {name: np.ma.masked_array(dict(q=q, v=v_new)[name])}
    args = dict(q=q, k_cache=k_cache, v_cache=v_cache, k=k_new, v=v_new,
                cache_seqlens=np.array([2, 3], np.int32))
    args.update(change)
    before = k_cache.copy(), v_cache.copy()
    with pytest.raises(exc, match=match):
        C.flash_attn_with_kvcache(**args)
    np.testing.assert_array_equal(k_cache, before[0])
    np.testing.assert_array_equal(v_cache, before[1])


def test_flash_attn_with_kvcache_on_torch_refuses_before_writing():
    """A leaf that requires grad (torch refuses in-place writes into it) or an expanded cache:
    a TypeError before either cache is written. (k_cache was written, then v_cache failed; an
    expanded v_cache was written through, entry 1's values landing in entry 0's.)"""
    torch = pytest.importorskip("torch")
    q, k_cache, v_cache, k_new, v_new = (torch.from_numpy(t) for t in kvcache_inputs())
    grad_leaf = v_cache.clone().requires_grad_(True)
    expanded = v_cache[:1].clone().expand(*v_cache.shape)
    for bad, match in ((grad_leaf, r"^v_cache: expected an array that can be written in place"),
                       (expanded, r"^v_cache: expected an array whose entries have memory of their own")):
        before = k_cache.clone()
        with pytest.raises(TypeError, match=match):
            C.flash_attn_with_kvcache(q, k_cache, bad, k_new, v_new, cache_seqlens=1)
        assert torch.equal(k_cache, before)


@pytest.mark.parametrize("lib", ["numpy", "torch"])
def test_flash_attn_with_kvcache_new_keys_read_from_the_caches_are_taken_as_they_were(lib):
    """k a view of k_cache overlapping the positions it is written to, v a view of those very
    positions: the call equals one with copies of k and v, the caches included. torch refused
    the overlapping write as a cache that cannot be written in place; NumPy read v after the
    keys had been written over it."""
    conv = (lambda t: t) if lib == "numpy" else pytest.importorskip("torch").from_numpy
    q, k_cache, v_cache, _, _ = kvcache_inputs(Dv=4)
    want_kc, want_vc = k_cache.copy(), v_cache.copy()
    want = C.flash_attn_with_kvcache(q, want_kc, want_vc, k_cache[:2, 1:3].copy(),
                                     k_cache[:2, 2:4].copy(), cache_seqlens=2)
    q, k_cache, v_cache = conv(q), conv(k_cache), conv(v_cache)
    out = C.flash_attn_with_kvcache(q, k_cache, v_cache, k_cache[:2, 1:3], k_cache[:2, 2:4], cache_seqlens=2)
    np.testing.assert_array_equal(np.asarray(k_cache), want_kc)
    np.testing.assert_array_equal(np.asarray(v_cache), want_vc)
    np.testing.assert_allclose(np.asarray(out), want, rtol=1e-12, atol=1e-12)


def test_flash_attn_with_kvcache_refuses_one_buffer_for_keys_and_values():
    """k_cache and v_cache sharing memory: the values were written over the new keys and the
    call attended values as keys. A ValueError naming v_cache, before anything is written."""
    q, k_cache, _, k_new, v_new = kvcache_inputs(Dv=4)
    before = k_cache.copy()
    for v_cache in (k_cache, k_cache[:, :, ::-1]):
        with pytest.raises(ValueError, match=r"^v_cache: expected a buffer apart from k_cache \(the new "
                                             r"keys and values are written into each\), got one sharing"):
            C.flash_attn_with_kvcache(q, k_cache, v_cache, k_new, v_new, cache_seqlens=1)
        np.testing.assert_array_equal(k_cache, before)
    # without new keys nothing is written: one buffer for both is a cache whose keys are its values
    out = C.flash_attn_with_kvcache(q, k_cache, k_cache, cache_seqlens=4)
    want = C.flash_attn_with_kvcache(q, k_cache, k_cache.copy(), cache_seqlens=4)
    np.testing.assert_array_equal(out, want)


def test_flash_attn_with_kvcache_on_torch_takes_the_halves_of_one_key_value_buffer():
    """k_cache and v_cache the two halves kv[0], kv[1] of one torch buffer (a packed cache): one
    storage, no byte in common. The call appends and attends as with two buffers, as it does on
    NumPy; comparing storages refused it as caches sharing memory. Two tensors of two storages
    over overlapping bytes (torch.from_numpy of overlapping NumPy views) do share memory, and
    are refused before anything is written."""
    torch = pytest.importorskip("torch")
    q, k_cache, v_cache, k_new, v_new = kvcache_inputs(Dv=4)
    seqlens = [1, 3]
    kv = torch.from_numpy(np.stack([k_cache, v_cache]))  # [2, B + 1, Lc, Hkv, Dh]
    t = torch.from_numpy
    out = C.flash_attn_with_kvcache(t(q), kv[0], kv[1], t(k_new), t(v_new),
                                    cache_seqlens=np.array(seqlens), causal=True)
    want_k, want_v = appended(k_cache, k_new, seqlens), appended(v_cache, v_new, seqlens)
    np.testing.assert_array_equal(kv[0].numpy(), want_k)
    np.testing.assert_array_equal(kv[1].numpy(), want_v)
    want, _ = kvcache_ref(q, want_k, want_v, k_new, seqlens, causal=True)
    np.testing.assert_allclose(out.numpy(), want, rtol=1e-12, atol=1e-12)
    # two storages, overlapping bytes: v_cache starts one row of batch entry 0 into k_cache
    flat = np.stack([k_cache, k_cache]).reshape(-1)
    n, row = k_cache.size, k_cache[0, 0].size
    kc, vc = t(flat[:n]).reshape(k_cache.shape), t(flat[row:row + n]).reshape(k_cache.shape)
    before = flat.copy()
    with pytest.raises(ValueError, match=r"^v_cache: expected a buffer apart from k_cache"):
        C.flash_attn_with_kvcache(t(q), kc, vc, t(k_new), t(k_new), cache_seqlens=np.array(seqlens))
    np.testing.assert_array_equal(flat, before)


@pytest.mark.parametrize("lib", ["numpy", "torch", "array_api_strict"])
def test_flash_attn_with_kvcache_takes_the_keys_and_values_of_flash_attns_packed_cache(lib):
    """flash-attn's packed cache kv of shape (B, Lc, 2, Hkv, Dh): k_cache = kv[:, :, 0] and
    v_cache = kv[:, :, 1] interleave, each spanning the other's bytes without sharing one. The
    call appends and attends as kvcache_ref says, as it did before caches sharing memory were
    refused; a test of bounds alone refused it (array_api_strict's arrays included, whose host
    memory is compared through DLPack)."""
    conv = {"numpy": lambda a: a, "torch": lambda a: pytest.importorskip("torch").from_numpy(a),
            "array_api_strict": lambda a: pytest.importorskip("array_api_strict").asarray(a)}[lib]
    q, k_cache, v_cache, k_new, v_new = kvcache_inputs(Dv=4)
    seqlens = [2, 0]
    kv = conv(np.stack([k_cache, v_cache], axis=2))  # [B + 1, Lc, 2, Hkv, Dh]
    out = C.flash_attn_with_kvcache(conv(q), kv[:, :, 0, ...], kv[:, :, 1, ...], conv(k_new), conv(v_new),
                                    cache_seqlens=np.array(seqlens), causal=True)
    want_k, want_v = appended(k_cache, k_new, seqlens), appended(v_cache, v_new, seqlens)
    np.testing.assert_array_equal(np.from_dlpack(kv[:, :, 0, ...]), want_k)
    np.testing.assert_array_equal(np.from_dlpack(kv[:, :, 1, ...]), want_v)
    want, _ = kvcache_ref(q, want_k, want_v, k_new, seqlens, causal=True)
    np.testing.assert_allclose(np.from_dlpack(out), want, rtol=1e-12, atol=1e-12)


def test_flash_attn_with_kvcache_on_torch_meta_caches_share_no_memory():
    """torch's meta tensors have no memory: two meta caches are two buffers, and a call with
    new keys gives the output's shape and device (all their data pointers are 0, so comparing
    addresses called them one buffer and refused the call)."""
    torch = pytest.importorskip("torch")
    kw = dict(device="meta", dtype=torch.float64)
    q, k_cache = torch.empty(2, 3, 4, 4, **kw), torch.empty(3, 8, 2, 4, **kw)
    v_cache = torch.empty(3, 8, 2, 5, **kw)
    k_new, v_new = torch.empty(2, 2, 2, 4, **kw), torch.empty(2, 2, 2, 5, **kw)
    out = C.flash_attn_with_kvcache(q, k_cache, v_cache, k_new, v_new, cache_seqlens=np.array([1, 3]))
    assert out.shape == (2, 3, 4, 5) and out.device.type == "meta"


@pytest.mark.parametrize("lib", ["numpy", "torch"])
def test_flash_attn_with_kvcache_new_keys_read_from_the_value_cache_are_taken_as_they_were(lib):
    """k a view of the memory v_cache lies in, batch entry 1 of k over the positions batch
    entry 0's values are written to (v_cache = buf[1:], k = buf[:2, 1:3]): the keys of entry 1
    are written after the values of entry 0, so k must be read first. The call equals one with
    a copy of k, caches included; copying only what shares memory with k_cache was not enough."""
    conv = (lambda t: t) if lib == "numpy" else pytest.importorskip("torch").from_numpy
    q, k_cache, _, _, v_new = kvcache_inputs(Dv=4)
    buf = randn(1 + k_cache.shape[0], *k_cache.shape[1:])  # [B + 2, Lc, Hkv, Dv]
    want_kc, want_buf = k_cache.copy(), buf.copy()
    want = C.flash_attn_with_kvcache(q, want_kc, want_buf[1:], buf[:2, 1:3].copy(), v_new, cache_seqlens=2)
    q, k_cache, buf, v_new = conv(q), conv(k_cache), conv(buf), conv(v_new)
    out = C.flash_attn_with_kvcache(q, k_cache, buf[1:], buf[:2, 1:3], v_new, cache_seqlens=2)
    np.testing.assert_array_equal(np.asarray(k_cache), want_kc)
    np.testing.assert_array_equal(np.asarray(buf), want_buf)
    np.testing.assert_allclose(np.asarray(out), want, rtol=1e-12, atol=1e-12)


def test_flash_attn_with_kvcache_refuses_one_dask_array_for_keys_and_values():
    """One dask array as both k_cache and v_cache, with new keys: a dask array exports no memory
    to compare, so one object is one buffer, and the values would replace the new keys. A
    ValueError naming v_cache, the cache's entries as they were; a test that called two dask
    arrays apart whatever they were let it through."""
    da = pytest.importorskip("dask.array")
    q, k_cache, _, k_new, v_new = kvcache_inputs(Dv=4)
    kc = da.from_array(k_cache.copy(), chunks=2)
    with pytest.raises(ValueError, match=r"^v_cache: expected a buffer apart from k_cache"):
        C.flash_attn_with_kvcache(da.from_array(q), kc, kc, da.from_array(k_new), da.from_array(v_new),
                                  cache_seqlens=1)
    np.testing.assert_array_equal(np.asarray(kc), k_cache)


def test_flash_attn_with_kvcache_on_torch_bfloat16_takes_flash_attns_packed_cache():
    """flash-attn's packed cache (B, Lc, 2, Hkv, Dh) in bfloat16, whose host memory NumPy has no
    dtype for: its interleaved halves share no byte, and the call appends and attends as it does
    into two buffers (the new entries land bit for bit; the outputs are equal)."""
    torch = pytest.importorskip("torch")
    q, k_cache, v_cache, k_new, v_new = kvcache_inputs(Dv=4)
    seqlens = np.array([2, 0])

    def bf(a):
        return torch.from_numpy(a).to(torch.bfloat16)

    kv = torch.stack([bf(k_cache), bf(v_cache)], dim=2)  # [B + 1, Lc, 2, Hkv, Dh]
    kc, vc = kv[:, :, 0].clone(), kv[:, :, 1].clone()  # two buffers of the same entries
    want = C.flash_attn_with_kvcache(bf(q), kc, vc, bf(k_new), bf(v_new), cache_seqlens=seqlens, causal=True)
    out = C.flash_attn_with_kvcache(bf(q), kv[:, :, 0], kv[:, :, 1], bf(k_new), bf(v_new),
                                    cache_seqlens=seqlens, causal=True)
    as_np = (lambda t: t.to(torch.float32).numpy())
    np.testing.assert_array_equal(as_np(kv[:, :, 0]), appended(as_np(bf(k_cache)), as_np(bf(k_new)), seqlens))
    np.testing.assert_array_equal(as_np(kv[:, :, 1]), appended(as_np(bf(v_cache)), as_np(bf(v_new)), seqlens))
    assert torch.equal(out, want)


def test_may_share_memory_of_memory_not_exported_is_true():
    """An array whose library will not export its memory (NumPy before 2.1 refuses a read-only
    view, as array_api_strict's broadcast_to gives, with a BufferError) may share it: the
    writers then copy it. Taking it for memory apart wrote a KV cache's new values into the
    new keys broadcast from its value buffer (array_api_strict 2.5 with NumPy 2.0). Arrays
    with no memory at all (dask's) are one buffer only when they are one object."""
    from npattn.backend import may_share_memory, shares_memory

    class Unexported:
        def __dlpack_device__(self):
            return (1, 0)  # the CPU

        def __dlpack__(self, **kwargs):
            raise BufferError("Cannot export readonly array since signalling readonly is unsupported")

    x, y = Unexported(), np.zeros(3)
    assert may_share_memory(x, y) and may_share_memory(y, x) and shares_memory(x, y)
    da = pytest.importorskip("dask.array")
    a, b = da.zeros(3), da.zeros(3)
    assert may_share_memory(a, a) and not may_share_memory(a, b)


def test_may_share_memory_on_torch_compares_the_bytes_each_tensor_spans():
    """backend.may_share_memory on views of one torch buffer is NumPy's bounds test on the same
    views: views whose spans meet in one element share memory, views side by side (a key-value
    buffer's halves) do not, and neither does an empty view; shares_memory is NumPy's exact test.
    On a GPU the refusal of caches that share memory rests on the bounds alone, so a bound off
    by one element or one byte refused a packed cache's halves there or missed an overlap."""
    torch = pytest.importorskip("torch")
    from npattn.backend import may_share_memory, shares_memory

    t = torch.arange(24, dtype=torch.float64)
    m = t.reshape(4, 6)
    cases = [  # (a, b, spans meet, a byte in common), counted on the elements each view covers
        (t[0:2], t[1:3], True, True),  # element 1
        (t[0:2], t[2:4], False, False),  # side by side
        (t[:12], t[12:], False, False),  # the halves
        (m[:, :2], m[3, 1:], True, True),  # element 19
        (m[:, :2], m[:, 2:], True, False),  # interleaved: the spans [0, 20) and [2, 24) meet
        (t[5:5], t, False, False),  # an empty view
        (t[23:], t[:23], False, False),
        (t.view(torch.int32)[3:5], t[2:3], True, True),  # bytes 12 to 20 and 16 to 24
    ]
    for i, (a, b, meet, common) in enumerate(cases):
        for x, y in ((a, b), (b, a)):
            assert may_share_memory(x, y) is meet, i
            assert may_share_memory(x, y) == np.may_share_memory(x.numpy(), y.numpy()), i
            assert shares_memory(x, y) is common, i


def test_flash_attn_with_kvcache_appends_into_dask_caches():
    """dask arrays take the in-place append (item assignment); the checks before it must not
    refuse them (an empty test write did: dask refuses an empty slice's assignment)."""
    da = pytest.importorskip("dask.array")
    q, k_cache, v_cache, k_new, v_new = kvcache_inputs()
    want = C.flash_attn_with_kvcache(q, k_cache.copy(), v_cache.copy(), k_new, v_new, cache_seqlens=1)
    kc, vc = da.from_array(k_cache.copy()), da.from_array(v_cache.copy())
    out = C.flash_attn_with_kvcache(*(da.from_array(t) for t in (q,)), kc, vc,
                                    da.from_array(k_new), da.from_array(v_new), cache_seqlens=1)
    np.testing.assert_allclose(np.asarray(out), want, rtol=1e-12, atol=1e-12)
    np.testing.assert_array_equal(np.asarray(kc)[:2, 1:1 + k_new.shape[1]], k_new)


def test_flash_attn_with_kvcache_needs_a_writable_cache():
    jnp = pytest.importorskip("jax.numpy", reason="an immutable array library: JAX")
    q, k_cache, v_cache, k_new, v_new = (jnp.asarray(t, dtype=jnp.float32) for t in kvcache_inputs())
    with pytest.raises(TypeError, match=r"^k_cache: expected an array that can be written in place"):
        C.flash_attn_with_kvcache(q, k_cache, v_cache, k_new, v_new, cache_seqlens=1)


# --------------------------------------------------------------------------
# scaled_dot_product_attention


def sdpa_case(name):
    """(query, key, value, attn_mask, kwargs) in torch's (B, H, L, E) layout."""
    q, k, v = randn(2, 4, 3, 5), randn(2, 4, 6, 5), randn(2, 4, 6, 4)
    if name == "bool_mask_empty_row":
        m = RNG.random((2, 1, 3, 6)) > 0.4
        m[0, 0, 1] = False  # a row with nothing to attend
        return q, k, v, m, {}
    if name == "float_mask":
        m = randn(1, 4, 3, 6)
        m[..., 0, 0] = -np.inf
        return q, k, v, m, {}
    if name == "bool_mask_and_causal":  # ANDed: torch's fused CPU path (Dv = Dh) takes both
        return q, k, randn(2, 4, 6, 5), RNG.random((3, 6)) > 0.3, dict(is_causal=True)
    if name == "gqa_scale":
        return q, k[:, :2], v[:, :2], None, dict(enable_gqa=True, scale=0.4)
    raise KeyError(name)


SDPA_CASES = ["bool_mask_empty_row", "float_mask", "bool_mask_and_causal", "gqa_scale"]


def sdpa_ref(q, k, v, m, *, is_causal=False, scale=None, enable_gqa=False, keep=None, p=0.0):
    """torch's documented semantics: bool True = attend, float added, is_causal top-left."""
    bias = m if m is not None and m.dtype != bool else None
    allowed = m if m is not None and m.dtype == bool else None
    return ref(q, k, v, scale=scale, causal=is_causal, bias=bias, allowed=allowed, keep=keep, p=p)[0]


@pytest.mark.parametrize("name", SDPA_CASES)
def test_scaled_dot_product_attention_matches_the_reference(name):
    q, k, v, m, kw = sdpa_case(name)
    out = C.scaled_dot_product_attention(q, k, v, m, **kw)
    np.testing.assert_allclose(out, sdpa_ref(q, k, v, m, **kw), rtol=1e-12, atol=1e-12)
    if name == "bool_mask_empty_row":
        assert not out[0, :, 1].any()


@pytest.mark.parametrize("name", SDPA_CASES)
def test_scaled_dot_product_attention_matches_torch(name):
    torch = pytest.importorskip("torch", reason="comparing with torch's SDPA needs torch")
    q, k, v, m, kw = sdpa_case(name)
    tq, tk, tv = (torch.tensor(t, requires_grad=True) for t in (q, k, v))
    tm = None if m is None else torch.tensor(m, requires_grad=m.dtype != bool)
    t_out = torch.nn.functional.scaled_dot_product_attention(tq, tk, tv, tm, **kw)
    ct = randn(*t_out.shape)
    t_out.backward(torch.tensor(ct))
    args = [t.detach() for t in (tq, tk, tv)] + [None if tm is None else tm.detach()]
    out, pullback = C.vjp(C.scaled_dot_product_attention, *args, **kw)
    assert isinstance(out, torch.Tensor)
    np.testing.assert_allclose(out.numpy(), t_out.detach().numpy(), rtol=1e-10, atol=1e-12)
    grads = pullback(torch.tensor(ct))
    expected = [tq.grad, tk.grad, tv.grad, None if tm is None or m.dtype == bool else tm.grad]
    assert len(grads) == 4
    for g, e in zip(grads, expected):
        if e is None:
            assert g is None
        else:
            np.testing.assert_allclose(g.numpy(), e.numpy(), rtol=1e-9, atol=1e-11)


def test_scaled_dot_product_attention_dropout_gradients_match_finite_differences():
    q, k, v, m, _ = sdpa_case("float_mask")  # m (1, 4, 3, 6), broadcast over the batch
    k, v = k[:, :2], v[:, :2]
    keep = RNG.random((2, 4, 3, 6)) > 0.3
    kw = dict(is_causal=True, enable_gqa=True, dropout_mask=keep)
    out, pullback = C.vjp(C.scaled_dot_product_attention, q, k, v, m, 0.3, **kw)
    np.testing.assert_allclose(out, sdpa_ref(q, k, v, m, is_causal=True, keep=keep, p=0.3),
                               rtol=1e-12, atol=1e-12)
    ct = randn(*out.shape)
    grads = pullback(ct)
    assert len(grads) == 5 and grads[4] is None
    check_vjp(lambda a, b, c, d: C.scaled_dot_product_attention(a, b, c, d, 0.3, **kw),
              [q, k, v, m], grads[:4], ct)


@pytest.mark.filterwarnings("ignore:the matrix subclass:PendingDeprecationWarning")
def test_scaled_dot_product_attention_bad_input_names_the_argument():
    q, k, v, m, _ = sdpa_case("bool_mask_empty_row")
    with pytest.raises(TypeError, match=r"^attn_mask: expected a bool or real floating dtype"):
        C.scaled_dot_product_attention(q, k, v, m.astype(np.int8))
    with pytest.raises(ValueError, match=r"^attn_mask: expected a shape that broadcasts"):
        C.scaled_dot_product_attention(q, k, v, m[..., :5])
    with pytest.raises(TypeError, match=r"^query: expected an array"):
        C.scaled_dot_product_attention(None, k, v)
    with pytest.raises(TypeError, match=r"^query: expected a plain numpy.ndarray, got numpy.matrix; "
                                        r"use np.asarray"):  # torch's name, not q
        C.scaled_dot_product_attention(np.asmatrix(q[0, 0]), k[0, 0], v[0, 0], m[0, 0])
    # fewer K/V heads without enable_gqa: refused as torch refuses them, not grouped
    # (every name torch's: "those of query", not q)
    with pytest.raises(ValueError, match=r"^key: expected leading axes that broadcast with those of "
                                         r"query \(1, 4\) \(and key\), got shape \(1, 2, 5, 4\); with "
                                         r"enable_gqa=True, 2 key/value heads would serve 4 query heads$"):
        C.scaled_dot_product_attention(np.ones((1, 4, 3, 4)), np.ones((1, 2, 5, 4)),
                                       np.ones((1, 2, 5, 4)))
    # torch's names, not npattn's q, k, v (the dispatcher's checks named them so)
    with pytest.raises(TypeError, match=r"^query: expected a real floating dtype, got int64"):
        C.scaled_dot_product_attention(q.astype(np.int64), k, v)
    with pytest.raises(TypeError, match=r"^key: expected dtype float64 \(that of query\), got float32"):
        C.scaled_dot_product_attention(q, k.astype(np.float32), v)
    with pytest.raises(ValueError, match=r"^value: expected length 6 \(that of key\)"):
        C.scaled_dot_product_attention(q, k, v[..., :1, :])
    out, pullback = C.vjp(C.scaled_dot_product_attention, q, k, v, m)
    with pytest.raises(ValueError, match=r"^dlse: scaled_dot_product_attention returns no"):
        pullback(out, dlse=out[..., 0])


def test_device_refusals_name_the_callers_arguments():
    """An array on another device than the first: "(like q)" was npattn's name in torch's and
    JAX's signatures, which have no q."""
    xp = pytest.importorskip("array_api_strict")
    if not hasattr(xp, "Device"):
        pytest.skip("this array_api_strict has one device")
    q = xp.asarray(randn(1, 2, 3, 4))
    other = xp.Device("device1")
    k = xp.asarray(randn(1, 2, 5, 4), device=other)
    here = re.escape(repr(q.device))
    there = re.escape(repr(other))
    got = rf"expected an array on device {here} \(like query\), got one on device {there}$"
    with pytest.raises(ValueError, match="^key: " + got):
        C.scaled_dot_product_attention(q, k, xp.asarray(randn(1, 2, 5, 4)))
    with pytest.raises(ValueError, match="^attn_mask: " + got):
        C.scaled_dot_product_attention(q, q, q, xp.asarray(np.ones((3, 3), dtype=bool), device=other))
    blth = (0, 2, 1, 3)  # JAX's (B, T, N, H)
    with pytest.raises(ValueError, match="^value: " + got):
        C.dot_product_attention(xp.permute_dims(q, blth), xp.permute_dims(q, blth),
                                xp.permute_dims(xp.asarray(randn(1, 2, 3, 4), device=other), blth))
    got_q = got.replace("like query", "like q")  # flash-attn's own names are q, k, v
    with pytest.raises(ValueError, match="^k: " + got_q):
        C.flash_attn_func(xp.permute_dims(q, blth), xp.permute_dims(k, blth), xp.permute_dims(k, blth))


# --------------------------------------------------------------------------
# dot_product_attention (JAX)


def jax_case(name):
    """(query, key, value, bias, mask, kwargs) in JAX's (B, T, N, H) layout; T = 4, S = 6."""
    q, k, v = randn(2, 4, 4, 5), randn(2, 6, 2, 5), randn(2, 6, 2, 5)
    if name == "bias_mask_gqa":
        mask = RNG.random((2, 1, 4, 6)) > 0.3
        mask[..., 0] = True  # every row sees a key (JAX's fill differs on empty rows)
        return q, k, v, randn(1, 4, 4, 6), mask, {}
    if name == "causal_window_lengths":
        kw = dict(is_causal=True, local_window_size=(2, 1),
                  query_seq_lengths=np.array([4, 2], np.int32),
                  key_value_seq_lengths=np.array([6, 5], np.int32))
        return q, k, v, randn(4, 6), None, kw
    if name == "symmetric_window_scale":
        return q, k, v, None, None, dict(local_window_size=1, scale=0.3)
    raise KeyError(name)


JAX_CASES = ["bias_mask_gqa", "causal_window_lengths", "symmetric_window_scale"]


def jax_ref(q, k, v, bias, mask, *, scale=None, is_causal=False, query_seq_lengths=None,
            key_value_seq_lengths=None, local_window_size=None, keep=None, p=0.0):
    """JAX's documented semantics on (B, T, N, H): top-left, padded queries give 0."""
    T, S = q.shape[1], k.shape[1]
    allowed = np.ones((q.shape[0], 1, T, S), bool) if mask is None else mask
    if key_value_seq_lengths is not None:
        allowed = allowed & (np.arange(S) < key_value_seq_lengths[:, None])[:, None, None, :]
    w = local_window_size
    window = (None, None) if w is None else (w, w) if isinstance(w, int) else w
    out = ref(to_bhld(q), to_bhld(k), to_bhld(v), scale=scale, causal=is_causal, window=window,
              bias=bias, allowed=allowed, keep=keep, p=p)[0]
    out = to_bhld(out)
    if query_seq_lengths is not None:
        out = out * (np.arange(T) < query_seq_lengths[:, None])[:, :, None, None]
    return out


@pytest.mark.parametrize("name", JAX_CASES)
def test_dot_product_attention_matches_the_reference_and_finite_differences(name):
    q, k, v, bias, mask, kw = jax_case(name)
    out, pullback = C.vjp(C.dot_product_attention, q, k, v, bias, mask, **kw)
    np.testing.assert_allclose(out, jax_ref(q, k, v, bias, mask, **kw), rtol=1e-12, atol=1e-12)
    ct = randn(*out.shape)
    grads = pullback(ct)
    assert len(grads) == 5 and grads[4] is None  # the bool mask has none
    xs = [q, k, v] + ([] if bias is None else [bias])
    assert (grads[3] is None) == (bias is None)

    def f(a, b, c, *d):
        return C.dot_product_attention(a, b, c, d[0] if d else None, mask, **kw)

    check_vjp(f, xs, grads[:len(xs)], ct)
    if "query_seq_lengths" in kw:  # padded query rows: zero output, zero gradient
        assert not out[1, 2:].any() and not grads[0][1, 2:].any()


@pytest.mark.parametrize("name", JAX_CASES)
def test_dot_product_attention_matches_jax(name):
    q, k, v, bias, mask, kw = jax_case(name)
    window_alone = ("local_window_size" in kw and mask is None and not kw.get("is_causal")
                    and "query_seq_lengths" not in kw and "key_value_seq_lengths" not in kw)
    jax = jax_since(JAX_WINDOW_ALONE if window_alone else (0,), "comparing with jax.nn.dot_product_attention")
    jnp = jax.numpy
    f32 = [None if t is None else jnp.asarray(np.asarray(t, np.float32)) for t in (q, k, v, bias)]
    jkw = {n: jnp.asarray(a) if isinstance(a, np.ndarray) else a for n, a in kw.items()}
    jmask = None if mask is None else jnp.asarray(mask)

    def jf(*xs):
        return jax.nn.dot_product_attention(*xs[:3], xs[3] if len(xs) > 3 else None, jmask, **jkw)

    primals = f32[:3] + ([] if bias is None else [f32[3]])
    j_out, j_vjp = jax.vjp(jf, *primals)
    ct = randn(*j_out.shape)
    j_grads = j_vjp(jnp.asarray(ct, jnp.float32))
    out, pullback = C.vjp(C.dot_product_attention, q, k, v, bias, mask, **kw)
    np.testing.assert_allclose(out, np.asarray(j_out), rtol=2e-5, atol=2e-5)
    grads = pullback(ct)
    for g, e in zip(grads, j_grads):
        np.testing.assert_allclose(g, np.asarray(e), rtol=1e-4, atol=1e-4)


#: JAX's value for masked logits: -0.7 * finfo.max of the logits' dtype, capped at float32's
#: range, and its softmax runs in float32
JAX_FILL = np.float32(-0.7 * float(np.finfo(np.float32).max))


def empty_rows_case():
    """(q, k, v, bias, mask, query_seq_lengths), B = 2, T = 4, S = 5, N = 4, K = 2: batch 1's
    query 2 has every key masked by ``mask``, its query 3 is padding; every other row attends."""
    q, k, v = randn(2, 4, 4, 3), randn(2, 5, 2, 3), randn(2, 5, 2, 3)
    mask = RNG.random((2, 1, 4, 5)) > 0.3
    mask[..., 0] = True
    mask[1, 0, 2] = False
    return q, k, v, randn(2, 4, 4, 5), mask, np.array([4, 3], np.int32)


def test_dot_product_attention_query_lengths_with_t_equal_to_s():
    """``query_seq_lengths`` pads queries, never keys, also when T = S."""
    g = np.random.default_rng(13)
    q, k, v = (g.standard_normal(s) for s in ((2, 4, 2, 3), (2, 4, 2, 3), (2, 4, 2, 5)))
    out = C.dot_product_attention(q, k, v, query_seq_lengths=np.array([2, 3], np.int32))
    # [B, T, N, S]: every query attends all four keys
    w = np.exp(np.einsum("btnh,bsnh->btns", q, k) / np.sqrt(3))
    expect = np.einsum("btns,bsnd->btnd", w / w.sum(axis=-1, keepdims=True), v)
    np.testing.assert_allclose(out[0, :2], expect[0, :2], rtol=1e-12)
    np.testing.assert_allclose(out[1, :3], expect[1, :3], rtol=1e-12)
    assert not out[0, 2:].any() and not out[1, 3:].any()


def test_dot_product_attention_rows_with_nothing_to_attend():
    """npattn's side of docs/compat.md's "Rows with nothing to attend": a row whose keys are all
    masked and a padded query row both give zeros, a residual of -inf and zero gradients, and
    the residual's gradient flows (d lse / d bias is the row's softmax)."""
    q, k, v, bias, mask, qlen = empty_rows_case()
    (out, lse), pullback = C.vjp(C.dot_product_attention, q, k, v, bias, mask,
                                 query_seq_lengths=qlen, return_residual=True)
    _, r_lse, r_probs = ref(to_bhld(q), to_bhld(k), to_bhld(v), bias=bias, allowed=mask)
    assert not out[1, 2:].any() and np.isneginf(lse[1, 2:]).all()
    assert lse.dtype == np.float64 and np.isfinite(lse[0]).all() and np.isfinite(lse[1, :2]).all()
    np.testing.assert_allclose(out, jax_ref(q, k, v, bias, mask, query_seq_lengths=qlen),
                               rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(lse[1, :2], r_lse.transpose(0, 2, 1)[1, :2], rtol=1e-12)
    ct = np.zeros(out.shape)
    ct[1, 2:] = randn(2, 4, 3)  # an upstream gradient on the two rows only
    dq, dk, dv, dbias, _ = pullback(ct)
    assert not dq.any() and not dk.any() and not dv.any() and not dbias.any()
    # the residual is differentiable: d lse[b, t, n] / d bias[b, n, t, s] = probs[b, n, t, s]
    dbias = pullback(np.zeros(out.shape), dlse=np.ones(lse.shape))[3]
    want = r_probs.copy()
    want[1, :, 3] = 0.0  # the padded query: no gradient
    np.testing.assert_allclose(dbias, want, rtol=1e-12, atol=1e-14)
    assert not dbias[1, :, 2:].any()


def test_dot_product_attention_rows_with_nothing_to_attend_in_jax():
    """JAX's side, as docs/compat.md states it: the row whose keys are all masked gets the mean of
    all S values, the padded query 0; the residual of both is the log-sum-exp of S fill values,
    which in float32 is the fill itself (-inf in float16, bfloat16's rounding in bfloat16); the
    masked row's gradient reaches v only (dout / S to every key), and the residual has no
    gradient (JAX stops it)."""
    jax = jax_since(JAX_RESIDUAL, "the JAX side of the difference (return_residual)")
    jnp = jax.numpy
    q, k, v, bias, mask, qlen = empty_rows_case()
    args = [jnp.asarray(np.float32(t)) for t in (q, k, v, bias)]
    jkw = dict(mask=jnp.asarray(mask), query_seq_lengths=jnp.asarray(qlen), return_residual=True)

    def jf(a, b, c, d):
        return jax.nn.dot_product_attention(a, b, c, d, **jkw)

    (j_out, j_lse), j_vjp = jax.vjp(jf, *args)
    j_out, j_lse = np.asarray(j_out), np.asarray(j_lse)
    mean_v = np.repeat(v[1].mean(axis=0), 2, axis=0)  # [N, H]: query head n uses K/V head n // 2
    np.testing.assert_allclose(j_out[1, 2], mean_v, rtol=1e-5, atol=1e-6)
    assert not j_out[1, 3].any()
    assert j_lse.dtype == np.float32
    np.testing.assert_array_equal(j_lse[1, 2:], np.full((2, 4), JAX_FILL))  # + log(5), lost
    out, lse = C.dot_product_attention(q, k, v, bias, mask, query_seq_lengths=qlen,
                                       return_residual=True)
    np.testing.assert_allclose(j_out[0], out[0], rtol=1e-4, atol=1e-5)  # elsewhere they agree
    # float32 against float64: an lse near 0 keeps the absolute rounding of its O(1) terms
    np.testing.assert_allclose(j_lse[:, :2], lse[:, :2], rtol=1e-5, atol=1e-6)

    ct = np.zeros(j_out.shape, np.float32)
    ct[1, 2:] = randn(2, 4, 3)
    dq, dk, dv, dbias = (np.asarray(g) for g in j_vjp((jnp.asarray(ct), jnp.zeros(j_lse.shape))))
    assert not dq.any() and not dk.any() and not dbias.any()
    want_dv = np.zeros(v.shape, np.float32)
    want_dv[1] = ct[1, 2].reshape(2, 2, 3).sum(axis=1) / 5  # [K, H]: the masked row's, per key
    np.testing.assert_allclose(dv, want_dv, rtol=1e-5, atol=1e-7)
    no_grad = j_vjp((jnp.zeros(j_out.shape), jnp.ones(j_lse.shape)))
    assert not any(np.asarray(g).any() for g in no_grad)

    for dtype, want in ((jnp.float16, -np.inf), (jnp.bfloat16, float(jnp.bfloat16(JAX_FILL)))):
        low = jax.nn.dot_product_attention(*(a.astype(dtype) for a in args), **jkw)[1]
        assert low.dtype == dtype
        np.testing.assert_array_equal(np.asarray(low, np.float32)[1, 2:], want)
        assert np.isfinite(np.asarray(low, np.float32)[:, :2]).all()


def test_dot_product_attention_bias_of_minus_inf_in_jax():
    """docs/compat.md's "A bias of -inf on every key a row may attend": JAX fills only the logits
    its masks mask, so with m of S keys masked (0 < m < S) the row gets uniform weights over those
    m keys (their mean, dout / m into value, residual F), and with none masked NaN (residual
    -inf); npattn gives zeros, -inf and zero gradients in both. B = 1, T = 4, S = 5, N = 2, K = 1:
    query 1 has bias -inf everywhere and no key masked; query 2 has keys 0 and 1 masked and bias
    -inf on keys 2 to 4; queries 0 and 3 attend."""
    jax = jax_since(JAX_RESIDUAL, "the JAX side of the difference (return_residual)")
    jnp = jax.numpy
    q, k, v = randn(1, 4, 2, 3), randn(1, 5, 1, 3), randn(1, 5, 1, 3)
    bias = randn(1, 2, 4, 5)
    bias[0, :, 1, :] = -np.inf
    bias[0, :, 2, 2:] = -np.inf
    mask = np.ones((1, 1, 4, 5), bool)
    mask[0, 0, 2, :2] = False
    args = [jnp.asarray(np.float32(t)) for t in (q, k, v, bias)]

    def jf(a, b, c, d):
        return jax.nn.dot_product_attention(a, b, c, d, jnp.asarray(mask), return_residual=True)

    (j_out, j_lse), j_vjp = jax.vjp(jf, *args)
    j_out, j_lse = np.asarray(j_out), np.asarray(j_lse)
    assert np.isnan(j_out[0, 1]).all() and np.isneginf(j_lse[0, 1]).all()  # m = 0
    mean_v = np.float32(v)[0, :2, 0].mean(axis=0)  # [H]: keys 0 and 1, the masked ones (m = 2)
    np.testing.assert_allclose(j_out[0, 2], np.stack([mean_v, mean_v]), rtol=1e-6, atol=1e-7)
    np.testing.assert_array_equal(j_lse[0, 2], np.full(2, JAX_FILL))
    zero_ct = (jnp.zeros(j_out.shape), jnp.zeros(j_lse.shape))
    dq, dk, dv, _ = (np.asarray(g) for g in j_vjp(zero_ct))  # the NaN row poisons them anyway
    assert np.isnan(dq[0, 1]).all() and np.isnan(dk).all() and np.isnan(dv).all()

    finite = bias.copy()
    finite[0, :, 1, :] = 0.0  # query 1 attends: JAX's gradients are finite again
    ct = np.zeros(j_out.shape, np.float32)
    ct[0, 2] = randn(2, 3)  # an upstream gradient on query 2 only
    _, j_vjp = jax.vjp(jf, *args[:3], jnp.asarray(np.float32(finite)))
    dq, dk, dv, dbias = (np.asarray(g) for g in j_vjp((jnp.asarray(ct), jnp.zeros(j_lse.shape))))
    assert not dq.any() and not dk.any() and not dbias.any()
    want_dv = np.zeros(v.shape, np.float32)
    want_dv[0, :2, 0] = ct[0, 2].sum(axis=0) / 2  # dout / m to each masked key, both heads
    np.testing.assert_allclose(dv, want_dv, rtol=1e-6, atol=1e-7)

    (out, lse), pullback = C.vjp(C.dot_product_attention, q, k, v, bias, mask, return_residual=True)
    assert not out[0, 1:3].any() and np.isneginf(lse[0, 1:3]).all()
    np.testing.assert_allclose(j_out[0, ::3], out[0, ::3], rtol=1e-5, atol=1e-6)  # the others agree
    grads = pullback(np.float64(ct))
    assert not any(g.any() for g in grads[:4])


def test_dot_product_attention_residual_gradient_with_t_not_n():
    """The residual is (B, T, N) and npattn's log-sum-exp (B, N, T): the pullback transposes
    dlse back. With T = 3 != N = 4 queries and a random dlse (not ones, whose transpose
    reads the same), checked against finite differences, batched and unbatched."""
    q, k, v, bias = randn(2, 3, 4, 5), randn(2, 6, 2, 5), randn(2, 6, 2, 5), randn(1, 4, 3, 6)
    kw = dict(is_causal=True, return_residual=True)
    for args in ((q, k, v, bias), (q[1], k[1], v[1], bias[0])):
        (out, lse), pullback = C.vjp(C.dot_product_attention, *args, **kw)
        assert lse.shape == out.shape[:-1]  # (B, T, N) or (T, N)
        ct, ct_lse = randn(*out.shape), randn(*lse.shape)
        grads = pullback(ct, dlse=ct_lse)
        check_vjp(lambda *a: C.dot_product_attention(*a, **kw), list(args), grads, ct,
                  ct_lse=ct_lse)


def test_dot_product_attention_residual_unbatched_and_dropout():
    q, k, v, bias, _, kw = jax_case("causal_window_lengths")
    out, lse = C.dot_product_attention(q, k, v, bias, return_residual=True, **kw)
    assert out.shape == (2, 4, 4, 5) and lse.shape == (2, 4, 4)
    assert np.isneginf(lse[1, 2:]).all() and np.isfinite(lse[0]).all()  # padded queries: -inf
    single = C.dot_product_attention(q[0], k[0], v[0], bias, is_causal=True)
    np.testing.assert_allclose(single, jax_ref(q[:1], k[:1], v[:1], bias, None, is_causal=True)[0],
                               rtol=1e-12, atol=1e-12)
    keep = RNG.random((2, 4, 4, 6)) > 0.25
    dropped = C.dot_product_attention(q, k, v, bias, dropout_p=0.25, dropout_mask=keep, **kw)
    np.testing.assert_allclose(dropped, jax_ref(q, k, v, bias, None, keep=keep, p=0.25, **kw),
                               rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("kwargs, exc, match", [
    (dict(mask=np.ones((1, 1, 4, 6))), TypeError,
     r"^mask: expected a bool array \(True = takes part; an additive mask goes to bias\), "
     r"got dtype float64$"),
    (dict(bias=np.ones((1, 1, 1, 4, 6))), ValueError,
     r"^bias: expected at most 4 axes, broadcastable to \(B, N, T, S\), got shape \(1, 1, 1, 4, 6\)$"),
    (dict(bias=np.ones((4, 5))), ValueError,
     r"^bias: expected a shape that broadcasts to \(B, N, T, S\) = \(2, 4, 4, 6\) .*, "
     r"got shape \(1, 1, 4, 5\)$"),
    (dict(implementation="flash"), ValueError,
     r"^implementation: expected None, 'xla' or 'cudnn', got 'flash'$"),
    # not a str: a TypeError (a one-element array of a name was taken for the name)
    (dict(implementation=1), TypeError, r"^implementation: expected None, 'xla' or 'cudnn', got int 1$"),
    (dict(implementation=np.array(["xla"])), TypeError,
     r"^implementation: expected None, 'xla' or 'cudnn', got numpy.ndarray"),
    # an array: its == against the names was an array, whose truth value failed naming nothing
    (dict(implementation=np.array(["xla", "cudnn"])), TypeError,
     r"^implementation: expected None, 'xla' or 'cudnn', got numpy.ndarray "),
    (dict(local_window_size=-1), ValueError, r"^local_window_size: expected sides >= 0, got -1$"),
    (dict(local_window_size=(2, -1)), ValueError, r"^local_window_size: expected sides >= 0, got \(2, -1\)$"),
    (dict(local_window_size="wide"), TypeError,
     r"^local_window_size: expected None, an int or a pair \(left, right\) of ints, got str 'wide'$"),
    (dict(query_seq_lengths=np.array([4], np.int32)), ValueError,
     r"^query_seq_lengths: expected shape \(B,\) = \(2,\), got \(1,\)$"),
    (dict(query_seq_lengths=np.array([4, 4, 4], np.int32)), ValueError,
     r"^query_seq_lengths: expected shape \(B,\) = \(2,\), got \(3,\)$"),
    (dict(key_value_seq_lengths=np.array([4.0, 5.0])), TypeError,
     r"^key_value_seq_lengths: expected an integer dtype \(sequence lengths \(B,\)\), got float64$"),
    # a negative length: refused (it was taken as 0, rows with nothing to attend)
    (dict(query_seq_lengths=np.array([-1, 3], np.int32)), ValueError,
     r"^query_seq_lengths: expected lengths >= 0, got \[-1, 3\]$"),
    (dict(key_value_seq_lengths=[-5, 3]), ValueError,
     r"^key_value_seq_lengths: expected lengths >= 0, got \[-5, 3\]$"),
    # the attention core's checks, named as this function's arguments (q, k, v, mask before)
    (dict(bias=np.ones((1, 1, 4, 6), np.float32)), TypeError,
     r"^bias: expected a floating mask of dtype float64 \(that of query\), got float32; cast it first "
     r"\(no silent promotion\)$"),
    (dict(value=np.float32), TypeError,
     r"^value: expected dtype float64 \(that of query\), got float32 \(no silent promotion\)$"),
    # value's layout ends in its own width Dv, which may differ from H (it said (B, S, K, H))
    (dict(value=np.ones((2, 6, 2))), ValueError,
     r"^value: expected 4 axes \(B, S, K, Dv\), got shape \(2, 6, 2\)$"),
    (dict(value="v"), TypeError, r"^value: expected an array \(B, S, K, Dv\) or without B, got str$"),
    # query's rank decides the layout: a query of neither is told both (it was told 3 axes only)
    (dict(query=np.ones((1, 2, 4, 4, 5))), ValueError,
     r"^query: expected 4 axes \(B, T, N, H\) or 3 \(T, N, H\), got shape \(1, 2, 4, 4, 5\)$"),
    (dict(query=np.ones((4, 5))), ValueError,
     r"^query: expected 4 axes \(B, T, N, H\) or 3 \(T, N, H\), got shape \(4, 5\)$"),
    # mask and bias together: each checked under its own name before they are combined
    (dict(bias=np.ones((4, 5)), mask=np.ones((4, 6), bool)), ValueError,
     r"^bias: expected a shape that broadcasts to \(B, N, T, S\) = \(2, 4, 4, 6\) .*, "
     r"got shape \(1, 1, 4, 5\)$"),
    (dict(mask=np.ones((4, 5), bool), bias=np.ones((4, 6))), ValueError,
     r"^mask: expected a shape that broadcasts to \(B, N, T, S\) = \(2, 4, 4, 6\) .*, "
     r"got shape \(1, 1, 4, 5\)$"),
    (dict(mask=np.ma.masked_array(np.ones((4, 6), bool)), bias=np.ones((4, 6))), TypeError,
     r"^mask: expected a plain numpy.ndarray, got numpy.ma.MaskedArray"),
    # lengths: a list holds ints, an array has one axis
    (dict(key_value_seq_lengths=[4.5, 5]), TypeError,
     r"^key_value_seq_lengths: expected sequence lengths \(B,\) as ints, got \[4\.5, 5\]$"),
    (dict(query_seq_lengths=np.array(4, np.int32)), ValueError,
     r"^query_seq_lengths: expected sequence lengths \(B,\), a 1-D integer array, got shape \(\)$"),
])
def test_dot_product_attention_bad_input_names_the_argument(kwargs, exc, match):
    q, k, v, _, _, _ = jax_case("bias_mask_gqa")
    args = dict(query=q, key=k, value=v)
    if kwargs.get("value") is np.float32:
        kwargs = dict(value=v.astype(np.float32))
    with pytest.raises(exc, match=match):
        C.dot_product_attention(**{**args, **kwargs})


@pytest.mark.parametrize("backend", ["numpy", "torch"])
def test_dot_product_attention_lengths_past_the_sequence_mask_nothing(backend):
    """A sequence length at or past T (S) leaves every query (key) valid, as in JAX's
    ``arange(T) < length``, whatever the integer: lengths past int64 were an overflow
    ``ValueError`` from torch naming nothing, and an object array in NumPy."""
    xp_of = {"numpy": np.asarray, "torch": lambda a: pytest.importorskip("torch").asarray(a)}
    to = xp_of[backend]
    r = np.random.default_rng(3)
    q = r.standard_normal((2, 3, 2, 4))  # (B, T, N, H)
    k, v = r.standard_normal((2, 5, 2, 4)), r.standard_normal((2, 5, 2, 4))  # (B, S, K, H)
    out = C.dot_product_attention(to(q), to(k), to(v), query_seq_lengths=[10**30, 3],
                                  key_value_seq_lengths=np.array([2**64 - 1, 5], np.uint64))
    np.testing.assert_allclose(np.asarray(out), jax_ref(q, k, v, None, None), rtol=1e-12, atol=1e-12)


def test_dot_product_attention_shapes_are_named_in_its_own_layout():
    """A shape error names the array as given, (B, T, N, H) or (T, N, H) without B: the
    sizes of 0 were the core's messages about its (B, N, T, H) views (T = 0 read "a query
    length Lq (axis -2)", axis -2 being N here, with a batch of 1 added to an unbatched
    query), and an unbatched value of another length was reported with that batch of 1."""
    q, k, v = randn(2, 4, 4, 5), randn(2, 6, 2, 5), randn(2, 6, 2, 5)
    with pytest.raises(ValueError, match=r"^query: expected a query length T \(axis 1\) of at least 1, got shape \(2, 0, 4, 5\)$"):
        C.dot_product_attention(q[:, :0], k, v)
    with pytest.raises(ValueError, match=r"^query: expected a head count N \(axis 2\) of at least 1, got shape \(2, 4, 0, 5\)$"):
        C.dot_product_attention(q[:, :, :0], k, v)
    with pytest.raises(ValueError, match=r"^query: expected a head width H \(axis 3\) of at least 1, got shape \(2, 4, 4, 0\)$"):
        C.dot_product_attention(q[..., :0], k[..., :0], v)
    with pytest.raises(ValueError, match=r"^key: expected a key length S \(axis 1\) of at least 1, got shape \(2, 0, 2, 5\)$"):
        C.dot_product_attention(q, k[:, :0], v[:, :0])
    # a value width of 0, refused as flash_attn_func's headdim of 0 (it gave an empty output)
    with pytest.raises(ValueError, match=r"^value: expected a value width Dv \(axis 3\) of at least 1, got shape \(2, 6, 2, 0\)$"):
        C.dot_product_attention(q, k, v[..., :0])
    with pytest.raises(ValueError, match=r"^value: expected a value width Dv \(axis 2\) of at least 1, got shape \(6, 2, 0\)$"):
        C.dot_product_attention(q[0], k[0], v[0, ..., :0])
    # unbatched, (T, N, H): the axes count from T
    with pytest.raises(ValueError, match=r"^query: expected a query length T \(axis 0\) of at least 1, got shape \(0, 4, 5\)$"):
        C.dot_product_attention(q[0, :0], k[0], v[0])
    with pytest.raises(ValueError, match=r"^key: expected a key length S \(axis 0\) of at least 1, got shape \(0, 2, 5\)$"):
        C.dot_product_attention(q[0], k[0, :0], v[0, :0])
    with pytest.raises(ValueError, match=r"^value: expected the length S of key = 6 on axis 0, got shape \(5, 2, 5\)$"):
        C.dot_product_attention(q[0], k[0], v[0, :5])
    with pytest.raises(ValueError, match=r"^key: expected the head width of query = 5 on axis 2, got shape \(6, 2, 3\)$"):
        C.dot_product_attention(q[0], k[0, ..., :3], v[0])
    # the batched forms of the last two, unchanged
    with pytest.raises(ValueError, match=r"^value: expected the length S of key = 6 on axis 1, got shape \(2, 5, 2, 5\)$"):
        C.dot_product_attention(q, k, v[:, :5])
    with pytest.raises(ValueError, match=r"^value: expected the batch of query = 2 on axis 0, got shape \(1, 6, 2, 5\)$"):
        C.dot_product_attention(q, k, v[:1])
    # key's batch and heads, value's heads and an axis too many: as given, not the core's views
    with pytest.raises(ValueError, match=r"^key: expected the batch of query = 2 on axis 0, "
                                         r"got shape \(1, 6, 2, 5\)$"):
        C.dot_product_attention(q, k[:1], v)
    with pytest.raises(ValueError, match=r"^value: expected the heads K of key = 2 on axis 2, "
                                         r"got shape \(2, 6, 1, 5\)$"):
        C.dot_product_attention(q, k, v[:, :, :1])
    with pytest.raises(ValueError, match=r"^key: expected a head count K \(axis 2\) of at least 1, "
                                         r"got shape \(2, 6, 0, 5\)$"):
        C.dot_product_attention(q, k[:, :, :0], v[:, :, :0])
    with pytest.raises(ValueError, match=r"^key: expected key/value heads \(axis 2 of \(B, S, K, H\)\) "
                                         r"that divide the query heads \(4, axis 2 of query\), got 3 in "
                                         r"shape \(2, 6, 3, 5\)$"):
        C.dot_product_attention(q, np.ones((2, 6, 3, 5)), np.ones((2, 6, 3, 5)))
    with pytest.raises(ValueError, match=r"^key: expected key/value heads \(axis 1 of \(S, K, H\)\) "
                                         r"that divide the query heads \(4, axis 1 of query\), got 3 in "
                                         r"shape \(6, 3, 5\)$"):
        C.dot_product_attention(q[0], np.ones((6, 3, 5)), np.ones((6, 3, 5)))
    with pytest.raises(ValueError, match=r"^key: expected 4 axes \(B, S, K, H\), "
                                         r"got shape \(1, 2, 6, 2, 5\)$"):
        C.dot_product_attention(q, k[None], v)


@pytest.mark.parametrize("change, exc, match", [
    (dict(bias=np.zeros((4, 6), np.float16)), TypeError, r"^bias: expected a floating mask of dtype float32"),
    (dict(bias=np.zeros((4, 6), np.int32)), TypeError, r"^bias: expected a real floating dtype"),
    (dict(bias=np.zeros((4, 6), bool)), TypeError, r"^bias: expected a real floating dtype"),
    (dict(local_window_size=(-1, 2)), ValueError, r"^local_window_size: expected sides >= 0"),
    (dict(query_seq_lengths=np.array([-1, 3], np.int32)), ValueError,
     r"^query_seq_lengths: expected lengths >= 0"),
    (dict(query=slice(0, 0)), ValueError, r"^query: expected a query length"),
    (dict(key=slice(0, 0)), ValueError, r"^key: expected a key length"),
    (dict(is_causal=1), TypeError, r"^is_causal: expected a bool"),
    (dict(return_residual=1), TypeError, r"^return_residual: expected a bool"),
])
def test_dot_product_attention_refuses_what_jax_answers(change, exc, match):
    """docs/compat.md's "Refused where JAX answers": each call JAX computes and npattn refuses,
    with an error that names the argument."""
    jax = jax_since(JAX_RESIDUAL if "return_residual" in change else (0,), "what JAX answers")
    q, k, v, _, _, _ = jax_case("bias_mask_gqa")
    kwargs = dict(query=np.float32(q), key=np.float32(k), value=np.float32(v))
    for name, cut in change.items():
        if isinstance(cut, slice):  # no queries (T = 0) or no keys (S = 0)
            for n in ((name,) if name == "query" else ("key", "value")):
                kwargs[n] = kwargs[n][:, cut]
        else:
            kwargs[name] = cut
    jax.nn.dot_product_attention(**{n: jax.numpy.asarray(a) if isinstance(a, np.ndarray) else a
                                    for n, a in kwargs.items()})  # JAX answers
    with pytest.raises(exc, match=match):
        C.dot_product_attention(**kwargs)


# --------------------------------------------------------------------------
# vjp itself, and every backend


def test_vjp_contract():
    q, k, v, _, _ = flash_inputs((2, 3, 2, 4, 2, 5, 4))
    with pytest.raises(TypeError, match=r"^fn: expected one of npattn.compat's functions"):
        C.vjp(np.add, q, k)

    def flash_attn_func(*args, **kwargs):  # another library's function of the same name
        raise AssertionError("not called")

    with pytest.raises(TypeError, match=r"^fn: expected one of npattn.compat's functions"):
        C.vjp(flash_attn_func, q, k, v)
    out, pullback = C.vjp(C.flash_attn_func, q, k, v, causal=True)
    with pytest.raises(ValueError, match=r"^dout: expected the shape of the output"):
        pullback(out[:, :2])
    (_, lse, _), with_lse = C.vjp(C.flash_attn_func, q, k, v, causal=True, return_attn_probs=True)
    with pytest.raises(ValueError, match=r"^dlse: expected the shape"):
        with_lse(out, dlse=np.zeros((2, 3)))
    assert lse.shape == (2, 2, 3)  # (B, Hq, Lq)
    with pytest.raises(ValueError, match=r"^dlse: expected the shape"):
        with_lse(out, dlse=np.zeros((2, 3, 2)))  # (B, Lq, Hq): q's layout, the same rank
    with pytest.raises(TypeError, match=r"^dlse: expected an array .* got list"):
        with_lse(out, dlse=[0.0])  # a ValueError before: a wrong kind of value is a TypeError
    ct = randn(*out.shape)
    first, second = pullback(ct), pullback(ct)  # the forward's cache is not consumed
    assert len(first) == 3
    for a, b in zip(first, second):
        np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(out, C.flash_attn_func(q, k, v, causal=True))


def test_vjp_refuses_dlse_when_no_lse_was_returned():
    """A dlse for a call that returned no log-sum-exp was added to the gradients of
    flash_attn_func, the varlen and kvcache functions and dot_product_attention (the
    gradient of an output the caller never received); scaled_dot_product_attention
    refused it. Now each refuses it and names the flag that returns the lse."""
    q, k, v, _, _ = flash_inputs((2, 3, 4, 4, 2, 5, 4))
    kc = np.concatenate([k, np.zeros((2, 2, 2, 4))], axis=1)
    vc = np.concatenate([v, np.zeros((2, 2, 2, 4))], axis=1)
    cases = [
        (C.flash_attn_func, (q, k, v), {}, "return_attn_probs=True", (2, 4, 3)),
        (C.flash_attn_varlen_func, (q.reshape(6, 4, 4), k.reshape(10, 2, 4), v.reshape(10, 2, 4),
                                    np.array([0, 3, 6], np.int32), np.array([0, 5, 10], np.int32),
                                    3, 5), {}, "return_attn_probs=True", (4, 6)),
        (C.flash_attn_with_kvcache, (q, kc, vc, k[:, :1], v[:, :1]),
         dict(cache_seqlens=np.array([2, 4], np.int32)), "return_softmax_lse=True", (2, 4, 3)),
        (C.dot_product_attention, (q, k, v), {}, "return_residual=True", (2, 3, 4)),
    ]
    for fn, args, kw, flag, lse_shape in cases:
        out, pullback = C.vjp(fn, *args, **kw)
        with pytest.raises(ValueError, match=rf"^dlse: {fn.__name__} returned no log-sum-exp .*{flag}"):
            pullback(out, dlse=np.ones(lse_shape))
        (out, lse, *_), with_lse = C.vjp(fn, *args, **kw, **{flag.split("=")[0]: True})
        assert lse.shape == lse_shape
        assert len(with_lse(out, dlse=np.ones(lse_shape))) == len(args)


def test_every_pullback_checks_dout():
    """Each pullback refuses an upstream gradient that is no array, or one token longer than the
    output (the varlen and kvcache pullbacks slice dout per sequence, and would leave the extra
    token unread), naming dout, before any gradient is computed."""
    g = np.random.default_rng(17)
    q, k, v = (g.standard_normal(s) for s in ((2, 3, 4, 4), (2, 5, 2, 4), (2, 5, 2, 4)))
    kc = np.concatenate([k, np.zeros((2, 2, 2, 4))], axis=1)
    vc = np.concatenate([v, np.zeros((2, 2, 2, 4))], axis=1)
    cases = [
        (C.flash_attn_func, (q, k, v), {}),
        (C.flash_attn_varlen_func, (q.reshape(6, 4, 4), k.reshape(10, 2, 4), v.reshape(10, 2, 4),
                                    np.array([0, 3, 6], np.int32), np.array([0, 5, 10], np.int32),
                                    3, 5), {}),
        (C.flash_attn_with_kvcache, (q, kc, vc, k[:, :1], v[:, :1]),
         dict(cache_seqlens=np.array([2, 4], np.int32))),
        (C.scaled_dot_product_attention, (to_bhld(q), to_bhld(k), to_bhld(v)), dict(enable_gqa=True)),
        (C.dot_product_attention, (q, k, v), {}),
    ]
    for fn, args, kw in cases:
        out, pullback = C.vjp(fn, *args, **kw)
        with pytest.raises(TypeError, match=rf"^dout: expected an array of the output's shape "
                                            rf"\({out.shape[0]}, .* got list"):
            pullback(out.tolist())
        longer = np.concatenate([out, out[:1]])  # one more batch entry, or one more packed token
        with pytest.raises(ValueError, match=r"^dout: expected the shape of the output"):
            pullback(longer)
        assert len(pullback(out)) == len(args), fn.__name__  # the right shape is taken


@pytest.mark.parametrize("fn_name", ["flash_attn_func", "flash_attn_varlen_func",
                                     "flash_attn_with_kvcache", "scaled_dot_product_attention",
                                     "dot_product_attention"])
def test_every_backend_gets_its_own_arrays_back_and_finite_difference_gradients(xp, to_xp, to_np, fn_name):
    q, k, v, _, _ = flash_inputs((2, 3, 4, 4, 2, 5, 4))
    fn = getattr(C, fn_name)
    if fn_name == "flash_attn_varlen_func":
        args = [q.reshape(6, 4, 4), k.reshape(10, 2, 4), v.reshape(10, 2, 4),
                np.array([0, 3, 6], np.int32), np.array([0, 5, 10], np.int32)]
        extra, kw = [3, 5], dict(causal=True)
    elif fn_name == "flash_attn_with_kvcache":
        args = [q, np.concatenate([k, np.zeros((2, 2, 2, 4))], axis=1),
                np.concatenate([v, np.zeros((2, 2, 2, 4))], axis=1), k[:, :1], v[:, :1]]
        extra, kw = [], dict(cache_seqlens=np.array([2, 4], np.int32), causal=True)
    elif fn_name == "scaled_dot_product_attention":
        args = [to_bhld(q), to_bhld(k), to_bhld(v), RNG.random((1, 1, 3, 5)) > 0.2]
        extra, kw = [], dict(enable_gqa=True)
    else:
        args, extra, kw = [q, k, v], [], dict(causal=True) if fn_name == "flash_attn_func" else {}
    expected = fn(*[a.copy() for a in args], *extra, **kw)
    before = [a.copy() for a in args]  # (to_xp may share a NumPy array, which the append writes)
    moved = [to_xp(a) for a in args]
    kw = {n: to_xp(a) if isinstance(a, np.ndarray) else a for n, a in kw.items()}
    out, pullback = C.vjp(fn, *moved, *extra, **kw)
    assert type(out) is type(moved[0])
    np.testing.assert_allclose(to_np(out), expected, rtol=1e-12, atol=1e-12)
    ct = to_xp(randn(*expected.shape))
    grads = pullback(ct)
    assert type(grads[0]) is type(moved[0]) and grads[0].shape == moved[0].shape
    if fn_name == "flash_attn_with_kvcache":  # appended in place on every backend
        np.testing.assert_array_equal(to_np(moved[1])[0, 2], k[0, 0])

    # every floating argument's gradient on this backend, by central differences along random
    # directions (the caches as they were before the append; each evaluation appends to copies)
    def f(*a):
        if fn_name == "flash_attn_with_kvcache":
            a = (a[0], a[1] * 1.0, a[2] * 1.0, *a[3:])  # copies: the call writes into them
        return fn(*a, *extra, **kw)

    inputs = [to_xp(a) for a in before]
    report = gradcheck_vjp(f, inputs, list(grads[:len(args)]), ct, seed=7)
    assert report.ok, str(report)
    floating = [n for n, a in enumerate(args) if a.dtype.kind == "f"]
    assert [r.name for r in report.inputs] == [f"input{n}" for n in floating]
    assert all(r.scale > 1e-3 for r in report.inputs)  # nothing vanished


def _length_calls(lengths):
    """Each compat entry point that reads host lengths, with ``lengths`` in their place."""
    r = np.random.default_rng(0)
    q = r.standard_normal((6, 2, 4))  # varlen: 2 sequences of 2 and 4 tokens
    cu = np.array([0, 2, 6], dtype=np.int32)
    qb = r.standard_normal((2, 3, 2, 4))  # (B, T, N, H)
    kc, vc = r.standard_normal((2, 6, 2, 4)), r.standard_normal((2, 6, 2, 4))
    new = r.standard_normal((2, 1, 2, 4))
    return {
        "cu_seqlens_q": lambda: C.flash_attn_varlen_func(q, q, q, lengths(cu), cu, 4, 4),
        "cache_seqlens": lambda: C.flash_attn_with_kvcache(
            new, kc, vc, k=new, v=new, cache_seqlens=lengths(np.array([2, 3], np.int32))),
        "key_value_seq_lengths": lambda: C.dot_product_attention(
            qb, qb, qb, key_value_seq_lengths=lengths(np.array([3, 2], np.int32))),
    }


@pytest.mark.parametrize("name", ["cu_seqlens_q", "cache_seqlens", "key_value_seq_lengths"])
def test_lengths_as_masked_arrays_are_refused_by_name(name):
    """A NumPy masked array of lengths is refused as everywhere else in npattn (its mask
    would be ignored); a masked entry was a numpy.ma.MaskError from reading it."""
    def hide_first(a):
        return np.ma.array(a, mask=np.arange(a.size) == 0)

    with pytest.raises(TypeError, match=f"^{name}: expected a plain numpy.ndarray, got numpy.ma.MaskedArray"):
        _length_calls(hide_first)[name]()
    with pytest.raises(TypeError, match=f"^{name}: expected a plain numpy.ndarray, got numpy.ma.MaskedArray"):
        _length_calls(np.ma.array)[name]()  # nothing masked: refused all the same
    _length_calls(lambda a: a)[name]()  # the plain array is taken
    _length_calls(lambda a: a.tolist())[name]()  # and so is a list of ints


def test_a_value_that_is_no_array_is_named_with_the_layout_expected():
    """The message says what was expected in the function's own layout, not only "an array"."""
    x = np.ones((1, 2, 1, 2))
    with pytest.raises(TypeError, match=r"^q: expected an array of shape \(batch, seqlen, nheads, headdim\), "
                                        r"got list"):
        C.flash_attn_func([[1.0]], x, x)
    with pytest.raises(TypeError, match=r"^query: expected an array \(\.\.\., L, E\), got list"):
        C.scaled_dot_product_attention([[1.0]], x, x)
    with pytest.raises(TypeError, match=r"^query_seq_lengths: expected sequence lengths \(B,\), a 1-D "
                                        r"integer array, got str"):
        C.dot_product_attention(x, x, x, query_seq_lengths="ab")


def test_vjp_gives_no_entry_for_arguments_passed_by_keyword():
    """The pullback has one entry per positional argument: a floating attn_mask passed by
    keyword is a constant (docs/compat.md), passed positionally it gets its gradient; the
    gradients of q, k, v are the same either way, and the flash_attn_with_kvcache new k and v
    likewise."""
    q, k, v, m = randn(2, 3, 4, 5), randn(2, 3, 6, 5), randn(2, 3, 6, 4), randn(4, 6)
    dout = randn(2, 3, 4, 4)
    out_kw, by_keyword = C.vjp(C.scaled_dot_product_attention, q, k, v, attn_mask=m)
    out_pos, positional = C.vjp(C.scaled_dot_product_attention, q, k, v, m)
    np.testing.assert_array_equal(out_kw, out_pos)
    grads_kw, grads_pos = by_keyword(dout), positional(dout)
    assert len(grads_kw) == 3 and len(grads_pos) == 4 and grads_pos[3].shape == (4, 6)
    for a, b in zip(grads_kw, grads_pos):
        np.testing.assert_array_equal(a, b)
    assert C.vjp(C.scaled_dot_product_attention, query=q, key=k, value=v)[1](dout) == ()

    q1, knew, vnew = randn(2, 1, 3, 4), randn(2, 1, 3, 4), randn(2, 1, 3, 4)
    seqlens = np.array([2, 3], np.int32)
    caches = [randn(2, 5, 3, 4) for _ in range(2)]
    _, by_keyword = C.vjp(C.flash_attn_with_kvcache, q1, *(c.copy() for c in caches), k=knew, v=vnew,
                          cache_seqlens=seqlens)
    _, positional = C.vjp(C.flash_attn_with_kvcache, q1, *(c.copy() for c in caches), knew, vnew,
                          cache_seqlens=seqlens)
    d = randn(2, 1, 3, 4)
    grads_kw, grads_pos = by_keyword(d), positional(d)
    assert len(grads_kw) == 3 and len(grads_pos) == 5
    assert grads_pos[3].shape == knew.shape and grads_pos[4].shape == vnew.shape
    assert np.abs(grads_pos[4]).sum() > 0  # the new value is attended: it has a gradient
    for a, b in zip(grads_kw, grads_pos):
        np.testing.assert_array_equal(a, b)


# --------------------------------------------------------------------------
# flash-attn's packed forms: q, k and v (or k and v) stacked on one axis


def assert_bitwise(a, b):
    """The same dtype, shape and bytes: equal values, the sign of every zero included."""
    a, b = np.asarray(a), np.asarray(b)
    np.testing.assert_array_equal(a, b)  # a readable report first
    assert (a.dtype, a.shape) == (b.dtype, b.shape)
    assert np.ascontiguousarray(a).tobytes() == np.ascontiguousarray(b).tobytes()


#: options of the packed tests; "alibi" and "p" as in FLASH_CASES
PACKED_CASES = {
    "plain": dict(),
    "causal": dict(causal=True),
    "window_softcap": dict(window_size=(1, 2), softcap=2.0),
    "causal_alibi_h": dict(causal=True, alibi="h"),
    "left_window_alibi_bh": dict(window_size=(2, -1), alibi="bh"),
    "causal_window_dropout": dict(causal=True, window_size=(3, -1), p=0.3),
}


def packed_case(name, shape):
    """``q, k, v`` (each an array of its own), the slopes, the keep-mask, ``p`` and the other
    keyword arguments of case ``name`` on ``flash_inputs``'s ``shape``."""
    case = dict(PACKED_CASES[name])
    alibi, p = case.pop("alibi", None), case.pop("p", 0.0)
    q, k, v, slopes, keep = flash_inputs(shape, alibi=alibi, p=p)
    return q, k, v, slopes, keep, p, case


@pytest.mark.parametrize("name", PACKED_CASES)
def test_flash_attn_qkvpacked_func_is_flash_attn_func_of_its_parts(name):
    """out, softmax_lse and S_dmask are flash_attn_func's on q, k and v bit for bit (each given
    to it as an array of its own, qkv their stack on axis 2), and out is the reference's."""
    q, k, v, slopes, keep, p, kw = packed_case(name, (2, 5, 4, 4, 4, 5, 4))
    qkv = np.stack([q, k, v], axis=2)  # [B, L, 3, H, D]
    packed = C.flash_attn_qkvpacked_func(qkv, p, alibi_slopes=slopes, return_attn_probs=True,
                                         dropout_mask=keep, **kw)
    parts = C.flash_attn_func(q, k, v, p, alibi_slopes=slopes, return_attn_probs=True,
                              dropout_mask=keep, **kw)
    assert len(packed) == 3
    for a, b in zip(packed, parts):
        assert_bitwise(a, b)
    np.testing.assert_allclose(packed[0], flash_ref(q, k, v, alibi=slopes, keep=keep, p=p, **kw)[0],
                               rtol=1e-12, atol=1e-12)
    # without return_attn_probs: out alone, the same
    assert_bitwise(C.flash_attn_qkvpacked_func(qkv, p, alibi_slopes=slopes, dropout_mask=keep, **kw),
                   parts[0])


@pytest.mark.parametrize("lengths", [(3, 6), (5, 3)], ids=["lq_lt_lk", "lq_gt_lk"])
@pytest.mark.parametrize("name", PACKED_CASES)
def test_flash_attn_kvpacked_func_is_flash_attn_func_of_its_parts(name, lengths):
    """Grouped-query (4 query heads, 2 key/value heads), Lq != Lk (with causal and Lq > Lk the
    first rows attend nothing): flash_attn_func's out, softmax_lse and S_dmask bit for bit."""
    Lq, Lk = lengths
    q, k, v, slopes, keep, p, kw = packed_case(name, (2, Lq, 4, 4, 2, Lk, 4))
    kv = np.stack([k, v], axis=2)  # [B, Lk, 2, Hkv, D]
    packed = C.flash_attn_kvpacked_func(q, kv, p, alibi_slopes=slopes, return_attn_probs=True,
                                        dropout_mask=keep, **kw)
    parts = C.flash_attn_func(q, k, v, p, alibi_slopes=slopes, return_attn_probs=True,
                              dropout_mask=keep, **kw)
    for a, b in zip(packed, parts):
        assert_bitwise(a, b)
    np.testing.assert_allclose(packed[0], flash_ref(q, k, v, alibi=slopes, keep=keep, p=p, **kw)[0],
                               rtol=1e-12, atol=1e-12)
    if kw.get("causal") and Lq > Lk:  # bottom-right: Lq - Lk rows see no key
        assert np.isposinf(packed[1][:, :, :Lq - Lk]).all() and not packed[0][:, :Lq - Lk].any()


@pytest.mark.parametrize("packing", ["qkv", "kv"])
@pytest.mark.parametrize("name", ["causal", "window_softcap", "left_window_alibi_bh",
                                  "causal_window_dropout"])
def test_packed_gradients_match_finite_differences(packing, name):
    """vjp's gradient of qkv (kv) is one array of its shape, by central differences along a
    random direction with a random upstream gradient, and it is flash_attn_func's dq, dk, dv
    (dk, dv) stacked on the packed axis, bit for bit."""
    if packing == "qkv":
        q, k, v, slopes, keep, p, kw = packed_case(name, (2, 5, 4, 4, 4, 5, 4))
        fn, args = C.flash_attn_qkvpacked_func, [np.stack([q, k, v], axis=2)]
    else:
        q, k, v, slopes, keep, p, kw = packed_case(name, (2, 5, 4, 4, 2, 3, 4))
        fn, args = C.flash_attn_kvpacked_func, [q, np.stack([k, v], axis=2)]
    kw = dict(alibi_slopes=slopes, dropout_mask=keep, **kw)
    out, pullback = C.vjp(fn, *args, p, **kw)
    ct = randn(*out.shape)
    grads = pullback(ct)
    assert len(grads) == len(args) + 1 and grads[-1] is None  # dropout_p has none
    assert [g.shape for g in grads[:-1]] == [a.shape for a in args]
    check_vjp(lambda *a: fn(*a, p, **kw), args, grads[:-1], ct)
    dq, dk, dv, _ = C.vjp(C.flash_attn_func, q, k, v, p, **kw)[1](ct)
    expected = [np.stack([dq, dk, dv], axis=2)] if packing == "qkv" else [dq, np.stack([dk, dv], axis=2)]
    for a, b in zip(grads[:-1], expected):
        assert_bitwise(a, b)


def test_packed_dlse_gradient():
    """The pullback of a packed form takes dlse, the gradient of the returned softmax_lse, into
    the packed gradient (finite differences of out and lse together)."""
    q, k, v, _, _, _, _ = packed_case("plain", (2, 5, 2, 4, 2, 5, 4))
    qkv = np.stack([q, k, v], axis=2)
    kw = dict(causal=True, softcap=1.5, return_attn_probs=True)
    (out, lse, _), pullback = C.vjp(C.flash_attn_qkvpacked_func, qkv, **kw)
    ct, ct_lse = randn(*out.shape), randn(*lse.shape)
    grads = pullback(ct, dlse=ct_lse)
    check_vjp(lambda a: C.flash_attn_qkvpacked_func(a, **kw)[:2], [qkv], grads, ct, ct_lse=ct_lse)
    # and its refusal without return_attn_probs names the packed function
    out, pullback = C.vjp(C.flash_attn_qkvpacked_func, qkv, causal=True)
    with pytest.raises(ValueError, match=r"^dlse: flash_attn_qkvpacked_func returned no log-sum-exp "
                                         r"\(it returns one with return_attn_probs=True\); pass None, "
                                         r"or call it with return_attn_probs=True$"):
        pullback(ct, dlse=ct_lse)


# unequal sequences: for qkv one length each (with one empty sequence); for kv LENS_Q, LENS_K
PACKED_LENS = [2, 5, 1, 0]


def test_flash_attn_varlen_qkvpacked_func_is_the_varlen_func_of_its_parts():
    """One cu_seqlens and max_seqlen for queries and keys: flash_attn_varlen_func's out,
    softmax_lse and S_dmask bit for bit, and the reference's out per sequence; its gradient
    by finite differences, the varlen dq, dk, dv stacked on axis 1."""
    cu = np.cumsum([0] + PACKED_LENS).astype(np.int32)
    q, k, v = randn(cu[-1], 4, 4), randn(cu[-1], 4, 4), randn(cu[-1], 4, 4)
    qkv = np.stack([q, k, v], axis=1)  # [total, 3, H, D]
    keep = RNG.random((len(PACKED_LENS), 4, 5, 5)) >= 0.3
    slopes = RNG.uniform(0.1, 1.0, (len(PACKED_LENS), 4))
    kw = dict(causal=True, window_size=(2, -1), softcap=3.0, alibi_slopes=slopes, dropout_mask=keep)
    packed = C.flash_attn_varlen_qkvpacked_func(qkv, cu, 5, 0.3, return_attn_probs=True, **kw)
    parts = C.flash_attn_varlen_func(q, k, v, cu, cu, 5, 5, 0.3, return_attn_probs=True, **kw)
    for a, b in zip(packed, parts):
        assert_bitwise(a, b)
    r_out = varlen_ref(q, k, v, cu, cu, alibi=slopes, keep=keep, p=0.3, causal=True,
                       window_size=(2, -1), softcap=3.0)[0]
    np.testing.assert_allclose(packed[0], r_out, rtol=1e-12, atol=1e-12)
    assert packed[1].shape == (4, cu[-1]) and packed[2].shape == (4, 4, 5, 5)

    out, pullback = C.vjp(C.flash_attn_varlen_qkvpacked_func, qkv, cu, 5, 0.3, **kw)
    ct = randn(*out.shape)
    grads = pullback(ct)
    assert len(grads) == 4 and all(g is None for g in grads[1:])  # cu_seqlens, max_seqlen, p
    check_vjp(lambda a: C.flash_attn_varlen_qkvpacked_func(a, cu, 5, 0.3, **kw), [qkv], grads[:1], ct)
    dq, dk, dv = C.vjp(C.flash_attn_varlen_func, q, k, v, cu, cu, 5, 5, 0.3, **kw)[1](ct)[:3]
    assert_bitwise(grads[0], np.stack([dq, dk, dv], axis=1))


def test_flash_attn_varlen_kvpacked_func_is_the_varlen_func_of_its_parts():
    """Sequences of unequal lengths (Lq < Lk, Lq > Lk with causal, no keys, no queries) and
    grouped-query heads: flash_attn_varlen_func's out, softmax_lse and S_dmask bit for bit, the
    reference's out; the gradients of q and kv by finite differences, dk and dv stacked."""
    q, k, v, cq, ck, keep = varlen_inputs(Dv=4, p=0.25)
    kv = np.stack([k, v], axis=1)  # [total_k, 2, Hkv, D]
    slopes = RNG.uniform(0.1, 1.0, 4)
    kw = dict(causal=True, softcap=3.0, alibi_slopes=slopes, dropout_mask=keep)
    packed = C.flash_attn_varlen_kvpacked_func(q, kv, cq, ck, 5, 4, 0.25, return_attn_probs=True, **kw)
    parts = C.flash_attn_varlen_func(q, k, v, cq, ck, 5, 4, 0.25, return_attn_probs=True, **kw)
    for a, b in zip(packed, parts):
        assert_bitwise(a, b)
    r_out = varlen_ref(q, k, v, cq, ck, alibi=np.broadcast_to(slopes, (4, 4)), keep=keep, p=0.25,
                       causal=True, softcap=3.0)[0]
    np.testing.assert_allclose(packed[0], r_out, rtol=1e-12, atol=1e-12)

    out, pullback = C.vjp(C.flash_attn_varlen_kvpacked_func, q, kv, cq, ck, 5, 4, 0.25, **kw)
    ct = randn(*out.shape)
    grads = pullback(ct)
    assert len(grads) == 7 and all(g is None for g in grads[2:])
    check_vjp(lambda a, b: C.flash_attn_varlen_kvpacked_func(a, b, cq, ck, 5, 4, 0.25, **kw),
              [q, kv], grads[:2], ct)
    dq, dk, dv = C.vjp(C.flash_attn_varlen_func, q, k, v, cq, ck, 5, 4, 0.25, **kw)[1](ct)[:3]
    assert_bitwise(grads[0], dq)
    assert_bitwise(grads[1], np.stack([dk, dv], axis=1))


def test_flash_attn_varlen_kvpacked_func_takes_no_keys_at_all():
    """total_k = 0 (every sequence without keys), which flash_attn_varlen_func takes: the same
    zeros, +inf softmax_lse and gradients as the varlen function of its parts, not a refusal
    of kv's axis 0 (it was checked as a seqlen_k of at least 1)."""
    cq = np.array([0, 2, 5], dtype=np.int32)
    ck = np.zeros(3, dtype=np.int32)
    q, kv = randn(5, 4, 3), randn(0, 2, 2, 3)  # [total_q, Hq, D], [0, 2, Hkv, D]
    k, v = kv[:, 0], kv[:, 1]
    packed, pullback = C.vjp(C.flash_attn_varlen_kvpacked_func, q, kv, cq, ck, 3, 0,
                             causal=True, return_attn_probs=True)
    parts, parts_pullback = C.vjp(C.flash_attn_varlen_func, q, k, v, cq, ck, 3, 0,
                                  causal=True, return_attn_probs=True)
    for a, b in zip(packed, parts):
        assert_bitwise(a, b)
    assert not packed[0].any() and np.isposinf(packed[1]).all()
    ct = randn(*packed[0].shape)
    dq, dkv = pullback(ct)[:2]
    pq, pk, pv = parts_pullback(ct)[:3]
    assert_bitwise(dq, pq)
    assert_bitwise(dkv, np.stack([pk, pv], axis=1))
    assert dq.shape == q.shape and not dq.any() and dkv.shape == kv.shape


@pytest.mark.parametrize("fn_name", ["flash_attn_qkvpacked_func", "flash_attn_kvpacked_func",
                                     "flash_attn_varlen_qkvpacked_func",
                                     "flash_attn_varlen_kvpacked_func"])
def test_packed_forms_hand_on_views_of_the_packed_array(monkeypatch, fn_name):
    """The arrays that reach the unpacked function are q itself and views into the packed
    array (NumPy's basic indexing), no copies: each shares the packed array's memory."""
    seen = []
    private = "_flash_attn_varlen_func" if "varlen" in fn_name else "_flash_attn_func"
    unpacked = getattr(C, private)

    def spy(*args, **kwargs):
        seen.append(args[:3])
        return unpacked(*args, **kwargs)

    monkeypatch.setattr(C, private, spy)
    g = np.random.default_rng(32)
    q, kv = g.standard_normal((5, 4, 4)), g.standard_normal((5, 2, 2, 4))
    qkv, cu = g.standard_normal((5, 3, 4, 4)), np.array([0, 2, 5], np.int32)
    if fn_name == "flash_attn_qkvpacked_func":
        C.flash_attn_qkvpacked_func(qkv[None])
        packed = qkv
    elif fn_name == "flash_attn_kvpacked_func":
        C.flash_attn_kvpacked_func(q[None], kv[None])
        packed = kv
    elif fn_name == "flash_attn_varlen_qkvpacked_func":
        C.flash_attn_varlen_qkvpacked_func(qkv, cu, 3)
        packed = qkv
    else:
        C.flash_attn_varlen_kvpacked_func(q, kv, cu, cu, 3, 3)
        packed = kv
    (args,) = seen
    for n, a in enumerate(args):
        if packed is kv and n == 0:  # q is passed on as it came
            assert np.shares_memory(a, q) and a.size == q.size
        else:
            assert np.shares_memory(a, packed) and a.base is not None, n
    # and they are the packed entries, in order (packed axis 1 of the unbatched arrays here)
    for i, a in enumerate(args[1 if packed is kv else 0:]):
        np.testing.assert_array_equal(a if "varlen" in fn_name else a[0], np.take(packed, i, axis=1))


#: flash-attn 2.x's signatures (flash_attn/flash_attn_interface.py): the positional parameters
#: and their defaults; npattn adds the keyword-only dropout_mask and rng to each
_FLASH_OPTIONS = [("dropout_p", 0.0), ("softmax_scale", None), ("causal", False),
                  ("window_size", (-1, -1)), ("softcap", 0.0), ("alibi_slopes", None),
                  ("deterministic", False), ("return_attn_probs", False)]
FLASH_PACKED_SIGNATURES = {
    "flash_attn_qkvpacked_func": ["qkv"],
    "flash_attn_kvpacked_func": ["q", "kv"],
    "flash_attn_varlen_qkvpacked_func": ["qkv", "cu_seqlens", "max_seqlen"],
    "flash_attn_varlen_kvpacked_func": ["q", "kv", "cu_seqlens_q", "cu_seqlens_k", "max_seqlen_q",
                                        "max_seqlen_k"],
}


@pytest.mark.parametrize("fn_name", FLASH_PACKED_SIGNATURES)
def test_packed_forms_have_flash_attns_signatures(fn_name):
    params = list(inspect.signature(getattr(C, fn_name)).parameters.values())
    positional = [(p.name, p.default) for p in params if p.kind is p.POSITIONAL_OR_KEYWORD]
    required = [(n, inspect.Parameter.empty) for n in FLASH_PACKED_SIGNATURES[fn_name]]
    assert positional == required + _FLASH_OPTIONS
    assert [(p.name, p.default) for p in params if p.kind is p.KEYWORD_ONLY] == \
        [("dropout_mask", None), ("rng", None)]
    assert fn_name in C.__all__


def _packed_call(fn_name, **change):
    """A call of ``fn_name`` on small arrays (q (2, 3, 4, 4), kv (2, 5, 2, 2, 4), qkv
    (2, 5, 3, 4, 4); varlen: 2 sequences of 2 and 3 tokens), with ``change`` applied."""
    g = np.random.default_rng(33)
    cu = np.array([0, 2, 5], np.int32)
    args = {
        "flash_attn_qkvpacked_func": dict(qkv=g.standard_normal((2, 5, 3, 4, 4))),
        "flash_attn_kvpacked_func": dict(q=g.standard_normal((2, 3, 4, 4)),
                                         kv=g.standard_normal((2, 5, 2, 2, 4))),
        "flash_attn_varlen_qkvpacked_func": dict(qkv=g.standard_normal((5, 3, 4, 4)), cu_seqlens=cu,
                                                 max_seqlen=3),
        "flash_attn_varlen_kvpacked_func": dict(q=g.standard_normal((5, 4, 4)),
                                                kv=g.standard_normal((5, 2, 2, 4)), cu_seqlens_q=cu,
                                                cu_seqlens_k=cu, max_seqlen_q=3, max_seqlen_k=3),
    }[fn_name]
    return getattr(C, fn_name)(**{**args, **change})


QKV = r"\(batch, seqlen, 3, nheads, headdim\)"
KV = r"\(batch, seqlen_k, 2, nheads_k, headdim\)"
VQKV = r"\(total_tokens, 3, nheads, headdim\)"
VKV = r"\(total_k, 2, nheads_k, headdim\)"


@pytest.mark.parametrize("fn_name, change, exc, match", [
    ("flash_attn_qkvpacked_func", dict(qkv=[[1.0]]), TypeError,
     rf"^qkv: expected an array of shape {QKV}, got list$"),
    # the packed axis holds exactly 3 (q, k, v)
    ("flash_attn_qkvpacked_func", dict(qkv=np.ones((2, 5, 2, 4, 4))), ValueError,
     rf"^qkv: expected shape {QKV}, got shape \(2, 5, 2, 4, 4\)$"),
    ("flash_attn_qkvpacked_func", dict(qkv=np.ones((2, 5, 4, 4, 4))), ValueError,
     rf"^qkv: expected shape {QKV}, got shape \(2, 5, 4, 4, 4\)$"),
    ("flash_attn_qkvpacked_func", dict(qkv=np.ones((2, 5, 3, 4))), ValueError,
     rf"^qkv: expected shape {QKV}, got shape \(2, 5, 3, 4\)$"),
    ("flash_attn_qkvpacked_func", dict(qkv=np.ones((2, 0, 3, 4, 4))), ValueError,
     r"^qkv: expected a seqlen \(axis 1\) of at least 1, got shape \(2, 0, 3, 4, 4\)$"),
    ("flash_attn_qkvpacked_func", dict(qkv=np.ones((2, 5, 3, 0, 4))), ValueError,
     r"^qkv: expected a nheads \(axis 3\) of at least 1, got shape \(2, 5, 3, 0, 4\)$"),
    # the core's checks of the unpacked views name qkv too
    ("flash_attn_qkvpacked_func", dict(qkv=np.ones((2, 5, 3, 4, 4), np.int64)), TypeError,
     r"^qkv: expected a real floating dtype, got int64$"),
    ("flash_attn_qkvpacked_func", dict(qkv=np.ma.masked_array(np.ones((2, 5, 3, 4, 4)))), TypeError,
     r"^qkv: expected a plain numpy.ndarray, got numpy.ma.MaskedArray \(npattn would ignore its "
     r"mask\); pass its data, np.ma.getdata\(a\), and express the masked entries as an attention mask$"),
    ("flash_attn_qkvpacked_func", dict(causal=1), TypeError, r"^causal: expected a bool, got int 1$"),
    ("flash_attn_kvpacked_func", dict(kv=np.ones((2, 5, 3, 2, 4))), ValueError,
     rf"^kv: expected shape {KV}, got shape \(2, 5, 3, 2, 4\)$"),
    ("flash_attn_kvpacked_func", dict(kv=np.ones((2, 5, 2, 4))), ValueError,
     rf"^kv: expected shape {KV}, got shape \(2, 5, 2, 4\)$"),
    ("flash_attn_kvpacked_func", dict(kv=(1.0, 2.0)), TypeError,
     rf"^kv: expected an array of shape {KV}, got tuple$"),
    ("flash_attn_kvpacked_func", dict(kv=np.ones((1, 5, 2, 2, 4))), ValueError,
     r"^kv: expected the batch of q = 2 on axis 0, got shape \(1, 5, 2, 2, 4\)$"),
    ("flash_attn_kvpacked_func", dict(kv=np.ones((2, 5, 2, 2, 3))), ValueError,
     r"^kv: expected the head width of q = 4 on axis 4, got shape \(2, 5, 2, 2, 3\)$"),
    ("flash_attn_kvpacked_func", dict(kv=np.ones((2, 5, 2, 3, 4))), ValueError,
     rf"^kv: expected key/value heads \(axis 3 of {KV}\) that divide the query heads \(4, axis 2 of "
     r"q\), got 3 in shape \(2, 5, 2, 3, 4\)$"),
    ("flash_attn_kvpacked_func", dict(kv=np.ones((2, 0, 2, 2, 4))), ValueError,
     r"^kv: expected a seqlen_k \(axis 1\) of at least 1, got shape \(2, 0, 2, 2, 4\)$"),
    ("flash_attn_kvpacked_func", dict(kv=np.ones((2, 5, 2, 2, 4), np.float32)), TypeError,
     r"^kv: expected dtype float64 \(that of q\), got float32 \(no silent promotion\)$"),
    ("flash_attn_kvpacked_func", dict(q=np.ones((3, 4, 4))), ValueError,
     r"^q: expected 4 axes \(batch, seqlen, nheads, headdim\), got shape \(3, 4, 4\)$"),
    ("flash_attn_varlen_qkvpacked_func", dict(qkv=np.ones((5, 2, 4, 4))), ValueError,
     rf"^qkv: expected shape {VQKV}, got shape \(5, 2, 4, 4\)$"),
    ("flash_attn_varlen_qkvpacked_func", dict(qkv=np.ones((2, 5, 3, 4, 4))), ValueError,
     rf"^qkv: expected shape {VQKV}, got shape \(2, 5, 3, 4, 4\)$"),
    ("flash_attn_varlen_qkvpacked_func", dict(cu_seqlens=np.array([0, 2, 6], np.int32)), ValueError,
     r"^cu_seqlens: expected cumulative lengths, non-decreasing from 0 to 5 \(the tokens of qkv\), "
     r"got \[0, 2, 6\]$"),
    ("flash_attn_varlen_qkvpacked_func", dict(max_seqlen=2), ValueError,
     r"^max_seqlen: expected at least the longest sequence, 3, got 2$"),
    ("flash_attn_varlen_qkvpacked_func", dict(max_seqlen=3.0), TypeError,
     r"^max_seqlen: expected an int >= 0, got float 3\.0$"),
    ("flash_attn_varlen_qkvpacked_func", dict(block_table=None), TypeError,
     r"got an unexpected keyword argument 'block_table'$"),  # as flash-attn's: no paged cache
    ("flash_attn_varlen_kvpacked_func", dict(kv=np.ones((5, 3, 2, 4))), ValueError,
     rf"^kv: expected shape {VKV}, got shape \(5, 3, 2, 4\)$"),
    ("flash_attn_varlen_kvpacked_func", dict(kv=np.ones((5, 2, 4))), ValueError,
     rf"^kv: expected shape {VKV}, got shape \(5, 2, 4\)$"),
    ("flash_attn_varlen_kvpacked_func", dict(kv=np.ones((5, 2, 2, 3))), ValueError,
     r"^kv: expected the head width of q = 4 on axis 3, got shape \(5, 2, 2, 3\)$"),
    ("flash_attn_varlen_kvpacked_func", dict(kv=np.ones((5, 2, 3, 4))), ValueError,
     rf"^kv: expected key/value heads \(axis 2 of {VKV}\) that divide the query heads \(4, axis 1 of "
     r"q\), got 3 in shape \(5, 2, 3, 4\)$"),
    ("flash_attn_varlen_kvpacked_func", dict(kv=np.ones((6, 2, 2, 4))), ValueError,
     r"^cu_seqlens_k: expected cumulative lengths, non-decreasing from 0 to 6 \(the tokens of kv\), "
     r"got \[0, 2, 5\]$"),
    ("flash_attn_varlen_kvpacked_func", dict(cu_seqlens_q=np.array([0, 5, 4], np.int32)), ValueError,
     r"^cu_seqlens_q: expected cumulative lengths, non-decreasing from 0 to 5 \(the tokens of q\), "
     r"got \[0, 5, 4\]$"),
    ("flash_attn_varlen_kvpacked_func", dict(kv=np.ones((5, 2, 2, 4), np.float16)), TypeError,
     r"^kv: expected dtype float64 \(that of q\), got float16 \(no silent promotion\)$"),
    ("flash_attn_varlen_kvpacked_func", dict(max_seqlen_k=2), ValueError,
     r"^max_seqlen_k: expected at least the longest sequence, 3, got 2$"),
])
def test_packed_forms_bad_input_names_the_packed_argument(fn_name, change, exc, match):
    _packed_call(fn_name)  # the unchanged call is taken
    with pytest.raises(exc, match=match):
        _packed_call(fn_name, **change)


@pytest.mark.parametrize("fn_name", ["flash_attn_kvpacked_func", "flash_attn_varlen_kvpacked_func"])
def test_kvpacked_q_without_heads_or_width_is_named_q(fn_name):
    """q, the first argument, is checked on its own before kv is checked against it: a q of
    head width 0 (or no heads) is q's fault, not kv's ("kv: expected the head width of q = 0"
    named the valid argument; flash_attn_varlen_func names q there), also when kv has the same
    empty axis."""
    lead = (2, 3) if fn_name == "flash_attn_kvpacked_func" else (5,)
    kv_lead = (2, 5, 2) if fn_name == "flash_attn_kvpacked_func" else (5, 2)
    q_axes = len(lead) + 1  # the axis of q's head width (heads: one before)
    cu = ([] if fn_name == "flash_attn_kvpacked_func"
          else [np.array([0, 2, 5], np.int32), np.array([0, 2, 5], np.int32), 3, 3])
    fn = getattr(C, fn_name)
    for q_shape, kv_shape, axis, what in (
            (lead + (4, 0), kv_lead + (2, 4), q_axes, "headdim"),
            (lead + (4, 0), kv_lead + (2, 0), q_axes, "headdim"),
            (lead + (0, 4), kv_lead + (0, 4), q_axes - 1, "nheads")):
        with pytest.raises(ValueError, match=rf"^q: expected a {what} \(axis {axis}\) of at least 1, "
                                             rf"got shape {re.escape(str(q_shape))}$"):
            fn(np.ones(q_shape), np.ones(kv_shape), *cu)


def test_flash_attn_func_q_without_heads_or_width_is_named_q():
    """As the packed and varlen forms: each of q, k, v is checked on its own before k and v are
    checked against q's axes ("k: expected the head width of q = 0" named the valid k)."""
    for q_shape, kv_shape, axis, what in (((2, 5, 2, 0), (2, 3, 2, 8), 3, "headdim"),
                                          ((2, 5, 0, 4), (2, 3, 2, 4), 2, "nheads"),
                                          ((2, 0, 2, 4), (2, 3, 2, 4), 1, "seqlen")):
        with pytest.raises(ValueError, match=rf"^q: expected a {what} \(axis {axis}\) of at least 1, "
                                             rf"got shape {re.escape(str(q_shape))}$"):
            C.flash_attn_func(np.ones(q_shape), np.ones(kv_shape), np.ones(kv_shape))


@pytest.mark.parametrize("fn_name", ["flash_attn_qkvpacked_func", "flash_attn_varlen_qkvpacked_func"])
def test_qkvpacked_messages_of_other_arguments_name_qkv(fn_name):
    """A qkvpacked function has no q: a dropout_mask or alibi_slopes of another library is
    refused "(that of qkv)" ("(that of q)" named an argument the caller does not have)."""
    torch = pytest.importorskip("torch")
    g = np.random.default_rng(35)
    if fn_name == "flash_attn_qkvpacked_func":
        args, grid = [g.standard_normal((2, 5, 3, 2, 4))], (2, 2, 5, 5)
    else:
        args, grid = [g.standard_normal((5, 3, 2, 4)), np.array([0, 2, 5], np.int32), 3], (2, 2, 3, 3)
    fn = getattr(C, fn_name)
    for kw, name in ((dict(dropout_p=0.5, dropout_mask=torch.ones(grid, dtype=torch.bool)), "dropout_mask"),
                     (dict(alibi_slopes=torch.ones(2, dtype=torch.float64)), "alibi_slopes")):
        with pytest.raises(TypeError, match=rf"^{name}: expected a numpy array \(that of qkv\), got a "
                                            r"torch array \(torch\.Tensor\); pass every array from one "
                                            r"library$"):
            fn(*args, **kw)
    # the slopes' shape is told in heads of qkv too ("heads of q" before)
    heads = (r"H heads of qkv" if fn_name == "flash_attn_qkvpacked_func"
             else r"nheads of qkv, or batch and nheads")
    with pytest.raises(ValueError, match=rf"^alibi_slopes: expected shape \(2,\) or \(2, 2\) \({heads}\), "
                                         r"got \(3,\)$"):
        fn(*args, alibi_slopes=np.ones(3))


def test_kv_of_another_library_is_named_kv():
    xps = pytest.importorskip("array_api_strict")
    g = np.random.default_rng(34)
    q, kv = g.standard_normal((2, 3, 4, 4)), g.standard_normal((2, 5, 2, 2, 4))
    with pytest.raises(TypeError, match=r"^kv: expected an array of the library of q \(numpy.ndarray\), "
                                        r"got array_api_strict"):
        C.flash_attn_kvpacked_func(q, xps.asarray(kv))
    cu = np.array([0, 2, 5], np.int32)
    with pytest.raises(TypeError, match=r"^kv: expected an array of the library of q"):
        C.flash_attn_varlen_kvpacked_func(q.reshape(6, 4, 4)[:5],
                                          xps.asarray(kv.reshape(10, 2, 2, 4)[:5]), cu, cu, 3, 3)


def _packed_and_unpacked(fn_name, g):
    """``(packed args, extra args, unpacked function, its args, kwargs, packed axis)`` on
    arrays of ``g``: q, k, v drawn apart and then stacked."""
    cu = np.array([0, 2, 5], np.int32)
    if fn_name == "flash_attn_qkvpacked_func":
        q, k, v = (g.standard_normal((2, 5, 2, 4)) for _ in range(3))
        return ([np.stack([q, k, v], axis=2)], [], C.flash_attn_func, [q, k, v], dict(causal=True), 2)
    if fn_name == "flash_attn_kvpacked_func":
        q, k, v = (g.standard_normal(s) for s in ((2, 3, 4, 4), (2, 5, 2, 4), (2, 5, 2, 4)))
        return ([q, np.stack([k, v], axis=2)], [], C.flash_attn_func, [q, k, v],
                dict(window_size=(1, 1)), 2)
    if fn_name == "flash_attn_varlen_qkvpacked_func":
        q, k, v = (g.standard_normal((5, 2, 4)) for _ in range(3))
        return ([np.stack([q, k, v], axis=1)], [cu, 3], C.flash_attn_varlen_func,
                [q, k, v, cu, cu, 3, 3], dict(causal=True), 1)
    cq = np.array([0, 3, 5], np.int32)
    q, k, v = (g.standard_normal(s) for s in ((5, 4, 4), (5, 2, 4), (5, 2, 4)))
    return ([q, np.stack([k, v], axis=1)], [cq, cu, 3, 3], C.flash_attn_varlen_func,
            [q, k, v, cq, cu, 3, 3], dict(causal=True), 1)


@pytest.mark.parametrize("fn_name", list(FLASH_PACKED_SIGNATURES))
def test_packed_forms_on_every_backend(xp, to_xp, to_np, fn_name):
    """On every backend: the backend's arrays back, out bit for bit that of the unpacked function
    on q, k and v of their own on the same backend, the packed gradient its gradients stacked,
    and that gradient by central differences along random directions."""
    g = np.random.default_rng(35)
    packed, extra, unpacked_fn, unpacked, kw, axis = _packed_and_unpacked(fn_name, g)
    fn = getattr(C, fn_name)
    moved = [to_xp(a) for a in packed]
    out, pullback = C.vjp(fn, *moved, *extra, **kw)
    assert type(out) is type(moved[0])
    arrays = [to_xp(a) if isinstance(a, np.ndarray) and a.dtype.kind == "f" else a for a in unpacked]
    out_u, pullback_u = C.vjp(unpacked_fn, *arrays, **kw)
    assert_bitwise(to_np(out), to_np(out_u))
    ct = to_xp(randn(*to_np(out).shape))
    grads, grads_u = pullback(ct), pullback_u(ct)
    assert all(type(d) is type(moved[0]) for d in grads[:len(packed)])
    stacked = np.stack([to_np(d) for d in grads_u[len(packed) - 1:3]], axis=axis)  # dk, dv (dq)
    assert_bitwise(to_np(grads[len(packed) - 1]), stacked)
    if len(packed) == 2:
        assert_bitwise(to_np(grads[0]), to_np(grads_u[0]))
    report = gradcheck_vjp(lambda *a: fn(*a, *extra, **kw), [to_xp(a) for a in packed],
                           list(grads[:len(packed)]), ct, seed=7)
    assert report.ok, str(report)
    assert all(r.scale > 1e-3 for r in report.inputs)  # nothing vanished


def _prefix_means(v, counts):
    """Row ``i`` of the result is the mean of ``v``'s first ``counts[i]`` keys (axis -3 of (B, L, H, D))."""
    return np.stack([v[:, :n].mean(axis=1) for n in counts], axis=1)  # [B, len(counts), H, D]


def test_a_scale_of_zero_is_zero_not_the_default():
    # softmax_scale / scale = 0.0 makes every score 0: each row weighs the keys it sees equally and
    # q gets no gradient. flash-attn (`if softmax_scale is None`), torch and JAX all read 0.0 as 0;
    # a default taken with `scale or 1 / sqrt(D)` would give the scaled attention instead.
    q, k, v = randn(2, 3, 2, 4), randn(2, 5, 2, 4), randn(2, 5, 2, 4)  # (B, L, H, D), Lq < Lk
    bottom_right = _prefix_means(v, [3, 4, 5])  # causal, aligned bottom-right: row i sees i + 3 keys
    top_left = _prefix_means(v, [1, 2, 3])      # causal, aligned top-left: row i sees i + 1 keys
    ct = randn(2, 3, 2, 4)
    calls = [
        (C.flash_attn_func, (q, k, v, 0.0, 0.0, True), {}, bottom_right),
        (C.flash_attn_with_kvcache, (q, k, v), {"softmax_scale": 0.0, "causal": True}, bottom_right),
        (C.dot_product_attention, (q, k, v), {"scale": 0.0, "is_causal": True}, top_left),
    ]
    for fn, args, kw, expected in calls:
        out, pullback = C.vjp(fn, *args, **kw)
        np.testing.assert_allclose(out, expected, rtol=1e-12, atol=1e-12, err_msg=fn.__name__)
        assert not pullback(ct)[0].any(), fn.__name__
    sq, sk, sv = (np.swapaxes(t, 1, 2) for t in (q, k, v))  # (B, H, L, D)
    out, pullback = C.vjp(C.scaled_dot_product_attention, sq, sk, sv, None, 0.0, True, 0.0)
    np.testing.assert_allclose(out, np.swapaxes(top_left, 1, 2), rtol=1e-12, atol=1e-12)
    assert not pullback(np.swapaxes(ct, 1, 2))[0].any()
    cu = np.array([0, 3, 6], dtype=np.int32)
    cu_k = np.array([0, 5, 10], dtype=np.int32)
    out = C.flash_attn_varlen_func(q.reshape(6, 2, 4), k.reshape(10, 2, 4), v.reshape(10, 2, 4),
                                   cu, cu_k, 3, 5, 0.0, 0.0, True)
    np.testing.assert_allclose(out, bottom_right.reshape(6, 2, 4), rtol=1e-12, atol=1e-12)
