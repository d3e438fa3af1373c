"""What the coding-agent CLIs send, understood at the protocol layer (no cluster): Codex's real first
request (tests/fixtures/agents/) flattens its namespace tools and leaves out its hosted web_search;
freeform (custom) tools are a function of one string to the model and a custom_tool_call item to the
client, whatever parser found the call; custom_tool_call items and reasoning items come back as
history; Claude Code's billing line does not reach the prompt; both CLIs' conversation keys lead the
prefix affinity's keys. Responses and events are checked with the openai SDK's own models."""

import json
from pathlib import Path
from typing import Any

import pytest
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import TypeAdapter
from support.chat_body import as_body

from router.protocols import anthropic as ap, responses as rp
from router.protocols.events import Finish, ReasoningDelta, ToolCallArguments, ToolCallEnd, ToolCallStart
from router.protocols.openai import ProtocolError
from router.serving.affinity import prefix_keys

FIXTURES = Path(__file__).parent / "fixtures" / "agents"
CODEX = json.loads((FIXTURES / "codex-0.171.0" / "00-v1_responses.json").read_text())
CLAUDE = json.loads((FIXTURES / "claude-code-2.1.332" / "00-v1_messages.json").read_text())
STREAM_EVENT = TypeAdapter(ResponseStreamEvent)
PATCH = "*** Begin Patch\n*** Add File: hello.txt\n+hi\n*** End Patch\n"
APPLY_PATCH = {
    "type": "custom",
    "name": "apply_patch",
    "description": "Edit files.",
    "format": {"type": "grammar", "syntax": "lark", "definition": "start: /.+/"},
}


def _sse(data: bytes) -> list[dict[str, Any]]:
    return [json.loads(line[6:]) for line in data.decode().splitlines() if line.startswith("data: ")]


def test_codex_first_request_flattens_namespaces_and_drops_hosted_tools():
    req = rp.parse_responses_request(CODEX)
    assert req.dropped_tools == ["web_search"]
    namespaced = {t.name: t.namespace for t in req.function_tools if t.namespace}
    assert namespaced == dict.fromkeys(("close_agent", "resume_agent", "send_input", "spawn_agent", "wait_agent"), "multi_agent_v1")
    chat = as_body(rp.to_chat_request(req))
    names = [t["function"]["name"] for t in chat["tools"]]
    assert "spawn_agent" in names and "exec_command" in names and len(names) == len(set(names)) == len(req.function_tools)
    assert chat["prompt_cache_key"] == CODEX["prompt_cache_key"] and chat["max_tokens"] == rp.UNBOUNDED_OUTPUT_TOKENS
    assert [m["role"] for m in chat["messages"]][:2] == ["system", "system"]  # developer messages


def test_a_namespaced_call_goes_back_with_its_namespace():
    req = rp.parse_responses_request(CODEX)
    events = [ToolCallStart(index=0, id="call_1", name="spawn_agent"), ToolCallArguments(index=0, arguments='{"message": "x"}'), ToolCallEnd(index=0)]
    body = rp.response_object(req, "resp_1", [*events, Finish(reason="tool_calls", prompt_tokens=10, completion_tokens=3)])
    item = Response.model_validate(body).output[0]
    assert (item.type, item.name, item.namespace) == ("function_call", "spawn_agent", "multi_agent_v1")  # type: ignore[union-attr]
    # sent back as history, it is the function the model knows
    again = rp.parse_responses_request(
        {**CODEX, "input": [*CODEX["input"], body["output"][0], {"type": "function_call_output", "call_id": "call_1", "output": "ok"}]}
    )
    chat = as_body(rp.to_chat_request(again))
    assert chat["messages"][-2]["tool_calls"][0]["function"]["name"] == "spawn_agent" and chat["messages"][-1]["role"] == "tool"


def test_a_namespace_function_named_like_a_top_level_tool_is_offered_under_its_namespace():
    tools = [{"type": "function", "name": "f"}, {"type": "namespace", "name": "ns", "description": "d", "tools": [{"type": "function", "name": "f"}]}]
    req = rp.parse_responses_request({"model": "m", "input": "x", "tools": tools})
    assert [(t.name, t.namespace, t.tool_name) for t in req.function_tools] == [("f", None, "f"), ("ns.f", "ns", "f")]
    body = rp.response_object(req, "resp_1", [ToolCallStart(index=0, id="c", name="ns.f"), ToolCallEnd(index=0), Finish(reason="tool_calls")])
    assert (body["output"][0]["name"], body["output"][0]["namespace"]) == ("f", "ns")


def test_a_name_two_namespaces_hold_is_offered_under_each_namespace():
    inner = [{"type": "function", "name": "search"}]
    tools = [{"type": "namespace", "name": n, "description": "d", "tools": inner} for n in ("docs", "web")]
    req = rp.parse_responses_request({"model": "m", "input": "x", "tools": tools})
    assert [(t.name, t.namespace, t.tool_name) for t in req.function_tools] == [("docs.search", "docs", "search"), ("web.search", "web", "search")]


@pytest.mark.parametrize("kind", ["网络", "web_search\r\nX-Evil: 1", "x" * 65, ""])
def test_a_hosted_tool_type_that_is_not_a_name_is_a_400(kind):
    # its type goes back in the Orchard-Dropped-Tools header: text that no header can carry is refused
    with pytest.raises(ProtocolError) as e:
        rp.parse_responses_request({"model": "m", "input": "x", "tools": [{"type": kind}]})
    assert e.value.status == 400 and e.value.param is not None and e.value.param.startswith("tools")


