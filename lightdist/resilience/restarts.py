"""Restarts under torchrun: each round of ranks meets in a store of its own, and trains on the nodes it has.

torchrun's elastic agent serves one TCPStore to the ranks of every round it starts (``TORCHELASTIC_USE_AGENT_STORE``),
and torch names a process group's keys after the group only, the same in every round. A restarted rank then reads the
address a killed rank published in the previous round and fails to connect (gloo: "Connection refused" in
``connectFullMesh``; NCCL: a stale unique id). Prefixing the keys with ``TORCHELASTIC_RESTART_COUNT`` is not enough
across nodes: an agent whose ranks were healthy restarts them for a membership change without counting a restart, so
two nodes can disagree on the count. So rank 0 of each round serves a fresh store, as torch itself does under
``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``, and publishes its port with a random token in the agent's store. A rank that
reads the previous round's entry finds that server gone (its rank 0 ended with the round) or holding another token,
and reads again.
"""

from __future__ import annotations

import os
import secrets
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

from torch.distributed import Store, TCPStore

__all__ = ["nodes_started_by_torchrun", "round_store"]

_ENTRY = "lightdist/round_store"  # in the agent's store: "PORT TOKEN" of the newest round's store
_TOKEN = "lightdist/round_token"  # in the round's store: the same TOKEN
_CONNECT_TIMEOUT = timedelta(seconds=2)


def round_store(rank: int, timeout: timedelta) -> Store | None:
    """A store that only this round's ranks use, where torchrun's agent shares its own store with the ranks;
    ``None`` elsewhere, where torch's rendezvous makes a fresh store each time."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != str(True):
        return None
    host = os.environ["MASTER_ADDR"]  # the node of rank 0: torchrun gives global rank 0 to the agent it elected
    agent_store = TCPStore(host, int(os.environ["MASTER_PORT"]), is_master=False, timeout=timeout)
    if rank == 0:
        store = TCPStore(host, 0, is_master=True, timeout=timeout)
        token = secrets.token_hex(16)
        store.set(_TOKEN, token)
        agent_store.set(_ENTRY, f"{store.port} {token}")
        return store
    deadline = time.monotonic() + timeout.total_seconds()
    while time.monotonic() < deadline:
        port, token = agent_store.get(_ENTRY).decode().split()  # blocks until a rank 0 has published
        try:
            store = TCPStore(host, int(port), is_master=False, timeout=_CONNECT_TIMEOUT)
            if store.get(_TOKEN).decode() == token:
                store.set_timeout(timeout)
                return store
        except RuntimeError:  # the previous round's server, gone; DistNetworkError and DistStoreError are both
            pass
        time.sleep(0.2)
    raise TimeoutError(
        f"Rank {rank} waited {timeout.total_seconds():.0f} s for rank 0 of this torchrun round to publish its store "
        f"in the agent's store at {host}:{os.environ['MASTER_PORT']}. Check that rank 0 started (its log), or raise "
        "the strategy's collective_timeout."
    )


def nodes_started_by_torchrun(configured: int, report: Callable[[str], Any] = print) -> int:
    """The nodes torchrun's agents brought to this round; ``report`` says so where they differ from ``configured``.

    Under ``--nnodes=MIN:MAX`` the agents decide how many nodes train, round by round: a lost node restarts the job on
    the others. ``Trainer(num_nodes=...)`` is then what the user expected, and Lightning's check of it against the
    world size would refuse the smaller round."""
    if "GROUP_WORLD_SIZE" not in os.environ:  # a launcher that sets torchrun's variables, but not this one
        return configured
    started = int(os.environ["GROUP_WORLD_SIZE"])
    if started != configured:
        report(f"torchrun started {started} node(s) for this round: training on them, not on {configured}.")
    return started
