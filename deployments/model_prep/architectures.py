"""Model folders of today's architectures with random weights, for checking what a model reserves
against what it holds (tests/test_memory_matrix.py, bench/memory_matrix.py).

Each config is in its family's own config.json shape (the keys mlx-lm reads, with the real model's
layer mix: Gemma 3's five sliding layers to one global, gpt-oss's alternating sliding / full layers,
Qwen3-Next's three linear-attention layers to one full, DeepSeek-V2-Lite's latent projections and
experts), scaled down by `scale` ("tiny": few layers and a small width, seconds to build and run on a
CPU; "full": the real model's dimensions, gigabytes). The folders load through mlx_lm.load like a
hub folder: the offline tokenizer, config.json and one safetensors file."""

import json
from pathlib import Path
from typing import Any

import deployments  # noqa: F401  (OpenBLAS before MLX)

# isort: split
import mlx.core as mx
from mlx.utils import tree_flatten, tree_map
from mlx_lm.utils import _get_classes

from deployments.estimate import kv_bytes_per_token
from deployments.manifest import ManifestEntry, safetensors_bytes
from deployments.model_prep import fresh_dir, is_ready, mark_ready
from deployments.model_prep.tokenizer import train_tokenizer

VERSION = "1"
KIND = "llm"

_COMMON: dict[str, Any] = {"vocab_size": 2048, "max_position_embeddings": 32768, "rms_norm_eps": 1e-6, "tie_word_embeddings": False}

