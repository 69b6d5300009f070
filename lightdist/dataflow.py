"""Which Linear feeds which inside a decoder block, found by running the model once on a few tokens.

Megatron's pairs are visible in the data flow: a Linear whose output reaches another Linear of the same block through
elementwise ops, reshapes or attention is column-parallel, and the one it reaches is row-parallel (q, k, v -> o;
gate, up -> down). A row-parallel output starts the next pair's input (the residual stream), so it never counts as a
source. A column-parallel output cut into equal parts along its features by ``chunk``/``split`` is a fused
projection: three parts are q, k, v, two are gate and up.
"""

from __future__ import annotations

from itertools import pairwise
from typing import Any

import torch
import torch.nn.functional as F
from lightning_utilities.core.apply_func import apply_to_collection
from torch import Tensor, nn
from torch.overrides import TorchFunctionMode
from torch.utils.weak import WeakIdKeyDictionary

from lightdist.parallel.structure import DecoderStack, is_projection, out_features

__all__ = ["cloned", "device_of_call", "expanded_index", "run_first_block", "tensors_in", "trace_block_plan"]

_SPLITS = {torch.split, torch.chunk, Tensor.split, Tensor.chunk, torch.tensor_split, Tensor.tensor_split}
_FUSED_BY_PARTS = {3: "qkv", 2: "gate_up"}


def tensors_in(value: Any) -> list[Tensor]:
    """The tensors in ``value``, however nested: in call arguments, in a model's output (a ``ModelOutput`` too)."""
    found: list[Tensor] = []
    apply_to_collection(value, Tensor, found.append, allow_frozen=True)
    return found


def cloned(value: Any) -> Any:
    """``value`` with each tensor in it cloned: a batch handed to a step that may write into it (labels masked in
    place), which must run on it again."""
    return apply_to_collection(value, Tensor, torch.clone)


def expanded_index(index: Any, dims: int) -> tuple:
    """``index`` as a tuple of one entry per dimension: an ``Ellipsis``, and the dimensions after the last given,
    made whole slices."""
    index = index if isinstance(index, tuple) else (index,)
    if Ellipsis in index:
        at = index.index(Ellipsis)
        index = index[:at] + (slice(None),) * (dims - len(index) + 1) + index[at + 1 :]
    return index + (slice(None),) * (dims - len(index))


def device_of_call(args: tuple, kwargs: dict) -> torch.device:
    """The device a module's call computes on: its first tensor argument's, not its parameters' (which CPU offload
    keeps on the CPU, and a model built on meta has there until it is moved); the CPU for a call without one."""
    return next((x.device for x in (*args, *kwargs.values()) if isinstance(x, Tensor)), torch.device("cpu"))


class _Provenance(TorchFunctionMode):
    """Tags every tensor with the block's Linear layers it was computed from."""

    def __init__(self) -> None:
        super().__init__()
        self.sources: WeakIdKeyDictionary = WeakIdKeyDictionary()  # tensor -> frozenset of Linear names
        self.outputs: WeakIdKeyDictionary = WeakIdKeyDictionary()  # a Linear's own output -> its name
        self.parts: dict[str, int] = {}  # Linear name -> parts its output is cut into
        self.slices: dict[str, set[tuple[int, int]]] = {}  # Linear name -> (start, stop) of feature slices taken
        self.sliced: set[str] = set()  # cut in ways that make no parts (a stride, an index)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        result = func(*args, **kwargs)
        if func is F.linear:  # the Linear's forward hook tags its output; F.linear inside it must not
            return result
        inputs = tensors_in((args, kwargs))
        tags = frozenset().union(*(self.sources.get(x, frozenset()) for x in inputs))
        if tags:
            for x in tensors_in(result):
                self.sources[x] = tags | self.sources.get(x, frozenset())
        if inputs and inputs[0] in self.outputs:
            self._note_feature_cut(self.outputs[inputs[0]], func, args, kwargs, inputs[0], result)
        return result

    def _note_feature_cut(self, name: str, func, args: tuple, kwargs: dict, output: Tensor, result: Any) -> None:
        if func in _SPLITS:
            dim = kwargs.get("dim", args[2] if len(args) > 2 else 0)
            if dim % output.ndim == output.ndim - 1:
                self.parts[name] = len(result)
        elif func is Tensor.__getitem__:
            index = args[1] if isinstance(args[1], tuple) else (args[1],)
            last = index[-1] if index[0] is Ellipsis or len(index) == output.ndim else slice(None)
            if isinstance(last, slice) and last.step in (None, 1):
                start, stop, _ = last.indices(output.shape[-1])
                if (start, stop) != (0, output.shape[-1]):
                    self.slices.setdefault(name, set()).add((start, stop))
            else:
                self.sliced.add(name)


