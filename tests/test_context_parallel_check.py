"""A step written any way a user writes it trains under context parallelism as one process trains it, or stops with an
error at its first run: each kind of step is run once on whole sequences and once split, and must agree
(``lightdist/parallel/context/check.py``); a mean over tokens written in the step is counted as Hugging Face's loss is
(``lightdist/parallel/context/token_means.py``).

Each step below is a way people write one, grouped by what it does with the sequence: a mean over its tokens,
a shift, a write into the labels, positions from a table, a reduction or one position of each sequence.
"""

from __future__ import annotations

from functools import cache

import pytest
import torch
import torch.nn.functional as F
import transformers
from lightning.pytorch import Callback, LightningModule, Trainer, seed_everything
from torch import Tensor, nn
from torch.utils.data import DataLoader, DistributedSampler

from lightdist.parallel.context import probe_prefix
from lightdist.plugins import ParallelStrategy

from multirank import run_ranks, run_ranks_beside
from zoo import GPT, HF_TINY, GPTConfig, documents, language_modelling_collator, pairs

pytestmark = pytest.mark.multirank

PROMPT = 8  # the tokens of each document a prompt-masking step leaves unlabelled
BLOCK = 24  # the tokens of each batch's documents, padded


def shifted(module: LightningModule, batch: dict[str, Tensor]) -> tuple[Tensor, Tensor]:
    """Every token's loss and its label, the logits and labels shifted in the step."""
    logits = module.model(input_ids=batch["input_ids"]).logits
    labels = batch["labels"][:, 1:].flatten()
    return F.cross_entropy(logits[:, :-1].flatten(0, 1), labels, reduction="none"), labels


def masked_token_mean(module, batch):
    losses, labels = shifted(module, batch)
    mask = (labels != -100).float()
    return (losses * mask).sum() / mask.sum()


def summed_over_labelled(module, batch):
    logits = module.model(input_ids=batch["input_ids"]).logits
    summed = F.cross_entropy(logits[:, :-1].flatten(0, 1), batch["labels"][:, 1:].flatten(), reduction="sum")
    return summed / (batch["labels"][:, 1:] != -100).sum().clamp(min=1)


def mean_of_selected(module, batch):
    losses, labels = shifted(module, batch)
    return losses[labels != -100].mean()


def own_loss_after_the_prompt(module, batch):
    """The prompt's tokens unlabelled before the model computes its loss, on a copy."""
    labels = batch["labels"].clone()
    labels[:, :PROMPT] = -100
    return module.model(input_ids=batch["input_ids"], labels=labels).loss


def summed_over_a_number(module, batch):
    """The count taken out of the graph, where lightdist cannot see what the sum is divided by (targets shifted by
    the loader)."""
    logits = module.model(input_ids=batch["input_ids"]).logits
    losses = F.cross_entropy(logits.flatten(0, 1), batch["targets"].flatten(), reduction="none")
    mask = batch["targets"].flatten() != -100
    return (losses * mask).sum() / mask.sum().item()


def flattened_shift(module, batch):
    logits = module.model(input_ids=batch["input_ids"]).logits
    return F.cross_entropy(logits.view(-1, logits.size(-1))[:-1], batch["labels"].view(-1)[1:])


def row_by_row_shift(module, batch):
    logits = module.model(input_ids=batch["input_ids"]).logits
    rows = [F.cross_entropy(logits[row, :-1], batch["labels"][row][1:]) for row in range(len(logits))]
    return torch.stack(rows).mean()


def prompt_masked_in_place(module, batch):
    """The prompt is a tensor of the batch; the labels under it unlabelled where its shape says it ends."""
    labels = batch["labels"]
    labels[:, : batch["prompt"].shape[1]] = -100
    return module.model(input_ids=batch["input_ids"], labels=labels).loss


def per_sequence_mean(module, batch):
    losses, _ = shifted(module, batch)
    return losses.view(len(batch["labels"]), -1).mean(axis=1).mean()


