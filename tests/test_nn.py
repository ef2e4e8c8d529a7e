"""Finite-difference and property tests of npattn.nn (embedding, positions, cross-entropy, Adam)."""

import decimal
import math
import re
import warnings

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from npattn import nn
from npattn import validation as Vd
from npattn.backend import namespace
from npattn.gradcheck import gradcheck

from reliability_helpers import raises


def _ids(rng, shape, V):
    ids = rng.integers(0, V, size=shape)
    ids.flat[0], ids.flat[-1] = 0, V - 1  # both ends of the vocabulary occur
    return ids


def test_embedding_gradcheck(xp, to_xp):
    rng = np.random.default_rng(1)
    V, D = 5, 3
    ids = to_xp(_ids(rng, (2, 4), V))
    table = to_xp(rng.standard_normal((V, D)))
    report = gradcheck(nn.embedding_forward, nn.embedding_backward, [ids, table],
                       names=["ids", "table"], mode="full")
    assert report.ok, str(report)


def test_embedding_forward_is_row_lookup(xp, to_xp, to_np):
    rng = np.random.default_rng(2)
    ids = _ids(rng, (3, 5), 7)
    table = rng.standard_normal((7, 4))
    out, _ = nn.embedding_forward(to_xp(ids), to_xp(table))
    np.testing.assert_array_equal(to_np(out), table[ids])


def test_embedding_ids_of_another_library_are_named(xp, to_xp):
    """ids must come from the table's library: NumPy ids for a table of another library (or
    ids of another library for a NumPy table) are a TypeError naming ids and both libraries."""
    table = to_xp(np.ones((3, 2)))
    if namespace(table) is namespace(np.ones(1)):
        torch = pytest.importorskip("torch")
        ids, theirs, ours = torch.tensor([[0, 1]]), "torch", "numpy"
    else:
        ids, theirs, ours = np.array([[0, 1]]), "numpy", ""
    with raises(TypeError, "ids", "(that of table)", f"{ours} array", f"got a {theirs} array"):
        nn.embedding_forward(ids, table)


def test_an_infinite_table_entry_is_read_only_by_its_token(xp, to_xp, to_np):
    """``out = table[ids]``: an inf in a row no id reads changes nothing, and one that is read
    is inf where it is read only (as torch.nn.functional.embedding). As the product
    ``one_hot(ids) @ table`` it was 0 * inf = NaN in that column of every position."""
    table = np.array([[0.5, 1.0], [np.inf, 2.0], [3.0, -np.inf]])
    ids = np.array([[0, 2, 0], [2, 2, 0]], dtype=np.int16)  # row 1 is never read
    out = to_np(nn.embedding_forward(to_xp(ids), to_xp(table))[0])
    np.testing.assert_array_equal(out, table[ids])
    assert np.isneginf(out).sum() == 3 and not np.isnan(out).any()


def test_embedding_of_zero_width_runs_both_ways(xp, to_xp, to_np):
    """A table of width D = 0 (torch.nn.Embedding(4, 0) runs), or of no rows with no ids:
    the backward's reshape to (-1, 0) is ambiguous and NumPy refused it ('cannot reshape
    array of size 0 into shape (0)') after the forward had accepted the call."""
    for ids, shape in (([[0, 2], [1, 1]], (4, 0)), (np.zeros((2, 0), dtype=np.int64), (0, 3))):
        ids = np.asarray(ids)
        out, cache = nn.embedding_forward(to_xp(ids), to_xp(np.ones(shape)))
        assert tuple(out.shape) == (*ids.shape, shape[1])
        _, dtable = nn.embedding_backward(to_xp(np.ones((*ids.shape, shape[1]))), cache)
        np.testing.assert_array_equal(to_np(dtable), np.zeros(shape))


def test_embedding_of_a_table_without_rows_names_the_table(xp, to_xp):
    """Ids to look up in a table of no rows: the table is what is missing (the ids were told
    'expected token ids in [0, 0)'); ids of the wrong kind are still told as the ids."""
    table = to_xp(np.ones((0, 3)))
    for ids in ([[0]], [[-1, 2]]):
        with pytest.raises(ValueError, match=r"^table: expected a row for each id to look up, got "
                           r"shape \(0, 3\) \(no rows\) for ids of shape \(1, \d\)$"):
            nn.embedding_forward(to_xp(np.asarray(ids)), table)
    with pytest.raises(TypeError, match="^ids: expected an integer array"):
        nn.embedding_forward(to_xp(np.zeros((1, 1))), table)


def test_embedding_backward_counts_repeated_tokens(xp, to_xp, to_np):
    """dtable[v] = sum of dout over the positions holding v (a token that never occurs: 0)."""
    rng = np.random.default_rng(3)
    ids = np.array([[1, 1, 3], [3, 1, 0]])
    dout = rng.standard_normal((2, 3, 2))
    _, cache = nn.embedding_forward(to_xp(ids), to_xp(rng.standard_normal((5, 2))))
    dids, dtable = nn.embedding_backward(to_xp(dout), cache)
    assert dids is None
    expected = np.zeros((5, 2))
    for b in range(2):
        for i in range(3):
            expected[ids[b, i]] += dout[b, i]
    np.testing.assert_allclose(to_np(dtable), expected, rtol=1e-12, atol=1e-12)
    assert np.all(to_np(dtable)[[2, 4]] == 0.0)


def test_add_positions_gradcheck(xp, to_xp):
    rng = np.random.default_rng(4)
    x, pos = to_xp(rng.standard_normal((3, 4, 2))), to_xp(rng.standard_normal((4, 2)))
    report = gradcheck(nn.add_positions_forward, nn.add_positions_backward, [x, pos],
                       names=["x", "pos"], mode="full")
    assert report.ok, str(report)


def test_add_positions_rejects_wrong_shape():
    with pytest.raises(ValueError, match=r"^pos: expected shape \(4, 3\) \(L, D\) to match x, got \(5, 3\)$"):
        nn.add_positions_forward(np.zeros((2, 4, 3)), np.zeros((5, 3)))


