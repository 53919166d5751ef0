from __future__ import annotations

import copy
import json
import os
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

if os.environ.get("PYTEST_XDIST_WORKER"):
    # One worker per core (scripts/test.sh): each computes on one thread, and so do the processes it
    # starts, or OpenMP threads of neighbouring workers spin against each other and everything slows
    # down by orders of magnitude.
    os.environ["OMP_NUM_THREADS"] = "1"

import torch

if not torch.cuda.is_available():
    # Without a GPU, Triton kernels run in Triton's CPU interpreter (design.md §4). It must be chosen
    # before triton is first imported, which `import torch` does not do.
    os.environ.setdefault("TRITON_INTERPRET", "1")
    # transformers' Qwen3-Next binds fla-core's kernels at import whenever `fla` imports, and fla's chunk
    # kernel cannot run on a CPU (its autotuner asks for a GPU driver). Hiding fla makes our reference
    # take transformers' pure-torch path; morion itself imports fla only on CUDA.
    sys.modules.setdefault("fla", None)

import numpy as np
import pytest
import transformers

from morion.config import EngineConfig
from morion.engine.engine import Engine
from morion.engine.sampling_params import SamplingParams
from morion.layers.moe import SparseMoE
from morion.loader import LoadedModel, load_model
from morion.loader.model_store import DEFAULT_MODEL, pull
from morion.ops.attention import causal_attention_reference


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory) -> LoadedModel:
    """A tiny random Llama (vocab 128, 2 layers, GQA), saved and loaded the way users load models."""
    torch.manual_seed(1)
    config = transformers.LlamaConfig(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
    )
    directory = tmp_path_factory.mktemp("tiny_llama")
    transformers.LlamaForCausalLM(config).save_pretrained(directory)
    return load_model(str(directory), torch.float32, torch.device("cpu"))


TINY_QWEN3_NEXT = dict(
    model_type="qwen3_next",
    vocab_size=512,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_key_head_dim=16,
    linear_value_head_dim=16,
    num_experts=4,
    num_experts_per_tok=2,
    moe_intermediate_size=32,
    shared_expert_intermediate_size=32,
    full_attention_interval=2,
    max_position_embeddings=512,
)


@pytest.fixture(scope="session")
def tiny_qwen3_next_config_dir(tmp_path_factory) -> Path:
    """A config-only Qwen3-Next directory (2 Gated DeltaNet + 2 attention layers), for dummy weights."""
    directory = tmp_path_factory.mktemp("tiny_qwen3_next_config")
    (directory / "config.json").write_text(json.dumps(TINY_QWEN3_NEXT))
    return directory


CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@pytest.fixture(scope="session")
def tiny_qwen3_next_chat_dir(tmp_path_factory) -> Path:
    """The tiny Qwen3-Next (config only: dummy weights) with a vocabulary of 258, the ids of a byte-level
    tokenizer with a chat template: a hybrid model that takes text (and splits over two ranks)."""
    directory = tmp_path_factory.mktemp("tiny_qwen3_next_chat")
    config = {**TINY_QWEN3_NEXT, "vocab_size": 258, "eos_token_id": 257}
    (directory / "config.json").write_text(json.dumps(config))
    write_byte_tokenizer(directory, CHAT_TEMPLATE)
    return directory


@pytest.fixture(scope="session")
def tiny_qwen3_next(tiny_qwen3_next_config_dir) -> LoadedModel:
    """Seeded random weights on the CPU (move a copy to another device: weights drawn there differ)."""
    return load_model(str(tiny_qwen3_next_config_dir), torch.float32, torch.device("cpu"), "dummy")


@pytest.fixture(scope="session")
def small_llama(tmp_path_factory) -> LoadedModel:
    """A small random Llama (vocab 256, 3 layers, hidden 128), on the CPU."""
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=256,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
    )
    directory = tmp_path_factory.mktemp("small_llama")
    transformers.LlamaForCausalLM(config).save_pretrained(directory)
    return load_model(str(directory), torch.float32, torch.device("cpu"))


