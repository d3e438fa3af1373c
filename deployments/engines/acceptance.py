"""A verify step's acceptance of each row's drafts (speculation.py): greedy rows keep the drafts the
target's own choice matches; sampled rows use standard rejection sampling for a deterministic
proposal: a draft is accepted with the target's probability of it, and on rejection the token is
drawn from the target's distribution with that draft removed. Its own module so that what measures
a verify step's memory (measure.py) runs it as the engine does without importing the speculator."""

import math

import mlx.core as mx

from deployments.engines.sampling import RowSampling, filtered


def accept(logprobs: mx.array, drafts: mx.array, lengths: mx.array | list[int], settings: list[RowSampling]) -> tuple[mx.array, mx.array]:
    """Per row: how many of its drafts the target accepts, and the token after them.
    `logprobs`: [rows, K + 1, vocab], position j predicting the token after input j; `drafts`:
    [rows, K], of which the first `lengths[i]` are row i's (the rest are rejected)."""
    rows, width, vocab = logprobs.shape
    depth = width - 1
    valid = mx.arange(depth)[None, :] < mx.array(lengths)[:, None]  # (an mx.array stays itself)
    greedy = [s.temperature == 0 for s in settings]
    target = mx.argmax(logprobs, axis=-1)  # [rows, K + 1]
    if all(greedy):
        agree = (target[:, :depth] == drafts) & valid
        accepted = mx.cumprod(agree.astype(mx.int32), axis=-1).sum(axis=-1)
        return accepted, mx.take_along_axis(target, accepted[:, None], axis=-1)[:, 0]
    flat = filtered(logprobs.reshape(rows * width, vocab), [s for s in settings for _ in range(width)]).reshape(rows, width, vocab)
    inverse_t = mx.array([1 / s.temperature if s.temperature else 1.0 for s in settings], dtype=mx.float32)[:, None, None]
    scores = flat.astype(mx.float32) * inverse_t
    probs = mx.softmax(scores, axis=-1)
    p_draft = mx.take_along_axis(probs[:, :depth, :], drafts[..., None], axis=-1)[..., 0]  # [rows, K]
    is_greedy = mx.array(greedy)[:, None]
    chance = mx.where(is_greedy, (target[:, :depth] == drafts).astype(mx.float32), p_draft)
    agree = (mx.random.uniform(shape=(rows, depth)) < chance) & valid
    accepted = mx.cumprod(agree.astype(mx.int32), axis=-1).sum(axis=-1)
    # a rejected draft's token is drawn from the residual: the target without that token
    removed = (mx.arange(vocab)[None, None, :] == drafts[..., None]) & valid[..., None]  # [rows, K, vocab]
    removed = mx.concatenate([removed, mx.zeros((rows, 1, vocab), dtype=mx.bool_)], axis=1)
    drawn = mx.argmax(mx.where(removed, -math.inf, scores) + mx.random.gumbel(shape=scores.shape), axis=-1)
    following = mx.where(is_greedy, target, drawn)
    return accepted, mx.take_along_axis(following, accepted[:, None], axis=-1)[:, 0]
