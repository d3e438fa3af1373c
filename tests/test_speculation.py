"""Speculative decoding in the batch: prompt-lookup proposals, the depth controller, the acceptance
rule, and the engine's greedy output with speculation equal to its output without, for every cache
kind the engine uses (plain KV, quantized KV, block prefix cache hits, mlx-lm's LRU cache, chunked
prefill) and for several rows verified in one forward."""

import asyncio
from collections import Counter

import mlx.core as mx
import pytest
from mlx_lm.models.cache import BatchKVCache

from deployments.engines.acceptance import accept
from deployments.engines.llm import LLMEngine
from deployments.engines.prompt_lookup import PromptLookup
from deployments.engines.sampling import RowSampling
from deployments.engines.spec_depth import Depth
from deployments.engines.speculation import COUNTERS, _rewind
from deployments.wire.generation import GenerationRequest

REPEATING = "the cat sat on the mat and the dog sat on the log. " * 12
PROMPTS = [
    REPEATING,
    "Once upon a time, in a land far away, there lived a",
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n\n" * 3,
    "1, 2, 3, 4, 5, 1, 2, 3, 4, 5, 1, 2, 3,",
]


def run(coro):
    return asyncio.run(coro)


# ---- proposals -------------------------------------------------------------------------------
def test_prompt_lookup_proposes_what_followed_the_most_recent_earlier_occurrence():
    lookup = PromptLookup(ngram_max=3, ngram_min=2)
    tokens = [1, 2, 3, 4, 5, 9, 2, 3, 7, 8, 6, 2, 3]
    assert lookup.propose(tokens, 4) == [7, 8, 6, 2]  # "2 3" last came before 7 8 6 2
    assert lookup.propose([*tokens, 7], 3) == [8, 6, 2]  # "2 3 7": the longer match
    assert lookup.propose([*tokens, 7, 0], 3) == []  # "7 0" and "3 7 0" never came before
    assert lookup.propose([*tokens, 7, 0, 5], 0) == []


def test_prompt_lookup_grown_token_by_token_proposes_as_one_built_at_once():
    tokens = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8, 9, 7, 9, 3, 2, 3, 8, 4, 6, 2, 6, 4, 3, 3, 8, 3, 2, 7, 9, 5] * 3
    grown = PromptLookup()
    for end in range(1, len(tokens) + 1):
        assert grown.propose(tokens[:end], 5) == PromptLookup().propose(tokens[:end], 5)


def test_prompt_lookup_takes_the_token_fed_next_apart_as_part_of_the_sequence():
    tokens = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8, 9, 7, 9, 3, 2, 3, 8, 4, 6, 2, 6, 4, 3, 3, 8, 3, 2, 7, 9, 5] * 3
    apart = PromptLookup()
    for end in range(2, len(tokens) + 1):
        assert apart.propose(tokens[: end - 1], 5, tokens[end - 1 : end]) == PromptLookup().propose(tokens[:end], 5)


def test_prompt_lookup_indexes_only_the_window_before_its_first_proposal_and_all_after():
    prompt = [7, 8, 9, 1] + list(range(100, 130)) + [5, 6, 2] + list(range(200, 210))  # 47 tokens
    lookup = PromptLookup(ngram_max=2, ngram_min=2, window=20)
    assert lookup.propose(prompt, 3, [7]) == []  # nothing yet: a 1-gram is shorter than the sizes
    assert lookup.propose([*prompt, 7], 3, [8]) == []  # "7 8" is 48 tokens back: past the window
    assert PromptLookup(ngram_max=2, ngram_min=2).propose([*prompt, 7], 3, [8]) == [9, 1, 100]  # (unbounded: found)
    assert lookup.propose([*prompt, 7, 8], 2, [5]) == []
    assert lookup.propose([*prompt, 7, 8, 5], 2, [6]) == [2, 200]  # "5 6": 12 tokens back, inside it
    assert lookup.propose([*prompt, 7, 8, 5, 6, 2, 200], 2, [7]) == []
    assert lookup.propose([*prompt, 7, 8, 5, 6, 2, 200, 7], 2, [8]) == [5, 6]  # "7 8" after the first proposal: indexed
    assert sum(map(len, lookup._index.values())) < 30  # the 20-token window and what followed, not the 47
    with pytest.raises(ValueError):
        PromptLookup(window=0)