@pytest.fixture(scope="session")
def tiny_vlm_checkpoint(tmp_path_factory) -> tuple[Path, torch.nn.Module]:
    """(directory, transformers reference) of the tiny Qwen3.8-Flash-Next with images (tests/tiny_vlm.py),
    built once per session."""
    from tests import tiny_vlm

    directory = tmp_path_factory.mktemp("tiny_vlm")
    return directory, tiny_vlm.build(directory)


@pytest.fixture(scope="session")
def smollm2_gguf() -> Path:
    """The real default model, pulled once into MORION_HOME (it is never downloaded twice)."""
    return pull(DEFAULT_MODEL, verify_existing=False)


class OneSequenceBackend:
    """The simplest backend: one whole sequence in one forward, no cache; per-request state starts at
    zero and its final value is dropped."""

    def __init__(self, model: torch.nn.Module, num_tokens: int) -> None:
        dtype = next(model.parameters()).dtype
        self._device = next(model.parameters()).device
        self._states = {c.name: c for c in model.cache_spec(16, dtype).state_components}
        self._pools: dict[tuple[str, int], torch.Tensor] = {}
        self.query_ranges = [(0, num_tokens)]
        self.decode_only = num_tokens == 1
        self.cu_seqlens = torch.tensor([0, num_tokens], dtype=torch.int32, device=self._device)
        self.state_indices = torch.zeros(1, dtype=torch.int32, device=self._device)

    def attend(self, layer_index: int, q, k, v, scale: float) -> torch.Tensor:
        return causal_attention_reference(q, k, v, 0, scale)

    def read_state(self, component: str, linear_ordinal: int) -> torch.Tensor:
        spec = self._states[component]
        return torch.zeros(1, *spec.shape, dtype=spec.dtype, device=self._device)

    def write_state(self, component: str, linear_ordinal: int, value: torch.Tensor) -> None:
        pass

    verify_slots = None  # never a speculative verify forward

    def outside_graph(self, op, *inputs: torch.Tensor) -> torch.Tensor:
        return op(self, *inputs)

    def state_pool(self, component: str, linear_ordinal: int) -> torch.Tensor:
        """One zeroed slot per (component, layer), made on first use; what the kernels leave is dropped."""
        key = (component, linear_ordinal)
        if key not in self._pools:
            spec = self._states[component]
            self._pools[key] = torch.zeros(1, *spec.shape, dtype=spec.dtype, device=self._device)
        return self._pools[key]


def full_prefill_logits(model: torch.nn.Module, token_ids: Sequence[int]) -> torch.Tensor:
    """Logits for every position of one sequence, straight through the model's layers (on the CPU)."""
    with torch.inference_mode():
        backend = OneSequenceBackend(model, len(token_ids))
        hidden = model(torch.tensor(token_ids), torch.arange(len(token_ids)), backend)
    return model.compute_logits(hidden)


def with_modules_of(
    model: torch.nn.Module, donor: torch.nn.Module, kind: type, leaf: str | None = None
) -> torch.nn.Module:
    """A copy of `model` with every module of type `kind` (with `leaf`, only those of that attribute
    name) taken from `donor` (same names)."""
    model = copy.deepcopy(model)
    for name, module in donor.named_modules():
        if isinstance(module, kind) and leaf in (None, name.rpartition(".")[2]):
            parent, _, child = name.rpartition(".")
            setattr(model.get_submodule(parent), child, module)
    return model


