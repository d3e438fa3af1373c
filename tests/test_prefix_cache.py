"""The shared prefix cache (deployments/engines/prefix_cache.py): alone, on MLX arrays shaped as a
model's KV, and inside the LLM engine on llama-10m's real weights (no Ray): a system prompt stored
once however many conversations begin with it, a later turn reusing the earlier ones, the same greedy
tokens with and without the cache, eviction within the byte budget, and usage's cached_tokens."""

import asyncio

import mlx.core as mx
import pytest
from mlx_lm.models.cache import KVCache, RotatingKVCache

from deployments.engines import block_rows
from deployments.engines.block_rows import BlockKVCache, BlockQuantizedKVCache, RowViewBatchKVCache, RowViewBatchQuantizedKVCache
from deployments.engines.llm import LLMEngine
from deployments.engines.prefix_cache import PrefixCache, sliceable
from deployments.engines.quantized_cache import QuantizedKVCache
from deployments.wire.generation import GenerationRequest

LAYERS, HEADS, DIM = 2, 2, 4
PER_TOKEN = LAYERS * 2 * HEADS * DIM * 4  # bytes of one token's KV (float32 keys and values, every layer)


def kv(tokens: list[int]) -> list[KVCache]:
    """A per-layer cache whose entry at position i depends on tokens[: i + 1] only, as a model's does."""
    prefix = mx.cumsum(mx.array(tokens, dtype=mx.float32))[None, None, :, None]
    layers = []
    for layer in range(LAYERS):
        keys = mx.broadcast_to(prefix + layer + mx.arange(HEADS, dtype=mx.float32)[None, :, None, None] / 10, (1, HEADS, len(tokens), DIM))
        cache = KVCache()
        cache.keys, cache.values = mx.array(keys), mx.array(-keys)
        cache.offset = len(tokens)
        layers.append(cache)
    return layers


SYSTEM = list(range(1000, 1100))  # 100 tokens


def own(i: int, n: int = 20) -> list[int]:
    return [5000 + 100 * i + k for k in range(n)]


def test_a_shared_system_prompt_is_stored_once():
    cache = PrefixCache(block_tokens=16)
    for i in range(10):
        cache.insert(SYSTEM + own(i), kv(SYSTEM + own(i)))
    # 6 blocks (96 tokens) of the system prompt once; each conversation its block 6 (16) and a last block (8)
    assert cache.nbytes == (96 + 10 * 24) * PER_TOKEN
    assert len(cache) == 6 + 10 * 2
    # what a cache of whole copies holds for the same ten (mlx-lm's LRUPromptCache: one entry each)
    assert cache.nbytes < 0.3 * 10 * len(SYSTEM + own(0)) * PER_TOKEN


def test_fetch_gives_back_the_kv_of_the_longest_cached_prefix_to_the_token():
    tokens = SYSTEM + own(1)
    cache = PrefixCache(block_tokens=16)
    cache.insert(tokens, kv(tokens))
    asked = tokens[:50] + [7, 7, 7]  # diverges inside a block
    layers, reused = cache.fetch(asked, limit=len(asked) - 1)
    assert layers is not None and reused == 50 and cache.match(asked) == 50
    expected = kv(tokens)
    for got, want in zip(layers, expected, strict=True):
        (keys, values, offset), (all_keys, all_values, _) = got.state, want.state
        assert offset == 50 and keys.shape == (1, HEADS, 50, DIM)
        assert mx.array_equal(keys, all_keys[..., :50, :]) and mx.array_equal(values, all_values[..., :50, :])
    # the whole prompt cached: one token is left to prefill (its logits start the answer)
    layers, reused = cache.fetch(tokens, limit=len(tokens) - 1)
    assert layers is not None and reused == len(tokens) - 1 and layers[0].state[0].shape[2] == len(tokens) - 1
    assert cache.fetch(asked, limit=len(asked) - 1, min_tokens=51) == (None, 0)
    assert cache.fetch([1, 2, 3], limit=2) == (None, 0)


