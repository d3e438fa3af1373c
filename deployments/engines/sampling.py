"""One sampling call per engine step, whatever mix of sampling settings the batch's rows carry.

mlx-lm's GenerationBatch samples its batch in one call only when every row holds the *same* sampler
object; otherwise it calls each row's own sampler on a one-row slice and concatenates the results:
a batch of 64 rows with two settings (a greedy client beside a sampling one) ran 64 sampler calls a
step (issue 11: per-request samplers cost 0.64-0.80x of the tokens/s on an H200 at 16 streams).

`BatchSampler` is that one object for every row of an engine's BatchGenerator. It keeps each row's
settings by the generator's uid and samples the whole batch at once with per-row temperature,
top-p, min-p and top-k as arrays. A seeded row draws its noise from its own key, so its tokens do
not depend on which other requests share the batch.

The three filters are thresholds on the row's log-probabilities, each computed from the same sorted
copy: top-p keeps the smallest set of the most likely tokens whose mass reaches p (as mlx-lm's
`apply_top_p`), min-p keeps tokens at least `min_p` times the top token's probability (as
`apply_min_p`), top-k keeps tokens at least as likely as the k-th (as `apply_top_k`, except that a
tie at the k-th keeps every tied token). Each removes only tokens below its threshold, so applying
them one after another, as mlx-lm does, equals removing what lies below the highest of the three.
A token is then drawn by the Gumbel-max trick (`argmax(logits / T + Gumbel noise)`), which is
exactly a categorical draw. Runs on the engine's MLX thread, like everything holding MLX arrays."""

import math
import sys
from dataclasses import dataclass

import mlx.core as mx


@dataclass(frozen=True)
class RowSampling:
    """One request's sampling settings, normalised: temperature 0 is greedy; top_p 1, min_p 0 and
    top_k 0 are off (a top_k at or past the vocabulary keeps every token, so it is off too)."""

    temperature: float = 0.0
    top_p: float = 1.0
    min_p: float = 0.0
    top_k: int = 0
    seed: int | None = None

    @classmethod
    def of(cls, temperature: float, top_p: float, min_p: float, top_k: int, seed: int | None, vocab: int | None) -> "RowSampling":
        if temperature == 0:
            return cls()
        if vocab and top_k >= vocab:
            top_k = 0
        return cls(temperature, top_p if 0 < top_p < 1 else 1.0, min_p, top_k, seed)


class _Row:
    """A row's settings and, for a seeded row, its PRNG key (split once per sampling call)."""

    __slots__ = ("settings", "key")

    def __init__(self, settings: RowSampling):
        self.settings = settings
        self.key = mx.random.key(settings.seed % 2**64) if settings.seed is not None else None  # OpenAI seeds may be negative


class BatchSampler:
    """The one sampler object of every row of a BatchGenerator (`insert(samplers=[it, ...])`); `add`
    each inserted uid's settings before the next step, `discard` it once the row has left.

    mlx-lm calls a shared sampler as `sampler(logprobs)` from `GenerationBatch._step`, with one row
    of logprobs per entry of that batch's `uids`, in order (the running batch, or a group that has
    just been prefilled and is about to join it). The rows' order is read there, from the calling
    batch, because it changes whenever rows join or leave; a caller without `uids` matching the
    logprobs is refused loudly (mlx-lm is pinned; tests/test_sampling.py pins this contract)."""

    def __init__(self) -> None:
        self._rows: dict[int, _Row] = {}
        self.calls = 0  # sampling calls made (one per batch stepped)
        self.rows_sampled = 0

    def add(self, uid: int, settings: RowSampling) -> None:
        self._rows[uid] = _Row(settings)

    def settings(self, uid: int) -> RowSampling:
        return self._rows[uid].settings

    def discard(self, uid: int) -> None:
        self._rows.pop(uid, None)

    def clear(self) -> None:
        self._rows.clear()

    def __len__(self) -> int:
        return len(self._rows)

    def __call__(self, logprobs: mx.array) -> mx.array:
        uids = _calling_batch_uids(logprobs.shape[0])
        self.calls += 1
        self.rows_sampled += len(uids)
        return sample(logprobs, [self._rows[uid] for uid in uids])


