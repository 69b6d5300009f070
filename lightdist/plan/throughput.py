"""Model FLOPs utilisation: the FLOPs a step must do, over what the device could do in the same time."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from lightdist.parallel.expert_parallel import find_experts
from lightdist.parallel.structure import find_decoder_stack, find_repeated_blocks

__all__ = ["PEAK_TFLOPS", "DecoderFlops", "device_peak_flops"]

# Dense bf16 tensor-core peaks from the vendors' datasheets, without sparsity.
PEAK_TFLOPS = {
    "H200": 989.0,
    "H100": 989.0,  # SXM; the PCIe card is lower and reported as "H100 PCIe"
    "H100 PCIe": 756.0,
    "A100": 312.0,
    "L40S": 362.0,
    "A10G": 125.0,
}


@dataclass(frozen=True)
class DecoderFlops:
    """A decoder's training FLOPs per token, in PaLM's accounting (the one MFU figures are quoted in).

    Each weight that multiplies costs 6 FLOPs per token (forward 2, backward 4); attention scores and values add
    ``12 * n_layers * dim * seq_len``, not halved for the causal mask. Embedding lookups are not matmuls and are left
    out, unless the LM head multiplies by the embedding's weight. A Mixture-of-Experts layer counts the experts a
    token runs through, ``top_k`` of them.
    """

    matmul_params: int
    n_layers: int
    dim: int

    @classmethod
    def of(cls, model: nn.Module, *, n_layers: int | None = None, dim: int | None = None) -> DecoderFlops:
        """Count ``model`` as it is built, before any parallelism splits it; the depth is its decoder stack's and
        the width its token embedding's (the largest table) unless given. Without a block ``ModuleList``, the depth is
        the count of its repeated blocks."""
        embeddings = [m for m in model.modules() if isinstance(m, nn.Embedding)]
        lookups = {id(m.weight) for m in embeddings}
        matmul_params = sum(p.numel() for p in model.parameters() if id(p) not in lookups)
        matmul_params += sum(
            m.weight.numel() for m in model.modules() if isinstance(m, nn.Linear) and id(m.weight) in lookups
        )
        experts = find_experts(model)
        if experts is not None:
            matmul_params -= experts.idle_parameters(model)
        if n_layers is None:
            try:
                n_layers = len(find_decoder_stack(model))
            except ValueError:
                n_layers = len(find_repeated_blocks(model))
                if not n_layers:
                    raise
        if dim is None:
            dim = max(embeddings, key=lambda m: m.num_embeddings).embedding_dim
        return cls(matmul_params=matmul_params, n_layers=n_layers, dim=dim)

    def per_token(self, seq_len: int) -> float:
        return 6.0 * self.matmul_params + 12.0 * self.n_layers * self.dim * seq_len


def device_peak_flops(device: torch.device, override_tflops: float | None = None) -> float | None:
    """Peak bf16 FLOP/s of ``device``: the override if given, else the table; ``None`` where unknown (CPUs)."""
    if override_tflops is not None:
        return override_tflops * 1e12
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    for key in sorted(PEAK_TFLOPS, key=len, reverse=True):
        if key in name:
            return PEAK_TFLOPS[key] * 1e12
    return None
