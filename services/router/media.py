"""Images, audio and video in chat messages: OpenAI content parts to the media items a prompt carries.

    {"type": "image_url", "image_url": {"url": "data:image/png;base64,..."}}    (or "url": "https://...")
    {"type": "input_audio", "input_audio": {"data": "<base64>", "format": "wav" | "mp3"}}
    {"type": "video_url", "video_url": {"url": "data:video/mp4;base64,..."}}    (vLLM's; or "url": "https://...")
        │  data URL / base64 decoded; an http(s) URL fetched only from a host on the allow-list,
        │  within the size and time limits (`fetch_remote_media`, before the request is prepared)
        ▼
    decoded and checked (shared/multimodal/media.py, video.py) ──► soft-token count (Gemma4Processor's rules)
        ▼
    a marker in the message text; after the chat template, the marker becomes
    <boi> <image> x n <eoi> (or <boa> <audio> x n <eoa>) and a MediaItem at that offset;
    a video's becomes "MM:SS <boi> <video> x n <eoi>" per sampled frame, joined by spaces, a MediaItem each

A part the model cannot read (any media to a text-only model, audio to a model
without an audio tower, video to one without video rules) is a 400, as is
anything undecodable or over a limit. Decoding a video takes a while (every
frame up to the last sampled), so the endpoints prepare a request holding one
on a worker thread (`has_video`).
"""

from __future__ import annotations

import base64
import binascii
import re
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

from shared.errors import InvalidRequestError
from shared.models.gemma4.multimodal import MultimodalConfig
from shared.multimodal.items import AUDIO, IMAGE, VIDEO, MediaItem
from shared.multimodal.media import AUDIO_SAMPLE_RATE, MediaLimits, content_hash, decode_audio, decode_image
from shared.multimodal.seams import MediaProcessor
from shared.multimodal.video import decode_video, frame_png, timestamp

MEDIA_PART_TYPES = ("image_url", "input_audio", "input_image", "video_url")
MARKER = "\x00baton-media-{}\x00"
FRAME_MARKER = "\x00baton-media-{}.{}\x00"  # frame f of the video part k
_MARKER_RE = re.compile("\x00baton-media-(\\d+)(?:\\.(\\d+))?\x00")
_DATA_URL = re.compile(r"data:(?P<mime>[\w.+-]+/[\w.+-]+)?(?P<params>(;[\w-]+=[\w.-]+)*)(?P<b64>;base64)?,(?P<data>.*)",
                       re.DOTALL)


@dataclass
class PendingMedia:
    """One conversation's media parts, in the order their markers appear (a video: its frames, as PNGs, and their
    times; `data` empty)."""

    kind: list[str] = field(default_factory=list)
    data: list[bytes] = field(default_factory=list)
    audio_format: list[str] = field(default_factory=list)
    num_tokens: list[int] = field(default_factory=list)  # a video's: each frame's
    frames: list[list[bytes]] = field(default_factory=list)
    times: list[list[str]] = field(default_factory=list)


