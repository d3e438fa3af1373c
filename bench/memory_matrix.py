"""What a model reserves against what it holds, on today's architectures
(deployments/model_prep/architectures.py): for each, the LLM engine loads a random-weight folder of
the family's shape, prefills `concurrency` prompts that fill the reserved context together, decodes
them to the end of it, and MLX's peak over all of that (the weights included) is compared with the
engine's reservation (measured after its load: weights, KV for the reserved context and
concurrency, one prefill step) and with the folder's estimate.

    python -m bench.memory_matrix                      # tiny shapes, this machine (seconds each)
    python -m bench.memory_matrix --scale card --context 8192 --concurrency 4 --chunk 512   # a GPU (real widths, layers cut)

Prints a table and writes bench/results/memory-matrix-<scale>.json (or --json). `reserved / peak` is the issue's
goal: at least 1 (the reservation holds) and at most 1.15 (it wastes little)."""

import argparse
import asyncio
import json
import platform
import shutil
import subprocess
import tempfile
import time
from collections.abc import Awaitable
from pathlib import Path
from typing import Any, TypeVar

import deployments  # noqa: F401  (OpenBLAS before MLX)

# isort: split
import mlx.core as mx

from deployments.engines.llm import LLMEngine
from deployments.estimate import estimate
from deployments.model_prep import architectures
from deployments.wire.generation import GenerationRequest

RESULTS = Path(__file__).parent / "results"
MIB = 2**20


T = TypeVar("T")


async def gathered_with_kv_peak(engine: LLMEngine, awaitables: list[Awaitable[T]], every_s: float) -> tuple[list[T], int]:
    """The awaitables' results, gathered, and the most KV cache the engine held while they ran
    (`MemoryReport.kv_bytes_in_use`, sampled every `every_s`)."""
    in_use = 0

    async def sample() -> None:
        nonlocal in_use
        while True:
            in_use = max(in_use, engine.memory().kv_bytes_in_use)
            await asyncio.sleep(every_s)

    sampler = asyncio.create_task(sample())
    try:
        return list(await asyncio.gather(*awaitables)), in_use
    finally:
        sampler.cancel()


