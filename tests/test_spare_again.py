"""Rule R1's other half in the model server (ModelServer.recycle, in a process of its own, as a
model server is: no Ray needed): a process started as a spare that stopped its model's engine
becomes a spare again, takes another model and serves it; it refuses (and so exits) when it was not
started as a spare, has held its most models, or its engine left a thread behind. A process of its
own: the checks read the whole process (MLX's memory, the engines' threads), and a test worker holds
other tests' engines."""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

SCRIPT = """
import asyncio, json, sys, threading
import deployments
from deployments.manifest import read_manifest
from deployments.model_server import ModelServer
from deployments.wire.generation import GenerationRequest

OPTIONS = {"prefix_disk_bytes": 0, "max_batch": 2}

async def main(models_dir):
    manifest = read_manifest(models_dir)
    out = {}
    server = ModelServer(None, models_dir, "n1")
    await server.take(manifest.entry("llama-10m"), models_dir, OPTIONS)
    await server.stop("evicted")
    out["held"] = await server.recycle(8)
    out["status"] = server.engine.health().status
    await server.take(manifest.entry("smollm2-135m-instruct"), models_dir, OPTIONS)
    reply = await server.engine.complete(GenerationRequest(prompt="Hello", max_tokens=3, temperature=0))
    out["completion_tokens"] = reply.usage.completion_tokens
    await server.stop("done")
    out["models_held"] = server.models_held
    out["third"] = await server.recycle(2)  # its second model: at most 2

    named = ModelServer(manifest.entry("llama-10m"), models_dir, "n1", engine_options=OPTIONS)
    await named.load()
    await named.stop("evicted")
    out["not_born_a_spare"] = await named.recycle(8)

    spare = ModelServer(None, models_dir, "n1")
    await spare.take(manifest.entry("llama-10m"), models_dir, OPTIONS)
    gate = threading.Event()
    stray = threading.Thread(target=gate.wait, name="mlx-left-behind")  # as an engine names its threads
    stray.start()
    await spare.stop("evicted")
    out["thread_left"] = await spare.recycle(8)
    gate.set()
    stray.join()
    print("RESULT " + json.dumps(out), flush=True)

asyncio.run(main(sys.argv[1]))
"""


def test_a_spare_takes_model_after_model_and_refuses_when_not_born_one_past_its_most_or_with_a_thread_left(models_dir):
    run = subprocess.run([sys.executable, "-c", SCRIPT, str(models_dir)], cwd=ROOT, capture_output=True, text=True, timeout=300)
    lines = [line for line in run.stdout.splitlines() if line.startswith("RESULT ")]
    assert run.returncode == 0 and lines, run.stderr[-3000:]
    out = json.loads(lines[-1][len("RESULT ") :])
    assert out["held"] is not None and out["held"] > 20 * 2**20 and out["status"] == "spare"
    assert out["completion_tokens"] == 3 and out["models_held"] == 2
    assert out["third"] is None  # two models held: it ends instead
    assert out["not_born_a_spare"] is None and out["thread_left"] is None


def test_a_process_counts_what_its_nodes_budget_stands_for(tmp_path, monkeypatch):
    """spare.process_bytes: on a CPU node (and a Mac) the process's resident memory; on CUDA its device
    memory, where the driver's count for the process comes from nvidia-smi (a stand-in executable on
    PATH here, printing what nvidia-smi prints: this machine has no GPU)."""
    import os

    import psutil

    from deployments.spare import driver_bytes, process_bytes

    rss = psutil.Process().memory_info().rss
    assert abs(process_bytes() - rss) < 0.05 * rss  # this process: CPU MLX, no CUDA
    assert driver_bytes() == 0  # no nvidia-smi here
    fake = tmp_path / "nvidia-smi"
    fake.write_text(f"#!/bin/sh\necho '{os.getpid()}, 1636'\necho '{os.getpid() + 1}, 80000'\necho '99999999, [N/A]'\n")
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}:{os.environ['PATH']}")
    assert driver_bytes() == 1636 * 2**20  # its own line, in MiB; another process's and an unreadable one's left out
    assert driver_bytes(os.getpid() + 1) == 80000 * 2**20
