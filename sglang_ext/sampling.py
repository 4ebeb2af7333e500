"""Sampling parameters and the logits -> probabilities transform shared by draft and target.

The same transform (temperature, then top-k, then top-p) is applied to the target's logits and to
the drafter's logits, so verification compares like with like. Penalties and logit bias depend on
each row's context and apply to the target's logits only, before it (penalties.py).
"""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
import torch

from .device import to_device
from .errors import InvalidRequest  # noqa: F401 - re-exported: sampling.InvalidRequest is used across the tree

if TYPE_CHECKING:
    from .grammar import GrammarSpec


MAX_TOP_LOGPROBS = 20  # OpenAI's limit for top_logprobs
MAX_LOGIT_BIAS = 300  # tokens in one request's logit_bias (OpenAI's limit)
MAX_PREDICTION_TOKENS = 16384  # a predicted output's length (it is searched by lookup drafters every step)
MAX_REPETITION_PENALTY = 2.0  # SGLang's range is [0, 2]; 0 itself would divide by zero
# NOTE: a penalty near 0 divides a logit up to inf (NaN probabilities); from 0.01 on, logit / penalty /
# temperature stays finite in float32 for any temperature that samples (>= GREEDY_TEMPERATURE)
MIN_REPETITION_PENALTY = 0.01
GREEDY_TEMPERATURE = 1e-5  # temperatures below this decode greedily


def _is_number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def check_token_ids(ids, vocab: int, param: str) -> None:
    """Every id in [0, vocab): InvalidRequest naming `param` otherwise.
    NOTE: an id past the vocabulary would index past a logits row, and a negative one wrap around to another token."""
    bad = next((t for t in ids if not (isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab)), None)
    if bad is not None:
        raise InvalidRequest(f"{param}: token ids must be integers in [0, {vocab}), got {str(bad)[:24]}", param)


