"""OpenAI wire format (router/openai_protocol.py): requests as the openai SDK serialises them parse
and translate to engine requests; fields Orchard cannot honour are 400s naming the field; responses,
chunks and SSE frames have the keys OpenAI clients read; errors have OpenAI's shape. Pure Python."""

import base64
import importlib.util
import json
import math
import struct
import subprocess
import sys

import pytest
from pydantic import ValidationError

from router.protocols import openai as op
from router.protocols.openai import (
    SSE_DONE,
    ChatCompletionRequest,
    ProtocolError,
    StreamEncoder,
    chat_chunk,
    chat_completion_response,
    completion_chunk,
    completion_response,
    embedding_response,
    error_body,
    generation_fields,
    join_deltas,
    parse_chat_request,
    parse_completion_request,
    parse_embedding_request,
    split_images,
    sse,
    to_vlm_request,
    validation_error_body,
)

# What `client.chat.completions.create(...)` sends (the SDK drops every NOT_GIVEN argument).
SDK_CHAT = {
    "messages": [
        {"role": "developer", "content": "You are terse."},
        {"role": "user", "content": "Name a fruit."},
        {"role": "assistant", "content": "Apple."},
        {"role": "user", "content": [{"type": "text", "text": "Another"}, {"type": "text", "text": "one, please."}]},
    ],
    "model": "smollm2-135m",
    "frequency_penalty": 0.5,
    "logit_bias": {"50256": -100},
    "logprobs": True,
    "max_completion_tokens": 64,
    "metadata": {"team": "orchard"},
    "n": 1,
    "parallel_tool_calls": False,
    "presence_penalty": -0.5,
    "seed": 7,
    "service_tier": "auto",
    "stop": ["\n\n", "END"],
    "store": False,
    "stream": True,
    "stream_options": {"include_usage": True},
    "temperature": 0.2,
    "tool_choice": "none",
    "top_logprobs": 3,
    "top_p": 0.9,
    "user": "user-1234",
    "reasoning_effort": "low",
    "prompt_cache_key": "k",
    "safety_identifier": "s",
}

SDK_COMPLETION = {
    "model": "smollm2-135m",
    "prompt": "Once upon a time",
    "max_tokens": 16,
    "temperature": 0.0,
    "logprobs": 2,
    "stop": "\n",
    "echo": False,
    "best_of": 1,
    "n": 1,
    "stream": False,
    "user": "u",
    "suffix": None,
}

SDK_EMBEDDING = {"input": ["hello", "world"], "model": "minilm", "encoding_format": "base64", "dimensions": 128, "user": "u"}


def _user(content="hi", **extra) -> dict:
    return {"model": "m", "messages": [{"role": "user", "content": content}], **extra}


def _fails(parse, body) -> ProtocolError:
    with pytest.raises(ProtocolError) as info:
        parse(body)
    err = info.value
    assert err.status == 400
    body = err.body()["error"]
    assert set(body) == {"message", "type", "param", "code"}
    assert body["type"] == "invalid_request_error"
    assert body["param"] is None or body["param"] in body["message"]
    return err


# ---- requests -------------------------------------------------------------------------------------


def test_sdk_chat_payload_round_trip():
    req = parse_chat_request(json.dumps(SDK_CHAT).encode())
    assert req.model == "smollm2-135m" and req.include_usage and req.ignored_fields == []
    f = generation_fields(req)
    assert f["messages"] == [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Name a fruit."},
        {"role": "assistant", "content": "Apple."},
        {"role": "user", "content": "Another\none, please."},
    ]
    assert f["max_tokens"] == 64 and f["temperature"] == 0.2 and f["top_p"] == 0.9
    assert f["stop"] == ["\n\n", "END"] and f["seed"] == 7
    assert f["presence_penalty"] == -0.5 and f["frequency_penalty"] == 0.5
    assert f["logit_bias"] == {50256: -100.0}
    assert f["logprobs"] is True and f["top_logprobs"] == 3
    assert f["chat_template_kwargs"] == {"reasoning_effort": "low"}
    assert "prompt" not in f and "prompt_tokens" not in f


def test_unknown_keys_are_ignored_and_listed():
    req = parse_chat_request(_user(mirostat=2, keep_alive="5m"))
    assert req.ignored_fields == ["keep_alive", "mirostat"]
    assert "mirostat" not in generation_fields(req)


def test_local_server_extras_are_honoured():
    f = generation_fields(parse_chat_request(_user(top_k=40, min_p=0.05, repetition_penalty=1.1, chat_template_kwargs={"enable_thinking": False})))
    assert (f["top_k"], f["min_p"], f["repetition_penalty"]) == (40, 0.05, 1.1)
    assert f["chat_template_kwargs"] == {"enable_thinking": False}
    assert generation_fields(parse_chat_request(_user(top_k=-1)))["top_k"] == 0


