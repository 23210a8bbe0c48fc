"""Sphinx configuration of the docs check (python3 -m scripts.docs_check).

A minimal project holding the series' docs page(s) and an index whose toctree mirrors
the "Getting Started for PyTorch Users" toctree of upstream's docs/source/torch.compiler.md,
where the page belongs. Built with -W: any warning (a page in no toctree, a bad reference,
a docstring that is not valid reStructuredText) fails the check. The extensions are the ones
upstream's docs use for these pages: MyST for Markdown, autodoc for the module docstrings.
"""

project = "RFC-0051 docs check"
extensions = ["myst_parser", "sphinx.ext.autodoc"]
source_suffix = {".md": "markdown", ".rst": "restructuredtext"}
myst_enable_extensions = ["colon_fence", "deflist"]
root_doc = "index"
html_theme = "alabaster"
autodoc_typehints = "none"
nitpicky = False
