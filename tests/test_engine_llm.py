"""The LLM engine on real MLX weights: continuous batching is exact, cancellation frees KV at once,
stop strings never leak, unicode streams correctly, and bad requests fail alone."""

import asyncio
import time

import pytest
from pydantic import ValidationError
from support.engine_runs import greedy, join_and_leave

from deployments.engine import RequestError
from deployments.engines.llm import LLMEngine
from deployments.wire.generation import GenerationRequest

PROMPTS = [
    "The number one is",
    "Once upon a time, in a land far away, there lived a",
    "def fibonacci(n):",
    "Paris",
    "A quick brown fox jumps over the lazy dog and then",
    "import numpy as np\nx =",
    "Question: what is two plus two? Answer:",
    "Hello",
]


def run(coro):
    return asyncio.run(coro)


@pytest.fixture(scope="module")
def engine(models_dir):
    e = LLMEngine("llama-10m", str(models_dir / "llama-10m"), max_batch=16)
    run(e.load())
    yield e
    run(e.stop())


def test_concurrent_requests_give_the_tokens_of_solo_runs(engine):
    async def both():
        together = await asyncio.gather(*(engine.complete(greedy(p)) for p in PROMPTS))
        alone = [await engine.complete(greedy(p)) for p in PROMPTS]
        return together, alone

    together, alone = run(both())
    assert [d.token_ids for d in together] == [d.token_ids for d in alone]
    assert all(d.finish_reason == "length" and d.usage.completion_tokens == 24 for d in together)


def test_requests_joining_and_leaving_mid_batch(engine):
    solo, results = run(join_and_leave(engine, PROMPTS, first=4, tokens=40))
    assert results == [solo[p] for p in PROMPTS]
    assert engine.running_requests() == 0


def test_cancel_frees_the_kv_cache_at_once(engine):
    async def scenario():
        stream = engine.generate(greedy("Keep talking about the weather", 400))
        async for delta in stream:
            if len(delta.token_ids) and engine.memory().kv_bytes_in_use > 0:
                break
        during = engine.memory().kv_bytes_in_use
        await stream.aclose()
        for _ in range(100):
            if engine.running_requests() == 0:
                break
            await asyncio.sleep(0.01)
        return during, engine.memory().kv_bytes_in_use

    during, after = run(scenario())
    assert during > 0 and after == 0


def test_stop_strings_cut_exactly_and_never_leak(engine):
    full = run(engine.complete(greedy(PROMPTS[1], 40))).text
    stop = full[12:16]
    assert stop and stop in full

    async def streamed():
        return [d async for d in engine.generate(greedy(PROMPTS[1], 40, stop=[stop]))]

    deltas = run(streamed())
    text = "".join(d.text for d in deltas)
    assert text == full[: full.find(stop)]
    assert deltas[-1].finish_reason == "stop" and deltas[-1].stop_sequence == stop
    assert all(stop not in d.text for d in deltas)

    # of several stop strings, the one found first in the text ended it, whatever the list order
    later = full[20:24]
    assert later not in full[:20]
    both = run(engine.complete(greedy(PROMPTS[1], 40, stop=[later, stop])))
    assert both.text == full[: full.find(stop)] and both.stop_sequence == stop


def test_unicode_streams_whole_characters(engine):
    """Random weights emit byte-level tokens that split UTF-8 characters: the streamed text must
    still equal the decoding of all tokens, whatever the split."""

    async def sample(seed):
        deltas = [d async for d in engine.generate(GenerationRequest(prompt="日本語 😀 café", max_tokens=48, temperature=1.0, seed=seed))]
        return "".join(d.text for d in deltas), [t for d in deltas for t in d.token_ids]

    for seed in range(4):
        text, tokens = run(sample(seed))
        assert text == engine.tokenizer.decode(tokens)


def test_a_completion_keeps_its_leading_space(engine):
    """A byte-level BPE model's first generated token may start with a space (" the"): the text keeps
    it, as the tokenizer's decode does ("The capital of France is" + " Paris"); mlx-lm's streaming
    detokenizer alone drops it."""
    (the,) = engine.tokenizer.encode(" the", add_special_tokens=False)
    d = run(engine.complete(greedy("Hello", 3, logit_bias={the: 100.0})))
    assert d.token_ids == [the] * 3
    assert d.text == " the the the" == engine.tokenizer.decode(d.token_ids)


