"""One dedicated thread for all of an engine's MLX work.

MLX streams are thread-local: a model, its caches and its generation stream must be used from the
thread that made them. Every engine owns one MLXWorker and runs every MLX call through it. The
thread is a daemon: an engine that was never stopped must not keep its process from exiting.

Ending the thread cleanly is the worker's job, stopped or not:
- MLX keeps per-thread state (the thread's streams and its `mx.compile` cache, which holds Python
  functions). A thread that ends without `mx.clear_streams()` frees it in C++ thread-exit
  destructors, which run after `Thread.join()` has returned and take the GIL to drop the Python
  functions: when the main thread has gone on into interpreter finalization by then, CPython ends
  that thread inside the destructor and C++ aborts the process ("terminate called without an
  active exception"). The worker clears its streams as its last MLX call, as MLX asks of every
  thread but the main one.
- A worker still running when the interpreter exits (its engine never stopped) is ended by an
  atexit hook, before finalization: its `interrupt` (what ends a job that runs until told, an
  engine's loop) is called, then the worker finishes its queued jobs and joins."""

import asyncio
import atexit
import logging
import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, TypeVar

import mlx.core as mx

T = TypeVar("T")
_STOP = object()
EXIT_JOIN_S = 60.0  # how long interpreter exit waits for a worker that was never stopped

logger = logging.getLogger(__name__)


class MLXWorker:
    def __init__(self, name: str, interrupt: Callable[[], None] | None = None):
        """`interrupt`: ends the job that runs until told (an engine's loop), for a worker that is
        still running when the interpreter exits; None when every job ends by itself."""
        self.name = name
        self._interrupt = interrupt
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._serve, name=f"mlx-{name}", daemon=True)
        with _running_lock:
            _running.add(self)
        self._thread.start()

    def _serve(self) -> None:
        try:
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
        finally:
            mx.clear_streams()  # this thread's MLX state, freed while the thread still holds the GIL

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

    def shutdown(self, timeout: float | None = None) -> None:
        """Finish the jobs already queued, then end the thread (waiting at most `timeout` seconds
        for it; None: until it ends)."""
        with _running_lock:
            _running.discard(self)
        self._jobs.put(_STOP)
        if not self.on_worker:
            self._thread.join(timeout)

    def _shutdown_at_exit(self) -> None:
        if self._interrupt is not None:
            self._interrupt()
        self.shutdown(EXIT_JOIN_S)
        if self._thread.is_alive():
            logger.warning("MLX worker %s did not end within %.0f s of interpreter exit", self.name, EXIT_JOIN_S)


_running: set[MLXWorker] = set()  # started, not shut down
_running_lock = threading.Lock()


@atexit.register
def _shutdown_running() -> None:
    """Workers whose engines were never stopped end before the interpreter finalizes (atexit runs
    while other threads may still take the GIL)."""
    with _running_lock:
        workers = list(_running)
    for worker in workers:
        worker._shutdown_at_exit()
