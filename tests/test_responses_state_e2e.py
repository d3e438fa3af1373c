"""Stored Responses end to end: the shared Ray cluster, two ingress replicas, SmolLM2, the openai SDK
as the client. A response made through one replica's direct address is retrieved, listed and
continued through the other's (the store is Ray's GCS key-value store); the continued turn's prompt
is exactly the earlier conversation plus its own input, without the earlier instructions; a
streamed response is stored by the time its client reads response.completed; another key finds
none of them (404, and previous_response_not_found); a deleted response is a 404 and the ones that
continued it still continue; a model unloaded meanwhile is loaded again to continue."""

import openai
import pytest
import requests
from ray import serve
from support.cluster import key_entry, serve_orchard, wait_for

pytestmark = pytest.mark.cluster  # starts or uses a Ray cluster: one worker runs these in turn (conftest.py)

SMOL = "smollm2-135m-instruct"
KEYS = {"ops": "sk-state-ops", "team-a": "sk-state-a", "team-b": "sk-state-b"}
MAX_RESPONSE_BYTES = 16 * 1024
GREEDY = {"temperature": 0, "max_output_tokens": 12}
FIRST = "My name is Ada and my cat is called Pixel."
SECOND = "What is my cat called?"


@pytest.fixture(scope="module")
def orchard(models_dir, shared_ray):
    args = {
        "models_dir": str(models_dir),
        "ingress_replicas": 2,
        "api_keys": [key_entry("ops", KEYS["ops"], "admin"), key_entry("team-a", KEYS["team-a"], models=[SMOL]), key_entry("team-b", KEYS["team-b"])],
        "policy": {"min_residency_s": 0, "residency_per_reload": 0},
        "responses_store": {"max_response_bytes": MAX_RESPONSE_BYTES},
    }
    proxy = serve_orchard(args)
    ops = {"authorization": f"Bearer {KEYS['ops']}"}
    # each replica's own server starts once it is ready: the list can lag the deploy
    direct = wait_for(lambda: u if len(set(u := _urls(proxy, ops))) == 2 else None, 60, "both replicas' direct-ingress addresses")
    yield {"proxy": proxy, "direct": direct, "ops": ops}
    serve.shutdown()


def _urls(proxy: str, ops: dict) -> list[str]:
    return [i["url"] for i in requests.get(proxy + "/v1/cluster", headers=ops, timeout=30).json()["ingress"]]


