"""The ``lightdist`` command: Lightning's own CLI, with lightdist's strategy names registered.

``lightdist fit --config configs/zero3_cpu.yaml`` trains; every strategy option can be set from YAML or as
``--trainer.strategy.init_args.zero_stage=2``, and a registered name works as ``--trainer.strategy=lightdist_zero2``.
"""

from __future__ import annotations

from lightning.pytorch.cli import ArgsType, LightningCLI

import lightdist  # noqa: F401  (registers the strategy names before the config is parsed)

__all__ = ["main"]


def main(args: ArgsType = None) -> None:
    LightningCLI(save_config_kwargs={"overwrite": True}, args=args)


if __name__ == "__main__":
    main()
