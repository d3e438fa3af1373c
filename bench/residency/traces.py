"""Request traces, seeded and deterministic: Zipf popularity, bursts, and a primary+utility workday."""

import math
import random
from dataclasses import dataclass

from bench.residency.catalog import LLMS, SMALL


@dataclass(frozen=True)
class Request:
    arrival: float
    model: str
    duration: float


KIND = {name: kind for name, kind, *_ in LLMS + SMALL}


def service_seconds(model: str, rng: random.Random) -> float:
    """How long a request keeps the instance busy once it starts."""
    kind = KIND[model]
    if kind in ("llm", "vlm"):
        return rng.lognormvariate(math.log(6.0), 0.6)
    if kind in ("embedding", "rerank"):
        return rng.uniform(0.02, 0.3)
    return rng.uniform(1.0, 4.0)  # stt, tts


def _zipf_weights(n: int, s: float) -> list[float]:
    return [1.0 / (rank**s) for rank in range(1, n + 1)]


def zipf(seed: int = 1, requests: int = 5000, rate_per_s: float = 0.8, s: float = 1.1) -> list[Request]:
    """Popularity ~ 1/rank^s over the whole catalog, ranks shuffled so big and small models mix."""
    rng = random.Random(seed)
    names = [n for n, *_ in LLMS + SMALL]
    rng.shuffle(names)
    weights = _zipf_weights(len(names), s)
    t, out = 0.0, []
    for _ in range(requests):
        t += rng.expovariate(rate_per_s)
        model = rng.choices(names, weights)[0]
        out.append(Request(t, model, service_seconds(model, rng)))
    return out


def bursts(seed: int = 2, hours: float = 2.0) -> list[Request]:
    """A light Zipf background, plus every ten minutes a batch job hitting three models at once."""
    rng = random.Random(seed)
    out = list(zipf(seed, requests=int(0.25 * hours * 3600), rate_per_s=0.25))
    llms = [n for n, *_ in LLMS]
    smalls = [n for n, *_ in SMALL]
    start = 300.0
    while start < hours * 3600:
        targets = rng.sample(llms, 2) + rng.sample(smalls, 1)
        for model in targets:
            for _ in range(rng.randint(20, 60)):
                t = start + rng.uniform(0, 60)
                out.append(Request(t, model, service_seconds(model, rng)))
        start += 600.0
    return sorted(out, key=lambda r: r.arrival)


WORKDAY_PRIMARY = "qwen2.5-32b-4bit"
WORKDAY_UTILITIES = ("nomic-embed", "bge-reranker-base", "whisper-small")


def workday(seed: int = 3, hours: float = 8.0) -> list[Request]:
    """One Mac, one person: a coding assistant on one primary LLM, RAG utilities (embed, rerank) and
    voice input all day; every ~40 minutes the user tries another model (7-30 GB) for a few minutes,
    then returns (the Lemonade discussion's workday)."""
    rng = random.Random(seed)
    end = hours * 3600
    out: list[Request] = []

    def stream(model: str, mean_gap: float, start: float = 0.0, stop: float = end) -> None:
        t = start
        while True:
            t += rng.expovariate(1.0 / mean_gap)
            if t >= stop:
                return
            out.append(Request(t, model, service_seconds(model, rng)))

    stream(WORKDAY_PRIMARY, 20.0)
    stream("nomic-embed", 4.0)
    stream("bge-reranker-base", 8.0)
    stream("whisper-small", 120.0)
    others = [n for n, kind, gb, *_ in LLMS if gb <= 30 and n != WORKDAY_PRIMARY]
    t = 1200.0
    while t < end:
        stream(rng.choice(others), 10.0, start=t, stop=t + rng.uniform(120, 480))
        t += rng.uniform(1800, 3000)
    return sorted(out, key=lambda r: r.arrival)