@dataclass
class RouterMedia:
    """What the router knows of a model's media side: its token ids, processor rules and the request limits."""

    config: MultimodalConfig
    processor: MediaProcessor
    limits: MediaLimits = field(default_factory=MediaLimits)
    url_allowlist: tuple[str, ...] = ()  # hosts (or ".domain" suffixes) http(s) image URLs may name
    fetch_timeout_s: float = 10.0

    @classmethod
    def from_checkpoint(cls, hf_dir: Any, settings: Any) -> RouterMedia | None:
        """The media side of the checkpoint in `hf_dir` under the router's settings (None: text only)."""
        from shared.models.checkpoint import architecture_of
        from shared.multimodal.loading import read_multimodal

        found = read_multimodal(hf_dir, architecture_of(hf_dir)[0])
        if found is None:
            return None
        limits = MediaLimits(settings.media_max_image_bytes, settings.media_max_image_pixels,
                             settings.media_max_audio_bytes, settings.media_max_audio_seconds, settings.media_max_items,
                             settings.media_max_video_bytes, settings.media_max_video_seconds)
        return cls(found[0], found[1], limits, tuple(h.lower() for h in settings.media_url_allowlist),
                   settings.media_fetch_timeout_s)

    def add_part(self, part: Any, pending: PendingMedia, param: str) -> str:
        """Decode and check one content part; the marker that stands for it in the message text."""
        if len(pending.kind) >= self.limits.max_items:
            raise InvalidRequestError(f"too many images, audio clips and videos: at most {self.limits.max_items} "
                                      "per request", param=param)
        kind, data, audio_format = _part_payload(part, param)
        frames: list[bytes] = []
        times: list[str] = []
        if kind == VIDEO:
            rules = self.processor.video_rules
            if not self.config.has_vision or rules is None or self.config.video_token_id is None:
                raise InvalidRequestError("this model does not read video", param=param)
            video = decode_video(data, rules, self.limits, param)
            frames, times = [frame_png(f) for f in video.frames], [timestamp(t) for t in video.seconds]
            data, num_tokens = b"", video.tokens_per_frame
        elif kind == IMAGE:
            if not self.config.has_vision:
                raise InvalidRequestError("this model does not read images", param=param)
            image = decode_image(data, self.limits, param)
            num_tokens = self.processor.image_tokens(image.width, image.height)
        else:
            if not self.config.has_audio:
                raise InvalidRequestError("this model does not read audio", param=param)
            wave = decode_audio(data, audio_format, self.limits, param)
            num_tokens = self.processor.audio_tokens(len(wave))
            if num_tokens == 0:
                raise InvalidRequestError(f"audio clip of {len(wave) / AUDIO_SAMPLE_RATE:.3f} s is too short",
                                          param=param)
        pending.kind.append(kind)
        pending.data.append(data)
        pending.audio_format.append(audio_format)
        pending.num_tokens.append(num_tokens)
        pending.frames.append(frames)
        pending.times.append(times)
        return MARKER.format(len(pending.kind) - 1)

    def allows(self, url: str) -> bool:
        host = (urlsplit(url).hostname or "").lower()
        return any(host == h or (h.startswith(".") and host.endswith(h)) for h in self.url_allowlist)


def has_video(parts: list[Any]) -> bool:
    """Whether any of these content parts is a video (whose decoding belongs off the event loop)."""
    return any(part.type == "video_url" for part in parts)


def _part_payload(part: Any, param: str) -> tuple[str, bytes, str]:
    """(kind, the file's bytes, audio format) of an image_url / input_image / input_audio / video_url part."""
    fields = part if isinstance(part, dict) else {**(part.model_extra or {}), "type": part.type}
    if fields["type"] == "input_audio":
        audio = fields.get("input_audio")
        if not isinstance(audio, dict):
            raise InvalidRequestError("an input_audio part needs {\"data\": base64, \"format\": \"wav\" | \"mp3\"}",
                                      param=param)
        audio_format = str(audio.get("format", "")).lower()
        return AUDIO, _b64(audio.get("data"), param), audio_format
    kind, what = (VIDEO, "video") if fields["type"] == "video_url" else (IMAGE, "image")
    url = fields.get(f"{what}_url")
    if isinstance(url, dict):
        url = url.get("url")
    if not isinstance(url, str) or not url:
        raise InvalidRequestError(f"a {fields['type']!r} part needs {'a video' if kind == VIDEO else 'an image'} URL",
                                  param=param)
    match = _DATA_URL.fullmatch(url)
    if match is None:
        raise InvalidRequestError(f"{what} URLs must be data: URLs (http(s) URLs only from hosts the server allows)",
                                  param=param)
    if not match["b64"]:
        raise InvalidRequestError(f"{what} data URLs must be base64", param=param)
    return kind, _b64(match["data"], param), ""


def _b64(text: Any, param: str) -> bytes:
    if not isinstance(text, str) or not text:
        raise InvalidRequestError("media data must be a non-empty base64 string", param=param)
    try:
        return base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError):
        raise InvalidRequestError("media data is not valid base64", param=param) from None


