"""Pipeline stages cut by torch's tracer, for models whose blocks are not in one ModuleList (training through them is
in test_equivalence)."""

from __future__ import annotations

import pytest
import torch
from torch import Tensor, nn
from torch.overrides import TorchFunctionMode
from torch.utils.flop_counter import FlopCounterMode

from lightdist.models import Llama
from lightdist.parallel.activation_checkpointing import apply_activation_checkpointing
from lightdist.parallel.context.mode import TRACED_CALLS
from lightdist.parallel.context.traced_calls import as_called
from lightdist.parallel.pipeline.structural import MicrobatchCalls, ModelCall
from lightdist.parallel.pipeline.traced import (
    TracedInput,
    drop_other_stages,
    modules_around_blocks,
    trace_stages,
    traced_stage_sizes,
)
from lightdist.parallel.structure import find_decoder_stack, find_repeated_blocks

from training import HeldSequentialLM, SequentialBlocksLM, TwoStreamLM
from zoo import GPTLanguageModel, LectureGPT


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm, self.proj = nn.LayerNorm(16), nn.Linear(16, 16)

    def forward(self, x: Tensor) -> Tensor:
        return x + self.proj(self.norm(x))


class BlocksAsAttributes(nn.Module):
    """Blocks called one by one, by name."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(32, 16)
        self.first, self.second, self.third = Block(), Block(), Block()
        self.head = nn.Linear(16, 32)

    def forward(self, tokens: Tensor) -> Tensor:
        return self.head(self.third(self.second(self.first(self.embed(tokens)))))


def test_blocks_are_the_outermost_repeated_modules() -> None:
    # nn.Linear repeats more often (inside every block, and the head), but some sit inside blocks.
    assert find_repeated_blocks(BlocksAsAttributes()) == ["first", "second", "third"]
    assert find_repeated_blocks(SequentialBlocksLM(1e-3, 2)) == ["blocks.0", "blocks.1", "blocks.2", "blocks.3"]
    assert find_repeated_blocks(nn.Sequential(nn.Linear(4, 4))) == []
    # Karpathy's lecture GPT: blocks in an nn.Sequential, each with a ModuleList of heads, which is no decoder stack
    lecture = LectureGPT(1e-3, 2)
    assert find_repeated_blocks(lecture) == [f"model.blocks.{index}" for index in range(4)]
    with pytest.raises(ValueError, match=r"ModuleLists seen: model.blocks.0.sa.heads \(4 x Head\)"):
        find_decoder_stack(lecture)
    # what the step may call as the model: the LightningModule, or the network it holds, not the blocks' container
    assert modules_around_blocks(lecture, find_repeated_blocks(lecture)) == ["", "model"]
    held = HeldSequentialLM(1e-3, 2)  # the whole network one nn.Sequential: blocks model.1 to model.4
    assert modules_around_blocks(held, find_repeated_blocks(held)) == ["", "model"]


def test_traced_stages_compute_the_model_and_share_its_tied_weight() -> None:
    model = SequentialBlocksLM(1e-3, 2)
    tokens = torch.randint(0, 64, (2, 16))
    blocks = find_repeated_blocks(model)
    sizes = traced_stage_sizes(model, blocks, 2)
    assert sizes == [2, 2]

    first, last = trace_stages(model, ((tokens,), {}), blocks, sizes, torch.device("cpu"))

    torch.testing.assert_close(last(first(tokens)), model(tokens))
    # Both ends train the model's one embedding weight, which the LM head is tied to.
    assert first.get_parameter("embed.weight") is model.embed.weight
    assert last.get_parameter("unembed.weight") is model.embed.weight
    assert not hasattr(first, "unembed")  # the first stage does not compute the head
    assert {name for name, _ in last.named_parameters()} == {
        *(f"blocks.{i}.{name}" for i in (2, 3) for name, _ in model.blocks[i].named_parameters()),
        "final_norm.weight",
        "final_norm.bias",
        "unembed.weight",
    }

    drop_other_stages(model, [last])
    assert {name for name, _ in model.named_parameters()} == {name for name, _ in last.named_parameters()}


def test_activation_checkpointing_recomputes_traced_blocks_in_backward() -> None:
    model, tokens = SequentialBlocksLM(1e-3, 2), torch.randint(0, 64, (2, 16))
    (first,) = trace_stages(model, ((tokens,), {}), ["blocks.0"], [1], torch.device("cpu"))

    def backward_flops() -> int:
        loss = first(tokens).sum()
        with FlopCounterMode(display=False) as counter:
            loss.backward()
        return counter.get_total_flops()

    with FlopCounterMode(display=False) as counter:
        model.blocks[0](torch.zeros(2, 16, 64))
    block_forward = counter.get_total_flops()

    plain = backward_flops()
    apply_activation_checkpointing([first.get_submodule("blocks.0")], mode="full")
    # The block's forward runs again in backward, up to the last value backward needs (not its last matmul).
    assert plain + block_forward / 2 < backward_flops() < plain + block_forward


class AddsOnes(nn.Module):
    def forward(self, x: Tensor) -> Tensor:
        return x + torch.ones(16, device=x.device)


class MakesTensors(nn.Module):
    """Makes tensors in its blocks and around them: the trace records the example's device in those calls."""

    def __init__(self) -> None:
        super().__init__()
        self.first, self.second = AddsOnes(), AddsOnes()

    def forward(self, x: Tensor) -> Tensor:
        return self.second(self.first(x)) + torch.zeros(16, device=x.device)


