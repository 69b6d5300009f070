"""Expert parallelism trains Mixture-of-Experts models, ours and Hugging Face's, as one process or plain data
parallelism does.

A router's load-balancing loss is computed over each rank's own tokens (as Megatron and Hugging Face compute it), so
with it a data-parallel run equals plain data parallelism of the same size, not one process. The language-model loss
alone (the models with no load-balancing loss) must equal one process; with the load-balancing loss, the expert-parallel
run must equal plain data parallelism.
"""

from __future__ import annotations

import dataclasses
import os
import re
from functools import cache
from pathlib import Path

import pytest
import torch
from lightning.pytorch import Trainer, seed_everything
from torch import nn

from lightdist.models import Llama, MoELlama, TokenDataModule
from lightdist.parallel.expert_load import ExpertLoad
from lightdist.parallel.expert_parallel import find_experts
from lightdist.parallel.listed_experts import ExpertList
from lightdist.plugins import ParallelStrategy, TrainingMonitor, WandbLogger

from multirank import run_ranks
from training import MODELS, WEIGHT_ATOL, Case, References, Result, merge_stages, train_cases
from wandb_offline import offline_run_history

pytestmark = pytest.mark.multirank

EP2 = dict(expert_parallel_size=2)
PP2 = dict(pipeline_parallel_size=2)
TP2 = dict(tensor_parallel_size=2)
HF_FAMILIES = ("mixtral", "qwen3_moe", "olmoe", "qwen2_moe", "deepseek_v3")

