"""What the residency loop's parts (asks.py, placements.py, removals.py, spares.py, swaps.py) use of
the loop (controller.py) and of each other: small protocols, so a part depends on what it touches
rather than on the controller, which builds the parts and passes itself as their `Loop`. A part that
needs another part reaches it through the loop, by the narrow protocol here."""

import asyncio
from collections.abc import Coroutine
from typing import Any, Protocol

from policy import ClusterState, InstanceRef, InstanceState, LoadFailure, Place, PolicyConfig
from router.residency.clock import Clock
from router.residency.events import (
    CachesReported,
    EventKind,
    FetchDone,
    InstanceDied,
    LoadDone,
    LoadFailed,
    NodeLost,
    NodeReported,
    StopDone,
    StopReleased,
)
from router.residency.interface import Effects
from router.residency.leases import LeaseBook
from router.residency.sites import Sites


class PlacementsPart(Protocol):
    """What the other parts use of the placements under way (placements.py)."""

    prefetches: set[tuple[str, str]]  # (model, node): weights fetched before an eviction
    spare_for: dict[tuple[str, str], tuple[str, asyncio.Task | None]]  # (model, node) -> the spare it takes

    def begin(self, place: Place, *, for_requests: bool = False) -> bool: ...

    def offer_spare(self, node_id: str) -> bool: ...


class RemovalsPart(Protocol):
    """What the other parts use of the store folders leaving (removals.py)."""

    pending: set[tuple[str, str]]  # (model, node) whose files an operator removes (X3)

    def on(self, model: str) -> frozenset[str]: ...

    def gone(self, node_id: str, folders: list[str], reason: str) -> None: ...


class SparesPart(Protocol):
    """What the placements use of the spare processes (spares.py)."""

    def plan(self) -> None: ...

    def take(self, node_id: str) -> tuple[str, asyncio.Task | None] | None: ...

    def claim(self, node_id: str) -> tuple[str, int] | None: ...

    async def claim_soon(self, node_id: str) -> str | None: ...

    async def recycle(self, node_id: str, actor: str, held_bytes: int) -> bool: ...


class Loop(Protocol):
    """What the parts use of the residency loop: its state (which they change in the loop's steps),
    its settings, clock, effects and books, the other parts, and the loop's own steps (record an
    event, drop an instance, decide again, run a task)."""

    state: ClusterState

    @property
    def config(self) -> PolicyConfig: ...

    @property
    def clock(self) -> Clock: ...

    @property
    def effects(self) -> Effects: ...

    @property
    def sites(self) -> Sites: ...

    @property
    def leases(self) -> LeaseBook: ...

    @property
    def revoke_grace_s(self) -> float: ...

    @property
    def placements(self) -> PlacementsPart: ...

    @property
    def removals(self) -> RemovalsPart: ...

    @property
    def spares(self) -> SparesPart: ...

    def apply(
        self, event: NodeReported | CachesReported | NodeLost | InstanceDied | LoadDone | LoadFailed | StopReleased | StopDone | FetchDone
    ) -> None: ...

    def mark_failed(self, failure: LoadFailure) -> None: ...

    def _instance(self, ref: InstanceRef) -> InstanceState | None: ...

    def _count(self, ref: InstanceRef, now: float) -> None: ...

    def _record(self, kind: EventKind, **fields: Any) -> None: ...

    def _drop(
        self, ref: InstanceRef, kind: EventKind | None, reason: str, stop_reason: str, cause: str | None = None, for_room: bool = False
    ) -> None: ...

    def _retry_if_files_changed(self, model: str) -> None: ...

    def _schedule(self, delay_s: float) -> None: ...

    def _spawn(self, coro: Coroutine[Any, Any, Any]) -> asyncio.Task: ...

    def _wake(self) -> None: ...
