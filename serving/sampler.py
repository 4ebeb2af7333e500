"""The sampler: what a request's sampling parameters ask of the target's logits and of its output (vLLM's
sampler and rejection sampler, SGLang's sampler with its logits processors and a Req's finish checks).

    logits rows of a request ──► penalties, min_tokens, grammar mask (each node after its own path)
                             ──► verify its tree (greedy / seeded / speculative sampling) or draw its first token
                             ──► logprobs when asked
    accepted tokens ──► append: stop at EOS / stop ids / max_new_tokens / the context limit; the grammar advances

Everything up to the accepted path runs on the target's device and reads nothing back (verify.py's device
forms); the grammar's bitmask is built by xgrammar on the host. What is computed for one request alone runs in
a `stage`: a fault there fails that request alone.
"""

from __future__ import annotations

import logging

import torch

from sglang_ext.grammar import apply_bitmask, tree_bitmask
from sglang_ext.models.penalty_graphs import PenaltyRow
from sglang_ext.penalties import ban_early_stops, penalize_tree
from sglang_ext.sampling import (
    TokenLogprob,
    draw,
    greedy_tokens,
    int64,
    logits_to_probs,
    seeded_token,
    splitmix64,
    token_logprobs,
)
from sglang_ext.tree import TokenTree, TreeShape, root_tree
from sglang_ext.verify import AcceptedPath, VerifyResult, coupled_path, greedy_path, path_logprobs, sampling_path

from .request import Request, RequestFault, stage

log = logging.getLogger(__name__)

_UNSEEDED = 0x5EED_C0DE  # (mixed into an unseeded request's generator seed: its coupling seed is not that seed)


