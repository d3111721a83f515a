"""Speculative decoding in the engine core, as a specification: greedy requests arriving at drawn steps, some
cancelled, on a pool small enough to preempt, verifying adversarial drafts (all right, all wrong, right then wrong,
junk, of drawn lengths ending anywhere in a block, crossing a stop token or a stop sequence) give token for token
what each gives decoded alone without speculation, emit nothing twice or past their end, hold no block for a rejected
position, and leave the cache quiescent.  Then the real drafter (the request's context and the cache's blocks) on a
repeated prompt, logprobs, grammars, and the engine's counters.  ``PREFIXCACHE_PROPERTY_EXAMPLES`` sets the examples
drawn (40; a bug hunt runs thousands)."""

from __future__ import annotations

import os
import random
from collections.abc import Sequence
from concurrent.futures import CancelledError

import pytest
import torch
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from prefixcache import PrefixCachingRunner, SamplingParams
from prefixcache.engine.batching import BatchEngine
from prefixcache.engine.core import EngineCore
from prefixcache.engine.draft import DraftLength
from prefixcache.engine.request import EngineRequest
from prefixcache.engine.speculation import VerifyClock
from prefixcache.errors import InvalidArgumentError
from prefixcache.models.llama import LlamaModel
from prefixcache.testing import assert_quiescent

BLOCK = 4
VOCAB = 259
MAX_NEW = 14
PREFIXES = [list(b"System: be brief. "), list(b"Tool result: ")]
_ANSWERS: dict[tuple[int, ...], list[int]] = {}


def _ids(n: int, seed: int) -> list[int]:
    return torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def full_answer(tiny: LlamaModel, prompt: Sequence[int]) -> list[int]:
    """The prompt's greedy answer of ``MAX_NEW`` tokens decoded alone, serially, without speculation: the reference
    (a shorter request's answer is its prefix)."""
    key = tuple(prompt)
    if key not in _ANSWERS:
        runner = PrefixCachingRunner(tiny, cache_tokens=4096, block_size=BLOCK)
        _ANSWERS[key] = list(runner.generate(list(prompt), SamplingParams(max_new_tokens=MAX_NEW)).token_ids)
    return _ANSWERS[key]


def expected(answer: list[int], max_new: int, stop_token: int | None, stop_seq: tuple[int, ...]) -> tuple[list, str]:
    """The tokens and finish reason of a request whose greedy answer is ``answer``: cut after the first stop token or
    the first completed stop sequence, else at ``max_new``."""
    for i, token in enumerate(answer[:max_new]):
        if token == stop_token or (stop_seq and tuple(answer[max(0, i + 1 - len(stop_seq)) : i + 1]) == stop_seq):
            return answer[: i + 1], "stop"
    return answer[:max_new], "length"


class Adversary:
    """A draft source that knows every prompt's reference answer and proposes, each step, a draft of a drawn length
    (1 .. max_tokens) of a drawn kind: the right continuation, all wrong, right then one wrong token, random ids,
    or none.  Records what it proposed and what was accepted."""

    KINDS = ("right", "right", "wrong", "partial", "junk", "none")

    def __init__(self, answers: dict[tuple[int, ...], list[int]], seed: int, kinds: Sequence[str] = KINDS) -> None:
        self.answers = answers
        self.rng = random.Random(seed)
        self.kinds = tuple(kinds)
        self.offered = 0  # draft tokens proposed
        self.proposed = 0  # of them, verified (the engine cuts a draft where the budget, pool or grammar says)
        self.accepted = 0

    def propose(self, request: EngineRequest, max_tokens: int) -> list[int]:
        assert max_tokens >= 1 and request.sampling.temperature == 0
        draft = self._draft(request, max_tokens)
        self.offered += len(draft)
        return draft

    def _draft(self, request: EngineRequest, max_tokens: int) -> list[int]:
        done = len(request.generated)
        right = self.answers[tuple(request.prompt)][done : done + max_tokens]  # after the known tokens
        k = self.rng.randint(1, max_tokens)
        kind = self.rng.choice(self.kinds)
        if kind == "right":
            return right[:k]
        if kind == "wrong":
            return [(t + 1) % VOCAB for t in right[:k]]
        if kind == "partial":
            j = self.rng.randint(0, k - 1)
            return right[:j] + [(right[j] + 1) % VOCAB] + right[j + 1 : k]
        if kind == "junk":
            return [self.rng.randrange(VOCAB) for _ in range(k)]
        return []

    def verified(self, request: EngineRequest, num_proposed: int, num_accepted: int) -> None:
        assert 0 <= num_accepted <= num_proposed
        self.proposed += num_proposed
        self.accepted += num_accepted


