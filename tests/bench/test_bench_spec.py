"""`morion bench --workloads spec` on the tiny Qwen3-Next (a hybrid: the verify forward rolls its Gated
DeltaNet state back): plain and speculative decode of the same fresh prompts on one set of weights, the
speculative engine under forced acceptance (outputs not compared), the speedup and the mean accepted
length measured over the measured runs only and consistent with the set acceptance; results labelled
SYNTHETIC; its errors. Then the real-acceptance mode (`--speculative ngram`) on a tiny dense model with a
byte-level tokenizer and a chat template: code-edit prompts, outputs identical to plain (and a difference
failing the bench), the SpecStats and drafter counts consistent, results labelled REAL."""

from __future__ import annotations

import json
import math
import statistics
from pathlib import Path

import pytest

from morion.bench import speculative
from morion.bench.prompts import CODE_EDIT, CodeEditPrompts
from morion.bench.report import markdown
from morion.cli import main
from morion.errors import MorionError
from morion.loader.hf_tokenizer import load_hf_tokenizer
from morion.spec.forced import ForcedAcceptance
from morion.spec.synthetic import acceptance_for_mean_accepted
from tests.bench.conftest import run_bench
from tests.conftest import CHAT_TEMPLATE, write_byte_tokenizer

WIDTH, OUTPUT, MEAN = 3, 48, 2.58
TINY_SPEC = [
    "--device", "cpu", "--kv-cache-tokens", "2048", "--workloads", "spec", "--spec-width", str(WIDTH),
    "--contexts", "32", "--output-tokens", str(OUTPUT),
]  # fmt: skip
# Standard deviations a measured mean may lie from its expectation: with the normal approximation, a
# correct run lands outside about once in 150,000 (the seed is the prompt salt, new every run).
SIGMAS = 4.5


def _bench(model_dir: Path, flags: list[str], out: Path) -> tuple[int, str]:
    """Runs `morion bench` on the tiny model with the TINY_SPEC flags: (exit status, stderr)."""
    return run_bench(["--model", str(model_dir), "--load-format", "dummy", *TINY_SPEC, *flags], out)


@pytest.fixture(scope="module")
def spec_result(tiny_qwen3_next_config_dir, tmp_path_factory) -> tuple[dict, Path, str]:
    out = tmp_path_factory.mktemp("spec")
    flags = ["--concurrency", "1,4", "--repeats", "2", "--spec-mean-accepted", str(MEAN), "--label", "tiny"]
    status, stderr = _bench(tiny_qwen3_next_config_dir, flags, out)
    assert status == 0, stderr
    [path] = out.glob("*-tiny.json")
    return json.loads(path.read_text()), path, stderr


def test_results_are_labelled_synthetic_and_record_the_setting(spec_result):
    result, _, _ = spec_result
    section = result["spec"]
    assert result["status"] == "complete" and section["synthetic"] is True
    assert section["method"] == "forced acceptance"
    assert section["width"] == WIDTH and section["target_mean_accepted"] == MEAN
    assert section["acceptance_p"] == acceptance_for_mean_accepted(MEAN, WIDTH)
    assert section["acceptance_seed"] == result["settings"]["prompt_salt"] and section["skipped"] == []
    assert section["drafter"] == "cost-free" and section["drafter_name"] == "cost-free"
    assert "failures" not in section and "outputs_must_match" not in section  # outputs are not compared
    assert result["engine_config"]["spec_width"] == WIDTH and result["engine_config"]["speculative"] == "off"
    assert result["settings"]["spec_mean_accepted"] == MEAN
    assert "--workloads spec" in result["provenance"]["command"]
    assert result["decode"] == [] and result["restore"] is None


def test_both_engines_generate_every_token_and_the_speedup_is_the_ratio_of_medians(spec_result):
    points = spec_result[0]["spec"]["points"]
    assert [(p["concurrency"], p["context"]) for p in points] == [(1, 32), (4, 32)]
    for point in points:
        assert len(point["runs"]) == 2 and len(point["warmup_runs"]) == 1 and "identical" not in point
        for run in point["runs"]:
            assert "identical" not in run and "first_difference" not in run
            for kind in ("plain", "speculative"):
                requests = run[kind]["requests"]
                assert len(requests) == point["concurrency"]
                assert all(r["completion_tokens"] == OUTPUT and r["cached_tokens"] == 0 for r in requests)
        median = {
            kind: statistics.median(run[kind]["per_request_tok_s"] for run in point["runs"])
            for kind in ("plain", "speculative")
        }
        assert point["median"]["plain_per_request_tok_s"] == median["plain"]
        assert point["median"]["speculative_per_request_tok_s"] == median["speculative"]
        assert point["speedup"] == median["speculative"] / median["plain"]


