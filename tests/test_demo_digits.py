"""``npattn demo --task digits``: the data pipeline, a short run that learns, seeds, pictures and the command.

The learning test trains for four epochs at d_model 16 (about 3 s on two
slow cores): measured validation accuracy 0.81 at seed 0 and 0.76-0.81 over
seeds 0-4, against 0.1 for chance; the bound is 0.6.
"""

import importlib.util
import io
import math
import os
import re
import sys
from types import SimpleNamespace

import numpy as np
import pytest

from npattn import nn
from npattn.backend import backend_name, from_numpy, to_numpy
from npattn.classifier import TransformerClassifier
from npattn.tools import cli
from npattn.tools import demo_digits as dd
from reliability_helpers import count_forward_runs

needs_sklearn = pytest.mark.skipif(importlib.util.find_spec("sklearn") is None,
                                   reason="needs scikit-learn (the demo extra)")
needs_matplotlib = pytest.mark.skipif(importlib.util.find_spec("matplotlib") is None,
                                      reason="needs matplotlib")


@pytest.fixture(scope="module")
def data():
    pytest.importorskip("sklearn")
    return dd.load_digits_data(2, 0.2, 0)


def subset(data, n_train, n_val):
    """The first images of each split: for runs that must take well under a second."""
    return dd.DigitsData(data.x_train[:n_train], data.y_train[:n_train], data.x_val[:n_val],
                         data.y_val[:n_val], data.images_val[:n_val], data.patch)


# ------------------------------------------------------------------ data


def test_image_patches_are_row_by_row():
    img = np.arange(64, dtype=float).reshape(1, 8, 8)
    p = dd.image_patches(img, 2)
    assert p.shape == (1, 16, 4)
    np.testing.assert_array_equal(p[0, 0], [0, 1, 8, 9])  # top-left patch, its rows in order
    np.testing.assert_array_equal(p[0, 1], [2, 3, 10, 11])  # the next patch to the right
    np.testing.assert_array_equal(p[0, 4], [16, 17, 24, 25])  # the second row of patches
    np.testing.assert_array_equal(dd.image_patches(img, 1)[0, :, 0], np.arange(64))
    assert dd.image_patches(img, 4).shape == (1, 4, 16)
    with pytest.raises(ValueError, match=r"^images: expected shape \(N, S, S\)"):
        dd.image_patches(img, 3)
    for shape in ((8, 8), (1, 8, 4), (1, 4, 8)):  # one image without N, images not square
        got = re.escape(f"got shape {shape}")
        with pytest.raises(ValueError, match=r"^images: expected shape \(N, S, S\) .*" + got):
            dd.image_patches(np.zeros(shape), 2)
    for bad in (0, -2, 2.0, True):
        with pytest.raises(ValueError, match=r"^patch: expected an int >= 1, got " + repr(bad)):
            dd.image_patches(img, bad)
    np.testing.assert_array_equal(dd.image_patches(img, np.int64(2)), p)  # NumPy's ints are ints


def test_the_docstring_lists_the_default_models_final_layer_norm():
    """The default model is pre-norm (ViT): a layer norm between the blocks and the pooling."""
    assert dd.DigitsConfig().norm_first
    steps = [ln.strip() for ln in dd.__doc__.splitlines() if ln.strip()[:2] in {f"{i}." for i in range(10)}]
    assert [s.split()[0] for s in steps] == [f"{i}." for i in range(1, len(steps) + 1)]
    blocks = next(i for i, s in enumerate(steps) if "TransformerBlock" in s)
    pool = next(i for i, s in enumerate(steps) if "mean over the L tokens" in s)
    assert pool == blocks + 2 and "layer_norm" in steps[blocks + 1], steps


def _fake_data(n=4, patch=2):
    rng = np.random.default_rng(0)
    images = rng.random((n, 8, 8))
    x = dd.image_patches(images, patch)
    y = np.arange(n, dtype=np.int64) % dd.N_CLASSES
    return dd.DigitsData(x, y, x, y, images, patch)


@pytest.mark.parametrize("call", ["evaluate", "save_attention_figures"])
def test_a_failure_puts_the_training_mode_back(call, tmp_path, monkeypatch):
    data = _fake_data()
    model = dd.build_model(dd.DigitsConfig(d_model=8, n_head=2), data)
    assert model.training

    def fail(*args, **kwargs):
        raise MemoryError("out of memory")

    monkeypatch.setattr(model, "forward", fail)
    with pytest.raises(MemoryError):
        if call == "evaluate":
            dd.evaluate(model, data.x_val, data.y_val)
        else:
            dd.save_attention_figures(model, data, str(tmp_path))
    assert model.training and all(b.training for b in model.blocks)


def test_stratified_split_is_seeded_disjoint_and_keeps_the_class_shares():
    labels = np.repeat(np.arange(10), [20, 30] * 5)
    tr, va = dd.stratified_split(labels, 0.2, np.random.default_rng(0))
    assert np.intersect1d(tr, va).size == 0 and tr.size + va.size == labels.size
    np.testing.assert_array_equal(np.bincount(labels[va]), [4, 6] * 5)
    tr2, va2 = dd.stratified_split(labels, 0.2, np.random.default_rng(0))
    np.testing.assert_array_equal(va, va2)
    _, va3 = dd.stratified_split(labels, 0.2, np.random.default_rng(1))
    assert not np.array_equal(va, va3)


def test_stratified_split_rounds_each_class_s_share():
    """A fifth of 23, 7 and 12 examples is 4.6, 1.4 and 2.4: 5, 1 and 2 validation examples."""
    labels = np.repeat(np.arange(3), [23, 7, 12])
    _, va = dd.stratified_split(labels, 0.2, np.random.default_rng(0))
    np.testing.assert_array_equal(np.bincount(labels[va], minlength=3), [5, 1, 2])


