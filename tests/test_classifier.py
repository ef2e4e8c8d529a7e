"""npattn.classifier: the TransformerClassifier's gradient against finite differences, its weights, seeds and errors.

Finite differences run in float64 with a random upstream gradient on every
backend fixture, over the input and every parameter, at B = 2, H = 2, two
blocks, a padding mask and dropout p = 0.3 from fixed keep-masks at every
site of every block.
"""

import copy
import math
import pickle

import numpy as np
import pytest

from reliability_helpers import raises

from npattn.classifier import TransformerClassifier
from npattn.gradcheck import check_vjp
from npattn.transformer import ENCODER_DROPOUT_SITES

B, L, P, C, D, H, FF = 2, 5, 3, 4, 8, 2, 12


def small(backend, **kw):
    args = dict(d_model=D, n_head=H, n_layers=2, d_ff=FF, dtype="float64", backend=backend, seed=3)
    args.update(kw)
    return TransformerClassifier(P, L, C, **args)


def keep_masks(rng, to_xp, p, n_layers=2):
    shapes = {"self_attn": (B, H, L, L), "dropout1": (B, L, D), "dropout": (B, L, FF),
              "dropout2": (B, L, D)}
    assert set(shapes) == set(ENCODER_DROPOUT_SITES)
    return [{k: to_xp(rng.random(s) > p) for k, s in shapes.items()} for _ in range(n_layers)]


def padding_mask(to_xp, empty_entry=False):
    m = np.ones((B, L), dtype=bool)
    m[0, 3:] = False  # entry 0: three tokens, two padding
    if empty_entry:
        m[1] = False  # entry 1: all padding, every attention row of it has nothing to attend
    return to_xp(m)


@pytest.mark.parametrize("norm_first, activation, empty_entry, n_layers",
                         [(False, "relu", False, 2), (True, "gelu", True, 2), (True, "gelu_tanh", False, 1)])
def test_gradients_match_finite_differences(xp, to_xp, to_np, backend, norm_first, activation, empty_entry,
                                            n_layers):
    """check_vjp over x and every parameter, random dlogits, mask, dropout p = 0.3 with fixed keep-masks;
    with ``empty_entry`` entry 1 is all padding (fully masked attention rows, an empty pooling);
    one block as well as two (the final norm's backward must not depend on the count)."""
    p = 0.3
    model = small(backend, dropout=p, norm_first=norm_first, activation=activation, n_layers=n_layers)
    rng = np.random.default_rng(4)
    # move the parameters off their init (norms at 1 and 0, the head's bias at 0)
    model.params = {k: v + to_xp(0.2 * rng.standard_normal(tuple(v.shape)))
                    for k, v in model.params.items()}
    keeps = keep_masks(rng, to_xp, p, n_layers)
    mask = padding_mask(to_xp, empty_entry)
    x = to_xp(rng.standard_normal((B, L, P)))
    names = list(model.params)

    def f(x, *params):
        model.params = dict(zip(names, params))
        return model.forward(x, mask, dropout_masks=keeps)

    inputs = [x] + [model.params[k] for k in names]
    logits = f(*inputs)
    assert tuple(logits.shape) == (B, C)
    dlogits = to_xp(rng.standard_normal((B, C)))  # random, never all ones
    grads = model.backward(dlogits)
    assert list(grads) == names
    report = check_vjp(f, inputs, [model.dx] + [grads[k] for k in names], dlogits,
                       names=["x"] + names, n_directions=2, seed=5)
    assert report.ok, str(report)
    for name, g in zip(["x"] + names, [model.dx] + [grads[k] for k in names]):
        if name.endswith("self_attn.b_k"):
            continue  # softmax ignores a shift of every key's score: zero up to rounding
        assert np.max(np.abs(to_np(g))) > 0.0, f"{name}: a zero gradient checks nothing"
    dx = to_np(model.dx)
    np.testing.assert_array_equal(dx[0, 3:], 0.0)  # padding reaches neither pooling nor attention
    if empty_entry:
        np.testing.assert_array_equal(dx[1], 0.0)


def test_parameter_names_and_shapes(backend):
    model = small(backend, norm_first=True)
    shapes = {k: tuple(v.shape) for k, v in model.params.items()}
    names = list(shapes)
    assert names[:3] == ["embed.weight", "embed.bias", "pos"]
    assert names[-4:] == ["norm.weight", "norm.bias", "head.weight", "head.bias"]
    assert shapes["embed.weight"] == (D, P) and shapes["pos"] == (L, D)
    assert shapes["head.weight"] == (C, D) and shapes["head.bias"] == (C,)
    block = model.blocks[1].params
    assert all(f"blocks.1.{k}" in shapes for k in block)
    assert model.n_params() == sum(int(np.prod(s)) for s in shapes.values())
    post = small(backend)  # post-norm: no final norm
    assert not any(k.startswith("norm.") for k in post.params)