def test_a_longer_sequence_replaces_the_shorter_last_block_it_extends():
    first = SYSTEM[:40]
    cache = PrefixCache(block_tokens=16)
    cache.insert(first, kv(first))
    assert (len(cache), cache.nbytes) == (3, 40 * PER_TOKEN)  # 16 + 16 + a last block of 8
    longer = SYSTEM[:56]
    added = cache.insert(longer, kv(longer))
    assert added == (16 + 8) * PER_TOKEN and (len(cache), cache.nbytes) == (4, 56 * PER_TOKEN)
    cache.insert(first, kv(first))  # already held inside a longer block: nothing added
    assert cache.nbytes == 56 * PER_TOKEN
    assert cache.fetch(first + [1], limit=40)[1] == 40


def test_eviction_keeps_the_budget_and_takes_the_least_recently_used_leaves():
    budget = (96 + 5 * 24) * PER_TOKEN  # the system prompt and five conversations
    cache = PrefixCache(block_tokens=16, max_bytes=budget)
    for i in range(5):
        cache.insert(SYSTEM + own(i), kv(SYSTEM + own(i)))
    assert cache.nbytes == budget
    assert cache.fetch(SYSTEM + own(0) + [1], limit=120)[1] == 120  # conversation 0 used again: the most recent
    for i in range(5, 8):
        cache.insert(SYSTEM + own(i), kv(SYSTEM + own(i)))
        assert cache.nbytes <= budget
    assert cache.match(SYSTEM + own(0)) == 120  # kept: used after 1-4
    # the oldest went; the whole system prompt stays (its last 4 tokens from a block another conversation holds)
    assert [cache.match(SYSTEM + own(i)) for i in (1, 2, 3)] == [100, 100, 100]
    assert cache.match(SYSTEM + own(7)) == 120
    held = cache.nbytes
    assert cache.shrink(0) == held and cache.nbytes == 0 and len(cache) == 0
    assert cache.stats["prefix_blocks_evicted"] == cache.stats["prefix_blocks_added"]


def test_only_plain_kv_caches_are_cut_into_blocks():
    assert sliceable([KVCache(), KVCache()])
    assert not sliceable([KVCache(), RotatingKVCache(max_size=64)])  # a sliding window is not a prefix
    assert not sliceable([])
    with pytest.raises(ValueError, match="block_tokens"):
        PrefixCache(block_tokens=0)
    with pytest.raises(ValueError, match="prefix_cache"):
        LLMEngine("m", "nowhere", prefix_cache="radix")


def _kv_arrays(cache) -> list[mx.array]:
    keys, values = cache.keys, cache.values
    return [*keys, *values] if isinstance(keys, tuple) else [keys, values]


@pytest.mark.parametrize("kv_bits", [None, 8])
def test_a_batch_row_goes_to_the_block_cache_as_views_so_only_its_new_blocks_are_copied(kv_bits):
    """Two rows of a batch whose tokens share all but their last 256: the first row's blocks are
    held, so the second adds 2 blocks of 128. Rows joined with block_rows' caches give `insert`
    views, and inserting copies only those 2 blocks; mlx-lm's own batch (and the quantized batch's
    copying class) hands over a copy of the whole row, which the same insert evaluates first. The
    blocks hold the row's own keys and values, and a fetch gives block_rows' caches again, as does
    a batch of empty caches (new prompts with nothing cached)."""
    layers, heads, dim, n, new, group = 4, 4, 64, 2048, 256, 64
    tokens = [list(range(n)), list(range(n - new)) + [100_000 + i for i in range(new)]]
    kv_rows = [[(mx.random.normal((1, heads, n, dim)), mx.random.normal((1, heads, n, dim))) for _ in range(layers)] for _ in tokens]

    def batch(fresh) -> list:
        rows = [fresh() for _ in tokens]
        for caches, kvs in zip(rows, kv_rows, strict=True):
            for c, (k, v) in zip(caches, kvs, strict=True):
                c.update_and_fetch(k, v)
        merged = [rows[0][i].merge([r[i] for r in rows]) for i in range(layers)]  # as mlx-lm's _merge_caches
        mx.eval([a for c in merged for a in _kv_arrays(c)])
        return merged

    def second_row_added(merged: list) -> tuple[PrefixCache, int, float]:
        cache = PrefixCache(block_tokens=128, kv_bits=kv_bits, kv_group_size=group)
        cache.insert(tokens[0], [c.extract(0) for c in merged])
        mx.synchronize()
        mx.clear_cache()
        mx.reset_peak_memory()
        base = mx.get_active_memory()
        added = cache.insert(tokens[1], [c.extract(1) for c in merged])
        return cache, added, mx.get_peak_memory() - base

    plain = (
        (lambda: [KVCache() for _ in range(layers)])
        if kv_bits is None
        else (lambda: [QuantizedKVCache(group_size=group, bits=kv_bits) for _ in range(layers)])
    )
    views = batch(lambda: block_rows.fresh(layers, kv_bits, group))
    row_bytes = sum(a[1:2].nbytes for c in views for a in _kv_arrays(c))
    assert type(views[0]) is (RowViewBatchKVCache if kv_bits is None else RowViewBatchQuantizedKVCache)

    _, copied_added, copied_peak = second_row_added(batch(plain))
    cache, added, peak = second_row_added(views)
    assert added == copied_added == row_bytes * new // n  # 2 blocks of the 16
    assert copied_peak >= row_bytes  # the whole row copied first
    assert peak < 2 * added and 4 * peak < row_bytes  # only the new blocks

    got, reused = cache.fetch(tokens[1], limit=n)
    assert reused == n and got is not None
    assert type(got[0]) is (BlockKVCache if kv_bits is None else BlockQuantizedKVCache)
    for layer, c in zip(got, views, strict=True):  # the shared part is the first row's, the rest the second's
        for fetched, held in zip(_kv_arrays(layer), _kv_arrays(c), strict=True):
            assert mx.array_equal(fetched[..., : n - new, :], held[0:1, :, : n - new])
            assert mx.array_equal(fetched[..., n - new :, :], held[1:2, :, n - new :])
    empty = block_rows.fresh(2, kv_bits, group)
    assert type(empty[0].merge(empty)) is type(views[0])


