"""How often each model is asked for (rule L4's demand): request counts per model that halve every
`half_life_s`, so what was asked for an hour ago counts a quarter of what is asked for now."""


class Demand:
    def __init__(self, half_life_s: float):
        self.half_life_s = half_life_s
        self._counts: dict[str, tuple[float, float]] = {}  # model -> (count, as of when)

    def add(self, model: str, n: float, now: float) -> None:
        self._counts[model] = (self.at(model, now) + n, now)

    def at(self, model: str, now: float) -> float:
        count, since = self._counts.get(model, (0.0, now))
        return count * 0.5 ** (max(0.0, now - since) / self.half_life_s)

    def snapshot(self, now: float) -> dict[str, float]:
        """Every model's count now; those decayed below 1/1000 of a request are forgotten."""
        counts = {m: self.at(m, now) for m in self._counts}
        for model in [m for m, v in counts.items() if v < 1e-3]:
            del self._counts[model], counts[model]
        return counts
