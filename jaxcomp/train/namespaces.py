"""A real slow link on one machine: a private network namespace whose loopback is rate-limited.

``SlowLink`` (root only) creates a network namespace of its own (``ip netns add``), raises its
loopback's MTU to 9000 (gloo's reads time out behind a rate limit at MTU 65536) and rate-limits it
with a token bucket filter (``tc qdisc ... tbf rate 100mbit burst 256kb limit 64mb``; the large
``limit`` keeps tbf from dropping gloo's bursts). Processes started with ``SlowLink.popen`` live in
that namespace and talk over 127.0.0.1, so every byte they exchange passes the limited queue;
nothing else on the machine is touched. The namespace is removed on every exit path: the ``with``
block's end, an exception, SIGINT / SIGTERM / SIGHUP (the handlers unwind, then re-deliver the
signal), interpreter exit (atexit), and — after a SIGKILL, which nothing can catch — the next
``SlowLink`` removes namespaces left by dead processes. Workers get ``PR_SET_PDEATHSIG``
(``setpriv``), so they die with the process that started them.

**One shared medium.** A loopback has one queue: the traffic of all W workers passes the same tbf,
so the link's rate is shared by all of them (a hub, not a switch). A ring all-reduce of N bytes puts
2(W−1)·N bytes through it in total — W times what one worker sends — so it takes W times as long
as on a switched network whose every port has that rate. ``benchmarks/network_model.py`` models it
that way (β/W per worker); all figures from this harness are for this shared medium.

**Latency.** ``latency_ms`` needs the ``netem`` qdisc (then ``netem delay`` sits above the tbf; on
a loopback each packet is delayed once, so a round trip gains 2× the delay). This machine's kernel
has no ``netem`` (``tc`` answers "Specified qdisc kind is unknown"), and neither tbf nor htb delays
packets, so added latency cannot be emulated here: asking for it fails with that message. The
latency the link has is measured instead (``probe``: a TCP ping-pong inside the namespace) and fed
to the α-β model.

The jobs that run over such a link — W training processes — are ``jaxcomp.train.link_job``'s.

**Several nodes.** ``Nodes`` is the other shape: a namespace per node, each with its own (fast)
loopback, joined through a switch by links limited in both directions — a node's devices and
processes talk among themselves at memory speed and to other nodes at the link's rate, as in a
cluster of several machines. ``jaxcomp.train.nodes`` trains over it.
"""

from __future__ import annotations

import atexit
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import threading
import time
import uuid
from typing import Optional, Sequence

PREFIX = "jaxcomp-"  # namespace names: jaxcomp-<pid of the creating process>-<random>
MTU = 9000
BURST = "256kb"  # tc's kb: kilobytes
BURST_BYTES = 256 * 1024
"""The token bucket's depth: bytes a rate-limited link passes at once before its rate applies (the
α-β model's ``burst``, ``jaxcomp.train.network.shared_medium_time``)."""
LIMIT = "64mb"
HOSTS_DIR = "/etc/netns"
"""``ip netns exec NAME`` mounts the files of ``HOSTS_DIR/NAME/`` over ``/etc/``: a node's own
``hosts`` file names its address (``Nodes``)."""
PROBE_PORT = 12357
_RATE = re.compile(r"^(\d+(?:\.\d+)?)(kbit|mbit|gbit)$")
_UNITS = {"kbit": 1e3, "mbit": 1e6, "gbit": 1e9}


class LinkError(RuntimeError):
  """A slow link cannot be made here; the message is one line saying why."""


def check_rate(rate: str) -> str:
  """``rate`` if it is ``none`` or a tc rate such as ``100mbit`` / ``1gbit`` / ``500kbit``.

  Raises:
    ValueError: anything else.
  """
  if rate == "none" or (isinstance(rate, str) and _RATE.match(rate)):
    return rate
  raise ValueError(f"rate must be 'none' or a number with kbit, mbit or gbit, e.g. 100mbit or "
                   f"1gbit; got {rate!r}")


