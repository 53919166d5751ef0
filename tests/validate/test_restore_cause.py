"""The cause of a wrong answer, from the prompt computed cold once more in the process that served it."""

from __future__ import annotations

from morion.validate.restore_cause import UNAVAILABLE, ColdHere, cause, explain


def _answer(logprob: float, **extra) -> dict:
    return {"text": "x", "token_logprobs": [logprob], "token_ids": [5], "completion_tokens": 1, **extra}


COLD, HIT = _answer(-0.25), _answer(-0.5, cached_tokens=48)


def test_cold_here_answering_as_cold_as_the_hit_or_as_neither():
    assert cause(_answer(-0.25, cached_tokens=0), HIT, COLD) == "restore"
    assert cause(_answer(-0.5, cached_tokens=0), HIT, COLD) == "process"
    assert cause(_answer(-0.75), HIT, COLD) == "neither"
    for missing in (UNAVAILABLE, {"error": "HTTP 500: boom"}, None):
        assert cause(missing, HIT, COLD) == "unknown"
    assert explain("unknown", None) == "cold here not sent: unknown"
    assert "failed (HTTP 500: boom)" in explain("unknown", {"error": "HTTP 500: boom"})


def test_a_server_error_is_no_refusal_but_a_rejected_or_ignored_salt_is():
    said, salts = [], []
    replies = [{"error": "HTTP 503: busy", "status": 503}, _answer(-0.25, cached_tokens=0)]
    cold_here = ColdHere(lambda tokens, salt: salts.append(salt) or replies.pop(0), said.append)
    assert cold_here.send([1, 2])["error"] == "HTTP 503: busy"  # recorded (a cause "unknown"), not refused
    assert cold_here.send([1, 2])["cache_salt"] == salts[1] != salts[0]  # a fresh salt each time
    assert cold_here.refused is None and not said
    for refusal, words in (
        ({"error": "HTTP 400: cache_salt: unknown field", "status": 400}, "rejected"),
        (_answer(-0.25, cached_tokens=16), "ignored"),
    ):
        sent = []
        cold_here = ColdHere(lambda tokens, salt, r=refusal, s=sent: s.append(salt) or r, said.append)
        assert cold_here.send([1]) == cold_here.send([2]) == UNAVAILABLE
        assert len(sent) == 1 and words in cold_here.refused  # asked once, then never again
    assert len(said) == 2