def test_chat_translation_defaults():
    f = generation_fields(parse_chat_request(_user()))
    assert f["max_tokens"] == op.DEFAULT_MAX_TOKENS == 512
    assert (f["temperature"], f["top_p"], f["top_k"], f["min_p"]) == (1.0, 1.0, 0, 0.0)
    assert f["stop"] == [] and f["seed"] is None and f["logit_bias"] is None
    assert f["logprobs"] is False and f["top_logprobs"] == 0
    assert "chat_template_kwargs" not in f
    assert generation_fields(parse_chat_request(_user(max_tokens=20)))["max_tokens"] == 20
    both = generation_fields(parse_chat_request(_user(max_tokens=20, max_completion_tokens=30)))
    assert both["max_tokens"] == 30  # the current name wins over the deprecated one
    greedy = generation_fields(parse_chat_request(_user(top_p=0, temperature=0.7)))
    assert (greedy["temperature"], greedy["top_p"]) == (0.0, 1.0)
    assert generation_fields(parse_chat_request(_user(stop="###")))["stop"] == ["###"]
    assert generation_fields(parse_chat_request(_user(stop=["", "x"])))["stop"] == ["x"]
    assert generation_fields(parse_chat_request(_user(stop=None)))["stop"] == []


def test_translation_builds_a_valid_generation_request():
    llm = pytest.importorskip("deployments.engines.llm")
    chat = op.to_generation_request(parse_chat_request(SDK_CHAT))
    assert isinstance(chat, llm.GenerationRequest) and chat.messages[0]["role"] == "system"
    assert chat.logit_bias == {50256: -100.0} and chat.top_logprobs == 3
    text = op.to_generation_request(parse_completion_request(SDK_COMPLETION))
    assert text.prompt == "Once upon a time" and text.max_tokens == 16 and text.top_logprobs == 2
    tokens = op.to_generation_request(parse_completion_request({"model": "m", "prompt": [1, 2, 3]}))
    assert tokens.prompt_tokens == [1, 2, 3] and tokens.prompt is None and tokens.max_tokens == 512
    eight = op.to_generation_request(parse_chat_request(_user(stop=[str(i) for i in range(8)])))
    assert len(eight.stop) == 8


def test_message_roles_and_history():
    body = {
        "model": "m",
        "messages": [
            {"role": "system", "content": [{"type": "text", "text": "sys"}]},
            {"role": "user", "content": "weather?", "name": "ann"},
            {"role": "assistant", "content": None, "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "w", "arguments": "{}"}}]},
            {"role": "tool", "content": "sunny", "tool_call_id": "c1"},
            {"role": "assistant", "content": [{"type": "refusal", "refusal": "no"}]},
        ],
    }
    msgs = generation_fields(parse_chat_request(body))["messages"]
    assert msgs[0] == {"role": "system", "content": "sys"}
    assert msgs[1] == {"role": "user", "content": "weather?", "name": "ann"}
    assert msgs[2]["content"] == "" and msgs[2]["tool_calls"][0]["id"] == "c1"
    assert msgs[3] == {"role": "tool", "content": "sunny", "tool_call_id": "c1"}
    assert msgs[4] == {"role": "assistant", "content": "no"}


IMAGE = "data:image/png;base64,iVBORw0KGgo="


def test_image_parts_helpers():
    body = {
        "model": "llava",
        "messages": [
            {"role": "developer", "content": "Describe images."},
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "What is this?"},
                    {"type": "image_url", "image_url": {"url": IMAGE, "detail": "low"}},
                    {"type": "image_url", "image_url": "data:image/png;base64,AAAA"},
                ],
            },
        ],
        "max_tokens": 32,
        "temperature": 0,
    }
    req = parse_chat_request(body)
    assert req.has_images() and not parse_chat_request(_user()).has_images()
    messages, images = split_images(req)
    assert images == [IMAGE, "data:image/png;base64,AAAA"]
    assert messages == [
        {"role": "system", "content": [{"type": "text", "text": "Describe images."}]},
        {"role": "user", "content": [{"type": "text", "text": "What is this?"}, {"type": "image"}, {"type": "image"}]},
    ]
    assert to_vlm_request(req) == {"messages": messages, "images": images, "max_tokens": 32, "temperature": 0.0, "top_p": 1.0, "stop": []}
    with pytest.raises(ProtocolError) as info:  # a text model cannot take them
        generation_fields(req)
    assert isinstance(info.value, op.UnsupportedParameter)
    assert info.value.status == 400 and info.value.param == "messages[1].content[1]" and str(info.value) == info.value.message


def test_vlm_rejects_controls_it_cannot_honour():
    req = parse_chat_request({**_user([{"type": "image_url", "image_url": {"url": IMAGE}}]), "seed": 1})
    with pytest.raises(ProtocolError) as info:
        to_vlm_request(req)
    assert info.value.param == "seed" and info.value.status == 400
    with pytest.raises(ProtocolError) as info:
        to_vlm_request(parse_chat_request(_user(logprobs=True)))
    assert info.value.param == "logprobs"
    tool = parse_chat_request({"model": "m", "messages": [{"role": "user", "content": "a"}, {"role": "tool", "content": "b", "tool_call_id": "x"}]})
    with pytest.raises(ProtocolError) as info:
        split_images(tool)
    assert info.value.param == "messages[1].role"


