"""The training loop the reference LLMs share: next-token cross-entropy, AdamW, linear warmup then cosine decay, and
validation loss and perplexity as torchmetrics metrics."""

from __future__ import annotations

import math
from dataclasses import replace
from typing import ClassVar, TypeVar

import torch
import torch.nn.functional as F
from lightning.pytorch import LightningModule
from torch import Tensor, nn
from torchmetrics.aggregation import MeanMetric

__all__ = ["CausalLM", "Perplexity", "PresetCausalLM", "resolve_preset"]

ConfigT = TypeVar("ConfigT")


def resolve_preset(presets: dict[str, ConfigT], preset: str, overrides: dict | None) -> ConfigT:
    """The named preset config with ``overrides`` applied; an unknown name lists the known ones."""
    if preset not in presets:
        raise ValueError(f"preset={preset!r} is not one of {', '.join(presets)}.")
    return replace(presets[preset], **(overrides or {}))


class Perplexity(MeanMetric):
    """The exponential of the mean next-token loss over every target token seen.

    Update it as the loss's ``MeanMetric``: each batch's mean loss weighted by its token count. torchmetrics' own
    ``Perplexity`` takes the logits, which tensor parallelism may hold split over the vocabulary.
    """

    def compute(self) -> Tensor:
        return super().compute().exp()


class CausalLM(LightningModule):
    """A LightningModule whose ``forward`` maps token ids ``(B, T)`` to logits ``(B, T, vocab)``.

    Batches are token windows ``(B, T + 1)``: inputs are the first ``T`` tokens, targets the last ``T``.
    """

    def __init__(
        self, *, learning_rate: float, weight_decay: float, warmup_steps: int, min_lr_ratio: float = 0.1
    ) -> None:
        super().__init__()
        self.learning_rate = learning_rate
        self.weight_decay = weight_decay
        self.warmup_steps = warmup_steps
        self.min_lr_ratio = min_lr_ratio
        # Means over every token of the set, not of per-batch means, which would weigh a short batch as a full one.
        # A NaN loss stays NaN rather than being dropped with a warning. Built in CPU memory also when the model is
        # built on the meta device, which would lose the metrics' starting values; they move with the model.
        with torch.device("cpu"):
            self.val_loss, self.val_perplexity = MeanMetric(nan_strategy="disable"), Perplexity(nan_strategy="disable")
            self.test_loss = MeanMetric(nan_strategy="disable")
            self.test_perplexity = Perplexity(nan_strategy="disable")

    def loss(self, batch: Tensor) -> Tensor:
        inputs, targets = batch[:, :-1], batch[:, 1:]
        logits = self(inputs)
        return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())

    def training_step(self, batch: Tensor, batch_idx: int) -> Tensor:
        loss = self.loss(batch)
        self.log("train_loss", loss, prog_bar=True, sync_dist=True)
        return loss

    def validation_step(self, batch: Tensor, batch_idx: int) -> Tensor:
        loss = self.loss(batch)
        self._track(loss, batch, self.val_loss, self.val_perplexity)
        self.log("val_loss", self.val_loss, prog_bar=True)
        self.log("val_perplexity", self.val_perplexity)
        return loss

    def test_step(self, batch: Tensor, batch_idx: int) -> Tensor:
        loss = self.loss(batch)
        self._track(loss, batch, self.test_loss, self.test_perplexity)
        self.log("test_loss", self.test_loss)
        self.log("test_perplexity", self.test_perplexity)
        return loss

    @staticmethod
    def _track(loss: Tensor, batch: Tensor, *metrics: MeanMetric) -> None:
        targets = batch[:, 1:].numel()
        for metric in metrics:
            metric.update(loss.detach(), targets)

    def configure_optimizers(self):
        # Decay matrices and embeddings, not norms or biases (GPT-3, Llama).
        decay = [p for p in self.parameters() if p.requires_grad and p.dim() >= 2]
        no_decay = [p for p in self.parameters() if p.requires_grad and p.dim() < 2]
        optimizer = torch.optim.AdamW(
            [{"params": decay, "weight_decay": self.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
            lr=self.learning_rate,
            betas=(0.9, 0.95),
            # On GPUs one kernel reads each tensor once, where the foreach kernels take seven passes: 14 of 141 ms
            # a step of the 1b preset on an H200 (bench/throughput.py's profile).
            fused=all(p.device.type == "cuda" for p in decay + no_decay),
        )
        total_steps = max(1, int(self.trainer.estimated_stepping_batches))
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, self._lr_factor(total_steps))
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    def _lr_factor(self, total_steps: int):
        warmup, floor = self.warmup_steps, self.min_lr_ratio

        def factor(step: int) -> float:
            if step < warmup:
                return (step + 1) / warmup
            progress = min(1.0, (step - warmup) / max(1, total_steps - warmup))
            return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress))

        return factor


class PresetCausalLM(CausalLM):
    """A reference model chosen by size: ``presets`` names its configs, ``network`` builds the model from one.

    Args:
        preset: A size from the class's ``presets`` ("tiny" for CPU tests).
        config: Overrides the preset's fields, e.g. ``{"n_layers": 8}``.
    """

    presets: ClassVar[dict]
    network: ClassVar[type[nn.Module]]

    def __init__(
        self,
        preset: str = "tiny",
        config: dict | None = None,
        learning_rate: float = 3e-3,
        weight_decay: float = 0.1,
        warmup_steps: int = 20,
    ) -> None:
        super().__init__(learning_rate=learning_rate, weight_decay=weight_decay, warmup_steps=warmup_steps)
        self.save_hyperparameters()
        self.config = resolve_preset(self.presets, preset, config)
        self.model = self.network(self.config)

    def forward(self, tokens: Tensor) -> Tensor:
        return self.model(tokens)