def test_a_hosted_tool_sent_twice_is_named_once():
    req = rp.parse_responses_request({"model": "m", "input": "x", "tools": [{"type": "web_search"}, {"type": "web_search"}]})
    assert req.dropped_tools == ["web_search"]


def test_a_custom_tool_is_a_function_of_one_string_and_its_call_a_custom_tool_call():
    req = rp.parse_responses_request({"model": "m", "input": "add hello.txt", "tools": [APPLY_PATCH], "stream": True})
    tool = as_body(rp.to_chat_request(req))["tools"][0]["function"]
    assert tool["name"] == "apply_patch" and tool["parameters"] == rp.CUSTOM_PARAMETERS and "freeform" in tool["description"]
    arguments = json.dumps({"input": PATCH})
    events = [
        ReasoningDelta(text="A patch."),
        ToolCallStart(index=0, id="call_p", name="apply_patch"),
        ToolCallArguments(index=0, arguments=arguments[:20]),
        ToolCallArguments(index=0, arguments=arguments[20:]),
        ToolCallEnd(index=0),
        Finish(reason="tool_calls", prompt_tokens=50, completion_tokens=20),
    ]
    enc = rp.ResponseStreamEncoder(req, "resp_s")
    data = enc.start() + b"".join(enc.feed(e) for e in events) + enc.close()
    parsed = [STREAM_EVENT.validate_python(e) for e in _sse(data)]
    kinds = [e.type for e in parsed]
    assert "response.custom_tool_call_input.done" in kinds and "response.function_call_arguments.delta" not in kinds
    done = [e for e in parsed if e.type == "response.output_item.done"][-1]
    assert (done.item.type, done.item.input, done.item.call_id) == ("custom_tool_call", PATCH, "call_p")  # type: ignore[union-attr]
    whole = Response.model_validate(rp.response_object(req, "resp_w", events))
    assert [o.type for o in whole.output] == ["reasoning", "custom_tool_call"] and whole.output[1].input == PATCH  # type: ignore[union-attr]


def test_custom_tool_calls_and_reasoning_come_back_as_history():
    req = rp.parse_responses_request(
        {
            "model": "m",
            "tools": [APPLY_PATCH],
            "input": [
                {"role": "user", "content": "add hello.txt"},
                {
                    "type": "reasoning",
                    "id": "rs_1",
                    "summary": [],
                    "content": [{"type": "reasoning_text", "text": "A patch."}],
                    "encrypted_content": None,
                },
                {"type": "custom_tool_call", "id": "ctc_1", "call_id": "call_p", "name": "apply_patch", "input": PATCH, "status": "completed"},
                {"type": "custom_tool_call_output", "call_id": "call_p", "output": "Success. Updated: A hello.txt"},
            ],
        }
    )
    messages = as_body(rp.to_chat_request(req))["messages"]
    assert [m["role"] for m in messages] == ["user", "assistant", "tool"]
    call = messages[1]["tool_calls"][0]
    assert call["function"] == {"name": "apply_patch", "arguments": json.dumps({"input": PATCH})} and call["id"] == "call_p"
    assert messages[2] == {"role": "tool", "content": "Success. Updated: A hello.txt", "tool_call_id": "call_p", "name": "apply_patch"}
    stored = [rp.stored_item(i) for i in req.input]
    assert stored[2]["type"] == "custom_tool_call" and stored[2]["input"] == PATCH and stored[3]["output"].startswith("Success")


def test_claude_code_billing_line_does_not_reach_the_prompt():
    first = CLAUDE["system"][0]["text"]
    assert first.startswith("x-anthropic-billing-header: cc_version=")
    other = {**CLAUDE, "system": [{"type": "text", "text": first.replace("cc_version=", "cc_version=9.9.9.fff; x=")}, *CLAUDE["system"][1:]]}
    one, two = (as_body(ap.to_chat_request(ap.parse_messages_request(body))) for body in (CLAUDE, other))
    assert one == two and "x-anthropic-billing-header" not in json.dumps(one)
    assert one["messages"][0]["content"].startswith("You are a Claude agent")
    assert one["max_tokens"] == 32000 and one["prompt_cache_key"] == CLAUDE["metadata"]["user_id"]
    assert any(m["role"] == "system" for m in one["messages"][1:])  # system messages inside `messages`, where they stand
    inline = {**CLAUDE, "system": f"{first}\nBe brief."}  # a string system prompt: the first line goes
    assert as_body(ap.to_chat_request(ap.parse_messages_request(inline)))["messages"][0]["content"] == "Be brief."


def test_a_conversation_key_leads_the_prefix_keys():
    chat = rp.to_chat_request(rp.parse_responses_request(CODEX))
    keys = prefix_keys(chat)
    plain = prefix_keys(rp.to_chat_request(rp.parse_responses_request({k: v for k, v in CODEX.items() if k != "prompt_cache_key"})))
    assert len(keys) == len(plain) + 1 and keys[0] not in plain
    other = prefix_keys(rp.to_chat_request(rp.parse_responses_request({**CODEX, "prompt_cache_key": "another"})))
    assert other[0] != keys[0] and other[1:] == keys[1:]
