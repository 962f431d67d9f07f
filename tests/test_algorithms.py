"""Algorithm-specific properties: PowerSGD on low-rank matrices, QSGD's unbiasedness, byte
formulas, spec strings."""

from __future__ import annotations

import json

import pytest
import torch

import gradzip
from gradzip.comm.base import allgather_wire_bytes, allreduce_wire_bytes
from gradzip.comm.header import HEADER_BYTES
from gradzip.compressors.base import Job, StepContext

# Every call starts with a fixed-size header all-reduced among the workers (rank agreement and
# the non-finite flag), counted like any other traffic.
FLAG = HEADER_BYTES


def _ctx(workers: int, step: int = 0) -> StepContext:
    return StepContext(step=step, ranks=tuple(range(workers)), world_size=workers)


@pytest.mark.parametrize("r", [1, 2, 4])
def test_powersgd_recovers_an_exactly_rank_r_matrix(r: int) -> None:
    gen = torch.Generator().manual_seed(r)
    m = torch.randn(40, r, generator=gen) @ torch.randn(r, 30, generator=gen)
    comp = gradzip.PowerSGD(matrix_rank=r, min_compression_rate=1.0)
    state = comp.init_state({"m": m.shape})
    job = Job("m", m.unsqueeze(0).clone())
    comp.reduce([job], state, gradzip.SimulatedGroup(1), _ctx(1))
    # The best rank-r approximation of a rank-r matrix is the matrix itself.
    assert torch.allclose(job.averaged, m, atol=1e-4, rtol=1e-4)


def test_powersgd_approaches_best_rank_r_with_warm_start() -> None:
    gen = torch.Generator().manual_seed(0)
    u, _ = torch.linalg.qr(torch.randn(50, 50, generator=gen))
    v, _ = torch.linalg.qr(torch.randn(40, 40, generator=gen))
    s = torch.tensor([10.0, 5.0] + [0.5] * 38)
    m = u[:, :40] @ torch.diag(s) @ v.T
    best = u[:, :2] @ torch.diag(s[:2]) @ v[:, :2].T
    comp = gradzip.PowerSGD(matrix_rank=2, min_compression_rate=1.0)
    engine = gradzip.Engine({"m": m.shape}, comp, collective=gradzip.SimulatedGroup(1),
                            error_feedback=False)
    for _ in range(10):
        out = engine.reduce({"m": m.unsqueeze(0)})["m"]
    assert float((out - best).norm() / best.norm()) < 1e-3


def test_powersgd_sends_small_and_one_dim_tensors_dense() -> None:
    comp = gradzip.PowerSGD(matrix_rank=4)
    assert comp.matrix_rank_for(torch.Size([10])) == 0
    assert comp.matrix_rank_for(torch.Size([4, 4])) == 0  # 16 < 2 * 4 * 8
    assert comp.matrix_rank_for(torch.Size([64, 3, 3, 3])) == 4
    state = comp.init_state({"w": torch.Size([64, 3, 3, 3]), "b": torch.Size([64])})
    assert set(state["q"]) == {"w"} and state["q"]["w"].shape == (27, 4)


def test_powersgd_bytes_are_its_factors() -> None:
    comp = gradzip.PowerSGD(matrix_rank=2)
    engine = gradzip.Engine({"w": torch.Size([32, 16]), "b": torch.Size([32])}, comp,
                            collective=gradzip.SimulatedGroup(4))
    engine.reduce({"w": torch.randn(4, 32, 16), "b": torch.randn(4, 32)})
    p_bytes = (32 * 2 + 32) * 4  # P factor with the dense bias riding along
    q_bytes = 16 * 2 * 4
    assert engine.stats["payload_bytes"] == [FLAG + p_bytes + q_bytes] * 4
    want = sum(allreduce_wire_bytes(b, 4) for b in (FLAG, p_bytes, q_bytes))
    assert engine.stats["wire_bytes"] == [want] * 4


