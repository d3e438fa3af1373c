"""ray-config.yaml carries the policy and the model registry: they must validate as policy types."""

from pathlib import Path

import pytest
import yaml
from pydantic import ValidationError

from policy import ClusterState, ModelSpec, PolicyConfig, ensure
from policy.config import GIB, MIB

ROOT = Path(__file__).resolve().parent.parent


def app_args() -> dict:
    config = yaml.safe_load((ROOT / "ray-config.yaml").read_text())
    (app,) = config["applications"]
    return app["args"]


def test_ray_config_policy_and_models_validate():
    args = app_args()
    policy = PolicyConfig.model_validate(args["policy"])
    assert policy.safety_margin_bytes == GIB and policy.instance_overhead_bytes == 256 * MIB
    models = [ModelSpec.model_validate(m) for m in args["models"]]
    assert len({m.name for m in models}) == len(models)
    assert {m.kind for m in models} >= {"llm", "embedding", "stt"}
    # Usable for a decision as it stands.
    catalog = ClusterState(catalog={m.name: m for m in models})
    assert ensure(models[0].name, catalog, 0.0, policy).decision == "reject"  # no nodes yet


def test_unknown_policy_keys_and_bad_sizes_are_refused():
    with pytest.raises(ValidationError, match="max_loaded_models"):
        PolicyConfig.model_validate({"max_loaded_models": 2})
    with pytest.raises(ValidationError):
        ModelSpec.model_validate({"name": "x", "kind": "llm", "weight_bytes": "lots"})
    with pytest.raises(ValidationError):
        ModelSpec.model_validate({"name": "x", "kind": "diffusion", "weight_bytes": "1GiB"})
    assert ModelSpec.model_validate({"name": "x", "kind": "llm", "weight_bytes": "1.5GiB"}).weight_bytes == int(1.5 * GIB)