def _stopper(stop_seq: tuple[int, ...], seen: list[int]):
    """``on_token``: records each token; asks to stop once the answer ends with ``stop_seq`` (a stop string)."""

    def on_token(token: int) -> bool:
        seen.append(token)
        return bool(stop_seq) and tuple(seen[-len(stop_seq) :]) == stop_seq

    return on_token


@st.composite
def scenarios(draw: st.DrawFn) -> dict:
    requests = []
    for _ in range(draw(st.integers(1, 4), label="requests")):
        prefix = PREFIXES[draw(st.integers(0, 1))][: draw(st.integers(0, 8))]
        prompt = prefix + _ids(draw(st.integers(1, 5)), seed=draw(st.integers(0, 4)))
        max_new = draw(st.integers(1, MAX_NEW), label="max_new")
        stop = draw(st.sampled_from(["none", "token", "sequence"]), label="stop")
        requests.append(
            {
                "prompt": prompt,
                "max_new": max_new,
                "stop": stop,
                "stop_at": draw(st.integers(1, MAX_NEW - 1)),
                "arrival": draw(st.integers(0, 3), label="arrival"),
                "cancel": draw(st.none() | st.integers(0, 14), label="cancel"),
            }
        )
    return {
        "requests": requests,
        "num_blocks": draw(st.integers(7, 11), label="blocks"),  # a request needs 7 at most
        "max_batch_tokens": draw(st.sampled_from([3, 8, 64]), label="max_batch_tokens"),
        "seed": draw(st.integers(0, 2**31)),
    }


