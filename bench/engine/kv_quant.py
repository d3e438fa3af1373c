"""A quantized KV cache (issue 27 item 4, `kv_bits`) against the unquantized one on a real model,
SmolLM2-135M-Instruct, in one run: what it holds, what it changes in the output, what it costs.

    python -m bench.engine.kv_quant [--models-dir models] [--prompts 16] [--max-tokens 64]
        [--bits 8 4] [--group-size 64] [--rounds 2]

- Tokens per byte: the model's own layers prefill the same 512 tokens into mlx-lm's BatchKVCache and
  into Orchard's BatchQuantizedKVCache (deployments/engines/quantized_cache.py); bytes per token of
  each, as the model ships (float32 here) and cast to float16 (an MLX model's usual dtype on a Mac),
  beside deployments/estimate.py's figure, which the residency policy reserves.
- Greedy agreement: bench.engine's prompts (chat-templated), all at once through the LLM engine (its
  batch, the real path), `--max-tokens` each, temperature 0, with each cache: the share of the
  unquantized continuations' tokens the quantized run reproduces at the same position, and how far
  each continuation runs before its first different token.
- Logit difference: each prompt and its unquantized continuation fed through the model (teacher
  forcing, one left-padded batch) with each cache: max and mean |logit difference| over the vocabulary
  at every continuation position, and how often the top token is the same.
- The noise floor: the same greedy continuations and logits, by a plain batched greedy loop, with
  the unquantized cache's keys and values only rounded to bfloat16 or float16 (what the same model
  holds when it runs in that dtype, as MLX models do on a Mac), against the same loop unrounded.
- Decode tok/s: mlx-lm's own decode counters of each engine over the same greedy batch, `--rounds`
  rounds with the variants in turns; ratio against the unquantized engine of the same run.

Prints a table, writes JSON (bench/results/engine-kv-quant.json). No Ray, no HTTP."""

import argparse
import asyncio
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any, cast

import deployments  # noqa: F401  (OpenBLAS before MLX)

# isort: split
import mlx.core as mx
import mlx_lm
from mlx_lm.models.cache import BatchKVCache

from bench.engine.__main__ import prompts
from bench.report import write_json
from deployments.engines.llm import LLMEngine
from deployments.engines.quantized_cache import BatchQuantizedKVCache
from deployments.estimate import kv_bytes_per_token
from deployments.models import prepare
from deployments.wire.generation import GenerationRequest

ROOT = Path(__file__).resolve().parents[2]
MODEL = "smollm2-135m-instruct"
MLX_VERSION: str = mx.__version__  # type: ignore[attr-defined]  # not in mlx's stubs


ROUNDED = ("bfloat16", "float16")  # the noise floor's variants


class _Rounded(BatchKVCache):
    """The unquantized batch cache holding its keys and values rounded to a 16-bit dtype."""

    def __init__(self, padding: list[int], dtype: str):
        super().__init__(padding)
        self.dtype = getattr(mx, dtype)

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> Any:
        return super().update_and_fetch(keys.astype(self.dtype).astype(keys.dtype), values.astype(self.dtype).astype(values.dtype))


def batch_cache(layers: int, padding: list[int], variant: int | str | None, group: int) -> list[Any]:
    if variant is None:
        return [BatchKVCache(padding) for _ in range(layers)]
    if isinstance(variant, str):
        return [_Rounded(padding, variant) for _ in range(layers)]
    return [BatchQuantizedKVCache(padding, group_size=group, bits=variant) for _ in range(layers)]


