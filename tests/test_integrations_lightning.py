"""gradzip.integrations.lightning with the real Lightning: 2 CPU gloo processes under torchrun.

Run as a script (by torchrun), this file is the worker: ``trainer OUT`` fits with
``GradzipDDPStrategy``, ``fabric OUT`` trains with ``GradzipFabricDDPStrategy``, ``both OUT``
does both in one launch (Fabric's in ``OUT/fabric``, then the Trainer's in ``OUT/trainer``);
every rank saves its final parameters and hook state under its folder.
"""

from __future__ import annotations

import csv
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from integrations_launch import torchrun, trees_equal

HERE = Path(__file__).resolve()
SPEC = "topk:ratio=0.1"
# The Trainer test runs an Accordion, so its levels reach the logger too.
ACCORDION = "accordion(steady=topk:ratio=0.05,critical=topk:ratio=0.2,interval=2)"
STEPS_PER_EPOCH = 4  # 64 samples, 2 ranks, batch 8


def tiny_net() -> nn.Module:
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))


def batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Fabric's data: a function of (step, rank), so a resumed run sees the same batches."""
    generator = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(8, 8, generator=generator), torch.randint(0, 4, (8,), generator=generator)


# -- worker: the Trainer --------------------------------------------------------------------
def trainer_worker(out: Path) -> None:
    import lightning as L
    from lightning.pytorch.callbacks import ModelCheckpoint
    from lightning.pytorch.loggers import CSVLogger
    from torch.utils.data import DataLoader, TensorDataset

    from gradzip.integrations.lightning import CHECKPOINT_KEY, GradzipDDPStrategy

    class Module(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = tiny_net()

        def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
            x, y = batch
            return nn.functional.cross_entropy(self.net(x), y)

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)

    generator = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(64, 8, generator=generator),
                         torch.randint(0, 4, (64,), generator=generator))

    def fit(name: str, ckpt_path: str | None = None, **trainer_args: object) -> None:
        # One seed for every run: Lightning seeds its DistributedSampler from it.
        L.seed_everything(0, verbose=False)
        module = Module()
        if ckpt_path is not None:  # weights the checkpoint must overwrite
            with torch.no_grad():
                for p in module.parameters():
                    p.add_(1.0)
        strategy = GradzipDDPStrategy(ACCORDION)
        trainer = L.Trainer(
            accelerator="cpu", devices=2, strategy=strategy, max_epochs=2, log_every_n_steps=1,
            enable_progress_bar=False, enable_model_summary=False, **trainer_args,
        )
        trainer.fit(module, DataLoader(data, batch_size=8, shuffle=True), ckpt_path=ckpt_path)
        torch.save({"params": {k: v.detach().clone() for k, v in module.state_dict().items()},
                    "state": strategy.hook_state.state_dict(),
                    "stats": strategy.hook_state.stats},
                   out / f"{name}-rank{trainer.global_rank}.pt")

    ckpt_dir = out / "checkpoints"
    fit("full", callbacks=[ModelCheckpoint(dirpath=ckpt_dir, save_top_k=-1, every_n_epochs=1)],
        logger=CSVLogger(out, name="logs"))
    first_epoch = sorted(ckpt_dir.glob("epoch=0*.ckpt"))[0]
    fit("resumed", ckpt_path=str(first_epoch), logger=False, enable_checkpointing=False)
    # The control: the same checkpoint without its gradzip entry must not resume exactly.
    stripped = out / "stripped.ckpt"
    if torch.distributed.get_rank() == 0:
        checkpoint = torch.load(first_epoch, weights_only=False)
        del checkpoint[CHECKPOINT_KEY]
        torch.save(checkpoint, stripped)
    torch.distributed.barrier()
    fit("stripped", ckpt_path=str(stripped), logger=False, enable_checkpointing=False)


# -- worker: Fabric -------------------------------------------------------------------------
def fabric_worker(out: Path) -> None:
    import lightning as L

    from gradzip.integrations.lightning import GradzipFabricDDPStrategy

    def run(seed: int, name: str, start: int, total: int, save_at: int | None = None) -> None:
        fabric = L.Fabric(accelerator="cpu", devices=2, strategy=GradzipFabricDDPStrategy(SPEC))
        fabric.launch()
        torch.manual_seed(seed)
        net = tiny_net()
        optimizer = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
        model, optimizer = fabric.setup(net, optimizer)
        state = {"model": model, "optimizer": optimizer, "step": 0}
        if start:
            fabric.load(out / "fabric.ckpt", state)
            assert state["step"] == start, state["step"]
        for step in range(start, total):
            if step == save_at:
                state["step"] = step
                fabric.save(out / "fabric.ckpt", state)
            x, y = batch(step, fabric.global_rank)
            optimizer.zero_grad()
            fabric.backward(nn.functional.cross_entropy(model(x), y))
            optimizer.step()
        hook_state = fabric.strategy.hook_state
        torch.save({"params": {k: v.detach().clone() for k, v in net.state_dict().items()},
                    "state": hook_state.state_dict(), "stats": hook_state.stats},
                   out / f"{name}-rank{fabric.global_rank}.pt")

    run(0, "full", 0, 8, save_at=4)
    run(1, "resumed", 4, 8)