def test_traced_stages_make_their_tensors_on_the_device_they_run_on() -> None:
    model, example = MakesTensors(), torch.zeros(2, 16)  # traced on the CPU, for stages on the meta device
    attributes = dict(vars(model.second))
    first, last = trace_stages(model, ((example,), {}), ["first", "second"], [1, 1], torch.device("meta"))

    assert last(first(torch.zeros(2, 16, device="meta"))).is_meta
    assert vars(model.second) == attributes  # the tracer's split markers are removed again


class BranchesOnData(BlocksAsAttributes):
    def forward(self, tokens: Tensor) -> Tensor:
        x = self.first(self.embed(tokens))
        if x.sum() > 0:  # data-dependent control flow: torch.export cannot record it
            x = self.second(x)
        return self.head(self.third(x))


def test_a_model_neither_cut_can_split_says_what_to_change() -> None:
    model, tokens = BranchesOnData(), torch.zeros(2, 8, dtype=torch.long)
    with pytest.raises(ValueError, match=r"Keep the transformer blocks in one nn\.ModuleList") as raised:
        trace_stages(model, ((tokens,), {}), ["first", "second", "third"], [1, 2], torch.device("cpu"))
    assert "before its blocks second: lightdist traced its forward with torch.export, which failed" in str(raised.value)
    assert "forward" not in model.second.__dict__  # the tracer's split markers are removed again


def test_an_argument_a_later_stage_reads_comes_from_the_microbatch_s_model_call() -> None:
    # The lecture GPT computes its loss from targets after its blocks: the second stage reads them from the model
    # call the schedule hands every stage, not sent on from the first stage
    model, tokens, targets = GPTLanguageModel(), torch.randint(0, 64, (2, 16)), torch.randint(0, 64, (2, 16))
    first, last = trace_stages(model, ((tokens, targets), {}), find_repeated_blocks(model), [2, 2], torch.device("cpu"))

    calls = MicrobatchCalls([ModelCall("", (tokens, targets), {})])
    output = last(first(tokens, targets), lightdist_model_calls=calls, lightdist_microbatch=torch.tensor([0]))
    logits, loss = last.whole_output(output)
    expected_logits, expected_loss = model(tokens, targets)
    torch.testing.assert_close(logits, expected_logits)
    torch.testing.assert_close(loss, expected_loss)


