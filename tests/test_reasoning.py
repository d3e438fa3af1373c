"""The reasoning splitter on outputs as Qwen3 / DeepSeek-R1 distills write them, fed whole and cut at
every chunk boundary (markers split across chunks included)."""

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st
from pydantic import ValidationError

from router.protocols.events import ReasoningDelta, TextDelta
from router.serving.output.reasoning import ReasoningConfig, ReasoningSplitter

SETTINGS = settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])

DEFAULT = ReasoningConfig()
INSIDE = ReasoningConfig(starts_inside=True)
CUSTOM = ReasoningConfig(start="<|begin_of_thought|>", end="<|end_of_thought|>")


def run(config, chunks) -> list:
    s = ReasoningSplitter(config)
    events = []
    for c in chunks:
        events += s.feed(c)
    return events + s.finish()


def merged(events) -> list[tuple[str, str]]:
    out: list[tuple[str, str]] = []
    for e in events:
        assert isinstance(e, (TextDelta, ReasoningDelta)) and e.text
        if out and out[-1][0] == e.type:
            out[-1] = (e.type, out[-1][1] + e.text)
        else:
            out.append((e.type, e.text))
    return out


def splits(text: str):
    yield [text]
    for i in range(1, len(text)):
        yield [text[:i], text[i:]]
    yield list(text)


R, T = "reasoning", "text"
CASES = {
    # Qwen3 with thinking on: the model opens the block itself.
    "qwen3": (
        DEFAULT,
        "<think>\nThe user asks for 2+2. That is 4.\n</think>\n\n2 + 2 = 4.",
        [(R, "The user asks for 2+2. That is 4."), (T, "2 + 2 = 4.")],
    ),
    # Qwen3 with enable_thinking=False: the template writes an empty block into the prompt.
    "qwen3_no_thinking": (DEFAULT, "2 + 2 = 4.", [(T, "2 + 2 = 4.")]),
    "empty_block": (DEFAULT, "<think>\n\n</think>\n\nHi!", [(T, "Hi!")]),
    # DeepSeek-R1 (current template): `<think>\n` is in the prompt.
    "r1_inside": (
        INSIDE,
        "Okay, so the user wants a haiku.\nLet me count syllables.\n</think>\n\nAutumn moonlight\u2014",
        [(R, "Okay, so the user wants a haiku.\nLet me count syllables."), (T, "Autumn moonlight\u2014")],
    ),
    "r1_inside_repeats_start": (INSIDE, "<think>\nHmm.\n</think>\nYes.", [(R, "Hmm."), (T, "Yes.")]),
    "truncated_reasoning": (
        DEFAULT,
        "<think>\nLet me think about this very carefully, step by",
        [(R, "Let me think about this very carefully, step by")],
    ),
    "truncated_inside": (INSIDE, "First, </thi", [(R, "First, </thi")]),
    "think_mentioned_later_is_text": (DEFAULT, "Use <think> tags like <think>this</think>.", [(T, "Use <think> tags like <think>this</think>.")]),
    "end_marker_in_answer_is_text": (DEFAULT, "<think>a</think>b</think>c", [(R, "a"), (T, "b</think>c")]),
    "leading_whitespace_answer": (DEFAULT, "\n\n  Plain answer\n", [(T, "\n\n  Plain answer\n")]),
    "start_prefix_only": (DEFAULT, "<thin", [(T, "<thin")]),
    "lookalike_end": (DEFAULT, "<think>x </thinking> y</think>z", [(R, "x </thinking> y"), (T, "z")]),
    "custom_markers": (
        CUSTOM,
        "<|begin_of_thought|>\n\nplan\n\n<|end_of_thought|>\n\n<|begin_of_solution|>42",
        [(R, "plan"), (T, "<|begin_of_solution|>42")],
    ),
}


@pytest.mark.parametrize("name", CASES)
def test_split_at_every_boundary(name):
    config, out, expected = CASES[name]
    for chunks in splits(out):
        assert merged(run(config, chunks)) == expected, chunks


@pytest.mark.parametrize("name", CASES)
@SETTINGS
@given(data=st.data())
def test_split_at_random_boundaries(name, data):
    config, out, expected = CASES[name]
    cuts = sorted(data.draw(st.sets(st.integers(1, max(1, len(out) - 1)), max_size=10)))
    chunks = [out[i:j] for i, j in zip([0, *cuts], [*cuts, len(out)], strict=True)]
    assert merged(run(config, chunks)) == expected


def test_markers_split_across_chunks_are_held_only_while_needed():
    s = ReasoningSplitter()
    assert s.feed("<th") == []
    assert s.feed("ink>Let me") == [ReasoningDelta(text="Let me")]
    assert s.feed(" see </th") == [ReasoningDelta(text=" see")]
    assert s.feed("inking") == [ReasoningDelta(text=" </thinking")]
    assert s.feed("</") == []
    assert s.feed("think>\n") == []
    assert s.feed("\nDone") == [TextDelta(text="Done")]
    assert s.finish() == []


def test_answer_text_streams_through_at_once():
    s = ReasoningSplitter()
    assert s.feed("Hello") == [TextDelta(text="Hello")]
    assert s.feed(" <think>") == [TextDelta(text=" <think>")]


@SETTINGS
@given(answer=st.text(), data=st.data())
def test_output_without_reasoning_is_unchanged(answer, data):
    if answer.lstrip().startswith("<think>"):
        answer = "x" + answer
    cut = data.draw(st.integers(0, len(answer)))
    assert "".join(e.text for e in run(DEFAULT, [answer[:cut], answer[cut:]])) == answer


@SETTINGS
@given(thought=st.text(), answer=st.text(), data=st.data())
def test_reasoning_and_answer_come_back_apart(thought, answer, data):
    thought = thought.replace("</think>", "")
    out = "<think>" + thought + "</think>" + answer
    cut = data.draw(st.integers(0, len(out)))
    events = run(DEFAULT, [out[:cut], out[cut:]])
    assert "".join(e.text for e in events if e.type == "reasoning") == thought.strip()
    assert "".join(e.text for e in events if e.type == "text") == answer.lstrip()


def test_config():
    assert ReasoningConfig() == ReasoningConfig(start="<think>", end="</think>", starts_inside=False)
    with pytest.raises(ValidationError):
        ReasoningConfig(end="")
    with pytest.raises(ValidationError):
        ReasoningConfig(stop="</think>")
    with pytest.raises(ValidationError):
        DEFAULT.starts_inside = True  # frozen
    s = ReasoningSplitter()
    s.finish()
    with pytest.raises(RuntimeError):
        s.feed("x")


@pytest.mark.parametrize("config", [DEFAULT, INSIDE], ids=["default", "inside"])
@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(pieces=st.lists(st.sampled_from(["<think>", "</think>", "<th", "</th", "ink>", " ", "\n", "x", "<", "/"]), max_size=12), data=st.data())
def test_any_mix_of_marker_fragments_is_chunking_independent(config, pieces, data):
    out = "".join(pieces)
    cuts = sorted(data.draw(st.sets(st.integers(1, max(1, len(out) - 1)), max_size=8)))
    chunks = [out[i:j] for i, j in zip([0, *cuts], [*cuts, len(out)], strict=True)]
    assert merged(run(config, chunks)) == merged(run(config, [out]))
