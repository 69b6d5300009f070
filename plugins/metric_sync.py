"""torchmetrics metrics under a parallel layout: each metric's state is reduced over the data-parallel ranks only.

Tensor-parallel peers compute the same values from the same batch, and so do a pipeline's stages once the last stage,
the only one that computes them, has copied its states to the others. Reducing over the whole world, torchmetrics'
default, would count every batch ``tp * pp`` times in a sum or a count.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch.distributed as dist
from lightning_utilities.core.apply_func import apply_to_collection
from torch import Tensor, nn
from torchmetrics import Metric

from lightdist.plugins.lightning_internals import metric_forward_cache, set_metric_progress

__all__ = [
    "MetricStates",
    "load_metric_states",
    "metric_states",
    "metrics_of",
    "metrics_set_aside",
    "reduce_metrics_over",
    "refuse_metrics_on_meta",
]

MetricStates = dict[str, dict[str, Any]]


def metrics_of(module: nn.Module) -> dict[str, Metric]:
    """Every torchmetrics metric in ``module`` by its module path; those inside a ``MetricCollection`` too."""
    return {name: metric for name, metric in module.named_modules() if isinstance(metric, Metric)}


def refuse_metrics_on_meta(module: nn.Module) -> None:
    """Raise if a metric of ``module`` was built on the meta device: its starting values, and the defaults ``reset()``
    returns to, are lost, and no ``reset_parameters`` gives them back."""
    on_meta = [
        f"{name} ({type(metric).__name__})"
        for name, metric in metrics_of(module).items()
        if any(value.is_meta for value in metric.metric_state.values() if isinstance(value, Tensor))
    ]
    if on_meta:
        raise ValueError(
            f"{type(module).__name__}'s metrics {', '.join(on_meta)} were built on the meta device (under "
            "`Trainer.init_module(empty_init=True)` or `torch.device('meta')`), where their starting values are lost. "
            "Build them on a real device inside that context, for example `with torch.device('cpu'): "
            "self.val_loss = MeanMetric()`: lightdist moves them to the model's device."
        )


@contextmanager
def metrics_set_aside(module: nn.Module) -> Iterator[None]:
    """Take ``module``'s metrics out of it for the duration, each left in place. Materializing a model built on the
    meta device calls ``to_empty`` on the whole model, which torchmetrics applies to every metric's states and
    defaults too, though they hold real values: they would read uninitialized memory."""
    outermost: list[str] = []
    for name in metrics_of(module):
        if not any(name.startswith(f"{outer}.") for outer in outermost):
            outermost.append(name)
    aside = []
    for name in outermost:
        owner, _, leaf = name.rpartition(".")
        parent = module.get_submodule(owner)
        aside.append((parent, leaf, getattr(parent, leaf)))
        setattr(parent, leaf, None)  # keeps its place among the children
    try:
        yield
    finally:
        for parent, leaf, metric in aside:
            setattr(parent, leaf, metric)


def reduce_metrics_over(module: nn.Module, group: dist.ProcessGroup) -> None:
    """Make every metric of ``module`` reduce its state over ``group`` when it computes."""
    for metric in metrics_of(module).values():
        metric.process_group = group


def metric_states(metrics: dict[str, Metric]) -> MetricStates:
    """A copy in CPU memory of what each metric has accumulated, for ``load_metric_states`` on this or another rank."""

    def copy(value: Any) -> Any:
        return apply_to_collection(value, Tensor, lambda tensor: tensor.detach().cpu().clone())

    return {
        name: {
            "state": copy(metric.metric_state),
            "update_count": metric.update_count,
            "forward_cache": copy(metric_forward_cache(metric)),
        }
        for name, metric in metrics.items()
    }


def load_metric_states(metrics: dict[str, Metric], states: MetricStates) -> None:
    """Give each metric named in ``states`` the state saved there, as if it had seen the same updates."""
    for name, saved in states.items():
        metric = metrics[name]

        def to_device(value: Any, metric: Metric = metric) -> Any:
            return apply_to_collection(value, Tensor, lambda tensor: tensor.to(metric.device))

        for attribute, value in saved["state"].items():
            setattr(metric, attribute, to_device(value))
        set_metric_progress(metric, saved["update_count"], to_device(saved["forward_cache"]))
