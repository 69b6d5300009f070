"""Run a function on several CPU processes that form one gloo process group, the way torchrun would start them.

Each rank gets the environment a launcher sets (``MASTER_ADDR``, ``RANK``, ``LOCAL_RANK``, ...), so Lightning sees
processes created externally and launches nothing itself.
"""

from __future__ import annotations

import contextlib
import faulthandler
import io
import multiprocessing as mp
import os
import queue
import random
import signal
import socket
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from multiprocessing import forkserver, reduction
from pathlib import Path
from typing import Any
from unittest import mock

import fsspec.config
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

from lightdist.parallel.structure import find_decoder_stack
from lightdist.parallel.tensor import apply_tensor_parallel, discover_plan

__all__ = ["free_port", "processes_left", "raised", "run_each", "run_ranks", "run_ranks_beside", "split_over_two_ranks"]


def free_port() -> int:
    """A port nothing listens on, for a server a test starts next, drawn below the kernel's ephemeral range: a port
    the kernel handed out (a bind to port 0) is free only until released, and the next connection or gloo socket of
    any process may take it before the server binds it (one CI run: EADDRINUSE on rank 0's store). Each pytest-xdist
    worker draws from its own share of the range, so two workers never draw the same port."""
    ephemeral = Path("/proc/sys/net/ipv4/ip_local_port_range")
    first_ephemeral = int(ephemeral.read_text().split()[0]) if ephemeral.exists() else 32768
    worker = int(os.environ.get("PYTEST_XDIST_WORKER", "gw0").removeprefix("gw"))
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    share = (first_ephemeral - 10000) // workers
    low = 10000 + worker * share
    for port in random.SystemRandom().sample(range(low, low + share), 100):
        with socket.socket() as sock, contextlib.suppress(OSError):
            sock.bind(("", port))
            return port
    raise RuntimeError(f"no port free among 100 drawn from {low} to {low + share - 1}")


def processes_left(variable: str, value: str, grace_s: float = 5) -> list[str]:
    """The command lines of the processes with ``variable=value`` in their environment still running after
    ``grace_s``: what a job, marked so, left behind."""
    deadline = time.monotonic() + grace_s
    while True:
        left = []
        for environ in Path("/proc").glob("[0-9]*/environ"):
            with contextlib.suppress(OSError):
                if f"{variable}={value}".encode() in environ.read_bytes().split(b"\0"):
                    left.append((environ.parent / "cmdline").read_bytes().replace(b"\0", b" ").decode())
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.2)


# Ranks fork from a server that imported torch, Lightning, transformers and lightdist once, where a spawned rank
# imports them itself: seconds of the two cores for each of the suite's hundreds of ranks. The server runs one OpenMP
# thread, as every rank does (torch starts a pool of them at import, which a fork would leave half copied); a rank
# takes its caller's environment, standard output and error at its start, as a spawned one inherits them.
_FORKED = mp.get_context("forkserver")
_FORKED.set_forkserver_preload(["torch", "lightning.pytorch", "transformers", "lightdist.plugins", "training", "zoo"])
_STANDARD_STREAMS = (1, 2)


_SERVER_START = threading.Lock()  # ranks start from two threads: a group, and the references beside it


def _start_fork_server() -> None:
    with _SERVER_START, mock.patch.dict(os.environ, OMP_NUM_THREADS="1"):
        forkserver.ensure_running()