def per_document_mean_of_a_reshape(module, batch):
    """Each document's mean over its labelled tokens, then the documents' mean (targets shifted by the loader)."""
    logits = module.model(input_ids=batch["input_ids"]).logits
    losses = F.cross_entropy(logits.flatten(0, 1), batch["targets"].flatten(), reduction="none").view(-1, BLOCK)
    mask = (batch["targets"] != -100).view(-1, BLOCK)
    return ((losses * mask).sum(1) / mask.sum(1).clamp(min=1)).mean()


def last_token_classified(module, batch):
    hidden = module.model.model(input_ids=batch["input_ids"]).last_hidden_state
    return F.cross_entropy(module.model.lm_head(hidden[:, -1]), batch["input_ids"][:, 0])


class FineTuning(LightningModule):
    """A tiny Hugging Face Llama as ``self.model`` (its loss's own shift, SDPA), trained by one of the steps above
    on the collator's batches of documents padded to ``BLOCK`` tokens, each opening with an unlabelled instruction,
    with a prompt tensor of ``PROMPT`` tokens and the labels shifted by one (``targets``) beside them."""

    def __init__(self, loss) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.loss = loss
        self.model = transformers.AutoModelForCausalLM.from_config(
            transformers.AutoConfig.for_model(model_type="llama", num_key_value_heads=2, **HF_TINY)
        )

    def training_step(self, batch: dict[str, Tensor], batch_idx: int) -> Tensor:
        loss = self.loss(self, batch)
        self.log("train_loss", loss, sync_dist=True)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-3)

    def train_dataloader(self) -> DataLoader:
        collate = transformers.DataCollatorForLanguageModeling(
            language_modelling_collator().tokenizer, mlm=False, pad_to_multiple_of=BLOCK
        )

        def with_prompt(docs: list[dict]) -> dict[str, Tensor]:
            batch = dict(collate(docs))
            # each document's first tokens an instruction, unlabelled: 2, 5, 3 and 7 of them
            instruction = torch.tensor([2, 5, 3, 7]).repeat(len(docs))[: len(docs), None]
            labels = batch["labels"].masked_fill(torch.arange(BLOCK) < instruction, -100)
            targets = F.pad(labels[:, 1:], (0, 1), value=-100)
            return {**batch, "labels": labels, "prompt": batch["input_ids"][:, :PROMPT], "targets": targets}

        return DataLoader(documents(64, padded=True), batch_size=4, collate_fn=with_prompt)


class AnswerInTheLastQuarter(FineTuning):
    """Fine-tuning on documents whose first three quarters are a prompt, unlabelled by the data: one rank holds no
    labelled token (the split gives it the middle two of four chunks), and its mean over none is 0 / 0."""

    def __init__(self) -> None:
        super().__init__(EXACT["labels"])

    def train_dataloader(self) -> DataLoader:
        collate = transformers.DataCollatorForLanguageModeling(
            language_modelling_collator().tokenizer, mlm=False, pad_to_multiple_of=4
        )

        def answer_only(docs: list[dict]) -> dict[str, Tensor]:
            batch = dict(collate(docs))
            batch["labels"][:, : batch["labels"].size(1) * 3 // 4 + 1] = -100
            return batch

        return DataLoader(documents(64, padded=True), batch_size=4, collate_fn=answer_only)


class TabledPositions(GPT):
    """nanoGPT whose positions come from a table sliced by the sequence's length, as minGPT's learned ``pos_emb``
    (a parameter of shape (1, block, width)), a sinusoidal ``pe`` buffer, or a tensor attribute nobody registered."""

    def __init__(self, table: str) -> None:
        super().__init__(GPTConfig(n_layer=2))
        values = torch.randn(1, self.config.block_size, self.config.n_embd) * 0.02
        if table == "parameter":
            self.pos_emb = nn.Parameter(values)
        elif table == "buffer":
            self.register_buffer("pos_emb", values)
        else:
            self.pos_emb = values

    def forward(self, idx: Tensor, targets: Tensor) -> Tensor:
        x = self.transformer.wte(idx) + self.pos_emb[:, : idx.size(1)]
        for block in self.transformer.h:
            x = block(x)
        logits = self.lm_head(self.transformer.ln_f(x))
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))


