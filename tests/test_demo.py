"""The demo model: its composed backward against finite differences, and that it learns."""

import importlib.util
import io
import math
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from npattn import nn
from npattn.backend import from_numpy, resolve_backend, to_numpy
from npattn.tools import demo
from npattn.tools.demo import DemoConfig, ReverseModel, TrainResult, make_batch, train
from npattn.gradcheck import check_vjp
from reliability_helpers import count_forward_runs

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("pos", ["learned", "sinusoidal"])
def test_model_gradients_match_finite_differences(backend, pos):
    """Every parameter's gradient of the loss (embedding, positions, attention, output) by directions."""
    xp = resolve_backend(backend)
    cfg = DemoConfig(seq_len=4, d_model=8, n_head=2, dtype="float64", pos=pos, backend=backend,
                     seed=3)
    model = ReverseModel(cfg)
    ids_h, tgt_h = make_batch(np.random.default_rng(0), 3, cfg.seq_len, cfg.vocab)
    ids, tgt = from_numpy(ids_h, xp), from_numpy(tgt_h, xp)
    names = sorted(model.all_params())
    params = [model.all_params()[n] for n in names]

    def loss_of(*ps):
        model.set_params(dict(zip(names, ps)))
        loss, _ = nn.cross_entropy_forward(model.forward(ids), tgt)
        return loss

    loss, ce_cache = nn.cross_entropy_forward(model.forward(ids), tgt)
    dloss = from_numpy(np.asarray(0.7), xp)  # a non-unit upstream gradient
    dlogits, _ = nn.cross_entropy_backward(dloss, ce_cache)
    grads = model.backward(dlogits)
    assert set(grads) == set(names)
    report = check_vjp(loss_of, params, [grads[n] for n in names], dloss, names=names,
                       n_directions=2, rtol=1e-6)
    assert report.ok, str(report)


def test_training_learns_to_reverse():
    """A short run must solve a small reversal task: the gradients drive real learning."""
    cfg = DemoConfig(seq_len=6, d_model=16, n_head=2, batch=32, steps=150, eval_size=256, seed=1,
                     pos="learned")
    model, result = train(cfg, progress=False)
    assert result.accuracy >= 0.95, result
    assert result.final_loss < 0.2, result
    assert result.n_params == model.n_params() > 0


def test_untrained_model_is_at_chance():
    """The held-out accuracy starts near 1/10, so the learning test above is not trivial."""
    cfg = DemoConfig(seq_len=6, d_model=16, n_head=2, batch=32, steps=1, eval_size=256, seed=1,
                     pos="learned")
    _, result = train(cfg, progress=False)
    assert result.accuracy < 0.4, result


def test_make_batch_reverses():
    ids, tgt = make_batch(np.random.default_rng(0), 4, 7, 10)
    np.testing.assert_array_equal(tgt, ids[:, ::-1])
    assert ids.shape == (4, 7) and ids.min() >= 0 and ids.max() < 10


def test_make_batch_draws_every_digit():
    """512 uniform draws of 10 digits: each of 0 .. 9 is among them (a range short by one at
    either end never drew 0, or 9)."""
    ids, _ = make_batch(np.random.default_rng(0), 64, 8, 10)
    assert sorted(np.unique(ids).tolist()) == list(range(10))


@pytest.mark.parametrize("pos", ["learned", "sinusoidal"])
def test_parameter_count_by_hand(pos):
    """V = 10, D = 8, L = 4: embedding and output weight V x D each, output bias V, learned
    positions L x D, the attention's four D x D weights and four biases of D."""
    model = ReverseModel(DemoConfig(seq_len=4, d_model=8, n_head=2, pos=pos))
    positions = 4 * 8 if pos == "learned" else 0
    assert model.n_params() == 10 * 8 + 10 * 8 + 10 + positions + 4 * (8 * 8 + 8)


