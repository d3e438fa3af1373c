"""Llama-3.2-1B's shape (2048 hidden, 16 layers, 32 query / 8 KV heads, 8192 MLP) with random
bfloat16 weights: the accelerator benchmarks' model (issue 11), 1.95 GB. Built only when named
(`python -m deployments.models prepare DIR --only llama-1b-shape`). Its vocabulary is the offline
tokenizer's 2048 tokens, not Llama's 128k: the output projection is 0.5% of the layers' work instead
of ~20%, so a step is a little shorter than the real model's, which only makes the serving path's
share of it larger."""

from pathlib import Path
from typing import Any

from deployments.manifest import ManifestEntry
from deployments.model_prep.llama_tiny import CONFIG as TINY, build_llama

NAME = "llama-1b-shape"
KIND = "llm"
VERSION = "1"
SEED = 1

CONFIG: dict[str, Any] = dict(
    TINY,
    hidden_size=2048,
    num_hidden_layers=16,
    intermediate_size=8192,
    num_attention_heads=32,
    num_key_value_heads=8,
    head_dim=64,
    max_position_embeddings=8192,
    rope_theta=500000.0,
    tie_word_embeddings=True,
    torch_dtype="bfloat16",
)


def build(dest: Path) -> ManifestEntry:
    return build_llama(dest, NAME, CONFIG, VERSION, SEED)
