"""Beyond one process: the cache's KV events on the wire, and routing requests to the replica that holds their prefix.

- :mod:`~prefixcache.distributed.wire`: vLLM's ``EventBatch`` msgpack layout for :mod:`prefixcache.cache.events`.
- :mod:`~prefixcache.distributed.publisher` / :mod:`~prefixcache.distributed.subscriber`: a ZMQ PUB socket with
  sequence numbers and a replay endpoint, and the subscriber that mirrors a replica into a
  :class:`~prefixcache.cache.events.BlockIndex` (extra ``[events]``: pyzmq, msgspec).
- :mod:`~prefixcache.distributed.router`: the exact-prefix router's score and its load guard (no extra needed).
"""