@needs_sklearn
def test_load_digits_data(data):
    assert data.x_train.shape[1:] == (16, 4) and data.x_val.shape[1:] == (16, 4)
    assert data.x_train.shape[0] + data.x_val.shape[0] == 1797
    assert 0.19 < data.x_val.shape[0] / 1797 < 0.21
    assert data.x_train.min() == 0.0 and data.x_train.max() == 1.0  # pixels scaled from 0..16
    assert set(np.unique(data.y_val)) == set(range(10))
    np.testing.assert_array_equal(dd.image_patches(data.images_val, 2), data.x_val)
    again = dd.load_digits_data(2, 0.2, 0)
    np.testing.assert_array_equal(again.y_val, data.y_val)
    assert not np.array_equal(dd.load_digits_data(2, 0.2, 1).y_val, data.y_val)
    with pytest.raises(ValueError, match=r"^patch: expected one of \[1, 2, 4\], got 3"):
        dd.load_digits_data(3)
    for bad in (0.0, 1.0):  # the ends of the open interval, refused before the data are loaded
        with pytest.raises(ValueError, match=r"^val_fraction: expected a number in \(0, 1\)"):
            dd.load_digits_data(2, bad)
    # NumPy's floats are numbers: float32's 0.2 rounds each class's share as 0.2 does
    np.testing.assert_array_equal(dd.load_digits_data(2, np.float32(0.2), 0).y_val, data.y_val)
    for bad, kind in (("0.2", "str"), (True, "bool"), (None, "None")):  # not numbers: named
        with pytest.raises(TypeError, match=rf"^val_fraction: expected a number in \(0, 1\), got {kind}"):
            dd.load_digits_data(2, bad)


def test_missing_scikit_learn_names_the_package_and_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "sklearn", None)
    monkeypatch.setitem(sys.modules, "sklearn.datasets", None)
    with pytest.raises(ImportError,
                       match=r"pip install scikit-learn, or '\.\[demo\]' from the repository root"):
        dd.load_digits_data()


# -------------------------------------------------------------- training


@pytest.mark.parametrize("d_ff, width, norm_first", [(None, 16, False), (24, 24, True)])
def test_build_model_takes_every_setting_of_the_config(d_ff, width, norm_first):
    """Width, heads, blocks, feed-forward width (default 2 * d_model), dropout, norm placement
    (both ways: the classifier's own default is post-norm, the config's pre-norm), dtype and
    backend are the config's, as the command passes them on."""
    cfg = dd.DigitsConfig(n_head=2, d_model=8, n_layers=2, d_ff=d_ff, dropout=0.3, norm_first=norm_first,
                          dtype="float64", backend="array_api_strict")
    model = dd.build_model(cfg, _fake_data())
    assert (model.d_model, model.n_head, model.n_layers, model.d_ff) == (8, 2, 2, width)
    assert (model.dropout, model.norm_first) == (0.3, norm_first)
    assert all(block.norm_first is norm_first for block in model.blocks)
    assert ("norm.weight" in model.params) is norm_first  # pre-norm's final layer norm
    assert backend_name(model.xp) == "array_api_strict" and model.dtype == model.xp.float64
    assert (model.n_features, model.seq_len, model.n_classes) == (4, 16, 10)


def test_build_model_draws_its_parameters_from_the_config_s_seed():
    """The same seed builds the same parameters, another seed other ones."""
    data = _fake_data()
    params = [dd.build_model(dd.DigitsConfig(n_head=2, d_model=8, seed=s), data).params for s in (4, 4, 5)]
    assert params[0].keys() == params[1].keys() == params[2].keys()
    for name in params[0]:
        np.testing.assert_array_equal(to_numpy(params[0][name]), to_numpy(params[1][name]))
    assert any(not np.array_equal(to_numpy(params[0][n]), to_numpy(params[2][n])) for n in params[0])


def _loss_and_hits(logits, labels):
    """Summed cross-entropy and correct count, from host logits [N, C], by log-softmax."""
    logp = logits - np.log(np.exp(logits).sum(axis=-1, keepdims=True))
    return -logp[np.arange(labels.size), labels].sum(), int(np.sum(logits.argmax(axis=-1) == labels))


def test_evaluate_weighs_each_batch_by_its_images_and_runs_in_evaluation_mode():
    """Batches of 3 over 7 images (3, 3, 1): the mean over the images, dropout off, the model's
    mode left as it was (evaluation here)."""
    data = _fake_data(n=7)
    model = dd.build_model(dd.DigitsConfig(n_head=2, d_model=8, dropout=0.5, dtype="float64"), data)
    model.eval()
    logits = to_numpy(model.forward(from_numpy(data.x_val, model.xp)))  # [7, C]
    total, hits = _loss_and_hits(logits, data.y_val)
    model.train()
    loss, acc = dd.evaluate(model, data.x_val, data.y_val, batch=3)
    assert loss == pytest.approx(total / 7, rel=1e-12) and acc == hits / 7
    assert model.training
    model.eval()
    assert dd.evaluate(model, data.x_val, data.y_val, batch=3) == (loss, acc)
    assert not model.training


