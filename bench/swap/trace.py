"""The swap benchmark's workload and its numbers, the same for every server: the seeded trace
(open-loop arrivals, Zipf popularity, one burst), the client that replays it over streamed chat
completions, and the summary of what came back. No server and no Ray here."""

import asyncio
import json
import random
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import aiohttp

from bench.sse import Chunks

TOPICS = ("a lighthouse", "a fox", "the moon", "a train", "an orchard", "a storm", "a violin", "a glacier")


@dataclass(frozen=True)
class Request:
    index: int
    model: str
    at_s: float  # scheduled arrival, seconds after the trace starts
    burst: bool
    prompt: str


@dataclass
class Outcome:
    index: int
    model: str
    burst: bool
    at_s: float  # scheduled arrival
    sent_s: float  # when it got a client slot and was sent (>= at_s: the semaphore's queue)
    ok: bool
    error: str
    first_token_s: float | None  # from the scheduled arrival: a wait for a slot counts
    total_s: float  # from the scheduled arrival to the end of the stream
    tokens: int  # completion tokens, from the stream's usage


def zipf_weights(n: int, s: float) -> list[float]:
    raw = [1.0 / (rank**s) for rank in range(1, n + 1)]
    return [w / sum(raw) for w in raw]


def build(models: list[str], requests: int, seconds: float, burst: int, burst_at: float, zipf_s: float, seed: int) -> list[Request]:
    """`requests` Poisson arrivals over `seconds` (given their count, a Poisson process's arrival
    times are that many uniform draws, sorted), each for a model drawn with Zipf(s) popularity
    (models[0] the most popular), plus `burst` requests for the least popular model (models[-1]),
    all at `burst_at` x seconds. Sorted by arrival; the same arguments give the same trace."""
    rng = random.Random(seed)
    times = sorted(rng.uniform(0.0, seconds) for _ in range(requests))
    weights = zipf_weights(len(models), zipf_s)
    picks = rng.choices(models, weights=weights, k=requests)
    items = [(t, m, False) for t, m in zip(times, picks, strict=True)]
    items += [(round(burst_at * seconds, 3), models[-1], True)] * burst
    items.sort(key=lambda x: x[0])
    return [
        Request(i, m, round(t, 3), b, f"Tell me a short story about {TOPICS[rng.randrange(len(TOPICS))]} (request {i}).")
        for i, (t, m, b) in enumerate(items)
    ]


