"""A quantized KV cache (`kv_bits`, deployments/engines/quantized_cache.py): the batched cache alone
on MLX arrays (merge, extend, filter, extract as rows join and leave a batch), inside the LLM engine
on llama-10m's real weights (greedy tokens against the unquantized cache, rows joining a running
batch, prefixes reused from quantized blocks), the memory figures the residency policy reserves,
and the settings refused."""

import asyncio
from typing import Any, cast

import mlx.core as mx
import pytest
from mlx_lm.models.cache import KVCache, QuantizedKVCache as SingleQuantizedKVCache, RotatingKVCache
from pydantic import ValidationError
from support.engine_runs import greedy, join_and_leave

from deployments.cache_shape import quantized_kv_bytes
from deployments.engines.llm import LLMEngine
from deployments.engines.options import LLMEngineOptions
from deployments.engines.prefix_cache import PrefixCache
from deployments.engines.quantized_cache import BatchQuantizedKVCache, QuantizedKVCache, quantizable
from deployments.estimate import kv_bytes_per_token
from deployments.models import open_engine
from policy import PolicyConfig
from policy.memory import required_bytes
from router.residency.registry import from_config

HEADS, DIM, GROUP = 2, 64, 64
PROMPTS = [
    "The number one is",
    "Once upon a time, in a land far away, there lived a",
    "def fibonacci(n):",
    "A quick brown fox jumps over the lazy dog and then",
    "Question: what is two plus two? Answer:",
    "Hello",
]


def run(coro):
    return asyncio.run(coro)


def kv_of(seed: int, n: int) -> tuple[mx.array, mx.array]:
    """One sequence's keys and values, (1, heads, n, dim)."""
    k = mx.random.normal((1, HEADS, n, DIM), key=mx.random.key(seed))
    return k, -2 * k + 1


def dequantized(q) -> mx.array:
    return mx.dequantize(q[0], q[1], q[2], group_size=GROUP, bits=8)


def single(seed: int, n: int) -> QuantizedKVCache:
    c = QuantizedKVCache(group_size=GROUP, bits=8)
    if n:
        c.update_and_fetch(*kv_of(seed, n))
    return c


def rows_of(batch: BatchQuantizedKVCache) -> list[mx.array]:
    """Each row's keys, dequantized, without its padding."""
    return [dequantized(batch.extract(i).keys) for i in range(batch.offset.shape[0])]


def test_rows_survive_merge_extend_filter_and_extract_exactly():
    # three requests join with cached prefixes of 5, 0 and 9 tokens; two more join the running batch later
    lengths = {0: 5, 1: 0, 2: 9, 3: 3, 4: 12}
    batch = BatchQuantizedKVCache.merge([single(s, lengths[s]) for s in (0, 1, 2)])
    assert batch.left_padding.tolist() == [4, 9, 0] and batch.size() == 9
    step = {s: kv_of(100 + s, 1) for s in range(5)}
    batch.update_and_fetch(mx.concatenate([step[s][0] for s in (0, 1, 2)]), mx.concatenate([step[s][1] for s in (0, 1, 2)]))
    later = BatchQuantizedKVCache.merge([single(s, lengths[s]) for s in (3, 4)])
    batch.extend(later)  # a group joins: both right-aligned at the longer index
    assert batch.offset.tolist() == [6, 1, 10, 3, 12]
    batch.filter([0, 2, 3, 4])  # request 1 leaves
    batch.filter([1, 2, 3])  # ... and request 0: the padding every row shared is dropped
    assert batch.left_padding.min().item() == 0
    got = rows_of(batch)
    for s, row in zip((2, 3, 4), got, strict=True):
        keys = kv_of(s, lengths[s])[0]
        if s == 2:  # it decoded a step before the others joined
            keys = mx.concatenate([keys, step[2][0]], axis=2)
        want = dequantized(mx.quantize(keys, group_size=GROUP, bits=8))
        assert row.shape == want.shape and mx.array_equal(row, want)
        assert cast(float, mx.abs(row - keys).max().item()) < 0.05  # 8 bits: close to what was put in


