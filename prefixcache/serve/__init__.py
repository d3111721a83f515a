"""An OpenAI-compatible server over a :class:`~prefixcache.PrefixCachingRunner` (extra ``prefixcache[server]``).

``create_app`` builds the FastAPI app (chat completions with tools and streaming, completions, models, health,
Prometheus metrics, prefix warming); ``serve_forever`` and ``start_background`` run it under uvicorn.
"""

from prefixcache.serve.app import create_app
from prefixcache.serve.auth import ApiKeys
from prefixcache.serve.server import BackgroundServer, serve_forever, start_background

__all__ = ["ApiKeys", "BackgroundServer", "create_app", "serve_forever", "start_background"]
