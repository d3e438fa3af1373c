"""What the LLM engine tests (test_engine_llm, test_kv_quant) run on an engine in process."""

import asyncio

from deployments.engines.llm import LLMEngine
from deployments.wire.generation import GenerationRequest


def greedy(prompt: str, n: int = 24, **kw) -> GenerationRequest:
    return GenerationRequest(prompt=prompt, max_tokens=n, temperature=0, **kw)


async def join_and_leave(engine: LLMEngine, prompts: list[str], first: int, tokens: int) -> tuple[dict[str, list[int]], list[list[int]]]:
    """Each prompt's greedy tokens alone, then the same prompts in one batch that others join and leave:
    the first `first` start together, one more is cancelled after three deltas, then the rest join.
    Returns (tokens alone by prompt, tokens in the batch in the prompts' order)."""
    alone = {p: (await engine.complete(greedy(p, tokens))).token_ids for p in prompts}
    early = [asyncio.create_task(engine.complete(greedy(p, tokens))) for p in prompts[:first]]
    cancelled = engine.generate(greedy("This one leaves after three deltas", 200))
    seen = 0
    async for _ in cancelled:
        seen += 1
        if seen == 3:
            break
    await cancelled.aclose()  # type: ignore[attr-defined]  # an async generator
    later = [asyncio.create_task(engine.complete(greedy(p, tokens))) for p in prompts[first:]]
    together = await asyncio.gather(*early, *later)
    return alone, [d.token_ids for d in together]
