"""The ``route`` benchmark: replicas behind a router, simulated with caches only.

Each replica is one metadata-only :class:`~prefixcache.RadixCache` (``KVBlockPool(num_blocks, block_size)``, no KV
tensor) driven as ``prefixcache replay --no-model`` drives one: acquire, reserve, commit of prompt + answer.  Every
request is served to completion before the next arrives, so a replica's *load* is the number of requests it has
served so far, and the table's imbalance is ``max / mean`` of those counts.  Four routers:

- **round-robin**: request ``i`` to replica ``i mod N``.
- **affinity**: a consistent-hash ring (64 virtual nodes per replica, xxh64) keyed by the conversation id (a
  Mooncake trace has none: its first 512-token hash block stands in).
- **text prefix**: Ray Serve LLM's ``PrefixCacheAffinityRouter`` as documented: a prefix tree per replica of the
  prompts *routed* there (not what the replica still caches), at most 400,000 characters each with LRU trimming;
  the replicas with the longest match win when it covers >= 10% of the prompt, otherwise the replica with the
  smallest tree.  Prompts here are byte-tokenized, so characters are tokens.
- **exact**: :class:`~prefixcache.distributed.router.ExactPrefixRouter` on a
  :class:`~prefixcache.cache.events.BlockIndex` per replica fed by that replica's KV events.
- **oracle**: the replica with the longest exact match, load ignored (ties to the less loaded): what routing on the
  cache alone gives.  It is not an upper bound when memory is short: piling a shared prefix's conversations onto one
  replica overflows it.

Both load-aware routers fall back to power of two choices past the same threshold, ``max(8, 10% of the mean)``:
the text router when the fleet's ``max - min`` load exceeds it (Ray's rule), the exact router when its preferred
replica's load exceeds the lightest by that much.  The exact router also gives up 128 tokens of cached prefix
per request of extra load while replicas have served up to 16 requests on average, and relatively less after
(``128 * 16 / mean``: 8 tokens at a mean of 256), so early on a short shared prefix (one MT-Bench question
asked of 31 models) does not pile its conversations onto one replica, while later a conversation or a group
sharing a first turn stays together.  Each replica also reports its free blocks (as a live replica publishes them
beside its KV events): the exact router prices the prompt tokens a replica would have to store by how much fuller
than the emptiest replica it is (weight 4), so new conversations fill memory evenly rather than request counts,
and half a token per token a request would make a full replica evict (its uncached prompt plus the mean answer
seen so far, beyond that replica's free blocks).  A conversation coming back (its replica holds at least half the
prompt) is moved by the load guard only when its replica is more than ``max(4, 20%)`` above the *mean* load:
moving it would lose its cached prefix and store it twice, and those copies overflow replicas that together just
hold the working set.

Every replica holds ``1 / 8`` of the workload's working set (blocks an unbounded cache holds at the end; at least
twice the longest request), and the baseline is one replica with ``N`` times that memory.
"""

from __future__ import annotations

import bisect
import random
import time
from array import array
from collections.abc import Sequence
from pathlib import Path

import xxhash

from prefixcache.bench.common import BenchResult, Table, progress
from prefixcache.bench.policy import DATA_DIR
from prefixcache.cache.events import BlockIndex
from prefixcache.cache.pool import KVBlockPool
from prefixcache.cache.radix_cache import RadixCache
from prefixcache.chat.tokenizer import ByteTokenizer
from prefixcache.distributed.router import ExactPrefixRouter, power_of_two, too_uneven
from prefixcache.errors import InvalidArgumentError, OutOfBlocksError
from prefixcache.replay.replayer import ReplayRequest, interleave, load_requests
from prefixcache.replay.scenarios import MOONCAKE_BLOCK_TOKENS

