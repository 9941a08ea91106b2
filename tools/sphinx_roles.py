"""A Griffe extension for the manual's API pages: Sphinx roles in docstrings become code, linked where documented.

The docstrings cross-reference in Sphinx's words (``:func:`ddplab.audit```, ``:class:`~ddplab.errors.UsageError```,
``:meth:`step```), which read well in ``help()`` but which mkdocstrings would print as they are. Each role becomes
its name in code (``~`` keeps the last part; functions and methods get ``()``, as Sphinx shows them), wrapped in an
optional cross-reference: a link where the site documents the target, plain code where it does not.
mkdocs.yml loads it (``extensions:`` of the python handler).
"""

from __future__ import annotations

import re

from griffe import Extension, Object

ROLE = re.compile(r":(?:py:)?(?P<kind>func|meth|class|mod|attr|data|exc|obj|const):`(?P<tilde>~?)(?P<target>[^`]+)`")
CALLABLE = ("func", "meth")


def title(match: re.Match) -> str:
    """What the reader sees for a role: its target (the last part after ``~``), with ``()`` for a callable."""
    target = match["target"].rsplit(".", 1)[-1] if match["tilde"] else match["target"]
    return target + ("()" if match["kind"] in CALLABLE else "")


def plain(text: str) -> str:
    """``text`` with each role as its title (what the built page shows)."""
    return ROLE.sub(title, text)


def _identifier(obj: Object, target: str) -> str | None:
    """The full path ``target`` names seen from ``obj``, when Griffe can tell."""
    if target.startswith("ddplab."):
        return target
    try:
        return obj.resolve(target)
    except Exception:  # griffe raises NameResolutionError, or a KeyError for a member it cannot see
        return None


def rewrite(obj: Object, text: str) -> str:
    def replace(match: re.Match) -> str:
        code = f"<code>{title(match)}</code>"
        identifier = _identifier(obj, match["target"])
        return f'<autoref identifier="{identifier}" optional>{code}</autoref>' if identifier else code

    return ROLE.sub(replace, text)


class SphinxRoles(Extension):
    """Rewrites every loaded object's docstring once the object tree is complete."""

    def on_object(self, *, obj: Object, **kwargs) -> None:
        if obj.docstring is not None and ROLE.search(obj.docstring.value):
            obj.docstring.value = rewrite(obj, obj.docstring.value)
