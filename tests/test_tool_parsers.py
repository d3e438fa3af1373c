"""Tool-call parsers on outputs as Qwen2.5-7B-Instruct (hermes), Llama-3.1-8B-Instruct (llama3) and
Mistral-7B-Instruct-v0.3 (mistral; the [ARGS] form as Mistral Small 3.2 writes it) produce them, fed
whole and cut at every chunk boundary; render_calls round trips; forced-call grammars checked with
llguidance on a byte-level tokenizer."""

import itertools
import json

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from router.protocols.events import TextDelta, ToolCallArguments, ToolCallEnd, ToolCallStart
from router.serving.output.tool_parser_base import new_call_id
from router.serving.output.tool_parsers import PARSERS, SYNTAX, UnknownToolParser, get_parser, render_call, render_calls

SETTINGS = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def counter_ids():
    n = itertools.count()
    return lambda: f"call_{next(n):024x}"


def run(family: str, chunks) -> list:
    p = get_parser(family, counter_ids())
    events = []
    for c in chunks:
        events += p.feed(c)
    return events + p.finish()


def summary(events) -> list[tuple]:
    """Text merged; each call as ("call", name, arguments); checks the Start/Arguments/End shape."""
    out: list[tuple] = []
    it = iter(events)
    for e in it:
        if isinstance(e, TextDelta):
            assert e.text, "no empty text events"
            if out and out[-1][0] == "text":
                out[-1] = ("text", out[-1][1] + e.text)
            else:
                out.append(("text", e.text))
            continue
        assert isinstance(e, ToolCallStart), e
        args, end = next(it), next(it)
        assert isinstance(args, ToolCallArguments) and isinstance(end, ToolCallEnd)
        assert args.index == end.index == e.index == sum(x[0] == "call" for x in out)
        assert e.id.startswith("call_")
        out.append(("call", e.name, json.loads(args.arguments)))
    return out


def splits(text: str):
    """Whole, every two-chunk cut, and one character at a time."""
    yield [text]
    for i in range(1, len(text)):
        yield [text[:i], text[i:]]
    yield list(text)


BOSTON = {"location": "Boston, MA", "unit": "fahrenheit"}
SF = {"location": "San Francisco, CA", "unit": "fahrenheit"}
PARIS = {"location": "Paris, France", "format": "celsius"}
LONDON = {"location": "London, UK", "format": "celsius"}


def call(name, args):
    return ("call", name, args)


def text(s):
    return ("text", s)


QWEN_CALL = '<tool_call>\n{"name": "get_current_weather", "arguments": {"location": "Boston, MA", "unit": "fahrenheit"}}\n</tool_call>'
QWEN_CALL_SF = '<tool_call>\n{"name": "get_current_weather", "arguments": {"location": "San Francisco, CA", "unit": "fahrenheit"}}\n</tool_call>'
LLAMA_CALL = '{"name": "get_current_weather", "parameters": {"location": "Boston, MA", "unit": "fahrenheit"}}'
LLAMA_CALL_SF = '{"name": "get_current_weather", "parameters": {"location": "San Francisco, CA", "unit": "fahrenheit"}}'
MISTRAL_PARIS = '{"name": "get_current_weather", "arguments": {"location": "Paris, France", "format": "celsius"}}'
MISTRAL_LONDON = '{"name": "get_current_weather", "arguments": {"location": "London, UK", "format": "celsius"}}'

