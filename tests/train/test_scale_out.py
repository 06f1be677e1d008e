"""Training past one process with the shipped accelerate configs: the configs load, the launch check refuses
settings that contradict the recipe, and 2 CPU processes (DDP, DeepSpeed ZeRO-2, and ZeRO-3 for a draft model) train
as 1 process does at the same global batch, with DDP checkpoints that resume in 1 process.

Why 2 processes x batch 2 must match 1 process x batch 4 here: with the seedable sampler every process draws the
same seeded permutation and accelerate hands process p the p-th batch of each pair, so the two shards of a step
are the single process's batch of 4, in order; every tiny conversation has the same number of loss positions, so
the average of the two shard-mean gradients (DDP's all-reduce) is the single process's mean gradient. The runs
compare by their final weights, final evaluation (summed over processes) and logged train losses (each process's
shard mean, averaged over processes: with equal loss positions per shard, the batch mean).

Tolerance: weights agree within 1e-5 (values ~0.1-1). The two runs differ only in the order of float32 sums;
after 4 AdamW steps at lr 0.01 the largest difference measured was 7e-7. The errors the tests are for are
>= 1e-3: DeepSpeed clipping at accelerate's default 1.0 instead of optim.max_grad_norm=0.01 moves weights by
1.5e-3, and a wrong LR schedule, data order or gradient average by more.

On CPU, the DDP runs launch the shipped multi_gpu_ddp.yaml with ACCELERATE_USE_CPU=true (gloo); `--cpu` would not
do, as it starts a single process. The ZeRO runs launch the shipped deepspeed_zero2.yaml and deepspeed_zero3.yaml with
DeepSpeed's CPU accelerator, through deepspeed_cpu.py (which says what it changes, and why).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from accelerate.commands.config.config_args import load_config_from_file
from accelerate.utils import DistributedType
from safetensors.torch import load_file

from specheads.train.__main__ import main as train_main
from specheads.train.config import OptimConfig, load_train_config
from specheads.train.launch_check import check_deepspeed_config, check_launch
from specheads.train.objective import OBJECTIVES
from tests.conftest import base_args

REPO = Path(__file__).resolve().parents[2]
CONFIGS = REPO / "configs" / "accelerate"
DEEPSPEED_CPU = Path(__file__).with_name("deepspeed_cpu.py")
# Every run: 4 AdamW steps large enough to move weights, clipping that binds (so a launch that clips differently
# shows), 4 eval conversations (one batch of 2 per process: none repeated to even out the shards), no decoding, and
# float32 on every CPU (auto would pick bf16 on CPUs with native bf16, where rounding, not the launch, would differ).
RUN = ("max_steps=4", "save_every=2", "eval_every=100", "measure_prompts=0", "optim.lr=0.01", "optim.warmup_steps=1",
       "optim.max_grad_norm=0.01", "data.max_eval_conversations=4", "mixed_precision='no'")
DISTILL = ("recipe=distill", "drafter.init=early-exit:2")


def launch(config: Path, processes: int, program: list[str], *, deepspeed: bool = False) -> subprocess.CompletedProcess:
    """`accelerate launch` (the real CLI) of `program` on CPU processes, as a user would run it."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO), "CUDA_VISIBLE_DEVICES": ""}
    # DDP on CPU: accelerate's CPU mode (gloo). DeepSpeed: its own CPU accelerator (gloo, see deepspeed_cpu.py).
    env |= {"DS_ACCELERATOR": "cpu"} if deepspeed else {"ACCELERATE_USE_CPU": "true"}
    return subprocess.run([sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(config),
                           "--num_processes", str(processes), "--main_process_port", "0", *program],
                          capture_output=True, text=True, timeout=600, env=env, cwd=REPO)


def weights(out: Path) -> dict[str, torch.Tensor]:
    return load_file(out / "final" / "model.safetensors")


def assert_same_weights(a: Path, b: Path) -> None:
    wa, wb = weights(a), weights(b)
    assert wa.keys() == wb.keys()
    for name in wa:
        torch.testing.assert_close(wb[name], wa[name], rtol=0, atol=1e-5, msg=lambda m, n=name: f"{n}: {m}")


def train_losses(out: Path) -> dict[int, float]:
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in rows if "loss" in r}


