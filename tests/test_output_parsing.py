"""OutputParser: the engine's delta stream to OutputEvents. Finish exactly once and last, held text
flushed before it, "tool_calls" only for a natural stop after a complete call, the same merged
result however the engine cut the text."""

import itertools
from types import SimpleNamespace

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st
from pydantic import ValidationError

from router.protocols.events import Finish, ReasoningDelta, TextDelta, ToolCallArguments, ToolCallEnd, ToolCallStart
from router.serving.output.parsing import OutputConfig, OutputParser, tools_enabled
from router.serving.output.reasoning import ReasoningConfig

SETTINGS = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])

QWEN3 = OutputConfig(tool_parser="hermes", reasoning=ReasoningConfig())
USAGE = {"prompt_tokens": 31, "completion_tokens": 12, "cached_tokens": 16}
CALL = '<tool_call>\n{"name": "get_current_weather", "arguments": {"location": "Boston, MA"}}\n</tool_call>'


def ids():
    n = itertools.count()
    return lambda: f"call_{next(n):024x}"


def parse(chunks, finish="stop", config=QWEN3, tools=True, **last) -> list:
    p = OutputParser(config, tools=tools, new_id=ids())
    events = []
    for c in chunks:
        events += p.feed({"text": c, "token_ids": [1], "finish_reason": None, "usage": None})
    events += p.feed({"text": "", "token_ids": [], "finish_reason": finish, "usage": USAGE, **last})
    return events


def check_finish(events) -> Finish:
    finishes = [e for e in events if isinstance(e, Finish)]
    assert len(finishes) == 1 and events[-1] is finishes[0]
    return finishes[0]


def merged(events) -> list:
    out: list = []
    for e in events:
        if isinstance(e, (TextDelta, ReasoningDelta)):
            if out and out[-1][0] == e.type:
                out[-1] = (e.type, out[-1][1] + e.text)
                continue
            out.append((e.type, e.text))
        elif isinstance(e, ToolCallStart):
            out.append(("call", e.index, e.id, e.name))
        elif isinstance(e, ToolCallArguments):
            out.append(("args", e.index, e.arguments))
        elif isinstance(e, ToolCallEnd):
            out.append(("end", e.index))
        else:
            out.append(e)
    return out


TRANSCRIPT = "<think>\nThe user wants the weather; I should call the tool.\n</think>\n\nLet me check.\n" + CALL


def test_reasoning_text_and_call():
    events = parse([TRANSCRIPT])
    assert merged(events) == [
        ("reasoning", "The user wants the weather; I should call the tool."),
        ("text", "Let me check."),
        ("call", 0, "call_" + "0" * 24, "get_current_weather"),
        ("args", 0, '{"location":"Boston, MA"}'),
        ("end", 0),
        Finish(reason="tool_calls", prompt_tokens=31, completion_tokens=12, cached_tokens=16),
    ]


def test_same_result_however_the_engine_cuts_the_text():
    whole = merged(parse([TRANSCRIPT]))
    for i in range(len(TRANSCRIPT) + 1):
        assert merged(parse([TRANSCRIPT[:i], TRANSCRIPT[i:]])) == whole
    assert merged(parse(list(TRANSCRIPT))) == whole


@SETTINGS
@given(data=st.data())
def test_same_result_at_random_cuts(data):
    cuts = sorted(data.draw(st.sets(st.integers(1, len(TRANSCRIPT) - 1), max_size=15)))
    chunks = [TRANSCRIPT[i:j] for i, j in zip([0, *cuts], [*cuts, len(TRANSCRIPT)], strict=True)]
    assert merged(parse(chunks)) == merged(parse([TRANSCRIPT]))


@pytest.mark.parametrize("reason", ["stop", "length", "error", "cancelled"])
@pytest.mark.parametrize("tail", ["", "Hello <tool_c", "<think>unfinished thought </thi", CALL[:40], CALL, "Hi\n\n"])
def test_finish_is_last_exactly_once_and_flushes_what_was_held(reason, tail):
    events = parse([tail], finish=reason)
    fin = check_finish(events)
    assert fin.reason == ("tool_calls" if reason == "stop" and tail == CALL else reason)
    shown = "".join(e.text for e in events if isinstance(e, (TextDelta, ReasoningDelta)))
    calls = sum(isinstance(e, ToolCallStart) for e in events)
    if tail == CALL:
        assert calls == 1 and shown == ""
    elif tail.startswith("<think>"):
        assert shown == "unfinished thought </thi"
    else:
        assert calls == 0 and shown == tail  # nothing held back is lost


