"""Real text to training: a corpus tokenized once by ``lightdist prepare`` and streamed by range from local disk, S3
and GCS. Every format is read into one stream, every bad input is named, a rank downloads its windows and not the
corpus, and a run stopped anywhere resumes on the next sample, on as many data-parallel ranks or on another number.

The corpus is real text that ships with Python (its standard library's docstrings) and the tokenizer a byte-level BPE
trained on it on the spot (lightdist/models/python_docs.py), so nothing is downloaded.
"""

from __future__ import annotations

import gzip
import json
import os
import re
import shutil
from collections import Counter
from dataclasses import replace
from functools import partial
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from fsspec import AbstractFileSystem
from lightning.pytorch import Callback
from lightning.pytorch.callbacks import ModelCheckpoint as LightningModelCheckpoint
from tokenizers import Tokenizer
from torch.utils.data import DistributedSampler
from torchdata.stateful_dataloader import StatefulDataLoader

from lightdist.cli import main
from lightdist.data.prepare import prepare
from lightdist.data.token_shards import TokenShards
from lightdist.models.data import ARITHMETIC_ALPHABET, TokenDataModule, TokenWindows, arithmetic_corpus
from lightdist.models.python_docs import train_tokenizer, write_corpus

from faulty_storage import FaultyStorage
from multirank import raised, run_each, run_ranks
from training import Case, StopAfter, keep_two_newest, train

MODULES = ("json", "csv", "pathlib", "string", "shutil", "uuid")  # about 60k tokens of docstrings


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> tuple[list[Path], Path]:
    """The docstrings of a few standard-library modules, one JSON-lines file each, and a 512-token BPE trained on
    them."""
    root = tmp_path_factory.mktemp("python_docs")
    files = write_corpus(root / "corpus", MODULES)
    return files, train_tokenizer(files, root / "tokenizer", vocab_size=512)


def texts_of(file: Path) -> list[str]:
    return [json.loads(line)["text"] for line in file.read_text().splitlines()]


def encoded(tokenizer: Path, documents: list[str]) -> list[int]:
    """What the stream must hold: each document's ids, then the end-of-sequence id."""
    rust = Tokenizer.from_file(str(tokenizer / "tokenizer.json"))
    eos = rust.token_to_id("<|endoftext|>")
    return [i for document in documents for i in (*rust.encode(document, add_special_tokens=False).ids, eos)]


def stream(url: str) -> list[int]:
    shards = TokenShards.open(url)
    (tokens,) = shards.read([(0, len(shards))])
    return tokens.tolist()


def test_every_format_becomes_one_stream_of_documents_each_ended_by_eos(
    corpus: tuple[list[Path], Path], tmp_path: Path
) -> None:
    """JSON lines (gzipped), a JSON array, Parquet, plain text and a ``datasets.save_to_disk`` folder, tokenized by
    two processes into small shards: one stream, in the inputs' order, with what was skipped counted."""
    files, tokenizer = corpus
    docs = [texts_of(file) for file in files]
    inputs = tmp_path / "inputs"
    inputs.mkdir()
    records = [{"text": text} for text in docs[0]] + [{"title": "no text"}, {"text": ""}]
    with gzip.open(inputs / "a.jsonl.gz", "wt") as file:
        file.writelines(json.dumps(record) + "\n" for record in records)
    (inputs / "b.json").write_text(json.dumps([{"text": text} for text in docs[1]]))
    pq.write_table(pa.table({"text": docs[2]}), inputs / "c.parquet")
    (inputs / "d.txt").write_text("\n\n".join(docs[3]))
    (inputs / "e.jsonl").write_text("")
    saved = tmp_path / "saved_dataset"  # the files datasets.save_to_disk writes: Arrow streams named in state.json
    saved.mkdir()
    for i, part in enumerate((docs[4], docs[5])):
        with pa.ipc.new_stream(saved / f"data-0000{i}-of-00002.arrow", pa.schema([("text", pa.string())])) as writer:
            writer.write_table(pa.table({"text": part}))
    state = {"_data_files": [{"filename": f"data-0000{i}-of-00002.arrow"} for i in range(2)]}
    (saved / "state.json").write_text(json.dumps(state))

    output = str(tmp_path / "tokens")
    index = prepare([str(inputs), str(saved)], str(tokenizer), output, processes=2, shard_tokens=4096)

    documents = [*docs[0], *docs[1], *docs[2], "\n\n".join(docs[3]), *docs[4], *docs[5]]
    assert stream(output) == encoded(tokenizer, documents)
    assert index["documents"] == len(documents)
    assert index["skipped"] == {"records without a text field 'text'": 1, "empty documents": 1}
    assert [Path(url).name for url in index["empty_files"]] == ["e.jsonl"]
    assert len(index["shards"]) > len(index["sources"])  # each source's shards roll over at about 4096 tokens
    assert prepare([str(inputs), str(saved)], str(tokenizer), output) == index  # done already: nothing redone