def test_sinusoidal_positions_formula(xp, to_np):
    L, D = 6, 8
    pe = to_np(nn.sinusoidal_positions(xp, L, D, dtype=xp.float64))
    for i in range(L):
        for k in range(D // 2):
            angle = i / 10000.0 ** (2 * k / D)
            assert pe[i, 2 * k] == pytest.approx(math.sin(angle), abs=1e-12)
            assert pe[i, 2 * k + 1] == pytest.approx(math.cos(angle), abs=1e-12)


def test_sinusoidal_positions_on_a_second_device():
    """``device=`` is where the table is made (it came back on the default device)."""
    xps = pytest.importorskip("array_api_strict")
    dev, cpu = xps.Device("device1"), xps.Device("CPU_DEVICE")
    pe = nn.sinusoidal_positions(xps, 3, 4, device=dev)
    assert pe.device == dev
    np.testing.assert_array_equal(np.asarray(xps.asarray(pe, device=cpu)), nn.sinusoidal_positions(np, 3, 4))


def test_cross_entropy_gradcheck(xp, to_xp):
    rng = np.random.default_rng(5)
    V = 4
    logits = to_xp(3.0 * rng.standard_normal((2, 3, V)))
    targets = to_xp(_ids(rng, (2, 3), V))
    report = gradcheck(nn.cross_entropy_forward, nn.cross_entropy_backward, [logits, targets],
                       names=["logits", "targets"], mode="full")
    assert report.ok, str(report)


@given(
    n=st.integers(1, 6),
    V=st.integers(2, 6),
    shift=st.floats(-500.0, 500.0),
    seed=st.integers(0, 2**16),
)
def test_cross_entropy_matches_direct_formula(n, V, shift, seed):
    """Mean of -log(exp(x_t) / sum exp(x)), computed in a different way; a large shift must not overflow.
    dlogits is (softmax(x) - onehot(t)) * dloss / n, entry by entry, for a random dloss."""
    rng = np.random.default_rng(seed)
    logits = rng.standard_normal((n, V)) * 2.0
    targets = rng.integers(0, V, size=n)
    loss, cache = nn.cross_entropy_forward(logits + shift, targets)
    expected = np.mean([
        -(logits[i, targets[i]] - math.log(math.fsum(math.exp(v) for v in logits[i])))
        for i in range(n)
    ])
    assert float(loss) == pytest.approx(expected, rel=1e-9, abs=1e-9)
    dloss = float(rng.uniform(0.5, 2.0) * rng.choice([-1.0, 1.0]))
    dlogits, dtargets = nn.cross_entropy_backward(dloss, cache)
    assert dtargets is None
    np.testing.assert_allclose(np.sum(dlogits, axis=-1), 0.0, atol=1e-12)  # rows sum to 0
    softmax = np.array([[math.exp(v - math.log(math.fsum(math.exp(u) for u in row))) for v in row]
                        for row in logits])  # [n, V], of the unshifted logits (softmax ignores the shift)
    expected_dlogits = (softmax - np.eye(V)[targets]) * dloss / n  # [n, V]
    # the shift of up to 500 rounds the logits by up to 2**-44 each: within 1e-11 in softmax
    np.testing.assert_allclose(dlogits, expected_dlogits, rtol=1e-9, atol=1e-11)


def test_cross_entropy_with_minus_inf_logits(xp, to_xp, to_np):
    """A -inf logit (a class masked out) away from the target adds nothing to the loss and gets
    zero gradient; on the target the loss is +inf. (0 * -inf made the loss NaN.)"""
    z = np.array([[0.0, -np.inf, 1.0], [0.5, 0.2, -0.3], [-np.inf, 2.0, -np.inf]])
    t = np.array([0, 1, 1])
    loss, cache = nn.cross_entropy_forward(to_xp(z), to_xp(t))
    expected = np.mean([math.log(1.0 + math.e) - 0.0,
                        math.log(sum(math.exp(x) for x in (0.5, 0.2, -0.3))) - 0.2,
                        0.0])
    assert float(loss) == pytest.approx(expected, rel=1e-14)
    dz = to_np(nn.cross_entropy_backward(1.0, cache)[0])
    assert np.all(np.isfinite(dz)) and dz[0, 1] == 0.0 and np.all(dz[2] == 0.0)
    loss, _ = nn.cross_entropy_forward(to_xp(z), to_xp(np.array([1, 1, 1])))
    assert float(loss) == math.inf


def _direct_cross_entropy(z, t):
    """Per-position -log softmax(z)[t] of float64 logits z (N, V) near 0, with math.fsum."""
    return np.array([-(z[i, t[i]] - math.log(math.fsum(math.exp(v) for v in z[i])))
                     for i in range(len(t))])


def test_cross_entropy_of_logits_past_exp_overflow(xp, to_xp, to_np):
    """exp overflows past 709.8 in float64 and 88.7 in float32, and underflows to 0 below
    -745: the loss and dlogits = (softmax - one_hot) / N of logits shifted that far are
    those of the same logits near 0 (the shift cancels in log-softmax), finite."""
    rng = np.random.default_rng(13)
    base = 2.0 * rng.standard_normal((3, 4))
    t = np.array([0, 3, 1])
    for dtype, shift, tol in ((np.float64, 1000.0, 1e-12), (np.float64, -1000.0, 1e-12),
                              (np.float32, 200.0, 1e-5)):
        z = (base + shift).astype(dtype)
        near0 = z.astype(np.float64) - shift  # the logits given, less the shift
        p = np.exp(near0) / np.exp(near0).sum(axis=-1, keepdims=True)
        expected_d = (p - np.eye(4)[t]) / 3.0
        loss, cache = nn.cross_entropy_forward(to_xp(z), to_xp(t))
        assert float(loss) == pytest.approx(_direct_cross_entropy(near0, t).mean(), rel=tol)
        dz = to_np(nn.cross_entropy_backward(1.0, cache)[0])
        np.testing.assert_allclose(dz, expected_d, rtol=tol, atol=tol)


def test_cross_entropy_averages_over_every_leading_axis(xp, to_xp, to_np):
    """Logits (B, L, V) and targets (B, L): the mean runs over all B * L positions, as
    torch's cross_entropy of the flattened (B * L, V) logits, not over B alone."""
    rng = np.random.default_rng(14)
    z = rng.standard_normal((2, 3, 5))
    t = rng.integers(0, 5, size=(2, 3))
    loss, cache = nn.cross_entropy_forward(to_xp(z), to_xp(t))
    per_position = _direct_cross_entropy(z.reshape(6, 5), t.reshape(6))
    assert float(loss) == pytest.approx(math.fsum(per_position) / 6.0, rel=1e-12)
    p = np.exp(z) / np.exp(z).sum(axis=-1, keepdims=True)
    dz = to_np(nn.cross_entropy_backward(1.0, cache)[0])
    np.testing.assert_allclose(dz, (p - np.eye(5)[t]) / 6.0, rtol=1e-12, atol=1e-15)


@pytest.mark.parametrize("ignore", [2, -100])
def test_cross_entropy_ignore_index_leaves_positions_out(xp, to_xp, to_np, ignore):
    """Positions whose target is ignore_index (2: a class id, here a padding token's; -100:
    torch's default, outside [0, V)) add nothing: the loss is the mean over the other
    positions alone, their dlogits = dloss (p - one_hot) / N_kept, and the ignored rows get
    exactly zero (with 2 in range, its one-hot row would otherwise count)."""
    rng = np.random.default_rng(21)
    z = 2.0 * rng.standard_normal((2, 3, 5))
    t = np.array([[0, 2, 1], [2, 4, 3]]) if ignore == 2 else np.array([[0, -100, 1], [-100, 4, 3]])
    kept = (t != ignore).reshape(6)
    zk, tk = z.reshape(6, 5)[kept], t.reshape(6)[kept]  # the 4 positions that count
    loss, cache = nn.cross_entropy_forward(to_xp(z), to_xp(t), ignore_index=ignore)
    assert float(loss) == pytest.approx(math.fsum(_direct_cross_entropy(zk, tk)) / 4.0, rel=1e-12)
    dloss = 1.3
    dz = to_np(nn.cross_entropy_backward(dloss, cache)[0]).reshape(6, 5)
    p = np.exp(zk) / np.exp(zk).sum(axis=-1, keepdims=True)
    np.testing.assert_allclose(dz[kept], dloss * (p - np.eye(5)[tk]) / 4.0, rtol=1e-12, atol=1e-15)
    assert np.all(dz[~kept] == 0.0)
    report = gradcheck(lambda logits: nn.cross_entropy_forward(logits, to_xp(t), ignore_index=ignore),
                       lambda d, c: nn.cross_entropy_backward(d, c)[0], [to_xp(z)], names=["logits"])
    assert report.ok, str(report)


def test_cross_entropy_ignore_index_matches_torch():
    """torch.nn.functional.cross_entropy(..., ignore_index=-100) on the flattened (B * L, V)
    logits: loss and dlogits for an upstream gradient other than 1."""
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(22)
    z = rng.standard_normal((3, 4, 6))
    t = rng.integers(0, 6, size=(3, 4))
    t[rng.random((3, 4)) < 0.4] = -100
    t[0, 0] = 1  # at least one target counts
    zt = torch.tensor(z, requires_grad=True)
    lt = torch.nn.functional.cross_entropy(zt.reshape(-1, 6), torch.tensor(t).reshape(-1),
                                           ignore_index=-100)
    lt.backward(torch.tensor(0.7, dtype=torch.float64))
    loss, cache = nn.cross_entropy_forward(z, t, ignore_index=-100)
    assert float(loss) == pytest.approx(lt.item(), rel=1e-13)
    np.testing.assert_allclose(nn.cross_entropy_backward(0.7, cache)[0], zt.grad.numpy(),
                               rtol=1e-12, atol=1e-16)


@pytest.mark.parametrize("ignore, dtype, all_but_one", [(2, "float64", False), (0, "float64", True),
                                                     (5, "float64", False), (2, "float16", False),
                                                     (-100, "float16", True)])
def test_cross_entropy_ignore_index_in_range_matches_torch(ignore, dtype, all_but_one):
    """An ignore_index inside [0, V) (a padding token's id; the first and the last class too),
    every position but one ignored, and float16 logits: loss and dlogits as torch's
    cross_entropy(ignore_index=) gives them on the same logits in float32 / float64."""
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(23)
    z = (3.0 * rng.standard_normal((3, 4, 6))).astype(dtype)
    t = rng.integers(0, 6, size=(3, 4))
    t[rng.random((3, 4)) < 0.4] = ignore
    if all_but_one:
        t[...] = ignore
    t[1, 2] = 3  # one target counts
    zt = torch.tensor(z.astype(np.float64 if dtype == "float64" else np.float32), requires_grad=True)
    lt = torch.nn.functional.cross_entropy(zt.reshape(-1, 6), torch.tensor(t).reshape(-1),
                                           ignore_index=ignore)
    lt.backward(torch.tensor(0.7, dtype=zt.dtype))
    loss, cache = nn.cross_entropy_forward(z, t, ignore_index=ignore)
    dz = nn.cross_entropy_backward(0.7, cache)[0]
    assert loss.dtype == z.dtype and dz.dtype == z.dtype
    tol = dict(rtol=1e-12, atol=1e-16) if dtype == "float64" else dict(rtol=2e-3, atol=1e-4)
    np.testing.assert_allclose(float(loss), lt.item(), **tol)
    np.testing.assert_allclose(dz.astype(np.float64), zt.grad.numpy(), **tol)
    assert np.all(dz[t == ignore] == 0)


def test_cross_entropy_takes_a_numpy_int_ignore_index(xp, to_xp, to_np):
    """ignore_index may be a NumPy int (it is taken as the int it holds): loss and dlogits are
    those of the Python int, on every backend (one that takes no NumPy scalars included)."""
    rng = np.random.default_rng(8)
    z = to_xp(rng.standard_normal((2, 3, 4)))
    t = to_xp(np.array([[0, 2, 1], [2, 3, 2]]))
    dloss = 0.7
    loss, cache = nn.cross_entropy_forward(z, t, ignore_index=2)
    expected = to_np(nn.cross_entropy_backward(dloss, cache)[0])
    for ignore in (np.int64(2), np.uint8(2)):
        got, cache = nn.cross_entropy_forward(z, t, ignore_index=ignore)
        assert float(got) == float(loss)
        np.testing.assert_array_equal(to_np(nn.cross_entropy_backward(dloss, cache)[0]), expected)
    assert np.all(expected[[0, 1, 1], [1, 0, 2]] == 0.0) and np.any(expected != 0.0)


def test_cross_entropy_ignore_index_is_checked_before_computing():
    """ignore_index None or an int its targets' dtype holds; other targets in [0, V); at
    least one target not ignored (torch gives NaN); each a TypeError / ValueError naming
    the argument, the targets unchanged. Without ignore_index, -100 is out of range."""
    rng = np.random.default_rng(23)
    z, t = rng.standard_normal((2, 3, 5)), np.array([[0, -100, 1], [2, 4, -100]])
    for bad in (True, 1.0, "x", np.float64(2.0)):
        with raises(TypeError, "ignore_index", "expected None or an int", type(bad).__name__):
            nn.cross_entropy_forward(z, t, ignore_index=bad)
    for kwargs, tgt, words in (
            ({}, t, ("targets", "class indices in [0, 5)", "[-100, 4]")),
            (dict(ignore_index=-1), t, ("targets", "[0, 5) or ignore_index = -1", "others in [-100, 4]")),
            (dict(ignore_index=-100), np.where(t == 4, 5, t),
             ("targets", "or ignore_index = -100", "[0, 5]")),
            (dict(ignore_index=-100), np.full((2, 3), -100), ("targets", "at least one target", "-100")),
            (dict(ignore_index=2**40), t.astype(np.int32),
             ("ignore_index", "int32 of targets", "1099511627776"))):
        before = tgt.copy()
        with raises(ValueError, *words):
            nn.cross_entropy_forward(z, tgt, **kwargs)
        np.testing.assert_array_equal(tgt, before)
    loss, _ = nn.cross_entropy_forward(z, t, ignore_index=np.int16(-100))  # a NumPy int is an int
    assert float(loss) == pytest.approx(float(nn.cross_entropy_forward(z[t != -100], t[t != -100])[0]),
                                        rel=1e-14)


def test_ids_of_a_float_dtype_are_refused_and_ignore_index_may_be_a_dtype_bound():
    """Float targets or token ids are a TypeError naming them; an ignore_index equal to the
    smallest or the largest value of the targets' dtype is one that dtype holds, and leaves
    those positions out of the mean: -mean(z[i, t_i] - log sum_c exp z[i, c]) over the others."""
    z = np.random.default_rng(5).standard_normal((4, 5))
    with pytest.raises(TypeError, match=r"^targets: expected an integer array of class indices, "
                                        r"got dtype float64$"):
        nn.cross_entropy_forward(z, np.array([0.0, 1.0, 2.0, 3.0]))
    with pytest.raises(TypeError, match=r"^ids: expected an integer array of token ids, got dtype float64$"):
        nn.embedding_forward(np.array([0.0, 1.0]), np.ones((5, 2)))
    want = -np.mean([z[i, c] - np.log(np.sum(np.exp(z[i]))) for i, c in ((0, 1), (2, 3))])
    for ignore in (-128, 127):
        t = np.array([1, ignore, 3, ignore], dtype=np.int8)
        loss, _ = nn.cross_entropy_forward(z, t, ignore_index=ignore)
        assert float(loss) == pytest.approx(want, rel=1e-13), ignore


def _smoothed_cross_entropy(z, t, eps, counted, weight=None):
    """Per-position -sum_c y_c log softmax(z)_c with y_c = ((1 - eps) one_hot(t)_c + eps / V) w_c,
    written as a cross-entropy against target weights, with math.fsum; 0 where not counted."""
    N, V = z.shape
    w = [1.0] * V if weight is None else [float(x) for x in weight]
    out = []
    for i in range(N):
        if not counted[i]:
            out.append(0.0)
            continue
        lse = math.log(math.fsum(math.exp(v) for v in z[i]))
        y = [((1.0 - eps) * (c == t[i]) + eps / V) * w[c] for c in range(V)]
        out.append(-math.fsum(y[c] * (z[i, c] - lse) for c in range(V)))
    return np.array(out)


@pytest.mark.parametrize("weighted", [False, True])
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("eps", [0.0, 0.3, 1.0])
@pytest.mark.parametrize("ignore", [None, 1])
def test_cross_entropy_reduction_and_label_smoothing_match_the_direct_formula(xp, to_xp, to_np, reduction,
                                                                              eps, ignore, weighted):
    """label_smoothing = eps: the cross-entropy against y = (1 - eps) one_hot(t) + eps / V,
    each class's entry scaled by its weight; reduction: the mean over the positions that
    count (divided by the sum of their targets' weights), their sum, or each position's loss
    (0 where ignored). The gradient against a random upstream gradient: finite differences
    on every backend."""
    rng = np.random.default_rng(31)
    z = rng.standard_normal((2, 3, 4))
    t = rng.integers(0, 4, size=(2, 3))
    t[0, 0], t[1, 2] = 1, 3  # one ignored when ignore = 1, and one that counts
    wc = np.array([0.5, 2.0, 0.0, 1.25]) if weighted else np.ones(4)  # class 2: weight 0
    counted = (t != ignore).reshape(-1)
    per = _smoothed_cross_entropy(z.reshape(6, 4), t.reshape(6), eps, counted, wc)
    n_mean = math.fsum(wc[t.reshape(-1)][counted])
    expected = {"mean": math.fsum(per) / n_mean, "sum": math.fsum(per), "none": per.reshape(2, 3)}
    kw = dict(ignore_index=ignore, label_smoothing=eps, reduction=reduction,
              weight=to_xp(wc) if weighted else None)
    loss, cache = nn.cross_entropy_forward(to_xp(z), to_xp(t), **kw)
    np.testing.assert_allclose(to_np(loss), expected[reduction], rtol=1e-13, atol=1e-15)
    assert tuple(loss.shape) == ((2, 3) if reduction == "none" else ())
    # dlogits = dloss (s p - y) / N, s = sum_c y_c, from the closed form
    dloss = rng.standard_normal((2, 3)) if reduction == "none" else np.asarray(rng.standard_normal())
    p = np.exp(z) / np.exp(z).sum(axis=-1, keepdims=True)
    w = (t != ignore)[..., None].astype(float)
    y = w * ((1.0 - eps) * np.eye(4)[t] + eps / 4) * wc
    n = n_mean if reduction == "mean" else 1
    d = dloss[..., None] if reduction == "none" else dloss
    np.testing.assert_allclose(to_np(nn.cross_entropy_backward(to_xp(dloss), cache)[0]),
                               d * (y.sum(axis=-1, keepdims=True) * p - y) / n, rtol=1e-12, atol=1e-15)
    report = gradcheck(lambda logits: nn.cross_entropy_forward(logits, to_xp(t), **kw),
                       lambda dl, c: nn.cross_entropy_backward(dl, c)[0], [to_xp(z)], names=["logits"])
    assert report.ok, str(report)


@pytest.mark.parametrize("weighted", [False, True])
@pytest.mark.parametrize("dtype,tol", [("float64", 1e-12), ("float32", 2e-6), ("float16", 2e-3)])
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("ignore,eps", [(-100, 0.1), (2, 0.25), (0, 1.0), (-100, 0.0)])
def test_cross_entropy_reduction_and_label_smoothing_match_torch(dtype, tol, reduction, ignore, eps,
                                                                 weighted):
    """torch.nn.functional.cross_entropy(weight=, reduction=, label_smoothing=, ignore_index=)
    on the flattened logits, its gradient against a random upstream gradient; float16 logits
    (and weights) against torch's on the same float16 values in float32."""
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(32)
    z = (2.0 * rng.standard_normal((3, 4, 6))).astype(dtype)
    t = rng.integers(0, 6, size=(3, 4))
    t[0, :2] = 2 if ignore == 2 else -100 if ignore == -100 else 0
    dl = rng.standard_normal((3, 4) if reduction == "none" else ())
    wc = rng.uniform(0.25, 2.0, size=6).astype(dtype) if weighted else None
    ref_dtype = torch.float32 if dtype == "float16" else getattr(torch, dtype)
    zt = torch.tensor(z.astype(np.float64), dtype=ref_dtype, requires_grad=True)
    wt = None if wc is None else torch.tensor(wc.astype(np.float64), dtype=ref_dtype)
    lt = torch.nn.functional.cross_entropy(zt.reshape(-1, 6), torch.tensor(t).reshape(-1), weight=wt,
                                           ignore_index=ignore, label_smoothing=eps, reduction=reduction)
    lt.backward(torch.tensor(dl, dtype=ref_dtype).reshape(lt.shape))
    loss, cache = nn.cross_entropy_forward(z, t, weight=wc, ignore_index=ignore, label_smoothing=eps,
                                           reduction=reduction)
    assert loss.dtype == np.dtype(dtype)
    np.testing.assert_allclose(loss.astype(np.float64).reshape(-1), lt.detach().double().numpy().reshape(-1),
                               rtol=tol, atol=tol)
    dz = nn.cross_entropy_backward(np.asarray(dl, dtype=dtype), cache)[0]
    assert dz.dtype == np.dtype(dtype)
    np.testing.assert_allclose(dz.astype(np.float64), zt.grad.double().numpy().reshape(3, 4, 6),
                               rtol=tol, atol=tol)


def test_label_smoothing_with_a_minus_inf_logit(xp, to_xp, to_np):
    """y puts eps / V on every class, a -inf logit's too: the loss is +inf (not NaN), the
    gradient finite, p - y = -eps / V there; at eps = 1 with the target's logit -inf, +inf
    too (not 0 * inf). An ignored row with a -inf logit adds nothing."""
    z = np.array([[0.0, -np.inf, 1.0], [0.5, 0.2, -0.3]])
    for eps, t in ((0.3, [0, 1]), (1.0, [1, 0])):
        loss, cache = nn.cross_entropy_forward(to_xp(z), to_xp(np.array(t)), label_smoothing=eps,
                                               reduction="none")
        assert to_np(loss)[0] == math.inf and math.isfinite(to_np(loss)[1])
        dz = to_np(nn.cross_entropy_backward(to_xp(np.ones(2)), cache)[0])
        assert np.all(np.isfinite(dz)) and dz[0, 1] == pytest.approx(-eps / 3 - (1 - eps) * (t[0] == 1))
    loss, cache = nn.cross_entropy_forward(to_xp(z), to_xp(np.array([0, 1])), ignore_index=0,
                                           label_smoothing=0.3)
    assert float(loss) == pytest.approx(_smoothed_cross_entropy(z[1:], [1], 0.3, [True])[0], rel=1e-13)
    dz = to_np(nn.cross_entropy_backward(1.0, cache)[0])
    assert np.all(dz[0] == 0.0) and np.all(np.isfinite(dz))


def test_an_ignored_position_loses_plus_zero(xp, to_xp, to_np):
    """reduction="none": an ignored position's loss is +0.0, as torch's, with or without
    smoothing (the negated sum of its picked zeros was -0.0, printed "-0.")."""
    z = np.random.default_rng(35).standard_normal((2, 3, 4))
    t = np.array([[1, 3, 1], [0, 1, 2]])
    for eps in (0.0, 0.3):
        loss, _ = nn.cross_entropy_forward(to_xp(z), to_xp(t), ignore_index=1, label_smoothing=eps,
                                           reduction="none")
        ignored = to_np(loss)[t == 1]
        assert np.all(ignored == 0.0) and not np.any(np.signbit(ignored)), ignored


def test_cross_entropy_sum_and_none_over_no_positions(xp, to_xp, to_np):
    """A sum over no positions is 0 and "none" gives no losses, as torch; only the mean (0 / 0)
    is refused. Every target ignored: the sum is 0, each loss 0, every gradient 0."""
    for shape in ((0, 5), (2, 0, 5)):
        z, t = to_xp(np.zeros(shape)), to_xp(np.zeros(shape[:-1], np.int64))
        loss, cache = nn.cross_entropy_forward(z, t, reduction="sum")
        assert float(loss) == 0.0 and tuple(loss.shape) == ()
        assert tuple(nn.cross_entropy_backward(1.0, cache)[0].shape) == shape
        loss, _ = nn.cross_entropy_forward(z, t, reduction="none", label_smoothing=0.5)
        assert tuple(loss.shape) == shape[:-1]
    z = np.random.default_rng(33).standard_normal((2, 3, 5))
    t = np.full((2, 3), 4)
    for reduction in ("sum", "none"):
        loss, cache = nn.cross_entropy_forward(to_xp(z), to_xp(t), ignore_index=4, label_smoothing=0.2,
                                               reduction=reduction)
        assert np.all(to_np(loss) == 0.0)
        assert np.all(to_np(nn.cross_entropy_backward(2.0, cache)[0]) == 0.0)
    with raises(ValueError, "targets", "at least one target other than ignore_index = 4"):
        nn.cross_entropy_forward(to_xp(z), to_xp(t), ignore_index=4, reduction="mean")


def test_reduction_and_label_smoothing_are_checked_before_computing():
    """reduction one of the strings, label_smoothing a real number in [0, 1] (torch's range;
    not a bool); a per-position loss takes a dloss of its shape. Each refusal names the
    argument, the targets unchanged."""
    rng = np.random.default_rng(34)
    z, t = rng.standard_normal((2, 3, 5)), rng.integers(0, 5, size=(2, 3))
    before = t.copy()
    for bad, err, words in ((True, TypeError, ("bool",)), ("0.1", TypeError, ("str",)),
                            (None, TypeError, ("None",)), (-0.1, ValueError, ("-0.1",)),
                            (1.5, ValueError, ("1.5",)), (math.nan, ValueError, ("nan",)),
                            (math.inf, ValueError, ("inf",))):
        with raises(err, "label_smoothing", "real number in [0, 1]", *words):
            nn.cross_entropy_forward(z, t, label_smoothing=bad)
    for bad, err in (("avg", ValueError), ("Mean", ValueError), (None, TypeError), (0, TypeError)):
        with raises(err, "reduction", "'mean', 'sum' or 'none'"):
            nn.cross_entropy_forward(z, t, reduction=bad)
    np.testing.assert_array_equal(t, before)
    # a NumPy float and an int are real numbers
    for eps in (np.float32(0.5), 1, 0):
        loss, _ = nn.cross_entropy_forward(z, t, label_smoothing=eps)
        per = _smoothed_cross_entropy(z.reshape(6, 5), t.reshape(6), float(eps), [True] * 6)
        expected = math.fsum(per) / 6
        assert float(loss) == pytest.approx(expected, rel=1e-6)
    _, cache = nn.cross_entropy_forward(z, t, reduction="none")
    for bad in (np.ones(()), np.ones(6), np.ones((2, 3, 1))):
        with raises(ValueError, "dloss", "shape (2, 3)"):
            nn.cross_entropy_backward(bad, cache)
    with raises(TypeError, "dloss", "float64"):
        nn.cross_entropy_backward(np.ones((2, 3), np.float32), cache)
    d = rng.standard_normal((2, 3))
    np.testing.assert_allclose(nn.cross_entropy_backward(2.0, cache)[0],  # a number: every position's
                               nn.cross_entropy_backward(np.full((2, 3), 2.0), cache)[0], rtol=0, atol=0)
    np.testing.assert_allclose(nn.cross_entropy_backward(d, cache)[0].sum(axis=-1), 0.0, atol=1e-15)
    _, cache = nn.cross_entropy_forward(z, t, reduction="sum")
    with raises(ValueError, "dloss", "shape ()"):
        nn.cross_entropy_backward(np.ones((2, 3)), cache)


def _adam_reference(w, grads, lr, b1, b2, eps, weight_decay=0.0):
    """Adam written per scalar with plain floats, as in Kingma & Ba, Algorithm 1 (with the L2
    penalty added to each gradient, as torch.optim.Adam's weight_decay)."""
    w = [float(v) for v in w]
    m = [0.0] * len(w)
    v = [0.0] * len(w)
    for t, g in enumerate(grads, start=1):
        for j in range(len(w)):
            gj = g[j] + weight_decay * w[j]
            m[j] = b1 * m[j] + (1 - b1) * gj
            v[j] = b2 * v[j] + (1 - b2) * gj ** 2
            mhat = m[j] / (1 - b1**t)
            vhat = v[j] / (1 - b2**t)
            w[j] -= lr * mhat / (math.sqrt(vhat) + eps)
    return w


@pytest.mark.parametrize("weight_decay", [0.0, 1e-3, 0.5])
def test_adam_matches_scalar_reference(xp, to_xp, to_np, weight_decay):
    rng = np.random.default_rng(6)
    w0 = rng.standard_normal(5)
    grads = [rng.standard_normal(5) for _ in range(4)]
    params = {"w": to_xp(w0)}
    state = nn.adam_init(params)
    for g in grads:
        params, state = nn.adam_step(params, {"w": to_xp(g)}, state, lr=0.05, betas=(0.8, 0.99),
                                     eps=1e-8, weight_decay=weight_decay)
    assert state.t == 4
    expected = _adam_reference(w0, grads, 0.05, 0.8, 0.99, 1e-8, weight_decay)
    np.testing.assert_allclose(to_np(params["w"]), expected, rtol=1e-12, atol=1e-12)


def test_adam_init_gives_each_moment_arrays_of_its_own():
    """Zero moments of the parameter's shape and dtype, m and v apart: a caller who writes
    into one in place (as torch.optim.Adam's own state is written) leaves the other at 0."""
    params = {"w": np.ones((2, 3), dtype=np.float32), "b": np.ones(3)}
    state = nn.adam_init(params)
    for k, p in params.items():
        for moment in (state.m[k], state.v[k]):
            assert moment.shape == p.shape and moment.dtype == p.dtype
            np.testing.assert_array_equal(moment, 0.0)
        state.m[k][...] = 1.0
        np.testing.assert_array_equal(state.v[k], 0.0)
    assert state.t == 0 and state.m is not state.v


def test_adam_first_step_is_lr_times_sign_and_writes_nothing():
    g = np.array([3.0, -0.01, 1e-3])
    w = np.array([1.0, 2.0, 3.0])
    params, grads = {"w": w}, {"w": g}
    state = nn.adam_init(params)
    new, _ = nn.adam_step(params, grads, state, lr=0.1, eps=0.0)
    np.testing.assert_allclose(new["w"], w - 0.1 * np.sign(g), rtol=1e-12)
    np.testing.assert_array_equal(params["w"], [1.0, 2.0, 3.0])  # input untouched
    np.testing.assert_array_equal(state.m["w"], 0.0)


def test_adam_counts_each_parameters_own_updates():
    """A parameter without a gradient in a step keeps its moments and its count: its first update
    is a first step, lr times the gradient's sign (bias-corrected with its own t = 1, not the
    step count), as torch.optim.Adam's per-parameter state does."""
    params = {"a": np.array([1.0, 2.0]), "b": np.array([3.0, 4.0])}
    state = nn.adam_init(params)
    ga, gb = np.array([0.5, -2.0]), np.array([-0.3, 7.0])
    params, state = nn.adam_step(params, {"a": ga, "b": None}, state, lr=0.1, eps=0.0)
    assert state.t == 1 and state.steps == {"a": 1, "b": 0}
    params, state = nn.adam_step(params, {"a": ga}, state, lr=0.1, eps=0.0)  # b left out
    np.testing.assert_array_equal(params["b"], [3.0, 4.0])
    np.testing.assert_array_equal(state.m["b"], 0.0)
    params, state = nn.adam_step(params, {"a": ga, "b": gb}, state, lr=0.1, eps=0.0)
    np.testing.assert_allclose(params["b"], [3.0 + 0.1, 4.0 - 0.1], rtol=1e-14)
    np.testing.assert_allclose(params["a"], [1.0 - 0.3, 2.0 + 0.3], rtol=1e-14)  # 3 equal steps
    assert state.t == 3 and state.steps == {"a": 3, "b": 1}


def test_adam_matches_torch_with_gradients_left_out():
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(8)
    params = {"a": rng.standard_normal(3), "b": rng.standard_normal((2, 2))}
    tp = {k: torch.tensor(v, requires_grad=True) for k, v in params.items()}
    opt = torch.optim.Adam(list(tp.values()), lr=0.1, betas=(0.8, 0.95), weight_decay=0.01)
    state = nn.adam_init(params)
    for step in range(5):
        grads = {"a": rng.standard_normal(3), "b": None if step in (0, 2) else rng.standard_normal((2, 2))}
        for k in tp:
            tp[k].grad = None if grads[k] is None else torch.tensor(grads[k])
        opt.step()
        params, state = nn.adam_step(params, grads, state, lr=0.1, betas=(0.8, 0.95), weight_decay=0.01)
    assert state.steps == {"a": 5, "b": 3}
    for k in params:
        np.testing.assert_allclose(params[k], tp[k].detach().numpy(), rtol=1e-13, atol=1e-15)


def test_adam_minimises_a_quadratic():
    rng = np.random.default_rng(7)
    target = rng.standard_normal(4)
    params = {"w": np.zeros(4)}
    state = nn.adam_init(params)
    for _ in range(500):
        params, state = nn.adam_step(params, {"w": 2.0 * (params["w"] - target)}, state, lr=0.05)
    np.testing.assert_allclose(params["w"], target, atol=1e-3)


def test_adam_on_dask_returns_computed_parameters_and_moments():
    # a training loop on dask: unless each step's parameters and moments are computed and kept
    # (persisted), the next step's graph holds every earlier step, and every step that reads a
    # number (the loss, the gradient norm) computes them all again, quadratic in the steps
    # (npattn demo --backend dask: 20 steps in 11 s, 80 in 180 s)
    da = pytest.importorskip("dask.array", reason="needs dask: pip install '.[dask]'")
    rng = np.random.default_rng(7)
    w0, target = rng.standard_normal(6), rng.standard_normal(6)
    params = {"w": da.from_array(w0, chunks=3)}
    state = nn.adam_init(params)
    for _ in range(4):
        grad = 2.0 * (params["w"] - da.from_array(target, chunks=3))  # of |w - target|^2
        params, state = nn.adam_step(params, {"w": grad}, state, lr=0.1, betas=(0.8, 0.99))
        for name, a in (("w", params["w"]), ("m", state.m["w"]), ("v", state.v["w"])):
            # a persisted array's graph holds its two chunks and no task that makes them
            assert len(dict(a.__dask_graph__())) == 2, name
    # the values: Adam per scalar with plain floats (Kingma & Ba, Algorithm 1)
    w, m, v = [float(x) for x in w0], [0.0] * 6, [0.0] * 6
    for t in range(1, 5):
        for j in range(6):
            g = 2.0 * (w[j] - target[j])
            m[j] = 0.8 * m[j] + 0.2 * g
            v[j] = 0.99 * v[j] + 0.01 * g * g
            w[j] -= 0.1 * (m[j] / (1 - 0.8**t)) / (math.sqrt(v[j] / (1 - 0.99**t)) + 1e-8)
    np.testing.assert_allclose(params["w"].compute(), w, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(state.m["w"].compute(), m, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("weight_decay", [0.0, 0.01])
def test_adam_on_dask_is_one_task_per_chunk_and_numpy_s_bits(monkeypatch, weight_decay):
    """On dask a parameter's update (its new value and moments) is one task per chunk and
    output (backend.elementwise), where its dozen operations one by one made a dozen each
    (the Adam step of a 2-block GPT's 36 parameters on dask: 236-293 ms, 96-124 ms so). The numbers
    are NumPy's bit for bit, in float32, with a 0-d parameter and a gradient whose chunks
    are not the parameter's."""
    da = pytest.importorskip("dask.array", reason="needs dask: pip install '.[dask]'")
    rng = np.random.default_rng(5)
    host = {"w": rng.standard_normal((4, 6)).astype(np.float32), "b": np.asarray(0.3, dtype=np.float32)}
    chunks = {"w": (2, 6), "b": ()}
    lazy = {k: da.from_array(a, chunks=chunks[k]) for k, a in host.items()}
    host_state, lazy_state = nn.adam_init(host), nn.adam_init(lazy)
    real, made, inputs = nn.persisted, [], []

    def recording(*arrays):  # the number of tasks in each array's graph, before the persist
        if hasattr(arrays[0], "dask"):
            made.append([len(dict(a.__dask_graph__())) for a in arrays])
        return real(*arrays)

    monkeypatch.setattr(nn, "persisted", recording)
    for step in range(3):
        grads = {k: rng.standard_normal(a.shape).astype(np.float32) for k, a in host.items()}
        host, host_state = nn.adam_step(host, grads, host_state, lr=0.1, weight_decay=weight_decay)
        given = {k: da.from_array(g, chunks=chunks[k] if step else -1) for k, g in grads.items()}
        inputs.append({k: len({**dict(lazy[k].__dask_graph__()), **dict(given[k].__dask_graph__()),
                               **dict(lazy_state.m[k].__dask_graph__()),
                               **dict(lazy_state.v[k].__dask_graph__())}) for k in host})
        lazy, lazy_state = nn.adam_step(lazy, given, lazy_state, lr=0.1, weight_decay=weight_decay)
        for name in host:
            for got, want in ((lazy[name], host[name]), (lazy_state.m[name], host_state.m[name]),
                              (lazy_state.v[name], host_state.v[name])):
                got = got.compute()
                assert got.dtype == np.float32 and got.shape == want.shape
                np.testing.assert_array_equal(got, want, err_msg=f"{name}, step {step}")
    # from the second step on (the chunks of the gradient are the parameter's): the update adds
    # two tasks per chunk to its inputs' (one that runs it, one that takes an output from it)
    for tasks, before in zip(made[1:], inputs[1:]):
        for name, outputs, n_chunks in (("w", tasks[0::2], 2), ("b", tasks[1::2], 1)):
            assert all(n - before[name] <= 2 * n_chunks for n in outputs), (name, tasks, before)


def test_clip_grad_norm_scales_to_max_norm_and_keeps_small_gradients(xp, to_xp, to_np):
    rng = np.random.default_rng(3)
    a, b = rng.standard_normal((3, 4)), rng.standard_normal(5)
    total = float(np.sqrt(np.sum(a * a) + np.sum(b * b)))  # computed here, independently
    grads = {"a": to_xp(a.copy()), "b": to_xp(b.copy()), "none": None}  # (to_xp may share a's memory)
    clipped, norm = nn.clip_grad_norm(grads, 0.5 * total)
    assert abs(norm - total) < 1e-12 * total
    got = math.sqrt(sum(float(np.sum(to_np(clipped[k]) ** 2)) for k in ("a", "b")))
    assert abs(got - 0.5 * total) < 1e-6 * total  # eps = 1e-6 in the denominator
    # each gradient times max_norm / (total + eps) with the default eps = 1e-6: it moves the
    # factor by eps / total, about 2.5e-7 here, far beyond float64's rounding (1e-14)
    scale = 0.5 * total / (total + 1e-6)
    np.testing.assert_allclose(to_np(clipped["a"]), a * scale, rtol=1e-14, atol=0)
    np.testing.assert_allclose(to_np(clipped["b"]), b * scale, rtol=1e-14, atol=0)
    np.testing.assert_allclose(to_np(clipped["a"]) / a, (to_np(clipped["b"]) / b)[0])  # one factor
    assert clipped["none"] is None
    np.testing.assert_array_equal(to_np(grads["a"]), a)  # the input dict's arrays are not written
    kept, _ = nn.clip_grad_norm(grads, 2.0 * total)
    np.testing.assert_array_equal(to_np(kept["a"]), a)
    kept["a"] = None  # a new dict when nothing is scaled too: the caller's keeps its entries
    assert kept is not grads and grads["a"] is not None


def _zero_view(xp, shape):
    """float32 zeros of ``shape``, a broadcast view of one entry: an array of any size, in no memory."""
    return xp.broadcast_to(xp.zeros((1,) * len(shape), dtype=xp.float32), shape)


@pytest.mark.parametrize("build, match", [
    (lambda xp: nn.one_hot(xp, xp.zeros(64, dtype=xp.int64), 2**56, "float32"),
     rf"^ids and n: expected sizes for which the one-hot rows, an array of shape \(64, {2**56}\) "
     rf"\(4 bytes an entry\), .*got {2**64} bytes$"),
    # no ids, but the classes 0, ..., n - 1 they are compared with are made all the same
    (lambda xp: nn.one_hot(xp, xp.zeros(0, dtype=xp.int64), 2**61, "float64"),
     rf"^n: expected sizes for which the classes 0, \.\.\., n - 1, an array of shape \({2**61},\) "
     rf"\(8 bytes an entry\)"),
    (lambda xp: nn.embedding_forward(xp.zeros(64, dtype=xp.int64), _zero_view(xp, (2**56, 1))),
     rf"^ids and table: expected sizes for which the one-hot rows of ids, an array of shape "
     rf"\(64, {2**56}\) \(4 bytes an entry\)"),
    (lambda xp: nn.embedding_forward(xp.zeros(64, dtype=xp.int64), _zero_view(xp, (1, 2**56))),
     rf"^ids and table: expected sizes for which the rows looked up, an array of shape "
     rf"\(64, {2**56}\) \(4 bytes an entry\)"),
])
def test_a_one_hot_or_lookup_that_cannot_exist_is_refused_naming_its_sizes(xp, build, match):
    """One-hot rows (..., n), their classes, or looked-up rows larger than the largest array
    (sys.maxsize bytes) are refused by name before anything is made (the tables are broadcast
    views in no memory; the library's own error came from the classes, n long, or named nothing)."""
    import sys

    with pytest.raises(ValueError, match=match) as info:
        build(xp)
    assert f"fits in {sys.maxsize} bytes (the largest array)" in str(info.value)


def _targets_not_read(*args, **kwargs):
    raise AssertionError("the targets were read before the sizes were checked")


def test_a_cross_entropy_whose_float32_copy_cannot_exist_is_refused_naming_logits(xp, monkeypatch):
    """float16 logits of 3 * 2**60 entries (a broadcast view in no memory) could exist, in
    3 * 2**61 bytes, but their float32 copy, 3 * 2**62 bytes, could not: refused naming logits
    before anything is made or the targets are read (their check is replaced by one that fails
    the test: reading 2**60 targets takes hours)."""
    import sys

    if not hasattr(xp, "float16"):
        pytest.skip("no float16 on this backend")
    shape = (2**60, 3)
    logits = xp.broadcast_to(xp.zeros((1, 1), dtype=xp.float16), shape)
    targets = xp.broadcast_to(xp.zeros((1,), dtype=xp.int8), shape[:1])
    monkeypatch.setattr(Vd, "check_ids", _targets_not_read)
    for reduction in ("mean", "none"):
        with pytest.raises(ValueError, match=rf"^logits: expected sizes for which the float32 copy of the "
                                             rf"logits, an array of shape \({2**60}, 3\) \(4 bytes an "
                                             rf"entry\), fits in {sys.maxsize} bytes \(the largest "
                                             rf"array\), got {3 * 2**62} bytes$"):
            nn.cross_entropy_forward(logits, targets, reduction=reduction)


def test_a_cross_entropy_whose_classes_cannot_exist_is_refused_naming_logits(xp):
    """float32 logits of one position and V = 2**60 classes (a broadcast view) could exist, but
    not the classes 0, ..., V - 1 the targets are compared with, 8 bytes each: refused naming
    logits before anything is made (the library's own error named nothing)."""
    import sys

    logits = _zero_view(xp, (1, 2**60))
    with pytest.raises(ValueError, match=rf"^logits: expected sizes for which the classes 0, \.\.\., "
                                         rf"V - 1, an array of shape \({2**60},\) \(8 bytes an "
                                         rf"entry\), fits in {sys.maxsize} bytes"):
        nn.cross_entropy_forward(logits, xp.zeros((1,), dtype=xp.int64))


@pytest.mark.parametrize("max_norm", [0.5, 1e6])  # clipped, and kept as they are
def test_clip_grad_norm_on_dask_computes_the_gradients_once(max_norm):
    """Gradients on dask that share one upstream graph (as a backward's do): their norm reads
    one sum per array, and each sum computed the whole graph again (the digits demo on dask:
    72 s an epoch, 27 s with the gradients computed once). Each chunk of the upstream runs once
    in the call, and not again when the gradients returned are read or stepped with Adam; the
    norm and the gradients are NumPy's."""
    da = pytest.importorskip("dask.array", reason="needs dask: pip install '.[dask]'")
    import dask

    rng = np.random.default_rng(11)
    host = rng.standard_normal(8)
    calls = []

    def counted(block):
        calls.append(block.shape)
        return block

    with dask.config.set(scheduler="sync"):  # the calls are counted in this process
        base = da.from_array(host, chunks=4).map_blocks(counted, meta=host[:0])  # 2 chunks
        grads = {"a": base * 2.0, "b": base - 1.0, "c": base[:3], "none": None}
        new, total = nn.clip_grad_norm(grads, max_norm)
        assert len(calls) == 2, calls  # each upstream chunk once
        want = {"a": host * 2.0, "b": host - 1.0, "c": host[:3]}
        norm = math.sqrt(sum(float(np.sum(g * g)) for g in want.values()))
        assert total == pytest.approx(norm, rel=1e-14)
        c = min(max_norm / (norm + 1e-6), 1.0)
        for k, g in want.items():
            np.testing.assert_allclose(new[k].compute(), g * c, rtol=1e-14, atol=0)
        assert new["none"] is None
        params = {k: da.zeros(g.shape, chunks=4) for k, g in want.items()}
        nn.adam_step(params, {k: new[k] for k in want}, nn.adam_init(params))
        assert nn.global_norm(grads) == pytest.approx(norm, rel=1e-14)
        assert len(calls) == 4, calls  # global_norm's: one more pass, none from the steps above


@pytest.mark.parametrize("clip", [False, True])
def test_global_norm_on_dask_reads_its_sums_in_one_graph(clip):
    """The norm of gradients on dask, once they are computed, read one sum per array, each
    in a graph of its own: a training step of a 2-block GPT ran 36 (85 ms of a step on a
    2-core machine, 49 ms in one graph). The scheduler now runs twice: the gradients, then
    every sum; the norm is NumPy's."""
    da = pytest.importorskip("dask.array", reason="needs dask: pip install '.[dask]'")
    import dask

    rng = np.random.default_rng(12)
    host = {k: rng.standard_normal(n) for k, n in zip("abcde", (3, 4, 5, 6, 7))}
    runs = []

    def counting_scheduler(dsk, keys, **kwargs):
        runs.append(keys)
        return dask.get(dsk, keys, **kwargs)

    grads = {k: da.from_array(g, chunks=2) * 1.0 for k, g in host.items()}
    want = math.sqrt(sum(math.fsum(float(x) ** 2 for x in g) for g in host.values()))
    with dask.config.set(scheduler=counting_scheduler):
        got = nn.clip_grad_norm(grads, 1e6)[1] if clip else nn.global_norm(grads)
    assert len(runs) == 2, runs
    assert got == pytest.approx(want, rel=1e-14)


@pytest.mark.parametrize("ignore_index", [None, 3])
def test_ids_on_dask_are_read_in_one_pass(ignore_index):
    """The range check of ids on dask read their smallest and largest value in two graphs
    (with ignore_index: whether any counts, the smallest and the largest in three), each a
    pass over the ids and whatever computes them. Each chunk of the ids now runs once in
    embedding_forward's check (and once more in the cross-entropy's count of the targets
    that count, with ignore_index); the results are NumPy's, and out of range is still
    refused."""
    da = pytest.importorskip("dask.array", reason="needs dask: pip install '.[dask]'")
    import dask

    rng = np.random.default_rng(13)
    host = rng.integers(0, 5, (4, 6))
    host[0, :2] = 3
    w = rng.standard_normal((5, 2))
    logits = rng.standard_normal((4, 6, 5))
    calls = []

    def counted(block):
        calls.append(block.shape)
        return block

    ids = da.from_array(host, chunks=(2, 6)).map_blocks(counted, meta=host[:0])  # 2 chunks
    with dask.config.set(scheduler="sync"):  # the calls are counted in this process
        e, _ = nn.embedding_forward(ids, da.from_array(w))
        assert len(calls) == 2, calls
        np.testing.assert_array_equal(e.compute(), w[host])
        calls.clear()
        loss, _ = nn.cross_entropy_forward(da.from_array(logits), ids, ignore_index=ignore_index)
        assert len(calls) == (2 if ignore_index is None else 4), calls
        z = logits - logits.max(axis=-1, keepdims=True)
        nll = np.log(np.exp(z).sum(axis=-1)) - np.take_along_axis(z, host[..., None], -1)[..., 0]
        keep = np.ones(host.shape, bool) if ignore_index is None else host != ignore_index
        np.testing.assert_allclose(float(loss), nll[keep].mean(), rtol=1e-12)
        with pytest.raises(ValueError, match=r"ids: expected token ids in \[0, 4\), got values in \[0, 4\]"):
            nn.embedding_forward(ids, da.from_array(w[:4]))


def test_clip_grad_norm_and_adam_keep_a_0_d_array_an_array(xp, to_xp, to_np):
    """A 0-d gradient or parameter comes back as a 0-d array of its library and dtype: NumPy's
    arithmetic on 0-d arrays gives a NumPy scalar (np.float64), which clipping and Adam's
    parameter and moments returned in place of the array."""
    w, g = to_xp(np.asarray(0.5)), to_xp(np.asarray(-3.0))

    def check(a, expected):
        assert type(a) is type(w) and tuple(a.shape) == () and a.dtype == w.dtype, (type(a), a)
        assert abs(float(to_np(a)) - expected) <= 1e-12 * abs(expected), (float(to_np(a)), expected)

    clipped, total = nn.clip_grad_norm({"g": g}, 2.0, eps=0.0)
    assert total == 3.0
    check(clipped["g"], -2.0)
    params, state = {"w": w}, nn.adam_init({"w": w})
    for t in (1, 2):  # the second step takes the first's state; Adam's first step is lr * sign(g)
        params, state = nn.adam_step(params, {"w": g}, state, lr=0.1, betas=(0.5, 0.75), eps=0.0)
        check(state.m["w"], -3.0 * (1.0 - 0.5**t))
        check(state.v["w"], 9.0 * (1.0 - 0.75**t))
        check(params["w"], 0.5 + 0.1 * t)


def test_clip_grad_norm_of_zero_gradients_with_eps_0_keeps_them():
    """A joint norm of 0 with eps = 0: c = max_norm / 0 is inf (torch's tensor division), so
    nothing is scaled and the total is 0.0; also with no gradient at all. Before, Python's
    float division raised ZeroDivisionError."""
    for grads in ({"a": np.zeros((2, 3)), "b": np.zeros(4), "c": None}, {}, {"c": None}):
        clipped, total = nn.clip_grad_norm(grads, 1.0, eps=0.0)
        assert total == 0.0 and clipped.keys() == grads.keys()
        for k, g in grads.items():
            assert (clipped[k] is None) if g is None else np.array_equal(clipped[k], g)


def test_clip_grad_norm_matches_torch():
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(4)
    arrays = [rng.standard_normal((4, 3)), rng.standard_normal(7)]
    ts = [torch.zeros(x.shape, dtype=torch.float64, requires_grad=True) for x in arrays]
    for t, x in zip(ts, arrays):
        t.grad = torch.from_numpy(x.copy())
    norm_t = torch.nn.utils.clip_grad_norm_(ts, 1.5)
    clipped, norm = nn.clip_grad_norm({"a": arrays[0], "b": arrays[1]}, 1.5)
    assert abs(norm - float(norm_t)) < 1e-12
    for t, k in zip(ts, ("a", "b")):
        np.testing.assert_allclose(clipped[k], t.grad.numpy(), rtol=1e-14, atol=0)


def _norm_of(arrays):
    """The 2-norm of the entries of ``arrays``, in 60-digit decimals: no square overflows."""
    with decimal.localcontext() as ctx:
        ctx.prec = 60
        return float(sum((decimal.Decimal(float(v)) ** 2 for a in arrays for v in np.ravel(a)),
                         decimal.Decimal(0)).sqrt())


# warnings are errors: the overflow of the squares or of their sum is what the sum taken
# again from the scaled arrays is for, so NumPy's overflow warning would be a false alarm
@pytest.mark.filterwarnings("error")
@pytest.mark.parametrize("dtype, big", [("float32", 1e20), ("float32", 3e38), ("float32", 1.5e19),
                                        ("float64", 1e200), ("float64", 1.2e154)])
def test_clip_grad_norm_of_finite_gradients_whose_squares_overflow(xp, to_xp, to_np, dtype, big):
    """Entries of 1e20 in float32 (their squares overflow past 3.4e38) or 1e200 in float64: the
    sum of squares is inf, which gave total = inf and scaled every gradient to 0 (as torch's).
    total is the norm, and the gradients are scaled by max_norm / total, a float16 one too.
    With 1.5e19 (float32) or 1.2e154 (float64) no square overflows, but their sum does. No
    warning is raised on any backend."""
    if dtype == "float64" and not hasattr(xp, "float64"):
        pytest.skip("no float64 on this backend")
    rng = np.random.default_rng(16)
    a = (big * rng.uniform(0.25, 1.0, (3, 4)) * rng.choice([-1.0, 1.0], (3, 4))).astype(dtype)
    b = rng.standard_normal(5).astype(dtype)
    arrays = {"a": a, "b": b}
    if hasattr(xp, "float16"):
        arrays["h"] = rng.standard_normal(4).astype(np.float16) * 1000.0
    grads = {k: xp.astype(to_xp(v), getattr(xp, v.dtype.name)) for k, v in arrays.items()}
    expected = _norm_of(arrays.values())
    assert math.isfinite(expected) and expected > big
    clipped, total = nn.clip_grad_norm(grads, 2.0)
    rtol = 1e-6 if dtype == "float32" else 1e-14
    assert abs(total - expected) <= rtol * expected, (total, expected)
    for k, v in arrays.items():  # each scaled by 2 / total, to within its dtype's rounding
        got = to_np(clipped[k])
        assert got.dtype == v.dtype
        fi = np.finfo(v.dtype)
        np.testing.assert_allclose(got.astype(np.float64), v.astype(np.float64) * (2.0 / expected),
                                   rtol=rtol if v.dtype != np.float16 else 1e-3,
                                   atol=4.0 * float(fi.smallest_subnormal))  # (the float16 one's are 0)
    assert abs(_norm_of(to_np(clipped[k]) for k in ("a", "b")) - 2.0) <= 1e-5


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # inf * 0, and NumPy's NaN warnings
def test_clip_grad_norm_of_infinite_or_nan_gradients_is_torch_s():
    """An infinite entry makes total inf and the factor 0: finite entries become 0 and the
    infinite one NaN (inf * 0); a NaN entry makes total and every gradient NaN, as torch's
    clip_grad_norm_ (error_if_nonfinite=False) on the same gradients."""
    torch = pytest.importorskip("torch")
    for bad in (math.inf, -math.inf, math.nan):
        arrays = [np.array([bad, 1.0, 1e20], np.float32), np.array([3.0, -2.0], np.float32)]
        ts = [torch.zeros(2 if i else 3, requires_grad=True) for i in range(2)]
        for t, x in zip(ts, arrays):
            t.grad = torch.from_numpy(x.copy())
        norm_t = float(torch.nn.utils.clip_grad_norm_(ts, 1.0))
        clipped, total = nn.clip_grad_norm({"a": arrays[0], "b": arrays[1]}, 1.0)
        assert total == norm_t or (math.isnan(total) and math.isnan(norm_t)), (total, norm_t)
        assert (math.isnan(total) if math.isnan(bad) else total == math.inf)
        for t, k in zip(ts, ("a", "b")):
            np.testing.assert_array_equal(clipped[k], t.grad.numpy())


@pytest.mark.parametrize("bad, exc", [(0, ValueError), (-1.0, ValueError), (float("nan"), ValueError),
                                      (True, TypeError), ("1", TypeError), (None, TypeError)])
def test_clip_grad_norm_rejects_bad_max_norm(bad, exc):
    received = {0: "0", -1.0: "-1.0", True: "bool True", "1": "str '1'", None: "None"}.get(bad, "nan")
    expected = "a real number" if exc is TypeError else "a finite number > 0"
    with pytest.raises(exc, match=rf"^max_norm: expected {expected}, got {received}$"):
        nn.clip_grad_norm({"a": np.ones(2)}, bad)


@pytest.mark.parametrize("bad, exc", [(-1.0, ValueError), (float("nan"), ValueError), (float("inf"), ValueError),
                                      (True, TypeError), ("1e-6", TypeError)])
def test_clip_grad_norm_rejects_bad_eps(bad, exc):
    """eps is a finite number >= 0 (a negative one could divide by total + eps = 0)."""
    received = {True: "bool True", "1e-6": "str '1e-6'"}.get(bad, repr(bad))
    expected = "a real number" if exc is TypeError else "a finite number >= 0"
    with pytest.raises(exc, match=rf"^eps: expected {expected}, got {re.escape(received)}$"):
        nn.clip_grad_norm({"a": np.ones(2)}, 1.0, eps=bad)


def test_clip_grad_norm_takes_numpy_numbers():
    for max_norm in (np.float32(1.0), np.int64(1)):
        clipped, total = nn.clip_grad_norm({"a": np.full(4, 1.0)}, max_norm)
        assert total == 2.0
        np.testing.assert_allclose(clipped["a"], np.full(4, 0.5), rtol=1e-6)


def test_adam_checks_its_arguments_before_writing_anything():
    params = {"w": np.ones(2)}
    state = nn.adam_init(params)
    cases = [
        (dict(grads={"b": np.ones(2)}), ValueError, r"^grads: expected names of params \['w'\], got \['b'\]"),
        (dict(grads={"w": np.ones(3)}), ValueError, r"^grads\['w'\]: expected shape \(2,\)"),
        (dict(grads=[np.ones(2)]), TypeError, "^grads: expected a dict"),
        (dict(state=nn.AdamState(state.m, state.v, "x")), TypeError, r"^state\.t: expected an int >= 0"),
        (dict(state=nn.AdamState(state.m, state.v, -1)), ValueError, r"^state\.t: expected an int >= 0, got -1"),
        (dict(state=nn.adam_init({"v": np.ones(2)})), ValueError, "^state: expected the Adam moments"),
        (dict(state=nn.adam_init({"w": np.ones(3)})), ValueError, r"^state\.m\['w'\]: expected shape \(2,\)"),
        (dict(state=nn.adam_init({"w": np.ones(2, np.float32)})), TypeError,
         r"^state\.m\['w'\]: expected dtype float64 \(that of params\['w'\]\)"),
        (dict(state=state._replace(v={"w": [0.0, 0.0]})), TypeError, r"^state\.v\['w'\]: expected a numpy array"),
        (dict(params={"w": [1.0, 1.0]}), TypeError, r"^params\['w'\]: expected an array, got list"),
        # gradients of the parameter's library and dtype (a float32 one promoted nothing, but a
        # float64 one for a float32 parameter did; a list raised AttributeError)
        (dict(grads={"w": [1.0, 1.0]}), TypeError, r"^grads\['w'\]: expected a numpy array"),
        (dict(grads={"w": np.ones(2, np.float32)}), TypeError,
         r"^grads\['w'\]: expected dtype float64 \(that of params\['w'\]\), got float32"),
        (dict(grads={"w": np.ones(2, np.int64)}), TypeError, r"^grads\['w'\]: expected dtype float64"),
        (dict(state=state._replace(steps={"w": -1})), ValueError, r"^state\.steps\['w'\]: expected an int >= 0"),
        (dict(state=state._replace(steps={"v": 1})), ValueError, r"^state\.steps: expected None or a dict"),
        (dict(lr=-0.1), ValueError, "^lr"), (dict(eps=float("inf")), ValueError, "^eps"),
        (dict(betas=(0.9, 1.0)), ValueError, r"^betas\[1\]: expected a number in \[0, 1\), got 1\.0$"),
        (dict(weight_decay="0"), TypeError, "^weight_decay"),
        # an int beyond the float range is out of [0, 1) too (it raised OverflowError), told
        # by its size, not its 401 digits
        (dict(betas=(10**400, 0.9)), ValueError,
         r"^betas\[0\]: expected a number in \[0, 1\), got an int too large for a float \(1329 bits\)$"),
        (dict(betas=(-1, 0.9)), ValueError, r"^betas\[0\]: expected a number in \[0, 1\), got -1$"),
        # a wrong type is a TypeError, naming the entry
        (dict(betas=(False, 0.999)), TypeError,
         r"^betas\[0\]: expected a real number in \[0, 1\), got bool False$"),
        (dict(betas=(0.9, np.bool_(True))), TypeError,
         r"^betas\[1\]: expected a real number in \[0, 1\), got numpy\.bool np\.True_$"),
        (dict(betas=(0.9, "0.99")), TypeError,
         r"^betas\[1\]: expected a real number in \[0, 1\), got str '0\.99'$"),
        (dict(betas=0.9), TypeError,
         r"^betas: expected a tuple \(or list\) of two numbers in \[0, 1\), got float 0\.9$"),
        (dict(betas=[0.9]), ValueError,
         r"^betas: expected two numbers in \[0, 1\), got a list of 1: \[0\.9\]$"),
        (dict(betas=(0.9, 0.999, 0.5)), ValueError,
         r"^betas: expected two numbers in \[0, 1\), got a tuple of 3: \(0\.9, 0\.999, 0\.5\)$"),
        # an AdamState, not a plain tuple of its fields; moments of exactly the parameters' names
        (dict(state=(state.m, state.v, 0)), TypeError, r"^state: expected an npattn\.nn\.AdamState"),
        (dict(state=state._replace(m={**state.m, "b": np.zeros(2)})), ValueError,
         "^state: expected the Adam moments"),
    ]
    for change, exc, match in cases:
        args = dict(params=params, grads={"w": np.ones(2)}, state=state)
        args.update(change)
        with pytest.raises(exc, match=match):
            nn.adam_step(args.pop("params"), args.pop("grads"), args.pop("state"), **args)
    np.testing.assert_array_equal(params["w"], 1.0)
    assert state.t == 0


def test_adam_step_refuses_integer_parameters_as_adam_init_does():
    """Before, integer parameters, gradients and moments came back as float64 parameters."""
    params, grads = {"w": np.arange(3)}, {"w": np.ones(3, np.int64)}
    state = nn.AdamState({"w": np.zeros(3, np.int64)}, {"w": np.zeros(3, np.int64)}, 0)
    with raises(TypeError, "params['w']", "real floating", "int64"):
        nn.adam_step(params, grads, state)
    with raises(TypeError, "params['w']", "real floating", "int64"):
        nn.adam_init(params)
    np.testing.assert_array_equal(params["w"], [0, 1, 2])
    assert state.t == 0 and np.all(state.m["w"] == 0) and np.all(state.v["w"] == 0)


def test_embedding_positions_and_tables_check_their_arguments():
    """dout of the forward's shape, library and dtype; pos an array of x's library and dtype;
    sinusoidal sizes ints. Before, a float64 dout or pos promoted a float32 model silently, a
    dout of another shape was reshaped or summed, a list raised AttributeError and D=0
    ZeroDivisionError."""
    x = np.ones((2, 3, 4), np.float32)
    pos = np.zeros((3, 4), np.float32)
    _, pc = nn.add_positions_forward(x, pos)
    table = np.ones((5, 4), np.float32)
    _, ec = nn.embedding_forward(np.array([[0, 1]]), table)
    cases = [
        (lambda: nn.add_positions_forward(x, pos.astype(np.float64)), TypeError,
         r"^pos: expected dtype float32 \(that of x\), got float64"),
        (lambda: nn.add_positions_forward(x, [[0.0] * 4] * 3), TypeError, "^pos: expected a numpy array"),
        (lambda: nn.add_positions_forward(np.ones((2, 3, 4), np.int64), pos), TypeError,
         "^x: expected a real floating dtype"),
        (lambda: nn.add_positions_backward(np.ones((7, 3, 4), np.float32), pc), ValueError,
         r"^dout: expected shape \(2, 3, 4\)"),
        (lambda: nn.add_positions_backward(np.ones((2, 3, 4)), pc), TypeError,
         "^dout: expected dtype float32"),
        (lambda: nn.embedding_backward(np.ones((2, 4), np.float32), ec), ValueError,
         r"^dout: expected shape \(1, 2, 4\)"),
        (lambda: nn.embedding_backward(np.ones((1, 2, 4)), ec), TypeError, "^dout: expected dtype float32"),
        (lambda: nn.embedding_backward(np.ones((1, 2, 4), np.float32), pc), TypeError,
         "^cache: expected a EmbeddingCache"),
        (lambda: nn.sinusoidal_positions(np, 4, 0), ValueError, "^D: expected a positive int, got 0"),
        (lambda: nn.sinusoidal_positions(np, -1, 4), ValueError, "^L: expected an int >= 0, got -1"),
        (lambda: nn.sinusoidal_positions(np, 2.5, 4), TypeError, "^L: expected an int >= 0"),
        (lambda: nn.sinusoidal_positions("nump", 2, 4), ValueError, "^xp: expected one of"),
        (lambda: nn.one_hot(np, np.array([7]), 3, np.float64), ValueError,
         r"^ids: expected class indices in \[0, 3\), got values in \[7, 7\]"),
        (lambda: nn.one_hot(np, [1], 3, np.float64), TypeError, "^ids: expected a numpy array"),
        # no classes is refused by name, even for no ids (a (0, 0) one-hot otherwise)
        (lambda: nn.one_hot(np, np.zeros(0, np.int64), 0, np.float64), ValueError,
         "^n: expected a positive int, got 0"),
        # a table has two axes (V, D): a third is refused, not looked up into a reshape error
        (lambda: nn.embedding_forward(np.array([0]), np.ones((5, 4, 1), np.float32)), ValueError,
         r"^table: expected shape \(V, D\), got \(5, 4, 1\)"),
        # x has a sequence axis: a 1-D x would be added to a 1-D pos of its shape
        (lambda: nn.add_positions_forward(np.ones(4, np.float32), np.ones(4, np.float32)), ValueError,
         r"^x: expected shape \(B, L, D\), got \(4,\)"),
        (lambda: nn.adam_init(None), TypeError, "^params: expected a dict of arrays, got None"),
        (lambda: nn.adam_init({"w": [1.0]}), TypeError, r"^params\['w'\]: expected an array, got list"),
        (lambda: nn.clip_grad_norm({"w": [3.0, 4.0]}, 1.0), TypeError,
         r"^grads\['w'\]: expected an array, got list"),
    ]
    for call, exc, match in cases:
        with pytest.raises(exc, match=match):
            call()
    # the right arguments still work, with the numbers the definitions give
    dx, dpos = nn.add_positions_backward(np.full((2, 3, 4), 0.5, np.float32), pc)
    assert dpos.dtype == np.float32 and np.all(dpos == 1.0)
    _, dtable = nn.embedding_backward(np.ones((1, 2, 4), np.float32), ec)
    np.testing.assert_array_equal(dtable, [[1.0] * 4, [1.0] * 4] + [[0.0] * 4] * 3)
    assert nn.sinusoidal_positions(np, 0, 4).shape == (0, 4)


@pytest.mark.parametrize("call", [
    lambda dtype: nn.sinusoidal_positions("numpy", 3, 4, dtype=dtype),
    lambda dtype: nn.one_hot("numpy", np.arange(3), 4, dtype),
], ids=["sinusoidal_positions", "one_hot"])
def test_dtype_arguments_are_float_dtypes_of_the_backend(call):
    """As the constructors' dtype=: a float dtype of the backend or its name. Before, an integer
    dtype truncated the sines to 0 and 1, and an unknown name raised NumPy's "data type 'nope'
    not understood", naming no argument."""
    for bad, exc in ((np.int32, TypeError), (np.dtype(np.int8), TypeError), (np.bool_, TypeError),
                     ("int32", ValueError), ("nope", ValueError), ("bfloat16", ValueError)):
        with raises(exc, "dtype", "float32"):
            call(bad)
    for good in ("float32", np.float32, np.dtype(np.float32)):
        assert call(good).dtype == np.float32
    with raises(TypeError, "dtype", "None"):  # one_hot's dtype is not optional
        nn.one_hot("numpy", np.arange(3), 4, None)
    assert nn.sinusoidal_positions("numpy", 3, 4, dtype=None).dtype == np.float64


def test_dtype_names_work_on_every_backend(xp, to_np):
    """A name is resolved in the backend, where its astype may take no strings."""
    pe = nn.sinusoidal_positions(xp, 3, 4, dtype="float32")
    assert pe.dtype == xp.float32
    np.testing.assert_allclose(to_np(pe), nn.sinusoidal_positions(np, 3, 4), rtol=1e-6)


def test_ids_targets_and_dloss_are_checked_before_computing():
    """Out-of-range or non-integer ids and targets, a targets shape unlike the logits', and a
    dloss of another shape or dtype: a ValueError / TypeError naming the argument (they
    were silently a zero row, a missing loss term or a broadcast)."""
    rng = np.random.default_rng(0)
    table, logits = rng.standard_normal((5, 2)), rng.standard_normal((2, 3, 5))
    good = np.array([[0, 4, 1], [2, 3, 0]])
    for ids, err, match in (
            (np.array([[0, 5, 1]]), ValueError,
             r"^ids: expected token ids in \[0, 5\), got values in \[0, 5\]$"),
            (np.array([-1]), ValueError, r"^ids: expected token ids in \[0, 5\), got values in \[-1, -1\]$"),
            (good.astype(np.float64), TypeError,
             "^ids: expected an integer array of token ids, got dtype float64$")):
        with pytest.raises(err, match=match):
            nn.embedding_forward(ids, table)
    for tgt, err, match in (
            (np.where(good == 4, 5, good), ValueError,
             r"^targets: expected class indices in \[0, 5\), got values in \[0, 5\]$"),
            (np.where(good == 4, -1, good), ValueError,
             r"^targets: expected class indices in \[0, 5\), got values in \[-1, 3\]$"),
            (good > 0, TypeError, "^targets: expected an integer array of class indices, got dtype bool$"),
            (good[:, :2], ValueError,
             r"^targets: expected shape \(2, 3\) \(that of logits without its last axis\), got \(2, 2\)$")):
        before = tgt.copy()
        with pytest.raises(err, match=match):
            nn.cross_entropy_forward(logits, tgt)
        np.testing.assert_array_equal(tgt, before)
    loss, cache = nn.cross_entropy_forward(logits, good)
    with pytest.raises(ValueError, match=r"^dloss: expected shape \(\) \(that of the loss\), got \(3,\)$"):
        nn.cross_entropy_backward(np.ones(3), cache)
    with pytest.raises(TypeError, match=r"^dloss: expected dtype float64 \(that of the loss\), got float32 "
                       r"\(no silent promotion\)$"):
        nn.cross_entropy_backward(np.ones((), dtype=np.float32), cache)
    # a number a float holds, and finite (10**400 raised OverflowError; inf and NaN gave NaN)
    for bad, text in ((10**400, "an int too large for a float (1329 bits)"), (math.inf, "inf"),
                      (math.nan, "nan")):
        with raises(ValueError, "dloss", "finite number", text):
            nn.cross_entropy_backward(bad, cache)
    d1, _ = nn.cross_entropy_backward(1.0, cache)  # a number, or the loss's own like
    d2, _ = nn.cross_entropy_backward(np.ones_like(loss), cache)
    np.testing.assert_array_equal(d1, d2)
    # or of shape (1,), as gradcheck passes it; a bool is no number (True would scale by 1)
    np.testing.assert_array_equal(nn.cross_entropy_backward(np.ones(1), cache)[0], d1)
    with pytest.raises(TypeError, match="^dloss: expected an array, got bool$"):
        nn.cross_entropy_backward(True, cache)


def test_torch_unsigned_ids_without_arithmetic_are_a_type_error():
    """torch's uint16, uint32 and uint64 have no min, max, comparison or promotion (its
    namespace info lists them as no integral dtype): ids, targets or a GPT's tokens of those
    dtypes raised torch's NotImplementedError from inside the range check; now a TypeError
    naming the argument, and the ones torch computes with still pass."""
    torch = pytest.importorskip("torch")
    from npattn.gpt import GPT

    table = torch.ones((5, 3), dtype=torch.float64)
    logits = torch.zeros((1, 2, 5), dtype=torch.float64)
    model = GPT(5, 4, 4, 1, 2, dtype="float64", seed=0, backend="torch")
    for dtype in (torch.uint16, torch.uint32, torch.uint64):
        ids = torch.tensor([[1, 2]], dtype=dtype)
        with raises(TypeError, "ids", "uint", "int64"):
            nn.embedding_forward(ids, table)
        with raises(TypeError, "targets", "uint", "int64"):
            nn.cross_entropy_forward(logits, ids)
        with raises(TypeError, "ids", "uint", "int64"):
            model.forward(ids)
    for dtype in (torch.uint8, torch.int32):
        ids = torch.tensor([[1, 2]], dtype=dtype)
        out, _ = nn.embedding_forward(ids, table)
        assert tuple(out.shape) == (1, 2, 3)
        assert tuple(model.forward(ids).shape) == (1, 2, 5)


def test_uint64_ids_on_a_strict_namespace_match_int64_ids():
    """array-api-strict computes with uint64 (the range check takes it) but does not promote it
    with int64: the one-hot rows of embedding_forward, cross_entropy_forward and a GPT compared
    uint64 ids with int64 classes and raised the library's TypeError from inside. The ids are
    compared in the classes' dtype now; every number equals that of the same ids in int64."""
    xps = pytest.importorskip("array_api_strict")
    from npattn.gpt import GPT

    rng = np.random.default_rng(3)
    ids = rng.integers(0, 5, size=(2, 3))
    table = xps.asarray(rng.standard_normal((5, 4)))
    logits = xps.asarray(rng.standard_normal((2, 3, 5)))
    model = GPT(5, 4, 4, 1, 2, dtype="float64", seed=0, backend="array_api_strict")
    results = []
    for dtype in (xps.int64, xps.uint64):
        t = xps.asarray(ids, dtype=dtype)
        out, cache = nn.embedding_forward(t, table)
        _, dtable = nn.embedding_backward(xps.asarray(np.arange(24.0).reshape(2, 3, 4)), cache)
        loss, ce = nn.cross_entropy_forward(logits, t, ignore_index=int(ids[0, 0]), label_smoothing=0.1)
        dlogits, _ = nn.cross_entropy_backward(1.5, ce)
        gpt_loss, dgpt = model.loss(t, t)
        outputs = (nn.one_hot(xps, t, 5, "float64"), out, dtable, loss, dlogits, model.forward(t),
                   gpt_loss, dgpt)
        results.append([np.asarray(a) for a in outputs])
    for a, b in zip(*results):
        np.testing.assert_array_equal(a, b)
    assert results[0][0].sum() == ids.size  # one 1 per id


def test_cross_entropy_over_no_positions_is_refused(xp, to_xp):
    """A mean over no positions is 0 / 0: torch returns NaN; npattn refuses it rather than give
    NaN from input it accepted (it returned NaN too)."""
    for shape in ((0, 5), (2, 0, 5)):
        with raises(ValueError, "logits", "at least one position", str(shape)):
            nn.cross_entropy_forward(to_xp(np.zeros(shape)), to_xp(np.zeros(shape[:-1], np.int64)))
    # no classes (V = 0) is refused as the logits' shape, not as targets no class can hold
    with raises(ValueError, "logits", "V >= 1", "(2, 0)"):
        nn.cross_entropy_forward(to_xp(np.zeros((2, 0))), to_xp(np.zeros(2, np.int64)))
    loss, _ = nn.cross_entropy_forward(to_xp(np.zeros(5)), to_xp(np.zeros((), np.int64)))  # one position
    assert float(loss) == pytest.approx(math.log(5.0))


def test_a_numpy_float64_dloss_keeps_float32_logits_float32():
    """np.float64 is a float subclass, and under NumPy 2 it upcasts a float32 array."""
    logits = np.random.default_rng(0).standard_normal((3, 5)).astype(np.float32)
    _, cache = nn.cross_entropy_forward(logits, np.array([1, 2, 0]))
    d_py, _ = nn.cross_entropy_backward(0.5, cache)
    d_np, _ = nn.cross_entropy_backward(np.float64(0.5), cache)
    assert d_np.dtype == np.float32
    np.testing.assert_array_equal(d_np, d_py)


def test_add_positions_backward_returns_new_arrays():
    """dx and dpos are never dout itself: adding into one changed dout and, for an x of
    shape (L, D), the other (all three were one array)."""
    for shape in ((3, 4), (2, 3, 4)):
        _, c = nn.add_positions_forward(np.zeros(shape), np.zeros((3, 4)))
        dout = np.random.default_rng(0).standard_normal(shape)
        keep = dout.copy()
        dx, dpos = nn.add_positions_backward(dout, c)
        dx += 1.0
        dpos += 1.0
        np.testing.assert_array_equal(dout, keep)
        np.testing.assert_array_equal(dx, keep + 1.0)
        np.testing.assert_array_equal(dpos, keep.reshape(-1, 3, 4).sum(0) + 1.0)


def test_half_precision_clip_norm_and_cross_entropy_sum_in_float32():
    """A float16 sum of squares (300**2) or of exp (65505 equal logits) overflows: both
    run in float32, as the attention softmax does, and give torch's float32 numbers."""
    torch = pytest.importorskip("torch")
    clipped, total = nn.clip_grad_norm({"w": np.array([300.0, 0.0], np.float16)}, 1000.0)
    assert total == 300.0
    np.testing.assert_array_equal(clipped["w"], [300.0, 0.0])
    g = np.ones(70000, np.float16)
    clipped, total = nn.clip_grad_norm({"w": g}, 1.0)
    assert abs(total - math.sqrt(70000)) < 1e-9
    assert clipped["w"].dtype == np.float16 and abs(float(clipped["w"][0]) - 1 / math.sqrt(70000)) < 1e-5

    logits = np.random.default_rng(1).standard_normal((3, 70000)).astype(np.float16) * 0.01
    targets = np.array([0, 5, 69999])
    loss, cache = nn.cross_entropy_forward(logits, targets)
    lt = torch.from_numpy(logits.astype(np.float32)).requires_grad_()
    ref = torch.nn.functional.cross_entropy(lt, torch.from_numpy(targets))
    ref.backward()
    assert loss.dtype == np.float16 and np.isfinite(loss)
    assert abs(float(loss) - ref.item()) <= 2e-3 * ref.item()  # float16 rounding of the loss
    dlogits, _ = nn.cross_entropy_backward(np.asarray(1.0, np.float16), cache)
    assert dlogits.dtype == np.float16
    # most entries (1/70000 / 3) are float16 subnormals, spaced 2**-24 apart
    np.testing.assert_allclose(dlogits.astype(np.float32), lt.grad.numpy(), rtol=2e-3, atol=2.0**-24)


def test_adam_init_keeps_an_infinite_parameter_infinite():
    """Zero moments from zeros_like: inf * 0.0 made a NaN moment, and the step a NaN weight
    (torch.optim.Adam keeps inf)."""
    params = {"w": np.array([np.inf, 1.0])}
    state = nn.adam_init(params)
    np.testing.assert_array_equal(state.m["w"], 0.0)
    new, _ = nn.adam_step(params, {"w": np.array([0.0, 1.0])}, state, lr=1e-3)
    assert new["w"][0] == np.inf and abs(new["w"][1] - 0.999) < 1e-10  # eps: 1e-11


def test_class_weights_of_zero_and_their_checks(xp, to_xp, to_np):
    """A class of weight 0 adds nothing, also where its logit is -inf under smoothing (0, not
    0 * inf = NaN, and no warning); a mean whose counted targets' weights sum to 0 is refused
    (torch: NaN), their sum is 0. weight: the logits' library, dtype and (V,) shape, finite;
    each refusal names it, before computing, the targets unchanged."""
    z = np.array([[0.0, -np.inf, 1.0], [0.5, 0.2, -0.3]])
    wc = np.array([1.0, 0.0, 2.0])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        loss, cache = nn.cross_entropy_forward(to_xp(z), to_xp(np.array([0, 2])), weight=to_xp(wc),
                                               label_smoothing=0.3, reduction="none")
        dz = to_np(nn.cross_entropy_backward(to_xp(np.ones(2)), cache)[0])
    want = _smoothed_cross_entropy(np.array([[0.0, -50.0, 1.0], [0.5, 0.2, -0.3]]), [0, 2], 0.3,
                                   [True, True], wc)  # -inf as -50: its weight 0 leaves it out
    np.testing.assert_allclose(to_np(loss), want, rtol=1e-13)
    assert np.all(np.isfinite(dz)) and dz[0, 1] == 0.0  # p = 0 there and y = 0
    t = np.array([1, 1])  # every target of weight 0
    with raises(ValueError, "weight", "nonzero sum", "got 0"):
        nn.cross_entropy_forward(to_xp(z[1:].repeat(2, 0)), to_xp(t), weight=to_xp(wc))
    loss, _ = nn.cross_entropy_forward(to_xp(z[1:].repeat(2, 0)), to_xp(t), weight=to_xp(wc), reduction="sum")
    assert float(loss) == 0.0
    zz, tt = np.zeros((2, 3)), np.array([0, 2])
    before = tt.copy()
    for bad, err, words in ((np.ones(4), ValueError, ("shape (3,)", "(4,)")),
                            (np.ones((1, 3)), ValueError, ("shape (3,)", "(1, 3)")),
                            (np.ones(3, np.float32), TypeError, ("dtype float64", "float32")),
                            (np.ones(3, np.int64), TypeError, ("real floating", "int64")),
                            (np.array([1.0, np.nan, 1.0]), ValueError, ("finite", "1 entries")),
                            (np.array([1.0, np.inf, 1.0]), ValueError, ("finite", "1 entries")),
                            ([1.0, 1.0, 1.0], TypeError, ("list",))):
        with raises(err, "weight", *words):
            given = to_xp(bad) if isinstance(bad, np.ndarray) else bad
            nn.cross_entropy_forward(to_xp(zz), to_xp(tt), weight=given)
    np.testing.assert_array_equal(tt, before)


def test_an_out_of_range_target_is_reported_with_the_range_of_the_others(xp, to_xp):
    """With ignore_index, the refusal gives the range of the targets that are not ignored (the
    ignored ones read as 0 made a range of [0, 7] out of others in [3, 7]); targets that are
    all ignored are in range (the sum over them is 0)."""
    z = to_xp(np.zeros((4, 5)))
    for t, got in (([3, 4, -100, 7], "got others in [3, 7]"), ([-2, -100, 2, 3], "got others in [-2, 3]"),
                   ([6, 6, -100, 6], "got others in [6, 6]")):
        with raises(ValueError, "targets", "[0, 5) or ignore_index = -100", got):
            nn.cross_entropy_forward(z, to_xp(np.array(t)), ignore_index=-100)
    loss, _ = nn.cross_entropy_forward(z, to_xp(np.full(4, -100)), ignore_index=-100, reduction="sum")
    assert float(loss) == 0.0


def test_adam_takes_betas_of_zero():
    """betas in [0, 1), 0 included, as torch.optim.Adam: with b1 = b2 = 0, m = g and v = g^2 with
    no bias correction left (1 - 0^t = 1), so with eps = 0 every step is lr times the sign of
    its gradient."""
    w0 = np.array([1.0, -2.0, 0.5])
    grads = [np.array([0.3, -4.0, 2.0]), np.array([-1e-3, -0.2, 7.0]), np.array([5.0, 0.1, -0.4])]
    params = {"w": w0}
    state = nn.adam_init(params)
    for g in grads:
        params, state = nn.adam_step(params, {"w": g}, state, lr=0.1, betas=(0.0, 0.0), eps=0.0)
    expected = w0 - 0.1 * np.sum([np.sign(g) for g in grads], axis=0)  # [1 - 0.1, -2 + 0.1, 0.5 - 0.1]
    np.testing.assert_allclose(params["w"], expected, rtol=1e-14)


def test_adam_with_lr_zero_moves_no_parameter_and_still_counts_the_step():
    """lr = 0 is allowed (>= 0, as torch.optim.Adam's): the parameters stay as they are while
    the moments take the gradient, m = (1 - b1) g and v = (1 - b2) g^2 from zero, and t = 1."""
    rng = np.random.default_rng(4)
    params = {"w": rng.standard_normal((2, 3))}
    g = rng.standard_normal((2, 3))
    new_params, state = nn.adam_step(params, {"w": g}, nn.adam_init(params), lr=0.0, betas=(0.8, 0.9))
    np.testing.assert_array_equal(new_params["w"], params["w"])
    np.testing.assert_allclose(state.m["w"], 0.2 * g, rtol=1e-14)
    np.testing.assert_allclose(state.v["w"], 0.1 * g * g, rtol=1e-14)
    assert state.t == 1 and state.steps is None


def test_adam_steps_stays_none_while_every_parameter_gets_a_gradient():
    """state.steps is None while every parameter has had all t updates (the documented
    shorthand), and a dict of the counts once one parameter has missed a step."""
    params = {"a": np.array([1.0]), "b": np.array([2.0])}
    state = nn.adam_init(params)
    for _ in range(2):
        params, state = nn.adam_step(params, {"a": np.array([0.5]), "b": np.array([-1.0])}, state)
    assert state.t == 2 and state.steps is None
    params, state = nn.adam_step(params, {"a": np.array([0.5])}, state)
    assert state.t == 3 and state.steps == {"a": 3, "b": 2}


def test_clip_grad_norm_scales_a_norm_just_over_max_norm():
    """total = |(3, 4)| = 5 over max_norm = 4: the factor is 4 / 5 = 0.8 (with eps = 0), or
    4 / (5 + 1e-6) with the default eps; a factor near 1 scales as well as a small one."""
    grads = {"a": np.array([3.0]), "b": np.array([4.0])}
    clipped, total = nn.clip_grad_norm(grads, 4.0, eps=0.0)
    assert total == 5.0
    np.testing.assert_allclose([clipped["a"][0], clipped["b"][0]], [2.4, 3.2], rtol=1e-15)
    clipped, _ = nn.clip_grad_norm(grads, 4.9)
    f = 4.9 / (5.0 + 1e-6)  # 0.97999...
    np.testing.assert_allclose([clipped["a"][0], clipped["b"][0]], [3.0 * f, 4.0 * f], rtol=1e-15)


def test_cross_entropy_mean_counts_more_targets_than_float16_holds():
    """N, the targets that count, is an exact integer: 2049 (float16 rounds it to 2048) counted
    positions among 2052. With zero logits over V = 2 every counted loss is log 2, so the mean
    is log 2 exactly (not log 2 * 2049 / 2048), and dlogits = (1/2 - y) / 2049 there."""
    t = np.zeros(2052, dtype=np.int64)
    t[:3] = 1  # ignored
    z = np.zeros((2052, 2))
    loss, cache = nn.cross_entropy_forward(z, t, ignore_index=1)
    assert float(loss) == pytest.approx(math.log(2.0), rel=1e-14)
    dz = nn.cross_entropy_backward(1.0, cache)[0]
    np.testing.assert_allclose(dz[3:], np.tile([-0.5 / 2049, 0.5 / 2049], (2049, 1)), rtol=1e-14)
    np.testing.assert_array_equal(dz[:3], 0.0)


def test_adam_a_none_gradient_first_leaves_the_later_ones_stepped_and_checked():
    """A None gradient skips its own parameter only: with grads {"a": None, "b": g} the first
    step moves b by lr times the sign of g (eps = 0) and leaves a, and a wrongly shaped
    gradient after a None is still refused by name."""
    params = {"a": np.array([1.0, 2.0]), "b": np.array([3.0, 4.0])}
    state = nn.adam_init(params)
    new, state = nn.adam_step(params, {"a": None, "b": np.array([0.2, -5.0])}, state, lr=0.1, eps=0.0)
    np.testing.assert_array_equal(new["a"], [1.0, 2.0])
    np.testing.assert_allclose(new["b"], [3.0 - 0.1, 4.0 + 0.1], rtol=1e-15)
    assert state.steps == {"a": 0, "b": 1}
    with pytest.raises(ValueError, match=r"^grads\['b'\]: expected shape \(2,\)"):
        nn.adam_step(params, {"a": None, "b": np.ones(3)}, nn.adam_init(params))


def test_count_targets_counts_exactly_past_float32s_integers():
    """N is an exact int: 2**24 + 1 targets that count (float32 holds no 2**24 + 1, so a float32
    sum of ones gives 2**24), and one fewer once a target is the ignored value."""
    t = np.zeros(2**24 + 1, dtype=np.int8)
    assert nn.count_targets(np, t, 1) == 2**24 + 1
    t[5] = 1
    assert nn.count_targets(np, t, 1) == 2**24
    assert nn.count_targets(np, t.reshape(1, -1), None) == 2**24 + 1


def test_count_targets_refuses_no_targets_with_or_without_ignore_index():
    """No targets at all is a mean over nothing (0 / 0) as much as only ignored ones: a
    ValueError naming targets either way (without ignore_index it returned 0)."""
    for shape in ((2, 0), (0,)):
        with raises(ValueError, "targets", "at least one target", str(shape)):
            nn.count_targets(np, np.zeros(shape, dtype=np.int64), None)
        with raises(ValueError, "targets", "at least one target other than ignore_index = 3",
                    f"got none (shape {shape})"):
            nn.count_targets(np, np.zeros(shape, dtype=np.int64), 3)
    with raises(ValueError, "targets", "at least one target other than ignore_index = 3", "got only 3s"):
        nn.count_targets(np, np.full((2, 3), 3, dtype=np.int64), 3)
    assert nn.count_targets(np, np.zeros((2, 3), dtype=np.int64), None) == 6


def test_adam_takes_numpy_int_counts_past_their_type_s_range():
    """state.t and state.steps may be NumPy ints: after np.uint8(255) a parameter's step is 256,
    as after the int 255 (a uint8 count wrapped to 0, and 1 - b1**0 = 0 divided the step).
    From zero moments a step at t = 256 is w - lr * (0.1 g / c1) / (sqrt(0.001 g^2 / c2) + eps)
    with c = 1 - beta**256."""
    rng = np.random.default_rng(9)
    w, g = rng.standard_normal(3), rng.standard_normal(3)
    c1, c2 = 1.0 - 0.9**256, 1.0 - 0.999**256
    expected = w - 1e-3 * (0.1 * g / c1) / (np.sqrt(0.001 * g * g / c2) + 1e-8)
    params = {"w": w}
    new, state = nn.adam_step(params, {"w": g}, nn.adam_init(params)._replace(t=np.uint8(255)))
    np.testing.assert_allclose(new["w"], expected, rtol=1e-12)
    assert state.t == 256 and type(state.t) is int and state.steps is None
    params = {"a": w, "b": w}  # a's own count a NumPy int, b left without a gradient
    start = nn.adam_init(params)._replace(t=255, steps={"a": np.uint8(255), "b": 3})
    new, state = nn.adam_step(params, {"a": g}, start)
    np.testing.assert_allclose(new["a"], expected, rtol=1e-12)
    np.testing.assert_array_equal(new["b"], w)
    assert state.t == 256 and state.steps == {"a": 256, "b": 3}
