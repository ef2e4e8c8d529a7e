"""The benchmark's parsing, FLOP count and command line (no timing assertions)."""

import io
import json
import re
import sys

import numpy as np
import pytest

from npattn.tools import bench


def test_parse_shapes():
    assert bench.parse_shapes("32x128x256x8, 4x1024x768x12c") == (
        bench.Shape(32, 128, 256, 8, False),
        bench.Shape(4, 1024, 768, 12, True),
    )
    assert bench.parse_shapes("8x512x768x12d0.1,2x4x4x2cd0.25") == (
        bench.Shape(8, 512, 768, 12, False, 0.1),
        bench.Shape(2, 4, 4, 2, True, 0.25),
    )
    assert str(bench.Shape(2, 4, 4, 2, True, 0.25)) == "2x4x4x2cd0.25"  # what the child parses
    # each refusal names --shapes, what it expected and the item it got
    like = "expected items like 32x128x256x8, 4x1024x768x12c, 1x16384x512x8w256 or 8x512x768x12d0.1, got "
    for bad, message in [("2x3", like + "'2x3'"), ("axbxcxd", like + "'axbxcxd'"),
                         ("2x4x4x2d", like + "'2x4x4x2d'"),
                         ("2x4x6x4", "'2x4x6x4' needs positive sizes and D divisible by H"),
                         ("0x4x8x2", "'0x4x8x2' needs positive sizes and D divisible by H"),
                         ("", "no shape in ''"),
                         ("2x4x4x2d1.5", "'2x4x4x2d1.5': the dropout after d must be in [0, 1)")]:
        with pytest.raises(ValueError, match=re.escape(f"--shapes: {message}")):
            bench.parse_shapes(bad)


@pytest.mark.parametrize("text, number", [
    ("32x128x256x8,,1x4096x512x8", "number 2 of 3"),
    ("1x8x8x2,", "number 2 of 2"),
    (",1x8x8x2", "number 1 of 2"),
    ("1x8x8x2, ,2x8x8x2", "number 2 of 3"),
])
def test_parse_shapes_refuses_an_empty_item(text, number):
    """A shape left out between commas, or a trailing comma, is named, not skipped."""
    with pytest.raises(ValueError) as exc:
        bench.parse_shapes(text)
    message = str(exc.value)
    assert message.startswith("--shapes: expected comma-separated shapes")
    assert f"got an empty item ({number}) in {text!r}" in message


def test_flops_counts_projections_and_half_causal_attention():
    # B=2, L=3, D=4: projections 4 GEMMs forward (2*6*4*4 each), twice that backward
    proj = 3 * 4 * (2 * 6 * 4 * 4)
    # attention: q k^T and a v forward, four matmuls backward, each 2*B*L*L*D
    attn = 6 * (2 * 2 * 3 * 3 * 4)
    assert bench.flops(bench.Shape(2, 3, 4, 2, False)) == proj + attn
    assert bench.flops(bench.Shape(2, 3, 4, 2, True)) == proj + attn / 2


def test_main_runs_and_writes_json(tmp_path, capsys):
    path = tmp_path / "out.json"
    rc = bench.main(["--shapes", "2x8x8x2,1x8x8x2c,2x8x8x2d0.2", "--repeat", "5", "--warmup", "1",
                     "--gemm", "32", "--pause", "0", "--min-sample", "0.005",
                     "--json", str(path)])
    assert rc == 0
    result = json.loads(path.read_text())
    assert [r["shape"] for r in result["rows"]] == ["2x8x8x2", "1x8x8x2c", "2x8x8x2d0.2"]
    assert result["min_sample_s"] == 0.005
    for row in result["rows"]:
        assert len(row["ms_all"]) == 5 and row["ms"] > 0 and row["gflops"] > 0
        assert row["peak_mib"] is not None and row["peak_mib"] >= 0
        assert row["number"] >= 1 and row["gemm_number"] >= 1  # steps per sample
        assert (row["torch_number"] is None) == (row["torch_ms"] is None)
    printed = capsys.readouterr().out
    assert "2x8x8x2" in printed and "GEMM" in printed


def test_json_rows_carry_every_field_of_their_shape(tmp_path):
    """A row's B, L, D, H, causal and window left out its dropout: the rows of 2x8x8x2 and
    2x8x8x2d0.2 read alike but for the shape string. Each row's fields rebuild its Shape."""
    path, iso = tmp_path / "out.json", tmp_path / "iso.json"
    assert bench.main(["--shapes", "2x8x8x2,2x8x8x2cd0.2", "--repeat", "5", "--warmup", "0",
                       "--gemm", "8", "--pause", "0", "--min-sample", "0", "--no-torch",
                       "--no-memory", "--no-progress", "--json", str(path)]) == 0
    assert bench.main(["--isolated", "--shapes", "1x8x8x2w2d0.5", "--impl", "blocked", "--gemm", "0",
                       "--json", str(iso)]) == 0
    rows = json.loads(path.read_text())["rows"] + json.loads(iso.read_text())["rows"]
    for row in rows:
        shape = bench.Shape(*(row[f] for f in bench.Shape._fields))
        assert str(shape) == row["shape"]
    assert [row["dropout"] for row in rows] == [0.0, 0.2, 0.5]


