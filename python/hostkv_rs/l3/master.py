"""A Mooncake master on loopback, for the demo, the benchmark and the tests.

`LoopbackMaster.start()` runs the `mooncake_master` binary that the
`mooncake-transfer-engine-non-cuda` wheel installs, on two free 127.0.0.1 ports (its RPC port and
its embedded HTTP metadata server), waits until both accept connections, and `stop()` ends that
one process by its pid (SIGTERM, then SIGKILL after a grace period). Nothing else is touched.
Its metrics/admin HTTP server also gets a free loopback port (the binary's default is
0.0.0.0:9003, which a second master, or anything else on 9003, would collide with).

A master never outlives the process that started it: masters still running at interpreter exit
are stopped, and the kernel kills one whose parent dies without exiting cleanly (SIGKILL, a
crash) through PR_SET_PDEATHSIG. That signal follows the starting *thread*: a master started
from a thread that ends is killed with it (pass `die_with_parent=False` to opt out of both).
"""

from __future__ import annotations

import atexit
import ctypes
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

LOOPBACK = "127.0.0.1"
_PR_SET_PDEATHSIG = 1

# Masters this process started and has not stopped, for the exit hook.
_LIVE: set[LoopbackMaster] = set()
_LIVE_LOCK = threading.Lock()


def _prctl():
    """libc's prctl, looked up in the parent: a forked child of a threaded process must not run
    the dynamic loader (a lock another thread held at the fork stays held)."""
    try:
        return ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):  # not Linux / no glibc symbol: atexit alone
        return None


def _die_with_parent(prctl, parent: int):
    def preexec() -> None:
        prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        if os.getppid() != parent:  # the parent died before the prctl took effect
            os._exit(1)

    return preexec


def stop_all(grace: float = 2.0) -> None:
    """Stop every master this process started and has not stopped (runs at exit)."""
    with _LIVE_LOCK:
        masters = list(_LIVE)
    for master in masters:
        master.stop(grace=grace)
        master.remove_log()


atexit.register(stop_all)


# How long a master whose ports accept must stay up before it counts as started.
_SETTLE_S = 0.5


class MasterError(RuntimeError):
    """The master binary is missing, or it did not come up."""


