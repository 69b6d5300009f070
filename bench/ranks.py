"""Starting a benchmark's CPU ranks the way torchrun would: one process per rank, one gloo group."""

from __future__ import annotations

import os
import socket

import torch

__all__ = ["free_port", "join_ranks"]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def join_ranks(rank: int, world_size: int, port: int) -> None:
    """The environment a launcher gives ``rank``, so that Lightning joins the group rather than start one; one thread
    each, so that ranks sharing a machine's cores do not fight over them."""
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE=str(world_size), RANK=str(rank), LOCAL_RANK=str(rank)
    )
    torch.set_num_threads(1)