def final_eval(out: Path) -> dict[str, float]:
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if any(k.startswith("eval/") for k in r)][-1]


@pytest.fixture(scope="module")
def eagle_one_process(tiny_run_inputs, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("eagle-one") / "run"
    assert train_main(base_args(tiny_run_inputs, out, *RUN, "optim.batch_size=4")) == 0
    return out


# --- the shipped configs and the launch check ---------------------------------------------------------------------


def test_shipped_accelerate_configs_load_and_begin_with_their_command():
    shipped = {p.name: p for p in CONFIGS.glob("*.yaml")}
    assert set(shipped) == {"single_gpu.yaml", "multi_gpu_ddp.yaml", "deepspeed_zero2.yaml", "deepspeed_zero3.yaml"}
    for name, path in shipped.items():
        config = load_config_from_file(str(path))  # accelerate's own loader: unknown keys are refused
        first = path.read_text().splitlines()[0]
        assert first.startswith(f"# accelerate launch --config_file configs/accelerate/{name} "
                                "-m specheads.train "), name
        load_train_config(REPO / first.split()[-1], [])  # the recipe it names exists
        if config.distributed_type == DistributedType.DEEPSPEED:  # the recipe's settings are left to the recipe
            assert not {"gradient_accumulation_steps", "gradient_clipping", "deepspeed_config_file"} & set(
                config.deepspeed_config), name
            assert config.deepspeed_config["zero_stage"] == int(name[len("deepspeed_zero")])


@pytest.mark.parametrize(("ds_config", "message"), [
    ({"optimizer": {"type": "AdamW"}}, "defines 'optimizer', but the recipe builds its own .*remove the 'optimizer'"),
    ({"scheduler": {"type": "WarmupLR"}}, "remove the 'scheduler' section"),
    ({"train_micro_batch_size_per_gpu": 8}, r"train_micro_batch_size_per_gpu=8, but the recipe's optim.batch_size "
                                            r"gives 2"),
    ({"gradient_accumulation_steps": 1}, r"gradient_accumulation_steps=1, but the recipe's optim.grad_accum gives 4"),
    ({"train_batch_size": 16}, r"train_batch_size=16, but the recipe's optim.batch_size x optim.grad_accum x 3 "
                               r"processes gives 24"),
    ({"gradient_clipping": 1.0}, r"gradient_clipping=1.0, but the recipe's optim.max_grad_norm gives 0.5; remove "
                                 r"gradient_clipping from the accelerate config's deepspeed_config"),
])
def test_deepspeed_settings_that_contradict_the_recipe_are_refused(ds_config, message):
    with pytest.raises(ValueError, match=message):
        check_deepspeed_config(ds_config, OptimConfig(batch_size=2, grad_accum=4, max_grad_norm=0.5), num_processes=3)


def test_deepspeed_settings_left_to_the_recipe_pass_and_clip_at_its_max_grad_norm():
    optim = OptimConfig(batch_size=2, grad_accum=4, max_grad_norm=0.5)
    for clipping in ({"gradient_clipping": "auto"}, {}):  # accelerate would fill "auto" with 1.0; absent = no clipping
        ds_config = {"train_micro_batch_size_per_gpu": "auto", "train_batch_size": "auto",
                     "gradient_accumulation_steps": "auto", "zero_optimization": {"stage": 2}, **clipping}
        check_deepspeed_config(ds_config, optim, num_processes=3)
        assert ds_config["gradient_clipping"] == 0.5
    matching = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 4, "train_batch_size": 24,
                "gradient_clipping": 0.5}
    check_deepspeed_config(matching, optim, num_processes=3)