def with_shared_expert_beside(model: torch.nn.Module) -> torch.nn.Module:
    """A copy of `model` (weights in the model dtype) whose MoE blocks, stacked or separate, hold their
    shared expert beside the routed ones (layers/moe.py: a one-expert stack of its own, its gate the
    router's row E) with the same weights: the layout `--weight-dtype nvfp4` builds."""
    model = copy.deepcopy(model)
    for block in model.modules():
        if not isinstance(block, SparseMoE) or block.shared_experts is not None:
            continue
        experts = block.experts
        if block.shared_slot is not None:
            slot = block.shared_slot
            router = block.gate.weight
            shared_gate_up, shared_down = experts.gate_up_proj[slot], experts.down_proj[slot]
            routed_gate_up, routed_down = experts.gate_up_proj[:slot], experts.down_proj[:slot]
        else:
            shared = block.shared_expert
            router = torch.cat((block.gate.weight, block.shared_expert_gate.weight))
            shared_gate_up = torch.cat((shared.gate_proj.weight, shared.up_proj.weight))
            shared_down = shared.down_proj.weight
            routed_gate_up, routed_down = experts.gate_up_proj, experts.down_proj
        block.set_shared_expert_beside()
        with torch.no_grad():
            block.gate.weight.copy_(router)
            block.experts.gate_up_proj.copy_(routed_gate_up)
            block.experts.down_proj.copy_(routed_down)
            block.shared_experts.gate_up_proj.copy_(shared_gate_up[None])
            block.shared_experts.down_proj.copy_(shared_down[None])
    return model.requires_grad_(False)


def make_engine(loaded: LoadedModel, **options) -> Engine:
    options.setdefault("kv_cache_tokens", 8192)
    options.setdefault("device", "cpu")
    return Engine(EngineConfig(**options), loaded)


def run_engine(
    engine: Engine, prompts: Sequence[Sequence[int]], params: SamplingParams | Sequence[SamplingParams]
):
    """Submits all prompts at once and steps until done; returns the final outputs in prompt order."""
    if isinstance(params, SamplingParams):
        params = [params] * len(prompts)
    ids = [engine.add_request(prompt, p) for prompt, p in zip(prompts, params, strict=True)]
    finals = {}
    while engine.has_unfinished():
        for step in engine.step():
            if step.final is not None:
                finals[step.request_id] = step.final
    return [finals[i] for i in ids]


def assert_same_greedy(
    ours: Sequence[int],
    reference: Sequence[int],
    reference_logits: Callable[[int], torch.Tensor],
    tie_gap: float,
) -> None:
    """Greedy continuations must match token for token. A divergence is accepted only where the
    reference's own logits show a near-tie (top-1 minus top-2 below `tie_gap`) at that step."""
    for step, (mine, theirs) in enumerate(zip(ours, reference, strict=False)):
        if mine == theirs:
            continue
        top2 = reference_logits(step).topk(2).values
        gap = (top2[0] - top2[1]).item()
        assert gap < tie_gap, (
            f"greedy diverged at step {step} ({mine} vs {theirs}) with a clear gap {gap:.4f}"
        )
        return
    assert len(ours) == len(reference), f"lengths differ: {len(ours)} vs {len(reference)}"


@pytest.fixture(scope="session")
def greedy_checker() -> Callable[..., None]:
    return assert_same_greedy


@pytest.fixture(scope="session")
def engine_factory() -> Callable[..., Engine]:
    return make_engine


@pytest.fixture(scope="session")
def engine_runner() -> Callable[..., list]:
    return run_engine


@pytest.fixture(scope="session")
def prefill_logits() -> Callable[..., torch.Tensor]:
    return full_prefill_logits


def assert_outputs_agree(model, prompts, outputs, references, tie_gap: float) -> None:
    """Each output's greedy tokens equal its reference's, except where `model`'s logits (a full prefill of
    the prompt and the reference's tokens so far) nearly tie, within `tie_gap`."""
    for prompt, output, reference in zip(prompts, outputs, references, strict=True):
        assert_same_greedy(
            output.token_ids,
            reference.token_ids,
            lambda step, p=prompt, r=reference: full_prefill_logits(model, p + r.token_ids[:step])[-1],
            tie_gap,
        )


@pytest.fixture(scope="session")
def outputs_agree() -> Callable[..., None]:
    return assert_outputs_agree