def rate_bits(rate: str) -> Optional[float]:
  """Bits per second of ``rate`` (None for ``none``)."""
  if check_rate(rate) == "none":
    return None
  number, unit = _RATE.match(rate).groups()
  return float(number) * _UNITS[unit]


def unavailable_reason() -> Optional[str]:
  """Why no slow link can be made on this machine (one line), or None when it can."""
  if os.name != "posix" or not hasattr(os, "geteuid"):
    return "a slow link needs Linux network namespaces"
  if os.geteuid() != 0:
    return ("a slow link needs root (it creates a network namespace and rate-limits its loopback "
            "with tc); run as root")
  missing = [tool for tool in ("ip", "tc") if shutil.which(tool) is None]
  if missing:
    return (f"a slow link needs the {' and '.join(missing)} "
            f"command{'s' if len(missing) > 1 else ''} (iproute2: apt-get install iproute2)")
  return None


def qdisc_commands(rate: str, latency_ms: float = 0.0) -> list:
  """The ``tc`` argument lists that give ``lo`` this rate and added latency (none: no qdisc)."""
  commands = [["qdisc", "del", "dev", "lo", "root"]]  # may fail when there is none: ignored
  tbf = ["tbf", "rate", rate, "burst", BURST, "limit", LIMIT]
  if latency_ms > 0:
    commands.append(["qdisc", "add", "dev", "lo", "root", "handle", "1:", "netem", "delay",
                     f"{latency_ms}ms"])
    if rate != "none":
      commands.append(["qdisc", "add", "dev", "lo", "parent", "1:", "handle", "2:"] + tbf)
  elif rate != "none":
    commands.append(["qdisc", "add", "dev", "lo", "root"] + tbf)
  return commands


def set_link(rate: str, latency_ms: float = 0.0, namespace: Optional[str] = None) -> None:
  """Applies ``rate`` (and latency) to ``lo`` of ``namespace`` (None: the current namespace)."""
  check_rate(rate)
  where = ["-n", namespace] if namespace else []
  for i, command in enumerate(qdisc_commands(rate, latency_ms)):
    done = subprocess.run(["tc"] + where + command, capture_output=True, text=True)
    if done.returncode and i:
      message = (done.stderr.strip() or done.stdout.strip()).splitlines()[0]
      if "netem" in command:
        raise LinkError(f"added latency needs the netem qdisc, which this kernel does not have "
                        f"(tc: {message}); latency cannot be emulated here, leave it out")
      raise LinkError(f"tc {' '.join(command)}: {message}")


# ------------------------------------------------------------------------------------- namespaces

_LIVE: dict = {}  # namespace name -> SlowLink, for the signal and exit handlers
_HANDLED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
_installed = False


def _cleanup_all() -> None:
  for link in list(_LIVE.values()):
    link.close()


def _on_signal(signum, frame):
  _cleanup_all()
  signal.signal(signum, signal.SIG_DFL)
  os.kill(os.getpid(), signum)  # exit as the signal would have made us


def _install_handlers() -> None:
  global _installed
  if _installed:
    return
  atexit.register(_cleanup_all)
  if threading.current_thread() is threading.main_thread():
    for sig in _HANDLED:
      if signal.getsignal(sig) in (signal.SIG_DFL, signal.default_int_handler):
        signal.signal(sig, _on_signal)
  _installed = True


def _remove_stale() -> None:
  """Deletes namespaces this harness made in processes that no longer exist (killed by SIGKILL),
  and their hosts files (``Nodes``)."""
  listing = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
  made = re.findall(rf"^({re.escape(PREFIX)}(\d+)-[0-9a-f]+(?:-\w+)?)", listing, re.M)
  if os.path.isdir(HOSTS_DIR):
    made += [(name, name.split("-")[1]) for name in os.listdir(HOSTS_DIR)
             if re.match(rf"^{re.escape(PREFIX)}\d+-", name)]
  for name, pid in made:
    if not os.path.exists(f"/proc/{pid}"):
      _delete_namespace(name)


