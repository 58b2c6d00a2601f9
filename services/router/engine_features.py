"""What the engines behind this router can do beyond plain sampling, by feature name.

The router refuses a request that needs a feature not listed here with a clear 400
(never accepting it and silently ignoring it). Each engine feature of issue 22 lands
on its own; when one does, its name joins `ENGINE_FEATURES` in the same change that
wires it through the router and tests it end to end.
"""

from __future__ import annotations

from shared.errors import InvalidRequestError

LOGITS_PROCESSING = "logits_processing"  # presence/frequency/repetition penalties, logit_bias, min_p
STRUCTURED_OUTPUTS = "structured_outputs"  # SamplingParams.structured on every path
MULTIPLE_CHOICES = "n"  # SamplingParams.n > 1: one prefill, one handoff, choices with their index
THINKING_BUDGET = "thinking_token_budget"  # ReasoningSpec.budget forces the end of thinking
PROMPT_LOGPROBS = "prompt_logprobs"  # SamplingParams.prompt_logprobs

ENGINE_FEATURES: frozenset[str] = frozenset({LOGITS_PROCESSING, STRUCTURED_OUTPUTS, THINKING_BUDGET, MULTIPLE_CHOICES,
                                             PROMPT_LOGPROBS})


def has(feature: str) -> bool:
    return feature in ENGINE_FEATURES


def require(feature: str, param: str, what: str | None = None) -> None:
    """Raise a 400 naming `param` unless the engines do `feature`."""
    if not has(feature):
        raise InvalidRequestError(f"{what or param} is not supported by this server yet", param=param)