def test_initial_parameters_follow_torchs_linear_init():
    """nn.Linear's init: U(-1/sqrt(fan_in), 1/sqrt(fan_in)) for the embedding (fan_in = P) and
    the head (fan_in = D), with P = 3 != D = 64 so the two bounds differ by a factor 4.6; the
    head's bias 0, positions N(0, 0.02^2), a final norm of ones and zeros."""
    d = 64
    model = TransformerClassifier(P, L, 10, d_model=d, n_head=H, dtype="float64", seed=5,
                                  norm_first=True)
    p = {k: np.asarray(v) for k, v in model.params.items()}
    for name, fan_in in (("embed.weight", P), ("embed.bias", P), ("head.weight", d)):
        bound = 1.0 / np.sqrt(fan_in)
        assert np.abs(p[name]).max() <= bound, name
        assert np.abs(p[name]).max() > 0.85 * bound, name  # 64 or more draws reach near the bound
    assert not p["head.bias"].any()
    assert 0.015 < p["pos"].std() < 0.025 and abs(p["pos"].mean()) < 0.005
    np.testing.assert_array_equal(p["norm.weight"], np.ones(d))
    np.testing.assert_array_equal(p["norm.bias"], np.zeros(d))


def test_blocks_start_from_independent_draws():
    """Every block has the same shapes, so one seed handed to each would start them as copies
    of one another (and draw the same dropout masks); each block gets its own."""
    model = small("numpy", n_layers=3, dropout=0.3)
    p = {k: np.asarray(v) for k, v in model.params.items()}
    for k in (k.split(".", 2)[2] for k in p if k.startswith("blocks.0.")):
        if np.all(p[f"blocks.0.{k}"] == p[f"blocks.0.{k}"].flat[0]):
            continue  # norms start at 1 and 0, attention biases at 0 in every block
        for n in (1, 2):
            assert not np.allclose(p[f"blocks.0.{k}"], p[f"blocks.{n}.{k}"]), (n, k)
    states = [b.rng_state for b in model.blocks]
    assert all(states[0] != s for s in states[1:])


def test_block_n_takes_the_keep_masks_of_entry_n():
    """forward(x, mask, dropout_masks) against the six steps composed here on NumPy: block n
    runs with dropout_masks[n], the padding mask goes to every block as (B, 1, 1, L), and
    the pooling averages the tokens only."""
    rng = np.random.default_rng(11)
    model = small("numpy", dropout=0.3)
    x = rng.standard_normal((B, L, P))
    mask = np.asarray(padding_mask(np.asarray))
    keeps = keep_masks(rng, np.asarray, 0.3)
    got = np.asarray(model.forward(x, mask, dropout_masks=keeps))
    p = {k: np.asarray(v) for k, v in model.params.items()}
    h = x @ p["embed.weight"].T + p["embed.bias"] + p["pos"]  # [B, L, D]
    for n, block in enumerate(model.blocks):
        h = np.asarray(block.forward(h, mask=mask[:, None, None, :], dropout_masks=keeps[n]))
    w = mask[..., None].astype(float)  # [B, L, 1]
    z = (h * w).sum(axis=1) / w.sum(axis=1)  # [B, D]
    np.testing.assert_allclose(got, z @ p["head.weight"].T + p["head.bias"], rtol=1e-12, atol=1e-13)
    # a tuple is a sequence of the same entries
    np.testing.assert_array_equal(np.asarray(model.forward(x, mask, dropout_masks=tuple(keeps))), got)
    swapped = np.asarray(model.forward(x, mask, dropout_masks=keeps[::-1]))
    assert np.abs(swapped - got).max() > 1e-3  # the two blocks' masks are not interchangeable


def test_attention_weights_per_head_are_the_blocks(xp, to_xp, to_np, backend):
    """need_weights gives each block's (B, H, L, L) probabilities: those its attention module computes."""
    model = small(backend).eval()
    rng = np.random.default_rng(6)
    x, mask = to_xp(rng.standard_normal((B, L, P))), padding_mask(to_xp)
    logits, weights = model.forward(x, mask, need_weights=True)
    assert len(weights) == 2 and all(tuple(w.shape) == (B, H, L, L) for w in weights)
    np.testing.assert_allclose(to_np(model.forward(x, mask)), to_np(logits), rtol=0, atol=0)
    w0 = to_np(weights[0])
    np.testing.assert_allclose(w0.sum(axis=-1), 1.0, rtol=1e-12)
    np.testing.assert_array_equal(w0[0, :, :, 3:], 0.0)  # padded keys get no attention
    # recompute block 0's weights from its input, e + pos (post-norm: attention sees it as is)
    P_ = model.params
    h0 = x @ xp.matrix_transpose(P_["embed.weight"]) + P_["embed.bias"] + P_["pos"]
    m4 = xp.reshape(mask, (B, 1, 1, L))
    _, ref = model.blocks[0].self_attn.forward(h0, h0, h0, mask=m4, need_weights=True,
                                               average_attn_weights=False)
    np.testing.assert_allclose(w0, to_np(ref), rtol=1e-12, atol=1e-14)
    # and block 1's from its input, block 0's output (each list entry is its own block's)
    h1 = model.blocks[0](h0, mask=m4)
    _, ref1 = model.blocks[1].self_attn.forward(h1, h1, h1, mask=m4, need_weights=True,
                                                average_attn_weights=False)
    np.testing.assert_allclose(to_np(weights[1]), to_np(ref1), rtol=1e-12, atol=1e-14)


