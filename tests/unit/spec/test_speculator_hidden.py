"""The speculator's window of target hidden states per request (what an EAGLE proposer drafts from)."""

from __future__ import annotations

import torch

from shared.spec.speculator import Speculator


class _HiddenStateProposer:
    uses_hidden_states = True

    def propose(self, requests):  # never called here
        raise AssertionError


def test_rows_join_the_window_on_the_device_of_the_newest() -> None:
    """A handoff's rows arrive on the host, a verification's on the engine's device (CUDA): the window
    follows the newest rows. The meta device stands in for a second device on a CPU-only machine."""
    spec = Speculator(_HiddenStateProposer(), num_speculative_tokens=2, max_model_len=64, vocab_size=10,
                      hidden_window=4)
    spec.add_hidden_states("r", torch.randn(3, 8), start_pos=0)  # positions 0 .. 2, from the handoff
    spec.add_hidden_states("r", torch.empty(2, 8, device="meta"), start_pos=3)  # 3 .. 4, from verification
    window = spec._hidden["r"]
    assert window.rows.device.type == "meta" and window.rows.shape == (4, 8) and window.start_pos == 1
    spec.remove_request("r")
    spec.check_no_leaks()
