"""How a model is cut into pipeline stages, and validation through a pipeline (training is in test_equivalence)."""

from __future__ import annotations

import re
import tempfile
import xml.etree.ElementTree as ElementTree
from concurrent.futures import Future
from functools import cache
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from lightning.pytorch import Trainer, seed_everything
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.utils.data import DataLoader

from lightdist.cli import main
from lightdist.models import Llama, TokenDataModule
from lightdist.parallel.pipeline.structural import (
    MicrobatchCalls,
    ModelCall,
    StageModel,
    balanced_split,
    check_blocks_hand_on_one_stream,
    keep_stages,
    stage_ends,
)
from lightdist.parallel.pipeline.whole_copy import whole_copy
from lightdist.parallel.structure import find_decoder_stack
from lightdist.plan.timeline import stage_spans
from lightdist.plugins import ParallelStrategy, ProfileSteps
from lightdist.plugins.model_calls import model_call_of

import zoo
from multirank import raised, run_each, run_ranks, run_ranks_beside
from training import MODELS, Case, train


def test_stages_balance_parameters_counting_embeddings_and_head() -> None:
    assert balanced_split([1] * 6, 2) == [3, 3]
    assert balanced_split([1] * 6, 2, first_extra=2) == [2, 4]  # the embeddings weigh as much as two blocks
    assert balanced_split([4, 1, 1, 1, 1], 2) == [1, 4]  # a heavy first block is a stage of its own
    assert balanced_split([4, 1, 1, 1, 1], 2, last_extra=2) == [2, 3]


@pytest.mark.parametrize(
    ("model", "first_stage", "last_stage"),
    [
        # the embeddings' norm runs before the blocks: on the first stage (it was on the last, and BLOOM trained
        # differently from one process under a pipeline, without an error)
        ("hf_bloom", {"word_embeddings", "word_embeddings_layernorm"}, {"ln_f", "lm_head"}),
        # OPT registers its final norm before its blocks, LitGPT its head before its embedding: the run tells
        ("zoo_hf_opt_labels", {"embed_tokens", "embed_positions"}, {"final_layer_norm", "lm_head"}),
        ("zoo_litgpt", {"wte"}, {"ln_f", "lm_head"}),
        ("zoo_nanogpt", {"wte", "wpe"}, {"ln_f", "lm_head"}),
    ],
)
def test_each_module_outside_the_blocks_goes_to_the_stage_that_runs_it(
    model: str, first_stage: set[str], last_stage: set[str]
) -> None:
    module = MODELS[model](learning_rate=1e-3, warmup_steps=2)
    ends = stage_ends(module, find_decoder_stack(module))
    assert {name.rsplit(".", 1)[-1] for name, first in ends.items() if first} == first_stage
    assert {name.rsplit(".", 1)[-1] for name, first in ends.items() if not first} == last_stage


class _NormedEmbeddingsLM(torch.nn.Module):
    """Norms its embeddings before its blocks, and runs only with the targets it is given."""

    def __init__(self) -> None:
        super().__init__()
        self.embed, self.embed_norm = torch.nn.Embedding(16, 8), torch.nn.LayerNorm(8)
        self.blocks = torch.nn.ModuleList(torch.nn.Linear(8, 8) for _ in range(2))
        self.head = torch.nn.Linear(8, 16)

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        x = self.embed_norm(self.embed(tokens))
        for block in self.blocks:
            x = block(x)
        return torch.nn.functional.cross_entropy(self.head(x).flatten(0, 1), targets.flatten())


def test_a_stage_refuses_to_compute_without_a_module_placed_on_another() -> None:
    """Where lightdist cannot run the model to see which modules run before its blocks, only the embeddings go
    first: the first stage then meets a stand-in for the norm, and refuses rather than train without it."""
    model = _NormedEmbeddingsLM()
    stack = keep_stages(model, find_decoder_stack(model), {0}, first=True, last=False)
    first_stage = StageModel(model, stack, list(stack.blocks), first=True, last=False)
    tokens = torch.zeros(2, 4, dtype=torch.long)
    calls = MicrobatchCalls([ModelCall("", (tokens, tokens), {})])
    with pytest.raises(
        ValueError,
        match=r"placed embed_norm \(LayerNorm\) on the last stage, but the model's forward runs "
        r"it before its blocks",
    ) as refused:
        first_stage(lightdist_model_calls=calls, lightdist_microbatch=torch.zeros(1))
    assert "(pipeline_tracer=True)" in str(refused.value)


