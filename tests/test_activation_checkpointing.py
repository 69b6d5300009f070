"""Selective activation checkpointing keeps the outputs of the ops SDPA runs, found by asking SDPA on this device."""

from __future__ import annotations

import pytest
import torch
from torch import Tensor, nn
from torch.fx.experimental.proxy_tensor import make_fx
from torch.nn.functional import scaled_dot_product_attention

from lightdist.activation_checkpointing import apply_activation_checkpointing, attention_ops


class Attention(nn.Module):
    def forward(self, x: Tensor) -> Tensor:
        return scaled_dot_product_attention(x, x, x).sin()


def _ops(traced: torch.fx.GraphModule) -> list:
    return [node.target for node in traced.graph.nodes if node.op == "call_function"]


@pytest.mark.parametrize(("mode", "attention_runs"), [("selective", 1), ("full", 2)])
def test_selective_checkpointing_keeps_the_attention_output_rather_than_recompute_it(
    mode: str, attention_runs: int
) -> None:
    x = torch.randn(1, 2, 16, 64, requires_grad=True)
    found = attention_ops("cpu")  # found first: tracing would record the ops finding them runs
    assert len(found & set(_ops(make_fx(scaled_dot_product_attention)(x, x, x)))) == 1  # the op SDPA dispatches to

    block = Attention()
    apply_activation_checkpointing([block], mode=mode)
    forward_and_backward = make_fx(lambda x: torch.autograd.grad(block(x).sum(), x))(x)
    assert sum(op in found for op in _ops(forward_and_backward)) == attention_runs
