"""OpenAI chat content parts with images: `{"type": "image_url", "image_url": {"url": ..., "detail": ...}}`
beside text parts, in user messages. A message whose content holds images keeps its parts in order (the
chat template shows each image where it stands); its `content` is the text alone."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError


class _Part(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


class TextPart(_Part):
    type: Literal["text"]
    text: str


class ImageURL(_Part):
    url: str
    detail: Literal["auto", "low", "high"] | None = None  # accepted; images are always seen at full detail


class ImageURLPart(_Part):
    type: Literal["image_url"]
    image_url: ImageURL


ContentPart = Annotated[TextPart | ImageURLPart, Field(discriminator="type")]
_PARTS = TypeAdapter(list[ContentPart])


def image_content_parts(message: Any) -> list[TextPart | ImageURLPart] | None:
    """The validated parts of a raw message whose content is a list holding an image part; None for any
    other message (text parts alone are joined by the message model itself). ValueError names the bad
    part, or an image outside a user message."""
    if not isinstance(message, dict) or not isinstance(message.get("content"), list):
        return None
    raw = message["content"]
    if not any(isinstance(part, dict) and part.get("type") == "image_url" for part in raw):
        return None
    try:
        parts = _PARTS.validate_python(raw)
    except ValidationError as error:
        first = error.errors(include_url=False)[0]
        loc = first["loc"]
        if len(loc) > 1 and isinstance(loc[0], int):  # (index, the part's type tag, field...)
            loc = (loc[0], *loc[2:])
        where = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in loc)
        raise ValueError(f"content{where}: {first['msg']}") from None
    if message.get("role") != "user":
        raise ValueError(
            f"content: image parts are only accepted in user messages, not {message.get('role')!r}"
        )
    return parts


def joined_text(parts: list[TextPart | ImageURLPart]) -> str:
    return "".join(part.text for part in parts if isinstance(part, TextPart))


def template_parts(parts: list[TextPart | ImageURLPart]) -> list[dict[str, Any]]:
    """The parts as chat templates read them: Qwen-VL's show `{"type": "image"}` as its placeholder
    (<|vision_start|><|image_pad|><|vision_end|>)."""
    return [
        {"type": "text", "text": part.text} if isinstance(part, TextPart) else {"type": "image"}
        for part in parts
    ]
