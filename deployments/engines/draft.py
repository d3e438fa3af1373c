"""The draft-model proposer of speculative decoding: a smaller model of the target's tokenizer, loaded
in the target's process (part of its instance: loaded, measured and evicted with it), that proposes
each speculating row's next tokens by greedy decoding.

Each row it drafts for has its own cache of the draft (mlx-lm's make_prompt_cache), which holds a
prefix of the row's tokens. Before proposing, the cache is brought to the row's tokens in the
target's cache (`batch.tokens`): positions it holds past what the target accepted (rejected drafts)
are trimmed (mlx-lm's trim_prompt_cache), the tokens it lacks (the row's prompt on its first
proposal, in chunks; a verify step's last accepted draft; the tokens of plain steps in between) are
fed, and then the token the row feeds next and each draft in turn, one forward a draft, the argmax
of each the next input (a deterministic proposal: the speculator's acceptance rule keeps the
target's distribution for sampled rows). The draft's tokens stay on the device until the k drafts
are evaluated together.

Only `max_rows` rows draft at once (the first to come; each draft forward runs one row); the others
take prompt lookup's proposals. A draft whose vocabulary differs from the target's, or whose cache
cannot be trimmed (a sliding window, an SSM state), is refused at load."""

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

import mlx.core as mx
import mlx_lm
from mlx_lm.models.cache import make_prompt_cache, trim_prompt_cache

from deployments.cache_shape import joined
from deployments.engines.measure import cache_shape
from deployments.engines.prefix_cache import sliceable
from deployments.estimate import estimate
from deployments.manifest import safetensors_bytes
from deployments.wire.measured import CacheShape, MeasuredMemory

logger = logging.getLogger(__name__)

FUSED = 8  # new tokens of a row fed with its first draft forward (more: fed before, untimed)


class DraftRefused(ValueError):
    """The draft cannot serve this target (its vocabulary, its cache)."""


@dataclass(eq=False)
class _Row:
    cache: list[Any]
    held: list[int] = field(default_factory=list)  # the tokens whose positions the cache holds, in order
    sure: int = 0  # ... of which this many are known to be the row's own (the rest: drafts, maybe rejected)
    fed: list[int] = field(default_factory=list)  # the host tokens of the last proposal's catch-up (not yet in held)


def check_vocab(target_name: str, target_tokenizer: Any, draft_name: str, draft_tokenizer: Any) -> None:
    """Refuse a draft whose tokenizer maps any token to another id than the target's."""
    mine, theirs = target_tokenizer.get_vocab(), draft_tokenizer.get_vocab()
    if mine == theirs:
        return
    differ = sum(1 for t, i in theirs.items() if mine.get(t) != i) + sum(1 for t in mine if t not in theirs)
    raise DraftRefused(
        f"draft model {draft_name} has another tokenizer than {target_name} ({len(theirs)} tokens against {len(mine)}, "
        f"{differ} of them differ): a draft must share its target's vocabulary"
    )


