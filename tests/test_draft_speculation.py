"""Speculative decoding with a draft model (deployments/engines/draft.py): greedy output identical to
the plain decode with the draft's own caches kept in step (plain KV, block prefix cache hits, several
rows, some on prompt lookup beside the drafted ones), a draft that agrees with its target has its
drafts accepted, a draft of another tokenizer is refused at load, the depth turns the draft off where
its forwards cost more than they save, and the draft's weights and cache are counted with the
target's: the folder estimate, the registry's reservation and the engine's measured report."""

import asyncio
from pathlib import Path

import pytest

from deployments.engines.draft import DraftRefused
from deployments.engines.llm import LLMEngine
from deployments.engines.options import LLMEngineOptions
from deployments.engines.spec_depth import Depth
from deployments.estimate import estimate
from deployments.model_prep.quantized_draft import build_draft
from deployments.wire.generation import GenerationRequest

PROMPTS = [
    "Once upon a time, in a land far away, there lived a",
    "the cat sat on the mat and the dog sat on the log. " * 12,
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n\n" * 3,
    "1, 2, 3, 4, 5, 1, 2, 3, 4, 5, 1, 2, 3,",
]


@pytest.fixture(scope="module")
def q4_draft(models_dir, tmp_path_factory) -> Path:
    """llama-10m's own weights in 4 bits (the project's model prep): a draft that mostly agrees."""
    return build_draft(models_dir / "llama-10m", tmp_path_factory.mktemp("drafts") / "llama-10m-q4-draft", bits=4)


def _outputs(path, requests, together=False, repeat=1, **settings) -> tuple[list[list[list[int]]], dict, LLMEngine]:
    async def scenario():
        engine = LLMEngine("llama-10m", str(path), prefix_disk_bytes=0, **settings)
        await engine.load()
        try:
            rounds = []
            for _ in range(repeat):
                if together:
                    rounds.append([d.token_ids for d in await asyncio.gather(*(engine.complete(r) for r in requests))])
                else:
                    rounds.append([(await engine.complete(r)).token_ids for r in requests])
            return rounds, engine.counters(), engine
        finally:
            await engine.stop()

    return asyncio.run(scenario())


CACHES = {
    "plain KV": {"prompt_cache_entries": 0},
    "block prefix cache": {"prompt_cache_min_tokens": 16},
    "LRU prefix cache": {"prefix_cache": "lru", "prompt_cache_min_tokens": 16},
}


@pytest.mark.parametrize("cache", [pytest.param(c, marks=pytest.mark.slow) if c == "LRU prefix cache" else c for c in CACHES])
def test_greedy_output_with_a_draft_model_is_the_plain_decode(models_dir, q4_draft, cache):
    requests = [GenerationRequest(prompt=p, max_tokens=32, temperature=0) for p in PROMPTS]
    # twice: the second round's prompts are cached prefixes (the draft prefills them itself)
    plain, _, _ = _outputs(models_dir / "llama-10m", requests, repeat=2, speculation="off", **CACHES[cache])
    drafted, counted, _ = _outputs(
        models_dir / "llama-10m", requests, repeat=2, speculation="draft", draft_model=str(q4_draft), spec_fixed_depth=4, **CACHES[cache]
    )
    assert drafted == plain
    assert counted["spec_draft_rows"] > 0 and counted["spec_draft_forwards"] >= counted["spec_draft_rows"]
    assert 0 < counted["spec_accepted"] < counted["spec_proposed"]  # drafts kept and drafts rejected: the draft's caches were trimmed
    if cache == "block prefix cache":
        assert counted["prefix_hits"] > 0


def test_rows_past_draft_rows_take_prompt_lookup_in_the_same_verify_steps(models_dir, q4_draft):
    requests = [GenerationRequest(prompt=p, max_tokens=32 + 5 * i, temperature=0) for i, p in enumerate(PROMPTS)]
    alone, _, _ = _outputs(models_dir / "llama-10m", requests, speculation="off")
    together, counted, _ = _outputs(
        models_dir / "llama-10m", requests, together=True, speculation="draft", draft_model=str(q4_draft), draft_rows=2, spec_fixed_depth=3
    )
    assert together == alone
    assert counted["spec_rows"] > counted["spec_draft_rows"] > counted["spec_steps"] > 0  # 2 drafted rows a step, others beside them


def test_sampled_rows_with_a_draft_finish_with_their_lengths(models_dir, q4_draft):
    requests = [GenerationRequest(prompt=p, max_tokens=16, temperature=0.8, top_p=0.9) for p in PROMPTS[:3]]
    outputs, counted, _ = _outputs(
        models_dir / "llama-10m", requests, together=True, speculation="draft", draft_model=str(q4_draft), spec_fixed_depth=4
    )
    assert [len(t) for t in outputs[0]] == [16, 16, 16]
    assert counted["spec_draft_rows"] > 0 and counted["spec_proposed"] > 0  # (llama-10m's sampled tokens seldom match a greedy draft)