def test_training_steps_rates_and_the_held_out_batch(monkeypatch):
    """``steps`` Adam steps on batches of ``batch``, each at a rate that falls along a cosine
    from ``lr`` toward 10 % of it, then one fresh batch of ``eval_size``; the result's
    accuracy and loss are those of the trained model on that batch, recomputed here."""
    rates, batches = [], []
    adam_step, make = nn.adam_step, demo.make_batch

    def recording_adam_step(params, grads, state, *, lr, **kwargs):
        rates.append(lr)
        return adam_step(params, grads, state, lr=lr, **kwargs)

    def recording_make_batch(*args):
        batches.append(make(*args))
        return batches[-1]

    monkeypatch.setattr(nn, "adam_step", recording_adam_step)
    monkeypatch.setattr(demo, "make_batch", recording_make_batch)
    cfg = DemoConfig(seq_len=3, d_model=8, n_head=2, batch=5, steps=4, lr=0.02, eval_size=7,
                     dtype="float64", seed=2)
    model, result = train(cfg, progress=False)
    # at step s of 4 the rate is lr (0.55 + 0.45 cos(pi s / 4)): cos is 1, sqrt(1/2), 0, -sqrt(1/2)
    h = 0.45 * math.sqrt(0.5)
    np.testing.assert_allclose(rates, [0.02, 0.02 * (0.55 + h), 0.02 * 0.55, 0.02 * (0.55 - h)],
                               rtol=1e-12)
    assert [ids.shape for ids, _ in batches] == [(5, 3)] * 4 + [(7, 3)]
    assert result.steps == 4
    ids, tgt = batches[-1]  # [7, 3] each
    logits = to_numpy(model.forward(from_numpy(ids, model.xp)))  # [7, 3, V]
    logp = logits - np.log(np.exp(logits).sum(axis=-1, keepdims=True))
    picked = np.take_along_axis(logp, tgt[..., None], axis=-1)  # [7, 3, 1]
    assert result.final_loss == pytest.approx(-picked.mean(), rel=1e-12)
    assert result.accuracy == np.mean(logits.argmax(axis=-1) == tgt)


def test_the_progress_note_is_the_last_batch_s_at_the_end(monkeypatch):
    """The note (batch loss and accuracy) is renewed every 10 steps and at the last one, so the
    bar ends on the last training batch's numbers, not those of step 10; each note's loss and
    token accuracy are those of that step's logits against its reversed targets, recomputed
    here."""
    notes, done, batches, logits = [], [0], [], []
    make, forward = demo.make_batch, ReverseModel.forward

    class RecordingBar(demo.ProgressBar):
        def update(self, n=1, note=None):
            if note is not None:
                notes.append((done[0], note))  # the steps done before this note
            done[0] += n
            super().update(n, note)

    def recording_make_batch(*args):
        batches.append(make(*args))
        return batches[-1]

    def recording_forward(self, ids, **kwargs):
        out = forward(self, ids, **kwargs)
        logits.append(to_numpy(out))
        return out

    monkeypatch.setattr(demo, "ProgressBar", RecordingBar)
    monkeypatch.setattr(demo, "make_batch", recording_make_batch)
    monkeypatch.setattr(ReverseModel, "forward", recording_forward)
    train(DemoConfig(seq_len=3, d_model=8, n_head=2, batch=4, steps=12, eval_size=4, dtype="float64"),
          progress=False)
    assert [step for step, _ in notes] == [0, 10, 11]
    for step, note in notes:
        z, tgt = logits[step], batches[step][1]  # [4, 3, V], [4, 3]
        logp = z - np.log(np.exp(z).sum(axis=-1, keepdims=True))
        loss = -np.take_along_axis(logp, tgt[..., None], axis=-1).mean()
        acc = np.mean(z.argmax(axis=-1) == tgt)
        shown = re.fullmatch(r"batch loss (\S+)  batch acc (\S+)", note)
        assert shown and float(shown[1]) == pytest.approx(loss, abs=1e-4), note
        assert float(shown[2]) == pytest.approx(acc, abs=1e-3), note


