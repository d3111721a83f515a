"""Tenant isolation: a namespace (cache salt) and the model/tokenizer fingerprint are part of every cache key, so
two namespaces never share a block, never see each other's hits, and pressure from one cannot corrupt another."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from prefixcache import PrefixCachingRunner, RadixCache, SamplingParams
from prefixcache.chat.tokenizer import ByteTokenizer
from prefixcache.models.llama import PRESETS, LlamaModel, build_model
from prefixcache.testing import assert_quiescent, greedy_reference

BLOCK_SIZE = 4
MAX_NEW = 3
SHARED = list(range(1, 14))  # the prefix every tenant sends
ATOL = 1e-4


class RenamedTokenizer(ByteTokenizer):
    """The byte tokenizer under another name, as a tokenizer whose ids could mean other text would be."""

    __slots__ = ()

    @property
    def name(self) -> str:
        return "byte-utf8+chatml-v1-renamed"


@pytest.fixture(scope="module")
def other_seed() -> LlamaModel:
    return LlamaModel(dataclasses.replace(PRESETS["tiny"], seed=99), device="cpu")


_REFERENCE: dict[tuple[str, tuple[int, ...]], list[int]] = {}


def reference_tokens(model: LlamaModel, prompt: list[int]) -> list[int]:
    key = (model.fingerprint(), tuple(prompt))
    if key not in _REFERENCE:
        _REFERENCE[key] = greedy_reference(model, prompt, MAX_NEW)[0]
    return _REFERENCE[key]


def serve(runner: PrefixCachingRunner, prompt: list[int], namespace: str | None):
    return runner.generate(prompt, SamplingParams(max_new_tokens=MAX_NEW), namespace=namespace)


def tree_blocks(cache: RadixCache, key: str) -> set[int]:
    """Every block held by a node of namespace ``key``."""
    with cache._mutex:
        root = cache._tree.roots.get(key)
        stack = list(root.children.values()) if root is not None else []
        blocks: set[int] = set()
        while stack:
            node = stack.pop()
            blocks.update(node.blocks.tolist())
            stack.extend(node.children.values())
        return blocks


def test_the_same_prompt_in_two_namespaces_is_cached_twice_in_disjoint_blocks(model) -> None:
    runner = PrefixCachingRunner(model, num_blocks=64, block_size=BLOCK_SIZE)
    prompt = SHARED + [20, 21]
    serve(runner, prompt, "alice")

    second = serve(runner, prompt, "bob")

    assert second.usage.cached_tokens == 0
    alice, bob = runner.namespace_key("alice"), runner.namespace_key("bob")
    alice_table = runner.cache.match(prompt, alice).block_table
    bob_table = runner.cache.match(prompt, bob).block_table
    assert len(alice_table) == len(bob_table) == 4
    assert not set(alice_table.tolist()) & set(bob_table.tolist())
    assert not tree_blocks(runner.cache, alice) & tree_blocks(runner.cache, bob)


def test_a_namespace_only_hits_what_it_cached_itself(model) -> None:
    runner = PrefixCachingRunner(model, num_blocks=64, block_size=BLOCK_SIZE)
    prompt = SHARED + [30]
    serve(runner, prompt, "alice")

    assert serve(runner, prompt, "bob").usage.cached_tokens == 0
    assert serve(runner, prompt, None).usage.cached_tokens == 0
    assert serve(runner, prompt, "").usage.cached_tokens == 0
    assert serve(runner, prompt, "alice").usage.cached_tokens == len(prompt) - 1
    assert runner.cache.match(prompt, "alice").num_tokens == 0  # the raw salt is not the tree key


def test_pressure_from_one_namespace_never_corrupts_another(model) -> None:
    runner = PrefixCachingRunner(model, num_blocks=24, block_size=BLOCK_SIZE)
    alice_prompts = [SHARED + [40 + i] for i in range(3)]
    for prompt in alice_prompts:
        serve(runner, prompt, "alice")
    alice_hits = 0
    for i in range(30):
        bob = serve(runner, SHARED + [100 + i, 101 + i, 102 + i], "bob")  # evicts: 24 blocks hold 96 tokens
        assert list(bob.token_ids) == reference_tokens(model, SHARED + [100 + i, 101 + i, 102 + i])
        prompt = alice_prompts[i % 3]
        alice = serve(runner, prompt, "alice")
        alice_hits += alice.usage.cached_tokens
        assert list(alice.token_ids) == reference_tokens(model, prompt)
        key_a, key_b = runner.namespace_key("alice"), runner.namespace_key("bob")
        assert not tree_blocks(runner.cache, key_a) & tree_blocks(runner.cache, key_b)
        assert_quiescent(runner.cache)

    assert runner.cache.stats().evictions > 0
    assert alice_hits > 0  # some of alice's cache survived the pressure and was reused, exactly


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    requests=st.lists(
        st.tuples(st.sampled_from(["alice", "bob", None]), st.integers(0, 5), st.integers(0, 3)),
        min_size=1,
        max_size=12,
    ),
    block_size=st.integers(1, 16),
    spare_blocks=st.integers(0, 18),
)
def test_hits_only_ever_come_from_the_same_namespaces_history(model, requests, block_size, spare_blocks) -> None:
    """Interleaved tenants sending overlapping prompts: a request's hit never exceeds its longest common prefix
    with what its own namespace sent before, outputs are exact, and the namespaces' blocks stay disjoint."""
    tails = [[], [50], [50, 51, 52], [60, 61], [50, 51, 70, 71, 72], [80]]
    longest = len(SHARED) + max(map(len, tails)) + MAX_NEW
    # A request's own blocks (plus a copy-on-write block) beside the whole locked edges of its match.
    num_blocks = 2 * -(-longest // block_size) + 2 + spare_blocks
    runner = PrefixCachingRunner(model, num_blocks=num_blocks, block_size=block_size)
    history: dict[str | None, list[list[int]]] = {}
    for namespace, tail, cut in requests:
        prompt = SHARED[: len(SHARED) - cut] + tails[tail]
        result = serve(runner, prompt, namespace)
        own = [_common_prefix(prompt, seq) for seq in history.get(namespace, [])]
        assert result.usage.cached_tokens <= min(max(own, default=0), len(prompt) - 1)
        assert list(result.token_ids) == reference_tokens(model, prompt)
        history.setdefault(namespace, []).append(prompt + list(result.token_ids[:-1]))
        keys = [runner.namespace_key(ns) for ns in ("alice", "bob", None)]
        blocks = [tree_blocks(runner.cache, key) for key in keys]
        assert not (blocks[0] & blocks[1] or blocks[0] & blocks[2] or blocks[1] & blocks[2])
    assert_quiescent(runner.cache)


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def test_namespace_key_mixes_in_model_and_tokenizer_fingerprints(model, other_seed) -> None:
    def key(m: LlamaModel, tokenizer: ByteTokenizer | None = None, namespace: str | None = None) -> str:
        return PrefixCachingRunner(m, tokenizer, num_blocks=1).namespace_key(namespace)

    base = key(model)
    rebuilt = key(build_model("tiny", device="cpu"))
    variants = {
        "seed": key(other_seed),
        "preset": key(build_model("small", device="cpu")),
        "dtype": key(LlamaModel(PRESETS["tiny"], dtype=torch.bfloat16, device="cpu")),
        "config": key(LlamaModel(dataclasses.replace(PRESETS["tiny"], rope_theta=500000.0), device="cpu")),
        "tokenizer": key(model, RenamedTokenizer()),
    }

    assert rebuilt == base  # stable across builds, so a cache survives a model reload
    assert len({base, *variants.values()}) == 1 + len(variants)
    salted = {key(model, namespace=ns) for ns in (None, "", "-", "=", "a", "a:b")}
    assert len(salted) == 6
    assert all(k.startswith(base.split(":")[0] + ":") for k in salted)


def test_a_cache_built_under_one_model_is_never_hit_under_another(model, other_seed) -> None:
    """Two runners made to share one cache (by hand: a runner normally builds its own) see only their own
    entries, because their namespace keys carry different model fingerprints."""
    first = PrefixCachingRunner(model, num_blocks=64, block_size=BLOCK_SIZE)
    second = PrefixCachingRunner(other_seed, num_blocks=64, block_size=BLOCK_SIZE)
    second.cache, second.pool = first.cache, first.pool
    renamed = PrefixCachingRunner(model, RenamedTokenizer(), num_blocks=64, block_size=BLOCK_SIZE)
    renamed.cache, renamed.pool = first.cache, first.pool
    prompt = SHARED + [90, 91]
    serve(first, prompt, "tenant")

    for runner, m in ((second, other_seed), (renamed, model)):
        result = serve(runner, prompt, "tenant")
        assert result.usage.cached_tokens == 0
        assert list(result.token_ids) == reference_tokens(m, prompt)
    again = serve(first, prompt, "tenant")
    assert again.usage.cached_tokens == len(prompt) - 1
    assert list(again.token_ids) == reference_tokens(model, prompt)
    keys = [r.namespace_key("tenant") for r in (first, second, renamed)]
    blocks = [tree_blocks(first.cache, k) for k in keys]
    assert all(blocks) and not (blocks[0] & blocks[1] or blocks[0] & blocks[2] or blocks[1] & blocks[2])
    assert_quiescent(first.cache)
    assert np.count_nonzero(first.pool.ref_counts()) == len(set().union(*blocks))