class Sampler:
    """Per-request logits processing, verification and sampling, logprobs and stop rules. eos_ids: the target's
    end tokens; max_context: the longest sequence; depth: the deepest tree a step may verify (a request stops
    when the next one would not fit)."""

    def __init__(self, eos_ids: set[int], max_context: int, depth: int):
        self.eos_ids, self.max_context, self.depth = eos_ids, max_context, depth

    def stop_ids(self, r: Request) -> set[int]:
        """Tokens that end the request: EOS (unless ignore_eos) and its stop_token_ids."""
        return set(r.params.stop_token_ids) if r.params.ignore_eos else self.eos_ids | set(r.params.stop_token_ids)

    def context_dependent(self, r: Request) -> bool:
        """Whether the request's logits depend on each row's path (penalties, grammar, min_tokens)."""
        return r.params.penalized or r.matcher is not None or len(r.output_ids) < r.params.min_tokens

    def penalty_row(self, r: Request) -> PenaltyRow | None:
        """What a chained step's graph takes of the request's penalties and min_tokens (models/penalty_graphs.py:
        the host path's values, each node after its own path), or None where its logits are the raw ones. (A grammar
        is the host's: a request with one takes the ordinary step.)"""
        if not (r.params.penalized or len(r.output_ids) < r.params.min_tokens):
            return None
        return PenaltyRow(r.params, r.prompt_ids, r.output_ids, self.stop_ids(r))

    @staticmethod
    def coupling_seed(r: Request) -> int:
        """The seed of a sampled request's coupled verification (verify.coupled_path; a chained step's, in its graph):
        its own, else one made once from its generator's seed (hashed: no draw, so no read of a device generator
        and the stream its ordinary steps draw from as it was), so that it is reproducible where the generator is
        and requests differ. An unseeded request's ordinary steps keep speculative sampling (sampling_path): each
        position's token is an exact sample of the target's law given the past either way."""
        if r.params.seed is not None:
            return r.params.seed
        if r.coupling_seed is None:
            r.coupling_seed = splitmix64(r.generator.initial_seed() ^ _UNSEEDED)
        return r.coupling_seed

    def graph_sampling(self, reqs: list[Request]) -> list[tuple[float, int, float, int]] | None:
        """A chained graph's per-request sampling parameters (models/spec_graphs.py, decode_graphs.py:
        sampling.coupled_tokens): (temperature, top_k, top_p, the coupling seed as int64) per request, a greedy one's
        temperature 0; None where every request is greedy."""
        if all(r.params.greedy for r in reqs):
            return None
        return [
            (0.0, 0, 1.0, 0)
            if r.params.greedy
            else (r.params.temperature, r.params.top_k, r.params.top_p, int64(self.coupling_seed(r)))
            for r in reqs
        ]

    def plain_greedy(self, r: Request) -> bool:
        """Whether the request verifies greedily on the raw logits (verify.greedy_paths may take it)."""
        return r.params.greedy and not self.context_dependent(r)

    def constrained(self, r: Request, logits: torch.Tensor, tree: TokenTree) -> torch.Tensor:
        """The tree's rows under the request's penalties, min_tokens, then its grammar, each node after
        its own path. (Logprobs stay the raw ones: callers keep their rows.) Penalties and min_tokens are
        device ops; the grammar's bitmask is built by xgrammar on the host from the tree's tokens (a
        copy of its own, for requests with a grammar only)."""
        if r.params.penalized:
            with stage("penalty"):
                logits = penalize_tree(logits, r.params, r.prompt_ids, r.output_ids, tree)
        if len(r.output_ids) < r.params.min_tokens:
            with stage("mask"):
                logits = ban_early_stops(logits, tree, len(r.output_ids), r.params.min_tokens, self.stop_ids(r))
        if r.matcher is not None:  # after the penalties: a masked token stays impossible
            with stage("mask"):
                logits = apply_bitmask(logits, tree_bitmask(r.matcher, tree, logits.shape[-1]))
        return logits

    def verify(
        self, r: Request, tree: TokenTree, logits: torch.Tensor, shape: TreeShape | None
    ) -> AcceptedPath | VerifyResult:
        """The request's accepted path on its tree's rows of the logits, on their device, no host read; shape: the
        shape the step's trees were proposed under (None: not drafted). (A subclass may verify on the host and
        return a VerifyResult; the step's copy passes it through.)"""
        if self.context_dependent(r):
            logits = self.constrained(r, logits, tree)
        with stage("verify"):
            if r.params.greedy:
                return greedy_path(tree, greedy_tokens(logits))
            probs = logits_to_probs(logits, r.params)
            if r.params.seed is not None:  # reproducible: plain seeded decoding's tokens, whatever was drafted
                return coupled_path(tree, probs, r.params.seed, len(r.slots))  # the root's position
            # a tree proposed under a shape gives a node at most shape.topk children (the sampled rounds)
            return sampling_path(tree, probs, r.generator, shape.topk if shape is not None else None)

    def sample(self, logits: torch.Tensor, r: Request) -> AcceptedPath:
        """The first output token from the prompt's last row [V], on its device (no host read)."""
        if self.context_dependent(r):  # the first token: a root-only tree, no path
            logits = self.constrained(r, logits[None], root_tree(0, 0, logits.device))[0]
        with stage("sample"):
            if r.params.greedy:
                tok = greedy_tokens(logits)
            elif r.params.seed is not None:
                tok = seeded_token(logits_to_probs(logits, r.params), r.params.seed, len(r.prompt_ids))
            else:
                tok = draw(logits_to_probs(logits, r.params), r.generator)  # torch.multinomial's draw
            tok = tok.reshape(1)
            return AcceptedPath(torch.zeros_like(tok), tok)

    def first_tokens(self, chunks: list[tuple[Request, int]], logits: torch.Tensor) -> list:
        """Per chunk, on the device: a prompt done now gets its first token (an AcceptedPath, as a root-only
        tree's; logits: one row per such prompt, in order), or the RequestFault of that; others None."""
        done = [r for r, end in chunks if end == len(r.prompt_ids)]
        together = self._greedy_firsts(done, logits)
        out, rows = [], iter(range(logits.shape[0]))
        for r, end in chunks:
            if end < len(r.prompt_ids):
                out.append(None)
                continue
            row = next(rows)
            if row in together:
                out.append(together[row])
                continue
            try:
                out.append(self.with_logprobs(r, self.sample(logits[row], r), logits[row][None]))
            except RequestFault as f:
                out.append(f)
        return out

    def _greedy_firsts(self, done: list[Request], logits: torch.Tensor) -> dict[int, AcceptedPath]:
        """The first tokens of the plain greedy requests among `done` (logits: one row each, in order) by row,
        from one argmax over the rows (a fixed number of device ops, not a few per request); only with this
        class's own `sample`, and for requests that asked for no logprobs (the others go one by one)."""
        if type(self).sample is not Sampler.sample:
            return {}
        rows = [i for i, r in enumerate(done) if self.plain_greedy(r) and r.params.logprobs is None]
        if not rows:
            return {}
        try:
            toks = greedy_tokens(logits).view(-1, 1)  # [D, 1] (every row's: one op, whoever needs it)
            nodes, toks = torch.zeros_like(toks).unbind(0), toks.unbind(0)
            return {i: AcceptedPath(nodes[i], toks[i]) for i in rows}
        except Exception:  # noqa: BLE001 - then each request alone, in its own stage: a fault fails its request only
            log.warning("batched first tokens failed; sampling request by request", exc_info=True)
            return {}

    @staticmethod
    def with_logprobs(r: Request, path, logits: torch.Tensor):
        """path (an AcceptedPath, on the device) with its tokens' logprobs when the request asked for them,
        computed on the device from the tree's raw logits [N, V] (they travel in the step's one copy), or
        the RequestFault of that; anything else as it is."""
        if r.params.logprobs is None or not isinstance(path, AcceptedPath):
            return path
        try:
            with stage("logprobs"):
                path_logprobs(path, logits, r.params.logprobs)
        except RequestFault as f:
            return f
        return path

    def logprobs(
        self, r: Request, logits: torch.Tensor, rows: list[int], new: list[int], copied: list | None = None
    ) -> list[TokenLogprob] | None:
        """The new tokens' logprobs when the request asked: those that came in the step's copy (`copied`),
        else from the logits (rows: the logits row of each, in order; a copy of their own: a verifier
        that returned host results)."""
        if r.params.logprobs is None:
            return None
        with stage("logprobs"):
            lps = (
                copied[: len(new)]
                if copied is not None
                else token_logprobs(logits[rows[: len(new)]], new, r.params.logprobs)
            )
        r.output_logprobs += lps
        return lps

    def append(self, r: Request, tokens: list[int]) -> list[int]:
        """Append tokens, stopping at EOS/stop ids or max_new_tokens; return what was appended."""
        p = r.params
        stops = self.stop_ids(r)
        out = []
        for tok in tokens:
            out.append(tok)
            if tok in stops:
                r.finish_reason = "stop"
                break
            if len(r.output_ids) + len(out) >= p.max_new_tokens:
                r.finish_reason = "length"
                break
        r.output_ids += out
        if r.matcher is not None:
            with stage("grammar"):
                left = not all(r.matcher.accept_token(tok) for tok in out)
            if left:  # cannot happen (the mask allowed only matching tokens): end this request alone
                raise RequestFault("grammar")
        if not r.finished and len(r.token_ids) + self.depth + 1 >= self.max_context:
            r.finish_reason = "length"
        return out