def test_format_table_rows():
    r = TrainResult(n_head=2, final_loss=0.25, accuracy=0.875, seconds=3.21, n_params=490, steps=600)
    header, row = demo.format_table([(r, 8)]).splitlines()
    assert header.split() == ["heads", "head", "dim", "final", "loss", "accuracy", "time", "(s)",
                              "params"]
    assert row.split() == ["2", "4", "0.2500", "0.8750", "3.2", "490"]


@pytest.mark.parametrize("field,value,error", [
    ("steps", -1, ValueError),  # trained nothing and reported steps=-1
    ("steps", 2.5, TypeError),  # range()'s "'float' object cannot be interpreted as an integer"
    ("batch", 0, ValueError),  # "query: expected a batch size (axis 0) of at least 1"
    ("eval_size", 0, ValueError),  # the same, after training
    ("seq_len", "4", TypeError),
    ("vocab", 0, ValueError),  # failed in the first batch's draw, without naming the field
])
def test_train_refuses_a_size_that_is_not_a_positive_int(field, value, error):
    """As the command's flags (and the gpt demo's train): each size a positive int, told by
    its field before a model is built."""
    cfg = DemoConfig(**{"seq_len": 4, "d_model": 8, "n_head": 2, "steps": 1, field: value})
    with pytest.raises(error, match=rf"^cfg\.{field}: expected a positive int, got .*{value!r}"):
        train(cfg, progress=False)


def test_bad_pos_is_rejected():
    with pytest.raises(ValueError, match="^pos: expected 'learned' or 'sinusoidal', got 'rotary'$"):
        ReverseModel(DemoConfig(pos="rotary"))


@pytest.mark.parametrize("H, grid", [(1, (1, 1)), (2, (1, 2)), (3, (1, 3)), (4, (1, 4)),
                                     (5, (2, 4)), (6, (2, 4)), (8, (2, 4)), (12, (3, 4))])
def test_heads_are_laid_out_in_rows_of_four(H, grid):
    from npattn.tools.demo import grid_shape

    assert grid_shape(H) == grid


@pytest.mark.parametrize("value,error", [(0, ValueError), (-4, ValueError), (2.0, TypeError)])
def test_grid_shape_refuses_a_head_count_that_is_not_positive(value, error):
    """0 heads divided by zero columns; -4 gave a grid of (1, -4), 2.0 one of (1.0, 2.0)."""
    from npattn.tools.demo import grid_shape

    with pytest.raises(error, match=rf"^n_head: expected a positive int, got .*{value!r}"):
        grid_shape(value)


@pytest.mark.parametrize("shape", [(0, 6, 6), (6, 6), (2, 6, 5)])
def test_heatmap_figure_refuses_weights_that_are_not_heads_of_square_maps(shape):
    """No head at all divided by zero in the grid (and left the colorbar's image undefined)."""
    from npattn.tools.demo import heatmap_figure

    with pytest.raises(ValueError, match=r"^weights: expected shape \(H, L, L\) with H >= 1, got "
                                         + re.escape(f"shape {shape}")):
        heatmap_figure(np.zeros(shape), list(range(6)))


def test_combined_heatmap_has_a_grid_a_colorbar_and_position_ticks():
    pytest.importorskip("matplotlib")
    from npattn.tools.demo import heatmap_figure

    L = 6
    w = np.random.default_rng(0).dirichlet(np.ones(L), size=(8, L))  # [H, L, L]
    fig = heatmap_figure(w, [3, 1, 4, 1, 5, 9])
    width, height = fig.get_size_inches()
    assert 1.0 <= width / height <= 2.5  # a 2 x 4 grid, not one long row
    images = [im for ax in fig.axes for im in ax.get_images()]
    assert len(images) == 8
    assert sum(im.colorbar is not None for im in images) == 1  # one colorbar for all heads
    assert len(fig.axes) == 8 + 1  # the heads and the colorbar's axis
    heads = [ax for ax in fig.axes if ax.get_images()]
    for ax in heads:
        ticks = [t.get_text() for t in ax.get_xticklabels()]
        assert ticks == [str(i) for i in range(L)]  # positions, as the axis labels say
    assert {ax.get_xlabel() for ax in heads} <= {"key position", ""}
    assert {ax.get_ylabel() for ax in heads} <= {"query position", ""}
    assert "3 1 4 1 5 9" in fig.get_suptitle()  # the digits, by position


