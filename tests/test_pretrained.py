"""Pretrained Hugging Face weights read straight into any layout: each rank reads only its shards' bytes, from local
disk or object storage, and holds what ``from_pretrained`` in one process holds."""

from __future__ import annotations

import gc
import json
import os
import statistics
import struct
import threading
import time
from functools import cache
from pathlib import Path

import litgpt
import psutil
import pytest
import requests
import torch
import torch.nn.functional as F
import transformers
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.callbacks import ModelCheckpoint as LightningModelCheckpoint
from litgpt.scripts.convert_hf_checkpoint import copy_weights_hf_llama
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.utils.data import DataLoader

from lightdist.models import HuggingFaceCausalLM
from lightdist.parallel.sharding import local_tensor
from lightdist.plugins import ParallelStrategy
from lightdist.pretrained import PretrainedWeights
from lightdist.verify import ShardedOrder

from multirank import raised, run_ranks
from zoo import HF_TINY, HF_TINY_GPT2

FAMILIES = {
    "llama": dict(HF_TINY, model_type="llama", num_key_value_heads=2),
    "qwen2": dict(HF_TINY, model_type="qwen2", num_key_value_heads=2),
    # q, k and v fused in qkv_proj, gate and up in gate_up_proj: reordered for tensor parallelism as they are read
    "phi3": dict(HF_TINY, model_type="phi3", num_key_value_heads=2, pad_token_id=0),
    # Conv1D, q, k and v fused in c_attn, the head tied to the embedding (saved once)
    "gpt2": HF_TINY_GPT2,
    # experts stacked in one tensor per layer in the model, saved one tensor per expert (transformers' conversion)
    "mixtral": dict(HF_TINY, model_type="mixtral", num_key_value_heads=2, num_local_experts=4),
    # 0.14B parameters, 0.53 GiB in fp32: big enough that each rank's share of it shows in its resident memory
    "llama_0.14b": dict(
        model_type="llama",
        vocab_size=32000,
        hidden_size=1024,
        intermediate_size=2816,
        num_hidden_layers=6,
        num_attention_heads=8,
        num_key_value_heads=8,
    ),
}


def save_checkpoint(directory: Path, family: str) -> Path:
    """A randomly initialised model of ``family`` saved as people download them: safetensors in several shards with
    their index."""
    torch.manual_seed(0)
    options = dict(FAMILIES[family])
    config = transformers.AutoConfig.for_model(options.pop("model_type"), **options)
    model = transformers.AutoModelForCausalLM.from_config(config)
    model.save_pretrained(directory / family, max_shard_size="100KB")
    return directory / family


def from_pretrained(directory: Path) -> dict[str, torch.Tensor]:
    """What one process's ``from_pretrained`` holds, by the LightningModule's names."""
    model = transformers.AutoModelForCausalLM.from_pretrained(directory, local_files_only=True)
    return {f"model.{name}": tensor for name, tensor in model.state_dict().items()}


# A LitGPT GPT started from a Hugging Face Llama checkpoint: q, k and v, saved apart, concatenated into its qkv.
LITGPT_FROM_LLAMA = {
    r"model\.embed_tokens\.weight": "transformer.wte.weight",
    r"model\.layers\.(\d+)\.input_layernorm\.weight": r"transformer.h.\1.norm_1.weight",
    r"model\.layers\.(\d+)\.self_attn\.q_proj\.weight": r"transformer.h.\1.attn.qkv.weight",
    r"model\.layers\.(\d+)\.self_attn\.k_proj\.weight": r"transformer.h.\1.attn.qkv.weight",
    r"model\.layers\.(\d+)\.self_attn\.v_proj\.weight": r"transformer.h.\1.attn.qkv.weight",
    r"model\.layers\.(\d+)\.self_attn\.o_proj\.weight": r"transformer.h.\1.attn.proj.weight",
    r"model\.layers\.(\d+)\.post_attention_layernorm\.weight": r"transformer.h.\1.norm_2.weight",
    r"model\.layers\.(\d+)\.mlp\.gate_proj\.weight": r"transformer.h.\1.mlp.fc_1.weight",
    r"model\.layers\.(\d+)\.mlp\.up_proj\.weight": r"transformer.h.\1.mlp.fc_2.weight",
    r"model\.layers\.(\d+)\.mlp\.down_proj\.weight": r"transformer.h.\1.mlp.proj.weight",
    r"model\.norm\.weight": "transformer.ln_f.weight",
}


