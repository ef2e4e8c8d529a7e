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


def _requirements(text):
    from packaging.requirements import Requirement

    return [Requirement(line) for line in text.strip().splitlines()
            if line.strip() and not line.strip().startswith("#")]


def test_python_requires_is_the_oldest_classified_python():
    """``python_requires``, the classifiers and mypy's target name the same oldest Python."""
    cfg = _setup_cfg()
    versions = [c.rsplit("::", 1)[1].strip() for c in cfg["metadata"]["classifiers"].splitlines()
                if c.strip().startswith("Programming Language :: Python :: 3.")]
    oldest = min(versions, key=lambda v: tuple(int(x) for x in v.split(".")))
    assert cfg["options"]["python_requires"].strip() == f">={oldest}"
    assert cfg["mypy"]["python_version"].strip() == oldest


def test_install_requires_names_every_module_level_import_and_not_torch():
    """Each third-party package that a module of npattn imports at its top (the ``npattn``
    command's tools included: they ship with it) is a runtime dependency; torch, imported only
    inside the functions that need it (tests/test_no_torch_dependency.py), is an extra."""
    import ast

    imported = set()
    for path in PKG.rglob("*.py"):
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.Import):
                imported.update(a.name.partition(".")[0] for a in node.names)
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                imported.add(node.module.partition(".")[0])
    third_party = {n.replace("_", "-") for n in imported - set(sys.stdlib_module_names)} - {"npattn"}
    cfg = _setup_cfg()
    required = {r.name for r in _requirements(cfg["options"]["install_requires"])}
    assert {"numpy", "array-api-compat"} <= third_party  # what the check runs on
    assert third_party <= required, third_party - required
    assert "torch" not in required and "torch" not in third_party
    assert [r.name for r in _requirements(cfg["options.extras_require"]["torch"])] == ["torch"]


def test_console_script_names_a_function():
    line = _setup_cfg()["options.entry_points"]["console_scripts"].strip()
    name, _, target = (w.strip() for w in line.partition("="))
    module, _, attr = target.partition(":")
    assert name == "npattn"
    assert callable(getattr(importlib.import_module(module), attr))


def test_the_sdist_leaves_out_bytecode_and_caches():
    excluded = [line.split()[1:] for line in (ROOT / "MANIFEST.in").read_text().splitlines()
                if line.startswith("global-exclude ")]
    patterns = {w for words in excluded for w in words}
    assert {"__pycache__", "*.py[cod]", ".hypothesis"} <= patterns


def test_the_oldest_pins_are_the_floors_of_setup_cfg():
    """.ci/oldest.txt pins every runtime and test dependency (and what an extra in brackets
    brings: distributed with dask[distributed]), each at a version its floor allows."""
    cfg = _setup_cfg()
    reqs = (_requirements(cfg["options"]["install_requires"])
            + _requirements(cfg["options.extras_require"]["test"]))
    pins = {r.name: r for r in _requirements((ROOT / ".ci" / "oldest.txt").read_text())}
    wanted = {r.name for r in reqs} | {x for r in reqs for x in r.extras if x == "distributed"}
    assert set(pins) == wanted, (sorted(set(pins) ^ wanted))
    for r in reqs:
        (spec,) = pins[r.name].specifier
        assert spec.operator == "==", pins[r.name]
        assert r.specifier.contains(spec.version, prereleases=True), (str(r), str(pins[r.name]))


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
