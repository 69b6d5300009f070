"""The Lightning face of lightdist: strategies registered by name for ``Trainer(strategy=...)``."""

from lightning.pytorch.strategies import StrategyRegistry

from lightdist.plugins.strategy import ParallelStrategy

__all__ = ["ParallelStrategy"]

if "lightdist" not in StrategyRegistry:
    ParallelStrategy.register_strategies(StrategyRegistry)