def litgpt_config(checkpoint: str) -> litgpt.Config:
    """The LitGPT config of a Hugging Face Llama's."""
    hf = transformers.AutoConfig.from_pretrained(checkpoint, local_files_only=True)
    return litgpt.Config(
        block_size=64,
        vocab_size=hf.vocab_size,
        padded_vocab_size=hf.vocab_size,
        n_layer=hf.num_hidden_layers,
        n_head=hf.num_attention_heads,
        n_query_groups=hf.num_key_value_heads,
        n_embd=hf.hidden_size,
        intermediate_size=hf.intermediate_size,
        rotary_percentage=1.0,
        parallel_residual=False,
        bias=False,
        norm_class_name="RMSNorm",
        norm_eps=hf.rms_norm_eps,
        mlp_class_name="LLaMAMLP",
        rope_base=int(hf.rope_parameters["rope_theta"]),
    )


def litgpt_from_pretrained(directory: Path) -> dict[str, torch.Tensor]:
    """What LitGPT's own conversion of the checkpoint holds, by the LightningModule's names."""
    hf_weights = {name.removeprefix("model."): tensor for name, tensor in from_pretrained(directory).items()}
    converted: dict[str, torch.Tensor] = {}
    copy_weights_hf_llama(litgpt_config(str(directory)), {}, converted, hf_weights)
    return {f"model.{name}": tensor for name, tensor in converted.items()}


class LitGPTFineTuning(LightningModule):
    """A user's LitGPT model, named by ``ParallelStrategy(pretrained=PretrainedWeights(..., key_map=...))``."""

    def __init__(self, checkpoint: str) -> None:
        super().__init__()
        self.model = litgpt.GPT(litgpt_config(checkpoint))

    def validation_step(self, batch: torch.Tensor, batch_idx: int) -> None:
        logits = self.model(batch[:, :-1])
        self.log("val_loss", F.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten()), sync_dist=True)


def windows() -> DataLoader:
    return DataLoader(torch.randint(0, 64, (8, 17), generator=torch.Generator().manual_seed(0)), batch_size=4)


class OwnFineTuning(LightningModule):
    """A user's module: a Hugging Face model built from its config as their code builds it, named by nothing but
    ``ParallelStrategy(pretrained=..., pretrained_prefix="model")``."""

    def __init__(self, checkpoint: str) -> None:
        super().__init__()
        config = transformers.AutoConfig.from_pretrained(checkpoint, local_files_only=True)
        self.model = transformers.AutoModelForCausalLM.from_config(config)

    def validation_step(self, batch: torch.Tensor, batch_idx: int) -> None:
        self.log("val_loss", self.model(input_ids=batch, labels=batch).loss, sync_dist=True)


def module_of(kind: str, checkpoint: str, trainer: Trainer) -> LightningModule:
    """``"wrapper"``: lightdist's ``HuggingFaceCausalLM(pretrained=...)``; ``"own"``: ``OwnFineTuning``, built on a
    device; ``"own_on_meta"``: built under ``trainer.init_module(empty_init=True)``, its rotary tables on meta too;
    ``"litgpt"``: ``LitGPTFineTuning``."""
    if kind == "wrapper":
        return HuggingFaceCausalLM(pretrained=checkpoint)
    if kind == "own":
        return OwnFineTuning(checkpoint)
    if kind == "litgpt":
        return LitGPTFineTuning(checkpoint)
    with trainer.init_module(empty_init=True):
        return OwnFineTuning(checkpoint)


def filled(cases: list[tuple[str, str, dict]], devices: int) -> list[tuple[dict[str, torch.Tensor], int, bool, float]]:
    """For each kind of module (``module_of``), checkpoint URL and layout: the weights the module holds once the
    strategy filled it (this rank's pipeline stage's), the bytes this rank read, whether it is in train mode, and
    the validation loss."""
    results = []
    for kind, url, options in cases:
        if kind == "litgpt":
            options = dict(options, pretrained=PretrainedWeights(url, prefix="model", key_map=LITGPT_FROM_LLAMA))
        elif kind != "wrapper":
            options = dict(options, pretrained=url, pretrained_prefix="model")
        strategy = ParallelStrategy(**options)
        trainer = Trainer(
            accelerator="cpu",
            devices=devices,
            strategy=strategy,
            logger=False,
            enable_progress_bar=False,
            enable_model_summary=False,
        )
        module = module_of(kind, url, trainer)
        (validated,) = trainer.validate(module, windows(), verbose=False)
        state = get_model_state_dict(module, options=StateDictOptions(full_state_dict=True))
        weights = {name: tensor.detach().cpu().clone() for name, tensor in state.items()}
        results.append((weights, strategy.pretrained_load.bytes_read, module.model.training, validated["val_loss"]))
    return results


