"""What a model will hold, from its folder alone, before its first load: for admission by policy/
(once loaded, the engine measures it: deployments/engines/measure.py).

Weights in memory = the sum of the *.safetensors sizes (matched mx.get_active_memory() exactly
here). The cache by layer kind (deployments/cache_shape.py: full attention, sliding windows,
fixed-size state, latent attention), from config.json (its text_config for a VLM) as mlx-lm builds
it; `kv_bytes_per_token` is its full-attention layers' (2 x layers x KV heads x head dim x bytes per
element for a dense model), the element size following the config's dtype. With a
quantized cache (`kv_bits` b, `kv_group_size` g; deployments/engines/quantized_cache.py) an element
takes b/8 bytes, and every g elements add a scale and a bias in that dtype: 8 bits, groups of 64,
float16 hold 2 / (1 + 4/64) = 1.88x the tokens in the same bytes."""

import json
import struct
from pathlib import Path

from deployments.cache_shape import cache_shape, joined, quantized_kv_bytes
from deployments.engine import Frozen
from deployments.manifest import safetensors_bytes
from deployments.wire.measured import CacheShape

DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2, "F32": 4, "F16": 2, "BF16": 2}


class FolderEstimate(Frozen):
    weight_bytes: int
    kv_bytes_per_token: int
    cache: CacheShape = CacheShape()


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


def dtype_bytes(folder: str | Path) -> int:
    """Bytes of one KV element of the model in `folder` (its config's dtype, else its weights'; 2 if
    neither says)."""
    folder = Path(folder)
    config = json.loads((folder / "config.json").read_text())
    text = config.get("text_config") or config
    dtype = config.get("torch_dtype") or config.get("dtype") or text.get("torch_dtype") or weights_dtype(folder) or "float16"
    return DTYPE_BYTES.get(dtype, 2)


def config_cache(config: dict, weights_dtype: str | None = None, kv_bits: int | None = None, kv_group_size: int = 64) -> CacheShape:
    """The cache of the model `config` describes, by layer kind; empty for models without a decoder
    cache (encoders, audio models without these keys)."""
    text = config.get("text_config") or config
    dtype = config.get("torch_dtype") or config.get("dtype") or text.get("torch_dtype") or weights_dtype or "float16"
    return cache_shape(config, DTYPE_BYTES.get(dtype, 2), kv_bits, kv_group_size)


def kv_bytes_per_token(config: dict, weights_dtype: str | None = None, kv_bits: int | None = None, kv_group_size: int = 64) -> int:
    """What the layers whose cache grows with the context hold per token (0 without a decoder cache)."""
    return config_cache(config, weights_dtype, kv_bits, kv_group_size).full_bytes_per_token


def kv_bytes_quantized(kv_bytes: int, dtype_bytes: int, kv_bits: int | None, kv_group_size: int = 64) -> int:
    """An unquantized per-token figure (a registry entry's kv_bytes_per_token, a manifest's) as the
    quantized cache holds it."""
    return quantized_kv_bytes(kv_bytes // dtype_bytes, dtype_bytes, kv_bits, kv_group_size)


def estimate(
    folder: str | Path, kind: str = "llm", kv_bits: int | None = None, kv_group_size: int = 64, draft: str | Path | None = None
) -> FolderEstimate:
    """Encoders (embedding, rerank) keep no KV cache; decoders do, LLM-based TTS included.
    `kv_bits`: an LLM engine's quantized cache (its llm_engine options). `draft`: the folder of a
    draft model loaded with it (speculative decoding), whose weights and cache (in its own dtype,
    for every sequence) are the instance's too."""
    folder = Path(folder)
    config = json.loads((folder / "config.json").read_text())
    cache = CacheShape() if kind in ("embedding", "rerank") else config_cache(config, weights_dtype(folder), kv_bits, kv_group_size)
    weights = safetensors_bytes(folder)
    if draft is not None:
        extra = estimate(draft)
        weights, cache = weights + extra.weight_bytes, joined(cache, extra.cache)
    return FolderEstimate(weight_bytes=weights, kv_bytes_per_token=cache.full_bytes_per_token, cache=cache)