TRANSCRIPTS = {
    # ---- Qwen2.5-7B-Instruct (hermes) ----
    "qwen_single": ("hermes", QWEN_CALL, [call("get_current_weather", BOSTON)]),
    "qwen_text_before": (
        "hermes",
        "I'll check the current weather in Boston for you.\n" + QWEN_CALL,
        [text("I'll check the current weather in Boston for you."), call("get_current_weather", BOSTON)],
    ),
    "qwen_two_calls": ("hermes", QWEN_CALL + "\n" + QWEN_CALL_SF, [call("get_current_weather", BOSTON), call("get_current_weather", SF)]),
    "qwen_malformed": (
        "hermes",
        '<tool_call>\n{"name": "get_current_weather", "arguments": {"location": "Boston, MA", "unit": "fahrenheit"}\n</tool_call>',
        [text('<tool_call>\n{"name": "get_current_weather", "arguments": {"location": "Boston, MA", "unit": "fahrenheit"}\n</tool_call>')],
    ),
    "qwen_malformed_then_good": (
        "hermes",
        '<tool_call>\n{"name": "get_current_weather", "arguments": {"location": "Boston}\n</tool_call>\n' + QWEN_CALL_SF,
        [text('<tool_call>\n{"name": "get_current_weather", "arguments": {"location": "Boston}\n</tool_call>'), call("get_current_weather", SF)],
    ),
    "qwen_no_call": (
        "hermes",
        "The capital of France is Paris. It has been the capital since 508 AD,\nwith brief interruptions.\n",
        [text("The capital of France is Paris. It has been the capital since 508 AD,\nwith brief interruptions.\n")],
    ),
    "qwen_truncated": (
        "hermes",
        '<tool_call>\n{"name": "get_current_weather", "arguments": {"location": "Bos',
        [text('<tool_call>\n{"name": "get_current_weather", "arguments": {"location": "Bos')],
    ),
    "qwen_no_closing_tag": ("hermes", '<tool_call>\n{"name": "get_current_time", "arguments": {}}\n', [call("get_current_time", {})]),
    "qwen_lookalikes": (
        "hermes",
        "Use the <tool> tag; a < b, and <tool_call is not one.",
        [text("Use the <tool> tag; a < b, and <tool_call is not one.")],
    ),
    "qwen_call_then_text": (
        "hermes",
        QWEN_CALL + "\n\nI've asked for the weather in Boston.",
        [call("get_current_weather", BOSTON), text("I've asked for the weather in Boston.")],
    ),
    "qwen_nested_unicode": (
        "hermes",
        '<tool_call>\n{"name": "search", "arguments": {"query": "caf\u00e9 \\"cr\u00e8me\\" {br\u00fbl\u00e9e}", "filters": {"lang": ["fr", "en"], "limit": 5}}}\n</tool_call>',
        [call("search", {"query": 'caf\u00e9 "cr\u00e8me" {br\u00fbl\u00e9e}', "filters": {"lang": ["fr", "en"], "limit": 5}})],
    ),
    # ---- Llama-3.1-8B-Instruct (llama3) ----
    "llama_single": ("llama3", LLAMA_CALL, [call("get_current_weather", BOSTON)]),
    "llama_python_tag": ("llama3", "<|python_tag|>" + LLAMA_CALL, [call("get_current_weather", BOSTON)]),
    "llama_type_function": (
        "llama3",
        '{"type": "function", "name": "get_current_weather", "parameters": {"location": "Boston, MA", "unit": "fahrenheit"}}',
        [call("get_current_weather", BOSTON)],
    ),
    "llama_two_calls": ("llama3", LLAMA_CALL + "; " + LLAMA_CALL_SF, [call("get_current_weather", BOSTON), call("get_current_weather", SF)]),
    "llama_string_parameters": (
        "llama3",
        '{"name": "get_current_weather", "parameters": "{\\"location\\": \\"Boston, MA\\"}"}',
        [call("get_current_weather", {"location": "Boston, MA"})],
    ),
    "llama_malformed": (
        "llama3",
        '{"name": "get_current_weather", "parameters": {"location": "Boston, MA"}',
        [text('{"name": "get_current_weather", "parameters": {"location": "Boston, MA"}')],
    ),
    "llama_no_call": (
        "llama3",
        "I'm not able to provide real-time weather information. You can check a weather website for Boston.",
        [text("I'm not able to provide real-time weather information. You can check a weather website for Boston.")],
    ),
    "llama_json_answer": ("llama3", '{"city": "Paris", "country": "France"}', [text('{"city": "Paris", "country": "France"}')]),
    "llama_name_only_answer": ("llama3", '{"name": "Ada Lovelace"}', [text('{"name": "Ada Lovelace"}')]),
    "llama_text_before": ("llama3", "Here is the function call: " + LLAMA_CALL, [text("Here is the function call: " + LLAMA_CALL)]),
    "llama_call_then_text": (
        "llama3",
        LLAMA_CALL + "\n\nThis will return the current weather.",
        [call("get_current_weather", BOSTON), text("This will return the current weather.")],
    ),
    "llama_tag_then_code": ("llama3", "<|python_tag|>print(2 + 2)", [text("<|python_tag|>print(2 + 2)")]),
    "llama_leading_space_text": ("llama3", "  \n<|python", [text("  \n<|python")]),
    # ---- Mistral-7B-Instruct-v0.3 (mistral) ----
    "mistral_single": ("mistral", "[TOOL_CALLS] [" + MISTRAL_PARIS + "]", [call("get_current_weather", PARIS)]),
    "mistral_two_calls": (
        "mistral",
        "[TOOL_CALLS] [" + MISTRAL_PARIS + ", " + MISTRAL_LONDON + "]",
        [call("get_current_weather", PARIS), call("get_current_weather", LONDON)],
    ),
    "mistral_text_before": (
        "mistral",
        "Let me check that for you.[TOOL_CALLS][" + MISTRAL_PARIS + "]",
        [text("Let me check that for you."), call("get_current_weather", PARIS)],
    ),
    "mistral_malformed": (
        "mistral",
        '[TOOL_CALLS] [{"name": "get_current_weather", "arguments": {"location": "Paris, France"}]',
        [text('[TOOL_CALLS] [{"name": "get_current_weather", "arguments": {"location": "Paris, France"}]')],
    ),
    "mistral_bad_element": (
        "mistral",
        "[TOOL_CALLS] [" + MISTRAL_PARIS + ', {"arguments": {}}]',
        [text("[TOOL_CALLS] [" + MISTRAL_PARIS + ', {"arguments": {}}]')],
    ),
    "mistral_no_call": (
        "mistral",
        "I don't have real-time data [1], but Paris in May averages 20\u00b0C [see TOOL docs].",
        [text("I don't have real-time data [1], but Paris in May averages 20\u00b0C [see TOOL docs].")],
    ),
    "mistral_marker_in_prose": ("mistral", "The [TOOL_CALLS] token marks calls.", [text("The [TOOL_CALLS] token marks calls.")]),
    "mistral_args_form": (
        "mistral",
        '[TOOL_CALLS]get_current_weather[ARGS]{"location": "Paris, France", "format": "celsius"}',
        [call("get_current_weather", PARIS)],
    ),
    "mistral_args_form_two": (
        "mistral",
        '[TOOL_CALLS]get_current_weather[ARGS]{"location": "Paris, France", "format": "celsius"}[TOOL_CALLS]get_current_time[ARGS]{}',
        [call("get_current_weather", PARIS), call("get_current_time", {})],
    ),
    "mistral_args_form_call_id": (
        "mistral",
        '[TOOL_CALLS]get_current_time[CALL_ID]a1B2c3D4e[ARGS]{"timezone": "Europe/Paris"}',
        [call("get_current_time", {"timezone": "Europe/Paris"})],
    ),
    "mistral_args_form_truncated": (
        "mistral",
        '[TOOL_CALLS]get_current_weather[ARGS]{"location": "Par',
        [text('[TOOL_CALLS]get_current_weather[ARGS]{"location": "Par')],
    ),
}


