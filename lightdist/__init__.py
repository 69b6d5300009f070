"""lightdist: tensor, pipeline and ZeRO/FSDP parallelism for any LightningModule LLM, by one strategy flag.

``import lightdist`` does not load Lightning; its strategy names (``lightdist``, ``lightdist_zero3``, ...) are
registered with Lightning as Lightning loads, before or after lightdist, so they work in ``Trainer(strategy=...)``
and in LightningCLI configs. ``lightdist.ParallelStrategy`` is ``lightdist.plugins.ParallelStrategy``.
"""

from typing import Any

from lightdist.layout import ParallelLayout
from lightdist.quiet import silence_known_noise
from lightdist.registration import register_with_lightning

__all__ = ["ParallelLayout", "ParallelStrategy"]
__version__ = "0.1.0"

register_with_lightning()
silence_known_noise()


def __getattr__(name: str) -> Any:
    if name == "ParallelStrategy":
        from lightdist.plugins import ParallelStrategy

        return ParallelStrategy
    raise AttributeError(f"module 'lightdist' has no attribute {name!r}")