BLOCK_SIZE = 16
REPLICA_SHARE = 8
"""Each replica holds ``1 / REPLICA_SHARE`` of the working set: eight of them together hold it once."""
WORKLOADS: dict[str, tuple[str, int, int]] = {
    "tau-bench": ("tau_bench_airline_gpt4o.jsonl", 200, 24),
    "mt-bench": ("mtbench_31models.jsonl", 2480, 62),
    "oasst": ("oasst_en100_tree_paths.jsonl", 626, 60),
    "mooncake-conv": ("mooncake/conversation_trace.jsonl", 500, 100),
}
"""Label -> (file under the shared data, conversations or trace lines in a full run, in a ``--quick`` run).  A full
run takes each transcript file whole (MT-Bench: 80 questions x 31 models, all eight categories) and the first 500
lines of the Mooncake trace."""
MEMORY_SHARES = (6, 8, 10, 12, 16)
"""At ``N = REPLICA_SHARE`` replicas the exact router is also run with ``1 / share`` of the working set per replica
for each of these: at 1/8 the fleet holds the working set with no block to spare, a knife edge where one more copy
of a prefix overflows a replica, so one memory size alone can mislead."""
ORDERS = ("shuffled", "random")
ORDER_SEEDS = (0, 1, 2)
"""At ``N = REPLICA_SHARE`` and the bench's sizing the exact router also serves each workload's conversations in
other orders (see :func:`reordered`), one run per seed: the bench's round-robin order puts every second turn after
all first turns, the longest wait for a cached prefix, and one order alone can mislead."""
REPLICAS = (2, 8, 64)
QUICK_REPLICAS = (2, 8)
ROUTERS = ("round-robin", "affinity", "text prefix", "exact", "oracle")
TEXT_TREE_CHARS = 400_000
TEXT_MATCH_RATE = 0.1
IMBALANCE_ABS = 8
IMBALANCE_REL = 0.1
LOAD_PENALTY_TOKENS = 128.0
"""Tokens of cached prefix the exact router gives up per request of extra load ..."""
LOAD_RELATIVE_ABOVE = 16.0
"""... while the mean load is at most this; beyond it, relatively less (see ExactPrefixRouter)."""
MEMORY_WEIGHT = 4.0
"""The exact router's price of the prompt tokens a replica must store, per unit of how much fuller (fraction of its
pool) that replica is than the emptiest one."""
EVICT_WEIGHT = 0.5
"""The exact router's price per token a request would make a full replica evict."""
CONTINUATION_ABS = 4
CONTINUATION_REL = 0.2
"""A conversation coming back is moved by the load guard only past ``max(4, 20% of the mean)`` above the mean."""


class Replica:
    """One simulated replica: a metadata-only cache, the index its events feed, and what it served."""

    def __init__(self, num_blocks: int, block_size: int = BLOCK_SIZE) -> None:
        self.index = BlockIndex()
        self.cache = RadixCache(KVBlockPool(num_blocks, block_size), event_listener=self.index)
        self.num_blocks = num_blocks
        self.served = 0

    def serve(self, prompt: array, answer: array) -> int:
        """Run one request; its cached prompt tokens (0 when it cannot fit at all)."""
        self.served += 1
        total = len(prompt) + len(answer)
        if self.cache.pool.blocks_for_tokens(total) > self.num_blocks:
            return 0
        lease = self.cache.acquire(prompt)
        try:
            self.cache.reserve(lease, total)
        except OutOfBlocksError:
            self.cache.release(lease)
            return 0
        self.cache.commit(lease, prompt + answer)
        return lease.num_cached_tokens


def session_key(request: ReplayRequest) -> str:
    """The conversation id, or for a trace line the first hash block of its prompt."""
    if request.conversation is None and request.prompt:
        return f"block{request.prompt[0] // MOONCAKE_BLOCK_TOKENS}"
    return request.conversation_id


class ConsistentHashRing:
    """Consistent hashing (Karger et al.): ``virtual_nodes`` points per replica on a 64-bit ring.  O(log points)."""

    def __init__(self, num_replicas: int, virtual_nodes: int = 64) -> None:
        points = sorted(
            (xxhash.xxh64_intdigest(f"{r}/{v}".encode()), r) for r in range(num_replicas) for v in range(virtual_nodes)
        )
        self._keys = [k for k, _ in points]
        self._owners = [r for _, r in points]

    def owner(self, key: str) -> int:
        i = bisect.bisect(self._keys, xxhash.xxh64_intdigest(key.encode())) % len(self._keys)
        return self._owners[i]


