"""Anthropic Messages (router/anthropic_protocol.py): requests as the anthropic SDK sends them parse
and translate to OpenAI chat bodies of the right shape; what Orchard cannot do is a 400 naming the
field, in Anthropic's error shape; responses and SSE streams built from output events parse with the
SDK's own models, follow Anthropic's event order, and accumulate (MessageStream.get_final_message)
to the same message as the non-streaming response. Pure Python: the SDK talks to a mock transport."""

import json
from typing import Any

import anthropic
import httpx2
import pytest
from anthropic.types import Message, RawMessageStreamEvent
from hypothesis import HealthCheck, given, settings, strategies as st
from openai.types.chat import completion_create_params
from pydantic import TypeAdapter, ValidationError
from support.chat_body import as_body, some_of, translation_of

from router.protocols import anthropic as ap
from router.protocols.events import Finish, ReasoningDelta, TextDelta, ToolCallArguments, ToolCallEnd, ToolCallStart
from router.protocols.openai import MAX_STOP, ProtocolError

STREAM_EVENT = TypeAdapter(RawMessageStreamEvent)
CHAT_PARAMS = TypeAdapter(completion_create_params.CompletionCreateParamsNonStreaming)
PNG = "iVBORw0KGgo="

WEATHER = {
    "name": "get_weather",
    "description": "Weather for a city",
    "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
}


def body(**kw: Any) -> dict[str, Any]:
    return {"model": "qwen3-4b", "max_tokens": 64, "messages": [{"role": "user", "content": "Hi"}], **kw}


def chat(**kw: Any) -> dict[str, Any]:
    return as_body(ap.to_chat_request(ap.parse_messages_request(body(**kw))))


def _drain(v: Any) -> Any:
    """The SDK's TypedDicts validate iterables lazily: walk them so every item is checked."""
    if isinstance(v, dict):
        return {k: _drain(x) for k, x in v.items()}
    if isinstance(v, list | tuple) or hasattr(v, "__next__"):
        return [_drain(x) for x in v]
    return v


def assert_chat_shape(chat_body: dict[str, Any]) -> None:
    """The body is an OpenAI chat request as the openai SDK types it (as_body checked that Orchard's
    own ChatCompletionRequest gives back the built request)."""
    _drain(CHAT_PARAMS.validate_python(chat_body))


def rejected(request: dict[str, Any]) -> ProtocolError:
    with pytest.raises(ProtocolError) as e:
        ap.parse_messages_request(request)
    assert e.value.status == 400
    assert ap.protocol_error_body(e.value)["error"]["type"] == "invalid_request_error"
    return e.value


# ---- a fake Orchard behind the SDK ---------------------------------------------------------------


class FakeServer:
    """Serves /v1/messages from a scripted event list through the encoders under test, recording
    the parsed request, for the SDK's client (mock transport: no sockets)."""

    def __init__(self) -> None:
        self.events: list[Any] = []
        self.requests: list[ap.MessagesRequest] = []
        self.input_tokens = 0
        transport = httpx2.MockTransport(self.handle)
        self.client = anthropic.Anthropic(api_key="test", base_url="http://orchard", http_client=httpx2.Client(transport=transport), max_retries=0)

    def handle(self, request: httpx2.Request) -> httpx2.Response:
        try:
            if request.url.path.endswith("/count_tokens"):
                ap.parse_count_tokens_request(request.content)
                return httpx2.Response(200, json=ap.count_tokens_response(42))
            req = ap.parse_messages_request(request.content)
            self.requests.append(req)
            if not req.stream:
                return httpx2.Response(200, json=ap.message_response(req.model, "msg_test", self.events))
        except ProtocolError as e:
            return httpx2.Response(e.status, json=ap.protocol_error_body(e))
        enc = ap.MessageStreamEncoder(req.model, "msg_test", input_tokens=self.input_tokens)
        data = enc.start() + b"".join(enc.feed(e) for e in self.events) + enc.close()
        return httpx2.Response(200, content=data, headers={"content-type": "text/event-stream"})


@pytest.fixture
def server() -> FakeServer:
    return FakeServer()


def sse_events(data: bytes) -> list[tuple[str, dict[str, Any]]]:
    """(event name, data) per SSE frame; every frame has both lines and they agree."""
    out = []
    for frame in data.decode("utf-8").split("\n\n"):
        if not frame:
            continue
        lines = frame.split("\n")
        assert lines[0].startswith("event: ") and lines[1].startswith("data: ") and len(lines) == 2, frame
        payload = json.loads(lines[1][len("data: ") :])
        assert payload["type"] == lines[0][len("event: ") :]
        out.append((payload["type"], payload))
    return out


