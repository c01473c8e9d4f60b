"""The built documentation site: a page per public name, no broken internal link, and pages
that render in headless Chromium without a console error and without any request off the
site, their maths typeset.

Build the site first (`sphinx-build -W --keep-going -b html docs docs/_build/html`, with the
`docs` extra); without it, or without Chromium (Debian's `chromium`) and playwright, these
tests skip. .ci/run's docs stage builds the site and sets OPTAX_SAFEFACTOR_SITE_REQUIRED=1,
which turns those skips into failures. The screenshots go to docs/_build/screenshots/.
"""

import functools
import html.parser
import http.server
import os
import pathlib
import re
import threading
import urllib.parse

import pytest

import optax_safefactor
from tests.helpers import load_module

ROOT = pathlib.Path(__file__).resolve().parents[1]
SITE = ROOT / "docs" / "_build" / "html"
SCREENSHOTS = ROOT / "docs" / "_build" / "screenshots"
CHROMIUM = pathlib.Path("/usr/bin/chromium")
REQUIRED = os.environ.get("OPTAX_SAFEFACTOR_SITE_REQUIRED") == "1"
# What MathJax leaves in a page where it did not typeset: Sphinx writes inline maths between
# these delimiters, display maths between the second pair.
RAW_MATHS = ("\\(", "\\[")


def _skip_or_fail(reason: str):
  if REQUIRED:
    pytest.fail(f"{reason}, and OPTAX_SAFEFACTOR_SITE_REQUIRED=1")
  pytest.skip(reason)


@pytest.fixture(scope="module")
def site() -> pathlib.Path:
  if not (SITE / "index.html").is_file():
    _skip_or_fail(f"the site is not built ({SITE})")
  return SITE


class _Page(html.parser.HTMLParser):
  """The ids and the links of one HTML page."""

  def __init__(self):
    super().__init__()
    self.ids, self.links = set(), []

  def handle_starttag(self, tag, attrs):
    attrs = dict(attrs)
    if attrs.get("id"):
      self.ids.add(attrs["id"])
    if tag == "a" and attrs.get("href") is not None:
      self.links.append(attrs["href"])
    if tag in ("img", "script") and attrs.get("src"):
      self.links.append(attrs["src"])
    if tag == "link" and attrs.get("href") and attrs.get("rel") != ["canonical"]:
      self.links.append(attrs["href"])


@functools.cache
def _parse(path: pathlib.Path) -> _Page:
  page = _Page()
  page.feed(path.read_text(encoding="utf-8"))
  return page


def broken_links(site: pathlib.Path) -> list[str]:
  """Every internal link or anchor of the built site that leads nowhere, as ``page: href``."""
  broken = []
  for page_path in sorted(site.rglob("*.html")):
    for href in _parse(page_path).links:
      parts = urllib.parse.urlsplit(href)
      if parts.scheme or parts.netloc or href.startswith(("mailto:", "javascript:")):
        continue
      target = page_path
      if parts.path:
        target = (page_path.parent / urllib.parse.unquote(parts.path)).resolve()
        if target.is_dir():
          target = target / "index.html"
      if not target.is_file():
        broken.append(f"{page_path.relative_to(site)}: {href}")
      elif parts.fragment and target.suffix == ".html" and (
          urllib.parse.unquote(parts.fragment) not in _parse(target).ids):
        broken.append(f"{page_path.relative_to(site)}: {href} (no such anchor)")
  return broken


def test_every_public_name_has_a_page(site):
  for name in optax_safefactor.__all__:
    page = site / "api" / f"{name}.html"
    assert page.is_file(), f"no page for osf.{name}"
    anchor = f"optax_safefactor.{name}"
    ids = _parse(page).ids
    assert anchor in ids or f"module-{anchor}" in ids, f"{page.name} does not document {name}"
  index_links = _parse(site / "api.html").links
  for name in optax_safefactor.__all__:
    assert any(link.split("#")[0] == f"api/{name}.html" for link in index_links), name


