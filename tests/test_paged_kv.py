"""The paged KV cache (model/kvpool.py, model/kvcache.py): logits bit-identical to one block per
session (the contiguous layout) for any block size, chunking, shared prefix and cached blocks taken
back after their sessions were released (evicted least recently freed first); pool accounting of
growth, truncation, release, shared and cached blocks; copy-on-write; snapshots; hand-offs between
device slots; pool sizing errors."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from strata_core.engine import Engine
from strata_core.engine_load import kv_pools
from strata_core.errors import BudgetError, RequestError
from strata_core.model.kvpool import KVPoolFull, KVPools, blocks_for
from strata_core.plugin.placement import PHASES
from strata_core.serving.conv_cache import common_prefix
from test_batch_invariance import DEEPSEEK2, GPT_OSS, QWEN3NEXT

CONTEXT = 64


def repool(engine: Engine, block: int, tokens: int | None = None) -> Engine:
    """``engine`` with fresh pools of ``block``-token blocks (what ``--kv-block block`` loads), of
    ``tokens`` positions each if given (``--kv-pool-tokens``)."""
    update = {"kv_block": block, "kv_pool_tokens": tokens}
    engine.kv_pools = kv_pools(engine.settings.model_copy(update=update), engine.spec, engine.dtype)
    for phase in PHASES:
        for layer, placed in enumerate(engine.placement.layers(phase)):
            engine.kv_pools.pool(placed.device, engine.devices[placed.device].device).add_layer(
                layer, engine.spec.layer_state(layer))
    return engine


def held(engine: Engine, slot: int = 0) -> int:
    """Blocks of ``slot``'s pool held by some session."""
    return engine.kv_pools.used(slot)


def only_cached(engine: Engine) -> bool:
    """Whether no session holds a block and every index entry's blocks are cached free blocks."""
    pools = engine.kv_pools.pools
    return (all(held(engine, slot) == 0 for slot in pools)
            and all(block in pools[slot].cached for e in engine.kv_pools.index.values() for slot, block in e.blocks.items())
            and all(len(pool.cached) == len(pool.published) for pool in pools.values()))


@pytest.fixture(scope="module", params=["qwen3moe", "gpt-oss", "qwen3next", "deepseek2"])
def engines(request, tiny_model_factory):
    """The same model twice: one to page in random block sizes, one with a block per session."""
    path = ({"gpt-oss": GPT_OSS, "qwen3next": QWEN3NEXT, "deepseek2": DEEPSEEK2}.get(request.param)
            or tiny_model_factory(expert_type="Q8_0"))
    return (Engine.load(path, max_context=CONTEXT, parallel=3),
            Engine.load(path, max_context=CONTEXT, parallel=3, kv_block=CONTEXT))


def _run(engine: Engine, first: list[int], pieces: list[int], second: list[int], cut: int) -> tuple[list, int]:
    """Every logit of: ``first`` prefilled in ``pieces``; a session sharing what it can of ``second``
    (all but its last token) and prefilling the rest; three batched decode windows; the first session
    cut back to ``cut`` (into a shared block: copy-on-write) and extended; two more windows."""
    out = []
    a = engine.new_session()
    start = 0
    for size in pieces:
        if start < len(first):
            out.append(engine.prefill(a, first[start:start + size], all_logits=True))
            start += size
    b = engine.new_session(second[:-1])
    shared = b.n_tokens
    out.append(engine.prefill(b, second[shared:]))  # the last position's (the others were not computed here)
    steps = [(a, 3), (b, 5)]
    for _ in range(3):
        out.append(engine.decode_window(steps))
    if engine.spec.rewindable:
        a.truncate(min(cut, a.n_tokens))
        out.append(engine.prefill(a, [7, 8, 9], all_logits=True))
    for _ in range(2):
        out.append(engine.decode_window(steps))
    engine.release_session(a)
    engine.release_session(b)
    return out, shared


@given(block=st.integers(1, 24), first=st.integers(2, 30), pieces=st.lists(st.integers(1, 12), min_size=1, max_size=4),
       common=st.integers(0, 30), tail=st.integers(1, 8), cut=st.integers(1, 30))
