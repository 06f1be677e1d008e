"""`llama-server` run on a free loopback port for as long as a `with` block lasts, and asked for completions.

One slot (`-np 1`) by default, so each request has the machine to itself as our engine does (`slots=N` serves N
requests at once, each with `ctx_size` tokens: throughput, for regeneration); prompts are sent as token ids (the
same ids our engine decodes from) and answers come back as token ids (`return_tokens`), never re-tokenized.
The server keeps no prompt cache between requests (`cache_prompt: false`), so every request pays its prefill,
as ours do. With a drafter (`-md FILE --spec-type TYPE`) its answer carries llama.cpp's own draft statistics.
"""

from __future__ import annotations

import json
import os
import shlex
import socket
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType

from specheads.llamacpp.build import llama_server
from specheads.llamacpp.source import Progress

START_TIMEOUT_S = 300.0  # loading a model and warming it up; a big model from a slow disk can take minutes


@dataclass(frozen=True)
class Completion:
    """One answer of llama-server, in our terms (`GenerationStats`'s)."""

    tokens: list[int]  # the generated ids, a final end-of-generation token included
    wall_s: float  # the whole request, as the client saw it
    stop: str  # llama.cpp's stop type: "eos", "limit", ...
    prompt_ms: float  # llama.cpp's own timings: the prefill and the decoding after it
    predicted_ms: float
    drafted: int  # draft tokens llama.cpp proposed and verified (0 without a drafter)
    accepted: int  # of those, accepted

    @property
    def steps(self) -> int:
        """Target forwards, the prefill's included: every forward commits one token more than it accepts."""
        return len(self.tokens) - self.accepted


