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
_KINDS = '{"type": "text", "text": "..."} or {"type": "image_url", "image_url": {"url": "data:..."}}'


def content_parts(raw: list[Any]) -> list[TextPart | ImageURLPart]:
    """A content list's parts, validated; ValueError naming the bad part (`[1].image_url.url: ...`)."""
    try:
        return _PARTS.validate_python(raw)
    except ValidationError as error:
        first = error.errors(include_url=False)[0]
        if first["type"] in ("union_tag_invalid", "union_tag_not_found", "model_type"):
            raise ValueError(f"content parts must be {_KINDS}") from None
        loc = first["loc"]
        if len(loc) > 1 and isinstance(loc[0], int):  # (index, the part's type tag, field...)
            loc = (loc[0], *loc[2:])
        where = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in loc)
        raise ValueError(f"{where}: {first['msg']}") from None


def image_content_parts(message: Any) -> list[TextPart | ImageURLPart] | None:
    """The parts of a raw message whose content is a list holding an image part (already validated by
    the message model); None for any other message."""
    content = message.get("content") if isinstance(message, dict) else None
    if not isinstance(content, list):
        return None
    if not any(isinstance(part, dict) and part.get("type") == "image_url" for part in content):
        return None
    return content_parts(content)


def joined_text(parts: list[TextPart | ImageURLPart]) -> str:
    return "".join(part.text for part in parts if isinstance(part, TextPart))


def template_parts(parts: list[TextPart | ImageURLPart]) -> list[dict[str, Any]]:
    """The parts as chat templates read them: Qwen-VL's show `{"type": "image"}` as its placeholder
    (<|vision_start|><|image_pad|><|vision_end|>)."""
    return [
        {"type": "text", "text": part.text} if isinstance(part, TextPart) else {"type": "image"}
        for part in parts
    ]
