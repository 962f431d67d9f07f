"""The seconds-per-step benchmark over an emulated network (benchmarks/netem_steps.py) and its
worker (netem_steps_worker.py) without rights: the link rate chosen from the compute probe, the
per-round ratios and the table, the verdicts of the step-time targets, the worker's hook modes
and arguments, the dry run, a real two-process gloo run of the worker on 127.0.0.1, and the
report.

Nothing here creates a namespace or runs ``ip``/``tc``.
"""

from __future__ import annotations

import inspect
import json
import socket
import subprocess

import pytest
import torch

from benchmarks import _netlab as netlab
from benchmarks import netem_steps as steps
from benchmarks import netem_steps_worker as steps_worker
from benchmarks._common import module_command, package_env
from gradzip.comm.header import rider_bytes

# --------------------------------------------------------------------------- step times


def test_bandwidth_is_chosen_so_dense_communication_matches_compute():
    # 2 workers: a ring all-reduce sends the whole gradient once; 4 workers: 1.5 times it.
    assert steps.ring_wire_bytes(1000, 2) == 1000 and steps.ring_wire_bytes(1000, 4) == 1500
    grad = 15_663_656  # the default model's fp32 gradient
    rate = steps.choose_bandwidth(grad, 2, 0.1678)
    assert rate == 780  # 15.66 MB x 1514/1448 frame overhead x 8 bits / 0.1678 s, 2 figures
    seconds = steps.ring_wire_bytes(grad, 2) * steps.WIRE_OVERHEAD * 8 / (rate * 1e6)
    assert seconds == pytest.approx(0.1678, rel=0.01)  # comm at line rate ~ compute
    assert steps.choose_bandwidth(grad, 2, 0.1678, comm_compute=2.0) == 390
    assert steps.choose_bandwidth(grad, 4, 0.1678) == 1200
    assert steps.round_significant(1234.5) == 1200 and steps.round_significant(0.04567) == 0.046
    for bad in ((0, 2, 0.1), (grad, 1, 0.1), (grad, 2, 0.0), (grad, 2, -1.0)):
        with pytest.raises(ValueError, match="must be"):
            steps.choose_bandwidth(*bad)
    with pytest.raises(ValueError, match=r"\(0, 100000\] Mbit/s"):
        steps.choose_bandwidth(grad, 2, 1e-6)  # 130 Tbit/s: no link to emulate


def _steps_record(times: dict[str, list[list[float]]], sync: dict | None = None) -> dict:
    """A worker record: ``times[config][rank]`` = seconds per step in each round."""
    configs = list(times)
    ranks = []
    for r in range(len(next(iter(times.values())))):
        ranks.append({
            "seconds": {c: times[c][r] for c in configs},
            "cpu_seconds": {c: [t / 2 for t in times[c][r]] for c in configs},
            "allreduce_seconds": [0.1, 0.1],
            "kernel_tx_bytes_per_step": {c: 0.0 if c == "floor" else 2e6 for c in configs},
            "hook_bytes_per_step": {c: {"wire_bytes": 1e6} for c in configs
                                    if c.startswith("gradzip")},
            "buckets": {c: 4 for c in configs if c != "floor"},
        })
    return {"configs": configs, "world": len(ranks), "params": 100, "grad_bytes": 400,
            "sync_keyword": sync, "steps": 2, "rounds": len(ranks[0]["seconds"][configs[0]]),
            "ranks": ranks}


