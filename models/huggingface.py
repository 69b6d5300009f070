"""Any Hugging Face causal LM as a LightningModule, built offline from a config or a local checkpoint.

Nothing is downloaded: ``config`` builds a randomly initialised model (``model_type`` picks the family), and
``pretrained`` loads weights from a local directory only.
"""

from __future__ import annotations

from torch import Tensor

from lightdist.models.lm import CausalLM

__all__ = ["HuggingFaceCausalLM"]


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
        try:
            from transformers import AutoConfig, AutoModelForCausalLM
        except ImportError as error:
            raise ImportError("HuggingFaceCausalLM needs transformers: pip install 'lightdist[hf]'.") from error
        if (config is None) == (pretrained is None):
            raise ValueError("Pass exactly one of config (a random model) or pretrained (a local directory).")
        if pretrained is not None:
            self.model = AutoModelForCausalLM.from_pretrained(pretrained, local_files_only=True)
        else:
            options = dict(config)
            self.model = AutoModelForCausalLM.from_config(AutoConfig.for_model(options.pop("model_type"), **options))

    def forward(self, tokens: Tensor) -> Tensor:
        return self.model(input_ids=tokens).logits