def test_isolated_mode_measures_each_case_in_a_child(tmp_path, capsys):
    path, md = tmp_path / "iso.json", tmp_path / "iso.md"
    rc = bench.main(["--isolated", "--shapes", "1x16x8x2", "--impl", "blocked", "--repeat", "2",
                     "--gemm", "16", "--json", str(path), "--markdown", str(md)])
    assert rc == 0
    (row,) = json.loads(path.read_text())["rows"]
    assert row["shape"] == "1x16x8x2" and row["impl"] == "blocked" and len(row["ms_all"]) == 2
    assert row["ms"] > 0 and row["gflops"] > 0 and row["gemm_gflops"] > 0
    assert row["peak_rss_mib"] >= row["rss_before_mib"] > 0
    assert "peak RSS" in capsys.readouterr().out
    assert "| 1x16x8x2 | blocked |" in md.read_text()


def test_an_isolated_case_that_fails_keeps_the_others(tmp_path, capsys, monkeypatch):
    """A child that fails (here out of memory) ended the parent in a traceback that lost the
    cases already measured: they are written, the failure is reported, the status is 1."""
    monkeypatch.setattr(bench, "memory_refusal", lambda *a, **k: None)  # let the child fail
    path, md = tmp_path / "iso.json", tmp_path / "iso.md"
    rc = bench.main(["--isolated", "--shapes", "1x16x8x2,99999999x99999x4x2", "--impl", "dense",
                     "--gemm", "0", "--json", str(path), "--markdown", str(md)])
    assert rc == 1
    data = json.loads(path.read_text())
    assert [r["shape"] for r in data["rows"]] == ["1x16x8x2"]
    assert [f["shape"] for f in data["failed"]] == ["99999999x99999x4x2"]
    assert "| 1x16x8x2 | dense |" in md.read_text()
    assert "1 of the cases failed: 99999999x99999x4x2 (dense)" in capsys.readouterr().err


def test_window_shapes_and_the_attention_scope(tmp_path):
    """A window shape parses, counts only its attended pairs, and runs on the module and
    on the attention core alone (--scope attention) in an isolated child."""
    (w,) = bench.parse_shapes("1x32x8x2w4")
    assert w.window == 4 and str(w) == "1x32x8x2w4"
    full = bench.parse_shapes("1x32x8x2")[0]
    pairs = 32 * 5 - 4 * 5 / 2  # query i attends min(i, 4) + 1 keys
    assert bench.flops(w) == 24.0 * 32 * 64 + 12.0 * pairs * 8
    assert bench.flops(w) < bench.flops(full)
    for scope in ("module", "attention"):
        path = tmp_path / f"{scope}.json"
        assert bench.main(["--isolated", "--shapes", "1x32x8x2w4", "--impl", "blocked", "--gemm", "0",
                           "--scope", scope, "--json", str(path)]) == 0
        (row,) = json.loads(path.read_text())["rows"]
        assert row["scope"] == scope and row["window"] == 4 and row["ms"] > 0
        assert row["block_k"] == 128  # the window's key blocks
    with pytest.raises(SystemExit):
        bench.main(["--scope", "attention"])  # needs --isolated


def test_main_rejects_bad_options(capsys):
    with pytest.raises(SystemExit):
        bench.main(["--repeat", "3"])
    with pytest.raises(SystemExit):
        bench.main(["--shapes", "1x2x3"])
    for isolated_only in (["--block-q", "16"], ["--markdown", "x.md"]):
        with pytest.raises(SystemExit):
            bench.main(isolated_only)
    capsys.readouterr()
    with pytest.raises(SystemExit):
        bench.main(["--isolated", "--impl", "dense"])  # the default plan sets its own impl
    assert ("--impl: with --isolated, expected --shapes too (ISOLATED_PLAN sets the impl of each "
            "of its cases), got --impl dense without --shapes") in capsys.readouterr().err


SMALL = ["--shapes", "1x8x8x2", "--repeat", "5", "--warmup", "0", "--no-torch", "--no-memory",
         "--gemm", "64", "--no-progress"]


