"""The coding-agent CLIs' recorded requests (tests/fixtures/agents/, written by test_agent_clis.py)
replayed through a real Orchard (the shared cluster, llama-64k), each answer checked with the SDK's
own models as the CLI parses it: Claude Code's ~20k-token first request with max_tokens 32000 is
served, streamed and whole; its second turn, sent with another billing
hash as Claude Code does, is served from the prefix cache; count_tokens gives the prompt's exact
count (tools included). Codex's first request (a namespace tool, web_search, apply_patch as a custom
tool) streams to response.completed, the dropped tool named in a header and apply_patch offered. max_tokens is lowered so a random
model's answer stays short; every other field is as the CLI sent it (a tool round names its tool in
`tool_choice`, so the forced-call grammar makes the random model call it). A long prefill's stream starts
at once and keeps alive; a max_tokens past the room left ends with each protocol's length reason."""

import json
import re
import time
from pathlib import Path

import anthropic
import pytest
import ray
import requests
from anthropic.types import Message, RawMessageStreamEvent
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import TypeAdapter
from ray import serve
from support.cluster import serve_orchard, wait_for

from cluster.model_servers import find_model_servers

pytestmark = pytest.mark.cluster

FIXTURES = Path(__file__).parent / "fixtures" / "agents"
CLAUDE = json.loads((FIXTURES / "claude-code-2.1.332" / "00-v1_messages.json").read_text())
CODEX = json.loads((FIXTURES / "codex-0.171.0" / "00-v1_responses.json").read_text())
MODEL = "llama-64k"
SMALL = "llama-10m"
HEADERS = {"x-api-key": "unused", "anthropic-version": "2023-06-01", "content-type": "application/json"}


@pytest.fixture(scope="module")
def orchard(models_dir, shared_ray):
    models = [
        {"name": MODEL, "kind": "llm", "path": MODEL, "reserve_context_tokens": 65536, "reserve_concurrency": 2},
        {"name": SMALL, "kind": "llm", "path": SMALL},  # a 4096-token context
    ]
    yield serve_orchard({"models_dir": str(models_dir), "models": models, "policy": {"min_residency_s": 0, "residency_per_reload": 0}})
    serve.shutdown()


def _events(response: requests.Response) -> list[dict]:
    return [json.loads(line[6:]) for line in response.iter_lines(decode_unicode=True) if line.startswith("data: ")]


def test_claude_code_requests_are_served_and_cached(orchard):
    first = {**CLAUDE, "max_tokens": 16, "stream": False}
    r = requests.post(orchard + "/v1/messages", json=first, headers=HEADERS, timeout=600)
    assert r.status_code == 200, r.text
    message = Message.model_validate(r.json())
    assert message.stop_reason in ("end_turn", "max_tokens") and message.usage.input_tokens > 10000
    prompt = message.usage.input_tokens + (message.usage.cache_read_input_tokens or 0)
    counted = requests.post(
        orchard + "/v1/messages/count_tokens", json={k: CLAUDE[k] for k in ("model", "system", "messages", "tools")}, headers=HEADERS, timeout=120
    )
    assert counted.status_code == 200 and counted.json()["input_tokens"] == prompt  # exact: the template with tools
    # the next turn as Claude Code sends it: a new billing hash, the answer and a new user message after the history
    billing = CLAUDE["system"][0]["text"].replace("cc_version=", "cc_version=0.0.0.abc; was=")
    second = {
        **CLAUDE,
        "system": [{"type": "text", "text": billing}, *CLAUDE["system"][1:]],
        "messages": [
            *CLAUDE["messages"],
            {"role": "assistant", "content": [{"type": "text", "text": "Done."}]},
            {"role": "user", "content": "Thanks."},
        ],
        "max_tokens": 8,
        "stream": True,
    }
    with requests.post(orchard + "/v1/messages", json=second, headers=HEADERS, timeout=600, stream=True) as streamed:
        assert streamed.status_code == 200
        events = [TypeAdapter(RawMessageStreamEvent).validate_python(e) for e in _events(streamed) if e["type"] != "ping"]
    assert events[0].type == "message_start" and events[-1].type == "message_stop"
    usage = next(e for e in events if e.type == "message_delta").usage
    assert usage.cache_read_input_tokens is not None and usage.input_tokens is not None
    assert usage.cache_read_input_tokens >= 0.95 * (usage.cache_read_input_tokens + usage.input_tokens)
    # the SDK reads the same answer the CLI does
    client = anthropic.Anthropic(base_url=orchard, api_key="unused", max_retries=0, timeout=600)
    again = client.messages.create(
        **{k: v for k, v in second.items() if k not in ("stream", "context_management")},
        extra_body={"context_management": CLAUDE.get("context_management")},
    )
    assert again.usage.cache_read_input_tokens and again.usage.cache_read_input_tokens > 10000


