"""Specification of resume points: a cache for recurrent (hybrid, state-space) models resumes a prefix only where a
state is kept (prefixcache.cache.resume), keeps states within a byte budget, and frees them with their KV."""

from __future__ import annotations

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from prefixcache import KVBlockPool, RadixCache, StateMarker
from prefixcache.cache.host import make_host_pool
from prefixcache.errors import InvalidArgumentError, LockError

BS = 4


def make_cache(num_blocks: int = 64, max_state_bytes: int = 10_000, **kwargs) -> RadixCache:
    pool = KVBlockPool(num_blocks, BS, num_layers=1, num_kv_heads=1, head_dim=2)
    return RadixCache(pool, resume_states=True, max_state_bytes=max_state_bytes, **kwargs)


def put(cache: RadixCache, tokens: list[int], state: object, namespace: str | None = None) -> None:
    """Cache ``tokens`` with a state after them, through the low-level insert (the caller's own blocks)."""
    blocks = cache.allocate(-(-len(tokens) // BS))
    cache.insert(tokens, blocks, namespace, state=state)


def run(cache: RadixCache, prompt: list[int], answer: list[int], prompt_state=None, answer_state=None):
    """One request as the engine runs it: acquire, prompt inserted at the end of prefill, answer committed."""
    lease = cache.acquire(prompt, num_tokens=len(prompt))
    cache.insert_prefix(lease, prompt, state=prompt_state)
    cache.reserve(lease, len(prompt) + len(answer))
    cache.commit(lease, prompt + answer, state=answer_state)
    return lease


SEQ = list(range(100, 120))  # 20 distinct tokens


# ---- options and the default cache -----------------------------------------------------------------------------


def test_a_default_cache_refuses_states_and_reports_zero() -> None:
    cache = RadixCache(KVBlockPool(16, BS))
    assert cache.max_state_bytes is None
    blocks = cache.allocate(2)
    with pytest.raises(InvalidArgumentError, match="resume_states"):
        cache.insert(SEQ[:8], blocks, state=StateMarker(10))
    assert cache.stats().cached_tokens == 0
    cache.insert(SEQ[:8], blocks)
    lease = cache.acquire(SEQ[:10])
    assert (lease.num_cached_tokens, lease.num_matched_tokens, lease.resume_state) == (8, 8, None)
    with pytest.raises(InvalidArgumentError):
        cache.put_state(lease, 4, StateMarker(1))
    with pytest.raises(InvalidArgumentError):
        cache.commit(lease, SEQ[:10], state=StateMarker(1))
    cache.release(lease)
    stats = cache.stats()
    assert (stats.num_states, stats.state_bytes, stats.resume_shortfall_tokens, stats.dropped_states) == (0, 0, 0, 0)
    assert cache.state_positions(SEQ) == []
    cache.check_invariants()


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"resume_states": True}, "max_state_bytes"),
        ({"resume_states": True, "max_state_bytes": -1}, "max_state_bytes"),
        ({"resume_states": True, "max_state_bytes": 1.5}, "max_state_bytes"),
        ({"resume_states": True, "max_state_bytes": True}, "max_state_bytes"),
        ({"max_state_bytes": 100}, "resume_states=True"),
        ({"resume_states": 1, "max_state_bytes": 100}, "bool"),
    ],
)
def test_bad_resume_options_are_refused(kwargs: dict, message: str) -> None:
    with pytest.raises(InvalidArgumentError, match=message):
        RadixCache(KVBlockPool(16, BS), **kwargs)


def test_resume_states_with_a_host_tier_is_refused() -> None:
    pool = KVBlockPool(16, BS, num_layers=1, num_kv_heads=1, head_dim=2)
    with pytest.raises(InvalidArgumentError, match="host-memory tier"):
        RadixCache(pool, resume_states=True, max_state_bytes=100, host_pool=make_host_pool(pool, 16))


# ---- acquire: the deepest kept state -----------------------------------------------------------------------------