# ---- in the engine, on llama-10m ------------------------------------------------------------

RULE = "Rule: read the file before you change it, run the tests after, and say what changed. "


def run(coro):
    return asyncio.run(coro)


def engine_with(models_dir, **kw) -> LLMEngine:
    e = LLMEngine("llama-10m", str(models_dir / "llama-10m"), max_batch=16, prompt_cache_min_tokens=32, prefix_block_tokens=32, **kw)
    run(e.load())
    return e


@pytest.fixture(scope="module")
def system(models_dir) -> str:
    return RULE * 8  # 240 tokens with llama-10m's tokenizer


def turn(messages: list[dict], tokens: int = 12) -> GenerationRequest:
    return GenerationRequest(messages=messages, max_tokens=tokens, temperature=0)


async def conversations(engine: LLMEngine, system: str, n: int, turns: int, first: int = 0) -> list[list]:
    """n conversations at once, `turns` turns each; each conversation's finished deltas in order."""

    async def one(c: int) -> list:
        messages: list[dict] = [{"role": "system", "content": system}]
        done = []
        for t in range(turns):
            messages.append({"role": "user", "content": f"Conversation {c}, step {t}: fix module_{c}_{t}.py"})
            d = await engine.complete(turn(list(messages)))
            done.append(d)
            messages.append({"role": "assistant", "content": d.text})
        return done

    return list(await asyncio.gather(*(one(c) for c in range(first, first + n))))


def test_the_engine_stores_a_shared_system_prompt_once(models_dir, system):
    blocks, lru = engine_with(models_dir), engine_with(models_dir, prefix_cache="lru")
    try:
        system_tokens = len(blocks.tokenizer.encode(system))
        per_token = blocks.kv_bytes_per_token
        run(conversations(blocks, system, 1, 1))
        one = blocks.memory().prefix_cache_bytes
        assert one >= system_tokens * per_token
        run(conversations(blocks, system, 8, 1, first=1))
        grown = blocks.memory().prefix_cache_bytes - one
        # eight more conversations add only their own tokens (a user turn and 12 generated, ~40), the
        # block each shares partly with the system prompt and a last block (32 each), not the system prompt again
        assert grown <= 8 * (40 + 2 * 32) * per_token < 0.5 * 8 * system_tokens * per_token
        run(conversations(lru, system, 9, 1))
        assert lru.memory().prefix_cache_bytes >= 9 * system_tokens * per_token  # the old cache: one copy each
        assert blocks.prefix_cache_kind == "blocks" and lru.prefix_cache_kind == "lru"
    finally:
        run(blocks.stop())
        run(lru.stop())