@pytest.mark.parametrize("name", TRANSCRIPTS)
def test_transcript_at_every_split(name):
    family, out, expected = TRANSCRIPTS[name]
    for chunks in splits(out):
        assert summary(run(family, chunks)) == expected, chunks


@pytest.mark.parametrize("name", TRANSCRIPTS)
@SETTINGS
@given(data=st.data())
def test_transcript_at_random_splits(name, data):
    family, out, expected = TRANSCRIPTS[name]
    cuts = sorted(data.draw(st.sets(st.integers(1, max(1, len(out) - 1)), max_size=12)))
    chunks = [out[i:j] for i, j in zip([0, *cuts], [*cuts, len(out)], strict=True)]
    assert summary(run(family, chunks)) == expected


def test_text_goes_out_promptly_and_marker_tails_are_held_briefly():
    p = get_parser("hermes", counter_ids())
    assert p.feed("Hello wor") == [TextDelta(text="Hello wor")]
    assert p.feed("ld <tool_") == [TextDelta(text="ld")]  # " <tool_" may still become a call
    assert p.feed("box>") == [TextDelta(text=" <tool_box>")]
    assert p.feed("\n") == []  # whitespace waits for the next visible character
    assert p.feed("ok") == [TextDelta(text="\nok")]
    m = get_parser("mistral", counter_ids())
    assert m.feed("a [TOOL") == [TextDelta(text="a")]
    assert m.feed("S]") == [TextDelta(text=" [TOOLS]")]
    lp = get_parser("llama3", counter_ids())
    assert lp.feed("Sure") == [TextDelta(text="Sure")]  # not a call: text from the first character on


