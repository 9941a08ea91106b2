"""A mkdocs hook: the site's header names the version it documents, and the repository where pyproject.toml names one.

The version is ``ddplab.__version__`` (what ``ddplab --version`` prints), shown after the site's name; the repository
link is ``[project.urls] Repository`` of pyproject.toml, the address PyPI shows too, so neither is written twice.
mkdocs.yml loads it (``hooks:``).
"""

from __future__ import annotations

import os
import re

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def version() -> str:
    with open(os.path.join(ROOT, "src", "ddplab", "__init__.py")) as fh:
        return re.search(r'^__version__ = "([^"]+)"', fh.read(), re.M)[1]


def repository(text: str | None = None) -> str | None:
    """``[project.urls] Repository`` of pyproject.toml (or of ``text``), if it names one."""
    if text is None:
        with open(os.path.join(ROOT, "pyproject.toml")) as fh:
            text = fh.read()
    urls = re.search(r"^\[project\.urls\]\n(.*?)(?:^\[|\Z)", text, re.M | re.S)
    found = urls and re.search(r'^Repository\s*=\s*"([^"]+)"', urls[1], re.M)
    return found[1] if found else None


def on_config(config, **kwargs):
    config["site_name"] = f"{config['site_name']} {version()}"
    if config.get("repo_url") is None and (url := repository()):
        config["repo_url"] = url
        config["repo_name"] = "/".join(url.rstrip("/").split("/")[-2:])  # owner/name
    return config