def test_a_batch_holds_about_half_a_16_bit_cache():
    k = mx.random.normal((4, HEADS, 300, DIM)).astype(mx.float16)
    plain, quant = KVCache(), BatchQuantizedKVCache([0] * 4, group_size=GROUP, bits=8)
    plain.update_and_fetch(k, k)
    quant.update_and_fetch(k, k)
    assert plain.nbytes / quant.nbytes == pytest.approx(2 / (1 + 4 / 64))  # 1.88x the tokens in the same bytes
    assert QuantizedKVCache().nbytes == 0 and BatchQuantizedKVCache([0]).nbytes == 0  # a request waiting to join is counted too
    assert quantizable([KVCache(), KVCache()]) and not quantizable([KVCache(), RotatingKVCache(max_size=8)])


def test_a_batch_of_one_gives_mlx_lms_own_quantized_logits(engines):
    """The batched cache against mlx-lm's single-stream QuantizedKVCache (what `generate --kv-bits`
    uses) on llama-10m: the same quantized keys and values, so the same logits, step after step."""
    model = engines[8].model
    prompt = mx.array([engines[8].tokenizer.encode("Once upon a time, in a land far away")])
    single = [SingleQuantizedKVCache(group_size=64, bits=8) for _ in model.layers]
    batched = [BatchQuantizedKVCache([0], group_size=64, bits=8) for _ in model.layers]
    plain = [KVCache() for _ in model.layers]
    a, b, c = model(prompt, cache=single), model(prompt, cache=batched), model(prompt, cache=plain)
    for _ in range(4):
        assert mx.array_equal(a[:, -1], b[:, -1]) and not mx.array_equal(a[:, -1], c[:, -1])  # quantized, alike
        step = a[:, -1:].argmax(axis=-1)
        a, b, c = model(step, cache=single), model(step, cache=batched), model(step, cache=plain)


@pytest.fixture(scope="module")
def engines(models_dir):
    made = {bits: LLMEngine("llama-10m", str(models_dir / "llama-10m"), max_batch=16, kv_bits=bits) for bits in (None, 8)}
    for e in made.values():
        run(e.load())
    yield made
    for e in made.values():
        run(e.stop())


def test_batched_greedy_with_8_bits_agrees_with_the_plain_cache(engines):
    async def batch(e: LLMEngine) -> list[list[int]]:
        return [d.token_ids for d in await asyncio.gather(*(e.complete(greedy(p, 24)) for p in PROMPTS[:4]))]

    plain, quant = run(batch(engines[None])), run(batch(engines[8]))
    same = sum(a == b for x, y in zip(plain, quant, strict=True) for a, b in zip(x, y, strict=True))
    assert same >= 0.9 * sum(map(len, plain))
    assert engines[8].kv_bytes_per_token * 3 < engines[None].kv_bytes_per_token  # float32 llama-10m: 4 / 1.125 bytes


def test_requests_joining_and_leaving_a_quantized_batch_keep_their_tokens(engines):
    alone, together = run(join_and_leave(engines[8], PROMPTS[:4], first=2, tokens=24))
    assert together == [alone[p] for p in PROMPTS[:4]]


SYSTEM = "You are a careful assistant. Answer briefly and cite the rule you follow. " * 4


def test_prefixes_are_reused_from_quantized_blocks(models_dir):
    def engine(**kw) -> LLMEngine:
        e = LLMEngine("llama-10m", str(models_dir / "llama-10m"), prompt_cache_min_tokens=32, prefix_block_tokens=32, **kw)
        run(e.load())
        return e

    quant, uncached, plain = engine(kv_bits=8), engine(kv_bits=8, prompt_cache_entries=0), engine()
    try:
        asks = [greedy(SYSTEM + f" Question {i}: what comes next?", 8) for i in range(2)]
        first = run(quant.complete(asks[0]))
        run(plain.complete(asks[0]))
        # the same prompt and reply kept in quantized blocks: (1 + 2 x 4 / 64) / 4 of float32's bytes
        assert isinstance(quant.prompt_cache, PrefixCache) and quant.prompt_cache.kv_bits == 8
        held, plain_held = quant.memory().prefix_cache_bytes, plain.memory().prefix_cache_bytes
        assert held > 0 and held / plain_held == pytest.approx(1.125 / 4)
        got = [first] + [run(quant.complete(r)) for r in asks[1:]]
        assert got[1].usage.cached_tokens >= 64  # the shared start came from the blocks
        assert [d.token_ids for d in got] == [run(uncached.complete(r)).token_ids for r in asks]
        layers, n = quant.prompt_cache.fetch(quant._checked_tokens(asks[0]), limit=10**6)
        assert n > 64 and layers is not None and all(isinstance(c, QuantizedKVCache) and c.bits == 8 for c in layers)
    finally:
        for e in (quant, uncached, plain):
            run(e.stop())