def test_seed_reproduces_even_inside_a_batch(engine):
    request = GenerationRequest(prompt="Once upon", max_tokens=20, temperature=1.0, seed=7)

    async def scenario():
        alone = await engine.complete(request)
        batch = await asyncio.gather(
            engine.complete(request),
            *(engine.complete(greedy(p)) for p in PROMPTS[:4]),
            *(engine.complete(GenerationRequest(prompt=p, max_tokens=20, temperature=0.8, top_p=0.9)) for p in PROMPTS[4:]),
        )
        other = await engine.complete(request.model_copy(update={"seed": 8}))
        return alone, batch[0], other

    alone, batched, other = run(scenario())
    assert alone.token_ids == batched.token_ids
    assert other.token_ids != alone.token_ids


def test_any_int_seed_samples(engine):
    """OpenAI seeds may be negative or past 64 bits: each is a seed (modulo 2**64), not a 500."""

    def sample(seed):
        return run(engine.complete(GenerationRequest(prompt="Once upon", max_tokens=8, temperature=1.0, seed=seed))).token_ids

    assert sample(-1) == sample(-1) == sample(2**64 - 1)
    assert sample(2**64 + 7) == sample(7)


def test_a_top_k_past_the_vocabulary_keeps_every_token_and_spoils_nothing(engine):
    """top_k >= the vocabulary is no top-k. mlx-lm's apply_top_k raised there inside an mx.compile
    trace: the whole batch failed, and the trace's placeholder stayed in the MLX thread's RNG, so every
    later unseeded sampled request failed with "[eval] Attempting to eval an array without a
    primitive" (a fuzzed POST /v1/completions {"prompt": "0"} was a 500 that way)."""
    vocab = engine.model.args.vocab_size

    def request(**kw):
        return GenerationRequest(**{"prompt": "0", "max_tokens": 6, "temperature": 1.0} | kw)

    async def scenario():
        wide = await asyncio.gather(
            engine.complete(request(top_k=vocab)),
            engine.complete(request(top_k=vocab + 100, seed=3)),
            engine.complete(greedy(PROMPTS[0], 6)),
        )
        return wide, await engine.complete(request(seed=3)), await engine.complete(request(max_tokens=32))

    wide, no_top_k, after = run(scenario())  # complete() raises on an error delta
    assert all(d.finish_reason in ("length", "stop") for d in (*wide, after))
    assert wide[1].token_ids == no_top_k.token_ids


def test_a_broken_sampling_step_leaves_the_rng_sound(engine, monkeypatch):
    """A sampling step that raises while mx.compile traces it (as mlx-lm's apply_top_k did for top_k
    >= the vocabulary) leaves the trace's placeholder in the MLX thread's mx.random.state: the engine
    reseeds after a broken step, so only that step's requests fail, not every later sampled one."""
    from mlx_lm.sample_utils import apply_top_k

    import deployments.engines.sampling as sampling

    sampled = GenerationRequest(prompt="0", max_tokens=4, temperature=1.0)
    with monkeypatch.context() as patch:
        patch.setattr(sampling, "sample", lambda logprobs, rows: apply_top_k(logprobs, logprobs.shape[-1]))
        with pytest.raises(RequestError, match="top_k"):
            run(engine.complete(sampled))
    for request in (sampled, sampled.model_copy(update={"top_p": 0.9, "min_p": 0.05})):
        assert run(engine.complete(request)).finish_reason in ("length", "stop")  # not an error
    assert len(engine.sampling) == 0  # the broken batch's rows are forgotten


