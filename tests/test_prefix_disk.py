"""The block prefix cache's disk tier (deployments/engines/prefix_disk.py): blocks written beside the
memory cache come back in a new cache (a new process) exactly, plain and 8-bit; a torn or foreign file
is never used; the node's budget holds across models and after a restart; and inside the LLM engine
on llama-10m's real weights, a conversation whose model was stopped and loaded again reuses its
prefix from disk with the same greedy tokens."""

import asyncio
import shutil
from pathlib import Path

import mlx.core as mx
import pytest
from mlx_lm.models.cache import KVCache

from deployments.engines.llm import LLMEngine
from deployments.engines.prefix_cache import PrefixCache
from deployments.engines.prefix_disk import READ_PROBE_EVERY, SUFFIX, DiskTier, chain, model_identity, tier_bytes
from deployments.engines.quantized_cache import QuantizedKVCache
from deployments.wire.generation import GenerationRequest

LAYERS, HEADS, DIM, BLOCK = 2, 2, 64, 16


def kv(tokens: list[int], bits: int | None = None) -> list:
    """Per-layer caches whose entries depend on the tokens so far, as a model's do (bfloat16, as served)."""
    prefix = mx.cumsum(mx.array(tokens, dtype=mx.float32))[None, None, :, None] / 1000
    layers = []
    for layer in range(LAYERS):
        keys = mx.broadcast_to(prefix + layer, (1, HEADS, len(tokens), DIM)).astype(mx.bfloat16)
        cache = KVCache() if bits is None else QuantizedKVCache(group_size=64, bits=bits)
        cache.update_and_fetch(mx.array(keys), mx.array(-keys))
        layers.append(cache)
    return layers


TOKENS = list(range(100, 100 + 5 * BLOCK + 7))  # 5 full blocks and a short last one


def arrays(layer_caches: list) -> list[mx.array]:
    out = []
    for c in layer_caches:
        for x in (c.keys, c.values):
            out += list(x) if isinstance(x, tuple) else [x]
    return out


def written(tier: DiskTier) -> list[Path]:
    assert tier.flush(10)
    return sorted(tier.folder.glob(f"*{SUFFIX}"))


@pytest.mark.parametrize("bits", [None, 8])
def test_blocks_written_by_one_cache_come_back_exactly_in_another(tmp_path, bits):
    first = PrefixCache(block_tokens=BLOCK, kv_bits=bits, disk=DiskTier(tmp_path, "model-a", 2**30))
    first.insert(TOKENS, kv(TOKENS, bits))
    assert len(written(first.disk)) == 5  # full blocks only
    first.disk.close()

    again = PrefixCache(block_tokens=BLOCK, kv_bits=bits, disk=DiskTier(tmp_path, "model-a", 2**30))  # a new process
    asked = TOKENS[: 4 * BLOCK + 3] + [9, 9, 9]
    assert again.match(asked) == 0
    assert again.restore(asked) == 4 * BLOCK  # the blocks it asks for, in a row
    assert again.match(asked) == 4 * BLOCK and again.disk.stats["disk_blocks_restored"] == 4
    layers, reused = again.fetch(asked, limit=len(asked) - 1)
    reference, _ = _reference(bits).fetch(asked, limit=4 * BLOCK)  # a warm cache's same prefix
    assert reused == 4 * BLOCK
    for got, want in zip(arrays(layers), arrays(reference), strict=True):
        assert got.dtype == want.dtype and mx.array_equal(got, want)
    assert again.restore(asked) == 0  # in memory now: nothing is read twice


def _reference(bits):
    cache = PrefixCache(block_tokens=BLOCK, kv_bits=bits)
    cache.insert(TOKENS, kv(TOKENS, bits))
    return cache


def test_a_torn_or_foreign_block_is_never_used(tmp_path):
    first = PrefixCache(block_tokens=BLOCK, disk=DiskTier(tmp_path, "model-a", 2**30))
    first.insert(TOKENS, kv(TOKENS))
    assert len(written(first.disk)) == 5
    keys = [chain("", TOKENS[:BLOCK])]
    for i in range(1, 5):
        keys.append(chain(keys[-1], TOKENS[i * BLOCK : (i + 1) * BLOCK]))
    torn = first.disk._file(keys[2])
    torn.write_bytes(torn.read_bytes()[:-100])  # the third block cut short, as by a crash mid-write
    (tmp_path / "model-b").mkdir()
    shutil.copy(first.disk._file(keys[0]), tmp_path / "model-b" / first.disk._file(keys[0]).name)  # model-a's block in model-b's folder

    again = PrefixCache(block_tokens=BLOCK, disk=DiskTier(tmp_path, "model-a", 2**30))
    assert again.restore(TOKENS) == 2 * BLOCK  # up to the torn one, which is gone
    assert again.disk.stats["disk_blocks_refused"] == 1 and not torn.exists()
    other = PrefixCache(block_tokens=BLOCK, disk=DiskTier(tmp_path, "model-b", 2**30))
    assert other.restore(TOKENS) == 0 and other.disk.stats["disk_blocks_refused"] == 1  # another model's: refused


