"""Every tool-call family on its model's real chat template (tests/fixtures/chat_templates, sources in
the README there): the template renders a conversation with tools, a past call (in the message shape
`history_messages` gives the family) and its result; the call text it writes is what the family's
parser reads back, whole and streamed cut at every byte, and as each of the three protocols answers
it; the family is inferred from the template. Pure: no cluster, no model."""

import codecs
import json
import pathlib
import subprocess
import sys
from dataclasses import dataclass

import pytest
from transformers.utils.chat_template_utils import render_jinja_template

from deployments.tool_family import folder_template, infer_family, infer_folder_family, infer_reasoning
from router.protocols import anthropic as anth, openai as oai, responses as resp
from router.protocols.events import ReasoningDelta, TextDelta, ToolCallArguments, ToolCallEnd, ToolCallStart
from router.serving.output.families import history_messages
from router.serving.output.parsing import OutputConfig, OutputParser
from router.serving.output.tool_parsers import FAMILIES, PARSERS, UnknownToolParser, get_parser
from router.serving.renderers import AnthropicRenderer, OpenAIRenderer, ResponsesRenderer

TEMPLATES = pathlib.Path(__file__).parent / "fixtures" / "chat_templates"

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather forecast for a city.",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string", "description": "City name"}, "days": {"type": "integer", "description": "How many days"}},
                "required": ["city"],
            },
        },
    }
]
ARGS = {"city": "Paris", "days": 3}
CONVERSATION = [
    {"role": "system", "content": "You are helpful."},
    {"role": "user", "content": "Weather in Paris for 3 days?"},
    {
        "role": "assistant",
        "content": "",
        "tool_calls": [{"id": "call_0001", "type": "function", "function": {"name": "get_weather", "arguments": json.dumps(ARGS)}}],
    },
    {"role": "tool", "tool_call_id": "call_0001", "content": '{"temp": 21}'},
]


@dataclass(frozen=True)
class Family:
    name: str
    template: str  # file under tests/fixtures/chat_templates
    call: str  # the call exactly as the template writes it (and the model does)
    result: str  # the tool result as the template writes it
    before: str = "Let me check. "  # what the model may write before its call
    inferred: str | None = None  # the family inference gives, when not `name`

    def text(self) -> str:
        return (TEMPLATES / self.template).read_text(encoding="utf-8")