def both_workers(out: Path) -> None:
    """Fabric's runs, then the Trainer's, in the same processes and process group (one
    launch: starting processes that import Lightning costs more than the training)."""
    for name, worker in (("fabric", fabric_worker), ("trainer", trainer_worker)):
        (out / name).mkdir(exist_ok=True)
        worker(out / name)


# -- tests ----------------------------------------------------------------------------------
def load(out: Path, name: str) -> list[dict[str, object]]:
    return [torch.load(out / f"{name}-rank{rank}.pt", weights_only=False) for rank in (0, 1)]


def assert_resumed_exactly(out: Path, steps: int) -> None:
    full, resumed = load(out, "full"), load(out, "resumed")
    for rank in (0, 1):
        assert full[rank]["stats"]["steps"] == steps
        assert full[rank]["stats"]["compression_rate"] > 1
        assert trees_equal(full[rank]["params"], resumed[rank]["params"]), f"rank {rank} params"
        # Every rank got its own residuals back, not rank 0's.
        assert trees_equal(full[rank]["state"], resumed[rank]["state"]), f"rank {rank} state"
        assert resumed[rank]["stats"]["steps"] == steps
    assert not trees_equal(full[0]["state"], full[1]["state"])


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The folder of one ``both`` launch: ``fabric/`` and ``trainer/`` each hold their runs."""
    pytest.importorskip("lightning", reason="needs lightning (the `integrations` extra)")
    out = tmp_path_factory.mktemp("lightning")
    torchrun(HERE, "both", str(out))
    return out


@pytest.mark.slow
def test_trainer_strategy_compresses_logs_and_resumes_exactly(runs: Path) -> None:
    tmp_path = runs / "trainer"
    assert_resumed_exactly(tmp_path, 2 * STEPS_PER_EPOCH)
    # Resuming without the gradzip entry (residuals and counters lost) does not match.
    stripped = load(tmp_path, "stripped")
    assert not trees_equal(load(tmp_path, "full")[0]["params"], stripped[0]["params"])
    assert stripped[0]["stats"]["steps"] == STEPS_PER_EPOCH
    # The counters reached the trainer's logger, one row per step, wire bytes growing.
    rows = list(csv.DictReader((tmp_path / "logs" / "version_0" / "metrics.csv").open()))
    wire = [float(r["gradzip/wire_bytes"]) for r in rows if r.get("gradzip/wire_bytes")]
    rates = [float(r["gradzip/compression_rate"]) for r in rows if r.get("gradzip/compression_rate")]
    assert len(wire) == 2 * STEPS_PER_EPOCH and wire == sorted(wire) and wire[0] > 0
    assert all(rate > 1 for rate in rates) and len(rates) == len(wire)
    # Accordion's levels: the share of tensors at each level, summing to one.
    shares = [(float(r.get("gradzip/level_share/critical") or 0), float(r.get("gradzip/level_share/steady") or 0))
              for r in rows if r.get("gradzip/wire_bytes")]
    assert all(sum(pair) == 1.0 for pair in shares), shares


@pytest.mark.slow
def test_fabric_strategy_saves_every_rank_and_resumes_exactly(runs: Path) -> None:
    assert_resumed_exactly(runs / "fabric", 8)


def test_strategy_validates_its_arguments() -> None:
    pytest.importorskip("lightning", reason="needs lightning (the `integrations` extra)")
    from gradzip.integrations.lightning import GradzipDDPStrategy, GradzipFabricDDPStrategy

    with pytest.raises(ValueError, match="ddp_comm_hook"):
        GradzipDDPStrategy("topk:ratio=0.1", ddp_comm_hook=lambda state, bucket: None)
    with pytest.raises(ValueError, match="ratio"):
        GradzipDDPStrategy("topk:ratio=1.5")
    with pytest.raises(TypeError, match="log_stats"):
        GradzipDDPStrategy("topk:ratio=0.1", log_stats="yes")
    strategy = GradzipDDPStrategy("powersgd:rank=2", dense_1d=True, find_unused_parameters=True)
    assert strategy.engine_options == {"dense_1d": True}
    assert strategy._ddp_kwargs == {"find_unused_parameters": True}
    with pytest.raises(ValueError, match="ddp_comm_state"):
        GradzipFabricDDPStrategy("sign", ddp_comm_state=object())


if __name__ == "__main__":
    torch.set_num_threads(1)
    import gradzip.comm

    {"trainer": trainer_worker, "fabric": fabric_worker, "both": both_workers}[sys.argv[1]](
        Path(sys.argv[2]))
    gradzip.comm.shutdown_process_group()
