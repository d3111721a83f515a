"""The ``agent`` benchmark, the headline: a tool-calling agent loop on a real model shape, four ways in one process.

Workload: real tau-bench airline conversations (``../shared/data``): a system prompt of the airline policy (cut at a
paragraph boundary) with the tool schemas the conversations call, about 1,500 tokens, then the customer's turns,
the agent's tool calls and the tools' results.  Each step is one of the agent's tool calls: the history up to it is
rendered with the Qwen2.5 tokenizer's own chat template (``add_generation_prompt``), and the model generates
greedily (``max_new_tokens``).  The history then carries the recorded tool call and its recorded result (teacher
forcing: a random-weight model's own output is not a tool call, and each way must see identical prompts), so every
step of the loop is a prompt that extends the last one by a tool call and a tool result, as in an agent framework.

The model is a random-weight Qwen2 from the shared ``config.json`` cut to a few layers.  The four ways, interleaved
step by step (the order rotates), all greedy and all checked to produce the same tokens:

(a) ``model.generate`` on the whole prompt every step, what smolagents' ``TransformersModel`` and LangChain's
    ``HuggingFacePipeline`` do;
(b) transformers' documented prefix reuse: prefill the system prompt once into a ``DynamicCache`` and give
    ``model.generate`` a ``copy.deepcopy`` of it every step (its one-time prefill is counted in step 1);
(c) :class:`~prefixcache.engine.runner.PrefixCachingRunner`, which reuses everything any earlier step computed;
(d) (c) with tree speculation (:mod:`prefixcache.engine.speculation`): a
    :class:`~prefixcache.engine.batching.BatchEngine` with ``speculate="tree"`` on a runner of its own (so that it
    never drafts from (c)'s answer to the same prompt), prefilling in one forward as (c) does; its greedy rows verify
    drafts from their context and its cache.  Its figures include the decode time per answer token against (c)'s and
    the draft tokens verified and accepted.  On a random-weight model the answers are the model's own (not tool
    calls), so acceptance is what that model's repetitions give, not an agent's.

Time covers the whole call, prefill time runs to the first token (a streamer notes it for ``generate``).  Both are
the calling thread's CPU time with torch held to one thread (see ``bench engine``), so that other
processes on a shared machine do not leak into the figures.  ``--quick`` (CI) runs a 2-layer, hidden-64 Qwen2
with the real tokenizer: a check that the three agree, not a measurement.
"""

from __future__ import annotations

import copy
import json
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from prefixcache.bench.common import BenchResult, Table
from prefixcache.bench.device_clock import TORCH_THREADS, clock, timed_runner_call, torch_threads
from prefixcache.engine.batching import BatchEngine
from prefixcache.engine.runner import PrefixCachingRunner
from prefixcache.engine.sampling import SamplingParams
from prefixcache.errors import InvalidArgumentError, install_command

DATA_DIR = Path(__file__).resolve().parents[2].parent / "shared" / "data"
QWEN_DIR = DATA_DIR / "tokenizers" / "qwen2.5-0.5b-instruct"
WAYS = ("a", "b", "c", "d")
WAY_NAMES = {
    "a": "(a) model.generate from scratch",
    "b": "(b) generate + deepcopy(system cache)",
    "c": "(c) prefixcache runner",
    "d": "(d) (c) + tree speculation",
}


@dataclass(frozen=True, slots=True)
class AgentSetup:
    """One run's sizes: model layers (``None``: the tiny quick model), conversations, tool-call steps each,
    greedy tokens per step, the system prompt's token budget (policy + tool schemas), block size."""

    layers: int | None
    conversations: int
    steps: int
    max_new_tokens: int
    system_tokens: int
    block_size: int = 16


FULL = AgentSetup(layers=4, conversations=2, steps=6, max_new_tokens=24, system_tokens=1500)
QUICK = AgentSetup(layers=None, conversations=2, steps=6, max_new_tokens=8, system_tokens=1500)


@dataclass(frozen=True, slots=True)
class AgentStep:
    """One step of one conversation: its rendered prompt ids and the ways' figures (seconds, tokens)."""

    conversation: int
    step: int
    prompt_tokens: int
    cpu_s: dict[str, float]
    wall_s: dict[str, float]
    prefill_s: dict[str, float]
    prefilled_tokens: dict[str, int]
    cached_tokens: dict[str, int]
    output: tuple[int, ...]


