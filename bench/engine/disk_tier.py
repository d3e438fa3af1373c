"""A coding agent's conversation whose model is evicted and loaded again between its turns, on the
LLM engine in process: what its next turn's first token costs with the block cache's disk tier
(deployments/engines/prefix_disk.py) against a cold prefill of the same prompt.

    python -m bench.engine.disk_tier [--model models/llama-10m] [--prompt-tokens 20000] [--turns 3]

One conversation: a `--prompt-tokens` prefix (random ids: the system prompt, tools and history of an
agent), then `--turns` turns, each adding a user message (`--turn-tokens` ids) and `--answer-tokens`
greedy tokens to the history. Between two turns the engine is stopped and a new one loaded from the
same folder (a swap: the memory cache is gone). Three ways, each its own engines, in turns:
- `disk`: the tier on (a fresh folder): each turn after the first reads the prefix back from disk;
- `cold`: no prefix cache at all: each turn prefills its whole prompt (what a reload cost before);
- `warm`: one engine for the whole conversation, never stopped (the memory cache: the floor).
Per turn: the first token's time from the request (the engine loaded already; a load's own seconds
are beside it), the tokens reused, and for `disk` the blocks read back. The greedy tokens of every
way are checked to be the same. Ratios: disk / cold per turn. Writes JSON
(bench/results/engine-disk-tier.json)."""

import argparse
import asyncio
import platform
import random
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import deployments  # noqa: F401  (OpenBLAS before MLX)

# isort: split
import mlx.core as mx

from bench.report import write_json
from deployments.engines.llm import LLMEngine
from deployments.wire.generation import GenerationRequest

ROOT = Path(__file__).resolve().parents[2]


def engine(path: Path, context: int, **kw: Any) -> tuple[LLMEngine, float]:
    started = time.monotonic()
    e = LLMEngine(path.name, str(path), max_batch=4, context_length=context, reserve_context_tokens=context, **kw)
    asyncio.run(e.load())
    return e, time.monotonic() - started


def conversation(vocab: int, prompt_tokens: int, turns: int, turn_tokens: int, seed: int) -> tuple[list[int], list[list[int]]]:
    rng = random.Random(seed)
    return [rng.randrange(3, vocab) for _ in range(prompt_tokens)], [[rng.randrange(3, vocab) for _ in range(turn_tokens)] for _ in range(turns)]


def run_way(way: str, path: Path, args: argparse.Namespace, folder: Path) -> dict[str, Any]:
    context = args.prompt_tokens + args.turns * (args.turn_tokens + args.answer_tokens) + 64
    options: dict[str, Any] = {"prefix_disk_bytes": 64 * 2**30, "prefix_disk_dir": str(folder)} if way == "disk" else {}
    if way == "cold":
        options["prompt_cache_entries"] = 0
    options["prompt_cache_bytes"] = 4 * 2**30
    history: list[int] | None = None
    turns, loads, answers = [], [], []
    e: LLMEngine | None = None
    for t in range(args.turns):
        if e is None or way != "warm":
            if e is not None:
                asyncio.run(e.stop())
            e, load_s = engine(path, context, **options)
            loads.append(round(load_s, 3))
        if history is None:
            prefix, users = conversation(e.vocab_size, args.prompt_tokens, args.turns, args.turn_tokens, args.seed)
            history = list(prefix)
        history += users[t]
        no_eos = dict.fromkeys(e.eos_ids, -100.0)
        request = GenerationRequest(prompt_tokens=list(history), max_tokens=args.answer_tokens, temperature=0, logit_bias=no_eos)

        async def first_token(current: LLMEngine = e, asked: GenerationRequest = request) -> tuple[float, Any, list[int]]:
            sent = time.monotonic()
            first, tokens, last = None, [], None
            async for d in current.generate(asked):
                if first is None and d.token_ids:
                    first = time.monotonic() - sent
                tokens += d.token_ids or []
                last = d
            return first or 0.0, last, tokens

        ttft, last, tokens = asyncio.run(first_token())
        history += tokens
        answers.append(tokens)
        counters = e.counters()
        turns.append(
            {
                "turn": t + 1,
                "prompt_tokens": len(history) - len(tokens),
                "first_token_s": round(ttft, 3),
                "cached_tokens": last.usage.cached_tokens if last is not None and last.usage else 0,
                "disk_blocks_restored": counters.get("disk_blocks_restored", 0),
                "disk_blocks_written": counters.get("disk_blocks_written", 0),
            }
        )
        print(f"  {way} turn {t + 1}: {turns[-1]}", flush=True)
    if e is not None:
        asyncio.run(e.stop())
    return {"turns": turns, "load_s": loads, "answers": answers}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, default=ROOT / "models" / "llama-10m")
    ap.add_argument("--prompt-tokens", type=int, default=20000)
    ap.add_argument("--turns", type=int, default=3)
    ap.add_argument("--turn-tokens", type=int, default=200)
    ap.add_argument("--answer-tokens", type=int, default=32)
    ap.add_argument("--ways", nargs="+", default=["disk", "cold", "warm"], choices=["disk", "cold", "warm"])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default=str(ROOT / "bench" / "results" / "engine-disk-tier.json"))
    args = ap.parse_args()
    results: dict[str, Any] = {
        "model": args.model.name,
        "device": str(mx.default_device()),
        "device_name": mx.device_info().get("device_name") if mx.default_device() != mx.cpu else None,  # the card, on a GPU
        "machine": platform.machine(),
        "args": vars(args) | {"model": str(args.model)},
    }
    with tempfile.TemporaryDirectory(prefix="orchard-tier-") as tmp:
        for way in args.ways:
            print(f"{way}:", flush=True)
            results[way] = run_way(way, args.model, args, Path(tmp) / way)
    ways = [w for w in args.ways if w in results]
    same = all(results[w]["answers"] == results[ways[0]]["answers"] for w in ways)
    results["same_greedy_tokens"] = same
    print(
        f"\n{args.model.name} on {results['device_name'] or results['device']}, a {args.prompt_tokens}-token prefix, {args.turns} turns of +{args.turn_tokens} tokens, the model reloaded between turns"
    )
    print("| way | " + " | ".join(f"turn {t + 1} first token s (cached)" for t in range(args.turns)) + " |")
    print("|---|" + "---:|" * args.turns)
    for w in ways:
        cells = [f"{x['first_token_s']:.2f} ({x['cached_tokens']})" for x in results[w]["turns"]]
        print(f"| {w} | " + " | ".join(cells) + " |")
    if "disk" in results and "cold" in results:
        ratios = [round(d["first_token_s"] / c["first_token_s"], 3) for d, c in zip(results["disk"]["turns"], results["cold"]["turns"], strict=True)]
        results["disk_over_cold"] = ratios
        later = ratios[1:]
        print(
            f"\ndisk / cold, turns 2+: {', '.join(f'{r}x' for r in later)} (median {statistics.median(later) if later else '-'}); same greedy tokens: {same}"
        )
    write_json(results, args.json)
    return 0 if same else 1


if __name__ == "__main__":
    raise SystemExit(main())
