"""Which layout each unit of a block (its attention, its MLP) runs in under tensor parallelism, found by running it.

Code that reshapes with sizes it does not read from a head-count attribute (nanoGPT's ``split(self.n_embd)`` and
``view(B, T, C)`` with ``C`` from its input, LitGPT's ``config.n_head``) fails on local shards, or runs with wrong
shapes and trains a wrong model. So before the model is split, each unit of its first block is copied, split across the
tensor-parallel ranks, run on the inputs the unit gets in a forward pass of 2 x 8 tokens and compared with the unsplit
copy. The first layout that gives the unsplit output is the one every block's unit gets: fast, else adapted, else global
(see ``lightdist.parallel.tensor.UnitLayout``). The cost is a few forwards of one block on 2 x 8 tokens, and for a
moment the memory of the unit twice over, in fp32. Units larger than ``NUMERIC_CHECK_LIMIT`` parameters (a 70B model's
MLP), and runs in torch's fake process group (which sends nothing), are checked on the meta device instead: for their
output shapes only, at no cost.
"""

from __future__ import annotations

import contextlib
import copy
import inspect
import logging
import os
import traceback
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from lightning_utilities.core.apply_func import apply_to_collection
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.debug import CommDebugMode
from torch.distributed.tensor.parallel import parallelize_module

from lightdist.dataflow import run_first_block, tensors_in
from lightdist.parallel.structure import DecoderStack, within
from lightdist.parallel.tensor import (
    TensorParallelStyle,
    UnitLayout,
    attention_heads,
    block_units,
    check_divisible,
    parallel_styles,
    prepare_units,
    reorder_optimizer_state,
)

__all__ = ["probe_layouts"]

_LAYOUTS: tuple[UnitLayout, ...] = ("fast", "adapted", "global")
TOLERANCE = 1e-4  # relative: a split unit's outputs and gradients differ from the unsplit one's by rounding only
NUMERIC_CHECK_LIMIT = 256 * 2**20  # parameters of one unit: 1 GiB in fp32, an 8B Llama's MLP


def probe_layouts(
    model: nn.Module,
    stack: DecoderStack,
    plan: dict[str, TensorParallelStyle],
    tp_mesh: DeviceMesh,
    *,
    report: Callable[[str], Any] = print,
) -> dict[str, UnitLayout]:
    """The layout of each unit, by its name inside a block, for ``apply_tensor_parallel``. A collective of the
    tensor-parallel ranks. Each unit that does not run fast is reported in one line: why, and what it costs."""
    check_divisible(model, stack, plan, tp_mesh.size())
    first = f"{stack.name}.{next(iter(stack.blocks.named_children()))[0]}"
    units = {name: in_block for name, in_block in block_units(stack, plan).items() if within(name, first)}
    inputs = _unit_inputs(model, stack, list(units))
    if isinstance(inputs, str):
        report(
            f"lightdist: tensor parallelism could not check the layout of {first} ({inputs}), so its modules run "
            "global: right for any code of torch ops, at some cost. Let the module holding the blocks run on token "
            "ids alone (model(ids)) for the check to find the fast layout."
        )
        return dict.fromkeys(units.values(), "global")
    layouts: dict[str, UnitLayout] = {}
    for name, in_block in units.items():
        unit_plan = {child[len(name) + 1 :]: style for child, style in plan.items() if child.rpartition(".")[0] == name}
        layout, failures, collectives = _first_layout_that_matches(
            model.get_submodule(name), unit_plan, tp_mesh, inputs[name]
        )
        where = f"{stack.name}.*.{in_block}" if in_block else f"{stack.name}.*"
        what = type(model.get_submodule(name)).__name__
        tried = "; ".join(f"{earlier}: {failure.rstrip('.')}" for earlier, failure in failures.items())
        if layout is None:
            raise ValueError(
                f"Tensor parallelism cannot split {where} ({what}) in any layout: {tried}. Leave its projections out "
                "of tp_plan (they are then replicated); or, for the fast layout, reshape with sizes read from "
                "head-count attributes (self.num_heads); or, for the global one, register how torch places the op it "
                "names (torch.distributed.tensor.experimental.register_sharding)."
            )
        layouts[in_block] = layout
        if layout != "fast":
            report(
                f"lightdist: {where} ({what}) runs tensor-parallel {layout}, since {tried}. Per call it costs "
                f"{_counted(collectives)}."
            )
    return layouts


