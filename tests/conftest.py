"""Shared fixtures: one test body runs on every installed backend.

``xp`` is parametrized over numpy, array_api_strict, torch (CPU) and cupy; a
backend that is not installed, or cupy without a GPU, is skipped with the
reason. Set ``NPATTN_REQUIRE_GPU=1`` to turn a skipped cupy into a failure.

Hypothesis profiles: ``ci`` (derandomized, no deadline, bounded) is loaded
when ``CI`` is set, ``dev`` otherwise; ``HYPOTHESIS_PROFILE`` overrides both.
"""

import importlib
import os
import types

import numpy as np
import pytest
from hypothesis import HealthCheck, settings

from npattn.backend import from_numpy, resolve_backend, to_numpy

settings.register_profile(
    "ci",
    derandomize=True,
    deadline=None,
    max_examples=15,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.register_profile(
    "dev",
    deadline=None,
    max_examples=40,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci" if os.environ.get("CI") else "dev"))

BACKEND_NAMES = ["numpy", "array_api_strict", "torch", "cupy"]


def _gpu_available() -> bool:
    try:
        import cupy

        return cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:
        return False


def backend_or_skip(name):
    """The namespace for backend ``name``, or a pytest skip that says why not."""
    if name == "cupy":
        if importlib.util.find_spec("cupy") is None or not _gpu_available():
            reason = "cupy backend needs CuPy and a CUDA GPU"
            if os.environ.get("NPATTN_REQUIRE_GPU") == "1":
                pytest.fail(reason + " (NPATTN_REQUIRE_GPU=1)")
            pytest.skip(reason)
    elif name in ("torch", "array_api_strict") and importlib.util.find_spec(name) is None:
        pytest.skip(f"{name} backend: {name} is not installed")
    return resolve_backend(name)


@pytest.fixture(scope="session", params=BACKEND_NAMES)
def backend(request):
    """Backend name, skipped with a reason when unavailable."""
    backend_or_skip(request.param)
    return request.param


@pytest.fixture(scope="session")
def xp(backend):
    """The Array API namespace of ``backend``."""
    return resolve_backend(backend)


@pytest.fixture(scope="session")
def to_xp(xp):
    """Move a NumPy array (or None) onto the backend under test."""

    def convert(a):
        if a is None:
            return None
        return from_numpy(np.asarray(a), xp)

    return convert


@pytest.fixture(scope="session")
def to_np():
    """Host NumPy copy of a backend array (or None)."""

    def convert(a):
        return None if a is None else to_numpy(a)

    return convert


@pytest.fixture
def command_config(monkeypatch):
    """``command_config(module, argv)``: the config ``npattn argv`` hands ``module.train``, taken
    by a stand-in that stops the command there (nothing is trained)."""
    from npattn.tools import cli

    class Trained(Exception):
        pass

    def run(module, argv):
        seen = []

        def stand_in(cfg, *args, **kwargs):
            seen.append(cfg)
            raise Trained

        monkeypatch.setattr(module, "train", stand_in)
        with pytest.raises(Trained):
            cli.main(argv)
        (cfg,) = seen
        return cfg

    return run


@pytest.fixture
def bar_notes(monkeypatch):
    """``bar_notes(module)``: the list that every note ``module.ProgressBar`` is updated with from
    now on is appended to (the bar still draws as before)."""
    def record(module):
        notes = []

        class RecordingBar(module.ProgressBar):
            def update(self, n=1, note=None):
                if note is not None:
                    notes.append(note)
                super().update(n, note)

        monkeypatch.setattr(module, "ProgressBar", RecordingBar)
        return notes

    return record


@pytest.fixture
def step_clock(monkeypatch):
    """``step_clock(module, owner, name, seconds)``: ``module.time.perf_counter`` becomes a clock
    that stands still except that each call of ``owner.name`` advances it by ``seconds``."""
    def install(module, owner, name, seconds):
        clock = [1000.0]
        step = getattr(owner, name)

        def slow_step(*args, **kwargs):
            clock[0] += seconds
            return step(*args, **kwargs)

        monkeypatch.setattr(module, "time", types.SimpleNamespace(perf_counter=lambda: clock[0]))
        monkeypatch.setattr(owner, name, slow_step)

    return install


def pytest_collection_modifyitems(config, items):
    """Mark every test parametrized on the cupy backend as ``gpu`` (``pytest -m gpu`` runs them)."""
    for item in items:
        params = getattr(getattr(item, "callspec", None), "params", {})
        if any(isinstance(v, str) and v == "cupy" for v in params.values()):
            item.add_marker(pytest.mark.gpu)
