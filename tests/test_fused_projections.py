"""A Linear computing q, k and v at once (GPT-2's ``c_attn``), or gate and up, splits so each rank holds its heads of
every part, computes what one process computes, and saves in the model's own layout."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from torch import Tensor, nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

from lightdist.models import GPT2
from lightdist.parallel.structure import find_decoder_stack
from lightdist.parallel.tensor import discover_plan

from multirank import run_ranks, split_over_two_ranks

pytestmark = pytest.mark.multirank

TOKENS = torch.arange(64).view(2, 32) % 64


def rows_of_each_part(weight: Tensor, parts: int, rank: int, ranks: int = 2) -> Tensor:
    """This rank's share of every part of a fused weight: ``[q_rank | k_rank | v_rank]``."""
    return torch.cat([part.chunk(ranks)[rank] for part in weight.chunk(parts)])


def split_gpt2(checkpoint: str) -> dict:
    torch.manual_seed(0)
    model = GPT2("tiny")  # with biases: the fused bias is split like the weight
    whole = {name: tensor.clone() for name, tensor in model.state_dict().items()}
    expected = model.model(TOKENS).detach()
    with split_over_two_ranks(model, sequence_parallel=True):
        attention = model.model.h[0].attn
        rank = dist.get_rank()
        dcp.save(get_model_state_dict(model), checkpoint_id=checkpoint)
        return {
            "whole": whole,
            "expected": expected,
            "logits": model.model(TOKENS).detach(),
            "weight_is_mine": torch.equal(
                attention.c_attn.weight.to_local(), rows_of_each_part(whole["model.h.0.attn.c_attn.weight"], 3, rank)
            ),
            "bias_is_mine": torch.equal(
                attention.c_attn.bias.to_local(), rows_of_each_part(whole["model.h.0.attn.c_attn.bias"], 3, rank)
            ),
            "full_state_dict": get_model_state_dict(model, options=StateDictOptions(full_state_dict=True)),
        }


def test_fused_qkv_holds_whole_heads_of_q_k_and_v_and_saves_the_model_layout(tmp_path: Path) -> None:
    model = GPT2("tiny")
    assert discover_plan(model, find_decoder_stack(model))["model.h.0.attn.c_attn"] == "qkv"
    checkpoint = str(tmp_path / "tp2")
    rank0, rank1 = run_ranks(2, split_gpt2, checkpoint)

    assert rank0["weight_is_mine"] and rank1["weight_is_mine"]
    assert rank0["bias_is_mine"] and rank1["bias_is_mine"]
    torch.testing.assert_close(rank0["logits"], rank0["expected"], rtol=1e-5, atol=1e-5)
    for name, tensor in rank0["whole"].items():
        torch.testing.assert_close(rank0["full_state_dict"][name], tensor, rtol=0, atol=0, msg=name)
    # The sharded checkpoint loads into one unsplit process as its own weights.
    one_process = GPT2("tiny").state_dict()
    dcp.load(one_process, checkpoint_id=checkpoint, no_dist=True)
    for name, tensor in rank0["whole"].items():
        torch.testing.assert_close(one_process[name], tensor, rtol=0, atol=0, msg=name)


class FusedMLP(nn.Module):
    """Phi-3's MLP: gate and up in one Linear, separated by ``chunk``."""

    def __init__(self, width: int = 16, hidden: int = 32) -> None:
        super().__init__()
        self.gate_up_proj = nn.Linear(width, 2 * hidden, bias=False)
        self.down_proj = nn.Linear(hidden, width, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.mlp = FusedMLP()

    def forward(self, x: Tensor) -> Tensor:
        return x + self.mlp(x)


def split_fused_mlp() -> tuple[Tensor, Tensor, Tensor, Tensor]:
    torch.manual_seed(0)
    model = nn.Sequential()
    model.layers = nn.ModuleList(Block() for _ in range(2))
    x = torch.randn(2, 8, 16, requires_grad=True)

    def loss_and_input_grad() -> tuple[Tensor, Tensor]:
        loss = (model.layers[1](model.layers[0](x)) ** 2).mean()
        (grad,) = torch.autograd.grad(loss, x)
        return loss.detach(), grad

    expected = loss_and_input_grad()
    plan = {"layers.*.mlp.gate_up_proj": "gate_up", "layers.*.mlp.down_proj": "rowwise"}
    with split_over_two_ranks(model, sequence_parallel=False, tp_plan=plan):
        return (*expected, *loss_and_input_grad())


def test_fused_gate_up_computes_what_one_process_computes() -> None:
    expected_loss, expected_grad, loss, grad = run_ranks(2, split_fused_mlp)[0]
    torch.testing.assert_close(loss, expected_loss, rtol=1e-6, atol=0)
    torch.testing.assert_close(grad, expected_grad, rtol=1e-5, atol=1e-7)
