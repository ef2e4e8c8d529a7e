"""npattn demo --task gpt: the corpus, the codec, a short training run, the plot and the samples."""

import inspect
import math
from pathlib import Path

import numpy as np
import pytest

from npattn.backend import backend_name, from_numpy, to_numpy
from npattn.gpt import GPT
from npattn.tools import demo_gpt
from npattn.tools.demo_gpt import (
    CharCodec,
    GPTDemoConfig,
    GPTHistory,
    corpus,
    evaluate,
    format_summary,
    generate_samples,
    save_loss_plot,
    train,
)

SMALL = dict(block_size=16, d_model=32, n_layer=2, n_head=2, batch=16, steps=80, lr=1e-2,
             warmup=10, eval_every=40, eval_batches=2)


def test_the_corpus_is_npattns_docstrings():
    text = corpus()
    assert len(text) > 50_000
    assert "Multi-head attention" in text or "multi-head attention" in text
    assert "def " not in text.split("\n")[0]  # prose, not source lines
    assert corpus() == text  # the same text every time: a seeded run is reproducible


def test_the_corpus_holds_module_class_and_function_docstrings():
    text = corpus()
    for obj in (demo_gpt, CharCodec, generate_samples):
        assert inspect.cleandoc(obj.__doc__) in text, obj


def test_codec_ids_are_the_sorted_characters():
    """The ids follow the sorted characters, the same in every process (a set's order is not)."""
    codec = CharCodec("cabbage")
    assert codec.chars == ["a", "b", "c", "e", "g"]
    np.testing.assert_array_equal(codec.encode("gcab"), [4, 2, 0, 1])


def test_codec_round_trip_and_unknown_characters():
    codec = CharCodec("hello world")
    assert codec.vocab_size == 8
    ids = codec.encode("low")
    assert codec.decode(ids) == "low"
    with pytest.raises(ValueError, match="text"):
        codec.encode("xyz")