def test_ratios_are_medians_of_per_round_ratios_of_the_slowest_rank():
    # Round 2 is slow for everyone (another job): the per-round ratio stays 1.5.
    rec = _steps_record({"ddp": [[0.2, 0.4, 0.2], [0.1, 0.5, 0.2]],
                         "gradzip-none": [[0.3, 0.75, 0.3], [0.3, 0.6, 0.2]],
                         "floor": [[0.1, 0.2, 0.1], [0.1, 0.2, 0.1]]})
    times = steps.slowest_rank(rec["ranks"])
    assert times["ddp"] == [0.2, 0.5, 0.2] and times["gradzip-none"] == [0.3, 0.75, 0.3]
    assert steps.rank_mean(rec["ranks"], "cpu_seconds")["ddp"] == pytest.approx([0.075, 0.225, 0.1])
    assert steps.paired_ratio(times["gradzip-none"], times["ddp"]) == pytest.approx(1.5)
    with pytest.raises(ValueError, match="equally long"):
        steps.paired_ratio([1.0], [1.0, 2.0])
    rows, _ = steps.summarise(rec)
    by = {r["config"]: r for r in rows}
    assert by["gradzip-none"]["ms_per_step"] == pytest.approx(300)
    assert by["gradzip-none"]["vs_ddp"] == pytest.approx(1.5)
    assert by["ddp"]["vs_floor"] == pytest.approx(2.0) and by["floor"]["vs_floor"] == 1
    assert by["floor"]["buckets"] is None and by["ddp"]["buckets"] == 4
    table = steps.markdown_table(rows).splitlines()
    assert len(table) == 5 and all(line.count("|") == 8 for line in table)
    cells = [[c.strip() for c in line.strip().strip("|").split("|")] for line in table]
    assert ["gradzip-none", "4", "300.0", "1.500", "3.000", "150.0", "2,000"] in cells
    assert ["floor", "-", "100.0", "0.500", "1.000", "50.0", "0"] in cells


def test_comm_compute_ratio_uses_the_synchronous_dense_step():
    times = {"floor": [0.1, 0.2, 0.1], "gradzip-none": [0.2, 0.5, 0.25],
             "gradzip-none-sync": [0.3, 0.4, 0.2]}
    assert steps.dense_serial_config(list(times), {"synchronous": True}) == "gradzip-none-sync"
    # Before the hook has modes, gradzip none is itself synchronous; after, without its
    # synchronous variant, no configuration serialises compute and communication.
    assert steps.dense_serial_config(["floor", "gradzip-none"], None) == "gradzip-none"
    assert steps.dense_serial_config(["floor", "gradzip-none"], {"synchronous": True}) is None
    got = steps.comm_compute_ratio(times, "gradzip-none-sync")
    assert got["comm_seconds"] == pytest.approx(0.2) and got["ratio"] == pytest.approx(1.0)
    assert steps.comm_compute_ratio(times, None)["ratio"] is None


def test_verdicts_cover_every_target_and_hook_mode():
    t = {"floor": [1.0, 1.0], "ddp": [2.0, 2.0], "torch-fp16": [1.5, 1.5],
         "gradzip-none": [2.04, 2.06], "gradzip-fp16": [1.8, 1.8],
         "gradzip-powersgd-r4": [1.2, 1.2], "gradzip-none-sync": [3.0, 3.0]}
    got = steps.verdicts(t)
    assert [(v["config"], v["reference"]) for v in got] == [
        ("gradzip-none", "ddp"), ("gradzip-none-sync", "ddp"), ("gradzip-fp16", "torch-fp16"),
        ("gradzip-powersgd-r4", "ddp"), ("gradzip-powersgd-r4", "floor")]
    none, none_sync, fp16, speed, floor = got
    assert none["ratio"] == pytest.approx(1.025) and none["met"] is True
    assert none_sync["ratio"] == pytest.approx(1.5) and none_sync["met"] is False
    assert fp16["ratio"] == pytest.approx(1.2) and fp16["met"] is False
    assert speed["ratio"] == pytest.approx(2 / 1.2) and speed["met"] is True
    assert floor["ratio"] == pytest.approx(1.2) and floor["met"] is True
    assert len(steps.verdicts(t)) == 5  # only gradzip none has a synchronous variant here
    lines = [steps.verdict_line(v) for v in steps.verdicts(t)]
    assert lines[0] == ("met: gradzip none within 5% of native DDP "
                        "(gradzip-none / ddp = 1.025x, bound 1.05)")
    assert "ddp / gradzip-powersgd-r4 = 1.667x" in lines[3]
    assert lines[2].startswith("MISSED: gradzip fp16")
    partial = steps.verdicts({"floor": [1.0], "gradzip-powersgd-r4": [1.1]})
    assert [v["met"] for v in partial] == [None, None, None, True]
    assert steps.verdict_line(partial[0]).startswith("not measured")