def client(base: str, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{base}/v1", api_key=KEYS[key], max_retries=0, timeout=180)


def test_two_turns_chained_across_replicas(orchard):
    one, two = (client(url, "team-a") for url in orchard["direct"])
    first = one.responses.create(model=SMOL, input=FIRST, instructions="You answer in one short sentence, always politely.", **GREEDY)
    assert first.store is True and first.previous_response_id is None and first.output_text
    second = two.responses.create(model=SMOL, input=SECOND, previous_response_id=first.id, **GREEDY)  # the other replica
    assert second.previous_response_id == first.id and second.store is True
    # the same conversation sent whole, without storing: the prompt is the same, token for token
    # (the first turn's instructions are not carried over, its answer is)
    whole = one.responses.create(
        model=SMOL,
        input=[{"role": "user", "content": FIRST}, {"role": "assistant", "content": first.output_text}, {"role": "user", "content": SECOND}],
        store=False,
        **GREEDY,
    )
    alone = one.responses.create(model=SMOL, input=SECOND, store=False, **GREEDY)
    assert second.usage.input_tokens == whole.usage.input_tokens > alone.usage.input_tokens + first.usage.output_tokens
    assert whole.store is False
    with pytest.raises(openai.NotFoundError):
        one.responses.retrieve(whole.id)

    # retrieved and listed through either replica
    for c in (one, two):
        got = c.responses.retrieve(first.id)
        assert (got.id, got.output_text, got.usage.input_tokens, got.instructions) == (
            first.id,
            first.output_text,
            first.usage.input_tokens,
            first.instructions,
        )
    items = two.responses.input_items.list(second.id, order="asc")
    assert [(i.type, i.role) for i in items.data] == [("message", "user"), ("message", "assistant"), ("message", "user")]
    assert items.data[1].id == first.output[0].id and items.data[1].content[0].text == first.output_text
    assert items.data[2].content[0].text == SECOND and not items.has_more
    assert (items.first_id, items.last_id) == (items.data[0].id, items.data[2].id)
    paged = [i.id for i in one.responses.input_items.list(second.id, limit=1)]  # the SDK follows `after` page by page
    assert paged == [i.id for i in reversed(items.data)]  # newest first by default

    # a third turn continues the second through the first replica
    third = one.responses.create(model=SMOL, input="And what is my name?", previous_response_id=second.id, **GREEDY)
    assert third.usage.input_tokens > second.usage.input_tokens + second.usage.output_tokens
    assert len(one.responses.input_items.list(third.id).data) == 5


def test_another_key_finds_nothing(orchard):
    mine, theirs = client(orchard["proxy"], "team-a"), client(orchard["proxy"], "team-b")
    first = mine.responses.create(model=SMOL, input=FIRST, **GREEDY)
    for call in (
        lambda: theirs.responses.retrieve(first.id),
        lambda: theirs.responses.input_items.list(first.id),
        lambda: theirs.responses.delete(first.id),
    ):
        with pytest.raises(openai.NotFoundError) as e:
            call()
        assert e.value.body["message"] == f"Response with id '{first.id}' not found."  # as for an id that never was
    with pytest.raises(openai.BadRequestError) as e:
        theirs.responses.create(model=SMOL, input=SECOND, previous_response_id=first.id, **GREEDY)
    assert (e.value.code, e.value.param) == ("previous_response_not_found", "previous_response_id")
    assert mine.responses.retrieve(first.id).id == first.id  # still there for its own key


def test_delete_then_404_and_what_continued_it_still_continues(orchard):
    c = client(orchard["proxy"], "team-a")
    first = c.responses.create(model=SMOL, input=FIRST, **GREEDY)
    second = c.responses.create(model=SMOL, input=SECOND, previous_response_id=first.id, **GREEDY)
    assert c.responses.delete(first.id) is None  # the SDK reads nothing back
    raw = requests.delete(f"{orchard['proxy']}/v1/responses/{first.id}", headers={"authorization": f"Bearer {KEYS['team-a']}"}, timeout=30)
    assert raw.status_code == 404 and raw.json()["error"]["message"] == f"Response with id '{first.id}' not found."
    for call in (lambda: c.responses.retrieve(first.id), lambda: c.responses.input_items.list(first.id)):
        with pytest.raises(openai.NotFoundError):
            call()
    with pytest.raises(openai.BadRequestError) as e:
        c.responses.create(model=SMOL, input=SECOND, previous_response_id=first.id, **GREEDY)
    assert e.value.code == "previous_response_not_found"
    third = c.responses.create(model=SMOL, input="And my name?", previous_response_id=second.id, **GREEDY)  # self-contained
    assert third.usage.input_tokens > second.usage.input_tokens


def test_a_streamed_response_is_stored_before_its_last_event(orchard):
    one, two = (client(url, "team-a") for url in orchard["direct"])
    stream = one.responses.create(model=SMOL, input=FIRST, stream=True, **GREEDY)
    done = None
    for event in stream:
        if event.type in ("response.completed", "response.incomplete"):
            done = event.response
            got = two.responses.retrieve(done.id)  # asked before the stream's end is read, through the other replica
            assert got.output_text == done.output_text and got.status == done.status
            break
    stream.close()
    assert done is not None and done.store is True
    second = two.responses.create(model=SMOL, input=SECOND, previous_response_id=done.id, stream=True, **GREEDY)
    final = [e for e in second if e.type in ("response.completed", "response.incomplete")][0].response
    assert final.previous_response_id == done.id and final.usage.input_tokens > done.usage.input_tokens + done.usage.output_tokens


def test_errors_in_openais_shape(orchard):
    c = client(orchard["proxy"], "team-a")
    with pytest.raises(openai.NotFoundError) as e:
        c.responses.retrieve("resp_nope")
    assert e.value.status_code == 404 and "Traceback" not in e.value.response.text
    with pytest.raises(openai.BadRequestError) as e:  # a conversation over max_response_bytes is refused before it runs
        c.responses.create(model=SMOL, input="word " * (MAX_RESPONSE_BYTES // 4), **GREEDY)
    assert (e.value.code, e.value.param) == ("response_too_large", "input") and "store: false" in e.value.message
    first = c.responses.create(model=SMOL, input=FIRST, **GREEDY)
    with pytest.raises(openai.BadRequestError) as e:
        c.responses.input_items.list(first.id, limit=101)
    assert e.value.param == "limit"
    with pytest.raises(openai.BadRequestError) as e:
        c.responses.input_items.list(first.id, after="msg_nope")
    assert e.value.param == "after"


def test_a_stored_response_continues_after_its_model_was_unloaded(orchard):
    c = client(orchard["proxy"], "team-a")
    first = c.responses.create(model=SMOL, input=FIRST, **GREEDY)
    r = requests.post(f"{orchard['proxy']}/v1/models/{SMOL}/unload", headers=orchard["ops"], timeout=60)
    assert r.status_code == 200, r.text
    model = requests.get(f"{orchard['proxy']}/v1/models/{SMOL}", headers=orchard["ops"], timeout=30).json()
    assert model["orchard"]["status"] != "loaded"
    second = c.responses.create(model=SMOL, input=SECOND, previous_response_id=first.id, **GREEDY)
    assert second.status in ("completed", "incomplete") and second.usage.input_tokens > first.usage.input_tokens
