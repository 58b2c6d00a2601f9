"""Logprobs of the prompt's own tokens (`prompt_logprobs`), from the hidden states a prefill chunk computed.

Row i of a chunk that starts at position s scores the token at s + i + 1; the logits of a
long prompt are vocabulary-wide, so they are made a slice of rows at a time. Raw logprobs,
as for generated tokens. Requests asking for them skip the prefix cache (every position
must be computed), as in vLLM.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from shared.engine.request import TokenLogprobs

__all__ = ["prompt_logprobs"]

_ROWS_PER_SLICE = 64  # [64, 262k] fp32 logits are 64 MiB


def prompt_logprobs(
    compute_logits: Callable[[torch.Tensor], torch.Tensor],
    hidden: torch.Tensor,  # [len(targets), hidden]: the rows that score the targets
    targets: Sequence[int],  # the prompt token each row predicts
    num_top: int,
) -> list[TokenLogprobs]:
    out: list[TokenLogprobs] = []
    for lo in range(0, len(targets), _ROWS_PER_SLICE):
        rows = hidden[lo : lo + _ROWS_PER_SLICE]
        logprobs = torch.log_softmax(compute_logits(rows).float(), dim=-1)  # [n, vocab]
        wanted = torch.tensor(targets[lo : lo + _ROWS_PER_SLICE], device=logprobs.device)
        chosen = logprobs.gather(1, wanted.unsqueeze(1)).squeeze(1).tolist()
        if num_top:
            values, ids = logprobs.topk(min(num_top, logprobs.shape[1]), dim=-1)
            tops = [list(zip(i, v, strict=True)) for i, v in zip(ids.tolist(), values.tolist(), strict=True)]
        else:
            tops = [[] for _ in chosen]
        out.extend(TokenLogprobs(t, lp, top) for t, lp, top in zip(wanted.tolist(), chosen, tops, strict=True))
    return out
