"""Agent-framework adapters that run a :class:`~prefixcache.PrefixCachingRunner` in-process.

``prefixcache.integrations.langchain.ChatPrefixCache`` (extra ``prefixcache[langchain]``) is a LangChain chat model;
``prefixcache.integrations.smolagents.PrefixCacheModel`` (extra ``prefixcache[smolagents]``) a smolagents model.
Import the submodule you need; this package imports neither framework.
"""