# name -> (the real model's config.json keys that set its shape, the tiny version's overrides)
FAMILIES: dict[str, tuple[dict[str, Any], dict[str, Any]]] = {
    "llama3": (
        {
            "model_type": "llama",
            "hidden_size": 4096,
            "num_hidden_layers": 32,
            "intermediate_size": 14336,
            "num_attention_heads": 32,
            "num_key_value_heads": 8,
            "head_dim": 128,
            "rope_theta": 500000.0,
        },
        {"hidden_size": 256, "num_hidden_layers": 4, "intermediate_size": 512, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64},
    ),
    "qwen3": (
        {
            "model_type": "qwen3",
            "hidden_size": 4096,
            "num_hidden_layers": 36,
            "intermediate_size": 12288,
            "num_attention_heads": 32,
            "num_key_value_heads": 8,
            "head_dim": 128,
            "rope_theta": 1000000.0,
        },
        {"hidden_size": 256, "num_hidden_layers": 4, "intermediate_size": 512, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64},
    ),
    "gemma3": (  # Gemma 3 12B's text model: 5 sliding (1024) to 1 global layer
        {
            "model_type": "gemma3_text",
            "hidden_size": 3840,
            "num_hidden_layers": 48,
            "intermediate_size": 15360,
            "num_attention_heads": 16,
            "num_key_value_heads": 8,
            "head_dim": 256,
            "query_pre_attn_scalar": 256,
            "sliding_window": 1024,
            "sliding_window_pattern": 6,
            "rope_theta": 1000000.0,
            "rope_local_base_freq": 10000.0,
        },
        {
            "hidden_size": 256,
            "num_hidden_layers": 6,
            "intermediate_size": 512,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "head_dim": 64,
            "query_pre_attn_scalar": 64,
            "sliding_window": 128,
        },
    ),
    "gpt-oss": (  # gpt-oss-20b: alternating sliding (128) and full layers, 32 experts, 4 active
        {
            "model_type": "gpt_oss",
            "hidden_size": 2880,
            "num_hidden_layers": 24,
            "intermediate_size": 2880,
            "num_attention_heads": 64,
            "num_key_value_heads": 8,
            "head_dim": 64,
            "num_local_experts": 32,
            "num_experts_per_tok": 4,
            "sliding_window": 128,
            "rope_theta": 150000,
            "layer_types": ["sliding_attention", "full_attention"] * 12,
        },
        {
            "hidden_size": 256,
            "num_hidden_layers": 4,
            "intermediate_size": 256,
            "num_attention_heads": 8,
            "num_key_value_heads": 2,
            "head_dim": 32,
            "num_local_experts": 4,
            "num_experts_per_tok": 2,
            "sliding_window": 64,
            "layer_types": ["sliding_attention", "full_attention"] * 2,
        },
    ),
    "qwen3-moe": (  # Qwen3-30B-A3B: 128 experts, 8 active
        {
            "model_type": "qwen3_moe",
            "hidden_size": 2048,
            "num_hidden_layers": 48,
            "intermediate_size": 6144,
            "num_attention_heads": 32,
            "num_key_value_heads": 4,
            "head_dim": 128,
            "num_experts": 128,
            "num_experts_per_tok": 8,
            "decoder_sparse_step": 1,
            "mlp_only_layers": [],
            "moe_intermediate_size": 768,
            "norm_topk_prob": True,
            "rope_theta": 1000000.0,
        },
        {
            "hidden_size": 256,
            "num_hidden_layers": 4,
            "intermediate_size": 512,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "head_dim": 64,
            "num_experts": 8,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 128,
        },
    ),
    "qwen3-next": (  # Qwen3-Next-80B-A3B: 3 gated-delta (linear) layers to 1 full, 512 experts
        {
            "model_type": "qwen3_next",
            "hidden_size": 2048,
            "num_hidden_layers": 48,
            "intermediate_size": 5120,
            "num_attention_heads": 16,
            "num_key_value_heads": 2,
            "head_dim": 256,
            "linear_num_value_heads": 32,
            "linear_num_key_heads": 16,
            "linear_key_head_dim": 128,
            "linear_value_head_dim": 128,
            "linear_conv_kernel_dim": 4,
            "num_experts": 512,
            "num_experts_per_tok": 10,
            "decoder_sparse_step": 1,
            "shared_expert_intermediate_size": 512,
            "mlp_only_layers": [],
            "moe_intermediate_size": 512,
            "rope_theta": 10000000.0,
            "partial_rotary_factor": 0.25,
            "full_attention_interval": 4,
            "norm_topk_prob": True,
        },
        {
            "hidden_size": 256,
            "num_hidden_layers": 4,
            "intermediate_size": 512,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "head_dim": 64,
            "linear_num_value_heads": 4,
            "linear_num_key_heads": 2,
            "linear_key_head_dim": 32,
            "linear_value_head_dim": 32,
            "num_experts": 8,
            "num_experts_per_tok": 2,
            "shared_expert_intermediate_size": 128,
            "moe_intermediate_size": 128,
        },
    ),
    "deepseek-v2-lite": (  # DeepSeek-V2-Lite: latent KV projections (rank 512), 64 experts, 6 active, 2 shared
        {
            "model_type": "deepseek_v2",
            "hidden_size": 2048,
            "num_hidden_layers": 27,
            "intermediate_size": 10944,
            "moe_intermediate_size": 1408,
            "num_attention_heads": 16,
            "num_key_value_heads": 16,
            "kv_lora_rank": 512,
            "q_lora_rank": None,
            "qk_rope_head_dim": 64,
            "qk_nope_head_dim": 128,
            "v_head_dim": 128,
            "n_routed_experts": 64,
            "n_shared_experts": 2,
            "num_experts_per_tok": 6,
            "first_k_dense_replace": 1,
            "moe_layer_freq": 1,
            "topk_method": "greedy",
            "rope_theta": 10000.0,
            "rope_scaling": {
                "type": "yarn",
                "factor": 40,
                "mscale": 0.707,
                "mscale_all_dim": 0.707,
                "beta_fast": 32,
                "beta_slow": 1,
                "original_max_position_embeddings": 4096,
            },
        },
        {
            "hidden_size": 256,
            "num_hidden_layers": 3,
            "intermediate_size": 512,
            "moe_intermediate_size": 128,
            "num_attention_heads": 4,
            "num_key_value_heads": 4,
            "kv_lora_rank": 64,
            "qk_rope_head_dim": 16,
            "qk_nope_head_dim": 32,
            "v_head_dim": 32,
            "n_routed_experts": 8,
            "n_shared_experts": 1,
            "num_experts_per_tok": 2,
        },
    ),
    "deepseek-v3": (  # DeepSeek V3 / Kimi K2's attention: one latent (512) and one rotary key (64) cached per token
        {
            "model_type": "deepseek_v3",
            "hidden_size": 7168,
            "num_hidden_layers": 61,
            "intermediate_size": 18432,
            "moe_intermediate_size": 2048,
            "num_attention_heads": 128,
            "num_key_value_heads": 128,
            "kv_lora_rank": 512,
            "q_lora_rank": 1536,
            "qk_rope_head_dim": 64,
            "qk_nope_head_dim": 128,
            "v_head_dim": 128,
            "n_routed_experts": 256,
            "n_shared_experts": 1,
            "num_experts_per_tok": 8,
            "first_k_dense_replace": 3,
            "moe_layer_freq": 1,
            "n_group": 8,
            "topk_group": 4,
            "rope_theta": 10000.0,
        },
        {
            "hidden_size": 256,
            "num_hidden_layers": 3,
            "intermediate_size": 512,
            "moe_intermediate_size": 128,
            "num_attention_heads": 4,
            "num_key_value_heads": 4,
            "kv_lora_rank": 64,
            "q_lora_rank": 96,
            "qk_rope_head_dim": 16,
            "qk_nope_head_dim": 32,
            "v_head_dim": 32,
            "n_routed_experts": 8,
            "n_shared_experts": 1,
            "num_experts_per_tok": 2,
            "first_k_dense_replace": 1,
            "n_group": 1,
            "topk_group": 1,
        },
    ),
}


