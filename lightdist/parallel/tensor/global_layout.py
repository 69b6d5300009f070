"""The global layout: a unit's own code run on DTensors of the unsplit shapes, torch's sharding propagation placing
each op. For attention that reshapes with sizes from its input, which per-rank shapes cannot serve; any code of torch
ops is right this way, at the cost of DTensor's dispatch.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable

import torch
from lightning_utilities.core.apply_func import apply_to_collection
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import (
    DTensor,
    Replicate,
)
from torch.distributed.tensor.experimental import implicit_replication
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.overrides import TorchFunctionMode

from lightdist.dataflow import tensors_in
from lightdist.parallel.kv_cache import without_kv_cache
from lightdist.parallel.tensor.styles import is_local

__all__ = ["run_on_global_shapes"]


def run_on_global_shapes(module: nn.Module, tp_mesh: DeviceMesh) -> None:
    """Run ``module``'s own forward on DTensors: the tensors it is given (rotary tables, masks; not integer positions,
    which index), and those it makes that meet a DTensor (nanoGPT's causal mask, sliced from a buffer), become
    replicated DTensors, so that backward meets DTensors too (``masked_fill``'s gradient is masked by the same
    mask). On CPU, attention takes SDPA's math kernel: torch places DTensor ops for the fused CPU kernel nowhere.
    A key/value cache is not passed on: a training step never reads it back, and its plain tensors cannot take the
    DTensor keys (Hugging Face models build one on every forward unless ``use_cache=False``).

    A caller given no DTensor (without sequence parallelism) gets plain tensors back, as the fast layout gives it: each
    replicated output becomes its local copy, a tensor of its own for residual code that adds into it in place. An
    output split across the ranks (BLOOM's attention probabilities, split by head) stays a DTensor rather than cost an
    all-gather on every call."""
    forward = module.forward
    on_cpu = tp_mesh.device_type == "cpu"

    def replicated(x):
        if not is_local(x) or not (x.is_floating_point() or x.dtype == torch.bool):
            return x
        return DTensor.from_local(x, tp_mesh, [Replicate()], run_check=False)

    @functools.wraps(forward)
    def global_forward(*args, **kwargs):
        args, kwargs = without_kv_cache(args, kwargs, training_only=False)
        given_dtensors = any(isinstance(x, DTensor) for x in tensors_in((args, kwargs)))
        args, kwargs = apply_to_collection((args, kwargs), Tensor, replicated, allow_frozen=True)
        kernel = sdpa_kernel(SDPBackend.MATH) if on_cpu else contextlib.nullcontext()
        with implicit_replication(), _ReplicatedWhereMixed(replicated), kernel:  # integer indices: implicitly
            output = forward(*args, **kwargs)
        if given_dtensors:
            return output
        return apply_to_collection(output, DTensor, _local_if_replicated, allow_frozen=True)

    module.forward = global_forward


class _ReplicatedWhereMixed(TorchFunctionMode):
    """Each plain tensor an op takes beside a DTensor made a replicated DTensor by ``replicate``: DTensor's own
    ``implicit_replication`` treats it as one in forward only, and its saved copy then meets DTensor gradients in
    backward."""

    def __init__(self, replicate: Callable[[Tensor], Tensor]) -> None:
        super().__init__()
        self.replicate = replicate

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        tensors = tensors_in((args, kwargs))
        if any(isinstance(t, DTensor) for t in tensors) and not all(isinstance(t, DTensor) for t in tensors):
            args, kwargs = apply_to_collection((args, kwargs), Tensor, self.replicate, allow_frozen=True)
        return func(*args, **kwargs)


def _local_if_replicated(x: DTensor) -> Tensor:
    return x.to_local().clone() if all(placement.is_replicate() for placement in x.placements) else x