def test_without_any_state_a_cached_prefix_resumes_from_zero_and_counts_the_shortfall() -> None:
    cache = make_cache()
    run(cache, SEQ[:10], SEQ[10:14])  # no states handed over
    lease = cache.acquire(SEQ[:18])
    assert (lease.num_cached_tokens, lease.num_matched_tokens, lease.resume_shortfall_tokens) == (0, 14, 14)
    assert lease.resume_state is None and lease.first_owned_block == 0
    cache.release(lease)
    stats = cache.stats()
    assert stats.resume_shortfall_tokens == 14
    assert stats.hit_tokens == 0  # only resumed tokens are hits
    cache.check_invariants()


def test_a_turn_resumes_at_the_state_of_the_previous_answer() -> None:
    cache = make_cache()
    prompt_state, answer_state = StateMarker(100), StateMarker(100)
    first = run(cache, SEQ[:10], SEQ[10:14], prompt_state, answer_state)
    assert (first.num_cached_tokens, first.resume_shortfall_tokens) == (0, 0)
    assert cache.state_positions(SEQ) == [10, 14]
    lease = cache.acquire(SEQ[:18])
    assert lease.num_cached_tokens == lease.num_matched_tokens == 14
    assert lease.resume_state is answer_state and lease.resume_shortfall_tokens == 0
    cache.release(lease)
    assert cache.stats().hit_tokens == 14
    cache.check_invariants()


def test_a_branch_resumes_at_the_deepest_state_before_it_leaves_the_path() -> None:
    cache = make_cache()
    prompt_state = StateMarker(100)
    run(cache, SEQ[:10], SEQ[10:14], prompt_state, StateMarker(100))
    branch = SEQ[:12] + [7, 7, 7]  # leaves the cached path at 12, between the states at 10 and 14
    lease = cache.acquire(branch)
    assert (lease.num_matched_tokens, lease.num_cached_tokens, lease.resume_shortfall_tokens) == (12, 10, 2)
    assert lease.resume_state is prompt_state
    assert lease.num_copied_tokens == 2  # copy-on-write works as usual on the cut match
    cache.release(lease)
    cache.check_invariants()


def test_a_state_at_the_whole_prompt_is_not_resumed_since_the_last_token_is_computed() -> None:
    cache = make_cache()
    put(cache, SEQ[:8], StateMarker(10))
    lease = cache.acquire(SEQ[:8])  # at most 7 tokens match: the state at 8 is out of reach
    assert (lease.num_matched_tokens, lease.num_cached_tokens, lease.resume_shortfall_tokens) == (7, 0, 7)
    cache.release(lease)


def test_match_and_cached_length_report_the_resumable_length() -> None:
    cache = make_cache()
    put(cache, SEQ[:6], StateMarker(10))
    put(cache, SEQ[:12], StateMarker(10))
    assert cache.cached_length(SEQ[:12]) == 12
    assert cache.cached_length(SEQ[:12], for_prefill=True) == 6
    assert cache.cached_length(SEQ[:11] + [0]) == 6
    before = cache.stats()
    assert cache.stats() == before  # cached_length counts nothing
    result = cache.match(SEQ[:10])
    assert result.num_tokens == 6 and len(result.block_table) == 2
    handle = cache.lock(result)  # the cut match locks like any other
    cache.unlock(handle)
    stats = cache.stats()
    assert (stats.hit_tokens, stats.resume_shortfall_tokens) == (6, 4)
    cache.check_invariants()


def test_put_state_keeps_states_inside_the_prompt_once_the_tree_holds_it() -> None:
    cache = make_cache()
    prompt = SEQ[:16]
    lease = cache.acquire(prompt, num_tokens=16)
    assert cache.put_state(lease, 8, StateMarker(5)) is False  # not inserted yet: dropped
    cache.insert_prefix(lease, prompt)
    assert cache.put_state(lease, 8, StateMarker(5)) is True
    with pytest.raises(InvalidArgumentError):
        cache.put_state(lease, 17, StateMarker(5))
    with pytest.raises(InvalidArgumentError):
        cache.put_state(lease, 0, StateMarker(5))
    cache.commit(lease, prompt)
    with pytest.raises(LockError):
        cache.put_state(lease, 8, StateMarker(5))
    assert cache.state_positions(prompt) == [8]
    assert cache.stats().dropped_states == 1
    assert cache.acquire(prompt).num_cached_tokens == 8


