"""What the benchmarks share: CPU ranks started the way torchrun would (one process per rank, one gloo group), and
an S3 server on this machine."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager

import torch

__all__ = ["free_port", "join_ranks", "local_s3"]


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


@contextmanager
def local_s3(bucket: str) -> Iterator[str]:
    """moto's S3 server on 127.0.0.1 holding an empty ``bucket``, s3fs pointed at it through the environment (which
    the ranks inherit); yields the bucket's URL, and stops the server after."""
    import s3fs

    port = free_port()
    endpoint = f"http://127.0.0.1:{port}"
    server = subprocess.Popen(
        [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    os.environ.update(
        AWS_ENDPOINT_URL=endpoint,
        FSSPEC_S3_ENDPOINT_URL=endpoint,
        AWS_ACCESS_KEY_ID="bench",
        AWS_SECRET_ACCESS_KEY="bench",
        AWS_DEFAULT_REGION="us-east-1",
    )
    try:
        for _ in range(100):
            try:
                s3fs.S3FileSystem(endpoint_url=endpoint, skip_instance_cache=True).mkdir(bucket)
                break
            except Exception:
                time.sleep(0.1)
        yield f"s3://{bucket}"
    finally:
        server.terminate()