def test_launches_that_partition_what_cannot_be_or_override_accumulation_are_refused(tiny_run_inputs, tmp_path):
    def config(*args):
        return load_train_config(None, base_args(tiny_run_inputs, tmp_path / "run", "optim.grad_accum=2", *args))

    def accelerator(distributed_type=DistributedType.MULTI_GPU, accumulation=2, zero_stage=None):
        plugin = None if zero_stage is None else SimpleNamespace(deepspeed_config={
            "zero_optimization": {"stage": zero_stage}, "gradient_accumulation_steps": accumulation})
        return SimpleNamespace(distributed_type=distributed_type, state=SimpleNamespace(deepspeed_plugin=plugin),
                               num_processes=2, gradient_accumulation_steps=accumulation)

    eagle, distill = config(), config(*DISTILL)
    for cfg in (eagle, distill):
        check_launch(accelerator(), cfg, OBJECTIVES.get(cfg.recipe))
        check_launch(accelerator(zero_stage=2), cfg, OBJECTIVES.get(cfg.recipe))
    check_launch(accelerator(zero_stage=3), distill, OBJECTIVES.get("distill"))
    with pytest.raises(ValueError, match="ZeRO-3 partitions the trained model, but the eagle recipe's heads share "
                                         "the frozen target's modules.*use configs/accelerate/deepspeed_zero2"):
        check_launch(accelerator(zero_stage=3), eagle, OBJECTIVES.get("eagle"))
    on_policy = config(*DISTILL, "drafter.on_policy_fraction=0.5")
    with pytest.raises(ValueError, match="on-policy steps .* set drafter.on_policy_fraction: 0 or launch with "
                                         "configs/accelerate/deepspeed_zero2.yaml"):
        check_launch(accelerator(zero_stage=3), on_policy, OBJECTIVES.get("distill"))
    with pytest.raises(ValueError,
                       match="FSDP is not supported.*deepspeed_zero2.yaml .*deepspeed_zero3.yaml.*shard_target=true"):
        check_launch(accelerator(DistributedType.FSDP), eagle, OBJECTIVES.get("eagle"))
    with pytest.raises(ValueError, match="sets gradient accumulation to 8 .* optim.grad_accum is 2; unset it"):
        check_launch(accelerator(accumulation=8), eagle, OBJECTIVES.get("eagle"))
    muon = config("optim.optimizer=muon")
    check_launch(accelerator(), muon, OBJECTIVES.get("eagle"))  # DDP: each process holds whole matrices
    with pytest.raises(ValueError, match="muon orthogonalises whole matrices, which DeepSpeed's ZeRO partitions.*"
                                         "set optim.optimizer=adamw, or launch multi_gpu_ddp.yaml"):
        check_launch(accelerator(zero_stage=2), muon, OBJECTIVES.get("eagle"))


def test_a_launch_that_overrides_the_recipe_stops_before_writing(tiny_run_inputs, tmp_path, monkeypatch, capsys):
    # What `accelerate launch --gradient_accumulation_steps 2` sets. Under a real DeepSpeed launch the check reads the
    # launched config: the ZeRO-2 test below shows it (DeepSpeed clips at the value the check gives it).
    monkeypatch.setenv("ACCELERATE_GRADIENT_ACCUMULATION_STEPS", "2")
    out = tmp_path / "run"
    assert train_main(base_args(tiny_run_inputs, out)) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        "specheads train: error: the launch sets gradient accumulation to 2 (ACCELERATE_GRADIENT_ACCUMULATION_STEPS), "
        "but the recipe's optim.grad_accum is 1; unset it in the launch and set optim.grad_accum instead")
    assert not out.exists()


# --- 2 processes train as 1 -----------------------------------------------------------------------------------------


@pytest.mark.slow
def test_two_ddp_processes_train_eagle_as_one_and_their_checkpoint_resumes_in_one(tiny_run_inputs, tmp_path,
                                                                                  eagle_one_process):
    two = tmp_path / "two"
    proc = launch(CONFIGS / "multi_gpu_ddp.yaml", 2,
                  ["-m", "specheads.train", *base_args(tiny_run_inputs, two, *RUN, "optim.batch_size=2")])
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (two / "checkpoints" / "step_2" / "random_states_1.pkl").is_file()  # two processes ran
    assert_same_weights(eagle_one_process, two)
    assert final_eval(two) == pytest.approx(final_eval(eagle_one_process), abs=1e-6)

    # A run that stopped after the 2-process step-2 checkpoint, resumed by 1 process at the same global batch.
    resumed = tmp_path / "resumed"
    shutil.copytree(two / "checkpoints" / "step_2", resumed / "checkpoints" / "step_2")
    shutil.copy(two / "config.yaml", resumed / "config.yaml")
    assert train_main(base_args(tiny_run_inputs, resumed, *RUN, "optim.batch_size=4", "resume=true")) == 0
    assert (resumed / "final" / "config.json").is_file()
    assert_same_weights(eagle_one_process, resumed)  # same data position and LR schedule as the unbroken run


