"""Image throughput of a Gemma-3-shaped vision-language model through `LLM`: images/s, time to
first token with 1 and with 8 images per request, the encoder's share of the step time, and the
step's images encoded in one call against one image per call in the same run.

The model is a random `Gemma3ForConditionalGeneration` (config only, `load_format="dummy"`, no
downloads) with transformers' own `Gemma3Processor` (its image processor, a word-level tokenizer)
saved to a temporary folder. Shapes (`--shape`): `cpu` has the SigLIP-So400m tower of Gemma 3
(width 1152, 16 heads, MLP 4304, 14-pixel patches) at 224 px with `--vision-layers` of its 27
layers, 256 tokens per image, and a 6-layer Gemma-3-270M-shaped text model; `gpu` has the whole
tower at 896 px (27 layers, 4,096 patches pooled 4 x 4 to 256 tokens) and the Gemma-3-4B text
model (34 layers); `tiny` is the CPU dry run of the GPU check.

Each setting sends `requests` prompts at once (`max_tokens` greedy tokens each, every image new,
so neither the prefix cache nor the encoder cache hits) and records the call's wall time
(images/s, HF processing included), each request's time to first token (the engine's: arrival to
first token, queueing behind the other requests of the call included), and per step the wall
time of the runner's `execute` and of the model's `embed_images` (timed by wrapping both on the
instance; CUDA is synchronised around them). "one per call" runs the same prompts with
`embed_images` wrapped to encode one image per call; "alone" sends the requests one at a time
(time to first token without queueing). Modes alternate within each repeat.

    .venv/bin/python benchmarks/bench_images.py [--shape cpu] [--repeats 3] [--vision-layers 2]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch
import transformers
from PIL import Image
from tokenizers import Tokenizer
from tokenizers.models import WordLevel
from tokenizers.pre_tokenizers import WhitespaceSplit

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from cluster import LLM, SamplingParams

VOCAB = 1024
BOI_ID, EOI_ID, IMAGE_ID = VOCAB - 3, VOCAB - 2, VOCAB - 1
BOI, EOI, IMAGE = "<start_of_image>", "<end_of_image>", "<image_soft_token>"
TEXT_WORDS = 24
"""Text tokens of a prompt besides its images (8 before them, 16 after)."""
BATCHED, ONE_PER_CALL, ALONE = "batched", "one per call", "alone"
MODES = (BATCHED, ONE_PER_CALL, ALONE)
SIGLIP_SO400M = {
    "hidden_size": 1152,
    "intermediate_size": 4304,
    "num_attention_heads": 16,
    "patch_size": 14,
    "num_hidden_layers": 27,
}
"""Gemma 3's vision tower (SigLIP-So400m), as its checkpoints configure it."""
GEMMA3_4B_TEXT = {
    "hidden_size": 2560,
    "intermediate_size": 10240,
    "num_hidden_layers": 34,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "head_dim": 256,
    "query_pre_attn_scalar": 256,
    "sliding_window": 1024,
}
GEMMA3_270M_TEXT = {
    "hidden_size": 640,
    "intermediate_size": 2048,
    "num_hidden_layers": 6,
    "num_attention_heads": 4,
    "num_key_value_heads": 1,
    "head_dim": 256,
    "query_pre_attn_scalar": 256,
    "sliding_window": 512,
}
"""Gemma-3-270M's text layers, 6 of its 18 (one sliding : full period)."""
TINY_TEXT = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "query_pre_attn_scalar": 16,
    "sliding_window": 8,
}
TINY_VISION = {
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_attention_heads": 2,
    "patch_size": 14,
    "num_hidden_layers": 2,
}


@dataclass(frozen=True)
class Shape:
    """One measured model and load."""

    name: str
    vision: dict[str, Any]
    text: dict[str, Any]
    image_size: int
    mm_tokens: int
    """Image tokens per image (a square number; patches are average-pooled down to it)."""
    requests: dict[int, int]
    """Images per request -> requests sent at once."""
    repeats: int = 3
    max_tokens: int = 4


SHAPES = {
    "cpu": Shape(
        "SigLIP-So400m 224px, Gemma-3-270M-shaped text (6 layers)",
        vision={**SIGLIP_SO400M, "num_hidden_layers": 2},
        text=GEMMA3_270M_TEXT,
        image_size=224,
        mm_tokens=256,
        requests={1: 8, 8: 4},
    ),
    "gpu": Shape(
        "SigLIP-So400m 896px (27 layers), Gemma-3-4B text (34 layers)",
        vision=SIGLIP_SO400M,
        text=GEMMA3_4B_TEXT,
        image_size=896,
        mm_tokens=256,
        requests={1: 32, 8: 8},
    ),
    "tiny": Shape(
        "tiny SigLIP 56px, tiny Gemma 3 text",
        vision=TINY_VISION,
        text=TINY_TEXT,
        image_size=56,
        mm_tokens=4,
        requests={1: 2, 8: 2},
        repeats=2,
        max_tokens=2,
    ),
}


