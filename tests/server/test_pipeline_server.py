"""Pipeline and data parallel servers: real ranks, a tiny model; replicas behind one HTTP server, a dead middle
stage, and a SIGTERM to the whole process group."""

import asyncio
import os
import signal

import httpx
import pytest

from test_fault_tolerance import TOKENS, rank_pid, streams_with_a_fault, undisturbed, wait_health
from test_reliability import children, drains_under_group_sigterm
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


@pytest.mark.slow
def test_sigkill_of_a_middle_stage_restarts_the_pipeline_and_the_stream_goes_on(server_factory, five_layers):
    """-pp 3: the middle stage dies mid-stream; the last stage is killed too and both are started again (rank 0
    keeps its stage), and the streams finish with the text of an undisturbed run."""
    s = server_factory(five_layers, 1, "-pp", "3", "--max-model-len", "256")
    workers = children(s.proc.pid)
    assert len(workers) == 2
    seeds = [None, 5]
    expected = undisturbed(s, seeds)
    victim = rank_pid(s.proc.pid, 1)
    texts, usage, _, _ = streams_with_a_fault(s, seeds, lambda: os.kill(victim, signal.SIGKILL))
    assert texts == expected and usage == [TOKENS, TOKENS]
    assert wait_health(s, "ok") == {"status": "ok"}
    for pid in workers:  # the old stages are gone, new ones serve
        assert not os.path.exists(f"/proc/{pid}") or "zombie" in open(f"/proc/{pid}/status").read().lower()
    assert len(children(s.proc.pid)) == 2


@pytest.mark.slow
def test_group_sigterm_drains_a_pipeline(server_factory, checkpoints):
    s = server_factory(checkpoints("llama"), 1, "-pp", "2", "--max-model-len", "256", "--shutdown-timeout", "60",
                       new_session=True)
    drains_under_group_sigterm(s)
