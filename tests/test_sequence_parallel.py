"""Sequence parallelism is really on: between blocks each tensor-parallel rank holds its share of the sequence, and
tensor parallelism communicates what Megatron's layout needs, counted with torch's CommDebugMode, and holds what it
needs: the token embedding's gradient by vocabulary rows."""

from __future__ import annotations

import copy
from collections import Counter
from functools import cache

import pytest
import torch
import torch.distributed as dist
import transformers
from lightning.pytorch import Callback
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.debug import CommDebugMode

from lightdist.models import Llama

import training
import zoo
from multirank import run_ranks, split_over_two_ranks
from training import Case

pytestmark = pytest.mark.multirank


class _RecordLayouts(Callback):
    """The placements and per-rank shape of what the first norm receives and what the LM head returns."""

    def __init__(self) -> None:
        self.norm_inputs: list[tuple] = []
        self.logits: list[tuple] = []

    def on_fit_start(self, trainer, pl_module) -> None:
        norm = pl_module.model.layers[0].input_layernorm
        norm.register_forward_hook(lambda module, args, output: self.norm_inputs.append(_layout(args[0])))
        pl_module.model.lm_head.register_forward_hook(lambda module, args, output: self.logits.append(_layout(output)))


def _layout(x: torch.Tensor) -> tuple:
    return (tuple(x.placements), tuple(x.to_local().shape)) if isinstance(x, DTensor) else ("local", tuple(x.shape))


def layouts(strategies: list[dict]) -> list[dict[str, set[tuple]]]:
    """For each strategy, one step's layouts; all in one group of processes, so the start-up cost is paid once."""
    seen = []
    for strategy in strategies:
        probe = _RecordLayouts()
        case = Case(strategy=dict(tensor_parallel_size=2, **strategy), steps=1, seq_len=32)
        training.train(case, devices=2, callbacks=[probe])
        seen.append({"norm_inputs": set(probe.norm_inputs), "logits": set(probe.logits)})
    return seen


@cache
def layouts_under() -> dict[str, dict[str, set[tuple]]]:
    """The layouts of tp=2 by default (sequence parallel), without sequence parallelism, and with loss parallelism."""
    strategies = {
        "default": {},
        "no_sequence_parallel": dict(sequence_parallel=False),
        "loss_parallel": dict(loss_parallel=True),
    }
    seen, _ = run_ranks(2, layouts, list(strategies.values()))
    return dict(zip(strategies, seen, strict=True))


def test_norms_see_half_the_sequence_with_sequence_parallel() -> None:
    with_sp, without_sp = layouts_under()["default"], layouts_under()["no_sequence_parallel"]
    assert with_sp["norm_inputs"] == {((Shard(dim=1),), (4, 16, 64))}  # batch 4, 32 tokens over 2 ranks, width 64
    assert without_sp["norm_inputs"] == {((Replicate(),), (4, 32, 64))}  # every rank, the whole sequence


def test_loss_parallel_never_gathers_the_logits() -> None:
    gathered, split = layouts_under()["default"], layouts_under()["loss_parallel"]
    assert gathered["logits"] == {("local", (4, 32, 64))}  # the whole vocabulary of 64 on every rank
    assert split["logits"] == {((Shard(dim=2),), (4, 32, 32))}  # half of it: the loss is computed from that


class _FlatBlock(nn.Module):
    """Projections straight in the block, with no attention or MLP submodule to gather the sequence for."""

    def __init__(self) -> None:
        super().__init__()
        self.q, self.k, self.v, self.o = (nn.Linear(8, 8) for _ in range(4))


def split_flat_model() -> None:
    model = nn.Module()
    model.layers = nn.ModuleList(_FlatBlock() for _ in range(2))
    with split_over_two_ranks(model, sequence_parallel=True):
        pass


def test_sequence_parallel_needs_attention_and_mlp_submodules() -> None:
    with pytest.raises(RuntimeError, match=r"layers.0.q sits directly in its block. Pass sequence_parallel=False"):
        run_ranks(2, split_flat_model)


def count_collectives(n_layers: int, sequence_parallel: bool) -> tuple[Counter, Counter]:
    """Collectives of one forward and one backward of the tiny Llama split over 2 ranks (names without namespace)."""
    torch.manual_seed(0)
    with split_over_two_ranks(
        Llama("tiny", config={"n_layers": n_layers}), sequence_parallel=sequence_parallel
    ) as model:
        batch = torch.randint(0, 64, (4, 33))
        with CommDebugMode() as forward:
            loss = model.loss(batch)
        with CommDebugMode() as backward:
            loss.backward()
    return tuple(
        Counter({str(op).split(".")[-1]: n for op, n in mode.get_comm_counts().items()}) for mode in (forward, backward)
    )


