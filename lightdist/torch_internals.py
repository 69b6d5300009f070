"""The private names of torch that lightdist relies on, in one place.

torch promises nothing about its private names: an upgrade may rename or change any of them. lightdist reaches each
through this module only, and ``tests/test_internals.py`` pins the behaviour relied on, so that an upgrade fails in
that test, naming the name, rather than in a user's run. Tested with torch 2.11 and 2.13.

Each name is here because torch has no public way to do the same yet:

- ``torch.distributed.checkpoint._fsspec_filesystem``: DCP's reader and writer for fsspec URLs (s3://, gs://).
- ``torch.distributed.checkpoint._async_process_executor``: what DCP's checkpoint process runs first.
- ``torch._subclasses.fake_tensor``, ``torch.testing._internal.distributed.fake_pg``: shapes without memory, and a
  process group without processes, for the planner and ``lightdist plan``.
- ``torch.distributed.distributed_c10d``: a group's timeout.
- ``Tensor._base``: whether a tensor is a view.
- ``torch._C.DisableTorchFunctionSubclass``: a tensor subclass's ``__torch_function__`` calling torch on itself
  without calling itself again, as ``Tensor.__torch_function__`` does.
- ``torch.overrides._get_current_function_mode_stack``: the ``TorchFunctionMode``s a checkpointed block ran under,
  entered again where backward recomputes it (torch leaves a mode while the mode handles ``backward``).
- ``torch.distributed.tensor.experimental._context_parallel._attention``: torch's ring attention, forward and
  backward, for any attention kernel that returns its log-sum-exp; its public ``context_parallel`` patches only the
  CUDA kernels, for torchtitan's own models.

``SUBCLASS_PRIVATES`` lists the private members of torch's classes that lightdist's subclasses override or call.
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import timedelta
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.distributed.checkpoint._async_process_executor import _AsyncCheckpointProcess
from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader, FsspecWriter
from torch.distributed.distributed_c10d import _set_pg_timeout
from torch.distributed.tensor.experimental._context_parallel._attention import (
    _cp_options,
    _templated_ring_attention,
    _templated_ring_attention_backward,
)
from torch.overrides import TorchFunctionMode, _get_current_function_mode_stack
from torch.testing._internal.distributed.fake_pg import FakeStore

from lightdist.quiet import silence_known_noise

__all__ = [
    "SUBCLASS_PRIVATES",
    "FakeStore",
    "FakeTensorMode",
    "FsspecReader",
    "FsspecWriter",
    "is_view",
    "quiet_checkpoint_processes",
    "ring_attention_backward",
    "ring_attention_forward",
    "set_group_timeout",
    "subclass_dispatch_disabled",
    "torch_function_modes",
]

# Private members of torch's classes that lightdist's subclasses override or call, and why.
SUBCLASS_PRIVATES = {
    "_apply": "ParallelStyle's one abstract method: how a tensor-parallel style splits a module",
    "_to_tensor": "PipelineStage (torch 2.13): the tensors a stage learns its output shapes on, made from shapes",
}


def set_group_timeout(group: dist.ProcessGroup, timeout: timedelta) -> None:
    """``group``'s collectives wait ``timeout``: a DeviceMesh makes its groups with torch's default timeout, not the
    one the world was started with, and has no option to pass one."""
    _set_pg_timeout(timeout, group)


def subclass_dispatch_disabled() -> torch._C.DisableTorchFunctionSubclass:
    """A context in which torch calls on tensor subclasses skip their ``__torch_function__``."""
    return torch._C.DisableTorchFunctionSubclass()


def torch_function_modes() -> list[TorchFunctionMode]:
    """The ``TorchFunctionMode``s entered now, outermost first."""
    return _get_current_function_mode_stack()


def is_view(tensor: Tensor) -> bool:
    """Whether ``tensor`` is a view of another tensor's memory."""
    return tensor._base is not None


_aten = torch.ops.aten
# torch's ring attention reads its options from a global: chunks held as head and tail (load-balanced), key/value
# blocks passed by all-gather. lightdist holds its sequences so, always.
_cp_options.enable_load_balance = True


# Flash attention takes half precision only; on CUDA, fp32 goes through the memory-efficient kernel, as torch's own
# context_parallel does.
_FLASH_DTYPES = (torch.float16, torch.bfloat16)
_EFFICIENT_LSE_ROWS = 32  # the memory-efficient kernel pads its log-sum-exp to a multiple of this many queries


