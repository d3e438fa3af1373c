"""The LLM engine: mlx-lm's own BatchGenerator driven by one loop on one MLX thread.

Requests join and leave the running batch at any step (continuous batching). The asyncio side only
validates, enqueues and reads deltas. A request's chat template and tokenizing run on the engine's
preparation thread, so the MLX thread does only what needs MLX: every MLX call and KV cache lives on
the engine's worker thread, because MLX streams are thread-local. Arrivals that come while the batch
decodes join it together (`admit_hold_steps`), so their prefill and their merge into the batch are
paid once per group. Deltas of one engine step reach the event loop in one hand-off, whatever the
number of streams. Prompt prefixes are reused across requests through a block tree that stores each
prefix's KV once however many requests share it (prefix_cache.py), or mlx-lm's LRUPromptCache for
models whose caches cannot be cut into blocks."""

import asyncio
import gc
import itertools
import logging
import math
import queue
import secrets
import threading
import time
from collections import deque
from collections.abc import AsyncIterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Protocol, cast

import deployments  # noqa: F401  (OpenBLAS before MLX)

# isort: split
import mlx.core as mx
import mlx_lm
from mlx_lm.generate import BatchGenerator, StopSequences
from mlx_lm.models.cache import LRUPromptCache, can_trim_prompt_cache, make_prompt_cache, trim_prompt_cache
from mlx_lm.sample_utils import make_logits_processors
from mlx_lm.tokenizer_utils import BPEStreamingDetokenizer
from pydantic import Field

from deployments.engine import Engine, Frozen, MemoryReport, RequestError, RequestErrorCode, queued_adds
from deployments.engines import block_rows, buffer_cache, prefix_disk
from deployments.engines.chat_format import chat_inputs, template_kwargs_error, template_supports_tools
from deployments.engines.constrained import GrammarCompiler, GrammarProcessor
from deployments.engines.options import LLMEngineOptions
from deployments.engines.prefix_cache import PrefixCache, sliceable
from deployments.engines.prefix_disk import DiskTier
from deployments.engines.quantized_cache import KV_BITS, KV_GROUP_SIZES, fresh_caches, quantizable
from deployments.engines.sampling import BatchSampler, RowSampling
from deployments.engines.text_stream import StopStringFilter
from deployments.estimate import kv_bytes_per_token
from deployments.manifest import safetensors_bytes
from deployments.wire.generation import FinishReason, GenerationRequest
from deployments.worker import MLXWorker

logger = logging.getLogger(__name__)

DISK_FLUSH_S = 5.0  # a stopping engine waits at most this long for its blocks to reach the disk tier


class TokenLogprob(Frozen):
    token_id: int
    token: str
    logprob: float
    top: list[tuple[int, str, float]] = Field(default_factory=list)


class Usage(Frozen):
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


class Delta(Frozen):
    """A piece of one stream. The last one has finish_reason and usage set."""

    text: str = ""
    token_ids: list[int] = Field(default_factory=list)
    logprobs: list[TokenLogprob] | None = None
    finish_reason: FinishReason | None = None
    usage: Usage | None = None
    error: str | None = None
    error_code: str | None = None
    error_param: str | None = None  # the request field at fault, when one is
    stop_sequence: str | None = None  # the stop string that ended the stream (None for EOS / length)


class DeltaSink(Protocol):
    """Where a started request's deltas go (an asyncio.Queue is one)."""

    def put_nowait(self, delta: Delta) -> None: ...


@dataclass(eq=False)
class _Stream:
    """Worker-thread state of one running request."""

    request: GenerationRequest
    tokens: list[int]
    loop: asyncio.AbstractEventLoop
    out: DeltaSink
    detokenizer: Any
    stops: Any
    grammar: GrammarProcessor | None = None
    uid: int = -1
    cached: int = 0
    completion: int = 0
    pending: list[Delta] = field(default_factory=list)
    started: float = 0.0  # time.monotonic() at start(): the engine's own time to first token
    answered: bool = False  # its first token is out
    joined_step: int = 0  # the engine's step count when it joined the batch


@dataclass(eq=False)
class _Arrival:
    """A request tokenized and checked on the preparation thread, waiting to join the batch."""

    rid: int
    request: GenerationRequest
    tokens: list[int]
    loop: asyncio.AbstractEventLoop
    out: DeltaSink
    grammar: GrammarProcessor | None
    started: float = 0.0  # time.monotonic() at start()
    prepared: float = 0.0  # ... when the preparation thread handed it to the MLX thread
    step: int = 0  # the engine's step count when it reached the MLX thread


