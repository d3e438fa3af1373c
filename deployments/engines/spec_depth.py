"""How many draft tokens each row verifies in a step: from its recent acceptance and what a wider
forward costs at this batch size, down to 0 when speculation would cost more than it saves.
Pure decisions on plain numbers (no MLX, no clock: the engine passes the seconds it measured).

A verify step runs every row of the batch with its last token and K draft tokens (rows with fewer
drafts are padded to K; what is padded is rejected): B x (K + 1) tokens in one forward where a plain
step runs B. A row whose drafts are accepted at rate a (each draft independently, the usual model)
makes 1 + a + a^2 + ... + a^k tokens per step with k drafts instead of 1. The step's time is
modelled as `fixed + per_token x tokens in the forward`, fitted to the steps the engine measured
(plain and verify, exponentially forgetting), starting from `prior_token_cost` (per_token / fixed).
With a draft model (draft.py) a row it drafts for costs its K draft forwards too: one draft forward's
seconds (measured, starting from `prior_draft_cost` of a one-row plain step; until the fit has
points enough, over the measured seconds of one unit of the prior's cost) is added to the step's
cost per draft token. The depth K is the one whose expected tokens per second is highest,
if it beats a plain step by `min_gain`; else 0."""

import math
from collections import Counter
from dataclasses import dataclass, field


@dataclass
class Choice:
    """The depth chosen for a step: K (0: a plain step), each row's drafts (at most K), and why."""

    depth: int
    drafts: list[int]
    why: str  # "speculate", "no_drafts", "cost"
    gain: float = 1.0  # the expected tokens/s ratio against a plain step


@dataclass
class _Fit:
    """Decayed least squares of seconds against forward tokens."""

    decay: float
    sums: list[float] = field(default_factory=lambda: [0.0] * 5)  # w, x, y, xx, xy

    def add(self, x: float, y: float) -> None:
        w, sx, sy, sxx, sxy = (s * self.decay for s in self.sums)
        self.sums = [w + 1, sx + x, sy + y, sxx + x * x, sxy + x * y]

    def line(self) -> tuple[float, float] | None:
        """(fixed, per_token) seconds, or None until the points spread enough to fit."""
        w, sx, sy, sxx, sxy = self.sums
        if w < 4:
            return None
        var = sxx / w - (sx / w) ** 2
        if var <= (0.1 * sx / w) ** 2:  # the x's barely differ: a slope would be noise
            return None
        slope = (sxy / w - sx * sy / w / w) / var
        fixed = sy / w - slope * sx / w
        if slope < 0 or fixed <= 0:
            return None
        return fixed, slope


