"""TTFT of image+text prompts against text-only prompts of the same token count, and the encoder cache's effect.

One colocated engine in process on a tiny random multimodal Gemma 4 checkpoint
(`baton make-tiny gemma4 --vision --audio`, cached under ~/.cache/baton/bench-gemma4-mm).
Each round sends, one after another, in an order that rotates each round (so drift reaches all alike):

    text        random text tokens, as many as the image prompt has
    image       random text + a fresh random image (encoder and prefix caches miss)
    image_seen  different random text *before* one image sent every round (the prefix cache misses, the
                encoder-output cache hits)

TTFT is wall time from `add_request` (media decoded and preprocessed there, encoded at the first step) to
the first token. Reported: p50 / p99 of each, ratios to text's p50, and the encoder's ms per image; JSON in
bench/results/.

Tower batching (the engine and the encoder service encode every item a step or a pass holds together):
for batches of k images of the bench's size, one `encode_images` pass over all k against k passes of one,
alternating which goes first, the vision tower alone (no caches): ms per image each way and the ratio.

    .venv/bin/python -m bench.multimodal [--rounds 30] [--image-size 64 48] [--text-tokens 64]
    .venv/bin/python -m bench.multimodal --readme-from bench/results/multimodal-<stamp>.json
"""

from __future__ import annotations

import argparse
import io
import json
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from bench.engine import log, machine
from bench.results_file import write_results
from bench.serve_report import write_block
from shared.cache_dir import DEFAULT_CACHE_DIR
from shared.engine.config import EngineConfig
from shared.engine.engine import LLMEngine
from shared.engine.request import SamplingParams
from shared.multimodal.items import IMAGE, MediaItem
from shared.multimodal.media import content_hash

CONFIGS = ("text", "image", "image_seen")


def checkpoint(cache_dir: Path) -> Path:
    from shared.models.gemma4.tiny import TinyGemma4, write_checkpoint
    from shared.models.loader import resolve_model

    path = cache_dir / "bench-gemma4-mm"
    if not (path / "config.json").exists():
        log(f"writing a tiny multimodal Gemma 4 to {path} ...")
        write_checkpoint(path, TinyGemma4(vision=True, audio=True, bidirectional_vision=True),
                         resolve_model("gemma3-270m", cache_dir))
    return path


def png(width: int, height: int, seed: int) -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)).save(
        buf, format="PNG")
    return buf.getvalue()


def image_prompt(engine: LLMEngine, before: list[int], data: bytes, size: tuple[int, int],
                 after: list[int]) -> tuple[list[int], list[MediaItem]]:
    mm = engine.loaded.multimodal
    n = engine.loaded.media_encoder.processor.image_tokens(*size)
    ids = [*before, mm.boi_token_id]
    item = MediaItem(IMAGE, len(ids), n, content_hash(data), data)
    return ids + [mm.image_token_id] * n + [mm.eoi_token_id, *after], [item]


def ttft_s(engine: LLMEngine, request_id: str, prompt: list[int], media: list[MediaItem]) -> float:
    t0 = time.perf_counter()
    engine.add_request(request_id, prompt, SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True),
                       media=media)
    while True:
        if any(out.new_token_ids for out in engine.step() if out.request_id == request_id):
            return time.perf_counter() - t0


def run(engine: LLMEngine, rounds: int, size: tuple[int, int], text_tokens: int) -> dict[str, Any]:
    rng = random.Random(0)

    def words(n: int) -> list[int]:
        return [rng.randrange(1000, 200_000) for _ in range(n)]

    seen = png(*size, seed=10**6)
    times: dict[str, list[float]] = {c: [] for c in CONFIGS}
    num_tokens = 0
    for r in range(rounds):
        image_ids, image_media = image_prompt(engine, [2, *words(4)], png(*size, seed=r), size, words(text_tokens))
        num_tokens = len(image_ids)
        seen_ids, seen_media = image_prompt(engine, [2, *words(4)], seen, size, words(text_tokens))
        prompts = {"text": ([2, *words(num_tokens - 1)], []), "image": (image_ids, image_media),
                   "image_seen": (seen_ids, seen_media)}
        for k in range(len(CONFIGS)):  # the order rotates each round: no config always follows another
            c = CONFIGS[(r + k) % len(CONFIGS)]
            times[c].append(ttft_s(engine, f"{c}-{r}", *prompts[c]))
        if (r + 1) % 10 == 0:
            log(f"round {r + 1}/{rounds}")
    for c in CONFIGS:  # the first round warms up (the seen image is encoded there)
        times[c] = times[c][1:]
    base = statistics.median(times["text"])
    rows = {c: {"ttft_p50_ms": round(statistics.median(t) * 1e3, 3),
                "ttft_p99_ms": round(float(np.percentile(t, 99)) * 1e3, 3),
                "p50_vs_text": round(statistics.median(t) / base, 3), "samples": len(t)} for c, t in times.items()}
    return {"prompt_tokens": num_tokens, "image_soft_tokens": image_media[0].num_tokens, "configs": rows}