def free_greedy(model: Any, prompts_: list[list[int]], steps: int, variant: str | None, eos: set[int]) -> list[list[int]]:
    """Greedy continuations by a plain batched loop (left-padded, as the engine's batch), each cut
    before its first end-of-sequence token, as the engine's are."""
    longest = max(len(p) for p in prompts_)
    padding = [longest - len(p) for p in prompts_]
    cache = batch_cache(len(model.layers), padding, variant, 64)
    logits = model(mx.array([[0] * pad + p for pad, p in zip(padding, prompts_, strict=True)]), cache=cache)[:, -1, :]
    out: list[list[int]] = [[] for _ in prompts_]
    for _ in range(steps):
        column = logits.argmax(axis=-1)
        for row, t in zip(out, cast(list[int], column.tolist()), strict=True):
            row.append(t)
        logits = model(column[:, None], cache=cache)[:, -1, :]
        mx.eval(logits)
    return [row[: next((i for i, t in enumerate(row) if t in eos), len(row))] for row in out]


def bytes_per_token(config: dict, bits: int | None, group: int, dtype: str) -> dict:
    """The caches' bytes once every layer holds 512 tokens of keys and values shaped as the model's
    (a multiple of both caches' 256-token allocation step), per token, beside the estimate's figure.
    (The values are random: a cache's size depends on its shapes and dtype, not on what it holds.)"""
    n, layers = 512, config["num_hidden_layers"]
    heads, dim = config["num_key_value_heads"], config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    cache = batch_cache(layers, [0], bits, group)
    for c in cache:
        kv = mx.random.normal((1, heads, n, dim)).astype(getattr(mx, dtype))
        c.update_and_fetch(kv, kv)
    mx.eval([c.state for c in cache])
    measured = sum(c.nbytes for c in cache) / n
    estimated = kv_bytes_per_token(config | {"torch_dtype": dtype}, kv_bits=bits, kv_group_size=group)
    return {"bytes_per_token": measured, "estimate": estimated}


def templated(tokenizer: Any, texts: list[str]) -> list[list[int]]:
    return [list(tokenizer.apply_chat_template([{"role": "user", "content": t}], add_generation_prompt=True)) for t in texts]


async def greedy_batch(engine: LLMEngine, tokens: list[list[int]], max_tokens: int) -> tuple[list[list[int]], float, float]:
    """Every prompt at once; (continuations, decode tokens, decode seconds by mlx-lm's counters)."""
    before = engine.counters()
    done = await asyncio.gather(*(engine.complete(GenerationRequest(prompt_tokens=t, max_tokens=max_tokens, temperature=0)) for t in tokens))
    after = engine.counters()
    return [d.token_ids for d in done], after["generation_tokens"] - before["generation_tokens"], after["decode_time"] - before["decode_time"]


def agreement(base: list[list[int]], other: list[list[int]]) -> dict:
    same = sum(a == b for x, y in zip(base, other, strict=True) for a, b in zip(x, y, strict=False))
    total = sum(max(len(x), len(y)) for x, y in zip(base, other, strict=True))
    prefix = [next((i for i, (a, b) in enumerate(zip(x, y, strict=False)) if a != b), min(len(x), len(y))) for x, y in zip(base, other, strict=True)]
    return {
        "token_agreement": same / total,
        "identical_continuations": sum(x == y for x, y in zip(base, other, strict=True)),
        "first_difference_mean": statistics.mean(prefix),
    }


def forced_logits(
    model: Any, prompts_: list[list[int]], continuations: list[list[int]], bits: int | str | None, group: int
) -> tuple[mx.array, mx.array]:
    """Log-probabilities at every continuation position, (rows, steps, vocab), and which positions
    are real (a continuation that ended early leaves the rest of its row unused)."""
    steps = max(len(c) for c in continuations)
    longest = max(len(p) for p in prompts_)
    padding = [longest - len(p) for p in prompts_]
    cache = batch_cache(len(model.layers), padding, bits, group)
    x = mx.array([[0] * pad + p for pad, p in zip(padding, prompts_, strict=True)])
    out = [model(x, cache=cache)[:, -1:, :]]
    for i in range(steps - 1):
        column = mx.array([[c[i] if i < len(c) else 0] for c in continuations])
        out.append(model(column, cache=cache))
        mx.eval(out[-1])
    logits = mx.concatenate(out, axis=1).astype(mx.float32)
    real = mx.array([[i < len(c) for i in range(steps)] for c in continuations])
    return logits - mx.logsumexp(logits, axis=-1, keepdims=True), real