def check_order(events: list[dict[str, Any]]) -> None:
    """Anthropic's stream grammar: message_start first; each block index starts once, in order from
    0, gets deltas of its own kind only while open, and stops once; message_delta then message_stop
    last, with no block left open."""
    assert events[0]["type"] == "message_start"
    assert [e["type"] for e in events[-2:]] == ["message_delta", "message_stop"]
    kinds: dict[int, str] = {}
    open_blocks: set[int] = set()
    delta_kind = {"text": "text_delta", "thinking": "thinking_delta", "tool_use": "input_json_delta"}
    for e in events[1:-2]:
        if e["type"] == "content_block_start":
            assert e["index"] == len(kinds)
            kinds[e["index"]] = e["content_block"]["type"]
            open_blocks.add(e["index"])
        elif e["type"] == "content_block_delta":
            assert e["index"] in open_blocks
            assert e["delta"]["type"] == delta_kind[kinds[e["index"]]]
        elif e["type"] == "content_block_stop":
            assert e["index"] in open_blocks
            open_blocks.remove(e["index"])
        else:
            assert e["type"] == "ping"
    assert not open_blocks


def stream(events: list[Any], **kw: Any) -> list[dict[str, Any]]:
    enc = ap.MessageStreamEncoder("qwen3-4b", "msg_test", **kw)
    data = enc.start() + b"".join(enc.feed(e) for e in events) + enc.close()
    parsed = [payload for _, payload in sse_events(data)]
    for payload in parsed:
        if payload["type"] != "error":
            STREAM_EVENT.validate_python(payload)
    return parsed


TOOL_TURN = [
    ReasoningDelta(text="The user wants "),
    ReasoningDelta(text="weather."),
    TextDelta(text="Let me check."),
    ToolCallStart(index=0, id="call_a", name="get_weather"),
    ToolCallArguments(index=0, arguments='{"city": '),
    ToolCallArguments(index=0, arguments='"Paris"}'),
    ToolCallEnd(index=0),
    ToolCallStart(index=1, id="call_b", name="get_weather"),
    ToolCallArguments(index=1, arguments='{"city": "Oslo"}'),
    ToolCallEnd(index=1),
    Finish(reason="tool_calls", prompt_tokens=120, completion_tokens=30, cached_tokens=100),
]


# ---- requests: translation -----------------------------------------------------------------------


def test_sdk_request_round_trip(server: FakeServer) -> None:
    server.events = [TextDelta(text="Hello"), Finish(reason="stop", prompt_tokens=5, completion_tokens=1)]
    message = server.client.messages.create(
        model="qwen3-4b",
        max_tokens=100,
        system="Be brief.",
        stop_sequences=["END"],
        metadata={"user_id": "u1"},
        extra_body={"temperature": 0.2, "top_p": 0.9, "top_k": 20},  # this SDK version dropped the sampling arguments
        messages=[{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "Again"}],
    )
    assert message.content[0].text == "Hello" and message.stop_reason == "end_turn"
    out = as_body(ap.to_chat_request(server.requests[0]))
    assert out == {
        "model": "qwen3-4b",
        "messages": [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Hello!"},
            {"role": "user", "content": "Again"},
        ],
        "max_tokens": 100,
        "temperature": 0.2,
        "top_p": 0.9,
        "top_k": 20,
        "stop": ["END"],
        "stream": False,
        "prompt_cache_key": "u1",  # metadata.user_id: the instance affinity's conversation key
    }
    assert_chat_shape(out)


def test_system_blocks_join_and_system_role_messages() -> None:
    out = chat(
        system=[{"type": "text", "text": "One."}, {"type": "text", "text": "Two.", "cache_control": {"type": "ephemeral"}}],
        messages=[{"role": "system", "content": "Mid."}, {"role": "user", "content": "Hi"}],
    )
    assert out["messages"] == [{"role": "system", "content": "One.\nTwo."}, {"role": "system", "content": "Mid."}, {"role": "user", "content": "Hi"}]
    assert_chat_shape(out)


