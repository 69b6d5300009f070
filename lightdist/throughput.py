"""Model FLOPs utilisation: the FLOPs a step must do, over what the device could do in the same time."""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["PEAK_TFLOPS", "device_peak_flops", "transformer_flops_per_token"]

# Dense bf16 tensor-core peaks from the vendors' datasheets, without sparsity.
PEAK_TFLOPS = {
    "H200": 989.0,
    "H100": 989.0,  # SXM; the PCIe card is lower and reported as "H100 PCIe"
    "H100 PCIe": 756.0,
    "A100": 312.0,
    "L40S": 362.0,
    "A10G": 125.0,
}


def transformer_flops_per_token(model: nn.Module, *, n_layers: int, dim: int, seq_len: int) -> float:
    """Training FLOPs per token of a decoder: 6 per weight that multiplies (forward 2, backward 4) plus attention.

    Embedding lookups are not matmuls and are left out; attention scores and values add ``12 * n_layers * dim *
    seq_len`` (PaLM's accounting, not halved for the causal mask).
    """
    embeddings = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    matmul_params = sum(p.numel() for p in model.parameters() if id(p) not in embeddings)
    tied = sum(m.weight.numel() for m in model.modules() if isinstance(m, nn.Linear) and id(m.weight) in embeddings)
    return 6.0 * (matmul_params + tied) + 12.0 * n_layers * dim * seq_len


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
