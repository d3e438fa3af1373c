"""What joins an LLM engine's batch, and when: admission, grouping, prefix alignment, and the
interleave of prefill chunks with decode steps. Pure decisions on plain data (token lists, counts,
step numbers): no MLX, no threads, no clock; the engine's MLX thread asks and acts.

- Arrivals are held while the batch decodes (`admit_now`): up to `admit_hold_steps` steps, until a
  prefill group of `prefill_batch` waits, or until `admit_quiet_steps` steps pass with no arrival;
  an idle batch, or one with fewer than `admit_hold_min_rows` rows, admits at once. Each group costs
  mlx-lm a prefill and a merge into the batch, two synchronous evaluations.
- A group (`choose`) keeps at most `max_prefill_tokens` prompt tokens admitted and not yet
  prefilled (one longer prompt joins alone), is cut where right-padding its prefill to its longest
  uncached prompt would cost more than `prefill_pad_ratio` times its rows' own tokens, and leaves
  for later an arrival that begins like a prompt being prefilled now (`share_prefill`: it waits a
  step or two for those blocks instead of prefilling them again beside it).
- Within a group every row prefills the same number of tokens (`prefill_align`): the group's
  longest uncached prompt, when that fits one prefill chunk.
- While rows decode, a prefill chunk runs only every `prefill_decode_steps` + 1 steps (`prefill_now`).
- The batch's KV stays within the instance's KV reservation (`KVBudget`; docs/residency.md, M4): an
  arrival joins only when the batch's rows, each at the most tokens it may reach (its prompt and its
  max_tokens, within the engine's context), fit the reservation together; otherwise it waits at the
  head of the queue and nothing behind it joins before it (first in, first out: a long request is
  never overtaken by shorter ones while it waits for room). A running row never grows past its
  bound, so decode needs no check. One that could not fit even alone is refused.

docs/engines.md gives the measurements behind each setting (options.py: the served defaults)."""

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Generic, Protocol, TypeVar


class SchedulingSettings(Protocol):
    """The settings the scheduler reads, live (an engine is one; `Settings` the plain one)."""

    prefill_batch: int
    admit_hold_steps: int
    admit_quiet_steps: int
    admit_hold_min_rows: int
    max_prefill_tokens: int
    prompt_cache_min_tokens: int
    prefill_pad_ratio: float
    prefill_align: bool
    share_prefill: bool
    prefix_block_tokens: int
    prefill_decode_steps: int

    @property
    def prefill_chunk(self) -> int: ...


@dataclass
class Settings:
    """Scheduling settings as plain data, with the engine's defaults (options.py)."""

    prefill_batch: int = 32
    admit_hold_steps: int = 4
    admit_quiet_steps: int = 1
    admit_hold_min_rows: int = 0
    max_prefill_tokens: int = 1024
    prompt_cache_min_tokens: int = 256
    prefill_pad_ratio: float = 2.0
    prefill_align: bool = True
    share_prefill: bool = True
    prefix_block_tokens: int = 128
    prefill_decode_steps: int = 0
    prefill_chunk: int = 512


class Waiting(Protocol):
    """An arrival as the scheduler sees it: its id, its prompt, the most tokens it may generate,
    and the step it arrived at."""

    rid: int
    tokens: list[int]
    step: int

    @property
    def max_tokens(self) -> int: ...


@dataclass(frozen=True)
class KVBudget:
    """The KV reservation a batch is held to (M4). mlx-lm's batch cache is as long as its longest
    row for every row (shorter rows are left-padded), so a batch of rows whose longest reaches T
    tokens holds `rows x sequence_bytes(T)`. `context_tokens`: the most tokens one row may hold (the
    engine's context, within one of reserve_concurrency shares); `sequence_bytes`: one row's cache
    at a length (MeasuredMemory.sequence_bytes: buffers in mlx-lm's steps, windows, fixed state);
    `overshoot`: positions the batch cache may run past its longest row (a speculative verify step
    runs every row's drafts in before it trims the rejected ones)."""

    reserved_bytes: int
    context_tokens: int
    sequence_bytes: Callable[[int], int]
    overshoot: int = 0

    def row_tokens(self, prompt_tokens: int, max_tokens: int) -> int:
        """The most tokens a row holds: its prompt and what it may generate, within the context."""
        return min(prompt_tokens + max_tokens, self.context_tokens)

    def batch_bytes(self, rows: list[int]) -> int:
        """The KV a batch of rows reaching `rows` tokens each holds at most."""
        return len(rows) * self.sequence_bytes(max(rows) + self.overshoot) if rows else 0

    def fits(self, rows: list[int]) -> bool:
        return self.batch_bytes(rows) <= self.reserved_bytes


