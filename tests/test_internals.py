"""Private names of torch, Lightning and the other packages lightdist builds on are reached through lightdist's two
internals modules only (``lightdist/torch_internals.py``, ``plugins/lightning_internals.py``), and behave there as
lightdist relies on: an upgrade that renames or changes one fails here, naming it, not in a user's run."""

from __future__ import annotations

import ast
import importlib
import inspect
import pkgutil
from datetime import timedelta
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.overrides import TorchFunctionMode
from torchmetrics import MeanMetric

from lightdist import torch_internals
from lightdist.parallel.sharding import optimizers_for_layout
from lightdist.parallelize import materialize
from lightdist.plugins import lightning_internals
from lightdist.plugins.lightning_internals import (
    checkpoint_now,
    data_source,
    give_device_mesh,
    metric_forward_cache,
    restore_after_setup,
    set_metric_progress,
    skip_lightning_backward,
)
from lightdist.plugins.pipeline_step import batch_on_device, optimizer_steps_after
from lightdist.torch_internals import (
    entered_beneath,
    is_view,
    set_group_timeout,
    torch_function_modes,
)

REPO = Path(__file__).parents[1]
INTERNALS = {REPO / "lightdist/torch_internals.py", REPO / "plugins/lightning_internals.py"}
OTHER_PACKAGES = {"torch", "lightning", "lightning_utilities", "torchmetrics", "transformers", "fsspec", "wandb", "ray"}
# Private by name, documented by their owner: Python's sys module documents _current_frames.
DOCUMENTED = {"_current_frames"}
SUBCLASS_PRIVATES = {**torch_internals.SUBCLASS_PRIVATES, **lightning_internals.SUBCLASS_PRIVATES}


def _private(name: str) -> bool:
    return name.startswith("_") and not name.endswith("__")


def _sources(*folders: str) -> list[Path]:
    return sorted(path for folder in folders for path in (REPO / folder).rglob("*.py"))


def _own_private_names() -> set[str]:
    """The private names lightdist's own code and tests define: functions, classes, attributes, variables."""
    names = set()
    for path in _sources("lightdist", "plugins", "models", "tests", "examples", "bench"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                names.add(node.name)
            elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
                # Set on self, or named as lightdist's own: setting another object's private attribute is a use.
                on_self = isinstance(node.value, ast.Name) and node.value.id in ("self", "cls")
                if on_self or node.attr.startswith("_lightdist"):
                    names.add(node.attr)
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                names.add(node.id)
            elif isinstance(node, ast.arg):
                names.add(node.arg)
    return {name for name in names if _private(name)}


def private_uses(path: Path, own: set[str]) -> list[str]:
    """Where ``path`` imports a private name or module of another package, or reads a private attribute that is
    not lightdist's own off anything but ``self``."""
    uses = []
    for node in ast.walk(ast.parse(path.read_text())):
        where = f"{path.relative_to(REPO)}:{getattr(node, 'lineno', 0)}"
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] in OTHER_PACKAGES:
            names = [node.module] if any(map(_private, node.module.split("."))) else []
            uses += [f"{where} {n}" for n in names + [a.name for a in node.names if _private(a.name)]]
        elif isinstance(node, ast.Import):
            uses += [f"{where} {a.name}" for a in node.names if any(map(_private, a.name.split(".")))]
        elif isinstance(node, ast.Attribute) and _private(node.attr) and node.attr not in own | DOCUMENTED:
            on_self = isinstance(node.value, ast.Name) and node.value.id in ("self", "cls")
            on_super = isinstance(node.value, ast.Call) and getattr(node.value.func, "id", "") == "super"
            if not on_self and not on_super:
                uses.append(f"{where} .{node.attr}")
        elif isinstance(node, ast.Call) and getattr(node.func, "id", "") in (
            "getattr",
            "setattr",
            "hasattr",
            "delattr",
        ):
            key = node.args[1] if len(node.args) > 1 else None
            if isinstance(key, ast.Constant) and isinstance(key.value, str) and _private(key.value):
                uses += [f"{where} {key.value}"] if key.value not in own else []
    return uses


def test_private_names_of_other_packages_go_through_the_internals_modules_only() -> None:
    own = _own_private_names()
    outside = [
        use
        for path in _sources("lightdist", "plugins", "models")
        if path not in INTERNALS
        for use in private_uses(path, own)
    ]
    assert outside == [], "private names of other packages outside the internals modules:\n" + "\n".join(outside)


