"""A long prompt arriving while streams decode (issue 27 item 3), on the LLM engine in process: do the
decoding streams keep their pace while it is prefilled? Each engine variant (a `prefill_chunk_tokens`
value and a `prefill_decode_steps` one) runs, in turns each round, `--streams` greedy streams; once every one of them has decoded a
few tokens, their inter-token gaps are taken for `--bare-steps` deltas with nothing else arriving
(the bare engine's ITL, same engine, same run), then one `--long-tokens` prompt arrives and their gaps
are taken from its arrival to its first token (ITL under load). Ratios: load over bare, per variant.

    python -m bench.engine.long_prefill [--model models/llama-10m] [--streams 8] [--long-tokens 3000]
        [--variants 4096:0 512:0 256:0 512:2] [--rounds 2]

Per variant: ITL p50 / p99 / max in ms, bare and during the prefill, the prefill's own time (arrival
to first token) and how many tokens each decoding stream made meanwhile. Greedy, no Ray, no HTTP.
Writes JSON (bench/results/engine-long-prefill.json)."""

import argparse
import asyncio
import os
import platform
import random
import statistics
import time
from pathlib import Path

import deployments  # noqa: F401  (OpenBLAS before MLX)

# isort: split
import mlx.core as mx

from bench.report import write_json
from deployments.engines.llm import LLMEngine
from deployments.wire.generation import GenerationRequest

ROOT = Path(__file__).resolve().parents[2]


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else 0.0


async def cell(engine: LLMEngine, streams: int, long_tokens: int, bare_steps: int, seed: int) -> dict:
    """One round on one engine: the gaps of the decoding streams with nothing arriving, then while
    a long prompt (fresh random ids, so no cache gives it back) is prefilled."""
    rng = random.Random(seed)
    vocab = engine.vocab_size
    times: list[list[float]] = [[] for _ in range(streams)]
    warm, bare_done, long_done = asyncio.Event(), asyncio.Event(), asyncio.Event()
    marks: dict[str, float] = {}

    async def decode(i: int) -> None:
        prompt = [rng.randrange(3, vocab) for _ in range(32)]
        no_eos = dict.fromkeys(engine.eos_ids, -100.0)  # keep decoding through the whole round
        request = GenerationRequest(prompt_tokens=prompt, max_tokens=engine.context_length - 64, temperature=0, logit_bias=no_eos)
        async for d in engine.generate(request):
            if d.token_ids:
                times[i].append(time.monotonic())
            if min(len(t) for t in times) >= 8:
                warm.set()
            if long_done.is_set():
                return

    async def long_prompt() -> None:
        await bare_done.wait()
        prompt = [rng.randrange(3, vocab) for _ in range(long_tokens)]
        marks["long_start"] = time.monotonic()
        async for d in engine.generate(GenerationRequest(prompt_tokens=prompt, max_tokens=1, temperature=0)):
            if d.token_ids and "long_first" not in marks:
                marks["long_first"] = time.monotonic()
        long_done.set()

    async def window() -> None:
        await warm.wait()
        marks["bare_start"] = time.monotonic()
        start = min(len(t) for t in times)
        while min(len(t) for t in times) < start + bare_steps:
            await asyncio.sleep(0.001)
        marks["bare_end"] = time.monotonic()
        bare_done.set()

    tasks = [asyncio.create_task(decode(i)) for i in range(streams)] + [asyncio.create_task(long_prompt()), asyncio.create_task(window())]
    await asyncio.gather(*tasks)

    def gaps(lo: float, hi: float) -> tuple[list[float], int]:
        out, made = [], 0
        for t in times:
            inside = [x for x in t if lo < x <= hi]
            made += len(inside)
            before = [x for x in t if x <= lo]
            seq = before[-1:] + inside  # the first gap runs from the last token before the window
            out += [b - a for a, b in zip(seq, seq[1:], strict=False)]
        return out, made

    bare, _ = gaps(marks["bare_start"], marks["bare_end"])
    load, made = gaps(marks["long_start"], marks["long_first"])
    return {"bare": bare, "load": load, "prefill_s": marks["long_first"] - marks["long_start"], "tokens_during": made / streams}