def _delete_namespace(name: str) -> None:
  """Deletes namespace ``name`` (with the links in it) and its hosts file, if they exist."""
  subprocess.run(["ip", "netns", "del", name], capture_output=True)
  shutil.rmtree(os.path.join(HOSTS_DIR, name), ignore_errors=True)


def _run(*argv) -> None:
  """Runs an ``ip`` / ``tc`` command; a failure raises ``LinkError`` with its first line."""
  done = subprocess.run(list(argv), capture_output=True, text=True)
  if done.returncode:
    message = (done.stderr.strip() or done.stdout.strip() or "failed").splitlines()[0]
    raise LinkError(f"{' '.join(argv)}: {message}")


class SlowLink:
  """A private network namespace with a rate-limited loopback; a context manager.

  Example::

    with SlowLink("100mbit") as link:
      proc = link.popen([sys.executable, "-c", "..."])   # runs inside the namespace
      proc.wait()
    # the namespace and its processes are gone here

  Args:
    rate: ``"none"`` (plain loopback) or a tc rate, e.g. ``"100mbit"``, ``"1gbit"``.
    latency_ms: added one-way delay per packet (needs ``netem``; see the module docstring).

  Raises:
    LinkError: not root, ``ip``/``tc`` missing, or the kernel refused (the message says which).
  """

  def __init__(self, rate: str = "100mbit", latency_ms: float = 0.0):
    self.rate = check_rate(rate)
    if latency_ms < 0:
      raise ValueError(f"latency_ms must be >= 0; got {latency_ms}")
    self.latency_ms = float(latency_ms)
    self.name: Optional[str] = None
    self.processes: list = []

  def __enter__(self) -> "SlowLink":
    reason = unavailable_reason()
    if reason:
      raise LinkError(reason)
    _install_handlers()
    _remove_stale()
    name = f"{PREFIX}{os.getpid()}-{uuid.uuid4().hex[:6]}"
    made = subprocess.run(["ip", "netns", "add", name], capture_output=True, text=True)
    if made.returncode:
      raise LinkError(f"ip netns add failed: {made.stderr.strip().splitlines()[0]}")
    self.name = name
    _LIVE[name] = self
    try:
      up = subprocess.run(["ip", "-n", name, "link", "set", "lo", "mtu", str(MTU), "up"],
                          capture_output=True, text=True)
      if up.returncode:
        raise LinkError(f"ip link set lo up failed: {up.stderr.strip().splitlines()[0]}")
      set_link(self.rate, self.latency_ms, name)
    except BaseException:
      self.close()
      raise
    return self

  def __exit__(self, *exc) -> None:
    self.close()

  def popen(self, argv: Sequence[str], **kwargs) -> subprocess.Popen:
    """Starts ``argv`` inside the namespace (it dies with this process)."""
    if self.name is None:
      raise RuntimeError("SlowLink.popen outside its with-block")
    # setpriv sets PR_SET_PDEATHSIG and execs argv: the worker is killed when this process dies
    # (a preexec_fn would fork a multithreaded JAX process unsafely).
    orphan_guard = ["setpriv", "--pdeathsig", "KILL"] if shutil.which("setpriv") else []
    proc = subprocess.Popen(["ip", "netns", "exec", self.name, *orphan_guard, *argv], **kwargs)
    self.processes.append(proc)
    return proc

  def close(self) -> None:
    """Kills the processes started here and deletes the namespace (idempotent)."""
    _end(self.processes)
    self.processes = []
    if self.name is not None:
      _delete_namespace(self.name)
      _LIVE.pop(self.name, None)
      self.name = None


# ------------------------------------------------------------------------------------------ nodes

SUBNET = "10.77.0"  # node i is SUBNET.(i + 1) inside its own namespaces: no address leaves them


