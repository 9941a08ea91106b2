"""A launch script read as bash runs it, as far as its flags need: the words of its commands, variables expanded.

Statements run in order: ``NAME=value`` (``export``/``declare``/``local`` included) sets a variable to its value
expanded with the variables set before it, so ``NODE_RANK=${NODE_RANK:-0}`` is 0 and no variable refers to another
at lookup; ``name=(...)`` sets an array, expanded by ``"${name[@]}"``. A variable the script does not set stays as
written (``$SLURM_NNODES``) for the caller to name. Comments, line continuations, quotes, here-documents, ``$(...)``
and ``${...}`` are read as bash reads them; text bash itself could not finish reading (an unterminated quote, an
unclosed ``$(``) is a :class:`ShellError` naming its line.

>>> words("GPUS=${GPUS:-8}\\nargs=(--lr 1e-4\\n  --micro-batch-size 4)\\n"
...       "torchrun --nproc_per_node $GPUS x.py \\"${args[@]}\\"")
['torchrun', '--nproc_per_node', '8', 'x.py', '--lr', '1e-4', '--micro-batch-size', '4']
"""

from __future__ import annotations

import dataclasses
import re

_NAME = re.compile(r"[A-Za-z_]\w*")
_ASSIGNMENT = re.compile(r"([A-Za-z_]\w*)(\+?)=")
_DECLARATIONS = frozenset({"export", "declare", "local", "readonly", "typeset"})
_OPERATORS = ";&|"
_BARE = re.compile(r"[^\s\\'\"$`()<;&|#]+|.")
_DOUBLE_QUOTED = re.compile(r'[^"\\$`]+|\\(?:.|\n)|\$\(|\$\{|`|"|\$', re.S)
_NESTED = re.compile(r"[^()'\"{}\\]+|\\.|'[^']*'|\"(?:[^\"\\]|\\.)*\"|.", re.S)
_QUOTES = re.compile(r"\"([^\"]*)\"|'([^']*)'")
_HEREDOC = re.compile(r"<<(-?)[ \t]*(?:'([^'\n]*)'|\"([^\"\n]*)\"|([^\s;&|<>()]+))")


class ShellError(ValueError):
    """Text bash could not finish reading, at its line (1-based)."""

    def __init__(self, line: int, what: str):
        super().__init__(f"line {line}: {what}")
        self.line, self.what = line, what


@dataclasses.dataclass(frozen=True)
class Part:
    """A run of a word's characters: ``quote`` is '' (bare), '"' or "'" (nothing in it expands)."""

    text: str
    quote: str


@dataclasses.dataclass(frozen=True)
class Token:
    """A word (its parts) or an operator: ``(`` and ``)`` of an array, or a statement's end."""

    parts: tuple[Part, ...]
    line: int
    operator: str = ""

    @property
    def raw(self) -> str:
        return "".join(part.text for part in self.parts)


def words(text: str) -> list[str]:
    """Every command's words in order, with the variables and arrays set before each expanded."""
    variables: dict[str, list[str]] = {}
    out: list[str] = []
    for statement in statements(text):
        out += _run(statement, variables)
    return out


def statements(text: str) -> list[list[Token]]:
    """The script's statements, each its tokens; a newline inside an array's parentheses continues it."""
    return _Reader(text).read()