FAMILY_CASES = [
    Family(
        "hermes",
        "hermes-qwen3-0.6b.jinja",
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}\n</tool_call>',
        '<tool_response>\n{"temp": 21}\n</tool_response>',
    ),
    Family(
        "llama3",
        "llama3-llama-3.3-70b-instruct.jinja",
        '{"name": "get_weather", "parameters": {"city": "Paris", "days": 3}}',
        '<|start_header_id|>ipython<|end_header_id|>\n\n"{\\"temp\\": 21}"<|eot_id|>',
        before="",  # a Llama 3 call is the whole answer
    ),
    Family(
        "mistral",
        "mistral-mistral-nemo-instruct-2407.jinja",
        '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}, "id": "76c75faa4"}]',
        '[TOOL_RESULTS]{"content": {"temp": 21}, "call_id": "76c75faa4"}[/TOOL_RESULTS]',
    ),
    Family(
        "mistral_v11",
        "mistral_v11-mistral-small-3.2-24b-instruct-2506.jinja",
        '[TOOL_CALLS]get_weather[CALL_ID]76c75faa4[ARGS]{"city": "Paris", "days": 3}',
        '[TOOL_RESULTS]76c75faa4[TOOL_CONTENT]{"temp": 21}[/TOOL_RESULTS]',
    ),
    Family(
        "qwen3_coder",
        "qwen3_coder-qwen3-coder.jinja",
        "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>",
        '<tool_response>\n{"temp": 21}\n</tool_response>',
    ),
    Family(
        "glm47",
        "glm47-glm-4.6.jinja",
        "<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Paris</arg_value>\n<arg_key>days</arg_key>\n<arg_value>3</arg_value>\n</tool_call>",
        '<|observation|>\n<tool_response>\n{"temp": 21}\n</tool_response>',
    ),
    Family(
        "minimax_m2",
        "minimax_m2-minimax-m2.jinja",
        '<minimax:tool_call>\n<invoke name="get_weather">\n<parameter name="city">Paris</parameter>\n<parameter name="days">3</parameter>\n</invoke>\n</minimax:tool_call>',
        ']~b]tool\n<response>{"temp": 21}</response>',
    ),
    Family(
        "kimi_k2",
        "kimi_k2-kimi-k2-thinking.jinja",
        '<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>{"city": "Paris", "days": 3}<|tool_call_end|><|tool_calls_section_end|>',
        '## Return of functions.get_weather:0\n{"temp": 21}',
    ),
    Family(
        "gemma4",
        "gemma4-gemma-4.jinja",
        '<|tool_call>call:get_weather{city:<|"|>Paris<|"|>,days:3}<tool_call|>',
        '<|turn>tool\n{"temp": 21}<turn|>',
    ),
    Family(
        "pythonic",
        "pythonic-lfm2.5-8b-a1b.jinja",
        "<|tool_call_start|>[get_weather(city='Paris', days=3)]<|tool_call_end|>",
        '<|im_start|>tool\n{"temp": 21}<|im_end|>',
    ),
    Family(
        "deepseek",
        "deepseek-deepseek-v3.1.jinja",
        '<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{"city": "Paris", "days": 3}<｜tool▁call▁end｜><｜tool▁calls▁end｜>',
        '<｜tool▁output▁begin｜>{"temp": 21}<｜tool▁output▁end｜>',
        before="",  # the template writes content right before the calls; no separator to test here
        inferred="hermes",  # its template does not render tools: the engine prompts it Hermes-style
    ),
    Family(
        "harmony",
        "harmony-gpt-oss-120b.jinja",
        '<|start|>assistant to=functions.get_weather<|channel|>commentary json<|message|>{"city": "Paris", "days": 3}<|call|>',
        '<|start|>functions.get_weather to=assistant<|channel|>commentary<|message|>"{\\"temp\\": 21}"<|end|>',
        before="<|channel|>analysis<|message|>The user wants the weather.<|end|>",
    ),
]
BY_NAME = {f.name: f for f in FAMILY_CASES}


def render(family: Family, messages=CONVERSATION) -> str:
    rendered, _ = render_jinja_template(
        [history_messages(family.name, messages)],
        tools=TOOLS,
        chat_template=family.text(),
        add_generation_prompt=True,
        bos_token="<s>",
        eos_token="</s>",
    )
    return rendered[0]


def counter_ids():
    n = iter(range(1000))
    return lambda: f"call_{next(n):024x}"


def summary(events) -> list[tuple]:
    """Text and reasoning merged per run; each call as ("call", name, arguments)."""
    out: list[tuple] = []
    for e in events:
        if isinstance(e, (TextDelta, ReasoningDelta)):
            kind = "text" if isinstance(e, TextDelta) else "reasoning"
            if out and out[-1][0] == kind:
                out[-1] = (kind, out[-1][1] + e.text)
            else:
                out.append((kind, e.text))
        elif isinstance(e, ToolCallStart):
            out.append(("call", e.name))
        elif isinstance(e, ToolCallArguments):
            out[-1] = (*out[-1], json.loads(e.arguments))
        else:
            assert isinstance(e, ToolCallEnd)
    return out


def parse(family: str, chunks: list[str]) -> list[tuple]:
    p = OutputParser(OutputConfig(tool_parser=family), tools=True, tool_specs=TOOLS, new_id=counter_ids())
    events = []
    for c in chunks:
        events += p.feed({"text": c})
    events += p.feed({"text": "", "finish_reason": "stop"})
    assert events[-1].type == "finish" and events[-1].reason == "tool_calls"
    return summary(events[:-1])


def byte_cuts(text: str):
    """`text` cut into two pieces at every byte boundary of its UTF-8, each piece decoded as a
    streaming detokenizer would (a character split across the cut comes whole with the second)."""
    data = text.encode()
    for i in range(len(data) + 1):
        decoder = codecs.getincrementaldecoder("utf-8")()
        yield [decoder.decode(data[:i]), decoder.decode(data[i:], final=True)]