def test_training_batches_rates_clipping_and_the_reported_losses(monkeypatch):
    """10 images in batches of 4 for 2 epochs: 6 steps of 4, 4 and 2 images, each epoch every
    image once in a shuffled order; the rate falls along a cosine from lr toward 10 % of it
    over the 6 steps, gradients are clipped at cfg.clip; each epoch's training loss is the
    mean over its images, and the validation loss and accuracy are the model's in evaluation
    mode, all recomputed here from the logits."""
    data = _fake_data(n=10)
    data = dd.DigitsData(data.x_train, data.y_train, data.x_val[:5], data.y_val[:5],
                         data.images_val[:5], data.patch)
    seen, rates, norms = [], [], []
    forward, adam_step, clip = TransformerClassifier.forward, nn.adam_step, nn.clip_grad_norm

    def recording_forward(self, x, *args, **kwargs):
        logits = forward(self, x, *args, **kwargs)
        seen.append((self.training, to_numpy(x), to_numpy(logits)))
        return logits

    def recording_adam_step(params, grads, state, *, lr, **kwargs):
        rates.append(lr)
        return adam_step(params, grads, state, lr=lr, **kwargs)

    def recording_clip(grads, max_norm, **kwargs):
        norms.append(max_norm)
        return clip(grads, max_norm, **kwargs)

    monkeypatch.setattr(TransformerClassifier, "forward", recording_forward)
    monkeypatch.setattr(nn, "adam_step", recording_adam_step)
    monkeypatch.setattr(nn, "clip_grad_norm", recording_clip)
    cfg = dd.DigitsConfig(n_head=2, d_model=8, epochs=2, batch=4, lr=0.02, clip=0.5, dropout=0.0,
                          dtype="float64", seed=3)
    _, r = dd.train(cfg, data, progress=False)
    # step s of 6: lr (0.55 + 0.45 cos(pi s / 6)), cos being 1, sqrt(3)/2, 1/2, 0, -1/2, -sqrt(3)/2
    c = [1.0, math.sqrt(3) / 2, 0.5, 0.0, -0.5, -math.sqrt(3) / 2]
    np.testing.assert_allclose(rates, [0.02 * (0.55 + 0.45 * x) for x in c], rtol=1e-12)
    assert norms == [0.5] * 6
    assert [(training, x.shape[0]) for training, x, _ in seen] == [
        (True, 4), (True, 4), (True, 2), (False, 5), (True, 4), (True, 4), (True, 2), (False, 5)]
    orders = []
    for epoch in range(2):
        steps = seen[4 * epoch:4 * epoch + 3]
        # which training images each batch held, found by their pixels
        idx = [[int(np.flatnonzero((data.x_train == xi).all(axis=(1, 2)))[0]) for xi in x]
               for _, x, _ in steps]
        order = sum(idx, [])
        assert sorted(order) == list(range(10)) and order != list(range(10))
        orders.append(order)
        total = sum(_loss_and_hits(logits, data.y_train[i])[0] for (_, _, logits), i in zip(steps, idx))
        assert r.history["train_loss"][epoch] == pytest.approx(total / 10, rel=1e-12)
        val_total, val_hits = _loss_and_hits(seen[4 * epoch + 3][2], data.y_val)
        assert r.history["val_loss"][epoch] == pytest.approx(val_total / 5, rel=1e-12)
        assert r.history["val_accuracy"][epoch] == val_hits / 5
    assert (r.train_loss, r.val_loss, r.val_accuracy) == (
        r.history["train_loss"][1], r.history["val_loss"][1], r.history["val_accuracy"][1])
    assert orders[0] != orders[1]  # a new order each epoch


@pytest.mark.parametrize("clip", [1e-3, 1e6])
def test_adam_is_given_the_gradients_clipped_to_the_global_norm(clip, monkeypatch):
    """clip 1e-3, far below the gradients' norm: each step Adam gets the backward's gradients
    scaled by clip / (norm + 1e-6), the norm recomputed here over all of them in float64
    (Adam's update barely changes when every gradient is scaled by one factor, so the loss
    alone would not show a clipping that was computed and then left unused); clip 1e6, far
    above it: the backward's gradients themselves, not scaled up."""
    backward, adam_step = TransformerClassifier.backward, nn.adam_step
    raw, given = [], []

    def recording_backward(self, dlogits):
        grads = backward(self, dlogits)
        raw.append({k: to_numpy(g) for k, g in grads.items()})
        return grads

    def recording_adam_step(params, grads, state, **kwargs):
        given.append({k: to_numpy(g) for k, g in grads.items()})
        return adam_step(params, grads, state, **kwargs)

    monkeypatch.setattr(TransformerClassifier, "backward", recording_backward)
    monkeypatch.setattr(nn, "adam_step", recording_adam_step)
    cfg = dd.DigitsConfig(n_head=2, d_model=8, epochs=1, batch=4, clip=clip, dropout=0.0,
                          dtype="float64", seed=1)
    dd.train(cfg, _fake_data(n=10), progress=False)
    assert len(raw) == len(given) == 3
    for before, after in zip(raw, given):
        norm = math.sqrt(sum(float(np.sum(g.astype(np.float64) ** 2)) for g in before.values()))
        assert norm > 10 * clip if clip < 1.0 else norm < clip / 10
        scale = clip / (norm + 1e-6) if clip < 1.0 else 1.0
        assert after.keys() == before.keys()
        for name, g in before.items():
            np.testing.assert_allclose(after[name], g * scale, rtol=1e-10, atol=0, err_msg=name)


@needs_sklearn
def test_a_short_run_beats_chance_by_a_wide_margin(data):
    cfg = dd.DigitsConfig(n_head=2, d_model=16, epochs=4, seed=0)
    model, r = dd.train(cfg, data, progress=False)
    assert r.val_accuracy > 0.6, r  # chance is 0.1
    h = r.history
    assert len(h["train_loss"]) == len(h["val_accuracy"]) == len(h["seconds"]) == 4
    assert h["train_loss"][-1] < h["train_loss"][0] < np.log(10.0) + 0.1
    assert r.n_params == model.n_params() and r.head_dim == 8
    assert r.seconds_per_epoch == pytest.approx(np.mean(h["seconds"]))
    loss, acc = dd.evaluate(model, data.x_val, data.y_val)
    assert acc == r.val_accuracy and loss == pytest.approx(r.val_loss)


