"""What context parallelism costs and saves: step time and activation memory per rank of one long sequence, at each
context-parallel size, by ring and by all-to-all.

A Llama (by default 2 blocks, width 256, 8 heads) takes a forward and backward of one sequence on ``cp`` ranks holding
1/cp of it, joined by gloo: on CPU one thread each; with ``--device cuda`` all on the one GPU (NCCL refuses two ranks
a GPU; gloo passes CUDA tensors through host memory), so that each rank's memory is what a rank of its own GPU holds,
but the ranks share the GPU's time and their exchanges go through the host: cp > 1 step times there are no multi-GPU
figures. Activation memory is what the forward keeps for backward besides the weights, counted as it is saved (the
peak a rank's backward starts from); on a GPU, the step's peak allocation above the weights is shown too, and the
loss, which each size computes alike. Each rank sends, per block and step:

    ring:        3 x (cp - 1) x tokens / cp x key/value width x 2 x bytes   (keys and values around the ring forward;
                                                                             again, with their gradients, in backward)
    all-to-all:  8 x (cp - 1) / cp x tokens / cp x width x bytes            (q, k, v and the output, forward and back)

With ``--document N`` the sequence packs documents of N tokens (``document_end_token``: attention within each), and
the last column says how even the ranks' work is: the busiest rank's CPU time in a step over the least busy's (on CPU
ranks; a step's wall time is every rank's alike, as they wait for each other at each attention). Both methods slice
each rank's attention by document, and deal the sequence's chunks out by the work their documents give them.

    python bench/context_parallel.py                        # 4k, 8k and 16k tokens; cp 1, 2 and 4
    python bench/context_parallel.py --lengths 4096 --sizes 1 2 --repeats 1
    python bench/context_parallel.py --lengths 8192 16384 --sizes 2 --document 128
    python bench/context_parallel.py --lengths 16384 --sizes 2 4 --document 3000 --varied   # lengths drawn
    python bench/context_parallel.py --lengths 8192 --sizes 2 --document 128 --compile   # blocks compiled
    python bench/context_parallel.py --device cuda --precision bf16-mixed --dim 2048 --heads 16 --layers 4 \
        --lengths 16384 65536 --sizes 1 2
"""

from __future__ import annotations

import argparse
import queue
import statistics
import time
import traceback
from contextlib import ExitStack, nullcontext
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from ranks import free_port, join_ranks
from torch import Tensor
from torch.distributed.device_mesh import init_device_mesh

from lightdist.models.llama import LlamaConfig, LlamaModel
from lightdist.parallel.compiled_blocks import compile_block
from lightdist.parallel.context import ContextParallel
from lightdist.parallel.documents import DocumentMasks

METHODS = ("ring", "all_to_all")
END = 0  # the token that ends each document, with --document


def build(args: argparse.Namespace, device: torch.device) -> LlamaModel:
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=256,
        dim=args.dim,
        n_layers=args.layers,
        n_heads=args.heads,
        n_kv_heads=args.heads,
        ffn_dim=2 * args.dim,
        max_seq_len=max(args.lengths),
    )
    return LlamaModel(config).to(device)


def step(
    model: LlamaModel, windows: Tensor, cp: ContextParallel | None, bf16: bool, documents: DocumentMasks | None
) -> tuple[float, int, int, float, float]:
    """One forward and backward (within the ``documents`` of ``windows``, where given): its seconds, the activation
    bytes the forward kept, the peak bytes allocated above what was before (on a GPU), the loss over the whole
    sequence, and the seconds this process computed (its CPU time: not the waits on other ranks)."""
    weights = {parameter.data_ptr() for parameter in model.parameters()}
    saved = 0

    def keep(tensor: Tensor) -> Tensor:
        nonlocal saved
        if tensor.data_ptr() not in weights:
            saved += tensor.numel() * tensor.element_size()
        return tensor

    def loss_of(batch: Tensor) -> Tensor:
        with torch.autocast(windows.device.type, torch.bfloat16) if bf16 else nullcontext():
            return F.cross_entropy(model(batch[:, :-1]).flatten(0, 1).float(), batch[:, 1:].flatten())

    on_gpu = windows.device.type == "cuda"
    if on_gpu:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
    start, started_computing = time.perf_counter(), time.process_time()
    if documents is not None:
        documents.see(windows)
    with torch.autograd.graph.saved_tensors_hooks(keep, lambda tensor: tensor), split(cp, documents):
        loss = loss_of(windows if cp is None else cp.shard_batch(windows))
    with split(cp, documents):
        loss.backward()
    if on_gpu:
        torch.cuda.synchronize()
    seconds, computing = time.perf_counter() - start, time.process_time() - started_computing
    peak = torch.cuda.max_memory_allocated() - before if on_gpu else 0
    model.zero_grad(set_to_none=True)
    if cp is not None:  # each rank's mean over its half of the tokens; the sequence's is their mean
        loss = loss.detach().clone()
        dist.all_reduce(loss)
        loss /= cp.size
    return seconds, saved, peak, loss.item(), computing