class _Reader:
    """One pass over the text: each character is looked at a bounded number of times."""

    def __init__(self, text: str):
        self.text, self.at, self.line = text, 0, 1
        self.statements: list[list[Token]] = []
        self.tokens: list[Token] = []
        self.parts: list[Part] = []
        self.word_line = 1
        self.arrays = 0
        self.heredocs: list[tuple[str, bool]] = []

    def read(self) -> list[list[Token]]:
        text = self.text
        while self.at < len(text):
            char = text[self.at]
            if char == "\\" and text.startswith("\\\n", self.at):
                self._advance(2)
            elif char in " \t\r":
                self._end_word()
                self.at += 1
            elif char == "\n":
                self._newline()
            elif char == "#" and not self.parts:
                end = text.find("\n", self.at)
                self.at = len(text) if end < 0 else end
            elif char in "'\"":
                self._quoted(char)
            elif char == "\\":
                self._add(text[self.at + 1:self.at + 2], "'")
                self._advance(2)
            elif char == "$" and text.startswith(("$(", "${"), self.at):
                self._substitution()
            elif char == "`":
                start = self.at
                self._skip_to("`", start + 1, "`")
                self._add(text[start:self.at], "")
            elif char == "<" and text.startswith("<<", self.at) and not text.startswith("<<<", self.at):
                self._heredoc()
            elif char in "()":
                self._parenthesis(char)
            elif char in _OPERATORS:
                self._end_statement()
                self.at += 1
            else:
                match = _BARE.match(text, self.at)
                self._add(match[0], "")
                self.at = match.end()
        if self.arrays:
            raise ShellError(self.line, "an array's '(' is never closed")
        self._end_statement()
        return self.statements

    def _advance(self, count: int) -> None:
        self.line += self.text.count("\n", self.at, self.at + count)
        self.at += count

    def _add(self, text: str, quote: str) -> None:
        if not self.parts:
            self.word_line = self.line
        if self.parts and self.parts[-1].quote == quote:
            # One run of like-quoted text, so that "$" and the name after it expand together.
            self.parts[-1] = Part(self.parts[-1].text + text, quote)
        else:
            self.parts.append(Part(text, quote))

    def _end_word(self) -> None:
        if self.parts:
            self.tokens.append(Token(tuple(self.parts), self.word_line))
            self.parts = []

    def _end_statement(self) -> None:
        self._end_word()
        if self.tokens:
            self.statements.append(self.tokens)
            self.tokens = []

    def _newline(self) -> None:
        self._end_word()
        if not self.arrays:
            self._end_statement()
        self._advance(1)
        if self.heredocs:
            self._skip_heredocs()

    def _quoted(self, quote: str) -> None:
        start = self.at
        if quote == "'":
            self._skip_to("'", start + 1, "'")
            self._add(self.text[start + 1:self.at - 1], "'")
            return
        chunk, at = [], start + 1
        while True:
            match = _DOUBLE_QUOTED.match(self.text, at)
            if match is None:
                raise ShellError(self.line, 'a " quote is never closed')
            piece = match[0]
            if piece == '"':
                break
            if piece in ("$(", "${", "`"):
                end = self._closing(at, piece)
                chunk.append(self.text[at:end])
                at = end
                continue
            chunk.append(piece[1:] if piece[0] == "\\" and piece[1:] in '"\\$`' else
                         "" if piece == "\\\n" else piece)
            at = match.end()
        self._add("".join(chunk), '"')
        self._advance(at + 1 - start)

    def _substitution(self) -> None:
        start = self.at
        end = self._closing(start, self.text[start:start + 2])
        self._add(self.text[start:end], "")
        self._advance(end - start)

    def _closing(self, start: int, opener: str) -> int:
        """Past the end of the ``$(...)``, ``${...}`` or backquote that starts at ``start`` (nesting counted)."""
        if opener == "`":
            end = self.text.find("`", start + 1)
            if end < 0:
                raise ShellError(self.line, "a ` command substitution is never closed")
            return end + 1
        close = ")" if opener == "$(" else "}"
        depth, at = 0, start + 1
        while at < len(self.text):
            piece = _NESTED.match(self.text, at)[0]
            if piece in ("(", "{"):
                depth += piece == ("(" if close == ")" else "{")
            elif piece == close:
                depth -= 1
                if depth == 0:
                    return at + 1
            elif piece[0] in "'\"" and (len(piece) == 1 or piece[-1] != piece[0]):
                break
            at += len(piece)
        raise ShellError(self.line, f"a {opener} is never closed")

    def _skip_to(self, char: str, at: int, what: str) -> None:
        end = self.text.find(char, at)
        if end < 0:
            raise ShellError(self.line, f"a {what} quote is never closed")
        self._advance(end + 1 - self.at)

    def _parenthesis(self, char: str) -> None:
        if char == "(" and self.parts and _ASSIGNMENT.fullmatch(self._word()):
            self.arrays += 1
        elif char == ")" and self.arrays:
            self.arrays -= 1
        self._end_word()
        self.tokens.append(Token((), self.line, operator=char))
        self.at += 1

    def _word(self) -> str:
        return "".join(part.text for part in self.parts) if all(not p.quote for p in self.parts) else ""

    def _heredoc(self) -> None:
        """``<<WORD`` (or ``<<-WORD``): the lines up to WORD are its text, no commands."""
        match = _HEREDOC.match(self.text, self.at)
        if match is None:
            raise ShellError(self.line, "a << here-document has no delimiter")
        self.heredocs.append((match[2] or match[3] or match[4] or "", bool(match[1])))
        self.at = match.end()

    def _skip_heredocs(self) -> None:
        for delimiter, tabs in self.heredocs:
            start_line = self.line
            while True:
                if self.at >= len(self.text):
                    raise ShellError(start_line - 1, f"a here-document is never ended by {delimiter!r}")
                end = self.text.find("\n", self.at)
                end = len(self.text) if end < 0 else end
                line = self.text[self.at:end]
                self._advance(min(end + 1, len(self.text)) - self.at)
                if (line.lstrip("\t") if tabs else line) == delimiter:
                    break
        self.heredocs = []


