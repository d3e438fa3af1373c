"""The full API surface end to end: a real Ray cluster, real MLX models, the official `openai` and
`anthropic` SDKs as clients. Tool calls, JSON schemas and reasoning ride on random-weight models
whose output is steered by constrained decoding (forced-call grammars, JSON schemas) or by the
registry's reasoning markers, so every assertion is about what the router and engine guarantee,
not about what a random model happens to say."""

import base64
import io
import json
import re
import shutil
import subprocess
import time
import wave
from concurrent.futures import ThreadPoolExecutor

import jsonschema
import pytest
import requests

ray = pytest.importorskip("ray")
anthropic = pytest.importorskip("anthropic")
import openai  # noqa: E402
from ray import serve  # noqa: E402
from support.cluster import free_port  # noqa: E402
from support.schemas import random_schemas  # noqa: E402
from support.speech import REFERENCE, words  # noqa: E402

from router.api.builder import build_app  # noqa: E402
from router.residency.registry import from_manifest  # noqa: E402

pytestmark = pytest.mark.cluster  # starts or uses a Ray cluster: one worker runs these in turn (conftest.py)

MIB = 1024**2
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 12}, "unit": {"type": "string", "enum": ["c", "f"]}},
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}, "additionalProperties": False}}}
USER = [{"role": "user", "content": "What is the weather in Paris?"}]
COUNTED = "smollm2-135m-instruct"  # a real chat template; counted before this module's first generation loads it


@pytest.fixture(scope="module")
def orchard(models_dir, shared_ray):
    """The shared one-node cluster (room for every model); the Serve app with a few registry variants."""
    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    models = from_manifest(models_dir)
    models += [
        {"name": "llama-think", "kind": "llm", "path": "llama-10m", "reasoning": {"starts_inside": True}},
        # its own admission (the bare loop's: no hold, groups of 8) over the app's
        {
            "name": "llama-no-tools",
            "kind": "llm",
            "path": "llama-10m",
            "tool_parser": None,
            "llm_engine": {"admit_hold_steps": 0, "prefill_batch": 8},
        },
        {"name": "llama-mistral", "kind": "llm", "path": "llama-10m", "tool_parser": "mistral"},
        {"name": "minilm-rerank", "kind": "rerank", "path": "all-minilm-l6-v2"},
        {"name": "llava-short", "kind": "vlm", "path": "llava-tiny-random", "reserve_context_tokens": 256},
    ]
    policy = {"min_residency_s": 0, "residency_per_reload": 0, "instance_overhead_bytes": 32 * MIB}
    serve.run(
        build_app({"models_dir": str(models_dir), "models": models, "policy": policy, "max_audio_bytes": 2 * MIB}), name="orchard", route_prefix="/"
    )
    base = f"http://127.0.0.1:{port}"
    yield {
        "base": base,
        "openai": openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=180),
        "anthropic": anthropic.Anthropic(base_url=base, api_key="unused", max_retries=0, timeout=180),
    }
    serve.shutdown()


# ---- tools -------------------------------------------------------------------------------------


def _weather_args(arguments: str) -> dict:
    args = json.loads(arguments)
    jsonschema.validate(args, WEATHER["function"]["parameters"])
    return args


def test_forced_tool_call_round_trip(orchard):
    client = orchard["openai"]
    reply = client.chat.completions.create(
        model="llama-10m", messages=USER, tools=[WEATHER, TIME], tool_choice={"type": "function", "function": {"name": "get_weather"}}, max_tokens=120
    )
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.function.name == "get_weather" and re.fullmatch(r"call_[0-9a-f]{24}", call.id)
    _weather_args(call.function.arguments)
    # the result goes back; the model answers in text (tool_choice none: no call parsing)
    history = USER + [choice.message.model_dump(exclude_none=True), {"role": "tool", "tool_call_id": call.id, "content": '{"temp": 21}'}]
    answer = client.chat.completions.create(model="llama-10m", messages=history, tools=[WEATHER], tool_choice="none", max_tokens=8)
    assert answer.choices[0].finish_reason in ("stop", "length") and answer.choices[0].message.tool_calls is None
    assert answer.usage.prompt_tokens > reply.usage.prompt_tokens  # the call and its result are in the prompt
    assert "get_weather" not in (answer.choices[0].message.content or "") or answer.choices[0].message.tool_calls is None