def test_a_batch_of_mixed_sampling_settings_is_sampled_in_one_call_per_step(engine):
    """mlx-lm samples a batch in one call only when its rows hold one sampler object, and row by row
    otherwise (issue 11: 64 rows, 64 calls a step). Every row holds the engine's one BatchSampler, so
    greedy, sampled, filtered and seeded requests side by side cost one call per batch stepped (the
    running batch, plus each group as it joins) and each row keeps its own settings."""
    settings = [
        {"temperature": 0},
        {"temperature": 0.7, "top_p": 0.9},
        {"temperature": 1.0, "top_k": 1},  # top_k 1 is greedy: its tokens are the greedy ones
        {"temperature": 1.2, "min_p": 0.1},
        {"temperature": 1.0, "seed": 5},
        {"temperature": 0.9, "top_p": 0.5, "top_k": 3, "seed": 6},
        {"temperature": 1.0},
        {"temperature": 0},
    ]
    before = engine.counters()

    async def batch():
        return await asyncio.gather(
            *(engine.complete(GenerationRequest(prompt=p, max_tokens=16, **s)) for p, s in zip(PROMPTS, settings, strict=True))
        )

    done = run(batch())
    after = engine.counters()
    assert all(d.finish_reason in ("length", "stop") for d in done)  # random weights may sample EOS
    calls = after["sampling_calls"] - before["sampling_calls"]
    steps = after["generation_steps"] - before["generation_steps"]
    groups = after["admitted_groups"] - before["admitted_groups"]
    assert calls <= steps + groups  # row by row would be ~8 calls a step
    tokens = sum(d.usage.completion_tokens for d in done)
    assert after["sampled_rows"] - before["sampled_rows"] >= tokens >= 8 * 4  # every row of every step, in those calls
    assert len(engine.sampling) == 0  # finished rows leave the table
    greedy = run(engine.complete(greedy_request := GenerationRequest(prompt=PROMPTS[2], max_tokens=16, temperature=0)))
    assert done[2].token_ids == greedy.token_ids, greedy_request
    assert done[0].token_ids == run(engine.complete(GenerationRequest(prompt=PROMPTS[0], max_tokens=16, temperature=0))).token_ids
    assert done[4].token_ids == run(engine.complete(GenerationRequest(prompt=PROMPTS[4], max_tokens=16, **settings[4]))).token_ids


def test_max_tokens_usage_and_logprobs(engine):
    d = run(engine.complete(greedy("Hello there", 7, logprobs=True, top_logprobs=3)))
    prompt_tokens = len(engine.tokenizer.encode("Hello there", add_special_tokens=False))
    assert d.finish_reason == "length" and d.stop_sequence is None
    assert (d.usage.prompt_tokens, d.usage.completion_tokens) == (prompt_tokens, 7)
    assert len(d.logprobs) == 7 and [lp.token_id for lp in d.logprobs] == d.token_ids
    for lp in d.logprobs:
        assert len(lp.top) == 3 and lp.logprob <= 0
        assert lp.top[0][0] == lp.token_id and lp.top[0][2] == pytest.approx(lp.logprob, abs=1e-5)  # greedy picks the top


def test_a_repeated_prompt_reuses_its_cached_prefix(engine):
    prompt = " ".join(PROMPTS) * 3
    first = run(engine.complete(greedy(prompt, 8)))
    second = run(engine.complete(greedy(prompt, 8)))
    assert first.usage.cached_tokens == 0 or first.usage.cached_tokens < first.usage.prompt_tokens
    assert second.usage.cached_tokens >= second.usage.prompt_tokens - 1
    assert second.token_ids == first.token_ids


def test_max_tokens_past_the_context_generates_up_to_it_and_stops_with_length(engine):
    # docs/protocols.md: a max_tokens larger than the room the prompt leaves is clamped, not refused
    prompt = [1 + i % 50 for i in range(engine.context_length - 6)]
    no_eos = dict.fromkeys(engine.eos_ids, -100.0)
    d = run(engine.complete(GenerationRequest(prompt_tokens=prompt, max_tokens=engine.context_length, temperature=0, logit_bias=no_eos)))
    assert (d.finish_reason, d.usage.prompt_tokens, d.usage.completion_tokens) == ("length", engine.context_length - 6, 6)


