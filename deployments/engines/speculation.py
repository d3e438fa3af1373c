"""Speculative decoding inside the batch: every row's draft tokens verified in one forward.

A decode step of mlx-lm's GenerationBatch feeds each row the token sampled at the step before (the
row's `_next_tokens`). A verify step feeds it that token and K draft tokens ([rows, K + 1] in one
forward of the target model over the batch's own cache), then keeps, per row, the longest prefix of
drafts the target accepts, and samples the token after it from the target:
- greedy rows accept a draft while it is the target's argmax at its position; the next token is the
  argmax after the last accepted one, so the output is the plain greedy decode's;
- sampled rows use rejection sampling with the deterministic proposal of prompt lookup: draft t is
  accepted with probability p(t), p the target's distribution under the row's own temperature,
  top-p, top-k and min-p; on a rejection the token is drawn from p with t removed (max(p - onehot(t),
  0), normalised), after all K are accepted from p at the next position. The output keeps the
  target's distribution.

The cache then holds K + 1 new positions a row, of which the rejected tail must go. Every layer
cache is trimmed by the fewest rejected; a row that rejected more has its extra tail rolled to the
front into its left padding (mlx-lm's `prepare(right_padding=...)` and `finalize()`, what it does
after a right-padded prefill), where the mask hides it; then the padding all rows have is cut from
the front (as mlx-lm's `filter` does), so the batch stays as long as its longest row. With one row
nothing is rolled.

After a plain step a row's next token is still being computed (mlx-lm runs a step ahead); waiting for
it before proposing would stall that pipeline on every step. The lookup then runs on the tokens before
it and its proposal's first token is a guess of it: the drafts count only where the guess was right
(compared on the device). After a verify step the token is on the host, and the lookup uses it.
Rows a draft model drafts for (draft.py, up to its `max_rows`) are proposed for once the depth is
chosen, the draft fed the token itself on the device: their drafts need no guess. The step's cost
then counts the draft's forwards (spec_depth.py). This reads and sets GenerationBatch's own fields
(mlx-lm is pinned: 0.32.2).

Steps that do not speculate are mlx-lm's own (`Speculator.step` returns None): while a prompt is
being prefilled, while any row carries logits processors (penalties, logit_bias, a grammar: they see
one token per step) or a seed (its draws come from its own key, one per step), when no row has a
proposal, or when the depth controller (spec_depth.py) finds a verify step would not pay. Runs on
the engine's MLX thread."""

import time
from collections.abc import Callable, Sequence
from typing import Any, Protocol, cast

import mlx.core as mx

from deployments.engines.acceptance import accept
from deployments.engines.draft import Draft, proposals
from deployments.engines.prompt_lookup import WINDOW, PromptLookup
from deployments.engines.sampling import BatchSampler, RowSampling
from deployments.engines.spec_depth import Depth

COUNTERS = (
    "spec_steps",  # verify steps run
    "spec_rows",  # rows in them
    "spec_proposed",  # draft tokens verified
    "spec_accepted",  # ... and accepted
    "spec_depth_sum",  # the depth K of each verify step, summed (over spec_steps: the mean)
    "spec_off_prefill",  # decode steps not speculated: a prompt was being prefilled
    "spec_off_rows",  # ... a row carried logits processors or a seed
    "spec_off_no_drafts",  # ... no row had a proposal
    "spec_off_cost",  # ... the depth controller found it would cost more than it saves
    "spec_draft_rows",  # rows of verify steps whose drafts came from the draft model (draft.py)
    "spec_draft_forwards",  # ... the draft's forwards for them (one a draft token)
    "spec_draft_s",  # ... and their seconds
)


class Proposer(Protocol):
    """Draft tokens for one row: up to `k` tokens to follow `tokens` and then `then` (together the
    row's whole sequence, prompt and output, each call extending the last; `then`: the token the row
    feeds next where it is known, passed apart so that the row's list is not copied). PromptLookup
    is one."""

    def propose(self, tokens: Sequence[int], k: int, then: Sequence[int] = ()) -> list[int]: ...


