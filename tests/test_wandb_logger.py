"""lightdist's W&B logger decides for itself whether it can log online, and says why when it cannot."""

from __future__ import annotations

import re
import socket
import warnings
from collections.abc import Iterator
from pathlib import Path

import pytest

from lightdist.plugins import WandbLogger


@pytest.fixture
def no_wandb_login(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    for name in ("WANDB_API_KEY", "WANDB_IDENTITY_TOKEN_FILE", "WANDB_MODE", "WANDB_BASE_URL"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("NETRC", str(tmp_path / "no-netrc"))


@pytest.fixture
def wandb_server() -> Iterator[str]:
    """Something listening where the W&B server would be: the logger only needs it to answer."""
    with socket.create_server(("127.0.0.1", 0)) as server:
        yield f"http://127.0.0.1:{server.getsockname()[1]}"


def test_without_an_api_key_it_logs_offline_and_says_how_to_upload_later(no_wandb_login: None, tmp_path: Path) -> None:
    with pytest.warns(UserWarning, match="no API key is set") as said:
        logger = WandbLogger(project="lightdist", save_dir=tmp_path)
    assert logger.offline
    assert f"wandb sync {tmp_path}/wandb/offline-run-*" in str(said[0].message)


def test_with_a_key_but_no_server_it_logs_offline_and_names_the_server(
    no_wandb_login: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("WANDB_API_KEY", "k" * 40)
    monkeypatch.setenv("WANDB_BASE_URL", "http://127.0.0.1:1")  # nothing listens there
    with pytest.warns(UserWarning, match="the W&B server http://127.0.0.1:1 cannot be reached"):
        assert WandbLogger(project="lightdist").offline


def test_with_a_key_and_a_server_it_logs_online(
    no_wandb_login: None, monkeypatch: pytest.MonkeyPatch, wandb_server: str
) -> None:
    monkeypatch.setenv("WANDB_API_KEY", "k" * 40)
    monkeypatch.setenv("WANDB_BASE_URL", wandb_server)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert not WandbLogger(project="lightdist").offline


def test_wandb_mode_in_the_environment_decides_without_a_check(
    no_wandb_login: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("WANDB_MODE", "disabled")  # wandb obeys it; lightdist neither checks nor warns
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert not WandbLogger(project="lightdist").offline


@pytest.mark.parametrize(
    ("environment", "options", "message"),
    [
        ({"WANDB_MODE": "ofline"}, {}, "WANDB_MODE='ofline' is not a W&B mode: set one of online, offline"),
        ({}, {"project": "team/run"}, "project='team/run' contains /, which W&B refuses in project names"),
        ({"WANDB_BASE_URL": "api.wandb.ai"}, {}, "WANDB_BASE_URL='api.wandb.ai' is not a server URL"),
        ({}, {"save_dir": "a-file"}, "save_dir='a-file' is a file"),
    ],
)
def test_misconfiguration_fails_when_the_logger_is_made_naming_the_setting(
    no_wandb_login: None,
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
    environment: dict[str, str],
    options: dict[str, str],
    message: str,
) -> None:
    """Before the Trainer starts, not at the first logged metric, after the model has taken its memory."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "a-file").touch()
    for name, value in environment.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(ValueError, match=re.escape(message)):
        WandbLogger(**options)


def test_an_offline_run_starts_without_wandbs_warning_about_lightnings_anonymous_setting(
    no_wandb_login: None, tmp_path: Path, capfd: pytest.CaptureFixture
) -> None:
    logger = WandbLogger(project="lightdist", save_dir=tmp_path, offline=True)
    try:
        assert logger.experiment.offline
    finally:
        logger.experiment.finish()
    assert "anonymous" not in capfd.readouterr().err
