"""Reading replay input files record by record: JSON Lines, or one JSON array of objects, with 1-based line numbers.

Every loader of :mod:`prefixcache.replay` reads through :func:`iter_json_records`, so every format reports a bad
record the same way: ``file:line: what``, with the 1-based column where the problem starts.
"""

from __future__ import annotations

import codecs
import json
import re
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from prefixcache.errors import ScenarioError

__all__ = ["NOT_FOUND", "Record", "iter_json_lines", "iter_json_records"]

Record = tuple[int, Any, "ScenarioError | None"]
"""``(line_no, parsed, None)`` for a usable record, ``(line_no, None, error)`` for one that is not JSON."""

_WHITESPACE = " \t\r\n"

NOT_FOUND = "not found: no such file or folder"
"""What an input path that does not exist is told (after its name), whatever the format or mode."""


def _open(path: Path):
    try:
        return path.open("rb")
    except FileNotFoundError:
        raise ScenarioError(NOT_FOUND, str(path)) from None
    except OSError as exc:
        raise ScenarioError(f"cannot open: {exc.strerror or exc}", str(path)) from None


def iter_json_records(path: str | Path) -> Iterator[Record]:
    """Yield the records of ``path``: each non-blank line of a JSON Lines file, or each element of a file holding one
    JSON array of objects (ShareGPT dumps are written so), numbered by the line it starts on.

    The file is an array when its first non-blank line is ``[`` and not a whole JSON value on its own (an indented
    dump), or a whole array of objects with nothing after it (a dump on one line); otherwise it is JSON Lines, so a
    line that is an array, or nested too deep to read, is that line's error as before.  A JSON Lines file is read a
    line at a time; an array file is read whole (memory: a few times its size), and a syntax error in it ends the
    records there (the error is the last record).  A UTF-8 byte order mark at the start is read past.  Errors are
    yielded rather than raised so that a caller skipping bad records can keep reading.
    Raises :class:`ScenarioError` (no line) if the file cannot be opened (:data:`NOT_FOUND` if it does not exist).
    """
    path = Path(path)
    with _open(path) as handle:
        first = b""
        for line_no, raw in enumerate(handle, start=1):
            if line_no == 1 and raw.startswith(codecs.BOM_UTF8):
                raw = raw[len(codecs.BOM_UTF8) :]
            if raw.strip():
                first = raw
                break
        rest_is_blank = not first or all(not line.strip() for line in handle)
    if not first.lstrip().startswith(b"["):
        yield from iter_json_lines(path)
        return
    try:
        value = json.loads(first)
    except json.JSONDecodeError:
        yield from _iter_array(path)  # an array spread over several lines
        return
    except (RecursionError, ValueError, UnicodeDecodeError):
        yield from iter_json_lines(path)
        return
    if rest_is_blank and isinstance(value, list) and all(isinstance(item, dict) for item in value):
        yield from ((line_no, item, None) for item in value)
        return
    yield from iter_json_lines(path)


def iter_json_lines(path: str | Path) -> Iterator[Record]:
    """Yield ``(line_no, parsed, None)`` per non-blank line of a JSON Lines file, or ``(line_no, None, error)`` for a
    line that is not UTF-8 or JSON (the error names the 1-based column).  O(file size), one line in memory at a time.
    A UTF-8 byte order mark at the start of the file is dropped (editors on Windows write one).
    Raises :class:`ScenarioError` (no line) if the file cannot be opened.
    """
    path = Path(path)
    with _open(path) as handle:
        # Decoding per line (not per file) lets a bad byte be reported, and skipped, on its own line.
        for line_no, raw in enumerate(handle, start=1):
            if line_no == 1 and raw.startswith(codecs.BOM_UTF8):
                raw = raw[len(codecs.BOM_UTF8) :]
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError as exc:
                column = len(raw[: exc.start].decode("utf-8", errors="replace")) + 1
                error = ScenarioError(f"not valid UTF-8 ({exc.reason} at column {column})", str(path), line_no)
                yield line_no, None, error
                continue
            if not text.strip():
                continue
            try:
                obj = json.loads(text)
            except json.JSONDecodeError as exc:
                yield line_no, None, ScenarioError(_syntax(exc, exc.colno), str(path), line_no)
                continue
            except RecursionError:
                yield line_no, None, ScenarioError(_too_deep(text, 0), str(path), line_no)
                continue
            except ValueError as exc:  # an integer of thousands of digits
                yield line_no, None, ScenarioError(f"not usable JSON: {_long_number(text, exc)}", str(path), line_no)
                continue
            yield line_no, obj, None


