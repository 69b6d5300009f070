"""``lightdist export``: one sharded checkpoint, whatever layout saved it, as weights that load into the plain model.

    lightdist export s3://bucket/run/last.ckpt model.safetensors
    lightdist export s3://bucket/run/last.ckpt model.pt --dtype bfloat16
    lightdist export s3://bucket/run/last.ckpt llama-hf/        # a Hugging Face model: from_pretrained("llama-hf")

The checkpoint's shards (ZeRO, tensor-parallel and pipeline alike) are read into one process by DCP, which keys them
by the LightningModule's own names, so the result is what ``module.state_dict()`` would give on one device. It is
built whole in CPU memory: export on a machine with room for the model's weights.
"""

from __future__ import annotations

import argparse
import posixpath
import tempfile
import warnings
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from fsspec.core import url_to_fs
from fsspec.implementations.local import LocalFileSystem
from safetensors.torch import save as safetensors_bytes
from torch import Tensor

from lightdist.checkpoint.storage import read_metadata, reader, resolve, saved_model_tensors

__all__ = ["consolidate", "export", "main"]

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def consolidate(checkpoint_url: str, dtype: torch.dtype | None = None) -> dict[str, Tensor]:
    """The model's full state dict, keyed as the LightningModule's, from the checkpoint ``checkpoint_url`` is or
    points to. Floating-point tensors are cast to ``dtype`` where given."""
    return _read_weights(resolve(checkpoint_url), dtype)


def export(checkpoint_url: str, out: str, dtype: torch.dtype | None = None) -> None:
    """Write the weights of the checkpoint that ``checkpoint_url`` is or points to, to ``out`` (any fsspec URL).

    ``out`` ending in ``.safetensors`` or ``.pt`` is one file keyed as the LightningModule's ``state_dict``;
    anything else is a directory for a Hugging Face model, written with ``save_pretrained``, for checkpoints of
    ``lightdist.models.HuggingFaceCausalLM``.
    """
    suffix = posixpath.splitext(out)[1]
    url = resolve(checkpoint_url)
    if suffix not in (".safetensors", ".pt", ".pth"):
        _save_pretrained(_huggingface_config(url, out), _read_weights(url, dtype), out)
        return
    weights = _read_weights(url, dtype)
    fs, path = url_to_fs(out)
    fs.makedirs(posixpath.dirname(path), exist_ok=True)
    with fs.open(path, "wb") as file:
        if suffix == ".safetensors":
            # safetensors refuses tensors that share memory; tied weights arrive from DCP as separate tensors.
            file.write(safetensors_bytes(weights, metadata={"format": "pt"}))
        else:
            torch.save(weights, file)


def _read_weights(url: str, dtype: torch.dtype | None) -> dict[str, Tensor]:
    """The checkpoint's model tensors, whole: allocated from the sizes its index records, then filled by DCP."""
    weights = {
        name: torch.empty(entry.size, dtype=entry.properties.dtype) for name, entry in saved_model_tensors(url).items()
    }
    with warnings.catch_warnings():  # DCP warns that it loads in one process, which is what export asks for
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load({"state_dict": weights}, storage_reader=reader(url), no_dist=True)
    if dtype is not None:
        weights = {name: t.to(dtype) if t.is_floating_point() else t for name, t in weights.items()}
    return weights


def _huggingface_config(url: str, out: str) -> Any:
    """The ``transformers`` config of the checkpoint's model, read before its weights so another model fails fast."""
    from lightdist.models.huggingface import pretrained_config

    try:
        return pretrained_config(read_metadata(url).get("hyper_parameters", {}))
    except ValueError as error:
        raise ValueError(
            f"{out} is not a .safetensors or .pt file, so export would write a Hugging Face model directory there, but "
            f"the checkpoint at {url} is not one of lightdist.models.HuggingFaceCausalLM: {error} Export to a "
            ".safetensors or .pt file instead."
        ) from None


def _save_pretrained(config: Any, weights: dict[str, Tensor], out: str) -> None:
    """Hugging Face's own ``save_pretrained`` (tied weights, sharding, config), from a model built on the meta device
    so that no second copy of the weights is allocated."""
    from transformers import AutoModelForCausalLM

    from lightdist.models.huggingface import STATE_DICT_PREFIX

    weights = {name.removeprefix(STATE_DICT_PREFIX): tensor for name, tensor in weights.items()}
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    fs, path = url_to_fs(out)
    if isinstance(fs, LocalFileSystem):
        model.save_pretrained(path, state_dict=weights)
        return
    with tempfile.TemporaryDirectory() as local:
        model.save_pretrained(local, state_dict=weights)
        fs.put(local, path, recursive=True)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="lightdist export",
        description="Consolidate a lightdist sharded checkpoint into weights for the plain model: a .safetensors or "
        ".pt file, or a Hugging Face model directory.",
    )
    parser.add_argument("checkpoint", help="the checkpoint directory, or a pointer to one such as .../last.ckpt")
    parser.add_argument("out", help="model.safetensors, model.pt, or a directory for a Hugging Face model")
    parser.add_argument("--dtype", choices=sorted(_DTYPES), help="cast floating-point weights (default: as saved)")
    args = parser.parse_args(argv)
    try:
        export(args.checkpoint, args.out, _DTYPES.get(args.dtype))
    except (ValueError, FileNotFoundError) as error:
        parser.exit(2, f"lightdist export: error: {error}\n")
    print(f"lightdist export: wrote {args.out}")