def expected(family: Family) -> list[tuple]:
    if family.name == "harmony":
        return [("reasoning", "The user wants the weather."), ("call", "get_weather", ARGS)]
    head = [("text", family.before.strip())] if family.before.strip() else []
    return [*head, ("call", "get_weather", ARGS)]


@pytest.mark.parametrize("family", FAMILY_CASES, ids=lambda f: f.name)
def test_the_template_renders_the_call_and_its_result_in_the_family_syntax(family):
    prompt = render(family)
    assert family.call in prompt
    assert family.result in prompt
    if family.inferred != "hermes":  # a template without tools gets the engine's Hermes-style prompt instead
        assert "get_weather" in prompt.split(family.call)[0]  # the tools were offered before the call


@pytest.mark.parametrize("family", FAMILY_CASES, ids=lambda f: f.name)
def test_the_call_the_template_writes_parses_back_whole_and_at_every_byte_cut(family):
    output = family.before + family.call
    want = expected(family)
    assert parse(family.name, [output]) == want
    for chunks in byte_cuts(output):
        assert parse(family.name, chunks) == want, chunks
    assert parse(family.name, list(output)) == want  # one character at a time: the finest stream there is


@pytest.mark.parametrize("family", FAMILY_CASES, ids=lambda f: f.name)
def test_the_family_is_inferred_from_its_template(family):
    assert infer_family(family.text()) == (family.inferred or family.name)


def test_inference_reads_a_model_folder_and_its_vocabulary(tmp_path):
    harmony = tmp_path / "gpt-oss"
    harmony.mkdir()
    (harmony / "tokenizer_config.json").write_text(json.dumps({"chat_template": BY_NAME["harmony"].text()}))
    assert folder_template(harmony) == BY_NAME["harmony"].text()
    assert infer_folder_family(harmony) == "harmony"
    coder = tmp_path / "coder"
    coder.mkdir()
    (coder / "chat_template.jinja").write_text(BY_NAME["qwen3_coder"].text())
    assert infer_folder_family(coder) == "qwen3_coder"
    lfm = tmp_path / "lfm"  # LFM2 conversions: no tool markers in the template, the tokens in the vocabulary
    lfm.mkdir()
    (lfm / "tokenizer.json").write_text(json.dumps({"added_tokens": [{"content": "<|tool_call_start|>"}, {"content": "<|tool_call_end|>"}]}))
    assert infer_folder_family(lfm) == "pythonic"
    assert infer_folder_family(tmp_path) is None  # nothing to read
    declared = tmp_path / "laguna"  # a conversion that names its family, as mlx-lm reads it first
    declared.mkdir()
    (declared / "tokenizer_config.json").write_text(json.dumps({"tool_parser_type": "laguna", "chat_template": BY_NAME["hermes"].text()}))
    assert infer_folder_family(declared) == "laguna"
    (declared / "tokenizer_config.json").write_text(json.dumps({"tool_parser_type": "qwen9", "chat_template": BY_NAME["hermes"].text()}))
    assert infer_folder_family(declared) == "hermes"  # a name no parser reads: the template decides


def test_every_family_inference_can_name_has_a_parser():
    from deployments.tool_family import ALIASES, KNOWN_FAMILIES, TEMPLATE_RULES, VOCAB_RULES
    from router.serving.output.tool_parsers import ALIASES as PARSER_ALIASES

    assert {f for f, _ in TEMPLATE_RULES + VOCAB_RULES} <= set(FAMILIES)
    assert set(FAMILIES) == KNOWN_FAMILIES and ALIASES == PARSER_ALIASES  # what a checkpoint may declare is what parses
    for family in FAMILIES:
        get_parser(family)


def test_an_unknown_family_is_refused_naming_the_choices():
    with pytest.raises(UnknownToolParser, match="unknown tool_parser 'qwen9'; known: deepseek, .*harmony.*qwen3_coder"):
        get_parser("qwen9")
    with pytest.raises(ValueError, match="unknown tool_parser 'qwen9'"):
        OutputConfig(tool_parser="qwen9")
    assert OutputConfig(tool_parser="json_tools").tool_parser == "hermes"  # mlx-lm's name for the same syntax


