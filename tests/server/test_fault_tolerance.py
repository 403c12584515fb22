"""A rank that dies or hangs costs no request: its replica leaves rotation, its streams continue on another replica
(or wait for it to be restarted) with the same text, and the replica comes back. Real servers, real ranks, real
SIGKILL and SIGSTOP (server/engine/supervisor.py)."""

import asyncio
import json
import os
import signal
import subprocess
import time

import httpx
import pytest

TOKENS = 160
PROMPTS = [f"stream {i} says" for i in range(4)]


def children(pid: int) -> list[int]:
    out = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout
    return sorted(int(x) for x in out.split())


def rank_pid(server_pid: int, rank: int) -> int:
    """The pid of a spawned rank (its environment names it), so the test kills the rank it means."""
    for pid in children(server_pid):
        try:
            env = open(f"/proc/{pid}/environ", "rb").read().split(b"\0")
        except OSError:
            continue
        if f"RANK={rank}".encode() in env:
            return pid
    raise AssertionError(f"no process for rank {rank}")


def body(i: int, seed: int | None = None) -> dict:
    b = {"prompt": PROMPTS[i], "max_tokens": TOKENS, "ignore_eos": True, "temperature": 0, "logprobs": 1}
    if seed is not None:
        b.update(temperature=1.0, seed=seed)
    return b


def undisturbed(s, seeds, logprobs: list | None = None) -> list[str]:
    out = []
    for i, seed in enumerate(seeds):
        r = httpx.post(s.url + "/v1/completions", json=body(i, seed), timeout=120)
        assert r.status_code == 200, r.text
        out.append(r.json()["choices"][0]["text"])
        if logprobs is not None:
            logprobs.append(r.json()["choices"][0]["logprobs"]["token_logprobs"])
    return out


def streams_with_a_fault(s, seeds, fault, after: int = 4):
    """Stream every prompt at once; once every stream has `after` chunks, call fault() (a kill). Also polls /health
    while the streams run. Returns (texts, completion token counts, health codes, seconds of the longest gap between
    two chunks of any stream)."""
    health: list[int] = []
    counts = [0] * len(seeds)
    logprobs: list[list[float]] = [[] for _ in seeds]
    started = asyncio.Event()

    async def one(client, i):
        text, usage, last, gap = "", None, None, 0.0
        async with client.stream("POST", "/v1/completions", json={
                **body(i, seeds[i]), "stream": True, "stream_options": {"include_usage": True}}) as r:
            assert r.status_code == 200
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line[6:])
                assert "error" not in event, event
                if event["choices"]:
                    text += event["choices"][0]["text"]
                    logprobs[i] += event["choices"][0]["logprobs"]["token_logprobs"]
                    now = time.monotonic()
                    gap = max(gap, now - last) if last is not None else 0.0
                    last = now
                    counts[i] += 1
                    if min(counts) >= after and not started.is_set():
                        started.set()
                        fault()
                if event.get("usage"):
                    usage = event["usage"]["completion_tokens"]
        return text, usage, gap

    async def poll(client, done):
        while not done.is_set():
            health.append((await client.get("/health")).status_code)
            await asyncio.sleep(0.05)

    async def run():
        done = asyncio.Event()
        async with httpx.AsyncClient(base_url=s.url, timeout=300) as client:
            poller = asyncio.create_task(poll(client, done))
            results = await asyncio.gather(*(one(client, i) for i in range(len(seeds))))
            done.set()
            await poller
        return results

    results = asyncio.run(run())
    streams_with_a_fault.logprobs = logprobs
    return [r[0] for r in results], [r[1] for r in results], health, max(r[2] for r in results)


def wait_health(s, status: str, timeout: float = 120) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        r = httpx.get(s.url + "/health", timeout=5)
        if r.json().get("status") == status:
            return r.json()
        assert s.proc.poll() is None, s.tail()
        time.sleep(0.2)
    raise AssertionError(f"/health never said {status!r}: {r.text}\n{s.tail()}")


def metric(s, name: str) -> float:
    for line in httpx.get(s.url + "/metrics").text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise AssertionError(f"{name} not exported")


@pytest.fixture(scope="module")
def dp2(server_factory, checkpoints):
    return server_factory(checkpoints("llama"), 1, "--data-parallel-size", "2", "--max-model-len", "256",
                          "--step-timeout", "4")


SEEDS = [None, None, 7, 11]  # greedy and seeded sampling, on both replicas (the least loaded lane alternates)