def test_put_state_reaches_the_tokens_given_to_insert_prefix_beyond_a_shorter_acquired_prompt() -> None:
    # A resumed request may acquire a prefix of what it knows (the engine does, owing prompt logits) and insert more.
    cache = make_cache()
    prompt = SEQ[:14]
    lease = cache.acquire(prompt[:5], num_tokens=len(prompt))
    cache.insert_prefix(lease, prompt, state=StateMarker(5))
    assert cache.put_state(lease, 13, StateMarker(5)) is True
    with pytest.raises(InvalidArgumentError):
        cache.put_state(lease, 15, StateMarker(5))
    cache.commit(lease, prompt)
    assert cache.state_positions(prompt) == [13, 14]
    cache.check_invariants()


def test_insert_prefix_that_caches_only_whole_blocks_drops_the_state() -> None:
    cache = make_cache(num_blocks=3)
    prompt = SEQ[:10]  # 3 blocks, all the lease's: no block is left for the copy of the partial one
    lease = cache.acquire(prompt, num_tokens=10)
    cache.insert_prefix(lease, prompt, state=StateMarker(10))
    assert cache.stats().cached_tokens == 8
    assert cache.stats().dropped_states == 1 and cache.stats().num_states == 0
    cache.commit(lease, prompt, state=StateMarker(10))  # the whole prompt now: kept
    assert cache.state_positions(prompt) == [10]
    cache.check_invariants()


def test_insert_prefix_keeps_the_state_when_the_tree_already_held_the_partial_block() -> None:
    cache = make_cache(num_blocks=5)
    put(cache, SEQ[:10], None)
    lease = cache.acquire(SEQ[:12], num_tokens=12)  # resumes at 0, holds 3 blocks
    others = cache.allocate(cache.pool.num_free_blocks)  # no block left for the copy
    cache.insert_prefix(lease, SEQ[:10], state=StateMarker(10))
    assert cache.state_positions(SEQ) == [10]  # the tree held SEQ[:10] through position 10
    cache.release(lease)
    cache.free(others)
    cache.check_invariants()


# ---- where states live: split, trim, removal, namespaces --------------------------------------------------------


def test_a_split_refiles_states_by_position() -> None:
    cache = make_cache()
    put(cache, SEQ[:6], StateMarker(1))
    put(cache, SEQ[:14], StateMarker(1))  # one node 6..14 holding the state at 14
    put(cache, SEQ[:9] + [1, 2, 3], StateMarker(1))  # splits it at 9
    cache.check_invariants()
    assert cache.state_positions(SEQ[:14]) == [6, 14]
    assert cache.state_positions(SEQ[:9] + [1, 2, 3]) == [6, 12]
    put(cache, SEQ[:14] + [5], StateMarker(1))
    put(cache, SEQ[:14] + [6], StateMarker(1))
    put(cache, SEQ[:12] + [1], StateMarker(1))  # a split at 12 leaves the state at 14 below
    cache.check_invariants()
    assert cache.state_positions(SEQ[:14] + [5]) == [6, 14, 15]


def test_block_eviction_drops_the_states_beyond_the_new_end_only() -> None:
    cache = make_cache()
    put(cache, SEQ[:8], StateMarker(1))
    put(cache, SEQ[:11], StateMarker(1))
    put(cache, SEQ[:16], StateMarker(1))  # one leaf 11..16 under 8..11
    cache.evict(1)  # the block 12..15 goes: the leaf ends at 12, the state at 16 with it
    cache.check_invariants()
    assert cache.state_positions(SEQ) == [8, 11]
    stats = cache.stats()
    assert (stats.num_states, stats.kv_evicted_states, stats.evicted_states) == (2, 1, 0)


