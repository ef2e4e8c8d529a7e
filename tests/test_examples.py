"""Every script in examples/ runs to completion (skipped where its library or a GPU is missing)."""

import importlib.util
import os
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


def test_cupy_forward_backward_on_gpu():
    if not _gpu_available():
        if os.environ.get("NPATTN_REQUIRE_GPU") == "1":  # a GPU run must not pass by skipping
            pytest.fail("needs CuPy and a CUDA GPU (NPATTN_REQUIRE_GPU=1)")
        pytest.skip("needs CuPy and a CUDA GPU")
    out = run_example("cupy_forward_backward.py")
    assert "max |numpy - cupy|" in out


@pytest.mark.skipif(_gpu_available(), reason="checks the message shown without a GPU")
def test_cupy_example_exits_cleanly_without_gpu():
    out = run_example("cupy_forward_backward.py")
    assert "skipped" in out


@pytest.mark.skipif(importlib.util.find_spec("torch") is None, reason="needs torch")
def test_check_torch_module():
    out = run_example("check_torch_module.py")
    assert "agree" in out
    assert out.count("max |npattn - torch|") == 9


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
