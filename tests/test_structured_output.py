"""Structured output and tool-aware prompts in the batched LLM engine, on real MLX weights.

llama-10m has random weights: sampled at temperature 1.0, it follows nothing but the grammar, so
every output that validates is the grammar's doing. The schemas are derived from random example
values, with sizes bounded (strings by maxLength, arrays by maxItems, integers by a range, objects by
additionalProperties false) so a random model must end well inside max_tokens."""

import asyncio
import json
import math
import re

import jsonschema
import pytest
from pydantic import ValidationError
from support.schemas import random_schemas

from deployments.engine import RequestError
from deployments.engines import chat_format
from deployments.engines.llm import LLMEngine
from deployments.wire.generation import Constraint, GenerationRequest


def run(coro):
    return asyncio.run(coro)


def run_all(coros) -> list:
    async def gathered():
        return await asyncio.gather(*coros)

    return run(gathered())


@pytest.fixture(scope="module")
def engine(models_dir):
    e = LLMEngine("llama-10m", str(models_dir / "llama-10m"), max_batch=32)
    run(e.load())
    yield e
    run(e.stop())


def test_the_schema_generator_covers_every_shape():
    text = json.dumps(random_schemas(20))
    for needle in (
        '"type": "string"',
        '"maxLength"',
        '"type": "integer"',
        '"type": "number"',
        '"type": "boolean"',
        '"enum"',
        '"type": "array"',
        '"required"',
        '"additionalProperties": false',
    ):
        assert needle in text, needle
    assert any(s["properties"].get(k, {}).get("type") == "object" for s in random_schemas(20) for k in s["properties"])


def test_twenty_random_schemas_in_one_batch_all_validate(engine):
    schemas = random_schemas(20)

    async def scenario():
        requests = [
            GenerationRequest(
                prompt=f"Record {i}:",
                max_tokens=400,
                temperature=1.0,
                seed=i,
                constraint=Constraint(type="json_schema", schema=schema),
            )
            for i, schema in enumerate(schemas)
        ]
        return await asyncio.gather(*(engine.complete(r) for r in requests))

    results = run(scenario())
    for schema, result in zip(schemas, results, strict=True):
        assert result.finish_reason == "stop", (schema, result.text)
        value = json.loads(result.text)
        jsonschema.validate(value, schema)
        assert result.usage.completion_tokens < 300
    assert engine.running_requests() == 0


def test_regex_constraint_matches_the_whole_output(engine):
    pattern = r"(yes|no), [0-9]{2}-[a-z]{3}"
    results = run_all(
        engine.complete(
            GenerationRequest(prompt="Answer:", max_tokens=40, temperature=1.0, seed=s, constraint=Constraint(type="regex", pattern=pattern))
        )
        for s in range(4)
    )
    for r in results:
        assert r.finish_reason == "stop" and re.fullmatch(pattern, r.text), r.text
    # logprobs come from the masked distribution: the alternatives are only allowed tokens
    few = run(
        engine.complete(
            GenerationRequest(
                prompt="Answer:",
                max_tokens=4,
                temperature=1.0,
                seed=0,
                logprobs=True,
                top_logprobs=20,
                constraint=Constraint(type="regex", pattern="(yes|no)"),
            )
        )
    )
    assert few.text in ("yes", "no")
    first = few.logprobs[0]
    assert 1 <= len(first.top) < 20 and all(math.isfinite(v) for _, _, v in first.top)
    assert all(("yes".startswith(t) or "no".startswith(t)) and t for _, t, _ in first.top)


TOOL_CALL_GRAMMAR = r"""
start: "<tool_call>" call "</tool_call>"
call: %json {
  "type": "object",
  "properties": {
    "name": {"const": "get_weather"},
    "arguments": {
      "type": "object",
      "properties": {"city": {"type": "string", "minLength": 1, "maxLength": 12}},
      "required": ["city"],
      "additionalProperties": false
    }
  },
  "required": ["name", "arguments"],
  "additionalProperties": false,
  "x-guidance": {"whitespace_flexible": false, "item_separator": ", ", "key_separator": ": "}
}
"""


