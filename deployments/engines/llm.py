"""The LLM engine: mlx-lm's own BatchGenerator driven by one loop on one MLX thread.

Requests join and leave the running batch at any step (continuous batching). The asyncio side only
validates, enqueues and reads deltas. A request's chat template and tokenizing run on the engine's
preparation thread, so the MLX thread does only what needs MLX: every MLX call and KV cache lives on
the engine's worker thread, because MLX streams are thread-local.

The engine's parts, each in its module:
- this one: `LLMEngine`, the async facade (load, stop, generate, start, cancel, complete, tokenize,
  counters, memory) and the preparation thread's templating, tokenizing and checks;
- llm_loop.py: the MLX thread's loop over the BatchGenerator (commands, admission, steps);
- llm_scheduler.py: what joins the batch and when (holding arrivals, grouping, prefix alignment,
  prefill chunks between decode steps), pure decisions on plain data;
- llm_cache.py: the kept prompt prefixes (the block tree of prefix_cache.py, or mlx-lm's
  LRUPromptCache for models whose caches cannot be cut into blocks);
- llm_output.py: a request's deltas (detokenizing, stop strings, logprobs, usage) and their hand-off
  to the event loop, one call per loop per step whatever the number of streams;
- speculation.py: draft tokens (prompt_lookup.py, or a draft model's: draft.py) verified for every
  row in one forward, at a depth that follows acceptance and the step's cost (spec_depth.py)."""

import asyncio
import itertools
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict
from typing import Any, cast

import deployments  # noqa: F401  (OpenBLAS before MLX)

# isort: split
import mlx.core as mx
import mlx_lm
from mlx_lm.models.cache import LRUPromptCache, make_prompt_cache

from deployments.engine import Engine, MemoryReport, RequestError, RequestErrorCode
from deployments.engines import buffer_cache, measure
from deployments.engines.chat_format import template_kwargs_error
from deployments.engines.constrained import GrammarCompiler, GrammarProcessor
from deployments.engines.draft import Draft
from deployments.engines.llm_cache import KeptPrefixes
from deployments.engines.llm_loop import Arrival, MLXLoop
from deployments.engines.llm_output import Delta, DeltaSink, Stream, TokenLogprob, Usage, failure, put
from deployments.engines.llm_scheduler import Scheduler
from deployments.engines.options import LLMEngineOptions
from deployments.engines.prefix_cache import PrefixCache, sliceable
from deployments.engines.prefix_disk import DiskTier
from deployments.engines.prompt_tokens import knows_tools, prompt_tokens
from deployments.engines.quantized_cache import KV_BITS, KV_GROUP_SIZES, quantizable
from deployments.engines.sampling import BatchSampler
from deployments.engines.speculation import Speculator
from deployments.estimate import kv_bytes_per_token
from deployments.manifest import safetensors_bytes
from deployments.wire.generation import GenerationRequest
from deployments.wire.measured import MeasuredMemory
from deployments.worker import MLXWorker

__all__ = ["Delta", "DeltaSink", "LLMEngine", "TokenLogprob", "Usage"]

logger = logging.getLogger(__name__)


