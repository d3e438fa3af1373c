"""OpenAI Responses (router/responses_protocol.py): requests as the openai SDK sends them parse and
translate to OpenAI chat bodies; state Orchard does not keep is a 400 naming the field;
Response objects and SSE streams built from output events parse with the SDK's own models, keep
the Responses event order and sequence numbers, and accumulate (responses.stream ->
get_final_response) to the non-streaming Response. Pure Python: the SDK talks to a mock transport."""

import json
from typing import Any

import httpx2
import openai
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st
from openai.types.chat import completion_create_params
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import TypeAdapter, ValidationError
from support.chat_body import as_body, some_of, translation_of

from router.protocols import responses as rp
from router.protocols.events import Finish, ReasoningDelta, TextDelta, ToolCallArguments, ToolCallEnd, ToolCallStart
from router.protocols.openai import ProtocolError, error_body

STREAM_EVENT = TypeAdapter(ResponseStreamEvent)
CHAT_PARAMS = TypeAdapter(completion_create_params.CompletionCreateParamsNonStreaming)
IMAGE = "data:image/png;base64,iVBORw0KGgo="

WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "Weather for a city",
    "strict": True,
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"], "additionalProperties": False},
}
CHAT_WEATHER = {
    "type": "function",
    "function": {"name": "get_weather", "description": "Weather for a city", "parameters": WEATHER["parameters"], "strict": True},
}


def request(**kw: Any) -> rp.ResponsesRequest:
    return rp.parse_responses_request({"model": "qwen3-4b", "input": "Hi", **kw})


def chat(**kw: Any) -> dict[str, Any]:
    return as_body(rp.to_chat_request(request(**kw)))


def _drain(v: Any) -> Any:
    """The SDK's TypedDicts validate iterables lazily: walk them so every item is checked."""
    if isinstance(v, dict):
        return {k: _drain(x) for k, x in v.items()}
    if isinstance(v, list | tuple) or hasattr(v, "__next__"):
        return [_drain(x) for x in v]
    return v


def assert_chat_shape(chat_body: dict[str, Any]) -> None:
    """An OpenAI chat request as the openai SDK types it (as_body checked that Orchard's own
    ChatCompletionRequest gives back the built request)."""
    _drain(CHAT_PARAMS.validate_python(chat_body))


def rejected(body: dict[str, Any]) -> ProtocolError:
    with pytest.raises(ProtocolError) as e:
        rp.parse_responses_request({"model": "m", **body})
    assert e.value.status == 400 and e.value.body()["error"]["type"] == "invalid_request_error"
    return e.value


# ---- a fake Orchard behind the SDK ---------------------------------------------------------------


class FakeServer:
    """Serves /v1/responses from a scripted event list through the encoders under test."""

    def __init__(self) -> None:
        self.events: list[Any] = []
        self.requests: list[rp.ResponsesRequest] = []
        transport = httpx2.MockTransport(self.handle)
        self.client = openai.OpenAI(api_key="test", base_url="http://orchard/v1", http_client=httpx2.Client(transport=transport), max_retries=0)

    def handle(self, http_request: httpx2.Request) -> httpx2.Response:
        try:
            req = rp.parse_responses_request(http_request.content)
            self.requests.append(req)
            if not req.stream:
                return httpx2.Response(200, json=rp.response_object(req, "resp_test", self.events, created_at=1700000000))
        except ProtocolError as e:
            return httpx2.Response(e.status, json=e.body())
        enc = rp.ResponseStreamEncoder(req, "resp_test", created_at=1700000000)
        data = enc.start() + b"".join(enc.feed(e) for e in self.events) + enc.close()
        return httpx2.Response(200, content=data, headers={"content-type": "text/event-stream"})


@pytest.fixture
def server() -> FakeServer:
    return FakeServer()


def sse_events(data: bytes) -> list[dict[str, Any]]:
    out = []
    for frame in data.decode("utf-8").split("\n\n"):
        if not frame:
            continue
        name, payload = frame.split("\n")
        event = json.loads(payload.removeprefix("data: "))
        assert name == f"event: {event['type']}"
        out.append(event)
    return out