def test_lightdist_relies_on_twenty_private_names_or_fewer() -> None:
    """Each private name is a place an upgrade can break lightdist: their number is held down, not let grow."""
    own = _own_private_names()
    used = {use.split()[-1].lstrip(".") for path in sorted(INTERNALS) for use in private_uses(path, own)}
    assert len(used) <= 20, f"{len(used)} private names of other packages: {sorted(used)}"


def test_a_private_attribute_lightdist_sets_on_another_packages_object_counts_as_a_use() -> None:
    own = _own_private_names()
    internals = [use.split()[-1] for path in sorted(INTERNALS) for use in private_uses(path, own)]
    assert {"._skip_backward", "._device_mesh", "._update_count"} <= set(internals)  # set on Lightning's objects
    assert "_lightdist_row_order" in own  # set on a module, named as lightdist's own


def _lightdist_classes() -> list[type]:
    import lightdist.models
    import lightdist.plugins

    modules = [
        importlib.import_module(info.name)
        for package in (lightdist, lightdist.plugins, lightdist.models)
        for info in pkgutil.walk_packages(package.__path__, f"{package.__name__}.")
        if not info.name.endswith("__main__")  # runs the CLI
    ]
    return [
        cls
        for module in modules
        for _, cls in inspect.getmembers(module, inspect.isclass)
        if cls.__module__ == module.__name__
    ]


def _privates_defined_by(cls: type) -> set[str]:
    """The private members ``cls`` defines: methods, class attributes, and what its code assigns to ``self``."""
    names = {name for name in vars(cls) if _private(name)}
    try:
        source = inspect.getsource(cls)
    except (OSError, TypeError):
        return names
    return names | {
        name for name in _private_self_names(source) if f"self.{name} =" in source or f"self.{name}:" in source
    }


def _private_self_names(source: str) -> set[str]:
    tree = ast.parse(inspect.cleandoc("\n" + source) if source[:1].isspace() else source)
    names = {node.name for node in ast.walk(tree) if isinstance(node, ast.FunctionDef)}
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"):
            names.add(node.attr)
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Call):
            names.add(node.attr)  # super()._name
    return {name for name in names if _private(name)}


def test_private_members_that_subclasses_use_of_other_packages_classes_are_declared_with_a_reason() -> None:
    undeclared = []
    for cls in _lightdist_classes():
        theirs = [base for base in cls.__mro__ if base.__module__.split(".")[0] in OTHER_PACKAGES]
        if not theirs:
            continue
        inherited = set().union(*(_privates_defined_by(base) for base in theirs))
        used = _private_self_names(inspect.getsource(cls)) & inherited
        undeclared += [f"{cls.__module__}.{cls.__qualname__}: {name}" for name in sorted(used - set(SUBCLASS_PRIVATES))]
    assert undeclared == [], "declare these in SUBCLASS_PRIVATES, with why:\n" + "\n".join(undeclared)


def test_declared_private_members_still_exist_where_lightdist_uses_them() -> None:
    from lightning.pytorch.callbacks import ModelCheckpoint
    from lightning.pytorch.loggers import WandbLogger
    from lightning.pytorch.strategies import ModelParallelStrategy
    from torch.distributed.pipelining import PipelineStage
    from torch.distributed.tensor.parallel import ParallelStyle

    owners = {
        "_configure_launcher": ModelParallelStrategy,
        "_apply": ParallelStyle,
        "_to_tensor": PipelineStage,  # torch 2.11 has none: it learns a stage's shapes on zeros
        "_wandb_init": WandbLogger(offline=True),  # made in __init__; no run starts until it logs
    }
    checkpoint = ModelCheckpoint()
    for name in SUBCLASS_PRIVATES:
        owner = owners.get(name, checkpoint)
        assert hasattr(owner, name) or (name == "_to_tensor" and torch.__version__ < "2.13"), (
            f"{owner} has no {name} any more"
        )