class Nodes:
  """Several nodes on one machine: a network namespace per node, joined through a switch by links
  rate-limited in both directions; a context manager.

  A node's own loopback is not limited: the processes of a node (and the devices of a process,
  whose collectives gloo also sends over TCP) talk at memory speed. Node ``i`` has the address
  ``address(i)`` on a veth pair to a Linux bridge in a switch namespace; a token bucket filter
  (``tc ... tbf``, the same as ``SlowLink``'s) on both ends of the pair gives every node ``rate``
  up and ``rate`` down, as a network card of that speed on a switched network would. Each node's
  ``/etc/hosts`` (``HOSTS_DIR``) names this machine's host name at the node's address, so that gloo,
  which listens on the address of the host name, listens on the node's link. All of it is removed
  on every exit path, as ``SlowLink``'s namespace is.

  Example::

    with Nodes(2, "100mbit") as nodes:
      procs = [nodes.popen(i, [sys.executable, "worker.py", nodes.address(0)]) for i in range(2)]
      ...
      nodes.sent()          # bytes each node has sent over its link

  Args:
    count: how many nodes (at most 250).
    rate: each node's link, ``"none"`` or a tc rate (``check_rate``).

  Raises:
    LinkError: not root, ``ip``/``tc`` missing, or the kernel refused (the message says which).
  """

  def __init__(self, count: int, rate: str = "100mbit"):
    if not 1 <= count <= 250:
      raise ValueError(f"count must be from 1 to 250 nodes; got {count}")
    self.count, self.rate = count, check_rate(rate)
    self.names: list = []  # the switch's namespace first, then the nodes'
    self.processes: list = []

  def address(self, node: int) -> str:
    """The address of ``node`` on its link."""
    return f"{SUBNET}.{node + 1}"

  def namespace(self, node: int) -> str:
    """The network namespace of ``node``."""
    return self.names[node + 1]

  def __enter__(self) -> "Nodes":
    reason = unavailable_reason()
    if reason:
      raise LinkError(reason)
    _install_handlers()
    _remove_stale()
    self.base = f"{PREFIX}{os.getpid()}-{uuid.uuid4().hex[:6]}"
    _LIVE[self.base] = self
    try:
      self._make(self.base)
    except BaseException:
      self.close()
      raise
    return self

  def _make(self, base: str) -> None:
    switch = f"{base}-sw"
    _run("ip", "netns", "add", switch)
    self.names.append(switch)
    _run("ip", "-n", switch, "link", "add", "br0", "type", "bridge")
    _run("ip", "-n", switch, "link", "set", "br0", "mtu", str(MTU), "up")
    for i in range(self.count):
      node = f"{base}-n{i}"
      _run("ip", "netns", "add", node)
      self.names.append(node)
      hosts = os.path.join(HOSTS_DIR, node)
      os.makedirs(hosts, exist_ok=True)
      with open(os.path.join(hosts, "hosts"), "w") as f:
        f.write(f"127.0.0.1 localhost\n{self.address(i)} {socket.gethostname()}\n")
      _run("ip", "-n", node, "link", "add", "up0", "type", "veth", "peer", "name", f"p{i}",
           "netns", switch)
      _run("ip", "-n", switch, "link", "set", f"p{i}", "master", "br0", "mtu", str(MTU), "up")
      _run("ip", "-n", node, "addr", "add", f"{self.address(i)}/24", "dev", "up0")
      _run("ip", "-n", node, "link", "set", "up0", "mtu", str(MTU), "up")
      _run("ip", "-n", node, "link", "set", "lo", "up")
    self.set_rate(self.rate)

  def set_rate(self, rate: str) -> None:
    """Gives every node's link ``rate`` in both directions (``"none"``: not limited)."""
    set_nodes_rate(self.names, rate)
    self.rate = rate

  def sent(self) -> list:
    """Bytes each node has sent over its link so far (``nodes_sent``)."""
    return nodes_sent(self.names)

  def popen(self, node: int, argv: Sequence[str], **kwargs) -> subprocess.Popen:
    """Starts ``argv`` in ``node``'s namespace (it dies with this process)."""
    if not self.names:
      raise RuntimeError("Nodes.popen outside its with-block")
    orphan_guard = ["setpriv", "--pdeathsig", "KILL"] if shutil.which("setpriv") else []
    proc = subprocess.Popen(["ip", "netns", "exec", self.namespace(node), *orphan_guard, *argv],
                            **kwargs)
    self.processes.append(proc)
    return proc

  def __exit__(self, *exc) -> None:
    self.close()

  def close(self) -> None:
    """Kills the processes started here and deletes the namespaces (idempotent)."""
    _end(self.processes)
    self.processes = []
    for name in reversed(self.names):
      _delete_namespace(name)
    self.names = []
    _LIVE.pop(getattr(self, "base", None), None)


