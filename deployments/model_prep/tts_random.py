"""A tiny Soprano text-to-speech model with random weights, written as a hub folder would be.

Soprano (mlx_audio.tts.models.soprano) is a Qwen3 language model whose hidden states a Vocos
decoder turns into 32 kHz audio: one model, no separate codec, voices or G2P package, and a plain
Hugging Face tokenizer, so everything it needs can be made offline. The LM is shrunk to 2 layers of
width 64; the decoder's size is fixed by mlx-audio (8 ConvNeXt blocks of width 512, ~13.7M params)."""

import json
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from deployments.estimate import estimate
from deployments.manifest import ManifestEntry
from deployments.model_prep import fresh_dir, is_ready, mark_ready
from deployments.model_prep.tokenizer import training_corpus

NAME = "soprano-tiny-random"
KIND = "tts"
VERSION = "1"
ARCHITECTURE = "soprano"
SEED = 0
STOP, TEXT, START = "[STOP]", "[TEXT]", "[START]"  # Soprano's prompt is "[STOP][TEXT]...[START]"
LM = dict(hidden_size=64, num_hidden_layers=2, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=16)


def _tokenizer(dest: Path) -> int:
    """Byte-level BPE whose pad token is [STOP]: Soprano stops generating on the pad token id."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=512, special_tokens=[STOP, TEXT, START], initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False
    )
    tok.train_from_iterator(training_corpus(), trainer=trainer)
    tok.save(str(dest / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "pad_token": STOP, "eos_token": STOP, "model_max_length": 4096}
    (dest / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
    (dest / "special_tokens_map.json").write_text(json.dumps({"pad_token": STOP, "eos_token": STOP}))
    return tok.get_vocab_size()


def _write(dest: Path) -> None:
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_audio.tts.models.soprano.soprano import Model, ModelConfig

    config = {
        "model_type": ARCHITECTURE,
        **LM,
        "vocab_size": _tokenizer(dest),
        "rms_norm_eps": 1e-6,
        "max_position_embeddings": 4096,
        "rope_theta": 10000.0,
        "tie_word_embeddings": False,  # Soprano always calls lm_head
        "sample_rate": 32000,
    }
    mx.random.seed(SEED)
    # mlx-audio picks the decoder width from model_path (as its loader will), so build with it too.
    model = Model(ModelConfig.from_dict({**config, "model_path": str(dest)}))
    lm, head = model.language_model, model.decoder.head.out
    lm.embed_tokens.weight = lm.embed_tokens.weight * 0.02
    # A random LM would end utterances at random; with [STOP]'s logit pinned at 0 the length follows
    # the engine's token budget for the text, as a trained model's would follow the text.
    lm.lm_head.weight[0] = 0.0
    # Lift the log-magnitudes a little so the noise is audible yet well inside [-1, 1].
    head.bias = head.bias + mx.concatenate([mx.full((head.bias.shape[0] // 2,), 1.5), mx.zeros((head.bias.shape[0] // 2,))])
    mx.save_safetensors(str(dest / "model.safetensors"), dict(tree_flatten(model.parameters())), metadata={"format": "mlx"})
    (dest / "config.json").write_text(json.dumps(config, indent=2))


def build(dest: Path) -> ManifestEntry:
    dest = Path(dest)
    if not is_ready(dest, VERSION):
        _write(fresh_dir(dest))
        mark_ready(dest, VERSION)
    size = estimate(dest, KIND)
    return ManifestEntry(
        name=NAME,
        kind=KIND,
        path=dest.name,
        weight_bytes=size.weight_bytes,
        kv_bytes_per_token=size.kv_bytes_per_token,
        weights="random",
        architecture=ARCHITECTURE,
        source="random weights, Orchard model_prep",
    )
