"""lightdist: tensor, pipeline and ZeRO/FSDP parallelism for any LightningModule LLM, by one strategy flag.

Importing lightdist registers its strategy names (``lightdist``, ``lightdist_zero3``, ...) with Lightning, so they
work in ``Trainer(strategy=...)`` and in LightningCLI configs.
"""

from lightdist.layout import ParallelLayout
from lightdist.plugins import ParallelStrategy

__all__ = ["ParallelLayout", "ParallelStrategy"]
__version__ = "0.1.0"
