"""The real coding-agent CLIs against a real Orchard: Claude Code 2.1.332 (`claude -p ... --output-format
json`, Anthropic Messages) and Codex 0.171.0 (`codex exec --json`, the Responses API), each in an empty
folder with a throwaway home, pinned releases installed by `make clients` (npm, with Node 22) into
.clients/. The model is llama-64k (random weights, a 64k context): Claude Code's prompt is ~20k of its
tokens with max_tokens 32000, so the session runs only because a max_tokens past the room left is
clamped. Codex gets a model catalog (`model_catalog_json`) that marks llama-64k as taking `apply_patch`
as a freeform (custom) tool, so its requests carry it as they do for OpenAI's models. A recording proxy (support/capture.py) keeps every request each CLI sent and its status;
Orchard's events show the model loaded, the CLIs' own output the usage Orchard reported. ORCHARD_RECORD_AGENTS=1 writes the
requests as tests/fixtures/agents/ (what test_agent_replay.py replays)."""

import json
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest
import requests
from ray import serve
from support.capture import CaptureProxy
from support.cluster import serve_orchard

pytestmark = [pytest.mark.cluster, pytest.mark.slow]  # each CLI's session prefills ~20k tokens a few times: ~1-2 min each

ROOT = Path(__file__).resolve().parent.parent
BIN = ROOT / ".clients" / "node_modules" / ".bin"
FIXTURES = ROOT / "tests" / "fixtures" / "agents"
MODEL = "llama-64k"
CLAUDE_VERSION = "2.1.332"
CODEX_VERSION = "0.171.0"


@pytest.fixture(scope="module")
def clis() -> Path:
    if not (BIN / "claude").exists() or not (BIN / "codex").exists():
        if shutil.which("npm") is None:
            pytest.skip("npm is needed to install the agent CLIs (make clients)")
        subprocess.run(["make", "-s", "clients"], cwd=ROOT, check=True, timeout=900)
    return BIN


@pytest.fixture(scope="module")
def orchard(models_dir, shared_ray):
    models = [{"name": MODEL, "kind": "llm", "path": MODEL, "reserve_context_tokens": 65536, "reserve_concurrency": 2}]
    base = serve_orchard({"models_dir": str(models_dir), "models": models, "policy": {"min_residency_s": 0, "residency_per_reload": 0}})
    proxy = CaptureProxy(base).start()
    yield {"base": base, "proxy": proxy}
    proxy.stop()
    serve.shutdown()


def _env(bin_dir: Path, home: str, **extra: str) -> dict[str, str]:
    path = f"{bin_dir}:{os.environ.get('PATH', '')}"
    return {"PATH": path, "HOME": home, "LANG": "C.UTF-8", **extra}


def _record(name: str, captured: list) -> None:
    if os.environ.get("ORCHARD_RECORD_AGENTS") != "1":
        return
    folder = FIXTURES / name
    folder.mkdir(parents=True, exist_ok=True)
    for old in folder.glob("*.json"):
        old.unlink()
    for i, c in enumerate(captured):
        (folder / f"{i:02d}-{c.path.strip('/').replace('/', '_')}.json").write_text(json.dumps(c.body, indent=1, ensure_ascii=False) + "\n")


def _loaded(base: str) -> bool:
    events = requests.get(base + "/v1/cluster/events", headers={"Authorization": "Bearer unused"}, timeout=30).json()["data"]
    return any(MODEL in json.dumps(e) for e in events)


def test_claude_code_completes_a_headless_session(clis, orchard):
    proxy: CaptureProxy = orchard["proxy"]
    start = len(proxy.requests)
    home, work = tempfile.mkdtemp(prefix="cc-home-"), tempfile.mkdtemp(prefix="cc-work-")
    env = _env(
        clis,
        home,
        CLAUDE_CONFIG_DIR=home,
        ANTHROPIC_BASE_URL=proxy.base,
        ANTHROPIC_API_KEY="unused",
        DISABLE_TELEMETRY="1",
        DISABLE_ERROR_REPORTING="1",
        DISABLE_AUTOUPDATER="1",
        CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC="1",
        API_TIMEOUT_MS="600000",
    )
    version = subprocess.run([str(clis / "claude"), "--version"], env=env, capture_output=True, text=True, timeout=60).stdout
    assert CLAUDE_VERSION in version
    run = subprocess.run(
        [str(clis / "claude"), "-p", "List the files in this folder.", "--model", MODEL, "--output-format", "json"],
        env=env,
        cwd=work,
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=900,
    )
    captured = proxy.requests[start:]
    _record(f"claude-code-{CLAUDE_VERSION}", captured)
    assert run.returncode == 0, (run.stdout[-2000:], run.stderr[-2000:], [(c.path, c.status, c.error[:300]) for c in captured])
    result = json.loads(run.stdout)
    assert result["is_error"] is False and result["type"] == "result", result
    messages = [c for c in captured if c.path == "/v1/messages"]
    assert messages and all(c.status == 200 for c in messages), [(c.path, c.status) for c in captured]
    first = messages[0].body
    assert first["max_tokens"] == 32000 and len(first["tools"]) >= 10  # the real request: it fits only clamped
    assert first["system"][0]["text"].startswith("x-anthropic-billing-header:")  # stripped before tokenising
    assert result["usage"]["input_tokens"] + result["usage"].get("cache_read_input_tokens", 0) > 5000
    assert _loaded(orchard["base"])


