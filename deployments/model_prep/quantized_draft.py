"""A draft model for speculative decoding made from its target: the same weights quantized (mlx-lm's
quantize_model, 4 bits in groups of 64 by default), its tokenizer files copied, so it shares the
target's vocabulary and agrees with it on most tokens at a fraction of its weight bytes. `layers`:
only the target's first N decoder layers are kept (then its final norm and output head, as early-exit
self-speculation drafts do): a forward of N / L of the target's layers.

    python -m deployments.model_prep.quantized_draft SOURCE DEST [--bits 4] [--group-size 64] [--layers N]

e.g. `models/llama-1b-shape models/llama-1b-shape-q4-draft` (the GPU benchmark's draft: the 1B shape
is built with `python -m deployments.models prepare models --only llama-1b-shape`). Idempotent: a
finished DEST (its marker naming the source and the bits) is kept."""

import argparse
import json
import shutil
import sys
from pathlib import Path

from mlx_lm.utils import load_model, quantize_model, save_config, save_model

from deployments.model_prep import fresh_dir, is_ready, mark_ready

VERSION = "1"


def build_draft(source: Path, dest: Path, bits: int | None = 4, group_size: int = 64, layers: int | None = None) -> Path:
    """Write `source`'s model (its first `layers` decoder layers; all: None) quantized to `bits`
    (None: not quantized) into `dest`, kept if already built the same way."""
    source, dest = Path(source), Path(dest)
    version = f"{VERSION}-{source.resolve()}-{bits}-{group_size}-{layers}"
    if is_ready(dest, version):
        return dest
    if not (source / "config.json").is_file():
        raise FileNotFoundError(f"no model at {source} to make a draft of")
    fresh_dir(dest)
    model, config = load_model(source)
    if "quantization" in config:
        raise ValueError(f"{source} is quantized already; a draft is made from unquantized weights")
    if layers is not None:
        inner = model.model
        if not 1 <= layers <= len(inner.layers):
            raise ValueError(f"{source} has {len(inner.layers)} layers; a draft keeps 1 to {len(inner.layers)} of them, not {layers}")
        inner.layers = inner.layers[:layers]
        inner.num_hidden_layers = layers
        config = dict(config, num_hidden_layers=layers)
        if isinstance(config.get("layer_types"), list):
            config["layer_types"] = config["layer_types"][:layers]
        if hasattr(model, "args"):
            model.args.num_hidden_layers = layers
    if bits is not None:
        model, config = quantize_model(model, config, group_size, bits)
    save_model(dest, model, donate_model=True)
    save_config(config, dest / "config.json")
    for path in source.iterdir():  # the tokenizer's files and the chat template: the target's own
        if (
            path.is_file()
            and not path.name.endswith(".safetensors")
            and path.name not in ("config.json", "model.safetensors.index.json")
            and not path.name.startswith(".")
        ):
            shutil.copy(path, dest / path.name)
    (dest / "draft_of.json").write_text(json.dumps({"source": str(source), "bits": bits, "group_size": group_size, "layers": layers}) + "\n")
    mark_ready(dest, version)
    return dest


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m deployments.model_prep.quantized_draft", description=__doc__.splitlines()[0])
    ap.add_argument("source", type=Path)
    ap.add_argument("dest", type=Path)
    ap.add_argument("--bits", type=int, default=4, choices=(0, 2, 3, 4, 6, 8), help="0: not quantized")
    ap.add_argument("--group-size", type=int, default=64, choices=(32, 64, 128))
    ap.add_argument("--layers", type=int, default=None, help="keep the first N decoder layers (default: all)")
    a = ap.parse_args(argv)
    print(build_draft(a.source, a.dest, a.bits or None, a.group_size, a.layers))
    return 0


if __name__ == "__main__":
    sys.exit(main())
