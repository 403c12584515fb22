"""The checks of scripts/docker_check.sh, run against a built image and the bare install of the same commit.

Every server listens on 127.0.0.1 (containers with --network host). Prints one line per check and writes
WORK/docker_check.json; exit code 1 if any check failed.
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import json
import os
import platform
import re
import secrets
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
RESULTS: dict = {"checks": {}}


def cpu_name() -> str:
    info = {}
    for ln in open("/proc/cpuinfo"):
        key, _, value = ln.partition(":")
        info.setdefault(key.strip(), value.strip())
    return f"{info.get('model name', '?')} (family {info.get('cpu family', '?')} model {info.get('model', '?')}, " \
           f"{len(os.sched_getaffinity(0))} CPUs)"


def check(name: str, ok: bool, detail: str) -> bool:
    RESULTS["checks"][name] = {"ok": bool(ok), "detail": detail}
    print(f"{'PASS' if ok else 'FAIL'}  {name}: {detail}", flush=True)
    return ok


def sh(*cmd: str, check_rc: bool = True, timeout: float = 600, env: dict | None = None) -> str:
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    if check_rc and p.returncode:
        raise RuntimeError(f"{' '.join(cmd)} -> {p.returncode}: {p.stderr.strip()[-2000:]}")
    return p.stdout


def container(image: str, name: str, port: int, args: list[str], mounts: list[str] = (), env: dict | None = None):
    sh("docker", "rm", "-f", name, check_rc=False)
    cmd = ["docker", "run", "-d", "--init", "--network", "host", "--name", name, "-e", f"TPSERVE_PORT={port}"]
    for k, v in (env or {}).items():
        cmd += ["-e", f"{k}={v}"]
    for m in mounts:
        cmd += ["-v", m]
    sh(*cmd, image, "--host", "127.0.0.1", *args)
    return name


def bare(bin_dir: str, port: int, args: list[str], log: Path) -> subprocess.Popen:
    return subprocess.Popen([f"{bin_dir}/tpserve", "serve", "--host", "127.0.0.1", "--port", str(port), *args],
                            stdout=open(log, "w"), stderr=subprocess.STDOUT)


def wait_health(url: str, alive, what: str, timeout: float = 300) -> float:
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        if not alive():
            raise RuntimeError(f"{what} exited before it served")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return time.monotonic() - t0
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"{what}: /health not 200 after {timeout:.0f} s")


def running(name: str) -> bool:
    return sh("docker", "inspect", "-f", "{{.State.Running}}", name, check_rc=False).strip() == "true"


def chat(url: str, messages=QUESTION, max_tokens: int = 32) -> str:
    r = httpx.post(url + "/v1/chat/completions", timeout=120,
                   json={"model": model_id(url), "messages": messages, "temperature": 0, "max_tokens": max_tokens})
    r.raise_for_status()
    return r.json()["choices"][0]["message"]["content"]


def complete(url: str, prompt: str, max_tokens: int = 32) -> str:
    r = httpx.post(url + "/v1/completions", timeout=120,
                   json={"model": model_id(url), "prompt": prompt, "temperature": 0, "max_tokens": max_tokens})
    r.raise_for_status()
    return r.json()["choices"][0]["text"]


def model_id(url: str) -> str:
    return httpx.get(url + "/v1/models", timeout=10).json()["data"][0]["id"]


def throughput(url: str, concurrency: int, requests: int, max_tokens: int = 128) -> float:
    """Generated tokens per second over `requests` completions of max_tokens each, `concurrency` at a time."""
    model = model_id(url)

    def one(i: int) -> int:
        r = httpx.post(url + "/v1/completions", timeout=300, json={
            "model": model, "prompt": f"Request {i}: tell a long story about the sea and a lighthouse keeper.",
            "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True})
        r.raise_for_status()
        return r.json()["usage"]["completion_tokens"]

    t0 = time.perf_counter()
    with cf.ThreadPoolExecutor(concurrency) as pool:
        tokens = sum(pool.map(one, range(requests)))
    return tokens / (time.perf_counter() - t0)


def compare_throughput(label: str, urls: dict[str, str], rounds: int) -> dict:
    """Interleaved rounds. This host's speed drifts by tens of percent within a minute, so each round measures every
    level as bare, docker, docker, bare (or the mirror image, alternating), seconds apart: a drift that is linear over
    the four cancels out of the round's ratio, sum(docker) / sum(bare)."""
    levels = {"batch 1": (1, 2), "8 streams": (8, 16)}  # (concurrency, requests): 3-5 s per measurement here
    out = {lvl: {"bare": [], "docker": [], "ratios": []} for lvl in levels}
    for url in urls.values():
        throughput(url, 1, 1, 16)  # warm-up
    for r in range(rounds):
        order = ["bare", "docker", "docker", "bare"] if r % 2 == 0 else ["docker", "bare", "bare", "docker"]
        for lvl, (conc, num) in levels.items():
            got = {"bare": [], "docker": []}
            for who in order:
                got[who].append(throughput(urls[who], conc, num))
            for who in got:
                out[lvl][who].append(sum(got[who]) / 2)
            out[lvl]["ratios"].append(sum(got["docker"]) / sum(got["bare"]))
        print(f"      {label} round {r + 1}: " + ", ".join(
            f"{lvl} bare {out[lvl]['bare'][-1]:.1f} / docker {out[lvl]['docker'][-1]:.1f} tok/s "
            f"({out[lvl]['ratios'][-1]:.3f})" for lvl in levels), flush=True)
    for lvl in levels:
        out[lvl]["median_ratio"] = statistics.median(out[lvl]["ratios"])
    return out


