"""Chunked prefill (issue 27 item 3) in the LLM engine on llama-10m's real weights (no Ray): a long
prompt is prefilled `prefill_chunk_tokens` at a time between decode steps, so streams already decoding
get tokens while it is prefilled, and greedy output is the same whatever the chunk."""

import asyncio
import random

import pytest

from deployments.engines.llm import LLMEngine
from deployments.engines.options import LLMEngineOptions
from deployments.wire.generation import GenerationRequest


def run(coro):
    return asyncio.run(coro)


def engine_with(models_dir, **kw) -> LLMEngine:
    e = LLMEngine(
        "llama-10m", str(models_dir / "llama-10m"), max_batch=16, admit_hold_steps=0, prompt_cache_min_tokens=32, prefix_block_tokens=32, **kw
    )
    run(e.load())
    return e


def ids(seed: int, n: int, vocab: int = 2048) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, vocab) for _ in range(n)]


async def together(engine: LLMEngine, prompts: list[list[int]], tokens: int = 16) -> list[list[int]]:
    done = await asyncio.gather(*(engine.complete(GenerationRequest(prompt_tokens=p, max_tokens=tokens, temperature=0)) for p in prompts))
    return [d.token_ids for d in done]


def test_greedy_tokens_are_the_same_whatever_the_chunk(models_dir):
    long, other = ids(1, 600), ids(2, 350)
    prompts = [long, ids(3, 40), other, ids(4, 90)]
    results = []
    for chunk, decode_steps in ((4096, 0), (100, 0), (37, 0), (100, 2)):
        e = engine_with(models_dir, prefill_chunk_tokens=chunk, prefill_decode_steps=decode_steps)
        try:
            first = run(together(e, prompts))
            # a later request that begins with the long prompt: its prefix comes from the block cache
            # (kept from chunked prefill) and only its own tail is prefilled
            later = run(together(e, [long + ids(5, 150)]))
            assert e.counters()["prefix_hit_tokens"] >= 500
            results.append(first + later)
        finally:
            run(e.stop())
    assert results[0] == results[1] == results[2] == results[3]


async def decode_during_prefill(engine: LLMEngine, long_tokens: int) -> int:
    """Tokens a decoding stream gets between a long prompt's arrival and that prompt's first token."""
    no_eos = dict.fromkeys(engine.eos_ids, -100.0)
    got: list[int] = []
    window: dict[str, int] = {}
    started, long_done = asyncio.Event(), asyncio.Event()

    async def decode() -> None:
        request = GenerationRequest(prompt_tokens=ids(6, 20), max_tokens=2000, temperature=0, logit_bias=no_eos)
        async for d in engine.generate(request):
            got.extend(d.token_ids)
            if len(got) >= 4:
                started.set()
            if long_done.is_set():
                return

    async def long() -> None:
        await started.wait()
        window["start"] = len(got)
        async for d in engine.generate(GenerationRequest(prompt_tokens=ids(7, long_tokens), max_tokens=1, temperature=0)):
            if d.token_ids:
                window["end"] = len(got)
        long_done.set()

    await asyncio.gather(decode(), long())
    return window["end"] - window["start"]


@pytest.mark.parametrize("decode_steps", [0, 2])
def test_decoding_streams_get_tokens_between_the_chunks_of_a_long_prefill(models_dir, decode_steps):
    chunk = 128
    chunked = engine_with(models_dir, prefill_chunk_tokens=chunk, prefill_decode_steps=decode_steps)
    whole = engine_with(models_dir, prefill_chunk_tokens=4096, prefill_decode_steps=decode_steps)
    try:
        during = run(decode_during_prefill(chunked, 1500))
        during_whole = run(decode_during_prefill(whole, 1500))
    finally:
        run(chunked.stop())
        run(whole.stop())
    # 1,499 tokens in chunks of 128: twelve steps, each one decoding the running stream first, and
    # decode_steps more steps that only decode after each chunk
    assert during >= (1499 // chunk - 1) * (1 + decode_steps)
    # mlx-lm's default slice (2,048) prefills it in one step: the stream waits the whole prefill (the
    # few tokens it gets come while the prompt is tokenized and admitted, and while its row joins)
    assert during_whole <= 5 < during


def test_the_chunk_is_a_served_setting():
    assert LLMEngineOptions().prefill_chunk_tokens == 512
    with pytest.raises(ValueError):
        LLMEngineOptions(prefill_chunk_tokens=0)
    with pytest.raises(ValueError, match="prefill_chunk_tokens"):
        LLMEngine("m", "nowhere", prefill_chunk_tokens=0)
    with pytest.raises(ValueError, match="prefill_decode_steps"):
        LLMEngine("m", "nowhere", prefill_decode_steps=-1)
    assert LLMEngine("m", "nowhere", prefill_chunk_tokens=256).scheduling()["prefill_chunk_tokens"] == 256