# Compared with one process: no load-balancing loss.
MATCH_ONE_PROCESS = {
    2: {
        "moe_ep2_zero3_clip": Case(strategy=EP2, model="moe_lm_only", gradient_clip_val=0.5, validate=True),
        "moe_ep2_zero0": Case(strategy=dict(EP2, zero_stage=0), model="moe_lm_only"),
        **{f"zoo_hf_{family}_ep2": Case(strategy=EP2, model=f"zoo_hf_{family}_logits") for family in HF_FAMILIES},
        # the second rank's experts get no token: its backward still sends gradients back through both all-to-alls
        "moe_ep2_a_rank_gets_no_token": Case(strategy=EP2, model="moe_routed_to_the_first_experts"),
        # experts held as a list of modules, called one by one by the block's own loop: over the experts hit, as
        # transformers 4's Mixtral loops, and over all of them, as LitGPT's LLaMAMoE does
        "listed_experts_ep2_zero3_clip": Case(strategy=EP2, model="listed_experts", gradient_clip_val=0.5),
        "zoo_litgpt_moe_ep2_zero0": Case(strategy=dict(EP2, zero_stage=0), model="zoo_litgpt_moe"),
        # a DeepSeek-style block written here: a shared expert beside 8 small routed ones, a sigmoid router
        "deepseek_style_ep2": Case(strategy=EP2, model="deepseek_style"),
    },
    4: {
        # two ranks hold each expert: each expert's gradient sums 2 ranks' tokens, then 2 copies' gradients
        "moe_ep2_of_dp4_zero3": Case(strategy=EP2, model="moe_lm_only"),
        "moe_ep2_of_dp4_zero0": Case(strategy=dict(EP2, zero_stage=0), model="moe_lm_only"),
        "moe_ep4_zero3": Case(strategy=dict(expert_parallel_size=4), model="moe_lm_only"),
        "zoo_hf_qwen3_moe_ep4_zero2": Case(
            strategy=dict(expert_parallel_size=4, zero_stage=2), model="zoo_hf_qwen3_moe_logits"
        ),
        # each stage's experts split over its 2 data-parallel ranks, tokens exchanged per microbatch
        # validating every 2 steps: the schedule sets its stages up again after each validation
        "moe_pp2_ep2_clip_validating_every_2_steps": Case(
            strategy=dict(PP2, **EP2), model="moe_lm_only", gradient_clip_val=0.5, val_check_interval=2
        ),
        # its first layer dense, on the first stage: that stage splits one layer's experts, the other two
        "zoo_hf_deepseek_v3_pp2_ep2": Case(strategy=dict(PP2, **EP2), model="zoo_hf_deepseek_v3_logits"),
        # attention split by tensor parallelism, the MoE blocks run whole on each tensor-parallel rank
        "moe_tp2_ep2_clip": Case(strategy=dict(TP2, **EP2), model="moe_lm_only", gradient_clip_val=0.5),
        "zoo_hf_olmoe_tp2_ep2_without_sequence_parallel": Case(
            strategy=dict(TP2, **EP2, sequence_parallel=False), model="zoo_hf_olmoe_logits"
        ),
        "zoo_hf_qwen2_moe_pp2_ep2_gpipe": Case(
            strategy=dict(PP2, **EP2, pipeline_schedule="gpipe", microbatches=4), model="zoo_hf_qwen2_moe_logits"
        ),
        "listed_experts_ep2_of_dp4_zero2": Case(strategy=dict(EP2, zero_stage=2), model="listed_experts"),
        "deepseek_style_ep4_zero2": Case(strategy=dict(expert_parallel_size=4, zero_stage=2), model="deepseek_style"),
        "zoo_litgpt_moe_pp2_ep2_clip": Case(strategy=dict(PP2, **EP2), model="zoo_litgpt_moe", gradient_clip_val=0.5),
    },
    # each stage's attention split over 2 tensor-parallel ranks, its experts over its 2 data-parallel ranks
    8: {
        "moe_pp2_ep2_tp2_clip": Case(strategy=dict(PP2, **EP2, **TP2), model="moe_lm_only", gradient_clip_val=0.5),
        "zoo_hf_qwen3_moe_pp2_ep2_tp2": Case(strategy=dict(PP2, **EP2, **TP2), model="zoo_hf_qwen3_moe_logits"),
        "zoo_litgpt_moe_pp2_ep2_tp2": Case(strategy=dict(PP2, **EP2, **TP2), model="zoo_litgpt_moe"),
    },
}
# Compared with plain data parallelism of the same size: the load-balancing loss on.
MATCH_DATA_PARALLEL = {
    2: {
        "moe_aux_loss": Case(strategy=EP2, model="moe"),
        "zoo_hf_mixtral_own_loss_with_aux_loss": Case(strategy=EP2, model="zoo_hf_mixtral_labels"),
        "zoo_hf_olmoe_own_loss_with_aux_loss_zero2": Case(
            strategy=dict(EP2, zero_stage=2), model="zoo_hf_olmoe_labels"
        ),
    },
    # the load-balancing loss's gradient injected in each stage's backward: it never reaches the last stage's loss
    4: {
        "moe_aux_loss_pp2_ep2_interleaved": Case(
            strategy=dict(PP2, **EP2, pipeline_schedule="interleaved_1f1b"), model="moe"
        )
    },
    8: {"moe_aux_loss_pp2_ep2_tp2": Case(strategy=dict(PP2, **EP2, **TP2), model="moe")},
}
# Refused before anything is split, every rank alike.
REFUSED = {
    2: {
        "experts_that_do_not_split": (
            Case(strategy=EP2, model="moe_3_experts", steps=1),
            r"expert_parallel_size=2 does not divide the 3 experts of MoELlama's MoE layers \(model.layers.0.mlp",
        ),
        "dense_model": (
            Case(strategy=EP2, model="llama", steps=1),
            r"expert_parallel_size=2, but Llama has no MoE layer: .* Set expert_parallel_size=1 for a dense model",
        ),
    },
    4: {
        "traced_pipeline": (
            Case(strategy=dict(PP2, **EP2, pipeline_tracer=True), model="moe", steps=1),
            r"expert_parallel_size=2 with pipeline stages cut by torch's tracer: .* Cut the stages by structure",
        ),
    },
}


