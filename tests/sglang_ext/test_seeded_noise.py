"""The seeded requests' noise (sampling.gumbel_noise: splitmix64 of (seed, position, token)) and the per-row sampling
that the chained verify's graph runs (sampling.probs_rows, coupled_tokens): the noise is a pure function of (seed,
position), the batched form's rows are the scalar form's, its uniforms are uniform and independent across tokens,
positions and seeds; each row's probabilities are logits_to_probs's under its own parameters, and each row's token
seeded_token's (a greedy row's the argmax)."""

import itertools

import numpy as np
import pytest
import torch
from scipy.stats import chisquare, kstest

from sglang_ext.sampling import (
    SamplingParams,
    _bits,
    _bits_torch,
    coupled_tokens,
    greedy_tokens,
    gumbel_noise,
    int64,
    logits_to_probs,
    position_gumbel,
    probs_rows,
    seeded_token,
    splitmix64,
)

MASK = (1 << 64) - 1


def _reference(seed: int, position: int, vocab: int) -> torch.Tensor:
    """The noise from Python integers: splitmix64's stream from splitmix64(splitmix64(seed) ^ position), its top 23
    bits m of output v + 1 for token v, u = (m + 1/2) / 2^23, -log(-log u)."""
    state = splitmix64(splitmix64(seed & MASK) ^ position)
    gamma = 0x9E3779B97F4A7C15
    m = [splitmix64((state + v * gamma) & MASK) >> 41 for v in range(vocab)]
    u = torch.tensor([(x + 0.5) / 2**23 for x in m], dtype=torch.float32)
    return -torch.log(-torch.log(u))


def _uniforms(noise: torch.Tensor) -> np.ndarray:
    """The uniforms u behind Gumbel noise (u = exp(-exp(-G)))."""
    return torch.exp(-torch.exp(-noise.double())).numpy().ravel()


def test_the_noise_is_splitmix64_of_seed_position_and_token():
    """Bit for bit the Python integers' splitmix64, for seeds of any size (their low 64 bits) and positions; the CPU's
    numpy form and torch's int64 form (any device's, a graph's) give the same bits."""
    for seed, position in [(0, 0), (3, 5), (MASK, 7), (-5, 100), (123456789123, 99999), (1 << 70, 1)]:
        assert torch.equal(position_gumbel(seed, position, 64), _reference(seed, position, 64)), (seed, position)
    assert torch.equal(position_gumbel(-5, 3, 32), position_gumbel(MASK - 4, 3, 32))  # (the same 64 bits)
    keys = torch.tensor([0, 1, -1, 1 << 62, -(1 << 63), 987654321987], dtype=torch.long)
    assert torch.equal(_bits(keys, 3000), _bits_torch(keys, 3000))
    assert int(_bits(keys, 3000).min()) >= 0 and int(_bits(keys, 3000).max()) < 1 << 23


def test_the_batched_noise_is_the_scalar_forms_rows():
    """gumbel_noise over rows of (seed, position) pairs: each row position_gumbel's; deterministic; rows of other
    seeds or positions differ."""
    pairs = [(s, p) for s, p in itertools.product([0, 7, 1 << 40, -3], [0, 1, 17, 4096])]
    seeds = torch.tensor([int64(s) for s, _ in pairs])
    positions = torch.tensor([p for _, p in pairs])
    noise = gumbel_noise(seeds, positions, 500)
    assert torch.equal(noise, gumbel_noise(seeds, positions, 500))
    for row, (s, p) in zip(noise, pairs):
        assert torch.equal(row, position_gumbel(s, p, 500))
    assert len({tuple(row.tolist()) for row in noise}) == len(pairs)


def test_the_noise_is_uniform_and_independent():
    """The uniforms of 400 (seed, position) rows of 1,000 tokens: uniform (KS), each token's column uniform across
    rows (chi-square of a token column's deciles), and uncorrelated between neighbouring positions, seeds and
    tokens."""
    seeds = torch.arange(20).repeat_interleave(20)
    positions = torch.arange(20).repeat(20) + 100
    u = _uniforms(gumbel_noise(seeds, positions, 1000)).reshape(20, 20, 1000)  # [seed, position, token]
    assert kstest(u.ravel(), "uniform").pvalue > 1e-3
    deciles = np.floor(u[:, :, 7].ravel() * 10).astype(int)
    assert chisquare(np.bincount(deciles, minlength=10)).pvalue > 1e-3
    for a, b in ((u[:, :-1], u[:, 1:]), (u[:-1], u[1:]), (u[..., :-1], u[..., 1:])):
        r = np.corrcoef(a.ravel(), b.ravel())[0, 1]
        assert abs(r) < 5 / np.sqrt(a.size), r