def test_calling_the_model_is_its_forward_keywords_included():
    """model(...) is model.forward(...), keywords and all: need_weights=True returns the
    weights too, and given keep-masks drop what they say in training mode."""
    model = small("numpy", dropout=0.3)
    rng = np.random.default_rng(12)
    x, mask = rng.standard_normal((B, L, P)), padding_mask(np.asarray)
    masks = keep_masks(rng, np.asarray, 0.3)
    logits, weights = model(x, mask, need_weights=True, dropout_masks=masks)
    ref_logits, ref_weights = model.forward(x, mask, need_weights=True, dropout_masks=masks)
    np.testing.assert_array_equal(logits, ref_logits)
    assert len(weights) == 2
    for w, ref in zip(weights, ref_weights):
        np.testing.assert_array_equal(w, ref)


def test_weights_of_shapes_where_auto_would_take_the_blocked_path(monkeypatch):
    """need_weights at sizes where impl="auto" takes the blocked implementation (which forms no
    weights): the blocks are asked for weights, so auto keeps them (it raised after every block
    ran, naming 'cache'). Here the threshold is lowered instead of the sizes raised."""
    from npattn import attention as A

    monkeypatch.setattr(A, "AUTO_BLOCKED_MAX_DENSE_SCORES", 16)
    model = small("numpy").eval()
    x = np.random.default_rng(7).standard_normal((B, L, P))
    logits, weights = model.forward(x, need_weights=True)
    np.testing.assert_allclose(np.asarray(weights[0]).sum(axis=-1), 1.0, rtol=1e-12)
    np.testing.assert_allclose(model.forward(x), logits, rtol=1e-12, atol=1e-14)
    model.forward(x)  # a forward to keep
    model.blocks[1].self_attn.impl = "blocked"  # asked for weights it cannot give: before any block
    with pytest.raises(ValueError, match="impl='blocked' cannot return attention weights"):
        model.forward(x, need_weights=True)
    dlogits = np.random.default_rng(8).standard_normal((B, C))  # random, never all ones
    model.backward(dlogits)  # the kept forward's: the gradient of the logits it gave
    report = check_vjp(model.forward, [x], [model.dx], dlogits, names=["x"], n_directions=2, seed=9)
    assert report.ok, str(report)
    assert np.max(np.abs(model.dx)) > 0.0


def test_one_seed_gives_the_same_numbers_on_every_backend(xp, to_xp, to_np, backend):
    ref = small("numpy")
    model = small(backend)
    for k, v in ref.params.items():
        np.testing.assert_array_equal(to_np(model.params[k]), np.asarray(v), err_msg=k)
    x = np.random.default_rng(7).standard_normal((B, L, P))
    np.testing.assert_allclose(to_np(model.eval().forward(to_xp(x))), ref.eval().forward(x),
                               rtol=1e-12, atol=1e-12)
    other = small("numpy", seed=4)
    assert not np.array_equal(other.params["pos"], ref.params["pos"])


def test_dropout_acts_in_training_and_not_in_eval(xp, to_xp, to_np, backend):
    model = small(backend, dropout=0.5)
    x = to_xp(np.random.default_rng(8).standard_normal((B, L, P)))
    a, b = to_np(model.forward(x)), to_np(model.forward(x))
    assert not np.allclose(a, b)  # fresh keep-masks each call
    model.eval()
    np.testing.assert_array_equal(to_np(model.forward(x)), to_np(model.forward(x)))
    assert model.train().training and all(blk.training for blk in model.blocks)


def test_float16_attention_weights_are_float16():
    """The blocks compute the attention probabilities in float32 for a float16 model; the
    weights returned are in the model's dtype, as the logits."""
    model = small("numpy", dtype="float16")
    x = np.random.default_rng(9).standard_normal((B, L, P)).astype(np.float16)
    logits, weights = model.forward(x, need_weights=True)
    assert logits.dtype == np.float16 and [w.dtype for w in weights] == [np.float16] * 2


