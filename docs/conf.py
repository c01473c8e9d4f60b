"""Sphinx configuration of the optax_safefactor site: MyST pages, notebooks, the API."""

import pathlib
import shutil
import sys

import optax_safefactor

DOCS = pathlib.Path(__file__).resolve().parent
ROOT = DOCS.parent
sys.path.insert(0, str(DOCS / "_ext"))

project = "optax_safefactor"
author = "The optax_safefactor authors"
copyright = "the optax_safefactor authors"
release = version = optax_safefactor.__version__

extensions = [
    "myst_nb",
    "sphinx.ext.autodoc",
    "sphinx.ext.autosummary",
    "sphinx.ext.napoleon",
    "sphinx.ext.intersphinx",
    "sphinx.ext.mathjax",
    # MathJax from the package (it sets mathjax_path to its own copy, which it writes into
    # the site's _static/mathjax/): the maths is typeset without any request off the site.
    "sphinx-mathjax-offline",
    "api_pages",
    "figures",
    "page_links",
]

# The built site, the generated API pages and the notebooks' copies (below) are outputs.
exclude_patterns = ["_build", "_inventories", "_ext", "**/.ipynb_checkpoints"]
source_suffix = {".md": "myst-nb", ".ipynb": "myst-nb"}

# Every cross-reference must resolve: a broken one is a warning, and CI builds with -W.
nitpicky = True
nitpick_ignore = [
    # Private type aliases in the public signatures; the docstrings say what each one is.
    ("py:class", "FactorRulesFn"),
    ("py:class", "DecayRateFn"),
    ("py:class", "EveryK"),
    ("py:class", "optax_safefactor._src.counters.MicroBatchCounters"),
    # optax documents no page for its ScalarOrSchedule alias (a float or a schedule).
    ("py:class", "optax.ScalarOrSchedule"),
    # jax.typing.DTypeLike (a dtype or its name), as autodoc spells it and its parts.
    ("py:class", "DTypeLike"),
    ("py:class", "numpy.dtype"),
    ("py:class", "jax._src.typing.SupportsDType"),
]

# Intersphinx reads inventories shipped in docs/_inventories/ instead of downloading each
# project's objects.inv: the build runs offline. docs/_inventories/write_inventories.py
# writes them from the names these pages reference, with the URLs of their real pages.
intersphinx_mapping = {
    "python": ("https://docs.python.org/3/", "_inventories/python.inv"),
    "jax": ("https://docs.jax.dev/en/latest/", "_inventories/jax.inv"),
    "optax": ("https://optax.readthedocs.io/en/latest/", "_inventories/optax.inv"),
    "numpy": ("https://numpy.org/doc/stable/", "_inventories/numpy.inv"),
    "flax": ("https://flax.readthedocs.io/en/latest/", "_inventories/flax.inv"),
}
intersphinx_timeout = 1

autodoc_typehints = "description"
autodoc_typehints_format = "short"
autodoc_member_order = "bysource"
autosummary_generate = False
napoleon_google_docstring = True
napoleon_numpy_docstring = False
napoleon_use_rtype = False

# The docstrings name arguments inside maths as \text{decay\_rate}: MathJax 3 reads the
# escaped underscore in \text only with its textmacros package (shipped with it).
mathjax3_config = {"loader": {"load": ["[tex]/textmacros"]},
                   "tex": {"packages": {"[+]": ["textmacros"]}}}

myst_enable_extensions = ["colon_fence", "dollarmath"]
myst_heading_anchors = 3

# The notebooks are committed without outputs; the build executes them (about 30 s on two
# cores), and a cell that raises fails it.
nb_execution_mode = "auto"
nb_execution_timeout = 300
nb_execution_raise_on_error = True
nb_execution_show_tb = True
nb_merge_streams = True

html_theme = "furo"
html_title = "optax_safefactor"
html_static_path = ["_static"]
html_css_files = ["custom.css"]
html_show_sourcelink = False
html_copy_source = False
html_last_updated_fmt = None


def _copy_notebooks(app) -> None:
  """The notebooks live in notebooks/ at the top of the repository; the site shows copies."""
  folder = DOCS / "notebooks"
  folder.mkdir(exist_ok=True)
  wanted = {path.name: path for path in (ROOT / "notebooks").glob("*.ipynb")}
  for stale in folder.glob("*.ipynb"):
    if stale.name not in wanted:
      stale.unlink()
  for name, source in wanted.items():
    target = folder / name
    if not target.exists() or target.read_bytes() != source.read_bytes():
      shutil.copyfile(source, target)


# Autodoc writes a type hint by the module that defines it, which for these is private; each
# is looked up by its public name instead.
PUBLIC_NAMES = {
    "jax.jaxlib._jax.Array": "jax.Array",
    "jax._src.mesh.Mesh": "jax.sharding.Mesh",
    "optax._src.base.GradientTransformation": "optax.GradientTransformation",
    "optax._src.base.GradientTransformationExtraArgs": "optax.GradientTransformationExtraArgs",
}


def _resolve_public_name(app, env, node, contnode):
  public = PUBLIC_NAMES.get(node.get("reftarget"))
  if public is None:
    return None
  from sphinx.ext import intersphinx

  node["reftarget"] = public
  return intersphinx.missing_reference(app, env, node, contnode)


def setup(app):
  app.connect("builder-inited", _copy_notebooks)
  app.connect("missing-reference", _resolve_public_name)