def test_the_guides_and_notebooks_are_in_the_site(site):
  for guide in (ROOT / "docs" / "guides").glob("*.md"):
    assert (site / "guides" / f"{guide.stem}.html").is_file(), guide.name
  for notebook in (ROOT / "notebooks").glob("*.ipynb"):
    page = (site / "notebooks" / f"{notebook.stem}.html").read_text()
    # Executed at build time: the outputs are in the page (a stream or a figure).
    assert 'class="output' in page, f"{notebook.name} is shown without its outputs"


def test_no_internal_link_is_broken(site):
  assert not broken_links(site)


def test_broken_links_finds_a_missing_page_and_a_missing_anchor(tmp_path):
  (tmp_path / "a.html").write_text('<p id="here"></p><a href="b.html#nowhere">b</a>'
                                   '<a href="#here">self</a><a href="c.html">c</a>'
                                   '<a href="https://example.org/x.html">out</a>')
  (tmp_path / "b.html").write_text('<p id="there"></p>')
  assert broken_links(tmp_path) == ["a.html: b.html#nowhere (no such anchor)",
                                    "a.html: c.html"]


@pytest.fixture(scope="module")
def page_links():
  """docs/_ext/page_links.py, which needs Sphinx (the docs extra)."""
  try:
    import sphinx  # noqa: F401
  except ImportError:
    _skip_or_fail("Sphinx is not installed (the docs extra)")
  return load_module(ROOT / "docs" / "_ext" / "page_links.py")


class _Mentions(html.parser.HTMLParser):
  """The mentions of repository paths in a page's article, each with the link it is in.

  A mention is a path as a word of prose, or as the whole of an inline code span; paths in
  code blocks, and in longer code spans (command lines), are code, not mentions.
  """

  def __init__(self, pattern, paths):
    super().__init__()
    self.pattern, self.paths = pattern, paths
    self.found = []  # (path, href of the innermost link around it, or None)
    self._depth = {"article": 0, "pre": 0}
    self._links, self._code = [], None

  def handle_starttag(self, tag, attrs):
    if tag in self._depth:
      self._depth[tag] += 1
    elif tag == "a":
      self._links.append(dict(attrs).get("href"))
    elif tag == "code" and self._code is None:
      self._code = []

  def handle_endtag(self, tag):
    if tag in self._depth:
      self._depth[tag] -= 1
    elif tag == "a" and self._links:
      self._links.pop()
    elif tag == "code" and self._code is not None:
      text, self._code = "".join(self._code).strip(), None
      if text in self.paths and self._depth["article"]:
        self.found.append((text, self._links[-1] if self._links else None))

  def handle_data(self, data):
    if self._code is not None:
      self._code.append(data)
    elif self._depth["article"] and not self._depth["pre"]:
      link = self._links[-1] if self._links else None
      self.found += [(found[0], link) for found in self.pattern.finditer(data)]


def unlinked_mentions(site: pathlib.Path, paths: dict[str, str], pattern) -> list[str]:
  """Each mention, on a page of the site, of a path of a page without a link to that page.

  ``paths`` maps a path to its page's name (``docs/benchmarks.md`` to ``benchmarks``); a
  page's mention of its own path is not counted. Returned as ``page: path``.
  """
  unlinked = []
  for page_path in sorted(site.rglob("*.html")):
    mentions = _Mentions(pattern, paths)
    mentions.feed(page_path.read_text(encoding="utf-8"))
    for path, href in mentions.found:
      target = (site / f"{paths[path]}.html").resolve()
      if target == page_path.resolve():
        continue
      linked = href is not None and not urllib.parse.urlsplit(href).scheme and (
          page_path.parent / urllib.parse.urlsplit(href).path).resolve() == target
      if not linked:
        unlinked.append(f"{page_path.relative_to(site)}: {path}")
  return unlinked