def test_mean_accepted_length_comes_from_the_measured_runs_alone(spec_result):
    for point in spec_result[0]["spec"]["points"]:
        runs = point["runs"]
        for run in runs:
            change = run["spec_stats"]
            # One run's change, not the engine's totals: at most every request's decode tokens, plus the
            # drafts of a request's last verify step that went past its end (warm-ups would add theirs).
            assert change["emitted_tokens"] <= point["concurrency"] * (OUTPUT - 1 + WIDTH)
            assert change["verify_steps"] > 0 and change["verify_graph_replays"] == 0  # no graphs on a CPU
            assert sum(change["drafted_by_position"]) == change["drafted_tokens"]
            assert sum(change["accepted_by_position"]) == change["accepted_tokens"]
            steps = change["emitted_tokens"] - change["accepted_tokens"]
            assert run["mean_accepted"] == change["emitted_tokens"] / steps
        total = point["spec_stats"]
        for key in ("verify_steps", "drafted_tokens", "accepted_tokens", "emitted_tokens"):
            assert total[key] == sum(run["spec_stats"][key] for run in runs)
        assert total["drafted_by_position"] == [
            sum(c) for c in zip(*(r["spec_stats"]["drafted_by_position"] for r in runs), strict=True)
        ]
        mean = total["emitted_tokens"] / (total["emitted_tokens"] - total["accepted_tokens"])
        assert point["measured_mean_accepted"] == mean and 1 < mean < WIDTH + 1
        rates = [
            a / d for a, d in zip(total["accepted_by_position"], total["drafted_by_position"], strict=True)
        ]
        assert point["acceptance_by_position"] == rates and len(rates) == WIDTH


def test_measured_acceptance_lies_within_a_statistical_bound_of_the_set_one(spec_result):
    """Each request-step accepts A drafts, P(A >= j) = p^j for j <= width, independently: over N steps the
    mean accepted length (1 + A averaged) has standard deviation sd(A) / sqrt(N), and the acceptance at
    position j is a binomial rate with mean p^j. Pooled over every run, warm-ups included (the same
    draws; the report leaves them out only because they are not timed)."""
    section = spec_result[0]["spec"]
    p = section["acceptance_p"]
    law = [p**a * (1 - p) for a in range(WIDTH)] + [p**WIDTH]  # P(A = a), a = 0 .. width
    mean = sum(a * q for a, q in enumerate(law))
    sd = math.sqrt(sum((a - mean) ** 2 * q for a, q in enumerate(law)))  # 1.24 at 2.58
    assert 1 + mean == pytest.approx(MEAN)
    runs = [run for point in section["points"] for run in [*point["warmup_runs"], *point["runs"]]]
    changes = [run["spec_stats"] for run in runs]
    accepted = sum(c["accepted_tokens"] for c in changes)
    steps = sum(c["emitted_tokens"] - c["accepted_tokens"] for c in changes)
    assert steps >= 200  # enough that the bound means something: within +-0.4 of the set mean
    assert abs((steps + accepted) / steps - MEAN) <= SIGMAS * sd / math.sqrt(steps)
    for j in range(WIDTH):
        rate, expected = sum(c["accepted_by_position"][j] for c in changes) / steps, p ** (j + 1)
        assert sum(c["drafted_by_position"][j] for c in changes) == steps  # every step drafts the full width
        assert abs(rate - expected) <= SIGMAS * math.sqrt(expected * (1 - expected) / steps)


def test_the_recorded_seed_reproduces_every_acceptance_draw(spec_result):
    """One forced-acceptance generator, seeded with `acceptance_seed`, serves the speculative engine's
    whole life (warm-ups included), one truncated geometric draw per request and verify step."""
    section = spec_result[0]["spec"]
    runs = [run for point in section["points"] for run in [*point["warmup_runs"], *point["runs"]]]
    steps = sum(run["spec_stats"]["emitted_tokens"] - run["spec_stats"]["accepted_tokens"] for run in runs)
    assert sum(run["spec_stats"]["drafted_tokens"] for run in runs) == WIDTH * steps
    forced = ForcedAcceptance(section["acceptance_p"], section["acceptance_seed"])
    draws = sum(forced.num_accepted(WIDTH) for _ in range(steps))
    assert sum(run["spec_stats"]["accepted_tokens"] for run in runs) == draws


