"""The docs agree with the code.

* The softmax-backward formula, as written in LaTeX in ``docs/derivations.md``
  (the equation labelled ``softmax-backward``), is translated into array code
  and checked against ``masked_softmax_backward`` on random inputs, masks and
  upstream gradients.
* Every ```python block in ``docs/*.md`` preceded by ``<!-- run -->`` is
  executed, page by page in one namespace, in order; each block is one test.
  ``<!-- run: requires=torch -->`` names what a block needs (a module, or a
  dotted attribute such as ``npattn.MultiHeadAttention.from_torch``; ``cupy``
  means CuPy and a GPU). A block whose requirement is missing is skipped, so a
  block may only use names from earlier blocks that need no more than it does.
* The formulas and conventions the pages state (the kernel options' window, ALiBi, softcap,
  sinks, segments and lse; flash-attn's ``window_size``; dropout's ``p``; RoPE; Shaw's rows;
  GELU; mean pooling; Adam and clipping; sampling; ``from_torch_mha``; the printed causal
  masks) are written out as code from their words, entry by entry, and compared with the
  library's results.
* Every ``{py:...}`` cross-reference in the docs names an object that exists.
* Every ordered list renders the numbers it is written with (step numbers that
  skip, as "1. 4. 5.", would be renumbered by Markdown).
* The API reference (``docs/api/*.md``) renders every name of the library's
  ``__all__`` lists, under one of the names it is exported as.
* The docstring examples of the package run (doctest).
* The Sphinx build is warning-free (skipped when Sphinx is not installed),
  its pages load no remote script (MathJax is served from the build, so the
  math renders offline), and, where Chromium is installed, one headless
  browser run typesets the math of every built page that has math: each
  formula is typeset, without a TeX error or an undefined macro, and no raw
  TeX is left in the rendered prose.
"""

from __future__ import annotations

import ast
import doctest
import os
import functools
import html.parser
import json
import math
import importlib
import importlib.util
import pkgutil
import re
import shutil
import subprocess
import sys
import traceback
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import npattn
from npattn import functional as F

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
PAGES = sorted(p for p in DOCS.rglob("*.md") if "_build" not in p.parts)


# --------------------------------------------------------------------------
# the softmax-backward formula, read from the docs


def labelled_equation(text: str, label: str) -> str:
    """The body of the MyST ``$$ ... $$ (label)`` block named ``label``."""
    m = re.search(r"\$\$(?P<body>(?:(?!\$\$).)*)\$\$\s*\(" + re.escape(label) + r"\)", text, re.S)
    if m is None:
        raise AssertionError(f"no equation labelled ({label}) found")
    return m.group("body").strip()


_TOKEN = re.compile(
    r"\s+|\\,|\\;|\\!|\\left|\\right|\\Big|\\big"  # spacing and sizing: ignored
    r"|(?P<sum>\\sum_(?:\{(?P<si>[a-z])\}|(?P<si2>[a-z])))"
    r"|(?P<sym>(?:\\mathrm\{d\}\s*)?[a-zA-Z])_(?:\{(?P<i>[a-z])\}|(?P<i2>[a-z]))"
    r"|(?P<op>[-+=()])"
)


def latex_to_python(latex: str, names: dict) -> tuple[str, str]:
    """Translate a one-row softmax-style formula in index notation into array code.

    The grammar is the small one the derivation uses: indexed symbols
    (``p_j``, ``\\mathrm{d}p_k``), products by juxtaposition, ``+``, ``-``,
    parentheses (with ``\\left``/``\\right``) and ``\\sum_k``, which sums the
    rest of its product term over the last axis. All indices run over the last
    axis; a free index maps to the array itself, a summed one to a reduction.
    ``names`` maps LaTeX symbols to Python names. Returns ``(lhs, rhs)``.
    """
    tokens = []
    pos = 0
    while pos < len(latex):
        m = _TOKEN.match(latex, pos)
        if m is None:
            raise ValueError(f"cannot read {latex[pos:pos + 20]!r} in {latex!r}")
        pos = m.end()
        if m.group("sum"):
            tokens.append(("sum", m.group("si") or m.group("si2")))
        elif m.group("sym"):
            sym = re.sub(r"\s+", "", m.group("sym"))
            if sym not in names:
                raise ValueError(f"unknown symbol {sym!r} in {latex!r}")
            tokens.append(("sym", (names[sym], m.group("i") or m.group("i2"))))
        elif m.group("op"):
            tokens.append(("op", m.group("op")))
    eq = tokens.index(("op", "="))
    lhs, rhs = tokens[:eq], tokens[eq + 1:]
    if len(lhs) != 1 or lhs[0][0] != "sym":
        raise ValueError(f"expected one symbol left of '=', got {lhs}")
    free = lhs[0][1][1]

    def parse_expr(i, bound):  # expr := term (('+'|'-') term)*
        code, i = parse_term(i, bound)
        while i < len(rhs) and rhs[i][0] == "op" and rhs[i][1] in "+-":
            op = rhs[i][1]
            nxt, i = parse_term(i + 1, bound)
            code = f"({code} {op} {nxt})"
        return code, i

    def parse_term(i, bound):  # term := factor+ ; \sum_k takes the rest of the term
        factors = []
        while i < len(rhs):
            kind, val = rhs[i]
            if kind == "sum":
                inner, i = parse_term(i + 1, bound | {val})
                factors.append(f"xp.sum({inner}, axis=-1, keepdims=True)")
                break
            if kind == "sym":
                name, index = val
                if bound and index not in bound:
                    raise ValueError(f"{name}_{index} inside a sum: only summed indices there")
                if not bound and index != free:
                    raise ValueError(f"index {index} of {name} is neither free nor summed")
                factors.append(name)
                i += 1
            elif val == "(":
                inner, i = parse_expr(i + 1, bound)
                if i >= len(rhs) or rhs[i] != ("op", ")"):
                    raise ValueError("unbalanced parentheses")
                factors.append(f"({inner})")
                i += 1
            else:
                break
        if not factors:
            raise ValueError(f"empty term at token {i} of {latex!r}")
        return " * ".join(factors), i

    code, end = parse_expr(0, frozenset())
    if end != len(rhs):
        raise ValueError(f"unparsed tokens {rhs[end:]} in {latex!r}")
    return lhs[0][1][0], code


SOFTMAX_NAMES = {"p": "p", r"\mathrm{d}p": "dp", r"\mathrm{d}z": "dz"}


def test_formula_translator_reads_variants():
    # the translator itself must be able to tell formulas apart
    assert latex_to_python(r"\mathrm{d}z_j = p_j \left( \mathrm{d}p_j - \sum_k \mathrm{d}p_k \, p_k \right)",
                           SOFTMAX_NAMES) == (
        "dz", "p * ((dp - xp.sum(dp * p, axis=-1, keepdims=True)))")
    assert latex_to_python(r"\mathrm{d}z_j = p_j (\mathrm{d}p_j - \sum_{k} \mathrm{d}p_k)",
                           SOFTMAX_NAMES)[1] == "p * ((dp - xp.sum(dp, axis=-1, keepdims=True)))"
    for bad in (r"\mathrm{d}z_j = p_i", r"\mathrm{d}z_j = \sum_k p_j \mathrm{d}p_k",
                r"\mathrm{d}z_j = p_j (\mathrm{d}p_j", r"\mathrm{d}z_j = q_j"):
        with pytest.raises(ValueError):
            latex_to_python(bad, SOFTMAX_NAMES)


