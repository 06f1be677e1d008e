"""`scripts/slurm_train.sbatch` as Slurm runs it: `scontrol` and `srun` are stand-ins that check what the script asks
of them (on a machine without Slurm), and the launch they run is the real `accelerate launch` of 2 CPU processes."""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
from pathlib import Path

from tests.conftest import base_args

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "scripts" / "slurm_train.sbatch"

SCONTROL = """#!/usr/bin/env bash
# scontrol: only `show hostnames NODELIST` is expected
[[ "$1 $2 $3" == "show hostnames node[01-02]" ]] || { echo "scontrol got: $*" >&2; exit 3; }
echo 127.0.0.1
echo 127.0.0.2
"""
SRUN = """#!/usr/bin/env bash
# srun: one task per node, the job stopped if one fails; runs the task as node 0 of the allocation
echo "$@" > "$SRUN_LOG"
[[ "$1" == "--kill-on-bad-exit=1" && "$2" == "--ntasks-per-node=1" && "$3" == "bash" && "$4" == "-c" ]] \
    || { echo "srun got: $*" >&2; exit 3; }
SLURM_NODEID=0 exec bash -c "$5"
"""


def test_the_sbatch_script_launches_every_nodes_processes_and_resumes(tiny_run_inputs, tmp_path):
    stubs = tmp_path / "bin"
    stubs.mkdir()
    for name, text in (("scontrol", SCONTROL), ("srun", SRUN)):
        (stubs / name).write_text(text)
        (stubs / name).chmod(0o755)
    env = {**os.environ, "PATH": f"{stubs}:{os.environ['PATH']}", "SRUN_LOG": str(tmp_path / "srun.log"),
           "SLURM_NNODES": "1", "SLURM_GPUS_ON_NODE": "2", "SLURM_JOB_NODELIST": "node[01-02]",
           "ACCELERATE": f"{shlex.quote(sys.executable)} -m accelerate.commands.accelerate_cli",
           "MAIN_PROCESS_PORT": "0", "ACCELERATE_USE_CPU": "true", "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO),
           "CUDA_VISIBLE_DEVICES": ""}
    out = tmp_path / "run"
    overrides = base_args(tiny_run_inputs, out, "max_steps=2", "save_every=2", "measure_prompts=0",
                          "mixed_precision='no'")
    done = subprocess.run(["bash", str(SCRIPT), *overrides], env=env, cwd=REPO, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert (out / "final" / "config.json").is_file()
    assert (out / "checkpoints" / "step_2" / "random_states_1.pkl").is_file()  # both processes of the node ran
    task = " ".join((tmp_path / "srun.log").read_text().split())
    assert "--num_machines 1 --num_processes 2 --machine_rank $SLURM_NODEID --main_process_ip 127.0.0.1" in task
    assert task.rstrip().endswith("resume=true")
    # a requeued job runs the same script again: it resumes at its last step instead of training anew
    again = subprocess.run(["bash", str(SCRIPT), *overrides], env=env, cwd=REPO, capture_output=True, text=True,
                           timeout=600)
    assert again.returncode == 0, again.stderr[-3000:]
    assert "resumed from" in again.stderr and "step 2" in again.stderr


def test_outside_an_allocation_the_script_says_so():
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    done = subprocess.run(["bash", str(SCRIPT), "configs/eagle3-smollm2-gpu.yaml"], env=env, cwd=REPO,
                          capture_output=True, text=True)
    assert done.returncode != 0 and "run under sbatch or srun" in done.stderr
