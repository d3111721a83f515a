"""The engine benchmark's prefix-aware scheduling case: new sessions behind one uncached system prompt prefill it once
with ``policy="lpm"`` and once per session with ``"fcfs"``, with equal tokens."""

from __future__ import annotations

import dataclasses

from prefixcache.bench.engine_batching import measure_shared_prefill
from prefixcache.bench.engine_setup import QUICK


def test_shared_system_prompt_is_prefilled_once_with_prefix_aware_scheduling() -> None:
    setup = dataclasses.replace(
        QUICK, batch_sessions=4, batch_system_tokens=40, batch_question_tokens=8, batch_new_tokens=3
    )
    figures = measure_shared_prefill(setup)
    assert figures["lpm"]["prefilled_tokens"] == 40 + 4 * 8
    assert figures["fcfs"]["prefilled_tokens"] == 4 * (40 + 8)
    assert figures["lpm"]["wall_s"] > 0 and figures["fcfs"]["wall_s"] > 0
