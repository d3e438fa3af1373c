"""What a loaded vision-language model holds, measured in its own process (rule M1 for VLMs): the
language model's weights, cache and steps as measure.py measures an LLM's, and the vision tower's
step, which runs between two batch steps while the batch's cache is held.

- weights: MLX's active memory after the load less before it (the vision tower included);
- the cache: the language model's own caches (mlx-vlm's make_prompt_cache) with one token run
  through them;
- the activations: the most of the language model's prefill and decode steps (measure.measure,
  through `TextLogits`), a group of the reserved rows prefilled in mlx-vlm's batch generator as the
  engine runs it (`served_group`: what a bare forward may leave out, such as padding masks and the
  merge into the batch), and one arrival's images (`max_images` of them, at the size the processor
  makes them: `largest_image_side`) through the processor and the vision tower into the prompt's
  embeddings.

The batch is held to the KV reservation as an LLM's is (rule M4): the engine asks the same
`KVBudget` (measure.kv_budget) whether a row joins."""

import gc
import math
from collections.abc import Callable
from typing import Any, cast

import mlx.core as mx

from deployments.engines import measure
from deployments.wire.measured import CacheShape, MeasuredMemory

# The same step's peak moves with the timing of MLX's asynchronous frees: six runs of llava's
# reserved group in one process peaked 18.13-18.91 MB, a run in another process 17.5 MB (CPU).
# The group is measured twice and the most carries this much over it, so that a batch's later
# groups, each another draw, stay within the reservation.
PEAK_SLACK = 0.05


class TextLogits:
    """The language model as measure.py calls a model: `model(tokens, cache=...)` -> logits (mlx-vlm's
    language models return an output object that carries them)."""

    def __init__(self, language_model: Any):
        self.language_model = language_model

    def __call__(self, inputs: mx.array, cache: Any = None) -> mx.array:
        out = self.language_model(inputs, cache=cache)
        return getattr(out, "logits", out)


def vision_activation(embed: Callable[[int], Any], images: int) -> int:
    """MLX's peak while `embed(images)` (the processor and the vision tower for one arrival with
    that many images, to its prompt's embeddings) runs, less what is active after it."""
    if images < 1:
        return 0
    mx.synchronize()
    gc.collect()
    mx.clear_cache()
    active = mx.get_active_memory()
    mx.reset_peak_memory()
    held = embed(images)
    mx.eval(held)
    mx.synchronize()
    peak = mx.get_peak_memory()
    del held
    return max(0, peak - max(active, mx.get_active_memory()))


def served_group(generator: Callable[[], Any], embed_text: Callable[[list[int]], dict], rows: int, tokens: int, vocab: int) -> int:
    """MLX's peak while a group of `rows` prompts of `tokens` prefills in mlx-vlm's own batch
    generator and takes its first tokens, less what is active after (their caches included): the
    batch's padding masks and the group's merge into the batch, which a bare forward leaves out."""
    batch = generator()
    try:
        prompts = cast(list[list[int]], mx.random.randint(0, vocab, (rows, tokens)).tolist())
        embedded = [embed_text(p) for p in prompts]  # as each arrival's are, before the group
        mx.synchronize()
        gc.collect()
        mx.clear_cache()
        mx.reset_peak_memory()
        waiting = set(batch.insert(prompts, max_tokens=2, prompt_kwargs=embedded))
        while waiting:
            _, responses = batch.next()
            waiting -= {r.uid for r in responses}
        mx.synchronize()
        return max(0, mx.get_peak_memory() - mx.get_active_memory())
    finally:
        batch.close()


def measure_vlm(
    language_model: Any,
    embed: Callable[[int], Any],
    generator: Callable[[], Any],
    embed_text: Callable[[list[int]], dict],
    *,
    weight_bytes: int,
    vocab: int,
    max_images: int,
    reserve_context_tokens: int,
    reserve_concurrency: int,
    prefill_chunk: int,
    prefill_rows: int,
    decode_rows: int,
    estimated_weight_bytes: int = 0,
    estimated_cache: CacheShape | None = None,
) -> MeasuredMemory:
    """MeasuredMemory of a VLM just loaded (module docstring): measure.measure's figures for the
    language model; its activation the most of those steps, the served group and one arrival's
    vision step, with PEAK_SLACK over it."""
    from mlx_vlm.models.cache import make_prompt_cache

    text = measure.measure(
        TextLogits(language_model),
        lambda: make_prompt_cache(language_model),
        weight_bytes=weight_bytes,
        vocab=vocab,
        reserve_context_tokens=reserve_context_tokens,
        reserve_concurrency=reserve_concurrency,
        prefill_chunk=prefill_chunk,
        prefill_rows=prefill_rows,
        decode_rows=decode_rows,
        estimated_weight_bytes=estimated_weight_bytes,
        estimated_cache=estimated_cache,
    )
    tokens = min(text.prefill_chunk, max(1, text.longest_sequence() - 1))
    group = max(served_group(generator, embed_text, text.prefill_rows, tokens, vocab) for _ in range(2))
    vision = vision_activation(embed, max_images)
    mx.clear_cache()
    most = max(text.activation_bytes, vision, group)
    return text.model_copy(update={"activation_bytes": int(most * (1 + PEAK_SLACK))})


def largest_image_side(max_image_pixels: int, image_processor: Any) -> int:
    """The side of the square image that measures the vision step: where the processor crops or
    resizes every image to one size (CLIP's center crop, SigLIP's fixed size), that size, since a
    larger image gives the same pixels (and 8 images of 4096 px took 4.5 s to process); else the
    largest a request may send, or the processor's own pixel ceiling (Qwen2-VL's `max_pixels`)."""
    fixed = _fixed_side(image_processor)
    if fixed:
        return fixed
    ceiling = getattr(image_processor, "max_pixels", None)
    pixels = min(max_image_pixels, ceiling) if isinstance(ceiling, int) and ceiling > 0 else max_image_pixels
    return max(1, math.isqrt(pixels))


def _fixed_side(image_processor: Any) -> int | None:
    """The side every image comes out at (transformers' image processors), or None where it varies."""

    def height_width(size: Any) -> tuple[Any, Any]:
        if isinstance(size, dict):
            return size.get("height"), size.get("width")
        return getattr(size, "height", None), getattr(size, "width", None)

    if image_processor is None:
        return None
    if getattr(image_processor, "do_center_crop", False):
        height, width = height_width(getattr(image_processor, "crop_size", None))
        if isinstance(height, int) and isinstance(width, int):
            return max(height, width)
    if getattr(image_processor, "do_resize", False) and getattr(image_processor, "max_pixels", None) is None:
        height, width = height_width(getattr(image_processor, "size", None))
        if isinstance(height, int) and isinstance(width, int):
            return max(height, width)
    return None