def test_topk_bytes_count_values_and_int32_indices() -> None:
    engine = gradzip.Engine({"w": torch.Size([1000])}, "topk:ratio=0.01",
                            collective=gradzip.SimulatedGroup(4))
    engine.reduce({"w": torch.randn(4, 1000)})
    assert engine.stats["payload_bytes"] == [FLAG + 10 * (4 + 4)] * 4
    assert engine.stats["wire_bytes"] == [allreduce_wire_bytes(FLAG, 4) + allgather_wire_bytes(80, 4)] * 4


def test_threshold_counts_sizes_and_pads_to_the_densest_worker() -> None:
    grads = torch.zeros(3, 100)
    grads[0, :5] = 1.0  # worker 0 sends 5 entries, worker 1 sends 2, worker 2 none
    grads[1, :2] = -1.0
    engine = gradzip.Engine({"w": torch.Size([100])}, "threshold:lam=0.5",
                            collective=gradzip.SimulatedGroup(3))
    out = engine.reduce({"w": grads})["w"]
    assert torch.allclose(out, grads.mean(0))
    sizes = 4  # one int32 count per tensor
    assert engine.stats["payload_bytes"] == [FLAG + sizes + 5 * 8, FLAG + sizes + 2 * 8, FLAG + sizes]
    wire = allreduce_wire_bytes(FLAG, 3) + allgather_wire_bytes(4, 3) + allgather_wire_bytes(5 * 8, 3)
    assert engine.stats["wire_bytes"] == [wire] * 3


def test_threshold_goes_dense_when_sparse_costs_more() -> None:
    engine = gradzip.Engine({"w": torch.Size([100])}, "threshold:lam=0.01",
                            collective=gradzip.SimulatedGroup(4))
    grads = torch.ones(4, 100)
    engine.reduce({"w": grads})
    want = allreduce_wire_bytes(FLAG, 4) + allgather_wire_bytes(4, 4) + allreduce_wire_bytes(400, 4)
    assert engine.stats["wire_bytes"] == [want] * 4


def test_threshold_sends_a_fixed_capacity_sized_from_shapes() -> None:
    grads = torch.zeros(3, 100)
    grads[0, :5] = 1.0  # worker 0 sends 5 entries, worker 1 sends 2, worker 2 none
    grads[1, :2] = -1.0
    engine = gradzip.Engine({"w": torch.Size([100])}, "threshold:lam=0.5,capacity=0.05",
                            collective=gradzip.SimulatedGroup(3))
    out = engine.reduce({"w": grads})["w"]
    assert torch.equal(out, grads.sum(0) / 3)
    # Every worker's message holds 5 slots (no sizes exchanged, nothing read on the host).
    assert engine.stats["payload_bytes"] == [FLAG + 5 * 8] * 3
    wire = allreduce_wire_bytes(FLAG, 3) + allgather_wire_bytes(5 * 8, 3)
    assert engine.stats["wire_bytes"] == [wire] * 3
    assert engine.residuals["w"].abs().sum() == 0
    assert engine.compressor.report(engine.compressor_state)["density_parts"] == (7, 300)


def test_threshold_over_capacity_sends_the_largest_and_keeps_the_rest() -> None:
    grads = torch.zeros(2, 100)
    grads[0, :8] = torch.arange(1.0, 9.0)  # 8 entries above lambda, 5 slots
    grads[1, 50] = 2.0
    engine = gradzip.Engine({"w": torch.Size([100])}, "threshold:lam=0.5,capacity=0.05",
                            collective=gradzip.SimulatedGroup(2))
    out = engine.reduce({"w": grads})["w"]
    sent = torch.zeros(100)
    sent[3:8] = torch.arange(4.0, 9.0)
    sent[50] = 2.0
    assert torch.equal(out, sent / 2)
    kept = torch.zeros(100)
    kept[:3] = torch.arange(1.0, 4.0)  # over capacity: left to error feedback
    assert torch.equal(engine.residuals["w"][0], kept)
    assert torch.equal(engine.residuals["w"][1], torch.zeros(100))
    assert engine.compressor.report(engine.compressor_state)["density_parts"] == (6, 200)