def test_bad_requests_fail_alone_and_the_engine_goes_on(engine):
    async def scenario():
        good = asyncio.create_task(engine.complete(greedy(PROMPTS[0], 30)))
        errors = []
        for bad in (
            GenerationRequest(prompt="", max_tokens=4),
            GenerationRequest(prompt_tokens=[1] * engine.context_length, max_tokens=1),
            GenerationRequest(prompt_tokens=[1, 2, 10**9], max_tokens=4),
            GenerationRequest(messages=[], max_tokens=4),
        ):
            with pytest.raises(RequestError) as info:
                await engine.complete(bad)
            errors.append(info.value.code)
        return errors, await good, await engine.complete(greedy(PROMPTS[0], 30))

    errors, during, after = run(scenario())
    assert errors == ["invalid_request", "context_length_exceeded", "invalid_request", "invalid_request"]
    assert during.token_ids == after.token_ids and len(after.token_ids) == 30
    assert engine.health().status == "ready"
    with pytest.raises(ValidationError):
        GenerationRequest(prompt="x", temperature=5)
    with pytest.raises(ValidationError):
        GenerationRequest(prompt="x", messages=[{"role": "user", "content": "y"}])


def test_memory_report_counts_weights_and_reserves_kv(engine):
    m = engine.memory()
    assert m.weight_bytes == sum(p.stat().st_size for p in __import__("pathlib").Path(engine.path).glob("*.safetensors"))
    assert m.kv_bytes_reserved == 16 * 1024 * 4096  # 16 KiB per token x the default 4096-token reservation
    assert m.active_bytes >= m.weight_bytes and m.load_seconds > 0


def test_counters_count_the_batched_steps(engine):
    """mlx-lm's generator counters, as the engine reports them: two requests decoding together
    make fewer steps than tokens (rows share a step), and the counters only grow."""

    async def two():  # prompts of their own: a cached prefix would skip prompt processing
        return await asyncio.gather(*(engine.complete(greedy(f"Counters, case {i}: one two three", 16)) for i in range(2)))

    before = engine.counters()
    run(two())
    after = engine.counters()
    tokens = after["generation_tokens"] - before["generation_tokens"]
    steps = after["generation_steps"] - before["generation_steps"]
    assert tokens >= 2 * 15 and 0 < steps < tokens
    assert after["prompt_tokens"] > before["prompt_tokens"] and after["decode_time"] > before["decode_time"]


def test_smollm2_knows_the_capital_of_france(models_dir):
    async def scenario():
        e = LLMEngine("smollm2", str(models_dir / "smollm2-135m-instruct"))
        await e.load()
        try:
            request = GenerationRequest(messages=[{"role": "user", "content": "What is the capital of France?"}], max_tokens=24, temperature=0)
            return await e.complete(request)
        finally:
            await e.stop()

    answer = run(scenario())
    assert "Paris" in answer.text


# ---- admission: arrivals prepared off the MLX thread, joining the batch in groups (issue 11) ----


def test_the_served_scheduling_defaults_are_the_engines_own():
    """ray-config's llm_engine options and a bare LLMEngine schedule alike (one set of defaults)."""
    import inspect

    from deployments.engines.options import LLMEngineOptions

    params = inspect.signature(LLMEngine.__init__).parameters
    for name, field in LLMEngineOptions.model_fields.items():
        assert params[name].default == field.default, name


def test_templating_and_tokenizing_run_off_the_mlx_thread(models_dir, monkeypatch):
    import threading

    seen: list[str] = []
    real = LLMEngine._tokenize

    def recording(self, request):
        seen.append(threading.current_thread().name)
        return real(self, request)

    monkeypatch.setattr(LLMEngine, "_tokenize", recording)

    async def scenario():
        e = LLMEngine("llama-10m", str(models_dir / "llama-10m"), max_batch=4)
        await e.load()
        try:
            chat = GenerationRequest(messages=[{"role": "user", "content": "Hi"}], max_tokens=3, temperature=0)
            await asyncio.gather(e.complete(chat), e.complete(greedy("Hello", 3)))
            return len(await asyncio.to_thread(e.tokenize, chat))
        finally:
            await e.stop()

    assert run(scenario()) > 0
    assert len(seen) == 3 and all(name.startswith("prep-llama-10m") for name in seen), seen


