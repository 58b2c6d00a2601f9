"""Videos as Gemma4VideoProcessor reads them (shared/multimodal/video.py, processor.py's `video_frame`).

transformers' video processor cannot be built here (its resize needs
torchvision, whose PyPI builds need CUDA); its module-level rules (frame
sampling, the prompt text per frame) run unbound, and its whole pipeline is
compared on a GPU machine (tests/integration/engine/test_video_processor_parity.py).
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from transformers.models.gemma4.processing_gemma4 import Gemma4Processor, get_aspect_ratio_preserving_size
from transformers.video_utils import VideoMetadata, default_sample_indices_fn

from shared.errors import InvalidRequestError
from shared.multimodal.media import MediaLimits
from shared.multimodal.video import VideoRules, decode_video, resize_frame, sample_indices, timestamp
from tests.helpers.gemma4_mm import media_processor, random_image, video_bytes

RULES = VideoRules(num_frames=4, max_soft_tokens=70, patch_size=4, pooling_kernel_size=2)


@pytest.mark.parametrize("total", [4, 5, 31, 32, 100, 1001])
def test_frames_are_sampled_as_transformers_samples_them(total: int) -> None:
    meta = VideoMetadata(total_num_frames=total, fps=24.0)
    assert sample_indices(total, 32) == (default_sample_indices_fn(meta, num_frames=32).tolist()
                                         if total >= 32 else list(range(total)))  # transformers refuses fewer


def test_the_prompt_text_per_frame_is_gemma4_processors() -> None:
    seconds = [0.0, 0.5, 59.99, 61.0, 3725.0]
    fake = SimpleNamespace(boi_token="<b>", eoi_token="</b>", video_token="v")
    meta = SimpleNamespace(fps=2.0, timestamps=seconds)
    theirs = Gemma4Processor.replace_video_token(fake, {"num_soft_tokens_per_video": [3], "video_metadata": [meta]}, 0)
    assert theirs == " ".join(f"{timestamp(t)} <b>vvv</b>" for t in seconds)
    assert [timestamp(t) for t in seconds] == ["00:00", "00:00", "00:59", "01:01", "62:05"]


def test_a_video_decodes_to_its_sampled_frames_resized_for_the_tower() -> None:
    data = video_bytes(10, 64, 48, fps=4)
    video = decode_video(data, RULES, MediaLimits(), "messages")
    h, w = get_aspect_ratio_preserving_size(48, 64, 4, 70 * 4, 2)
    assert [f.shape for f in video.frames] == [(h, w, 3)] * 4
    assert video.seconds == [i * 10 // 4 / 4 for i in range(4)]
    assert video.tokens_per_frame == (h // 4) * (w // 4) // 4
    assert len({f.tobytes() for f in video.frames}) == 4  # the blocks move: every sampled frame differs


@pytest.mark.parametrize("container,codec", [("mp4", "mpeg4"), ("webm", "libvpx"), ("matroska", "mpeg4"),
                                             ("avi", "mpeg4"), ("mov", "h264")])
def test_every_supported_container_gives_the_same_sampling(container: str, codec: str) -> None:
    video = decode_video(video_bytes(9, 40, 32, container=container, codec=codec), RULES, MediaLimits(), "m")
    assert len(video.frames) == 4 and video.seconds == [i * 9 // 4 / 4 for i in range(4)]


@pytest.mark.parametrize("size", [(24, 40), (96, 120)])
def test_resize_is_bicubic_antialiased(size: tuple[int, int]) -> None:
    """Down and up: close to a float64 bicubic of the same frame (torchvision's uint8 kernel rounds between its
    two passes, so not equal; the GPU parity test holds it to torchvision itself)."""
    frame = np.array(random_image(64, 48, seed=1))
    out = resize_frame(frame, *size)
    x = torch.from_numpy(frame).permute(2, 0, 1)[None].double()
    want = F.interpolate(x, size=list(size), mode="bicubic", antialias=True).clamp(0, 255)[0].permute(1, 2, 0)
    assert out.shape == (*size, 3) and out.dtype == np.uint8
    assert float(np.abs(out - want.numpy()).mean()) < 1.0
    assert resize_frame(frame, 48, 64) is frame  # already its size: untouched, as transformers skips it


def test_a_frame_is_cut_into_the_image_processors_patches() -> None:
    """At its processed size a frame's patches are what the image processor cuts from the same pixels, unresized
    (both lay a patch out (row, column, channel), rows of patches first)."""
    proc = media_processor()
    frame = np.asarray(random_image(40, 24, seed=2))
    cut = proc.video_frame(frame)
    ref = proc.images(images=[random_image(40, 24, seed=2)], do_resize=False, return_tensors="pt")
    real = (ref["image_position_ids"][0] != -1).all(dim=-1)
    torch.testing.assert_close(cut.patches, ref["pixel_values"][0][real].float())
    assert torch.equal(cut.positions, ref["image_position_ids"][0][real].long())
    assert cut.num_soft_tokens == int(ref["num_soft_tokens_per_image"][0])


BAD = {
    "not a video": (b"\x00\x01 certainly not a video" * 10, MediaLimits(), "could not be decoded"),
    "too many bytes": (video_bytes(4, 32, 32), MediaLimits(max_video_bytes=100), "over the limit of 100"),
    "too long": (video_bytes(12, 32, 32, fps=4), MediaLimits(max_video_seconds=2.0), "3.0 s is over the limit"),
    "too long, uncounted": (video_bytes(12, 32, 32, fps=4, container="webm", codec="libvpx"),
                            MediaLimits(max_video_seconds=2.0), "is over the limit of 2 s"),
    "frames too large": (video_bytes(2, 64, 64), MediaLimits(max_image_pixels=1000), "over the limit of 1000 pixels"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_videos_are_refused_with_the_reason(case: str) -> None:
    data, limits, message = BAD[case]
    with pytest.raises(InvalidRequestError, match=message) as err:
        decode_video(data, RULES, limits, "messages")
    assert err.value.param == "messages"


def test_an_image_file_is_no_video() -> None:
    import io

    buf = io.BytesIO()
    random_image(16, 16).save(buf, format="GIF")
    with pytest.raises(InvalidRequestError, match="container 'gif' is not supported"):
        decode_video(buf.getvalue(), RULES, MediaLimits(), "messages")