def test_the_model_call_is_the_first_call_of_a_module_around_the_decoder_stack() -> None:
    """Pipeline stages run the module the step calls: nanoGPT's step calls ``self.model(x, y)``; a step that calls
    only what sits inside the stack or beside it is told which calls would be the model's."""
    nanogpt = MODELS["zoo_nanogpt"](learning_rate=1e-3, warmup_steps=2)
    batch = torch.randint(0, 64, (2, 9))
    enclosing = ["", "model", "model.transformer"]
    call = model_call_of(nanogpt, lambda whole: nanogpt.training_step(whole, 0), batch, {}, enclosing)
    assert isinstance(call, ModelCall) and call.path == "model" and not call.kwargs
    assert [tuple(argument.shape) for argument in call.args] == [(2, 8), (2, 8)]

    def step_around_the_model(whole: torch.Tensor) -> torch.Tensor:
        return nanogpt.model.lm_head(nanogpt.model.transformer.wte(whole))

    with pytest.raises(RuntimeError, match=r"never called the model \(`self\(...\)` or `self.model\(...\)` or "):
        model_call_of(nanogpt, step_around_the_model, batch, {}, enclosing)


def quiet_trainer(strategy: dict | None, devices: int, **options: Any) -> Trainer:
    """A ``ParallelStrategy`` with ``strategy``'s options, or a single process when it is ``None``."""
    return Trainer(
        **options,
        accelerator="cpu",
        devices=devices,
        strategy=ParallelStrategy(**strategy) if strategy else "auto",
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )


class CountingLlama(Llama):
    """Also counts the windows it validates, logged as a sum: under a pipeline, over the microbatches too."""

    def validation_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        self.log("val_windows", float(len(batch)), reduce_fx="sum", sync_dist=True)
        return super().validation_step(batch, batch_idx)


def validation_data() -> TokenDataModule:
    return TokenDataModule(seq_len=32, batch_size=4, val_fraction=0.25, synthetic_tokens=16_384, shuffle=False)


def validate(strategy: dict | None, devices: int) -> tuple[dict[str, float], list[str]]:
    """``trainer.validate`` and ``trainer.test`` of a freshly seeded tiny Llama; their metrics and the parameter
    names this rank holds."""
    seed_everything(1234)
    model = CountingLlama("tiny")
    data = validation_data()
    trainer = quiet_trainer(strategy, devices)
    (metrics,) = trainer.validate(model, datamodule=data)
    (tested,) = trainer.test(model, dataloaders=data.val_dataloader())
    return {**metrics, **tested}, [name for name, _ in model.named_parameters()]


@pytest.mark.multirank
@pytest.mark.parametrize("schedule", ["1f1b", "interleaved_1f1b"])
def test_validation_and_test_through_a_pipeline_match_one_process(schedule: str) -> None:
    (first, first_names), (last, last_names) = pipeline_results()[f"validate_{schedule}"]
    single, _ = single_process_results()["validate"]

    assert (
        first.keys() == single.keys() == {"val_loss", "val_perplexity", "val_windows", "test_loss", "test_perplexity"}
    )
    assert first == pytest.approx(single, rel=1e-5, abs=0)
    assert first["val_windows"] == 124  # 31 batches of 4: the step's log ran once per microbatch, and was summed
    assert first == last  # every stage reports the last stage's numbers
    # Each stage keeps its blocks under their own names: the first the embeddings, the last the norm and head.
    assert [name for name in first_names if ".layers." not in name] == ["model.embed_tokens.weight"]
    assert [name for name in last_names if ".layers." not in name] == ["model.norm.weight", "model.lm_head.weight"]
    blocks = {name.split(".")[2] for name in first_names if ".layers." in name}
    # Interleaved: each rank holds two stages, every other block; otherwise the first half.
    assert blocks == ({"0", "2"} if schedule == "interleaved_1f1b" else {"0", "1"})
    assert {name.split(".")[2] for name in last_names if ".layers." in name} == {"0", "1", "2", "3"} - blocks


