"""Bounded load on loopback: hundreds of concurrent streamed requests, a share of clients leaving early.

The server must keep answering throughout, every request that stays must get exactly its tokens, and once the
load is gone every KV block must be free again (aborts release blocks) and no admission slot may leak.
"""

from __future__ import annotations

import asyncio
import json
import random
import time

import httpx
from test_server import make_app, metrics, running, wait_until_idle

NUM_REQUESTS = 240
LEAVE_AT_HEADERS = 0.1  # share of clients that close before any token
LEAVE_AFTER_FIRST = 0.15  # share that close after the first token
LEAVER_MAX_TOKENS = 1900
DEADLINE_S = 180.0
IDLE_TIMEOUT_S = 10.0


async def _client(client: httpx.AsyncClient, url: str, i: int, max_tokens: int, leave: str | None) -> dict:
    body = {"prompt": f"Request {i}: write a few words about load tests.", "max_tokens": max_tokens,
            "ignore_eos": True, "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}
    async with client.stream("POST", f"{url}/v1/completions", json=body) as resp:
        if resp.status_code != 200:
            return {"status": resp.status_code}
        if leave == "headers":
            return {"status": 200, "left": True}
        chunks, usage, done = 0, None, False
        async for line in resp.aiter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                done = True
                break
            msg = json.loads(line[6:])
            if msg.get("usage"):
                usage = msg["usage"]
            elif msg["choices"]:
                chunks += 1
                if leave == "first":
                    return {"status": 200, "left": True}
        return {"status": 200, "left": False, "done": done, "usage": usage, "max_tokens": max_tokens}


async def _probe_health(url: str, stop: asyncio.Event) -> list[float]:
    """Time /health while the load runs: the event loop must stay responsive."""
    latencies = []
    async with httpx.AsyncClient(timeout=10.0) as client:
        while not stop.is_set():
            t = time.perf_counter()
            r = await client.get(f"{url}/health")
            assert r.status_code == 200
            latencies.append(time.perf_counter() - t)
            await asyncio.sleep(0.2)
    return latencies


async def _load(url: str) -> tuple[list[dict], list[float]]:
    rng = random.Random(0)
    plan = []
    for i in range(NUM_REQUESTS):
        u = rng.random()
        leave = "headers" if u < LEAVE_AT_HEADERS else "first" if u < LEAVE_AT_HEADERS + LEAVE_AFTER_FIRST else None
        # Leavers ask for ~all the context: only an abort on disconnect frees their blocks within the test.
        plan.append((i, rng.randint(2, 12) if leave is None else LEAVER_MAX_TOKENS, leave))
    limits = httpx.Limits(max_connections=NUM_REQUESTS + 10, max_keepalive_connections=0)
    stop = asyncio.Event()
    async with httpx.AsyncClient(limits=limits, timeout=httpx.Timeout(120.0)) as client:
        probe = asyncio.create_task(_probe_health(url, stop))
        results = await asyncio.gather(*(_client(client, url, *p) for p in plan))
        stop.set()
        return list(results), await probe


def test_hundreds_of_streams_with_early_disconnects(tiny_model_dir):
    with running(make_app(tiny_model_dir, max_num_seqs=32, max_waiting=NUM_REQUESTS)) as url:
        start = time.perf_counter()
        results, health = asyncio.run(asyncio.wait_for(_load(url), DEADLINE_S))
        print(f"load: {time.perf_counter() - start:.1f} s, worst /health {max(health):.3f} s")
        assert all(r["status"] == 200 for r in results), {r["status"] for r in results}
        stayed = [r for r in results if not r["left"]]
        left = [r for r in results if r["left"]]
        assert len(stayed) > NUM_REQUESTS // 2 and len(left) > NUM_REQUESTS // 10
        for r in stayed:  # every client that stayed got all its tokens and a clean end
            assert r["done"] and r["usage"]["completion_tokens"] == r["max_tokens"], r
        assert health and max(health) < 10.0

        m = wait_until_idle(url, IDLE_TIMEOUT_S)
        assert m["qtool_kv_blocks_free"] == m["qtool_kv_blocks_total"]
        assert m["vllm:num_requests_waiting"] == 0
        r = httpx.post(f"{url}/v1/completions", json={"prompt": "still there?", "max_tokens": 3, "ignore_eos": True},
                       timeout=30.0)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
        assert metrics(url)["qtool_kv_blocks_used"] == 0
