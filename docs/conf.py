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

import os
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # this checkout's jaxcomp, whatever is installed
sys.path.insert(0, str(ROOT / "docs" / "_ext"))

# 8 simulated CPU devices, set before JAX starts its backends (autodoc imports jaxcomp, and the
# doctests run in this process).
import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)
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


# Today's docstrings that docutils cannot parse, mended in memory so that the build passes with
# warnings as errors. Each entry: (object, text in the docstring, replacement). Remove an entry once
# its docstring is fixed at the source; an entry that no longer matches is reported (not an error).
DOCSTRING_FIXES = (
    # jaxcomp/_src/dgc.py:839-840, coarse_dgc's Args: a parameter name list wrapped onto a second
    # line ("Field list ends without a blank line"). Fix: one name per entry, or the names on one line.
    ("jaxcomp.coarse_dgc",
     "steps_per_epoch,\n    value_dtype, sparsify, bucket_cap_mb: as in",
     "steps_per_epoch, value_dtype, sparsify, bucket_cap_mb: as in"),
    # jaxcomp/_src/quantized.py:219, quantized: "``all_gather``ed" (an inline literal must end before
    # a space or punctuation). Fix: "which every device receives by ``all_gather``".
    ("jaxcomp.quantized", "which is ``all_gather``ed.", "which every device receives by ``all_gather``."),
    # jaxcomp/_src/diloco.py, the module docstring's steps S1-S5 of streaming_diloco: "S1." is no
    # list marker for docutils, so the indented continuation lines read as definition lists and block
    # quotes ("Unexpected indentation"). Fix: make them a bullet list ("* S1. ..."), continuation
    # lines indented by two.
    ("jaxcomp._src.diloco",
     'S1. Pieces in flight: for each fragment whose exchange began k steps ago, 1 ≤ k ≤ τ, piece k of the\n'
     '    pseudo-gradient kept at its beginning (S5) is averaged over the devices (step 4, through\n'
     "    ``compressor``, one state per piece) and stored. It reads the state only, never this step's\n"
     '    gradient, so XLA may run it alongside the forward and backward pass.\n'
     'S2. Inner step (step 1).\n'
     'S3. The outer step of each fragment whose exchange began τ steps ago (with τ = 0: begins now, its\n'
     "    pseudo-gradient averaged at once, steps 3–4): the outer SGD on the fragment's θ with its own\n"
     '    momentum, kept if not finite (steps 5–6);\n'
     "S4. mixed into this device's parameters: θᵢ ← mix·θ + (1 − mix)·θᵢ, θᵢ holding what the device\n"
     '    learned during the τ steps of the exchange (mix = 1: every device set to θ, step 6).\n'
     "S5. A fragment's exchange begins (τ > 0): Δᵢ = θ − θᵢ (step 3) kept for S1 of the next τ steps.",
     '* S1. Pieces in flight: for each fragment whose exchange began k steps ago, 1 ≤ k ≤ τ, piece k of the\n'
     '  pseudo-gradient kept at its beginning (S5) is averaged over the devices (step 4, through\n'
     "  ``compressor``, one state per piece) and stored. It reads the state only, never this step's\n"
     '  gradient, so XLA may run it alongside the forward and backward pass.\n'
     '* S2. Inner step (step 1).\n'
     '* S3. The outer step of each fragment whose exchange began τ steps ago (with τ = 0: begins now, its\n'
     "  pseudo-gradient averaged at once, steps 3–4): the outer SGD on the fragment's θ with its own\n"
     '  momentum, kept if not finite (steps 5–6);\n'
     "* S4. mixed into this device's parameters: θᵢ ← mix·θ + (1 − mix)·θᵢ, θᵢ holding what the device\n"
     '  learned during the τ steps of the exchange (mix = 1: every device set to θ, step 6).\n'
     "* S5. A fragment's exchange begins (τ > 0): Δᵢ = θ − θᵢ (step 3) kept for S1 of the next τ steps."),
    # jaxcomp/_src/chunked_topk.py, the module docstring's step 3: "[min |v|, max |v|]" outside a
    # literal reads as a substitution reference |v|. Fix: "[min ``|v|``, max ``|v|``]".
    ("jaxcomp._src.chunked_topk", "[min |v|, max |v|]", "[min ``|v|``, max ``|v|``]"),
    # jaxcomp/_src/hooks.py, dgc_state, quantized_state and chunked_topk_state's Args: "**settings"
    # after another name opens an inline strong ("Inline strong start-string without end-string").
    # Fix: escape the stars, "ratio, \\*\\*settings:" (napoleon then lists both parameters).
    ("jaxcomp.hooks.dgc_state", "ratio, **settings:", "ratio, \\*\\*settings:"),
    ("jaxcomp.hooks.quantized_state", "bits, **settings:", "bits, \\*\\*settings:"),
    ("jaxcomp.hooks.chunked_topk_state", "k, **settings:", "k, \\*\\*settings:"),
)


def _mend_docstring(app, what, name, obj, options, lines):
  for target, old, new in DOCSTRING_FIXES:
    if name != target:
      continue
    text = "\n".join(lines)
    if old not in text:
      from sphinx.util import logging
      logging.getLogger(__name__).info(f"conf.DOCSTRING_FIXES: {target} no longer needs its fix")
      continue
    lines[:] = text.replace(old, new).split("\n")


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
  app.connect("autodoc-process-docstring", _mend_docstring, priority=100)  # before napoleon