async def one(session: aiohttp.ClientSession, url: str, r: Request, max_tokens: int, t0: float, slots: asyncio.Semaphore) -> Outcome:
    """Wait for the request's arrival, then for a client slot, then stream it."""
    await asyncio.sleep(max(0.0, t0 + r.at_s - time.monotonic()))
    arrival = t0 + r.at_s
    body = {
        "model": r.model,
        "messages": [{"role": "user", "content": r.prompt}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    first: float | None = None
    tokens = 0
    error = ""
    async with slots:
        sent = time.monotonic()
        try:
            async with session.post(url, json=body) as response:
                if response.status != 200:
                    text = await response.text()
                    try:
                        error = (
                            f"HTTP {response.status} {json.loads(text)['error'].get('code')}: {json.loads(text)['error'].get('message', '')[:200]}"
                        )
                    except (ValueError, KeyError, TypeError, AttributeError):
                        error = f"HTTP {response.status}: {text[:200]}"
                else:
                    chunks = Chunks(response.content)
                    async for chunk in chunks:
                        if "error" in chunk:
                            error = f"stream error: {str(chunk['error'])[:200]}"
                            break
                        choices = chunk.get("choices") or []
                        if first is None and choices and (choices[0].get("delta") or {}).get("content"):
                            first = time.monotonic() - arrival
                        if chunk.get("usage"):
                            tokens = int(chunk["usage"].get("completion_tokens") or 0)
                    if not error and not chunks.done:
                        error = "stream ended without [DONE]"
        except (TimeoutError, aiohttp.ClientError) as e:
            error = f"client: {type(e).__name__}: {e}"[:200]
    ok = not error
    return Outcome(
        r.index,
        r.model,
        r.burst,
        r.at_s,
        round(sent - t0, 3),
        ok,
        error,
        None if first is None or not ok else round(first, 4),
        round(time.monotonic() - arrival, 4),
        tokens if ok else 0,
    )


async def replay(
    base: str | list[str],
    trace: list[Request],
    clients: int,
    max_tokens: int,
    poll: Callable[[aiohttp.ClientSession], Awaitable[None]] | None = None,
    poll_every_s: float = 1.0,
    timeout_s: float = 600.0,
) -> tuple[list[Outcome], float, float]:
    """The trace against `base`, at most `clients` requests in flight; `poll(session)` is called
    every `poll_every_s` while it runs and once after (the server's own record: events, status).
    Several bases (a cluster's nodes' own URLs): request i goes to base i mod their count.
    Returns (outcomes in trace order, t0 on time.monotonic's clock, wall seconds to the last end)."""
    slots = asyncio.Semaphore(clients)
    timeout = aiohttp.ClientTimeout(total=timeout_s)
    headers = {"Authorization": "Bearer unused"}
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0), timeout=timeout, headers=headers) as session:

        async def poller() -> None:
            assert poll is not None
            while True:
                try:
                    await poll(session)
                except (TimeoutError, aiohttp.ClientError) as e:
                    print(f"  poll: {type(e).__name__}: {e}", flush=True)
                await asyncio.sleep(poll_every_s)

        t0 = time.monotonic() + 0.5  # the tasks are made before the first arrival
        task = asyncio.create_task(poller()) if poll is not None else None
        bases = [base] if isinstance(base, str) else base
        urls = [f"{b}/v1/chat/completions" for b in bases]
        outcomes = await asyncio.gather(*(one(session, urls[r.index % len(urls)], r, max_tokens, t0, slots) for r in trace))
        wall = time.monotonic() - t0
        if task is not None:
            task.cancel()
        if poll is not None:
            await poll(session)
    return list(outcomes), t0, wall


def pct(values: list[float], q: float) -> float | None:
    """The nearest-rank percentile (bench.residency.contention's), None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    return round(ordered[min(len(ordered) - 1, int(q * len(ordered)))], 3)


def summarize(outcomes: list[Outcome], models: list[str], wall: float) -> dict[str, Any]:
    ok = [o for o in outcomes if o.ok]
    firsts = [o.first_token_s for o in ok if o.first_token_s is not None]
    per_model: dict[str, dict[str, Any]] = {}
    for m in models:
        mine = [o for o in outcomes if o.model == m]
        mine_ok = [o.first_token_s for o in mine if o.ok and o.first_token_s is not None]
        per_model[m] = {
            "requests": len(mine),
            "ok": sum(o.ok for o in mine),
            "first_token_p50_s": pct(mine_ok, 0.50),
            "first_token_p95_s": pct(mine_ok, 0.95),
            "first_token_max_s": max(mine_ok, default=None),
        }
    scored = {m: r["first_token_p95_s"] for m, r in per_model.items() if r["first_token_p95_s"] is not None}
    worst = max(scored, key=lambda m: scored[m]) if scored else None
    burst = [o.first_token_s for o in outcomes if o.burst and o.ok and o.first_token_s is not None]
    errors: dict[str, int] = {}
    for o in outcomes:
        if not o.ok:
            errors[o.error] = errors.get(o.error, 0) + 1
    tokens = sum(o.tokens for o in ok)
    return {
        "requests": len(outcomes),
        "ok": len(ok),
        "failed": len(outcomes) - len(ok),
        "errors": errors,
        "tokens": tokens,
        "wall_s": round(wall, 2),
        "tok_s": round(tokens / wall, 1) if wall > 0 else 0.0,
        "first_token_p50_s": pct(firsts, 0.50),
        "first_token_p95_s": pct(firsts, 0.95),
        "first_token_p99_s": pct(firsts, 0.99),
        "worst_model": worst,
        "worst_model_p95_s": scored.get(worst) if worst else None,
        "burst_requests": sum(o.burst for o in outcomes),
        "burst_ok": len(burst),
        "burst_first_token_p50_s": pct(burst, 0.50),
        "burst_first_token_max_s": max(burst, default=None),
        "models": per_model,
    }
