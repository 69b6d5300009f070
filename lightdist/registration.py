"""Lightning learns lightdist's strategy names as it loads, whichever of the two is imported first.

``import lightdist`` does not load Lightning: the core (``lightdist.parallelize`` in a plain training loop,
``lightdist.checkpoint.storage`` in a checkpoint tool) runs without it. Yet ``import lightdist`` followed by
``Trainer(strategy="lightdist_3d")`` must work, and import sorting puts ``lightdist`` before ``lightning``. So where
Lightning is not loaded yet, the import system is asked to load ``lightdist.plugins``, which registers the names, right
after it has loaded ``lightning.pytorch``.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import sys
from importlib.machinery import ModuleSpec
from types import ModuleType
from typing import Any

__all__ = ["register_with_lightning"]

_LIGHTNING = "lightning.pytorch"


def register_with_lightning() -> None:
    """Register the strategy names now if Lightning is loaded, else as soon as it is."""
    if _LIGHTNING in sys.modules:
        import lightdist.plugins  # noqa: F401  (registers the names)
    elif not any(isinstance(finder, _AfterLightning) for finder in sys.meta_path):
        sys.meta_path.insert(0, _AfterLightning())


class _AfterLightning(importlib.abc.MetaPathFinder):
    """Finds ``lightning.pytorch`` as the import system would, and hands back a loader that registers after it."""

    def find_spec(self, name: str, path: Any = None, target: ModuleType | None = None) -> ModuleSpec | None:
        if name != _LIGHTNING:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        if spec is not None and spec.loader is not None:
            spec.loader = _ThenRegister(spec.loader)
        return spec


class _ThenRegister(importlib.abc.Loader):
    def __init__(self, loader: importlib.abc.Loader) -> None:
        self.loader = loader

    def create_module(self, spec: ModuleSpec) -> ModuleType | None:
        return self.loader.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        self.loader.exec_module(module)
        import lightdist.plugins  # noqa: F401  (registers the names)

    def __getattr__(self, name: str) -> Any:  # resources and source, as the loader it wraps has them
        return getattr(self.loader, name)
