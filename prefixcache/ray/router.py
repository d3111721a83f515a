"""A Ray Serve request router that scores replicas by the exact prompt tokens they hold.

Each replica of :class:`~prefixcache.ray.deployment.PrefixCacheServer` publishes its cache's KV events on ZMQ
(:mod:`prefixcache.distributed.publisher`) and reports the endpoints, its model fingerprint and block size through
Ray Serve's routing stats (``record_routing_stats``).  The router, which runs wherever the deployment handle is
used (the driver, or Serve's HTTP proxy), keeps one :class:`~prefixcache.distributed.subscriber.ZmqEventSubscriber`
per replica feeding a :class:`~prefixcache.cache.events.BlockIndex`, and ranks replicas with
:class:`~prefixcache.distributed.router.ExactPrefixRouter`: cached prompt tokens minus a load penalty and a memory
cost from the free blocks each replica reports, power of two choices when the preferred replica is too busy.  A
replica's load is Ray Serve's queue length for it (the requests sent there and not finished) plus the requests this
router has routed there and Ray Serve has not sent yet: Ray Serve decides a burst of requests before any is sent, so
the queue lengths alone would be the same for the whole burst.  It returns two ranks, the chosen replica then the
rest by cached tokens, so Ray Serve falls through to another replica if the first rejects the request or has died.

Ray Serve's ``RequestRouter`` API is alpha (Ray >= 2.46); this module is written against Ray 2.60.
"""

from __future__ import annotations

import logging
import time
import weakref
from typing import Any, ClassVar

from ray.serve.request_router import FIFOMixin, PendingRequest, ReplicaID, RequestRouter, RunningReplica

from prefixcache.cache.events import BlockIndex, check_namespace
from prefixcache.distributed.router import ExactPrefixRouter
from prefixcache.distributed.subscriber import ZmqEventSubscriber
from prefixcache.errors import PrefixCacheError

__all__ = ["ExactPrefixRequestRouter", "memory_of", "routed_namespace"]

logger = logging.getLogger(__name__)

UNSENT_GRACE_S = 30.0
"""Seconds after which a routed request neither sent nor routed again is no longer counted (a request waiting for a
replica in Ray Serve's routing loop is decided again at least every 0.5 s, and one that is sent is sent within
milliseconds of its decision; one never resolved, as ``handle.choose_replica(..., _reserve=False)`` leaves it, or
one whose caller gave up just after it resolved, has no hook)."""


def routed_namespace(fingerprint: str, namespace: str | None) -> str:
    """The tree namespace a runner with ``fingerprint`` uses for a request's ``namespace`` (the same rule as
    :meth:`~prefixcache.engine.runner.PrefixCachingRunner.namespace_key`, so the router hashes prompts exactly as
    the replica cached them).

    Raises:
        NamespaceError: ``namespace`` neither ``None`` nor a ``str``.
    """
    namespace = check_namespace(namespace)
    return f"{fingerprint}:" + ("-" if namespace is None else "=" + namespace)


def request_of(pending: PendingRequest | None) -> dict[str, Any] | None:
    """The ``generate`` request dict of a pending call, or None for any other call."""
    if pending is None:
        return None
    candidate = pending.args[0] if pending.args else pending.kwargs.get("request")
    if isinstance(candidate, dict) and isinstance(candidate.get("prompt_ids"), (list, tuple)):
        return candidate
    return None


def _where(chosen: ReplicaID, pending: PendingRequest) -> ReplicaID | None:
    """The replica a routed request is going to: the one its routing future resolved to (Ray Serve falls through to
    the next rank when the chosen replica is full), the chosen one until it resolves, None once it was cancelled or
    failed."""
    future = getattr(pending, "future", None)
    if future is None or not future.done():
        return chosen
    if future.cancelled() or future.exception() is not None:
        return None
    return getattr(future.result(), "replica_id", chosen)


def memory_of(replicas: list[RunningReplica]) -> tuple[list[int] | None, list[int] | None]:
    """Free blocks and pool sizes the replicas report in their routing stats, or ``(None, None)`` unless every
    replica reports both, as ints with ``0 <= free_blocks <= num_blocks`` and ``num_blocks >= 1`` (a replica that
    has not reported yet would otherwise look full or empty)."""
    stats = [r.routing_stats or {} for r in replicas]

    def is_count(value: object) -> bool:
        return isinstance(value, int) and not isinstance(value, bool)

    if not all(is_count(s.get("free_blocks")) and is_count(s.get("num_blocks")) for s in stats):
        return None, None
    if not all(0 <= s["free_blocks"] <= s["num_blocks"] and s["num_blocks"] >= 1 for s in stats):
        return None, None
    return [s["free_blocks"] for s in stats], [s["num_blocks"] for s in stats]


