"""baton's video path against transformers' own: Gemma4VideoProcessor on frames transformers' PyAV loader read.

The same file both ways: transformers samples 32 frames with `load_video(backend="pyav")` and cuts them with
Gemma4VideoProcessor (torchvision's resize); baton decodes, samples and resizes in shared/multimodal/video.py
and cuts each frame in processor.py. Frame times, soft-token counts, patch positions and pixel values agree
(pixels within one uint8 step: two bicubic implementations). Runs where torchvision runs: its PyPI builds
need CUDA's libraries, so on a GPU machine.
"""

from __future__ import annotations

from functools import partial
from pathlib import Path

import numpy as np
import pytest
import torch

from shared.models.gemma4.tiny import TINY_VIDEO_PROCESSOR
from shared.multimodal.media import MediaLimits
from shared.multimodal.video import decode_video
from tests.helpers.gemma4_mm import hf_video_inputs, media_processor, video_bytes

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available(), reason="transformers' video processor needs torchvision, whose PyPI builds "
    "need CUDA")]


@pytest.mark.parametrize("frames,width,height", [(40, 64, 48), (33, 100, 30), (64, 37, 53)])
def test_frames_times_and_patches_are_transformers(tmp_path: Path, frames: int, width: int, height: int) -> None:
    from transformers.models.gemma4.video_processing_gemma4 import Gemma4VideoProcessor
    from transformers.video_utils import default_sample_indices_fn, load_video

    data = video_bytes(frames, width, height, fps=8, seed=frames)
    path = tmp_path / "clip.mp4"
    path.write_bytes(data)
    settings = {k: v for k, v in TINY_VIDEO_PROCESSOR.items() if k != "video_processor_type"}
    raw, metadata = load_video(str(path), backend="pyav",
                               sample_indices_fn=partial(default_sample_indices_fn, num_frames=settings["num_frames"]))
    theirs = Gemma4VideoProcessor(**settings)(videos=[raw], video_metadata=[metadata], do_sample_frames=False,
                                              return_tensors="pt")

    ours = decode_video(data, media_processor().video_rules, MediaLimits(), "messages")
    assert [round(t, 6) for t in ours.seconds] == [round(t, 6) for t in metadata.timestamps]
    assert ours.tokens_per_frame == int(theirs["num_soft_tokens_per_video"][0])
    mine = hf_video_inputs(ours.frames)
    assert torch.equal(mine["video_position_ids"], theirs["video_position_ids"])
    assert int(theirs["num_frames_per_video"][0]) == len(ours.frames) == settings["num_frames"]
    diff = (mine["pixel_values_videos"] - theirs["pixel_values_videos"].float()).abs()
    assert float(diff.max()) <= 1 / 255 + 1e-6, float(diff.max())
    assert float((diff > 1e-6).float().mean()) < 0.01  # off by a step in under 1% of the pixels
    assert np.isfinite(diff.numpy()).all()