def test_the_reservation_counts_the_quantized_cache(models_dir):
    config = {"num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3, "hidden_size": 576, "torch_dtype": "bfloat16"}
    plain = kv_bytes_per_token(config)
    assert plain == 2 * 30 * 3 * 64 * 2
    eight, four = kv_bytes_per_token(config, kv_bits=8), kv_bytes_per_token(config, kv_bits=4, kv_group_size=32)
    assert eight == 2 * 30 * 3 * 64 * (1 + 2 * 2 / 64) and plain / eight >= 1.8
    assert four == quantized_kv_bytes(2 * 30 * 3 * 64, 2, 4, 32) == 2 * 30 * 3 * 64 * (0.5 + 2 * 2 / 32)
    # the registry reserves it: per model, or app-wide under the model's own
    entry = {"name": "llama-10m", "kind": "llm", "reserve_context_tokens": 4096, "reserve_concurrency": 8}
    catalog, entries = from_config([entry], models_dir)
    quant, _ = from_config([entry | {"llm_engine": {"kv_bits": 8}}], models_dir)
    app_wide, _ = from_config([entry], models_dir, llm_engine={"kv_bits": 8})
    overridden, _ = from_config([entry | {"llm_engine": {"kv_bits": None}}], models_dir, llm_engine={"kv_bits": 8})
    given, _ = from_config([entry | {"kv_bytes_per_token": entries["llama-10m"].kv_bytes_per_token, "llm_engine": {"kv_bits": 8}}], models_dir)
    base = catalog["llama-10m"]
    assert quant["llama-10m"].kv_bytes_per_token == base.kv_bytes_per_token * 1.125 / 4  # float32: 4 bytes -> 1 + 8/64
    assert app_wide["llama-10m"] == quant["llama-10m"] == given["llama-10m"] and overridden["llama-10m"] == base
    # so a node holds more instances: the policy's whole reservation (weights, KV, overhead)
    policy = PolicyConfig(instance_overhead_bytes=16 * 2**20)
    node = 4 * 2**30
    assert node // required_bytes(quant["llama-10m"], policy) >= 2.5 * (node // required_bytes(base, policy))
    # the entry's options reach the engine (as the residency effects pass them), which holds what was reserved
    _, quant_entries = from_config([entry | {"llm_engine": {"kv_bits": 8}}], models_dir)
    engine = open_engine(quant_entries["llama-10m"], models_dir, **(quant_entries["llama-10m"].llm_engine or {}))
    assert isinstance(engine, LLMEngine) and engine.kv_bits == 8
    run(engine.load())
    try:
        assert engine.kv_bytes_per_token == quant["llama-10m"].kv_bytes_per_token
        assert engine.memory().kv_bytes_reserved == 4096 * engine.kv_bytes_per_token  # reserve_context_tokens, one stream
    finally:
        run(engine.stop())


def test_bad_settings_are_refused(models_dir):
    bads: list[dict[str, Any]] = [{"kv_bits": 3}, {"kv_group_size": 17}]
    for bad in bads:
        with pytest.raises(ValidationError, match=next(iter(bad))):
            LLMEngineOptions.model_validate(bad)
        with pytest.raises(ValueError, match=f"llm_engine.*{next(iter(bad))}"):
            from_config([{"name": "llama-10m", "kind": "llm", "llm_engine": bad}], models_dir)
        with pytest.raises(ValueError, match=next(iter(bad))):
            LLMEngine("llama-10m", str(models_dir / "llama-10m"), **bad)
    e = LLMEngine("llama-10m", str(models_dir / "llama-10m"), kv_bits=8, kv_group_size=128)  # its heads are 64 wide
    with pytest.raises(ValueError, match="kv_group_size 128 does not divide llama-10m's head dimension 64"):
        run(e.load())
    assert e.health().status == "failed"
    run(e.stop())