def single_process_val_loss(kind: str, checkpoint: Path) -> float:
    """The validation loss of ``from_pretrained``'s Hugging Face model in one process (LitGPT's: the same model)."""
    trainer = Trainer(accelerator="cpu", devices=1, logger=False, enable_progress_bar=False)
    module = HuggingFaceCausalLM(pretrained=str(checkpoint)) if kind == "wrapper" else OwnFineTuning(str(checkpoint))
    if kind != "wrapper":
        module.load_state_dict(from_pretrained(checkpoint))
    (validated,) = trainer.validate(module, windows(), verbose=False)
    return validated["val_loss"]


def checkpoint_bytes(directory: Path) -> tuple[int, int]:
    """The bytes of a checkpoint's tensors, and of everything else a reader reads: headers and the index."""
    tensors = other = 0
    for file in directory.glob("*.safetensors"):
        with file.open("rb") as stream:
            (header,) = struct.unpack("<Q", stream.read(8))
        tensors += file.stat().st_size - 8 - header
        other += 8 + header
    return tensors, other + (directory / "model.safetensors.index.json").stat().st_size


LAYOUTS_2 = {
    "llama_zero3": ("wrapper", "llama", dict(zero_stage=3)),
    "phi3_tp2_fused_projections": ("wrapper", "phi3", dict(tensor_parallel_size=2)),
    "gpt2_tp2_conv1d_fused_qkv_tied": ("wrapper", "gpt2", dict(tensor_parallel_size=2, sequence_parallel=False)),
    "qwen2_pp2": ("wrapper", "qwen2", dict(pipeline_parallel_size=2)),
    "gpt2_pp2_head_tied_across_stages": ("wrapper", "gpt2", dict(pipeline_parallel_size=2)),
    "own_module_qwen2_zero3": ("own", "qwen2", dict(zero_stage=3)),
    "own_module_on_meta_llama_tp2": ("own_on_meta", "llama", dict(tensor_parallel_size=2)),
    "mixtral_ep2_experts_saved_apart": ("wrapper", "mixtral", dict(expert_parallel_size=2)),
    "litgpt_zero3_key_map_fuses_qkv": ("litgpt", "llama", dict(zero_stage=3)),
}
LAYOUTS_4 = {
    "llama_pp2_tp2": ("wrapper", "llama", dict(pipeline_parallel_size=2, tensor_parallel_size=2)),
    "phi3_tp2_dp2_zero3": ("wrapper", "phi3", dict(tensor_parallel_size=2, zero_stage=3)),
    "own_module_on_meta_gpt2_pp2_dp2": ("own_on_meta", "gpt2", dict(pipeline_parallel_size=2)),
    "own_module_mixtral_pp2_ep2": ("own", "mixtral", dict(pipeline_parallel_size=2, expert_parallel_size=2)),
    "litgpt_pp2_tp2": ("litgpt", "llama", dict(pipeline_parallel_size=2, tensor_parallel_size=2)),
}
LAYOUTS_8 = {
    "llama_3d_zero3": ("wrapper", "llama", dict(pipeline_parallel_size=2, tensor_parallel_size=2, zero_stage=3)),
    # OwnFineTuning calls its model on whole windows of 17 tokens, which sequence parallelism cannot halve
    "own_module_mixtral_pp2_tp2_ep2": (
        "own",
        "mixtral",
        dict(pipeline_parallel_size=2, tensor_parallel_size=2, expert_parallel_size=2, sequence_parallel=False),
    ),
}
LAYOUTS = {2: LAYOUTS_2, 4: LAYOUTS_4, 8: LAYOUTS_8}


