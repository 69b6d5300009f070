"""Each attention and MLP module gets the tensor-parallel layout its code computes right in, found by running it split
on the ranks before training: no code is trusted to reshape with per-rank sizes, and code that would train a wrong
model on local shards, without an error, runs on global shapes instead."""

from __future__ import annotations

import copy
from collections.abc import Callable
from functools import cache

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.device_mesh import init_device_mesh

from lightdist.parallel.layout_probe import probe_layouts
from lightdist.parallel.structure import find_decoder_stack
from lightdist.parallel.tensor import apply_tensor_parallel, discover_plan
from lightdist.plan.command import format_plan

from multirank import raised, run_ranks
from training import MODELS

pytestmark = pytest.mark.multirank

HEADS = 4  # a module-level constant: what lightdist cannot find and set per rank


class ConstantHeadsAttention(nn.Module):
    """Attention reading its head count from a constant. On local shards it still runs, four heads of half the width
    each: wrong numbers, no error."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.q, self.k, self.v, self.o = (nn.Linear(width, width) for _ in range(4))

    def forward(self, x: Tensor) -> Tensor:
        B, T, _ = x.shape
        q, k, v = (proj(x).view(B, T, HEADS, -1).transpose(1, 2) for proj in (self.q, self.k, self.v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o(y.transpose(1, 2).reshape(B, T, -1))


@torch.library.custom_op("zoo::mix_heads", mutates_args=())
def mix_heads(x: Tensor) -> Tensor:
    """A kernel of the user's own, as flash-attn's are: torch's DTensor has no rule for placing it."""
    return x.flip(-2).clone()


@mix_heads.register_fake
def _(x: Tensor) -> Tensor:
    return torch.empty_like(x)


class CustomKernelAttention(ConstantHeadsAttention):
    """Reshapes with its input's width, then calls its own kernel."""

    def forward(self, x: Tensor) -> Tensor:
        B, T, C = x.shape
        y = mix_heads(self.q(x).view(B, T, HEADS, C // HEADS))
        return self.o(y.reshape(B, T, C))


class RelativeBiasAttention(ConstantHeadsAttention):
    """Attention only the global layout runs (its bias holds every head), with the two things that stopped its
    backward there inside lightdist (``to_local`` given a DTensor gradient): it adds its input back after the output
    projection, as BLOOM's attention adds the residual, and a learned bias per head that it looks up with plain
    positions, as T5's relative positions do."""

    def __init__(self, width: int) -> None:
        super().__init__(width)
        self.relative = nn.Embedding(64, HEADS)

    def forward(self, x: Tensor) -> Tensor:
        B, T, C = x.shape
        q, k, v = (proj(x).view(B, T, HEADS, -1).transpose(1, 2) for proj in (self.q, self.k, self.v))
        positions = torch.arange(T, device=x.device)
        bias = self.relative(positions[None, :] - positions[:, None] + T).permute(2, 0, 1)  # (HEADS, T, T)
        causal = torch.full((T, T), float("-inf"), device=x.device).triu(1)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=bias + causal)
        return x + self.o(y.transpose(1, 2).reshape(B, T, C))


class Block(nn.Module):
    def __init__(self, attention: type[nn.Module], width: int = 32) -> None:
        super().__init__()
        self.attn = attention(width)
        self.mlp = nn.Sequential()
        self.mlp.fc1, self.mlp.act, self.mlp.fc2 = nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width)

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.attn(x)
        return x + self.mlp(x)


class MLPInBlock(nn.Module):
    """fc1 and fc2 in the block itself, as OPT's: the block is a unit, its attention a unit inside it."""

    def __init__(self, attention: type[nn.Module], width: int = 32) -> None:
        super().__init__()
        self.attn = attention(width)
        self.fc1, self.fc2 = nn.Linear(width, 4 * width), nn.Linear(4 * width, width)

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.attn(x)
        return x + self.fc2(F.gelu(self.fc1(x)))


class TinyLM(nn.Module):
    def __init__(self, attention: type[nn.Module], block: type[nn.Module] = Block) -> None:
        super().__init__()
        self.embed = nn.Embedding(64, 32)
        self.blocks = nn.ModuleList(block(attention) for _ in range(2))
        self.head = nn.Linear(32, 64)

    def forward(self, tokens: Tensor) -> Tensor:
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def layouts_and_reports(model: nn.Module) -> tuple[dict[str, str], list[str]]:
    stack = find_decoder_stack(model)
    reports: list[str] = []
    layouts = probe_layouts(
        model, stack, discover_plan(model, stack), init_device_mesh("cpu", (2,)), report=reports.append
    )
    return layouts, reports


