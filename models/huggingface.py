"""Any Hugging Face causal LM as a LightningModule, built offline from a config or a local checkpoint.

Nothing is downloaded: ``config`` builds a randomly initialised model (``model_type`` picks the family), and
``pretrained`` loads weights from a local directory only.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from torch import Tensor

from lightdist.models.lm import CausalLM

__all__ = ["STATE_DICT_PREFIX", "HuggingFaceCausalLM", "pretrained_config"]

STATE_DICT_PREFIX = "model."  # the LightningModule's names for the weights of its transformers model, ``self.model``


class HuggingFaceCausalLM(CausalLM):
    """A ``transformers`` ``AutoModelForCausalLM`` trained with the reference models' loop.

    Args:
        config: Keyword arguments of the family's config, with ``model_type`` (e.g. ``{"model_type": "llama",
            "hidden_size": 64, ...}``); the model starts from random weights.
        pretrained: A local directory saved with ``save_pretrained``; used instead of ``config``.
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
            raise ValueError("Pass exactly one of config (a random model) or pretrained (a local directory).")
        transformers = _transformers()
        if pretrained is not None:
            self.model = transformers.AutoModelForCausalLM.from_pretrained(pretrained, local_files_only=True)
        else:
            self.model = transformers.AutoModelForCausalLM.from_config(pretrained_config(self.hparams))

    def forward(self, tokens: Tensor) -> Tensor:
        return self.model(input_ids=tokens).logits


def pretrained_config(hyperparameters: Mapping[str, Any]) -> Any:
    """The ``transformers`` config of the model that a ``HuggingFaceCausalLM`` with these hyperparameters holds:
    what a checkpoint's saved hyperparameters need to rebuild it, for export."""
    transformers = _transformers()
    if hyperparameters.get("pretrained") is not None:
        return transformers.AutoConfig.from_pretrained(hyperparameters["pretrained"], local_files_only=True)
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