def _iter_array(path: Path) -> Iterator[Record]:
    """The elements of a file that is one JSON array, each with the line it starts on."""
    name = str(path)
    raw = path.read_bytes()
    if raw.startswith(codecs.BOM_UTF8):
        raw = raw[len(codecs.BOM_UTF8) :]
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        before = raw[: exc.start].decode("utf-8", errors="replace")
        line_no = before.count("\n") + 1
        column = len(before) - (before.rfind("\n") + 1) + 1
        yield line_no, None, ScenarioError(f"not valid UTF-8 ({exc.reason} at column {column})", name, line_no)
        return
    decoder = json.JSONDecoder()
    index = text.index("[") + 1
    line_no, counted_to = 1, 0

    def line_of(position: int) -> int:
        nonlocal line_no, counted_to
        line_no += text.count("\n", counted_to, position)
        counted_to = position
        return line_no

    def column_of(position: int) -> int:
        return position - (text.rfind("\n", 0, position) + 1) + 1

    expect_element = True  # after "[" or ",": an element (or, right after "[", the closing "]")
    first = True
    while True:
        while index < len(text) and text[index] in _WHITESPACE:
            index += 1
        if index == len(text):
            yield line_of(index), None, ScenarioError("not valid JSON: the array is not closed with ']'", name, line_no)
            return
        if not expect_element:
            if text[index] == "]":
                rest = text[index + 1 :].strip(_WHITESPACE)
                if rest:
                    where = line_of(index + 1 + text[index + 1 :].index(rest[0]))
                    yield where, None, ScenarioError("not valid JSON: text after the closing ']'", name, where)
                return
            if text[index] != ",":
                where = line_of(index)
                message = f"not valid JSON: expected ',' or ']' after an element at column {column_of(index)}"
                yield where, None, ScenarioError(message, name, where)
                return
            index += 1
            expect_element = True
            continue
        if first and text[index] == "]":
            return
        first = False
        start = line_of(index)
        try:
            obj, index = decoder.raw_decode(text, index)
        except json.JSONDecodeError as exc:
            yield exc.lineno, None, ScenarioError(_syntax(exc, exc.colno), name, exc.lineno)
            return
        except RecursionError:
            yield start, None, ScenarioError(_too_deep(text, index), name, start)
            return
        except ValueError as exc:
            end = text.find("\n", index)
            line = text[text.rfind("\n", 0, index) + 1 : end if end >= 0 else len(text)]
            yield start, None, ScenarioError(f"not usable JSON: {_long_number(line, exc)}", name, start)
            return
        yield start, obj, None
        expect_element = False


def _syntax(exc: json.JSONDecodeError, column: int) -> str:
    # Some of json's messages end in " at" ("Invalid control character at"); don't say it twice.
    reason = exc.msg[: -len(" at")] if exc.msg.endswith(" at") else exc.msg
    return f"not valid JSON: {reason} at column {column}"


def _too_deep(text: str, start: int) -> str:
    depth, column = _deepest_bracket(text, start)
    return f"not usable JSON: nested {depth} levels deep (deepest bracket at column {column})"


def _deepest_bracket(text: str, start: int = 0) -> tuple[int, int]:
    """``(depth, 1-based column on its line)`` of the most deeply nested bracket of the JSON value at ``start``,
    strings skipped."""
    depth = deepest = column = 0
    in_string = escaped = False
    line_start = text.rfind("\n", 0, start) + 1
    for index in range(start, len(text)):
        char = text[index]
        if in_string:
            if escaped:
                escaped = False
            elif char == "\\":
                escaped = True
            elif char == '"':
                in_string = False
        elif char == '"':
            in_string = True
        elif char == "\n":
            line_start = index + 1
        elif char in "[{":
            depth += 1
            if depth > deepest:
                deepest, column = depth, index - line_start + 1
        elif char in "]}":
            depth -= 1
            if depth == 0:
                break
    return deepest, column


def _long_number(text: str, error: ValueError) -> str:
    """Where the integer too long for Python's int conversion starts, or the error itself."""
    limit = sys.get_int_max_str_digits() if hasattr(sys, "get_int_max_str_digits") else 0
    match = re.search(rf"-?\d{{{limit + 1},}}", text) if limit else None
    if match is None:
        return f"{type(error).__name__}: {error}"
    digits = len(match.group().lstrip("-"))
    return f"an integer of {digits:,} digits at column {match.start() + 1} (Python reads at most {limit:,})"
