"""Sphinx configuration for the Oases API reference (`make docs`; built with -W, warnings are errors)."""
import os
import sys

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
# The editable install already puts both packages on sys.path; this keeps a bare checkout buildable.
for path in (os.path.join(ROOT, "python_api"), ROOT):
    if path not in sys.path:
        sys.path.insert(0, path)

import oases  # noqa: E402

project = "Oases"
release = version = oases.__version__
copyright = "the Oases authors"

extensions = ["sphinx.ext.autodoc", "sphinx.ext.napoleon"]
napoleon_numpy_docstring = False

# The public API is what each package's __all__ exports; members appear in source order.
autodoc_default_options = {"members": True, "member-order": "bysource"}
autodoc_class_signature = "mixed"
autodoc_typehints = "signature"
autodoc_preserve_defaults = True
# Overrides of torch methods without a docstring of their own stay bare: torch's docstrings refer to
# labels of torch's documentation.
autodoc_inherit_docstrings = False
# Pseudo-code in `backticks` is rendered as inline code, not as a cross-reference.
default_role = "code"
nitpicky = False

html_theme = "alabaster"
html_theme_options = {"nosidebar": False}
html_static_path = []
exclude_patterns = ["_build"]
