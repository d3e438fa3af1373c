"""Registry entries become ModelSpecs with sizes from the config or measured from the folder."""

import pytest

from router.residency.registry import from_config, from_manifest


def test_sizes_come_from_the_folder_when_not_given(models_dir):
    catalog, entries = from_config(
        [
            {"name": "llama-10m", "kind": "llm", "pinned": True, "reserve_context_tokens": 1024},
            {"name": "e", "kind": "embedding", "path": "all-minilm-l6-v2", "policy": {"keep_warm": True, "role": "utility"}},
        ],
        models_dir,
    )
    llama = catalog["llama-10m"]
    assert llama.pinned and llama.reserve_context_tokens == 1024 and llama.kv_bytes_per_token == 16 * 1024
    assert llama.weight_bytes == entries["llama-10m"].weight_bytes > 0
    assert catalog["e"].keep_warm and catalog["e"].role == "utility" and catalog["e"].kv_bytes_per_token == 0
    assert entries["e"].path.endswith("all-minilm-l6-v2")


def test_every_prepared_model_registers(models_dir):
    catalog, _ = from_config(from_manifest(models_dir, {"smollm2-135m-instruct": {"keep_warm": True}}), models_dir)
    assert len(catalog) == 8 and catalog["smollm2-135m-instruct"].keep_warm


def test_bad_entries_are_refused(models_dir, tmp_path):
    with pytest.raises(ValueError, match="twice"):
        from_config([{"name": "a", "kind": "llm", "weight_bytes": "1GiB"}] * 2, models_dir)
    with pytest.raises(ValueError, match="no weight_bytes"):
        from_config([{"name": "nowhere", "kind": "llm"}], tmp_path)
    with pytest.raises(ValueError, match=r"models\[0\] \(a\)\.pinnned"):
        from_config([{"name": "a", "kind": "llm", "weight_bytes": "1GiB", "pinnned": True}], models_dir)
    with pytest.raises(ValueError, match=r"models\[0\] \(é\)\.name"):  # names are ASCII: actor names and URL paths
        from_config([{"name": "é", "kind": "llm", "weight_bytes": "1GiB"}], models_dir)


def test_hub_models_are_loaded_by_id(models_dir):
    from deployments.manifest import model_location
    from deployments.models import open_engine

    catalog, entries = from_config(
        [
            {
                "name": "qwen",
                "kind": "llm",
                "hub_id": "mlx-community/Qwen2.5-7B-Instruct-4bit",
                "weight_bytes": "4.3GiB",
                "kv_bytes_per_token": "56KiB",
            }
        ],
        models_dir,
    )
    entry = entries["qwen"]
    assert entry.hub and model_location(entry, models_dir) == "mlx-community/Qwen2.5-7B-Instruct-4bit"
    assert open_engine(entry, models_dir).path == "mlx-community/Qwen2.5-7B-Instruct-4bit"  # mlx_lm.load gets the id
    assert catalog["qwen"].kv_bytes_per_token == 56 * 1024
    with pytest.raises(ValueError, match="hub model"):
        from_config([{"name": "q", "kind": "llm", "hub_id": "org/x"}], models_dir)