def test_a_state_at_the_new_end_of_a_trimmed_leaf_stays() -> None:
    cache = make_cache()
    put(cache, SEQ[:2], StateMarker(1))
    put(cache, SEQ[:8], StateMarker(1))
    put(cache, SEQ[:4] + [1, 2, 3, 4, 5], StateMarker(1))  # node 2..4 with leaves 4..8 and 4..9
    cache.evict_all()
    assert cache.stats().num_states == 0 and cache.stats().state_bytes == 0
    assert cache.stats().kv_evicted_states == 3
    put(cache, SEQ[:4], StateMarker(1))
    put(cache, SEQ[:10], StateMarker(1))
    cache.evict(1)  # the leaf 4..10 loses the block 8..11 and ends at 8
    assert cache.state_positions(SEQ) == [4]
    put(cache, SEQ[:8], StateMarker(1))
    assert cache.state_positions(SEQ) == [4, 8]
    cache.check_invariants()


def test_a_namespace_sees_only_its_own_states() -> None:
    cache = make_cache()
    put(cache, SEQ[:8], StateMarker(1), namespace="a")
    put(cache, SEQ[:8], None, namespace="b")
    assert cache.acquire(SEQ[:10], "a").num_cached_tokens == 8
    lease = cache.acquire(SEQ[:10], "b")
    assert (lease.num_cached_tokens, lease.num_matched_tokens) == (0, 8)


# ---- the budget --------------------------------------------------------------------------------------------------


def test_the_least_recently_used_state_is_evicted_to_fit_and_its_kv_stays() -> None:
    cache = make_cache(max_state_bytes=250)
    a, b = [1] + SEQ[:7], [2] + SEQ[:7]
    put(cache, a, StateMarker(100))
    put(cache, b, StateMarker(100))
    cache.match(a)  # a is now more recent than b
    put(cache, [3] + SEQ[:7], StateMarker(100))
    assert cache.state_positions(a) == [8] and cache.state_positions(b) == []
    stats = cache.stats()
    assert (stats.num_states, stats.state_bytes, stats.evicted_states) == (2, 200, 1)
    assert stats.cached_tokens == 24  # freeing a state frees no KV
    put(cache, b, StateMarker(100))  # a later insert puts it back
    assert cache.state_positions(b) == [8]
    cache.check_invariants()


def test_states_on_one_path_go_shallowest_first() -> None:
    cache = make_cache(max_state_bytes=200)
    put(cache, SEQ[:4], StateMarker(100))
    put(cache, SEQ[:8], StateMarker(100))
    cache.match(SEQ[:8])  # the whole path touched at one tick
    put(cache, [9, 9, 9], StateMarker(100))
    assert cache.state_positions(SEQ) == [8]


def test_a_deeper_state_outlives_a_shallower_one_put_at_the_same_time() -> None:
    cache = make_cache(max_state_bytes=200)
    put(cache, [1] + SEQ[:15], StateMarker(100))  # 16 tokens it lets a request skip
    put(cache, [2] + SEQ[:3], StateMarker(100))  # 4
    put(cache, [3] + SEQ[:7], StateMarker(100))  # 8: the budget evicts the state of least value, at 4
    assert cache.state_positions([1] + SEQ[:15]) == [16] and cache.state_positions([2] + SEQ[:3]) == []


def test_a_state_resumed_often_outlives_deeper_ones_nobody_resumes() -> None:
    cache = make_cache(max_state_bytes=200)
    put(cache, [1] + SEQ[:3], StateMarker(100))
    for _ in range(8):  # eight requests resume at 4: worth 8 x 4 tokens
        cache.release(cache.acquire([1] + SEQ[:3] + [5, 5]))
    put(cache, [2] + SEQ[:15], StateMarker(100))
    put(cache, [3] + SEQ[:15], StateMarker(100))
    assert cache.state_positions([1] + SEQ[:3]) == [4] and cache.stats().evicted_states == 1


