"""`morion` command line: argument parsing only; the work happens in the packages it calls."""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable, Sequence

from morion.errors import MorionError


class _OneLineParser(argparse.ArgumentParser):
    """Bad arguments end in one line naming the problem (argparse's default adds a usage block)."""

    def error(self, message: str) -> None:  # type: ignore[override]
        self.exit(2, f"{self.prog}: error: {message}\n")


def _bounded(kind: Callable[[str], float], minimum: float, name: str) -> Callable[[str], float]:
    def parse(text: str) -> float:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{name} must be a number, got {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"{name} must be >= {minimum}, got {text}")
        return value

    return parse


def _add_model_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--model", help="model directory, .gguf file or known name (default: smollm2-135m-instruct)"
    )
    parser.add_argument(
        "--dtype", default="auto", help="auto (bf16 on CUDA, fp32 on CPU), float32, bfloat16, float16"
    )
    parser.add_argument("--device", default="auto", help="auto, cpu, cuda, cuda:N")


def _build_parser() -> argparse.ArgumentParser:
    parser = _OneLineParser(prog="morion", description="Serve and run hybrid MoE language models.")
    commands = parser.add_subparsers(dest="command", required=True, parser_class=_OneLineParser)

    pull = commands.add_parser("pull", help="fetch a known model into MORION_HOME")
    pull.add_argument("name", nargs="?", default=None, help="known model name (default: the default model)")

    generate = commands.add_parser("generate", help="generate text from a prompt, streamed to stdout")
    _add_model_arguments(generate)
    generate.add_argument("--prompt", required=True)
    generate.add_argument("--max-tokens", type=_bounded(int, 1, "--max-tokens"), default=256)
    generate.add_argument("--temperature", type=_bounded(float, 0.0, "--temperature"), default=0.0)
    generate.add_argument("--top-p", type=_bounded(float, 0.0, "--top-p"), default=1.0)
    generate.add_argument("--top-k", type=_bounded(int, 0, "--top-k"), default=0)
    generate.add_argument("--seed", type=int, default=None)
    generate.add_argument(
        "--chat",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="apply the chat template (default: on when the model has one)",
    )

    info = commands.add_parser("info", help="print a model's architecture summary")
    _add_model_arguments(info)
    return parser


def _run_pull(args: argparse.Namespace) -> None:
    from morion.loader.model_store import DEFAULT_MODEL, pull

    print(pull(args.name or DEFAULT_MODEL))


def _engine_options(args: argparse.Namespace) -> dict:
    return {"dtype": args.dtype, "device": args.device}


def _run_generate(args: argparse.Namespace) -> None:
    from morion.engine.sampling_params import SamplingParams
    from morion.llm import LLM

    params = SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        seed=args.seed,
    )
    llm = LLM(model=args.model, **_engine_options(args))
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
    from morion.config import EngineConfig
    from morion.loader import load_model

    config = EngineConfig(model=args.model, **_engine_options(args))
    loaded = load_model(config.model, config.torch_dtype, config.torch_device)
    parameters = sum(p.numel() for p in loaded.model.parameters())
    print(f"path: {loaded.path}")
    print(f"model_type: {loaded.hf_config['model_type']}")
    print(f"parameters: {parameters / 1e6:.1f}M")
    for key, value in vars(loaded.model.config).items():
        print(f"{key}: {value}")
    has_template = loaded.tokenizer is not None and loaded.tokenizer.chat_template is not None
    print(f"chat_template: {'yes' if has_template else 'no'}")


_COMMANDS = {"pull": _run_pull, "generate": _run_generate, "info": _run_info}


def main(argv: Sequence[str] | None = None) -> int:
    args = _build_parser().parse_args(argv)
    try:
        _COMMANDS[args.command](args)
    except MorionError as error:
        print(f"morion: error: {error}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
