"""VLMEngine on the real tiny random LLaVA (real MLX, real mlx-vlm loader and processor)."""

import asyncio
import base64
import io
import json

import pytest

import deployments  # noqa: F401  (OpenBLAS before MLX)
from deployments.engine import RequestError
from deployments.engines.vlm import VLMEngine
from deployments.manifest import safetensors_bytes
from deployments.model_prep import MARKER, llava_tiny

PROMPT = "What is in this picture?"


def png_bytes(size=(40, 30), color=(200, 30, 30)) -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", size, color).save(buf, format="PNG")
    return buf.getvalue()


def data_url(raw: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(raw).decode()


def user(text=PROMPT):
    return [{"role": "user", "content": text}]


async def collect(engine, messages, **kw):
    return [d async for d in engine.generate(messages, **kw)]


def run(coro):
    return asyncio.run(coro)


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    dest = tmp_path_factory.mktemp("models") / llava_tiny.NAME
    return dest, llava_tiny.build(dest)


@pytest.fixture(scope="module")
def image_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("allowed")
    (d / "red.png").write_bytes(png_bytes())
    return d


@pytest.fixture(scope="module")
def engine(built, image_dir):
    dest, _ = built
    eng = VLMEngine(llava_tiny.NAME, str(dest), allowed_image_dirs=[image_dir])
    run(eng.load())
    yield eng
    run(eng.stop())


def test_builder_is_idempotent_and_describes_the_folder(built):
    dest, entry = built
    stamp = (dest / "model.safetensors").stat().st_mtime_ns
    again = llava_tiny.build(dest)
    assert again == entry and (dest / "model.safetensors").stat().st_mtime_ns == stamp
    assert (dest / MARKER).exists()
    assert entry.kind == "vlm" and entry.weights == "random" and entry.architecture == "llava"
    assert entry.weight_bytes == safetensors_bytes(dest) > 0
    config = json.loads((dest / "config.json").read_text())
    assert config["model_type"] == "llava" and config["vision_config"]["model_type"] == "clip_vision_model"


def test_image_request_streams_and_counts_image_tokens(engine):
    deltas = run(collect(engine, user(), images=[data_url(png_bytes())], max_tokens=8))
    assert all(d.finish_reason is None and d.usage is None for d in deltas[:-1])
    last = deltas[-1]
    assert last.finish_reason in ("stop", "length") and last.usage is not None
    text_only = run(collect(engine, user(), images=[], max_tokens=1))[-1].usage
    patches = (llava_tiny.IMAGE_SIZE // llava_tiny.PATCH_SIZE) ** 2
    assert last.usage.prompt_tokens >= text_only.prompt_tokens + patches
    weights = engine.memory().weight_bytes  # measured: what the load made active
    assert abs(weights - safetensors_bytes(engine.path)) < 0.01 * safetensors_bytes(engine.path)


def test_image_part_in_content_and_allowed_file_path(engine, image_dir):
    messages = [{"role": "user", "content": [{"type": "image_url"}, {"type": "text", "text": PROMPT}]}]
    by_path = run(collect(engine, messages, images=[str(image_dir / "red.png")], max_tokens=4))
    by_url = run(collect(engine, user(), images=[data_url(png_bytes())], max_tokens=4))
    # Same pixels, same greedy decode: the path and the data URL reach the model identically.
    assert "".join(d.text for d in by_path) == "".join(d.text for d in by_url)
    assert by_path[-1].usage == by_url[-1].usage


def test_max_tokens_is_honoured(engine):
    for n in (1, 5):
        last = run(collect(engine, user(), images=[data_url(png_bytes())], max_tokens=n))[-1]
        # Random weights may hit EOS early ("stop"); otherwise generation ends at exactly n.
        assert last.finish_reason in ("stop", "length") and 1 <= last.usage.completion_tokens <= n
        if last.finish_reason == "length":
            assert last.usage.completion_tokens == n


def test_stop_string_cuts_the_stream(engine):
    img = [data_url(png_bytes())]
    full = "".join(d.text for d in run(collect(engine, user(), images=img, max_tokens=12)))
    if len(full) < 4:
        pytest.skip(f"greedy output too short to pick a stop string: {full!r}")
    stop = full[2:4]
    deltas = run(collect(engine, user(), images=img, max_tokens=12, stop=[stop]))
    assert deltas[-1].finish_reason == "stop"
    assert "".join(d.text for d in deltas) == full[: full.find(stop)]


def test_event_loop_keeps_running_during_generation(engine):
    async def main():
        ticks = 0

        async def ticker():
            nonlocal ticks
            while True:
                await asyncio.sleep(0.002)
                ticks += 1

        task = asyncio.create_task(ticker())
        await collect(engine, user(), images=[data_url(png_bytes())], max_tokens=16)
        task.cancel()
        return ticks

    assert run(main()) >= 3


@pytest.mark.parametrize(
    "kwargs, code",
    [
        ({"images": ["http://example.com/cat.png"]}, "unsupported"),
        ({"images": ["https://example.com/cat.png"]}, "unsupported"),
        ({"images": ["/etc/hostname"]}, "invalid_request"),
        ({"images": ["relative/cat.png"]}, "invalid_request"),
        ({"images": ["ftp://example.com/cat.png"]}, "invalid_request"),
        ({"images": ["data:image/png;base64,!!!not-base64!!!"]}, "invalid_request"),
        ({"images": ["data:image/png;base64," + base64.b64encode(b"not a png").decode()]}, "invalid_request"),
        ({"images": [data_url(png_bytes())] * 9}, "invalid_request"),  # past max_images (8)
        ({"images": [], "messages": []}, "invalid_request"),
        ({"images": [], "messages": user("   ")}, "invalid_request"),
        ({"images": [], "max_tokens": 0}, "invalid_request"),
    ],
)
def test_bad_requests_fail_alone(engine, kwargs, code):
    messages = kwargs.pop("messages", user())
    with pytest.raises(RequestError) as err:
        run(collect(engine, messages, **kwargs))
    assert err.value.code == code
    last = run(collect(engine, user(), images=[data_url(png_bytes())], max_tokens=2))[-1]
    assert last.finish_reason in ("stop", "length") and engine.health().status == "ready"


def test_path_escaping_the_allowed_folder_is_refused(engine, image_dir, tmp_path):
    (tmp_path / "secret.png").write_bytes(png_bytes())
    (image_dir / "link.png").symlink_to(tmp_path / "secret.png")
    for src in (str(image_dir / ".." / tmp_path.name / "secret.png"), str(image_dir / "link.png")):
        with pytest.raises(RequestError) as err:
            run(collect(engine, user(), images=[src]))
        assert err.value.code == "invalid_request"


def test_the_vision_step_is_measured_at_the_largest_image_the_processor_makes(engine):
    """llava's CLIP processor crops every image to 64 px, so a larger one measures nothing more; a
    processor that keeps an image's size (up to its own pixel ceiling) is measured at that ceiling,
    or at the largest image a request may send."""
    from types import SimpleNamespace

    from deployments.engines.vlm_memory import largest_image_side

    assert largest_image_side(4096 * 4096, engine._processor.image_processor) == llava_tiny.IMAGE_SIZE
    dynamic = SimpleNamespace(do_resize=True, size={"shortest_edge": 56, "longest_edge": 1 << 20}, max_pixels=1000 * 1000)
    assert largest_image_side(4096 * 4096, dynamic) == 1000
    assert largest_image_side(500 * 500, dynamic) == 500
    assert largest_image_side(300 * 300, None) == 300
