"""What ``npattn bench`` reports, computed from known sample times (no timing assertions).

The steps are stand-ins that advance a fake clock by set amounts, so every number of a
row (median, fastest sample, ms per step, GFLOP/s, %GEMM, ratio) has a value worked out
here by hand: from the listed sample times and a hand count of the shape's FLOPs.
"""

import inspect
import io
import os
import sys
import types

import numpy as np
import pytest

from npattn.tools import bench, bench_gpt, limits


class Clock:
    """``time.perf_counter`` stand-in: it moves only when a fake step advances it."""

    def __init__(self):
        self.t = 0.0
        self.sleeps = []

    def perf_counter(self):
        return self.t

    def sleep(self, s):
        self.sleeps.append(s)


def stepper(clock, per_sample, number, skip=0):
    """A step whose calls in timed sample i each take ``per_sample[i]`` seconds: the first
    ``skip`` calls (warm-up) take 1 s, then samples of ``number`` calls follow."""
    calls = [0]

    def step():
        c = calls[0] - skip
        clock.t += 1.0 if c < 0 else per_sample[min(c // number, len(per_sample) - 1)]
        calls[0] += 1

    step.calls = calls
    return step


# six samples each (an even count: the median is the mean of the middle two)
NPATTN_S = [0.005, 0.003, 0.009, 0.004, 0.007, 0.006]  # sorted 3 4 5 6 7 9 ms: median 5.5, min 3
TORCH_S = [0.002, 0.004, 0.003, 0.008, 0.0025, 0.005]  # sorted 2 2.5 3 4 5 8 ms: median 3.5, min 2
GEMM_S = [0.5, 0.25, 1.0, 2.0, 0.4, 0.1]  # sorted .1 .25 .4 .5 1 2: median 0.45 s
GEMM_FLOPS = 6e9  # so the GEMM runs at 6 / 0.45 GFLOP/s
# 2x3x4x2 causal: 4 projections of (6, 4) x (4, 4), each 2*6*4*4 = 192 FLOPs forward and twice
# that backward: 3 * 4 * 192 = 2304; attention: q k^T and a v forward, dv, da, dq, dk backward,
# each 2*B*L*L*D = 2*2*3*3*4 = 144, halved when causal: 6 * 72 = 432
SHAPE = bench.Shape(2, 3, 4, 2, True)
SHAPE_FLOPS = 2304 + 432


def fake_run(monkeypatch, *, warmup=0, torch_side=True, torch_error=None, memory=False, pause=0.0,
             dtype="float32", impl="dense", seen=None, min_sample=0.0, rss=1.5):
    """``bench.run`` over SHAPE with stand-in steps: npattn 3 calls per sample, torch 2, GEMM 4;
    ``seen`` gets the arguments each stand-in was called with (``autorange``: the ``min_time``
    of each call), the RSS reading is ``rss``."""
    seen = {} if seen is None else seen
    clock = Clock()
    fake_time = types.SimpleNamespace(perf_counter=clock.perf_counter, sleep=clock.sleep)
    monkeypatch.setattr(bench, "time", fake_time)
    events = []
    npattn = stepper(clock, NPATTN_S, 3, skip=warmup)
    torch = stepper(clock, TORCH_S, 2, skip=warmup)
    gemm = stepper(clock, GEMM_S, 4)
    numbers = {npattn: 3, torch: 2, gemm: 4}
    monkeypatch.setattr(bench, "autorange", lambda fn, sync, min_time=0.2:
                        seen.setdefault("autorange", []).append(min_time) or numbers[fn])
    module = types.SimpleNamespace(clear_cache=lambda: events.append("clear"))
    monkeypatch.setattr(bench, "_make_npattn",
                        lambda *a: seen.__setitem__("_make_npattn", a) or (module, None, None, npattn))

    def make_torch(*a):
        seen["_make_torch"] = a
        if torch_error:
            raise torch_error
        return torch, None

    monkeypatch.setattr(bench, "_make_torch", make_torch)
    monkeypatch.setattr(bench, "_gemm_step",
                        lambda *a: seen.__setitem__("_gemm_step", a) or (gemm, GEMM_FLOPS))
    monkeypatch.setattr(bench, "gemm_gflops", lambda *a: seen.__setitem__("gemm_gflops", a) or 100.0)
    monkeypatch.setattr(bench, "_peak_traced_mib",
                        lambda *a: seen.__setitem__("_peak_traced_mib", a) or events.append("peak") or 7.25)
    monkeypatch.setattr(bench, "_rss_rise_mib",
                        lambda *a: seen.__setitem__("_rss_rise_mib", a) or events.append("rss") or rss)
    out = io.StringIO()
    result = bench.run([SHAPE], dtype=dtype, impl=impl, repeat=6, warmup=warmup, gemm_n=8,
                       torch_compare=torch_side, memory=memory, pause=pause, min_sample=min_sample, out=out,
                       progress=False)
    return result, out.getvalue(), events, clock, (npattn, torch)


def test_a_row_reports_medians_minimums_rates_and_ratios_of_its_samples(monkeypatch):
    result, text, events, clock, _ = fake_run(monkeypatch)
    (row,) = result["rows"]
    assert row["ms_all"] == pytest.approx([5, 3, 9, 4, 7, 6])  # ms per step, each sample
    assert row["ms"] == pytest.approx(5.5) and row["ms_min"] == pytest.approx(3.0)
    assert row["torch_ms_all"] == pytest.approx([2, 4, 3, 8, 2.5, 5])
    assert row["torch_ms"] == pytest.approx(3.5) and row["torch_ms_min"] == pytest.approx(2.0)
    assert row["ratio"] == pytest.approx(5.5 / 3.5) and row["ratio_min"] == pytest.approx(3 / 2)
    assert (row["number"], row["torch_number"], row["gemm_number"]) == (3, 2, 4)
    rate = SHAPE_FLOPS / 5.5e-3 / 1e9
    assert row["gflops"] == pytest.approx(rate)
    assert row["gemm_gflops"] == pytest.approx(6 / 0.45)  # this shape's rounds, not the start's 100
    assert row["pct_gemm"] == pytest.approx(100 * rate / (6 / 0.45))
    assert result["gemm_gflops"] == 100.0
    assert row["torch_note"] is None and row["notes"] == [] and row["peak_mib"] is None
    assert clock.sleeps == []  # pause 0: no rest
    cells = text.splitlines()[-1].split()
    assert cells[:3] == ["2x3x4x2c", "5.50", "3"] and cells[-3:] == ["3.50", "1.57", "1.50"]


def test_warm_up_pause_and_memory_runs(monkeypatch):
    """The warm-up calls come before the first sample, each sample rests ``pause`` first, and
    the memory readings run after a cleared cache each and land in their own columns."""
    result, _, events, clock, (npattn, torch) = fake_run(monkeypatch, warmup=2, memory=True,
                                                         pause=0.25)
    (row,) = result["rows"]
    assert row["ms"] == pytest.approx(5.5) and row["torch_ms"] == pytest.approx(3.5)
    assert npattn.calls[0] == 2 + 6 * 3 and torch.calls[0] == 2 + 6 * 2
    assert clock.sleeps == [0.25] * (3 * 6)  # npattn, torch and the GEMM, six rounds
    assert events == ["clear", "peak", "clear", "rss"]
    assert row["peak_mib"] == 7.25 and row["rss_mib"] == 1.5


def test_rows_without_torch_say_why_only_when_it_was_asked_for(monkeypatch):
    result, text, *_ = fake_run(monkeypatch, torch_side=False)
    (row,) = result["rows"]
    assert row["ms"] == pytest.approx(5.5)
    assert row["torch_ms"] is row["ratio"] is row["ratio_min"] is row["torch_number"] is None
    assert row["torch_note"] is None and row["notes"] == [] and "torch:" not in text
    result, text, *_ = fake_run(monkeypatch, torch_error=RuntimeError("no kernel"))
    (row,) = result["rows"]
    assert row["ratio"] is None and row["torch_note"] == "RuntimeError: no kernel"
    assert "(torch: RuntimeError: no kernel)" in text


def test_the_gemm_rate_is_2n3_over_the_median_of_at_least_three_samples(monkeypatch):
    ticks = iter([0.0, 1.0, 10.0, 12.0, 20.0, 24.0, 30.0, 38.0])  # samples of 1, 2, 4, 8 s
    monkeypatch.setattr(bench, "time", types.SimpleNamespace(perf_counter=lambda: next(ticks)))
    # repeat 1 still takes three samples (1, 2, 4 s): 2 * 4**3 FLOPs in the median, 2 s
    assert bench.gemm_gflops(np, "float32", 4, 1, lambda: None) == pytest.approx(128 / 2 / 1e9)


def test_the_isolated_child_reports_its_samples_rate_and_rss(monkeypatch):
    clock = Clock()
    fake_time = types.SimpleNamespace(perf_counter=clock.perf_counter, sleep=clock.sleep)
    monkeypatch.setattr(bench, "time", fake_time)
    shape = bench.Shape(2, 3, 4, 2, True)
    for scope in ("module", "attention"):
        step = stepper(clock, [0.004, 0.001, 0.003, 0.006, 0.002], 1, skip=2)  # median 3, mean 3.2
        if scope == "module":
            monkeypatch.setattr(bench, "_make_npattn", lambda *a: (types.SimpleNamespace(xp=np),
                                                                   None, None, step))
        else:
            monkeypatch.setattr(bench, "_make_core", lambda *a: (np, step))
        # the peak RSS grows 10 MiB per step: read before the warm-up, and after the samples
        monkeypatch.setattr(bench, "_peak_rss_mib", lambda: 100.0 + 10 * step.calls[0])
        monkeypatch.setattr(bench, "gemm_gflops", lambda *a: 50.0)
        r = bench.measure_here(shape, repeat=5, warmup=2, gemm_n=8, scope=scope)
        assert r["ms_all"] == pytest.approx([4, 1, 3, 6, 2])
        assert r["ms"] == pytest.approx(3.0) and r["ms_min"] == pytest.approx(1.0)
        # the core alone: only the attention's 432 FLOPs of SHAPE_FLOPS
        rate = (SHAPE_FLOPS if scope == "module" else 432) / 3e-3 / 1e9
        assert r["gflops"] == pytest.approx(rate)
        assert r["gemm_gflops"] == 50.0 and r["pct_gemm"] == pytest.approx(100 * rate / 50)
        assert r["rss_before_mib"] == 100.0 and r["peak_rss_mib"] == 100.0 + 10 * 7


def _isolated_row(**values):
    r = {"shape": "1x8x8x2", "impl": "blocked", "block_q": 16, "block_k": 32, "ms": 12.3,
         "ms_min": 9.0, "gflops": 4.5, "gemm_gflops": 60.0, "pct_gemm": 7.5, "rss_before_mib": 111.0,
         "peak_rss_mib": 999.0, "loadavg": [0.5, 0.25, 0.125], "repeat": 5, "warmup": 2,
         "blas_threads": None}
    r.update(values)
    return r


def test_the_isolated_tables_put_each_number_under_its_header():
    r = _isolated_row()
    widths = bench.isolated_widths([(bench.Shape(1, 8, 8, 2, False), "blocked")], 16, 32)
    header = bench.format_isolated_header(widths).replace("RSS before", "RSS_before")
    header = header.replace("peak RSS", "peak_RSS").split()
    cells = dict(zip(header, bench.format_isolated_row(r, widths).split()))
    assert cells == {"shape": "1x8x8x2", "impl": "blocked", "blocks": "16,32", "ms": "12.30",
                     "GFLOP/s": "4.5", "GEMM": "60.0", "%GEMM": "7.5", "RSS_before": "111.0",
                     "peak_RSS": "999.0", "load": "0.5"}
    env = {"cpu": "x", "cpu_count": 2, "memory_gib": 4.0, "threadpools": "none", "numpy": "2",
           "python": "3", "backend": "numpy"}
    lines = bench.markdown_table({"env": env, "dtype": "float32", "rows": [r]}).splitlines()
    assert lines[:3] == ["- CPU: x, 2 logical cpus, 4.0 GiB RAM", "- BLAS: none",
                         "- NumPy 2, Python 3, backend numpy, float32"]
    head = [c.strip() for c in lines[-3].strip("|").split("|")]
    cells = dict(zip(head, (c.strip() for c in lines[-1].strip("|").split("|"))))
    assert cells == {"shape": "1x8x8x2", "impl": "blocked", "blocks (q, k)": "16, 32",
                     "BLAS threads": "default", "runs": "5 (+2 warm-up)", "ms (median)": "12",
                     "GFLOP/s": "4.5", "GEMM GFLOP/s": "60", "peak RSS MiB": "999",
                     "RSS before fwd MiB": "111", "load (1 min)": "0.5"}


def test_peak_rss_readings_in_mib(monkeypatch):
    import resource
    import sys

    monkeypatch.setattr(bench, "_hwm_kib", lambda: 3072)
    assert bench._peak_rss_mib() == 3.0
    monkeypatch.setattr(bench, "_hwm_kib", lambda: None)  # no VmHWM: ru_maxrss
    monkeypatch.setattr(resource, "getrusage", lambda who: types.SimpleNamespace(ru_maxrss=4096))
    monkeypatch.setattr(sys, "platform", "linux")
    assert bench._peak_rss_mib() == 4.0  # KiB on Linux
    monkeypatch.setattr(sys, "platform", "darwin")
    assert bench._peak_rss_mib() == 4096 / 2**20  # bytes on macOS


def test_the_rss_rise_resets_the_high_water_mark_and_reads_it_in_mib(monkeypatch):
    written = []

    class File(io.StringIO):
        def __exit__(self, *exc):
            written.append(self.getvalue())

    def fake_open(path, mode="r"):
        assert path == "/proc/self/clear_refs" and mode == "w"
        return File()

    monkeypatch.setattr(bench, "open", fake_open, raising=False)
    readings = iter([1000, 3048])  # KiB, before and after the step
    monkeypatch.setattr(bench, "_hwm_kib", lambda: next(readings))
    assert bench._rss_rise_mib(lambda: None, lambda: None) == 2.0
    assert written == ["5"]  # 5 resets VmHWM (Documentation/filesystems/proc.rst)

    def refused(path, mode="r"):
        raise PermissionError(path)

    monkeypatch.setattr(bench, "open", refused, raising=False)
    assert bench._rss_rise_mib(lambda: None, lambda: None) is None


def test_shape_strings_round_trip_through_the_childs_parser():
    """The isolated child gets its shape as ``str(shape)``: every suffix must parse back."""
    for shape in (bench.Shape(1, 8, 8, 2, True, 0.25, 4), bench.Shape(3, 5, 6, 3, False, 0.0, 0),
                  bench.Shape(1, 8, 8, 2, True)):
        assert bench.parse_shapes(str(shape)) == (shape,)


def test_a_dropout_of_any_digits_round_trips_through_the_shape_string():
    """The shape string gave the dropout in six significant digits, or in an exponent: the
    isolated child of ``--shapes 1x8x8x2d0.1234567`` ran p = 0.123457, and those of
    ``d0.00001`` (``d1e-05``) and ``d0.9999999999`` (``d1``) refused their own shape."""
    for p in (0.1234567, 0.00001, 0.9999999999, 0.1 + 0.2):
        shape = bench.Shape(1, 8, 8, 2, True, p, 3)
        assert bench.parse_shapes(str(shape)) == (shape,), str(shape)
    assert str(bench.Shape(1, 8, 8, 2, False, 0.00001)) == "1x8x8x2d0.00001"
    assert [str(s) for s in bench.parse_shapes("8x512x768x12d0.1,2x4x4x2cd0.25")] == [
        "8x512x768x12d0.1", "2x4x4x2cd0.25"]


def test_parse_shapes_at_its_limits():
    (big,) = bench.parse_shapes(f"1x1x{2**31 - 1}x1")  # BLAS's largest 32-bit size is taken
    assert big.D == 2**31 - 1
    for bad in ("2x4x4x2d1", "2x4x4x2d0.1.2", "2x4x4x2d."):  # p = 1 drops all; not numbers
        with pytest.raises(ValueError, match="--shapes: .* the dropout after d must be in"):
            bench.parse_shapes(bad)


def _captured(monkeypatch, name):
    calls = []
    monkeypatch.setattr(bench, name, lambda *a, **k: calls.append((a, k)) or {"rows": []})
    return calls


def test_the_command_line_reaches_the_run(monkeypatch):
    calls = _captured(monkeypatch, "run")
    assert bench.main(["--shapes", "1x4x4x2"]) == 0
    (shapes,), kw = calls[-1]
    assert shapes == (bench.Shape(1, 4, 4, 2, False),)
    assert {k: kw[k] for k in ("repeat", "warmup", "impl", "gemm_n", "torch_compare", "memory",
                               "pause", "min_sample", "dtype", "backend")} == {
        "repeat": 7, "warmup": 2, "impl": "dense", "gemm_n": 2048, "torch_compare": True,
        "memory": True, "pause": 0.1, "min_sample": 0.2, "dtype": "float32", "backend": "numpy"}
    assert bench.main(["--shapes", "1x4x4x2c", "--repeat", "5", "--warmup", "0", "--impl", "blocked",
                       "--gemm", "8", "--no-torch", "--no-memory", "--pause", "0",
                       "--min-sample", "0.01", "--dtype", "float64", "--no-progress"]) == 0
    _, kw = calls[-1]
    assert {k: kw[k] for k in ("repeat", "warmup", "impl", "gemm_n", "torch_compare", "memory",
                               "pause", "min_sample", "dtype", "progress")} == {
        "repeat": 5, "warmup": 0, "impl": "blocked", "gemm_n": 8, "torch_compare": False,
        "memory": False, "pause": 0.0, "min_sample": 0.01, "dtype": "float64", "progress": False}


def test_the_isolated_command_line_reaches_its_run(monkeypatch):
    calls = _captured(monkeypatch, "run_isolated")
    assert bench.main(["--isolated"]) == 0
    (plan,), kw = calls[-1]
    assert list(plan) == list(bench.ISOLATED_PLAN)
    assert (kw["repeat"], kw["warmup"], kw["gemm_n"]) == (1, 0, 2048)
    assert kw["block_q"] is None and kw["block_k"] is None
    assert bench.main(["--isolated", "--shapes", "1x8x8x2", "--impl", "blocked", "--repeat", "3",
                       "--warmup", "1", "--gemm", "0", "--block-q", "16", "--block-k", "32",
                       "--scope", "attention"]) == 0
    (plan,), kw = calls[-1]
    assert list(plan) == [(bench.Shape(1, 8, 8, 2, False), "blocked")]
    assert {k: kw[k] for k in ("repeat", "warmup", "gemm_n", "block_q", "block_k", "scope")} == {
        "repeat": 3, "warmup": 1, "gemm_n": 0, "block_q": 16, "block_k": 32, "scope": "attention"}


@pytest.mark.parametrize("argv, message", [
    (["--repeat", "4"], "--repeat: expected at least 5, got 4"),
    (["--isolated", "--repeat", "0"], "--repeat: expected at least 1, got 0"),
    (["--warmup", "-1"], "--warmup: expected a non-negative integer, got -1"),
    (["--gemm", "0"], "--gemm: expected a positive size of at most"),
    (["--isolated", "--gemm", "-1"], "--gemm: expected 0 or a positive size"),
    (["--blas-threads", "0"], "--blas-threads: expected an integer in [1, 4096], got 0"),
    (["--isolated", "--block-q", "0"], "--block-q: expected an integer in [1, 2147483647], got 0"),
    (["--pause", "inf"], "--pause: expected a finite number of seconds >= 0, got inf"),
    (["--min-sample", "inf"], "--min-sample: expected a finite number of seconds >= 0, got inf"),
])
def test_counts_just_past_their_limits_are_usage_errors(argv, message, monkeypatch, capsys):
    _captured(monkeypatch, "run")
    _captured(monkeypatch, "run_isolated")
    with pytest.raises(SystemExit) as exc:
        bench.main(argv)
    assert exc.value.code == 2 and message in capsys.readouterr().err


@pytest.mark.parametrize("text", ["2x5x8x2", "2x5x8x2c", "1x6x8x2w2", "1x6x8x2cw2"])
def test_torch_runs_the_same_attention_as_npattn(text):
    """The ratio compares like with like: torch's module holds npattn's weights and masks the
    same keys (causal, a window of 2 keys back, or both), so in float64 the weight and bias
    gradients of one step of each agree. (The module starts with zero biases: random ones
    here, so that they count.)"""
    pytest.importorskip("torch")
    (shape,) = bench.parse_shapes(text)
    m, x, dout, step = bench._make_npattn(shape, "float64", "numpy", "dense")
    rng = np.random.default_rng(3)
    for name in ("b_q", "b_k", "b_v", "b_o"):
        m.params[name] = rng.standard_normal(m.params[name].shape)
    tstep, why_not = bench._make_torch(shape, "float64", m, x, dout)
    assert why_not is None
    step()
    tstep()
    mha = inspect.getclosurevars(tstep).nonlocals["mha"]
    D = shape.D
    w_in, b_in = mha.in_proj_weight.grad.numpy(), mha.in_proj_bias.grad.numpy()
    for name, got in (("w_q", w_in[:D]), ("w_k", w_in[D:2 * D]), ("w_v", w_in[2 * D:]),
                      ("w_o", mha.out_proj.weight.grad.numpy()), ("b_q", b_in[:D]),
                      ("b_k", b_in[D:2 * D]), ("b_v", b_in[2 * D:]),
                      ("b_o", mha.out_proj.bias.grad.numpy())):
        np.testing.assert_allclose(got, np.asarray(m.grads[name]), rtol=1e-10, atol=1e-12,
                                   err_msg=name)


def test_the_dropout_rows_drop_on_both_sides(monkeypatch):
    """A dropout row times steps that drop: npattn's module and torch's in training mode with
    the row's p, and the attention core called with it and a seed."""
    pytest.importorskip("torch")
    (shape,) = bench.parse_shapes("1x6x8x2d0.5")
    m, x, dout, step = bench._make_npattn(shape, "float64", "numpy", "dense")
    assert m.dropout == 0.5 and m.training
    tstep, _ = bench._make_torch(shape, "float64", m, x, dout)
    mha = inspect.getclosurevars(tstep).nonlocals["mha"]
    assert mha.dropout == 0.5 and mha.training
    from npattn import attention

    seen = []
    forward = attention.sdpa_forward
    monkeypatch.setattr(attention, "sdpa_forward", lambda *a, **k: seen.append(k) or forward(*a, **k))
    _, core_step = bench._make_core(shape, "float64", "numpy", "dense")
    core_step()
    assert seen[0]["dropout_p"] == 0.5 and seen[0]["rng"] is not None


def test_the_gpt_step_reports_medians_and_the_ratio_of_its_rounds(monkeypatch):
    clock = Clock()
    monkeypatch.setattr(bench_gpt, "time", types.SimpleNamespace(perf_counter=clock.perf_counter))
    npattn = stepper(clock, [0.030, 0.010, 0.020, 0.050], 2, skip=1)  # median 25 ms
    torch = stepper(clock, [0.010, 0.020, 0.040, 0.015], 3, skip=1)  # median 17.5 ms
    model = types.SimpleNamespace(n_params=lambda: 123)
    monkeypatch.setattr(bench_gpt, "make_steps", lambda cfg, torch_side: (npattn, torch, model))
    monkeypatch.setattr(bench_gpt, "autorange", lambda fn, sync: {npattn: 2, torch: 3}[fn])
    out = io.StringIO()
    r = bench_gpt.run(bench_gpt.GPTBenchConfig(), repeat=4, warmup=1, out=out)
    assert r["numbers"] == {"npattn": 2, "torch": 3}
    assert r["samples_ms"]["npattn"] == pytest.approx([30, 10, 20, 50])
    assert r["samples_ms"]["torch"] == pytest.approx([10, 20, 40, 15])
    assert r["median_ms"] == pytest.approx({"npattn": 25.0, "torch": 17.5})
    assert r["ratio"] == pytest.approx(25 / 17.5)
    assert r["round_ratios"] == pytest.approx([3.0, 0.5, 0.5, 50 / 15])
    text = out.getvalue()
    assert "round 1: npattn     30.0 ms  torch     10.0 ms  ratio 3.00" in text
    assert "ratio 1.43 (rounds 0.50 .. 3.33)" in text
    assert npattn.calls[0] == 1 + 4 * 2 and torch.calls[0] == 1 + 4 * 3
    env = bench.environment_info(np)  # the first line names the CPU as npattn bench's cpu: line
    assert text.splitlines()[0].startswith(f"npattn bench --model gpt: {bench_gpt.GPTBenchConfig()}; "
                                           f"{bench.cpu_text(env)}, ")
    assert len(r["loadavg"]) == 3  # the machine's load, next to the samples it may explain


@pytest.mark.parametrize("argv, message", [
    (["--repeat", "0"], "--repeat: expected a positive integer, got 0"),
    (["--warmup", "-1"], "--warmup: expected a non-negative integer, got -1"),
    (["--d-model", "8", "--n-head", "3"], "--n-head: expected a divisor of --d-model 8, got 3"),
])
def test_the_gpt_step_refuses_counts_past_their_limits(argv, message, monkeypatch, capsys):
    monkeypatch.setattr(bench_gpt, "run", lambda *a, **k: pytest.fail("ran"))
    with pytest.raises(SystemExit) as exc:
        bench_gpt.main(["--model", "gpt", *argv])
    assert exc.value.code == 2 and message in capsys.readouterr().err


def test_the_gpt_command_line_reaches_its_run(monkeypatch):
    calls = []
    monkeypatch.setattr(bench_gpt, "run", lambda cfg, **k: calls.append((cfg, k)) or {})
    assert bench_gpt.main(["--model", "gpt", "--batch", "2", "--seq-len", "4", "--d-model", "8",
                           "--n-head", "2", "--repeat", "3", "--warmup", "0", "--no-torch"]) == 0
    cfg, kw = calls[-1]
    assert (cfg.batch, cfg.seq_len, cfg.d_model, cfg.n_head) == (2, 4, 8, 2)
    assert kw == {"repeat": 3, "warmup": 0, "torch_compare": False}


def test_the_memory_estimates_at_their_edges(monkeypatch):
    GiB = 2**30
    assert limits.memory_error("--x", "y", GiB, "z", available=GiB) is None  # exactly fits
    assert "needs at least 1.0 GiB" in limits.memory_error("--x", "y", GiB, "z", available=GiB - 1)
    assert limits.format_bytes(GiB) == "1.0 GiB" and limits.format_bytes(GiB - 2**20) == "1023.0 MiB"
    # the smaller of MemAvailable and the cgroup's room
    monkeypatch.setattr(limits, "_meminfo_available", lambda: 8 * GiB)
    monkeypatch.setattr(limits, "cgroup_room", lambda: 2 * GiB)
    assert limits.available_memory() == 2 * GiB


def test_a_cgroup_used_past_its_limit_has_no_room(tmp_path):
    (tmp_path / "memory.max").write_text("1000\n")
    (tmp_path / "memory.current").write_text("5000\n")
    assert limits.cgroup_room(str(tmp_path)) == 0


def test_the_gpt_step_estimate_by_hand():
    # B=2, L=3, block 5, D=4, F=16, 2 blocks, 2 heads, V=7, float32:
    # weights 7*4 + 5*4 + 2 * (4*16 + 2*4*16) = 432, held 4 times (values, grads, 2 moments): 1728;
    # logits and their gradient 2*2*3*7 = 84; per block 2*3*(2*4 + 16) = 144 activations and
    # 2*2*3*3 = 36 probabilities: 2 * 180 = 360; (1728 + 84 + 360) * 4 bytes
    assert limits.gpt_training_bytes(2, 3, 5, 4, 2, 2, 7, 4) == (1728 + 84 + 360) * 4


def test_auto_counts_the_probabilities_of_all_heads():
    """impl auto turns blocked when the scores of all B*H heads together pass the dense
    limit: heads of 1024 x 1024 scores (each below the per-head limit) keep their
    probabilities up to that limit, and none past it."""
    from npattn import attention

    L = 1024
    assert L * L < attention.AUTO_BLOCKED_MIN_SCORES
    H = attention.AUTO_BLOCKED_MAX_DENSE_SCORES // (L * L)  # all heads at the limit
    assert limits.dense_probabilities(1, H // 2, L, L, "auto") == H // 2 * L * L
    assert limits.dense_probabilities(1, H, L, L, "auto") == 0  # one batch entry, H heads
    assert limits.dense_probabilities(1, H, L, L, "dense") == H * L * L


def test_the_step_estimate_by_hand():
    shape = bench.Shape(2, 3, 4, 2, False)
    # the module: x, dout, q, k, v and the output kept, 6 * 2*3*4 = 144, four 4x4 weights 64,
    # and on the dense path 2*2*3*3 = 36 probabilities, float64
    need, what = bench.step_bytes(shape, "dense", "float64")
    assert need == (144 + 64 + 36) * 8
    assert what == ("6 B*L*D activations and 4 D*D weights and 2*2*3*3 attention probabilities "
                    "of impl dense, float64")
    # the core alone on the blocked path: q, k, v, dout and the output, 5 * 24, float32
    assert bench.step_bytes(shape, "blocked", "float32", "attention") == (
        120 * 4, "5 B*L*D activations, float32")


def test_autorange_stops_at_a_sample_of_exactly_the_shortest_time(monkeypatch):
    """As ``timeit``'s autorange: a sample that lasts exactly ``min_time`` is long enough."""
    clock = Clock()
    monkeypatch.setattr(bench, "time", types.SimpleNamespace(perf_counter=clock.perf_counter))
    step = stepper(clock, [0.25], 1)
    assert bench.autorange(step, lambda: None, 0.5) == 2  # 1 call: 0.25 s, 2 calls: 0.5 s
    assert bench.autorange(step, lambda: None, 0.25) == 1


def test_the_notes_start_just_past_their_thresholds():
    """%GEMM is warned above 100, not at 100; an RSS rise of 0.05 MiB prints as 0.1 (the
    ``<0.1`` and its note are for rises that round to 0.0)."""
    row = {"pct_gemm": 100.0, "rss_mib": 0.05}
    assert bench.row_notes(row) == []
    assert bench.format_mib(0.05) == "0.1" and bench.format_mib(0.0499) == "<0.1"
    assert bench.row_notes({"pct_gemm": 100.01, "rss_mib": 0.0499}) == [bench.GEMM_WARNING,
                                                                        bench.RSS_NOTE]


def test_the_traced_peak_is_what_the_step_allocated_in_mib():
    """A step that holds 8 MiB of float64 (2**20 entries) at its peak reads 8 MiB, whatever
    was allocated before it."""
    before = np.ones(2**21)  # 16 MiB live before the step: not counted

    def step():
        a = np.ones(2**20)
        del a

    peak = bench._peak_traced_mib(step, lambda: None)
    assert 8.0 <= peak < 8.1 and before.size == 2**21


# ------------------------------------------------------- figures at their edges, and the plumbing


def test_shapes_are_read_in_either_case():
    assert bench.parse_shapes("4X1024X768X12C, 1x8x8x2W2D0.5") == (
        bench.Shape(4, 1024, 768, 12, True), bench.Shape(1, 8, 8, 2, False, 0.5, 2))


def test_the_flops_of_a_window_at_its_edges():
    """w0: each query attends its own key alone, L pairs; a window that reaches back past the
    first key (w >= L - 1) attends what a causal mask does, 1 + 2 + ... + L = L (L + 1) / 2."""
    proj = 24.0 * 1 * 8 * 4 * 4  # B=1, L=8, D=4: the projections, as without a window
    assert bench.flops(bench.Shape(1, 8, 4, 2, False, window=0)) == proj + 12.0 * 8 * 4
    for w in (7, 100):
        assert bench.flops(bench.Shape(1, 8, 4, 2, False, window=w)) == proj + 12.0 * 36 * 4


def test_the_memory_check_refuses_any_case_that_does_not_fit():
    """Every case is checked against the memory given, not the first one alone. Float32 on
    the dense path: 1x4x4x2 holds 6*16 activations, 4*16 weights and 2*4*4 probabilities,
    192 * 4 = 768 bytes; 1x64x4x2 holds 6*256 + 64 + 2*64*64 = 9792, 39168 bytes."""
    small, big = bench.parse_shapes("1x4x4x2,1x64x4x2")
    cases = [(small, "dense"), (big, "dense")]
    assert bench.memory_refusal(cases, available=39168) is None  # exactly fits
    why = bench.memory_refusal(cases, available=39167)
    assert why.startswith("--shapes: expected sizes") and "got 1x64x4x2 (--impl dense)" in why
    assert bench.memory_refusal(cases[:1], available=768) is None
    assert "got 1x4x4x2 (--impl dense)" in bench.memory_refusal(cases, available=767)


class Device:
    """A GPU stand-in: a step queues work, ``sync`` waits for it on the clock, and ``sleep``
    passes on the clock too."""

    def __init__(self, queued=0.0):
        self.t, self.queued = 0.0, queued

    def perf_counter(self):
        return self.t

    def sleep(self, s):
        self.t += s

    def sync(self):
        self.t, self.queued = self.t + self.queued, 0.0

    def step(self):
        self.queued += 0.01


def test_a_sample_waits_for_the_device_and_not_for_its_pause(monkeypatch):
    """A sample's time is that of its own steps: their queued work is waited for before the
    clock stops, work queued before the sample is waited for before it starts, and the rest
    before a sample (--pause) is not part of it."""
    device = Device(queued=0.5)  # a previous step's work, still running
    monkeypatch.setattr(bench, "time", device)
    assert bench._timed(device.step, device.sync, 4, pause=0.25) == pytest.approx(0.01)
    assert device.t == pytest.approx(0.5 + 0.25 + 4 * 0.01)


def test_autorange_stops_at_its_largest_number(monkeypatch):
    """A step that takes no time at all gets ``max_number`` calls per sample, not more."""
    monkeypatch.setattr(bench, "time", types.SimpleNamespace(perf_counter=lambda: 0.0))
    assert bench.autorange(lambda: None, lambda: None, 0.2, max_number=100) == 100
    assert bench.autorange(lambda: None, lambda: None, 0.2, max_number=7) == 10  # 1, 2, 5, 10


def test_the_gemm_step_multiplies_two_matrices_of_the_dtype():
    for dtype in ("float32", "float64"):
        step, fl = bench._gemm_step(np, dtype, 3)
        c = step()
        assert c.dtype == np.dtype(dtype) and c.shape == (3, 3)
        assert fl == 2 * 3**3  # 27 multiply-adds


def test_the_gemm_is_warmed_up_and_its_samples_autoranged(monkeypatch):
    """One untimed call, then three samples of the ``autorange`` number of calls each (one
    call each without ``min_time``); each call takes 0.5 s of 1e9 FLOPs: 2 GFLOP/s."""
    clock = Clock()
    monkeypatch.setattr(bench, "time", types.SimpleNamespace(perf_counter=clock.perf_counter))
    step = stepper(clock, [0.5], 1)
    monkeypatch.setattr(bench, "_gemm_step", lambda xp, dtype, n: (step, 1e9))
    monkeypatch.setattr(bench, "autorange", lambda fn, sync, min_time: 4)
    assert bench.gemm_gflops(np, "float32", 8, 1, lambda: None, min_time=0.2) == pytest.approx(2.0)
    assert step.calls[0] == 1 + 3 * 4
    assert bench.gemm_gflops(np, "float32", 8, 1, lambda: None) == pytest.approx(2.0)
    assert step.calls[0] == 13 + 1 + 3


def test_the_module_step_runs_the_case_it_is_given():
    shape = bench.Shape(1, 6, 8, 2, False, window=2)
    m, x, dout, step = bench._make_npattn(shape, "float64", "array_api_strict", "blocked", 16, 32)
    assert (m.impl, m.block_q, m.block_k) == ("blocked", 16, 32)
    assert bench.backend_name(m.xp) == "array_api_strict"
    assert x.dtype == dout.dtype == m.xp.float64 and x.shape == (1, 6, 8)


def test_the_core_step_runs_the_case_it_is_given(monkeypatch):
    """--scope attention times the core's forward and backward on q, k, v of (B, H, L, D / H),
    with the shape's mask and the blocks given."""
    from npattn import attention

    calls = []
    for name in ("sdpa_forward", "sdpa_backward"):
        real = getattr(attention, name)
        monkeypatch.setattr(attention, name, lambda *a, _real=real, _name=name, **k:
                            calls.append((_name, a, k)) or _real(*a, **k))
    shape = bench.Shape(2, 6, 8, 2, True, window=2)
    xp, step = bench._make_core(shape, "float32", "array_api_strict", "auto", 16, 32)
    assert bench.backend_name(xp) == "array_api_strict"
    step()
    assert [c[0] for c in calls] == ["sdpa_forward", "sdpa_backward"]
    (_, (q, k, v), kw) = calls[0]
    assert q.shape == k.shape == v.shape == (2, 2, 6, 4) and q.dtype == xp.float32
    assert kw["is_causal"] is True and kw["window"] == (2, 0)
    assert (kw["impl"], kw["block_q"], kw["block_k"]) == ("auto", 16, 32)


def test_the_torch_step_computes_what_npattn_does_and_no_more(monkeypatch):
    """torch's step has the input's gradient to compute, as npattn's has (the sum of the
    three it returns for x, x, x), and no attention weights to average and return."""
    pytest.importorskip("torch")
    (shape,) = bench.parse_shapes("2x5x8x2c")
    m, x, dout, step = bench._make_npattn(shape, "float64", "numpy", "dense")
    tstep, _ = bench._make_torch(shape, "float64", m, x, dout)
    names = inspect.getclosurevars(tstep).nonlocals
    mha, tx = names["mha"], names["tx"]
    seen = []
    forward = mha.forward
    mha.forward = lambda *a, **k: seen.append(k) or forward(*a, **k)
    m(x, x, x, is_causal=True)
    dx = sum(np.asarray(g) for g in m.backward(dout))
    tstep()
    np.testing.assert_allclose(tx.grad.numpy(), dx, rtol=1e-10, atol=1e-12)
    assert seen[0]["need_weights"] is False


def test_the_peak_rss_is_read_from_vmhwm(monkeypatch):
    status = "Name:\tpython\nVmPeak:\t  9000 kB\nVmHWM:\t    700 kB\nVmRSS:\t    500 kB\n"
    monkeypatch.setattr(bench, "open", lambda path, mode="r": io.StringIO(status), raising=False)
    assert bench._hwm_kib() == 700  # the high-water mark, not the size now (VmRSS)

    def refused(path, mode="r"):
        raise PermissionError(path)

    monkeypatch.setattr(bench, "open", refused, raising=False)
    assert bench._hwm_kib() is None


def test_an_rss_rise_without_a_reading_before_is_none(monkeypatch):
    monkeypatch.setattr(bench, "open", lambda path, mode="r": io.StringIO(), raising=False)
    for readings in ([None, 3048], [1000, None]):
        values = iter(readings)
        monkeypatch.setattr(bench, "_hwm_kib", lambda: next(values))
        assert bench._rss_rise_mib(lambda: None, lambda: None) is None


def test_the_torch_device_peak_is_counted_above_what_was_allocated_before(monkeypatch):
    torch = pytest.importorskip("torch")
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda: 3 * 2**20)
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda: None)
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda: 10 * 2**20)
    assert bench._torch_cuda_peak_mib(lambda: None, lambda: None) == 7.0