A = TypeVar("A", bound=Waiting)


@dataclass
class Group(Generic[A]):
    """The arrivals that join the batch together, in order. `align`: the tokens each row prefills
    (None: each its own); `matched`: request id -> the tokens the prefix cache holds of it."""

    arrivals: list[A] = field(default_factory=list)
    align: int | None = None
    matched: dict[int, int] = field(default_factory=dict)
    refused: list[A] = field(default_factory=list)  # could never fit the KV reservation, even alone (M4)


class Scheduler(Generic[A]):
    """The held arrivals and the prefills in flight, and the decisions on them (module docstring)."""

    def __init__(self, settings: SchedulingSettings, kv: KVBudget | None = None):
        self.settings = settings
        self.kv = kv  # None: no KV reservation holds the batch (reserve_context_tokens 0)
        self.held: deque[A] = deque()  # prepared arrivals waiting to join the batch
        self.prefilling: dict[int, int] = {}  # request id -> prompt tokens it still prefills
        self.rows: dict[int, int] = {}  # request id -> the most tokens its row may hold (KVBudget.row_tokens)
        self.due = False  # held arrivals of a group already let in, waiting only for prefill room
        self.steps = 0  # the engine's steps so far
        self.last_arrival = 0  # the step count when the last arrival came
        self._decode_only = settings.prefill_decode_steps  # decode-only steps since the last chunk
        # groups admitted, the held steps of their rows; uncached prompt tokens of the groups and
        # what their right-padded prefill runs (rows x the longest row's); cached tokens a group's
        # rows gave back to prefill alike (prefill_align), and the rows that still prefilled ragged
        self.stats = {
            "admitted_groups": 0,
            "admitted_requests": 0,
            "held_steps": 0,
            "group_prompt_tokens": 0,
            "group_padded_tokens": 0,
            "aligned_tokens": 0,
            "ragged_rows": 0,
            "kv_waits": 0,  # choices that stopped at an arrival whose KV would pass the reservation (one a step while it waits)
        }

    # ---- arrivals ----------------------------------------------------------------------------
    def arrive(self, arrival: A) -> None:
        arrival.step = self.last_arrival = self.steps
        self.held.append(arrival)

    def withdraw(self, rid: int) -> A | None:
        """A held arrival taken back (cancelled before it joined), or None when none is held."""
        arrival = next((a for a in self.held if a.rid == rid), None)
        if arrival is not None:
            self.held.remove(arrival)
            self.due = self.due and bool(self.held)
        return arrival

    def admit_now(self, decoding_rows: int) -> bool:
        """Whether the held arrivals join the batch now: at once when it is idle (or has fewer than
        admit_hold_min_rows rows), else when they fill a prefill group, the oldest has waited
        admit_hold_steps steps, or none has arrived for admit_quiet_steps steps (waiting longer
        would not grow the group)."""
        s = self.settings
        if not self.held:
            return False
        busy = decoding_rows >= max(1, s.admit_hold_min_rows)
        if not busy or self.due or len(self.held) >= s.prefill_batch:
            return True
        return self.steps - self.held[0].step >= s.admit_hold_steps or self.steps - self.last_arrival >= s.admit_quiet_steps

    def choose(self, match: Callable[[list[int]], int] | None, prefill_tokens: Callable[[int], list[int] | None]) -> Group[A]:
        """The group that joins now, taken from the held arrivals in order, as far as
        max_prefill_tokens allows (the rest wait for the prefills in flight). `match`: how many
        leading tokens of a prompt the block prefix cache holds (None: no block cache);
        `prefill_tokens`: the prompt of a request being prefilled, by its id."""
        s = self.settings
        prefilling = sum(self.prefilling.values())
        widest = useful = 0  # the group's longest and total uncached prompt tokens
        later: list[A] = []  # left for a later group, ahead of the rest
        cut = match is not None and s.prefill_pad_ratio > 0
        group: Group[A] = Group()
        kv = self.kv
        bounds = list(self.rows.values())  # the rows' KV bounds, the group's included as it forms
        while self.held:
            arrival = self.held[0]
            rest = len(arrival.tokens)
            bound = kv.row_tokens(rest, arrival.max_tokens) if kv is not None else 0
            if kv is not None and not kv.fits([*bounds, bound]):
                if kv.fits([bound]):  # it waits for room, first in line: nothing behind it joins first
                    self.stats["kv_waits"] += 1
                    break
                group.refused.append(self.held.popleft())  # it could never fit, even alone
                continue
            if match is not None:
                cached = group.matched[arrival.rid] = match(arrival.tokens)
                rest -= cached if cached >= s.prompt_cache_min_tokens else 0
                if s.share_prefill and self._prefilled_beside(arrival.tokens, cached, prefill_tokens, group.arrivals):
                    later.append(self.held.popleft())
                    continue
            if prefilling and prefilling + rest > s.max_prefill_tokens:
                break  # the rest of this group joins as soon as there is room: it waits no more
            joined = len(group.arrivals)
            padded = max(widest, rest) * (joined + 1)  # what the group's prefill would run with this one
            if cut and joined and padded > s.prefill_pad_ratio * (useful + rest) and padded - useful - rest > s.prompt_cache_min_tokens:
                later.append(self.held.popleft())
                continue
            group.arrivals.append(self.held.popleft())
            bounds.append(bound)
            prefilling += rest
            widest, useful = max(widest, rest), useful + rest
        self.held.extendleft(reversed(later))
        self.due = bool(self.held)
        joined = len(group.arrivals)
        # rows align only within one prefill chunk: past it, mlx-lm gives a shorter row its first
        # token as soon as its own tokens are through, chunks before the longest's
        if match is not None and s.prefill_align and joined > 1 and widest <= s.prefill_chunk:
            group.align = max(1, widest)
        if joined:
            self.stats["admitted_groups"] += 1
            self.stats["admitted_requests"] += joined
            self.stats["group_prompt_tokens"] += useful
            self.stats["group_padded_tokens"] += widest * joined
        return group

    def _prefilled_beside(self, tokens: list[int], cached: int, prefill_tokens: Callable[[int], list[int] | None], group: list[A]) -> bool:
        """Whether a prompt being prefilled now, or joining the group being formed, shares at least
        a block of `tokens` past what the cache holds: then waiting for its blocks costs a step or
        two, prefilling them again far more."""
        size = self.settings.prefix_block_tokens
        if len(tokens) - cached <= size:
            return False
        ahead = tokens[cached : cached + size]
        for rid in self.prefilling:
            other = prefill_tokens(rid)
            if other is not None and other[cached : cached + size] == ahead:
                return True
        return any(a.tokens[cached : cached + size] == ahead for a in group)

    def joined(self, group: Group[A], arrival: A, cached: int) -> None:
        """`arrival` of `group` is in the batch with `cached` tokens from the prefix cache."""
        uncached = self.prefilling[arrival.rid] = len(arrival.tokens) - cached
        if self.kv is not None:
            self.rows[arrival.rid] = self.kv.row_tokens(len(arrival.tokens), arrival.max_tokens)
        self.stats["held_steps"] += self.steps - arrival.step
        if group.align is not None:
            self.stats["ragged_rows"] += uncached != group.align
            # what the row would have reused unaligned (at least one token is left to prefill)
            alone = min(group.matched[arrival.rid], len(arrival.tokens) - 1)
            self.stats["aligned_tokens"] += max(0, alone - cached) if alone >= self.settings.prompt_cache_min_tokens else 0

    # ---- steps -------------------------------------------------------------------------------
    def prefix_limit(self, tokens: int, align: int | None) -> int:
        """How many of a prompt's `tokens` its prefix cache may give back: all but the last (its
        logits start the answer), or with `align` as many as leave that many to prefill, while the
        prefix stays at least prompt_cache_min_tokens."""
        if align is not None and tokens - align >= max(1, self.settings.prompt_cache_min_tokens):
            return tokens - align
        return tokens - 1

    def prefill_now(self, rows: int) -> bool:
        """Whether this step prefills a chunk (`rows`: the batch's rows, prefilling or decoding):
        always when no row decodes or none prefills, else once prefill_decode_steps steps have only
        decoded since the last chunk."""
        decoding = rows > len(self.prefilling)
        if not self.prefilling or not decoding or self._decode_only >= self.settings.prefill_decode_steps:
            self._decode_only = 0 if self.prefilling else self.settings.prefill_decode_steps
            return True
        self._decode_only += 1
        return False

    def answered(self, rid: int) -> None:
        """A row made its first token: its prefill is done."""
        self.prefilling.pop(rid, None)

    def left(self, rid: int) -> None:
        """A row left the batch (finished, cancelled): its KV is free for the next arrivals."""
        self.prefilling.pop(rid, None)
        self.rows.pop(rid, None)

    def reset(self) -> None:
        """The batch is gone (a broken step): no row prefills or holds KV."""
        self.prefilling.clear()
        self.rows.clear()
