"""The contract every engine keeps, whatever its kind: load, stop, health, a memory report in the
units policy/ consumes (both reports are the wire's, deployments/wire/reports.py: the model server
sends them on), and per-request failures that never take the engine down."""

import abc
import queue
import time
from typing import Any, Literal

from deployments.wire.reports import EngineStatus, Health, MemoryReport
from policy._frozen import Frozen
from policy.specs import ModelKind

__all__ = ["Engine", "Frozen", "Health", "MemoryReport", "RequestError", "RequestErrorCode"]


RequestErrorCode = Literal["invalid_request", "context_length_exceeded", "unsupported", "engine_stopped", "internal"]


def queued_adds(commands: "queue.SimpleQueue[Any] | queue.Queue[Any]") -> list[Any]:
    """Empty a stopping engine's command queue: the payloads of the ("add", payload) commands still in
    it, in order (requests that never reached the batch; the other commands no longer matter)."""
    added: list[Any] = []
    while True:
        try:
            kind, payload = commands.get_nowait()
        except queue.Empty:
            return added
        if kind == "add":
            added.append(payload)


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
        self._status: EngineStatus = "loading"
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
