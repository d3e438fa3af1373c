"""The engine's one batched sampler against mlx-lm's samplers, in-process (issue 11's row-by-row
sampling): the LLM engine with N concurrent requests, alternating rounds, median tok/s per side (no
logit bias holds requests to max_tokens: mlx-lm runs logits processors row by row, which would hide
what sampling costs), for two mixes of sampling settings:

- uniform: every request temperature 1, top_p 0.95 (one setting: mlx-lm samples it in one call
  when the rows share a sampler, as the engine's old per-setting table arranged);
- mixed: a quarter each greedy, temperature 0.7 / top_p 0.9, temperature 1, temperature 0.8 /
  top_k 40 (mlx-lm calls each row's own sampler on a one-row slice: N calls a step).

Sides: `batched` (shipped: every row holds the engine's BatchSampler, deployments/engines/
sampling.py), `per-setting` (the engine before it: one mlx-lm sampler per distinct setting, greedy
rows on the generator's own), `per-request` (one mlx-lm sampler per request). The batched side also
runs the mixed set with a quarter of its requests seeded (`batched+seeds`: each seeded row draws its
noise from its own key).

    python -m bench.engine.samplers [--model models/llama-10m] [--streams 16 64] [--tokens 64] [--rounds 3]

Prints a table and writes JSON (bench/results/samplers.json). Runs anywhere MLX runs: on the lent
H200 it needs only mlx, mlx-lm, pydantic and llguidance (bench/gpu/run.sh)."""

import argparse
import asyncio
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
from mlx_lm.sample_utils import make_sampler

from deployments.engines.llm import LLMEngine
from deployments.engines.sampling import RowSampling
from deployments.wire.generation import GenerationRequest

ROOT = Path(__file__).resolve().parents[2]

MIXES: dict[str, list[dict[str, Any]]] = {
    "uniform": [{"temperature": 1.0, "top_p": 0.95}],
    "mixed": [{"temperature": 0.0}, {"temperature": 0.7, "top_p": 0.9}, {"temperature": 1.0}, {"temperature": 0.8, "top_k": 40}],
}


def _mlx_lm_sampler(s: RowSampling) -> Any:
    return None if s.temperature == 0 else make_sampler(temp=s.temperature, top_p=s.top_p, min_p=s.min_p, top_k=s.top_k)


def per_setting(engine: LLMEngine) -> Any:
    table: dict[RowSampling, Any] = {}
    return lambda s: table.setdefault(s, _mlx_lm_sampler(s))


SIDES = {
    "batched": lambda engine: lambda s: engine.sampling,
    "per-setting": per_setting,
    "per-request": lambda engine: _mlx_lm_sampler,
}


def _requests(mix: str, streams: int, tokens: int, seeded: bool) -> list[GenerationRequest]:
    settings = MIXES[mix]
    out = []
    for i in range(streams):
        s = dict(settings[i % len(settings)])
        if seeded and i % 4 == 1:
            s["seed"] = i
        out.append(GenerationRequest(prompt=f"Once upon a time {i}", max_tokens=tokens, **s))
    return out


async def _round(engine: LLMEngine, requests: list[GenerationRequest]) -> dict[str, float]:
    before = engine.counters()
    started = time.perf_counter()
    done = await asyncio.gather(*(engine.complete(r) for r in requests))
    elapsed = time.perf_counter() - started
    after = engine.counters()
    steps = max(1, after["generation_steps"] - before["generation_steps"])
    return {
        "tok_s": sum(d.usage.completion_tokens if d.usage else 0 for d in done) / elapsed,
        "ms_per_step": 1000 * elapsed / steps,
        "sampling_calls_per_step": (after["sampling_calls"] - before["sampling_calls"]) / steps,
    }


async def measure(model: Path, streams: int, tokens: int, rounds: int) -> dict:
    engine = LLMEngine(model.name, str(model), max_batch=streams, reserve_context_tokens=0)  # no KV reservation held (M4 off), as BatchGenerator runs
    await engine.load()
    cells = [(mix, side, False) for mix in MIXES for side in SIDES] + [("mixed", "batched", True)]
    runs: dict[str, list[dict[str, float]]] = {}
    for mix, side, seeded in cells:  # warm-up: each cell once, compiles included
        engine._sampler_of = SIDES[side](engine)  # type: ignore[method-assign]  # the A/B switch
        await _round(engine, _requests(mix, streams, tokens, seeded))
    for _ in range(rounds):
        for mix, side, seeded in cells:
            engine._sampler_of = SIDES[side](engine)  # type: ignore[method-assign]
            name = f"{mix}/{side}{'+seeds' if seeded else ''}"
            runs.setdefault(name, []).append(await _round(engine, _requests(mix, streams, tokens, seeded)))
    await engine.stop()
    return {name: {key: statistics.median(r[key] for r in rs) for key in rs[0]} | {"rounds": rs} for name, rs in runs.items()}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", type=Path, default=ROOT / "models" / "llama-10m")
    ap.add_argument("--streams", type=int, nargs="+", default=[16, 64])
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--json", type=Path, default=ROOT / "bench" / "results" / "samplers.json")
    a = ap.parse_args(argv)
    rows = {str(n): asyncio.run(measure(a.model, n, a.tokens, a.rounds)) for n in a.streams}
    print(f"{'streams':>7} {'mix':>8} {'side':>15} {'tok/s':>8} {'/ batched':>9} {'ms/step':>8} {'sampling calls/step':>20}")
    for n, cells in rows.items():
        for name, r in cells.items():
            mix, side = name.split("/")
            base = cells[f"{mix}/batched"]["tok_s"]
            calls = f"{r['sampling_calls_per_step']:.2f}" if side.startswith("batched") else "-"  # mlx-lm's own are not counted
            print(f"{n:>7} {mix:>8} {side:>15} {r['tok_s']:>8.0f} {r['tok_s'] / base:>9.2f} {r['ms_per_step']:>8.2f} {calls:>20}")
    machine = {"device": str(mx.default_device()), "processor": platform.processor() or platform.machine(), "cores": os.cpu_count()}
    a.json.write_text(json.dumps({"model": a.model.name, "tokens": a.tokens, "machine": machine, "results": rows}, indent=2))
    print(f"wrote {a.json}", flush=True)
    os._exit(0)  # MLX's CUDA backend has aborted the interpreter's exit after a run (bench.engine.share)


if __name__ == "__main__":
    raise SystemExit(main())