@dataclass(frozen=True)
class SamplingParams:
    max_new_tokens: int = 128
    temperature: float = 0.0  # 0 (or below GREEDY_TEMPERATURE) = greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = field(default=())
    ignore_eos: bool = False
    logprobs: int | None = (
        None  # None: off; k >= 0: each output token's log-probability and its k likeliest alternatives
    )
    prompt_logprobs: int | None = (
        None  # the same for the prompt's tokens (from the second on: the first has no context)
    )
    # applied to the target's logits before the transform below (sglang_ext/penalties.py)
    presence_penalty: float = 0.0  # subtracted once from the logit of every token the output already holds
    frequency_penalty: float = 0.0  # subtracted once per occurrence in the output
    repetition_penalty: float = 1.0  # a token in the prompt or output: logit / this if positive, * this if not
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, added to its logit)
    grammar: GrammarSpec | None = None  # structured output: tokens outside the grammar are masked (grammar.py)
    min_tokens: int = 0  # EOS and stop_token_ids are masked until the output holds this many tokens
    prediction: tuple[int, ...] = ()  # predicted output (OpenAI's Predicted Outputs): drafts only, never the output

    def __post_init__(self):
        if not isinstance(self.max_new_tokens, int) or self.max_new_tokens <= 0:
            raise InvalidRequest(
                f"max_new_tokens must be a positive integer, got {self.max_new_tokens!r}", "max_tokens"
            )
        if (
            not isinstance(self.temperature, (int, float))
            or not math.isfinite(self.temperature)
            or self.temperature < 0
        ):
            raise InvalidRequest(f"temperature must be a finite number >= 0, got {self.temperature!r}", "temperature")
        if not isinstance(self.top_p, (int, float)) or not 0 < self.top_p <= 1:
            raise InvalidRequest(f"top_p must be in (0, 1], got {self.top_p!r}", "top_p")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise InvalidRequest(f"top_k must be an integer >= 0, got {self.top_k!r}", "top_k")
        for name, k in (("top_logprobs", self.logprobs), ("prompt_logprobs", self.prompt_logprobs)):
            if k is not None and (not isinstance(k, int) or not 0 <= k <= MAX_TOP_LOGPROBS):
                raise InvalidRequest(f"{name} must be an integer in [0, {MAX_TOP_LOGPROBS}], got {k!r}", name)
        for name in ("presence_penalty", "frequency_penalty"):
            x = getattr(self, name)
            if not _is_number(x) or not -2 <= x <= 2:
                raise InvalidRequest(f"{name} must be a number in [-2, 2], got {x!r}", name)
        rp = self.repetition_penalty
        if not _is_number(rp) or not MIN_REPETITION_PENALTY <= rp <= MAX_REPETITION_PENALTY:
            bounds = f"[{MIN_REPETITION_PENALTY}, {MAX_REPETITION_PENALTY}]"
            raise InvalidRequest(f"repetition_penalty must be in {bounds}, got {rp!r}", "repetition_penalty")
        if len(self.logit_bias) > MAX_LOGIT_BIAS:
            raise InvalidRequest(
                f"logit_bias may hold at most {MAX_LOGIT_BIAS} tokens, got {len(self.logit_bias)}", "logit_bias"
            )
        if (
            not isinstance(self.min_tokens, int)
            or isinstance(self.min_tokens, bool)
            or not 0 <= self.min_tokens <= self.max_new_tokens
        ):
            raise InvalidRequest(
                f"min_tokens must be an integer from 0 to max_tokens ({self.max_new_tokens}), got {self.min_tokens!r}",
                "min_tokens",
            )
        if len(self.prediction) > MAX_PREDICTION_TOKENS:
            raise InvalidRequest(
                f"prediction may hold at most {MAX_PREDICTION_TOKENS} tokens, got {len(self.prediction)}", "prediction"
            )
        if self.grammar is not None and self.min_tokens:
            raise InvalidRequest(
                "min_tokens cannot be combined with a grammar (the grammar decides where the output ends)", "min_tokens"
            )
        if self.grammar is not None and self.ignore_eos:
            raise InvalidRequest(
                "ignore_eos cannot be combined with a grammar (the output ends where the grammar does)", "ignore_eos"
            )
        if not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in self.stop_token_ids):
            got = list(self.stop_token_ids)[:8]
            raise InvalidRequest(f"stop_token_ids must be token ids (integers >= 0), got {got!r}", "stop_token_ids")
        if len({tok for tok, _ in self.logit_bias}) < len(self.logit_bias):
            raise InvalidRequest("logit_bias names a token more than once", "logit_bias")
        for tok, bias in self.logit_bias:
            if not isinstance(tok, int) or isinstance(tok, bool) or tok < 0:
                raise InvalidRequest(f"logit_bias keys must be token ids (integers >= 0), got {tok!r}", "logit_bias")
            if not _is_number(bias) or not -100 <= bias <= 100:
                raise InvalidRequest(
                    f"logit_bias values must be numbers in [-100, 100], got {bias!r} for token {tok}", "logit_bias"
                )

    def check_vocab(self, vocab: int) -> None:
        """The token ids this request carries are in [0, vocab) and top_k is at most vocab (else InvalidRequest)."""
        check_token_ids(self.stop_token_ids, vocab, "stop_token_ids")
        check_token_ids([tok for tok, _ in self.logit_bias], vocab, "logit_bias")
        check_token_ids(self.prediction, vocab, "prediction")
        if self.top_k > vocab:
            raise InvalidRequest(
                f"top_k must be at most the vocabulary size {vocab} (0: off), got {self.top_k}", "top_k"
            )

    @property
    def penalized(self) -> bool:
        """True when the target's logits need the per-context step of sglang_ext/penalties.py."""
        return bool(
            self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0 or self.logit_bias
        )

    @property
    def greedy(self) -> bool:
        # NOTE: below GREEDY_TEMPERATURE, logits / temperature can overflow to inf (NaN probabilities);
        # such a temperature means the argmax anyway (vLLM's rule)
        return self.temperature < GREEDY_TEMPERATURE

    def generator(self, device: torch.device | str = "cpu") -> torch.Generator:
        """The request's random stream, on the device its draws are made on (torch draws on a device
        only from that device's generator)."""
        return device_generator(self.seed if self.seed is not None else torch.seed(), device)


