"""The README's reference tables, rendered from the code they describe, and the command that rewrites them.

Each table sits in the README between ``<!-- generated:NAME -->`` and ``<!-- /generated:NAME -->``:

- ``flags:serve``: every option of ``prefixcache serve``'s argparse parser, with its default and help;
- ``usage:COMMAND`` (``replay``, ``bench``, ``plan``): the command's usage synopsis, every option in it;
- ``endpoints``: every route of the server (method, path, one-line summary), read from a FastAPI app built over the
  ``tiny`` model, the summaries from that app's own ``/openapi.json``;
- ``fields:PATH``: the body fields a POST route validates, from the same document;
- ``metrics``: every metric family a ``GET /metrics`` scrape of that app names, with its type, labels and help;
- ``architectures``: the Hugging Face support table (:data:`prefixcache.models.architectures.ARCHITECTURES`).

``python -m prefixcache.cli.reference --write README.md`` rewrites the blocks in place; ``--check README.md`` exits 1
and names the blocks that differ.  Rendering builds the server (the ``server`` extra) over the embedded ``tiny``
model: about a second.
"""

from __future__ import annotations

import argparse
import re
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from prefixcache.errors import InvalidArgumentError

__all__ = ["REGENERATE", "flag_table", "main", "render_tables", "splice", "stale_blocks", "usage"]

REGENERATE = "python -m prefixcache.cli.reference --write README.md"
"""The command that brings the README's generated blocks up to date."""

_BLOCK = re.compile(r"<!-- generated:(?P<name>[\w:/.-]+) -->\n(?P<body>.*?)<!-- /generated:(?P=name) -->", re.S)
_USAGES = ("replay", "bench", "plan")


def _cell(text: str) -> str:
    return " ".join(str(text).split()).replace("|", "\\|")


def _default(action: argparse.Action) -> str:
    from prefixcache.cli.options import parse_size

    value = action.default
    if isinstance(action, argparse.BooleanOptionalAction):
        return "on" if value else "off"
    if value is None or value is False or value is argparse.SUPPRESS or value == []:
        return ""
    if action.type is parse_size and isinstance(value, int):
        for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
            if value % size == 0:
                return f"`{value // size}{unit}`"
    return f"`{value}`"


def _subparser(command: str) -> argparse.ArgumentParser:
    from prefixcache.cli import build_parser

    parser = build_parser()
    commands = next(action for action in parser._actions if action.dest == "command").choices
    if command not in commands:
        raise InvalidArgumentError(f"no command {command!r}; the commands are {sorted(commands)}")
    return commands[command]


def _invocation(formatter: argparse.HelpFormatter, action: argparse.Action) -> str:
    # A metavar argparse derives from the option's name (--served-model-name SERVED_MODEL_NAME) says nothing the
    # help does not; a declared one (PATH, BYTES) or the choices do.
    if not action.option_strings:
        return formatter._format_action_invocation(action) + (" ..." if action.nargs in ("*", "+") else "")
    if action.nargs == 0 or (action.metavar is None and action.choices is None):
        return ", ".join(action.option_strings)
    return formatter._format_action_invocation(action)


def flag_table(command: str) -> str:
    """The markdown table of ``prefixcache COMMAND``'s options: ``| flag | default | what it does |``, in the order
    the parser declares them (positional arguments first), ``-h`` and ``-v`` left out.

    Raises InvalidArgumentError for an unknown command."""
    sub = _subparser(command)
    formatter = sub._get_formatter()
    rows = ["| flag | default | what it does |", "|---|---|---|"]
    skipped = {"help", "verbose_after"}
    actions = [a for a in sub._actions if a.dest not in skipped]
    actions.sort(key=lambda action: bool(action.option_strings))  # positionals first, else as declared
    for action in actions:
        invocation = _invocation(formatter, action)
        what = formatter._expand_help(action) if action.help else ""
        if action.required and action.option_strings:
            what = f"required; {what}"
        rows.append(f"| `{_cell(invocation)}` | {_default(action)} | {_cell(what)} |")
    return "\n".join(rows)


def usage(command: str) -> str:
    """The usage synopsis of ``prefixcache COMMAND`` as argparse writes it, wrapped at 120 columns, in a ``text`` code
    fence.  Raises InvalidArgumentError for an unknown command."""
    sub = _subparser(command)
    formatter = argparse.HelpFormatter(sub.prog, width=120)
    formatter.add_usage(sub.usage, sub._actions, sub._mutually_exclusive_groups, prefix="")
    return "```text\n" + formatter.format_help().strip() + "\n```"


