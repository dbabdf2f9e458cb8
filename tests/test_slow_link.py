"""The slow-link harness (``jaxcomp.train.namespaces``, ``jaxcomp.train.link_job``): rates, the
refusal messages, a link that is really rate-limited, a namespace that is gone on every exit path,
and workers that time the main job's ``data_parallel`` steps without torch.

The namespace tests need root and the ``ip`` / ``tc`` commands; where they are missing they skip
with that reason (CI runs as root, so there they run).
"""

import os
import signal
import subprocess
import sys
import textwrap
import time

import jax
import pytest

from jaxcomp.train import link_job, namespaces, tasks

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
REASON = namespaces.unavailable_reason()
needs_link = pytest.mark.skipif(REASON is not None, reason=f"no network namespaces here: {REASON}")


def _namespaces():
  return subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout


def _python(code, **kwargs):
  env = dict(os.environ, PYTHONPATH=ROOT)
  env.update(kwargs.pop("env", {}))
  return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=env, capture_output=True,
                        text=True, timeout=120, **kwargs)


@pytest.mark.parametrize("rate", ["none", "100mbit", "1gbit", "2.5gbit", "500kbit"])
def test_rates_that_tc_understands(rate):
  assert namespaces.check_rate(rate) == rate


@pytest.mark.parametrize("rate", ["100", "fast", "100 mbit", "100MB", "", "1gbps"])
def test_bad_rates_are_refused_with_the_fix(rate):
  with pytest.raises(ValueError, match="rate must be 'none' or a number with kbit, mbit or gbit"):
    namespaces.check_rate(rate)


def test_rate_bits():
  assert namespaces.rate_bits("100mbit") == 1e8
  assert namespaces.rate_bits("1gbit") == 1e9
  assert namespaces.rate_bits("none") is None


def test_a_wrappers_timed_rounds_hold_whole_periods_of_steps():
  # Every step's collectives: period 1; DiLoCo's sync every 20 steps; Streaming DiLoCo's fragments,
  # each on a quarter of the steps (the 0.0 one is a warm-up, which never runs in the steady state).
  assert link_job.period([["all-reduce", 400, 1.0]]) == 1
  assert link_job.period([["all-reduce", 400, 0.05], ["all-reduce", 4, 1.0]]) == 20
  assert link_job.period([["all-reduce", 100, 0.25], ["all-reduce", 100, 0.25],
                          ["all-gather", 8, 0.0]]) == 4
  assert [link_job.whole_periods(steps, 20) for steps in (1, 20, 21)] == [20, 20, 40]
  assert link_job.whole_periods(7, 1) == 7


def test_qdisc_commands_use_a_large_tbf_limit():
  commands = namespaces.qdisc_commands("100mbit")
  assert commands[-1] == ["qdisc", "add", "dev", "lo", "root", "tbf", "rate", "100mbit", "burst",
                          "256kb", "limit", "64mb"]
  assert namespaces.qdisc_commands("none") == [["qdisc", "del", "dev", "lo", "root"]]
  with_delay = namespaces.qdisc_commands("1gbit", latency_ms=5)
  assert "netem" in with_delay[1] and with_delay[2][4:7] == ["parent", "1:", "handle"]


def test_missing_ip_and_tc_is_one_line(tmp_path):
  # A PATH with python but neither ip nor tc.
  (tmp_path / "python").symlink_to(sys.executable)
  proc = _python("""
      from jaxcomp.train import namespaces
      print(namespaces.unavailable_reason())
      """, env={"PATH": str(tmp_path)})
  assert proc.returncode == 0, proc.stderr
  if os.geteuid() == 0:
    assert proc.stdout.strip() == ("a slow link needs the ip and tc commands (iproute2: apt-get "
                                   "install iproute2)")


@pytest.mark.skipif(os.geteuid() != 0 or not os.path.exists("/usr/bin/setpriv"),
                    reason="needs root to run a check as another user")