@pytest.mark.parametrize("argv, message", [
    (SMALL + ["--json", "/nonexistent-npattn/b.json"], "--json: the directory"),
    (SMALL + ["--json", "."], "--json: expected a file path, got the directory"),
    (SMALL + ["--isolated", "--markdown", "/nonexistent-npattn/m.md"], "--markdown: the directory"),
    (SMALL + ["--impl", "numpy", "--backend", "array_api_strict"],
     "--impl numpy: the NumPy kernel needs --backend numpy, got --backend array_api_strict"),
    (["--model", "gpt", "--json", "/nonexistent-npattn/g.json"], "--json: the directory"),
    # two outputs on one file (the later overwrote the earlier), '-' for a file-only output
    # (a file named '-'), an empty --shapes (the whole default benchmark ran), sizes past
    # BLAS's 32 bits and thread counts past a C int (tracebacks)
    (SMALL + ["--isolated", "--json", "same.out", "--markdown", "same.out"],
     "--json and --markdown: expected two different outputs, got 'same.out' for both"),
    (SMALL + ["--isolated", "--markdown", "-"], "--markdown: expected a file path, got '-'"),
    (["--shapes", "", "--no-torch"], "--shapes: no shape in ''"),
    (["--shapes", "1x8x8x2,,2x8x8x2", "--no-torch"],
     "--shapes: expected comma-separated shapes such as 32x128x256x8,4x1024x768x12c, got an empty item "
     "(number 2 of 3) in '1x8x8x2,,2x8x8x2'"),
    (["--shapes", "99999999999x99999999999x4x2"], "needs sizes of at most 2147483647"),
    (SMALL + ["--gemm", "99999999999"],
     "--gemm: expected a positive size of at most 2147483647, got 99999999999"),
    (SMALL + ["--blas-threads", "99999999999999999999"], "--blas-threads: expected an integer in [1, 4096]"),
])
def test_unusable_outputs_and_impls_are_refused_before_any_timing(argv, message, capsys):
    """Each was found out after the whole run, in a traceback that lost the timings."""
    from npattn.tools import cli

    with pytest.raises(SystemExit) as exc:
        cli.main(["bench", *argv])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


class _FakeTerminal(io.StringIO):
    def isatty(self):
        return True


def test_json_dash_prints_only_json_on_stdout(capsys, monkeypatch):
    term = _FakeTerminal()
    monkeypatch.setattr(sys, "stderr", term)
    rc = bench.main(["--shapes", "2x8x8x2", "--repeat", "5", "--warmup", "0", "--gemm", "16",
                     "--pause", "0", "--min-sample", "0.001", "--no-torch", "--json", "-"])
    assert rc == 0
    result = json.loads(capsys.readouterr().out)  # nothing but the JSON
    assert [r["shape"] for r in result["rows"]] == ["2x8x8x2"]
    err = term.getvalue()
    assert bench.format_header() in err and "2x8x8x2" in err  # the table went to stderr
    assert "bench:" in err and "5/5" in err  # and the progress bar, on a terminal


def test_json_dash_of_the_gpt_and_dask_benchmarks(tmp_path, monkeypatch, capsys):
    """--json - prints the JSON alone on stdout for --model gpt and --backend dask too (they wrote
    a file named '-', the table on stdout)."""
    from npattn.tools import cli

    monkeypatch.chdir(tmp_path)
    assert cli.main(["bench", "--model", "gpt", "--batch", "1", "--seq-len", "4", "--d-model", "8",
                       "--n-layer", "1", "--n-head", "2", "--vocab", "5", "--repeat", "1",
                       "--warmup", "0", "--no-torch", "--json", "-"]) == 0
    captured = capsys.readouterr()
    assert json.loads(captured.out)["n_params"] > 0 and "median: npattn" in captured.err
    pytest.importorskip("distributed")
    assert cli.main(["bench", "--backend", "dask", "--shape", "1x8x16x2", "--q-chunk", "4",
                     "--k-chunk", "4", "--graph-only", "--json", "-"]) == 0
    captured = capsys.readouterr()
    assert json.loads(captured.out)["graph"] and "pairs" in captured.err
    assert not (tmp_path / "-").exists()


def test_no_progress_is_taken_by_every_benchmark_mode(tmp_path, capsys):
    """--no-progress, the main benchmark's flag, is accepted by --model gpt and --backend dask
    too (they drew no bar and refused it as an unknown argument)."""
    from npattn.tools import cli

    assert cli.main(["bench", "--model", "gpt", "--batch", "1", "--seq-len", "4", "--d-model", "8",
                     "--n-layer", "1", "--n-head", "2", "--vocab", "5", "--repeat", "1",
                     "--warmup", "0", "--no-torch", "--no-progress"]) == 0
    assert "median: npattn" in capsys.readouterr().out
    pytest.importorskip("distributed")
    assert cli.main(["bench", "--backend", "dask", "--shape", "1x8x16x2", "--q-chunk", "4",
                     "--k-chunk", "4", "--graph-only", "--no-progress"]) == 0
    assert "pairs" in capsys.readouterr().out


def test_autorange_repeats_a_step_until_a_sample_lasts_long_enough(monkeypatch):
    clock = [0.0]
    monkeypatch.setattr(bench.time, "perf_counter", lambda: clock[0])

    def step_of(seconds):
        def step():
            clock[0] += seconds
        return step

    sync = lambda: None  # noqa: E731
    assert bench.autorange(step_of(0.03), sync, 0.2) == 10  # 5 steps: 0.15 s, 10: 0.3 s
    assert bench.autorange(step_of(0.05), sync, 0.2) == 5
    assert bench.autorange(step_of(0.5), sync, 0.2) == 1  # a long step: one per sample
    assert bench.autorange(step_of(3e-5), sync, 0.2) == 10000
    assert bench._timed(step_of(0.03), sync, 10) == pytest.approx(0.03)  # seconds per step


