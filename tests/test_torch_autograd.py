"""torch's own autograd through npattn's forwards, against npattn's hand-derived backwards.

On torch tensors every forward runs torch operations (through
array_api_compat), so a tensor with ``requires_grad=True`` gets torch's
autograd through it: an independent check of npattn's backward. These tests
pin where that holds, in float64: ``torch.autograd.grad`` through

* ``npattn.attention.sdpa_forward`` with ``impl="reference"``, ``"blocked"``
  (blocks of 2 x 3, so that tiles are crossed) and ``"auto"``, and
  ``npattn.functional.sdpa_forward``, with every option;
* every function of ``npattn.compat``, against ``compat.vjp``'s pullback;
* ``MultiHeadAttention(backend="torch")`` with parameters that require grad,
  against ``module.backward`` and ``module.grads``;

equals npattn's gradients to 1e-12 (relative to the largest entry), through
``out`` and through the log-sum-exp (``cache.lse``, flash-attn's
``softmax_lse``, JAX's residual). Rows with nothing to attend give torch's
autograd zeros, not NaN: npattn's forward cleans the input of every risky
operation before it selects (the "double where" of STYLE.md). The gradients
of the ``sdpa_forward`` cases are also checked against central differences
in one random direction, so that the two cannot agree by being wrong
together there.
"""

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from npattn import MultiHeadAttention  # noqa: E402
from npattn import attention as A  # noqa: E402
from npattn import compat as C  # noqa: E402
from npattn import functional as F  # noqa: E402

TOL = 1e-12  # relative to the largest entry of npattn's gradient
B, H, Lq, Lk, Dh, Dv = 2, 3, 5, 7, 4, 6


def t64(a, grad=True):
    return torch.tensor(np.asarray(a), dtype=torch.float64, requires_grad=grad)


def assert_same(got, want, name):
    """torch's gradient ``got`` equals npattn's ``want``: no NaN, not detached, 1e-12 relative."""
    assert want is not None, f"{name}: npattn gives no gradient"
    assert got is not None, f"{name}: torch's autograd found no path to it (detached)"
    got, want = got.detach().numpy(), want.detach().numpy()
    assert got.shape == want.shape, f"{name}: shape {got.shape} != {want.shape}"
    assert not np.isnan(got).any(), f"{name}: NaN in torch's gradient"
    assert np.abs(want).max() > 1e-3, f"{name}: a gradient near zero checks nothing"
    err = np.abs(got - want).max() / np.abs(want).max()
    assert err < TOL, f"{name}: torch autograd differs from npattn's backward by {err:.1e}"


def check_fd(fn, inputs, couts, rng, eps=1e-6):
    """Central differences of ``sum(cout * fn(*inputs))`` in one random direction against
    torch's gradients of it: ``<grad, t>`` for a direction ``t`` over all ``inputs``."""
    outs = fn(*inputs)
    grads = torch.autograd.grad(outs, inputs, couts, allow_unused=True)
    dirs = [torch.tensor(rng.standard_normal(tuple(x.shape))) for x in inputs]
    along = sum(float((g * d).sum()) for g, d in zip(grads, dirs) if g is not None)

    def f(sign):
        with torch.no_grad():
            shifted = [x + sign * eps * d for x, d in zip(inputs, dirs)]
            return sum(float(torch.where(torch.isfinite(o), c * o, 0.0).sum())
                       for o, c in zip(fn(*shifted), couts))

    fd = (f(1.0) - f(-1.0)) / (2 * eps)
    assert abs(fd - along) <= 1e-7 * (1.0 + abs(fd)), f"finite differences {fd} != autograd {along}"


def finite_dlse(rng, lse):
    """A random upstream gradient of ``lse``, 0 where lse is infinite (a row with nothing to
    attend: constant there, and torch would multiply its 0 derivative by nothing else)."""
    d = torch.tensor(rng.standard_normal(tuple(lse.shape)), dtype=lse.dtype)
    return torch.where(torch.isfinite(lse), d, 0.0)


