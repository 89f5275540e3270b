"""``agentrl engine`` serving tiny Qwen2.5-VL and Qwen3-VL models built in code, as real subprocesses: greedy tokens
and logprobs equal to transformers' own ``generate`` on the same images and prompt, through ``/generate`` with
``image_data`` and the OpenAI chat path with ``image_url``; the prefix cache tells images apart; bad images and
images for a text model get a 400 naming the image."""

from __future__ import annotations

import base64
from pathlib import Path

import httpx
import openai
import pytest
import torch
from transformers import AutoModelForImageTextToText, AutoTokenizer

from agentrl.inference.tiny_model import build_tiny_vision_model
from agentrl.vision.images import load_image
from agentrl.vision.processor import VisionProcessor
from inference_fixtures import picture

pytestmark = pytest.mark.xdist_group("vision-engine")

FAMILIES = ("qwen2_5_vl", "qwen3_vl")
QUESTION = [{"type": "image"}, {"type": "text", "text": "What is in the picture?"}]


def data_uri(data: bytes, mime: str = "image/png") -> str:
    return f"data:{mime};base64,{base64.b64encode(data).decode()}"


@pytest.fixture(scope="module", params=FAMILIES)
def vision_model(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_vision_model(tmp_path_factory.mktemp(request.param), family=request.param)


def prompt_ids(model_dir: Path, content: list[dict], images: list[bytes], *, expand: bool) -> list[int]:
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    text = tokenizer.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True,
                                         tokenize=False)
    ids = tokenizer.encode(text, add_special_tokens=False)
    if not expand:
        return ids
    processor = VisionProcessor(model_dir)
    return processor.expand(ids, [processor.image_tokens(load_image(b, "test")) for b in images])


def reference(model_dir: Path, ids: list[int], images: list[bytes], new_tokens: int,
              model: torch.nn.Module | None = None) -> tuple[list[int], list[float]]:
    """transformers' greedy ``generate`` on the expanded ids and the images' pixel values: tokens and logprobs (of
    ``model``, by default the one in ``model_dir``)."""
    if model is None:
        model = AutoModelForImageTextToText.from_pretrained(model_dir, attn_implementation="sdpa").eval()
    processor = VisionProcessor(model_dir)
    inputs = processor.inputs([load_image(b, "test") for b in images])
    x = torch.tensor([ids])
    out = model.generate(input_ids=x, attention_mask=torch.ones_like(x), pixel_values=inputs.pixel_values,
                         image_grid_thw=inputs.image_grid_thw, mm_token_type_ids=(x == processor.image_token_id).int(),
                         max_new_tokens=new_tokens, do_sample=False, output_logits=True, return_dict_in_generate=True)
    tokens = out.sequences[0, len(ids):].tolist()
    logprobs = [torch.log_softmax(step[0].float(), -1)[t].item() for step, t in zip(out.logits, tokens, strict=True)]
    return tokens, logprobs


async def generate(url: str, body: dict) -> httpx.Response:
    async with httpx.AsyncClient(base_url=url, timeout=120) as http:
        return await http.post("/generate", json=body)


async def test_generate_with_images_equals_transformers(vision_engine: str, vision_model: Path) -> None:
    images = [picture(1), picture(2, (100, 56))]
    content = [{"type": "image"}, {"type": "text", "text": "and"}, *QUESTION]
    ids = prompt_ids(vision_model, content, images, expand=True)
    want_tokens, want_logprobs = reference(vision_model, ids, images, 12)
    for given in (ids, prompt_ids(vision_model, content, images, expand=False)):  # expanded, or one pad an image
        response = await generate(vision_engine, {
            "input_ids": given, "image_data": [data_uri(b) for b in images], "return_logprob": True,
            "sampling_params": {"max_new_tokens": 12, "temperature": 0, "ignore_eos": True}})
        assert response.status_code == 200, response.text
        payload = response.json()
        assert payload["output_ids"] == want_tokens
        assert payload["meta_info"]["prompt_tokens"] == len(ids)
        got = [entry[0] for entry in payload["meta_info"]["output_token_logprobs"]]
        assert max(abs(a - b) for a, b in zip(got, want_logprobs, strict=True)) < 1e-4


async def test_chat_with_an_image_url_equals_transformers(vision_engine: str, vision_model: Path) -> None:
    image = picture(3, kind="JPEG")
    ids = prompt_ids(vision_model, QUESTION, [image], expand=True)
    want_tokens, _ = reference(vision_model, ids, [image], 8)
    client = openai.AsyncOpenAI(base_url=f"{vision_engine}/v1", api_key="unused")
    reply = await client.chat.completions.create(
        model="tiny", max_tokens=8, temperature=0,
        messages=[{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": data_uri(image, "image/jpeg")}},
            {"type": "text", "text": "What is in the picture?"}]}])
    await client.close()
    tokenizer = AutoTokenizer.from_pretrained(vision_model)
    assert reply.usage.prompt_tokens == len(ids)
    assert reply.choices[0].message.content == tokenizer.decode(want_tokens, skip_special_tokens=True)


