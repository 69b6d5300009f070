"""Packed documents: with ``document_end_token``, each token attends within its own document, in the model's own code,
and a window of packed documents trains as the documents would alone.

The windows are the arithmetic corpus's: sums of about ten tokens, each ended by a newline, so a window of 32 tokens
packs three or four documents and the end of another. The models are third-party code as users write it: nanoGPT
(learned positions, ``wpe(arange(t))``; or minGPT's table sliced, ``pos_emb[:, :t, :]``), LitGPT (rotary,
grouped-query attention), and Hugging Face Llama, Qwen2 and GPT-2 (learned positions, Conv1D), each with the step
that trains it in ``zoo``.
"""

from __future__ import annotations

import contextlib
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor

from lightdist.models import TokenDataModule
from lightdist.models.data import ARITHMETIC_ALPHABET, arithmetic_corpus
from lightdist.parallel.compiled_blocks import compile_block
from lightdist.parallel.document_attention import attention_per_document, compiled_attention_per_document
from lightdist.parallel.documents import (
    DocumentMasks,
    attention_within_documents,
    check_end_token,
    document_ids,
    document_positions,
)
from lightdist.parallel.kv_cache import without_kv_cache_in_training
from lightdist.parallel.structure import find_repeated_blocks
from lightdist.plugins import ParallelStrategy

from multirank import run_ranks
from training import MODELS, WEIGHT_ATOL, Case, References, merge_stages, prepared_arithmetic, train_cases

pytestmark = pytest.mark.multirank

NEWLINE = ARITHMETIC_ALPHABET.index("\n")  # where each sum, a document here, ends
FAMILIES = [
    "zoo_nanogpt",
    "zoo_nanogpt_sliced_positions",  # minGPT's table of positions, sliced: self.pos_emb[:, :t, :]
    "zoo_nanogpt_table_positions",  # a (positions, width) table's first rows, added by broadcasting: self.pos_emb[:t]
    "zoo_nanogpt_sinusoidal_positions",  # PyTorch tutorial's fixed sinusoids, a buffer: x + self.pe[:t], sequence-first
    "zoo_litgpt",
    "zoo_hf_llama_labels",
    "zoo_hf_qwen2_logits",
    "zoo_hf_gpt2_labels",
]


def windows(rows: int = 2, length: int = 33, seed: int = 0) -> Tensor:
    return torch.from_numpy(arithmetic_corpus(rows * length, seed=seed).astype("int64")).view(rows, length)


def documents_of(window: Tensor) -> list[Tensor]:
    """A window cut into the pieces each document trains on alone: its tokens, and the token its last one predicts
    (the next document's first, as in the packed window)."""
    starts = [0] + [int(end) + 1 for end in (window[:-2] == NEWLINE).nonzero().flatten()]
    return [window[start : stop + 1] for start, stop in zip(starts, [*starts[1:], len(window) - 1], strict=True)]


def documents_alone(window: Tensor) -> list[Tensor]:
    """A window cut into its documents, each ended by its end token: what each trains on alone once the end tokens'
    predictions are left out of the loss (the window's last, unended, runs to the window's end)."""
    starts = [int(end) + 1 for end in (window[:-1] == NEWLINE).nonzero().flatten()]
    return [piece for piece in window.tensor_split(starts) if len(piece) > 1]


def step_loss(module, batch: Tensor) -> Tensor:
    module.log = lambda *args, **kwargs: None
    return module.training_step(batch, 0)


def test_document_ids_and_positions_restart_after_each_end_token() -> None:
    tokens = torch.tensor([[5, 12, 7, 8, 12, 12, 3], [1, 2, 3, 4, 5, 6, 7]])
    ids = document_ids(tokens, end_token=12)
    assert ids.tolist() == [[0, 0, 1, 1, 1, 2, 3], [0, 0, 0, 0, 0, 0, 0]]
    assert document_positions(ids).tolist() == [[0, 1, 0, 1, 2, 0, 0], [0, 1, 2, 3, 4, 5, 6]]