def load_workload(tokenizer, setup: AgentSetup) -> tuple[list[list[int]], list[list[list[int]]]]:
    """``(system_ids, prompts)``: the shared prefix ids and, per conversation, the rendered prompt of each step.

    Picks the conversations with at least ``setup.steps`` tool calls whose prompt at the last step is shortest;
    tools are those the picked conversations call.  Raises InvalidArgumentError when the shared data is missing.
    """
    transcripts = DATA_DIR / "tau_bench_airline_gpt4o.jsonl"
    tools_path = DATA_DIR / "tau_bench_airline_tools.json"
    if not transcripts.is_file() or not tools_path.is_file():
        raise InvalidArgumentError(f"the tau-bench data is missing under {DATA_DIR}")
    all_tools = json.loads(tools_path.read_text(encoding="utf-8"))
    candidates = []
    with transcripts.open(encoding="utf-8") as f:
        for line in f:
            messages = json.loads(line)["messages"]
            calls = [i for i, m in enumerate(messages) if m["role"] == "assistant" and "<tool_call>" in m["content"]]
            if len(calls) >= setup.steps:
                size = sum(len(m["content"]) for m in messages[1 : calls[setup.steps - 1]])
                candidates.append((size, messages, calls[: setup.steps]))
    if len(candidates) < setup.conversations:
        raise InvalidArgumentError(f"only {len(candidates)} conversations have {setup.steps} tool calls")
    candidates.sort(key=lambda c: c[0])
    picked = candidates[: setup.conversations]
    called = {
        json.loads(_call_json(m["content"]))["name"] for _, msgs, calls in picked for m in (msgs[i] for i in calls)
    }
    tools = [t for t in all_tools if t["function"]["name"] in called]
    system = _fit_system_prompt(tokenizer, picked[0][1][0]["content"], tools, setup.system_tokens)
    prompts = []
    for _, messages, calls in picked:
        history = [{"role": "system", "content": system}, *messages[1:]]
        prompts.append([tokenizer.render_chat(history[:i], tools, add_generation_prompt=True) for i in calls])
    system_ids = _common_prefix([p for conv in prompts for p in conv])
    return system_ids, prompts


def _call_json(content: str) -> str:
    return content.split("<tool_call>", 1)[1].split("</tool_call>", 1)[0].strip()


def _fit_system_prompt(tokenizer, policy: str, tools: list[dict], budget: int) -> str:
    """The policy cut at a paragraph boundary so that system prompt + tool schemas render to about ``budget`` tokens
    (the longest cut not over it, at least the first paragraph)."""
    paragraphs = policy.split("\n\n")
    best = paragraphs[0]
    for n in range(1, len(paragraphs) + 1):
        text = "\n\n".join(paragraphs[:n])
        if (
            len(tokenizer.render_chat([{"role": "system", "content": text}], tools, add_generation_prompt=False))
            > budget
        ):
            break
        best = text
    return best


def _common_prefix(sequences: Sequence[Sequence[int]]) -> list[int]:
    first = sequences[0]
    n = len(first)
    for seq in sequences[1:]:
        n = min(n, len(seq))
        n = next((i for i in range(n) if seq[i] != first[i]), n)
    return list(first[:n])