@pytest.mark.slow
def test_two_ddp_processes_stop_together_at_the_main_processs_minutes(tiny_run_inputs, tmp_path):
    # 6 ms of budget: spent by the end of the first step on the main process's clock, which every process reads
    out = tmp_path / "timed"
    proc = launch(CONFIGS / "multi_gpu_ddp.yaml", 2,
                  ["-m", "specheads.train", *base_args(tiny_run_inputs, out, *RUN[1:], "max_steps=1000",
                                                       "max_minutes=0.0001", "optim.batch_size=2")])
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [(r["step"], r["lr"]) for r in rows if "loss" in r] == [(1, 0.0)]  # the last step, annealed
    assert [p.name for p in (out / "checkpoints").iterdir()] == ["step_1"]


def test_two_processes_cache_features_in_parallel_and_train_as_one_process_on_its_own_cache(tiny_run_inputs,
                                                                                           tmp_path):
    offline = (*RUN, "features=offline", "feature_dtype=float32")
    one, two = tmp_path / "one", tmp_path / "two"
    assert train_main(base_args(tiny_run_inputs, one, *offline, "optim.batch_size=4")) == 0
    proc = launch(CONFIGS / "multi_gpu_ddp.yaml", 2,
                  ["-m", "specheads.train", *base_args(tiny_run_inputs, two, *offline, "optim.batch_size=2")])
    assert proc.returncode == 0, proc.stderr[-3000:]
    for name in ("train", "eval"):  # each process wrote its share, and one index joins them
        shards = {p.name.split("_")[1] for p in (two / "features" / name).glob("shard_*.safetensors")}
        assert shards == {"p0", "p1"} and not list((two / "features" / name).glob("index.part*"))
    assert_same_weights(one, two)
    assert final_eval(two) == pytest.approx(final_eval(one), abs=1e-6)


@pytest.mark.parametrize("features", ["online", "offline"])
def test_two_processes_each_holding_half_the_target_train_as_one_process_holding_it_whole(tiny_run_inputs, tmp_path,
                                                                                         eagle_one_process, features):
    two = tmp_path / "two"
    settings = (*RUN, "optim.batch_size=2", "shard_target=true", f"features={features}", "feature_dtype=float32")
    proc = launch(CONFIGS / "multi_gpu_ddp.yaml", 2, ["-m", "specheads.train", *base_args(tiny_run_inputs, two,
                                                                                          *settings)])
    assert proc.returncode == 0, proc.stderr[-3000:]
    record = json.loads((two / "metrics.jsonl").read_text().splitlines()[0])
    total = record["target_decoder_weights"]
    assert record["target_decoder_weights_held"] == [total // 2, total // 2]  # each process half of every layer
    assert_same_weights(eagle_one_process, two)
    assert final_eval(two) == pytest.approx(final_eval(eagle_one_process), abs=1e-6)


def test_a_sharded_target_needs_several_processes_and_no_one_process_decoding(tiny_run_inputs, tmp_path, capsys):
    with pytest.raises(ValueError, match="set measure_prompts=0"):
        load_train_config(None, base_args(tiny_run_inputs, tmp_path, "shard_target=true"))
    assert train_main(base_args(tiny_run_inputs, tmp_path / "one", *RUN, "shard_target=true")) == 2
    assert "this run has one; launch with several" in capsys.readouterr().err
    assert not (tmp_path / "one" / "metrics.jsonl").exists()


def test_a_killed_two_process_run_resumes_losing_nothing_and_repeating_no_step(tiny_run_inputs, tmp_path):
    # DDP for the drafter, the target sharded with FSDP2: both kinds of process state meet the kill and the resume
    import signal
    import time

    # RUN, longer and with more checkpoints, within the first epoch (where 2 processes at batch 2 see what 1 at batch
    # 4 sees; past it, accelerate evens the last partial batch out differently)
    steps = (*RUN[2:], "max_steps=10", "save_every=2", "log_every=1")
    one = tmp_path / "one"  # uninterrupted, one process holding the whole target
    assert train_main(base_args(tiny_run_inputs, one, *steps, "optim.batch_size=4")) == 0
    two = tmp_path / "two"
    program = ["-m", "specheads.train", *base_args(tiny_run_inputs, two, *steps, "optim.batch_size=2",
                                                   "shard_target=true")]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO), "CUDA_VISIBLE_DEVICES": "",
           "ACCELERATE_USE_CPU": "true"}
    proc = subprocess.Popen([sys.executable, "-m", "accelerate.commands.launch", "--config_file",
                             str(CONFIGS / "multi_gpu_ddp.yaml"), "--num_processes", "2", "--main_process_port", "0",
                             *program], env=env, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)
    deadline = time.monotonic() + 300
    while not (two / "checkpoints" / "step_4" / "trainer_state.json").is_file():  # killed past its second checkpoint
        assert proc.poll() is None and time.monotonic() < deadline, "the run ended before it could be killed"
        time.sleep(0.02)
    os.killpg(proc.pid, signal.SIGKILL)  # every process of the launch, as a preempted job's
    proc.wait()
    assert not (two / "final").exists()
    resumed = launch(CONFIGS / "multi_gpu_ddp.yaml", 2, [*program, "resume=true"])
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    logged = [r["step"] for r in map(json.loads, (two / "metrics.jsonl").read_text().splitlines()) if "loss" in r]
    assert logged == list(range(1, 11))  # every step once: those past the checkpoint ran and were logged again
    assert_same_weights(one, two)  # and nothing lost: the uninterrupted run's weights