def test_each_head_shows_its_own_weights_on_one_scale():
    """Head h's panel is weights[h] (rows the queries), titled "head h", coloured on [0, 1];
    at L = 12 every position is ticked."""
    pytest.importorskip("matplotlib")
    from npattn.tools.demo import heatmap_figure

    L = 12
    w = np.random.default_rng(1).dirichlet(np.ones(L), size=(3, L))  # [H, L, L]
    heads = [ax for ax in heatmap_figure(w, list(range(L))).axes if ax.get_images()]
    assert len(heads) == 3
    for h, ax in enumerate(heads):
        (im,) = ax.get_images()
        np.testing.assert_array_equal(im.get_array(), w[h])
        assert im.get_clim() == (0.0, 1.0)
        assert ax.get_title() == f"head {h}"
        assert [t.get_text() for t in ax.get_yticklabels()] == [str(i) for i in range(L)]


def test_saved_heatmaps_are_the_model_s_weights_on_the_seeded_sequence(tmp_path, monkeypatch):
    """Each attention_head{h}.png draws head h, attention_heads.png all heads, of the sequence
    that ``seed`` draws, recomputed here from the model; each head's figure is titled with
    its head and the sequence's digits, its one panel left untitled."""
    pytest.importorskip("matplotlib")
    drawn = []
    figure = demo.heatmap_figure

    def recording_figure(weights, digits, **kwargs):
        fig = figure(weights, digits, **kwargs)
        drawn.append((np.array(weights), list(digits), fig))
        return fig

    monkeypatch.setattr(demo, "heatmap_figure", recording_figure)
    model = ReverseModel(DemoConfig(seq_len=5, d_model=8, n_head=2, seed=4))
    demo.save_heatmaps(model, str(tmp_path), seed=7)
    ids, _ = make_batch(np.random.default_rng(7), 1, 5, 10)  # [1, L]
    _, w = model.forward(from_numpy(ids, model.xp), need_weights=True)  # [1, H, L, L]
    w = to_numpy(w)[0]
    assert len(drawn) == 3
    sequence = " ".join(str(d) for d in ids[0])
    for h, (weights, digits, fig) in enumerate(drawn[:2]):
        np.testing.assert_array_equal(weights, w[h:h + 1])
        assert digits == ids[0].tolist()
        title = fig.get_suptitle()
        assert title.startswith(f"head {h} of 2") and sequence in title, title
        assert fig.axes[0].get_title() == ""  # the figure's title names the head, once
    np.testing.assert_array_equal(drawn[2][0], w)


def test_saved_heatmaps_of_eight_heads_are_a_grid(tmp_path):
    pytest.importorskip("matplotlib")
    import matplotlib
    import matplotlib.image

    from npattn.tools.demo import save_heatmaps

    backend = matplotlib.get_backend()
    model = ReverseModel(DemoConfig(seq_len=12, d_model=16, n_head=8))
    paths = save_heatmaps(model, str(tmp_path))
    assert len(paths) == 9 and paths[-1].endswith("attention_heads.png")
    height, width = matplotlib.image.imread(paths[-1]).shape[:2]
    assert 1.0 <= width / height <= 2.5, (width, height)  # was 2710 x 431
    h0, w0 = matplotlib.image.imread(paths[0]).shape[:2]
    assert 0.7 <= w0 / h0 <= 1.5, (w0, h0)
    assert matplotlib.get_backend() == backend