def test_attention_per_document_is_the_block_causal_mask_without_it() -> None:
    """SDPA's causal kernel on each document's slice computes what the dense block-causal mask does, forward and
    backward, with grouped-query heads and a scale of the model's own."""
    torch.manual_seed(0)
    query = torch.randn(2, 8, 64, 16, requires_grad=True)
    key, value = (torch.randn(2, 2, 64, 16, requires_grad=True) for _ in range(2))
    ids = document_ids(torch.tensor([[1] * 9 + [0] + [1] * 30 + [0] + [1] * 23, [1] * 64]), end_token=0)
    causal = torch.ones(64, 64, dtype=torch.bool).tril()
    mask = ((ids[:, :, None] == ids[:, None, :]) & causal)[:, None]
    options = dict(scale=0.3, enable_gqa=True)
    sliced = attention_per_document(query, key, value, [[10, 31, 23], [64]], **options)
    dense = F.scaled_dot_product_attention(query, key, value, mask, **options)
    torch.testing.assert_close(sliced, dense, rtol=1e-6, atol=1e-6)
    gradients = [torch.autograd.grad(out.square().sum(), (query, key, value)) for out in (sliced, dense)]
    for sliced_gradient, dense_gradient in zip(*gradients, strict=True):
        torch.testing.assert_close(sliced_gradient, dense_gradient, rtol=1e-5, atol=1e-5)
    # a chunk of queries, positions 20 to 45 (context parallelism's ring), over the keys before its last: the second
    # document begun before the chunk attends over its keys from its beginning
    keys, values = key[:, :, :45], value[:, :, :45]
    lengths = [[10, 31, 23], [64]]
    chunk = attention_per_document(query[:, :, 20:45], keys, values, lengths, torch.arange(20, 45), **options)
    torch.testing.assert_close(chunk, dense[:, :, 20:45], rtol=1e-6, atol=1e-6)
    # a rank's chunks of queries (positions 8 to 16 and 40 to 56) over the whole keys, as the ring's rank holds them
    # where the documents dealt them, and as a compiled block's one op over the keys' document ids and the positions
    positions = torch.cat([torch.arange(8, 16), torch.arange(40, 56)])
    chunks = attention_per_document(query[:, :, positions], key, value, lengths, positions, **options)
    torch.testing.assert_close(chunks, dense[:, :, positions], rtol=1e-6, atol=1e-6)
    op = compiled_attention_per_document(query[:, :, positions], key, value, ids, positions, **options)
    torch.testing.assert_close(op, chunks, rtol=0, atol=0)
    dense = F.scaled_dot_product_attention(query, key, value, mask, **options)[:, :, positions]
    pulled = [torch.autograd.grad(out.square().sum(), (query, key, value)) for out in (op, dense)]
    for op_gradient, dense_gradient in zip(*pulled, strict=True):
        torch.testing.assert_close(op_gradient, dense_gradient, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("family", FAMILIES)
def test_a_packed_window_trains_as_its_documents_alone(family: str) -> None:
    """The step's loss and gradients on packed windows with document masks are those of each document run alone
    (its own step, on its own tokens), weighed by its targets and summed; without masks they are not."""
    torch.manual_seed(0)
    module = MODELS[family](learning_rate=1e-3, warmup_steps=1).eval()
    batch = windows()
    targets = batch.size(1) - 1

    def gradients_of(loss: Tensor) -> list[Tensor]:
        module.zero_grad(set_to_none=True)
        loss.backward()
        return [parameter.grad.clone() for parameter in module.parameters()]

    with attention_within_documents(module, batch, NEWLINE) as documents:
        packed = step_loss(module, batch)
    packed_gradients = gradients_of(packed)
    assert documents.attended
    alone = sum(
        step_loss(module, piece[None]) * (len(piece) - 1) / (targets * len(batch))
        for window in batch
        for piece in documents_of(window)
    )
    torch.testing.assert_close(packed, alone, rtol=1e-5, atol=0)
    for packed_gradient, alone_gradient in zip(packed_gradients, gradients_of(alone), strict=True):
        torch.testing.assert_close(packed_gradient, alone_gradient, rtol=1e-4, atol=1e-6)
    assert (step_loss(module, batch) - alone).abs() > 1e-3  # attention across documents trains otherwise


@pytest.mark.parametrize("family", ["zoo_nanogpt", "zoo_hf_llama_labels", "zoo_hf_qwen2_logits"])
def test_without_the_end_tokens_predictions_a_packed_window_trains_as_its_documents_alone(family: str) -> None:
    """With ``mask_end_loss`` the loss leaves out what each end token predicts (Megatron's ``--eod-mask-loss``): a
    packed window's loss and gradients are those of its documents alone, each on its own tokens only, weighed by
    their targets and summed; the count of targets kept is what batches weigh by."""
    torch.manual_seed(0)
    module = MODELS[family](learning_rate=1e-3, warmup_steps=1).eval()
    batch = windows()
    with attention_within_documents(module, batch, NEWLINE, mask_end_loss=True) as documents:
        packed = step_loss(module, batch)
    packed_gradients = torch.autograd.grad(packed, list(module.parameters()))
    pieces = [piece for window in batch for piece in documents_alone(window)]
    kept = sum(len(piece) - 1 for piece in pieces)
    assert documents.loss_counts == [kept] and kept < batch.numel() - len(batch)
    alone = sum(step_loss(module, piece[None]) * (len(piece) - 1) / kept for piece in pieces)
    torch.testing.assert_close(packed, alone, rtol=1e-5, atol=0)
    for packed_gradient, alone_gradient in zip(
        packed_gradients, torch.autograd.grad(alone, list(module.parameters())), strict=True
    ):
        torch.testing.assert_close(packed_gradient, alone_gradient, rtol=1e-4, atol=1e-6)


def test_a_loss_whose_end_predictions_cannot_be_told_is_refused() -> None:
    """A mean other than over the targets, targets that are not the inputs' next tokens, and a training step with no
    cross-entropy over them: each refused, naming the way out."""
    batch = windows()
    logits = torch.randn(2, 32, len(ARITHMETIC_ALPHABET))
    documents = DocumentMasks(NEWLINE, mask_end_loss=True)
    documents.see(batch)
    with documents.active():
        with pytest.raises(ValueError, match="another mean than one over its targets"):
            F.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten(), reduction="sum")
        with pytest.raises(ValueError, match="does not take its inputs' next tokens"):
            F.cross_entropy(logits.flatten(0, 1), batch[:, :-1].flatten())
        with pytest.raises(ValueError, match=r"training_step computed 0 of them, not one"):
            documents.loss_tokens("training_step")
        assert documents.loss_tokens("validation_step") is None  # a validation step may compute no loss
        F.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten())
        F.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten())
        with pytest.raises(ValueError, match=r"validation_step computed 2 of them, not one"):
            documents.loss_tokens("validation_step")


