"""What a loaded model holds, measured in its own process: the figures its reservation comes from once
it has loaded (the folder's estimate, deployments/estimate.py, is only for before the first load).

- weights as resident: MLX's active memory after the load less before it;
- the cache per layer kind, from the real cache objects: the model's own make_prompt_cache (or the
  engine's quantized caches) with one token run through it; a layer with keys holds its buffers'
  bytes over their token slots per token (up to its max_size for a RotatingKVCache), any other
  layer (an ArraysCache: a convolution tail and a recurrent state) the same bytes at any context;
- a step's activation peak: MLX's peak over a step less what is active after it. A prompt longer
  than the engine's max_prefill_tokens prefills alone, one chunk a step: one row's steps at context
  offsets 0 and one chunk (with sliding windows: a few chunks past the windows) give a line that
  bounds its steps at the reserved context from above (`prefill_line`: attention's scratch and the cache's copy into a larger
  buffer grow with the context; a chunk at the reserved context itself would cost a whole prefill at
  load). A group of shorter prompts
  prefills `rows` rows at once, and a decode step of `reserve_concurrency` rows computes the logits:
  the most of the three is the figure, each with the decoding rows' last outputs that mlx-lm holds
  beside it (`held_outputs`).

`limit_bytes` is what the process may hold: weights, the KV of `reserve_concurrency` sequences of
`reserve_context_tokens`, one prefill step's activations at that context, and the prefix cache's
budget. The engine sets MLX's memory limit (and on Metal its wired limit) to it, and refuses a
request whose own cache could never fit the reservation (`refusal`)."""

import gc
import logging
import math
import threading
import time
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol, cast

import mlx.core as mx
from mlx.utils import tree_flatten
from mlx_lm.models.cache import make_prompt_cache

from deployments.engines.acceptance import accept
from deployments.engines.llm_scheduler import KVBudget
from deployments.engines.prefix_disk import model_identity
from deployments.engines.quantized_cache import fresh_caches
from deployments.engines.sampling import RowSampling
from deployments.estimate import config_cache, weights_dtype
from deployments.manifest import safetensors_bytes
from deployments.wire.measured import KV_STEP, CacheShape, MeasuredMemory

MIB = 2**20

logger = logging.getLogger(__name__)


def _arrays(x: Any) -> list[mx.array]:
    return [a for _, a in cast(list[tuple[str, Any]], tree_flatten(x)) if isinstance(a, mx.array)]


def _layer(cache: Any) -> tuple[int, int, int]:
    """(bytes per token, fixed bytes, window) of one layer's cache after a token: a cache with keys
    (KVCache, RotatingKVCache, a quantized one, a latent one) holds its buffers' bytes over their
    token slots per token, up to its max_size if it has one; any other (an ArraysCache) holds its
    arrays whatever the context; a CacheList, its members'."""
    if isinstance(getattr(cache, "caches", None), (list, tuple)):
        parts = [_layer(c) for c in cache.caches]
        return sum(p[0] for p in parts), sum(p[1] for p in parts), max((p[2] for p in parts), default=0)
    keys = getattr(cache, "keys", None)
    if keys is not None and hasattr(cache, "offset"):
        held = _arrays((keys, getattr(cache, "values", None)))
        slots = held[0].shape[-2]
        size = getattr(cache, "max_size", None)
        return sum(a.nbytes for a in held) // slots, 0, size if isinstance(size, int) else 0
    return 0, sum(a.nbytes for a in _arrays(cache.state)), 0


def cache_shape(model: Any, caches: Callable[[], list[Any]]) -> CacheShape:
    """The cache per layer kind from `caches()` (fresh caches as the engine makes them), one token
    run through them (module docstring)."""
    layers = caches()
    model(mx.array([[1]]), cache=layers)
    mx.eval([c.state for c in layers])
    full = window = window_tokens = state = 0
    counts: dict[str, int] = {}
    for layer in layers:
        per_token, fixed, size = _layer(layer)
        kind = "window" if size and per_token else "full" if per_token else "state" if fixed else "none"
        counts[kind] = counts.get(kind, 0) + 1
        if size:
            window, window_tokens = window + per_token, max(window_tokens, size)
        else:
            full += per_token
        state += fixed
    return CacheShape(full_bytes_per_token=full, window_bytes_per_token=window, window_tokens=window_tokens, state_bytes=state, layers=counts)


