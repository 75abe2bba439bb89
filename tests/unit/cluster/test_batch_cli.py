"""`hybridserve batch` / `python -m cluster.batch` usage errors and the Ray token rule (no Ray)."""

from __future__ import annotations

from pathlib import Path

import pytest

from cluster import cli, ray_auth


def test_usage_errors_are_one_line_and_exit_2(tmp_path: Path, capsys) -> None:
    source, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    assert cli.main(["batch", "--input", str(source), "--output", str(out)]) == 2
    assert capsys.readouterr().err == f"hybridserve batch: error: --input {source} is not a file\n"
    source.write_text('{"prompt": "x"}\n')
    out.write_text('{"id": 0, "error": "x"}\n')
    assert cli.main(["batch", "--input", str(source), "--output", str(out)]) == 2
    assert "already exists: pass --resume" in capsys.readouterr().err
    args = ["batch", "--input", str(source), "--output", str(tmp_path / "new.jsonl")]
    with pytest.raises(SystemExit, match="2"):
        cli.main([*args, "--max-num-seqs", "x"])
    assert "--max-num-seqs: invalid int value" in capsys.readouterr().err
    config = tmp_path / "llm.yaml"
    config.write_text("model_loading_config: {model_id: m}\nengine_kwargs: {max_model_lenn: 8}\n")
    assert cli.main([*args, "--config", str(config)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert "did you mean 'max_model_len'" in err


@pytest.mark.parametrize(
    ("mode", "token", "expected", "mode_after"),
    [
        (None, "secret", True, "token"),
        (None, "", False, None),
        ("disabled", "secret", False, "disabled"),
        ("token", "", True, "token"),
    ],
)
def test_token_auth_is_enabled_when_a_token_exists_and_no_mode_was_chosen(
    tmp_path: Path, monkeypatch, mode, token, expected, mode_after
) -> None:
    token_file = tmp_path / "auth_token"
    token_file.write_text(token)
    monkeypatch.delenv("RAY_AUTH_TOKEN", raising=False)
    monkeypatch.setenv("RAY_AUTH_TOKEN_PATH", str(token_file))
    if mode is None:
        monkeypatch.delenv("RAY_AUTH_MODE", raising=False)
    else:
        monkeypatch.setenv("RAY_AUTH_MODE", mode)
    assert ray_auth.enable_token_auth_if_available() is expected
    assert ray_auth.os.environ.get("RAY_AUTH_MODE") == mode_after


def test_engine_args_come_from_the_config_then_model_and_flags(tmp_path: Path) -> None:
    import argparse

    from cluster.cli.batch import add_batch_arguments, engine_args_from

    config = tmp_path / "llm.yaml"
    config.write_text(
        "model_loading_config: {model_id: tiny, model_source: /models/tiny}\n"
        "engine_kwargs: {max_model_len: 64, block_size: 8}\n"
    )
    parser = argparse.ArgumentParser()
    add_batch_arguments(parser)
    base = ["--input", "in.jsonl", "--output", "out.jsonl", "--config", str(config)]
    args = engine_args_from(parser.parse_args(base))
    assert (args.model, args.max_model_len, args.block_size) == ("/models/tiny", 64, 8)
    args = engine_args_from(parser.parse_args([*base, "--model", "/m2", "--block-size", "4"]))
    assert (args.model, args.max_model_len, args.block_size) == ("/m2", 64, 4)


def test_a_replica_pool_the_cluster_cannot_hold_fails_at_once() -> None:
    from cluster.batch.runner import check_pool_fits

    check_pool_fits(2, 0, {"CPU": 2.0})
    with pytest.raises(ValueError, match=r"--replicas 3 needs 3 CPU .* the cluster has 2"):
        check_pool_fits(3, 0, {"CPU": 2.0})
    with pytest.raises(ValueError, match=r"needs 2 GPU"):
        check_pool_fits(1, 2, {"CPU": 8.0, "GPU": 1.0})
