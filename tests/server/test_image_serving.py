"""Images through a real `morion serve` of a tiny Qwen3.8-Flash-Next with its vision tower (tests/tiny_vlm.py:
config, preprocessor config, tokenizer and chat template in a directory; weights drawn at load), driven by the
official `openai` client: image_url parts with data: URLs (PNG, JPEG, WebP), usage with image tokens, the
prefix cache keyed by image content, the render endpoint's placeholders, and a 400 naming the part for
every bad image, after which the server still answers."""

from __future__ import annotations

import base64
import io
import json
import struct
import zlib

import openai
import pytest
from PIL import Image

from morion.cli import main
from tests import tiny_vlm
from tests.server.conftest import start_server, stop

MODEL = "tiny-vlm"
# 37x53 resizes to 40x56 pixels: 10x14 patches of 4, 5x7 merged tokens
FIRST = tiny_vlm.png(37, 53, seed=0)
FIRST_TOKENS = 35
SECOND = tiny_vlm.png(37, 53, seed=1)


@pytest.fixture(scope="module")
def vlm_server(tmp_path_factory):
    # Weights drawn by the server (tests/models/test_qwen4_exp_images.py loads the saved ones against
    # transformers); what is served here is the model's directory as users have it, but its safetensors.
    directory = tmp_path_factory.mktemp("tiny_vlm_serve")
    tiny_vlm.write_without_weights(directory)
    flags = ["--model", str(directory), "--load-format", "dummy", "--device", "cpu", "--page-size", "8"]
    # A context of 1024: the test of images past it decodes 30 of them, not 118.
    flags += ["--kv-cache-tokens", "4096", "--chunk-size", "64", "--max-model-len", "1024"]
    running = start_server([*flags, "--served-model-name", MODEL], directory / "serve.log")
    yield running
    assert stop(running) == 0, running.log()


def _data_url(data: bytes, media_type: str = "image/png") -> str:
    return f"data:{media_type};base64,{base64.b64encode(data).decode()}"


def _messages(*urls: str, text: str = "What is in the picture?") -> list[dict]:
    parts = [{"type": "text", "text": "Look: "}]
    parts += [{"type": "image_url", "image_url": {"url": url}} for url in urls]
    return [{"role": "user", "content": [*parts, {"type": "text", "text": text}]}]


def _ask(server, messages: list[dict]):
    with server.openai() as client:
        return client.chat.completions.create(
            model=MODEL, messages=messages, max_tokens=4, temperature=0, extra_body={"ignore_eos": True}
        )


def _encoded(data: bytes, fmt: str, **options) -> bytes:
    buffer = io.BytesIO()
    Image.open(io.BytesIO(data)).save(buffer, format=fmt, **options)
    return buffer.getvalue()


def test_image_parts_are_answered_with_image_tokens_counted(vlm_server):
    reply = _ask(vlm_server, _messages(_data_url(FIRST)))
    choice = reply.choices[0]
    assert choice.finish_reason == "length" and isinstance(choice.message.content, str)
    assert reply.usage.completion_tokens == 4
    assert reply.usage.prompt_tokens_details.image_tokens == FIRST_TOKENS
    text_only = _ask(vlm_server, [{"role": "user", "content": "Look: What is in the picture?"}])
    # the image is its tokens plus <|vision_start|> and <|vision_end|>
    assert reply.usage.prompt_tokens == text_only.usage.prompt_tokens + FIRST_TOKENS + 2
    assert text_only.usage.prompt_tokens_details.image_tokens is None


def test_the_same_image_hits_the_prefix_cache_and_another_does_not(vlm_server):
    first = _ask(vlm_server, _messages(_data_url(FIRST), text="Describe it."))
    again = _ask(
        vlm_server,
        _messages(_data_url(_encoded(FIRST, "WEBP", lossless=True), "image/webp"), text="Describe it."),
    )
    other = _ask(vlm_server, _messages(_data_url(SECOND), text="Describe it."))
    # Lossless WebP of the same pixels: the same content hash, the whole prompt but its tail cached.
    assert again.usage.prompt_tokens_details.cached_tokens >= again.usage.prompt_tokens - 8
    assert again.choices[0].message.content == first.choices[0].message.content
    # Another image after the same text: only the pages before the image come from the cache.
    assert other.usage.prompt_tokens_details.cached_tokens < 8


def test_two_images_and_jpeg(vlm_server):
    reply = _ask(vlm_server, _messages(_data_url(FIRST), _data_url(_encoded(SECOND, "JPEG"), "image/jpeg")))
    assert reply.usage.prompt_tokens_details.image_tokens == 2 * FIRST_TOKENS


def test_render_shows_the_placeholders_and_the_image_tokens(vlm_server):
    with vlm_server.http() as http:
        rendered = http.post(
            "/v1/chat/completions/render", json={"model": MODEL, "messages": _messages(_data_url(FIRST))}
        ).json()
    assert "Look: <|vision_start|><|image_pad|><|vision_end|>What is in the picture?" in rendered["prompt"]
    assert (
        rendered["token_ids"].count(tiny_vlm.IMAGE_TOKEN)
        == FIRST_TOKENS
        == rendered["count"] - (len(rendered["token_ids"]) - FIRST_TOKENS)
    )