class TextPrefixRouter:
    """Ray Serve LLM's prefix-aware routing, approximated: one LRU prefix tree per replica of the prompts routed
    there, trimmed to ``tree_chars`` characters (tokens here)."""

    def __init__(self, num_replicas: int, tree_chars: int = TEXT_TREE_CHARS, seed: int = 0) -> None:
        import random

        blocks = -(-tree_chars // BLOCK_SIZE)
        self.trees = [RadixCache(KVBlockPool(blocks, BLOCK_SIZE)) for _ in range(num_replicas)]
        self._rng = random.Random(seed)

    def choose(self, prompt: array, loads: Sequence[int]) -> int:
        if too_uneven(loads, IMBALANCE_ABS, IMBALANCE_REL):
            choice = power_of_two(loads, self._rng)
        else:
            matched = [tree.match(prompt).num_tokens for tree in self.trees]
            best = max(matched)
            if prompt and best / len(prompt) >= TEXT_MATCH_RATE:
                choice = min((i for i, m in enumerate(matched) if m == best), key=lambda i: (loads[i], i))
            else:
                choice = min(range(len(self.trees)), key=lambda i: (self.trees[i].stats().used_blocks, loads[i], i))
        self._record(self.trees[choice], prompt)
        return choice

    @staticmethod
    def _record(tree: RadixCache, prompt: array) -> None:
        if tree.pool.blocks_for_tokens(len(prompt)) > tree.pool.num_blocks:
            return
        lease = tree.acquire(prompt)
        try:
            tree.reserve(lease, len(prompt))
        except OutOfBlocksError:
            tree.release(lease)
            return
        tree.commit(lease, prompt)


def simulate(
    requests: Sequence[ReplayRequest],
    num_replicas: int,
    num_blocks: int,
    router: str,
    reference_hits: Sequence[int] | None = None,
) -> dict:
    """Serve ``requests`` on ``num_replicas`` replicas of ``num_blocks`` blocks each, routed by ``router``.

    Returns ``hit_rate``, ``imbalance``, ``hits`` (cached prompt tokens per request) and ``kept``: of the requests
    whose conversation came before, the share sent to the replica that served its previous turn (``None`` when no
    conversation has two requests, as in a trace). For the exact and oracle routers, given ``reference_hits`` (the
    one big replica's ``hits``), it also splits the tokens they miss against it: ``steered`` (a longer prefix sat on
    another replica; the router chose otherwise), ``absent`` (no replica held the prefix any more: evicted for lack
    of memory, duplicates included) and ``other`` (the rest: partial blocks, a prefix the chosen replica lost to its
    own eviction), each as a fraction of all prompt tokens.

    Raises:
        InvalidArgumentError: no request, no replica, ``num_blocks < 1`` or a router not in :data:`ROUTERS`.
    """
    if router not in ROUTERS:
        raise InvalidArgumentError(f"unknown router {router!r}; choose one of {ROUTERS}")
    if not requests or num_replicas < 1:
        raise InvalidArgumentError(f"need requests and replicas, got {len(requests)} and {num_replicas}")
    replicas = [Replica(num_blocks) for _ in range(num_replicas)]
    ring = ConsistentHashRing(num_replicas) if router == "affinity" else None
    text = TextPrefixRouter(num_replicas) if router == "text prefix" else None
    exact = ExactPrefixRouter(
        BLOCK_SIZE,
        load_penalty_tokens=LOAD_PENALTY_TOKENS,
        relative_above=LOAD_RELATIVE_ABOVE,
        imbalance_abs=IMBALANCE_ABS,
        imbalance_rel=IMBALANCE_REL,
        memory_weight=MEMORY_WEIGHT,
        evict_weight=EVICT_WEIGHT,
        continuation_abs=CONTINUATION_ABS,
        continuation_rel=CONTINUATION_REL,
    )
    pools = [num_blocks] * num_replicas
    indexes = [r.index for r in replicas]
    hits: list[int] = []
    steered = absent = prompt = answered = kept = returning = 0
    previous: dict[str, int] = {}
    for i, request in enumerate(requests):
        loads = [r.served for r in replicas]
        if router == "round-robin":
            choice = i % num_replicas
        elif ring is not None:
            choice = ring.owner(session_key(request))
        elif text is not None:
            choice = text.choose(request.prompt, loads)
        else:
            if router == "exact":
                free = [r.cache.pool.num_free_blocks for r in replicas]
                # The mean answer so far: what a live router sees in the blocks each replica stores after a prompt.
                expected = answered / i if i else 0.0
                decision = exact.choose(
                    request.prompt, indexes, loads, free_blocks=free, num_blocks=pools, expected_new_tokens=expected
                )
                choice, cached = decision.replica, decision.cached_tokens
            else:
                cached = tuple(exact.cached_tokens(request.prompt, indexes))
                choice = max(range(num_replicas), key=lambda r: (cached[r], -loads[r], -r))
            steered += max(cached) - cached[choice]
            if reference_hits is not None:
                absent += max(0, reference_hits[i] // BLOCK_SIZE * BLOCK_SIZE - max(cached))
        hits.append(replicas[choice].serve(request.prompt, request.answer))
        if request.conversation_id in previous:
            returning += 1
            kept += previous[request.conversation_id] == choice
        previous[request.conversation_id] = choice
        prompt += len(request.prompt)
        answered += len(request.answer)
    served = [r.served for r in replicas]
    result = {
        "hit_rate": sum(hits) / prompt if prompt else 0.0,
        "imbalance": max(served) * num_replicas / len(requests),
        "hits": hits,
        "kept": kept / returning if returning else None,
    }
    if reference_hits is not None and router in ("exact", "oracle") and prompt:
        missed = sum(reference_hits) - sum(hits)
        result["missed"] = {"steered": steered / prompt, "absent": absent / prompt}
        result["missed"]["other"] = missed / prompt - result["missed"]["steered"] - result["missed"]["absent"]
    return result


def reordered(requests: Sequence[ReplayRequest], order: str, seed: int) -> list[ReplayRequest] | None:
    """The same requests in another order, each conversation's turns still in turn order: ``shuffled`` is
    round-robin over the conversations in a seeded random order, ``random`` lets a seeded random conversation take
    its next turn each step (``prefixcache replay --order random``).  ``None`` when no conversation has a second
    request (a trace, which keeps its time order).

    Raises:
        InvalidArgumentError: an unknown order.
    """
    if order not in ORDERS:
        raise InvalidArgumentError(f"unknown order {order!r}; choose one of {ORDERS}")
    per_conversation: dict[str, list[ReplayRequest]] = {}
    for request in requests:
        per_conversation.setdefault(request.conversation_id, []).append(request)
    if len(per_conversation) == len(requests):
        return None
    conversations = list(per_conversation.values())
    if order == "shuffled":
        random.Random(seed).shuffle(conversations)
        return interleave(conversations, "round-robin", seed)
    return interleave(conversations, "random", seed)


def working_set_blocks(requests: Sequence[ReplayRequest]) -> int:
    """Blocks one unbounded cache holds after serving every request."""
    unbounded = sum(-(-(len(r.prompt) + len(r.answer)) // BLOCK_SIZE) + 2 for r in requests)
    replica = Replica(unbounded)
    for request in requests:
        replica.serve(request.prompt, request.answer)
    return replica.cache.stats().used_blocks


def measure(requests: Sequence[ReplayRequest], replica_counts: Sequence[int], show_progress: bool = True) -> dict:
    """Per replica count: the one-big-replica baseline and every router's hit rate and imbalance; with
    ``REPLICA_SHARE`` among the counts, ``exact_by_memory``: share -> the exact router's hit rate over the big
    replica's there, at each of :data:`MEMORY_SHARES` (None where the big replica hits nothing), and
    ``exact_by_order``: order -> per seed of :data:`ORDER_SEEDS`, the exact router's and round-robin's hit rates over
    the big replica's and the exact router's imbalance, with the requests :func:`reordered` (none for a trace).

    Raises:
        InvalidArgumentError: no request, or a replica count below 1.
    """
    if not requests:
        raise InvalidArgumentError("no requests to route")
    # A replica must at least fit the two longest requests, or small workloads would be all misses.
    longest = max(-(-(len(r.prompt) + len(r.answer)) // BLOCK_SIZE) + 2 for r in requests)
    working_set = working_set_blocks(requests)
    per_replica = max(2 * longest, working_set // REPLICA_SHARE)
    rows = []
    for n in progress(replica_counts, "route: replicas", len(replica_counts), show_progress):
        big = simulate(requests, 1, per_replica * n, "round-robin")
        routed = {name: simulate(requests, n, per_replica, name, big["hits"]) for name in ROUTERS}
        for result in routed.values():
            del result["hits"]
        rows.append({"replicas": n, "baseline": big["hit_rate"], **routed})
    memory = {}
    if REPLICA_SHARE in replica_counts:
        at_share = next(row for row in rows if row["replicas"] == REPLICA_SHARE)
        for share in MEMORY_SHARES:
            blocks = max(2 * longest, working_set // share)
            if blocks == per_replica:  # the row above already ran this sizing
                big, exact = at_share["baseline"], at_share["exact"]["hit_rate"]
            else:
                big = simulate(requests, 1, blocks * REPLICA_SHARE, "round-robin")["hit_rate"]
                exact = simulate(requests, REPLICA_SHARE, blocks, "exact")["hit_rate"]
            memory[share] = exact / big if big else None
    by_order: dict[str, list[dict]] = {}
    if REPLICA_SHARE in replica_counts:
        for order in ORDERS:
            for seed in ORDER_SEEDS:
                other = reordered(requests, order, seed)
                if other is None:
                    break
                big = simulate(other, 1, per_replica * REPLICA_SHARE, "round-robin")["hit_rate"]
                exact = simulate(other, REPLICA_SHARE, per_replica, "exact")
                rr = simulate(other, REPLICA_SHARE, per_replica, "round-robin")["hit_rate"]
                by_order.setdefault(order, []).append(
                    {
                        "seed": seed,
                        "exact": exact["hit_rate"] / big if big else None,
                        "exact_load": exact["imbalance"],
                        "round_robin": rr / big if big else None,
                    }
                )
    return {
        "requests": len(requests),
        "replica_blocks": per_replica,
        "rows": rows,
        "exact_by_memory": memory,
        "exact_by_order": by_order,
    }


def run(quick: bool = False, replicas: Sequence[int] | None = None) -> BenchResult:
    """Hit rate and load imbalance of each router on the shared transcripts and the Mooncake conversation trace."""
    counts = tuple(replicas) if replicas else (QUICK_REPLICAS if quick else REPLICAS)
    results: dict[str, dict] = {}
    skipped: list[str] = []
    for label, (name, full, small) in WORKLOADS.items():
        path = DATA_DIR / name
        if not path.is_file():
            skipped.append(name)
            continue
        start = time.perf_counter()
        requests, _ = load_requests(Path(path), ByteTokenizer(), limit=small if quick else full)
        results[label] = measure(requests, counts, not quick)
        results[label]["seconds"] = time.perf_counter() - start
    rows = []
    for label, r in results.items():
        for row in r["rows"]:
            big = row["baseline"]
            rows.append(
                (
                    label,
                    row["replicas"],
                    100 * row["baseline"],
                    *(100 * row[name]["hit_rate"] for name in ROUTERS),
                    *(100 * row[name]["hit_rate"] / big if big else None for name in ("exact", "oracle")),
                    *(row[name]["imbalance"] for name in ROUTERS),
                )
            )
    notes = [
        f"Token hit rate (%) of all prompt tokens; block size {BLOCK_SIZE}; ByteTokenizer; conversations interleaved "
        f"round-robin; each replica holds 1/{REPLICA_SHARE} of the working set; 'one big' = one replica with N x that.",
        "load = max / mean requests per replica. text prefix = Ray Serve's prefix-aware router (routing history); "
        "exact = block hashes from each replica's KV events; oracle = the longest exact match, load ignored.",
    ]
    for label, r in results.items():
        notes.append(
            f"{label}: {r['requests']:,} requests, {r['replica_blocks']:,} blocks per replica; {r['seconds']:.1f} s"
        )
        row = next((x for x in r["rows"] if x["replicas"] == REPLICA_SHARE), r["rows"][0])
        missed = row["exact"]["missed"]
        notes.append(
            f"  exact at N={row['replicas']} misses vs one big, % of prompt tokens: steered away from the prefix "
            f"{100 * missed['steered']:.1f}, prefix evicted everywhere {100 * missed['absent']:.1f}, "
            f"other {100 * missed['other']:.1f}"
        )
        kept = {name: row[name]["kept"] for name in ROUTERS if row[name]["kept"] is not None}
        if kept:
            notes.append(
                f"  later turns sent to their previous turn's replica at N={row['replicas']}, %: "
                + ", ".join(f"{name} {100 * share:.0f}" for name, share in kept.items())
            )
        ratios = {share: ratio for share, ratio in r["exact_by_memory"].items() if ratio is not None}
        if ratios:
            cells = ", ".join(f"1/{share} {100 * ratio:.1f}" for share, ratio in ratios.items())
            notes.append(
                f"  exact/big % at N={REPLICA_SHARE} by memory per replica (of the working set): {cells}; "
                f"mean {100 * sum(ratios.values()) / len(ratios):.1f}"
            )
        for order, runs in r["exact_by_order"].items():
            cells = ", ".join(
                f"{100 * x['exact']:.1f} (load {x['exact_load']:.2f}; round-robin {100 * x['round_robin']:.0f})"
                for x in runs
                if x["exact"] is not None
            )
            notes.append(
                f"  exact/big % at N={REPLICA_SHARE}, 1/{REPLICA_SHARE}, {order} order, seeds 0-{len(runs) - 1}: "
                f"{cells}"
            )
    notes += [f"skipped {name}: not found in {DATA_DIR}" for name in skipped]
    table = Table(
        title="route: N replicas behind a router (cache-only simulation)",
        headers=(
            "workload",
            "N",
            "one big %",
            "round-robin %",
            "affinity %",
            "text %",
            "exact %",
            "oracle %",
            "exact/big %",
            "oracle/big %",
            "RR load",
            "affinity load",
            "text load",
            "exact load",
            "oracle load",
        ),
        rows=tuple(rows),
        notes=tuple(notes),
    )
    data = {"block_size": BLOCK_SIZE, "replica_share": REPLICA_SHARE, "skipped": skipped, "workloads": results}
    return BenchResult("route", (table,), data)
