"""Edit one value in a config file's text in place: TOML, YAML, JSON and command-line arguments.

Each editor finds the key's value in the original text and replaces only those characters (adding the key where
the file lacks it), so comments, key order, quoting and layout elsewhere stay as they were; nothing is
re-serialised.
"""

from __future__ import annotations

import json
import re
import shlex
from typing import Any


def number(value: float | int) -> str:
    """A number as every format here reads it back as the same type: floats keep a '.' in their mantissa (YAML 1.1
    reads ``1e-05`` as a string, ``1.0e-05`` as a float)."""
    if isinstance(value, int) and not isinstance(value, bool):
        return str(value)
    text = f"{value:.6g}"
    mantissa, e, exponent = text.partition("e")
    if "." not in mantissa:
        mantissa += ".0"
    return mantissa + (e + exponent if e else "")


def scalar(value: Any) -> str:
    """A value in the flow syntax TOML, YAML and JSON share: numbers, booleans, strings, lists."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return number(value)
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(map(scalar, value)) + "]"
    return json.dumps(value)


# --- TOML ---------------------------------------------------------------------------------------------------------

_TOML_VALUE = r'("(?:[^"\\]|\\.)*"|\'[^\']*\'|\[[^\]]*\]|[^\s#]+)'


def toml_set(text: str, key: str, value: Any) -> str:
    """``[section] name = value`` set to ``value``: the value's characters replaced, or the line added."""
    section, _, name = key.rpartition(".")
    lines = text.splitlines(keepends=True)
    start, end = _toml_section(lines, section)
    if start is None:
        tail = "" if not text or text.endswith("\n") else "\n"
        return f"{text}{tail}\n[{section}]\n{name} = {scalar(value)}\n"
    pattern = re.compile(rf"^(\s*{re.escape(name)}\s*=\s*){_TOML_VALUE}")
    for index in range(start, end):
        match = pattern.match(lines[index])
        if match:
            lines[index] = match[1] + scalar(value) + lines[index][match.end():]
            return "".join(lines)
    last = max((i for i in range(start, end) if lines[i].strip()), default=start - 1)
    lines.insert(last + 1, f"{name} = {scalar(value)}\n")
    return "".join(lines)


def _toml_section(lines: list[str], section: str) -> tuple[int | None, int]:
    """The lines of ``[section]``'s body: (first, past the last); (None, 0) when the file has no such table."""
    header = re.compile(rf"^\s*\[\s*{re.escape(section)}\s*\]\s*(#.*)?$")
    for index, line in enumerate(lines):
        if header.match(line):
            end = next((j for j in range(index + 1, len(lines)) if re.match(r"^\s*\[", lines[j])), len(lines))
            return index + 1, end
    return None, 0


# --- YAML ---------------------------------------------------------------------------------------------------------

_YAML_KEY = re.compile(r"^(?P<indent>\s*)(?P<key>[\w.\-]+|\"[^\"]*\"|'[^']*'):(?P<rest>.*)$")


def yaml_set(text: str, key: str, value: Any) -> str:
    """A block mapping's ``key: value`` set to ``value``; a block sequence replaced item by item; added if absent."""
    lines = text.splitlines(keepends=True)
    if lines and not lines[-1].endswith("\n"):
        lines[-1] += "\n"
    _yaml_set(lines, key.split("."), value, 0, len(lines), -1)
    return "".join(lines)