def _png_claiming(width: int, height: int) -> bytes:
    """A valid 1x1 PNG whose header claims another size (decoding would fail; the size check comes
    first)."""
    data = bytearray(tiny_vlm.png(1, 1, seed=2))
    ihdr = data[12:29]  # type + 13 bytes of IHDR data
    ihdr[4:12] = struct.pack(">II", width, height)
    data[12:29] = ihdr
    data[29:33] = struct.pack(">I", zlib.crc32(bytes(ihdr)))
    return bytes(data)


BAD_IMAGES = [
    ("corrupt base64", "data:image/png;base64,iVBORw0K$$$", "base64"),
    ("not an image", _data_url(b"hello, this is text"), "not an image"),
    ("truncated png", _data_url(FIRST[: len(FIRST) // 2]), "could not be decoded"),
    ("unsupported type", _data_url(b"GIF89a", "image/gif"), "image/gif"),
    ("gif under a png type", _data_url(_encoded(FIRST, "GIF")), "not an image"),
    ("oversized", _data_url(_png_claiming(9000, 9000)), "pixels accepted"),
    ("decompression bomb", _data_url(_png_claiming(20000, 20000)), "pixels accepted"),
    ("extreme aspect ratio", _data_url(tiny_vlm.png(1, 300, seed=3)), "aspect ratio"),
    ("http URL", "https://example.com/cat.png", "does not fetch"),
    ("file URL while off", "file:///etc/hostname", "--allowed-local-media-path"),
]


@pytest.mark.parametrize(("case", "url", "words"), BAD_IMAGES, ids=[case for case, _, _ in BAD_IMAGES])
def test_bad_image_is_a_400_naming_the_part(vlm_server, case, url, words):
    with vlm_server.openai() as client, pytest.raises(openai.BadRequestError) as raised:
        client.chat.completions.create(model=MODEL, messages=_messages(_data_url(FIRST), url), max_tokens=2)
    error = raised.value.body
    assert error["param"] == "messages[0].content[2].image_url", error
    assert words in error["message"], error


def test_images_past_the_context_are_refused_at_the_first_that_does_not_fit(vlm_server):
    """Each image is decoded only while the images so far fit the context: the 400 names the first one
    past it, not the last of the request."""
    with vlm_server.openai() as client:
        max_model_len = client.models.retrieve(MODEL).model_extra["max_model_len"]
        first_past = -(-max_model_len // FIRST_TOKENS)  # the image whose tokens reach the context
        too_many = _messages(*[_data_url(FIRST)] * (first_past + 20))
        with pytest.raises(openai.BadRequestError) as raised:
            client.chat.completions.create(model=MODEL, messages=too_many, max_tokens=2)
    error = raised.value.body
    assert error["code"] == "context_length_exceeded", error
    assert error["param"] == f"messages[0].content[{first_past}].image_url", error  # content[0] is text


def test_image_part_outside_a_user_message_is_refused(vlm_server):
    messages = [
        {"role": "assistant", "content": [{"type": "image_url", "image_url": {"url": _data_url(FIRST)}}]}
    ]
    with vlm_server.http() as http:
        response = http.post("/v1/chat/completions", json={"model": MODEL, "messages": messages})
    assert response.status_code == 400 and "user messages" in response.json()["error"]["message"]


def test_the_server_still_answers_after_bad_images(vlm_server):
    assert _ask(vlm_server, _messages(_data_url(FIRST))).choices[0].finish_reason == "length"


def test_validate_vision_passes_against_the_server(vlm_server, tmp_path):
    """`morion validate vision`: frozen image cases, token counts from the processor settings the server
    reports, repeats equal, the corrupt image refused. Each case costs three served answers: two of the
    four take every frozen image (the JPEG alone; the PNG and the WebP together) and every resize path
    (96x72 and 200x40 resized, 64x48 kept); the other two are those images alone."""
    cases = "jpeg-checkerboard,two-images"
    argv = ["validate", "vision", "--url", vlm_server.base_url, "--out", str(tmp_path), "--cases", cases]
    assert main(argv) == 0
    (result_path,) = tmp_path.glob("*.json")
    suite = json.loads(result_path.read_text())["suites"]["vision"]
    assert suite["verdict"] == "pass" and suite["processing"] == "server_info"
    counts = {case["id"]: (case["expected_image_tokens"], case["image_tokens"]) for case in suite["cases"]}
    # Tokens of 8x8 pixels, at most 4096 pixels: 96x72 becomes 72x48 (9x6 tokens); 64x48 keeps its size
    # (8x6) and 200x40 becomes 136x24 (17x3).
    assert counts == {"jpeg-checkerboard": (54, 54), "two-images": (48 + 51, 99)}
    assert suite["corrupt_image"]["status"] == 400