# ---------------------------------------------------------------- sdpa_forward

def _options(name, rng):
    """Keyword arguments of ``sdpa_forward`` for case ``name``, and the names of the floating
    ones that get a gradient (a float mask, sinks)."""
    bool_mask = rng.random((B, 1, Lq, Lk)) > 0.3
    bool_mask[:, :, 0, 0] = True
    bool_mask[:, :, 1] = False  # query 1 attends nothing
    float_mask = rng.standard_normal((B, H, Lq, Lk))
    float_mask[0, 0, 2] = -np.inf  # a row with nothing to attend
    float_mask[1, :, 3, :3] = -np.inf
    keep = torch.tensor(rng.random((B, H, Lq, Lk)) > 0.3)
    slopes = torch.tensor([0.5, 0.25, 0.125], dtype=torch.float64)
    fm, sinks = t64(float_mask), t64(rng.standard_normal(H))
    # a float mask of fewer axes, broadcast over the batch and the query rows: its gradient
    # is summed over both (on the blocked path across its query blocks too)
    row_bias = rng.standard_normal((H, 1, Lk))
    row_bias[1, 0, 4] = -np.inf
    fm_rows = t64(row_bias)
    cases = {
        "plain": ({}, []),
        "bool mask, a row masked": (dict(mask=torch.tensor(bool_mask)), []),
        "float mask, -inf rows": (dict(mask=fm), ["mask"]),
        "float mask (H, 1, Lk)": (dict(mask=fm_rows), ["mask"]),
        "causal": (dict(is_causal=True), []),
        "causal, bottom-right": (dict(is_causal=True, align="bottom_right"), []),
        "window": (dict(window=(1, 1)), []),
        "softcap": (dict(softcap=2.0), []),
        "alibi": (dict(alibi_slopes=slopes), []),
        "sinks": (dict(sinks=sinks), ["sinks"]),
        "dropout mask": (dict(dropout_p=0.3, dropout_mask=keep), []),
        "segments": (dict(q_segments=torch.tensor([[0, 0, 1, 1, 1]] * B),
                          k_segments=torch.tensor([[0, 0, 0, 1, 1, 1, 2]] * B)), []),
        "everything": (dict(mask=fm, is_causal=True, align="bottom_right", softcap=2.0,
                            alibi_slopes=slopes, sinks=sinks, dropout_p=0.2, dropout_mask=keep),
                       ["mask", "sinks"]),
    }
    return cases[name]


SDPA_CASES = ["plain", "bool mask, a row masked", "float mask, -inf rows", "causal",
              "causal, bottom-right", "window", "softcap", "alibi", "sinks", "dropout mask",
              "segments", "everything", "float mask (H, 1, Lk)"]
IMPLS = ["reference", "blocked", "auto", "functional"]


def _sdpa(impl, q, k, v, **kw):
    if impl == "functional":
        return F.sdpa_forward(q, k, v, **kw)
    blocks = dict(block_q=2, block_k=3) if impl == "blocked" else {}
    return A.sdpa_forward(q, k, v, impl=impl, **blocks, **kw)


