"""Issue 21's bar, tried as a new user would: `qtool signoff` against two endpoints served by `qtool serve`
(baseline: the default model; candidate: its INT4 quantization, argv[1], made with
`qtool quantize --model default --recipe int4-rtn --output DIR`), each behind its own API key given through the
environment. Sizes: the sign-off's defaults made explicit (--limit 8, tiers 1,8 of 16 requests, 5 rounds) and the
shipped `deployment` policy; BAR21_SMALL=1 runs the 2-item, 2-round smoke size instead (a loaded machine).

Run from the repository root:
  QTOOLKIT_SRC=$PWD python3 measurements/2026-12-01/session7/bar-issue21.py /tmp/int4 /tmp/bar21
Writes what it observed (exit codes, verdict, gates, bench tier endpoints, report lines, key leaks, the
standalone eval / bench serve figures beside the report's) to bar-issue21.json beside this file.
"""
import datetime
import json
import os
import pathlib
import subprocess
import sys
import time

from qtoolkit.server.process import free_port

OUT = pathlib.Path(__file__).with_name("bar-issue21" + ("-small" if os.environ.get("BAR21_SMALL") == "1" else "")
                                       + ".json")
KEYS = {"candidate": "cand-bar21-5ecret", "baseline": "base-bar21-5ecret"}
SMALL_RUN = os.environ.get("BAR21_SMALL") == "1"
LIMIT, TIERS, REQUESTS, ROUNDS = ("2", "1,2", "2", "2") if SMALL_RUN else ("8", "1,8", "16", "5")
SMALL = ["--limit", LIMIT, "--concurrency", TIERS, "--num-requests", REQUESTS, "--rounds", ROUNDS]


def qtool(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "qtoolkit", *args], capture_output=True, text=True,
                          env=os.environ | {"QTOOLKIT_QUIET": "1", "OMP_NUM_THREADS": "1"} | (env or {}))


def serve(model: str, key: str, port: int) -> tuple[subprocess.Popen, str]:
    proc = subprocess.Popen([sys.executable, "-m", "qtoolkit", "serve", "--model", model, "--port", str(port),
                             "--api-key", key, "--kv-cache-memory", "256MiB", "--log-level", "warning"],
                            env=os.environ | {"QTOOLKIT_QUIET": "1"})
    return proc, f"http://127.0.0.1:{port}"


def wait_healthy(url: str) -> None:
    import httpx
    deadline = time.monotonic() + 1200  # a loaded shared machine can take minutes to load a model
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise SystemExit(f"{url} never became healthy")


