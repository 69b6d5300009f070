"""Restarts under torchrun: each attempt's ranks meet in keys of their own.

torchrun's elastic agent keeps one TCPStore alive across restarts and hands it to the ranks it starts
(``TORCHELASTIC_USE_AGENT_STORE``). torch prefixes the default process group's keys with the group's name only, and
names every new group (DeviceMesh's dimensions among them) the same on every attempt. So a restarted rank reads the
address a killed rank published on the previous attempt and fails to connect (gloo: "Connection refused" in
``connectFullMesh``; NCCL: a stale unique id), unless the keys of each attempt are kept apart.
"""

from __future__ import annotations

import os
from datetime import timedelta

from torch.distributed import PrefixStore, Store, TCPStore

__all__ = ["restart_attempt_store"]


def restart_attempt_store(timeout: timedelta) -> Store | None:
    """The agent's store with this attempt's prefix (``TORCHELASTIC_RESTART_COUNT``) where torchrun's agent shares its
    store with the ranks; ``None`` elsewhere, where torch's own rendezvous is right."""
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT")
    if attempt is None or os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != str(True):
        return None
    agent_store = TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False, timeout=timeout)
    return PrefixStore(f"lightdist/attempt_{attempt}", agent_store)
