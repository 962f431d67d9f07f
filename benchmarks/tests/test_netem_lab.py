"""The lab both emulated-network benchmarks share (benchmarks/_netlab.py): its addresses,
names, shaping and topology commands, the rights check, the cleanup of exactly what it created
(also when a launcher's main fails or is interrupted), signals and worker process handling.

Nothing here creates a namespace or runs ``ip``/``tc``: the lab runs on a recording runner,
rights are checked through the function and the ``GRADZIP_NETEM_ASSUME_UNPRIVILEGED``
switch, and process handling is exercised on plain ``sleep`` children.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Sequence

import pytest

from benchmarks import _netlab as netlab
from benchmarks import netem
from benchmarks import netem_steps as steps
from benchmarks._common import module_command, package_env


class FakeRunner:
    """Records commands; fails (or raises ``exc``) on the first command containing ``fail_on``."""

    def __init__(self, fail_on: str | None = None, exc: BaseException | None = None,
                 existing: Sequence[str] = ()) -> None:
        self.calls: list[list[str]] = []
        self.fail_on, self.exc, self.existing = fail_on, exc, list(existing)

    def __call__(self, argv: Sequence[str]) -> str:
        argv = list(argv)
        self.calls.append(argv)
        if self.fail_on is not None and self.fail_on in " ".join(argv):
            self.fail_on = None
            raise self.exc or netlab.LabError(f"`{' '.join(argv)}` failed (2): boom")
        if argv[:3] == ["ip", "netns", "list"]:
            return "".join(f"{n} (id: 0)\n" for n in self.existing)
        return ""

    def added(self) -> list[str]:
        return [c[3] for c in self.calls if c[:3] == ["ip", "netns", "add"]]

    def deleted(self) -> list[str]:
        return [c[3] for c in self.calls if c[:3] == ["ip", "netns", "del"]]


# --------------------------------------------------------------------------- pure helpers


def test_addresses_come_from_the_private_subnet_only():
    assert netlab.worker_addresses("10.77.0.0/24", 3) == ["10.77.0.1", "10.77.0.2", "10.77.0.3"]
    with pytest.raises(ValueError, match="private IPv4"):
        netlab.worker_addresses("8.8.8.0/24", 2)
    with pytest.raises(ValueError, match="private IPv4"):
        netlab.worker_addresses("fd00::/64", 2)
    with pytest.raises(ValueError, match="private IPv4"):
        netlab.worker_addresses("10.77.0.1/24", 2)  # host bits set: not a network
    with pytest.raises(ValueError, match="must hold 4 hosts"):
        netlab.worker_addresses("10.77.0.0/30", 4)


def test_namespace_names_match_the_cleanup_pattern_and_nothing_else():
    hub, names = netlab.namespace_names(4242, 3)
    assert hub == "gzn4242-hub" and names == ["gzn4242-w0", "gzn4242-w1", "gzn4242-w2"]
    assert all(netlab.NAME_RE.match(n) for n in [hub, *names])
    alive = {4242}
    found = netlab.stale_namespaces(
        ["gzn4242-w0", "gzn17-hub", "gzn17-w1", "gzn17-foo", "default", "gzn17-w1x"],
        lambda pid: pid in alive)
    assert found == ["gzn17-hub", "gzn17-w1"]


def test_shaping_is_tbf_alone():
    delete, add = netlab.shaping_commands("ns", "eth0", 100)
    assert delete == ["tc", "-n", "ns", "qdisc", "del", "dev", "eth0", "root"]
    assert add[:9] == ["tc", "-n", "ns", "qdisc", "add", "dev", "eth0", "root", "handle"]
    assert add[10:13] == ["tbf", "rate", "100mbit"] and "netem" not in add
    assert netlab.tbf_burst_bytes(10) == 32 * 1024
    assert netlab.tbf_burst_bytes(1000) == 250_000


def test_topology_commands_stay_inside_the_created_namespaces():
    hub, names = netlab.namespace_names(1, 2)
    cmds = netlab.topology_commands(hub, names, ["10.77.0.1", "10.77.0.2"], 24)
    ours = {hub, *names}
    for cmd in cmds:
        assert cmd[:2] == ["ip", "-n"] and cmd[2] in ours, cmd
        if "netns" in cmd:  # the veth's peer is created straight into a worker namespace
            assert cmd[cmd.index("netns") + 1] in names
    assert ["ip", "-n", names[1], "addr", "add", "10.77.0.2/24", "dev", "eth0"] in cmds
    assert not any("route" in cmd for cmd in cmds)  # no default route: nothing leaves


# --------------------------------------------------------------------------- rights


def test_rights_check_refuses_without_root():
    with pytest.raises(netlab.RightsError, match="needs root.*nothing was created"):
        netlab.check_rights(euid=1000, env={})
    with pytest.raises(netlab.RightsError, match="needs root"):
        netlab.check_rights(euid=0, env={netlab.UNPRIVILEGED_ENV: "1"})


def test_rights_check_needs_iproute2(monkeypatch):
    monkeypatch.setattr(netlab.shutil, "which", lambda tool: None if tool == "tc" else "/x")
    with pytest.raises(netlab.RightsError, match=r"iproute2 \(tc not found\)"):
        netlab.check_rights(euid=0, env={})
    monkeypatch.setattr(netlab.shutil, "which", lambda tool: "/x")
    netlab.check_rights(euid=0, env={})  # root with both tools: allowed


@pytest.mark.slow  # starts a process
def test_command_line_refuses_without_rights_and_creates_nothing():
    env = {**package_env(), netlab.UNPRIVILEGED_ENV: "1"}
    done = subprocess.run([*module_command("netem"), "--workers", "2",
                           "--bandwidth-mbit", "10"], env=env, capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 2
    assert "needs root" in done.stderr and "--dry-run" in done.stderr
    assert "ip netns" not in done.stdout


def test_first_namespace_failing_reads_as_missing_rights():
    fake = FakeRunner(fail_on="netns add")
    lab = netlab.Lab(2, runner=fake, pid=7)
    with pytest.raises(netlab.RightsError, match="cannot create network namespaces"):
        lab.create()
    assert lab.created == [] and lab.destroy() == [] and fake.deleted() == []


# --------------------------------------------------------------------------- cleanup


def test_lab_creates_then_deletes_exactly_its_namespaces():
    fake = FakeRunner()
    lab = netlab.Lab(3, runner=fake, pid=11)
    lab.create()
    assert fake.added() == ["gzn11-hub", "gzn11-w0", "gzn11-w1", "gzn11-w2"]
    assert lab.destroy() == []
    assert fake.deleted() == ["gzn11-w2", "gzn11-w1", "gzn11-w0", "gzn11-hub"]
    assert lab.created == []


def test_failure_midway_deletes_what_was_created():
    fake = FakeRunner(fail_on="link add h1")
    lab = netlab.Lab(3, runner=fake, pid=12)
    with pytest.raises(netlab.LabError, match="boom"):
        lab.create()
    lab.destroy()
    assert sorted(fake.deleted()) == sorted(fake.added())
    assert len(fake.deleted()) == 4


def test_interrupt_during_namespace_creation_still_deletes_it():
    fake = FakeRunner(fail_on="netns add gzn13-w1", exc=netlab.Interrupted("SIGINT"))
    lab = netlab.Lab(3, runner=fake, pid=13)
    with pytest.raises(netlab.Interrupted):
        lab.create()
    lab.destroy()
    # The namespace whose creation was cut short is deleted too (the deletion fails
    # harmlessly if it never came to exist); w2 was never attempted.
    assert fake.deleted() == ["gzn13-w1", "gzn13-w0", "gzn13-hub"]


def test_taken_names_are_refused_before_anything_is_created():
    fake = FakeRunner(existing=["gzn14-w1"])
    lab = netlab.Lab(2, runner=fake, pid=14)
    with pytest.raises(netlab.LabError, match="exist already"):
        lab.create()
    assert fake.added() == [] and lab.destroy() == [] and fake.deleted() == []


def test_failed_deletion_is_reported_and_the_rest_still_deleted():
    fake = FakeRunner()
    lab = netlab.Lab(2, runner=fake, pid=15)
    lab.create()
    fake.fail_on = "netns del gzn15-w1"
    errors = lab.destroy()
    assert len(errors) == 1 and "gzn15-w1" in errors[0]
    assert fake.deleted() == ["gzn15-w1", "gzn15-w0", "gzn15-hub"]


def test_shaping_caps_both_directions_of_every_link_with_or_without_a_round_trip():
    for rtt in (0.0, 100.0):
        fake = FakeRunner()
        netlab.Lab(2, runner=fake, pid=16, rtt_ms=rtt).shape(100)
        shaped = {(c[2], c[6]) for c in fake.calls if c[4] == "add"}
        assert shaped == {("gzn16-w0", "eth0"), ("gzn16-w1", "eth0"),
                          ("gzn16-hub", "h0"), ("gzn16-hub", "h1")}
        assert sum("tbf" in c for c in fake.calls) == 4
        assert not any("netem" in c for c in fake.calls)


@pytest.mark.parametrize("exc, status", [(netlab.Interrupted("SIGTERM"), 130),
                                         (netlab.LabError("worker died"), 1)])
def test_main_cleans_up_on_interrupt_and_error(monkeypatch, tmp_path, exc, status):
    fake = FakeRunner()
    monkeypatch.setattr(netlab, "run_command", fake)
    monkeypatch.setattr(netlab, "check_rights", lambda: None)

    def boom(*args, **kwargs):
        raise exc

    monkeypatch.setattr(netem, "benchmark", boom)
    code = netem.main(["--workers", "2", "--bandwidth-mbit", "10",
                       "--out", str(tmp_path / "x.json")])
    assert code == status
    assert len(fake.added()) == 3 and sorted(fake.deleted()) == sorted(fake.added())
    assert not (tmp_path / "x.json").exists()


def test_step_benchmark_cleans_up_on_interrupt(monkeypatch, tmp_path):
    fake = FakeRunner()
    monkeypatch.setattr(netlab, "run_command", fake)
    monkeypatch.setattr(netlab, "check_rights", lambda: None)

    def boom(*args, **kwargs):
        raise netlab.Interrupted("SIGINT")

    monkeypatch.setattr(steps, "benchmark", boom)
    assert steps.main(["--out", str(tmp_path / "x.json")]) == 130
    assert len(fake.added()) == 3 and sorted(fake.deleted()) == sorted(fake.added())
    assert not (tmp_path / "x.json").exists()


def test_a_signal_becomes_an_exception_and_handlers_are_restored():
    before = signal.getsignal(signal.SIGTERM)
    with pytest.raises(netlab.Interrupted, match="SIGTERM"), netlab.signals_raise():
        os.kill(os.getpid(), signal.SIGTERM)
        signal.sigtimedwait([], 5)  # give the handler a chance to run
    assert signal.getsignal(signal.SIGTERM) is before


def _sleeper(code: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", code], start_new_session=True)


def test_wait_all_kills_the_rest_on_failure_and_on_timeout():
    slow, bad = _sleeper("import time; time.sleep(60)"), _sleeper("raise SystemExit(3)")
    assert netlab.wait_all([slow, bad], timeout=60) == "worker 1 exited with code 3"
    assert slow.poll() is not None  # killed, not left running
    slow = _sleeper("import time; time.sleep(60)")
    assert netlab.wait_all([slow], timeout=0.2).startswith("timed out")
    assert slow.poll() is not None
    ok = _sleeper("pass")
    assert netlab.wait_all([ok], timeout=60) is None
