"""A process's random state, in a form that checkpoints can hold and ``torch.load(weights_only=True)`` can read.

Lightning's checkpoints hold no random state, so a resumed run draws other dropout masks than an uninterrupted one.
NumPy's state is an array inside a tuple, which the weights-only unpickler refuses; here it becomes a list of ints.
"""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch

__all__ = ["rng_state", "set_rng_state"]


def rng_state(device: torch.device) -> dict[str, Any]:
    """The state of Python's, NumPy's and torch's generators, and of ``device``'s if it is a GPU."""
    kind, keys, position, has_gauss, cached_gaussian = np.random.get_state()
    state = {
        "python": random.getstate(),
        "numpy": [kind, keys.tolist(), position, has_gauss, cached_gaussian],
        "torch": torch.get_rng_state(),
    }
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def set_rng_state(state: dict[str, Any], device: torch.device) -> None:
    """Put back a state from ``rng_state``."""
    version, internal, gauss_next = state["python"]
    random.setstate((version, tuple(internal), gauss_next))
    kind, keys, position, has_gauss, cached_gaussian = state["numpy"]
    np.random.set_state((kind, np.array(keys, dtype=np.uint32), position, has_gauss, cached_gaussian))
    torch.set_rng_state(state["torch"])
    if device.type == "cuda" and "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"], device)