def validate_built_on_meta(strategy: dict, devices: int) -> tuple[dict[str, float], dict[str, torch.Tensor]]:
    """``trainer.validate`` of a tiny Llama built on the meta device, as ``Trainer.init_module(empty_init=True)``
    builds a model too large for one process's memory; the metrics and this rank's share of the weights it was
    materialized with."""
    seed_everything(1234)
    trainer = quiet_trainer(strategy, devices)
    with trainer.init_module(empty_init=True):
        model = Llama("tiny")
    assert all(p.is_meta for p in model.parameters())
    # Memory that materializing leaves unfilled reads as NaN, not as whatever was there before.
    torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        (metrics,) = trainer.validate(model, datamodule=validation_data())
    finally:
        torch.use_deterministic_algorithms(False)
    weights = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    return metrics, {name: weight.detach().clone() for name, weight in weights.items()}


@pytest.mark.multirank
def test_a_model_built_on_the_meta_device_validates_as_its_weights_do_in_memory() -> None:
    # Stages cut by the tracer compute with the model's rotary tables, filled when the model is materialized; the
    # validation metrics start from zero, not from uninitialized memory.
    (metrics, first_weights), (_, last_weights) = pipeline_results()["validate_built_on_meta"]
    model = Llama("tiny")
    model.load_state_dict({**first_weights, **last_weights})
    (in_memory,) = quiet_trainer(None, 1).validate(model, datamodule=validation_data())
    assert metrics == pytest.approx(in_memory, rel=1e-5, abs=0)


class WeightedLlama(Llama):
    """Called with more than the token ids: a weight per example, and a keyword option."""

    def forward(self, tokens: torch.Tensor, weights: torch.Tensor, *, scale: float = 1.0) -> torch.Tensor:
        return super().forward(tokens) * weights[:, None, None] * scale

    def predict_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        return self(batch, 1 + batch[:, 0] / 64, scale=0.5)


def predict(strategy: dict | None, devices: int) -> torch.Tensor:
    seed_everything(1234)
    tokens = torch.randint(0, 64, (8, 32), generator=torch.Generator().manual_seed(0))
    trainer = quiet_trainer(strategy, devices)
    batches = trainer.predict(WeightedLlama("tiny"), dataloaders=DataLoader(tokens, batch_size=4))
    return torch.cat(batches)


