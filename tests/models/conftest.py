"""Fixtures for hybrid models: a reference cache backend, a registry-like builder, the engine's paged
backend driven directly, and the tiny Qwen3-Next and Qwen3.8-Flash-Next (qwen4_exp) configs."""

from __future__ import annotations

import json
import random
from collections.abc import Callable, Sequence
from pathlib import Path

import pytest
import torch
import transformers

from morion.cache.page_pool import PagePool
from morion.cache.spec import CacheSpec
from morion.cache.state_slots import StateSlots
from morion.loader import LoadedModel, load_model
from morion.models.qwen3_next import Qwen3NextForCausalLM
from morion.ops.attention import causal_attention_reference
from morion.runner.backend import PagedAttentionBackend
from morion.runner.forward_batch import build_forward_batch


class ReferenceHybridBackend:
    """The simplest implementation of `HybridBackend`: contiguous K/V per sequence and attention
    layer, and a zero-initialised state tensor per (component, linear layer) for every sequence.

    `run(model, {sequence: new token ids, ...})` is one forward over the named sequences (in that
    order, concatenated); it returns each one's logits for its new tokens. Sequences not named keep
    their cache untouched.
    """

    def __init__(self, spec: CacheSpec, num_sequences: int = 1, device: torch.device | str = "cpu") -> None:
        (kv,) = spec.token_components
        self.num_attention_layers = kv.num_layers
        self.kv_dtype = kv.dtype
        self.keys = [[None] * kv.num_layers for _ in range(num_sequences)]
        self.values = [[None] * kv.num_layers for _ in range(num_sequences)]
        self.num_cached = [0] * num_sequences
        self.states = {
            c.name: torch.zeros(c.num_layers, num_sequences, *c.shape, dtype=c.dtype, device=device)
            for c in spec.state_components
        }
        self.device = torch.device(device)
        self._active: list[int] = []
        self._ranges: list[tuple[int, int]] = []
        self._cu_seqlens = torch.zeros(1, dtype=torch.int32, device=self.device)
        self._state_indices = torch.zeros(0, dtype=torch.int32, device=self.device)

    # -- HybridBackend --------------------------------------------------------------------------

    @property
    def query_ranges(self) -> Sequence[tuple[int, int]]:
        return self._ranges

    def attend(self, layer_index: int, q, k, v, scale: float) -> torch.Tensor:
        out = torch.empty_like(q)
        for seq, (start, length) in zip(self._active, self._ranges, strict=True):
            span = slice(start, start + length)
            keys, values = self.keys[seq][layer_index], self.values[seq][layer_index]
            new_k, new_v = k[span].to(self.kv_dtype), v[span].to(self.kv_dtype)
            keys = new_k if keys is None else torch.cat((keys, new_k))
            values = new_v if values is None else torch.cat((values, new_v))
            self.keys[seq][layer_index], self.values[seq][layer_index] = keys, values
            out[span] = causal_attention_reference(
                q[span], keys.to(q.dtype), values.to(q.dtype), self.num_cached[seq], scale
            )
        return out

    def read_state(self, component: str, linear_ordinal: int) -> torch.Tensor:
        return self.states[component][linear_ordinal, self._active].clone()

    def write_state(self, component: str, linear_ordinal: int, value: torch.Tensor) -> None:
        stored = self.states[component]
        expected = (len(self._active), *stored.shape[2:])
        assert tuple(value.shape) == expected, f"{component} state {tuple(value.shape)}, expected {expected}"
        stored[linear_ordinal, self._active] = value.to(stored.dtype)

    # The in-place members (the CUDA path): sequence n's pool row is its own index, so the pool of a
    # (component, layer) is simply that layer's slice of `states`.

    @property
    def decode_only(self) -> bool:
        return all(length == 1 for _, length in self._ranges)

    @property
    def cu_seqlens(self) -> torch.Tensor:
        return self._cu_seqlens

    @property
    def state_indices(self) -> torch.Tensor:
        return self._state_indices

    verify_slots = None  # never a speculative verify forward

    def outside_graph(self, op, *inputs: torch.Tensor) -> torch.Tensor:
        return op(self, *inputs)

    def state_pool(self, component: str, linear_ordinal: int) -> torch.Tensor:
        return self.states[component][linear_ordinal]

    # -- driving it -------------------------------------------------------------------------------

    @torch.inference_mode()
    def run(self, model: torch.nn.Module, new_tokens: dict[int, Sequence[int]]) -> dict[int, torch.Tensor]:
        self._active = list(new_tokens)
        self._ranges, ids, positions = [], [], []
        for seq, tokens in new_tokens.items():
            self._ranges.append((len(ids), len(tokens)))
            ids.extend(tokens)
            positions.extend(range(self.num_cached[seq], self.num_cached[seq] + len(tokens)))
        # Fixed for the whole forward, on the states' device (the HybridBackend contract).
        ends = [start + length for start, length in self._ranges]
        self._cu_seqlens = torch.tensor([0, *ends], dtype=torch.int32, device=self.device)
        self._state_indices = torch.tensor(self._active, dtype=torch.int32, device=self.device)
        model_device = next(model.parameters()).device
        hidden = model(
            torch.tensor(ids, device=model_device), torch.tensor(positions, device=model_device), self
        )
        logits = model.compute_logits(hidden)
        for seq, tokens in new_tokens.items():
            self.num_cached[seq] += len(tokens)
        return {
            seq: logits[start : start + length]
            for seq, (start, length) in zip(new_tokens, self._ranges, strict=True)
        }

    def prefill(
        self, model: torch.nn.Module, tokens: Sequence[int], chunk: int | None = None
    ) -> torch.Tensor:
        """Sequence 0's logits for every token, fed `chunk` tokens per forward (all at once if None)."""
        chunk = chunk or len(tokens)
        pieces = [self.run(model, {0: tokens[i : i + chunk]})[0] for i in range(0, len(tokens), chunk)]
        return torch.cat(pieces)


