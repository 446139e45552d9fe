"""Private, throw-away RabbitMQ nodes for tests that restart, kill or cluster a broker.

The shared broker (``rabbit@localhost`` on port 5672) is never touched: every node
made here has its own name (``wq-test-<hex>@localhost``), its own AMQP and
distribution ports, its own data/log directory, its own config and plugin files,
and its own Erlang cookie (kept in a private ``HOME``), so even a wrong node name
cannot reach the shared broker through ``rabbitmqctl``.

Typical use::

    with BrokerNode() as node:            # start() on enter, cleanup() on exit
        ...connect to node.url...
        node.restart()                    # graceful stop + start, same data dir
        node.kill()                       # SIGKILL the beam process
        node.start()

    with running_cluster(3) as nodes:     # three nodes joined into one cluster
        urls = cluster_url(nodes)         # "amqp://...:P1/,amqp://...:P2/,..."

All methods block; from async code use ``await node.arestart()`` etc. (they run the
blocking call in a worker thread so the event loop keeps serving connections).

Pitfalls handled here (see the module's helpers for details):

* ``/usr/sbin/rabbitmq-server`` and ``/usr/sbin/rabbitmqctl`` are Debian wrappers
  that, when run as root, ``su`` to the ``rabbitmq`` user, ``cd /var/lib/rabbitmq``
  (shared cookie) and redirect output to the shared broker's
  ``/var/log/rabbitmq/startup_log``.  We run ``/usr/lib/rabbitmq/bin/*`` directly.
* ``/etc/rabbitmq/rabbitmq-env.conf`` sets ``NODENAME=rabbit@localhost`` and
  ``/etc/rabbitmq/rabbitmq.conf`` binds port 5672; both are replaced by per-node
  files via ``RABBITMQ_CONF_ENV_FILE`` / ``RABBITMQ_CONFIG_FILE``.
* Ports are picked below the kernel's ephemeral range so that a stopped node's
  port is not grabbed by some outgoing connection before ``restart()``.
* A tiny ``sh`` watchdog per node SIGKILLs the beam process if the Python process
  dies without cleaning up (e.g. the test run is SIGKILLed); ``atexit`` covers
  normal interpreter exit.  Processes are only ever killed by pid, and only after
  checking ``/proc/<pid>/environ`` carries this node's ``RABBITMQ_NODENAME``.
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import json
import os
import random
import secrets
import shutil
import signal
import socket
import subprocess
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

RABBITMQ_BIN = Path(os.environ.get("WQ_RABBITMQ_BIN", "/usr/lib/rabbitmq/bin"))
RABBITMQ_SERVER = RABBITMQ_BIN / "rabbitmq-server"
RABBITMQCTL = RABBITMQ_BIN / "rabbitmqctl"

SHARED_NODE = "rabbit@localhost"
# Ports never handed out: epmd, the shared broker's AMQP/dist ports, CLI dist range.
_RESERVED_PORTS = {4369, 5672, 5671, 15672, 25672, *range(35672, 35683)}

_lock = threading.Lock()
_used_ports: set[int] = set()
_live_nodes: set[BrokerNode] = set()
_home_dir: Path | None = None


class BrokerError(RuntimeError):
    """A private node failed to start, stop or answer a command."""


# --------------------------------------------------------------------------- helpers


def _ephemeral_low() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def _port_is_free(port: int) -> bool:
    """True if nobody listens on `port` (TIME_WAIT leftovers are fine: Erlang sets
    SO_REUSEADDR on its listeners, and so do we here)."""
    for addr in ("127.0.0.1", "0.0.0.0"):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                sock.bind((addr, port))
                sock.listen(1)
            except OSError:
                return False
    return True


def free_port() -> int:
    """Return a currently free TCP port below the ephemeral range, unique in this process."""
    high = min(_ephemeral_low(), 65535) - 1
    low = max(10000, high - 12000)
    with _lock:
        for _ in range(1000):
            port = random.randint(low, high)
            if port in _RESERVED_PORTS or port in _used_ports:
                continue
            if _port_is_free(port):
                _used_ports.add(port)
                return port
    raise BrokerError("no free TCP port found")


def _private_home() -> Path:
    """HOME holding the Erlang cookie shared by all private nodes of this process."""
    global _home_dir
    with _lock:
        if _home_dir is None:
            home = Path(tempfile.mkdtemp(prefix="wq-rabbit-home-"))
            cookie = home / ".erlang.cookie"
            cookie.write_text(secrets.token_hex(16).upper())
            cookie.chmod(0o400)
            _home_dir = home
        return _home_dir


def _pid_is_node(pid: int, name: str) -> bool:
    """True if process ``pid`` is alive and was started for node ``name``."""
    try:
        environ = Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return False
    return f"RABBITMQ_NODENAME={name}".encode() in environ.split(b"\0")


def _pid_alive(pid: int) -> bool:
    """True if `pid` exists and is not a zombie."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def amqp_handshake(host: str, port: int, timeout: float = 2.0) -> bool:
    """True if an AMQP 0-9-1 server answers the protocol header with Connection.Start."""
    try:
        with socket.create_connection((host, port), timeout=timeout) as sock:
            sock.settimeout(timeout)
            sock.sendall(b"AMQP\x00\x00\x09\x01")
            data = b""
            while len(data) < 11:
                chunk = sock.recv(4096)
                if not chunk:
                    return False
                data += chunk
    except OSError:
        return False
    # frame type 1 (method), channel 0, then class 10 / method 10 = Connection.Start
    return data[0] == 1 and data[7:11] == b"\x00\x0a\x00\x0a"


