"""The parallel layout: how many ranks go to each dimension, and the DeviceMesh built from it.

Mesh dims are ``("pp", "dp", "tp")``: tensor parallel innermost (neighbouring ranks, the fastest links inside a
node), pipeline outermost. Sub-meshes are always taken by name, never by position; Lightning's names for two of them
(``"data_parallel"``, ``"tensor_parallel"``) answer too.

Under context parallelism ``"dp"`` holds each data-parallel rank's context-parallel peers beside it: they are the
ranks that reduce gradients together, over which FSDP shards (torchtitan's ``dp_shard_cp``);
``lightdist.parallel.context.split.context_mesh`` names them apart.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Literal

import torch
from torch.distributed.device_mesh import DeviceMesh

__all__ = ["MESH_DIM_NAMES", "ParallelLayout", "ParallelMesh"]

MESH_DIM_NAMES = ("pp", "dp", "tp")


class ParallelMesh(DeviceMesh):
    """The ``("pp", "dp", "tp")`` mesh, whose sub-meshes also go by the names Lightning's ``ModelParallelStrategy``
    gives them: a ``configure_model`` written for it (``self.device_mesh["tensor_parallel"]``) runs unchanged, on the
    very process groups lightdist uses."""

    LIGHTNING_NAMES: ClassVar[dict[str, str]] = {"data_parallel": "dp", "tensor_parallel": "tp"}

    def __getitem__(self, names: str | tuple[str, ...]) -> DeviceMesh:
        if isinstance(names, str):
            return super().__getitem__(self.LIGHTNING_NAMES.get(names, names))
        return super().__getitem__(tuple(self.LIGHTNING_NAMES.get(name, name) for name in names))


@dataclass(frozen=True)
class ParallelLayout:
    """Degrees of pipeline, data, tensor and context parallelism; their product is the world size."""

    pp: int
    dp: int
    tp: int
    cp: int = 1

    @classmethod
    def resolve(
        cls,
        world_size: int,
        *,
        data_parallel_size: int | Literal["auto"],
        tensor_parallel_size: int,
        pipeline_parallel_size: int,
        world_from: str,
        context_parallel_size: int = 1,
    ) -> ParallelLayout:
        """Fill in ``"auto"`` and check that the degrees multiply to ``world_size``, which ``world_from`` sets.

        Called before any process group or parameter exists, so a wrong layout costs nothing.
        """
        model_parallel = tensor_parallel_size * pipeline_parallel_size * context_parallel_size
        context = f" x context_parallel_size={context_parallel_size}" if context_parallel_size > 1 else ""
        if data_parallel_size == "auto":
            if world_size % model_parallel:
                raise ValueError(
                    f"world size {world_size} is not divisible by tensor_parallel_size={tensor_parallel_size} x "
                    f"pipeline_parallel_size={pipeline_parallel_size}{context} = {model_parallel}, so "
                    f"data_parallel_size='auto' has no whole value. Change {world_from} or the tensor/pipeline"
                    f"{'/context' if context else ''} sizes."
                )
            data_parallel_size = world_size // model_parallel
        layout = cls(
            pp=pipeline_parallel_size, dp=data_parallel_size, tp=tensor_parallel_size, cp=context_parallel_size
        )
        if layout.world_size != world_size:
            raise ValueError(
                f"pipeline_parallel_size={layout.pp} x data_parallel_size={layout.dp} x "
                f"tensor_parallel_size={layout.tp}{context} = {layout.world_size}, but the world size is {world_size} "
                f"({world_from}). Make the product equal the world size, or set data_parallel_size='auto'."
            )
        return layout

    @property
    def world_size(self) -> int:
        return self.pp * self.dp * self.cp * self.tp

    def build_mesh(self, device_type: str) -> ParallelMesh:
        ranks = torch.arange(self.world_size, dtype=torch.int, device="cpu").view(self.pp, self.dp * self.cp, self.tp)
        return ParallelMesh(device_type, ranks, mesh_dim_names=MESH_DIM_NAMES)

    def __str__(self) -> str:
        context = f" x cp={self.cp}" if self.cp > 1 else ""
        return f"pp={self.pp} x dp={self.dp}{context} x tp={self.tp}"