def test_finish_reason_on_a_delta_with_text():
    p = OutputParser(QWEN3, tools=True, new_id=ids())
    assert p.feed({"text": "Hello <tool_c"}) == [TextDelta(text="Hello")]
    events = p.feed({"text": "all", "finish_reason": "length", "usage": USAGE})
    assert events == [TextDelta(text=" <tool_call"), Finish(reason="length", **USAGE)]
    assert p.finished
    assert p.feed({"text": "more", "finish_reason": "stop"}) == []  # after the Finish: nothing
    assert p.close() == []


def test_truncated_call_is_text_and_reason_stays_length():
    events = parse([CALL[:-5]], finish="length")
    assert merged(events) == [("text", CALL[:-5]), Finish(reason="length", **USAGE)]


def test_error_fields_and_stop_sequence_pass_through():
    fin = check_finish(parse(["partial"], finish="error", error="engine died", error_code="internal"))
    assert (fin.reason, fin.error, fin.error_code) == ("error", "engine died", "internal")
    fin = check_finish(parse([CALL], finish="error", error="x", error_code="internal"))
    assert fin.reason == "error"  # a call does not turn an error into tool_calls
    fin = check_finish(parse(["The answer is 4. END"], finish="stop", stop_sequence="END"))
    assert fin.stop_sequence == "END" and fin.reason == "stop"
    fin = check_finish(parse(["x"], finish="abandoned"))
    assert fin.reason == "error" and "abandoned" in fin.error


def test_tools_disabled_leaves_call_syntax_as_text():
    events = parse([CALL], tools=False)
    assert merged(events) == [("text", CALL), Finish(reason="stop", **USAGE)]
    events = parse([CALL], config=OutputConfig(), tools=True)  # a model without a tool parser
    assert merged(events)[0] == ("text", CALL)


def test_a_call_drafted_while_thinking_is_reasoning():
    events = parse(["<think>I could write " + CALL + " here.</think>Sunny."])
    assert merged(events) == [("reasoning", "I could write " + CALL + " here."), ("text", "Sunny."), Finish(reason="stop", **USAGE)]


def test_plain_model_passes_text_through():
    p = OutputParser()
    assert p.feed({"text": "<think>hi</think>"}) == [TextDelta(text="<think>hi</think>")]
    assert p.feed({"text": "", "finish_reason": "stop"}) == [Finish(reason="stop")]


def test_engine_delta_objects_are_accepted():
    usage = SimpleNamespace(prompt_tokens=3, completion_tokens=2, cached_tokens=0)
    p = OutputParser(QWEN3, tools=True, new_id=ids())
    events = p.feed(SimpleNamespace(text=CALL, token_ids=[], finish_reason="stop", usage=usage, error=None, error_code=None))
    assert events[-1] == Finish(reason="tool_calls", prompt_tokens=3, completion_tokens=2)


def test_close_finishes_a_stream_that_never_finished():
    p = OutputParser(QWEN3, tools=True, new_id=ids())
    assert p.feed({"text": "<think>hmm"}) == [ReasoningDelta(text="hmm")]
    assert p.feed({"text": " </th"}) == []
    assert p.close(error="client went away") == [ReasoningDelta(text=" </th"), Finish(reason="cancelled", error="client went away")]
    assert p.close() == [] and p.feed({"text": "x", "finish_reason": "stop"}) == []


def test_events_of_one_feed_are_coalesced():
    p = OutputParser(OutputConfig(tool_parser="hermes"), tools=True)
    assert p.feed({"text": "a <b> <tool_x c"}) == [TextDelta(text="a <b> <tool_x c")]


def test_two_calls_are_indexed_and_reason_is_tool_calls():
    events = parse([CALL + "\n" + CALL])
    starts = [e for e in events if isinstance(e, ToolCallStart)]
    assert [s.index for s in starts] == [0, 1] and len({s.id for s in starts}) == 2
    assert check_finish(events).reason == "tool_calls"


def test_output_config():
    assert OutputConfig(tool_parser="llama3", reasoning=True).reasoning == ReasoningConfig()
    assert OutputConfig(reasoning=False).reasoning is None
    assert OutputConfig(reasoning={"end": "</thinking>", "starts_inside": True}).reasoning.starts_inside
    with pytest.raises(ValidationError, match="unknown tool_parser 'qwen'.*hermes"):
        OutputConfig(tool_parser="qwen")
    with pytest.raises(ValidationError):
        OutputConfig(tool_parsers="hermes")
    with pytest.raises(ValidationError):
        QWEN3.tool_parser = None  # frozen


def test_tools_enabled():
    tools = [{"type": "function", "function": {"name": "f"}}]
    assert tools_enabled(tools) and tools_enabled(tools, "auto") and tools_enabled(tools, "required")
    assert tools_enabled(tools, {"type": "function", "function": {"name": "f"}})
    assert not tools_enabled(tools, "none") and not tools_enabled(tools, {"type": "none"})
    assert not tools_enabled(None, "auto") and not tools_enabled([], "required")
