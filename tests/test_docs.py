"""The manual builds: `mkdocs build --strict` passes, and the API pages show the docstrings of what they name."""

import ast
import html
import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SRC = os.path.join(ROOT, "src")
sys.path.insert(0, os.path.join(ROOT, "tools"))
import output_blocks
import site_header
import sphinx_roles

from ddplab.runtime.timescale import scaled


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    site_dir = tmp_path_factory.mktemp("site")
    # The theme's notice about its own future is no warning about this site.
    env = dict(os.environ, NO_MKDOCS_2_WARNING="1")
    done = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(site_dir)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=scaled(110), check=False)
    log = done.stdout + done.stderr
    assert done.returncode == 0, log
    assert "WARNING" not in log, log
    return site_dir


def built(site_dir, page: str) -> str:
    """Where mkdocs writes ``page``: foo.md at foo/index.html, an index.md at its folder's index.html."""
    folder, name = os.path.split(page.removesuffix(".md"))
    return os.path.join(site_dir, folder, "index.html") if name == "index" else \
        os.path.join(site_dir, folder, name, "index.html")


def page_text(site_dir, page: str) -> str:
    """The built page's visible text, without whitespace (tags split words where the source had none)."""
    with open(built(site_dir, page)) as fh:
        text = re.sub(r"<[^>]+>", " ", fh.read())
    return "".join(html.unescape(text).split())


def plain(docstring: str) -> str:
    """A docstring's first paragraph as the page shows it, without code marks or whitespace."""
    summary = sphinx_roles.plain(docstring.strip().split("\n\n")[0])
    return "".join(summary.replace("``", "").replace("`", "").split())


def directives(page: str) -> list[str]:
    with open(os.path.join(ROOT, "docs", page)) as fh:
        return re.findall(r"^::: ([\w.]+)$", fh.read(), re.M)


def locate(path: str):
    """The module's syntax tree and the class or function ``path`` names in it (the module itself for a module)."""
    parts = path.split(".")
    for split in range(len(parts), 0, -1):
        module = os.path.join(SRC, *parts[:split]) + ".py"
        if os.path.exists(module):
            with open(module) as fh:
                tree = ast.parse(fh.read())
            node = tree
            for name in parts[split:]:
                node = next(n for n in node.body if getattr(n, "name", None) == name)
            return node
    raise AssertionError(f"{path} names no module under src/")


API_PAGES = sorted(f"api/{name}" for name in os.listdir(os.path.join(ROOT, "docs", "api"))
                   if name.endswith(".md") and name != "index.md")


def test_the_site_builds_strictly_with_every_page_in_its_navigation(site):
    pages = [os.path.relpath(os.path.join(folder, name), os.path.join(ROOT, "docs"))
             for folder, _, names in os.walk(os.path.join(ROOT, "docs")) for name in names if name.endswith(".md")]
    assert len(pages) > 15
    for page in pages:
        assert os.path.exists(built(site, page)), page
    with open(os.path.join(ROOT, "mkdocs.yml")) as fh:
        nav = fh.read()
    assert all(f": {page}\n" in nav for page in pages)


def test_the_api_pages_show_the_docstring_of_every_object_they_name_and_of_its_public_members(site):
    checked = []
    for page in API_PAGES:
        text = page_text(site, page)
        for path in directives(page):
            node = locate(path)
            documented = [node] + [member for member in getattr(node, "body", []) if isinstance(node, ast.ClassDef)
                                   and isinstance(member, ast.FunctionDef | ast.AsyncFunctionDef)
                                   and not member.name.startswith("_") and ast.get_docstring(member)]
            for item in documented:
                docstring = ast.get_docstring(item)
                assert docstring, f"{path} has no docstring to show"
                assert plain(docstring) in text, f"{page}: {getattr(item, 'name', path)}"
                checked.append(getattr(item, "name", path))
    assert {"AdaScale", "BatchRamp", "GradientNoiseScale", "ScaleLearningRate", "Audit", "state_dict"} <= set(checked)


