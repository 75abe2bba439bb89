"""A tiny served model (random llama + word-level tokenizer with a chat template) and Serve on
free loopback ports, for the Serve tests and the serve benchmark."""

from __future__ import annotations

import contextlib
import socket
import time
from collections.abc import Iterator
from dataclasses import dataclass
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


@dataclass(frozen=True)
class ServeAddress:
    """Where the Serve instance of the running Ray instance listens (HTTP and gRPC)."""

    http_port: int
    grpc_port: int

    @property
    def base_url(self) -> str:
        return f"http://{NODE_IP}:{self.http_port}"


_serve_of_session: tuple[str, ServeAddress] | None = None
"""The Ray session Serve was started in here, and its address."""


def shared_serve() -> ServeAddress:
    """Serve on the running Ray instance, started once per instance (HTTP and gRPC on free
    loopback ports): its controller and proxy outlive the modules, which `serve.run` their
    apps on it and `serve.delete` them when done."""
    import ray
    from ray import serve
    from ray.serve.config import HTTPOptions, gRPCOptions

    from cluster.cli.serve_apps import SERVICER

    global _serve_of_session
    session = ray.get_runtime_context().get_node_id()  # a new Ray instance: a new node
    if _serve_of_session is not None and _serve_of_session[0] == session:
        return _serve_of_session[1]
    address = ServeAddress(free_port(), free_port())
    serve.start(
        http_options=HTTPOptions(host=NODE_IP, port=address.http_port),
        grpc_options=gRPCOptions(port=address.grpc_port, grpc_servicer_functions=[SERVICER]),
    )
    _serve_of_session = (session, address)
    return address


@contextlib.contextmanager
def deployed(app: Any, name: str, route_prefix: str | None = "/") -> Iterator[ServeAddress]:
    """`app` running as `name` on the shared Serve instance; deleted (drained) on exit, and
    this process's cached handles dropped with it, as `serve.shutdown` would (a handle keeps
    the routers it was made with: a later app of the same name needs new ones)."""
    from ray import serve
    from ray.serve.context import _get_global_client

    address = shared_serve()
    serve.run(app, name=name, route_prefix=route_prefix)
    try:
        yield address
    finally:
        serve.delete(name)
        _get_global_client().shutdown_cached_handles()


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