def build_agent_model(setup: AgentSetup, vocab_size: int):
    """The model: the shared Qwen2.5 config cut to ``setup.layers`` layers, or (``layers=None``) a 2-layer hidden-64
    Qwen2 with the tokenizer's vocabulary.  Raises InvalidArgumentError without transformers."""
    try:
        import transformers
    except ImportError:
        raise InvalidArgumentError(f"this benchmark needs transformers: {install_command('hf')}") from None
    from prefixcache.models.hf import HFCausalLM, random_model_from_config

    if setup.layers is not None:
        return random_model_from_config(QWEN_DIR, layers=setup.layers, seed=0, device="cpu")
    config = transformers.AutoConfig.for_model(
        "qwen2",
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=32768,
        initializer_range=0.2,
        tie_word_embeddings=True,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return HFCausalLM(transformers.AutoModelForCausalLM.from_config(config).eval())


class _FirstTokenClock:
    """A ``generate`` streamer that notes when the first new token arrives (its first ``put`` is the prompt)."""

    def __init__(self) -> None:
        self.puts = 0
        self.first_token_at: float | None = None

    def put(self, value: Any) -> None:
        self.puts += 1
        if self.puts == 2:
            self.first_token_at = clock()

    def end(self) -> None:
        pass


class _Ways:
    """The three ways of serving one step, on one model."""

    def __init__(self, hf, tokenizer, setup: AgentSetup, system_ids: list[int], cache_tokens: int) -> None:
        from transformers import GenerationConfig

        self.hf = hf
        self.setup = setup
        self.system_ids = system_ids
        eos = sorted(tokenizer.eos_token_ids)
        self.stop = frozenset(eos)
        self.generation = GenerationConfig(
            do_sample=False, max_new_tokens=setup.max_new_tokens, eos_token_id=eos, pad_token_id=eos[0]
        )
        self.runner = PrefixCachingRunner(hf, tokenizer, cache_tokens=cache_tokens, block_size=setup.block_size)
        spec_runner = PrefixCachingRunner(hf, tokenizer, cache_tokens=cache_tokens, block_size=setup.block_size)
        self.spec_engine = BatchEngine(spec_runner, max_batch_tokens=cache_tokens, speculate="tree")
        self.drafted_tokens = self.accepted_tokens = 0  # (d)'s draft tokens verified and accepted, over the steps
        self.system_cache = None

    def warm_up(self, ids: list[int]) -> None:
        """One untimed call of each way's code on a short prompt (first-call allocations and lazy imports), on a
        throwaway runner so that the measured one starts empty."""
        from transformers import DynamicCache

        self._generate(ids, None)
        self._generate(ids, lambda: DynamicCache(config=self.hf.config))
        spare = PrefixCachingRunner(self.hf, self.runner.tokenizer, cache_tokens=4 * len(ids), block_size=16)
        timed_runner_call(spare, ids, SamplingParams(max_new_tokens=self.setup.max_new_tokens))
        spare = PrefixCachingRunner(self.hf, self.runner.tokenizer, cache_tokens=4 * len(ids), block_size=16)
        _timed_engine_call(BatchEngine(spare, speculate="tree"), ids, SamplingParams(max_new_tokens=2))

    @torch.inference_mode()
    def _generate(self, ids: list[int], cache) -> tuple[float, float, list[int]]:
        first_token = _FirstTokenClock()
        start = clock()
        out = self.hf.model.generate(
            torch.tensor([ids]),
            attention_mask=torch.ones(1, len(ids), dtype=torch.long),
            generation_config=self.generation,
            **{self.hf.cache_kwarg: cache() if cache is not None else None},
            streamer=first_token,
        )
        seconds = clock() - start
        first = first_token.first_token_at if first_token.first_token_at is not None else start + seconds
        return seconds, first - start, out[0, len(ids) :].tolist()

    def scratch(self, ids: list[int]) -> tuple[float, float, int, int, list[int]]:
        seconds, prefill, tokens = self._generate(ids, None)
        return seconds, prefill, len(ids), 0, tokens

    @torch.inference_mode()
    def reuse(self, ids: list[int]) -> tuple[float, float, int, int, list[int]]:
        from transformers import DynamicCache

        setup_s = 0.0
        if self.system_cache is None:
            # The documented recipe: one forward of the shared prefix into a cache, kept for every later prompt.
            start = clock()
            self.system_cache = DynamicCache(config=self.hf.config)
            self.hf.model(
                input_ids=torch.tensor([self.system_ids]), **{self.hf.cache_kwarg: self.system_cache}, use_cache=True
            )
            setup_s = clock() - start
        seconds, prefill, tokens = self._generate(ids, lambda: copy.deepcopy(self.system_cache))
        cached = len(self.system_ids)
        return seconds + setup_s, prefill + setup_s, len(ids) - cached, cached, tokens

    def prefixcache(self, ids: list[int]) -> tuple[float, float, int, int, list[int]]:
        params = SamplingParams(max_new_tokens=self.setup.max_new_tokens, stop_token_ids=self.stop)
        ttft, seconds, result = timed_runner_call(self.runner, ids, params)
        usage = result.usage
        return seconds, ttft, usage.prefilled_tokens, usage.cached_tokens, list(result.token_ids)

    def speculating(self, ids: list[int]) -> tuple[float, float, int, int, list[int]]:
        params = SamplingParams(max_new_tokens=self.setup.max_new_tokens, stop_token_ids=self.stop)
        ttft, seconds, result = _timed_engine_call(self.spec_engine, ids, params)
        usage = result.usage
        self.drafted_tokens += usage.drafted_tokens
        self.accepted_tokens += usage.accepted_tokens
        return seconds, ttft, usage.prefilled_tokens, usage.cached_tokens, list(result.token_ids)


def _timed_engine_call(engine: BatchEngine, prompt: list[int], params: SamplingParams):
    """``(ttft_s, total_s, result)`` of one request stepped in this thread by ``engine``, on :func:`clock`."""
    first: list[float] = []
    start = clock()
    handle = engine.submit(prompt, params, on_token=lambda _token: first.append(clock()) if not first else None)
    engine.run_until_idle()
    total = clock() - start
    return (first[0] - start if first else total), total, handle.result()


def measure(setup: AgentSetup) -> tuple[list[AgentStep], dict]:
    """Run every step of every conversation three ways, interleaved; returns the steps and a description.

    Raises AssertionError if the ways' greedy tokens differ at any step, InvalidArgumentError without the data or
    transformers.
    """
    from prefixcache.chat.hf_tokenizer import HFTokenizer

    if not QWEN_DIR.is_dir():
        raise InvalidArgumentError(f"the Qwen tokenizer folder is missing at {QWEN_DIR}")
    tokenizer = HFTokenizer(QWEN_DIR)
    system_ids, prompts = load_workload(tokenizer, setup)
    hf = build_agent_model(setup, tokenizer.vocab_size)
    longest = sum(len(conv[-1]) + setup.max_new_tokens * len(conv) for conv in prompts)
    ways = _Ways(hf, tokenizer, setup, system_ids, cache_tokens=longest + 64 * setup.block_size)
    run_way = {"a": ways.scratch, "b": ways.reuse, "c": ways.prefixcache, "d": ways.speculating}
    with torch_threads():
        ways.warm_up(prompts[0][0][-64:])
        steps = _interleaved(setup, prompts, run_way)
    description = {
        "model": f"{hf.name}, hidden {hf.config.hidden_size}, vocab {hf.vocab_size:,}",
        "system_tokens": len(system_ids),
        "tools": "tau-bench airline",
        "conversations": len(prompts),
        "steps": setup.steps,
        "max_new_tokens": setup.max_new_tokens,
        "torch_threads": TORCH_THREADS,
        "d_drafted_tokens": ways.drafted_tokens,
        "d_accepted_tokens": ways.accepted_tokens,
    }
    return steps, description


def _interleaved(setup: AgentSetup, prompts: list[list[list[int]]], run_way: dict) -> list[AgentStep]:
    steps: list[AgentStep] = []
    turn = 0
    for step in range(setup.steps):
        for conv, conv_prompts in enumerate(prompts):
            ids = conv_prompts[step]
            figures = {}
            for way in WAYS[turn % len(WAYS) :] + WAYS[: turn % len(WAYS)]:
                start = time.perf_counter()
                figures[way] = (*run_way[way](ids), time.perf_counter() - start)
            turn += 1
            outputs = {way: tuple(f[4]) for way, f in figures.items()}
            if len(set(outputs.values())) != 1:
                raise AssertionError(f"conversation {conv} step {step + 1}: greedy outputs differ: {outputs}")
            steps.append(
                AgentStep(
                    conversation=conv,
                    step=step + 1,
                    prompt_tokens=len(ids),
                    cpu_s={w: f[0] for w, f in figures.items()},
                    wall_s={w: f[5] for w, f in figures.items()},
                    prefill_s={w: f[1] for w, f in figures.items()},
                    prefilled_tokens={w: f[2] for w, f in figures.items()},
                    cached_tokens={w: f[3] for w, f in figures.items()},
                    output=outputs["c"],
                )
            )
    return steps


def summarize(steps: Sequence[AgentStep], first_step: int = 1) -> dict:
    """Totals over the steps numbered ``>= first_step``: per way CPU, wall and prefill seconds, prefilled and cached
    tokens; ratios a/c and b/c of CPU time (``wall_*`` of wall time)."""
    chosen = [s for s in steps if s.step >= first_step]
    totals: dict[str, dict[str, float]] = {}
    for way in WAYS:
        totals[way] = {
            "cpu_s": sum(s.cpu_s[way] for s in chosen),
            "wall_s": sum(s.wall_s[way] for s in chosen),
            "prefill_s": sum(s.prefill_s[way] for s in chosen),
            "prefilled_tokens": sum(s.prefilled_tokens[way] for s in chosen),
            "cached_tokens": sum(s.cached_tokens[way] for s in chosen),
            "decode_s": sum(s.cpu_s[way] - s.prefill_s[way] for s in chosen),
        }
    c_cpu = totals["c"]["cpu_s"]
    return {
        "steps": len(chosen),
        "totals": totals,
        "a_over_c": totals["a"]["cpu_s"] / c_cpu,
        "b_over_c": totals["b"]["cpu_s"] / c_cpu,
        "wall_a_over_c": totals["a"]["wall_s"] / totals["c"]["wall_s"],
        "wall_b_over_c": totals["b"]["wall_s"] / totals["c"]["wall_s"],
        "median_step_a_over_c": statistics.median(s.cpu_s["a"] / s.cpu_s["c"] for s in chosen),
        # Decode time per answer token, (c) over (d): what speculation saves (the same tokens, asserted).
        "decode_c_over_d": totals["c"]["decode_s"] / max(totals["d"]["decode_s"], 1e-9),
    }


def run(quick: bool = False, setup: AgentSetup | None = None) -> BenchResult:
    """Measure and tabulate (see the module docstring); raises as :func:`measure`."""
    setup = setup if setup is not None else (QUICK if quick else FULL)
    steps, description = measure(setup)
    later_from = 3
    summaries = {"all": summarize(steps), "later": summarize(steps, later_from)}
    rows = []
    for label, summary in (("all steps", summaries["all"]), (f"steps {later_from}+", summaries["later"])):
        for way in WAYS:
            t = summary["totals"][way]
            ratio = "1.00" if way == "c" else f"{t['cpu_s'] / summary['totals']['c']['cpu_s']:.2f}"
            wall_ratio = "1.00" if way == "c" else f"{t['wall_s'] / summary['totals']['c']['wall_s']:.2f}"
            rows.append(
                (
                    label,
                    WAY_NAMES[way],
                    f"{t['cpu_s']:.2f}",
                    f"{t['prefill_s']:.2f}",
                    f"{int(t['prefilled_tokens']):,}",
                    f"{int(t['cached_tokens']):,}",
                    ratio,
                    f"{t['wall_s']:.2f}",
                    wall_ratio,
                )
            )
    summary_table = Table(
        title=(
            f"agent: {description['conversations']} tau-bench conversations x {setup.steps} tool-calling steps, "
            f"{description['system_tokens']:,}-token system prompt + tools, {description['model']}"
            f"{' (quick: tiny model)' if quick else ''}"
        ),
        headers=("steps", "way", "cpu (s)", "prefill (s)", "prefilled", "cached", "/ (c)", "wall (s)", "wall / (c)"),
        rows=tuple(rows),
        notes=(
            f"greedy, max_new_tokens {setup.max_new_tokens}; the four ways' tokens are asserted equal at every step;"
            " history carries the recorded tool calls and results (teacher forcing)",
            f"ways interleaved per step, order rotating; one process, {description['torch_threads']} torch thread(s);"
            " (b)'s one-time system-prompt prefill is counted in its first step",
            f"(d): decode time (cpu - prefill) per answer token (c)/(d) {summaries['all']['decode_c_over_d']:.2f} "
            f"(steps {later_from}+: {summaries['later']['decode_c_over_d']:.2f}); draft tokens accepted "
            f"{description['d_accepted_tokens']:,} of {description['d_drafted_tokens']:,} verified",
        ),
    )
    per_step = Table(
        title="agent: per step (thread CPU seconds, summed over conversations)",
        headers=("step", "prompt tok", "(a) s", "(b) s", "(c) s", "(c) prefilled", "(c) cached", "a/c", "b/c"),
        rows=tuple(_step_row(steps, n) for n in range(1, setup.steps + 1)),
    )
    data = {
        "setup": {name: getattr(setup, name) for name in AgentSetup.__slots__},
        "description": description,
        "summary": summaries,
        "steps": [
            {
                "conversation": s.conversation,
                "step": s.step,
                "prompt_tokens": s.prompt_tokens,
                "cpu_s": s.cpu_s,
                "wall_s": s.wall_s,
                "prefill_s": s.prefill_s,
                "prefilled_tokens": s.prefilled_tokens,
                "cached_tokens": s.cached_tokens,
                "output": list(s.output),
            }
            for s in steps
        ],
    }
    return BenchResult("agent", (summary_table, per_step), data)


def _step_row(steps: Sequence[AgentStep], n: int) -> tuple:
    chosen = [s for s in steps if s.step == n]
    cpu = {w: sum(s.cpu_s[w] for s in chosen) for w in WAYS}
    return (
        n,
        f"{sum(s.prompt_tokens for s in chosen):,}",
        f"{cpu['a']:.2f}",
        f"{cpu['b']:.2f}",
        f"{cpu['c']:.2f}",
        f"{sum(s.prefilled_tokens['c'] for s in chosen):,}",
        f"{sum(s.cached_tokens['c'] for s in chosen):,}",
        f"{cpu['a'] / cpu['c']:.2f}",
        f"{cpu['b'] / cpu['c']:.2f}",
    )
