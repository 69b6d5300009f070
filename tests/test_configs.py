"""Every way of training in ``configs/``, launched as its header says, cut down to two steps of a tiny model on CPU
ranks: each parses, builds its layout, trains, validates and saves a complete checkpoint.

The CPU configs' own launch, Lightning starting the ranks from ``lightdist fit``, is tested in tests/test_cli.py."""

from __future__ import annotations

import json
import os
import posixpath
import sys
from pathlib import Path

import fsspec
import pytest
from fsspec import AbstractFileSystem

from lightdist.checkpoint.storage import resolve
from lightdist.cli import main
from lightdist.data.prepare import prepare
from lightdist.models.python_docs import MODULES, train_tokenizer, write_corpus

from multirank import run_each, run_ranks
from training import checkpoint_files

pytestmark = pytest.mark.multirank

CONFIGS = Path(__file__).parents[1] / "configs"
ON_CPU = [
    "--trainer.accelerator=cpu",
    "--trainer.precision=32-true",
    "--trainer.max_steps=2",
    "--trainer.val_check_interval=2",
    "--trainer.limit_val_batches=1",
    "--trainer.logger=false",  # W&B is tested with the main job (tests/test_cli.py)
    "--trainer.enable_progress_bar=false",
    "--data.init_args.seq_len=32",
    "--data.init_args.synthetic_tokens=16384",
]
TINY_LLAMA = ["--model.init_args.preset=tiny"]
TINY_QWEN2 = [
    "--model.init_args.config="
    + json.dumps(
        dict(
            model_type="qwen2",
            vocab_size=64,
            hidden_size=64,
            intermediate_size=176,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
        )
    )
]
STRATEGY = "--trainer.strategy.init_args"
# What each config needs to fit 2 CPU ranks; the 8-rank 3D run is configs/3d_cpu.yaml's, in tests/test_cli.py.
ON_TWO_RANKS = {
    "zero3_cpu": [],
    "tp2_zero3_cpu": [],  # tensor parallel in one pair
    "ddp": TINY_LLAMA,
    "zero1": TINY_LLAMA,
    "zero2": TINY_LLAMA,
    "zero3": TINY_LLAMA,
    "tp": [*TINY_LLAMA, f"{STRATEGY}.tensor_parallel_size=2"],
    "pp": [*TINY_LLAMA, f"{STRATEGY}.pipeline_parallel_size=2"],  # 2 stages x 2 virtual: the tiny Llama's 4 blocks
    "3d": [*TINY_LLAMA, f"{STRATEGY}.tensor_parallel_size=1"],  # its pipeline of 2 stages
    "hf_qwen2": TINY_QWEN2,
    "s3": TINY_LLAMA,
    # its 2 expert-parallel ranks, the 2 data-parallel ones
    "moe_cpu": [f"{STRATEGY}.pipeline_parallel_size=1", f"{STRATEGY}.tensor_parallel_size=1"],
    # the corpus prepared into the bucket first, as its header says (a few modules' docstrings)
    "python_docs_s3_cpu": [f"{STRATEGY}.pipeline_parallel_size=1", f"{STRATEGY}.tensor_parallel_size=1"],
    "long_context_cpu": [f"{STRATEGY}.tensor_parallel_size=1"],  # each window split over the 2 ranks
    # the 2 ranks split each window, and recompute each block under the split in backward
    "long_context": [*TINY_LLAMA, "--model.init_args.config={}", f"{STRATEGY}.context_parallel_size=2"],
}


def fit(name: str, overrides: list[str], workdir: Path, devices: int) -> list[str]:
    """``lightdist fit --config configs/NAME.yaml`` in ``workdir``; the files of the checkpoint last.ckpt names."""
    launch(name, overrides, workdir, devices)
    return saved_last("s3://lightdist/runs/s3/last.ckpt" if name == "s3" else f"runs/{name}/checkpoints/last.ckpt")


def launch(name: str, overrides: list[str], workdir: Path, devices: int) -> None:
    os.chdir(workdir)
    main(["fit", "--config", str(CONFIGS / f"{name}.yaml"), *ON_CPU, f"--trainer.devices={devices}", *overrides])


def saved_last(last: str) -> list[str]:
    """The files of the checkpoint the pointer ``last`` names."""
    storage, path = fsspec.core.url_to_fs(resolve(last))  # resolve refuses an incomplete checkpoint
    return sorted(posixpath.basename(file) for file in storage.ls(path, detail=False))


def test_every_config_trains_on_two_cpu_ranks(
    tmp_path: Path, s3_bucket: tuple[str, AbstractFileSystem], capfd: pytest.CaptureFixture
) -> None:
    _, s3 = s3_bucket
    s3.mkdir("lightdist")  # the bucket configs/s3.yaml names
    s3.mkdir("lightdist-data")  # and configs/python_docs_s3_cpu.yaml's corpus
    calls = [(fit, (name, overrides, tmp_path / name, 2)) for name, overrides in ON_TWO_RANKS.items()]
    for name in ON_TWO_RANKS:
        (tmp_path / name).mkdir()
    python_docs = tmp_path / "python_docs_s3_cpu" / "data" / "python_docs"
    corpus = write_corpus(python_docs / "corpus", MODULES[:3])
    tokenizer = train_tokenizer(corpus, python_docs / "tokenizer")
    prepare([str(file) for file in corpus], str(tokenizer), "s3://lightdist-data/python_docs", processes=1)
    saved, _ = run_ranks(2, run_each, calls)
    assert dict(zip(ON_TWO_RANKS, saved, strict=True)) == {name: checkpoint_files(2) for name in ON_TWO_RANKS}
    # The S3 secret the ranks had in their environment is nowhere: not in what they printed, not in W&B's offline
    # runs, the saved configs or the checkpoints, local or in the bucket.
    secret = os.environ["AWS_SECRET_ACCESS_KEY"].encode()
    printed = capfd.readouterr()
    # The tiny Llama's 4 heads divide between the 2 ranks that split each window: "auto" deals them out.
    assert "each sequence split over 2 ranks (attention: all_to_all, auto)" in printed.out + printed.err
    assert "attention within each document (ended by token 0)" in printed.out + printed.err  # python_docs_s3_cpu
    assert secret not in (printed.out + printed.err).encode()
    written = [path for path in tmp_path.rglob("*") if path.is_file() and secret in path.read_bytes()]
    uploaded = [key for key in s3.find("lightdist") if secret in s3.cat_file(key)]
    assert written == uploaded == []


def test_the_single_device_config_trains_on_one_cpu_rank(tmp_path: Path) -> None:
    (saved,) = run_ranks(1, fit, "single_device", TINY_LLAMA, tmp_path, 1)
    assert saved == checkpoint_files(1)


def test_the_cpu_offload_config_says_what_to_change_on_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """Offloading to CPU memory from the CPU means nothing: the config fails before any rank starts."""
    monkeypatch.setattr(sys, "argv", ["lightdist"])
    with pytest.raises(ValueError, match=r"cpu_offload=True moves sharded state .* but the accelerator is the CPU"):
        main(["fit", "--config", str(CONFIGS / "cpu_offload.yaml"), *ON_CPU, *TINY_LLAMA])