def test_markdown_and_progress_lines(spec_result):
    result, path, stderr = spec_result
    text = path.with_suffix(".md").read_text()
    assert text == markdown(result)
    heading = "## Speculative decoding, SYNTHETIC (forced acceptance): width 3, p = 0.712, set for 2.58"
    assert heading in text and "**SYNTHETIC**: each verify step accepts each draft with probability p" in text
    assert "Drafter `cost-free`: repeats of the last token, no draft model runs" in text
    assert "Outputs are not compared with plain" in text
    assert "| plain tok/s [1] | speculative tok/s [1] | speedup |" in text
    rows = [line for line in text.splitlines() if line.startswith(("| 1 | 32 |", "| 4 | 32 |"))]
    assert len(rows) == 2 and all(row.endswith("| 0 |") for row in rows)  # verify graph replays, last
    speedup = result["spec"]["points"][1]["speedup"]
    assert f"| {speedup:.2f}x |" in rows[1]
    assert "[9] speculative decoding, SYNTHETIC (forced acceptance)" in text
    assert "[10] measured mean accepted length" in text and "identical" not in text
    assert "[7]" not in text  # no restore footnotes without the restore workload
    assert "spec C=4 ctx=32: run 2/2: plain " in stderr and ", mean accepted " in stderr
    assert "spec C=1 ctx=32: median per-request plain " in stderr and "identical" not in stderr


def test_a_result_of_the_oracle_method_is_not_rendered_as_forced_acceptance(spec_result):
    """`--plot` on a result measured before forced acceptance (no `method`) says so instead of
    describing it wrongly."""
    result = json.loads(json.dumps(spec_result[0]))
    del result["spec"]["method"]
    text = markdown(result)
    assert "## Speculative decoding, SYNTHETIC (oracle drafter): width 3" in text
    assert "superseded oracle method" in text and "[9]" not in text and "| C | context |" not in text


@pytest.mark.parametrize("speculative", ["off", "mtp"])
@pytest.mark.parametrize("mean", [1, WIDTH + 1])
def test_acceptance_at_the_extremes(tiny_qwen3_next_config_dir, tmp_path, mean, speculative):
    """p = 0 accepts nothing (one token per verify step); p = 1 accepts every draft (width + 1 tokens per
    step, exactly: a step's tokens count before max_tokens cuts a request's last one). Without
    --speculative a cost-free drafter proposes; with mtp the model's MTP head does, for real."""
    flags = ["--concurrency", "2", "--repeats", "1", "--warmup-runs", "0", "--output-tokens", "24"]
    flags += ["--spec-mean-accepted", str(mean), "--speculative", speculative]
    status, stderr = _bench(tiny_qwen3_next_config_dir, flags, tmp_path)
    assert status == 0, stderr
    [path] = tmp_path.glob("*.json")
    result = json.loads(path.read_text())
    section = result["spec"]
    [point] = section["points"]
    change = point["spec_stats"]
    assert change["accepted_tokens"] == (change["drafted_tokens"] if mean == WIDTH + 1 else 0)
    assert point["measured_mean_accepted"] == mean
    [run] = point["runs"]
    assert all(r["completion_tokens"] == 24 for r in run["speculative"]["requests"])
    assert result["engine_config"]["speculative"] == speculative  # as given; the plain engine runs without
    drafter = {"off": "cost-free", "mtp": "mtp"}[speculative]
    assert section["drafter"] == drafter and section["drafter_name"] == drafter
    if speculative == "mtp":
        text = path.with_suffix(".md").read_text()
        assert "Drafter `mtp`: the model's MTP head drafts as it would" in text


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--url", "http://127.0.0.1:9"], "--workloads spec needs the offline engine"),
        ([], "--workloads spec needs --spec-width N, the draft width: e.g. --spec-width 3"),
        (["--spec-width", "2", "--spec-mean-accepted", "3.5"], "--spec-mean-accepted 3.5 must be in [1, 3]"),
        (["--spec-width", "3", "--spec-mean-accepted", "0.5"], "--spec-mean-accepted must be >= 1"),
        (
            ["--speculative", "ngram"],
            "--workloads spec needs --spec-width N, the draft width: e.g. --spec-width 4",
        ),
        (
            ["--spec-width", "3", "--speculative", "ngram", "--host-cache-gb", "1"],
            "leave out --host-cache-gb",
        ),
        (["--spec-width", "3", "--host-cache-gb", "1"], "leave out --host-cache-gb and --disk-cache-dir"),
    ],
)
def test_flag_errors_are_one_line(flags, message, tmp_path, capsys):
    assert main(["bench", "--device", "cpu", "--workloads", "spec", *flags, "--out", str(tmp_path)]) == 1
    err = capsys.readouterr().err
    assert err.startswith("morion: error: ") and err.count("\n") == 1
    assert message in err
    assert not list(tmp_path.iterdir())


