"""Issue 25 item 1: no token id a client sends reaches MLX unchecked, and a request that crashes its
instance is not taken to a second one. Also item 6's part in the model server: an unexpected
failure reaches the caller as an incident id, not as Python's exception text, and a failed load
names no absolute path.

The engine's checks run in a subprocess: before them, `{"logit_bias": {"2000000000": 1}}`
segfaulted the process that ran the engine (a smaller id past the vocabulary wrote past the logits
row), and a crash here must fail one test, not the run. The retry rule of router/serving/generation.py
is checked with plain fakes of the lease and the actor, raising the ActorDiedError Ray raises (built
from the death-cause record Ray's GCS sends); tests/test_security_inputs.py tries the whole path on
a running cluster."""

import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from ray.core.generated.common_pb2 import ActorDiedErrorContext
from ray.exceptions import ActorDiedError

from deployments.failures import crashed, death_cause, internal_error, load_failure, unwrap, without_paths
from deployments.wire.failure import OrchardError
from deployments.wire.generation import GenerationRequest, WholeReply
from router.serving import generation
from router.serving.stream_mux import Unavailable

ROOT = Path(__file__).resolve().parent.parent

ENGINE_SCRIPT = """
import asyncio, json, sys
from deployments.engine import RequestError
from deployments.engines.llm import LLMEngine
from deployments.wire.generation import GenerationRequest

async def main(path):
    engine = LLMEngine("llama-10m", path, max_batch=4)
    await engine.load()
    vocab = engine.model.args.vocab_size  # config.json's: the logits row's width
    hello = [{"role": "user", "content": "Hello"}]
    cases = {
        "huge_bias": dict(prompt="Hello", logit_bias={2_000_000_000: 1.0}),
        "first_past_the_row": dict(prompt="Hello", logit_bias={vocab: 1.0}),
        "negative_bias": dict(prompt="Hello", logit_bias={-1: 1.0}),
        "prompt_tokens": dict(prompt_tokens=[1, 2, vocab + 5]),
        "template": dict(messages=hello, chat_template_kwargs={"chat_template": "{{ 'x' * 10 }}"}),
        "tokenize": dict(messages=hello, chat_template_kwargs={"tokenize": False}),
        "padding": dict(messages=hello, chat_template_kwargs={"padding": "max_length", "max_length": 3000}),
    }
    out = {"vocab": vocab}
    for name, fields in cases.items():
        try:
            await engine.complete(GenerationRequest(max_tokens=2, temperature=0, **fields))
            out[name] = "answered"
        except RequestError as e:
            out[name] = [e.code, e.param, e.message]
    try:
        engine.tokenize(GenerationRequest(prompt_tokens=[vocab]))
        out["count"] = "counted"
    except RequestError as e:
        out["count"] = [e.code, e.param, e.message]
    last = await engine.complete(GenerationRequest(prompt_tokens=[1, vocab - 1], max_tokens=2, temperature=0, logit_bias={vocab - 1: 5.0}))
    out["last_id"] = last.finish_reason
    thinking = await engine.complete(GenerationRequest(messages=hello, max_tokens=2, temperature=0, chat_template_kwargs={"enable_thinking": False}))
    out["template_variable"] = thinking.finish_reason
    await engine.stop()
    print("RESULT " + json.dumps(out), flush=True)

asyncio.run(main(sys.argv[1]))
"""


