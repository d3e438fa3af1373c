"""What an LLM engine's request gets back: its deltas, made token by token on the MLX thread.

Each running request's `Stream` turns the tokens the batch generates for it into text (mlx-lm's
streaming detokenizer, whole characters across multi-token UTF-8, the leading space kept), cuts it at
the first stop string without leaking a partial match, adds logprobs when asked, and ends it with a
finish reason and usage. A step's deltas of one stream are merged into one, and all streams of one
event loop are handed to it in one thread-safe call (`hand_off`), whatever the number of streams."""

import asyncio
import logging
import math
import time
from dataclasses import dataclass, field
from typing import Any, Protocol, cast

import mlx.core as mx
from mlx_lm.tokenizer_utils import BPEStreamingDetokenizer
from pydantic import Field

from deployments.engine import Frozen, RequestError
from deployments.engines.constrained import GrammarProcessor
from deployments.engines.text_stream import StopStringFilter
from deployments.wire.generation import FinishReason, GenerationRequest

logger = logging.getLogger("deployments.engines.llm")


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


class Generated(Protocol):
    """One token the batch made for a row (mlx-lm's GenerationBatch.Response has these fields)."""

    token: int
    logprobs: Any  # the row's normalised log-probabilities, an mx.array
    finish_reason: str | None


@dataclass(eq=False)
class Stream:
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

    def advance(self, r: Generated, tokenizer: Any) -> bool:
        """Take one generated token; returns whether the stream is finished."""
        eos = r.finish_reason == "stop"
        if not eos:
            self.completion += 1
            self.detokenizer.add_token(r.token)
        if r.finish_reason is not None:
            self.detokenizer.finalize()
        text = self.stops.push(self.detokenizer.last_segment) if self.stops else self.detokenizer.last_segment
        logprobs = token_logprobs(self.request, r, tokenizer) if self.request.logprobs and not eos else None
        token_ids = [] if eos else [r.token]
        self.pending.append(Delta.model_construct(text=text, token_ids=token_ids, logprobs=logprobs))  # per token: no validation
        if self.grammar is not None and self.grammar.error is not None:
            self.finish("error", error=self.grammar.error, code="internal")
            return True
        if self.stops and self.stops.stopped:
            self.finish("stop", stop_sequence=self.stops.matched)
            return True
        if r.finish_reason is not None:
            if self.stops:
                self.pending.append(Delta(text=self.stops.flush()))
            self.finish(cast(FinishReason, r.finish_reason))
            return True
        return False

    def finish(self, reason: FinishReason, error: str | None = None, code: str | None = None, stop_sequence: str | None = None) -> None:
        usage = Usage(prompt_tokens=len(self.tokens), completion_tokens=self.completion, cached_tokens=self.cached)
        self.pending.append(Delta(finish_reason=reason, usage=usage, error=error, error_code=code, stop_sequence=stop_sequence))


def new_stream(
    request: GenerationRequest, tokens: list[int], loop: asyncio.AbstractEventLoop, out: DeltaSink, tokenizer: Any, grammar: GrammarProcessor | None
) -> Stream:
    """A request's stream, with a fresh detokenizer and its stop strings' filter."""
    stops = _StopFilter(request.stop) if request.stop else None
    return Stream(request=request, tokens=tokens, loop=loop, out=out, detokenizer=_detokenizer(tokenizer), stops=stops, grammar=grammar)


def token_logprobs(request: GenerationRequest, r: Generated, tokenizer: Any) -> list[TokenLogprob]:
    row = r.logprobs
    top: list[tuple[int, str, float]] = []
    if request.top_logprobs:
        ids = mx.argpartition(-row, request.top_logprobs - 1)[: request.top_logprobs]
        values = row[ids]
        pairs = sorted(zip(cast(list[int], ids.tolist()), cast(list[float], values.tolist()), strict=True), key=lambda p: -p[1])
        # a grammar leaves some tokens at -inf: they are not alternatives (nor valid JSON)
        top = [(i, tokenizer.decode([i]), v) for i, v in pairs if v != -math.inf]
    return [TokenLogprob(token_id=r.token, token=tokenizer.decode([r.token]), logprob=row[r.token].item(), top=top)]


def failure(e: Exception) -> Delta:
    """The one delta of a request that failed before it produced anything."""
    if isinstance(e, RequestError):
        return Delta(finish_reason="error", error=e.message, error_code=e.code, error_param=e.param)
    logger.error("a request failed before its first token", exc_info=e)
    return Delta(finish_reason="error", error=f"{type(e).__name__}: {e}", error_code="internal")


def _merged(stream: Stream) -> Delta:
    """What one step produced for a stream, as one delta."""
    pending, stream.pending = stream.pending, []
    if len(pending) == 1 and not stream.request.logprobs:  # a plain step's one token per row: the delta as it is, not a copy (~2 µs a row a step)
        return pending[0]
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


def hand_off(streams: list[Stream], lag: dict | None = None) -> None:
    """One thread-safe call per event loop per step carries the deltas of all its streams.
    `lag`: counts how long each call waited for its loop (handoff_s over handoffs)."""
    by_loop: dict[asyncio.AbstractEventLoop, list[tuple[DeltaSink, Delta]]] = {}
    for stream in dict.fromkeys(streams):  # each stream once, in order
        if stream.pending:
            by_loop.setdefault(stream.loop, []).append((stream.out, _merged(stream)))
    for loop, items in by_loop.items():
        put(loop, items, lag)


def put(loop: asyncio.AbstractEventLoop, items: list[tuple[DeltaSink, Delta]], lag: dict | None = None) -> None:
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
