"""The clients as users run them: request sequences shaped after what a Responses-API coding agent,
an Anthropic-Messages coding agent and a chat UI send (tests/fixtures/client_sessions/, written by
us, not captured), replayed turn by turn through the official openai and anthropic SDKs against
SmolLM2 on the shared cluster, the three at the same time as three users would. Each answer is fed back as that client would: a tool call answered
with a canned result, and when the 135M model made no call, the call the client would have made
resent in history with its result (clients resend history with calls in it whatever this run's
model said). The assertions are about shape and protocol, never the model's words: each event
sequence in a valid order as the SDK's own types parse it, ids that chain, usage present and
consistent, allowed stop reasons, previous_response_id continuing the stored conversation, token
counts that grow with it."""

import json
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, cast

import anthropic
import openai
import pytest
from ray import serve
from support.cluster import serve_orchard

SMOL = "smollm2-135m-instruct"
# Three SDK sessions of 3-4 turns over ~2,000-token prompts take about a minute on a 2-core machine:
# `slow` by the suite's rule (over ~30 s), so `make test-all` runs them and `make test` does not.
pytestmark = [pytest.mark.slow, pytest.mark.cluster]

SESSIONS = Path(__file__).parent / "fixtures" / "client_sessions"
STOP_REASONS = {"end_turn", "max_tokens", "stop_sequence", "tool_use"}
FINISH_REASONS = {"stop", "length", "tool_calls"}


@pytest.fixture(scope="module")
def base(models_dir, shared_ray) -> Iterator[str]:
    yield serve_orchard({"models_dir": str(models_dir), "policy": {"min_residency_s": 0, "residency_per_reload": 0}})
    serve.shutdown()


@pytest.fixture(scope="module")
def replayed(base) -> dict[str, BaseException | None]:
    """The three sessions replayed at the same time, as three users of one server would run them
    (their turns share the model's batch); what each raised, for its own test to report."""
    replays = {
        "codex": replay_codex_style_responses_agent,
        "claude_code": replay_claude_code_style_messages_agent,
        "open_webui": replay_open_webui_style_chat,
    }
    with ThreadPoolExecutor(len(replays)) as pool:
        running = {name: pool.submit(replay, base) for name, replay in replays.items()}
    return {name: future.exception() for name, future in running.items()}


def _passed(replayed: dict[str, BaseException | None], name: str) -> None:
    error = replayed[name]
    if error is not None:
        raise error  # with the replay's own traceback


def test_codex_style_responses_agent(replayed):
    _passed(replayed, "codex")


def test_claude_code_style_messages_agent(replayed):
    _passed(replayed, "claude_code")


def test_open_webui_style_chat(replayed):
    _passed(replayed, "open_webui")


def load(name: str) -> Iterator[dict[str, Any]]:
    """The session's steps with `define`d names substituted ("$name" anywhere stands for its value)."""
    names: dict[str, Any] = {}

    def sub(v: Any) -> Any:
        if isinstance(v, str) and v.startswith("$") and v[1:] in names:
            return names[v[1:]]
        if isinstance(v, list):
            return [sub(x) for x in v]
        if isinstance(v, dict):
            return {k: sub(x) for k, x in v.items()}
        return v

    for step in json.loads((SESSIONS / name).read_text()):
        step = sub(step)
        if step["op"] == "define":
            for key, value in step["values"].items():
                names[key] = sub(value)
        else:
            yield step


def test_every_session_file_is_replayed():
    """A new fixture needs a replay here."""
    assert sorted(p.name for p in SESSIONS.glob("*.json")) == ["claude_code_messages.json", "codex_responses.json", "open_webui_chat.json"]


# ---- a Responses-API coding agent ----------------------------------------------------------------

RESPONSE_EVENTS = {
    "response.created",
    "response.in_progress",
    "response.output_item.added",
    "response.content_part.added",
    "response.output_text.delta",
    "response.output_text.done",
    "response.content_part.done",
    "response.function_call_arguments.delta",
    "response.function_call_arguments.done",
    "response.reasoning_text.delta",
    "response.reasoning_text.done",
    "response.output_item.done",
    "response.completed",
    "response.incomplete",
}


