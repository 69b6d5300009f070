"""What context parallelism costs and saves: step time and activation memory per rank of one long sequence, at each
context-parallel size, by ring and by all-to-all.

A Llama of 2 blocks (width 256, 8 heads) takes a forward and backward of one sequence, on ``cp`` CPU ranks (gloo, one
thread each) holding 1/cp of it. Activation memory is what the forward keeps for backward besides the weights,
counted as it is saved (the peak a rank's backward starts from). Each rank sends, per block and step:

    ring:        3 x (cp - 1) x tokens / cp x key/value width x 2 x bytes   (keys and values around the ring forward;
                                                                             again, with their gradients, in backward)
    all-to-all:  8 x (cp - 1) / cp x tokens / cp x width x bytes            (q, k, v and the output, forward and back)

    python bench/context_parallel.py                        # 4k, 8k and 16k tokens; cp 1, 2 and 4
    python bench/context_parallel.py --lengths 4096 --sizes 1 2 --repeats 1
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from ranks import free_port, join_ranks
from torch import Tensor
from torch.distributed.device_mesh import init_device_mesh

from lightdist.context_parallel import ContextParallel
from lightdist.models.llama import LlamaConfig, LlamaModel

METHODS = ("ring", "all_to_all")


def build(max_seq_len: int) -> LlamaModel:
    torch.manual_seed(0)
    return LlamaModel(
        LlamaConfig(vocab_size=256, dim=256, n_layers=2, n_heads=8, n_kv_heads=8, ffn_dim=512, max_seq_len=max_seq_len)
    )


def step(model: LlamaModel, windows: Tensor, cp: ContextParallel | None) -> tuple[float, int]:
    """One forward and backward: its seconds and the activation bytes the forward kept."""
    weights = {parameter.data_ptr() for parameter in model.parameters()}
    saved = 0

    def keep(tensor: Tensor) -> Tensor:
        nonlocal saved
        if tensor.data_ptr() not in weights:
            saved += tensor.numel() * tensor.element_size()
        return tensor

    def loss_of(batch: Tensor) -> Tensor:
        return F.cross_entropy(model(batch[:, :-1]).flatten(0, 1), batch[:, 1:].flatten())

    start = time.perf_counter()
    with torch.autograd.graph.saved_tensors_hooks(keep, lambda tensor: tensor):
        if cp is None:
            loss = loss_of(windows)
        else:
            with cp.active():
                loss = loss_of(cp.shard_batch(windows))
    if cp is None:
        loss.backward()
    else:
        with cp.active():
            loss.backward()
    model.zero_grad(set_to_none=True)
    return time.perf_counter() - start, saved


def measure(rank: int, size: int, port: int, lengths: list[int], repeats: int, results) -> None:
    join_ranks(rank, size, port)
    if size > 1:
        dist.init_process_group("gloo")
        mesh = init_device_mesh("cpu", (size,), mesh_dim_names=("cp",))["cp"]
    model = build(max(lengths))
    for seq_len in lengths:
        windows = torch.randint(0, 256, (1, seq_len + 1), generator=torch.Generator().manual_seed(seq_len))
        for method in METHODS if size > 1 else ("none",):
            cp = ContextParallel(mesh, method, model) if size > 1 else None
            step(model, windows[:, : 2 * 4 * size + 1], cp)  # warm-up
            runs = [step(model, windows, cp) for _ in range(repeats)]
            if rank == 0:
                seconds = statistics.median(run[0] for run in runs)
                results.put((seq_len, size, method, seconds, runs[0][1]))
    if size > 1:
        dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lengths", type=int, nargs="+", default=[4096, 8192, 16384])
    parser.add_argument("--sizes", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    context = mp.get_context("spawn")
    results = context.Queue()
    rows = []
    for size in args.sizes:
        port = free_port()
        ranks = [
            context.Process(target=measure, args=(rank, size, port, args.lengths, args.repeats, results))
            for rank in range(size)
        ]
        for process in ranks:
            process.start()
        rows += [results.get() for _ in range(len(args.lengths) * (len(METHODS) if size > 1 else 1))]
        for process in ranks:
            process.join()
            if process.exitcode:
                raise SystemExit(f"cp={size}: a rank failed (exit code {process.exitcode})")
    one_rank = {seq_len: saved for seq_len, size, _, _, saved in rows if size == 1}
    print("| tokens | cp | attention | step (s) | activations per rank (MiB) | x one rank's |")
    print("|---|---|---|---|---|---|")
    for seq_len, size, method, seconds, saved in sorted(rows):
        share = f"{saved / one_rank[seq_len]:.2f}" if seq_len in one_rank else ""
        print(f"| {seq_len} | {size} | {method} | {seconds:.3f} | {saved / 2**20:.1f} | {share} |")


if __name__ == "__main__":
    main()
