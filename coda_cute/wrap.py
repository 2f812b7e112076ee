"""Fitting the emitted module into ``WIDTH`` columns.

The templates wrap their own lines by hand; the lines lowering generates (the epilogue's
per-pair code, reductions, table gathers) and the ones that hold names from the program vary
in length, so whatever is still too long is wrapped here, the way a person formatting it
would: a statement breaks inside its last bracket (``f(`` / arguments / ``)``), or an
assignment's right-hand side goes in parentheses with one operand per line, each after its
operator; a trailing comment moves to the line above; comments and docstring prose wrap at
words.  Only whitespace changes: the code means what it meant on one line.
"""

from __future__ import annotations

import textwrap

WIDTH = 100
# binary operators as lowering writes them (spaced), loosest first: a split happens at the
# loosest operator present outside brackets
_OPERATORS = ((" or ",), (" and ",), (" | ",), (" & ",),
              (" < ", " <= ", " > ", " >= ", " == ", " != "), (" + ", " - "), (" * ", " / ", " // ", " % "))


def fit_code(source: str, width: int = WIDTH) -> str:
    """``source`` (a module) with every code or comment line longer than ``width`` wrapped;
    lines inside triple-quoted strings are left as they are."""
    lines, in_string = [], False
    for line in source.split("\n"):
        lines.append(fit(line, 0, width) if len(line) > width and not in_string else line)
        if line.count('"""') % 2:
            in_string = not in_string
    return "\n".join(lines)


def fit(line: str, indent: int, width: int = WIDTH) -> str:
    """``line`` (one generated statement or comment, with its own leading spaces) as it stands
    ``indent`` columns in: itself when it fits, else wrapped; continuation lines carry their
    full indentation, the first line none (the template indents it)."""
    own = len(line) - len(line.lstrip(" "))
    lines = _fit(line.strip(), indent + own, width)
    return "\n".join([" " * own + lines[0][1]] + [" " * col + text for col, text in lines[1:]])


def wrap_prose(text: str, width: int = WIDTH, hanging: int = 4) -> list[str]:
    """A line of docstring prose wrapped at words, continuation lines ``hanging`` columns
    deeper than the line's own indentation."""
    own = len(text) - len(text.lstrip(" "))
    if len(text) <= width:
        return [text]
    return textwrap.wrap(text.strip(), width, initial_indent=" " * own, subsequent_indent=" " * (own + hanging),
                         break_long_words=False, break_on_hyphens=False)


def wrap_items(text: str, width: int = WIDTH, hanging: int = 4) -> list[str]:
    """A line listing items separated by ", " (outside brackets) wrapped between items."""
    items = _split_top(text, ", ")
    lines, current = [], items[0]
    for item in items[1:]:
        if len(current) + len(", ") + len(item) + 1 <= width:  # +1: the comma ending a full line
            current += ", " + item
        else:
            lines.append(current + ",")
            current = " " * hanging + item
    return lines + [current]


def wrap_command(command: str, indent: int, width: int = WIDTH) -> list[str]:
    """A shell command wrapped between its flags (`--flag value` stays together), with ``\\``
    continuations; lines after the first are four columns deeper, all ``indent`` columns in."""
    words = command.split(" ")
    groups = []
    for word in words:
        if groups and not word.startswith("--") and groups[-1].startswith("--") and " " not in groups[-1]:
            groups[-1] += " " + word
        else:
            groups.append(word)
    lines, current = [], groups[0]
    for group in groups[1:]:
        if indent + len(current) + 1 + len(group) + 2 <= width:  # room for " \"
            current += " " + group
        else:
            lines.append(current + " \\")
            current = "    " + group
    return lines + [current]


# ----------------------------------------------------------------------------- statements
def _fit(text: str, col: int, width: int) -> list[tuple[int, str]]:
    if col + len(text) <= width:
        return [(col, text)]
    if text.startswith("#"):
        body = text[1:].strip()
        return [(col, "# " + part) for part in textwrap.wrap(body, max(width - col - 2, 20), break_long_words=False)]
    code, comment = _split_comment(text)
    if comment:  # the comment goes above the code
        return _fit(comment, col, width) + _fit(code, col, width)
    return _break(code, col, width) or [(col, text)]


def _break(code: str, col: int, width: int) -> list[tuple[int, str]] | None:
    """``code`` over several lines, or None where no break fits."""
    target, rhs = _split_assignment(code)
    if rhs is not None and not _is_atom(rhs):  # lhs = (operands one per line)
        body = _operands(rhs, col + 4, width)
        return [(col, f"{target} = (")] + body + [(col, ")")] if col + len(target) + 4 <= width else None
    found = _last_bracket(code)
    if found is None:
        return None
    start, end = found
    head, inner, tail = code[:start + 1], code[start + 1:end], code[end:]
    if col + len(head) > width:
        return None
    return [(col, head)] + _operands(inner, col + 4, width) + [(col, tail)]