def split_differences(
    model: nn.Module, loss_of: Callable, *, layouts: dict[str, str] | None = None, sequence_parallel: bool = True
) -> tuple[float, float]:
    """``model`` split over the two ranks in ``layouts`` (by default the check's), against its unsplit copy: the
    difference of the loss and the largest of the gradients'."""
    tokens = torch.arange(64).view(2, 32) % 64
    whole = copy.deepcopy(model)
    expected = loss_of(whole, tokens)
    expected.backward()
    stack = find_decoder_stack(model)
    mesh = init_device_mesh("cpu", (2,))
    plan = discover_plan(model, stack)
    if layouts is None:
        layouts = probe_layouts(model, stack, plan, mesh, report=lambda line: None)
    apply_tensor_parallel(model, stack, mesh, plan=plan, layouts=layouts, sequence_parallel=sequence_parallel)
    loss = loss_of(model, tokens)
    loss.backward()
    gradients = zip(model.parameters(), whole.parameters(), strict=True)
    return abs(loss.item() - expected.item()), max(
        (p.grad.full_tensor() - q.grad).abs().max().item() for p, q in gradients
    )


def labels_loss(model: nn.Module, tokens: Tensor) -> Tensor:
    return model(input_ids=tokens, labels=tokens).loss


def next_token_loss(model: nn.Module, tokens: Tensor) -> Tensor:
    return F.cross_entropy(model(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten())


def global_layout_differences() -> dict[str, tuple[float, float]]:
    """Code run in the global layout, against one process. Hugging Face Llama with its attention and MLP forced to
    it: its rotary tables reach backward, and it builds a key/value cache every step. Attention adding the residual
    and a looked-up bias inside it, without sequence parallelism (the stream between blocks plain tensors). An
    OPT-style block forced global, with its attention left to run fast inside it."""
    torch.manual_seed(0)
    llama = MODELS["zoo_hf_llama_labels"](learning_rate=1e-3, warmup_steps=2).model
    return {
        "hf_llama": split_differences(llama, labels_loss, layouts={"self_attn": "global", "mlp": "global"}),
        "relative_bias": split_differences(TinyLM(RelativeBiasAttention), next_token_loss, sequence_parallel=False),
        "block_around_attention": split_differences(
            TinyLM(ConstantHeadsAttention, MLPInBlock), next_token_loss, layouts={"": "global"}, sequence_parallel=False
        ),
    }


def global_state_dict_difference() -> float:
    """nanoGPT with its attention global (fused c_attn split plainly) saves what the unsplit model saves."""
    torch.manual_seed(0)
    model = MODELS["zoo_nanogpt"](learning_rate=1e-3, warmup_steps=2)
    whole = copy.deepcopy(model.state_dict())
    stack = find_decoder_stack(model)
    mesh = init_device_mesh("cpu", (2,))
    apply_tensor_parallel(model, stack, mesh, plan=discover_plan(model, stack), layouts={"attn": "global"})
    saved = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    assert saved.keys() == whole.keys()
    return max((saved[name] - whole[name]).abs().max().item() for name in whole)


def probe_each() -> list:
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    try:
        zoo = {name: MODELS[name](learning_rate=1e-3, warmup_steps=2) for name in PROBED}
        probed = {name: layouts_and_reports(model) for name, model in zoo.items()}
        probed["constant_heads"] = layouts_and_reports(TinyLM(ConstantHeadsAttention))
        probed["relative_bias"] = layouts_and_reports(TinyLM(RelativeBiasAttention))
        return [
            probed,
            raised(layouts_and_reports, TinyLM(CustomKernelAttention)),
            global_layout_differences(),
            global_state_dict_difference(),
        ]
    finally:
        dist.destroy_process_group()


@cache
def probed_on_two_ranks() -> list:
    return run_ranks(2, probe_each)[0]


PROBED = [
    "llama",
    "hf_qwen2",
    "hf_opt",
    "hf_bloom",
    "zoo_nanogpt",
    "zoo_nanogpt_slow_attention",
    "zoo_hf_gpt2_labels",
    "zoo_litgpt",
    "zoo_hf_qwen3_logits",
]


def test_each_unit_runs_in_the_first_layout_that_computes_what_one_process_computes() -> None:
    probed, unsplittable, *_ = probed_on_two_ranks()
    layouts = {name: layouts for name, (layouts, _) in probed.items()}
    assert layouts == {
        # head counts in attributes (lightdist's Llama) or in Hugging Face's config: each rank runs its own heads
        "llama": {"self_attn": "fast", "mlp": "fast"},
        "hf_qwen2": {"self_attn": "fast", "mlp": "fast"},
        "hf_opt": {"self_attn": "fast", "": "fast"},  # fc1 and fc2 sit in the block itself
        # ALiBi biases given as (batch * heads, 1, keys), cut to each rank's heads; its attention probabilities
        # given back split by head
        "hf_bloom": {"self_attention": "fast", "mlp": "fast"},
        # nanoGPT reshapes with its input's width: no per-rank size can help, torch's DTensor places each op
        "zoo_nanogpt": {"attn": "global", "mlp": "fast"},
        # its slow path too: the causal mask sliced from a buffer meets DTensor scores, and their gradients in backward
        "zoo_nanogpt_slow_attention": {"attn": "global", "mlp": "fast"},
        # GPT-2 splits c_attn's output with split_size, LitGPT reads its heads from the config every block shares
        "zoo_hf_gpt2_labels": {"attn": "adapted", "mlp": "fast"},
        "zoo_litgpt": {"attn": "adapted", "mlp": "fast"},
        # runs on local shards, wrongly: caught by its output, not by an error
        "constant_heads": {"attn": "global", "mlp": "fast"},
        # right outputs on local shards, but q_norm's weight would see only its rank's heads: caught by its gradient
        "zoo_hf_qwen3_logits": {"self_attn": "global", "mlp": "fast"},
        # a bias of every head added to each rank's heads' scores: no local shape fits
        "relative_bias": {"attn": "global", "mlp": "fast"},
    }
    (qwen3_report,) = probed["zoo_hf_qwen3_logits"][1]
    assert "fast: a wrong gradient of q_norm.weight (relative error" in qwen3_report
    (nanogpt_report,) = probed["zoo_nanogpt"][1]
    assert nanogpt_report.startswith(
        "lightdist: model.transformer.h.*.attn (CausalSelfAttention) runs tensor-parallel global, since fast: "
        "ValueError: not enough values to unpack (expected 3, got 2) (at "
    )
    # each failure names the line of the model's own code it came from
    assert ": q, k, v = self.c_attn(x).split(self.n_embd, dim=2)); adapted: RuntimeError: shape" in nanogpt_report
    assert nanogpt_report.endswith("Per call it costs 1 all_gather_into_tensor, 1 all_reduce.")
    (constant_heads_report,) = probed["constant_heads"][1]
    assert "fast: wrong outputs (relative error" in constant_heads_report
    assert probed["llama"][1] == probed["hf_qwen2"][1] == probed["hf_bloom"][1] == []  # nothing to say: all fast
    assert unsplittable.startswith(
        "ValueError: Tensor parallelism cannot split blocks.*.attn (CustomKernelAttention) in any layout: fast: "
    )
    assert (
        "global: NotImplementedError: Operator zoo.mix_heads.default does not have a sharding strategy" in unsplittable
    )
    assert ": y = mix_heads(self.q(x).view(B, T, HEADS, C // HEADS)))" in unsplittable
    assert "Leave its projections out of tp_plan (they are then replicated)" in unsplittable


def test_plan_shows_each_module_layout_before_any_process_starts() -> None:
    """`lightdist plan --tp 2` runs the check in torch's fake process group, on the meta device: shapes only."""
    with torch.device("meta"):
        nanogpt = MODELS["zoo_nanogpt"](learning_rate=1e-3, warmup_steps=2)
    lines = format_plan(nanogpt, tp=2).splitlines()
    assert "  model.transformer.h.*.attn                       global" in lines
    assert "  model.transformer.h.*.mlp                        fast" in lines
    assert any(
        line.startswith("  model.transformer.h.*.attn (CausalSelfAttention) runs tensor-parallel global, since")
        for line in lines
    )
    assert not dist.is_initialized()


def test_any_unit_trains_in_the_global_layout_as_one_process_does() -> None:
    *_, differences, state_dict_difference = probed_on_two_ranks()
    assert differences.keys() == {"hf_llama", "relative_bias", "block_around_attention"}
    for name, (loss_difference, largest_gradient_difference) in differences.items():
        assert loss_difference < 1e-6, name
        assert largest_gradient_difference < 1e-6, name
    assert state_dict_difference == 0  # checkpoints hold the model's own layout, whatever layout runs


class NeedsAMask(TinyLM):
    """A forward that cannot run on token ids alone: the check cannot see its modules' inputs."""

    def forward(self, tokens: Tensor, mask: Tensor) -> Tensor:
        return super().forward(tokens * mask)


def test_a_model_the_check_cannot_run_gets_the_layout_right_for_any_code_and_says_why() -> None:
    with torch.device("meta"):
        model = NeedsAMask(ConstantHeadsAttention)
    lines = format_plan(model, tp=2).splitlines()
    assert "  blocks.*.attn                                    global" in lines
    (line,) = [line for line in lines if "could not check" in line]
    assert line.startswith(
        "  tensor parallelism could not check the layout of blocks.0 (running the model on 2 x 8 tokens"
    )
    assert "missing 1 required positional argument: 'mask'" in line
    assert "so its modules run global" in line