class PositionTables(torch.nn.Module):
    """Tables of positions as model code keeps them: learned (parameters) and fixed (buffers), of (positions, width),
    (1, positions, width) and sequence-first (positions, 1, width)."""

    def __init__(self) -> None:
        super().__init__()
        self.table = torch.nn.Parameter(torch.randn(64, 8))
        self.batched = torch.nn.Parameter(self.table[None].detach().clone())
        self.sequence_first = torch.nn.Parameter(self.table[:, None].detach().clone())
        self.register_buffer("pe", self.table.detach().clone())
        self.register_buffer("pe_batched", self.pe[None].clone())
        self.register_buffer("pe_sequence_first", self.pe[:, None].clone())
        self.register_buffer("cos", self.pe.cos())  # a rotary table: its rows keep their shape


# Each way model code reads a table's first t rows into what it adds to the embeddings, (batch, t, width) or, for a
# sequence-first table, (t, batch, width).
READS = {
    "learned[:t]": lambda m, t: m.table[:t],
    "learned[:t, :]": lambda m, t: m.table[:t, :],
    "learned[None, :t]": lambda m, t: m.table[None, :t],
    "learned[arange(t)]": lambda m, t: m.table[torch.arange(t)],
    "learned[arange(t)[None]]": lambda m, t: m.table[torch.arange(t)[None]],
    "learned.narrow": lambda m, t: m.table.narrow(0, 0, t),
    "torch.narrow(learned)": lambda m, t: torch.narrow(m.table, 0, 0, t),
    "learned.index_select": lambda m, t: m.table.index_select(0, torch.arange(t)),
    "batched[:, :t, :]": lambda m, t: m.batched[:, :t, :],
    "batched[0, :t]": lambda m, t: m.batched[0, :t],
    "batched.narrow": lambda m, t: m.batched.narrow(1, 0, t),
    "sequence_first[:t]": lambda m, t: m.sequence_first[:t],
    "buffer[:t]": lambda m, t: m.pe[:t],
    "buffer[None, :t].to(float32)": lambda m, t: m.pe[None, :t].to(torch.float32),
    "batched buffer[:, :t].detach()": lambda m, t: m.pe_batched[:, :t].detach(),
    "sequence-first buffer[:t]": lambda m, t: m.pe_sequence_first[:t],
}