def stream(req: rp.ResponsesRequest, events: list[Any]) -> list[dict[str, Any]]:
    enc = rp.ResponseStreamEncoder(req, "resp_test", created_at=1700000000)
    parsed = sse_events(enc.start() + b"".join(enc.feed(e) for e in events) + enc.close())
    for event in parsed:
        STREAM_EVENT.validate_python(event)
    return parsed


def check_order(events: list[dict[str, Any]]) -> None:
    """The Responses stream grammar: sequence numbers 0..n-1; created, in_progress first and one
    terminal event last; each output item added once (indexes 0, 1, ...), its parts and deltas
    only while it is open, the done texts equal to the deltas joined, and the item done once; the
    terminal Response lists exactly the done items."""
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert [e["type"] for e in events[:2]] == ["response.created", "response.in_progress"]
    assert events[-1]["type"] in ("response.completed", "response.incomplete", "response.failed")
    items: dict[int, dict[str, Any]] = {}
    open_items: set[int] = set()
    done: dict[int, dict[str, Any]] = {}
    text: dict[int, str] = {}
    for e in events[2:-1]:
        kind = e["type"]
        if kind == "response.output_item.added":
            assert e["output_index"] == len(items)
            items[e["output_index"]] = e["item"]
            open_items.add(e["output_index"])
            text[e["output_index"]] = ""
            continue
        if kind == "error":
            continue
        index = e["output_index"]
        assert index in open_items, kind
        if "item_id" in e:
            assert e["item_id"] == items[index]["id"]
        if kind in ("response.output_text.delta", "response.reasoning_text.delta", "response.function_call_arguments.delta"):
            text[index] += e["delta"]
        elif kind in ("response.output_text.done", "response.reasoning_text.done"):
            assert e["text"] == text[index]
        elif kind == "response.function_call_arguments.done":
            assert e["arguments"] == text[index]
        elif kind == "response.output_item.done":
            open_items.remove(index)
            done[index] = e["item"]
    final = events[-1]["response"]
    if final["status"] != "failed":
        assert not open_items
        assert final["output"] == [done[i] for i in sorted(done)]


TOOL_TURN = [
    ReasoningDelta(text="Two cities, "),
    ReasoningDelta(text="two calls."),
    TextDelta(text="Checking."),
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
    """What `client.responses.create(...)` sends (store defaults to true server-side: accepted)."""
    server.events = [TextDelta(text="Hello"), Finish(reason="stop", prompt_tokens=5, completion_tokens=1)]
    response = server.client.responses.create(
        model="qwen3-4b",
        instructions="Be brief.",
        input="Hi",
        max_output_tokens=100,
        temperature=0.2,
        top_p=0.9,
        store=True,
        metadata={"run": "1"},
        user="u",
        truncation="auto",
        include=["reasoning.encrypted_content"],
        extra_body={"top_k": 20},
    )
    assert response.output_text == "Hello" and response.status == "completed"
    assert response.metadata == {"run": "1"}
    out = as_body(rp.to_chat_request(server.requests[0]))
    assert out == {
        "model": "qwen3-4b",
        "messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}],
        "max_tokens": 100,
        "temperature": 0.2,
        "top_p": 0.9,
        "top_k": 20,
        "stream": False,
    }
    assert_chat_shape(out)


def test_message_items_and_roles() -> None:
    out = chat(
        input=[
            {"role": "developer", "content": "Rules."},
            {"role": "system", "content": [{"type": "input_text", "text": "More rules."}]},
            {
                "role": "user",
                "content": [
                    {"type": "input_text", "text": "Look:"},
                    {"type": "input_image", "image_url": IMAGE, "detail": "low"},
                    {"type": "input_image", "image_url": "https://example.com/a.png", "detail": "original"},
                ],
            },
            {
                "type": "message",
                "role": "assistant",
                "id": "msg_1",
                "status": "completed",
                "content": [{"type": "output_text", "text": "A cat.", "annotations": []}],
            },
            {"role": "assistant", "content": "Plain string."},
            {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Thanks"}]},
        ]
    )
    assert out["messages"] == [
        {"role": "system", "content": "Rules."},
        {"role": "system", "content": "More rules."},
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "Look:"},
                {"type": "image_url", "image_url": {"url": IMAGE, "detail": "low"}},
                {"type": "image_url", "image_url": {"url": "https://example.com/a.png"}},
            ],
        },
        {"role": "assistant", "content": "A cat."},
        {"role": "assistant", "content": "Plain string."},
        {"role": "user", "content": "Thanks"},
    ]
    assert_chat_shape(out)


