"""Every impossible configuration fails with a message that names the value and the fix, before memory is spent."""

from __future__ import annotations

import re

import pytest
import torch
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.plugins import AsyncCheckpointIO
from torch import nn
from torch.torch_version import TorchVersion
from torch.utils.data import DataLoader
from torchmetrics import MeanMetric

from lightdist.models import Llama, TokenDataModule
from lightdist.parallel.pipeline.structural import MicrobatchCalls, ModelCall, StageModel, keep_stages
from lightdist.parallel.structure import find_decoder_stack
from lightdist.plugins import ParallelStrategy
from lightdist.plugins.metric_sync import refuse_metrics_on_meta

from multirank import raised, run_each, run_ranks
from training import MODELS, TwoStreamLM


def test_context_parallel_ranks_count_in_the_world_size() -> None:
    with pytest.raises(
        ValueError, match=r"tensor_parallel_size=1 x context_parallel_size=4 = 8, but the world size is 4"
    ):
        Trainer(accelerator="cpu", devices=4, strategy=ParallelStrategy(data_parallel_size=2, context_parallel_size=4))
    with pytest.raises(ValueError, match=r"pipeline_parallel_size=1 x context_parallel_size=3 = 3, so data_parallel"):
        Trainer(accelerator="cpu", devices=4, strategy=ParallelStrategy(context_parallel_size=3))


def test_world_size_must_equal_the_product_of_the_degrees() -> None:
    # Raised while the Trainer is built: no process started, no parameter allocated.
    with pytest.raises(ValueError, match=r"data_parallel_size=3 .* = 3, but the world size is 4"):
        Trainer(accelerator="cpu", devices=4, strategy=ParallelStrategy(data_parallel_size=3))


def test_replicas_must_divide_the_data_parallel_ranks() -> None:
    with pytest.raises(
        ValueError, match=r"data_parallel_replicas=3 does not divide data_parallel_size=4: each replica"
    ):
        Trainer(accelerator="cpu", devices=4, strategy=ParallelStrategy(data_parallel_replicas=3))
    # context-parallel peers are no data-parallel ranks: 2 of them do not make room for a second replica
    with pytest.raises(ValueError, match=r"data_parallel_replicas=2 does not divide data_parallel_size=1"):
        Trainer(
            accelerator="cpu", devices=2, strategy=ParallelStrategy(context_parallel_size=2, data_parallel_replicas=2)
        )


