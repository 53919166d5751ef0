"""`morion` command line: argument parsing only; the work happens in the packages it calls."""

from __future__ import annotations

import argparse
import re
import sys
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

from morion.bench.options import add_bench_arguments
from morion.engine_flags import add_engine_flags, add_model_flags, bounded, engine_config, engine_options
from morion.errors import MorionError
from morion.logs import show_morion_logs
from morion.validate.options import add_validate_arguments

if TYPE_CHECKING:  # imported where used: torch alone takes seconds to import on a small CPU
    from morion.engine.sampling_params import SamplingParams
    from morion.llm import LLM


class _OneLineParser(argparse.ArgumentParser):
    """Bad arguments end in one line naming the problem (argparse's default adds a usage block)."""

    def error(self, message: str) -> None:  # type: ignore[override]
        self.exit(2, f"{self.prog}: error: {message}\n")


# The server's numeric flags: (flag, type, minimum, help).
_SERVE_NUMBERS = (
    ("--port", int, 1, "TCP port (default 8000)"),
    ("--max-request-bytes", int, 1, "request body limit (4 MiB)"),
    ("--shutdown-timeout", float, 0.0, "seconds in-flight requests get to finish after SIGTERM (30)"),
    ("--read-timeout", float, 0.001, "seconds a client gets to send a request's headers, then its body (30)"),
    ("--grammar-timeout", float, 0.001, "seconds one structured-output grammar may take to compile (10)"),
    ("--grammar-memory-gb", float, 0.001, "memory one grammar's compilation may take (1 GiB)"),
)


def _origins(text: str) -> tuple[str, ...]:
    """--allowed-origins: "*" or comma-separated origins as browsers send them (scheme://host[:port])."""
    origins = tuple(part.strip() for part in text.split(",") if part.strip())
    for origin in origins:
        if origin != "*" and not re.fullmatch(r"https?://[^/\s]+", origin):
            raise argparse.ArgumentTypeError(
                f"--allowed-origins takes origins such as https://app.example:8080 (or *), got {origin!r}"
            )
    return origins


def _build_parser() -> argparse.ArgumentParser:
    parser = _OneLineParser(prog="morion", description="Serve and run hybrid MoE language models.")
    commands = parser.add_subparsers(dest="command", required=True, parser_class=_OneLineParser)

    pull = commands.add_parser("pull", help="fetch a known model into MORION_HOME")
    pull.add_argument("name", nargs="?", default=None, help="known model name (default: the default model)")

    generate = commands.add_parser("generate", help="generate text from a prompt, streamed to stdout")
    add_engine_flags(generate)
    generate.add_argument("--prompt", required=True)
    generate.add_argument("--max-tokens", type=bounded(int, 1, "--max-tokens"), default=256)
    generate.add_argument("--temperature", type=bounded(float, 0.0, "--temperature"), default=0.0)
    generate.add_argument("--top-p", type=bounded(float, 0.0, "--top-p"), default=1.0)
    generate.add_argument("--top-k", type=bounded(int, 0, "--top-k"), default=0)
    generate.add_argument("--seed", type=int, default=None)
    generate.add_argument(
        "--chat",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="apply the chat template (default: on when the model has one)",
    )

    serve = commands.add_parser("serve", help="serve the OpenAI-compatible HTTP API (see docs/server.md)")
    add_engine_flags(serve)
    serve.add_argument("--host", help="address to listen on (default 127.0.0.1: this machine only)")
    serve.add_argument("--api-key", help="require 'Authorization: Bearer KEY' on every endpoint but /health")
    serve.add_argument("--served-model-name", help="the model id clients send (default: the model's name)")
    for flag, kind, minimum, help_text in _SERVE_NUMBERS:
        serve.add_argument(flag, type=bounded(kind, minimum, flag), help=help_text)
    serve.add_argument(
        "--allowed-origins",
        type=_origins,
        help="comma-separated browser origins that may call the API, with CORS ('*': any; default: none)",
    )
    serve.add_argument(
        "--tool-call-parser",
        choices=("hermes", "qwen25", "qwen3_coder"),
        help="how tool calls are read from the output (default: from the chat template; hermes)",
    )
    serve.add_argument(
        "--reasoning-parser", choices=("qwen3",), help="split <think>...</think> into reasoning_content"
    )
    serve.add_argument(
        "--log-level",
        choices=("debug", "info", "warning", "error"),
        help="morion's and uvicorn's logs (info)",
    )
    serve.add_argument(
        "--log-requests",
        action="store_true",
        default=None,
        help="one log line per request: status, tokens, time to first token, duration",
    )
    serve.add_argument(
        "--allowed-local-media-path",
        metavar="DIR",
        help="read file:// images under DIR (default: file:// images are refused; data: URLs always work)",
    )
    serve.add_argument("--config", help="TOML profile setting any of these flags; flags given here win")
    serve.set_defaults(profile_parser=serve)

    bench = commands.add_parser("bench", help="measure decode, prefill and TTFT against the roofline")
    add_engine_flags(bench)
    add_bench_arguments(bench)

    validate = commands.add_parser(
        "validate", help="qualify an OpenAI-compatible server with frozen cases (see docs/validate.md)"
    )
    add_validate_arguments(validate)

    info = commands.add_parser("info", help="print a model's architecture summary")
    add_model_flags(info)

    cache = commands.add_parser("cache", help="inspect, verify or purge a disk cache tier")
    cache.add_argument("action", choices=("ls", "verify", "purge"))
    cache.add_argument("--disk-cache-dir", required=True)
    cache.add_argument("--namespace", help="a namespace (or a unique prefix of one)")
    cache.add_argument("--remove-bad", action="store_true", help="verify: delete objects that fail")
    cache.add_argument("--all", action="store_true", help="purge: every namespace")

    frspec = commands.add_parser(
        "frspec", help="build an FR-Spec reduced draft vocabulary (docs/speculative.md)"
    )
    frspec.add_argument(
        "action",
        choices=("build", "lowest-ids"),
        help="build: from a tokenizer and a corpus; lowest-ids: the --size lowest of --vocab-size ids, for "
        "random-weight presets (no tokenizer: only the draft head's size is real)",
    )
    frspec.add_argument("--tokenizer", help="build: model directory, .gguf file or known name")
    frspec.add_argument("--corpus", nargs="+", metavar="FILE", help="build: text files to count tokens in")
    frspec.add_argument(
        "--vocab-size", type=bounded(int, 1, "--vocab-size"), help="lowest-ids: the model's vocabulary size"
    )
    frspec.add_argument("--size", type=bounded(int, 1, "--size"), required=True, help="ids in the map")
    frspec.add_argument(
        "--base-count", type=bounded(int, 0, "--base-count"), help="lowest ids always kept (half of --size)"
    )
    frspec.add_argument("--out", required=True, help="the map file to write (JSON)")
    return parser