def _site_page_paths(site, page_links) -> dict[str, str]:
  docnames = [str(page.relative_to(site).with_suffix("")) for page in site.rglob("*.html")]
  return page_links.page_paths(ROOT / "docs", docnames)


def test_every_mention_of_a_page_s_file_links_to_the_page(site, page_links):
  paths = _site_page_paths(site, page_links)
  # Among them, the ones the README, the guides and the docstrings name.
  for path, page in [("docs/benchmarks.md", "benchmarks"),
                     ("quickstart.ipynb", "notebooks/quickstart"),
                     ("notebooks/quickstart.ipynb", "notebooks/quickstart"),
                     ("docs/guides/from_optax.md", "guides/from_optax"),
                     ("CHANGELOG.md", "changelog"), ("README.md", "index")]:
    assert paths.get(path) == page, (path, paths.get(path))
  unlinked = unlinked_mentions(site, paths, page_links.mention_pattern(paths))
  assert not unlinked, "mentions without a link to their page:\n" + "\n".join(unlinked)


def test_unlinked_mentions_finds_a_path_in_prose_and_in_code(tmp_path, page_links):
  paths = {"docs/benchmarks.md": "benchmarks", "quickstart.ipynb": "notebooks/quickstart"}
  (tmp_path / "notebooks").mkdir()
  for name in ("benchmarks.html", "notebooks/quickstart.html"):
    (tmp_path / name).write_text("<article><h1>x</h1></article>")
  (tmp_path / "index.html").write_text(
      '<nav>docs/benchmarks.md</nav><article>'
      '<p>see docs/benchmarks.md, and <code><span>quickstart.ipynb</span></code></p>'
      '<p><a href="benchmarks.html"><code>docs/benchmarks.md</code></a>, '
      '<a href="notebooks/quickstart.html">quickstart.ipynb</a></p>'
      '<p><a href="other.html">quickstart.ipynb</a>, <code>jupytext quickstart.ipynb</code>, '
      'olddocs/benchmarks.md</p><pre>docs/benchmarks.md</pre></article>')
  pattern = page_links.mention_pattern(paths)
  assert unlinked_mentions(tmp_path, paths, pattern) == [
      "index.html: docs/benchmarks.md", "index.html: quickstart.ipynb",
      "index.html: quickstart.ipynb"]


class _SidebarLinks(html.parser.HTMLParser):
  """The links of a page's navigation sidebar (furo's ``sidebar-tree``), in order."""

  def __init__(self):
    super().__init__()
    self.links, self._depth = [], 0

  def handle_starttag(self, tag, attrs):
    attrs = dict(attrs)
    if self._depth or (tag == "div" and "sidebar-tree" in (attrs.get("class") or "").split()):
      self._depth += tag == "div"
      if tag == "a" and attrs.get("href"):
        self.links.append(attrs["href"])

  def handle_endtag(self, tag):
    if self._depth and tag == "div":
      self._depth -= 1


def sidebar_links(page: pathlib.Path) -> list[str]:
  parser = _SidebarLinks()
  parser.feed(page.read_text(encoding="utf-8"))
  return parser.links


def test_sidebar_lists_the_guides_in_the_readme_s_order(site):
  readme = (ROOT / "README.md").read_text(encoding="utf-8")
  in_readme = list(dict.fromkeys(re.findall(r"\]\(docs/(guides/[\w-]+)\.md[)#]", readme)))
  in_sidebar = [link.removesuffix(".html") for link in sidebar_links(site / "index.html")
                if link.startswith("guides/")]
  # The guide most readers come for first: switching from optax.adafactor.
  assert in_sidebar[:1] == ["guides/from_optax"], in_sidebar
  assert in_sidebar == in_readme


class _QuietHandler(http.server.SimpleHTTPRequestHandler):
  def log_message(self, *args):
    pass


