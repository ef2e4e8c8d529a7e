"""The benchmark's parsing, FLOP count and command line (no timing assertions)."""

import json

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
    for bad in ("2x3", "2x4x6x4", "axbxcxd", "0x4x8x2", "", "2x4x4x2d1.5", "2x4x4x2d"):
        with pytest.raises(ValueError, match="--shapes"):
            bench.parse_shapes(bad)


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
                     "--gemm", "32", "--pause", "0", "--json", str(path)])
    assert rc == 0
    result = json.loads(path.read_text())
    assert [r["shape"] for r in result["rows"]] == ["2x8x8x2", "1x8x8x2c", "2x8x8x2d0.2"]
    for row in result["rows"]:
        assert len(row["ms_all"]) == 5 and row["ms"] > 0 and row["gflops"] > 0
        assert row["peak_mib"] is not None and row["peak_mib"] >= 0
    printed = capsys.readouterr().out
    assert "2x8x8x2" in printed and "GEMM" in printed


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


def test_main_rejects_bad_options(capsys):
    with pytest.raises(SystemExit):
        bench.main(["--repeat", "3"])
    with pytest.raises(SystemExit):
        bench.main(["--shapes", "1x2x3"])
    for isolated_only in (["--block-q", "16"], ["--markdown", "x.md"]):
        with pytest.raises(SystemExit):
            bench.main(isolated_only)
    with pytest.raises(SystemExit):
        bench.main(["--isolated", "--impl", "dense"])  # the default plan sets its own impl