class Speculator:
    """Proposals, depth and verification for one engine's BatchGenerator (module docstring)."""

    def __init__(
        self,
        sampling: BatchSampler,
        max_drafts: int = 8,
        fixed_depth: int | None = None,
        ngram_max: int = 4,
        ngram_min: int = 2,
        lookup_window: int = WINDOW,
    ):
        self.sampling = sampling
        self.depth = Depth(max_drafts=max_drafts, fixed=fixed_depth)
        self.proposer: Callable[[], Proposer] = lambda: PromptLookup(ngram_max, ngram_min, lookup_window)  # a new row's
        self.draft: Draft | None = None  # a draft model's proposals for up to its max_rows rows (draft.py)
        self._lookups: dict[int, Proposer] = {}  # by the generator's uid
        self.stats: dict[str, float] = dict.fromkeys(COUNTERS, 0)
        self._plain_rows = 0  # rows of the last step, when it was a plain decode step (0: it was not)
        self._following: dict[int, int] = {}  # by uid: the token each row feeds next, where a verify step just made it

    # ---- the engine's calls --------------------------------------------------------------------
    def step(self, generator: Any) -> list[Any] | None:
        """One verify step of the generator's decoding batch, its responses (several a row, in order,
        as mlx-lm's next() gives one), or None where this step is mlx-lm's own."""
        batch = generator._generation_batch
        known, self._following = self._following, {}  # valid for the step right after a verify step only
        if not batch.uids:
            return None
        if len(generator._prompt_batch) or generator._unprocessed_sequences:
            self.stats["spec_off_prefill"] += 1
            return None
        if any(batch.logits_processors) or any(self._settings(uid).seed is not None for uid in batch.uids):
            self.stats["spec_off_rows"] += 1
            return None
        drafted = self.draft.rows(batch.uids) if self.draft is not None else set()
        by_draft = [uid in drafted for uid in batch.uids]
        if self.depth.hopeless(batch.uids, len(drafted)):  # not even every row's best case would pay
            self.stats["spec_off_cost"] += 1
            return None
        started = time.perf_counter()
        # The token a row feeds next is on the host after a verify step (which waited for it); after a
        # plain step it is still being sampled, and waiting for it would stall mlx-lm's pipeline: the
        # proposal is then looked up from the tokens before it, its first token a guess of that one,
        # and its drafts count only where the guess was right (checked on the device).
        # A draft past the row's max_tokens would be cut anyway (and past the context, not computed at all).
        room = [max(0, m - n - 1) for m, n in zip(batch.max_tokens, batch._num_tokens, strict=True)]
        # A row the draft model drafts for is proposed for once the depth is chosen (its drafts follow
        # the token it feeds next on the device: no guess), as deep as the room it has.
        looked_up: list[list[int]] = []
        for uid, tokens, r, mine in zip(batch.uids, batch.tokens, room, by_draft, strict=True):
            y = known.get(uid)
            if mine:
                looked_up.append([-1] * min(r + 1, self.depth.max_drafts + 1))
            else:
                looked_up.append([y, *self._propose(uid, tokens, (y,))][: r + 1] if y is not None else self._propose(uid, tokens)[: r + 1])
        choice = self.depth.choose(batch.uids, [max(0, len(p) - 1) for p in looked_up], by_draft)
        if choice.depth == 0:
            self.stats["spec_off_no_drafts" if choice.why == "no_drafts" else "spec_off_cost"] += 1
            return None
        guesses = [p[0] if p else 0 for p in looked_up]  # (a row without drafts has none to count)
        drafts = [p[1 : k + 1] for p, k in zip(looked_up, choice.drafts, strict=True)]
        draft_s = 0.0
        with mx.stream(generator.stream):
            if self.draft is not None and any(by_draft):
                depths = [k if mine else 0 for k, mine in zip(choice.drafts, by_draft, strict=True)]
                made, draft_s = proposals(self.draft, batch.uids, batch.tokens, batch._next_tokens, depths)
                for i, mine in enumerate(by_draft):
                    if mine:
                        drafts[i], guesses[i] = made[i], -1
                self._draft_stats(depths, draft_s)
            verify_started = time.perf_counter()
            responses, emitted = self._verify(batch, guesses, drafts, choice.depth)
        seconds = time.perf_counter() - started
        counters = generator._counters
        counters.decode_time += seconds
        counters.generation_tokens += emitted
        counters.generation_steps += 1
        self.depth.observe_step(len(batch.uids) * (choice.depth + 1), time.perf_counter() - verify_started)
        self._plain_rows = 0
        return responses

    def _draft_stats(self, depths: list[int], seconds: float) -> None:
        forwards = sum(depths)
        self.stats["spec_draft_rows"] += sum(1 for k in depths if k)
        self.stats["spec_draft_forwards"] += forwards
        self.stats["spec_draft_s"] += seconds
        self.depth.observe_draft(forwards, seconds)

    def timed_plain_step(self, rows: int, seconds: float) -> None:
        """A plain decode step's wall time (none after a verify step: mlx-lm's next step then finds
        its input computed, and its time would be too short)."""
        if self._plain_rows == rows:
            self.depth.observe_step(rows, seconds)
        self._plain_rows = rows

    def not_plain(self) -> None:
        """The last step was not a plain decode step (a prefill ran in it)."""
        self._plain_rows = 0

    def clear(self) -> None:
        """The batch was dropped (a broken step)."""
        for uid in list(self._lookups):
            self.forget(uid)
        if self.draft is not None:
            self.draft.clear()

    def forget(self, uid: int) -> None:
        """A row left the batch."""
        self._lookups.pop(uid, None)
        self.depth.forget(uid)
        if self.draft is not None:
            self.draft.forget(uid)

    # ---- inside a step -------------------------------------------------------------------------
    def _settings(self, uid: int) -> RowSampling:
        return self.sampling.settings(uid)

    def _propose(self, uid: int, tokens: list[int], then: Sequence[int] = ()) -> list[int]:
        lookup = self._lookups.get(uid)
        if lookup is None:
            lookup = self._lookups[uid] = self.proposer()
        return lookup.propose(tokens, self.depth.max_drafts + 1, then)

    def _verify(self, batch: Any, guesses: list[int], drafts: list[list[int]], depth: int) -> tuple[list[Any], int]:
        """Feed every row its last token and drafts, keep what the target accepts, fix the cache.
        `guesses`: what each row's drafts take its last token to be (they count only where it is;
        -1: the drafts followed the token itself)."""
        rows = len(guesses)
        y = batch._next_tokens
        padded = [d + [0] * (depth - len(d)) for d in drafts]  # padding is never accepted
        inputs = mx.concatenate([y[:, None].astype(mx.int32), mx.array(padded, dtype=mx.int32)], axis=1)
        logits = batch.model(inputs, cache=batch.prompt_cache)
        logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        settings = [self._settings(uid) for uid in batch.uids]
        known = mx.array([g < 0 for g in guesses]) | (y == mx.array([max(g, 0) for g in guesses], dtype=y.dtype))
        lengths = mx.where(known, mx.array([len(d) for d in drafts]), 0)
        accepted, following = accept(logprobs, inputs[:, 1:], lengths, settings)
        mx.eval(accepted, following, y)
        accepted_n = cast(list[int], accepted.tolist())
        last = cast(list[int], y.tolist())

        responses: list[Any] = []
        kept: list[int] = []  # positions each row keeps in its cache
        finished: list[tuple[int, list[Any]]] = []  # row, its responses' fields
        emitted_total = 0
        for i in range(rows):
            tokens = [last[i], *drafts[i][: accepted_n[i]]]
            logprob_rows = [batch._next_logprobs[i], *(logprobs[i, j] for j in range(accepted_n[i]))]
            out, reason = [], None
            for token, row in zip(tokens, logprob_rows, strict=True):
                batch._num_tokens[i] += 1
                if batch._num_tokens[i] >= batch.max_tokens[i]:
                    reason = "length"
                if batch._matchers[i].advance(token):
                    reason = "stop"
                out.append([batch.uids[i], token, row, reason])
                if reason is not None:
                    break
            kept.append(len(out))
            batch.tokens[i].extend(tokens[: len(out)])
            emitted_total += len(out)
            self.stats["spec_proposed"] += len(drafts[i])
            self.stats["spec_accepted"] += accepted_n[i]
            self.depth.observe_row(batch.uids[i], len(drafts[i]), accepted_n[i])
            if reason is not None:
                finished.append((i, out))
            responses.append(out)
        _rewind(batch.prompt_cache, [depth + 1 - k for k in kept])
        done = {i for i, _ in finished}
        made: list[Any] = []
        for i, out in enumerate(responses):
            for n, (uid, token, row, reason) in enumerate(out):
                last_one = i in done and n == len(out) - 1
                made.append(
                    batch.Response(
                        uid=uid,
                        token=token,
                        logprobs=row,
                        finish_reason=reason,
                        prompt_cache=batch.extract_cache(i) if last_one else None,
                        all_tokens=batch.tokens[i] if last_one else None,
                    )
                )
        batch._next_tokens = following
        self._following = dict(zip(batch.uids, cast(list[int], following.tolist()), strict=True))
        batch._next_logprobs = [logprobs[i, accepted_n[i]] for i in range(rows)]
        self.stats["spec_steps"] += 1
        self.stats["spec_rows"] += rows
        self.stats["spec_depth_sum"] += depth
        if done:
            batch.filter([i for i in range(rows) if i not in done])
        return made, emitted_total