def _row(**values):
    row = {"shape": "2x64x64x4", "ms": 1.2345, "number": 200, "gflops": 3.21,
           "gemm_gflops": 50.0, "pct_gemm": 6.4, "peak_mib": 0.5, "rss_mib": 1.26,
           "torch_ms": 0.66, "ratio": 1.87, "ratio_min": 1.5, "torch_note": None}
    row.update(values)
    return row


def _column_ends():
    ends, start = [], 0
    for _, _, width, _ in bench.COLUMNS:
        ends.append(start + width - 1)  # the last character of the column
        start += width + 1  # one space between columns
    return ends


def test_missing_values_are_dashes_at_the_right_edge_of_their_column():
    header = bench.format_header()
    missing = ("peak_mib", "rss_mib", "torch_ms", "ratio", "ratio_min")
    full, gaps = bench.format_row(_row()), bench.format_row(_row(**dict.fromkeys(missing)))
    assert len(full) == len(gaps) == len(header)
    for (title, key, _, _), end in zip(bench.COLUMNS, _column_ends()):
        assert header[end] != " " and header[end + 1:end + 2] in ("", " "), title
        assert full[end] != " ", title
        if key in missing:
            assert gaps[end] == "-" and gaps[end - 1] == " ", (title, gaps)
    assert gaps.split()[-5:] == ["-"] * 5


def test_rss_that_did_not_rise_is_shown_below_a_tenth_and_explained():
    assert bench.format_mib(0.0) == "<0.1" and bench.format_mib(0.04) == "<0.1"
    assert bench.format_mib(0.26) == "0.3" and bench.format_mib(None) == "-"
    table = bench.format_table([_row(rss_mib=0.0), _row(shape="8x512x768x12", rss_mib=0.0)])
    lines = table.splitlines()
    assert lines[1].split()[7] == "<0.1"
    assert " 0.0 " not in lines[1]
    assert table.count("allocator reused memory") == 1 and lines[-1].startswith("note: RSS")
    assert "allocator" not in bench.format_table([_row()])
    assert bench.RSS_NOTE in bench.row_notes(_row(rss_mib=0.0))


def test_pct_gemm_above_100_is_warned_under_its_row():
    assert bench.row_notes(_row(pct_gemm=99.9)) == []
    (note,) = bench.row_notes(_row(pct_gemm=332.9))
    assert note.startswith("%GEMM > 100: the reference GEMM was slowed by load") and "rerun" in note
    lines = bench.format_table([_row(pct_gemm=332.9), _row(shape="1x8x8x2")]).splitlines()
    assert "332.9" in lines[1] and lines[2].strip() == f"({note})" and "1x8x8x2" in lines[3]


def test_torch_notes_go_under_the_row():
    lines = bench.format_table([_row(torch_ms=None, ratio=None, ratio_min=None,
                                     torch_note="torch not installed")]).splitlines()
    assert lines[2].strip() == "(torch: torch not installed)"


def test_float16_without_such_a_dtype_is_a_value_error():
    import array_api_strict

    with pytest.raises(ValueError, match="--dtype float16: the array_api_strict backend has no"):
        bench.check_dtype(array_api_strict, "float16")
    with pytest.raises(ValueError, match=r"\(the Array API standard defines float32 and float64, "
                                         r"not float16\); choose float32 or float64"):
        bench.check_dtype(array_api_strict, "float16")
    assert bench.check_dtype(np, "float16") is np.float16


@pytest.mark.parametrize("option", [["--pause", "-1"], ["--pause", "nan"], ["--min-sample", "-0.1"]])
def test_bad_timing_options_are_usage_errors(option, capsys):
    with pytest.raises(SystemExit) as exc:
        bench.main(option)
    assert exc.value.code == 2
    assert f"{option[0]}: expected a finite number of seconds" in capsys.readouterr().err


def _needed_gib(err):
    return float(err.split("needs at least ")[1].split(" GiB")[0])


@pytest.mark.parametrize("argv, option, received, lowest", [
    # the dask graph of (2e9 / 1024)**2 chunk pairs was being built for minutes (each size under
    # limits.MAX_SIZE, which is refused first)
    (["--backend", "dask", "--shape", "1x2000000000x16x2"], "--shape", "1x2000000000x16x2",
     (2e9 / 1024) ** 2 * 1024 / 2**30),
    # a GPT step over 16 windows of 1e8 tokens: its position embedding alone is 1e8 x 128 floats
    (["--model", "gpt", "--seq-len", "100000000"], "--seq-len", "100000000", 1e8 * 128 * 4 / 2**30),
    # the dense probabilities of 8 heads of 100000 x 100000
    (["--shapes", "1x100000x512x8", "--impl", "dense", "--no-torch"], "--shapes", "1x100000x512x8",
     8 * 1e5**2 * 4 / 2**30),
])
def test_sizes_past_the_memory_are_usage_errors(argv, option, received, lowest, capsys, monkeypatch):
    """Each started computing and ran for minutes; now refused before anything is computed,
    with an estimate of what it needs (at least the arrays named in `lowest`). On a machine
    of 64 GiB, whatever this one has (with 320 GiB free the dense case would run)."""
    from npattn.tools import cli, limits

    monkeypatch.setattr(limits, "available_memory", lambda: 64 * 2**30)

    with pytest.raises(SystemExit) as exc:
        cli.main(["bench", *argv])
    err = capsys.readouterr().err
    assert exc.value.code == 2
    assert option in err and received in err and "64.0 GiB of memory available here" in err, err
    assert _needed_gib(err) >= lowest


