"""Shared fixtures: one torch thread, the tiny model, a cache factory, a helper that caches one sequence, the gate
for files under ../shared/data, and two small Hugging Face tokenizers trained here (no hub): a SentencePiece-style one
(Llama 2 / Mistral) and a byte-level BPE one (GPT-2 / Qwen)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import pytest
import torch

from prefixcache import InsertResult, KVBlockPool, RadixCache
from prefixcache.models.llama import LlamaModel, build_model

SHARED_DATA = Path(__file__).resolve().parents[2] / "shared" / "data"
QWEN_TOKENIZER = "tokenizers/qwen2.5-0.5b-instruct"
QWEN_FILES = (
    "vocab.json",
    "merges.txt",
    "tokenizer_config.json",
    "added_tokens.json",
    "special_tokens_map.json",
    "config.json",
)


def in_ci() -> bool:
    """True when the environment says it is a CI run (``CI=true``, as GitHub Actions and most CI services set)."""
    return os.environ.get("CI", "").strip().lower() in ("true", "1")


def require_shared(relative: str, *members: str) -> Path:
    """The path of ``relative`` under ``../shared/data`` (and of its ``members``, for a folder), if all exist.

    A user's clone may have no shared data: then the calling test is skipped with the missing path as reason.
    Under CI (``CI=true``) a missing file fails the test instead, so a partly copied data folder cannot turn
    real checks into silent skips.
    """
    path = SHARED_DATA / relative
    missing = [p for p in (path, *(path / m for m in members)) if not p.exists()]
    if missing:
        reason = f"shared data not found: {', '.join(map(str, missing))} (../shared/data beside the project)"
        if in_ci():
            pytest.fail(f"{reason}; CI=true requires every shared file", pytrace=False)
        pytest.skip(reason)
    return path


@pytest.fixture(scope="session")
def shared_data() -> Callable[..., Path]:
    """``shared_data(relative, *members)``: :func:`require_shared` as a fixture (skip locally, fail under CI)."""
    return require_shared


@pytest.fixture(scope="session")
def qwen_dir() -> Path:
    """The Qwen2.5 tokenizer folder under ``../shared/data``, with every file the tests load from it."""
    return require_shared(QWEN_TOKENIZER, *QWEN_FILES)


@pytest.fixture(scope="session", autouse=True)
def single_torch_thread() -> Iterator[None]:
    # The tiny model's ops are microseconds long: on a shared 2-core machine a second intra-op thread only
    # spin-waits (seen 15-100x slower).
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def tiny() -> LlamaModel:
    """The embedded ``tiny`` model on the CPU, built once."""
    return build_model("tiny", device="cpu")


@pytest.fixture(scope="session")
def model(tiny: LlamaModel) -> LlamaModel:
    """The same ``tiny`` model, under the name the stress tests use."""
    return tiny


@pytest.fixture
def make_cache() -> Callable[..., RadixCache]:
    """``make_cache(num_blocks=16, block_size=4, policy="lru", num_layers=0)``: a fresh cache on the CPU.

    With ``num_layers > 0`` the pool holds a real float32 KV tensor of 2 KV heads of dimension 3.
    """

    def make(num_blocks: int = 16, block_size: int = 4, *, policy: object = "lru", num_layers: int = 0) -> RadixCache:
        heads_and_dim = {"num_kv_heads": 2, "head_dim": 3} if num_layers else {}
        pool = KVBlockPool(
            num_blocks, block_size, num_layers=num_layers, dtype=torch.float32, device="cpu", **heads_and_dim
        )
        return RadixCache(pool, policy=policy)

    return make


@pytest.fixture
def put() -> Callable[..., InsertResult]:
    """``put(cache, tokens, namespace=None)``: allocate fresh blocks for ``tokens`` and insert them."""

    def insert(cache: RadixCache, tokens: Sequence[int], namespace: str | None = None) -> InsertResult:
        blocks = cache.allocate(cache.pool.blocks_for_tokens(len(tokens)))
        return cache.insert(tokens, blocks, namespace)

    return insert


CHATML_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
TRAINING_TEXTS = (
    "Hello world, how are you?",
    "The quick brown fox jumps over the lazy dog.",
    "how are you doing today? Fine, thank you.",
    "Hello there, world! Observation: sunny.",
)
CHATML_SPECIALS = ("<|im_start|>", "<|im_end|>")


def _save_tokenizer(tokenizer: object, folder: Path, **special: str) -> Path:
    from transformers import PreTrainedTokenizerFast

    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, chat_template=CHATML_TEMPLATE, **special)
    fast.save_pretrained(str(folder))
    return folder


@pytest.fixture(scope="session")
def sentencepiece_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A Llama 2 / Mistral-style tokenizer folder: BPE with byte fallback (ids 3..258 are ``<0x00>``..``<0xFF>``, so
    emoji and CJK, absent from the training text, become byte tokens), the family's normalizer (Prepend + Replace
    "▁"), a ``Metaspace`` pre-tokenizer and the decoders ``Replace("▁", " ") + ByteFallback + Fuse +
    Strip(" ", 1, 0)`` of their tokenizer.json files; ChatML specials and template, ``<|im_end|>`` ends a turn."""
    pytest.importorskip("transformers", reason="needs: pip install 'prefixcache[hf]'")
    from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

    def pipeline(tokenizer: Tokenizer) -> Tokenizer:
        tokenizer.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
        tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="never", split=True)
        tokenizer.decoder = decoders.Sequence(
            [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
        )
        return tokenizer

    specials = ["<unk>", "<s>", "</s>"]
    trained = pipeline(Tokenizer(models.BPE(unk_token="<unk>")))
    trained.train_from_iterator(
        TRAINING_TEXTS, trainers.BpeTrainer(vocab_size=220, special_tokens=specials, show_progress=False)
    )
    learned = json.loads(trained.to_str())["model"]
    vocab = {name: index for index, name in enumerate(specials)}
    vocab.update({f"<0x{byte:02X}>": len(specials) + byte for byte in range(256)})
    for piece, _ in sorted(learned["vocab"].items(), key=lambda item: item[1]):
        vocab.setdefault(piece, len(vocab))
    merges = [tuple(m) if isinstance(m, list) else tuple(m.split(" ")) for m in learned["merges"]]
    tokenizer = pipeline(Tokenizer(models.BPE(vocab, merges, unk_token="<unk>", byte_fallback=True, fuse_unk=True)))
    tokenizer.add_special_tokens(
        [AddedToken(name, special=True, normalized=False) for name in (*specials, *CHATML_SPECIALS)]
    )
    folder = tmp_path_factory.mktemp("sentencepiece")
    return _save_tokenizer(tokenizer, folder, bos_token="<s>", eos_token="<|im_end|>", unk_token="<unk>")


@pytest.fixture(scope="session")
def byte_bpe_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A GPT-2 / Qwen-style tokenizer folder: byte-level BPE (``ByteLevel`` pre-tokenizer and decoder, all 256 byte
    symbols in the alphabet) trained here; ChatML specials and template, ``<|im_end|>`` ends a turn."""
    pytest.importorskip("transformers", reason="needs: pip install 'prefixcache[hf]'")
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=["<|endoftext|>", *CHATML_SPECIALS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(TRAINING_TEXTS, trainer)
    return _save_tokenizer(tokenizer, tmp_path_factory.mktemp("byte_bpe"), eos_token="<|im_end|>")


@pytest.fixture(scope="session")
def single_byte_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A byte-level tokenizer folder with no merges: ids 0..255 are the 256 bytes (one each, as GPT-2's characters
    for them sort), the rest ChatML specials.  Any ids a model writes are then the tokenizer's own encoding of their
    text, so a re-rendered answer is token for token what was generated (a random model on a BPE vocabulary writes
    ``ge`` + ``t`` where the re-encoding has ``get``).  Its ChatML template ignores ``tools``."""
    pytest.importorskip("transformers", reason="needs: pip install 'prefixcache[hf]'")
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    vocab = {symbol: index for index, symbol in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    tokenizer = Tokenizer(models.BPE(vocab, []))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens([AddedToken(name, special=True, normalized=False) for name in CHATML_SPECIALS])
    return _save_tokenizer(tokenizer, tmp_path_factory.mktemp("single_byte"), eos_token="<|im_end|>")


# `python -m prefixcache` with Python's own Ctrl-C handler: a run started under nohup or in a script's background
# inherits an ignored SIGINT, which Python keeps (and which the tests of Ctrl-C would then wait on forever).
_INTERRUPTIBLE_CLI = (
    "import runpy, signal, sys; signal.signal(signal.SIGINT, signal.default_int_handler); "
    "sys.argv[0] = 'prefixcache'; runpy.run_module('prefixcache', run_name='__main__')"
)


class CliProcesses:
    """``start(args, **popen_kwargs)``: ``python -m prefixcache ARGS`` in a new process that Ctrl-C reaches even where
    this test run ignores SIGINT; ``interrupt(process)``: send it SIGINT and kill it if it is still running 120 s
    later (a test reading its output then fails instead of hanging).  Every process is killed at the test's end."""

    def __init__(self) -> None:
        self.processes: list[subprocess.Popen] = []
        self.timers: list[threading.Timer] = []

    def start(self, args: Sequence[str], **popen_kwargs) -> subprocess.Popen:
        process = subprocess.Popen([sys.executable, "-c", _INTERRUPTIBLE_CLI, *args], **popen_kwargs)
        self.processes.append(process)
        return process

    def interrupt(self, process: subprocess.Popen) -> None:
        process.send_signal(signal.SIGINT)
        timer = threading.Timer(120, process.kill)
        timer.daemon = True
        timer.start()
        self.timers.append(timer)

    def close(self) -> None:
        for timer in self.timers:
            timer.cancel()
        for process in self.processes:
            if process.poll() is None:
                process.kill()
                process.wait()


@pytest.fixture
def cli_processes() -> Iterator[CliProcesses]:
    """A :class:`CliProcesses` whose processes end with the test."""
    processes = CliProcesses()
    yield processes
    processes.close()
