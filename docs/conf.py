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
autodoc_default_options = {"members": True, "show-inheritance": False}
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


def setup(app):
    app.connect("missing-reference", _unresolved_npattn_reference)