def test_under_torchrun_the_error_names_the_launchers_world_size(monkeypatch: pytest.MonkeyPatch) -> None:
    """torchrun started the ranks: ``devices`` is not what to change."""
    torchrun = dict(TORCHELASTIC_RUN_ID="run", RANK="0", GROUP_RANK="0", LOCAL_RANK="0", LOCAL_WORLD_SIZE="3")
    for name, value in dict(torchrun, WORLD_SIZE="3", GROUP_WORLD_SIZE="1").items():
        monkeypatch.setenv(name, value)
    with pytest.raises(
        ValueError,
        match=r"world size 3 is not divisible by tensor_parallel_size=2 .* Change the launcher's world size "
        r"\(TorchElasticEnvironment\) or the tensor/pipeline sizes",
    ):
        Trainer(accelerator="cpu", devices=3, strategy=ParallelStrategy(tensor_parallel_size=2))


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (dict(zero_stage=4), r"zero_stage=4 is not a ZeRO stage. Choose 0"),
        (dict(zero_stage=-1), r"zero_stage=-1 is not a ZeRO stage"),
        (dict(data_parallel_size=0), r"data_parallel_size=0 must be a positive integer or 'auto'"),
        (dict(pipeline_schedule="round_robin"), r"pipeline_schedule='round_robin' is not one of gpipe, 1f1b"),
        (dict(microbatches=0), r"microbatches=0 must be a positive integer"),
        (dict(activation_checkpointing="some"), r"activation_checkpointing='some' is not one of None, 'full'"),
        (dict(expert_parallel_size=0), r"expert_parallel_size=0 must be a positive integer"),
        (dict(data_parallel_replicas=0), r"data_parallel_replicas=0 must be a positive integer"),
        (
            dict(data_parallel_replicas=2, zero_stage=1),
            r"data_parallel_replicas=2 splits .* zero_stage=1 shards none: .* Use zero_stage=2 or 3 with",
        ),
        (
            dict(expert_parallel_size=2, zero_stage=1),
            r"zero_stage=1 with expert_parallel_size=2: .* Use zero_stage=0, 2 or 3 with expert parallelism",
        ),
        (dict(zero_stage=1, cpu_offload=True), r"cpu_offload=True needs .* zero_stage=1. Use zero_stage=2 or 3"),
        (dict(compile=True, activation_checkpointing="full"), r"compile=True with activation_checkpointing='full'"),
        (dict(tensor_parallel_size=0), r"tensor_parallel_size=0 must be a positive integer or 'auto' or 'node'"),
        (dict(context_parallel_size=0), r"context_parallel_size=0 must be a positive integer\.$"),
        (dict(context_parallel_method="ulysses"), r"context_parallel_method='ulysses' is not one of 'auto', 'ring'"),
        (dict(pipeline_parallel_size="four"), r"pipeline_parallel_size='four' must be a positive integer or 'auto'"),
        (dict(virtual_stages=2), r"pipeline_schedule='1f1b' runs one stage per rank, but virtual_stages=2. Use"),
        (dict(async_checkpoint="daemon"), r"async_checkpoint='daemon' is not one of 'process' \(upload from a daemon"),
        (dict(loss_weighting="examples"), r"loss_weighting='examples' is not one of 'tokens' \(batches weigh by"),
        (
            dict(storage_options={"s3": {"profile": "training", "secret": "abc"}}),
            r"storage_options\['s3'\]\['secret'\] is a credential, .* saved with the run's config .* a profile",
        ),
        (
            dict(storage_options={"s3": {"client_kwargs": {"aws_secret_access_key": "abc"}}}),
            r"storage_options\['s3'\]\['client_kwargs'\]\['aws_secret_access_key'\] is a credential",
        ),
        (dict(storage_options={"endpoint_url": "http://x"}), r"must map a protocol to its fsspec options, e.g."),
        (
            dict(pipeline_parallel_size=2, pipeline_schedule="interleaved_1f1b", microbatches=5),
            r"microbatches=5 must be a multiple of 2 rounds. Choose a multiple of 2",
        ),
        (
            dict(pipeline_parallel_size=2, tensor_parallel_size=2, pipeline_tracer=True),
            r"pipeline_tracer=True traces .* but tensor_parallel_size=2. Use tensor_parallel_size=1 with the tracer",
        ),
    ],
)
def test_invalid_options_are_rejected_when_the_strategy_is_built(options: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        ParallelStrategy(**options)


def test_cpu_offload_on_cpu_accelerator_is_rejected() -> None:
    with pytest.raises(ValueError, match=r"cpu_offload=True .* but the accelerator is the CPU. Drop cpu_offload"):
        Trainer(accelerator="cpu", devices=2, strategy=ParallelStrategy(cpu_offload=True))


def test_zero_bubble_is_refused_on_a_torch_whose_split_backward_takes_tensors_only(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(torch, "__version__", TorchVersion("2.11.0"))
    with pytest.raises(NotImplementedError, match=r"needs torch 2.13 .* this is torch 2.11.0: .*='interleaved_1f1b'"):
        ParallelStrategy(pipeline_parallel_size=2, pipeline_schedule="zero_bubble")


def test_fp16_mixed_is_refused_with_the_precisions_that_run() -> None:
    """fp16 needs a gradient scaler whose overflow check spans every rank's shards; lightdist has none. Lightning
    refuses it for ModelParallelStrategy, which ParallelStrategy is, as the Trainer is built."""
    with pytest.raises(ValueError, match=r"precision='16-mixed'.* Choose a different precision among: .*bf16-mixed"):
        Trainer(accelerator="cpu", devices=2, strategy=ParallelStrategy(), precision="16-mixed")


def test_v_shaped_schedule_is_refused_with_the_reason() -> None:
    with pytest.raises(NotImplementedError, match=r"'zbv' is not offered: .* cannot run forward-only .*='zero_bubble'"):
        ParallelStrategy(pipeline_parallel_size=2, pipeline_schedule="zbv")


def fit_llama(config: dict, strategy: dict, resume_from: str | None = None, save_to: str | None = None) -> None:
    trainer = Trainer(accelerator="cpu", devices=2, strategy=ParallelStrategy(**strategy), max_steps=1, logger=False)
    data = TokenDataModule(seq_len=16, batch_size=4, val_fraction=0.0, synthetic_tokens=4096)
    trainer.fit(Llama("tiny", config=config), datamodule=data, ckpt_path=resume_from)
    if save_to is not None:
        trainer.save_checkpoint(save_to)


PIPELINES_THAT_CANNOT_BE_CUT_OR_FED = {
    "more_stages_than_blocks": (
        {"n_layers": 1},
        {},
        r"pipeline_parallel_size=2 exceeds the 1 blocks of model.layers: every stage needs",
    ),
    "microbatches": (
        {},
        {"microbatches": 3},
        r"microbatches=3 does not divide the batch of 4 examples on each data-parallel rank",
    ),
    "split": (
        {},
        {"pipeline_split": [3, 2]},
        r"pipeline_split=\[3, 2\] must give each of the 2 stages at least one block",
    ),
    "virtual_stages_than_blocks": (
        {"n_layers": 3},
        {"pipeline_schedule": "interleaved_1f1b"},
        r"pipeline_parallel_size=2 x virtual_stages=2 = 4 stages exceeds the 3 blocks of model.layers",
    ),
}


@pytest.mark.multirank
@pytest.mark.parametrize("name", PIPELINES_THAT_CANNOT_BE_CUT_OR_FED)
def test_pipelines_that_cannot_be_cut_or_fed(errors_on_two_ranks: dict[str, str], name: str) -> None:
    message = PIPELINES_THAT_CANNOT_BE_CUT_OR_FED[name][-1]
    assert re.search(message, errors_on_two_ranks[name])


@pytest.mark.multirank
def test_sequence_parallel_stages_need_sequences_that_split_over_the_tensor_parallel_ranks() -> None:
    """A Hugging Face model given the whole 33-token window (it shifts its labels itself): each stage would hand
    the next unequal shares of the sequence, which gloo answers by aborting the process."""
    errors = run_ranks(4, raised, fit_labels_model_in_pp2_tp2)
    message = (
        "ValueError: Sequence parallelism hands the next pipeline stage each of the 2 tensor-parallel ranks' equal "
        "share of the sequence, but the model is called with sequences of 33 positions. Call it with sequences of a "
        "multiple of 2 (e.g. the window's first T tokens as inputs), or pass sequence_parallel=False."
    )
    assert errors == [message] * 4


def fit_labels_model_in_pp2_tp2() -> None:
    strategy = ParallelStrategy(pipeline_parallel_size=2, tensor_parallel_size=2)
    trainer = Trainer(accelerator="cpu", devices=4, strategy=strategy, max_steps=1, logger=False)
    data = TokenDataModule(seq_len=32, batch_size=4, val_fraction=0.0, synthetic_tokens=4096)
    trainer.fit(MODELS["zoo_hf_llama_labels"](learning_rate=1e-3, warmup_steps=2), datamodule=data)


class _PackedLlama(Llama):
    """Reads a batch of packed sequences: tokens, and the offsets where each document starts, which have rows of their
    own rather than one per example."""

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        return self(batch["tokens"]).mean()


def fit_packed_sequences_in_a_pipeline() -> None:
    trainer = Trainer(accelerator="cpu", devices=2, strategy=ParallelStrategy(pipeline_parallel_size=2), max_steps=1)
    packed = DataLoader(
        torch.zeros(4, 16, dtype=torch.long),
        batch_size=4,
        collate_fn=lambda windows: {"tokens": torch.stack(windows), "offsets": torch.tensor([0, 5, 9, 12, 16])},
    )
    trainer.fit(_PackedLlama("tiny"), train_dataloaders=packed)


@pytest.mark.multirank
def test_pipeline_names_what_of_the_batch_it_cannot_cut(errors_on_two_ranks: dict[str, str]) -> None:
    message = r"batch\['offsets'\] has 5 rows where the batch has 4 examples, so pipeline parallelism cannot tell"
    assert re.search(message, errors_on_two_ranks["packed_sequences"])


def _one_microbatch_calling_with(tokens: torch.Tensor) -> dict:
    """A stage's keyword arguments for a step of one microbatch, which calls the model with ``tokens``."""
    return {
        "lightdist_model_calls": MicrobatchCalls([ModelCall("", (tokens,), {})]),
        "lightdist_microbatch": torch.zeros(1),
    }


def test_pipeline_refuses_blocks_that_pass_two_streams_on() -> None:
    model = TwoStreamLM()
    stack = keep_stages(model, find_decoder_stack(model), {0}, first=True, last=False)
    first_stage = StageModel(model, stack, list(stack.blocks), first=True, last=False)
    with pytest.raises(
        ValueError, match=r"_TwoStreamBlock returns 2 tensors shaped like its hidden states \(2, 4, 8\)"
    ) as raised_error:
        first_stage(**_one_microbatch_calling_with(torch.zeros(2, 4, dtype=torch.long)))
    assert "cut the stages with torch's tracer, which hands on every value (pipeline_tracer=True)" in str(
        raised_error.value
    )


class _KeywordBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 8)

    def forward(self, *, hidden_states: torch.Tensor) -> torch.Tensor:
        return hidden_states + self.proj(hidden_states)


class _KeywordBlocksLM(nn.Module):
    """Calls its blocks by keyword only, so a pipeline stage cannot hand them the previous stage's output."""

    def __init__(self) -> None:
        super().__init__()
        self.embed, self.head = nn.Embedding(16, 8), nn.Linear(8, 16)
        self.layers = nn.ModuleList(_KeywordBlock() for _ in range(2))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for block in self.layers:
            x = block(hidden_states=x)
        return self.head(x)


def test_pipeline_needs_blocks_that_take_the_hidden_states_first() -> None:
    model = _KeywordBlocksLM()
    stack = keep_stages(model, find_decoder_stack(model), {1}, first=False, last=True)
    second_stage = StageModel(model, stack, list(stack.blocks), first=False, last=True)
    received = torch.zeros(2, 4, 8)  # the first stage's output
    with pytest.raises(
        ValueError, match=r"calls its blocks by keyword only. Call them with the hidden states first"
    ) as raised_error:
        second_stage(received, **_one_microbatch_calling_with(torch.zeros(2, 4, dtype=torch.long)))
    assert "(pipeline_tracer=True)" in str(raised_error.value)


def test_another_checkpoint_io_is_refused_as_the_trainer_is_built() -> None:
    """Lightning's own async or torch.save plugins would write one rank's shards as if they were the model."""
    with pytest.raises(TypeError, match=r"was given AsyncCheckpointIO. Leave it out of Trainer\(plugins=...\)"):
        Trainer(accelerator="cpu", devices=2, strategy=ParallelStrategy(), plugins=[AsyncCheckpointIO()])


def test_unknown_strategy_name_is_named_in_the_error() -> None:
    with pytest.raises(ValueError, match=r"invalid strategy name: `strategy='lightdist_zero7'`"):
        Trainer(accelerator="cpu", devices=2, strategy="lightdist_zero7")


class _NoLayers(LightningModule):
    def training_step(self, batch, batch_idx):
        raise AssertionError("never reached")

    def configure_optimizers(self):
        raise AssertionError("never reached")


def fit_module_without_parameters() -> None:
    trainer = Trainer(accelerator="cpu", devices=1, strategy=ParallelStrategy(), max_steps=1, logger=False)
    trainer.fit(_NoLayers(), train_dataloaders=[[0]])


def test_module_without_parameters_is_rejected() -> None:
    with pytest.raises(RuntimeError, match=r"_NoLayers has no parameters to train"):
        run_ranks(1, fit_module_without_parameters)


def test_metrics_built_on_the_meta_device_are_refused_with_the_fix() -> None:
    # Under `Trainer.init_module(empty_init=True)`: the metric's starting values are lost, and the run would stop
    # only later, on torch's "Cannot copy out of meta tensor", which names no metric.
    with torch.device("meta"):
        model = Llama("tiny")
        refuse_metrics_on_meta(model)  # the reference models build their metrics in CPU memory
        model.val_accuracy = MeanMetric()
    with pytest.raises(
        ValueError, match=r"val_accuracy \(MeanMetric\) were built on the meta device.*torch.device\('cpu'\)"
    ):
        refuse_metrics_on_meta(model)


class _OneWeight(LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(4, 4, bias=False)])

    def training_step(self, batch, batch_idx):
        raise AssertionError("never reached")

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters())