@pytest.fixture(scope="module")
def distill_one_process(tiny_run_inputs, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("distill-one") / "run"
    assert train_main(base_args(tiny_run_inputs, out, *RUN, *DISTILL, "optim.batch_size=4")) == 0
    return out


@pytest.mark.slow
def test_two_ddp_processes_train_distill_as_one(tiny_run_inputs, tmp_path, distill_one_process):
    one, two = distill_one_process, tmp_path / "two"
    proc = launch(CONFIGS / "multi_gpu_ddp.yaml", 2,
                  ["-m", "specheads.train", *base_args(tiny_run_inputs, two, *RUN, *DISTILL, "optim.batch_size=2")])
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert_same_weights(one, two)
    assert final_eval(two) == pytest.approx(final_eval(one), rel=1e-5)
    assert train_losses(two) == pytest.approx(train_losses(one), rel=1e-5)  # the whole step's loss, not rank 0's


@pytest.mark.slow
def test_two_deepspeed_zero2_processes_train_eagle_as_one(tiny_run_inputs, tmp_path, eagle_one_process):
    pytest.importorskip("deepspeed")  # the train extra
    two = tmp_path / "zero2"
    proc = launch(CONFIGS / "deepspeed_zero2.yaml", 2,
                  [str(DEEPSPEED_CPU), *base_args(tiny_run_inputs, two, *RUN, "optim.batch_size=2")], deepspeed=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    # A DeepSpeed checkpoint, its optimizer state in one shard per process: DeepSpeed ran, over 2 processes.
    assert (two / "checkpoints" / "step_4" / "pytorch_model" / "zero_pp_rank_1_mp_rank_00_optim_states.pt").is_file()
    # DeepSpeed clipped at optim.max_grad_norm (0.01), where it would otherwise use 1.0 (module docstring)
    assert_same_weights(eagle_one_process, two)


@pytest.mark.slow
def test_two_deepspeed_zero3_processes_train_a_draft_model_as_one(tiny_run_inputs, tmp_path, distill_one_process):
    pytest.importorskip("deepspeed")
    three = tmp_path / "zero3"
    proc = launch(CONFIGS / "deepspeed_zero3.yaml", 2,
                  [str(DEEPSPEED_CPU), *base_args(tiny_run_inputs, three, *RUN, *DISTILL, "optim.batch_size=2")],
                  deepspeed=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    # The weights themselves partitioned, one part per process (ZeRO-2 writes them whole, once)
    step = three / "checkpoints" / "step_4" / "pytorch_model"
    assert {p.name for p in step.glob("*model_states.pt")} == {
        "zero_pp_rank_0_mp_rank_00_model_states.pt", "zero_pp_rank_1_mp_rank_00_model_states.pt"}
    assert_same_weights(distill_one_process, three)  # gathered whole into final/, a plain model folder
    assert final_eval(three) == pytest.approx(final_eval(distill_one_process), rel=1e-5)