def test_layer_norm_eps_reaches_the_blocks_and_the_final_norm():
    """Pre-norm with layer_norm_eps = 0.3: the blocks have it, and the final norm before the
    pooling uses it (the steps composed here on NumPy)."""
    model = small("numpy", norm_first=True, layer_norm_eps=0.3)
    p = {k: np.asarray(v) for k, v in model.params.items()}
    rng = np.random.default_rng(14)
    p["norm.weight"], p["norm.bias"] = rng.standard_normal(D), rng.standard_normal(D)
    model.params = p
    assert [b.layer_norm_eps for b in model.blocks] == [0.3, 0.3]
    x = rng.standard_normal((B, L, P))
    got = np.asarray(model.forward(x))
    h = x @ p["embed.weight"].T + p["embed.bias"] + p["pos"]  # [B, L, D]
    for block in model.blocks:
        h = np.asarray(block.forward(h))
    mu, var = h.mean(axis=-1, keepdims=True), h.var(axis=-1, keepdims=True)
    z = ((h - mu) / np.sqrt(var + 0.3) * p["norm.weight"] + p["norm.bias"]).mean(axis=1)  # [B, D]
    np.testing.assert_allclose(got, z @ p["head.weight"].T + p["head.bias"], rtol=1e-12, atol=1e-13)


def test_float32_stays_float32(xp, to_xp, backend):
    model = small(backend, dtype="float32", n_layers=1)
    x = xp.astype(to_xp(np.random.default_rng(9).standard_normal((B, L, P))), xp.float32)
    logits, (w,) = model.forward(x, need_weights=True)
    assert logits.dtype == xp.float32 and w.dtype == xp.float32
    grads = model.backward(xp.astype(to_xp(np.ones((B, C)) * 0.1), xp.float32))
    assert all(g.dtype == xp.float32 for g in grads.values()) and model.dx.dtype == xp.float32


def test_bad_arguments_name_the_argument(xp, to_xp, backend):
    model = small(backend, n_layers=1)
    x = to_xp(np.zeros((B, L, P)))
    with pytest.raises(RuntimeError, match=r"^backward: expected a forward call first"):
        model.backward(to_xp(np.zeros((B, C))))
    with pytest.raises(TypeError, match=r"^x: expected a"):
        model.forward(np.zeros((B, L, P)).tolist())
    with pytest.raises(TypeError, match=r"^x: expected dtype float64"):
        model.forward(xp.astype(x, xp.float32))
    with pytest.raises(ValueError, match=r"^x: expected shape \(B, 5, 3\)"):
        model.forward(to_xp(np.zeros((B, L + 1, P))))
    with pytest.raises(ValueError, match=r"^x: expected shape \(B, 5, 3\)"):
        model.forward(to_xp(np.zeros((L, P))))
    with pytest.raises(ValueError, match=r"^x: expected shape \(B, 5, 3\) .* got shape \(2, 5, 4\)"):
        model.forward(to_xp(np.zeros((B, L, P + 1))))  # one feature too many
    with pytest.raises(ValueError, match=r"^x: expected shape \(B, 5, 3\) .* got shape \(0, 5, 3\)"):
        model.forward(to_xp(np.zeros((0, L, P))))  # no sequence to classify
    with pytest.raises(TypeError, match=r"^mask: expected a bool padding mask"):
        model.forward(x, to_xp(np.ones((B, L))))
    with pytest.raises(ValueError, match=r"^mask: expected shape \(2, 5\)"):
        model.forward(x, to_xp(np.ones((B, 1, 1, L), dtype=bool)))
    with pytest.raises(TypeError, match=r"^mask: expected an? .*array, got list"):
        model.forward(x, np.ones((B, L), dtype=bool).tolist())  # no dtype to check
    with pytest.raises(TypeError, match=r"^need_weights: expected a bool"):
        model.forward(x, need_weights=1)
    with pytest.raises(TypeError, match=r"^dropout_masks: expected a list of 1 dicts or None "
                                        r"\(one per block\), got dict$"):
        model.forward(x, dropout_masks={"dropout1": None})
    with pytest.raises(ValueError, match=r"^dropout_masks: expected a list of 1 dicts or None "
                                         r"\(one per block\), got a list of length 2$"):
        model.forward(x, dropout_masks=[None, None])
    with pytest.raises(TypeError, match=r"^dropout_masks\[0\]: expected a dict or None, got str$"):
        model.forward(x, dropout_masks=["self_attn"])
    model.forward(x)
    with pytest.raises(ValueError, match=r"^dlogits: expected shape \(2, 4\)"):
        model.backward(to_xp(np.zeros((B, C + 1))))
    with pytest.raises(TypeError, match=r"^dlogits: expected dtype float64"):
        model.backward(xp.astype(to_xp(np.zeros((B, C))), xp.float32))


def test_a_failed_params_assignment_changes_nothing(xp, to_xp, to_np, backend):
    model = small(backend, n_layers=1)
    before = {k: to_np(v).copy() for k, v in model.params.items()}
    bad = {k: v * 2.0 for k, v in model.params.items()}
    bad["head.bias"] = to_xp(np.zeros(C + 1))
    with pytest.raises(ValueError, match=r"^params\['head.bias'\]: expected shape \(4,\)"):
        model.params = bad
    with pytest.raises(ValueError, match=r"^params: expected the keys"):
        model.params = {"pos": model.params["pos"]}
    with pytest.raises(TypeError, match=r"^params: expected a dict of arrays .* got list"):
        model.params = list(model.params.items())  # a ValueError listing the keys before
    for k, v in model.params.items():
        np.testing.assert_array_equal(to_np(v), before[k], err_msg=k)