def document_ends(seq_len: int, document: int, varied: bool) -> Tensor:
    """Where each packed document ends in a window of ``seq_len + 1`` tokens: every ``document`` tokens, or
    ``varied``, after lengths drawn between a third and twice ``document`` (the first cut short, as a window cuts a
    stream), seeded."""
    if not varied:
        return torch.arange(document - 1, seq_len + 1, document)
    generator = torch.Generator().manual_seed(seq_len)
    shortest = max(document // 3, 1)
    lengths = torch.randint(shortest, 2 * document, (seq_len // shortest + 2,), generator=generator)
    ends = lengths.cumsum(0) - lengths[0] // 2 - 1
    return ends[(ends >= 0) & (ends <= seq_len)]


def split(cp: ContextParallel | None, documents: DocumentMasks | None) -> ExitStack:
    """Attention within the ``documents`` (where given), then the split's, as lightdist's steps enter them."""
    stack = ExitStack()
    for context in (documents, cp):
        if context is not None:
            stack.enter_context(context.active())
    return stack


def measure(rank: int, size: int, port: int, args: argparse.Namespace, results) -> None:
    join_ranks(rank, size, port)
    device = torch.device(args.device)
    if size > 1:
        dist.init_process_group("gloo", timeout=timedelta(seconds=300))
        mesh = init_device_mesh("cpu", (size,), mesh_dim_names=("cp",))["cp"]
    model = build(args, device)
    for block in model.layers if args.compile else []:
        compile_block(block)
    bf16 = args.precision == "bf16-mixed"
    for seq_len in args.lengths:
        windows = torch.randint(1, 256, (1, seq_len + 1), generator=torch.Generator().manual_seed(seq_len))
        if args.document:
            windows[:, document_ends(seq_len, args.document, args.varied)] = END
        windows = windows.to(device)
        for method in METHODS if size > 1 else ("none",):
            cp = ContextParallel(mesh, method, model) if size > 1 else None
            documents = DocumentMasks(END) if args.document else None
            if cp is not None and documents is not None:
                cp.attend_within(documents)
            try:
                warm_up = windows if args.compile else windows[:, : 2 * 4 * size + 1]  # compiled, at this length
                step(model, warm_up, cp, bf16, documents)
                runs = [step(model, windows, cp, bf16, documents) for _ in range(args.repeats)]
            except torch.OutOfMemoryError:
                model.zero_grad(set_to_none=True)
                torch.cuda.empty_cache()
                runs, error = [], "out of memory"
            except Exception:  # the row says what failed, and the next ones still run
                runs, error = [], traceback.format_exc()
            seconds = statistics.median(run[0] for run in runs) if runs else 0.0
            # Each rank's work: its CPU time on CPU ranks (a step's wall time is every rank's alike, as the ranks
            # wait for each other at every attention), its step's on a shared GPU.
            work = statistics.median(run[4 if device.type == "cpu" else 0] for run in runs) if runs else 0.0
            ranks_work = [work]
            if size > 1:
                ranks_work = [None] * size
                dist.all_gather_object(ranks_work, work)
            if rank == 0:
                if runs:
                    spread = max(ranks_work) / min(ranks_work)
                    results.put((seq_len, size, method, seconds, *runs[0][1:4], spread, ""))
                else:
                    results.put((seq_len, size, method, 0.0, 0, 0, 0.0, 0.0, error))
    if size > 1:
        dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lengths", type=int, nargs="+", default=[4096, 8192, 16384])
    parser.add_argument("--sizes", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--precision", choices=["32-true", "bf16-mixed"], default="32-true")
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--document", type=int, help="tokens per packed document, its end token included")
    parser.add_argument("--varied", action="store_true", help="documents between a third and twice --document long")
    parser.add_argument("--compile", action="store_true", help="compile each block (the warm-up step compiles)")
    parser.add_argument("--size-timeout", type=float, default=600.0, help="seconds for all lengths at one size")
    args = parser.parse_args()
    context = mp.get_context("spawn")
    results = context.Queue()
    rows = []
    for size in args.sizes:
        port = free_port()
        ranks = [context.Process(target=measure, args=(rank, size, port, args, results)) for rank in range(size)]
        for process in ranks:
            process.start()
        deadline = time.monotonic() + args.size_timeout
        try:
            for _ in range(len(args.lengths) * (len(METHODS) if size > 1 else 1)):
                rows.append(results.get(timeout=max(deadline - time.monotonic(), 1)))
                seq_len, _, method, seconds, *_, error = rows[-1]
                outcome = error.strip().splitlines()[-1] if error else f"{seconds:.3f} s"
                print(f"cp={size}, {method}, {seq_len} tokens: {outcome}")
        except queue.Empty:
            print(f"cp={size}: no result within --size-timeout {args.size_timeout:.0f} s; its ranks are stopped")
        for process in ranks:
            process.join(timeout=max(deadline - time.monotonic(), 1))
            if process.is_alive():
                process.kill()
            elif process.exitcode:
                print(f"cp={size}: a rank failed (exit code {process.exitcode})")
    one_rank = {seq_len: saved for seq_len, size, _, _, saved, *_ in rows if size == 1 and saved}
    packing = f", documents of {args.document} tokens" if args.document else ""
    packing = f", documents of {args.document // 3} to {2 * args.document} tokens" if args.varied else packing
    print(f"{args.device}, {args.precision}, width {args.dim}, {args.heads} heads, {args.layers} blocks{packing}")
    print(
        "| tokens | cp | attention | step (s) | activations per rank (MiB) | x one rank's | peak (MiB) | loss | "
        "busiest rank / least busy |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for seq_len, size, method, seconds, saved, peak, loss, spread, error in sorted(rows):
        if error:
            print(f"| {seq_len} | {size} | {method} | {error.strip().splitlines()[-1]} | | | | | |")
            continue
        share = f"{saved / one_rank[seq_len]:.2f}" if seq_len in one_rank else ""
        peak_mib = f"{peak / 2**20:.0f}" if peak else ""
        figures = f"{seconds:.3f} | {saved / 2**20:.1f} | {share} | {peak_mib} | {loss:.6f} | {spread:.2f}"
        print(f"| {seq_len} | {size} | {method} | {figures} |")
    for *_, error in rows:
        if error and error != "out of memory":
            print(error)


if __name__ == "__main__":
    main()