@cache
def filled_from_local(directory: Path, devices: int) -> tuple[dict[str, tuple], dict[str, Path]]:
    """Every layout of ``devices`` ranks filled in one group of ranks: the weights (all stages'), each rank's bytes
    read, whether all were in train mode and the validation loss, by layout; and the checkpoints, by family."""
    layouts = LAYOUTS[devices]
    checkpoints = {family: save_checkpoint(directory / str(devices), family) for _, family, _ in layouts.values()}
    cases = [(kind, str(checkpoints[family]), options) for kind, family, options in layouts.values()]
    ranks = run_ranks(devices, filled, cases, devices, timeout=600)
    results = {}
    for index, name in enumerate(layouts):
        weights = {}
        for rank in ranks:
            weights.update(rank[index][0])
        read, in_train_mode = [rank[index][1] for rank in ranks], all(rank[index][2] for rank in ranks)
        results[name] = (weights, read, in_train_mode, ranks[0][index][3])
    return results, checkpoints


@pytest.fixture(scope="module")
def checkpoints_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("pretrained")


@pytest.mark.multirank
@pytest.mark.parametrize(("devices", "name"), [(devices, name) for devices in LAYOUTS for name in LAYOUTS[devices]])
def test_each_layout_holds_what_from_pretrained_holds(checkpoints_dir: Path, devices: int, name: str) -> None:
    results, checkpoints = filled_from_local(checkpoints_dir, devices)
    weights, _, in_train_mode, val_loss = results[name]
    kind, family, _ = LAYOUTS[devices][name]
    expected = (litgpt_from_pretrained if kind == "litgpt" else from_pretrained)(checkpoints[family])
    assert weights.keys() == expected.keys()
    for key, tensor in expected.items():
        torch.testing.assert_close(weights[key], tensor, rtol=0, atol=0, msg=key)
    assert in_train_mode
    # ... and computes what one process computes with them: buffers no checkpoint holds (rotary tables) included
    assert val_loss == pytest.approx(single_process_val_loss(kind, checkpoints[family]), rel=1e-5)


@pytest.mark.multirank
@pytest.mark.parametrize(("name", "family"), [("llama_zero3", "llama"), ("mixtral_ep2_experts_saved_apart", "mixtral")])
def test_each_rank_reads_its_half_of_the_bytes(checkpoints_dir: Path, name: str, family: str) -> None:
    """Under ZeRO-3 each rank reads its half of every tensor; under ep=2 its half of the experts, each saved apart."""
    results, checkpoints = filled_from_local(checkpoints_dir, 2)
    _, bytes_read, _, _ = results[name]
    tensors, other = checkpoint_bytes(checkpoints[family])
    for read in bytes_read:
        assert read <= tensors / 2 + other
    assert sum(bytes_read) >= tensors  # and between them, all of it


@pytest.mark.multirank
def test_weights_come_from_s3_and_gcs(tmp_path: Path, s3_bucket, gcs_bucket) -> None:
    checkpoint = save_checkpoint(tmp_path, "gpt2")
    urls = []
    for bucket, storage in (s3_bucket, gcs_bucket):
        storage.put(str(checkpoint), f"{bucket.split('://')[1]}/gpt2", recursive=True)
        urls.append(f"{bucket}/gpt2")
    cases = [("wrapper", url, dict(zero_stage=3)) for url in urls]
    expected = from_pretrained(checkpoint)
    for weights, *_ in run_ranks(2, filled, cases, 2, timeout=600)[0]:
        for key, tensor in expected.items():
            torch.testing.assert_close(weights[key], tensor, rtol=0, atol=0, msg=key)


def test_without_lightdist_the_module_reads_the_whole_model_in_configure_model(tmp_path: Path) -> None:
    """Plain Lightning, one process: the same wrapper, the same weights, in train mode."""
    checkpoint = save_checkpoint(tmp_path, "gpt2")
    module = HuggingFaceCausalLM(pretrained=str(checkpoint))
    assert all(parameter.is_meta for parameter in module.parameters())  # nothing allocated before the trainer
    trainer = Trainer(accelerator="cpu", devices=1, limit_val_batches=1, logger=False, enable_progress_bar=False)
    trainer.validate(module, windows(), verbose=False)
    for key, tensor in from_pretrained(checkpoint).items():
        torch.testing.assert_close(module.state_dict()[key], tensor, rtol=0, atol=0, msg=key)
    assert module.model.training