UNSUPPORTED_CHAT = [
    ({"n": 2}, "n", "unsupported_value"),
    ({"functions": [{"name": "f"}]}, "functions", "unsupported_parameter"),
    ({"function_call": {"name": "f"}}, "function_call", "unsupported_parameter"),
    ({"audio": {"voice": "alloy", "format": "wav"}, "modalities": ["text", "audio"]}, "audio", "unsupported_parameter"),
    ({"modalities": ["text", "audio"]}, "modalities", "unsupported_value"),
    ({"web_search_options": {}}, "web_search_options", "unsupported_parameter"),
]


@pytest.mark.parametrize("extra,param,code", UNSUPPORTED_CHAT)
def test_unsupported_chat_fields_are_400_with_param(extra, param, code):
    err = _fails(parse_chat_request, _user(**extra))
    assert (err.param, err.code) == (param, code)


TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}
BAD_TOOLS = [
    ({"tool_choice": "required"}, "tool_choice", "invalid_value"),
    ({"tools": [TOOL], "tool_choice": {"type": "function", "function": {"name": "other"}}}, "tool_choice", "invalid_value"),
    ({"tools": [TOOL, TOOL]}, "tools", "invalid_value"),
    ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools[0].function.name", "invalid_value"),
    ({"tools": [{"type": "web_search"}]}, "tools[0].type", "invalid_value"),
    ({"response_format": {"type": "json_schema"}}, "response_format.json_schema", "missing_required_parameter"),
    # issue 25 item 7: a forced call's grammar needs an object schema (was a 500)
    (
        {"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}], "tool_choice": "required"},
        "tools[0].function.parameters",
        "invalid_value",
    ),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": ["city"]}}]}, "tools[0].function.parameters", "invalid_type"),
]


@pytest.mark.parametrize(
    "kwargs,param",
    [
        ({"chat_template": "{% for i in range(10**9) %}x{% endfor %}"}, "chat_template_kwargs.chat_template"),
        ({"tokenize": False}, "chat_template_kwargs.tokenize"),
        ({"padding": "max_length", "max_length": 4000}, "chat_template_kwargs.padding"),
        ({"truncation": True}, "chat_template_kwargs.truncation"),
        ({"return_dict": True}, "chat_template_kwargs.return_dict"),
        ({"add_generation_prompt": False}, "chat_template_kwargs.add_generation_prompt"),
        ({"tools": []}, "chat_template_kwargs.tools"),
        ({"documents": [{"text": "x"}]}, "chat_template_kwargs.documents"),
        ({"enable_thinking": {"nested": True}}, "chat_template_kwargs.enable_thinking"),
        ({"reasoning_effort": "x" * 1000}, "chat_template_kwargs.reasoning_effort"),
        ({"thinking": 10**40}, "chat_template_kwargs.thinking"),
    ],
)
def test_chat_template_kwargs_are_template_variables_only(kwargs, param):
    """Issue 25 item 2: a template of the client's own or a tokenizer argument never reaches
    apply_chat_template; the 400 names the key."""
    err = _fails(parse_chat_request, _user(chat_template_kwargs=kwargs))
    assert (err.param, err.code) == (param, "invalid_value")


def test_template_variables_pass():
    kwargs = {"enable_thinking": False, "reasoning_effort": "low", "thinking": True, "date_string": "26 Jul 2024", "model_identity": None}
    assert generation_fields(parse_chat_request(_user(chat_template_kwargs=kwargs)))["chat_template_kwargs"] == kwargs


@pytest.mark.parametrize("extra,param,code", BAD_TOOLS)
def test_bad_tools_and_formats_are_400_with_param(extra, param, code):
    err = _fails(parse_chat_request, _user(**extra))
    assert (err.param, err.code) == (param, code)


def test_tools_and_formats_reach_the_engine_request():
    req = parse_chat_request(
        _user(
            tools=[TOOL],
            tool_choice="auto",
            response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object"}, "strict": True}},
        )
    )
    fields = generation_fields(req)
    assert fields["tools"] == [TOOL] and req.forced_tool is None and req.uses_tools
    assert fields["constraint"] == {"type": "json_schema", "schema": {"type": "object"}, "strict": True}
    named = parse_chat_request(_user(tools=[TOOL], tool_choice={"type": "function", "function": {"name": "get_weather"}}))
    assert named.forced_tool == "get_weather"
    assert parse_chat_request(_user(tools=[TOOL], tool_choice="required")).forced_tool == "required"
    off = parse_chat_request(_user(tools=[TOOL], tool_choice="none"))
    assert not off.uses_tools and generation_fields(off)["tools"] == [TOOL]  # in the prompt, not parsed
    assert generation_fields(parse_chat_request(_user(response_format={"type": "json_object"})))["constraint"] == {"type": "json_object"}


def test_image_urls_are_data_urls_unless_remote_ones_are_allowed():
    def img(url):
        return parse_chat_request(_user() | {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}}]}]})

    op.check_image_urls(img("data:image/png;base64,AAAA"), allow_remote=False)
    op.check_image_urls(img("https://example.com/a.png"), allow_remote=True)
    for url, remote in (("https://example.com/a.png", False), ("/etc/passwd", True), ("file:///etc/passwd", True)):
        with pytest.raises(ProtocolError) as info:
            op.check_image_urls(img(url), allow_remote=remote)
        assert (info.value.status, info.value.code, info.value.param) == (400, "invalid_image_url", "messages[0].content[0].image_url.url")