def main() -> None:
    cand_dir, work = sys.argv[1], pathlib.Path(sys.argv[2])
    role_env = {"QTOOLKIT_CANDIDATE_API_KEY": KEYS["candidate"], "QTOOLKIT_BASELINE_API_KEY": KEYS["baseline"]}
    res: dict = {"when": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                 "commit": subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                                          text=True).stdout.strip(), "load_average": os.getloadavg(),
                 "candidate_checkpoint": cand_dir, "sizes": SMALL}
    # BAR21_PORTS=CAND,BASE serves on the ports of an earlier run, so the sign-off reuses its finished steps
    ports = [int(p) for p in os.environ.get("BAR21_PORTS", "").split(",") if p] or [free_port(), free_port()]
    servers = {"baseline": serve("default", KEYS["baseline"], ports[1]),
               "candidate": serve(cand_dir, KEYS["candidate"], ports[0])}
    try:
        for _, url in servers.values():
            wait_healthy(url)
        urls = {r: f"{u}/v1" for r, (_, u) in servers.items()}
        out = work / "signoff"
        t = time.perf_counter()
        p = qtool("signoff", "--candidate-endpoint", urls["candidate"], "--baseline-endpoint", urls["baseline"],
                  "--model", cand_dir, "--baseline", "default", "--policy", "deployment", *SMALL,
                  "--output", str(out), env=role_env)
        res["signoff"] = {"exit_code": p.returncode, "seconds": round(time.perf_counter() - t, 1),
                          "stderr_tail": p.stderr.strip().splitlines()[-3:], "stdout_tail": p.stdout.strip()[-600:]}
        report = json.loads((out / "report.json").read_text())
        md = (out / "report.md").read_text()
        res["report"] = {
            "verdict": report["verdict"], "reasons": report["reasons"],
            "gates": {g["name"]: {"verdict": g["verdict"], "point": g["point"], "judged": g.get("judged"),
                                  "state": g["state"]} for g in report["gates"]},
            "deployments": {r: {k: d[k] for k in ("url", "model_id", "model_ids", "server", "version",
                                                  "api_key_env")} for r, d in report["deployments"].items()},
            "bench_tier_endpoints": [{"concurrency": t["concurrency"], **{r: e["endpoint"] for r, e in
                                                                          t["endpoints"].items()}}
                                     for t in report["deployment_bench"]["tiers"]],
            "ablation": report["ablation"], "diagnose": report["diagnose"],
            "not_measurable": [x["key"] for x in report["not_measurable"]],
            "md_ablation_heading": [ln for ln in md.splitlines() if ln.startswith("## Ablation")],
        }
        # standalone qtool eval (twice on the smoke size: does the deployment itself repeat?) and qtool bench serve
        alone = []
        for i in (1, 2) if SMALL_RUN else (1,):
            ev = work / f"eval-{i}.json"
            ev.unlink(missing_ok=True)
            p = qtool("eval", "--model", cand_dir, "--baseline", "default", "--endpoint", urls["candidate"],
                      "--baseline-endpoint", urls["baseline"], "--task", "code,summarization", "--limit", LIMIT,
                      "--output", str(ev), env=role_env)
            alone.append(json.loads(ev.read_text()) if p.returncode == 0 else {"error": p.stderr[-300:]})
        inside_eval = json.loads((out / "eval.json").read_text())

        def differing(a: dict, b: dict) -> list[str]:
            return [f"{t}/{i}/{side}" for t in ("code", "summarization") for i in a["tasks"][t]["records"]
                    for side in ("candidate", "baseline")
                    if a["tasks"][t]["records"][i][side].get("completion", a["tasks"][t]["records"][i][side].get(
                        "summary")) != b["tasks"][t]["records"][i][side].get(
                        "completion", b["tasks"][t]["records"][i][side].get("summary"))]
        res["standalone_eval"] = {
            "exit_codes": [2 if "error" in a else 0 for a in alone],
            "summaries_equal_to_signoff": [{t: a.get("tasks", {}).get(t, {}).get("summary") == report["eval"][t]["summary"]
                                            for t in ("code", "summarization")} for a in alone],
            "generations_differing_from_signoff": [differing(a, inside_eval) if "tasks" in a else None for a in alone],
            "generations_differing_run1_vs_run2": differing(*alone) if len(alone) == 2 and all(
                "tasks" in a for a in alone) else None}
        inside = json.loads((out / "bench.json").read_text())
        keys = ("num_requests", "completed", "failed", "prompt_tokens", "output_tokens")
        res["standalone_bench"] = {}
        for role in ("candidate", "baseline"):
            bj = work / f"bench-{role}.json"
            bj.unlink(missing_ok=True)
            p = qtool("bench", "serve", "--endpoint", urls[role], "--model", report["deployments"][role]["model_id"],
                      "--concurrency", TIERS, "--num-requests", REQUESTS, "--mean-output-tokens", "48",
                      "--max-output-tokens", "96", "--output", str(bj),
                      env={"QTOOLKIT_API_KEY": KEYS[role]})
            alone = json.loads(bj.read_text()) if p.returncode == 0 else {"tiers": []}
            res["standalone_bench"][role] = {"exit_code": p.returncode, "stderr_tail": p.stderr[-300:], "tiers": [
                {"concurrency": a["concurrency"], "standalone": {k: a["results"]["endpoint"][k] for k in keys},
                 "in_signoff": {k: b["results"][role][k] for k in keys}}
                for a, b in zip(alone["tiers"], inside["tiers"], strict=False)]}
        files = [f for f in work.rglob("*") if f.is_file()]
        res["key_leaks"] = {"files_checked": len(files), "files_with_a_key": [
            str(f) for f in files if any(k.encode() in f.read_bytes() for k in KEYS.values())]}
        dead = f"http://127.0.0.1:{free_port()}/v1"
        p = qtool("signoff", "--candidate-endpoint", urls["candidate"], "--baseline-endpoint", dead,
                  "--model", cand_dir, "--baseline", "default", "--output", str(work / "never"), env=role_env)
        res["unreachable_baseline"] = {"exit_code": p.returncode, "stderr_lines": p.stderr.strip().splitlines(),
                                       "output_created": (work / "never").exists()}
    finally:
        for proc, _ in servers.values():
            proc.terminate()
            proc.wait(30)
    r = res["report"]
    res["bar"] = {
        "decides": r["verdict"] in ("PASS", "FAIL")
        and res["signoff"]["exit_code"] == {"PASS": 0, "FAIL": 1}[r["verdict"]],
        "bench_tiers_name_the_endpoints": all(t["candidate"] == servers["candidate"][1]
                                              and t["baseline"] == servers["baseline"][1]
                                              for t in r["bench_tier_endpoints"]),
        "ablation_not_measurable": r["ablation"] is None and "ablation" in r["not_measurable"]
        and any("not measurable" in h for h in r["md_ablation_heading"]),
        "standalone_eval_equal": all(all(x.values()) for x in res["standalone_eval"]["summaries_equal_to_signoff"]),
        "standalone_bench_counts_equal": all(t["standalone"] == t["in_signoff"] for b in res["standalone_bench"].values()
                                             for t in b["tiers"]) and all(b["tiers"] for b in
                                                                          res["standalone_bench"].values()),
        "unreachable_is_one_line_exit_2": res["unreachable_baseline"]["exit_code"] == 2
        and len(res["unreachable_baseline"]["stderr_lines"]) == 1 and not res["unreachable_baseline"]["output_created"],
        "no_key_in_output_files": not res["key_leaks"]["files_with_a_key"],
    }
    OUT.write_text(json.dumps(res, indent=2, default=str) + "\n")
    print(json.dumps(res["bar"], indent=2))


if __name__ == "__main__":
    main()
