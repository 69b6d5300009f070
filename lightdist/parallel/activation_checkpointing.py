"""Activation checkpointing per decoder block.

Each block's own ``forward`` is wrapped in ``torch.utils.checkpoint``, in place, so parameter names (and so
checkpoints) do not change, as they would under a wrapper module. Must run after tensor parallelism and before FSDP,
the order torchtitan uses: FSDP's hooks on the block then gather its parameters before the recomputed forward.

Backward recomputes a block from the arguments its forward was given, so a block must not leave state behind that its
recompute reads: checkpointed blocks are called without Hugging Face's key/value cache
(``lightdist.parallel.kv_cache``). And it recomputes under context parallelism and within packed documents, as the
forward ran, though torch leaves their modes while it runs backward.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterable, Iterator
from contextlib import AbstractContextManager, ExitStack, contextmanager
from functools import cache, partial, wraps
from itertools import product
from typing import Any, Literal

import torch
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.functional import scaled_dot_product_attention
from torch.overrides import TorchFunctionMode
from torch.utils.checkpoint import (
    CheckpointPolicy,
    checkpoint,
    create_selective_checkpoint_contexts,
    noop_context_fn,
)

from lightdist.dataflow import device_of_call
from lightdist.parallel.context import ContextParallelMode
from lightdist.parallel.documents import DocumentMode
from lightdist.parallel.kv_cache import without_kv_cache
from lightdist.torch_internals import torch_function_modes

__all__ = ["ActivationCheckpointing", "apply_activation_checkpointing", "attention_ops"]

ActivationCheckpointing = Literal["full", "selective"]
# The modes a block's forward ran under that its recompute must run under too.
_RECOMPUTED_UNDER = (ContextParallelMode, DocumentMode)

# Outputs worth keeping: matmuls and attention (``attention_ops``) are where the FLOPs are; norms, activations and
# elementwise ops are cheap to recompute and hold as much memory. This is torchtitan's op-level selective
# checkpointing policy.
_MATMULS = (torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default)


@cache
def attention_ops(device_type: str) -> frozenset[Callable[..., Any]]:
    """The ops ``scaled_dot_product_attention`` dispatches to on ``device_type``, one per fused backend that runs
    there (flash, memory-efficient, cuDNN): those whose outputs selective checkpointing keeps.

    aten's names for them are private, and differ per backend, device and torch version; asking SDPA which ops it runs
    needs none. So each backend runs once on tiny inputs under a checkpoint policy that records the ops it sees. The
    math backend is left out: it runs matmuls, kept already.
    """
    seen = []

    def record(ctx, op, *args, **kwargs) -> CheckpointPolicy:
        seen.append(op)
        return CheckpointPolicy.PREFER_RECOMPUTE

    contexts = partial(create_selective_checkpoint_contexts, record)
    backends = [b for b in SDPBackend.__members__.values() if b not in (SDPBackend.MATH, SDPBackend.ERROR)]
    # With grad, also when first called in validation: checkpointing without it asks no policy.
    with torch.inference_mode(False), torch.enable_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # SDPA warns why each backend that cannot run here does not
        for backend, dtype in product(backends, (torch.float32, torch.bfloat16, torch.float16)):
            qkv = torch.ones(1, 2, 64, 64, dtype=dtype, device=device_type, requires_grad=True)
            try:
                with sdpa_kernel(backend):
                    checkpoint(scaled_dot_product_attention, qkv, qkv, qkv, use_reentrant=False, context_fn=contexts)
            except RuntimeError:  # the backend does not run on this device, or in this dtype
                continue
    # The attention ops only: not the casts autocast adds around them.
    return frozenset(op for op in seen if "attention" in op.name())


def apply_activation_checkpointing(blocks: Iterable[nn.Module], *, mode: ActivationCheckpointing) -> None:
    """Recompute each block's activations in backward: all of them (``"full"``) or only the cheap ones. ``blocks``:
    a decoder stack's, or a traced pipeline stage's."""
    if mode not in ("full", "selective"):
        raise ValueError(f"activation_checkpointing={mode!r} is not one of None, 'full', 'selective'.")
    for block in blocks:
        block.forward = _recomputed_in_backward(block.forward, selective=mode == "selective")


def _recomputed_in_backward(forward: Callable[..., Any], selective: bool) -> Callable[..., Any]:
    @wraps(forward)
    def recomputed_in_backward(*args: Any, **kwargs: Any) -> Any:
        contexts = noop_context_fn
        if selective:
            # The attention ops of the device the block runs on, known only now: a model built on the meta device
            # is moved after its blocks are wrapped.
            keep = [*_MATMULS, *attention_ops(device_of_call(args, kwargs).type)]
            contexts = partial(create_selective_checkpoint_contexts, keep)
        if modes := [mode for mode in torch_function_modes() if isinstance(mode, _RECOMPUTED_UNDER)]:
            contexts = partial(_recomputed_under, modes, contexts)
        args, kwargs = without_kv_cache(args, kwargs)
        return checkpoint(forward, *args, use_reentrant=False, context_fn=contexts, **kwargs)

    return recomputed_in_backward


def _recomputed_under(
    modes: list[TorchFunctionMode], contexts: Callable[[], tuple[Any, Any]]
) -> tuple[AbstractContextManager, AbstractContextManager]:
    forward_context, recompute_context = contexts()
    return forward_context, _under_modes(modes, recompute_context)


@contextmanager
def _under_modes(modes: list[TorchFunctionMode], context: AbstractContextManager) -> Iterator[None]:
    """``context``, under the ``modes`` the forward ran under that are not entered now: torch leaves a mode while the
    mode handles a call, ``backward`` included, so a block recomputed there would attend within the rank's share of
    the sequence, or across documents, not as its forward did."""
    entered = torch_function_modes()
    with ExitStack() as stack:
        for mode in modes:
            if not any(mode is active for active in entered):
                stack.enter_context(mode)
        stack.enter_context(context)
        yield
