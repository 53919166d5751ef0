"""`morion validate` flags and their validation into one frozen `ValidateOptions`.

Numbers and lists are parsed here (with bench's parsers) rather than by argparse, so a bad value ends in
the CLI's usual `morion: error: ...` line. Imports nothing heavy: `morion --help` builds every parser.
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass

from morion.bench.options import _int_list, _number
from morion.errors import MorionError

SUITES = ("needle", "restore", "soak", "perf", "tools")


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

    soak = parser.add_argument_group("soak")
    soak.add_argument("--soak-clients", default="4", help="concurrent clients (4)")
    soak.add_argument("--soak-minutes", default="10", help="duration bound in minutes (10)")
    soak.add_argument("--soak-max-requests", default="0", help="request count bound (0: time only)")
    soak.add_argument(
        "--soak-max-growth-mib", default="200", help="pass bound on resident-memory growth (200 MiB)"
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
    soak_clients: int
    soak_minutes: float
    soak_max_requests: int
    soak_max_growth_mib: float
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
            soak_clients=_number(args.soak_clients, "--soak-clients", int, 1),
            soak_minutes=_number(args.soak_minutes, "--soak-minutes", float, 0.01),
            soak_max_requests=_number(args.soak_max_requests, "--soak-max-requests", int, 0),
            soak_max_growth_mib=_number(args.soak_max_growth_mib, "--soak-max-growth-mib", float, 0),
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
            words += [f"--{key.replace('_', '-')}", str(value)]
    return " ".join(words)
