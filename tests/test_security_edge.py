"""The app's door tried from outside (issue 25 items 3 and 9), on the shared one-node cluster with an
admin key and a user key limited to llama-10m at rpm 5: through the Serve proxy and on the ingress
replica's own direct-ingress port, with raw HTTP (http.client: headers sent, the body held back or
sent in pieces), what is refused before the body arrives. Nothing here loads a model."""

import http.client
import json
import time
from urllib.parse import urlsplit

import openai
import pytest
import requests

ray = pytest.importorskip("ray")
from ray import serve  # noqa: E402
from support.cluster import key_entry, serve_orchard  # noqa: E402

from cluster.serve_endpoints import serve_http_host  # noqa: E402

pytestmark = pytest.mark.cluster  # starts or uses a Ray cluster: one worker runs these in turn (conftest.py)

ADMIN, USER = "sk-edge-admin", "sk-edge-user"
MAX_REQUEST, MAX_AUDIO = 32 * 1024, 64 * 1024
ANSWER_WITHIN_S = 10  # a server waiting for the body would never answer: the socket times out instead


@pytest.fixture(scope="module")
def orchard(models_dir, shared_ray):
    args = {
        "models_dir": str(models_dir),
        "api_keys": [
            key_entry("ops", ADMIN, "admin"),
            key_entry("team", USER, models=["llama-10m"], rpm=5),
        ],
        "max_request_bytes": MAX_REQUEST,
        "max_audio_bytes": MAX_AUDIO,
    }
    proxy = serve_orchard(args)
    deadline = time.monotonic() + 30
    while True:  # a replica's own server starts once it is ready: the list can lag the deploy
        ingress = requests.get(proxy + "/v1/cluster", headers={"authorization": f"Bearer {ADMIN}"}, timeout=30).json()["ingress"]
        if ingress or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert ingress, "no direct-ingress address: the shared cluster runs with cluster/environment.py's SERVE_ENV"
    yield {"proxy": proxy, "direct": ingress[0]["url"]}
    serve.shutdown()


def send(base: str, method: str, path: str, headers: dict[str, str], chunks: list[bytes] = ()) -> tuple[int, dict[str, str], dict]:
    """Send the request line and headers (and `chunks`, as they are), never finishing a body the
    headers promise; the answer (status, headers, JSON body) as the server gives it meanwhile."""
    url = urlsplit(base)
    conn = http.client.HTTPConnection(url.hostname, url.port, timeout=ANSWER_WITHIN_S)
    try:
        conn.putrequest(method, path, skip_host=True, skip_accept_encoding=True)
        for name, value in ({"host": url.netloc} | headers).items():
            conn.putheader(name, value)
        conn.endheaders()
        for chunk in chunks:
            conn.send(chunk)
        r = conn.getresponse()
        return r.status, {k.lower(): v for k, v in r.getheaders()}, json.loads(r.read() or b"null")
    finally:
        conn.close()


def chunked(total: int, piece: int = 4096) -> list[bytes]:
    return [b"%x\r\n%s\r\n" % (piece, b"x" * piece) for _ in range(total // piece)]  # no final 0-chunk: the body is still coming


VIA = ["proxy", "direct"]


def test_the_app_builder_reads_where_serve_listens(orchard):
    assert serve_http_host() == "127.0.0.1"  # what build_app checks against its keys (loopback: no admin key needed)


@pytest.mark.parametrize("via", VIA)
def test_no_key_and_a_huge_promised_body_is_a_401_at_once(orchard, via):
    status, headers, body = send(orchard[via], "POST", "/v1/chat/completions", {"content-type": "application/json", "content-length": str(10**12)})
    assert status == 401 and body["error"]["code"] == "invalid_api_key"
    assert headers.get("connection") == "close"
    status, _, body = send(orchard[via], "POST", "/v1/messages", {"content-type": "application/json", "transfer-encoding": "chunked"}, chunked(8192))
    assert status == 401 and body["type"] == "error"  # a slow chunked body: Anthropic's format under /v1/messages


@pytest.mark.parametrize("via", VIA)
def test_a_keyed_body_over_max_request_bytes_is_a_413(orchard, via):
    user = {"authorization": f"Bearer {USER}", "content-type": "application/json"}
    status, _, body = send(orchard[via], "POST", "/v1/chat/completions", user | {"content-length": str(MAX_REQUEST + 1)})
    assert status == 413 and body["error"]["code"] == "request_too_large"  # before a byte of the body was sent
    status, headers, body = send(orchard[via], "POST", "/v1/chat/completions", user | {"transfer-encoding": "chunked"}, chunked(MAX_REQUEST + 8192))
    assert status == 413 and headers.get("connection") == "close", body  # cut off as it arrives


@pytest.mark.parametrize("via", VIA)
def test_an_audio_upload_over_max_audio_bytes_is_a_413_before_the_upload(orchard, via):
    multipart = {"authorization": f"Bearer {USER}", "content-type": "multipart/form-data; boundary=b"}
    status, _, body = send(orchard[via], "POST", "/v1/audio/transcriptions", multipart | {"content-length": str(MAX_AUDIO + 1024**2)})
    assert status == 413 and "max_audio_bytes" in body["error"]["message"]


@pytest.mark.parametrize("via", VIA)
def test_an_unknown_host_is_refused_and_loopback_names_answer(orchard, via):
    admin = {"authorization": f"Bearer {ADMIN}"}
    status, _, body = send(orchard[via], "GET", "/v1/models", admin | {"host": "rebound.evil.example"})
    assert status == 421 and body["error"]["code"] == "host_not_allowed"  # the proxy passed the Host through
    port = urlsplit(orchard[via]).port
    for host in (f"localhost:{port}", f"127.0.0.1:{port}"):
        status, _, body = send(orchard[via], "GET", "/v1/models", {"authorization": f"Bearer {USER}", "host": host})
        assert status == 200 and [m["id"] for m in body["data"]] == ["llama-10m"], host  # the user key sees its model only


@pytest.mark.parametrize("via", VIA)
def test_clients_that_send_the_whole_body_first_read_the_413(orchard, via):
    """requests and the OpenAI SDK (httpx) write the whole body before reading: they still read the 413
    the server answered at once and closed on (not a connection error)."""
    user = {"authorization": f"Bearer {USER}", "content-type": "application/json"}
    r = requests.post(orchard[via] + "/v1/chat/completions", data=b" " * (4 * 1024**2), headers=user, timeout=30)
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"
    client = openai.OpenAI(base_url=orchard[via] + "/v1", api_key=USER, max_retries=0, timeout=30)
    with pytest.raises(openai.APIStatusError) as info:
        client.audio.transcriptions.create(model="llama-10m", file=("big.wav", b"RIFF" + b"\0" * (4 * 1024**2)))
    assert info.value.status_code == 413