class OnPairs(LightningModule):
    """``TabledPositions`` on ``(x, y)`` pairs of 32 tokens."""

    def __init__(self, table: str) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.model = TabledPositions(table)

    def training_step(self, batch: list[Tensor], batch_idx: int) -> Tensor:
        loss = self.model(*batch)
        self.log("train_loss", loss, sync_dist=True)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-3)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(pairs(64, 32), batch_size=4)


EXACT = {
    "labels": lambda module, batch: module.model(input_ids=batch["input_ids"], labels=batch["labels"]).loss,
    "masked_token_mean": masked_token_mean,
    "summed_over_labelled": summed_over_labelled,
    "mean_of_selected": mean_of_selected,
    "own_loss_after_the_prompt": own_loss_after_the_prompt,
    "learned_positions": "parameter",
    "buffered_positions": "buffer",
}
REFUSED = {
    "summed_over_a_number": summed_over_a_number,
    "flattened_shift": flattened_shift,
    "row_by_row_shift": row_by_row_shift,
    "prompt_masked_in_place": prompt_masked_in_place,
    "per_sequence_mean": per_sequence_mean,
    "last_token_classified": last_token_classified,
    "positions_from_an_attribute": "attribute",
    "per_document_mean_of_a_reshape": per_document_mean_of_a_reshape,
}


def module_for(name: str) -> LightningModule:
    if name == "answer_in_the_last_quarter":
        return AnswerInTheLastQuarter()
    step = {**EXACT, **REFUSED}[name]
    return FineTuning(step) if callable(step) else OnPairs(step)


class _LoggedLosses(Callback):
    def __init__(self) -> None:
        self.losses: list[float] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.losses.append(trainer.callback_metrics["train_loss"].item())


LAYOUTS = {  # each sequence split over two ranks, alone or beside two pipeline stages
    "cp2": dict(context_parallel_size=2),
    "pp2_cp2": dict(pipeline_parallel_size=2, context_parallel_size=2),
}


def train(name: str, layout: str | None) -> list[float] | str:
    """The loss logged at each of 3 steps, on one process (``layout`` None) or in ``layout``; or the error that
    stopped the run."""
    seed_everything(0)
    logged = _LoggedLosses()
    options = LAYOUTS.get(layout)
    trainer = Trainer(
        accelerator="cpu",
        devices=2 * options.get("pipeline_parallel_size", 1) if options else 1,
        strategy=ParallelStrategy(**options) if options else "auto",
        max_steps=3,
        callbacks=[logged],
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
    )
    module = module_for(name)
    try:
        trainer.fit(module, train_dataloaders=module.train_dataloader() if options else dealt(module))
    except ValueError as error:
        return f"ValueError: {error}"
    return logged.losses


def dealt(module: LightningModule) -> DataLoader:
    """``module``'s loader in the order Lightning's distributed sampler deals one data-parallel rank: shuffled, seed
    0. Lightning adds it to every multi-rank run."""
    loader = module.train_dataloader()
    order = DistributedSampler(loader.dataset, num_replicas=1, rank=0, shuffle=True, seed=0)
    return DataLoader(loader.dataset, batch_size=loader.batch_size, sampler=order, collate_fn=loader.collate_fn)


def train_each(names: list[str], layout: str | None) -> dict[str, list[float] | str]:
    return {name: train(name, layout) for name in names}


EXACT_RUNS = [*EXACT, "answer_in_the_last_quarter"]


