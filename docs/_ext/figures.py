"""Figures wider than the content column fill it and link to their full-size file.

The theme (furo) shrinks a wide image to its 46em content column, 736 px at its 16 px font,
where a four-panel figure is hard to read. Such an image is given ``width: 100%``: the page
shows it at the column's full width whatever its file's size, and Sphinx wraps every resized
image in a link to the file itself (``html_scaled_image_link``), so a reader can open the
figure at full size. Narrower images keep their own size rather than being blown up.
"""

from __future__ import annotations

import pathlib

from docutils import nodes
from sphinx.util.images import get_image_size

#: furo's content column, in CSS pixels: 46em at its 16 px body font.
CONTENT_WIDTH_PX = 736


def image_width_px(path: pathlib.Path) -> int | None:
  """The width of the image file at ``path`` in pixels, or None where it cannot be read."""
  size = get_image_size(path) if path.is_file() else None
  return size[0] if size else None


def fill_content_width(doctree: nodes.document, srcdir: pathlib.Path) -> list[str]:
  """Sets ``width: 100%`` on each image wider than the content column; returns their URIs.

  An image whose size the page already sets (``width``, ``height`` or ``scale``) is left as
  it is.
  """
  widened = []
  for image in doctree.findall(nodes.image):
    if any(key in image for key in ("width", "height", "scale")):
      continue
    # The file the environment's image collector found for this node (relative to srcdir).
    found = image.get("candidates", {}).get("*")
    width = image_width_px(srcdir / found) if found else None
    if width is not None and width > CONTENT_WIDTH_PX:
      image["width"] = "100%"
      widened.append(image["uri"])
  return widened


def _on_doctree_read(app, doctree) -> None:
  fill_content_width(doctree, pathlib.Path(app.srcdir))


def setup(app):
  # After Sphinx's own image collector (priority 500), which fills in node["candidates"].
  app.connect("doctree-read", _on_doctree_read, priority=600)
  return {"parallel_read_safe": True, "parallel_write_safe": True}
