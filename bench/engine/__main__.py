"""`python -m bench.engine`: aggregate decode tok/s of the LLM engine against mlx-lm's
BatchGenerator driven directly in the same process (the ceiling for any server), at several
concurrencies, on the embedded 10M llama and SmolLM2. Prints a table, writes JSON (and Markdown
with --markdown). Greedy decoding, the same prompts and max_tokens on both sides."""

import argparse
import asyncio
import json
import platform
import time
from pathlib import Path
from typing import Any

import deployments  # noqa: F401  (OpenBLAS before MLX)

# isort: split
import mlx.core as mx
import mlx_lm
from mlx_lm.generate import BatchGenerator

from deployments.engines.llm import LLMEngine
from deployments.models import prepare
from deployments.wire.generation import GenerationRequest

MLX_VERSION: str = mx.__version__  # type: ignore[attr-defined]  # not in mlx's stubs
TOPICS = ["the sea", "a city at night", "bread", "mountains", "a small robot", "rain", "music", "the moon"]


def prompts(n: int) -> list[str]:
    return [f"Write a long story about {TOPICS[i % len(TOPICS)]} (number {i})." for i in range(n)]


def direct(path: str, texts: list[str], max_tokens: int) -> tuple[int, float]:
    """Tokens generated and seconds, mlx-lm alone: insert everything, step until done."""
    model, tokenizer = mlx_lm.load(path)  # type: ignore[misc]  # a 2-tuple without return_config
    eos = [[t] for t in tokenizer.eos_token_ids]
    tokens = [tokenizer.apply_chat_template([{"role": "user", "content": t}], add_generation_prompt=True) for t in texts]
    gen = BatchGenerator(model, stop_tokens=eos, completion_batch_size=64, prefill_batch_size=8)
    started = time.perf_counter()
    gen.insert(tokens, max_tokens=[max_tokens] * len(tokens))
    done, produced = 0, 0
    while done < len(tokens):
        _, responses = gen.next()
        for r in responses:
            produced += r.finish_reason != "stop"
            done += r.finish_reason is not None
    elapsed = time.perf_counter() - started
    gen.close()
    return produced, elapsed


async def through_engine(engine: LLMEngine, texts: list[str], max_tokens: int) -> tuple[int, float]:
    requests = [GenerationRequest(messages=[{"role": "user", "content": t}], max_tokens=max_tokens, temperature=0) for t in texts]
    started = time.perf_counter()
    results = await asyncio.gather(*(engine.complete(r) for r in requests))
    return sum(r.usage.completion_tokens for r in results), time.perf_counter() - started  # type: ignore[union-attr, misc]  # complete() sets usage


def measure(name: str, path: str, concurrencies: list[int], max_tokens: int, speculation: str = "prompt_lookup") -> list[dict]:
    rows = []
    # No prefix reuse: the direct side has none, and the prompts share a long prefix.
    engine = LLMEngine(
        name, path, max_batch=64, prompt_cache_entries=0, speculation=speculation, reserve_context_tokens=0
    )  # no KV reservation held (M4 off), as BatchGenerator runs
    asyncio.run(engine.load())
    asyncio.run(through_engine(engine, prompts(2), 4))  # warm-up: compile, caches
    direct(path, prompts(2), 4)
    for c in concurrencies:
        texts = prompts(c)
        d_tokens, d_s = direct(path, texts, max_tokens)
        e_tokens, e_s = asyncio.run(through_engine(engine, texts, max_tokens))
        row: dict[str, Any] = {
            "model": name,
            "concurrency": c,
            "max_tokens": max_tokens,
            "direct_tok_s": round(d_tokens / d_s, 1),
            "engine_tok_s": round(e_tokens / e_s, 1),
            "direct_tokens": d_tokens,
            "engine_tokens": e_tokens,
        }
        row["ratio"] = round(row["engine_tok_s"] / row["direct_tok_s"], 3)
        print(f"| {name} | {c} | {row['direct_tok_s']} | {row['engine_tok_s']} | {row['ratio']:.2f} |", flush=True)
        rows.append(row)
    asyncio.run(engine.stop())
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--models-dir", default="models")
    parser.add_argument("--concurrency", default="1,4,16,64")
    parser.add_argument("--json", default="bench/results/engine.json")
    parser.add_argument("--markdown", default=None)
    # the engine's own default is prompt lookup; "off" compares the plain decode step with BatchGenerator's
    parser.add_argument("--speculation", choices=["prompt_lookup", "off"], default="prompt_lookup")
    args = parser.parse_args()
    models = Path(args.models_dir)
    prepare(models, {"llama-10m", "smollm2-135m-instruct"}, log=lambda *_: None)
    concurrencies = [int(c) for c in args.concurrency.split(",")]
    header = "| model | concurrency | direct BatchGenerator tok/s | engine tok/s | ratio |\n|---|---:|---:|---:|---:|"
    print(header)
    rows = measure("llama-10m", str(models / "llama-10m"), concurrencies, 128, args.speculation)
    rows += measure("smollm2-135m-instruct", str(models / "smollm2-135m-instruct"), concurrencies, 48, args.speculation)
    result: dict[str, Any] = {
        "rows": rows,
        "machine": {"python": platform.python_version(), "processor": platform.machine(), "mlx": MLX_VERSION, "device": str(mx.default_device())},
    }
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.json}")
    if args.markdown:
        lines = [f"| {r['model']} | {r['concurrency']} | {r['direct_tok_s']} | {r['engine_tok_s']} | {r['ratio']:.2f} |" for r in rows]
        Path(args.markdown).write_text(MARKDOWN.format(table="\n".join([header, *lines]), device=result["machine"]["device"], mlx=MLX_VERSION))
        print(f"wrote {args.markdown}")


MARKDOWN = """# LLM engine throughput

Produced by `make bench-engine` (`python -m bench.engine --markdown docs/engine-benchmark.md`); JSON
in `bench/results/engine.json`. Aggregate decode tokens per second, greedy, every request the same
max_tokens (128 for the 10M llama, 48 for SmolLM2), all requests sent at once. "direct" is mlx-lm's
BatchGenerator driven in the same process with the same prompts: the ceiling for any server. MLX
{mlx} on {device}, Linux x86_64 with 2 cores (shared), OpenBLAS, float32 weights.

{table}
"""

if __name__ == "__main__":
    main()