@pytest.mark.multirank
def test_predict_through_a_pipeline_matches_one_process() -> None:
    # Every argument of the model call reaches every stage, tensors cut into microbatches with the batch.
    first, last = pipeline_results()["predict_zero_bubble"]  # two stages per rank
    single = single_process_results()["predict"]
    assert single.shape[-1] == 64  # logits over the vocabulary, for every window and position
    torch.testing.assert_close(last, single, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(first, last, rtol=0, atol=0)  # every rank returns the last stage's predictions


@pytest.mark.multirank
def test_predict_with_each_sequence_split_over_two_ranks_returns_it_whole() -> None:
    # Each rank predicts for its half of every sequence, gathered in order; weights from each sequence's first token.
    first, second = pipeline_results()["predict_cp2"]
    torch.testing.assert_close(first, single_process_results()["predict"], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(first, second, rtol=0, atol=0)


# Under 1F1B, third-party model code: a Hugging Face Llama whose step calls self.model(..., labels=...) and takes the
# model's own loss; under interleaved 1F1B, the reference Llama's four blocks make four stages.
PROFILED_MODELS = {"1f1b": "zoo_hf_llama_labels", "interleaved_1f1b": "llama"}


def profile_second_step(schedule: str, traces: str) -> None:
    strategy = dict(pipeline_parallel_size=2, microbatches=4, pipeline_schedule=schedule)
    case = Case(strategy=strategy, model=PROFILED_MODELS[schedule], steps=2)
    train(case, devices=2, callbacks=[ProfileSteps(steps=[1], dirpath=traces)])


@pytest.mark.multirank
@pytest.mark.parametrize(("schedule", "stages"), [("1f1b", [[0], [1]]), ("interleaved_1f1b", [[0, 2], [1, 3]])])
def test_a_profiled_step_traces_each_stage_forward_and_backward_per_microbatch(
    schedule: str, stages: list[list[int]], tmp_path: Path
) -> None:
    traces = pipeline_results()[f"traces_{schedule}"]
    for rank, rank_stages in enumerate(stages):
        spans = stage_spans(traces / f"rank{rank}.json")
        assert sorted((span.stage, span.kind, span.microbatch) for span in spans) == sorted(
            (stage, kind, microbatch)
            for stage in rank_stages
            for kind in ("forward", "backward")
            for microbatch in range(4)
        )
    # Every rank's spans, drawn as one timeline: a box per stage, computation and microbatch.
    main(["timeline", str(traces), "--output", str(tmp_path / "timeline.svg")])
    drawing = ElementTree.parse(tmp_path / "timeline.svg").getroot()
    boxes = [box for box in drawing.iter("{http://www.w3.org/2000/svg}rect") if box.find("{*}title") is not None]
    assert len(boxes) == 2 * 2 * 4 * len(stages[0])


PP2 = dict(pipeline_parallel_size=2, microbatches=2)


@cache
def pipeline_results() -> dict[str, tuple]:
    """Each pipelined run above, all in one pair of ranks: rank 0's result (first stage) and rank 1's (last)."""
    single_process_run()
    calls = {
        f"validate_{schedule}": (validate, (dict(PP2, pipeline_schedule=schedule), 2))
        for schedule in ("1f1b", "interleaved_1f1b")
    }
    calls["predict_zero_bubble"] = (predict, (dict(PP2, pipeline_schedule="zero_bubble"), 2))
    calls["predict_cp2"] = (predict, (dict(context_parallel_size=2), 2))
    calls["validate_built_on_meta"] = (validate_built_on_meta, (dict(PP2, pipeline_tracer=True), 2))
    calls |= {f"first_step_{name}": (raised, (train_one_step, name)) for name in FIRST_STEP_REFUSED}
    traces = {f"traces_{name}": Path(tempfile.mkdtemp(prefix="traces-")) for name in ("1f1b", "interleaved_1f1b")}
    calls |= {name: (profile_second_step, (name.removeprefix("traces_"), str(path))) for name, path in traces.items()}
    first, last = run_ranks(2, run_each, list(calls.values()))
    return dict(zip(calls, zip(first, last, strict=True), strict=True)) | traces


@cache
def single_process_run() -> Future[list[list[Any]]]:
    """Validation and prediction in one process, beside the pipeline's ranks: started with them."""
    return run_ranks_beside(1, run_each, [(validate, (None, 1)), (predict, (None, 1))])


def single_process_results() -> dict[str, Any]:
    validated, predicted = single_process_run().result()[0]
    return {"validate": validated, "predict": predicted}


class _BiasedBlock(torch.nn.Module):
    """A block that takes a bias over its scores, and computes it where it is given none, as T5's first block does."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(8, 8)

    def forward(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        bias = torch.zeros(x.size(1), x.size(1)) if bias is None else bias
        return x + self.proj(x) + bias.sum(), bias + 1


class _BiasHandedOnLM(torch.nn.Module):
    """Its loop hands each block the bias the block before returned (T5's position bias)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed, self.head = torch.nn.Embedding(16, 8), torch.nn.Linear(8, 16)
        self.layers = torch.nn.ModuleList(_BiasedBlock() for _ in range(4))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x, bias = self.embed(tokens), None
        for block in self.layers:
            x, bias = block(x, bias)
        return self.head(x)


def test_a_model_whose_blocks_hand_on_more_than_the_hidden_states_is_refused_before_it_is_cut() -> None:
    model = _BiasHandedOnLM()
    handed_on = r"hands layers.1 a tensor of shape \(8, 8\) that layers.0 returned besides its hidden states"
    with pytest.raises(ValueError, match=handed_on):
        check_blocks_hand_on_one_stream(model, find_decoder_stack(model))
    # what a block hands back as it was given (a mask carried through the loop) is no state of its own
    nanogpt = MODELS["zoo_nanogpt"](learning_rate=1e-3, warmup_steps=2)
    check_blocks_hand_on_one_stream(nanogpt, find_decoder_stack(nanogpt))


class _EmbeddingsAddedBackGPT(zoo.GPT):
    """nanoGPT whose head reads the embeddings beside the last block's output: a tensor computed before the blocks,
    used after them."""

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        positions = torch.arange(idx.size(1), device=idx.device)
        embedded = self.transformer.wte(idx) + self.transformer.wpe(positions)
        x = embedded
        for block in self.transformer.h:
            x = block(x)
        logits = self.lm_head(self.transformer.ln_f(x + embedded))
        return logits, F.cross_entropy(logits.flatten(0, 1), targets.flatten())


class EmbeddingsAddedBack(zoo.NanoGPT):
    def __init__(self) -> None:
        super().__init__(learning_rate=1e-3, warmup_steps=2)
        self.model = _EmbeddingsAddedBackGPT(zoo.GPTConfig())


class OwnMeanUncounted(zoo.HuggingFaceFineTuning):
    """Its loss is a mean over the labelled tokens, computed in the step, with no ``loss_tokens`` to count them."""

    def __init__(self) -> None:
        super().__init__(learning_rate=1e-3, warmup_steps=2, model_type="llama", **zoo.HF_TINY)

    training_step = zoo.HuggingFaceFineTuningOwnLoss.training_step


FIRST_STEP_REFUSED = {
    "embeddings_added_back": (EmbeddingsAddedBack, lambda: torch.randint(0, 64, (8, 17))),
    # padded to 24 tokens, the first batch's documents hold 8 to 24 labelled tokens
    "own_mean_uncounted": (OwnMeanUncounted, lambda: zoo.documents(8, padded=True)),
}


def train_one_step(name: str) -> None:
    module, data = FIRST_STEP_REFUSED[name]
    seed_everything(1234)
    collate = zoo.language_modelling_collator() if name == "own_mean_uncounted" else None
    trainer = quiet_trainer(dict(PP2), 2, max_steps=1)
    trainer.fit(module(), DataLoader(data(), batch_size=4, collate_fn=collate))


@pytest.mark.multirank
@pytest.mark.parametrize(
    ("name", "difference"),
    [
        ("embeddings_added_back", r"computes a loss of [\d.]+ on 2 examples of its first batch, where it computes "),
        ("own_mean_uncounted", r"on 2 examples of its first batch does not compute what its microbatches compute"),
    ],
)
def test_a_pipeline_that_would_train_differently_from_one_process_stops_at_its_first_step(
    name: str, difference: str
) -> None:
    """Neither shows in the model's structure: the head reading the embeddings (the last stage holds a stand-in for
    them, which gives zeros), and a mean over tokens lightdist cannot count, which weighs the microbatches alike.
    The first step runs the pipeline beside a whole copy of the model, and every rank stops."""
    first, last = pipeline_results()[f"first_step_{name}"]
    assert first == last
    assert re.search(difference, first), first
    assert "the run would train differently from one process" in first


class _HoldsItsData(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(4, 4)
        self.tokens = torch.arange(1000)  # its data, not a weight
        self.tokenizer = {"pad": 0}


def test_the_whole_copy_has_weights_of_its_own_and_shares_what_else_the_model_holds() -> None:
    model = _HoldsItsData()
    copied = whole_copy(model)
    assert copied.layer is not model.layer and copied.layer.weight is not model.layer.weight
    assert torch.equal(copied.layer.weight, model.layer.weight)
    assert copied.tokens is model.tokens and copied.tokenizer == model.tokenizer
    with torch.device("meta"):
        assert whole_copy(_HoldsItsData()) is None  # too big to build on a device: no copy
