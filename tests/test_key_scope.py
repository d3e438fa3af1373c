"""What a user key may read of an error (issue 25 item 6): the residency policy's own refusals, as the
controller turns them into errors, reach a user key without other models' names, node names, memory
figures or store paths, with the same code, status and Retry-After; an admin key reads them whole,
and errors about the key's own request pass as they are."""

import re

import pytest
from support.builders import PLAIN, cluster, failed, inst, node, spec

from deployments.failures import unwrap
from deployments.wire.failure import STATUS, OrchardError
from policy import Reject, ensure
from policy.failures import reject_marked
from router.api.errors import USER_SAFE_CODES, error_response, for_principal
from router.residency.asks import error_for as _error_for
from router.residency.limits import RateLimited
from router.serving.stream_mux import Unavailable

NOW = 1000.0
PATH = "/Users/ops/orchard-store/mine/model.safetensors"


def _refusals() -> list[OrchardError]:
    """The controller's errors for each kind of placement refusal of model `mine`, by the real policy."""
    mine = spec("mine", gb=12)
    pinned = [spec("secret-a", gb=20, pinned=True), spec("secret-b", gb=10, pinned=True)]
    blocked = ensure("mine", cluster([node("mac-studio-2", 36, inst("secret-a", 20), inst("secret-b", 10))], [*pinned, mine]), NOW, PLAIN)
    too_large = ensure("mine", cluster([node("mac-studio-2", 8)], [mine]), NOW, PLAIN)
    busy = ensure(
        "mine",
        cluster([node("mac-studio-2", 16, inst("secret-a", 10, in_flight=1))], [spec("secret-a", gb=10), mine]),
        NOW,
        PLAIN.model_copy(update={"contention": "fail"}),
    )
    mark = failed("mine", NOW - 5, node_id="mac-studio-2", reason="bad_files", message=f"SafetensorError: {PATH}: incomplete metadata")
    load_failed = reject_marked(mark, NOW, PLAIN)
    decisions = [blocked, too_large, busy, load_failed]
    assert all(isinstance(d, Reject) for d in decisions), decisions
    assert {d.code for d in decisions} == {"blocked", "too_large", "busy", "load_failed"}
    errors = [_error_for(d) for d in decisions]  # type: ignore[arg-type]
    errors.append(unwrap(Unavailable("model mine on mac-studio-2 is unavailable: RayActorError")))
    errors.append(OrchardError("model_gave_up", "gave up after waiting 60 s: model mine waits for its weights on mac-studio-2 (3.1 GiB of 4.0 GiB)"))
    errors.append(OrchardError("internal", "KeyError: 'secret-b' in /opt/orchard/deployments/engines/llm.py"))
    return errors


LEAKS = re.compile(r"secret-|mac-studio|GiB|MiB|\d{4,}|/|RayActorError|KeyError")


@pytest.mark.parametrize("error", _refusals(), ids=lambda e: e.code)
def test_a_user_key_reads_a_neutral_message_an_admin_key_the_whole_one(error):
    assert LEAKS.search(error.message), error.message  # the real message does carry details
    shown = for_principal(error, admin=False, model="mine")
    assert not LEAKS.search(shown.message), shown.message
    assert "mine" in shown.message and "events" in shown.message
    assert (shown.code, shown.status, shown.param, shown.retry_after_s) == (error.code, error.status, error.param, error.retry_after_s)
    response = error_response("openai", shown)
    assert response.status_code == error.status and (response.headers.get("retry-after") is not None) == bool(error.retry_after_s)
    assert for_principal(error, admin=True, model="mine") is error


def test_errors_about_the_keys_own_request_pass_as_they_are():
    own = [
        RateLimited("tpm", "key 'team-a' used or holds 900 tokens in the last minute and asks for 300: its limit tpm is 1000", 12.0),
        OrchardError("context_length_exceeded", "the prompt has 5000 tokens; the model's context is 4096", "messages"),
        OrchardError("model_not_found", "model 'other' is not in the registry", "model"),
        OrchardError("tools_not_supported", "model mine has no tool-call parser configured (registry: tool_parser)", "tools"),
    ]
    for error in own:
        assert for_principal(error, admin=False, model="mine") is error


def test_every_code_that_names_cluster_details_is_off_the_allow_list():
    """New codes are scrubbed unless someone adds them here on purpose."""
    cluster_codes = {
        code
        for code in STATUS
        if code.startswith(("model_", "node_", "files_", "fetch_")) or code in ("load_failed", "unavailable", "engine_stopped", "internal")
    }
    assert cluster_codes & USER_SAFE_CODES == {"model_not_found", "model_not_supported"}
    assert for_principal(OrchardError("some_new_code", "node mac-1 said 5 GiB"), admin=False, model="m").message.count("mac-1") == 0