async def test_the_prefix_cache_tells_images_apart(vision_engine: str, vision_model: Path) -> None:
    """The same text with two pictures: each answer is its own picture's, asked first or after the other, again
    and again (a cache keyed by tokens alone would answer the second from the first's blocks)."""
    first, second = picture(4), picture(5)
    ids = prompt_ids(vision_model, QUESTION, [first], expand=True)
    answers = {}
    for image in (first, second, first, second):
        response = await generate(vision_engine, {
            "input_ids": ids, "image_data": data_uri(image),
            "sampling_params": {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True}})
        assert response.status_code == 200, response.text
        answers.setdefault(image, []).append(response.json()["output_ids"])
    for image, outputs in answers.items():
        assert outputs[0] == outputs[1] == reference(vision_model, ids, [image], 8)[0]
    assert answers[first][0] != answers[second][0]


async def test_requests_with_and_without_images_batched_together(vision_engine: str, vision_model: Path) -> None:
    """Six requests at once, four with their own picture (of other sizes: other token counts and rotary offsets)
    and two text-only, decode in shared steps: each gets the answer it gets alone."""
    import asyncio

    bodies = []
    for i in range(4):
        image = picture(20 + i, (56 + 28 * i, 84))
        bodies.append({"input_ids": prompt_ids(vision_model, QUESTION, [image], expand=False),
                       "image_data": [data_uri(image)]})
    for text in ("Tell me a story.", "Count to ten."):
        bodies.append({"input_ids": prompt_ids(vision_model, [{"type": "text", "text": text}], [], expand=False)})
    params = {"sampling_params": {"max_new_tokens": 16, "temperature": 0, "ignore_eos": True}}
    alone = [(await generate(vision_engine, body | params)).json()["output_ids"] for body in bodies]
    together = await asyncio.gather(*[generate(vision_engine, body | params) for body in bodies])
    assert [response.json()["output_ids"] for response in together] == alone
    assert len({tuple(output) for output in alone}) == len(alone)


async def test_prompt_logprobs_with_images(vision_engine: str, vision_model: Path) -> None:
    """``logprob_start_len`` over a prompt with an image: the text tokens after the image get the logprobs of a
    forward pass of transformers' model with the image."""
    image = picture(6)
    ids = prompt_ids(vision_model, QUESTION, [image], expand=True)
    response = await generate(vision_engine, {
        "input_ids": ids, "image_data": [data_uri(image)], "return_logprob": True, "logprob_start_len": 0,
        "sampling_params": {"max_new_tokens": 1, "temperature": 0}})
    assert response.status_code == 200, response.text
    got = [entry[0] for entry in response.json()["meta_info"]["input_token_logprobs"]][1:]
    model = AutoModelForImageTextToText.from_pretrained(vision_model, attn_implementation="sdpa").eval()
    processor = VisionProcessor(vision_model)
    inputs = processor.inputs([load_image(image, "test")])
    x = torch.tensor([ids])
    with torch.no_grad():
        logits = model(input_ids=x, pixel_values=inputs.pixel_values, image_grid_thw=inputs.image_grid_thw,
                       mm_token_type_ids=(x == processor.image_token_id).int()).logits[0, :-1]
    want = torch.log_softmax(logits.float(), -1).gather(-1, x[0, 1:, None])[:, 0].tolist()
    assert len(got) == len(want)
    assert max(abs(a - b) for a, b in zip(got, want, strict=True)) < 1e-4


@pytest.mark.parametrize(("image_data", "fragment"), [
    ("data:image/png;base64,bm90IGFuIGltYWdl", "image_data[0]: not an image"),
    (data_uri(picture(7)[:200]), "image_data[0]: the image cannot be decoded"),
    ("data:text/plain;base64,aGVsbG8=", "declares text/plain"),
    ("http://example.com/cat.png", "not as URLs or paths"),
    ("%%%", "not valid base64"),
])
async def test_bad_images_get_400_naming_the_image(vision_engine: str, vision_model: Path, image_data: str,
                                                   fragment: str) -> None:
    ids = prompt_ids(vision_model, QUESTION, [], expand=False)
    response = await generate(vision_engine, {"input_ids": ids, "image_data": [image_data],
                                              "sampling_params": {"max_new_tokens": 2}})
    assert response.status_code == 400 and fragment in response.text, response.text