# Under a pipeline too (the check runs the schedule whole, then split). A shift in the step is refused there by name
# (the microbatches are weighed before their loss is computed): these steps shift nothing, or in the model's loss.
PIPELINED = ["labels", "summed_over_a_number", "prompt_masked_in_place", "last_token_classified"]


@cache
def runs() -> tuple[dict, dict, dict]:
    """Every step split over two ranks, some beside two pipeline stages too, and the exact ones on one process beside
    them (on the core they leave idle): Lightning's sampler deals one data-parallel rank the batches in the loader's
    order."""
    one_process = run_ranks_beside(1, train_each, EXACT_RUNS, None)
    split = run_ranks(2, train_each, [*EXACT_RUNS, *REFUSED], "cp2", timeout=500)[0]
    pipelined = run_ranks(4, train_each, PIPELINED, "pp2_cp2", timeout=500)[0]
    return split, one_process.result()[0], pipelined


@pytest.mark.parametrize("name", EXACT_RUNS)
def test_a_step_that_splits_exactly_trains_as_one_process(name: str) -> None:
    split, one_process, _ = runs()
    assert isinstance(split[name], list), split[name]
    assert len(split[name]) == 3
    assert split[name] == pytest.approx(one_process[name], rel=1e-5)


@pytest.mark.parametrize(
    ("name", "refusal"),
    [
        # by name, where the op shows it: a shift of tensors the split has flattened, a mean along the sequence
        (
            "flattened_shift",
            "shifts a tensor that holds this rank's share of each sequence ((24, 64), the last position",
        ),
        ("per_sequence_mean", "computes mean along the sequence of a tensor that holds this rank's share"),
        # by the check of the step against whole sequences, where nothing does
        ("summed_over_a_number", "the loss by"),
        ("row_by_row_shift", "the loss by"),
        ("prompt_masked_in_place", "the loss by"),
        ("last_token_classified", "the loss by"),
        ("positions_from_an_attribute", "the loss by"),
        ("per_document_mean_of_a_reshape", "the loss by"),
    ],
)
def test_a_step_that_would_train_differently_is_refused_at_its_first_run(name: str, refusal: str) -> None:
    split, _, _ = runs()
    assert isinstance(split[name], str), f"{name} trained: {split[name]}"
    assert refusal in split[name]
    if "the loss by" in refusal:
        assert (
            "training_step computes something else on sequences split over 2 ranks than on whole sequences"
            in (split[name])
        )
        assert "train with context_parallel_size=1" in split[name]


def test_the_check_runs_on_as_many_tokens_as_a_rank_holds_the_ranks_holding_unequal_labels() -> None:
    # over 2 ranks, rank 0 holds positions 0 and 3, rank 1 positions 1 and 2
    labels = torch.tensor([[1, 2, 3, 4], [1, 2, -100, -100], [1, -100, -100, -100], [-100, -100, -100, 4]])
    batch = {"input_ids": labels.clamp(min=0), "labels": labels, "prompt": labels[:, :2]}
    prefix = probe_prefix(batch, cp=2)
    assert prefix["labels"].tolist() == [[1, -100, -100, -100], [-100, -100, -100, 4]]  # in the batch's order
    assert prefix["prompt"].tolist() == [[1, -100], [-100, -100]]
    # one window of 65 tokens over 4 ranks: its first 17, one more than a length that splits into 8 chunks
    (window,) = probe_prefix([torch.arange(65)[None]], cp=4)
    assert window.tolist() == [list(range(17))]


def test_under_a_pipeline_too_a_step_trains_as_one_process_or_is_refused_at_its_first_run() -> None:
    _, one_process, pipelined = runs()
    assert pipelined["labels"] == pytest.approx(one_process["labels"], rel=1e-5), pipelined["labels"]
    for name in ("summed_over_a_number", "prompt_masked_in_place", "last_token_classified"):
        assert isinstance(pipelined[name], str), f"{name} trained: {pipelined[name]}"
        assert "training_step computes something else on sequences split over 2 ranks" in pipelined[name], name