def _served_app() -> Any:
    from prefixcache.engine.runner import PrefixCachingRunner
    from prefixcache.models.llama import build_model
    from prefixcache.serve import create_app

    return create_app(PrefixCachingRunner(build_model("tiny", device="cpu"), cache_tokens=1024), model_name="tiny")


def _route_path(path: str) -> str:
    return re.sub(r"\{(\w+):\w+\}", r"{\1}", path)  # Starlette's "{model_id:path}" is OpenAPI's "{model_id}"


def _endpoint_table(app: Any, document: dict[str, Any]) -> str:
    rows = ["| method | path | what it does |", "|---|---|---|"]
    for route in app.routes:
        methods = sorted(set(getattr(route, "methods", None) or ()) - {"HEAD"})
        path = _route_path(getattr(route, "path", ""))
        for method in methods:
            operation = document["paths"].get(path, {}).get(method.lower(), {})
            summary = _summary(operation, document) or _sentence(getattr(route.endpoint, "__doc__", None) or "")
            rows.append(f"| {method} | `{path}` | {_cell(summary)} |")
    return "\n".join(rows)


def _summary(operation: dict[str, Any], document: dict[str, Any]) -> str:
    """A POST route's body docstrings (each body's first sentence, joined), else the operation's summary."""
    body = operation.get("requestBody", {}).get("content", {}).get("application/json", {}).get("schema")
    if body is None:
        return _sentence(operation.get("summary", ""))
    schemas = document["components"]["schemas"]
    names = [branch["$ref"].rsplit("/", 1)[1] for branch in body.get("anyOf", [body])]
    return "; ".join(_sentence(schemas[name].get("description", "")) for name in names)


def _sentence(doc: str) -> str:
    """The first sentence of a docstring, without the ````METHOD /path```` it opens with, in markdown's backticks."""
    text = " ".join(doc.split())
    text = re.sub(r"^``[A-Z]+ /[^`]*``:\s*", "", text)  # "``POST /v1/completions``: one prompt" -> "one prompt"
    text = re.sub(r"^``[A-Z]+ (/[^`]*``)", r"``\1", text).replace("``", "`")  # else the path stays, as the subject
    text = re.split(r"(?<=[.])\s", text, maxsplit=1)[0].removesuffix(".")
    return text[:1].upper() + text[1:]


def _body_fields(document: dict[str, Any]) -> dict[str, str]:
    schemas = document["components"]["schemas"]
    blocks = {}
    for path, operations in document["paths"].items():
        post = operations.get("post")
        if post is None:
            continue
        schema = post["requestBody"]["content"]["application/json"]["schema"]
        refs = [branch["$ref"] for branch in schema.get("anyOf", [schema])]
        fields: dict[str, str] = {}
        for ref in refs:
            for name, spec in schemas[ref.rsplit("/", 1)[1]]["properties"].items():
                fields.setdefault(name, spec.get("description", ""))
        names = ", ".join(f"`{name}`" for name in fields)
        notes = "; ".join(f"`{name}`: {_cell(note)}" for name, note in fields.items() if note)
        line = f"Fields (any other is a 400): {names}."
        blocks[f"fields:{path}"] = line + (f" Notes: {notes}." if notes else "")
    return blocks


def _metrics_table(scrape: str) -> str:
    """``| metric | type | labels | what it counts |`` from a scrape's text: each family's HELP and TYPE, the label
    names its samples carry (a histogram's ``le`` left out), and no ``_created`` series (prometheus_client's start
    times, one per counter)."""
    helps: dict[str, str] = {}
    kinds: dict[str, str] = {}
    labels: dict[str, list[str]] = {}
    for line in scrape.splitlines():
        if line.startswith("# HELP "):
            name, _, text = line[len("# HELP ") :].partition(" ")
            helps[name] = text.replace("\\\\", "\\").replace("\\n", " ")
        elif line.startswith("# TYPE "):
            name, _, kind = line[len("# TYPE ") :].partition(" ")
            kinds[name] = kind
        elif "{" in line and not line.startswith("#"):
            sample, _, rest = line.partition("{")
            family = next((name for name in helps if sample.startswith(name)), sample)
            for label in re.findall(r'(\w+)="', rest):
                if label != "le" and label not in labels.setdefault(family, []):
                    labels[family].append(label)
    rows = ["| metric | type | labels | what it counts |", "|---|---|---|---|"]
    for name, text in helps.items():
        if not name.endswith("_created"):
            named = ", ".join(f"`{label}`" for label in labels.get(name, []))
            rows.append(f"| `{name}` | {kinds.get(name, '')} | {named} | {_cell(text)} |")
    return "\n".join(rows)


