"""How a failure in or of a model server becomes the wire's `OrchardError` (deployments/wire/failure.py):
`unwrap` takes Ray's wrappers off on the caller's side (the router, the residency service, the model
server for what its engine raised), `internal_error` hides an unexpected exception behind an incident
id, `without_paths` keeps a node's folders out of a client's message. Importing it stays light (no
MLX, Ray only inside the functions): the router imports `unwrap` from here."""

import asyncio
import errno
import re
import secrets
import sys
import traceback
from typing import Any

from deployments.engine import RequestError
from deployments.wire.failure import OrchardError

# Codes that say the instance went away, not that the request failed: a retry (elsewhere) may serve it.
RETRYABLE = ("unavailable", "engine_stopped")
RETRY_S = 1.0


def internal_error(e: BaseException | str, where: str = "the model server") -> OrchardError:
    """An unexpected failure as its caller (and so a client) sees it: `internal`, with a short
    incident id and no exception text; the exception itself (its traceback when there is one) goes
    to this process's log under the same id, for the operator."""
    incident = secrets.token_hex(4)
    if isinstance(e, BaseException):
        detail = "".join(traceback.format_exception(e)).rstrip()
    else:
        detail = e
    print(f"orchard: incident {incident} in {where}: {detail}", file=sys.stderr, flush=True)
    return OrchardError("internal", f"{where} failed unexpectedly (incident {incident}; the operator's logs have the details)")


def engine_error(code: str | None, message: str | None, param: str | None = None) -> OrchardError:
    """An engine's failure (a RequestError, an error delta) as it may leave this process: its own
    message for an expected error, an incident id (`internal_error`) for an internal one."""
    if code in (None, "internal"):
        return internal_error(message or "generation failed", "the engine")
    return OrchardError(code, message or "generation failed", param, retry_after_s=RETRY_S if code in RETRYABLE else None)


def _actor_died(exc: BaseException) -> Any:
    """The RayActorError (ActorDiedError, ActorUnavailableError) behind `exc`, or None."""
    import ray.exceptions as rex

    seen: BaseException | None = exc
    for _ in range(8):
        if isinstance(seen, rex.RayActorError):
            return seen
        seen = getattr(seen, "cause", None) if isinstance(seen, rex.RayTaskError) else None
        if seen is None:
            return None
    return None


def death_cause(exc: BaseException) -> str | None:
    """What Ray says ended the model server behind a failed call (its GCS death cause: "The actor is
    dead because it was killed by `ray.kill`.", "... its worker process has died. Worker exit type:
    SYSTEM_ERROR ...", "... its node has died ..."), without the actor's id, pid, address or Ray's
    advice; None when the call did not fail for its actor's death or absence."""
    died = _actor_died(exc)
    if died is None:
        return None
    lines = [line.strip() for line in str(died).splitlines() if line.strip() and not line.startswith("\t")]
    cause = next((line for line in lines if "dead because" in line or "died because" in line), lines[-1] if lines else type(died).__name__)
    cause = cause.split(" Some common causes")[0].split(" Node Id:")[0].split(" Owner Id:")[0]
    return re.sub(r"\b[0-9a-f]{16,}\b", "…", cause)[:300]


def crashed(exc: BaseException) -> bool:
    """Whether a model-server call failed because the actor's process exited on its own: a crash
    (a segfault, an abort, any exit code) or a SIGKILL (an out-of-memory kill). Not for a
    `ray.kill` (an operator's or the residency service's), an `exit_actor` (an intended exit), its
    node's death, or an actor that was only unreachable (tests/test_security_inputs.py)."""
    import ray.exceptions as rex

    died = _actor_died(exc)
    if not isinstance(died, rex.ActorDiedError):
        return False
    text = str(died)
    return "worker process has died" in text and "INTENDED_" not in text


def unwrap(exc: BaseException) -> OrchardError:
    """The OrchardError behind whatever a call to a model server raised: Ray's RayTaskError
    (whose `.cause` is the actor's exception), a FileNotFoundError from `load` (not_found), an
    engine RequestError, a dead or unreachable actor (unavailable, with Ray's death cause), a
    cancelled task (cancelled); anything else is `internal_error` (an incident id, the exception in
    the log). The one translator: the router, the residency service and this server (for what its
    engine raised) map every failure through it. An instance that went away (unavailable,
    engine_stopped) says a retry could help (`retry_after_s`)."""
    import ray.exceptions as rex

    seen = exc
    for _ in range(8):  # RayTaskError chains (an actor calling an actor) nest causes
        if isinstance(seen, OrchardError) and not isinstance(seen, rex.RayTaskError):
            return seen
        cause = getattr(seen, "cause", None) if isinstance(seen, rex.RayTaskError) else None
        if cause is None:
            break
        seen = cause
    if isinstance(seen, OrchardError):  # a dual RayTaskError(OrchardError) without cause
        return OrchardError(seen.code, seen.message, seen.param, retry_after_s=seen.retry_after_s)
    if isinstance(seen, RequestError):
        return engine_error(seen.code, seen.message, seen.param)
    if isinstance(seen, FileNotFoundError):
        return OrchardError("not_found", without_paths(str(seen)), "model")
    if isinstance(seen, (rex.TaskCancelledError, asyncio.CancelledError)):
        return OrchardError("cancelled", "the request was cancelled")
    if isinstance(seen, (rex.RayActorError, rex.ActorUnavailableError)):
        return OrchardError("unavailable", f"the model server is unavailable: {death_cause(seen) or type(seen).__name__}", retry_after_s=RETRY_S)
    return internal_error(seen)


# The folders of an absolute path (POSIX), not a URL's nor a relative path's: what `without_paths` drops.
_FOLDERS = re.compile(r"(?<![\w.:/~-])(?:/[^\s'\"/]+)+/")


def without_paths(text: str) -> str:
    """`text` with every absolute path cut to its last part: a load failure goes to clients (a
    503's message), which must not learn where a node keeps its models; the log keeps the whole."""
    return _FOLDERS.sub("", text)


def load_failure(e: BaseException) -> OrchardError:
    """A load that failed, as the caller sees it: not_found (no folder), else load_failed with the
    engine's exception named (the controller tells an out-of-memory from bad files by it); no
    absolute path in the message (`without_paths`)."""
    if isinstance(e, OrchardError):
        return e
    if isinstance(e, FileNotFoundError):
        return OrchardError("not_found", without_paths(str(e)), "model")
    return OrchardError("load_failed", without_paths(f"{type(e).__name__}: {e}"))


def load_error_for_caller(e: BaseException) -> Exception:
    """What `load` raises for a failed load: a FileNotFoundError (the caller's not_found) or the
    OrchardError of `load_failure`, without absolute paths either way."""
    failure = load_failure(e)
    if isinstance(e, FileNotFoundError):
        return FileNotFoundError(errno.ENOENT, failure.message.removeprefix(f"[Errno {errno.ENOENT}] "))
    return failure