class LLMEngine(Engine):
    kind = "llm"

    def __init__(
        self,
        name: str,
        path: str,
        *,
        max_batch: int = 64,
        prefill_batch: int = 32,
        prefill_step: int = 2048,
        prefill_chunk_tokens: int = 512,
        prefill_decode_steps: int = 0,
        context_length: int | None = None,
        prompt_cache_entries: int = 16,  # 0: no prefix reuse; else the LRU cache's entries
        prompt_cache_bytes: int = 512 * 2**20,  # the prefix cache's byte budget (either kind)
        prefix_cache: str = "blocks",  # "blocks": shared blocks (prefix_cache.py); "lru": mlx-lm's LRUPromptCache
        prefix_block_tokens: int = 128,
        prefix_disk_bytes: int = 16 * 2**30,  # the disk tier (prefix_disk.py), where a folder is given or the node names a store
        prefix_disk_dir: str | None = None,
        share_prefill: bool = True,
        prefill_pad_ratio: float = 2.0,
        prefill_align: bool = True,
        reserve_context_tokens: int = 4096,
        reserve_concurrency: int = 1,
        admit_hold_steps: int = 4,  # these five: the served defaults (deployments/engines/options.py)
        admit_quiet_steps: int = 1,
        admit_hold_min_rows: int = 0,
        max_prefill_tokens: int = 1024,
        prompt_cache_min_tokens: int = 256,
        prefill_cache_keep_mib: int | None = None,
        kv_bits: int | None = None,  # a quantized KV cache (quantized_cache.py): 8 or 4 bits, None: the model's dtype
        kv_group_size: int = 64,
    ):
        super().__init__(name, path)
        if kv_bits is not None and kv_bits not in KV_BITS:
            raise ValueError(f"kv_bits must be one of {KV_BITS} (or None), not {kv_bits}")
        if kv_group_size not in KV_GROUP_SIZES:
            raise ValueError(f"kv_group_size must be one of {KV_GROUP_SIZES}, not {kv_group_size}")
        self.kv_bits, self.kv_group_size = kv_bits, kv_group_size
        self.max_batch = max_batch
        self.prefill_batch = min(prefill_batch, max_batch)  # a group never exceeds the batch
        self.prefill_step = prefill_step
        # Each prefilling row runs at most this many prompt tokens per step: mlx-lm's BatchGenerator
        # decodes the batch, then prefills one slice of every pending prompt, each next(); with its
        # slice at 2048 a 3,000-token prompt stalls every decoding stream for a 2,048-token forward.
        if prefill_chunk_tokens < 1:
            raise ValueError(f"prefill_chunk_tokens must be at least 1, not {prefill_chunk_tokens}")
        self.prefill_chunk_tokens = prefill_chunk_tokens
        # ... and after a chunk, while other rows decode, this many steps decode only (a chunk costs
        # several decode steps on a small batch: without these, every step of a long prefill does)
        if prefill_decode_steps < 0:
            raise ValueError(f"prefill_decode_steps must not be negative, not {prefill_decode_steps}")
        self.prefill_decode_steps = prefill_decode_steps
        self._decode_only = prefill_decode_steps  # decode-only steps since the last chunk (MLX thread)
        self._context_length = context_length
        self._prompt_cache_entries = prompt_cache_entries
        self.prompt_cache_bytes = prompt_cache_bytes
        if prefix_cache not in ("blocks", "lru"):
            raise ValueError(f"prefix_cache must be 'blocks' or 'lru', not {prefix_cache!r}")
        if prefix_block_tokens < 1:
            raise ValueError(f"prefix_block_tokens must be at least 1, not {prefix_block_tokens}")
        self.prefix_cache = prefix_cache  # what was asked; prefix_cache_kind: what the model allows
        self.prefix_block_tokens = prefix_block_tokens
        if prefix_disk_bytes < 0:
            raise ValueError(f"prefix_disk_bytes must not be negative, not {prefix_disk_bytes}")
        self.prefix_disk_bytes, self.prefix_disk_dir = prefix_disk_bytes, prefix_disk_dir
        self.disk: DiskTier | None = None
        self.prefix_cache_kind = prefix_cache
        # With the block cache: a prompt's KV is kept once it is prefilled (not only when its request
        # ends), and an arrival that begins like a prompt still being prefilled waits for it (a step
        # or two) and reuses its blocks instead of prefilling the same tokens beside it.
        self.share_prefill = share_prefill
        # mlx-lm prefills a group as one right-padded batch: every row costs the longest row's
        # uncached tokens. With the block cache a group is cut where that padding would make it cost
        # more than this many times its rows' own tokens, and by more than prompt_cache_min_tokens
        # (the oldest arrival always joins; 0: no cut), so a request whose history is cached does
        # not prefill at the pace of a new conversation beside it; the rest join the next group, a
        # step later.
        self.prefill_pad_ratio = prefill_pad_ratio
        # With the block cache, a group's rows take from it only as much as leaves each the same
        # number of tokens to prefill (the group's longest uncached prompt, when that fits one
        # prefill chunk; a row whose cached prefix would drop below prompt_cache_min_tokens keeps
        # its own): the tokens a shorter row gives back are the ones mlx-lm would otherwise run as
        # right padding, and with no padding its prefill skips rolling every row's whole cache into
        # place afterwards (a gather over all of the group's KV, per layer; bench.engine.forward_shapes
        # --replay times both).
        self.prefill_align = prefill_align
        self.reserve_context_tokens = reserve_context_tokens
        self.reserve_concurrency = reserve_concurrency
        # While the batch decodes, an arrival waits up to this many steps for others to join it
        # (or until a prefill group of `prefill_batch` is full); an idle batch admits at once.
        self.admit_hold_steps = admit_hold_steps
        # ... but not once arrivals have stopped: no arrival for this many steps ends the wait.
        self.admit_quiet_steps = admit_quiet_steps
        # ... and only while at least this many rows decode: a smaller batch loses little to a
        # prefill of its own, so its arrivals join at the next step (0: whenever the batch is busy).
        self.admit_hold_min_rows = admit_hold_min_rows
        self._last_arrival = 0  # the step count when the last arrival reached the MLX thread
        # Prompt tokens admitted and not yet through prefill, at most (one longer prompt alone may
        # exceed it): a group of 32 long prompts would otherwise prefill 32 x prefill_step tokens in
        # one step, stalling every stream and spiking memory, and every first token of the group would
        # wait for all of it (options.py says why 1,024).
        self.max_prefill_tokens = max_prefill_tokens
        self._prefilling: dict[int, int] = {}  # request id -> prompt tokens it still prefills (MLX thread)
        self._due = False  # held arrivals of a group already let in, waiting only for prefill room
        # groups admitted into the batch, and where a request's first token waits inside the engine:
        # from start() to joining the batch (preparation and hold), and to its first token
        # (admit_prep_s: the part of admit_wait_s before the MLX thread had it: templating, tokenizing;
        # held_steps: the engine's steps from arriving in the MLX thread to joining, the hold's own cost;
        # join_steps: the engine's steps from joining to the first token), and how long a request
        # that ran to its end spent inside the engine, from start() to its last delta's hand-off
        # (a client's time per request less this is the path's, both ways)
        self._admitted = {
            "admitted_groups": 0,
            "admitted_requests": 0,
            "admit_wait_s": 0.0,
            "admit_prep_s": 0.0,
            "first_token_s": 0.0,
            "first_tokens": 0,
            "held_steps": 0,
            "join_steps": 0,
            "finished_s": 0.0,
            "finished_requests": 0,
            "handoff_s": 0.0,  # a step's deltas waiting for the caller's event loop to run them
            "handoffs": 0,
            # uncached prompt tokens of the groups admitted, and what their right-padded prefill
            # runs (rows x the longest row's), so the padding a group's prefill wastes shows
            "group_prompt_tokens": 0,
            "group_padded_tokens": 0,
            # cached tokens a group's rows gave back to prefill alike (prefill_align), and the rows
            # that still prefilled ragged (mlx-lm right-pads them and rolls the group's caches)
            "aligned_tokens": 0,
            "ragged_rows": 0,
        }
        self._steps = 0
        # A prefix is kept (a finished request's prompt + completion) and reused only from this
        # many tokens: reusing one copies the cached KV (all of it) and merges a ragged cache into
        # the batch, and keeping one holds its KV; both cost more than prefilling a short prefix
        # such as a chat template's header again (docs/serve-path.md).
        self.prompt_cache_min_tokens = prompt_cache_min_tokens
        # MLX buffer cache kept through mlx-lm's prefill (None: the KV reservation; buffer_cache.py)
        self.prefill_cache_keep_mib = prefill_cache_keep_mib
        self._prep: ThreadPoolExecutor | None = None  # templating and tokenizing, in arrival order
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._streams: dict[int, _Stream] = {}
        self._ids = itertools.count()
        self._worker: MLXWorker | None = None
        self._loop_done: Any = None
        self._stopping = threading.Event()
        self._retired_counters: dict[str, float] = {}  # of generators replaced after a broken step
        # Every row's one sampler: the batch is sampled in one call whatever its rows' settings (MLX thread)
        self.sampling = BatchSampler()
        self._arriving = 0  # started, not yet in the batch (being prepared or held); under _arriving_lock
        self._arriving_lock = threading.Lock()  # three threads change it: the caller's, preparation, MLX
        self._held: deque[_Arrival] = deque()  # prepared arrivals waiting to join the batch (MLX thread)

    # ---- lifecycle -------------------------------------------------------------------------
    async def _load(self) -> None:
        self._worker = MLXWorker(self.name)
        await self._worker.run(self._load_on_worker)
        self._prep = ThreadPoolExecutor(1, thread_name_prefix=f"prep-{self.name}")
        self._loop_done = self._worker.submit(self._run_loop)

    def _load_on_worker(self) -> None:
        self.model, self.tokenizer, config = mlx_lm.load(self.path, return_config=True)  # type: ignore[misc]  # a 3-tuple with return_config
        self.weight_bytes = safetensors_bytes(self.path)
        self.context_length = self._context_length or int(config.get("max_position_embeddings") or 4096)
        self.kv_bytes_per_token = kv_bytes_per_token(config, kv_bits=self.kv_bits, kv_group_size=self.kv_group_size)
        self._layers = len(make_prompt_cache(self.model))
        if self.kv_bits is not None:
            self._check_quantizable(config)
        buffer_cache.keep(self, self.cache_keep_bytes())
        self.eos_ids = sorted(self.tokenizer.eos_token_ids)
        self.vocab_size = _logits_width(self.model, self.tokenizer)
        self.prompt_cache = self._new_prompt_cache()
        hf_tokenizer = self.tokenizer._tokenizer
        self.grammars = GrammarCompiler(hf_tokenizer, self.eos_ids, self.vocab_size)
        # mlx-lm's own renderers (a Python chat template) take tools; a Jinja one must name them
        self.template_knows_tools = getattr(self.tokenizer, "_chat_template", None) is not None or template_supports_tools(
            getattr(hf_tokenizer, "chat_template", None)
        )
        self.generator = self._new_generator()

    def _check_quantizable(self, config: dict) -> None:
        """kv_bits is refused at load, with the reason, for a model whose cache is not plain KV in
        every layer (a sliding window's or an SSM's cache has no batched quantized form here) or
        whose head dimension the group size does not divide (mx.quantize's groups)."""
        layers = make_prompt_cache(self.model)
        kinds = sorted({type(c).__name__ for c in layers})
        if not quantizable(layers):
            raise ValueError(f"kv_bits needs a plain KV cache in every layer; {self.name}'s layers use {', '.join(kinds)}")
        text = config.get("text_config") or config
        head_dim = text.get("head_dim") or text["hidden_size"] // text["num_attention_heads"]
        if head_dim % self.kv_group_size:
            raise ValueError(f"kv_group_size {self.kv_group_size} does not divide {self.name}'s head dimension {head_dim}")

    def _new_prompt_cache(self) -> PrefixCache | LRUPromptCache:
        """Shared blocks when every layer's cache is a plain KVCache; otherwise (a sliding window,
        an SSM's state: not a prefix that can be cut) mlx-lm's whole-entry LRUPromptCache."""
        self.prefix_cache_kind = self.prefix_cache
        if self.prefix_cache == "blocks" and not sliceable(make_prompt_cache(self.model)):
            logger.info("%s: its KV cache cannot be cut into blocks; prefixes are reused whole (LRUPromptCache)", self.name)
            self.prefix_cache_kind = "lru"
        if self.prefix_cache_kind == "blocks":
            self.disk = self._disk_tier()
            return PrefixCache(
                block_tokens=self.prefix_block_tokens,
                max_bytes=self.prompt_cache_bytes,
                kv_bits=self.kv_bits,
                kv_group_size=self.kv_group_size,
                disk=self.disk,
            )
        return LRUPromptCache(max_size=max(1, self._prompt_cache_entries), max_bytes=self.prompt_cache_bytes)

    def _disk_tier(self) -> DiskTier | None:
        """The block cache's disk tier, where a budget and a folder are given (prefix_disk.py)."""
        root = Path(self.prefix_disk_dir).expanduser() if self.prefix_disk_dir else prefix_disk.default_dir()
        if not self.prefix_disk_bytes or root is None or not Path(self.path).is_dir():
            return None
        identity = prefix_disk.model_identity(self.path, self.kv_bits, self.kv_group_size, self.prefix_block_tokens, "")
        try:
            tier = DiskTier(root, identity, self.prefix_disk_bytes)
        except OSError as e:  # an unwritable folder: the memory cache alone
            logger.warning("%s: no prefix disk tier at %s: %s", self.name, root, e)
            return None
        tier.prefill_rate = self._prefill_rate
        return tier

    def _prefill_rate(self) -> float:
        """Prompt tokens a second, as mlx-lm measured this engine's prefills (0 before any)."""
        counted = self.counters()
        tokens, seconds = counted.get("prompt_tokens", 0), counted.get("prompt_time", 0.0)
        return tokens / seconds if tokens > 0 and seconds > 0 else 0.0

    @property
    def _prefill_chunk(self) -> int:
        """The prompt tokens a prefilling row runs in one step (mlx-lm's prefill_step_size)."""
        return min(self.prefill_step, self.prefill_chunk_tokens)

    def _new_generator(self) -> BatchGenerator:
        old = getattr(self, "generator", None)
        if old is not None:
            self._retired_counters = self.counters()
        return BatchGenerator(
            self.model,
            stop_tokens=[[t] for t in self.eos_ids],
            completion_batch_size=self.max_batch,
            prefill_batch_size=self.prefill_batch,
            prefill_step_size=self._prefill_chunk,
            stream=mx.default_stream(mx.default_device()),
        )

    async def _stop(self) -> None:
        if self._prep is not None:  # what it is preparing reaches the loop, which answers it
            await asyncio.to_thread(self._prep.shutdown, True)
        self._stopping.set()
        self._commands.put(("wake", None))
        if self._loop_done is not None:
            await asyncio.wrap_future(self._loop_done)
        if self._worker is not None:
            self._worker.shutdown()

    def running_requests(self) -> int:
        return len(self._streams) + self._arriving

    def cache_keep_bytes(self) -> int:
        """How much of MLX's buffer cache this engine keeps through mlx-lm's prefill (buffer_cache.py):
        prefill_cache_keep_mib, or by default its KV reservation, which the residency policy counts."""
        if self.prefill_cache_keep_mib is not None:
            return self.prefill_cache_keep_mib * 2**20
        return self.kv_bytes_per_token * self.reserve_context_tokens * self.reserve_concurrency

    def scheduling(self) -> dict[str, bool | int | float | str | None]:
        """The admission settings this engine runs with (deployments/engines/options.py's fields)."""
        return {name: getattr(self, name) for name in LLMEngineOptions.model_fields}

    def counters(self) -> dict[str, float]:
        """mlx-lm's own BatchGenerator counters (prompt_tokens, prompt_time, generation_tokens,
        generation_steps, decode_time), summed over the generators this engine made: they only
        grow, so two readings give the rows per step and the time per step of a window."""
        generator = getattr(self, "generator", None)
        now = asdict(generator._counters) if generator is not None else {}
        mlx_lm_counters = {k: self._retired_counters.get(k, 0) + v for k, v in now.items()} or dict(self._retired_counters)
        sampling = {"sampling_calls": self.sampling.calls, "sampled_rows": self.sampling.rows_sampled}  # one call per batch stepped
        cache = getattr(self, "prompt_cache", None)
        prefix = dict(cache.stats) if isinstance(cache, PrefixCache) else {}  # lookups, hits, tokens given back, blocks made / evicted
        if self.disk is not None:
            prefix |= self.disk.stats  # blocks written, restored, refused
        return mlx_lm_counters | self._admitted | sampling | prefix  # and the engine's own: groups admitted into the batch

    def memory(self) -> MemoryReport:
        generator = getattr(self, "generator", None)
        kept = self.prompt_cache.nbytes if generator is not None else 0  # within prompt_cache_bytes; shrink_prefix_cache
        return MemoryReport(
            weight_bytes=getattr(self, "weight_bytes", 0),
            kv_bytes_in_use=generator.prompt_cache_nbytes if generator is not None else 0,
            prefix_cache_bytes=kept,
            prefix_prefill_s=self._prefill_seconds(kept),
            kv_bytes_reserved=getattr(self, "kv_bytes_per_token", 0) * self.reserve_context_tokens * self.reserve_concurrency,
            active_bytes=mx.get_active_memory(),
            peak_bytes=mx.get_peak_memory(),
            load_seconds=self._load_seconds,
        )

    def _prefill_seconds(self, kept_bytes: int) -> float:
        """Seconds the kept prefixes would cost again: read back from the disk tier where that beats a
        prefill, else their tokens prefilled at the rate mlx-lm measured here (0 before any prefill)."""
        if self.disk is not None and self.disk.worth_reading():
            return kept_bytes / self.disk.read_bytes_per_s()
        per_token, rate = getattr(self, "kv_bytes_per_token", 0), self._prefill_rate()
        return kept_bytes / per_token / rate if kept_bytes and per_token and rate else 0.0

    async def shrink_prefix_cache(self, target_bytes: int) -> int:
        """Evict kept prefixes, least recently used first, until the prefix cache holds at most
        `target_bytes`; returns the bytes freed (handed back to the device past what the engine keeps
        cached). What an instance gives back before a model is evicted for room. Runs on the MLX
        thread between steps; running requests keep their own KV."""
        if target_bytes < 0:
            raise ValueError(f"target_bytes must not be negative, not {target_bytes}")
        self._check_ready()
        done: Future[int] = Future()
        self._commands.put(("shrink", (target_bytes, done)))
        return await asyncio.wrap_future(done)

    def _shrink(self, target_bytes: int) -> int:
        cache = self.prompt_cache
        before = cache.nbytes
        if isinstance(cache, PrefixCache):
            cache.shrink(target_bytes)
        else:
            cache.trim_to(n_bytes=target_bytes)
        freed = before - cache.nbytes
        if freed:
            buffer_cache.clear_past_keep()
        return freed

    # ---- the request API (event loop side) --------------------------------------------------
    async def generate(self, request: GenerationRequest) -> AsyncIterator[Delta]:
        """Stream the deltas of one request. Closing the iterator early cancels the request and
        frees its KV cache at once. A constraint whose grammar does not compile raises
        RequestError(invalid_request, param response_format) before any output."""
        grammar = await self.compile(request)
        out: asyncio.Queue[Delta] = asyncio.Queue()
        request_id = self.start(request, out, grammar)
        finished = False
        try:
            while True:
                delta = await out.get()
                finished = delta.finish_reason is not None
                yield delta
                if finished:
                    return
        finally:
            if not finished:
                self.cancel(request_id)

    async def compile(self, request: GenerationRequest) -> GrammarProcessor | None:
        """The grammar of `request.constraint` (None without one), compiled off the event loop and
        off the MLX thread, whose steps serve every stream; RequestError when it does not compile."""
        self._check_ready()
        if request.constraint is None:
            return None
        return await asyncio.to_thread(self.grammars.compile, request.constraint)

    def start(self, request: GenerationRequest, sink: DeltaSink, grammar: GrammarProcessor | None = None) -> int:
        """Start a request whose deltas go to `sink.put_nowait` on the calling event loop, in order,
        the last one with a finish_reason (a failed admission: one error delta). One thread-safe
        call per step carries every delta that loop gets, so a server that fans many requests into
        one outbox (ModelServer's channels) needs no task or queue per request. Returns the id
        that `cancel` takes. `grammar`: from `compile`, required when the request has a constraint."""
        self._check_ready()
        self.check(request)
        if request.constraint is not None and grammar is None:
            raise RequestError("internal", "a constrained request starts with the grammar from compile()")
        request_id = next(self._ids)
        assert self._prep is not None  # ready means loaded
        self._arrived(1)
        self._prep.submit(self._prepare, request_id, request, asyncio.get_running_loop(), sink, grammar, time.monotonic())
        return request_id

    def check(self, request: GenerationRequest) -> None:
        """Refuse, before anything reaches the tokenizer or MLX, what only this model can judge: a
        token id outside its vocabulary (`logit_bias` keys, a token-id prompt: MLX does not check an
        index, and one past the logits row writes or reads out of bounds, or segfaults the process)
        and chat_template_kwargs that are not template variables (chat_format.TEMPLATE_VARIABLES)."""
        vocab = self.vocab_size
        for param, ids in (("logit_bias", request.logit_bias or ()), ("prompt", request.prompt_tokens or ())):
            bad = next((t for t in ids if not 0 <= t < vocab), None)
            if bad is not None:
                raise RequestError(
                    "invalid_request", f"token id {bad} in {param} is outside the vocabulary of model {self.name} (ids 0 to {vocab - 1})", param
                )
        refused = template_kwargs_error(request.chat_template_kwargs)
        if refused is not None:
            name, why = refused
            raise RequestError("invalid_request", why, f"chat_template_kwargs.{name}" if name else "chat_template_kwargs")

    def cancel(self, request_id: int) -> None:
        """Stop a started request: its KV cache is freed at once and a `cancelled` delta ends it
        (nothing happens for one that already ended). Sent through the preparation thread, so it
        reaches the MLX thread after its request did."""
        prep = self._prep
        try:
            if prep is None:
                raise RuntimeError("not loaded")
            prep.submit(self._commands.put, ("cancel", request_id))
        except RuntimeError:  # stopping: the preparation thread is shut; the loop still answers
            self._commands.put(("cancel", request_id))

    async def complete(self, request: GenerationRequest) -> Delta:
        """The whole completion as one Delta (text, tokens, finish reason, usage)."""
        text, tokens, logprobs, last = [], [], [], Delta()
        async for delta in self.generate(request):
            text.append(delta.text)
            tokens.extend(delta.token_ids)
            logprobs.extend(delta.logprobs or [])
            last = delta
        if last.finish_reason == "error":
            raise RequestError(cast(RequestErrorCode, last.error_code or "internal"), last.error or "generation failed")
        return Delta(
            text="".join(text),
            token_ids=tokens,
            logprobs=logprobs if request.logprobs else None,
            finish_reason=last.finish_reason,
            usage=last.usage,
            stop_sequence=last.stop_sequence,
        )

    # ---- the loop (worker thread) ----------------------------------------------------------
    def _run_loop(self) -> None:
        streams: dict[int, _Stream] = {}  # by request id
        try:
            self._serve(streams)
        except Exception as e:  # a bug here must surface in health, and no stream may hang
            self._status, self._detail = "failed", f"engine loop crashed: {type(e).__name__}: {e}"
            for stream in streams.values():
                self._finish(stream, "error", error=self._detail, code="internal")
            _hand_off(list(streams.values()))
            self._answer_unadmitted()
            raise
        leftovers = list(streams.values())
        for stream in leftovers:
            self._finish(stream, "cancelled", error="engine stopped", code="engine_stopped")
        _hand_off(leftovers)
        self._answer_unadmitted()
        self._streams = {}
        self._release_on_worker()

    def _answer_unadmitted(self) -> None:
        """Arrivals that never joined the batch (held, or queued when the loop stopped) end too."""
        stopped = Delta(finish_reason="cancelled", error="engine stopped", error_code="engine_stopped")
        arrivals = [*self._held, *queued_adds(self._commands)]
        self._held.clear()
        for arrival in arrivals:
            self._arrived(-1)
            _put(arrival.loop, [(arrival.out, stopped)])

    def _release_on_worker(self) -> None:
        """Drop the model, batch and caches on the thread whose stream made them (as mlx-lm's
        server does): arrays still being computed there must not outlive it."""
        mx.synchronize()
        self._retired_counters = self.counters()
        del self.generator
        buffer_cache.release(self)
        self.sampling.clear()
        if self.disk is not None:  # what is still queued for the disk goes there before the process ends
            self.disk.flush(DISK_FLUSH_S)
            self.disk.close()
        self.prompt_cache = LRUPromptCache(max_size=1)  # the kept KV is freed here, on the thread that made it
        self.model = None
        gc.collect()
        mx.clear_cache()

    def _serve(self, streams: dict[int, _Stream]) -> None:
        by_uid: dict[int, int] = {}  # generator uid -> request id
        while not self._stopping.is_set():
            outbox: list[_Stream] = []
            try:
                command = self._commands.get(block=not by_uid and not self._held)
                self._handle(command, streams, by_uid, outbox)
                while True:
                    self._handle(self._commands.get_nowait(), streams, by_uid, outbox)
            except queue.Empty:
                pass
            if self._held and self._admit_now(busy=len(by_uid) >= max(1, self.admit_hold_min_rows)):
                self._admit_held(streams, by_uid, outbox)
            self._streams = streams
            if by_uid:
                self._step(streams, by_uid, outbox)
                self._steps += 1
            _hand_off(outbox, self._admitted)

    def _admit_now(self, busy: bool) -> bool:
        """Whether the held arrivals join the batch now: at once when it is idle, else when they
        fill a prefill group, the oldest has waited admit_hold_steps steps, or none has arrived for
        admit_quiet_steps steps (waiting longer would not grow the group)."""
        if not busy or self._due or len(self._held) >= self.prefill_batch:
            return True
        return self._steps - self._held[0].step >= self.admit_hold_steps or self._steps - self._last_arrival >= self.admit_quiet_steps

    def _admit_held(self, streams: dict[int, _Stream], by_uid: dict[int, int], outbox: list[_Stream]) -> None:
        """The held arrivals into the batch, in order, as far as max_prefill_tokens allows (the
        rest wait for the prefills in flight to finish): the group is chosen first, then its rows
        are admitted, aligned (prefill_align)."""
        prefilling = sum(self._prefilling.values())
        joined, now = 0, time.monotonic()
        widest = useful = 0  # the group's longest and total uncached prompt tokens
        later: list[_Arrival] = []  # left for a later group, ahead of the rest
        blocks = self.prompt_cache if isinstance(self.prompt_cache, PrefixCache) and self._prompt_cache_entries > 0 else None
        cut = blocks is not None and self.prefill_pad_ratio > 0
        group: list[_Arrival] = []
        matched: dict[int, int] = {}  # request id -> the tokens the cache holds of it
        while self._held:
            arrival = self._held[0]
            rest = len(arrival.tokens)
            if blocks is not None:
                blocks.restore(arrival.tokens)  # what the disk tier has of it, first (prefix_disk.py)
                cached = matched[arrival.rid] = blocks.match(arrival.tokens)
                rest -= cached if cached >= self.prompt_cache_min_tokens else 0
                if self.share_prefill and self._prefilled_beside(arrival.tokens, cached, streams, group):
                    later.append(self._held.popleft())
                    continue
            if prefilling and prefilling + rest > self.max_prefill_tokens:
                break  # the rest of this group joins as soon as there is room: it waits no more
            padded = max(widest, rest) * (joined + 1)  # what the group's prefill would run with this one
            if cut and joined and padded > self.prefill_pad_ratio * (useful + rest) and padded - useful - rest > self.prompt_cache_min_tokens:
                later.append(self._held.popleft())
                continue

            self._held.popleft()
            group.append(arrival)
            prefilling += rest
            widest, useful = max(widest, rest), useful + rest
            joined += 1
        self._held.extendleft(reversed(later))
        self._due = bool(self._held)
        # rows align only within one prefill chunk: past it, mlx-lm gives a shorter row its first
        # token as soon as its own tokens are through, chunks before the longest's
        align = max(1, widest) if blocks is not None and self.prefill_align and joined > 1 and widest <= self._prefill_chunk else None
        for arrival in group:
            self._arrived(-1)
            try:
                stream = self._admit(arrival, align)
            except Exception as e:
                _put(arrival.loop, [(arrival.out, _failure(e))])
                continue
            stream.started, stream.joined_step = arrival.started, self._steps
            self._admitted["held_steps"] += self._steps - arrival.step
            self._admitted["admit_wait_s"] += now - arrival.started
            self._admitted["admit_prep_s"] += arrival.prepared - arrival.started
            streams[arrival.rid] = stream
            by_uid[stream.uid] = arrival.rid
            self._prefilling[arrival.rid] = len(arrival.tokens) - stream.cached
            if align is not None:
                self._admitted["ragged_rows"] += self._prefilling[arrival.rid] != align
                # what the row would have reused unaligned (at least one token is left to prefill)
                alone = min(matched[arrival.rid], len(arrival.tokens) - 1)
                self._admitted["aligned_tokens"] += max(0, alone - stream.cached) if alone >= self.prompt_cache_min_tokens else 0
        if joined:
            self._admitted["admitted_groups"] += 1
            self._admitted["admitted_requests"] += joined
            self._admitted["group_prompt_tokens"] += useful
            self._admitted["group_padded_tokens"] += widest * joined

    def _prefilled_beside(self, tokens: list[int], cached: int, streams: dict[int, _Stream], group: list[_Arrival]) -> bool:
        """Whether a prompt being prefilled now, or joining the group being formed, shares at least
        a block of `tokens` past what the cache holds: then waiting for its blocks costs a step or
        two, prefilling them again far more."""
        size = self.prefix_block_tokens
        if len(tokens) - cached <= size:
            return False
        ahead = tokens[cached : cached + size]
        for rid in self._prefilling:
            stream = streams.get(rid)
            if stream is not None and stream.tokens[cached : cached + size] == ahead:
                return True
        return any(a.tokens[cached : cached + size] == ahead for a in group)

    def _worth_keeping(self, stream: _Stream) -> bool:
        """A prompt is kept at its first token when it is long enough to be kept at all and adds at
        least a block to what the cache gave it."""
        if not isinstance(self.prompt_cache, PrefixCache) or self._prompt_cache_entries <= 0:
            return False
        return len(stream.tokens) >= self.prompt_cache_min_tokens and len(stream.tokens) - stream.cached >= self.prefix_block_tokens

    def _keep_prompts(self, uids: list[int]) -> None:
        """The prompts of rows that just made their first token into the block cache (only the blocks
        it lacks are copied), so arrivals that begin alike reuse them while these rows still decode."""
        cache = self.prompt_cache
        if not uids or not isinstance(cache, PrefixCache):
            return
        for layers, tokens in self.generator.extract_cache(uids).values():
            cache.insert(tokens, layers)

    def _prefill_now(self, by_uid: dict[int, int]) -> bool:
        """Whether this step prefills a chunk: always when no row decodes or none prefills, else once
        prefill_decode_steps steps have only decoded since the last chunk."""
        decoding = len(by_uid) > len(self._prefilling)
        if not self._prefilling or not decoding or self._decode_only >= self.prefill_decode_steps:
            self._decode_only = 0 if self._prefilling else self.prefill_decode_steps
            return True
        self._decode_only += 1
        return False

    def _step(self, streams: dict[int, _Stream], by_uid: dict[int, int], outbox: list[_Stream]) -> None:
        """One BatchGenerator step for every running request."""
        chunk = self.generator.prefill_step_size
        if not self._prefill_now(by_uid):
            self.generator.prefill_step_size = 0  # mlx-lm slices no prompt tokens: this step only decodes
        try:
            _, responses = self.generator.next()
            self.generator.prefill_step_size = chunk
        except Exception as e:  # a broken step must not kill the engine: fail this batch, go on
            logger.error("a batch step failed; its %d requests end with an error", len(streams), exc_info=e)
            for running in list(streams):
                stream = streams.pop(running)
                self._finish(stream, "error", error=f"{type(e).__name__}: {e}", code="internal")
                outbox.append(stream)
            by_uid.clear()
            self._prefilling.clear()
            self.generator = self._new_generator()
            self.sampling.clear()
            _reseed_rng()  # a compiled function that raised in its trace left a tracer in mx.random.state
            return
        now = time.monotonic()
        prefilled: list[int] = []  # rows whose prompts are worth keeping now
        for r in responses:
            rid = by_uid.get(r.uid)
            if rid is None:
                continue
            self._prefilling.pop(rid, None)  # its first token: its prefill is done
            stream = streams[rid]
            if not stream.answered:
                if self.share_prefill and r.finish_reason is None and self._worth_keeping(stream):
                    prefilled.append(r.uid)
                stream.answered = True
                self._admitted["first_token_s"] += now - stream.started
                self._admitted["first_tokens"] += 1
                self._admitted["join_steps"] += self._steps - stream.joined_step
            outbox.append(stream)
            if not self._advance(stream, r):
                continue
            by_uid.pop(r.uid)
            streams.pop(rid)
            self.sampling.discard(r.uid)
            self._admitted["finished_s"] += now - stream.started
            self._admitted["finished_requests"] += 1
            if r.finish_reason is None:  # cut by a stop string: still in the batch
                self.generator.remove([r.uid])
            elif r.prompt_cache is not None and self._prompt_cache_entries > 0 and len(r.all_tokens) >= self.prompt_cache_min_tokens:
                if isinstance(self.prompt_cache, PrefixCache):
                    self.prompt_cache.insert(r.all_tokens, r.prompt_cache)  # copies only the blocks it lacks
                else:
                    self.prompt_cache.insert_cache(self.name, r.all_tokens[:], r.prompt_cache, cache_type="assistant")
        self._keep_prompts(prefilled)

    def _handle(self, command: tuple[str, Any], streams: dict[int, _Stream], by_uid: dict[int, int], outbox: list[_Stream]) -> None:
        kind, payload = command
        if kind == "add":
            payload.step = self._last_arrival = self._steps
            self._held.append(payload)
        elif kind == "shrink":
            target, done = payload
            try:
                done.set_result(self._shrink(target))
            except Exception as e:  # the caller gets it; the loop goes on
                done.set_exception(e)
        elif kind == "cancel":
            held = next((a for a in self._held if a.rid == payload), None)
            if held is not None:  # not in the batch yet: nothing to free
                self._held.remove(held)
                self._due = self._due and bool(self._held)
                self._arrived(-1)
                _put(held.loop, [(held.out, Delta(finish_reason="cancelled", usage=Usage(prompt_tokens=len(held.tokens), completion_tokens=0)))])
                return
            cancelled = streams.pop(payload, None)
            self._prefilling.pop(payload, None)
            if cancelled is not None:
                by_uid.pop(cancelled.uid, None)
                self.generator.remove([cancelled.uid])  # drops its KV cache now
                self.sampling.discard(cancelled.uid)
                mx.synchronize()
                self._finish(cancelled, "cancelled")
                outbox.append(cancelled)

    def _prepare(
        self,
        rid: int,
        request: GenerationRequest,
        loop: asyncio.AbstractEventLoop,
        out: DeltaSink,
        grammar: GrammarProcessor | None,
        started: float,
    ) -> None:
        """On the preparation thread: template, tokenize and check a request, then hand it to the
        MLX thread; a request that fails here gets its one error delta from here."""
        try:
            tokens = self._checked_tokens(request)
        except Exception as e:
            self._arrived(-1)
            _put(loop, [(out, _failure(e))])
            return
        self._commands.put(("add", _Arrival(rid, request, tokens, loop, out, grammar, started, prepared=time.monotonic())))

    def _checked_tokens(self, request: GenerationRequest) -> list[int]:
        tokens = self._tokenize(request)
        if not tokens:
            raise RequestError("invalid_request", "the prompt is empty")
        if len(tokens) >= self.context_length:  # a max_tokens past the room left is clamped (_admit): docs/protocols.md
            raise RequestError(
                "context_length_exceeded",
                f"the prompt ({len(tokens)} tokens) leaves no room to generate in the context of {self.context_length} tokens",
            )
        if any(not 0 <= t < self.vocab_size for t in tokens):  # a token-id prompt was checked by start()
            raise RequestError("invalid_request", f"prompt token ids must lie in [0, {self.vocab_size})", "prompt")
        return tokens

    def _arrived(self, n: int) -> None:
        with self._arriving_lock:
            self._arriving += n

    def _reusable_prefix(self, tokens: list[int]) -> int:
        """How many of `tokens` the prompt cache could give back, found without copying anything
        (fetch_nearest_cache's own trie search; mlx-lm is pinned); all of them if unknown."""
        search = getattr(getattr(self.prompt_cache, "_trie", None), "search", None)
        if search is None:
            return len(tokens)
        found = search(self.name, tokens)
        if found.exact is not None:
            return len(tokens)
        longer = min(len(tokens) - 1, found.common_prefix) if found.longer is not None else 0
        return max(len(found.shorter or ()), longer)

    def _admit(self, arrival: _Arrival, align: int | None = None) -> _Stream:
        """On the MLX thread: the prompt cache's nearest prefix, and the request into the batch.
        `align`: the tokens every row of its group prefills (prefill_align), when its cached prefix
        stays at least prompt_cache_min_tokens with that many left."""
        request, tokens, vocab = arrival.request, arrival.tokens, self.vocab_size
        cache, rest = None, tokens
        if self._prompt_cache_entries <= 0:
            pass
        elif isinstance(self.prompt_cache, PrefixCache):  # at least one token is left to prefill: it gives the first logits
            limit = len(tokens) - 1
            if align is not None and len(tokens) - align >= max(1, self.prompt_cache_min_tokens):
                limit = len(tokens) - align
            cache, reused = self.prompt_cache.fetch(tokens, limit=limit, min_tokens=self.prompt_cache_min_tokens)
            rest = tokens[reused:]
        elif self._reusable_prefix(tokens) >= max(1, self.prompt_cache_min_tokens):
            cache, rest = self.prompt_cache.fetch_nearest_cache(self.name, tokens)
        if cache is not None and not rest:
            if can_trim_prompt_cache(cache):
                trim_prompt_cache(cache, 1)
                rest = tokens[-1:]
            else:
                cache, rest = None, tokens
        cached = len(tokens) - len(rest)
        if cache is None and isinstance(self.prompt_cache, PrefixCache):  # a batch of rows it takes as views (block_rows.py)
            cache = block_rows.fresh(self._layers, self.kv_bits, self.kv_group_size)
        elif cache is None and self.kv_bits is not None:  # mlx-lm would make a plain one
            cache = fresh_caches(self._layers, self.kv_bits, self.kv_group_size)
        sampling = RowSampling.of(request.temperature, request.top_p, request.min_p, request.top_k, request.seed, vocab)
        stream = _Stream(
            request=request,
            tokens=tokens,
            loop=arrival.loop,
            out=arrival.out,
            detokenizer=_detokenizer(self.tokenizer),
            stops=_stop_filter(request.stop),
            cached=cached,
            grammar=arrival.grammar,
        )
        (stream.uid,) = self.generator.insert(
            [rest],
            max_tokens=[min(request.max_tokens, self.context_length - len(tokens))],  # up to the context, then "length"
            caches=[cache] if cache is not None else None,
            all_tokens=[tokens[:cached]],
            samplers=[self._sampler_of(sampling)],
            logits_processors=[_processors(request) + ([arrival.grammar] if arrival.grammar is not None else [])],  # the mask last
            stop_sequences=[StopSequences([[t] for t in self.eos_ids])],
        )
        self.sampling.add(stream.uid, sampling)
        return stream

    def _sampler_of(self, sampling: RowSampling) -> Any:
        """The sampler object a row holds: the engine's one BatchSampler for every row, whatever its
        settings (kept in it by uid), so mlx-lm samples each step's batch in one call
        (deployments/engines/sampling.py; bench.engine.samplers measures it against per-row ones)."""
        return self.sampling

    def tokenize(self, request: GenerationRequest) -> list[int]:
        """The prompt tokens the engine would feed for `request` (chat template and tools applied),
        without generating: for token counting. Safe off the MLX thread (tokenizer only)."""
        if self.tokenizer is None:
            raise RequestError("engine_stopped", f"model {self.name} is not loaded")
        self.check(request)
        prep = self._prep
        if prep is None:
            return self._tokenize(request)
        try:
            job = prep.submit(self._tokenize, request)  # one thread uses the tokenizer
        except RuntimeError:  # shut down: the engine is stopping
            raise RequestError("engine_stopped", f"model {self.name} is stopping") from None
        return job.result()

    def _tokenize(self, request: GenerationRequest) -> list[int]:
        if request.prompt_tokens is not None:
            return list(request.prompt_tokens)
        if request.messages is not None:
            if not request.messages:
                raise RequestError("invalid_request", "messages is empty")
            messages, extra = chat_inputs(request.messages, request.tools, self.template_knows_tools)
            if template_kwargs_error(request.chat_template_kwargs) is not None:  # start() refused it already
                raise RequestError("invalid_request", "chat_template_kwargs holds more than template variables", "chat_template_kwargs")
            try:
                tokens = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, **extra, **request.chat_template_kwargs)
            except Exception as e:
                raise RequestError("invalid_request", f"the chat template rejected the messages: {e}") from e
            return list(tokens["input_ids"] if isinstance(tokens, dict) else tokens)
        return self.tokenizer.encode(request.prompt, add_special_tokens=False) if request.prompt else []

    def _advance(self, stream: _Stream, r: Any) -> bool:
        """Take one generated token; returns whether the stream is finished."""
        eos = r.finish_reason == "stop"
        if not eos:
            stream.completion += 1
            stream.detokenizer.add_token(r.token)
        if r.finish_reason is not None:
            stream.detokenizer.finalize()
        text = stream.stops.push(stream.detokenizer.last_segment) if stream.stops else stream.detokenizer.last_segment
        logprobs = self._logprobs(stream.request, r) if stream.request.logprobs and not eos else None
        token_ids = [] if eos else [r.token]
        stream.pending.append(Delta.model_construct(text=text, token_ids=token_ids, logprobs=logprobs))  # per token: no validation
        if stream.grammar is not None and stream.grammar.error is not None:
            self._finish(stream, "error", error=stream.grammar.error, code="internal")
            return True
        if stream.stops and stream.stops.stopped:
            self._finish(stream, "stop", stop_sequence=stream.stops.matched)
            return True
        if r.finish_reason is not None:
            if stream.stops:
                stream.pending.append(Delta(text=stream.stops.flush()))
            self._finish(stream, r.finish_reason)
            return True
        return False

    def _logprobs(self, request: GenerationRequest, r: Any) -> list[TokenLogprob]:
        row = r.logprobs
        top: list[tuple[int, str, float]] = []
        if request.top_logprobs:
            ids = mx.argpartition(-row, request.top_logprobs - 1)[: request.top_logprobs]
            values = row[ids]
            pairs = sorted(zip(cast(list[int], ids.tolist()), cast(list[float], values.tolist()), strict=True), key=lambda p: -p[1])
            # a grammar leaves some tokens at -inf: they are not alternatives (nor valid JSON)
            top = [(i, self.tokenizer.decode([i]), v) for i, v in pairs if v != -math.inf]
        return [TokenLogprob(token_id=r.token, token=self.tokenizer.decode([r.token]), logprob=row[r.token].item(), top=top)]

    def _finish(
        self, stream: _Stream, reason: FinishReason, error: str | None = None, code: str | None = None, stop_sequence: str | None = None
    ) -> None:
        usage = Usage(prompt_tokens=len(stream.tokens), completion_tokens=stream.completion, cached_tokens=stream.cached)
        stream.pending.append(Delta(finish_reason=reason, usage=usage, error=error, error_code=code, stop_sequence=stop_sequence))


