"""Where a page names a file of the repository that the site shows as a page, it links there.

The README, the guides and the docstrings name files by their path in the repository
(``docs/benchmarks.md``, ``quickstart.ipynb``, ``CHANGELOG.md``), which is what a reader of
the source or of GitHub needs. On the site each of those files is a page: every mention of
such a path, as a whole inline code span or as a word of prose, becomes a link to its page.
Mentions inside a longer code span (a command line) and in code blocks stay code, and a page
does not link to itself.
"""

from __future__ import annotations

import functools
import pathlib
import re
from collections.abc import Iterable

from docutils import nodes
from sphinx import addnodes

# A MyST page that shows a file from the top of the repository: ```{include} ../CHANGELOG.md
_INCLUDE = re.compile(r"^```\{include\}\s+\.\./(\S+)", re.MULTILINE)
# Text that is code, a link already, or not shown as prose.
_NOT_PROSE = (nodes.FixedTextElement, nodes.literal, nodes.reference, nodes.raw, nodes.comment,
              nodes.math, nodes.target, addnodes.desc_signature, addnodes.pending_xref)


def page_paths(docs: pathlib.Path, docnames: Iterable[str]) -> dict[str, str]:
  """The paths in the repository that name a page of the site, each with the page's name.

  ``docs`` is the site's source folder (``docs/`` at the top of the repository); a notebook's
  page is named by the notebook (``notebooks/N.ipynb``, or ``N.ipynb`` alone) and by its
  jupytext text form (``notebooks/N.py``); a page that includes a file from the top of the
  repository, by that file too.
  """
  paths = {}
  for docname in sorted(docnames):
    markdown, notebook = docs / f"{docname}.md", docs / f"{docname}.ipynb"
    if markdown.is_file():
      paths[f"{docs.name}/{docname}.md"] = docname
      for included in _INCLUDE.findall(markdown.read_text(encoding="utf-8")):
        paths[included] = docname
    elif notebook.is_file():
      stem = pathlib.PurePosixPath(docname).name
      for path in (f"notebooks/{stem}.ipynb", f"{stem}.ipynb", f"notebooks/{stem}.py"):
        paths[path] = docname
  return paths


def mention_pattern(paths: Iterable[str]) -> re.Pattern[str]:
  """Finds the paths as words of prose: not part of a longer path or name."""
  alternatives = "|".join(re.escape(path) for path in sorted(paths, key=len, reverse=True))
  return re.compile(rf"(?<![\w/.-])(?:{alternatives})(?![\w/-])")


def _is_prose(text: nodes.Text) -> bool:
  parent = text.parent
  while parent is not None:
    if isinstance(parent, _NOT_PROSE):
      return False
    parent = parent.parent
  return True


def _inside_link(node: nodes.Node) -> bool:
  parent = node.parent
  while parent is not None:
    if isinstance(parent, nodes.reference):
      return True
    parent = parent.parent
  return False


def link_mentions(doctree: nodes.Node, paths: dict[str, str], docname: str, uri_of) -> int:
  """Wraps each mention of a path of ``paths`` in a link to its page; returns how many.

  ``uri_of(target_docname)`` is the URI of a page from ``docname``'s page.
  """
  others = {path: target for path, target in paths.items() if target != docname}
  if not others:
    return 0
  linked = 0

  def link(child: nodes.Node, target: str) -> nodes.reference:
    nonlocal linked
    linked += 1
    reference = nodes.reference("", "", internal=True, refuri=uri_of(target))
    reference += child
    return reference

  for literal in list(doctree.findall(nodes.literal)):
    target = others.get(literal.astext().strip())
    if target is not None and not _inside_link(literal):
      parent = literal.parent
      parent.replace(literal, link(literal.deepcopy(), target))

  pattern = mention_pattern(others)
  for text in list(doctree.findall(nodes.Text)):
    if not _is_prose(text) or not pattern.search(text):
      continue
    pieces, start = [], 0
    for found in pattern.finditer(text):
      pieces.append(nodes.Text(text[start:found.start()]))
      pieces.append(link(nodes.Text(found[0]), others[found[0]]))
      start = found.end()
    pieces.append(nodes.Text(text[start:]))
    text.parent.replace(text, [piece for piece in pieces if piece.astext()])
  return linked


@functools.cache
def _site_paths(docs: pathlib.Path, docnames: frozenset[str]) -> dict[str, str]:
  # Once per build, not once per page.
  return page_paths(docs, docnames)


def _on_doctree_resolved(app, doctree, docname) -> None:
  paths = _site_paths(pathlib.Path(app.srcdir), frozenset(app.env.found_docs))
  link_mentions(doctree, paths, docname,
                lambda target: app.builder.get_relative_uri(docname, target))


def setup(app):
  app.connect("doctree-resolved", _on_doctree_resolved)
  return {"parallel_read_safe": True, "parallel_write_safe": True}
