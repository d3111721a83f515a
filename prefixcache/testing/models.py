"""Stand-in models for tests: :class:`ScriptedModel`, whose greedy output follows a script (a tool call, then an
answer...) while it reads its context back from the pool, so that an agent loop runs deterministically on real cached
K/V; :class:`ShiftedLogits`, whose cached-path logits are off by a constant, so that verification must fail.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import xxhash

from prefixcache.chat.tokenizer import ByteTokenizer, Tokenizer
from prefixcache.models.base import CausalLM, LiveKV, check_cached_call, check_logits_from, check_reference_call

__all__ = ["ScriptedModel", "ShiftedLogits"]


class ShiftedLogits:
    """A model whose cached-path logits are all shifted by ``shift``: greedy tokens agree with the reference, logits
    do not, so ``--verify`` must fail (for tests of verification)."""

    def __init__(self, model: CausalLM, shift: float = 0.01) -> None:
        self.model = model
        self.shift = shift
        for name in ("num_layers", "num_kv_heads", "head_dim", "vocab_size", "max_position", "dtype", "device"):
            setattr(self, name, getattr(model, name))

    def fingerprint(self) -> str:
        return self.model.fingerprint()

    def weights_version(self) -> int | None:
        read = getattr(self.model, "weights_version", None)
        return None if read is None else read()

    def forward_cached(self, *args: Any, **options: Any) -> torch.Tensor:
        return self.model.forward_cached(*args, **options) + self.shift

    def forward_reference(self, token_ids: torch.Tensor, **options: Any) -> torch.Tensor:
        return self.model.forward_reference(token_ids, **options)


class ScriptedModel:
    """A :class:`CausalLM` whose greedy output is a script: answer ``k`` of a conversation is ``script[k]``.

    The K/V it writes are the token ids and positions themselves (``K[..., 0] = V[..., 0] = token id``, ``K[..., 1] =
    position``; one layer, one KV head, ``head_dim`` 2, float32, CPU), and every forward reads the whole context back
    from the pool through the block table.  So its output depends on the cache being right: a block holding the wrong
    tokens changes the context, and the script goes off course (a position that does not match raises
    ``RuntimeError``).  The turn number ``k`` is the number of ``turn_marker`` sequences (the generation prompt,
    ``<|im_start|>assistant\\n``) in the context minus one; within a turn, while the tokens after the marker follow
    ``script[k]``, the next token is the next one of the script, and otherwise (past the script, or off it)
    ``end_token_id``.  The chosen token gets logit 50, every other 0, so sampling picks it too; ``runner_up_ids``,
    when given, get 49, 48, ... in that order (the chosen one among them keeps 50), so a request's top logprobs name
    them after the chosen token.

    Use :meth:`from_texts` for a script written as text.  ``forward_cached`` costs O(context length) per call.
    """

    num_layers = 1
    num_kv_heads = 1
    head_dim = 2
    dtype = torch.float32
    device = torch.device("cpu")

    def __init__(
        self,
        script: Sequence[Sequence[int]],
        *,
        turn_marker: Sequence[int],
        end_token_id: int,
        vocab_size: int,
        max_position: int = 1 << 16,
        runner_up_ids: Sequence[int] = (),
    ) -> None:
        self.script = [list(map(int, answer)) for answer in script]
        self.runner_up_ids = [int(t) for t in runner_up_ids]
        self.turn_marker = [int(t) for t in turn_marker]
        if not self.turn_marker:
            raise ValueError("turn_marker must not be empty")
        self.end_token_id = int(end_token_id)
        self.vocab_size = int(vocab_size)
        self.max_position = int(max_position)
        shape = (self.script, self.turn_marker, self.end_token_id, self.runner_up_ids)
        self._fingerprint = xxhash.xxh64(repr(shape if self.runner_up_ids else shape[:3]).encode()).hexdigest()

    @classmethod
    def from_texts(cls, texts: Sequence[str], tokenizer: Tokenizer | None = None) -> ScriptedModel:
        """A script of ``texts`` (each answer ends with ``<|im_end|>``) for a ChatML ``tokenizer`` (default bytes).

        Answers are encoded as plain text, which is what the byte tokenizer's template renders back; a BPE tokenizer
        with added tokens such as ``<tool_call>`` would render those as single ids instead.
        """
        tokenizer = tokenizer if tokenizer is not None else ByteTokenizer()
        end = tokenizer.special_token_id("<|im_end|>")
        marker = [tokenizer.special_token_id("<|im_start|>"), *tokenizer.encode("assistant\n")]
        script = [tokenizer.encode(text) for text in texts]
        return cls(script, turn_marker=marker, end_token_id=end, vocab_size=tokenizer.vocab_size)

    def fingerprint(self) -> str:
        return self._fingerprint

    def forward_cached(
        self,
        token_ids: torch.Tensor,
        start_pos: int,
        kv: torch.Tensor,
        block_table: torch.Tensor,
        *,
        return_logits: bool = False,
        live: LiveKV | None = None,
    ) -> torch.Tensor:
        """See :meth:`CausalLM.forward_cached`.  ``live`` is accepted and ignored: this model reads its whole context
        back from the pool on every call, which is what makes a wrong cache hit visible."""
        ids, table = check_cached_call(self, token_ids, start_pos, kv, block_table)
        block_size = kv.shape[3]
        end = start_pos + len(ids)
        positions = torch.arange(start_pos, end)
        blocks, rows = table[positions // block_size], positions % block_size
        kv[0, 0, blocks, rows, 0, 0] = ids.to(torch.float32)
        kv[0, 0, blocks, rows, 0, 1] = positions.to(torch.float32)
        kv[0, 1, blocks, rows, 0, 0] = ids.to(torch.float32)
        everything = torch.arange(end)
        keys = kv[0, 0, table[everything // block_size], everything % block_size, 0]
        if not torch.equal(keys[:, 1], everything.to(torch.float32)):
            raise RuntimeError("ScriptedModel: the pool holds another sequence's K/V at these positions")
        context = keys[:, 0].to(torch.long).tolist()
        logits = self._logits(context, start_pos)
        return logits if return_logits else logits[-1:]

    def forward_reference(
        self, token_ids: torch.Tensor, *, return_logits: bool = False, logits_from: int = 0
    ) -> torch.Tensor:
        ids = check_reference_call(self, token_ids)
        logits = self._logits(ids.tolist(), check_logits_from(logits_from, ids.numel()))
        return logits if return_logits else logits[-1:]

    def _logits(self, context: list[int], first: int) -> torch.Tensor:
        targets = self._next_tokens(context)[first:]
        logits = torch.zeros(len(targets), self.vocab_size)
        if self.runner_up_ids:
            runner_ups = torch.tensor(self.runner_up_ids, dtype=torch.long)
            logits[:, runner_ups] = 49.0 - torch.arange(len(runner_ups), dtype=torch.float32)
        logits[torch.arange(len(targets)), torch.tensor(targets, dtype=torch.long)] = 50.0
        return logits

    def _next_tokens(self, context: list[int]) -> list[int]:
        marker, width = self.turn_marker, len(self.turn_marker)
        turn, answer_start, on_script = -1, 0, False
        out = []
        for p, token in enumerate(context):
            if context[max(0, p - width + 1) : p + 1] == marker:
                turn, answer_start, on_script = turn + 1, p + 1, True
            elif on_script:
                answer = self.script[turn] if turn < len(self.script) else []
                index = p - answer_start
                on_script = index < len(answer) and answer[index] == token
            answer = self.script[turn] if 0 <= turn < len(self.script) else []
            index = p + 1 - answer_start
            out.append(answer[index] if on_script and index < len(answer) else self.end_token_id)
        return out