def _nothing() -> None:
    return None


def _step_activation(
    model: Any, layers: list[Any], rows: int, tokens: int, vocab: int, logits: bool = False, between: Callable[[], None] = _nothing
) -> int:
    """MLX's peak over one step of `rows` x `tokens` (a prefill step as mlx-lm runs it: the caches
    evaluated, the logits not; a decode step: the logits too, in float32 as the samplers take them,
    and where it verifies drafts (tokens > 1) the acceptance of sampled rows, whose filtering,
    scores and draws hold arrays of every position's vocabulary at once), less what is active after
    it (the caches grown by the step included). `between` runs first (it may raise to stop a
    measurement: `Interrupted`)."""
    between()
    inputs = mx.random.randint(0, vocab, (rows, tokens))
    mx.eval(inputs)
    mx.synchronize()
    gc.collect()  # garbage freed during the step (an earlier model's arrays) would lower what stays after it
    mx.clear_cache()  # the step's buffers allocated at their own sizes, not taken from larger cached ones
    mx.reset_peak_memory()
    out = model(inputs, cache=layers)
    if logits and tokens > 1:  # a speculative verify step: every position's logits, sampled rows' acceptance
        sampled = [RowSampling(temperature=1.0, top_p=0.95, top_k=40)] * rows  # every filter: its sort and thresholds too
        logprobs = out - mx.logsumexp(out, axis=-1, keepdims=True)  # as Speculator._verify holds them
        held = [out, logprobs, *accept(logprobs, inputs[:, 1:], [tokens - 1] * rows, sampled)]
    elif logits:
        held = [mx.softmax(out.astype(mx.float32), axis=-1)]
    else:
        held = []  # a prefill step: the logits are not computed
    mx.eval(held, [c.state for c in layers])
    mx.synchronize()
    peak = mx.get_peak_memory()
    del out, held  # nothing of the step is held when what stays active is read
    return max(0, peak - mx.get_active_memory())