@pytest.mark.parametrize("kw, err, match", [
    ({"n_features": 0}, ValueError, r"^n_features: expected a positive int"),
    ({"seq_len": 2.0}, TypeError, r"^seq_len: expected a positive int"),
    ({"n_classes": -1}, ValueError, r"^n_classes: expected a positive int"),
    ({"n_layers": 0}, ValueError, r"^n_layers: expected a positive int"),
    ({"seed": -1}, ValueError, r"^seed: expected a non-negative int seed, got -1"),
    ({"n_head": 3}, ValueError, r"n_head"),
    ({"dropout": 1.0}, ValueError, r"dropout"),
    ({"activation": "swish"}, ValueError, r"^activation"),
])
def test_bad_constructor_arguments(kw, err, match):
    args = dict(n_features=P, seq_len=L, n_classes=C, d_model=D, n_head=H)
    args.update(kw)
    with pytest.raises(err, match=match):
        TransformerClassifier(**args)


# ------------------------------------------------ a failed forward changes nothing


def _state_after(model, to_xp, to_np, x, dl):
    """(the backward of the last forward, or None for a RuntimeError; the next dropout forward)."""
    try:
        grads = {k: to_np(v).copy() for k, v in model.backward(dl).items()}
    except RuntimeError:
        grads = None
    return grads, to_np(model.forward(x))


@pytest.mark.parametrize("bad, err, match", [
    ([None, {"dropout9": None}], ValueError,
     r"^dropout_masks\[1\]: expected keys among \['self_attn', 'dropout1', 'dropout', 'dropout2'\], "
     r"got \['dropout9'\]"),
    ([None, {"dropout1": "shape"}], ValueError, r"^dropout_masks\[1\]\['dropout1'\]"),
    ([None, {"dropout": "float"}], TypeError, r"^dropout_masks\[1\]\['dropout'\]: expected a bool"),
    ([None, {"self_attn": "list"}], TypeError, r"^dropout_masks\[1\]\['self_attn'\]"),
])
def test_a_forward_refused_for_block_1s_masks_changes_nothing(xp, to_xp, to_np, backend, bad, err,
                                                                match):
    """Block 0 must not run (its generator and cache) before block 1's masks are refused."""
    model, twin = (small(backend, dropout=0.3, seed=0) for _ in range(2))
    rng = np.random.default_rng(11)
    x = to_xp(rng.standard_normal((B, L, P)))
    dl = to_xp(rng.standard_normal((B, C)))
    model.forward(x)
    twin.forward(x)
    bad = [None if m is None else {k: {"shape": to_xp(np.ones((B, L, D + 1), dtype=bool)),
                                       "float": to_xp(np.ones((B, L, FF))),
                                       "list": [[True]], None: None}[v] for k, v in m.items()}
           for m in bad]
    with pytest.raises(err, match=match):
        model.forward(5.0 * x, dropout_masks=bad)
    grads, nxt = _state_after(model, to_xp, to_np, x, dl)
    ref_grads, ref_nxt = _state_after(twin, to_xp, to_np, x, dl)
    assert grads is not None  # refused up front: the previous forward is still the one cached
    for k in ref_grads:
        np.testing.assert_array_equal(grads[k], ref_grads[k], err_msg=k)
    np.testing.assert_array_equal(nxt, ref_nxt)  # the generators did not move


def test_a_keep_mask_on_another_device_is_named_by_block_and_site():
    """A torch keep-mask on another device than the parameters ("meta" stands in for a GPU
    here) is refused by the model under dropout_masks[n][site], before block 0 runs (block
    1's own check would name it dropout_masks[site], after block 0 had run)."""
    torch = pytest.importorskip("torch")
    model = small("torch", dropout=0.3)
    x = torch.zeros((B, L, P), dtype=torch.float64)
    bad = [None, {"dropout1": torch.ones((B, L, D), dtype=torch.bool, device="meta")}]
    with pytest.raises(ValueError, match=r"^dropout_masks\[1\]\['dropout1'\]: expected an array on device"):
        model.forward(x, dropout_masks=bad)


