"""Every series the Grafana dashboard charts is one the server exports.

The engine's series come from the metric objects a replica registers (`EngineMetrics`, with its
speculative decoding and offload tier parts): their names, as Ray's Prometheus exporter writes
them (`ray_` prefix, ':' sanitized; a counter's samples end in `_total`, a histogram's in
`_bucket`, `_sum`, `_count`). The routing panel reads Ray Serve's own series; the Ray test
`tests/ray/test_serve_openai.py::test_metrics_are_exported_with_sane_values` checks those in a
live scrape.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from ray.util import metrics

from cluster.serve.metrics import EngineMetrics
from cluster.serve.offload_metrics import OffloadMetrics
from tests.helpers.serve_cases import DASHBOARD_SERVE_SERIES

DASHBOARD = Path(__file__).resolve().parents[3] / "helm/hybridserve/dashboards/hybridserve.json"


def dashboard_series() -> set[str]:
    """The metric names the dashboard's queries read."""
    panels = json.loads(DASHBOARD.read_text())["panels"]
    exprs = [target["expr"] for panel in panels for target in panel.get("targets", [])]
    return {name for expr in exprs for name in re.findall(r"\bray_[a-z0-9_]+", expr)}


def _metric_objects(owner: object) -> list[metrics.Metric]:
    return [value for value in vars(owner).values() if isinstance(value, metrics.Metric)]


def exported_series() -> set[str]:
    """What Ray exports for every metric object a replica's engine metrics register."""
    engine = EngineMetrics("m", ["full_attention", "sliding_window"])
    objects = [
        *_metric_objects(engine),
        *_metric_objects(engine.spec),
        *_metric_objects(OffloadMetrics("m")),
    ]
    series = set()
    for metric in objects:
        name = "ray_" + metric._name
        if isinstance(metric, metrics.Counter):
            series |= {name, name if name.endswith("_total") else name + "_total"}
        elif isinstance(metric, metrics.Histogram):
            series |= {name + "_bucket", name + "_sum", name + "_count"}
        else:
            series.add(name)
    return series


def test_every_dashboard_query_names_a_series_the_server_exports() -> None:
    charted = dashboard_series()
    unknown = charted - exported_series() - set(DASHBOARD_SERVE_SERIES)
    assert not unknown, f"the dashboard charts series nothing exports: {sorted(unknown)}"


def test_the_dashboard_charts_misses_routing_and_speculative_decoding() -> None:
    charted = dashboard_series()
    assert "ray_hybridserve_prefix_cache_misses_total" in charted
    assert "ray_vllm_spec_decode_num_accepted_tokens_total" in charted
    assert set(DASHBOARD_SERVE_SERIES) <= charted
