"""The embedded model set: one command builds it offline and idempotently, and its manifest says
what policy/ needs (weights, KV per token) for every kind."""

import time

import pytest

from deployments.estimate import estimate
from deployments.manifest import read_manifest
from deployments.models import main, prepare


def test_manifest_covers_every_kind_with_real_and_random_weights(models_dir):
    manifest = read_manifest(models_dir)
    kinds = {e.kind for e in manifest.models}
    assert kinds == {"llm", "vlm", "embedding", "rerank", "stt", "tts"}
    real = {e.name for e in manifest.models if e.weights == "real"}
    assert real == {"smollm2-135m-instruct", "all-minilm-l6-v2", "whisper-tiny-en"}
    for e in manifest.models:
        folder = models_dir / e.path
        assert folder.is_dir() and e.weight_bytes > 0
        assert e.weight_bytes == sum(p.stat().st_size for p in folder.glob("*.safetensors"))
        if e.kind in ("llm", "vlm"):
            assert e.kv_bytes_per_token > 0
        if e.kind in ("embedding", "rerank"):
            assert e.kv_bytes_per_token == 0
        assert estimate(folder, e.kind).kv_bytes_per_token == e.kv_bytes_per_token  # from the folder alone
    assert manifest.entry("llama-10m").kv_bytes_per_token == 16 * 1024
    assert manifest.entry("smollm2-135m-instruct").kv_bytes_per_token == 45 * 1024


def test_prepare_is_idempotent_and_fast_the_second_time(models_dir):
    before = {p: p.stat().st_mtime_ns for p in models_dir.rglob("*.safetensors")}
    started = time.perf_counter()
    prepare(models_dir, log=lambda *_: None)
    assert time.perf_counter() - started < 5
    assert {p: p.stat().st_mtime_ns for p in models_dir.rglob("*.safetensors")} == before


def test_command_line_lists_the_manifest(models_dir, capsys):
    assert main(["list", str(models_dir)]) == 0
    out = capsys.readouterr().out
    assert "smollm2-135m-instruct" in out and "whisper-tiny-en" in out


@pytest.mark.parametrize(
    ("module", "low", "high"), [("llama_1b_shape", 0.9e9, 1.1e9), ("llama_1b_shape_64k", 0.9e9, 1.1e9), ("llama_8b_shape", 6.8e9, 7.1e9)]
)
def test_the_benchmark_shapes_are_the_real_models_layers_and_are_built_only_when_named(models_dir, module, low, high):
    """llama-1b-shape and llama-8b-shape have Llama-3.2-1B's and Llama-3.1-8B's layers (their parameters
    less the 128k-token embedding: the offline vocabulary is 2048), counted on the lazily built model
    (nothing is allocated); the plain prepare that made the test set did not build them (gigabytes each)."""
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_lm.models import llama

    from deployments.models import ON_REQUEST, builder

    config = builder(module).CONFIG
    model = llama.Model(llama.ModelArgs.from_dict(config))
    params = sum(p.size for _, p in tree_flatten(model.parameters()))
    mx.clear_cache()
    assert low <= params <= high and config["torch_dtype"] == "bfloat16"
    assert module in ON_REQUEST
    assert builder(module).NAME not in {e.name for e in read_manifest(models_dir).models}
