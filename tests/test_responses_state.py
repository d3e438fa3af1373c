"""Stored Responses without a cluster (router/protocols/responses/store.py, state.py): the store over
a dict-backed key-value store keeps a record for its TTL, only for the key that made it, within its
size caps (a conversation over the per-response cap refused, the oldest records deleted over the
total cap); a continued request's input is the earlier conversation (inputs, then outputs with
reasoning items and function calls) before its own, without the earlier instructions; the
input_items pages have OpenAI's list shape and parse with the openai SDK's types. The cluster test
is tests/test_responses_state_e2e.py."""

from typing import Any

import pytest
from openai.types.responses import Response, ResponseItemList
from support.chat_body import as_body

from router.protocols import responses as rp
from router.protocols.events import Finish, ReasoningDelta, TextDelta, ToolCallArguments, ToolCallEnd, ToolCallStart
from router.protocols.openai import ProtocolError
from router.protocols.responses.store import INDEX, RECORD, SWEEP_PERIOD_S

DAY = 24 * 3600.0


class DictKV:
    """The store's KV interface over a dict (what Ray's GCS gives the app)."""

    def __init__(self) -> None:
        self.data: dict[str, bytes] = {}
        self.lists = 0

    def get(self, key: str) -> bytes | None:
        return self.data.get(key)

    def put(self, key: str, value: bytes) -> None:
        self.data[key] = value

    def delete(self, key: str) -> None:
        self.data.pop(key, None)

    def keys(self, prefix: str) -> list[str]:
        self.lists += 1
        return [k for k in self.data if k.startswith(prefix)]


