"""speculators' own trainer (`python -m speculators.train`, speculators 0.9.0) on a machine without a GPU.

Its code runs unchanged but for what is set here from the outside, without editing the installed package:

1. The device. Its `Trainer` moves the model and every batch to `get_local_rank()`, an int that torch reads as
   `cuda:<rank>`, and autocasts for `torch.accelerator.current_accelerator()`, falling back to "cuda" when there
   is none. Here both are "cpu": the local rank is the device "cpu" and the autocast device type is "cpu". Its
   step timer synchronizes the accelerator before each reading, which raises where there is none; a CPU has no
   queued work to wait for, so there the synchronization does nothing.
2. The step budget. With `--max-steps`, its epoch loop checks the budget after each step, so every epoch that
   starts once the budget is spent still trains one step. Here an epoch that starts with the budget spent trains
   none; the validation pass after it still runs, as speculators' code has it.
3. On a CPU without native bf16 only: Muon's orthogonalization. torch's Muon (speculators' default optimizer) runs
   its Newton-Schulz iteration in bf16, which such a CPU emulates at about 50x the fp32 cost (53 s against 1 s for
   an 8192 x 576 head on a 2-core AVX2 EPYC): a step would take a minute, mostly there. There the same iteration
   runs in fp32 (`specheads.train.optimizer.orthogonalised`, what our recipe's Muon runs on such a CPU). Pass
   `--hidden-states-dtype float32` on such a CPU too: that dtype is also the autocast's, and bf16 autocast is
   emulated as well.

Everything else (data loading and packing, the model, losses, optimizer, schedule, checkpoints) is speculators'.

    .venv/bin/python scripts/lab/speculators_train_cpu.py --speculator-type eagle3 --verifier-name-or-path DIR ...

The arguments are those of `python -m speculators.train` (its `--help` lists them).
"""

from __future__ import annotations

import sys


def run_on_cpu() -> None:
    import speculators.train.trainer as trainer
    import torch

    if not torch.accelerator.is_available():
        torch.accelerator.synchronize = lambda device=None: None
    trainer.get_local_rank = lambda: "cpu"
    setup_trainer = trainer.Trainer.setup_trainer
    train_epoch = trainer.Trainer.train_epoch

    def setup_on_cpu(self) -> None:  # runs right after __init__ chose the autocast device type
        self.device_type = "cpu"
        setup_trainer(self)

    def train_epoch_within_budget(self, epoch: int, **kwargs) -> None:
        if self.config.max_steps is not None and self.global_step >= self.config.max_steps:
            return
        train_epoch(self, epoch, **kwargs)

    trainer.Trainer.setup_trainer = setup_on_cpu
    trainer.Trainer.train_epoch = train_epoch_within_budget

    from specheads.machine import cpu_has_native_bf16

    if not torch.accelerator.is_available() and not cpu_has_native_bf16():
        orthogonalize_in_fp32()


def orthogonalize_in_fp32() -> None:
    """torch's Muon orthogonalizes its update in bf16; here in fp32, by our Muon's iteration (setting 3)."""
    import torch.optim._muon as muon

    from specheads.train.optimizer import orthogonalised

    muon._zeropower_via_newtonschulz = orthogonalised  # its call is by the module's name, with the same arguments


def main(argv: list[str] | None = None) -> None:
    try:
        from speculators.train.cli import main as train
        from speculators.train.config import TrainConfig
    except ImportError as err:
        sys.exit(f"speculators is not installed ({err}); install it: pip install --no-deps speculators==0.9.0 "
                 "hs-connectors==0.9.0 (scripts/setup.sh does)")
    run_on_cpu()
    train(TrainConfig.resolve(argv))


if __name__ == "__main__":
    main()
