"""Speculative decoding on the LLM engine in process: prompt lookup, what it gains where the answer
repeats the prompt and what it costs where it does not; a draft model (`--draft`), what it gains at
one request.

    python -m bench.engine.speculation [--model models/smollm2-135m-instruct] [--file deployments/engines/block_rows.py]
        [--rewrite-tokens 600] [--streams 16] [--stream-tokens 128] [--rounds 2] [--cells rewrite story concurrent]
        [--draft DRAFT_FOLDER ...] [--no-lookup] [--fixed-depth K]

Two cells, each run by two engines of the same model loaded side by side, one with speculation off and
one with it on (prompt lookup, the adaptive depth), taking turns in every round:
- rewrite: one conversation asks the model to rewrite a ~1k-token file it is given (greedy). Decode
  tok/s is the completion's tokens over the time from its first token to its last; the two sides'
  token ids must be identical.
- story: one conversation whose answer repeats nothing it was given (a story, `--stream-tokens`):
  what the speculation's bookkeeping costs where there is little to propose;
- concurrent: `--streams` requests of the engine benchmark's prompts at once (greedy, `--stream-tokens`
  each), all the engine's tokens over the wall time, and whether the outputs are identical.
With `--draft`, one more engine per draft folder (a smaller model of the target's tokenizer, e.g. one
`python -m deployments.model_prep.quantized_draft` made) speculates with it (`speculation: draft`)
and takes its turn beside the others (`--no-lookup`: without the prompt-lookup engine; `--cells
story`: the one request a draft is for). Medians over the rounds; each ratio is that side / off.
Also the speculation counters of each side (proposed, accepted, verify steps, the mean depth, the
steps it turned down and why, the draft's forwards and their mean time). Writes JSON
(bench/results/engine-speculation.json). Needs only MLX, mlx-lm and the repository."""

import argparse
import asyncio
import os
import platform
import statistics
import subprocess
import time
from pathlib import Path

import deployments  # noqa: F401  (OpenBLAS before MLX)

# isort: split
from bench.engine.__main__ import prompts
from bench.report import write_json
from deployments.engines.llm import LLMEngine
from deployments.wire.generation import GenerationRequest

ROOT = Path(__file__).resolve().parents[2]
CELLS = ("rewrite", "story", "concurrent")


def sides_of(a: argparse.Namespace) -> dict[str, dict]:
    """Each engine's name and its speculation settings: off first."""
    sides: dict[str, dict] = {"off": {"speculation": "off"}}
    if not a.no_lookup:
        sides["prompt_lookup"] = {"speculation": "prompt_lookup"}
    for folder in a.draft:
        sides[f"draft:{Path(folder).name}"] = {"speculation": "draft", "draft_model": folder}
    if a.fixed_depth:
        for name, settings in sides.items():
            if name != "off":
                settings["spec_fixed_depth"] = a.fixed_depth
    return sides


def rewrite_request(text: str, max_tokens: int) -> GenerationRequest:
    ask = "Rewrite this Python file with the class BlockKVCache renamed to RowKVCache. Answer with the whole file and nothing else.\n\n"
    return GenerationRequest(messages=[{"role": "user", "content": ask + "```python\n" + text + "```"}], max_tokens=max_tokens, temperature=0)


async def rewrite(engine: LLMEngine, request: GenerationRequest) -> dict:
    stamps: list[float] = []
    tokens: list[int] = []
    started = time.perf_counter()
    async for d in engine.generate(request):
        if d.token_ids:
            stamps.append(time.perf_counter())
            tokens += d.token_ids
    decode_s = stamps[-1] - stamps[0] if len(stamps) > 1 else 0.0
    return {
        "tokens": tokens,
        "completion_tokens": len(tokens),
        "first_token_s": stamps[0] - started if stamps else 0.0,
        "decode_tok_s": (len(tokens) - 1) / decode_s if decode_s else 0.0,
        "total_s": time.perf_counter() - started,
    }


async def concurrent(engine: LLMEngine, requests: list[GenerationRequest]) -> dict:
    started = time.perf_counter()
    done = await asyncio.gather(*(engine.complete(r) for r in requests))
    wall = time.perf_counter() - started
    made = sum(len(d.token_ids) for d in done)
    return {"tokens": [d.token_ids for d in done], "completion_tokens": made, "tok_s": made / wall, "wall_s": wall}


def spec_counters(before: dict, after: dict) -> dict:
    keys = [k for k in after if k.startswith("spec_")] + ["generation_steps", "generation_tokens"]
    return {k: after.get(k, 0) - before.get(k, 0) for k in keys}


async def run(a: argparse.Namespace) -> dict:
    text = (ROOT / a.file).read_text()
    sides = sides_of(a)
    engines = {side: LLMEngine(f"{Path(a.model).name}-{side}", a.model, prefix_disk_bytes=0, **settings) for side, settings in sides.items()}
    for engine in engines.values():
        await engine.load()
    try:
        ask = rewrite_request(text, a.rewrite_tokens)
        many = [GenerationRequest(messages=[{"role": "user", "content": p}], max_tokens=a.stream_tokens, temperature=0) for p in prompts(a.streams)]
        warm = GenerationRequest(messages=[{"role": "user", "content": "Say hello."}], max_tokens=8, temperature=0)
        for engine in engines.values():
            await engine.complete(warm)
        story = many[0]
        jobs = {"rewrite": lambda e: rewrite(e, ask), "story": lambda e: rewrite(e, story), "concurrent": lambda e: concurrent(e, many)}
        cells: dict[str, dict[str, list[dict]]] = {c: {s: [] for s in sides} for c in a.cells}
        counted: dict[str, dict[str, dict[str, float]]] = {c: {s: {} for s in sides if s != "off"} for c in a.cells}
        for r in range(a.rounds):
            order = list(sides) if r % 2 == 0 else list(sides)[::-1]
            for cell in a.cells:
                for side in order:
                    engine = engines[side]
                    before = engine.counters()
                    cells[cell][side].append(await jobs[cell](engine))
                    if side != "off":
                        got = spec_counters(before, engine.counters())
                        counted[cell][side] = {k: counted[cell][side].get(k, 0) + v for k, v in got.items()}
        prompt_tokens = len(engines["off"].tokenize(ask))
    finally:
        for engine in engines.values():
            await engine.stop()
    return summarise(a, cells, counted, prompt_tokens)


