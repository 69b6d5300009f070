"""Reference LightningModule LLMs and their data, for demos, tests and benchmarks."""

from lightdist.models.data import TokenDataModule, arithmetic_corpus
from lightdist.models.gpt2 import GPT2, GPT2Config
from lightdist.models.huggingface import HuggingFaceCausalLM
from lightdist.models.llama import Llama, LlamaConfig
from lightdist.models.moe import MoELlama, MoELlamaConfig

__all__ = [
    "GPT2",
    "GPT2Config",
    "HuggingFaceCausalLM",
    "Llama",
    "LlamaConfig",
    "MoELlama",
    "MoELlamaConfig",
    "TokenDataModule",
    "arithmetic_corpus",
]
