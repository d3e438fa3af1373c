"""Draft models of llama-1b-shape for speculative decoding (deployments/engines/draft.py): its own
weights, the same tokenizer. `llama-1b-shape-q4-draft`: all 16 layers in 4 bits (mlx-lm's
quantize_model), 0.29x the bytes. Built only when named, after llama-1b-shape:
`python -m deployments.models prepare DIR --only llama-1b-shape,llama-1b-shape-q4-draft`."""

from pathlib import Path

from deployments.estimate import estimate
from deployments.manifest import ManifestEntry, safetensors_bytes
from deployments.model_prep import llama_1b_shape
from deployments.model_prep.quantized_draft import build_draft

NAME = "llama-1b-shape-q4-draft"
KIND = "llm"
BITS: int | None = 4
LAYERS: int | None = None


def build_of(dest: Path, name: str, bits: int | None, layers: int | None) -> ManifestEntry:
    """A draft of llama-1b-shape (built beside it first if it is not there) in `dest`."""
    dest = Path(dest)
    source = dest.parent / llama_1b_shape.NAME
    llama_1b_shape.build(source)
    build_draft(source, dest, bits=bits, layers=layers)
    how = ", ".join(x for x in (f"{bits} bits" if bits else "", f"its first {layers} layers" if layers else "") if x)
    return ManifestEntry(
        name=name,
        kind=KIND,
        path=dest.name,
        weight_bytes=safetensors_bytes(dest),
        kv_bytes_per_token=estimate(dest).kv_bytes_per_token,
        weights="random",
        architecture="llama",
        source=f"{llama_1b_shape.NAME}'s weights, {how} (deployments.model_prep.quantized_draft)",
    )


def build(dest: Path) -> ManifestEntry:
    return build_of(dest, NAME, BITS, LAYERS)
