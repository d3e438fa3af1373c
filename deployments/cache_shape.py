"""What a decoder's cache holds, by layer kind, read from config.json the way mlx-lm builds its caches
(each model's `make_cache` in mlx_lm/models/): before a model is loaded, for admission by policy/.

Four kinds of layer, as mlx-lm caches them:
- full attention (`KVCache`): K and V of every token, in buffers grown 256 tokens at a time;
- sliding window (`RotatingKVCache(max_size=W)`): at most W tokens, but a prefill chunk of S tokens
  is appended before the oldest are dropped, so it holds up to W - 1 + S while it prefills (Gemma 3:
  every `sliding_window_pattern`-th layer is full, the rest slide; gpt-oss and llama-family models
  with `layer_types`: "sliding_attention" layers slide. Mistral's `sliding_window` without
  `layer_types` is full attention in mlx-lm's llama, so it is counted as such);
- fixed-size state (`ArraysCache`): a linear-attention or SSM layer's convolution tail and recurrent
  state, the same at any context (Qwen3-Next, Nemotron-H, Granite 4 hybrids, LFM2);
- latent attention: DeepSeek V3 / Kimi K2 (mlx-lm's deepseek_v3 family) cache one compressed latent
  (kv_lora_rank) and one rotary key (qk_rope_head_dim) per token per layer; mlx-lm's deepseek_v2
  (DeepSeek-V2 and V2-Lite) caches the decompressed keys and values of every head instead.
A quantized cache (`kv_bits`) shrinks the attention kinds (`quantized_kv_bytes`)."""

from deployments.wire.measured import CacheShape

STATE_BYTES = 4  # recurrent states (gated delta, Mamba's SSM) are kept in float32

# model types that cache a compressed latent (mlx-lm's deepseek_v3 and its kin)
LATENT_TYPES = {"deepseek_v3", "kimi_k2", "deepseek_v32", "joyai_llm_flash", "glm4_moe_lite", "kimi_k3", "longcat_flash", "mistral4"}


def _text(config: dict) -> dict:
    return config.get("text_config") or config


def _kv_elements(text: dict) -> int:
    """K + V elements per token of one attention layer."""
    heads = text["num_attention_heads"]
    head_dim = text.get("head_dim") or text["hidden_size"] // heads
    kv_heads = text.get("num_key_value_heads") or heads
    return 2 * kv_heads * head_dim