def _logits_width(model: Any, tokenizer: Any) -> int:
    """How many token ids the model's embedding takes and its logits row holds: the config's
    vocab_size (a VLM's text_config's), else the rows of its output or embedding matrix, else the
    tokenizer's size. Every token id a client sends is checked against it (`LLMEngine.check`)."""
    args = getattr(model, "args", None)
    for config in (args, getattr(args, "text_config", None)):
        size = config.get("vocab_size") if isinstance(config, dict) else getattr(config, "vocab_size", None)
        if isinstance(size, int) and size > 0:
            return size
    from mlx.utils import tree_flatten

    for name, weight in cast(list[tuple[str, Any]], tree_flatten(model.parameters())):
        if name.endswith(("lm_head.weight", "embed_tokens.weight", "wte.weight", "tok_embeddings.weight")):
            return int(weight.shape[0])
    return len(tokenizer._tokenizer)


def _failure(e: Exception) -> Delta:
    """The one delta of a request that failed before it produced anything."""
    if isinstance(e, RequestError):
        return Delta(finish_reason="error", error=e.message, error_code=e.code, error_param=e.param)
    logger.error("a request failed before its first token", exc_info=e)
    return Delta(finish_reason="error", error=f"{type(e).__name__}: {e}", error_code="internal")


def _merged(stream: _Stream) -> Delta:
    """What one step produced for a stream, as one delta."""
    pending, stream.pending = stream.pending, []
    return Delta.model_construct(
        text="".join(d.text for d in pending),
        token_ids=[t for d in pending for t in d.token_ids],
        logprobs=[lp for d in pending for lp in (d.logprobs or [])] if stream.request.logprobs else None,
        finish_reason=pending[-1].finish_reason,
        usage=pending[-1].usage,
        error=pending[-1].error,
        error_code=pending[-1].error_code,
        stop_sequence=pending[-1].stop_sequence,
    )


