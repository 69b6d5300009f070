"""A pipeline cuts each batch into microbatches of the same form, whatever the data loader made, and weighs each
microbatch's loss by its share of the batch's tokens where it can count them."""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import pytest
import torch
import transformers

from lightdist.parallel.loss_tokens import labelled_tokens, shares
from lightdist.parallel.pipeline.microbatches import cut_batch, examples_in


def rows(count: int, width: int = 3) -> torch.Tensor:
    return torch.arange(count * width).reshape(count, width)


def test_a_pair_from_a_tensor_dataset_is_cut_alike() -> None:
    x, y = rows(4), rows(4) + 100

    first, second = cut_batch([x, y], 2)

    assert isinstance(first, list)
    torch.testing.assert_close(first[0], x[:2])
    torch.testing.assert_close(second[1], y[2:])


def test_a_collators_batch_encoding_stays_one() -> None:
    batch = transformers.BatchEncoding(
        {"input_ids": rows(4), "attention_mask": torch.ones(4, 3), "labels": torch.full((4, 3), -100)}
    )

    microbatches = cut_batch(batch, 4)

    assert all(type(microbatch) is transformers.BatchEncoding for microbatch in microbatches)
    assert [microbatch["input_ids"].tolist() for microbatch in microbatches] == [[row] for row in rows(4).tolist()]
    assert microbatches[3].keys() == batch.keys()


@dataclass
class Example:
    tokens: torch.Tensor
    names: list[str]  # one per example
    source: str  # one for the whole batch
    temperature: torch.Tensor  # a scalar


class Pair(NamedTuple):
    inputs: torch.Tensor
    positions: torch.Tensor  # one row, broadcast over the examples


def test_nested_dataclasses_and_named_tuples_keep_what_is_not_per_example_whole() -> None:
    batch = {
        "example": Example(rows(4), ["a", "b", "c", "d"], "corpus", torch.tensor(0.5)),
        "pair": Pair(rows(4, 5), torch.arange(5)[None]),
    }

    first, second = cut_batch(batch, 2)

    assert second["example"].names == ["c", "d"]
    assert second["example"].source == "corpus"
    torch.testing.assert_close(second["example"].temperature, torch.tensor(0.5))
    assert isinstance(first["pair"], Pair)
    torch.testing.assert_close(first["pair"].inputs, rows(4, 5)[:2])
    torch.testing.assert_close(first["pair"].positions, torch.arange(5)[None])


def test_examples_are_counted_by_the_token_shaped_tensors() -> None:
    assert examples_in({"tokens": rows(4, 16), "offsets": torch.arange(5)}) == 4
    assert examples_in((torch.arange(6), torch.arange(6))) == 6  # ids and labels for classification
    assert examples_in({"tokens": rows(4), "positions": torch.arange(3)[None]}) == 4


def test_what_cannot_be_cut_is_named() -> None:
    with pytest.raises(ValueError, match=r"batch\['offsets'\] has 5 rows where the batch has 4 examples"):
        cut_batch({"tokens": rows(4), "offsets": torch.arange(5)}, 2)
    with pytest.raises(ValueError, match="microbatches=3 does not divide the batch of 4 examples"):
        cut_batch(rows(4), 3)
    with pytest.raises(ValueError, match=r"holds no tensor with one \(dict\)"):
        cut_batch({"text": ["a", "b"]}, 2)


def test_a_causal_lm_called_with_labels_counts_the_tokens_its_loss_averages_over() -> None:
    config = transformers.AutoConfig.for_model(
        model_type="llama",
        vocab_size=64,
        hidden_size=32,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
    )
    model = transformers.AutoModelForCausalLM.from_config(config)
    labels = torch.tensor([[5, 6, 7, -100], [5, -100, -100, -100]])  # the first label of each row is never predicted

    assert labelled_tokens(model, {"input_ids": labels.clamp(min=0), "labels": labels}) == 2 + 0
    assert labelled_tokens(model, {"input_ids": labels.clamp(min=0)}) is None  # no labels: the step's own loss
    assert labelled_tokens(model, {"labels": labels, "num_items_in_batch": 7}) is None  # normalised by the caller
    assert labelled_tokens(torch.nn.Linear(2, 2), {"labels": labels}) is None


def test_microbatches_weigh_by_their_tokens_where_every_count_is_known() -> None:
    torch.testing.assert_close(shares([3, 1], torch.device("cpu")), torch.tensor([0.75, 0.25]))
    torch.testing.assert_close(shares([torch.tensor(3), None], torch.device("cpu")), torch.tensor([0.5, 0.5]))
    torch.testing.assert_close(shares([0, 0], torch.device("cpu")), torch.tensor([0.5, 0.5]))
