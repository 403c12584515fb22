import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

ROOT = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Server:
    url: str
    proc: subprocess.Popen
    model_name: str
    log: Path

    @property
    def v1(self) -> str:
        return self.url + "/v1"

    def stop(self, timeout: float = 60) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode

    def tail(self) -> str:
        return self.log.read_text(errors="replace")[-4000:]


def start_server(model: str | None, tp: int = 1, *extra: str, log_dir: Path, ready_timeout: float = 240,
                 env: dict | None = None, new_session: bool = False) -> Server:
    port = free_port()
    log = log_dir / f"server-{port}.log"
    cmd = [sys.executable, "-m", "server.cli.main", "serve", *([model] if model else []), "--host", "127.0.0.1",
           "--port", str(port), "-tp", str(tp), "--log-level", "warning", *extra]
    f = open(log, "w")
    proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, cwd=ROOT, env=dict(os.environ, **(env or {})),
                            start_new_session=new_session)  # a process group of its own, to signal as a whole
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + ready_timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}:\n{log.read_text()[-4000:]}")
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                key = extra[extra.index("--api-key") + 1].split(",")[0] if "--api-key" in extra else None
                name = httpx.get(url + "/v1/models", timeout=5,
                                 headers={"Authorization": f"Bearer {key}"} if key else {}).json()["data"][0]["id"]
                return Server(url, proc, name, log)
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    proc.kill()
    raise RuntimeError(f"server not ready in {ready_timeout} s:\n{log.read_text()[-4000:]}")


@pytest.fixture(scope="module")
def server_factory(tmp_path_factory):
    """Start real `tpserve serve` processes; every one is stopped (SIGTERM, then SIGKILL) at module end."""
    started: list[Server] = []
    log_dir = tmp_path_factory.mktemp("logs")

    def make(model, tp=1, *extra, **kw) -> Server:
        s = start_server(str(model) if model else None, tp, *extra, log_dir=log_dir, **kw)
        started.append(s)
        return s

    yield make
    for s in started:  # every server drains at once, then each is waited for
        if s.proc.poll() is None:
            s.proc.send_signal(signal.SIGTERM)
    for s in started:
        s.stop()


def cli_in_process(argv: list[str]) -> tuple[int, str]:
    """Run `tpserve ARGV` through its entry point (server.cli.main.main) in this process, for refusals that happen
    before any rank or model is started: (exit code, stderr). A refusal raised as SystemExit("tpserve: error: ...")
    is what Python would print and exit 1 with. The caller captures stderr (capsys) and stdin if the command reads it."""
    import contextlib
    import io

    from server.cli.main import main

    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        try:
            code = main(argv)
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else 1
            if isinstance(e.code, str):
                print(e.code, file=sys.stderr)
    return code, err.getvalue()