def _hand_off(streams: list[_Stream], lag: dict | None = None) -> None:
    """One thread-safe call per event loop per step carries the deltas of all its streams.
    `lag`: counts how long each call waited for its loop (handoff_s over handoffs)."""
    by_loop: dict[asyncio.AbstractEventLoop, list[tuple[DeltaSink, Delta]]] = {}
    for stream in dict.fromkeys(streams):  # each stream once, in order
        if stream.pending:
            by_loop.setdefault(stream.loop, []).append((stream.out, _merged(stream)))
    for loop, items in by_loop.items():
        _put(loop, items, lag)


def _put(loop: asyncio.AbstractEventLoop, items: list[tuple[DeltaSink, Delta]], lag: dict | None = None) -> None:
    handed = time.monotonic()

    def put_all() -> None:
        if lag is not None:  # on the loop's thread; the MLX thread writes other keys
            lag["handoff_s"] += time.monotonic() - handed
            lag["handoffs"] += 1
        for out, delta in items:
            try:
                out.put_nowait(delta)
            except Exception:  # one broken sink must not cost the other streams their deltas
                logger.exception("a delta sink failed")

    try:
        loop.call_soon_threadsafe(put_all)
    except RuntimeError:
        pass  # that event loop is closed: its client is gone


class _StopFilter(StopStringFilter):
    """StopStringFilter that also keeps which stop string cut the text (`matched`)."""

    matched: str | None = None

    def push(self, segment: str) -> str:
        if self.stopped:
            return ""
        text = self._held + segment
        out = super().push(segment)
        if self.stopped:  # the cut is where the earliest stop string starts
            rest = text[len(out) :]
            self.matched = next((s for s in self.stops if rest.startswith(s)), None)
        return out