def test_arrivals_while_the_batch_decodes_are_held_and_join_as_one_group(models_dir):
    """While a batch decodes, arrivals wait (up to admit_hold_steps, here longer than the test)
    until a prefill group is full, then all join in one step; a held request can be cancelled, and
    one still held when the engine stops ends with engine_stopped. Held requests count as running."""

    async def first_delta(stream):
        return await anext(stream)

    async def scenario():
        e = LLMEngine(
            "llama-10m", str(models_dir / "llama-10m"), max_batch=8, prefill_batch=3, admit_hold_steps=100_000, admit_quiet_steps=100_000,
            reserve_concurrency=8,  # KV for the busy one's 3,000 tokens beside the others (M4: the batch is as long as its longest row)
        )  # fmt: skip
        await e.load()
        busy = e.generate(greedy("A long one keeps the batch busy", 3000))
        await first_delta(busy)
        busy_from = e._steps
        b, c = e.generate(greedy("Second", 8)), e.generate(greedy("Third", 8))
        waiting = [asyncio.create_task(first_delta(s)) for s in (b, c)]
        await asyncio.sleep(0.5)
        held_early = [t.done() for t in waiting]
        running_while_held = e.running_requests()
        before = e.counters()
        d = e.generate(greedy("Fourth fills the group", 8))
        firsts = await asyncio.gather(*waiting, first_delta(d))
        after = e.counters()
        # counted by the engine, not by when this coroutine ran again (under load, that lags the
        # MLX thread by a varying number of steps): the groups and requests admitted, the steps from
        # joining to the first tokens, and whether the busy one was still decoding then
        joined = (after["admitted_groups"] - before["admitted_groups"], after["admitted_requests"] - before["admitted_requests"])
        join_steps = after["join_steps"] - before["join_steps"]
        busy_decoding = e._steps - busy_from < 3000
        # a held one that is cancelled: its client went away before it joined
        gone = e.generate(greedy("Gone before it joins", 8))
        gone_first = asyncio.create_task(first_delta(gone))
        await asyncio.sleep(0.2)
        gone_first.cancel()
        await asyncio.gather(gone_first, return_exceptions=True)
        await gone.aclose()
        await asyncio.sleep(0.3)
        running_after_cancel = e.running_requests()
        # one still held when the engine stops (the busy batch still decoding)
        last = e.generate(greedy("Never joins", 8))
        last_delta = asyncio.create_task(first_delta(last))
        await asyncio.sleep(0.3)
        await e.stop()
        stopped = await last_delta
        for s in (busy, b, c, d, last):
            await s.aclose()
        return (
            held_early,
            running_while_held,
            firsts,
            (joined, join_steps, busy_decoding),
            running_after_cancel,
            (stopped.finish_reason, stopped.error_code),
        )

    held_early, running_while_held, firsts, group, running_after_cancel, stopped_code = run(scenario())
    assert held_early == [False, False]  # a group of 3 was not full: nobody joined
    assert running_while_held == 3  # the busy one and the two held
    # the full group joined at once, as one group of three, while the busy one still decoded: not
    # after the 100,000-step hold, nor when the batch emptied (the only other ways in); each of
    # the three had its first token within a couple of steps of joining (the group's prefill)
    (joined, join_steps, busy_decoding) = group
    assert all(f.token_ids for f in firsts) and joined == (1, 3) and busy_decoding
    assert join_steps <= 3 * 2
    # b, c and d ran their 8 tokens; the held one, alone and never admitted, was cancelled: only
    # the busy one is left (2 if the cancel had missed a request not yet in the batch)
    assert running_after_cancel == 1
    assert stopped_code == ("cancelled", "engine_stopped")


