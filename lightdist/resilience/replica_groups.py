"""Replica groups that survive each other: torchft's quorum each step, across separate launches.

Each replica group is a launch of its own (a torchrun, a node, a Ray worker group) holding any layout inside. Every
group loads the same global batch; each step the groups in torchft's quorum deal its rows among themselves, average
their gradients through torchft's fault-tolerant process group, and step the optimizer only where torchft commits
the step. A group that dies, or hangs past ``timeout``, is left out of the next quorum and the survivors redo the
step on the same global batch, in the same processes: no sample is lost or repeated, no checkpoint is read.

Why deal rows rather than give each group its own batches, as torchft's examples do: the global batch then does not
depend on how many groups are alive, so a run trains on exactly the batches the uninterrupted run trains on.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from datetime import timedelta
from typing import Any

import torch
from lightning_utilities.core.apply_func import apply_to_collection
from torch import Tensor

from lightdist.parallel.sharding import local_tensor

__all__ = ["ReplicaGroup", "ReplicaGroups", "StepNotCommitted"]

LIGHTHOUSE_VARIABLE = "TORCHFT_LIGHTHOUSE"  # torchft's own name for the lighthouse's address
GROUP_VARIABLE = "LIGHTDIST_REPLICA_GROUP"


class StepNotCommitted(RuntimeError):
    """A group failed during the step: the survivors redo it on the same global batch under the next quorum."""


@dataclass(frozen=True)
class ReplicaGroups:
    """Options of the replica groups a run trains in (``ParallelStrategy(replica_groups=...)``).

    Args:
        lighthouse: The torchft lighthouse every group meets at, e.g. ``"http://10.0.0.1:29510"``; default
            ``$TORCHFT_LIGHTHOUSE``.
        group: This launch's name, unique among the groups, e.g. ``"group-1"``; default ``$LIGHTDIST_REPLICA_GROUP``.
            A group started again under the same name takes the lost one's place.
        groups: The groups the run starts (or resumes) with: a group's first step waits until this many have joined
            (up to ``timeout``), so that none joins a run that has already stepped.
        min_groups: Steps commit only while at least this many groups are in the quorum.
        timeout: Seconds a collective across groups waits before the group it waits for counts as lost.
        quorum_timeout: Seconds a step's quorum waits for the lighthouse before it counts as lost, and every group
            stops with the way back (a whole-job restart from the newest checkpoint). Keep it above the lighthouse's
            ``--join_timeout_ms``, which a quorum may wait for a slow group.
    """

    lighthouse: str | None = None
    group: str | None = None
    groups: int = 1
    min_groups: int = 1
    timeout: float = 30.0
    quorum_timeout: float = 300.0

    def __post_init__(self) -> None:
        if type(self.groups) is not int or self.groups < 1:
            raise ValueError(f"replica_groups.groups={self.groups!r} must be a positive number of groups.")
        if type(self.min_groups) is not int or self.min_groups < 1:
            raise ValueError(f"replica_groups.min_groups={self.min_groups!r} must be a positive number of groups.")
        for name in ("timeout", "quorum_timeout"):
            seconds = getattr(self, name)
            if not isinstance(seconds, int | float) or seconds <= 0:
                raise ValueError(f"replica_groups.{name}={seconds!r} must be a positive number of seconds.")

    def resolved(self) -> ReplicaGroups:
        """These options with the lighthouse and group name from the environment where not given; refused where
        either is nowhere."""
        lighthouse = self.lighthouse or os.environ.get(LIGHTHOUSE_VARIABLE)
        group = self.group or os.environ.get(GROUP_VARIABLE)
        if not lighthouse:
            raise ValueError(
                f"replica_groups needs the torchft lighthouse's address: set replica_groups.lighthouse or "
                f"${LIGHTHOUSE_VARIABLE} (start one with `torchft_lighthouse --min_replicas 1 --bind [::]:29510`)."
            )
        if not group:
            raise ValueError(
                f"replica_groups needs this launch's group name, unique among the groups: set replica_groups.group "
                f"or ${GROUP_VARIABLE}, e.g. group-0 for the first launch."
            )
        return replace(self, lighthouse=lighthouse, group=group)


class ReplicaGroup:
    """This rank's place in its replica group: the quorum, its share of each global batch, and the gradients
    averaged with the same rank of every other group in the quorum (ranks of one layout hold the same shards)."""

    def __init__(
        self,
        options: ReplicaGroups,
        rank: int,
        size: int,
        device: torch.device,
        live_state: Callable[[], Any],
        heal: Callable[[Any], None],
    ) -> None:
        """``live_state``: what the same rank of a group that joins receives from this one; ``heal``: takes that in
        place of this rank's own, where this group joins a run that has stepped."""
        from torchft import Manager, ProcessGroupGloo, ProcessGroupNCCL

        options = options.resolved()
        timeout = timedelta(seconds=options.timeout)
        self._across = ProcessGroupNCCL(timeout=timeout) if device.type == "cuda" else ProcessGroupGloo(timeout=timeout)
        self.manager = Manager(
            pg=self._across,
            load_state_dict=self._heal,
            state_dict=live_state,
            min_replica_size=options.min_groups,
            use_async_quorum=False,  # the quorum decides the step's share of the batch before the forward
            timeout=timeout,  # a collective or commit across groups
            # The lighthouse decides when a group that stopped asking is left out (its join timeout): the quorum
            # gives up only on the lighthouse itself.
            quorum_timeout=timedelta(seconds=options.quorum_timeout),
            connect_timeout=timeout,
            rank=rank,
            world_size=size,
            lighthouse_addr=options.lighthouse,
            replica_id=options.group,
            init_sync=False,  # every group starts from the same seed, or from the same checkpoint
        )
        self.options = options
        self._take_live_state = heal
        self._joining = False
        self._weight = 1.0  # this group's rows of the global batch, times the groups in the quorum, over all rows
        self.rows = 0  # of the step's batch, this group's share
        self.groups_in_step = 1  # in the step's quorum
        # Whether each group's share weighs by its rows; not where the steps' losses carry their share of the global
        # batch's labelled tokens themselves (plugins/token_weights.py)
        self.weigh_rows = True
        self.place: int | None = None  # this group's in the step's quorum; None: left out of it
        self._in_quorum = False  # once the group's first step began
        self._joined_for_next_step = False  # the quorum the group joined in serves its first step
        self.steps_redone = 0
        self.joined_at = 0  # the step this group joined the run at: 0, or where the others stood

    def join(self) -> None:
        """Take this group's first quorum: in a run that has not stepped yet, once every group it starts with has
        joined; in one that has, healing from a live group (``heal``) before it returns. That quorum is the one of
        the group's first step, which the others are about to take."""
        self._joining = True
        self._start_quorum()
        deadline = time.monotonic() + self.options.timeout
        while self.manager.current_step() == 0 and self.manager.num_participants() < self.options.groups:
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"lightdist: {self.manager.num_participants()} of replica_groups.groups={self.options.groups} "
                    f"groups joined at {self.options.lighthouse} within {self.options.timeout:.0f} s: start the "
                    "others, or lower groups to those that will start."
                )
            time.sleep(0.05)
            self._start_quorum()
        self._joining, self._joined_for_next_step = False, True
        self.joined_at = self.manager.current_step()

    def start_step(self) -> None:
        """Take the step's quorum: the groups alive now share its batch."""
        # From the first step on, what the groups log spans them all; before it, a group that joins a run under way
        # reduces within itself while it sets up, and would otherwise meet the others' collectives of their step.
        self._in_quorum = True
        if self._joined_for_next_step:
            self._joined_for_next_step = False
            return
        self._start_quorum()

    def _start_quorum(self) -> None:
        try:
            self.manager.start_quorum()
        except TimeoutError as error:
            raise RuntimeError(
                f"lightdist: no quorum from the lighthouse at {self.options.lighthouse} within "
                f"replica_groups.quorum_timeout={self.options.quorum_timeout:g} s: it is lost or unreachable. Start a "
                "lighthouse again, then every group with ckpt_path='last': the run resumes from its newest complete "
                "checkpoint. (A quorum_timeout above the lighthouse's --join_timeout_ms keeps a slow group from "
                "looking like a lost lighthouse.)"
            ) from error

    def deal(self, batch: Any) -> Any:
        """This group's rows of the global batch ``batch`` (a tensor, or a tuple, list or dict of tensors of as many
        rows), by its place in the quorum."""
        rows = {tensor.shape[0] for tensor in _tensors(batch)}
        if len(rows) != 1:
            raise ValueError(
                f"replica groups deal each batch's rows among the groups, but this batch's tensors have "
                f"{sorted(rows)} rows: give every tensor of a batch one row per sample."
            )
        (total,) = rows
        place, groups = self.manager.participating_rank(), self.manager.num_participants()
        self.place = place
        if place is None:  # not in this step's quorum: its gradients count for nothing
            self._weight, self.rows = 0.0, 0
            return batch
        start, stop = total * place // groups, total * (place + 1) // groups
        self.rows, self.groups_in_step = stop - start, groups
        self._weight = self.rows * groups / total if self.weigh_rows else 1.0
        return apply_to_collection(batch, Tensor, lambda tensor: tensor[start:stop])

    def average(self, tensor: Tensor) -> Tensor:
        """The mean over the global batch of a mean over this group's rows (a loss, a logged metric); the group's own
        where a group failed during the step, which is then redone."""
        if not self._in_quorum:
            return tensor
        weighted = tensor.detach().float() * self._weight
        self.manager.allreduce(weighted).wait()
        return tensor if self.manager.errored() else weighted.to(tensor.dtype)

    def sum(self, tensor: Tensor) -> Tensor:
        """The sum over every group of a sum over this group's rows."""
        if not self._in_quorum:
            return tensor
        total = tensor.detach().clone()
        self.manager.allreduce(total, reduce_op=torch.distributed.ReduceOp.SUM).wait()
        return tensor if self.manager.errored() else total

    def average_gradients(self, parameters: list[torch.nn.Parameter]) -> None:
        """Average this rank's gradient shards with the same rank of every group in the quorum, weighted by each
        group's rows; raises ``StepNotCommitted`` unless torchft commits the step, before the optimizer steps."""
        grads = [local_tensor(p.grad) for p in parameters if p.grad is not None]
        by_dtype: dict[torch.dtype, list[Tensor]] = {}
        for grad in grads:
            by_dtype.setdefault(grad.dtype, []).append(grad)
        flats = {dtype: torch.cat([g.reshape(-1) for g in group]) * self._weight for dtype, group in by_dtype.items()}
        for work in [self.manager.allreduce(flat) for flat in flats.values()]:
            work.wait()
        if self.manager.errored():
            # Close this rank's connections at once: a peer still waiting on them fails now, not after the timeout,
            # and joins the next quorum, which builds the process group anew.
            self._across.abort()
        if not self.manager.should_commit():
            self.steps_redone += 1
            raise StepNotCommitted(f"a replica group failed during step {self.manager.current_step()}")
        for dtype, flat in flats.items():
            offset = 0
            for grad in by_dtype[dtype]:
                grad.copy_(flat[offset : offset + grad.numel()].view_as(grad))
                offset += grad.numel()

    def _heal(self, live_state: Any) -> None:
        if not self._joining:
            raise RuntimeError(
                f"lightdist: replica group {self.options.group} fell behind the others (left out of a quorum while "
                "it was slow, past the lighthouse's join timeout) and cannot take their state in the middle of its "
                "run. Start it again: it rejoins with the live state. A longer --join_timeout_ms keeps slow groups in."
            )
        self._take_live_state(live_state)

    def shutdown(self) -> None:
        self.manager.shutdown(wait=False)


def _tensors(batch: Any) -> list[Tensor]:
    found: list[Tensor] = []
    apply_to_collection(batch, Tensor, found.append)
    return found
