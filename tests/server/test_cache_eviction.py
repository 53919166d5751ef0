"""`POST /v1/cache/evict_device`: a conversation leaves GPU memory (here the CPU's pool) and, with no tier
behind it on this server, is computed again: the same answer, nothing cached. Behind the API key."""

from __future__ import annotations

PROMPT = (
    "The rainbow has seven colours: red, orange, yellow, green, blue, indigo and violet. A prism splits "
    "white light into the same bands. List the first three colours, separated by commas:"
)


def _complete(server) -> tuple[str, int]:
    with server.openai() as client:
        reply = client.completions.create(model="smollm2", prompt=PROMPT, max_tokens=12, temperature=0)
    details = reply.usage.prompt_tokens_details
    return reply.choices[0].text, details.cached_tokens if details else 0


def test_evicting_the_device_cache_makes_the_next_request_compute_again(server):
    cold_text, _ = _complete(server)
    hit_text, hit_cached = _complete(server)
    assert hit_cached > 0 and hit_text == cold_text
    with server.http() as http:
        reply = http.post("/v1/cache/evict_device", json={})
    assert reply.status_code == 200, reply.text
    body = reply.json()
    assert body["object"] == "cache.eviction" and body["evicted_pages"] >= hit_cached // 16
    again_text, again_cached = _complete(server)
    assert again_cached == 0 and again_text == cold_text
    with server.http(authenticated=False) as http:
        assert http.post("/v1/cache/evict_device", json={}).status_code == 401
