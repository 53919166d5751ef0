"""`morion validate` flags and their validation into one frozen `ValidateOptions`.

Numbers and lists are parsed here (with bench's parsers) rather than by argparse, so a bad value ends in
the CLI's usual `morion: error: ...` line. Imports nothing heavy: `morion --help` builds every parser.
"""

from __future__ import annotations

import argparse
import os
import secrets
from dataclasses import dataclass

from morion.bench.options import _int_list, _number
from morion.errors import MorionError

SUITES = ("needle", "restore", "soak", "perf", "tools", "vision")
SOAK_PROMPTS = ("chat", "token-ids")


def add_validate_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("suites", nargs="*", metavar="SUITE", help=f"any of {', '.join(SUITES)}")
    target = parser.add_argument_group("target")
    target.add_argument("--url", help="base URL of the OpenAI-compatible server (required)")
    target.add_argument("--model", help="the model name to send (default: the first /v1/models lists)")
    target.add_argument("--api-key", help="bearer key (default: $MORION_API_KEY or $OPENAI_API_KEY)")
    target.add_argument("--request-timeout", default="3600", help="seconds per request (3600)")
    target.add_argument(
        "--tokenizer",
        help="needle: a tokenizer.json directory or .gguf to count prompts with when the server has neither "
        "/v1/chat/completions/render nor /tokenize (default: the server's usage.prompt_tokens)",
    )
    target.add_argument("--cases", default="", help="only these case ids (comma-separated; default: all)")

    needle = parser.add_argument_group("needle")
    needle.add_argument("--needle-lengths", default="4096,32768", help="prompt tokens per case (4096,32768)")

    restore = parser.add_argument_group("restore")
    restore.add_argument(
        "--flood-tokens",
        default="auto",
        help="prompt tokens of other traffic sent to push the cases out of GPU memory (auto: twice the "
        "server's KV pool when /v1/server_info says it, else 262144)",
    )
    restore.add_argument(
        "--restart-cmd", help="shell command that restarts the server; the disk-hit step runs after it"
    )
    restore.add_argument(
        "--restart-timeout", default="900", help="seconds to wait for /health after it (900)"
    )
    restore.add_argument(
        "--restore-conversations",
        default="0",
        help="instead of the frozen chat cases, this many generated token-id conversations (for servers "
        "without a tokenizer, and qualification at scale; 0: the chat cases)",
    )
    restore.add_argument(
        "--restore-lengths", default="1024:65536", help="their prompt lengths, MIN:MAX tokens (1024:65536)"
    )
    restore.add_argument(
        "--restore-group",
        default="10",
        help="conversations per round of cold, device and host requests between device-cache evictions (10)",
    )
    restore.add_argument("--restore-max-tokens", default="16", help="greedy tokens per answer (16)")
    restore.add_argument("--restore-seed", default="random", help="seed of the conversations (random)")
    restore.add_argument(
        "--restore-resume",
        metavar="FILE.json",
        help="the conversations and answers of an earlier run's results: only the disk step is sent (the "
        "server was restarted on the same disk cache since)",
    )

    soak = parser.add_argument_group("soak")
    soak.add_argument("--soak-clients", default="4", help="concurrent clients (4)")
    soak.add_argument("--soak-minutes", default="10", help="duration bound in minutes (10)")
    soak.add_argument("--soak-max-requests", default="0", help="request count bound (0: time only)")
    soak.add_argument(
        "--soak-max-growth-mib", default="200", help="pass bound on resident-memory growth (200 MiB)"
    )
    soak.add_argument(
        "--soak-max-tokens", default="case", help="tokens per reply (case: the case file's, 64)"
    )
    soak.add_argument(
        "--soak-prompts",
        default="chat",
        choices=SOAK_PROMPTS,
        help="chat: the frozen conversations; token-ids: blocks of random token ids on /v1/completions (a "
        "server without a tokenizer)",
    )
    soak.add_argument(
        "--soak-turn-tokens", default="1024", help="token-ids: prompt tokens each turn adds (1024)"
    )
    soak.add_argument(
        "--soak-during-restore",
        action="store_true",
        help="with restore and soak: run soak's clients while restore runs (the other traffic restores "
        "must be immune to); soak ends before restore's --restart-cmd",
    )

    perf = parser.add_argument_group("perf (the decode sweep and cold prefill of `morion bench --url`)")
    perf.add_argument("--perf-concurrency", default="1,2,4,8", help="decode concurrency (1,2,4,8)")
    perf.add_argument("--perf-contexts", default="1024", help="decode prompt tokens (1024)")
    perf.add_argument("--perf-output-tokens", default="256", help="decode tokens per request (256)")
    perf.add_argument("--perf-prefill-lengths", default="1024,8192", help="cold prefill prompt tokens")
    perf.add_argument("--perf-repeats", default="3", help="measured runs per point (3)")

    out = parser.add_argument_group("output")
    out.add_argument("--out", default="results", help="directory for <date>-validate-<label>.json/.md/.png")
    out.add_argument("--label", help="file label (default: the served model)")


