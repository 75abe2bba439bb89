"""The ingress's parts that need no Ray cluster: the API key it asks clients for."""

from __future__ import annotations

import pytest

from cluster.config import API_KEY_ENV
from cluster.serve.ingress import OpenAiIngress


def test_ingress_reads_the_api_key_from_the_config_variable(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv(API_KEY_ENV, " secret\n")
    ingress = OpenAiIngress({})
    assert ingress.check_api_key("Bearer secret") is None
    assert ingress.check_api_key("Bearer other") is not None


def test_ingress_without_a_key_lets_every_client_in(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(API_KEY_ENV, raising=False)
    assert OpenAiIngress({}).check_api_key(None) is None