class LlamaServer:
    """`with LlamaServer(model_gguf, draft=drafter_gguf, spec_type="draft-eagle3") as server: server.complete(...)`.

    `draft_max` is how many tokens llama.cpp drafts per step (its `--spec-draft-n-max`), `p_min` the drafter's
    probability below which it stops drafting (`--spec-draft-p-min`; 0: never: llama.cpp's default; this release
    takes both per server only, not per request: `draft_settings.py` measures them); `threads` its `-t` and
    `-tb` (None: llama.cpp's default); `ctx_size` a slot's context; `cache_type` its KV cache's type (None:
    llama.cpp's default, f16; "f32" for an F32 model compared with our fp32, whose cache is fp32, with flash
    attention off, whose CPU kernel rounds through f16; "bf16" beside our bf16). The binary is `binary`, else
    `$SPECHEADS_LLAMA_SERVER` (one built elsewhere, e.g. with CUDA: it should be of the release
    `specheads.llamacpp.source.VERSION` names), else the one `build.py` builds. The server's log is kept in a
    temporary file and quoted when it fails.
    """

    def __init__(self, model: Path, *, draft: Path | None = None, spec_type: str | None = None, draft_max: int = 3,
                 p_min: float = 0.0, threads: int | None = None, ctx_size: int = 4096, cache_type: str | None = None,
                 slots: int = 1, binary: Path | None = None,
                 extra_args: tuple[str, ...] = (), on_progress: Progress | None = None) -> None:
        if draft is not None and spec_type is None:
            raise ValueError("a drafter needs both draft= (its GGUF) and spec_type= (e.g. draft-eagle3)")
        if draft is None and spec_type is not None and spec_type.startswith("draft"):
            raise ValueError(f"spec_type={spec_type} drafts with a model: pass its GGUF as draft=")
        if slots < 1:
            raise ValueError(f"slots must be >= 1, got {slots}")
        if not 0.0 <= p_min <= 1.0:
            raise ValueError(f"p_min is a probability in [0, 1], got {p_min}")
        for path in (model, draft):
            if path is not None and not Path(path).is_file():
                raise ValueError(f"{path} is not a file; pass a GGUF model file")
        self.model, self.draft, self.spec_type, self.draft_max = Path(model), draft, spec_type, draft_max
        self.p_min = p_min
        self.threads, self.ctx_size, self.cache_type, self.extra_args = threads, ctx_size, cache_type, tuple(extra_args)
        self.slots = slots
        self.binary = binary
        self.on_progress = on_progress
        self.port = 0
        self._proc: subprocess.Popen | None = None
        self._log: tempfile._TemporaryFileWrapper | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def command(self) -> list[str]:
        own = os.environ.get("SPECHEADS_LLAMA_SERVER")  # a llama-server built elsewhere (e.g. for a GPU)
        binary = self.binary or (Path(own) if own else llama_server(on_progress=self.on_progress))
        cmd = [str(binary), "-m", str(self.model), "--host", "127.0.0.1", "--port", str(self.port),
               "-c", str(self.ctx_size * self.slots), "-np", str(self.slots), "--no-webui"]
        if self.threads:
            cmd += ["-t", str(self.threads), "-tb", str(self.threads)]
        if self.cache_type:
            cmd += ["-ctk", self.cache_type, "-ctv", self.cache_type]
            if self.draft is not None:
                cmd += ["-ctkd", self.cache_type, "-ctvd", self.cache_type]
        if self.cache_type == "f32":  # llama.cpp's CPU flash attention rounds K and V through f16: off, for fp32
            cmd += ["-fa", "off"]
        if self.draft is not None:
            cmd += ["-md", str(self.draft)]
        if self.spec_type is not None:  # a draft model's type, or one of llama.cpp's own n-gram drafters
            cmd += ["--spec-type", str(self.spec_type), "--spec-draft-n-max", str(self.draft_max),
                    "--spec-draft-n-min", "0"]
            if self.p_min:
                cmd += ["--spec-draft-p-min", f"{self.p_min:g}"]
        return cmd + list(self.extra_args)

    def __enter__(self) -> LlamaServer:
        self.port = _free_port()
        cmd = self.command()
        self._log = tempfile.NamedTemporaryFile("w+", prefix="llama-server-", suffix=".log", delete=False)
        # llama.cpp's kernels meet at an OpenMP barrier after every operation: threads told to sleep there (the
        # OMP_WAIT_POLICY=PASSIVE our CLI sets for torch) made a one-token step about 2x as slow, so the server
        # waits as llama.cpp does by default
        env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
        self._proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                      env=env)
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            if self._proc.poll() is not None:
                log = self.log_tail()
                self.close()
                raise RuntimeError(f"llama-server exited ({self._proc.returncode}) while starting: "
                                   f"{shlex.join(cmd)}\n{log}")
            try:
                with urllib.request.urlopen(f"{self.url}/health", timeout=5) as response:
                    if response.status == 200:
                        return self
            except (urllib.error.URLError, OSError):
                pass
            if time.monotonic() > deadline:
                log = self.log_tail()
                self.close()
                raise RuntimeError(f"llama-server did not answer /health within {START_TIMEOUT_S:.0f} s\n{log}")
            time.sleep(0.2)

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()

    def close(self) -> None:
        if self._proc is not None and self._proc.poll() is None:
            self._proc.terminate()
            try:
                self._proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
        if self._log is not None:
            self._log.close()
            os.unlink(self._log.name)
            self._log = None

    def log_tail(self, lines: int = 30) -> str:
        if self._log is None:
            return ""
        self._log.flush()
        return "\n".join(Path(self._log.name).read_text(errors="replace").splitlines()[-lines:])

    def complete(self, prompt: list[int], *, max_new_tokens: int, temperature: float = 0.0, top_k: int = 0,
                 top_p: float = 1.0, seed: int | None = None) -> Completion:
        """Answer the token ids `prompt` with up to `max_new_tokens` tokens; greedy at temperature 0 (llama.cpp
        then takes the argmax); it stops at the model's end-of-generation tokens."""
        if self._proc is None or self._proc.poll() is not None:
            raise RuntimeError("llama-server is not running; use it inside `with LlamaServer(...) as server:`")
        body = {"prompt": prompt, "n_predict": max_new_tokens, "temperature": temperature, "top_k": top_k,
                "top_p": top_p, "min_p": 0.0, "cache_prompt": False, "return_tokens": True, "stream": False}
        if seed is not None:
            body["seed"] = seed
        request = urllib.request.Request(f"{self.url}/completion", data=json.dumps(body).encode(),
                                         headers={"Content-Type": "application/json"})
        start = time.perf_counter()
        try:
            with urllib.request.urlopen(request, timeout=3600) as response:
                answer = json.loads(response.read())
        except urllib.error.HTTPError as err:
            raise RuntimeError(f"llama-server refused the request ({err.code}): {err.read()[:500]!r}") from None
        wall = time.perf_counter() - start
        timings = answer.get("timings") or {}
        return Completion(tokens=[int(t) for t in answer.get("tokens") or []], wall_s=wall,
                          stop=str(answer.get("stop_type", "")), prompt_ms=float(timings.get("prompt_ms", 0.0)),
                          predicted_ms=float(timings.get("predicted_ms", 0.0)),
                          drafted=int(timings.get("draft_n", 0)), accepted=int(timings.get("draft_n_accepted", 0)))


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])