def plain_data_parallel(case: Case) -> Case:
    """``case`` with every expert on every rank: the run expert parallelism must reproduce, weights included."""
    return dataclasses.replace(case, strategy={k: v for k, v in case.strategy.items() if k != "expert_parallel_size"})


@cache
def parallel_results(world_size: int) -> dict[str, Result | tuple[Result, Result]]:
    """Every case of a world size in one group of ranks: each run compared with one process, each run with the
    load-balancing loss and its plain data-parallel twin, and on two ranks the refused runs."""
    REFERENCES.start()
    alone, paired, refused = (cases.get(world_size, {}) for cases in (MATCH_ONE_PROCESS, MATCH_DATA_PARALLEL, REFUSED))
    twins = [run for case in paired.values() for run in (case, plain_data_parallel(case))]
    cases = [*alone.values(), *twins, *(case for case, _ in refused.values())]
    # a pipeline rank holds its stage; the 8 ranks' group takes minutes on two cores
    results = iter(merge_stages(run_ranks(world_size, train_cases, cases, world_size, timeout=560)))
    found = {name: next(results) for name in alone}
    found |= {name: (next(results), next(results)) for name in paired}
    return found | {name: next(results) for name in refused}


AUX_LOSS_ON_ONE_PROCESS = Case(model="moe").reference(2)


# The single-process runs: those compared with, and the load-balancing loss's on one process.
COMPARED = [case.reference(size) for size, cases in MATCH_ONE_PROCESS.items() for case in cases.values()]
REFERENCES = References([*COMPARED, AUX_LOSS_ON_ONE_PROCESS])


def assert_same_losses(run: Result, expected: Result, case: Case) -> None:
    assert not run.error, run.error
    assert not expected.error, expected.error
    assert not run.gradients_unlike_parameters  # each rank's gradients are its share, as the planner counts
    assert len(run.losses) == case.steps
    torch.testing.assert_close(run.losses, expected.losses, rtol=1e-5, atol=0)
    torch.testing.assert_close(run.logged, expected.logged, rtol=1e-5, atol=0)
    torch.testing.assert_close(run.grad_norms, expected.grad_norms, rtol=1e-5, atol=0)
    # the router sent every token to the same experts: the busiest expert's share is the same (not counting the
    # routing of a pipeline's stages on made-up inputs, which its schedule runs to set them up)
    assert len(run.expert_imbalance) == case.steps
    assert run.expert_imbalance == expected.expert_imbalance
    assert all(value > 1 for value in run.expert_imbalance)
    assert run.validated == pytest.approx(expected.validated, rel=1e-5, abs=0)


def assert_same_weights(run: Result, expected: Result) -> None:
    """The same arithmetic as one process, or plain data parallelism, but for the order of sums, which Adam amplifies on
    gradients near zero up to WEIGHT_ATOL, as between plain data parallelism and one process (pp2 x ep2 x tp2 with the
    load-balancing loss: one expert weight 1.4e-5 from plain data parallelism). A wrong split moves whole tensors by
    about the learning rate, 1e-3."""
    assert run.params.keys() == expected.params.keys()
    for key in expected.params:
        torch.testing.assert_close(run.params[key], expected.params[key], rtol=1e-5, atol=WEIGHT_ATOL, msg=key)
    # the experts were split: each rank held its share, and the whole weights were gathered for the comparison (8
    # stacked, or the last of 4 in a list, which the first rank does not hold)
    stacked = any(tensor.dim() == 3 and tensor.size(0) == 8 for tensor in run.params.values())
    assert stacked or any(".experts.3." in key for key in run.params)


@pytest.mark.parametrize(
    ("world_size", "name"), [(size, name) for size, cases in MATCH_ONE_PROCESS.items() for name in cases]
)
def test_expert_parallel_run_matches_one_process(world_size: int, name: str) -> None:
    case = MATCH_ONE_PROCESS[world_size][name]
    expert_parallel = parallel_results(world_size)[name]
    single = REFERENCES[case.reference(world_size)]
    assert_same_losses(expert_parallel, single, case)
    assert_same_weights(expert_parallel, single)