def gemma3_config(shape: Shape) -> transformers.Gemma3Config:
    """A Gemma 3 image model config: Gemma 3's 5 sliding : 1 full layer pattern, bf16."""
    layers = shape.text["num_hidden_layers"]
    text = {
        **shape.text,
        "vocab_size": VOCAB,
        "max_position_embeddings": 16384,
        "layer_types": [
            "full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(layers)
        ],
        "eos_token_id": None,
        "bos_token_id": None,
        "pad_token_id": None,
    }
    vision = {**shape.vision, "image_size": shape.image_size}
    return transformers.Gemma3Config(
        text_config=text,
        vision_config=vision,
        mm_tokens_per_image=shape.mm_tokens,
        boi_token_index=BOI_ID,
        eoi_token_index=EOI_ID,
        image_token_index=IMAGE_ID,
        architectures=["Gemma3ForConditionalGeneration"],
        dtype="bfloat16",
    )


def gemma3_processor(shape: Shape) -> transformers.Gemma3Processor:
    """transformers' Gemma 3 processor: its image processor at the shape's size, a word-level
    tokenizer of t0..t1020 and the image tokens."""
    vocab = {f"t{i}": i for i in range(BOI_ID)} | {BOI: BOI_ID, EOI: EOI_ID, IMAGE: IMAGE_ID}
    backend = Tokenizer(WordLevel(vocab, unk_token="t0"))
    backend.pre_tokenizer = WhitespaceSplit()
    tokenizer = transformers.PreTrainedTokenizerFast(
        tokenizer_object=backend,
        unk_token="t0",
        extra_special_tokens={"boi_token": BOI, "eoi_token": EOI, "image_token": IMAGE},
    )
    size = {"height": shape.image_size, "width": shape.image_size}
    image_processor = transformers.Gemma3ImageProcessor(size=size)
    return transformers.Gemma3Processor(
        image_processor, tokenizer, image_seq_length=shape.mm_tokens
    )


def write_model(shape: Shape, folder: Path) -> None:
    gemma3_config(shape).save_pretrained(folder)
    gemma3_processor(shape).save_pretrained(folder)


def open_llm(shape: Shape, folder: Path, device: str) -> LLM:
    images = max(shape.requests)
    prompt_len = images * (shape.mm_tokens + 2) + TEXT_WORDS
    return LLM(
        str(folder),
        load_format="dummy",
        device=device,
        distributed_executor_backend="uni",
        limit_mm_per_prompt={"image": images},
        max_model_len=prompt_len + shape.max_tokens + 16,
    )


def random_image(rng: np.random.Generator) -> Image.Image:
    """A random 640 x 480 RGB photo-sized image (the processor resizes it)."""
    return Image.fromarray(rng.integers(0, 256, (480, 640, 3), dtype=np.uint8))


def image_prompts(shape: Shape, num_images: int, seed: int) -> list[dict[str, Any]]:
    """`requests[num_images]` prompts, each with `num_images` new images between text."""
    rng = np.random.default_rng(seed)
    prompts = []
    for _ in range(shape.requests[num_images]):
        words = [f"t{token}" for token in rng.integers(0, BOI_ID, TEXT_WORDS)]
        text = " ".join(words[:8] + [BOI] * num_images + words[8:])
        images = [random_image(rng) for _ in range(num_images)]
        prompts.append({"prompt": text, "multi_modal_data": {"image": images}})
    return prompts


@dataclass
class StepTimes:
    """Wall seconds of the runner's steps and of the encoder calls within them."""

    steps: list[float] = field(default_factory=list)
    encoder: list[float] = field(default_factory=list)
    """Per step: seconds in `embed_images` (0 for steps without images)."""
    calls: list[int] = field(default_factory=list)
    """Per step: `embed_images` calls."""
    images: list[int] = field(default_factory=list)
    """Per step: images encoded."""