def set_nodes_rate(names: Sequence[str], rate: str) -> None:
  """Gives every link of the ``Nodes`` whose namespaces are ``names`` (``Nodes.names``: the
  switch's, then the nodes') ``rate`` in both directions; a process inside one of them may call
  it (as root)."""
  ends = [end for i, node in enumerate(names[1:]) for end in ((node, "up0"), (names[0], f"p{i}"))]
  for namespace, device in ends:
    subprocess.run(["tc", "-n", namespace, "qdisc", "del", "dev", device, "root"],
                   capture_output=True)  # none there yet: fine
    if check_rate(rate) != "none":
      _run("tc", "-n", namespace, "qdisc", "add", "dev", device, "root", "tbf", "rate", rate,
           "burst", BURST, "limit", LIMIT)


def nodes_sent(names: Sequence[str]) -> list:
  """Bytes each node of the ``Nodes`` whose namespaces are ``names`` has sent over its link so
  far: its end's transmit counter (payload and TCP/IP headers)."""
  counts = []
  for node in names[1:]:
    shown = subprocess.run(["ip", "-n", node, "-s", "-j", "link", "show", "dev", "up0"],
                           capture_output=True, text=True, check=True).stdout
    counts.append(int(json.loads(shown)[0]["stats64"]["tx"]["bytes"]))
  return counts


def _end(processes: Sequence[subprocess.Popen]) -> None:
  """Kills ``processes`` and waits for them (up to 10 s each)."""
  for proc in processes:
    if proc.poll() is None:
      proc.kill()
  for proc in processes:
    try:
      proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
      pass


# ------------------------------------------------------------------------------- link measurement


def probe(seconds: float = 1.5, port: int = PROBE_PORT) -> dict:
  """Measures the current namespace's loopback: one TCP stream's throughput (β, bytes/s) and half
  the round trip of a 1-byte ping-pong (α, s). Call it while nothing else uses the link."""
  server = listen("127.0.0.1", port)
  received = {}
  thread = threading.Thread(target=sink, args=(server, received), daemon=True)
  thread.start()
  alpha = source("127.0.0.1", port, seconds)
  thread.join(timeout=120)
  return {"alpha": alpha, "beta": received["bytes"] / received["seconds"]}


def listen(host: str, port: int = PROBE_PORT) -> socket.socket:
  """A socket listening on ``host:port`` for ``sink``."""
  server = socket.socket()
  server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
  server.bind((host, port))
  server.listen(1)
  return server


def sink(server: socket.socket, received: dict) -> None:
  """The far end of ``source``: answers its ping-pong, then counts the bytes of its stream into
  ``received`` (``bytes``, ``seconds``)."""
  conn, _ = server.accept()
  conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
  for _ in range(200):  # ping-pong
    conn.sendall(conn.recv(1))
  total, start = 0, None
  while True:
    data = conn.recv(1 << 20)
    if not data:
      break
    start = start or time.perf_counter()
    total += len(data)
  received["bytes"], received["seconds"] = total, time.perf_counter() - start
  conn.close()
  server.close()


def source(host: str, port: int = PROBE_PORT, seconds: float = 1.5) -> float:
  """Plays 200 1-byte ping-pongs with ``sink`` at ``host:port``, then streams to it for
  ``seconds``; returns α, half the median round trip (s)."""
  client = socket.create_connection((host, port))
  client.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
  trips = []
  for _ in range(200):
    start = time.perf_counter()
    client.sendall(b"x")
    client.recv(1)
    trips.append(time.perf_counter() - start)
  chunk = b"\0" * (1 << 20)
  end = time.perf_counter() + seconds
  while time.perf_counter() < end:
    client.sendall(chunk)
  client.close()
  trips.sort()
  return trips[len(trips) // 2] / 2
