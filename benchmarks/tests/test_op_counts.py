"""The op counter behind benchmarks/op_counts.py: what it counts and how it judges."""

from __future__ import annotations

import pytest
import torch

from benchmarks import op_counts


@pytest.fixture(scope="module")
def oc():
    return op_counts


def _profile(fn):
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        fn()
    return prof.events()


def test_leaf_counts_skip_composites_and_views(oc):
    x = torch.randn(8, 8)

    def work():
        y = x.view(64)            # a view: no kernel
        z = torch.zeros(3)        # composite: empty + zero_ (one kernel)
        (y * 2).sum()             # two kernels
        float(z.sum())            # a kernel and a host read
    counts = oc.leaf_counts(_profile(work))
    assert "aten::zeros" not in counts  # composite, counted by its leaf zero_
    summary = oc.summarize(counts)
    # zero_, mul, sum, sum and the scalar read
    assert summary["ops"] == 5, counts
    assert summary["syncs"] == 1, counts
    assert summary["collectives"] == 0


def test_verdicts_judge_ratios_syncs_and_the_split(oc):
    def row(model, scheme, extra, syncs=0.0):
        return {"model": model, "scheme": scheme, "extra_ops": extra, "syncs_mean": syncs}
    rows = [row("resnet18", "ddp", 100), row("resnet18", "gradzip:none", 119),
            row("resnet18", "gradzip:topk:ratio=0.01", 150, syncs=2.0),
            row("split16", "ddp", 30), row("split64", "ddp", 120),
            row("split16", "gradzip:none", 80), row("split64", "gradzip:none", 176)]
    found = {v["target"]: v for v in oc.verdicts(rows)}
    assert found["gradzip:none extra ops <= 1.2x ddp's"]["met"]
    assert found["gradzip:topk:ratio=0.01 extra ops <= 2.0x ddp's"]["met"]
    assert not found["gradzip:topk:ratio=0.01 host syncs per step == 0"]["met"]
    # the hook's own ops: 50 with 16 tensors, 56 with 64
    split = found["gradzip:none: 4x the tensors, same bytes: hook's own ops change <= 10%"]
    assert split["value"] == pytest.approx(0.12) and not split["met"]


@pytest.mark.slow
def test_counts_a_real_step(oc, tmp_path):
    """One scheme on the small model, end to end through DDP and the gradzip hook."""
    code = oc.main(["--out", str(tmp_path), "--steps", "1", "--warmup", "2",
                    "--only", "gradzip:none", "--models", "split16"])
    assert code == 0
    text = (tmp_path / "op_counts.md").read_text()
    assert "`gradzip:none`" in text and "`ddp`" in text


def test_a_multi_tensor_op_counts_once(oc):
    tensors = [torch.zeros(3), torch.zeros(4), torch.zeros(5)]

    def work():
        torch._foreach_add_(tensors, 1.0)  # one launch per batch on CUDA, a loop on the CPU
        torch.matmul(torch.ones(2, 2), torch.ones(2, 2))  # records resolve_conj: a no-op
    counts = oc.leaf_counts(_profile(work))
    # the foreach op once; two fills (ones) and the product (mm, whose resolve_conj children
    # launch nothing)
    assert counts["aten::_foreach_add_"] == 1 and counts["aten::mm"] == 1, counts
    assert oc.summarize(counts)["ops"] == 4, counts
