"""Issue 14's bar, tried as a new user would, against `qtool serve --api-key` on the default model.

Run from the repository root: QTOOLKIT_SRC=$PWD python3 measurements/2026-12-01/session7/bar-issue14.py
Writes what it observed (status codes, error codes, times, RSS) to bar-issue14.json beside this file.
"""
import datetime
import json
import os
import pathlib
import socket
import subprocess
import sys
import time

import httpx

OUT = pathlib.Path(__file__).with_suffix(".json")
KEY = "k3y-bar14"
AUTH = {"Authorization": f"Bearer {KEY}"}
JSON = {"content-type": "application/json"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rss_mib(pid: int) -> float:
    for line in pathlib.Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def timed(fn):
    t = time.perf_counter()
    try:
        r = fn()
        return r, time.perf_counter() - t, None
    except httpx.HTTPError as e:  # the server may close the connection while the client is still sending
        return None, time.perf_counter() - t, f"{type(e).__name__}: {e}"


def outcome(r, seconds=None, err=None) -> dict:
    row: dict = {"seconds": None if seconds is None else round(seconds, 3)}
    if r is None:
        return row | {"status": None, "client_error": err}
    body = r.json() if r.headers.get("content-type", "").startswith("application/json") else {}
    e = body.get("error") or {}
    return row | {"status": r.status_code, "code": e.get("code"), "param": e.get("param"),
                  "message": (e.get("message") or "")[:160], "retry_after": r.headers.get("retry-after")}


def main() -> None:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "qtoolkit", "serve", "--model", "default", "--port", str(port), "--api-key", KEY,
           "--kv-cache-memory", "64MiB", "--log-level", "warning"]
    proc = subprocess.Popen(cmd, env=os.environ | {"QTOOLKIT_QUIET": "1"})
    res: dict = {"when": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                 "commit": subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                                          text=True).stdout.strip(),
                 "load_average": os.getloadavg(), "server": " ".join(cmd[1:]).replace(KEY, "KEY")}
    try:
        for _ in range(600):
            try:
                if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        c = httpx.Client(base_url=url, timeout=60)
        big = b'{"prompt": "' + b"x" * (64 * 1024 * 1024) + b'"}'
        rss0 = rss_mib(proc.pid)
        r, s, err = timed(lambda: c.post("/v1/completions", content=big, headers=JSON))
        res["unauth_64mib"] = outcome(r, s, err) | {"server_rss_growth_mib": round(rss_mib(proc.pid) - rss0, 1)}

        def chunks():
            for _ in range(64):
                yield b"x" * (1024 * 1024)
        r, s, err = timed(lambda: c.post("/v1/completions", content=chunks(), headers=JSON))
        res["unauth_64mib_chunked"] = outcome(r, s, err)
        r, s, err = timed(lambda: c.post("/v1/completions", content=big, headers=JSON | AUTH))
        res["keyed_64mib"] = outcome(r, s, err)
        bad = b'{"prompt": "x", max_tok'
        res["malformed_json_no_key"] = outcome(c.post("/v1/completions", content=bad, headers=JSON))
        res["malformed_json_with_key"] = outcome(c.post("/v1/completions", content=bad, headers=JSON | AUTH))
        stops = [f"a{i}" for i in range(100_000)]
        res["stop_100k"] = outcome(*timed(lambda: c.post("/v1/completions", json={"prompt": "x", "stop": stops},
                                                         headers=AUTH)))
        for name, seed in (("seed_2_pow_64", 2**64), ("seed_negative_2_pow_64", -(2**64))):
            res[name] = outcome(c.post("/v1/completions", json={"prompt": "x", "seed": seed}, headers=AUTH))
        res["fan_out_100_prompts_n16"] = outcome(c.post("/v1/completions", json={"prompt": ["a"] * 100, "n": 16},
                                                        headers=AUTH))
        res["prompt_list_100k"] = outcome(*timed(lambda: c.post(
            "/v1/completions", json={"prompt": ["a"] * 100_000, "max_tokens": 1}, headers=AUTH)))
        body = {"prompt": "def add(a, b):\n    return a + b\n\n\ndef sub(a, b):\n    return a - b\n\n\ndef mul(a, b):\n",
                "max_tokens": 64, "temperature": 0, "stop": ["\ndef ", "product", "`mul` takes"]}
        # "`mul` takes" is a prefix of the text for 6 characters, then not: held back, then released
        final = c.post("/v1/completions", json=body, headers=AUTH).json()["choices"][0]
        with c.stream("POST", "/v1/completions", json=body | {"stream": True}, headers=AUTH) as resp:
            chunk_texts = [json.loads(ln[6:])["choices"][0]["text"] for ln in resp.iter_lines()
                           if ln.startswith("data: {")]
        nostop = c.post("/v1/completions", json=body | {"stop": None}, headers=AUTH).json()["choices"][0]["text"]
        res["stream_with_stops"] = {"stops": body["stop"], "final_text": final["text"],
                                    "finish_reason": final["finish_reason"], "streamed": "".join(chunk_texts),
                                    "chunks": len(chunk_texts), "equal": "".join(chunk_texts) == final["text"],
                                    "text_without_stops": nostop[:120]}
        r = c.post("/v1/completions", json={"prompt": "hello", "max_tokens": 5, "ignore_eos": True}, headers=AUTH)
        res["afterwards"] = {"status": r.status_code, "usage": r.json().get("usage"),
                             "health": c.get("/health").json(), "server_alive": proc.poll() is None,
                             "metrics_status": c.get("/metrics").status_code}
    finally:
        proc.terminate()
        proc.wait(30)
    a = res
    res["bar"] = {
        "unauth_64mib_refused_under_1s": a["unauth_64mib"]["status"] == 401 and a["unauth_64mib"]["seconds"] < 1,
        "malformed_json_no_key_401": a["malformed_json_no_key"]["status"] == 401,
        "stop_100k_400": a["stop_100k"]["status"] == 400 and a["stop_100k"]["param"] == "stop",
        "seed_out_of_range_400": a["seed_2_pow_64"]["status"] == 400 and a["seed_2_pow_64"]["param"] == "seed",
        "fan_out_non_retryable_4xx": 400 <= (a["fan_out_100_prompts_n16"]["status"] or 0) < 500
        and a["fan_out_100_prompts_n16"]["retry_after"] is None,
        "stream_equals_final_with_stops": a["stream_with_stops"]["equal"],
        "answers_normally_afterwards": a["afterwards"]["status"] == 200 and a["afterwards"]["server_alive"],
    }
    OUT.write_text(json.dumps(res, indent=2) + "\n")
    print(json.dumps(res["bar"], indent=2))


if __name__ == "__main__":
    main()
