"""One dedicated thread for all of an engine's MLX work.

MLX streams are thread-local: a model, its caches and its generation stream must be used from the
thread that made them. Every engine owns one MLXWorker and runs every MLX call through it. The
thread is a daemon: an engine that was never stopped must not keep its process from exiting."""

import asyncio
import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, TypeVar

T = TypeVar("T")
_STOP = object()


class MLXWorker:
    def __init__(self, name: str):
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._serve, name=f"mlx-{name}", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while True:
            job = self._jobs.get()
            if job is _STOP:
                return
            future, fn, args = job
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(fn(*args))
            except BaseException as e:
                future.set_exception(e)

    @property
    def on_worker(self) -> bool:
        return threading.current_thread() is self._thread

    def submit(self, fn: Callable[..., T], *args: Any) -> "Future[T]":
        """A concurrent.futures.Future for fn(*args) on the worker thread."""
        future: Future = Future()
        self._jobs.put((future, fn, args))
        return future

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        """Await fn(*args) run on the worker thread."""
        return await asyncio.wrap_future(self.submit(fn, *args))

    def shutdown(self) -> None:
        """Finish the jobs already queued, then end the thread."""
        self._jobs.put(_STOP)
        if not self.on_worker:
            self._thread.join()