def test_codex_request_streams_to_completion(orchard):
    body = {**CODEX, "max_output_tokens": 16}
    with requests.post(orchard + "/v1/responses", json=body, headers={"Authorization": "Bearer unused"}, timeout=600, stream=True) as r:
        assert r.status_code == 200, r.text
        assert r.headers["Orchard-Dropped-Tools"] == "web_search"
        events = [TypeAdapter(ResponseStreamEvent).validate_python(e) for e in _events(r)]
    assert [e.type for e in events][:2] == ["response.created", "response.in_progress"]
    last = events[-1]
    assert last.type in ("response.completed", "response.incomplete")
    response = Response.model_validate(last.response.model_dump())  # type: ignore[union-attr]
    assert response.usage is not None and response.usage.input_tokens > 2000
    # the whole conversation sent again (Codex resends its history): its prefix is cached
    follow = {
        **body,
        "input": [*CODEX["input"], *[o.model_dump(exclude_none=True) for o in response.output], {"role": "user", "content": "And now?"}],
        "stream": False,
    }
    r2 = requests.post(orchard + "/v1/responses", json=follow, headers={"Authorization": "Bearer unused"}, timeout=600)
    assert r2.status_code == 200, r2.text
    usage = Response.model_validate(r2.json()).usage
    assert usage is not None and usage.input_tokens_details.cached_tokens >= 0.9 * usage.input_tokens


def test_codex_s_freeform_apply_patch_is_offered(orchard):
    """The recorded request carries `apply_patch` as a custom (freeform, lark grammar) tool, as Codex
    sends it for a model its catalog marks so: Orchard offers it to the model (its description and
    `input` parameter are in the prompt: the same request without it reads fewer tokens) and drops
    only web_search."""
    patch = next(t for t in CODEX["tools"] if t.get("name") == "apply_patch")
    assert patch["type"] == "custom" and patch["format"]["syntax"] == "lark"
    body = {**CODEX, "max_output_tokens": 1, "stream": False}
    without = {**body, "tools": [t for t in CODEX["tools"] if t.get("name") != "apply_patch"]}
    answers = [requests.post(orchard + "/v1/responses", json=b, headers={"Authorization": "Bearer unused"}, timeout=600) for b in (body, without)]
    assert [a.status_code for a in answers] == [200, 200], [a.text[:300] for a in answers]
    assert all(a.headers["Orchard-Dropped-Tools"] == "web_search" for a in answers)
    used = [Response.model_validate(a.json()).usage for a in answers]
    assert used[0] is not None and used[1] is not None
    assert used[0].input_tokens > used[1].input_tokens + 50, (used[0].input_tokens, used[1].input_tokens)


def test_claude_code_tool_use_turn_and_its_result(orchard):
    """A whole tool round of Claude Code's conversation through the real engine: its recorded request
    with `tool_choice` naming Read (the random model never calls a tool by itself; the forced-call
    grammar makes llguidance hold its output to a Read call, every other field as recorded), answered
    with a tool_use block. Sampled at the temperature Claude Code leaves to the server: a greedy random
    model repeats itself inside a string until max_tokens, a sampled one closes it well before 1024
    tokens. Then the next request as Claude Code sends it (the tool_use, a tool_result in a user turn,
    no tool_choice, a new billing hash) streams to message_stop, its prompt read from the prefix
    cache. Both answers read with the anthropic SDK's models."""
    forced = {**CLAUDE, "tool_choice": {"type": "tool", "name": "Read"}, "max_tokens": 1024, "stream": False}
    r = requests.post(orchard + "/v1/messages", json=forced, headers=HEADERS, timeout=600)
    assert r.status_code == 200, r.text
    message = Message.model_validate(r.json())
    assert message.stop_reason == "tool_use", message
    call = next(b for b in message.content if b.type == "tool_use")
    assert call.name == "Read" and isinstance(call.input, dict) and isinstance(call.input.get("file_path"), str)
    billing = CLAUDE["system"][0]["text"].replace("cc_version=", "cc_version=0.0.0.def; was=")
    result = {"type": "tool_result", "tool_use_id": call.id, "content": [{"type": "text", "text": "1\tREADME.md\n2\tsrc/\n"}]}
    follow = {
        **CLAUDE,
        "system": [{"type": "text", "text": billing}, *CLAUDE["system"][1:]],
        "messages": [
            *CLAUDE["messages"],
            {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in message.content]},
            {"role": "user", "content": [result]},
        ],
        "max_tokens": 16,
        "stream": True,
    }
    with requests.post(orchard + "/v1/messages", json=follow, headers=HEADERS, timeout=600, stream=True) as streamed:
        assert streamed.status_code == 200, streamed.text
        events = [TypeAdapter(RawMessageStreamEvent).validate_python(e) for e in _events(streamed) if e["type"] != "ping"]
    assert events[0].type == "message_start" and events[-1].type == "message_stop"
    usage = next(e for e in events if e.type == "message_delta").usage
    assert usage.cache_read_input_tokens is not None and usage.input_tokens is not None
    assert usage.cache_read_input_tokens >= 0.9 * (usage.cache_read_input_tokens + usage.input_tokens), usage


