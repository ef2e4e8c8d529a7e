"""The demo model: its composed backward against finite differences, and that it learns."""

import importlib.util
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from npattn import nn
from npattn.backend import from_numpy, resolve_backend
from npattn.tools.demo import DemoConfig, ReverseModel, make_batch, train
from npattn.gradcheck import check_vjp

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
    cfg = DemoConfig(seq_len=6, d_model=16, n_head=2, batch=32, steps=150, eval_size=256, seed=1)
    model, result = train(cfg, progress=False)
    assert result.accuracy >= 0.95, result
    assert result.final_loss < 0.2, result
    assert result.n_params == model.n_params() > 0


def test_untrained_model_is_at_chance():
    """The held-out accuracy starts near 1/10, so the learning test above is not trivial."""
    cfg = DemoConfig(seq_len=6, d_model=16, n_head=2, batch=32, steps=1, eval_size=256, seed=1)
    _, result = train(cfg, progress=False)
    assert result.accuracy < 0.4, result


def test_make_batch_reverses():
    ids, tgt = make_batch(np.random.default_rng(0), 4, 7, 10)
    np.testing.assert_array_equal(tgt, ids[:, ::-1])
    assert ids.shape == (4, 7) and ids.min() >= 0 and ids.max() < 10


def test_bad_pos_is_rejected():
    with pytest.raises(ValueError, match="pos: expected 'learned' or 'sinusoidal'"):
        ReverseModel(DemoConfig(pos="rotary"))


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