def test_a_request_refused_for_blocks_adds_nothing_to_the_value_of_the_state_it_would_resume() -> None:
    from prefixcache.errors import OutOfBlocksError

    # An engine retries a request that waits for blocks at every step: eight refusals are not eight resumes.
    cache = make_cache(num_blocks=12, max_state_bytes=200)
    put(cache, [1] + SEQ[:3], StateMarker(100))
    hog = cache.acquire([9] * 28, num_tokens=28)  # 7 blocks: 4 left, the cached one locked by the request below
    for _ in range(8):
        with pytest.raises(OutOfBlocksError):
            cache.acquire([1] + SEQ[:3] + [5, 5], num_tokens=24)
    cache.release(hog)
    assert cache.stats().rejected_requests == 8
    put(cache, [2] + SEQ[:15], StateMarker(100))
    put(cache, [3] + SEQ[:15], StateMarker(100))
    assert cache.state_positions([1] + SEQ[:3]) == [] and cache.stats().evicted_states == 1
    cache.check_invariants()


def test_branch_marks_are_bounded_oldest_first_and_go_with_their_kv() -> None:
    cache = make_cache()
    put(cache, SEQ, StateMarker(1))
    cache._states.marks.max_marks = 2
    # Three requests part from SEQ at 5, 9 and 13, where no state is kept: each marks and passes the marks before.
    for cut, points in ((5, (5,)), (9, (5, 9)), (13, (9, 13))):
        lease = cache.acquire(SEQ[:cut] + [1, 1])
        assert lease.state_points == points
        cache.release(lease)
    lease = cache.acquire(SEQ[:19] + [1])  # parts nowhere (all but its last token cached): passes the two marks left
    assert lease.state_points == (9, 13) and cache.stats().num_branch_marks == 2
    cache.release(lease)
    cache.check_invariants()
    cache.evict_all()
    assert cache.stats().num_branch_marks == 0
    cache.check_invariants()


def test_a_state_larger_than_the_budget_is_not_kept_and_replacing_one_counts_once() -> None:
    cache = make_cache(max_state_bytes=100)
    put(cache, SEQ[:8], StateMarker(101))
    assert cache.stats().dropped_states == 1 and cache.state_positions(SEQ) == []
    put(cache, SEQ[:8], StateMarker(60))
    put(cache, SEQ[:8], StateMarker(70))  # replaces the state at 8
    stats = cache.stats()
    assert (stats.num_states, stats.state_bytes, stats.evicted_states) == (1, 70, 0)
    put(cache, SEQ[:4], StateMarker(0))  # a zero-byte state always fits
    assert cache.state_positions(SEQ) == [4, 8]
    cache.check_invariants()


# ---- bad input -----------------------------------------------------------------------------------------------------


class NoBytes:
    pass


class Bytes:
    def __init__(self, nbytes: object) -> None:
        self.nbytes = nbytes


BAD_STATES = [NoBytes(), Bytes(-1), Bytes(True), Bytes(2.0), Bytes("8")]


@pytest.mark.parametrize("state", BAD_STATES, ids=lambda s: f"{type(s).__name__}{getattr(s, 'nbytes', '')!r}")
def test_a_bad_state_raises_and_changes_nothing(state: object) -> None:
    cache = make_cache()
    run(cache, SEQ[:6], SEQ[6:8], StateMarker(1), StateMarker(1))
    before = cache.stats()
    blocks = cache.allocate(3)
    with pytest.raises(InvalidArgumentError, match="nbytes"):
        cache.insert(SEQ[:12], blocks, state=state)
    cache.free(blocks)  # still the caller's: nothing was inserted
    lease = cache.acquire(SEQ[:12], num_tokens=12)
    with pytest.raises(InvalidArgumentError, match="nbytes"):
        cache.insert_prefix(lease, SEQ[:12], state=state)
    with pytest.raises(InvalidArgumentError, match="nbytes"):
        cache.put_state(lease, 4, state)
    with pytest.raises(InvalidArgumentError, match="nbytes"):
        cache.commit(lease, SEQ[:12], state=state)
    assert not lease.closed
    cache.release(lease)
    after = cache.stats()
    assert (after.cached_tokens, after.num_states, after.state_bytes, after.used_blocks) == (
        before.cached_tokens,
        before.num_states,
        before.state_bytes,
        before.used_blocks,
    )
    assert cache.state_positions(SEQ) == [6, 8]
    cache.check_invariants()


# ---- copy-on-write without a block ---------------------------------------------------------------------------------


