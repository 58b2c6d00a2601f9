"""Token sampling: greedy, temperature, top-k, top-p, suppression and raw logprobs.

One call handles a whole batch. The filtering (temperature, top-k, top-p) is
vectorised across rows with a single sort; only the random draws loop per row,
because each seeded request owns a `torch.Generator` whose state must advance
independently of whatever else shares the batch. That makes a seeded request
reproducible regardless of batch composition or its row index.

Sampling uses the exponential race: with q ~ Exp(1) i.i.d. per token,
argmax(p / q) is distributed as Categorical(p). It needs one vector of random
numbers per row and no cumulative-sum search, and masked tokens (p == 0) can
never win.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass

import torch

from shared.engine.request import SamplingParams, TokenLogprobs
from shared.ops.argmax_cpu import argmax_rows
from shared.ops.host_copy import to_device
from shared.ops.race_noise import exponential_

__all__ = ["Sampler", "SamplerOutput", "make_generator", "processed_probs", "raw_logprobs", "suppress"]


@dataclass
class SamplerOutput:
    """Result of one sampling step for a batch."""

    token_ids: torch.Tensor  # [num_seqs] int64, on the logits' device
    logprobs: list[TokenLogprobs | None]  # per seq; None where params.logprobs is None


def make_generator(seed: int | None, device: torch.device | str) -> torch.Generator | None:
    """A generator seeded with `seed` on `device` for a seeded request; None for an unseeded one.

    The caller keeps it for the request's lifetime and passes it on every step, so the
    request's random stream continues across steps.
    """
    if seed is None:
        return None
    generator = torch.Generator(device=device)
    generator.manual_seed(seed)
    return generator


class Sampler:
    """Picks the next token for each row of a logits batch.

    Rows whose generator is None draw from the sampler's own per-device default
    generator, seeded from `seed` (or from OS entropy when `seed` is None).
    """

    def __init__(self, seed: int | None = None) -> None:
        self._seed = seed
        self._default_generators: dict[torch.device, torch.Generator] = {}

    def __call__(
        self,
        logits: torch.Tensor,  # [num_seqs, vocab] float32
        params: Sequence[SamplingParams],
        generators: Sequence[torch.Generator | None],
        suppress_token_ids: Sequence[Collection[int]] | None = None,
        suppress_active: torch.Tensor | None = None,
        raw_logits: torch.Tensor | None = None,
    ) -> SamplerOutput:
        """Sample one token per row.

        Args:
            logits: model logits, one row per sequence, after the logits pipeline (shared/engine/logits/).
            params: sampling parameters, one per row.
            generators: per-row generator (see `make_generator`); None uses the default generator.
            suppress_token_ids: per row, token ids forced to -inf before greedy/sampled selection
                (e.g. eos/stop ids while min_tokens is not yet reached). Logprobs are unaffected.
                At least one token per row must stay unsuppressed.
            suppress_active: [num_seqs] bool on the device, the rows suppress_token_ids applies to
                (None = all).
            raw_logits: the model's logits before the pipeline, which logprobs report (None: `logits`).
        """
        num_seqs = logits.shape[0]
        if logits.dim() != 2 or len(params) != num_seqs or len(generators) != num_seqs:
            raise ValueError(
                f"expected 2-D logits with one params/generator per row; got logits {tuple(logits.shape)}, "
                f"{len(params)} params, {len(generators)} generators"
            )
        if suppress_token_ids is not None and len(suppress_token_ids) != num_seqs:
            raise ValueError(f"expected {num_seqs} suppress_token_ids entries, got {len(suppress_token_ids)}")
        logits = logits.float()  # no-op for fp32
        raw = logits if raw_logits is None else raw_logits.float()  # logprobs report these, unmodified

        masked = suppress(logits, suppress_token_ids, suppress_active)
        # argmax's first-max tie rule gives the lowest id; with nothing suppressed this is torch.argmax(logits)
        token_ids = argmax_rows(masked)

        sampled_rows = [i for i, p in enumerate(params) if not p.is_greedy]
        if sampled_rows:
            sampled = self._sample(
                masked,
                sampled_rows,
                [params[i] for i in sampled_rows],
                [generators[i] for i in sampled_rows],
            )
            token_ids[to_device(sampled_rows, device=logits.device)] = sampled

        return SamplerOutput(token_ids=token_ids, logprobs=raw_logprobs(raw, token_ids, params))

    def default_generator(self, device: torch.device) -> torch.Generator:
        """The stream unseeded rows draw from on `device` (speculative verification shares it)."""
        generator = self._default_generators.get(device)
        if generator is None:
            generator = torch.Generator(device=device)
            if self._seed is None:
                generator.seed()
            else:
                generator.manual_seed(self._seed)
            self._default_generators[device] = generator
        return generator

    def _sample(
        self,
        logits: torch.Tensor,  # [num_seqs, vocab], suppressed ids already -inf
        rows: list[int],
        params: list[SamplingParams],
        generators: list[torch.Generator | None],
    ) -> torch.Tensor:  # [len(rows)] int64
        """Temperature, top-k, top-p, then one exponential-race draw per row."""
        device = logits.device
        row_index = to_device(rows, device=device)
        probs = processed_probs(logits.index_select(0, row_index), params)  # [n, vocab]

        exp_noise = torch.empty_like(probs)  # [n, vocab]
        default_rows = [j for j, g in enumerate(generators) if g is None]
        if default_rows:
            # one draw for all unseeded rows: they share a stream, so their order does not matter
            noise = exponential_(torch.empty((len(default_rows), probs.shape[1]), dtype=probs.dtype,
                                             device=device), self.default_generator(device))
            exp_noise[to_device(default_rows, device=device)] = noise
        for j, generator in enumerate(generators):
            if generator is not None:
                # each seeded row consumes exactly vocab draws from its own stream per step
                exponential_(exp_noise[j], generator)
        return argmax_rows(probs / exp_noise)


def processed_probs(
    logits: torch.Tensor,  # [n, vocab], suppressed ids already -inf
    params: Sequence[SamplingParams],  # one per row, none greedy
) -> torch.Tensor:  # [n, vocab] float32
    """The distribution plain sampling draws from: temperature, min-p, top-k, top-p, softmax."""
    temperature = to_device([p.temperature for p in params], dtype=torch.float32, device=logits.device)
    scaled = logits / temperature.unsqueeze(1)  # [n, vocab]
    if any(p.min_p > 0.0 for p in params):
        scaled = _apply_min_p(scaled, params)
    if any(p.top_k > 0 or p.top_p < 1.0 for p in params):
        scaled = _apply_top_k_top_p(scaled, list(params))
    return torch.softmax(scaled, dim=-1)


def _apply_min_p(
    logits: torch.Tensor,  # [n, vocab] temperature-scaled
    params: Sequence[SamplingParams],
) -> torch.Tensor:  # [n, vocab] with tokens below min_p * p_max at -inf
    """Drop tokens less likely than min_p times the most likely one (vLLM applies it after temperature).

    In log space: log p_i < log min_p + log p_max  <=>  logit_i < logit_max + log(min_p).
    """
    min_p = to_device([p.min_p for p in params], dtype=torch.float32, device=logits.device)  # [n]
    threshold = logits.max(dim=-1, keepdim=True).values + torch.log(min_p).unsqueeze(1)  # -inf where min_p = 0
    return logits.masked_fill(logits < threshold, float("-inf"))


def suppress(
    logits: torch.Tensor,  # [num_seqs, vocab]
    suppress_token_ids: Sequence[Collection[int]] | None,
    active: torch.Tensor | None = None,  # [num_seqs] bool on the device: rows whose ids are suppressed
) -> torch.Tensor:  # [num_seqs, vocab]
    """A copy of `logits` with the suppressed ids at -inf, or `logits` itself when nothing is suppressed.

    `active` decides on the device which rows' ids apply (the zero-bubble loop learns how many tokens
    a request has emitted, and so whether it is still below min_tokens, only there); None = all rows.
    """
    if suppress_token_ids is None:
        return logits
    vocab = logits.shape[1]
    rows: list[int] = []
    cols: list[int] = []
    for row, ids in enumerate(suppress_token_ids):
        for token_id in ids:
            # ids past the model's vocab can never be produced, so there is nothing to mask
            if 0 <= token_id < vocab:
                rows.append(row)
                cols.append(token_id)
    if not rows:
        return logits
    masked = logits.clone()
    index = to_device([rows, cols], dtype=torch.long, device=logits.device)
    if active is None:
        masked[index[0], index[1]] = float("-inf")
    else:
        masked[index[0], index[1]] = torch.where(active[index[0]], float("-inf"), logits[index[0], index[1]])
    return masked


def _apply_top_k_top_p(
    logits: torch.Tensor,  # [n, vocab] temperature-scaled
    params: list[SamplingParams],
) -> torch.Tensor:  # [n, vocab] with filtered-out tokens at -inf
    """Mask everything outside each row's top-k, then outside its top-p nucleus, with one sort."""
    n, vocab = logits.shape
    device = logits.device
    sorted_logits, sorted_ids = logits.sort(dim=-1, descending=True)  # [n, vocab] each

    k = to_device([p.top_k if 0 < p.top_k < vocab else vocab for p in params], device=device)
    # a threshold (not a position cut) keeps tokens tied with the k-th, independent of sort stability
    kth_value = sorted_logits.gather(1, (k - 1).unsqueeze(1))  # [n, 1]
    sorted_logits = sorted_logits.masked_fill(sorted_logits < kth_value, float("-inf"))

    # top_p == 1 must keep every token: fp32 cumsum can reach 1.0 before the tail, so disable it outright
    top_p = to_device(
        [p.top_p if p.top_p < 1.0 else float("inf") for p in params], dtype=torch.float32, device=device
    )
    sorted_probs = torch.softmax(sorted_logits, dim=-1)  # [n, vocab]
    mass_before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs  # probability of strictly better tokens
    # keep a token while the better ones have not reached top_p yet; the top token has mass 0 before it
    drop = mass_before >= top_p.unsqueeze(1)
    drop[:, 0] = False
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))

    return torch.empty_like(logits).scatter_(1, sorted_ids, sorted_logits)


