"""Grammars that constrain decoding: JSON Schema, any JSON object, a tool call; one per request, per-token masks.

A :class:`Grammar` is a compiled constraint bound to a tokenizer; ``SamplingParams(grammar=...)`` asks a request to
follow it.  The request's :class:`~prefixcache.engine.logits.LogitsPipeline` makes a :class:`GrammarState` at its first
admission and keeps it, like the rest of the picker, across preemptions: a resumed request recomputes the tokens it
knows and only then picks anew, so each token advances the state exactly once.  Before every pick the row is masked to
the ids the grammar allows there (ids beyond the tokenizer's vocabulary never are); the request's stop tokens are
allowed only where the grammar may end; once the grammar is complete (nothing more may follow) the request ends with
one of them (finish reason ``"stop"``; at once where it has none).  The cache never sees any of this: a constrained
request's tokens are cached as any others.

The engine is llguidance (Microsoft's Rust "low-level guidance", the structured-output backend of vLLM, SGLang,
llama.cpp and Guidance): no torch dependency, masks computed lazily over a token trie (tens of microseconds per token
for a JSON schema), and the widest JSON Schema coverage of the maintained engines.  It is an optional dependency (the
``structured`` extra), imported on first use.

JSON is generated with ``json.dumps``'s default separators (``", "`` and ``": "``) and no other whitespace: what the
chat templates write when they render arguments back, so a tool call's tokens are the next turn's prompt, and a random
model cannot spend its budget on whitespace.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Collection, Mapping, Sequence
from typing import Any

import torch

from prefixcache.chat.tool_calls import TOOL_CALL_CLOSE, TOOL_CALL_OPEN
from prefixcache.errors import InvalidArgumentError, InvalidTokensError, install_command

__all__ = [
    "Grammar",
    "GrammarState",
    "check_json_schema",
    "check_response_format",
    "llguidance_tokenizer",
    "require_structured",
    "strict_tools",
    "structured_available",
    "tool_call_grammar",
    "tool_calls_grammar",
]

_JSON_OPTIONS = {"item_separator": ", ", "key_separator": ": ", "whitespace_flexible": False}
_TOKENIZERS: dict[str, Any] = {}
_TOKENIZERS_LOCK = threading.Lock()


def _llguidance() -> Any:
    try:
        import llguidance
    except ImportError:  # pragma: no cover - the structured extra is installed wherever tests run
        raise InvalidArgumentError(
            f"structured outputs need the llguidance package: {install_command('structured')}"
        ) from None
    return llguidance


def _validated(source: str, what: str, tokenizer: Any = None) -> str:
    error = _llguidance().LLMatcher.validate_grammar(source, tokenizer)
    if error:
        raise InvalidArgumentError(f"{what}: {error}")
    return source


def check_json_schema(schema: Any, what: str = "json_schema", *, lenient: bool = False) -> str:
    """The llguidance grammar (JSON text) of JSON ``schema`` (a mapping; True: any JSON value).  No
    tokenizer needed: the server checks a request with it before anything runs.  Raises InvalidArgumentError naming
    ``what`` for a schema that is not an object or that llguidance cannot compile (an unknown type, a bad ``$ref``,
    an unsupported keyword, unless ``lenient``: then such keywords are ignored)."""
    if schema is True:
        schema = {}
    if not isinstance(schema, Mapping):
        raise InvalidArgumentError(f"{what} must be a JSON Schema object, got {schema!r:.40}")
    options = {**_JSON_OPTIONS, "lenient": lenient}
    try:
        source = _llguidance().LLMatcher.grammar_from_json_schema(json.dumps(schema), defaults=options)
    except (TypeError, ValueError) as error:
        raise InvalidArgumentError(f"{what}: {error}") from None
    return _validated(source, what)


def check_response_format(response_format: Any) -> tuple[str, str] | None:
    """OpenAI's ``response_format`` as ``(kind, llguidance grammar)``; None for ``{"type": "text"}`` or None.  Takes
    ``{"type": "json_object"}`` and ``{"type": "json_schema", "json_schema": {"name": str, "schema": {...}, "strict":
    bool}}`` (``name`` required, as OpenAI; ``schema`` absent: any JSON value).  Raises InvalidArgumentError naming the
    part that is wrong."""
    if response_format is None:
        return None
    if not isinstance(response_format, Mapping):
        raise InvalidArgumentError("response_format must be an object with a 'type'")
    kind = response_format.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return kind, check_json_schema({"type": "object"}, "response_format")
    if kind != "json_schema":
        raise InvalidArgumentError(f"response_format.type must be 'text', 'json_object' or 'json_schema', got {kind!r}")
    spec = response_format.get("json_schema")
    if not isinstance(spec, Mapping):
        raise InvalidArgumentError("response_format.json_schema must be an object with 'name' and 'schema'")
    if not isinstance(spec.get("name"), str) or not spec["name"]:
        raise InvalidArgumentError("response_format.json_schema.name must be a non-empty string")
    if not isinstance(spec.get("strict", False), bool) and spec.get("strict") is not None:
        raise InvalidArgumentError("response_format.json_schema.strict must be a bool")
    schema = spec.get("schema", True)
    if spec.get("strict") is True:
        # OpenAI refuses a strict schema with an open object; here it is closed (as a tool call's arguments), so a
        # small model cannot write keys without end.
        schema = closed_objects(schema)
    return kind, check_json_schema(schema, "response_format.json_schema.schema")


def require_structured(tokenizer: Any, what: str) -> None:
    """Refuse ``what`` (the request's field that needs a grammar, as the message should name it) unless llguidance is
    installed and reads ``tokenizer``.  O(1) once the tokenizer's llguidance copy is made (about a second for an HF
    tokenizer, the first time).

    Raises InvalidArgumentError ``"{what}: structured outputs need the llguidance package: pip install ..."``
    (:func:`~prefixcache.errors.install_command`), or naming the tokenizer llguidance cannot read (a slow,
    sentencepiece-only one).
    """
    try:
        _llguidance()
        llguidance_tokenizer(tokenizer)
    except InvalidArgumentError as error:
        raise InvalidArgumentError(f"{what}: {error}") from None


def structured_available(tokenizer: Any) -> bool:
    """llguidance is installed and reads ``tokenizer`` (:func:`require_structured` would pass): a strict tool's call
    under ``tool_choice: "auto"`` is then constrained to its schema (else it is parsed as the model writes it)."""
    try:
        require_structured(tokenizer, "structured outputs")
    except InvalidArgumentError:
        return False
    return True


def tool_call_grammar(tools: Sequence[Mapping[str, Any]], name: str | None, close_id: int | None = None) -> str:
    """The llguidance grammar of what follows the prefix :func:`~prefixcache.engine.tool_choice.check_tool_choice`
    forces: for a named function, `` {arguments}}\\n</tool_call>``; else (``"required"``) one of the tools' names, then
    ``", "arguments": {arguments}}\\n</tool_call>``; the arguments valid against that function's ``parameters``
    (absent: any object; objects without other keys where the schema does not say: :func:`closed_objects`; keywords
    llguidance does not implement are ignored, as a forced call worked before they
    were checked).  ``close_id`` is the id of ``</tool_call>`` where the tokenizer has it as one added token (Qwen's):
    the grammar then ends on that token, the one the template renders (spelled as text, pieces would be allowed too,
    and the next turn's rendering would not repeat them).  Raises InvalidArgumentError naming the tool whose parameters
    do not compile."""
    rules, choices = _call_rules(tools, name, strict_only=False)
    lark = "start: (" + " | ".join(choices) + ") " + _close(close_id) + "\n" + "\n".join(rules) + "\n"
    return _validated(_llguidance().LLMatcher.grammar_from_lark(lark), "tools")


def strict_tools(tools: Sequence[Mapping[str, Any]] | None) -> bool:
    """Some function of ``tools`` says ``"strict": true`` (OpenAI's: its calls follow its ``parameters`` exactly)."""
    return any(tool.get("function", tool).get("strict") is True for tool in tools or ())


def tool_calls_grammar(tools: Sequence[Mapping[str, Any]], close_id: int | None = None) -> str:
    """The llguidance grammar of a free answer (``tool_choice`` ``"auto"``) whose tool calls are constrained: any text,
    until it writes ``<tool_call>``; from there (a lazy trigger: llguidance masks nothing before it) the rest of a
    call as the template renders it, ``\\n{"name": "NAME", "arguments": {arguments}}\\n</tool_call>``, NAME one of the
    tools', the arguments valid against that function's ``parameters`` where it is ``strict`` (any JSON object
    where it is not: such a call still parses); then, as :func:`~prefixcache.chat.tool_calls.parse_tool_calls` reads
    calls, only whitespace and more calls.  The text is valid UTF-8 (a byte tokenizer's stray bytes are refused); the
    stop tokens are allowed before the first call and after each one.  ``close_id`` as in :func:`tool_call_grammar`.
    Raises InvalidArgumentError naming the tool whose parameters do not compile."""
    rules, choices = _call_rules(tools, None, strict_only=True)
    opening, head = _lark_literal(TOOL_CALL_OPEN), _lark_literal('\n{"name": "')
    lark = (
        "%llguidance {}\n"
        "start: TEXT | first call (NEXT call)* SPACE\n"
        f"first[lazy]: TEXT {opening}\n"
        f"call: {head} (" + " | ".join(choices) + f") {_close(close_id)}\n"
        "TEXT: /(.|\\n)*/\n"
        f"NEXT: /[ \\t\\r\\n]*/ {opening}\n"
        "SPACE: /[ \\t\\r\\n]*/\n" + "\n".join(rules) + "\n"
    )
    return _validated(_llguidance().LLMatcher.grammar_from_lark(lark), "tools")


def _call_rules(
    tools: Sequence[Mapping[str, Any]], name: str | None, *, strict_only: bool
) -> tuple[list[str], list[str]]:
    """The Lark rules of the tools' arguments and the choices of name and arguments (see :func:`tool_call_grammar`);
    ``strict_only``: a function that is not ``strict`` takes any object."""
    rules, choices = [], []
    for index, tool in enumerate(tools):
        function = tool.get("function", tool)
        tool_name = function.get("name")
        if name is not None and tool_name != name:
            continue
        parameters = function.get("parameters") or {"type": "object"}
        check_json_schema(parameters, f"tools[{index}].function.parameters", lenient=True)
        parameters = parameters if isinstance(parameters, Mapping) else {}
        if strict_only and function.get("strict") is not True:
            parameters = {"type": "object"}
        parameters = closed_objects(parameters)
        # %json in a Lark grammar takes the compiler's options from the schema's own "x-guidance" key.
        options = {**_JSON_OPTIONS, "lenient": True}
        rules.append(f"args{index}: %json {json.dumps({**parameters, 'x-guidance': options})}")
        # The forced prefix of "required" ends inside the name's string: the rest of the name as JSON writes it.
        head = "" if name is not None else json.dumps(tool_name, ensure_ascii=False)[1:] + ', "arguments":'
        choices.append(f"{_lark_literal(head + ' ')} args{index}")
    return rules, choices


_SUBSCHEMA_MAPS = ("properties", "patternProperties")
_SUBSCHEMA_LISTS = ("anyOf", "oneOf", "prefixItems")
_SUBSCHEMAS = ("items", "additionalItems", "contains")
_COMPOSING = ("allOf", "$ref", "not", "if", "then", "else", "dependentSchemas", "unevaluatedProperties")
"""Keywords that make an object's keys the union of several schemas' (or that negate one): such an object, and
what it composes, stays as given, since closing each part apart would refuse the keys of the others."""


def closed_objects(schema: Any) -> Any:
    """A copy of the JSON Schema ``schema`` in which every object schema that names its ``properties`` and says
    nothing of ``additionalProperties`` takes no other keys (``"additionalProperties": false``); other schemas as
    given.  O(schema size).

    Why: a tool call's arguments are what the function declares.  Left open, a schema lets a constrained model add
    keys without end (a 135M model asked for ``{"city": ...}`` went on writing invented keys until ``max_tokens``,
    so no call parsed); closed, the call ends once the declared keys are written, and still validates against the
    schema as given.  OpenAI's strict mode asks every object to say ``false``; this makes it the default for calls
    and for a ``strict`` ``json_schema``.  An object composed with ``allOf``, ``$ref``, ``not``, ``if`` or
    ``dependentSchemas`` is left open with everything under it (closing the parts apart would refuse each other's
    keys), and so are ``$defs`` entries (a ``$ref`` beside other ``properties`` extends one).  O(schema size)."""
    if isinstance(schema, list):
        return [closed_objects(item) for item in schema]
    if not isinstance(schema, Mapping):
        return schema
    out = dict(schema)
    if any(key in out for key in _COMPOSING):
        return out
    for key in _SUBSCHEMA_MAPS:
        if isinstance(out.get(key), Mapping):
            out[key] = {name: closed_objects(sub) for name, sub in out[key].items()}
    for key in (*_SUBSCHEMA_LISTS, *_SUBSCHEMAS):
        if key in out:
            out[key] = closed_objects(out[key])
    if isinstance(out.get("properties"), Mapping) and "additionalProperties" not in out:
        out["additionalProperties"] = False
    return out


def _close(close_id: int | None) -> str:
    return _lark_literal("}\n" + TOOL_CALL_CLOSE) if close_id is None else f'"}}\\n" <[{close_id}]>'


def _lark_literal(text: str) -> str:
    return json.dumps(text, ensure_ascii=False)


def llguidance_tokenizer(tokenizer: Any) -> Any:
    """llguidance's ``LLTokenizer`` for a prefixcache tokenizer, made once per tokenizer ``name`` (an HF tokenizer's
    takes about a second).  The byte tokenizer's ids are its 256 bytes and its specials; an
    :class:`~prefixcache.chat.hf_tokenizer.HFTokenizer` goes through llguidance's reader of HF fast tokenizers.  Raises
    InvalidArgumentError for any other kind (a slow, sentencepiece-only tokenizer)."""
    key = tokenizer.name
    with _TOKENIZERS_LOCK:
        made = _TOKENIZERS.get(key)
        if made is None:
            made = _TOKENIZERS[key] = _make_tokenizer(tokenizer)
    return made


class _ByteTokens:
    """What llguidance's ``TokenizerWrapper`` reads of a byte-level tokenizer."""

    def __init__(self, tokenizer: Any) -> None:
        from prefixcache.chat.tokenizer import BYTE_SPECIAL_TOKENS

        specials = sorted(BYTE_SPECIAL_TOKENS.items(), key=lambda item: item[1])
        self.tokens = [bytes([i]) for i in range(256)] + [spelled.encode() for spelled, _ in specials]
        self.special_token_ids = [token_id for _, token_id in specials]
        self.eos_token_id = min(tokenizer.eos_token_ids)
        self.bos_token_id = None

    def __call__(self, text: bytes | str) -> list[int]:
        return list(text if isinstance(text, bytes) else text.encode("utf-8"))


class _ByteLevelTokens:
    """A byte-level BPE tokenizer (GPT-2's, Qwen's, Llama 3's) as llguidance's ``TokenizerWrapper`` reads it: every
    id's bytes, and as special only the tokenizer's special tokens.  llguidance's own reader makes every added token
    special, and a special token is never text: Qwen's ``<tool_call>`` (added, not special) inside a JSON string, as
    its tokenizer encodes that text, would be refused."""

    def __init__(self, hf: Any, eos: Sequence[int]) -> None:
        from prefixcache.chat.hf_tokenizer import BYTE_LEVEL_ALPHABET as shown

        added = hf.added_tokens_decoder
        special = set(hf.all_special_ids)
        self.tokens: list[bytes] = []
        for token_id, piece in enumerate(hf.convert_ids_to_tokens(list(range(len(hf))))):
            if token_id in added:
                self.tokens.append(added[token_id].content.encode("utf-8"))
            else:
                self.tokens.append(bytes(shown[c] for c in piece) if all(c in shown for c in piece) else b"")
        self.special_token_ids = sorted(special | set(eos))
        self.eos_token_id = eos[0] if eos else None
        self.bos_token_id = None
        self._hf = hf

    def __call__(self, text: bytes | str) -> list[int]:
        text = text.decode("utf-8", errors="replace") if isinstance(text, bytes) else text
        return self._hf.encode(text, add_special_tokens=False)


def _make_tokenizer(tokenizer: Any) -> Any:
    from prefixcache.chat.tokenizer import ByteTokenizer

    llg = _llguidance()
    eos = sorted(tokenizer.eos_token_ids)
    if isinstance(tokenizer, ByteTokenizer):
        return llg.LLTokenizer(llg.TokenizerWrapper(_ByteTokens(tokenizer)), eos_token=eos)
    hf = getattr(tokenizer, "tokenizer", None)
    if hf is not None and getattr(hf, "is_fast", False):
        if json.loads(hf.backend_tokenizer.to_str()).get("decoder", {}).get("type") == "ByteLevel":
            return llg.LLTokenizer(llg.TokenizerWrapper(_ByteLevelTokens(hf, eos)), eos_token=eos)
        from llguidance.hf import from_tokenizer

        return from_tokenizer(hf, n_vocab=tokenizer.vocab_size, eos_token=eos or None)
    raise InvalidArgumentError(f"structured outputs need a byte or a Hugging Face fast tokenizer, not {tokenizer!r}")


class Grammar:
    """A compiled constraint (llguidance grammar ``source``, JSON text) for the ids of ``tokenizer``.  Immutable;
    equal when source and tokenizer name are (so ``SamplingParams`` stays comparable and hashable).  Make one with
    :meth:`json_schema`, :meth:`json_object` or :meth:`tool_call`."""

    __slots__ = ("kind", "source", "tokenizer_name", "vocab")

    def __init__(self, source: str, tokenizer: Any, kind: str = "grammar") -> None:
        self.vocab = llguidance_tokenizer(tokenizer)
        self.source = _validated(source, kind, self.vocab)
        self.tokenizer_name = tokenizer.name
        self.kind = kind

    @classmethod
    def json_schema(cls, schema: Any, tokenizer: Any) -> Grammar:
        """JSON valid against ``schema``.  Raises InvalidArgumentError for a schema llguidance cannot compile."""
        return cls(check_json_schema(schema), tokenizer, "json_schema")

    @classmethod
    def json_object(cls, tokenizer: Any) -> Grammar:
        """Any JSON object (OpenAI's ``response_format: {"type": "json_object"}``)."""
        return cls(check_json_schema({"type": "object"}, "json_object"), tokenizer, "json_object")

    @classmethod
    def tool_call(cls, tools: Sequence[Mapping[str, Any]], name: str | None, tokenizer: Any) -> Grammar:
        """The rest of a forced tool call (:func:`tool_call_grammar`)."""
        return cls(tool_call_grammar(tools, name, _close_id(tokenizer)), tokenizer, "tool_call")

    @classmethod
    def tool_calls(cls, tools: Sequence[Mapping[str, Any]], tokenizer: Any) -> Grammar:
        """A free answer whose tool calls follow their functions' schemas where ``strict`` (:func:`tool_calls_grammar`):
        ``tool_choice`` ``"auto"`` with strict tools."""
        return cls(tool_calls_grammar(tools, _close_id(tokenizer)), tokenizer, "tool_calls")

    def start(self) -> GrammarState:
        """A fresh matcher at the grammar's start.  O(grammar size) to build its parser."""
        return GrammarState(self)

    def __reduce__(self) -> tuple[Any, ...]:
        # Pickled as its source: the llguidance tokenizer does not pickle, and the process that unpickles it (an
        # engine process) rebuilds it from its own tokenizer of the same name (register_tokenizer).
        return _registered_grammar, (self.source, self.kind, self.tokenizer_name)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Grammar):
            return NotImplemented
        return (self.source, self.tokenizer_name) == (other.source, other.tokenizer_name)

    def __hash__(self) -> int:
        return hash((self.source, self.tokenizer_name))

    def __repr__(self) -> str:
        return f"Grammar({self.kind}, {len(self.source)} chars, tokenizer={self.tokenizer_name!r})"


_REGISTERED: dict[str, Any] = {}
"""Tokenizers by name that grammars unpickled in this process are for (:func:`register_tokenizer`)."""


def register_tokenizer(tokenizer: Any) -> None:
    """Let grammars for ``tokenizer`` (by its ``name``) be unpickled in this process: an engine process registers its
    runner's tokenizer, so a request's grammar crosses the pipe as its source.  O(1): the llguidance tokenizer is made
    on the first grammar."""
    _REGISTERED[tokenizer.name] = tokenizer


def _registered_grammar(source: str, kind: str, tokenizer_name: str) -> Grammar:
    tokenizer = _REGISTERED.get(tokenizer_name)
    if tokenizer is None:
        raise InvalidArgumentError(
            f"a grammar for tokenizer {tokenizer_name!r} reached a process without that tokenizer"
        )
    grammar = Grammar.__new__(Grammar)
    grammar.vocab = llguidance_tokenizer(tokenizer)
    grammar.source = source  # validated where it was made
    grammar.tokenizer_name = tokenizer_name
    grammar.kind = kind
    return grammar


def _close_id(tokenizer: Any) -> int | None:
    try:
        return tokenizer.special_token_id(TOOL_CALL_CLOSE)
    except InvalidArgumentError:
        return None


class GrammarState:
    """One request's position in its grammar: the ids allowed next, tokens accepted one by one.  Not thread-safe."""

    __slots__ = ("_eos_ids", "_matcher", "vocab_size")

    def __init__(self, grammar: Grammar) -> None:
        self._matcher = _llguidance().LLMatcher(grammar.vocab, grammar.source)
        self._eos_ids = tuple(grammar.vocab.eos_tokens)
        self.vocab_size: int = grammar.vocab.vocab_size
        """The ids the tokenizer knows, ``[0, vocab_size)``: the width of the mask."""
        self._check()

    @property
    def accepting(self) -> bool:
        """The text so far is a complete sentence of the grammar (the request may stop here)."""
        return self._matcher.is_accepting()

    @property
    def done(self) -> bool:
        """Nothing more of the grammar may follow: only a stop token, or the request ends here."""
        return self._matcher.is_stopped()

    def allowed(self, width: int, stop_ids: Collection[int], device: torch.device) -> torch.Tensor:
        """``[width]`` bool: the ids the grammar allows next, ids at or above the tokenizer's vocabulary never, the
        request's ``stop_ids`` exactly when the text may end here (llguidance's own end-of-sequence ids no further).
        O(vocab) (the matcher computes the mask lazily over its token trie; one byte per id is copied).  Raises
        InvalidTokensError where nothing is allowed (a complete grammar and no stop token: the request has ended)."""
        bias = torch.frombuffer(bytearray(self._matcher.compute_logit_bias()), dtype=torch.uint8)
        allowed = torch.zeros(width, dtype=torch.bool)
        known = min(width, bias.shape[0])
        allowed[:known] = bias[:known] != 0
        ends = self.accepting
        for token_id in self._eos_ids:
            if token_id < width:
                allowed[token_id] = False
        for token_id in stop_ids:
            if token_id < width:
                allowed[token_id] = ends
        if not allowed.any():  # on the host, before the copy: no sync with the device
            raise InvalidTokensError(f"the grammar allows no token here: {self._matcher.get_error() or 'complete'}")
        return allowed.to(device, non_blocking=True)

    def accept(self, token_id: int, stop_ids: Collection[int]) -> None:
        """Advance past ``token_id``, the token just picked; a stop token where the text may end changes nothing (the
        request ends on it).  Raises InvalidTokensError for a token the grammar refuses (a caller that picked outside
        :meth:`allowed`)."""
        if token_id in stop_ids and self.accepting:
            return
        if not self._matcher.consume_token(token_id):
            raise InvalidTokensError(f"token {token_id} does not follow the grammar: {self._matcher.get_error()}")

    def valid_prefix(self, token_ids: Sequence[int]) -> int:
        """How many of ``token_ids`` (a speculative draft) the grammar accepts in a row from here, without advancing.
        O(len(token_ids)) matcher steps (llguidance's ``validate_tokens``)."""
        return int(self._matcher.validate_tokens(list(token_ids))) if token_ids else 0

    def _check(self) -> None:
        if self._matcher.is_error():
            raise InvalidArgumentError(f"grammar: {self._matcher.get_error()}")