def test_the_machine_memory_is_in_gib(monkeypatch):
    """/proc/meminfo's first line, MemTotal, is in KiB: 25165824 kB is 24 GiB."""
    real_open = open

    def fake_open(path, *a, **k):
        if path == "/proc/meminfo":
            return io.StringIO("MemTotal:       25165824 kB\nMemFree:         1048576 kB\n")
        return real_open(path, *a, **k)

    monkeypatch.setattr(bench, "open", fake_open, raising=False)
    assert bench.environment_info(np)["memory_gib"] == 24.0


def test_each_number_of_a_row_sits_under_its_own_header():
    cells = bench.format_row({"shape": "2x64x64x4", "ms": 1.2345, "number": 200, "gflops": 3.21,
                              "gemm_gflops": 50.0, "pct_gemm": 6.4, "peak_mib": 0.5,
                              "rss_mib": 1.26, "torch_ms": 0.66, "ratio": 1.87,
                              "ratio_min": 1.5}).split()
    assert cells == ["2x64x64x4", "1.23", "200", "3.2", "50.0", "6.4", "0.5", "1.3", "0.66",
                     "1.87", "1.50"]
    assert [c[0] for c in bench.COLUMNS] == ["shape", "ms", "n", "GFLOP/s", "GEMM", "%GEMM",
                                             "peak MiB", "RSS MiB", "torch ms", "ratio",
                                             "ratio(min)"]


