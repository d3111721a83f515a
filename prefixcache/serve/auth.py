"""API keys and the cache namespace each one owns.

The namespace (cache salt) of a request comes from the key that authenticated it and from nothing in the request
body, so one tenant can never read another's cached prefixes by naming them (the timing side channel of shared
prefix caches described in "I Know What You Asked", NDSS 2025, and the reason vLLM added ``cache_salt``).

Keys file: one key per line, optionally followed by whitespace and the namespace it maps to; blank lines and lines
starting with ``#`` are ignored.  A key without a namespace gets ``key-<xxh64 of the key>``, so the key itself never
appears in the cache, its stats or its logs.
"""

from __future__ import annotations

import hmac
import os
from dataclasses import dataclass
from pathlib import Path

import xxhash

from prefixcache.errors import InvalidArgumentError

__all__ = ["ApiKeys", "Unauthorized"]


class Unauthorized(Exception):
    """The request carried no key, or a key that is not in the file (HTTP 401)."""


@dataclass(frozen=True, slots=True)
class ApiKeys:
    """Key -> namespace.  An empty mapping means the server is open: every request shares namespace ``None``."""

    namespaces: dict[str, str]

    @classmethod
    def open(cls) -> ApiKeys:
        return cls({})

    @classmethod
    def from_file(cls, path: str | os.PathLike[str]) -> ApiKeys:
        """Read a keys file (format in the module docstring).

        Raises :class:`InvalidArgumentError` if the file cannot be read, holds no key, a line has more than two
        fields, or a key appears twice.
        """
        try:
            text = Path(path).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as error:
            raise InvalidArgumentError(f"cannot read API keys from {str(path)!r}: {error}") from None
        namespaces: dict[str, str] = {}
        for line_no, line in enumerate(text.splitlines(), start=1):
            fields = line.split()
            if not fields or fields[0].startswith("#"):
                continue
            if len(fields) > 2:
                raise InvalidArgumentError(f"{path}:{line_no}: expected 'KEY [NAMESPACE]', got {len(fields)} fields")
            key = fields[0]
            if key in namespaces:
                raise InvalidArgumentError(f"{path}:{line_no}: duplicate API key")
            namespaces[key] = fields[1] if len(fields) == 2 else "key-" + xxhash.xxh64(key.encode()).hexdigest()
        if not namespaces:
            raise InvalidArgumentError(f"{path}: no API key in the file")
        return cls(namespaces)

    @property
    def required(self) -> bool:
        return bool(self.namespaces)

    def namespace_for(self, authorization: str | None) -> str | None:
        """The namespace of the ``Authorization: Bearer <key>`` header value.

        Keys are compared in constant time, as UTF-8 bytes: HTTP servers hand header values over decoded as Latin-1
        (ASGI's rule), so such a value is turned back into the bytes the client sent, and a key with non-ASCII
        characters from the keys file matches the same key sent in UTF-8.  Raises :class:`Unauthorized` when keys are
        configured and the header is missing, malformed or names an unknown key; returns ``None`` when the server is
        open.
        """
        if not self.namespaces:
            return None
        scheme, _, key = (authorization or "").partition(" ")
        key = key.strip(" \t")  # HTTP's whitespace only: "\xa0" may be half of a UTF-8 character decoded as Latin-1
        if scheme.lower() != "bearer" or not key:
            raise Unauthorized("missing API key: send 'Authorization: Bearer <key>'")
        sent = _key_bytes(key)
        found = None
        for known, namespace in self.namespaces.items():
            known_bytes = known.encode("utf-8", "surrogatepass")
            if hmac.compare_digest(known_bytes, sent):
                found = namespace
        if found is None:
            raise Unauthorized("invalid API key")
        return found


def _key_bytes(key: str) -> bytes:
    """The bytes the client sent as ``key``: a header value comes decoded as Latin-1, so encoding it back gives them
    (a value with characters past U+00FF was not decoded that way: its UTF-8)."""
    try:
        return key.encode("latin-1")
    except UnicodeEncodeError:
        return key.encode("utf-8", "surrogatepass")
