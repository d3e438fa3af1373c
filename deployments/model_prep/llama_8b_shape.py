"""Llama-3.1-8B's shape (4096 hidden, 32 layers, 32 query / 8 KV heads, 14336 MLP) with random
bfloat16 weights, for issue 11's 8B row on an accelerator: ~14 GB, built only when named
(`python -m deployments.models prepare DIR --only llama-8b-shape`). Like llama-1b-shape it keeps
the offline tokenizer's 2048-token vocabulary."""

from pathlib import Path
from typing import Any

from deployments.manifest import ManifestEntry
from deployments.model_prep.llama_1b_shape import CONFIG as ONE_B
from deployments.model_prep.llama_tiny import build_llama

NAME = "llama-8b-shape"
KIND = "llm"
VERSION = "1"
SEED = 8

CONFIG: dict[str, Any] = dict(
    ONE_B,
    hidden_size=4096,
    num_hidden_layers=32,
    intermediate_size=14336,
    num_attention_heads=32,
    num_key_value_heads=8,
    head_dim=128,
    tie_word_embeddings=False,
)


def build(dest: Path) -> ManifestEntry:
    return build_llama(dest, NAME, CONFIG, VERSION, SEED)
