"""Issue 14's bar, tried as a new user would, against `qtool serve --api-key` (model: argv[1]).

Run from the repository root: QTOOLKIT_SRC=$PWD python3 measurements/2026-12-01/server-hardening-bar.py default
"""
import json
import socket
import subprocess
import sys
import time

import httpx

model = sys.argv[1]
with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
url = f"http://127.0.0.1:{port}"
proc = subprocess.Popen([sys.executable, "-m", "qtoolkit", "serve", "--model", model, "--port", str(port),
                         "--api-key", "k3y", "--kv-cache-memory", "64MiB", "--log-level", "warning"])
try:
    for _ in range(600):
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    key = {"Authorization": "Bearer k3y"}
    big = b'{"prompt": "' + b"x" * (64 * 1024 * 1024) + b'"}'
    t = time.perf_counter()
    try:
        r = httpx.post(f"{url}/v1/completions", content=big, headers={"content-type": "application/json"}, timeout=30)
        print("64MiB unauthenticated:", r.status_code, f"{time.perf_counter() - t:.3f} s", r.json()["error"]["code"])
    except httpx.HTTPError as e:
        print("64MiB unauthenticated: client error", type(e).__name__, e, f"{time.perf_counter() - t:.3f} s")
    t = time.perf_counter()
    r = httpx.post(f"{url}/v1/completions", content=big, headers={"content-type": "application/json", **key}, timeout=30)
    print("64MiB with key:", r.status_code, f"{time.perf_counter() - t:.3f} s", r.json()["error"]["code"])
    r = httpx.post(f"{url}/v1/completions", content=b'{"prompt": "x", max_tok', headers={"content-type": "application/json"})
    print("malformed JSON, no key:", r.status_code, r.json()["error"]["code"])
    r = httpx.post(f"{url}/v1/completions", json={"prompt": "x", "stop": [f"a{i}" for i in range(100_000)]}, headers=key)
    print("100k stop strings:", r.status_code, r.json()["error"]["param"], "|", r.json()["error"]["message"][:90])
    r = httpx.post(f"{url}/v1/completions", json={"prompt": "x", "seed": 2**64}, headers=key)
    print("seed=2**64:", r.status_code, r.json()["error"]["param"], "|", r.json()["error"]["message"][:90])
    r = httpx.post(f"{url}/v1/completions", json={"prompt": ["a"] * 100, "n": 16}, headers=key)
    print("100 prompts x n=16:", r.status_code, r.headers.get("retry-after"), r.json()["error"]["code"], "|",
          r.json()["error"]["message"][:110])
    body = {"prompt": "def add(a, b):\n    return a + b\n\n\ndef sub(a, b):\n    return a - b\n\n\ndef mul(a, b):\n", "max_tokens": 64, "temperature": 0,
            "stop": ["\ndef ", "\n\nIn this"]}
    final = httpx.post(f"{url}/v1/completions", json=body, headers=key, timeout=60).json()["choices"][0]
    with httpx.stream("POST", f"{url}/v1/completions", json=body | {"stream": True}, headers=key, timeout=60) as resp:
        chunks = [json.loads(ln[6:]) for ln in resp.iter_lines() if ln.startswith("data: {")]
    streamed = "".join(c["choices"][0]["text"] for c in chunks)
    print("stream == final:", streamed == final["text"], repr(final["text"]), final["finish_reason"])
    nostop = httpx.post(f"{url}/v1/completions", json=body | {"stop": None}, headers=key, timeout=60).json()
    print("  same request without stop:", repr(nostop["choices"][0]["text"][:120]))
    r = httpx.post(f"{url}/v1/completions", json={"prompt": "hello", "max_tokens": 5, "ignore_eos": True}, headers=key, timeout=60)
    print("afterwards:", r.status_code, r.json()["usage"], httpx.get(f"{url}/health").json())
finally:
    proc.terminate()
    proc.wait(15)