def test_threshold_goes_dense_when_its_capacity_costs_more() -> None:
    engine = gradzip.Engine({"w": torch.Size([100])}, "threshold:lam=0.01,capacity=0.3",
                            collective=gradzip.SimulatedGroup(4))
    grads = torch.ones(4, 100)
    engine.reduce({"w": grads})
    want = allreduce_wire_bytes(FLAG, 4) + allreduce_wire_bytes(400, 4)
    assert engine.stats["wire_bytes"] == [want] * 4


def test_qsgd_is_unbiased() -> None:
    """The mean of many independent quantisations approaches the input (fixed seeds)."""
    x = torch.randn(1, 500, generator=torch.Generator().manual_seed(1))
    comp = gradzip.QSGD(levels=2)
    total = torch.zeros(500)
    trials = 2000
    for step in range(trials):
        job = Job("x", x.clone())
        comp.reduce([job], {}, gradzip.SimulatedGroup(1), _ctx(1, step))
        total += job.averaged
    mean = total / trials
    # Each entry's quantisation noise has std <= norm / levels; the mean of n trials shrinks it
    # by sqrt(n). Bound the worst entry at about 5 standard errors.
    bound = 5 * float(x.norm()) / comp.levels / trials**0.5
    assert float((mean - x[0]).abs().max()) < bound
    # And a single quantisation is clearly not the identity (the test can fail).
    job = Job("x", x.clone())
    comp.reduce([job], {}, gradzip.SimulatedGroup(1), _ctx(1, 0))
    assert float((job.averaged - x[0]).abs().max()) > 0.1


def test_qsgd_codes_take_the_advertised_bits() -> None:
    assert gradzip.QSGD(levels=1).bits == 2
    assert gradzip.QSGD(levels=7).bits == 4
    assert gradzip.QSGD(levels=127).bits == 8
    engine = gradzip.Engine({"w": torch.Size([1000])}, "qsgd:levels=7",
                            collective=gradzip.SimulatedGroup(2))
    engine.reduce({"w": torch.randn(2, 1000)})
    assert engine.stats["payload_bytes"] == [FLAG + 4 + 500] * 2


def test_sign_sends_one_bit_per_entry() -> None:
    engine = gradzip.Engine({"w": torch.Size([1001])}, "sign", collective=gradzip.SimulatedGroup(2))
    engine.reduce({"w": torch.randn(2, 1001)})
    assert engine.stats["payload_bytes"] == [FLAG + 4 + 126] * 2


@pytest.mark.parametrize("spec", ["sign:exchange=allgather", "qsgd:levels=8,exchange=allgather",
                                  "qsgd:levels=3,bucket_size=100,exchange=allgather"])
def test_bit_streams_of_one_call_are_packed_together(spec: str) -> None:
    """Several tensors in one call, all-gathered: their codes form one packed stream (no
    padding byte per tensor), the payload is exactly ``message_bytes`` of their sizes, and every tensor decodes
    to the average of what the workers' messages say."""
    shapes = {"a": torch.Size([3]), "b": torch.Size([5, 7]), "c": torch.Size([1001])}
    compressor = gradzip.compressor_from_spec(spec)
    engine = gradzip.Engine(shapes, compressor, collective=gradzip.SimulatedGroup(3))
    gen = torch.Generator().manual_seed(5)
    engine.reduce({n: torch.randn(3, *s, generator=gen) for n, s in shapes.items()})
    expected = compressor.message_bytes(*(s.numel() for s in shapes.values()))  # type: ignore[attr-defined]
    apart = sum(compressor.message_bytes(s.numel()) for s in shapes.values())  # type: ignore[attr-defined]
    assert expected < apart if spec.startswith("sign") else expected <= apart
    assert engine.stats["payload_bytes"] == [FLAG + expected] * 3
    jobs = [Job(n, torch.randn(3, *s, generator=gen)) for n, s in shapes.items()]
    compressor.reduce(jobs, compressor.init_state(shapes), gradzip.SimulatedGroup(3), _ctx(3, 0))
    for job in jobs:
        torch.testing.assert_close(job.averaged, job.own_decoded().mean(0), rtol=1e-4, atol=1e-5)


