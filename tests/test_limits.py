"""Per-key limits (router/residency/limits.py), driven with explicit times: rpm, tpm (reserved from
the prompt's estimate and max_tokens, corrected to what was used) and requests in flight trip with a
429 naming the limit and recover when the window moves on or a request ends; the x-ratelimit-*
headers say where a key stands."""

import json
from pathlib import Path

import pytest

from deployments.wire.failure import STATUS
from router.api.generate import prompt_estimate, reserve_tokens
from router.protocols import openai as oai
from router.residency.limits import Limiter, RateLimited, Tenant
from router.serving.token_estimate import AUDIO_BYTES_PER_S, AUDIO_TOKENS_PER_S, audio_tokens, estimate_tokens


def test_rpm_trips_with_retry_after_and_recovers_after_the_window():
    lim, key = Limiter(), Tenant(name="team-a", rpm=3)
    for i in range(3):
        lim.admit(key, f"t{i}", 0, now=100.0 + i)
        lim.finish(f"t{i}", 0, now=100.5 + i)
    with pytest.raises(RateLimited) as info:
        lim.admit(key, "t3", 0, now=110.0)
    e = info.value
    assert (e.limit, e.code, STATUS[e.code]) == ("rpm", "rate_limited", 429) and "rpm is 3" in e.message
    assert e.retry_after_s == pytest.approx(50.0)  # the oldest request leaves the window at 160
    assert lim.headers(key, 110.0)["x-ratelimit-remaining-requests"] == "0"
    lim.admit(key, "t4", 0, now=160.5)  # recovered
    assert lim.headers(key, 160.5)["x-ratelimit-remaining-requests"] == "0"  # 101, 102 and 160.5 in the window


def test_tpm_reserves_max_tokens_and_keeps_what_was_used():
    lim, key = Limiter(), Tenant(name="team-a", tpm=1000)
    lim.admit(key, "a", 600, now=0.0)
    with pytest.raises(RateLimited) as info:  # 600 held + 600 asked > 1000
        lim.admit(key, "b", 600, now=1.0)
    assert info.value.limit == "tpm"
    lim.finish("a", 150, now=2.0)  # it used 150 of its 600
    lim.admit(key, "b", 600, now=3.0)
    assert lim.headers(key, 3.0)["x-ratelimit-remaining-tokens"] == str(1000 - 150 - 600)
    lim.finish("b", None, now=4.0)  # usage unknown: the reservation counts
    assert lim.headers(key, 4.0)["x-ratelimit-remaining-tokens"] == str(1000 - 150 - 600)
    assert lim.headers(key, 64.5)["x-ratelimit-remaining-tokens"] == "1000"  # the window moved on


def test_concurrency_holds_until_a_request_ends_and_other_keys_are_not_counted():
    lim, key, other = Limiter(), Tenant(name="team-a", max_concurrent=2), Tenant(name="team-b", max_concurrent=1)
    lim.admit(key, "a", 0, now=0.0)
    lim.admit(key, "b", 0, now=0.0)
    with pytest.raises(RateLimited) as info:
        lim.admit(key, "c", 0, now=0.0)
    assert info.value.limit == "max_concurrent" and info.value.retry_after_s == 1.0
    lim.admit(other, "x", 0, now=0.0)  # a key of its own
    lim.finish("a", 0, now=1.0)
    lim.admit(key, "c", 0, now=1.0)
    lim.finish("unknown-ticket", 5, now=1.0)  # idempotent, and a stranger's end changes nothing
    assert lim.headers(key, 1.0)["x-ratelimit-remaining-concurrent"] == "0"


def test_a_key_without_limits_is_never_counted():
    lim, key = Limiter(), Tenant(name="free")
    for i in range(1000):
        lim.admit(key, f"t{i}", 10**6, now=0.0)
    assert lim.headers(key, 0.0) == {}


# ---- what a request reserves (issue 25 item 5) ------------------------------------------------------

SAMPLES = [
    "What is the weather in Paris? Tell me about the history of the city and its museums. " * 10,
    (Path(__file__).parent.parent / "router" / "api" / "sse.py").read_text(),
    "Grüße aus Köln, 東京 " * 10,
    "1234567890 " * 30,
    "Le café est très chaud à Zürich; 3,14159 € — naïve façade. " * 5,
]


def test_the_prompt_estimate_is_above_a_real_bpe_tokenizers_count_and_not_far_above_for_english(models_dir):
    from tokenizers import Tokenizer

    smollm2 = Tokenizer.from_file(str(models_dir / "smollm2-135m-instruct" / "tokenizer.json"))  # a real 49k-token BPE vocabulary
    counts = [(len(smollm2.encode(text).ids), estimate_tokens(text)) for text in SAMPLES]
    assert all(estimate >= real for real, estimate in counts), counts
    assert counts[0][1] <= 2 * counts[0][0], counts  # English: within 2x
    assert estimate_tokens("abc", "abcd") == 3 and estimate_tokens("") == 0


def test_a_long_prompt_counts_at_admission_though_its_max_tokens_alone_fits():
    lim, key = Limiter(), Tenant(name="team-a", tpm=1000)
    long_chat = oai.ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "word " * 900}], max_tokens=10)
    assert prompt_estimate(long_chat) == 1500 and reserve_tokens(long_chat) == 1510
    with pytest.raises(RateLimited) as info:
        lim.admit(key, "long", reserve_tokens(long_chat), now=0.0)
    assert info.value.limit == "tpm" and "asks for 1510" in info.value.message
    short = oai.ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "word " * 90}], max_tokens=10)
    lim.admit(key, "a", reserve_tokens(short), now=0.0)  # 150 + 10
    lim.admit(key, "b", reserve_tokens(short), now=0.0)
    lim.finish("a", 130, now=1.0)  # the model's usage (prompt + completion) replaces the estimate
    assert lim.headers(key, 1.0)["x-ratelimit-remaining-tokens"] == str(1000 - 130 - 160)


def test_every_text_of_a_prompt_is_estimated_and_a_token_id_prompt_is_counted():
    tool = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    bare = oai.ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "hi"}])
    with_tools = oai.ChatCompletionRequest(
        model="m",
        messages=[
            {"role": "system", "content": "be brief"},
            {"role": "user", "content": [{"type": "text", "text": "hi"}]},
            {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "call_1", "content": "21 C"},
        ],
        tools=[tool],
    )
    assert prompt_estimate(bare) == 1
    assert prompt_estimate(with_tools) > estimate_tokens(json.dumps(tool)) + estimate_tokens(json.dumps([call])) + 3
    assert prompt_estimate(oai.CompletionRequest(model="m", prompt=[5] * 700)) == 700
    assert reserve_tokens(oai.CompletionRequest(model="m", prompt="abcdef")) == 2 + oai.DEFAULT_MAX_TOKENS


def test_audio_counts_its_seconds():
    assert audio_tokens(1.01) == 11 and audio_tokens(0) == 0
    assert audio_tokens(AUDIO_BYTES_PER_S * 30 / AUDIO_BYTES_PER_S) == 30 * AUDIO_TOKENS_PER_S
