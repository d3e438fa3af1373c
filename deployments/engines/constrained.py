"""Structured output for the batched LLM engine: a grammar per request (JSON object, JSON schema,
regex or Lark), compiled by llguidance, applied as one more mlx-lm logits processor of that request.

How it fits mlx-lm 0.32's BatchGenerator: every step calls a request's processors with
(`tokens`, `logits`), where `tokens` is the request's whole context (prompt, then every token fed to
the model so far) and `logits` its one row. On the first call `tokens` ends with the prompt; on
every later call it ends with the token sampled at the previous step, which the matcher has not seen
yet. So a processor consumes `tokens[-1]` (from the second call on), then masks the row to what the
grammar allows next. When the grammar is complete (nothing but EOS can follow) the mask leaves only
EOS, so the request ends with "stop". Rows without a constraint are untouched, so constrained and
unconstrained requests share one batch.

Whitespace in JSON is fixed (", " and ": ", no other whitespace): a random-weight or weak model
cannot loop on whitespace, and the output stays close to the JSON models are trained on."""

import threading
from typing import TYPE_CHECKING, Any

import llguidance
import llguidance.hf
import mlx.core as mx
import numpy as np

from deployments.engine import RequestError
from deployments.wire.generation import Constraint

if TYPE_CHECKING:
    from llguidance._lib import JsonCompileOptions  # a TypedDict of the stub only

PARAM = "response_format"

# JSON whitespace for json_object / json_schema: fixed separators, nothing flexible.
JSON_OPTIONS: "JsonCompileOptions" = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}

_MAX_ERROR_CHARS = 2000


def grammar_source(constraint: Constraint) -> str:
    """The llguidance grammar (its JSON serialisation) of a constraint."""
    if constraint.type == "json_object":
        return llguidance.LLMatcher.grammar_from_json_schema({"type": "object"}, overrides=JSON_OPTIONS)
    if constraint.type == "json_schema":
        # schema, pattern and grammar are present for their types (Constraint._needs_its_field)
        options: JsonCompileOptions = {**JSON_OPTIONS, "lenient": not constraint.strict}
        return llguidance.LLMatcher.grammar_from_json_schema(constraint.schema, overrides=options)  # type: ignore[arg-type]
    if constraint.type == "regex":
        return llguidance.LLMatcher.grammar_from_regex(constraint.pattern)  # type: ignore[arg-type]
    return llguidance.LLMatcher.grammar_from_lark(constraint.grammar)  # type: ignore[arg-type]


_WHAT = {"json_object": "JSON object grammar", "json_schema": "JSON schema", "regex": "regex", "lark": "Lark grammar"}


class GrammarCompiler:
    """One per engine: llguidance's view of the model's tokenizer (built once, on first use: about
    0.4 s for a 49k vocabulary) and a compiled matcher per request. Thread-safe: the engine compiles
    off both the event loop and its MLX thread."""

    def __init__(self, hf_tokenizer: Any, eos_ids: list[int], vocab_size: int | None = None):
        self._hf_tokenizer = hf_tokenizer
        self.eos_ids = list(eos_ids)
        self._vocab_size = vocab_size
        self._tokenizer: llguidance.LLTokenizer | None = None
        self._lock = threading.Lock()

    @property
    def tokenizer(self) -> llguidance.LLTokenizer:
        with self._lock:
            if self._tokenizer is None:
                n_vocab = max(self._vocab_size or 0, len(self._hf_tokenizer)) or None
                try:
                    self._tokenizer = llguidance.hf.from_tokenizer(self._hf_tokenizer, n_vocab=n_vocab, eos_token=self.eos_ids)
                except Exception as e:
                    raise RequestError("unsupported", f"structured output needs a fast (tokenizers) tokenizer: {type(e).__name__}: {e}", PARAM) from e
            return self._tokenizer

    def compile(self, constraint: Constraint) -> "GrammarProcessor":
        """A fresh per-request processor, or RequestError(invalid_request, param response_format)
        when the grammar does not compile."""
        try:
            source = grammar_source(constraint)
        except Exception as e:  # e.g. a schema that is not a JSON object
            raise _invalid(constraint, str(e)) from e
        matcher = llguidance.LLMatcher(self.tokenizer, source, log_level=0)
        if matcher.is_error():
            raise _invalid(constraint, matcher.get_error())
        return GrammarProcessor(matcher, self.eos_ids)


def _invalid(constraint: Constraint, detail: str) -> RequestError:
    detail = detail.strip()
    if len(detail) > _MAX_ERROR_CHARS:
        detail = detail[:_MAX_ERROR_CHARS] + " ..."
    what = "forced tool call's grammar (a tool's parameters schema)" if constraint.param == "tools" else _WHAT[constraint.type]
    return RequestError("invalid_request", f"the {what} does not compile: {detail}", constraint.param)


class GrammarProcessor:
    """The mlx-lm logits processor of one constrained request (stateful: one per request, called
    once per step of that request, in order). Never raises: a matcher that breaks (a resource limit
    of llguidance, say) records `error` and leaves only EOS, and the engine fails the request."""

    def __init__(self, matcher: llguidance.LLMatcher, eos_ids: list[int]):
        self.matcher = matcher
        self.eos_ids = eos_ids
        self.error: str | None = None
        self._started = False
        self._eos_only: mx.array | None = None

    def __call__(self, tokens: mx.array, logits: mx.array) -> mx.array:
        width = logits.shape[-1]
        try:
            if self._started:
                token = int(tokens[-1].item())  # type: ignore[arg-type]  # a token id: mlx types item() as any scalar
                if not self.matcher.consume_token(token) and self.error is None:
                    self.error = f"the grammar rejected token {token}: {self.matcher.get_error()}"
            self._started = True
            if self.error is None and self.matcher.is_error():
                self.error = f"grammar matcher failed: {self.matcher.get_error()}"
            if self.error is not None or self.matcher.is_stopped():
                allowed = self._eos_mask(width)
            else:
                allowed = bitmask_to_mx(self.matcher.compute_bitmask(), width)
        except Exception as e:  # a processor that raises would fail the whole batch's step
            self.error = self.error or f"grammar processor failed: {type(e).__name__}: {e}"
            allowed = self._eos_mask(width)
        return mx.where(allowed, logits, -mx.inf)

    def _eos_mask(self, width: int) -> mx.array:
        if self._eos_only is None or self._eos_only.size != width:
            mask = np.zeros(width, dtype=np.bool_)
            mask[[t for t in self.eos_ids if t < width]] = True
            self._eos_only = mx.array(mask)
        return self._eos_only


def bitmask_to_mx(bitmask: bytes, width: int) -> mx.array:
    """llguidance's token bitmask (one bit per token, little-endian 32-bit words) as a boolean MLX
    row of `width` (the logits' vocabulary; tokens past the tokenizer's are never allowed)."""
    bits = np.unpackbits(np.frombuffer(bitmask, dtype=np.uint8), bitorder="little")
    if bits.size < width:
        bits = np.pad(bits, (0, width - bits.size))
    return mx.array(bits[:width].view(np.bool_))