class ExactPrefixRequestRouter(FIFOMixin, RequestRouter):
    """Route ``generate`` calls to the replica holding the longest exact prefix of the prompt.

    Configure with ``RequestRouterConfig(request_router_class=ExactPrefixRequestRouter, request_router_kwargs=
    {...})``; the kwargs reach :meth:`initialize_state`.  Calls without a ``prompt_ids`` request, and requests the
    router cannot hash (bad token ids or namespace), get every replica in one rank (Ray Serve's own choice among
    them): the replica then raises the package's error to the caller, where an exception out of the router would
    end Ray Serve's routing task and leave the caller waiting.
    """

    live: ClassVar[weakref.WeakSet] = weakref.WeakSet()
    """The routers of this process (for tests and debugging)."""

    def initialize_state(
        self,
        load_penalty_tokens: float = 16.0,
        relative_above: float | None = None,
        imbalance_abs: float = 4,
        imbalance_rel: float = 0.5,
        memory_weight: float = 4.0,
        evict_weight: float = 0.0,
        continuation_abs: float = 4,
        continuation_rel: float | None = None,
        seed: int = 0,
    ) -> None:
        """Router settings; see :class:`~prefixcache.distributed.router.ExactPrefixRouter` (loads are request counts,
        so the penalty is absolute unless ``relative_above`` is given; the memory and eviction costs use the
        ``free_blocks`` and ``num_blocks`` each replica reports in its routing stats, refreshed every routing-stats
        period, and the eviction cost takes a request's ``max_new_tokens`` as its expected answer)."""
        self._settings = {
            "load_penalty_tokens": load_penalty_tokens,
            "relative_above": relative_above,
            "imbalance_abs": imbalance_abs,
            "imbalance_rel": imbalance_rel,
            "memory_weight": memory_weight,
            "evict_weight": evict_weight,
            "continuation_abs": continuation_abs,
            "continuation_rel": continuation_rel,
            "seed": seed,
        }
        self._routers: dict[tuple[int, int], ExactPrefixRouter] = {}
        self._mirrors: dict[ReplicaID, tuple[str, BlockIndex, ZmqEventSubscriber]] = {}
        self._routed: dict[ReplicaID, int] = {}
        # Requests routed and not yet sent, oldest first: id(pending request) -> (replica chosen, request, when).
        self._unsent: dict[int, tuple[ReplicaID, PendingRequest, float]] = {}
        self._clock = time.monotonic
        ExactPrefixRequestRouter.live.add(self)

    @property
    def num_mirrored(self) -> int:
        """Replicas whose KV events this router follows."""
        return len(self._mirrors)

    @property
    def num_unsent(self) -> dict[ReplicaID, int]:
        """Requests routed to each replica that Ray Serve has not sent yet, by this router's count (replicas with none
        are left out).  A request counts on the replica its routing resolved to (Ray Serve falls through to the
        second rank when the chosen replica is full), and no longer once it is sent, cancelled or failed, or
        after :data:`UNSENT_GRACE_S`."""
        counts: dict[ReplicaID, int] = {}
        for chosen, pending, _ in list(self._unsent.values()):
            where = _where(chosen, pending)
            if where is not None:
                counts[where] = counts.get(where, 0) + 1
        return counts

    def _forget_stale(self) -> None:
        now = self._clock()
        for key, (chosen, pending, decided_at) in list(self._unsent.items()):
            if now - decided_at > UNSENT_GRACE_S or _where(chosen, pending) is None:
                del self._unsent[key]

    def _forget_one_resolved_to(self, replica_id: ReplicaID) -> None:
        # Which of the requests resolved to that replica does not matter for the count.
        for key, (chosen, pending, _) in list(self._unsent.items()):
            future = getattr(pending, "future", None)
            if future is not None and future.done() and _where(chosen, pending) == replica_id:
                del self._unsent[key]
                return

    def on_send_request(self, replica_id: ReplicaID) -> None:
        # From now on Ray Serve's queue length counts the request: stop counting the oldest one resolved there.
        super().on_send_request(replica_id)
        self._forget_one_resolved_to(replica_id)

    def on_new_queue_len_info(self, replica_id: ReplicaID, num_ongoing_requests: int) -> None:
        # The replica's own count, which includes every request it has received or reserved a slot for.
        # ``handle.choose_replica`` reserves a slot and reports this, then dispatches with no on_send_request: stop
        # counting a request resolved there.  After a plain send (already forgotten by on_send_request) this forgets
        # one more only if another request resolved there is about to be sent in this same event-loop turn.
        super().on_new_queue_len_info(replica_id, num_ongoing_requests)
        self._forget_one_resolved_to(replica_id)

    def _index(self, replica: RunningReplica) -> BlockIndex | None:
        stats = replica.routing_stats or {}
        endpoint = stats.get("kv_events_endpoint")
        if not endpoint:
            return None
        known = self._mirrors.get(replica.replica_id)
        if known is not None and known[0] == endpoint and known[2].healthy:
            return known[1]
        if known is not None:
            self._drop(replica.replica_id)
        index = BlockIndex(strict=False)
        subscriber = ZmqEventSubscriber(endpoint, stats.get("kv_events_replay_endpoint"), index)
        self._mirrors[replica.replica_id] = (endpoint, index, subscriber)
        return index

    def _drop(self, replica_id: ReplicaID) -> None:
        known = self._mirrors.pop(replica_id, None)
        if known is not None:
            known[2].close(timeout_s=1.0)

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        self._drop(replica_id)
        for key, (chosen, pending, _) in list(self._unsent.items()):
            if _where(chosen, pending) == replica_id:
                del self._unsent[key]

    async def choose_replicas(
        self, candidate_replicas: list[RunningReplica], pending_request: PendingRequest | None = None
    ) -> list[list[RunningReplica]]:
        live = set(self.curr_replicas)
        for gone in [r for r in self._mirrors if r not in live]:
            self._drop(gone)
        request = request_of(pending_request)
        if request is None or len(candidate_replicas) < 2:
            return [candidate_replicas]
        stats = next((r.routing_stats for r in candidate_replicas if (r.routing_stats or {}).get("fingerprint")), None)
        if stats is None:
            return [candidate_replicas]
        key = (int(stats["block_size"]), int(stats.get("hash_seed", 0)))
        router = self._routers.get(key)
        if router is None:
            router = ExactPrefixRouter(key[0], hash_seed=key[1], index_namespace=None, **self._settings)
            self._routers[key] = router
        empty = BlockIndex()
        indexes = [self._index(r) or empty for r in candidate_replicas]
        self._forget_stale()
        unsent = self.num_unsent
        loads = [
            (self.replica_queue_len_cache.get(r.replica_id) or 0) + unsent.get(r.replica_id, 0)
            for r in candidate_replicas
        ]
        routed = [self._routed.get(r.replica_id, 0) for r in candidate_replicas]
        free, pools = memory_of(candidate_replicas)
        answer = request.get("max_new_tokens")
        # Beyond 2**53 the float is inexact anyway, and far beyond it float() overflows.
        expected = float(min(answer, 2**53)) if isinstance(answer, int) and answer > 0 else 0.0
        try:
            namespace = routed_namespace(stats["fingerprint"], request.get("namespace"))
            decision = router.choose(request["prompt_ids"], indexes, loads, namespace, routed, free, pools, expected)
        except PrefixCacheError as exc:
            logger.debug("not routing by prefix: %s", exc)
            return [candidate_replicas]
        chosen = candidate_replicas[decision.replica]
        # Counted at decision time: requests routed together would otherwise all see the same tallies and tie.
        self._routed[chosen.replica_id] = self._routed.get(chosen.replica_id, 0) + 1
        if pending_request is not None:
            # Routed again (its replica was full, or rejected it): it moves to the end, counted once.
            self._unsent.pop(id(pending_request), None)
            self._unsent[id(pending_request)] = (chosen.replica_id, pending_request, self._clock())
        rest = sorted(
            (i for i in range(len(candidate_replicas)) if i != decision.replica),
            key=lambda i: (-decision.cached_tokens[i], loads[i]),
        )
        return [[chosen], [candidate_replicas[i] for i in rest]]
