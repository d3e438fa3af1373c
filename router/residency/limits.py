"""Per-key limits: requests per minute, tokens per minute and requests in flight, for every ingress
replica at once. The residency service keeps them: every request already asks it for a lease (one
call, never per token), so the count lives in one place whatever the number of ingress replicas.

Tokens are reserved when a request is admitted, the prompt's estimate (router/serving/token_estimate.py) plus
max_tokens for a generation, and corrected to what it used (the usage the model reports: prompt +
completion, an embedding's or a rerank's input tokens) when its lease ends. Every route that runs a
model counts: generations, embeddings, rerank, audio (router/api); count_tokens, which runs none,
counts as a request and holds no tokens. The windows slide over the last 60 s."""

from collections import deque
from dataclasses import dataclass, field

from pydantic import BaseModel, ConfigDict

from deployments.wire.failure import OrchardError

WINDOW_S = 60.0


class RateLimited(OrchardError):
    """A request over one of its key's limits (`limit`: rpm, tpm or max_concurrent): a 429."""

    def __init__(self, limit: str, message: str, retry_after_s: float):
        super().__init__("rate_limited", message, retry_after_s=max(0.1, retry_after_s))
        self.limit = limit


class Tenant(BaseModel):
    """A key's name and limits, as the ingress sends them with each lease request."""

    model_config = ConfigDict(frozen=True)

    name: str
    rpm: int | None = None
    tpm: int | None = None
    max_concurrent: int | None = None

    @property
    def limited(self) -> bool:
        return self.rpm is not None or self.tpm is not None or self.max_concurrent is not None


@dataclass
class _Usage:
    requests: deque[float] = field(default_factory=deque)  # admission times
    tokens: deque[tuple[float, int]] = field(default_factory=deque)  # (time, tokens) of finished requests
    reserved: dict[str, int] = field(default_factory=dict)  # ticket -> tokens held by a running request

    def trim(self, now: float) -> None:
        while self.requests and self.requests[0] <= now - WINDOW_S:
            self.requests.popleft()
        while self.tokens and self.tokens[0][0] <= now - WINDOW_S:
            self.tokens.popleft()

    def tokens_used(self) -> int:
        return sum(t for _, t in self.tokens) + sum(self.reserved.values())


class Limiter:
    def __init__(self) -> None:
        self._usage: dict[str, _Usage] = {}
        self._tickets: dict[str, tuple[str, int]] = {}  # ticket -> (tenant, reserved tokens)

    def admit(self, tenant: Tenant, ticket: str, reserve_tokens: int, now: float) -> None:
        """Count a request in, or raise OrchardError("rate_limited") naming the limit it passes, with
        Retry-After: when the window frees enough (rpm, tpm) or a second (concurrency)."""
        if not tenant.limited:
            return
        u = self._usage.setdefault(tenant.name, _Usage())
        u.trim(now)
        if tenant.max_concurrent is not None and len(u.reserved) >= tenant.max_concurrent:
            raise RateLimited(
                "max_concurrent",
                f"key {tenant.name!r} has {len(u.reserved)} requests running: its limit max_concurrent is {tenant.max_concurrent}",
                1.0,
            )
        if tenant.rpm is not None and len(u.requests) >= tenant.rpm:
            wait = u.requests[0] + WINDOW_S - now
            raise RateLimited("rpm", f"key {tenant.name!r} sent {len(u.requests)} requests in the last minute: its limit rpm is {tenant.rpm}", wait)
        if tenant.tpm is not None and u.tokens_used() + reserve_tokens > tenant.tpm:
            wait = (u.tokens[0][0] + WINDOW_S - now) if u.tokens else 1.0
            raise RateLimited(
                "tpm",
                f"key {tenant.name!r} used or holds {u.tokens_used()} tokens in the last minute and asks for {reserve_tokens}: its limit tpm is {tenant.tpm}",
                wait,
            )
        u.requests.append(now)
        u.reserved[ticket] = reserve_tokens
        self._tickets[ticket] = (tenant.name, reserve_tokens)

    def finish(self, ticket: str, used_tokens: int | None, now: float) -> None:
        """The request ended: its reservation becomes what it used (the reservation if not known)."""
        found = self._tickets.pop(ticket, None)
        if found is None:
            return
        name, reserved = found
        u = self._usage[name]
        u.reserved.pop(ticket, None)
        used = reserved if used_tokens is None else used_tokens
        if used:
            u.tokens.append((now, used))

    def headers(self, tenant: Tenant, now: float) -> dict[str, str]:
        """OpenAI's x-ratelimit-* headers for this key now (none for a key without limits)."""
        if not tenant.limited:
            return {}
        u = self._usage.setdefault(tenant.name, _Usage())
        u.trim(now)
        out: dict[str, str] = {}
        if tenant.rpm is not None:
            reset = (u.requests[0] + WINDOW_S - now) if u.requests else 0.0
            out |= {
                "x-ratelimit-limit-requests": str(tenant.rpm),
                "x-ratelimit-remaining-requests": str(max(0, tenant.rpm - len(u.requests))),
                "x-ratelimit-reset-requests": f"{max(0.0, reset):.1f}s",
            }
        if tenant.tpm is not None:
            reset = (u.tokens[0][0] + WINDOW_S - now) if u.tokens else 0.0
            out |= {
                "x-ratelimit-limit-tokens": str(tenant.tpm),
                "x-ratelimit-remaining-tokens": str(max(0, tenant.tpm - u.tokens_used())),
                "x-ratelimit-reset-tokens": f"{max(0.0, reset):.1f}s",
            }
        if tenant.max_concurrent is not None:
            out["x-ratelimit-limit-concurrent"] = str(tenant.max_concurrent)
            out["x-ratelimit-remaining-concurrent"] = str(max(0, tenant.max_concurrent - len(u.reserved)))
        return out