def _port_open(host: str, port: int) -> bool:
    try:
        with socket.create_connection((host, port), timeout=0.5):
            return True
    except OSError:
        return False


_FIRST_ERROR_MARKERS = ("Error during startup", "BOOT FAILED", "[error]")


def _tail(path: Path, lines: int) -> str:
    """Last `lines` lines of a log, preceded by the first error block if it scrolled off."""
    try:
        all_lines = path.read_text(errors="replace").splitlines()
    except OSError:
        return f"<no {path.name}>"
    tail = all_lines[-lines:]
    head: list[str] = []
    for i, line in enumerate(all_lines[: max(0, len(all_lines) - lines)]):
        if any(marker in line for marker in _FIRST_ERROR_MARKERS):
            head = [*all_lines[i : i + 8], "[...]"]
            break
    return "\n".join(head + tail)


# --------------------------------------------------------------------------- node


class BrokerNode:
    """One private RabbitMQ node (``rabbitmq-server`` run as a child process)."""

    def __init__(
        self,
        name: str | None = None,
        *,
        base_dir: str | os.PathLike[str] | None = None,
        port: int | None = None,
        dist_port: int | None = None,
        extra_config: str = "",
        start_timeout: float = 90.0,
    ) -> None:
        if name is None:
            name = f"wq-test-{secrets.token_hex(4)}@localhost"
        if "@" not in name:
            name += "@localhost"
        if name == SHARED_NODE or name.split("@")[0] == "rabbit":
            raise ValueError(f"refusing to use the shared broker's node name {name!r}")
        self.name = name
        self.host = "127.0.0.1"
        self.port = port or free_port()
        self.dist_port = dist_port or free_port()
        if 5672 in (self.port, self.dist_port) or 25672 in (self.port, self.dist_port):
            raise ValueError("refusing to use the shared broker's ports")
        self.start_timeout = start_timeout
        short = name.split("@")[0]
        if base_dir is None:
            self.data_dir = Path(tempfile.mkdtemp(prefix=f"{short}-"))
        else:
            self.data_dir = Path(base_dir) / short
            self.data_dir.mkdir(parents=True, exist_ok=False)
        self.log_dir = self.data_dir / "log"
        self.log_file = self.log_dir / f"{name}.log"
        self.stdout_file = self.data_dir / "stdout.log"
        self.pid_file = self.data_dir / "node.pid"
        self._write_config(extra_config)
        self._proc: subprocess.Popen[bytes] | None = None
        self._watchdog: subprocess.Popen[bytes] | None = None
        self.beam_pid: int | None = None
        self._launched_at = 0.0

    # ----------------------------------------------------------------- properties

    @property
    def url(self) -> str:
        return f"amqp://guest:guest@{self.host}:{self.port}/"

    @property
    def running(self) -> bool:
        """True while the node's beam process is alive (it may still be booting)."""
        return self.beam_pid is not None and _pid_is_node(self.beam_pid, self.name)

    def __repr__(self) -> str:
        state = f"pid {self.beam_pid}" if self.running else "stopped"
        return f"<BrokerNode {self.name} port {self.port} {state}>"

    # ----------------------------------------------------------------- setup

    def _write_config(self, extra_config: str) -> None:
        self.log_dir.mkdir(parents=True, exist_ok=True)
        (self.data_dir / "enabled_plugins").write_text("[].\n")
        (self.data_dir / "rabbitmq-env.conf").write_text("")  # replaces /etc's NODENAME=rabbit
        (self.data_dir / "conf.d").mkdir(exist_ok=True)
        (self.data_dir / "rabbitmq.conf").write_text(
            f"listeners.tcp.1 = 127.0.0.1:{self.port}\n"
            "loopback_users.guest = true\n"
            "disk_free_limit.absolute = 1MB\n"
            "log.console = false\n"
            "log.file.level = info\n"
            f"{extra_config}\n"
        )

    def env(self) -> dict[str, str]:
        """Environment for rabbitmq-server / rabbitmqctl of this node (hermetic)."""
        env = {k: v for k, v in os.environ.items() if not k.startswith(("RABBITMQ_", "ERL_"))}
        d = self.data_dir
        env.update(
            HOME=str(_private_home()),
            RABBITMQ_NODENAME=self.name,
            RABBITMQ_USE_LONGNAME="false",
            RABBITMQ_NODE_IP_ADDRESS="127.0.0.1",
            RABBITMQ_NODE_PORT=str(self.port),
            RABBITMQ_DIST_PORT=str(self.dist_port),
            RABBITMQ_CONF_ENV_FILE=str(d / "rabbitmq-env.conf"),
            RABBITMQ_CONFIG_FILE=str(d / "rabbitmq.conf"),
            RABBITMQ_CONFIG_FILES=str(d / "conf.d"),
            RABBITMQ_ADVANCED_CONFIG_FILE=str(d / "advanced.config"),
            RABBITMQ_ENABLED_PLUGINS_FILE=str(d / "enabled_plugins"),
            RABBITMQ_MNESIA_BASE=str(d / "mnesia"),
            RABBITMQ_LOG_BASE=str(self.log_dir),
            RABBITMQ_PID_FILE=str(self.pid_file),
            # keep the distribution listener on loopback like the shared broker
            RABBITMQ_SERVER_ADDITIONAL_ERL_ARGS="-kernel inet_dist_use_interface {127,0,0,1}",
        )
        return env

    # ----------------------------------------------------------------- lifecycle

    def launch(self) -> None:
        """Spawn rabbitmq-server without waiting (use wait_started()); see start()."""
        self._reap()
        if self.running or self._proc is not None:
            raise BrokerError(f"{self.name} is already running (pid {self.beam_pid})")
        if not _port_is_free(self.port):
            raise BrokerError(f"AMQP port {self.port} of {self.name} is in use by someone else")
        if not _port_is_free(self.dist_port):
            raise BrokerError(f"dist port {self.dist_port} of {self.name} is in use")
        with contextlib.suppress(FileNotFoundError):
            self.pid_file.unlink()
        with _lock:
            _live_nodes.add(self)
        with open(self.stdout_file, "ab") as out:
            out.write(f"\n===== launch {time.strftime('%H:%M:%S')} =====\n".encode())
            out.flush()
            self._proc = subprocess.Popen(
                [str(RABBITMQ_SERVER)],
                cwd=self.data_dir,
                env=self.env(),
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # Ctrl-C of pytest is not forwarded
            )
        self._launched_at = time.monotonic()

    def wait_started(self, timeout: float | None = None) -> None:
        """Wait until the AMQP port answers and `rabbitmqctl await_startup` succeeds."""
        timeout = self.start_timeout if timeout is None else timeout
        deadline = self._launched_at + timeout
        try:
            while True:
                if self.beam_pid is None:
                    self._find_beam_pid()
                if self._proc is None or self._proc.poll() is not None:
                    code = None if self._proc is None else self._proc.returncode
                    raise self._startup_error(f"rabbitmq-server exited with {code}")
                if self.beam_pid is not None and amqp_handshake(self.host, self.port):
                    break
                if time.monotonic() > deadline:
                    raise self._startup_error(f"no AMQP on port {self.port} after {timeout:.0f}s")
                time.sleep(0.1)
            remaining = max(5, int(deadline - time.monotonic()))
            try:
                self.ctl("await_startup", "--timeout", str(remaining), timeout=remaining + 10)
            except BrokerError as exc:
                raise self._startup_error(str(exc)) from None
        except BaseException:
            self.kill()
            raise
        self._start_watchdog()

    def start(self, timeout: float | None = None) -> BrokerNode:
        """Start the node (same data dir as before, if any) and wait until it serves AMQP."""
        self.launch()
        self.wait_started(timeout)
        return self

    def stop(self, timeout: float = 60.0) -> None:
        """Graceful stop (`rabbitmqctl stop`, SIGTERM as fallback); waits for port closed."""
        if not self.running:
            self._reap()
            return
        self._stop_watchdog()
        pid = self.beam_pid
        try:
            self.ctl("stop", timeout=timeout)
        except BrokerError:
            if pid is not None and _pid_is_node(pid, self.name):
                os.kill(pid, signal.SIGTERM)
        if not self._wait_gone(timeout):
            self.kill()
            raise BrokerError(f"{self.name} did not stop within {timeout}s; killed it")
        self._reap()

    def kill(self) -> None:
        """SIGKILL the node's beam process (like a crash / power loss) and reap it."""
        self._stop_watchdog()
        wrapper = self._proc
        if self.beam_pid is None and wrapper is not None and wrapper.poll() is None:
            self._find_beam_pid()
        pid = self.beam_pid
        if pid is not None and _pid_is_node(pid, self.name):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        if wrapper is not None:
            try:  # the rabbitmq-server script reaps beam, then exits
                wrapper.wait(timeout=10 if pid is not None else 0)
            except subprocess.TimeoutExpired:
                # beam pid unknown (killed very early in boot): the wrapper's own
                # process group holds only this node's processes
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(wrapper.pid, signal.SIGKILL)
                wrapper.wait(timeout=10)
        self._wait_gone(30)
        self._reap()

    def restart(self, timeout: float | None = None, *, kill: bool = False) -> BrokerNode:
        """Stop (or kill, if kill=True) the node if running, then start it on the same data."""
        if kill:
            self.kill()
        else:
            self.stop()
        return self.start(timeout)

    def cleanup(self, *, graceful: bool = False, remove_data: bool = True) -> None:
        """Kill (or stop, if graceful) the node if running and delete its data dir."""
        try:
            if graceful and self.running:
                with contextlib.suppress(BrokerError):
                    self.stop(timeout=30)
            self.kill()
        finally:
            with _lock:
                _live_nodes.discard(self)
                _used_ports.discard(self.port)
                _used_ports.discard(self.dist_port)
            if remove_data:
                shutil.rmtree(self.data_dir, ignore_errors=True)

    def __enter__(self) -> BrokerNode:
        if not self.running:
            self.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.cleanup()

    # async conveniences: run the blocking call in a thread, keep the loop alive
    async def astart(self, start_timeout: float | None = None) -> BrokerNode:
        return await asyncio.to_thread(self.start, start_timeout)

    async def astop(self, stop_timeout: float = 60.0) -> None:
        await asyncio.to_thread(self.stop, stop_timeout)

    async def akill(self) -> None:
        await asyncio.to_thread(self.kill)

    async def arestart(self, start_timeout: float | None = None, *, kill: bool = False) -> BrokerNode:
        return await asyncio.to_thread(self.restart, start_timeout, kill=kill)

    # ----------------------------------------------------------------- commands

    def ctl(self, *args: str, timeout: float = 60.0, check: bool = True) -> str:
        """Run `rabbitmqctl -n NAME ARGS...` for this node and return its stdout."""
        cmd = [str(RABBITMQCTL), "-n", self.name, *args]
        try:
            res = subprocess.run(
                cmd,
                env=self.env(),
                cwd=self.data_dir,
                stdin=subprocess.DEVNULL,
                capture_output=True,
                text=True,
                timeout=timeout,
            )
        except subprocess.TimeoutExpired:
            raise BrokerError(f"{' '.join(cmd[1:])}: timed out after {timeout}s") from None
        if check and res.returncode != 0:
            raise BrokerError(
                f"rabbitmqctl {' '.join(cmd[1:])} exited {res.returncode}:\n"
                f"{res.stdout.strip()}\n{res.stderr.strip()}".rstrip()
            )
        return res.stdout

    def close_all_connections(self, reason: str = "test") -> None:
        """Force-close every client connection on this node (clients see a 320)."""
        self.ctl("close_all_connections", reason)

    def list_queues(self, *columns: str) -> list[list[str]]:
        """Rows of `rabbitmqctl list_queues COLUMNS` (default: name messages)."""
        cols = columns or ("name", "messages")
        out = self.ctl("list_queues", "-q", "--no-table-headers", *cols)
        return [line.split("\t") for line in out.splitlines() if line.strip()]

    def queue_messages(self, queue: str) -> int | None:
        """Number of messages (ready + unacked) in `queue`, None if it does not exist."""
        for row in self.list_queues("name", "messages"):
            if row[0] == queue:
                return int(row[1])
        return None

    def cluster_status(self) -> dict[str, Any]:
        """`rabbitmqctl cluster_status --formatter json`, parsed."""
        status: dict[str, Any] = json.loads(self.ctl("cluster_status", "--formatter", "json"))
        return status

    def running_nodes(self) -> list[str]:
        """Names of the running members of this node's cluster."""
        return sorted(self.cluster_status()["running_nodes"])

    def log_tail(self, lines: int = 40) -> str:
        """Last lines of the node log and of rabbitmq-server's stdout."""
        return (
            f"--- {self.log_file}\n{_tail(self.log_file, lines)}\n"
            f"--- {self.stdout_file}\n{_tail(self.stdout_file, lines)}"
        )

    # ----------------------------------------------------------------- internals

    def _startup_error(self, why: str) -> BrokerError:
        return BrokerError(
            f"private RabbitMQ node {self.name} (port {self.port}, data {self.data_dir}) "
            f"failed to start: {why}\n{self.log_tail()}"
        )

    def _find_beam_pid(self) -> None:
        candidates: list[int] = []
        with contextlib.suppress(OSError, ValueError):
            candidates.append(int(self.pid_file.read_text().strip()))
        if self._proc is not None:  # the wrapper's background child is erl -> beam
            for task in Path(f"/proc/{self._proc.pid}/task").glob("*/children"):
                with contextlib.suppress(OSError, ValueError):
                    candidates += [int(p) for p in task.read_text().split()]
        for pid in candidates:
            if _pid_is_node(pid, self.name) and self._is_beam(pid):
                self.beam_pid = pid
                return

    @staticmethod
    def _is_beam(pid: int) -> bool:
        try:
            return Path(f"/proc/{pid}/exe").resolve().name.startswith("beam")
        except OSError:
            return False

    def _wait_gone(self, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            beam_alive = self.beam_pid is not None and _pid_alive(self.beam_pid)
            wrapper_alive = self._proc is not None and self._proc.poll() is None
            if not beam_alive and not wrapper_alive and not _port_open(self.host, self.port):
                return True
            time.sleep(0.05)
        return False

    def _reap(self) -> None:
        if self._proc is not None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                self._proc.wait(timeout=5)
            if self._proc.poll() is not None:
                self._proc = None
        if self.beam_pid is not None and not _pid_is_node(self.beam_pid, self.name):
            self.beam_pid = None

    def _start_watchdog(self) -> None:
        """sh process that SIGKILLs our beam once our end of its stdin pipe closes.

        That happens only if this Python process dies without cleanup: before
        stopping/killing the node ourselves we kill the watchdog first.
        """
        self._stop_watchdog()
        script = (
            "read _ || :; "
            'if tr "\\0" "\\n" < "/proc/$1/environ" 2>/dev/null | grep -qxF "RABBITMQ_NODENAME=$2"; '
            'then kill -9 "$1"; fi'
        )
        self._watchdog = subprocess.Popen(
            ["sh", "-c", script, "wq-broker-watchdog", str(self.beam_pid), self.name],
            stdin=subprocess.PIPE,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )

    def _stop_watchdog(self) -> None:
        wd, self._watchdog = self._watchdog, None
        if wd is not None:
            wd.kill()
            wd.wait()
            if wd.stdin is not None:
                wd.stdin.close()


# --------------------------------------------------------------------------- cluster


def start_cluster(
    n: int = 3,
    *,
    base_dir: str | os.PathLike[str] | None = None,
    extra_config: str = "",
    timeout: float = 120.0,
) -> list[BrokerNode]:
    """Start n private nodes and join nodes 2..n to node 1; returns them, node 1 first.

    Nodes boot in parallel; joins are sequential (stop_app, join_cluster, start_app).
    On failure every node is cleaned up and BrokerError is raised.
    """
    nodes = [BrokerNode(base_dir=base_dir, extra_config=extra_config) for _ in range(n)]
    try:
        for node in nodes:
            node.launch()
        for node in nodes:
            node.wait_started(timeout)
        seed = nodes[0]
        for node in nodes[1:]:
            node.ctl("stop_app")
        for node in nodes[1:]:
            node.ctl("join_cluster", seed.name)
            node.ctl("start_app")
        for node in nodes[1:]:
            node.ctl("await_startup", "--timeout", "60", timeout=70)
        expected = sorted(node.name for node in nodes)
        deadline = time.monotonic() + 30
        while (running := seed.running_nodes()) != expected:
            if time.monotonic() > deadline:
                raise BrokerError(f"cluster has running nodes {running}, expected {expected}")
            time.sleep(0.5)
    except BaseException:
        cleanup_nodes(nodes)
        raise
    return nodes


def cleanup_nodes(nodes: list[BrokerNode]) -> None:
    """cleanup() every node (kill + remove data), even if some fail."""
    errors = []
    for node in nodes:
        try:
            node.cleanup()
        except Exception as exc:  # collect, clean the rest
            errors.append(exc)
    if errors:
        raise errors[0]


@contextlib.contextmanager
def running_cluster(n: int = 3, **kwargs: object) -> Iterator[list[BrokerNode]]:
    """Context manager around start_cluster() / cleanup_nodes()."""
    nodes = start_cluster(n, **kwargs)  # type: ignore[arg-type]
    try:
        yield nodes
    finally:
        cleanup_nodes(nodes)


def cluster_url(nodes: list[BrokerNode]) -> str:
    """Comma-separated AMQP URLs of the nodes (the scripts' --url / AMQP_URL syntax)."""
    return ",".join(node.url for node in nodes)


@atexit.register
def _cleanup_at_exit() -> None:
    with _lock:
        nodes = list(_live_nodes)
    for node in nodes:
        with contextlib.suppress(Exception):
            node.cleanup()
    if _home_dir is not None:
        shutil.rmtree(_home_dir, ignore_errors=True)