def expand_markers(text: str, pending: PendingMedia, config: MultimodalConfig,
                   tokenize: Any) -> tuple[list[int], list[MediaItem]]:
    """The rendered conversation's tokens with each marker replaced by its delimited placeholder run (a video's
    frames each with its time before it, tokenized with the text around it, as Gemma4Processor writes them)."""
    text = _MARKER_RE.sub(lambda m: _frames_text(int(m[1]), pending) if pending.kind[int(m[1])] == VIDEO
                          else m[0], text)
    video_id = config.video_token_id or 0  # add_part admits video only where the model names its token
    ids: list[int] = []
    items: list[MediaItem] = []
    seen: set[int] = set()
    pieces = _MARKER_RE.split(text)  # text, part, frame (or None), text, ...
    for i in range(0, len(pieces), 3):
        if pieces[i]:
            ids += tokenize(pieces[i])
        if i + 1 == len(pieces):
            break
        k = int(pieces[i + 1])
        seen.add(k)
        kind, n = pending.kind[k], pending.num_tokens[k]
        begin, token, end = ((config.boi_token_id, config.image_token_id, config.eoi_token_id) if kind == IMAGE
                             else (config.boi_token_id, video_id, config.eoi_token_id) if kind == VIDEO
                             else (config.boa_token_id, config.audio_token_id, config.eoa_token_id))
        data = pending.frames[k][int(pieces[i + 2])] if kind == VIDEO else pending.data[k]
        ids.append(begin)
        items.append(MediaItem(kind, len(ids), n, content_hash(data), data, pending.audio_format[k]))
        ids += [token] * n + [end]
    if len(seen) != len(pending.kind):
        raise InvalidRequestError("the chat template dropped an image, audio or video part", param="messages")
    return ids, items


def _frames_text(k: int, pending: PendingMedia) -> str:
    """Video part k as Gemma4Processor.replace_video_token writes it, each frame a marker: "MM:SS <frame>" joined
    by spaces."""
    return " ".join(f"{t} {FRAME_MARKER.format(k, f)}" for f, t in enumerate(pending.times[k]))


async def fetch_remote_media(media: RouterMedia | None, parts: list[Any]) -> None:
    """Replace each http(s) image or video URL among `parts` (content parts) by a data URL of what it serves,
    fetched only from an allowed host, within the size limit of its kind and the fetch timeout."""
    for part in parts:
        fields = part.model_extra or {}
        key = "video_url" if part.type == "video_url" else "image_url"
        url = fields.get(key)
        if isinstance(url, dict):
            url = url.get("url")
        if not isinstance(url, str) or not url.startswith(("http://", "https://")):
            continue
        what = key.partition("_")[0]
        if media is None or not media.allows(url):
            raise InvalidRequestError(f"{what} URL host {urlsplit(url).hostname!r} is not allowed (send a data: URL, "
                                      "or ask the operator to allow the host)", param="messages")
        limit = media.limits.max_video_bytes if key == "video_url" else media.limits.max_image_bytes
        data = await _fetch(url, what, limit, media.fetch_timeout_s)
        fields[key] = {"url": "data:application/octet-stream;base64," + base64.b64encode(data).decode()}


async def _fetch(url: str, what: str, max_bytes: int, timeout_s: float) -> bytes:
    import asyncio

    import httpx

    chunks: list[bytes] = []
    size = 0
    try:
        async with asyncio.timeout(timeout_s), httpx.AsyncClient(timeout=timeout_s, follow_redirects=False) as client:
            async with client.stream("GET", url) as response:
                if response.status_code != 200:
                    raise InvalidRequestError(f"{what} URL answered HTTP {response.status_code}", param="messages")
                async for chunk in response.aiter_bytes():
                    size += len(chunk)
                    if size > max_bytes:
                        raise InvalidRequestError(f"{what} at the URL is over the limit of {max_bytes} bytes",
                                                  param="messages")
                    chunks.append(chunk)
    except TimeoutError:
        raise InvalidRequestError(f"{what} URL did not answer within {timeout_s:g} s", param="messages") from None
    except httpx.HTTPError as e:
        raise InvalidRequestError(f"{what} URL could not be fetched: {type(e).__name__}", param="messages") from None
    return b"".join(chunks)