@pytest.fixture(scope="module")
def softmax_backward_as_documented():
    latex = labelled_equation((DOCS / "derivations.md").read_text(), "softmax-backward")
    lhs, code = latex_to_python(latex, SOFTMAX_NAMES)
    assert lhs == "dz"
    return code


@settings(suppress_health_check=[HealthCheck.function_scoped_fixture])  # fixtures are stateless
@given(
    shape=st.tuples(st.integers(1, 3), st.integers(2, 4), st.integers(2, 6)),
    kind=st.sampled_from(["none", "bool", "float"]),
    seed=st.integers(0, 2**32 - 1),
)
def test_documented_softmax_backward_matches_code(softmax_backward_as_documented, xp, to_xp, to_np,
                                                  shape, kind, seed):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(shape) * 3.0
    dp = rng.standard_normal(shape)  # random upstream gradient, never all ones
    mask = None
    if kind == "bool":
        mask = rng.random(shape[-2:]) < 0.6
        mask[0] = False  # a fully masked row
    elif kind == "float":
        mask = rng.standard_normal(shape[-2:])
        mask[rng.random(shape[-2:]) < 0.3] = -np.inf
        mask[-1] = -np.inf  # a fully masked row
    p, cache = F.masked_softmax_forward(to_xp(x), to_xp(mask))
    dx, _, _ = F.masked_softmax_backward(to_xp(dp), cache)
    documented = eval(softmax_backward_as_documented, {"xp": xp, "p": p, "dp": to_xp(dp)})
    np.testing.assert_allclose(to_np(dx), to_np(documented), rtol=1e-12, atol=1e-12)
    assert np.all(np.isfinite(to_np(dx)))


def test_a_wrong_formula_would_fail(softmax_backward_as_documented):
    # the check above can fail: the formula without its p_j factor disagrees with the code
    rng = np.random.default_rng(0)
    x, dp = rng.standard_normal((2, 3, 4)), rng.standard_normal((2, 3, 4))
    p, cache = F.masked_softmax_forward(x)
    dx, _, _ = F.masked_softmax_backward(dp, cache)
    _, wrong = latex_to_python(r"\mathrm{d}z_j = \mathrm{d}p_j - \sum_k \mathrm{d}p_k \, p_k", SOFTMAX_NAMES)
    assert not np.allclose(dx, eval(wrong, {"xp": np, "p": p, "dp": dp}))
    assert np.allclose(dx, eval(softmax_backward_as_documented, {"xp": np, "p": p, "dp": dp}))


# --------------------------------------------------------------------------
# runnable snippets

_BLOCK = re.compile(
    r"<!--[ \t]*run(?:[ \t]*:[ \t]*(?P<opts>[^\n>]*?))?[ \t]*-->[ \t]*\n"
    r"```python[^\n]*\n(?P<code>.*?)^```",
    re.S | re.M,
)


def runnable_blocks(page: Path):
    """``(line, requires, code)`` for each runnable block of ``page``."""
    text = page.read_text()
    blocks = []
    for m in _BLOCK.finditer(text):
        requires = []
        for opt in (m.group("opts") or "").split():
            key, _, value = opt.partition("=")
            if key != "requires":
                raise ValueError(f"{page.name}: unknown run option {opt!r}")
            requires += [r for r in value.split(",") if r]
        line = text.count("\n", 0, m.start("code")) + 1
        blocks.append((line, requires, m.group("code")))
    return blocks


def missing(requirement: str):
    """Why ``requirement`` is not met, or None when it is."""
    if requirement == "cupy":
        try:
            import cupy

            if cupy.cuda.runtime.getDeviceCount() > 0:
                return None
        except Exception:  # noqa: BLE001 - no CuPy or no GPU, either way skip
            pass
        return "CuPy and a CUDA GPU"
    parts = requirement.split(".")
    for n in range(len(parts), 0, -1):  # longest importable prefix, then attributes
        module = ".".join(parts[:n])
        try:
            obj = importlib.import_module(module)
        except ImportError:
            continue
        for attr in parts[n:]:
            if not hasattr(obj, attr):
                return requirement
            obj = getattr(obj, attr)
        return None
    return requirement


PAGES_WITH_CODE = [p for p in PAGES if runnable_blocks(p)]
BLOCKS = [(page, i) for page in PAGES_WITH_CODE for i in range(len(runnable_blocks(page)))]


@functools.lru_cache(maxsize=None)
def run_page(page: Path):
    """Execute the runnable blocks of ``page`` in order, in one namespace.

    Returns one ``(status, detail)`` per block: ``("ok", "")``,
    ``("skip", why)`` or ``("fail", traceback)``. A block whose requirement is
    missing is skipped on its own; so a block may use names defined only by
    earlier blocks that need no more than it does.
    """
    namespace = {"__name__": f"docs_{page.stem}"}
    results = []
    for line, requires, code in runnable_blocks(page):
        absent = [r for r in (missing(r) for r in requires) if r]
        if absent:
            results.append(("skip", f"{page.name}:{line} needs {', '.join(absent)}"))
            continue
        try:
            exec(compile(code, f"{page}:{line}", "exec"), namespace)
        except Exception:  # noqa: BLE001 - reported by the block's own test
            results.append(("fail", traceback.format_exc()))
        else:
            results.append(("ok", ""))
    return results


def test_some_pages_have_runnable_code():
    names = {p.name for p in PAGES_WITH_CODE}
    assert {"derivations.md", "oracle.md", "gpu.md"} <= names


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(DOCS)))
def test_every_run_marker_has_a_python_block(page):
    # a marker that is not directly followed by a ```python block would be ignored silently
    markers = len(re.findall(r"^<!--[ \t]*run\b", page.read_text(), re.M))
    assert markers == len(runnable_blocks(page)), f"{page.name}: a <!-- run --> marker has no block"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(DOCS)))
def test_ordered_lists_render_their_written_numbers(page):
    # Markdown numbers a list from its first item on and ignores the others: the steps
    # "1. 4. 5." of a derivation would be shown as 1. 2. 3., not the code's step numbers
    markdown_it = pytest.importorskip("markdown_it", reason="needs the docs extra (myst-parser)")
    renumbered, lists = [], []
    for tok in markdown_it.MarkdownIt("commonmark").parse(page.read_text()):
        if tok.type == "ordered_list_open":
            lists.append((tok.map[0] + 1, []))
        elif tok.type == "list_item_open" and lists and tok.markup in (".", ")"):
            lists[-1][1].append(int(tok.info))
        elif tok.type == "ordered_list_close":
            line, written = lists.pop()
            shown = list(range(written[0], written[0] + len(written)))
            if written != shown:
                renumbered.append(f"line {line}: written {written}, shown {shown}")
    assert not renumbered, f"{page.name}: ordered lists renumbered by Markdown: {renumbered}"


