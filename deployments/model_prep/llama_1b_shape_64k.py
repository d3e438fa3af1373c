"""llama-1b-shape with a 65,536-token context (rope theta 500k as Llama 3.2's): the accelerator
model for the coding-agent benchmarks (bench.peers --agent --shape claude-code|codex), whose
~20-30k-token prompts do not fit llama-1b-shape's 8,192. The same random weights (same seed and
layers); built only when named (`python -m deployments.models prepare DIR --only llama-1b-shape-64k`)."""

from pathlib import Path
from typing import Any

from deployments.manifest import ManifestEntry
from deployments.model_prep.llama_1b_shape import CONFIG as ONE_B, SEED
from deployments.model_prep.llama_tiny import build_llama

NAME = "llama-1b-shape-64k"
KIND = "llm"
VERSION = "1"

CONFIG: dict[str, Any] = dict(ONE_B, max_position_embeddings=65536)


def build(dest: Path) -> ManifestEntry:
    return build_llama(dest, NAME, CONFIG, VERSION, SEED)