# ---- past turns in each template's own shape ------------------------------------------------------


def test_history_gives_each_template_the_arguments_and_ids_it_renders():
    qwen = history_messages("qwen3_coder", CONVERSATION)
    assert qwen[2]["tool_calls"][0]["function"]["arguments"] == ARGS  # an object: the template iterates it
    assert CONVERSATION[2]["tool_calls"][0]["function"]["arguments"] == json.dumps(ARGS)  # the input is kept
    deepseek = history_messages("deepseek", [{**CONVERSATION[2], "tool_calls": [{"id": "c", "function": {"name": "f", "arguments": {"a": 1}}}]}])
    assert deepseek[0]["tool_calls"][0]["function"]["arguments"] == '{"a": 1}'  # a string: the template concatenates it
    mistral = history_messages("mistral_v11", CONVERSATION)
    call_id = mistral[2]["tool_calls"][0]["id"]
    assert len(call_id) == 9 and call_id.isalnum() and mistral[3]["tool_call_id"] == call_id
    kimi = history_messages("kimi_k2", CONVERSATION + CONVERSATION[2:])
    assert [m.get("tool_call_id") for m in kimi[3::2]] == ["functions.get_weather:0", "functions.get_weather:1"]


def test_without_the_shaping_templates_render_history_wrongly():
    """What history_messages fixes: the client's string arguments, quoted twice by Llama's template
    and refused by Qwen3-Coder's; an OpenAI call id refused by Mistral's."""
    llama = render_jinja_template([CONVERSATION], tools=TOOLS, chat_template=BY_NAME["llama3"].text(), add_generation_prompt=True, bos_token="<s>")[
        0
    ][0]
    assert BY_NAME["llama3"].call not in llama
    with pytest.raises(TypeError, match="item pairs from a mapping"):
        render_jinja_template([CONVERSATION], tools=TOOLS, chat_template=BY_NAME["qwen3_coder"].text(), add_generation_prompt=True)
    openai_ids = [
        CONVERSATION[0],
        CONVERSATION[1],
        {**CONVERSATION[2], "tool_calls": [{**CONVERSATION[2]["tool_calls"][0], "id": "call_Xy12Ab34Cd56Ef78Gh90Ij12"}]},
    ]
    with pytest.raises(Exception, match="length 9"):
        render_jinja_template(
            [openai_ids], tools=TOOLS, chat_template=BY_NAME["mistral_v11"].text(), add_generation_prompt=True, bos_token="<s>", eos_token="</s>"
        )
    shaped = render_jinja_template(
        [history_messages("mistral_v11", openai_ids)], tools=TOOLS, chat_template=BY_NAME["mistral_v11"].text(), bos_token="<s>", eos_token="</s>"
    )[0][0]
    assert "[ARGS]" + json.dumps(ARGS) in shaped


def test_two_rounds_of_calls_round_trip_through_the_template():
    """A second call after the first result: each template writes both, and each written call reads
    back as the call it was (families whose templates write several past turns)."""
    second = {
        "role": "assistant",
        "content": "",
        "tool_calls": [{"id": "call_0002", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}],
    }
    messages = [*CONVERSATION, second, {"role": "tool", "tool_call_id": "call_0002", "content": '{"temp": 5}'}]
    for name in ("hermes", "qwen3_coder", "glm47", "minimax_m2", "gemma4", "pythonic", "harmony", "mistral_v11", "kimi_k2"):
        prompt = render(BY_NAME[name], messages)
        assert "Oslo" in prompt and '{"temp": 5}' in prompt.replace('\\"', '"'), name


# ---- the three protocols ----------------------------------------------------------------------------


def _sse(body: bytes) -> list[dict]:
    return [json.loads(line[6:]) for line in body.decode().splitlines() if line.startswith("data: {")]