def logit_difference(base: tuple[mx.array, mx.array], other: tuple[mx.array, mx.array]) -> dict:
    (a, real), (b, _) = base, other
    diff = mx.abs(a - b)
    per_position_max = diff.max(axis=-1)
    per_position_mean = diff.mean(axis=-1)
    count = cast(int, real.sum().item())
    top_same = (a.argmax(axis=-1) == b.argmax(axis=-1)) & real
    return {
        "max_abs_logprob_diff": cast(float, mx.where(real, per_position_max, 0).max().item()),
        "mean_abs_logprob_diff": cast(float, (mx.where(real, per_position_mean, 0).sum() / count).item()),
        "mean_of_position_max": cast(float, (mx.where(real, per_position_max, 0).sum() / count).item()),
        "top1_same": cast(int, top_same.sum().item()) / count,
        "positions": count,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models-dir", type=Path, default=ROOT / "models")
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--bits", type=int, nargs="+", default=[8, 4])
    ap.add_argument("--group-size", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--json", type=Path, default=ROOT / "bench" / "results" / "engine-kv-quant.json")
    a = ap.parse_args(argv)
    prepare(a.models_dir, {MODEL}, log=lambda *_: None)
    path = str(a.models_dir / MODEL)
    variants: list[int | None] = [None, *a.bits]
    group = a.group_size

    # tokens per byte: the model's cache shapes, as it ships (float32) and in float16 (an MLX model's
    # usual dtype on a Mac; float16 matmuls are too slow on this CPU to run the model itself in it)
    model, tokenizer, config = mlx_lm.load(path, return_config=True)  # type: ignore[misc]  # a 3-tuple with return_config
    shipped = str(config.get("torch_dtype", "float32"))
    memory: dict[str, dict[str, dict]] = {
        dtype: {str(b): bytes_per_token(config, b, group, dtype) for b in variants} for dtype in (shipped, "float16")
    }
    for per in memory.values():
        for b in variants:
            per[str(b)]["tokens_per_byte_ratio"] = per["None"]["bytes_per_token"] / per[str(b)]["bytes_per_token"]

    # greedy through the engine, each cache, rounds in turns (decode tok/s in the same run)
    tokens = templated(tokenizer, prompts(a.prompts))
    engines = {
        b: LLMEngine(MODEL, path, max_batch=64, prompt_cache_entries=0, kv_bits=b, kv_group_size=group, reserve_context_tokens=0) for b in variants
    }
    for e in engines.values():
        asyncio.run(e.load())
        asyncio.run(greedy_batch(e, tokens[:2], 4))  # warm-up
    outputs: dict[int | None, list[list[int]]] = {}
    decode: dict[int | None, list[float]] = {b: [] for b in variants}
    for _ in range(a.rounds):
        for b, e in engines.items():
            started = time.perf_counter()
            out, produced, seconds = asyncio.run(greedy_batch(e, tokens, a.max_tokens))
            decode[b].append(produced / seconds)
            print(f"  kv_bits {b}: {produced:.0f} tokens, decode {produced / seconds:.1f} tok/s, {time.perf_counter() - started:.1f} s", flush=True)
            if b in outputs and outputs[b] != out:
                print(f"  kv_bits {b}: a later round's greedy tokens differ from the first's", flush=True)
            outputs.setdefault(b, out)
    for e in engines.values():
        asyncio.run(e.stop())

    # logit difference, teacher-forced on the unquantized continuations
    forced: dict[int | str | None, tuple[mx.array, mx.array]] = {b: forced_logits(model, tokens, outputs[None], b, group) for b in variants}
    # the noise floor: 16-bit rounding of the unquantized cache, by the plain loop
    eos = set(tokenizer.eos_token_ids)
    plain = free_greedy(model, tokens, a.max_tokens, None, eos)
    floor: list[dict[str, Any]] = []
    for dtype in ROUNDED:
        rounded = free_greedy(model, tokens, a.max_tokens, dtype, eos)
        floor.append(
            {
                "kv": f"{dtype} rounding",
                "greedy": agreement(plain, rounded),
                "logits": logit_difference(forced[None], forced_logits(model, tokens, outputs[None], dtype, group)),
            }
        )
    loop_same_as_engine = sum(x == y for x, y in zip(plain, outputs[None], strict=True))

    rows: list[dict[str, Any]] = []
    for b in variants:
        tok_s = statistics.median(decode[b])
        row: dict[str, Any] = {
            "kv_bits": b,
            "kv_group_size": group if b is not None else None,
            "memory": {dtype: per[str(b)] for dtype, per in memory.items()},
            "decode_tok_s": round(tok_s, 1),
            "decode_ratio": round(tok_s / statistics.median(decode[None]), 3),
        }
        if b is not None:
            row["greedy"] = agreement(outputs[None], outputs[b])
            row["logits"] = logit_difference(forced[None], forced[b])
        rows.append(row)

    print(
        f"\nSmolLM2-135M-Instruct, {a.prompts} prompts x {a.max_tokens} greedy tokens, group size {group}, MLX {MLX_VERSION} on {mx.default_device()}"
    )
    print(
        f"| kv_bits | bytes/token {shipped} | x tokens | bytes/token float16 | x tokens | greedy agreement | identical | max / mean abs logprob diff | top-1 same | decode tok/s | ratio |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---|---:|---:|---:|")
    for r in rows:
        m32, m16 = r["memory"][shipped], r["memory"]["float16"]
        g: dict | None = r.get("greedy")
        lg: dict | None = r.get("logits")
        agree = f"{g['token_agreement']:.1%}" if g else "-"
        same = f"{g['identical_continuations']}/{a.prompts}" if g else "-"
        diff = f"{lg['max_abs_logprob_diff']:.3f} / {lg['mean_abs_logprob_diff']:.4f}" if lg else "-"
        top = f"{lg['top1_same']:.1%}" if lg else "-"
        print(
            f"| {r['kv_bits'] or 'none'} | {m32['bytes_per_token']:,.0f} | {m32['tokens_per_byte_ratio']:.2f} | {m16['bytes_per_token']:,.0f} "
            f"| {m16['tokens_per_byte_ratio']:.2f} | {agree} | {same} | {diff} | {top} | {r['decode_tok_s']} | {r['decode_ratio']:.2f} |"
        )
    for f in floor:
        fg, flg = f["greedy"], f["logits"]
        print(
            f"| {f['kv']} (floor) | - | - | - | - | {fg['token_agreement']:.1%} | {fg['identical_continuations']}/{a.prompts} "
            f"| {flg['max_abs_logprob_diff']:.3f} / {flg['mean_abs_logprob_diff']:.4f} | {flg['top1_same']:.1%} | - | - |"
        )
    print(f"(the plain loop's unquantized continuations: {loop_same_as_engine}/{a.prompts} the engine's)")
    result = {
        "bench": "engine-kv-quant",
        "model": MODEL,
        "prompts": a.prompts,
        "max_tokens": a.max_tokens,
        "rounds": a.rounds,
        "rows": rows,
        "noise_floor": floor,
        "plain_loop_same_as_engine": loop_same_as_engine,
        "command": "python -m bench.engine.kv_quant " + " ".join(argv if argv is not None else sys.argv[1:]),
        "host": {"platform": platform.platform(), "cpus": os.cpu_count(), "device": str(mx.default_device()), "mlx": MLX_VERSION},
    }
    write_json(result, a.json)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
