"""How much of MLX's buffer cache an LLM engine keeps through mlx-lm's prefill
(deployments/engines/buffer_cache.py), on real MLX allocations and a real engine."""

import asyncio
import sys

import mlx.core as mx
import pytest

from deployments.engines import buffer_cache
from deployments.engines.llm import LLMEngine
from deployments.wire.generation import GenerationRequest


def _fill_cache() -> None:
    """Allocate and free ~16 MiB: the freed buffers go to MLX's cache."""
    mx.eval(mx.ones((4, 1 << 20), dtype=mx.float32) * 2)
    mx.synchronize()


def test_mlx_lm_clears_only_past_what_the_engines_keep(monkeypatch):
    monkeypatch.setattr(buffer_cache, "_keep", {})
    owner = object()
    buffer_cache.keep(owner, 1 << 40)
    generate = sys.modules["mlx_lm.generate"]
    assert generate.mx.clear_cache is buffer_cache.clear_past_keep
    assert generate.mx.array is mx.array and generate.mx.random is mx.random and generate.mx.eval is mx.eval  # mlx.core's own
    assert mx.clear_cache is not buffer_cache.clear_past_keep  # the rest of the process is untouched

    _fill_cache()
    held = mx.get_cache_memory()
    assert held > 0
    generate.mx.clear_cache()  # what mlx-lm's prefill calls after every chunk
    assert mx.get_cache_memory() >= held  # kept: within what the engines keep

    with buffer_cache.mlx_lm_own():  # a bare BatchGenerator's baseline beside an engine
        _fill_cache()
        generate.mx.clear_cache()
        assert mx.get_cache_memory() == 0
    assert buffer_cache.kept_bytes() == 1 << 40

    buffer_cache.keep(owner, 0)  # mlx-lm's own behaviour
    _fill_cache()
    generate.mx.clear_cache()
    assert mx.get_cache_memory() == 0
    buffer_cache.release(owner)
    assert buffer_cache.kept_bytes() == 0


@pytest.mark.parametrize("keep_mib", [None, 3])
def test_an_engine_keeps_its_kv_reservation_or_its_setting_until_it_stops(models_dir, monkeypatch, keep_mib):
    monkeypatch.setattr(buffer_cache, "_keep", {})
    engine = LLMEngine(
        "llama-10m", str(models_dir / "llama-10m"), reserve_context_tokens=1024, reserve_concurrency=2, prefill_cache_keep_mib=keep_mib
    )
    asyncio.run(engine.load())
    try:
        reserved = engine.kv_bytes_per_token * 1024 * 2
        assert buffer_cache.kept_bytes() == (reserved if keep_mib is None else keep_mib * 2**20)
        assert engine.scheduling()["prefill_cache_keep_mib"] == keep_mib
        done = asyncio.run(engine.complete(GenerationRequest(prompt="Once upon a time", max_tokens=4, temperature=0)))
        assert done.finish_reason == "length"
    finally:
        asyncio.run(engine.stop())
    assert buffer_cache.kept_bytes() == 0