def test_streamed_tool_call_deltas_and_final_chunk(orchard):
    stream = orchard["openai"].chat.completions.create(
        model="llama-10m", messages=USER, tools=[WEATHER], tool_choice="required", max_tokens=120, stream=True, stream_options={"include_usage": True}
    )
    chunks = list(stream)
    calls: dict[int, dict] = {}
    for c in chunks:
        for d in (c.choices[0].delta.tool_calls or []) if c.choices else []:
            call = calls.setdefault(d.index, {"id": d.id, "name": "", "arguments": ""})
            call["name"] += (d.function.name or "") if d.function else ""
            call["arguments"] += (d.function.arguments or "") if d.function else ""
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == ["tool_calls"]  # the parser never swallows the final chunk
    assert list(calls) == [0] and calls[0]["name"] == "get_weather" and calls[0]["id"].startswith("call_")
    _weather_args(calls[0]["arguments"])
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens > 0


def test_mistral_family_call(orchard):
    reply = orchard["openai"].chat.completions.create(model="llama-mistral", messages=USER, tools=[WEATHER], tool_choice="required", max_tokens=120)
    (call,) = reply.choices[0].message.tool_calls
    assert call.function.name == "get_weather"
    _weather_args(call.function.arguments)


def test_tools_to_a_model_without_a_parser_are_refused(orchard):
    with pytest.raises(openai.BadRequestError) as info:
        orchard["openai"].chat.completions.create(model="llama-no-tools", messages=USER, tools=[WEATHER], max_tokens=4)
    assert info.value.code == "tools_not_supported" and info.value.param == "tools"


# ---- structured output ---------------------------------------------------------------------------


def test_twenty_random_json_schemas_validate_through_the_cluster(orchard):
    client = orchard["openai"]
    schemas = random_schemas(20, seed=7)

    def ask(i_schema):
        i, schema = i_schema
        fmt = {"type": "json_schema", "json_schema": {"name": f"s{i}", "schema": schema, "strict": True}}
        if i % 4 == 0:  # some streamed
            chunks = client.chat.completions.create(
                model="llama-10m", messages=USER, response_format=fmt, max_tokens=400, temperature=1.0, stream=True
            )
            return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        return (
            client.chat.completions.create(model="llama-10m", messages=USER, response_format=fmt, max_tokens=400, temperature=1.0)
            .choices[0]
            .message.content
        )

    with ThreadPoolExecutor(10) as pool:
        outputs = list(pool.map(ask, enumerate(schemas)))
    for schema, text in zip(schemas, outputs, strict=True):
        jsonschema.validate(json.loads(text), schema)


def test_json_object_response_format(orchard):
    reply = orchard["openai"].chat.completions.create(
        model="llama-10m", messages=USER, response_format={"type": "json_object"}, max_tokens=200, temperature=1.0
    )
    if reply.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(reply.choices[0].message.content), dict)
    else:  # a random model may keep writing one object; what came out is still a JSON prefix
        assert reply.choices[0].message.content.startswith("{")


def test_a_generation_says_where_its_first_token_waited_in_server_timing(orchard):
    """W3C Server-Timing on streamed and whole answers: the app's part before the route, the lease,
    and the wait for the instance's first output, each a duration in ms that adds up to no more than
    the client's own wait for the headers."""
    for stream in (False, True):
        body = {"model": "llama-10m", "messages": USER, "max_tokens": 4, "temperature": 0, "stream": stream}
        started = time.monotonic()
        with requests.post(f"{orchard['base']}/v1/chat/completions", json=body, stream=stream, timeout=120) as r:
            waited_ms = 1000 * (time.monotonic() - started)
            assert r.status_code == 200, r.text
            parts = dict(part.strip().split(";dur=") for part in r.headers["Server-Timing"].split(","))
            r.content  # noqa: B018  (read to the end)
        assert sorted(parts) == ["app", "first-delta", "lease"], parts
        durations = {k: float(v) for k, v in parts.items()}
        assert all(d >= 0 for d in durations.values()) and durations["first-delta"] > 0
        assert sum(durations.values()) <= waited_ms + 1, (durations, waited_ms)