@pytest.mark.parametrize("family", FAMILY_CASES, ids=lambda f: f.name)
def test_each_protocol_answers_the_call_streamed_and_whole(family):
    output = family.before + family.call
    deltas = [{"text": c} for c in output] + [{"text": "", "finish_reason": "stop", "usage": {"prompt_tokens": 5, "completion_tokens": 9}}]

    def parser():
        return OutputParser(OutputConfig(tool_parser=family.name), tools=True, tool_specs=TOOLS, new_id=counter_ids())

    chat = oai.ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "hi"}], tools=TOOLS, stream=True)
    whole = OpenAIRenderer(chat, parser()).respond(deltas)["choices"][0]
    assert whole["finish_reason"] == "tool_calls"
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in whole["message"]["tool_calls"]] == [("get_weather", ARGS)]
    renderer = OpenAIRenderer(chat, parser())
    chunks = _sse(b"".join(renderer.feed(d) for d in deltas) + renderer.close())
    pieces = [tc for c in chunks for ch in c["choices"] for tc in ch["delta"].get("tool_calls") or ()]
    assert pieces[0]["function"]["name"] == "get_weather"
    assert json.loads("".join(p["function"].get("arguments") or "" for p in pieces)) == ARGS

    messages = anth.MessagesRequest(
        model="m",
        max_tokens=64,
        messages=[{"role": "user", "content": "hi"}],
        tools=[{"name": "get_weather", "input_schema": TOOLS[0]["function"]["parameters"]}],
    )
    whole_msg = AnthropicRenderer(messages, parser()).respond(deltas)
    assert whole_msg["stop_reason"] == "tool_use"
    assert [(b["name"], b["input"]) for b in whole_msg["content"] if b["type"] == "tool_use"] == [("get_weather", ARGS)]
    renderer_a = AnthropicRenderer(messages, parser())
    events = _sse(renderer_a.start() + b"".join(renderer_a.feed(d) for d in deltas) + renderer_a.close())
    starts = [e["content_block"] for e in events if e["type"] == "content_block_start" and e["content_block"]["type"] == "tool_use"]
    partial = "".join(e["delta"]["partial_json"] for e in events if e["type"] == "content_block_delta" and e["delta"]["type"] == "input_json_delta")
    assert [s["name"] for s in starts] == ["get_weather"] and json.loads(partial) == ARGS

    responses = resp.ResponsesRequest(
        model="m",
        input=[{"role": "user", "content": "hi"}],
        tools=[{"type": "function", "name": "get_weather", "parameters": TOOLS[0]["function"]["parameters"]}],
    )
    whole_resp = ResponsesRenderer(responses, parser()).respond(deltas)
    assert [(i["name"], json.loads(i["arguments"])) for i in whole_resp["output"] if i["type"] == "function_call"] == [("get_weather", ARGS)]
    renderer_r = ResponsesRenderer(responses, parser())
    events = _sse(renderer_r.start() + b"".join(renderer_r.feed(d) for d in deltas) + renderer_r.close())
    done = [e["item"] for e in events if e["type"] == "response.output_item.done" and e["item"]["type"] == "function_call"]
    assert [(i["name"], json.loads(i["arguments"])) for i in done] == [("get_weather", ARGS)]


