"""Sphinx configuration of unimem's user's guide and API reference.

Build (warnings are errors, every cross-reference must resolve)::

    python -m sphinx -W -n -b html docs docs/_build/html

The pages are MyST Markdown, so that the guide's code blocks run under
pytest-codeblocks as the README's do (tests/integrations/test_readme.py); the
reference is autodoc over the installed package, and the CLI's help pages come
from its argparse parser at build time (_ext/unimem_docs.py). No page loads
anything from the network: no intersphinx, no CDN, Furo's assets are local.
"""
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "_ext"))
# The checkout's unimem (with its built extensions) before any installed copy.
sys.path.insert(0, os.path.dirname(HERE))

import unimem  # noqa: E402

project = "unimem"
author = "the unimem developers"
copyright = "the unimem developers"
release = version = unimem.__version__

extensions = [
    "myst_parser",
    "sphinx.ext.autodoc",
    "sphinx.ext.napoleon",
    "unimem_docs",
]
source_suffix = {".md": "markdown", ".rst": "restructuredtext"}
exclude_patterns = ["_build", "Thumbs.db", ".DS_Store"]
myst_enable_extensions = ["colon_fence", "deflist"]
myst_heading_anchors = 3

# The reference: the docstrings as written (reST with Sphinx roles, and the
# "Args:" sections PyTorch's docstrings use, which napoleon reads).
autodoc_default_options = {"members": True, "member-order": "bysource", "show-inheritance": False}
autodoc_typehints = "signature"
autodoc_preserve_defaults = False
napoleon_google_docstring = True
napoleon_numpy_docstring = False

nitpicky = True
# A block without a language (what an example prints) is shown as plain text.
highlight_language = "text"

html_theme = "furo"
html_title = f"unimem {release}"
html_last_updated_fmt = None
html_show_sourcelink = False
html_copy_source = False

# Signatures name these aliases rather than spelling out their unions;
# reference/arguments.md says what each accepts (unimem_docs links them there).
autodoc_type_aliases = {name: name for name in ("DeviceLike", "MemoryLike", "PathLike", "_history.PathLike")}
