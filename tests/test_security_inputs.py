"""What a client sends can never crash or misuse an instance (issue 25 items 1, 2 and 7), tried from
outside over HTTP against a running app with an admin key and a user key limited to llama-10m at
rpm 5: token ids outside the vocabulary (logit_bias on both routes, a token-array prompt) are 400s
naming the parameter and the instance that refused them lives on; chat_template_kwargs carry
template variables only (a template of the client's own, `tokenize`, `padding` are 400s); a forced
tool whose parameters are not an object schema is a 400 naming it, on all three protocols."""

import os
import signal
import threading

import pytest
import requests

ray = pytest.importorskip("ray")
from ray import serve  # noqa: E402
from support.cluster import key_entry, serve_orchard, wait_for  # noqa: E402

pytestmark = pytest.mark.cluster  # starts or uses a Ray cluster: one worker runs these in turn (conftest.py)

ADMIN_KEY = "sk-orchard-security-admin"
USER_KEY = "sk-orchard-security-user"
ADMIN = {"Authorization": f"Bearer {ADMIN_KEY}"}
USER = {"Authorization": f"Bearer {USER_KEY}"}
VOCAB = 2048  # llama-10m's (config.json vocab_size: the logits row's width)
HELLO = [{"role": "user", "content": "Hello"}]


@pytest.fixture(scope="module")
def orchard(models_dir, shared_ray):
    args = {
        "models_dir": str(models_dir),
        "models": [{"name": "llama-10m", "kind": "llm", "path": "llama-10m"}],
        "policy": {"min_residency_s": 0, "residency_per_reload": 0, "instance_overhead_bytes": 32 * 1024**2},
        "api_keys": [
            key_entry("ops", ADMIN_KEY, "admin"),
            key_entry("team", USER_KEY, models=["llama-10m"], rpm=5),
        ],
    }
    yield serve_orchard(args)
    serve.shutdown()


def post(base: str, path: str, body: dict, headers: dict = ADMIN) -> requests.Response:
    return requests.post(base + path, json={"model": "llama-10m", **body}, headers=headers, timeout=120)


def actor(base: str) -> str:
    r = requests.get(base + "/v1/cluster", headers=ADMIN, timeout=30)
    assert r.status_code == 200, r.text
    (instance,) = [i for n in r.json()["nodes"] for i in n["instances"] if i["model"] == "llama-10m"]
    return instance["actor"]


def refused(r: requests.Response, param: str) -> dict:
    assert r.status_code == 400, (r.status_code, r.text)
    error = r.json()["error"]
    assert error["param"] == param, error
    return error


def test_token_ids_outside_the_vocabulary_are_400s_and_the_instance_lives_on(orchard):
    ok = post(orchard, "/v1/completions", {"prompt": "Hello", "max_tokens": 2})
    assert ok.status_code == 200, ok.text
    before = actor(orchard)
    for token in (2_000_000_000, VOCAB):  # far out, and the first id past the logits row
        error = refused(post(orchard, "/v1/chat/completions", {"messages": HELLO, "max_tokens": 2, "logit_bias": {str(token): 1}}), "logit_bias")
        assert f"0 to {VOCAB - 1}" in error["message"], error
        refused(post(orchard, "/v1/completions", {"prompt": "Hello", "max_tokens": 2, "logit_bias": {str(token): 1}}), "logit_bias")
    refused(post(orchard, "/v1/completions", {"prompt": [1, 2, VOCAB + 5], "max_tokens": 2}), "prompt")
    # the user key's own requests are refused the same way (one of its five a minute)
    refused(post(orchard, "/v1/completions", {"prompt": "Hi", "max_tokens": 2, "logit_bias": {"2000000000": 1}}, USER), "logit_bias")
    # the last id of the vocabulary is fine, and the same instance answers
    fine = post(orchard, "/v1/completions", {"prompt": [1, 2, VOCAB - 1], "max_tokens": 2, "logit_bias": {str(VOCAB - 1): 1}})
    assert fine.status_code == 200, fine.text
    assert actor(orchard) == before


@pytest.mark.parametrize(
    "kwargs,name",
    [
        ({"chat_template": "{% for i in range(99999999) %}x{% endfor %}"}, "chat_template"),
        ({"tokenize": False}, "tokenize"),
        ({"padding": "max_length", "max_length": 4000}, "padding"),
        ({"enable_thinking": "x" * 10_000}, "enable_thinking"),
    ],
)
def test_chat_template_kwargs_carry_template_variables_only(orchard, kwargs, name):
    r = post(orchard, "/v1/chat/completions", {"messages": HELLO, "max_tokens": 2, "chat_template_kwargs": kwargs})
    refused(r, f"chat_template_kwargs.{name}")


def test_a_template_variable_still_passes(orchard):
    r = post(orchard, "/v1/chat/completions", {"messages": HELLO, "max_tokens": 2, "chat_template_kwargs": {"enable_thinking": False}}, USER)
    assert r.status_code == 200, r.text


NOT_AN_OBJECT = {"type": "string"}


def test_a_forced_tool_whose_parameters_are_not_an_object_schema_is_a_400(orchard):
    tool = {"type": "function", "function": {"name": "f", "parameters": NOT_AN_OBJECT}}
    chat = {"messages": HELLO, "max_tokens": 8, "tools": [tool], "tool_choice": {"type": "function", "function": {"name": "f"}}}
    refused(post(orchard, "/v1/chat/completions", chat), "tools[0].function.parameters")
    responses = {
        "input": "Hello",
        "max_output_tokens": 8,
        "tools": [{"type": "function", "name": "f", "parameters": NOT_AN_OBJECT}],
        "tool_choice": "required",
    }
    refused(post(orchard, "/v1/responses", responses), "tools[0].parameters")
    messages = {
        "messages": HELLO,
        "max_tokens": 8,
        "tools": [{"name": "f", "input_schema": NOT_AN_OBJECT}],
        "tool_choice": {"type": "tool", "name": "f"},
    }
    r = post(orchard, "/v1/messages", messages)
    assert r.status_code == 400, (r.status_code, r.text)
    assert r.json()["type"] == "error" and "tools.0.input_schema" in r.json()["error"]["message"], r.json()


NEVER_END = {str(t): -100 for t in range(4)}  # llama-10m's special tokens (EOS among them): it runs to max_tokens


def test_an_instance_that_crashes_under_a_request_does_not_get_it_again(orchard):
    """The request may be what crashed it (same input, same death): a 502 model_crashed, not a move
    to a fresh instance (a ray.kill still moves it: test_cluster_lifecycle.py). Runs last: it
    ends the module's instance."""
    assert post(orchard, "/v1/completions", {"prompt": "Hello", "max_tokens": 2}).status_code == 200
    name = actor(orchard)
    server = ray.get_actor(name, namespace="orchard")
    pid = ray.get(server.__ray_call__.remote(lambda self: os.getpid()))
    result: dict = {}

    def ask() -> None:
        r = post(orchard, "/v1/completions", {"prompt": "Go on", "max_tokens": 2000, "logit_bias": NEVER_END})
        result.update(status=r.status_code, body=r.json())

    waiter = threading.Thread(target=ask)
    waiter.start()
    wait_for(lambda: ray.get(server.counters.remote()).get("generation_tokens", 0) > 20, 30, "some tokens generated")
    os.kill(pid, signal.SIGSEGV)  # what a crash inside MLX looks like
    waiter.join(120)
    assert result["status"] == 502 and result["body"]["error"]["code"] == "model_crashed", result
    assert "not retried" in result["body"]["error"]["message"]