def test_the_architecture_page_names_every_package_and_module_of_the_tree():
    with open(os.path.join(ROOT, "docs", "architecture.md")) as fh:
        architecture = fh.read()
    entries = [name for name in os.listdir(os.path.join(SRC, "ddplab"))
               if not name.startswith("_") and (name.endswith(".py") or
                                                 os.path.exists(os.path.join(SRC, "ddplab", name, "__init__.py")))]
    assert len(entries) > 10
    for name in entries:
        shown = name if name.endswith(".py") else f"{name}/"
        assert f"`{shown}`" in architecture, name


def read_built(site_dir, page: str) -> str:
    with open(built(site_dir, page)) as fh:
        return fh.read()


def test_no_sphinx_role_shows_raw_and_a_role_links_to_what_it_names(site):
    for page in API_PAGES:
        assert not sphinx_roles.ROLE.search(page_text(site, page).replace("`", "")), page
        assert not re.search(r":(func|meth|class|mod|data|attr):<code>", read_built(site, page)), page
    # :class:`ddplab.noise.scale.GradientNoiseScale` in the Lightning callback's docstring, linked across pages.
    assert 'href="../noise/#ddplab.noise.scale.GradientNoiseScale"><code>ddplab.noise.scale.GradientNoiseScale' \
        in read_built(site, "api/integrations.md")


def test_signatures_are_formatted_on_lines_of_their_own_by_a_pinned_formatter(site):
    with open(os.path.join(ROOT, "pyproject.toml")) as fh:
        docs_extra = re.search(r"^docs = \[(.*?)\]", fh.read(), re.M | re.S)[1]
    assert re.search(r'"ruff==[\d.]+"', docs_extra)
    signature = re.search(r'<div class="doc-signature highlight"><pre>(.*?)</pre>', read_built(site, "api/noise.md"),
                          re.S)[1]
    lines = html.unescape(re.sub(r"<[^>]+>", "", signature)).strip().splitlines()
    assert lines[0] == "GradientNoiseScale(" and "    per_device_batch_size: int," in lines and lines[-1] == ")"


def test_formulas_are_mathml_drawn_by_the_browser_with_no_script(site):
    page = read_built(site, "concepts/noise-scale.md")
    assert page.count("<math ") >= 5 and 'class="arithmatex"' not in page, "pip install -e '.[docs]' (latex2mathml)"
    assert '<math alttext="B_\\text{simple} = \\frac' in page and "<mfrac>" in page
    assert "mathjax" not in page.lower() and "katex" not in page.lower()


def test_long_output_lines_wrap_and_output_tables_keep_their_shape(site):
    with open(os.path.join(ROOT, "docs", "stylesheets", "extra.css")) as fh:
        css = " ".join(fh.read().split())
    assert ".md-typeset .output pre > code .wrap { white-space: pre-wrap;" in css
    page = read_built(site, "commands/study.md")
    wrapped = re.findall(r'<span class="wrap">(.*?)</span>', page)
    assert max(map(len, wrapped)) > 170 and not any(output_blocks.BOX.search(line) for line in wrapped)
    assert "┃ rule     ┃ S_min" in page
    assert output_blocks.line("│ a │") == "│ a │" and output_blocks.line("") == ""


def test_names_in_table_cells_never_break_mid_word():
    with open(os.path.join(ROOT, "docs", "stylesheets", "extra.css")) as fh:
        css = " ".join(fh.read().split())
    # Material breaks inline code anywhere (word-break: break-word): ddplab.integrations.tr|ansformers.
    assert ".md-typeset td code { word-break: normal; overflow-wrap: normal; }" in css


def test_the_header_names_the_version_and_the_repository_pyproject_names():
    from ddplab import __version__

    assert site_header.version() == __version__
    assert site_header.repository("[project]\nname = 'x'\n") is None
    text = '[project.urls]\nRepository = "https://example.org/team/ddplab"\n\n[tool.x]\n'
    assert site_header.repository(text) == "https://example.org/team/ddplab"


def test_the_built_header_shows_the_version(site):
    from ddplab import __version__

    assert f"<title>ddplab {__version__}</title>" in read_built(site, "index.md")
    header = read_built(site, "index.md").split('<div class="md-header__topic">')[1]
    assert header.split("</span>")[0].split() == ['<span', 'class="md-ellipsis">', "ddplab", __version__]