def _yaml_set(lines: list[str], parts: list[str], value: Any, start: int, end: int, parent: int) -> None:
    found = _yaml_find(lines, parts[0], start, end, parent)
    if found is None:
        indent = _yaml_child_indent(lines, start, end, parent)
        body = _yaml_block(parts, value, indent)
        at = max((i for i in range(start, end) if lines[i].strip() and not lines[i].lstrip().startswith("#")),
                 default=start - 1) + 1
        lines[at:at] = body
        return
    index, indent = found
    block_end = _yaml_block_end(lines, index + 1, end, indent)
    if len(parts) > 1:
        _yaml_set(lines, parts[1:], value, index + 1, block_end, indent)
        return
    match = _YAML_KEY.match(lines[index])
    rest = match["rest"]
    content, comment = _split_comment(rest)
    if content.strip():
        lead = content[:len(content) - len(content.lstrip())]
        lines[index] = f"{match['indent']}{match['key']}:{lead}{scalar(value)}{comment}\n"
        return
    items = [i for i in range(index + 1, block_end) if lines[i].lstrip().startswith("- ")]
    if isinstance(value, (list, tuple)) and len(items) == len(value):
        for i, item in zip(items, value):
            dash = lines[i][:lines[i].index("- ") + 2]
            _, tail = _split_comment(lines[i][len(dash):].rstrip("\n"))
            lines[i] = f"{dash}{scalar(item)}{tail}\n"
        return
    lines[index] = f"{match['indent']}{match['key']}: {scalar(value)}{comment}\n"
    del lines[index + 1:block_end]


def _yaml_find(lines: list[str], key: str, start: int, end: int, parent: int) -> tuple[int, int] | None:
    """The line of ``key`` among the direct children of the mapping whose indent is ``parent``."""
    child = None
    for index in range(start, end):
        match = _YAML_KEY.match(lines[index])
        if not match or lines[index].lstrip().startswith("#"):
            continue
        indent = len(match["indent"])
        if indent <= parent:
            return None
        child = indent if child is None else child
        if indent == child and match["key"].strip("\"'") == key:
            return index, indent
    return None


def _yaml_block_end(lines: list[str], start: int, end: int, indent: int) -> int:
    """Past the last line that belongs to the key at ``indent`` (deeper lines, blanks and comments between)."""
    last = start
    for index in range(start, end):
        line = lines[index]
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        depth = len(line) - len(line.lstrip())
        if depth <= indent and not (depth == indent and line.lstrip().startswith("- ")):
            return last
        last = index + 1
    return last


def _yaml_child_indent(lines: list[str], start: int, end: int, parent: int) -> int:
    for index in range(start, end):
        match = _YAML_KEY.match(lines[index])
        if match and len(match["indent"]) > parent:
            return len(match["indent"])
    return parent + 2 if parent >= 0 else 0


def _yaml_block(parts: list[str], value: Any, indent: int) -> list[str]:
    pad = " " * indent
    if len(parts) == 1:
        return [f"{pad}{parts[0]}: {scalar(value)}\n"]
    return [f"{pad}{parts[0]}:\n"] + _yaml_block(parts[1:], value, indent + 2)


def _split_comment(rest: str) -> tuple[str, str]:
    """A YAML value and its trailing comment (`` # ...``), split outside quotes."""
    quote = None
    for index, char in enumerate(rest):
        if char in "\"'" and quote in (None, char):
            quote = None if quote else char
        elif char == "#" and quote is None and (index == 0 or rest[index - 1] in " \t"):
            content = rest[:index]
            stripped = content.rstrip()
            return stripped, content[len(stripped):] + rest[index:]
    return rest.rstrip(), ""


# --- JSON ---------------------------------------------------------------------------------------------------------

def json_set(text: str, key: str, value: Any) -> str:
    """A JSON member's value replaced in place (its characters only); a member added where the object lacks it."""
    spans = _json_spans(text)
    if key in spans:
        start, end = spans[key]
        return text[:start] + scalar(value) + text[end:]
    parent, _, name = key.rpartition(".")
    if parent and parent not in spans:
        # The object itself is missing: add it empty, then the member into it.
        return json_set(json_set(text, parent, {}), key, value)
    return _json_add(text, spans, parent, name, scalar(value))