def _register_sync(model, compressor, *, optimizer=None, synchronous=False): ...
def _register_async(model, compressor, *, optimizer=None, asynchronous=True): ...
def _register_mode(model, compressor, *, optimizer=None, mode="async"): ...
def _register_plain(model, compressor, *, optimizer=None, nonfinite="skip"): ...


def test_sync_mode_is_found_from_the_register_signature():
    assert steps_worker.sync_keyword(_register_sync) == {"synchronous": True}
    assert steps_worker.sync_keyword(_register_async) == {"asynchronous": False}
    assert steps_worker.sync_keyword(_register_mode) == {"mode": "sync"}
    assert steps_worker.sync_keyword(_register_plain) is None
    import gradzip.ddp

    found = steps_worker.sync_keyword(gradzip.ddp.register)  # the real one, before or after
    assert found is None or set(found) <= set(inspect.signature(gradzip.ddp.register).parameters)
    names = ["floor", "ddp", "gradzip-none", "gradzip-fp16"]
    assert steps_worker.expand_configs(names, None, ["default", "sync"]) == names
    assert steps_worker.expand_configs(names, {"synchronous": True}, ["default", "sync"]) == [
        "floor", "ddp", "gradzip-none", "gradzip-none-sync", "gradzip-fp16", "gradzip-fp16-sync"]
    assert steps_worker.expand_configs(names, {"synchronous": True}, ["sync"]) == [
        "floor", "ddp", "gradzip-none-sync", "gradzip-fp16-sync"]
    assert steps_worker.rotated(["a", "b", "c"], 4) == ["b", "c", "a"]


def test_step_worker_accepts_what_the_launcher_passes_and_dry_run_cleans_up():
    args = steps.parse_args(["--rounds", "7", "--bucket-cap-mb", "0.5", "--configs", "floor", "ddp"])
    parsed = steps_worker.parse_args(steps.worker_argv(args, args.configs, 7, "r.json")[len(steps.WORKER):])
    assert (parsed.rounds, parsed.bucket_cap_mb, parsed.configs, parsed.batch_size) == (
        7, 0.5, ["floor", "ddp"], 32)
    cmds = steps.dry_run(args)
    added = [c[3] for c in cmds if c[:3] == ["ip", "netns", "add"]]
    deleted = [c[3] for c in cmds if c[:3] == ["ip", "netns", "del"]]
    assert len(added) == 3 and deleted == added[::-1]
    runs = [c for c in cmds if c[:3] == ["ip", "netns", "exec"]]
    assert len(runs) == 2  # the compute probe (auto rate), then the timed run
    assert runs[0][runs[0].index("--configs") + 1:runs[0].index("--gradzip-modes")] == ["floor"]
    fixed = steps.dry_run(steps.parse_args(["--bandwidth-mbit", "300"]))
    assert sum(c[:3] == ["ip", "netns", "exec"] for c in fixed) == 1
    assert sum("300mbit" in c for c in fixed) == 4  # both directions of both links


@pytest.mark.parametrize("argv, message", [
    (["--bandwidth-mbit", "fast"], "must be 'auto' or a number"),
    (["--bandwidth-mbit", "0"], "must be in (0, 100000]"),
    (["--warmup", "2"], "`--warmup` must be >= 3"),
    (["--comm-compute", "0"], "`--comm-compute` must be > 0"),
    (["--configs", "ddp", "ddp"], "must not repeat"),
    (["--configs", "horovod"], "invalid choice"),
    (["--rounds", "0"], "`--rounds` must be >= 1"),
])
def test_step_benchmark_refuses_bad_arguments(capsys, argv, message):
    with pytest.raises(SystemExit) as info:
        steps.parse_args(argv)
    assert info.value.code == 2 and message in capsys.readouterr().err