@pytest.mark.parametrize("page, index", [
    pytest.param(p, i, id=f"{p.relative_to(DOCS)}:{runnable_blocks(p)[i][0]}",
                 marks=[pytest.mark.gpu] if "cupy" in runnable_blocks(p)[i][1] else [])
    for p, i in BLOCKS  # `pytest -m gpu` runs the blocks that need CuPy with the rest of the GPU part
])
def test_runnable_snippet(page, index):
    status, detail = run_page(page)[index]
    if status == "skip":
        if "CuPy and a CUDA GPU" in detail and os.environ.get("NPATTN_REQUIRE_GPU") == "1":
            pytest.fail(detail + " (NPATTN_REQUIRE_GPU=1)")  # a GPU run must not pass by skipping
        pytest.skip(detail)
    assert status == "ok", f"the block at {page.name}:{runnable_blocks(page)[index][0]} failed:\n{detail}"


def test_pytest_m_gpu_selects_the_blocks_that_need_cupy():
    # scripts/gpu_check.sh and scripts/gpu_report.sh run the GPU part as `pytest -m gpu`: a
    # block that needs CuPy must be among what it selects, and a block that does not must not
    wanted = {f"{p.relative_to(DOCS)}:{line}" for p in PAGES_WITH_CODE
              for line, requires, _ in runnable_blocks(p) if "cupy" in requires}
    assert wanted, "no page has a block that needs CuPy"
    run = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-m", "gpu",
                          "-p", "no:cacheprovider", "-k", "test_runnable_snippet", __file__],
                         cwd=ROOT, capture_output=True, text=True, timeout=300)
    selected = set(re.findall(r"test_runnable_snippet\[(.+?)\]", run.stdout))
    assert selected == wanted, (sorted(selected), sorted(wanted), run.stdout[-2000:], run.stderr[-2000:])


# --------------------------------------------------------------------------
# cross-references

_XREF = re.compile(r"\{py:(?:func|meth|class|mod|attr|data|obj)\}`(?:[^`<]*<)?~?(?P<target>[\w.]+)>?`")


def test_cross_references_name_existing_objects():
    targets = {m.group("target") for p in PAGES for m in _XREF.finditer(p.read_text())}
    assert targets, "the docs link no API object"
    broken = sorted(t for t in targets if missing(t))
    assert not broken, f"docs link objects that do not exist: {broken}"


# --------------------------------------------------------------------------
# the API reference covers every public name

_DIRECTIVE = re.compile(r"^\.\. (?P<kind>auto\w+):: (?P<target>\S+)\n(?P<options>(?:   .*\n)*)", re.M)


def _api_documented() -> set:
    """The dotted names that docs/api/*.md renders: the targets of its autodoc directives,
    the ``:members:`` each lists, and the ``__all__`` of a module rendered with its members."""
    documented = set()
    for page in sorted((DOCS / "api").glob("*.md")):
        for m in _DIRECTIVE.finditer(page.read_text()):
            target, options = m.group("target"), m.group("options")
            documented.add(target)
            listed = re.search(r":members:(.*(?:\n      .*)*)", options)
            if listed and listed.group(1).strip():
                names = [n.strip() for n in listed.group(1).replace("\n", " ").split(",")]
            elif m.group("kind") == "automodule" and listed:  # a bare :members:
                names = getattr(importlib.import_module(target), "__all__", [])
            else:
                names = []
            documented.update(f"{target}.{n}" for n in names)
    return documented


def test_the_api_reference_renders_every_public_name():
    # each name of a library module's __all__ (the tools' modules are the commands', but
    # for the audit; the hypothesis strategies need hypothesis, docs/api/verify.md names
    # them) is rendered under one of the names it is exported as
    documented = _api_documented()
    modules = [n for n in _package_modules() if n == "npattn.tools.audit"
               or not n.startswith(("npattn.tools", "npattn.testing.strategies"))]
    exported: dict = {}
    for name in modules:
        module = importlib.import_module(name)
        for public in getattr(module, "__all__", []):
            obj = getattr(module, public)
            key = id(obj) if isinstance(obj, type) or callable(obj) else f"{name}.{public}"
            exported.setdefault(key, set()).add(f"{name}.{public}")
    undocumented = sorted(min(names) for names in exported.values()
                          if not names & documented and not min(names).rsplit(".", 1)[1].startswith("__"))
    assert len(documented) >= 100, f"only {len(documented)} names found: is the reader broken?"
    assert not undocumented, f"public names missing from docs/api: {undocumented}"


def test_the_api_reference_lists_each_state_read_with_its_restore():
    # a class rendered with a :members: list lists each restore_X method and the X that
    # reads the state it puts back (the blocks' forward_state and backward_state)
    documented = _api_documented()
    checked, unlisted = 0, []
    for page in sorted((DOCS / "api").glob("*.md")):
        for m in _DIRECTIVE.finditer(page.read_text()):
            if m.group("kind") != "autoclass" or not re.search(r":members:\s*\S", m.group("options")):
                continue
            target = m.group("target")
            module, name = target.rsplit(".", 1)
            cls = getattr(importlib.import_module(module), name)
            for restore in (n for n in dir(cls) if n.startswith("restore_") and callable(getattr(cls, n))):
                checked += 1
                unlisted += [f"{target}.{n}" for n in (restore, restore[len("restore_"):])
                             if f"{target}.{n}" not in documented]
    assert checked >= 4, f"only {checked} restore_ methods found: is the reader broken?"
    assert not unlisted, f"state methods missing from docs/api: {sorted(unlisted)}"


def _member_lists():
    """(page, target, class, listed names) of each ``autoclass`` in docs/api with a ``:members:`` list."""
    for page in sorted((DOCS / "api").glob("*.md")):
        for m in _DIRECTIVE.finditer(page.read_text()):
            listed = re.search(r":members:(.*(?:\n      .*)*)", m.group("options"))
            if m.group("kind") != "autoclass" or not (listed and listed.group(1).strip()):
                continue
            target = m.group("target")
            module, name = target.rsplit(".", 1)
            names = {n.strip() for n in listed.group(1).replace("\n", " ").split(",")}
            yield page, target, getattr(importlib.import_module(module), name), names


# Public members a :members: list leaves out on purpose.
_UNLISTED_MEMBERS = {
    # the models' params: their class docstrings' Attributes sections name each model's
    # parameters and shapes; a :members: entry would describe params a second time
    "npattn.gpt.GPT.params", "npattn.classifier.TransformerClassifier.params",
}


def test_a_members_list_names_every_public_member():
    # An explicit :members: list is all that autodoc renders of a class, so it names every
    # public attribute the class or an npattn base class defines (dict's and object's
    # excepted). docs/conf.py sets no default "members": that would replace every list
    # (sphinx-doc/sphinx#9709), which rendered ParameterDict.pop with dict.pop's docstring.
    conf = ast.parse((DOCS / "conf.py").read_text())
    defaults = next(ast.literal_eval(node.value) for node in ast.walk(conf)
                    if isinstance(node, ast.Assign)
                    and getattr(node.targets[0], "id", None) == "autodoc_default_options")
    assert "members" not in defaults, f"autodoc_default_options overrides the :members: lists: {defaults}"
    classes, unlisted = 0, []
    for page, target, cls, names in _member_lists():
        classes += 1
        public = {n for base in cls.__mro__ if base.__module__.split(".")[0] == "npattn"
                  for n in vars(base) if not n.startswith("_")}
        unlisted += [f"{page.name}: {target}.{n}" for n in sorted(public - names)
                     if f"{target}.{n}" not in _UNLISTED_MEMBERS]
    assert classes >= 8, f"only {classes} classes with a :members: list found: is the reader broken?"
    assert not unlisted, f"public members missing from their class's :members: list: {unlisted}"