def check_response_events(events: list[Any], final: Any) -> None:
    """One streamed response's events: in order, each item opened, filled and closed before the
    next, the deltas adding up to what the item and the final response say."""
    kinds = [e.type for e in events]
    assert set(kinds) <= RESPONSE_EVENTS, kinds
    assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] in ("response.completed", "response.incomplete"), kinds
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert {e.response.id for e in events if e.type.startswith("response.") and hasattr(e, "response")} == {final.id}
    assert events[-1].response.model_dump() == final.model_dump()
    assert events[0].response.status == "in_progress" and events[0].response.output == []
    index = -1
    open_item: Any = None
    text: dict[tuple[int, int], str] = {}
    arguments: dict[int, str] = {}
    for e in events[2:-1]:
        if e.type == "response.output_item.added":
            assert open_item is None and e.output_index == index + 1, kinds
            index, open_item = e.output_index, e.item
            continue
        assert open_item is not None and e.output_index == index, kinds
        if e.type == "response.output_item.done":
            assert e.item.id == open_item.id and e.item.type == open_item.type
            assert e.item.model_dump() == final.output[index].model_dump()
            open_item = None
            continue
        assert e.item_id == open_item.id
        if e.type == "response.output_text.delta":
            text[index, e.content_index] = text.get((index, e.content_index), "") + e.delta
        elif e.type == "response.output_text.done":
            assert e.text == text.get((index, e.content_index), "") == final.output[index].content[e.content_index].text
        elif e.type == "response.function_call_arguments.delta":
            arguments[index] = arguments.get(index, "") + e.delta
        elif e.type == "response.function_call_arguments.done":
            assert e.arguments == arguments.get(index, "") == final.output[index].arguments
    assert open_item is None and index == len(final.output) - 1


def check_response(final: Any, previous: Any, store: bool) -> None:
    assert final.id.startswith("resp_") and final.object == "response" and final.model == SMOL
    assert final.previous_response_id == (previous.id if previous else None) and final.store is store
    if final.status == "incomplete":
        assert final.incomplete_details is not None and final.incomplete_details.reason == "max_output_tokens"
    else:
        assert final.status == "completed" and final.incomplete_details is None
    for item in final.output:
        assert item.type in ("message", "function_call", "reasoning")
        if item.type == "function_call":
            assert item.call_id and item.status == "completed" and isinstance(json.loads(item.arguments or "{}"), dict)
    usage = final.usage
    assert usage is not None and usage.input_tokens > 0 and usage.output_tokens > 0
    assert usage.total_tokens == usage.input_tokens + usage.output_tokens


def replay_codex_style_responses_agent(base: str) -> None:
    client = openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=120)
    held: list[dict[str, Any]] = []  # the conversation as a stateless client holds it
    pending: list[dict[str, Any]] = []  # input items not sent yet
    last: Any = None
    turns = 0
    for step in load("codex_responses.json"):
        if step["op"] in ("developer", "user"):
            pending.append({"type": "message", "role": step["op"], "content": step["content"]})
        elif step["op"] == "tool_round":
            assert last is not None
            made = [item for item in last.output if item.type == "function_call"]
            if not made:  # the call the client would have made, resent as history
                call_id = f"call_{uuid.uuid4().hex[:24]}"
                pending += [step["reasoning"]] if "reasoning" in step else []
                pending.append(
                    {"type": "function_call", "call_id": call_id, "name": step["call"]["name"], "arguments": json.dumps(step["call"]["arguments"])}
                )
                answered = [call_id]
            else:
                answered = [item.call_id for item in made]
            pending += [{"type": "function_call_output", "call_id": call_id, "output": step["output"]} for call_id in answered]
        else:
            assert step["op"] == "send"
            request = dict(step["request"])
            assert request.pop("stream") is True  # the SDK's stream helper sets it
            previous = last if step.get("chain") else None
            sent = pending if previous else held + pending
            if previous:
                request["previous_response_id"] = previous.id
            with client.responses.stream(model=SMOL, input=cast(Any, sent), **request) as stream:
                events: list[Any] = list(stream)
            # the helper's final response is response.completed's; one cut at max_output_tokens ends
            # with response.incomplete instead, whose response is the final one
            final = events[-1].response
            if final.status == "completed":
                helper = stream.get_final_response()
                assert (helper.id, helper.output_text, helper.usage) == (final.id, final.output_text, final.usage)
            check_response_events(events, final)
            check_response(final, previous, request["store"])
            if previous is not None:  # the stored conversation continued: the earlier turns are in the prompt
                assert previous.usage is not None and final.usage is not None
                assert final.usage.input_tokens > previous.usage.input_tokens + previous.usage.output_tokens
            sent_outputs = [p["call_id"] for p in pending if p["type"] == "function_call_output"]
            if request["store"] and sent_outputs:  # the stored conversation has the results, in order, last
                stored = client.responses.input_items.list(final.id, order="asc", limit=100).data
                assert [i.call_id for i in stored if i.type == "function_call_output"][-len(sent_outputs) :] == sent_outputs
            held += pending + [item.model_dump(exclude_none=True) for item in final.output]
            pending = []
            last = final
            turns += 1
    assert turns == 4 and last is not None and last.store is False
    with pytest.raises(openai.NotFoundError):  # store: false is not kept
        client.responses.retrieve(last.id)