def fit_one_weight_on_two_zero1_ranks() -> None:
    trainer = Trainer(accelerator="cpu", devices=2, strategy=ParallelStrategy(zero_stage=1), max_steps=1, logger=False)
    trainer.fit(_OneWeight(), train_dataloaders=[[0]])


def fit_a_global_batch_of_three_on_two_ranks() -> None:
    trainer = Trainer(accelerator="cpu", devices=2, strategy=ParallelStrategy(), max_steps=1, logger=False)
    data = TokenDataModule(seq_len=16, global_batch_size=3, val_fraction=0.0, synthetic_tokens=4096)
    trainer.fit(Llama("tiny"), datamodule=data)


@pytest.mark.multirank
def test_a_global_batch_must_split_over_the_data_parallel_ranks(errors_on_two_ranks: dict[str, str]) -> None:
    message = r"global_batch_size=3 does not split over 2 data-parallel ranks. Make it a multiple of 2"
    assert re.search(message, errors_on_two_ranks["global_batch_of_three"])


def test_a_batch_is_given_per_rank_or_over_all_ranks_not_both() -> None:
    with pytest.raises(ValueError, match=r"batch_size=4 \(per rank\) and global_batch_size=8 .* give one of them"):
        TokenDataModule(batch_size=4, global_batch_size=8)