@needs_sklearn
@pytest.mark.parametrize("n_train,n_val,named", [(0, 8, "data.x_train"), (8, 0, "data.x_val")])
def test_train_refuses_an_empty_split(data, n_train, n_val, named):
    """No training image failed on the epoch's mean loss (loss_sum / 0), no validation
    image on evaluate's; both are refused before a model is built."""
    cfg = dd.DigitsConfig(n_head=2, d_model=8, epochs=1)
    with pytest.raises(ValueError, match=rf"^{named}: expected at least one image, got shape \(0, 16, 4\)"):
        dd.train(cfg, subset(data, n_train, n_val), progress=False)


@needs_sklearn
@pytest.mark.parametrize("field,value,error", [("epochs", 0, ValueError), ("batch", 0, ValueError),
                                               ("epochs", 2.0, TypeError)])
def test_train_refuses_a_bad_epoch_count_or_batch(data, field, value, error):
    """epochs=0 failed on the last epoch's entry of an empty history, batch=0 on the batch
    count (N // 0), epochs=2.0 in range(). The check names the field."""
    cfg = dd.DigitsConfig(n_head=2, d_model=8, **{field: value})
    with pytest.raises(error, match=rf"^cfg\.{field}: expected a positive int, got .*{value!r}"):
        dd.train(cfg, subset(data, 8, 8), progress=False)


@needs_sklearn
@pytest.mark.parametrize("val_fraction,empty", [(0.001, "0 validation"), (0.999, "0 training")])
def test_load_digits_data_refuses_a_split_with_an_empty_side(val_fraction, empty):
    """Every class's share rounds to none (or all) of its ~180 images: one side was empty."""
    with pytest.raises(ValueError, match=rf"^val_fraction: expected a share that leaves .*{empty}"):
        dd.load_digits_data(2, val_fraction)


@needs_sklearn
def test_untrained_model_is_near_chance(data):
    model = dd.build_model(dd.DigitsConfig(n_head=2, d_model=16), data)
    _, acc = dd.evaluate(model, data.x_val, data.y_val)
    assert acc < 0.3


@needs_sklearn
def test_one_seed_repeats_and_matches_across_backends(data, backend):
    small = subset(data, 96, 40)
    cfg = dd.DigitsConfig(n_head=2, d_model=8, epochs=2, batch=32, dtype="float64", seed=5)
    _, ref = dd.train(cfg, small, progress=False)
    _, again = dd.train(cfg, small, progress=False)
    assert again.history["train_loss"] == ref.history["train_loss"]
    cfg.backend = backend
    _, other = dd.train(cfg, small, progress=False)
    np.testing.assert_allclose(other.history["train_loss"], ref.history["train_loss"], rtol=1e-9)
    assert other.history["val_accuracy"] == ref.history["val_accuracy"]
    cfg.seed = 6
    _, seed6 = dd.train(cfg, small, progress=False)
    assert seed6.history["train_loss"] != ref.history["train_loss"]


def test_format_table_has_the_seed_columns():
    r = dd.DigitsResult(4, 32, 0.01234, 0.975, 0.1, 0.61, 9610, 20)
    header, row = dd.format_table([r]).splitlines()
    assert header.split() == ["heads", "head", "dim", "train", "loss", "val", "accuracy",
                              "s/epoch", "params"]
    assert row.split() == ["4", "8", "0.0123", "0.9750", "0.61", "9610"]


# -------------------------------------------------------------- pictures


@needs_sklearn
@needs_matplotlib
def test_pictures_are_pngs_and_leave_matplotlib_alone(data, tmp_path):
    import matplotlib

    backend = matplotlib.get_backend()
    small = subset(data, 64, 8)
    results = []
    for H in (1, 8):
        model, r = dd.train(dd.DigitsConfig(n_head=H, d_model=8, epochs=2), small, progress=False)
        results.append(r)
    paths = dd.save_attention_figures(model, small, str(tmp_path), index=3)
    assert [p.rsplit("/", 1)[-1] for p in paths] == ["attention_heads.png", "attention_on_image.png"]
    for p in paths:
        with open(p, "rb") as f:
            assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    assert model.training  # put back as it was
    fig = dd.curves_figure(results)
    loss_ax, acc_ax = fig.axes
    assert len(loss_ax.get_lines()) == len(acc_ax.get_lines()) == 2
    assert [t.get_text() for t in acc_ax.get_legend().get_texts()] == ["1 head (dim 8)",
                                                                     "8 heads (dim 1)"]
    assert matplotlib.get_backend() == backend


