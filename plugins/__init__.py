"""The Lightning face of lightdist: strategies registered by name for ``Trainer(strategy=...)``, and the checkpoint
callback for their sharded checkpoints."""

from lightning.pytorch.strategies import StrategyRegistry

from lightdist.plugins.checkpoint import ModelCheckpoint
from lightdist.plugins.strategy import ParallelStrategy

__all__ = ["ModelCheckpoint", "ParallelStrategy"]

if "lightdist" not in StrategyRegistry:
    ParallelStrategy.register_strategies(StrategyRegistry)