def _unit_inputs(model: nn.Module, stack: DecoderStack, names: list[str]) -> dict[str, tuple[tuple, dict]] | str:
    """Each unit's (args, kwargs) in a forward pass of 2 x 8 tokens, or why there are none."""
    captured: dict[str, tuple[tuple, dict]] = {}

    def capture(name: str):
        def hook(module: nn.Module, args: tuple, kwargs: dict) -> None:
            # A copy: the unit may change what it is given (a key/value cache it appends to).
            captured.setdefault(name, copy.deepcopy((args, kwargs)))

        return hook

    handles = [model.get_submodule(name).register_forward_pre_hook(capture(name), with_kwargs=True) for name in names]
    try:
        run_first_block(model, stack)
    except RuntimeError as error:
        return str(error)
    finally:
        for handle in handles:
            handle.remove()
    missing = [name for name in names if name not in captured]
    return f"{', '.join(missing)} never ran" if missing else captured


def _first_layout_that_matches(
    unit: nn.Module, plan: dict[str, TensorParallelStyle], tp_mesh: DeviceMesh, inputs: tuple[tuple, dict]
) -> tuple[UnitLayout | None, dict[str, str], dict[str, int]]:
    """The first layout whose output and weights' gradients equal the unsplit unit's on every rank, what the ones
    before it did, and the collectives of one call in it.

    Gradients too: a norm of each head's queries (Qwen3's ``q_norm``) gives the right output on each rank's heads, but
    its replicated weight's gradient then sums that rank's heads only."""
    numeric = dist.get_backend(tp_mesh.get_group()) != "fake" and _size(unit) <= NUMERIC_CHECK_LIMIT
    device = torch.device(tp_mesh.device_type if numeric else "meta")
    reference = _seeded_copy(unit, device)
    inputs = _seeded_inputs(inputs, device)
    args, kwargs = copy.deepcopy(inputs)
    expected = tensors_in(reference(*args, **kwargs))
    expected_gradients: dict[str, Tensor] = {}
    if numeric:
        try:
            _backward(expected)
            expected_gradients = _gradients(reference)
        except RuntimeError:  # the unit's code has no backward (a kernel with no autograd): each layout says so below
            pass
    expected = [x.detach() for x in expected]
    failures: dict[str, str] = {}
    candidates = _LAYOUTS if attention_heads(unit) is not None else ("fast", "global")
    for layout in candidates:
        split = copy.deepcopy(reference)
        units = {"": layout}
        parallelize_module(
            split,
            tp_mesh,
            parallel_styles(split, plan, units, tp_mesh.size(), sequence_parallel=False, loss_parallel=False),
        )
        prepare_units(split, plan, units, tp_mesh)
        args, kwargs = copy.deepcopy(inputs)
        comm = CommDebugMode()
        try:
            with _quietly():
                with comm:
                    output = tensors_in(split(*args, **kwargs))
                failure = _difference(output, expected)
                if not failure:  # and backward runs too
                    _backward(output)
                    failure = _gradient_difference(_gradients(split), expected_gradients)
        except Exception as error:  # the unit's own code, on shapes it was not written for
            failure = f"{type(error).__name__}: {str(error).rstrip('.')}{_in_own_code(error, unit)}"
        if _all_ranks_agree(not failure, tp_mesh):
            return layout, failures, {str(op).rsplit(".", 1)[-1]: count for op, count in comm.get_comm_counts().items()}
        failures[layout] = failure or "another rank's output differs"
    return None, failures, {}


@contextlib.contextmanager
def _quietly() -> Iterator[None]:
    """Without what torch says along the way, here expected: the shape errors DTensor's sharding propagation logs
    before raising them (a layout that does not fit is an answer, said once in the report), and the warning about
    full backward hooks that ``CommDebugMode``'s module tracker sets off on inputs that need no gradient."""
    logger = logging.getLogger("torch._subclasses.fake_tensor")
    level = logger.level
    logger.setLevel(logging.CRITICAL)
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="Full backward hook is firing", category=UserWarning)
            yield
    finally:
        logger.setLevel(level)


def _in_own_code(error: Exception, unit: nn.Module) -> str:
    """The line of the unit's own code the error came from (the model's file, not torch's), for the user to change."""
    files = set()
    for module in unit.modules():
        if not type(module).__module__.startswith(("torch.", "lightdist.")):
            with contextlib.suppress(TypeError):
                files.add(inspect.getsourcefile(type(module)))
    frames = [frame for frame in traceback.extract_tb(error.__traceback__) if frame.filename in files]
    if not frames:
        return ""
    frame = frames[-1]
    return f" (at {os.path.basename(frame.filename)}:{frame.lineno}: {frame.line})"