def test_a_checkpoint_of_another_config_is_refused_naming_the_weight_and_both_shapes(tmp_path: Path) -> None:
    checkpoint = save_checkpoint(tmp_path, "llama")
    config = json.loads((checkpoint / "config.json").read_text())
    (checkpoint / "config.json").write_text(json.dumps(dict(config, intermediate_size=128)))
    trainer = Trainer(accelerator="cpu", devices=1, limit_val_batches=1, logger=False, enable_progress_bar=False)
    with pytest.raises(
        ValueError, match=r"model.model.layers.0.mlp.gate_proj.weight has shape \(128, 64\) in the model"
    ):
        trainer.validate(HuggingFaceCausalLM(pretrained=str(checkpoint)), windows(), verbose=False)


def test_a_missing_shard_and_a_truncated_one_are_named(tmp_path: Path) -> None:
    checkpoint = save_checkpoint(tmp_path, "llama")
    shards = sorted(checkpoint.glob("*.safetensors"))
    shards[0].unlink()
    trainer = Trainer(accelerator="cpu", devices=1, limit_val_batches=1, logger=False, enable_progress_bar=False)
    with pytest.raises(FileNotFoundError, match=rf"names {shards[0].name}, which is missing"):
        trainer.validate(HuggingFaceCausalLM(pretrained=str(checkpoint)), windows(), verbose=False)
    save_checkpoint(tmp_path, "llama")
    shards[1].write_bytes(shards[1].read_bytes()[:-100])
    with pytest.raises(ValueError, match=rf"{shards[1].name} in .* is truncated"):
        trainer.validate(HuggingFaceCausalLM(pretrained=str(checkpoint)), windows(), verbose=False)


class PeakResident(Callback):
    """The most resident memory this process held from its creation until validation starts (the model built,
    split and filled), sampled every millisecond."""

    def __init__(self) -> None:
        self.process, self.peak, self.sampling = psutil.Process(), 0, True
        self.sampler = threading.Thread(target=self._sample, daemon=True)
        self.sampler.start()

    def _sample(self) -> None:
        while self.sampling:
            self.peak = max(self.peak, self.process.memory_info().rss)
            time.sleep(0.001)

    def on_validation_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self.sampling = False
        self.sampler.join()


def resident_growth(url: str, options: dict, devices: int) -> int:
    """How far this rank's resident memory rose from before ``HuggingFaceCausalLM(pretrained=url)`` was built until
    the strategy had filled it."""
    trainer = Trainer(accelerator="cpu", devices=devices, strategy=ParallelStrategy(**options), logger=False)
    gc.collect()
    before = psutil.Process().memory_info().rss
    peak = PeakResident()
    trainer.callbacks.append(peak)
    trainer.validate(HuggingFaceCausalLM(pretrained=url), windows(), verbose=False)
    return peak.peak - before


@pytest.mark.multirank
@pytest.mark.parametrize("layout", ["zero3", "tp2"])
def test_each_ranks_memory_falls_with_the_ranks(tmp_path: Path, layout: str) -> None:
    """Each rank's resident memory grows by at most 1.25 x its share of the model plus one whole tensor (the
    embedding), where ``from_pretrained`` on every rank holds the whole model: the build takes no memory, and reads
    are at most 64 MiB at a time. Under tensor parallelism, plus what the layout probe ran before the model was
    materialized: one block's attention and MLP, unsplit and split, each with its gradients, freed but kept resident
    by the allocator; one block's, whatever the model's depth."""
    checkpoint = save_checkpoint(tmp_path, "llama_0.14b")
    tensors, _ = checkpoint_bytes(checkpoint)
    largest = 32000 * 1024 * 4
    block = 4 * 1024 * 1024 + 3 * 1024 * 2816
    probe = 4 * block * 4 if layout == "tp2" else 0
    options = dict(zero_stage=3) if layout == "zero3" else dict(tensor_parallel_size=2)
    grown = {}
    for devices in (2, 4):
        grown[devices] = run_ranks(devices, resident_growth, str(checkpoint), options, devices, timeout=600)
        for growth in grown[devices]:
            assert growth <= 1.25 * tensors / devices + largest + probe, (devices, options, growth / 2**20)
    # Compared at the median rank: how much of the probe's freed memory the allocator keeps varies from rank to rank
    # (a clean-clone run saw one of 4 ranks at 474 MiB, over the 2-rank maximum of 464).
    assert statistics.median(grown[4]) < statistics.median(grown[2])


