"""The ``lightdist`` command: Lightning's own CLI, with lightdist's strategy names registered, and ``plan``.

``lightdist fit --config configs/zero3_cpu.yaml`` trains; every strategy option can be set from YAML or as
``--trainer.strategy.init_args.zero_stage=2``, and a registered name works as ``--trainer.strategy=lightdist_zero2``.
``lightdist plan --config ...`` shows what tensor parallelism will do to the model, without allocating it.
``lightdist export CKPT OUT`` turns a sharded checkpoint into weights for the plain model (safetensors, torch, or a
Hugging Face model). ``lightdist fit --config ... --launcher ray --num-workers N`` trains on Ray Train's workers.
"""

from __future__ import annotations

import sys

from lightning.pytorch.cli import ArgsType, LightningCLI

import lightdist.plugins  # noqa: F401  (registers the strategy names before the config is parsed)
from lightdist import export, plan

__all__ = ["main"]


def main(args: ArgsType = None) -> None:
    argv = sys.argv[1:] if args is None else list(args)
    if argv[:1] == ["plan"]:
        plan.main(argv[1:])
        return
    if argv[:1] == ["export"]:
        export.main(argv[1:])
        return
    if any(arg == "--launcher" or arg.startswith("--launcher=") for arg in argv):
        from lightdist import ray  # Ray's import is heavy, and Ray is an extra

        ray.main(argv)
        return
    LightningCLI(save_config_kwargs={"overwrite": True}, args=args)


if __name__ == "__main__":
    main()
