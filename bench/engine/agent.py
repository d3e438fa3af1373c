"""Agent-shaped load on the LLM engine in process (issue 27): conversations of several turns over one
long shared system prompt (instructions and a tool list), each turn resending the whole history, so
the system prompt and a conversation's earlier turns are what a prefix cache can give back. Every
prefix-cache variant of the engine runs the same conversations in the same run, in turns, and the
table gives each one's ratio to the first (the baseline, mlx-lm's LRUPromptCache as shipped before).

    python -m bench.engine.agent [--model models/llama-10m] [--concurrency 8 24] [--per-slot 2]
        [--turns 3] [--tokens 64] [--system-tokens 1100] [--variants lru blocks] [--rounds 1]
        [--set KEY=VALUE ...] [--phases]

Per cell: tok/s (completion tokens over the wall time of the cell), TTFT p50 / p90 of each turn (from
`generate()` to the first delta), the prompt tokens the cache gave back per turn (usage's
cached_tokens), the tokens mlx-lm prefilled, and the prefix cache's bytes at the end. Greedy, no Ray,
no HTTP. `--set` gives every variant an LLMEngine argument; `--phases` times the engine's phases
(bench/engine/phases.py) and counts the prefill attention shapes. Writes JSON
(bench/results/engine-agent.json)."""

import argparse
import asyncio
import itertools
import json
import os
import platform
import statistics
import time
from pathlib import Path
from typing import Any

import deployments  # noqa: F401  (OpenBLAS before MLX)

# isort: split
import mlx.core as mx

from bench.engine import phases
from deployments.engines.llm import LLMEngine
from deployments.wire.generation import GenerationRequest

ROOT = Path(__file__).resolve().parents[2]
TOOLS = [
    ("read_file", "Read a file of the repository.", {"path": "string", "start_line": "integer", "end_line": "integer"}),
    ("write_file", "Write a whole file, replacing what it held.", {"path": "string", "text": "string"}),
    ("edit_file", "Replace one exact string of a file with another.", {"path": "string", "old": "string", "new": "string"}),
    ("run", "Run a shell command in the repository root and return its output.", {"command": "string", "timeout_s": "integer"}),
    ("search", "Search the repository for a regular expression.", {"pattern": "string", "glob": "string"}),
    ("list_dir", "List a directory.", {"path": "string", "depth": "integer"}),
    ("test", "Run the test files named and report failures.", {"files": "array", "keyword": "string"}),
    ("ask", "Ask the user a question and wait for the answer.", {"question": "string"}),
]
RULES = [
    "Read the code before changing it, and change only what the task needs.",
    "Run the tests that cover what you changed before you say it is done.",
    "Never invent a file's content: read it with read_file first.",
    "Keep every answer short: say what you did, what you measured and what is left.",
    "When a command fails, read its output and fix the cause, not the symptom.",
    "Prefer small edits with edit_file over rewriting whole files.",
]
TASKS = [
    "fix the failing test",
    "add a flag for the timeout",
    "explain the retry loop",
    "rename the helper",
    "profile the slow path",
    "document the API",
]


def system_prompt(tokenize: Any, target: int) -> str:
    """Instructions and a tool list, in numbered sections, one item at a time until `target` tokens."""
    parts = ["You are a coding agent working in a repository. You act only through the tools below."]
    for section in itertools.count(1):
        items = [f"Rule {section}.{i}: {rule}" for i, rule in enumerate(RULES, 1)]
        items += [
            json.dumps({"type": "function", "function": {"name": f"{name}_{section}", "description": what, "parameters": params}})
            for name, what, params in TOOLS
        ]
        for item in items:
            if len(tokenize(" ".join(parts))) >= target:
                return " ".join(parts)
            parts.append(item)
    raise AssertionError("unreachable")


def user_turn(conversation: int, turn: int) -> str:
    task = TASKS[(conversation + turn) % len(TASKS)]
    return f"Conversation {conversation}, step {turn + 1}: please {task} in src/module_{conversation}_{turn}.py and report what changed."


async def conversation(engine: LLMEngine, system: str, c: int, turns: int, tokens: int, out: list[dict]) -> int:
    messages: list[dict] = [{"role": "system", "content": system}]
    produced = 0
    for turn in range(turns):
        messages.append({"role": "user", "content": user_turn(c, turn)})
        sent, first, text = time.perf_counter(), None, []
        usage = None
        async for d in engine.generate(GenerationRequest(messages=list(messages), max_tokens=tokens, temperature=0)):
            if first is None:
                first = time.perf_counter() - sent
            text.append(d.text)
            usage = d.usage or usage
        assert usage is not None
        produced += usage.completion_tokens
        out.append({"turn": turn, "ttft_s": first, "prompt": usage.prompt_tokens, "cached": usage.cached_tokens})
        messages.append({"role": "assistant", "content": "".join(text)})
    return produced