class TrainLosses(Callback):
    """Each training step's loss, as Lightning logs it (over the data-parallel ranks)."""

    def __init__(self) -> None:
        self.losses: list[float] = []

    def on_train_batch_end(self, trainer: Trainer, *args: object) -> None:
        self.losses.append(trainer.callback_metrics["train_loss"].item())


def trained_losses(url: str, layouts: list[dict], devices: int, sampled_as_ranks: int = 0) -> list[list[float]]:
    """For each layout, the loss of each of 3 training steps of ``HuggingFaceCausalLM(pretrained=url)`` on batches of
    4 windows a data-parallel rank; on one device, under plain Lightning, drawing the global batches that
    ``sampled_as_ranks`` data-parallel ranks' shuffling samplers deal. A validation after training must keep the
    trained weights, not read the pretrained ones again."""
    results = []
    for options in layouts:
        losses = TrainLosses()
        trainer = Trainer(
            accelerator="cpu",
            devices=devices,
            strategy=ParallelStrategy(**options) if devices > 1 else "auto",
            max_steps=3,
            callbacks=[losses],
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
        )
        data = windows()
        if sampled_as_ranks:
            order = ShardedOrder(data.dataset, sampled_as_ranks, data.batch_size, shuffle=True)
            data = DataLoader(data.dataset, batch_sampler=order)
        module = HuggingFaceCausalLM(pretrained=url, learning_rate=1e-2, warmup_steps=1)
        trainer.fit(module, data)
        trained = [local_tensor(p).clone() for p in module.parameters()]
        trainer.validate(module, windows(), verbose=False)
        assert all(torch.equal(local_tensor(p), t) for p, t in zip(module.parameters(), trained, strict=True)), options
        results.append(losses.losses)
    return results


@pytest.mark.multirank
def test_a_model_started_from_pretrained_trains_as_from_pretrained_does_in_one_process(tmp_path: Path) -> None:
    checkpoint = str(save_checkpoint(tmp_path, "qwen2"))
    layouts = [dict(zero_stage=3), dict(tensor_parallel_size=2), dict(pipeline_parallel_size=2)]
    trained = run_ranks(2, trained_losses, checkpoint, layouts, 2)[0]
    for options, losses in zip(layouts, trained, strict=True):
        dp = 2 if options.get("zero_stage") else 1
        (expected,) = trained_losses(checkpoint, [{}], 1, sampled_as_ranks=dp)
        assert losses == pytest.approx(expected, rel=1e-5), options


def train_refuse_and_resume(checkpoint: str, other_config: str, run: str, devices: int) -> tuple[str, int, bool]:
    """Under ZeRO-3: what a checkpoint of another config raises; then two steps from ``checkpoint`` saving to
    ``run``, the checkpoint's weights deleted, and a resume to step 4: its global step, and whether it read any."""
    refused = raised(
        Trainer(accelerator="cpu", devices=devices, strategy=ParallelStrategy(zero_stage=3), logger=False).validate,
        HuggingFaceCausalLM(pretrained=other_config),
        windows(),
    )

    def fit(steps: int, ckpt_path: str | None) -> Trainer:
        saving = LightningModelCheckpoint(dirpath=run, every_n_train_steps=2, save_last=True)
        trainer = Trainer(
            accelerator="cpu",
            devices=devices,
            strategy=ParallelStrategy(zero_stage=3),
            max_steps=steps,
            callbacks=[saving],
            logger=False,
            enable_progress_bar=False,
        )
        trainer.fit(HuggingFaceCausalLM(pretrained=checkpoint), windows(), ckpt_path=ckpt_path)
        return trainer

    fit(2, None).strategy.barrier()
    if int(os.environ["RANK"]) == 0:  # the weights gone, the config (what the module is built from) kept
        for weights in Path(checkpoint).glob("model*.safetensors*"):
            weights.unlink()
    resumed = fit(4, "last")
    return refused, resumed.global_step, resumed.strategy.pretrained_load is not None