# ------------------------------------------------------------------------------ real acceptance (ngram)
NGRAM_OUTPUT, NGRAM_CONTEXT = 32, 1024


@pytest.fixture(scope="module")
def tiny_chat_llama_dir(tmp_path_factory) -> Path:
    """A config-only tiny Llama (random weights with --load-format dummy) with a byte-level tokenizer and a
    chat template: a dense model the code-edit prompts can be written for."""
    directory = tmp_path_factory.mktemp("tiny_chat_llama")
    config = dict(
        model_type="llama", vocab_size=264, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048, eos_token_id=257,
    )  # fmt: skip
    (directory / "config.json").write_text(json.dumps(config))
    write_byte_tokenizer(directory, CHAT_TEMPLATE)
    return directory


def _ngram_bench(model_dir: Path, flags: list[str], out: Path) -> tuple[int, str]:
    model = ["--model", str(model_dir), "--load-format", "dummy", "--device", "cpu", "--kv-cache-tokens"]
    spec = ["4096", "--workloads", "spec", "--speculative", "ngram", "--spec-width", str(WIDTH)]
    shape = ["--contexts", str(NGRAM_CONTEXT), "--output-tokens", str(NGRAM_OUTPUT)]
    return run_bench([*model, *spec, *shape, *flags], out)


@pytest.fixture(scope="module")
def ngram_result(tiny_chat_llama_dir, tmp_path_factory) -> tuple[dict, Path, str]:
    out = tmp_path_factory.mktemp("ngram")
    flags = ["--concurrency", "1,2", "--repeats", "2", "--label", "tiny-ngram"]
    status, stderr = _ngram_bench(tiny_chat_llama_dir, flags, out)
    assert status == 0, stderr
    [path] = out.glob("*-tiny-ngram.json")
    return json.loads(path.read_text()), path, stderr


def _all_runs(section: dict) -> list[tuple[dict, dict]]:
    return [(p, run) for p in section["points"] for run in [*p["warmup_runs"], *p["runs"]]]


def test_real_section_is_labelled_real_and_records_drafter_and_prompts(ngram_result):
    result, _, _ = ngram_result
    section = result["spec"]
    assert result["status"] == "complete"
    assert section["synthetic"] is False and section["method"] == "real acceptance"
    assert section["drafter"] == "ngram" and section["drafter_name"] == "ngram" and section["ngram"] == [2, 4]
    assert section["width"] == WIDTH and section["outputs_must_match"] is True and section["failures"] == []
    assert section["prompt_set"]["name"] == CODE_EDIT and section["prompt_set"]["format"] == "chat template"
    assert "acceptance_p" not in section and "target_mean_accepted" not in section  # nothing is forced
    assert (
        result["engine_config"]["speculative"] == "ngram" and result["engine_config"]["spec_width"] == WIDTH
    )
    assert [(p["concurrency"], p["context"]) for p in section["points"]] == [(1, 1024), (2, 1024)]


def test_prompts_are_code_edits_rebuilt_from_their_keys(ngram_result, tiny_chat_llama_dir):
    """Each request's prompt is the code-edit prompt of its key, at most the context, the same when made
    again; every request in the invocation has its own."""
    section = ngram_result[0]["spec"]
    tokenizer = load_hf_tokenizer(tiny_chat_llama_dir, {})
    prompts = CodeEditPrompts(tokenizer)
    texts = []
    for point, run in _all_runs(section):
        assert len(run["prompts"]) == point["concurrency"]
        for i, (made, request) in enumerate(zip(run["prompts"], run["plain"]["requests"], strict=True)):
            again = prompts.make(f"{run['prompt_key']}:{i}", point["context"])
            assert made["text"] == again.text and made["task"] == again.task
            assert (
                made["prompt_tokens"] == len(again.token_ids) == request["prompt_tokens"] <= point["context"]
            )
            assert made["instruction"] in made["text"] and "```python\n" in made["text"]
            texts.append(made["text"])
    assert len(set(texts)) == len(texts)


