"""Failed loads (rules P9, P10): which failures earn a retry, the back-off of a model marked
failed, and the refusal a request for it gets while the back-off lasts."""

from policy.cluster_state import ClusterState, FailedLoad, LoadFailureReason
from policy.config import PolicyConfig
from policy.decisions import Reject

# Why a failure is not retried by evicting: more memory cannot fix it.
NOT_RETRIED_BECAUSE: dict[LoadFailureReason, str] = {
    "not_found": "its files were not found",
    "bad_files": "its files are unusable (truncated or corrupt weights, or an unsupported format or architecture)",
    "error": "the error was not an out-of-memory",
    "out_of_memory": "it ran out of memory again after evicting every evictable instance",
}


def failed_load_backoff(failures: int, config: PolicyConfig) -> float:
    """Seconds a model stays refused after `failures` consecutive failed loads (P10):
    failed_load_backoff_s x 2^(failures - 1), at most failed_load_backoff_max_s."""
    doublings = min(max(failures, 1) - 1, 64)  # 2^64 x any base is past any cap; no float overflow
    return min(config.failed_load_backoff_max_s, config.failed_load_backoff_s * 2.0**doublings)


def failures_after(state: ClusterState, model: str) -> int:
    """The consecutive-failure count a new failure of `model` makes (the mark's count + 1)."""
    mark = state.failed.get(model)
    return 1 if mark is None else mark.failures + 1


def backoff_left(mark: FailedLoad, now: float, config: PolicyConfig) -> float:
    """Seconds until the marked model may be tried again; <= 0 once the back-off has passed."""
    return mark.at + failed_load_backoff(mark.failures, config) - now


def within_backoff(state: ClusterState, model: str, now: float, config: PolicyConfig) -> bool:
    mark = state.failed.get(model)
    return mark is not None and backoff_left(mark, now, config) > 0


def _times(n: int) -> str:
    return "once" if n == 1 else "twice" if n == 2 else f"{n} times in a row"


def load_failed(model: str, said: str, again: str, retry_after_s: float | None) -> Reject:
    """The `load_failed` refusal of P9 and P10: what happened, and when the model is tried again."""
    return Reject(
        model=model,
        code="load_failed",
        message=f"{said}; it is tried again {again}, or sooner when its files change or an operator loads it",
        retry_after_s=retry_after_s,
    )


def failure_text(reason: LoadFailureReason, message: str) -> str:
    return f"{reason}: {message}" if message else reason


def reject_marked(mark: FailedLoad, now: float, config: PolicyConfig) -> Reject:
    """P10: the answer to a request for a model within its back-off. Call only while
    backoff_left(mark, now, config) > 0."""
    left = backoff_left(mark, now, config)
    said = f"model {mark.model} failed to load on {mark.node_id} ({failure_text(mark.reason, mark.message)}), {_times(mark.failures)}, {now - mark.at:.0f} s ago"
    return load_failed(mark.model, said, f"in {left:.0f} s", left)
