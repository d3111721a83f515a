"""The logits of a Hugging Face model's cached forward: its plain LM head run by us on the base's hidden state, with
the CPU decode shortcuts, or the model's own forward where the head is not plain (extra ``prefixcache[hf]``)."""

from __future__ import annotations

import inspect
from typing import Any

import torch

from prefixcache.models.hf_decode_attention import grouped_decode
from prefixcache.models.hf_decode_step import decode_logits
from prefixcache.models.hf_last_position import last_layer_mlp, last_position_mlp
from prefixcache.models.hf_support import output_embeddings, plain_head
from prefixcache.models.linear import WeightPacks, large_cpu_linears, lay_out_for_decode, project, tall_skinny_linears

__all__ = ["HeadRunner"]


class HeadRunner:
    """Runs ``model`` (a transformers ``*ForCausalLM``, its cache passed as ``cache_kwarg``) to its logits.

    ``pack_head``: batched CPU decode multiplies by a oneDNN-packed copy of the LM head weight
    (:class:`~prefixcache.models.linear.WeightPacks`), made on first use and again after the weight changes.
    ``decode_layout``: on the CPU in float32 the widening large layers get column-major weights in place
    (:func:`~prefixcache.models.linear.lay_out_for_decode`).  The head is looked up again whenever the model's output
    embeddings are replaced (``resize_token_embeddings``, a new ``lm_head``)."""

    def __init__(self, model: Any, cache_kwarg: str, *, pack_head: bool, decode_layout: bool) -> None:
        self.model = model
        self.config = model.config
        self.cache_kwarg = cache_kwarg
        # Older or custom heads without logits_to_keep compute every position's logits; we still return the last.
        self.keeps_logits = "logits_to_keep" in inspect.signature(model.forward).parameters
        """Whether the model's forward takes ``logits_to_keep``."""
        self._decode_layout = decode_layout
        self.resolve()
        self.head_packs = WeightPacks() if pack_head else None
        """The LM head's oneDNN copy for batched CPU decode; None with ``pack_head=False``."""

    def resolve(self) -> None:
        """Find the head and base run here (:func:`.hf_support.plain_head`), noted by head module, and the large
        layers of the base; again after the model's layers were replaced (quantized)."""
        self._head_module = output_embeddings(self.model)
        self._head = plain_head(self.model)
        self._linears = large_cpu_linears(self._head[0]) if self._head is not None else []
        self.last_mlp = last_layer_mlp(self._head[0], self.config) if self._head is not None else None
        """The last decoder layer's MLP, run on the last position alone for a prefill's last logits; None where the
        layers do not allow it (:func:`~prefixcache.models.hf_last_position.last_layer_mlp`)."""
        if self._decode_layout:
            lay_out_for_decode(self.model)

    def drop_weight_copies(self) -> None:
        """Drop the packed copy of the LM head (made again on the next batched forward)."""
        if self.head_packs is not None:
            self.head_packs.clear()

    def keep_kwargs(self, num_logits: int) -> dict[str, int]:
        """The model's own forward arguments that keep the last ``num_logits`` positions' logits (0: every one),
        none for a model without ``logits_to_keep`` (it returns every position)."""
        return {"logits_to_keep": num_logits} if self.keeps_logits else {}

    def logits(self, cache: Any, return_logits: bool, **inputs: torch.Tensor) -> torch.Tensor:
        """Logits ``[B, n or 1, vocab]`` (model dtype) of one cached forward of ``inputs`` on ``cache``: every
        position with ``return_logits``, else the last.  A plain head (:func:`.hf_support.plain_head`) is run by us
        on the base's hidden state (few tokens: tall-skinny products; the last layer's MLP on the last position alone
        unless ``return_logits``, :mod:`.hf_last_position`); else the model's own forward with ``logits_to_keep``."""
        if output_embeddings(self.model) is not self._head_module:
            self.resolve()  # replaced since we looked (resize_token_embeddings, a new lm_head)
        # One decode query on the CPU attends its KV heads grouped (.hf_decode_attention), and where the layers allow,
        # through our own layer loop (.hf_decode_step); an attention mask (a padded batch) goes through the model.
        decode = inputs["input_ids"].shape[-1] == 1 and self.model.device.type == "cpu"
        if decode and self._head is not None:
            logits = decode_logits(self._head, self.config, cache, inputs, self._linears, self.head_packs)
            if logits is not None:
                return logits
        grouped = grouped_decode(self.config, decode)
        if self._head is None:
            with grouped:
                # logits_to_keep=0 means every position in transformers.
                keep = self.keep_kwargs(0 if return_logits else 1)
                out = self.model(**inputs, use_cache=True, **keep, **{self.cache_kwarg: cache})
            return out.logits if return_logits else out.logits[:, -1:]
        base, base_cache_kwarg, head = self._head
        last = self.last_mlp if not return_logits and inputs["input_ids"].shape[-1] > 1 else None
        with tall_skinny_linears(self._linears, inputs["input_ids"].numel()), last_position_mlp(last), grouped:
            hidden = base(**inputs, use_cache=True, **{base_cache_kwarg: cache}).last_hidden_state
        return project(hidden if return_logits else hidden[:, -1:], head.weight, head.bias, self.head_packs)