def test_the_rss_note_is_given_once_when_any_row_needs_it():
    row = {"shape": "1x8x8x2", "ms": 1.0, "number": 1, "rss_mib": 2.0}
    table = bench.format_table([dict(row, rss_mib=0.0), row])
    assert table.splitlines()[-1] == f"note: {bench.RSS_NOTE}"


def test_run_refuses_a_dtype_its_backend_lacks_before_it_prints():
    out = io.StringIO()
    with pytest.raises(ValueError, match="--dtype float16: the array_api_strict backend has no"):
        bench.run([SHAPE], dtype="float16", backend="array_api_strict", out=out, progress=False)
    assert out.getvalue() == ""


def test_a_run_times_its_dtype_and_impl_on_every_side(monkeypatch):
    """The module, torch's step and both GEMMs get the run's dtype; the module its impl;
    the result says both, with the pause; the memory is read of npattn's step."""
    seen = {}
    result, _, _, _, (npattn, _) = fake_run(monkeypatch, memory=True, pause=0.5, dtype="float64",
                                            impl="blocked", seen=seen)
    assert seen["_make_npattn"][:4] == (SHAPE, "float64", "numpy", "blocked")
    assert seen["_make_torch"][:2] == (SHAPE, "float64")
    assert seen["_gemm_step"][1:] == ("float64", 8) and seen["gemm_gflops"][1:3] == ("float64", 8)
    assert seen["_peak_traced_mib"][0] is npattn and seen["_rss_rise_mib"][0] is npattn
    assert result["dtype"] == "float64" and result["pause_s"] == 0.5
    assert result["env"]["impl"] == "blocked"