# the smallest run of each mode, quick but past an available memory of 1 byte, and a line of its table
SMALLEST_RUNS = {
    "bench": (["--shapes", "1x4x4x2", "--repeat", "5", "--warmup", "0", "--gemm", "4", "--pause", "0",
               "--min-sample", "0", "--no-torch", "--no-memory", "--no-progress"], "1x4x4x2"),
    "gpt": (["--model", "gpt", "--batch", "1", "--seq-len", "4", "--d-model", "8", "--n-layer", "1",
             "--n-head", "2", "--vocab", "5", "--repeat", "1", "--warmup", "0", "--no-torch"],
            "median: npattn"),
    "dask": (["--backend", "dask", "--shape", "1x8x16x2", "--q-chunk", "4", "--k-chunk", "4",
              "--graph-only"], "pairs"),
}


@pytest.mark.parametrize("mode", list(SMALLEST_RUNS))
def test_skip_memory_check_runs_what_the_estimate_refuses(mode, capsys, monkeypatch):
    """A run past the memory available was refused with no way round it (swap is not counted,
    a container may misreport): every mode takes --skip-memory-check, which skips the check,
    and the refusal names it."""
    from npattn.tools import cli, limits

    if mode == "dask":
        pytest.importorskip("distributed")
    argv, ran = SMALLEST_RUNS[mode]
    monkeypatch.setattr(limits, "available_memory", lambda: 1)
    with pytest.raises(SystemExit) as exc:
        cli.main(["bench", *argv])
    err = capsys.readouterr().err
    assert exc.value.code == 2
    assert err.rstrip().endswith("choose smaller sizes, or pass --skip-memory-check to run anyway"), err
    assert cli.main(["bench", *argv, "--skip-memory-check"]) == 0
    captured = capsys.readouterr()
    assert "memory available" not in captured.err and ran in captured.out, captured


@pytest.mark.parametrize("argv", [[], ["--model", "gpt"], ["--backend", "dask"]],
                         ids=["bench", "gpt", "dask"])
def test_every_benchmark_mode_lists_skip_memory_check(argv, capsys):
    from npattn.tools import cli

    with pytest.raises(SystemExit) as exc:
        cli.main(["bench", *argv, "--help"])
    assert exc.value.code == 0
    assert "--skip-memory-check" in capsys.readouterr().out


def test_a_repeated_worker_count_is_a_usage_error(capsys):
    """--workers 1,1 ran a second cluster of one worker, its "speed-up" 1.0."""
    from npattn.tools import cli

    with pytest.raises(SystemExit) as exc:
        cli.main(["bench", "--backend", "dask", "--shape", "1x8x16x2", "--workers", "1,2,1"])
    assert exc.value.code == 2
    assert "--workers: expected each worker count once, got 1 more than once" in capsys.readouterr().err


def test_the_documented_shapes_pass_the_memory_check():
    """The default shapes, the isolated plan and the shapes of docs/performance.md fit in 4 GiB
    (their estimates are lower bounds: nothing runs here)."""
    from npattn.tools import bench_dask, limits

    docs = bench.parse_shapes("32x128x256x8,4x1024x768x12c,8x512x768x12d0.1,1x4096x512x8w256,"
                              "1x8192x512x8,1x16384x512x8c,1x16384x512x8w256")
    cases = ([(s, "dense") for s in bench.DEFAULT_SHAPES] + list(bench.ISOLATED_PLAN)
             + [(s, "blocked") for s in docs] + [(s, "auto") for s in docs])
    assert bench.memory_refusal(cases, available=4 * 2**30) is None
    assert bench.memory_refusal(cases, scope="attention", available=4 * 2**30) is None
    assert bench.memory_refusal(cases) is None  # and here
    dask = bench_dask.parse_shape(bench_dask.DEFAULT_SHAPE)
    assert bench_dask.run_bytes(dask, 4, 1024, 1024)[0] < 4 * 2**30
    assert limits.gpt_training_bytes(16, 128, 128, 128, 4, 4, 96, 4) < 4 * 2**30  # --model gpt
    # and the same dense shape is refused where it cannot fit
    big = bench.parse_shapes("1x16384x512x8")[0]
    assert "--shapes: expected sizes" in bench.memory_refusal([(big, "dense")], available=4 * 2**30)


