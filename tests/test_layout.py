"""The architecture rules of STYLE.md that a reading of the imports can check.

Every ``import`` of an npattn module, at the top of a file or inside a
function (lazy), is an edge of the graph read here with ``ast``:

* imports run one way: no cycle;
* library code never imports ``npattn.tools`` (what the ``npattn`` command
  runs); only ``npattn/__main__.py``, the command itself, does;
* ``npattn.torch_interop`` is a leaf: it imports validation and backend only;
* no ``_private`` name is imported from another file.
"""

import ast
from pathlib import Path

PKG = Path(__file__).resolve().parents[1] / "npattn"


def _module_name(path: Path) -> str:
    parts = path.relative_to(PKG.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_module_name(p): p for p in sorted(PKG.rglob("*.py"))}


def _imports(name: str, path: Path):
    """(imported npattn module, names taken from it) for every import in the file."""
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "npattn":
                    yield alias.name, ()
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if target.split(".")[0] != "npattn":
                continue
            names = [a.name for a in node.names]
            for n in names:  # `from . import functional` imports the module npattn.functional
                if f"{target}.{n}" in MODULES:
                    yield f"{target}.{n}", ()
            rest = tuple(n for n in names if f"{target}.{n}" not in MODULES)
            if rest:
                yield target, rest


GRAPH = {name: sorted({t for t, _ in _imports(name, path) if t != name and t in MODULES})
         for name, path in MODULES.items()}


def test_the_graph_was_read():
    assert "npattn.validation" in GRAPH["npattn.module"]
    assert "npattn.attention" in GRAPH["npattn.module"]  # the module goes through the dispatcher
    assert "npattn.numpy_kernel" in GRAPH["npattn.attention"]
    assert not any(t in GRAPH["npattn.functional"]
                   for t in ("npattn.attention", "npattn.blocked", "npattn.numpy_kernel"))
    assert "npattn.torch_interop" in GRAPH["npattn.module"]  # lazy, inside from_torch
    assert "npattn.tools.audit" in GRAPH["npattn.tools.cli"]


KNOWN_BACK_EDGES: set = set()  # none: every import runs one way


def test_imports_run_one_way():
    state = {}

    def visit(node, path):
        state[node] = "open"
        for nxt in GRAPH[node]:
            if (node, nxt) in KNOWN_BACK_EDGES:
                continue
            if state.get(nxt) == "open":
                raise AssertionError("import cycle: " + " -> ".join(path + [node, nxt]))
            if nxt not in state:
                visit(nxt, path + [node])
        state[node] = "done"

    for node in GRAPH:
        if node not in state:
            visit(node, [])


def test_library_code_never_imports_tools():
    offenders = {
        name: [t for t in targets if t == "npattn.tools" or t.startswith("npattn.tools.")]
        for name, targets in GRAPH.items()
        if not (name.startswith("npattn.tools") or name == "npattn.__main__")
    }
    assert {k: v for k, v in offenders.items() if v} == {}


def test_torch_interop_is_a_leaf():
    assert set(GRAPH["npattn.torch_interop"]) <= {"npattn.validation", "npattn.backend"}


def test_no_private_name_is_imported_from_another_file():
    private = [
        (name, target, n)
        for name, path in MODULES.items()
        for target, names in _imports(name, path)
        for n in names + (target.rsplit(".", 1)[-1],)
        if n.startswith("_") and not n.startswith("__")
    ]
    assert private == []