@pytest.mark.parametrize("where", ["block 1", "pooling", "block 1, Ctrl-C"])
def test_a_forward_that_fails_after_the_checks_changes_nothing(xp, to_xp, to_np, backend, where,
                                                               monkeypatch):
    """A failure after the checks (memory, say, or a KeyboardInterrupt, which is no Exception),
    in block 1 or after every block ran: the blocks that ran are put back, so backward
    differentiates the previous forward and the generators draw what they would have drawn."""
    import npattn.layers as Ly

    model, twin = (small(backend, dropout=0.3, seed=0) for _ in range(2))
    rng = np.random.default_rng(12)
    x = to_xp(rng.standard_normal((B, L, P)))
    dl = to_xp(rng.standard_normal((B, C)))
    model.forward(x)
    twin.forward(x)
    before = [b.forward_state() for b in model.blocks]

    error = KeyboardInterrupt if where.endswith("Ctrl-C") else MemoryError

    def fail(*args, **kwargs):
        raise error("out of memory")

    if where.startswith("block 1"):
        monkeypatch.setattr(model.blocks[1], "forward", fail)
    else:
        monkeypatch.setattr(Ly, "mean_pool_forward", fail)
    with pytest.raises(error):
        model.forward(5.0 * x)
    monkeypatch.undo()
    for b, s in zip(model.blocks, before):
        assert b.forward_state().cache is s.cache
        assert b.self_attn.cache is s.attn_caches["self_attn"]
    grads, nxt = _state_after(model, to_xp, to_np, x, dl)
    ref_grads, ref_nxt = _state_after(twin, to_xp, to_np, x, dl)
    assert grads is not None and set(grads) == set(model.params)
    for k in ref_grads:
        np.testing.assert_array_equal(grads[k], ref_grads[k], err_msg=k)
    np.testing.assert_array_equal(nxt, ref_nxt)  # the generators did not move


@pytest.mark.parametrize("where", ["block 0", "positions"])
def test_a_backward_that_fails_in_block_0_keeps_every_blocks_grads(xp, to_xp, to_np, backend,
                                                                   monkeypatch, where):
    """Block 1's backward runs, block 0's fails (a MemoryError), or every block's ran and the
    positions' backward after them fails: the model's grads and dx, every block's grads and
    its attention module's grads, dmask and cache are those of the last successful backward,
    and the next backward gives what a model that never failed gives."""
    model, twin = (small(backend, dropout=0.3, seed=0) for _ in range(2))
    assert model.n_layers >= 2
    rng = np.random.default_rng(13)
    x0, x1 = (to_xp(rng.standard_normal((B, L, P))) for _ in range(2))
    dl = to_xp(rng.standard_normal((B, C)))
    mask = padding_mask(to_xp)
    for m in (model, twin):  # a backward done (grads to keep), then another forward
        m.forward(x0, mask)
        m.backward(dl)
        m.forward(x1, mask)
    model_grads, model_dx = model.grads, model.dx
    held = [(b.grads, b.self_attn.grads, b.self_attn.dmask, b.self_attn.cache) for b in model.blocks]

    def fails(dout):
        raise MemoryError("out of memory")

    if where == "block 0":
        monkeypatch.setattr(model.blocks[0], "backward", fails)
    else:
        from npattn import nn
        monkeypatch.setattr(nn, "add_positions_backward", lambda dh, cache: fails(dh))
    with pytest.raises(MemoryError):
        model.backward(dl)
    monkeypatch.undo()
    assert model.grads is model_grads and model.dx is model_dx
    for n, (block, (grads, attn_grads, dmask, attn_cache)) in enumerate(zip(model.blocks, held)):
        assert block.grads is grads and block.self_attn.grads is attn_grads, f"block {n}"
        assert block.self_attn.dmask is dmask and block.self_attn.cache is attn_cache, f"block {n}"
    grads = {k: to_np(v) for k, v in model.backward(dl).items()}
    ref = {k: to_np(v) for k, v in twin.backward(dl).items()}
    assert set(grads) == set(ref) == set(model.params)
    for k in ref:
        np.testing.assert_array_equal(grads[k], ref[k], err_msg=k)
    np.testing.assert_array_equal(to_np(model.dx), to_np(twin.dx))


# ------------------------------------------------------------ copies and pickles


@pytest.mark.parametrize("how", ["deepcopy", "pickle"])
def test_copies_keep_everything_but_the_last_forward(xp, to_xp, to_np, backend, how):
    model = small(backend, dropout=0.3, norm_first=True)
    rng = np.random.default_rng(13)
    x = to_xp(rng.standard_normal((B, L, P)))
    dl = to_xp(rng.standard_normal((B, C)))
    model.forward(x)
    model.backward(dl)
    model.forward(x)  # a cached forward that the copy does not take
    dup = copy.deepcopy(model) if how == "deepcopy" else pickle.loads(pickle.dumps(model))
    assert type(dup) is TransformerClassifier and dup.xp is model.xp and dup.dtype == model.dtype
    assert repr(dup) == repr(model) and dup.training and all(b.training for b in dup.blocks)
    for k, v in model.params.items():
        np.testing.assert_array_equal(to_np(dup.params[k]), to_np(v), err_msg=k)
    for k, v in model.grads.items():
        np.testing.assert_array_equal(to_np(dup.grads[k]), to_np(v), err_msg=k)
    with pytest.raises(RuntimeError, match=r"^backward: expected a forward call first"):
        dup.backward(dl)
    model.backward(dl)  # the original's cache is its own
    # the generators travel: the next dropout forward is the original's next
    a, b = to_np(model.forward(x)), to_np(dup.forward(x))
    np.testing.assert_array_equal(b, a)
    # and then each goes its own way: a change to the copy leaves the original alone
    before = {k: to_np(v).copy() for k, v in model.params.items()}
    dup.params = {k: v * 2.0 for k, v in dup.params.items()}
    dup.eval()
    dup.backward(dl)
    assert model.training and all(blk.training for blk in model.blocks)
    for k, v in model.params.items():
        np.testing.assert_array_equal(to_np(v), before[k], err_msg=k)