def test_codex_apply_patch_call_and_its_output(orchard):
    """A whole tool round of Codex's conversation: its recorded request with `tool_choice` naming the
    custom apply_patch tool (the grammar of the function Orchard offers for it holds the random model
    to calls), answered with `custom_tool_call` items; then the whole history resent with them and
    their `custom_tool_call_output`s, as Codex does, streams to its end. Read with the openai SDK's models."""
    # The random model closes its calls' strings by chance (sampled at Codex's default temperature 1):
    # of 80 forced answers to this request, 16 took over 512 tokens, 3 over 1024 and none over 1,799
    # (5 ms a token). At 1024 about 1 run in 8 ended unclosed; the tail falls ~5x per 512 tokens, so at
    # 8192 the chance is, extrapolated, below 1e-9, and the usual answer costs the same.
    forced = {**CODEX, "tool_choice": {"type": "custom", "name": "apply_patch"}, "max_output_tokens": 8192, "stream": False}
    r = requests.post(orchard + "/v1/responses", json=forced, headers={"Authorization": "Bearer unused"}, timeout=600)
    assert r.status_code == 200, r.text
    response = Response.model_validate(r.json())
    assert response.status == "completed", response.usage
    calls = [o for o in response.output if o.type == "custom_tool_call"]  # parallel_tool_calls is on: one or more
    assert calls and all(c.name == "apply_patch" and isinstance(c.input, str) for c in calls), response.output
    outputs = [
        {"type": "custom_tool_call_output", "call_id": c.call_id, "output": "Success. Updated the following files:\nM README.md\n"} for c in calls
    ]
    follow = {**CODEX, "input": [*CODEX["input"], *[o.model_dump(exclude_none=True) for o in response.output], *outputs], "max_output_tokens": 16}
    with requests.post(orchard + "/v1/responses", json=follow, headers={"Authorization": "Bearer unused"}, timeout=600, stream=True) as streamed:
        assert streamed.status_code == 200, streamed.text
        events = [TypeAdapter(ResponseStreamEvent).validate_python(e) for e in _events(streamed)]
    last = events[-1]
    assert last.type in ("response.completed", "response.incomplete"), [e.type for e in events]
    done = Response.model_validate(last.response.model_dump())  # type: ignore[union-attr]
    # the history resent: the first request's prompt comes from the prefix cache (what follows it,
    # the calls and their outputs, is new, and as long as the random model's calls were)
    assert response.usage is not None and done.usage is not None
    assert done.usage.input_tokens_details.cached_tokens >= 0.9 * response.usage.input_tokens, (response.usage, done.usage)


def _long_prompt(tag: str) -> dict:
    """Claude Code's request made ~30k tokens and new to every cache: its system prompt twice, after a new first line."""
    system = [{"type": "text", "text": f"Session {tag}."}, *CLAUDE["system"][1:], *CLAUDE["system"][1:]]
    return {**CLAUDE, "system": system, "max_tokens": 8, "stream": True}