def _codex_catalog(home: str) -> Path:
    """A model catalog (Codex's `model_catalog_json`) naming llama-64k as a model that takes
    `apply_patch` as a freeform tool, as Codex's own catalog marks its models: the fields its
    ModelInfo requires, the context window, and as base instructions the ones Codex sends a model it
    does not know (the recorded first request's first developer message)."""
    recorded = json.loads((FIXTURES / f"codex-{CODEX_VERSION}" / "00-v1_responses.json").read_text())
    entry = {
        "slug": MODEL,
        "display_name": MODEL,
        "apply_patch_tool_type": "freeform",
        "supported_reasoning_levels": [{"effort": "medium", "description": "the only level"}],
        "shell_type": "shell_command",
        "visibility": "list",
        "supported_in_api": True,
        "priority": 1,
        "support_verbosity": False,
        "truncation_policy": {"mode": "tokens", "limit": 10000},
        "experimental_supported_tools": [],
        "context_window": 65536,
        "base_instructions": recorded["input"][0]["content"][0]["text"],
    }
    path = Path(home, "catalog.json")
    path.write_text(json.dumps({"models": [entry]}))
    return path


def test_codex_completes_a_headless_session(clis, orchard):
    proxy: CaptureProxy = orchard["proxy"]
    start = len(proxy.requests)
    home, work = tempfile.mkdtemp(prefix="codex-home-"), tempfile.mkdtemp(prefix="codex-work-")
    Path(home, "config.toml").write_text(
        f'model = "{MODEL}"\nmodel_provider = "orchard"\nmodel_catalog_json = "{_codex_catalog(home)}"\n\n'
        f'[model_providers.orchard]\nname = "Orchard"\nbase_url = "{proxy.base}/v1"\nwire_api = "responses"\nstream_idle_timeout_ms = 600000\n'
    )
    env = _env(clis, home, CODEX_HOME=home, OPENAI_API_KEY="unused")
    version = subprocess.run([str(clis / "codex"), "--version"], env=env, capture_output=True, text=True, timeout=60).stdout
    assert CODEX_VERSION in version
    run = subprocess.run(
        [str(clis / "codex"), "exec", "--skip-git-repo-check", "--ephemeral", "--json", "-s", "read-only", "Say hi."],
        env=env,
        cwd=work,
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=900,
    )
    captured = proxy.requests[start:]
    _record(f"codex-{CODEX_VERSION}", captured)
    events = [json.loads(line) for line in run.stdout.splitlines() if line.startswith("{")]
    assert run.returncode == 0, (
        [e for e in events if e.get("type") != "item.completed"],
        run.stderr[-3000:],
        [(c.path, c.status, c.error[:300]) for c in captured],
    )
    events = [json.loads(line) for line in run.stdout.splitlines() if line.startswith("{")]
    kinds = [e.get("type") for e in events]
    assert "turn.completed" in kinds and "turn.failed" not in kinds and "error" not in kinds, kinds
    done = next(e for e in events if e.get("type") == "turn.completed")
    assert done["usage"]["input_tokens"] > 2000
    sent = [c for c in captured if c.path == "/v1/responses"]
    assert sent and all(c.status == 200 for c in sent)
    first = sent[0].body
    types = {t["type"] for t in first["tools"]}
    assert {"namespace", "web_search", "custom"} <= types, types  # flattened, dropped (not refused), offered as is
    patch = next(t for t in first["tools"] if t["type"] == "custom")
    assert patch["name"] == "apply_patch" and patch["format"]["syntax"] == "lark"  # the catalog's freeform apply_patch
    assert all(c.headers.get("orchard-dropped-tools") == "web_search" for c in sent), [c.headers for c in sent]  # apply_patch kept
    assert first["prompt_cache_key"]
    assert _loaded(orchard["base"])