@needs_matplotlib
def test_attention_pictures_are_of_the_chosen_image_and_the_first_block(tmp_path, monkeypatch):
    """The heatmaps are block 0's weights of validation image ``index`` in evaluation mode,
    titled with its label and the model's prediction; the picture on the image shows that
    image and, per head, the attention each patch receives (the mean over the queries),
    each patch's value over its patch x patch pixels, all heads on one colour scale from 0 to
    the most any patch receives."""
    from matplotlib.figure import Figure

    data = _fake_data(n=4)
    model = dd.build_model(dd.DigitsConfig(n_head=2, d_model=8, n_layers=2, dropout=0.5,
                                           dtype="float64"), data)
    titles, saved = [], []
    figure, savefig = dd.heatmap_figure, Figure.savefig

    def recording_figure(weights, digits, *, title=None):
        titles.append((np.array(weights), title))
        return figure(weights, digits, title=title)

    def recording_savefig(self, *args, **kwargs):
        saved.append(self)
        return savefig(self, *args, **kwargs)

    modes = []
    forward = TransformerClassifier.forward

    def recording_forward(self, *args, **kwargs):
        modes.append(self.training)
        return forward(self, *args, **kwargs)

    monkeypatch.setattr(dd, "heatmap_figure", recording_figure)
    monkeypatch.setattr(Figure, "savefig", recording_savefig)
    monkeypatch.setattr(TransformerClassifier, "forward", recording_forward)
    dd.save_attention_figures(model, data, str(tmp_path), index=2)
    assert modes == [False] and model.training  # dropout off for the picture, then put back
    model.eval()
    logits, weights = model.forward(from_numpy(data.x_val[2:3], model.xp), need_weights=True)
    w = to_numpy(weights[0])[0]  # [H, L, L] block 0's
    ((drawn, title),) = titles
    np.testing.assert_array_equal(drawn, w)
    label, pred = int(data.y_val[2]), int(to_numpy(logits)[0].argmax())
    assert f"validation image 2 (a {label}, predicted {pred})" in title
    image_axes = saved[1].axes
    np.testing.assert_array_equal(image_axes[0].get_images()[0].get_array(), data.images_val[2])
    most = w.mean(axis=1).max()  # over the heads and the patches
    for h in range(2):
        received = w[h].mean(axis=0).reshape(4, 4)  # per key token, on the 4 x 4 grid of patches
        pixels = received.repeat(2, axis=0).repeat(2, axis=1)  # [8, 8]
        (im,) = image_axes[1 + h].get_images()
        np.testing.assert_allclose(im.get_array(), pixels, rtol=1e-12)
        low, high = im.get_clim()
        assert low == 0.0 and high == pytest.approx(most, rel=1e-12), (low, high, most)


@needs_matplotlib
def test_curves_figure_plots_each_run_s_history():
    history = {"train_loss": [2.0, 1.0, 0.5], "val_loss": [1.9, 1.1, 0.7],
               "val_accuracy": [0.3, 0.6, 0.9], "seconds": [1.0] * 3}
    r = dd.DigitsResult(2, 8, 0.5, 0.9, 0.7, 1.0, 100, 3, history)
    loss_ax, acc_ax = dd.curves_figure([r]).axes
    ((loss,),), ((acc,),) = [loss_ax.get_lines()], [acc_ax.get_lines()]
    assert list(loss.get_xdata()) == list(acc.get_xdata()) == [1, 2, 3]
    assert list(loss.get_ydata()) == [2.0, 1.0, 0.5] and list(acc.get_ydata()) == [0.3, 0.6, 0.9]


def test_the_config_s_unexposed_defaults_are_the_documented_ones():
    """What the command does not set comes from the config (docs/digits.md): gradients clipped
    to a global norm of 1, pre-norm blocks, a feed-forward width of 2 d_model (``d_ff`` None:
    16 at d_model 8), and the fifth of the images the command holds out for validation."""
    cfg = dd.DigitsConfig()
    assert (cfg.clip, cfg.norm_first, cfg.d_ff, cfg.val_fraction) == (1.0, True, None, 0.2)
    assert dd.build_model(dd.DigitsConfig(n_head=2, d_model=8), _fake_data()).d_ff == 16


def test_train_without_data_loads_the_config_s_split(monkeypatch):
    """``data=None`` loads the digits with the config's patch size, validation share and seed."""
    asked = []

    def load(patch, val_fraction, seed):
        asked.append((patch, val_fraction, seed))
        return _fake_data(n=4, patch=4)

    monkeypatch.setattr(dd, "load_digits_data", load)
    cfg = dd.DigitsConfig(n_head=2, d_model=8, patch=4, val_fraction=0.3, seed=7, epochs=1)
    model, _ = dd.train(cfg, progress=False)
    assert asked == [(4, 0.3, 7)] and model.seq_len == 4


def _training_inputs(monkeypatch):
    """The images of each training-mode forward, in order."""
    seen = []
    forward = TransformerClassifier.forward

    def recording_forward(self, x, *args, **kwargs):
        if self.training:
            seen.append(to_numpy(x))
        return forward(self, x, *args, **kwargs)

    monkeypatch.setattr(TransformerClassifier, "forward", recording_forward)
    return seen


def test_the_seed_draws_the_order_of_the_training_images(monkeypatch):
    """One seed visits the images in the same order, another seed in another order."""
    data = _fake_data(n=10)
    orders = []
    for seed in (3, 3, 4):
        seen = _training_inputs(monkeypatch)
        dd.train(dd.DigitsConfig(n_head=2, d_model=8, epochs=1, batch=4, dropout=0.0, seed=seed),
                 data, progress=False)
        orders.append(np.concatenate(seen))  # [10, L, P]
    np.testing.assert_array_equal(orders[0], orders[1])
    assert not np.array_equal(orders[0], orders[2])
    np.testing.assert_array_equal(np.sort(orders[0], axis=0), np.sort(orders[2], axis=0))


def test_the_result_and_the_bar_report_the_last_epoch_s_validation(monkeypatch, bar_notes):
    """Validation accuracy 0.75 after epoch 1 and 0.25 after epoch 2 (the evaluation replaced by
    these numbers): the result is the last epoch's, not the best one's. 10 images in batches of
    2 are 5 steps an epoch, and the bar's notes come at steps 5 and 10 and after each evaluation:
    no accuracy yet (nan) at step 5, then the last one measured."""
    scores = iter([(1.0, 0.75), (2.0, 0.25)])
    monkeypatch.setattr(dd, "evaluate", lambda model, x, y: next(scores))
    notes = bar_notes(dd)
    cfg = dd.DigitsConfig(n_head=2, d_model=8, epochs=2, batch=2, dropout=0.0)
    _, r = dd.train(cfg, _fake_data(n=10), progress=False)
    assert (r.val_accuracy, r.val_loss, r.epochs) == (0.25, 2.0, 2)
    assert r.history["val_accuracy"] == [0.75, 0.25] and r.history["val_loss"] == [1.0, 2.0]
    shown = [re.fullmatch(r"epoch (\d)/2  batch loss \S+  val acc (\S+)", note) for note in notes]
    assert all(shown), notes
    assert [(m[1], m[2]) for m in shown] == [("1", "nan"), ("1", "0.750"), ("2", "0.750"),
                                             ("2", "0.250")]


