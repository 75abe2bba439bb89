"""Per-adapter metrics of a replica: vLLM's `vllm:lora_requests_info` (running and waiting
adapters, as labels), and per-adapter requests, prompt tokens and load time.

Names are sanitized for Ray as the other engine series are (`vllm:lora_requests_info` ->
`ray_vllm_lora_requests_info`).
"""

from __future__ import annotations

import time

from cluster.serve.ray_metric_names import counter as _counter
from cluster.serve.ray_metric_names import gauge as _gauge
from scheduler.stats import SchedulerStats


class LoRAMetrics:
    """The adapter series of one model in one replica."""

    def __init__(self, model_name: str) -> None:
        self.tags = {"model_name": model_name}
        self.info = _gauge(
            "vllm:lora_requests_info",
            "Running and waiting LoRA adapters (value: the time of the snapshot).",
            "running_lora_adapters",
            "waiting_lora_adapters",
            "max_lora",
        )
        self.requests = _counter(
            "hybridserve:lora_requests_total", "Requests admitted per LoRA adapter.", "lora_name"
        )
        self.prompt_tokens = _counter(
            "hybridserve:lora_prompt_tokens_total",
            "Prompt tokens of the requests admitted per LoRA adapter.",
            "lora_name",
        )
        self.load_seconds = _gauge(
            "hybridserve:lora_load_seconds",
            "Seconds the last read and check of a LoRA adapter took (all ranks).",
            "lora_name",
        )

    def record_request(self, lora_name: str, num_prompt_tokens: int, load_seconds: float) -> None:
        """An admitted request with an adapter (and the adapter's last load time)."""
        tags = {**self.tags, "lora_name": lora_name}
        self.requests.inc(1, tags)
        if num_prompt_tokens:
            self.prompt_tokens.inc(num_prompt_tokens, tags)
        self.load_seconds.set(load_seconds, tags)

    def record_stats(self, stats: SchedulerStats) -> None:
        """The adapters of the scheduler's snapshot, as vLLM labels them."""
        labels = {
            **self.tags,
            "running_lora_adapters": ",".join(stats.running_lora_adapters),
            "waiting_lora_adapters": ",".join(stats.waiting_lora_adapters),
            "max_lora": str(stats.max_lora),
        }
        self.info.set(time.time(), labels)