@pytest.fixture
def hybrid_backend() -> Callable[..., ReferenceHybridBackend]:
    """`hybrid_backend(model, num_sequences=1)`: a fresh reference backend for the model's cache spec."""

    def make(model: Qwen3NextForCausalLM, num_sequences: int = 1) -> ReferenceHybridBackend:
        weight = model.model.embed_tokens.weight
        return ReferenceHybridBackend(model.cache_spec(16, weight.dtype), num_sequences, weight.device)

    return make


@pytest.fixture(scope="session")
def build_qwen3_next() -> Callable[..., torch.nn.Module]:
    """`build_qwen3_next(directory, dtype=fp32)`: the model of a transformers `save_pretrained` dir."""

    def build(directory: Path, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
        return load_model(str(directory), dtype, torch.device("cpu")).model

    return build


CONFIGS = {
    # model-architecture.md §5: 3 Gated DeltaNet layers + 1 full attention, 2 value heads per key head.
    "tiny": dict(
        vocab_size=8192,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=32,
        linear_value_head_dim=32,
        linear_conv_kernel_dim=4,
        num_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=128,
        shared_expert_intermediate_size=128,
        full_attention_interval=4,
        max_position_embeddings=4096,
        rope_parameters={"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.25},
        norm_topk_prob=True,
        tie_word_embeddings=False,
    ),
    # An odd layer count starting with attention and ending with Gated DeltaNet; 3 value heads per key
    # head with Dk != Dv; half-rotary; QKV/O bias; a dense MLP layer; no top-k renormalisation.
    "odd": dict(
        vocab_size=2048,
        hidden_size=128,
        intermediate_size=96,
        num_hidden_layers=5,
        layer_types=[
            "full_attention",
            "linear_attention",
            "linear_attention",
            "full_attention",
            "linear_attention",
        ],
        mlp_only_layers=[2],
        num_attention_heads=4,
        num_key_value_heads=1,
        head_dim=32,
        attention_bias=True,
        linear_num_key_heads=2,
        linear_num_value_heads=6,
        linear_key_head_dim=32,
        linear_value_head_dim=16,
        linear_conv_kernel_dim=4,
        num_experts=6,
        num_experts_per_tok=3,
        moe_intermediate_size=64,
        shared_expert_intermediate_size=48,
        max_position_embeddings=4096,
        rope_parameters={"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.5},
        norm_topk_prob=False,
        tie_word_embeddings=False,
    ),
}


def perturb(reference: torch.nn.Module, seed: int = 0) -> None:
    """Random init leaves norms at identity, biases at zero, decays at one scale and the conv near zero;
    make all of them count so a swapped or dropped term changes the logits."""
    generator = torch.Generator().manual_seed(seed)

    def noise(param: torch.Tensor, scale: float) -> torch.Tensor:
        return torch.randn(param.shape, generator=generator) * scale

    with torch.no_grad():
        for name, param in reference.named_parameters():
            if "norm" in name or (name.endswith("bias") and not name.endswith("dt_bias")):
                param.add_(noise(param, 0.2))
            elif name.endswith("A_log"):
                # A log-uniform over [0.003, 1]: per-token decays from ~0.998 to ~0.5, so part of the
                # state outlives a 64-token chunk and a wrong carry between chunks shows.
                param.copy_(torch.empty(param.shape).uniform_(-5.8, 0.0, generator=generator))
            elif name.endswith("dt_bias"):
                param.copy_(noise(param, 0.5))
            elif name.endswith("conv1d.weight"):
                param.copy_(noise(param, 0.4))


@pytest.fixture(scope="session")
def qwen3_next_checkpoint(tmp_path_factory) -> Callable[[str], tuple[Path, torch.nn.Module]]:
    """`qwen3_next_checkpoint(name)`: (directory, transformers reference) for a CONFIGS entry, made once
    per session: random weights, perturbed so every term matters, saved with `save_pretrained`."""
    made: dict[str, tuple[Path, torch.nn.Module]] = {}

    def make(name: str) -> tuple[Path, torch.nn.Module]:
        if name not in made:
            torch.manual_seed(0)
            reference = transformers.Qwen3NextForCausalLM(
                transformers.Qwen3NextConfig(**CONFIGS[name])
            ).eval()
            reference.generation_config.eos_token_id = None  # random models: generate every token asked for
            perturb(reference)
            directory = tmp_path_factory.mktemp(f"qwen3_next_{name}")
            reference.save_pretrained(directory)
            made[name] = (directory, reference)
        return made[name]

    return make


# -- Qwen3.8-Flash-Next (qwen4_exp) ------------------------------------------------------------------

QWEN4_EXP_EOS = 5
# model-architecture.md §5's tiny config (transformers' Qwen4ExpTextConfig arguments): QSA budget 16, below
# most prompts, so block selection happens; PLE at layer index 1.
QWEN4_EXP_TINY = dict(
    vocab_size=4096,
    hidden_size=256,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=64,
    linear_num_key_heads=2,
    linear_num_value_heads=6,
    linear_key_head_dim=32,
    linear_value_head_dim=32,
    num_experts=8,
    num_experts_per_tok=2,
    moe_intermediate_size=128,
    shared_expert_intermediate_size=128,
    max_position_embeddings=4096,
    rope_parameters={"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.25},
    hc_count=4,
    hc_lowrank=32,
    ple_layer_ids=[2],
    heads_per_ngram=2,
    ngram_vocab_size_base=1000,
    make_ngram_vocab_size_divisible_by=8,
    split_ngram_parts=4,
    indexer_n_heads=2,
    indexer_kv_heads=1,
    indexer_head_dim=64,
    indexer_budget=16,
    indexer_compress_ratio=4,
    output_gate_type="sigmoid",
    eos_token_id=QWEN4_EXP_EOS,
)
# The tiny config as a config.json for seeded dummy weights, the n-gram table drawn as FP8 with a scale
# (as in the release).
QWEN4_EXP_TINY_CONFIG = {
    "model_type": "qwen4_exp_text",
    **QWEN4_EXP_TINY,
    "ple_embedding_dtype": "float8_e4m3fn",
}


@pytest.fixture(scope="module")
def qwen4_exp_tiny(tmp_path_factory) -> LoadedModel:
    """Seeded dummy weights of `QWEN4_EXP_TINY_CONFIG` on the CPU, loaded once per test module."""
    directory = tmp_path_factory.mktemp("qwen4_exp_tiny_config")
    (directory / "config.json").write_text(json.dumps(QWEN4_EXP_TINY_CONFIG))
    return load_model(str(directory), torch.float32, torch.device("cpu"), "dummy")


def qwen4_exp_prompts(count: int, seed: int, lengths: tuple[int, int]) -> list[list[int]]:
    """Random prompts of the tiny config's vocabulary with an EOS here and there (PLE's n-gram context
    stops at one)."""
    rng = random.Random(seed)
    vocab = QWEN4_EXP_TINY["vocab_size"]
    return [
        [QWEN4_EXP_EOS if rng.random() < 0.05 else rng.randrange(vocab) for _ in range(rng.randint(*lengths))]
        for _ in range(count)
    ]


@torch.inference_mode()
def one_shot_logits(model: torch.nn.Module, tokens: list[int], page_size: int) -> torch.Tensor:
    """One sequence, one forward, through the engine's backend (`PagedAttentionBackend`) on the CPU."""
    spec = model.cache_spec(page_size, torch.float32)
    pages = -(-len(tokens) // page_size)
    slots = StateSlots(spec, 1)
    slots.alloc()
    batch = build_forward_batch(
        [(tokens, list(range(pages)), 0, len(tokens))], [0], page_size, torch.device("cpu")
    )
    hidden = model(
        batch.input_ids, batch.positions, PagedAttentionBackend(PagePool(spec, pages), batch, slots)
    )
    return model.compute_logits(hidden)


class PagedRunner:
    """Sequences run through `PagedAttentionBackend` over a private pool (sequence n owns pages
    n * pages_per_sequence ...) with a working state slot each and `drafts` more for verify forwards.
    `run({seq: new tokens})` is one forward over the named sequences, concatenated in that order, and
    returns each one's logits; with `verify`, every sequence has the same number n of new tokens and the
    state after its token t is kept in its slot t (0: the working slot, then its draft slots)."""

    def __init__(
        self,
        model: torch.nn.Module,
        num_sequences: int = 1,
        page_size: int = 8,
        drafts: int = 0,
        pages_per_sequence: int = 32,
    ) -> None:
        spec = model.cache_spec(page_size, torch.float32)
        self.model, self.page_size = model, page_size
        self.pool = PagePool(spec, num_sequences * pages_per_sequence)
        self.slots = StateSlots(spec, num_sequences * (1 + drafts))
        self.working = [self.slots.alloc() for _ in range(num_sequences)]
        self.draft = [[self.slots.alloc() for _ in range(drafts)] for _ in range(num_sequences)]
        self.pages = [
            list(range(n * pages_per_sequence, (n + 1) * pages_per_sequence)) for n in range(num_sequences)
        ]
        self.tokens: list[list[int]] = [[] for _ in range(num_sequences)]

    @torch.inference_mode()
    def run(self, new_tokens: dict[int, Sequence[int]], verify: bool = False) -> dict[int, torch.Tensor]:
        chunks = []
        for seq, tokens in new_tokens.items():
            start = len(self.tokens[seq])
            self.tokens[seq].extend(tokens)
            chunks.append((self.tokens[seq], self.pages[seq], start, len(tokens)))
        working = [self.working[seq] for seq in new_tokens]
        batch = build_forward_batch(chunks, working, self.page_size, torch.device("cpu"))
        verify_slots = None
        if verify:
            width = len(next(iter(new_tokens.values())))
            columns = [[self.working[seq], *self.draft[seq][: width - 1]] for seq in new_tokens]
            verify_slots = torch.tensor(columns, dtype=torch.int32)
        backend = PagedAttentionBackend(self.pool, batch, self.slots, verify_slots=verify_slots)
        logits = self.model.compute_logits(self.model(batch.input_ids, batch.positions, backend))
        return {seq: logits[s : s + n] for seq, (s, n) in zip(new_tokens, batch.query_ranges, strict=True)}

    def prefill(self, tokens: Sequence[int], chunk: int | None = None) -> torch.Tensor:
        """Sequence 0's logits for every token, fed `chunk` tokens per forward (all at once if None)."""
        chunk = chunk or len(tokens)
        return torch.cat([self.run({0: tokens[i : i + chunk]})[0] for i in range(0, len(tokens), chunk)])


def check_llm_greedy_against_transformers(
    llm_outputs: Sequence, reference: torch.nn.Module, prompts: Sequence[list[int]], greedy_checker
) -> None:
    """Each `morion.LLM` output equals transformers' greedy continuation of its prompt (as many tokens),
    or diverges only at a near-tie (1e-3) of transformers' own logits."""
    for prompt, output in zip(prompts, llm_outputs, strict=True):
        with torch.no_grad():
            expected = reference.generate(
                torch.tensor([prompt]),
                attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                max_new_tokens=len(output.token_ids),
                do_sample=False,
                output_logits=True,
                return_dict_in_generate=True,
                pad_token_id=0,
            )
        greedy_checker(
            output.token_ids,
            expected.sequences[0, len(prompt) :].tolist(),
            lambda step, e=expected: e.logits[step][0],
            1e-3,
        )


def check_decode_against_transformers_cache(
    runner: PagedRunner,
    reference: torch.nn.Module,
    prompt: list[int],
    continuation: list[int],
    tolerance: float,
) -> None:
    """Prefill `prompt`, then feed `continuation` token by token, through our paged `runner` and through
    transformers with its cache: every step's logits within `tolerance` (max abs)."""
    with torch.no_grad():
        out = reference(torch.tensor([prompt]), use_cache=True)
        assert (runner.prefill(prompt) - out.logits[0]).abs().max().item() < tolerance
        cache = out.cache
        for token in continuation:
            out = reference(torch.tensor([[token]]), cache=cache, use_cache=True)
            cache = out.cache
            assert (runner.run({0: [token]})[0] - out.logits[0]).abs().max().item() < tolerance
