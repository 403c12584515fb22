"""Pipeline and data parallel servers: real ranks, a tiny model; replicas behind one HTTP server, a dead middle
stage, and a SIGTERM to the whole process group."""

import asyncio
import os
import time

import httpx
import pytest

from test_reliability import children, drains_under_group_sigterm, kill_mid_stream
from tiny import make_checkpoint


@pytest.fixture(scope="module")
def five_layers(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("five"), "llama", num_hidden_layers=5)


def rank_of(pid: int) -> int:
    env = open(f"/proc/{pid}/environ", "rb").read().split(b"\0")
    return int(next(e for e in env if e.startswith(b"RANK=")).split(b"=", 1)[1])


def test_two_replicas_serve_and_balance(server_factory, checkpoints):
    s = server_factory(checkpoints("llama"), 1, "-dp", "2", "--max-model-len", "256", "--max-num-seqs", "8")
    # long enough for /metrics to see both replicas busy: 8 requests of 40 tokens could finish within one poll
    body = {"model": s.model_name, "max_tokens": 160, "temperature": 0, "ignore_eos": True}
    prompts = [f"request {i} says" for i in range(8)]

    async def run():
        async with httpx.AsyncClient(base_url=s.url, timeout=120) as client:
            alone = [(await client.post("/v1/completions", json={**body, "prompt": p})).json() for p in prompts[:2]]
            tasks = [asyncio.create_task(client.post("/v1/completions", json={**body, "prompt": p}))
                     for p in prompts]
            peak = [0, 0]
            while not all(t.done() for t in tasks):  # both replicas hold sequences at once
                text = (await client.get("/metrics")).text
                for line in text.splitlines():
                    if line.startswith("tpserve_replica_requests_running{"):
                        replica = int(line.split('replica="')[1].split('"')[0])
                        peak[replica] = max(peak[replica], float(line.rsplit(" ", 1)[1]))
                await asyncio.sleep(0.02)
            return alone, [(await t).json() for t in tasks], peak

    alone, together, peak = asyncio.run(run())
    assert [a["choices"][0]["text"] for a in alone] == [t["choices"][0]["text"] for t in together[:2]]
    assert all(t["usage"]["completion_tokens"] == body["max_tokens"] for t in together)
    assert peak[0] >= 1 and peak[1] >= 1, peak
    assert httpx.get(s.url + "/health").status_code == 200


def test_sigkill_of_a_middle_stage_fails_fast(server_factory, five_layers):
    s = server_factory(five_layers, 1, "-pp", "3", "--max-model-len", "256")
    workers = children(s.proc.pid)
    middle = [p for p in workers if rank_of(p) == 1]
    assert len(workers) == 2 and len(middle) == 1
    events, t_kill = kill_mid_stream(s, middle[0])
    try:
        health = httpx.get(s.url + "/health", timeout=60).status_code
    except httpx.HTTPError:  # already gone
        health = None
    assert health == 503 or s.proc.poll() is not None
    assert time.monotonic() - t_kill < 15
    assert any("engine_failed" in e for e in events) or events[-1] == "connection closed", events[-3:]
    assert s.proc.wait(timeout=30) != 0
    assert time.monotonic() - t_kill < 30
    for pid in workers:
        assert not os.path.exists(f"/proc/{pid}") or "zombie" in open(f"/proc/{pid}/status").read().lower()


def test_group_sigterm_drains_a_pipeline(server_factory, checkpoints):
    s = server_factory(checkpoints("llama"), 1, "-pp", "2", "--max-model-len", "256", "--shutdown-timeout", "60",
                       new_session=True)
    drains_under_group_sigterm(s)
