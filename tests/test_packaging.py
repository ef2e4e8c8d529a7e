"""What a library user and a type checker get: py.typed, hints, license, metadata, a self-contained sdist."""

import configparser
import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

import npattn

ROOT = Path(__file__).resolve().parents[1]
PKG = Path(npattn.__file__).resolve().parent


def _setup_cfg():
    cfg = configparser.ConfigParser()
    cfg.read(ROOT / "setup.cfg")
    return cfg


def test_py_typed_ships_with_the_package():
    assert (PKG / "py.typed").is_file()
    assert "py.typed" in _setup_cfg()["options.package_data"]["npattn"]


def test_license_author_and_python_classifiers():
    meta = _setup_cfg()["metadata"]
    assert meta["license"] == "MIT" and meta["author"] == "npattn developers"
    text = (ROOT / meta["license_files"]).read_text()
    assert text.startswith("MIT License") and "2026 npattn developers" in text
    classifiers = meta["classifiers"]
    for version in ("3.10", "3.11", "3.12", "3.13"):
        assert f"Programming Language :: Python :: {version}" in classifiers
    assert "Typing :: Typed" in classifiers


def test_the_sdist_ships_what_the_tests_read():
    """MANIFEST.in grafts every top-level folder and file that a test opens."""
    manifest = (ROOT / "MANIFEST.in").read_text().split("\n")
    grafted = {line.split()[1] for line in manifest if line.startswith("graft ")}
    included = {w for line in manifest if line.startswith("include ") for w in line.split()[1:]}
    assert {"tests", "docs", "examples", ".ci", "scripts"} <= grafted
    assert {"LICENSE", "README.md", "npattn/py.typed"} <= included


def test_gradcheck_has_one_plain_function_name():
    import types

    assert isinstance(npattn.gradcheck, types.ModuleType) and not callable(npattn.gradcheck)
    assert npattn.check_gradients is npattn.gradcheck.gradcheck
    assert "check_gradients" in npattn.__all__


def test_public_functions_have_annotations():
    import inspect

    from npattn import attention, backend, blocked, functional, gradcheck, masks, nn, validation

    missing = []
    for mod in (attention, backend, blocked, functional, gradcheck, masks, nn, validation):
        for name in mod.__all__:
            obj = getattr(mod, name)
            if inspect.isfunction(obj) and "return" not in obj.__annotations__:
                missing.append(f"{mod.__name__}.{name}")
    assert not missing, f"public functions without a return annotation: {missing}"


def test_mypy_checks_names_bound_in_only_some_branches():
    """setup.cfg's [mypy] enables ``possibly-undefined`` (off by default in mypy): a loop that
    may run zero times left a name unbound in three public tool functions."""
    codes = {c.strip() for c in _setup_cfg()["mypy"]["enable_error_code"].split(",")}
    assert "possibly-undefined" in codes


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("mypy") is None,
                    reason="mypy is not installed (it is in the test extra)")
def test_mypy_accepts_the_package(tmp_path):
    """``mypy npattn`` with the project's configuration (setup.cfg [mypy]) reports nothing.

    It checks the project's own folder: an installed copy in site-packages would have mypy
    read that folder's other top-level modules as the project's."""
    cache = os.environ.get("MYPY_CACHE_DIR", str(ROOT / ".mypy_cache"))
    run = subprocess.run(
        [sys.executable, "-m", "mypy", "--ignore-missing-imports", "--cache-dir", cache,
         str(ROOT / "npattn")],
        cwd=ROOT, capture_output=True, text=True, timeout=600,
    )
    assert run.returncode == 0, run.stdout + run.stderr
