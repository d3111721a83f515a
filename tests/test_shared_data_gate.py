"""The gate for files under ../shared/data (tests/conftest.py): a user's clone without them skips those tests with
the missing path as reason; under CI (``CI=true``) a missing file fails the test instead of skipping it."""

from __future__ import annotations

import pytest


def test_a_missing_shared_file_skips_with_its_path_outside_ci(shared_data, monkeypatch) -> None:
    monkeypatch.delenv("CI", raising=False)

    with pytest.raises(pytest.skip.Exception, match="no-such-file.jsonl"):
        shared_data("no-such-file.jsonl")


@pytest.mark.parametrize("value", ["true", "TRUE", "1"])
def test_a_missing_shared_file_fails_under_ci(shared_data, monkeypatch, value: str) -> None:
    monkeypatch.setenv("CI", value)

    with pytest.raises(pytest.fail.Exception, match="no-such-file.jsonl.*CI=true"):
        shared_data("no-such-file.jsonl")


def test_a_folder_missing_one_member_counts_as_missing(shared_data, monkeypatch) -> None:
    monkeypatch.setenv("CI", "true")

    with pytest.raises(pytest.fail.Exception, match="absent.json"):
        shared_data(".", "absent.json")


@pytest.mark.parametrize("value", ["", "false", "0"])
def test_ci_unset_or_false_is_a_local_run(shared_data, monkeypatch, value: str) -> None:
    monkeypatch.setenv("CI", value)

    with pytest.raises(pytest.skip.Exception):
        shared_data("no-such-file.jsonl")