# ---- an Anthropic-Messages coding agent -----------------------------------------------------------

RAW_MESSAGE_EVENTS = {"message_start", "content_block_start", "content_block_delta", "content_block_stop", "message_delta", "message_stop", "ping"}
DELTA_FOR_BLOCK = {"text": {"text_delta"}, "thinking": {"thinking_delta", "signature_delta"}, "tool_use": {"input_json_delta"}}


def check_message_events(events: list[Any], final: Any) -> None:
    """The raw SSE events of one streamed message (the helper's own derived events aside):
    message_start, each block started, filled by its own kind of delta and stopped in index order,
    then message_delta and message_stop."""
    raw = [e for e in events if e.type in RAW_MESSAGE_EVENTS and e.type != "ping"]
    kinds = [e.type for e in raw]
    assert kinds[0] == "message_start" and kinds[-2:] == ["message_delta", "message_stop"], kinds
    assert raw[0].message.id == final.id and raw[0].message.content == [] and raw[0].message.stop_reason is None
    open_block: Any = None
    index = -1
    for e in raw[1:-2]:
        if e.type == "content_block_start":
            assert open_block is None and e.index == index + 1, kinds
            index, open_block = e.index, e.content_block
        elif e.type == "content_block_delta":
            assert open_block is not None and e.index == index and e.delta.type in DELTA_FOR_BLOCK[open_block.type], kinds
        else:
            assert e.type == "content_block_stop" and open_block is not None and e.index == index, kinds
            open_block = None
    assert open_block is None and index == len(final.content) - 1
    assert raw[-2].delta.stop_reason == final.stop_reason


def check_message(final: Any) -> None:
    assert final.id.startswith("msg_") and final.type == "message" and final.role == "assistant" and final.model == SMOL
    assert final.stop_reason in STOP_REASONS
    uses = [b for b in final.content if b.type == "tool_use"]
    if final.stop_reason == "tool_use":
        assert uses
    elif uses:  # a complete call whose turn was cut before it ended (a natural end says tool_use)
        assert final.stop_reason == "max_tokens"
    for block in final.content:
        assert block.type in ("text", "thinking", "tool_use")
        if block.type == "tool_use":
            assert block.id and isinstance(block.input, dict)
    assert final.usage.input_tokens > 0 and final.usage.output_tokens > 0