def test_the_isolated_child_runs_the_case_it_is_given(monkeypatch):
    """Its impl, dtype, blocks and BLAS threads reach the step, and the row says them; with
    --gemm 0 it times no GEMM and has no rate of one."""
    import contextlib

    clock = Clock()
    monkeypatch.setattr(bench, "time", types.SimpleNamespace(perf_counter=clock.perf_counter))
    step = stepper(clock, [0.002], 1)
    made, held = [], []
    monkeypatch.setattr(bench, "_make_npattn", lambda *a: made.append(("module",) + a)
                        or (types.SimpleNamespace(xp=np), None, None, step))
    monkeypatch.setattr(bench, "_make_core", lambda *a: made.append(("attention",) + a) or (np, step))
    monkeypatch.setattr(bench, "_blas_limit", lambda n: held.append(n) or contextlib.nullcontext())
    monkeypatch.setattr(bench, "gemm_gflops", lambda *a: pytest.fail("--gemm 0 times a GEMM"))
    shape = bench.Shape(1, 8, 8, 2, False)
    for scope in ("module", "attention"):
        r = bench.measure_here(shape, impl="blocked", dtype="float64", repeat=3, warmup=1, gemm_n=0,
                               block_q=16, block_k=32, blas_threads=2, scope=scope)
        assert made[-1] == (scope, shape, "float64", "numpy", "blocked", 16, 32) and held[-1] == 2
        assert (r["repeat"], r["warmup"], r["dtype"], r["blas_threads"]) == (3, 1, "float64", 2)
        assert (r["block_q"], r["block_k"]) == (16, 32)
        assert r["gemm_gflops"] is None and r["pct_gemm"] is None


