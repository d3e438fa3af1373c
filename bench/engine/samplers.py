"""Shared samplers against one sampler per request, in-process (issue 11's row-by-row sampling):
the LLM engine with N concurrent sampled requests (temperature 1, top_p 0.95, every request to
max_tokens), alternating rounds, median tok/s per side.

    python -m bench.engine.samplers [--streams 16 64] [--tokens 64] [--rounds 3]

Prints a table and writes bench/results/samplers.json."""

import argparse
import asyncio
import json
import statistics
import time
from pathlib import Path

import deployments  # noqa: F401  (OpenBLAS before MLX)
from deployments.engines.llm import GenerationRequest, LLMEngine, _sampler

ROOT = Path(__file__).resolve().parents[2]
NEVER_END = {str(t): -100.0 for t in range(4)}  # llama-10m's special tokens: every request runs to max_tokens


async def _round(engine: LLMEngine, streams: int, tokens: int) -> float:
    requests = [
        GenerationRequest(prompt=f"Once upon a time {i}", max_tokens=tokens, temperature=1.0, top_p=0.95, logit_bias=NEVER_END)
        for i in range(streams)
    ]
    started = time.perf_counter()
    done = await asyncio.gather(*(engine.complete(r) for r in requests))
    return sum(d.usage.completion_tokens if d.usage else 0 for d in done) / (time.perf_counter() - started)


async def measure(model: Path, streams: int, tokens: int, rounds: int) -> dict:
    engine = LLMEngine(model.name, str(model), max_batch=streams)
    await engine.load()
    shared = engine._shared_sampler
    sides = {"per_request": lambda request, vocab: _sampler(request, vocab), "shared": shared}
    out: dict[str, list[float]] = {name: [] for name in sides}
    await _round(engine, streams, tokens)  # warm-up
    for _ in range(rounds):
        for name, pick in sides.items():
            engine._shared_sampler = pick  # type: ignore[method-assign]  # the A/B switch
            out[name].append(await _round(engine, streams, tokens))
    await engine.stop()
    return {name: statistics.median(v) for name, v in out.items()} | {"rounds": out}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", type=Path, default=ROOT / "models" / "llama-10m")
    ap.add_argument("--streams", type=int, nargs="+", default=[16, 64])
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    a = ap.parse_args(argv)
    rows = {str(n): asyncio.run(measure(a.model, n, a.tokens, a.rounds)) for n in a.streams}
    print(f"{'streams':>8} {'per-request tok/s':>18} {'shared tok/s':>13} {'ratio':>6}")
    for n, r in rows.items():
        print(f"{n:>8} {r['per_request']:>18.0f} {r['shared']:>13.0f} {r['shared'] / r['per_request']:>6.2f}")
    out = ROOT / "bench" / "results" / "samplers.json"
    out.write_text(json.dumps({"model": a.model.name, "tokens": a.tokens, "results": rows}, indent=2))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