# ---- depth -----------------------------------------------------------------------------------
def test_depth_speculates_where_drafts_are_accepted_and_cheap_and_not_otherwise():
    depth = Depth(max_drafts=8, prior_token_cost=0.01)
    assert depth.choose([1, 2], [0, 0]).why == "no_drafts"
    for _ in range(10):
        depth.observe_row(1, 8, 8)
    chosen = depth.choose([1], [8])
    assert chosen.why == "speculate" and chosen.depth == 8 and chosen.gain > 4
    for _ in range(10):
        depth.observe_row(1, 4, 0)
    assert depth.choose([1], [8]).why == "cost"  # a row that accepts nothing does not pay for a wider forward


def test_depth_turns_down_where_the_measured_steps_say_a_wider_forward_costs_its_tokens():
    depth = Depth(max_drafts=4)
    for _ in range(20):  # 10 ms a step and 1 ms a token
        for tokens in (16, 32, 48, 80):
            depth.observe_step(tokens, 0.01 + 0.001 * tokens)
    rows = list(range(16))
    for r in rows:
        depth.observe_row(r, 4, 2)
    assert depth.step_cost(16, 4) == pytest.approx(0.09 / 0.026, rel=0.01)
    assert depth.choose(rows, [4] * 16).why == "cost"
    assert depth.hopeless(rows)
    assert not Depth(max_drafts=4, fixed=2).hopeless(rows) and Depth(max_drafts=4, fixed=2).choose(rows, [4] * 16).depth == 2


# ---- the acceptance rule ---------------------------------------------------------------------
def test_greedy_acceptance_keeps_the_drafts_the_target_agrees_with_and_then_its_token():
    vocab = 6
    targets = [[2, 3, 4, 5], [2, 0, 4, 5], [1, 1, 1, 1]]  # each position's argmax
    logprobs = mx.log(mx.softmax(mx.array([[[5.0 if v == t else 0.0 for v in range(vocab)] for t in row] for row in targets]), axis=-1))
    drafts = mx.array([[2, 3, 4], [2, 3, 4], [1, 1, 1]])
    accepted, following = accept(logprobs, drafts, [3, 3, 2], [RowSampling()] * 3)
    assert accepted.tolist() == [3, 1, 2]  # all; up to the disagreement; up to the row's own drafts
    assert following.tolist() == [5, 0, 1]


def test_rejection_sampling_keeps_the_target_distribution():
    mx.random.seed(7)
    rows, probs = 40_000, [0.5, 0.3, 0.15, 0.05]
    logprobs = mx.broadcast_to(mx.log(mx.array(probs))[None, None, :], (rows, 3, 4))
    drafts = mx.broadcast_to(mx.array([[1, 0]]), (rows, 2))  # a draft of token 1, then 0
    accepted, following = accept(logprobs, drafts, [2] * rows, [RowSampling(temperature=1.0)] * rows)
    accepted_n, after = accepted.tolist(), following.tolist()
    first = Counter(1 if a >= 1 else t for a, t in zip(accepted_n, after, strict=True))
    for token, p in enumerate(probs):
        assert abs(first[token] / rows - p) < 0.01, (token, first[token] / rows, p)
    assert abs(sum(a >= 1 for a in accepted_n) / rows - 0.3) < 0.01  # token 1 accepted with its probability
    second = Counter(0 if a == 2 else t for a, t in zip(accepted_n, after, strict=True) if a >= 1)
    kept = sum(second.values())
    for token, p in enumerate(probs):  # the token after an accepted draft: the target's again
        assert abs(second[token] / kept - p) < 0.02, (token, second[token] / kept, p)


