"""Vision requests in one batch against one at a time (issue 28 item 6), in-process: the VLM engine
(deployments/engines/vlm.py: mlx-vlm's BatchGenerator, the vision tower per request as it joins)
serves the same set of image requests with 1, 4 and 16 in flight, and mlx-vlm's own one-request
path (`stream_generate`, what the engine ran before it batched) serves them one after another.

Each request carries `--images` pictures of its own colour and a prompt of its own; greedy, so
every side writes the same tokens (the bench checks it) and only the time differs. A side's figure
is the median over `--rounds` rounds of requests/s (and generated tokens/s), every side taking its
turn in each round; ratios are against the engine with one request in flight, measured in the same
run. `rows/step` is the engine's mean batch
(decode_rows / decode_steps of its counters).

    python -m bench.engine.vlm_batch [--model models/llava-tiny-random] [--concurrency 1 4 16]
        [--requests 32] [--tokens 32] [--images 1] [--rounds 3]

Prints a table and writes JSON (bench/results/vlm-batch.json)."""

import argparse
import asyncio
import base64
import io
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

from deployments.engines.vlm import VLMEngine

ROOT = Path(__file__).resolve().parents[2]


def _picture(i: int, k: int) -> Any:
    from PIL import Image

    return Image.new("RGB", (48 + 8 * k, 36), ((37 * i + 90 * k) % 256, (91 * i) % 256, (53 * i + 17 * k) % 256))


def _data_url(img: Any) -> str:
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def requests(n: int, images: int) -> list[tuple[list[dict], list[Any]]]:
    """n (messages, PIL images): a prompt of its own and `images` pictures of its own colours."""
    out = []
    for i in range(n):
        text = f"Request {i}: what do these {images} pictures show, and which colour comes first?"
        out.append(
            (
                [{"role": "user", "content": [{"type": "image_url"}] * images + [{"type": "text", "text": text}]}],
                [_picture(i, k) for k in range(images)],
            )
        )
    return out


async def engine_round(engine: VLMEngine, reqs: list[tuple[list[dict], list[str]]], concurrency: int, tokens: int) -> dict[str, Any]:
    gate = asyncio.Semaphore(concurrency)

    async def one(messages: list[dict], urls: list[str]) -> tuple[str, int]:
        async with gate:
            text, last = [], None
            async for delta in engine.generate(messages, images=urls, max_tokens=tokens):
                text.append(delta.text)
                last = delta
            assert last is not None and last.usage is not None
            return "".join(text), last.usage.completion_tokens

    before = engine.counters()
    started = time.perf_counter()
    done = await asyncio.gather(*(one(m, u) for m, u in reqs))
    elapsed = time.perf_counter() - started
    after = engine.counters()
    steps = max(1, after["decode_steps"] - before["decode_steps"])
    return {
        "seconds": elapsed,
        "req_s": len(reqs) / elapsed,
        "tok_s": sum(n for _, n in done) / elapsed,
        "rows_per_step": (after["decode_rows"] - before["decode_rows"]) / steps,
        "texts": [t for t, _ in done],
    }


def single_round(model: Any, processor: Any, reqs: list[tuple[list[dict], list[Any]]], tokens: int) -> dict[str, Any]:
    """mlx-vlm's one-request path, one request after another (the engine before batching)."""
    from mlx_vlm.generate import stream_generate

    texts, generated = [], 0
    started = time.perf_counter()
    for messages, pictures in reqs:
        prompt = processor.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        inputs = processor(text=[prompt], images=pictures or None)
        pieces, n = [], 0
        for r in stream_generate(
            model,
            processor,
            prompt,
            input_ids=inputs["input_ids"],
            pixel_values=inputs.get("pixel_values"),
            mask=inputs.get("attention_mask"),
            max_tokens=tokens,
            temperature=0.0,
        ):
            if r.generation_tokens <= tokens:  # it may report one past max_tokens
                pieces.append(r.text)
                n = r.generation_tokens
        texts.append("".join(pieces))
        generated += n
    elapsed = time.perf_counter() - started
    return {"seconds": elapsed, "req_s": len(reqs) / elapsed, "tok_s": generated / elapsed, "rows_per_step": 1.0, "texts": texts}


