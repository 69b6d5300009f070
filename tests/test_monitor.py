"""``TrainingMonitor``: the figures it logs follow from what the run did, and its FLOP count is torch's own.

Under every layout, its gradient norm equals the single process's (tests/test_equivalence.py); the main job's run
logs every figure to W&B (tests/test_cli.py).
"""

from __future__ import annotations

import csv
from pathlib import Path

import pytest
import torch
from lightning.fabric.utilities.throughput import measure_flops
from lightning.pytorch import Callback, Trainer, seed_everything
from lightning.pytorch.loggers import CSVLogger
from torch.distributed.tensor import DTensor

from lightdist.models import Llama, TokenDataModule
from lightdist.plan.throughput import DecoderFlops
from lightdist.plugins import ModelCheckpoint, ParallelStrategy, TrainingMonitor
from lightdist.plugins.monitor import sequences_and_length

from multirank import run_ranks
from training import SequentialBlocksLM

BATCH, SEQ_LEN, PEAK_TFLOPS = 4, 32, 0.001


def test_decoder_flops_are_what_torch_counts_on_the_meta_device() -> None:
    with torch.device("meta"):
        model = Llama("1b").model  # 0.95B parameters, never allocated
        tokens = torch.zeros(2, 512, dtype=torch.long)
    counted = measure_flops(model, lambda: model(tokens), loss_fn=torch.Tensor.sum)
    estimated = DecoderFlops.of(model).per_token(seq_len=512) * tokens.numel()
    assert estimated == pytest.approx(counted, rel=0.01)


def test_a_model_without_a_block_list_counts_its_repeated_blocks() -> None:
    assert DecoderFlops.of(SequentialBlocksLM(learning_rate=1e-3, warmup_steps=2)).n_layers == 4  # an nn.Sequential


class _RecordGradientNorms(Callback):
    """The norm of every gradient laid end to end, beside the monitor's."""

    def __init__(self) -> None:
        self.norms: list[float] = []

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        grads = [p.grad for p in pl_module.parameters() if p.grad is not None]
        whole = [grad.full_tensor() if isinstance(grad, DTensor) else grad for grad in grads]
        self.norms.append(torch.cat([grad.flatten() for grad in whole]).norm().item())


def train_with_monitor(save_dir: str) -> tuple[list[float], dict[str, float]]:
    """Four steps of the tiny Llama on one rank, saving every other step; the monitor logs every other step."""
    seed_everything(1234)
    norms = _RecordGradientNorms()
    trainer = Trainer(
        accelerator="cpu",
        devices=1,
        strategy=ParallelStrategy(async_checkpoint="thread"),
        max_steps=4,
        logger=CSVLogger(save_dir, name="run", version=0),
        callbacks=[
            TrainingMonitor(log_every_n_steps=2, peak_tflops=PEAK_TFLOPS),
            norms,
            ModelCheckpoint(dirpath=f"{save_dir}/checkpoints", every_n_train_steps=2, save_top_k=-1),
        ],
        enable_model_summary=False,
    )
    data = TokenDataModule(seq_len=SEQ_LEN, batch_size=BATCH, val_fraction=0.0, synthetic_tokens=16_384)
    trainer.fit(Llama("tiny"), datamodule=data)
    return norms.norms, {name: float(value) for name, value in trainer.progress_bar_metrics.items()}


WEIGHTS = sum(p.numel() for p in Llama("tiny").parameters()) * 4  # bytes in fp32


def test_monitor_logs_throughput_mfu_memory_checkpoint_waits_and_gradient_norm(tmp_path: Path) -> None:
    norms, progress_bar = run_ranks(1, train_with_monitor, str(tmp_path))[0]
    with open(tmp_path / "run/version_0/metrics.csv") as file:
        rows = {int(row["step"]): row for row in csv.DictReader(file) if row["perf/tokens_per_s"]}
    assert sorted(rows) == [1, 3]  # after the 2nd and 4th step, numbered as Lightning numbers the loss

    for step, row in rows.items():
        tokens_per_s = float(row["perf/tokens_per_s"])
        assert float(row["perf/tokens_per_s_per_device"]) == pytest.approx(tokens_per_s)  # one device
        # Each step trains the batch's tokens; MFU is the model's FLOPs over the device's peak.
        assert float(row["perf/step_time_s"]) * tokens_per_s == pytest.approx(BATCH * SEQ_LEN)
        flops_per_token = DecoderFlops.of(Llama("tiny")).per_token(SEQ_LEN)
        assert float(row["perf/mfu"]) == pytest.approx(flops_per_token * tokens_per_s / (PEAK_TFLOPS * 1e12))
        assert float(row["memory/peak_gib"]) > 0.1  # the process's peak resident memory: torch alone takes more
        # One rank holds every fp32 weight, its gradient and AdamW's two moments (and a step count per tensor).
        gib = {part: float(row[f"memory/{part}_gib"]) * 2**30 for part in ("parameters", "gradients", "optimizer")}
        assert gib == {"parameters": WEIGHTS, "gradients": WEIGHTS, "optimizer": pytest.approx(2 * WEIGHTS, rel=1e-3)}
        # The planner's estimate beside them: ZeRO-3's parameters count one gathered block more.
        assert float(row["memory/planned_gradients_gib"]) * 2**30 == pytest.approx(WEIGHTS, rel=1e-3)
        assert float(row["memory/planned_optimizer_gib"]) * 2**30 == pytest.approx(2 * WEIGHTS, rel=1e-3)
        assert WEIGHTS < float(row["memory/planned_parameters_gib"]) * 2**30 < 1.1 * WEIGHTS
        assert float(row["memory/planned_activations_gib"]) > 0
        assert float(row["train/grad_norm"]) == pytest.approx(norms[step], rel=1e-5)
    assert float(rows[1]["checkpoint/blocked_s"]) == 0.0  # the first save comes after the 2nd step's figures
    assert float(rows[3]["checkpoint/blocked_s"]) > 0.0  # it staged the state in memory before training went on
    assert {"train_loss", "perf/tokens_per_s", "perf/mfu"} <= progress_bar.keys()


def test_monitor_refuses_what_it_cannot_use() -> None:
    with pytest.raises(ValueError, match="log_every_n_steps=0 must be at least 1"):
        TrainingMonitor(log_every_n_steps=0)
    with pytest.raises(ValueError, match="peak_tflops=-1 must be positive"):
        TrainingMonitor(peak_tflops=-1)
    assert sequences_and_length(torch.zeros(8, 65, dtype=torch.long)) == (8, 64)  # windows: inputs and targets
    assert sequences_and_length({"input_ids": torch.zeros(8, 64, dtype=torch.long)}) == (8, 64)
    assert sequences_and_length((torch.zeros(8, 64), torch.zeros(8, 64))) == (8, 64)  # a TensorDataset's (x, y)
    with pytest.raises(ValueError, match=r"Pass TrainingMonitor\(batch_shape_fn=...\)"):
        sequences_and_length([torch.zeros(8)])