def test_the_auto_impl_has_blocks_where_it_takes_the_blocked_path():
    """An auto case reports the blocked path's blocks where auto's rule takes that path (a
    head of 2**25 scores in host memory, 4 dense arrays past half a device's memory), and
    none where it runs dense."""
    from npattn import blocked

    small, window = bench.Shape(1, 8, 8, 2, False), bench.Shape(1, 8, 8, 2, False, window=2)
    long, long_window = bench.Shape(1, 2**13, 8, 2, False), bench.Shape(1, 2**13, 8, 2, False, window=2)
    just_short = bench.Shape(1, 2**12, 8, 2, False)  # 2**24 scores a head, 2**25 in all
    assert bench.case_blocks(long, "auto") == (blocked.DEFAULT_BLOCK_Q, blocked.DEFAULT_BLOCK_K)
    assert bench.case_blocks(long_window, "auto") == (blocked.DEFAULT_BLOCK_Q, blocked.WINDOW_BLOCK_K)
    assert bench.case_blocks(long, "auto", 16, 32) == bench.case_blocks(small, "blocked", 16, 32) == (16, 32)
    for shape in (small, window, just_short):
        assert bench.case_blocks(shape, "auto") == bench.case_blocks(shape, "auto", 16, 32) == (None, None)
    assert bench.case_blocks(window, "blocked") == (blocked.DEFAULT_BLOCK_Q, blocked.WINDOW_BLOCK_K)
    assert bench.case_blocks(long, "dense", 16, 32) == bench.case_blocks(long, "reference") == (None, None)
    # on a device: 4 arrays of 2 * 8 * 8 float32 entries are 2048 bytes, past half of 4000
    defaults = (blocked.DEFAULT_BLOCK_Q, blocked.DEFAULT_BLOCK_K)
    assert bench.case_blocks(small, "auto", device_memory=4000) == defaults
    assert bench.case_blocks(small, "auto", device_memory=4200) == (None, None)
    assert bench.case_blocks(small, "auto", device_memory=8000, itemsize=8) == defaults


def test_the_isolated_child_runs_this_npattn(monkeypatch):
    """The child imports the npattn that started it, not another one installed on the path."""
    import subprocess
    import sys

    import npattn

    started = []
    monkeypatch.setattr(bench.subprocess, "run", lambda cmd, **k: started.append((cmd, k)) or
                        types.SimpleNamespace(returncode=0, stdout='{"ms": 1.0}\n', stderr=""))
    assert bench.measure_isolated(bench.Shape(1, 8, 8, 2, False), impl="dense") == {"ms": 1.0}
    (cmd, kw), = started
    assert cmd[:3] == [sys.executable, "-m", "npattn.tools.bench"] and cmd[3] == "--child"
    monkeypatch.undo()
    where = subprocess.run([sys.executable, "-c", "import npattn; print(npattn.__file__)"],
                           env=kw["env"], capture_output=True, text=True, cwd="/", check=True)
    assert where.stdout.strip() == npattn.__file__


def test_an_isolated_case_that_fails_or_times_out_is_told_on_stderr(monkeypatch, capsys):
    """The other cases still run; the failures are listed in the result and said on stderr,
    not in the table."""
    import subprocess

    def child(shape, **case):
        if shape.L == 16:
            raise subprocess.TimeoutExpired(["python"], 3600)
        if shape.L == 32:
            raise RuntimeError("npattn bench: the child failed with status -9")
        return dict(_isolated_row(shape=str(shape)), impl=case["impl"])

    monkeypatch.setattr(bench, "measure_isolated", child)
    plan = [(bench.Shape(1, n, 8, 2, False), "blocked") for n in (16, 8, 32)]
    out = io.StringIO()
    result = bench.run_isolated(plan, gemm_n=0, out=out)
    assert [r["shape"] for r in result["rows"]] == ["1x8x8x2"]
    assert [f["shape"] for f in result["failed"]] == ["1x16x8x2", "1x32x8x2"]
    assert (result["dtype"], result["gemm_n"]) == ("float32", 0)  # the run's settings, in its JSON
    err = capsys.readouterr().err
    assert "timed out after 3600 seconds" in err and "failed with status -9" in err
    assert "timed out" not in out.getvalue() and "status -9" not in out.getvalue()
