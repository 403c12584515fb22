"""The `tpserve` command: readable errors with exit code 2, and offline generation equal to transformers."""

import json
import subprocess
import sys

import pytest
from transformers import AutoTokenizer

from tiny import hf_greedy

TPSERVE = [sys.executable, "-m", "server.cli.main"]


CLI_ERRORS = [
    (["serve", "/nonexistent/model"], "checkpoint folder '/nonexistent/model' does not exist"),
    (["serve", "{llama}", "-tp", "0"], "--tensor-parallel-size must be at least 1"),
    (["serve", "{llama}", "-tp", "16"], "tensor parallel size 16 must be between 1 and the number of attention heads"),
    (["serve", "{llama}", "--max-model-len", "100000"], "exceeds the model's max_position_embeddings"),
    # checked on rank 0 before any other rank is spawned
    (["serve", "{llama}", "-tp", "2", "--max-model-len", "100000"], "exceeds the model's max_position_embeddings"),
    (["generate", "{llama}"], "give --prompt"),
    (["serve", "{llama}", "--max-prefill-tokens-while-decoding", "-3"], "must be auto or a number of tokens"),
]


@pytest.mark.parametrize("args,message", [CLI_ERRORS[0], CLI_ERRORS[4]])
def test_cli_errors_are_readable(checkpoints, args, message):
    """The command as a user runs it: one line on stderr, a failing exit code, no traceback, no rank started."""
    args = [a.replace("{llama}", str(checkpoints("llama"))) for a in args]
    r = subprocess.run(TPSERVE + args, capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL)
    assert r.returncode != 0
    assert message in r.stderr, r.stderr[-2000:]
    assert "Traceback" not in r.stderr
    assert "rank" not in r.stderr, r.stderr[-2000:]  # refused before any rank started


@pytest.mark.parametrize("args,message", [CLI_ERRORS[i] for i in (1, 2, 3, 5, 6)])
def test_more_cli_errors_are_readable(checkpoints, monkeypatch, args, message):
    """The same entry point in this process (conftest.cli_in_process): the same line and a failing exit code,
    without paying an interpreter start for each refusal (the two cases above run the real command)."""
    import io

    from conftest import cli_in_process

    monkeypatch.setattr(sys, "stdin", io.StringIO(""))  # generate reads its prompts from stdin without --prompt
    code, err = cli_in_process([a.replace("{llama}", str(checkpoints("llama"))) for a in args])
    assert code != 0 and message in err and "Traceback" not in err, err[-2000:]


def test_generate_json_equals_transformers(checkpoints):
    folder = checkpoints("llama")
    r = subprocess.run(TPSERVE + ["generate", str(folder), "-tp", "2", "--prompt", "The capital of France is",
                                  "--max-tokens", "8", "--json"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    ids = AutoTokenizer.from_pretrained(str(folder)).encode("The capital of France is")
    expected, _ = hf_greedy(folder, ids, 8)
    assert out["token_ids"][: len(expected)] == expected[: len(out["token_ids"])]
    assert out["finish_reason"] in ("length", "stop")


@pytest.mark.parametrize("host, keyed, warned", [
    ("0.0.0.0", False, "every interface"), ("::", False, "every interface"), ("10.1.2.3", False, "10.1.2.3"),
    ("0.0.0.0", True, None), ("127.0.0.1", False, None), ("::1", False, None), ("localhost", False, None),
])
def test_the_start_warns_when_the_port_is_open_beyond_this_host_without_a_key(host, keyed, warned):
    from server.cli.main import open_without_key

    got = open_without_key(host, keyed)
    assert (got is None) if warned is None else (warned in got and "--api-key" in got), got