def test_save_and_load_on_another_backend_keep_parameters_mode_and_generators(tmp_path, xp, to_xp,
                                                                              to_np, backend):
    model = small(backend, dropout=0.3)
    x = to_xp(np.random.default_rng(5).standard_normal((2, model.seq_len, model.n_features)))
    model.forward(x)  # the generators move on from their seeded start
    path = tmp_path / "clf.npz"
    model.save(str(path))
    raw = np.load(path, allow_pickle=False)  # read independently of load
    np.testing.assert_array_equal(raw["param/pos"], to_np(model.params["pos"]))
    loaded = TransformerClassifier.load(str(path), backend="numpy")
    assert loaded.training and loaded.n_params() == model.n_params()
    for k, v in model.params.items():
        np.testing.assert_array_equal(to_np(loaded.params[k]), to_np(v), err_msg=k)
    # the next training forward draws the masks the saved model would draw
    np.testing.assert_allclose(loaded.forward(to_np(x)), to_np(model.forward(x)), rtol=0, atol=1e-12)
    model.eval().save(str(path))
    assert not TransformerClassifier.load(str(path)).training


def test_loading_another_models_file_is_a_value_error(tmp_path):
    from npattn.gpt import GPT

    path = tmp_path / "gpt.npz"
    GPT(7, 5, 8, 1, 2).save(str(path))
    with pytest.raises(ValueError, match="npattn.classifier.TransformerClassifier"):
        TransformerClassifier.load(str(path))