@pytest.mark.parametrize("read", READS)
def test_each_read_of_a_position_tables_first_rows_reads_the_positions_within_documents(read: str) -> None:
    """Added to the embeddings, a table's first rows are those of each token's position within its document, however
    the model reads them; a rotary table's rows, read alike but not added, keep their shape and the window's rows."""
    tables, batch = PositionTables(), windows()
    length = batch.size(1) - 1
    within = document_positions(document_ids(batch[:, :length], NEWLINE))
    assert within.tolist() != [list(range(length))] * len(batch)  # the windows pack several documents
    sequence_first = "sequence" in read
    embeddings = torch.zeros(length, 2, 8) if sequence_first else torch.zeros(2, length, 8)
    documents = DocumentMasks(NEWLINE, model=tables)
    documents.see(batch)
    with documents.active():
        added = embeddings + READS[read](tables, length)
        rotary = tables.cos[:length]
    expected = tables.pe[within]
    torch.testing.assert_close(added, expected.transpose(0, 1) if sequence_first else expected, rtol=0, atol=0)
    torch.testing.assert_close(rotary, tables.cos[:length], rtol=0, atol=0)


def add_in_place(embeddings: Tensor, rows: Tensor) -> Tensor:
    embeddings += rows
    return embeddings


@pytest.mark.parametrize(
    "add",
    [add_in_place, torch.add, Tensor.add, lambda e, r: e.add(other=r), lambda e, r: r + e],
    ids=["+=", "torch.add", "Tensor.add", "add(other=)", "rows + embeddings"],
)
def test_a_buffers_rows_added_any_way_are_those_within_documents(add) -> None:
    tables, batch = PositionTables(), windows()
    documents = DocumentMasks(NEWLINE, model=tables)
    documents.see(batch)
    with documents.active():
        added = add(torch.zeros(2, 32, 8), tables.pe[:32])
    torch.testing.assert_close(added, tables.pe[document_positions(document_ids(batch[:, :32], NEWLINE))])


@pytest.mark.parametrize("family", ["zoo_nanogpt", "zoo_hf_llama_labels"])
def test_no_token_sees_another_document(family: str) -> None:
    """Every token of the first document changed: the logits of every later document stay as they were."""
    torch.manual_seed(0)
    model = MODELS[family](learning_rate=1e-3, warmup_steps=1).model.eval()
    batch = windows(rows=1)[:, :-1]
    first_end = int((batch[0] == NEWLINE).nonzero()[0])
    changed = batch.clone()
    changed[0, :first_end] = (changed[0, :first_end] + 1) % NEWLINE

    def logits(tokens: Tensor, *, masked: bool) -> Tensor:
        with attention_within_documents(model, tokens, NEWLINE) if masked else contextlib.nullcontext():
            output = model(tokens, tokens) if family == "zoo_nanogpt" else model(tokens)
        return (output[0] if isinstance(output, tuple) else output.logits)[0, first_end + 1 :]

    torch.testing.assert_close(logits(changed, masked=True), logits(batch, masked=True), rtol=0, atol=1e-6)
    assert (logits(changed, masked=False) - logits(batch, masked=False)).abs().max() > 1e-3