def _rewind(layer_caches: list[Any], rejected: list[int]) -> None:
    """Drop each row's `rejected` last positions: all rows' fewest by trimming, a row's extra rolled
    into its left padding; then the padding every row has is dropped from the front, as mlx-lm's
    `filter` does when a row leaves (without it the batch would grow by the most any row kept each
    step, not by the longest row's growth)."""
    common = min(rejected)
    extra = [r - common for r in rejected]
    for cache in layer_caches:
        if common:
            cache.trim(common)
        if any(extra):
            cache.prepare(right_padding=extra)
            cache.finalize()
    if any(extra) and layer_caches:  # every layer's padding is the same: read it once
        shift = cast(int, layer_caches[0].left_padding.min().item())
        if shift > 0:
            for cache in layer_caches:
                _drop_front(cache, shift)


def _drop_front(cache: Any, shift: int) -> None:
    """Drop the first `shift` positions of a batch cache (padding in every row): mlx-lm's
    BatchKVCache (keys and values arrays) or BatchQuantizedKVCache (triples). A row's position
    (`offset`) stays; its padding and the write index move by `shift`."""

    def front(kv: Any) -> Any:
        if kv is None:
            return None
        return tuple(x[..., shift:, :] for x in kv) if isinstance(kv, tuple) else kv[..., shift:, :]

    cache.keys, cache.values = front(cache.keys), front(cache.values)
    cache._idx -= shift
    cache.left_padding = cache.left_padding - shift