def test_each_rows_probabilities_are_logits_to_probs_under_its_parameters():
    """probs_rows: bit for bit logits_to_probs of each row (temperature alone unfiltered; top_k, top_p, both, and
    rows with neither beside them filtered)."""
    g = torch.Generator().manual_seed(0)
    temps, ks, ps = [0.3, 0.7, 1.0, 1.3], [0, 1, 5, 50, 999, 1000], [1.0, 0.9, 0.5, 0.95]
    for trial in range(30):
        logits = torch.randn(6, 1000, generator=g) * 3
        params = [
            SamplingParams(temperature=temps[(trial + i) % 4], top_k=ks[(trial + i) % 6], top_p=ps[(trial * i) % 4])
            for i in range(6)
        ]
        if trial % 2:
            params = [SamplingParams(temperature=p.temperature) for p in params]
        want = torch.stack([logits_to_probs(row, p) for row, p in zip(logits, params)])
        got = probs_rows(
            logits,
            torch.tensor([p.temperature for p in params], dtype=torch.float32),
            torch.tensor([p.top_k for p in params]),
            torch.tensor([p.top_p for p in params], dtype=torch.float32),
            filtered=not trial % 2,
        )
        assert torch.equal(got, want), trial


@pytest.mark.parametrize("filtered", [False, True])
def test_coupled_tokens_are_each_rows_seeded_token_or_argmax(filtered):
    """coupled_tokens over a batch of rows: a sampled row's token seeded_token's at its (seed, position), a greedy
    row's greedy_tokens'."""
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(12, 300, generator=g) * 2
    params = [
        SamplingParams(temperature=0.0)
        if i % 3 == 0
        else SamplingParams(
            temperature=0.5 + 0.1 * i, seed=1000 + i, **({"top_k": 20, "top_p": 0.8} if filtered else {})
        )
        for i in range(12)
    ]
    sampled = torch.tensor([not p.greedy for p in params])
    got = coupled_tokens(
        logits,
        sampled,
        torch.tensor([p.temperature for p in params], dtype=torch.float32),
        torch.tensor([p.top_k for p in params]),
        torch.tensor([p.top_p for p in params], dtype=torch.float32),
        torch.tensor([int64(p.seed or 0) for p in params]),
        torch.arange(12) + 40,
        filtered,
    )
    for i, (row, p) in enumerate(zip(logits, params)):
        want = greedy_tokens(row) if p.greedy else seeded_token(logits_to_probs(row, p), p.seed, 40 + i)
        assert int(got[i]) == int(want), i
    assert len(set(got[sampled].tolist())) > 1


@pytest.mark.gpu
def test_gpu_noise_is_the_cpus():
    """On CUDA (torch's int64 ops, as a captured graph runs them): the CPU's bits, its noise within a log's rounding,
    and the same coupled tokens."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    seeds, positions = torch.tensor([0, 5, -7, 1 << 50]), torch.tensor([3, 9, 1, 70000])
    keys = torch.tensor([0, 1, -1, 1 << 62, -(1 << 63)])
    assert torch.equal(_bits(keys.cuda(), 4096).cpu(), _bits(keys, 4096))
    cpu, gpu = gumbel_noise(seeds, positions, 4096), gumbel_noise(seeds.cuda(), positions.cuda(), 4096).cpu()
    assert torch.allclose(cpu, gpu, rtol=1e-6, atol=1e-6)
    logits = torch.randn(4, 4096, generator=torch.Generator().manual_seed(2)) * 2
    args = [torch.ones(4, dtype=torch.bool), torch.full((4,), 0.8), torch.zeros(4, dtype=torch.long), torch.ones(4)]
    want = coupled_tokens(logits, *args, seeds, positions, False)
    got = coupled_tokens(logits.cuda(), *(x.cuda() for x in args), seeds.cuda(), positions.cuda(), False)
    assert torch.equal(got.cpu(), want)
