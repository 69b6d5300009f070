"""``"auto"`` sizes: the planner picks pp x dp x tp for the model, the batch and the devices' memory, and the run it
picks trains like any other layout."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from lightning.pytorch import Trainer

from lightdist.config import ParallelConfig
from lightdist.layout import ParallelLayout
from lightdist.models import Llama, TokenDataModule
from lightdist.plan.planner import Cluster, GiB, ModelShape, choose_layout
from lightdist.plugins.auto_layout import device_memory_gib, planned_layout

from multirank import run_ranks
from training import Case, train

BATCH = dict(precision="bf16-mixed", zero_stage=3, activation_checkpointing=None)


def meta_llama(preset: str) -> Llama:
    with torch.device("meta"):
        return Llama(preset)


def test_the_planner_picks_the_fastest_layout_that_fits() -> None:
    llama_70b = ModelShape(meta_llama("70b"))
    # 16 x 4096 tokens per data-parallel rank: without recomputation a 70B's activations need tensor and pipeline
    # parallelism to fit in 80 GiB; the rest of the 64 GPUs train data parallel.
    choice = choose_layout(llama_70b, Cluster(64), seq_len=4096, batch_per_replica=16, **BATCH)
    assert str(choice.layout) == "pp=8 x dp=2 x tp=4, ZeRO-3, 8 microbatches"
    assert choice.fits and choice.total / GiB == pytest.approx(79.6, abs=0.1)
    # Sizes that are given are kept; the planner fills in the rest.
    given = choose_layout(llama_70b, Cluster(64), seq_len=4096, batch_per_replica=16, tp=8, **BATCH)
    assert str(given.layout) == "pp=8 x dp=1 x tp=8, ZeRO-3, 8 microbatches"
    # A 1B model fits on each GPU whole, sharded ZeRO-3: every GPU trains data parallel, with no bubble and no
    # tensor-parallel traffic.
    llama_1b = ModelShape(meta_llama("1b"))
    choice = choose_layout(llama_1b, Cluster(8), seq_len=2048, batch_per_replica=8, **BATCH)
    assert str(choice.layout) == "pp=1 x dp=8 x tp=1, ZeRO-3"


def test_the_planner_says_by_how_much_nothing_fits_and_what_to_change() -> None:
    with pytest.raises(ValueError) as error:
        choose_layout(ModelShape(meta_llama("405b")), Cluster(8), seq_len=4096, batch_per_replica=1, **BATCH)
    assert str(error.value) == (
        "No layout of Llama on 8 GPUs (8 per node, 80 GiB each) fits 1 x 4096 tokens per data-parallel rank at "
        "zero_stage=3, activation_checkpointing=None: the leanest, pp=1 x dp=1 x tp=8, ZeRO-3, needs 803.6 GiB per "
        "device. Recompute activations (activation_checkpointing='full'), lower batch_size or seq_len or add "
        "devices; `lightdist plan --gpus N` shows every layout."
    )
    with pytest.raises(ValueError, match=r"No split of 8 ranks into pp x dp x tp suits Llama with tp=3"):
        choose_layout(ModelShape(meta_llama("8b")), Cluster(8), seq_len=4096, batch_per_replica=1, tp=3, **BATCH)


def planned_on_two_cpu_ranks(model: Llama) -> ParallelLayout:
    """What ``lightdist_auto`` picks for ``model`` on 2 CPU ranks, every size left to the planner."""
    layout, _ = planned_layout(
        model,
        world_size=2,
        devices_per_node=2,
        device=torch.device("cpu"),
        pp=None,
        dp=None,
        tp=None,
        config=ParallelConfig(),
    )
    return layout


def test_a_model_without_batch_dimensions_is_told_what_to_declare() -> None:
    with pytest.raises(ValueError, match=r"neither Llama nor its data module gives a `seq_len` attribute"):
        planned_on_two_cpu_ranks(meta_llama("tiny"))


def test_a_global_batch_does_not_say_what_each_rank_holds() -> None:
    """Its share per rank depends on the data-parallel size being picked."""
    trainer = Trainer(accelerator="cpu", devices=2, strategy="lightdist_auto", logger=False)
    model = meta_llama("tiny")
    model.trainer, trainer.strategy._lightning_module = trainer, model
    trainer._data_connector.attach_datamodule(model, TokenDataModule(seq_len=32, global_batch_size=8))
    with pytest.raises(ValueError, match=r"neither Llama nor its data module gives a `batch_size` attribute"):
        planned_on_two_cpu_ranks(model)


class LlamaBuiltLate(Llama):
    """Builds its layers in ``configure_model``, as Lightning advises for models too big for one device."""

    def __init__(self, seq_len: int, batch_size: int) -> None:
        super().__init__("tiny")
        del self.model
        self.seq_len, self.batch_size = seq_len, batch_size

    def configure_model(self) -> None:
        if not hasattr(self, "model"):
            self.model = self.network(self.config)


def test_a_model_built_in_configure_model_is_built_on_the_meta_device_to_be_planned() -> None:
    trainer = Trainer(accelerator="cpu", devices=2, strategy="lightdist_auto", logger=False)
    model = LlamaBuiltLate(seq_len=32, batch_size=4)
    model.trainer, trainer.strategy._lightning_module = trainer, model
    layout = planned_on_two_cpu_ranks(model)
    assert layout.world_size == 2
    assert {p.device.type for p in model.parameters()} == {"meta"}  # nothing allocated


@pytest.mark.multirank
def test_auto_sizes_train_the_planners_layout_as_one_process_would() -> None:
    auto = Case(strategy=dict(tensor_parallel_size="auto", pipeline_parallel_size="auto"), steps=3)
    cpu_ranks = Cluster(4, gpus_per_node=4, memory_gib=device_memory_gib(torch.device("cpu"), 4))
    choice = choose_layout(
        ModelShape(Llama("tiny")),
        cpu_ranks,
        seq_len=auto.seq_len,
        batch_per_replica=auto.batch_size,
        precision="32-true",
        zero_stage=3,
        activation_checkpointing=None,
    )
    planned = ParallelLayout(choice.layout.pp, choice.layout.dp, choice.layout.tp)
    results = run_ranks(4, train, auto, 4)
    assert {result.layout for result in results} == {str(planned)}
    explicit = replace(auto, strategy=dict(pipeline_parallel_size=planned.pp, tensor_parallel_size=planned.tp))
    (single,) = run_ranks(1, train, explicit.reference(4))
    # Under a pipeline only the last stage computes the loss; it reports it to every rank.
    assert results[-1].losses == pytest.approx(single.losses, rel=1e-5)
