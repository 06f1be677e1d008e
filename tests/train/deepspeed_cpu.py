"""`accelerate launch --config_file <a DeepSpeed config> tests/train/deepspeed_cpu.py ARGS...`: the training CLI
(`python -m specheads.train ARGS...`) under DeepSpeed on CPU processes, for tests on machines without a GPU.

Two settings differ from a GPU launch, both here and not in the library:
- the Accelerator is given the gloo backend: without a GPU, accelerate picks no process-group backend under
  DeepSpeed, so every process would count itself alone (and its CPU mode, ACCELERATE_USE_CPU, turns DeepSpeed off);
- DeepSpeed's shared-memory all-reduce is turned off: its CPU backend would first compile it (minutes on a small
  machine), and gloo's all-reduce is enough for a test.
"""

from __future__ import annotations

import sys

import deepspeed.ops
from accelerate.utils import InitProcessGroupKwargs

import specheads.train.recipe as recipe
from specheads.train.__main__ import main

deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False


class GlooAccelerator(recipe.Accelerator):
    def __init__(self, **kwargs) -> None:
        super().__init__(kwargs_handlers=[InitProcessGroupKwargs(backend="gloo")], **kwargs)


recipe.Accelerator = GlooAccelerator
sys.exit(main())