def test_call_is_emitted_as_soon_as_it_closes():
    p = get_parser("hermes", counter_ids())
    assert p.feed(QWEN_CALL[:-1]) == []
    events = p.feed(QWEN_CALL[-1])
    assert [type(e) for e in events] == [ToolCallStart, ToolCallArguments, ToolCallEnd]
    assert events[1].arguments == '{"location":"Boston, MA","unit":"fahrenheit"}'
    lp = get_parser("llama3", counter_ids())
    assert len(lp.feed(LLAMA_CALL)) == 3


def test_ids_default_to_openai_shape():
    assert len(new_call_id()) == 29 and new_call_id().startswith("call_")
    int(new_call_id()[5:], 16)
    (start, *_) = get_parser("hermes").feed(QWEN_CALL)
    assert start.id.startswith("call_") and len(start.id) == 29


def test_unknown_family_is_a_clear_error():
    with pytest.raises(UnknownToolParser, match="unknown tool_parser 'qwen9'.*hermes.*llama3.*mistral"):
        get_parser("qwen9")
    with pytest.raises(ValueError, match="unknown tool_parser"):
        render_call("qwen9", "f", {})


def test_feed_after_finish_is_a_bug():
    p = get_parser("hermes")
    p.finish()
    assert p.finish() == []
    with pytest.raises(RuntimeError):
        p.feed("x")


PIECES = [
    "<tool_call>",
    "</tool_call>",
    "[TOOL_CALLS]",
    "[ARGS]",
    "[CALL_ID]",
    "<|python_tag|>",
    "<tool_c",
    "[TOOL",
    '{"name": "f", "arguments": {"a": 1}}',
    '{"name": "g", "parameters": {}}',
    '[{"name": "h", "arguments": {}}]',
    "{",
    "}",
    "[",
    "]",
    ";",
    " ",
    "\n",
    "f",
    "words",
    '"',
    "\\",
    ",",
    ":",
]


@pytest.mark.parametrize("family", sorted(PARSERS))
@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(pieces=st.lists(st.sampled_from(PIECES), max_size=14), data=st.data())
def test_any_mix_of_syntax_fragments_is_chunking_independent_and_lossless(family, pieces, data):
    out = "".join(pieces)
    whole = summary(run(family, [out]))
    cuts = sorted(data.draw(st.sets(st.integers(1, max(1, len(out) - 1)), max_size=8)))
    assert summary(run(family, [out[i:j] for i, j in zip([0, *cuts], [*cuts, len(out)], strict=True)])) == whole
    if not any(kind == "call" for kind, *_ in whole):
        assert "".join(t for _, t in whole) == out  # no call: every character comes back


# ---- render_calls --------------------------------------------------------------------------------