def test_a_later_turn_reuses_the_earlier_turns_and_reports_them(models_dir, system):
    e = engine_with(models_dir)
    try:
        before = e.counters()
        (done,) = run(conversations(e, system, 1, 3))
        first, second, third = (d.usage for d in done)
        assert first.cached_tokens == 0
        # each later turn finds the turns before it (to the token, up to where the re-rendered reply differs)
        assert second.cached_tokens >= first.prompt_tokens
        assert third.cached_tokens >= second.prompt_tokens
        after = e.counters()
        assert after["prefix_hit_tokens"] - before["prefix_hit_tokens"] == second.cached_tokens + third.cached_tokens
        prefilled = after["prompt_tokens"] - before["prompt_tokens"]  # what mlx-lm ran through the model
        assert prefilled <= sum(u.prompt_tokens - u.cached_tokens for u in (first, second, third)) + 3
    finally:
        run(e.stop())


def test_greedy_tokens_are_the_same_with_and_without_the_cache(models_dir, system):
    cached, plain = engine_with(models_dir), engine_with(models_dir, prompt_cache_entries=0)
    try:
        with_cache = run(conversations(cached, system, 4, 3))
        without = run(conversations(plain, system, 4, 3))
        assert sum(d.usage.cached_tokens for c in with_cache for d in c) > 4 * 2 * 200  # the cache was used
        assert all(d.usage.cached_tokens == 0 for c in without for d in c)
        assert [[d.token_ids for d in c] for c in with_cache] == [[d.token_ids for d in c] for c in without]
    finally:
        run(cached.stop())
        run(plain.stop())


def test_the_cache_stays_within_its_budget_and_shrinks_on_demand(models_dir, system):
    budget = 400 * 16 * 1024  # 400 tokens of llama-10m's KV (16 KiB each): the system prompt and a little
    e = engine_with(models_dir, prompt_cache_bytes=budget)
    try:
        run(conversations(e, system, 6, 2))
        held = e.memory().prefix_cache_bytes
        assert 0 < held <= budget
        assert e.counters()["prefix_blocks_evicted"] > 0
        freed = run(e.shrink_prefix_cache(0))
        assert freed == held and e.memory().prefix_cache_bytes == 0 and len(e.prompt_cache) == 0
        (again,) = run(conversations(e, system, 1, 1))
        assert again[0].usage.cached_tokens == 0 and again[0].finish_reason in ("stop", "length")
        with pytest.raises(ValueError, match="target_bytes"):
            run(e.shrink_prefix_cache(-1))
    finally:
        run(e.stop())


def test_conversations_that_start_together_prefill_the_system_prompt_once(models_dir, system):
    """Six conversations arrive at once to a cold cache: one prefills the system prompt, the others
    wait a step or two for its blocks (share_prefill) and prefill only their own tokens, with the
    tokens they would have had alone."""
    shared, apart = engine_with(models_dir), engine_with(models_dir, share_prefill=False)
    try:
        system_tokens = len(shared.tokenizer.encode(system))
        prefilled = {}
        results = {}
        for name, e in (("shared", shared), ("apart", apart)):
            before = e.counters()["prompt_tokens"]
            results[name] = run(conversations(e, system, 6, 1))
            prefilled[name] = e.counters()["prompt_tokens"] - before
        assert prefilled["apart"] >= 6 * system_tokens
        assert prefilled["shared"] <= system_tokens + 6 * (30 + 32)  # each its own turn (~30) and a partly shared block
        assert sum(c[0].usage.cached_tokens for c in results["shared"]) >= 5 * (system_tokens - 32)
        assert [c[0].token_ids for c in results["shared"]] == [c[0].token_ids for c in results["apart"]]
    finally:
        run(shared.stop())
        run(apart.stop())