def test_the_gpt_step_prints_every_round_and_the_median_without_torch(monkeypatch):
    """Each round's line shows that round's samples and ratio (rounds 2 to 4 of the samples
    above: 10 and 20 ms, 20 and 40, 50 and 15); the model's size is the model's count; with
    --no-torch the median of npattn's samples alone (30 10 20 50: 25 ms) and no ratio."""
    clock = Clock()
    monkeypatch.setattr(bench_gpt, "time", types.SimpleNamespace(perf_counter=clock.perf_counter))
    npattn = stepper(clock, [0.030, 0.010, 0.020, 0.050], 2, skip=1)
    torch = stepper(clock, [0.010, 0.020, 0.040, 0.015], 3, skip=1)
    model = types.SimpleNamespace(n_params=lambda: 123)
    monkeypatch.setattr(bench_gpt, "make_steps", lambda cfg, torch_side: (npattn, torch, model))
    monkeypatch.setattr(bench_gpt, "autorange", lambda fn, sync: {npattn: 2, torch: 3}[fn])
    out = io.StringIO()
    r = bench_gpt.run(bench_gpt.GPTBenchConfig(), repeat=4, warmup=1, out=out)
    lines = out.getvalue().splitlines()
    assert "  model: 123 parameters" in lines and r["n_params"] == 123
    assert [line for line in lines if line.startswith("  round")] == [
        "  round 1: npattn     30.0 ms  torch     10.0 ms  ratio 3.00",
        "  round 2: npattn     10.0 ms  torch     20.0 ms  ratio 0.50",
        "  round 3: npattn     20.0 ms  torch     40.0 ms  ratio 0.50",
        "  round 4: npattn     50.0 ms  torch     15.0 ms  ratio 3.33"]

    clock = Clock()
    monkeypatch.setattr(bench_gpt, "time", types.SimpleNamespace(perf_counter=clock.perf_counter))
    npattn = stepper(clock, [0.030, 0.010, 0.020, 0.050], 2)
    monkeypatch.setattr(bench_gpt, "make_steps", lambda cfg, torch_side: (npattn, None, model))
    monkeypatch.setattr(bench_gpt, "autorange", lambda fn, sync: 2)
    out = io.StringIO()
    r = bench_gpt.run(bench_gpt.GPTBenchConfig(), repeat=4, warmup=0, torch_compare=False, out=out)
    assert r["median_ms"] == pytest.approx({"npattn": 25.0}) and "ratio" not in r
    assert out.getvalue().splitlines()[-1] == "median: npattn 25.0 ms per step"
    assert "round 4: npattn     50.0 ms" in out.getvalue() and "torch" not in out.getvalue().split("\n", 1)[1]


def test_the_gpt_config_prints_its_sizes_and_defaults_to_the_documented_shape():
    """docs/gpt.md quotes the default run's first line: B=16 L=128 d_model=128 layers=4
    heads=4 vocab=96 float32."""
    assert str(bench_gpt.GPTBenchConfig(2, 3, 8, 1, 2, 5, "float64")) == (
        "B=2 L=3 d_model=8 layers=1 heads=2 vocab=5 float64")
    documented = "B=16 L=128 d_model=128 layers=4 heads=4 vocab=96 float32"
    assert str(bench_gpt.GPTBenchConfig()) == documented


def test_the_gpt_command_s_defaults_and_every_size_reach_its_run(monkeypatch):
    """With no options: the documented shape, 7 rounds after 2 warm-up steps, float32; every
    size given reaches the config, the dtype too."""
    calls = []
    monkeypatch.setattr(bench_gpt, "run", lambda cfg, **k: calls.append((cfg, k)) or {})
    assert bench_gpt.main(["--model", "gpt", "--no-torch"]) == 0
    cfg, kw = calls[-1]
    assert str(cfg) == "B=16 L=128 d_model=128 layers=4 heads=4 vocab=96 float32"
    assert kw == {"repeat": 7, "warmup": 2, "torch_compare": False}
    assert bench_gpt.main(["--model", "gpt", "--batch", "3", "--seq-len", "5", "--d-model", "6",
                           "--n-layer", "2", "--n-head", "3", "--vocab", "11", "--dtype", "float64",
                           "--no-torch"]) == 0
    assert str(calls[-1][0]) == "B=3 L=5 d_model=6 layers=2 heads=3 vocab=11 float64"


@pytest.mark.parametrize("flag", ["--batch", "--seq-len", "--d-model", "--n-layer", "--n-head",
                                  "--vocab"])
def test_the_gpt_step_refuses_a_size_of_zero(flag, monkeypatch, capsys):
    monkeypatch.setattr(bench_gpt, "run", lambda *a, **k: pytest.fail("ran"))
    with pytest.raises(SystemExit) as exc:
        bench_gpt.main(["--model", "gpt", flag, "0"])
    assert exc.value.code == 2
    assert f"{flag}: expected a positive integer, got 0" in capsys.readouterr().err


def test_the_gpt_step_s_memory_check_estimates_its_own_sizes(monkeypatch):
    """The memory check is given the estimate of the sizes asked for, in the dtype asked for:
    B=2, L=3 (the block size too), D=4, F=16, 3 blocks, 2 heads, V=7, float64:
    weights 7*4 + 3*4 + 3 * (4*16 + 2*4*16) = 616, held 4 times: 2464; logits and their
    gradient 2*2*3*7 = 84; per block 2*3*(2*4 + 16) + 2*2*3*3 = 180, three blocks 540;
    (2464 + 84 + 540) * 8 bytes."""
    seen = []
    monkeypatch.setattr(bench_gpt, "memory_error", lambda *a: seen.append(a) or None)
    monkeypatch.setattr(bench_gpt, "run", lambda cfg, **k: {})
    assert bench_gpt.main(["--model", "gpt", "--batch", "2", "--seq-len", "3", "--d-model", "4",
                           "--n-layer", "3", "--n-head", "2", "--vocab", "7", "--dtype", "float64",
                           "--no-torch"]) == 0
    ((option, received, need, _),) = seen
    assert option == "--batch, --seq-len, --d-model, --n-layer, --n-head, --vocab"
    assert received == "--batch 2 --seq-len 3 --d-model 4 --n-layer 3 --n-head 2 --vocab 7"
    assert need == (2464 + 84 + 540) * 8


def test_the_gpt_step_without_torch_is_an_error_that_names_no_torch(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "torch", None)  # import torch raises ImportError
    monkeypatch.setattr(bench_gpt, "run", lambda *a, **k: pytest.fail("ran"))
    assert bench_gpt.main(["--model", "gpt", "--batch", "1", "--seq-len", "2", "--d-model", "2",
                           "--n-layer", "1", "--n-head", "1", "--vocab", "3"]) == 2
    err = capsys.readouterr().err
    assert "torch is not installed" in err and "or pass --no-torch" in err
    # the CPU build first: the extra alone (torch>=2.5) pulls a multi-GB CUDA build
    assert "pip install torch==2.13.0" in err, err


def test_the_gpt_steps_train_the_same_model_alike():
    """The two timed steps do the same work: from the same weights and batch, three steps of
    npattn's and three of torch's (cross-entropy, clipping at 1.0, Adam at lr 1e-4) leave the
    same weights (float64), which neither the first step alone nor a step of another kind does."""
    torch = pytest.importorskip("torch")
    cfg = bench_gpt.GPTBenchConfig(batch=2, seq_len=5, d_model=8, n_layer=1, n_head=2, vocab=7,
                                   dtype="float64", seed=3)
    npattn_step, torch_step, model = bench_gpt.make_steps(cfg)
    torch_model = inspect.getclosurevars(torch_step).nonlocals["torch_model"]
    before = {k: v.detach().clone() for k, v in torch_model.state_dict().items()}
    for _ in range(3):
        npattn_step()
        torch_step()
    ours = model.to_torch().state_dict()
    theirs = torch_model.state_dict()
    assert ours.keys() == theirs.keys()
    for name in ours:
        assert ours[name].dtype == torch.float64
        torch.testing.assert_close(ours[name], theirs[name], rtol=1e-9, atol=1e-12, msg=name)
    assert any(not torch.equal(before[k], theirs[k]) for k in theirs)  # the steps moved the weights


def test_the_gpt_steps_optimise_the_same_mean_loss_when_clipping_does_nothing():
    """A batch whose gradient norm stays below 1.0: clipping leaves both steps alone, so only the
    same mean cross-entropy (not a sum, which clipping would hide) leaves the same weights."""
    torch = pytest.importorskip("torch")
    cfg = bench_gpt.GPTBenchConfig(batch=4, seq_len=6, d_model=8, n_layer=1, n_head=2, vocab=13,
                                   dtype="float64", seed=3)
    npattn_step, torch_step, model = bench_gpt.make_steps(cfg)
    torch_model = inspect.getclosurevars(torch_step).nonlocals["torch_model"]
    for _ in range(3):
        npattn_step()
        torch_step()
        norm = np.sqrt(sum(float(np.sum(np.asarray(g) ** 2)) for g in model.grads.values()))
        assert norm < 0.95, norm
    ours, theirs = model.to_torch().state_dict(), torch_model.state_dict()
    for name in ours:
        torch.testing.assert_close(ours[name], theirs[name], rtol=1e-9, atol=1e-12, msg=name)


def test_the_gpt_steps_without_torch_make_no_torch_model(monkeypatch):
    """--no-torch: make_steps builds no torch copy (torch need not be installed) and gives no torch step."""
    def refused(self):
        raise AssertionError("a torch model was made")

    monkeypatch.setattr(bench_gpt.GPT, "to_torch", refused)
    cfg = bench_gpt.GPTBenchConfig(batch=2, seq_len=5, d_model=8, n_layer=1, n_head=2, vocab=7, seed=3)
    npattn_step, torch_step, model = bench_gpt.make_steps(cfg, torch_side=False)
    assert torch_step is None
    before = {k: np.asarray(v).copy() for k, v in model.params.items()}
    npattn_step()
    assert any(not np.array_equal(np.asarray(v), before[k]) for k, v in model.params.items())


def test_the_available_memory_is_read_from_meminfo_or_the_physical_pages(monkeypatch):
    """MemAvailable's kB are KiB; a cgroup with no room left (0) is the smaller of the two, not
    missing; without either, the physical pages times their size."""
    GiB = 2**30
    meminfo = "MemTotal:  8000000 kB\nMemFree:  1000 kB\nMemAvailable:  2048 kB\n"

    def fake_open(path, *args, **kwargs):
        assert path == "/proc/meminfo"
        return io.StringIO(meminfo)

    monkeypatch.setattr(limits, "open", fake_open, raising=False)
    monkeypatch.setattr(limits, "cgroup_room", lambda: None)
    assert limits.available_memory() == 2048 * 1024
    monkeypatch.setattr(limits, "cgroup_room", lambda: 0)
    assert limits.available_memory() == 0
    monkeypatch.setattr(limits, "cgroup_room", lambda: 3 * GiB)
    assert limits.available_memory() == 2048 * 1024
    monkeypatch.setattr(limits, "_meminfo_available", lambda: 8 * GiB)
    monkeypatch.setattr(limits, "cgroup_room", lambda: None)
    assert limits.available_memory() == 8 * GiB
    # an unreadable MemAvailable line and no cgroup limit: the physical memory
    meminfo = "MemAvailable:  many kB\n"
    monkeypatch.undo()
    monkeypatch.setattr(limits, "open", fake_open, raising=False)
    monkeypatch.setattr(limits, "cgroup_room", lambda: None)
    pages = {"SC_PHYS_PAGES": 1000, "SC_AVPHYS_PAGES": 10, "SC_PAGE_SIZE": 4096}
    monkeypatch.setattr(limits.os, "sysconf", lambda name: pages[name])
    assert limits.available_memory() == 1000 * 4096