# ---- reasoning -----------------------------------------------------------------------------------


def test_reasoning_is_split_into_reasoning_content(orchard):
    """llama-think's markers open in the prompt (starts_inside): everything before </think> is
    reasoning, which a random model never closes."""
    reply = orchard["openai"].chat.completions.create(model="llama-think", messages=USER, max_tokens=12, temperature=0)
    message = reply.choices[0].message.model_dump()
    assert message["reasoning_content"] and not message["content"]
    chunks = list(orchard["openai"].chat.completions.create(model="llama-think", messages=USER, max_tokens=12, temperature=0, stream=True))
    streamed = "".join(c.choices[0].delta.model_dump().get("reasoning_content") or "" for c in chunks if c.choices)
    assert streamed == message["reasoning_content"]


def _counted_request(billing_hash: str) -> dict:
    """A Claude-Code-shaped request: its billing line (a hash per request), a system prompt, a tool,
    a past tool call and its result."""
    tool = {"name": "get_weather", "description": "Current weather", "input_schema": WEATHER["function"]["parameters"]}
    return {
        "model": COUNTED,
        "system": [
            {"type": "text", "text": f"x-anthropic-billing-header: cc_version=2.1.40.{billing_hash}; cc_entrypoint=sdk-cli;"},
            {"type": "text", "text": "You answer questions about the weather."},
        ],
        "tools": [tool],
        "messages": [
            {"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris", "unit": "c"}}]},
            {
                "role": "user",
                "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "18 C, clear"}, {"type": "text", "text": "And now?"}],
            },
        ],
    }


def test_count_tokens_loads_nothing_and_equals_the_generations_prompt_tokens(orchard):
    """A model no instance of which is loaded is counted from its folder's tokenizer (a node agent)
    and nothing is placed or loaded; the count is the prompt a generation of the same request feeds
    (tools, system, a past tool call, the billing line left out), and the loaded model's engine,
    which counts once it is ready, says the same. Bad input is Anthropic's error."""
    base, client = orchard["base"], orchard["anthropic"]
    requests.post(base + f"/v1/models/{COUNTED}/unload", timeout=60)  # not loaded by an earlier test in any order
    since = max((e["seq"] for e in requests.get(base + "/v1/cluster/events", timeout=30).json()["data"]), default=0)
    counted = client.messages.count_tokens(**_counted_request("a1b2c"))
    assert counted.input_tokens > 100
    assert client.messages.count_tokens(**_counted_request("f9e8d")).input_tokens == counted.input_tokens  # the hash changes nothing
    instances = [i["model"] for n in requests.get(base + "/v1/cluster", timeout=30).json()["nodes"] for i in n["instances"]]
    assert COUNTED not in instances
    events = requests.get(base + f"/v1/cluster/events?since={since}", timeout=30).json()["data"]
    assert not [e for e in events if e["kind"] in ("placed", "loading", "loaded", "evicted", "waiting", "fetching")], events

    message = client.messages.create(max_tokens=1, **_counted_request("0c0c0"))
    usage = message.usage
    assert usage.input_tokens + (usage.cache_read_input_tokens or 0) + (usage.cache_creation_input_tokens or 0) == counted.input_tokens
    assert client.messages.count_tokens(**_counted_request("77777")).input_tokens == counted.input_tokens  # now by its engine

    malformed = requests.post(base + "/v1/messages/count_tokens", json={"model": COUNTED, "messages": "hi"}, timeout=30)
    assert malformed.status_code == 400 and malformed.json()["error"]["type"] == "invalid_request_error"
    with pytest.raises(anthropic.BadRequestError) as info:
        client.messages.count_tokens(model=COUNTED, messages=[])
    assert info.value.body["type"] == "error" and info.value.body["error"]["type"] == "invalid_request_error"
    with pytest.raises(anthropic.BadRequestError) as info:  # an embedding model has no prompt to count
        client.messages.count_tokens(model="all-minilm-l6-v2", messages=[{"role": "user", "content": "hi"}])
    assert info.value.body["error"]["type"] == "invalid_request_error" and "all-minilm-l6-v2" in info.value.body["error"]["message"]
    with pytest.raises(anthropic.NotFoundError) as info:
        client.messages.count_tokens(model="no-such-model", messages=[{"role": "user", "content": "hi"}])
    assert info.value.body["error"]["type"] == "not_found_error"


