"""The time-to-accuracy benchmark over an emulated network (benchmarks/netem.py) and its worker
(netem_worker.py) without rights: argument checks, the dry run, the options every launcher
passes on to its worker, the summary rows and table, and the goodput probe.

Nothing here creates a namespace or runs ``ip``/``tc``; the lab itself is tested in
test_netem_lab.py, the step-time benchmark in test_netem_steps.py.
"""

from __future__ import annotations

import socket
import threading

import pytest

from benchmarks import _netlab_launch as launch
from benchmarks import netem
from benchmarks import netem_steps as steps
from benchmarks import netem_steps_worker as steps_worker
from benchmarks import netem_worker as worker

# --------------------------------------------------------------------------- arguments


@pytest.mark.parametrize("argv, message", [
    (["--workers", "1"], "`--workers` must be in [2, 64]"),
    (["--bandwidth-mbit", "0"], "`--bandwidth-mbit` values must be in (0, 100000]"),
    (["--rtt-ms", "-1"], "`--rtt-ms` must be in [0, 2000], got -1"),
    (["--rtt-ms", "2500"], "`--rtt-ms` must be in [0, 2000], got 2500"),
    (["--rtt-ms", "100", "--workers", "2", "--subnet", "10.1.0.0/30"],
     "`subnet` must hold 3 hosts with `--rtt-ms` > 0"),
    (["--target", "1.5"], "`--target` must be in (0, 1]"),
    (["--subnet", "192.0.2.0/24"], "private IPv4"),
    (["--methods", "none", "none"], "must not repeat"),
    (["--methods", "none", "accordion:eta=0"], "accordion:eta=0.3,interval=11"),
    (["--window", "0"], "`--window` must be >= 1"),
])
def test_bad_arguments_are_refused(capsys, argv, message):
    with pytest.raises(SystemExit) as info:
        netem.parse_args(argv)
    assert info.value.code == 2
    assert message in capsys.readouterr().err


def test_dry_run_pairs_every_namespace_with_its_deletion():
    args = netem.parse_args(["--workers", "2", "--bandwidth-mbit", "100", "20",
                             "--methods", "none", "accordion"])
    cmds = netem.dry_run(args)
    added = [c[3] for c in cmds if c[:3] == ["ip", "netns", "add"]]
    deleted = [c[3] for c in cmds if c[:3] == ["ip", "netns", "del"]]
    assert len(added) == 3 and deleted == added[::-1]
    assert sum("tbf" in c for c in cmds) == 2 * 4  # two rates x (2 worker + 2 hub ports)
    runs = [c for c in cmds if c[:3] == ["ip", "netns", "exec"]]
    assert len(runs) == 4 and runs[1][runs[1].index("--spec") + 1] == "accordion"


def test_worker_accepts_what_the_launcher_passes():
    args = netem.parse_args(["--stop-at-target", "--interval", "33", "--eta", "0.4"])
    argv = netem.worker_argv(args, "accordion", "/tmp/r.json")
    assert argv[:len(netem.WORKER)] == netem.WORKER
    parsed = worker.parse_args(argv[len(netem.WORKER):])
    assert (parsed.spec, parsed.interval, parsed.eta, parsed.stop_at_target) == (
        "accordion", 33, 0.4, True)
    env = launch.worker_env("10.77.0.1", 29501, 2, 4)
    assert (env["MASTER_ADDR"], env["RANK"], env["WORLD_SIZE"], env["GLOO_SOCKET_IFNAME"]) == (
        "10.77.0.1", "2", "4", "eth0")


@pytest.mark.parametrize("launcher, work, tables", [
    (netem, worker, (worker.TRAINING_OPTIONS, worker.BUCKET_OPTIONS, worker.ACCORDION_OPTIONS)),
    (steps, steps_worker, (steps_worker.STEP_OPTIONS,)),
])
def test_every_passed_on_option_reaches_the_worker_unchanged(launcher, work, tables):
    options = [o for table in tables for o in table]
    values = {flag: {int: "7", float: "2.5", str: "topk:ratio=0.2"}[kind]
              for flag, kind, _, _ in options}
    values.update({"--target": "0.5"} if "--target" in values else {})
    argv = [word for item in values.items() for word in item]
    if launcher is netem:
        args = netem.parse_args([*argv, "--methods", "accordion"])
        sent = netem.worker_argv(args, "accordion", "r.json")[len(netem.WORKER):]
    else:
        args = steps.parse_args(argv)
        sent = steps.worker_argv(args, args.configs, args.rounds, "r.json")[len(steps.WORKER):]
    parsed = work.parse_args(sent)
    for flag, _, default, _ in options:
        name = flag[2:].replace("-", "_")
        assert getattr(parsed, name) == getattr(args, name) != default, flag


# --------------------------------------------------------------------------- summary


