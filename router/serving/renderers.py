"""One generation's deltas rendered in the protocol the client spoke.

The ingress runs every text generation the same way (lease, stream from the instance's actor,
release); only the rendering differs. Each renderer takes the model server's deltas (deployments/wire/generation.py), runs them through
the model's output parser (reasoning split, tool calls: router.serving.output.parsing) where the protocol
is a chat protocol, and returns SSE bytes (streaming) or the response body (not streaming). Errors
leave in the same protocol's error format (mid-stream; before the stream, router/api's handlers)."""

from collections.abc import Mapping
from typing import Any, Literal

from deployments.wire.failure import STATUS as HTTP_STATUS
from deployments.wire.generation import GenerationDelta
from router.protocols import anthropic as anth, openai as oai, responses as resp
from router.serving.output.parsing import OutputParser

Protocol = Literal["openai", "anthropic"]


class OpenAIRenderer:
    """Chat completions (parsed: reasoning_content, tool_calls) and legacy completions (raw text)."""

    protocol: Protocol = "openai"

    def __init__(self, req: oai.ChatCompletionRequest | oai.CompletionRequest, parser: OutputParser | None):
        self.chat = isinstance(req, oai.ChatCompletionRequest)
        self.req = req
        self.parser = parser if parser is not None and parser.transforms else None  # plain text: no per-delta parsing
        self.request_id = oai.new_request_id("chat" if self.chat else "completion")
        self.created = oai.now()
        self.encoder = oai.StreamEncoder(
            "chat" if self.chat else "completion", req.model, self.request_id, self.created, include_usage=req.include_usage, statuses=HTTP_STATUS
        )

    def _parsed(self, delta: GenerationDelta) -> Mapping[str, Any]:
        return oai.with_events(delta, self.parser.feed(delta)) if self.parser is not None else delta

    def start(self) -> bytes:
        return b""

    def ping(self) -> bytes:
        """A keep-alive while the prompt is read: an SSE comment line (clients skip it)."""
        return b": keep-alive\n\n"

    def feed(self, delta: GenerationDelta) -> bytes:
        return self.encoder.feed(self._parsed(delta))

    def fail(self, status: int, code: str, message: str) -> bytes:
        return self.encoder.error(code, message, status=status)

    def close(self) -> bytes:
        return self.encoder.close()

    def respond(self, deltas: list[GenerationDelta]) -> dict[str, Any]:
        joined = oai.join_deltas([self._parsed(d) for d in deltas])
        build = oai.chat_completion_response if self.chat else oai.completion_response
        return build(self.req.model, self.request_id, self.created, joined, statuses=HTTP_STATUS)


class _EventRenderer:
    """A protocol whose encoder takes output events (Anthropic Messages, Responses): every delta
    goes through the model's parser chain, and the encoder turns events into SSE bytes."""

    protocol: Protocol = "openai"

    def __init__(self, parser: OutputParser, encoder: Any):
        self.parser = parser
        self.encoder = encoder

    def _events(self, deltas: list[GenerationDelta]) -> list:
        return [e for d in deltas for e in self.parser.feed(d)]

    def start(self) -> bytes:
        return self.encoder.start()

    def ping(self) -> bytes:
        """A keep-alive while the prompt is read: an SSE comment line (clients skip it)."""
        return b": keep-alive\n\n"

    def feed(self, delta: GenerationDelta) -> bytes:
        return b"".join(self.encoder.feed(e) for e in self.parser.feed(delta))

    def fail(self, status: int, code: str, message: str) -> bytes:
        return self.encoder.error(status, message, code)

    def close(self) -> bytes:
        return self.encoder.close()


class AnthropicRenderer(_EventRenderer):
    """Anthropic Messages: thinking / text / tool_use blocks, Anthropic's SSE event sequence."""

    protocol: Protocol = "anthropic"

    def __init__(self, req: anth.MessagesRequest, parser: OutputParser):
        self.req = req
        self.message_id = anth.new_message_id()
        super().__init__(parser, anth.MessageStreamEncoder(req.model, self.message_id, statuses=HTTP_STATUS))

    def ping(self) -> bytes:
        """Anthropic's `ping` event (clients skip it), after message_start."""
        return self.encoder.ping()

    def respond(self, deltas: list[GenerationDelta]) -> dict[str, Any]:
        return anth.message_response(self.req.model, self.message_id, self._events(deltas), statuses=HTTP_STATUS)


class ResponsesRenderer(_EventRenderer):
    """OpenAI Responses: message / reasoning / function_call output items (stateless)."""

    def __init__(self, req: resp.ResponsesRequest, parser: OutputParser):
        self.req = req
        self.response_id = resp.new_response_id()
        super().__init__(parser, resp.ResponseStreamEncoder(req, self.response_id, statuses=HTTP_STATUS))

    def respond(self, deltas: list[GenerationDelta]) -> dict[str, Any]:
        return resp.response_object(self.req, self.response_id, self._events(deltas), statuses=HTTP_STATUS)


Renderer = OpenAIRenderer | AnthropicRenderer | ResponsesRenderer