def compile_blocks(module: torch.nn.Module) -> list[torch.fx.GraphModule]:
    """Compile each block as ``compile=True`` does, with a backend that runs and keeps each graph dynamo hands it (in
    place of inductor, whose builds the runs on two ranks below pay)."""
    graphs = []

    def keep(graph: torch.fx.GraphModule, inputs: list) -> object:
        graphs.append(graph)
        return graph.forward

    for name in find_repeated_blocks(module):
        without_kv_cache_in_training(module.get_submodule(name))
        compile_block(module.get_submodule(name), backend=keep)
    return graphs


@pytest.mark.parametrize("family", ["zoo_nanogpt", "zoo_hf_llama_labels"])
def test_compiled_blocks_attend_within_documents_in_one_graph_for_every_batch(family: str) -> None:
    """Each block compiled, as ``compile=True`` does: the step's loss and gradients are the eager step's, and one graph
    serves every block and a batch whose documents have other lengths."""
    torch.manual_seed(0)
    module = MODELS[family](learning_rate=1e-3, warmup_steps=1).eval()

    def step(batch: Tensor) -> tuple[Tensor, list[Tensor]]:
        module.zero_grad(set_to_none=True)
        with attention_within_documents(module, batch, NEWLINE):
            loss = step_loss(module, batch)
            loss.backward()
        return loss.detach(), [parameter.grad.clone() for parameter in module.parameters()]

    eager_loss, eager_gradients = step(windows())
    graphs = compile_blocks(module)
    compiled_loss, compiled_gradients = step(windows())
    torch.testing.assert_close(compiled_loss, eager_loss, rtol=1e-6, atol=0)
    for compiled_gradient, eager_gradient in zip(compiled_gradients, eager_gradients, strict=True):
        torch.testing.assert_close(compiled_gradient, eager_gradient, rtol=1e-5, atol=1e-7)
    other = windows(seed=1)
    assert document_ids(other, NEWLINE).tolist() != document_ids(windows(), NEWLINE).tolist()
    step(other)
    assert len(graphs) == 1


def test_compiled_blocks_whose_attention_drops_out_attend_within_documents_between_their_graphs() -> None:
    """Dropout in attention: the one op's backward would draw other masks as it runs the forward again, so the
    attention runs eagerly between the block's graphs, with the step's own draws; no batch compiles anew."""
    module = MODELS["zoo_nanogpt"](learning_rate=1e-3, warmup_steps=1, dropout=0.1).train()

    def step_loss_within_documents(batch: Tensor) -> Tensor:
        torch.manual_seed(0)
        with attention_within_documents(module, batch, NEWLINE):
            return step_loss(module, batch)

    eager = step_loss_within_documents(windows())
    graphs = compile_blocks(module)
    torch.testing.assert_close(step_loss_within_documents(windows()), eager, rtol=1e-6, atol=0)
    compiled = len(graphs)
    step_loss_within_documents(windows(seed=1))
    assert compiled > 0 and len(graphs) == compiled


def test_attention_the_masks_cannot_reach_is_refused_with_the_way_out() -> None:
    batch = windows()
    lecture = MODELS["zoo_nanogpt_slow_attention"](learning_rate=1e-3, warmup_steps=1)  # q @ k.T, tril, softmax
    refused = pytest.raises(ValueError, match=r"called no torch\.nn\.functional\.scaled_dot_product_attention")
    with refused, attention_within_documents(lecture, batch, NEWLINE):
        step_loss(lecture, batch)
    hugging_face = MODELS["zoo_hf_llama_labels"](learning_rate=1e-3, warmup_steps=1).model
    padding = torch.ones_like(batch)
    padding[0, -4:] = 0  # a collator's padding: Hugging Face builds a mask of its own
    refused = pytest.raises(ValueError, match="passes a mask of its own over the batch's sequences")
    with refused, attention_within_documents(hugging_face, batch, NEWLINE):
        hugging_face(input_ids=batch, attention_mask=padding)
    no_tokens = pytest.raises(ValueError, match="holds no token ids")
    with no_tokens, attention_within_documents(hugging_face, torch.randn(2, 8), NEWLINE):
        pass


