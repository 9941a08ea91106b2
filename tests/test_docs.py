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


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    site_dir = tmp_path_factory.mktemp("site")
    # The theme's notice about its own future is no warning about this site.
    env = dict(os.environ, NO_MKDOCS_2_WARNING="1")
    done = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(site_dir)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=110, check=False)
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
    summary = docstring.strip().split("\n\n")[0]
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
