"""One API page per name in ``optax_safefactor.__all__``, written before Sphinx reads the sources.

The pages go to ``docs/api/`` (not committed): a public name added to ``__all__`` gets its
page at the next build, a removed one loses it. A function, class, exception or constant
gets its autodoc entry; a module gets its docstring, a table of its functions and an entry
for each. The ``{public-names}`` directive is the summary table of ``docs/api.md``.
"""

from __future__ import annotations

import importlib
import inspect
import pathlib
import re
import sys
import types

PACKAGE = "optax_safefactor"


def public_names(package: types.ModuleType) -> list[str]:
  """The package's ``__all__``, sorted case-insensitively (the order of the API index)."""
  return sorted(package.__all__, key=str.lower)


def module_functions(module: types.ModuleType) -> list[str]:
  """A public module's functions: its ``__all__``, else the functions defined in it."""
  if hasattr(module, "__all__"):
    return list(module.__all__)
  return [name for name, value in inspect.getmembers(module, inspect.isfunction)
          if value.__module__ == module.__name__ and not name.startswith("_")]


def _directive(obj: object) -> str:
  if inspect.isclass(obj):
    return "autoexception" if issubclass(obj, BaseException) else "autoclass"
  if inspect.isfunction(obj):
    return "autofunction"
  return "autodata"


def page(package: types.ModuleType, name: str) -> str:
  """The MyST source of the page of ``package.name``."""
  obj = getattr(package, name)
  # Autodoc's output is reStructuredText (the docstrings are), so the directives go in an
  # eval-rst block: inside MyST they would be parsed as Markdown.
  if isinstance(obj, types.ModuleType):
    functions = module_functions(obj)
    lines = [f"# {name}", "", "```{eval-rst}", f".. automodule:: {obj.__name__}", "",
             f".. currentmodule:: {obj.__name__}", "", ".. autosummary::", ""]
    lines += [f"   {function}" for function in functions]
    lines.append("")
    lines += [f".. autofunction:: {function}" for function in functions]
    return "\n".join([*lines, "```", ""])
  # A NamedTuple's fields are described by its docstring's Attributes section; listing
  # them as members too would document each twice ("Alias for field number 0").
  lines = [f"# {name}", "", "```{eval-rst}", f".. currentmodule:: {package.__name__}", "",
           f".. {_directive(obj)}:: {name}"]
  if _directive(obj) == "autodata":
    # A constant's documentation is the "#:" comment where it is defined, which autodoc
    # reads only from that module, not from the package that re-exports it.
    lines += ["", *(f"   {line}" for line in doc_comment(package, name))]
  return "\n".join([*lines, "```", ""])


def doc_comment(package: types.ModuleType, name: str) -> list[str]:
  """The ``#:`` comment lines above the assignment of ``package.name`` in its own module."""
  obj = getattr(package, name)
  for module_name, module in sorted(sys.modules.items()):
    if not module_name.startswith(f"{package.__name__}.") or getattr(module, name, None) is not obj:
      continue
    try:
      source = inspect.getsource(module)
    except (OSError, TypeError):
      continue
    found = re.search(rf"((?:^#:.*\n)+)^{re.escape(name)}\b", source, re.MULTILINE)
    if found:
      return [line[2:].strip() for line in found[1].splitlines()]
  return []


def write_pages(folder: pathlib.Path, package: types.ModuleType) -> None:
  """Writes one page per public name into ``folder`` and removes the pages of no name.

  A page whose text is unchanged is not rewritten, so an incremental build rereads only
  what changed.
  """
  folder.mkdir(exist_ok=True)
  wanted = {f"{name}.md": page(package, name) for name in public_names(package)}
  for stale in folder.glob("*.md"):
    if stale.name not in wanted:
      stale.unlink()
  for filename, text in wanted.items():
    path = folder / filename
    if not path.exists() or path.read_text() != text:
      path.write_text(text)


def _public_names_directive():
  """``{public-names}``: an autosummary table of every name in the package's ``__all__``.

  Made when Sphinx loads the extension, so that the functions above import without Sphinx
  (tests/test_docs.py runs them in the test environment).
  """
  from docutils.statemachine import StringList
  from sphinx.ext.autosummary import Autosummary

  class PublicNames(Autosummary):
    required_arguments = 0
    has_content = False

    def run(self):
      package = importlib.import_module(PACKAGE)
      self.content = StringList(public_names(package))
      return super().run()

  return PublicNames


def _on_builder_inited(app) -> None:
  write_pages(pathlib.Path(app.srcdir) / "api", importlib.import_module(PACKAGE))


def setup(app):
  app.connect("builder-inited", _on_builder_inited)
  app.add_directive("public-names", _public_names_directive())
  return {"parallel_read_safe": True, "parallel_write_safe": True}