@pytest.mark.parametrize(
    ("world_size", "name"), [(size, name) for size, cases in MATCH_DATA_PARALLEL.items() for name in cases]
)
def test_with_the_load_balancing_loss_expert_parallel_matches_plain_data_parallel(world_size: int, name: str) -> None:
    case = MATCH_DATA_PARALLEL[world_size][name]
    expert_parallel, data_parallel = parallel_results(world_size)[name]
    assert_same_losses(expert_parallel, data_parallel, case)
    assert_same_weights(expert_parallel, data_parallel)


def test_the_load_balancing_loss_trains_as_each_ranks_own() -> None:
    """Guards the comparison above: with the load-balancing loss, data parallelism is not one process."""
    _, data_parallel = parallel_results(2)["moe_aux_loss"]
    single = REFERENCES[AUX_LOSS_ON_ONE_PROCESS]
    assert data_parallel.losses[0] == pytest.approx(single.losses[0], rel=1e-6)  # the same weights at step 1
    assert data_parallel.losses[-1] != pytest.approx(single.losses[-1], rel=1e-5)


@pytest.mark.parametrize(("world_size", "name"), [(size, name) for size, cases in REFUSED.items() for name in cases])
def test_models_expert_parallelism_cannot_split_are_refused(world_size: int, name: str) -> None:
    _, message = REFUSED[world_size][name]
    result = parallel_results(world_size)[name]
    assert result.error
    assert re.search(message, result.error), result.error


