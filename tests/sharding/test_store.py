"""The ranks' store (sharding/store.py): what the process groups need of it, and what it refuses: a peer without the
secret (torch's own store client included), a silent peer, a flood of half-open connections."""

import datetime
import logging
import socket
import threading

import pytest
import torch
import torch.distributed as dist

from sharding import store
from sharding.dist import Group

SECRET = b"0123456789abcdef0123456789abcdef"
TIMEOUT = datetime.timedelta(seconds=10)


@pytest.fixture
def server():
    s = store.StoreServer("127.0.0.1", 0, SECRET, handshake_timeout=0.5)
    yield s
    s.close()


def client(server, secret=SECRET, timeout=TIMEOUT):
    return store.StoreClient("127.0.0.1", server.port, secret, timeout)


def refused(server, payload: bytes) -> bool:
    """Send `payload` after reading the challenge; True when the server then closes the connection, having said
    nothing but that it refuses."""
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as s:
        s.recv(64)
        if payload:
            s.sendall(payload)
        s.settimeout(10)
        said = b""
        try:
            while chunk := s.recv(64):
                said += chunk
        except ConnectionResetError:
            pass
        return said in (b"", store._REFUSED)


def test_the_operations_the_groups_use(server):
    a, b = client(server), client(server)
    a.set("k", b"v")
    assert b.get("k") == b"v" and b.check(["k"]) and not b.check(["k", "missing"])
    assert a.add("n", 2) == 2 and b.add("n", 3) == 5 and a.get("n") == b"5"
    assert a.compare_set("c", "", "x") == b"x" and a.compare_set("c", "y", "z") == b"x"
    assert a.num_keys() == 3 and a.delete_key("c") and not a.delete_key("c") and a.num_keys() == 2

    got = []
    waiter = threading.Thread(target=lambda: got.append(b.get("later")))  # get waits for the key to appear
    waiter.start()
    a.set("later", "here")
    waiter.join(10)
    assert got == [b"here"]
    with pytest.raises(dist.DistStoreError, match="timed out"):
        a.wait(["never"], datetime.timedelta(milliseconds=200))

    # the process groups are made over it (a gloo group through a PrefixStore), on loopback sockets
    results = [None, None]

    def rank(r):
        g = Group(client(server), "g", [0, 1], r, TIMEOUT, device=store.gloo_device("127.0.0.1"))
        results[r] = float(g.all_reduce(torch.tensor([r + 1.0])))
    threads = [threading.Thread(target=rank, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert results == [3.0, 3.0]


def test_a_peer_without_the_secret_is_dropped_and_logged(server, caplog):
    client(server).set("mine", b"1")
    with caplog.at_level(logging.WARNING, logger="sharding.store"):
        with pytest.raises(dist.DistStoreError, match="secret"):
            client(server, secret=b"not the secret, but long enough")
        assert refused(server, b"\0" * 200)  # garbage in place of the answer
        assert refused(server, b"")  # nothing at all: dropped after the handshake timeout
    assert "dropped a connection from 127.0.0.1" in caplog.text
    # torch's own client (what a stranger would point at a TCPStore) gets nowhere either
    with pytest.raises((RuntimeError, dist.DistStoreError)):
        dist.TCPStore("127.0.0.1", server.port, is_master=False, timeout=datetime.timedelta(seconds=2)).set("x", "y")
    assert client(server).num_keys() == 1


def test_half_open_connections_cannot_crowd_out_the_ranks(server):
    """Silent connections past the handshake bound push out the oldest ones, never a rank that answers at once; a
    rank whose handshake is cut short by a flood tries again (within its timeout) rather than failing."""
    silent = [socket.create_connection(("127.0.0.1", server.port), timeout=10) for _ in range(store.MAX_PENDING + 20)]
    flood = threading.Event()

    def keep_flooding():  # while the rank joins, more silent connections keep coming
        while not flood.is_set():
            silent.append(socket.create_connection(("127.0.0.1", server.port), timeout=10))
    t = threading.Thread(target=keep_flooding)
    t.start()
    try:
        clients = [client(server, timeout=datetime.timedelta(seconds=20)) for _ in range(5)]
        for i, c in enumerate(clients):
            c.set(f"k{i}", "v")
        assert [c.get(f"k{i}") for i, c in enumerate(clients)] == [b"v"] * 5
    finally:
        flood.set()
        t.join(10)
        for s in silent:
            s.close()


def test_where_it_listens_and_the_secret_it_needs(monkeypatch, tmp_path):
    assert store.bind_address("127.0.0.1") == "127.0.0.1" and store.bind_address("localhost") == "127.0.0.1"
    assert store.local_address_towards("localhost") == "127.0.0.1"
    for var in ("TPSERVE_STORE_SECRET", "TPSERVE_STORE_SECRET_FILE"):
        monkeypatch.delenv(var, raising=False)
    with pytest.raises(ValueError, match="TPSERVE_STORE_SECRET"):
        store.secret_from_env()
    f = tmp_path / "secret"
    f.write_text("from-a-file-0123456789\n")
    monkeypatch.setenv("TPSERVE_STORE_SECRET_FILE", str(f))
    assert store.secret_from_env() == b"from-a-file-0123456789"
    monkeypatch.setenv("TPSERVE_STORE_SECRET", "short")
    with pytest.raises(ValueError, match="too short"):
        store.secret_from_env()

    # ranks on several hosts, and a MASTER_ADDR name that this host resolves to loopback: refused, not bound there
    monkeypatch.setenv("TPSERVE_STORE_SECRET", "long-enough-secret-0123")
    monkeypatch.setenv("MASTER_ADDR", "localhost")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    with pytest.raises(ValueError, match="resolves to the loopback address"):
        store.join_store(1, TIMEOUT)
    monkeypatch.setenv("TPSERVE_STORE_PORT", "31000")
    assert store.store_port() == 31000
    monkeypatch.delenv("TPSERVE_STORE_PORT")
    monkeypatch.setenv("MASTER_PORT", "29500")
    assert store.store_port() == 29501  # beside torchrun's own store