class TargetsInStarArgs(nn.Module):
    """A loss computed after the blocks from targets that come in ``*inputs``: no parameter names them."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.Sequential(*(nn.Linear(8, 8) for _ in range(2)))

    def forward(self, *inputs: Tensor) -> Tensor:
        x, targets = inputs
        return (self.blocks(x) - targets).square().mean()


def test_an_argument_a_later_stage_reads_without_a_name_is_refused_with_the_way_out() -> None:
    model, x = TargetsInStarArgs(), torch.randn(2, 8)
    with pytest.raises(ValueError, match=r"reads its input inputs_1 in pipeline stage 1, not a parameter of forward"):
        trace_stages(model, ((x, torch.randn(2, 8)), {}), ["blocks.0", "blocks.1"], [1, 1], torch.device("cpu"))


def test_the_last_stage_gives_the_step_what_the_model_returns() -> None:
    # Without targets the lecture GPT returns (logits, None): the stage returns the logits alone, which a step's
    # `logits, _ = self.model(x)` would split in two along the batch
    model, tokens = GPTLanguageModel(), torch.randint(0, 64, (2, 16))
    first, last = trace_stages(model, ((tokens,), {}), find_repeated_blocks(model), [2, 2], torch.device("cpu"))

    logits, loss = last.whole_output(last(first(tokens)))
    torch.testing.assert_close(logits, model(tokens)[0])
    assert loss is None


def test_traced_stages_take_the_traced_shape_only() -> None:
    traced_input = TracedInput(BlocksAsAttributes(), ((torch.zeros(2, 8),), {}))
    first, second = torch.zeros(2, 8), torch.ones(2, 8)

    (joined,) = traced_input([((first,), {}), ((second,), {})])  # the schedule cuts it back into the two
    torch.testing.assert_close(joined, torch.cat([first, second]))
    assert traced_input([((), {"tokens": first})])[0].shape == (2, 8)  # keywords become positions
    with pytest.raises(ValueError, match=r"microbatches are \[\(2, 16\)\]. Give every batch one shape"):
        traced_input([((torch.zeros(2, 16),), {})])


def test_the_tracer_hands_every_stream_to_the_next_stage() -> None:
    model, tokens = TwoStreamLM(), torch.randint(0, 16, (2, 8))
    blocks = [f"layers.{index}" for index in range(4)]

    first, last = trace_stages(model, ((tokens,), {}), blocks, [2, 2], torch.device("cpu"))

    handed_on = first(tokens)
    assert len(handed_on) == 2  # the hidden states and the residual stream
    torch.testing.assert_close(last(*handed_on), model(tokens))


def test_what_a_later_stage_reads_is_handed_on_by_every_stage_between() -> None:
    # The Llama's rotary tables are sliced before its first block and read by every block: cut into four stages, the
    # third and fourth get them from the stage before, as torch's PipelineStage hands values on.
    model, tokens = Llama("tiny").model, torch.randint(0, 64, (2, 16))
    stages = trace_stages(model, ((tokens,), {}), [f"layers.{i}" for i in range(4)], [1, 1, 1, 1], torch.device("cpu"))

    handed_on = (tokens,)
    for stage in stages[:-1]:
        handed_on = stage(*handed_on)
        assert len(handed_on) == 3  # the hidden states and the cosine and sine tables
    torch.testing.assert_close(stages[-1](*handed_on), model(tokens))


class CallsWhatContextParallelismReads(nn.Module):
    """Positions by ``arange``, a table's rows and a mask's corner by slicing, scores by hand, a reduction over
    positions."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("table", torch.randn(64, 16))
        self.register_buffer("mask", torch.ones(64, 64).tril())

    def forward(self, x: Tensor) -> Tensor:
        positions = self.table[: x.size(1)] + torch.arange(x.size(1))[:, None]
        scores = (x + positions) @ x.transpose(-2, -1)
        scores = scores.masked_fill(self.mask[: x.size(1), : x.size(1)] == 0, -1e9)
        return scores.softmax(-1)[:, 1:].sum(1)


class Calls(TorchFunctionMode):
    def __init__(self) -> None:
        super().__init__()
        self.made: list[tuple] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        func, args, kwargs = as_called(func, args, kwargs or {}, TRACED_CALLS)
        self.made.append((func, *args[1:]))
        return func(*args, **kwargs)


def test_a_traced_stage_makes_the_calls_its_model_made() -> None:
    # Context parallelism reads a model's positions and attention by the function it calls, which a stage cut by the
    # tracer calls as aten ops: as_called reads them back.
    model, x = CallsWhatContextParallelismReads(), torch.randn(2, 8, 16)
    (stage,) = trace_stages(model, ((x,), {}), [], [0], torch.device("cpu"))
    with Calls() as calls:
        torch.testing.assert_close(stage(x), model(x))
    made = {call[0] for call in calls.made}
    assert {torch.arange, torch.matmul, torch.softmax, torch.sum} <= made
    # torch.export records a slice per dimension, with open ends as 2**63 - 1: the stage indexes as the model's code
    assert (Tensor.__getitem__, slice(None, 8)) in calls.made  # the table's first rows
    assert (Tensor.__getitem__, (slice(None), slice(1, None))) in calls.made  # scores[:, 1:]
    assert (Tensor.__getitem__, (slice(None, 8), slice(None, 8))) in calls.made  # a mask's corner, as one index
    assert (torch.sum, [1]) in calls.made
