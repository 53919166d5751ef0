"""`morion bench`: build the target, run the chosen workloads, set them against the roofline, write files.

The JSON is rewritten after every decode point and workload (status "partial"), so a long run that fails
late still leaves what it measured; the Markdown and PNG are made from the final JSON.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import sys
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from morion.bench import agent_turn, analysis, provenance, restore, roofline, speculative
from morion.bench.options import BenchOptions, add_bench_arguments, device_peaks
from morion.bench.plot import matplotlib_available, write_png
from morion.bench.prompts import PromptFactory
from morion.bench.report import DEFINITIONS, markdown, output_paths, slug, write_json
from morion.bench.roofline import ModelCost
from morion.bench.timing import Target
from morion.bench.workloads import Workbench, run_decode_sweep
from morion.config import DTYPES, EngineConfig
from morion.errors import MorionError
from morion.models.presets import is_preset

SCHEMA = "morion-bench/1"


def run_bench(args: argparse.Namespace, engine_options: dict[str, Any]) -> int:
    """`args` as parsed by the CLI; `engine_options` the EngineConfig fields its flags set."""
    if args.plot:
        return regenerate(Path(args.plot))
    options = BenchOptions.from_args(args)
    config = EngineConfig(model=args.model, **engine_options)
    command = command_line(args, engine_options)
    if options.url:
        target, cost, cost_source = _remote_target(options, args, config, engine_options)
        if "turn" in options.workloads:
            agent_turn.check_prefix(options.turn_prefix, _page_size(target, config))
        device = None
        served = (target.server_info or {}).get("config") or {}
        device_name = served.get("device_name") or served.get("device")
    else:
        from morion.bench.offline import EngineTarget

        if "restore" in options.workloads:
            restore.check_flags(config, options)
        if "turn" in options.workloads:
            agent_turn.check_prefix(options.turn_prefix, config.page_size)
        plain = config
        if "spec" in options.workloads:
            speculative.check_flags(config, options)
            plain = speculative.plain_config(config)  # the engine flags configure its speculative engine
        most = max(options.concurrency) if {"decode", "spec"} & set(options.workloads) else 1
        if most > config.max_running_requests:
            raise MorionError(
                f"--concurrency {most} exceeds --max-running-requests {config.max_running_requests}: "
                "the extra requests would wait, not run concurrently"
            )
        target = EngineTarget(plain, options.logprobs)
        _check_lengths(options, target.engine.max_model_len, "the engine's max model len")
        if "restore" in options.workloads:
            restore.check_capacity(target.engine, options.restore_length)
        cost = roofline.from_model(target.engine.model, target.engine.pool.spec)
        cost_source, device = "the engine's model and cache spec", str(target.engine.device)
    prov = provenance.collect(command, device)
    if not options.url:
        device_name = prov.get("device_name") or device
    bandwidth, peak, peaks_source = device_peaks(options, device_name)
    options = dataclasses.replace(options, bandwidth_gbs=bandwidth, peak_tflops=peak)
    prompts = PromptFactory(target.vocab_size)
    label = options.label or _default_label(options, config, target, prov)
    path = output_paths(Path(options.out), prov["date"], slug(label))
    result: dict[str, Any] = {
        "schema": SCHEMA,
        "label": slug(label),
        "date": prov["date"],
        "mode": "url" if options.url else "offline",
        "status": "partial",
        "model": args.model if not options.url else (args.model or target.describe().get("served_model")),
        "preset": is_preset(args.model),
        "provenance": prov,
        "args": {key: value for key, value in vars(args).items() if key != "api_key"},
        "engine_config": None if options.url else asdict(config),
        "target": target.describe(),
        "settings": {
            **{k: v for k, v in asdict(options).items() if k != "api_key"},
            "prompt_salt": prompts.salt,
            "prompt_id_range": [prompts.low, prompts.high],
        },
        "roofline": _roofline_header(options, cost, cost_source, device_name, peaks_source),
        "definitions": DEFINITIONS,
        "decode": [],
        "decode_skipped": [],
        "prefill": [],
        "ttft": None,
        "turn": None,
        "spec": None,
        "restore": None,
        "baseline": None,
    }
    bench = Workbench(target, prompts, "server" if options.url else "morion")
    bench.say(f"writing {path}")
    try:
        _run_workloads(bench, options, config, cost, result, path)
    except BaseException:
        _write_all(path, result)  # what was measured before the failure, marked partial
        raise
    finally:
        target.close()
    if options.baseline:
        del target, bench
        _free_memory()
        try:
            result["baseline"] = _run_baseline(options, args, config, prompts)
        except Exception as error:
            result["status"] = "baseline failed"
            result["baseline"] = {"error": f"{type(error).__name__}: {error}"}
            _write_all(path, result)
            reason = str(error).splitlines()[0] if str(error) else type(error).__name__
            raise MorionError(
                f"--baseline {options.baseline} failed: {reason} (morion's results: {path})"
            ) from error
    result["status"] = "complete"
    _write_all(path, result)
    spec_failure = speculative.failure_message(result["spec"])
    if spec_failure:
        raise MorionError(f"{spec_failure}; results: {path}")
    for workload in ("turn", "restore"):
        failures = (result[workload] or {}).get("failures")
        if failures:
            raise MorionError(f"{workload} FAILED: {failures[0]} ({len(failures)} problems; results: {path})")
    return 0


def _run_workloads(
    bench: Workbench,
    options: BenchOptions,
    config: EngineConfig,
    cost: ModelCost | None,
    result: dict[str, Any],
    path: Path,
) -> None:
    chosen = options.workloads
    lengths = [
        *(options.contexts if {"decode", "spec"} & set(chosen) else ()),
        *(options.prefill_lengths if "prefill" in chosen else ()),
        *((options.ttft_length,) if "ttft" in chosen else ()),
        *((options.turn_new,) if "turn" in chosen else ()),
        *((options.restore_length,) if "restore" in chosen else ()),
    ]
    bench.warm_engine(min(1024, *lengths))
    if "decode" in options.workloads:

        def keep(point: dict[str, Any]) -> None:
            analysis.annotate_decode(point, cost, options.bandwidth_gbs)
            result["decode"].append(point)
            write_json(path, result)

        _, result["decode_skipped"] = run_decode_sweep(
            bench,
            options.concurrency,
            options.contexts,
            options.output_tokens,
            options.repeats,
            options.warmup_runs,
            options.max_cell_prompt_tokens,
            keep,
        )
    if "prefill" in options.workloads:
        for length in options.prefill_lengths:
            point = bench.prefill_point(length, options.repeats)
            analysis.annotate_prefill(point, cost, options.peak_tflops)
            result["prefill"].append(point)
            write_json(path, result)
    if "ttft" in options.workloads:
        point = bench.prefill_point(options.ttft_length, options.repeats, workload="ttft")
        analysis.annotate_prefill(point, cost, options.peak_tflops)
        result["ttft"] = point
        write_json(path, result)
    if "turn" in options.workloads:
        page_size = _page_size(bench.target, config)
        result["turn"] = agent_turn.run_turns(
            bench, options.turn_prefix, options.turn_new, options.repeats, page_size
        )
        write_json(path, result)
    if "spec" in options.workloads or "restore" in options.workloads:
        from morion.bench.offline import EngineTarget

        if not isinstance(bench.target, EngineTarget):
            raise MorionError("--workloads spec and restore need the offline engine")
    if "spec" in options.workloads:

        def keep_spec(section: dict[str, Any]) -> None:
            result["spec"] = section
            write_json(path, result)

        speculative.run_spec(bench, bench.target, config, options, keep_spec)
    if "restore" in options.workloads:  # last: it restarts the engine

        def keep_restore(section: dict[str, Any]) -> None:
            result["restore"] = section
            write_json(path, result)

        length, repeats = options.restore_length, options.restore_repeats
        restore.run_restore(
            bench, bench.target, length, repeats, keep_restore, page_cache=options.restore_page_cache
        )


def _run_baseline(
    options: BenchOptions,
    args: argparse.Namespace,
    config: EngineConfig,
    prompts: PromptFactory,
) -> dict[str, Any]:
    from morion.bench.hf_baseline import HFTarget

    model = options.baseline_model or args.model
    if model is None:
        raise MorionError("--baseline hf needs --baseline-model or --model (a preset or a model directory)")
    target = HFTarget(model, config.torch_dtype, config.torch_device)
    try:
        bench = Workbench(target, prompts, "transformers")
        cost = roofline.from_config(roofline.read_hf_config(model), config.torch_dtype)
        points, _ = run_decode_sweep(
            bench,
            (1,),
            options.contexts,
            options.output_tokens,
            options.repeats,
            options.warmup_runs,
            options.max_cell_prompt_tokens,
        )
        for point in points:
            analysis.annotate_decode(point, cost, options.bandwidth_gbs)
        return {"target": target.describe(), "decode": points, "roofline_model": roofline.describe(cost)}
    finally:
        target.close()


def command_line(args: argparse.Namespace, engine_options: dict[str, Any]) -> str:
    """The command as it could be typed again: the flags that differ from their defaults (the API key
    left out). Rebuilt from the parsed values, so it is the same however morion was started."""
    defaults_parser = argparse.ArgumentParser()
    add_bench_arguments(defaults_parser)
    defaults = vars(defaults_parser.parse_args([]))
    words = ["morion", "bench"]
    given = {"model": args.model, **engine_options}
    given.update({k: v for k, v in vars(args).items() if k in defaults and v != defaults[k]})
    given.pop("api_key", None)
    negated = {"cuda_graph": "--no-cuda-graph", "enable_prefix_cache": "--no-prefix-cache"}
    for key, value in given.items():
        if value is None or (key in ("dtype", "device") and value == "auto"):
            continue
        if key in negated:
            if value is False:
                words.append(negated[key])
            continue
        words += [f"--{key.replace('_', '-')}", str(value)]
    return " ".join(words)


def _remote_target(
    options: BenchOptions, args: argparse.Namespace, config: EngineConfig, given: dict[str, Any]
) -> tuple[Target, ModelCost | None, str]:
    from morion.bench.remote import RemoteTarget

    source = options.roofline_config or args.model
    hf_config = roofline.read_hf_config(source) if source else None
    vocab = hf_config.get("vocab_size") if hf_config else None
    target = RemoteTarget(
        options.url, options.served_model, options.api_key, options.request_timeout_s, vocab, options.logprobs
    )
    served = (target.server_info or {}).get("config") or {}
    capacity = (target.server_info or {}).get("capacity") or {}
    if capacity.get("max_model_len"):
        _check_lengths(options, capacity["max_model_len"], "the server's max model len")
    if hf_config is None:
        # A morion server names its model; when that is a preset or a path readable here, use it.
        path = ((target.server_info or {}).get("model") or {}).get("path")
        if path and (is_preset(path) or Path(path).exists()):
            source, hf_config = path, roofline.read_hf_config(path)
    if hf_config is None:
        return target, None, "none"

    def setting(name: str) -> Any:
        # A flag given here describes the served model; else what the server reports; else the default.
        value = given.get(name)
        if value is None or value == "auto":
            value = served.get(name, value if value is not None else getattr(config, name))
        return value

    dtype_name = setting("dtype")
    dtype = DTYPES.get(dtype_name, torch.bfloat16)  # "auto" on a remote server: assume a GPU, bf16
    kv = setting("kv_cache_dtype")
    kv_dtype = torch.float8_e4m3fn if kv == "fp8" else DTYPES.get(kv, dtype)
    cost = roofline.from_config(
        hf_config,
        dtype,
        setting("weight_dtype"),
        kv_dtype,
        DTYPES[setting("state_dtype")],
        setting("page_size"),
    )
    return target, cost, f"config of {source}"


def _check_lengths(options: BenchOptions, max_model_len: int, what: str) -> None:
    """Every prompt plus its output must fit, checked before anything is measured."""
    needs = []
    if {"decode", "spec"} & set(options.workloads):
        needs.append(("--contexts", max(options.contexts) + options.output_tokens))
    if "prefill" in options.workloads:
        needs.append(("--prefill-lengths", max(options.prefill_lengths) + 1))
    if "ttft" in options.workloads:
        needs.append(("--ttft-length", options.ttft_length + 1))
    if "turn" in options.workloads:
        needs.append(
            ("--turn-prefix + --turn-new", agent_turn.tokens_needed(options.turn_prefix, options.turn_new))
        )
    if "restore" in options.workloads:
        needs.append(("--restore-length", options.restore_length + 1 + restore.OUTPUT_TOKENS))
    for flag, tokens in needs:
        if tokens > max_model_len:
            raise MorionError(f"{flag} needs {tokens} tokens (prompt + output) but {what} is {max_model_len}")


def _page_size(target: Target, config: EngineConfig) -> int | None:
    """The engine's page size, or a morion server's; None for another server (its cache is not checked)."""
    from morion.bench.remote import RemoteTarget

    if isinstance(target, RemoteTarget):
        return ((target.server_info or {}).get("config") or {}).get("page_size")
    return config.page_size


def _roofline_header(
    options: BenchOptions, cost: ModelCost | None, source: str, device: str | None, peaks_source: str
) -> dict[str, Any]:
    header: dict[str, Any] = {
        "device": device,
        "bandwidth_gbs": options.bandwidth_gbs,
        "peak_tflops": options.peak_tflops,
        "peaks_source": peaks_source,
        "model_source": source,
        "model": roofline.describe(cost) if cost is not None else None,
    }
    if cost is None:
        header["note"] = "no roofline: pass --roofline-config (or --model) to describe the served model"
    elif options.bandwidth_gbs is None or options.peak_tflops is None:
        header["note"] = f"bound unknown: the device's peaks are {peaks_source}"
    return header


def _default_label(options: BenchOptions, config: EngineConfig, target: Target, prov: dict[str, Any]) -> str:
    if options.url:
        return f"url-{target.describe().get('served_model', 'model')}"
    device = prov.get("device_name") or str(config.torch_device)
    device = device.removeprefix("NVIDIA ").split()[0] if device else "device"
    model = Path(str(config.model or "default")).name.removeprefix("preset:")
    suffix = f"-{config.weight_dtype}" if config.weight_dtype != "auto" else ""
    # A results file with speculative numbers says how they were made in its name too.
    if "spec" in options.workloads:
        suffix += "-spec-ngram" if config.speculative == speculative.REAL else "-spec-synthetic"
    return f"{device}-{model}{suffix}"


def _free_memory() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _write_all(path: Path, result: dict[str, Any]) -> None:
    write_json(path, result)
    md_path = path.with_suffix(".md")
    md_path.write_text(markdown(result))
    png_path = path.with_suffix(".png")
    written = [str(path), str(md_path)]
    if write_png(result, png_path):
        written.append(str(png_path))
    elif not matplotlib_available():
        print(
            f"morion bench: no PNG (matplotlib is not installed here): run `morion bench --plot {path}` "
            "where it is",
            file=sys.stderr,
        )
    print("\n".join(written))


def regenerate(path: Path) -> int:
    """`--plot FILE.json`: the Markdown and PNG again from a results JSON, beside it."""
    try:
        result = json.loads(path.read_text())
    except (OSError, ValueError) as error:
        raise MorionError(f"cannot read the results file {path}: {error}") from None
    if not isinstance(result, dict) or result.get("schema") != SCHEMA:
        raise MorionError(f"{path} is not a morion bench result (schema {SCHEMA})")
    md_path = path.with_suffix(".md")
    md_path.write_text(markdown(result))
    print(md_path)
    png_path = path.with_suffix(".png")
    if write_png(result, png_path):
        print(png_path)
    elif not matplotlib_available():
        print("morion bench: no PNG (matplotlib is not installed here)", file=sys.stderr)
    return 0
