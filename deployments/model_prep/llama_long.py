"""A ~2M-parameter llama with random weights and a 64k context: the model the coding-agent CLIs'
real prompts fit (Claude Code's first request is ~20k tokens of this tokenizer, with max_tokens
32000). Two layers, one KV head: a 20k-token prefill takes seconds on a laptop CPU. KV per token =
2 x 2 layers x 1 head x 64 x 4 bytes = 1 KiB."""

from pathlib import Path
from typing import Any

from deployments.manifest import ManifestEntry
from deployments.model_prep.llama_tiny import CONFIG as TINY, build_llama

NAME = "llama-64k"
KIND = "llm"
VERSION = "1"
SEED = 64

CONFIG: dict[str, Any] = dict(
    TINY,
    hidden_size=128,
    num_hidden_layers=2,
    intermediate_size=256,
    num_attention_heads=2,
    num_key_value_heads=1,
    head_dim=64,
    vocab_size=4096,
    max_position_embeddings=65536,
    rope_theta=1000000.0,
)


def build(dest: Path) -> ManifestEntry:
    return build_llama(dest, NAME, CONFIG, VERSION, SEED)