def _whole(x: Tensor) -> Tensor:
    return x.full_tensor() if isinstance(x, DTensor) else x


def _size(unit: nn.Module) -> int:
    return sum(param.numel() for param in unit.parameters())


def _seeded_copy(unit: nn.Module, device: torch.device) -> nn.Module:
    """The unit with the same made-up weights on every rank, in fp32: equal on every rank without a collective, and
    built on the meta device too."""
    generator = torch.Generator().manual_seed(0)
    unit = copy.deepcopy(unit)
    on_meta = any(t.is_meta for t in (*unit.parameters(), *unit.buffers()))
    unit = unit.to_empty(device=device) if on_meta or device.type == "meta" else unit.to(device)
    unit.float()
    if device.type == "meta":
        return unit
    with torch.no_grad():
        for tensor in (*unit.parameters(), *(unit.buffers() if on_meta else ())):
            if tensor.is_floating_point():
                tensor.copy_(torch.randn(tensor.shape, generator=generator) * 0.1)
            else:
                tensor.fill_(1)
    return unit


def _seeded_inputs(inputs: tuple[tuple, dict], device: torch.device) -> tuple[tuple, dict]:
    """The unit's inputs with made-up values where they are floats (hidden states, rotary tables, additive masks),
    so that every position and head differs; integers and booleans as the forward pass gave them."""
    generator = torch.Generator().manual_seed(1)

    def made_up(x):
        if not isinstance(x, Tensor):
            return x
        if device.type == "meta":
            return torch.empty_like(x, device=device)
        if x.is_floating_point():
            return torch.randn(x.shape, generator=generator).to(device)
        return torch.ones(x.shape, dtype=x.dtype, device=device) if x.is_meta else x.to(device)

    return apply_to_collection(inputs, Tensor, made_up, allow_frozen=True)


def _difference(output: list[Tensor], expected: list[Tensor]) -> str:
    whole = [_whole(x).detach() for x in output]
    if [x.shape for x in whole] != [x.shape for x in expected]:
        return f"outputs of shapes {[tuple(x.shape) for x in whole]}, unsplit {[tuple(x.shape) for x in expected]}"
    for got, want in zip(whole, expected, strict=True):
        if want.is_meta:
            continue
        error = _relative_error(got, want)
        if error > TOLERANCE:
            return f"wrong outputs (relative error {error:.2g})"
    return ""


def _backward(outputs: list[Tensor]) -> None:
    trained = [_whole(x).sum() for x in outputs if x.requires_grad]
    if trained:
        torch.stack(trained).sum().backward()


def _gradients(unit: nn.Module) -> dict[str, Tensor]:
    """The weights' gradients by name, whole, those of fused projections back in the model's row order (as Adam's
    moments are put for a checkpoint)."""
    state = {name: {"grad": p.grad} for name, p in unit.named_parameters() if p.grad is not None and not p.grad.is_meta}
    state = reorder_optimizer_state(unit, {"state": state}, to_model_layout=True)["state"]
    return {name: _whole(tensors["grad"]) for name, tensors in state.items()}


def _gradient_difference(gradients: dict[str, Tensor], expected: dict[str, Tensor]) -> str:
    """Each gradient's error relative to its size, or to a hundredth of the unit's largest: a gradient that is zero
    but for rounding (a key bias's: softmax ignores a constant added to a query's scores) has no size of its own."""
    largest = max((want.abs().max().item() for want in expected.values()), default=0.0)
    for name, want in expected.items():
        got = gradients.get(name)
        if got is None:
            return f"no gradient for {name}"
        error = _relative_error(got, want, floor=largest / 100)
        if error > TOLERANCE:
            return f"a wrong gradient of {name} (relative error {error:.2g})"
    return ""


def _relative_error(got: Tensor, want: Tensor, floor: float = 0.0) -> float:
    """The largest difference, relative to ``want``'s largest value or to ``floor``, whichever is larger."""
    return (got - want).abs().max().item() / max(want.abs().max().item(), floor, 1e-12)


def _all_ranks_agree(ok: bool, tp_mesh: DeviceMesh) -> bool:
    flag = torch.tensor([int(ok)], device=tp_mesh.device_type)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=tp_mesh.get_group())
    return bool(flag.item())


def _counted(collectives: dict[str, int]) -> str:
    return ", ".join(f"{count} {name}" for name, count in sorted(collectives.items())) or "no collective"