def test_the_budget_holds_for_every_model_of_the_node_and_after_a_restart(tmp_path):
    a = PrefixCache(block_tokens=BLOCK, disk=DiskTier(tmp_path, "model-a", 2**30))
    a.insert(TOKENS, kv(TOKENS))
    block = written(a.disk)[0].stat().st_size
    b = PrefixCache(block_tokens=BLOCK, disk=DiskTier(tmp_path, "model-b", 7 * block))  # a budget for 7 of both models' blocks
    b.insert(TOKENS, kv(TOKENS))
    written(b.disk)
    assert tier_bytes(tmp_path) <= 7 * block
    assert len(list((tmp_path / "model-b").glob(f"*{SUFFIX}"))) == 5  # the newest stay: model-a's oldest went
    DiskTier(tmp_path, "model-a", 3 * block)  # a restart with a lower budget trims at once
    assert tier_bytes(tmp_path) <= 3 * block


def test_a_model_stopped_and_loaded_again_reads_its_prefix_back_with_the_same_greedy_tokens(models_dir, tmp_path):
    path = str(models_dir / "llama-10m")
    system = "Rule: read the file before you change it, run the tests after, and say what changed. " * 8
    messages = [{"role": "system", "content": system}, {"role": "user", "content": "fix module_1.py"}]
    request = GenerationRequest(messages=messages, max_tokens=16, temperature=0)

    def engine(**kw) -> LLMEngine:
        e = LLMEngine("llama-10m", path, max_batch=4, prompt_cache_min_tokens=32, prefix_block_tokens=32, **kw)
        asyncio.run(e.load())
        return e

    first = engine(prefix_disk_bytes=2**30, prefix_disk_dir=str(tmp_path))
    cold = asyncio.run(first.complete(request))
    asyncio.run(first.stop())  # its queued blocks reach the disk before it ends
    assert cold.usage.cached_tokens == 0 and first.counters()["disk_blocks_written"] >= 7

    again = engine(prefix_disk_bytes=2**30, prefix_disk_dir=str(tmp_path))
    plain = engine()
    try:
        warm = asyncio.run(again.complete(request))
        reference = asyncio.run(plain.complete(request))
        assert warm.usage.cached_tokens >= 7 * 32 and again.counters()["disk_blocks_restored"] >= 7
        assert warm.token_ids == reference.token_ids == cold.token_ids
        identity = model_identity(path, None, 64, 32, "")
        assert (tmp_path / identity).is_dir()
    finally:
        asyncio.run(again.stop())
        asyncio.run(plain.stop())


def test_a_prefix_is_read_back_only_where_that_beats_prefilling_it(tmp_path):
    first = PrefixCache(block_tokens=BLOCK, disk=DiskTier(tmp_path, "model-a", 2**30))
    first.insert(TOKENS, kv(TOKENS))
    written(first.disk)
    again = PrefixCache(block_tokens=BLOCK, disk=DiskTier(tmp_path, "model-a", 2**30))
    again.disk.per_token = first.disk.per_token  # as its first block would tell it
    again.disk.prefill_rate = lambda: 1e15  # a prefill far faster than any disk (an H100 on a small model)
    assert not again.disk.worth_reading() and again.restore(TOKENS) == 0 and again.disk.stats["disk_blocks_restored"] == 0
    again.disk.prefill_rate = lambda: 10.0  # a Mac's prefill of a large model: 10 tokens a second
    assert again.disk.worth_reading() and again.restore(TOKENS) == 5 * BLOCK


def test_a_tier_passed_up_as_too_slow_still_reads_now_and_then_so_its_rate_can_recover(tmp_path):
    disk = DiskTier(tmp_path, "model-a", 2**30)
    disk.per_token = 1000.0
    disk._read_rate = 1000.0  # one slow read back: a token a second
    disk.prefill_rate = lambda: 100.0
    asked = [disk.worth_reading() for _ in range(3 * READ_PROBE_EVERY)]
    assert asked.count(True) == 3 and asked[READ_PROBE_EVERY - 1]
