"""``lightdist export``: a sharded checkpoint, whatever layout saved it, becomes weights for the plain model."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from test_pretrained import filled
from transformers import AutoModelForCausalLM

from lightdist.checkpoint.export import consolidate, export
from lightdist.cli import main

from multirank import run_ranks
from training import MODELS, Case, Result, merge_stages, train

pytestmark = pytest.mark.multirank

SAVED = {
    # GPT-2's fused qkv rows reordered per tensor-parallel rank: exported in the model's own order
    "gpt2_no_bias": Case(strategy=dict(tensor_parallel_size=2), model="gpt2_no_bias", steps=2),
    # embedding and LM head tied, held by two pipeline stages
    "llama_tied": Case(strategy=dict(pipeline_parallel_size=2), model="llama_tied", steps=2),
    # a transformers model with tied embeddings and learned positions, sharded by ZeRO-3
    "hf_opt": Case(strategy=dict(zero_stage=3), model="hf_opt", steps=2),
    # a transformers Mixtral, its 8 experts split 4 and 4 over the ranks by expert parallelism
    "hf_mixtral": Case(strategy=dict(expert_parallel_size=2), model="hf_mixtral", steps=2),
}


def train_and_save_each(cases: dict[str, Case], directory: str) -> dict[str, Result]:
    return {name: train(case, devices=2, save_to=f"{directory}/{name}") for name, case in cases.items()}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, dict[str, torch.Tensor]]]:
    """Each model's sharded checkpoint, and the full weights its run ended with."""
    directory = tmp_path_factory.mktemp("checkpoints")
    per_rank = run_ranks(2, train_and_save_each, SAVED, str(directory))
    trained = merge_stages([list(results.values()) for results in per_rank])
    return directory, {name: result.params for name, result in zip(SAVED, trained, strict=True)}


@pytest.mark.parametrize("model", ["gpt2_no_bias", "llama_tied"])
@pytest.mark.parametrize("file", ["model.safetensors", "model.pt"])
def test_exported_file_loads_into_the_plain_model(tmp_path: Path, checkpoints, model: str, file: str) -> None:
    directory, trained = checkpoints
    export(str(directory / model), str(tmp_path / file))

    weights = load_file(tmp_path / file) if file.endswith(".safetensors") else torch.load(tmp_path / file)
    plain = MODELS[model](learning_rate=1e-3, warmup_steps=2)
    plain.load_state_dict(weights)  # strict: every name the plain model has, and no other
    for name, tensor in plain.state_dict().items():
        torch.testing.assert_close(tensor, trained[model][name], rtol=0, atol=0, msg=name)


def test_consolidated_weights_cast_to_the_dtype_asked_for(checkpoints) -> None:
    directory, trained = checkpoints
    weights = consolidate(str(directory / "llama_tied"), dtype=torch.bfloat16)

    assert {tensor.dtype for tensor in weights.values()} == {torch.bfloat16}
    for name, tensor in weights.items():
        torch.testing.assert_close(tensor, trained["llama_tied"][name].to(torch.bfloat16), rtol=0, atol=0)


def test_hugging_face_model_exports_to_a_directory_that_from_pretrained_loads(tmp_path: Path, checkpoints) -> None:
    directory, trained = checkpoints
    main(["export", str(directory / "hf_opt"), str(tmp_path / "opt-hf")])

    model = AutoModelForCausalLM.from_pretrained(tmp_path / "opt-hf", local_files_only=True)
    assert model.lm_head.weight is model.model.decoder.embed_tokens.weight  # tied again, saved once
    for name, tensor in model.state_dict().items():
        torch.testing.assert_close(tensor, trained["hf_opt"][f"model.{name}"], rtol=0, atol=0, msg=name)


def test_mixture_of_experts_split_over_ranks_exports_every_expert_to_hugging_face(tmp_path: Path, checkpoints) -> None:
    directory, trained = checkpoints
    main(["export", str(directory / "hf_mixtral"), str(tmp_path / "mixtral-hf")])

    model = AutoModelForCausalLM.from_pretrained(tmp_path / "mixtral-hf", local_files_only=True)
    assert model.model.layers[0].mlp.experts.gate_up_proj.shape[0] == 8  # both ranks' 4 experts
    for name, tensor in model.state_dict().items():
        torch.testing.assert_close(tensor, trained["hf_mixtral"][f"model.{name}"], rtol=0, atol=0, msg=name)


def test_export_of_another_model_to_a_directory_says_to_export_a_file(
    tmp_path: Path, checkpoints, capsys: pytest.CaptureFixture
) -> None:
    directory, _ = checkpoints
    with pytest.raises(SystemExit):
        main(["export", str(directory / "llama_tied"), str(tmp_path / "llama")])
    error = capsys.readouterr().err
    assert "not one of lightdist.models.HuggingFaceCausalLM" in error
    assert "Export to a .safetensors or .pt file instead" in error


def test_an_export_starts_a_run_under_another_layout_losslessly(tmp_path: Path, checkpoints) -> None:
    """Exported to a Hugging Face directory, then the pretrained weights of a run split otherwise: OPT saved under
    ZeRO-3, its embedding tied to the head, starts in two pipeline stages."""
    directory, trained = checkpoints
    main(["export", str(directory / "hf_opt"), str(tmp_path / "opt-hf")])
    per_rank = run_ranks(2, filled, [("wrapper", str(tmp_path / "opt-hf"), dict(pipeline_parallel_size=2))], 2)
    weights = {name: tensor for rank in per_rank for name, tensor in rank[0][0].items()}
    assert weights.keys() == trained["hf_opt"].keys()
    for name, tensor in trained["hf_opt"].items():
        torch.testing.assert_close(weights[name], tensor, rtol=0, atol=0, msg=name)
