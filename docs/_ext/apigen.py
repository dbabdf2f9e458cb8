"""The API reference, written from the packages' ``__all__`` at every build.

For each public namespace (``jaxcomp``, ``jaxcomp.hooks``, ``jaxcomp.axis``) every name in its
``__all__`` gets an autodoc entry, so a name added to ``__all__`` appears in the reference without
editing the docs. ``jaxcomp``'s names are grouped by the private module that defines them (one page
per group); a module missing from ``GROUPS`` gets a page of its own, titled by its module name — add
it to ``GROUPS`` to give it a title and a place. Pages are written to ``api/generated/`` (git-ignored)
when ``config-inited`` fires, before Sphinx reads any source, and only when their text changed.
"""

from __future__ import annotations

import importlib
import inspect
import pathlib
import sys
import types

# (page, title, the jaxcomp._src modules whose public names it holds), in reading order.
GROUPS = (
    ("dense", "Dense means", ("dense",)),
    ("powersgd", "PowerSGD", ("powersgd",)),
    ("dgc", "Deep Gradient Compression", ("dgc",)),
    ("low_bit", "8-bit and 1-bit compression", ("quantized", "sign", "onebit_adam")),
    ("dion_demo", "Dion and DeMo", ("dion", "demo")),
    ("less_often", "Communicating less often",
     ("local_sgd", "diloco", "streaming_diloco", "sparseloco", "local_steps")),
    ("hooks_buckets", "Communication hooks and buckets", ("buckets", "hooks")),
    ("accumulate_guards", "Accumulation and guards", ("accumulate", "guard")),
    ("data_parallel", "Data parallelism and state layout", ("data_parallel", "sharding")),
    ("sharded", "Sharded optimizer state", ("zero",)),
    ("fsdp", "Fully sharded (ZeRO-3 / FSDP)", ("fsdp", "fsdp_step")),
    ("distributed", "Several processes", ("distributed",)),
    ("several_nodes", "Several nodes", ("hierarchical", "membership")),
    ("report", "Communication report", ("report", "phases")),
    ("core", "The protocol, axes and gradient signatures",
     ("interface", "compressor", "axis", "tree", "finite")),
)
NAMESPACES = (  # (page, title, module) of the namespaces documented name by name
    ("hooks", "jaxcomp.hooks", "jaxcomp.hooks"),
    ("axis", "jaxcomp.axis", "jaxcomp.axis"),
)
OUT = "api/generated"


def _home(obj, name: str) -> str:
  """The jaxcomp._src module that defines ``obj`` (for values without ``__module__``: that holds it)."""
  module = getattr(obj, "__module__", None)
  if isinstance(module, str) and module.startswith("jaxcomp._src."):
    return module.rsplit(".", 1)[1]
  for mod_name, mod in sorted(sys.modules.items()):
    if mod_name.startswith("jaxcomp._src.") and getattr(mod, name, None) is obj:
      return mod_name.rsplit(".", 1)[1]
  return "other"


def _kind(obj) -> int:
  """Functions, then classes, then exceptions, then data."""
  if inspect.isclass(obj):
    return 2 if issubclass(obj, BaseException) else 1
  return 0 if callable(obj) else 3


def _order(module, name: str) -> tuple:
  """Sort key of a page's entries: kind, then the order of the modules in ``GROUPS``, then each
  module's own order (its source lines)."""
  obj = getattr(module, name)
  modules = [m for group in GROUPS for m in group[2]]
  home = _home(obj, name)
  try:
    line = inspect.getsourcelines(obj)[1]
  except (TypeError, OSError):
    line = 0  # data
  return (_kind(obj), modules.index(home) if home in modules else len(modules), home, line,
          name.lower())


def _entry(qualname: str, obj) -> str:
  if inspect.isclass(obj):
    if issubclass(obj, BaseException):
      return f".. autoexception:: {qualname}\n"
    return f".. autoclass:: {qualname}\n   :members:\n"
  if callable(obj):
    return f".. autofunction:: {qualname}\n"
  return f".. autodata:: {qualname}\n   :no-value:\n"


def _page(title: str, namespace: str, names: list, intro: str = "") -> str:
  """A page: title, intro, a summary table, one autodoc entry per name.

  In a namespace other than ``jaxcomp``, a name that is the same object as a ``jaxcomp`` name is
  listed (linked to that entry) but not documented twice.
  """
  import jaxcomp
  module = importlib.import_module(namespace)
  names = sorted(names, key=lambda n: _order(module, n))
  top = {} if namespace == "jaxcomp" else {
      n: n for n in names if getattr(jaxcomp, n, None) is getattr(module, n) and n in jaxcomp.__all__}
  lines = [title, "=" * len(title), "", ".. currentmodule:: " + namespace, ""]
  if intro:
    lines += [intro, ""]
  lines += [".. autosummary::", ""]
  lines += [f"   {'jaxcomp.' + n if n in top else n}" for n in names] + [""]
  if top:
    also = ", ".join(f":py:obj:`jaxcomp.{n}`" for n in top)
    lines += [f"Also exported by ``jaxcomp`` and documented there: {also}.", ""]
  for n in names:
    if n not in top:
      lines.append(_entry(f"{namespace}.{n}", getattr(module, n)))
  return "\n".join(lines)


def pages() -> dict:
  """File name → text of every generated page, and ``toc.inc``: the toctree ``api/index.md`` includes."""
  import jaxcomp
  groups = {g[0]: [] for g in GROUPS}
  titles = {g[0]: g[1] for g in GROUPS}
  page_of = {m: g[0] for g in GROUPS for m in g[2]}
  for name in jaxcomp.__all__:
    obj = getattr(jaxcomp, name)
    if isinstance(obj, types.ModuleType):
      continue  # a namespace: a page of its own (NAMESPACES)
    home = _home(obj, name)
    page = page_of.get(home, home)
    if page not in groups:
      groups[page], titles[page] = [], f"{home} (not yet placed in docs/_ext/apigen.py)"
    groups[page].append(name)
  out = {}
  for page, names in groups.items():
    if names:
      out[f"{page}.rst"] = _page(titles[page], "jaxcomp", names)
  for page, title, namespace in NAMESPACES:
    module = importlib.import_module(namespace)
    intro = (f"The names of ``{namespace}``. For its purpose and an example, see the module "
             f"docstring below.\n\n.. automodule:: {namespace}\n   :no-members:\n")
    out[f"{page}.rst"] = _page(title, namespace, list(module.__all__), intro)
  toc = [".. toctree::", "   :maxdepth: 1", ""] + [f"   generated/{p[:-4]}" for p in out]
  out["toc.inc"] = "\n".join(toc) + "\n"
  return out


def write(app, config) -> None:
  folder = pathlib.Path(app.srcdir) / OUT
  folder.mkdir(parents=True, exist_ok=True)
  new = pages()
  for stale in [*folder.glob("*.rst"), *folder.glob("*.inc")]:
    if stale.name not in new:
      stale.unlink()
  for name, text in new.items():
    path = folder / name
    if not path.exists() or path.read_text() != text:
      path.write_text(text)


def setup(app):
  app.connect("config-inited", write)
  return {"parallel_read_safe": True, "parallel_write_safe": True}
