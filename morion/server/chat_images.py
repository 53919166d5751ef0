"""The images of a chat request: read from their `image_url` parts, decoded and resized off the event loop
(multimodal/image_decode.py), and each image placeholder token of the rendered prompt expanded to the
image's tokens.

URLs: `data:image/png|jpeg|webp;base64,...` always; `file://PATH` only under the directory the server
was started with (`--allowed-local-media-path`, off by default); http(s) never (the server fetches
nothing from the network). Every problem is a 400 naming the part (`messages[i].content[j].image_url`).
"""

from __future__ import annotations

import asyncio
import base64
import binascii
from pathlib import Path
from urllib.parse import unquote, urlsplit

from morion.multimodal.image_decode import ImageError, PreparedImage, prepare_image
from morion.server.engine_messages import EngineInfo
from morion.server.errors import APIError
from morion.server.prepare import RenderedChat
from morion.server.protocol import ChatCompletionRequest

MAX_IMAGE_FILE_BYTES = 32 * 2**20  # a file:// image larger than this is refused before it is read
_DATA_TYPES = ("image/png", "image/jpeg", "image/jpg", "image/webp")


async def chat_images(
    body: ChatCompletionRequest, info: EngineInfo, local_media: Path | None
) -> list[PreparedImage]:
    """The request's images in prompt order; [] without image parts."""
    parts = [
        (f"messages[{m}].content[{p}].image_url", image_url.url)
        for m, message in enumerate(body.messages)
        for p, image_url in message.image_urls
    ]
    if not parts:
        return []
    if info.images is None:
        raise APIError(400, f"this model ({info.model_type}) takes no images", param=parts[0][0])
    processing = info.images.processing

    def prepare_all() -> list[PreparedImage]:
        images, tokens = [], 0
        for param, url in parts:
            try:
                image = prepare_image(read_image_url(url, local_media), processing)
            except ImageError as error:
                raise APIError(400, f"{param}: {error}", param=param) from None
            images.append(image)
            # Stop at the first image past the context: a body of many tiny images would otherwise have
            # every one decoded and upscaled before the prompt's length is checked.
            tokens += image.num_tokens(processing.merge_size)
            if tokens >= info.max_model_len:
                raise APIError(
                    400,
                    f"{param}: the images up to this one take {tokens} tokens, but this server's context is "
                    f"{info.max_model_len} tokens",
                    param=param,
                    code="context_length_exceeded",
                )
        return images

    return await asyncio.to_thread(prepare_all)


def read_image_url(url: str, local_media: Path | None) -> bytes:
    """The bytes of an image URL; ImageError for anything this server does not read."""
    scheme = url.split(":", 1)[0].lower() if ":" in url else ""
    if scheme == "data":
        return _data_url(url)
    if scheme == "file":
        return _local_file(url, local_media)
    if scheme in ("http", "https"):
        raise ImageError(
            "this server does not fetch images from the network; send the image inline as a "
            "data:image/...;base64 URL"
        )
    raise ImageError(f"unsupported image URL scheme {scheme or url[:16]!r} (send a data: URL)")


def _data_url(url: str) -> bytes:
    header, comma, payload = url.partition(",")
    if not comma:
        raise ImageError("a data: URL needs a comma before its data")
    media_type, *options = header[len("data:") :].split(";")
    if media_type.lower() not in _DATA_TYPES:
        raise ImageError(f"unsupported image type {media_type or 'none'!r} (png, jpeg or webp)")
    if "base64" not in (option.lower() for option in options):
        raise ImageError("the data: URL must be base64-encoded (data:image/...;base64,...)")
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise ImageError("the data: URL's base64 data is invalid") from None


def _local_file(url: str, local_media: Path | None) -> bytes:
    if local_media is None:
        raise ImageError(
            "file:// images are off on this server (start it with --allowed-local-media-path DIR to "
            "read images under DIR)"
        )
    split = urlsplit(url)
    if split.netloc not in ("", "localhost"):
        raise ImageError(f"file:// URLs name a local path, not a host ({split.netloc!r})")
    path = Path(unquote(split.path)).resolve()
    root = local_media.resolve()
    if not path.is_relative_to(root):
        raise ImageError(f"{path} is outside the allowed local media path {root}")
    try:
        size = path.stat().st_size
        if size > MAX_IMAGE_FILE_BYTES:
            raise ImageError(f"{path} is {size} bytes; at most {MAX_IMAGE_FILE_BYTES} are read")
        return path.read_bytes()
    except OSError as error:
        raise ImageError(f"cannot read {path}: {error.strerror}") from None


def with_image_tokens(rendered: RenderedChat, images: list[PreparedImage], info: EngineInfo) -> RenderedChat:
    """The rendered prompt with each image placeholder token expanded to its image's token count (the
    template writes one per image part)."""
    if not images:
        return rendered
    token = info.images.image_token_id
    merge = info.images.processing.merge_size
    placeholders = rendered.token_ids.count(token)
    if placeholders != len(images):
        raise APIError(
            400,
            f"the chat template shows {placeholders} image placeholders (token {token}) for {len(images)} "
            "images",
            param="messages",
        )
    counts = iter(image.num_tokens(merge) for image in images)
    token_ids: list[int] = []
    for token_id in rendered.token_ids:
        token_ids.extend([token] * next(counts) if token_id == token else [token_id])
    return RenderedChat(rendered.text, token_ids)