@pytest.mark.parametrize(
    ("hold", "quiet", "min_rows", "least", "most"),
    [(6, 100, 0, 6, 6), (100, 2, 0, 2, 2), (100, 100, 2, 0, 0)],
    ids=["after admit_hold_steps", "after admit_quiet_steps without another arrival", "at once below admit_hold_min_rows"],
)
def test_a_lone_arrival_joins_a_busy_batch(models_dir, hold, quiet, min_rows, least, most):
    """It waits for others while the batch decodes: until the hold ends, or until arrivals have
    stopped for admit_quiet_steps (waiting longer would not grow its group); not at all while
    fewer than admit_hold_min_rows rows decode (here one)."""

    async def scenario():
        e = LLMEngine(
            "llama-10m", str(models_dir / "llama-10m"), max_batch=8, admit_hold_steps=hold, admit_quiet_steps=quiet, admit_hold_min_rows=min_rows,
            reserve_concurrency=2,  # KV for the busy one's 3,000 tokens beside the lone one (M4)
        )  # fmt: skip
        await e.load()
        try:
            busy = e.generate(greedy("Busy for a while", 3000))
            await anext(busy)
            before = e.counters()["held_steps"]
            first = await anext(e.generate(greedy("Alone", 4)))
            waited = e.counters()["held_steps"] - before  # counted by the engine: arrival to joining, in its steps
            await busy.aclose()
            return first, waited
        finally:
            await e.stop()

    first, waited = run(scenario())
    assert first.token_ids and least <= waited <= most, waited


def test_requests_that_come_together_to_an_idle_engine_join_as_one_group_and_a_lone_one_waits_for_none(models_dir):
    """An idle batch lets an arrival in at once, unless others are being prepared beside it (a burst
    that waited for the model's load): then it waits for them (admit_gather_ms), and they are
    prefilled as one group. The preparation thread is held here until all six have started, so the
    first reaches the MLX thread with five still being prepared."""
    import threading

    async def scenario():
        e = LLMEngine("llama-10m", str(models_dir / "llama-10m"), max_batch=8, admit_gather_ms=5000, prefix_disk_bytes=0)
        await e.load()
        try:
            assert e._prep is not None
            go = threading.Event()
            e._prep.submit(go.wait, 30)
            before = e.counters()
            streams = [e.generate(greedy(f"Burst request {i}", 4)) for i in range(6)]
            firsts = [asyncio.create_task(anext(s)) for s in streams]
            await asyncio.sleep(0.2)  # every one started (counted as arriving), none prepared
            go.set()
            await asyncio.gather(*firsts)
            after = e.counters()
            for s in streams:
                await s.aclose()
            started = time.monotonic()
            await anext(e.generate(greedy("Alone", 4)))
            alone_s = time.monotonic() - started
            joined = (after["admitted_groups"] - before["admitted_groups"], after["admitted_requests"] - before["admitted_requests"])
            return joined, alone_s
        finally:
            await e.stop()

    joined, alone_s = run(scenario())
    assert joined == (1, 6)
    assert alone_s < 2.5  # nothing else being prepared: it did not wait out the 5 s window


def test_the_engine_counts_a_requests_time_inside_it(models_dir):
    """The counters bench.serve splits a round trip with: requests that ran to their end and their
    seconds from start() to the last delta, and the steps from joining the batch to a first token."""

    async def scenario():
        e = LLMEngine("llama-10m", str(models_dir / "llama-10m"), max_batch=4)
        await e.load()
        try:
            before = e.counters()
            started = time.monotonic()
            done = await asyncio.gather(*(e.complete(greedy(f"Count me {i}", 6)) for i in range(3)))
            took = time.monotonic() - started
            after = e.counters()
            return done, {k: after[k] - before[k] for k in ("finished_requests", "finished_s", "first_tokens", "join_steps")}, took
        finally:
            await e.stop()

    done, delta, took = run(scenario())
    assert [d.usage.completion_tokens for d in done] == [6, 6, 6]
    assert delta["finished_requests"] == 3 and delta["first_tokens"] == 3
    assert 0 < delta["finished_s"] <= 3 * took  # each one's own time, none longer than the whole
    assert 0 <= delta["join_steps"] <= 3 * 4  # a first token a step or two after joining, not the 6th


