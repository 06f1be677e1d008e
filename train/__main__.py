"""`python -m specheads.train CONFIG.yaml [key=value ...]` (also under `accelerate launch` and `torchrun`)."""

from __future__ import annotations

import logging
import os
import sys


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help"):
        print(__doc__.strip() + "\n\nThe config's recipe: key names what to train (list them: --recipes; every key of "
              "each: docs/recipes.md).\nCommon overrides: output_dir=DIR max_steps=N data.max_conversations=N "
              "resume=true report_to=wandb", file=sys.stdout if args else sys.stderr)  # asked for, or a usage error
        return 0 if args else 2
    if args == ["--recipes"]:  # imports every recipe (torch with them); --help stays instant
        from specheads.train.objective import OBJECTIVES

        for name, objective in sorted(OBJECTIVES.items()):
            doc = sys.modules[objective.build.__module__].__doc__ or ""  # the recipe module's first line says what
            print(f"{name}: {doc.strip().splitlines()[0] if doc.strip() else objective.kind}")
        return 0
    config_path, overrides = (None, args) if "=" in args[0] else (args[0], args[1:])
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    for noisy in ("httpx", "urllib3", "datasets", "filelock"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    from specheads.train.config import load_train_config
    from specheads.train.recipe import train

    try:
        cfg = load_train_config(config_path, overrides)
        final = train(cfg)
    except ValueError as err:
        print(f"specheads train: error: {err}", file=sys.stderr)
        return 2
    print(f"drafter saved to {final}", file=sys.stderr)
    return 0


def end_launched_process(code: int) -> None:
    """End one process of a multi-process launch without the interpreter's finalization.

    Torch keeps process groups alive in module-level registries (the device meshes of a sharded target among them)
    until the interpreter tears down. A gloo worker thread that then needs the GIL to free a tensor is stopped by
    Python in the middle of C++ and aborts the process ("terminate called without an active exception", SIGABRT)
    after the run has finished and saved, and the launcher reports the whole run failed. After a finished run every
    process has passed its last barrier and the process group is destroyed, and a refused run has nothing to save:
    all that finalization had left was to flush.
    """
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    status = main()
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:  # set by accelerate launch and torchrun for each process
        end_launched_process(status)
    sys.exit(status)