# --------------------------------------------------------------------------
# the caches' fields


def _named_tuples():
    """(file, class node, source lines) of every NamedTuple class of the library (not the tools)."""
    for path in sorted((ROOT / "npattn").rglob("*.py")):
        if "tools" in path.parts:
            continue
        lines = path.read_text().splitlines()
        for node in ast.walk(ast.parse("\n".join(lines))):
            if isinstance(node, ast.ClassDef) and any(getattr(b, "id", None) == "NamedTuple"
                                                      for b in node.bases):
                yield path, node, lines


def test_every_named_tuple_documents_its_fields():
    # the API reference lists each field with its ``#:`` comment (docs/conf.py): a cache
    # says what it is, and each field what it holds
    found, missing_doc, missing_fields = 0, [], []
    for path, node, lines in _named_tuples():
        found += 1
        where = f"{path.relative_to(ROOT)}:{node.lineno} {node.name}"
        if ast.get_docstring(node) is None:
            missing_doc.append(where)
        for f in node.body:
            if isinstance(f, ast.AnnAssign) and "#:" not in lines[f.lineno - 1] \
                    and not lines[f.lineno - 2].strip().startswith("#:"):
                missing_fields.append(f"{where}.{f.target.id}")
    assert found >= 30, f"only {found} NamedTuple classes found: is the reader broken?"
    assert not missing_doc, f"NamedTuple classes without a docstring: {missing_doc}"
    assert not missing_fields, f"fields without a #: comment: {missing_fields}"


# --------------------------------------------------------------------------
# docstring examples


def _package_modules():
    names = ["npattn"]
    for info in pkgutil.walk_packages(npattn.__path__, "npattn."):
        if info.name.rsplit(".", 1)[-1] != "__main__":
            names.append(info.name)
    return names