def _efficient_attention(query: Tensor, key: Tensor, value: Tensor, **kwargs: Any) -> tuple[Tensor, ...]:
    """The memory-efficient kernel with its log-sum-exp cut to the queries: the ring merges and halves it along the
    sequence, which the kernel's padding would misalign wherever a chunk is not a multiple of 32 tokens."""
    out, logsumexp, *state = _aten._scaled_dot_product_efficient_attention(
        query, key, value, attn_bias=None, compute_log_sumexp=True, **kwargs
    )
    return out, logsumexp[..., : query.size(2)], *state


def _efficient_attention_backward(logsumexp: Tensor, **kwargs: Any) -> tuple[Tensor, ...]:
    """The memory-efficient kernel's backward, its log-sum-exp padded back as the kernel made it."""
    padded = F.pad(logsumexp, (0, -logsumexp.size(-1) % _EFFICIENT_LSE_ROWS))
    return _aten._scaled_dot_product_efficient_attention_backward.default(
        logsumexp=padded, attn_bias=None, grad_input_mask=(True, True, True, False), **kwargs
    )


class _RingKernel(NamedTuple):
    """An attention kernel the ring runs per block: forward, backward, the name its backward gives the output's
    gradient, and the names of what the forward returns after the log-sum-exp that its backward takes."""

    forward: Callable[..., Any]
    backward: Callable[..., Any]
    grad_out_name: str
    state_names: tuple[str, ...]


_CPU_FLASH = _RingKernel(
    _aten._scaled_dot_product_flash_attention_for_cpu,
    _aten._scaled_dot_product_flash_attention_for_cpu_backward,
    "grad_out",
    (),
)
_CUDA_FLASH = _RingKernel(
    _aten._scaled_dot_product_flash_attention,
    _aten._scaled_dot_product_flash_attention_backward.default,
    "grad_out",
    ("cum_seq_q", "cum_seq_k", "max_q", "max_k", "philox_seed", "philox_offset"),
)
_CUDA_EFFICIENT = _RingKernel(
    _efficient_attention, _efficient_attention_backward, "grad_out_", ("philox_seed", "philox_offset")
)


def _ring_kernel(query: Tensor) -> _RingKernel:
    if query.device.type == "cpu":
        return _CPU_FLASH
    return _CUDA_FLASH if query.dtype in _FLASH_DTYPES else _CUDA_EFFICIENT


def ring_attention_forward(
    group: dist.ProcessGroup, query: Tensor, key: Tensor, value: Tensor, scale: float | None
) -> tuple[Tensor, Tensor, tuple]:
    """Causal ring attention over ``group`` of each rank's two chunks (head and tail) of the sequence: the output, its
    log-sum-exp, and what the kernel's backward needs besides."""
    kernel = _ring_kernel(query)
    out, logsumexp, *state = _templated_ring_attention(
        group, 2, kernel.forward, query, key, value, True, dropout_p=0.0, scale=scale
    )
    return out, logsumexp, tuple(state[: len(kernel.state_names)])


def ring_attention_backward(
    group: dist.ProcessGroup,
    grad_out: Tensor,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    out: Tensor,
    logsumexp: Tensor,
    kernel_state: tuple,
    scale: float | None,
) -> tuple[Tensor, Tensor, Tensor]:
    """The gradients of ``ring_attention_forward``'s query, key and value."""
    kernel = _ring_kernel(query)
    grads = _templated_ring_attention_backward(
        group,
        2,
        kernel.backward,
        grad_out.contiguous(),
        kernel.grad_out_name,
        query,
        key,
        value,
        out,
        logsumexp,
        True,
        dropout_p=0.0,
        scale=scale,
        **dict(zip(kernel.state_names, kernel_state, strict=True)),
    )
    return grads[0], grads[1], grads[2]


# torch's own first function of the checkpoint process, kept before quiet_checkpoint_processes replaces it.
_checkpoint_process_main = _AsyncCheckpointProcess._checkpointing_subprocess


def quiet_checkpoint_processes() -> None:
    """DCP's checkpoint process, which torch starts per rank by spawn, installs lightdist's filters before it logs.

    It logs each step of its start and every save request on the root logger, at INFO. Spawned, it inherits no
    filters, and imports only the script that started the rank, not what that script imports in ``main()``: without
    this, its lines show wherever the script does not import lightdist as it loads. Its first function is torch's
    own, called from lightdist's, which the process imports by name (and with it ``lightdist/quiet.py``).
    """
    _AsyncCheckpointProcess._checkpointing_subprocess = staticmethod(_quiet_checkpoint_process)


def _quiet_checkpoint_process(*args: Any) -> None:
    silence_known_noise()
    _checkpoint_process_main(*args)