def test_render_matches_the_chat_templates():
    assert render_call("hermes", "get_current_weather", BOSTON) == QWEN_CALL
    assert render_call("llama3", "get_current_weather", BOSTON) == LLAMA_CALL
    assert render_calls("mistral", [("get_current_weather", PARIS), ("get_current_weather", LONDON)]) == (
        "[TOOL_CALLS] [" + MISTRAL_PARIS + ", " + MISTRAL_LONDON + "]"
    )
    assert render_call("mistral_v11", "f", '{"a": 1}') == '[TOOL_CALLS]f[ARGS]{"a": 1}'
    assert render_call("hermes", "f", None) == '<tool_call>\n{"name": "f", "arguments": {}}\n</tool_call>'
    with pytest.raises(ValueError):
        render_call("hermes", "f", "[1, 2]")


NAMES = st.from_regex(r"[A-Za-z_][A-Za-z0-9_\-]{0,20}", fullmatch=True)
JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers(-(10**6), 10**6) | st.text(max_size=12),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3),
    max_leaves=8,
)
ARGS = st.dictionaries(st.text(max_size=8), JSON_VALUES, max_size=4)


@pytest.mark.parametrize("family", sorted(SYNTAX))
@SETTINGS
@given(calls=st.lists(st.tuples(NAMES, ARGS), min_size=1, max_size=3), data=st.data())
def test_rendered_calls_parse_back(family, calls, data):
    out = render_calls(family, calls)
    cut = data.draw(st.integers(0, len(out)))
    assert summary(run(family, [out[:cut], out[cut:]])) == [call(n, a) for n, a in calls]


@pytest.mark.parametrize("family", sorted(PARSERS))
@SETTINGS
@given(answer=st.text(), data=st.data())
def test_answers_without_calls_come_out_byte_for_byte(family, answer, data):
    marker = getattr(PARSERS[family], "marker", None)  # every family but llama3 (no marker) and harmony (channels)
    while marker and marker in answer:
        answer = answer.replace(marker, "")
    if not marker and (answer.lstrip()[:1] == "{" or answer.lstrip().startswith("<|python_tag|>")):
        answer = "x" + answer
    cut = data.draw(st.integers(0, len(answer)))
    events = run(family, [answer[:cut], answer[cut:]])
    assert "".join(e.text for e in events) == answer


# ---- forced-call grammars --------------------------------------------------------------------------

llguidance = pytest.importorskip("llguidance")

from router.serving.output.parsing import OutputConfig, OutputParser  # noqa: E402
from router.serving.output.reasoning import ReasoningConfig  # noqa: E402
from router.serving.output.tool_grammar import forced_call_grammar, grammar_error, tool_function  # noqa: E402


class _ByteTokenizer:
    """One token per byte plus EOS: every string is spelled out, so acceptance is about text alone."""

    eos_token_id = 256
    bos_token_id = None
    tokens = [bytes([i]) for i in range(256)] + [b"<eos>"]
    special_token_ids = [256]

    def __call__(self, s):
        return list(s.encode() if isinstance(s, str) else s)


TOKENIZER = llguidance.LLTokenizer(llguidance.TokenizerWrapper(_ByteTokenizer()))


def accepts(grammar: str, out: str) -> bool:
    m = llguidance.LLMatcher(TOKENIZER, llguidance.LLMatcher.grammar_from_lark(grammar), log_level=0)
    return m.consume_tokens(TOKENIZER.tokenize_str(out)) and m.is_accepting()


WEATHER = {
    "type": "function",
    "function": {
        "name": "get_current_weather",
        "description": "Current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"location": {"type": "string"}, "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
            "required": ["location", "unit"],
        },
    },
}
TIME = {"name": "get_current_time", "input_schema": {"type": "object", "properties": {"timezone": {"type": "string"}}}}
CALC = {"name": "add", "parameters": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}, "required": ["a", "b"]}}
TOOLS = [WEATHER, TIME, CALC]
FAMILIES = sorted(SYNTAX)  # the families a grammar can force


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("parallel", [False, True])
@pytest.mark.parametrize("reasoning", [None, ReasoningConfig(), ReasoningConfig(starts_inside=True)], ids=["plain", "think", "inside"])
def test_every_grammar_compiles(family, parallel, reasoning):
    for choice in ["required", "get_current_weather", "get_current_time"]:
        assert grammar_error(forced_call_grammar(family, TOOLS, choice, parallel, reasoning)) is None