@pytest.mark.parametrize(
    ("devices", "options", "message"),
    [
        (2, dict(expert_parallel_size=4), r"expert_parallel_size=4 does not divide data_parallel_size=2: .* Choose"),
        (  # 4 stages of 1 rank: no data-parallel ranks to split the experts
            4,
            dict(expert_parallel_size=2, pipeline_parallel_size=4),
            r"expert_parallel_size=2 does not divide data_parallel_size=1: the ranks that split the experts are taken",
        ),
    ],
)
def test_layouts_expert_parallelism_cannot_take_are_refused_as_the_trainer_is_built(
    devices: int, options: dict, message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        Trainer(accelerator="cpu", devices=devices, strategy=ParallelStrategy(**options))


def test_experts_are_read_from_the_model_where_it_declares_them_and_found_where_it_does_not() -> None:
    declared = find_experts(MODELS["zoo_hf_mixtral_labels"](learning_rate=1e-3, warmup_steps=1))
    assert declared.declared_by == "the model's base_model_ep_plan"
    assert declared.names == ["model.model.layers.0.mlp.experts", "model.model.layers.1.mlp.experts"]
    assert declared.num_experts == 8
    discovered = find_experts(MoELlama("tiny"))
    assert discovered.declared_by == "discovered"
    assert discovered.names == [f"model.layers.{index}.mlp.experts" for index in range(4)]
    assert find_experts(Llama("tiny")) is None
    listed = find_experts(MODELS["zoo_litgpt_moe"](learning_rate=1e-3, warmup_steps=1))
    assert listed.listed and listed.declared_by == "discovered"
    assert listed.names == [f"model.transformer.h.{index}.mlp.experts" for index in range(4)]
    assert (listed.num_experts, listed.top_k) == (4, 2)  # top_k from LitGPT's config: n_expert_per_token


def test_an_expert_of_a_list_given_more_than_its_tokens_says_where_to_apply_the_weights() -> None:
    experts = ExpertList(nn.ModuleList(nn.Linear(4, 4) for _ in range(4)), range(2, 4), ep_group=None)
    assert [name for name, _ in experts.named_parameters()] == ["2.weight", "2.bias", "3.weight", "3.bias"]
    assert len(experts) == 4 and len(list(experts)) == 4  # every expert's call, as the block's loop expects
    tokens = torch.ones(3, 4)
    with pytest.raises(TypeError, match=r"Expert 1 was called with more than its tokens; .* Apply routing weights"):
        experts[1](tokens, torch.ones(3, 1))
    with pytest.raises(RuntimeError, match="Expert 3 was called outside its MoE block's forward"):
        experts[-1](tokens)


def test_each_expert_of_a_list_counts_the_tokens_routed_to_it() -> None:
    model = MODELS["listed_experts"](learning_rate=1e-3, warmup_steps=1)
    load = ExpertLoad(model)
    model(torch.randint(0, 64, (4, 32)))
    tokens = load.take()
    assert list(tokens) == ["blocks.0.ffn.experts", "blocks.1.ffn.experts"]
    assert all(len(counts) == 4 and counts.sum() == 4 * 32 * 2 for counts in tokens.values())  # to 2 experts each


def train_logging_to_wandb(save_dir: str) -> None:
    """Two steps of the tiny MoE Llama on one rank, logging to an offline W&B run."""
    os.environ["WANDB_MODE"] = "offline"
    seed_everything(1234)
    trainer = Trainer(
        accelerator="cpu",
        devices=1,
        strategy=ParallelStrategy(),
        max_steps=2,
        log_every_n_steps=1,
        logger=WandbLogger(project="lightdist", save_dir=save_dir),
        callbacks=[TrainingMonitor(log_every_n_steps=1)],
        enable_checkpointing=False,
        enable_model_summary=False,
        enable_progress_bar=False,
    )
    data = TokenDataModule(seq_len=32, batch_size=4, val_fraction=0.0, synthetic_tokens=16_384)
    trainer.fit(MoELlama("tiny"), datamodule=data)
    trainer.logger.experiment.finish()  # the offline run's files complete, as the script's exit would leave them


def test_wandb_shows_the_tokens_each_expert_got_and_the_imbalance(tmp_path: Path, capfd: pytest.CaptureFixture) -> None:
    run_ranks(1, train_logging_to_wandb, str(tmp_path))
    # The header counts what a token runs through: the attention and 2 of each layer's 8 experts.
    model = MoELlama("tiny")
    experts_of_a_layer = sum(p.numel() for p in model.model.layers[0].mlp.experts.parameters())
    idle = 4 * experts_of_a_layer * 6 // 8  # 6 of the 8 experts of each of the 4 layers
    active = sum(p.numel() for p in model.parameters()) - idle
    assert (
        f"lightdist: MoELlama, 453.2K parameters ({active / 1e3:.1f}K active per token), on 1 CPU rank"
        in capfd.readouterr().err
    )
    rows = [row for row in offline_run_history(tmp_path / "wandb") if "moe/imbalance" in row]
    assert len(rows) == 2
    layers = [f"model.layers.{index}.mlp.experts" for index in range(4)]
    for row in rows:
        for layer in layers:
            histogram = f"moe/tokens_per_expert/{layer}"
            assert row[f"{histogram}/_type"] == "histogram"
            assert row[f"{histogram}/bins"] == list(range(9))  # a bar per expert
            tokens = row[f"{histogram}/values"]
            assert sum(tokens) == 4 * 32 * 2  # every token of the batch, to its top 2 experts
            busiest = max(tokens) / (sum(tokens) / 8)
            assert row[f"moe/imbalance/{layer}"] == pytest.approx(busiest)
        assert row["moe/imbalance"] == max(row[f"moe/imbalance/{layer}"] for layer in layers)
    # the reference model's load-balancing loss, over the rank's tokens (1 where routing is perfectly balanced)
    aux_losses = [row["train_aux_loss"] for row in offline_run_history(tmp_path / "wandb") if "train_aux_loss" in row]
    assert len(aux_losses) == 2
    assert all(0.5 < loss < 8 for loss in aux_losses)