def _run(statement: list[Token], variables: dict[str, list[str]]) -> list[str]:
    """A statement's command words after its assignments, which it sets (an array from its parentheses)."""
    index = 0
    while index < len(statement):
        token = statement[index]
        if token.operator:
            break
        if token.raw in _DECLARATIONS and not token.parts[0].quote:
            index += 1
            while index < len(statement) and statement[index].raw.startswith("-"):
                index += 1
            continue
        match = _ASSIGNMENT.match(token.raw) if not token.parts[0].quote else None
        if match is None or match.end() > len(token.parts[0].text):
            break
        index = _assign(statement, index, match, variables)
    command = []
    for token in statement[index:]:
        if not token.operator:
            command += expand(token, variables)
    return command


def _assign(statement: list[Token], index: int, match: re.Match, variables: dict[str, list[str]]) -> int:
    """Set the variable the token at ``index`` assigns; the index past it (past an array's closing parenthesis)."""
    token, name, append = statement[index], match[1], bool(match[2])
    rest = (Part(token.parts[0].text[match.end():], ""), *token.parts[1:])
    following = statement[index + 1] if index + 1 < len(statement) else None
    if following is not None and following.operator == "(" and not any(part.text for part in rest):
        values, index = [], index + 2
        while index < len(statement) and statement[index].operator != ")":
            if not statement[index].operator:
                values += expand(statement[index], variables)
            index += 1
        variables[name] = (variables.get(name, []) if append else []) + values
        return index + 1
    value = " ".join(_expand_parts(rest, variables, split=False))
    variables[name] = [(variables.get(name, [""])[0] if append else "") + value]
    return index + 1


def expand(token: Token, variables: dict[str, list[str]]) -> list[str]:
    """A word's expansion: its variables substituted, an unquoted one split at blanks, ``"${name[@]}"`` one word
    per element."""
    return [word for word in _expand_parts(token.parts, variables, split=True) if word] or (
        [""] if any(part.quote for part in token.parts) else [])


_REFERENCE = re.compile(r"\$(?:\{(?P<braced>[^{}]*(?:\{[^{}]*\}[^{}]*)*)\}|(?P<name>[A-Za-z_]\w*))")
_BRACED = re.compile(r"(?P<name>[A-Za-z_]\w*)(?:\[(?P<index>[^\]]*)\])?(?:(?P<op>:?[-=+?])(?P<word>.*))?", re.S)


def _expand_parts(parts, variables: dict[str, list[str]], *, split: bool) -> list[str]:
    """The words the parts make: text joins, a bare variable's blanks split, an array's ``[@]`` gives a word each."""
    out = [""]
    for part in parts:
        if part.quote == "'":
            out[-1] += part.text
            continue
        at = 0
        for match in _REFERENCE.finditer(part.text):
            out[-1] += part.text[at:match.start()]
            at = match.end()
            values, each = _lookup(match, variables)
            if values is None:
                out[-1] += match[0]
            elif each and len(values) != 1:
                out[-1:] = [out[-1] + values[0], *values[1:]] if values else out[-1:]
            elif split and not part.quote:
                _split_into(out, " ".join(values))
            else:
                out[-1] += " ".join(values)
        out[-1] += part.text[at:]
    return out


def _split_into(words: list[str], value: str) -> None:
    """An unquoted expansion's fields: the first joins the text before it, the last the text after (bash's blanks
    end a word)."""
    fields = value.split()
    if not fields:
        return
    if value[0].isspace():
        words.append("")
    words[-1] += fields[0]
    words += fields[1:]
    if value[-1].isspace():
        words.append("")


def _lookup(match: re.Match, variables: dict[str, list[str]]) -> tuple[list[str] | None, bool]:
    """A reference's values (None where unset and given no default: it stays as written) and whether each value is
    a word of its own (``[@]``)."""
    if match["name"]:
        values = variables.get(match["name"])
        return (values[:1] if values is not None else None), False
    braced = _BRACED.fullmatch(match["braced"])
    if braced is None:
        return None, False
    values, index = variables.get(braced["name"]), braced["index"]
    if values is not None and index not in (None, "@", "*"):
        values = [values[int(index)]] if index.isdigit() and int(index) < len(values) else []
    elif values is not None and index is None:
        values = values[:1]
    op, word = braced["op"], braced["word"]
    unset = values is None or (op and op.startswith(":") and not "".join(values))
    # The word after the operator loses its quotes, as bash's does: ${LR:-"1e-4"} is 1e-4.
    word = _QUOTES.sub(lambda quoted: quoted[1] if quoted[1] is not None else quoted[2], word or "")
    if op and op[-1] in "-=" and unset:
        default = "".join(_expand_parts((Part(word, '"'),), variables, split=False))
        if op[-1] == "=":
            variables[braced["name"]] = [default]
        return [default], False
    if op and op[-1] == "+":
        return ([] if unset else ["".join(_expand_parts((Part(word, '"'),), variables, split=False))]), False
    return values, index == "@"