@pytest.mark.parametrize(("kept", "expected"), [((8, 10), 8), ((6, 10), 0)])
def test_without_a_block_for_the_copy_the_request_resumes_at_a_state_on_a_block_boundary(
    kept: tuple[int, int], expected: int
) -> None:
    cache = make_cache(num_blocks=6)
    for n in kept:
        put(cache, SEQ[:n], StateMarker(1))
    put(cache, SEQ[:12], StateMarker(1))
    other = cache.acquire(SEQ[:12] + [1])  # locks all three blocks, so the copy's source cannot be evicted
    spare = cache.allocate(cache.pool.num_free_blocks)  # and no block is free
    lease = cache.acquire(SEQ[:10] + [5, 5])  # matches 10 tokens, with a state at 10 mid-block
    assert lease.num_matched_tokens == 10 and lease.resume_shortfall_tokens == 0
    assert lease.num_cached_tokens == expected and lease.num_copied_tokens == 0
    assert (lease.resume_state is None) == (expected == 0)
    assert lease.first_owned_block == expected // BS
    cache.free(spare)
    cache.reserve(lease, 12)
    cache.commit(lease, SEQ[:10] + [5, 5], state=StateMarker(1))
    cache.release(other)
    cache.check_invariants()


# ---- against a reference model -------------------------------------------------------------------------------------

Seq = tuple[int, ...]
NAMESPACES = ("a", "b")
tails = st.lists(st.integers(0, 2), min_size=1, max_size=7)
specs = st.tuples(st.integers(0, 1000), st.integers(0, 16), tails)