@pytest.mark.parametrize("family", FAMILIES)
def test_grammar_admits_rendered_calls_and_they_parse_back(family):
    g = forced_call_grammar(family, TOOLS, "required")
    for name, args in [
        ("get_current_weather", BOSTON),
        ("get_current_time", {}),
        ("get_current_time", {"timezone": "UTC"}),
        ("add", {"a": 2, "b": -3}),
    ]:
        out = render_call(family, name, args)
        assert accepts(g, out), out
        assert summary(run(family, [out])) == [call(name, args)]


@pytest.mark.parametrize("family", FAMILIES)
def test_grammar_rejects_what_is_not_a_valid_call(family):
    g = forced_call_grammar(family, TOOLS, "required")
    bad = [
        render_call(family, "get_weather", BOSTON),  # not a tool
        render_call(family, "get_current_weather", {"location": "Boston, MA"}),  # required unit missing
        render_call(family, "get_current_weather", {"location": "Boston", "unit": "kelvin"}),  # not in enum
        render_call(family, "add", {"a": "2", "b": 3}),  # wrong type
        render_call(family, "add", {"a": 2, "b": 3}).replace('"a": 2', '"a":2'),  # free whitespace
        render_call(family, "add", {"a": 2, "b": 3}).replace('"a": 2', '"a":  2'),
        "Sure! " + render_call(family, "add", {"a": 2, "b": 3}),  # text first
        render_calls(family, [("add", {"a": 1, "b": 2}), ("add", {"a": 3, "b": 4})]),  # not parallel
        "I cannot call tools.",
    ]
    for out in bad:
        assert not accepts(g, out), out


@pytest.mark.parametrize("family", FAMILIES)
def test_named_choice_and_parallel(family):
    named = forced_call_grammar(family, TOOLS, "add")
    assert accepts(named, render_call(family, "add", {"a": 1, "b": 2}))
    assert not accepts(named, render_call(family, "get_current_time", {}))
    par = forced_call_grammar(family, TOOLS, "required", parallel=True)
    two = [("add", {"a": 1, "b": 2}), ("get_current_weather", BOSTON)]
    assert accepts(par, render_calls(family, two))
    assert accepts(par, render_calls(family, two[:1]))
    assert summary(run(family, [render_calls(family, two)])) == [call(n, a) for n, a in two]


@pytest.mark.parametrize("family", FAMILIES)
@settings(max_examples=60, deadline=None)
@given(location=st.text(st.characters(blacklist_categories=["Cs"], blacklist_characters="\x7f"), max_size=20), a=st.integers(-(10**9), 10**9))
def test_any_valid_arguments_are_admitted_and_parse_back(family, location, a):
    # DEL (U+007F) is the one character llguidance's JSON strings want escaped (\u007f) where
    # json.dumps writes it raw; a constrained model writes the escape, which parses back the same.
    g = forced_call_grammar(family, TOOLS, "required", parallel=True)
    calls = [("get_current_weather", {"location": location, "unit": "celsius"}), ("add", {"a": a, "b": 0})]
    out = render_calls(family, calls)
    assert accepts(g, out), out
    assert summary(run(family, [out])) == [call(n, args) for n, args in calls]


def test_a_reasoning_model_may_think_before_the_forced_call():
    inside = ReasoningConfig(starts_inside=True)
    g = forced_call_grammar("hermes", TOOLS, "required", reasoning=inside)
    out = "The user wants Boston's weather.\n</think>\n\n" + QWEN_CALL
    assert accepts(g, out)
    assert not accepts(g, QWEN_CALL)  # the block the prompt opened must be closed first
    parser = OutputParser(OutputConfig(tool_parser="hermes", reasoning=inside), tools=True, new_id=counter_ids())
    events = parser.feed({"text": out, "finish_reason": "stop"})
    assert [e.type for e in events] == ["reasoning", "tool_call_start", "tool_call_arguments", "tool_call_end", "finish"]
    assert events[0].text == "The user wants Boston's weather." and events[-1].reason == "tool_calls"
    optional = forced_call_grammar("hermes", TOOLS, "required", reasoning=ReasoningConfig())
    assert accepts(optional, QWEN_CALL) and accepts(optional, "<think>hmm</think>\n\n" + QWEN_CALL)