async def cell(engine: LLMEngine, system: str, concurrency: int, per_slot: int, turns: int, tokens: int) -> dict:
    """`concurrency` clients, each running `per_slot` conversations one after the other."""
    records: list[dict] = []
    before = engine.counters()
    started = time.perf_counter()

    async def client(k: int) -> int:
        return sum([await conversation(engine, system, k + concurrency * i, turns, tokens, records) for i in range(per_slot)])

    produced = sum(await asyncio.gather(*(client(k) for k in range(concurrency))))
    elapsed = time.perf_counter() - started
    after = engine.counters()
    by_turn = []
    for t in range(turns):
        rs = [r for r in records if r["turn"] == t]
        ttfts = sorted(r["ttft_s"] for r in rs)
        by_turn.append(
            {
                "turn": t + 1,
                "ttft_p50_ms": round(1000 * statistics.median(ttfts), 1),
                "ttft_p90_ms": round(1000 * ttfts[int(0.9 * (len(ttfts) - 1))], 1),
                "prompt_tokens": sum(r["prompt"] for r in rs),
                "cached_tokens": sum(r["cached"] for r in rs),
            }
        )
    memory = engine.memory()
    firsts = max(1, after["first_tokens"] - before["first_tokens"])
    steps = max(1, after["generation_steps"] - before["generation_steps"])
    return {
        "tok_s": round(produced / elapsed, 1),
        "seconds": round(elapsed, 2),
        "completion_tokens": produced,
        "turns": by_turn,
        "prefilled_tokens": int(after["prompt_tokens"] - before["prompt_tokens"]),
        "padded_prefill_tokens": int(after["group_padded_tokens"] - before["group_padded_tokens"]),
        "aligned_tokens": int(after["aligned_tokens"] - before["aligned_tokens"]),  # cached tokens given back to prefill unpadded
        "ragged_rows": int(after["ragged_rows"] - before["ragged_rows"]),
        "prompt_time_s": round(after["prompt_time"] - before["prompt_time"], 2),
        "decode_time_s": round(after["decode_time"] - before["decode_time"], 2),
        # where a first token waited inside the engine (means over the cell's requests), and the steps
        "admit_wait_ms": round(1000 * (after["admit_wait_s"] - before["admit_wait_s"]) / firsts, 1),
        "first_token_ms": round(1000 * (after["first_token_s"] - before["first_token_s"]) / firsts, 1),
        "join_steps": round((after["join_steps"] - before["join_steps"]) / firsts, 2),
        "groups": int(after["admitted_groups"] - before["admitted_groups"]),
        "decode_ms_per_step": round(1000 * (after["decode_time"] - before["decode_time"]) / steps, 1),
        "rows_per_step": round((after["generation_tokens"] - before["generation_tokens"]) / steps, 2),
        "prefix_cache_bytes": memory.prefix_cache_bytes,
        "peak_bytes": memory.peak_bytes,
    }


VARIANTS: dict[str, dict[str, Any]] = {
    "lru": {"prefix_cache": "lru", "prefill_pad_ratio": 0},  # mlx-lm's LRUPromptCache, 16 entries, 512 MiB: the engine before issue 27
    "blocks": {"prefix_cache": "blocks"},  # the shared block tree (deployments/engines/prefix_cache.py), as served
    "blocks-plain": {"prefix_cache": "blocks", "share_prefill": False, "prefill_pad_ratio": 0},  # ... with the old admission
    "blocks-ragged": {"prefix_cache": "blocks", "prefill_align": False},  # as served, a group's rows right-padded (mlx-lm's way)
    "none": {"prompt_cache_entries": 0},
}