@pytest.mark.parametrize("gqa", [False, True], ids=["mha", "gqa"])
@pytest.mark.parametrize("case", SDPA_CASES)
@pytest.mark.parametrize("impl", IMPLS)
def test_sdpa_forward_autograd_equals_sdpa_backward(impl, case, gqa):
    rng = np.random.default_rng([IMPLS.index(impl), SDPA_CASES.index(case), gqa])
    Hkv = 1 if gqa else H
    q = t64(rng.standard_normal((B, H, Lq, Dh)))
    k = t64(rng.standard_normal((B, Hkv, Lk, Dh)))
    v = t64(rng.standard_normal((B, Hkv, Lk, Dv)))
    kw, extra = _options(case, rng)
    kw = dict(kw, enable_gqa=gqa)
    out, cache = _sdpa(impl, q, k, v, **kw)
    assert isinstance(cache, F.SDPACache if impl != "blocked" else A.blocked.BlockedSDPACache)
    dout = torch.tensor(rng.standard_normal(tuple(out.shape)))
    dlse = finite_dlse(rng, cache.lse)
    want = A.sdpa_backward(dout, cache, dlse=dlse)
    inputs = [q, k, v] + [kw[name] for name in extra]
    got = torch.autograd.grad([out, cache.lse], inputs, [dout, dlse], allow_unused=True)
    names = ["dq", "dk", "dv"] + ["d" + name for name in extra]
    for g, name in zip(got, names, strict=True):
        assert_same(g, getattr(want, name), name)
    if case == "bool mask, a row masked":  # the empty row: zero output, zero gradient
        assert not out[:, :, 1].any() and not got[0][:, :, 1].any()

    def fn(q, k, v, *floats):
        o, c = _sdpa(impl, q, k, v, **dict(kw, **dict(zip(extra, floats))))
        return o, c.lse

    check_fd(fn, inputs, [dout, dlse], rng)


@pytest.mark.parametrize("impl", IMPLS)
def test_leading_axes_that_broadcast(impl):
    # q of one batch entry against k and v of B, and k and v of one head against q's H: each
    # gradient is summed back over the axes its input was broadcast along
    rng = np.random.default_rng([41, IMPLS.index(impl)])
    q = t64(rng.standard_normal((1, H, Lq, Dh)))
    k = t64(rng.standard_normal((B, 1, Lk, Dh)))
    v = t64(rng.standard_normal((B, 1, Lk, Dv)))
    mask = t64(rng.standard_normal((Lq, Lk)))
    out, cache = _sdpa(impl, q, k, v, mask=mask, is_causal=True)
    assert tuple(out.shape) == (B, H, Lq, Dv)
    dout = torch.tensor(rng.standard_normal(tuple(out.shape)))
    dlse = finite_dlse(rng, cache.lse)
    want = A.sdpa_backward(dout, cache, dlse=dlse)
    got = torch.autograd.grad([out, cache.lse], [q, k, v, mask], [dout, dlse])
    for g, name in zip(got, ("dq", "dk", "dv", "dmask")):
        assert_same(g, getattr(want, name), name)

    def fn(q, k, v, mask):
        o, c = _sdpa(impl, q, k, v, mask=mask, is_causal=True)
        return o, c.lse

    check_fd(fn, [q, k, v, mask], [dout, dlse], rng)


@pytest.mark.parametrize("impl", ["reference", "blocked"])
def test_drawn_dropout_and_a_nan_dlse_on_empty_rows(impl):
    # a keep-mask drawn from rng is a constant of the graph, as the backward reuses it; the
    # lse of a row with nothing to attend is a constant (-inf), so its upstream gradient,
    # NaN here, reaches nothing in either gradient
    rng = np.random.default_rng(21)
    q, k, v = (t64(rng.standard_normal((B, H, n, d))) for n, d in ((Lq, Dh), (Lk, Dh), (Lk, Dv)))
    mask = torch.tensor(rng.random((B, 1, Lq, Lk)) > 0.3)
    mask[:, :, :, 0] = True
    mask[:, :, 1] = False
    out, cache = _sdpa(impl, q, k, v, mask=mask, dropout_p=0.3, rng=5)
    assert A.dropout_keep_mask(cache).logical_not().any()  # something was dropped
    dout = torch.tensor(rng.standard_normal(tuple(out.shape)))
    dlse = torch.tensor(rng.standard_normal(tuple(cache.lse.shape)))
    dlse[:, :, 1] = float("nan")
    want = A.sdpa_backward(dout, cache, dlse=dlse)
    got = torch.autograd.grad([out, cache.lse], [q, k, v], [dout, dlse])
    for g, name in zip(got, ("dq", "dk", "dv")):
        assert_same(g, getattr(want, name), name)
    assert not got[0][:, :, 1].any()