def test_randk_indices_are_shared_so_values_are_summed() -> None:
    engine = gradzip.Engine({"w": torch.Size([1000])}, "randk:ratio=0.1",
                            collective=gradzip.SimulatedGroup(4))
    grads = torch.randn(4, 1000)
    out = engine.reduce({"w": grads})["w"]
    sent = out != 0
    assert int(sent.sum()) == 100
    assert torch.allclose(out[sent], grads.mean(0)[sent])
    assert engine.stats["payload_bytes"] == [FLAG + 400] * 4


# -- spec strings ---------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("spec", "cls", "attrs"),
    [
        ("none", gradzip.NoCompression, {}),
        ("fp16", gradzip.FP16, {}),
        ("bf16", gradzip.BF16, {}),
        ("topk:ratio=0.01", gradzip.TopK, {"ratio": 0.01}),
        ("randk:ratio=0.5,seed=7", gradzip.RandK, {"ratio": 0.5, "seed": 7}),
        ("threshold:lam=1e-3", gradzip.HardThreshold, {"lam": 1e-3}),
        ("threshold:budget=0.01", gradzip.HardThreshold, {"budget": 0.01}),
        ("powersgd:rank=4,power_iterations=2", gradzip.PowerSGD, {"matrix_rank": 4, "power_iterations": 2}),
        ("qsgd:levels=16,bucket_size=512", gradzip.QSGD, {"levels": 16, "bucket_size": 512}),
        ("sign", gradzip.Sign, {}),
    ],
)
def test_spec_strings_build_and_round_trip(spec: str, cls: type, attrs: dict) -> None:
    comp = gradzip.compressor_from_spec(spec)
    assert isinstance(comp, cls)
    for key, value in attrs.items():
        assert getattr(comp, key) == value
    assert gradzip.compressor_from_spec(comp.spec()) == comp


@pytest.mark.parametrize(
    ("spec", "exc", "fragment"),
    [
        ("topk:ratio=0", ValueError, "`ratio` must be in (0, 1], got 0.0"),
        ("topk:ratio=1.5", ValueError, "`ratio` must be in (0, 1], got 1.5"),
        ("topk:ratio=nan", ValueError, "`ratio` must be in (0, 1], got nan"),
        ("threshold:lam=-1", ValueError, "`lam` must be > 0, got -1.0"),
        ("threshold", ValueError, "exactly one of `lam` and `budget`"),
        ("powersgd:rank=0", ValueError, "`matrix_rank` must be >= 1, got 0"),
        ("powersgd:rank=1.5", TypeError, "`matrix_rank` must be an integer, got 1.5"),
        ("qsgd:levels=0", ValueError, "`levels` must be in [1, 127], got 0"),
        ("topk:k=3", ValueError, "`topk` parameters must be among exchange, owner_keep, ratio, got 'k'"),
        ("zip", ValueError, "`spec` must name one of"),
        ("topk:ratio", ValueError, "key=value pairs"),
        ("topk:ratio=0.1,ratio=0.2", ValueError, "must not repeat a key"),
        (":ratio=1", ValueError, "must start with a compressor name"),
        (3, TypeError, "`spec` must be a string"),
    ],
)
def test_bad_specs_name_parameter_constraint_and_value(spec: object, exc: type, fragment: str) -> None:
    with pytest.raises(exc) as info:
        gradzip.compressor_from_spec(spec)  # type: ignore[arg-type]
    assert fragment in str(info.value)


def test_describe_compressors_is_json_and_complete() -> None:
    rows = json.loads(json.dumps(gradzip.describe_compressors()))
    names = {row["name"] for row in rows}
    assert names == {"none", "fp16", "bf16", "topk", "randk", "threshold", "powersgd", "qsgd", "sign",
                     "chunktopk", "binmean", "scatterq", "sharedtopk"}
    powersgd = next(r for r in rows if r["name"] == "powersgd")
    assert {"name": "rank", "type": "int", "default": 1} in powersgd["parameters"]