def test_a_lark_grammar_forces_a_hermes_tool_call(engine):
    results = run_all(
        engine.complete(
            GenerationRequest(
                messages=[{"role": "user", "content": "Weather in Paris?"}],
                max_tokens=80,
                temperature=1.0,
                seed=s,
                constraint=Constraint(type="lark", grammar=TOOL_CALL_GRAMMAR),
            )
        )
        for s in range(3)
    )
    for r in results:
        assert r.finish_reason == "stop", r.text
        m = re.fullmatch(r'<tool_call>(\{"name": "get_weather", "arguments": \{"city": ".*"\}\})</tool_call>', r.text, re.DOTALL)
        assert m, r.text
        call = json.loads(m.group(1))
        assert call["name"] == "get_weather" and set(call["arguments"]) == {"city"}
        assert 1 <= len(call["arguments"]["city"]) <= 12


def test_constrained_and_unconstrained_requests_share_a_batch(engine):
    schema = {
        "type": "object",
        "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}, "s": {"type": "string", "maxLength": 4}},
        "required": ["n", "s"],
        "additionalProperties": False,
    }
    plain = [GenerationRequest(prompt=p, max_tokens=30, temperature=0) for p in ("The number one is", "def f(x):", "Paris")]
    constrained = [
        GenerationRequest(prompt="JSON:", max_tokens=60, temperature=1.0, seed=s, constraint=Constraint(type="json_schema", schema=schema))
        for s in range(3)
    ]

    async def scenario():
        alone = [await engine.complete(r) for r in plain]
        together = await asyncio.gather(*(engine.complete(r) for r in (*constrained, *plain)))
        return alone, together

    alone, together = run(scenario())
    for r in together[:3]:
        assert r.finish_reason == "stop"
        jsonschema.validate(json.loads(r.text), schema)
    assert [r.token_ids for r in together[3:]] == [r.token_ids for r in alone]
    assert all(r.finish_reason == "length" for r in together[3:])


def test_a_grammar_that_does_not_compile_is_an_invalid_request(engine):
    bad = [
        Constraint(type="json_schema", schema={"type": "object", "properties": {"a": {"type": "strin"}}}),
        Constraint(type="json_schema", schema={"type": "string", "format": "no-such-format"}),
        Constraint(type="regex", pattern="[a-z"),
        Constraint(type="lark", grammar="start: undefined_rule"),
    ]

    async def scenario():
        good = asyncio.create_task(engine.complete(GenerationRequest(prompt="Hello", max_tokens=20, temperature=0)))
        errors = []
        for constraint in bad:
            stream = engine.generate(GenerationRequest(prompt="Hello", max_tokens=8, constraint=constraint))
            with pytest.raises(RequestError) as info:
                await stream.__anext__()  # raised before any output
            errors.append(info.value)
        return errors, await good

    errors, good = run(scenario())
    assert [(e.code, e.param) for e in errors] == [("invalid_request", "response_format")] * len(bad)
    assert "strin" in errors[0].message and "does not compile" in errors[0].message
    assert "no-such-format" in errors[1].message
    assert good.usage.completion_tokens == 20 and engine.health().status == "ready"
    # strict=False ignores what llguidance does not implement (an unknown format) instead of refusing
    lenient = Constraint(type="json_schema", schema={"type": "string", "format": "no-such-format", "maxLength": 5}, strict=False)
    r = run(engine.complete(GenerationRequest(prompt="Hi", max_tokens=30, temperature=1.0, seed=1, constraint=lenient)))
    assert r.finish_reason == "stop" and isinstance(json.loads(r.text), str)


def test_constraint_and_tools_validation():
    with pytest.raises(ValidationError):
        Constraint(type="json_schema")
    with pytest.raises(ValidationError):
        Constraint(type="regex")
    with pytest.raises(ValidationError):
        Constraint(type="yaml")
    with pytest.raises(ValidationError):
        GenerationRequest(prompt="x", tools=[{"type": "function", "function": {"description": "no name"}}])
    request = GenerationRequest.model_validate(
        {"prompt": "x", "constraint": {"type": "json_schema", "schema": {"type": "object"}}, "tools": [WEATHER_TOOL]}
    )
    assert request.constraint.schema == {"type": "object"}
    assert GenerationRequest.model_validate(request.model_dump()) == request  # round-trips as a dict (Ray)


def test_json_object_on_a_real_model(models_dir):
    """Any JSON object: a random model never closes an unbounded string, so this one runs on
    smollm2's real weights."""

    async def scenario():
        e = LLMEngine("smollm2", str(models_dir / "smollm2-135m-instruct"))
        await e.load()
        try:
            request = GenerationRequest(
                messages=[{"role": "user", "content": "Describe a cat as a JSON object with keys name and color."}],
                max_tokens=60,
                temperature=0,
                constraint=Constraint(type="json_object"),
            )
            return await e.complete(request)
        finally:
            await e.stop()

    r = run(scenario())
    assert r.finish_reason == "stop"
    assert isinstance(json.loads(r.text), dict)


