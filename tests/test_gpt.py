"""npattn.gpt: finite differences, torch parity (a whole training step), KV-cache decoding, sampling."""

import copy
import math
import warnings

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from npattn import KVCache, nn
from npattn.backend import backend_name, to_numpy
from npattn.gpt import GPT, sample_next, training_step
from npattn.gradcheck import check_vjp

from reliability_helpers import raises

VOCAB, T, D, N, H, FF = 11, 9, 8, 2, 2, 12
B, L = 2, 6  # L < T: the rows of wpe past L get no gradient
NO_FORWARD = r"^backward: expected a forward call first \(there is no cached forward\)$"


def make(backend="numpy", dtype="float64", **kw):
    return GPT(VOCAB, T, D, N, H, FF, dtype=dtype, backend=backend, seed=3, **kw)


def perturbed(model, to_xp, scale=0.3, seed=1):
    """Non-trivial norms and biases (they start at 1 and 0)."""
    rng = np.random.default_rng(seed)
    model.params = {k: v + to_xp(scale * rng.standard_normal(tuple(v.shape)))
                    for k, v in model.params.items()}
    return model


def ids_of(seed, shape=(B, L)):
    return np.random.default_rng(seed).integers(0, VOCAB, size=shape)


# ------------------------------------------------------------- finite differences


def _check_model_vjp(model, to_xp, ids, seed, **forward_kw):
    names = list(model.params)
    inputs = [model.params[k] for k in names]

    def f(*arrays):
        model.params = dict(zip(names, arrays))
        return model.forward(ids, **forward_kw)

    out = f(*inputs)
    dout = to_xp(np.random.default_rng(seed).standard_normal(tuple(out.shape)))  # never all ones
    grads = model.backward(dout)
    report = check_vjp(f, inputs, [grads[k] for k in names], dout, names=names, n_directions=2,
                       seed=seed)
    assert report.ok, str(report)
    return grads


def test_finite_differences_every_parameter(xp, to_xp):
    model = perturbed(make(xp), to_xp)
    grads = _check_model_vjp(model, to_xp, to_xp(ids_of(0)), seed=5)
    for k, g in grads.items():  # a backward that returns zeros fails here too
        assert float(np.max(np.abs(to_numpy(g)))) > 0.0, k
    # positions past L were not read: their gradient is exactly zero
    assert np.all(to_numpy(grads["wpe"])[L:] == 0.0)


def test_finite_differences_with_dropout_from_fixed_masks(xp, to_xp):
    p = 0.3
    model = perturbed(make(xp, dropout=p), to_xp, seed=2)
    rng = np.random.default_rng(9)
    shapes = {"self_attn": (B, H, L, L), "dropout1": (B, L, D), "dropout": (B, L, FF),
              "dropout2": (B, L, D)}
    masks = [{s: to_xp(rng.random(shape) > p) for s, shape in shapes.items()} for _ in range(N)]
    _check_model_vjp(model, to_xp, to_xp(ids_of(1)), seed=6, dropout_masks=masks)
    # the masks act: another set of masks gives other logits
    other = [{s: to_xp(rng.random(shape) > p) for s, shape in shapes.items()} for _ in range(N)]
    a = to_numpy(model.forward(to_xp(ids_of(1)), dropout_masks=masks))
    b = to_numpy(model.forward(to_xp(ids_of(1)), dropout_masks=other))
    assert np.max(np.abs(a - b)) > 1e-3


def test_block_n_takes_the_keep_masks_of_entry_n():
    """forward(ids, dropout_masks) against its steps composed here on NumPy: block n runs
    causal with dropout_masks[n], and the final layer norm (eps 0.1, not the default) and
    the tied head follow."""
    p = 0.3
    model = perturbed(make(dropout=p, layer_norm_eps=0.1), lambda a: a, seed=4)
    rng = np.random.default_rng(21)
    shapes = {"self_attn": (B, H, L, L), "dropout1": (B, L, D), "dropout": (B, L, FF),
              "dropout2": (B, L, D)}
    masks = [{s: rng.random(shape) > p for s, shape in shapes.items()} for _ in range(N)]
    ids = ids_of(5)
    got = model.forward(ids, dropout_masks=masks)
    P = model.params
    x = P["wte"][ids] + P["wpe"][:L]  # [B, L, D]
    for n, block in enumerate(model.blocks):
        x = block.forward(x, is_causal=True, dropout_masks=masks[n])
    mu, var = x.mean(axis=-1, keepdims=True), x.var(axis=-1, keepdims=True)
    h = (x - mu) / np.sqrt(var + 0.1) * P["ln_f.weight"] + P["ln_f.bias"]
    np.testing.assert_allclose(got, h @ P["wte"].T, rtol=1e-12, atol=1e-12)


def test_masks_drawn_for_sites_not_given_drop_at_the_models_rate(monkeypatch):
    """The keep-masks drawn from the model's generator (every site of every block here) keep
    an entry with probability 1 - p: 960 draws at p = 0.25 (not 0.5, where p and 1 - p
    agree), a kept fraction within 0.1 of 0.75."""
    import npattn.gpt as gpt_module

    drawn, real = [], gpt_module.keep_mask
    monkeypatch.setattr(gpt_module, "keep_mask", lambda *a, **kw: drawn.append(real(*a, **kw)) or drawn[-1])
    make(dropout=0.25).forward(ids_of(0))
    assert len(drawn) == 4 * N  # four sites per block
    kept = np.concatenate([np.asarray(m).ravel() for m in drawn])
    assert kept.size == N * (B * H * L * L + 2 * B * L * D + B * L * FF)
    assert abs(kept.mean() - 0.75) < 0.1, kept.mean()


def test_a_site_given_as_none_draws_from_the_models_generator_as_one_not_given():
    """dropout_masks=[{"dropout1": None}, {}] in training mode: block 0's dropout1 mask is drawn
    from the model's generator, as with no masks at all, so the logits equal a twin's that
    was given none (a block left to draw its own would give other logits)."""
    model, twin = make(dropout=0.3), make(dropout=0.3)
    ids = ids_of(4)
    got = model.forward(ids, dropout_masks=[{"dropout1": None}, {}])
    np.testing.assert_array_equal(got, twin.forward(ids))
    assert np.max(np.abs(got - twin.eval().forward(ids))) > 1e-3  # the masks act


def test_loss_gradient_is_the_cross_entropy_of_the_logits(xp, to_xp):
    model = perturbed(make(xp), to_xp)
    ids, tgt = ids_of(2), ids_of(3)
    loss, dlogits = model.loss(to_xp(ids), to_xp(tgt))
    logits = to_numpy(model.forward(to_xp(ids)))
    # independent: log-softmax in float64 on the host
    z = logits - logits.max(-1, keepdims=True)
    logp = z - np.log(np.exp(z).sum(-1, keepdims=True))
    expected = -np.mean(np.take_along_axis(logp, tgt[..., None], -1))
    assert abs(loss - expected) < 1e-12
    p = np.exp(logp)
    p[np.arange(B)[:, None], np.arange(L)[None, :], tgt] -= 1.0
    np.testing.assert_allclose(to_numpy(dlogits), p / (B * L), rtol=0, atol=1e-15)


def test_loss_with_ignore_index_leaves_padding_out(xp, to_xp):
    """Targets of -100 (torch's padding value) with ignore_index=-100: the loss is the mean
    over the other positions and their dlogits (p - one_hot) / N_kept; padded positions get
    dlogits of exactly 0. A call whose targets are all ignored, or an ignore_index of
    another type, fails before the forward."""
    model = perturbed(make(xp), to_xp)
    ids, tgt = ids_of(2), ids_of(3)
    tgt[0, -2:] = -100
    tgt[1, 0] = -100
    kept = tgt != -100
    loss, dlogits = model.loss(to_xp(ids), to_xp(tgt), ignore_index=-100)
    logits = to_numpy(model.forward(to_xp(ids)))
    z = logits - logits.max(-1, keepdims=True)
    logp = z - np.log(np.exp(z).sum(-1, keepdims=True))  # independent: float64 on the host
    picked = np.take_along_axis(logp, np.where(kept, tgt, 0)[..., None], -1)[..., 0]
    assert abs(loss - (-picked[kept].sum() / kept.sum())) < 1e-12
    p = np.exp(logp)
    p[kept] -= np.eye(VOCAB)[tgt[kept]]
    d = to_numpy(dlogits)
    np.testing.assert_allclose(d[kept], p[kept] / kept.sum(), rtol=0, atol=1e-15)
    assert np.all(d[~kept] == 0.0)
    cache = model._cache  # the last forward's: a refused call runs none
    with pytest.raises(ValueError, match=r"^targets: expected at least one target other than ignore_index"):
        model.loss(to_xp(ids), to_xp(np.full_like(tgt, -100)), ignore_index=-100)
    assert model._cache is cache, "the all-ignored targets were found after a forward"
    with pytest.raises(ValueError, match=r"^targets: expected token ids in \[0, \d+\) or ignore_index = -1"):
        model.loss(to_xp(ids), to_xp(tgt), ignore_index=-1)
    with pytest.raises(TypeError, match=r"^ignore_index: expected None or an int, got bool"):
        model.loss(to_xp(ids), to_xp(tgt), ignore_index=True)
    with pytest.raises(ValueError, match=r"^label_smoothing: expected a real number in \[0, 1\], got 2"):
        model.loss(to_xp(ids), to_xp(tgt), ignore_index=-100, label_smoothing=2)
    assert model._cache is cache, "label_smoothing was checked after a forward"


@pytest.mark.parametrize("reduction, smoothing, pad", [("mean", 0.0, False), ("mean", 0.2, True),
                                                       ("sum", 0.1, True), ("sum", 0.0, False)])
def test_weighted_loss_gradient_against_finite_differences(xp, to_xp, reduction, smoothing, pad):
    """GPT.loss with class weights (and padding, label smoothing, "mean" or "sum"): every
    parameter's gradient from backward(dlogits) against central differences of the loss, in
    random directions, scaled by a random upstream gradient (not 1)."""
    model = perturbed(make(xp), to_xp)
    ids, tgt = ids_of(2), ids_of(3)
    if pad:
        tgt[0, -2:] = -100
    weight = to_xp(np.random.default_rng(6).uniform(0.2, 3.0, VOCAB))
    kw = dict(weight=weight, ignore_index=-100 if pad else None, label_smoothing=smoothing,
              reduction=reduction)
    names = list(model.params)
    inputs = [model.params[k] for k in names]

    def f(*arrays):
        model.params = dict(zip(names, arrays))
        return xp.asarray(model.loss(to_xp(ids), to_xp(tgt), **kw)[0], dtype=xp.float64)

    f(*inputs)
    model.params = dict(zip(names, inputs))
    _, dlogits = model.loss(to_xp(ids), to_xp(tgt), **kw)
    c = float(np.random.default_rng(8).standard_normal())
    grads = model.backward(c * dlogits)
    report = check_vjp(f, inputs, [grads[k] for k in names], xp.asarray(c, dtype=xp.float64), names=names,
                       n_directions=2, seed=7)
    assert report.ok, str(report)
    unweighted, _ = model.loss(to_xp(ids), to_xp(tgt), **{**kw, "weight": None})
    assert abs(model.loss(to_xp(ids), to_xp(tgt), **kw)[0] - unweighted) > 1e-3  # the weights act


def test_sum_of_only_ignored_targets_is_zero_and_a_bad_weight_or_reduction_is_refused():
    """With reduction "sum" every target may be ignored (a loss of 0, zero dlogits, as torch's
    sum); the mean of none is refused before the forward. weight is an array (V,) of the
    model's dtype; reduction "mean" or "sum" ("none" has no one number to differentiate)."""
    model = make()
    ids, tgt = ids_of(0), np.full((B, L), -100)
    loss, dlogits = model.loss(ids, tgt, ignore_index=-100, reduction="sum")
    assert loss == 0.0 and np.all(dlogits == 0.0) and dlogits.shape == (B, L, VOCAB)
    monkeypatch = pytest.MonkeyPatch()
    monkeypatch.setattr(model, "forward", _forward_refused)
    try:
        with raises(ValueError, "targets", "other than ignore_index"):
            model.loss(ids, tgt, ignore_index=-100)
        good = ids_of(1)
        for weight, error, words in ((np.ones(VOCAB - 1), ValueError, ("weight", f"({VOCAB},)")),
                                     (np.ones(VOCAB, np.float32), TypeError, ("weight", "float64")),
                                     (np.full(VOCAB, np.nan), ValueError, ("weight", "finite")),
                                     ([1.0] * VOCAB, TypeError, ("weight", "list"))):
            with raises(error, *words):
                model.loss(ids, good, weight=weight)
        for reduction, error in (("none", ValueError), (None, TypeError), ("Sum", ValueError)):
            with raises(error, "reduction", "'mean' or 'sum'"):
                model.loss(ids, good, reduction=reduction)
            state = nn.adam_init(model.params)
            with raises(error, "reduction"):
                training_step(model, state, ids, good, lr=0.1, reduction=reduction)
    finally:
        monkeypatch.undo()