def layer_kinds(config: dict) -> list[str]:
    """Each cached layer's kind, in order, as the model type's make_cache builds them (layers that
    keep no cache, such as Nemotron-H's MLP and MoE blocks, are left out)."""
    text = _text(config)
    kind = text.get("model_type") or config.get("model_type") or ""
    n = int(text.get("num_hidden_layers") or 0)
    types = text.get("layer_types")
    if kind in ("gemma3_text", "gemma3"):
        every = int(text.get("sliding_window_pattern") or 6)
        return ["full" if i % every == every - 1 else "window" for i in range(n)]
    if kind == "gpt_oss":
        types = types or ["sliding_attention", "full_attention"] * (n // 2)
        return ["full" if t == "full_attention" else "window" for t in types]
    if kind == "qwen3_next":
        interval = int(text.get("full_attention_interval") or 4)
        return ["state" if (i + 1) % interval else "full" for i in range(n)]
    if kind == "nemotron_h":
        pattern: list[str] = list(text.get("hybrid_override_pattern") or [])
        if not pattern and types:
            pattern = ["M" if t == "mamba" else "*" if t == "attention" else "-" for t in types]
        return [{"M": "state", "*": "full"}[b] for b in pattern if b in "M*"]
    if kind == "granitemoehybrid":
        return [{"mamba": "state", "attention": "full"}[t] for t in types or [] if t in ("mamba", "attention")]
    if kind in ("lfm2", "lfm2_moe"):
        full = set(text.get("full_attn_idxs") or [i for i, t in enumerate(types or []) if t == "full_attention"])
        return ["full" if i in full else "state" for i in range(n)]
    if kind in LATENT_TYPES:
        return ["latent"] * n
    if types and kind in ("llama", "mistral", "ministral3", "qwen3", "qwen2", "olmo3", "exaone4", "cohere2"):
        return ["window" if t == "sliding_attention" else "full" for t in types]
    return ["full"] * n


def _state_elements(text: dict) -> tuple[int, int]:
    """(elements kept in the model's dtype, elements kept in float32) of one fixed-size-state layer."""
    kind = text.get("model_type") or ""
    if kind == "qwen3_next":
        key_dim = text["linear_key_head_dim"] * text["linear_num_key_heads"]
        value_heads, value_dim = text["linear_num_value_heads"], text["linear_value_head_dim"]
        conv = (text.get("linear_conv_kernel_dim", 4) - 1) * (2 * key_dim + value_heads * value_dim)
        return conv, value_heads * value_dim * text["linear_key_head_dim"]
    if kind in ("nemotron_h", "granitemoehybrid"):
        names = 0 if kind == "nemotron_h" else 1  # Nemotron-H's key names, or Granite's

        def g(nemotron: str, granite: str, default: int = 0) -> int:
            return int(text.get((nemotron, granite)[names]) or default)

        heads, head_dim = g("mamba_num_heads", "mamba_n_heads"), g("mamba_head_dim", "mamba_d_head")
        state, groups = g("ssm_state_size", "mamba_d_state"), g("n_groups", "mamba_n_groups", 1)
        kernel = g("conv_kernel", "mamba_d_conv", 4)
        conv = (kernel - 1) * (heads * head_dim + 2 * groups * state)
        return conv, heads * head_dim * state
    if kind in ("lfm2", "lfm2_moe"):
        return (text.get("conv_L_cache", 3) - 1) * text["hidden_size"], 0
    return 0, 0


def quantized_kv_bytes(elements: int, dtype_bytes: int, kv_bits: int | None, kv_group_size: int = 64) -> int:
    """Bytes of `elements` cached values: dtype_bytes each unquantized; quantized, kv_bits / 8 each
    and a scale and a bias of dtype_bytes for each kv_group_size of them (mx.quantize's layout)."""
    if kv_bits is None:
        return elements * dtype_bytes
    return -(-elements * kv_bits // 8) + 2 * dtype_bytes * -(-elements // kv_group_size)


def cache_shape(config: dict, dtype_bytes: int, kv_bits: int | None = None, kv_group_size: int = 64) -> CacheShape:
    """The cache of the model `config` describes, its elements `dtype_bytes` each (the activations'
    dtype); `kv_bits`: a quantized cache of the attention layers."""
    text = _text(config)
    kinds = layer_kinds(config) if text.get("num_attention_heads") else []
    if not kinds:
        return CacheShape()
    counts = {k: kinds.count(k) for k in sorted(set(kinds))}
    model_type = text.get("model_type") or config.get("model_type") or ""
    if model_type == "deepseek_v2":
        heads = text["num_attention_heads"]
        per_layer = heads * (text.get("qk_nope_head_dim", 128) + text.get("qk_rope_head_dim", 64) + text.get("v_head_dim", 128))
    else:
        per_layer = _kv_elements(text)
    latent = text.get("kv_lora_rank", 512) + text.get("qk_rope_head_dim", 64)
    full = counts.get("full", 0) * per_layer + counts.get("latent", 0) * latent
    window = counts.get("window", 0) * per_layer
    plain, wide = _state_elements(text)
    window_tokens = int(text.get("sliding_window") or (512 if model_type.startswith("gemma3") else 128)) if window else 0
    return CacheShape(
        full_bytes_per_token=quantized_kv_bytes(full, dtype_bytes, kv_bits, kv_group_size),
        window_bytes_per_token=quantized_kv_bytes(window, dtype_bytes, kv_bits, kv_group_size),
        window_tokens=window_tokens,
        state_bytes=counts.get("state", 0) * (plain * dtype_bytes + wide * STATE_BYTES),
        layers=counts,
    )


def joined(target: CacheShape, draft: CacheShape) -> CacheShape:
    """A target's cache and its draft model's (speculative decoding: the draft keeps its own cache of
    every sequence beside the target's), as one sequence's: bytes added, the longer window."""
    layers = {k: target.layers.get(k, 0) + draft.layers.get(k, 0) for k in sorted(set(target.layers) | set(draft.layers))}
    return CacheShape(
        full_bytes_per_token=target.full_bytes_per_token + draft.full_bytes_per_token,
        window_bytes_per_token=target.window_bytes_per_token + draft.window_bytes_per_token,
        window_tokens=max(target.window_tokens, draft.window_tokens),
        state_bytes=target.state_bytes + draft.state_bytes,
        layers=layers,
    )
