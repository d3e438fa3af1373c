"""Stored Responses: the record one response leaves (the conversation it answered and the Response
object) and the store that keeps records in a key-value store every ingress replica reads. The app
gives it Ray's GCS key-value store (router/api/routes/responses.py, through cluster/ray_api.py);
tests give it a dict. Pure otherwise (pydantic + stdlib).

A record holds its whole conversation (every earlier input and output item, then its own input),
so a response stays continuable however old the responses before it are: evicting or expiring an
old record never breaks a newer one. The price is that a long conversation is stored once per
turn, which the bounds below keep in check.

Bounds (ray-config.yaml `args.responses_store`, StoreSettings):
- `ttl_s` (24 h): a record older than this is gone (a read treats it as absent and deletes it; the
  sweep deletes the rest).
- `max_response_bytes` (8 MiB): a request to be stored whose conversation (the input items as JSON)
  is larger is refused before it runs (ResponseTooLarge, a 400); the record adds the response's own
  output to that.
- `max_total_bytes` (256 MiB): when the records add up to more, the oldest are deleted first. The
  sweep that checks it runs after a write, at most every SWEEP_PERIOD_S per replica unless that
  replica wrote an eighth of the cap since, so the total may pass the cap by that much for a moment.

Scoped: each record names its owner (the API key's name; "anonymous" without keys, whom everyone
is). A read or delete by another owner finds nothing, exactly as for an id that never existed.

Keys: `responses/record/<id>` -> the record's JSON; `responses/index/<created ms>/<id>/<bytes>` ->
b"", so one listing gives every record's age and size (the sweep) without reading any record."""

from __future__ import annotations

import json
import logging
import re
import time
from collections.abc import Callable
from typing import Any, Protocol

from pydantic import BaseModel, ConfigDict, Field

log = logging.getLogger("orchard.responses")

RECORD = "responses/record/"
INDEX = "responses/index/"
SWEEP_PERIOD_S = 10.0
_ID = re.compile(r"^resp_[A-Za-z0-9_-]{1,100}$")


class StoreSettings(BaseModel):
    """ray-config.yaml `args.responses_store`."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    ttl_s: float = Field(default=24 * 3600.0, gt=0)
    max_response_bytes: int = Field(default=8 * 1024**2, ge=1024)
    max_total_bytes: int = Field(default=256 * 1024**2, ge=1024)


class StoredResponse(BaseModel):
    """One stored response: the Response object as it was returned, and the conversation it
    answered (its input items, each with an id, oldest first)."""

    model_config = ConfigDict(frozen=True)

    id: str
    owner: str
    created_at: float
    model: str
    response: dict[str, Any]
    input_items: list[dict[str, Any]]

    def conversation(self) -> list[dict[str, Any]]:
        """What a response continuing this one starts from: its input items, then its output items."""
        return [*self.input_items, *self.response.get("output", [])]


class ResponseTooLarge(Exception):
    """A conversation over `max_response_bytes`."""

    def __init__(self, size: int, limit: int):
        super().__init__(f"the conversation is {size} bytes as JSON, over the {limit} bytes a stored response may hold")
        self.size = size
        self.limit = limit


class KV(Protocol):
    """A key-value store every ingress replica shares (the app's: Ray's GCS)."""

    def get(self, key: str) -> bytes | None: ...
    def put(self, key: str, value: bytes) -> None: ...
    def delete(self, key: str) -> None: ...
    def keys(self, prefix: str) -> list[str]: ...


def items_size(items: list[dict[str, Any]]) -> int:
    return len(json.dumps(items, separators=(",", ":"), ensure_ascii=False).encode())


class ResponseStore:
    """Records in `kv`, bounded by `settings`, each read only by its owner. Every call is blocking
    (the app runs them in a thread, or, at a stream's end, on the loop: see the route)."""

    def __init__(self, kv: KV, settings: StoreSettings | None = None, clock: Callable[[], float] = time.time):
        self.kv = kv
        self.settings = settings or StoreSettings()
        self.clock = clock
        self._swept_at = float("-inf")
        self._written = 0  # bytes this replica wrote since its last sweep

    # ---- reads and writes -------------------------------------------------------------------
    def check_size(self, items: list[dict[str, Any]]) -> None:
        """ResponseTooLarge when `items` (a conversation to be stored) are over max_response_bytes."""
        size = items_size(items)
        if size > self.settings.max_response_bytes:
            raise ResponseTooLarge(size, self.settings.max_response_bytes)

    def get(self, response_id: str, owner: str) -> StoredResponse | None:
        """The record of `response_id` if `owner` made it and it has not expired, else None."""
        found = self._read(response_id)
        if found is None:
            return None
        record, size = found
        if self._expired(record.created_at):
            self._remove(record, size)
            return None
        return record if record.owner == owner else None

    def put(self, record: StoredResponse, *, sweep: bool = True) -> None:
        """Store `record` (its index key first: a record is never stored unaccounted for), then
        sweep if one is due (`sweep=False`: the caller runs `sweep_if_due` elsewhere)."""
        raw = record.model_dump_json().encode()
        self.kv.put(self._index_key(record, len(raw)), b"")
        self.kv.put(RECORD + record.id, raw)
        self._written += len(raw)
        if sweep:
            self.sweep_if_due()

    def delete(self, response_id: str, owner: str) -> bool:
        """Delete the record of `response_id` if `owner` made it; whether there was one."""
        found = self._read(response_id)
        if found is None or found[0].owner != owner:
            return False
        record, size = found
        self._remove(record, size)
        return not self._expired(record.created_at)

    def _read(self, response_id: str) -> tuple[StoredResponse, int] | None:
        """The stored record of `response_id` and its size in the KV, whoever made it; None if none."""
        if not _ID.match(response_id):
            return None
        raw = self.kv.get(RECORD + response_id)
        return None if raw is None else (StoredResponse.model_validate_json(raw), len(raw))

    # ---- bounds -----------------------------------------------------------------------------
    def sweep_if_due(self) -> int:
        """A sweep if SWEEP_PERIOD_S passed since the last, or this replica wrote an eighth of
        max_total_bytes since; how many records it deleted."""
        if self.clock() - self._swept_at >= SWEEP_PERIOD_S or self._written > self.settings.max_total_bytes // 8:
            return self.sweep()
        return 0

    def sweep(self) -> int:
        """Delete expired records, then the oldest while the total is over max_total_bytes; how
        many were deleted."""
        self._swept_at, self._written = self.clock(), 0
        entries = []
        for key in self.kv.keys(INDEX):
            parts = key[len(INDEX) :].split("/")
            if len(parts) == 3 and parts[0].isdigit() and parts[2].isdigit():
                entries.append((int(parts[0]), parts[1], int(parts[2]), key))
        entries.sort()
        total = sum(e[2] for e in entries)
        dropped = 0
        for created_ms, response_id, size, key in entries:
            if not self._expired(created_ms / 1000) and total <= self.settings.max_total_bytes:
                break
            self.kv.delete(RECORD + response_id)
            self.kv.delete(key)
            total -= size
            dropped += 1
        if dropped:
            log.info("stored responses: %d deleted (expired or oldest over the cap), %d bytes left", dropped, total)
        return dropped

    def _expired(self, created_at: float) -> bool:
        return created_at + self.settings.ttl_s <= self.clock()

    @staticmethod
    def _index_key(record: StoredResponse, size: int) -> str:
        return f"{INDEX}{round(record.created_at * 1000):015d}/{record.id}/{size}"

    def _remove(self, record: StoredResponse, size: int) -> None:
        self.kv.delete(RECORD + record.id)
        self.kv.delete(self._index_key(record, size))