@pytest.mark.parametrize("impl", ["reference", "blocked"])
def test_a_sink_of_minus_inf_on_rows_with_nothing_to_attend(impl):
    # bottom-right causal with Lq > Lk leaves queries 0 and 1 no key (on the blocked path every
    # block of theirs is skipped), and a sink of -inf is no sink: in head 0 those rows give
    # zeros and lse = -inf, and the sink, exp(-inf) = 0 in every denominator, has gradient 0
    rng = np.random.default_rng(31)
    Lq_, Lk_ = 7, 5
    q = t64(rng.standard_normal((B, H, Lq_, Dh)))
    k = t64(rng.standard_normal((B, H, Lk_, Dh)))
    v = t64(rng.standard_normal((B, H, Lk_, Dv)))
    sinks = t64([-np.inf, 0.3, -0.2])
    out, cache = _sdpa(impl, q, k, v, is_causal=True, align="bottom_right", sinks=sinks)
    assert not out[:, 0, :2].any() and torch.isneginf(cache.lse[:, 0, :2]).all()
    assert (cache.lse[:, 1, :2] - 0.3).abs().max() < 1e-12  # a row with only its sink: lse = sink
    dout = torch.tensor(rng.standard_normal(tuple(out.shape)))
    dlse = finite_dlse(rng, cache.lse)
    want = A.sdpa_backward(dout, cache, dlse=dlse)
    assert want.dsinks[0] == 0.0
    got = torch.autograd.grad([out, cache.lse], [q, k, v, sinks], [dout, dlse])
    for g, name in zip(got, ("dq", "dk", "dv", "dsinks")):
        assert_same(g, getattr(want, name), name)


_COPIES = """
import warnings
import numpy as np, torch
from npattn import attention as A, compat as C
warnings.simplefilter("error")
rng = np.random.default_rng(7)
q, k, v = (torch.tensor(rng.standard_normal((2, 3, n, 4)), requires_grad=True) for n in (5, 7, 7))
out, cache = A.sdpa_forward(q, k, v, impl="blocked", block_q=2, block_k=3)
assert out.grad_fn is not None
assert out.untyped_storage().data_ptr() != cache.out.untyped_storage().data_ptr()
q, kc, vc = (torch.tensor(rng.standard_normal((2, n, 2, 4)), requires_grad=True) for n in (1, 6, 6))
out = C.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=torch.tensor([3, 5], dtype=torch.int32))
assert out.grad_fn is not None
kc.detach()[:] = 0.0  # the forward's cache holds copies of the keys
assert torch.autograd.grad(out, kc, torch.ones_like(out))[0].abs().max() > 0
print("ok")
"""


def test_forward_copies_stay_on_the_graph_without_a_warning():
    # the blocked forward returns a copy of its out, and flash_attn_with_kvcache attends
    # copies of the cache (the caches must not change when the caller writes into the arrays):
    # torch.asarray's copy of a tensor that requires grad warns in torch 2.13 (once per
    # process, hence a fresh one) and was off the graph before it; clone is on it in every
    # release
    import os
    import subprocess
    import sys

    import npattn
    root = os.path.dirname(os.path.dirname(os.path.abspath(npattn.__file__)))  # this npattn
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        p for p in (root, os.environ.get("PYTHONPATH")) if p))
    run = subprocess.run([sys.executable, "-c", _COPIES], capture_output=True, text=True,
                         env=env, timeout=300)
    assert run.returncode == 0 and run.stdout.strip() == "ok", run.stderr[-2000:]


# ---------------------------------------------------------------- npattn.compat