# ---- Anthropic Messages --------------------------------------------------------------------------


def test_anthropic_messages_plain_and_streamed(orchard):
    client = orchard["anthropic"]
    msg = client.messages.create(
        model="smollm2-135m-instruct",
        max_tokens=16,
        system="You answer in one short sentence.",
        messages=[{"role": "user", "content": "What is the capital of France?"}],
        extra_body={"temperature": 0},
    )
    assert msg.type == "message" and msg.role == "assistant" and msg.stop_reason in ("end_turn", "max_tokens")
    assert "Paris" in msg.content[0].text and msg.usage.input_tokens > 0 and msg.usage.output_tokens > 0
    with client.messages.stream(
        model="smollm2-135m-instruct",
        max_tokens=16,
        system="You answer in one short sentence.",
        messages=[{"role": "user", "content": "What is the capital of France?"}],
        extra_body={"temperature": 0},
    ) as stream:
        kinds = [e.type for e in stream]
        final = stream.get_final_message()
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop" and "content_block_delta" in kinds
    assert final.content[0].text == msg.content[0].text


def test_anthropic_tool_use_round_trip(orchard):
    client = orchard["anthropic"]
    tool = {"name": "get_weather", "description": "weather", "input_schema": WEATHER["function"]["parameters"]}
    msg = client.messages.create(
        model="llama-10m",
        max_tokens=120,
        tools=[tool],
        tool_choice={"type": "tool", "name": "get_weather"},
        messages=[{"role": "user", "content": "Weather in Paris?"}],
    )
    assert msg.stop_reason == "tool_use"
    (use,) = [b for b in msg.content if b.type == "tool_use"]
    jsonschema.validate(use.input, tool["input_schema"])
    follow = client.messages.create(
        model="llama-10m",
        max_tokens=8,
        tools=[tool],
        messages=[
            {"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "content": [b.model_dump() for b in msg.content]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "21 C"}]},
        ],
    )
    assert follow.stop_reason in ("end_turn", "max_tokens", "tool_use")
    with client.messages.stream(
        model="llama-10m", max_tokens=120, tools=[tool], tool_choice={"type": "any"}, messages=[{"role": "user", "content": "Weather?"}]
    ) as stream:
        final = stream.get_final_message()
    assert final.stop_reason == "tool_use" and final.content[-1].type == "tool_use"
    jsonschema.validate(final.content[-1].input, tool["input_schema"])


def test_anthropic_thinking_blocks(orchard):
    msg = orchard["anthropic"].messages.create(model="llama-think", max_tokens=10, messages=[{"role": "user", "content": "hi"}])
    assert msg.content[0].type == "thinking" and msg.content[0].thinking


def test_anthropic_count_tokens_and_errors(orchard):
    client = orchard["anthropic"]
    short = client.messages.count_tokens(model="llama-10m", messages=[{"role": "user", "content": "hi"}])
    longer = client.messages.count_tokens(model="llama-10m", messages=[{"role": "user", "content": "hi " * 50}], system="Be brief.")
    assert 0 < short.input_tokens < longer.input_tokens
    with pytest.raises(anthropic.NotFoundError) as info:
        client.messages.create(model="no-such-model", max_tokens=4, messages=[{"role": "user", "content": "hi"}])
    assert info.value.body["error"]["type"] == "not_found_error"
    with pytest.raises(anthropic.BadRequestError) as info:
        client.messages.create(model="llama-10m", max_tokens=4, messages=[])
    assert info.value.body["type"] == "error" and info.value.body["error"]["type"] == "invalid_request_error"


# ---- Responses -----------------------------------------------------------------------------------


def test_responses_text_stream_and_function_call(orchard):
    client = orchard["openai"]
    r = client.responses.create(
        model="smollm2-135m-instruct",
        input="What is the capital of France?",
        instructions="You answer in one short sentence.",
        max_output_tokens=16,
        temperature=0,
    )
    assert r.status in ("completed", "incomplete") and "Paris" in r.output_text
    with client.responses.stream(
        model="smollm2-135m-instruct",
        input="What is the capital of France?",
        instructions="You answer in one short sentence.",
        max_output_tokens=16,
        temperature=0,
    ) as stream:
        kinds = [e.type for e in stream]
    assert kinds[0] == "response.created" and "response.output_text.delta" in kinds
    tool = {"type": "function", "name": "get_weather", "parameters": WEATHER["function"]["parameters"], "strict": True}
    r = client.responses.create(model="llama-10m", input="Weather in Paris?", tools=[tool], tool_choice="required", max_output_tokens=120)
    (call,) = [o for o in r.output if o.type == "function_call"]
    assert call.name == "get_weather"
    _weather_args(call.arguments)


# ---- vision --------------------------------------------------------------------------------------


def _png_data_url() -> str:
    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (32, 32), (200, 30, 30)).save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def test_image_parts_reach_the_vision_model_and_are_refused_elsewhere(orchard):
    client = orchard["openai"]
    content = [{"type": "text", "text": "What colour is this?"}, {"type": "image_url", "image_url": {"url": _png_data_url()}}]
    reply = client.chat.completions.create(model="llava-tiny-random", messages=[{"role": "user", "content": content}], max_tokens=6, temperature=0)
    assert reply.choices[0].finish_reason in ("stop", "length") and reply.usage.prompt_tokens > 0
    remote = [{"type": "text", "text": "?"}, {"type": "image_url", "image_url": {"url": "https://example.com/cat.png"}}]
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model="llava-tiny-random", messages=[{"role": "user", "content": remote}], max_tokens=4)
    assert info.value.code == "invalid_image_url" and info.value.param == "messages[0].content[1].image_url.url"
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model="llama-10m", messages=[{"role": "user", "content": content}], max_tokens=4)
    assert "image" in info.value.message


