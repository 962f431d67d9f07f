"""gradzip.integrations.accelerate with the real Accelerate: 2 CPU gloo processes (torchrun).

Run as a script (by torchrun), this file is the worker: it trains 8 optimizer steps of 2
micro-batches each, saving with ``accelerator.save_state`` after 4, then trains a differently
initialised model from that checkpoint to step 8; every rank saves what it ended with.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from integrations_launch import torchrun, trees_equal

HERE = Path(__file__).resolve()
SPEC = "powersgd:rank=1"
STEPS, SAVE_AT, MICRO = 8, 4, 2


def batch(micro_step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1000 * micro_step + rank)
    return torch.randn(8, 8, generator=generator), torch.randint(0, 4, (8,), generator=generator)


def worker(out: Path) -> None:
    from accelerate import Accelerator

    import gradzip.comm
    import gradzip.integrations.accelerate

    def run(name: str, start: int) -> None:
        accelerator = Accelerator(cpu=True, gradient_accumulation_steps=MICRO)
        torch.manual_seed(start)  # another initialisation for the resumed run
        net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
        optimizer = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
        model, optimizer = accelerator.prepare(net, optimizer)
        state = gradzip.integrations.accelerate.register(accelerator, model, SPEC)
        assert state.optimizer is optimizer
        if start:
            accelerator.load_state(str(out / "ckpt"))
            assert state.stats["steps"] == start
        for micro_step in range(start * MICRO, STEPS * MICRO):
            if micro_step == SAVE_AT * MICRO and not start:
                accelerator.save_state(str(out / "ckpt"))
            with accelerator.accumulate(model):
                x, y = batch(micro_step, accelerator.process_index)
                accelerator.backward(nn.functional.cross_entropy(model(x), y))
                optimizer.step()
                optimizer.zero_grad()
        torch.save({"params": {k: v.detach().clone() for k, v in net.state_dict().items()},
                    "state": state.state_dict(), "stats": state.stats},
                   out / f"{name}-rank{accelerator.process_index}.pt")

    run("full", 0)
    run("resumed", SAVE_AT)
    gradzip.comm.shutdown_process_group()


@pytest.mark.slow
def test_register_compresses_and_load_state_resumes_every_rank_exactly(tmp_path: Path) -> None:
    pytest.importorskip("accelerate", reason="needs accelerate (the `integrations` extra)")
    torchrun(HERE, str(tmp_path))
    full, resumed = ([torch.load(tmp_path / f"{name}-rank{r}.pt", weights_only=False) for r in (0, 1)]
                     for name in ("full", "resumed"))
    for rank in (0, 1):
        assert full[rank]["stats"]["steps"] == STEPS  # optimizer steps, not micro-batches
        assert full[rank]["stats"]["compression_rate"] > 1
        assert trees_equal(full[rank]["params"], resumed[rank]["params"]), f"rank {rank} params"
        assert trees_equal(full[rank]["state"], resumed[rank]["state"]), f"rank {rank} state"
    assert not trees_equal(full[0]["state"], full[1]["state"])  # residuals are per rank


def test_register_refuses_what_is_not_a_prepared_ddp_model() -> None:
    pytest.importorskip("accelerate", reason="needs accelerate (the `integrations` extra)")
    from accelerate import Accelerator

    import gradzip.integrations.accelerate

    with pytest.raises(TypeError, match="`accelerator` must be"):
        gradzip.integrations.accelerate.register(object(), nn.Linear(2, 2), "sign")
    with pytest.raises(TypeError, match="`model` must be the DistributedDataParallel"):
        gradzip.integrations.accelerate.register(Accelerator(cpu=True), nn.Linear(2, 2), "sign")


if __name__ == "__main__":
    torch.set_num_threads(1)
    worker(Path(sys.argv[1]))