def counted_in_one_group(models: list[tuple[int, bool]]) -> list[tuple[Counter, Counter]]:
    """``count_collectives`` of each (n_layers, sequence_parallel), in one process group that each split joins."""
    dist.init_process_group("gloo")
    try:
        return [count_collectives(n_layers, sequence_parallel) for n_layers, sequence_parallel in models]
    finally:
        dist.destroy_process_group()


@cache
def per_block() -> dict[bool, tuple[Counter, Counter]]:
    """What two more blocks cost, with and without sequence parallelism, halved: the embedding's and head's
    collectives cancel out."""
    counts, _ = run_ranks(2, counted_in_one_group, [(4, True), (2, True), (4, False), (2, False)])
    return {
        True: _two_more_blocks_halved(*counts[:2]),
        False: _two_more_blocks_halved(*counts[2:]),
    }


def _two_more_blocks_halved(four: tuple[Counter, Counter], two: tuple[Counter, Counter]) -> tuple[Counter, Counter]:
    return tuple(_halved(with_four - with_two) for with_four, with_two in zip(four, two, strict=True))


def _halved(counts: Counter) -> Counter:
    return Counter({op: n // 2 for op, n in counts.items()})


def test_sequence_parallel_communicates_as_megatron_does() -> None:
    # Per block and step: attention and MLP each all-gather the sequence in and reduce-scatter it out, forward and
    # backward; together the volume of 4 all-reduces of batch x sequence x hidden.
    forward, backward = per_block()[True]
    assert forward == Counter(all_gather_into_tensor=2, reduce_scatter_tensor=2)
    assert backward == Counter(all_gather_into_tensor=2, reduce_scatter_tensor=2)


def test_tensor_parallel_without_sequence_parallel_all_reduces_twice_per_block_forward() -> None:
    forward, backward = per_block()[False]
    assert forward == Counter(all_reduce=2)
    # Each column-parallel projection (q, k, v, gate, up) all-reduces its own input gradient: 5, where Megatron
    # needs 2. Sequence parallelism (the default) does not pay this.
    assert backward == Counter(all_reduce=5)


def embedding_gradient_on_each_rank() -> tuple[tuple, tuple, float, float]:
    """A Hugging Face Gemma 3 (its embedding a subclass that scales the lookup, padding id 0, not tied to the head),
    split over 2 ranks with sequence parallelism, and one backward of its own loss on a batch with padding: the token
    embedding's gradient as this rank holds it (placements, shape), how far it is from the rows of the one-process
    gradient it stands for, and the padding row's largest entry."""
    torch.manual_seed(0)
    config = transformers.AutoConfig.for_model(
        model_type="gemma3_text",
        num_key_value_heads=2,
        head_dim=16,
        pad_token_id=0,
        tie_word_embeddings=False,
        **zoo.HF_TINY,
    )
    whole = transformers.AutoModelForCausalLM.from_config(config)
    split = copy.deepcopy(whole)
    batch = torch.randint(0, 64, (4, 32))
    batch[:, -6:] = 0
    whole(input_ids=batch, labels=batch).loss.backward()
    with split_over_two_ranks(split, sequence_parallel=True, layouts={"self_attn": "global"}) as model:  # its q_norm
        model(input_ids=batch, labels=batch).loss.backward()
        grad = model.get_input_embeddings().weight.grad
        own_rows = whole.get_input_embeddings().weight.grad.chunk(2)[dist.get_rank()]
        local = grad.to_local()
        return (
            tuple(grad.placements),
            tuple(local.shape),
            (local - own_rows).abs().max().item(),
            local[0].abs().max().item(),
        )


def test_each_rank_computes_and_holds_the_embeddings_gradient_for_its_own_vocabulary_rows() -> None:
    # As Megatron's VocabParallelEmbedding: not the whole table's gradient on every rank, reduced across them.
    first, second = run_ranks(2, embedding_gradient_on_each_rank)
    for placements, shape, off_by, _ in (first, second):
        assert (placements, shape) == ((Shard(0),), (32, 64))  # half the vocabulary of 64, the whole width
        assert off_by < 1e-6
    assert first[3] == 0  # the padding row, on the first rank, learns nothing
