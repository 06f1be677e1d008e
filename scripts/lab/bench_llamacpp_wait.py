"""llama.cpp's one-token decode under OpenMP's two wait policies, interleaved: `llama-server` (100 new tokens after a
60-token prompt, whole request timed) and the engine's llama.cpp backend (a plain step on a 128-token cache, median
of 40), each with OMP_WAIT_POLICY unset and =PASSIVE (the policy the CLI sets for torch). Results: docs/results.md,
"2026-12-07: the engine on llama.cpp's kernels".

    .venv/bin/python scripts/lab/bench_llamacpp_wait.py [--gguf f32] [--rounds 2]

The backend runs in a child process per policy: OpenMP reads the variable once, when it starts.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time

STEP = """
import statistics, sys, time, torch
from specheads.inference.engine.llamacpp_backend import llamacpp_backend
from specheads.inference.engine.tree import DraftTree
backend = llamacpp_backend("default", sys.argv[1], threads=2)
row = backend.add_row(400)
backend.prefill(row, torch.randint(0, 49152, (128,), generator=torch.Generator().manual_seed(0)), hidden=False)
backend.commit(row, torch.tensor([0]))
times = []
for i in range(40):
    start = time.perf_counter()
    backend.verify(row, [DraftTree.root_only(100 + i)], hidden=False)
    times.append(time.perf_counter() - start)
    backend.commit(row, torch.tensor([0]))
print(1000 * statistics.median(times))
"""


def server_ms(gguf: str, policy: str | None) -> float:
    """llama-server's time per new token with OMP_WAIT_POLICY=`policy` in its environment (None: unset; LlamaServer
    itself always leaves it unset, so it is put back here for the comparison)."""
    import specheads.llamacpp.server as server_mod
    from specheads.llamacpp.server import LlamaServer
    from specheads.llamacpp.target_gguf import target_gguf

    popen = subprocess.Popen

    def with_policy(cmd, **kwargs):
        env = {k: v for k, v in kwargs.pop("env").items() if k != "OMP_WAIT_POLICY"}
        return popen(cmd, env=env | ({"OMP_WAIT_POLICY": policy} if policy else {}), **kwargs)

    server_mod.subprocess.Popen = with_policy
    prompt = list(range(1000, 1060))
    try:
        with LlamaServer(target_gguf("default", gguf), threads=2, cache_type="f32" if gguf == "f32" else None) as srv:
            srv.complete(prompt, max_new_tokens=8)
            start = time.perf_counter()
            done = srv.complete(prompt, max_new_tokens=100)
            return 1000 * (time.perf_counter() - start) / len(done.tokens)
    finally:
        server_mod.subprocess.Popen = popen


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gguf", default="f32")
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    for _ in range(args.rounds):
        for policy in (None, "PASSIVE"):
            env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
            if policy:
                env["OMP_WAIT_POLICY"] = policy
            step = subprocess.run([sys.executable, "-c", STEP, args.gguf], env=env, capture_output=True, text=True,
                                  check=True).stdout.strip().splitlines()[-1]
            server = server_ms(args.gguf, policy)
            print(f"OMP_WAIT_POLICY={policy or 'unset'}: llama-server {server:.1f} ms/token, backend step "
                  f"{float(step):.1f} ms")


if __name__ == "__main__":
    main()
