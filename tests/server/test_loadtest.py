"""scripts/loadtest.py drives a real tpserve server: every request succeeds and the lengths hold."""

import importlib.util
import json
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def load_script():
    spec = importlib.util.spec_from_file_location("loadtest", ROOT / "scripts" / "loadtest.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_loadtest_sweep_against_tpserve(server_factory, checkpoints, tmp_path):
    folder = checkpoints("llama")
    s = server_factory(folder, 1, "--max-model-len", "128", "--max-num-seqs", "4")
    out = tmp_path / "lt.json"
    rc = load_script().main(["--base-url", s.url, "--concurrency", "1,4", "--num-requests", "6", "--input-len", "8",
                             "--output-len", "10", "--tokenizer", str(folder), "--output", str(out), "--no-progress"])
    assert rc == 0
    report = json.loads(out.read_text())
    assert report["total"] == {"requests": 12, "completed": 12, "failed": 0}
    for level in report["levels"]:
        assert level["output_tokens_source"] == "usage" and level["mean_output_tokens"] == 10
        assert level["ttft_ms"]["p50"] > 0 and level["output_throughput"] > 0
    assert all(Path(p).exists() for p in report["plots"])

    # --extra-body reaches the server, merged over the generated fields (here: a shorter max_tokens)
    out2 = tmp_path / "lt2.json"
    rc = load_script().main(["--base-url", s.url, "--concurrency", "2", "--num-requests", "2", "--input-len", "8",
                             "--output-len", "10", "--extra-body", '{"max_tokens": 4}', "--output", str(out2),
                             "--no-progress", "--no-plot"])
    assert rc == 0
    level = json.loads(out2.read_text())["levels"][0]
    assert level["completed"] == 2 and level["mean_output_tokens"] == 4


def test_loadtest_rejects_a_bad_extra_body(capsys):
    assert load_script().main(["--extra-body", "[1, 2]"]) == 2
    assert "--extra-body must be a JSON object" in capsys.readouterr().err
    assert load_script().main(["--extra-body", "{not json"]) == 2
    assert "--extra-body" in capsys.readouterr().err
