"""Sphinx configuration of jaxcomp's documentation site (docs/README.md says how to build it).

Choices, briefly:
* Sphinx + MyST (pages in Markdown) + autodoc/napoleon (Google-style docstrings): what JAX, optax,
  Flax and orbax use, so a JAX user finds the layout they know.
* sphinx-book-theme (optax's and Flax's theme). It builds offline: its assets ship in the wheel.
* No intersphinx: the build machine has no internet, and intersphinx fetches inventories at build
  time. References to jax/optax/flax are therefore plain text, not links.
* ``nitpicky = False``: type hints such as ``optax.GradientTransformation`` cannot resolve without
  intersphinx.
* ``sphinx.ext.doctest``: ``docs/build`` runs the ``{testcode}`` blocks of the pages and the ``>>>``
  examples of every docstring in the API reference (builder ``doctest``), with 8 simulated CPU
  devices — the same world the test suite runs in.
"""

import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # this checkout's jaxcomp, whatever is installed
sys.path.insert(0, str(ROOT / "docs" / "_ext"))

# 8 simulated CPU devices, set before JAX starts its backends (autodoc imports jaxcomp, and the
# doctests run in this process).
import jax  # noqa: E402

from jaxcomp.train import device_setup  # noqa: E402

device_setup.simulate_cpu_devices(8)
jax.config.update("jax_platforms", "cpu")

import jaxcomp  # noqa: E402

project = "jaxcomp"
author = "the jaxcomp authors"
copyright = "the jaxcomp authors; Apache-2.0"  # noqa: A001
release = version = jaxcomp.__version__

extensions = [
    "myst_parser",
    "sphinx.ext.autodoc",
    "sphinx.ext.autosummary",
    "sphinx.ext.napoleon",
    "sphinx.ext.doctest",
    "sphinx.ext.mathjax",
    "apigen",
]

source_suffix = {".rst": "restructuredtext", ".md": "markdown"}
root_doc = "index"
exclude_patterns = ["_build", "README.md", "_ext", "**/.ipynb_checkpoints"]
nitpicky = False

# MyST: `$…$` math is not used (pages write formulas in code spans, as the docstrings do);
# heading anchors let pages link to sections as [text](page.md#section).
myst_enable_extensions = ["colon_fence", "deflist"]
myst_heading_anchors = 3

# autodoc / napoleon: Google-style docstrings (Args / Returns / Raises / References / Attributes).
autodoc_member_order = "bysource"
autodoc_typehints = "signature"
autodoc_preserve_defaults = True
autosummary_generate = False  # apigen.py writes the pages itself, from __all__
napoleon_google_docstring = True
napoleon_numpy_docstring = False
napoleon_use_ivar = True  # "Attributes:" as a field list: no second target beside the real members


def _skip_namedtuple_fields(app, what, name, obj, skip, options):
  """NamedTuple fields are documented by the class's "Attributes:" section; their own docstrings
  are collections.namedtuple's "Alias for field number N"."""
  if (getattr(obj, "__doc__", None) or "").startswith("Alias for field number"):
    return True
  return None


# doctest: what every example may rely on (docs/README.md, "Examples that run").
doctest_global_setup = ""
doctest_default_flags = (
    __import__("doctest").ELLIPSIS | __import__("doctest").NORMALIZE_WHITESPACE
    | __import__("doctest").DONT_ACCEPT_TRUE_FOR_1)
doctest_test_doctest_blocks = "default"

html_theme = "sphinx_book_theme"
html_title = f"jaxcomp {release}"
html_theme_options = {
    "show_toc_level": 2,
    "navigation_with_keys": False,
    "use_download_button": False,
    "use_fullscreen_button": False,
}
html_static_path = ["_static"]
html_css_files = ["custom.css"]
html_last_updated_fmt = None
pygments_style = "default"


def setup(app):
  app.connect("autodoc-skip-member", _skip_namedtuple_fields)
