"""Real storage servers for the tests, started by the tests themselves on 127.0.0.1.

Each server's endpoint and test credentials go into the environment, where s3fs and gcsfs find them, in this
process and in the ranks it starts.
"""

from __future__ import annotations

import copy
import os
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path

import fsspec
import pytest
import s3fs
import torch.distributed as dist
from fsspec import AbstractFileSystem
from gcsfs.core import GCSFileSystem

from multirank import free_port


@contextmanager
def _restored(names: Iterable[str]) -> Iterator[None]:
    """The environment variables ``names`` as they were before, once the block is done."""
    saved = {name: os.environ.get(name) for name in names}
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


@contextmanager
def _environment(variables: dict[str, str]) -> Iterator[None]:
    with _restored(variables):
        os.environ.update(variables)
        yield


# What Lightning's launcher sets in the process it launches from, and lightdist's share of the cores.
LAUNCH_VARIABLES = ("MASTER_ADDR", "MASTER_PORT", "NODE_RANK", "LOCAL_RANK", "WORLD_SIZE", "RANK", "OMP_NUM_THREADS")


@pytest.fixture(autouse=True)
def _process_left_as_found() -> Iterator[None]:
    """A test that trains in this process (``devices=1``) leaves what a later test's ``python train.py`` would
    inherit: LOCAL_RANK (its launcher then takes the processes as started by another and waits for a rank it never
    starts) and MASTER_PORT (a port this process's store still holds). A storage endpoint a strategy configured
    would outlive the server it named. Each test leaves the process as it found it. Its ranks' store gets a port
    ``free_port`` drew, which Lightning's launcher and ``python train.py`` take from MASTER_PORT, rather than one the
    kernel handed out and released, which another process's next socket may take first."""
    storage_defaults = copy.deepcopy(fsspec.config.conf)
    with _restored(LAUNCH_VARIABLES):
        os.environ["MASTER_PORT"] = str(free_port())
        yield
        if dist.is_initialized():
            dist.destroy_process_group()
    fsspec.config.conf.clear()
    fsspec.config.conf.update(storage_defaults)


@contextmanager
def _server(command: list[str], port: int, name: str) -> Iterator[str]:
    """Run ``command``, a server listening on 127.0.0.1:``port``; its URL once it accepts connections."""
    server = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 30
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            break
        except OSError:
            if time.monotonic() > deadline or server.poll() is not None:
                server.kill()
                raise RuntimeError(f"{name} did not start on 127.0.0.1:{port}") from None
            time.sleep(0.1)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.terminate()
        server.wait(timeout=10)


@pytest.fixture
def s3_endpoint() -> Iterator[str]:
    """moto's S3 server, stopped and its variables unset after the test."""
    port = free_port()
    command = [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)]
    credentials = {
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": f"lightdist-test-secret-{uuid.uuid4().hex}",  # moto takes any; tests look for it
        "AWS_DEFAULT_REGION": "us-east-1",
    }
    with (
        _server(command, port, "moto's S3 server") as endpoint,
        _environment({"AWS_ENDPOINT_URL": endpoint, "FSSPEC_S3_ENDPOINT_URL": endpoint, **credentials}),
    ):
        s3fs.S3FileSystem.clear_instance_cache()  # fsspec would hand out a filesystem of an earlier test's server
        yield endpoint


@pytest.fixture
def s3_bucket(s3_endpoint: str) -> tuple[str, AbstractFileSystem]:
    """A new, empty S3 bucket's URL, and a filesystem to look into it."""
    s3 = s3fs.S3FileSystem(endpoint_url=s3_endpoint, skip_instance_cache=True)
    name = f"lightdist-{uuid.uuid4().hex[:12]}"
    s3.mkdir(name)
    return f"s3://{name}", s3


@pytest.fixture
def gcs_bucket() -> Iterator[tuple[str, AbstractFileSystem]]:
    """A new, empty bucket on a GCS emulator (gcp-storage-emulator, see gcs_emulator.py), and a filesystem to look
    into it. gcsfs finds the emulator through STORAGE_EMULATOR_HOST, connects without credentials (token "anon"
    through fsspec's configuration, rather than after 16 s of looking for Google's), and must not ask the emulator
    for the bucket's layout over gRPC, which it cannot answer."""
    port = free_port()
    command = [sys.executable, str(Path(__file__).with_name("gcs_emulator.py")), str(port)]
    with (
        _server(command, port, "the GCS emulator") as endpoint,
        _environment(
            {
                "STORAGE_EMULATOR_HOST": endpoint,
                "GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT": "false",
                "FSSPEC_GCS_TOKEN": "anon",
            }
        ),
    ):
        # gcsfs.GCSFileSystem was chosen when gcsfs was imported, before the variable was set: the JSON API's own.
        GCSFileSystem.clear_instance_cache()  # fsspec would hand out a filesystem of an earlier test's emulator
        gcs = GCSFileSystem(token="anon", skip_instance_cache=True)
        name = f"lightdist-{uuid.uuid4().hex[:12]}"
        gcs.mkdir(name)
        yield f"gs://{name}", gcs


@pytest.fixture
def lighthouse() -> Iterator[str]:
    """A torchft lighthouse that replica groups meet at, its address. A lost group's heartbeat stops for 1 s before the
    survivors' next quorum leaves it out; a live group that is slow to ask (saving a checkpoint) is waited for up to a
    minute, not left out after torchft's default 100 ms."""
    from torchft.coordination import LighthouseServer

    server = LighthouseServer(bind="[::]:0", min_replicas=1, join_timeout_ms=60_000, heartbeat_timeout_ms=1_000)
    yield server.address()
    server.shutdown()