def _architectures_table() -> str:
    from prefixcache.models.architectures import ARCHITECTURES, LAYER_KINDS

    rows = ["| layers | architectures (`model_type`) | the pool holds per token | also kept |", "|---|---|---|---|"]
    for key, kind in LAYER_KINDS.items():
        names = ", ".join(
            f"{a.name} (`{a.model_type}`{'; ' + a.note if a.note else ''})" for a in ARCHITECTURES if a.kind == key
        )
        rows.append(f"| {kind.title} | {names} | {_cell(kind.pool_holds)} | {_cell(kind.also_kept)} |")
    return "\n".join(rows)


def render_tables() -> dict[str, str]:
    """Every generated block's text, by name (``flags:serve``, ``usage:replay``, ``endpoints``,
    ``fields:/v1/completions``, ``metrics``, ``architectures``, ...), each without a trailing newline.  Builds the
    server over the ``tiny`` model on the CPU, answers one request and scrapes it once (about a second).  Raises
    ImportError without the ``server`` extra."""
    from fastapi.testclient import TestClient

    tables = {"flags:serve": flag_table("serve")}
    tables.update({f"usage:{command}": usage(command) for command in _USAGES})
    app = _served_app()
    try:
        with TestClient(app) as client:  # the lifespan starts the engine, whose figures /metrics reads
            document = client.get("/openapi.json").json()
            # One answered request, so that the labelled counters have a sample that names their labels.
            client.post("/v1/completions", json={"model": "tiny", "prompt": [1, 2, 3], "max_tokens": 1})
            scrape = client.get("/metrics").text
    finally:
        app.state.engine.close()
    tables["endpoints"] = _endpoint_table(app, document)
    tables.update(_body_fields(document))
    tables["metrics"] = _metrics_table(scrape)
    tables["architectures"] = _architectures_table()
    return tables


def splice(text: str, tables: dict[str, str]) -> str:
    """``text`` with each ``<!-- generated:NAME -->`` block's body replaced by ``tables[NAME]``.

    Raises InvalidArgumentError naming a block ``tables`` has no entry for, or an entry no block holds."""
    found = [match.group("name") for match in _BLOCK.finditer(text)]
    unknown = sorted(set(found) - set(tables))
    missing = sorted(set(tables) - set(found))
    if unknown or missing:
        raise InvalidArgumentError(
            f"generated blocks out of step with the code: unknown {unknown or 'none'}, missing {missing or 'none'}"
        )
    return _BLOCK.sub(
        lambda m: f"<!-- generated:{m['name']} -->\n{tables[m['name']]}\n<!-- /generated:{m['name']} -->", text
    )


def stale_blocks(text: str, tables: dict[str, str]) -> list[str]:
    """The names of the blocks of ``text`` whose body differs from ``tables`` (all of them when a block is missing or
    unknown, since :func:`splice` refuses such a text)."""
    try:
        splice(text, tables)
    except InvalidArgumentError:
        return sorted(set(tables) | {m["name"] for m in _BLOCK.finditer(text)})
    return [m["name"] for m in _BLOCK.finditer(text) if m["body"] != tables[m["name"]] + "\n"]


def main(argv: Sequence[str] | None = None) -> int:
    """``--write PATH`` rewrites PATH's generated blocks (0); ``--check PATH`` prints the stale ones and returns 1 when
    there are any, else 0; 2 for a file whose blocks do not match the tables' names."""
    parser = argparse.ArgumentParser(prog="python -m prefixcache.cli.reference", description=__doc__.split("\n")[0])
    action = parser.add_mutually_exclusive_group(required=True)
    action.add_argument("--write", metavar="PATH", type=Path, help="rewrite the generated blocks of PATH")
    action.add_argument("--check", metavar="PATH", type=Path, help="exit 1 if any generated block of PATH is stale")
    args = parser.parse_args(argv)
    path = args.write or args.check
    text = path.read_text(encoding="utf-8")
    tables = render_tables()
    try:
        updated = splice(text, tables)
    except InvalidArgumentError as error:
        print(f"error: {path}: {error}", file=sys.stderr)
        return 2
    if args.write:
        if updated != text:
            path.write_text(updated, encoding="utf-8")
        return 0
    stale = stale_blocks(text, tables)
    if stale:
        print(f"{path}: stale generated blocks: {', '.join(stale)}; run: {REGENERATE}", file=sys.stderr)
    return 1 if stale else 0


if __name__ == "__main__":
    sys.exit(main())