def _check_vjp(fn, args, kw, rng, *, grads_of=None, lse_index=1):
    """``torch.autograd.grad`` through ``fn(*args, **kw)`` against ``compat.vjp``'s pullback,
    with a random ``dout`` and, when ``fn`` returns a log-sum-exp, a random ``dlse``.

    ``grads_of``: the tensors whose autograd gradients are compared, by their positional
    index; default: every positional tensor that requires grad."""
    res, pullback = C.vjp(fn, *args, **kw)
    out = res[0] if isinstance(res, tuple) else res
    lse = res[lse_index] if isinstance(res, tuple) else None
    dout = torch.tensor(rng.standard_normal(tuple(out.shape)))
    outs, couts, dlse = [out], [dout], None
    if lse is not None:
        dlse = finite_dlse(rng, lse)
        outs, couts = [out, lse], [dout, dlse]
    want = pullback(dout, dlse=dlse)
    if grads_of is None:
        grads_of = {i: a for i, a in enumerate(args)
                    if isinstance(a, torch.Tensor) and a.requires_grad}
    got = torch.autograd.grad(outs, list(grads_of.values()), couts, allow_unused=True)
    for g, i in zip(got, grads_of):
        assert_same(g, want[i], f"{fn.__name__} argument {i}")
    return res, got


def test_flash_attn_func_and_packed_forms_autograd_equals_vjp():
    rng = np.random.default_rng(11)
    Hq, Hkv = 4, 2
    q = t64(rng.standard_normal((B, Lq, Hq, Dh)))
    k, v = (t64(rng.standard_normal((B, 3, Hkv, Dh))) for _ in range(2))  # Lq > Lk: empty rows
    keep = torch.tensor(rng.random((B, Hq, Lq, 3)) > 0.2)
    (out, lse, _), _ = _check_vjp(C.flash_attn_func, (q, k, v, 0.1), dict(
        causal=True, return_attn_probs=True, dropout_mask=keep), rng)
    assert torch.isposinf(lse[:, :, :2]).all() and not out[:, :2].any()  # bottom-right
    slopes = torch.tensor([0.5, 0.3, 0.2, 0.1], dtype=torch.float64)
    _check_vjp(C.flash_attn_func, (q, k, v), dict(window_size=(1, 0), softcap=3.0,
                                                  alibi_slopes=slopes, return_attn_probs=True), rng)
    qkv = t64(rng.standard_normal((B, Lq, 3, Hq, Dh)))
    _check_vjp(C.flash_attn_qkvpacked_func, (qkv,), dict(causal=True, return_attn_probs=True), rng)
    kv = t64(rng.standard_normal((B, 3, 2, Hkv, Dh)))
    _check_vjp(C.flash_attn_kvpacked_func, (q, kv), dict(causal=True, return_attn_probs=True), rng)


def test_flash_attn_varlen_and_packed_forms_autograd_equals_vjp():
    rng = np.random.default_rng(12)
    Hq, Hkv = 4, 2
    cu_q = torch.tensor([0, 3, 8, 10], dtype=torch.int32)
    cu_k = torch.tensor([0, 4, 6, 6], dtype=torch.int32)  # the third sequence has no keys
    q = t64(rng.standard_normal((10, Hq, Dh)))
    k, v = (t64(rng.standard_normal((6, Hkv, Dh))) for _ in range(2))
    (out, lse, _), (dq, *_) = _check_vjp(
        C.flash_attn_varlen_func, (q, k, v, cu_q, cu_k, 5, 4), dict(
            causal=True, return_attn_probs=True), rng)
    assert not out[8:].any() and not dq[8:].any()  # no keys: zeros, and zero gradients
    keep = torch.tensor(rng.random((3, Hq, 5, 4)) > 0.2)
    _check_vjp(C.flash_attn_varlen_func, (q, k, v, cu_q, cu_k, 5, 4, 0.2),
               dict(dropout_mask=keep), rng)
    cu = torch.tensor([0, 3, 8], dtype=torch.int32)
    qkv = t64(rng.standard_normal((8, 3, Hq, Dh)))
    _check_vjp(C.flash_attn_varlen_qkvpacked_func, (qkv, cu, 5),
               dict(causal=True, return_attn_probs=True), rng)
    kv = t64(rng.standard_normal((6, 2, Hkv, Dh)))
    _check_vjp(C.flash_attn_varlen_kvpacked_func, (q[:8], kv, cu_q[:3], cu_k[:3], 5, 4),
               dict(causal=True, return_attn_probs=True), rng, grads_of={1: kv})