def _median(runs: list[dict[str, Any]]) -> dict[str, Any]:
    keys = ("seconds", "req_s", "tok_s", "rows_per_step")
    return {k: statistics.median(r[k] for r in runs) for k in keys} | {"rounds": [{k: r[k] for k in keys} for r in runs]}


def measure(model_dir: Path, reqs: list[tuple[list[dict], list[Any]]], concurrency: list[int], tokens: int, rounds: int) -> dict[str, Any]:
    """Every side once per round, in turn (the engine at each concurrency, then mlx-vlm's one at a
    time), so that a change in the machine's load falls on every side alike."""
    import mlx_vlm

    engine = VLMEngine(model_dir.name, str(model_dir), max_batch=max(concurrency), max_images=max(len(p) for _, p in reqs))
    asyncio.run(engine.load())
    model, processor = mlx_vlm.load(str(model_dir))  # mlx-vlm's own path, on this thread
    with_urls = [(m, [_data_url(p) for p in pictures]) for m, pictures in reqs]
    runs: dict[str, list[dict[str, Any]]] = {"single": [], **{str(c): [] for c in concurrency}}
    try:
        for c in concurrency:  # warm-up: each shape once
            asyncio.run(engine_round(engine, with_urls, c, tokens))
        single_round(model, processor, reqs[:2], tokens)
        for _ in range(rounds):
            for c in concurrency:
                runs[str(c)].append(asyncio.run(engine_round(engine, with_urls, c, tokens)))
            runs["single"].append(single_round(model, processor, reqs, tokens))
    finally:
        asyncio.run(engine.stop())
    texts = runs["single"][0]["texts"]
    same = all(r["texts"] == texts for rs in runs.values() for r in rs)
    return {"same_texts": same, **{side: _median(rs) for side, rs in runs.items()}}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", type=Path, default=ROOT / "models" / "llava-tiny-random")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16])
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--images", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--json", type=Path, default=ROOT / "bench" / "results" / "vlm-batch.json")
    a = ap.parse_args(argv)
    if 1 not in a.concurrency:
        ap.error("--concurrency must include 1: the baseline the ratios are against")
    reqs = requests(a.requests, a.images)
    concurrency = sorted(set(a.concurrency))
    measured = measure(a.model, reqs, concurrency, a.tokens, a.rounds)
    same = measured["same_texts"]
    rows = {"mlx-vlm one at a time": measured["single"]} | {f"engine, {c} in flight": measured[str(c)] for c in concurrency}
    base = measured["1"]["req_s"]
    print(f"{a.requests} requests, {a.images} image(s) each, {a.tokens} tokens max, greedy; median of {a.rounds} rounds")
    print(f"{'side':>24} {'req/s':>8} {'/ 1 in flight':>14} {'tok/s':>8} {'rows/step':>10}")
    for name, r in rows.items():
        print(f"{name:>24} {r['req_s']:>8.2f} {r['req_s'] / base:>14.2f} {r['tok_s']:>8.0f} {r['rows_per_step']:>10.2f}")
    print(f"every side wrote the same texts: {same}")
    machine = {"device": str(mx.default_device()), "processor": platform.processor() or platform.machine(), "cores": os.cpu_count()}
    result = {
        "model": a.model.name,
        "requests": a.requests,
        "images_per_request": a.images,
        "tokens": a.tokens,
        "machine": machine,
        "same_texts": same,
        "results": rows,
    }
    a.json.parent.mkdir(parents=True, exist_ok=True)
    a.json.write_text(json.dumps(result, indent=2))
    print(f"wrote {a.json}", flush=True)
    os._exit(0 if same else 1)  # MLX's CUDA backend has aborted the interpreter's exit after a run (bench.engine.share)


if __name__ == "__main__":
    raise SystemExit(main())