class LLMEngine(MLXLoop, Engine):
    kind = "llm"
    known_memory: MeasuredMemory | None = None  # what an earlier load of these weights measured (M1): set before `load`

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
        speculation: str = "prompt_lookup",  # "off", or "draft" with draft_model (speculation.py, draft.py)
        spec_max_drafts: int = 8,
        spec_lookup_window: int = 16384,  # prompt lookup indexes a row's last this many prompt tokens (prompt_lookup.py)
        draft_model: str | None = None,  # a folder (or hub id) of a smaller model of this one's tokenizer
        draft_rows: int = 4,  # rows the draft proposes for at once; others take prompt lookup's
        spec_fixed_depth: int | None = None,  # verify this many drafts whenever a row has them, whatever it costs (comparisons, tests)
        measure_idle_s: float | None = 2.0,  # None: the activations measured in load(); else once idle this long (measure.py)
        admit_gather_ms: float = 20.0,
    ):
        """The scheduling and cache settings are options.py's fields of the same names (what each
        does and why its default: there, and in llm_scheduler.py / llm_cache.py)."""
        super().__init__(name, path)
        _check_settings(kv_bits, kv_group_size, prefill_chunk_tokens, prefill_decode_steps, prefix_cache, prefix_block_tokens, prefix_disk_bytes)
        self.kv_bits, self.kv_group_size = kv_bits, kv_group_size
        self.max_batch = max_batch
        self.prefill_batch = min(prefill_batch, max_batch)  # a group never exceeds the batch
        self.prefill_step = prefill_step
        # Each prefilling row runs at most this many prompt tokens per step: mlx-lm's BatchGenerator
        # decodes the batch, then prefills one slice of every pending prompt, each next(); with its
        # slice at 2048 a 3,000-token prompt stalls every decoding stream for a 2,048-token forward.
        self.prefill_chunk_tokens = prefill_chunk_tokens
        self.prefill_decode_steps = prefill_decode_steps
        self._context_length = context_length
        self.prompt_cache_bytes = prompt_cache_bytes
        self.prefix_cache = prefix_cache  # what was asked; prefix_cache_kind: what the model allows
        self.prefix_block_tokens = prefix_block_tokens
        self.prefix_disk_bytes, self.prefix_disk_dir = prefix_disk_bytes, prefix_disk_dir
        self.share_prefill = share_prefill
        self.prefill_pad_ratio = prefill_pad_ratio
        self.prefill_align = prefill_align
        self.reserve_context_tokens = reserve_context_tokens
        self.reserve_concurrency = reserve_concurrency
        self.measure_idle_s = measure_idle_s
        self.admit_gather_ms = admit_gather_ms
        self.admit_hold_steps = admit_hold_steps
        self.admit_quiet_steps = admit_quiet_steps
        self.admit_hold_min_rows = admit_hold_min_rows
        self.max_prefill_tokens = max_prefill_tokens
        self.prompt_cache_min_tokens = prompt_cache_min_tokens
        # MLX buffer cache kept through mlx-lm's prefill (None: the KV reservation; buffer_cache.py)
        self.prefill_cache_keep_mib = prefill_cache_keep_mib
        self.scheduler: Scheduler[Arrival] = Scheduler(self)  # what joins the batch and when (MLX thread)
        self.kept = KeptPrefixes(self, prompt_cache_entries)  # the prompt prefixes kept for reuse (MLX thread)
        # where a request's first token waits inside the engine: from start() to joining the batch
        # (preparation and hold), and to its first token (admit_prep_s: the part of admit_wait_s before
        # the MLX thread had it: templating, tokenizing; join_steps: the engine's steps from joining to
        # the first token; the scheduler counts held_steps, from arriving in the MLX thread to
        # joining), and how long a request that ran to its end spent inside the engine, from start()
        # to its last delta's hand-off (a client's time per request less this is the path's, both ways)
        self._admitted = {
            "admit_wait_s": 0.0,
            "admit_prep_s": 0.0,
            "first_token_s": 0.0,
            "first_tokens": 0,
            "join_steps": 0,
            "finished_s": 0.0,
            "finished_requests": 0,
            "handoff_s": 0.0,  # a step's deltas waiting for the caller's event loop to run them
            "handoffs": 0,
        }
        self._prep: ThreadPoolExecutor | None = None  # templating and tokenizing, in arrival order
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._streams: dict[int, Stream] = {}
        self._ids = itertools.count()
        self._worker: MLXWorker | None = None
        self._loop_done: Any = None
        self._stopping = threading.Event()
        self._retired_counters: dict[str, float] = {}  # of generators replaced after a broken step
        # Every row's one sampler: the batch is sampled in one call whatever its rows' settings (MLX thread)
        self.sampling = BatchSampler()
        if speculation not in ("off", "prompt_lookup", "draft"):
            raise ValueError(f"speculation must be 'off', 'prompt_lookup' or 'draft', not {speculation!r}")
        if (speculation == "draft") != bool(draft_model):
            raise ValueError("speculation 'draft' takes a draft_model (a smaller model of the same tokenizer), and only it does")
        self.speculation, self.spec_max_drafts, self.spec_lookup_window = speculation, spec_max_drafts, spec_lookup_window
        self.draft_model, self.draft_rows = draft_model, draft_rows
        # draft tokens verified in the batch (MLX thread)
        self.speculator = (
            Speculator(self.sampling, max_drafts=spec_max_drafts, fixed_depth=spec_fixed_depth, lookup_window=spec_lookup_window)
            if speculation != "off"
            else None
        )
        self._arriving = 0  # started, not yet in the batch (being prepared or held); under _arriving_lock
        self._arriving_lock = threading.Lock()  # three threads change it: the caller's, preparation, MLX

    # ---- the parts' state, by the names callers and benchmarks use ---------------------------
    @property
    def prompt_cache(self) -> PrefixCache | LRUPromptCache | None:
        return self.kept.cache

    @property
    def prefix_cache_kind(self) -> str:
        return self.kept.kind

    @property
    def disk(self) -> DiskTier | None:
        return self.kept.disk

    @property
    def _prompt_cache_entries(self) -> int:
        return self.kept.entries

    @_prompt_cache_entries.setter
    def _prompt_cache_entries(self, entries: int) -> None:
        self.kept.entries = entries

    @property
    def _steps(self) -> int:
        return self.scheduler.steps

    @property
    def prefill_chunk(self) -> int:
        """The prompt tokens a prefilling row runs in one step (mlx-lm's prefill_step_size)."""
        return min(self.prefill_step, self.prefill_chunk_tokens)

    # ---- lifecycle -------------------------------------------------------------------------
    async def _load(self) -> None:
        self._worker = MLXWorker(self.name, interrupt=self._end_loop)  # ends the loop at exit, if never stopped
        await self._worker.run(self._load_on_worker)
        self._prep = ThreadPoolExecutor(1, thread_name_prefix=f"prep-{self.name}")
        self._loop_done = self._worker.submit(self._run_loop)

    def _load_on_worker(self) -> None:
        active = mx.get_active_memory()  # what the weights add to it is theirs (measure.loaded)
        self.model, self.tokenizer, config = mlx_lm.load(self.path, return_config=True)  # type: ignore[misc]  # a 3-tuple with return_config
        self.weight_bytes = safetensors_bytes(self.path)
        self.context_length = self._context_length or int(config.get("max_position_embeddings") or 4096)
        self.kv_bytes_per_token = kv_bytes_per_token(config, kv_bits=self.kv_bits, kv_group_size=self.kv_group_size)
        if self.kv_bits is not None:
            self._check_quantizable(config)
        buffer_cache.keep(self, self.cache_keep_bytes())
        self.eos_ids = sorted(self.tokenizer.eos_token_ids)
        self.vocab_size = _logits_width(self.model, self.tokenizer)
        self.kept.open(self.model, self._prefill_rate)
        if self.speculator is not None and not sliceable(make_prompt_cache(self.model)):  # a window or an SSM state is not rewound by trimming
            logger.info("%s: its KV cache is not plain KV in every layer; no speculative decoding", self.name)
            self.speculator = None
        if self.speculator is not None and self.draft_model:  # part of the instance: in its weights and its measured cache
            self.speculator.draft = Draft.load(self.draft_model, self.name, self.tokenizer, self.vocab_size, self.draft_rows, self.prefill_chunk)
            self.weight_bytes += self.speculator.draft.weight_bytes
        hf_tokenizer = self.tokenizer._tokenizer
        self.grammars = GrammarCompiler(hf_tokenizer, self.eos_ids, self.vocab_size)
        self.template_knows_tools = knows_tools(self.tokenizer)
        self.measured = measure.loaded(self, config, active)  # what it holds; the process's MLX limit
        self.scheduler.kv = measure.kv_budget(self.measured, self.context_length, measure.drafts(self))  # the batch within its KV reservation (M4)
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

    def _prefill_rate(self) -> float:
        """Prompt tokens a second, as mlx-lm measured this engine's prefills (0 before any)."""
        counted = self.counters()
        tokens, seconds = counted.get("prompt_tokens", 0), counted.get("prompt_time", 0.0)
        return tokens / seconds if tokens > 0 and seconds > 0 else 0.0

    def _end_loop(self) -> None:
        """Tell the MLX thread's loop to end after its current step (stop(), or interpreter exit)."""
        self._stopping.set()
        self._commands.put(("wake", None))

    async def _stop(self) -> None:
        if self._prep is not None:  # what it is preparing reaches the loop, which answers it
            await asyncio.to_thread(self._prep.shutdown, True)
        self._end_loop()
        if self._loop_done is not None:
            await asyncio.wrap_future(self._loop_done)
        if self._worker is not None:
            self._worker.shutdown()
        measure.set_limit(id(self), None)  # a stopped engine holds nothing: its limit leaves the process's

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
        # and the engine's own: where first tokens wait, groups admitted into the batch, the prefix cache's
        speculated = self.speculator.stats if self.speculator is not None else {}
        return mlx_lm_counters | self._admitted | self.scheduler.stats | sampling | self.kept.stats() | speculated

    def memory(self) -> MemoryReport:
        generator = getattr(self, "generator", None)
        kept = self.kept.nbytes if generator is not None else 0  # within prompt_cache_bytes; shrink_prefix_cache
        return MemoryReport(
            weight_bytes=getattr(self, "weight_bytes", 0),
            kv_bytes_in_use=generator.prompt_cache_nbytes if generator is not None else 0,
            prefix_cache_bytes=kept,
            prefix_prefill_s=self._prefill_seconds(kept),
            kv_bytes_reserved=getattr(self, "kv_bytes_per_token", 0) * self.reserve_context_tokens * self.reserve_concurrency,
            measured=getattr(self, "measured", None),
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

    # ---- preparation (its own thread) ----------------------------------------------------------
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
            put(loop, [(out, failure(e))])
            return
        self._commands.put(("add", Arrival(rid, request, tokens, loop, out, grammar, started, prepared=time.monotonic())))

    def _checked_tokens(self, request: GenerationRequest) -> list[int]:
        tokens = self._tokenize(request)
        if not tokens:
            raise RequestError("invalid_request", "the prompt is empty")
        if (why := measure.refusal(getattr(self, "measured", None), len(tokens))) is not None:
            raise RequestError("context_length_exceeded", why)
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
        return prompt_tokens(self.tokenizer, request, self.template_knows_tools)  # as a count without the weights (prompt_tokens.py)


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


def _check_settings(
    kv_bits: int | None,
    kv_group_size: int,
    prefill_chunk_tokens: int,
    prefill_decode_steps: int,
    prefix_cache: str,
    prefix_block_tokens: int,
    prefix_disk_bytes: int,
) -> None:
    """LLMEngine's arguments that options.py does not bound already (a direct caller's)."""
    if kv_bits is not None and kv_bits not in KV_BITS:
        raise ValueError(f"kv_bits must be one of {KV_BITS} (or None), not {kv_bits}")
    if kv_group_size not in KV_GROUP_SIZES:
        raise ValueError(f"kv_group_size must be one of {KV_GROUP_SIZES}, not {kv_group_size}")
    if prefill_chunk_tokens < 1:
        raise ValueError(f"prefill_chunk_tokens must be at least 1, not {prefill_chunk_tokens}")
    if prefill_decode_steps < 0:
        raise ValueError(f"prefill_decode_steps must not be negative, not {prefill_decode_steps}")
    if prefix_cache not in ("blocks", "lru"):
        raise ValueError(f"prefix_cache must be 'blocks' or 'lru', not {prefix_cache!r}")
    if prefix_block_tokens < 1:
        raise ValueError(f"prefix_block_tokens must be at least 1, not {prefix_block_tokens}")
    if prefix_disk_bytes < 0:
        raise ValueError(f"prefix_disk_bytes must not be negative, not {prefix_disk_bytes}")