class ResumeMachine(RuleBasedStateMachine):
    """Random requests (with or without states at the end of prompt and answer, and inside the prompt), lookups and
    evictions against a model: per namespace, the cached sequences and the kept states as ``prefix -> state``.  The
    expected resume point of a prompt is the longest kept prefix of it within the token match.  What KV is cached
    is read back from the cache (``cached_sequences``; the radix machine checks it), and a state goes with its KV.
    With the exact budget nothing is evicted by the budget, so the model knows every state; with the tight one the
    states the cache still keeps (it picks by LRU) must be a subset of the model's, and resuming follows them."""

    BLOCK_SIZE = 4
    MAX_STATE_BYTES = 10**9

    def __init__(self) -> None:
        super().__init__()
        pool = KVBlockPool(4096 // self.BLOCK_SIZE, self.BLOCK_SIZE)
        self.cache = RadixCache(pool, resume_states=True, max_state_bytes=self.MAX_STATE_BYTES)
        self.history: list[Seq] = [()]
        self.cached: dict[str, set[Seq]] = {ns: set() for ns in NAMESPACES}
        self.states: dict[str, dict[Seq, StateMarker]] = {ns: {} for ns in NAMESPACES}
        self.marks: dict[str, set[Seq]] = {ns: set() for ns in NAMESPACES}  # prefixes where a cut match parted

    def sequence(self, spec) -> Seq:
        pick, cut, tail = spec
        base = self.history[pick % len(self.history)]
        return base[:cut] + tuple(tail)

    def token_match(self, ns: str, q: Seq, limit: int) -> int:
        best = 0
        for s in self.cached[ns]:
            n = 0
            for x, y in zip(s, q[:limit], strict=False):
                if x != y:
                    break
                n += 1
            best = max(best, n)
        return best

    def resume_point(self, ns: str, q: Seq, limit: int) -> tuple[int, StateMarker | None]:
        best, state = 0, None
        for prefix, kept in self.states[ns].items():
            if best < len(prefix) <= limit and q[: len(prefix)] == prefix:
                best, state = len(prefix), kept
        return best, state

    def keep(self, ns: str, prefix: Seq, nbytes: int) -> StateMarker:
        marker = StateMarker(nbytes)
        self.states[ns][prefix] = marker
        return marker

    @rule(ns=st.sampled_from(NAMESPACES), spec=specs, answer=tails, sizes=st.tuples(*[st.integers(0, 40)] * 3))
    def request(self, ns: str, spec, answer: list[int], sizes: tuple[int, int, int]) -> None:
        prompt = self.sequence(spec)
        full = prompt + tuple(answer)
        matched = self.token_match(ns, prompt, len(prompt) - 1)
        expected, state = self.resume_point(ns, prompt, matched)
        lease = self.cache.acquire(list(prompt), ns, num_tokens=len(prompt))
        assert (lease.num_matched_tokens, lease.num_cached_tokens) == (matched, expected)
        assert lease.resume_state is state and lease.resume_shortfall_tokens == matched - expected
        goes_on = any(len(c) > matched and c[:matched] == prompt[:matched] for c in self.cached[ns])
        if expected < matched < len(prompt) - 1 and goes_on:  # parts from a sequence, not extending its end
            self.marks[ns].add(prompt[:matched])
        points = {len(m) for m in self.marks[ns] if expected < len(m) <= matched and prompt[: len(m)] == m}
        assert lease.state_points == (tuple(sorted(points)) if expected < matched else ())
        self.cache.insert_prefix(lease, list(prompt), state=self.keep(ns, prompt, sizes[0]) if sizes[0] else None)
        inner = len(prompt) // 2
        if sizes[1] and inner > expected:
            assert self.cache.put_state(lease, inner, self.keep(ns, prompt[:inner], sizes[1]))
        self.cache.reserve(lease, len(full))
        self.cache.commit(lease, list(full), state=self.keep(ns, full, sizes[2]) if sizes[2] else None)
        self.cached[ns].add(full)
        self.history.append(full)
        self.sync_kv()  # should a large history fill the pool, admission evicts

    @rule(ns=st.sampled_from(NAMESPACES), spec=specs, for_prefill=st.booleans())
    def lookup(self, ns: str, spec, for_prefill: bool) -> None:
        q = self.sequence(spec)
        limit = len(q) - 1 if for_prefill else len(q)
        expected = self.resume_point(ns, q, self.token_match(ns, q, limit))[0]
        assert self.cache.cached_length(list(q), ns, for_prefill=for_prefill) == expected
        assert self.cache.match(list(q), ns, for_prefill=for_prefill).num_tokens == expected

    @rule(num_blocks=st.integers(1, 12))
    def evict(self, num_blocks: int) -> None:
        self.cache.evict(num_blocks)
        self.sync_kv()

    def sync_kv(self) -> None:
        for ns in NAMESPACES:
            self.cached[ns] = {tuple(s) for s in self.cache.cached_sequences(ns)}
            cached = self.cached[ns]
            # A state (and a mark) goes exactly when the KV of its last token does.
            self.states[ns] = {p: m for p, m in self.states[ns].items() if any(s[: len(p)] == p for s in cached)}
            self.marks[ns] = {p for p in self.marks[ns] if any(s[: len(p)] == p for s in cached)}

    @invariant()
    def consistent(self) -> None:
        self.cache.check_invariants()
        stats = self.cache.stats()
        kept = 0
        for ns in NAMESPACES:
            for prefix in list(self.states[ns]):
                if len(prefix) not in self.cache.state_positions(list(prefix), ns):
                    assert self.MAX_STATE_BYTES < 10**9, f"state at {prefix} lost"
                    del self.states[ns][prefix]  # evicted by the budget
            kept += len(self.states[ns])
        assert stats.num_states == kept
        assert stats.num_branch_marks == sum(len(marks) for marks in self.marks.values())
        assert stats.state_bytes == sum(m.nbytes for ns in NAMESPACES for m in self.states[ns].values())
        assert stats.state_bytes <= self.MAX_STATE_BYTES


class TightBudgetMachine(ResumeMachine):
    MAX_STATE_BYTES = 60


class BlockSize1Machine(ResumeMachine):
    BLOCK_SIZE = 1


RESUME_SETTINGS = settings(max_examples=60, stateful_step_count=40, deadline=None)
TestResumeStates = ResumeMachine.TestCase
TestResumeStates.settings = RESUME_SETTINGS
TestResumeStatesTightBudget = TightBudgetMachine.TestCase
TestResumeStatesTightBudget.settings = RESUME_SETTINGS
TestResumeStatesBlockSize1 = BlockSize1Machine.TestCase
TestResumeStatesBlockSize1.settings = RESUME_SETTINGS
