"""What a new attention shape costs: MLX's fused attention called with one shape again and again,
then with a new shape every call, as a prefill over a cached prefix sees (a group's rows, its new
tokens, its cached ones all vary from one group to the next).

    python -m bench.engine.sdpa_shapes [--rows 4] [--new 250] [--cached 3100] [--calls 12]

On MLX's CUDA backend a prefill's attention goes to cuDNN, whose graph is built for, and cached by,
the exact shapes and strides (mlx/backend/cuda/scaled_dot_product_attention.cpp); run it with
MLX_CUDA_USE_CUDNN_SDPA=0 to compare MLX's own fallback. Shapes of the 1B shape (32 query heads,
8 KV heads, head dimension 64), bfloat16, an additive mask as a batch with left padding has.
Prints a table and writes JSON."""

import argparse
import os
import time
from pathlib import Path

import mlx.core as mx

from bench.report import ms_table, write_json


def _call(rows: int, new: int, cached: int, heads: int, kv_heads: int, dim: int) -> float:
    q = mx.random.normal((rows, heads, new, dim)).astype(mx.bfloat16)
    k = mx.random.normal((rows, kv_heads, cached + new, dim)).astype(mx.bfloat16)
    v = mx.random.normal((rows, kv_heads, cached + new, dim)).astype(mx.bfloat16)
    mask = mx.zeros((rows, 1, new, cached + new), dtype=mx.bfloat16)
    mx.eval(q, k, v, mask)
    started = time.perf_counter()
    mx.eval(mx.fast.scaled_dot_product_attention(q, k, v, scale=dim**-0.5, mask=mask))
    return time.perf_counter() - started


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=4)
    ap.add_argument("--new", type=int, default=250, help="query tokens (a turn's uncached ones)")
    ap.add_argument("--cached", type=int, default=3100)
    ap.add_argument("--calls", type=int, default=12)
    ap.add_argument("--json", type=Path, default=Path("bench/results/engine-sdpa-shapes.json"))
    a = ap.parse_args(argv)
    shape = {"heads": 32, "kv_heads": 8, "dim": 64}
    _call(a.rows, a.new, a.cached, **shape)  # kernels loaded once
    same = [_call(a.rows, a.new, a.cached, **shape) for _ in range(a.calls)]
    fresh = [_call(a.rows, a.new + 1 + i, a.cached + 7 * i, **shape) for i in range(a.calls)]
    rows = {"same shape": same, "a new shape each call": fresh}
    print(ms_table(f"attention call ({os.environ.get('MLX_CUDA_USE_CUDNN_SDPA', 'default')} cuDNN setting)", rows))
    write_json(
        {
            "device": str(mx.default_device()),
            "mlx": mx.__version__,  # type: ignore[attr-defined]
            "cudnn_sdpa_env": os.environ.get("MLX_CUDA_USE_CUDNN_SDPA"),
            "rows": a.rows,
            "new": a.new,
            "cached": a.cached,
            "ms": {k: [round(1000 * t, 3) for t in v] for k, v in rows.items()},
        },
        a.json,
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
