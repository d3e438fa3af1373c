"""What one forward of a model costs by itself, the way mlx-lm's BatchGenerator runs it: a decode
step at several batch sizes over a long cached context, and a group's prefill over cached prefixes
with the same shape every call against a new shape every call (an agent's groups rarely repeat one),
and what a group's caches cost to build from the prefix cache on a hit (fetch and merge).

    python -m bench.engine.forward_shapes --model DIR [--cached 3100] [--new 150] [--rows 3] [--calls 10]
    python -m bench.engine.forward_shapes --model DIR --replay AGENT_PHASES_JSON

A decode step that costs about the same at 1 row as at 16 is bound by the host (launching kernels),
not by the device; a prefill whose new shapes cost far more than a repeated one pays for something
built per shape (kernels compiled, plans chosen). Every call ends in mx.eval, so the numbers are
each forward's own. Prints a table and writes JSON."""

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

import deployments  # noqa: F401  (OpenBLAS here, MLX's own attention on CUDA: as the engine runs)

# isort: split
import mlx.core as mx
import mlx_lm
from mlx_lm.generate import PromptProcessingBatch
from mlx_lm.models.cache import BatchKVCache, KVCache, make_prompt_cache

from bench.engine.hit_ops import hit_caches
from bench.report import ms_table, write_json
from deployments.engines.prefix_cache import PrefixCache


def _filled(model, rows: int, cached: int, vocab: int) -> list[BatchKVCache]:
    """A batch cache holding `cached` tokens of every row (random tokens, prefilled once, untimed)."""
    caches = [BatchKVCache([0] * rows) for _ in model.layers]
    step = 1024
    tokens = mx.random.randint(0, vocab, (rows, cached))
    for at in range(0, cached, step):
        model(tokens[:, at : at + step], cache=caches)
        mx.eval([c.keys for c in caches])
    return caches


def _forward(model, caches: list[BatchKVCache], rows: int, new: int, vocab: int) -> float:
    """One forward of `new` tokens a row, timed to its result, then trimmed off again."""
    tokens = mx.random.randint(0, vocab, (rows, new))
    mx.eval(tokens)
    started = time.perf_counter()
    logits = model(tokens, cache=caches)
    mx.eval(logits[:, -1, :])
    took = time.perf_counter() - started
    for c in caches:
        c.trim(new)
    return took


def _prefix_hits(model, rows: int, cached: int, vocab: int, block_tokens: int, calls: int) -> list[float]:
    """A group's caches as the engine builds them on a prefix hit: every row's cached prefix fetched
    from the block cache (its blocks joined) and the rows merged into one batch cache, timed to
    their arrays."""
    tokens: list[int] = mx.random.randint(0, vocab, (cached,)).tolist()  # type: ignore[assignment]
    kept = make_prompt_cache(model)
    model(mx.array([tokens]), cache=kept)
    mx.eval([c.keys for c in kept])
    blocks = PrefixCache(block_tokens=block_tokens, max_bytes=64 * 2**30)
    blocks.insert(tokens, kept)
    times = []
    for _ in range(calls + 1):
        started = time.perf_counter()
        merged = hit_caches(blocks, tokens, rows, len(kept))
        mx.eval([c.keys for c in merged] + [c.values for c in merged])
        times.append(time.perf_counter() - started)
    return times[1:]


def _as_engine(model, template: list[Any], row_cached: list[int], row_new: list[int], vocab: int) -> float:
    """One prefill chunk the way the engine runs it: every row's cached prefix a view of a kept
    cache (as a prefix hit's is), the rows merged into one batch cache by mlx-lm's
    PromptProcessingBatch, and its prompts prefilled by prompt() (right-padded and rolled into place
    when their lengths differ), timed from its caches' arrays to the finished cache."""
    rows = []
    for cached in row_cached:
        layers = []
        for kept in template:
            c = KVCache()
            if cached > 0:
                c.keys, c.values, c.offset = kept.keys[..., :cached, :], kept.values[..., :cached, :], cached
            layers.append(c)
        rows.append(layers)
    batch = PromptProcessingBatch(model, list(range(len(rows))), rows, prefill_step_size=max(row_new))
    tokens = [mx.random.randint(0, vocab, (n,)).tolist() for n in row_new]
    mx.eval([c.state for c in batch.prompt_cache])
    mx.synchronize()
    started = time.perf_counter()
    batch.prompt(tokens)  # type: ignore[arg-type]
    mx.synchronize()
    return time.perf_counter() - started