def test_speculative_outputs_equal_plain_token_for_token(ngram_result):
    section = ngram_result[0]["spec"]
    for point, run in _all_runs(section):
        count = point["concurrency"]
        assert run["identical"] == [True] * count and run["first_difference"] == [None] * count
        assert run["speculative_output_token_ids"] == [None] * count
        expected = [r["completion_tokens"] for r in run["plain"]["requests"]]
        assert [len(ids) for ids in run["plain_output_token_ids"]] == expected == [NGRAM_OUTPUT] * count
        assert [r["completion_tokens"] for r in run["speculative"]["requests"]] == expected
        assert point["identical"] is True


def test_real_acceptance_counters_are_consistent(ngram_result):
    """From the SpecStats change and the drafter's counts of each run: drafts were proposed and some
    accepted; at C1 every proposal is one verify step, and the decode tokens are what the verify and plain
    steps gave (a last verify step may run past max_tokens by up to the width)."""
    section = ngram_result[0]["spec"]
    for point, run in _all_runs(section):
        change = run["spec_stats"]
        steps = change["emitted_tokens"] - change["accepted_tokens"]  # verify request-steps
        assert 0 < change["accepted_tokens"] <= change["drafted_tokens"] <= WIDTH * steps
        assert sum(change["drafted_by_position"]) == change["drafted_tokens"]
        assert sum(change["accepted_by_position"]) == change["accepted_tokens"]
        pairs = zip(change["accepted_by_position"], change["drafted_by_position"], strict=True)
        assert all(a <= d for a, d in pairs)
        assert steps == change["drafter_proposed"] <= change["drafter_asked"]
        assert (
            run["mean_accepted"] == change["emitted_tokens"] / steps and 1 < run["mean_accepted"] <= WIDTH + 1
        )
        if point["concurrency"] == 1:
            assert change["verify_steps"] == steps
            decoded = run["speculative"]["requests"][0]["completion_tokens"] - 1
            plain_steps = change["drafter_asked"] - change["drafter_proposed"]
            assert 0 <= change["emitted_tokens"] + plain_steps - decoded <= WIDTH
    for point in section["points"]:
        total, runs = point["spec_stats"], point["runs"]
        for key in ("verify_steps", "drafted_tokens", "accepted_tokens", "emitted_tokens", "drafter_asked"):
            assert total[key] == sum(run["spec_stats"][key] for run in runs)
        steps = total["emitted_tokens"] - total["accepted_tokens"]
        assert point["measured_mean_accepted"] == total["emitted_tokens"] / steps
        rates = [
            a / d for a, d in zip(total["accepted_by_position"], total["drafted_by_position"], strict=True)
        ]
        assert point["acceptance_by_position"] == rates and len(rates) == WIDTH
        assert point["proposal_rate"] == total["drafter_proposed"] / total["drafter_asked"]
        decoded = sum(r["completion_tokens"] - 1 for run in runs for r in run["speculative"]["requests"])
        assert point["decode_tokens_per_step"] == decoded / total["drafter_asked"] > 1
        medians = [
            statistics.median(run[k]["per_request_tok_s"] for run in runs) for k in ("plain", "speculative")
        ]
        assert point["speedup"] == medians[1] / medians[0]


def test_real_markdown_and_progress_lines(ngram_result):
    result, path, stderr = ngram_result
    text = path.with_suffix(".md").read_text()
    assert text == markdown(result)
    heading = "## Speculative decoding, REAL acceptance (not synthetic): `ngram` drafter, width 3, code-edit"
    assert heading in text and "SYNTHETIC" not in text and "[9]" not in text
    assert "**REAL**: the n-gram drafter (prompt lookup over each request's own tokens, n = 2..4)" in text
    assert "all 9 requests (warm-ups included) identical" in text  # C1: 1 + 2 runs, C2: 2 x (1 + 2)
    assert "[11] speculative decoding, REAL acceptance (not synthetic)" in text
    assert "[12] measured mean accepted length" in text
    for point in result["spec"]["points"]:
        [row] = [line for line in text.splitlines() if line.startswith(f"| {point['concurrency']} | ")]
        assert f"| {point['speedup']:.2f}x | {point['measured_mean_accepted']:.2f} |" in row
        assert row.endswith("| identical |")
    assert "spec C=2 ctx=1024: run 2/2: plain " in stderr and ", outputs identical" in stderr
    assert (
        "spec C=1 ctx=1024: median per-request plain " in stderr and "% of steps, outputs identical" in stderr
    )


