"""The documentation: it builds with warnings as errors and every reference
resolved, its pages open offline, its reference has every public name, and
what it takes from the code (the CLI's help pages, the statistics' keys)
follows the code.

The build is the one command the README and CONTRIBUTING.md give
(``python -m sphinx -W -n -b html docs OUT``), run once for the module in a
fresh output folder. The code examples of the guide's pages run in
tests/integrations/test_readme.py.
"""
import glob
import html.parser
import importlib
import inspect
import os
import posixpath
import re
import subprocess
import sys
import textwrap
import urllib.parse

import pytest
from tests.helpers import REPO_ROOT


ROOT = str(REPO_ROOT)
DOCS = os.path.join(ROOT, "docs")
BUILD_TIMEOUT = 240

#: The modules whose every public name the reference documents.
MODULES = ("unimem", "unimem.accelerator", "unimem.cpu", "unimem.cuda", "unimem.xpu", "unimem.host",
           "unimem.capi", "unimem.dask", "unimem.prometheus")


def sphinx_build(source, out, *extra):
    return subprocess.run([sys.executable, "-m", "sphinx", "-W", "-n", "-b", "html", *extra, str(source), str(out)],
                          cwd=ROOT, capture_output=True, text=True, timeout=BUILD_TIMEOUT)


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    out = tmp_path_factory.mktemp("docs") / "html"
    done = sphinx_build(DOCS, out)
    assert done.returncode == 0, f"the docs do not build:\n{done.stdout[-3000:]}\n{done.stderr[-5000:]}"
    return out, done


def test_the_docs_build_without_a_warning(built):
    out, done = built
    assert "WARNING" not in done.stderr + done.stdout, done.stderr
    assert "build succeeded" in done.stdout
    assert (out / "index.html").is_file()
    for page in ("guide/getting-started", "guide/dpnp", "reference/cpu", "reference/statistics", "reference/cli",
                 "development"):
        assert (out / f"{page}.html").is_file(), page


# ---------------------------------------------------------------------------
# offline
# ---------------------------------------------------------------------------
class _Assets(html.parser.HTMLParser):
    """What a page loads: scripts, style sheets, icons, images, frames."""

    def __init__(self):
        super().__init__()
        self.loaded = []

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        if tag in ("script", "img", "iframe", "source", "video", "audio", "embed") and attrs.get("src"):
            self.loaded.append(attrs["src"])
        if tag == "link" and attrs.get("href") and (set((attrs.get("rel") or "").split())
                                                    & {"stylesheet", "icon", "preload", "modulepreload", "manifest"}):
            self.loaded.append(attrs["href"])
        if tag == "object" and attrs.get("data"):
            self.loaded.append(attrs["data"])


def test_every_page_loads_only_files_of_the_build(built):
    """Opened from the disk with no network, every page has all it loads:
    nothing from a CDN, and every file it names is there."""
    out, _ = built
    pages = glob.glob(str(out / "**" / "*.html"), recursive=True)
    assert len(pages) > 20
    checked = 0
    for page in pages:
        parser = _Assets()
        with open(page, encoding="utf-8") as f:
            parser.feed(f.read())
        for url in parser.loaded:
            parts = urllib.parse.urlsplit(url)
            assert not parts.scheme and not parts.netloc, f"{page} loads {url} from the network"
            path = os.path.normpath(os.path.join(os.path.dirname(page), urllib.parse.unquote(parts.path)))
            assert os.path.isfile(path), f"{page} loads {url}, which the build does not have"
            checked += 1
    assert checked > 100
    for sheet in glob.glob(str(out / "_static" / "**" / "*.css"), recursive=True):
        with open(sheet, encoding="utf-8") as f:
            urls = re.findall(r"url\(\s*['\"]?([^'\")]+)", f.read())
        assert not [u for u in urls if urllib.parse.urlsplit(u).scheme in ("http", "https") or u.startswith("//")], sheet


def test_the_report_screenshot_is_on_its_page(built):
    out, _ = built
    with open(out / "guide" / "seeing-memory.html", encoding="utf-8") as f:
        page = f.read()
    image = re.search(r'<img[^>]+src="([^"]*memory-report\.png)"', page)
    assert image, "the offline report's screenshot is not on the page"
    assert os.path.isfile(os.path.normpath(os.path.join(out / "guide", image.group(1))))


# ---------------------------------------------------------------------------
# the reference
# ---------------------------------------------------------------------------
def public_names(module_name):
    """A module's public names: its ``__all__``, else the functions and
    classes it defines whose names do not start with an underscore."""
    module = importlib.import_module(module_name)
    names = getattr(module, "__all__", None)
    if names is not None:
        return list(names)
    return [name for name, value in vars(module).items()
            if not name.startswith("_") and (inspect.isfunction(value) or inspect.isclass(value))
            and getattr(value, "__module__", None) == module_name]