def test_function_call_round_trip_history() -> None:
    """function_call items join the assistant message before them; outputs become tool messages
    with the function name; output images follow as a user message; reasoning items are dropped."""
    out = chat(
        tools=[WEATHER],
        input=[
            {"role": "user", "content": "Weather in Paris and Oslo?"},
            {"type": "reasoning", "id": "rs_1", "summary": [], "content": [{"type": "reasoning_text", "text": "two calls"}]},
            {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Checking.", "annotations": []}]},
            {
                "type": "function_call",
                "call_id": "call_a",
                "name": "get_weather",
                "arguments": '{"city":"Paris"}',
                "id": "fc_1",
                "status": "completed",
            },
            {"type": "function_call", "call_id": "call_b", "name": "get_weather", "arguments": '{"city":"Oslo"}'},
            {"type": "function_call_output", "call_id": "call_a", "output": "18C"},
            {
                "type": "function_call_output",
                "call_id": "call_b",
                "output": [{"type": "input_text", "text": "9C"}, {"type": "input_image", "image_url": IMAGE}],
            },
            {"role": "user", "content": "Summarise."},
        ],
    )
    assert out["messages"] == [
        {"role": "user", "content": "Weather in Paris and Oslo?"},
        {
            "role": "assistant",
            "content": "Checking.",
            "tool_calls": [
                {"id": "call_a", "type": "function", "function": {"name": "get_weather", "arguments": '{"city":"Paris"}'}},
                {"id": "call_b", "type": "function", "function": {"name": "get_weather", "arguments": '{"city":"Oslo"}'}},
            ],
        },
        {"role": "tool", "tool_call_id": "call_a", "content": "18C", "name": "get_weather"},
        {"role": "tool", "tool_call_id": "call_b", "content": "9C", "name": "get_weather"},
        {"role": "user", "content": [{"type": "image_url", "image_url": {"url": IMAGE}}]},
        {"role": "user", "content": "Summarise."},
    ]
    assert out["tools"] == [CHAT_WEATHER]
    assert_chat_shape(out)


def test_function_call_without_preceding_text() -> None:
    out = chat(
        input=[
            {"role": "user", "content": "x"},
            {"type": "function_call", "call_id": "c", "name": "f", "arguments": "{}"},
            {"type": "function_call_output", "call_id": "c", "output": "ok"},
        ]
    )
    assert out["messages"][1] == {
        "role": "assistant",
        "content": None,
        "tool_calls": [{"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}],
    }
    assert_chat_shape(out)


@pytest.mark.parametrize(
    ("choice", "expected", "tools"),
    [
        ("auto", "auto", ["get_weather", "get_time"]),
        ("none", "none", ["get_weather", "get_time"]),
        ("required", "required", ["get_weather", "get_time"]),
        ({"type": "function", "name": "get_time"}, {"type": "function", "function": {"name": "get_time"}}, ["get_weather", "get_time"]),
        ({"type": "allowed_tools", "mode": "required", "tools": [{"type": "function", "name": "get_time"}]}, "required", ["get_time"]),
    ],
)
def test_tool_choice_mapping(choice: Any, expected: Any, tools: list[str]) -> None:
    time_tool = {"type": "function", "name": "get_time", "parameters": {"type": "object", "properties": {}}}
    out = chat(tools=[WEATHER, time_tool], tool_choice=choice, parallel_tool_calls=False)
    assert out["tool_choice"] == expected
    assert [t["function"]["name"] for t in out["tools"]] == tools
    assert out["parallel_tool_calls"] is False
    assert_chat_shape(out)


def test_tool_without_parameters_gets_an_empty_object_schema() -> None:
    out = chat(tools=[{"type": "function", "name": "ping"}])
    assert out["tools"] == [{"type": "function", "function": {"name": "ping", "parameters": {"type": "object", "properties": {}}}}]


def test_text_format_and_reasoning() -> None:
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    out = chat(
        text={"format": {"type": "json_schema", "name": "thing", "schema": schema, "strict": True}, "verbosity": "low"},
        reasoning={"effort": "high", "summary": "auto"},
    )
    assert out["response_format"] == {"type": "json_schema", "json_schema": {"name": "thing", "schema": schema, "strict": True}}
    assert out["reasoning_effort"] == "high"
    assert chat(text={"format": {"type": "json_object"}})["response_format"] == {"type": "json_object"}
    assert "response_format" not in chat(text={"format": {"type": "text"}})
    _drain(CHAT_PARAMS.validate_python(out))


def test_unknown_keys_are_ignored_and_listed() -> None:
    req = request(frobnicate=1, store=False)
    assert req.ignored_fields == ["frobnicate"]


# ---- requests: errors ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("body", "param", "words"),
    [
        ({"input": "x", "previous_response_id": ""}, "previous_response_id", "at least 1"),
        ({"input": "x", "conversation": "conv_1"}, "conversation", "Conversations API"),
        ({"input": "x", "background": True}, "background", "not supported"),
        ({"input": "x", "prompt": {"id": "pmpt_1"}}, "prompt", "prompt templates"),
        ({"input": "x", "top_logprobs": 3}, "top_logprobs", "logprobs"),
        ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input[0].type", "previous_response_id"),
        ({"input": [{"type": "web_search_call", "id": "ws_1"}]}, "input[0].type", "not supported"),
        ({"input": [{"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}]}, "input[0].content[0].type", "file inputs"),
        ({"input": [{"role": "user", "content": [{"type": "input_audio", "input_audio": {}}]}]}, "input[0].content[0].type", "audio"),
        (
            {"input": [{"role": "user", "content": [{"type": "input_image", "file_id": "f", "detail": "auto"}]}]},
            "input[0].content[0].file_id",
            "Files API",
        ),
        ({"input": [{"role": "user", "content": [{"type": "input_image", "detail": "auto"}]}]}, "input[0].content[0].image_url", "Missing"),
        (
            {"input": [{"role": "system", "content": [{"type": "input_image", "image_url": IMAGE}]}]},
            "input[0].content[0].type",
            "system messages take",
        ),
        ({"input": [{"role": "user", "content": [{"type": "hologram"}]}]}, "input[0].content[0].type", "unknown"),
        ({"input": [{"type": "function_call", "name": "f", "arguments": "{}"}]}, "input[0].call_id", "Missing"),
        ({"input": [{"type": "function_call_output", "call_id": "c"}]}, "input[0].output", "Missing"),
        (
            {"input": [{"type": "function_call_output", "call_id": "c", "output": [{"type": "output_text", "text": "x"}]}]},
            "input[0].output[0].type",
            "takes",
        ),
        ({"input": [{"role": "tool", "content": "x"}]}, "input[0].role", "Invalid"),
        ({"input": []}, "input", "Invalid"),
        ({"input": "x", "tools": [{"type": "namespace", "name": "ns", "description": "d"}]}, "tools[0].tools", "Missing"),
        (
            {"input": "x", "tools": [{"type": "namespace", "name": "ns", "tools": [{"type": "web_search"}]}]},
            "tools[0].tools[0].type",
            "namespace holds",
        ),
        ({"input": "x", "tool_choice": {"type": "file_search"}}, "tool_choice.type", "built-in"),
        ({"input": "x", "tool_choice": "sometimes"}, "tool_choice", "must be"),
        ({"input": "x", "tool_choice": "required"}, "tool_choice", "needs tools"),
        ({"input": "x", "tools": [WEATHER], "tool_choice": {"type": "function", "name": "nope"}}, "tool_choice", "not in tools"),
        (
            {"input": "x", "tools": [WEATHER], "tool_choice": {"type": "allowed_tools", "mode": "auto", "tools": [{"type": "mcp"}]}},
            "tool_choice.tools[0]",
            "function and custom tools only",
        ),
        ({"input": "x", "text": {"format": {"type": "json_schema", "schema": {}}}}, "text.format.name", "Missing"),
        ({"input": "x", "text": {"format": {"type": "json_schema", "name": "n"}}}, "text.format.schema", "Missing"),
        ({"input": "x", "max_output_tokens": 0}, "max_output_tokens", "Invalid"),
        ({"input": "x", "temperature": 3}, "temperature", "Invalid"),
        # rules the chat request has too, checked here once, under the Responses field names
        ({"input": "x", "tools": [{**WEATHER, "name": "get weather!"}]}, "tools[0].name", "pattern"),
        ({"input": "x", "tools": [WEATHER, WEATHER]}, "tools", "unique"),
        # issue 25 item 7: a forced call's grammar needs an object schema (was a 500)
        ({"input": "x", "tools": [{**WEATHER, "parameters": {"type": "string"}}], "tool_choice": "required"}, "tools[0].parameters", "type 'object'"),
        ({"input": [{"type": "reasoning", "summary": []}]}, "input", "only reasoning"),
        (
            {"input": "x", "tools": [WEATHER], "tool_choice": {"type": "allowed_tools", "mode": "required", "tools": []}},
            "tool_choice",
            "at least one tool",
        ),
    ],
)
def test_rejections_name_the_field(body: dict, param: str, words: str) -> None:
    e = rejected(body)
    assert e.param == param, e.message
    assert words in e.message, e.message


def test_bad_json_and_non_objects() -> None:
    for raw in (b"{", b"[1]"):
        with pytest.raises(ProtocolError) as e:
            rp.parse_responses_request(raw)
        assert e.value.status == 400


def test_errors_reach_the_sdk_as_its_exceptions(server: FakeServer) -> None:
    with pytest.raises(openai.BadRequestError) as e:
        server.client.responses.create(model="m", input="x", conversation="conv_1")
    assert e.value.param == "conversation"


# ---- non-streaming responses ---------------------------------------------------------------------


def test_response_object_parses_with_the_sdk(server: FakeServer) -> None:
    req = request(tools=[WEATHER], tool_choice="auto", instructions="Be brief.", max_output_tokens=50)
    out = rp.response_object(req, "resp_1", TOOL_TURN, created_at=1700000000)
    response = Response.model_validate(out)
    assert [o.type for o in response.output] == ["reasoning", "message", "function_call", "function_call"]
    assert response.output[0].content[0].text == "Two cities, two calls."
    assert response.output_text == "Checking."
    call = response.output[2]
    assert (call.call_id, call.name, call.arguments, call.status) == ("call_a", "get_weather", '{"city": "Paris"}', "completed")
    assert response.status == "completed" and response.incomplete_details is None
    usage = response.usage
    assert (usage.input_tokens, usage.output_tokens, usage.total_tokens, usage.input_tokens_details.cached_tokens) == (120, 30, 150, 100)
    assert response.tools[0].name == "get_weather" and response.tool_choice == "auto" and response.max_output_tokens == 50
    assert out["store"] is True and out["previous_response_id"] is None  # stored unless store: false (the route stores it)
    assert rp.response_object(request(store=False, previous_response_id="resp_0"), "resp_1", TOOL_TURN)["store"] is False
    assert len({o.id for o in response.output}) == 4
    server.events = TOOL_TURN
    via_sdk = server.client.responses.create(model="qwen3-4b", input="Hi", tools=[WEATHER])
    assert [o.type for o in via_sdk.output] == ["reasoning", "message", "function_call", "function_call"]


def test_length_is_incomplete() -> None:
    response = Response.model_validate(
        rp.response_object(request(), "resp_1", [TextDelta(text="trunc"), Finish(reason="length", completion_tokens=5)])
    )
    assert response.status == "incomplete" and response.incomplete_details.reason == "max_output_tokens"
    assert response.output[0].status == "incomplete" and response.output_text == "trunc"


def test_json_schema_format_is_echoed() -> None:
    req = request(text={"format": {"type": "json_schema", "name": "thing", "schema": {"type": "object"}, "strict": True}})
    response = Response.model_validate(rp.response_object(req, "resp_1", [TextDelta(text="{}"), Finish(reason="stop")]))
    assert response.text.format.type == "json_schema" and response.text.format.name == "thing"


def test_failed_generations_raise() -> None:
    with pytest.raises(ProtocolError) as e:
        rp.response_object(request(), "resp_1", [Finish(reason="error", error="too long", error_code="context_length_exceeded")])
    assert (e.value.status, e.value.code, e.value.message) == (400, "context_length_exceeded", "too long")
    assert e.value.body() == error_body(400, "context_length_exceeded", "too long")
    with pytest.raises(ProtocolError) as e:
        rp.response_object(request(), "resp_1", [Finish(reason="cancelled")])
    assert e.value.status == 499
    with pytest.raises(ProtocolError):
        rp.response_object(request(), "resp_1", [TextDelta(text="x")])


# ---- streaming -----------------------------------------------------------------------------------


def test_stream_event_sequence() -> None:
    events = stream(request(tools=[WEATHER]), TOOL_TURN)
    check_order(events)
    assert [e["type"].removeprefix("response.") for e in events] == [
        "created",
        "in_progress",
        "output_item.added",
        "content_part.added",
        "reasoning_text.delta",
        "reasoning_text.delta",
        "reasoning_text.done",
        "content_part.done",
        "output_item.done",
        "output_item.added",
        "content_part.added",
        "output_text.delta",
        "output_text.done",
        "content_part.done",
        "output_item.done",
        "output_item.added",
        "function_call_arguments.delta",
        "function_call_arguments.delta",
        "function_call_arguments.done",
        "output_item.done",
        "output_item.added",
        "function_call_arguments.delta",
        "function_call_arguments.done",
        "output_item.done",
        "completed",
    ]
    assert events[0]["response"]["status"] == "in_progress" and events[0]["response"]["output"] == []
    assert events[15]["item"] == {
        "id": "fc_test_2",
        "type": "function_call",
        "call_id": "call_a",
        "name": "get_weather",
        "arguments": "",
        "status": "in_progress",
    }
    final = Response.model_validate(events[-1]["response"])
    assert final.status == "completed" and final.usage.total_tokens == 150


def test_sdk_stream_accumulates_to_the_non_stream_response(server: FakeServer) -> None:
    server.events = TOOL_TURN
    with server.client.responses.stream(model="qwen3-4b", input="Hi", tools=[WEATHER]) as s:
        deltas = [e.delta for e in s if e.type == "response.output_text.delta"]
        final = s.get_final_response()
    assert deltas == ["Checking."]
    expected = Response.model_validate(rp.response_object(server.requests[0], "resp_test", TOOL_TURN, created_at=1700000000))
    assert final.model_dump(exclude_none=True, exclude={"output"}) == expected.model_dump(exclude_none=True, exclude={"output"})
    assert [o.model_dump(exclude_none=True, exclude={"parsed_arguments"}) for o in final.output] == [
        o.model_dump(exclude_none=True) for o in expected.output
    ]


def test_sdk_raw_stream_events(server: FakeServer) -> None:
    server.events = [TextDelta(text="a"), TextDelta(text="b"), Finish(reason="stop")]
    kinds = [e.type for e in server.client.responses.create(model="m", input="x", stream=True)]
    assert kinds == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        "response.output_text.delta",
        "response.output_text.delta",
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed",
    ]


def test_length_streams_response_incomplete() -> None:
    events = stream(request(), [TextDelta(text="cut"), Finish(reason="length", completion_tokens=3)])
    check_order(events)
    assert events[-1]["type"] == "response.incomplete"
    assert events[-1]["response"]["incomplete_details"] == {"reason": "max_output_tokens"}
    assert events[-2]["item"]["status"] == "incomplete"


def test_mid_stream_error_sends_error_and_response_failed() -> None:
    events = stream(request(), [TextDelta(text="partial"), Finish(reason="error", error="engine stopped", error_code="engine_stopped")])
    check_order(events)
    assert [e["type"] for e in events[-2:]] == ["error", "response.failed"]
    assert events[-2]["code"] == "engine_stopped" and events[-2]["message"] == "engine stopped"
    failed = Response.model_validate(events[-1]["response"])
    assert failed.status == "failed" and failed.error.code == "server_error" and failed.error.message == "engine stopped"
    assert failed.output[0].status == "incomplete" and failed.usage is None


def test_stream_lifecycle_edges() -> None:
    enc = rp.ResponseStreamEncoder(request(), "resp_1", created_at=1)
    first = enc.start()
    assert first.startswith(b"event: response.created\n") and enc.start() == b""
    assert enc.feed(Finish(reason="cancelled")) == b""  # the client is gone: nothing more
    assert enc.close() == b"" and enc.feed(TextDelta(text="late")) == b""

    enc = rp.ResponseStreamEncoder(request(), "resp_1", created_at=1)
    assert enc.feed(Finish(reason="cancelled")) == b"" and enc.close() == b""  # cancelled before anything was sent

    enc = rp.ResponseStreamEncoder(request(), "resp_1", created_at=1)
    closed = sse_events(enc.close())  # no Finish at all
    assert [e["type"] for e in closed] == ["response.created", "response.in_progress", "error", "response.failed"]
    assert [e["sequence_number"] for e in closed] == [0, 1, 2, 3]
    assert enc.error(500, "again") == b""

    enc = rp.ResponseStreamEncoder(request(), "resp_1", created_at=1)
    enc.feed(TextDelta(text="x"))
    enc.feed(Finish(reason="stop"))
    assert enc.close() == b""


def test_text_after_reasoning_after_text_opens_new_items() -> None:
    events = stream(
        request(),
        [
            TextDelta(text="a"),
            ReasoningDelta(text="r"),
            TextDelta(text="b"),
            ToolCallStart(index=0, id="c", name="f"),
            ToolCallArguments(index=0, arguments="{}"),
            Finish(reason="tool_calls"),
        ],
    )
    check_order(events)
    added = [e["item"]["type"] for e in events if e["type"] == "response.output_item.added"]
    assert added == ["message", "reasoning", "message", "function_call"]


# ---- property: any event sequence streams and accumulates to the non-stream response -------------


@st.composite
def generations(draw: st.DrawFn) -> list[Any]:
    """Event sequences as the parser chain emits them: runs of reasoning / text deltas and whole
    tool calls (arguments split anywhere), then one Finish."""
    events: list[Any] = []
    calls = 0
    for kind in draw(st.lists(st.sampled_from(["text", "reasoning", "tool"]), max_size=6)):
        if kind == "tool":
            args = json.dumps(draw(st.dictionaries(st.text(max_size=5), st.integers() | st.text(max_size=5), max_size=3)))
            cuts = sorted(draw(st.lists(st.integers(0, len(args)), max_size=3)))
            pieces = [args[a:b] for a, b in zip([0, *cuts], [*cuts, len(args)], strict=True)]
            events.append(ToolCallStart(index=calls, id=f"call_{calls}", name="f"))
            events += [ToolCallArguments(index=calls, arguments=p) for p in pieces]
            if draw(st.booleans()):
                events.append(ToolCallEnd(index=calls))
            calls += 1
        else:
            cls = TextDelta if kind == "text" else ReasoningDelta
            events += [cls(text=t) for t in draw(st.lists(st.text(max_size=6), min_size=1, max_size=4))]
    reason = draw(st.sampled_from(["stop"] + (["tool_calls"] if calls else [])))
    prompt = draw(st.integers(0, 500))
    events.append(
        Finish(reason=reason, prompt_tokens=prompt, completion_tokens=draw(st.integers(0, 500)), cached_tokens=draw(st.integers(0, prompt)))
    )
    return events


PROPERTY_SERVER = FakeServer()


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(generations())
def test_any_generation_streams_validly_and_accumulates(events: list[Any]) -> None:
    req = request()
    check_order(stream(req, events))
    expected = Response.model_validate(rp.response_object(req, "resp_test", events, created_at=1700000000))
    PROPERTY_SERVER.events = events
    with PROPERTY_SERVER.client.responses.stream(model="qwen3-4b", input="Hi") as s:
        final = s.get_final_response()
    assert [o.model_dump(exclude_none=True, exclude={"parsed_arguments"}) for o in final.output] == [
        o.model_dump(exclude_none=True) for o in expected.output
    ]
    assert final.output_text == "".join(e.text for e in events if isinstance(e, TextDelta))


def test_request_models_are_frozen() -> None:
    req = request()
    with pytest.raises(ValidationError):
        req.model = "other"  # type: ignore[misc]


# ---- any accepted request builds a valid chat request (one validation, tests/support/chat_body.py) ----

_fn = st.sampled_from(["get_weather", "f", "lookup.v2", "x-y"])
_in_text = st.builds(lambda t: {"type": "input_text", "text": t}, st.text(max_size=8))
_in_image = st.builds(
    lambda d: {"type": "input_image", "image_url": "https://example.com/a.png", **({"detail": d} if d else {})},
    st.sampled_from([None, "auto", "low", "high", "original"]),
)
_message = st.one_of(
    st.builds(lambda c: {"role": "user", "content": c}, st.one_of(st.text(max_size=8), st.lists(st.one_of(_in_text, _in_image), max_size=3))),
    st.builds(lambda r, c: {"type": "message", "role": r, "content": c}, st.sampled_from(["system", "developer"]), st.lists(_in_text, max_size=2)),
    st.builds(
        lambda c: {"role": "assistant", "content": c},
        st.one_of(
            st.text(max_size=8), st.lists(st.sampled_from([{"type": "output_text", "text": "ok"}, {"type": "refusal", "refusal": "no"}]), max_size=2)
        ),
    ),
)
_call = st.builds(lambda i, n: {"type": "function_call", "call_id": f"c{i}", "name": n, "arguments": "{}"}, st.integers(0, 3), _fn)
_output = st.builds(
    lambda i, o: {"type": "function_call_output", "call_id": f"c{i}", "output": o},
    st.integers(0, 3),
    st.one_of(st.text(max_size=8), st.lists(st.one_of(_in_text, _in_image), max_size=2)),
)
_reasoning = st.just({"type": "reasoning", "summary": [{"type": "summary_text", "text": "hm"}]})
_fn_tool = st.builds(
    lambda n, p, strict: {
        "type": "function",
        "name": n,
        **({"parameters": p} if p is not None else {}),
        **({"strict": strict} if strict is not None else {}),
    },
    _fn,
    st.one_of(st.none(), st.just({"type": "object", "properties": {"a": {"type": "string"}}})),
    st.one_of(st.none(), st.booleans()),
)
_choice = st.one_of(
    st.sampled_from(["none", "auto", "required"]),
    st.builds(lambda n: {"type": "function", "name": n}, _fn),
    st.builds(
        lambda m, ns: {"type": "allowed_tools", "mode": m, "tools": [{"type": "function", "name": n} for n in ns]},
        st.sampled_from(["auto", "required"]),
        st.lists(_fn, max_size=2),
    ),
)
_format = st.sampled_from(
    [
        {"type": "text"},
        {"type": "json_object"},
        {"type": "json_schema", "name": "out", "schema": {"type": "object"}, "strict": True, "description": "d"},
    ]
)


@st.composite
def responses_requests(draw: st.DrawFn) -> dict[str, Any]:
    items = st.lists(st.one_of(_message, _call, _output, _reasoning), min_size=1, max_size=5)
    out: dict[str, Any] = {"model": "m", "input": draw(st.one_of(st.text(max_size=8), items))}
    optional = {
        "instructions": st.text(max_size=8),
        "tools": st.lists(_fn_tool, max_size=3, unique_by=lambda t: t["name"]),
        "tool_choice": _choice,
        "parallel_tool_calls": st.booleans(),
        "text": st.builds(lambda f: {"format": f}, _format),
        "reasoning": st.just({"effort": "low"}),
        "max_output_tokens": st.integers(1, 100),
        "temperature": st.floats(0, 2),
        "top_p": st.floats(0, 1),
        "top_k": st.integers(-1, 50),
        "stream": st.booleans(),
    }
    return out | some_of(draw, optional)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(responses_requests())
def test_any_accepted_responses_request_builds_the_chat_request_validation_would(request_body: dict[str, Any]) -> None:
    chat_body = translation_of(rp.parse_responses_request, rp.to_chat_request, request_body)
    if chat_body is not None:
        assert_chat_shape({k: v for k, v in chat_body.items() if k != "stream"})  # CHAT_PARAMS is the non-streaming type
