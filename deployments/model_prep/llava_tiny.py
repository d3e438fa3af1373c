"""A tiny LLaVA (CLIP vision tower + 2-layer MLP projector + small llama) with seeded random
weights: no vision-language weights are reachable here (shared/models/README.md), but a real
architecture exercises the real mlx-vlm loader, processor and image-token path end to end.

The folder looks like an MLX-converted hub LLaVA: config.json (model_type "llava" with text_config
and vision_config), model.safetensors in mlx-vlm's own parameter names, a CLIP image processor
config, processor_config.json, and the project's byte-level BPE plus an `<image>` token."""

import json
from pathlib import Path

import deployments  # noqa: F401  (OpenBLAS before MLX)
from deployments.estimate import estimate
from deployments.manifest import ManifestEntry
from deployments.model_prep import fresh_dir, is_ready, mark_ready
from deployments.model_prep.tokenizer import train_tokenizer

NAME = "llava-tiny-random"
KIND = "vlm"
VERSION = "1"
SEED = 0
IMAGE_TOKEN = "<image>"
IMAGE_SIZE, PATCH_SIZE = 64, 8  # 64 image tokens per image (CLS dropped by "default" strategy)

# ChatML that accepts OpenAI-style content lists; an image part becomes one <image> placeholder,
# which the processor expands to the image's patch count.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' }}"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] in ('image', 'image_url') %}{{ '<image>\\n' }}"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}"
    "{{ '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def _tokenizer(dest: Path) -> tuple[int, int, int]:
    """The shared BPE plus <image>; returns (vocab size, image token id, eos id)."""
    tok = train_tokenizer(dest)
    tok.add_special_tokens([IMAGE_TOKEN])
    tok.save(str(dest / "tokenizer.json"))
    cfg_path = dest / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["chat_template"] = CHAT_TEMPLATE
    cfg_path.write_text(json.dumps(cfg, indent=2))
    (dest / "chat_template.json").write_text(json.dumps({"chat_template": CHAT_TEMPLATE}))
    return tok.get_vocab_size(), tok.token_to_id(IMAGE_TOKEN), tok.token_to_id("<|im_end|>")  # type: ignore[return-value]  # both are in the vocabulary


def _config(vocab: int, image_id: int, eos_id: int) -> dict:
    return {
        "architectures": ["LlavaForConditionalGeneration"],
        "model_type": "llava",
        "image_token_index": image_id,
        "vision_feature_select_strategy": "default",
        "vision_feature_layer": -2,
        "projector_hidden_act": "gelu",
        "vocab_size": vocab,
        "eos_token_id": [eos_id],
        "torch_dtype": "float32",
        "text_config": {
            "model_type": "llama",
            "hidden_size": 128,
            "intermediate_size": 352,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "max_position_embeddings": 2048,
            "rms_norm_eps": 1e-5,
            "rope_theta": 10000.0,
            "vocab_size": vocab,
            "tie_word_embeddings": False,
        },
        "vision_config": {
            "model_type": "clip_vision_model",
            "hidden_size": 64,
            "intermediate_size": 256,
            "num_hidden_layers": 2,  # vision_feature_layer -2 needs at least two
            "num_attention_heads": 2,
            "image_size": IMAGE_SIZE,
            "patch_size": PATCH_SIZE,
            "projection_dim": 64,
            "hidden_act": "quick_gelu",
            "layer_norm_eps": 1e-5,
        },
    }


def _processor_files(dest: Path) -> None:
    """A CLIP image processor at IMAGE_SIZE px, and the LLaVA processor's token arithmetic."""
    clip_mean, clip_std = [0.48145466, 0.4578275, 0.40821073], [0.26862954, 0.26130258, 0.27577711]
    (dest / "preprocessor_config.json").write_text(
        json.dumps(
            {
                "image_processor_type": "CLIPImageProcessor",
                "processor_class": "LlavaProcessor",
                "do_resize": True,
                "size": {"shortest_edge": IMAGE_SIZE},
                "do_center_crop": True,
                "crop_size": {"height": IMAGE_SIZE, "width": IMAGE_SIZE},
                "do_rescale": True,
                "rescale_factor": 1 / 255,
                "do_normalize": True,
                "image_mean": clip_mean,
                "image_std": clip_std,
                "do_convert_rgb": True,
                "resample": 3,
            },
            indent=2,
        )
    )
    (dest / "processor_config.json").write_text(
        json.dumps(
            {
                "processor_class": "LlavaProcessor",
                "patch_size": PATCH_SIZE,
                "vision_feature_select_strategy": "default",
                "image_token": IMAGE_TOKEN,
                "num_additional_image_tokens": 1,
            },
            indent=2,
        )
    )


def _weights(dest: Path, config: dict) -> None:
    """Initialise mlx-vlm's own LLaVA module (seeded) and save its parameters under its names."""
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_vlm.models import llava

    mx.random.seed(SEED)
    cfg = llava.ModelConfig.from_dict(config)
    cfg.text_config = llava.TextConfig.from_dict(config["text_config"])
    cfg.vision_config = llava.VisionConfig.from_dict(config["vision_config"])
    params = dict(tree_flatten(llava.Model(cfg).parameters()))
    for name, value in params.items():
        # Unit-variance embeddings swamp the small layers; real checkpoints are near 0.02.
        if "embed_tokens" in name or "position_embedding" in name or "class_embedding" in name:
            params[name] = mx.random.normal(value.shape) * 0.02
    mx.save_safetensors(str(dest / "model.safetensors"), params, metadata={"format": "mlx"})


def build(dest: Path) -> ManifestEntry:
    dest = Path(dest)
    if not is_ready(dest, VERSION):
        fresh_dir(dest)
        config = _config(*_tokenizer(dest))
        (dest / "config.json").write_text(json.dumps(config, indent=2))
        _processor_files(dest)
        _weights(dest, config)
        mark_ready(dest, VERSION)
    size = estimate(dest, KIND)
    return ManifestEntry(
        name=NAME,
        kind=KIND,
        path=dest.name,
        weight_bytes=size.weight_bytes,
        kv_bytes_per_token=size.kv_bytes_per_token,
        weights="random",
        architecture="llava",
        source=f"random init (seed {SEED}) of mlx-vlm's llava: CLIP ViT {IMAGE_SIZE}px/{PATCH_SIZE} + llama",
    )
