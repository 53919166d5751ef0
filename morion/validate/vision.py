"""`vision`: images through `/v1/chat/completions` (OpenAI `image_url` parts with data: URLs), graded
against the frozen cases of `cases/vision-v1.json` and the image files beside it.

Per case: the question with its images, the same question without them, and the first request again.
Pass: every request answers (a stream that ends, a finish reason, at least one token); the image tokens
the server counts equal what the processor's settings make of the images (`ImageProcessing.num_tokens`:
from `/v1/server_info` where the server reports them, as morion does, else Qwen3-VL's published ones)
(`usage.prompt_tokens_details.image_tokens` where reported; else the prompt grows by at least that and at
most 4 more per image, the placeholder tokens around it); the repeat answers exactly as the first
(greedy), and reuses cached tokens where the server reports any. Then a corrupt image must be refused with
HTTP 400.
"""

from __future__ import annotations

import base64
import hashlib
from typing import Any

import httpx

from morion.multimodal.processing import ImageProcessing
from morion.validate import cases as case_files
from morion.validate.session import Session
from morion.validate.streaming import RequestFailed

_PLACEHOLDER_SLACK = 4  # tokens a template may put around one image (Qwen: <|vision_start|>, <|vision_end|>)


def check(session: Session) -> None:
    _images(case_files.load("vision").data)  # the image files are there and unchanged


def run(session: Session) -> dict[str, Any]:
    case_file = case_files.load("vision")
    data = case_file.data
    images = _images(data)
    processing, settings_from = _processing(session)
    header = {"case_file": case_file.identity(), "processing": settings_from}
    results = []
    for case in case_files.select(data["cases"], session.options.cases):
        session.say(f"vision: {case['id']}")
        results.append(_run_case(session, case, images, processing, data["max_tokens"]))
    corrupt = _corrupt(session, data)
    failed = [c["id"] for c in results if c["verdict"] != "pass"] + ([] if corrupt["pass"] else ["corrupt"])
    verdict = "fail" if failed else "pass"
    session.say(f"vision: {verdict.upper()}" + (f" ({', '.join(failed)})" if failed else ""))
    return {**header, "verdict": verdict, "cases": results, "corrupt_image": corrupt}


def _images(data: dict[str, Any]) -> dict[str, str]:
    """file -> data: URL of every case image, each checked against its recorded SHA-256."""
    urls = {}
    for case in data["cases"]:
        for image in case["images"]:
            raw = (case_files.CASES_DIR / "vision" / image["file"]).read_bytes()
            case_files.check_digest(image["file"], hashlib.sha256(raw).hexdigest(), image["sha256"])
            urls[image["file"]] = f"data:{image['media_type']};base64,{base64.b64encode(raw).decode()}"
    return urls


def _processing(session: Session) -> tuple[ImageProcessing, str]:
    """The server's image processor settings where `/v1/server_info` reports them, else Qwen3-VL's."""
    reported = ((session.server_info or {}).get("model") or {}).get("images")
    if reported:
        return ImageProcessing.from_dict(reported["processing"]), "server_info"
    return ImageProcessing.from_dict({}), "qwen3-vl defaults"


def _messages(case: dict[str, Any], images: dict[str, str], with_images: bool = True) -> list[dict[str, Any]]:
    parts: list[dict[str, Any]] = []
    if with_images:
        parts = [
            {"type": "image_url", "image_url": {"url": images[image["file"]]}} for image in case["images"]
        ]
    return [{"role": "user", "content": [*parts, {"type": "text", "text": case["question"]}]}]


def _run_case(
    session: Session,
    case: dict[str, Any],
    images: dict[str, str],
    processing: ImageProcessing,
    max_tokens: int,
) -> dict[str, Any]:
    expected = sum(processing.num_tokens(image["height"], image["width"]) for image in case["images"])
    record: dict[str, Any] = {"id": case["id"], "expected_image_tokens": expected}
    try:
        first = session.chat.ask(_messages(case, images), max_tokens)
        text_only = session.chat.ask(_messages(case, images, with_images=False), max_tokens)
        again = session.chat.ask(_messages(case, images), max_tokens)
    except (RequestFailed, httpx.HTTPError) as error:
        return {**record, "verdict": "fail", "reason": f"a request failed: {error or type(error).__name__}"}
    record.update(first=first.evidence(), text_only=text_only.evidence(), again=again.evidence())
    problems = [
        f"{name} {problem}"
        for name, reply in (("first", first), ("text-only", text_only), ("again", again))
        if (problem := _shape_problem(reply.evidence()))
    ]
    usage, plain = first.usage or {}, text_only.usage or {}
    reported = (usage.get("prompt_tokens_details") or {}).get("image_tokens")
    if reported is not None:
        record.update(image_tokens=reported, count_method="usage.prompt_tokens_details.image_tokens")
        if reported != expected:
            problems.append(f"the server counts {reported} image tokens, the processor's settings {expected}")
    else:
        grew = usage.get("prompt_tokens", 0) - plain.get("prompt_tokens", 0)
        record.update(image_tokens=None, prompt_growth=grew, count_method="prompt_tokens with - without")
        if not expected <= grew <= expected + _PLACEHOLDER_SLACK * len(case["images"]):
            problems.append(f"the images add {grew} prompt tokens, expected {expected} (+ placeholders)")
    tokens = [_completion_tokens(reply.evidence()) for reply in (first, again)]
    if again.content != first.content or tokens[0] != tokens[1]:
        problems.append("the same request again answered differently")
    cached = [
        (reply.usage or {}).get("prompt_tokens_details", {}).get("cached_tokens") for reply in (first, again)
    ]
    record["cached_tokens"] = cached
    if cached[1] is not None and cached[1] <= (cached[0] or 0):
        problems.append(f"the repeat reused no cached tokens ({cached[0]} then {cached[1]})")
    record.update(verdict="fail" if problems else "pass", reason="; ".join(problems))
    return record


def _shape_problem(reply: dict[str, Any]) -> str | None:
    if not reply["done"]:
        return "stream ended without [DONE]"
    if reply["finish_reason"] not in ("stop", "length"):
        return f"finished with {reply['finish_reason']!r}"
    if not isinstance(reply["content"], str) or _completion_tokens(reply) < 1:
        return "generated nothing"
    return None


def _completion_tokens(reply: dict[str, Any]) -> int:
    return (reply["usage"] or {}).get("completion_tokens", 0)


def _corrupt(session: Session, data: dict[str, Any]) -> dict[str, Any]:
    """A truncated image must be a 400 (not an answer, not a 500)."""
    bad = data["corrupt_image"]
    url = f"data:{bad['media_type']};base64,{bad['base64']}"
    case = {"images": [], "question": "What is in this image?"}
    messages = _messages(case, {})
    messages[0]["content"].insert(0, {"type": "image_url", "image_url": {"url": url}})
    try:
        reply = session.chat.ask(messages, 4)
    except RequestFailed as refused:
        return {"pass": refused.status == 400, "status": refused.status, "error": refused.text[:500]}
    except httpx.HTTPError as error:
        return {"pass": False, "status": None, "error": str(error) or type(error).__name__}
    return {"pass": False, "status": 200, "error": None, "answer": reply.evidence()}