def test_a_weighted_mean_over_weights_of_zero_fails_and_changes_nothing():
    """Weights of the counted targets that sum to 0 are found by the cross-entropy, after
    the forward: the call is refused naming weight, and the model is as before it (the same
    dropout masks drawn next, the same gradients of the earlier forward)."""
    model, twin = make(dropout=0.3), make(dropout=0.3)
    ids, tgt = ids_of(0), ids_of(1)
    for m in (model, twin):
        m.forward(ids)
    weight = np.ones(VOCAB)
    weight[np.unique(tgt)] = 0.0
    with raises(ValueError, "weight", "nonzero sum"):
        model.loss(ids, tgt, weight=weight)
    dlogits = np.random.default_rng(9).standard_normal((B, L, VOCAB))
    grads, ref = model.backward(dlogits), twin.backward(dlogits)
    for k in ref:
        np.testing.assert_array_equal(grads[k], ref[k], err_msg=k)
    weight[tgt[0, 0]] = 2.0
    loss, dl = model.loss(ids, tgt, weight=weight)
    ref_loss, ref_dl = twin.loss(ids, tgt, weight=weight)  # the same masks drawn
    assert loss == ref_loss
    np.testing.assert_array_equal(dl, ref_dl)


# ------------------------------------------------------------------ torch parity


@pytest.mark.parametrize("weight_decay, eps, pad, smoothing, weighted, reduction", [
    (0.0, 1e-8, False, 0.0, False, "mean"), (0.1, 1e-3, False, 0.0, False, "mean"),
    (0.0, 1e-8, True, 0.0, False, "mean"), (0.0, 1e-8, True, 0.2, False, "mean"),
    (0.0, 1e-8, True, 0.2, True, "mean"), (0.0, 1e-8, False, 0.0, True, "mean"),
    (0.0, 1e-8, True, 0.1, True, "sum"), (0.0, 1e-8, False, 0.0, False, "sum")])
def test_forward_backward_and_three_training_steps_match_torch(weight_decay, eps, pad, smoothing,
                                                               weighted, reduction):
    """torch.optim.Adam's weight_decay is the same L2 penalty as nn.adam_step's; with
    ``pad``, some targets are -100 and both losses take ignore_index=-100; both take
    label_smoothing, class weights (``weighted``: the mean divides by the weights of the
    targets that count) and reduction."""
    torch = pytest.importorskip("torch")
    model = perturbed(make(), lambda a: a)
    weight = np.random.default_rng(4).uniform(0.2, 3.0, VOCAB) if weighted else None
    weight_t = None if weight is None else torch.from_numpy(weight)
    tmodel = model.to_torch()
    opt = torch.optim.Adam(tmodel.parameters(), lr=0.01, eps=eps, weight_decay=weight_decay)
    state = nn.adam_init(model.params)
    named = {"wte": tmodel.wte.weight, "wpe": tmodel.wpe.weight, "ln_f.weight": tmodel.ln_f.weight,
             "ln_f.bias": tmodel.ln_f.bias}
    for step in range(3):
        ids, tgt = ids_of(10 + step), ids_of(20 + step)
        if pad:
            tgt[step % B, step + 1:] = -100
        opt.zero_grad()
        logits_t = tmodel(torch.from_numpy(ids))
        loss_t = torch.nn.functional.cross_entropy(logits_t.reshape(-1, VOCAB),
                                                   torch.from_numpy(tgt).reshape(-1), ignore_index=-100,
                                                   label_smoothing=smoothing, reduction=reduction,
                                                   weight=weight_t)
        loss_t.backward()
        norm_t = torch.nn.utils.clip_grad_norm_(tmodel.parameters(), 0.5)  # clips: the norm is larger
        grads_t = {k: v.grad.detach().clone().numpy() for k, v in named.items()}  # clipped
        opt.step()
        np.testing.assert_allclose(model.forward(ids), logits_t.detach().numpy(), rtol=0, atol=1e-10)
        loss, norm, state = training_step(model, state, ids, tgt, lr=0.01, max_grad_norm=0.5, eps=eps,
                                          weight_decay=weight_decay, ignore_index=-100 if pad else None,
                                          label_smoothing=smoothing, weight=weight, reduction=reduction)
        assert abs(loss - float(loss_t.detach())) < 1e-10
        assert abs(norm - float(norm_t)) < 1e-10 and norm > 0.5
        clipped = nn.clip_grad_norm(model.grads, 0.5)[0]
        for k, g in grads_t.items():
            np.testing.assert_allclose(clipped[k], g, rtol=0, atol=1e-10, err_msg=k)
    for k, v in named.items():  # after three Adam steps, the same parameters
        np.testing.assert_allclose(model.params[k], v.detach().numpy(), rtol=0, atol=1e-10, err_msg=k)
    for n, layer in enumerate(tmodel.blocks):
        w = layer.linear1.weight.detach().numpy()
        np.testing.assert_allclose(model.params[f"blocks.{n}.linear1.weight"], w, rtol=0, atol=1e-10)


def _torch_gpt(torch, P, ids, keeps, p, eps):
    """docs/gpt.md's model in torch ops on the parameters ``P`` (npattn's names): token rows
    of wte plus the first L rows of wpe, pre-norm causal blocks (heads as contiguous Dh slices,
    scores / sqrt(Dh), the tanh GELU, ``keeps[n]`` replayed at the four dropout sites), the
    final norm, the head tied to wte; no dropout on the embeddings."""
    F = torch.nn.functional
    Dh = D // H
    Bt, Lt = ids.shape
    future = ~torch.tril(torch.ones(Lt, Lt, dtype=torch.bool))  # [L, L] True = later position

    def drop(z, keep):  # inverted dropout with a given keep-mask
        return torch.where(torch.from_numpy(keep), z / (1.0 - p), torch.zeros_like(z))

    def heads(z):  # [B, L, D] -> [B, H, L, Dh]
        return z.reshape(Bt, Lt, H, Dh).transpose(1, 2)

    x = P["wte"][torch.from_numpy(ids)] + P["wpe"][:Lt]
    for n in range(N):
        w, k = (lambda name, n=n: P[f"blocks.{n}.{name}"]), keeps[n]
        h = F.layer_norm(x, (D,), w("norm1.weight"), w("norm1.bias"), eps)
        q, kk, v = (heads(F.linear(h, w(f"self_attn.w_{c}"), w(f"self_attn.b_{c}"))) for c in "qkv")
        s = (q @ kk.transpose(-1, -2) / math.sqrt(Dh)).masked_fill(future, -math.inf)
        a = drop(torch.softmax(s, dim=-1), k["self_attn"])
        o = F.linear((a @ v).transpose(1, 2).reshape(Bt, Lt, D), w("self_attn.w_o"), w("self_attn.b_o"))
        x = x + drop(o, k["dropout1"])
        h = F.layer_norm(x, (D,), w("norm2.weight"), w("norm2.bias"), eps)
        f = drop(F.gelu(F.linear(h, w("linear1.weight"), w("linear1.bias")), approximate="tanh"), k["dropout"])
        x = x + drop(F.linear(f, w("linear2.weight"), w("linear2.bias")), k["dropout2"])
    return F.layer_norm(x, (D,), P["ln_f.weight"], P["ln_f.bias"], eps) @ P["wte"].T


@pytest.mark.parametrize("max_grad_norm", [None, 1e3, 0.05])
def test_three_training_steps_with_dropout_match_a_torch_transcription_of_the_docs(max_grad_norm):
    """training_step with dropout p = 0.25 from given keep-masks, betas (0.8, 0.95), eps 1e-6,
    weight decay 0.05 and a layer-norm eps of 0.1, against docs/gpt.md's model written in torch
    ops with the same masks, torch.optim.Adam and clip_grad_norm_ (no clipping, a bound the
    norm stays under, one it passes): loss, norm, every unclipped gradient and every parameter
    after each step. The test above runs torch's own layers, without dropout and with Adam's
    default betas."""
    torch = pytest.importorskip("torch")
    p, ln_eps = 0.25, 0.1
    model = perturbed(make(dropout=p, layer_norm_eps=ln_eps), lambda a: a)
    P = {k: torch.tensor(v, requires_grad=True) for k, v in model.params.items()}
    hyper = dict(lr=0.02, betas=(0.8, 0.95), eps=1e-6, weight_decay=0.05)
    opt = torch.optim.Adam(list(P.values()), **hyper)
    state = nn.adam_init(model.params)
    rng = np.random.default_rng(8)
    for step in range(3):
        ids, tgt = ids_of(30 + step), ids_of(40 + step)
        tgt[0, 0], tgt[1, 0] = 0, VOCAB - 1  # the ends of the vocabulary
        keeps = [{"self_attn": rng.random((B, H, L, L)) > p, "dropout1": rng.random((B, L, D)) > p,
                  "dropout": rng.random((B, L, FF)) > p, "dropout2": rng.random((B, L, D)) > p}
                 for _ in range(N)]
        opt.zero_grad()
        logits_t = _torch_gpt(torch, P, ids, keeps, p, ln_eps)
        loss_t = torch.nn.functional.cross_entropy(logits_t.reshape(-1, VOCAB),
                                                   torch.from_numpy(tgt).reshape(-1))
        loss_t.backward()
        grads_t = {k: v.grad.detach().clone().numpy() for k, v in P.items()}  # before clipping
        if max_grad_norm is None:
            norm_t = math.sqrt(sum(float(np.sum(g * g)) for g in grads_t.values()))
        else:
            norm_t = float(torch.nn.utils.clip_grad_norm_(list(P.values()), max_grad_norm))
        opt.step()
        loss, norm, state = training_step(model, state, ids, tgt, max_grad_norm=max_grad_norm,
                                          dropout_masks=keeps, **hyper)
        assert abs(loss - float(loss_t.detach())) < 1e-12 * abs(loss)
        assert abs(norm - norm_t) < 1e-12 * norm
        assert max_grad_norm is None or (norm > max_grad_norm) == (max_grad_norm == 0.05)
        scale = max(float(np.abs(g).max()) for g in grads_t.values())
        for k, g in grads_t.items():  # (b_k's is 0 but for rounding: it shifts a row's scores)
            np.testing.assert_allclose(model.grads[k], g, rtol=1e-11, atol=1e-13 * scale, err_msg=k)
        for k, v in P.items():  # b_k: Adam steps by its gradient's rounding noise over eps
            tol = 1e-9 if k.endswith("self_attn.b_k") else 1e-12
            np.testing.assert_allclose(model.params[k], v.detach().numpy(), rtol=0, atol=tol, err_msg=k)


# -------------------------------------------------------------- KV-cache decoding


def test_generate_logits_equal_a_full_forward(xp, to_xp):
    model = perturbed(make(xp, dropout=0.2), to_xp)  # generate runs with dropout off
    prompt = to_xp(ids_of(4, (B, 3)))
    out, logits = model.generate(prompt, T - 3, seed=0, return_logits=True, temperature=0.7, top_k=5)
    out_h = to_numpy(out)
    assert out_h.shape == (B, T) and np.array_equal(out_h[:, :3], ids_of(4, (B, 3)))
    assert model.training  # the mode is restored
    full = to_numpy(model.eval().forward(out[:, :-1]))  # [B, T-1, V]: position t predicts t+1
    np.testing.assert_allclose(to_numpy(logits), full[:, 2:], rtol=0, atol=1e-10)
    # each sampled token is among the 5 largest logits of its step
    lg = to_numpy(logits)
    kth = np.sort(lg, axis=-1)[..., -5]
    chosen = np.take_along_axis(lg, out_h[:, 3:, None], -1)[..., 0]
    assert np.all(chosen >= kth)


def test_greedy_generation_is_the_argmax_chain_of_full_forwards(xp, to_xp):
    model = perturbed(make(xp), to_xp, seed=4).eval()
    seq = ids_of(5, (B, 2))
    got = to_numpy(model.generate(to_xp(seq), 4, greedy=True))
    for _ in range(4):  # no cache: the whole sequence each time
        logits = to_numpy(model.forward(to_xp(seq)))
        seq = np.concatenate([seq, logits[:, -1].argmax(-1)[:, None]], axis=1)
    np.testing.assert_array_equal(got, seq)