def test_a_draft_that_agrees_with_its_target_has_its_drafts_accepted(models_dir):
    requests = [GenerationRequest(prompt=p, max_tokens=48, temperature=0) for p in PROMPTS[:2]]
    path = models_dir / "llama-10m"
    _, counted, _ = _outputs(path, requests, speculation="draft", draft_model=str(path), spec_fixed_depth=4)
    assert counted["spec_proposed"] > 40
    assert counted["spec_accepted"] / counted["spec_proposed"] >= 0.95  # the target itself: its argmax, but for ties of float rounding


def test_a_draft_of_another_tokenizer_is_refused_at_load(models_dir):
    async def scenario():
        engine = LLMEngine(
            "llama-10m",
            str(models_dir / "llama-10m"),
            prefix_disk_bytes=0,
            speculation="draft",
            draft_model=str(models_dir / "smollm2-135m-instruct"),
        )
        try:
            with pytest.raises(DraftRefused, match="another tokenizer than llama-10m .*must share its target's vocabulary"):
                await engine.load()
            assert engine.health().status == "failed" and "tokenizer" in engine.health().detail
        finally:
            await engine.stop()

    asyncio.run(scenario())


def test_draft_settings_are_checked():
    with pytest.raises(ValueError, match="takes a draft_model"):
        LLMEngine("m", "models/llama-10m", speculation="draft")
    with pytest.raises(ValueError, match="takes a draft_model"):
        LLMEngineOptions(draft_model="llama-10m")  # a draft named without speculation: draft
    assert LLMEngineOptions(speculation="draft", draft_model="llama-10m").draft_rows == 4


def test_depth_turns_the_draft_off_where_its_forwards_cost_more_than_they_save():
    cheap, dear = Depth(max_drafts=4), Depth(max_drafts=4)
    for depth in (cheap, dear):
        for _ in range(20):
            depth.observe_row(1, 4, 4)  # every draft accepted
            for tokens in (1, 3, 5):
                depth.observe_step(tokens, 0.010 + 0.0005 * tokens)  # 10 ms a step, 0.5 ms a token
    cheap.observe_draft(4, 0.004)  # 1 ms a draft forward
    dear.observe_draft(4, 0.040)  # 10 ms: as much as the target's step
    assert cheap.choose([1], [4], [True]).depth == 4 and cheap.choose([1], [4], [True]).gain > 2
    assert dear.choose([1], [4], [True]).why == "cost" and dear.hopeless([1], drafted=1)
    assert dear.choose([1], [4], [False]).depth == 4  # the same drafts from prompt lookup cost nothing


def test_the_drafts_memory_is_counted_with_its_targets(models_dir, q4_draft, tmp_path):
    from router.residency.registry import from_config

    target, draft = estimate(models_dir / "llama-10m"), estimate(q4_draft)
    both = estimate(models_dir / "llama-10m", draft=q4_draft)
    assert both.weight_bytes == target.weight_bytes + draft.weight_bytes
    assert both.kv_bytes_per_token == target.kv_bytes_per_token + draft.kv_bytes_per_token > target.kv_bytes_per_token
    models = [
        {"name": "llama-10m", "kind": "llm", "llm_engine": {"speculation": "draft", "draft_model": "llama-10m-q4-draft"}},
        {"name": "llama-10m-q4-draft", "kind": "llm", "path": str(q4_draft)},
    ]
    catalog, entries = from_config(models, models_dir)
    assert catalog["llama-10m"].weight_bytes == both.weight_bytes and catalog["llama-10m"].kv_bytes_per_token == both.kv_bytes_per_token
    assert entries["llama-10m"].llm_engine == {"speculation": "draft", "draft_model": str(q4_draft)}  # the path the engine loads
    with pytest.raises(ValueError, match="no draft model at"):
        from_config([{**models[0], "llm_engine": {"speculation": "draft", "draft_model": str(tmp_path / "nothing")}}], models_dir)

    _, _, alone = _outputs(models_dir / "llama-10m", [], speculation="off")
    _, _, paired = _outputs(models_dir / "llama-10m", [], speculation="draft", draft_model=str(q4_draft))
    assert alone.measured is not None and paired.measured is not None
    assert paired.memory().weight_bytes == alone.memory().weight_bytes + draft.weight_bytes
    assert paired.measured.weight_bytes > alone.measured.weight_bytes + draft.weight_bytes // 2  # what the draft's load added, measured
    assert paired.measured.cache.full_bytes_per_token == alone.measured.cache.full_bytes_per_token + draft.kv_bytes_per_token
    assert paired.measured.kv_reserved_bytes > alone.measured.kv_reserved_bytes
    assert paired.measured.estimated_cache is not None and paired.measured.estimated_cache.full_bytes_per_token == both.kv_bytes_per_token


def test_a_draft_measured_slow_is_tried_again_later():
    depth = Depth(max_drafts=4)
    for _ in range(20):
        for tokens in (1, 3, 5):
            depth.observe_step(tokens, 0.010 + 0.0005 * tokens)
    depth.observe_draft(1, 0.5)  # a first forward that compiled kernels: 50 times a step
    checks = 0
    while depth.hopeless([1], drafted=1):
        checks += 1
        assert checks < 5000
    assert checks > 100  # not at once: the slow figure stands for a while (a retry costs the draft a catch-up)
    assert depth.choose([1], [4], [True]).depth >= 1  # then a verify step measures the draft again