@pytest.fixture(scope="module")
def server(site):
  handler = functools.partial(_QuietHandler, directory=str(site))
  httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
  thread = threading.Thread(target=httpd.serve_forever, daemon=True)
  thread.start()
  yield f"http://127.0.0.1:{httpd.server_address[1]}"
  httpd.shutdown()
  httpd.server_close()


@pytest.fixture(scope="module")
def browser(server, tmp_path_factory):
  if not CHROMIUM.is_file():
    _skip_or_fail(f"no Chromium at {CHROMIUM} (apt-get install chromium)")
  try:
    from playwright.sync_api import sync_playwright
  except ImportError:
    _skip_or_fail("playwright is not installed (the docs extra)")
  with sync_playwright() as playwright:
    context = playwright.chromium.launch_persistent_context(
        str(tmp_path_factory.mktemp("chromium-profile")),  # an empty --user-data-dir
        executable_path=str(CHROMIUM), headless=True, viewport={"width": 1280, "height": 900},
        args=["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
              "--disable-background-networking", "--disable-component-update",
              "--disable-sync"])
    yield context
    context.close()


def render(browser, server, path: str, screenshot: pathlib.Path) -> dict:
  """Opens ``path`` of the site, screenshots it, and returns what went wrong on the way.

  Every request outside the site is refused and reported: a reader offline must see the
  same page. ``problems["raw maths"]`` holds each line of the page's rendered text that still
  shows a maths delimiter once MathJax (if the page loads it) has typeset the page, and the
  text of each formula that still holds a backslash: TeX that MathJax did not read.
  """
  problems = {"console": [], "page errors": [], "failed": [], "external": []}
  page = browser.new_page()

  def route(request_route):
    url = request_route.request.url
    if url.startswith(server):
      request_route.continue_()
    else:
      problems["external"].append(url)
      request_route.abort()

  page.route("**/*", route)
  page.on("console", lambda message: message.type == "error" and problems["console"].append(
      f"{message.text} ({message.location.get('url')})"))
  page.on("pageerror", lambda error: problems["page errors"].append(str(error)))
  page.on("requestfailed", lambda request: problems["failed"].append(request.url))
  page.on("response", lambda response: response.status >= 400 and problems["failed"].append(
      f"{response.status} {response.url}"))
  response = page.goto(f"{server}/{path}", wait_until="networkidle")
  # MathJax typesets after the page has loaded; its startup promise settles when it is done.
  page.evaluate("() => window.MathJax?.startup?.promise")
  problems["raw maths"] = raw_maths(page.inner_text("body")) + [
      " ".join(text.split()) for text in page.locator(".math").all_inner_texts() if "\\" in text]
  problems["status"] = response.status
  problems["title"] = page.title()
  problems["headings"] = page.locator("h1").all_inner_texts()
  screenshot.parent.mkdir(parents=True, exist_ok=True)
  page.screenshot(path=str(screenshot), full_page=False)
  page.close()
  return problems


def raw_maths(text: str) -> list[str]:
  """The lines of a page's rendered text that show a maths delimiter, not typeset maths."""
  return [line for line in text.splitlines() if any(mark in line for mark in RAW_MATHS)]


def pages_with_maths(site: pathlib.Path) -> list[str]:
  """The site's pages that hold maths, as paths relative to the site."""
  return sorted(str(page.relative_to(site)) for page in site.rglob("*.html")
                if 'class="math' in page.read_text(encoding="utf-8"))


@pytest.mark.parametrize(("path", "heading"), [
    ("index.html", "optax_safefactor"),
    ("api/safefactor.html", "safefactor"),
    ("guides/sharding.html", "Sharded and multi-host training"),
])
def test_page_renders_without_errors(browser, server, path, heading):
  shot = SCREENSHOTS / f"{path.replace('/', '_').removesuffix('.html')}.png"
  problems = render(browser, server, path, shot)
  assert problems["status"] == 200, problems
  assert [h.rstrip("¶#").strip() for h in problems["headings"]][:1] == [heading], problems
  for kind in ("console", "page errors", "failed", "external", "raw maths"):
    assert not problems[kind], (kind, problems[kind])
  assert shot.stat().st_size > 10_000, "the screenshot is (nearly) blank"


