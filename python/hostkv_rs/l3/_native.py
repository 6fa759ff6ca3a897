"""Mooncake's native client, kept quiet when it works and quick when it cannot.

* Quiet: the client logs every setup step at INFO, and at ERROR level a normal event (its own
  segment's metadata key does not exist yet: `GET ... http=404 body: metadata not found`),
  preceded by glog's `WARNING: Logging before InitGoogleLogging()`. `MC_LOG_LEVEL` (read by the
  native side; its quietest level is ERROR) defaults to ERROR, and while a client is set up its
  stderr goes through a filter that drops those two known lines and passes everything else on.
  `HOSTKV_MOONCAKE_LOG=1` (or a level: TRACE, INFO, WARNING, ERROR) leaves Mooncake's logging as
  it is, at that level.
* Quick: a master that does not accept TCP connections is retried by the client for ~100 s with
  an error line per attempt, and a port that accepts but is not a master's RPC port makes the
  client's setup wait for good (no timeout, the GIL held); `probe` asks the master's port (and an
  HTTP metadata server's) with a short timeout first and raises one error naming the address.
"""

from __future__ import annotations

import contextlib
import os
import re
import socket
import struct
import sys
import tempfile
import time
import urllib.parse

from hostkv_rs import _env

LOG_ENV = "HOSTKV_MOONCAKE_LOG"
_MC_LEVELS = ("TRACE", "INFO", "WARNING", "ERROR")
PROBE_TIMEOUT_S = 3.0

# Lines a successful setup prints that say nothing is wrong.
_NOISE = (
    re.compile(r"^WARNING: Logging before InitGoogleLogging\(\) is written to STDERR$"),
    re.compile(r"^E\d{4} [\d:.]+ +\d+ \S+\] GET \S+ http=404 body: metadata not found$"),
)


def verbose() -> bool:
    """Whether the user asked for Mooncake's own logging (HOSTKV_MOONCAKE_LOG set, not 0)."""
    return _env.mooncake_log() is not None


def quiet_logging_env() -> None:
    """Set Mooncake's log level before its client is made (an explicit MC_LOG_LEVEL wins)."""
    wanted = _env.mooncake_log()
    if wanted is not None:
        if wanted in _MC_LEVELS:
            os.environ.setdefault("MC_LOG_LEVEL", wanted)
        return
    os.environ.setdefault("MC_LOG_LEVEL", "ERROR")


def is_noise(line: str) -> bool:
    return any(p.match(line) for p in _NOISE)


@contextlib.contextmanager
def filtered_stderr():
    """Route file descriptor 2 (where the native side writes) into a temporary file for the
    duration, then pass its lines on to stderr, less the known noise. Output of other threads in
    that window is delayed, not lost."""
    if verbose():
        yield
        return
    try:
        sys.stderr.flush()
        saved = os.dup(2)
    except (OSError, ValueError):  # no fd 2 (a daemon) or a closed stream: nothing to filter
        yield
        return
    with tempfile.TemporaryFile() as tmp:
        os.dup2(tmp.fileno(), 2)
        try:
            yield
        finally:
            os.dup2(saved, 2)
            os.close(saved)
            tmp.seek(0)
            text = tmp.read().decode(errors="replace")
            kept = [line for line in text.splitlines() if not is_noise(line)]
            if kept:
                sys.stderr.write("\n".join(kept) + "\n")
                sys.stderr.flush()


def _split_host_port(address: str) -> tuple[str, int] | None:
    host, sep, port = address.strip().rpartition(":")
    if not sep or not host or not port.isdigit():
        return None
    return host.strip("[]"), int(port)


def _reach(host: str, port: int, timeout: float) -> str | None:
    """None when (host, port) accepts a TCP connection within `timeout`, else why not."""
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return None
    except TimeoutError:
        return f"no answer within {timeout:g} s"
    except OSError as exc:
        return exc.strerror or str(exc)


# The master speaks coro_rpc (yalantinglibs): a request is a 20-byte little-endian header (magic
# 21, version, serialize type, message type, sequence number, function id, body length, attachment
# length) and every reply starts with a 16-byte header whose first byte is that magic, an error
# reply included. A request for a function id no master registers gets such an error reply at
# once, and nothing else (an HTTP server waits for more bytes, most servers answer in text).
_RPC_MAGIC = 21
_RPC_REPLY_HEADER_BYTES = 16
_RPC_PROBE = struct.pack("<BBBBIIII", _RPC_MAGIC, 0, 0, 0, 1, 0x686B7672, 0, 0)