def _operands(expr: str, col: int, width: int) -> list[tuple[int, str]]:
    """An expression inside brackets, at ``col``: on one line if it fits, else one item per line
    (items are split at top-level commas, or else at the loosest top-level operator)."""
    if col + len(expr) <= width:
        return [(col, expr)]
    items = _split_top(expr, ", ")
    if len(items) > 1:  # one per line, each with its comma (the last too: the list is open-ended)
        out = []
        for item in items:
            out += _continue(item, col, width, suffix=",")
        return out
    for ops in _OPERATORS:
        parts = _split_operators(expr, ops)
        if len(parts) > 1:
            out = []
            for k, (op, part) in enumerate(parts):
                out += _continue(part, col, width, prefix=f"{op.strip()} " if k else "")
            return out
    return _continue(expr, col, width)


def _continue(item: str, col: int, width: int, prefix: str = "", suffix: str = "") -> list[tuple[int, str]]:
    """One operand on its own line(s): broken inside its last bracket where it does not fit."""
    text = prefix + item + suffix
    if col + len(text) <= width:
        return [(col, text)]
    if item.startswith("(") and _matching(item, 0) == len(item) - 1:  # a parenthesized group
        return [(col, prefix + "(")] + _operands(item[1:-1], col + 4, width) + [(col, ")" + suffix)]
    broken = _break(item, col, width) if not prefix else _break(prefix + item, col, width)
    if broken is None:
        return [(col, text)]
    last_col, last = broken[-1]
    return broken[:-1] + [(last_col, last + suffix)]


# ----------------------------------------------------------------------------- scanning
def _scan(text: str):
    """(index, char, depth) for every character outside string literals."""
    depth, quote = 0, None
    for i, ch in enumerate(text):
        if quote:
            if ch == quote:
                quote = None
            continue
        if ch in "\"'":
            quote = ch
            continue
        if ch in ")]}":
            depth -= 1
        yield i, ch, depth
        if ch in "([{":
            depth += 1


def _matching(text: str, start: int) -> int | None:
    depth = None
    for i, ch, d in _scan(text):
        if i == start:
            depth = d
        elif depth is not None and ch in ")]}" and d == depth:
            return i
    return None


def _split_top(text: str, sep: str) -> list[str]:
    parts, last = [], 0
    for i, ch, depth in _scan(text):
        if depth == 0 and text.startswith(sep, i) and i >= last:
            parts.append(text[last:i])
            last = i + len(sep)
    return parts + [text[last:]]


def _split_operators(text: str, ops: tuple[str, ...]) -> list[tuple[str, str]]:
    """[("", first operand), (op, operand), ...] at the top-level occurrences of ``ops``."""
    parts, last, op = [], 0, ""
    for i, ch, depth in _scan(text):
        if depth or i < last or ch != " ":
            continue
        found = next((o for o in sorted(ops, key=len, reverse=True) if text.startswith(o, i)), None)
        if found and i > last:
            parts.append((op, text[last:i]))
            op, last = found, i + len(found)
    return parts + [(op, text[last:])]


def _split_comment(text: str) -> tuple[str, str]:
    for i, ch, _ in _scan(text):
        if ch == "#":
            return text[:i].rstrip(), text[i:]
    return text, ""


def _split_assignment(text: str) -> tuple[str, str | None]:
    """(target, value) of ``target = value``, else (text, None)."""
    for i, ch, depth in _scan(text):
        if depth == 0 and text.startswith(" = ", i):
            return text[:i], text[i + 3:]
    return text, None


def _is_atom(expr: str) -> bool:
    """Whether ``expr`` has no operator or comma outside brackets (a name, call or subscript)."""
    if len(_split_top(expr, ", ")) > 1:
        return False
    return all(len(_split_operators(expr, ops)) == 1 for ops in _OPERATORS)


def _last_bracket(code: str) -> tuple[int, int] | None:
    """(opening, closing) index of the last top-level bracket pair that ends the statement
    (but for a closing ``:``)."""
    end = len(code) - 1 - (code.endswith(":"))
    if end < 0 or code[end] not in ")]}":
        return None
    for i, ch, depth in _scan(code):
        if depth == 0 and ch in "([{" and _matching(code, i) == end:
            return i, end
    return None