class _KeepLeadingSpace(BPEStreamingDetokenizer):
    """mlx-lm's byte-level BPE detokenizer (Llama 3, Qwen, SmolLM2...) drops the leading space of a
    generation's text; the tokenizer's own decode keeps it, and so must a completion: "The capital
    of France is" continues " Paris", not "Paris". (Its SentencePiece one trims as decode does.)"""

    def _maybe_trim_space(self, current_text: str) -> str:
        return current_text


def _detokenizer(tokenizer: Any) -> Any:
    """A fresh streaming detokenizer of mlx-lm's for one request, whose text is the decode of its tokens."""
    detokenizer = tokenizer.detokenizer
    if type(detokenizer) is BPEStreamingDetokenizer:
        detokenizer.__class__ = _KeepLeadingSpace
    return detokenizer


def _stop_filter(stops: list[str]) -> _StopFilter | None:
    return _StopFilter(stops) if stops else None


def _reseed_rng() -> None:
    """Give this thread's MLX RNG a fresh key. A function compiled with `inputs=mx.random.state,
    outputs=mx.random.state` (as mlx-lm's samplers are) that raises while it is being traced leaves
    the compile tracer (an array without a primitive) in mx.random.state (the MLX thread's own), and
    every later unseeded sampling step fails with "[eval] Attempting to eval an array without a
    primitive". After a broken step the state may be such a tracer: a new key repairs it (unseeded
    sampling promises no sequence, so nothing is lost)."""
    mx.random.seed(secrets.randbits(64))


def _processors(request: GenerationRequest):
    return make_logits_processors(
        logit_bias=request.logit_bias,
        repetition_penalty=request.repetition_penalty,
        presence_penalty=request.presence_penalty or None,
        frequency_penalty=request.frequency_penalty or None,
    )