def _run_pull(args: argparse.Namespace) -> None:
    from morion.loader.model_store import DEFAULT_MODEL, pull

    print(pull(args.name or DEFAULT_MODEL))


_SERVER_FLAGS = (
    "host",
    "port",
    "api_key",
    "served_model_name",
    "max_request_bytes",
    "shutdown_timeout",
    "read_timeout",
    "allowed_origins",
    "grammar_timeout",
    "grammar_memory_gb",
    "tool_call_parser",
    "reasoning_parser",
    "log_level",
    "log_requests",
    "allowed_local_media_path",
)


def _given(args: argparse.Namespace, names: Sequence[str]) -> dict:
    return {name: value for name in names if (value := getattr(args, name, None)) is not None}


def _run_generate(args: argparse.Namespace) -> None:
    from morion.loader.model_store import DEFAULT_MODEL
    from morion.loader.resolve import resolve_model_path
    from morion.models.presets import is_preset

    if not is_preset(args.model):
        resolve_model_path(args.model)  # a missing path or id fails here, before seconds of imports
    # Before the imports: torch alone takes seconds on a small CPU, and the user should see why.
    print(f"morion: loading {args.model or DEFAULT_MODEL}", file=sys.stderr, flush=True)
    from morion.engine.sampling_params import SamplingParams
    from morion.llm import LLM

    params = SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        seed=args.seed,
    )
    # Closed on the way out: follower ranks stopped and the process group left before the interpreter
    # exits (left to interpreter teardown, torch.distributed's threads could abort the process).
    with LLM(model=args.model, **engine_options(args)) as llm:
        _generate_and_print(llm, args, params)


def _generate_and_print(llm: LLM, args: argparse.Namespace, params: SamplingParams) -> None:
    tokenizer = llm.tokenizer
    if tokenizer is None:
        raise MorionError(
            f"{llm.engine.model_path} has no tokenizer (tokenizer.json), so it cannot take a text prompt"
        )
    use_chat = tokenizer.chat_template is not None if args.chat is None else args.chat
    if use_chat:
        prompt_ids = llm.encode_chat([{"role": "user", "content": args.prompt}])
    else:
        prompt_ids = tokenizer.encode(args.prompt)
    print(f"morion: generating after a prompt of {len(prompt_ids)} tokens", file=sys.stderr, flush=True)
    started = time.perf_counter()
    num_tokens = 0
    for step in llm.stream(prompt_ids, params):
        num_tokens += len(step.new_token_ids)
        sys.stdout.write(step.new_text)
        sys.stdout.flush()
    elapsed = time.perf_counter() - started
    sys.stdout.write("\n")
    print(
        f"[{len(prompt_ids)} prompt tokens, {num_tokens} generated in {elapsed:.2f}s, "
        f"{num_tokens / max(elapsed, 1e-9):.1f} tok/s]",
        file=sys.stderr,
    )