def test_the_command_prints_what_it_prepared_and_names_a_bad_input(
    corpus: tuple[list[Path], Path], tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    files, tokenizer = corpus
    output = tmp_path / "tokens"
    main(["prepare", str(files[0]), "--tokenizer", str(tokenizer), "--output", str(output), "--processes", "1"])
    documents = len(texts_of(files[0]))
    assert f"lightdist prepare: {documents:,} documents, " in capsys.readouterr().out
    with pytest.raises(SystemExit) as exit:
        main(["prepare", str(tmp_path / "none.jsonl"), "--tokenizer", str(tokenizer), "--output", str(output)])
    assert exit.value.code == 2
    assert "cannot read" in (err := capsys.readouterr().err) and "none.jsonl" in err and "Correct the URL" in err


def test_an_interrupted_prepare_keeps_the_files_it_finished(corpus: tuple[list[Path], Path], tmp_path: Path) -> None:
    files, tokenizer = corpus
    inputs = tmp_path / "inputs"
    inputs.mkdir()
    shutil.copy(files[0], inputs / "a.jsonl")
    (inputs / "b.jsonl").write_bytes(files[1].read_bytes() + b'{"text": "caf\xe9"}\n')  # Latin-1, not UTF-8
    output = tmp_path / "tokens"
    error = raised(partial(prepare, processes=1), [str(inputs)], str(tokenizer), str(output))
    assert re.search(r"b\.jsonl: bytes that are not UTF-8 after record \d+ .* Convert the file to UTF-8", error)
    assert not (output / "index.json").exists()  # never read as complete
    finished = (output / "00000-0000.bin").stat().st_mtime_ns

    shutil.copy(files[1], inputs / "b.jsonl")
    prepare([str(inputs)], str(tokenizer), str(output), processes=1)
    assert (output / "00000-0000.bin").stat().st_mtime_ns == finished  # kept, not tokenized again
    assert stream(str(output)) == encoded(tokenizer, texts_of(files[0]) + texts_of(files[1]))


def test_bad_corpora_are_named_with_their_fix(corpus: tuple[list[Path], Path], tmp_path: Path) -> None:
    _, tokenizer = corpus
    (tmp_path / "fields.jsonl").write_text('{"content": "a document", "id": 1}\n' * 3)
    (tmp_path / "broken.jsonl").write_text('{"text": "one"}\n{"text": "two"\n')
    (tmp_path / "notes.md").write_text("# a document")
    no_eos = tmp_path / "no_eos"
    rust = Tokenizer.from_file(str(tokenizer / "tokenizer.json"))
    rust.add_special_tokens(["<sep>"])
    json_tokenizer = json.loads(rust.to_str())
    json_tokenizer["added_tokens"] = [t for t in json_tokenizer["added_tokens"] if t["content"] != "<|endoftext|>"]
    json_tokenizer["model"]["vocab"].pop("<|endoftext|>")
    no_eos.mkdir()
    (no_eos / "tokenizer.json").write_text(json.dumps(json_tokenizer))

    def error(inputs: str, tokenizer_at: Path = tokenizer) -> str:
        return raised(prepare, [str(tmp_path / inputs)], str(tokenizer_at), str(tmp_path / "out" / inputs))

    assert "3 records without a text field 'text'" in error("fields.jsonl")
    assert "Their records have the fields content, id: name one with --text-field" in error("fields.jsonl")
    assert "broken.jsonl: record 2 is not JSON" in error("broken.jsonl")
    assert "notes.md: not a file lightdist prepare reads" in error("notes.md")
    assert "names no text files" in error("missing*.jsonl")
    assert "Name the token that ends documents with --eos-token" in error("fields.jsonl", no_eos)


def test_a_prepared_corpus_cut_short_or_made_by_another_tokenizer_is_refused(
    corpus: tuple[list[Path], Path], tmp_path: Path
) -> None:
    files, tokenizer = corpus
    output = tmp_path / "tokens"
    prepare([str(files[0]), str(files[1])], str(tokenizer), str(output), processes=1)
    other = train_tokenizer(files[2:], tmp_path / "other_tokenizer", vocab_size=300)

    data = TokenDataModule(data_path=str(output), tokenizer=str(other))
    assert "not with this run's" in raised(data.setup)
    assert "Prepare the corpus again with the run's tokenizer" in raised(data.setup)
    TokenDataModule(data_path=str(output), tokenizer=str(tokenizer)).setup()  # its own: accepted

    shard = output / "00001-0000.bin"
    shard.write_bytes(shard.read_bytes()[:-6])
    assert re.search(r"shard 00001-0000\.bin holds \d+ bytes, where its index says", raised(TokenShards.open, output))
    shard.unlink()
    assert "shard 00001-0000.bin is missing" in raised(TokenShards.open, str(output))


def test_a_vocabulary_larger_than_the_models_embedding_is_refused_before_the_first_step(
    corpus: tuple[list[Path], Path], tmp_path: Path
) -> None:
    files, tokenizer = corpus
    prepare([str(files[0])], str(tokenizer), str(tmp_path / "tokens"))
    case = Case(model="llama", data_path=str(tmp_path / "tokens"), steps=1)  # the tiny Llama: 64 rows
    assert re.search(r"holds token ids up to 511 .* embedding has 64 rows", raised(train, case))
    assert train(Case(model="llama_vocab512", data_path=str(tmp_path / "tokens"), steps=1)).losses


def test_the_arithmetic_corpus_is_true_sums_cut_to_the_length_asked_the_same_for_a_seed() -> None:
    text = "".join(ARITHMETIC_ALPHABET[i] for i in arithmetic_corpus(100_000, seed=3))
    assert len(text) == 100_000
    lines = text.split("\n")[:-1]  # the last line may be cut short
    assert all(
        int(sum_) == int(a) + int(b)
        for a, b, sum_ in (re.fullmatch(r"(\d+)\+(\d+)=(\d+)", line).groups() for line in lines)
    )
    assert len({line.split("+")[0] for line in lines}) > 900  # operands drawn over 0 to 999
    assert np.array_equal(arithmetic_corpus(50, seed=3), arithmetic_corpus(100_000, seed=3)[:50])
    assert not np.array_equal(arithmetic_corpus(50, seed=4), arithmetic_corpus(50, seed=3))


def test_a_mixture_draws_each_corpus_by_its_weight_in_an_order_the_seed_fixes(
    corpus: tuple[list[Path], Path], tmp_path: Path
) -> None:
    """Two corpora weighed 3:1, the first much the smaller: an epoch holds their windows in that proportion, the
    small corpus's each drawn as often as the others, the large one's a random subset, evenly interleaved; validation
    holds each one's held-out windows once."""
    files, tokenizer = corpus
    small, large = str(tmp_path / "small"), str(tmp_path / "large")
    prepare([str(files[0])], str(tokenizer), small, processes=1)
    prepare([str(file) for file in files[1:]], str(tokenizer), large, processes=1)

    def blend(seed: int) -> TokenDataModule:
        data = TokenDataModule(data_path=[small, large], weights=[3, 1], seq_len=32, val_fraction=0.1, seed=seed)
        data.setup()
        return data

    data = blend(seed=0)
    mixture, (small_windows, large_windows) = data.train, data.train.datasets
    assert len(mixture) == len(small_windows) + len(large_windows)
    assert np.allclose(mixture.counts, [0.75 * len(mixture), 0.25 * len(mixture)], atol=0.5)
    drawn = Counter(zip(mixture.source.tolist(), mixture.position.tolist(), strict=True))
    passes = mixture.counts[0] / len(small_windows)
    small_times = {times for (source, _), times in drawn.items() if source == 0}
    assert small_times == {int(passes), int(passes) + 1}  # every window, once each pass
    assert max(times for (source, _), times in drawn.items() if source == 1) == 1
    assert abs(mixture.source[: len(mixture) // 2].mean() - 0.25) < 0.01  # evenly interleaved, not in runs
    batch = mixture.__getitems__([0, 1, 2, 3])
    for index, window in zip([0, 1, 2, 3], batch, strict=True):
        source = (small_windows, large_windows)[mixture.source[index]]
        assert torch.equal(window, source[int(mixture.position[index])])
    assert np.array_equal(blend(seed=0).train.position, mixture.position)
    assert not np.array_equal(blend(seed=1).train.position, mixture.position)
    assert data.val.counts == [len(validation) for validation in data.val.datasets]

    other = train_tokenizer(files[2:], tmp_path / "other_tokenizer", vocab_size=300)
    prepare([str(files[0])], str(other), str(tmp_path / "other"), processes=1)
    mixed_tokenizers = TokenDataModule(data_path=[small, str(tmp_path / "other")])
    assert re.search(
        r"other was prepared with the tokenizer at .* not with .*tokenizer, which prepared .*small",
        raised(mixed_tokenizers.setup),
    )
    assert "do not blend 2 datasets" in raised(TokenDataModule(data_path=[small, large], weights=[1]).setup)


def test_each_rank_downloads_its_windows_from_s3_and_gcs_not_the_corpus(
    corpus: tuple[list[Path], Path],
    s3_endpoint: str,
    s3_bucket: tuple[str, AbstractFileSystem],
    gcs_bucket: tuple[str, AbstractFileSystem],
    tmp_path: Path,
) -> None:
    """The corpus prepared from the bucket into it (text, tokenizer and tokens on S3; into GCS from local disk).
    Two data-parallel ranks' loaders, 4 shuffled batches each, through a proxy that counts the bytes the storage
    sends: the same windows as from local disk, and those windows' bytes exactly, of a corpus a hundred times more."""
    files, tokenizer = corpus
    (s3, s3fs), (gcs, _) = s3_bucket, gcs_bucket
    (tmp_path / "text").mkdir()
    copies = sorted(  # the corpus three times over, about 100k tokens, in the order a glob lists it
        shutil.copy(file, tmp_path / "text" / f"{copy}-{file.name}") for copy in range(3) for file in files
    )
    local = str(tmp_path / "tokens")
    prepare(copies, str(tokenizer), local, processes=1)
    s3fs.put(copies, f"{s3}/text/")
    s3fs.put(str(tokenizer / "tokenizer.json"), f"{s3}/tokenizer/tokenizer.json")
    prepare([f"{s3}/text/*.jsonl"], f"{s3}/tokenizer", f"{s3}/tokens", processes=1)
    prepare(copies, str(tokenizer), f"{gcs}/tokens", processes=1)
    assert stream(f"{s3}/tokens") == stream(f"{gcs}/tokens") == stream(local)
    for bucket, endpoint in {s3: s3_endpoint, gcs: os.environ["STORAGE_EMULATOR_HOST"]}.items():
        remote = f"{bucket}/tokens"
        counting = FaultyStorage(endpoint, faults=lambda *_: None)
        with counting as proxy:
            tokens = TokenShards.open(remote, endpoint_url=proxy, skip_instance_cache=True)
            for rank in range(2):
                served = counting.served
                batches = first_batches(TokenWindows(tokens, SEQ_LEN), rank)
                assert torch.equal(batches, first_batches(TokenWindows(TokenShards.open(local), SEQ_LEN), rank))
                downloaded = counting.served - served
                assert downloaded == batches.numel() * 2  # uint16 ids
                assert downloaded * 100 < len(tokens) * 2, bucket


SEQ_LEN = 64


def first_batches(windows: TokenWindows, rank: int, batches: int = 4) -> torch.Tensor:
    sampler = DistributedSampler(windows, num_replicas=2, rank=rank, shuffle=True, seed=0)
    loader = StatefulDataLoader(windows, batch_size=4, sampler=sampler)
    return torch.cat([batch for _, batch in zip(range(batches), loader, strict=False)])


# Resumes: the corpus on S3, 2 epochs of 3 global batches of 4 shuffled windows; each run records its batches.
EPOCH = 3


def on_s3(data_path: str | list[str], weights: list[float] | None = None, **strategy: int) -> Case:
    return Case(
        strategy=strategy,
        model="llama_vocab512",
        data_path=data_path,
        data_weights=weights,
        steps=2 * EPOCH,
        limit_train_batches=EPOCH,
        global_batch_size=4,
        shuffle=True,
    )


class RecordBatches(Callback):
    def __init__(self) -> None:
        self.batches: list[torch.Tensor] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        inputs = batch[0] if isinstance(batch, list | tuple) else batch  # a TensorDataset's (x, y): the x
        self.batches.append(inputs.clone())


def run(case: Case, devices: int, resume_from: str | None = None) -> list[torch.Tensor]:
    """This rank's batches of ``case`` on ``devices`` ranks, from the start or resumed from a checkpoint."""
    record = RecordBatches()
    train(case, devices, callbacks=[record], resume_from=resume_from)
    return record.batches


def stopped(case: Case, devices: int, steps: int, run: str) -> list[torch.Tensor]:
    """This rank's batches of ``case`` stopped after ``steps``, each step saved to ``run`` by Lightning's own
    ModelCheckpoint, as a preempted job's."""
    record = RecordBatches()
    train(case, devices, callbacks=[record, keep_two_newest(run, kind=LightningModelCheckpoint), StopAfter(steps)])
    return record.batches


class StopAtValidationEnd(Callback):
    def on_validation_end(self, trainer, pl_module) -> None:
        trainer.should_stop = True


def stopped_in_validation(case: Case, devices: int, run: str) -> list[torch.Tensor]:
    """This rank's batches of ``case`` stopped as its first validation ends, saved there by Lightning's own
    ModelCheckpoint watching the validation loss."""
    record = RecordBatches()
    saving = LightningModelCheckpoint(dirpath=run, monitor="val_loss", save_top_k=-1)
    train(case, devices, callbacks=[record, saving, StopAtValidationEnd()])
    return record.batches


def global_batches(per_rank: list[list[torch.Tensor]]) -> list[list[tuple[int, ...]]]:
    """Each step's windows over all ranks, as sorted token tuples: a global batch is a set of samples."""
    return [sorted(tuple(w.tolist()) for batch in step for w in batch) for step in zip(*per_rank, strict=True)]


def test_a_run_streamed_from_s3_resumes_on_the_next_sample_wherever_it_stopped_on_any_data_parallel_size(
    corpus: tuple[list[Path], Path],
    s3_bucket: tuple[str, AbstractFileSystem],
    gcs_bucket: tuple[str, AbstractFileSystem],
    tmp_path: Path,
) -> None:
    """Stopped mid-epoch (step 2, or step 5 in the second epoch), on an epoch's last batch (step 3) or as a
    validation in mid-epoch ends, resumed on 2 data-parallel ranks or 1, and from 1 on 2: each resumed run draws
    exactly the global batches the uninterrupted run drew from there on; also a blend of a corpus on S3 and one on
    GCS, and a plain DataLoader of one's own, to which Lightning adds its sampler, resumed at an epoch's end. One
    data-parallel rank is 2 tensor-parallel ranks here, which see the same batches: one group of processes for
    all."""
    files, tokenizer = corpus
    data, other = f"{s3_bucket[0]}/tokens", f"{gcs_bucket[0]}/tokens"
    prepare([str(file) for file in files], str(tokenizer), data, processes=1)
    prepare([str(file) for file in files[:2]], str(tokenizer), other, processes=1)
    dp2, dp1 = on_s3(data), on_s3(data, tensor_parallel_size=2)
    blend_dp2, blend_dp1 = on_s3([data, other], [1, 1]), on_s3([data, other], [1, 1], tensor_parallel_size=2)
    validating = replace(dp2, validate=True, val_check_interval=2)  # after steps 2 and 5, and after training
    own_loader = replace(
        dp2, data="pairs", data_path=None, model="zoo_nanogpt_pairs", batch_size=2, global_batch_size=None
    )
    runs = ("dp1_mid", "dp2_mid", "dp2_last", "dp2_second_epoch", "blend_mid", "validation", "own_loader_last")
    saved = {name: str(tmp_path / name) for name in runs}
    mid, last = "epoch=0-step=2.ckpt", f"epoch=0-step={EPOCH}.ckpt"
    calls = {
        "uninterrupted": (run, (dp2, 2)),
        "uninterrupted_on_dp1": (run, (dp1, 2)),
        "stopped_mid": (stopped, (dp2, 2, 2, saved["dp2_mid"])),
        "stopped_last": (stopped, (dp2, 2, EPOCH, saved["dp2_last"])),
        "stopped_mid_on_dp1": (stopped, (dp1, 2, 2, saved["dp1_mid"])),
        "mid_resumed": (run, (dp2, 2, f"{saved['dp2_mid']}/{mid}")),
        "last_resumed": (run, (dp2, 2, f"{saved['dp2_last']}/{last}")),
        "mid_resumed_on_dp1": (run, (dp1, 2, f"{saved['dp2_mid']}/{mid}")),
        "mid_on_dp1_resumed_on_dp2": (run, (dp2, 2, f"{saved['dp1_mid']}/{mid}")),
        "stopped_in_second_epoch": (stopped, (dp2, 2, 5, saved["dp2_second_epoch"])),
        "second_epoch_resumed_on_dp1": (run, (dp1, 2, f"{saved['dp2_second_epoch']}/epoch=1-step=5.ckpt")),
        "own_loader": (run, (own_loader, 2)),
        "own_loader_stopped_last": (stopped, (own_loader, 2, EPOCH, saved["own_loader_last"])),
        "own_loader_last_resumed": (run, (own_loader, 2, f"{saved['own_loader_last']}/{last}")),
        "blend": (run, (blend_dp2, 2)),
        "blend_stopped_mid": (stopped, (blend_dp2, 2, 2, saved["blend_mid"])),
        "blend_mid_resumed_on_dp1": (run, (blend_dp1, 2, f"{saved['blend_mid']}/{mid}")),
        "validating": (run, (validating, 2)),
        "stopped_in_validation": (stopped_in_validation, (validating, 2, saved["validation"])),
        "validation_resumed": (run, (validating, 2, f"{saved['validation']}/{mid}")),
    }
    per_rank = run_ranks(2, run_each, list(calls.values()))
    # A pair of tensor-parallel ranks holds one batch: one rank's batches are the global ones.
    tensor_parallel = [name for name, (_, (case, *_)) in calls.items() if case is dp1 or case is blend_dp1]
    drawn = {
        name: global_batches([runs[0]] if name in tensor_parallel else list(runs))
        for name, runs in zip(calls, zip(*per_rank, strict=True), strict=True)
    }

    uninterrupted = drawn["uninterrupted"]
    assert len(uninterrupted) == 2 * EPOCH
    assert len({window for step in uninterrupted[:EPOCH] for window in step}) == 4 * EPOCH  # none twice in an epoch
    assert drawn["uninterrupted_on_dp1"] == uninterrupted  # the same global batches on 1 data-parallel rank as on 2
    assert drawn["stopped_mid"] == drawn["stopped_mid_on_dp1"] == uninterrupted[:2]
    assert drawn["stopped_last"] == uninterrupted[:EPOCH]
    assert drawn["mid_resumed"] == drawn["mid_resumed_on_dp1"] == uninterrupted[2:]
    assert drawn["last_resumed"] == uninterrupted[EPOCH:]  # the next epoch's first batch: none replayed
    assert drawn["mid_on_dp1_resumed_on_dp2"] == uninterrupted[2:]
    assert drawn["stopped_in_second_epoch"] == uninterrupted[:5] and drawn["second_epoch_resumed_on_dp1"] == [
        uninterrupted[5]
    ]
    own_loader = drawn["own_loader"]
    assert own_loader[:EPOCH] != own_loader[EPOCH:]  # Lightning's sampler shuffles each epoch anew
    assert drawn["own_loader_stopped_last"] == own_loader[:EPOCH]
    assert drawn["own_loader_last_resumed"] == own_loader[EPOCH:]
    blend = drawn["blend"]
    assert blend != uninterrupted
    assert drawn["blend_stopped_mid"] == blend[:2] and drawn["blend_mid_resumed_on_dp1"] == blend[2:]
    validating = drawn["validating"]  # fewer windows to train on, a part held out: another order
    assert drawn["stopped_in_validation"] == validating[:2] and drawn["validation_resumed"] == validating[2:]