def device_generator(seed: int, device: torch.device | str = "cpu") -> torch.Generator:
    """A generator seeded with `seed` on `device` (host work only: seeding reads nothing back)."""
    g = torch.Generator(device=device)
    g.manual_seed(seed)
    return g


def greedy_tokens(logits: torch.Tensor) -> torch.Tensor:
    """argmax over the last dim (first index on ties; a NaN counts as the largest, its first one). Upcasting is
    exact, and on CPU a bf16 argmax is ~5x slower than upcast + fp32 argmax (1.4 vs 0.26 ms for 8 x 49k logits, one
    core). On the CPU numpy's argmax (the same index) is ~10x faster than torch's: 11 vs 125 us for a verify's 3 x
    49k rows, one core."""
    x = logits.float()
    if x.device.type == "cpu" and not x.requires_grad:
        return torch.from_numpy(np.asarray(x.numpy().argmax(-1)))
    return x.argmax(-1)


def logits_to_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """[..., V] logits -> [..., V] float32 probabilities under temperature/top-k/top-p, on the logits'
    device without host reads there."""
    if params.greedy:
        return torch.nn.functional.one_hot(greedy_tokens(logits), logits.shape[-1]).float()
    x = logits.float() / params.temperature
    if params.top_k and params.top_k < x.shape[-1]:
        kth = torch.topk(x, params.top_k, dim=-1).values[..., -1:]
        x = x.masked_fill(x < kth, float("-inf"))
    probs = torch.softmax(x, dim=-1)
    if params.top_p < 1.0:
        sorted_p, idx = _top_mass(probs, params.top_p)
        # keep the smallest prefix whose mass reaches top_p (the first token always stays)
        drop = (sorted_p.cumsum(-1) - sorted_p) >= params.top_p
        sorted_p = sorted_p.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter_(-1, idx, sorted_p)
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