def test_a_vision_model_is_held_to_its_measured_reservation(orchard):
    """A VLM's engine measures what it holds at its load and is held to it (as an LLM's): /v1/cluster
    shows the measured figures beside the folder's estimate, and a prompt past its reserved
    context (256 tokens here) is refused with a 400 that names the instance's memory limit."""
    client = orchard["openai"]
    image = {"type": "image_url", "image_url": {"url": _png_data_url()}}
    reply = client.chat.completions.create(
        model="llava-short", messages=[{"role": "user", "content": [image, {"type": "text", "text": "Hi"}]}], max_tokens=4
    )
    assert reply.usage.prompt_tokens > 64  # the image's 64 tokens and the text
    (instance,) = [
        i for n in requests.get(orchard["base"] + "/v1/cluster", timeout=30).json()["nodes"] for i in n["instances"] if i["model"] == "llava-short"
    ]
    measured = instance["memory"]["measured"]
    assert measured["kv_reserved_bytes"] > 0 and measured["activation_bytes"] > 0 and measured["limit_bytes"] > measured["weight_bytes"] > 0
    assert instance["memory"]["estimated"]["weight_bytes"] > 0
    long_text = {"type": "text", "text": "Describe" + " tree" * 200}
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model="llava-short", messages=[{"role": "user", "content": [image, long_text]}], max_tokens=4)
    assert info.value.code == "context_length_exceeded" and "memory limit of" in info.value.message, info.value.message


