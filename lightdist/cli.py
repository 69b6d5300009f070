"""The ``lightdist`` command: Lightning's own CLI, with lightdist's strategy names registered, and ``plan``.

``lightdist fit --config configs/zero3_cpu.yaml`` trains; every strategy option can be set from YAML or as
``--trainer.strategy.init_args.zero_stage=2``, and a registered name works as ``--trainer.strategy=lightdist_zero2``.
``lightdist plan --config ...`` shows what tensor parallelism will do to the model, without allocating it.
``lightdist export CKPT OUT`` turns a sharded checkpoint into weights for the plain model (safetensors, torch, or a
Hugging Face model). ``lightdist timeline DIR`` draws the pipeline schedule of the traces ``ProfileSteps`` wrote.
``lightdist prepare TEXT... --tokenizer DIR --output URL`` tokenizes a corpus into shards that runs stream.
``lightdist verify --config ...`` trains the config's layout beside one process on CPU ranks and compares each step.
``lightdist fit --config ... --launcher ray --num-workers N`` trains on Ray Train's workers.
``--verbose`` (or ``LIGHTDIST_LOG=debug``) shows the third-party messages lightdist silences (``lightdist/quiet.py``).
"""

from __future__ import annotations

import os
import sys

from lightning.pytorch.cli import ArgsType, LightningCLI

import lightdist.plugins  # noqa: F401  (registers the strategy names before the config is parsed)
from lightdist import verify
from lightdist.checkpoint import export
from lightdist.data import prepare
from lightdist.plan import command as plan
from lightdist.plan import timeline

__all__ = ["main"]

# lightdist's own commands, beside Lightning's fit, validate, test and predict: each one's entry point, and what it
# does.
COMMANDS = {
    "plan": (plan.main, "how a model splits, what each layout costs per GPU, and which to use, without allocating it"),
    "export": (
        export.main,
        "a sharded checkpoint as weights for the plain model: safetensors, torch, or a Hugging Face model",
    ),
    "prepare": (prepare.main, "a text corpus tokenized once into token shards at any URL, for runs to stream"),
    "timeline": (timeline.main, "the pipeline schedule of the traces ProfileSteps wrote, as one SVG of every rank"),
    "verify": (verify.main, "a config's layout trained beside one process on CPU ranks, step by step: equal or not"),
}


def main(args: ArgsType = None) -> None:
    argv = sys.argv[1:] if args is None else list(args)
    if "--verbose" in argv:
        argv.remove("--verbose")
        if args is None:  # Lightning reads the command line, and starts the other ranks with it
            sys.argv.remove("--verbose")
        os.environ["LIGHTDIST_LOG"] = "debug"  # the ranks and their checkpoint processes inherit it
    if not argv or argv[0] in ("-h", "--help"):
        print("lightdist: Lightning's commands (fit, validate, test, predict; their help below), and")
        print("\n".join(f"  {name:<10}{what}" for name, (_, what) in COMMANDS.items()))
        print("  --verbose also shows the third-party messages lightdist silences\n")
    if argv[:1] and argv[0] in COMMANDS:
        COMMANDS[argv[0]][0](argv[1:])
        return
    if any(arg == "--launcher" or arg.startswith("--launcher=") for arg in argv):
        from lightdist import ray  # Ray's import is heavy, and Ray is an extra

        ray.main(argv)
        return
    LightningCLI(save_config_kwargs={"overwrite": True}, args=None if args is None else argv)


if __name__ == "__main__":
    main()
