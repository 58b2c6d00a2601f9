"""The cost model the router scores candidates with; the planner reuses it with measured coefficients.

Every cost is an estimate in seconds of what a request waits for on one instance, so that prefix reuse,
queueing and KV handoff weigh against each other in one unit. The inputs are what the registry says
(load counts as of the last report, the prefix blocks each instance holds) plus the router's own
in-flight assignments since (`inflight`), which a burst raises before any report catches up.

```
 prefill instance p (disaggregated path), for a prompt of T tokens in blocks of B:
   hit_blocks(p)      = max(leading prompt blocks p's prefix cache holds,
                            leading prompt blocks the kv_transfer pool holds)   (prefill imports the pool's)
   uncached_tokens(p) = T − B × hit_blocks(p)
   import_blocks(p)   = max(0, pool's leading blocks − p's own)                (read from the pool first)
   queue(p)           = running + waiting + inflight                           (requests)
   prefill_s(p)       = prefill_s_per_token × (uncached_tokens(p) + queued_tokens_per_request × queue(p))
                        + transfer_s_per_block × import_blocks(p)

 decode instance d:
   load(d)            = running + waiting + inflight                           (requests)
   pull_blocks(d)     = prompt blocks − leading prompt blocks d's prefix cache holds   (disaggregated only)
   pressure(d)        = max(0, 1 − kv_free_fraction / kv_low_watermark)        (0 until KV runs low, then → 1)
   decode_s(d)        = decode_s_per_request × load(d) + transfer_s_per_block × pull_blocks(d)
                        + kv_pressure_s × pressure(d)

 local prefill on d (the colocated path: no prefill instance, no handoff):
   local_uncached(d)  = T − B × (leading prompt blocks d holds)
   local_s(d)         = local_prefill_slowdown × prefill_s_per_token × local_uncached(d) + decode_s(d) w/o pull
```

The router sends a request down the colocated path when `local_uncached(d)` of its chosen decode
instance is at most a threshold in tokens: a router setting, or `break_even_tokens()`, the prompt
length at which, on an idle fleet, computing on the decode instance (slowed by its running batch) costs
what a handoff saves: `local_prefill_slowdown × c × n = c × n + handoff_overhead_s + transfer_s_per_block
× n / B`, so `n* = handoff_overhead_s / (c × (local_prefill_slowdown − 1) − transfer_s_per_block / B)`.

The defaults are rough figures of SmolLM2-135M on two CPU cores; only their ratios steer the picks.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from shared.registry.base import Load


@dataclass(frozen=True)
class CostModel:
    """Coefficients of the model above (seconds, tokens, blocks, requests)."""

    prefill_s_per_token: float = 1e-3  # to compute one uncached prompt token on a prefill instance
    queued_tokens_per_request: int = 128  # prompt tokens assumed per request queued or running on a prefill
    decode_s_per_request: float = 0.02  # what one more request in a decode instance's batch adds
    transfer_s_per_block: float = 5e-4  # to move one KV block prefill → kv_transfer → decode
    handoff_overhead_s: float = 0.03  # a handoff's fixed cost (Reserve, Commit, Claim, Release round trips)
    local_prefill_slowdown: float = 2.0  # a prefill on a decode instance also stalls its running batch
    kv_pressure_s: float = 1.0  # added as a decode instance's free KV falls to nothing
    kv_low_watermark: float = 0.1  # free KV fraction below which pressure starts

    def prefill_s(self, num_uncached_tokens: int, load: Load, num_inflight: int = 0,
                  num_import_blocks: int = 0) -> float:
        """Seconds until a prefill instance has computed this prompt: its queue, the prefix blocks it reads
        from kv_transfer's pool first (`num_import_blocks`: those the pool holds beyond its own cache),
        then the uncached tokens. Charging the import is what keeps a prefix on the instance that already
        caches it when the pool holds it too: without it every instance scores the same hit, load alone
        decides, and with bounded caches each instance ends up caching (and evicting) every prefix."""
        queue = load.num_running + load.num_waiting + num_inflight
        return (self.prefill_s_per_token * (num_uncached_tokens + self.queued_tokens_per_request * queue)
                + self.transfer_s_per_block * num_import_blocks)

    def decode_s(self, load: Load, num_inflight: int = 0, num_pull_blocks: int = 0) -> float:
        """Seconds a decode instance's load, KV pressure and the blocks to pull add to a request."""
        requests = load.num_running + load.num_waiting + num_inflight
        return (self.decode_s_per_request * requests + self.transfer_s_per_block * num_pull_blocks
                + self.kv_pressure_s * self.kv_pressure(load))

    def kv_pressure(self, load: Load) -> float:
        """0 while the free KV fraction is above the watermark, rising to 1 as it reaches 0. An instance
        that reports no KV cache (a load report without it) counts as under no pressure."""
        if load.num_kv_blocks_total <= 0:
            return 0.0
        return max(0.0, 1.0 - load.kv_free_fraction / self.kv_low_watermark)

    def local_prefill_s(self, num_uncached_tokens: int, load: Load, num_inflight: int = 0) -> float:
        """Seconds to run the prompt's prefill on a decode instance and then decode there."""
        return (self.local_prefill_slowdown * self.prefill_s_per_token * num_uncached_tokens
                + self.decode_s(load, num_inflight))

    def break_even_tokens(self, block_size: int) -> int:
        """Uncached prompt tokens up to which a local prefill costs no more than a handoff (idle fleet)."""
        saved_per_token = self.prefill_s_per_token * (self.local_prefill_slowdown - 1.0)
        saved_per_token -= self.transfer_s_per_block / max(block_size, 1)
        if saved_per_token <= 0:  # computing locally is never slower per token: the handoff never pays
            return 1 << 30
        return math.floor(self.handoff_overhead_s / saved_per_token)


def uncached_tokens(num_prompt_tokens: int, num_hit_blocks: int, block_size: int) -> int:
    """Prompt tokens left to compute after a prefix hit; at least one (the step that samples the next token
    computes the last prompt token even on a full hit)."""
    return max(1, num_prompt_tokens - num_hit_blocks * block_size)