def _calling_batch_uids(rows: int) -> list[int]:
    """The uids of the GenerationBatch whose `_step` called the sampler (two frames up: its
    `__call__`, then `_step`)."""
    caller = sys._getframe(2).f_locals.get("self")
    uids = getattr(caller, "uids", None)
    if not isinstance(uids, list) or len(uids) != rows:
        raise RuntimeError(f"BatchSampler was called by {type(caller).__name__}, not by a batch of {rows} rows with uids (mlx-lm changed?)")
    return uids


def sample(logprobs: mx.array, rows: list[_Row]) -> mx.array:
    """One token per row of `logprobs` ([rows, vocab], normalised log-probabilities), each by its own
    settings, in one batched computation (a seeded row adds a draw of noise from its own key)."""
    settings = [r.settings for r in rows]
    greedy = [s.temperature == 0 for s in settings]
    if all(greedy):
        return mx.argmax(logprobs, axis=-1)
    inverse_t = mx.array([1 / s.temperature if s.temperature else 1.0 for s in settings], dtype=mx.float32)[:, None]
    noise = mx.random.gumbel(shape=logprobs.shape)  # the global PRNG: unseeded rows promise no sequence
    seeded, own = [], []
    for i, row in enumerate(rows):
        if row.key is not None:
            row.key, step = mx.random.split(row.key)
            seeded.append(i)
            own.append(mx.random.gumbel(shape=(1, logprobs.shape[-1]), key=step))
    if seeded:
        noise[mx.array(seeded)] = mx.concatenate(own)
    drawn = mx.argmax(filtered(logprobs, settings) * inverse_t + noise, axis=-1)
    if any(greedy):
        drawn = mx.where(mx.array(greedy), mx.argmax(logprobs, axis=-1), drawn)
    return drawn


def filtered(logprobs: mx.array, settings: list[RowSampling]) -> mx.array:
    """`logprobs` with what each row's top-p, min-p and top-k remove set to -inf. Only the rows that
    use top-p or top-k are sorted."""
    threshold = _sorted_thresholds(logprobs, settings)
    if any(s.min_p for s in settings):
        floor = mx.array([math.log(s.min_p) if s.min_p else -math.inf for s in settings], dtype=mx.float32)[:, None]
        by_min_p = mx.max(logprobs, axis=-1, keepdims=True) + floor
        threshold = by_min_p if threshold is None else mx.maximum(threshold, by_min_p)
    return logprobs if threshold is None else mx.where(logprobs < threshold, -math.inf, logprobs)


def _sorted_thresholds(logprobs: mx.array, settings: list[RowSampling]) -> mx.array | None:
    """Per row ([rows, 1]), the highest of its top-p and top-k thresholds (-inf where neither is on),
    from one sort of the rows that need one; None when no row does."""
    rows = [i for i, s in enumerate(settings) if s.top_p < 1 or s.top_k]
    if not rows:
        return None
    chosen = [settings[i] for i in rows]
    vocab = logprobs.shape[-1]
    ascending = mx.sort(logprobs if len(rows) == len(settings) else logprobs[mx.array(rows)], axis=-1)
    top_p = mx.array([s.top_p for s in chosen], dtype=mx.float32)[:, None]
    probs = mx.exp(ascending.astype(mx.float32))
    mass_above = mx.cumsum(probs, axis=-1, reverse=True, inclusive=False)
    total = mass_above[:, :1] + probs[:, :1]
    dropped = (mass_above >= top_p * total).sum(axis=-1, keepdims=True)
    by_p = mx.where(top_p < 1, mx.take_along_axis(ascending, dropped, axis=-1), -math.inf)
    kth = mx.array([vocab - s.top_k if s.top_k else 0 for s in chosen])[:, None]  # off: the smallest, which removes nothing
    threshold = mx.maximum(by_p, mx.take_along_axis(ascending, kth, axis=-1)).astype(logprobs.dtype)
    if len(rows) == len(settings):
        return threshold
    every = mx.full((len(settings), 1), -math.inf, dtype=logprobs.dtype)
    every[mx.array(rows)] = threshold
    return every