def summary(values: list[float]) -> dict:
    return {"p50_ms": 1e3 * pct(values, 0.5), "p99_ms": 1e3 * pct(values, 0.99), "max_ms": 1e3 * max(values, default=0.0), "n": len(values)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=str(ROOT / "models" / "llama-10m"))
    ap.add_argument("--streams", type=int, default=8)
    ap.add_argument("--long-tokens", type=int, default=3000)
    ap.add_argument("--bare-steps", type=int, default=40)
    ap.add_argument("--variants", nargs="+", default=["4096:0", "512:0", "256:0", "512:2"], help="prefill_chunk_tokens:prefill_decode_steps")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--json", type=Path, default=ROOT / "bench" / "results" / "engine-long-prefill.json")
    a = ap.parse_args(argv)
    if a.streams < 1 or a.long_tokens < 2 or a.bare_steps < 2 or a.rounds < 1:
        ap.error("--streams and --rounds must be at least 1, --long-tokens and --bare-steps at least 2")
    try:
        variants = [tuple(int(x) for x in v.split(":")) for v in a.variants]
    except ValueError:
        ap.error("--variants are chunk:decode_steps pairs of integers, e.g. 512:2")
    if any(len(v) != 2 or v[0] < 1 or v[1] < 0 for v in variants):
        ap.error("--variants are chunk:decode_steps pairs, chunk at least 1, decode_steps at least 0")

    async def run() -> dict[tuple[int, ...], list[dict]]:
        engines = {}
        for v in variants:  # one engine per variant, all loaded at once; admission without holding
            engines[v] = LLMEngine(
                Path(a.model).name, a.model, prefill_chunk_tokens=v[0], prefill_decode_steps=v[1], admit_hold_steps=0, reserve_context_tokens=0
            )
            await engines[v].load()
        cells: dict[tuple[int, ...], list[dict]] = {v: [] for v in variants}
        try:
            for r in range(a.rounds):
                for i, (v, engine) in enumerate(engines.items()):
                    cells[v].append(await cell(engine, a.streams, a.long_tokens, a.bare_steps, seed=1000 * r + i))
        finally:
            for engine in engines.values():
                await engine.stop()
        return cells

    cells = asyncio.run(run())
    rows = []
    print(f"{a.streams} streams decoding, one {a.long_tokens}-token prompt arrives ({Path(a.model).name}, {a.rounds} rounds)")
    print(
        f"{'chunk:dec':>9} | {'bare p50':>8} {'p99':>7} | {'load p50':>8} {'p99':>7} {'max':>7} | {'p50 x':>5} {'p99 x':>5} | {'prefill s':>9} {'tok/stream':>10}"
    )
    for (chunk, decode_steps), runs in cells.items():
        bare = summary([g for c in runs for g in c["bare"]])
        load = summary([g for c in runs for g in c["load"]])
        row = {
            "prefill_chunk_tokens": chunk,
            "prefill_decode_steps": decode_steps,
            "bare": bare,
            "load": load,
            "p50_ratio": load["p50_ms"] / bare["p50_ms"],
            "p99_ratio": load["p99_ms"] / bare["p99_ms"],
            "prefill_s": statistics.median(c["prefill_s"] for c in runs),
            "tokens_per_stream_during_prefill": statistics.median(c["tokens_during"] for c in runs),
        }
        rows.append(row)
        print(
            f"{f'{chunk}:{decode_steps}':>9} | {bare['p50_ms']:>8.2f} {bare['p99_ms']:>7.2f} | {load['p50_ms']:>8.2f} {load['p99_ms']:>7.2f} {load['max_ms']:>7.1f} | "
            f"{row['p50_ratio']:>5.2f} {row['p99_ratio']:>5.2f} | {row['prefill_s']:>9.3f} {row['tokens_per_stream_during_prefill']:>10.1f}"
        )
    result = {
        "bench": "engine-long-prefill",
        "model": Path(a.model).name,
        "streams": a.streams,
        "long_tokens": a.long_tokens,
        "rounds": a.rounds,
        "host": {"platform": platform.platform(), "cpus": os.cpu_count(), "device": str(mx.default_device())},
        "variants": rows,
    }
    write_json(result, a.json)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