# ---- audio ---------------------------------------------------------------------------------------


@pytest.mark.skipif(shutil.which("espeak-ng") is None, reason="espeak-ng is not on PATH")
def test_transcription_of_espeak_speech(orchard, tmp_path):
    wav = tmp_path / "speech.wav"
    subprocess.run(["espeak-ng", "-s", "120", "-w", str(wav), REFERENCE], check=True, capture_output=True)
    client = orchard["openai"]  # json, text and verbose_json bodies are the engine test's: here the route carries two
    with wav.open("rb") as f:
        verbose = client.audio.transcriptions.create(model="whisper-tiny-en", file=f, response_format="verbose_json")
    said = words(REFERENCE)
    heard = set(words(verbose.text))
    assert sum(w in heard for w in said) >= 0.6 * len(said), verbose.text  # the engine test scores 11 of 13
    assert verbose.duration > 1 and verbose.segments
    with wav.open("rb") as f:
        text = client.audio.transcriptions.create(model="whisper-tiny-en", file=f, response_format="text")
    assert isinstance(text, str) and "fox" in text.lower()
    big = io.BytesIO(b"RIFF" + b"\0" * (3 * MIB))
    with pytest.raises(openai.APIStatusError) as info:
        client.audio.transcriptions.create(model="whisper-tiny-en", file=("big.wav", big))
    assert info.value.status_code == 413


def test_speech_returns_wav(orchard):
    audio = orchard["openai"].audio.speech.create(model="soprano-tiny-random", input="Hello from Orchard.", voice="alloy")
    with wave.open(io.BytesIO(audio.content)) as w:
        assert w.getnframes() > 0 and w.getnchannels() == 1
    with pytest.raises(openai.BadRequestError):
        orchard["openai"].audio.speech.create(model="llama-10m", input="hi", voice="alloy")


# ---- rerank --------------------------------------------------------------------------------------


def test_rerank_orders_relevant_documents_first(orchard):
    docs = [
        "The Eiffel Tower is in Paris.",
        "Bananas are rich in potassium.",
        {"text": "Paris is the capital and largest city of France."},
        "Photosynthesis happens in chloroplasts.",
    ]
    body = {"model": "minilm-rerank", "query": "What is the capital of France?", "documents": docs, "top_n": 2, "return_documents": True}
    r = requests.post(orchard["base"] + "/v1/rerank", json=body, timeout=120)
    assert r.status_code == 200, r.text
    results = r.json()["results"]
    assert [x["index"] for x in results] == [2, 0] and results[0]["relevance_score"] >= results[1]["relevance_score"]
    assert results[0]["document"]["text"].startswith("Paris is the capital")
    bad = requests.post(orchard["base"] + "/v1/rerank", json=body | {"model": "llama-10m"}, timeout=60)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "model"


# ---- per-model scheduling ----------------------------------------------------------------------


def test_a_registry_entrys_llm_engine_reaches_its_instances_engine_over_the_apps(orchard):
    from cluster.model_servers import find_model_servers
    from deployments.engines.options import LLMEngineOptions

    for model in ("llama-no-tools", "llama-10m"):
        orchard["openai"].chat.completions.create(model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=2)
    running = {}
    for _, handle in find_model_servers():  # a model loaded into a spare (rule R1) has the spare's name: ask each
        health = ray.get(handle.health.remote())
        if health.model in ("llama-no-tools", "llama-10m"):
            running[health.model] = dict(health.scheduling)
    for scheduling in running.values():  # the prefix disk tier beside the node's store, as the residency service says
        assert str(scheduling.pop("prefix_disk_dir")).endswith("/.prefixes")
    defaults = LLMEngineOptions().model_dump()
    defaults.pop("prefix_disk_dir")
    assert running["llama-10m"] == defaults  # the app's (ray-config's defaults)
    assert running["llama-no-tools"] == defaults | {"admit_hold_steps": 0, "prefill_batch": 8}  # its own, the rest the app's