def _run_info(args: argparse.Namespace) -> None:
    from morion.loader import load_model

    config = engine_config(args)
    loaded = load_model(
        config.model, config.torch_dtype, config.torch_device, host_table_placement=config.ple_placement
    )
    parameters = sum(p.numel() for p in loaded.model.parameters())
    print(f"path: {loaded.path}")
    print(f"model_type: {loaded.hf_config['model_type']}")
    print(f"parameters: {parameters / 1e6:.1f}M")
    for key, value in vars(loaded.model.config).items():
        print(f"{key}: {value}")
    has_template = loaded.tokenizer is not None and loaded.tokenizer.chat_template is not None
    print(f"chat_template: {'yes' if has_template else 'no'}")


def _run_serve(args: argparse.Namespace) -> None:
    from morion.server.launch import serve
    from morion.server.options import ServeOptions

    serve(ServeOptions(engine_config(args), profile=args.config, **_given(args, _SERVER_FLAGS)))


def _with_profile(parser: argparse.ArgumentParser, args: argparse.Namespace, argv: Sequence[str] | None):
    from morion.server.profile import apply_profile

    apply_profile(args.profile_parser, args.config)
    return parser.parse_args(argv)  # again, so that flags on the command line win over the profile


def _run_cache(args: argparse.Namespace) -> int:
    from morion.cache import disk_admin

    root = args.disk_cache_dir
    if args.action == "ls":
        for info in disk_admin.list_namespaces(root):
            print(disk_admin.describe(info))
        return 0
    if args.action == "verify":
        reports = disk_admin.verify(root, args.namespace, args.remove_bad)
        for report in reports:
            counts = f"{report.checked} objects checked, {len(report.bad)} bad, {report.removed} removed"
            print(f"{report.namespace}: {counts}")
            for path, why in report.bad:
                print(f"  bad: {path}: {why}")
        return 1 if any(report.bad for report in reports) else 0
    if args.namespace is None and not args.all:
        raise MorionError("cache purge needs --namespace NS or --all")
    for directory in disk_admin.purge(root, args.namespace):
        print(f"removed {directory}")
    return 0


def _run_bench(args: argparse.Namespace) -> int:
    from morion.bench.run import run_bench

    return run_bench(args, engine_options(args))


def _run_validate(args: argparse.Namespace) -> int:
    from morion.validate.run import run_validate

    return run_validate(args)


def _run_frspec(args: argparse.Namespace) -> None:
    from morion.spec.frspec import build_for_model, lowest_ids_map, write_token_map

    if args.action == "lowest-ids":
        if args.vocab_size is None:
            raise MorionError("frspec lowest-ids needs --vocab-size (the model's vocabulary size)")
        write_token_map(lowest_ids_map(args.vocab_size, args.size), args.out)
        print(f"{args.out}: the {args.size} lowest of {args.vocab_size} ids (no tokenizer behind them)")
        return
    if args.tokenizer is None or args.corpus is None:
        raise MorionError("frspec build needs --tokenizer and --corpus")
    data = build_for_model(args.tokenizer, args.corpus, args.size, args.base_count)
    write_token_map(data, args.out)
    corpus = data["corpus"]
    print(
        f"{args.out}: {data['size']} token ids ({len(data['special_ids'])} special, {data['base_count']} "
        f"lowest; corpus of {corpus['tokens']} tokens, SHA-256 {corpus['sha256'][:16]})"
    )


_COMMANDS = {
    "pull": _run_pull,
    "generate": _run_generate,
    "serve": _run_serve,
    "info": _run_info,
    "cache": _run_cache,
    "bench": _run_bench,
    "validate": _run_validate,
    "frspec": _run_frspec,
}


def main(argv: Sequence[str] | None = None) -> int:
    parser = _build_parser()
    args = parser.parse_args(argv)
    show_morion_logs()
    try:
        if getattr(args, "config", None) is not None:
            args = _with_profile(parser, args, argv)
        return _COMMANDS[args.command](args) or 0
    except MorionError as error:
        print(f"morion: error: {error}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