@given(prompt=st.integers(1, 3), chunks=st.lists(st.integers(1, 3), min_size=1, max_size=2),
       back=st.integers(0, T - 2), seed=st.integers(0, 2**16))
def test_decoding_in_chunks_and_after_a_truncate_equals_full_forwards(prompt, chunks, back, seed):
    """A prompt of 1-3 tokens and chunks of 1-3 through the caches give the logits of one
    forward over the same tokens; caches then filled to block_size and truncated to ``back``
    give, for the next 2 tokens, those of a forward over the first ``back`` tokens and them.
    Greedy generation from a 1-token prompt up to block_size is the argmax chain of full
    forwards."""
    model = perturbed(make(), np.asarray, scale=1.0, seed=seed).eval()
    rng = np.random.default_rng(seed)
    ids, nxt = rng.integers(0, VOCAB, (B, T)), rng.integers(0, VOCAB, (B, 2))
    caches = model.new_caches(B)
    logits, t = [], 0
    for n in [prompt] + chunks:  # at most 3 + 2 * 3 = T tokens
        logits.append(model.forward(ids[:, t:t + n], kv_caches=caches))
        t += n
    np.testing.assert_allclose(np.concatenate(logits, axis=1), model.forward(ids[:, :t]), rtol=0, atol=1e-12)
    if t < T:
        model.forward(ids[:, t:], kv_caches=caches)  # every cache full
    for cache in caches:
        cache.truncate(back)
    want = model.forward(np.concatenate([ids[:, :back], nxt], axis=1))[:, back:]
    np.testing.assert_allclose(model.forward(nxt, kv_caches=caches), want, rtol=0, atol=1e-12)
    seq = ids[:, :1]
    got = model.generate(seq, T, greedy=True)  # the last token chosen is not fed back: 1 + T - 1 <= T
    for _ in range(T):
        seq = np.concatenate([seq, model.forward(seq)[:, -1].argmax(-1)[:, None]], axis=1)
    np.testing.assert_array_equal(got, seq)


def test_sampling_is_reproducible_from_a_seed_and_top_1_is_greedy(xp, to_xp):
    model = perturbed(make(xp), to_xp, seed=5)
    prompt = to_xp(ids_of(6, (B, 2)))
    a = to_numpy(model.generate(prompt, 5, seed=42))
    b = to_numpy(model.generate(prompt, 5, seed=42))
    np.testing.assert_array_equal(a, b)
    c = to_numpy(model.generate(prompt, 5, seed=np.random.default_rng(42)))
    np.testing.assert_array_equal(a, c)
    # every seed the dropout functions' rng takes: a SeedSequence and a BitGenerator too
    bits = np.random.PCG64(42)
    for seed in (np.random.SeedSequence(42), bits):
        np.testing.assert_array_equal(to_numpy(model.generate(prompt, 5, seed=seed)), a)
    assert bits.state != np.random.PCG64(42).state  # drawn from, as a Generator is
    g = to_numpy(model.generate(prompt, 5, greedy=True))
    np.testing.assert_array_equal(to_numpy(model.generate(prompt, 5, top_k=1, seed=7)), g)
    # each draw is sample_next's documented inverse CDF of softmax(logits / temperature) (top-k
    # kept): u ~ U[0, 1) from the seeded generator, one per row and step, and the token is the
    # first v with cumsum(p)[v] > u; the logits are those of a full forward of the ids so far.
    # Four prompts, seven steps each
    prompts = to_xp(ids_of(8, (4, 2)))
    for temperature, top_k in ((1.0, None), (0.5, 2), (2.0, None)):
        drawn = to_numpy(model.generate(prompts, 7, seed=42, temperature=temperature, top_k=top_k))
        u = np.random.default_rng(42).random((7, 4))  # [steps, rows]
        for t in range(7):
            z = to_numpy(model.forward(to_xp(drawn[:, :2 + t])))[:, -1] / temperature  # [B, V]
            if top_k is not None:
                z = np.where(z >= np.sort(z, axis=-1)[:, -top_k:][:, :1], z, -np.inf)
            p = np.exp(z - z.max(axis=-1, keepdims=True))
            p /= p.sum(axis=-1, keepdims=True)  # [B, V]
            want = [int(np.searchsorted(np.cumsum(p[i]), u[t, i], side="right")) for i in range(4)]
            assert drawn[:, 2 + t].tolist() == want, (temperature, top_k, t, drawn[:, 2 + t], want)
            if top_k is not None:  # among the two largest logits
                assert all(np.isfinite(z[i, drawn[i, 2 + t]]) for i in range(4))


def test_sample_next_frequencies_follow_the_tempered_softmax():
    logits = np.array([[1.0, 0.0, -1.0, 2.0, 0.5]])
    rng = np.random.default_rng(0)
    n = 20000
    for temperature, top_k in ((1.0, None), (0.5, None), (2.0, 3)):
        draws = np.array([sample_next(logits, rng, temperature=temperature, top_k=top_k)[0]
                          for _ in range(n)])
        z = logits[0] / temperature
        if top_k is not None:
            z = np.where(z >= np.sort(z)[-top_k], z, -np.inf)
        p = np.exp(z - z.max())
        p /= p.sum()
        freq = np.bincount(draws, minlength=5) / n
        sigma = np.sqrt(p * (1 - p) / n)
        assert np.all(np.abs(freq - p) <= 5 * sigma + 1e-12), (temperature, top_k, freq, p)


def test_greedy_takes_the_first_largest_logit_and_each_row_draws_its_own_number():
    rng = np.random.default_rng(0)
    ties = np.array([[1.0, 3.0, 3.0, 0.0], [2.0, 2.0, 2.0, 2.0], [0.0, -np.inf, 4.0, 4.0]])
    np.testing.assert_array_equal(sample_next(ties, rng, greedy=True), [1, 0, 2])  # as np.argmax
    # 400 rows of uniform logits over 5 tokens: independent rows cover all 5 (a token is
    # missing with probability 5 * 0.8**400); rows sharing one uniform number all agree
    tokens = sample_next(np.zeros((400, 5)), rng)
    assert set(tokens.tolist()) == {0, 1, 2, 3, 4}
    assert np.all(np.abs(np.bincount(tokens, minlength=5) - 80) < 5 * math.sqrt(400 * 0.2 * 0.8))
    # top_k = V keeps every token: the same draws as no top_k from the same seed
    logits = np.random.default_rng(1).standard_normal((6, 5))
    np.testing.assert_array_equal(sample_next(logits, np.random.default_rng(3), top_k=5),
                                  sample_next(logits, np.random.default_rng(3)))


def test_training_step_reports_the_global_norm_before_clipping():
    """grad_norm is sqrt(sum of every squared gradient entry), with and without clipping."""
    ids, tgt = ids_of(7), ids_of(8)
    probe = make()
    _, dlogits = probe.loss(ids, tgt)  # the gradients the step will see, computed apart
    grads = probe.backward(dlogits)
    want = np.linalg.norm(np.concatenate([np.ravel(to_numpy(g)) for g in grads.values()]))
    assert want > 0.1
    for max_grad_norm in (None, 0.01, 1e6):
        model = make()
        _, norm, _ = training_step(model, nn.adam_init(model.params), ids, tgt, lr=1e-3,
                                   max_grad_norm=max_grad_norm)
        assert norm == pytest.approx(want, rel=1e-10), max_grad_norm


# Adam's second moment, g * g in float32, overflows (a true inf there): NumPy warns of it
@pytest.mark.filterwarnings("ignore:overflow encountered in multiply:RuntimeWarning")
def test_training_step_reports_the_norm_of_gradients_whose_squares_overflow_without_clipping():
    """A float32 model whose final layer norm weight is 1e20 has gradients past 1.8e19, whose
    squares overflow: with max_grad_norm=None the step summed them as they are and reported
    inf, with a NumPy overflow warning, where clipping reports the norm (nn.clip_grad_norm's
    total, summed again from the scaled arrays). Both report the norm now, nn.global_norm."""
    def big():
        model = make(dtype="float32")
        model.params = {**model.params, "ln_f.weight": model.params["ln_f.weight"] * np.float32(1e20)}
        return model

    ids, tgt = ids_of(0), ids_of(1)
    probe = big()
    grads = probe.backward(probe.loss(ids, tgt)[1])
    want = np.linalg.norm(np.concatenate([np.ravel(g).astype(np.float64) for g in grads.values()]))
    assert want > 1e20 and math.isfinite(want)  # (float32 squares end at 3.4e38)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the overflow of the first sum is no news: none is raised
        assert abs(nn.global_norm(grads) - want) <= 1e-6 * want
    for max_grad_norm in (None, 1e30):  # 1e30: the norm of clip_grad_norm, which does not clip
        model = big()
        _, norm, _ = training_step(model, nn.adam_init(model.params), ids, tgt, lr=0.0,
                                   max_grad_norm=max_grad_norm)
        assert abs(norm - want) <= 1e-6 * want, (max_grad_norm, norm, want)


def test_generate_of_no_new_tokens_returns_the_prompt_and_no_logits(xp, to_xp):
    """max_new_tokens=0 runs the prompt and samples nothing: the ids come back, with logits
    (B, 0, V); a prompt of one token needs no cache room beyond it."""
    model = make(xp)
    for L0 in (1, 3):
        ids = ids_of(L0, (B, L0))
        out, logits = model.generate(to_xp(ids), 0, return_logits=True)
        np.testing.assert_array_equal(to_numpy(out), ids)
        assert tuple(logits.shape) == (B, 0, VOCAB) and logits.dtype == model.dtype
    # the sampling options are checked even when nothing is sampled, before the prompt runs
    for kw, error, match in (({"temperature": 0.0}, ValueError, "^temperature"),
                             ({"top_k": VOCAB + 1}, ValueError, "^top_k"),
                             ({"greedy": "yes"}, TypeError, "^greedy")):
        with pytest.raises(error, match=match):
            model.generate(to_xp(ids_of(0, (B, 2))), 0, **kw)


def test_generate_leaves_the_mode_as_it_found_it(xp, to_xp):
    model = make(backend=xp)
    prompt = to_xp(ids_of(2, (B, 3)))
    model.eval().generate(prompt, 2, greedy=True)
    assert model.training is False
    model.train().generate(prompt, 2, greedy=True)
    assert model.training is True


def test_training_reduces_the_loss_on_a_repeated_batch():
    model = make(dtype="float32")
    ids, tgt = ids_of(7), ids_of(8)
    state = nn.adam_init(model.params)
    first, _, state = training_step(model, state, ids, tgt, lr=0.02)
    for _ in range(40):
        loss, _, state = training_step(model, state, ids, tgt, lr=0.02)
    assert math.log(VOCAB) - 0.1 < first < math.log(VOCAB) + 0.3  # about uniform at the start
    assert loss < 0.5 * first


def test_training_step_defaults_clip_at_1_and_adam_eps_1e8():
    """Without them, training_step clips the gradients' norm to max_grad_norm = 1 and steps
    Adam with eps = 1e-8, betas (0.9, 0.999) and no weight decay (torch's defaults): the
    same bits as those steps taken by hand on a twin model. The gradients' norm is above 1,
    so the clipping acts, and Adam's first step g / (|g| + eps) depends on eps in its last
    bits."""
    model = perturbed(make(), np.asarray, scale=1.0)
    twin = copy.deepcopy(model)
    ids, tgt = ids_of(7), ids_of(8)
    state = nn.adam_init(model.params)
    loss, norm, _ = training_step(model, state, ids, tgt, lr=0.01)

    want_loss, dlogits = twin.loss(ids, tgt)
    grads = twin.backward(dlogits)
    clipped, want_norm = nn.clip_grad_norm(grads, 1.0)
    want, _ = nn.adam_step(twin.params, clipped, nn.adam_init(twin.params), lr=0.01,
                           betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0)
    assert want_norm > 1.0 and (loss, norm) == (want_loss, want_norm)
    for k in want:
        np.testing.assert_array_equal(model.params[k], want[k], err_msg=k)


def test_layer_norm_eps_defaults_to_torchs():
    """GPT's layer norms (every block's two and ln_f) default to torch's eps, 1e-5."""
    model = make()
    assert model.layer_norm_eps == 1e-5
    assert all(b.layer_norm_eps == 1e-5 for b in model.blocks)


# --------------------------------------------------------------------- bad input


