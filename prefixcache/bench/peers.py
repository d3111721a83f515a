"""The ``peers`` benchmark: our radix tree next to SGLang's radix cache and vLLM's block pool, measured in one run.

The peers are their published packages, installed without dependencies and imported with only the heavy imports
stubbed (:mod:`prefixcache.bench.peer_imports`); each is driven through its own API
(:mod:`prefixcache.bench.peer_caches`).  Everything runs in one process on one clock (this thread's CPU time);
the repeats are interleaved (every system once per round, in a rotating order) and each figure is the median over
rounds.  Ratios are peer / ours, so above 1 means we are faster.  Our block size 1 is compared with SGLang's page
size 1, our block size 16 with vLLM's block size 16.

Workloads:

- tree: the standard workload of ``bench tree`` (sequences of random token ids behind one shared prefix): each
  sequence goes through a request cycle into a growing cache, then every sequence is matched in full, matched at
  ``len - 1`` (the prefill lookup; node counts before and after: SGLang splits nodes on lookup), locked and
  unlocked, and finally everything is evicted;
- agent: conversations behind one shared system prompt, served round-robin; each turn's prompt is the previous
  prompt + answer + a new user message, so every turn but the first finds nearly all of its prompt cached.

Key preparation (token list to what each system looks up: our ``array('I')``, every id checked to be an int, not a
bool, in ``0 .. 2**32 - 1``; SGLang's ``RadixKey`` over ``array('q')``, whose conversion checks for ints in the int64
range; vLLM's chained block hashes) is timed apart from the cache operations.  Every
request's tokens hit are checked between systems: SGLang must hit exactly what we hit at block size 1; vLLM, which
caches full blocks only, exactly our block-size-16 hit rounded down to a whole block.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from prefixcache.bench.common import BenchResult, Table, frozen_gc, progress, standard_workload, us_per
from prefixcache.bench.device_clock import now_ns
from prefixcache.bench.peer_caches import OursDriver, SGLangDriver, VllmDriver
from prefixcache.bench.peer_imports import INSTALL_HINT, PeerUnavailableError, load_sglang, load_vllm

VLLM_BLOCK_SIZE = 16
FULL = {"tree_seqs": 2000, "conversations": 200, "turns": 12, "repeats": 5}
QUICK = {"tree_seqs": 200, "conversations": 20, "turns": 6, "repeats": 3}
SYSTEM_PROMPT_TOKENS = 2000
USER_TOKENS = (20, 120)
ANSWER_TOKENS = (40, 240)


@dataclass(frozen=True, slots=True)
class AgentWorkload:
    """``requests[i] = (prompt, answer)`` token lists, in arrival order (round-robin over conversations)."""

    num_conversations: int
    num_turns: int
    system_tokens: int
    requests: list[tuple[list[int], list[int]]]


def agent_workload(
    num_conversations: int, num_turns: int, system_tokens: int = SYSTEM_PROMPT_TOKENS, seed: int = 0
) -> AgentWorkload:
    """Random token ids (fixed seed): one shared system prompt, then per turn a user message of 20-120 tokens and an
    answer of 40-240; turn ``t`` of every conversation arrives before turn ``t + 1`` of any."""
    rng = np.random.default_rng(seed)
    system = rng.integers(0, 128_000, system_tokens).tolist()
    histories = [list(system) for _ in range(num_conversations)]
    requests = []
    for _ in range(num_turns):
        for history in histories:
            history.extend(rng.integers(0, 128_000, int(rng.integers(*USER_TOKENS))).tolist())
            answer = rng.integers(0, 128_000, int(rng.integers(*ANSWER_TOKENS))).tolist()
            requests.append((list(history), answer))
            history.extend(answer)
    return AgentWorkload(num_conversations, num_turns, system_tokens, requests)


def _timed(fn: Callable[[], Any]) -> tuple[int, Any]:
    start = now_ns()
    out = fn()
    return now_ns() - start, out


def tree_pass(driver: Any, token_lists: list[list[int]]) -> dict[str, Any]:
    """Every tree operation once over all sequences; microseconds per sequence, node counts and tokens hit."""
    n = len(token_lists)
    out: dict[str, Any] = {}
    ns, keys = _timed(lambda: [driver.key(tokens) for tokens in token_lists])
    out["key"] = us_per(ns, n)
    cycle = driver.cycle
    ns, hits = _timed(lambda: [cycle(key, key) for key in keys])
    out["cycle"], out["cycle_hits"] = us_per(ns, n), hits
    match = driver.match
    ns, full = _timed(lambda: [match(key) for key in keys])
    out["match"], out["match_hits"] = us_per(ns, n), full
    out["nodes_before"] = driver.num_nodes()
    prefill = driver.match_prefill
    ns, handles = _timed(lambda: [prefill(key) for key in keys])
    out["match_prefill"] = us_per(ns, n)
    out["nodes_after"] = driver.num_nodes()
    out["prefill_hits"] = [driver.matched_tokens(h) for h in handles]
    lock_unlock = driver.lock_unlock
    ns, _ = _timed(lambda: [lock_unlock(h) for h in handles])
    out["lock_unlock"] = us_per(ns, n)
    ns, out["evicted_tokens"] = _timed(driver.evict_all)
    out["evict_all"] = us_per(ns, n)
    return out


def agent_pass(driver: Any, workload: AgentWorkload) -> dict[str, Any]:
    """Every request of the agent workload through one request cycle; microseconds per request and tokens hit."""
    requests = workload.requests
    n = len(requests)
    keys_of = driver.keys
    ns, keys = _timed(lambda: [keys_of(prompt, prompt + answer) for prompt, answer in requests])
    key_us = us_per(ns, n)
    cycle = driver.cycle
    ns, hits = _timed(lambda: [cycle(prompt, full) for prompt, full in keys])
    return {"key": key_us, "cycle": us_per(ns, n), "total": key_us + us_per(ns, n), "hits": hits}


def _systems(tree_seqs: list[list[int]], workload: AgentWorkload) -> tuple[list[tuple[str, Callable]], list[str]]:
    """(label, driver factory taking capacity in tokens) for every system that imports, and notes on the others."""
    systems: list[tuple[str, Callable]] = [
        ("ours bs=1", lambda cap: OursDriver(1, cap)),
        ("ours bs=16", lambda cap: OursDriver(VLLM_BLOCK_SIZE, cap)),
    ]
    notes: list[str] = []
    sglang = load_sglang()
    systems.insert(1, ("SGLang", lambda cap: SGLangDriver(sglang, cap)))
    notes.append(f"SGLang {sglang.version}: sglang.srt.mem_cache.radix_cache; stubbed: {', '.join(sglang.stubs)}.")
    try:
        vllm = load_vllm()
    except PeerUnavailableError as exc:
        notes.append(f"vLLM not measured: {exc}")
    else:
        systems.append(("vLLM", lambda cap: VllmDriver(vllm, VLLM_BLOCK_SIZE, cap)))
        notes.append(
            f"vLLM {vllm.version}: vllm.v1.core.block_pool + kv_cache_utils (sha256 block hashes); "
            f"stubbed: {', '.join(vllm.stubs) or 'nothing'}."
        )
    return systems, notes


def _median_of(passes: list[dict[str, Any]], key: str) -> float:
    return statistics.median(p[key] for p in passes)


def _check_hits(results: dict[str, list[dict[str, Any]]], field: str) -> None:
    """SGLang hits what we hit at block size 1; vLLM our block-size-16 hit rounded down to whole blocks."""
    ours1, ours16 = results["ours bs=1"][0][field], results["ours bs=16"][0][field]
    for label, passes in results.items():
        for p in passes:
            if label == "SGLang":
                assert p[field] == ours1, f"SGLang's {field} differ from ours at block size 1"
            elif label == "vLLM":
                expected = [h // VLLM_BLOCK_SIZE * VLLM_BLOCK_SIZE for h in ours16]
                assert p[field] == expected, f"vLLM's {field} differ from ours at block size 16 (whole blocks)"


def _ratio(peer: float, ours: float) -> str:
    return f"{peer / ours:.2f}x" if ours else ""


def run(quick: bool = False) -> BenchResult:
    """The tree and agent workloads for every installed peer, interleaved repeats (3 with ``quick``, else 5).

    Raises:
        PeerUnavailableError: ``sglang`` is not installed (the message says how to install it).
    """
    setup = QUICK if quick else FULL
    tree_work = standard_workload(num_seqs=setup["tree_seqs"])
    agent = agent_workload(setup["conversations"], setup["turns"])
    systems, notes = _systems(tree_work.token_lists, agent)
    tree_capacity = tree_work.prefix_len + tree_work.num_seqs * (tree_work.seq_len - tree_work.prefix_len) * 2
    agent_capacity = sum(len(p) + len(a) for p, a in agent.requests) + 16 * len(agent.requests)
    tree_results: dict[str, list[dict[str, Any]]] = {label: [] for label, _ in systems}
    agent_results: dict[str, list[dict[str, Any]]] = {label: [] for label, _ in systems}
    rounds = range(setup["repeats"])
    with frozen_gc():
        for r in progress(rounds, "peers: rounds", setup["repeats"], not quick):
            order = systems[r % len(systems) :] + systems[: r % len(systems)]
            for label, make in order:
                tree_results[label].append(tree_pass(make(tree_capacity), tree_work.token_lists))
                agent_results[label].append(agent_pass(make(agent_capacity), agent))
    _check_hits(tree_results, "cycle_hits")
    _check_hits(tree_results, "prefill_hits")
    _check_hits(agent_results, "hits")

    labels = [label for label, _ in systems]
    pairs = [("SGLang", "ours bs=1")] + ([("vLLM", "ours bs=16")] if "vLLM" in labels else [])
    tree_rows = []
    for key, name in (
        ("key", "key preparation"),
        ("cycle", "request cycle (match+lock, allocate, insert, unlock)"),
        ("match", "match (full sequence)"),
        ("match_prefill", "match at len-1 (prefill)"),
        ("lock_unlock", "lock + unlock"),
        ("evict_all", "evict all (per sequence)"),
    ):
        row: list[Any] = [name]
        for peer, ours in pairs:
            o, p = _median_of(tree_results[ours], key), _median_of(tree_results[peer], key)
            row += [o, p, _ratio(p, o)]
        tree_rows.append(tuple(row))
    node_row: list[Any] = ["nodes before -> after match at len-1"]
    for peer, ours in pairs:
        for label in (ours, peer):
            first = tree_results[label][0]
            node_row.append(f"{first['nodes_before']:,} -> {first['nodes_after']:,}")
        node_row.append("")
    tree_rows.append(tuple(node_row))
    headers: list[str] = ["operation (us per sequence)"]
    for peer, ours in pairs:
        headers += [ours, peer, f"{peer}/ours"]
    common_notes = [
        f"Medians of {setup['repeats']} interleaved rounds; this thread's CPU time; one process; ratios above 1: "
        "we are faster.",
        *notes,
    ]
    if "vLLM" in labels:
        common_notes.append(
            "vLLM has no tree: its 'nodes' are cached block hashes; lock + unlock is touch + free_blocks of the "
            "matched blocks; evict all is reset_prefix_cache()."
        )
    tree_table = Table(
        title=(
            f"peers, tree: {tree_work.num_seqs:,} sequences x {tree_work.seq_len:,} tokens, "
            f"{tree_work.prefix_len:,}-token shared prefix"
        ),
        headers=tuple(headers),
        rows=tuple(tree_rows),
        notes=tuple(common_notes),
    )
    agent_rows = []
    for key, name in (("key", "key preparation"), ("cycle", "request cycle"), ("total", "total")):
        row = [name]
        for peer, ours in pairs:
            o, p = _median_of(agent_results[ours], key), _median_of(agent_results[peer], key)
            row += [o, p, _ratio(p, o)]
        agent_rows.append(tuple(row))
    hit_row: list[Any] = ["prompt tokens hit (%)"]
    prompt_tokens = sum(len(p) for p, _ in agent.requests)
    for peer, ours in pairs:
        for label in (ours, peer):
            hit_row.append(100 * sum(agent_results[label][0]["hits"]) / prompt_tokens)
        hit_row.append("")
    agent_rows.append(tuple(hit_row))
    agent_headers = ["operation (us per request)", *headers[1:]]
    agent_table = Table(
        title=(
            f"peers, agent: {agent.num_conversations} conversations x {agent.num_turns} turns behind a "
            f"{agent.system_tokens:,}-token system prompt, round-robin ({len(agent.requests):,} requests, "
            f"{prompt_tokens:,} prompt tokens)"
        ),
        headers=tuple(agent_headers),
        rows=tuple(agent_rows),
        notes=(
            "request cycle: match at most len-1 prompt tokens and lock them, allocate the rest of prompt + answer, "
            "insert prompt + answer, unlock; nothing is evicted (each cache holds the whole workload).",
            "key preparation: ours list -> array('I'), checking every id (an int, not a bool, 0 .. 2**32-1); "
            "SGLang list -> RadixKey(array('q')), whose conversion checks only for ints in the int64 range; vLLM the "
            "request's chained sha256 block hashes.  Each side builds the prompt + answer list and takes the "
            "prompt's key as a slice of the whole sequence's (a copy of the ids on both trees; vLLM hashes once).",
        ),
    )

    def summary(results: dict[str, list[dict[str, Any]]], keys: tuple[str, ...]) -> dict[str, dict[str, float]]:
        return {label: {k: _median_of(passes, k) for k in keys} for label, passes in results.items()}

    data = {
        "quick": quick,
        "repeats": setup["repeats"],
        "clock": "thread CPU time",
        "tree_workload": tree_work.params,
        "agent_workload": {
            "conversations": agent.num_conversations,
            "turns": agent.num_turns,
            "system_tokens": agent.system_tokens,
            "requests": len(agent.requests),
            "prompt_tokens": prompt_tokens,
        },
        "tree_us": summary(tree_results, ("key", "cycle", "match", "match_prefill", "lock_unlock", "evict_all")),
        "tree_nodes": {
            label: [passes[0]["nodes_before"], passes[0]["nodes_after"]] for label, passes in tree_results.items()
        },
        "agent_us": summary(agent_results, ("key", "cycle", "total")),
        "notes": notes,
    }
    return BenchResult("peers", (tree_table, agent_table), data)


__all__ = ["INSTALL_HINT", "PeerUnavailableError", "agent_workload", "run"]
