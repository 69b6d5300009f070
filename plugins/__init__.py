"""The Lightning face of lightdist: strategies registered by name for ``Trainer(strategy=...)``, the checkpoint
callback and ``CheckpointIO`` for their sharded checkpoints, a W&B logger that goes offline rather than stop a run,
a callback that logs throughput, MFU, memory and the other costs of a run, and one that profiles a few steps."""

from lightning.pytorch.strategies import StrategyRegistry

from lightdist.plugins.checkpoint import ModelCheckpoint
from lightdist.plugins.checkpoint_io import ShardedCheckpointIO
from lightdist.plugins.loggers import WandbLogger
from lightdist.plugins.monitor import TrainingMonitor
from lightdist.plugins.non_finite import NonFiniteError
from lightdist.plugins.profiling import ProfileSteps
from lightdist.plugins.strategy import ParallelStrategy

__all__ = [
    "ModelCheckpoint",
    "NonFiniteError",
    "ParallelStrategy",
    "ProfileSteps",
    "ShardedCheckpointIO",
    "TrainingMonitor",
    "WandbLogger",
]

if "lightdist" not in StrategyRegistry:
    ParallelStrategy.register_strategies(StrategyRegistry)