@pytest.mark.skipif(importlib.util.find_spec("matplotlib") is None, reason="needs matplotlib")
def test_save_heatmaps_leaves_the_callers_matplotlib_backend(tmp_path):
    """The figures are drawn without pyplot: the caller's backend and figures stay as they were."""
    code = textwrap.dedent(
        """
        import os, sys
        import matplotlib
        matplotlib.use("pdf")  # the caller's choice, not Agg
        import matplotlib.pyplot as plt
        plt.figure()  # a figure of the caller's, open
        from npattn.tools.demo import DemoConfig, ReverseModel, save_heatmaps
        model = ReverseModel(DemoConfig(seq_len=4, d_model=8, n_head=2, seed=0))
        paths = save_heatmaps(model, sys.argv[1])
        assert all(os.path.getsize(p) > 0 for p in paths), paths
        print(matplotlib.get_backend(), plt.get_fignums(), len(paths))
        """
    )
    env = {k: v for k, v in os.environ.items() if k != "MPLBACKEND"}
    run = subprocess.run([sys.executable, "-c", code, str(tmp_path / "maps")], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    assert run.stdout.split() == ["pdf", "[1]", "3"], run.stdout


@pytest.mark.parametrize("pos", ["learned", "sinusoidal"])
def test_the_positions_added_are_the_learned_table_or_the_sinusoidal_encoding(monkeypatch, pos):
    """Step 2, x = e + pos: with learned positions ``pos`` is the parameter (L, D); with
    sinusoidal ones pe[i, 2k] = sin(i / 10000^(2k/D)) and pe[i, 2k+1] = cos(i / 10000^(2k/D)),
    recomputed here (a wrong or zero encoding leaves the gradients right but the model blind
    to positions)."""
    added = []
    add_positions = nn.add_positions_forward

    def recording(x, pos):
        added.append(to_numpy(pos))
        return add_positions(x, pos)

    monkeypatch.setattr(nn, "add_positions_forward", recording)
    L, D = 5, 6
    model = ReverseModel(DemoConfig(seq_len=L, d_model=D, n_head=2, pos=pos, dtype="float64"))
    ids, _ = make_batch(np.random.default_rng(0), 2, L, 10)
    model.forward(from_numpy(ids, model.xp))
    (got,) = added
    if pos == "learned":
        np.testing.assert_array_equal(got, to_numpy(model.all_params()["pos"]))
    else:
        angle = np.arange(L)[:, None] / 10000.0 ** (2 * (np.arange(D)[None, :] // 2) / D)  # [L, D]
        expected = np.where(np.arange(D) % 2 == 0, np.sin(angle), np.cos(angle))
        np.testing.assert_allclose(got, expected, rtol=1e-12, atol=1e-15)


def test_axis_labels_sit_under_each_column_and_left_of_each_row():
    """Five heads in a 2 x 4 grid: "key position" under the lowest head of each column (heads
    1-3, whose cell below is empty, and head 4), "query position" left of the first head of
    each row (heads 0 and 4); the three cells without a head are hidden."""
    pytest.importorskip("matplotlib")
    from npattn.tools.demo import heatmap_figure

    w = np.random.default_rng(2).dirichlet(np.ones(4), size=(5, 4))  # [H, L, L]
    fig = heatmap_figure(w, [1, 2, 3, 4])
    heads = [ax for ax in fig.axes if ax.get_images()]
    assert [ax.get_xlabel() for ax in heads] == ["", "key position", "key position", "key position",
                                                 "key position"]
    assert [ax.get_ylabel() for ax in heads] == ["query position", "", "", "", "query position"]
    empty = [ax for ax in fig.axes[:8] if not ax.get_images()]  # the grid's cells, then the colorbar
    assert len(empty) == 3 and not any(ax.axison for ax in empty)


def _recording_make_batch(monkeypatch):
    """The ids of every batch ``demo.make_batch`` draws, in order."""
    drawn = []
    make = demo.make_batch

    def recording(*args):
        drawn.append(make(*args))
        return drawn[-1]

    monkeypatch.setattr(demo, "make_batch", recording)
    return drawn


def test_the_seed_draws_the_parameters_and_the_batches(monkeypatch):
    """One seed gives the same parameters and the same training batches; another seed other
    parameters of each kind (the embedding, positions and output projection drawn on the host,
    the attention's from a seed of its own) and other batches."""
    params = []
    for seed in (4, 4, 5):
        model = ReverseModel(DemoConfig(seq_len=4, d_model=8, n_head=2, seed=seed, pos="learned"))
        params.append({k: to_numpy(v) for k, v in model.all_params().items()})
    for name in params[0]:
        np.testing.assert_array_equal(params[0][name], params[1][name], err_msg=name)
    for name in ("embed", "pos", "out.w", "attn.w_q", "attn.w_o"):
        assert not np.array_equal(params[0][name], params[2][name]), name
    batches = []
    for seed in (4, 4, 5):
        drawn = _recording_make_batch(monkeypatch)
        train(DemoConfig(seq_len=4, d_model=8, n_head=2, batch=3, steps=2, eval_size=3, seed=seed),
              progress=False)
        batches.append([ids.tolist() for ids, _ in drawn])
    assert batches[0] == batches[1] and len(batches[0]) == 3
    assert all(a != b for a, b in zip(batches[0], batches[2]))


def test_the_held_out_batch_is_none_of_the_training_sequences(monkeypatch):
    """The result is measured on sequences drawn after the training ones, from the same stream:
    none of them is a sequence the model was trained on (10^6 sequences of 6 digits, 24 drawn)."""
    drawn = _recording_make_batch(monkeypatch)
    train(DemoConfig(seq_len=6, d_model=8, n_head=2, batch=4, steps=4, eval_size=8, seed=1),
          progress=False)
    *training, (held_out, _) = drawn
    seen = {tuple(row) for ids, _ in training for row in ids.tolist()}
    assert len(training) == 4 and len(seen) == 16
    assert not seen & {tuple(row) for row in held_out.tolist()}


def test_one_seed_trains_alike_on_every_backend(backend):
    """The parameters are drawn and the batches made on the host from the seed, so a run ends
    with the same loss and accuracy on every backend."""
    cfg = DemoConfig(seq_len=4, d_model=8, n_head=2, batch=8, steps=5, eval_size=16,
                     dtype="float64", seed=3)
    _, ref = train(cfg, progress=False)
    cfg.backend = backend
    _, other = train(cfg, progress=False)
    assert other.final_loss == pytest.approx(ref.final_loss, rel=1e-9)
    assert other.accuracy == ref.accuracy


def test_the_reported_time_is_that_of_the_training_steps(step_clock):
    """``seconds`` is the wall time from the first training step to the last one's end, here on
    a clock that advances 0.25 s in each of 4 Adam steps."""
    step_clock(demo, nn, "adam_step", 0.25)
    _, result = train(DemoConfig(seq_len=3, d_model=8, n_head=2, batch=2, steps=4, eval_size=2),
                      progress=False)
    assert result.seconds == 1.0


class _FakeTerminal(io.StringIO):
    def isatty(self):
        return True


def test_progress_false_draws_no_bar_even_on_a_terminal():
    cfg = DemoConfig(seq_len=3, d_model=8, n_head=2, batch=2, steps=2, eval_size=2)
    quiet, shown = _FakeTerminal(), _FakeTerminal()
    train(cfg, progress=False, stream=quiet)
    train(cfg, progress=True, stream=shown)
    assert quiet.getvalue() == ""
    assert "demo H=2" in shown.getvalue() and "2/2" in shown.getvalue()


def test_past_twelve_positions_every_other_one_is_ticked():
    """At L = 13 the ticks are the even positions 0, 2, ..., 12, on both axes."""
    pytest.importorskip("matplotlib")
    from npattn.tools.demo import heatmap_figure

    L = 13
    w = np.random.default_rng(3).dirichlet(np.ones(L), size=(2, L))  # [H, L, L]
    heads = [ax for ax in heatmap_figure(w, list(range(L))).axes if ax.get_images()]
    for ax in heads:
        even = [str(i) for i in range(0, L, 2)]
        assert [t.get_text() for t in ax.get_xticklabels()] == even
        assert [t.get_text() for t in ax.get_yticklabels()] == even


def test_the_gradient_adam_is_given_is_that_of_the_batch_s_mean_loss(monkeypatch):
    """The first step hands Adam the gradient of the mean cross-entropy of its batch at the
    initial parameters (Adam would hide a gradient scaled by a constant, the model would still
    learn): checked here by finite differences in float64."""
    given, drawn = [], _recording_make_batch(monkeypatch)
    adam_step = nn.adam_step

    def recording_adam_step(params, grads, state, **kwargs):
        given.append((dict(params), dict(grads)))
        return adam_step(params, grads, state, **kwargs)

    monkeypatch.setattr(nn, "adam_step", recording_adam_step)
    cfg = DemoConfig(seq_len=4, d_model=8, n_head=2, batch=3, steps=1, eval_size=2, dtype="float64",
                     seed=5)
    train(cfg, progress=False)
    (params, grads), (ids_h, tgt_h) = given[0], drawn[0]
    model = ReverseModel(cfg)
    ids, tgt = from_numpy(ids_h, model.xp), from_numpy(tgt_h, model.xp)
    names = sorted(params)

    def loss_of(*ps):
        model.set_params(dict(zip(names, ps)))
        return nn.cross_entropy_forward(model.forward(ids), tgt)[0]

    report = check_vjp(loss_of, [params[n] for n in names], [grads[n] for n in names],
                       from_numpy(np.asarray(1.0), model.xp), names=names, n_directions=2, rtol=1e-6)
    assert report.ok, str(report)


def test_the_command_s_defaults_are_the_config_s(tmp_path, command_config):
    """``npattn demo`` with no options trains ``DemoConfig()`` (12 digits, sinusoidal positions,
    400 steps, as docs/demo.md runs it): a script that builds the config gets the command's run."""
    cfg = command_config(demo, ["demo", "--no-plots", "--no-progress", "--out", str(tmp_path)])
    assert cfg == DemoConfig()
    assert (cfg.seq_len, cfg.pos, cfg.steps, cfg.n_head) == (12, "sinusoidal", 400, 4)
    # and the rest of docs/demo.md's defaults: 10 digits, batches of 64, 1024 held-out sequences
    assert (cfg.vocab, cfg.d_model, cfg.batch, cfg.lr, cfg.dtype, cfg.backend, cfg.seed, cfg.eval_size) == (
        10, 32, 64, 1e-2, "float32", "numpy", 0, 1024)


def test_on_dask_a_printed_step_and_the_result_run_the_forward_once_each(monkeypatch):
    """On dask the loss and the accuracy a step prints, and the result's, are read in one
    graph: each ran its own forward before (five passes over the logits for this one step,
    where three: the step's gradients and update, the printed numbers, the result's).
    The numbers are NumPy's."""
    pytest.importorskip("dask.array", reason="needs dask: pip install '.[dask]'")
    import dask

    calls = count_forward_runs(monkeypatch, ReverseModel)  # the logits' runs
    kw = dict(seq_len=4, vocab=5, d_model=8, n_head=2, batch=3, steps=1, eval_size=4, dtype="float64")
    _, want = train(DemoConfig(**kw), progress=False)
    with dask.config.set(scheduler="sync"):  # the calls are counted in this process
        _, got = train(DemoConfig(backend="dask", **kw), progress=False)
    assert len(calls) == 3, calls
    np.testing.assert_allclose(got.final_loss, want.final_loss, rtol=1e-12)
    assert got.accuracy == want.accuracy
