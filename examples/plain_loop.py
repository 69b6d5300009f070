"""A plain PyTorch training loop, no Lightning: ``lightdist.parallelize`` splits a Hugging Face Llama over
tensor-parallel x ZeRO-3 data-parallel ranks, and the loop stays the one written for one device.

    pip install -e .[hf]
    torchrun --nproc-per-node 4 examples/plain_loop.py --tp 2    # 2 data-parallel x 2 tensor-parallel CPU ranks
    python examples/plain_loop.py                                # one process: the same losses
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist
from transformers import LlamaConfig, LlamaForCausalLM

from lightdist.layout import ParallelLayout
from lightdist.parallelize import ParallelConfig, parallelize


def main(argv: list[str] | None = None) -> list[float]:
    """Train for ``--steps`` steps; each step's loss over the whole batch, as every rank sees it."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks")
    parser.add_argument("--steps", type=int, default=5)
    args = parser.parse_args(argv)
    for name, value in {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29511", "RANK": "0", "WORLD_SIZE": "1"}.items():
        os.environ.setdefault(name, value)  # what torchrun sets, for one process without it
    dist.init_process_group("gloo")
    layout = ParallelLayout.resolve(
        dist.get_world_size(),
        data_parallel_size="auto",
        tensor_parallel_size=args.tp,
        pipeline_parallel_size=1,
        world_from="torchrun --nproc-per-node",
    )
    mesh = layout.build_mesh("cpu")
    torch.manual_seed(0)  # the same weights on every rank
    config = LlamaConfig(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
    model = LlamaForCausalLM(config)
    parallelize(model, mesh, ParallelConfig(zero_stage=3), report=print if dist.get_rank() == 0 else lambda line: None)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)

    dp, dp_rank = mesh["dp"].size(), mesh["dp"].get_local_rank()
    batches = torch.Generator().manual_seed(1)
    losses = []
    for step in range(args.steps):
        # The global batch, the same on every rank: runs of counting tokens from random starts, to learn.
        starts = torch.randint(0, config.vocab_size, (8, 1), generator=batches)
        batch = (starts + torch.arange(32)) % config.vocab_size
        tokens = batch.chunk(dp)[dp_rank]  # this data-parallel rank's share; its tensor-parallel peers share it too
        loss = model(input_ids=tokens, labels=tokens).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        whole = loss.detach().clone()
        dist.all_reduce(whole, group=mesh["dp"].get_group())
        losses.append(whole.item() / dp)
        if dist.get_rank() == 0:
            print(f"step {step}: loss {losses[-1]:.4f}")
    dist.destroy_process_group()
    return losses


if __name__ == "__main__":
    main()
