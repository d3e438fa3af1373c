"""`llama-1b-shape-l2-draft`: llama-1b-shape's first 2 of 16 layers (then its final norm and tied
output head, as early-exit self-speculation drafts are), unquantized: an eighth of a target step's
layers. With the random weights' small residual updates its argmax follows the target's closely, an
artefact of random weights that a real model's shallow exit does not share: it measures what the
engine's draft path gains when a draft is cheap and agrees, not a draft to ship. Built only when named:
`python -m deployments.models prepare DIR --only llama-1b-shape,llama-1b-shape-l2-draft`."""

from pathlib import Path

from deployments.manifest import ManifestEntry
from deployments.model_prep.llama_1b_shape_q4_draft import build_of

NAME = "llama-1b-shape-l2-draft"
KIND = "llm"


def build(dest: Path) -> ManifestEntry:
    return build_of(dest, NAME, None, 2)