# One card's cut of the real shapes ("card"): the real widths, heads, windows and latent ranks, the
# layers cut (keeping the mix: whole Gemma 3 and Qwen3-Next patterns, gpt-oss pairs) and, for
# DeepSeek V3, its experts too, so each folder is 5-15 GB in bfloat16.
CARD: dict[str, dict[str, Any]] = {
    "gemma3": {"num_hidden_layers": 24},
    "gpt-oss": {"num_hidden_layers": 8, "layer_types": ["sliding_attention", "full_attention"] * 4},
    "qwen3-moe": {"num_hidden_layers": 12},
    "qwen3-next": {"num_hidden_layers": 4},
    "deepseek-v2-lite": {"num_hidden_layers": 12},
    "deepseek-v3": {"num_hidden_layers": 4, "n_routed_experts": 32},
}


def config(family: str, scale: str = "tiny", dtype: str = "float32") -> dict[str, Any]:
    """`family`'s config.json: the real shape ("full"), one card's cut of it ("card"), or (tiny) the
    same layer mix scaled down."""
    real, tiny = FAMILIES[family]
    cut = {"tiny": tiny, "card": CARD.get(family, {})}.get(scale, {})
    return _COMMON | real | cut | {"torch_dtype": dtype}


def build(dest: Path, family: str, scale: str = "tiny", dtype: str = "float32", seed: int = 0) -> ManifestEntry:
    """A folder of `family`'s architecture at `scale` with random weights (idempotent)."""
    dest = Path(dest)
    cfg = config(family, scale, dtype)
    if not is_ready(dest, VERSION):
        fresh_dir(dest)
        tokenizer = train_tokenizer(dest, vocab_size=cfg["vocab_size"])
        cfg = dict(cfg, eos_token_id=tokenizer.token_to_id("<|im_end|>"), bos_token_id=None)
        model_class, args_class = _get_classes(cfg)
        mx.random.seed(seed)
        model = model_class(args_class.from_dict(cfg))
        dt = {"float32": mx.float32, "bfloat16": mx.bfloat16, "float16": mx.float16}[dtype]
        # small weights keep activations finite through random layers
        model.update(tree_map(lambda p: (p * 0.02 if p.ndim >= 2 else p).astype(dt), model.parameters()))
        weights = dict(tree_flatten(model.parameters()))
        mx.save_safetensors(str(dest / "model.safetensors"), weights, metadata={"format": "mlx"})
        (dest / "config.json").write_text(json.dumps(cfg, indent=2))
        mark_ready(dest, VERSION)
    return ManifestEntry(
        name=dest.name,
        kind=KIND,
        path=dest.name,
        weight_bytes=safetensors_bytes(dest),
        kv_bytes_per_token=kv_bytes_per_token(cfg),
        weights="random",
        architecture=cfg["model_type"],
        source=f"random weights (seed {seed}) of {family}'s shape ({scale}), Orchard model_prep",
    )
