"""What a model will hold, from its folder alone, before loading: for admission by policy/.

Weights in memory = the sum of the *.safetensors sizes (matched mx.get_active_memory() exactly
here). KV per token = 2 (K and V) x layers x KV heads x head dim x bytes per element, from
config.json (its text_config for a VLM); the element size follows the config's dtype."""

import json
import struct
from pathlib import Path

from deployments.engine import Frozen
from deployments.manifest import safetensors_bytes

DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2, "F32": 4, "F16": 2, "BF16": 2}


class FolderEstimate(Frozen):
    weight_bytes: int
    kv_bytes_per_token: int


def weights_dtype(folder: Path) -> str | None:
    """The most common floating dtype in the safetensors headers (the activations', hence the KV
    cache's, dtype; quantized weights keep their scales in it)."""
    counts: dict[str, int] = {}
    for path in Path(folder).glob("*.safetensors"):
        with open(path, "rb") as f:
            header = json.loads(f.read(struct.unpack("<Q", f.read(8))[0]))
        for name, info in header.items():
            if name != "__metadata__" and info["dtype"] in DTYPE_BYTES:
                counts[info["dtype"]] = counts.get(info["dtype"], 0) + 1
    return max(counts, key=counts.__getitem__) if counts else None


def kv_bytes_per_token(config: dict, weights_dtype: str | None = None) -> int:
    """0 for models without a decoder KV cache (encoders, audio models without these keys)."""
    text = config.get("text_config") or config
    layers = text.get("num_hidden_layers")
    heads = text.get("num_attention_heads")
    if not layers or not heads:
        return 0
    head_dim = text.get("head_dim") or text["hidden_size"] // heads
    kv_heads = text.get("num_key_value_heads") or heads
    dtype = config.get("torch_dtype") or config.get("dtype") or text.get("torch_dtype") or weights_dtype or "float16"
    return 2 * layers * kv_heads * head_dim * DTYPE_BYTES.get(dtype, 2)


def estimate(folder: str | Path, kind: str = "llm") -> FolderEstimate:
    """Encoders (embedding, rerank) keep no KV cache; decoders do, LLM-based TTS included."""
    folder = Path(folder)
    config = json.loads((folder / "config.json").read_text())
    kv = 0 if kind in ("embedding", "rerank") else kv_bytes_per_token(config, weights_dtype(folder))
    return FolderEstimate(weight_bytes=safetensors_bytes(folder), kv_bytes_per_token=kv)