def test_a_models_own_activation_checkpointing_is_refused_for_the_strategys() -> None:
    """torch leaves the masks' mode while backward runs: a block the model recomputes itself would attend across
    documents. lightdist's own activation checkpointing recomputes within them (the runs on two ranks below)."""
    module = MODELS["zoo_hf_llama_labels"](learning_rate=1e-3, warmup_steps=1)
    module.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    batch = windows()
    with attention_within_documents(module, batch, NEWLINE):
        loss = step_loss(module.train(), batch)
        with pytest.raises(ValueError, match=r"activation_checkpointing='full' or 'selective'"):
            loss.backward()


def test_an_end_token_other_than_the_corpus_one_is_refused(tmp_path: Path) -> None:
    """A prepared corpus records its tokenizer's end-of-sequence id: any other would be in no window, and attention
    would cross documents as without masks."""
    data = TokenDataModule(data_path=prepared_arithmetic(tmp_path, tokens=4096), seq_len=32, batch_size=2)
    data.setup("fit")
    assert data.eos_token_id == len(ARITHMETIC_ALPHABET)  # <|endoftext|>, written in place of each newline
    check_end_token(data.eos_token_id, data)
    with pytest.raises(ValueError, match=f"Set document_end_token={data.eos_token_id}"):
        check_end_token(NEWLINE, data)


@pytest.mark.parametrize(
    ("options", "refusal"),
    [
        (dict(document_end_token=-1), "must be a token id"),
        (dict(document_end_token=NEWLINE, pipeline_parallel_size=2, pipeline_tracer=True), "pipeline_tracer=True"),
        (dict(mask_document_end_loss=True), "no document_end_token is set"),
    ],
)
def test_document_options_that_cannot_work_are_refused_as_the_strategy_is_built(options: dict, refusal: str) -> None:
    with pytest.raises(ValueError, match=refusal):
        ParallelStrategy(**options)


# Each run on two ranks, with document masks, and the same run on one process with them. Under a pipeline each
# microbatch's stages attend within its own documents; blocks recomputed in backward attend as their forward did.
PP2 = dict(pipeline_parallel_size=2)
CP2_RING = dict(context_parallel_size=2, context_parallel_method="ring")
CP2_ALL_TO_ALL = dict(context_parallel_size=2, context_parallel_method="all_to_all")


def packed(model: str, strategy: dict, batch_size: int = 2, seq_len: int = 32, validate: bool = False) -> Case:
    return Case(strategy, model, batch_size=batch_size, seq_len=seq_len, validate=validate, document_end_token=NEWLINE)


