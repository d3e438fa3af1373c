"""What an ingress replica and the residency service say to each other about leases.

- `acquire` answers a `Grant` (the lease and what the ingress needs to use it) or a `Refusal`
  (the one failure type's fields, and the key's rate-limit headers when a limit counted it);
- `report_usage` takes a `UsageReport` (a holder's in-flight counts per standing lease, and the
  requests it started per model since its last report);
- `routes`, the holders' long poll, answers a `RoutesView`."""

from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from deployments.wire.failure import OrchardError


class _Message(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class LeaseRecord(_Message):
    """A lease on one instance (router/residency/leases.py)."""

    lease_id: str
    model: str
    node_id: str
    acquired_at: float
    # When the instance was placed (or adopted): a model placed again on the same node is a new
    # actor under the same name, so callers key cached actor handles by (model, node, loaded_at).
    loaded_at: float
    # The ingress replica that routes requests through this lease until it gives it back (a
    # standing lease); None: one request's lease.
    holder: str | None = None

    @property
    def number(self) -> int:
        """Leases are numbered in the order they were granted (`RoutesView.leases_upto`)."""
        return int(self.lease_id.removeprefix("L"))


class Grant(_Message):
    lease: LeaseRecord
    kind: str
    tool_parser: str | None = None
    reasoning: Any = None
    actor_name: str | None = None
    # The residency service's incarnation: a standing lease of an earlier one is void.
    epoch: str
    ratelimit: dict[str, str] = Field(default_factory=dict)


class Refusal(_Message):
    """No lease: the failure (OrchardError's fields) and the key's rate-limit headers."""

    code: str
    message: str
    param: str | None = None
    retry_after_s: float | None = None
    ratelimit: dict[str, str] = Field(default_factory=dict)

    @classmethod
    def of(cls, error: OrchardError, ratelimit: dict[str, str] | None = None) -> "Refusal":
        return cls(code=error.code, message=error.message, param=error.param, retry_after_s=error.retry_after_s, ratelimit=ratelimit or {})

    def error(self) -> OrchardError:
        return OrchardError(self.code, self.message, self.param, retry_after_s=self.retry_after_s)


class UsageReport(_Message):
    holder: str
    in_flight: dict[str, int] = Field(default_factory=dict)  # standing lease id -> requests running on it
    started: dict[str, int] = Field(default_factory=dict)  # model -> requests started since the last report


class RoutesView(_Message):
    """A holder's standing leases as the residency service sees them now."""

    version: int
    valid: list[str]  # its standing leases still good
    revoked: list[str]  # asked back: finish what runs on them, then release
    copies: dict[str, int]  # ready instances per model
    epoch: str
    leases_upto: int  # the last lease number granted when this answer was made