@pytest.mark.multirank
def test_zero1_needs_a_parameter_for_every_data_parallel_rank(errors_on_two_ranks: dict[str, str]) -> None:
    message = r"but 2 ranks share 1 parameter tensors. Use zero_stage=2 or 3"
    assert re.search(message, errors_on_two_ranks["zero1_one_weight"])


PIPELINE = {"pipeline_parallel_size": 2}


@pytest.mark.multirank
def test_a_checkpoint_of_another_model_lists_every_difference(errors_on_two_ranks: dict[str, str]) -> None:
    # Saved by the 4-block tiny Llama, each pipeline stage holding two blocks.
    fewer_wider_blocks = errors_on_two_ranks["fewer_wider_blocks"]
    assert "holds a different model; not in this model: model.layers.3.input_layernorm.weight" in fewer_wider_blocks
    assert "of another shape: model.layers.0.mlp.down_proj.weight [64, 176] there, [64, 192] here" in fewer_wider_blocks
    more_blocks = errors_on_two_ranks["more_blocks"]
    assert "missing from the checkpoint: model.layers.4.input_layernorm.weight" in more_blocks
    assert "and 3 more. Load it into the model it was saved from" in more_blocks


def fit_model_positions_without_sequence_parallel() -> None:
    strategy = ParallelStrategy(tensor_parallel_size=2, sequence_parallel=False)
    trainer = Trainer(accelerator="cpu", devices=2, strategy=strategy, max_steps=1, logger=False)
    windows = DataLoader(torch.zeros(4, 17, dtype=torch.long), batch_size=2)
    trainer.fit(MODELS["zoo_nanogpt_sliced_positions"](learning_rate=1e-3, warmup_steps=1), train_dataloaders=windows)