class EncoderProbe:
    """Times the in-process runner's steps and its model's `embed_images` calls (wrappers set
    on the instances); `one_per_call` makes the wrapper encode one image per call."""

    def __init__(self, llm: LLM, device: torch.device) -> None:
        runner = llm.client.core.executor.worker.model_runner
        self.model = runner.model
        self.device = device
        self.one_per_call = False
        self.times = StepTimes()
        self._encode = self.model.embed_images
        self._execute = runner.execute
        self._step_encoder = [0.0, 0, 0]  # seconds, calls, images of the running step
        self.model.embed_images = self._timed_encode
        runner.execute = self._timed_execute

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def _timed_encode(self, features: list[Any]) -> list[torch.Tensor]:
        groups = [[feature] for feature in features] if self.one_per_call else [features]
        outputs: list[torch.Tensor] = []
        for group in groups:
            self._sync()
            start = time.perf_counter()
            outputs += self._encode(group)
            self._sync()
            self._step_encoder[0] += time.perf_counter() - start
            self._step_encoder[1] += 1
            self._step_encoder[2] += len(group)
        return outputs

    def _timed_execute(self, scheduler_output: Any) -> Any:
        self._step_encoder = [0.0, 0, 0]
        start = time.perf_counter()
        result = self._execute(scheduler_output)
        self._sync()
        self.times.steps.append(time.perf_counter() - start)
        seconds, calls, images = self._step_encoder
        self.times.encoder.append(float(seconds))
        self.times.calls.append(int(calls))
        self.times.images.append(int(images))
        return result

    @contextmanager
    def recording(self, one_per_call: bool) -> Iterator[StepTimes]:
        """Record the steps run inside the block into a fresh `StepTimes`."""
        self.one_per_call, self.times = one_per_call, StepTimes()
        try:
            yield self.times
        finally:
            self.one_per_call = False


@dataclass
class Samples:
    """What one setting measured over its repeats."""

    images_per_s: list[float] = field(default_factory=list)
    """Per repeat."""
    encoder_s_per_image: list[float] = field(default_factory=list)
    """Per repeat."""
    ttft_s: list[float] = field(default_factory=list)
    """Per request."""
    steps: StepTimes = field(default_factory=StepTimes)

    def add_steps(self, times: StepTimes) -> None:
        for name in ("steps", "encoder", "calls", "images"):
            getattr(self.steps, name).extend(getattr(times, name))


def run_call(llm: LLM, prompts: list[dict[str, Any]], max_tokens: int) -> tuple[float, list[float]]:
    """Seconds of one `generate` call over `prompts`, and each request's time to first token."""
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - start
    ttfts = [output.metrics.time_to_first_token for output in outputs if output.metrics]
    return seconds, [ttft for ttft in ttfts if ttft is not None]


def measure_once(
    llm: LLM,
    probe: EncoderProbe,
    prompts: list[dict[str, Any]],
    mode: str,
    shape: Shape,
    samples: Samples,
) -> None:
    """One repeat of one setting, added to `samples`."""
    num_images = sum(len(prompt["multi_modal_data"]["image"]) for prompt in prompts)
    calls = [[prompt] for prompt in prompts] if mode == ALONE else [prompts]
    with probe.recording(one_per_call=mode == ONE_PER_CALL) as times:
        results = [run_call(llm, call, shape.max_tokens) for call in calls]
    samples.images_per_s.append(num_images / sum(seconds for seconds, _ in results))
    samples.ttft_s += [ttft for _, ttfts in results for ttft in ttfts]
    samples.encoder_s_per_image.append(sum(times.encoder) / max(sum(times.images), 1))
    samples.add_steps(times)