def test_huge_estimates_are_written_in_powers_of_ten():
    GiB = 2**30
    assert limits.format_bytes(1e4 * GiB) == "10000.0 GiB"
    assert limits.format_bytes(1e7 * GiB) == "1e+07 GiB"


def test_the_refusal_says_what_it_counted_and_refuses_with_no_memory_at_all():
    GiB = 2**30
    assert limits.memory_error("--x", "3", 2 * GiB, "the arrays", available=GiB) == (
        "--x: expected sizes whose arrays fit in the 1.0 GiB of memory available here, got 3, "
        "which needs at least 2.0 GiB (the arrays); choose smaller sizes, or pass "
        "--skip-memory-check to run anyway")
    assert limits.memory_error("--x", "3", 1, "y", available=0) is not None  # 0 bytes, not unknown


def test_the_cgroup_room_never_exceeds_its_limit(tmp_path):
    """A page cache larger than the usage (the counters are read one after the other) holds
    nothing, not less than nothing; an unreadable memory.stat counts no page cache."""
    (tmp_path / "memory.max").write_text("5000\n")
    (tmp_path / "memory.current").write_text("1000\n")
    (tmp_path / "memory.stat").write_text("active_file 3000\ninactive_file 0\n")
    assert limits.cgroup_room(str(tmp_path)) == 5000
    (tmp_path / "memory.stat").write_text("active_file lots\n")
    assert limits.cgroup_room(str(tmp_path)) == 4000


def test_a_cgroup_v2_without_a_limit_is_not_read_as_v1(tmp_path):
    """cgroup v2's memory.max "max" is no limit: the v1 files are read only where v2's cannot
    be (missing, or no number), so v1 files beside it do not lower the room."""
    (tmp_path / "memory.max").write_text("max\n")
    (tmp_path / "memory.current").write_text("1000\n")
    v1 = tmp_path / "memory"
    v1.mkdir()
    (v1 / "memory.limit_in_bytes").write_text("5000\n")
    (v1 / "memory.usage_in_bytes").write_text("1000\n")
    assert limits.cgroup_room(str(tmp_path)) is None
    (tmp_path / "memory.max").write_text("a limit\n")  # unreadable as a number: v1's is read
    assert limits.cgroup_room(str(tmp_path)) == 4000
    (tmp_path / "memory.max").unlink()  # no v2 limit file: v1's is read
    assert limits.cgroup_room(str(tmp_path)) == 4000


def test_the_repeated_entry_is_the_one_repeated():
    assert limits.repeated_entry([3, 1, 2, 1]) == 1
    assert limits.repeated_entry(["a", "b"]) is None
    assert limits.repeated_entry([4, 2, 2]) == 2  # one right after the other


def test_every_dense_impl_keeps_its_probabilities():
    """Only the blocked path, and auto where it turns blocked, keep none: the reference and
    NumPy paths keep them where auto would not."""
    from npattn import attention

    L = 1024
    H = attention.AUTO_BLOCKED_MAX_DENSE_SCORES // (L * L)
    assert limits.dense_probabilities(1, H, L, L, "auto") == 0
    for impl in ("dense", "reference", "numpy"):
        assert limits.dense_probabilities(1, H, L, L, impl) == H * L * L
    assert limits.dense_probabilities(2, 3, 4, 5, "blocked") == 0


def test_the_gpt_step_estimate_with_its_own_feed_forward_width():
    # as test_the_gpt_step_estimate_by_hand with F = 6: weights 7*4 + 5*4 + 2 * (4*16 + 2*4*6)
    # = 272, 4 times 1088; logits 84; per block 2*3*(2*4 + 6) = 84 and 36 probabilities: 2 * 120
    assert limits.gpt_training_bytes(2, 3, 5, 4, 2, 2, 7, 4, d_ff=6) == (1088 + 84 + 240) * 4


@pytest.mark.parametrize("kwargs, exc, words", [
    (dict(repeat=0), ValueError, ("repeat", "got 0")),
    (dict(repeat=2.0), TypeError, ("repeat",)),
    (dict(warmup=-1), ValueError, ("warmup", "got -1")),
])
def test_run_refuses_a_bad_repeat_or_warmup_before_timing_anything(monkeypatch, kwargs, exc, words):
    """bench.run is public: repeat=0 timed the GEMM and then failed in statistics.median with
    a StatisticsError naming nothing (main checked --repeat, run did not)."""
    timed = []
    monkeypatch.setattr(bench, "gemm_gflops", lambda *a: timed.append(a) or 100.0)
    out = io.StringIO()
    with pytest.raises(exc) as info:
        bench.run([SHAPE], gemm_n=8, torch_compare=False, memory=False, pause=0.0, min_sample=0.0,
                  out=out, progress=False, **kwargs)
    assert str(info.value).startswith(words[0]) and all(w in str(info.value) for w in words)
    assert timed == [] and out.getvalue() == ""


# ------------------------------------------------------- what the run hands on, and the GPU path


def test_the_shortest_sample_reaches_every_autorange_and_the_starting_gemm(monkeypatch):
    """--min-sample sets how long a sample of npattn's step, torch's and the GEMM's lasts, and
    how the GEMM timed at the start is sampled; the result says it."""
    seen = {}
    result, *_ = fake_run(monkeypatch, min_sample=0.125, seen=seen)
    assert seen["autorange"] == [0.125] * 3  # npattn, torch, the GEMM of the rounds
    assert seen["gemm_gflops"][-1] == 0.125 and result["min_sample_s"] == 0.125


def test_a_run_that_did_not_raise_the_rss_ends_with_its_note(monkeypatch):
    """An RSS rise below 0.05 MiB is noted once, under the table, not under its row; the row's
    other notes sit under it, past the shape column."""
    result, text, *_ = fake_run(monkeypatch, memory=True, rss=0.0, torch_error=RuntimeError("no kernel"))
    (row,) = result["rows"]
    assert row["rss_mib"] == 0.0 and bench.RSS_NOTE in row["notes"]
    lines = text.splitlines()
    assert lines[-1] == f"note: {bench.RSS_NOTE}" and text.count(bench.RSS_NOTE) == 1
    assert lines[-2] == " " * bench.COLUMNS[0][2] + " (torch: RuntimeError: no kernel)"


def test_on_the_gpu_the_memory_is_the_device_s_of_each_library(monkeypatch):
    """backend cupy: npattn's peak is read from CuPy's allocations and torch's from its CUDA
    allocator, each of its own step, the host RSS is not read, and the table has torch's
    device memory in place of the RSS column."""
    read = {}

    def reading(name, mib):
        return lambda step, sync: read.setdefault(name, step) and mib

    monkeypatch.setattr(bench, "backend_name", lambda xp: "cupy")
    monkeypatch.setattr(bench, "_sync_for", lambda xp: (lambda: None))
    monkeypatch.setattr(bench, "_cupy_peak_mib", reading("npattn", 3.5))
    monkeypatch.setattr(bench, "_torch_cuda_peak_mib", reading("torch", 9.5))
    result, text, events, _, (npattn, torch) = fake_run(monkeypatch, memory=True)
    (row,) = result["rows"]
    assert read == {"npattn": npattn, "torch": torch} and events == ["clear"]
    assert (row["peak_mib"], row["torch_peak_mib"], row["rss_mib"]) == (3.5, 9.5, None)
    lines = text.splitlines()
    assert bench.format_header(bench.GPU_COLUMNS) in lines
    assert lines[-1].split()[6:8] == ["3.5", "9.5"]  # peak MiB, torch MiB


def test_torch_without_cuda_is_no_comparison_for_the_cupy_backend(monkeypatch):
    """The data of the cupy backend lives on the GPU: where torch has no CUDA, torch's step is
    left out with the reason, not built on the CPU or failed on a missing device."""
    torch = pytest.importorskip("torch")
    (shape,) = bench.parse_shapes("1x4x4x2")
    m, x, dout, _ = bench._make_npattn(shape, "float32", "numpy", "dense")
    monkeypatch.setattr(bench, "backend_name", lambda xp: "cupy")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert bench._make_torch(shape, "float32", m, x, dout) == (None, "torch has no CUDA here (backend cupy)")


def test_each_torch_step_starts_from_zero_gradients():
    """npattn's backward writes its gradients afresh each step; torch's step clears its
    module's and its input's first, so that it does no accumulating either: two steps in a
    row leave the gradients of one."""
    torch = pytest.importorskip("torch")
    (shape,) = bench.parse_shapes("2x5x8x2c")
    m, x, dout, _ = bench._make_npattn(shape, "float64", "numpy", "dense")
    tstep, _ = bench._make_torch(shape, "float64", m, x, dout)
    names = inspect.getclosurevars(tstep).nonlocals
    mha, tx = names["mha"], names["tx"]
    tstep()
    once = {name: p.grad.clone() for name, p in mha.named_parameters()}
    dx = tx.grad.clone()
    tstep()
    for name, p in mha.named_parameters():
        assert torch.equal(p.grad, once[name]), name
    assert torch.equal(tx.grad, dx)


