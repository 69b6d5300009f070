"""The Lightning face of lightdist: strategies registered by name for ``Trainer(strategy=...)``, the checkpoint
callback for their sharded checkpoints, and a W&B logger that goes offline rather than stop a run."""

from lightning.pytorch.strategies import StrategyRegistry

from lightdist.plugins.checkpoint import ModelCheckpoint
from lightdist.plugins.loggers import WandbLogger
from lightdist.plugins.strategy import ParallelStrategy

__all__ = ["ModelCheckpoint", "ParallelStrategy", "WandbLogger"]

if "lightdist" not in StrategyRegistry:
    ParallelStrategy.register_strategies(StrategyRegistry)
