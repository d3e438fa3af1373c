"""The contract every engine keeps, whatever its kind: load, stop, health, a memory report in the
units policy/ consumes, and per-request failures that never take the engine down."""

import abc
import time
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from policy.specs import ModelKind


class Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class MemoryReport(Frozen):
    """What the engine holds, in bytes, for the node agent and the residency controller."""

    weight_bytes: int = Field(ge=0)
    kv_bytes_in_use: int = Field(default=0, ge=0)  # KV of the requests running now
    prefix_cache_bytes: int = Field(default=0, ge=0)  # KV kept for reuse by later requests
    kv_bytes_reserved: int = Field(default=0, ge=0)
    active_bytes: int = Field(default=0, ge=0)  # mx.get_active_memory() of this process
    peak_bytes: int = Field(default=0, ge=0)
    load_seconds: float = Field(default=0.0, ge=0)


class Health(Frozen):
    status: Literal["loading", "ready", "stopped", "failed"]
    kind: ModelKind
    model: str
    detail: str = ""
    running_requests: int = 0


RequestErrorCode = Literal["invalid_request", "context_length_exceeded", "unsupported", "engine_stopped", "internal"]


class RequestError(Exception):
    """One request failed; the engine and every other request go on. The router maps `code` to an
    HTTP status (deployments/wire/failure.py: the engines carry none); it becomes an OrchardError
    before it leaves the model server."""

    def __init__(self, code: RequestErrorCode, message: str, param: str | None = None):
        super().__init__(message)
        self.code = code
        self.message = message
        self.param = param

    def to_dict(self) -> dict[str, Any]:
        return {"code": self.code, "message": self.message, "param": self.param}


class Engine(abc.ABC):
    """Base of every kind's engine. Subclasses do all MLX work on their MLXWorker thread."""

    kind: ModelKind

    def __init__(self, name: str, path: str):
        self.name = name
        self.path = path
        self._status: Literal["loading", "ready", "stopped", "failed"] = "loading"
        self._detail = ""
        self._load_seconds = 0.0

    async def load(self) -> None:
        started = time.perf_counter()
        try:
            await self._load()
        except Exception as e:
            self._status, self._detail = "failed", f"{type(e).__name__}: {e}"
            raise
        self._load_seconds = time.perf_counter() - started
        self._status = "ready"

    async def stop(self) -> None:
        if self._status == "stopped":
            return
        self._status = "stopped"
        await self._stop()

    def health(self) -> Health:
        return Health(status=self._status, kind=self.kind, model=self.name, detail=self._detail, running_requests=self.running_requests())

    def running_requests(self) -> int:
        return 0

    def _check_ready(self) -> None:
        if self._status != "ready":
            raise RequestError("engine_stopped", f"model {self.name} is {self._status}")

    @abc.abstractmethod
    async def _load(self) -> None: ...

    @abc.abstractmethod
    async def _stop(self) -> None: ...

    @abc.abstractmethod
    def memory(self) -> MemoryReport: ...