def test_the_environment_names_the_cpu_its_affinity_and_npattn_s_pool(monkeypatch):
    """The CPU is /proc/cpuinfo's model name (not its model number, on the line before), with
    the first processor's family and model numbers; the usable CPUs and npattn's pool threads
    are reported, and the pool's printed."""
    from npattn import backend

    real_open = open

    def fake_open(path, *a, **k):
        if path == "/proc/cpuinfo":
            return io.StringIO("processor\t: 0\ncpu family\t: 25\nmodel\t\t: 17\n"
                               "model name\t: Example CPU 9000: 8-Core\n\n"
                               "processor\t: 1\ncpu family\t: 26\nmodel\t\t: 2\n")
        return real_open(path, *a, **k)

    monkeypatch.setattr(bench, "open", fake_open, raising=False)
    env = bench.environment_info(np)
    assert env["cpu"] == "Example CPU 9000: 8-Core"
    assert env["cpu_id"] == "family 25 model 17"  # the first processor's, printed with the name
    if hasattr(os, "sched_getaffinity"):
        assert env["sched_affinity"] == len(os.sched_getaffinity(0))
    assert env["npattn_pool_threads"] == backend.pool_threads()
    out = io.StringIO()
    bench._print_env(env, "", "float32", out)
    assert f"npattn tile pool threads: {backend.pool_threads()}" in out.getvalue()
    assert "cpu: Example CPU 9000: 8-Core, family 25 model 17 (" in out.getvalue()


def test_the_cpu_s_family_and_model_are_left_out_where_cpuinfo_does_not_give_them(monkeypatch):
    """Without /proc/cpuinfo, or without its family line, the CPU has no family and model, and
    the reports print its name alone; with them, the Markdown report prints them too."""
    real_open = open
    text = {"/proc/cpuinfo": None}

    def fake_open(path, *a, **k):
        if path == "/proc/cpuinfo":
            if text[path] is None:
                raise OSError("no cpuinfo")
            return io.StringIO(text[path])
        return real_open(path, *a, **k)

    monkeypatch.setattr(bench, "open", fake_open, raising=False)
    assert bench._cpu_id() is None
    text["/proc/cpuinfo"] = "processor\t: 0\nmodel\t\t: 17\nmodel name\t: Example CPU\n"
    assert bench._cpu_id() is None  # a model number without its family tells nothing
    env = {"cpu": "Example CPU", "cpu_id": None, "cpu_count": 2}
    assert bench.cpu_text(env) == "Example CPU"
    assert bench.cpu_text({**env, "cpu_id": "family 6 model 207"}) == "Example CPU, family 6 model 207"


# ------------------------------------------------------- the isolated mode's child and tables


def test_a_dense_case_s_blocks_column_is_as_wide_as_its_header():
    """A plan of dense cases alone has no blocks to show (a ``-``): its column still takes the
    header's width, so the numbers after it stay under their headers."""
    widths = bench.isolated_widths([(bench.Shape(1, 8, 8, 2, False), "dense")])
    header = bench.format_isolated_header(widths)
    line = bench.format_isolated_row(_isolated_row(impl="dense", block_q=None, block_k=None), widths)
    import re

    def right_edges(text):  # where each column's text ends (right-aligned: the column's edge)
        return [m.end() for m in re.finditer(r"\S+", text)]

    header = header.replace("RSS before", "RSS_before").replace("peak RSS", "peak_RSS")
    assert line.split()[2] == "-" and right_edges(line) == right_edges(header)


def test_the_markdown_row_of_a_dense_case_run_without_warm_up():
    """No blocks is a ``-``, no warm-up adds nothing to the runs, and the BLAS threads held
    are named; several BLAS pools are each described, one after the other."""
    pools = [{"internal_api": "openblas", "version": "0.3.27", "threading_layer": "pthreads",
              "architecture": "Haswell", "num_threads": 4, "user_api": "blas", "prefix": "x"},
             {"internal_api": "mkl", "version": "2024.1", "threading_layer": "intel",
              "architecture": "SkylakeX", "num_threads": 8, "user_api": "blas", "prefix": "y"}]
    env = {"cpu": "x", "cpu_count": 2, "memory_gib": None, "threadpools": pools, "numpy": "2",
           "python": "3", "backend": "numpy"}
    r = _isolated_row(impl="dense", block_q=None, block_k=None, repeat=1, warmup=0, blas_threads=2)
    lines = bench.markdown_table({"env": env, "dtype": "float64", "rows": [r]}).splitlines()
    assert lines[0] == "- CPU: x, 2 logical cpus, RAM unknown"
    assert lines[1] == ("- BLAS: openblas 0.3.27 (pthreads, Haswell, 4 threads); "
                        "mkl 2024.1 (intel, SkylakeX, 8 threads)")
    head = [c.strip() for c in lines[-3].strip("|").split("|")]
    cells = dict(zip(head, (c.strip() for c in lines[-1].strip("|").split("|"))))
    assert (cells["impl"], cells["blocks (q, k)"], cells["runs"], cells["BLAS threads"]) == (
        "dense", "-", "1", "2")


def _finished(returncode, stdout="", stderr=""):
    return types.SimpleNamespace(returncode=returncode, stdout=stdout, stderr=stderr)


def test_a_child_killed_by_a_signal_has_failed(monkeypatch):
    """A child the kernel killed (out of memory: status -9) printed nothing; it is a failed
    case, told with the end of its standard error, not a result read from empty output."""
    shape = bench.Shape(1, 8, 8, 2, False)
    monkeypatch.setattr(bench.subprocess, "run", lambda cmd, **k: _finished(-9, "", "Killed\n"))
    with pytest.raises(RuntimeError, match=r"the child for 1x8x8x2 \(dense\) failed with status -9"):
        bench.measure_isolated(shape, impl="dense")
    stderr = "first line\n" + "x" * 5000 + "\nMemoryError: the last line"
    monkeypatch.setattr(bench.subprocess, "run", lambda cmd, **k: _finished(1, "", stderr))
    with pytest.raises(RuntimeError) as info:
        bench.measure_isolated(shape, impl="dense")
    assert str(info.value).endswith("MemoryError: the last line") and "first line" not in str(info.value)


def test_the_child_s_result_is_its_last_line_of_output(monkeypatch):
    """What a library prints on standard output before the child's JSON line is not the result."""
    monkeypatch.setattr(bench.subprocess, "run",
                        lambda cmd, **k: _finished(0, 'a library said something\n{"ms": 2.5}\n'))
    assert bench.measure_isolated(bench.Shape(1, 8, 8, 2, False), impl="dense") == {"ms": 2.5}


@pytest.mark.parametrize("stdout", ["", "\n", "a library said something\n", '{"ms": 2.5\n', "[1, 2]\n"])
def test_a_child_that_exits_0_without_a_result_has_failed(monkeypatch, stdout):
    """A child that exits 0 but whose last line of output is no JSON object is a failed case,
    told with that output's end (run_isolated then goes on with the other cases), not a
    JSONDecodeError or IndexError that ends the whole run and loses the cases measured."""
    shape = bench.Shape(1, 8, 8, 2, False)
    monkeypatch.setattr(bench.subprocess, "run",
                        lambda cmd, **k: _finished(0, stdout, "Warning: the reason\n"))
    told = r"the child for 1x8x8x2 \(dense\) exited 0 without a result"
    with pytest.raises(RuntimeError, match=told) as info:
        bench.measure_isolated(shape, impl="dense")
    assert stdout.strip() in str(info.value) and "Warning: the reason" in str(info.value)


def test_the_isolated_child_runs_this_npattn_before_another_on_pythonpath(monkeypatch, tmp_path):
    """An npattn found on PYTHONPATH is not the one the child imports: this one comes first."""
    import subprocess

    import npattn

    other = tmp_path / "npattn"
    other.mkdir()
    (other / "__init__.py").write_text("")
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    started = []
    monkeypatch.setattr(bench.subprocess, "run", lambda cmd, **k: started.append(k) or _finished(0, "{}"))
    bench.measure_isolated(bench.Shape(1, 8, 8, 2, False), impl="dense")
    (kw,) = started
    monkeypatch.undo()
    where = subprocess.run([sys.executable, "-c", "import npattn; print(npattn.__file__)"],
                           env=kw["env"], capture_output=True, text=True, cwd="/", check=True)
    assert where.stdout.strip() == npattn.__file__


def test_counts_at_their_limits_are_taken_and_threads_set_the_pool(monkeypatch):
    """The largest GEMM (past the memory check), tile pool and blocks allowed are taken, not
    refused by the argument checks; --threads is handed to npattn's tile pool through
    NPATTN_NUM_THREADS, as its help says."""
    monkeypatch.setenv("NPATTN_NUM_THREADS", "1")  # restored afterwards
    calls = _captured(monkeypatch, "run")
    assert bench.main(["--shapes", "1x4x4x2", "--gemm", str(limits.MAX_SIZE), "--skip-memory-check",
                       "--threads", str(limits.MAX_THREADS)]) == 0  # (its arrays would not fit)
    assert calls[-1][1]["gemm_n"] == limits.MAX_SIZE
    assert os.environ["NPATTN_NUM_THREADS"] == str(limits.MAX_THREADS)
    isolated = _captured(monkeypatch, "run_isolated")
    assert bench.main(["--isolated", "--shapes", "1x4x4x2", "--impl", "blocked", "--gemm", "0",
                       "--block-q", str(limits.MAX_SIZE), "--block-k", "1"]) == 0
    assert (isolated[-1][1]["block_q"], isolated[-1][1]["block_k"]) == (limits.MAX_SIZE, 1)


def test_the_isolated_child_refuses_a_dtype_its_backend_lacks_by_name():
    """measure_here resolves auto's blocks with an array of the case's dtype: one the backend
    lacks is the ValueError naming --dtype, not an AttributeError of the namespace."""
    pytest.importorskip("array_api_strict")
    with pytest.raises(ValueError, match=r"^--dtype float16: the array_api_strict backend has no float16 "):
        bench.measure_here(bench.Shape(1, 8, 8, 2, False), impl="auto", dtype="float16",
                           backend="array_api_strict")