def test_bad_inputs_name_the_argument_and_change_nothing(xp, to_xp):
    model, twin = make(xp, dropout=0.1), make(xp, dropout=0.1)
    ids = to_xp(ids_of(0))
    model.forward(ids)
    twin.forward(ids)
    params = {k: to_numpy(v) for k, v in model.params.items()}
    cases = [
        (lambda: model.forward(to_xp(ids_of(0).astype(np.float64))), TypeError, "ids"),
        (lambda: model.forward(to_xp(ids_of(0) + VOCAB)), ValueError, r"ids: expected token ids in \[0, 11\)"),
        (lambda: model.forward(to_xp(ids_of(0, (B, T + 1)))), ValueError, "block_size"),
        (lambda: model.forward(to_xp(ids_of(0)[0])), ValueError, r"ids: expected shape \(B, L\)"),
        (lambda: model.forward(ids, dropout_masks=[{}]), ValueError,
         r"^dropout_masks: expected a list of 2 dicts or None \(one per block\), got a list of length 1$"),
        (lambda: model.forward(ids, dropout_masks={"dropout": None}), TypeError,
         r"^dropout_masks: expected a list of 2 dicts or None \(one per block\), got dict$"),
        (lambda: model.forward(ids, dropout_masks=[None, "dropout"]), TypeError,
         r"^dropout_masks\[1\]: expected a dict or None, got str$"),
        (lambda: model.forward(ids, dropout_masks=[{"dropout9": None}, None]), ValueError, "dropout_masks"),
        (lambda: model.forward(ids, dropout_masks=[None, {"dropout": to_xp(np.ones((B, L, D), dtype=bool))}]),
         ValueError, rf"^dropout_masks\[1\]\['dropout'\]: expected a shape that broadcasts to \(B, L, F\) = "
                     rf"\({B}, {L}, {FF}\) .* got shape \({B}, {L}, {D}\)$"),
        (lambda: model.backward(to_xp(np.zeros((B, L + 1, VOCAB)))), ValueError, "dlogits"),
        (lambda: model.backward(to_xp(np.zeros((B, L, VOCAB), dtype=np.float32))), TypeError,
         r"^dlogits: expected dtype float64, got float32"),
        (lambda: model.generate(ids, T), ValueError, "max_new_tokens"),
        (lambda: model.generate(ids, 1, temperature=0.0), ValueError, "temperature"),
        (lambda: model.generate(ids, 1, top_k=VOCAB + 1), ValueError, "top_k"),
        (lambda: model.forward(ids, kv_caches=[None, None]), TypeError, "kv_caches"),
        (lambda: model.loss(ids, to_xp(ids_of(0)[:, :3])), ValueError, "targets"),
    ]
    for call, error, match in cases:
        with pytest.raises(error, match=match):
            call()
    # the dropout generator did not move: the next draw is the twin's, which saw no failed call
    np.testing.assert_array_equal(to_numpy(model.forward(ids)), to_numpy(twin.forward(ids)))
    for k, v in model.params.items():
        np.testing.assert_array_equal(to_numpy(v), params[k])