class Clock:
    def __init__(self, now: float = 1_700_000_000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def request(**kw: Any) -> rp.ResponsesRequest:
    return rp.parse_responses_request({"model": "smollm2", "input": "Hi", **kw})


TURN = [
    ReasoningDelta(text="They greet me."),
    TextDelta(text="Hello! "),
    ToolCallStart(index=0, id="call_a", name="get_weather"),
    ToolCallArguments(index=0, arguments='{"city": "Paris"}'),
    ToolCallEnd(index=0),
    Finish(reason="tool_calls", prompt_tokens=10, completion_tokens=5),
]


def record(
    response_id: str, owner: str = "team-a", created_at: float = 0.0, pad: int = 0, req: rp.ResponsesRequest | None = None
) -> rp.StoredResponse:
    req = req or request(input="x" * pad if pad else "Hi")
    response = rp.response_object(req, response_id, TURN)
    return rp.StoredResponse(
        id=response_id, owner=owner, created_at=created_at, model=req.model, response=response, input_items=rp.conversation(None, req)
    )


@pytest.fixture
def clock() -> Clock:
    return Clock()


def store(clock: Clock, **settings: Any) -> tuple[rp.ResponseStore, DictKV]:
    kv = DictKV()
    return rp.ResponseStore(kv, rp.StoreSettings(**settings), clock=clock), kv


# ---- the store -----------------------------------------------------------------------------------


def test_a_record_is_read_back_by_its_owner_only(clock):
    s, _ = store(clock)
    r = record("resp_1", owner="team-a", created_at=clock.now)
    s.put(r)
    assert s.get("resp_1", "team-a") == r
    assert s.get("resp_1", "team-b") is None  # another key: as if it never existed
    assert not s.delete("resp_1", "team-b") and s.get("resp_1", "team-a") == r  # nor can it delete it
    assert s.delete("resp_1", "team-a")
    assert s.get("resp_1", "team-a") is None and not s.delete("resp_1", "team-a")


def test_ids_that_are_not_response_ids_find_nothing(clock):
    s, kv = store(clock)
    kv.put(RECORD + "../x", b"{}")
    for bad in ("../x", "resp_a/b", "", "resp_" + "a" * 101):
        assert s.get(bad, "team-a") is None and not s.delete(bad, "team-a")


def test_a_record_expires_after_its_ttl(clock):
    s, kv = store(clock, ttl_s=DAY)
    s.put(record("resp_1", created_at=clock.now))
    clock.now += DAY - 1
    assert s.get("resp_1", "team-a") is not None
    clock.now += 1
    assert s.get("resp_1", "team-a") is None
    assert kv.data == {}  # the expired read deleted the record and its index key


def test_the_sweep_deletes_expired_records_nobody_reads(clock):
    s, kv = store(clock, ttl_s=60)
    s.put(record("resp_old", created_at=clock.now))
    clock.now += 61
    s.put(record("resp_new", created_at=clock.now))  # a put past the sweep period sweeps
    assert RECORD + "resp_old" not in kv.data and not [k for k in kv.data if "resp_old" in k]
    assert s.get("resp_new", "team-a") is not None


def test_a_conversation_over_the_per_response_cap_is_refused(clock):
    s, _ = store(clock, max_response_bytes=4096)
    s.check_size(rp.conversation(None, request(input="x" * 3000)))
    with pytest.raises(rp.ResponseTooLarge) as e:
        s.check_size(rp.conversation(None, request(input="x" * 5000)))
    assert e.value.limit == 4096 and e.value.size > 5000 and "4096" in str(e.value)


def test_over_the_total_cap_the_oldest_records_go_first(clock):
    s, kv = store(clock, max_total_bytes=64 * 1024)
    ids = [f"resp_{i:03d}" for i in range(40)]
    for rid in ids:  # ~3.5 KiB each: 40 of them are over 64 KiB
        clock.now += SWEEP_PERIOD_S  # every put may sweep
        s.put(record(rid, created_at=clock.now, pad=2000))
    kept = [rid for rid in ids if s.get(rid, "team-a") is not None]
    sizes = sum(int(k.rsplit("/", 1)[1]) for k in kv.keys(INDEX))
    assert sizes <= 64 * 1024 and sum(len(v) for k, v in kv.data.items() if k.startswith(RECORD)) == sizes
    assert kept == ids[-len(kept) :] and 10 < len(kept) < 40  # the newest survive, in one block


def test_the_sweep_lists_the_index_at_most_every_period(clock):
    s, kv = store(clock)
    for i in range(5):
        s.put(record(f"resp_{i}", created_at=clock.now))
        clock.now += 1
    assert kv.lists == 1  # the first put swept; the next four within SWEEP_PERIOD_S did not
    clock.now += SWEEP_PERIOD_S
    s.put(record("resp_9", created_at=clock.now))
    assert kv.lists == 2


def test_settings_refuse_nonsense():
    for bad in ({"ttl_s": 0}, {"max_response_bytes": 10}, {"max_total_bytes": -1}, {"ttl": 5}):
        with pytest.raises(ValueError):
            rp.StoreSettings(**bad)


# ---- continuing a conversation -------------------------------------------------------------------


def test_a_continued_request_starts_from_the_stored_conversation_without_its_instructions(clock):
    first_req = request(input="My name is Ada.", instructions="Answer in French.")
    first = record("resp_1", req=first_req)
    second = request(input="What is my name?", previous_response_id="resp_1", instructions="Be brief.")
    items = rp.conversation(first, second)
    assert [(i["type"], i.get("role")) for i in items] == [
        ("message", "user"),
        ("reasoning", None),
        ("message", "assistant"),
        ("function_call", None),
        ("message", "user"),
    ]
    assert items[1:4] == first.response["output"]  # the earlier output items, ids and all
    assert len({i["id"] for i in items}) == len(items)
    messages = as_body(rp.to_chat_request(rp.continued(second, first)))["messages"]
    assert messages[0] == {"role": "system", "content": "Be brief."}  # this request's instructions only
    assert "Answer in French." not in str(messages)
    assert messages[1] == {"role": "user", "content": "My name is Ada."}
    assert messages[2]["role"] == "assistant" and messages[2]["tool_calls"][0]["function"]["name"] == "get_weather"
    assert messages[-1] == {"role": "user", "content": "What is my name?"}
    assert rp.continued(second, None) is second


def test_an_item_sent_again_with_a_continued_request_is_a_400():
    first = record("resp_1")
    echoed = first.response["output"][1]  # the assistant message, as the client read it
    again = request(input=[echoed, {"role": "user", "content": "And?"}], previous_response_id="resp_1")
    with pytest.raises(ProtocolError) as e:
        rp.continued(again, first)
    assert (e.value.status, e.value.param) == (400, "input[0]") and echoed["id"] in e.value.message
    fresh = request(input=[{"role": "user", "content": "And?", "id": "msg_new"}], previous_response_id="resp_1")
    assert [i.id for i in rp.continued(fresh, first).input][-1] == "msg_new"


def test_stored_input_items_keep_client_ids_and_parse_as_the_sdks_items():
    req = request(
        input=[
            {"type": "message", "role": "user", "content": "Weather?", "id": "msg_client"},
            {"type": "function_call", "call_id": "call_a", "name": "get_weather", "arguments": "{}"},
            {"type": "function_call_output", "call_id": "call_a", "output": "21 C"},
            {"type": "message", "role": "assistant", "content": "It is 21 C."},
            {"type": "reasoning", "summary": [], "content": [{"type": "reasoning_text", "text": "hm"}]},
            {"role": "developer", "content": "Be brief."},
        ]
    )
    items = rp.conversation(None, req)
    assert items[0]["id"] == "msg_client"
    assert [i["id"][: i["id"].index("_")] for i in items[1:]] == ["fc", "fco", "msg", "rs", "msg"]
    page = ResponseItemList.model_validate(rp.item_page(items, limit=100, order="asc"))
    assert [type(i).__name__ for i in page.data] == [
        "ResponseInputMessageItem",
        "ResponseFunctionToolCallItem",
        "ResponseFunctionToolCallOutputItem",
        "ResponseOutputMessage",
        "ResponseReasoningItem",
        "ResponseInputMessageItem",
    ]
    assert page.data[2].output == "21 C" and page.data[3].content[0].text == "It is 21 C."


def test_input_item_pages():
    items = [{"id": f"msg_{i}", "type": "message", "role": "user", "content": []} for i in range(5)]
    page = rp.item_page(items, limit=2)
    assert [i["id"] for i in page["data"]] == ["msg_4", "msg_3"]  # newest first, OpenAI's default
    assert (page["object"], page["first_id"], page["last_id"], page["has_more"]) == ("list", "msg_4", "msg_3", True)
    page = rp.item_page(items, limit=2, after="msg_3")
    assert [i["id"] for i in page["data"]] == ["msg_2", "msg_1"] and page["has_more"]
    page = rp.item_page(items, limit=2, after="msg_1")
    assert [i["id"] for i in page["data"]] == ["msg_0"] and not page["has_more"]
    page = rp.item_page(items, limit=10, order="asc", after="msg_2")
    assert [i["id"] for i in page["data"]] == ["msg_3", "msg_4"] and not page["has_more"]
    with pytest.raises(ProtocolError) as e:
        rp.item_page(items, after="msg_9")
    assert (e.value.status, e.value.param) == (400, "after")


def test_the_response_says_it_is_stored_and_what_it_continues():
    out = Response.model_validate(rp.response_object(request(previous_response_id="resp_0"), "resp_1", TURN))
    assert out.store is True and out.previous_response_id == "resp_0"
    assert Response.model_validate(rp.response_object(request(store=False), "resp_1", TURN)).store is False