def test_an_output_that_differs_from_plain_fails_the_bench(tiny_chat_llama_dir, tmp_path, monkeypatch):
    """A speculative output changed after the fact (as a broken verify would) is recorded and fails the
    bench with one error line, after the results are written."""
    real_generate = speculative.generate

    def broken(engine, prompts, max_tokens):
        timings, outputs = real_generate(engine, prompts, max_tokens)
        if engine.speculative is not None:
            outputs[0][-1] += 1
        return timings, outputs

    monkeypatch.setattr(speculative, "generate", broken)
    flags = ["--concurrency", "1", "--repeats", "1", "--warmup-runs", "0", "--label", "broken"]
    status, stderr = _ngram_bench(tiny_chat_llama_dir, flags, tmp_path)
    assert status == 1
    message = (
        "morion: error: spec FAILED: greedy output with --speculative ngram differs from plain: C1 ctx "
        f"1,024, run 1: output differs from plain at request 0 from token {NGRAM_OUTPUT - 1} (1 differing"
    )
    assert message in stderr and stderr.count("morion: error") == 1
    [path] = tmp_path.glob("*-broken.json")
    result = json.loads(path.read_text())
    assert result["status"] == "complete"  # every point ran and was written before the error
    [point] = result["spec"]["points"]
    [run] = point["runs"]
    assert run["identical"] == [False] and run["first_difference"] == [NGRAM_OUTPUT - 1]
    assert run["speculative_output_token_ids"][0][-1] == run["plain_output_token_ids"][0][-1] + 1
    assert point["identical"] is False and len(result["spec"]["failures"]) == 1
    text = path.with_suffix(".md").read_text()
    assert "**FAILED**: 1 of 1 requests differ" in text and "| **FAILED** |" in text
    assert "- FAILED: C1 ctx 1,024, run 1: output differs from plain at request 0" in text


def test_real_mode_needs_a_tokenizer(tiny_qwen3_next_config_dir, tmp_path):
    status, stderr = _ngram_bench(tiny_qwen3_next_config_dir, ["--contexts", "64"], tmp_path)
    assert status == 1
    assert (
        "morion: error: --workloads spec --speculative ngram builds code-edit prompts with the model's"
        in stderr
    )


def test_code_edit_prompts(tiny_chat_llama_dir, tmp_path):
    """Deterministic per key, within the budget and longer for a larger one, every task kind over a few
    keys, each instruction's target in the file; plain text without a chat template; too small a budget is
    one error."""
    prompts = CodeEditPrompts(load_hf_tokenizer(tiny_chat_llama_dir, {}))
    made = [prompts.make(f"k:{i}", 1500) for i in range(16)]
    assert all(len(p.token_ids) <= 1500 for p in made) and {p.task for p in made} == set(_TASKS)
    assert prompts.make("k:0", 1500) == made[0] and made[1].text != made[0].text
    assert prompts.make("k:0", 3000).functions > made[0].functions
    for p in made:
        assert p.token_ids[:1] == [256] and p.text.startswith(p.instruction)  # <|im_start|>, the user message
        if p.task != "type-hints":  # the function, constant or call the instruction names first
            target = p.instruction.split("`")[1].replace("...)", "")
            assert target in p.text.split("```python\n", 1)[1]
    write_byte_tokenizer(tmp_path, None)
    plain = CodeEditPrompts(load_hf_tokenizer(tmp_path, {}))
    text = plain.make("k:0", 1500)
    assert not plain.chat and text.text == made[0].text and len(text.token_ids) == len(text.text.encode())
    assert plain.tokenizer.decode(text.token_ids, skip_special_tokens=False) == text.text  # no chat markers
    with pytest.raises(MorionError, match="a code-edit prompt needs more than 200 tokens"):
        prompts.make("k:0", 200)


_TASKS = ("constant", "logging", "rename", "type-hints")