def test_tool_round_trip_history() -> None:
    """tool_use -> assistant tool_calls (input as a JSON string); tool_result -> role tool messages
    with the function name, ahead of the turn's text; is_error marks the content; thinking dropped."""
    out = chat(
        tools=[WEATHER],
        messages=[
            {"role": "user", "content": "Weather in Paris and Oslo?"},
            {
                "role": "assistant",
                "content": [
                    {"type": "thinking", "thinking": "two calls", "signature": "sig"},
                    {"type": "redacted_thinking", "data": "xyz"},
                    {"type": "text", "text": "Checking."},
                    {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris"}},
                    {"type": "tool_use", "id": "toolu_2", "name": "get_weather", "input": {"city": "Oslo"}},
                ],
            },
            {
                "role": "user",
                "content": [
                    {"type": "tool_result", "tool_use_id": "toolu_1", "content": "18C"},
                    {"type": "tool_result", "tool_use_id": "toolu_2", "content": [{"type": "text", "text": "station down"}], "is_error": True},
                    {"type": "text", "text": "Summarise."},
                ],
            },
        ],
    )
    assert out["messages"][1:] == [
        {
            "role": "assistant",
            "content": "Checking.",
            "tool_calls": [
                {"id": "toolu_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
                {"id": "toolu_2", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}},
            ],
        },
        {"role": "tool", "tool_call_id": "toolu_1", "content": "18C", "name": "get_weather"},
        {"role": "tool", "tool_call_id": "toolu_2", "content": "Error: station down", "name": "get_weather"},
        {"role": "user", "content": "Summarise."},
    ]
    assert out["tools"] == [
        {"type": "function", "function": {"name": "get_weather", "description": "Weather for a city", "parameters": WEATHER["input_schema"]}}
    ]
    assert_chat_shape(out)


def test_assistant_tool_use_only_has_null_content() -> None:
    out = chat(
        messages=[
            {"role": "user", "content": "x"},
            {"role": "assistant", "content": [{"type": "tool_use", "id": "t", "name": "f", "input": {}}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t"}]},
        ]
    )
    assert out["messages"][1]["content"] is None and out["messages"][1]["tool_calls"][0]["function"]["arguments"] == "{}"
    assert out["messages"][2] == {"role": "tool", "tool_call_id": "t", "content": "", "name": "f"}
    assert_chat_shape(out)


def test_images_base64_and_url() -> None:
    out = chat(
        messages=[
            {
                "role": "user",
                "content": [
                    {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": PNG}},
                    {"type": "image", "source": {"type": "url", "url": "https://example.com/cat.jpg"}},
                    {"type": "text", "text": "Compare."},
                ],
            }
        ]
    )
    assert out["messages"] == [
        {
            "role": "user",
            "content": [
                {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{PNG}"}},
                {"type": "image_url", "image_url": {"url": "https://example.com/cat.jpg"}},
                {"type": "text", "text": "Compare."},
            ],
        }
    ]
    assert_chat_shape(out)


def test_images_in_tool_results_follow_as_a_user_message() -> None:
    out = chat(
        messages=[
            {"role": "user", "content": "Screenshot?"},
            {"role": "assistant", "content": [{"type": "tool_use", "id": "t", "name": "shot", "input": {}}]},
            {
                "role": "user",
                "content": [
                    {
                        "type": "tool_result",
                        "tool_use_id": "t",
                        "content": [
                            {"type": "text", "text": "done"},
                            {"type": "image", "source": {"type": "base64", "media_type": "image/jpeg", "data": PNG}},
                        ],
                    }
                ],
            },
        ]
    )
    assert out["messages"][2:] == [
        {"role": "tool", "tool_call_id": "t", "content": "done", "name": "shot"},
        {"role": "user", "content": [{"type": "image_url", "image_url": {"url": f"data:image/jpeg;base64,{PNG}"}}]},
    ]
    assert_chat_shape(out)


@pytest.mark.parametrize(
    ("choice", "expected", "parallel"),
    [
        ({"type": "auto"}, "auto", None),
        ({"type": "any"}, "required", None),
        ({"type": "none"}, "none", None),
        ({"type": "tool", "name": "get_weather"}, {"type": "function", "function": {"name": "get_weather"}}, None),
        ({"type": "any", "disable_parallel_tool_use": True}, "required", False),
    ],
)
def test_tool_choice_mapping(choice: dict, expected: Any, parallel: bool | None) -> None:
    out = chat(tools=[WEATHER], tool_choice=choice)
    assert out["tool_choice"] == expected
    assert out.get("parallel_tool_calls") == parallel
    assert_chat_shape(out)


def test_a_final_empty_assistant_turn_is_accepted() -> None:
    out = chat(messages=[{"role": "user", "content": "Hi"}, {"role": "assistant", "content": []}])
    assert out["messages"][-1] == {"role": "assistant", "content": ""}


def test_thinking_output_format_and_effort() -> None:
    assert chat(thinking={"type": "enabled", "budget_tokens": 2048})["chat_template_kwargs"] == {"enable_thinking": True}
    assert chat(thinking={"type": "adaptive"})["chat_template_kwargs"] == {"enable_thinking": True}
    assert chat(thinking={"type": "disabled"})["chat_template_kwargs"] == {"enable_thinking": False}
    assert "chat_template_kwargs" not in chat()
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    out = chat(output_config={"format": {"type": "json_schema", "schema": schema}, "effort": "low"})
    assert out["response_format"] == {"type": "json_schema", "json_schema": {"name": "output", "schema": schema}}
    assert out["reasoning_effort"] == "low"
    _drain(CHAT_PARAMS.validate_python(out))


def test_ignored_hints_are_accepted() -> None:
    req = ap.parse_messages_request(
        body(
            metadata={"user_id": "u"},
            service_tier="auto",
            cache_control={"type": "ephemeral"},
            inference_geo="us",
            context_management={"edits": []},
            stream=False,
            messages=[{"role": "user", "content": [{"type": "text", "text": "Hi", "cache_control": {"type": "ephemeral"}, "citations": None}]}],
        )
    )
    assert as_body(ap.to_chat_request(req))["messages"] == [{"role": "user", "content": "Hi"}]


def test_response_message_sent_back_as_history_is_accepted(server: FakeServer) -> None:
    """message.to_param() (SDK objects with caller / citations keys) is valid history."""
    server.events = TOOL_TURN
    first = server.client.messages.create(model="m", max_tokens=50, tools=[WEATHER], messages=[{"role": "user", "content": "Weather?"}])
    server.events = [TextDelta(text="Both mild."), Finish(reason="stop")]
    server.client.messages.create(
        model="m",
        max_tokens=50,
        tools=[WEATHER],
        messages=[
            {"role": "user", "content": "Weather?"},
            first.to_param(),
            {
                "role": "user",
                "content": [
                    {"type": "tool_result", "tool_use_id": "call_a", "content": "18C"},
                    {"type": "tool_result", "tool_use_id": "call_b", "content": "9C"},
                ],
            },
        ],
    )
    out = as_body(ap.to_chat_request(server.requests[1]))
    assert [m["role"] for m in out["messages"]] == ["user", "assistant", "tool", "tool"]
    assert out["messages"][1]["tool_calls"][1]["function"] == {"name": "get_weather", "arguments": '{"city": "Oslo"}'}
    assert_chat_shape(out)


def test_count_tokens(server: FakeServer) -> None:
    count = server.client.messages.count_tokens(model="m", system="s", messages=[{"role": "user", "content": "Hi"}], tools=[WEATHER])
    assert count.input_tokens == 42
    out = as_body(ap.to_chat_request(ap.parse_count_tokens_request({"model": "m", "messages": [{"role": "user", "content": "Hi"}]})))
    assert out == {"model": "m", "messages": [{"role": "user", "content": "Hi"}]}  # no sampling, no max_tokens


# ---- requests: errors ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("request_body", "where"),
    [
        ({"model": "m", "messages": [{"role": "user", "content": "x"}]}, "max_tokens: Field required"),
        (body(frequency_penalty=1), "frequency_penalty: Extra inputs are not permitted"),
        (body(max_tokens=0), "max_tokens:"),
        (body(temperature=1.5), "temperature:"),
        (body(messages=[]), "messages:"),
        (
            body(
                messages=[
                    {"role": "user", "content": [{"type": "document", "source": {"type": "base64", "media_type": "application/pdf", "data": "x"}}]}
                ]
            ),
            "messages.0.content.0.type: document blocks",
        ),
        (
            body(messages=[{"role": "user", "content": [{"type": "image", "source": {"type": "file", "file_id": "f"}}]}]),
            "messages.0.content.0.source.type: file sources",
        ),
        (
            body(messages=[{"role": "user", "content": [{"type": "image", "source": {"type": "base64", "media_type": "image/tiff", "data": "x"}}]}]),
            "messages.0.content.0.source.media_type",
        ),
        (
            body(messages=[{"role": "user", "content": [{"type": "image", "source": {"type": "base64", "media_type": "image/png"}}]}]),
            "messages.0.content.0.source.data",
        ),
        (body(messages=[{"role": "user", "content": [{"type": "hologram"}]}]), "unknown content block type 'hologram'"),
        (
            body(messages=[{"role": "user", "content": [{"type": "tool_use", "id": "t", "name": "f", "input": {}}]}]),
            "messages.0.content.0.type: user messages take",
        ),
        (
            body(messages=[{"role": "assistant", "content": [{"type": "tool_result", "tool_use_id": "t"}]}]),
            "messages.0.content.0.type: assistant messages take",
        ),
        (body(messages=[{"role": "user", "content": [{"type": "tool_result", "content": "x"}]}]), "messages.0.content.0.tool_use_id: Field required"),
        (
            body(messages=[{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t", "content": [{"type": "search_result"}]}]}]),
            "messages.0.content.0.content.0.type",
        ),
        (body(system=[{"type": "image", "source": {}}]), "system.0.type: system takes text blocks"),
        (body(tools=[{"type": "web_search_20250305", "name": "web_search"}]), "tools.0.type: server tools are not supported"),
        (body(tools=[{"name": "f"}]), "tools.0.input_schema: Field required"),
        # issue 25 item 7: a forced call's grammar needs an object schema (was a 500)
        (
            body(tools=[{"name": "f", "input_schema": {"type": "string"}}], tool_choice={"type": "tool", "name": "f"}),
            "tools.0.input_schema: input_schema must",
        ),
        (body(tool_choice={"type": "any"}), "tool_choice.type: tool_choice 'any' needs tools"),
        (body(tools=[WEATHER], tool_choice={"type": "tool", "name": "nope"}), "tool_choice.name: tool 'nope' is not in tools"),
        (body(tools=[WEATHER], tool_choice={"type": "tool"}), "tool_choice.name: Field required"),
        (body(thinking={"type": "enabled"}), "thinking.budget_tokens: Field required"),
        (body(stop_sequences=[f"s{i}" for i in range(MAX_STOP + 1)]), "stop_sequences: at most"),
        (body(container="c1"), "container: containers"),
        (body(mcp_servers=[{"type": "url", "url": "https://x", "name": "x"}]), "mcp_servers: MCP servers"),
        # rules the chat request has too, checked here once, under the Messages field names
        (body(tools=[{**WEATHER, "name": "get weather!"}]), "tools.0.name"),
        (body(tools=[WEATHER, WEATHER]), "tools: tool names must be unique"),
        (body(messages=[{"role": "user", "content": []}]), "messages.0.content: all messages must have non-empty content"),
        (
            body(messages=[{"role": "user", "content": "Hi"}, {"role": "assistant", "content": []}, {"role": "user", "content": "?"}]),
            "messages.1.content",
        ),
    ],
)
def test_rejections_name_the_field(request_body: dict, where: str) -> None:
    e = rejected(request_body)
    assert e.message.startswith(where) or where in e.message, e.message


def test_bad_json_and_non_objects() -> None:
    for raw in (b"{", b"[1]", "3"):
        with pytest.raises(ProtocolError) as e:
            ap.parse_messages_request(raw)
        assert e.value.status == 400


def test_errors_reach_the_sdk_as_its_exceptions(server: FakeServer) -> None:
    with pytest.raises(anthropic.BadRequestError) as e:
        server.client.messages.create(
            model="m",
            max_tokens=5,
            messages=[{"role": "user", "content": [{"type": "document", "source": {"type": "text", "media_type": "text/plain", "data": "x"}}]}],
        )
    assert e.value.body["error"]["type"] == "invalid_request_error"
    assert "messages.0.content.0.type" in e.value.body["error"]["message"]


def test_fastapi_style_errors() -> None:
    """RequestValidationError.errors() locations start with "body"."""
    e = ap.validation_error(
        [
            {"loc": ("body", "messages", 0, "role"), "msg": "Input should be 'user'", "type": "literal_error"},
            {"loc": ("body", "model"), "msg": "Field required", "type": "missing"},
        ]
    )
    assert e.message == "messages.0.role: Input should be 'user' (1 more error in the request)"
    assert ap.protocol_error_body(e) == {"type": "error", "error": {"type": "invalid_request_error", "message": e.message}}


@pytest.mark.parametrize(
    ("status", "code", "kind"),
    [
        (400, "context_length_exceeded", "invalid_request_error"),
        (401, None, "authentication_error"),
        (403, None, "permission_error"),
        (404, "not_found", "not_found_error"),
        (413, None, "request_too_large"),
        (429, None, "rate_limit_error"),
        (499, "cancelled", "invalid_request_error"),
        (500, "internal", "api_error"),
        (503, "engine_stopped", "overloaded_error"),
        (503, "unavailable", "overloaded_error"),
        (503, "load_failed", "api_error"),
        (504, None, "timeout_error"),
        (529, None, "overloaded_error"),
    ],
)
def test_error_type_mapping(status: int, code: str | None, kind: str) -> None:
    assert ap.error_type(status, code) == kind
    assert ap.error_body(status, "m", code) == {"type": "error", "error": {"type": kind, "message": "m"}}


# ---- non-streaming responses ---------------------------------------------------------------------


def test_message_response_parses_with_the_sdk() -> None:
    out = ap.message_response("qwen3-4b", "msg_1", TOOL_TURN)
    message = Message.model_validate(out)
    assert [b.type for b in message.content] == ["thinking", "text", "tool_use", "tool_use"]
    assert message.content[0].thinking == "The user wants weather."
    assert message.content[2].input == {"city": "Paris"} and message.content[2].id == "call_a"
    assert message.stop_reason == "tool_use" and message.stop_sequence is None
    assert message.usage.input_tokens == 20 and message.usage.cache_read_input_tokens == 100 and message.usage.output_tokens == 30


@pytest.mark.parametrize(
    ("finish", "reason", "sequence"),
    [
        (Finish(reason="stop"), "end_turn", None),
        (Finish(reason="stop", stop_sequence="END"), "stop_sequence", "END"),
        (Finish(reason="length"), "max_tokens", None),
        (Finish(reason="tool_calls"), "tool_use", None),
    ],
)
def test_stop_reasons(finish: Finish, reason: str, sequence: str | None) -> None:
    message = Message.model_validate(ap.message_response("m", "msg_1", [TextDelta(text="x"), finish]))
    assert (message.stop_reason, message.stop_sequence) == (reason, sequence)


def test_empty_generation_has_no_blocks() -> None:
    message = Message.model_validate(ap.message_response("m", "msg_1", [TextDelta(text=""), Finish(reason="length")]))
    assert message.content == [] and message.stop_reason == "max_tokens"


def test_failed_generations_raise() -> None:
    with pytest.raises(ProtocolError) as e:
        ap.message_response("m", "msg_1", [TextDelta(text="x"), Finish(reason="error", error="boom", error_code="context_length_exceeded")])
    assert (e.value.status, e.value.message) == (400, "boom")
    assert ap.protocol_error_body(e.value)["error"]["type"] == "invalid_request_error"
    with pytest.raises(ProtocolError) as e:
        ap.message_response("m", "msg_1", [Finish(reason="error")])
    assert e.value.status == 500
    with pytest.raises(ProtocolError) as e:
        ap.message_response("m", "msg_1", [Finish(reason="cancelled")])
    assert e.value.status == 499
    with pytest.raises(ProtocolError):
        ap.message_response("m", "msg_1", [TextDelta(text="x")])


def test_unreadable_tool_arguments_are_a_server_error() -> None:
    assert ap.tool_input("") == {}
    for bad in ("[1]", "{oops"):
        with pytest.raises(ProtocolError) as e:
            ap.tool_input(bad)
        assert e.value.status == 500


# ---- streaming -----------------------------------------------------------------------------------


def test_stream_event_sequence() -> None:
    events = stream(TOOL_TURN, input_tokens=120)
    check_order(events)
    assert [(e["type"], e.get("index")) for e in events] == [
        ("message_start", None),
        ("content_block_start", 0),
        ("content_block_delta", 0),
        ("content_block_delta", 0),
        ("content_block_stop", 0),
        ("content_block_start", 1),
        ("content_block_delta", 1),
        ("content_block_stop", 1),
        ("content_block_start", 2),
        ("content_block_delta", 2),
        ("content_block_delta", 2),
        ("content_block_stop", 2),
        ("content_block_start", 3),
        ("content_block_delta", 3),
        ("content_block_stop", 3),
        ("message_delta", None),
        ("message_stop", None),
    ]
    assert events[0]["message"]["usage"] == {"input_tokens": 120, "output_tokens": 0}
    assert events[1]["content_block"] == {"type": "thinking", "thinking": "", "signature": ""}
    assert events[8]["content_block"] == {"type": "tool_use", "id": "call_a", "name": "get_weather", "input": {}}
    assert events[-2]["delta"] == {"stop_reason": "tool_use", "stop_sequence": None}
    assert events[-2]["usage"] == {"input_tokens": 20, "output_tokens": 30, "cache_read_input_tokens": 100, "cache_creation_input_tokens": 0}


def test_sdk_stream_accumulates_to_the_non_stream_message(server: FakeServer) -> None:
    server.events = TOOL_TURN
    server.input_tokens = 120
    with server.client.messages.stream(model="qwen3-4b", max_tokens=50, tools=[WEATHER], messages=[{"role": "user", "content": "Weather?"}]) as s:
        texts = list(s.text_stream)
        final = s.get_final_message()
    assert texts == ["Let me check."]
    expected = Message.model_validate(ap.message_response("qwen3-4b", "msg_test", TOOL_TURN))
    assert final.model_dump(exclude_none=True) == expected.model_dump(exclude_none=True)
    assert final.usage.input_tokens == 20  # message_delta's count replaced message_start's


def test_sdk_raw_stream_events(server: FakeServer) -> None:
    server.events = [TextDelta(text="a"), TextDelta(text="b"), Finish(reason="stop", stop_sequence="###")]
    kinds = [
        type(e).__name__ for e in server.client.messages.create(model="m", max_tokens=5, stream=True, messages=[{"role": "user", "content": "x"}])
    ]
    assert kinds == [
        "RawMessageStartEvent",
        "RawContentBlockStartEvent",
        "RawContentBlockDeltaEvent",
        "RawContentBlockDeltaEvent",
        "RawContentBlockStopEvent",
        "RawMessageDeltaEvent",
        "RawMessageStopEvent",
    ]


def test_mid_stream_error_is_an_anthropic_error_event(server: FakeServer) -> None:
    events = stream([TextDelta(text="partial"), Finish(reason="error", error="engine stopped", error_code="engine_stopped")])
    assert [e["type"] for e in events] == ["message_start", "content_block_start", "content_block_delta", "error"]
    assert events[-1] == {"type": "error", "error": {"type": "overloaded_error", "message": "engine stopped"}}
    server.events = [TextDelta(text="partial"), Finish(reason="error", error="boom")]
    with (
        pytest.raises(anthropic.APIStatusError) as e,
        server.client.messages.stream(model="m", max_tokens=5, messages=[{"role": "user", "content": "x"}]) as s,
    ):
        s.get_final_message()
    assert e.value.body == {"type": "error", "error": {"type": "api_error", "message": "boom"}}


def test_stream_lifecycle_edges() -> None:
    enc = ap.MessageStreamEncoder("m", "msg_1")
    assert enc.start().startswith(b"event: message_start\n") and enc.start() == b""
    assert enc.ping() == b'event: ping\ndata: {"type":"ping"}\n\n'
    assert enc.feed(Finish(reason="cancelled")) == b""  # the client is gone: nothing more
    assert enc.close() == b"" and enc.feed(TextDelta(text="late")) == b""

    enc = ap.MessageStreamEncoder("m", "msg_1")
    assert enc.feed(Finish(reason="cancelled")) == b"" and enc.close() == b""  # cancelled before anything was sent

    enc = ap.MessageStreamEncoder("m", "msg_1")
    closed = [payload for _, payload in sse_events(enc.close())]  # no Finish at all
    assert [e["type"] for e in closed] == ["message_start", "error"] and closed[1]["error"]["type"] == "api_error"
    assert enc.error(500, "again") == b""

    enc = ap.MessageStreamEncoder("m", "msg_1")
    enc.feed(TextDelta(text="x"))
    enc.feed(Finish(reason="stop"))
    assert enc.close() == b"" and enc.error(500, "late") == b""


def test_unterminated_tool_call_and_text_after_tools() -> None:
    """A call the parser never ended is closed at the Finish; text after a call is a new block."""
    events = stream(
        [
            ToolCallStart(index=0, id="c0", name="f"),
            ToolCallArguments(index=0, arguments="{}"),
            ToolCallEnd(index=0),
            TextDelta(text="and"),
            ToolCallStart(index=1, id="c1", name="f"),
            ToolCallArguments(index=1, arguments='{"x": 1}'),
            Finish(reason="tool_calls"),
        ]
    )
    check_order(events)
    starts = [e["content_block"]["type"] for e in events if e["type"] == "content_block_start"]
    assert starts == ["tool_use", "text", "tool_use"]


# ---- property: any event sequence streams and accumulates to the non-stream message ---------------


@st.composite
def generations(draw: st.DrawFn) -> list[Any]:
    """Event sequences as the parser chain emits them: runs of reasoning / text deltas and whole
    tool calls (arguments split anywhere), then one Finish."""
    events: list[Any] = []
    calls = 0
    chunks = st.lists(st.text(min_size=0, max_size=6), min_size=1, max_size=4)
    for kind in draw(st.lists(st.sampled_from(["text", "reasoning", "tool"]), max_size=6)):
        if kind == "tool":
            args = json.dumps(draw(st.dictionaries(st.text(max_size=5), st.integers() | st.text(max_size=5), max_size=3)))
            cuts = sorted(draw(st.lists(st.integers(0, len(args)), max_size=3)))
            pieces = [args[a:b] for a, b in zip([0, *cuts], [*cuts, len(args)], strict=True)]
            events.append(ToolCallStart(index=calls, id=f"call_{calls}", name=draw(st.sampled_from(["f", "g"]))))
            events += [ToolCallArguments(index=calls, arguments=p) for p in pieces]
            events.append(ToolCallEnd(index=calls))
            calls += 1
        else:
            cls = TextDelta if kind == "text" else ReasoningDelta
            events += [cls(text=t) for t in draw(chunks)]
    reason = draw(st.sampled_from(["stop", "length"] + (["tool_calls"] if calls else [])))
    stop = draw(st.none() | st.just("END")) if reason == "stop" else None
    prompt = draw(st.integers(0, 500))
    events.append(
        Finish(
            reason=reason,
            prompt_tokens=prompt,
            completion_tokens=draw(st.integers(0, 500)),
            cached_tokens=draw(st.integers(0, prompt)),
            stop_sequence=stop,
        )
    )
    return events


PROPERTY_SERVER = FakeServer()


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(generations())
def test_any_generation_streams_validly_and_accumulates(events: list[Any]) -> None:
    check_order(stream(events))
    expected = Message.model_validate(ap.message_response("m", "msg_test", events))
    PROPERTY_SERVER.events = events
    with PROPERTY_SERVER.client.messages.stream(model="m", max_tokens=5, messages=[{"role": "user", "content": "x"}]) as s:
        final = s.get_final_message()
    assert final.model_dump(exclude_none=True) == expected.model_dump(exclude_none=True)
    text = "".join(e.text for e in events if isinstance(e, TextDelta))
    assert "".join(b.text for b in expected.content if b.type == "text") == text


def test_request_models_are_frozen() -> None:
    req = ap.parse_messages_request(body())
    with pytest.raises(ValidationError):
        req.max_tokens = 5  # type: ignore[misc]


# ---- any accepted request builds a valid chat request (one validation, tests/support/chat_body.py) ----

_names = st.sampled_from(["get_weather", "f", "lookup-2", "x_y"])
_text_block = st.builds(lambda t: {"type": "text", "text": t}, st.text(max_size=12))
_image_block = st.sampled_from(
    [
        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "iVBORw0KGgo="}},
        {"type": "image", "source": {"type": "url", "url": "https://example.com/a.png"}},
    ]
)
_tool_use = st.builds(
    lambda i, n, a: {"type": "tool_use", "id": f"t{i}", "name": n, "input": a},
    st.integers(0, 3),
    _names,
    st.dictionaries(st.sampled_from("ab"), st.integers(), max_size=2),
)
_tool_result = st.builds(
    lambda i, c, err: {"type": "tool_result", "tool_use_id": f"t{i}", "content": c, **({"is_error": err} if err is not None else {})},
    st.integers(0, 3),
    st.one_of(st.text(max_size=8), st.lists(st.one_of(_text_block, _image_block), max_size=2)),
    st.one_of(st.none(), st.booleans()),
)
_user = st.builds(
    lambda c: {"role": "user", "content": c}, st.one_of(st.text(max_size=8), st.lists(st.one_of(_text_block, _image_block, _tool_result), max_size=3))
)
_assistant = st.builds(
    lambda c: {"role": "assistant", "content": c},
    st.one_of(
        st.text(max_size=8),
        st.lists(st.one_of(_text_block, _tool_use, st.just({"type": "thinking", "thinking": "hm", "signature": "s"})), max_size=3),
    ),
)
_tool = st.builds(
    lambda n, d, strict: {
        "name": n,
        "input_schema": {"type": "object"},
        **({"description": d} if d else {}),
        **({"strict": strict} if strict is not None else {}),
    },
    _names,
    st.one_of(st.none(), st.text(max_size=6)),
    st.one_of(st.none(), st.booleans()),
)
_choice = st.one_of(
    st.none(),
    st.builds(
        lambda t, n, p: {"type": t, **({"name": n} if t == "tool" else {}), **({"disable_parallel_tool_use": p} if p is not None else {})},
        st.sampled_from(["auto", "any", "tool", "none"]),
        _names,
        st.one_of(st.none(), st.booleans()),
    ),
)


@st.composite
def messages_requests(draw: st.DrawFn) -> dict[str, Any]:
    out: dict[str, Any] = {
        "model": "m",
        "max_tokens": draw(st.integers(1, 100)),
        "messages": draw(st.lists(st.one_of(_user, _assistant), min_size=1, max_size=4)),
    }
    optional = {
        "system": st.one_of(st.text(max_size=8), st.lists(_text_block, max_size=2)),
        "tools": st.lists(_tool, max_size=3, unique_by=lambda t: t["name"]),
        "tool_choice": _choice,
        "thinking": st.sampled_from([{"type": "enabled", "budget_tokens": 64}, {"type": "disabled"}, {"type": "adaptive"}]),
        "output_config": st.sampled_from([{"format": {"type": "json_schema", "schema": {"type": "object"}}}, {"effort": "low"}]),
        "stop_sequences": st.lists(st.text(max_size=4), max_size=3),
        "temperature": st.floats(0, 1),
        "top_p": st.floats(0, 1),
        "top_k": st.integers(0, 50),
        "stream": st.booleans(),
    }
    return out | some_of(draw, optional)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(messages_requests())
def test_any_accepted_messages_request_builds_the_chat_request_validation_would(request_body: dict[str, Any]) -> None:
    chat_body = translation_of(ap.parse_messages_request, ap.to_chat_request, request_body)
    if chat_body is not None:
        assert_chat_shape({k: v for k, v in chat_body.items() if k != "stream"})  # CHAT_PARAMS is the non-streaming type