def _record(method: str, step: float, reached: int | None, wire: int) -> dict:
    n = 10
    accuracy = [0.5] * n if reached is None else [0.5] * (reached - 3) + [0.99] * (n - reached + 3)
    return {"method": method, "step_seconds": [step] * n, "steps_to_target": 1, "target": 0.98,
            "accuracy": accuracy, "compute_seconds": [0.05, 0.07],
            "allreduce_latency_seconds": 0.001,
            "hook_stats": [{"wire_bytes": wire * n, "dense_wire_bytes": 1000 * n,
                            "kernel_tx_bytes": wire * n + 50 * n}] * 2}


def test_summary_rows_speedups_and_table():
    rows = [netem.summarize(_record("none", 1.0, 8, 1000), 50, window=3),
            netem.summarize(_record("powersgd-r4", 0.25, 8, 20), 50, window=3),
            netem.summarize(_record("powersgd-r1", 0.2, None, 10), 50, window=3),
            netem.summarize({"method": "topk", "error": "timed out after 5 s"}, 50)]
    netem.add_speedups(rows)
    assert rows[0]["seconds_to_target"] == 8.0 and rows[0]["speedup_vs_none"] == 1.0
    assert rows[1]["speedup_vs_none"] == 4.0 and rows[1]["compression_rate"] == 50
    assert rows[1]["kernel_tx_bytes_per_step"] == 70
    assert rows[1]["compute_seconds"] == pytest.approx(0.06)
    assert rows[2]["seconds_to_target"] is None and rows[2]["speedup_vs_none"] is None
    table = netem.markdown_table(rows).splitlines()
    assert len(table) == 6 and all(line.count("|") == 10 for line in table)
    cells = [[c.strip() for c in line.strip().strip("|").split("|")] for line in table]
    assert ["50 Mbit/s", "powersgd-r4", "0.250", "8", "2.0", "4.00x", "0 kB", "50x",
            "0.990"] in cells
    assert "not reached (best 0.500)" in table[4] and "failed: timed out" in table[5]


def test_target_needs_a_window_of_evaluations():
    acc = [0.5, 0.99, 0.5, 0.98, 0.98, 0.99, 0.97]
    assert netem.steps_to_target(acc, 0.98, 1) == 2
    assert netem.steps_to_target(acc, 0.98, 3) == 6
    assert netem.steps_to_target(acc, 0.98, 8) is None
    assert netem.steps_to_target([], 0.5, 1) is None


def test_accordion_variants_override_eta_and_interval_only():
    assert netem.parse_method("topk") == ("topk", {})
    assert netem.parse_method("accordion:eta=0.3,interval=11") == (
        "accordion", {"eta": 0.3, "interval": 11})
    for bad in ("accordion:steady=x", "topk:eta=0.3", "accordion:eta=-1", "accordion:interval=x",
                "accordion:eta=0.3,eta=0.4", "sign"):
        with pytest.raises(ValueError, match="--methods"):
            netem.parse_method(bad)
    args = netem.parse_args(["--methods", "accordion:interval=44"])
    argv = netem.worker_argv(args, "accordion:interval=44", "r.json")
    parsed = worker.parse_args(argv[len(netem.WORKER):])
    assert (parsed.spec, parsed.interval, parsed.eta, parsed.sync) == ("accordion", 44, 0.5, False)


def test_baselines_the_synchronous_hook_and_bucket_size_reach_the_worker():
    assert netem.parse_method("powersgd-r4:sync") == ("powersgd-r4", {"sync": 1})
    assert netem.parse_method("accordion:sync,eta=0.3") == ("accordion", {"sync": 1, "eta": 0.3})
    for bad in ("native:sync", "torch-fp16:sync", "none:sync,sync"):
        with pytest.raises(ValueError, match="--methods"):
            netem.parse_method(bad)
    args = netem.parse_args(["--bucket-cap-mb", "2"])
    parsed = worker.parse_args(netem.worker_argv(args, "fp16:sync", "r.json")[len(netem.WORKER):])
    assert (parsed.spec, parsed.sync, parsed.bucket_cap_mb) == ("fp16", True, 2.0)
    parsed = worker.parse_args(netem.worker_argv(args, "torch-fp16", "r.json")[len(netem.WORKER):])
    assert (parsed.spec, parsed.sync) == ("torch-fp16", False)
    fp16 = worker.BaselineStats(1000, 2, half=True)
    fp16.steps = 3
    assert fp16.stats() == {"steps": 3, "wire_bytes": 3 * 2000, "dense_wire_bytes": 3 * 4000}


def test_goodput_probe_counts_every_byte():
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    result: dict = {}
    receiver = threading.Thread(
        target=lambda: result.update(worker.goodput_recv(f"127.0.0.1:{port}", 3 << 20, 30)))
    receiver.start()
    worker.goodput_send(f"127.0.0.1:{port}", 3 << 20, 30)
    receiver.join(30)
    assert result["bytes"] == 3 << 20 and result["mbit_per_s"] > 0