@pytest.mark.parametrize("name", _package_modules())
def test_docstring_examples(name):
    try:
        module = importlib.import_module(name)
    except ImportError as exc:  # an optional dependency of that module is absent
        pytest.skip(f"{name}: {exc}")
    result = doctest.testmod(module, optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    assert result.failed == 0, f"{result.failed} docstring example(s) failed in {name}"


# --------------------------------------------------------------------------
# the Sphinx build


@pytest.fixture(scope="module")
def built_docs(tmp_path_factory):
    """One warning-free HTML build of the docs, shared by the tests below: ``(run, html_dir)``."""
    if importlib.util.find_spec("sphinx") is None or importlib.util.find_spec("myst_parser") is None:
        pytest.skip("building the docs needs the docs extra (sphinx, myst-parser)")
    out = tmp_path_factory.mktemp("docs")
    cmd = [sys.executable, "-m", "sphinx", "-W", "--keep-going", "-q", "-b", "html",
           "-d", str(out / "doctrees"), str(DOCS), str(out / "html")]
    run = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    return run, out / "html"


@pytest.mark.slow  # one Sphinx build, shared
def test_sphinx_build_is_warning_free(built_docs):
    run, html_dir = built_docs
    assert run.returncode == 0, f"sphinx build failed:\n{run.stdout}\n{run.stderr}"
    assert (html_dir / "derivations.html").exists()


@pytest.mark.slow  # the shared Sphinx build
def test_each_listed_member_is_rendered(built_docs):
    # a :members: list that autodoc ignores (a default "members", sphinx-doc/sphinx#9709)
    # left out every member a class inherits: GPT's save and load, TransformerBlock's train
    run, html_dir = built_docs
    assert run.returncode == 0, f"sphinx build failed:\n{run.stdout}\n{run.stderr}"
    absent = []
    for page, target, _, names in _member_lists():
        text = (html_dir / "api" / f"{page.stem}.html").read_text()
        absent += [f"{page.name}: {target}.{n}" for n in sorted(names) if f'id="{target}.{n}"' not in text]
    assert not absent, f"listed members that the built pages do not render: {absent}"


@pytest.mark.slow  # the shared Sphinx build
def test_named_tuple_fields_are_listed_and_are_no_link_targets(built_docs):
    run, html_dir = built_docs
    assert run.returncode == 0, f"sphinx build failed:\n{run.stdout}\n{run.stderr}"
    api = {p.name: p.read_text() for p in (html_dir / "api").glob("*.html")}
    text = re.sub(r"<[^>]+>", "", api["functional.html"])
    cache = text[text.index("npattn.functional.SDPACache("):]
    assert "Fields" in cache[:3000] and "[B, Hkv, Lk, Dv]" in cache[:3000], cache[:3000]
    for name, page in api.items():
        assert "Alias for field number" not in page, name
        # a word of a docstring's type ("array, shape (B, L)") linked to a field
        assert "ArraySpec.shape" not in page, name


_SCRIPT_SRC = re.compile(r"<script\b[^>]*\bsrc=[\"']?([^\"'\s>]+)", re.I)
_REMOTE = re.compile(r"^(?:[a-z][a-z0-9+.-]*:)?//", re.I)  # http://, https://, //cdn...


def test_remote_script_detector():
    srcs = _SCRIPT_SRC.findall('<script defer src="https://cdn.jsdelivr.net/npm/mathjax@4/tex.js">'
                               "<script src='_static/doctools.js?v=1'><script src=//x.org/a.js>")
    assert [bool(_REMOTE.match(s)) for s in srcs] == [True, False, True]


@pytest.mark.slow  # one Sphinx build, shared
def test_built_pages_load_no_remote_script(built_docs):
    """Offline, every page works: scripts come from the build, MathJax included."""
    run, html_dir = built_docs
    assert run.returncode == 0, run.stderr
    pages = sorted(html_dir.rglob("*.html"))
    assert len(pages) > 10
    remote = [f"{p.relative_to(html_dir)}: {src}" for p in pages
              for src in _SCRIPT_SRC.findall(p.read_text(encoding="utf-8")) if _REMOTE.match(src)]
    assert not remote, "pages load remote scripts:\n" + "\n".join(remote)
    derivations = (html_dir / "derivations.html").read_text(encoding="utf-8")
    mathjax = [s for s in _SCRIPT_SRC.findall(derivations) if "mathjax" in s.lower()]
    assert mathjax, "derivations.html loads no MathJax"
    for src in mathjax:  # a path inside the build, and the file is there
        assert (html_dir / src.split("?")[0]).is_file(), src


class _RenderedText(html.parser.HTMLParser):
    """The prose a reader sees and the tags seen: no script, style or MathJax's hidden MathML,
    and no code (a page may quote TeX in code, as index.md quotes ``$$``)."""

    _HIDDEN = {"script", "style", "mjx-assistive-mml", "math", "template", "noscript", "code", "pre"}

    def __init__(self):
        super().__init__()
        self.text, self.tags, self._hidden = [], [], 0

    def handle_starttag(self, tag, attrs):
        self.tags.append(tag)
        if tag in self._HIDDEN:
            self._hidden += 1

    def handle_endtag(self, tag):
        if tag in self._HIDDEN and self._hidden:
            self._hidden -= 1

    def handle_data(self, data):
        if not self._hidden:
            self.text.append(data)


def rendered(dom: str):
    parser = _RenderedText()
    parser.feed(dom)
    return "".join(parser.text), parser.tags


def test_rendered_text_reader():
    text, tags = rendered("<p>a <script>var s = '$$';</script><mjx-container><math>x</math>"
                          "<mjx-c>y</mjx-c></mjx-container> $$\\frac{1}{2}$$ <code>\\sum</code></p>"
                          "<pre><span>\\begin{align}</span></pre>")
    assert "mjx-container" in tags and "$$" in text and "\\frac" in text and "var s" not in text
    assert "\\sum" not in text and "\\begin" not in text


def _chromium():
    for name in ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable"):
        path = shutil.which(name)
        if path:
            return path
    return None


# One Chromium run typesets every page with math: a harness page loads them one at a time
# in an iframe (file:// pages may read each other's documents only with
# --allow-file-access-from-files), waits for MathJax, and reports per page the body as
# typeset and the TeX errors, read from MathJax's own math list: an merror node (a TeX
# error such as a missing argument), or the red mtext that MathJax's noundefined
# extension puts in place of an undefined macro (no merror there), and any math element
# MathJax did not typeset (a formula with an unbalanced brace is not even found).
_HARNESS = """<!doctype html>
<html><body><script>
const pages = %(pages)s;
const report = {};
function texErrors(w) {
  const errors = [];
  for (const item of w.MathJax.startup.document.math) {
    item.root.walkTree(node => {
      if (node.isKind("merror")) {
        errors.push([item.math, node.attributes.get("data-mjx-error") || "merror"]);
      } else if (node.isKind("mtext") && node.attributes.get("mathcolor") === "red") {
        const text = node.childNodes.map(c => c.getText ? c.getText() : "").join("");
        if (text.startsWith("\\\\")) errors.push([item.math, "undefined control sequence " + text]);
      }
    });
  }
  for (const el of w.document.querySelectorAll(".math")) {
    if (!el.querySelector("mjx-container")) errors.push([el.textContent, "not typeset"]);
  }
  return errors;
}
async function typeset(name) {
  const frame = document.createElement("iframe");
  const loaded = new Promise(resolve => { frame.onload = resolve; });
  frame.src = name;
  document.body.appendChild(frame);
  await loaded;
  const w = frame.contentWindow;
  try {
    await w.MathJax.startup.promise;
    report[name] = {errors: texErrors(w), dom: w.document.body.outerHTML};
  } catch (e) {
    report[name] = {errors: [["", "MathJax did not run: " + e]], dom: w.document.body.outerHTML};
  }
  frame.remove();
}
(async () => {
  const out = document.createElement("script");  // rewritten after each page: a run cut
  out.type = "application/json";                   // short still says which pages it did
  out.id = "report";
  document.body.appendChild(out);
  for (const name of pages) {
    await typeset(name);
    out.textContent = JSON.stringify(report).replace(/</g, "\\\\u003c");
  }
})();
</script></body></html>
"""


def _pages_with_math(html_dir: Path) -> dict:
    """``{page: number of math elements}`` for each built page with math, as Sphinx wrote it."""
    found = {}
    for page in sorted(html_dir.rglob("*.html")):
        # Sphinx's math spans and divs, not their wrappers
        n_math = len(re.findall(r'class="math[ "]', page.read_text(encoding="utf-8")))
        if n_math:
            found[page.relative_to(html_dir).as_posix()] = n_math
    return found


@pytest.mark.slow
@pytest.mark.skipif(_chromium() is None,
                    reason="the browser check needs Chromium (Debian: apt-get install -y chromium)")
def test_math_is_typeset_in_a_headless_browser(built_docs):
    """Every page with math in headless Chromium, offline: MathJax typesets every formula."""
    run, html_dir = built_docs
    assert run.returncode == 0, run.stderr
    pages = _pages_with_math(html_dir)
    expected = {"derivations.html", "layers.html", "positions.html", "transformer.html", "gpt.html"}
    assert expected <= set(pages), f"is the reader broken? pages with math: {pages}"
    assert pages["derivations.html"] > 20
    source = (html_dir / "derivations.html").read_text(encoding="utf-8")
    assert "\\frac" in rendered(source)[0]  # untypeset, the page is raw TeX: the check can fail
    harness = html_dir.parent / "typeset-harness.html"  # next to the build, not in it
    harness.write_text(_HARNESS % {"pages": json.dumps([(html_dir / p).as_uri() for p in pages])},
                       encoding="utf-8")
    cmd = [_chromium(), "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run",
           "--allow-file-access-from-files", "--virtual-time-budget=30000", "--dump-dom",
           harness.as_uri()]
    dom = subprocess.run(cmd, capture_output=True, text=True, timeout=300).stdout
    found = re.search(r'<script type="application/json" id="report">(.*?)</script>', dom, re.S)
    assert found, "the harness page did not load:\n" + dom[-500:]
    report = {uri.split(html_dir.as_uri() + "/", 1)[-1]: result
              for uri, result in json.loads(found.group(1)).items()}
    assert set(report) == set(pages), \
        f"pages not reported (did the time budget run out?): {sorted(set(pages) - set(report))}"
    problems = []
    for name, n_math in pages.items():
        text, tags = rendered(report[name]["dom"])
        if "article" not in tags:
            problems.append(f"{name}: Chromium returned no page: {report[name]['dom'][:300]}")
            continue
        problems += [f"{name}: {error}, in: {' '.join(tex.split())}"
                     for tex, error in report[name]["errors"]]
        if tags.count("mjx-container") < n_math:
            problems.append(f"{name}: {tags.count('mjx-container')} of {n_math} formulas typeset")
        problems += [f"{name}: raw TeX {raw!r} left in the rendered text"
                     for raw in ("$$", "\\frac", "\\mathrm", "\\sum", "\\begin{", "\\(", "\\[")
                     if raw in text]
    assert not problems, "MathJax did not typeset every formula:\n" + "\n".join(problems)


# --------------------------------------------------------------------------
# the conventions as the docs word them, against code written from the words


def _documented_attention(q, k, v, *, align, window, softcap, alibi, sinks, q_seg, k_seg, scale):
    """docs/conventions.md, "Windows, softcap, ALiBi, sinks, segments and the log-sum-exp",
    one score at a time: query i sits at key position i + o (o = Lk - Lq bottom-right),
    may attend key j if i + o - left <= j <= i + o + right and their segments are equal;
    z = softcap * tanh(s / softcap) - slope * |i + o - j|; the sink joins each denominator."""
    B, H, Lq, Dh = q.shape
    Lk = k.shape[2]
    o = Lk - Lq if align == "bottom_right" else 0
    left, right = window
    out = np.zeros((B, H, Lq, v.shape[-1]))
    lse = np.full((B, H, Lq), -np.inf)
    for b, h, i in np.ndindex(B, H, Lq):
        z, keys = [], []
        for j in range(Lk):
            if (left is not None and j < i + o - left) or (right is not None and j > i + o + right):
                continue
            if q_seg[b, i] != k_seg[b, j]:
                continue
            s = scale * float(q[b, h, i] @ k[b, h, j])
            c = s if softcap is None else softcap * math.tanh(s / softcap)
            z.append(c - alibi[h] * abs(i + o - j))
            keys.append(j)
        denominator = math.exp(sinks[h]) + sum(math.exp(t) for t in z)
        lse[b, h, i] = math.log(denominator)
        for t, j in zip(z, keys):
            out[b, h, i] += math.exp(t) / denominator * v[b, h, j]
    return out, lse


@pytest.mark.parametrize("impl", ["reference", "blocked", "numpy"])
@pytest.mark.parametrize("align", ["top_left", "bottom_right"])
def test_kernel_options_follow_the_documented_formulas(impl, align):
    # each option's formula, as docs/conventions.md states it, computed score by score:
    # a window off by one on either side, ALiBi of the other sign, a softcap without its
    # factor, a bottom-right offset of the other sign or a sink left out of lse all differ
    from npattn import attention as A

    rng = np.random.default_rng(11)
    B, H, Lq, Lk, Dh = 2, 2, 5, 7, 4
    q, k, v = (rng.standard_normal((B, H, n, Dh)) for n in (Lq, Lk, Lk))
    plain = dict(softcap=None, alibi=np.zeros(H), sinks=np.full(H, -np.inf),
                 q_seg=np.zeros((B, Lq)), k_seg=np.zeros((B, Lk)))
    # a window, and is_causal, which is right = 0, each about the diagonal that align moves
    for window, kwargs in [((2, 1), dict(window=(2, 1))), ((None, 1), dict(window=(None, 1))),
                           ((1, None), dict(window=(1, None))), ((None, 0), dict(is_causal=True))]:
        out, cache = A.sdpa_forward(q, k, v, align=align, scale=0.7, impl=impl, **kwargs)
        want, want_lse = _documented_attention(q, k, v, align=align, window=window, scale=0.7, **plain)
        np.testing.assert_allclose(out, want, rtol=1e-12, atol=1e-14, err_msg=str(window))
        np.testing.assert_allclose(cache.lse, want_lse, rtol=1e-12, atol=1e-14, err_msg=str(window))
    if impl == "numpy":  # the NumPy kernel takes windows, not the other kernel options
        return
    alibi, sinks = rng.random(H), rng.standard_normal(H)
    q_seg = np.array([[0, 0, 1, 1, 1], [0, 0, 0, 0, 0]])
    k_seg = np.array([[0, 0, 0, 1, 1, 1, 1], [0, 0, 0, 0, 0, 0, 0]])
    out, cache = A.sdpa_forward(q, k, v, align=align, window=(2, 1), softcap=1.5, scale=0.7,
                                alibi_slopes=alibi, sinks=sinks, q_segments=q_seg,
                                k_segments=k_seg, impl=impl)
    want, want_lse = _documented_attention(q, k, v, align=align, window=(2, 1), softcap=1.5,
                                           scale=0.7, alibi=alibi, sinks=sinks, q_seg=q_seg,
                                           k_seg=k_seg)
    np.testing.assert_allclose(out, want, rtol=1e-12, atol=1e-14)
    np.testing.assert_allclose(cache.lse, want_lse, rtol=1e-12, atol=1e-14)


def test_dropout_p_is_the_drop_probability():
    # docs/conventions.md: `p` is the probability of dropping an entry, as torch's; the
    # keep-mask every implementation and backend shares keeps 1 - p of the entries
    from npattn.backend import dropout_key, keep_mask

    n = 400_000
    for p in (0.1, 0.25, 0.7):
        kept = keep_mask(dropout_key(np.random.default_rng(3)), p, (4, 2, 250, 200), np).mean()
        assert abs(kept - (1 - p)) < 5 * math.sqrt(p * (1 - p) / n), (p, kept)
    # and the kept entries are scaled by 1 / (1 - p), the dropped ones are 0
    x = np.random.default_rng(4).standard_normal((2, 3, 40, 50))
    y, cache = F.dropout_forward(x, 0.25, rng=5)
    keep = keep_mask(cache.key, 0.25, x.shape, np)
    np.testing.assert_array_equal(y == 0, ~keep)
    np.testing.assert_allclose(y, np.where(keep, x / 0.75, 0.0), rtol=1e-15, atol=0)


@pytest.mark.parametrize("interleaved", [False, True])
def test_rope_follows_the_documented_rotation(interleaved):
    # docs/positions.md: pair c, (x_c, x_{c + Dh/2}) half-split or (x_2c, x_2c+1)
    # interleaved, is rotated by theta = p * base^(-2c / Dh), y1 = x1 cos - x2 sin,
    # y2 = x2 cos + x1 sin; an int start gives positions start + arange(L)
    from npattn import positions as P

    rng = np.random.default_rng(7)
    L, Dh, start, base = 6, 8, 3, 500.0
    x = rng.standard_normal((2, 3, L, Dh))
    out, _ = P.rope_forward(x, start, interleaved=interleaved, base=base)
    want = np.empty_like(x)
    for pos, c in np.ndindex(L, Dh // 2):
        theta = (start + pos) * base ** (-2 * c / Dh)
        i1, i2 = (2 * c, 2 * c + 1) if interleaved else (c, c + Dh // 2)
        x1, x2 = x[..., pos, i1], x[..., pos, i2]
        want[..., pos, i1] = x1 * math.cos(theta) - x2 * math.sin(theta)
        want[..., pos, i2] = x2 * math.cos(theta) + x1 * math.sin(theta)
    np.testing.assert_allclose(out, want, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("offset", [0, 2])
def test_shaw_relative_scores_follow_the_documented_rows(offset):
    # docs/positions.md: pair (i, j) reads row clip(j - i - o, -K, K) + K of the table
    # (K = M - 1, farther pairs share the end rows), and the bias of the scores is
    # scale * q_i . r_{j - i - o}, scale = 1 / sqrt(E) by default
    from npattn import positions as P

    rng = np.random.default_rng(9)
    Lq, Lk, E, M = 4, 6, 3, 3
    K = M - 1
    table = rng.standard_normal((2 * M - 1, E))
    q = rng.standard_normal((2, 2, Lq, E))
    rel, _ = P.relative_embedding_forward(table, Lq, Lk, offset=offset)
    bias, _ = P.relative_scores_forward(q, table, Lk, offset=offset)
    for i, j in np.ndindex(Lq, Lk):
        row = table[min(max(j - i - offset, -K), K) + K]
        np.testing.assert_array_equal(rel[i, j], row)
        np.testing.assert_allclose(bias[..., i, j], q[..., i, :] @ row / math.sqrt(E), rtol=1e-12)


def test_gelu_follows_the_documented_forms():
    # docs/layers.md: exact y = x Phi(x), Phi(x) = (1 + erf(x / sqrt 2)) / 2; tanh form
    # y = x (1 + tanh(sqrt(2 / pi) (x + 0.044715 x^3))) / 2; and dx = dy (Phi(x) + x phi(x))
    from npattn import layers

    x = np.random.default_rng(3).standard_normal(50) * 3.0
    dy = np.random.default_rng(4).standard_normal(50)
    exact = np.array([t * (1 + math.erf(t / math.sqrt(2))) / 2 for t in x])
    tanh_form = np.array([t * (1 + math.tanh(math.sqrt(2 / math.pi) * (t + 0.044715 * t**3))) / 2
                          for t in x])
    y, cache = layers.gelu_forward(x)
    np.testing.assert_allclose(y, exact, rtol=1e-13, atol=1e-15)
    pdf = np.exp(-x * x / 2) / math.sqrt(2 * math.pi)
    np.testing.assert_allclose(layers.gelu_backward(dy, cache), dy * (exact / x + x * pdf),
                               rtol=1e-12, atol=1e-15)
    np.testing.assert_allclose(layers.gelu_forward(x, "tanh")[0], tanh_form, rtol=1e-13, atol=1e-15)


def test_adam_and_clipping_follow_the_documented_updates():
    # docs/derivations.md (adam-derivation): m_t = b1 m + (1 - b1) g, v_t = b2 v + (1 - b2) g^2,
    # w <- w - lr (m_t / (1 - b1^t)) / (sqrt(v_t / (1 - b2^t)) + eps), g + weight_decay w first;
    # docs/gpt.md: clipping multiplies every gradient by min(1, c / (||g|| + 1e-6))
    from npattn import nn

    rng = np.random.default_rng(5)
    w = {"a": rng.standard_normal((3, 2)), "b": rng.standard_normal(4)}
    state = nn.adam_init(w)
    m = {k: np.zeros_like(p) for k, p in w.items()}
    v = {k: np.zeros_like(p) for k, p in w.items()}
    want = dict(w)
    lr, (b1, b2), eps, wd = 0.01, (0.8, 0.95), 1e-3, 0.1
    for t in (1, 2, 3):
        g = {k: rng.standard_normal(p.shape) for k, p in w.items()}
        w, state = nn.adam_step(w, g, state, lr=lr, betas=(b1, b2), eps=eps, weight_decay=wd)
        for k in want:
            gk = g[k] + wd * want[k]
            m[k] = b1 * m[k] + (1 - b1) * gk
            v[k] = b2 * v[k] + (1 - b2) * gk**2
            want[k] = want[k] - lr * (m[k] / (1 - b1**t)) / (np.sqrt(v[k] / (1 - b2**t)) + eps)
            np.testing.assert_allclose(w[k], want[k], rtol=1e-13, atol=1e-15)
    g = {"a": np.full((3, 2), 2.0), "b": np.full(4, -1.0)}  # ||g|| = sqrt(6 * 4 + 4) = sqrt(28)
    clipped, total = nn.clip_grad_norm(g, 1.5)
    assert math.isclose(total, math.sqrt(28), rel_tol=1e-15)
    for k in g:
        np.testing.assert_allclose(clipped[k], g[k] * 1.5 / (math.sqrt(28) + 1e-6), rtol=1e-15)
    small, _ = nn.clip_grad_norm(g, 10.0)  # under the cap: unchanged
    assert all(np.array_equal(small[k], g[k]) for k in g)


def test_sampling_follows_the_documented_steps():
    # docs/gpt.md, sample_next: z = logits / tau; top-k keeps the entries not below the k-th
    # largest; p = softmax(z); the token is the first v whose cumulative p exceeds u ~ U[0, 1)
    from npattn.gpt import sample_next

    logits = np.array([[1.0, 3.0, 2.0, -1.0, 2.5]])
    n = 20_000
    for tau, top_k in [(1.0, None), (0.5, None), (2.0, 3), (1.0, 1)]:
        z = logits[0] / tau
        if top_k is not None:
            z = np.where(z >= np.sort(z)[-top_k], z, -np.inf)
        p = np.exp(z - z.max()) / np.exp(z - z.max()).sum()
        # the same draws u as the sampler's, one per row, from the same seed
        u = np.random.default_rng(8).random(n)
        want = np.minimum(np.searchsorted(np.cumsum(p), u, side="right"), len(p) - 1)
        got = sample_next(np.repeat(logits, n, axis=0), np.random.default_rng(8),
                          temperature=tau, top_k=top_k)
        assert np.mean(got == want) > 0.999, (tau, top_k)  # a u on a rounded CDF boundary may differ
        freq = np.bincount(got, minlength=len(p)) / n
        np.testing.assert_allclose(freq, p, atol=5 * math.sqrt(0.25 / n))
    assert (sample_next(logits, np.random.default_rng(0), greedy=True) == [1]).all()


def test_from_torch_mha_follows_the_documented_conversion():
    # docs/conventions.md: torch's True = ignore; all boolean: a boolean npattn mask (True = may
    # attend) of what no mask ignores; otherwise each boolean becomes -inf / 0 and the masks add
    from npattn import masks

    rng = np.random.default_rng(6)
    N, H, L, S = 2, 3, 4, 5
    attn = rng.random((L, S)) < 0.3
    pad = np.array([[False] * S, [False] * 3 + [True] * 2])
    keep = masks.from_torch_mha(attn, pad, n_head=H)
    np.testing.assert_array_equal(np.broadcast_to(keep, (N, H, L, S)),
                                  np.broadcast_to(~attn & ~pad[:, None, None, :], (N, H, L, S)))
    add = rng.standard_normal((N, S))
    out = masks.from_torch_mha(attn, add, n_head=H)
    np.testing.assert_array_equal(np.broadcast_to(out, (N, H, L, S)),
                                  np.broadcast_to(np.where(attn, -np.inf, 0.0) + add[:, None, None, :],
                                                  (N, H, L, S)))
    forced = masks.from_torch_mha(attn, pad, dtype="float64")
    np.testing.assert_array_equal(np.broadcast_to(forced, (N, 1, L, S)),
                                  np.where(attn[None, None] | pad[:, None, None, :], -np.inf, 0.0))


@pytest.mark.parametrize("mode", ["full", "vjp"])
def test_the_oracle_check_fails_a_gradient_off_by_a_little(mode):
    # docs/oracle.md trusts gradcheck's "pass": a dq off by a relative 1e-4 (a wrong
    # constant in a kernel's backward) is well past its rtol = 1e-6, and a right one passes
    from npattn.gradcheck import gradcheck

    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((1, 2, 3, 4)) for _ in range(3))

    def nudged(dout, cache):
        dq, dk, dv, _, _ = F.sdpa_backward(dout, cache)
        return dq * (1 + 1e-4), dk, dv

    def right(dout, cache):
        return F.sdpa_backward(dout, cache)[:3]

    bad = gradcheck(F.sdpa_forward, nudged, [q, k, v], names=["q", "k", "v"], mode=mode)
    assert not bad.ok and [r.passed for r in bad.inputs] == [False, True, True], bad
    good = gradcheck(F.sdpa_forward, right, [q, k, v], names=["q", "k", "v"], mode=mode)
    assert good.ok, good
    if mode == "full":  # entry by entry, the error it reports is the nudge, 1e-4 max |dq|
        out, cache = F.sdpa_forward(q, k, v)
        dq = right(rng.standard_normal(out.shape), cache)[0]
        assert 0.2e-4 < bad.inputs[0].max_rel_err < 5e-4, bad
        assert bad.inputs[0].max_abs_err < 1e-4 * 10 * np.abs(dq).max() + 1e-7, bad


def test_mean_pool_follows_the_documented_weights():
    # docs/layers.md (mean-pool-derivation): out is the mean of the tokens (m True), 1 / L
    # each without a mask; dx_i = w_i dout; a row with no token gives out = 0 and dx = 0
    from npattn import layers

    rng = np.random.default_rng(2)
    x, dout = rng.standard_normal((3, 5, 4)), rng.standard_normal((3, 4))
    m = np.array([[True] * 5, [True, False, True, True, False], [False] * 5])
    out, cache = layers.mean_pool_forward(x, m)
    want = np.stack([x[0].mean(axis=0), x[1, [0, 2, 3]].mean(axis=0), np.zeros(4)])
    np.testing.assert_allclose(out, want, rtol=1e-14, atol=0)
    dx = layers.mean_pool_backward(dout, cache)
    np.testing.assert_allclose(dx, m[..., None] * dout[:, None, :] / np.array([5, 3, 1])[:, None, None],
                               rtol=1e-14, atol=0)
    out, cache = layers.mean_pool_forward(x)
    np.testing.assert_allclose(out, x.mean(axis=1), rtol=1e-14)
    np.testing.assert_allclose(layers.mean_pool_backward(dout, cache),
                               np.broadcast_to(dout[:, None, :] / 5, x.shape), rtol=1e-14)


@pytest.mark.skipif(importlib.util.find_spec("torch") is None, reason="needs torch")
@pytest.mark.parametrize("dims", [{}, {"kdim": 3, "vdim": 5}])
def test_torch_state_dict_round_trip(dims):
    # docs/oracle.md ends with "npattn's parameters as a state dict that torch accepts":
    # torch then computes what npattn computes, every parameter random (biases included,
    # so that a q/k/v bias landing in another's slot shows)
    import torch

    from npattn import MultiHeadAttention

    D, H = 8, 2
    mha = MultiHeadAttention(D, H, add_bias_kv=True, dtype="float64", seed=0, **dims)
    rng = np.random.default_rng(12)
    mha.params = {k: rng.standard_normal(p.shape) for k, p in mha.params.items()}
    tmha = torch.nn.MultiheadAttention(D, H, add_bias_kv=True, batch_first=True,
                                       dtype=torch.float64, **dims).eval()
    tmha.load_state_dict(mha.torch_state_dict())
    query = rng.standard_normal((2, 3, D))
    key = rng.standard_normal((2, 4, dims.get("kdim", D)))
    value = rng.standard_normal((2, 4, dims.get("vdim", D)))
    out, _ = mha.eval()(query, key, value)
    t_out, _ = tmha(*(torch.tensor(a) for a in (query, key, value)), need_weights=False)
    np.testing.assert_allclose(out, t_out.detach().numpy(), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("window_size", [(0, 0), (1, 0), (0, 2), (-1, 1), (2, -1), (-1, -1)])
def test_flash_attn_window_size_as_documented(window_size):
    # docs/compat.md and conventions.md: flash-attn's window_size=(left, right), -1 = unbounded
    # (npattn's None), 0 = no key on that side, about the bottom-right diagonal
    from npattn.compat import flash_attn_func

    rng = np.random.default_rng(13)
    B, Lq, Lk, H, Dh = 2, 4, 6, 2, 3
    q, k, v = (rng.standard_normal((B, n, H, Dh)) for n in (Lq, Lk, Lk))  # (B, L, H, Dh)
    out = flash_attn_func(q, k, v, softmax_scale=0.6, window_size=window_size)
    window = tuple(None if w < 0 else w for w in window_size)
    want, _ = _documented_attention(*(a.transpose(0, 2, 1, 3) for a in (q, k, v)), align="bottom_right",
                                    window=window, softcap=None, alibi=np.zeros(H),
                                    sinks=np.full(H, -np.inf), q_seg=np.zeros((B, Lq)),
                                    k_seg=np.zeros((B, Lk)), scale=0.6)
    np.testing.assert_allclose(out, want.transpose(0, 2, 1, 3), rtol=1e-12, atol=1e-14)


def test_the_quoted_causal_masks_are_what_masks_causal_builds():
    # docs/conventions.md prints masks.causal(2, 5) top-left and bottom-right (1 = may attend)
    from npattn import masks

    text = (DOCS / "conventions.md").read_text()
    block = re.search(r"```\ntop_left +bottom_right\n(.*?)```", text, re.S).group(1)
    rows = [line.split() for line in block.strip().splitlines()]
    quoted = np.array(rows, dtype=int).astype(bool)  # [2, 10]: the two masks side by side
    top, bottom = quoted[:, :5], quoted[:, 5:]
    # the words beside them: j <= i top-left, j <= i + Lk - Lq bottom-right
    i, j = np.arange(2)[:, None], np.arange(5)[None, :]
    np.testing.assert_array_equal(top, j <= i)
    np.testing.assert_array_equal(bottom, j <= i + 5 - 2)
    np.testing.assert_array_equal(masks.causal(2, 5), top)
    np.testing.assert_array_equal(masks.causal(2, 5, "bottom_right"), bottom)


@pytest.mark.parametrize("align", ["top_left", "bottom_right"])
def test_masks_window_follows_the_documented_bounds(align):
    # conventions.md: query i may attend key j only if i + o - left <= j <= i + o + right,
    # o = 0 top-left, Lk - Lq bottom-right; None = unbounded
    from npattn import masks

    for Lq, Lk in [(4, 7), (6, 3)]:
        o = 0 if align == "top_left" else Lk - Lq
        i, j = np.arange(Lq)[:, None], np.arange(Lk)[None, :]
        for left, right in [(1, 0), (2, 1), (None, 1), (0, None), (0, 0)]:
            want = np.ones((Lq, Lk), dtype=bool)
            if left is not None:
                want &= j >= i + o - left
            if right is not None:
                want &= j <= i + o + right
            np.testing.assert_array_equal(masks.window(Lq, Lk, left, right, align), want,
                                          err_msg=f"{(Lq, Lk, left, right)}")


def test_the_dask_example_with_heads_split_across_chunks():
    # docs/dask.md: "a seed gives one keep-mask on every implementation and backend"; its
    # example keeps the heads of a batch entry in one chunk, here they are split in two and
    # the queries and keys in chunks of unequal sizes, so each chunk's keep-mask is drawn at
    # its own offsets
    da = pytest.importorskip("dask.array")
    import dask

    from npattn import attention

    rng = np.random.default_rng(1)
    B, H, L, Dh = 2, 4, 24, 8
    q, k, v, dout = (rng.standard_normal((B, H, L, Dh)) for _ in range(4))
    chunks = (1, 2, (10, 14), Dh)
    lazy = [da.from_array(a, chunks=chunks) for a in (q, k, v, dout)]
    out, cache = attention.sdpa_forward(*lazy[:3], is_causal=True, dropout_p=0.3, rng=7)
    out, grads = dask.compute(out, attention.sdpa_backward(lazy[3], cache))
    ref, ref_cache = attention.sdpa_forward(q, k, v, is_causal=True, dropout_p=0.3, rng=7)
    np.testing.assert_allclose(out, ref, rtol=1e-12, atol=1e-12)
    # and the mask that README.md says dropout_keep_mask returns is the one used, the same
    np.testing.assert_array_equal(np.asarray(attention.dropout_keep_mask(cache)),
                                  attention.dropout_keep_mask(ref_cache))
    for g, g_ref in zip(grads[:3], attention.sdpa_backward(dout, ref_cache)[:3]):
        np.testing.assert_allclose(g, g_ref, rtol=1e-12, atol=1e-12)


def test_the_documented_budget_factor_is_the_default():
    # docs/verify.md: "`budget_factor` is 2 by default"
    import inspect

    stated = re.search(r"`budget_factor` is (\d+(?:\.\d+)?) by default", (DOCS / "verify.md").read_text())
    assert stated, "docs/verify.md no longer states the default budget_factor"
    assert inspect.signature(npattn.verify).parameters["budget_factor"].default == float(stated.group(1))
