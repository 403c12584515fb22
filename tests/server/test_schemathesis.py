"""Property-based requests generated from our own /openapi.json: no input may produce a 5xx."""

import pytest

schemathesis = pytest.importorskip("schemathesis")


def test_no_5xx_from_generated_requests(server_factory, checkpoints):
    from hypothesis import HealthCheck, given, settings

    s = server_factory(checkpoints("llama"), 1, "--max-model-len", "64", "--max-num-seqs", "4")
    schema = schemathesis.openapi.from_url(s.url + "/openapi.json")
    failures = []

    @settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
    def check(case):
        response = case.call(base_url=s.url, timeout=60)
        if response.status_code >= 500:
            failures.append((case.method, case.path, case.body, response.status_code, response.text[:200]))

    for op in schema.get_all_operations():
        operation = op.ok()
        if operation.method.upper() not in ("GET", "POST"):
            continue
        given(operation.as_strategy())(check)()
    assert not failures, failures[:5]
    assert s.proc.poll() is None  # still serving