def test_maths_is_typeset_without_any_outside_request(browser, server, site):
  pages = pages_with_maths(site)
  # The docstrings with formulas: skip_spikes' rule, the presets' decay rates.
  assert {"api/safefactor.html", "api/presets.html"} <= set(pages), pages
  for path in pages:
    shot = SCREENSHOTS / f"maths_{path.replace('/', '_').removesuffix('.html')}.png"
    problems = render(browser, server, path, shot)
    for kind in ("raw maths", "external", "failed", "console", "page errors"):
      assert not problems[kind], (path, kind, problems[kind])


def test_raw_maths_finds_untypeset_delimiters():
  assert raw_maths("a\nthe rate \\(\\beta_2\\) decays\n\\[x\\]") == [
      "the rate \\(\\beta_2\\) decays", "\\[x\\]"]
  assert raw_maths("typeset: β₂ = 1 - t^-0.8, and f(x)") == []


def overflowing_tables(page) -> list[str]:
  """Each table of the open page that is wider than its container, as ``width > room``."""
  return page.evaluate("""() => [...document.querySelectorAll('article table')]
      .filter(table => table.scrollWidth > table.parentElement.clientWidth)
      .map(table => `${table.scrollWidth}px > ${table.parentElement.clientWidth}px: ` +
                    table.rows[0].innerText.replace(/\\s+/g, ' ').slice(0, 60))""")


@pytest.fixture
def front_page(browser, server):
  """The front page in a 1280x800 window, as a laptop shows it."""
  page = browser.new_page()
  page.set_viewport_size({"width": 1280, "height": 800})
  page.route("**/*", lambda route: route.continue_() if route.request.url.startswith(server)
             else route.abort())
  page.goto(f"{server}/index.html", wait_until="networkidle")
  yield page
  page.close()


def test_front_page_fits_a_1280_px_window(front_page):
  assert front_page.locator("article table").count() >= 3
  assert not overflowing_tables(front_page)
  width, room = front_page.evaluate(
      "() => [document.documentElement.scrollWidth, document.documentElement.clientWidth]")
  assert width <= room, "the front page scrolls sideways"


def test_overflowing_tables_finds_a_cut_table(front_page):
  front_page.evaluate("""() => document.querySelector('article table').style.minWidth =
                         '2000px'""")
  [cut] = overflowing_tables(front_page)
  assert cut.startswith("2000px > ") and "optimizer" in cut


def test_front_page_figure_fills_the_content_width_and_links_to_its_file(front_page, site):
  figure = front_page.locator("article img[src$='loss_curves.png']")
  shown, room, natural = figure.evaluate("""image => [image.getBoundingClientRect().width,
      image.closest('p, figure, div').clientWidth, image.naturalWidth]""")
  # The paragraph's width less its padding (none in furo): the content column.
  assert abs(shown - room) <= 1, (shown, room)
  assert natural > shown
  link = figure.evaluate("image => image.closest('a')?.getAttribute('href')")
  assert link is not None, "the figure links to nothing"
  assert (site / link).resolve() == (site / "_images" / "loss_curves.png").resolve()


def test_render_reports_a_missing_page_and_a_console_error(browser, server, site, tmp_path):
  broken = site / "_test_broken_page.html"
  broken.write_text("<html><head><title>x</title></head><body><h1>x</h1>"
                    "<script>console.error('boom')</script></body></html>")
  try:
    problems = render(browser, server, broken.name, tmp_path / "broken.png")
    assert any("boom" in message for message in problems["console"])
    missing = render(browser, server, "api/no_such_name.html", tmp_path / "missing.png")
    assert missing["status"] == 404
  finally:
    broken.unlink()