def _rank_main(
    rank: int, world_size: int, port: int, caller: tuple[dict, list], fn: Callable, args: tuple, results: Any
) -> None:
    os.setsid()  # a process group of its own, so that ending the rank ends the checkpoint daemon it starts too
    environ, streams = caller
    for fd, stream in zip(_STANDARD_STREAMS, streams, strict=True):
        given = stream.detach()
        os.dup2(given, fd)
        os.close(given)
    os.environ.clear()
    os.environ.update(environ)
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        WORLD_SIZE=str(world_size),
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        NODE_RANK="0",
    )
    # fsspec reads its FSSPEC_ variables as it is imported: the server imported it in the environment of the test that
    # started it, whose storage endpoint has since stopped. Read the caller's, as a started process does.
    fsspec.config.conf.clear()
    fsspec.config.set_conf_files(fsspec.config.conf_dir, fsspec.config.conf)
    fsspec.config.set_conf_env(fsspec.config.conf)
    # Two cores, up to eight ranks: one thread each keeps them from fighting over the cores.
    torch.set_num_threads(1)
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # where a rank is stuck, printed when run_ranks gives up
    faulthandler.enable(all_threads=True)  # where a rank crashed (SIGSEGV), printed before it dies
    try:
        # Results travel as bytes: tensors sent as shared memory would vanish when this process exits.
        buffer = io.BytesIO()
        torch.save(fn(*args), buffer)
        results.put((rank, buffer.getvalue(), None))
    except BaseException:
        results.put((rank, None, traceback.format_exc()))
        raise
    # The result is out: leave without the interpreter's teardown, where gloo's and torch's threads, destroyed in no
    # particular order, now and then abort the process ("terminate called without an active exception").
    results.close()
    results.join_thread()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def run_ranks(world_size: int, fn: Callable, *args: Any, timeout: float = 300.0, fresh: bool = False) -> list[Any]:
    """``fn(*args)`` on ``world_size`` ranks; returns each rank's result in rank order, or raises a rank's error, or
    names the rank that was killed (as a launcher would see it, when a rank dies without a word).

    ``fn`` must be importable (defined at module level): ranks receive it by name. ``fresh``: each rank started as a
    new program, for settings read only as a process starts (glibc's ``MALLOC_`` variables).
    """
    ctx = mp.get_context("spawn") if fresh else _FORKED
    if not fresh:
        _start_fork_server()
    results = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(
            target=_rank_main,
            args=(rank, world_size, port, _caller(), fn, args, results),
            daemon=False,
        )
        for rank in range(world_size)
    ]
    for proc in procs:
        proc.start()
    outputs: dict[int, Any] = {}
    errors: list[str] = []
    deadline = time.monotonic() + timeout
    try:
        while len(outputs) < world_size and not errors and not _killed(procs):
            try:
                rank, value, error = results.get(timeout=1)
            except queue.Empty:
                if time.monotonic() > deadline:
                    _print_stacks(procs)
                    errors.append(f"no result from every rank within {timeout:.0f} s; their stacks are on stderr")
                continue
            if error is not None:
                errors.append(f"rank {rank}:\n{error}")
            else:
                outputs[rank] = torch.load(io.BytesIO(value), weights_only=False)
    finally:
        failed = len(outputs) < world_size
        for proc in procs:
            proc.join(timeout=5 if failed else 60)
        errors = _killed(procs) + errors
        for proc in procs:
            with contextlib.suppress(ProcessLookupError):  # the rank, if alive, and its checkpoint daemon
                os.killpg(proc.pid, signal.SIGKILL)
            proc.join()
    if errors:
        raise RuntimeError("\n".join(errors))
    return [outputs[rank] for rank in range(world_size)]


def _caller() -> tuple[dict, list]:
    """This process's environment and its standard output and error, for a rank to take as its own."""
    return dict(os.environ), [reduction.DupFd(fd) for fd in _STANDARD_STREAMS]


_BESIDE = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ranks-beside")


def run_ranks_beside(world_size: int, fn: Callable, *args: Any, timeout: float = 300.0) -> Future[list[Any]]:
    """``run_ranks`` started in the background, its results (or error) in the future it returns: a single-process
    reference trains on the core that a group of ranks leaves idle while its ranks wait for each other (a whole
    equivalence suite's references hide behind its first group)."""
    return _BESIDE.submit(run_ranks, world_size, fn, *args, timeout=timeout)


def _print_stacks(procs: list[mp.Process]) -> None:
    """Each live rank prints every thread's stack to stderr, which pytest shows with the failure; one at a time."""
    for rank, proc in enumerate(procs):
        if proc.is_alive():
            print(f"rank {rank}, stuck:", file=sys.stderr, flush=True)
            with contextlib.suppress(ProcessLookupError):
                os.kill(proc.pid, signal.SIGUSR1)
            time.sleep(0.5)


def _killed(procs: list[mp.Process]) -> list[str]:
    """The ranks that a signal ended: they could not say so themselves."""
    return [
        f"rank {rank} was killed by {signal.Signals(-proc.exitcode).name}"
        for rank, proc in enumerate(procs)
        if proc.exitcode is not None and proc.exitcode < 0
    ]


def run_each(calls: list[tuple[Callable, tuple]]) -> list[Any]:
    """Each ``fn(*args)`` in turn, in the same ranks: for ``run_ranks``, where starting the ranks is the slow part.

    The process group the first call's Trainer creates serves every later one."""
    return [fn(*args) for fn, args in calls]


def raised(fn: Callable, *args: Any) -> str:
    """What ``fn(*args)`` raised, as "Type: message": errors to check beside other calls of ``run_each``."""
    try:
        fn(*args)
    except Exception as error:
        return f"{type(error).__name__}: {error}"
    raise AssertionError(f"{fn.__name__}{args} raised nothing")


@contextmanager
def split_over_two_ranks(
    model: nn.Module, *, sequence_parallel: bool, tp_plan: dict | None = None, layouts: dict | None = None
) -> Iterator[nn.Module]:
    """``model`` tensor parallel over this rank and one other, in the running gloo group or one that ends with the
    block; its units run fast, or as ``layouts`` names them."""
    starts_group = not dist.is_initialized()
    if starts_group:
        dist.init_process_group("gloo")
    try:
        stack = find_decoder_stack(model)
        mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
        plan = discover_plan(model, stack, tp_plan=tp_plan)
        apply_tensor_parallel(model, stack, mesh, plan=plan, layouts=layouts, sequence_parallel=sequence_parallel)
        yield model
    finally:
        if starts_group:
            dist.destroy_process_group()