class Draft:
    """A loaded draft model and the caches of the rows it drafts for (MLX thread)."""

    def __init__(self, model: Any, name: str, vocab_size: int, max_rows: int = 4, chunk: int = 512, weight_bytes: int = 0):
        if max_rows < 1:
            raise ValueError(f"draft_rows must be at least 1, not {max_rows}")
        self.model, self.name = model, name
        self.vocab_size = vocab_size  # the target's: a draft id past it is never proposed
        self.max_rows = max_rows
        self.chunk = max(1, chunk)
        self.weight_bytes = weight_bytes
        self._rows: dict[int, _Row] = {}  # by the generator's uid
        self.forwards = 0  # draft forwards run (each one row, one token, past the catch-up)
        self.seconds = 0.0  # ... and their time

    @classmethod
    def load(cls, path: str, target_name: str, target_tokenizer: Any, vocab_size: int, max_rows: int = 4, chunk: int = 512) -> "Draft":
        """Load the draft at `path` (a folder, or on a Mac a hub id) and check it against the target."""
        model, tokenizer = mlx_lm.load(path)[:2]
        check_vocab(target_name, target_tokenizer, path, tokenizer)
        if not sliceable(make_prompt_cache(model)):
            kinds = sorted({type(c).__name__ for c in make_prompt_cache(model)})
            raise DraftRefused(f"draft model {path} caches with {', '.join(kinds)}; a draft needs a plain KV cache in every layer (it is trimmed)")
        weights = safetensors_bytes(path) if Path(path).is_dir() else 0
        logger.info("%s: draft model %s loaded (%.1f MiB), for up to %d rows", target_name, path, weights / 2**20, max_rows)
        return cls(model, path, vocab_size, max_rows, chunk, weights)

    def shape(self) -> CacheShape:
        """The draft's cache per sequence (measure.py's reading of real caches)."""
        return cache_shape(self.model, lambda: make_prompt_cache(self.model))

    def counted(self, measured: MeasuredMemory) -> MeasuredMemory:
        """The target's measured memory with the draft's cache of each sequence in its cache, measured
        and estimated from the folder (its weights are in the weights measured around both loads)."""
        folder = Path(self.name)
        estimated = measured.estimated_cache
        if estimated is not None and folder.is_dir():
            estimated = joined(estimated, estimate(folder).cache)
        weights = measured.estimated_weight_bytes + self.weight_bytes if measured.estimated_weight_bytes else 0
        return measured.model_copy(
            update={"cache": joined(measured.cache, self.shape()), "estimated_cache": estimated, "estimated_weight_bytes": weights}
        )

    # ---- rows ------------------------------------------------------------------------------
    def rows(self, uids: Sequence[int]) -> set[int]:
        """Which of the batch's rows draft: those that have a cache, then new ones while there is room."""
        mine = {u for u in uids if u in self._rows}
        for uid in uids:
            if len(mine) >= self.max_rows:
                break
            if uid not in mine:
                self._rows[uid] = _Row(make_prompt_cache(self.model))
                mine.add(uid)
        return mine

    def forget(self, uid: int) -> None:
        self._rows.pop(uid, None)

    def clear(self) -> None:
        self._rows.clear()

    # ---- proposing -------------------------------------------------------------------------
    def catch_up(self, uid: int, tokens: Sequence[int]) -> None:
        """Bring the row's cache to `tokens` (the row's tokens in the target's cache): rejected
        positions trimmed, a stretch of new tokens (a prompt) fed and evaluated chunk by chunk, up to
        FUSED of them left for `propose` to feed with its first forward."""
        row = self._rows[uid]
        n = len(row.held)
        same = row.sure
        while same < n and same < len(tokens) and row.held[same] == tokens[same]:
            same += 1
        if n > same:
            trim_prompt_cache(row.cache, n - same)
            del row.held[same:]
        start = same
        while len(tokens) - start > FUSED:
            step = min(self.chunk, len(tokens) - start)
            self.model(mx.array([tokens[start : start + step]]), cache=row.cache)
            mx.eval([c.state for c in row.cache])
            start += step
        row.held.extend(tokens[same:start])
        row.sure = len(row.held)
        row.fed = list(tokens[start:])

    def propose(self, uid: int, last: mx.array, k: int) -> mx.array:
        """`k` draft tokens ([k], on the device, not evaluated) to follow the row's caught-up tokens
        and `last` ([1], the token it feeds next)."""
        row = self._rows[uid]
        x = mx.concatenate([mx.array(row.fed, dtype=mx.int32), last.astype(mx.int32)])[None]
        out = []
        for _ in range(k):
            logits = self.model(x, cache=row.cache)[:, -1, : self.vocab_size]
            x = mx.argmax(logits, axis=-1, keepdims=True).astype(mx.int32)
            out.append(x[0])
        return mx.concatenate(out)

    def settle(self, uid: int, last: int, drafts: list[int]) -> None:
        """What the last proposal fed, on the host: the catch-up, the token `last` and every draft
        but the final one (never fed)."""
        row = self._rows[uid]
        row.held.extend([*row.fed, last, *drafts[:-1]])
        row.sure += len(row.fed)
        row.fed = []

    def timed(self, forwards: int, seconds: float) -> None:
        self.forwards += forwards
        self.seconds += seconds

    def nbytes(self) -> int:
        """The rows' draft caches' bytes."""
        return sum(c.nbytes for row in self._rows.values() for c in row.cache if getattr(c, "keys", None) is not None)


def proposals(draft: Draft, uids: list[int], tokens: list[list[int]], last: mx.array, depths: list[int]) -> tuple[list[list[int]], float]:
    """Each row's drafts (rows of `uids` at `depths`, 0: none) as host lists, and the seconds the
    draft took (its forwards, and the catch-up of rows it fell behind on: the steps it did not
    draft are paid for when it drafts again; waiting for `last` left out)."""
    mx.eval(last)
    started = time.perf_counter()
    for uid, t, k in zip(uids, tokens, depths, strict=True):
        if k:
            draft.catch_up(uid, t)
    made = [draft.propose(uid, last[i : i + 1], k) if k else None for i, (uid, k) in enumerate(zip(uids, depths, strict=True))]
    mx.eval([m for m in made if m is not None])
    seconds = time.perf_counter() - started
    hosted = [cast(list[int], m.tolist()) if m is not None else [] for m in made]
    ys = cast(list[int], last.tolist())
    for uid, y, d in zip(uids, ys, hosted, strict=True):
        if d:
            draft.settle(uid, y, d)
    draft.timed(sum(depths), seconds)
    return hosted, seconds
