"""A docs page's shown output, checked against what its code printed.

A fenced block whose info string is `output`, right after a python or bash block (nothing but
blank lines between), is what that block prints on stdout: a python block's own prints (and
those of the processes it starts), or the stdout of a bash block's `posttrain` commands, one
after the other. It is compared line by line, exactly, except:

- a run of spaces matches any run of spaces (columns align to the widths of what is in them);
- `~` before a number matches any number: a time, a rate, a figure that differs by machine;
- `...` matches any text within a line, and a line of `...` alone any lines, none included.
"""

from __future__ import annotations

import difflib
import re

_NUMBER = r"[-+]?(?:\d[\d,]*)?\.?\d+(?:e[-+]?\d+)?"
_PIECES = re.compile(rf"(~{_NUMBER}| +|\.\.\.)")


def _line(line: str) -> str:
    """The regular expression of one shown line that is not `...` alone."""
    regex = ""
    for piece in _PIECES.split(line.rstrip()):
        if piece.startswith("~"):
            regex += _NUMBER
        elif piece == "...":
            regex += r"[^\n]*?"
        elif piece and piece.isspace():
            regex += " +"
        else:
            regex += re.escape(piece)
    return regex


def pattern(shown: str) -> re.Pattern[str]:
    """The regular expression an output block stands for (the rules above)."""
    lines = shown.rstrip("\n").split("\n")
    return re.compile(
        "".join(
            r"(?:[^\n]*\n)*?" if line.strip() == "..." else _line(line) + r"\n" for line in lines
        )
    )


def normalized(printed: str) -> str:
    """`printed` without trailing spaces on its lines, ending with one newline."""
    return "".join(line.rstrip() + "\n" for line in printed.rstrip("\n").split("\n"))


def mismatch(shown: str, printed: str) -> str | None:
    """None when `printed` is what the output block `shown` says; else what differs."""
    if pattern(shown).fullmatch(normalized(printed)):
        return None
    lines, got = shown.rstrip("\n").split("\n"), normalized(printed).rstrip("\n").split("\n")
    if len(lines) == len(got) and "..." not in (line.strip() for line in lines):
        # Line for line: name the lines that differ, not every line with a `~` in it.
        return "\n".join(
            f"line {n}: shown   {want}\n{' ' * len(f'line {n}: ')}printed {line}"
            for n, (want, line) in enumerate(zip(lines, got, strict=True), 1)
            if not re.fullmatch(_line(want), line)
        )
    diff = difflib.unified_diff(
        shown.rstrip("\n").split("\n"),
        normalized(printed).rstrip("\n").split("\n"),
        "shown",
        "printed",
        lineterm="",
    )
    return "\n".join(diff)
