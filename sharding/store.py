"""The ranks' rendezvous store: a small key-value server on rank 0 that speaks only to peers that know its secret.

Every process group is made over a store (sharding/dist.py: make_replica_groups), and rank 0 keeps it up for the
server's whole life so that a dead replica can be started again. torch's own TCPStore answers anyone who connects
and listens on every interface, so a stranger could fill rank 0's memory or pre-write a respawned replica's group
keys. This store is what tpserve opens instead:

- **Where it listens** (`bind_address`): on one host (ranks spawned by `tpserve serve`, or a single-host torchrun
  with MASTER_ADDR on loopback) 127.0.0.1; across hosts the address MASTER_ADDR names, never the wildcard. gloo's
  own sockets follow the same rule (`gloo_device`).
- **Who it speaks to**: a connection proves the secret before its first key, and the store proves it back: the
  server sends a random challenge, the client answers with an HMAC-SHA256 of it under the secret plus a challenge
  of its own, which the server answers in turn. A peer that fails (or says nothing within HANDSHAKE_TIMEOUT_S) is
  dropped and logged. At most MAX_PENDING connections may be in the handshake at once, the oldest making room for a
  new one, so a flood of silent connections can neither pile up threads nor keep a rank out.
- **The secret**: `tpserve serve` makes one per server (32 random bytes) and hands it to the ranks it spawns in
  TPSERVE_STORE_SECRET, through their environment (readable by the same user only). Under torchrun each node gets it
  from TPSERVE_STORE_SECRET or TPSERVE_STORE_SECRET_FILE, the same on every node (docs/deployment.md).

The client (`StoreClient`) is a `torch.distributed.Store` written in Python, which gloo, NCCL and `PrefixStore` use
like any other: it opens one connection per thread (rank 0 makes a respawned replica's groups from the supervisor's
thread while other threads may wait on the store too) and holds no lock across a blocking wait.

Wire format, after the handshake: a request is an op byte, a field count byte and the fields (each a 4-byte length
and its bytes); an answer is a status byte (OK, TIMEOUT, ERROR) and its fields. Only the few operations the groups
need exist: set, get (waits for the key), add, check, wait, delete, compare-set and a key count.
"""

from __future__ import annotations

import datetime
import hashlib
import hmac
import ipaddress
import logging
import os
import secrets
import socket
import struct
import threading
import time

import torch.distributed as dist

from loaders import envs

logger = logging.getLogger(__name__)

HANDSHAKE_TIMEOUT_S = 5.0  # a peer that has not proved the secret by then is dropped
MAX_PENDING = 64  # connections in the handshake at once; more are dropped at accept
MAX_FIELD_BYTES = 64 << 20  # one key or value (the groups write a few hundred bytes each)
_MAGIC = b"TPSTORE1"
_NONCE = 32
_MAC = 32

_OK, _TIMEOUT, _ERROR = 0, 1, 2
_ACCEPTED, _REFUSED = b"\x01", b"\x00"
_MARGIN_S = 30.0  # a store call's socket waits this much longer than the call itself may take
_SET, _GET, _ADD, _CHECK, _WAIT, _DELETE, _CAS, _NUM_KEYS = b"SGACWDXN"


def _mac(secret: bytes, *parts: bytes) -> bytes:
    return hmac.new(secret, b"".join(parts), hashlib.sha256).digest()


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise ConnectionError("the peer closed the connection")
        buf += chunk
    return bytes(buf)


def _send_msg(sock: socket.socket, head: int, fields: list[bytes]) -> None:
    sock.sendall(bytes([head, len(fields)]) + b"".join(struct.pack("!I", len(f)) + f for f in fields))


def _recv_msg(sock: socket.socket) -> tuple[int, list[bytes]]:
    head, count = _recv_exact(sock, 2)
    fields = []
    for _ in range(count):
        (n,) = struct.unpack("!I", _recv_exact(sock, 4))
        if n > MAX_FIELD_BYTES:
            raise ConnectionError(f"a store field of {n} bytes (at most {MAX_FIELD_BYTES})")
        fields.append(_recv_exact(sock, n))
    return head, fields