def test_a_gemm_that_cannot_fit_is_refused_before_anything_runs(capsys):
    """--gemm counts in the memory check: its float64 draw and three n x n arrays in the
    dtype (2048: 80 MiB in float32); a size past the memory is a usage error naming --gemm,
    before any step runs, and --skip-memory-check lets it through."""
    gib = 2**30
    assert bench.gemm_refusal(2048, "float32", available=80 * 2**20) is None  # 2048^2 (8 + 12) B
    why = bench.gemm_refusal(2048, "float32", available=80 * 2**20 - 1)
    assert why.startswith("--gemm: expected sizes") and "got 2048" in why
    assert bench.gemm_refusal(2048, "float64", available=128 * 2**20 - 1) is not None
    assert bench.gemm_refusal(2048, "float64", available=128 * 2**20) is None  # 8 + 24 B each
    assert bench.gemm_refusal(16384, "float16", available=4 * gib - 1) is None  # 14 B: 3.5 GiB
    # run holds the GEMM's inputs and product while each step runs: a shape and a GEMM that
    # each fit alone but not together are refused, naming both
    shape = bench.parse_shapes("1x64x4x2")[0]  # 39168 bytes dense
    gemm_held = 3 * 64 * 64 * 4  # 49152 bytes
    alone = max(39168, 64 * 64 * 20)
    assert bench.memory_refusal([(shape, "dense")], available=alone) is None
    assert bench.gemm_refusal(64, available=alone) is None
    why = bench.memory_refusal([(shape, "dense")], available=39168 + gemm_held - 1, gemm_n=64)
    assert "got 1x64x4x2 (--impl dense)" in why and "--gemm 64's three arrays" in why
    assert bench.memory_refusal([(shape, "dense")], available=39168 + gemm_held, gemm_n=64) is None
    with pytest.raises(SystemExit) as exc:
        bench.main(["--gemm", "10000000", "--shapes", "2x8x8x2", "--no-progress"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "--gemm: expected sizes whose arrays fit" in err and "got 10000000" in err


def test_the_cgroup_room_leaves_out_the_page_cache(tmp_path):
    """A container's memory.current counts the files it has read, which the kernel drops
    before it refuses memory: with 7.5 of its 8 GiB "used", 4 GiB of them page cache, the
    room was 0.5 GiB and a 2 GiB run was refused; it is 4.5 GiB. Missing files, "max" and
    cgroup v1's huge limit mean no limit; v1's memory.stat counts with total_."""
    from npattn.tools import limits

    GiB = 2**30
    v2 = tmp_path / "v2"
    v2.mkdir()
    (v2 / "memory.max").write_text(f"{8 * GiB}\n")
    (v2 / "memory.current").write_text(f"{15 * GiB // 2}\n")
    (v2 / "memory.stat").write_text(f"anon {3 * GiB}\nfile {4 * GiB}\nactive_file {3 * GiB}\n"
                                    f"inactive_file {GiB}\nshmem 0\n")
    assert limits.cgroup_room(str(v2)) == 9 * GiB // 2
    assert limits.memory_error("--shapes", "x", 2 * GiB, "y", limits.cgroup_room(str(v2))) is None
    (v2 / "memory.stat").unlink()  # no memory.stat: the usage as it is
    assert limits.cgroup_room(str(v2)) == GiB // 2
    (v2 / "memory.max").write_text("max\n")
    assert limits.cgroup_room(str(v2)) is None
    v1 = tmp_path / "v1" / "memory"
    v1.mkdir(parents=True)
    (v1 / "memory.limit_in_bytes").write_text(f"{4 * GiB}\n")
    (v1 / "memory.usage_in_bytes").write_text(f"{3 * GiB}\n")
    (v1 / "memory.stat").write_text(f"active_file 5\ninactive_file 7\ntotal_active_file {GiB}\n"
                                    f"total_inactive_file {GiB}\n")
    assert limits.cgroup_room(str(tmp_path / "v1")) == 3 * GiB
    (v1 / "memory.limit_in_bytes").write_text("9223372036854771712\n")
    assert limits.cgroup_room(str(tmp_path / "v1")) is None
    assert limits.cgroup_room(str(tmp_path / "none")) is None


def test_the_isolated_table_columns_fit_their_longest_entry(monkeypatch):
    """The impl column was 7 characters wide (and shape 18, blocks 9): `reference`, a long shape
    or large blocks pushed the rest of their row out of line with the header."""
    def fake_child(shape, *, impl, block_q, block_k, **case):  # no benchmark: a made-up result
        bq, bk = (block_q, block_k) if impl == "blocked" else (None, None)
        return {"shape": str(shape), "impl": impl, "block_q": bq, "block_k": bk, "ms": 12345.678,
                "gflops": 1.5, "gemm_gflops": None, "pct_gemm": None, "rss_before_mib": 100.0,
                "peak_rss_mib": 2000.0, "loadavg": [0.5, 0.5, 0.5]}

    monkeypatch.setattr(bench, "measure_isolated", fake_child)
    plan = [(bench.Shape(1, 8, 8, 2, False), "reference"),
            (bench.Shape(123, 45678, 4096, 32, True, 0.25, 1024), "blocked"),
            (bench.Shape(1, 8, 8, 2, False), "dense")]
    out = io.StringIO()
    bench.run_isolated(plan, gemm_n=0, block_q=65536, block_k=65536, out=out)
    lines = out.getvalue().splitlines()
    header = next(i for i, line in enumerate(lines) if line.lstrip().startswith("shape"))
    table = lines[header:]
    assert len(table) == 4

    def right_edges(line):  # where each column's text ends (right-aligned: the column's edge)
        return [m.end() for m in re.finditer(r"\S+", line)]

    rows = [right_edges(line) for line in table[1:]]
    assert rows[0] == rows[1] == rows[2], table
    head = right_edges(table[0].replace("RSS before", "RSS_before").replace("peak RSS", "peak_RSS"))
    assert head == rows[0], table
    assert "reference" in table[1] and "65536,65536" in table[2]


def test_the_gpu_table_shows_torch_device_memory_in_place_of_host_rss():
    """backend cupy: the host RSS column gives way to torch's peak device memory, same width."""
    header = bench.format_header(bench.GPU_COLUMNS)
    assert "torch MiB" in header and "RSS MiB" not in header
    line = bench.format_row(_row(rss_mib=None, torch_peak_mib=125.75), bench.GPU_COLUMNS)
    assert len(line) == len(header)
    assert line.split()[7] == "125.8"  # the eighth column, where RSS MiB is on the CPU
    assert bench.format_row(_row(), bench.COLUMNS).split()[7] == "1.3"


def test_the_cupy_peak_follows_allocations_and_frees(monkeypatch):
    """No GPU needed: with a stand-in for CuPy's MemoryHook, the step's peak is the most bytes
    in use at once above the level before it (frees of older arrays lower that level)."""
    import sys
    import types

    active = []

    class MemoryHook:
        def __enter__(self):
            active.append(self)

        def __exit__(self, *exc):
            active.remove(self)

    def step():  # what the pool would report: sizes as it rounds them
        for event, size in [("malloc", 2**20), ("malloc", 3 * 2**20), ("free", 2**20),
                            ("free", 5 * 2**20), ("malloc", 4 * 2**20), ("malloc", 2**20)]:
            for hook in active:
                getattr(hook, f"{event}_postprocess")(device_id=0, mem_size=size, mem_ptr=0, pmem_id=0)

    fake = types.SimpleNamespace(cuda=types.SimpleNamespace(MemoryHook=MemoryHook))
    monkeypatch.setitem(sys.modules, "cupy", fake)
    assert bench._cupy_peak_mib(step, lambda: None) == 4.0  # 1 + 3 MiB, before the frees
    assert not active


def _fake_runs(monkeypatch):
    """``run`` and ``run_isolated`` replaced: their arguments recorded, a result of one row."""
    calls = []
    row = {"shape": "1x8x8x2", "impl": "dense", "block_q": None, "block_k": None, "ms": 2.0,
           "gflops": 1.0, "gemm_gflops": None, "pct_gemm": None, "rss_before_mib": 1.0,
           "peak_rss_mib": 2.0, "loadavg": [0.5], "repeat": 1, "warmup": 0, "blas_threads": None}
    env = {"cpu": "x", "cpu_count": 1, "memory_gib": 1.0, "threadpools": "none", "numpy": "2",
           "python": "3", "backend": "numpy"}
    for name in ("run", "run_isolated"):
        monkeypatch.setattr(bench, name, lambda *a, _name=name, **k: calls.append((_name, a, k))
                            or {"env": env, "dtype": "float32", "rows": [row]})
    return calls


def test_the_markdown_table_is_appended(tmp_path, monkeypatch):
    _fake_runs(monkeypatch)
    md = tmp_path / "log.md"
    md.write_text("# earlier runs\n")
    for _ in range(2):
        assert bench.main(["--isolated", "--shapes", "1x8x8x2", "--impl", "dense", "--gemm", "0",
                           "--markdown", str(md)]) == 0
    text = md.read_text()
    assert text.startswith("# earlier runs\n") and text.count("| 1x8x8x2 | dense |") == 2


def test_the_options_reach_the_run_of_either_mode(monkeypatch):
    """--blas-threads holds BLAS around the run (and is passed to each isolated child), and
    --dtype and --backend reach the run in both modes."""
    import contextlib

    pytest.importorskip("threadpoolctl", reason="--blas-threads needs threadpoolctl")

    calls, held = _fake_runs(monkeypatch), []
    monkeypatch.setattr(bench, "_blas_limit", lambda n: held.append(n) or contextlib.nullcontext())
    options = ["--blas-threads", "2", "--dtype", "float64", "--backend", "array_api_strict"]
    assert bench.main(["--shapes", "1x8x8x2", *options]) == 0
    assert held == [2]
    assert bench.main(["--isolated", "--shapes", "1x8x8x2", "--impl", "dense", *options]) == 0
    (_, _, run), (_, _, isolated) = calls
    assert (run["dtype"], run["backend"]) == ("float64", "array_api_strict")
    assert {k: isolated[k] for k in ("dtype", "backend", "blas_threads")} == {
        "dtype": "float64", "backend": "array_api_strict", "blas_threads": 2}


@pytest.mark.parametrize("argv, fits, refused", [
    # float32: 1x64x4x2 dense holds 6*256 + 4*16 + 2*64*64 = 9792 numbers, 39168 bytes, and the
    # --gemm 1's three numbers beside it, 12 bytes; float64 twice
    (["--dtype", "float32"], 39180, 39179),
    (["--dtype", "float64"], 78360, 78359),
    # the core alone (--scope attention): 5*256 + 2*64*64 = 9472 numbers, 37888 bytes; an
    # isolated child times the GEMM apart from the step
    (["--isolated", "--impl", "dense", "--scope", "attention"], 37888, 37887),
    (["--isolated", "--impl", "dense"], 39168, 39167),
])
def test_the_memory_check_counts_the_dtype_and_scope_of_the_run(argv, fits, refused, monkeypatch, capsys):
    from npattn.tools import limits

    _fake_runs(monkeypatch)
    for available, ok in ((fits, True), (refused, False)):
        monkeypatch.setattr(limits, "available_memory", lambda: available)
        if ok:  # (a GEMM of 1 x 1: 20 bytes)
            assert bench.main(["--shapes", "1x64x4x2", "--gemm", "1", *argv]) == 0
            continue
        with pytest.raises(SystemExit) as exc:
            bench.main(["--shapes", "1x64x4x2", "--gemm", "1", *argv])
        assert exc.value.code == 2 and "got 1x64x4x2 (--impl dense)" in capsys.readouterr().err


def test_the_default_shapes_are_checked_against_the_memory(monkeypatch, capsys):
    from npattn.tools import limits

    _fake_runs(monkeypatch)
    monkeypatch.setattr(limits, "available_memory", lambda: 1000)  # a GEMM of 1 x 1 fits
    with pytest.raises(SystemExit):
        bench.main(["--gemm", "1"])
    assert f"got {bench.DEFAULT_SHAPES[0]} (--impl dense)" in capsys.readouterr().err


def test_the_cupy_backend_is_not_checked_against_the_host_s_memory(monkeypatch, capsys):
    """On the GPU the arrays live in the device's memory: a run that the host's memory could
    not hold is refused on numpy and runs on cupy."""
    from npattn.tools import limits

    _fake_runs(monkeypatch)
    monkeypatch.setattr(limits, "available_memory", lambda: 1)
    monkeypatch.setattr(bench, "resolve_backend", lambda name: np)  # no GPU needed
    assert bench.main(["--shapes", "1x4x4x2", "--backend", "cupy"]) == 0
    with pytest.raises(SystemExit) as exc:
        bench.main(["--shapes", "1x4x4x2", "--backend", "numpy"])
    assert exc.value.code == 2 and "memory available here" in capsys.readouterr().err


@pytest.mark.parametrize("argv, message", [
    (["--threads", "4097"], "--threads: expected an integer in [1, 4096], got 4097"),
    (["--threads", "0"], "--threads: expected an integer in [1, 4096], got 0"),
])
def test_thread_counts_past_their_limits_are_usage_errors(argv, message, monkeypatch, capsys):
    _fake_runs(monkeypatch)
    with pytest.raises(SystemExit) as exc:
        bench.main(argv)
    assert exc.value.code == 2 and message in capsys.readouterr().err


def test_a_missing_backend_or_threadpoolctl_is_exit_status_2(monkeypatch, capsys):
    import importlib.util

    _fake_runs(monkeypatch)

    def missing(name):
        raise ImportError(f"{name} is not installed")

    monkeypatch.setattr(bench, "resolve_backend", missing)
    assert bench.main(["--shapes", "1x8x8x2", "--backend", "cupy"]) == 2
    assert "npattn bench: cupy is not installed" in capsys.readouterr().err
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    assert bench.main(["--shapes", "1x8x8x2", "--blas-threads", "2"]) == 2
    assert "--blas-threads needs threadpoolctl" in capsys.readouterr().err


def test_the_default_shapes_are_those_of_the_performance_page():
    """docs/performance.md gives its results for the default shapes: its table has a row for
    each (causal ones marked so) and names the dropout one."""
    import os

    with open(os.path.join(os.path.dirname(__file__), "..", "docs", "performance.md"), encoding="utf-8") as f:
        page = f.read()
    for s in bench.DEFAULT_SHAPES:
        name = f"{s.B}x{s.L}x{s.D}x{s.H}"
        if s.dropout:
            assert f"dropout p = {s.dropout:g} at {name}" in page, s
        else:
            assert f"| {name}{' causal' if s.causal else ''} |" in page, s
