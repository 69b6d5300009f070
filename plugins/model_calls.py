"""The call a step makes to the model, learned by running the step up to it, and the step run with that call answered.

A pipeline's stages run the model's forward themselves: the step runs first up to its model call, to learn what
enters the first stage, and later, on the last stage, with the call answered by the stages' output.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from lightning.pytorch import LightningModule
from torchmetrics import Metric

from lightdist.parallel.pipeline.structural import ModelCall
from lightdist.plugins.metric_sync import load_metric_states, metric_states
from lightdist.plugins.token_weights import logging_to

__all__ = ["answering_model_calls", "model_call_of"]


class _ModelCalled(Exception):
    def __init__(self, call: ModelCall) -> None:
        super().__init__("the model was called")
        self.call = call


def model_call_of(
    module: LightningModule,
    step: Callable[[Any], Any],
    batch: Any,
    metrics: dict[str, Metric],
    callable_as_model: list[str],
) -> ModelCall:
    """The call ``step`` (the user's step on one batch) makes to the model, learned by running the step up to that
    call: the first call of ``module`` or of a module it holds named in ``callable_as_model`` (``""``: ``module``
    itself). What the step logs or adds to ``metrics`` on the way is dropped."""

    def called_at(path: str) -> Callable[..., None]:
        def called(*args: Any, **kwargs: Any) -> None:
            raise _ModelCalled(ModelCall(path, args, kwargs))

        return called

    with answering_model_calls(module, {path: called_at(path) for path in callable_as_model}, metrics=metrics):
        try:
            step(batch)
        except _ModelCalled as called:
            return called.call
    calls = " or ".join(f"`self.{path}(...)`" if path else "`self(...)`" for path in callable_as_model)
    raise RuntimeError(
        f"{type(module).__name__}'s step never called the model ({calls}), so pipeline parallelism cannot tell what "
        "enters the first stage. Call the model from your step, e.g. `logits = self(x)`."
    )


@contextmanager
def answering_model_calls(
    module: LightningModule,
    answers: dict[str, Callable[..., Any]],
    *,
    log: Callable[..., None] | None = None,
    metrics: dict[str, Metric],
) -> Iterator[None]:
    """Within, a call of the module at each path of ``answers`` (in ``module``; ``""``: ``module`` itself) returns
    its answer, and ``module``'s ``self.log`` calls go to ``log``; with ``log=None`` they and what the step adds to
    ``metrics`` are dropped."""
    saved_metrics = metric_states(metrics) if log is None else None
    answering = [(module.get_submodule(path), answer) for path, answer in answers.items()]
    for called, answer in answering:
        called.forward = answer
    try:
        with logging_to(module, log or (lambda *args, **kwargs: None)):
            yield
    finally:
        for called, _ in answering:
            del called.forward
        if saved_metrics is not None:
            load_metric_states(metrics, saved_metrics)
