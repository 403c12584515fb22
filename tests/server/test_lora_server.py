"""LoRA adapters through a real server at TP 2 (server/engine/lora_registry.py): picked by `model` on every endpoint, equal to PEFT,
mixed with the base model in one step, kept apart in the prefix cache, evicted and read again past --max-cpu-loras,
loaded and unloaded at runtime under load, and every bad adapter refused with a 400 while the server keeps serving.
Runtime loads from hostile clients: only from inside --lora-root, unloaded only by their key or the admin key, at most
--max-runtime-loras per key, every malformed safetensors header a 400, and a rank that cannot read an adapter fails
that load, not its replica."""

import asyncio
import json
import os
import shutil
import signal
import sys
from pathlib import Path

import httpx
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "sharding"))
from test_lora import LLAMA_ALL, _rewrite_config, make_adapter, reference  # noqa: E402 (tests/sharding/test_lora.py)
from tiny import make_checkpoint  # noqa: E402

TOKENS = 12
KEYS = {"a": "key-a", "b": "key-b", "admin": "key-admin"}  # srv's API keys: two tenants and the --lora-admin-key


def auth(who: str = "a") -> dict:
    return {"Authorization": f"Bearer {KEYS[who]}"}


AUTH = auth()
PROMPT = list(range(5, 45))  # 40 tokens: two full blocks of 16, so the prefix cache has something to share


@pytest.fixture(scope="module")
def lora_setup(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("lora_server")
    base = make_checkpoint(tmp / "base", "llama", intermediate_size=128)
    adapters = {"a": make_adapter(base, tmp / "a", seed=1, target_modules=LLAMA_ALL),
                "b": make_adapter(base, tmp / "b", seed=2, r=4, lora_alpha=8, target_modules=["q_proj", "v_proj",
                                                                                             "down_proj"]),
                "c": make_adapter(base, tmp / "c", seed=3, use_rslora=True, target_modules=["o_proj", "up_proj"])}
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(base))
    refs = {name: [tok.decode([t]) for t in reference(base, path, PROMPT, TOKENS)[0]]
            for name, path in [(None, None), *adapters.items()]}
    assert len({tuple(t) for t in refs.values()}) == 4, "each adapter must change the answer"
    return base, adapters, refs, tmp


@pytest.fixture(scope="module")
def srv(server_factory, lora_setup):
    base, adapters, _, tmp = lora_setup
    return server_factory(base, 2, "--max-model-len", "128", "--enable-lora", "--max-loras", "2",
                          "--max-cpu-loras", "2", "--lora-modules", f"a={adapters['a']}",
                          json.dumps({"name": "b", "path": str(adapters["b"])}),
                          "--api-key", ",".join(KEYS.values()), "--lora-admin-key", KEYS["admin"],
                          "--lora-root", str(tmp), "--max-runtime-loras", "2",
                          env={"TPSERVE_ALLOW_RUNTIME_LORA_UPDATING": "1"})


def complete(srv, model, prompt=PROMPT, **kw):
    r = httpx.post(srv.url + "/v1/completions", timeout=120, headers=AUTH, json={
        "model": model, "prompt": prompt, "max_tokens": TOKENS, "temperature": 0, "ignore_eos": True,
        "logprobs": 0, **kw})
    assert r.status_code == 200, r.text
    return r.json()


def tokens(response) -> list[str]:
    """The completion's tokens, one string each (its logprobs)."""
    return response["choices"][0]["logprobs"]["tokens"]


def metric(srv, name: str) -> float:
    for line in httpx.get(srv.url + "/metrics").text.splitlines():
        if line.startswith(name):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(name)


def test_models_lists_adapters_with_their_parent(srv):
    data = httpx.get(srv.v1 + "/models", headers=AUTH).json()["data"]
    assert [m["id"] for m in data] == [srv.model_name, "a", "b"]
    assert all(m["parent"] == srv.model_name for m in data[1:]) and data[0]["parent"] is None
    assert httpx.get(srv.v1 + "/models/a", headers=AUTH).json()["parent"] == srv.model_name


