"""Rule R1's other half in the model server (ModelServer.recycle, in process: no Ray needed): a
process started as a spare that stopped its model's engine becomes a spare again, takes another
model and serves it; it refuses (and so exits) when it was not started as a spare, has held its
most models, or its engine left a thread behind."""

import asyncio
import threading

import pytest

from deployments.manifest import read_manifest
from deployments.model_server import ModelServer
from deployments.wire.generation import GenerationRequest

OPTIONS = {"prefix_disk_bytes": 0, "max_batch": 2}


@pytest.fixture(scope="module")
def manifest(models_dir):
    return read_manifest(models_dir)


def test_a_spare_that_stopped_its_model_takes_the_next_one_and_serves_it(models_dir, manifest):
    async def scenario():
        server = ModelServer(None, str(models_dir), "n1")
        await server.take(manifest.entry("llama-10m"), str(models_dir), OPTIONS)
        await server.stop("evicted")
        held = await server.recycle(8)
        status = server.engine.health().status
        await server.take(manifest.entry("smollm2-135m-instruct"), str(models_dir), OPTIONS)
        reply = await server.engine.complete(GenerationRequest(prompt="Hello", max_tokens=3, temperature=0))
        await server.stop("done")
        again = await server.recycle(2)  # its second model: at most 2
        return held, status, server, reply, again

    held, status, server, reply, again = asyncio.run(scenario())
    assert held is not None and held > 20 * 2**20 and status == "spare"
    assert server.models_held == 2 and reply.usage.completion_tokens == 3
    assert again is None  # two models held: it ends instead


def test_a_process_not_born_a_spare_or_with_a_thread_left_behind_is_not_a_spare_again(models_dir, manifest):
    async def scenario():
        named = ModelServer(manifest.entry("llama-10m"), str(models_dir), "n1", engine_options=OPTIONS)
        await named.load()
        await named.stop("evicted")
        spare = ModelServer(None, str(models_dir), "n1")
        await spare.take(manifest.entry("llama-10m"), str(models_dir), OPTIONS)
        gate = threading.Event()
        stray = threading.Thread(target=gate.wait, name="mlx-left-behind")  # as an engine names its threads
        stray.start()
        await spare.stop("evicted")
        try:
            return await named.recycle(8), await spare.recycle(8)
        finally:
            gate.set()
            stray.join()

    assert asyncio.run(scenario()) == (None, None)
