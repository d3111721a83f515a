"""Bad input to the runner, as one table: each row is a call, the exception class it must raise, and a piece of
the message saying what was wrong and what is allowed.  A rejected call leaves both caches exactly as they were:
counters, cached sequences, reference counts and the free list."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch

from prefixcache import PrefixCachingRunner, SamplingParams
from prefixcache.errors import (
    CapacityError,
    InvalidArgumentError,
    InvalidTokensError,
    NamespaceError,
    TemplateError,
)
from prefixcache.models.llama import PRESETS, LlamaModel
from prefixcache.testing import CacheSnapshot, assert_quiescent, snapshot

MAX_POSITION = 64
NAMESPACES = (None, "tenant")


@dataclasses.dataclass
class World:
    """``short``: a model of 64 positions over a pool of 256 tokens; ``small_pool``: a model of 32,768 positions
    over a pool of 64 tokens (so that each capacity limit can be hit on its own).  Both already cache something in
    two namespaces."""

    short: PrefixCachingRunner
    small_pool: PrefixCachingRunner

    def runners(self) -> tuple[PrefixCachingRunner, ...]:
        return (self.short, self.small_pool)

    def snapshots(self) -> list[CacheSnapshot]:
        return [snapshot(r.cache, [r.namespace_key(ns) for ns in NAMESPACES]) for r in self.runners()]


@pytest.fixture(scope="module")
def world() -> World:
    tiny = PRESETS["tiny"]
    short = PrefixCachingRunner(
        LlamaModel(dataclasses.replace(tiny, max_position=MAX_POSITION), device="cpu"), cache_tokens=256, block_size=4
    )
    small_pool = PrefixCachingRunner(LlamaModel(tiny, device="cpu"), cache_tokens=64, block_size=4)
    for runner in (short, small_pool):
        for namespace in NAMESPACES:
            runner.generate(list(range(1, 11)), SamplingParams(max_new_tokens=3), namespace=namespace)
            runner.generate(list(range(1, 7)) + [40, 41], SamplingParams(max_new_tokens=2), namespace=namespace)
    return World(short, small_pool)


def generate(*args: Any, **kwargs: Any) -> Callable[[World], Any]:
    return lambda w: w.short.generate(*args, **kwargs)


def sampling(**kwargs: Any) -> Callable[[World], Any]:
    return lambda w: w.short.generate([1, 2, 3], SamplingParams(**kwargs))


def new_runner(**kwargs: Any) -> Callable[[World], Any]:
    return lambda w: PrefixCachingRunner(w.short.model, **kwargs)


OK = list(range(1, 6))
INTS_ONLY = "token ids must be non-negative Python ints (a flat, 1-D sequence)"

TABLE = [
    ("empty prompt", generate([]), InvalidTokensError, "must not be empty: at least one token is needed"),
    ("empty tensor", generate(torch.zeros(0, dtype=torch.long)), InvalidTokensError, "must not be empty"),
    ("negative id", generate([1, -2, 3]), InvalidTokensError, "index 1 is -2; allowed token ids are 0 .."),
    ("negative id in a tensor", generate(torch.tensor([4, -1])), InvalidTokensError, "is -1; allowed token ids"),
    ("id == vocab size", generate([1, 512]), InvalidTokensError, "token id 512 is outside the model's vocabulary"),
    ("id beyond vocab", generate([70_000]), InvalidTokensError, "allowed ids are 0 .. 511"),
    ("id beyond uint32", generate([2**32]), InvalidTokensError, "allowed token ids are 0 .. 4294967295"),
    ("floats", generate([1.0, 2.0]), InvalidTokensError, f"is 1.0 of type float; {INTS_ONLY}"),
    ("a float among ints", generate([1, 2.5]), InvalidTokensError, "index 1 is 2.5 of type float"),
    ("nan", generate([float("nan")]), InvalidTokensError, "of type float"),
    ("strings", generate(["1", "2"]), InvalidTokensError, "of type str"),
    ("a str", generate("hello"), InvalidTokensError, "must be a list/tuple/array/1-D integer tensor of ints, got str"),
    ("bytes", generate(b"\x01\x02"), InvalidTokensError, "got bytes"),
    ("None", generate(None), InvalidTokensError, "got NoneType"),
    ("an int", generate(7), InvalidTokensError, "got int"),
    ("nested lists", generate([[1, 2], [3, 4]]), InvalidTokensError, f"is [1, 2] of type list; {INTS_ONLY}"),
    ("2-D tensor", generate(torch.ones(2, 3, dtype=torch.long)), InvalidTokensError, "must be 1-D, got a tensor"),
    ("0-D tensor", generate(torch.tensor(5)), InvalidTokensError, "must be 1-D, got a tensor of shape ()"),
    ("float tensor", generate(torch.ones(3)), InvalidTokensError, "must be an integer tensor, got dtype torch.float32"),
    ("bool tensor", generate(torch.ones(3, dtype=torch.bool)), InvalidTokensError, "got dtype torch.bool"),
    (
        "tensor on another device",
        generate(torch.ones(3, dtype=torch.long, device="meta")),
        InvalidTokensError,
        "must be a CPU tensor (token ids are metadata), got a tensor on meta",
    ),
    ("2-D numpy array", generate(np.ones((2, 2), dtype=np.int64)), InvalidTokensError, "must be 1-D, got an array"),
    ("float numpy array", generate(np.ones(3)), InvalidTokensError, "must be an integer array, got dtype float64"),
    ("bools", generate([True, False]), InvalidTokensError, "of type bool"),
    (
        "prompt beyond the model's positions",
        generate(list(range(MAX_POSITION + 1)), SamplingParams(max_new_tokens=0)),
        CapacityError,
        "65 tokens exceed the model's maximum of 64 positions",
    ),
    (
        "prompt + new tokens beyond the model's positions",
        generate(list(range(60)), SamplingParams(max_new_tokens=5)),
        CapacityError,
        "65 tokens exceed the model's maximum of 64 positions",
    ),
    (
        "prompt + forced tokens beyond the model's positions",
        generate(list(range(60)), forced_tokens=list(range(5))),
        CapacityError,
        "exceed the model's maximum of 64 positions",
    ),
    (
        "prompt beyond the pool",
        lambda w: w.small_pool.generate(list(range(65)), SamplingParams(max_new_tokens=0)),
        CapacityError,
        "65 tokens exceed the pool's capacity of 64 tokens (16 blocks of 4)",
    ),
    (
        "prompt + new tokens beyond the pool",
        lambda w: w.small_pool.generate(list(range(60)), SamplingParams(max_new_tokens=5)),
        CapacityError,
        "exceed the pool's capacity of 64 tokens",
    ),
    ("max_new_tokens < 0", sampling(max_new_tokens=-1), InvalidArgumentError, "max_new_tokens must be >= 0, got -1"),
    ("max_new_tokens a float", sampling(max_new_tokens=2.0), InvalidArgumentError, "max_new_tokens must be an int"),
    ("max_new_tokens a bool", sampling(max_new_tokens=True), InvalidArgumentError, "max_new_tokens must be an int"),
    ("temperature < 0", sampling(temperature=-0.5), InvalidArgumentError, "temperature must be >= 0 (0 = greedy)"),
    ("temperature nan", sampling(temperature=float("nan")), InvalidArgumentError, "temperature must be >= 0"),
    ("top_p 0", sampling(top_p=0.0), InvalidArgumentError, "top_p must be in (0, 1], got 0.0"),
    ("top_p > 1", sampling(top_p=1.5), InvalidArgumentError, "top_p must be in (0, 1], got 1.5"),
    ("stop id a float", sampling(stop_token_ids=[1.5]), InvalidArgumentError, "stop_token_ids must be a collection"),
    ("stop id negative", sampling(stop_token_ids=[-1]), InvalidArgumentError, "of non-negative int token ids"),
    ("stop ids an int", sampling(stop_token_ids=258), InvalidArgumentError, "stop_token_ids must be a collection"),
    (
        "sampling not SamplingParams",
        generate(OK, {"max_new_tokens": 1}),
        InvalidArgumentError,
        "sampling must be SamplingParams, got dict",
    ),
    ("forced id negative", generate(OK, forced_tokens=[-1]), InvalidTokensError, "forced_tokens: token id at index 0"),
    ("forced id beyond vocab", generate(OK, forced_tokens=[600]), InvalidTokensError, "forced_tokens: token id 600"),
    ("forced ids a float tensor", generate(OK, forced_tokens=torch.ones(2)), InvalidTokensError, "forced_tokens:"),
    ("namespace int", generate(OK, namespace=3), NamespaceError, "must be None or a str (a cache salt), got int"),
    ("namespace bytes", generate(OK, namespace=b"t"), NamespaceError, "got bytes"),
    ("stream namespace int", lambda w: w.short.stream(OK, namespace=1), NamespaceError, "got int"),
    ("prefill empty", lambda w: w.short.prefill([]), InvalidTokensError, "must not be empty"),
    ("prefill namespace bytes", lambda w: w.short.prefill(OK, namespace=b"t"), NamespaceError, "got bytes"),
    (
        "chat unknown role",
        lambda w: w.short.chat([{"role": "robot", "content": "hi"}]),
        TemplateError,
        "has role 'robot'; allowed roles: assistant, system, tool, user",
    ),
    (
        "chat max_new_tokens < 0",
        lambda w: w.short.chat([{"role": "user", "content": "hi"}], max_new_tokens=-1),
        InvalidArgumentError,
        "max_new_tokens must be >= 0",
    ),
    ("block size 0", new_runner(block_size=0), InvalidArgumentError, "block_size must be in 1..256 tokens, got 0"),
    ("block size 257", new_runner(block_size=257), InvalidArgumentError, "must be in 1..256 tokens, got 257"),
    ("block size a float", new_runner(block_size=4.0), InvalidArgumentError, "block_size must be an int, got 4.0"),
    ("cache_tokens 0", new_runner(cache_tokens=0), InvalidArgumentError, "cache_tokens must be a positive int, got 0"),
    ("num_blocks 0", new_runner(num_blocks=0), InvalidArgumentError, "num_blocks must be at least 1, got 0"),
    (
        "two pool sizes",
        new_runner(num_blocks=4, cache_tokens=16),
        InvalidArgumentError,
        "give at most one of num_blocks, cache_tokens, cache_memory",
    ),
    ("budget below one block", new_runner(cache_memory=10), InvalidArgumentError, "10 bytes holds no block"),
    ("unknown policy", new_runner(policy="fifo"), InvalidArgumentError, "unknown eviction policy 'fifo'; choose"),
    (
        "not a model",
        lambda w: PrefixCachingRunner(object()),
        InvalidArgumentError,
        "model must implement the CausalLM protocol, got object",
    ),
]


@pytest.mark.parametrize(
    ("call", "error", "message"),
    [pytest.param(*row[1:], id=row[0]) if len(row) == 4 else row for row in TABLE],
)
def test_bad_input_raises_a_specific_error_and_changes_nothing(world, call, error, message) -> None:
    before = world.snapshots()

    with pytest.raises(error) as raised:
        call(world)

    assert raised.type is error, f"raised {raised.type.__name__}, a subclass of {error.__name__}"
    assert message in str(raised.value)
    assert world.snapshots() == before
    for runner in world.runners():
        assert_quiescent(runner.cache)