def test_adapters_and_base_in_one_step_equal_peft(srv, lora_setup):
    _, _, refs, _ = lora_setup

    async def run():
        async with httpx.AsyncClient(base_url=srv.url, timeout=120, headers=AUTH) as client:
            bodies = [{"model": m, "prompt": PROMPT, "max_tokens": TOKENS, "temperature": 0, "ignore_eos": True,
                       "logprobs": 0} for m in (srv.model_name, "a", "b")]
            return await asyncio.gather(*(client.post("/v1/completions", json=b) for b in bodies))

    before = metric(srv, "tpserve_step_seconds_count")
    base, a, b = [r.json() for r in asyncio.run(run())]
    steps = metric(srv, "tpserve_step_seconds_count") - before
    assert tokens(base) == refs[None] and tokens(a) == refs["a"] and tokens(b) == refs["b"]
    assert steps < 3 * TOKENS, steps  # the three decoded side by side, not one after the other
    # the chat endpoint picks the adapter too
    chat = httpx.post(srv.v1 + "/chat/completions", timeout=60, headers=AUTH, json={
        "model": "b", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "temperature": 0})
    assert chat.status_code == 200 and chat.json()["usage"]["completion_tokens"] >= 1


def test_prefix_cache_is_kept_apart_per_adapter(srv, lora_setup):
    _, _, refs, _ = lora_setup
    prompt = PROMPT
    for model, ref in (("a", refs["a"]), ("b", refs["b"]), (srv.model_name, refs[None]), ("a", refs["a"])):
        got = complete(srv, model, prompt)
        assert tokens(got) == ref, model  # K/V cached under another adapter would change the answer


def test_eviction_beyond_max_cpu_loras_and_runtime_load_unload(srv, lora_setup):
    _, adapters, refs, _ = lora_setup
    r = httpx.post(srv.v1 + "/load_lora_adapter", headers=AUTH,
                   json={"lora_name": "c", "lora_path": str(adapters["c"])})
    assert r.status_code == 200, r.text
    assert httpx.post(srv.v1 + "/load_lora_adapter", headers=AUTH,
                      json={"lora_name": "c", "lora_path": str(adapters["c"])}).status_code == 400  # the name is taken
    # three adapters, two slots: each use of the third evicts the least recently used, which is read again later
    for model in ("c", "a", "b", "c", "a"):
        assert tokens(complete(srv, model)) == refs[model], model
    assert metric(srv, "tpserve_lora_adapters_loaded") == 2

    async def unload_under_load():
        async with httpx.AsyncClient(base_url=srv.url, timeout=120, headers=AUTH) as client:
            long = asyncio.create_task(client.post("/v1/completions", json={
                "model": "c", "prompt": PROMPT, "max_tokens": 80, "temperature": 0, "ignore_eos": True}))
            running = ""
            for _ in range(200):  # until the engine runs it (then unload it in flight)
                running = (await client.get("/metrics")).text
                if 'tpserve_lora_requests_running{adapter="c"} 1.0' in running or long.done():
                    break
                await asyncio.sleep(0.01)
            unloaded = await client.post("/v1/unload_lora_adapter", json={"lora_name": "c"})
            after = await client.post("/v1/completions", json={"model": "c", "prompt": PROMPT, "max_tokens": 2})
            return await long, unloaded, after, running

    long, unloaded, after, running = asyncio.run(unload_under_load())
    assert 'tpserve_lora_requests_running{adapter="c"} 1.0' in running
    assert unloaded.status_code == 200, unloaded.text
    assert long.status_code == 200 and long.json()["usage"]["completion_tokens"] == 80  # in flight: finished
    assert after.status_code == 404 and after.json()["error"]["code"] == "model_not_found"
    assert httpx.post(srv.v1 + "/unload_lora_adapter", headers=AUTH, json={"lora_name": "c"}).status_code == 404
    assert [m["id"] for m in httpx.get(srv.v1 + "/models", headers=AUTH).json()["data"]][1:] == ["a", "b"]
    # the unloaded adapter's label has left /metrics (names are the clients' to choose: labels kept would grow)
    assert 'adapter="c"' not in httpx.get(srv.url + "/metrics").text


