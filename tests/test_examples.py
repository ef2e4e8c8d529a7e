"""Every script in examples/ runs to completion (skipped where its library or a GPU is missing),
and what it prints or draws holds: the numbers are read back, not only the exit status."""

import importlib.util
import os
import re
import subprocess
import sys

import numpy as np
import pytest

import npattn

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the project: docs, examples
# the folder holding the npattn under test (the project, or site-packages when installed),
# put on a child process's path so that it imports the same npattn (CI's second stage sets
# PYTHONSAFEPATH, so that a child's current folder, the checkout, does not come before it)
IMPORT_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(npattn.__file__)))
EXAMPLES = os.path.join(ROOT, "examples")


def _gpu_available():
    if importlib.util.find_spec("cupy") is None:
        return False
    try:
        import cupy

        return cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:
        return False


def run_example(name, *args, cwd=None):
    env = dict(os.environ)
    env["PYTHONPATH"] = IMPORT_ROOT + os.pathsep + env.get("PYTHONPATH", "")
    env.setdefault("OPENBLAS_NUM_THREADS", "1")
    env.setdefault("MPLBACKEND", "Agg")
    proc = subprocess.run([sys.executable, os.path.join(EXAMPLES, name), *args], cwd=cwd,
                          capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout


def test_every_example_has_a_test():
    scripts = sorted(f for f in os.listdir(EXAMPLES) if f.endswith(".py"))
    assert scripts == ["check_torch_module.py", "cupy_forward_backward.py",
                       "numpy_forward_backward.py", "plot_attention.py"]


def test_numpy_forward_backward():
    out = run_example("numpy_forward_backward.py")
    assert "dkey of the padded keys is zero: True" in out
    assert "FAIL" not in out and out.count("pass") == 4
    # the shapes it prints, from its B, Lq, Lk, D, H = 2, 3, 5, 8, 2
    assert "out (2, 3, 8), attention weights (2, 2, 3, 5)" in out
    assert "dquery (2, 3, 8), dkey (2, 5, 8), dvalue (2, 5, 8)" in out
    # the printed weights of batch 1, head 0: the padded keys 3 and 4 get exactly 0, and
    # each row, rounded to 3 decimals, sums to 1 over the 3 real keys
    rows = re.search(r"get exactly 0\):\n(\[\[.*?\]\])", out, re.S).group(1)
    w = np.array([[float(t) for t in r.split()] for r in re.findall(r"\[([^\[\]]+)\]", rows)])
    assert w.shape == (3, 5) and np.all(w[:, 3:] == 0.0) and np.all(w >= 0.0)
    np.testing.assert_allclose(w.sum(axis=1), 1.0, atol=2e-3)
    # the check of the functional pair: every input's error is that of rounding in float64
    for name in ("q", "k", "v", "mask"):
        err = float(re.search(rf"^{name} +(\S+) +\S+ +\S+ +pass$", out, re.M).group(1))  # abs, rel, atol
        assert err < 1e-6, (name, err)


def test_cupy_forward_backward_on_gpu():
    if not _gpu_available():
        if os.environ.get("NPATTN_REQUIRE_GPU") == "1":  # a GPU run must not pass by skipping
            pytest.fail("needs CuPy and a CUDA GPU (NPATTN_REQUIRE_GPU=1)")
        pytest.skip("needs CuPy and a CUDA GPU")
    out = run_example("cupy_forward_backward.py")
    assert "max |numpy - cupy|" in out
    # NumPy and CuPy agree to float64 rounding, whatever threshold the script uses
    worst = float(re.search(r"max \|numpy - cupy\| over the output and every gradient: (\S+)", out).group(1))
    assert worst <= 1e-10, worst


@pytest.mark.skipif(_gpu_available(), reason="checks the message shown without a GPU")
def test_cupy_example_exits_cleanly_without_gpu():
    out = run_example("cupy_forward_backward.py")
    assert "skipped" in out


@pytest.mark.skipif(importlib.util.find_spec("torch") is None, reason="needs torch")
def test_check_torch_module():
    out = run_example("check_torch_module.py")
    assert "agree" in out
    assert out.count("max |npattn - torch|") == 9
    # each of the nine differences is float64 rounding, whatever threshold the script uses
    errors = dict(re.findall(r"^(.+?) +max \|npattn - torch\| = (\S+)$", out, re.M))
    assert set(errors) == {"out", "weights", "dquery", "dkey", "dvalue", "d in_proj_weight",
                           "d in_proj_bias", "d out_proj.weight", "d out_proj.bias"}
    assert all(float(e) <= 1e-10 for e in errors.values()), errors


@pytest.mark.skipif(importlib.util.find_spec("matplotlib") is None, reason="needs matplotlib")
def test_plot_attention(tmp_path):
    target = tmp_path / "att.png"
    out = run_example("plot_attention.py", "--out", str(target))
    assert str(target) in out
    assert target.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # the masked cells are drawn grey (hatched), a colour viridis never takes, so that
    # masked zeros do not look like small weights: the upper triangle of 4 heads is grey
    import matplotlib.image

    rgb = matplotlib.image.imread(str(target))[..., :3]
    grey = (np.abs(rgb - 0.85) < 0.02).all(axis=-1)
    assert grey.sum() > 0.1 * rgb.shape[0] * rgb.shape[1]


@pytest.mark.skipif(importlib.util.find_spec("matplotlib") is None, reason="needs matplotlib")
def test_plot_attention_writes_the_file_it_names(tmp_path):
    # "wrote PATH" is the file written: without a suffix matplotlib used to add ".png"
    target = tmp_path / "attention"
    out = run_example("plot_attention.py", "--out", str(target))
    assert f"wrote {target}" in out
    assert target.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert os.listdir(tmp_path) == ["attention"]
    # a path that cannot be written is a usage error naming --out (status 2), not a traceback
    env = dict(os.environ, PYTHONPATH=IMPORT_ROOT, MPLBACKEND="Agg", OPENBLAS_NUM_THREADS="1")
    for bad in (tmp_path / "missing" / "a.png", tmp_path):
        proc = subprocess.run([sys.executable, os.path.join(EXAMPLES, "plot_attention.py"),
                               "--out", str(bad)], capture_output=True, text=True, env=env,
                              timeout=300)
        assert proc.returncode == 2, proc.stderr
        assert "Traceback" not in proc.stderr
        assert proc.stderr.splitlines()[-1].startswith(
            f"plot_attention.py: error: --out {str(bad)!r}: cannot write the picture there")


@pytest.mark.skipif(importlib.util.find_spec("matplotlib") is None, reason="needs matplotlib")
def test_plot_attention_draws_what_its_title_says(tmp_path, monkeypatch):
    # "a causal and a padding mask (keys 8, 9 are padding)": per head, the cells shown are the
    # weights of query i on key j <= i, j < 8, each row summing to 1, and the other 48 of the
    # 10 x 10 cells are masked and hatched
    import matplotlib.figure

    figures = []
    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", lambda self, *a, **k: figures.append(self))
    path = os.path.join(EXAMPLES, "plot_attention.py")
    spec = importlib.util.spec_from_file_location("plot_attention", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert module.main(["--out", str(tmp_path / "unused.png")]) == 0
    (fig,) = figures
    assert "keys 8, 9 are padding" in fig._suptitle.get_text()
    L = 10
    allowed = np.tril(np.ones((L, L), dtype=bool)) & (np.arange(L) < 8)[None, :]
    heads = [ax for ax in fig.axes if ax.images]
    assert len(heads) == 4
    for ax in heads:
        shown = ax.images[0].get_array()
        np.testing.assert_array_equal(np.ma.getmaskarray(shown), ~allowed)
        np.testing.assert_allclose(shown.filled(0.0).sum(axis=1), 1.0, rtol=1e-12)
        hatched = {(round(r.get_y() + 0.5), round(r.get_x() + 0.5)) for r in ax.patches}
        assert hatched == set(zip(*np.nonzero(~allowed))) and len(hatched) == 48
