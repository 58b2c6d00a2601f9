"""The vision encoder through its image-size buckets (shared/models/gemma4/vision_graphs.py).

On the CPU the bucketed, padded pass runs eagerly: its soft tokens match
transformers' and the unpadded batch's, whatever bucket an image lands in and
whatever a larger image left in the bucket's rows before it. On CUDA the same
pass is captured and replayed (skipped without a GPU).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from shared.models.gemma4.multimodal import Gemma4Encoders
from shared.models.gemma4.vision_graphs import budgets_up_to
from tests.helpers.gemma4_mm import media_processor, random_image, tiny_mm_hf

# tiny towers: 4 px patches pooled 2 x 2; taken unresized, these images give 70, 54, 30 and 6 soft tokens
SIZES = [(80, 56), (72, 48), (48, 40), (16, 24)]


@pytest.fixture(scope="module")
def hf() -> Any:
    return tiny_mm_hf("all", bidirectional=True)


def processed(picture: Any) -> tuple[torch.Tensor, torch.Tensor, dict[str, Any]]:
    """(patches, positions) of an image cut at its own size (the buckets below the processor's budget), and
    the processor's padded output for transformers."""
    out = media_processor().images(images=[picture], do_resize=False, return_tensors="pt")
    real = (out["image_position_ids"][0] != -1).all(dim=-1)
    return out["pixel_values"][0][real].float(), out["image_position_ids"][0][real].long(), out


def theirs(hf: Any, out: dict[str, Any]) -> torch.Tensor:
    with torch.no_grad():
        return hf.model.get_image_features(out["pixel_values"], out["image_position_ids"]).pooler_output[0]


def test_budgets_are_the_processors_up_to_its_own() -> None:
    assert budgets_up_to(70) == [70]
    assert budgets_up_to(280) == [70, 140, 280]
    assert budgets_up_to(100) == [70, 100]
    assert budgets_up_to(1120) == [70, 140, 280, 560]  # the largest images run eagerly: compute-bound


def test_each_image_takes_the_smallest_bucket_that_holds_it(hf: Any) -> None:
    graphs = Gemma4Encoders(hf.config, hf.state_dict()).use_vision_graphs([40, 20, 70], capture=False)
    assert [b.cells for b in graphs.buckets] == [20, 40, 70]
    assert graphs.bucket_for(4 * 15).cells == 20  # type: ignore[union-attr]
    assert graphs.bucket_for(4 * 20).cells == 20  # type: ignore[union-attr]
    assert graphs.bucket_for(4 * 21).cells == 40  # type: ignore[union-attr]
    assert graphs.bucket_for(4 * 71) is None


def test_bucketed_pass_gives_transformers_soft_tokens(hf: Any) -> None:
    """Largest image first, so smaller ones reuse rows a larger one filled: stale rows must not leak in."""
    encoders = Gemma4Encoders(hf.config, hf.state_dict())
    eager = Gemma4Encoders(hf.config, hf.state_dict())
    graphs = encoders.use_vision_graphs([20, 70], capture=False)
    for i, size in enumerate(SIZES):
        patches, positions, out = processed(random_image(*size, seed=i))
        mine = encoders.encode_image(patches, positions)
        want = theirs(hf, out)
        assert mine.shape == want.shape == (int(out["num_soft_tokens_per_image"][0]), hf.config.text_config.hidden_size)
        torch.testing.assert_close(mine, want, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(mine, eager.encode_image(patches, positions), atol=1e-5, rtol=1e-5)
    assert graphs.num_replays == 0  # nothing captured on the CPU: the same padded pass, eagerly


def test_an_image_past_every_bucket_runs_eagerly_with_its_batch(hf: Any) -> None:
    encoders = Gemma4Encoders(hf.config, hf.state_dict())
    encoders.use_vision_graphs([20], capture=False)
    images = [processed(random_image(*size, seed=i)) for i, size in enumerate(SIZES)]
    out = encoders.encode_images([(patches, positions) for patches, positions, _ in images])
    for mine, (_, _, theirs_in) in zip(out, images, strict=True):
        torch.testing.assert_close(mine, theirs(hf, theirs_in), atol=1e-4, rtol=1e-4)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_replayed_graphs_give_the_eager_soft_tokens(hf: Any) -> None:
    weights = hf.state_dict()
    captured = Gemma4Encoders(hf.config, weights, device="cuda")
    eager = Gemma4Encoders(hf.config, weights, device="cuda")
    graphs = captured.use_vision_graphs([20, 70], capture=True)
    assert graphs.captured
    for i, size in enumerate(SIZES * 2):
        patches, positions, _ = processed(random_image(*size, seed=i))
        mine = captured.encode_image(patches, positions)
        torch.testing.assert_close(mine, eager.encode_image(patches, positions), atol=1e-4, rtol=1e-4)
    assert graphs.num_replays == 2 * len(SIZES)
