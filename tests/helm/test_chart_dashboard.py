"""The chart's Grafana dashboard: every series charted per model, shipped as a ConfigMap the
Grafana sidecar picks up."""

from __future__ import annotations

import json
import re

from tests.helm.test_chart import CHART, _render

SERIES = [
    "ray_vllm_num_requests_running", "ray_vllm_num_requests_waiting",
    "ray_vllm_kv_cache_usage_perc",
    "ray_vllm_prefix_cache_queries_total", "ray_vllm_prefix_cache_hits_total",
    "ray_vllm_time_to_first_token_seconds_bucket", "ray_vllm_inter_token_latency_seconds_bucket",
    "ray_vllm_e2e_request_latency_seconds_bucket", "ray_vllm_request_queue_time_seconds_bucket",
    "ray_vllm_prompt_tokens_total", "ray_vllm_generation_tokens_total",
    "ray_vllm_num_preemptions_total", "ray_vllm_request_success_total",
    "ray_hybridserve_kv_cache_group_usage_perc", "ray_hybridserve_prefix_cache_group_hits",
    "ray_hybridserve_worker_alive",
    "ray_vllm_kv_offload_usage_perc", "ray_vllm_kv_offload_bytes_total",
    "ray_hybridserve_kv_offload_group_hit_tokens", "ray_vllm_num_requests_waiting_for_kvs",
    "ray_vllm_kv_offload_load_seconds_total", "ray_vllm_kv_offload_failed_loads_total",
    "ray_hybridserve_prefix_cache_misses_total", "ray_serve_deployment_request_counter_total",
    "ray_vllm_spec_decode_num_accepted_tokens_total", "ray_vllm_spec_decode_num_draft_tokens_total",
    "ray_hybridserve_kv_cache_group_blocks", "ray_hybridserve_kv_cache_group_pressure",
    "ray_hybridserve_admission_limited_total",
]  # fmt: skip


def test_dashboard_charts_every_series_per_model_and_ships_in_the_chart() -> None:
    text = (CHART / "dashboards" / "hybridserve.json").read_text()
    dashboard = json.loads(text)
    exprs = [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]
    for series in SERIES:
        assert any(series in expr for expr in exprs), f"{series} is not charted"
    for expr in exprs:  # every engine series is filtered by model (Ray Serve's have no model)
        selectors = len(re.findall(r"\bray_(?:vllm|hybridserve)_\w+\{", expr))
        selectors += expr.count("{__name__")
        assert expr.count('model_name=~"$model_name"') == selectors, expr
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids))
    shipped = _render({})["ConfigMap/dashboard"]["data"]["hybridserve.json"]
    assert json.loads(shipped) == dashboard


def test_dashboard_config_map_is_labelled_for_the_grafana_sidecar_and_can_be_turned_off() -> None:
    labels = _render({})["ConfigMap/dashboard"]["metadata"]["labels"]
    assert labels["grafana_dashboard"] == "1"
    assert "ConfigMap/dashboard" not in _render({"metrics": {"dashboard": {"enabled": False}}})