def _settings(pairs: list[str]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for pair in pairs:
        key, _, raw = pair.partition("=")
        value: Any = raw
        for kind in (int, float):
            try:
                value = kind(raw)
                break
            except ValueError:
                pass
        out[key] = value
    return out


def run_variant(path: str, name: str, settings: dict, system: str, concurrency: int, a: argparse.Namespace) -> dict:
    engine = LLMEngine(
        Path(path).name, path, max_batch=max(64, concurrency), **({"reserve_context_tokens": 0} | settings | _settings(a.set))
    )  # no KV reservation held (M4 off), as BatchGenerator runs
    asyncio.run(engine.load())
    try:
        asyncio.run(engine.complete(GenerationRequest(messages=[{"role": "user", "content": "warm up"}], max_tokens=4, temperature=0)))
        mx.reset_peak_memory()
        if not a.phases:
            return asyncio.run(cell(engine, system, concurrency, a.per_slot, a.turns, a.tokens))
        with phases.timed() as seen:
            started = time.perf_counter()
            result = asyncio.run(cell(engine, system, concurrency, a.per_slot, a.turns, a.tokens))
        result["profile"] = phases.summary(seen, time.perf_counter() - started)
        for name, p in sorted(result["profile"]["phases"].items(), key=lambda kv: -kv[1]["seconds"]):
            print(f"    {name}: {p['calls']} calls, {p['seconds']:.2f} s, {p['ms_per_call']:.1f} ms each", flush=True)
        print(f"    distinct prefill attention shapes: {result['profile']['distinct_prefill_attention_shapes']}", flush=True)
        return result
    finally:
        asyncio.run(engine.stop())


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", type=Path, default=ROOT / "models" / "llama-10m")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[8, 24])
    ap.add_argument("--per-slot", type=int, default=2, help="conversations each client runs, one after the other")
    ap.add_argument("--turns", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=64, help="max_tokens of every turn")
    ap.add_argument("--system-tokens", type=int, default=1100)
    ap.add_argument("--variants", nargs="+", default=["lru", "blocks"], choices=sorted(VARIANTS), help="the first is the baseline")
    ap.add_argument("--rounds", type=int, default=1, help="every variant this many times per concurrency, in turns")
    ap.add_argument("--phases", action="store_true", help="time the engine's phases (bench.engine.phases: synchronized, so slower)")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="an LLMEngine argument for every variant (an int, float or word)")
    ap.add_argument("--json", type=Path, default=ROOT / "bench" / "results" / "engine-agent.json")
    a = ap.parse_args(argv)
    path = str(a.model)
    from mlx_lm.utils import load_tokenizer

    tokenizer = load_tokenizer(a.model)
    system = system_prompt(lambda s: tokenizer.encode(s), a.system_tokens)
    cells: list[dict] = []
    head = "| conversations at a time | variant | tok/s | TTFT p50 ms, turns | cached / prompt tokens, turns | prefilled | prefix cache MiB | tok/s ratio | TTFT p50 ratio, turns |"
    print(head + "\n|---:|---|---:|---|---|---:|---:|---:|---|", flush=True)
    for concurrency in a.concurrency:
        runs: dict[str, list[dict]] = {v: [] for v in a.variants}
        for _ in range(a.rounds):
            for v in a.variants:
                runs[v].append(run_variant(path, v, VARIANTS[v], system, concurrency, a))
        base = runs[a.variants[0]]
        for v in a.variants:
            for i, r in enumerate(runs[v]):
                b = base[i]
                r["ratio_tok_s"] = round(r["tok_s"] / b["tok_s"], 3)
                r["ratio_ttft_p50"] = [round(t["ttft_p50_ms"] / bt["ttft_p50_ms"], 3) for t, bt in zip(r["turns"], b["turns"], strict=True)]
                cells.append({"concurrency": concurrency, "variant": v, "round": i} | r)
                ttft = " / ".join(f"{t['ttft_p50_ms']:.0f}" for t in r["turns"])
                cached = " / ".join(f"{t['cached_tokens']}/{t['prompt_tokens']}" for t in r["turns"])
                ratios = " / ".join(f"{x:.2f}" for x in r["ratio_ttft_p50"])
                print(
                    f"| {concurrency} | {v} | {r['tok_s']:.0f} | {ttft} | {cached} | {r['prefilled_tokens']} | "
                    f"{r['prefix_cache_bytes'] / 2**20:.1f} | {r['ratio_tok_s']:.2f} | {ratios} |",
                    flush=True,
                )
    result = {
        "model": a.model.name,
        "system_tokens": len(tokenizer.encode(system)),
        "per_slot": a.per_slot,
        "turns": a.turns,
        "tokens": a.tokens,
        "baseline": a.variants[0],
        "cells": cells,
        "machine": {"python": platform.python_version(), "cores": os.cpu_count(), "mlx": mx.__version__, "device": str(mx.default_device())},  # type: ignore[attr-defined]
    }
    a.json.parent.mkdir(parents=True, exist_ok=True)
    a.json.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {a.json}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
