"""Every shell command the README and the docs pages show is run: here, by the test named beside it, or by CI. A
command added to a page, or changed in one, without saying how it is run fails here, so the pages cannot drift."""

from __future__ import annotations

import ast
import re
import shlex
from pathlib import Path

import pytest

from lightdist.cli import main

REPO = Path(__file__).parents[1]
PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
RUN_HERE = "run here"

# Each shell block of the pages, as shown (comments and line continuations dropped), and what runs it: this file
# (RUN_HERE), the test that runs it or its equivalent, CI's script, or why it cannot run on this machine.
SHELL_BLOCKS = {
    "bash scripts/setup.sh && .venv/bin/lightdist fit --config configs/3d_cpu.yaml": (
        "tests/test_cli.py::test_main_job_config_trains_3d_and_saves_every_ranks_shard"
    ),
    "bash scripts/setup.sh && .venv/bin/python -m pytest && .venv/bin/python -m pytest -m ray": ".ci/run",
    ".venv/bin/lightdist fit --config configs/long_context_cpu.yaml": (
        "tests/test_configs.py::test_every_config_trains_on_two_cpu_ranks"
    ),
    '.venv/bin/lightdist plan --model lightdist.models.Llama --init-args \'{"preset": "70b"}\' --gpus 64 '
    "--gpu-memory 80": RUN_HERE,
    "torchrun --nnodes=1 --nproc-per-node=8 --max-restarts=3 --rdzv-backend=c10d --rdzv-endpoint=127.0.0.1:29500 "
    ".venv/bin/lightdist fit --config configs/3d.yaml": (
        "tests/test_restarts.py::test_lightnings_own_checkpoint_callback_resumes_a_killed_job_from_the_newest_complete"
        "_checkpoint"
    ),
    'head=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)\nsrun torchrun --nnodes="$SLURM_NNODES" '
    '--nproc-per-node=8 --max-restarts=3 --rdzv-backend=c10d --rdzv-endpoint="$head:29500" '
    '--rdzv-id="$SLURM_JOB_ID" .venv/bin/lightdist fit --config configs/3d.yaml': (
        "not here: this machine has no SLURM (the page says so)"
    ),
    "export TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1\ntorchrun --nnodes=1:4 --nproc-per-node=8 --max-restarts=3 "
    '--rdzv-backend=c10d --rdzv-endpoint="$head:29500" --rdzv-id=my-run .venv/bin/lightdist fit --config '
    "configs/3d.yaml --trainer.num_nodes=4": (
        "tests/test_restarts.py::test_an_elastic_job_grows_onto_a_node_that_joins_and_carries_on_when_it_is_lost"
    ),
    "lightdist export s3://bucket/run/last.ckpt model.safetensors\nlightdist export s3://bucket/run/last.ckpt "
    "model.pt --dtype bfloat16\nlightdist export s3://bucket/run/last.ckpt llama-hf": (
        "tests/test_export.py::test_exported_file_loads_into_the_plain_model"
    ),
    ".venv/bin/lightdist verify --config configs/3d.yaml": RUN_HERE,
    ".venv/bin/torchft_lighthouse --min_replicas 1 --join_timeout_ms 60000 --heartbeat_timeout_ms 2000 --bind "
    '"[::]:29510" &\nexport TORCHFT_LIGHTHOUSE=http://127.0.0.1:29510\nfor group in 0 1 2; do\n'
    "LIGHTDIST_REPLICA_GROUP=group-$group .venv/bin/lightdist fit --config configs/replica_groups_cpu.yaml &\ndone\n"
    "wait": (
        "tests/test_cli.py::test_replica_groups_launched_by_torchrun_per_node_and_by_lightdist_fit_train_as_one_run"
    ),
    "torchft_lighthouse --min_replicas 1 --join_timeout_ms 60000 --heartbeat_timeout_ms 2000 --bind "
    '"[::]:29510" &\nexport TORCHFT_LIGHTHOUSE=http://host0:29510 LIGHTDIST_REPLICA_GROUP=$(hostname)\n'
    "torchrun --standalone --nproc-per-node=8 --max-restarts=3 .venv/bin/lightdist fit --config "
    "my_replica_groups.yaml": (
        "tests/test_cli.py::test_replica_groups_launched_by_torchrun_per_node_and_by_lightdist_fit_train_as_one_run"
        " (on one machine; not here: several nodes)"
    ),
    'head=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)\nexport TORCHFT_LIGHTHOUSE="http://$head:29510"'
    '\nsrun --overlap --nodes=1 --ntasks=1 --nodelist="$head" torchft_lighthouse --min_replicas 1 --join_timeout_ms '
    '60000 --heartbeat_timeout_ms 2000 --bind "[::]:29510" &\nsrun --overlap --ntasks-per-node=1 bash -c '
    "'LIGHTDIST_REPLICA_GROUP=node-$SLURM_NODEID torchrun --standalone --nproc-per-node=8 --max-restarts=3 "
    ".venv/bin/lightdist fit --config my_replica_groups.yaml'": (
        "not here: this machine has no SLURM (the page says so)"
    ),
    "ray start --head\n.venv/bin/torchft_lighthouse --min_replicas 1 --join_timeout_ms 60000 --heartbeat_timeout_ms "
    '2000 --bind "[::]:29510" &\noptions=--trainer.strategy.init_args.replica_groups\nfor group in 0 1 2; do\n'
    ".venv/bin/lightdist fit --config configs/replica_groups_cpu.yaml --launcher ray --num-workers 2 --ray-address "
    "auto $options.lighthouse=http://$(hostname):29510 $options.group=group-$group &\ndone\nwait": (
        "tests/test_ray.py::test_replica_groups_run_as_ray_worker_groups"
    ),
    'lightdist plan --model lightdist.models.Llama --init-args \'{"preset": "70b"}\' --gpus 64 --format csv': RUN_HERE,
    'lightdist plan --model lightdist.models.MoELlama --init-args \'{"preset": "8x7b"}\' --gpus 16 --ep 4': RUN_HERE,
    ".venv/bin/lightdist fit --config configs/tp2_zero3_cpu.yaml --launcher ray --num-workers 4 --max-failures 1": (
        "tests/test_ray.py::test_lightdist_fit_runs_a_config_on_ray_and_reports_its_metrics"
    ),
    "lightdist prepare s3://corpus/raw/ --tokenizer ./tokenizer --output s3://corpus/tokens --text-field text": (
        "tests/test_data.py::test_every_format_becomes_one_stream_of_documents_each_ended_by_eos"
    ),
    "python -m lightdist.models.python_docs data/python_docs\nlightdist prepare data/python_docs/corpus --tokenizer "
    "data/python_docs/tokenizer --output s3://lightdist-data/python_docs\nlightdist fit --config "
    "configs/python_docs_s3_cpu.yaml": "tests/test_configs.py::test_every_config_trains_on_two_cpu_ranks",
    "lightdist timeline runs/3d/traces": (
        "tests/test_pipeline.py::test_a_profiled_step_traces_each_stage_forward_and_backward_per_microbatch"
    ),
    ".venv/bin/lightdist fit --config configs/tp2_zero3_cpu.yaml": (
        "tests/test_configs.py::test_every_config_trains_on_two_cpu_ranks"
    ),
    ".venv/bin/lightdist verify --config configs/hf_qwen2.yaml --steps 3": (
        "tests/test_verify.py::test_a_hugging_face_config_shrunk_trains_as_one_process"
    ),
    "torchrun --nproc-per-node 4 examples/plain_loop.py --tp 2\npython examples/plain_loop.py": (
        "tests/test_examples.py::test_a_plain_pytorch_loop_over_parallelize_trains_what_one_process_trains"
    ),
    'lightdist plan --model lightdist.models.Llama --init-args \'{"preset": "70b"}\' --tp 8\nlightdist plan --model '
    'lightdist.models.Llama --init-args \'{"preset": "70b"}\' --pp 8\nlightdist plan --config configs/3d_cpu.yaml': (
        RUN_HERE
    ),
}


