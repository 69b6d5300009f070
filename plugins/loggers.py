"""Weights & Biases logging that goes offline on its own where it cannot log online, instead of stopping the run.

Lightning's ``WandbLogger`` logs online unless told otherwise, and ``wandb.init`` then fails without an API key, or
waits out its timeouts without a network. A training job should not die of its logger: it trains, logs to the run's
directory, and the run is uploaded later with ``wandb sync``.
"""

from __future__ import annotations

import netrc
import os
import socket
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from lightning.pytorch.loggers import WandbLogger as LightningWandbLogger
from lightning.pytorch.utilities.rank_zero import rank_zero_warn

from lightdist.quiet import verbose

__all__ = ["WandbLogger", "why_wandb_cannot_log_online"]

_DEFAULT_HOST = "https://api.wandb.ai"
_MODES = ("online", "offline", "shared", "disabled", "dryrun", "run")
_NOT_IN_PROJECT_NAMES = "/\\#?%:"


class WandbLogger(LightningWandbLogger):
    """Lightning's ``WandbLogger``, with ``offline=None`` (the default) meaning: online where an API key is set and
    the W&B server answers, else offline, saying why once. ``offline=True`` or ``False``, or ``WANDB_MODE`` in the
    environment, decide as they do for Lightning's. Every other argument is Lightning's."""

    def __init__(
        self,
        *,
        offline: bool | None = None,
        save_dir: str | os.PathLike = ".",
        log_model: bool | str = False,
        **kwargs: Any,
    ) -> None:
        _check_settings(kwargs.get("project"), save_dir)
        if offline is None:
            reason = None if "WANDB_MODE" in os.environ else why_wandb_cannot_log_online()
            offline = reason is not None
            if reason is not None:
                wandb_dir = Path(save_dir or kwargs.get("dir") or ".") / "wandb"
                dropped = f" Checkpoints are not uploaded as artifacts (log_model={log_model})." if log_model else ""
                rank_zero_warn(
                    f"lightdist: W&B logs offline to {wandb_dir}, because {reason}.{dropped} Upload the run later"
                    f" with `wandb sync {wandb_dir}/offline-run-*`, or set WANDB_MODE=offline to skip this check."
                )
                log_model = False
        if not verbose():
            # W&B's own lines (its version, where the run is saved, its hints) say what the run's header says.
            os.environ.setdefault("WANDB_SILENT", "true")
        super().__init__(offline=offline, save_dir=save_dir, log_model=log_model, **kwargs)
        if "anonymous" in self._wandb_init and self._wandb_init["anonymous"] is None:
            del self._wandb_init["anonymous"]  # wandb warns that the setting, even None, does nothing
        self._runs_offline = offline

    @property
    def offline(self) -> bool:
        """Whether the run logs to its directory only, to be uploaded later with ``wandb sync``."""
        return self._runs_offline


def _check_settings(project: str | None, save_dir: str | os.PathLike | None) -> None:
    """What W&B would refuse only when the first metric is logged, after the model has taken its memory."""
    mode = os.environ.get("WANDB_MODE")
    if mode is not None and mode not in _MODES:
        raise ValueError(
            f"WANDB_MODE={mode!r} is not a W&B mode: set one of {', '.join(_MODES)}, or unset it and lightdist logs "
            "online where it can and offline where it cannot."
        )
    found = sorted(set(project or "") & set(_NOT_IN_PROJECT_NAMES))
    if found:
        raise ValueError(
            f"project={project!r} contains {' '.join(found)}, which W&B refuses in project names. Name the project "
            "with letters, digits, '-', '_' and '.'; the team goes in `entity`."
        )
    url = os.environ.get("WANDB_BASE_URL")
    if url is not None and not (urlsplit(url).scheme in ("http", "https") and urlsplit(url).hostname):
        raise ValueError(f"WANDB_BASE_URL={url!r} is not a server URL: set it like https://api.wandb.ai, or unset it.")
    if save_dir is not None and Path(save_dir).exists() and not Path(save_dir).is_dir():
        raise ValueError(f"save_dir={str(save_dir)!r} is a file: W&B writes the run's files into a directory there.")


def why_wandb_cannot_log_online(timeout: float = 3.0) -> str | None:
    """Why W&B cannot log online from this machine, or ``None`` where it can: no API key (``WANDB_API_KEY``, an
    identity token file, or ``wandb login``'s entry in ``~/.netrc``), or a server that does not answer."""
    url = os.environ.get("WANDB_BASE_URL", _DEFAULT_HOST)
    host = urlsplit(url)
    has_key = os.environ.get("WANDB_API_KEY") or os.environ.get("WANDB_IDENTITY_TOKEN_FILE")
    if not (has_key or _netrc_has(host.hostname)):
        return "no API key is set (set WANDB_API_KEY, or run `wandb login`)"
    port = host.port or (443 if host.scheme == "https" else 80)
    try:
        socket.create_connection((host.hostname, port), timeout=timeout).close()
    except OSError as error:
        return f"the W&B server {url} cannot be reached ({error})"
    return None


def _netrc_has(hostname: str | None) -> bool:
    path = Path(os.environ.get("NETRC", Path.home() / ".netrc"))
    try:
        return hostname is not None and netrc.netrc(path).authenticators(hostname) is not None
    except (OSError, netrc.NetrcParseError):
        return False
