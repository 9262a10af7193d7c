"""The sampler's race for unseeded rows (csrc/exponential_race.cpp): it draws from p (token
frequencies within a few standard errors, in the vectorized body and the scalar tail of a row),
never picks a token a filter removed, and a row's draw is its seed's alone."""

from __future__ import annotations

import pytest
import torch

from native_engine.kernels import fused_ops

pytestmark = pytest.mark.skipif(
    not fused_ops.races_here(torch.ones(1, 1)), reason="the CPU kernels did not build here"
)


def seeds(n: int, seed: int) -> torch.Tensor:
    return torch.randint(-(2**63), 2**63 - 1, (n,), generator=torch.Generator().manual_seed(seed))


def test_it_draws_from_p_across_a_rows_vectors_and_its_tail() -> None:
    vocab, rows = 49157, 40000  # 3072 vectors of 16 and a tail of 5
    where = [3, 16, 20000, 49151, 49155]  # first vector, second, middle, last vector, tail
    weights = torch.tensor([0.4, 0.25, 0.2, 0.1, 0.05])
    p = torch.full((vocab,), 1e-9)
    p[where] = weights
    p[7] = 0.0  # a removed token
    p /= p.sum()
    ids = fused_ops.exponential_race(p.expand(rows, vocab).contiguous(), seeds(rows, 0))
    freq = torch.bincount(ids, minlength=vocab).double() / rows
    for index, target in zip(where, p[where].double().tolist(), strict=True):
        error = (target * (1 - target) / rows) ** 0.5
        assert abs(freq[index].item() - target) < 5 * error, (index, freq[index].item(), target)
    assert freq[7] == 0


def test_a_rows_draw_depends_on_its_seed_alone() -> None:
    probs = torch.softmax(torch.randn(6, 1000, generator=torch.Generator().manual_seed(1)), -1)
    s = seeds(6, 2)
    together = fused_ops.exponential_race(probs, s)
    for row in range(6):
        alone = fused_ops.exponential_race(probs[row : row + 1], s[row : row + 1])
        assert alone.item() == together[row].item()
    reversed_rows = fused_ops.exponential_race(probs.flip(0).contiguous(), s.flip(0).contiguous())
    assert torch.equal(reversed_rows.flip(0), together)


def test_bad_arguments_are_refused_by_name() -> None:
    with pytest.raises(RuntimeError, match="probs must be"):
        fused_ops.exponential_race(torch.ones(2, 4, dtype=torch.float64), seeds(2, 0))
    with pytest.raises(RuntimeError, match="seeds must be"):
        fused_ops.exponential_race(torch.ones(2, 4), seeds(3, 0))


def test_no_token_wins_by_a_zero_noise() -> None:
    """A token of tiny probability must not win by its noise: u = 1 would make q = 0, and
    that token win whatever its probability (u now has 23 bits, so u < 1 by construction)."""
    vocab, rows = 49152, 40000
    p = torch.full((vocab,), 1e-10)
    p[0] = 1.0 - 1e-10 * (vocab - 1)
    ids = fused_ops.exponential_race(p.expand(rows, vocab).contiguous(), seeds(rows, 3))
    assert int((ids != 0).sum()) <= 5  # expected 0.2
