"""``lightdist plan --gpus N``: what every layout of a cluster costs per GPU, which to use, and what to do when nothing
fits; all from a model built on the meta device, in seconds."""

from __future__ import annotations

import dataclasses
import gc
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import transformers
from lightning.pytorch import Callback, Trainer, seed_everything
from torch.distributed.tensor import DTensor
from torch.testing._internal.distributed.fake_pg import FakeStore

from lightdist.cli import main
from lightdist.layout import ParallelLayout
from lightdist.models import Llama, MoELlama, TokenDataModule
from lightdist.models.llama import LLAMA_PRESETS
from lightdist.plan.planner import Cluster, GiB, Layout, ModelShape, Training, estimate, plan_layouts
from lightdist.plugins import ParallelStrategy

from multirank import run_ranks
from training import MODELS, Case, train_cases

LLAMA_70B = ["--model", "lightdist.models.Llama", "--init-args", '{"preset": "70b"}']
LLAMA_8B = ["--model", "lightdist.models.Llama", "--init-args", '{"preset": "8b"}']


def meta_llama(preset: str) -> Llama:
    with torch.device("meta"):
        return Llama(preset)


def test_parameters_per_rank_are_split_as_the_strategy_splits_them() -> None:
    config = LLAMA_PRESETS["70b"]
    norms = config.n_layers * 2 * config.dim + config.dim  # two per block and the final one: never split
    llama_70b = ModelShape(meta_llama("70b"))
    assert llama_70b.parameters == 70_553_706_496
    # Tensor parallelism splits every matrix over 8 ranks (8 key/value heads: one each) and leaves the norms whole.
    assert llama_70b.rank_parameters(pp=1, tp=8, dp=1) == [((llama_70b.parameters - norms) // 8 + norms,) * 2]
    # ZeRO shards each tensor's first dimension over the data-parallel ranks.
    (whole, sharded), *_ = llama_70b.rank_parameters(pp=1, tp=8, dp=4)
    assert sharded == pytest.approx(whole / 4, rel=1e-6)
    # Pipeline stages are the ones `lightdist plan --pp 4` shows (tests/test_cli.py): embeddings first, head last.
    stages = ModelShape(meta_llama("8b")).rank_parameters(pp=4, tp=1, dp=1)
    assert [whole for whole, _ in stages] == [2_052_120_576, 1_963_008_000, 1_963_008_000, 2_052_124_672]
    # With fewer key/value heads than ranks, each rank keeps the key and value projections whole (tiny: 2 heads).
    tiny = ModelShape(meta_llama("tiny"))
    per_block = 64 * 64 // 4 * 2 + 32 * 64 * 2 + 176 * 64 // 4 * 3 + 64 * 2  # q, o split; k, v whole; mlp split
    assert tiny.rank_parameters(pp=1, tp=4, dp=1)[0][0] == 4 * per_block + 64 * 64 // 4 * 2 + 64
    # A head tied to the embedding is one tensor, and under a pipeline a copy on each end.
    with torch.device("meta"):
        tied = ModelShape(Llama("tiny", config={"tie_embeddings": True}))
    assert tied.parameters == tied.rank_parameters(pp=1, tp=1, dp=1)[0][0] == 193_088 - 64 * 64
    assert sum(whole for whole, _ in tied.rank_parameters(pp=2, tp=1, dp=1)) == 193_088


def held_by(preset: str, pp: int, dp: int, tp: int, rank: int) -> int:
    """Elements of the parameters ``ParallelStrategy`` leaves ``rank`` of pp x dp x tp ranks, splitting a meta-device
    Llama in a fake process group: nothing is allocated and nothing is sent."""
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=pp * dp * tp)
    try:
        strategy = ParallelStrategy(pipeline_parallel_size=pp, tensor_parallel_size=tp, zero_stage=3)
        strategy.parallel_devices = [torch.device("cpu")]
        strategy._layout = ParallelLayout(pp=pp, dp=dp, tp=tp)
        strategy._mesh = strategy._layout.build_mesh("cpu")
        model = meta_llama(preset)
        strategy._parallelize(model)
        return sum((p.to_local() if isinstance(p, DTensor) else p).numel() for p in model.parameters())
    finally:
        dist.destroy_process_group()


def held_by_each(cases: list[tuple[str, int, int, int, int]]) -> list[int]:
    return [held_by(*case) for case in cases]


BIG_LAYOUTS = {  # preset: (pp, dp, tp)
    "8b": (2, 2, 2),  # 8 GPUs
    "70b": (8, 2, 4),  # 64 GPUs
    "405b": (16, 8, 8),  # 1024 GPUs
}


def test_parameters_per_rank_are_what_the_strategy_leaves_each_rank_of_a_big_cluster() -> None:
    # The first rank (the first stage) and the last (the last stage) of each cluster, in a fresh process.
    cases = [
        (preset, pp, dp, tp, rank) for preset, (pp, dp, tp) in BIG_LAYOUTS.items() for rank in (0, pp * dp * tp - 1)
    ]
    held = iter(run_ranks(1, held_by_each, cases)[0])
    for preset, (pp, dp, tp) in BIG_LAYOUTS.items():
        stages = ModelShape(meta_llama(preset)).rank_parameters(pp=pp, tp=tp, dp=dp)
        (_, first), (_, last) = stages[0], stages[-1]
        assert (next(held), next(held)) == (first, last), preset


GRADIENT_CASES = {  # on 4 ranks
    "tp2_dp2_zero3": Case(strategy=dict(tensor_parallel_size=2, zero_stage=3), model="llama_vocab512"),
    "tp4_replicated_key_values_zero1": Case(strategy=dict(tensor_parallel_size=4, zero_stage=1)),
    "pp2_tp2_4_microbatches": Case(strategy=dict(pipeline_parallel_size=2, tensor_parallel_size=2, microbatches=4)),
    "cp2_tp2": Case(strategy=dict(context_parallel_size=2, tensor_parallel_size=2)),
    # third-party code: Gemma 3's scaled embedding, GPT-2's Conv1D, nanoGPT's head tied to its embedding
    "hf_gemma3_tp2_dp2_zero2": Case(
        strategy=dict(tensor_parallel_size=2, zero_stage=2), model="zoo_hf_gemma3_text_logits"
    ),
    "hf_gpt2_pp2_dp2_zero1": Case(strategy=dict(pipeline_parallel_size=2, zero_stage=1), model="zoo_hf_gpt2_labels"),
    "nanogpt_pp2_tp2": Case(strategy=dict(pipeline_parallel_size=2, tensor_parallel_size=2), model="zoo_nanogpt"),
}


@pytest.mark.multirank
def test_each_rank_holds_the_gradients_the_planner_counts_when_the_optimizer_steps() -> None:
    """The gradients of the rank's parameters, as tensor and pipeline parallelism split them and ZeRO-2 and 3 shard
    them: what the planner counts (4 bytes each) from the model built on the meta device, for any model."""
    cases = [dataclasses.replace(case, steps=1) for case in GRADIENT_CASES.values()]
    per_rank = zip(*run_ranks(4, train_cases, cases, 4), strict=True)
    for (name, case), results in zip(GRADIENT_CASES.items(), per_rank, strict=True):
        assert not any(result.error or result.gradients_unlike_parameters for result in results), (name, results)
        options = case.strategy
        pp, tp = options.get("pipeline_parallel_size", 1), options.get("tensor_parallel_size", 1)
        with torch.device("meta"):
            shape = ModelShape(MODELS[case.model](learning_rate=1e-3, warmup_steps=2))
        # ZeRO shards over the data- and context-parallel ranks together
        stages = shape.rank_parameters(pp=pp, tp=tp, dp=4 // (pp * tp))
        planned = [sharded if options.get("zero_stage", 3) >= 2 else whole for whole, sharded in stages]
        held = sorted(result.gradient_elements for result in results)
        assert held == sorted(planned * (4 // pp)), name


class LlamaCheckingItsInput(Llama):
    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        if tokens.max() >= self.config.vocab_size:  # a branch on values, which fake tensors do not hold
            raise ValueError("token id out of range")
        return super().forward(tokens)


def test_activations_are_measured_per_block_or_counted_as_korthikanti_counts_them() -> None:
    # Llama: 80 bytes per token and hidden unit at fp32 (Korthikanti et al. count 68 for a GPT block).
    llama = ModelShape(meta_llama("tiny"))
    assert [round(per_block / 64, 1) for per_block in llama.activation_bytes_per_token(64)] == [80.4] * 4
    assert llama.activation_bytes_per_token(8192) == llama.activation_bytes_per_token(64)  # SDPA: linear
    with torch.device("meta"):
        branching = ModelShape(LlamaCheckingItsInput("tiny"))
    with pytest.warns(UserWarning, match=r"LlamaCheckingItsInput cannot run on fake tensors .* 34 bytes per token"):
        assert branching.activation_bytes_per_token(64) == [68 * 64] * 4


def saved_by_blocks(model: torch.nn.Module, blocks: torch.nn.ModuleList, tokens: int) -> int:
    """Bytes the blocks save for backward on one real sequence of ``tokens``: each storage once, weights left out."""
    weights = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved: dict[int, int] = {}
    inside = [False]

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        if inside[0] and storage.data_ptr() not in weights:
            saved[storage.data_ptr()] = storage.nbytes()
        return tensor

    for block in blocks:
        block.register_forward_pre_hook(lambda *_: inside.__setitem__(0, True))
        block.register_forward_hook(lambda *_: inside.__setitem__(0, False))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        model(torch.randint(0, 64, (1, tokens)))
    return sum(saved.values())


def test_attention_written_by_hand_is_planned_with_scores_that_grow_with_the_square_of_the_sequence() -> None:
    # Hugging Face's "eager" attention saves each head's scores and probabilities, T x T: measured at 60 and 30
    # tokens, planned at any length. SDPA saves what grows with T only.
    planned, measured = {}, {}
    for attention in ("eager", "sdpa"):
        config = transformers.LlamaConfig(
            vocab_size=64, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4
        )
        config._attn_implementation = attention
        model = transformers.LlamaForCausalLM(config)
        planned[attention] = sum(ModelShape(model).activation_bytes_per_token(1024)) * 1024
        measured[attention] = saved_by_blocks(model, model.model.layers, 1024)
    assert planned == measured
    assert planned["eager"] > 4 * planned["sdpa"]


def test_each_zero_stage_shards_what_the_paper_says() -> None:
    shape, cluster = ModelShape(meta_llama("8b")), Cluster(gpus=8)
    training = Training(seq_len=2048, global_batch=64, micro_batch=2)  # 4 microbatches of 2 on each of 8 ranks
    psi = shape.parameters
    stages = [
        estimate(shape, Layout(pp=1, dp=8, tp=1, zero_stage=zero, microbatches=4), training, cluster)
        for zero in range(4)
    ]
    assert [stage.optimizer / psi for stage in stages] == pytest.approx([8, 1, 1, 1], rel=1e-3)
    assert [stage.grads / psi for stage in stages] == pytest.approx([4, 4, 0.5, 0.5], rel=1e-3)
    # fp32 master weights, whole or sharded, and the bf16 copy FSDP2 gathers to compute with (its replicate too);
    # ZeRO-3 keeps only the root's embeddings, norm and head gathered, the blocks gathered one at a time.
    assert [stage.params / psi for stage in stages[:3]] == pytest.approx([4 + 2, 4 + 2, 0.5 + 2], rel=1e-3)
    (outside,) = shape.root_parameters(pp=1, tp=1)
    assert stages[3].params == pytest.approx(4 * psi / 8 + 2 * outside, rel=1e-3)
    assert stages[0].activations == stages[3].activations
    assert stages[0].step_s < stages[3].step_s  # ZeRO-3 gathers the weights again for every microbatch


def test_replicas_hold_a_node_s_shard_and_send_only_gradient_shards_between_nodes() -> None:
    """ZeRO-3 over 64 data-parallel ranks on 8 nodes, and in 8 replicas of a node each (HSDP): a replica's rank holds
    an 8th of the model's state rather than a 64th, and its step is shorter, the weights gathered inside the node."""
    shape, cluster = ModelShape(meta_llama("8b")), Cluster(gpus=64)
    training = Training(seq_len=4096, global_batch=64)
    psi = shape.parameters
    across, within = (
        estimate(shape, Layout(pp=1, dp=64, tp=1, zero_stage=3, replicas=replicas), training, cluster)
        for replicas in (1, 8)
    )
    assert across.optimizer / psi == pytest.approx(8 / 64, rel=1e-3)
    assert within.optimizer / psi == pytest.approx(8 / 8, rel=1e-3)
    assert within.grads / psi == pytest.approx(4 / 8, rel=1e-3)
    assert within.step_s < across.step_s
    # the search offers it where ZeRO's ranks span nodes
    assert any(plan.layout.replicas == 8 for plan in plan_layouts(shape, training, cluster))
    assert not Layout(pp=1, dp=6, tp=1, zero_stage=3, replicas=4).divides_evenly()


def test_plan_recommends_a_layout_for_70b_on_64_gpus(capsys: pytest.CaptureFixture) -> None:
    main(["plan", *LLAMA_70B, "--gpus", "64", "--gpu-memory", "80"])
    header, columns, *rows, load, recommendation = capsys.readouterr().out.splitlines()
    assert header == (
        "Llama, 70.6B parameters, on 64 GPUs (8 per node, 80 GiB each): 256 x 4096 tokens per step, bf16-mixed"
    )
    assert columns.split() == ["layout", "params", "grads", "optim", "activ", "total", "fits", "step", "s"]
    table = {" ".join(row.split()[:-7]): row.split()[-7:] for row in rows}  # layout: GiB x 5, fits, step s
    fits = [columns[5] for columns in table.values()]
    assert fits == sorted(fits, reverse=True)  # the layouts that fit first, fastest first
    best, (*_, total, fits_best, step) = next(iter(table.items()))
    assert recommendation.startswith(f"Recommended: {best}: the shortest estimated step ({step} s) of the ")
    assert float(total) <= 80 and fits_best == "yes"
    # Starting from a checkpoint costs each rank's host 64 MiB at a time, where from_pretrained holds 70.6B x 2 bytes.
    assert load.startswith("Starting from pretrained weights (pretrained=): host memory per rank about 64 MiB, ")
    assert load.endswith("from_pretrained on every rank holds 131.4 GiB per rank, 1051 GiB a node.")
    # 32 data-parallel ranks without tensor parallelism hold half of the 70B model's 16-bit weights each: too much.
    assert table["pp=2 x dp=32 x tp=1, ZeRO-2, full ckpt, 8 microbatches"][5] == "no"


def test_plan_says_by_how_much_nothing_fits_and_what_would(capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["plan", *LLAMA_70B, "--gpus", "8", "--gpu-memory", "24"])
    assert exit_info.value.code == 1
    verdict = capsys.readouterr().out.splitlines()[-1]
    assert verdict.startswith("Nothing fits: the leanest layout, pp=1 x dp=2 x tp=4, ZeRO-3, full ckpt, ")
    needed = float(verdict.split("needs ")[1].split(" GiB")[0])
    assert needed > 16 * 70.6e9 / 8 / GiB  # weights, gradients and Adam's moments alone, split 8 ways
    assert f"{needed - 24:.1f} GiB more than 24. It fits on 64 GPUs: " in verdict


def test_plan_splits_sequences_where_they_do_not_fit_otherwise(capsys: pytest.CaptureFixture) -> None:
    main(["plan", *LLAMA_8B, "--gpus", "8", "--seq-len", "131072", "--global-batch", "8"])
    *_, recommendation = capsys.readouterr().out.splitlines()
    # 131072 tokens' activations do not fit one GPU's 80 GiB, even recomputed: each sequence goes over 4 GPUs.
    assert recommendation.startswith("Recommended: pp=1 x dp=2 x cp=4 x tp=1, ZeRO-3, full ckpt: ")
    main(["plan", *LLAMA_8B, "--gpus", "8", "--seq-len", "4096", "--global-batch", "8"])
    assert " cp=" not in capsys.readouterr().out  # short sequences fit without: no split pays its ring


def test_context_parallel_time_is_the_all_to_all_where_the_heads_divide_else_the_ring() -> None:
    """Two models alike but for their heads: 16 divide among 4 context-parallel ranks (all-to-all: 8 x 3/4 of a
    rank's activations a block), 2 do not (the ring: keys and values passed on 3 times forward and backward, 18)."""
    training, cluster = Training(seq_len=32768, global_batch=2), Cluster(gpus=8)
    layout = Layout(pp=1, dp=2, tp=1, cp=4)
    step = {}
    for heads in (16, 2):
        with torch.device("meta"):
            shape = ModelShape(Llama("small", config={"n_heads": heads, "n_kv_heads": heads}))
        step[shape.context_parallel_method(tp=1, cp=4)] = estimate(shape, layout, training, cluster).step_s
    width = 32768 / 4 * 512 * 2  # bytes of a rank's activations at the model's width, bf16
    per_block = (18 - 6) * width / (cluster.intra_node_gbps * 1e9)
    assert step["ring"] - step["all_to_all"] == pytest.approx(8 * per_block)


def test_plan_names_what_no_split_of_the_cluster_can_satisfy(capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["plan", *LLAMA_70B, "--gpus", "3", "--global-batch", "2"])
    assert exit_info.value.code == 2
    assert "No split of 3 GPUs into pp x dp x tp suits Llama" in capsys.readouterr().err


class PeakResidentMemory(Callback):
    """The most memory the process held during each training step, as the kernel counts it: the high-water mark of
    its resident set, reset as the step starts (Linux's ``/proc/self/clear_refs``)."""

    def __init__(self) -> None:
        self.peaks: list[int] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        Path("/proc/self/clear_refs").write_text("5")

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.peaks.append(resident_bytes("VmHWM"))


def resident_bytes(field: str) -> int:
    (line,) = (line for line in Path("/proc/self/status").read_text().splitlines() if line.startswith(field))
    return int(line.split()[1]) * 1024


SEQ_LEN, BATCH = 128, 4  # per data-parallel rank
SMALL_4_LAYERS = {"n_layers": 4, "vocab_size": 8192}  # Llama "small"'s width, quick to train on 2 cores
MEMORY_LAYOUTS = {  # on 4 CPU ranks, fp32
    "pp2_tp2_loss_parallel": dict(pipeline_parallel_size=2, tensor_parallel_size=2, microbatches=4, loss_parallel=True),
    "pp2_dp2_zero2": dict(pipeline_parallel_size=2, zero_stage=2, microbatches=4),
    "dp4_zero3_full_checkpointing": dict(zero_stage=3, activation_checkpointing="full"),
}


def peak_memory_per_layout(layouts: list[dict]) -> list[int]:
    """Bytes each layout's second training step added to what the process held before the model was built (the
    first step also pays for one-time set-up). A first run of the tiny model loads the code every layout runs."""
    peaks = []
    for steps, options, model in [(1, layouts[0], Llama("tiny")), *((2, options, None) for options in layouts)]:
        seed_everything(1)
        gc.collect()
        before = resident_bytes("VmRSS")
        measure = PeakResidentMemory()
        trainer = Trainer(
            accelerator="cpu",
            devices=4,
            strategy=ParallelStrategy(**options),
            max_steps=steps,
            precision="32-true",
            callbacks=[measure],
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
        )
        data = TokenDataModule(seq_len=SEQ_LEN, batch_size=BATCH, synthetic_tokens=1 << 16)
        trainer.fit(model or Llama("small", config=SMALL_4_LAYERS), datamodule=data)
        peaks.append(measure.peaks[-1] - before)
    return peaks[1:]


@pytest.mark.multirank
def test_memory_estimate_is_within_15_percent_of_what_cpu_ranks_use(monkeypatch: pytest.MonkeyPatch) -> None:
    # Freed tensors go back to the kernel at once (glibc keeps small blocks only), so resident memory follows them.
    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", "65536")
    measured = run_ranks(4, peak_memory_per_layout, list(MEMORY_LAYOUTS.values()), fresh=True)
    with torch.device("meta"):
        shape = ModelShape(Llama("small", config=SMALL_4_LAYERS))
    for (name, options), per_rank in zip(MEMORY_LAYOUTS.items(), zip(*measured, strict=True), strict=True):
        pp, tp = options.get("pipeline_parallel_size", 1), options.get("tensor_parallel_size", 1)
        dp, microbatches = 4 // (pp * tp), options.get("microbatches", 1)
        layout = Layout(
            pp,
            dp,
            tp,
            options.get("zero_stage", 3),
            options.get("activation_checkpointing"),
            microbatches,
            options.get("loss_parallel", False),
        )
        training = Training(SEQ_LEN, BATCH * dp, BATCH // microbatches, precision="32-true")
        planned = estimate(shape, layout, training, Cluster(4, memory_gib=64)).total
        assert planned == pytest.approx(max(per_rank), rel=0.15), name


def test_a_mixture_of_experts_counts_active_parameters_and_splits_its_experts_over_ep(
    capsys: pytest.CaptureFixture,
) -> None:
    with torch.device("meta"):
        model = MoELlama("8x7b")
    shape = ModelShape(model)
    # Mixtral 8x7B's published sizes: 46.7B parameters, 12.9B of them run per token (2 experts of 8).
    assert (round(shape.parameters / 1e9, 1), round(shape.active_parameters / 1e9, 1)) == (46.7, 12.9)
    embedding = model.model.embed_tokens.weight.numel()  # a lookup, not a matmul
    assert shape.flops.matmul_params == shape.active_parameters - embedding  # MFU counts the experts a token runs
    experts = sum(p.numel() for name, p in model.named_parameters() if ".experts." in name)
    # Under ep=4 each rank keeps 2 experts of 8, sharded over the 2 ranks of 8 that hold the same ones.
    ((whole, _),) = shape.rank_parameters(pp=1, tp=1, dp=8)
    ((whole_ep, sharded_ep),) = shape.rank_parameters(pp=1, tp=1, dp=8, ep=4)
    assert whole - whole_ep == experts * 3 / 4
    assert sharded_ep == pytest.approx((whole - experts) / 8 + experts / 4 / 2, rel=1e-4)
    # Tensor parallelism splits attention; the MoE blocks run whole on every tensor-parallel rank.
    ((whole_tp, _),) = shape.rank_parameters(pp=1, tp=2, dp=8)
    assert experts < whole_tp < whole

    main(["plan", "--model", "lightdist.models.MoELlama", "--init-args", '{"preset": "8x7b"}', "--gpus", "16"])
    main(
        [
            "plan",
            "--model",
            "lightdist.models.MoELlama",
            "--init-args",
            '{"preset": "8x7b"}',
            "--gpus",
            "16",
            "--ep",
            "4",
        ]
    )
    without, with_ep = (table.splitlines() for table in capsys.readouterr().out.split("MoELlama, ")[1:])
    assert with_ep[0].startswith("46.7B parameters (12.9B active per token), on 16 GPUs")
    rows = [row.split(",")[0:2] for row in with_ep[2:-2]]  # between the column names and the pretrained load
    assert rows and all(experts == " ep=4" for _, experts in rows)
    assert all(int(layout.split("dp=")[1].split()[0]) % 4 == 0 for layout, _ in rows)
    assert all(", ep=" not in row for row in without)
    # The same layout with its experts split over 4 ranks: a quarter of their weights and Adam state on each rank.
    layout = Layout(pp=1, dp=16, tp=1, zero_stage=0, activation_checkpointing="full", microbatches=16)
    plain, split = (estimate(shape, dataclasses.replace(layout, ep=ep), Training(), Cluster(gpus=16)) for ep in (1, 4))
    assert plain.optimizer - split.optimizer == pytest.approx(8 * experts * 3 / 4)
