"""Sphinx configuration for the npattn docs (MyST Markdown + autodoc + napoleon).

Build warning-free, as CI does::

    python -m sphinx -W --keep-going -b html docs docs/_build/html
"""

import os
import sys

# npattn is imported from the source tree, installed or not
sys.path.insert(0, os.path.abspath(".."))

import npattn  # noqa: E402

project = "npattn"
author = "npattn developers"
copyright = "npattn developers"
release = npattn.__version__
version = ".".join(release.split(".")[:2])

extensions = [
    "myst_parser",
    "sphinx.ext.autodoc",
    "sphinx.ext.napoleon",
    "sphinx.ext.mathjax",
    # MathJax is copied into the build (_static/mathjax) and loaded from there,
    # so the derivations render offline; tests/test_docs.py checks that no page
    # loads a remote script.
    "sphinx-mathjax-offline",
    "sphinx.ext.viewcode",
]

source_suffix = {".md": "markdown", ".rst": "restructuredtext"}
root_doc = "index"
exclude_patterns = ["_build", "Thumbs.db", ".DS_Store"]

# -- MyST: $...$ and $$...$$ math, amsmath environments, ::: fences -----------
myst_enable_extensions = ["dollarmath", "amsmath", "colon_fence"]
myst_dmath_double_inline = True
myst_heading_anchors = 3

# -- autodoc + napoleon (numpydoc-style docstrings) --------------------------
autodoc_member_order = "bysource"
autodoc_typehints = "signature"
# No "members" here: a default "members" replaces every explicit ``:members:`` list
# (sphinx-doc/sphinx#9709), so a directive names its members (or says ``:members:``).
autodoc_default_options = {"show-inheritance": False}
napoleon_google_docstring = False
napoleon_numpy_docstring = True
napoleon_use_rtype = False
# module docstrings use a "Shape legend" section: render it as a rubric
napoleon_custom_sections = ["Shape legend"]

# -- HTML --------------------------------------------------------------------
html_theme = "furo"  # the theme of many scientific Python projects' docs
html_title = f"npattn {release}"
html_static_path = []


# -- a link to an npattn object that does not exist is an error --------------
# (Sphinx is silent about unresolved Python references unless nitpicky; turning
# nitpicky on would flag every external type. Check our own names only.)
from sphinx.util import logging as _logging  # noqa: E402

_logger = _logging.getLogger(__name__)


def _unresolved_npattn_reference(app, env, node, contnode):
    target = node.get("reftarget", "")
    if node.get("refdomain") == "py" and target.split(".")[0] == "npattn":
        _logger.warning("unresolved reference to %s", target, location=node,
                        type="ref", subtype="npattn")
    return None


# -- NamedTuple fields: a list in the class's docstring, not attributes ---------
# A field documented as an attribute becomes a link target, and Sphinx links
# every word of a docstring's type that matches one ("shape" in "array of
# shape (B, L)" went to ArraySpec.shape, "Lq" to a cache's field). The fields'
# ``#:`` comments are listed in their class's docstring instead.
from sphinx.pycode import ModuleAnalyzer  # noqa: E402


def _is_field(obj):
    return type(obj).__name__ == "_tuplegetter"  # a NamedTuple's field descriptor


def _skip_fields(app, what, name, obj, skip, options):
    return True if _is_field(obj) else None


def _list_fields(app, what, name, obj, options, lines):
    if what != "class" or not (isinstance(obj, type) and issubclass(obj, tuple)
                               and hasattr(obj, "_fields") and name.startswith("npattn.")):
        return
    analyzer = ModuleAnalyzer.for_module(obj.__module__)
    analyzer.analyze()
    lines += ["", ".. rubric:: Fields", ""]
    for field in obj._fields:
        doc = " ".join(line.strip() for line in analyzer.attr_docs.get((obj.__qualname__, field), []))
        lines.append(f"- ``{field}``: {doc}" if doc else f"- ``{field}``")
    lines.append("")


def setup(app):
    app.connect("missing-reference", _unresolved_npattn_reference)
    app.connect("autodoc-skip-member", _skip_fields)
    app.connect("autodoc-process-docstring", _list_fields)