def test_harmless_values_of_unsupported_fields_pass():
    req = parse_chat_request(
        _user(
            n=1, tools=[], tool_choice="auto", response_format={"type": "text"}, modalities=["text"], prediction={"type": "content", "content": "x"}
        )
    )
    assert req.n == 1


def test_unsupported_content_parts():
    audio = [{"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}}]
    assert _fails(parse_chat_request, _user(audio)).param == "messages[0].content[0].type"
    file = [{"type": "text", "text": "read"}, {"type": "file", "file": {"file_id": "f"}}]
    assert _fails(parse_chat_request, _user(file)).param == "messages[0].content[1].type"
    system_image = {"model": "m", "messages": [{"role": "system", "content": [{"type": "image_url", "image_url": {"url": IMAGE}}]}]}
    assert _fails(parse_chat_request, system_image).param == "messages[0].content[0].type"


INVALID_CHAT = [
    ({"messages": [{"role": "user", "content": "x"}]}, "model", "missing_required_parameter"),
    ({"model": "m"}, "messages", "missing_required_parameter"),
    ({"model": "m", "messages": []}, "messages", "invalid_value"),
    ({"model": "m", "messages": [{"role": "function", "content": "x"}]}, "messages[0].role", "invalid_value"),
    ({"model": "m", "messages": [{"role": "user"}]}, "messages[0].content", "missing_required_parameter"),
    ({"model": "m", "messages": [{"role": "user", "content": 5}]}, "messages[0].content", "invalid_type"),
    (_user([{"type": "video", "video": "x"}]), "messages[0].content[0].type", "invalid_value"),
    (_user([{"type": "text"}]), "messages[0].content[0].text", "missing_required_parameter"),
    (_user([{"type": "image_url", "image_url": {"detail": "low"}}]), "messages[0].content[0].image_url.url", "missing_required_parameter"),
    (_user(temperature=2.5), "temperature", "invalid_value"),
    (_user(temperature="hot"), "temperature", "invalid_type"),
    (_user(top_p=1.5), "top_p", "invalid_value"),
    (_user(max_tokens=0), "max_tokens", "invalid_value"),
    (_user(presence_penalty=3), "presence_penalty", "invalid_value"),
    (_user(stop=[str(i) for i in range(9)]), "stop", "invalid_value"),
    (_user(stop=[1]), "stop", "invalid_type"),
    (_user(logit_bias={"x": 1}), "logit_bias.x", "invalid_value"),
    (_user(logit_bias={"5": 101}), "logit_bias.5", "invalid_value"),
    (_user(top_logprobs=2), "top_logprobs", "invalid_value"),
    (_user(logprobs=True, top_logprobs=21), "top_logprobs", "invalid_value"),
    (_user(tool_choice="sometimes"), "tool_choice", "invalid_value"),
    (_user(stream_options={"include_usage": "maybe"}), "stream_options.include_usage", "invalid_type"),
    (_user(repetition_penalty=0), "repetition_penalty", "invalid_value"),
]


@pytest.mark.parametrize("body,param,code", INVALID_CHAT)
def test_invalid_chat_requests_name_the_field(body, param, code):
    err = _fails(parse_chat_request, body)
    assert (err.param, err.code) == (param, code)


def test_body_must_be_a_json_object():
    assert _fails(parse_chat_request, b"{not json").code == "invalid_json"
    assert _fails(parse_chat_request, "[1, 2]").param is None
    assert _fails(parse_chat_request, b"null").message == "The request body must be a JSON object."


def test_sdk_completion_payload_round_trip():
    req = parse_completion_request(SDK_COMPLETION)
    f = generation_fields(req)
    assert f["prompt"] == "Once upon a time" and "messages" not in f
    assert f["max_tokens"] == 16 and f["temperature"] == 0.0 and f["stop"] == ["\n"]
    assert f["logprobs"] is True and f["top_logprobs"] == 2
    assert generation_fields(parse_completion_request({"model": "m", "prompt": "x", "logprobs": 0}))["top_logprobs"] == 0
    plain = generation_fields(parse_completion_request({"model": "m", "prompt": "x"}))
    assert plain["logprobs"] is False and plain["max_tokens"] == 512 and plain["temperature"] == 1.0


@pytest.mark.parametrize(
    "prompt,key,value",
    [
        ("hi", "prompt", "hi"),
        (["hi"], "prompt", "hi"),
        ([5, 6, 7], "prompt_tokens", [5, 6, 7]),
        ([[5, 6]], "prompt_tokens", [5, 6]),
    ],
)
def test_completion_prompt_forms(prompt, key, value):
    assert generation_fields(parse_completion_request({"model": "m", "prompt": prompt}))[key] == value


@pytest.mark.parametrize(
    "extra,param,code",
    [
        ({"prompt": ["a", "b"]}, "prompt", "unsupported_value"),
        ({"prompt": [[1], [2]]}, "prompt", "unsupported_value"),
        ({"prompt": []}, "prompt", "invalid_type"),
        ({"prompt": [1, "a"]}, "prompt", "invalid_value"),
        ({"prompt": [-1]}, "prompt", "invalid_value"),
        ({"best_of": 3}, "best_of", "unsupported_value"),
        ({"echo": True}, "echo", "unsupported_value"),
        ({"suffix": "tail"}, "suffix", "unsupported_parameter"),
        ({"n": 2}, "n", "unsupported_value"),
        ({"logprobs": 21}, "logprobs", "invalid_value"),
    ],
)
def test_unsupported_or_invalid_completion_fields(extra, param, code):
    err = _fails(parse_completion_request, {"model": "m", "prompt": "x", **extra})
    assert (err.param, err.code) == (param, code)


def test_embedding_requests():
    req = parse_embedding_request(SDK_EMBEDDING)
    assert req.input == ["hello", "world"] and req.encoding_format == "base64" and req.dimensions == 128
    one = parse_embedding_request({"model": "e", "input": "solo"})
    assert one.input == one.texts() == ["solo"] and one.encoding_format == "float" and one.dimensions is None
    for body, param, code in [
        ({"input": [1, 2, 3]}, "input", "unsupported_value"),
        ({"input": [[1, 2]]}, "input", "unsupported_value"),
        ({"input": ["ok", ""]}, "input[1]", "invalid_value"),
        ({"input": ["ok", 3]}, "input[1]", "invalid_type"),
        ({"input": []}, "input", "invalid_type"),
        ({"input": "x", "encoding_format": "int8"}, "encoding_format", "invalid_value"),
        ({"input": "x", "dimensions": 0}, "dimensions", "invalid_value"),
        ({}, "input", "missing_required_parameter"),
    ]:
        err = _fails(parse_embedding_request, {"model": "e", **body})
        assert (err.param, err.code) == (param, code), body


# ---- responses ----------------------------------------------------------------------------------


def _lp(token: str, logprob: float, top=()) -> dict:
    return {"token_id": 1, "token": token, "logprob": logprob, "top": list(top)}


USAGE = {"prompt_tokens": 11, "completion_tokens": 3, "cached_tokens": 8}
DELTAS = [
    {
        "text": "Hel",
        "token_ids": [1],
        "logprobs": [_lp("Hel", -0.1, [(1, "Hel", -0.1), (2, "Hi", -2.5)])],
        "finish_reason": None,
        "usage": None,
        "error": None,
        "error_code": None,
    },
    {
        "text": "lo ",
        "token_ids": [2],
        "logprobs": [_lp("lo ", -0.2, [(3, "lo ", -0.2)])],
        "finish_reason": None,
        "usage": None,
        "error": None,
        "error_code": None,
    },
    {
        "text": "é",
        "token_ids": [3],
        "logprobs": [_lp("é", float("-inf"), [(4, "é", float("-inf"))])],
        "finish_reason": "length",
        "usage": USAGE,
        "error": None,
        "error_code": None,
    },
]


def test_join_deltas():
    joined = join_deltas(DELTAS)
    assert joined["text"] == "Hello é" and joined["token_ids"] == [1, 2, 3]
    assert len(joined["logprobs"]) == 3 and joined["finish_reason"] == "length" and joined["usage"] == USAGE
    vlm = join_deltas(
        [
            {"text": "a", "finish_reason": None, "usage": None},
            {"text": "b", "finish_reason": "stop", "usage": {"prompt_tokens": 2, "completion_tokens": 2}},
        ]
    )
    assert vlm["text"] == "ab" and vlm["logprobs"] is None and vlm["token_ids"] == []


def test_chat_completion_response_shape():
    resp = chat_completion_response("smollm2", "chatcmpl-1", 1700000000, join_deltas(DELTAS))
    assert resp["object"] == "chat.completion" and resp["id"] == "chatcmpl-1" and resp["created"] == 1700000000 and resp["model"] == "smollm2"
    choice = resp["choices"][0]
    assert choice["index"] == 0 and choice["finish_reason"] == "length"
    assert choice["message"] == {"role": "assistant", "content": "Hello é", "refusal": None}
    assert resp["usage"] == {"prompt_tokens": 11, "completion_tokens": 3, "total_tokens": 14, "prompt_tokens_details": {"cached_tokens": 8}}
    content = choice["logprobs"]["content"]
    assert [c["token"] for c in content] == ["Hel", "lo ", "é"]
    assert content[0]["top_logprobs"] == [
        {"token": "Hel", "logprob": -0.1, "bytes": [72, 101, 108]},
        {"token": "Hi", "logprob": -2.5, "bytes": [72, 105]},
    ]
    assert content[2]["bytes"] == [0xC3, 0xA9] and content[2]["logprob"] == op.MIN_LOGPROB  # no -inf in JSON
    json.dumps(resp, allow_nan=False)
    plain = chat_completion_response("m", "c", 1, {"text": "ok", "finish_reason": "stop", "usage": {"prompt_tokens": 1, "completion_tokens": 1}})
    assert plain["choices"][0]["logprobs"] is None and plain["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}


def test_completion_response_shape():
    resp = completion_response("smollm2", "cmpl-1", 5, join_deltas(DELTAS))
    assert resp["object"] == "text_completion"
    choice = resp["choices"][0]
    assert choice["text"] == "Hello é" and choice["finish_reason"] == "length" and choice["index"] == 0
    lp = choice["logprobs"]
    assert lp["tokens"] == ["Hel", "lo ", "é"]
    assert lp["token_logprobs"] == [-0.1, -0.2, op.MIN_LOGPROB]
    assert lp["top_logprobs"][0] == {"Hel": -0.1, "Hi": -2.5}
    assert lp["text_offset"] == [0, 3, 6]
    assert completion_response("m", "c", 1, join_deltas(DELTAS), text_offset=16)["choices"][0]["logprobs"]["text_offset"] == [16, 19, 22]


def test_error_results_raise_their_status():
    failed = {"text": "", "finish_reason": "error", "error": "prompt too long", "error_code": "context_length_exceeded"}
    with pytest.raises(ProtocolError) as info:
        chat_completion_response("m", "c", 1, failed)
    assert info.value.status == 400 and info.value.body()["error"]["code"] == "context_length_exceeded"
    with pytest.raises(ProtocolError) as info:
        completion_response("m", "c", 1, {"finish_reason": "error", "error": "stopped", "error_code": "engine_stopped"})
    assert info.value.status == 503
    with pytest.raises(ProtocolError) as info:
        chat_completion_response("m", "c", 1, {"text": "x", "finish_reason": None})
    assert info.value.status == 500
    assert op.error_from_delta({"text": "x", "finish_reason": "stop"}) is None


def test_every_engine_error_code_has_its_status_in_the_one_table():
    from typing import get_args

    from deployments.engine import RequestErrorCode
    from deployments.wire.failure import STATUS

    codes = set(get_args(RequestErrorCode)) | {"not_found", "load_failed", "unavailable", "cancelled"}  # + the model server's own
    assert codes <= set(STATUS) and op.ENGINE_STATUS is STATUS
    from policy.decisions import Reject, RejectCode
    from router.residency.asks import error_for

    assert {error_for(Reject(model="m", code=c, message="x")).code for c in get_args(RejectCode)} <= set(STATUS)  # the controller's codes
    assert STATUS["context_length_exceeded"] == 400 and STATUS["engine_stopped"] == 503 and STATUS["cancelled"] == 499


def test_embedding_response_float_and_base64():
    vectors = [[0.1, -0.25, 3.0], [1e-8, 0.5, -1.0]]
    floats = embedding_response("minilm", vectors, 7)
    assert floats["object"] == "list" and floats["model"] == "minilm"
    assert floats["usage"] == {"prompt_tokens": 7, "total_tokens": 7}
    assert [d["index"] for d in floats["data"]] == [0, 1] and all(d["object"] == "embedding" for d in floats["data"])
    assert floats["data"][0]["embedding"] == vectors[0]
    b64 = embedding_response("minilm", vectors, 7, "base64")
    for item, vector in zip(b64["data"], vectors, strict=True):
        raw = base64.b64decode(item["embedding"])
        assert len(raw) == 4 * len(vector)
        decoded = struct.unpack(f"<{len(vector)}f", raw)
        assert decoded == struct.unpack(f"<{len(vector)}f", struct.pack(f"<{len(vector)}f", *vector))  # float32 exact
        assert all(math.isclose(a, b, rel_tol=1e-6) for a, b in zip(decoded, vector, strict=True))


# ---- streaming ----------------------------------------------------------------------------------


def _events(raw: bytes) -> list:
    assert raw.endswith(b"\n\n")
    out = []
    for frame in raw.split(b"\n\n")[:-1]:
        assert frame.startswith(b"data: ") and b"\n" not in frame
        data = frame[len(b"data: ") :]
        out.append("[DONE]" if data == b"[DONE]" else json.loads(data))
    return out


def test_sse_framing():
    frame = sse({"text": "héllo\nworld", "n": 1})
    assert frame == 'data: {"text":"héllo\\nworld","n":1}\n\n'.encode()
    assert _events(frame) == [{"text": "héllo\nworld", "n": 1}]
    assert SSE_DONE == b"data: [DONE]\n\n" and _events(SSE_DONE) == ["[DONE]"]


def test_chat_chunk_shapes():
    first = chat_chunk("m", "c1", 9, {"text": ""}, True)
    assert first["object"] == "chat.completion.chunk" and first["id"] == "c1" and first["created"] == 9 and first["model"] == "m"
    assert first["choices"] == [{"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}]
    assert "usage" not in first
    mid = chat_chunk("m", "c1", 9, {"text": "Hi"}, False, include_usage=True)
    assert mid["choices"][0]["delta"] == {"content": "Hi"} and mid["usage"] is None
    last = chat_chunk("m", "c1", 9, {"text": "", "finish_reason": "stop", "usage": USAGE}, False)
    assert last["choices"][0]["delta"] == {} and last["choices"][0]["finish_reason"] == "stop"
    for hidden in ("error", "cancelled"):
        assert chat_chunk("m", "c1", 9, {"text": "x", "finish_reason": hidden}, False)["choices"][0]["finish_reason"] is None
    with_lp = chat_chunk("m", "c1", 9, DELTAS[0], False)
    assert with_lp["choices"][0]["logprobs"]["content"][0]["token"] == "Hel"


def test_completion_chunk_shape():
    chunk = completion_chunk("m", "cmpl-1", 3, DELTAS[2], first=True, text_offset=6, include_usage=True)
    assert chunk["object"] == "text_completion" and chunk["usage"] is None
    assert chunk["choices"][0]["text"] == "é" and chunk["choices"][0]["finish_reason"] == "length"
    assert chunk["choices"][0]["logprobs"]["text_offset"] == [6]
    usage = op.usage_chunk("m", "cmpl-1", 3, USAGE, chat=False)
    assert usage["object"] == "text_completion" and usage["choices"] == [] and usage["usage"]["total_tokens"] == 14
    assert op.usage_chunk("m", "c", 3, USAGE)["object"] == "chat.completion.chunk"


def test_chat_stream_with_usage():
    enc = StreamEncoder("chat", "smollm2", "chatcmpl-9", 100, include_usage=True)
    raw = b"".join(enc.feed(d) for d in DELTAS) + enc.close()
    events = _events(raw)
    assert events[-1] == "[DONE]"
    chunks, usage = events[:-2], events[-2]
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": "Hel"}
    assert all("role" not in c["choices"][0]["delta"] for c in chunks[1:])
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks) == "Hello é"
    assert [c["choices"][0]["finish_reason"] for c in chunks] == [None, None, "length"]
    assert all(c["usage"] is None and c["id"] == "chatcmpl-9" for c in chunks)
    assert usage["choices"] == [] and usage["object"] == "chat.completion.chunk"
    assert usage["usage"] == {"prompt_tokens": 11, "completion_tokens": 3, "total_tokens": 14, "prompt_tokens_details": {"cached_tokens": 8}}


def test_chat_stream_role_first_even_without_text_and_no_usage_by_default():
    enc = StreamEncoder("chat", "m", "c", 1)
    events = _events(
        enc.feed({"text": ""})
        + enc.feed({"text": ""})
        + enc.feed({"text": "A"})
        + enc.feed({"text": "", "finish_reason": "stop", "usage": USAGE})
        + enc.close()
    )
    assert [e if e == "[DONE]" else e["choices"][0]["delta"] for e in events] == [
        {"role": "assistant", "content": ""},
        {"content": "A"},
        {},
        "[DONE]",
    ]
    assert events[2]["choices"][0]["finish_reason"] == "stop" and "usage" not in events[2]


def test_stream_error_ends_with_error_event_then_done():
    enc = StreamEncoder("chat", "m", "c", 1, include_usage=True)
    raw = enc.feed({"text": "par"}) + enc.feed(
        {"text": "tial", "finish_reason": "error", "error": "engine stopped", "error_code": "engine_stopped", "usage": USAGE}
    )
    raw += enc.feed({"text": "late"}) + enc.close()
    events = _events(raw)
    assert events[-1] == "[DONE]"
    error = events[-2]["error"]
    assert error == {"message": "engine stopped", "type": "service_unavailable_error", "param": None, "code": "engine_stopped"}
    chunks = events[:-2]
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks) == "partial"
    assert all(c["choices"][0]["finish_reason"] is None for c in chunks)  # no usage chunk after an error either
    assert all("choices" in c and c["choices"] for c in chunks)


def test_stream_cancelled_and_unfinished():
    enc = StreamEncoder("completion", "m", "c", 1)
    assert enc.feed({"text": "", "finish_reason": "cancelled"}) == b""
    assert _events(enc.close()) == ["[DONE]"]
    cut = StreamEncoder("completion", "m", "c", 1)
    events = _events(cut.feed({"text": "a"}) + cut.close())
    assert events[0]["choices"][0]["text"] == "a" and events[1]["error"]["type"] == "server_error" and events[2] == "[DONE]"
    died = StreamEncoder("chat", "m", "c", 1)
    died.feed({"text": "a"})
    events = _events(died.error("unavailable", "the model server died") + died.close())
    assert events[0]["error"]["code"] == "unavailable" and events[0]["error"]["type"] == "service_unavailable_error" and events[1] == "[DONE]"


def test_completion_stream_offsets_continue():
    enc = StreamEncoder("completion", "m", "cmpl-2", 1, include_usage=True)
    events = _events(b"".join(enc.feed(d) for d in DELTAS) + enc.close())
    assert [e["choices"][0]["logprobs"]["text_offset"] for e in events[:3]] == [[0], [3], [6]]
    assert "".join(e["choices"][0]["text"] for e in events[:3]) == "Hello é"
    assert events[3]["choices"] == [] and events[3]["object"] == "text_completion" and events[3]["usage"]["total_tokens"] == 14


# ---- errors -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "status,code,kind",
    [
        (400, "invalid_request", "invalid_request_error"),
        (401, "invalid_api_key", "authentication_error"),
        (404, "model_not_found", "invalid_request_error"),
        (409, "model_pinned", "conflict_error"),
        (429, "rate_limited", "rate_limit_error"),
        (500, "internal", "server_error"),
        (503, "model_loading", "service_unavailable_error"),
        (503, "model_busy", "overloaded_error"),
    ],
)
def test_error_body_types(status, code, kind):
    body = error_body(status, code, "why", param="x")
    assert body == {"error": {"message": "why", "type": kind, "param": "x", "code": code}}
    assert error_body(status, code, "why", type="custom")["error"]["type"] == "custom"


def test_validation_error_body_from_pydantic_and_fastapi_errors():
    with pytest.raises(ValidationError) as info:
        ChatCompletionRequest.model_validate(_user(temperature=9))
    body = validation_error_body(info.value)["error"]
    assert body["param"] == "temperature" and body["type"] == "invalid_request_error" and "temperature" in body["message"]
    fastapi_style = [{"type": "missing", "loc": ("body", "messages", 0, "role"), "msg": "Field required", "input": {}}]
    assert validation_error_body(fastapi_style)["error"] == {
        "message": "Missing required parameter: 'messages[0].role'.",
        "type": "invalid_request_error",
        "param": "messages[0].role",
        "code": "missing_required_parameter",
    }


def test_module_stays_framework_free():
    code = "import sys, router.protocols.openai; print(sorted(m for m in ('mlx', 'ray', 'fastapi', 'starlette', 'numpy') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_openai_sdk_reads_the_shapes():
    openai_types = pytest.importorskip("openai.types")
    completion_types = pytest.importorskip("openai.types.chat")
    resp = chat_completion_response("m", "chatcmpl-1", 1, join_deltas(DELTAS))
    parsed = completion_types.ChatCompletion.model_validate(resp)
    assert parsed.choices[0].message.content == "Hello é" and parsed.usage.prompt_tokens_details.cached_tokens == 8
    chunk = completion_types.ChatCompletionChunk.model_validate(chat_chunk("m", "c", 1, DELTAS[0], True, include_usage=True))
    assert chunk.choices[0].delta.role == "assistant"
    assert openai_types.Completion.model_validate(completion_response("m", "cmpl-1", 1, join_deltas(DELTAS))).choices[0].text == "Hello é"
    assert openai_types.CreateEmbeddingResponse.model_validate(embedding_response("m", [[0.5]], 1)).data[0].embedding == [0.5]


def _sdk_client(handler):
    """An openai client whose HTTP goes to `handler(path, body) -> (status, bytes, content_type)`."""
    openai = pytest.importorskip("openai")
    # openai 3.x ships on httpx2, 1.x / 2.x on httpx
    httpx = pytest.importorskip("httpx2" if importlib.util.find_spec("httpx2") else "httpx")

    def transport(request):
        status, content, kind = handler(request.url.path, json.loads(request.content))
        return httpx.Response(status, content=content, headers={"content-type": kind})

    return openai.OpenAI(
        base_url="http://orchard.test/v1", api_key="x", max_retries=0, http_client=httpx.Client(transport=httpx.MockTransport(transport))
    )


def _serve(path: str, body: dict):
    """A minimal ingress over this module, answering from canned engine deltas."""
    try:
        if path.endswith("/chat/completions"):
            req = parse_chat_request(body)
            generation_fields(req)
            if req.stream:
                enc = StreamEncoder("chat", req.model, "chatcmpl-x", 1, include_usage=req.include_usage)
                return 200, b"".join(enc.feed(d) for d in DELTAS) + enc.close(), "text/event-stream"
            return 200, json.dumps(chat_completion_response(req.model, "chatcmpl-x", 1, join_deltas(DELTAS))).encode(), "application/json"
        if path.endswith("/completions"):
            req = parse_completion_request(body)
            generation_fields(req)
            return 200, json.dumps(completion_response(req.model, "cmpl-x", 1, join_deltas(DELTAS))).encode(), "application/json"
        req = parse_embedding_request(body)
        vectors = [[0.25, -0.5]] * len(req.input)
        return 200, json.dumps(embedding_response(req.model, vectors, 3, req.encoding_format)).encode(), "application/json"
    except ProtocolError as e:
        return e.status, json.dumps(e.body()).encode(), "application/json"


def test_round_trip_through_the_openai_sdk():
    client = _sdk_client(_serve)
    resp = client.chat.completions.create(
        model="smollm2",
        messages=[{"role": "developer", "content": "terse"}, {"role": "user", "content": "hi"}],
        max_completion_tokens=8,
        seed=1,
        user="u",
        metadata={"a": "b"},
        store=False,
        logprobs=True,
        top_logprobs=2,
        extra_body={"top_k": 20},
    )
    assert resp.choices[0].message.content == "Hello é" and resp.usage.total_tokens == 14
    assert resp.choices[0].logprobs.content[0].top_logprobs[1].token == "Hi"
    stream = client.chat.completions.create(
        model="smollm2", messages=[{"role": "user", "content": "hi"}], stream=True, stream_options={"include_usage": True}
    )
    chunks = list(stream)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == "Hello é"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 3
    text = client.completions.create(model="smollm2", prompt="Once", max_tokens=4, logprobs=1)
    assert text.choices[0].text == "Hello é" and text.choices[0].logprobs.text_offset == [0, 3, 6]
    emb = client.embeddings.create(model="minilm", input=["a", "b"])  # the SDK asks for base64 and decodes it
    assert [d.embedding for d in emb.data] == [[0.25, -0.5], [0.25, -0.5]]


def test_sdk_sees_openai_errors():
    openai = pytest.importorskip("openai")
    client = _sdk_client(_serve)
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}], n=2)
    assert info.value.param == "n" and info.value.code == "unsupported_value" and info.value.status_code == 400
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}], tool_choice="required")
    assert info.value.param == "tool_choice"