async def run_one(folder: Path, context: int, concurrency: int, chunk: int = 128, kv_bits: int | None = None) -> dict[str, Any]:
    """Load `folder` in an LLM engine reserving `context` x `concurrency`, run `concurrency`
    requests whose prompts and generations fill the reserved context, and return the figures. A
    long prompt prefills alone, a chunk a step, so each generates long enough for the last to
    prefill while the first still decodes: all of them hold the whole context at once (the row's
    `kv_in_use_peak_bytes`, sampled while they run, says whether they did)."""
    engine = LLMEngine(
        folder.name,
        str(folder),
        max_batch=concurrency,
        prefill_chunk_tokens=chunk,
        max_prefill_tokens=chunk * concurrency,
        reserve_context_tokens=context,
        reserve_concurrency=concurrency,
        prompt_cache_entries=0,
        prompt_cache_bytes=0,  # no kept prefixes: the peak is the model's own
        prefix_disk_bytes=0,
        prefix_cache="lru",
        measure_idle_s=None,  # measured in the load: the reservation is compared before anything runs
        kv_bits=kv_bits,  # a quantized cache (None: the model's dtype)
    )
    mx.synchronize()
    mx.clear_cache()
    mx.reset_peak_memory()
    before = mx.get_active_memory()
    started = time.perf_counter()
    await engine.load()
    load_s = time.perf_counter() - started
    measured = engine.measured
    assert measured is not None
    mx.synchronize()
    mx.reset_peak_memory()  # the probe at load is not serving; the weights stay active, so in the peak
    generate = min(context // 2, 2 * concurrency * -(-context // chunk))
    prompt = min(context, engine.context_length) - generate  # the context less what a verify step's drafts may add (M4)
    vocab = engine.vocab_size
    requests = [
        GenerationRequest(prompt_tokens=[(7 + 13 * i + 31 * j) % (vocab - 16) + 8 for j in range(prompt)], max_tokens=generate, temperature=0.0)
        for i in range(concurrency)
    ]
    started = time.perf_counter()
    done, in_use = await gathered_with_kv_peak(engine, [engine.complete(r) for r in requests], 0.005)
    run_s = time.perf_counter() - started
    mx.synchronize()
    peak = mx.get_peak_memory() - before
    await engine.stop()
    folder_estimate = estimate(folder, "llm")
    # the folder's figures as the engine's settings make them (a quantized cache's bits and scales)
    folder_cache = measured.estimated_cache if kv_bits is not None and measured.estimated_cache is not None else folder_estimate.cache
    est_kv = concurrency * folder_cache.sequence_bytes(context, chunk)
    return {
        "model": folder.name,
        "layers": measured.cache.layers,
        "context": context,
        "concurrency": concurrency,
        "completion_tokens": [d.usage.completion_tokens if d.usage else 0 for d in done],
        "generated_per_request": generate,
        "kv_in_use_peak_bytes": in_use,
        "kv_decoding_bytes": concurrency * measured.cache.sequence_bytes(context),  # all rows at the context, windows full
        "errors": [d.error for d in done if d.error],
        "weights_file_bytes": folder_estimate.weight_bytes,
        "estimated_kv_bytes": est_kv,
        "measured_weight_bytes": measured.weight_bytes,
        "measured_kv_bytes": measured.kv_reserved_bytes,
        "measured_activation_bytes": measured.activation_bytes,
        "reserved_bytes": measured.reserved_bytes,
        "peak_bytes": peak,
        "reserved_over_peak": measured.reserved_bytes / peak if peak else None,
        "kv_bits": kv_bits,
        "estimate_matches_cache": folder_cache.model_dump(exclude={"layers"}) == measured.cache.model_dump(exclude={"layers"}),
        "load_s": load_s,
        "measure_s": measured.seconds,
        "run_s": run_s,
    }


def table(rows: list[dict[str, Any]]) -> str:
    head = f"{'architecture':18} {'layers':26} {'weights':>9} {'KV est':>9} {'KV meas':>9} {'prefill':>9} {'reserved':>9} {'peak':>9} {'res/peak':>8}"
    lines = [head, "-" * len(head)]
    for r in rows:
        layers = " ".join(f"{k}:{v}" for k, v in sorted(r["layers"].items()))
        lines.append(
            f"{r['model']:18} {layers:26} {r['measured_weight_bytes'] / MIB:9.2f} {r['estimated_kv_bytes'] / MIB:9.2f} "
            f"{r['measured_kv_bytes'] / MIB:9.2f} {r['measured_activation_bytes'] / MIB:9.2f} {r['reserved_bytes'] / MIB:9.2f} "
            f"{r['peak_bytes'] / MIB:9.2f} {r['reserved_over_peak']:8.3f}"
        )
    return "\n".join(lines) + "\n(MiB; prefill: one prefill step's activations at the reserved context, as measured at load)"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.memory_matrix", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--scale", choices=("tiny", "card", "full"), default="tiny")
    parser.add_argument("--dtype", default=None, help="float32 (tiny's default: BLAS on a CPU) or bfloat16 (full's)")
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--concurrency", type=int, default=2)
    parser.add_argument("--chunk", type=int, default=128, help="the engine's prefill_chunk_tokens")
    parser.add_argument("--only", default="", help="comma-separated families")
    parser.add_argument("--dir", type=Path, default=None, help="where the folders are built (default: a temporary folder)")
    parser.add_argument("--json", type=Path, default=None, help="where the rows go (default: bench/results/memory-matrix-<scale>.json)")
    args = parser.parse_args(argv)
    dtype = args.dtype or ("float32" if args.scale == "tiny" else "bfloat16")
    families = [f for f in architectures.FAMILIES if not args.only or f in args.only.split(",")]
    with tempfile.TemporaryDirectory() as tmp:
        root = args.dir or Path(tmp)
        rows = []
        for family in families:
            folder = root / f"{family}-{args.scale}"
            started = time.perf_counter()
            architectures.build(folder, family, args.scale, dtype)
            built = time.perf_counter() - started
            rows.append(asyncio.run(run_one(folder, args.context, args.concurrency, chunk=args.chunk)) | {"build_s": built})
            print(f"{family}: reserved / peak {rows[-1]['reserved_over_peak']:.3f} (built in {built:.0f} s)", flush=True)
            if args.dir is None:  # full-size folders one at a time: a card's disk holds one or two
                shutil.rmtree(folder)
    print(table(rows))
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    out = args.json or RESULTS / f"memory-matrix-{args.scale}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    meta = {"commit": commit, "device": str(mx.default_device()), "machine": platform.machine(), "args": {k: str(v) for k, v in vars(args).items()}}
    out.write_text(json.dumps({"meta": meta, "rows": rows}, indent=2) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