def test_a_block_impl_that_cannot_run_is_refused_before_the_embedding(monkeypatch):
    """Block 1's self_attn.impl = "chunked" on NumPy arrays was refused inside block 1, after
    the embedding and block 0 had run (only need_weights=True checked the impls up front);
    now before anything is computed."""
    import npattn.functional as F

    model = small("numpy")
    model.blocks[1].self_attn.impl = "chunked"
    calls = []
    real = F.linear_forward
    monkeypatch.setattr(F, "linear_forward", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    with pytest.raises(ValueError, match=r"impl='chunked': .* got numpy\.ndarray of shapes "
                                         r"\(2, 2, 5, 4\), \(2, 2, 5, 4\), \(2, 2, 5, 4\);"):
        model.forward(np.zeros((B, L, P)))  # (the heads block 1 would get, named)
    assert calls == []
    # an impl that cannot form the weights asked for, likewise before anything is computed
    model.blocks[1].self_attn.impl = "blocked"
    with pytest.raises(ValueError, match="impl='blocked' cannot return attention weights"):
        model.forward(np.zeros((B, L, P)), need_weights=True)
    assert calls == []


def test_train_with_a_mode_that_is_no_bool_is_a_type_error_and_changes_nothing():
    """train("no") on a model made of blocks (BlockStack.train, GPT's too) is refused before
    anything changes: a model that set its own flag before its blocks refused the mode would
    be left in training mode."""
    model = small("numpy", dropout=0.3).eval()
    for mode in ("no", 1, None):
        with raises(TypeError, "mode", "bool"):
            model.train(mode)
        assert model.training is False and not any(b.training for b in model.blocks), mode


def test_defaults_of_the_signature_reach_every_block():
    """Without them, the classifier is the documented one: width 32, 4 heads, one block with a
    feed-forward width of 4 * 32, no dropout, and torch's encoder-layer defaults (ReLU, post-norm,
    layer-norm eps 1e-5), in the model and in every block it builds (the digits demo relies on
    them)."""
    m = TransformerClassifier(3, 5, 4, seed=0)
    assert (m.d_model, m.n_head, m.n_layers, m.d_ff, m.dropout) == (32, 4, 1, 128, 0.0)
    assert (m.activation, m.norm_first, m.layer_norm_eps) == ("relu", False, 1e-5)
    assert np.dtype(m.dtype) == np.float32
    assert len(m.blocks) == 1
    for b in m.blocks:
        got = (b.d_model, b.n_head, b.d_ff, b.activation, b.norm_first, b.layer_norm_eps)
        assert got == (32, 4, 128, "relu", False, 1e-5)


def _torch_classifier(torch, T, x, mask, keeps, p, activation, norm_first, n_layers):
    """The classifier as its docstring writes it, in torch ops on the parameters ``T``: a linear
    embedding, + pos, each block as torch's encoder layer computes it (heads as contiguous Dh
    slices of the projections, scores / sqrt(Dh), keep-masks replayed at each site), the final
    norm with ``norm_first``, the mean over the tokens of ``mask``, the head."""
    F = torch.nn.functional
    act = {"relu": torch.relu, "gelu": F.gelu,
           "gelu_tanh": lambda z: F.gelu(z, approximate="tanh")}[activation]
    Dh = D // H
    pad = ~torch.from_numpy(mask)[:, None, None, :]  # [B, 1, 1, L] True = padding

    def drop(z, keep):  # inverted dropout with a given keep-mask
        return torch.where(torch.from_numpy(keep), z / (1.0 - p), torch.zeros_like(z))

    def heads(z):  # [B, L, D] -> [B, H, L, Dh]
        return z.reshape(B, L, H, Dh).transpose(1, 2)

    h = F.linear(x, T["embed.weight"], T["embed.bias"]) + T["pos"]
    for n in range(n_layers):
        w, k = (lambda name, n=n: T[f"blocks.{n}.{name}"]), keeps[n]

        def attn(z):
            q, kk, v = (heads(F.linear(z, w(f"self_attn.w_{c}"), w(f"self_attn.b_{c}"))) for c in "qkv")
            s = (q @ kk.transpose(-1, -2) / math.sqrt(Dh)).masked_fill(pad, -math.inf)
            a = drop(torch.softmax(s, dim=-1), k["self_attn"])
            return F.linear((a @ v).transpose(1, 2).reshape(B, L, D), w("self_attn.w_o"), w("self_attn.b_o"))

        def ff(z):
            z = drop(act(F.linear(z, w("linear1.weight"), w("linear1.bias"))), k["dropout"])
            return F.linear(z, w("linear2.weight"), w("linear2.bias"))

        def norm(z, i):
            return F.layer_norm(z, (D,), w(f"norm{i}.weight"), w(f"norm{i}.bias"), 1e-5)

        if norm_first:
            h = h + drop(attn(norm(h, 1)), k["dropout1"])
            h = h + drop(ff(norm(h, 2)), k["dropout2"])
        else:
            h = norm(h + drop(attn(h), k["dropout1"]), 1)
            h = norm(h + drop(ff(h), k["dropout2"]), 2)
    if norm_first:
        h = F.layer_norm(h, (D,), T["norm.weight"], T["norm.bias"], 1e-5)
    m = torch.from_numpy(mask)[..., None].to(h.dtype)  # [B, L, 1]
    z = (h * m).sum(dim=1) / m.sum(dim=1)  # [B, D]
    return F.linear(z, T["head.weight"], T["head.bias"])


@pytest.mark.parametrize("activation", ["relu", "gelu", "gelu_tanh"])
@pytest.mark.parametrize("norm_first", [False, True])
def test_logits_and_every_gradient_match_torch_with_padding_and_dropout(activation, norm_first):
    """Forward, dx and every parameter's gradient against torch's autograd of the documented
    model, in float64: two blocks, a padding mask, dropout p = 0.3 from fixed keep-masks at
    every site, a random upstream gradient. The finite differences above check the backward
    against the forward; this checks the forward is torch's encoder model (the head's mean
    over the tokens, the final norm of a pre-norm stack, the order of the sublayers)."""
    torch = pytest.importorskip("torch")
    p = 0.3
    model = small("numpy", dropout=p, activation=activation, norm_first=norm_first)
    rng = np.random.default_rng(11)
    model.params = {k: v + 0.2 * rng.standard_normal(v.shape) for k, v in model.params.items()}
    x = rng.standard_normal((B, L, P))
    dlogits = rng.standard_normal((B, C))
    mask = padding_mask(lambda a: a)
    keeps = keep_masks(rng, lambda a: a, p)
    T = {k: torch.tensor(v, requires_grad=True) for k, v in model.params.items()}
    xt = torch.tensor(x, requires_grad=True)
    logits_t = _torch_classifier(torch, T, xt, mask, keeps, p, activation, norm_first, 2)
    logits_t.backward(torch.from_numpy(dlogits))
    logits = model.forward(x, mask=mask, dropout_masks=keeps)
    grads = model.backward(dlogits)
    np.testing.assert_allclose(logits, logits_t.detach().numpy(), rtol=1e-12, atol=1e-13)
    np.testing.assert_allclose(model.dx, xt.grad.numpy(), rtol=1e-11, atol=1e-13)
    assert set(grads) == set(T)
    scale = max(float(v.grad.abs().max()) for v in T.values())
    for k, v in T.items():  # (b_k's gradient is 0 but for rounding: scores shift per row)
        np.testing.assert_allclose(grads[k], v.grad.numpy(), rtol=1e-11, atol=1e-13 * scale, err_msg=k)