def test_a_long_prefill_keeps_the_stream_alive(orchard):
    started = time.monotonic()
    with requests.post(orchard + "/v1/messages", json=_long_prompt("one"), headers=HEADERS, timeout=600, stream=True) as r:
        assert r.status_code == 200
        head_s = time.monotonic() - started
        kinds = [json.loads(line[6:])["type"] for line in r.iter_lines(decode_unicode=True) if line.startswith("data: ")]
    whole_s = time.monotonic() - started
    # the answer starts (message_start, a ping) before the prompt is read, and pings come every 5 s until it is
    assert head_s < 4 < whole_s and kinds[:2] == ["message_start", "ping"], (head_s, whole_s, kinds)
    assert kinds.count("ping") >= 1 + int((whole_s - 4) // 5) and kinds[-1] == "message_stop"
    assert "content_block_start" not in kinds[: kinds.index("ping")]


def _context(orchard: str) -> int:
    """llama-10m's context as its engine serves it, from the refusal of a prompt of ~4093 tokens (within
    its KV reservation's 4095): 4096 less the positions a speculative verify step may add
    (deployments/engines/measure.py)."""
    body = {"model": SMALL, "max_tokens": 1, "messages": [{"role": "user", "content": _near_the_context(orchard, 2, 4096)}]}
    refused = requests.post(orchard + "/v1/messages", json=body, headers=HEADERS, timeout=300)
    assert refused.status_code == 400, refused.text
    found = re.search(r"context of (\d+) tokens", refused.json()["error"]["message"])
    assert found is not None, refused.text
    context = int(found.group(1))
    assert 4000 <= context <= 4096
    return context


def _near_the_context(orchard: str, room: int, context: int) -> str:
    """A user message whose prompt leaves `room` tokens of llama-10m's `context` (count_tokens, exact)."""

    def count(n: int) -> int:
        body = {"model": SMALL, "messages": [{"role": "user", "content": "a" + " b" * n}]}
        return requests.post(orchard + "/v1/messages/count_tokens", json=body, headers=HEADERS, timeout=120).json()["input_tokens"]

    base, per = count(0), count(100) - count(0)
    assert per > 0
    n = (context - room - base) * 100 // per
    while count(n) > context - room:
        n -= 1
    assert context - count(n) <= room + 2
    return "a" + " b" * n


def test_a_max_tokens_past_the_room_left_ends_with_each_protocol_s_length_reason(orchard):
    context = _context(orchard)
    text = _near_the_context(orchard, 8, context)
    no_eos = {"temperature": 0}
    anth = requests.post(
        orchard + "/v1/messages",
        json={"model": SMALL, "max_tokens": 32000, "messages": [{"role": "user", "content": text}], **no_eos},
        headers=HEADERS,
        timeout=300,
    )
    assert anth.status_code == 200, anth.text
    message = Message.model_validate(anth.json())
    chat = requests.post(
        orchard + "/v1/chat/completions",
        json={"model": SMALL, "max_tokens": 32000, "messages": [{"role": "user", "content": text}], **no_eos},
        headers=HEADERS,
        timeout=300,
    )
    assert chat.status_code == 200, chat.text
    resp = requests.post(
        orchard + "/v1/responses", json={"model": SMALL, "max_output_tokens": 32000, "input": text, **no_eos}, headers=HEADERS, timeout=300
    )
    assert resp.status_code == 200, resp.text
    response = Response.model_validate(resp.json())
    usage = chat.json()["usage"]
    # greedy, the same prompt: the same tokens on each protocol, up to the context (no EOS in 8 tokens here)
    assert chat.json()["choices"][0]["finish_reason"] == "length" and usage["prompt_tokens"] + usage["completion_tokens"] == context
    assert message.stop_reason == "max_tokens" and message.usage.output_tokens == usage["completion_tokens"]
    assert response.status == "incomplete" and response.incomplete_details is not None
    assert response.incomplete_details.reason == "max_output_tokens"
    # a prompt that leaves no room at all is still a 400
    full = _near_the_context(orchard, 0, context) + " b b b b"
    refused = requests.post(
        orchard + "/v1/messages",
        json={"model": SMALL, "max_tokens": 1, "messages": [{"role": "user", "content": full}]},
        headers=HEADERS,
        timeout=300,
    )
    assert refused.status_code == 400 and refused.json()["error"]["type"] == "invalid_request_error"


def _running(model: str) -> int:
    """Requests the instance of `model` runs now (its engine's health)."""
    healths = [ray.get(handle.health.remote(), timeout=30) for _, handle in find_model_servers()]
    return sum(h.running_requests for h in healths if h.model == model)


def test_a_client_that_leaves_during_a_long_prefill_cancels_it(orchard):
    started = time.monotonic()
    with requests.post(orchard + "/v1/messages", json=_long_prompt("three"), headers=HEADERS, timeout=600, stream=True) as r:
        for line in r.iter_lines(decode_unicode=True):
            if line.startswith("data: ") and json.loads(line[6:])["type"] == "ping":
                break
        # the first ping comes before the prompt is read (message_start, then a ping), so the request
        # may still be on its way to the instance: it is running there before the client leaves
        wait_for(lambda: _running(MODEL) == 1, 30, "the instance to run the request")
    left_s = time.monotonic() - started  # the connection is closed here, a few seconds into a ~9 s prefill
    wait_for(lambda: _running(MODEL) == 0, 30, "the instance to drop the request")
    gone_s = time.monotonic() - started
    whole_s = time.monotonic()
    r = requests.post(orchard + "/v1/messages", json={**_long_prompt("four"), "stream": False}, headers=HEADERS, timeout=600)
    assert r.status_code == 200
    whole_s = time.monotonic() - whole_s
    assert gone_s - left_s < 0.5 * (whole_s - left_s), (left_s, gone_s, whole_s)  # dropped, not read to the end
