"""The logits pipeline written out one token at a time (vLLM's formulas and order): the tests' oracle."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

import torch

from shared.engine.request import SamplingParams


def reference_row(logits: torch.Tensor, params: SamplingParams, prompt: Sequence[int],
                  output: Sequence[int]) -> torch.Tensor:  # [vocab] -> [vocab]
    """Bias, then repetition (prompt and output), then frequency and presence (output)."""
    x = logits.clone()
    for token_id, bias in params.logit_bias:
        if token_id < len(x):  # ids past the vocabulary are never produced
            x[token_id] += bias
    counts = Counter(output)
    p = params.repetition_penalty
    for t in set(prompt) | set(counts):
        x[t] = x[t] / p if x[t] > 0 else x[t] * p
    for t, c in counts.items():
        x[t] -= params.frequency_penalty * c + params.presence_penalty
    return x


@torch.no_grad()
def reference_greedy(hf_model: object, prompt: Sequence[int], params: SamplingParams, eos_id: int) -> list[int]:
    """Greedy decoding with transformers' forward over the whole sequence each step, through `reference_row`."""
    output: list[int] = []
    while len(output) < params.max_tokens:
        ids = torch.tensor([list(prompt) + output])
        logits = hf_model(ids).logits[0, -1].float()  # type: ignore[operator]
        token = int(reference_row(logits, params, prompt, output).argmax())
        output.append(token)
        if token == eos_id and not params.ignore_eos:
            break
    return output