# ---- what is not a call stays text -------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(set(PARSERS) - {"llama3"}))  # llama3 (no marker): test_tool_parsers
def test_a_call_cut_off_before_its_end_is_text_nothing_lost(name):
    call = BY_NAME[name].call if name in BY_NAME else WRITTEN[name]
    cut = call[: len(call) * 2 // 3]
    p = get_parser(name)
    events = p.feed(cut) + p.finish()
    assert p.calls == 0 and "".join(e.text for e in events) == cut


def test_harmony_without_tools_still_splits_reasoning_from_the_answer():
    output = "<|channel|>analysis<|message|>Think.<|end|><|start|>assistant<|channel|>final<|message|>Hello!"
    p = OutputParser(OutputConfig(tool_parser="harmony"), tools=False)
    events = p.feed({"text": output, "finish_reason": "stop"})
    assert summary(events[:-1]) == [("reasoning", "Think."), ("text", "Hello!")]
    assert events[-1].reason == "stop"
    call = BY_NAME["harmony"].call
    events = OutputParser(OutputConfig(tool_parser="harmony"), tools=False).feed({"text": call, "finish_reason": "stop"})
    assert summary(events[:-1]) == [("text", call.removesuffix("<|call|>") + "<|call|>")]  # no tools: the call is its text


def test_harmony_reads_a_built_in_tool_or_bad_json_as_text_and_plain_output_as_the_answer():
    p = get_parser("harmony")
    browse = '<|channel|>commentary to=browser.search <|constrain|>json<|message|>{"query": "x"}'
    assert summary(p.feed(browse) + p.finish()) == [("text", browse)]
    p = get_parser("harmony")
    assert summary(p.feed("Just an answer.") + p.finish()) == [("text", "Just an answer.")]
    p = get_parser("harmony")
    bad = "<|channel|>commentary to=functions.f <|constrain|>json<|message|>{oops"
    assert summary(p.feed(bad) + p.finish()) == [("text", bad)]


def test_deepseek_v3_fenced_calls_and_several_calls_in_one_section():
    p = get_parser("deepseek")
    out = (
        "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n"
        '{"city": "Paris"}\n```<｜tool▁call▁end｜>\n<｜tool▁call▁begin｜>function<｜tool▁sep｜>get_time\n```json\n{}\n```'
        "<｜tool▁call▁end｜><｜tool▁calls▁end｜>"
    )
    assert summary(p.feed(out) + p.finish()) == [("call", "get_weather", {"city": "Paris"}), ("call", "get_time", {})]


def test_typed_families_read_argument_types_from_the_request_tools():
    """qwen3_coder writes every value as text: the schema says days is an integer."""
    call = BY_NAME["qwen3_coder"].call
    untyped = get_parser("qwen3_coder")
    assert summary(untyped.feed(call) + untyped.finish()) == [("call", "get_weather", {"city": "Paris", "days": "3"})]
    typed = get_parser("qwen3_coder", tools=TOOLS)
    assert summary(typed.feed(call) + typed.finish()) == [("call", "get_weather", ARGS)]


# ---- families whose templates are not in the fixtures: their syntax as mlx-lm's modules document it ----

WRITTEN = {
    "function_gemma": "<start_function_call>call:get_weather{city:<escape>Paris<escape>,days:3}<end_function_call>",
    "longcat": "<longcat_tool_call>get_weather\n<longcat_arg_key>city</longcat_arg_key>\n<longcat_arg_value>Paris</longcat_arg_value>\n"
    "<longcat_arg_key>days</longcat_arg_key>\n<longcat_arg_value>3</longcat_arg_value>\n</longcat_tool_call>",
    "laguna": "<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Paris</arg_value>\n<arg_key>days</arg_key>\n<arg_value>3</arg_value>\n</tool_call>",
    "minicpm5": '<function name="get_weather"><param name="city">Paris</param><param name="days">3</param></function>',
    "muse_spark": '<atem:function_calls><atem:invoke name="get_weather"><atem:parameter name="city">"Paris"</atem:parameter>'
    '<atem:parameter name="days">3</atem:parameter></atem:invoke></atem:function_calls>',
    "kimi_k3": '<|open|>tools<|sep|><|open|>call tool="get_weather" index="1"<|sep|><|open|>argument key="city" type="string"<|sep|>Paris'
    '<|close|>argument<|sep|><|open|>argument key="days" type="number"<|sep|>3<|close|>argument<|sep|><|close|>call<|sep|><|close|>tools<|sep|>',
}


@pytest.mark.parametrize("name", sorted(WRITTEN))
def test_families_without_a_template_fixture_parse_their_syntax_at_every_cut(name):
    output = "Let me check. " + WRITTEN[name]
    want = [("text", "Let me check."), ("call", "get_weather", ARGS)]
    assert parse(name, [output]) == want
    for i in range(len(output) + 1):
        assert parse(name, [output[:i], output[i:]]) == want, i


def test_the_registry_infers_the_family_from_the_folder_and_the_entry_overrides_it(tmp_path):
    from router.residency.registry import from_config

    for name in ("gpt-oss", "qwen3"):
        (tmp_path / name).mkdir()
    (tmp_path / "gpt-oss" / "chat_template.jinja").write_text(BY_NAME["harmony"].text())
    (tmp_path / "qwen3" / "chat_template.jinja").write_text(BY_NAME["hermes"].text())
    sizes = {"weight_bytes": "1GiB", "kv_bytes_per_token": "1KiB"}
    _, entries = from_config(
        [
            {"name": "gpt-oss", "kind": "llm", **sizes},
            {"name": "qwen3", "kind": "llm", **sizes},
            {"name": "forced", "kind": "llm", "path": "gpt-oss", "tool_parser": "hermes", **sizes},
            {"name": "off", "kind": "llm", "path": "gpt-oss", "tool_parser": None, **sizes},
            {"name": "hub", "kind": "llm", "hub_id": "org/model", **sizes},
        ],
        tmp_path,
    )
    assert {n: e.tool_parser for n, e in entries.items()} == {
        "gpt-oss": "harmony",
        "qwen3": "hermes",
        "forced": "hermes",
        "off": None,
        "hub": "hermes",
    }
    assert entries["qwen3"].reasoning == {"starts_inside": False} and entries["gpt-oss"].reasoning is None


@pytest.mark.parametrize(
    "name,reasoning",
    [
        ("hermes", {"starts_inside": False}),  # Qwen3 writes <think> itself
        ("glm47", {"starts_inside": False}),
        ("kimi_k2", {"starts_inside": False}),
        ("minimax_m2", {"starts_inside": True}),  # its generation prompt opens the block
        ("llama3", None),
        ("harmony", None),  # channels: the harmony parser's own
        ("qwen3_coder", None),
    ],
)
def test_think_blocks_are_inferred_from_the_template(name, reasoning):
    assert infer_reasoning(BY_NAME[name].text()) == reasoning


def test_an_inferred_reasoning_splits_minimax_thinking_from_its_call():
    """MiniMax M2's prompt ends inside <think>: the output is reasoning until </think>, then the call."""
    family = BY_NAME["minimax_m2"]
    output = "The user wants Paris.\n</think>\n\n" + family.call
    config = OutputConfig(tool_parser="minimax_m2", reasoning=infer_reasoning(family.text()))
    for i in range(len(output) + 1):
        p = OutputParser(config, tools=True, tool_specs=TOOLS, new_id=counter_ids())
        events = p.feed({"text": output[:i]}) + p.feed({"text": output[i:], "finish_reason": "stop"})
        assert summary(events[:-1]) == [("reasoning", "The user wants Paris."), ("call", "get_weather", ARGS)], i


# ---- python -m router.tools parse ---------------------------------------------------------------------


def cli(*args: str, stdin: str = "") -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "router.tools", "parse", *args], input=stdin, capture_output=True, text=True, timeout=120)