@pytest.mark.multirank
def test_a_bad_checkpoint_is_refused_before_training_and_a_resume_never_reads_the_weights(tmp_path: Path) -> None:
    checkpoint = save_checkpoint(tmp_path, "llama")
    other = save_checkpoint(tmp_path / "other", "llama")
    config = json.loads((other / "config.json").read_text())
    (other / "config.json").write_text(json.dumps(dict(config, intermediate_size=128)))
    refused, step, read = run_ranks(2, train_refuse_and_resume, str(checkpoint), str(other), str(tmp_path / "run"), 2)[
        0
    ]
    assert "model.model.layers.0.mlp.gate_proj.weight has shape (128, 64) in the model and (176, 64)" in refused
    assert (step, read) == (4, False)


def test_a_key_map_joining_tensors_that_do_not_join_is_refused_naming_them(tmp_path: Path) -> None:
    checkpoint = str(save_checkpoint(tmp_path, "llama"))
    norm_into_qkv = {r"model\.layers\.(\d+)\.input_layernorm\.weight": r"transformer.h.\1.attn.qkv.weight"}
    weights = PretrainedWeights(checkpoint, prefix="model", key_map=LITGPT_FROM_LLAMA | norm_into_qkv)
    trainer = Trainer(accelerator="cpu", devices=1, strategy=ParallelStrategy(pretrained=weights), logger=False)
    with pytest.raises(ValueError, match=r"transformer.h.0.attn.qkv.weight is joined along dimension 0 from .*\(64,\)"):
        trainer.validate(LitGPTFineTuning(checkpoint), windows(), verbose=False)


class WithValueHead(OwnFineTuning):
    """A model the checkpoint holds, and a head it does not."""

    def __init__(self, checkpoint: str) -> None:
        super().__init__(checkpoint)
        self.value_head = torch.nn.Linear(self.model.config.hidden_size, 1)


def test_a_new_head_is_refused_unless_listed_as_new_and_then_keeps_its_initialisation(tmp_path: Path) -> None:
    checkpoint = str(save_checkpoint(tmp_path, "qwen2"))

    def start(new: tuple[str, ...]) -> tuple[ParallelStrategy, WithValueHead]:
        strategy = ParallelStrategy(pretrained=PretrainedWeights(checkpoint, prefix="model", new=new))
        torch.manual_seed(1)
        module = WithValueHead(checkpoint)
        trainer = Trainer(accelerator="cpu", devices=1, strategy=strategy, logger=False)
        trainer.validate(module, windows(), verbose=False)
        return strategy, module

    with pytest.raises(ValueError, match=r"lacks 2 of the model's weights: value_head.weight, value_head.bias"):
        start(())
    strategy, module = start(("value_head.weight", "value_head.bias"))
    assert "initialised, not in it: value_head.weight, value_head.bias" in strategy.pretrained_load.summary()
    held = get_model_state_dict(module, options=StateDictOptions(full_state_dict=True))
    torch.manual_seed(1)
    torch.testing.assert_close(held["value_head.weight"], WithValueHead(checkpoint).value_head.weight)
    for key, tensor in from_pretrained(Path(checkpoint)).items():
        torch.testing.assert_close(held[key], tensor, rtol=0, atol=0, msg=key)


def test_weights_these_credentials_may_not_read_are_refused_naming_the_fix(
    tmp_path: Path, s3_endpoint: str, s3_bucket
) -> None:
    bucket, storage = s3_bucket
    checkpoint = save_checkpoint(tmp_path, "qwen2")
    storage.put(str(checkpoint), f"{bucket.split('://')[1]}/qwen2", recursive=True)
    requests.post(f"{s3_endpoint}/moto-api/reset-auth", data=b"0", timeout=10)  # moto now checks every request's keys
    endpoint = {"s3": {"endpoint_url": s3_endpoint}}  # over what an earlier test in this process configured
    strategy = ParallelStrategy(pretrained=f"{bucket}/qwen2", pretrained_prefix="model", storage_options=endpoint)
    trainer = Trainer(accelerator="cpu", devices=1, strategy=strategy, logger=False)
    with pytest.raises(ValueError, match=rf"cannot read the pretrained weights at {bucket}/qwen2: .*read access"):
        trainer.validate(OwnFineTuning(str(checkpoint)), windows(), verbose=False)
    with pytest.raises(ValueError, match=rf"cannot read the pretrained model's config.json at {bucket}/qwen2: .*read"):
        HuggingFaceCausalLM(pretrained=f"{bucket}/qwen2")