def test_flash_attn_with_kvcache_autograd_equals_vjp():
    rng = np.random.default_rng(13)
    Hq, Hkv, Lc = 4, 2, 6
    seqlens = torch.tensor([3, 5], dtype=torch.int32)
    # without k and v the cache is only read: its gradient is autograd's
    q = t64(rng.standard_normal((B, 2, Hq, Dh)))
    kc, vc = (t64(rng.standard_normal((B, Lc, Hkv, Dh))) for _ in range(2))
    _check_vjp(C.flash_attn_with_kvcache, (q, kc, vc),
               dict(cache_seqlens=seqlens, causal=True, return_softmax_lse=True), rng)
    # with k and v the call appends them into the cache in place, which torch records on
    # the cache tensor (a leaf that requires grad is refused, tests/test_compat.py). npattn's
    # gradient of k_cache is that of its contents before the call: autograd's of the tensor
    # the cache was made from (here `before`); of the cache itself it is the gradient after
    # the append, which holds the new keys' gradient where they were written
    q1 = t64(rng.standard_normal((B, 1, Hq, Dh)))
    k1, v1 = (t64(rng.standard_normal((B, 1, Hkv, Dh))) for _ in range(2))
    before_k, before_v = (t64(rng.standard_normal((B, Lc, Hkv, Dh))) for _ in range(2))
    kc, vc = before_k * 1.0, before_v * 1.0
    _, got = _check_vjp(C.flash_attn_with_kvcache, (q1, kc, vc, k1, v1),
                        dict(cache_seqlens=seqlens, causal=True), rng,
                        grads_of={0: q1, 1: before_k, 2: before_v, 3: k1, 4: v1})
    for b in range(B):  # the written slot's gradient went to k, and nothing to the old entry
        assert not got[1][b, int(seqlens[b])].any() and got[3][b].abs().max() > 0.1
    # a cache that did not require grad does after new keys that do were written into it
    kc = torch.zeros((B, Lc, Hkv, Dh), dtype=torch.float64)
    C.flash_attn_with_kvcache(q1, kc, torch.zeros_like(kc), k1, v1, cache_seqlens=seqlens)
    assert kc.requires_grad and kc.grad_fn is not None


def test_sdpa_and_dot_product_attention_autograd_equals_vjp():
    rng = np.random.default_rng(14)
    q = t64(rng.standard_normal((B, H, Lq, Dh)))
    k, v = (t64(rng.standard_normal((B, H, Lk, Dh))) for _ in range(2))
    bias = t64(rng.standard_normal((B, H, Lq, Lk)))
    _check_vjp(C.scaled_dot_product_attention, (q, k, v, bias), {}, rng)
    bool_mask = torch.tensor(rng.random((Lq, Lk)) > 0.4)
    bool_mask[2] = False
    keep = torch.tensor(rng.random((B, H, Lq, Lk)) > 0.3)
    out, (dq, *_) = _check_vjp(C.scaled_dot_product_attention, (q, k, v, bool_mask, 0.3),
                               dict(dropout_mask=keep), rng)
    assert not out[:, :, 2].any() and not dq[:, :, 2].any()
    _check_vjp(C.scaled_dot_product_attention, (q, k[:, :1], v[:, :1]),
               dict(is_causal=True, enable_gqa=True), rng)
    qj = t64(rng.standard_normal((B, Lq, 4, Dh)))  # (B, T, N, H)
    kj, vj = (t64(rng.standard_normal((B, Lk, 2, Dh))) for _ in range(2))
    bj = t64(rng.standard_normal((B, 4, Lq, Lk)))
    mj = torch.tensor(rng.random((B, 4, Lq, Lk)) > 0.3)
    mj[:, :, 1] = False
    _check_vjp(C.dot_product_attention, (qj, kj, vj, bj, mj), dict(return_residual=True), rng)
    _check_vjp(C.dot_product_attention, (qj, kj, vj, bj), dict(
        query_seq_lengths=torch.tensor([3, 5]), key_value_seq_lengths=torch.tensor([0, 4]),
        local_window_size=(1, 1), return_residual=True), rng)