@pytest.mark.parametrize("kv_bits", [None, 8])
def test_a_group_whose_rows_have_cached_prefixes_of_different_lengths_prefills_unpadded(models_dir, system, kv_bits):
    """Four arrivals held into one group while the batch decodes, each with the system prompt
    cached and a user turn of its own length. With prefill_align each row takes from the cache only
    as much as leaves it the group's longest uncached length, so mlx-lm prefills the rows unpadded
    (the same number of tokens each: no right padding, no roll of the group's caches afterwards);
    greedy tokens are those of the right-padded group (prefill_align off), and the cached tokens
    each row reports are what it really reused. Rows whose longest turn spans more than one prefill
    chunk stay ragged: there mlx-lm gives a shorter row its first token chunks earlier. The same
    with an 8-bit cache (a row's cut prefix is a slice of its blocks' quantized keys, scales and
    biases)."""
    # reserve_concurrency: KV for the busy one's 3,000 tokens beside the four (M4)
    hold = {"prefill_batch": 4, "admit_hold_steps": 100_000, "admit_quiet_steps": 100_000, "kv_bits": kv_bits, "reserve_concurrency": 8}

    async def scenario(e: LLMEngine) -> tuple[list, list, dict]:
        await e.complete(turn([{"role": "system", "content": system}, {"role": "user", "content": "Warm the cache."}]))
        no_eos = dict.fromkeys(e.eos_ids, -100.0)
        busy = e.generate(GenerationRequest(prompt_tokens=[7] * 20, max_tokens=3000, temperature=0, logit_bias=no_eos))
        await anext(busy)  # the batch decodes: the four below are held until all four are there
        before = e.counters()
        asks = [turn([{"role": "system", "content": system}, {"role": "user", "content": "Fix" + " this module" * n}]) for n in (8, 11, 14, 17)]
        done = await asyncio.gather(*(e.complete(a) for a in asks))
        after = e.counters()
        await busy.aclose()
        counted = {k: after[k] - before[k] for k in ("admitted_groups", "admitted_requests", "aligned_tokens", "ragged_rows", "prompt_tokens")}
        return [d.token_ids for d in done], [(d.usage.prompt_tokens, d.usage.cached_tokens) for d in done], counted

    aligned, ragged = engine_with(models_dir, **hold), engine_with(models_dir, prefill_align=False, **hold)
    chunked = engine_with(models_dir, prefill_chunk_tokens=16, **hold)
    try:
        a_tokens, a_usage, a = run(scenario(aligned))
        r_tokens, r_usage, r = run(scenario(ragged))
        k_tokens, k_usage, k = run(scenario(chunked))
    finally:
        for e in (aligned, ragged, chunked):
            run(e.stop())
    assert min(p - c for p, c in r_usage) > 16 and k["aligned_tokens"] == 0 and k_usage == r_usage and k_tokens == r_tokens
    assert a["admitted_groups"] == r["admitted_groups"] == 1 and a["admitted_requests"] == 4
    rests = [p - c for p, c in a_usage]
    assert len(set(rests)) == 1 and a["ragged_rows"] == 0  # every row prefilled the same number of tokens
    assert len({p - c for p, c in r_usage}) > 1  # ... where each reusing all it could left them ragged
    # what the shorter rows gave back is the padding the ragged group ran: the same tokens in all
    assert a["aligned_tokens"] == sum(c for _, c in r_usage) - sum(c for _, c in a_usage) > 0
    assert a["prompt_tokens"] == r["prompt_tokens"] + a["aligned_tokens"]
    assert a_tokens == r_tokens


@pytest.mark.parametrize("kv_bits", [None, 8])
def test_the_engine_gives_the_block_cache_its_rows_as_views(models_dir, system, kv_bits, monkeypatch):
    """Every prompt the engine keeps, at its first token and whole when its request finishes,
    reaches the block cache as block_rows' views (so only the blocks it lacks are copied), with and
    without a quantized cache: every row of every batch joined with block_rows' caches."""
    e = engine_with(models_dir, kv_bits=kv_bits)
    kinds: list[type] = []
    insert = e.prompt_cache.insert

    def seen(tokens, layers):
        kinds.append(type(layers[0]))
        return insert(tokens, layers)

    monkeypatch.setattr(e.prompt_cache, "insert", seen)
    try:
        run(conversations(e, system, 3, 2))
        kept = e.counters()
    finally:
        run(e.stop())
    assert len(kinds) >= 6 and set(kinds) == {BlockKVCache if kv_bits is None else BlockQuantizedKVCache}
    assert kept["prefix_blocks_added"] > 0
