"""The architecture rules of STYLE.md that a reading of the imports can check.

Every ``import`` of an npattn module, at the top of a file or inside a
function (lazy), is an edge of the graph read here with ``ast``:

* imports run one way: no cycle;
* library code never imports ``npattn.tools`` (what the ``npattn`` command
  runs); only ``npattn/__main__.py``, the command itself, does;
* ``npattn.torch_interop`` is a leaf: it imports validation and backend only;
* no ``_private`` name is imported from another file, or read from another
  module through a name bound to it (``V._name``).
"""

import ast
from pathlib import Path

PKG = Path(__file__).resolve().parents[1] / "npattn"


def _module_name(path: Path) -> str:
    parts = path.relative_to(PKG.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_module_name(p): p for p in sorted(PKG.rglob("*.py"))}


def _from_target(package: str, node: ast.ImportFrom) -> str:
    """The module a ``from ... import`` reads from, its relative dots resolved in ``package``."""
    if not node.level:
        return node.module or ""
    base = package.split(".")
    base = base[: len(base) - node.level + 1]
    return ".".join(base + ([node.module] if node.module else []))


def _imports(name: str, path: Path):
    """(imported npattn module, names taken from it) for every import in the file."""
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "npattn":
                    yield alias.name, ()
        elif isinstance(node, ast.ImportFrom):
            target = _from_target(package, node)
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


def _module_aliases(name: str, path: Path, tree: ast.AST) -> dict:
    """{local name: npattn module} for every name the file binds to an npattn module:
    ``from . import validation as V``, ``import npattn.functional as F``, ``import npattn``."""
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    aliases = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] != "npattn":
                    continue
                if alias.asname:
                    aliases[alias.asname] = alias.name
                else:  # `import npattn.x` binds npattn itself
                    aliases["npattn"] = "npattn"
        elif isinstance(node, ast.ImportFrom):
            target = _from_target(package, node)
            for alias in node.names:
                if f"{target}.{alias.name}" in MODULES:
                    aliases[alias.asname or alias.name] = f"{target}.{alias.name}"
    return aliases


def _dotted(node: ast.AST):
    """``a.b.c`` of a chain of names and attributes, or None for anything else."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name):
        return None
    return ".".join([node.id, *reversed(parts)])


def _private_uses(name: str, path: Path, source: str) -> list:
    """(module, private name, line) for each attribute starting with ``_`` that the file reads
    from another npattn module, through any name it binds to that module."""
    tree = ast.parse(source)
    aliases = _module_aliases(name, path, tree)
    used = []
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Attribute) and node.attr.startswith("_")
                and not node.attr.startswith("__")):
            continue
        dotted = _dotted(node.value)
        if dotted is None:
            continue
        head, _, rest = dotted.partition(".")
        if head not in aliases:
            continue
        target = ".".join([aliases[head], *([rest] if rest else [])])
        if target in MODULES and target != name:
            used.append((name, f"{target}.{node.attr}", node.lineno))
    return used


def test_no_private_name_is_used_through_another_module():
    """``V._is_floating(...)`` after ``from . import validation as V`` uses validation's private
    name as much as ``from .validation import _is_floating`` does, which the test above refuses."""
    used = [u for name, path in MODULES.items() for u in _private_uses(name, path, path.read_text())]
    assert used == []


def test_the_private_name_check_sees_each_way_of_naming_a_module():
    """A private name reached through a module alias, a module imported by its name, a dotted
    path from ``npattn`` and an alias of ``import npattn.x as y`` is found; an attribute of
    another object, a dunder and a private name of the file's own module are not."""
    source = (
        "from . import validation as V\n"
        "from . import functional\n"
        "from . import module as own\n"
        "import npattn.backend\n"
        "import npattn.masks as M\n"
        "def f(self):\n"
        "    return (V._a, functional._b, npattn.backend._c, M._d, self._e, V.__name__,\n"
        "            own._f, V.check_bool)\n"
    )
    path = PKG / "module.py"
    found = [u[1] for u in _private_uses("npattn.module", path, source)]
    assert sorted(found) == ["npattn.backend._c", "npattn.functional._b", "npattn.masks._d",
                             "npattn.validation._a"]