CASES = {
    "llama_tp2_validating": packed("llama", dict(tensor_parallel_size=2), validate=True),
    "zoo_nanogpt_tp2": packed("zoo_nanogpt", dict(tensor_parallel_size=2)),
    "zoo_hf_qwen2_logits_tp2": packed("zoo_hf_qwen2_logits", dict(tensor_parallel_size=2)),
    # each block compiled (tests/test_equivalence.py's compiled tp2 case): its attention within documents one op in the
    # block's graph, on tensor parallelism's heads
    "zoo_hf_llama_labels_tp2_compiled": packed("zoo_hf_llama_labels", dict(tensor_parallel_size=2, compile=True)),
    "zoo_litgpt_zero3_dp2_full_checkpointing": packed(
        "zoo_litgpt", dict(zero_stage=3, activation_checkpointing="full")
    ),
    "zoo_hf_gpt2_labels_zero2_dp2": packed("zoo_hf_gpt2_labels", dict(zero_stage=2)),
    "zoo_nanogpt_pp2": packed("zoo_nanogpt", PP2),
    "zoo_hf_llama_labels_pp2_full_checkpointing": packed(
        "zoo_hf_llama_labels", dict(PP2, activation_checkpointing="full")
    ),
    "zoo_hf_gpt2_labels_pp2_zero_bubble_4_microbatches": packed(
        "zoo_hf_gpt2_labels", dict(PP2, pipeline_schedule="zero_bubble", microbatches=4), batch_size=4
    ),
    # Each sequence split over the 2 ranks: the ring masks each chunk of queries by its documents, the all-to-all's
    # whole sequences are masked as one process's; learned positions are looked up at a rank's share's.
    "zoo_nanogpt_cp2_ring": packed("zoo_nanogpt", CP2_RING),
    "zoo_nanogpt_sliced_positions_cp2_ring": packed("zoo_nanogpt_sliced_positions", CP2_RING),
    # minGPT's table, a parameter of the model itself, replicated over the tensor-parallel ranks and read per document
    "zoo_nanogpt_sliced_positions_tp2": packed("zoo_nanogpt_sliced_positions", dict(tensor_parallel_size=2)),
    "zoo_nanogpt_table_positions_zero3_dp2": packed("zoo_nanogpt_table_positions", dict(zero_stage=3)),
    # the tutorial's sinusoids, a buffer: added on the first stage (the whole copy the first step checks against holds
    # a buffer of its own), a rank's share of its rows under context parallelism, and replicated over the
    # tensor-parallel ranks, added to the sequence-parallel stream
    "zoo_nanogpt_sinusoidal_positions_pp2": packed("zoo_nanogpt_sinusoidal_positions", PP2),
    "zoo_nanogpt_sinusoidal_positions_tp2": packed("zoo_nanogpt_sinusoidal_positions", dict(tensor_parallel_size=2)),
    "zoo_nanogpt_sinusoidal_positions_cp2_ring": packed("zoo_nanogpt_sinusoidal_positions", CP2_RING),
    "llama_cp2_ring_full_checkpointing": packed("llama", dict(CP2_RING, activation_checkpointing="full")),
    "zoo_litgpt_cp2_all_to_all": packed("zoo_litgpt", CP2_ALL_TO_ALL),
    # Hugging Face shifts its labels itself: windows of 32 tokens, which the model takes whole
    "zoo_hf_gpt2_labels_cp2_all_to_all": packed("zoo_hf_gpt2_labels", CP2_ALL_TO_ALL, seq_len=31),
    # experts dealt out over the 2 data-parallel ranks: each token routed from its own document's attention
    "moe_ep2_zero3": packed("moe_lm_only", dict(expert_parallel_size=2)),
    # What each end token predicts left out of the loss: the ranks' batches, and an accumulation's, keep different
    # numbers of targets, and weigh by them; under tensor parallelism, a loss over logits split by vocabulary.
    "zoo_nanogpt_zero3_dp2_end_loss_masked_accumulate": Case(
        dict(zero_stage=3),
        "zoo_nanogpt",
        batch_size=2,
        accumulate_grad_batches=2,
        document_end_token=NEWLINE,
        mask_document_end_loss=True,
    ),
    # (x, y) pairs as a TensorDataset yields them: the documents read from the inputs
    "zoo_nanogpt_pairs_zero2_dp2_end_loss_masked": Case(
        dict(zero_stage=2),
        "zoo_nanogpt_pairs",
        batch_size=2,
        data="pairs",
        document_end_token=NEWLINE,
        mask_document_end_loss=True,
    ),
    # Under a pipeline each microbatch weighs by the targets it keeps, counted before the schedule runs and checked
    # against its cross-entropy's own count: the reference Llama's in its step, Hugging Face's from labels=.
    "llama_pp2_4_microbatches_end_loss_masked": Case(
        dict(PP2, microbatches=4),
        "llama",
        batch_size=4,
        document_end_token=NEWLINE,
        mask_document_end_loss=True,
    ),
    # (x, y) pairs: a target for each input, the last beyond the inputs
    "zoo_nanogpt_pairs_pp2_end_loss_masked": Case(
        PP2,
        "zoo_nanogpt_pairs",
        batch_size=2,
        data="pairs",
        document_end_token=NEWLINE,
        mask_document_end_loss=True,
    ),
    "zoo_hf_llama_labels_pp2_end_loss_masked_accumulate": Case(
        PP2,
        "zoo_hf_llama_labels",
        batch_size=4,
        accumulate_grad_batches=2,
        document_end_token=NEWLINE,
        mask_document_end_loss=True,
    ),
    # Each sequence split over the 2 ranks: each rank's share of the targets, masked at the positions it holds, and
    # weighed by what it keeps
    "zoo_nanogpt_cp2_all_to_all_end_loss_masked": Case(
        CP2_ALL_TO_ALL, "zoo_nanogpt", batch_size=2, document_end_token=NEWLINE, mask_document_end_loss=True
    ),
    "zoo_hf_llama_labels_cp2_ring_end_loss_masked": Case(
        CP2_RING,
        "zoo_hf_llama_labels",
        batch_size=2,
        seq_len=31,
        document_end_token=NEWLINE,
        mask_document_end_loss=True,
    ),
    "zoo_hf_llama_labels_tp2_loss_parallel_end_loss_masked": Case(
        dict(tensor_parallel_size=2, loss_parallel=True),
        "zoo_hf_llama_labels",
        batch_size=2,
        document_end_token=NEWLINE,
        mask_document_end_loss=True,
    ),
}
WITHOUT_MASKS = Case(model="llama", batch_size=4)
# Blocks in an nn.Sequential: torch's tracer cuts the stages, into graphs of aten ops the masks cannot reach.
TRACED = Case(strategy=PP2, model="zoo_lecture_gpt", batch_size=2, document_end_token=NEWLINE)
# A step that leaves targets out itself (nanoGPT's ignore_index=-1): the microbatches' counts miss them
MISCOUNTED = Case(
    PP2, "zoo_nanogpt_ignoring_last_targets", batch_size=2, document_end_token=NEWLINE, mask_document_end_loss=True
)
REFERENCES = References([*(case.reference(world_size=2) for case in CASES.values()), WITHOUT_MASKS])