def summarise(a: argparse.Namespace, cells: dict, counted: dict, prompt_tokens: int) -> dict:
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        commit = ""
    result: dict = {
        "command": "python -m bench.engine.speculation " + " ".join(a.argv),
        "commit": commit,
        "machine": f"{platform.system()} {platform.machine()}, {os.cpu_count()} cores",
        "date": time.strftime("%Y-%m-%d"),
        "model": a.model,
        "rounds": a.rounds,
        "drafts": list(a.draft),
        "fixed_depth": a.fixed_depth,
    }
    for cell, sides in cells.items():
        key = "tok_s" if cell == "concurrent" else "decode_tok_s"  # all tokens over the wall time; one stream's decode
        rates = {s: statistics.median(x[key] for x in runs) for s, runs in sides.items()}
        off = rates["off"]
        each = {
            s: {
                "ratio": rates[s] / off if off else 0.0,
                "identical": all(x["tokens"] == y["tokens"] for x, y in zip(sides["off"], runs, strict=True)),
                "counters": counted[cell][s],
            }
            for s, runs in sides.items()
            if s != "off"
        }
        first = next(iter(each.values()), {"ratio": 0.0, "identical": True, "counters": {}})
        result[cell] = {
            "completion_tokens": sides["off"][0]["completion_tokens"],
            key: {"off": off, "on": next((rates[s] for s in each), 0.0)} | rates,
            "ratio": first["ratio"],  # the first speculating side's (prompt lookup's unless --no-lookup)
            "identical": first["identical"],
            "counters": first["counters"],
            "sides": each,
        }
    if "rewrite" in result:
        result["rewrite"] |= {"file": a.file, "prompt_tokens": prompt_tokens}
    if "concurrent" in result:
        result["concurrent"] |= {"streams": a.streams, "stream_tokens": a.stream_tokens}
    return result


def table(result: dict) -> str:
    lines = [
        f"{result['model']}, {result['machine']}, {result['rounds']} rounds (medians), commit {result['commit']}"
        + (f", depth fixed at {result['fixed_depth']}" if result.get("fixed_depth") else ""),
        "| cell | side | off tok/s | side tok/s | ratio | identical | proposed | accepted | verify steps | mean depth "
        "| plain: no drafts / cost / prefill / rows | draft forwards (ms each) |",
        "|---|---|---:|---:|---:|---|---:|---:|---:|---:|---|---:|",
    ]
    names = {
        "rewrite": lambda c: f"rewrite ({c['prompt_tokens']}-token prompt, {c['completion_tokens']} tokens, decode)",
        "story": lambda c: f"story, one stream ({c['completion_tokens']} tokens, decode)",
        "concurrent": lambda c: f"{c['streams']} concurrent x {c['stream_tokens']} tokens",
    }
    for cell in CELLS:
        if cell not in result:
            continue
        got = result[cell]
        rate = got["tok_s" if cell == "concurrent" else "decode_tok_s"]
        for side, each in got["sides"].items():
            c = each["counters"]
            depth = c.get("spec_depth_sum", 0) / c["spec_steps"] if c.get("spec_steps") else 0.0
            plain = f"{c.get('spec_off_no_drafts', 0):.0f} / {c.get('spec_off_cost', 0):.0f} / {c.get('spec_off_prefill', 0):.0f} / {c.get('spec_off_rows', 0):.0f}"
            forwards = c.get("spec_draft_forwards", 0)
            drafted = f"{forwards:.0f} ({1000 * c.get('spec_draft_s', 0) / forwards:.2f})" if forwards else "-"
            lines.append(
                f"| {names[cell](got)} | {side} | {rate['off']:.1f} | {rate[side]:.1f} | {each['ratio']:.2f} | {each['identical']} | "
                f"{c.get('spec_proposed', 0):.0f} | {c.get('spec_accepted', 0):.0f} | {c.get('spec_steps', 0):.0f} | {depth:.1f} | {plain} | {drafted} |"
            )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=str(ROOT / "models" / "smollm2-135m-instruct"))
    ap.add_argument("--file", default="deployments/engines/block_rows.py", help="the file the conversation rewrites (from the repository's root)")
    ap.add_argument("--rewrite-tokens", type=int, default=600)
    ap.add_argument("--streams", type=int, default=16)
    ap.add_argument("--stream-tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--cells", nargs="+", choices=CELLS, default=list(CELLS))
    ap.add_argument("--draft", nargs="*", default=[], help="draft model folders: one more engine speculates with each")
    ap.add_argument("--no-lookup", action="store_true", help="no prompt-lookup engine (off and the drafts only)")
    ap.add_argument("--fixed-depth", type=int, default=None, help="verify this many drafts every step (the depth controller off)")
    ap.add_argument("--json", default=str(ROOT / "bench" / "results" / "engine-speculation.json"))
    a = ap.parse_args(argv)
    a.argv = argv if argv is not None else __import__("sys").argv[1:]
    result = asyncio.run(run(a))
    print(table(result))
    write_json(result, a.json)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