def test_an_epoch_s_time_is_its_training_steps_without_the_evaluation(monkeypatch):
    """On a clock that advances 1 s in each Adam step and 100 s in each evaluation, each epoch of
    3 steps took 3 s (docs/digits.md: "s/epoch" leaves the evaluation out)."""
    clock = [50.0]
    adam_step, evaluate = nn.adam_step, dd.evaluate

    def slow_adam_step(*args, **kwargs):
        clock[0] += 1.0
        return adam_step(*args, **kwargs)

    def slow_evaluate(*args, **kwargs):
        clock[0] += 100.0
        return evaluate(*args, **kwargs)

    monkeypatch.setattr(dd, "time", SimpleNamespace(perf_counter=lambda: clock[0]))
    monkeypatch.setattr(nn, "adam_step", slow_adam_step)
    monkeypatch.setattr(dd, "evaluate", slow_evaluate)
    cfg = dd.DigitsConfig(n_head=2, d_model=8, epochs=2, batch=4, dropout=0.0)
    _, r = dd.train(cfg, _fake_data(n=10), progress=False)
    assert r.history["seconds"] == [3.0, 3.0] and r.seconds_per_epoch == 3.0


def _picture_on_image(model, data, tmp_path, monkeypatch, index=0):
    """The figure save_attention_figures writes as attention_on_image.png."""
    from matplotlib.figure import Figure

    saved = []
    savefig = Figure.savefig

    def recording_savefig(self, path, *args, **kwargs):
        saved.append((os.path.basename(path), self))
        return savefig(self, path, *args, **kwargs)

    monkeypatch.setattr(Figure, "savefig", recording_savefig)
    dd.save_attention_figures(model, data, str(tmp_path), index=index)
    return dict(saved)["attention_on_image.png"]


@needs_matplotlib
@pytest.mark.parametrize("H, grid", [(2, (1, 3)), (4, (1, 5)), (8, (2, 5))])
def test_the_picture_on_the_image_has_rows_of_five_panels(H, grid, tmp_path, monkeypatch):
    """The image, then one panel per head: one row up to 4 heads, then rows of 5 panels."""
    data = _fake_data()
    model = dd.build_model(dd.DigitsConfig(n_head=H, d_model=8), data)
    fig = _picture_on_image(model, data, tmp_path, monkeypatch)
    panels = [ax for ax in fig.axes if ax.get_subplotspec() is not None]
    assert {ax.get_subplotspec().get_geometry()[:2] for ax in panels} == {grid}
    assert len(panels) == grid[0] * grid[1]
    assert sum(bool(ax.get_images()) for ax in panels) == H + 1
    assert all(ax.axison == bool(ax.get_images()) for ax in panels)  # a cell without a head is hidden


def _bilinear(image, x, y):
    """The image interpolated between its pixel centres at column x, row y (imshow's axes)."""
    i0, j0 = min(int(y), image.shape[0] - 2), min(int(x), image.shape[1] - 2)
    fy, fx = y - i0, x - j0
    return ((1 - fy) * (1 - fx) * image[i0, j0] + (1 - fy) * fx * image[i0, j0 + 1]
            + fy * (1 - fx) * image[i0 + 1, j0] + fy * fx * image[i0 + 1, j0 + 1])


@needs_matplotlib
def test_each_head_s_panel_outlines_the_digit_at_half_intensity(tmp_path, monkeypatch):
    """The white outline over each head's panel is the image's 0.5 level: every vertex of it
    lies where the image, interpolated between pixel centres, is 0.5 (an outline of the
    transposed image would lie elsewhere on this image, which is not symmetric)."""
    from matplotlib.path import Path as MplPath

    data = _fake_data()
    model = dd.build_model(dd.DigitsConfig(n_head=2, d_model=8), data)
    fig = _picture_on_image(model, data, tmp_path, monkeypatch, index=1)
    image = data.images_val[1]  # [8, 8]
    assert not np.allclose(image, image.T)
    for ax in fig.axes[1:3]:  # the two heads' panels
        (outline,) = ax.collections
        vertices = [v for path in outline.get_paths()
                    for v, code in zip(path.vertices, path.codes if path.codes is not None
                                       else [MplPath.LINETO] * len(path.vertices))
                    if code != MplPath.CLOSEPOLY]
        assert len(vertices) > 4
        for x, y in vertices:
            assert _bilinear(image, x, y) == pytest.approx(0.5, abs=1e-9), (x, y)