@pytest.fixture(scope="module")
def two_ranks() -> dict[str, object]:
    """Every case in one group of two ranks, the references beside it."""
    REFERENCES.start()
    results = merge_stages(run_ranks(2, train_cases, [*CASES.values(), TRACED, MISCOUNTED], 2, timeout=560))
    return dict(zip([*CASES, "traced", "miscounted"], results, strict=True))


@pytest.mark.parametrize("name", CASES)
def test_document_masks_on_two_ranks_train_as_one_process(two_ranks: dict, name: str) -> None:
    result, single = two_ranks[name], REFERENCES[CASES[name].reference(world_size=2)]
    assert not result.error and not single.error, result.error or single.error
    assert len(result.losses) == CASES[name].steps * CASES[name].accumulate_grad_batches
    torch.testing.assert_close(result.losses, single.losses, rtol=1e-5, atol=0)
    torch.testing.assert_close(result.grad_norms, single.grad_norms, rtol=1e-5, atol=0)
    assert result.validated == pytest.approx(single.validated, rel=1e-5, abs=0)
    assert result.params.keys() == single.params.keys()
    for parameter, value in single.params.items():
        torch.testing.assert_close(result.params[parameter], value, rtol=1e-5, atol=WEIGHT_ATOL, msg=parameter)


def test_stages_cut_by_the_tracer_are_refused_with_the_way_out(two_ranks: dict) -> None:
    assert "pipeline stages cut by torch's tracer" in two_ranks["traced"].error
    assert "Keep the blocks in an nn.ModuleList" in two_ranks["traced"].error


def test_a_pipeline_whose_targets_are_not_counted_as_its_loss_keeps_them_is_refused(two_ranks: dict) -> None:
    assert "mask_document_end_loss=True under a pipeline" in two_ranks["miscounted"].error
    assert "the targets to ignore -100 in the batch" in two_ranks["miscounted"].error


def test_the_masks_change_what_trains() -> None:
    masked, across = REFERENCES[CASES["llama_tp2_validating"].reference(world_size=2)], REFERENCES[WITHOUT_MASKS]
    assert masked.losses[0] != pytest.approx(across.losses[0], rel=1e-3)
