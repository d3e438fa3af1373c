"""A ~10M-parameter llama with random weights: the fast model for engine and cluster tests.

Real architecture (mlx-lm's llama), real config, safetensors and an offline-trained BPE tokenizer
with a ChatML template, so `mlx_lm.load(path)` treats it exactly like a hub folder. Float32: on the
Linux CPU build only float32 matmuls go through BLAS. KV per token = 2 x 8 layers x 4 heads x 64 x
4 bytes = 16 KiB."""

import json
from pathlib import Path
from typing import Any

import deployments  # noqa: F401  (OpenBLAS before MLX)

# isort: split
import mlx.core as mx
from mlx.utils import tree_flatten, tree_map
from mlx_lm.models import llama

from deployments.estimate import kv_bytes_per_token
from deployments.manifest import ManifestEntry, safetensors_bytes
from deployments.model_prep import fresh_dir, is_ready, mark_ready
from deployments.model_prep.tokenizer import train_tokenizer

NAME = "llama-10m"
KIND = "llm"
VERSION = "1"
SEED = 10

CONFIG: dict[str, Any] = {
    "model_type": "llama",
    "architectures": ["LlamaForCausalLM"],
    "hidden_size": 256,
    "num_hidden_layers": 8,
    "intermediate_size": 1024,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "head_dim": 64,
    "rms_norm_eps": 1e-5,
    "vocab_size": 2048,
    "max_position_embeddings": 4096,
    "rope_theta": 10000.0,
    "tie_word_embeddings": False,
    "torch_dtype": "float32",
}


def entry(dest: Path, name: str = NAME, config: dict[str, Any] = CONFIG, seed: int = SEED) -> ManifestEntry:
    return ManifestEntry(
        name=name,
        kind=KIND,
        path=Path(dest).name,
        weight_bytes=safetensors_bytes(dest),
        kv_bytes_per_token=kv_bytes_per_token(config),  # 16 KiB for the 10M
        weights="random",
        architecture="llama",
        source=f"random weights (seed {seed}), Orchard model_prep",
    )


def build(dest: Path) -> ManifestEntry:
    return build_llama(dest, NAME, CONFIG, VERSION, SEED)


def build_llama(dest: Path, name: str, config: dict[str, Any], version: str, seed: int) -> ManifestEntry:
    """A llama of `config`'s shape with random weights and the offline tokenizer (its vocabulary is
    the config's vocab_size), in the config's torch_dtype."""
    dest = Path(dest)
    if is_ready(dest, version):
        return entry(dest, name, config, seed)
    fresh_dir(dest)
    tokenizer = train_tokenizer(dest, vocab_size=config["vocab_size"])
    config = dict(config, eos_token_id=tokenizer.token_to_id("<|im_end|>"), bos_token_id=None)
    mx.random.seed(seed)
    model = llama.Model(llama.ModelArgs.from_dict(config))
    dtype = {"float32": mx.float32, "bfloat16": mx.bfloat16, "float16": mx.float16}[config["torch_dtype"]]
    # Default inits give logits that saturate; small weights keep sampling meaningful.
    model.update(tree_map(lambda p: (p * 0.02 if p.ndim == 2 else p).astype(dtype), model.parameters()))
    weights = dict(tree_flatten(model.parameters()))
    mx.save_safetensors(str(dest / "model.safetensors"), weights, metadata={"format": "mlx"})
    (dest / "config.json").write_text(json.dumps(config, indent=2))
    mark_ready(dest, version)
    return entry(dest, name, config, seed)