# ---- the secret and the addresses ------------------------------------------------------------------------------
def new_secret() -> str:
    return secrets.token_hex(32)


def secret_from_env() -> bytes:
    """The store's secret as this process was given it: TPSERVE_STORE_SECRET, else the contents of
    TPSERVE_STORE_SECRET_FILE. Raises ValueError (one readable line) when neither is set."""
    value = envs.STORE_SECRET.get()
    path = envs.STORE_SECRET_FILE.get()
    if value is None and path is not None:
        try:
            value = path.read_text().strip()
        except OSError as e:
            raise ValueError(f"TPSERVE_STORE_SECRET_FILE: cannot read {path}: {e.strerror}") from None
    if not value:
        raise ValueError("the ranks' store needs a secret shared by every node: set TPSERVE_STORE_SECRET (or "
                         "TPSERVE_STORE_SECRET_FILE) to the same value on each, e.g. the output of "
                         "`python -c 'import secrets; print(secrets.token_hex(32))'`")
    if len(value) < 16:
        raise ValueError("TPSERVE_STORE_SECRET is too short: use at least 16 characters (32 random bytes in hex is "
                         "what tpserve makes for its own ranks)")
    return value.encode()


def _resolve(host: str) -> str:
    try:
        return socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)[0][4][0]
    except socket.gaierror as e:
        raise ValueError(f"MASTER_ADDR {host!r} does not resolve: {e.strerror}") from None