@pytest.mark.multirank
def test_a_models_own_parameters_need_sequence_parallelism_under_tensor_parallelism(
    errors_on_two_ranks: dict[str, str],
) -> None:
    """minGPT's ``pos_emb``, a parameter of the model itself beside the blocks, becomes a DTensor, which the
    embeddings' local outputs cannot be added to; with sequence parallelism (the default) the stream is a DTensor too,
    and the run equals one process (``tests/test_documents.py``)."""
    error = errors_on_two_ranks["model_positions_without_sequence_parallel"]
    assert "GPT holds parameters of its own (pos_emb) beside the modules it calls" in error
    assert "Train with sequence_parallel=True" in error


@pytest.fixture(scope="module")
def errors_on_two_ranks(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """What each two-rank fit above raised, all in one pair of ranks."""
    checkpoint = str(tmp_path_factory.mktemp("llama") / "step=1.ckpt")
    fits = {
        name: (fit_llama, (config, dict(PIPELINE, **strategy)))
        for name, (config, strategy, _) in PIPELINES_THAT_CANNOT_BE_CUT_OR_FED.items()
    }
    fits.update(
        packed_sequences=(fit_packed_sequences_in_a_pipeline, ()),
        zero1_one_weight=(fit_one_weight_on_two_zero1_ranks, ()),
        global_batch_of_three=(fit_a_global_batch_of_three_on_two_ranks, ()),
        fewer_wider_blocks=(fit_llama, ({"n_layers": 3, "ffn_dim": 192}, PIPELINE, checkpoint)),
        more_blocks=(fit_llama, ({"n_layers": 5}, PIPELINE, checkpoint)),
        heads_for_all_to_all=(fit_llama, ({"n_heads": 1, "n_kv_heads": 1}, ALL_TO_ALL)),
        model_positions_without_sequence_parallel=(fit_model_positions_without_sequence_parallel, ()),
    )
    calls = [(fit_llama, ({}, PIPELINE, None, checkpoint))] + [(raised, (fit, *args)) for fit, args in fits.values()]
    (_, *errors), _ = run_ranks(2, run_each, calls)
    return dict(zip(fits, errors, strict=True))


ALL_TO_ALL = dict(context_parallel_size=2, context_parallel_method="all_to_all")


@pytest.mark.multirank
def test_heads_that_do_not_deal_out_are_refused_as_the_run_starts(errors_on_two_ranks: dict[str, str]) -> None:
    message = (
        "context_parallel_method='all_to_all' deals the heads out over the context-parallel ranks, but the model's "
        "num_heads=1 (1 per tensor-parallel rank) do not divide by context_parallel_size=2. Use "
        "context_parallel_method='ring' (or 'auto')."
    )
    assert message in errors_on_two_ranks["heads_for_all_to_all"]


def test_model_without_a_block_list_names_what_it_saw() -> None:
    model = nn.Sequential(nn.Embedding(8, 4), nn.ModuleList([nn.Linear(4, 4), nn.ReLU()]), nn.Linear(4, 8))
    with pytest.raises(ValueError, match=r"Could not find the decoder stack of Sequential.*1 \(2 x Linear, ReLU\)"):
        find_decoder_stack(model)