def test_backward_before_forward_and_after_decoding_are_runtime_errors(xp, to_xp):
    model = make(xp)
    with pytest.raises(RuntimeError, match=NO_FORWARD):
        model.backward(to_xp(np.zeros((B, L, VOCAB))))
    caches = model.new_caches(B)
    model.forward(to_xp(ids_of(0)), kv_caches=caches)
    with pytest.raises(RuntimeError, match="kv_caches"):
        model.backward(to_xp(np.zeros((B, L, VOCAB))))
    with pytest.raises(ValueError, match=r"^ids: expected at most 3 positions \(block_size 9, 6 already "
                       r"cached\), got 4$"):  # 6 cached + 4 new > 9
        model.forward(to_xp(ids_of(0, (B, 4))), kv_caches=caches)
    assert [list(c.cache_seqlens) for c in caches] == [[L, L]] * N
    # a cache that does not fit in the last block: refused before the first block's cache is
    # written; another dtype or library is a TypeError, as for MultiHeadAttention's and a
    # block's kv_cache (validation's vocabulary), another layout a ValueError
    other = "numpy" if backend_name(xp) != "numpy" else "array_api_strict"
    for last, error, match in [
        (make(xp, dtype="float32").new_caches(B)[0], TypeError,
         r"^kv_caches\[1\]: expected dtype float64 .*got float32$"),
        (KVCache(B, T, H, D // H, dtype="float64", backend=other), TypeError,
         rf"^kv_caches\[1\]: expected a cache of the module's backend '{backend_name(xp)}'"),
        (KVCache(B, T, H + 1, D // H, dtype="float64", backend=xp), ValueError,
         rf"^kv_caches\[1\]: expected batch_size={B}, num_kv_heads={H}, head_dim={D // H}, "
         rf".*got KVCache\(batch_size={B}, .*num_kv_heads={H + 1}, "),
    ]:
        mixed = model.new_caches(B)[:-1] + [last]
        with pytest.raises(error, match=match):
            model.forward(to_xp(ids_of(0, (B, 2))), kv_caches=mixed)
        assert [list(c.cache_seqlens) for c in mixed] == [[0, 0], [0, 0]]
    # a cache on another device (torch's meta device stands for a GPU's): refused before any
    # block runs, and the training forward before it can still be differentiated (the device was
    # checked inside the last block only, after the first had replaced its cache)
    if backend_name(xp) == "torch":
        import torch

        logits = model.forward(to_xp(ids_of(0)))
        elsewhere = model.new_caches(B)[:-1] + [KVCache(B, T, H, D // H, dtype="float64",
                                                        backend="torch", device="meta")]
        with pytest.raises(ValueError, match=r"^kv_caches\[1\]: expected a cache on device"):
            model.forward(to_xp(ids_of(0, (B, 2))), kv_caches=elsewhere)
        assert [list(c.cache_seqlens) for c in elsewhere[:-1]] == [[0, 0]]
        model.backward(torch.ones_like(logits) / logits.numel())
    dropping = make(xp, dropout=0.2)  # training mode with dropout: decoding is refused
    with pytest.raises(ValueError, match="eval"):
        dropping.forward(to_xp(ids_of(0, (B, 2))), kv_caches=dropping.new_caches(B))


# ----------------------------------------------------------------- copies, files


def test_pickle_and_deepcopy_keep_parameters_mode_and_the_dropout_generator(xp, to_xp):
    import copy
    import pickle

    model = perturbed(make(xp, dropout=0.3), to_xp)
    ids = to_xp(ids_of(0))
    model.forward(ids)
    for twin in (pickle.loads(pickle.dumps(model)), copy.deepcopy(model)):
        for k, v in model.params.items():
            np.testing.assert_array_equal(to_numpy(twin.params[k]), to_numpy(v))
        # the next two forwards draw the same dropout masks as the original's next two
        a = [to_numpy(twin.forward(ids)) for _ in range(2)]
        np.testing.assert_array_equal(a[0], to_numpy(copy.deepcopy(model).forward(ids)))
        assert np.max(np.abs(a[0] - a[1])) > 1e-3  # the generator moved on
    fresh = pickle.loads(pickle.dumps(model))  # after model's forward: its activations are not copied
    with pytest.raises(RuntimeError, match=NO_FORWARD):
        fresh.backward(to_xp(np.zeros((B, L, VOCAB))))
    twin = copy.deepcopy(model)
    twin.params = {k: v * 0.0 for k, v in twin.params.items()}
    assert float(np.max(np.abs(to_numpy(model.params["wte"])))) > 0.0  # independent


def test_save_and_load_on_another_backend(tmp_path, xp, to_xp):
    model = perturbed(make(xp, dropout=0.2), to_xp).eval()
    path = tmp_path / "gpt.npz"
    model.save(str(path))
    raw = np.load(path, allow_pickle=False)  # read independently: the parameters are there as saved
    np.testing.assert_array_equal(raw["param/wte"], to_numpy(model.params["wte"]))
    loaded = GPT.load(str(path), backend="numpy")
    assert not loaded.training and loaded.n_params() == model.n_params()
    ids = ids_of(1)
    np.testing.assert_allclose(loaded.forward(ids), to_numpy(model.forward(to_xp(ids))), rtol=0,
                               atol=1e-13)
    model.train()
    loaded.train()
    np.testing.assert_allclose(loaded.forward(ids), to_numpy(model.forward(to_xp(ids))), rtol=0,
                               atol=1e-13)  # the same dropout masks: the generator was saved


def test_loading_another_kind_of_file_is_a_value_error(tmp_path):
    from npattn.transformer import TransformerBlock

    path = tmp_path / "block.npz"
    TransformerBlock(D, H, FF).save(str(path))
    with pytest.raises(ValueError, match=r"^load: '.*block\.npz': expected format 'npattn\.gpt\.GPT' "
                       r"\(a file of GPT\.save\), got 'npattn\.TransformerBlock'$"):
        GPT.load(str(path))
    with pytest.raises(TypeError, match=r"^path: expected a file name \(str or os\.PathLike\) or a binary "
                       r"file object with write\(\), got int$"):
        make().save(3)


# ------------------------------------------------------------ review findings


def test_decoding_in_training_mode_with_dropout_is_refused_by_the_model():
    """kv_caches in training mode with dropout: the model's ValueError naming kv_caches, before
    the embedding (not a block's naming kv_cache after it), and the caches keep their lengths."""
    model = make(dropout=0.1)
    caches = model.new_caches(B)
    with pytest.raises(ValueError, match=r"^kv_caches: decoding is forward only, without dropout; call eval"):
        model.forward(ids_of(0, (B, 2)), kv_caches=caches)
    assert [list(c.cache_seqlens) for c in caches] == [[0, 0]] * N


def test_eval_forwards_draw_no_dropout_masks():
    """In eval mode the model's generator does not move: a training forward after eval
    forwards draws the masks of a twin that ran none."""
    model, twin = make(dropout=0.3), make(dropout=0.3)
    model.eval()
    for seed in range(3):
        model.forward(ids_of(seed))
    model.train()
    np.testing.assert_array_equal(model.forward(ids_of(7)), twin.forward(ids_of(7)))


def test_one_cache_shared_by_every_block_is_refused(xp, to_xp):
    from npattn import KVCache

    model = make(xp).eval()
    cache = KVCache(B, T, H, D // H, dtype="float64", backend=xp)
    with pytest.raises(ValueError, match=rf"got {N} with 1 distinct \(a list like \[cache\] \* n_layer "
                       r"shares one cache\)$"):
        model.forward(to_xp(ids_of(0, (B, 2))), kv_caches=[cache] * N)
    assert list(cache.cache_seqlens) == [0, 0]
    # too few caches, none shared: no word of sharing
    with pytest.raises(ValueError, match=r"distinct KVCache objects, one per block \(new_caches\), "
                       r"got 1 with 1 distinct$"):
        model.forward(to_xp(ids_of(0, (B, 2))), kv_caches=model.new_caches(B)[:1])


def test_caches_with_ragged_lengths_are_refused(xp, to_xp):
    """Positions are shared by the batch (wpe[s : s + L]): caches whose entries hold different
    lengths (a ragged prefill truncated per entry) would put an entry's token at another
    entry's position, so they are refused, and nothing is appended."""
    model = make(xp).eval()
    caches = model.new_caches(B)
    model.forward(to_xp(ids_of(0, (B, 3))), kv_caches=caches)
    for c in caches:
        c.truncate([3, 2])
    with pytest.raises(ValueError, match="^kv_caches: expected the same cached length"):
        model.forward(to_xp(ids_of(1, (B, 1))), kv_caches=caches)
    assert all([int(n) for n in c.cache_seqlens] == [3, 2] for c in caches)


def test_sample_next_is_greedy_in_the_limit_of_small_temperatures_and_checks_its_input():
    rng = np.random.default_rng(0)
    logits = np.array([[0.0, 1.0, 5.0, 2.0]] * 50)
    for tau in (1e-3, 1e-307, 5e-324):  # (logits - max) / tau: no overflow, the largest wins
        assert np.all(sample_next(logits, rng, temperature=tau) == 2)
    with_neg_inf = np.array([[-np.inf, 0.0, -np.inf]])
    assert sample_next(with_neg_inf, rng)[0] == 1
    bad = [
        (np.array([[0.0, np.nan]]), {}, ValueError, "^logits: expected no NaN .* got NaN in row 0$"),
        (np.array([[0.0, 1.0], [0.0, np.inf]]), {}, ValueError, "^logits: .* got \\+inf in row 1$"),
        (np.array([[-np.inf, -np.inf]]), {}, ValueError, "^logits: .* got only -inf in row 0$"),
        (np.array([[0.0, 1.0], [np.inf, np.nan]]), {}, ValueError, "^logits: .* got NaN in row 1$"),
        (np.array([0.0, 1.0]), {}, ValueError,
         r"^logits: expected shape \(B, V\) with B, V >= 1, got \(2,\)$"),
        (np.zeros((2, 3, 4)), {}, ValueError, r"^logits: expected shape \(B, V\) .*, got \(2, 3, 4\)$"),
        (logits, {"greedy": "no"}, TypeError, "^greedy: expected a bool, got str 'no'$"),
        (logits, {"temperature": 0.0}, ValueError, "^temperature: expected a finite number > 0, got 0.0$"),
        (logits, {"top_k": 5}, ValueError, "^top_k: expected at most vocab_size = 4, got 5$"),
        # host real floating arrays only (complex lost its imaginary part, bool and object and
        # other libraries' arrays were converted)
        (logits.astype(np.complex128), {}, TypeError, "^logits: expected a real floating NumPy array"),
        (logits > 0, {}, TypeError, "^logits: expected a real floating NumPy array"),
        (logits.tolist(), {}, TypeError, "^logits: expected a real floating NumPy array .* got list"),
        # a masked array's mask was ignored: masked tokens were drawn
        (np.ma.array(logits, mask=logits > 4), {}, TypeError,
         "^logits: expected a plain numpy.ndarray, got numpy.MaskedArray"),
    ]
    for z, kw, error, match in bad:
        with pytest.raises(error, match=match):
            sample_next(z, rng, **kw)
    with pytest.raises(TypeError, match="^rng: expected a numpy.random.Generator, got int$"):
        sample_next(logits, 0)
    # greedy checks the sampling options too, as generate does (they were ignored: a NaN
    # temperature, top_k = 0 and a non-generator rng returned the argmax)
    for kw, error, match in [({"temperature": float("nan")}, ValueError, "^temperature: .* got nan"),
                             ({"top_k": 0}, ValueError, "^top_k: expected an int >= 1, got 0"),
                             ({"top_k": 5}, ValueError, "^top_k: expected at most vocab_size = 4")]:
        with pytest.raises(error, match=match):
            sample_next(logits, rng, greedy=True, **kw)
    with pytest.raises(TypeError, match="^rng: expected a numpy.random.Generator, got None$"):
        sample_next(logits, None, greedy=True)
    state = rng.bit_generator.state
    assert np.all(sample_next(logits, rng, greedy=True, temperature=0.5, top_k=2) == 2)
    assert rng.bit_generator.state == state  # greedy draws nothing
    assert sample_next(logits, rng, temperature=np.float32(0.5)).shape == (50,)


@pytest.mark.parametrize("eps", [1e-5, 0.2])
def test_to_torch_matches_in_eval_mode_under_no_grad(eps):
    """The torch model computes the same logits, with the blocks' and the final norm's eps."""
    torch = pytest.importorskip("torch")
    model = perturbed(make(layer_norm_eps=eps), lambda a: a).eval()
    tmodel = model.to_torch()
    ids = ids_of(3)
    with torch.no_grad():  # torch's fast inference path of the encoder layers
        got = tmodel(torch.from_numpy(ids)).numpy()
    np.testing.assert_allclose(got, model.forward(ids), rtol=0, atol=1e-10)
    assert tmodel.training is False and model.train().to_torch().training is True  # the mode


def test_training_step_checks_its_arguments_before_the_forward(xp, to_xp):
    model, twin = make(xp, dropout=0.2), make(xp, dropout=0.2)
    ids, tgt = to_xp(ids_of(0)), to_xp(ids_of(1))
    state = nn.adam_init(model.params)
    other = nn.adam_init(GPT(VOCAB, T, D, 1, H, FF, dtype="float64", backend=xp).params)  # one block
    cases = [
        (dict(lr=-1.0), ValueError, "^lr: expected a finite number >= 0, got -1.0$"),
        (dict(lr="a"), TypeError, "^lr: expected a real number, got str 'a'$"),
        (dict(lr=0.1, max_grad_norm=0), ValueError, "^max_grad_norm: expected a finite number > 0, got 0$"),
        (dict(lr=0.1, betas=(0.9,)), ValueError,
         r"^betas: expected two numbers in \[0, 1\), got a tuple of 1: \(0\.9,\)$"),
        (dict(lr=0.1, eps=-1e-8), ValueError, "^eps: expected a finite number >= 0, got -1e-08$"),
        (dict(lr=0.1, weight_decay=-1.0), ValueError,
         "^weight_decay: expected a finite number >= 0, got -1.0$"),
        (dict(lr=0.1, state=nn.AdamState(state.m, state.v, "x")), TypeError, r"^state\.t: expected an int"),
    ]
    for kw, error, match in cases:
        kw = dict(kw)
        with pytest.raises(error, match=match):
            training_step(model, kw.pop("state", state), ids, tgt, **kw)
    with pytest.raises(ValueError, match=r"^state: expected the Adam moments of these parameters "
                                         r"\(nn\.adam_init\(params\)\), got moments of other names$"):
        training_step(model, other, ids, tgt, lr=0.1)
    lower = nn.adam_init({k: v[...] * 0.0 for k, v in model.params.items()})  # a float32 Adam state
    lower = lower._replace(m={k: xp.astype(v, xp.float32) for k, v in lower.m.items()})
    with pytest.raises(TypeError, match=r"state\.m\['wte'\]: expected dtype float64"):
        training_step(model, lower, ids, tgt, lr=0.1)  # refused before the forward, not by Adam after it
    with pytest.raises(TypeError, match=r"^state: expected an npattn\.nn\.AdamState "
                                        r"\(nn\.adam_init\(params\)\), got None$"):
        training_step(model, None, ids, tgt, lr=0.1)
    assert model.grads == {}  # nothing ran
    np.testing.assert_array_equal(to_numpy(model.forward(ids)), to_numpy(twin.forward(ids)))
    training_step(model, state, ids, tgt, lr=0.1, max_grad_norm=np.float32(1.0))  # NumPy scalars are numbers


def test_fresh_parameters_follow_gpt2s_initialisation():
    """GPT-2's init: the token and position tables N(0, 0.02^2) (800 and 320 draws here: their
    sample standard deviations within 20%, their means within 0.005), the final norm 1 and 0."""
    model = GPT(50, 20, 16, 1, 2, dtype="float64", seed=7)
    p = {k: np.asarray(v) for k, v in model.params.items()}
    for name in ("wte", "wpe"):
        assert 0.8 * 0.02 < p[name].std() < 1.2 * 0.02, (name, p[name].std())
        assert abs(p[name].mean()) < 0.005, name
    np.testing.assert_array_equal(p["ln_f.weight"], np.ones(16))
    np.testing.assert_array_equal(p["ln_f.bias"], np.zeros(16))


def test_a_seed_sequence_seeds_the_model_as_its_entropy_does_and_is_not_advanced():
    """The seed check takes a numpy SeedSequence, but the constructor then passed it to
    SeedSequence(), whose TypeError named no argument. A SeedSequence(5) that has spawned
    nothing is the root seed=5 makes, so the parameters and the dropout draws are those of
    seed=5; the SeedSequence given is not advanced (a second model from it is the same)."""
    seq = np.random.SeedSequence(5)
    models = [GPT(VOCAB, T, D, N, H, FF, dtype="float64", dropout=0.3, seed=s) for s in (seq, seq, 5)]
    assert seq.n_children_spawned == 0
    ids = ids_of(0)
    logits = [np.asarray(m.forward(ids)) for m in models]  # training: dropout drawn
    for m, out in zip(models[:2], logits[:2]):
        for k, v in models[2].params.items():
            np.testing.assert_array_equal(m.params[k], v, err_msg=k)
        np.testing.assert_array_equal(out, logits[2])


def test_constructor_and_generate_checks(xp, to_xp):
    # (a backend without float16 lists the two it has)
    with pytest.raises(ValueError, match=r"^dtype: expected ('float32' or 'float64' \(the GPT's Adam .*\)"
                                         r"|one of \['float32', 'float64'\] for backend '\w+'), "
                                         r"got 'float16'$"):
        make(xp, dtype="float16")
    # dtype as MultiHeadAttention reads it: a name or a dtype object (NumPy's type, the backend's
    # own); None or an integer dtype is a TypeError, half precision a ValueError
    for bad, err in ((None, TypeError), (np.int64, TypeError), (np.float16, ValueError),
                     (b"float32", TypeError)):
        with raises(err, "dtype", "got"):
            make(xp, dtype=bad)
    # a dtype that is no float is told with the two the GPT takes, not the blocks' three
    for bad, err in (("int64", ValueError), (np.int64, TypeError), (None, TypeError)):
        with pytest.raises(err, match=r"^dtype: expected one of \['float32', 'float64'\]"):
            make(xp, dtype=bad)
    for given in (np.float64, np.dtype("float64"), xp.float64):
        model = make(xp, dtype=given)
        assert model.dtype == xp.float64 and model.params["wte"].dtype == xp.float64
        assert model.forward(to_xp(ids_of(1))).dtype == xp.float64
    with pytest.raises(TypeError, match="^seed: expected None, a non-negative int seed or a SeedSequence, "
                                        "got float 1.5$"):
        GPT(VOCAB, T, D, N, H, seed=1.5)
    with pytest.raises(ValueError, match="^seed: expected a non-negative int seed, got -1$"):
        GPT(VOCAB, T, D, N, H, seed=-1)
    for flag in (True, np.bool_(False)):  # a bool is no seed, though Python counts it an int
        with pytest.raises(TypeError, match=r"^seed: expected None, a non-negative int seed or a "
                                            r"SeedSequence, got .*bool"):
            GPT(VOCAB, T, D, N, H, seed=flag)
    with pytest.raises(TypeError, match="^vocab_size: expected an int >= 1, got float 2.0$"):
        GPT(2.0, T, D, N, H)
    model = make(xp)
    with pytest.raises(ValueError, match=r"^ids: expected shape \(B, L\) with B >= 1 and L >= 1, "
                                         r"got \(0, 3\)$"):
        model.forward(to_xp(np.zeros((0, 3), dtype=np.int64)))
    with pytest.raises(TypeError, match="^seed: expected None, .* or a numpy.random.Generator, got str 'x'$"):
        model.generate(to_xp(ids_of(0, (B, 2))), 2, seed="x")
    with pytest.raises(TypeError, match=r"^seed: expected None, a non-negative int seed, a SeedSequence, "
                                        r"a BitGenerator or a numpy.random.Generator, got bool"):
        model.generate(to_xp(ids_of(0, (B, 2))), 2, seed=True)
    # a prompt of the whole context still gets one token: the last one chosen is never fed back
    out, logits = model.eval().generate(to_xp(ids_of(2, (B, T))), 1, greedy=True, return_logits=True)
    assert tuple(out.shape) == (B, T + 1)
    np.testing.assert_allclose(to_numpy(logits)[:, 0], to_numpy(model.forward(to_xp(ids_of(2, (B, T)))))[:, -1],
                               rtol=0, atol=1e-10)
    with pytest.raises(ValueError, match=r"^max_new_tokens: expected at most block_size - L0 \+ 1 = 1, "
                                         r"got 2$"):
        model.generate(to_xp(ids_of(2, (B, T))), 2)
    # a NumPy int is counted as an int: np.uint8(255) wrapped in L0 + 255, passed the check, and
    # failed later naming capacity (an argument generate has not), after the cached forward was dropped
    logits = model.forward(to_xp(ids_of(0)))
    for n in (np.uint8(255), np.int64(2**63 - 1)):
        with pytest.raises(ValueError, match=rf"^max_new_tokens: expected at most .* got {int(n)}$"):
            model.generate(to_xp(ids_of(0, (B, 2))), n)
    model.backward(logits * 0.0)  # the forward before the failed calls is still the one cached
    assert tuple(model.generate(to_xp(ids_of(0, (B, 2))), np.uint8(3), greedy=True).shape) == (B, 5)


@pytest.mark.parametrize("where", ["block 1", "final norm"])
def test_a_training_forward_that_fails_after_the_checks_changes_nothing(monkeypatch, where):
    """A failure past the checks (a MemoryError) in block 1, or in the final layer norm after
    every block ran: the blocks are put back, so backward differentiates the previous forward,
    and the next dropout forward draws what it would have drawn."""
    import npattn.layers as Ly

    model, twin = make(dropout=0.3), make(dropout=0.3)
    ids = ids_of(0)
    model.forward(ids)
    twin.forward(ids)
    dlogits = np.random.default_rng(7).standard_normal((B, L, VOCAB))
    real, calls = Ly.layer_norm_forward, []

    def fails_last(*args, **kwargs):  # norm1 and norm2 of each block, then the final one
        calls.append(1)
        if len(calls) == 2 * N + 1:
            raise MemoryError("no memory")
        return real(*args, **kwargs)

    def fails(*args, **kwargs):
        raise MemoryError("no memory")

    if where == "block 1":
        monkeypatch.setattr(model.blocks[1], "forward", fails)
    else:
        monkeypatch.setattr(Ly, "layer_norm_forward", fails_last)
    with pytest.raises(MemoryError):
        model.forward(ids_of(1, (B, 4)))
    monkeypatch.undo()
    assert where == "block 1" or len(calls) == 2 * N + 1  # it failed where it was meant to
    grads, ref = model.backward(dlogits), twin.backward(dlogits)
    for k in ref:
        np.testing.assert_array_equal(grads[k], ref[k], err_msg=k)
    np.testing.assert_array_equal(model.forward(ids), twin.forward(ids))  # the same masks drawn


@pytest.mark.parametrize("where", ["block 0", "positions"])
def test_a_backward_that_fails_in_block_0_keeps_every_blocks_grads(monkeypatch, where):
    """Block 1's backward runs, block 0's fails (a MemoryError), or every block's ran and the
    positions' backward after them fails: the model's grads, every block's grads and its
    attention module's grads are those of the last successful backward, and the next
    backward gives what a model that never failed gives."""
    model, twin = make(dropout=0.3), make(dropout=0.3)
    dlogits = np.random.default_rng(8).standard_normal((B, L, VOCAB))
    for m in (model, twin):
        m.forward(ids_of(0))
        m.backward(dlogits)
        m.forward(ids_of(1))
    model_grads = model.grads
    held = [(b.grads, b.self_attn.grads, b.self_attn.dmask) for b in model.blocks]

    def fails(dout):
        raise MemoryError("no memory")

    if where == "block 0":
        monkeypatch.setattr(model.blocks[0], "backward", fails)
    else:
        monkeypatch.setattr(nn, "add_positions_backward", lambda dx, cache: fails(dx))
    with pytest.raises(MemoryError):
        model.backward(dlogits)
    monkeypatch.undo()
    assert model.grads is model_grads
    for n, (block, (grads, attn_grads, dmask)) in enumerate(zip(model.blocks, held)):
        assert block.grads is grads and block.self_attn.grads is attn_grads, f"block {n}"
        assert block.self_attn.dmask is dmask, f"block {n}"
    grads, ref = model.backward(dlogits), twin.backward(dlogits)
    for k in ref:
        np.testing.assert_array_equal(grads[k], ref[k], err_msg=k)


@pytest.mark.parametrize("where", ["backward", "adam"])
def test_a_training_step_that_fails_after_its_forward_changes_nothing(monkeypatch, where):
    """A training step whose backward (block 0's, after block 1's ran) or Adam step fails (a
    MemoryError) puts the model back: its cache, grads and every generator as before the call,
    so that the step run again draws the same dropout masks and gives what a model that never
    failed gives."""
    import npattn.gpt as gpt_module

    model, twin = make(dropout=0.3), make(dropout=0.3)
    ids, tgt = ids_of(0), ids_of(1)
    state = nn.adam_init(model.params)
    for m in (model, twin):  # a step done: a cache and grads to keep
        _, _, state_after = training_step(m, state, ids, tgt, lr=0.05)
    cache, grads = model._cache, model.grads
    held = [(b.grads, b.self_attn.grads, b.self_attn.cache, b._cache) for b in model.blocks]

    def fails(*args, **kwargs):
        raise MemoryError("no memory")

    if where == "backward":
        monkeypatch.setattr(model.blocks[0], "backward", fails)
    else:
        monkeypatch.setattr(gpt_module.nn, "adam_step", fails)
    with pytest.raises(MemoryError):
        training_step(model, state_after, ids, tgt, lr=0.05)
    monkeypatch.undo()
    assert model._cache is cache and model.grads is grads
    for n, (block, (g, attn_g, attn_cache, block_cache)) in enumerate(zip(model.blocks, held)):
        assert block.grads is g and block.self_attn.grads is attn_g, f"block {n}"
        assert block.self_attn.cache is attn_cache and block._cache is block_cache, f"block {n}"
    loss, norm, _ = training_step(model, state_after, ids, tgt, lr=0.05)
    ref_loss, ref_norm, _ = training_step(twin, state_after, ids, tgt, lr=0.05)
    assert (loss, norm) == (ref_loss, ref_norm)
    for k, v in twin.params.items():
        np.testing.assert_array_equal(model.params[k], v, err_msg=k)


@pytest.mark.parametrize("where", ["cross_entropy_forward", "cross_entropy_backward"])
def test_a_loss_that_fails_after_its_forward_changes_nothing(monkeypatch, where):
    """GPT.loss whose cross-entropy fails after the forward ran (a MemoryError) puts the model
    back: backward differentiates the forward before the call, and the next dropout forward
    draws what a model that never failed draws (the failed loss kept its own forward cached
    and had advanced the generators)."""
    model, twin = make(dropout=0.3), make(dropout=0.3)
    ids, tgt = ids_of(0), ids_of(1)
    for m in (model, twin):
        m.forward(ids)

    def fails(*args, **kwargs):
        raise MemoryError("no memory")

    monkeypatch.setattr(nn, where, fails)
    with pytest.raises(MemoryError):
        model.loss(ids_of(2, (B, 4)), ids_of(3, (B, 4)))
    monkeypatch.undo()
    dlogits = np.random.default_rng(9).standard_normal((B, L, VOCAB))
    grads, ref = model.backward(dlogits), twin.backward(dlogits)
    for k in ref:
        np.testing.assert_array_equal(grads[k], ref[k], err_msg=k)
    loss, dl = model.loss(ids, tgt)
    ref_loss, ref_dl = twin.loss(ids, tgt)  # the same masks drawn
    assert loss == ref_loss
    np.testing.assert_array_equal(dl, ref_dl)


def test_a_decoding_loss_that_fails_after_its_forward_puts_the_caches_back(monkeypatch):
    """GPT.loss with kv_caches whose cross-entropy fails (a MemoryError) after every block
    appended: the caches keep their lengths, and decoding on gives what a model that never
    failed gives."""
    model, twin = make().eval(), make().eval()
    caches, twin_caches = model.new_caches(B), twin.new_caches(B)
    ids = ids_of(0, (B, 3))
    model.forward(ids[:, :2], kv_caches=caches)
    twin.forward(ids[:, :2], kv_caches=twin_caches)

    def fails(*args, **kwargs):
        raise MemoryError("no memory")

    monkeypatch.setattr(nn, "cross_entropy_forward", fails)
    with pytest.raises(MemoryError):
        model.loss(ids[:, 2:], ids[:, 2:], kv_caches=caches)
    monkeypatch.undo()
    assert [list(c.cache_seqlens) for c in caches] == [[2, 2]] * N
    np.testing.assert_array_equal(model.forward(ids[:, 2:], kv_caches=caches),
                                  twin.forward(ids[:, 2:], kv_caches=twin_caches))


def test_a_decoding_forward_that_fails_midway_puts_the_caches_back(monkeypatch):
    """A failure past the checks in the last block's feed-forward (a MemoryError), after the
    first block and the last one's self-attention appended: every cache keeps its length,
    and decoding on gives the same logits as a model that never failed."""
    import npattn.layers as Ly

    model, twin = make().eval(), make().eval()
    caches, twin_caches = model.new_caches(B), twin.new_caches(B)
    ids = ids_of(0, (B, 3))
    model.forward(ids[:, :2], kv_caches=caches)
    twin.forward(ids[:, :2], kv_caches=twin_caches)
    real, calls = Ly.feed_forward_forward, []

    def fails_second(*args, **kwargs):
        calls.append(1)
        if len(calls) == N:
            raise MemoryError("no memory")
        return real(*args, **kwargs)

    monkeypatch.setattr(Ly, "feed_forward_forward", fails_second)
    with pytest.raises(MemoryError):
        model.forward(ids[:, 2:], kv_caches=caches)
    monkeypatch.setattr(Ly, "feed_forward_forward", real)
    assert [list(c.cache_seqlens) for c in caches] == [[2, 2]] * N
    np.testing.assert_array_equal(model.forward(ids[:, 2:], kv_caches=caches),
                                  twin.forward(ids[:, 2:], kv_caches=twin_caches))


@pytest.mark.parametrize("decoding", [False, True])
@pytest.mark.parametrize("impl, match", [
    ("chunked", r"impl='chunked': the chunked implementation takes dask arrays .* got numpy\.ndarray of "
                r"shapes \(2, 2, 3, 4\), \(2, 2, 3, 4\), \(2, 2, 3, 4\);"),
    ("fast", "impl: expected 'auto'")])
def test_a_block_impl_that_cannot_run_is_refused_before_the_embedding(monkeypatch, decoding, impl,
                                                                      match):
    """A block's self_attn.impl that cannot run the call (an unknown name, "chunked" on NumPy
    arrays) was refused inside that block, after the embedding and the blocks before it had
    run; now before anything is computed, and the KV caches keep their lengths. The refusal
    names the heads the block would get: q, k and v (B, H, 3, Dh), as the prompt's three
    tokens are all the keys there are."""
    model = make().eval()
    caches = model.new_caches(B) if decoding else None
    ids = ids_of(0, (B, 3))
    model.blocks[1].self_attn.impl = impl
    calls = []
    real = nn.embedding_forward
    monkeypatch.setattr(nn, "embedding_forward", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    with pytest.raises(ValueError, match=match):
        model.forward(ids, kv_caches=caches)
    assert calls == []
    assert caches is None or [list(c.cache_seqlens) for c in caches] == [[0, 0]] * N


def _count_reads_of_w_q(model) -> list:
    """Make block 0's w_q of a dask GPT (one chunk) a task that records each run in the list
    returned: one entry per pass over the graph that needs it (sync scheduler)."""
    calls = []

    def counted(block):
        calls.append(block.shape)
        return block

    params = dict(model.params)
    w = params["blocks.0.self_attn.w_q"]
    params["blocks.0.self_attn.w_q"] = w.map_blocks(counted, meta=np.asarray(w)[:0])
    model.params = params
    return calls


def test_generate_on_dask_starts_each_step_from_computed_caches(monkeypatch):
    """GPT.generate on dask persists its KV caches after each step: the graph an append
    extends stays one size, where it grew by every earlier token before (40 tokens of a
    2-block model took 36 s against 3.3 s for 10). The tokens are those of NumPy."""
    pytest.importorskip("dask.array", reason="needs dask: pip install '.[dask]'")
    sizes = []
    append = KVCache.append

    def counting_append(self, k_new, v_new):
        sizes.append(len(self.k.__dask_graph__()))
        append(self, k_new, v_new)

    monkeypatch.setattr(KVCache, "append", counting_append)
    lazy = GPT(11, 16, 8, 2, 2, seed=4, dtype="float64", backend="dask")
    prompt = np.array([[1, 2, 3], [4, 5, 6]])
    out = lazy.generate(lazy.xp.asarray(prompt), 7, greedy=True)
    monkeypatch.setattr(KVCache, "append", append)
    host = GPT(11, 16, 8, 2, 2, seed=4, dtype="float64").generate(prompt, 7, greedy=True)
    np.testing.assert_array_equal(to_numpy(out), host)
    later = sizes[2:]  # one append per block and step; the prompt's first ones write zeros
    assert len(later) == 12 and len(set(later)) == 1, sizes


def test_generate_on_dask_computes_each_step_once():
    """Each step of generate on dask persisted the caches one by one and then read the
    logits: block 1's keys and the logits each ran block 0's attention again, so its query
    projection (w_q, one chunk) ran twice a step (a 2-block model of width 128, 16 tokens:
    3.5 s, 3.2 s computed together). Now once a step, with NumPy's tokens and logits."""
    da = pytest.importorskip("dask.array", reason="needs dask: pip install '.[dask]'")
    import dask

    prompt = np.array([[1, 2, 3], [4, 5, 6]])
    host = GPT(11, 16, 8, 2, 2, seed=4, dtype="float64")
    want, want_logits = host.generate(prompt, 5, greedy=True, return_logits=True)
    lazy = GPT(11, 16, 8, 2, 2, seed=4, dtype="float64", backend="dask")
    calls = _count_reads_of_w_q(lazy)
    with dask.config.set(scheduler="sync"):  # the calls are counted in this process
        out, logits = lazy.generate(da.from_array(prompt), 5, greedy=True, return_logits=True)
        assert len(calls) == 5, calls
        np.testing.assert_array_equal(to_numpy(out), want)
        np.testing.assert_allclose(to_numpy(logits), want_logits, rtol=1e-10, atol=1e-12)
        assert len(calls) == 5, calls  # the logits returned are the computed ones


@pytest.mark.parametrize("max_grad_norm", [None, 0.05])
def test_training_step_on_dask_computes_the_backward_once(max_grad_norm):
    """training_step on dask reads the loss and the gradients' norm, one sum per parameter:
    with the gradients left lazy each sum ran the forward and backward again (36 passes for
    this 2-block model), and Adam's update once more (the GPT demo on dask: 1.6 s a step, 0.8 s
    computed once); the loss read on its own ran the forward once more. A parameter's chunk is
    read by two passes: the one that computes the loss and the gradients, and Adam's update of
    it; the step is NumPy's, and model.grads are the computed gradients."""
    da = pytest.importorskip("dask.array", reason="needs dask: pip install '.[dask]'")
    import dask

    rng = np.random.default_rng(3)
    ids, targets = rng.integers(0, 11, (2, 8)), rng.integers(0, 11, (2, 8))
    host = GPT(11, 8, 8, 2, 2, seed=4, dtype="float64")
    want = training_step(host, nn.adam_init(host.params), ids, targets, lr=1e-2, max_grad_norm=max_grad_norm)
    lazy = GPT(11, 8, 8, 2, 2, seed=4, dtype="float64", backend="dask")
    calls = _count_reads_of_w_q(lazy)
    with dask.config.set(scheduler="sync"):  # the calls are counted in this process
        got = training_step(lazy, nn.adam_init(lazy.params), da.from_array(ids, chunks=(1, 8)),
                            da.from_array(targets, chunks=(1, 8)), lr=1e-2, max_grad_norm=max_grad_norm)
        assert len(calls) == 2, calls
        np.testing.assert_allclose(got[0], want[0], rtol=1e-12)  # the loss
        np.testing.assert_allclose(got[1], want[1], rtol=1e-12)  # the norm
        for name, a in host.params.items():  # (b_k's gradient is 0 but for rounding, which Adam
            atol = 1e-9 if name.endswith("b_k") else 1e-12  # scales by lr / eps: 1e-17 -> 1e-11)
            np.testing.assert_allclose(to_numpy(lazy.params[name]), a, rtol=1e-10, atol=atol, err_msg=name)
        for name, g in host.grads.items():
            np.testing.assert_allclose(to_numpy(lazy.grads[name]), g, rtol=1e-10, atol=1e-14, err_msg=name)
        assert len(calls) == 2, calls  # the new parameters and the gradients were computed in the step


def _fail_the_second_sample(monkeypatch) -> list:
    """Make generate's second sampling step raise a MemoryError; the list counts the steps."""
    import npattn.gpt as gpt_module

    real, calls = gpt_module.sample_next, []

    def fails_second(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise MemoryError("no memory")
        return real(*args, **kwargs)

    monkeypatch.setattr(gpt_module, "sample_next", fails_second)
    return calls


def test_a_generate_that_fails_midway_restores_the_mode(monkeypatch):
    """Generation runs in eval mode and puts the mode back (the docstring); a failure at the
    second step (a MemoryError) puts it back too and leaves no decoding forward cached (a
    model with no forward before: backward asks for one, not about kv_caches)."""
    model = make(dropout=0.3)
    assert model.training
    calls = _fail_the_second_sample(monkeypatch)
    with pytest.raises(MemoryError):
        model.generate(ids_of(0, (B, 2)), 3, seed=0)
    assert len(calls) == 2
    assert model.training and all(b.training for b in model.blocks)
    with pytest.raises(RuntimeError, match=NO_FORWARD):
        model.backward(np.zeros((B, 2, VOCAB)))


@pytest.mark.parametrize("fails", [False, True])
def test_generate_puts_back_a_block_set_apart_in_another_mode(monkeypatch, fails):
    """A model in training mode with block 0 (and so its attention) set to eval, and block
    1's attention module alone set to eval: generate, finished or failed at its second step,
    leaves each of them in its own mode. It used to put every block in the model's mode."""
    model = make(dropout=0.3)
    model.blocks[0].eval()
    model.blocks[1].self_attn.eval()
    if fails:
        _fail_the_second_sample(monkeypatch)
        with pytest.raises(MemoryError):
            model.generate(ids_of(0, (B, 2)), 3, seed=0)
    else:
        model.generate(ids_of(0, (B, 2)), 3, seed=0)
    assert model.training
    assert (model.blocks[0].training, model.blocks[0].self_attn.training) == (False, False)
    assert (model.blocks[1].training, model.blocks[1].self_attn.training) == (True, False)


def test_a_generate_that_fails_midway_changes_nothing(monkeypatch):
    """A generate that fails at its second step (a MemoryError) puts back the forward cached
    before it (the model's and its blocks': backward then gives the gradients of a twin
    model that never generated) and the state of the Generator passed as ``seed`` (the next
    generate draws what a fresh Generator of that seed draws)."""
    model, twin = make(dropout=0.3), make(dropout=0.3)
    x = ids_of(5)
    dlogits = np.random.default_rng(6).standard_normal((B, L, VOCAB))
    model.forward(x)
    twin.forward(x)
    calls = _fail_the_second_sample(monkeypatch)
    rng = np.random.default_rng(8)
    with pytest.raises(MemoryError):
        model.generate(ids_of(0, (B, 2)), 3, seed=rng)
    assert len(calls) == 2
    got, want = model.backward(dlogits), twin.backward(dlogits)
    for name in want:
        np.testing.assert_array_equal(to_numpy(got[name]), to_numpy(want[name]), err_msg=name)
    monkeypatch.undo()
    again = model.generate(ids_of(0, (B, 2)), 3, seed=rng)
    fresh = model.generate(ids_of(0, (B, 2)), 3, seed=np.random.default_rng(8))
    np.testing.assert_array_equal(to_numpy(again), to_numpy(fresh))


@pytest.mark.parametrize("where", ["from_numpy", "stack"])
def test_a_generate_that_fails_making_its_results_changes_nothing(monkeypatch, where):
    """Every token drawn, generate makes its results (the ids as a backend array, the logits
    stacked); should that fail (a MemoryError), the model keeps the forward cached before it
    (backward gives the gradients of a twin that never generated) and the Generator passed
    as ``seed`` its state. They were made after both had been given up."""
    import npattn.gpt as gpt_module

    model, twin = make(dropout=0.3), make(dropout=0.3)
    x = ids_of(5)
    dlogits = np.random.default_rng(6).standard_normal((B, L, VOCAB))
    model.forward(x)
    twin.forward(x)
    rng = np.random.default_rng(8)
    drawn = copy.deepcopy(rng.bit_generator.state)

    real, failed = gpt_module.from_numpy, []

    def fails(*args, **kwargs):
        failed.append(1)
        raise MemoryError("no memory")

    def fails_on_the_ids(a, *args, **kwargs):  # the prompt and the 3 tokens: (B, 2 + 3)
        return fails() if a.shape == (B, 5) else real(a, *args, **kwargs)

    with monkeypatch.context() as patch:
        if where == "stack":
            patch.setattr(model.xp, "stack", fails)
        else:
            patch.setattr(gpt_module, "from_numpy", fails_on_the_ids)
        with pytest.raises(MemoryError):
            model.generate(ids_of(0, (B, 2)), 3, seed=rng, return_logits=True)
    assert failed == [1]
    assert rng.bit_generator.state == drawn
    got, want = model.backward(dlogits), twin.backward(dlogits)
    for name in want:
        np.testing.assert_array_equal(to_numpy(got[name]), to_numpy(want[name]), err_msg=name)


def test_a_generate_that_fails_switching_to_eval_puts_the_modes_back(monkeypatch):
    """generate switches the model to eval mode block by block; should block 1's switch fail
    (an interrupt, after the model's and block 0's were made), the model and every block are
    left in training mode, as before the call."""
    model = make(dropout=0.3)
    real, calls = model.blocks[1].train, []

    def fails_first(*args, **kwargs):
        calls.append(1)
        if len(calls) == 1:
            raise KeyboardInterrupt
        return real(*args, **kwargs)

    monkeypatch.setattr(model.blocks[1], "train", fails_first)
    with pytest.raises(KeyboardInterrupt):
        model.generate(ids_of(0, (B, 2)), 3, seed=0)
    assert model.training
    for n, block in enumerate(model.blocks):
        assert block.training and block.self_attn.training, f"block {n}"


def test_a_training_step_whose_assignment_fails_changes_nothing(monkeypatch):
    """training_step assigns the updated parameters last; should block 1's assignment fail
    (an interrupt, say, after block 0's was made), every parameter is the one before the
    call, and so are the model's cache and grads: the step run again gives what a twin that
    never failed gives."""
    import npattn.transformer as transformer_module

    model, twin = make(dropout=0.3), make(dropout=0.3)
    ids, tgt = ids_of(0), ids_of(1)
    state = nn.adam_init(model.params)
    for m in (model, twin):  # a step done: a cache and grads to keep
        _, _, state_after = training_step(m, state, ids, tgt, lr=0.05)
    params = {k: np.array(v, copy=True) for k, v in model.params.items()}
    cache, grads = model._cache, model.grads
    real, calls = transformer_module.check_params_assignment, []

    def fails_second(*args, **kwargs):  # block 0's assignment, then block 1's
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return real(*args, **kwargs)

    with monkeypatch.context() as patch:
        patch.setattr(transformer_module, "check_params_assignment", fails_second)
        with pytest.raises(KeyboardInterrupt):
            training_step(model, state_after, ids, tgt, lr=0.05)
    assert len(calls) >= 2  # it failed where it was meant to (putting block 0 back calls it again)
    for k, v in model.params.items():
        np.testing.assert_array_equal(v, params[k], err_msg=k)
    assert model._cache is cache and model.grads is grads
    loss, norm, _ = training_step(model, state_after, ids, tgt, lr=0.05)
    assert (loss, norm) == training_step(twin, state_after, ids, tgt, lr=0.05)[:2]
    for k, v in twin.params.items():
        np.testing.assert_array_equal(model.params[k], v, err_msg=k)


@pytest.mark.parametrize("step", [1, 3])
def test_generate_names_the_step_whose_logits_are_nan(step):
    """A NaN in the position embedding of the position step ``step`` reads (the first step
    reads the prompt's positions 0 .. L0 - 1, step s > 1 position L0 + s - 2) makes that
    step's logits NaN: the error says so in generate's terms, not as a bad ``logits``
    argument (which the caller never passed), and the sampling generator is put back."""
    model = make()
    L0, n = 2, 4
    model.params["wpe"][L0 - 1 if step == 1 else L0 + step - 2, 0] = np.nan
    rng = np.random.default_rng(4)
    drawn = rng.bit_generator.state
    with pytest.raises(ValueError) as exc:
        model.generate(ids_of(0, (B, L0)), n, seed=rng)
    assert str(exc.value) == (f"generate: the model produced logits with NaN at step {step} of {n} "
                              f"(in {B} of {B} rows), so no token can be drawn: its parameters or "
                              "the activations they give are not finite")
    assert rng.bit_generator.state == drawn


def test_a_chunked_block_decodes_past_the_prompt_as_the_numpy_model():
    """On dask, impl='chunked' runs the bottom-right aligned causal attention that a decoding
    forward past the prompt asks of every block (it was refused before the chunked path took
    the kernel options): the logits of the prompt and of the next token equal the NumPy
    model's (float64), and the KV caches grow by the token."""
    pytest.importorskip("dask.array", reason="needs dask: pip install '.[dask]'")
    ref = make().eval()
    model = make(backend="dask").eval()
    for block in model.blocks:
        block.self_attn.impl = "chunked"
    caches, ref_caches = model.new_caches(B), ref.new_caches(B)
    for seed, n in ((0, 3), (1, 1)):  # the prompt, then one token past it
        ids = ids_of(seed, (B, n))
        got = model.forward(model.xp.asarray(ids), kv_caches=caches)
        want = ref.forward(ids, kv_caches=ref_caches)
        np.testing.assert_allclose(np.asarray(got.compute()), want, rtol=1e-12, atol=1e-12)
    assert [list(c.cache_seqlens) for c in caches] == [[4, 4]] * N


# ------------------------------------------------------- sizes, options and limits


def test_constructor_refuses_empty_sizes_and_a_generator_as_seed():
    """vocab_size, block_size and n_layer are at least 1; the constructor's seed is an int or a
    SeedSequence (a Generator is generate's alone)."""
    for pos, name in ((0, "vocab_size"), (1, "block_size"), (3, "n_layer")):
        sizes = [VOCAB, T, D, N, H]
        sizes[pos] = 0
        with raises(ValueError, name, "got 0"):
            GPT(*sizes)
    with raises(TypeError, "seed", "SeedSequence", "Generator"):
        GPT(VOCAB, T, D, N, H, seed=np.random.default_rng(0))


def test_repr_names_the_configuration():
    text = repr(make(dropout=0.25))
    for part in (f"vocab_size={VOCAB}", f"block_size={T}", f"d_model={D}", f"n_layer={N}", f"n_head={H}",
                 f"d_ff={FF}", "dropout=0.25", "dtype='float64'", "backend='numpy'"):
        assert part in text, (part, text)


def test_ids_without_positions_and_overlong_requests_name_the_limit_that_applies():
    model = make().eval()
    with raises(ValueError, "ids", "L >= 1", "(2, 0)"):
        model.forward(np.zeros((B, 0), dtype=np.int64))
    caches = model.new_caches(B)
    model.forward(ids_of(0, (B, 4)), kv_caches=caches)
    # 4 cached: 5 positions are left of block_size 9
    with raises(ValueError, "ids", "at most 5 positions", "4 already cached", "got 6"):
        model.forward(ids_of(1, (B, 6)), kv_caches=caches)
    # a prompt of 3: the last token chosen is not fed back, so 9 - 3 + 1 = 7 new tokens fit
    with raises(ValueError, "max_new_tokens", "= 7", "got 8"):
        model.generate(ids_of(0, (B, 3)), 8)
    assert tuple(model.generate(ids_of(0, (B, 3)), 7, greedy=True).shape) == (B, 10)
    with raises(TypeError, "return_logits"):
        model.generate(ids_of(0, (B, 3)), 1, return_logits="yes")


def test_a_training_forward_without_dropout_draws_no_masks(monkeypatch):
    """Masks are drawn in training mode with dropout > 0 only: at dropout 0 no keep-mask is drawn
    (they would all keep, but the draws would cost time and move the model's generator)."""
    import npattn.gpt

    def drawn(*args, **kwargs):
        raise AssertionError("a keep-mask was drawn")

    model = make(dropout=0.0)
    ids = ids_of(0)
    expected = model.forward(ids)
    monkeypatch.setattr(npattn.gpt, "keep_mask", drawn)
    np.testing.assert_array_equal(model.forward(ids), expected)
    with pytest.raises(AssertionError, match="drawn"):  # the replacement is the one the model calls
        make(dropout=0.1).forward(ids)


# ------------------------------------------------------------------- KV caches


def test_kv_caches_must_be_a_list_with_one_length_for_every_block():
    model = make().eval()
    with raises(TypeError, "kv_caches", "list"):
        model.forward(ids_of(0, (B, 2)), kv_caches=iter(model.new_caches(B)))
    caches = model.new_caches(B)
    model.forward(ids_of(0, (B, 3)), kv_caches=caches)
    caches[1].truncate([2, 2])  # each cache even, but block 1 one position behind block 0
    with raises(ValueError, "kv_caches", "same cached length"):
        model.forward(ids_of(1, (B, 1)), kv_caches=caches)
    assert [list(c.cache_seqlens) for c in caches] == [[3, 3], [2, 2]]


def test_kv_caches_of_another_batch_size_are_named_by_their_block_and_batch_size():
    """Empty caches, one of them for another batch size: every length is 0, so the error is
    that cache's batch size, named by its place in the list, and nothing is written."""
    model = make().eval()
    caches = model.new_caches(B)
    caches[1] = model.new_caches(B + 1)[1]
    with pytest.raises(ValueError, match=rf"^kv_caches\[1\]: expected batch_size={B}, .*got KVCache\("
                                         rf"batch_size={B + 1}, "):
        model.forward(ids_of(0, (B, 2)), kv_caches=caches)
    assert [list(c.cache_seqlens) for c in caches] == [[0] * B, [0] * (B + 1)]


def test_new_caches_hold_block_size_tokens_unless_asked_for_fewer():
    model = make()
    assert [c.capacity for c in model.new_caches(B)] == [T] * N
    assert [c.capacity for c in model.new_caches(B, 4)] == [4] * N
    with raises(ValueError, "capacity", f"at most block_size = {T}", f"got {T + 1}"):
        model.new_caches(B, T + 1)


def test_block_n_appends_its_keys_and_values_to_kv_caches_n():
    """Entry n of kv_caches is block n's: block 0's keys are those it makes of the embeddings
    (run here on its own), and block 1's are not."""
    model = perturbed(make(), np.asarray).eval()
    ids = ids_of(4, (B, 3))
    caches = model.new_caches(B)
    model.forward(ids, kv_caches=caches)
    x0 = np.asarray(model.params["wte"])[ids] + np.asarray(model.params["wpe"])[:3]  # [B, 3, D]
    own = KVCache(B, T, H, D // H, dtype="float64")
    model.blocks[0].forward(x0, is_causal=True, kv_cache=own)
    for name in ("k", "v"):
        np.testing.assert_allclose(np.asarray(getattr(caches[0], name))[:, :, :3],
                                   np.asarray(getattr(own, name))[:, :, :3], rtol=0, atol=1e-12)
        assert not np.allclose(np.asarray(getattr(caches[1], name))[:, :, :3],
                               np.asarray(getattr(own, name))[:, :, :3])


# ---------------------------------------------------- backward, loss, training_step


def test_backward_refuses_a_non_array_and_logits_of_another_vocabulary():
    model = make()
    model.forward(ids_of(0))
    dout = np.random.default_rng(0).standard_normal((B, L, VOCAB))
    with raises(TypeError, "dlogits"):
        model.backward(dout.tolist())
    with raises(ValueError, "dlogits", f"{(B, L, VOCAB)}", f"{(B, L, VOCAB - 1)}"):
        model.backward(dout[..., :-1])
    model.backward(dout)  # the forward is still the one cached


def test_grads_list_the_parameters_in_the_order_of_params():
    model = make()
    model.forward(ids_of(0))
    grads = model.backward(np.random.default_rng(1).standard_normal((B, L, VOCAB)))
    assert list(grads) == list(model.params)
    assert list(model.grads) == list(model.params)


def _forward_refused(*args, **kwargs):
    raise AssertionError("the forward ran before the arguments were checked")


@pytest.mark.parametrize("case", ["ids", "targets shape", "label_smoothing", "every target ignored",
                                  "weight_decay", "model"])
def test_loss_and_training_step_check_their_arguments_before_the_forward(monkeypatch, case):
    """A bad argument is refused, naming it, before the forward runs (the forward is replaced by one
    that fails the test)."""
    model = make()
    monkeypatch.setattr(model, "forward", _forward_refused)
    ids, tgt = ids_of(0), ids_of(1)
    state = nn.adam_init(model.params)
    calls = {
        "ids": (lambda: model.loss(ids + VOCAB, tgt), ValueError, "ids"),
        "targets shape": (lambda: model.loss(ids, ids_of(1, (B, L - 1))), ValueError, "targets"),
        "label_smoothing": (lambda: model.loss(ids, tgt, label_smoothing=1.5), ValueError, "label_smoothing"),
        "every target ignored": (lambda: model.loss(ids, np.zeros_like(tgt), ignore_index=0), ValueError,
                                 "targets"),
        "weight_decay": (lambda: training_step(model, state, ids, tgt, lr=0.1, weight_decay=-1.0), ValueError,
                         "weight_decay"),
        "model": (lambda: training_step(object(), state, ids, tgt, lr=0.1), TypeError, "model"),
    }
    call, error, name = calls[case]
    with raises(error, name):
        call()


# ------------------------------------------------------------------------ generate


def test_generate_of_no_new_tokens_drops_the_cached_forward_and_keeps_the_types():
    """Even with nothing sampled, generate drops the cached forward (backward needs a new one); the
    ids come back as int64 from an int32 prompt and the empty logits have the model's dtype."""
    model = make(dtype="float32")
    model.forward(ids_of(0))
    out, logits = model.generate(ids_of(1, (B, 3)).astype(np.int32), 0, return_logits=True)
    assert out.dtype == np.int64 and logits.dtype == np.float32
    # and the logits of sampled tokens: those of the forward, in the model's dtype
    out, logits = model.generate(ids_of(1, (B, 3)), 2, greedy=True, return_logits=True)
    assert logits.shape == (B, 2, VOCAB) and logits.dtype == np.float32
    with pytest.raises(RuntimeError, match=NO_FORWARD):
        model.backward(np.zeros((B, L, VOCAB), dtype=np.float32))


# ---------------------------------------------------------------------- sample_next


class _Fixed(np.random.Generator):
    """A Generator whose uniform numbers are all ``u``."""

    def __init__(self, u):
        super().__init__(np.random.PCG64(0))
        self.u = u

    def random(self, size=None, dtype=np.float64, out=None):
        return np.full(size, self.u)


def test_sample_next_never_draws_a_token_of_probability_zero_and_checks_empty_logits():
    """u = 0 takes the first token of positive probability, u just below 1 the last: tokens at -inf
    (or left out by top_k) at either end are never drawn."""
    logits = np.array([[-np.inf, 0.5, 1.0, -np.inf], [2.0, -1.0, 3.0, 0.0]])
    first = sample_next(logits, _Fixed(0.0))
    last = sample_next(logits, _Fixed(np.nextafter(1.0, 0.0)))
    np.testing.assert_array_equal(first, [1, 0])
    np.testing.assert_array_equal(last, [2, 3])
    np.testing.assert_array_equal(sample_next(logits, _Fixed(0.0), top_k=2), [1, 0])
    np.testing.assert_array_equal(sample_next(logits, _Fixed(np.nextafter(1.0, 0.0)), top_k=2), [2, 2])
    for shape in ((0, 4), (2, 0)):
        with raises(ValueError, "logits", "B, V >= 1", f"{shape}"):
            sample_next(np.zeros(shape), np.random.default_rng(0))


# ------------------------------------------------------------- without biases, in torch


def test_a_model_without_biases_has_no_bias_parameters_and_its_gradients_check(xp, to_xp):
    model = perturbed(make(xp, bias=False), to_xp)
    assert "ln_f.bias" not in model.params
    assert not [k for k in model.params if k.endswith("bias") or ".b_" in k]
    grads = _check_model_vjp(model, to_xp, to_xp(ids_of(5)), seed=6)
    assert list(grads) == list(model.params)


def test_to_torch_keeps_the_modes_of_blocks_set_apart():
    """A block in eval mode inside a training model, and an attention module set apart inside
    a training block, are so in the torch copy too: its layers and their dropout modules take the
    block's mode, their ``self_attn`` the attention module's."""
    pytest.importorskip("torch")
    model = GPT(VOCAB, T, D, 3, H, FF, dtype="float64", dropout=0.2, seed=3)
    model.blocks[1].eval()
    model.blocks[2].self_attn.eval()
    tmodel = model.to_torch()
    assert tmodel.training is True
    expected = [(True, True), (False, False), (True, False)]  # (layer, self_attn)
    for layer, (mode, attn) in zip(tmodel.blocks, expected):
        assert layer.training is mode
        assert all(getattr(layer, s).training is mode for s in ("dropout", "dropout1", "dropout2"))
        assert layer.self_attn.training is attn
    assert tmodel.ln_f.training is True and tmodel.wte.training is True


@pytest.mark.parametrize("bias", [True, False])
def test_to_torch_keeps_the_models_dtype_and_its_biases(bias):
    """A float32 model's torch copy is float32, with a final norm bias exactly when the model has one;
    its logits are the model's to float32 rounding."""
    torch = pytest.importorskip("torch")
    model = perturbed(make(dtype="float32", bias=bias), lambda a: a.astype(np.float32)).eval()
    tmodel = model.to_torch()
    assert {p.dtype for p in tmodel.parameters()} == {torch.float32}
    assert ("ln_f.bias" in dict(tmodel.named_parameters())) is bias
    ids = ids_of(3)
    with torch.no_grad():
        got = tmodel(torch.from_numpy(ids)).numpy()
    assert got.dtype == np.float32
    np.testing.assert_allclose(got, model.forward(ids), rtol=0, atol=1e-5)
