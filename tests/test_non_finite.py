"""A step whose gradients are not finite is skipped, rolled back to the last checkpoint, or stops the run with a
report, as ``ParallelStrategy(non_finite=...)`` says; the weights never take in a NaN."""

from __future__ import annotations

import time
from collections.abc import Callable
from unittest.mock import patch

import pytest
import torch
from lightning.pytorch import Callback, Trainer, seed_everything
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

from lightdist.checkpoint import async_checkpoint
from lightdist.models import TokenDataModule
from lightdist.plugins import ModelCheckpoint, NonFiniteError, ParallelStrategy

from multirank import run_ranks
from training import LlamaWithOneBadBatch

pytestmark = pytest.mark.multirank

BAD_STEP = 3  # the 4th batch's loss is NaN: checkpoints were saved after steps 2 and 4 would be


class RecordWeights(Callback):
    """The whole model's weights after every batch."""

    def __init__(self) -> None:
        self.weights: list[dict[str, torch.Tensor]] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        state = get_model_state_dict(pl_module, options=StateDictOptions(full_state_dict=True))
        self.weights.append({name: tensor.detach().clone() for name, tensor in state.items()})


def train_through_a_bad_batch(policy: str, run: str) -> tuple[list[dict[str, torch.Tensor]], str]:
    """The weights after each batch, and the error the run stopped with ("" if none)."""
    seed_everything(1234)
    record = RecordWeights()
    trainer = Trainer(
        accelerator="cpu",
        devices=2,
        strategy=ParallelStrategy(tensor_parallel_size=2, non_finite=policy),
        max_steps=6,
        precision="32-true",
        callbacks=[record, ModelCheckpoint(dirpath=run, every_n_train_steps=2, save_last=True)],
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    model = LlamaWithOneBadBatch(BAD_STEP)
    try:
        trainer.fit(model, datamodule=TokenDataModule(seq_len=32, batch_size=4, synthetic_tokens=1 << 16))
    except NonFiniteError as error:
        return record.weights, str(error)
    return record.weights, ""


def written_late(write_pointer: Callable[[str, str], None]) -> Callable[[str, str], None]:
    """Rank 0 writes ``last.ckpt`` a second after the checkpoint is complete, as a bucket slow to answer may: the
    other ranks must still roll back to the checkpoint it names, not find none or an older one."""

    def write_late(url: str, checkpoint_url: str) -> None:
        time.sleep(1.0)
        write_pointer(url, checkpoint_url)

    return write_late


def runs_through_a_bad_batch(root: str) -> dict[str, tuple[list[dict[str, torch.Tensor]], str]]:
    runs = {policy: train_through_a_bad_batch(policy, f"{root}/{policy}") for policy in ("skip", "stop")}
    with patch.object(async_checkpoint, "write_pointer", written_late(async_checkpoint.write_pointer)):
        runs["rollback"] = train_through_a_bad_batch("rollback", f"{root}/rollback")
    return runs


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[list[dict[str, torch.Tensor]], str]]:
    return run_ranks(2, runs_through_a_bad_batch, str(tmp_path_factory.mktemp("non_finite")))[0]


def assert_same(weights: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    for name, tensor in expected.items():
        torch.testing.assert_close(weights[name], tensor, rtol=0, atol=0)


def all_finite(weights: dict[str, torch.Tensor]) -> bool:
    return all(bool(torch.isfinite(tensor).all()) for tensor in weights.values())


def test_skip_leaves_the_weights_as_they_were_and_trains_on(runs) -> None:
    weights, error = runs["skip"]
    assert error == "" and len(weights) == 6 and all(all_finite(step) for step in weights)
    assert_same(weights[BAD_STEP], weights[BAD_STEP - 1])  # the bad batch changed nothing
    assert not torch.equal(weights[BAD_STEP + 1]["model.lm_head.weight"], weights[BAD_STEP]["model.lm_head.weight"])


def test_rollback_returns_to_the_last_checkpoint_and_trains_on(runs) -> None:
    weights, error = runs["rollback"]
    assert error == "" and len(weights) == 6 and all(all_finite(step) for step in weights)
    # The newest checkpoint is step 2's, saved after the second batch: the weights are that checkpoint's again.
    assert_same(weights[BAD_STEP], weights[1])
    assert not torch.equal(weights[BAD_STEP]["model.lm_head.weight"], weights[BAD_STEP - 1]["model.lm_head.weight"])


def test_stop_raises_a_report_naming_the_step_and_the_gradients(runs) -> None:
    weights, error = runs["stop"]
    assert len(weights) == BAD_STEP and all(all_finite(step) for step in weights)
    assert error.startswith(f"Step {BAD_STEP}: the gradient norm is nan (loss nan); on this rank ")
    assert "gradients are not finite: model.embed_tokens.weight, model.layers.0." in error
    assert "Stopped, as non_finite='stop' asks" in error


def test_an_unknown_policy_is_refused_when_the_strategy_is_built() -> None:
    with pytest.raises(ValueError, match=r"non_finite='ignore' is not one of 'skip'"):
        ParallelStrategy(non_finite="ignore")