def test_not_root_is_one_line():
  proc = subprocess.run(
      ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", sys.executable, "-c",
       "from jaxcomp.train import namespaces; print(namespaces.unavailable_reason())"],
      env=dict(os.environ, PYTHONPATH=ROOT), capture_output=True, text=True, timeout=120)
  if proc.returncode:
    pytest.skip(f"this Python cannot run as nobody here: {proc.stderr.strip()[-200:]}")
  assert proc.stdout.strip() == ("a slow link needs root (it creates a network namespace and "
                                 "rate-limits its loopback with tc); run as root")


def test_slow_link_refuses_when_unavailable(monkeypatch):
  monkeypatch.setattr(namespaces, "unavailable_reason", lambda: "a slow link needs root (...)")
  with pytest.raises(namespaces.LinkError, match="needs root"):
    with namespaces.SlowLink("100mbit"):
      pass


@needs_link
def test_the_link_is_rate_limited_and_removed_after_the_block():
  probe = ("from jaxcomp.train import namespaces; import json; "
           "print(json.dumps(namespaces.probe(0.5)))")
  measured = {}
  for rate in ("100mbit", "none"):
    with namespaces.SlowLink(rate) as slow:
      name = slow.name
      assert name in _namespaces()
      out = subprocess.run(["ip", "netns", "exec", name, sys.executable, "-c", probe],
                           env=dict(os.environ, PYTHONPATH=ROOT), capture_output=True, text=True,
                           timeout=120)
      assert out.returncode == 0, out.stderr
      measured[rate] = eval(out.stdout)  # a dict of two floats
      qdisc = subprocess.run(["tc", "-n", name, "qdisc", "show", "dev", "lo"], capture_output=True,
                             text=True).stdout
      assert ("tbf" in qdisc) == (rate != "none")
    assert name not in _namespaces()
  # 100 Mbit/s is 12.5 MB/s. Unlimited, one Python stream moves more (hundreds of MB/s on an idle
  # machine; only tens when the CPU is starved, so the bound is loose).
  assert 5e6 < measured["100mbit"]["beta"] < 16e6
  assert measured["none"]["beta"] > 1.5 * measured["100mbit"]["beta"]


@needs_link
def test_namespace_is_removed_when_the_block_raises():
  with pytest.raises(KeyError):
    with namespaces.SlowLink("1gbit") as slow:
      name = slow.name
      raise KeyError("boom")
  assert name not in _namespaces()


# The holder sets its own dispositions first (a process started from a shell may inherit SIGINT or
# SIGHUP ignored: a background job, nohup), then waits on stdin so that the test sees its namespace
# before it exits.
HOLDER = """
import signal, sys
signal.signal(signal.SIGINT, signal.default_int_handler)
for sig in (signal.SIGTERM, signal.SIGHUP):
  signal.signal(sig, signal.SIG_DFL)
if {ignore_sighup!r}:
  signal.signal(signal.SIGHUP, signal.SIG_IGN)
from jaxcomp.train import namespaces
slow = namespaces.SlowLink("100mbit").__enter__()       # no with-block: atexit must clean up
worker = slow.popen([sys.executable, "-c", "import time; time.sleep(600)"])
print(slow.name, worker.pid, flush=True)
sys.stdin.readline()
"""


def _worker_is_gone(pid, seconds=10) -> bool:
  deadline = time.time() + seconds
  while os.path.exists(f"/proc/{pid}") and time.time() < deadline:
    time.sleep(0.1)
  return not os.path.exists(f"/proc/{pid}")


@needs_link
@pytest.mark.parametrize("how", ["SIGTERM", "SIGINT", "SIGHUP", "exit",
                                 "SIGHUP ignored, then exit"])
