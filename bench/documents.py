"""What document masks cost: a forward and backward of one packed sequence, attention under the causal mask against
attention within each document (``document_end_token``: SDPA's causal kernel on each document's slice), at each
length.

A Llama (by default 2 blocks, width 256, 8 heads) on one sequence of documents of ``--document`` tokens each (the
end token closing each). Within documents, attention computes the documents' scores only: the table shows their share
of the causal mask's beside the step times.

    python bench/documents.py                                  # 1k to 16k tokens on CPU
    python bench/documents.py --device cuda --lengths 4096 16384 65536
    python bench/documents.py --compile                        # each block compiled, as compile=True does
"""

from __future__ import annotations

import argparse
import statistics
import time
from contextlib import nullcontext

import torch
import torch.nn.functional as F
from context_parallel import build

from lightdist.models.llama import LlamaModel
from lightdist.parallel.compiled_blocks import compile_block
from lightdist.parallel.documents import attention_within_documents
from lightdist.parallel.structure import find_repeated_blocks

END = 0  # the token that ends each document


def packed(length: int, document: int, device: torch.device) -> torch.Tensor:
    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(1, 256, (1, length + 1), generator=generator)
    tokens[:, document - 1 :: document] = END
    return tokens.to(device)


def step_seconds(model: LlamaModel, tokens: torch.Tensor, masked: bool, repeats: int) -> float:
    times = []
    for _ in range(repeats + 1):  # the first, a warm-up
        model.zero_grad(set_to_none=True)
        if tokens.is_cuda:
            torch.cuda.synchronize()
        started = time.perf_counter()
        with attention_within_documents(model, tokens, END) if masked else nullcontext():
            logits = model(tokens[:, :-1])
            loss = F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
            loss.backward()
        if tokens.is_cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - started)
    return statistics.median(times[1:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[1024, 4096, 8192, 16384])
    parser.add_argument("--document", type=int, default=512, help="tokens per document, its end token included")
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--compile", action="store_true", help="compile each block (the warm-up step compiles)")
    args = parser.parse_args()
    device = torch.device(args.device)
    model = build(args, device)  # the context-parallel benchmark's Llama, of the same options
    for name in find_repeated_blocks(model) if args.compile else []:
        compile_block(model.get_submodule(name))
    blocks = f"{args.layers} blocks{', compiled' if args.compile else ''}"
    print(f"documents of {args.document} tokens; {blocks}, width {args.dim}, {args.heads} heads, {device}")
    print("| tokens | causal step | step within documents | ratio | scores computed |")
    print("|---|---|---|---|---|")
    for length in args.lengths:
        tokens = packed(length, args.document, device)
        causal, masked = (step_seconds(model, tokens, masked, args.repeats) for masked in (False, True))
        whole, rest = divmod(length, args.document)
        scores = whole * args.document * (args.document + 1) + rest * (rest + 1)
        share = scores / (length * (length + 1))  # of the causal mask's scores
        print(f"| {length} | {causal * 1e3:.0f} ms | {masked * 1e3:.0f} ms | {masked / causal:.2f} | {share:.1%} |")


if __name__ == "__main__":
    main()