def _is_ip(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
        return True
    except ValueError:
        return False


def is_loopback(host: str) -> bool:
    addr = _resolve(host)
    return addr.startswith("127.") or addr == "::1"


def bind_address(master_addr: str) -> str:
    """Where rank 0's store listens: loopback when MASTER_ADDR is, else the address MASTER_ADDR resolves to."""
    return "127.0.0.1" if is_loopback(master_addr) else _resolve(master_addr)


def local_address_towards(master_addr: str) -> str:
    """This host's address on the route to MASTER_ADDR (no packet is sent: a UDP socket's connect only picks the
    route), which is where this rank's gloo sockets listen; loopback when MASTER_ADDR is."""
    if is_loopback(master_addr):
        return "127.0.0.1"
    addr = _resolve(master_addr)
    with socket.socket(socket.AF_INET6 if ":" in addr else socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((addr, 9))
        return s.getsockname()[0]


_devices: dict[str, object] = {}


def gloo_device(master_addr: str):
    """The gloo device every group of this process uses: its sockets on the interface GLOO_SOCKET_IFNAME names, if
    set, else on this host's address towards MASTER_ADDR (loopback on one host), never on the wildcard."""
    ifname = os.environ.get("GLOO_SOCKET_IFNAME", "").split(",")[0].strip()
    key = f"if:{ifname}" if ifname else f"addr:{local_address_towards(master_addr)}"
    if key not in _devices:
        create = dist.ProcessGroupGloo.create_device
        _devices[key] = create(interface=ifname) if ifname else create(hostname=key[5:])
    return _devices[key]


# ---- the server (rank 0) ---------------------------------------------------------------------------------------
class StoreServer:
    """The key-value store, served from threads of rank 0's process for as long as the process lives (or until
    `close`). `port` 0 picks a free one (then read `.port`)."""

    def __init__(self, host: str, port: int, secret: bytes, handshake_timeout: float = HANDSHAKE_TIMEOUT_S):
        self.secret, self.handshake_timeout = secret, handshake_timeout
        self._data: dict[str, bytes] = {}
        self._cond = threading.Condition()
        self._pending: dict[socket.socket, float] = {}  # connections in the handshake, oldest first
        self._pending_lock = threading.Lock()
        self._dropped = 0
        self._last_log = 0.0
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        try:
            self._sock = socket.create_server((host, port), family=family, backlog=128)
        except OSError as e:
            raise ValueError(f"the ranks' store cannot listen on {host}:{port}: {e.strerror} (it listens where "
                             f"MASTER_ADDR points, which must be an address of rank 0's host)") from None
        self.host, self.port = host, self._sock.getsockname()[1]
        self._closed = False
        threading.Thread(target=self._accept, name="tpserve-store", daemon=True).start()

    def close(self) -> None:
        self._closed = True
        try:
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._sock.close()

    def _accept(self) -> None:
        while not self._closed:
            try:
                conn, peer = self._sock.accept()
            except OSError as e:
                if self._closed:
                    return
                logger.warning("ranks' store: accept failed (%s); retrying", e)  # e.g. out of file descriptors
                time.sleep(0.1)
                continue
            with self._pending_lock:  # full: the oldest one still in the handshake makes room (a rank answers in ms)
                if len(self._pending) >= MAX_PENDING:
                    oldest = next(iter(self._pending))
                    del self._pending[oldest]
                    try:
                        oldest.shutdown(socket.SHUT_RDWR)  # its thread's read fails, and it drops the peer
                    except OSError:
                        pass
                self._pending[conn] = time.monotonic()
            threading.Thread(target=self._serve, args=(conn, peer), name="tpserve-store-conn", daemon=True).start()

    def _drop(self, peer, why: str) -> None:
        """Log a refused peer: the first one at once, then at most one line every 10 s (with the count since)."""
        self._dropped += 1
        now = time.monotonic()
        if now - self._last_log >= 10:
            logger.warning("ranks' store: dropped a connection from %s (%s); %d dropped so far", peer[0], why,
                           self._dropped)
            self._last_log = now

    def _handshake(self, conn: socket.socket, peer) -> bool:
        conn.settimeout(self.handshake_timeout)
        challenge = secrets.token_bytes(_NONCE)
        try:
            conn.sendall(_MAGIC + challenge)
            answer = _recv_exact(conn, len(_MAGIC) + _MAC + _NONCE)
        except (OSError, ConnectionError):
            self._drop(peer, "no answer to the challenge")
            return False
        proof, theirs = answer[len(_MAGIC):len(_MAGIC) + _MAC], answer[len(_MAGIC) + _MAC:]
        if answer[:len(_MAGIC)] != _MAGIC or not hmac.compare_digest(proof, _mac(self.secret, b"client", challenge)):
            self._drop(peer, "it did not prove the secret")
            try:
                conn.sendall(_REFUSED)  # a rank with the wrong secret fails at once instead of retrying
            except OSError:
                pass
            return False
        conn.sendall(_ACCEPTED + _mac(self.secret, b"server", theirs, challenge))
        conn.settimeout(None)
        return True

    def _serve(self, conn: socket.socket, peer) -> None:
        with conn:
            try:
                ok = self._handshake(conn, peer)
            finally:
                with self._pending_lock:
                    self._pending.pop(conn, None)
            if not ok:
                return
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            try:
                while not self._closed:
                    op, fields = _recv_msg(conn)
                    status, out = self._apply(op, fields)
                    _send_msg(conn, status, out)
            except (OSError, ConnectionError, ValueError, struct.error):
                return  # the peer left (or sent garbage after proving the secret: it is trusted, but not obeyed)

    def _apply(self, op: int, f: list[bytes]) -> tuple[int, list[bytes]]:
        data, cond = self._data, self._cond
        if op == _SET:
            with cond:
                data[f[0].decode()] = f[1]
                cond.notify_all()
            return _OK, []
        if op in (_GET, _WAIT):
            timeout = int(f[0]) / 1000
            keys = [k.decode() for k in f[1:]]
            with cond:
                if not cond.wait_for(lambda: all(k in data for k in keys), timeout):
                    return _TIMEOUT, []
                return _OK, [data[keys[0]]] if op == _GET else []
        if op == _ADD:
            with cond:
                key = f[0].decode()
                value = int(data.get(key, b"0")) + int(f[1])
                data[key] = str(value).encode()
                cond.notify_all()
            return _OK, [str(value).encode()]
        if op == _CHECK:
            with cond:
                return _OK, [b"1" if all(k.decode() in data for k in f) else b"0"]
        if op == _DELETE:
            with cond:
                return _OK, [b"1" if data.pop(f[0].decode(), None) is not None else b"0"]
        if op == _CAS:
            with cond:
                key = f[0].decode()
                current = data.get(key)
                if (current is None and f[1] == b"") or current == f[1]:
                    data[key] = current = f[2]
                    cond.notify_all()
                return _OK, [current if current is not None else f[1]]
        if op == _NUM_KEYS:
            with cond:
                return _OK, [str(len(data)).encode()]
        return _ERROR, [f"unknown store operation {op}".encode()]


# ---- the client (every rank) -----------------------------------------------------------------------------------
class StoreClient(dist.Store):
    """A torch.distributed.Store over the connection(s) to `StoreServer`: one per thread, made on first use, each
    proving the secret (and checking the server's proof) before its first request."""

    def __init__(self, host: str, port: int, secret: bytes, timeout: datetime.timedelta):
        super().__init__()
        self.host, self.port, self.secret = host, port, secret
        self._timeout_s = timeout.total_seconds()
        self._local = threading.local()
        self._conn()  # fail here, at join, if the store cannot be reached

    def _conn(self) -> socket.socket:
        conn = getattr(self._local, "conn", None)
        if conn is not None:
            return conn
        deadline = time.monotonic() + self._timeout_s
        while True:  # rank 0 may not be listening yet (torchrun starts every node's ranks at once), or be shedding
            try:
                conn = self._handshake()
                break
            except (OSError, ConnectionError) as e:
                if time.monotonic() > deadline:
                    raise dist.DistStoreError(f"cannot reach the ranks' store at {self.host}:{self.port}: "
                                              f"{getattr(e, 'strerror', None) or e}") from None
                time.sleep(0.1)
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._local.conn = conn
        return conn

    def _handshake(self) -> socket.socket:
        """A connection that has proved the secret and checked the store's proof. Raises DistStoreError when the
        store refuses the secret (or does not know it), OSError / ConnectionError when the connection was lost on
        the way (the store sheds the oldest handshakes under a flood: worth another try)."""
        conn = socket.create_connection((self.host, self.port), timeout=HANDSHAKE_TIMEOUT_S)
        try:
            head = _recv_exact(conn, len(_MAGIC) + _NONCE)
            if head[:len(_MAGIC)] != _MAGIC:
                raise dist.DistStoreError(f"{self.host}:{self.port} is not a tpserve ranks' store")
            mine = secrets.token_bytes(_NONCE)
            conn.sendall(_MAGIC + _mac(self.secret, b"client", head[len(_MAGIC):]) + mine)
            if _recv_exact(conn, 1) != _ACCEPTED:
                raise dist.DistStoreError(f"the ranks' store at {self.host}:{self.port} refused this rank: it does "
                                          f"not know the same secret (TPSERVE_STORE_SECRET)")
            proof = _recv_exact(conn, _MAC)
            if not hmac.compare_digest(proof, _mac(self.secret, b"server", mine, head[len(_MAGIC):])):
                raise dist.DistStoreError(f"the server at {self.host}:{self.port} does not know the store's secret")
        except BaseException:
            conn.close()
            raise
        return conn

    def _call(self, op: int, fields: list[bytes], what: str, wait_s: float | None = None) -> list[bytes]:
        """One request and its answer; `wait_s`: how long the store may hold it (a get or wait), which bounds the
        socket's wait too (with a margin), so a vanished rank-0 host fails the call instead of hanging it."""
        conn = self._conn()
        try:
            conn.settimeout((self._timeout_s if wait_s is None else wait_s) + _MARGIN_S)
            _send_msg(conn, op, fields)
            status, out = _recv_msg(conn)
        except (OSError, ConnectionError) as e:
            self._local.conn = None
            conn.close()
            raise dist.DistStoreError(f"the ranks' store at {self.host}:{self.port} went away: {e}") from None
        if status == _TIMEOUT:
            waited = self._timeout_s if wait_s is None else wait_s
            raise dist.DistStoreError(f"timed out after {waited:g} s waiting for {what} in the ranks' store")
        if status != _OK:
            raise dist.DistStoreError(out[0].decode() if out else "store error")
        return out

    def _seconds(self, timeout: datetime.timedelta | None) -> float:
        return self._timeout_s if timeout is None else timeout.total_seconds()

    @staticmethod
    def _b(value) -> bytes:
        return value.encode() if isinstance(value, str) else bytes(value)

    def set(self, key: str, value) -> None:
        self._call(_SET, [key.encode(), self._b(value)], key)

    def get(self, key: str) -> bytes:
        return self._call(_GET, [str(int(self._timeout_s * 1000)).encode(), key.encode()], key, self._timeout_s)[0]

    def add(self, key: str, amount: int) -> int:
        return int(self._call(_ADD, [key.encode(), str(int(amount)).encode()], key)[0])

    def check(self, keys: list[str]) -> bool:
        return self._call(_CHECK, [k.encode() for k in keys], "keys")[0] == b"1"

    def wait(self, keys: list[str], timeout: datetime.timedelta | None = None) -> None:
        s = self._seconds(timeout)
        self._call(_WAIT, [str(int(s * 1000)).encode(), *(k.encode() for k in keys)], ", ".join(keys), s)

    def delete_key(self, key: str) -> bool:
        return self._call(_DELETE, [key.encode()], key)[0] == b"1"

    def compare_set(self, key: str, expected, desired) -> bytes:
        return self._call(_CAS, [key.encode(), self._b(expected), self._b(desired)], key)[0]

    def num_keys(self) -> int:
        return int(self._call(_NUM_KEYS, [], "keys")[0])

    def clone(self) -> StoreClient:
        return StoreClient(self.host, self.port, self.secret, datetime.timedelta(seconds=self._timeout_s))


# ---- joining ---------------------------------------------------------------------------------------------------
_servers: dict[int, StoreServer] = {}  # port -> the store this process serves there (rank 0's)


def serve_store(master_addr: str, port: int, secret: bytes) -> StoreServer:
    """Start a store in this process (rank 0's) on `bind_address(master_addr)`; port 0 picks a free one. tpserve's
    launcher starts a new one, with a new secret, for each set of ranks it spawns."""
    server = StoreServer(bind_address(master_addr), port, secret)
    _servers[server.port] = server
    logger.debug("ranks' store on %s:%d", server.host, server.port)
    return server


def close_store(port: int) -> None:
    server = _servers.pop(port, None)
    if server is not None:
        server.close()


def store_port() -> int:
    """The store's port: TPSERVE_STORE_PORT (tpserve's launcher sets it for the ranks it spawns), else
    MASTER_PORT + 1: under torchrun its own agent's store holds MASTER_PORT."""
    return envs.STORE_PORT.get() or int(os.environ.get("MASTER_PORT", "29500")) + 1


def join_store(rank: int, timeout: datetime.timedelta) -> StoreClient:
    """This rank's client of the ranks' store, from MASTER_ADDR, the port and the secret of the environment. Rank 0
    serves the store first, unless tpserve's launcher already did (before spawning the other ranks)."""
    addr = os.environ.get("MASTER_ADDR", "127.0.0.1")
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > int(os.environ.get("LOCAL_WORLD_SIZE", str(world))) and not _is_ip(addr) and is_loopback(addr):
        # e.g. Debian's /etc/hosts maps the host's own name to 127.0.1.1: the store would listen where no other
        # host can reach it (a literal 127.0.0.1 is taken at its word: several "nodes" on one host, as in tests)
        raise ValueError(f"MASTER_ADDR {addr!r} resolves to the loopback address {_resolve(addr)} on this host, but "
                         f"the ranks run on several hosts: set MASTER_ADDR to node 0's address on the network the "
                         f"nodes share")
    port, secret = store_port(), secret_from_env()
    if rank == 0 and port not in _servers:
        serve_store(addr, port, secret)
    return StoreClient(bind_address(addr), port, secret, timeout)
