"""Install hints name what a user can install: npattn is not on PyPI.

A hint such as ``pip install 'npattn[plot]'`` would ask pip for a package
that does not exist. A hint names the packages first (``pip install matplotlib``),
which an installed wheel's user can install too, then the checkout's extra
(``'.[plot]'`` in the repository root); where torch is suggested, the hint
names the CPU pin (``pip install torch==2.13.0``), since a plain
``pip install torch`` pulls a multi-GB CUDA build.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "npattn"

# an extra requested by the package's name: npattn[plot], "npattn[torch]", ...
_BY_NAME = re.compile(r"npattn\[")

# Files another branch of issue #13 is rewriting; their hints are fixed there.
# Remove an entry when that branch lands (strict: the test then says so).
_PENDING: dict = {}  # files whose hints are known to be stale (none left)


def _files():
    files = sorted(PACKAGE.rglob("*.py"))  # the runtime messages and docstrings
    for extra in [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md")),
                  *sorted((ROOT / "examples").glob("*.py"))]:
        if extra.exists() and "_build" not in extra.parts:  # absent from an sdist
            files.append(extra)
    return [f.relative_to(ROOT).as_posix() for f in files]


def _param(rel):
    if rel in _PENDING:
        return pytest.param(rel, marks=pytest.mark.xfail(reason=_PENDING[rel], strict=True))
    return rel


def test_the_package_files_are_found():
    files = _files()
    assert "npattn/torch_interop.py" in files and "npattn/tools/demo.py" in files


@pytest.mark.parametrize("rel", [_param(f) for f in _files()])
def test_no_hint_installs_npattn_by_name(rel):
    text = (ROOT / rel).read_text()
    hits = [f"{rel}:{n}: {line.strip()}" for n, line in enumerate(text.splitlines(), 1)
            if _BY_NAME.search(line)]
    assert not hits, "install from the checkout, pip install '.[extra]':\n" + "\n".join(hits)


def test_the_check_would_catch_a_hint():
    assert _BY_NAME.search("pip install 'npattn" + "[plot]'")
    assert not _BY_NAME.search("pip install '.[plot]'")


def test_torch_hints_name_the_cpu_pin():
    # every file of the package that suggests installing torch names the CPU build's pin
    for path in PACKAGE.rglob("*.py"):
        rel = path.relative_to(ROOT).as_posix()
        if rel in _PENDING:
            continue
        # a message split over adjacent string literals reads as one line
        text = re.sub(r"[\"']\s*\n\s*[\"']", "", path.read_text())
        if re.search(r"pip install[^\n]*\[torch\]", text):
            assert "torch==2.13.0" in text, f"{rel} suggests the torch extra without the CPU pin"


def test_every_torch_install_hint_is_the_cpu_pin():
    """Each ``pip install torch...`` in the package names the pin, but for the warning that a
    plain ``pip install torch`` pulls a CUDA build; the two runtime hints are among those read."""
    pinned = set()
    for path in PACKAGE.rglob("*.py"):
        rel = path.relative_to(ROOT).as_posix()
        text = re.sub(r"[\"']\s*\n\s*f?[\"']", "", path.read_text())  # adjacent literals as one
        for m in re.finditer(r"(.{0,8})pip install ([^\s;,)`'\"]*torch[^\s;,)`'\"]*)", text):
            if m.group(2) == "torch==2.13.0":
                pinned.add(rel)
            else:
                assert m.group(1).endswith("plain ``") or m.group(1).endswith("plain '"), \
                    f"{rel}: expected pip install torch==2.13.0, got {m.group(0)!r}"
    assert {"npattn/torch_interop.py", "npattn/tools/bench_gpt.py"} <= pinned


def test_the_hypothesis_strategies_without_hypothesis_say_what_to_install():
    """``npattn.testing.strategies`` needs hypothesis, a test dependency: without it the import
    names the package to install, not a bare ModuleNotFoundError from inside npattn."""
    import subprocess
    import sys

    code = ("import sys; sys.modules['hypothesis'] = None\n"  # as if hypothesis were not installed
            "try:\n    import npattn.testing.strategies\n"
            "except ImportError as e:\n    print(type(e).__name__, e)\n")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    assert run.stdout.startswith("ImportError npattn.testing.strategies needs hypothesis: pip install "
                                 "hypothesis, or '.[test]' from the repository root"), run.stdout


def test_runtime_hints_name_the_packages_first():
    """A hint that names an extra ('.[plot]', from the repository root) names the packages too,
    first: an installed wheel has no repository root to install an extra from."""
    plain = {"plot": "matplotlib", "demo": "scikit-learn", "dask": "dask[array,distributed]",
             "test": "hypothesis"}
    found = []
    for path in PACKAGE.rglob("*.py"):
        rel = path.relative_to(ROOT).as_posix()
        text = re.sub(r"[\"']\s*\n\s*f?[\"']", "", path.read_text())  # adjacent literals as one
        for m in re.finditer(r"pip install[^\n]{0,60}?['\"]\.\[(\w+)\]['\"]", text):
            extra = m.group(1)
            if extra in plain:
                found.append(rel)
                assert f"pip install {plain[extra]}" in m.group(0) or \
                    f"pip install '{plain[extra]}'" in m.group(0) or \
                    f"pip install ``{plain[extra]}" in m.group(0), f"{rel}: {m.group(0)!r}"
    # the hints of the demos, verify, the dask bench, the picture and the strategies were read
    assert {"npattn/tools/cli.py", "npattn/tools/demo_digits.py", "npattn/tools/verify.py",
            "npattn/tools/bench_dask.py", "npattn/verifier.py", "npattn/testing/strategies.py"} <= set(found)