def test_grammar_inputs_are_checked():
    with pytest.raises(ValueError, match="not among the tools"):
        forced_call_grammar("hermes", TOOLS, "delete_everything")
    with pytest.raises(ValueError, match="at least one tool"):
        forced_call_grammar("hermes", [], "required")
    with pytest.raises(UnknownToolParser):
        forced_call_grammar("qwen9", TOOLS)
    with pytest.raises(ValueError, match="tool name"):
        forced_call_grammar("hermes", [{"name": "two words", "parameters": {}}])
    with pytest.raises(ValueError, match="object"):
        tool_function({"name": "f", "parameters": {"type": "string"}})
    assert tool_function({"name": "f"}) == ("f", {"type": "object", "properties": {}})
    # A schema llguidance cannot compile is reported, not raised: the router answers 400 with it.
    lookbehind = {"name": "f", "parameters": {"type": "object", "properties": {"s": {"type": "string", "pattern": "(?<=a)b"}}}}
    assert "look-around" in grammar_error(forced_call_grammar("hermes", [lookbehind]))


class _SpecialTokenizer(_ByteTokenizer):
    """Bytes, EOS, and two special tokens as Mistral's and a reasoning model's tokenizers have them."""

    tokens = _ByteTokenizer.tokens + [b"[TOOL_CALLS]", b"</think>"]
    special_token_ids = [256, 257, 258]


SPECIAL = llguidance.LLTokenizer(llguidance.TokenizerWrapper(_SpecialTokenizer()))


def accepts_tokens(grammar: str, tokens: list[int]) -> bool:
    m = llguidance.LLMatcher(SPECIAL, llguidance.LLMatcher.grammar_from_lark(grammar), log_level=0)
    return m.consume_tokens(tokens) and m.is_accepting()


def test_special_token_markers_are_admitted_as_their_token():
    spelled = render_call("mistral", "add", {"a": 1, "b": 2})
    after = list(spelled.removeprefix("[TOOL_CALLS]").encode())
    plain = forced_call_grammar("mistral", TOOLS, "required")
    assert accepts_tokens(plain, list(spelled.encode())) and not accepts_tokens(plain, [257, *after])
    g = forced_call_grammar("mistral", TOOLS, "required", special_tokens={"[TOOL_CALLS]": 257})
    assert grammar_error(g) is None
    assert accepts_tokens(g, [257, *after]) and accepts_tokens(g, list(spelled.encode()))
    thinking = forced_call_grammar(
        "mistral", TOOLS, "add", reasoning=ReasoningConfig(starts_inside=True), special_tokens={"[TOOL_CALLS]": 257, "</think>": 258}
    )
    assert accepts_tokens(thinking, [*b"Add them.", 258, *b"\n\n", 257, *after])
    assert not accepts_tokens(thinking, [257, *after])


def test_a_closing_tag_inside_an_argument_does_not_end_the_hermes_block():
    """Found by the hypothesis test above: the block's end is found outside JSON strings."""
    out = '<tool_call>\n{"name": "f", "arguments": {"q": "</tool_call>", "n": 1}}\n</tool_call>'
    for chunks in ([out], list(out)):
        assert summary(run("hermes", chunks)) == [call("f", {"q": "</tool_call>", "n": 1})]
    # an object followed by something other than the closing tag is still text, as before
    bad = '<tool_call>{"name": "f", "arguments": {}} oops </tool_call> after'
    assert [kind for kind, *_ in summary(run("hermes", [bad]))] == ["text"]