def test_bad_adapters_get_a_400_that_says_which(srv, lora_setup):
    base, adapters, refs, tmp = lora_setup
    pickled = tmp / "pickled"
    pickled.mkdir()
    (pickled / "adapter_config.json").write_text((adapters["a"] / "adapter_config.json").read_text())
    (pickled / "adapter_model.bin").write_bytes(b"\x80\x02pickle")
    other = make_checkpoint(tmp / "other_base", "llama", intermediate_size=96)
    cases = [
        (base, "not a PEFT adapter folder"),
        (tmp / "nowhere", "not a local folder"),
        ("https://huggingface.co/some/adapter", "not a local folder"),
        (pickled, "pickled adapter weights"),
        (make_adapter(base, tmp / "big", seed=4, r=32, target_modules=["q_proj"]), "rank above the maximum LoRA rank"),
        (_rewrite_config(adapters["a"], tmp / "dora", use_dora=True), "DoRA"),
        (_rewrite_config(adapters["a"], tmp / "mts", modules_to_save=["lm_head"]), "modules_to_save"),
        (_rewrite_config(adapters["a"], tmp / "named", base_model_name_or_path="meta-llama/Llama-3.1-8B"),
         "was trained on base model"),
        (make_adapter(other, tmp / "shapes", seed=5, target_modules=["down_proj"]), "does not fit this base model"),
    ]
    for i, (path, match) in enumerate(cases):
        r = httpx.post(srv.v1 + "/load_lora_adapter", headers=AUTH,
                       json={"lora_name": f"bad{i}", "lora_path": str(path)})
        assert r.status_code == 400, (path, r.text)
        err = r.json()["error"]
        assert match in err["message"] and set(err) == {"message", "type", "param", "code"}, (match, err)
    assert httpx.post(srv.v1 + "/completions", headers=AUTH, json={"model": "bad0", "prompt": "hi"}).status_code == 404
    assert tokens(complete(srv, "a")) == refs["a"]  # still serving


def put_adapter(folder: Path, like: Path, weights: bytes | None = None) -> Path:
    """A copy of adapter folder `like` (its adapter_model.safetensors replaced by `weights` if given)."""
    folder.mkdir(parents=True, exist_ok=True)
    shutil.copy(like / "adapter_config.json", folder / "adapter_config.json")
    if weights is None:
        shutil.copy(like / "adapter_model.safetensors", folder / "adapter_model.safetensors")
    else:
        (folder / "adapter_model.safetensors").write_bytes(weights)
    return folder


def load(srv, name: str, path, who: str = "a") -> httpx.Response:
    return httpx.post(srv.v1 + "/load_lora_adapter", headers=auth(who), timeout=60,
                      json={"lora_name": name, "lora_path": str(path)})


def unload(srv, name: str, who: str = "a") -> httpx.Response:
    return httpx.post(srv.v1 + "/unload_lora_adapter", headers=auth(who), timeout=60, json={"lora_name": name})


def test_runtime_paths_must_resolve_inside_lora_root(srv, lora_setup, tmp_path_factory):
    _, adapters, _, tmp = lora_setup
    outside = put_adapter(tmp_path_factory.mktemp("outside_root") / "ad", adapters["c"])
    (tmp / "dir_link").symlink_to(outside, target_is_directory=True)  # a folder inside the root pointing out of it
    file_link = tmp / "file_link"  # a real folder inside whose weights are a link to a file outside
    file_link.mkdir()
    shutil.copy(outside / "adapter_config.json", file_link / "adapter_config.json")
    (file_link / "adapter_model.safetensors").symlink_to(outside / "adapter_model.safetensors")
    for path in (outside, tmp / "dir_link", file_link, os.path.relpath(outside, tmp), tmp / ".." / outside.parent.name):
        r = load(srv, "escape", path)
        assert r.status_code == 400, (path, r.text)
        err = r.json()["error"]
        assert err["code"] == "lora_path_outside_root" and "--lora-root" in err["message"], err
    assert "escape" not in [m["id"] for m in httpx.get(srv.v1 + "/models", headers=AUTH).json()["data"]]
    # inside the root: an absolute path or one relative to the root
    assert load(srv, "inside", "c").status_code == 200
    assert unload(srv, "inside").status_code == 200
    assert load(srv, "in\nside", "c").json()["error"]["param"] == "lora_name"  # a name that would forge log lines


