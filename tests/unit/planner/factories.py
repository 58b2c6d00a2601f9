"""Profiles with hand-chosen coefficients, so that simulated times can be checked by hand."""

from __future__ import annotations

from shared.planner.profile import EngineCurves, HandoffCurves, MachineShape, Profile


def make_profile(prefill: tuple[float, float, float] = (0.01, 0.001, 0.0),
                 decode: tuple[float, float, float] = (0.02, 0.005, 0.0),
                 push: tuple[float, float] = (0.0, 0.0), pull: tuple[float, float] = (0.0, 0.0),
                 budget: int = 2048, max_num_seqs: int = 64, kv_bytes_per_token: int = 1000) -> Profile:
    """One thread count (1) with the given fits; points that lie on them (enough to refit)."""
    curves = EngineCurves(prefill_fit=list(prefill), decode_fit=list(decode))
    curves.prefill_points = [[1, n, n, curves.prefill_step_s(n)] for n in (16, 256, 1024)]
    curves.decode_points = [[b, c, curves.decode_step_s(b, b * c)] for b in (1, 8) for c in (64, 512)]
    handoff = HandoffCurves(transport="tcp", push_fit=list(push), pull_fit=list(pull))
    handoff.points = [[n, handoff.push_s(n), handoff.pull_s(n)] for n in (1000, 100_000)]
    return Profile(model="smollm2-135m", model_identity="llama:30L:576H:3KV:64D:49152V",
                   machine=MachineShape(2, ("avx2", "avx512f"), "test cpu"), block_size=16,
                   kv_bytes_per_token=kv_bytes_per_token, max_num_batched_tokens=budget, max_num_seqs=max_num_seqs,
                   engines={1: curves}, handoff=handoff)