def drain_check(url: str, name: str) -> None:
    """A stream in flight when `docker stop` comes finishes, and the container exits 0."""
    got: dict = {"text": "", "finish": None, "done": False, "chunks": 0}
    started = threading.Event()

    def stream() -> None:
        with httpx.stream("POST", url + "/v1/completions", timeout=120, json={
                "model": model_id(url), "prompt": "Once upon a time", "max_tokens": 200, "temperature": 0,
                "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}) as r:
            for line in r.iter_lines():
                if not line.startswith("data: "):
                    continue
                if line == "data: [DONE]":
                    got["done"] = True
                    break
                ev = json.loads(line[6:])
                for c in ev.get("choices", []):
                    got["chunks"] += 1
                    got["finish"] = c.get("finish_reason") or got["finish"]
                if ev.get("usage"):
                    got["usage"] = ev["usage"]["completion_tokens"]
                if got["chunks"] >= 5:
                    started.set()

    t = threading.Thread(target=stream, daemon=True)
    t.start()
    started.wait(60)
    t0 = time.monotonic()
    sh("docker", "stop", "-t", "60", name)
    stop_s = time.monotonic() - t0
    t.join(30)
    code = sh("docker", "inspect", "-f", "{{.State.ExitCode}}", name).strip()
    ok = got["done"] and got["finish"] == "length" and got.get("usage") == 200 and code == "0"
    check("docker stop drains a stream", ok, f"stream finished={got['done']} finish_reason={got['finish']} "
          f"tokens={got.get('usage')}, docker stop took {stop_s:.1f} s, exit code {code}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--image", required=True)
    ap.add_argument("--work", required=True)
    ap.add_argument("--bare", required=True, help="bin folder of the bare install (tpserve, python)")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--port", type=int, default=18600)
    ap.add_argument("--compose", default="docker compose")
    ap.add_argument("--compose-file", required=True)
    ap.add_argument("--build-seconds", type=int, default=None)
    args = ap.parse_args()
    work = Path(args.work)
    cpu = cpu_name()
    RESULTS.update(image=args.image, cpu=cpu, machine=platform.machine(), build_seconds=args.build_seconds,
                   image_bytes=int(sh("docker", "image", "inspect", "-f", "{{.Size}}", args.image)),
                   started=time.strftime("%Y-%m-%d %H:%M:%S"))
    print(f"      image {args.image}: {RESULTS['image_bytes'] / 1e9:.2f} GB, built in {args.build_seconds} s; "
          f"CPU {cpu}", flush=True)
    chooses = json.loads(sh(f"{args.bare}/python", "-m", "sharding.cpu.variants", "--show"))["cpu_chooses"]
    p_bare, p_dock = args.port, args.port + 1
    u_bare, u_dock = f"http://127.0.0.1:{p_bare}", f"http://127.0.0.1:{p_dock}"
    failed = False
    procs: list = []
    try:
        for precision, extra in (("float32", []), ("int4", ["-q", "int4"])):
            name = f"tpserve-check-{precision}"
            container(args.image, name, p_dock, extra)
            b = bare(args.bare, p_bare, extra, work / f"bare-{precision}.log")
            procs.append(b)
            wait_health(u_dock, lambda: running(name), name)
            wait_health(u_bare, lambda: b.poll() is None, "the bare server")
            if precision == "float32":
                t0 = time.monotonic()
                status = ""
                while time.monotonic() - t0 < 120:
                    status = sh("docker", "inspect", "-f", "{{.State.Health.Status}}", name).strip()
                    if status in ("healthy", "unhealthy"):
                        break
                    time.sleep(1)
                failed |= not check("healthcheck", status == "healthy", f"docker reports {status!r} "
                                    f"(/health 200 first, then the image's HEALTHCHECK)")
                answer = chat(u_dock)
                failed |= not check("default model answers", "Paris" in answer, repr(answer))
                out = subprocess.run(["docker", "logs", name], capture_output=True, text=True)
                logs = out.stdout + out.stderr
                serving = next((ln for ln in logs.splitlines() if "serving" in ln and "http://" in ln), "")
                m = re.search(r"kernels (\S+) \(prebuilt\)", serving)
                failed |= not check("startup line names the kernel variant", bool(m) and m.group(1) == chooses,
                                    f"{serving.strip()!r} (this CPU chooses {chooses})")
                warns = [ln for ln in logs.splitlines() if re.search(r"warn", ln, re.I)]
                failed |= not check("no warnings at start", not warns, "; ".join(warns[:3]) or "none in the log")
                RESULTS["startup_log"] = logs.splitlines()[-12:]
                uids = [ln.split()[1] for ln in sh("docker", "top", name, "-eo", "pid,uid,args").splitlines()[1:]]
                failed |= not check("runs as non-root", bool(uids) and not {"0", "root"} & set(uids),
                                    f"{len(uids)} processes, uids {sorted(set(uids))}")
                RESULTS["single_server_text"] = complete(u_dock, "The capital of France is", 24)
            res = compare_throughput(precision, {"bare": u_bare, "docker": u_dock}, args.rounds)
            RESULTS.setdefault("throughput", {})[precision] = res
            for lvl in ("batch 1", "8 streams"):
                r = res[lvl]
                failed |= not check(f"{precision} {lvl} >= 0.95x bare", r["median_ratio"] >= 0.95,
                                    f"docker / bare median {r['median_ratio']:.3f} (rounds "
                                    f"{', '.join(f'{x:.3f}' for x in r['ratios'])}; bare "
                                    f"{statistics.median(r['bare']):.1f}, docker {statistics.median(r['docker']):.1f} "
                                    "tok/s)")
            if precision == "float32":
                drain_check(u_dock, name)
                failed |= not RESULTS["checks"]["docker stop drains a stream"]["ok"]
            sh("docker", "rm", "-f", name, check_rc=False)
            b.terminate()
            b.wait(60)

        # a mounted checkpoint folder at -tp 2 (the default model as converted by the bare install)
        folder = sh(f"{args.bare}/tpserve", "prepare").strip().splitlines()[-1]
        name = "tpserve-check-mounted"
        container(args.image, name, p_dock, ["/models/smol", "-tp", "2"], mounts=[f"{folder}:/models/smol:ro"])
        wait_health(u_dock, lambda: running(name), name)
        text = complete(u_dock, "The capital of France is", 24)
        answer = chat(u_dock)
        failed |= not check("mounted checkpoint at -tp 2", "Paris" in answer and text == RESULTS["single_server_text"],
                            f"chat {answer!r}; completion equals the single server's: "
                            f"{text == RESULTS['single_server_text']}")
        sh("docker", "rm", "-f", name, check_rc=False)

        # two compose "nodes", torchrun across them, one pipeline stage each
        env = dict(os.environ, TPSERVE_IMAGE=args.image, TPSERVE_PORT=str(p_dock), TPSERVE_THREADS="1",
                   MASTER_PORT=str(args.port + 50), COMPOSE_PROJECT_NAME="tpservecheck",
                   TPSERVE_STORE_SECRET=secrets.token_hex(32))  # the ranks' store's, the same on both nodes
        compose = args.compose.split() + ["-f", args.compose_file]
        sh(*compose, "up", "-d", env=env)
        try:
            wait_health(u_dock, lambda: True, "compose node0", timeout=300)
            text = complete(u_dock, "The capital of France is", 24)
            logs = sh(*compose, "logs", "--no-color", env=env)
            pp = "pipeline parallel size 2" in logs
            failed |= not check("compose: two nodes, torchrun, -pp 2", pp and text == RESULTS["single_server_text"],
                                f"{text!r} equals the single server's: {text == RESULTS['single_server_text']}; "
                                f"startup line says pipeline parallel size 2: {pp}")
        finally:
            (work / "compose.log").write_text(sh(*compose, "logs", "--no-color", env=env, check_rc=False))
            sh(*compose, "down", "-t", "30", env=env, check_rc=False)
    except Exception as e:  # noqa: BLE001 - report what broke, then the summary
        failed = True
        check("ran to the end", False, f"{type(e).__name__}: {e}")
    finally:
        for p in procs:
            if p.poll() is None:
                p.terminate()
        for n in ("float32", "int4", "mounted"):
            sh("docker", "rm", "-f", f"tpserve-check-{n}", check_rc=False)
    RESULTS["passed"] = not failed
    (work / "docker_check.json").write_text(json.dumps(RESULTS, indent=1))
    print(f"{'ALL CHECKS PASSED' if not failed else 'SOME CHECKS FAILED'}; results in {work / 'docker_check.json'}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