def test_only_long_prefixes_are_kept_and_reused(models_dir):
    """prompt_cache_min_tokens: a finished request is kept for reuse, and a kept prefix is reused,
    only when it is that long; shorter ones are prefilled again (copying a cache costs more)."""
    prompt = " ".join(PROMPTS) * 3

    async def twice(min_tokens):
        e = LLMEngine("llama-10m", str(models_dir / "llama-10m"), max_batch=4, prompt_cache_min_tokens=min_tokens)
        await e.load()
        try:
            first = await e.complete(greedy(prompt, 8))
            second = await e.complete(greedy(prompt, 8))
            return first, second, len(e.prompt_cache)
        finally:
            await e.stop()

    first, second, kept = run(twice(0))
    assert second.usage.cached_tokens >= second.usage.prompt_tokens - 1 and kept >= 1 and second.token_ids == first.token_ids
    long_enough = first.usage.prompt_tokens + 8 + 1
    first, second, kept = run(twice(long_enough))
    assert second.usage.cached_tokens == 0 and kept == 0 and second.token_ids == first.token_ids


@pytest.mark.parametrize(("budget", "groups"), [(16384, 1), (40, 3)])
def test_a_group_is_split_to_keep_prefill_within_max_prefill_tokens(models_dir, budget, groups):
    """Three 30-token prompts fill a group of three and join together, unless max_prefill_tokens
    allows fewer tokens in prefill at once: then each waits for the one before to finish its
    prefill (the engine's own counters: groups and requests admitted)."""

    async def scenario():
        e = LLMEngine(
            "llama-10m",
            str(models_dir / "llama-10m"),
            max_batch=8,
            prefill_batch=3,
            admit_hold_steps=100_000,
            admit_quiet_steps=100_000,
            max_prefill_tokens=budget,
            reserve_concurrency=4,  # KV for the busy one's 3,000 tokens beside the three (M4)
        )
        await e.load()
        try:
            busy = e.generate(greedy("Busy while the group gathers", 3000))
            await anext(busy)
            before = e.counters()
            three = [GenerationRequest(prompt_tokens=list(range(100 + i, 130 + i)), max_tokens=4, temperature=0) for i in range(3)]
            done = await asyncio.gather(*(e.complete(r) for r in three))
            after = e.counters()
            await busy.aclose()
            delta = {k: after[k] - before[k] for k in after}
            return done, delta, time.monotonic() - started
        finally:
            await e.stop()

    started = time.monotonic()
    done, delta, elapsed = run(scenario())
    assert [d.usage.completion_tokens for d in done] == [4, 4, 4]
    assert (delta["admitted_groups"], delta["admitted_requests"]) == (groups, 3)
    # where their first tokens waited: three first tokens, each after its wait for admission
    assert delta["first_tokens"] == 3
    assert 0 < delta["admit_wait_s"] < delta["first_token_s"] < 3 * elapsed
    assert 0 < delta["admit_prep_s"] < delta["admit_wait_s"]  # preparing is the first part of the wait; the hold is the rest


def test_a_count_from_the_folders_tokenizer_equals_the_engines_prompt(engine, models_dir, tmp_path):
    """What a node agent counts without the weights (prompt_tokens.Tokenizers) is the prompt the
    engine feeds: chat template, tools, past tool calls; the cache keeps `capacity` tokenizers; a
    folder without a tokenizer and a refused request are the caller's errors."""
    from deployments.engines.prompt_tokens import Tokenizers
    from deployments.wire.failure import OrchardError

    tool = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}
    call = {"id": "c1", "type": "function", "function": {"name": "get_time", "arguments": "{}"}}
    chat = GenerationRequest(
        messages=[
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "What time is it?"},
            {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "c1", "content": "noon"},
        ],
        tools=[tool],
    )
    tokenizers = Tokenizers(capacity=1)
    folder = str(models_dir / "llama-10m")
    for request in (chat, greedy("Hello there", 1)):
        assert tokenizers.count("llama-10m", folder, request) == len(engine.tokenize(request)) > 0
    tokenizers.count("smollm2-135m-instruct", str(models_dir / "smollm2-135m-instruct"), chat)
    assert len(tokenizers) == 1
    with pytest.raises(OrchardError) as info:
        tokenizers.count("nothing", str(tmp_path), chat)
    assert info.value.code == "files_not_stored" and str(tmp_path) not in info.value.message
    with pytest.raises(OrchardError) as info:
        tokenizers.count("llama-10m", folder, GenerationRequest(messages=[]))
    assert info.value.code == "invalid_request"