def test_a_short_run_learns_the_character_statistics(tmp_path):
    cfg = GPTDemoConfig(**SMALL)
    model, codec, hist = train(cfg, progress=False)
    assert len(hist.train_loss) == cfg.steps and hist.val_steps == [40, 80]
    uniform = math.log(codec.vocab_size)
    assert abs(hist.train_loss[0] - uniform) < 0.3  # starts about uniform
    # unigram entropy of the text is about 3.3 nats below uniform 4.5; 80 steps get well below uniform
    assert hist.val_loss[-1] < uniform - 1.0, hist.val_loss
    samples = generate_samples(model, codec, prompts=("The ",), length=40, seed=0)  # > block_size
    assert samples[0][1].startswith("The ") and len(samples[0][1]) == 44
    again = generate_samples(model, codec, prompts=("The ",), length=40, seed=0)
    assert again == samples  # seeded
    pytest.importorskip("matplotlib")
    path = save_loss_plot(hist, str(tmp_path / "loss.png"))
    with open(path, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    assert "validation loss" in format_summary(cfg, hist)


TINY = dict(block_size=4, d_model=8, n_layer=1, n_head=2, batch=2, steps=5, lr=0.01, warmup=2,
            max_grad_norm=0.5, eval_every=2, eval_batches=3, dtype="float64")


def _record_training(monkeypatch):
    """The windows, rates and clipping norms of each training step, and the windows each
    evaluation-mode loss is taken on."""
    steps, evaluated = [], []
    training_step, loss = demo_gpt.training_step, GPT.loss

    def recording_step(model, state, ids, targets, *, lr, max_grad_norm, **kwargs):
        steps.append((to_numpy(ids), to_numpy(targets), lr, max_grad_norm))
        return training_step(model, state, ids, targets, lr=lr, max_grad_norm=max_grad_norm,
                             **kwargs)

    def recording_loss(self, ids, targets, **kwargs):
        if not self.training:
            evaluated.append((to_numpy(ids), to_numpy(targets)))
        return loss(self, ids, targets, **kwargs)

    monkeypatch.setattr(demo_gpt, "training_step", recording_step)
    monkeypatch.setattr(GPT, "loss", recording_loss)
    return steps, evaluated


def test_training_windows_rates_and_the_held_out_part(monkeypatch):
    """"abcdefghij" at block_size 4: the held-out part is the last 5 characters (a window and
    its target), so every training window is "abcd" with targets "bcde" and every validation
    window "fghi" with "ghij". Warm-up over 2 steps, then a cosine from lr to 10 % of it over
    the other 3; each step clipped at max_grad_norm; 3 validation batches after steps 2, 4, 5."""
    steps, evaluated = _record_training(monkeypatch)
    model, codec, hist = train(GPTDemoConfig(**TINY), text="abcdefghij", progress=False)
    assert len(steps) == 5
    for x, y, _, norm in steps:
        assert [codec.decode(row) for row in x] == ["abcd"] * 2
        assert [codec.decode(row) for row in y] == ["bcde"] * 2
        assert norm == 0.5
    # warm-up: lr / 2, lr; then t = 0, 1/3, 2/3 of the decay: 0.1 + 0.45 (1 + cos(pi t)) of lr
    np.testing.assert_allclose([lr for *_, lr, _ in steps],
                               [0.005, 0.01, 0.01, 0.01 * 0.775, 0.01 * 0.325], rtol=1e-12)
    assert hist.val_steps == [2, 4, 5] and len(evaluated) == 3 * 3
    for x, y in evaluated:
        assert [codec.decode(row) for row in x] == ["fghi"] * 2
        assert [codec.decode(row) for row in y] == ["ghij"] * 2
    assert (hist.train_chars, hist.val_chars, hist.vocab) == (5, 5, 10)
    with pytest.raises(ValueError, match=r"^text: expected at least 10 characters for block_size 4 .* got 9"):
        train(GPTDemoConfig(**TINY), text="abcdefghi", progress=False)


def test_validation_batches_differ_and_are_the_same_at_every_evaluation(monkeypatch):
    """Each of the eval_batches is drawn on its own (one draw repeated would be one batch)."""
    _, evaluated = _record_training(monkeypatch)
    text = "".join(chr(97 + i % 23) for i in range(400))
    hist = train(GPTDemoConfig(**{**TINY, "eval_every": 3}), text=text, progress=False)[2]
    assert hist.val_steps == [3, 5] and len(evaluated) == 6
    assert (hist.train_chars, hist.val_chars, hist.vocab) == (360, 40, 23)  # 23 distinct characters
    first = [x.tolist() for x, _ in evaluated[:3]]
    assert first == [x.tolist() for x, _ in evaluated[3:]]
    assert first[0] != first[1] or first[1] != first[2]


def test_train_takes_the_config_s_model_settings():
    cfg = GPTDemoConfig(**{**TINY, "steps": 1, "eval_every": 1, "dropout": 0.25,
                           "backend": "array_api_strict"})
    model = train(cfg, text="abcdefghij" * 3, progress=False)[0]
    assert (model.block_size, model.d_model, model.n_layer, model.n_head) == (4, 8, 1, 2)
    assert model.dropout == 0.25 and model.dtype == model.xp.float64
    assert backend_name(model.xp) == "array_api_strict"
    other = train(GPTDemoConfig(**{**TINY, "steps": 1, "seed": 1}), text="abcdefghij" * 3,
                  progress=False)[2]
    same = train(GPTDemoConfig(**{**TINY, "steps": 1, "seed": 0}), text="abcdefghij" * 3,
                 progress=False)[2]
    assert other.train_loss != same.train_loss  # the seed draws the weights and windows


@pytest.mark.parametrize("field", ["block_size", "steps", "eval_every", "eval_batches", "batch"])
@pytest.mark.parametrize("value, error", [(0, ValueError), (2.5, TypeError)])
def test_train_refuses_a_size_that_is_not_a_positive_int(field, value, error):
    """As the reverse demo's train: steps=2.5 failed in the progress bar as "total: expected an
    int >= 0" after the model was built, eval_every=2.5 evaluated at every fifth step."""
    with pytest.raises(error, match=rf"^cfg\.{field}: expected a positive int, got .*{value!r}"):
        train(GPTDemoConfig(**{**TINY, field: value}), text="abcdefghij", progress=False)


@pytest.mark.parametrize("training", [True, False])
def test_evaluate_is_the_mean_loss_with_dropout_off(training):
    model = GPT(5, 4, 8, 1, 2, dropout=0.5, dtype="float64", seed=1)
    rng = np.random.default_rng(0)
    batches = [(rng.integers(0, 5, (2, 4)), rng.integers(0, 5, (2, 4))) for _ in range(3)]
    model.eval()
    losses = [model.loss(from_numpy(x, model.xp), from_numpy(y, model.xp))[0] for x, y in batches]
    model.train(training)
    assert evaluate(model, batches) == pytest.approx(sum(losses) / 3, rel=1e-12)
    assert model.training is training


def _generate_calls(monkeypatch, codec):
    """The list that every ``GPT.generate`` call from now on appends its (prompt text, n) to."""
    calls = []
    generate = GPT.generate

    def recording_generate(self, ids, n, **kwargs):
        calls.append((codec.decode(to_numpy(ids)), n))
        return generate(self, ids, n, **kwargs)

    monkeypatch.setattr(GPT, "generate", recording_generate)
    return calls


def test_samples_go_on_from_the_last_half_context(monkeypatch):
    """block_size 4: each generate call starts from the last 2 characters of the text so far
    and adds at most 3 (2 + 3 - 1 = 4 positions)."""
    codec = CharCodec("abcdefgh")
    model = GPT(codec.vocab_size, 4, 8, 1, 2, seed=0)
    calls = _generate_calls(monkeypatch, codec)
    ((prompt, text),) = generate_samples(model, codec, prompts=("abcdef",), length=7, seed=0)
    assert text.startswith("abcdef") and len(text) == 13
    assert [n for _, n in calls] == [3, 3, 1]
    done = 6
    for prompt_ids, n in calls:
        assert prompt_ids == text[done - 2:done]
        done += n
    other = generate_samples(model, codec, prompts=("abcdef",), length=7, seed=1)
    assert other != [(prompt, text)]


def test_a_sample_is_its_prompt_then_the_tokens_each_generate_call_added(monkeypatch):
    """block_size 4, 7 characters after "abcdef": three generate calls add 3, 3 and 1 tokens
    after their prompts, and the sample is the prompt followed by exactly those, in order
    (not a prompt token again, nor one added token short)."""
    codec = CharCodec("abcdefgh")
    model = GPT(codec.vocab_size, 4, 8, 1, 2, seed=0)
    added = []
    generate = GPT.generate

    def recording_generate(self, ids, n, **kwargs):
        out = generate(self, ids, n, **kwargs)
        added.append(codec.decode(to_numpy(out)[0, ids.shape[1]:]))
        return out

    monkeypatch.setattr(GPT, "generate", recording_generate)
    ((prompt, text),) = generate_samples(model, codec, prompts=("abcdef",), length=7, seed=0)
    assert [len(a) for a in added] == [3, 3, 1]
    assert text == "abcdef" + "".join(added)


def test_the_command_s_samples_are_drawn_as_their_heading_says(tmp_path, monkeypatch, capsys):
    """samples.txt heads each sample "(temperature 0.8, top-k 10)": the values generate got."""
    from npattn.tools import cli

    seen = []
    generate = GPT.generate

    def recording_generate(self, ids, n, **kwargs):
        seen.append((kwargs["temperature"], kwargs["top_k"]))
        return generate(self, ids, n, **kwargs)

    monkeypatch.setattr(GPT, "generate", recording_generate)
    out = tmp_path / "gpt"
    assert cli.main(["demo", "--task", "gpt", "--steps", "1", "--seq-len", "64", "--d-model", "8",
                     "--layers", "1", "--heads", "2", "--batch", "1", "--no-progress",
                     "--no-plots", "--out", str(out)]) == 0
    assert set(seen) == {(0.8, 10)}
    assert (out / "samples.txt").read_text(encoding="utf-8").count("(temperature 0.8, top-k 10)") == 3


def _saved_figures(monkeypatch):
    """The list that every matplotlib Figure saved from now on is appended to (and saved)."""
    pytest.importorskip("matplotlib")
    from matplotlib.figure import Figure

    saved = []
    savefig = Figure.savefig

    def recording_savefig(self, *args, **kwargs):
        saved.append(self)
        return savefig(self, *args, **kwargs)

    monkeypatch.setattr(Figure, "savefig", recording_savefig)
    return saved


def test_the_loss_plot_draws_each_curve_at_its_steps(tmp_path, monkeypatch):
    """Step s's training loss is s - 1 here: the 50-step mean ending at step s is s - 25.5,
    drawn from step 50 on; the validation losses at their steps; the uniform level ln 8."""
    saved = _saved_figures(monkeypatch)
    hist = GPTHistory(train_loss=[float(i) for i in range(60)], val_steps=[30, 60],
                      val_loss=[2.0, 1.0], vocab=8)
    save_loss_plot(hist, str(tmp_path / "loss.png"))
    lines = {line.get_label(): line for line in saved[0].axes[0].get_lines()}
    batch, mean = lines["training batch"], lines["training, 50-step mean"]
    np.testing.assert_array_equal(batch.get_xdata(), np.arange(1, 61))
    np.testing.assert_array_equal(batch.get_ydata(), np.arange(60))
    np.testing.assert_array_equal(mean.get_xdata(), np.arange(50, 61))
    np.testing.assert_allclose(mean.get_ydata(), np.arange(50, 61) - 25.5, rtol=1e-12)
    val = lines["validation (held-out 10 %)"]
    assert list(val.get_xdata()) == [30, 60] and list(val.get_ydata()) == [2.0, 1.0]
    assert list(lines["uniform, ln 8"].get_ydata()) == [math.log(8)] * 2
    assert saved[0].axes[0].get_ylim()[0] == 0.0  # the loss axis starts at 0


def test_format_summary_by_hand():
    """60 steps in 3 s is 50 ms a step; the last 50 training losses are 1.0; ln 8 = 2.079."""
    hist = GPTHistory(train_loss=[3.0] * 10 + [1.0] * 50, val_steps=[30, 60], val_loss=[2.5, 1.5],
                      seconds=3.0, n_params=1234, vocab=8)
    assert format_summary(GPTDemoConfig(), hist) == (
        "60 steps in 3.0s (50 ms/step), 1234 parameters; final validation loss 1.500 nats/char "
        "(uniform 2.079), training loss (last 50 steps) 1.000")


def test_the_same_seed_gives_the_same_run():
    cfg = GPTDemoConfig(**{**SMALL, "steps": 5, "eval_every": 5})
    a = train(cfg, progress=False)[2]
    b = train(cfg, progress=False)[2]
    np.testing.assert_array_equal(a.train_loss, b.train_loss)
    assert a.val_loss == b.val_loss


def test_the_command_trains_and_writes_the_samples_and_the_loss_curve(tmp_path, capsys):
    from npattn.tools import cli

    out = tmp_path / "gpt"
    status = cli.main(["demo", "--task", "gpt", "--steps", "12", "--seq-len", "16", "--d-model", "16",
                       "--layers", "1", "--heads", "2", "--batch", "8", "--no-progress",
                       "--out", str(out)])
    assert status == 0
    text = capsys.readouterr().out
    assert "Character-level GPT on npattn's docstrings" in text and "12 steps in" in text
    samples = (out / "samples.txt").read_text(encoding="utf-8")
    assert samples.count("--- prompt") == 3 and "Returns the " in samples
    # the prompts and their headings are those of the samples shown in docs/gpt.md
    docs = (Path(__file__).resolve().parents[1] / "docs" / "gpt.md").read_text(encoding="utf-8")
    headings = [line for line in samples.splitlines() if line.startswith("--- prompt")]
    assert headings == [line for line in docs.splitlines() if line.startswith("--- prompt")]
    if (out / "loss.png").exists() or pytest.importorskip("matplotlib"):
        assert (out / "loss.png").read_bytes()[:4] == b"\x89PNG"


@pytest.mark.parametrize("extra, named", [
    (["--epochs", "2"], "--epochs: an option of --task digits, not of --task gpt"),
    (["--pos", "learned"], "--pos: an option of --task reverse, not of --task gpt"),
    (["--heads", "1,2"], "--heads: --task gpt trains one model"),
    (["--heads", "5"], "--heads: expected divisors of --d-model 96, got '5', where 5 does not divide it"),
])
def test_the_command_refuses_options_of_other_tasks(extra, named, tmp_path, capsys):
    from npattn.tools import cli

    with pytest.raises(SystemExit) as exc:
        cli.main(["demo", "--task", "gpt", "--out", str(tmp_path)] + extra)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert named in err, err


def test_the_largest_finite_lr_warms_up_without_overflow(monkeypatch, tmp_path, capsys):
    """--lr takes any positive finite number: the warm-up rate is a fraction of it, never
    lr * (step + 1), which overflowed to inf at the second step (1e308 * 2) and stopped the run
    with "--seq-len 64: lr: expected a finite number" (the wrong option named)."""
    from npattn.tools import cli

    steps, _ = _record_training(monkeypatch)
    with np.errstate(all="ignore"):  # such steps overflow the weights
        train(GPTDemoConfig(**{**TINY, "lr": 1e308}), text="abcdefghij", progress=False)
    np.testing.assert_allclose([lr for *_, lr, _ in steps],
                               [5e307, 1e308, 1e308, 0.775e308, 0.325e308], rtol=1e-12)
    # the command: the run diverges and says so, naming --lr (status 1), not --seq-len
    monkeypatch.undo()
    with np.errstate(all="ignore"):  # the weights overflow: that is the divergence reported
        status = cli.main(["demo", "--task", "gpt", "--lr", "1e308", "--steps", "3", "--d-model",
                           "8", "--layers", "1", "--heads", "2", "--batch", "2", "--seq-len", "8",
                           "--no-plots", "--no-progress", "--out", str(tmp_path / "g")])
    err = capsys.readouterr().err
    assert status == 1 and "training diverged" in err and "smaller --lr than 1e+308" in err, err
    assert "--seq-len" not in err


def test_edge_settings_do_not_fail_after_training(tmp_path, capsys):
    from npattn.tools import cli

    # a context of 2 and samples longer than it: each continuation is at least one character
    model, codec, _ = train(GPTDemoConfig(**{**SMALL, "block_size": 2, "steps": 3, "eval_every": 3}),
                            progress=False)
    (prompt, text), = generate_samples(model, codec, prompts=("The ",), length=7, seed=0)
    assert len(text) == len(prompt) + 7
    few = CharCodec("abcab")  # a vocabulary smaller than the default top-k of 10
    tiny = train(GPTDemoConfig(**{**SMALL, "block_size": 2, "steps": 2, "eval_every": 2}),
                 text="abcab" * 40, progress=False)[0]
    assert len(generate_samples(tiny, few, prompts=("ab",), length=5)[0][1]) == 7
    afile = tmp_path / "a-file"
    afile.write_text("x")
    status = cli.main(["demo", "--task", "gpt", "--no-plots", "--out", str(afile), "--steps", "1"])
    assert status == 2 and "--out" in capsys.readouterr().err  # refused before training
    with pytest.raises(SystemExit) as exc:  # a usage error, before any training
        cli.main(["demo", "--task", "gpt", "--seq-len", "150000", "--steps", "1",
                  "--out", str(tmp_path / "g"), "--no-progress", "--no-plots"])
    assert exc.value.code == 2 and "--seq-len" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        cli.main(["demo", "--task", "gpt", "--seq-len", "1", "--out", str(tmp_path)])
    with pytest.raises(ValueError, match="steps"):
        train(GPTDemoConfig(**{**SMALL, "steps": 0}), progress=False)


def test_a_context_or_a_step_too_large_is_a_usage_error(tmp_path, capsys, monkeypatch):
    """--seq-len 100000 trained for minutes and took 12 GB: its windows do not fit in the held-out
    tenth of the text. A step past the memory available is refused too, with its estimate."""
    from npattn.tools import cli, limits

    n = len(corpus())
    with pytest.raises(SystemExit) as exc:
        cli.main(["demo", "--task", "gpt", "--seq-len", "100000", "--out", str(tmp_path)])
    err = capsys.readouterr().err
    assert exc.value.code == 2
    assert "--seq-len" in err and f"at most {n // 10 - 1}, got 100000" in err, err
    # the memory: a context that the text takes, on a machine of 1 GiB
    monkeypatch.setattr(limits, "available_memory", lambda: 2**30)
    with pytest.raises(SystemExit) as exc:
        cli.main(["demo", "--task", "gpt", "--seq-len", "20000", "--out", str(tmp_path)])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and "--seq-len" in err and "20000" in err
    assert "1.0 GiB of memory available" in err and "needs at least" in err
    # 32 windows of 20000 characters: their logits alone (94 characters, float32) pass 1 GiB
    needed = float(err.split("needs at least ")[1].split(" GiB")[0])
    assert needed >= 32 * 20000 * len(set(corpus())) * 4 / 2**30
    # CuPy's arrays live on the device: the host's memory does not refuse them (where CuPy is
    # missing the run then stops at the backend instead)
    import importlib.util

    if importlib.util.find_spec("cupy") is None:
        assert cli.main(["demo", "--task", "gpt", "--seq-len", "20000", "--backend", "cupy",
                         "--out", str(tmp_path)]) != 0
        err = capsys.readouterr().err
        assert "cupy" in err and "memory available" not in err, err
    # the defaults fit in 1 GiB, and in the held-out text
    d = cli.DEMO_TASKS["gpt"]
    assert d["seq_len"] <= n // 10 - 1
    assert limits.gpt_training_bytes(d["batch"], d["seq_len"], d["seq_len"], d["d_model"], d["layers"],
                                     4, len(set(corpus())), 4) < 2**30


def test_skip_memory_check_trains_what_the_estimate_refuses(tmp_path, capsys, monkeypatch):
    """A step past the memory available was refused with no way round it (swap is not counted,
    a container may misreport): --skip-memory-check skips the check, and the refusal names it.
    It is gpt's own option, as the demo's help lists it."""
    from npattn.tools import cli, limits

    small = ["demo", "--task", "gpt", "--seq-len", "4", "--d-model", "8", "--layers", "1",
             "--heads", "2", "--batch", "2", "--steps", "1", "--no-plots", "--no-progress",
             "--out", str(tmp_path / "g")]
    monkeypatch.setattr(limits, "available_memory", lambda: 1)
    with pytest.raises(SystemExit) as exc:
        cli.main(small)
    err = capsys.readouterr().err
    assert exc.value.code == 2
    assert err.rstrip().endswith("choose smaller sizes, or pass --skip-memory-check to run anyway"), err
    assert cli.main([*small, "--skip-memory-check"]) == 0
    assert "memory available" not in capsys.readouterr().err
    with pytest.raises(SystemExit) as exc:
        cli.main(["demo", "--task", "reverse", "--skip-memory-check"])
    assert exc.value.code == 2
    assert "--skip-memory-check: an option of --task gpt, not of --task reverse" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exc:
        cli.main(["demo", "--help"])
    assert exc.value.code == 0 and "--skip-memory-check" in capsys.readouterr().out


def test_a_model_on_dask_samples_from_its_numpy_copy(monkeypatch):
    """generate_samples decodes a dask model's text on a NumPy copy of it (the parameters bit
    for bit): on dask every token is a graph to build and compute (the command's 900
    characters took 7.7 minutes for a 1-block model of width 16, 15 s with the copy)."""
    pytest.importorskip("dask.array", reason="needs dask: pip install '.[dask]'")
    from npattn.backend import backend_name
    from npattn.gpt import GPT

    codec = CharCodec("abcabd")
    lazy = GPT(codec.vocab_size, 6, 8, 1, 2, seed=3, backend="dask")
    host = GPT(codec.vocab_size, 6, 8, 1, 2, seed=3)  # the same parameters, from the seed
    ran_on = []
    generate = GPT.generate

    def recording_generate(self, *args, **kwargs):
        ran_on.append(backend_name(self.xp))
        return generate(self, *args, **kwargs)

    monkeypatch.setattr(GPT, "generate", recording_generate)
    text = generate_samples(lazy, codec, prompts=("ab",), length=9, seed=1)
    assert ran_on and set(ran_on) == {"numpy"}, ran_on
    assert text == generate_samples(host, codec, prompts=("ab",), length=9, seed=1)
    assert backend_name(lazy.xp) == "dask"  # the caller's model is left on dask


def test_the_longest_context_the_held_out_text_takes_is_accepted(tmp_path, capsys, monkeypatch):
    """The held-out last tenth of the n-character text holds n // 10 characters: a window of
    n // 10 - 1 and its shifted targets fit, and --seq-len takes that length (training is
    replaced by a stand-in that stops the run); one more is refused."""
    from npattn.tools import cli
    from npattn.tools import demo_gpt

    class Trained(Exception):
        pass

    def stand_in(cfg, **kwargs):
        raise Trained(cfg.block_size)

    monkeypatch.setattr(demo_gpt, "train", stand_in)
    longest = len(corpus()) // 10 - 1
    small = ["demo", "--task", "gpt", "--d-model", "8", "--heads", "1", "--layers", "1",
             "--batch", "1", "--skip-memory-check", "--no-plots", "--no-progress",
             "--out", str(tmp_path)]
    with pytest.raises(Trained) as exc:
        cli.main([*small, "--seq-len", str(longest)])
    assert exc.value.args == (longest,)
    with pytest.raises(SystemExit) as exc:
        cli.main([*small, "--seq-len", str(longest + 1)])
    assert exc.value.code == 2
    assert f"expected at most {longest}, got {longest + 1}" in capsys.readouterr().err


@pytest.mark.parametrize("dtype, itemsize", [("float32", 4), ("float64", 8)])
def test_the_command_s_memory_check_estimates_its_own_sizes(dtype, itemsize, tmp_path, monkeypatch):
    """The memory check of --task gpt is given the estimate of the sizes asked for, in the dtype
    asked for: B=2, L=4 (the block size too), D=8, F=32, one block of 2 heads, V characters:
    weights 8 V + 4*8 + (4*8*8 + 2*8*32) = 8 V + 800, held 4 times; logits and their gradient
    2*2*4*V = 16 V; the block's activations 2*4*(2*8 + 32) = 384 and probabilities 2*2*4*4 = 64."""
    from npattn.tools import cli, demo_gpt, limits

    class Trained(Exception):
        pass

    def stand_in(cfg, **kwargs):
        raise Trained

    seen = []
    monkeypatch.setattr(limits, "memory_error", lambda *a: seen.append(a) or None)
    monkeypatch.setattr(demo_gpt, "train", stand_in)
    with pytest.raises(Trained):
        cli.main(["demo", "--task", "gpt", "--seq-len", "4", "--d-model", "8", "--layers", "1",
                  "--heads", "2", "--batch", "2", "--dtype", dtype, "--no-plots", "--no-progress",
                  "--out", str(tmp_path)])
    ((option, received, need, _),) = seen
    V = len(set(corpus()))
    assert option == "--batch, --seq-len, --d-model, --layers"
    assert received == "--batch 2 --seq-len 4 --d-model 8 --layers 1"
    assert need == (4 * (8 * V + 800) + 16 * V + 384 + 64) * itemsize


def test_the_corpus_runs_file_by_file_in_sorted_order_with_blank_lines_between_docstrings():
    import ast
    from pathlib import Path

    import npattn

    text = corpus()
    root = Path(npattn.__file__).resolve().parent
    firsts = []
    for path in sorted(root.rglob("*.py")):
        doc = ast.get_docstring(ast.parse(path.read_text(encoding="utf-8")))
        if doc and len(doc) > 200 and doc not in firsts:  # long enough to be found only where it is
            firsts.append(doc)
    assert len(firsts) >= 5
    where = [text.index(doc + "\n\n") for doc in firsts]
    assert where == sorted(where)


def test_samples_draw_from_one_generator_across_prompts_and_a_context_of_one():
    """The prompts share one seeded generator: the same prompt twice gives two different
    continuations (the second draws go on from the first's). A model of block_size 1 keeps one
    character of context."""
    codec = CharCodec("abcdefghij")
    model = GPT(codec.vocab_size, 8, 8, 1, 2, dtype="float64", seed=0)  # near uniform: 10 choices each
    (_, first), (_, second) = generate_samples(model, codec, prompts=("ab", "ab"), length=30, seed=0,
                                               temperature=1.0, top_k=None)
    assert first != second
    one = GPT(codec.vocab_size, 1, 8, 1, 2, dtype="float64", seed=0)
    ((prompt, text),) = generate_samples(one, codec, prompts=("abc",), length=5, seed=0)
    assert text.startswith("abc") and len(text) == 8


def test_the_last_window_of_the_training_text_is_drawn_too(monkeypatch):
    """11 characters at block_size 4: the training part "abcdef" holds two windows, "abcd" and
    "bcde" (whose targets end on the part's last character); both are drawn."""
    steps, _ = _record_training(monkeypatch)
    _, codec, _ = train(GPTDemoConfig(**{**TINY, "steps": 6, "batch": 3}), text="abcdefghijk",
                        progress=False)
    windows = {codec.decode(row) for x, *_ in steps for row in x}
    targets = {codec.decode(row) for _, y, *_ in steps for row in y}
    assert windows == {"abcd", "bcde"} and targets == {"bcde", "cdef"}


def test_the_seed_draws_the_weights_and_the_training_windows(monkeypatch):
    """One seed gives the same initial weights and windows; another seed other weights (seen in
    the first loss on a text whose every training window is "abcd") and other windows. The
    history counts the model's parameters."""
    first = []
    for seed in (0, 0, 1):
        model, _, hist = train(GPTDemoConfig(**{**TINY, "steps": 1, "seed": seed}), text="abcdefghij",
                               progress=False)
        assert hist.n_params == model.n_params() > 0
        first.append(hist.train_loss[0])
    assert first[0] == first[1] != first[2]
    text = "".join(chr(97 + i * 7 % 23) for i in range(200))
    windows = []
    for seed in (0, 0, 1):
        steps, _ = _record_training(monkeypatch)
        train(GPTDemoConfig(**{**TINY, "steps": 2, "seed": seed}), text=text, progress=False)
        windows.append([x.tolist() for x, *_ in steps])
    assert windows[0] == windows[1] != windows[2]


def test_the_progress_note_shows_the_recent_training_and_the_last_validation_loss(bar_notes):
    """After each evaluation the note is "train T  val V": T the mean training loss of the steps
    so far (fewer than 20 here), V the evaluation's loss."""
    notes = bar_notes(demo_gpt)
    hist = train(GPTDemoConfig(**TINY), text="abcdefghij" * 3, progress=False)[2]
    assert hist.val_steps == [2, 4, 5]
    expected = [f"train {np.mean(hist.train_loss[:s]):.3f}  val {v:.3f}"
                for s, v in zip(hist.val_steps, hist.val_loss)]
    assert notes == expected


def test_the_progress_note_s_training_loss_is_the_mean_of_the_last_twenty_steps(bar_notes):
    """25 steps, one evaluation after the last: the note's training loss is the mean of steps
    6 to 25 (the last 20), neither all 25 nor fewer; here those means differ in the third
    decimal, as the loss falls."""
    notes = bar_notes(demo_gpt)
    hist = train(GPTDemoConfig(**{**TINY, "steps": 25, "eval_every": 25}), text="abcdefghij" * 3,
                 progress=False)[2]
    losses = hist.train_loss
    assert len(losses) == 25 and hist.val_steps == [25]
    last20 = f"{sum(losses[5:]) / 20:.3f}"
    assert last20 != f"{sum(losses) / 25:.3f}" and last20 != f"{sum(losses[15:]) / 10:.3f}"
    assert notes == [f"train {last20}  val {hist.val_loss[0]:.3f}"]


def test_the_history_s_time_is_that_of_the_training_loop(step_clock):
    """On a clock that advances 0.5 s in each of 5 training steps, the run took 2.5 s."""
    step_clock(demo_gpt, demo_gpt, "training_step", 0.5)
    hist = train(GPTDemoConfig(**TINY), text="abcdefghij", progress=False)[2]
    assert hist.seconds == 2.5


def test_format_summary_averages_the_last_fifty_steps_and_reports_the_last_validation():
    """12 steps: the training loss is the mean of all 12, and the summary says so; the final
    validation loss is the last one measured, even where an earlier one was lower."""
    hist = GPTHistory(train_loss=[2.0] * 6 + [1.0] * 6, val_steps=[6, 12], val_loss=[1.25, 1.75],
                      seconds=0.6, n_params=99, vocab=8)
    summary = format_summary(GPTDemoConfig(), hist)
    assert "final validation loss 1.750 nats/char" in summary
    assert summary.endswith("training loss (last 12 steps) 1.500")
    # 70 steps: the mean of the last 50 (25 at 2.0 and 25 at 1.0), not of fewer or more
    hist.train_loss = [3.0] * 20 + [2.0] * 25 + [1.0] * 25
    assert format_summary(GPTDemoConfig(), hist).endswith("training loss (last 50 steps) 1.500")


def test_the_loss_plot_makes_its_folder_draws_no_mean_of_one_step_and_takes_a_title(tmp_path, monkeypatch):
    """A path in a folder that does not exist yet is written; a one-step run has no running
    mean to draw, only its one training loss, the validation loss and the uniform level; the
    title is the corpus's unless one is given."""
    saved = _saved_figures(monkeypatch)
    hist = GPTHistory(train_loss=[2.0], val_steps=[1], val_loss=[2.1], vocab=8)
    path = save_loss_plot(hist, str(tmp_path / "new" / "deeper" / "loss.png"))
    assert open(path, "rb").read(8) == b"\x89PNG\r\n\x1a\n"
    labels = sorted(line.get_label() for line in saved[0].axes[0].get_lines())
    assert labels == ["training batch", "uniform, ln 8", "validation (held-out 10 %)"]
    assert saved[0].axes[0].get_title() == "Character-level GPT on npattn's docstrings"
    save_loss_plot(hist, str(tmp_path / "titled.png"), title="a run of one step")
    assert saved[1].axes[0].get_title() == "a run of one step"


def test_samples_of_an_odd_context_go_on_from_its_last_half_rounded_down(monkeypatch):
    """block_size 5: each generate call starts from the last 5 // 2 = 2 characters and adds at
    most 4 (2 + 4 - 1 = 5 positions)."""
    codec = CharCodec("abcdefgh")
    model = GPT(codec.vocab_size, 5, 8, 1, 2, seed=0)
    calls = _generate_calls(monkeypatch, codec)
    ((_, text),) = generate_samples(model, codec, prompts=("abcdef",), length=9, seed=0)
    assert len(text) == 15 and [n for _, n in calls] == [4, 4, 1]
    assert [prompt for prompt, _ in calls] == [text[4:6], text[8:10], text[12:14]]


def test_samples_default_to_the_command_s_settings(monkeypatch):
    """Without settings a prompt is continued by 300 characters (the command's 900 for its three
    prompts) at temperature 0.8 and top-k 10, as the command's samples.txt headings say."""
    codec = CharCodec("abcdefghijkl")  # more characters than top-k, which is not capped here
    model = GPT(codec.vocab_size, 64, 8, 1, 2, seed=0)
    seen = set()
    generate = GPT.generate

    def recording_generate(self, ids, n, **kwargs):
        seen.add((kwargs["temperature"], kwargs["top_k"]))
        return generate(self, ids, n, **kwargs)

    monkeypatch.setattr(GPT, "generate", recording_generate)
    ((_, text),) = generate_samples(model, codec, prompts=("ab",))
    assert len(text) == 2 + 300 and seen == {(0.8, 10)}


def test_the_command_s_defaults_are_the_config_s(tmp_path, command_config):
    """The command's gpt run is ``GPTDemoConfig()`` (docs/gpt.md: 1500 steps, a warm-up over 100
    steps, clipping at 1.0, no dropout, the validation loss every 100 steps over 8 batches of 32
    windows: the documented loss depends on them)."""
    cfg = command_config(demo_gpt, ["demo", "--task", "gpt", "--no-plots", "--no-progress",
                                    "--out", str(tmp_path)])
    assert cfg == GPTDemoConfig()
    assert (cfg.steps, cfg.warmup, cfg.max_grad_norm, cfg.dropout) == (1500, 100, 1.0, 0.0)
    assert (cfg.eval_every, cfg.eval_batches, cfg.batch) == (100, 8, 32)


def test_the_command_hands_every_option_to_the_config(tmp_path, command_config):
    """Each option given reaches the run's config: none is dropped for its default."""
    cfg = command_config(demo_gpt, ["demo", "--task", "gpt", "--seq-len", "8", "--d-model", "16",
                                    "--layers", "2", "--heads", "2", "--batch", "4", "--steps", "7",
                                    "--lr", "0.02", "--dropout", "0.1", "--dtype", "float64",
                                    "--seed", "3", "--no-plots", "--no-progress",
                                    "--out", str(tmp_path)])
    assert cfg == GPTDemoConfig(block_size=8, d_model=16, n_layer=2, n_head=2, batch=4, steps=7,
                                lr=0.02, dropout=0.1, dtype="float64", seed=3)


def test_encode_refuses_even_one_unknown_character():
    codec = CharCodec("hello world")
    with pytest.raises(ValueError, match=r"^text: expected characters of the training text, got \['x'\]$"):
        codec.encode("lox")


def test_progress_false_draws_no_bar_even_on_a_terminal():
    import io

    class Terminal(io.StringIO):
        def isatty(self):
            return True

    quiet, shown = Terminal(), Terminal()
    train(GPTDemoConfig(**{**TINY, "steps": 2}), text="abcdefghij", progress=False, stream=quiet)
    train(GPTDemoConfig(**{**TINY, "steps": 2}), text="abcdefghij", progress=True, stream=shown)
    assert quiet.getvalue() == ""
    assert "gpt" in shown.getvalue() and "2/2" in shown.getvalue()


@pytest.mark.parametrize("top_k, given", [(None, None), (2, 2), (10, 3)])
def test_top_k_none_samples_from_every_character_and_a_larger_one_is_capped(top_k, given, monkeypatch):
    """``top_k=None`` reaches generate as None (no cut), a top-k past the 3 characters as 3."""
    codec = CharCodec("abcab")
    model = GPT(codec.vocab_size, 4, 8, 1, 2, seed=0)
    seen = set()
    generate = GPT.generate

    def recording_generate(self, ids, n, **kwargs):
        seen.add(kwargs["top_k"])
        return generate(self, ids, n, **kwargs)

    monkeypatch.setattr(GPT, "generate", recording_generate)
    generate_samples(model, codec, prompts=("ab",), length=5, top_k=top_k)
    assert seen == {given}


def test_an_empty_text_is_refused_not_replaced_by_the_corpus():
    with pytest.raises(ValueError, match=r"^text: expected at least 10 characters .* got 0$"):
        train(GPTDemoConfig(**TINY), text="", progress=False)
