"""The prepared model set's manifest: what the router's model registry reads."""

import json
import os
from pathlib import Path
from typing import Literal

from pydantic import Field

from deployments.engine import Frozen
from policy.specs import ModelKind

MANIFEST_NAME = "manifest.json"


class ManifestEntry(Frozen):
    name: str
    kind: ModelKind
    path: str  # relative to the models folder (or absolute); a Hugging Face repo id when `hub`
    hub: bool = False  # loaded by repo id through the same loaders (a Mac with hub access)
    # The folder's name in the node model stores (cluster/store.py): the registry path relative to
    # models_dir, or models--<org>--<name> for a hub model. None for absolute paths: stores do not
    # keep those.
    folder: str | None = None
    weight_bytes: int = Field(ge=0)  # sum of the *.safetensors sizes (== MLX active memory once loaded)
    kv_bytes_per_token: int = Field(default=0, ge=0)
    weights: Literal["real", "random"]
    architecture: str
    source: str  # where the weights came from
    # How the router parses this model's output (router.serving.output.parsing.OutputConfig): the tool-call
    # syntax family (router.serving.output.tool_parsers.FAMILIES, docs/tool-calls.md; None: no tool
    # calling; the registry infers it from the chat template when its entry names none) and the reasoning
    # markers (None: the model does not reason; true: <think>...</think>; or {start, end, starts_inside}).
    tool_parser: str | None = None
    reasoning: bool | dict | None = None
    # The registry entry's own LLM scheduling (deployments/engines/options.py fields), over the app's.
    llm_engine: dict | None = None


def model_location(entry: ManifestEntry, models_dir: str | Path) -> str:
    """What the loaders get: the repo id of a hub model, else the folder on this node."""
    return entry.path if entry.hub else str(Path(models_dir) / entry.path)


class Manifest(Frozen):
    models: tuple[ManifestEntry, ...]

    def entry(self, name: str) -> ManifestEntry:
        for e in self.models:
            if e.name == name:
                return e
        raise KeyError(f"no model {name!r} in the manifest")


def read_manifest(models_dir: str | Path) -> Manifest:
    return Manifest.model_validate_json((Path(models_dir) / MANIFEST_NAME).read_text())


def write_manifest(models_dir: Path, manifest: Manifest) -> None:
    path = Path(models_dir) / MANIFEST_NAME
    partial = path.with_name(f".{MANIFEST_NAME}.{os.getpid()}")
    partial.write_text(json.dumps(manifest.model_dump(), indent=2) + "\n")
    partial.replace(path)  # whole or not at all: a reader (a node, another process) never sees half of it


def safetensors_bytes(folder: str | Path) -> int:
    return sum(p.stat().st_size for p in Path(folder).glob("*.safetensors"))