def prefill_line(
    model: Any, caches: Callable[[], list[Any]], chunk: int, vocab: int, context: int, window: int = 0, between: Callable[[], None] = _nothing
) -> tuple[int, int, float, int]:
    """One row's prefill steps of `chunk` tokens up to `context`, bounded: (the most of the steps
    measured, a line's value at offset `start`, its growth per token, `start`); a step at offset
    o >= start holds at most `value + growth x (o - start)`.

    Attention's scratch and the cache's copy into a larger buffer grow with the context. Without
    sliding windows the line runs from offset 0 to one chunk, which bounds the later steps from above
    (bench/memory_matrix.py measures how far). With windows, a sliding layer's span grows only until
    its window is full (W - 1 + a chunk while it prefills), then stays: that line climbs as if every
    layer's span grew for the whole context (twice Gemma 3's real steps at 1,024 tokens). So the
    steps run from offset 0 to two periods past the first chunk
    boundary a window and a chunk in (`period`: the chunks that make a whole number of mlx-lm's
    256-token buffer steps, so two steps a period apart both copy their full layers' buffers into
    larger ones, or neither), the growth is the steepest between such pairs (a single step's
    activation varies by a few hundred KiB from run to run; one pair, extrapolated 15-fold to the
    reserved context, made the bound vary by 15%), and each step of the last period is carried to
    the reserved context at that growth. Where the steps reach the context, every step was measured
    and the line is flat."""
    layers = caches()
    if not window:  # every layer's span grows from the start: the line from offset 0 to one chunk
        base = _step_activation(model, layers, 1, chunk, vocab, between=between)
        second = _step_activation(model, layers, 1, chunk, vocab, between=between)
        return max(base, second), base, max(0.0, (second - base) / chunk), 0
    period = min(4, math.lcm(chunk, KV_STEP) // chunk) * chunk
    first = -(-(window + chunk) // chunk) * chunk  # every window full from here on
    end = first + 2 * period
    last = max(0, context - chunk)  # the offset of the reserved context's last step
    steps = {offset: _step_activation(model, layers, 1, chunk, vocab, between=between) for offset in range(0, min(end, last) + 1, chunk)}
    most = max(steps.values())
    if end >= last:  # every step up to the context was measured
        return most, most, 0.0, 0
    growth = max(0.0, *((steps[q + period] - steps[q]) / period for q in range(first, end - period + 1, chunk)))
    start = end - period + chunk  # the last period's first step
    value = max(steps[q] - growth * (q - start) for q in range(start, end + 1, chunk))
    return most, int(value + 0.5), growth, start


def held_outputs(model: Any, caches: Callable[[], list[Any]], rows: int, vocab: int) -> int:
    """One decode step's log-probabilities for `rows` rows, as mlx-lm's GenerationBatch keeps them
    between steps: it computes a step while the last one's are still held (returned with the
    step's tokens), and a prefill step runs between a decode step and the next, with both held."""
    out = model(mx.zeros((1, 1), dtype=mx.int32), cache=caches())
    return rows * vocab * out.dtype.size


def activation(
    model: Any,
    caches: Callable[[], list[Any]],
    rows: int,
    chunk: int,
    vocab: int,
    decode_rows: int,
    decode_tokens: int = 1,
    between: Callable[[], None] = _nothing,
    one_row: int | None = None,
    held: int | None = None,
) -> int:
    """The most of a prefill step of `rows` rows of a chunk at context 0 and a decode step of
    `decode_rows` rows (the batch's most: short rows beyond reserve_concurrency fit the KV
    reservation, M4) of `decode_tokens` each: one, or with speculative decoding the token and its
    drafts, with every position's logits and their acceptance. Each carries the decoding rows'
    outputs held beside it (`held_outputs`): the last step's in a decode step, two steps' in a
    prefill step. `one_row`: a one-row step of a chunk at context 0 measured already (the group's
    step when `rows` is 1); `held`: `held_outputs` of `decode_rows` rows, where known already."""
    held = held_outputs(model, caches, decode_rows, vocab) if held is None else held
    if rows == 1 and one_row is not None:
        group = one_row
    else:
        group = _step_activation(model, caches(), rows, chunk, vocab, between=between)  # one cache per layer holds the batch
    decode = _step_activation(model, caches(), decode_rows, decode_tokens, vocab, logits=True, between=between)
    return max(group + 2 * held, decode + held)


def measure(
    model: Any,
    caches: Callable[[], list[Any]],
    *,
    weight_bytes: int,
    vocab: int,
    reserve_context_tokens: int,
    reserve_concurrency: int,
    prefill_chunk: int,
    prefill_rows: int,
    decode_tokens: int = 1,
    decode_rows: int = 0,
    prefix_cache_bytes: int = 0,
    weights_hash: str = "",
    estimated_weight_bytes: int = 0,
    estimated_cache: CacheShape | None = None,
    passes: bool = True,
    between: Callable[[], None] = _nothing,
) -> MeasuredMemory:
    """Every figure of MeasuredMemory for a model just loaded (its weights `weight_bytes` as
    measured around the load); without `passes`, all but the activations' (a `provisional` one:
    the cache's shape takes one token, the activation passes a few steps of the reserved batch)."""
    started = time.perf_counter()
    shape = cache_shape(model, caches)
    rows = max(1, min(prefill_rows, reserve_concurrency))
    chunk = max(1, min(prefill_chunk, reserve_context_tokens or 1))
    at_context = base = 0
    per_token = 0.0
    if passes:
        # a prompt longer than the engine's max_prefill_tokens prefills alone; a group's rows are shorter
        most, base, per_token, start = prefill_line(model, caches, chunk, vocab, reserve_context_tokens, shape.window_tokens, between)
        decode_most = max(decode_rows, reserve_concurrency)
        held = held_outputs(model, caches, decode_most, vocab)
        batched = activation(model, caches, rows, chunk, vocab, decode_most, decode_tokens, between, None if shape.window_tokens else base, held)
        mx.clear_cache()
        line = max(most, base + int(per_token * max(0, reserve_context_tokens - chunk - start) + 0.5))
        at_context = max(batched, 2 * held + line)  # a long prompt's chunk beside the decoding rows' outputs too
    return MeasuredMemory(
        weights_hash=weights_hash,
        weight_bytes=weight_bytes,
        cache=shape,
        activation_bytes=at_context,
        activation_base_bytes=base,
        activation_bytes_per_token=per_token,
        prefill_rows=rows,
        prefill_chunk=chunk,
        decode_rows=max(decode_rows, reserve_concurrency),
        decode_tokens=decode_tokens,
        reserve_context_tokens=reserve_context_tokens,
        reserve_concurrency=reserve_concurrency,
        prefix_cache_bytes=prefix_cache_bytes,
        seconds=time.perf_counter() - started,
        estimated_weight_bytes=estimated_weight_bytes,
        estimated_cache=estimated_cache,
        provisional=not passes,
    )


def caches_of(model: Any, make: Callable[[Any], list[Any]], quantized: Callable[[int], list[Any]] | None) -> Callable[[], list[Any]]:
    """Fresh caches as the engine makes them: the engine's quantized ones where it quantizes (given
    the layer count), else the model's own make_prompt_cache."""
    if quantized is not None:
        layers = len(make(model))
        return lambda: quantized(layers)
    return lambda: make(model)


_limits: dict[int, int] = {}  # id(engine) -> its limit_bytes, while the engine lives
_limits_lock = threading.Lock()
_mlx_default: list[int] = []  # MLX's own memory limit, from before any engine set one


def _set_memory_limit(nbytes: int) -> None:
    previous = mx.set_memory_limit(nbytes)
    if not _mlx_default:
        _mlx_default.append(previous)


def unlimited() -> None:
    """MLX's own memory limit again, as before any engine set one. A model is measured under it: under
    a smaller limit (a stopped engine's, or one that does not count the model being measured) MLX
    waits for work in flight before it allocates, and a step peaks lower than it will when it serves
    (a gpt-oss step measured after another model's engine: 15% under the peak it then reached)."""
    if _mlx_default:
        mx.set_memory_limit(_mlx_default[0])


def set_limit(owner: int, limit_bytes: int | None) -> int:
    """MLX's memory limit for this process, and on Metal its wired limit (what it may keep resident):
    the sum of its live engines' limits (a model server runs one; a test may run several), each
    engine by its id(); `None`: that engine is gone. Returns the process's limit."""
    with _limits_lock:
        if limit_bytes is None:
            _limits.pop(owner, None)
        else:
            _limits[owner] = int(limit_bytes)
        total = sum(_limits.values())
    if not total:  # no engine left: MLX's own limit
        unlimited()
        return 0
    _set_memory_limit(total)
    if mx.metal.is_available():
        try:
            mx.set_wired_limit(total)
        except ValueError as e:  # past the device's ceiling: the node's iogpu.wired_limit_mb
            logger.warning("wired limit of %d bytes refused: %s", total, e)
    return total


class LoadedEngine(Protocol):
    """What `loaded` reads of an LLM engine that has just loaded its model."""

    name: str
    path: str
    model: Any
    vocab_size: int
    context_length: int
    kv_bits: int | None
    kv_group_size: int
    reserve_context_tokens: int
    reserve_concurrency: int
    prefill_batch: int
    max_prefill_tokens: int
    prompt_cache_bytes: int
    spec_max_drafts: int
    max_batch: int
    known_memory: MeasuredMemory | None
    measure_idle_s: float | None

    @property
    def prefill_chunk(self) -> int: ...


def loaded(engine: LoadedEngine, config: dict, active_before: int) -> MeasuredMemory:
    """Measure `engine`'s model just loaded (MLX's active memory was `active_before` when its load
    began), set the process's limits from it, and keep the engine's context within its KV
    reservation: a longer prompt is refused (`refusal`), a longer generation stops at it.

    An engine with `measure_idle_s` (the served default) runs no activation passes here: its
    measurement is `provisional` (weights and cache shape, no activations), the process runs under
    MLX's own limit, and `completed` measures the rest once the engine has been idle that long,
    so a swap's first tokens do not wait for a few forward passes of the reserved batch. A draft
    model's target measures here."""
    mx.synchronize()
    weights = max(0, mx.get_active_memory() - active_before)
    unlimited()  # measured as it will run (set_limit below sets the process's limit again)
    bits, group = engine.kv_bits, engine.kv_group_size
    quantized = (lambda layers: list(fresh_caches(layers, bits, group))) if bits is not None else None
    identity = model_identity(engine.path, bits, group, 0, "") if Path(engine.path).is_dir() else ""
    draft = getattr(getattr(engine, "speculator", None), "draft", None)
    known = engine.known_memory
    if draft is None and known is not None and measured_as(known, engine, identity):
        measured = known.model_copy(
            update={"weight_bytes": weights}
        )  # M1: these weights measured under these settings before: the figures hold, no passes run again
        logger.info("%s: the measurement of these weights and settings from an earlier load holds", engine.name)
    else:
        passes = draft is not None or engine.measure_idle_s is None
        estimated_cache = config_cache(config, weights_dtype(Path(engine.path)) if Path(engine.path).is_dir() else None, bits, group)
        measured = _measure_loaded(engine, weights, identity, quantized, estimated_cache, passes)
    if draft is not None:  # a draft model's cache of every sequence is the instance's too (its weights are in `weights`)
        measured = draft.counted(measured)
    if engine.reserve_context_tokens:  # 0: the operator reserves no KV, and nothing is held to it
        # a verify step runs every row's drafts into the batch cache before it trims the rejected
        # ones: a row's cache may reach its length + the drafts, which its share must hold too
        engine.context_length = min(engine.context_length, measured.longest_sequence() - drafts(engine))
    limit = set_limit(id(engine), None if measured.provisional else measured.limit_bytes)
    weakref.finalize(engine, set_limit, id(engine), None)
    if measured.provisional:
        logger.info(
            "%s: weights %.1f MiB, KV %.1f MiB; its activations are measured once it is idle",
            engine.name,
            weights / MIB,
            measured.kv_reserved_bytes / MIB,
        )
        return measured
    logger.info(
        "%s: weights %.1f MiB, KV %.1f MiB for %d x %d tokens, prefill step %.1f MiB (measured in %.2f s); MLX limit %.1f MiB",
        engine.name, weights / MIB, measured.kv_reserved_bytes / MIB, engine.reserve_concurrency, engine.reserve_context_tokens,
        measured.activation_bytes / MIB, measured.seconds, limit / MIB,
    )  # fmt: skip
    return measured


def measured_as(known: MeasuredMemory, engine: LoadedEngine, identity: str) -> bool:
    """Whether `known` was measured of the weights `engine` just loaded (their identity:
    prefix_disk.model_identity) under the settings it runs with: then every figure of a new
    measurement would be the same, so a reload runs none of its forward passes again."""
    chunk = engine.prefill_chunk
    return (
        bool(identity)
        and not known.provisional
        and known.weights_hash == identity
        and known.reserve_context_tokens == engine.reserve_context_tokens
        and known.reserve_concurrency == engine.reserve_concurrency
        and known.prefill_chunk == max(1, min(chunk, engine.reserve_context_tokens or 1))
        and known.prefill_rows == max(1, min(engine.max_prefill_tokens // chunk, engine.reserve_concurrency))
        and known.decode_rows == max(engine.max_batch, engine.reserve_concurrency)
        and known.decode_tokens == 1 + drafts(engine)
        and known.prefix_cache_bytes == engine.prompt_cache_bytes
    )


class Interrupted(Exception):
    """A measurement stopped between two of its steps: a request came (`completed`'s `between`)."""


def completed(engine: LoadedEngine, provisional: MeasuredMemory, between: Callable[[], None]) -> MeasuredMemory:
    """The activation passes a `provisional` measurement left out (`loaded`), on the engine's MLX
    thread while it is idle: the whole measurement, the process's limit set from it. `between`
    runs before each pass and raises `Interrupted` to give the thread back to requests (the
    passes run again at the next idle moment)."""
    bits, group = engine.kv_bits, engine.kv_group_size
    quantized = (lambda layers: list(fresh_caches(layers, bits, group))) if bits is not None else None
    unlimited()  # measured as it will run (and as `loaded` measures)
    try:
        measured = _measure_loaded(engine, provisional.weight_bytes, provisional.weights_hash, quantized, provisional.estimated_cache, True, between)
    except BaseException:
        set_limit(id(engine), None)  # the other engines' limits again
        raise
    limit = set_limit(id(engine), measured.limit_bytes)
    logger.info(
        "%s: prefill step %.1f MiB (measured in %.2f s, once idle); MLX limit %.1f MiB",
        engine.name, measured.activation_bytes / MIB, measured.seconds, limit / MIB,
    )  # fmt: skip
    return measured


def _measure_loaded(
    engine: LoadedEngine,
    weights: int,
    identity: str,
    quantized: Callable[[int], list[Any]] | None,
    estimated_cache: CacheShape | None,
    passes: bool = True,
    between: Callable[[], None] = _nothing,
) -> MeasuredMemory:
    chunk = engine.prefill_chunk
    return measure(
        engine.model,
        caches_of(engine.model, make_prompt_cache, quantized),
        weight_bytes=weights,
        vocab=engine.vocab_size,
        reserve_context_tokens=engine.reserve_context_tokens,
        reserve_concurrency=engine.reserve_concurrency,
        prefill_chunk=chunk,
        prefill_rows=max(1, engine.max_prefill_tokens // chunk),
        decode_tokens=1 + drafts(engine),
        decode_rows=engine.max_batch,
        prefix_cache_bytes=engine.prompt_cache_bytes,
        weights_hash=identity,
        estimated_weight_bytes=safetensors_bytes(engine.path) if Path(engine.path).is_dir() else 0,
        estimated_cache=estimated_cache,
        passes=passes,
        between=between,
    )


def drafts(engine: Any) -> int:
    """The draft tokens a speculative verify step runs past a row's length at most (0 without one)."""
    return int(engine.spec_max_drafts) if getattr(engine, "speculator", None) is not None else 0


def kv_budget(measured: MeasuredMemory, context_length: int, overshoot: int = 0) -> KVBudget | None:
    """The KV reservation the engine's batch is held to (M4), its rows at most `context_length`
    tokens each, the batch cache up to `overshoot` positions past its longest row (`drafts`); None
    where the operator reserves no KV (reserve_context_tokens 0)."""
    if not measured.reserve_context_tokens:
        return None
    return KVBudget(
        reserved_bytes=measured.kv_reserved_bytes, context_tokens=context_length, sequence_bytes=measured.sequence_bytes, overshoot=overshoot
    )


def refusal(measured: MeasuredMemory | None, prompt_tokens: int) -> str | None:
    """Why a prompt of `prompt_tokens` cannot run on this instance (None: it can): its own cache
    would pass one sequence's share of the KV this instance reserves, so its prefill could take the
    process past its limit."""
    if measured is None or not measured.reserve_context_tokens or prompt_tokens < measured.longest_sequence():
        return None
    return (
        f"the prompt ({prompt_tokens} tokens) needs {measured.sequence_bytes(prompt_tokens + 1) / MIB:.1f} MiB of KV cache; this instance "
        f"reserves {measured.kv_reserved_bytes / MIB:.1f} MiB for {measured.reserve_concurrency} x {measured.reserve_context_tokens} tokens "
        f"(at most {measured.longest_sequence() - 1} prompt tokens a request) within its memory limit of {measured.limit_bytes / MIB:.1f} MiB"
    )