def test_runtime_adapters_are_unloaded_only_by_their_key_or_the_admin_key(srv, lora_setup):
    _, adapters, _, _ = lora_setup
    assert load(srv, "b_owned", adapters["b"], who="b").status_code == 200
    for name in ("b_owned", "a"):  # another key's runtime adapter; a --lora-modules one
        r = unload(srv, name, who="a")
        assert r.status_code == 403, r.text
        err = r.json()["error"]
        assert err["type"] == "permission_error" and err["code"] == "lora_not_owner" and err["param"] == "lora_name"
    assert tokens(complete(srv, "b_owned")) == lora_setup[2]["b"]  # still there, and any key may use it
    assert unload(srv, "b_owned", who="b").status_code == 200  # its own key
    assert load(srv, "b_owned", adapters["b"], who="b").status_code == 200
    assert unload(srv, "b_owned", who="admin").status_code == 200  # the --lora-admin-key
    assert unload(srv, "b_owned", who="b").status_code == 404


def test_runtime_registrations_are_bounded_per_key(srv, lora_setup):
    _, adapters, _, _ = lora_setup
    for i in range(2):
        assert load(srv, f"b{i}", adapters["b"], who="b").status_code == 200
    r = load(srv, "b2", adapters["b"], who="b")
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["code"] == "lora_limit_reached" and "--max-runtime-loras" in err["message"] and "(2)" in err["message"]
    assert load(srv, "a0", adapters["a"], who="a").status_code == 200  # another key's own allowance
    assert unload(srv, "b0", who="b").status_code == 200
    assert load(srv, "b2", adapters["b"], who="b").status_code == 200  # room again
    for name, who in (("b1", "b"), ("b2", "b"), ("a0", "a")):
        assert unload(srv, name, who=who).status_code == 200


def safetensors_bytes(header, data: bytes = b"", length: int | None = None) -> bytes:
    raw = header if isinstance(header, bytes) else json.dumps(header).encode()
    return (len(raw) if length is None else length).to_bytes(8, "little") + raw + data


def test_every_malformed_safetensors_header_gets_a_400(srv, lora_setup):
    _, adapters, refs, tmp = lora_setup
    a = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"

    def one(meta: dict, data: bytes = bytes(16)) -> bytes:
        return safetensors_bytes({a: meta}, data)

    cases = [
        (b"\x01\x02", "shorter than 8 bytes"),
        (safetensors_bytes(b"{}", length=1 << 62), "header length"),
        (safetensors_bytes(b"{}", length=10_000), "header length"),  # beyond the end of the file
        (safetensors_bytes(b"{not json"), "corrupt safetensors header"),
        (safetensors_bytes(b"[" * 100_000 + b"]" * 100_000), "corrupt safetensors header"),  # deeper than json goes
        (safetensors_bytes([1, 2]), "not an object"),
        (safetensors_bytes({a: 5}), "not an object"),
        (safetensors_bytes({a: ["F32", [2, 2], [0, 16]]}), "not an object"),
        (one({"dtype": "Q4", "shape": [2, 2], "data_offsets": [0, 16]}), "unsupported dtype"),
        (one({"dtype": ["F32"], "shape": [2, 2], "data_offsets": [0, 16]}), "unsupported dtype"),
        (one({"dtype": "F32", "shape": "2x2", "data_offsets": [0, 16]}), "shape"),
        (one({"dtype": "F32", "shape": [2, -2], "data_offsets": [0, 16]}), "shape"),
        (one({"dtype": "F32", "shape": [2.0, 2], "data_offsets": [0, 16]}), "shape"),
        (one({"dtype": "F32", "shape": [2, 2]}), "data_offsets"),
        (one({"dtype": "F32", "shape": [2, 2], "data_offsets": [0]}), "data_offsets"),
        (one({"dtype": "F32", "shape": [4], "data_offsets": [-16, 0]}), "data_offsets"),  # before the data
        (one({"dtype": "F32", "shape": [4], "data_offsets": [16, 0]}), "data_offsets"),
        (one({"dtype": "F32", "shape": [2, 2], "data_offsets": [0, 4000]}), "inconsistent offsets"),  # past the end
        (one({"dtype": "F32", "shape": [2, 2], "data_offsets": [0, 8]}), "inconsistent offsets"),  # size != shape
        # no product of huge dimensions is taken (100 of 4000 digits: 0.4 s holding the GIL), none is quoted
        (one({"dtype": "F32", "shape": [int("9" * 4000)] * 100, "data_offsets": [0, 16]}), "at most 8"),
        (one({"dtype": "F32", "shape": [int("9" * 4000), 1], "data_offsets": [0, 16]}), "dimension above"),
    ]
    for i, (weights, match) in enumerate(cases):
        r = load(srv, f"hdr{i}", put_adapter(tmp / f"hdr{i}", adapters["a"], weights))
        assert r.status_code == 400, (i, match, r.text)
        err = r.json()["error"]
        assert match in err["message"] and err["param"] == "lora_path", (i, match, err)
        assert "9999" not in err["message"] and len(err["message"]) < 1000, (i, err)
    assert tokens(complete(srv, "a")) == refs["a"]  # still serving