def replay_claude_code_style_messages_agent(base: str) -> None:
    client = anthropic.Anthropic(base_url=base, api_key="unused", max_retries=0, timeout=120)
    history: list[dict[str, Any]] = []
    counted: list[int] = []
    last: Any = None
    counted_now: int | None = None
    turns = 0
    for step in load("claude_code_messages.json"):
        if step["op"] == "user":
            if history and history[-1]["role"] == "user":  # after tool results: the same turn, as the client sends it
                history[-1]["content"] += step["content"]
            else:
                history.append({"role": "user", "content": step["content"]})
        elif step["op"] == "tool_round":
            assert last is not None and history[-1]["role"] == "assistant"
            uses = [b for b in last.content if b.type == "tool_use"]
            if uses:  # the calls the model made, each answered with the first canned result
                answers = [(b.id, step["calls"][0]) for b in uses]
            else:  # the calls the client would have made (in parallel), resent as history
                blocks = history[-1]["content"]
                thinking = [step["thinking"]] if "thinking" in step and not any(b["type"] == "thinking" for b in blocks) else []
                calls = [{"type": "tool_use", "id": f"toolu_{uuid.uuid4().hex[:24]}", "name": c["name"], "input": c["input"]} for c in step["calls"]]
                history[-1]["content"] = thinking + blocks + calls
                answers = [(call["id"], c) for call, c in zip(calls, step["calls"], strict=True)]
            results = [
                {"type": "tool_result", "tool_use_id": i, "content": c["result"]} | ({"is_error": True} if c.get("is_error") else {})
                for i, c in answers
            ]
            history.append({"role": "user", "content": results})
        elif step["op"] == "count_tokens":
            count = client.beta.messages.count_tokens(model=SMOL, messages=cast(Any, history), **step["request"])
            assert isinstance(count.input_tokens, int) and count.input_tokens > 0
            assert not counted or count.input_tokens > counted[-1]  # the conversation only grows
            counted.append(count.input_tokens)
            counted_now = count.input_tokens
        else:
            assert step["op"] == "send"
            with client.beta.messages.stream(model=SMOL, messages=cast(Any, history), **step["request"]) as stream:
                events = list(stream)
                final = stream.get_final_message()
            check_message_events(events, final)
            check_message(final)
            forced = step["request"].get("tool_choice", {}).get("name")
            if forced is not None:  # the grammar makes the call; only max_tokens can cut it (then it is text)
                assert final.stop_reason in ("tool_use", "max_tokens")
                assert final.stop_reason == "max_tokens" or [b.name for b in final.content if b.type == "tool_use"] == [forced]
            usage = final.usage
            prompt = usage.input_tokens + (usage.cache_read_input_tokens or 0) + (usage.cache_creation_input_tokens or 0)
            if counted_now is not None:
                assert prompt == counted_now  # count_tokens, just before, counted the prompt this turn sent
            counted_now = None
            if last is not None:
                assert prompt > last.usage.input_tokens + (last.usage.cache_read_input_tokens or 0)
            # the assistant turn as the client keeps it: the blocks as they came back
            history.append(
                {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in final.content] or [{"type": "text", "text": ""}]}
            )
            last = final
            turns += 1
    assert turns == 4 and len(counted) == 4


# ---- a chat UI on /v1/chat/completions --------------------------------------------------------------


def check_chunks(chunks: list[Any]) -> tuple[str, Any]:
    """A streamed chat answer with include_usage: one id throughout, the role first, one finish
    reason on the last choice chunk, then one chunk with no choices and the usage; its text."""
    assert chunks and {c.id for c in chunks} == {chunks[0].id} and chunks[0].id.startswith("chatcmpl-")
    assert {c.object for c in chunks} == {"chat.completion.chunk"} and {c.model for c in chunks} == {SMOL}
    with_choices, usage_chunk = chunks[:-1], chunks[-1]
    assert usage_chunk.choices == [] and usage_chunk.usage is not None
    assert all(c.usage is None for c in with_choices) and all(len(c.choices) == 1 and c.choices[0].index == 0 for c in with_choices)
    assert with_choices[0].choices[0].delta.role == "assistant"
    finishes = [c.choices[0].finish_reason for c in with_choices]
    assert finishes[-1] in FINISH_REASONS and not any(finishes[:-1]), finishes
    usage = usage_chunk.usage
    assert usage.prompt_tokens > 0 and usage.completion_tokens > 0 and usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
    return "".join(c.choices[0].delta.content or "" for c in with_choices), usage


def check_completion(reply: Any) -> None:
    assert reply.id.startswith("chatcmpl-") and reply.object == "chat.completion" and reply.model == SMOL
    (choice,) = reply.choices
    assert choice.finish_reason in ("stop", "length") and choice.message.role == "assistant" and isinstance(choice.message.content, str)
    usage = reply.usage
    assert usage is not None and usage.prompt_tokens > 0 and usage.completion_tokens > 0
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens


def replay_open_webui_style_chat(base: str) -> None:
    client = openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=120)
    history: list[dict[str, Any]] = []
    prompts: list[int] = []
    sides = 0
    for step in load("open_webui_chat.json"):
        if step["op"] in ("system", "user"):
            history.append({"role": step["op"], "content": step["content"]})
        elif step["op"] == "send":
            chunks: list[Any] = list(client.chat.completions.create(model=SMOL, messages=cast(Any, history), **step["request"]))
            text, usage = check_chunks(chunks)
            assert not prompts or usage.prompt_tokens > prompts[-1]  # the history is resent each turn
            prompts.append(usage.prompt_tokens)
            history.append({"role": "assistant", "content": text})
        else:
            assert step["op"] == "side"
            quoted = "\n".join(f"{m['role'].upper()}: {m['content']}" for m in history if m["role"] != "system")
            reply = client.chat.completions.create(
                model=SMOL, messages=[{"role": "user", "content": step["prompt"].replace("{history}", quoted)}], **step["request"]
            )
            check_completion(reply)
            sides += 1
    assert len(prompts) == 3 and sides == 2