def raw_logprobs(
    logits: torch.Tensor,  # [num_seqs, vocab] raw, unmodified
    token_ids: torch.Tensor,  # [num_seqs] chosen tokens
    params: Sequence[SamplingParams],
) -> list[TokenLogprobs | None]:
    """Logprobs of the chosen tokens and top-n alternatives, from the raw (pre-sampling) distribution."""
    result: list[TokenLogprobs | None] = [None] * len(params)
    rows = [i for i, p in enumerate(params) if p.logprobs is not None]
    if not rows:
        return result
    row_index = to_device(rows, device=logits.device)
    logprobs = torch.log_softmax(logits.index_select(0, row_index), dim=-1)  # [n, vocab]
    chosen_ids = token_ids.index_select(0, row_index)  # [n]
    chosen = logprobs.gather(1, chosen_ids.unsqueeze(1)).squeeze(1)  # [n]

    max_n = min(max(params[i].logprobs or 0 for i in rows), logprobs.shape[1])
    top_values, top_ids = logprobs.topk(max_n, dim=-1, sorted=True)  # [n, max_n] each

    # one device-to-host transfer per tensor rather than per element
    chosen_ids_host = chosen_ids.tolist()
    chosen_host = chosen.tolist()
    top_values_host = top_values.tolist()
    top_ids_host = top_ids.tolist()
    for j, row in enumerate(rows):
        want = params[row].logprobs or 0
        top = list(zip(top_ids_host[j][:want], top_values_host[j][:want], strict=True))
        result[row] = TokenLogprobs(token_id=chosen_ids_host[j], logprob=chosen_host[j], top=top)
    return result


def skip_draws(generator: torch.Generator, vocab_size: int, num_steps: int, device: torch.device) -> None:
    """Advance a seeded generator by the draws `num_steps` sampled steps take.

    Keeps a request's random stream identical when another engine sampled its
    first tokens (prefill in one process, decode in another).
    """
    noise = torch.empty(vocab_size, dtype=torch.float32, device=device)
    for _ in range(num_steps):
        exponential_(noise, generator)