@pytest.mark.slow
def test_step_worker_times_every_configuration_over_real_gloo(tmp_path):
    """Two real gloo processes on 127.0.0.1 (no namespaces), a narrow model, one round."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    result = tmp_path / "r.json"
    argv = [*module_command("netem_steps_worker"), "--result", str(result),
            "--rounds", "2", "--steps", "1", "--width", "4", "--batch-size", "2",
            "--bucket-cap-mb", "0.002", "--comm-probes", "1", "--collective-timeout", "60"]
    procs = [subprocess.Popen(argv, env={**package_env(), "MASTER_ADDR": "127.0.0.1",
                                         "MASTER_PORT": str(port), "RANK": str(r),
                                         "WORLD_SIZE": "2", "GLOO_SOCKET_IFNAME": "lo",
                                         "OMP_NUM_THREADS": "1"},
                              start_new_session=True) for r in range(2)]
    assert netlab.wait_all(procs, timeout=120) is None
    rec = json.loads(result.read_text())
    assert rec["configs"][:4] == ["floor", "ddp", "torch-fp16", "torch-powersgd-r4"]
    assert rec["grad_bytes"] == 4 * rec["params"] and len(rec["ranks"]) == 2
    buckets = rec["ranks"][0]["buckets"]
    assert buckets["ddp"] >= 4 and buckets["gradzip-powersgd-r4"] >= 4
    assert buckets["torch-powersgd-r4"] == 1  # its own cap: several buckets fail on gloo
    for r in rec["ranks"]:
        assert all(len(v) == 2 and min(v) > 0 for v in r["seconds"].values())
    hook = rec["ranks"][0]["hook_bytes_per_step"]
    # 2 workers: ring = 1x; plus each bucket's call header, riding in its all-reduce.
    header = rider_bytes(torch.float32, 2, summed=True)
    assert hook["gradzip-none"]["wire_bytes"] == rec["grad_bytes"] + buckets["gradzip-none"] * header
    assert 0 < hook["gradzip-powersgd-r4"]["wire_bytes"] < rec["grad_bytes"]
    rows, _ = steps.summarise(rec)
    assert {r["config"] for r in rows} == set(rec["configs"])


def test_report_states_link_ratio_load_and_verdicts():
    rec = _steps_record({"floor": [[0.1, 0.1]], "ddp": [[0.2, 0.2]],
                         "torch-powersgd-r4": [[0.15, 0.15]], "gradzip-none": [[0.21, 0.2]]})
    rec["ranks"][0]["buckets"]["torch-powersgd-r4"] = 1
    rows, times = steps.summarise(rec)
    cc = {**steps.comm_compute_ratio(times, "gradzip-none"), "allreduce_alone_ratio": 0.9,
          "line_rate_ratio": 0.95}
    meta = {"bandwidth_mbit": 780.0, "goodput": {"mbit_per_s": 747.7}, "world": 2,
            "params": 3_915_914, "grad_bytes": 15_663_656, "comm_compute": cc,
            "loadavg_start": (0.5, 0, 0), "loadavg_end": (1.25, 0, 0), "sync_keyword": None,
            "rounds": 2, "steps": 3}
    text = steps.report({"meta": meta, "rows": rows, "verdicts": steps.verdicts(times)})
    lines = text.splitlines()
    assert lines[0].startswith("link: 780 Mbit/s each way, measured goodput 748 Mbit/s; "
                               "2 workers; model 3.92 M parameters (15.7 MB")
    assert lines[1].startswith("comm : compute of a dense step: 1.05 : 1 measured "
                               "(gradzip-none minus the floor")
    assert "0.90 : 1 for a dense all-reduce alone; 0.95 : 1 at line rate" in lines[1]
    assert "load average: 0.50 at the start, 1.25 at the end" in lines[2]
    assert "torch-powersgd-r4 ran on 1 bucket(s) (others: 4)" in text
    cells = [[c.strip() for c in line.strip("|").split("|")] for line in lines if line[:1] == "|"]
    assert ["gradzip-none", "4", "205.0", "1.025", "2.050"] in [row[:5] for row in cells]
    assert "met: gradzip none within 5% of native DDP (gradzip-none / ddp = 1.025x" in text
    assert "not measured: gradzip fp16" in text