@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
def test_paged_logits_are_bit_identical_to_a_block_per_session(engines, block, first, pieces, common, tail, cut):
    paged, whole = engines
    repool(paged, block)
    one = list(range(10, 10 + first))
    common = min(common, first)
    two = one[:common] + list(range(50, 50 + tail))
    pieces = pieces + [first]  # the rest in one piece
    got, shared = _run(paged, one, pieces, two, cut)
    want, none = _run(whole, one, pieces, two, cut)
    assert none == 0 and all(torch.equal(g, w) for g, w in zip(got, want))
    expect = (min(common, len(two) - 1) // block) * block if paged.spec.rewindable else 0
    assert shared == expect  # the full blocks of the common prefix, shared, not recomputed
    assert only_cached(paged)  # every block back; the published ones cached


def _conversation(engine: Engine, prompt: list[int], fed: list[int], reuse: bool) -> tuple[list, int]:
    """The logits of ``prompt`` (its last position) and of a window for each of ``fed``; with ``reuse`` the
    session first takes the published blocks ``prompt`` starts with and is released with ``cache``."""
    session = engine.new_session(prompt[:-1] if reuse else ())
    taken = session.n_tokens
    out = [engine.prefill(session, prompt[taken:])]
    out += [engine.decode_window([(session, token)]) for token in fed]
    engine.release_session(session, cache=reuse)
    return out, taken


@given(block=st.integers(1, 12), small=st.booleans(),
       turns=st.lists(st.tuples(st.integers(0, 7), st.integers(0, 40), st.integers(1, 10), st.integers(0, 6)),
                      min_size=2, max_size=5))
@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
def test_cached_blocks_taken_back_give_the_logits_of_the_prompt_computed_again(engines, block, small, turns):
    """Conversations one after another, each released before the next: a turn continues an earlier one's
    tokens (prompt and fed tokens) up to a cut, adds its own, and takes back the cached full blocks of
    what was computed before. Its logits equal the whole prompt computed again bit for bit; with a pool
    of one session (``small``) the cached blocks are evicted least recently freed first, never short."""
    paged, whole = engines
    repool(paged, block, CONTEXT if small else None)
    histories: list[list[int]] = [[]]
    taken_total = 0
    for n, (parent, cut, tail, fed) in enumerate(turns):
        history = histories[parent % len(histories)]
        prompt = (history[:cut] + [100 + n] * tail)[-(CONTEXT - fed):]
        tokens = [3 + (n + i) % 5 for i in range(fed)]
        got, taken = _conversation(paged, prompt, tokens, reuse=True)
        want, _ = _conversation(whole, prompt, tokens, reuse=False)
        assert all(torch.equal(g, w) for g, w in zip(got, want))
        known = max(common_prefix(h, prompt[:-1]) for h in histories) // block * block
        assert taken % block == 0 and taken <= (known if paged.spec.rewindable else 0)
        assert small or taken == (known if paged.spec.rewindable else 0)  # nothing evicted from a large pool
        assert only_cached(paged)
        taken_total += taken
        histories.append(prompt + tokens)
    counters = paged.kv_pools.counters()
    assert counters["hits"] == taken_total // block and (small or counters["evictions"] == 0)


@pytest.fixture(scope="module")
def loaded(tiny_model_factory):
    return Engine.load(tiny_model_factory(expert_type="Q8_0"), max_context=CONTEXT, kv_block=4)


@pytest.fixture
def engine(loaded):
    """The module's engine with fresh pools of 4-token blocks (no block cached by an earlier test)."""
    return repool(loaded, 4)


def test_blocks_grow_shrink_and_return(engine):
    s = engine.new_session()
    engine.prefill(s, list(range(10)))
    assert len(s.kv.blocks(0)) == 3 and held(engine) == 3  # 10 positions in blocks of 4
    for token in (1, 2):
        engine.decode_window([(s, token)])  # 11, 12 positions: still 3 blocks
    assert held(engine) == 3
    engine.decode_window([(s, 3)])  # 13: a fourth
    assert held(engine) == 4 and len(engine.kv_pools.index) == 2  # the prompt's 2 full blocks published
    table = s.kv.block_table(0)
    s.truncate(5)
    assert held(engine) == 2 and s.kv.block_table(0) is table and table[2:].eq(0).all()
    engine.release_session(s)
    assert only_cached(engine) and len(engine.kv_pools.index) == 2  # the prompt's full blocks, cached


def test_shared_prefix_blocks_are_refcounted_and_freed_with_the_last_holder(engine):
    prompt = list(range(20, 30))
    a = engine.new_session()
    engine.prefill(a, prompt)
    b = engine.new_session(prompt + [1, 2])
    assert b.tokens == prompt[:8] and b.kv.blocks(0) == a.kv.blocks(0)[:2]  # two full blocks: no copy
    pool = engine.kv_pools.pools[0]
    assert [pool.refs[i] for i in a.kv.blocks(0)] == [2, 2, 1] and held(engine) == 3
    engine.prefill(b, prompt[8:] + [1, 2])
    assert held(engine) == 4  # b's own third block
    engine.release_session(a)
    assert held(engine) == 3 and [pool.refs[i] for i in b.kv.blocks(0)] == [1, 1, 1]
    c = engine.new_session(prompt)  # the prefix is still published: b holds it
    assert c.n_tokens == 8
    engine.release_session(b)
    engine.release_session(c)
    assert only_cached(engine)
    hits = engine.kv_pools.counters()["hits"]
    d = engine.new_session(prompt)  # the last holder gone: the blocks are cached and taken back
    assert d.n_tokens == 8 and engine.kv_pools.counters()["hits"] == hits + 2 and held(engine) == 2


def test_a_write_after_truncating_into_a_shared_block_copies_it_first(engine):
    prompt = list(range(30, 42))
    a = engine.new_session()
    engine.prefill(a, prompt)
    b = engine.new_session(prompt)
    assert b.n_tokens == 12
    rows = [t.clone() for t in b.kv.read(0, 12)]
    shared = a.kv.blocks(0)[1]
    a.truncate(6)  # into the second block, which b holds too
    engine.prefill(a, [1, 2, 3])
    assert a.kv.blocks(0)[1] != shared and b.kv.blocks(0)[1] == shared  # a wrote a copy
    assert all(torch.equal(x, y) for x, y in zip(b.kv.read(0, 12), rows))  # b's rows unchanged
    fresh = engine.new_session()
    engine.prefill(fresh, prompt[:6] + [1, 2, 3])
    assert all(torch.equal(x, y) for x, y in zip(a.kv.read(0, 9), fresh.kv.read(0, 9)))
    for s in (a, b, fresh):
        engine.release_session(s)
    assert held(engine) == 0


def test_a_truncated_block_held_alone_is_unpublished_not_copied(engine):
    a = engine.new_session()
    engine.prefill(a, list(range(8)))
    blocks = a.kv.blocks(0)
    a.truncate(6)
    engine.prefill(a, [9])
    assert a.kv.blocks(0) == blocks and len(engine.kv_pools.index) == 1  # the second block is a's again
    b = engine.new_session(list(range(8)))
    assert b.n_tokens == 4
    engine.release_session(a)
    del b  # dropped without release: its block goes back all the same
    assert held(engine) == 0


def test_snapshots_restore_beside_and_after_the_original(engine):
    a = engine.new_session()
    engine.prefill(a, list(range(40, 50)))
    engine.decode_window([(a, 3)])
    snap = engine.save_session(a)
    beside = engine.restore_session(snap)  # a holds the published prefix: shared, the rest copied in
    assert beside.tokens == a.tokens and beside.kv.blocks(0)[:2] == a.kv.blocks(0)[:2]
    assert beside.kv.blocks(0)[2] != a.kv.blocks(0)[2]
    want = engine.decode_window([(a, 4)])
    assert torch.equal(engine.decode_window([(beside, 4)]), want)
    engine.release_session(a)
    engine.release_session(beside)
    assert held(engine) == 0
    after = engine.restore_session(snap)  # the cached prefix taken back, the rest from the snapshot
    assert after.tokens == list(snap.tokens) and held(engine) == 3
    assert torch.equal(engine.decode_window([(after, 4)]), want)
    engine.release_session(after)


def test_a_full_pool_fails_the_request_and_loses_nothing(tiny_model_factory):
    engine = Engine.load(tiny_model_factory(expert_type="Q8_0"), max_context=CONTEXT, kv_block=4,
                         kv_pool_tokens=CONTEXT)
    a, b = engine.new_session(), engine.new_session()
    engine.prefill(a, list(range(50)))
    with pytest.raises(KVPoolFull, match="KV pool of device slot 0 is full: 5 more blocks of 4 tokens needed, "
                                         "4 of 17 free"):
        engine.prefill(b, list(range(20)))
    assert isinstance(KVPoolFull("x"), RequestError)
    assert b.n_tokens == 0 and b.kv.blocks(0) == [] and held(engine) == 13
    logits = engine.decode_window([(a, 1)])  # a goes on
    engine.release_session(a)
    engine.prefill(b, list(range(20)))
    assert logits.shape[0] == 1 and held(engine) == 5


def test_a_pool_smaller_than_one_session_is_refused_at_load(tiny_model_factory):
    with pytest.raises(BudgetError, match=r"KV pool of 40 tokens \(--kv-pool-tokens\) cannot hold one session of "
                                          r"64 tokens \(--max-context\)"):
        Engine.load(tiny_model_factory(expert_type="Q8_0"), max_context=CONTEXT, kv_pool_tokens=40)


def test_the_default_pool_holds_parallel_sessions_of_the_context(tiny_model_factory, caplog):
    with caplog.at_level("INFO", logger="strata_core.model.kvpool"):
        engine = Engine.load(tiny_model_factory(expert_type="Q8_0"), max_context=CONTEXT, parallel=2)
    pool = engine.kv_pools.pools[0]
    assert pool.block_size == 16 and pool.n_blocks == 2 * CONTEXT // 16 + 2
    assert "KV pool of cpu#0: 8 blocks of 16 tokens (128 tokens" in caplog.text


def test_hand_offs_between_slots_share_and_match_single(tiny_model_factory):
    """prefill_main on logical devices: the prompt on slot 0, the later layers' decode on slot 1; a
    session sharing a prefix holds its blocks on both slots; logits equal single's. A session released
    after decoding caches only the blocks whose rows every slot holds: slot 0's rows of the layers
    decoded on slot 1 stopped at the prompt."""
    path = tiny_model_factory(expert_type="Q8_0", n_layers=4)
    split = Engine.load(path, strategy="prefill_main", devices=["cpu", "cpu"], max_context=CONTEXT, kv_block=4,
                        strategy_options={"split": "2"}, dbg_handoff=True)
    single = Engine.load(path, max_context=CONTEXT, kv_block=4)
    prompt = list(range(60, 71))
    results = []
    for engine in (split, single):
        a = engine.new_session()
        out = [engine.prefill(a, prompt)]
        b = engine.new_session(prompt[:9] + [3, 4])
        out.append(engine.prefill(b, prompt[b.n_tokens:9] + [3, 4]))
        out += [engine.decode_window([(a, 1), (b, 2)]) for _ in range(3)]
        snap = engine.save_session(b)
        c = engine.restore_session(snap)
        out.append(engine.decode_window([(b, 5), (c, 5)]))
        history, home, used = list(b.tokens), dict(b.kv.home), engine.kv_pools.used(len(engine.devices) - 1)
        shared = [b.kv.blocks(slot)[:2] == c.kv.blocks(slot)[:2] for slot in range(len(engine.devices))]
        engine.release_session(b, cache=True)
        engine.release_session(c)
        d = engine.new_session(history)
        taken = d.n_tokens
        out.append(engine.prefill(d, history[taken:] + [6]))
        out += [engine.decode_window([(d, 7)]) for _ in range(2)]
        results.append((out, home, shared, used, taken))
    (got, home, shared, used, taken), (want, _, _, _, all_blocks) = results
    assert all(torch.equal(g, w) for g, w in zip(got, want))
    assert home == {0: 0, 1: 0, 2: 1, 3: 1} and shared == [True, True] and used > 0  # shared on both slots
    assert (taken, all_blocks) == (8, 12)  # 11 prompt positions on slot 0 (8 in whole blocks); 15 on single


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("graphs", [False, True])
def test_shared_prefixes_decode_on_cuda_as_computed_alone(tiny_model_factory, graphs):
    """On CUDA (fused decode through the block tables, graphs or not): a session sharing another's
    prefix decodes the greedy tokens of the same prompt computed alone, and the CPU's."""
    path = tiny_model_factory(expert_type="Q4_0", n_layers=3)
    prompt = list(range(5, 45))

    def greedy(engine: Engine, share: bool) -> list[int]:
        first = engine.new_session()
        engine.prefill(first, prompt)
        session = engine.new_session(prompt[:-1] if share else ())
        token = int(engine.prefill(session, prompt[session.n_tokens:]).argmax())
        assert session.n_tokens == len(prompt) and (not share or first.kv.blocks(0)[:2] == session.kv.blocks(0)[:2])
        out = [token]
        for _ in range(20):  # past a block boundary or two
            rows = engine.decode_window([(first, 3), (session, token)])
            token = int(rows[1].argmax())
            out.append(token)
        return out

    cuda = Engine.load(path, devices=["cuda:0"], max_context=CONTEXT, dtype="float32", arena="pinned",
                       expert_cache=8, cuda_graphs=graphs)
    cpu = Engine.load(path, max_context=CONTEXT)
    assert greedy(cuda, True) == greedy(cuda, False) == greedy(cpu, False)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_cuda_snapshot_lands_in_pinned_memory_before_its_blocks_are_reused(tiny_model_factory):
    """A snapshot of a CUDA session is copied to pinned memory without the host waiting; its blocks
    freed and rewritten by another session at once, it still restores the saved rows exactly."""
    path = tiny_model_factory(expert_type="Q4_0", n_layers=3)
    engine = Engine.load(path, devices=["cuda:0"], max_context=CONTEXT, dtype="float32", arena="pinned",
                         expert_cache=8)
    a = engine.new_session()
    engine.prefill(a, list(range(5, 45)))
    want = engine.decode_window([(a, 3)])
    a.truncate(a.n_tokens - 1)
    snap = engine.save_session(a)
    assert snap.kv.ready and all(t.is_pinned() for named in snap.kv.tensors.values() for t in named.values())
    engine.release_session(a)
    other = engine.new_session()  # takes the freed blocks and overwrites them
    engine.prefill(other, list(range(100, 140)))
    restored = engine.restore_session(snap)
    assert torch.equal(engine.decode_window([(restored, 3)]), want)
    engine.release_session(other)
    engine.release_session(restored)


def _session_in(pools: KVPools, tokens: list[int]) -> list[int]:
    """One session on slot 0 of ``pools`` (no layers: the block accounting alone): it takes the published
    blocks ``tokens`` starts with, allocates the rest (checking that it evicts the least recently freed
    cached blocks, and only when no unpublished block is free), publishes its full blocks and frees its
    table. Returns the table."""
    pool, bs = pools.pools[0], pools.block_size
    chain: list = []
    for j in range(len(tokens) // bs):
        entry = pools.lookup(chain[-1] if chain else None, tuple(tokens[j * bs:(j + 1) * bs]))
        if entry is None:
            break
        chain.append(entry)
    for entry in chain:
        pool.hold(entry.blocks[0])
    need = blocks_for(len(tokens), bs) - len(chain)
    lru, unpublished = list(pool.cached), pool.n_free - len(pool.cached)
    evictions = pool.evictions
    new = pools.allocate(0, need)
    evicted = lru[:max(0, need - unpublished)]
    assert set(evicted) <= set(new) and pool.evictions == evictions + len(evicted)
    assert not any(block in pool.published or block in pool.cached for block in new)
    assert not any(e.blocks[0] in evicted for e in pools.index.values())  # their entries left the index
    table = [entry.blocks[0] for entry in chain] + new
    for j in range(len(chain), len(tokens) // bs):
        chain.append(pools.publish(chain[-1] if chain else None, tuple(tokens[j * bs:(j + 1) * bs]), {0: table[j]}))
    pools.free(0, table)
    return table


@given(block=st.integers(1, 4), extra=st.integers(0, 12),
       sessions=st.lists(st.lists(st.integers(0, 2), min_size=1, max_size=16), min_size=1, max_size=12))
def test_freed_blocks_are_cached_tail_first_and_evicted_least_recently_freed(block, extra, sessions):
    pools = KVPools(block, blocks_for(16, block) + 1 + extra, torch.float32)
    pool = pools.pool(0, "cpu")
    for tokens in sessions:
        table = _session_in(pools, tokens)
        full = len(tokens) // block
        assert pool.refs == [0] * pool.n_blocks and pool.n_free == pool.n_blocks - 1
        assert list(pool.cached)[len(pool.cached) - full:] == table[:full][::-1]  # the tail is evicted first
        assert set(pool.cached) == set(pool.published) == {e.blocks[0] for e in pools.index.values()}
        hits = pool.hits
        again = _session_in(pools, tokens)  # the same prompt at once: every full block taken back
        assert again[:full] == table[:full] and pool.hits == hits + full


def test_evicting_a_block_on_one_slot_frees_its_cached_block_on_the_other():
    pools = KVPools(2, 3, torch.float32)
    first, second = pools.pool(0, "cpu"), pools.pool(1, "cpu")
    blocks = {0: pools.allocate(0, 1)[0], 1: pools.allocate(1, 1)[0]}
    entry = pools.publish(None, (1, 2), blocks)
    pools.free(0, [blocks[0]])
    pools.free(1, [blocks[1]])
    assert list(first.cached) == [blocks[0]] and list(second.cached) == [blocks[1]]
    assert pools.allocate(0, 2) and first.evictions == 1  # the unpublished block, then the cached one
    assert pools.lookup(None, (1, 2)) is None and entry.key not in pools.index
    assert not second.cached and not second.published and second.n_free == 2 and second.evictions == 0


def test_pools_sized_for_their_sessions_also_hold_the_padding_sessions_block():
    # --parallel 2 sessions at --max-context 32 (16-token blocks), beside graphed windows' padding session
    pools = KVPools.for_tokens(2 * 32, 16, torch.float32, 32)
    pool = pools.pool(0, "cpu")
    pools.allocate(0, 1)  # the padding session's one block
    for _ in range(2):
        pools.allocate(0, blocks_for(32, 16))
    assert pool.n_free == 0
    with pytest.raises(KVPoolFull):
        pools.allocate(0, 1)
