"""prefixcache on Ray Serve (extra ``[ray]``): replicas that each hold a
:class:`~prefixcache.engine.runner.PrefixCachingRunner` and publish their KV events, and a request router that
sends each prompt to the replica caching most of it.

- :mod:`~prefixcache.ray.deployment`: the ``PrefixCacheServer`` deployment and its ``generate`` handle;
  ``serve run prefixcache.ray.deployment:app``.
- :mod:`~prefixcache.ray.router`: ``ExactPrefixRequestRouter``, a Ray Serve ``RequestRouter``.

Nothing here is imported by ``import prefixcache``; Ray is only needed when these modules are imported.
"""