# ---- the rewind ------------------------------------------------------------------------------
@pytest.mark.parametrize("rows", [2, 8])
def test_rewind_keeps_each_rows_positions_and_the_batch_at_its_longest_row(rows):
    """Rows taking turns at accepting every draft (one row at a time, the turn passing every 50 verify
    steps): each row's cache holds exactly its kept positions, in order, and the batch is no longer
    than its longest row."""
    depth, cache = 4, BatchKVCache([0] * rows)
    written = [0] * rows  # the positions each row kept so far; row i's position j holds the value j
    for step in range(400):
        new = mx.array([[float(n + j) for j in range(depth + 1)] for n in written])
        cache.update_and_fetch(new[:, None, :, None], new[:, None, :, None])
        kept = [depth + 1 if (step // 50) % rows == i else 1 for i in range(rows)]
        _rewind([cache], [depth + 1 - k for k in kept])
        written = [n + k for n, k in zip(written, kept, strict=True)]
    keys, _ = cache.keys_and_values()
    padding = cache.left_padding.tolist()
    for i in range(rows):
        assert keys[i, 0, padding[i] :, 0].tolist() == [float(j) for j in range(written[i])]
    assert cache._idx == max(written), (cache._idx, written)


# ---- the engine ------------------------------------------------------------------------------
class Known:
    """Drafts from the plain decode's known answers, one in three of them spoiled and one in five
    missing, so that rows accept different numbers of drafts (prompt lookup on llama-10m's random
    weights seldom proposes, and what it proposes is always right): the verify step, the rewinds and
    the rolls all run."""

    def __init__(self, answers: list[tuple[list[int], list[int]]], vocab: int):
        self.answers, self.vocab = answers, vocab

    def propose(self, tokens, k, then=()):
        tokens = [*tokens, *then]
        for prompt, answer in self.answers:
            if list(tokens[: len(prompt)]) == prompt:
                at = len(tokens) - len(prompt)  # the answer's tokens so far (the last is fed next)
                if at % 5 == 4:
                    return []  # a row without drafts beside rows with them
                drafts = list(answer[at : at + k])
                if drafts and at % 3 != 2:
                    spoil = (at * 7) % len(drafts)
                    drafts[spoil] = (drafts[spoil] + 1) % self.vocab
                return drafts
        return []


class Repeat:
    """Drafts that repeat the last token: mostly rejected, sometimes not."""

    def propose(self, tokens, k, then=()):
        return [[*tokens, *then][-1]] * k


async def _complete_all(engine: LLMEngine, requests: list[GenerationRequest], together: bool) -> list[list[int]]:
    if together:
        return [d.token_ids for d in await asyncio.gather(*(engine.complete(r) for r in requests))]
    return [(await engine.complete(r)).token_ids for r in requests]


def _outputs(path, requests, together=False, repeat=1, known=None, proposer=None, later=(), **settings) -> tuple[list[list[list[int]]], dict]:
    """Each round's outputs (`repeat` rounds of `requests`, then a round of `later`) and the engine's
    counters. `known`: the outputs the drafts come from (of `requests`, then of `later`)."""

    async def scenario():
        engine = LLMEngine("llama-10m", path, prefix_disk_bytes=0, **settings)
        await engine.load()
        try:
            if known is not None:
                answers = [(engine.tokenize(r), out) for r, out in zip([*requests, *later], known, strict=True)]
                engine.speculator.proposer = lambda: Known(answers, engine.vocab_size)
            elif proposer is not None:
                engine.speculator.proposer = proposer
            outputs = []
            for _ in range(repeat):
                outputs.append(await _complete_all(engine, requests, together))
            if later:
                outputs.append(await _complete_all(engine, list(later), together))
            return outputs, engine.counters()
        finally:
            await engine.stop()

    return run(scenario())


CACHES = {
    "plain KV": {"prompt_cache_min_tokens": 16},
    "quantized KV": {"kv_bits": 8, "prompt_cache_min_tokens": 16},
    "LRU prefix cache": {"prefix_cache": "lru", "prompt_cache_min_tokens": 16},
    "chunked prefill": {"prefill_chunk_tokens": 32, "prompt_cache_min_tokens": 16},
}


@pytest.mark.parametrize("cache", list(CACHES))
def test_greedy_output_with_speculation_is_the_plain_decode(models_dir, cache):
    path = str(models_dir / "llama-10m")
    requests = [GenerationRequest(prompt=p, max_tokens=48, temperature=0) for p in PROMPTS]
    # twice: the second round's prompts are cached prefixes (block cache or LRU)
    plain, _ = _outputs(path, requests, repeat=2, speculation="off", **CACHES[cache])
    spec, counted = _outputs(path, requests, repeat=2, known=plain[0], spec_fixed_depth=4, **CACHES[cache])
    assert spec == plain
    assert 0 < counted["spec_accepted"] < counted["spec_proposed"]  # drafts were verified, some rejected
    if cache != "LRU prefix cache":
        assert counted["prefix_hits"] > 0  # the second round reused the first's prefixes


def test_prompt_lookup_itself_keeps_the_plain_decode(models_dir):
    path = str(models_dir / "llama-10m")
    requests = [GenerationRequest(prompt=p, max_tokens=48, temperature=0) for p in PROMPTS]
    plain, _ = _outputs(path, requests, speculation="off")
    spec, counted = _outputs(path, requests, spec_fixed_depth=4)
    assert spec == plain and counted["spec_accepted"] > 0


@pytest.mark.parametrize("kv_bits", [None, 8])
def test_several_rows_verified_in_one_forward_give_each_rows_plain_decode(models_dir, kv_bits):
    path = str(models_dir / "llama-10m")
    requests = [GenerationRequest(prompt=p, max_tokens=40 + 7 * i, temperature=0) for i, p in enumerate(PROMPTS)]
    # then the same prompts with tails of different lengths: their rows join with cached prefixes that
    # leave them different numbers of tokens to prefill, and take back as much as aligns them (prefill_align)
    later = [GenerationRequest(prompt=r.prompt + " and then" * (2 + 3 * i), max_tokens=32, temperature=0) for i, r in enumerate(requests)]
    alone, _ = _outputs(path, [*requests, *later], speculation="off", kv_bits=kv_bits)
    together, counted = _outputs(
        path, requests, together=True, later=later, known=alone[0], spec_fixed_depth=4, kv_bits=kv_bits, prompt_cache_min_tokens=16
    )
    assert together == [alone[0][:4], alone[0][4:]]
    assert counted["spec_rows"] > counted["spec_steps"] > 0  # rows verified together
    assert 0 < counted["spec_accepted"] < counted["spec_proposed"]
    assert counted["prefix_hits"] >= 4 and counted["aligned_tokens"] > 0


def test_sampled_and_seeded_rows_finish_beside_speculating_ones(models_dir):
    path = str(models_dir / "llama-10m")
    requests = [
        GenerationRequest(prompt=PROMPTS[0], max_tokens=40, temperature=0.8),
        GenerationRequest(prompt=PROMPTS[3], max_tokens=40, temperature=0.7, top_p=0.9, top_k=20),
        GenerationRequest(prompt=PROMPTS[2], max_tokens=16, temperature=0.7, seed=3),
    ]
    alone, _ = _outputs(path, requests[2:], speculation="off")
    outputs, counted = _outputs(path, requests, together=True, proposer=Repeat, spec_fixed_depth=4)
    assert [len(t) for t in outputs[0]] == [40, 40, 16]
    assert outputs[0][2] == alone[0][0]  # a seeded row is never speculated: its draws are its own key's
    assert counted["spec_off_rows"] > 0 and counted["spec_steps"] > 0  # ... and speculation resumed once it left


def test_metrics_carry_each_instances_speculation_counters():
    from router.api.routes.metrics import speculation_lines

    counted = dict.fromkeys(COUNTERS, 0) | {"spec_proposed": 40, "spec_accepted": 31, "spec_steps": 9, "spec_off_cost": 5, "spec_draft_rows": 7}
    counted |= {"spec_draft_forwards": 28, "spec_draft_s": 0.25}
    lines = speculation_lines([("smollm2", "mac-1", counted), ("whisper", "mac-1", {"decode_steps": 3})])
    assert 'orchard_spec_accepted_tokens_total{model="smollm2",node="mac-1"} 31' in lines
    assert 'orchard_spec_proposed_tokens_total{model="smollm2",node="mac-1"} 40' in lines
    assert 'orchard_spec_plain_steps_total{model="smollm2",node="mac-1",why="cost"} 5' in lines
    assert 'orchard_spec_draft_rows_total{model="smollm2",node="mac-1"} 7' in lines  # what a draft model proposed, and its cost
    assert 'orchard_spec_draft_forwards_total{model="smollm2",node="mac-1"} 28' in lines
    assert 'orchard_spec_draft_seconds_total{model="smollm2",node="mac-1"} 0.25' in lines
    assert not any("whisper" in line for line in lines)  # an engine that does not speculate has no lines
    assert speculation_lines([("whisper", "mac-1", {})]) == []


class Taking:
    """Drafts from the plain decode's known answers, each row's all right for `turn` tokens of its
    output and all wrong (the first one spoiled) for the next `turn`, the rows out of step: at every
    verify step one row accepts everything and another nothing."""

    def __init__(self, answers: list[tuple[list[int], list[int]]], vocab: int, turn: int):
        self.answers, self.vocab, self.turn = answers, vocab, turn

    def propose(self, tokens, k, then=()):
        tokens = [*tokens, *then]
        for row, (prompt, answer) in enumerate(self.answers):
            if tokens[: len(prompt)] == prompt:
                at = len(tokens) - len(prompt)
                drafts = list(answer[at : at + k])
                if drafts and (at // self.turn + row) % 2:
                    drafts[0] = (drafts[0] + 1) % self.vocab
                return drafts
        return []


@pytest.mark.parametrize("kv_bits", [None, pytest.param(8, marks=pytest.mark.slow)])
def test_rows_accepting_in_turns_keep_the_batch_cache_at_the_longest_rows_length(models_dir, kv_bits):
    """A row that rejected more than another has its rejected tail rolled into its left padding; the
    padding every row then has is dropped, so the batch holds rows x the longest row (rule M4), not
    the sum of every step's best row."""
    path = str(models_dir / "llama-10m")
    prompts = [PROMPTS[0][:200], PROMPTS[2][:200], PROMPTS[1]]
    requests = [GenerationRequest(prompt=p, max_tokens=160, temperature=0) for p in prompts]
    plain, _ = _outputs(path, requests, speculation="off", kv_bits=kv_bits)

    async def scenario():
        engine = LLMEngine("llama-10m", path, prefix_disk_bytes=0, spec_fixed_depth=4, kv_bits=kv_bits)
        await engine.load()
        answers = [(engine.tokenize(r), out) for r, out in zip(requests, plain[0], strict=True)]
        speculator = engine.speculator
        speculator.proposer = lambda: Taking(answers, engine.vocab_size, turn=20)
        verify, over = speculator.step, []

        def step(generator):
            responses = verify(generator)
            batch = generator._generation_batch
            if responses is not None and batch.uids:
                over.append(batch.prompt_cache[0]._idx - max(len(t) for t in batch.tokens))
            return responses

        speculator.step = step
        try:
            outputs = await _complete_all(engine, requests, together=True)
            return outputs, engine.counters(), over
        finally:
            await engine.stop()

    outputs, counted, over = run(scenario())
    assert outputs == plain[0]
    assert counted["spec_steps"] > 20 and 0 < counted["spec_accepted"] < counted["spec_proposed"]
    assert max(over) <= 0, f"the batch cache outgrew its longest row by up to {max(over)} positions"