def free_port(host: str = LOOPBACK) -> int:
    """A TCP port nobody listens on right now (the kernel's pick)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def _distinct_free_ports(n: int) -> list[int]:
    ports: list[int] = []
    while len(ports) < n:
        port = free_port()
        if port not in ports:
            ports.append(port)
    return ports


def master_binary() -> str | None:
    """Path of `mooncake_master`: the binary inside the Mooncake wheel, else the wheel's launcher
    script next to this interpreter or on PATH (it execs the same binary)."""
    try:
        import importlib.util

        spec = importlib.util.find_spec("mooncake")  # locates the package without importing it
    except (ImportError, ValueError):
        spec = None
    candidates = []
    if spec is not None and spec.origin:
        candidates.append(Path(spec.origin).parent / "mooncake_master")
    candidates.append(Path(sys.executable).parent / "mooncake_master")
    for path in candidates:
        if path.is_file() and os.access(path, os.X_OK):
            return str(path)
    return shutil.which("mooncake_master")


def _accepts(host: str, port: int) -> bool:
    try:
        with socket.create_connection((host, port), timeout=0.2):
            return True
    except OSError:
        return False


class LoopbackMaster:
    """One `mooncake_master` process on 127.0.0.1 with its HTTP metadata server.

    `address` ("127.0.0.1:PORT") is what clients pass as the master, `metadata_server`
    ("http://127.0.0.1:PORT/metadata") as the metadata server. Use it as a context manager or call
    `stop()`; `extra_args` go to the binary (e.g. `["--default_kv_lease_ttl=100"]`).
    """

    def __init__(self, process: subprocess.Popen, rpc_port: int, http_port: int, log_path: str):
        self.process = process
        self.rpc_port = rpc_port
        self.http_port = http_port
        self.log_path = log_path

    @property
    def pid(self) -> int:
        return self.process.pid

    @property
    def address(self) -> str:
        return f"{LOOPBACK}:{self.rpc_port}"

    @property
    def metadata_server(self) -> str:
        return f"http://{LOOPBACK}:{self.http_port}/metadata"

    @classmethod
    def start(
        cls,
        extra_args=(),
        *,
        timeout: float = 30.0,
        log_dir: str | None = None,
        die_with_parent: bool = True,
    ):
        binary = master_binary()
        if binary is None:
            raise MasterError(
                'mooncake_master was not found: pip install ".[mooncake]" in the hostkv_rs '
                "checkout (the mooncake-transfer-engine-non-cuda wheel ships it; it also needs "
                "the Debian packages libibverbs1 and libnuma1)"
            )
        prctl = _prctl() if die_with_parent else None
        preexec = _die_with_parent(prctl, os.getpid()) if prctl is not None else None
        last_log = ""
        for _attempt in range(3):  # a port picked as free can be taken before the bind
            rpc_port, http_port, metrics_port = _distinct_free_ports(3)
            fd, log_path = tempfile.mkstemp(prefix="mooncake_master.", suffix=".log", dir=log_dir)
            args = [
                binary,
                f"--rpc_address={LOOPBACK}",
                f"--rpc_port={rpc_port}",
                "--enable_http_metadata_server=true",
                f"--http_metadata_server_host={LOOPBACK}",
                f"--http_metadata_server_port={http_port}",
                # its HTTP metrics/admin server (default 0.0.0.0:9003, so a second master on the
                # machine would fail to start)
                f"--metrics_host={LOOPBACK}",
                f"--metrics_port={metrics_port}",
                *extra_args,
            ]
            with os.fdopen(fd, "wb") as log:
                process = subprocess.Popen(
                    args,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    stdin=subprocess.DEVNULL,
                    # only a prctl resolved beforehand and getppid run between fork and exec
                    preexec_fn=preexec,  # noqa: PLW1509
                )
            master = cls(process, rpc_port, http_port, log_path)
            if die_with_parent:
                with _LIVE_LOCK:
                    _LIVE.add(master)
            deadline = time.monotonic() + timeout
            while time.monotonic() < deadline:
                if process.poll() is not None:
                    break
                if _accepts(LOOPBACK, rpc_port) and _accepts(LOOPBACK, http_port):
                    # Another process may hold a picked port: then the ports accept while this
                    # master fails to bind and exits. One that is still running a moment later
                    # bound them itself.
                    settled = time.monotonic() + _SETTLE_S
                    while process.poll() is None and time.monotonic() < settled:
                        time.sleep(0.02)
                    if process.poll() is None:
                        return master
                    break
                time.sleep(0.02)
            exited_early = process.poll() is not None
            exit_code = process.returncode
            last_log = master.log_tail()
            master.stop()
            master.remove_log()
            if not exited_early:  # it ran but never listened: retrying will not help
                break
        why = (
            f"exited with code {exit_code} (3 tries)"
            if exited_early
            else f"did not listen within {timeout:.0f} s"
        )
        raise MasterError(
            f"mooncake_master did not come up on {LOOPBACK}: it {why}; last lines of its log:\n"
            f"{last_log}"
        )

    def log_tail(self, lines: int = 20) -> str:
        try:
            text = Path(self.log_path).read_text(errors="replace")
        except OSError:
            return ""
        return "\n".join(text.splitlines()[-lines:])

    def running(self) -> bool:
        return self.process.poll() is None

    def stop(self, grace: float = 10.0) -> None:
        """SIGTERM this master (by its pid), SIGKILL it after `grace` seconds. Idempotent."""
        with _LIVE_LOCK:
            _LIVE.discard(self)
        if self.process.poll() is None:
            try:
                self.process.send_signal(signal.SIGTERM)
                self.process.wait(timeout=grace)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
            except ProcessLookupError:
                pass

    def remove_log(self) -> None:
        try:
            os.unlink(self.log_path)
        except OSError:
            pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.stop()
        self.remove_log()