def _rpc_reply(host: str, port: int, timeout: float) -> str | None:
    """None when (host, port) answers a coro_rpc request as a master does within `timeout`
    seconds, else why not."""
    try:
        with socket.create_connection((host, port), timeout=timeout) as sock:
            # The reply gets its own `timeout` from here: a name that resolves to several
            # addresses may spend most of the connect's time on one that drops the attempt.
            deadline = time.monotonic() + timeout
            sock.sendall(_RPC_PROBE)
            reply, closed = b"", False
            while len(reply) < _RPC_REPLY_HEADER_BYTES:
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                sock.settimeout(left)
                try:
                    chunk = sock.recv(_RPC_REPLY_HEADER_BYTES - len(reply))
                except TimeoutError:
                    break
                if not chunk:
                    closed = True
                    break
                reply += chunk
    except TimeoutError:
        return f"no answer within {timeout:g} s"
    except OSError as exc:
        return exc.strerror or str(exc)
    if len(reply) == _RPC_REPLY_HEADER_BYTES and reply[0] == _RPC_MAGIC:
        return None
    if reply:
        return f"it answered, but not as a Mooncake master's RPC port (first bytes {reply[:8]!r})"
    if closed:
        return "it closed the connection without a Mooncake RPC reply"
    return f"it accepted the connection but sent no Mooncake RPC reply within {timeout:g} s"


def _master_target(master: str) -> tuple[str, int] | None:
    """(host, port) of a plain HOST:PORT master address; None for the other forms (etcd://, an
    HA list, a bare host), which are left to Mooncake. A plain address with a port that is not
    one (`:::`, `host:-1`, `host:99999`) is refused: no probe could check it, and Mooncake's setup
    against it waits for good."""
    from hostkv_rs.l3.mooncake import StoreUnavailable

    if "://" in master or "," in master or ":" not in master:
        return None
    target = _split_host_port(master)
    if target is None or not 0 < target[1] < 65536:
        raise StoreUnavailable(
            f"Mooncake master address {master!r} is not HOST:PORT with a port in [1, 65535]"
        )
    return target


def refuse_metadata_port_as_master(master: str, metadata_server: str | None) -> None:
    """StoreUnavailable when the master address is the http metadata server's own host:port.
    That port answers TCP, and Mooncake's setup would then wait for an RPC reply that never
    comes, holding the GIL (no timeout, no Ctrl-C). Text only: no connection is made."""
    from hostkv_rs.l3.mooncake import StoreUnavailable

    target = _master_target(master)
    if target is None or not metadata_server or not metadata_server.startswith("http"):
        return
    url = urllib.parse.urlsplit(metadata_server)
    try:
        http = ((url.hostname or "").strip("[]"), url.port)
    except ValueError:  # a bad port: the metadata probe names it
        return
    if http == target:
        raise StoreUnavailable(
            f"Mooncake master {master} is the metadata server's HTTP port ({metadata_server}); "
            "give the master's RPC port (mooncake_master --rpc_port, 50051 unless set)"
        )


def probe(master: str, metadata_server: str | None = None, timeout: float = PROBE_TIMEOUT_S):
    """Raise StoreUnavailable, in one line naming the address, when the master (HOST:PORT) does
    not answer an RPC request as a Mooncake master within `timeout` seconds, or an http(s)
    metadata server does not accept a TCP connection in that time. Other forms (etcd://,
    P2PHANDSHAKE, an HA list) are left to Mooncake."""
    from hostkv_rs.l3.mooncake import StoreUnavailable

    refuse_metadata_port_as_master(master, metadata_server)
    target = _master_target(master)
    if target is not None:
        why = _rpc_reply(*target, timeout)
        if why is not None:
            raise StoreUnavailable(
                f"Mooncake master {master} does not answer ({why}); is mooncake_master running "
                "there, and is that its RPC port (mooncake_master --rpc_port, 50051 unless set)?"
            )
    if metadata_server and metadata_server.startswith(("http://", "https://")):
        url = urllib.parse.urlsplit(metadata_server)
        try:
            port = url.port or (443 if url.scheme == "https" else 80)
        except ValueError:
            port = None
        if url.hostname and port is not None:
            why = _reach(url.hostname, port, timeout)
            if why is not None:
                raise StoreUnavailable(
                    f"Mooncake metadata server {metadata_server} does not answer ({why}); the "
                    "master's embedded one needs --enable_http_metadata_server=true"
                )