class _Recorder(pl.LightningModule):
    """Records, from inside its own steps, what the Lightning internals lightdist reads say, and what lightdist's own
    readings of the loop's public state say beside them."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(2, 1)
        self.steps_after: list[bool] = []
        self.transferred = 0

    def transfer_batch_to_device(self, batch, device, dataloader_idx):
        self.transferred += 1
        return super().transfer_batch_to_device(batch, device, dataloader_idx)

    def on_train_start(self) -> None:
        self.loader = data_source(self.trainer.fit_loop).dataloader()
        self.moved = batch_on_device(self, torch.ones(2), torch.device("cpu"))
        skip_lightning_backward(self.trainer, True)
        self.initial = self.layer.weight.detach().clone()

    def training_step(self, batch, batch_idx):
        self.steps_after.append(optimizer_steps_after(self.trainer, batch_idx))
        return self.layer(batch).sum()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=1.0)


def test_lightning_internals_behave_as_lightdist_relies_on() -> None:
    module, loader = _Recorder(), torch.utils.data.DataLoader(torch.ones(3, 2), batch_size=1)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=1,
        max_epochs=1,
        accumulate_grad_batches=2,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(module, loader)
    assert module.steps_after == [False, True, True]  # the second of two accumulated batches, and the epoch's last
    assert module.loader is loader
    assert module.transferred == 4 and torch.equal(module.moved, torch.ones(2))  # three batches, and ours
    assert torch.equal(module.layer.weight, module.initial)  # no backward ran: the optimizer had no gradients


class _Restores(pl.Callback):
    """Hands ``fit`` a checkpoint to restore as the strategy's setup does for a replica group that joins; keeps the
    checkpoint of the run as it ends."""

    def __init__(self, checkpoint: dict | None = None) -> None:
        self.checkpoint = checkpoint

    def setup(self, trainer, pl_module, stage) -> None:
        if self.checkpoint is not None:
            restore_after_setup(trainer, self.checkpoint)

    def on_train_end(self, trainer, pl_module) -> None:
        self.checkpoint = checkpoint_now(trainer)


def test_a_checkpoint_taken_in_memory_resumes_fit_without_a_ckpt_path() -> None:
    def fit(steps: int, restores: _Restores) -> _Recorder:
        module = _Recorder()
        trainer = pl.Trainer(
            accelerator="cpu",
            devices=1,
            max_steps=steps,
            callbacks=[restores],
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
        )
        trainer.fit(module, torch.utils.data.DataLoader(torch.ones(8, 2), batch_size=1))
        return module

    first = _Restores()
    fit(2, first)
    assert first.checkpoint["global_step"] == 2 and "loops" in first.checkpoint
    resumed = fit(3, _Restores(first.checkpoint))
    assert len(resumed.steps_after) == 1  # steps 0 and 1 were the first run's: the loop resumed at step 2


def test_torchmetrics_internals_behave_as_lightdist_relies_on() -> None:
    metric = MeanMetric()
    metric(torch.tensor(4.0))
    assert metric_forward_cache(metric) == 4.0
    set_metric_progress(metric, 5, torch.tensor(2.0))
    assert metric.update_count == 5 and metric_forward_cache(metric) == 2.0


def test_torch_internals_behave_as_lightdist_relies_on(tmp_path: Path) -> None:
    tensor = torch.ones(4, 4)
    assert is_view(tensor[0]) and not is_view(tensor)
    with TorchFunctionMode() as outer, TorchFunctionMode() as inner:
        assert torch_function_modes()[-2:] == [outer, inner]
        beneath = TorchFunctionMode()
        with entered_beneath(beneath):
            assert torch_function_modes()[-3:] == [beneath, outer, inner]
        assert torch_function_modes()[-2:] == [outer, inner]
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,), mesh_dim_names=("dp",))
        set_group_timeout(mesh.get_group(), timedelta(seconds=7))
        module = _Recorder()
        give_device_mesh(module, mesh)
        assert module.device_mesh is mesh
    finally:
        dist.destroy_process_group()


class _Unresettable(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(3))


def test_a_model_built_on_meta_is_allocated_and_initialized_by_its_modules_reset_parameters() -> None:
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(3, 3), _Unresettable())
    with pytest.warns(UserWarning, match=r"_Unresettable built on the meta device have no reset_parameters\(\)"):
        materialize(model, torch.device("cpu"))
    linear = model[0]
    assert linear.weight.device.type == "cpu" and 0 < linear.weight.abs().max() <= 3**-0.5  # nn.Linear's own init
    materialize(model, torch.device("meta"))  # nothing on meta any more: left as it is
    assert linear.weight.device.type == "cpu"


def test_restored_optimizer_states_move_to_the_device_and_their_step_counts_stay() -> None:
    weight = nn.Parameter(torch.ones(2, device="meta"))
    optimizer = torch.optim.AdamW([weight])
    optimizer.state[weight] = {"step": torch.tensor(3.0), "exp_avg": torch.zeros(2), "exp_avg_sq": torch.zeros(2)}
    assert optimizers_for_layout([optimizer], None, torch.device("meta")) == [optimizer]
    state = optimizer.state[weight]
    assert state["exp_avg"].is_meta and state["exp_avg_sq"].is_meta and state["step"].device.type == "cpu"