# ---------------------------------------------------------------- MultiHeadAttention

MODULES = {
    "plain": dict(),
    "gqa, sinks, bias_kv, zero_attn": dict(n_kv_head=2, sinks=True, add_bias_kv=True,
                                           add_zero_attn=True),
    "dropout, kdim, vdim": dict(dropout=0.2, kdim=6, vdim=5),
    "blocked, softcap": dict(impl="blocked", block_q=2, block_k=2, softcap=3.0),
}


@pytest.mark.parametrize("mask", ["float", "bool", "self, causal"])
@pytest.mark.parametrize("config", list(MODULES))
def test_module_autograd_equals_module_backward(config, mask):
    rng = np.random.default_rng([list(MODULES).index(config), len(mask)])
    kw = MODULES[config]
    if mask == "self, causal":  # one input: the key and value widths are the model's
        kw = {name: x for name, x in kw.items() if name not in ("kdim", "vdim")}
    D, Hm, Lq_, Lk_ = 8, 4, 5, 3
    mha = MultiHeadAttention(D, Hm, dtype="float64", seed=1, backend="torch", **kw)
    with torch.no_grad():  # non-zero biases and sinks, so that their gradients matter
        for name, p in mha.params.items():
            if name.startswith("b") or name == "sinks":
                p.copy_(torch.tensor(rng.standard_normal(tuple(p.shape))))
    for p in mha.params.values():
        p.requires_grad_(True)
    x = t64(rng.standard_normal((B, Lq_, D)))
    if mask == "self, causal":
        inputs, call = [x], dict(is_causal=True)
        args, Lk_ = (x, x, x), Lq_
    else:
        kx = t64(rng.standard_normal((B, Lk_, kw.get("kdim", D))))
        vx = t64(rng.standard_normal((B, Lk_, kw.get("vdim", D))))
        inputs, args = [x, kx, vx], (x, kx, vx)
        if mask == "float":
            call = dict(mask=t64(rng.standard_normal((B, Hm, Lq_, Lk_))))
        else:
            m = torch.tensor(rng.random((B, 1, Lq_, Lk_)) > 0.3)
            m[:, :, 1] = False  # a query with nothing to attend (but bias_k / zero_attn's keys)
            call = dict(mask=m)
    if mha.dropout:
        call["dropout_mask"] = torch.tensor(rng.random((B, Hm, Lq_, Lk_)) > 0.2)
    out, _ = mha(*args, **call)
    dout = torch.tensor(rng.standard_normal(tuple(out.shape)))
    dinputs = mha.backward(dout)
    want = [sum(dinputs)] if mask == "self, causal" else list(dinputs)
    names = list(mha.params)
    targets = inputs + [mha.params[n] for n in names]
    want += [mha.grads[n] for n in names]
    if mask == "float":
        targets.append(call["mask"])
        want.append(mha.dmask)
    got = torch.autograd.grad(out, targets, dout, allow_unused=True)
    labels = [f"input {i}" for i in range(len(inputs))] + names + ["dmask"]
    for g, w, label in zip(got, want, labels):
        if w.abs().max() < 1e-12:  # b_k without extra keys: the softmax ignores a row shift
            assert g is not None and g.abs().max() < 1e-12, label
            continue
        assert_same(g, w, label)