def _top_mass(probs: torch.Tensor, mass: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The largest probabilities, descending, with their ids: enough of them to reach `mass` in every
    row. A partial top-k first (a full sort of a 49k vocab costs ~5 ms per row on one CPU core,
    top-256 0.1 ms); the full sort only when the nucleus is wider than that. Off the CPU, the full sort
    at once: choosing would read the device (and a GPU sorts a vocab in microseconds)."""
    v = probs.shape[-1]
    for k in (256, 4096) if probs.device.type == "cpu" else ():
        if k >= v:
            break
        vals, idx = probs.topk(k, dim=-1)
        if bool((vals.sum(-1) >= mass).all()):
            return vals, idx
    return probs.sort(dim=-1, descending=True)


@dataclass(frozen=True)
class TokenLogprob:
    """An output token's log-probability under the target, and the `k` likeliest tokens at its position."""

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()  # (token id, logprob), likeliest first


def token_logprobs(logits: torch.Tensor, tokens: list[int], k: int) -> list[TokenLogprob]:
    """[n, V] logits at the positions that produced `tokens` (n of them) -> their logprobs.

    The target's raw distribution (log-softmax of its logits, before temperature/top-k/top-p), as
    vLLM and SGLang report by default: the same numbers whether a token came from a draft, a bonus
    or a plain decode step, since a logits row does not depend on the rest of the batch."""
    if not tokens:
        return []
    lp = torch.log_softmax(logits.float(), dim=-1)
    chosen = lp.gather(1, torch.tensor(tokens, device=lp.device).unsqueeze(1)).squeeze(1).tolist()
    if not k:
        return [TokenLogprob(t, c) for t, c in zip(tokens, chosen)]
    vals, ids = lp.topk(k, dim=-1)
    return [TokenLogprob(t, c, tuple(zip(i, v))) for t, c, i, v in zip(tokens, chosen, ids.tolist(), vals.tolist())]


def sample(probs: torch.Tensor, generator: torch.Generator | None) -> int:
    return int(torch.multinomial(probs, 1, generator=generator))


def draw(probs: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """[..., V] probabilities -> [...] int64, one sample per row, on the rows' device: torch.multinomial's
    own exponential race (argmax p / E, E ~ Exp(1)), so the same draws for the same generator state,
    without multinomial's checks of the probabilities (host reads of the device)."""
    race = torch.empty_like(probs).exponential_(generator=generator)
    return (probs / race).argmax(-1)


# --- seeded requests: sampling as a function of (seed, position) -------------------------------------
# A seeded request samples the token at sequence position t as argmax(log p + G), G Gumbel noise that is
# a pure function of (seed, t) (Gumbel-max: exactly a sample from p). The token then depends only on the
# seed, the position and the context: speculation (any drafter, tree, batch or adaptive choice, an ordinary
# step or a chained one inside a captured graph) reproduces plain decoding's output token for token, where
# rejection sampling would consume random numbers per draft and give another (equally distributed) text.
# The noise is a counter-based hash (splitmix64) of (seed, position, vocab index) in int64 tensor ops: the
# same values on any device (up to its log's rounding), batched over rows of (seed, position) pairs, with
# no generator state (a graph computes it from its inputs).

_MASK64 = (1 << 64) - 1
_GAMMA = 0x9E3779B97F4A7C15  # splitmix64's increment
_M1, _M2 = 0xBF58476D1CE4E5B9, 0x94D049BB133111EB


def splitmix64(x: int) -> int:
    """splitmix64 of a 64-bit int (its output after the state x)."""
    x = (x + _GAMMA) & _MASK64
    x = ((x ^ (x >> 30)) * _M1) & _MASK64
    x = ((x ^ (x >> 27)) * _M2) & _MASK64
    return x ^ (x >> 31)


def int64(x: int) -> int:
    """x's low 64 bits as a signed int64 (a seed of any size, as the hash takes it)."""
    x &= _MASK64
    return x - (1 << 64) if x >> 63 else x


def _lsr_(x: torch.Tensor, k: int) -> torch.Tensor:
    """x's int64 bits shifted right by k, logically (torch's >> is arithmetic)."""
    return (x >> k).bitwise_and_((1 << (64 - k)) - 1)


def _bits(keys: torch.Tensor, vocab: int) -> torch.Tensor:
    """[R, vocab] int64: the top 23 bits of splitmix64's outputs 1..vocab from each state keys[r] (int64 bits, wrapping
    arithmetic). On the CPU in numpy's uint64 (logical shifts, in place: ~2.5x faster), the same bits."""
    if keys.device.type != "cpu":
        return _bits_torch(keys, vocab)
    k = keys.numpy().view(np.uint64)
    g, m1, m2 = (np.uint64(m) for m in (_GAMMA, _M1, _M2))
    with np.errstate(over="ignore"):
        x = np.arange(1, vocab + 1, dtype=np.uint64) * g + k[:, None]
        x ^= x >> np.uint64(30)
        x *= m1
        x ^= x >> np.uint64(27)
        x *= m2
        x ^= x >> np.uint64(31)
        x >>= np.uint64(41)
    return torch.from_numpy(x.view(np.int64))


def _bits_torch(keys: torch.Tensor, vocab: int) -> torch.Tensor:
    """_bits in torch's int64 ops (any device; a graph captures them)."""
    x = torch.arange(1, vocab + 1, dtype=torch.long, device=keys.device).mul_(int64(_GAMMA)) + keys[:, None]
    x.bitwise_xor_(_lsr_(x, 30)).mul_(int64(_M1))
    x.bitwise_xor_(_lsr_(x, 27)).mul_(int64(_M2))
    x.bitwise_xor_(_lsr_(x, 31))
    return _lsr_(x, 41)


def _mix64(x: torch.Tensor) -> torch.Tensor:
    """splitmix64's output function on int64 tensors (wrapping arithmetic: splitmix64's bits, signed)."""
    x = (x ^ _lsr_(x, 30)) * int64(_M1)
    x = (x ^ _lsr_(x, 27)) * int64(_M2)
    return x ^ _lsr_(x, 31)


def gumbel_noise(seeds: torch.Tensor, positions: torch.Tensor, vocab: int) -> torch.Tensor:
    """[R, vocab] float32 Gumbel(0, 1) noise, row r the noise of the token at positions[r] of a request seeded with
    seeds[r] ([R] int64 each, on one device; a seed as `int64` gives it): splitmix64's stream from the state
    splitmix64(splitmix64(seed) ^ position), its (v + 1)-th output for token v, its top 23 bits m, u = (m + 1/2) / 2^23
    in (0, 1), then -log(-log(u)). Device ops of fixed shapes, no host read (a graph runs them)."""
    g = int64(_GAMMA)
    state = _mix64((_mix64(seeds.long() + g) ^ positions.long()) + g)
    u = _bits(state, vocab).float().add_(0.5).mul_(1.0 / (1 << 23))  # (exact in float32: 2m + 1 < 2^24)
    return u.log_().neg_().log_().neg_()


def position_gumbel(seed: int, position: int, vocab: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """[vocab] the noise of the token at `position` of a request seeded with `seed` (gumbel_noise's row), on
    `device`."""
    at = to_device(torch.tensor([[int64(seed), position]], dtype=torch.long), device)
    return gumbel_noise(at[:, 0], at[:, 1], vocab)[0]


def seeded_token(probs: torch.Tensor, seed: int, position: int) -> torch.Tensor:
    """The token at `position` drawn from probs [V] with the (seed, position) noise: a 0-d int64 on
    probs' device (no host read)."""
    return (probs.log() + position_gumbel(seed, position, probs.shape[-1], probs.device)).argmax()


def seeded_sample(probs: torch.Tensor, seed: int, position: int) -> int:
    """seeded_token, read back to the host."""
    return int(seeded_token(probs, seed, position))


# --- per-row parameters: a batch of requests each with its own, in one set of device ops ------------------------


def probs_rows(
    logits: torch.Tensor,  # [R, V]
    temperature: torch.Tensor,  # [R] float32, > 0 (a greedy row: any, its probabilities unused)
    top_k: torch.Tensor,  # [R] int64 (0: off)
    top_p: torch.Tensor,  # [R] float32 (1: off)
    filtered: bool,  # some row has top_k or top_p on (else they are not applied: no sort)
) -> torch.Tensor:
    """logits_to_probs of each row under its own parameters: the same values (the same float ops, row by row; where
    top_p cuts between tokens of equal probability, their order is the sort's), in device ops of fixed shapes, no
    host read (a graph runs them). With `filtered`, a sort of the vocab per row (top_k's k-th value, top_p's
    nucleus): on the CPU ~4 ms a row at a 49k vocab."""
    x = logits.float() / temperature[:, None]
    if not filtered:
        return torch.softmax(x, dim=-1)
    v = x.shape[-1]
    kth = x.sort(dim=-1, descending=True).values.gather(1, (top_k.clamp(1, v) - 1)[:, None])
    x = x.masked_fill(((top_k > 0) & (top_k < v))[:, None] & (x < kth), float("-inf"))
    probs = torch.softmax(x, dim=-1)
    sorted_p, idx = probs.sort(dim=-1, descending=True)
    cut = top_p < 1.0
    drop = (sorted_p.cumsum(-1) - sorted_p) >= top_p[:, None]  # (as logits_to_probs: the first token stays)
    nucleus = torch.zeros_like(probs).scatter_(-1, idx, sorted_p.masked_fill(drop, 0.0))
    return torch.where(cut[:, None], nucleus / nucleus.sum(-1, keepdim=True), probs)


def coupled_tokens(
    logits: torch.Tensor,  # [R, V] raw
    sampled: torch.Tensor,  # [R] bool: the row samples (else its token is the argmax)
    temperature: torch.Tensor,  # [R] float32 (a greedy row's: any)
    top_k: torch.Tensor,  # [R] int64
    top_p: torch.Tensor,  # [R] float32
    seeds: torch.Tensor,  # [S] int64 (int64(seed))
    positions: torch.Tensor,  # [S] int64: the position of the token picked
    filtered: bool,
    at: torch.Tensor | None = None,  # [R] int64: row r picks with the noise of (seeds[at[r]], positions[at[r]])
) -> torch.Tensor:
    """[R] int64: each sampled row's seeded token (seeded_token: argmax of log p + the (seed, position) noise, p the
    row's probabilities under its parameters), each other row's greedy_tokens; device ops of fixed shapes. Without
    `at`, row r's noise is (seeds[r], positions[r]) (S = R); with it, rows that share a (seed, position) (a tree's
    nodes of one depth) share one noise row, made once."""
    temp = torch.where(sampled, temperature, torch.ones_like(temperature))
    probs = probs_rows(logits, temp, top_k, top_p, filtered)
    noise = gumbel_noise(seeds, positions, logits.shape[-1])
    drawn = (probs.log() + (noise if at is None else noise[at])).argmax(-1)
    return torch.where(sampled, drawn, greedy_tokens(logits).to(drawn.device))


def sampling_rows(sampling: list | None, bb: int, vocab: int) -> tuple[bool | None, tuple]:
    """A chained graph's sampling inputs (coupled_tokens' per-row ones), from per request (temperature, top_k, top_p,
    seed as int64; a greedy request's temperature 0) or None: (the graph's kind: None where every request is greedy,
    else whether one filters (top_k, top_p: a sort per row); its per-request inputs, padded to bb: flags (1: sampled),
    top_k, seeds [bb] int64, temperatures, top_p [bb] float32 (a greedy or padding row: 0, 0, 0, 1, 1))."""
    if sampling is None or all(t <= 0 for t, *_ in sampling):
        return None, ()
    rows = [x if x[0] > 0 else (1.0, 0, 1.0, 0) for x in sampling] + [(1.0, 0, 1.0, 0)] * (bb - len(sampling))
    flags = [int(x[0] > 0) for x in sampling] + [0] * (bb - len(sampling))
    ints = torch.tensor([flags, [k for _, k, _, _ in rows], [s for *_, s in rows]], dtype=torch.long)
    floats = torch.tensor([[t for t, *_ in rows], [q for _, _, q, _ in rows]], dtype=torch.float32)
    filtered = any(0 < k < vocab or q < 1 for (t, k, q, _) in sampling if t > 0)
    return filtered, (*ints.unbind(0), *floats.unbind(0))


def sampling_buffers(inputs: tuple, device) -> tuple[torch.Tensor, ...]:
    """A graph's buffers for sampling_rows' inputs, every row greedy (flag, top_k, seed 0; temperature, top_p 1)."""
    pad = lambda x: (torch.zeros_like if x.dtype == torch.long else torch.ones_like)(x, device=device)  # noqa: E731
    return tuple(pad(x) for x in inputs)


def float_bits(x: torch.Tensor) -> torch.Tensor:
    """x (float32) as int64s holding its fp32 bits, on its device: floats beside ints in one int64 copy to the host."""
    return x.float().contiguous().view(torch.int32).long()


def bits_floats(ints: list[int]) -> tuple[float, ...]:
    """float_bits' values read on the host back to the floats (exact)."""
    return struct.unpack(f"{len(ints)}f", struct.pack(f"{len(ints)}i", *ints))
