"""Request cases of the Serve tests: invalid bodies, fuzz strategies, metric names, a tool."""

from __future__ import annotations

import re
from typing import Any

from hypothesis import strategies as st

from tests.helpers.serve_app import MAX_MODEL_LEN

LONG_PROMPT = " ".join(f"t{i % 200}" for i in range(MAX_MODEL_LEN + 10))
INVALID = [
    ("/v1/completions", {"model": "tiny", "prompt": 5}, 400, "prompt"),
    ("/v1/completions", {"model": "tiny", "prompt": "t1", "max_tokens": -1}, 400, "max_tokens"),
    ("/v1/completions", {"model": "tiny", "prompt": "t1", "max_tokens": "x"}, 400, "max_tokens"),
    ("/v1/completions", {"model": "tiny", "prompt": "t1", "temperature": -1}, 400, "temperature"),
    ("/v1/completions", {"model": "tiny", "prompt": "t1", "n": 0}, 400, "n"),
    ("/v1/completions", {"model": "tiny", "prompt": "t1", "logprobs": 99}, 400, "logprobs"),
    ("/v1/completions", {"model": "nope", "prompt": "t1"}, 404, "model"),
    ("/v1/completions", {"model": "tiny", "prompt": LONG_PROMPT}, 400, None),
    ("/v1/completions", {"model": "tiny", "prompt": "t1", "max_tokens": 5000}, 400, None),
    ("/v1/completions", {"model": "tiny", "prompt": [1, 2, 999]}, 400, None),
    ("/v1/completions", {"model": "tiny", "prompt": ""}, 400, None),
    ("/v1/completions", '{"model": "tiny", "prompt": ', 400, None),
    ("/v1/completions", "[1, 2]", 400, None),
    ("/v1/chat/completions", {"model": "tiny", "messages": []}, 400, "messages"),
    ("/v1/chat/completions", {"model": "tiny", "messages": [{"content": "t1"}]}, 400, None),
    ("/v1/chat/completions", {"model": "tiny", "messages": "hi"}, 400, "messages"),
]


JUNK = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-3, 40),
    st.floats(-3, 3, allow_nan=False),
    st.text(max_size=4),
    st.lists(st.integers(-2, 300), max_size=4),
    st.dictionaries(st.text(max_size=3), st.integers(-2, 2), max_size=2),
)
SPECIAL = {
    "model": st.sampled_from(["tiny", "other", None]),
    "prompt": st.one_of(st.sampled_from(["t1 t2", "", "t3"]), JUNK),
    "messages": st.one_of(
        st.lists(
            st.fixed_dictionaries(
                {"role": st.sampled_from(["user", "system", "bad"]), "content": JUNK}
            ),
            max_size=2,
        ),
        JUNK,
    ),
    "max_tokens": st.one_of(st.integers(-2, 6), JUNK),
    "max_completion_tokens": st.one_of(st.integers(-2, 6), JUNK),
    "n": st.one_of(st.integers(-1, 3), st.just("2")),
    "stream_options": st.one_of(st.fixed_dictionaries({"include_usage": JUNK}), JUNK),
}


def request_bodies(model_cls: type) -> st.SearchStrategy[dict[str, Any]]:
    """Request bodies over the pydantic model's fields: plausible values mixed with junk."""
    fields = {name: SPECIAL.get(name, JUNK) for name in model_cls.model_fields}
    required = {"model": SPECIAL["model"], "max_tokens": st.integers(1, 4)}
    optional = {k: v for k, v in fields.items() if k not in required}
    return st.fixed_dictionaries(required, optional=optional)


METRICS = [
    "vllm:num_requests_running",
    "vllm:num_requests_waiting",
    "vllm:kv_cache_usage_perc",
    "vllm:prefix_cache_queries",
    "vllm:prefix_cache_hits",
    "vllm:time_to_first_token_seconds",
    "vllm:inter_token_latency_seconds",
    "vllm:e2e_request_latency_seconds",
    "vllm:request_queue_time_seconds",
    "vllm:prompt_tokens_total",
    "vllm:generation_tokens_total",
    "vllm:num_preemptions_total",
    "vllm:request_success_total",
    "hybridserve:kv_cache_group_usage_perc",
    "hybridserve:prefix_cache_group_hits",
    "hybridserve:worker_alive",
]

DASHBOARD_SERVE_SERIES = [
    "ray_serve_deployment_request_counter_total",
    "ray_serve_deployment_queued_queries",
]
"""Ray Serve's own series the Grafana dashboard's routing panel reads (requests per replica,
requests queued at the handles)."""


def exported(name: str) -> str:
    """The series Ray exports: ':' sanitized to '_', `ray_` prefix."""
    return "ray_" + name.replace(":", "_")


def metric_samples(text: str) -> dict[str, list[tuple[str, float]]]:
    samples: dict[str, list[tuple[str, float]]] = {}
    for line in text.splitlines():
        match = re.match(r"^(\w+)(\{.*\})? ([-+\w.]+)$", line)
        if match:
            samples.setdefault(match[1], []).append((match[2] or "", float(match[3])))
    return samples


def has_metric(samples: dict[str, list[tuple[str, float]]], name: str) -> bool:
    return any(key in samples for key in (name, name + "_total", name + "_count"))


WEATHER = {
    "type": "object",
    "properties": {
        "city": {"enum": ["Paris", "Rome"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
    },
    "required": ["city", "days"],
    "additionalProperties": False,
}
"""A tool's argument schema the byte model can fill (a city from two, 1 to 7 days)."""
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}}]