def test_a_rank_that_cannot_read_an_adapter_fails_that_load_not_the_replica(srv, lora_setup):
    """Rank 1 dies; its respawn reads every loaded adapter again, one of which was truncated meanwhile. That rank
    reports the failure instead of exiting (which restarted it again, for ever): the replica serves, the adapter's
    next request gets the reason, and once the file is whole again the adapter serves again."""
    from test_fault_tolerance import rank_pid

    _, adapters, refs, tmp = lora_setup
    fragile = put_adapter(tmp / "fragile", adapters["b"])
    assert load(srv, "fragile", fragile).status_code == 200
    assert tokens(complete(srv, "fragile")) == refs["b"]  # in a slot on both ranks
    whole = (fragile / "adapter_model.safetensors").read_bytes()
    (fragile / "adapter_model.safetensors").write_bytes(whole[: len(whole) // 2])
    failures = metric(srv, "tpserve_replica_failures_total")
    os.kill(rank_pid(srv.proc.pid, 1), signal.SIGKILL)
    assert tokens(complete(srv, srv.model_name)) == refs[None]  # waits out the respawn, then serves
    r = httpx.post(srv.v1 + "/completions", headers=AUTH, timeout=60,
                   json={"model": "fragile", "prompt": PROMPT, "max_tokens": 2})
    assert r.status_code == 503, r.text
    err = r.json()["error"]
    assert err["code"] == "lora_load_failed" and "'fragile' could not be read on rank 1" in err["message"], err
    assert "inconsistent offsets" in err["message"], err
    (fragile / "adapter_model.safetensors").write_bytes(whole)
    assert tokens(complete(srv, "fragile")) == refs["b"]  # read again, on every rank
    assert tokens(complete(srv, srv.model_name)) == refs[None]
    assert metric(srv, "tpserve_replica_failures_total") == failures + 1  # the kill, and nothing since
    assert httpx.get(srv.url + "/health").json() == {"status": "ok"}
    assert unload(srv, "fragile").status_code == 200


@pytest.mark.slow
def test_pipeline_replicas_and_a_respawned_replica_serve_the_adapters(server_factory, lora_setup):
    """-pp 2 -dp 2: the load commands pass from stage to stage and reach the other replica; a replica restarted
    after a SIGKILL reads the loaded adapters again before it serves (server/engine/lora_registry.py: LoraSlots.reload)."""
    import os
    import signal

    from test_fault_tolerance import rank_pid, wait_health

    base, adapters, refs, _ = lora_setup
    s = server_factory(base, 1, "-pp", "2", "-dp", "2", "--max-model-len", "128", "--enable-lora",
                       "--max-loras", "2", "--max-cpu-loras", "2", "--lora-modules", f"a={adapters['a']}",
                       f"b={adapters['b']}")

    async def both_replicas():
        async with httpx.AsyncClient(base_url=s.url, timeout=120) as client:
            models = ["a", "b", "a", "b", s.model_name, "a"]  # 6 at once: every lane of both replicas gets some
            rs = await asyncio.gather(*(client.post("/v1/completions", json={
                "model": m, "prompt": PROMPT, "max_tokens": TOKENS, "temperature": 0, "ignore_eos": True,
                "logprobs": 0}) for m in models))
            return [(m, tokens(r.json())) for m, r in zip(models, rs)]

    for model, got in asyncio.run(both_replicas()):
        assert got == refs[None if model == s.model_name else model], model
    os.kill(rank_pid(s.proc.pid, 2), signal.SIGKILL)  # replica 1's first stage
    wait_health(s, "degraded", timeout=30)
    wait_health(s, "ok")
    for model, got in asyncio.run(both_replicas()):
        assert got == refs[None if model == s.model_name else model], model