def test_the_parse_command_prints_calls_reasoning_and_text_as_json(tmp_path):
    harmony = BY_NAME["harmony"]
    done = cli("--family", "harmony", stdin=harmony.before + harmony.call)
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout)
    assert out["calls"] == [{"name": "get_weather", "arguments": ARGS}]
    assert out["reasoning"] == "The user wants the weather." and out["text"] == "" and out["finish_reason"] == "tool_calls"
    tools = tmp_path / "tools.json"
    tools.write_text(json.dumps(TOOLS))
    coder = tmp_path / "coder"
    coder.mkdir()
    (coder / "chat_template.jinja").write_text(BY_NAME["qwen3_coder"].text())
    out = json.loads(cli("--model", str(coder), "--tools", str(tools), stdin="Sure. " + BY_NAME["qwen3_coder"].call).stdout)
    assert out["family"] == "qwen3_coder" and out["family_from"].startswith("chat template of")
    assert out["calls"] == [{"name": "get_weather", "arguments": ARGS}] and out["text"] == "Sure."


def test_the_parse_command_shows_a_call_that_did_not_parse_and_refuses_an_unknown_family():
    broken = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}\n</tool_call>'  # one brace short
    out = json.loads(cli("--family", "hermes", stdin=broken).stdout)
    assert out["calls"] == [] and out["text"] == broken and out["markers"] == ["<tool_call>", "</tool_call>"]
    done = cli("--family", "qwen9", stdin="x")
    assert done.returncode == 2 and done.stdout == ""
    assert "unknown tool_parser 'qwen9'; known: deepseek, function_gemma, gemma4" in done.stderr and "harmony" in done.stderr
    done = cli("--model", "no-such-model", "--config", "/nonexistent/ray-config.yaml", stdin="x")
    assert done.returncode == 2 and "no model folder 'no-such-model'" in done.stderr