def encoder_ms(engine: LLMEngine, size: tuple[int, int], repeats: int = 10) -> float:
    encoder = engine.loaded.media_encoder
    samples = []
    for i in range(repeats):
        data = png(*size, seed=10**7 + i)
        item = MediaItem(IMAGE, 0, encoder.processor.image_tokens(*size), content_hash(data), data)
        t0 = time.perf_counter()
        encoder.encode(item)
        samples.append(time.perf_counter() - t0)
    return round(statistics.median(samples) * 1e3, 3)


def tower_batching(engine: LLMEngine, size: tuple[int, int], batch_sizes: tuple[int, ...] = (1, 4, 8),
                   repeats: int = 20) -> dict[str, Any]:
    from PIL import Image

    encoder = engine.loaded.media_encoder
    rows: dict[str, Any] = {}
    for k in batch_sizes:
        images = []
        for i in range(k):
            with Image.open(io.BytesIO(png(*size, seed=10**8 + 100 * k + i))) as img:
                cut = encoder.processor.image(img.convert("RGB"))
            images.append((cut.patches, cut.positions))
        one_pass, separate = [], []
        for r in range(repeats):
            for batched in ((True, False) if r % 2 == 0 else (False, True)):
                t0 = time.perf_counter()
                if batched:
                    encoder.encoders.encode_images(images)
                else:
                    for image in images:
                        encoder.encoders.encode_images([image])
                (one_pass if batched else separate).append(time.perf_counter() - t0)
        together, apart = statistics.median(one_pass[1:]), statistics.median(separate[1:])
        rows[str(k)] = {"one_pass_ms_per_image": round(together / k * 1e3, 3),
                        "separate_ms_per_image": round(apart / k * 1e3, 3),
                        "separate_over_one_pass": round(apart / together, 3)}
        log(f"tower batching, {k} images: {rows[str(k)]}")
    return rows


def readme_table(result: dict[str, Any], name: str) -> str:
    """bench/README.md's multimodal block, from one results file."""
    rows = result["configs"]
    lines = [f"Images through a colocated engine (`bench/multimodal.py`, run `{name}`, commit "
             f"`{result['machine'].get('commit', '?')}`; tiny random Gemma 4 with both towers, {result['rounds']} "
             f"rounds in rotating order): a {result['image_size'][0]}x{result['image_size'][1]} image "
             f"({result['image_soft_tokens']} soft tokens) in a {result['prompt_tokens']}-token prompt against "
             "text-only prompts of the same length; the vision tower "
             f"{result['encoder_ms_per_image']} ms per image.", "",
             "| prompt | TTFT p50 (ms) | p99 (ms) | p50 / text |", "|---|---|---|---|"]
    labels = {"text": "text only", "image": "image + text (encoder and prefix caches miss)",
              "image_seen": "image seen before + other text (encoder cache hit)"}
    for config in CONFIGS:
        r = rows[config]
        lines.append(f"| {labels[config]} | {r['ttft_p50_ms']:.2f} | {r['ttft_p99_ms']:.2f} | "
                     f"{r['p50_vs_text']:.3f}x |")
    batching = result.get("tower_batching")
    if batching:
        lines += ["", "Tower batching (the images of a step's requests, or of an encoder pass, in one vision-tower "
                  "pass; k = 1 is the control):", "",
                  "| images | one pass, ms per image | one pass each, ms per image | speedup |", "|---|---|---|---|"]
        for k, r in batching.items():
            lines.append(f"| {k} | {r['one_pass_ms_per_image']:.2f} | {r['separate_ms_per_image']:.2f} | "
                         f"{r['separate_over_one_pass']:.2f}x |")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--readme-from", type=Path, default=None,
                        help="only rewrite bench/README.md's block from this results file")
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--image-size", type=int, nargs=2, default=[64, 48], metavar=("W", "H"))
    parser.add_argument("--text-tokens", type=int, default=64, help="text tokens after the image")
    parser.add_argument("--cache-dir", type=Path, default=DEFAULT_CACHE_DIR)
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    args = parser.parse_args()
    readme = Path(__file__).parent / "README.md"
    if args.readme_from is not None:
        write_block(readme, "multimodal", readme_table(json.loads(args.readme_from.read_text()),
                                                       args.readme_from.name))
        return 0
    path = checkpoint(args.cache_dir)
    engine = LLMEngine(EngineConfig(model=str(path), max_model_len=1024, kv_cache_bytes=64 << 20))
    size = (args.image_size[0], args.image_size[1])
    result: dict[str, Any] = {"bench": "multimodal", "model": "tiny gemma4 (vision+audio, random)",
                              "machine": machine(), "image_size": list(size), "rounds": args.rounds,
                              **run(engine, args.rounds, size, args.text_tokens),
                              "encoder_ms_per_image": encoder_ms(engine, size),
                              "tower_batching": tower_batching(engine, size)}
    engine.close()
    for c, row in result["configs"].items():
        log(f"{c}: TTFT p50 {row['ttft_p50_ms']:.2f} ms, p99 {row['ttft_p99_ms']:.2f} ms, x{row['p50_vs_text']:.3f}")
    out = write_results(result, args.out, "multimodal")
    write_block(readme, "multimodal", readme_table(result, out.name))
    log(f"wrote {out} and bench/README.md's multimodal block")
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