@dataclass(frozen=True)
class ValidateOptions:
    suites: tuple[str, ...]
    url: str
    model: str | None
    api_key: str | None
    request_timeout_s: float
    tokenizer: str | None
    cases: tuple[str, ...]
    needle_lengths: tuple[int, ...]
    flood_tokens: int | None  # None: auto
    restart_cmd: str | None
    restart_timeout_s: float
    restore_conversations: int
    restore_lengths: tuple[int, int]
    restore_group: int
    restore_max_tokens: int
    restore_seed: int
    restore_resume: str | None
    soak_clients: int
    soak_minutes: float
    soak_max_requests: int
    soak_max_growth_mib: float
    soak_max_tokens: int | None  # None: the case file's
    soak_prompts: str
    soak_turn_tokens: int
    soak_during_restore: bool
    perf_concurrency: tuple[int, ...]
    perf_contexts: tuple[int, ...]
    perf_output_tokens: int
    perf_prefill_lengths: tuple[int, ...]
    perf_repeats: int
    out: str
    label: str | None

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> ValidateOptions:
        if not args.suites:
            raise MorionError(f"name at least one suite: {', '.join(SUITES)}")
        if not args.url:
            raise MorionError("--url is required: the base URL of the server to validate")
        suites = []
        for name in args.suites:
            for suite in (part.strip() for part in name.split(",")):
                if suite not in SUITES:
                    raise MorionError(f"unknown suite {suite!r} (choose from {', '.join(SUITES)})")
                suites.append(suite)
        url = args.url.rstrip("/")
        if not url.startswith(("http://", "https://")):
            raise MorionError(f"--url must start with http:// or https://, got {args.url!r}")
        return cls(
            suites=tuple(dict.fromkeys(suites)),
            url=url,
            model=args.model,
            api_key=args.api_key or os.environ.get("MORION_API_KEY") or os.environ.get("OPENAI_API_KEY"),
            request_timeout_s=_number(args.request_timeout, "--request-timeout", float, 1),
            tokenizer=args.tokenizer,
            cases=tuple(item.strip() for item in args.cases.split(",") if item.strip()),
            needle_lengths=_int_list(args.needle_lengths, "--needle-lengths"),
            flood_tokens=None
            if args.flood_tokens == "auto"
            else _number(args.flood_tokens, "--flood-tokens", int, 1),
            restart_cmd=args.restart_cmd,
            restart_timeout_s=_number(args.restart_timeout, "--restart-timeout", float, 1),
            restore_conversations=_number(args.restore_conversations, "--restore-conversations", int, 0),
            restore_lengths=_length_range(args.restore_lengths),
            restore_group=_number(args.restore_group, "--restore-group", int, 1),
            restore_max_tokens=_number(args.restore_max_tokens, "--restore-max-tokens", int, 1),
            restore_seed=secrets.randbits(32)
            if args.restore_seed == "random"
            else _number(args.restore_seed, "--restore-seed", int, 0),
            restore_resume=args.restore_resume,
            soak_clients=_number(args.soak_clients, "--soak-clients", int, 1),
            soak_minutes=_number(args.soak_minutes, "--soak-minutes", float, 0.01),
            soak_max_requests=_number(args.soak_max_requests, "--soak-max-requests", int, 0),
            soak_max_growth_mib=_number(args.soak_max_growth_mib, "--soak-max-growth-mib", float, 0),
            soak_max_tokens=None
            if args.soak_max_tokens == "case"
            else _number(args.soak_max_tokens, "--soak-max-tokens", int, 1),
            soak_prompts=args.soak_prompts,
            soak_turn_tokens=_number(args.soak_turn_tokens, "--soak-turn-tokens", int, 1),
            soak_during_restore=args.soak_during_restore,
            perf_concurrency=_int_list(args.perf_concurrency, "--perf-concurrency"),
            perf_contexts=_int_list(args.perf_contexts, "--perf-contexts"),
            perf_output_tokens=_number(args.perf_output_tokens, "--perf-output-tokens", int, 1),
            perf_prefill_lengths=_int_list(args.perf_prefill_lengths, "--perf-prefill-lengths"),
            perf_repeats=_number(args.perf_repeats, "--perf-repeats", int, 1),
            out=args.out,
            label=args.label,
        )

    def settings(self) -> dict[str, object]:
        """The options as results record them (never the API key)."""
        return {key: value for key, value in self.__dict__.items() if key != "api_key"}


def _length_range(text: str) -> tuple[int, int]:
    low, sep, high = text.partition(":")
    if not sep:
        raise MorionError(f"--restore-lengths must be MIN:MAX tokens, got {text!r}")
    low_value = _number(low, "--restore-lengths MIN", int, 2)
    high_value = _number(high, "--restore-lengths MAX", int, low_value)
    return low_value, high_value


def command_line(args: argparse.Namespace) -> str:
    """The command as it could be typed again: the suites and the flags that differ from their defaults
    (the API key left out)."""
    defaults_parser = argparse.ArgumentParser()
    add_validate_arguments(defaults_parser)
    defaults = vars(defaults_parser.parse_args([]))
    words = ["morion", "validate", *args.suites]
    for key, value in vars(args).items():
        if (
            key in defaults
            and key not in ("suites", "api_key")
            and value is not None
            and value != defaults[key]
        ):
            flag = f"--{key.replace('_', '-')}"
            words += [flag] if value is True else [flag, str(value)]
    return " ".join(words)
