"""ray-config.yaml is what `serve run` reads: its args must validate as the app's and the policy's
types, and its per-model overrides must be ModelSpec fields of models in the prepared set."""

from pathlib import Path

import pytest
import yaml
from pydantic import ValidationError

from policy import ModelSpec, PolicyConfig
from policy.config import MIB
from router.api.builder import AppArgs
from router.residency.registry import from_config, from_manifest

ROOT = Path(__file__).resolve().parent.parent


def app_args() -> dict:
    config = yaml.safe_load((ROOT / "ray-config.yaml").read_text())
    (app,) = config["applications"]
    assert app["import_path"] == "router.api.builder:build_app"
    return app["args"]


def test_ray_config_args_validate(models_dir):
    args = AppArgs.model_validate(app_args())
    policy = PolicyConfig.model_validate(args.policy)
    assert policy.safety_margin_bytes == 64 * MIB and policy.instance_overhead_bytes == 128 * MIB
    catalog, _ = from_config(from_manifest(models_dir, args.overrides), models_dir)
    assert set(args.overrides) <= set(catalog)
    assert catalog["all-minilm-l6-v2"].keep_warm and catalog["all-minilm-l6-v2"].device == "cpu"


def test_unknown_policy_keys_and_bad_sizes_are_refused():
    with pytest.raises(ValidationError, match="max_loaded_models"):
        PolicyConfig.model_validate({"max_loaded_models": 2})
    with pytest.raises(ValidationError):
        ModelSpec.model_validate({"name": "x", "kind": "llm", "weight_bytes": "lots"})
    with pytest.raises(ValidationError):
        ModelSpec.model_validate({"name": "x", "kind": "diffusion", "weight_bytes": "1GiB"})
    assert ModelSpec.model_validate({"name": "x", "kind": "llm", "weight_bytes": "1.5GiB"}).weight_bytes == int(1.5 * 1024**3)
