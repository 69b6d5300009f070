"""What the benchmarks share: CPU ranks started the way torchrun would (one process per rank, one gloo group), and
an S3 server on this machine."""

from __future__ import annotations

import contextlib
import os
import random
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager

import torch

__all__ = ["free_port", "join_ranks", "local_s3", "moto_server", "s3_bucket"]


def free_port() -> int:
    """A port nothing listens on, drawn below the kernel's ephemeral range (which starts at 32768 by default): a port
    the kernel handed out (a bind to port 0) is free only until released, and any process's next socket may take it
    before the ranks' store binds it."""
    for port in random.SystemRandom().sample(range(10000, 32768), 100):
        with socket.socket() as sock, contextlib.suppress(OSError):
            sock.bind(("", port))
            return port
    raise RuntimeError("no port free among 100 drawn between 10000 and 32767")


def join_ranks(rank: int, world_size: int, port: int) -> None:
    """The environment a launcher gives ``rank``, so that Lightning joins the group rather than start one; one thread
    each, so that ranks sharing a machine's cores do not fight over them."""
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE=str(world_size), RANK=str(rank), LOCAL_RANK=str(rank)
    )
    torch.set_num_threads(1)


@contextmanager
def moto_server() -> Iterator[str]:
    """moto's S3 server on 127.0.0.1, in its own process so that it never competes for this one's GIL; yields its
    endpoint once it accepts connections, and stops it after."""
    port = free_port()
    server = subprocess.Popen(
        [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                if time.monotonic() > deadline or server.poll() is not None:
                    raise RuntimeError(f"moto's S3 server did not start on 127.0.0.1:{port}") from None
                time.sleep(0.1)
        yield f"http://127.0.0.1:{port}"
    finally:
        server.terminate()
        server.wait(timeout=30)


def s3_bucket(endpoint: str, bucket: str) -> str:
    """A new ``bucket`` at ``endpoint``; its URL. The endpoint and test credentials go into the environment, where
    s3fs finds them in this process and in those it starts (ranks, DCP's upload process)."""
    os.environ.update(AWS_ENDPOINT_URL=endpoint, FSSPEC_S3_ENDPOINT_URL=endpoint)
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
        os.environ.setdefault(name, "testing")
    os.environ.setdefault("AWS_DEFAULT_REGION", "us-east-1")
    import s3fs  # here, so that a benchmark run without S3 needs no s3fs (the GPU machine has none)

    s3fs.S3FileSystem(endpoint_url=endpoint, skip_instance_cache=True).mkdir(bucket)
    return f"s3://{bucket}"


@contextmanager
def local_s3(bucket: str) -> Iterator[str]:
    """moto's S3 server holding an empty ``bucket``; yields the bucket's URL."""
    with moto_server() as endpoint:
        yield s3_bucket(endpoint, bucket)
