"""Images and audio in chat messages: OpenAI content parts to the media items a prompt carries.

    {"type": "image_url", "image_url": {"url": "data:image/png;base64,..."}}    (or "url": "https://...")
    {"type": "input_audio", "input_audio": {"data": "<base64>", "format": "wav" | "mp3"}}
        │  data URL / base64 decoded; an http(s) URL fetched only from a host on the allow-list,
        │  within the size and time limits (`fetch_remote`, before the request is prepared)
        ▼
    decoded and checked (shared/multimodal/media.py) ──► soft-token count (Gemma4Processor's rules)
        ▼
    a marker in the message text; after the chat template, the marker becomes
    <boi> <image> x n <eoi> (or <boa> <audio> x n <eoa>) and a MediaItem at that offset

A part the model cannot read (any media to a text-only model, audio to a model
without an audio tower) is a 400, as is anything undecodable or over a limit.
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
from shared.multimodal.items import AUDIO, IMAGE, MediaItem
from shared.multimodal.media import AUDIO_SAMPLE_RATE, MediaLimits, content_hash, decode_audio, decode_image
from shared.multimodal.seams import MediaProcessor

MEDIA_PART_TYPES = ("image_url", "input_audio", "input_image")
MARKER = "\x00baton-media-{}\x00"
_MARKER_RE = re.compile("\x00baton-media-(\\d+)\x00")
_DATA_URL = re.compile(r"data:(?P<mime>[\w.+-]+/[\w.+-]+)?(?P<params>(;[\w-]+=[\w.-]+)*)(?P<b64>;base64)?,(?P<data>.*)",
                       re.DOTALL)


@dataclass
class PendingMedia:
    """One conversation's media, in the order their markers appear."""

    kind: list[str] = field(default_factory=list)
    data: list[bytes] = field(default_factory=list)
    audio_format: list[str] = field(default_factory=list)
    num_tokens: list[int] = field(default_factory=list)


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
                             settings.media_max_audio_bytes, settings.media_max_audio_seconds, settings.media_max_items)
        return cls(found[0], found[1], limits, tuple(h.lower() for h in settings.media_url_allowlist),
                   settings.media_fetch_timeout_s)

    def add_part(self, part: Any, pending: PendingMedia, param: str) -> str:
        """Decode and check one content part; the marker that stands for it in the message text."""
        if len(pending.kind) >= self.limits.max_items:
            raise InvalidRequestError(f"too many images and audio clips: at most {self.limits.max_items} per request",
                                      param=param)
        kind, data, audio_format = _part_payload(part, param)
        if kind == IMAGE:
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
        return MARKER.format(len(pending.kind) - 1)

    def allows(self, url: str) -> bool:
        host = (urlsplit(url).hostname or "").lower()
        return any(host == h or (h.startswith(".") and host.endswith(h)) for h in self.url_allowlist)


def _part_payload(part: Any, param: str) -> tuple[str, bytes, str]:
    """(kind, the file's bytes, audio format) of an image_url / input_image / input_audio part."""
    fields = part if isinstance(part, dict) else {**(part.model_extra or {}), "type": part.type}
    if fields["type"] == "input_audio":
        audio = fields.get("input_audio")
        if not isinstance(audio, dict):
            raise InvalidRequestError("an input_audio part needs {\"data\": base64, \"format\": \"wav\" | \"mp3\"}",
                                      param=param)
        audio_format = str(audio.get("format", "")).lower()
        return AUDIO, _b64(audio.get("data"), param), audio_format
    url = fields.get("image_url")
    if isinstance(url, dict):
        url = url.get("url")
    if not isinstance(url, str) or not url:
        raise InvalidRequestError(f"a {fields['type']!r} part needs an image URL", param=param)
    match = _DATA_URL.fullmatch(url)
    if match is None:
        raise InvalidRequestError("image URLs must be data: URLs (http(s) URLs only from hosts the server allows)",
                                  param=param)
    if not match["b64"]:
        raise InvalidRequestError("image data URLs must be base64", param=param)
    return IMAGE, _b64(match["data"], param), ""


def _b64(text: Any, param: str) -> bytes:
    if not isinstance(text, str) or not text:
        raise InvalidRequestError("media data must be a non-empty base64 string", param=param)
    try:
        return base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError):
        raise InvalidRequestError("media data is not valid base64", param=param) from None


def expand_markers(text: str, pending: PendingMedia, config: MultimodalConfig,
                   tokenize: Any) -> tuple[list[int], list[MediaItem]]:
    """The rendered conversation's tokens with each marker replaced by its delimited placeholder run."""
    ids: list[int] = []
    items: list[MediaItem] = []
    pieces = _MARKER_RE.split(text)
    for i, piece in enumerate(pieces):
        if i % 2 == 0:
            ids += tokenize(piece) if piece else []
            continue
        k = int(piece)
        kind, n = pending.kind[k], pending.num_tokens[k]
        begin, token, end = ((config.boi_token_id, config.image_token_id, config.eoi_token_id) if kind == IMAGE
                             else (config.boa_token_id, config.audio_token_id, config.eoa_token_id))
        ids.append(begin)
        items.append(MediaItem(kind, len(ids), n, content_hash(pending.data[k]), pending.data[k],
                               pending.audio_format[k]))
        ids += [token] * n + [end]
    if len(items) != len(pending.kind):
        raise InvalidRequestError("the chat template dropped an image or audio part", param="messages")
    return ids, items


async def fetch_remote_images(media: RouterMedia | None, parts: list[Any]) -> None:
    """Replace each http(s) image URL among `parts` (content parts) by a data URL of what it serves, fetched
    only from an allowed host, within the image size limit and the fetch timeout."""
    for part in parts:
        fields = part.model_extra or {}
        url = fields.get("image_url")
        if isinstance(url, dict):
            url = url.get("url")
        if not isinstance(url, str) or not url.startswith(("http://", "https://")):
            continue
        if media is None or not media.allows(url):
            raise InvalidRequestError(f"image URL host {urlsplit(url).hostname!r} is not allowed (send a data: URL, "
                                      "or ask the operator to allow the host)", param="messages")
        data = await _fetch(url, media.limits.max_image_bytes, media.fetch_timeout_s)
        fields["image_url"] = {"url": "data:application/octet-stream;base64," + base64.b64encode(data).decode()}


async def _fetch(url: str, max_bytes: int, timeout_s: float) -> bytes:
    import asyncio

    import httpx

    chunks: list[bytes] = []
    size = 0
    try:
        async with asyncio.timeout(timeout_s), httpx.AsyncClient(timeout=timeout_s, follow_redirects=False) as client:
            async with client.stream("GET", url) as response:
                if response.status_code != 200:
                    raise InvalidRequestError(f"image URL answered HTTP {response.status_code}", param="messages")
                async for chunk in response.aiter_bytes():
                    size += len(chunk)
                    if size > max_bytes:
                        raise InvalidRequestError(f"image at the URL is over the limit of {max_bytes} bytes",
                                                  param="messages")
                    chunks.append(chunk)
    except TimeoutError:
        raise InvalidRequestError(f"image URL did not answer within {timeout_s:g} s", param="messages") from None
    except httpx.HTTPError as e:
        raise InvalidRequestError(f"image URL could not be fetched: {type(e).__name__}", param="messages") from None
    return b"".join(chunks)