def test_dead_replica_streams_continue_on_the_other_one_with_the_same_text(dp2):
    want_logprobs: list = []
    expected = undisturbed(dp2, SEEDS, want_logprobs)
    victim = rank_pid(dp2.proc.pid, 1)
    texts, usage, health, _ = streams_with_a_fault(dp2, SEEDS, lambda: os.kill(victim, signal.SIGKILL))
    assert texts == expected  # greedy and seeded: no token lost, repeated or changed
    assert usage == [TOKENS] * len(SEEDS)  # each token counted once
    for got, want in zip(streams_with_a_fault.logprobs, want_logprobs):  # one logprob per token, the same ones
        assert len(got) == TOKENS and max(abs(a - b) for a, b in zip(got, want)) < 1e-3
    assert health and set(health) == {200}, health  # replica 0 served throughout
    assert metric(dp2, "tpserve_replica_failures_total") == 1
    info = wait_health(dp2, "ok")  # replica 1 was restarted
    assert metric(dp2, "tpserve_replicas_alive") == 2, info
    assert rank_pid(dp2.proc.pid, 1) != victim
    assert undisturbed(dp2, SEEDS) == expected  # the respawned replica serves the same answers


def test_hung_rank_is_killed_after_the_step_timeout_and_its_streams_finish(dp2):
    wait_health(dp2, "ok")
    failures = metric(dp2, "tpserve_replica_failures_total")  # (whatever other tests of the module did to dp2)
    expected = undisturbed(dp2, SEEDS)
    victim = rank_pid(dp2.proc.pid, 1)
    texts, usage, health, gap = streams_with_a_fault(dp2, SEEDS, lambda: os.kill(victim, signal.SIGSTOP))
    assert texts == expected and usage == [TOKENS] * len(SEEDS)
    assert gap >= 3.5, gap  # the streams waited for --step-timeout (4 s), not for the collective timeout
    assert not os.path.exists(f"/proc/{victim}") or "zombie" in open(f"/proc/{victim}/status").read().lower()
    wait_health(dp2, "ok")
    assert metric(dp2, "tpserve_replica_failures_total") == failures + 1


def test_tp2_group_is_respawned_and_then_gives_up_after_the_limit(server_factory, checkpoints):
    s = server_factory(checkpoints("llama"), 2, "--max-model-len", "256", "--max-rank-restarts", "1")
    expected = undisturbed(s, SEEDS[:2])
    victim = rank_pid(s.proc.pid, 1)
    texts, usage, health, gap = streams_with_a_fault(s, SEEDS[:2], lambda: os.kill(victim, signal.SIGKILL))
    assert texts == expected and usage == [TOKENS, TOKENS]  # paused while rank 1 reloaded, then went on
    assert 503 in health  # nothing served meanwhile ("recovering"); requests waited
    info = wait_health(s, "ok")
    assert info == {"status": "ok"}
    assert undisturbed(s, SEEDS[:2]) == expected  # new requests after the respawn
    # the second death within the window is one more than --max-rank-restarts 1: the server gives up
    os.kill(rank_pid(s.proc.pid, 1), signal.SIGKILL)
    assert s.proc.wait(timeout=60) != 0
    assert "not restarting it" in s.log.read_text()


def test_sigkill_of_rank_0_takes_the_respawned_ranks_with_it(dp2):
    """The respawned rank was started by the supervisor's thread: it still dies with rank 0 (PR_SET_PDEATHSIG)."""
    wait_health(dp2, "ok")
    respawned = rank_pid(dp2.proc.pid, 1)
    os.kill(dp2.proc.pid, signal.SIGKILL)
    dp2.proc.wait(timeout=10)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and os.path.exists(f"/proc/{respawned}"):
        if "zombie" in open(f"/proc/{respawned}/status").read().lower():
            break
        time.sleep(0.1)
    assert not os.path.exists(f"/proc/{respawned}") or "zombie" in open(f"/proc/{respawned}/status").read().lower()


@pytest.mark.slow
def test_sigterm_during_a_respawn_drains_and_exits_0(server_factory, checkpoints):
    s = server_factory(checkpoints("llama"), 2, "--max-model-len", "256", "--shutdown-timeout", "60")
    expected = undisturbed(s, SEEDS[:1])
    victim = rank_pid(s.proc.pid, 1)

    def fault():
        os.kill(victim, signal.SIGKILL)
        deadline = time.monotonic() + 60  # until the supervisor is starting rank 1 again
        while "restarting replica" not in s.log.read_text() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert "restarting replica" in s.log.read_text(), s.tail()
        s.proc.send_signal(signal.SIGTERM)

    texts, usage, _, _ = streams_with_a_fault(s, SEEDS[:1], fault)
    assert texts == expected and usage == [TOKENS]
    assert s.proc.wait(timeout=60) == 0
    assert "restarted in" in s.log.read_text()
    assert not children(s.proc.pid)
