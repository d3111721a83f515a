"""A runner with a host-memory tier restarted from a snapshot: a document the device pool had demoted to host is found
whole after the restart (as host hits), and the output equals uncached output."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from prefixcache import PrefixCachingRunner, SamplingParams
from prefixcache.models.llama import LlamaModel, build_model

pytest.importorskip("safetensors", reason="needs: pip install 'prefixcache[snapshot]'")

ONE = SamplingParams(max_new_tokens=1)
DOC = list(range(60, 156))  # 96 tokens: 6 blocks of 16
OTHER = list(range(300, 427))  # 127 tokens: with its generated token, the whole 8-block device pool


def runner(model: LlamaModel) -> PrefixCachingRunner:
    return PrefixCachingRunner(model, num_blocks=8, block_size=16, host_cache_tokens=512)


def test_a_document_demoted_to_host_is_found_whole_after_a_restart(tiny: LlamaModel, tmp_path: Path) -> None:
    first = runner(tiny)
    first.generate(DOC, ONE)
    first.generate(OTHER, ONE)
    stats = first.cache.stats()
    assert (stats.demoted_blocks, stats.host_used_blocks) == (6, 6)
    assert first.cache.match(DOC, first.namespace_key(None)).num_tokens == 0  # not on the device
    (old_run,) = first.cache._host.runs.values()
    old_kv = first.cache.host_pool.kv[:, :, torch.from_numpy(old_run.block_ids)]
    saved = first.save_snapshot(tmp_path / "snap")
    assert (saved.num_tokens, saved.host_runs, saved.host_tokens, saved.host_blocks) == (127, 1, 96, 6)

    restarted = runner(build_model("tiny", device="cpu"))  # a new process's model
    loaded = restarted.load_snapshot(tmp_path / "snap")
    prompt = DOC + [1, 2, 3, 4]
    result = restarted.generate(prompt, ONE, return_logits=True)

    assert (loaded.num_tokens, loaded.host_tokens, loaded.skipped_host_tokens) == (127, 96, 0)
    assert (result.usage.cached_tokens, result.usage.host_cached_tokens, result.usage.prefilled_tokens) == (96, 96, 4)
    assert restarted.cache.stats().promoted_blocks == 6
    uncached = PrefixCachingRunner(tiny, num_blocks=8, block_size=16).generate(prompt, ONE, return_logits=True)
    assert result.token_ids == uncached.token_ids
    reference = tiny.forward_reference(torch.tensor(prompt), return_logits=True).float()
    assert float((result.prompt_logits - reference[96:]).abs().max()) < 1e-4
    match = restarted.cache.match(DOC, restarted.namespace_key(None))
    assert match.num_tokens == 96
    promoted_kv = restarted.pool.kv[:, :, torch.from_numpy(match.block_table[:6].astype("int64"))]
    assert torch.equal(promoted_kv, old_kv), "the promoted K/V differ from what was computed before the restart"
    restarted.cache.check_invariants()
