from __future__ import annotations

import math

import pytest
import torch

from morion.spec.rejection import Acceptance, greedy_accept, rejection_sample

VOCAB = 6
TRIALS = 12_000
Z_1E4 = 3.719  # standard normal quantile for a one-sided 1e-4 tail


def chi_square_critical(df: int, z: float = Z_1E4) -> float:
    """Wilson-Hilferty approximation of the chi-square quantile (good to ~1% for df >= 3)."""
    h = 2.0 / (9.0 * df)
    return df * (1.0 - h + z * math.sqrt(h)) ** 3


def chi_square(counts: torch.Tensor, probs: torch.Tensor) -> float:
    expected = counts.sum() * probs
    return float(((counts - expected) ** 2 / expected).sum())


def random_dists(rows: int, generator: torch.Generator, logits: torch.Tensor | None = None) -> torch.Tensor:
    noise = torch.randn(rows, VOCAB, generator=generator)
    return ((noise * 0.7 + logits) if logits is not None else noise).softmax(dim=-1)


def emitted_counts(p: torch.Tensor, q: torch.Tensor | None, fixed: torch.Tensor | None, seed: int):
    """Per position j, how often each token was emitted there (over trials that got that far)."""
    k = p.shape[0] - 1
    generator = torch.Generator().manual_seed(seed)
    draft_generator = torch.Generator().manual_seed(seed + 1)
    if q is not None:
        drafts = torch.multinomial(q, TRIALS, replacement=True, generator=draft_generator).T  # [TRIALS, k]
    else:
        drafts = fixed.expand(TRIALS, k)
    counts = torch.zeros(k + 1, VOCAB)
    for trial in range(TRIALS):
        result = rejection_sample(p, drafts[trial], q, generator)
        emitted = [*drafts[trial, : result.num_accepted].tolist(), result.next_token]
        counts[torch.arange(len(emitted)), torch.tensor(emitted)] += 1
    return counts


def assert_target_distribution(counts: torch.Tensor, p: torch.Tensor) -> None:
    critical = chi_square_critical(VOCAB - 1)
    checked = 0
    for j in range(p.shape[0]):
        if counts[j].sum() < 1000:  # too few trials got this far for the test to mean anything
            continue
        statistic = chi_square(counts[j], p[j])
        assert statistic < critical, f"position {j}: chi-square {statistic:.1f} >= {critical:.1f}"
        checked += 1
    assert checked >= 2


@pytest.mark.parametrize("k,seed", [(1, 0), (2, 1), (4, 2)])
def test_sampled_drafts_keep_the_target_distribution(k: int, seed: int) -> None:
    generator = torch.Generator().manual_seed(100 + seed)
    p = random_dists(k + 1, generator, torch.zeros(VOCAB))
    q = random_dists(k, generator, p[:k].log())  # a drafter that roughly agrees with the target
    counts = emitted_counts(p, q, None, seed)
    assert_target_distribution(counts, p)
    # The test has power: what the drafter proposes (q) would fail it.
    assert chi_square(counts[0].sum() * q[0], p[0]) > chi_square_critical(VOCAB - 1)


def test_deterministic_drafts_keep_the_target_distribution() -> None:
    generator = torch.Generator().manual_seed(7)
    p = random_dists(4, generator, torch.zeros(VOCAB))
    # A likely draft, an unlikely one (exercises the residual), then a likely one again.
    fixed = torch.stack([p[0].argmax(), p[1].argmin(), p[2].argmax()])
    assert_target_distribution(emitted_counts(p, None, fixed, seed=3), p)


def test_a_draft_distribution_equal_to_the_target_is_always_accepted() -> None:
    generator = torch.Generator().manual_seed(8)
    p = random_dists(4, generator, torch.zeros(VOCAB))
    for _ in range(200):
        drafts = torch.multinomial(p[:3], 1, generator=generator).squeeze(1)
        assert rejection_sample(p, drafts, p[:3].clone(), generator).num_accepted == 3


def test_one_hot_target_probabilities_reduce_to_greedy() -> None:
    """Greedy is sampling from a one-hot target: both rules must agree draft for draft."""
    generator = torch.Generator().manual_seed(9)
    for _ in range(200):
        logits = torch.randn(4, VOCAB, generator=generator)
        argmax = logits.argmax(dim=-1)
        drafts = torch.where(torch.rand(3, generator=generator) < 0.7, argmax[:3], (argmax[:3] + 1) % VOCAB)
        one_hot = torch.nn.functional.one_hot(argmax, VOCAB).float()
        assert rejection_sample(one_hot, drafts, None, generator) == greedy_accept(
            argmax.tolist(), drafts.tolist()
        )


def test_greedy_accept_exact_cases() -> None:
    target = [5, 6, 7, 8]
    assert greedy_accept(target, [5, 6, 7]) == Acceptance(3, 8)  # all, then the bonus
    assert greedy_accept(target, [5, 9, 7]) == Acceptance(1, 6)  # corrected at position 1
    assert greedy_accept(target, [0, 6, 7]) == Acceptance(0, 5)
    assert greedy_accept(target[:1], []) == Acceptance(0, 5)  # no drafts
    assert greedy_accept(target, [5, 6, 0]) == (2, 7)  # a plain tuple too


def test_shapes_are_checked() -> None:
    generator = torch.Generator()
    with pytest.raises(ValueError, match="one more row than drafts"):
        greedy_accept([1, 2], [1, 2])
    p = torch.full((3, VOCAB), 1.0 / VOCAB)
    with pytest.raises(ValueError, match="one more row than drafts"):
        rejection_sample(p, torch.tensor([1]), None, generator)
    with pytest.raises(ValueError, match="draft_probs shape"):
        rejection_sample(p, torch.tensor([1, 2]), p, generator)