class _FirstBlockDone(Exception):
    pass


def run_first_block(model: nn.Module, stack: DecoderStack, tokens: int = 8, *, blocks: int = 1) -> None:
    """Run the network a training step calls on two sequences of ``tokens`` zero tokens, up to the end of its first
    block (of its first ``blocks``). Two, so that what the block is given shows which sizes grow with the batch, as in
    training (BLOOM's ALiBi biases lead with batch x heads, MPT's with heads alone: one sequence would make them
    alike), and code that folds the batch into the heads costs in the layout check what it costs in training.

    The step may call the model itself or a module holding the stack (``self.model(x)``,
    ``self.model.model(input_ids=x)``); the innermost of those whose forward gets through the first block is run, so
    neither a LightningModule without ``forward`` nor a model wanting targets stops it. Runs on the meta device when
    the model is there (no memory, no compute), else on the model's own device. Raises with every attempt's error
    when none gets through.
    """

    def stop(*_) -> None:
        raise _FirstBlockDone

    device = next(model.parameters()).device
    ids = torch.zeros(2, tokens, dtype=torch.long, device=device)
    handle = stack.blocks[blocks - 1].register_forward_hook(stop)
    errors = []
    try:
        for name in reversed(stack.enclosing):
            try:
                with torch.no_grad():
                    model.get_submodule(name)(ids)
            except _FirstBlockDone:
                return
            except Exception as error:  # the user's forward may want other inputs
                errors.append(f"{name or type(model).__name__}: {type(error).__name__}: {error}")
    finally:
        handle.remove()
    raise RuntimeError(f"running the model on 2 x {tokens} tokens failed ({'; '.join(errors)})")


def trace_block_plan(model: nn.Module, stack: DecoderStack) -> dict[str, str]:
    """The style of each projection of a block, by its name inside the block, from one forward pass on 2 x 8 tokens."""
    block = stack.blocks[0]
    linears = {name: module for name, module in block.named_modules() if is_projection(module)}
    provenance = _Provenance()
    consumed: dict[str, frozenset[str]] = {}

    def record_input(name: str):
        def hook(module: nn.Module, args: tuple) -> None:
            consumed[name] = frozenset().union(
                *(provenance.sources.get(x, frozenset()) for x in args if isinstance(x, Tensor))
            )

        return hook

    def tag_output(name: str):
        def hook(module: nn.Module, args: tuple, output: Tensor) -> None:
            provenance.sources[output] = frozenset({name})
            provenance.outputs[output] = name

        return hook

    handles = []
    for name, module in linears.items():
        handles.append(module.register_forward_pre_hook(record_input(name)))
        handles.append(module.register_forward_hook(tag_output(name)))
    try:
        with provenance:
            run_first_block(model, stack)
    finally:
        for handle in handles:
            handle.remove()
    return _pairs(linears, consumed, provenance)


def _tiling(slices: set[tuple[int, int]], width: int) -> int | None:
    """How many parts feature slices cut an output into (Phi-3's ``qkv[..., :query_pos]``, ...), when they tile it."""
    if not slices:
        return None
    bounds = sorted(slices)
    tiles = bounds[0][0] == 0 and bounds[-1][1] == width and all(a[1] == b[0] for a, b in pairwise(bounds))
    return len(bounds) if tiles else -1


def _pairs(linears: dict[str, nn.Module], consumed: dict[str, frozenset[str]], provenance: _Provenance) -> dict:
    row, column = set(), set()
    for name, sources in consumed.items():  # in the order the Linear layers ran
        if sources - row:
            row.add(name)
            column |= sources - row
    plan = {}
    for name in linears:
        if name in row:
            plan[name] = "rowwise"
        elif name in column:
            parts = provenance.parts.get(name) or _tiling(
                provenance.slices.get(name, set()), out_features(linears[name])
            )
            if name in provenance.sliced or (parts is not None and parts not in _FUSED_BY_PARTS):
                raise ValueError(
                    f"The output of {name} is cut along its features before it reaches the next Linear, in a way "
                    "lightdist cannot map to parts (q, k, v or gate, up). Pass tp_plan, with 'qkv' or 'gate_up' "
                    "for fused layers."
                )
            plan[name] = _FUSED_BY_PARTS[parts] if parts else "colwise"
    return plan
