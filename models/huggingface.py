"""Any Hugging Face causal LM as a LightningModule, built offline from a config or from a checkpoint at any URL.

``config`` builds a randomly initialised model (``model_type`` picks the family). ``pretrained`` names a
``save_pretrained`` directory, a path or any fsspec URL (``s3://``, ``gs://``): the model is built with its parameters
on the meta device and filled once split, each rank reading only its own shards' bytes
(``lightdist.checkpoint.pretrained``); under any other strategy, whole in ``configure_model``.
"""

from __future__ import annotations

import json
import posixpath
from collections.abc import Mapping
from typing import Any

from fsspec.core import url_to_fs
from torch import Tensor

from lightdist.checkpoint.pretrained import PretrainedWeights, load_pretrained, parameters_on_meta
from lightdist.checkpoint.storage import storage_fix
from lightdist.models.lm import CausalLM
from lightdist.parallelize import materialize

__all__ = ["STATE_DICT_PREFIX", "HuggingFaceCausalLM", "pretrained_config"]

STATE_DICT_PREFIX = "model."  # the LightningModule's names for the weights of its transformers model, ``self.model``


class HuggingFaceCausalLM(CausalLM):
    """A ``transformers`` ``AutoModelForCausalLM`` trained with the reference models' loop.

    Args:
        config: Keyword arguments of the family's config, with ``model_type`` (e.g. ``{"model_type": "llama",
            "hidden_size": 64, ...}``); the model starts from random weights.
        pretrained: A directory saved with ``save_pretrained``, a path or any fsspec URL; used instead of ``config``.
    """

    def __init__(
        self,
        config: dict | None = None,
        pretrained: str | None = None,
        learning_rate: float = 3e-4,
        weight_decay: float = 0.1,
        warmup_steps: int = 20,
    ) -> None:
        super().__init__(learning_rate=learning_rate, weight_decay=weight_decay, warmup_steps=warmup_steps)
        self.save_hyperparameters()
        if (config is None) == (pretrained is None):
            raise ValueError("Pass exactly one of config (a random model) or pretrained (a checkpoint directory).")
        transformers = _transformers()
        self.pretrained_weights = PretrainedWeights(pretrained, prefix=STATE_DICT_PREFIX) if pretrained else None
        if pretrained is not None:
            with parameters_on_meta():
                self.model = transformers.AutoModelForCausalLM.from_config(pretrained_config(self.hparams))
        else:
            self.model = transformers.AutoModelForCausalLM.from_config(pretrained_config(self.hparams))

    def configure_model(self) -> None:
        """Under a strategy other than lightdist's, which fills the model once split: the whole model, read here."""
        from lightdist.plugins import ParallelStrategy

        weights, on_meta = self.pretrained_weights, any(parameter.is_meta for parameter in self.parameters())
        if weights is None or not on_meta or isinstance(self.trainer.strategy, ParallelStrategy):
            return
        materialize(self.model, self.device, filled_after=lambda name: weights.fills(STATE_DICT_PREFIX + name))
        load_pretrained(self, weights)

    def forward(self, tokens: Tensor) -> Tensor:
        return self.model(input_ids=tokens).logits


def pretrained_config(hyperparameters: Mapping[str, Any]) -> Any:
    """The ``transformers`` config of the model that a ``HuggingFaceCausalLM`` with these hyperparameters holds:
    what a checkpoint's saved hyperparameters need to rebuild it, for export."""
    transformers = _transformers()
    if (url := hyperparameters.get("pretrained")) is not None:
        fs, path = url_to_fs(url)
        try:
            options = json.loads(fs.cat_file(posixpath.join(path, "config.json")))
        except Exception as error:
            fix = storage_fix(error, url, reading=True)
            raise ValueError(f"lightdist cannot read the pretrained model's config.json at {url}: {fix}") from error
        return transformers.AutoConfig.for_model(options.pop("model_type"), **options)
    options = dict(hyperparameters.get("config") or {})
    if "model_type" not in options:
        raise ValueError("its hyperparameters have neither `pretrained` nor a `config` with a `model_type`.")
    return transformers.AutoConfig.for_model(options.pop("model_type"), **options)


def _transformers() -> Any:
    try:
        import transformers
    except ImportError as error:
        raise ImportError("HuggingFaceCausalLM needs transformers: pip install 'lightdist[hf]'.") from error
    return transformers
