"""A process that used an LLM engine exits cleanly, stopped or not (deployments/worker.py).

A worker thread that was left running, or that ended holding MLX's per-thread state, aborted its
process at interpreter exit now and then ("terminate called without an active exception", -6)
after every result was out. Here a script leaves its engine generating for four requests and
returns without stopping it: the worker's exit hook must end the loop and join the thread before
the interpreter finalizes. A hook of the script's own, registered before the engine's (atexit runs
the last registered first), sees which MLX worker threads are still alive after it."""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

NEVER_STOPPED = """
import atexit, json, threading

def after_the_engines():
    alive = [t.name for t in threading.enumerate() if t.name.startswith("mlx-")]
    print("ALIVE " + json.dumps(alive), flush=True)

atexit.register(after_the_engines)

import asyncio, sys
from deployments.engines.llm import LLMEngine
from deployments.wire.generation import GenerationRequest

class Count:
    deltas = 0

    def put_nowait(self, delta):
        self.deltas += 1

async def main(path):
    engine = LLMEngine("llama-10m", path, max_batch=4)
    await engine.load()
    sink = Count()
    for i in range(4):
        engine.start(GenerationRequest(prompt=f"Hello {i} " * 40, max_tokens=4000, temperature=0.7), sink)
    while sink.deltas < 20:
        await asyncio.sleep(0.01)
    print("RUNNING " + json.dumps(engine.running_requests()), flush=True)

asyncio.run(main(sys.argv[1]))
"""


def test_an_engine_left_generating_is_stopped_and_joined_at_exit(models_dir):
    run = subprocess.run([sys.executable, "-c", NEVER_STOPPED, str(models_dir / "llama-10m")], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, f"the engine's process ended with {run.returncode} (-6: an abort)\n{run.stderr[-3000:]}"
    lines = dict(line.split(" ", 1) for line in run.stdout.splitlines() if line.startswith(("RUNNING ", "ALIVE ")))
    assert json.loads(lines["RUNNING"]) > 0  # requests were still generating when the script returned
    assert json.loads(lines["ALIVE"]) == []  # its MLX thread had ended before the interpreter finalized
