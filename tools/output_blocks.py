"""A mkdocs hook: a pasted output's long lines wrap, its tables keep their shape.

A pasted output is a block under ``<!-- output: ... -->`` (tools/refresh_docs.py).

An output's messages and commands run to 170 characters and more, while its tables are drawn to 120 columns. Each
line of an output block that draws no box is wrapped in ``<span class="wrap">`` (``white-space: pre-wrap`` in
``docs/stylesheets/extra.css``), so it wraps at the page's width instead of hiding behind a horizontal scroll; the
box-drawing lines stay as drawn. mkdocs.yml loads it (``hooks:``).
"""

from __future__ import annotations

import re

BLOCK = re.compile(r'(<!-- output[^>]*-->\s*<div class="highlight)("><pre><span></span><code>)(.*?)(</code></pre>)',
                   re.S)
BOX = re.compile("[\u2500-\u257f]")
"""Box-drawing characters: a line with one belongs to a table."""


def line(text: str) -> str:
    return text if not text or BOX.search(text) else f'<span class="wrap">{text}</span>'


def mark(page_html: str) -> str:
    """Every output block of ``page_html`` classed ``output``, its lines without a box made to wrap."""
    def replace(match: re.Match) -> str:
        body = "\n".join(line(text) for text in match[3].split("\n"))
        return f"{match[1]} output{match[2]}{body}{match[4]}"

    return BLOCK.sub(replace, page_html)


def on_page_content(html_text: str, **kwargs) -> str:
    return mark(html_text)
