"""A mkdocs hook: the manual's formulas ($...$ and $$...$$, found by pymdownx.arithmatex) as MathML, at build time.

Browsers draw MathML themselves, so the site shows its formulas with no script, no font download and no network:
the TeX that arithmatex marks (``<span class="arithmatex">\\(...\\)</span>``, or a ``div`` for a displayed
formula) is converted by latex2mathml (the ``docs`` extra). Without it the formulas stay TeX, and the build says so.
mkdocs.yml loads it (``hooks:``).
"""

from __future__ import annotations

import html
import logging
import re

MARKED = re.compile(r'<(?P<tag>span|div) class="arithmatex">\s*\\(?P<open>[(\[])(?P<tex>.*?)\\[)\]]\s*</(?P=tag)>',
                    re.S)
log = logging.getLogger("mkdocs.hooks.mathml")


def mathml(tex: str, display: bool) -> str:
    """One formula as MathML, its TeX kept as the accessible label."""
    from latex2mathml.converter import convert

    element = convert(tex.strip(), display="block" if display else "inline")
    return element.replace("<math ", f'<math alttext="{html.escape(tex.strip(), quote=True)}" ', 1)


def render(page_html: str) -> str:
    """Every formula arithmatex marked in ``page_html`` as MathML."""
    def replace(match: re.Match) -> str:
        display = match["open"] == "["
        element = mathml(html.unescape(match["tex"]), display)
        return f'<div class="math">{element}</div>' if display else element

    return MARKED.sub(replace, page_html)


def on_page_content(html_text: str, **kwargs) -> str:
    try:
        import latex2mathml  # noqa: F401
    except ImportError:
        log.info("latex2mathml is not installed (pip install -e '.[docs]'): formulas stay TeX")
        return html_text
    return render(html_text)