async def test_images_that_do_not_fit_the_prompt_get_400(vision_engine: str, vision_model: Path) -> None:
    one = prompt_ids(vision_model, QUESTION, [], expand=False)
    pad = VisionProcessor(vision_model).image_token_id
    cases = [
        ({"input_ids": one, "image_data": [data_uri(picture(8)), data_uri(picture(9))]}, "2 image(s) given"),
        ({"input_ids": one}, "more image placeholders than the 0 image(s)"),
        ({"input_ids": [pad if i == pad else i for i in one for _ in range(3 if i == pad else 1)],
          "image_data": [data_uri(picture(8))]}, "its placeholder has 3 <|image_pad|> tokens"),
    ]
    for body, fragment in cases:
        response = await generate(vision_engine, {**body, "sampling_params": {"max_new_tokens": 2}})
        assert response.status_code == 400 and fragment in response.text, response.text


async def test_a_text_model_refuses_images(engine_url: str) -> None:
    response = await generate(engine_url, {"input_ids": [1, 2, 3], "image_data": [data_uri(picture(10))],
                                           "sampling_params": {"max_new_tokens": 2}})
    assert response.status_code == 400 and "text-only model" in response.text, response.text
    client = openai.AsyncOpenAI(base_url=f"{engine_url}/v1", api_key="unused")
    with pytest.raises(openai.BadRequestError, match="text-only model"):
        await client.chat.completions.create(model="tiny", max_tokens=2, messages=[{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": data_uri(picture(10))}}]}])
    await client.close()


@pytest.mark.parametrize("family", FAMILIES)
def test_token_counts_from_the_size_equal_the_processors_grids(family: str, tmp_path: Path) -> None:
    """Samplers count an image's tokens from its size alone; the engine and trainer from the processor's grid."""
    processor = VisionProcessor(build_tiny_vision_model(tmp_path, family=family, max_pixels=200 * 200))
    for size in [(1, 1), (28, 28), (60, 90), (90, 60), (13, 400), (223, 337), (640, 480)]:
        image = load_image(picture(0, size), "size")
        grid = processor.inputs([image]).grids()[0]
        assert processor.image_tokens(image) == processor.grid_tokens(grid), size


@pytest.mark.parametrize("kernels", ["this CPU's", "by row count (emulated)"])
async def test_the_same_image_prompt_gets_the_same_bits_cached_or_computed_whole(
        tmp_path: Path, kernels: str, monkeypatch: pytest.MonkeyPatch, emulate_matmul) -> None:
    """A greedy request with a picture, three times on one batcher (the prefix cache emptied, kept, emptied: its
    picture's blocks computed, then served from the cache): the same tokens and logprobs to the bit, on this CPU's
    kernels and on kernels that depend on the row count (``tests/emulated_kernels.py``, as a Xeon with AMX)."""
    from agentrl.inference import paged_attention
    from agentrl.inference.batching import BatchingConfig, ContinuousBatcher, RequestSampling
    from agentrl.inference.vision_inputs import VisionEncoder
    from emulated_kernels import count_kernel, long_query_sdpa

    if kernels != "this CPU's":
        emulate_matmul(lambda real: count_kernel(16, real))
        long_query_sdpa(64, monkeypatch)
    cached: list[bool] = []
    from_batch = paged_attention.StepLayout.from_batch.__func__

    def spy(cls, batch: dict, *args) -> paged_attention.StepLayout:
        layout = from_batch(cls, batch, *args)
        cached.extend(p.slots is not None for p in layout.prefills)
        return layout

    monkeypatch.setattr(paged_attention.StepLayout, "from_batch", classmethod(spy))
    model_dir = build_tiny_vision_model(tmp_path / "vlm")
    model = AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="sdpa")
    encoder = VisionEncoder(model, VisionProcessor(model_dir))
    batcher = ContinuousBatcher(model, BatchingConfig(max_total_tokens=2048, page_size=16), vision=encoder)
    image = picture(30, (84, 112))
    batcher.start()
    try:
        for content in (QUESTION, [{"type": "text", "text": "Look:"}, *QUESTION]):  # other lengths after the pages
            prompt = encoder.prompt(prompt_ids(model_dir, content, [image], expand=False), [load_image(image, "x")])
            runs = []
            for fresh in (True, False, True):
                if fresh:
                    batcher.reset_prefix_cache()
                cached.clear()
                runs.append(await batcher.generate(prompt.cache_ids, max_new_tokens=10, stop_token_ids=[],
                                                   sampling=RequestSampling(top_k=1), vision=prompt))
                assert cached[0] is not fresh, (fresh, cached)
            assert all(run.generated_tokens == runs[0].generated_tokens for run in runs)
            assert all(run.logprobs == runs[0].logprobs for run in runs), [run.logprobs for run in runs]
    finally:
        batcher.stop()
