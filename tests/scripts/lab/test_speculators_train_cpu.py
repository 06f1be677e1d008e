"""speculators' own trainer runs on a CPU through scripts/lab/speculators_train_cpu.py: on hidden states written in its
offline layout here, it trains exactly the steps it is given (its own epoch loop would add one per epoch left), and
the drafter it saves imports here and decodes exactly."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from specheads.formats.load import load_heads
from specheads.inference import Engine
from specheads.inference.proposers import AutoregressiveProposer
from specheads.target import load_target
from specheads.train.data import load_conversations, tokenize_dataset
from specheads.train.speculators_states import write_speculators_states
from tests.conftest import repetitive_prompt
from tests.drafters import proposer_for

SCRIPT = Path(__file__).resolve().parents[3] / "scripts" / "lab" / "speculators_train_cpu.py"
STEPS = 3


def test_the_peer_trains_its_steps_on_cpu_and_its_drafter_decodes_exactly_here(tiny_run_inputs, tmp_path):
    pytest.importorskip("speculators", reason="install with: pip install --no-deps speculators==0.9.0")
    target_dir, conversations_file = tiny_run_inputs
    target, tokenizer = load_target(str(target_dir))
    conversations, _ = load_conversations(str(conversations_file))
    rows = tokenize_dataset(conversations, tokenizer, 96)
    data = write_speculators_states(target, tokenizer, rows["input_ids"], rows["loss_mask"], tmp_path / "data",
                                    target_layer_ids=[1, 2, 3])
    save = tmp_path / "peer"
    # 43 rows packed to 200 tokens make a few batches an epoch: 3 steps end inside the second of 4 epochs.
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--speculator-type", "eagle3", "--verifier-name-or-path", str(target_dir),
         "--data-path", str(data), "--save-path", str(save), "--log-dir", str(tmp_path / "logs"),
         "--num-layers", "1", "--draft-arch", "llama", "--target-layer-ids", "1", "2", "3", "--draft-attn-impl",
         "sdpa", "--total-seq-len", "200", "--hidden-states-dtype", "float32", "--num-workers", "0",
         "--on-missing", "raise", "--max-steps", str(STEPS), "--epochs", "4", "--optimizer", "adamw",
         "--lr", "0.01", "--loss-implementation", "eager"],  # its fused losses need Triton (a GPU)
        capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    last = save / "3"
    assert json.loads((last / "training_state.json").read_text())["global_step"] == STEPS

    head = load_heads(last, target, kind="eagle3")
    assert head.config.aux_layers == (1, 2, 3)
    prompt = repetitive_prompt()
    plain = Engine(target, AutoregressiveProposer()).generate(prompt, max_new_tokens=32)
    res = Engine(target, proposer_for("eagle3", target, last, {"lookup": 0})).generate(prompt, max_new_tokens=32)
    assert res.output_ids == plain.output_ids and res.stats.drafted > 0


def test_muons_orthogonalization_runs_in_fp32(monkeypatch):
    import importlib.util

    import torch
    import torch.optim._muon as muon

    spec = importlib.util.spec_from_file_location("speculators_train_cpu", SCRIPT)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    monkeypatch.setattr(muon, "_zeropower_via_newtonschulz", muon._zeropower_via_newtonschulz)  # restored after
    in_bf16 = muon._zeropower_via_newtonschulz
    script.orthogonalize_in_fp32()
    grad = torch.randn(48, 16, generator=torch.Generator().manual_seed(0))
    kept = grad.clone()
    args = ((3.4445, -4.7750, 2.0315), 5, 1e-7)
    fp32 = muon._zeropower_via_newtonschulz(grad, *args)
    assert fp32.dtype == torch.float32 and torch.equal(grad, kept)  # the momentum buffer it reads is left alone
    bf16 = in_bf16(grad, *args)
    assert bf16.dtype == torch.bfloat16 and not torch.equal(fp32, bf16.float())
    # the same iteration, apart by bf16 rounding only (entries up to about 0.5 here, 0.008 apart)
    assert (fp32 - bf16.float()).abs().max() < 0.05
