"""What one MLX process holds on a CUDA machine through a model's life, by the device's count (the
driver's memory for this process, what a node's budget stands for there) and by the host's (resident
memory, what a Mac's unified pool would count): MLX imported; a first array on the GPU; a model of
Llama-3.2-1B's shape (random bf16 weights) evaluated; a prefill and a batch of decode steps run; the
model dropped and MLX's buffer cache cleared, as a model server's release does (rule X1).

    python3 -m bench.gpu.process_memory [--json FILE]

Prints a table and writes JSON. Needs MLX with its CUDA backend, mlx-lm and nvidia-smi."""

import argparse
import gc
import json
import os
import subprocess
import sys
import time
from pathlib import Path

MIB = 2**20


def resident_bytes() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def device_bytes() -> int | None:
    """This process's device memory as the driver counts it (nvidia-smi's compute apps), or None."""
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"], capture_output=True, text=True, timeout=20
        ).stdout
    except (OSError, subprocess.TimeoutExpired):
        return None
    for line in out.splitlines():
        pid, _, used = line.partition(",")
        if pid.strip() == str(os.getpid()):
            return int(used.strip()) * MIB
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python3 -m bench.gpu.process_memory", description=__doc__)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    rows: list[dict] = []

    def stage(name: str) -> None:
        mx = sys.modules.get("mlx.core")
        info = mx.device_info() if mx is not None and mx.cuda.is_available() else {}
        rows.append(
            {
                "stage": name,
                "resident_bytes": resident_bytes(),
                "device_bytes": device_bytes(),
                "mlx_active_bytes": mx.get_active_memory() if mx is not None else 0,
                "mlx_cache_bytes": mx.get_cache_memory() if mx is not None else 0,
                "device_free_bytes": int(info.get("free_memory", 0)),
            }
        )

    stage("python, nothing imported")
    import mlx.core as mx

    stage("mlx imported")
    mx.eval(mx.zeros((1,)))
    stage("a first array on the GPU")
    from mlx_lm.models import llama

    config = llama.ModelArgs(
        model_type="llama", hidden_size=2048, num_hidden_layers=16, intermediate_size=8192, num_attention_heads=32,
        num_key_value_heads=8, rms_norm_eps=1e-5, vocab_size=128256, head_dim=64, rope_theta=500000.0, tie_word_embeddings=True,
    )  # fmt: skip
    model = llama.Model(config)
    model.set_dtype(mx.bfloat16)
    mx.eval(model.parameters())
    stage("a 1B-shape model's weights evaluated")
    from mlx_lm.models.cache import make_prompt_cache

    cache = make_prompt_cache(model)
    mx.eval(model(mx.zeros((1, 512), dtype=mx.int32), cache=cache))
    rows_cache = make_prompt_cache(model)
    for _ in range(16):
        mx.eval(model(mx.zeros((32, 1), dtype=mx.int32), cache=rows_cache))
    stage("a 512-token prefill and 16 decode steps of 32 rows run")
    del model, cache, rows_cache
    gc.collect()
    mx.clear_cache()
    time.sleep(0.5)
    stage("the model dropped, MLX's cache cleared")
    print(f"{'stage':58} {'resident MiB':>13} {'device MiB':>11} {'MLX active':>11} {'MLX cache':>10} {'device free GiB':>16}")
    for r in rows:
        device = "-" if r["device_bytes"] is None else f"{r['device_bytes'] / MIB:.0f}"
        print(
            f"{r['stage']:58} {r['resident_bytes'] / MIB:13.0f} {device:>11} {r['mlx_active_bytes'] / MIB:11.0f}"
            f" {r['mlx_cache_bytes'] / MIB:10.0f} {r['device_free_bytes'] / 2**30:16.2f}"
        )
    if args.json is not None:
        args.json.write_text(json.dumps({"stages": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