def test_namespace_and_workers_are_gone_on_signals_and_exit(how):
  """A signal (handled by default) ends the holder and its namespace; a signal the user ignores is
  left ignored (the holder lives on) and the namespace goes at exit."""
  ignored = how.startswith("SIGHUP ignored")
  holder = subprocess.Popen([sys.executable, "-c", HOLDER.format(ignore_sighup=ignored)],
                            env=dict(os.environ, PYTHONPATH=ROOT), stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
  name, worker = None, None
  try:
    name, worker = holder.stdout.readline().split()
    assert name in _namespaces()
    if how.startswith("SIG"):
      holder.send_signal(getattr(signal, how.split()[0]))
    if ignored:
      time.sleep(1)
      assert holder.poll() is None, "an ignored SIGHUP ended the holder"
      assert name in _namespaces()
    if how.endswith("exit"):
      holder.stdin.write("\n")
      holder.stdin.flush()
    holder.wait(timeout=60)
    assert name not in _namespaces()
    assert _worker_is_gone(worker), "the worker outlived the harness"
  finally:  # whatever failed above, leave nothing behind
    holder.kill()
    holder.wait()
    if worker is not None and os.path.exists(f"/proc/{worker}"):
      os.kill(int(worker), signal.SIGKILL)
    if name is not None and name in _namespaces():
      subprocess.run(["ip", "netns", "del", name], capture_output=True)


@needs_link
def test_a_namespace_left_by_sigkill_is_removed_by_the_next_link():
  holder = subprocess.Popen(
      [sys.executable, "-c", textwrap.dedent("""
          import time
          from jaxcomp.train import namespaces
          slow = namespaces.SlowLink("none").__enter__()
          print(slow.name, flush=True)
          time.sleep(600)
          """)], env=dict(os.environ, PYTHONPATH=ROOT), stdout=subprocess.PIPE, text=True)
  name = holder.stdout.readline().strip()
  holder.kill()  # SIGKILL: no handler runs
  holder.wait(timeout=60)
  assert name in _namespaces()
  with namespaces.SlowLink("none"):
    assert name not in _namespaces()


@needs_link
def test_added_latency_works_or_says_netem_is_missing():
  try:
    with namespaces.SlowLink("100mbit", latency_ms=5) as slow:
      qdisc = subprocess.run(["tc", "-n", slow.name, "qdisc", "show", "dev", "lo"],
                             capture_output=True, text=True).stdout
      assert "netem" in qdisc and "tbf" in qdisc
  except namespaces.LinkError as e:
    assert "netem" in str(e) and "latency cannot be emulated here" in str(e)
    assert "\n" not in str(e)
  assert not any(n.startswith(namespaces.PREFIX + str(os.getpid()))
                 for n in _namespaces().split())


@pytest.mark.slow  # an end-to-end run of a script or of several processes
@needs_link
def test_workers_time_the_main_jobs_data_parallel_steps_without_torch(tmp_path, monkeypatch):
  blocker = tmp_path / "torch"
  blocker.mkdir()
  (blocker / "__init__.py").write_text("raise ImportError('jaxcomp imported torch')\n")
  monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(tmp_path), ROOT]))  # the workers' too
  job = link_job.Job(task="digits", quick=True, seed=0, batch_size=16, world=2, rates=["none"],
                     programs={"allreduce": ["allreduce", {}], "fp16": ["fp16", {}]}, rounds=1,
                     round_seconds=0.05, check={"rate": "none", "names": ["fp16"], "steps": 3})
  try:
    result = link_job.run_job(job, timeout=600, log=lambda line: None)
  finally:
    assert not any(n.startswith(f"{namespaces.PREFIX}{os.getpid()}-")
                   for n in _namespaces().split())
  dense = 4 * sum(x.size for x in jax.tree.leaves(tasks.digits(quick=True).init(0)))
  # data_parallel's step: the compressor's mean and nothing else, not even a mean of the loss (the
  # losses come back per device).
  assert result["collectives"] == {"allreduce": [["all-reduce", dense, 1.0]],
                                   "fp16": [["all-reduce", dense // 2, 1.0]]}
  assert set(result["links"]["none"]["seconds"]) == {"allreduce", "fp16"}
  losses = result["checks"]["fp16"]["losses"]
  assert len(losses) == 3 and all(0 < loss < 10 for loss in losses)