def _json_add(text: str, spans: dict[str, tuple[int, int]], parent: str, name: str, raw: str) -> str:
    """``"name": raw`` added as the last member of the object at ``parent``, laid out as its other members are."""
    start, end = spans[parent]
    close = end - 1
    body = text[start + 1:close]
    member = f"{json.dumps(name)}: {raw}"
    if body.strip() and "\n" not in body:
        # A one-line object stays on one line.
        last = start + 1 + len(body.rstrip())
        return text[:last] + f", {member}" + text[last:]
    line = text[text.rfind("\n", 0, start) + 1:start]
    base = line[:len(line) - len(line.lstrip())]
    unit = re.search(r"\n([ \t]+)\S", text)
    pad = base + (unit[1] if unit else "  ")
    if not body.strip():
        return text[:start + 1] + f"\n{pad}{member}\n{base}" + text[close:]
    last = start + 1 + len(body.rstrip())
    return text[:last] + f",\n{pad}{member}" + text[last:]


def _json_spans(text: str) -> dict[str, tuple[int, int]]:
    """Every value's (start, end) by dotted key ("" for the top object), found by one scan of the text."""
    spans: dict[str, tuple[int, int]] = {}
    decoder = json.JSONDecoder()

    def skip(i: int) -> int:
        while i < len(text) and text[i] in " \t\r\n":
            i += 1
        return i

    def value(i: int, key: str) -> int:
        i = skip(i)
        if text[i] == "{":
            j = skip(i + 1)
            while text[j] != "}":
                name, j = decoder.raw_decode(text, j)
                j = skip(skip(j) + 1)  # past ':'
                j = skip(value(j, f"{key}.{name}" if key else name))
                j = skip(j + 1) if text[j] == "," else j
            end = j + 1
        elif text[i] == "[":
            j = skip(i + 1)
            index = 0
            while text[j] != "]":
                j = skip(value(j, f"{key}[{index}]"))
                j = skip(j + 1) if text[j] == "," else j
                index += 1
            end = j + 1
        else:
            end = decoder.raw_decode(text, i)[1]
        spans[key] = (i, end)
        return end

    value(0, "")
    return spans


# --- command-line arguments (Megatron-LM) ------------------------------------------------------------------------

def args_set(text: str, flag: str, value: Any, *, after: str) -> str:
    """A command-line flag's value set in a launch script or args file: the value token(s) replaced, or the flag added
    after the flag ``after`` (and its value) on the same line. A list value is that many tokens (Megatron's batch
    ramp takes three)."""
    values = list(value) if isinstance(value, (list, tuple)) else [value]
    rendered = " ".join(number(v) if isinstance(v, (int, float)) else str(v) for v in values)
    found = flag_value(text, flag, len(values))
    if found is not None:
        start, end = found
        return text[:start] + rendered + text[end:]
    start, end = flag_value(text, after, 1)
    return text[:end] + f" {flag} {rendered}" + text[end:]


_TOKEN = re.compile(r"\"[^\"]*\"|'[^']*'|[^\s\\)\"']+")


def flag_value(text: str, flag: str, count: int = 1) -> tuple[int, int] | None:
    """The span of ``flag``'s ``count`` value tokens in the text (a line continuation between them allowed); a flag
    in a comment is not one."""
    pattern = re.compile(rf"(?<![\w-]){re.escape(flag)}(?:=|[ \t]+)")
    match = next((m for m in pattern.finditer(text) if not _commented(text, m.start())), None)
    if match is None:
        return None
    first = _TOKEN.match(text, match.end())
    if first is None:
        return None
    end = first.end()
    for _ in range(count - 1):
        gap = re.match(r"(?:[ \t]|\\\n)+", text[end:])
        token = _TOKEN.match(text, end + gap.end()) if gap else None
        if token is None:
            break
        end = token.end()
    return first.start(), end


def _commented(text: str, at: int) -> bool:
    """Whether ``at`` follows a ``#`` that starts a comment on its line."""
    return re.search(r"(?:^|\s)#", text[text.rfind("\n", 0, at) + 1:at]) is not None


def shell_words(text: str) -> list[str]:
    """A launch script's words, line continuations and comments removed (the flags and their values)."""
    joined = re.sub(r"\\\n", " ", text)
    words = []
    for line in joined.splitlines():
        try:
            words += shlex.split(line, comments=True)
        except ValueError:
            words += line.split()
    return words