def documented(out):
    from sphinx.util.inventory import InventoryFile
    with open(out / "objects.inv", "rb") as f:
        inventory = InventoryFile.load(f, "", posixpath.join)
    data = getattr(inventory, "data", inventory)
    return {name for entries in data.values() for name in entries}


@pytest.mark.parametrize("module_name", MODULES)
def test_the_reference_documents_every_public_name(built, module_name):
    out, _ = built
    names = documented(out)
    public = public_names(module_name)
    assert public
    missing = [name for name in public if f"{module_name}.{name}" not in names]
    assert not missing, f"{module_name}: not in the reference: {missing}"


def test_the_reference_shows_the_docstrings(built):
    out, _ = built
    with open(out / "reference" / "cpu.html", encoding="utf-8") as f:
        page = f.read()
    import unimem.cpu
    first_line = inspect.getdoc(unimem.cpu.memory_stats).splitlines()[0]
    assert first_line.split(".")[0] in html_text(page)
    assert 'id="unimem.cpu.memory_stats"' in page


def html_text(page):
    import html as html_module
    return html_module.unescape(re.sub(r"<[^>]+>", "", page))


def test_the_cli_pages_are_what_the_parser_prints(built):
    """reference/cli.html holds, for ``unimem`` and each of its commands, the
    help that the parser prints now (so a changed option shows at the next
    build), one section per command."""
    sys.path.insert(0, os.path.join(DOCS, "_ext"))
    try:
        import unimem_docs
    finally:
        sys.path.remove(os.path.join(DOCS, "_ext"))
    out, _ = built
    with open(out / "reference" / "cli.html", encoding="utf-8") as f:
        text = html_text(f.read())
    commands = unimem_docs.cli_commands()
    assert {"demo", "run", "view", "stats"} <= set(commands)
    for command in [None] + commands:
        help_text = unimem_docs.cli_help(command)
        assert help_text.strip() in text, f"`{command} --help` is not on the page as the parser prints it"
    assert text.count("show this help message and exit") >= len(commands) + 1


def test_the_readme_lists_every_command():
    sys.path.insert(0, os.path.join(DOCS, "_ext"))
    try:
        import unimem_docs
    finally:
        sys.path.remove(os.path.join(DOCS, "_ext"))
    with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as f:
        readme = f.read()
    table = readme[readme.index("| command | what it does |"):]
    listed = re.findall(r"^\| `(\w+)", table.split("\n\n")[0], flags=re.M)
    assert listed and sorted(listed) == sorted(unimem_docs.cli_commands())


def test_the_readme_is_a_front_page():
    """At most ~200 lines, the two commands first, and every file it links to exists."""
    with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as f:
        readme = f.read()
    assert len(readme.splitlines()) <= 200
    links = re.findall(r"\]\(([^)#\s]+)", readme)
    local = [link for link in links if not urllib.parse.urlsplit(link).scheme]
    assert len(local) >= 10
    for link in local:
        assert os.path.exists(os.path.join(ROOT, link)), f"README.md links to {link}, which does not exist"


# ---------------------------------------------------------------------------
# what the build refuses
# ---------------------------------------------------------------------------
def small_project(tmp_path, page):
    """A documentation project with the real configuration and one page."""
    source = tmp_path / "src"
    source.mkdir()
    conf = os.path.join(DOCS, "conf.py")
    (source / "conf.py").write_text(f"__file__ = {conf!r}\nexec(open(__file__).read())\n")
    (source / "index.md").write_text(textwrap.dedent(page))
    return source


def test_a_reference_to_no_such_name_fails_the_build(tmp_path):
    source = small_project(tmp_path, """
        # Page

        {func}`unimem.cpu.memory_stat` is misspelled; {func}`unimem.backends.cuda.stream_key`
        exists (shown unlinked), and so does {class}`numpy.ndarray`.
    """)
    done = sphinx_build(source, tmp_path / "out")
    assert done.returncode != 0
    assert "unimem.cpu.memory_stat" in done.stderr and "reference target not found" in done.stderr, done.stderr
    assert "stream_key" not in done.stderr and "ndarray" not in done.stderr, done.stderr


def test_a_statistics_table_out_of_step_with_the_code_fails_the_build(tmp_path):
    source = small_project(tmp_path, """
        # Page

        ```{unimem-statistics} host
        allocated.{current,peak,allocated,freed}: blocks handed out.
        no_such_key: a key the pool does not return.
        ```
    """)
    done = sphinx_build(source, tmp_path / "out")
    assert done.returncode != 0
    assert "out of step with the code" in done.stderr and "no_such_key" in done.stderr, done.stderr
    assert "num_host_alloc" in done.stderr, "the keys the table lacks are named"