# -- MTP drafter test helpers (tests/engine/test_speculative.py, tests/models/test_qwen4_exp_mtp.py) --


class PendingOnlyMtp:
    """The MTP drafter without its after-verify path: every draft goes through extend-on-propose."""

    name = "mtp (pending path)"

    def __init__(self, drafter) -> None:
        self._drafter = drafter

    def observe(self, request, start, hidden) -> None:
        self._drafter.observe(request, start, hidden)

    def propose(self, requests, width):
        return self._drafter.propose(requests, width)

    def release(self, request_id) -> None:
        self._drafter.release(request_id)


def recorded_proposals(engine) -> list:
    """Every proposal the engine's drafter makes from now on: per call, (request id, drafts) pairs."""
    record, drafter = [], engine.speculative.drafter
    original = drafter.propose

    def propose(requests, width):
        drafts = original(requests, width)
        record.append(
            [(r.request_id, list(tokens)) for r, tokens in zip(requests, drafts.tokens, strict=True)]
        )
        return drafts

    drafter.propose = propose
    return record


def write_byte_tokenizer(directory: Path, chat_template: str | None) -> None:
    """A byte-level BPE without merges (one token per byte, ids 0-255) and two special tokens (256, 257:
    the end of a turn, also EOS), written to `directory` as tokenizer.json and tokenizer_config.json."""
    from tokenizers import Tokenizer as FastTokenizer
    from tokenizers import decoders, models, pre_tokenizers

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    backend = FastTokenizer(models.BPE(vocab={ch: i for i, ch in enumerate(alphabet)}, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens(["<|im_start|>", "<|im_end|>"])
    backend.save(str(directory / "tokenizer.json"))
    config = {"eos_token": "<|im_end|>", **({"chat_template": chat_template} if chat_template else {})}
    (directory / "tokenizer_config.json").write_text(json.dumps(config))


def small_token_map(directory: Path, eos_id: int) -> Path:
    """An FR-Spec token map of 64 ids (`morion frspec build`'s content) from a word-level tokenizer of 100
    words and a corpus of every third one, written to `directory`/map.json."""
    from tokenizers import Tokenizer as FastTokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Whitespace

    from morion.spec.frspec import build_token_map, write_token_map
    from morion.text.tokenizer import Tokenizer

    words = [f"w{i}" for i in range(100)]
    backend = FastTokenizer(WordLevel({w: i for i, w in enumerate(words)}, unk_token="w0"))
    backend.pre_tokenizer = Whitespace()
    corpus = directory / "corpus.txt"
    corpus.write_text(" ".join(words[::3]) * 5)
    token_map = directory / "map.json"
    write_token_map(build_token_map(Tokenizer(backend, [eos_id]), [corpus], size=64), token_map)
    return token_map


@pytest.fixture
def exact_e4m3_casts_in_the_interpreter(monkeypatch):
    """Triton 3.7's interpreter converts fp32 to e4m3 with a lost carry (127.9 -> 64, not 128) and ties
    away from zero; the hardware rounds to nearest even. Under the interpreter, e4m3 conversions go
    through torch's (round to nearest even, as the GPU), so FP8 results can be checked closely here."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        return
    import triton.language as tl
    from triton.runtime import interpreter

    original = interpreter.InterpreterBuilder.create_fp_to_fp

    def create_fp_to_fp(self, src, dst_type, rounding_mode):
        if dst_type.scalar != tl.float8e4nv or src.dtype.scalar not in (tl.float32, tl.float16):
            return original(self, src, dst_type, rounding_mode)
        values = torch.from_numpy(np.array(src.data, dtype=np.float32))
        codes = values.to(torch.float8_e4m3fn).view(torch.uint8).numpy()
        return interpreter.TensorHandle(codes, dst_type.scalar)

    monkeypatch.setattr(interpreter.InterpreterBuilder, "create_fp_to_fp", create_fp_to_fp)