@settings(
    max_examples=int(os.environ.get("PREFIXCACHE_PROPERTY_EXAMPLES", "40")),
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
@given(scenarios())
def test_greedy_output_with_adversarial_drafts_equals_decoding_alone(tiny: LlamaModel, scenario: dict) -> None:
    specs = scenario["requests"]
    answers = {tuple(s["prompt"]): full_answer(tiny, s["prompt"]) for s in specs}
    runner = PrefixCachingRunner(tiny, num_blocks=scenario["num_blocks"], block_size=BLOCK)
    drafts = Adversary(answers, scenario["seed"])
    engine = BatchEngine(runner, max_batch_tokens=scenario["max_batch_tokens"], speculate="tree", drafts=drafts)
    handles: list = [None] * len(specs)
    streamed: list[list[int]] = [[] for _ in specs]
    wanted = []
    for spec in specs:
        answer = answers[tuple(spec["prompt"])]
        stop_token = answer[spec["stop_at"]] if spec["stop"] == "token" else None
        stop_seq = tuple(answer[spec["stop_at"] - 1 : spec["stop_at"] + 1]) if spec["stop"] == "sequence" else ()
        wanted.append((*expected(answer, spec["max_new"], stop_token, stop_seq), stop_token, stop_seq))
    step = 0
    while step <= 3 or engine.num_pending:
        for i, spec in enumerate(specs):
            if spec["arrival"] == step:
                _, _, stop_token, stop_seq = wanted[i]
                params = SamplingParams(
                    max_new_tokens=spec["max_new"],
                    stop_token_ids=frozenset() if stop_token is None else frozenset({stop_token}),
                )
                handles[i] = engine.submit(spec["prompt"], params, on_token=_stopper(stop_seq, streamed[i]))
            if spec["cancel"] == step and handles[i] is not None:
                handles[i].cancel()
        engine.step()
        for request in engine.core.running:  # no block held for a rejected draft position
            assert len(request.lease.block_table) <= -(-request.sequence_length() // BLOCK)
        step += 1
    for handle, seen, (tokens, reason, _, _), spec in zip(handles, streamed, wanted, specs, strict=True):
        try:
            result = handle.result()
        except CancelledError:
            assert spec["cancel"] is not None
            assert seen == tokens[: len(seen)]  # what it emitted before the cancel is the reference's beginning
            continue
        assert list(result.token_ids) == tokens
        assert result.finish_reason == reason
        assert seen == tokens  # nothing emitted past the stop, nothing twice
        assert result.usage.accepted_tokens <= result.usage.drafted_tokens
    assert_quiescent(runner.cache)
    event(f"accepted > 0: {drafts.accepted > 0}")
    event(f"preempted: {engine.preempted_requests > 0}")


def _engine(tiny: LlamaModel, kinds: Sequence[str], prompts: Sequence[list[int]], **options) -> BatchEngine:
    runner = PrefixCachingRunner(tiny, cache_tokens=1024, block_size=BLOCK)
    answers = {tuple(p): full_answer(tiny, p) for p in prompts}
    return BatchEngine(runner, speculate="tree", drafts=Adversary(answers, 7, kinds), **options)


def test_right_drafts_are_accepted_whole_and_save_forwards(tiny: LlamaModel) -> None:
    prompt = _ids(9, seed=1)
    engine = _engine(tiny, ["right"], [prompt])
    result = engine.submit(prompt, SamplingParams(max_new_tokens=MAX_NEW))
    engine.run_until_idle()
    done = result.result()
    assert list(done.token_ids) == full_answer(tiny, prompt)
    assert done.usage.accepted_tokens == done.usage.drafted_tokens > 0
    assert engine.core.accepted_tokens == done.usage.accepted_tokens
    assert engine.steps < 1 + MAX_NEW - done.usage.accepted_tokens // 2  # the prefill, then fewer decode steps
    assert_quiescent(engine.runner.cache)


def test_wrong_drafts_accept_nothing_and_give_their_blocks_back(tiny: LlamaModel) -> None:
    prompt = _ids(7, seed=2)  # 7 prompt tokens: a draft's positions run into blocks of their own
    engine = _engine(tiny, ["wrong"], [prompt])
    handle = engine.submit(prompt, SamplingParams(max_new_tokens=MAX_NEW))
    free_after = []
    while engine.step():
        free_after.append(engine.runner.cache.pool.num_free_blocks)
        for request in engine.core.running:
            assert len(request.lease.block_table) == -(-request.sequence_length() // BLOCK)
    done = handle.result()
    assert list(done.token_ids) == full_answer(tiny, prompt)
    assert done.usage.drafted_tokens > 0 and done.usage.accepted_tokens == 0
    assert_quiescent(engine.runner.cache)


def test_logprobs_of_accepted_tokens_are_those_of_decoding_one_at_a_time(tiny: LlamaModel) -> None:
    prompt = _ids(6, seed=3)
    params = SamplingParams(max_new_tokens=10, logprobs=2)
    alone = PrefixCachingRunner(tiny, cache_tokens=1024, block_size=BLOCK).generate(prompt, params)
    engine = _engine(tiny, ["right", "partial"], [prompt])
    handle = engine.submit(prompt, params)
    engine.run_until_idle()
    done = handle.result()
    assert done.usage.accepted_tokens > 0
    assert done.token_ids == alone.token_ids
    assert [r.token_id for r in done.logprobs] == list(alone.token_ids)
    for got, want in zip(done.logprobs, alone.logprobs, strict=True):
        assert got.logprob == pytest.approx(want.logprob, abs=1e-4)
        assert [t for t, _ in got.top] == [t for t, _ in want.top]


def test_sampled_requests_never_speculate(tiny: LlamaModel) -> None:
    prompt = _ids(6, seed=4)
    engine = _engine(tiny, ["right"], [prompt])
    params = SamplingParams(max_new_tokens=8, temperature=0.8, seed=5)
    handle = engine.submit(prompt, params)
    engine.run_until_idle()
    alone = PrefixCachingRunner(tiny, cache_tokens=1024, block_size=BLOCK).generate(prompt, params)
    assert handle.result().token_ids == alone.token_ids
    assert handle.result().usage.drafted_tokens == 0 and engine.core.drafted_tokens == 0


def test_the_real_drafter_accepts_tokens_on_a_repeated_prompt_and_changes_nothing(tiny: LlamaModel) -> None:
    prompt = PREFIXES[0] + _ids(5, seed=6)
    shared = PREFIXES[0] + _ids(5, seed=6)[:3] + [7]  # shares all but the last token
    runner = PrefixCachingRunner(tiny, cache_tokens=1024, block_size=BLOCK)
    engine = BatchEngine(runner, speculate="tree")
    params = SamplingParams(max_new_tokens=MAX_NEW)
    results = []
    for p in (prompt, prompt, shared):
        handle = engine.submit(p, params)
        engine.run_until_idle()
        results.append(handle.result())
    assert [list(r.token_ids) for r in results] == [full_answer(tiny, p) for p in (prompt, prompt, shared)]
    assert results[1].usage.accepted_tokens > 0  # its answer is in the cache: the tree drafts it
    assert engine.core.accepted_tokens == sum(r.usage.accepted_tokens for r in results)
    assert runner.tree_drafts().proposed_by_source["tree"] > 0
    assert runner.tree_drafts().clock.samples[0] > 0  # lone decode rows on the CPU were timed
    runner.tree_drafts().drafter.check_invariants()
    assert_quiescent(runner.cache)


def test_generate_many_speculates_and_the_serial_calls_do_not(tiny: LlamaModel) -> None:
    prompt = _ids(8, seed=8)
    runner = PrefixCachingRunner(tiny, cache_tokens=1024, block_size=BLOCK)
    params = SamplingParams(max_new_tokens=MAX_NEW)
    first = runner.generate(prompt, params)
    assert first.usage.drafted_tokens == 0
    [again] = runner.generate_many([prompt], params, speculate="tree")
    assert again.token_ids == first.token_ids and again.usage.accepted_tokens > 0


def test_bad_speculate_options_are_refused(tiny: LlamaModel) -> None:
    runner = PrefixCachingRunner(tiny, cache_tokens=256, block_size=BLOCK)
    with pytest.raises(InvalidArgumentError, match="speculate"):
        BatchEngine(runner, speculate="ngram")
    with pytest.raises(InvalidArgumentError, match="draft source"):
        EngineCore(runner.model, runner.cache, runner.checks, speculate="tree")


def test_a_grammar_cuts_drafts_before_their_verify_and_the_output_is_unchanged(tiny: LlamaModel) -> None:
    pytest.importorskip("llguidance")
    from prefixcache.chat.tokenizer import ByteTokenizer
    from prefixcache.engine.grammar import Grammar
    from prefixcache.engine.logits import LogitsPipeline

    tokenizer = ByteTokenizer()
    schema = {"type": "object", "properties": {"a": {"enum": ["yes", "no"]}}, "required": ["a"]}
    grammar = Grammar.json_schema(schema, tokenizer)
    picker = LogitsPipeline(SamplingParams(grammar=grammar), torch.device("cpu"), tiny.vocab_size)
    assert picker.draft_prefix(list(b'{"a": "ye')) == 9
    assert picker.draft_prefix(list(b'{"a": "yx')) == 8  # cut at the first token the grammar forbids
    assert picker.draft_prefix(list(b'{"a": "ye')) == 9  # nothing advanced
    params = SamplingParams(
        max_new_tokens=MAX_NEW, grammar=grammar, stop_token_ids=tokenizer.eos_token_ids, vocab_limit=VOCAB
    )
    prompt = list(b"Answer in JSON: ")
    alone = PrefixCachingRunner(tiny, cache_tokens=1024, block_size=BLOCK).generate(prompt, params)
    runner = PrefixCachingRunner(tiny, cache_tokens=1024, block_size=BLOCK)
    drafts = Adversary({tuple(prompt): list(alone.token_ids) + [0] * MAX_NEW}, 3, ["right", "junk", "partial"])
    engine = BatchEngine(runner, speculate="tree", drafts=drafts)
    handle = engine.submit(prompt, params)
    engine.run_until_idle()
    done = handle.result()
    assert done.token_ids == alone.token_ids and done.finish_reason == alone.finish_reason
    assert done.usage.accepted_tokens > 0
    assert done.usage.drafted_tokens == drafts.proposed < drafts.offered  # the grammar cut the junk
    assert_quiescent(runner.cache)


def test_a_hugging_face_model_speculates_batched_and_alone_with_its_live_caches_cut_back() -> None:
    pytest.importorskip("transformers")
    from prefixcache.models.hf_tiny import tiny_random_model

    model = tiny_random_model("llama")
    prompts = [_ids(n, seed=n) for n in (9, 14, 5)]
    params = SamplingParams(max_new_tokens=12)
    alone = [PrefixCachingRunner(model, cache_tokens=1024, block_size=BLOCK).generate(p, params) for p in prompts]
    answers = {tuple(p): list(a.token_ids) for p, a in zip(prompts, alone, strict=True)}
    runner = PrefixCachingRunner(model, cache_tokens=1024, block_size=BLOCK)
    engine = BatchEngine(runner, speculate="tree", drafts=Adversary(answers, 5, ["right", "partial", "wrong"]))
    handles = [engine.submit(p, params) for p in prompts]  # together: the padded batch forward
    engine.run_until_idle()
    handles.append(engine.submit(prompts[0], params))  # alone
    engine.run_until_idle()
    done = [h.result() for h in handles]
    assert [d.token_ids for d in done] == [a.token_ids for a in (*alone, alone[0])]
    assert all(d.usage.accepted_tokens > 0 for d in done)
    assert_quiescent(runner.cache)


class _Faulty(Adversary):
    """Right drafts, except that every third proposal raises and the others end with an id outside the vocabulary."""

    calls = 0

    def propose(self, request: EngineRequest, max_tokens: int) -> list[int]:
        self.calls += 1
        if self.calls % 3 == 0:
            raise RuntimeError("the draft source broke")
        return [*super().propose(request, max_tokens), 10**6]


def test_a_failing_or_out_of_vocabulary_draft_costs_the_step_its_draft_not_the_request(tiny: LlamaModel) -> None:
    prompt = _ids(8, seed=9)
    runner = PrefixCachingRunner(tiny, cache_tokens=1024, block_size=BLOCK)
    drafts = _Faulty({tuple(prompt): full_answer(tiny, prompt)}, 1, ["right"])
    engine = BatchEngine(runner, speculate="tree", drafts=drafts)
    handle = engine.submit(prompt, SamplingParams(max_new_tokens=MAX_NEW))
    engine.run_until_idle()
    done = handle.result()
    assert list(done.token_ids) == full_answer(tiny, prompt)
    assert done.usage.accepted_tokens == done.usage.drafted_tokens > 0  # the foreign id was cut before the verify
    assert drafts.calls >= 3
    assert_quiescent(runner.cache)


def test_the_verify_clock_fits_a_cost_line_through_the_forwards_it_timed() -> None:
    clock = VerifyClock(8, min_samples=2)
    clock.observe(0, 0.010)
    clock.observe(0, 0.010)
    assert clock.costs() is None  # no verify seen enough yet
    clock.observe(4, 0.030)
    clock.observe(4, 0.030)
    clock.observe(9, 1.0)  # beyond max_tokens: ignored
    clock.observe(2, 0.0)  # not a duration: ignored
    costs = clock.costs()
    assert costs[0] == 1 and costs[4] == pytest.approx(3.0) and costs[8] == pytest.approx(5.0)
    clock.observe(2, 0.001)
    clock.observe(2, 0.001)  # cheaper than a decode step: the slope is fitted, never below 0
    assert all(c >= 1 for c in clock.costs())


def test_a_costly_verify_stops_drafts_that_are_rarely_accepted() -> None:
    length = DraftLength(8)
    for _ in range(6):
        length.update(8, 0)
    length.update(8, 1)
    assert length.next_budget() > 0  # a verify as cheap as a decode step: any chance pays
    length.set_costs([1 + 0.5 * k for k in range(9)])
    assert length.next_budget() == 0
    with pytest.raises(InvalidArgumentError):
        length.set_costs([1, -1])
    assert length.costs[1] == 1.5  # left as it was


def test_a_request_whose_verify_looks_too_costly_probes_and_then_drafts(tiny: LlamaModel) -> None:
    from prefixcache.engine.speculation import PROBE_EVERY_STEPS, TreeDrafts

    prompt = _ids(10, seed=11)
    params = SamplingParams(max_new_tokens=PROBE_EVERY_STEPS + 24)
    runner = PrefixCachingRunner(tiny, cache_tokens=1024, block_size=BLOCK)
    # At the prior acceptance no draft pays for such a verify; once a probe is accepted, one does.
    drafts = TreeDrafts(runner.cache, verify_cost=[1 + 0.55 * k for k in range(9)])
    engine = BatchEngine(runner, speculate="tree", drafts=drafts)
    results = []
    for _ in range(2):
        handle = engine.submit(prompt, params)
        engine.run_until_idle()
        results.append(handle.result())
    assert results[0].token_ids == results[1].token_ids
    assert results[1].usage.accepted_tokens > 2  # the probe, then the drafts it opened
    assert_quiescent(runner.cache)
