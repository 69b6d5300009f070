"""The benchmark runs end to end (its numbers are read by people on the GPU machine, never asserted here)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from multirank import processes_left

BENCH = Path(__file__).parents[1] / "bench" / "throughput.py"


def test_throughput_benchmark_prints_the_runs_asked_for_a_failed_one_among_them_and_their_profiles(
    tmp_path: Path,
) -> None:
    options = ["--preset", "tiny", "--seq-len", "32", "--steps", "3", "--warmup", "1", "--profile", "ops.txt"]
    # cpu_offload is refused on the CPU: its run fails, and the runs after it still run.
    runs = ["plain", "hf-plain", "lightning", "lightdist-offload", "lightdist", "hf-lightdist"]
    run = subprocess.run(
        [sys.executable, str(BENCH), *options, "--runs", *runs, "--profile-runs", "hf-plain", "lightdist"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    rows = [line for line in run.stdout.splitlines() if line.endswith("x") or " failed: " in line]
    assert [row.split("  ")[0] for row in rows] == [
        "plain PyTorch",
        "HF Llama: plain PyTorch",
        "Lightning ModelParallelStrategy (FSDP2)",
        "lightdist ParallelStrategy (ZeRO-3, cpu_offload)",
        "lightdist ParallelStrategy (ZeRO-3)",
        "HF Llama: lightdist (ZeRO-3)",
    ]
    assert "failed: ValueError: cpu_offload=True" in rows[3]
    profiles = (tmp_path / "ops.txt").read_text()
    assert [line for line in profiles.splitlines() if line.startswith("== ")] == [
        "== HF Llama: plain PyTorch",
        "== lightdist ParallelStrategy (ZeRO-3)",
    ]
    assert profiles.count("aten::mm") == 2


def test_pipeline_bubble_benchmark_counts_microbatches_in_flight(tmp_path: Path) -> None:
    bubble = BENCH.parent / "pipeline_bubble.py"
    options = ["--stages", "2", "--microbatches", "4", "--steps", "1", "--forward-ms", "1"]
    run = subprocess.run(
        [sys.executable, str(bubble), *options], cwd=tmp_path, capture_output=True, text=True, timeout=300
    )
    assert run.returncode == 0, run.stderr[-3000:]
    rows = {tuple(line.split()[:3]): line.split()[-1] for line in run.stdout.splitlines() if line.startswith(" 2 ")}
    # GPipe holds every microbatch's activations before the first backward; 1F1B at most one per stage; every
    # schedule runs, two stages per rank under the interleaved and zero-bubble ones.
    assert rows[("2", "gpipe", "4")] == "4.0"
    assert rows[("2", "1f1b", "4")] == "2.0"
    assert {schedule for _, schedule, _ in rows} == {"gpipe", "1f1b", "interleaved_1f1b", "zero_bubble"}


def test_checkpoint_stall_benchmark_times_every_kind_of_save(tmp_path: Path) -> None:
    stall = BENCH.parent / "checkpoint_stall.py"
    options = ["--preset", "tiny", "--seq-len", "16", "--local-only", "--async-checkpoint", "thread"]
    run = subprocess.run(
        [sys.executable, str(stall), *options], cwd=tmp_path, capture_output=True, text=True, timeout=300
    )
    assert run.returncode == 0, run.stderr[-3000:]
    header, local = [line.split() for line in run.stdout.splitlines()[-2:]]
    assert header[0] == "target" and local[0] == "local"
    state_gigabytes, *seconds = (float(value) for value in local[1:6])
    assert state_gigabytes > 0 and all(value > 0 for value in seconds)


@pytest.mark.parametrize("experts", ["stacked", "list"])
def test_expert_parallel_benchmark_times_each_ep_in_turn(tmp_path: Path, experts: str) -> None:
    bench = BENCH.parent / "expert_parallel.py"
    options = ["--ranks", "2", "--ep", "1", "2", "--steps", "2", "--warmup", "1", "--rounds", "1", "--experts", experts]
    run = subprocess.run(
        [sys.executable, str(bench), *options], cwd=tmp_path, capture_output=True, text=True, timeout=300
    )
    assert run.returncode == 0, run.stderr[-3000:]
    rows = [line.split() for line in run.stdout.splitlines() if line.strip()[:1].isdigit()]
    assert [row[0] for row in rows] == ["1", "2"]
    assert rows[0][2] == "1.00x"  # ep=1 is the baseline
    assert float(rows[0][3]) == 0 < float(rows[1][3])  # only split experts send tokens


def test_pretrained_load_benchmark_starts_each_way_and_counts_what_lightdist_read(tmp_path: Path) -> None:
    bench = BENCH.parent / "pretrained_load.py"
    options = ["--hidden", "128", "--layers", "2", "--ranks", "2"]
    run = subprocess.run(
        [sys.executable, str(bench), *options], cwd=tmp_path, capture_output=True, text=True, timeout=600
    )
    assert run.returncode == 0, run.stderr[-3000:]
    rows = [line.split(maxsplit=1) for line in run.stdout.splitlines() if line.strip()[:1].isdigit()]
    assert [row[1].split("  ")[0] for row in rows] == ["lightdist", "lightdist", "every rank", "rank 0 + broadcast"]
    lightdist_read = [float(row[1].split()[-1]) for row in rows[:2]]
    assert all(read > 0 for read in lightdist_read)  # local and S3


def test_data_benchmark_tokenizes_each_way_and_loads_from_disk_and_s3(tmp_path: Path) -> None:
    bench = BENCH.parent / "data.py"
    options = ["--megabytes", "0.5", "--files", "2", "--seq-len", "128", "--batches", "5", "--vocab-size", "512"]
    run = subprocess.run(
        [sys.executable, str(bench), *options], cwd=tmp_path, capture_output=True, text=True, timeout=600
    )
    assert run.returncode == 0, run.stderr[-3000:]
    last_columns = {
        line[:36].strip(): line.split()[-1].rstrip("x").replace(",", "") for line in run.stdout.splitlines()
    }
    rates = {row: float(value) for row, value in last_columns.items() if value.replace(".", "").isdigit()}
    ways = ["tokenizers alone, its threads", "lightdist prepare, 1 process(es)", "local disk", "S3 (moto)"]
    assert all(rates[way] > 0 for way in ways), run.stdout


@pytest.mark.parametrize("packing", [[], ["--document", "32"]], ids=["one_document", "documents_of_32"])
def test_context_parallel_benchmark_times_each_size_and_method(tmp_path: Path, packing: list[str]) -> None:
    bench = BENCH.parent / "context_parallel.py"
    options = ["--lengths", "256", "--sizes", "1", "2", "--repeats", "1", *packing]
    run = subprocess.run(
        [sys.executable, str(bench), *options], cwd=tmp_path, capture_output=True, text=True, timeout=300
    )
    assert run.returncode == 0, run.stderr[-3000:]
    rows = [line.strip("|").split("|") for line in run.stdout.splitlines() if line.startswith("| 256 ")]
    assert [(row[1].strip(), row[2].strip()) for row in rows] == [("1", "none"), ("2", "all_to_all"), ("2", "ring")]
    # Each rank of two keeps about half of one rank's activations, and the sequence's loss is one rank's (within
    # each document too); the last column compares the ranks' CPU times.
    assert all(0.4 < float(row[5]) < 0.6 for row in rows[1:]), run.stdout
    assert len({row[7] for row in rows}) == 1, run.stdout
    assert all(float(row[8]) >= 1.0 for row in rows), run.stdout


def test_documents_benchmark_times_the_causal_and_the_document_masked_step() -> None:
    bench = BENCH.parent / "documents.py"
    options = ["--lengths", "128", "256", "--document", "32", "--repeats", "1"]
    run = subprocess.run([sys.executable, str(bench), *options], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    rows = [line.strip("|").split("|") for line in run.stdout.splitlines() if line.startswith("| ") and "ms" in line]
    assert [row[0].strip() for row in rows] == ["128", "256"]
    assert all(float(row[3]) > 0 for row in rows), run.stdout
    assert [row[4].strip() for row in rows] == ["25.6%", "12.8%"]  # documents of 32 tokens: 4 of 128, 8 of 256


def test_failures_benchmark_loses_a_rank_both_ways_and_counts_no_sample_missed(tmp_path: Path) -> None:
    """Its ranks upload checkpoints from a checkpoint process each, as lightdist does by default: none is left
    running after the job, not even the killed rank's, which may have been killed as its checkpoint process started."""
    failures = BENCH.parent / "failures.py"
    # the others wait for the lost group's new start 15 steps before the end, however slow the machine; 2 groups, 4
    # ranks (each starts a checkpoint process under torchrun)
    options = ["--steps", "30", "--kill-at", "5", "--save-every", "3", "--groups", "2"]
    marked = os.environ | {"LIGHTDIST_TEST_JOB": str(tmp_path)}  # every process of the job inherits it
    run = subprocess.run(
        [sys.executable, str(failures), *options], capture_output=True, text=True, timeout=600, env=marked
    )
    assert run.returncode == 0, run.stderr[-3000:]
    assert not processes_left("LIGHTDIST_TEST_JOB", str(tmp_path))
    rows = [
        line.split(" | ") for line in run.stdout.splitlines() if line.startswith("| replica") or "| torchrun" in line
    ]
    (groups, restart) = [[cell.strip("| ") for cell in row] for row in rows]
    assert [groups[0], restart[0]] == ["replica-groups", "torchrun"]
    seconds = [float(cell.removesuffix(" s")) for cell in (groups[1], restart[1])]
    assert seconds[0] < seconds[1]  # the others go on in their processes; torchrun starts every rank again
    assert groups[3] == "1" and int(restart[3]) >= 1  # one step redone; the steps since the checkpoint
    assert groups[4] == restart[4] == "0"  # no sample missed or seen twice by the final weights
    assert groups[5].endswith(" s") and restart[5] == "-"