@needs_matplotlib
@pytest.mark.parametrize("patch", [1, 2, 4])
def test_each_patch_number_sits_on_the_pixels_of_its_token(patch, tmp_path, monkeypatch):
    """Patch number t is drawn inside the pixels that ``image_patches`` puts in token t, so the
    numbers on the image are the heatmaps' token numbers."""
    data = _fake_data(patch=patch)
    model = dd.build_model(dd.DigitsConfig(n_head=2, d_model=8, patch=patch), data)
    fig = _picture_on_image(model, data, tmp_path, monkeypatch, index=1)
    image = data.images_val[1]  # [8, 8]
    labels = fig.axes[0].texts
    assert sorted(int(t.get_text()) for t in labels) == list(range((8 // patch) ** 2))
    for text in labels:
        x, y = text.get_position()  # imshow's pixel (i, j) is centred on (j, i)
        r, c = int((y + 0.5) // patch), int((x + 0.5) // patch)
        pixels = image[r * patch:(r + 1) * patch, c * patch:(c + 1) * patch].reshape(-1)
        np.testing.assert_array_equal(pixels, data.x_val[1, int(text.get_text())])


@needs_matplotlib
@pytest.mark.parametrize("training", [True, False])
def test_the_pictures_leave_the_model_in_its_mode(training, tmp_path):
    data = _fake_data()
    model = dd.build_model(dd.DigitsConfig(n_head=2, d_model=8), data)
    model.train(training)
    dd.save_attention_figures(model, data, str(tmp_path))
    assert model.training is training


@needs_matplotlib
def test_the_pictures_title_names_the_model_s_prediction(tmp_path, monkeypatch):
    """A head whose bias favours the last class by far predicts it: "predicted 9"."""
    titles = []
    figure = dd.heatmap_figure

    def recording_figure(weights, digits, *, title=None):
        titles.append(title)
        return figure(weights, digits, title=title)

    monkeypatch.setattr(dd, "heatmap_figure", recording_figure)
    data = _fake_data()
    model = dd.build_model(dd.DigitsConfig(n_head=2, d_model=8, dtype="float64"), data)
    bias = np.zeros(dd.N_CLASSES)
    bias[-1] = 50.0
    model.params = {**model.params, "head.bias": from_numpy(bias, model.xp)}
    dd.save_attention_figures(model, data, str(tmp_path), index=2)
    assert f"(a {int(data.y_val[2])}, predicted 9)" in titles[0], titles


# --------------------------------------------------------------- command


def _args(tmp_path, *extra):
    return ["demo", "--task", "digits", "--epochs", "1", "--d-model", "8", "--batch", "64",
            "--no-progress", "--out", str(tmp_path / "out"), *extra]


@needs_sklearn
def test_command_compares_heads_and_writes_pictures(tmp_path, capsys):
    assert cli.main(_args(tmp_path, "--heads", "1,2")) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    assert lines[0].startswith("Handwritten digits (scikit-learn, 1797 images")
    assert sum(line.startswith("heads=") and "validation accuracy" in line for line in lines) == 2
    header = next(i for i, line in enumerate(lines) if line.split()[:1] == ["heads"])
    table = [row.split() for row in lines[header + 1:]]
    assert [row[:2] for row in table] == [["1", "8"], ["2", "4"]]
    assert table[0][-1] == table[1][-1]  # the same parameter count at equal d_model
    if importlib.util.find_spec("matplotlib") is not None:
        for H in (1, 2):
            names = sorted(p.name for p in (tmp_path / "out" / f"heads{H}").iterdir())
            assert names == ["attention_heads.png", "attention_on_image.png"]
        assert (tmp_path / "out" / "training_curves.png").read_bytes()[:4] == b"\x89PNG"


class _FakeTerminal(io.StringIO):
    def isatty(self):
        return True


@needs_sklearn
def test_command_progress_bar_shows_epoch_loss_and_accuracy(tmp_path, capsys, monkeypatch):
    term = _FakeTerminal()
    monkeypatch.setattr(sys, "stderr", term)
    args = [a for a in _args(tmp_path, "--no-plots", "--heads", "2") if a != "--no-progress"]
    assert cli.main(args) == 0
    err = term.getvalue()
    assert "digits H=2" in err and "epoch 1/1" in err and "val acc" in err and "23/23" in err


def test_command_without_scikit_learn_says_so(tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "sklearn", None)
    monkeypatch.setitem(sys.modules, "sklearn.datasets", None)
    args = _args(tmp_path, "--no-plots")
    del args[args.index("--out"):args.index("--out") + 2]  # with --no-plots --out is a warning
    assert cli.main(args) == 2
    err = capsys.readouterr().err
    assert err.startswith("npattn demo: the digits task needs scikit-learn") and ".[demo]" in err
    assert "pip install scikit-learn, or '.[demo]'" in err  # what a wheel's user can install first
    assert "Traceback" not in err


def _must_not_train(*args, **kwargs):
    raise AssertionError("the demo trained before its arguments were checked")


@pytest.mark.parametrize("extra, named", [
    (["--steps", "10"], "--steps: an option of --task reverse and --task gpt, not of --task digits"),
    (["--seq-len", "6"], "--seq-len: an option of --task reverse"),
    (["--pos", "learned"], "--pos: an option of --task reverse"),
    (["--heads", "3"], "--heads: expected divisors of --d-model 8, got '3', where 3 does not divide it"),
    (["--patch", "3"], "argument --patch: invalid choice"),
    (["--dropout", "1"], "argument --dropout: expected a number in [0, 1), got '1'"),
    (["--dropout", "nan"], "argument --dropout"),
    (["--dropout", "x"], "argument --dropout: expected a number in [0, 1), got 'x'"),
    (["--epochs", "0"], "argument --epochs: expected a positive integer"),
    (["--layers", "-1"], "argument --layers"),
    (["--task", "gpt2"], "argument --task: invalid choice"),
])
def test_command_usage_errors_name_the_option(extra, named, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(dd, "train", _must_not_train)
    with pytest.raises(SystemExit) as exc:
        cli.main(_args(tmp_path) + extra)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "usage: npattn demo" in err and named in err, err


@pytest.mark.parametrize("option, value", [("--epochs", "2"), ("--layers", "2"), ("--patch", "4"),
                                           ("--dropout", "0.2"), ("--dropout", "0")])
def test_digits_options_are_refused_by_the_reverse_task(option, value, tmp_path, capsys,
                                                        monkeypatch):
    from npattn.tools import demo

    monkeypatch.setattr(demo, "train", _must_not_train)
    with pytest.raises(SystemExit) as exc:
        cli.main(["demo", "--no-progress", "--out", str(tmp_path), option, value])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert f"{option}: an option of --task digits" in err and "not of --task reverse" in err, err


class _Stop(Exception):
    pass


def _capture(seen):
    def train(cfg, *args, **kwargs):
        seen.append(cfg)
        raise _Stop

    return train


def test_reverse_stays_the_default_task_with_its_defaults(tmp_path, monkeypatch):
    from npattn.tools import demo

    seen = []
    monkeypatch.setattr(demo, "train", _capture(seen))
    with pytest.raises(_Stop):
        cli.main(["demo", "--no-plots", "--no-progress"])
    (cfg,) = seen
    assert isinstance(cfg, demo.DemoConfig)
    assert (cfg.steps, cfg.seq_len, cfg.pos, cfg.batch, cfg.lr, cfg.n_head, cfg.d_model) == (
        400, 12, "sinusoidal", 64, 1e-2, 4, 32)


@needs_sklearn
def test_digits_defaults(monkeypatch):
    seen = []
    monkeypatch.setattr(dd, "train", _capture(seen))
    with pytest.raises(_Stop):
        cli.main(["demo", "--task", "digits", "--no-plots", "--no-progress"])
    (cfg,) = seen
    assert (cfg.epochs, cfg.n_layers, cfg.patch, cfg.dropout, cfg.batch, cfg.lr) == (
        20, 1, 2, 0.1, 32, 1e-2)
    assert (cfg.n_head, cfg.d_model, cfg.dtype, cfg.backend, cfg.seed) == (4, 32, "float32", "numpy", 0)
    assert cfg == dd.DigitsConfig(n_head=4)  # the command's defaults are the config's


def test_the_command_hands_every_option_to_the_config_and_the_data(tmp_path, monkeypatch):
    """Each option given reaches the run's config, none dropped for its default, and the
    images are split by --seed with --patch's tokens (the fifth held out, the config's)."""
    seen, loaded = [], []

    def load(patch, val_fraction, seed):
        loaded.append((patch, val_fraction, seed))
        return _fake_data(n=4, patch=patch)

    monkeypatch.setattr(dd, "load_digits_data", load)
    monkeypatch.setattr(dd, "train", _capture(seen))
    with pytest.raises(_Stop):
        cli.main(["demo", "--task", "digits", "--heads", "2", "--d-model", "8", "--layers", "2",
                  "--patch", "4", "--epochs", "3", "--batch", "16", "--lr", "0.05", "--dropout",
                  "0.2", "--dtype", "float64", "--seed", "7", "--no-plots", "--no-progress"])
    assert loaded == [(4, 0.2, 7)]
    assert seen == [dd.DigitsConfig(n_head=2, d_model=8, n_layers=2, patch=4, epochs=3, batch=16,
                                    lr=0.05, dropout=0.2, dtype="float64", seed=7)]


def test_the_gradient_clipped_and_given_to_adam_is_that_of_the_batch_s_mean_loss(monkeypatch):
    """The first step's gradient, before clipping, is the gradient of the mean cross-entropy of
    its batch at the initial parameters (dropout off), checked by finite differences in float64."""
    from npattn.gradcheck import check_vjp

    seen, clipped = _training_inputs(monkeypatch), []
    clip = nn.clip_grad_norm

    def recording_clip(grads, max_norm, **kwargs):
        clipped.append(dict(grads))
        return clip(grads, max_norm, **kwargs)

    monkeypatch.setattr(nn, "clip_grad_norm", recording_clip)
    data = _fake_data(n=10)
    cfg = dd.DigitsConfig(n_head=2, d_model=8, epochs=1, batch=4, dropout=0.0, dtype="float64", seed=2)
    dd.train(cfg, data, progress=False)
    model = dd.build_model(cfg, data)  # the initial parameters, from the seed
    x = from_numpy(seen[0], model.xp)  # [4, L, P]: the first batch
    rows = [int(np.flatnonzero((data.x_train == xi).all(axis=(1, 2)))[0]) for xi in seen[0]]
    y = from_numpy(data.y_train[rows], model.xp)  # [4]: their labels, the images found by pixels
    names = sorted(model.params)
    params = [model.params[n] for n in names]

    def loss_of(*ps):
        model.params = dict(zip(names, ps))
        return nn.cross_entropy_forward(model.forward(x), y)[0]

    report = check_vjp(loss_of, params, [clipped[0][n] for n in names],
                       from_numpy(np.asarray(1.0), model.xp), names=names, n_directions=2, rtol=1e-6)
    assert report.ok, str(report)


def test_on_dask_a_step_and_the_evaluation_run_the_forward_once_each(monkeypatch):
    """On dask a step computes its loss with its gradients, and the evaluation reads the
    loss and the predictions in one graph: the loss read after the step, and the loss and
    the predictions read apart, each ran the forward again (six passes over the logits for
    two steps and one evaluation batch, where three). The numbers are NumPy's."""
    pytest.importorskip("dask.array", reason="needs dask: pip install '.[dask]'")
    import dask

    calls = count_forward_runs(monkeypatch, TransformerClassifier)  # the logits' runs
    data = _fake_data(8)
    kw = dict(d_model=8, n_head=2, epochs=1, batch=4, dtype="float64")
    _, want = dd.train(dd.DigitsConfig(**kw), data, progress=False)
    with dask.config.set(scheduler="sync"):  # the calls are counted in this process
        _, got = dd.train(dd.DigitsConfig(backend="dask", **kw), data, progress=False)
    assert len(calls) == 3, calls
    np.testing.assert_allclose([got.train_loss, got.val_loss], [want.train_loss, want.val_loss], rtol=1e-12)
    assert got.val_accuracy == want.val_accuracy