@pytest.fixture(scope="module")
def engine_checks(models_dir) -> dict:
    run = subprocess.run([sys.executable, "-c", ENGINE_SCRIPT, str(models_dir / "llama-10m")], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, f"the engine's process ended with {run.returncode} (-11: a segfault)\n{run.stderr[-3000:]}"
    (line,) = [line for line in run.stdout.splitlines() if line.startswith("RESULT ")]
    return json.loads(line.removeprefix("RESULT "))


@pytest.mark.parametrize("case", ["huge_bias", "first_past_the_row", "negative_bias"])
def test_logit_bias_ids_outside_the_vocabulary_are_refused_naming_logit_bias(engine_checks, case):
    code, param, message = engine_checks[case]
    assert (code, param) == ("invalid_request", "logit_bias")
    assert f"0 to {engine_checks['vocab'] - 1}" in message


def test_a_token_id_prompt_outside_the_vocabulary_is_refused_naming_prompt(engine_checks):
    assert engine_checks["prompt_tokens"][:2] == ["invalid_request", "prompt"]
    assert engine_checks["count"][:2] == ["invalid_request", "prompt"]  # count_tokens' path too


@pytest.mark.parametrize("case,name", [("template", "chat_template"), ("tokenize", "tokenize"), ("padding", "padding")])
def test_the_engine_passes_template_variables_only(engine_checks, case, name):
    """Defense in depth behind the request models' own check (tests/test_openai_protocol.py)."""
    assert engine_checks[case][:2] == ["invalid_request", f"chat_template_kwargs.{name}"]


def test_the_last_id_of_the_vocabulary_and_a_template_variable_still_serve(engine_checks):
    assert engine_checks["vocab"] == 2048  # llama-10m's config.json
    assert engine_checks["last_id"] == "length" and engine_checks["template_variable"] == "length"


# ---- how an instance ended, as Ray tells it ------------------------------------------------------

WORKER_DIED = (
    "The actor is dead because its worker process has died. Worker exit type: SYSTEM_ERROR Worker exit detail: Worker unexpectedly "
    "exits with a connection error code 2. End of file. Some common causes include: (1) the process was killed by the OOM killer"
)
RAY_KILL = "The actor is dead because it was killed by `ray.kill`."
EXITED = "The actor is dead because its worker process has died. Worker exit type: INTENDED_USER_EXIT Worker exit detail: User requested to exit the actor."
NODE_DIED = "The actor died because its node has died. Node Id: 0123456789abcdef0123456789abcdef"


def died(cause: str) -> ActorDiedError:
    """The error Ray raises for a call on (or into) a dead actor, with the GCS's death cause."""
    context = ActorDiedErrorContext(
        error_message=cause, actor_id=os.urandom(16), pid=4242, node_ip_address="10.1.2.3", class_name="ModelServer", name="orchard:llama-10m"
    )
    return ActorDiedError(context)


def test_a_crash_is_told_from_a_kill_an_exit_and_a_node_death():
    assert crashed(died(WORKER_DIED))  # a segfault, an abort, an exit code, a SIGKILL: all read the same
    assert not any(crashed(died(cause)) for cause in (RAY_KILL, EXITED, NODE_DIED))
    assert not crashed(OrchardError("engine_stopped", "stopping")) and not crashed(Unavailable("gone"))
    cause = death_cause(died(WORKER_DIED))
    assert cause is not None and cause.startswith("The actor is dead because its worker process has died") and "SYSTEM_ERROR" in cause
    for text in (cause, unwrap(died(NODE_DIED)).message):  # no pid, address, actor id, or Ray's advice
        assert "4242" not in text and "10.1.2.3" not in text and "0123456789abcdef" not in text and "OOM killer" not in text
    assert unwrap(died(RAY_KILL)).code == "unavailable"  # as before: the residency service reads the code


def test_an_unexpected_failure_reaches_the_caller_as_an_incident(capfd):
    try:
        raise KeyError("the secret inner workings")
    except KeyError as e:
        error = unwrap(e)
    assert error.code == "internal" and "incident" in error.message
    assert "secret" not in error.message and "KeyError" not in error.message
    incident = error.message.split("incident ")[1].split(";")[0]
    logged = capfd.readouterr().err
    assert f"incident {incident}" in logged and "the secret inner workings" in logged and "Traceback" in logged
    assert internal_error("x").message != internal_error("x").message  # each its own id


def test_a_load_failure_names_no_absolute_path():
    missing = load_failure(FileNotFoundError(2, "model folder of llama not found on node mac-1", "/Users/ops/orchard/store/llama"))
    assert missing.code == "not_found" and "/Users" not in missing.message and "llama" in missing.message
    broken = load_failure(OSError("Unable to open /Volumes/models/store/llama/model.safetensors: truncated"))
    assert broken.code == "load_failed" and broken.message == "OSError: Unable to open model.safetensors: truncated"
    assert without_paths("see https://huggingface.co/a/b or ./a/b") == "see https://huggingface.co/a/b or ./a/b"


# ---- the retry rule (router/serving/generation.py), with fakes of the lease and the actor --------------


class FakeLease:
    """What WholeGeneration, DeltaStream and `call` use of a Lease; `actors`: one per placement."""

    model = "llama-10m"
    label = "model llama-10m on head"

    def __init__(self, *actors):
        self.actors = list(actors)
        self.moves: list[str] = []
        self.reported: list[str] = []
        self.released = 0

    @property
    def moved(self) -> bool:
        return bool(self.moves)

    def actor(self):
        return self.actors[len(self.moves)]

    def report_unavailable(self, message: str) -> None:
        self.reported.append(message)

    async def move(self, why: str) -> None:
        self.moves.append(why)

    def release(self, used_tokens=None) -> None:
        self.released += 1


class Method:
    """An actor method: `.remote(...)` is an awaitable that answers or raises."""

    def __init__(self, outcome):
        self.outcome = outcome

    def remote(self, *args, **kwargs):
        async def answer():
            if isinstance(self.outcome, BaseException):
                raise self.outcome
            return self.outcome

        return answer()


class FakeActor:
    def __init__(self, outcome):
        self.generate_whole = Method(outcome)
        self.health = Method(outcome if isinstance(outcome, BaseException) else {"status": "ready"})
        self.progress = Method(0.0)


ANSWER = WholeReply(
    delta={"text": "hi", "token_ids": [5], "finish_reason": "length", "usage": {"prompt_tokens": 1, "completion_tokens": 1}}, first_s=0.0, last_s=0.0
)


def whole(lease) -> dict:
    return asyncio.run(generation.WholeGeneration(lease, GenerationRequest(prompt="x"), timeout_s=5).run())


def test_a_non_streamed_request_whose_instance_crashed_is_not_moved():
    lease = FakeLease(FakeActor(died(WORKER_DIED)), FakeActor(ANSWER))
    with pytest.raises(OrchardError) as info:
        whole(lease)
    assert (info.value.code, info.value.status) == ("model_crashed", 502)
    assert "not retried" in info.value.message and "4242" not in info.value.message
    assert lease.moves == [] and lease.reported  # the residency service is told, the request is not moved


@pytest.mark.parametrize("cause", [RAY_KILL, EXITED, NODE_DIED])
def test_a_non_streamed_request_whose_instance_was_ended_for_it_moves_once(cause):
    lease = FakeLease(FakeActor(died(cause)), FakeActor(ANSWER))
    assert whole(lease)["text"] == "hi" and len(lease.moves) == 1


def test_a_call_whose_instance_crashed_is_not_moved():
    lease = FakeLease(FakeActor(died(WORKER_DIED)), FakeActor(ANSWER))
    with pytest.raises(OrchardError) as info:
        asyncio.run(generation.call(lease, lambda actor: actor.health.remote()))
    assert info.value.code == "model_crashed" and lease.moves == []
    killed = FakeLease(FakeActor(died(RAY_KILL)), FakeActor(ANSWER))
    assert asyncio.run(generation.call(killed, lambda actor: actor.generate_whole.remote())) == ANSWER and len(killed.moves) == 1


class FakeReader:
    def __init__(self, actor):
        self.actor = actor


class FakeStream:
    """A MuxStream whose channel broke (`Unavailable`) before any output, or that answers."""

    def __init__(self, actor, submitted, answer=None):
        self.reader = FakeReader(actor)
        self.answer = answer
        outcome = Method(submitted).remote()
        self.submitted = asyncio.ensure_future(outcome)

    async def next(self, timeout_s):
        if self.answer is None:
            raise Unavailable("model llama-10m on head is unavailable: ActorDiedError")
        return self.answer

    def close(self):
        pass


class FakeMux:
    def __init__(self, *streams):
        self.streams = list(streams)

    def open(self, actor, label, request):
        return self.streams.pop(0)(actor)


def stream_first(lease, *streams) -> dict:
    async def go():
        deltas = generation.DeltaStream(FakeMux(*streams), lease, GenerationRequest(prompt="x"), chunk_timeout_s=5)
        try:
            return await deltas.first()
        finally:
            await deltas.aclose()

    return asyncio.run(go())


def test_a_stream_whose_instance_crashed_before_any_output_is_not_moved():
    crash = died(WORKER_DIED)
    lease = FakeLease(FakeActor(crash), FakeActor(ANSWER))
    with pytest.raises(OrchardError) as info:
        stream_first(lease, lambda actor: FakeStream(actor, submitted=None), lambda actor: FakeStream(actor, None, ANSWER.delta))
    assert info.value.code == "model_crashed" and lease.moves == []


@pytest.mark.parametrize("how", ["ray.kill", "never reached", "closed its channel"])
def test_a_stream_whose_instance_went_away_for_another_reason_moves_once(how):
    first = FakeActor(died(RAY_KILL)) if how == "ray.kill" else FakeActor(died(WORKER_DIED)) if how == "never reached" else FakeActor(ANSWER)
    submitted = died(WORKER_DIED) if how == "never reached" else None  # the submit itself failed: it never ran there
    lease = FakeLease(first, FakeActor(ANSWER))
    delta = stream_first(lease, lambda actor: FakeStream(actor, submitted), lambda actor: FakeStream(actor, None, ANSWER.delta))
    assert delta["text"] == "hi" and len(lease.moves) == 1