def _replay(model, profile: Path, vocab: int, calls: int) -> list[dict]:
    """Every prefill chunk an engine ran (bench.engine.agent --phases: its rows, each row's cached
    and new tokens), timed three ways beside what it took in the engine: as one forward of its
    padded shape alone (the same shape repeated), and as the engine runs it (ragged rows merged,
    right-padded, rolled) the first time its shape is seen and again. Where the engine's time
    matches the first and not the second, the engine pays for new shapes (CUDA graphs built,
    kernels chosen); where it matches neither, for something outside the prefill."""
    out = []
    chunks = [c for cell in json.loads(profile.read_text())["cells"] for c in cell.get("profile", {}).get("prefill_calls", [])]
    longest = max((max(c.get("row_cached") or [0]) for c in chunks), default=0)
    template = make_prompt_cache(model)
    if longest:
        model(mx.random.randint(0, vocab, (1, longest)), cache=template)
        mx.eval([c.keys for c in template])
    for chunk in chunks:
        rows, new = chunk["rows"], chunk["longest"]
        caches = _filled(model, rows, max(1, chunk["cached"]), vocab)
        _forward(model, caches, rows, new, vocab)
        alone = statistics.median(_forward(model, caches, rows, new, vocab) for _ in range(calls))
        del caches
        result = chunk | {"alone_ms": round(1000 * alone, 2)}
        if "row_cached" in chunk:
            result["engine_path_first_ms"] = round(1000 * _as_engine(model, template, chunk["row_cached"], chunk["row_new"], vocab), 2)
            result["engine_path_again_ms"] = round(1000 * _as_engine(model, template, chunk["row_cached"], chunk["row_new"], vocab), 2)
            # the same rows aligned (LLMEngine's prefill_align): each gives back cached tokens to prefill the longest's count
            aligned = [c + n - new for c, n in zip(chunk["row_cached"], chunk["row_new"], strict=True)]
            if min(aligned) >= 0 and len(set(chunk["row_new"])) > 1:
                result["aligned_first_ms"] = round(1000 * _as_engine(model, template, aligned, [new] * rows, vocab), 2)
                result["aligned_again_ms"] = round(1000 * _as_engine(model, template, aligned, [new] * rows, vocab), 2)
        out.append(result)
    return out


def _ms(times: list[float]) -> dict[str, float]:
    return {"p50": round(1000 * statistics.median(times), 2), "max": round(1000 * max(times), 2)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--cached", type=int, default=3100, help="tokens every row holds already")
    ap.add_argument("--new", type=int, default=150, help="a prefill's new tokens a row")
    ap.add_argument("--rows", type=int, default=3, help="a prefill group's rows")
    ap.add_argument("--decode-rows", default="1,4,8,16")
    ap.add_argument("--calls", type=int, default=10)
    ap.add_argument("--hit-rows", type=int, default=6, help="a prefix-hit group's rows")
    ap.add_argument("--block-tokens", default="128,512")
    ap.add_argument(
        "--replay",
        type=Path,
        help="an agent --phases JSON: time each of its prefill chunks again (alone, along the engine's path, aligned), and nothing else",
    )
    ap.add_argument("--json", type=Path, default=Path("bench/results/engine-forward-shapes.json"))
    a = ap.parse_args(argv)
    model, tokenizer = mlx_lm.load(a.model)[:2]
    vocab = len(tokenizer.vocab) if hasattr(tokenizer, "vocab") else 2048
    if a.replay:
        chunks = _replay(model, a.replay, vocab, min(a.calls, 3))
        print(
            "| rows | longest new | cached | caches ms | prefill ms, in the engine | alone | engine's path, first | again | aligned, first | again |"
        )
        print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
        paths = ("engine_path_first_ms", "engine_path_again_ms", "aligned_first_ms", "aligned_again_ms")
        for c in chunks:
            path = " | ".join(str(c.get(k, "-")) for k in paths)
            print(f"| {c['rows']} | {c['longest']} | {c['cached']} | {c['caches_ms']} | {c['forward_ms']} | {c['alone_ms']} | {path} |")
        totals = {k: sum(c.get(k, 0) for c in chunks) for k in ("forward_ms", "alone_ms", *paths)}
        print("total ms: " + ", ".join(f"{k} {v:.0f}" for k, v in totals.items()))
        write_json({"device": str(mx.default_device()), "model": Path(a.model).name, "replayed": str(a.replay), "chunks": chunks}, a.json)
        return 0
    cells: dict[str, list[float]] = {}  # seconds a call
    for rows in [int(r) for r in a.decode_rows.split(",")]:
        caches = _filled(model, rows, a.cached, vocab)
        _forward(model, caches, rows, 1, vocab)
        cells[f"decode step, {rows} rows"] = [_forward(model, caches, rows, 1, vocab) for _ in range(a.calls)]
        del caches
    caches = _filled(model, a.rows, a.cached, vocab)
    _forward(model, caches, a.rows, a.new, vocab)
    cells[f"prefill {a.rows} x {a.new}, same shape"] = [_forward(model, caches, a.rows, a.new, vocab) for _ in range(a.calls)]
    cells[f"prefill {a.rows} x ~{a.new}, a new length each call"] = [_forward(model, caches, a.rows, a.new + 1 + i, vocab) for i in range(a.calls)]
    del caches
    fresh = []
    for i in range(a.calls):  # a new cached length too: a new key length for the attention
        caches = _filled(model, a.rows, a.cached + 7 * (i + 1), vocab)
        fresh.append(_forward(model, caches, a.rows, a.new + 1 + i, vocab))
        del caches
    cells[f"prefill {a.rows} x ~{a.new}, new lengths and cached lengths"] = fresh
    for block_tokens in [int(b) for b in a.block_tokens.split(",")]:
        times = _prefix_hits(model, a.hit_rows, a.cached, vocab, block_tokens, a.calls)
        cells[f"a group's caches from the prefix cache, {a.hit_rows} rows, {block_tokens}-token blocks"] = times
    print(ms_table(f"forward ({mx.default_device()}, {a.cached} cached tokens a row)", cells))
    write_json(
        {
            "device": str(mx.default_device()),
            "mlx": mx.__version__,  # type: ignore[attr-defined]
            "model": Path(a.model).name,
            "cached": a.cached,
            "new": a.new,
            "rows": a.rows,
            "ms": {name: _ms(times) for name, times in cells.items()},
        },
        a.json,
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
