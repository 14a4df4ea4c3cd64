"""Sphinx configuration of the Oases documentation site (`make docs`: built with -W, warnings are
errors): the Markdown pages of docs/ (MyST) and the API reference generated from the docstrings
(docs/api/).

A link from a page to a file of the repository outside docs/ (`../README.md`, a source file, a
test) resolves to that file's place in the checkout, relative to the built page, so the site read
from build/docs/ in a checkout reaches it; a link to anything that does not exist stays a warning
(so an error: a broken link fails the build). Not checked: an anchor into such a file
(`../README.md#a-heading`), and whether the file is tracked (a clean-clone CI build is). The
links are right for the site as `make docs` builds it, in build/docs/ of a checkout.
"""

import os
import sys

DOCS = os.path.abspath(os.path.dirname(__file__))
ROOT = os.path.dirname(DOCS)
# The editable install already puts both packages on sys.path; this keeps a bare checkout buildable.
for path in (os.path.join(ROOT, "python_api"), ROOT):
    if path not in sys.path:
        sys.path.insert(0, path)

import oases  # noqa: E402

project = "Oases"
release = version = oases.__version__
copyright = "the Oases authors"

extensions = ["myst_parser", "sphinx.ext.autodoc", "sphinx.ext.napoleon"]
source_suffix = {".rst": "restructuredtext", ".md": "markdown"}
root_doc = "index"
napoleon_numpy_docstring = False
myst_heading_anchors = 4  # `[text](page.md#a-heading)` links resolve to the heading
myst_enable_extensions = ["strikethrough"]
suppress_warnings = ["myst.strikethrough"]  # (HTML output only: the extension's own notice)

# The public API is what each package's __all__ exports; members appear in source order.
autodoc_default_options = {"members": True, "member-order": "bysource"}
autodoc_class_signature = "mixed"
napoleon_include_init_with_doc = True  # a constructor's Args (GPT, Pipeline) shown with its class
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
# The result files are linked from the pages (tables, logs, plots), not pages of their own.
exclude_patterns = ["_build", "results/**"]


def _checkout_link(env, refdoc: str, path: str, anchor: str):
    """A reference node to `path` (absolute, in the checkout), relative to the page of `refdoc`
    as `make docs` builds it (build/docs/); None where no such file or folder exists."""
    from docutils import nodes

    path = os.path.normpath(path)
    if not path.startswith(ROOT + os.sep) or not os.path.exists(path):
        return None  # a broken link: MyST's warning stands
    page_dir = os.path.join(ROOT, "build", "docs", os.path.dirname(refdoc))
    uri = os.path.relpath(path, page_dir) + ("/" if os.path.isdir(path) else "") + (f"#{anchor}" if anchor else "")
    return nodes.reference("", "", internal=False, refuri=uri)


def setup(app):
    from sphinx import addnodes
    from sphinx.transforms.post_transforms import SphinxPostTransform

    class CheckoutLinks(SphinxPostTransform):
        """Before MyST resolves its links (priority 9): a Markdown link to a Markdown file that is
        not a page of the site (README.md, CHANGELOG.md, a result table) or to a folder of the
        checkout becomes a link to it there."""

        default_priority = 8

        def run(self, **kwargs):
            env = self.env
            for node in list(self.document.findall(addnodes.pending_xref)):
                if node.get("reftype") != "myst":
                    continue
                refdoc = node.get("refdoc", env.docname)
                if node.get("refdomain") == "doc":
                    if node["reftarget"] in env.all_docs:
                        continue
                    base = os.path.join(str(env.srcdir), node["reftarget"])  # a docname: no suffix
                    path = next((base + suffix for suffix in (".md", ".rst") if os.path.exists(base + suffix)), base)
                    anchor = node.get("reftargetid") or ""
                elif not node.get("refdomain"):
                    target, _, anchor = node["reftarget"].partition("#")
                    path = os.path.join(os.path.dirname(str(env.doc2path(refdoc))), target)
                else:
                    continue
                ref = _checkout_link(env, refdoc, path, anchor)
                if ref is not None:
                    ref += node[0].deepcopy()
                    node.replace_self(ref)

    app.add_post_transform(CheckoutLinks)
