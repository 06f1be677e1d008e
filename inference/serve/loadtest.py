"""`specheads loadtest`: concurrent streaming chat requests against running servers, compared in one run.

Each server (a label and a base URL, e.g. speculation on, off and adaptive) gets the same requests at each
concurrency level: `concurrency` clients each send their next prompt as soon as their last answer ended, until
`requests` answers came back. Levels run in increasing order and the servers take turns within each level, so
machine drift spreads over all of them. Requests are greedy (temperature 0) and streamed, which gives
time-to-first-token as the client sees it (queueing included); every server's answer to a prompt must equal the
first server's, since every mode is exact, and a mismatch is reported.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx


@dataclass(frozen=True)
class Answer:
    prompt: int  # index into the prompts
    text: str
    tokens: int  # completion tokens (the server's usage)
    latency_s: float  # request sent to last byte
    ttft_s: float  # request sent to the first content delta
    error: str = ""


@dataclass(frozen=True)
class LevelResult:
    label: str
    concurrency: int
    requests: int
    failed: int
    wall_s: float
    requests_per_s: float
    output_tokens_per_s: float
    latency_p50_s: float
    latency_p99_s: float
    ttft_p50_s: float
    ttft_p99_s: float
    answers: tuple[Answer, ...] = field(repr=False, default=())

    def summary(self) -> dict:
        return {k: v for k, v in asdict(self).items() if k != "answers"}


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0-100) by linear interpolation between order statistics (numpy's default)."""
    if not values:
        return float("nan")
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100
    lo = int(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


async def _one(client: httpx.AsyncClient, url: str, model: str, prompt: str, max_tokens: int, index: int) -> Answer:
    body = {"model": model, "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
            "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}
    start = time.perf_counter()
    first, parts, tokens = None, [], 0
    try:
        async with client.stream("POST", f"{url}/v1/chat/completions", json=body) as response:
            if response.status_code != 200:
                detail = (await response.aread()).decode(errors="replace")[:200]
                return Answer(index, "", 0, time.perf_counter() - start, 0.0, f"HTTP {response.status_code}: {detail}")
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line[6:])
                if event.get("usage"):
                    tokens = event["usage"]["completion_tokens"]
                for choice in event.get("choices", ()):
                    content = choice.get("delta", {}).get("content")
                    if content:
                        first = first if first is not None else time.perf_counter()
                        parts.append(content)
    except (httpx.HTTPError, ValueError) as err:
        return Answer(index, "", 0, time.perf_counter() - start, 0.0, f"{type(err).__name__}: {err}")
    end = time.perf_counter()
    return Answer(index, "".join(parts), tokens, end - start, (first or end) - start)


async def run_level(url: str, prompts: Sequence[str], *, label: str, concurrency: int, requests: int,
                    max_tokens: int, model: str, api_key: str | None = None, timeout_s: float = 600.0) -> LevelResult:
    """`requests` answers from `concurrency` clients, prompts taken in turn (request i asks prompts[i % len])."""
    if concurrency < 1 or requests < 1:
        raise ValueError(f"concurrency and requests must be >= 1, got {concurrency} and {requests}")
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    todo = iter(range(requests))
    answers: list[Answer] = []
    async with httpx.AsyncClient(headers=headers, timeout=timeout_s, limits=limits) as client:
        async def worker() -> None:
            for i in todo:  # shared: each client takes the next request when its last one ended
                k = i % len(prompts)
                answers.append(await _one(client, url, model, prompts[k], max_tokens, k))

        start = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        wall = time.perf_counter() - start
    ok = [a for a in answers if not a.error]
    latencies, ttfts = [a.latency_s for a in ok], [a.ttft_s for a in ok]
    return LevelResult(label=label, concurrency=concurrency, requests=requests, failed=len(answers) - len(ok),
                       wall_s=wall, requests_per_s=len(ok) / wall, output_tokens_per_s=sum(a.tokens for a in ok) / wall,
                       latency_p50_s=percentile(latencies, 50), latency_p99_s=percentile(latencies, 99),
                       ttft_p50_s=percentile(ttfts, 50), ttft_p99_s=percentile(ttfts, 99), answers=tuple(answers))


def check_servers(servers: Sequence[tuple[str, str]], api_key: str | None = None) -> dict[str, str]:
    """{label: model name} of each server (from /v1/models), or ValueError naming the one that does not answer."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    names = {}
    for label, url in servers:
        try:
            response = httpx.get(f"{url}/v1/models", headers=headers, timeout=10)
            response.raise_for_status()
            names[label] = response.json()["data"][0]["id"]
        except (httpx.HTTPError, ValueError, KeyError, IndexError) as err:
            raise ValueError(f"server {label!r} at {url} does not answer GET /v1/models ({err}); start it with "
                             "`specheads serve` first") from None
    return names


def loadtest(servers: Sequence[tuple[str, str]], prompts: Sequence[str], *, concurrency: Sequence[int],
             requests: Callable[[int], int], max_tokens: int, api_key: str | None = None, warmup: int = 1,
             progress: Callable[[str], None] | None = None) -> list[LevelResult]:
    """Every server at every concurrency level (`requests(c)` requests at level c), servers taking turns within a
    level after `warmup` unmeasured requests each."""
    if not servers:
        raise ValueError("name at least one server (LABEL=URL)")
    if not prompts:
        raise ValueError("the load test needs at least one prompt")
    names = check_servers(servers, api_key)
    for label, url in servers:
        if warmup:
            asyncio.run(run_level(url, prompts, label=label, concurrency=1, requests=warmup, max_tokens=max_tokens,
                                  model=names[label], api_key=api_key))
    results = []
    for c in concurrency:
        for label, url in servers:
            if progress is not None:
                progress(f"{label}: concurrency {c}, {requests(c)} requests")
            results.append(asyncio.run(run_level(url, prompts, label=label, concurrency=c, requests=requests(c),
                                                 max_tokens=max_tokens, model=names[label], api_key=api_key)))
    return results


def mismatches(results: Sequence[LevelResult]) -> list[str]:
    """Prompts whose answers differ between servers or levels (greedy answers must all be equal), and failures."""
    reference: dict[int, tuple[str, str]] = {}
    found = []
    for level in results:
        for a in level.answers:
            where = f"{level.label} at concurrency {level.concurrency}"
            if a.error:
                found.append(f"prompt {a.prompt}: {where} failed: {a.error}")
                continue
            first = reference.setdefault(a.prompt, (where, a.text))
            if a.text != first[1]:
                found.append(f"prompt {a.prompt}: {where} answered differently from {first[0]}")
    return found


def save_results(path: Path, servers: Sequence[tuple[str, str]], results: Sequence[LevelResult], *,
                 max_tokens: int) -> None:
    """Every level's figures and answers as one JSON file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"servers": dict(servers), "max_tokens": max_tokens,
                                "levels": [asdict(r) for r in results]}, indent=1), encoding="utf-8")