def test_a_forced_call_for_a_family_without_a_grammar_is_a_clear_error():
    from router.serving.output.tool_grammar import forced_call_grammar

    with pytest.raises(ValueError, match="not available for the harmony family; forcible: hermes, llama3, mistral, mistral_v11"):
        forced_call_grammar("harmony", TOOLS, "required")


# ---- any mix of a family's own fragments: chunking never changes the result, and nothing is lost ------

from hypothesis import HealthCheck, given, settings, strategies as st  # noqa: E402


def fragments(name: str) -> list[str]:
    """The family's markers, pieces of its call text, and plain words: what a property test mixes."""
    call = BY_NAME[name].call if name in BY_NAME else WRITTEN[name]
    cls = PARSERS.get(name)
    markers = [m for m in (getattr(cls, "marker", ""), getattr(cls, "close", "")) if m]
    if name == "harmony":
        markers = ["<|channel|>", "<|message|>", "<|end|>", "<|start|>", "analysis", "final", " to=functions.f", "commentary"]
    third = max(1, len(call) // 3)
    return [*markers, call, call[:third], call[third : 2 * third], call[2 * third :], "words ", "\n", " ", "{", '"', "}"]


@pytest.mark.parametrize("name", sorted({*PARSERS, "harmony"} - {"hermes", "llama3", "mistral", "mistral_v11"}))  # those four: test_tool_parsers
@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_any_mix_of_a_familys_fragments_is_chunking_independent_and_lossless(name, data):
    pieces = data.draw(st.lists(st.sampled_from(fragments(name)), max_size=10))
    out = "".join(pieces)

    def run(chunks):
        p = get_parser(name, counter_ids(), TOOLS)
        events = [e for c in chunks for e in p.feed(c)] + p.finish()
        return summary(events)

    whole = run([out])
    cuts = sorted(data.draw(st.sets(st.integers(1, max(1, len(out) - 1)), max_size=8)))
    assert run([out[i:j] for i, j in zip([0, *cuts], [*cuts, len(out)], strict=True)]) == whole
    if name != "harmony" and not any(kind == "call" for kind, *_ in whole):
        assert "".join(t for _, t in whole) == out  # no call: every character comes back


# ---- the ingress's request preparation: what the engine is sent ----------------------------------------


def prepared(family: str, body: dict):
    from deployments.wire.leases import Grant, LeaseRecord
    from router.serving.generation import prepare
    from router.serving.lease import Lease

    grant = Grant(lease=LeaseRecord(lease_id="l", model="m", node_id="n", acquired_at=0, loaded_at=0), kind="llm", tool_parser=family, epoch="e")
    return prepare(Lease(None, grant), oai.ChatCompletionRequest.model_validate(body), allow_remote_images=False)  # type: ignore[arg-type]


def test_the_engine_gets_past_calls_in_the_familys_shape_and_the_parser_gets_the_tools():
    body = {"model": "m", "messages": CONVERSATION, "tools": TOOLS}
    request, parser = prepared("qwen3_coder", body)
    assert request.messages[2]["tool_calls"][0]["function"]["arguments"] == ARGS
    events = parser.feed({"text": BY_NAME["qwen3_coder"].call, "finish_reason": "stop"})
    assert summary(events[:-1]) == [("call", "get_weather", ARGS)]  # days typed by the request's schema
    request, _ = prepared("mistral_v11", body)
    assert render_jinja_template([request.messages], tools=TOOLS, chat_template=BY_NAME["mistral_v11"].text(), bos_token="<s>", eos_token="</s>")
    request, _ = prepared("deepseek", body)
    assert request.messages[2]["tool_calls"][0]["function"]["arguments"] == json.dumps(ARGS)