def measure(
    shape: Shape, device: torch.device, log: Callable[[str], None] = print
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Every setting of `shape` (images per request x mode), repeats alternating the modes: a
    row per setting, and per images/request the batching ratios."""
    with tempfile.TemporaryDirectory() as folder:
        write_model(shape, Path(folder))
        llm = open_llm(shape, Path(folder), device.type)
        try:
            probe = EncoderProbe(llm, device)
            for k in shape.requests:  # warm-up: one request of each size
                run_call(llm, image_prompts(shape, k, seed=10_000 + k)[:1], shape.max_tokens)
            samples = {(k, mode): Samples() for k in shape.requests for mode in MODES}
            for repeat in range(shape.repeats):
                for (k, mode), sample in samples.items():
                    prompts = image_prompts(shape, k, seed=1000 * repeat + 10 * k + len(mode))
                    measure_once(llm, probe, prompts, mode, shape, sample)
                log(f"repeat {repeat + 1}/{shape.repeats} done")
        finally:
            llm.shutdown()
    rows = [row(shape, k, mode, sample) for (k, mode), sample in samples.items()]
    ratios = [
        batching_ratios(k, samples[(k, BATCHED)], samples[(k, ONE_PER_CALL)])
        for k in shape.requests
    ]
    return rows, ratios


def spread(values: list[float], scale: float = 1.0, digits: int = 1) -> str:
    """`median (min-max)` of `values` times `scale`."""
    med, low, high = (
        round(v * scale, digits or None)
        for v in (statistics.median(values), min(values), max(values))
    )
    return f"{med} ({low}-{high})"


def row(shape: Shape, num_images: int, mode: str, samples: Samples) -> dict[str, object]:
    """One table row; encoder figures over the steps that encoded images."""
    steps = samples.steps
    encoding = [i for i, calls in enumerate(steps.calls) if calls]
    encoder_s = sum(steps.encoder[i] for i in encoding)
    step_s = sum(steps.steps[i] for i in encoding)
    images = sum(steps.images[i] for i in encoding)
    calls = sum(steps.calls[i] for i in encoding)
    return {
        "images/request": num_images,
        "requests": shape.requests[num_images],
        "mode": mode,
        "images/s": spread(samples.images_per_s, digits=2 if shape.name.startswith("tiny") else 1),
        "median_images_per_s": round(statistics.median(samples.images_per_s), 3),
        "ttft_ms": spread(samples.ttft_s, scale=1e3, digits=0),
        "median_ttft_ms": round(statistics.median(samples.ttft_s) * 1e3, 1),
        "images/encoder call": round(images / max(calls, 1), 1),
        "encoder_ms/image": round(encoder_s / max(images, 1) * 1e3, 2),
        "encoder_share_of_image_steps": round(encoder_s / step_s, 3) if step_s else 0.0,
        "encoder_share_of_all_steps": round(sum(steps.encoder) / sum(steps.steps), 3),
    }


def batching_ratios(num_images: int, batched: Samples, single: Samples) -> dict[str, object]:
    """Batched against one image per call, paired within each repeat (the two run back to
    back): one-per-call over batched encoder s/image, batched over one-per-call images/s (above
    1: batching helps); median (min-max) over the repeats."""
    pairs = zip(batched.encoder_s_per_image, single.encoder_s_per_image, strict=True)
    encoder = [one / both for both, one in pairs]
    pairs = zip(batched.images_per_s, single.images_per_s, strict=True)
    throughput = [both / one for both, one in pairs]
    return {
        "images/request": num_images,
        "encoder s/image, one per call / batched": spread(encoder, digits=2),
        "images/s, batched / one per call": spread(throughput, digits=2),
        "median_encoder_ratio": round(statistics.median(encoder), 3),
    }


def image_figures(shape: Shape, device: torch.device) -> dict[str, object]:
    """The GPU check's `images` section: the shape, its rows and the batching ratios."""
    rows, ratios = measure(shape, device, log=lambda line: None)
    return {
        "model": shape.name,
        "repeats": shape.repeats,
        "max_tokens": shape.max_tokens,
        "rows": rows,
        "batching": ratios,
    }


TABLE_COLUMNS = (
    "images/request",
    "requests",
    "mode",
    "images/s",
    "ttft_ms",
    "images/encoder call",
    "encoder_ms/image",
    "encoder_share_of_image_steps",
    "encoder_share_of_all_steps",
)


def markdown(rows: list[dict[str, Any]], ratios: list[dict[str, Any]]) -> str:
    """The rows' table, then the batching ratios' table."""
    return "\n".join([*_table(rows, TABLE_COLUMNS), "", *_table(ratios, tuple(ratios[0])[:3])])


def _table(rows: list[dict[str, Any]], columns: tuple[str, ...]) -> list[str]:
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    return lines + ["| " + " | ".join(str(r[c]) for c in columns) + " |" for r in rows]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="cpu")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--repeats", type=int, default=None)
    parser.add_argument(
        "--vision-layers",
        type=int,
        default=None,
        help="layers of the vision tower (default: the shape's)",
    )
    parser.add_argument("--json", type=Path, default=None, help="also write the rows here")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    shape = SHAPES[args.shape]
    if args.repeats is not None:
        shape = replace(shape, repeats=args.repeats)
    if args.vision_layers is not None:
        shape = replace(shape, vision={**shape.vision, "num_hidden_layers": args.vision_layers})
    print(
        f"{shape.name}: vision {shape.vision}, {shape.image_size} px, {shape.mm_tokens} tokens"
        f"/image; text {shape.text}; torch threads {torch.get_num_threads()}"
    )
    rows, ratios = measure(shape, torch.device(args.device))
    if args.json is not None:
        args.json.write_text(json.dumps({"rows": rows, "batching": ratios}, indent=2) + "\n")
    print(markdown(rows, ratios))


if __name__ == "__main__":
    main()