def shell_blocks(page: Path) -> list[tuple[str, str]]:
    """Each ``bash`` block of ``page``, as one command per line, and the ``text`` block right after it (its output as
    the page shows it), if any."""
    blocks = []
    for match in re.finditer(r"```bash\n(.*?)```\n*(?:```text\n(.*?)```)?", page.read_text(), re.S):
        lines = match.group(1).replace("\\\n", " ").splitlines()
        commands = [re.sub(r"\s+#.*$|^#.*$", "", line).strip() for line in lines]
        blocks.append(("\n".join(" ".join(c.split()) for c in commands if c), match.group(2) or ""))
    return blocks


ALL_BLOCKS = [block for page in PAGES for block in shell_blocks(page)]


def test_every_shell_block_of_the_pages_says_how_it_is_run() -> None:
    shown = {command for command, _ in ALL_BLOCKS}
    unknown = sorted(shown - set(SHELL_BLOCKS))
    assert not unknown, "say in SHELL_BLOCKS how each of these is run:\n" + "\n\n".join(unknown)
    assert not set(SHELL_BLOCKS) - shown, f"no page shows these any more: {sorted(set(SHELL_BLOCKS) - shown)}"


def test_the_tests_and_scripts_named_as_running_the_commands_exist() -> None:
    for runner in SHELL_BLOCKS.values():
        if runner == ".ci/run":
            ci = (REPO / ".ci/run").read_text()
            assert all(command in ci for command, _ in ALL_BLOCKS if SHELL_BLOCKS[command] == ".ci/run")
        elif "::" in runner:
            path, name = runner.split("::")
            name = name.split(" (")[0]  # a note on what the test leaves out may follow
            defined = {
                node.name
                for node in ast.walk(ast.parse((REPO / path).read_text()))
                if isinstance(node, ast.FunctionDef)
            }
            assert name in defined, f"{runner} does not exist"


def _run(command: str, capsys: pytest.CaptureFixture) -> str:
    """``command`` run by lightdist's own entry point, in this process (starting one per command would cost an
    interpreter and torch's import each)."""
    argv = shlex.split(command)
    assert argv[0] in ("lightdist", ".venv/bin/lightdist"), command
    try:
        main(argv[1:])
    except SystemExit as exit:
        assert not exit.code, f"{command}\n{capsys.readouterr().err}"
    return capsys.readouterr().out


@pytest.mark.parametrize(
    ("command", "shown"),
    [
        (command, shown)
        for block, output in ALL_BLOCKS
        if SHELL_BLOCKS.get(block) == RUN_HERE
        for command in block.splitlines()
        for shown in [output if "\n" not in block else ""]
    ],
)
def test_commands_run_here_succeed_and_print_what_the_page_shows(
    command: str, shown: str, capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(REPO)  # where the pages' commands run, as the README's setup leaves the user
    printed = _run(command, capsys)
    if shown:
        assert [line.rstrip() for line in printed.strip().splitlines()] == shown.strip().splitlines()
