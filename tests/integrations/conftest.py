"""The adapters' extras: skipped on a user's machine without them, required in CI (which installs every extra)."""

from __future__ import annotations

import os

import pytest

NEEDED = {"test_langchain.py": ("langchain_core", "langchain"), "test_smolagents.py": ("smolagents", "smolagents")}


def pytest_ignore_collect(collection_path, config):
    module, extra = NEEDED.get(collection_path.name, (None, None))
    if module is None or os.environ.get("CI") == "true":
        return None
    try:
        __import__(module)
    except ImportError:
        return True
    return None


@pytest.fixture
def weather_calls() -> list[str]:
    """Five tool calls for five cities: the scripted model's answers for an agent's first five steps."""
    cities = ["Paris", "Oslo", "Lima", "Pune", "Kyiv"]
    return [
        f'<tool_call>\n{{"name": "get_weather", "arguments": {{"city": "{city}"}}}}\n</tool_call>' for city in cities
    ]
