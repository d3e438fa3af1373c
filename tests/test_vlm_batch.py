"""VLMEngine batching on the real tiny random LLaVA (real MLX, real mlx-vlm loader, processor and
BatchGenerator): concurrent requests decode in one batch and write what each would write alone,
and what mlx-vlm's own one-request path writes; a request may carry several images; a bad image
fails its request alone, with an error naming it; a closed stream leaves the batch."""

import asyncio
import base64
import io

import pytest

import deployments  # noqa: F401  (OpenBLAS before MLX)
from deployments.engine import RequestError
from deployments.engines.vlm import VLMEngine
from deployments.model_prep import llava_tiny

MAX_TOKENS = 12
PATCHES = (llava_tiny.IMAGE_SIZE // llava_tiny.PATCH_SIZE) ** 2  # image tokens per image


def image(color, size=(40, 30)):
    from PIL import Image

    return Image.new("RGB", size, color)


def data_url(img) -> str:
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def messages(text: str, n_images: int) -> list[dict]:
    return [{"role": "user", "content": [{"type": "image_url"}] * n_images + [{"type": "text", "text": text}]}]


# (prompt, image colours): prompts of different lengths, none, one and several images
CASES = [
    ("What is in this picture?", [(200, 30, 30)]),
    ("Compare these two pictures, please.", [(0, 200, 0), (0, 0, 200)]),
    ("Hello there, how are you today?", []),
    ("x", [(9, 9, 9)]),
    ("Three pictures: which one is darkest?", [(250, 250, 250), (120, 60, 0), (10, 10, 40)]),
    ("Describe the colour.", [(30, 140, 210)]),
    ("Tell me a story about the sea and the sky and the wind.", []),
    ("Is it red?", [(255, 0, 0)]),
]


async def answer(engine, text, colors, **kw):
    deltas = [
        d async for d in engine.generate(messages(text, len(colors)), images=[data_url(image(c)) for c in colors], **{"max_tokens": MAX_TOKENS, **kw})
    ]
    assert all(d.finish_reason is None for d in deltas[:-1]) and deltas[-1].finish_reason in ("stop", "length")
    return "".join(d.text for d in deltas), deltas[-1].usage


def run(coro):
    return asyncio.run(coro)


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    dest = tmp_path_factory.mktemp("models") / llava_tiny.NAME
    llava_tiny.build(dest)
    return dest


@pytest.fixture(scope="module")
def engine(folder):
    eng = VLMEngine(llava_tiny.NAME, str(folder))
    run(eng.load())
    yield eng
    run(eng.stop())


@pytest.fixture(scope="module")
def alone(engine):
    """Each case's greedy answer with nothing else running (one at a time)."""
    return [run(answer(engine, text, colors)) for text, colors in CASES]


def reference(folder, text, colors) -> str:
    """mlx-vlm's own one-request greedy generation (stream_generate, as the engine ran before it
    batched), on a model loaded here: the text of its first MAX_TOKENS tokens."""
    import mlx_vlm
    from mlx_vlm.generate import stream_generate

    model, processor = mlx_vlm.load(str(folder))
    prompt = processor.tokenizer.apply_chat_template(messages(text, len(colors)), tokenize=False, add_generation_prompt=True)
    inputs = processor(text=[prompt], images=[image(c) for c in colors] or None)
    pieces = [
        r.text
        for r in stream_generate(
            model,
            processor,
            prompt,
            input_ids=inputs["input_ids"],
            pixel_values=inputs.get("pixel_values"),
            mask=inputs.get("attention_mask"),
            max_tokens=MAX_TOKENS,
            temperature=0.0,
        )
        if r.generation_tokens <= MAX_TOKENS
    ]
    return "".join(pieces)


def gather(engine, cases, **kw):
    async def main():
        return await asyncio.gather(*(answer(engine, text, colors, **kw) for text, colors in cases), return_exceptions=True)

    return run(main())


def test_concurrent_requests_decode_in_one_batch_and_answer_as_alone(engine, alone, folder):
    before = engine.counters()
    together = gather(engine, CASES)
    after = engine.counters()
    assert together == alone  # same texts, same usage, however the batch was made up
    steps = after["decode_steps"] - before["decode_steps"]
    rows = after["decode_rows"] - before["decode_rows"]
    assert after["max_decode_rows"] > 1 and rows > steps  # steps carried several requests
    assert after["admitted_requests"] - before["admitted_requests"] == len(CASES)
    assert after["images_encoded"] - before["images_encoded"] == sum(len(c) for _, c in CASES)
    # and what mlx-vlm's own single-request path writes: the batch changes no token
    assert [text for text, _ in alone] == [reference(folder, text, colors) for text, colors in CASES]


def test_a_request_carries_several_images(engine, alone):
    three = CASES[4]
    text, usage = alone[4]
    _, text_only = run(answer(engine, three[0], []))
    assert usage.prompt_tokens >= text_only.prompt_tokens + 3 * PATCHES  # every image's tokens are in the prompt
    reordered = run(answer(engine, three[0], list(reversed(three[1]))))
    assert reordered[1] == usage  # the same images in another order: the same prompt length
    with pytest.raises(RequestError, match=r"at most 8 image\(s\) per request") as err:
        run(answer(engine, "too many", [(1, 2, 3)] * 9))
    assert err.value.code == "invalid_request" and err.value.param == "images"


def test_a_bad_image_fails_its_request_alone_naming_it(engine, alone):
    good = [CASES[0], CASES[1], CASES[2]]
    not_png = "data:image/png;base64," + base64.b64encode(b"not a png at all").decode()
    huge = data_url(image((1, 1, 1), size=(5000, 4000)))  # 20 Mpx, over the 16 Mpx limit

    async def bad(images):
        return [d async for d in engine.generate(messages("bad", len(images)), images=images, max_tokens=MAX_TOKENS)]

    async def main():
        return await asyncio.gather(
            *(answer(engine, text, colors) for text, colors in good),
            bad([not_png]),
            bad([data_url(image((5, 5, 5))), huge]),
            bad(["data:image/png;base64,!!!"]),
            return_exceptions=True,
        )

    *answers, corrupt, too_big, not_base64 = run(main())
    assert answers == alone[:3]
    for err, says in (
        (corrupt, r"images\[0\] cannot be decoded"),
        (too_big, r"images\[1\] has more than"),
        (not_base64, r"images\[0\] cannot be decoded"),
    ):
        assert isinstance(err, RequestError) and err.code == "invalid_request" and err.param == "images"
        with pytest.raises(RequestError, match=says):
            raise err
    assert engine.health().status == "ready" and engine.running_requests() == 0


def test_a_closed_stream_leaves_the_batch(engine, alone):
    async def main():
        stream = engine.generate(messages("a long answer", 1), images=[data_url(image((0, 0, 0)))], max_tokens=1000)
        first = await anext(stream)
        await stream.aclose()  # the client went away after its first delta
        before = engine.counters()
        after_close = await answer(engine, *CASES[0])
        return first, before, after_close

    first, before, after_close = run(main())
    after = engine.counters()
    assert first.finish_reason is None and after_close == alone[0]
    # the closed request was out of the batch before the next one joined: that one decoded alone
    # (a step or so of the closed one may still fall after `before`: it ran alone too)
    assert after["decode_rows"] - before["decode_rows"] == after["decode_steps"] - before["decode_steps"]
    assert engine.running_requests() == 0 and engine.memory().kv_bytes_in_use == 0


def test_rows_sample_by_their_own_settings_in_one_call(engine, alone):
    before = engine.counters()
    mixed = gather(engine, [CASES[0], CASES[1]], temperature=0.0) + gather(engine, [CASES[2], CASES[3]], temperature=1.5, top_p=0.9)
    after = engine.counters()
    assert mixed[:2] == alone[:2]  # greedy rows stay greedy
    assert all(usage.completion_tokens >= 1 for _, usage in mixed)
    calls = after["sampling_calls"] - before["sampling_calls"]
    assert calls > 0 and after["sampled_rows"] - before["sampled_rows"] > calls  # one call for several rows

    async def side_by_side():  # a greedy row beside a sampling one, in the same steps
        return await asyncio.gather(answer(engine, *CASES[5]), answer(engine, *CASES[6], temperature=1.0))

    greedy, _ = run(side_by_side())
    assert greedy == alone[5]


def test_max_batch_caps_the_rows_and_the_rest_wait_their_turn(folder, alone):
    capped = VLMEngine(llava_tiny.NAME, str(folder), max_batch=3, prefill_batch=2)
    run(capped.load())
    try:
        together = gather(capped, CASES)
        counters = capped.counters()
    finally:
        run(capped.stop())
    assert together == alone
    assert 1 < counters["max_decode_rows"] <= 3 and counters["admitted_requests"] == len(CASES)