class Depth:
    """Per-row acceptance and the batch's step cost, and the choice of depth from them."""

    def __init__(
        self,
        max_drafts: int = 8,
        prior_acceptance: float = 0.5,
        prior_token_cost: float = 0.1,
        min_gain: float = 1.05,
        memory: float = 0.7,
        recovery: float = 0.02,
        fixed: int | None = None,
        prior_draft_cost: float = 0.3,
    ):
        self.max_drafts = max_drafts
        self.prior_acceptance = prior_acceptance
        self.prior_token_cost = prior_token_cost  # a token's share of a one-token forward's fixed cost, until measured
        self.min_gain = min_gain
        self.memory = memory  # a row's acceptance: this much of the old estimate kept at each step
        self.recovery = recovery  # ... and this much of its distance to the prior regained at each step it does not speculate
        self.fixed = fixed  # a depth to use whenever a row has drafts, whatever it costs (comparisons, tests)
        self.acceptance: dict[int, float] = {}  # by row id
        self._fit = _Fit(decay=0.98)
        self.prior_draft_cost = prior_draft_cost  # a draft forward as a share of a one-row plain step, until measured
        self._unit_s: float | None = None  # seconds per unit of the step-cost model (decayed mean)
        self._draft_s: float | None = None  # seconds of one draft forward (decayed mean)

    def forget(self, row: int) -> None:
        self.acceptance.pop(row, None)

    def observe_step(self, forward_tokens: int, seconds: float) -> None:
        """A decode step's wall time, plain (forward_tokens = rows) or verifying (rows x (K + 1))."""
        if forward_tokens > 0 and seconds > 0:
            self._unit_s = _mean(self._unit_s, seconds / (1.0 + self.prior_token_cost * forward_tokens))  # the prior's units
            self._fit.add(forward_tokens, seconds)

    def observe_draft(self, forwards: int, seconds: float) -> None:
        """A step's draft forwards (one row, one token each) and their wall time."""
        if forwards > 0 and seconds > 0:
            self._draft_s = _mean(self._draft_s, seconds / forwards)

    def _line(self) -> tuple[float, float]:
        fit = self._fit.line()
        return fit if fit is not None else (1.0, self.prior_token_cost)

    def draft_cost(self) -> float:
        """One draft forward in units of the step-cost model."""
        fit = self._fit.line()
        if fit is not None:  # the model's units are seconds
            return self._draft_s if self._draft_s is not None else self.prior_draft_cost * sum(fit)
        if self._draft_s is None or self._unit_s is None:
            return self.prior_draft_cost * (1.0 + self.prior_token_cost)
        return self._draft_s / self._unit_s

    def observe_row(self, row: int, proposed: int, accepted: int) -> None:
        if proposed <= 0:
            return
        rate = accepted / proposed
        old = self.acceptance.get(row, self.prior_acceptance)
        self.acceptance[row] = self.memory * old + (1 - self.memory) * rate

    def step_cost(self, rows: int, depth: int, draft_forwards: int = 0) -> float:
        """A verify step's time with `depth` drafts a row (and `draft_forwards` of a draft model), as
        a multiple of a plain step's."""
        fixed, per_token = self._line()
        drafting = draft_forwards * self.draft_cost() if draft_forwards else 0.0
        return (fixed + per_token * rows * (depth + 1) + drafting) / (fixed + per_token * rows)

    def hopeless(self, rows: list[int], drafted: int = 0) -> bool:
        """Whether no depth would pay for these rows even with every draft available (checked before
        proposing, every step of a full batch: rows of one acceptance are counted together, most
        of them at the prior; `drafted` of them by a draft model). A row's acceptance, and a draft
        forward's measured time, drift back towards their priors at each such check, so a row
        that stopped speculating tries again later."""
        if self.fixed is not None:
            return False
        if drafted and self._draft_s is not None:  # ... and a draft once measured slow is tried again later
            fit = self._fit.line()
            one = sum(fit) if fit is not None else (1.0 + self.prior_token_cost) * (self._unit_s or 0.0)  # a one-row plain step, seconds
            self._draft_s += self.recovery / 4 * (self.prior_draft_cost * one - self._draft_s)  # (its retry costs a catch-up)
        alike: Counter[float] = Counter()
        for r in rows:
            a = self.acceptance.get(r)
            if a is not None:
                a = self.acceptance[r] = a + self.recovery * (self.prior_acceptance - a)
            alike[self.prior_acceptance if a is None else a] += 1
        n = len(rows)
        for depth in range(1, self.max_drafts + 1):
            made = sum(count * _expected(a, depth) for a, count in alike.items())
            if made / n / self.step_cost(n, depth, drafted * depth) >= self.min_gain:
                return False
        return True

    def choose(self, rows: list[int], available: list[int], by_draft: list[bool] | None = None) -> Choice:
        """The depth for a step of these rows (ids), each with `available` draft tokens (`by_draft`:
        whether a draft model makes them, one forward a token)."""
        drafted = by_draft or [False] * len(rows)
        if not any(available):
            return Choice(0, [0] * len(rows), "no_drafts")
        n = len(rows)
        if self.fixed is not None:
            depth = min(self.fixed, max(available))
            return Choice(depth, [min(a, depth) for a in available], "speculate")
        best, best_gain = 0, 1.0
        for depth in range(1, min(self.max_drafts, max(available)) + 1):
            made = sum(_expected(self.acceptance.get(r, self.prior_acceptance), min(a, depth)) for r, a in zip(rows, available, strict=True))
            forwards = sum(min(a, depth) for a, d in zip(available, drafted, strict=True) if d)
            gain = made / n / self.step_cost(n, depth, forwards)
            if gain > best_gain:
                best, best_gain = depth, gain
        if best == 0 or best_gain < self.min_gain:
            return Choice(0, [0] * n, "cost", best_gain)
        return Choice(best, [min(a, best) for a in available], "speculate", best_gain)


def _expected(acceptance: float, drafts: int) -> float:
    """Tokens a row makes in one step with `drafts` drafts, each accepted at `acceptance`."""
    a = min(max(acceptance, 0.0), 1.0)
    if a >= 1.0:
        return drafts + 1.0
    return (1 - math.pow(a, drafts + 1)) / (1 - a)


def _mean(old: float | None, new: float, keep: float = 0.8) -> float:
    return new if old is None else keep * old + (1 - keep) * new
