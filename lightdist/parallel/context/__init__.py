"""Context parallelism: each sequence split over ranks, attention still over all of it.

The package's one entry point. ``ContextParallel`` (``split.py``) splits a batch's sequences and runs a step under
its mode (``mode.py``), which follows the split through the ops it knows (``sequence_shard.py``, attention by SDPA
in ``attention.py`` or by hand, ``token_means.py`` for means over tokens); ``check.py`` proves a step computes the
same split as whole. The modules stand in layers, each importing only those below: ``sequences.py`` (who holds which
positions), ``attention.py``, the ops, ``mode.py``, ``split.py``, ``check.py``.
"""

from lightdist.parallel.context.attention import ContextParallelMethod, auto_method
from lightdist.parallel.context.check import check_split_step, parameters_of, probe_prefix, tolerance
from lightdist.parallel.context.mode import ContextParallelMode
from lightdist.parallel.context.sequence_shard import unwrapped
from lightdist.parallel.context.sequences import balanced_by_documents, load_balanced_positions
from lightdist.parallel.context.split import ContextParallel, context_parallel_over

__all__ = [
    "ContextParallel",
    "ContextParallelMethod",
    "ContextParallelMode",
    "auto_method",
    "balanced_by_documents",
    "check_split_step",
    "context_parallel_over",
    "load_balanced_positions",
    "parameters_of",
    "probe_prefix",
    "tolerance",
    "unwrapped",
]
