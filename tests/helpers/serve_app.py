"""A tiny served model (random llama + word-level tokenizer with a chat template) and Serve on
free loopback ports, for the Serve tests and the serve benchmark."""

from __future__ import annotations

import socket
import time
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer, decoders
from tokenizers.models import WordLevel
from tokenizers.pre_tokenizers import WhitespaceSplit
from transformers import PreTrainedTokenizerFast

from tests.helpers.ray_local import NODE_IP
from tests.helpers.tiny_models import save_tiny_model

CHAT_TEMPLATE = (
    "{% for m in messages %}{{ 't1 ' + m['content'] + ' t2 ' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ 't3 ' }}{% endif %}"
)
MAX_MODEL_LEN = 1024


def save_tiny_served_model(path: Path, vocab_size: int = 256) -> Path:
    """A tiny llama with a whitespace tokenizer over the words t0..t255 and a chat template."""
    save_tiny_model("llama", path, max_position_embeddings=MAX_MODEL_LEN)
    return save_word_tokenizer(path, vocab_size)


def save_word_tokenizer(path: Path, vocab_size: int = 256) -> Path:
    """A whitespace tokenizer over the words t0..t{vocab_size - 1} with a chat template."""
    vocab = {f"t{i}": i for i in range(vocab_size)}
    backend = Tokenizer(WordLevel(vocab, unk_token="t0"))
    backend.pre_tokenizer = WhitespaceSplit()
    backend.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="t0")
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(path)
    return path


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind((NODE_IP, 0))
        return int(sock.getsockname()[1])


def llm_config(model_dir: Path, model_id: str = "tiny", **engine_kwargs: Any) -> dict[str, Any]:
    """A serving config of the tiny model: the replica is its engine, driving one worker actor
    (the Ray executor) in the replica's placement group."""
    return {
        "model_loading_config": {"model_id": model_id, "model_source": str(model_dir)},
        "engine_kwargs": {
            "dtype": "float32",  # the parity tests compare with transformers in fp32
            "block_size": 4,
            "kv_cache_memory_bytes": 8 * 1024 * 1024,
            "max_num_seqs": 64,
            **engine_kwargs,
        },
        "deployment_config": {"ray_actor_options": {"num_cpus": 0.5}},
    }


def shutdown_serve(timeout: float = 60.0) -> None:
    """Shut Serve down and wait until its named actors are gone, so the next module's
    `serve.start` in the same Ray session does not meet a dying proxy or controller."""
    import ray
    from ray import serve

    serve.shutdown()
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        names = ray.util.list_named_actors(all_namespaces=True)
        if not any(actor["name"].startswith("SERVE_") for actor in names):
            return
        time.sleep(0.2)