# ---- tool-aware prompts --------------------------------------------------------------------------

WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather of a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}

HISTORY = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Weather in Paris and Rome?"},
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
            {"id": "call_2", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Rome"}'}},
        ],
    },
    {"role": "tool", "tool_call_id": "call_1", "content": "18 C, sunny"},
    {"role": "tool", "tool_call_id": "call_2", "content": "24 C"},
]


def test_template_tool_detection():
    chatml = "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] }}{% endfor %}"
    hermes = "{%- if tools %}{{- '<tools>' }}{%- for tool in tools %}{{ tool | tojson }}{%- endfor %}{%- endif %}" + chatml
    assert not chat_format.template_supports_tools(chatml)
    assert not chat_format.template_supports_tools("{{ 'You can use tools when asked' }}" + chatml)
    assert not chat_format.template_supports_tools(None)
    assert chat_format.template_supports_tools(hermes)
    assert chat_format.template_supports_tools("{{ tools | tojson }}")
    assert chat_format.template_supports_tools({"default": chatml, "tool_use": hermes})
    assert chat_format.template_supports_tools([{"name": "default", "template": hermes}])


def test_fallback_rendering_of_tools_and_tool_history():
    messages = chat_format.fallback_messages(HISTORY, [WEATHER_TOOL])
    assert [m["role"] for m in messages] == ["system", "user", "assistant", "user"]
    system = messages[0]["content"]
    assert system.startswith("Be brief.\n\n") and json.dumps(WEATHER_TOOL) in system
    assert '<tool_call>{"name": <function-name>, "arguments": <args-json-object>}</tool_call>' in system
    assert messages[2]["content"] == (
        '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>\n'
        '<tool_call>{"name": "get_weather", "arguments": {"city": "Rome"}}</tool_call>'
    )
    assert messages[3]["content"] == "<tool_response>\n18 C, sunny\n</tool_response>\n<tool_response>\n24 C\n</tool_response>"
    assert HISTORY[2]["content"] is None and HISTORY[0]["content"] == "Be brief."  # inputs untouched

    # no system message: the preamble is one; no tools: no preamble, None content becomes ""
    alone = chat_format.fallback_messages([{"role": "user", "content": "hi"}], [WEATHER_TOOL])
    assert alone[0]["role"] == "system" and alone[1] == {"role": "user", "content": "hi"}
    plain = chat_format.fallback_messages([{"role": "user", "content": "hi"}, {"role": "assistant", "content": None}])
    assert plain == [{"role": "user", "content": "hi"}, {"role": "assistant", "content": ""}]
    # text beside calls, arguments already an object, and arguments that are not JSON
    mixed = chat_format.fallback_messages(
        [
            {
                "role": "assistant",
                "content": "Checking.",
                "tool_calls": [
                    {"type": "function", "function": {"name": "f", "arguments": {"a": 1}}},
                    {"type": "function", "function": {"name": "g", "arguments": "not json"}},
                ],
            }
        ]
    )
    assert mixed[0]["content"] == (
        'Checking.\n<tool_call>{"name": "f", "arguments": {"a": 1}}</tool_call>\n<tool_call>{"name": "g", "arguments": "not json"}</tool_call>'
    )
    # a template that knows tools gets the messages and tools as they are
    assert chat_format.chat_inputs(HISTORY, [WEATHER_TOOL], True) == (HISTORY, {"tools": [WEATHER_TOOL]})
    assert chat_format.chat_inputs(HISTORY, None, False) == (chat_format.fallback_messages(HISTORY), {})


def test_the_engine_renders_tools_into_the_prompt(engine):
    assert engine.template_knows_tools is False  # llama-10m's ChatML template ignores tools
    request = GenerationRequest(messages=HISTORY, tools=[WEATHER_TOOL], max_tokens=4, temperature=0)
    expected = engine.tokenizer.apply_chat_template(chat_format.fallback_messages(HISTORY, [WEATHER_TOOL]), add_generation_prompt=True)
    r = run(engine.complete(request))
    assert r.usage.prompt_tokens == len(expected)
    prompt = engine.tokenizer.decode(expected)
    assert "<tool_response>\n18 C, sunny\n</tool_response>" in prompt and '"name": "get_weather"' in prompt
