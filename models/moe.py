"""A Llama-style Mixture-of-Experts decoder: each block's MLP is ``n_experts`` SwiGLU experts, ``top_k`` per token.

The experts module is laid out as Hugging Face transformers 5 lays out Mixtral's: every expert's weights stacked on
dim 0 (``gate_up_proj`` ``[E, 2F, H]``, ``down_proj`` ``[E, H, F]``), called with the routed tokens. The router's
load-balancing loss (Switch Transformer's, over this rank's tokens, as Megatron and Hugging Face compute it) reaches
training through its gradient, injected in backward as Megatron's ``MoEAuxLossAutoScaler`` does: the model returns
logits alone, so its loss is the language-model loss under any pipeline, and each layer keeps its last
``aux_loss`` for logging.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from lightdist.models.llama import LlamaConfig, LlamaModel
from lightdist.models.lm import PresetCausalLM

__all__ = ["MOE_PRESETS", "MoELlama", "MoELlamaConfig", "MoELlamaModel"]


@dataclass(frozen=True)
class MoELlamaConfig(LlamaConfig):
    n_experts: int = 8
    top_k: int = 2
    aux_loss_coef: float = 0.01  # the load-balancing loss's weight in the gradient

    def __post_init__(self) -> None:
        super().__post_init__()
        if not 1 <= self.top_k <= self.n_experts:
            raise ValueError(f"top_k={self.top_k} must be between 1 and n_experts={self.n_experts}.")


MOE_PRESETS: dict[str, MoELlamaConfig] = {
    # CPU tests and demos: 8 experts of 64 hidden units, 2 per token.
    "tiny": MoELlamaConfig(vocab_size=64, dim=64, n_layers=4, n_heads=4, n_kv_heads=2, ffn_dim=64, max_seq_len=256),
    # Mixtral 8x7B's shape.
    "8x7b": MoELlamaConfig(
        vocab_size=32000, dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, ffn_dim=14336, rope_theta=1e6
    ),
}


class AuxLossGradient(torch.autograd.Function):
    """Identity on the layer's output; in backward, gives ``aux_loss`` the gradient ``coef``, as if ``coef *
    aux_loss`` had been added to the loss (Megatron's ``MoEAuxLossAutoScaler``)."""

    @staticmethod
    def forward(ctx, output: Tensor, aux_loss: Tensor, coef: float) -> Tensor:
        ctx.save_for_backward(aux_loss)
        ctx.coef = coef
        return output

    @staticmethod
    def backward(ctx, grad_output: Tensor) -> tuple[Tensor, Tensor, None]:
        (aux_loss,) = ctx.saved_tensors
        return grad_output, torch.full_like(aux_loss, ctx.coef), None


class Experts(nn.Module):
    """``n_experts`` SwiGLU MLPs, their weights stacked; each token's output is its experts' sum by routing weight."""

    def __init__(self, cfg: MoELlamaConfig) -> None:
        super().__init__()
        self.num_experts = cfg.n_experts
        self.gate_up_proj = nn.Parameter(torch.empty(cfg.n_experts, 2 * cfg.ffn_dim, cfg.dim))
        self.down_proj = nn.Parameter(torch.empty(cfg.n_experts, cfg.dim, cfg.ffn_dim))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        for weight in (self.gate_up_proj, self.down_proj):
            nn.init.normal_(weight, std=weight.size(-1) ** -0.5)

    def forward(self, tokens: Tensor, expert_index: Tensor, weights: Tensor) -> Tensor:
        """``tokens`` (N, H), each routed to ``expert_index`` (N, K) with ``weights`` (N, K)."""
        out = torch.zeros_like(tokens)
        pairs = expert_index.flatten()
        order = torch.argsort(pairs, stable=True)
        counts = torch.bincount(pairs, minlength=self.num_experts).tolist()
        for expert, chosen in enumerate(order.split(counts)):
            if not len(chosen):
                continue
            rows = chosen // expert_index.size(-1)
            gate, up = F.linear(tokens[rows], self.gate_up_proj[expert]).chunk(2, dim=-1)
            y = F.linear(F.silu(gate) * up, self.down_proj[expert])
            out.index_add_(0, rows, y * weights.flatten()[chosen, None])
        return out


class MoE(nn.Module):
    def __init__(self, cfg: MoELlamaConfig) -> None:
        super().__init__()
        self.top_k, self.aux_loss_coef = cfg.top_k, cfg.aux_loss_coef
        self.gate = nn.Linear(cfg.dim, cfg.n_experts, bias=False)
        self.experts = Experts(cfg)
        self.aux_loss: Tensor | None = None

    def forward(self, x: Tensor) -> Tensor:
        tokens = x.flatten(0, 1)
        probs = F.softmax(self.gate(tokens).float(), dim=-1)
        weights, expert_index = torch.topk(probs, self.top_k, dim=-1)
        weights = weights / weights.sum(dim=-1, keepdim=True)
        out = self.experts(tokens, expert_index, weights.to(tokens.dtype)).view_as(x)
        # Switch Transformer's load-balancing loss: E * sum_e (share of routed pairs to e) * (mean probability of e).
        counts = torch.bincount(expert_index.flatten(), minlength=probs.size(-1))
        aux_loss = probs.size(-1) * (counts / expert_index.numel() * probs.mean(dim=0)).sum()
        self.aux_loss = aux_loss.detach()
        return AuxLossGradient.apply(out, aux_loss, self.aux_loss_coef) if self.training else out


class MoELlamaModel(LlamaModel):
    """Token ids (B, T) to logits (B, T, vocab)."""

    def __init__(self, cfg: MoELlamaConfig) -> None:
        super().__init__(cfg, mlp=MoE)


class MoELlama(PresetCausalLM):
    """The reference MoE Llama as a LightningModule: ``train_loss`` is the language-model loss, and
    ``train_aux_loss`` the layers' mean load-balancing loss on this rank's tokens."""

    presets = MOE_PRESETS
    network = MoELlamaModel

    def training_step(self, batch: Tensor, batch_idx: int) -> Tensor:
        loss = super().training_step(batch, batch_idx)
        aux = [layer.mlp.aux_loss for layer in self.model.layers if layer.mlp.aux_loss is not None]
        if aux:
            self.log("train_aux_loss", torch.stack(aux).mean(), sync_dist=True)
        return loss
