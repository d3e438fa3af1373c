"""Stop strings never leak, even split across deltas; nothing else is held back longer than needed."""

from hypothesis import given, strategies as st

from deployments.engines.text_stream import StopStringFilter


def run(stops, pieces):
    f = StopStringFilter(stops)
    out = [f.push(p) for p in pieces]
    out.append(f.flush())
    return "".join(out), f.stopped


def test_stop_split_across_pieces_is_cut_exactly():
    assert run(["</s>"], ["Hello </", "s> world"]) == ("Hello ", True)
    assert run(["STOP"], ["aS", "T", "OPb"]) == ("a", True)


def test_partial_match_that_does_not_complete_is_released():
    f = StopStringFilter(["###"])
    assert f.push("a##") == "a"  # "##" might begin "###"
    assert f.push("b") == "##b"
    assert f.flush() == "" and not f.stopped


def test_earliest_stop_wins():
    assert run(["world", "lo"], ["hello world"]) == ("hel", True)


@given(st.text(alphabet="ab#x", max_size=30), st.lists(st.integers(1, 5), max_size=10), st.sampled_from(["##", "a#b", "xx"]))
def test_matches_cutting_the_whole_text(text, cuts, stop):
    pieces, i = [], 0
    for c in cuts:
        pieces.append(text[i : i + c])
        i += c
    pieces.append(text[i:])
    emitted, stopped = run([stop], pieces)
    expected = text[: text.find(stop)] if stop in text else text
    assert emitted == expected and stopped == (stop in text)
