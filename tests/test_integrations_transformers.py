"""gradzip.integrations.transformers with the real Trainer: 2 CPU gloo processes (torchrun).

Run as a script (by torchrun), this file is the worker: a tiny GPT-2 built from a config (no
download) trains 8 steps with ``GradzipCallback``, checkpointing after 4; a differently
initialised model then resumes from that checkpoint to step 8. Every rank saves its final
parameters and hook state.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from integrations_launch import torchrun, trees_equal

HERE = Path(__file__).resolve()
SPEC = "topk:ratio=0.1"
STEPS, SAVE_AT = 8, 4


def worker(out: Path) -> None:
    from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

    import gradzip.comm
    from gradzip.integrations.transformers import GradzipCallback, state_file

    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 32, (64, 12), generator=generator)
    data = [{"input_ids": row, "labels": row} for row in tokens]

    def run(name: str, resume: str | None) -> None:
        torch.manual_seed(1 if resume else 0)  # another initialisation for the resumed run
        config = GPT2Config(vocab_size=32, n_positions=16, n_embd=16, n_layer=1, n_head=2,
                            resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
        model = GPT2LMHeadModel(config)
        args = TrainingArguments(
            output_dir=str(out / "run"), use_cpu=True, per_device_train_batch_size=4,
            max_steps=STEPS, save_steps=SAVE_AT, learning_rate=1e-2, report_to="none",
            disable_tqdm=True, seed=0, dataloader_num_workers=0, logging_steps=100,
        )
        callback = GradzipCallback(SPEC)
        trainer = Trainer(model=model, args=args, train_dataset=data, callbacks=[callback])
        trainer.train(resume_from_checkpoint=resume)
        rank = torch.distributed.get_rank()
        torch.save({"params": {k: v.detach().clone() for k, v in model.state_dict().items()},
                    "state": callback.state.state_dict(), "stats": callback.state.stats,
                    "saved": Path(state_file(out / "run" / f"checkpoint-{SAVE_AT}", rank)).is_file()},
                   out / f"{name}-rank{rank}.pt")

    run("full", None)
    run("resumed", str(out / "run" / f"checkpoint-{SAVE_AT}"))
    gradzip.comm.shutdown_process_group()


@pytest.mark.slow
def test_callback_compresses_and_resumes_every_rank_exactly(tmp_path: Path) -> None:
    pytest.importorskip("transformers", reason="needs transformers (the `integrations` extra)")
    torchrun(HERE, str(tmp_path), timeout=240.0)
    full, resumed = ([torch.load(tmp_path / f"{name}-rank{r}.pt", weights_only=False) for r in (0, 1)]
                     for name in ("full", "resumed"))
    for rank in (0, 1):
        assert full[rank]["saved"]
        assert full[rank]["stats"]["steps"] == STEPS
        assert full[rank]["stats"]["compression_rate"] > 1
        assert trees_equal(full[rank]["params"], resumed[rank]["params"]), f"rank {rank} params"
        assert trees_equal(full[rank]["state"], resumed[rank]["state"]), f"rank {rank} state"
    assert not trees_equal(full[0]["state"], full[1]["state"])  # residuals are per rank


def test_callback_validates_its_arguments() -> None:
    pytest.importorskip("transformers", reason="needs transformers (the `integrations` extra)")
    from gradzip.integrations.transformers import GradzipCallback

    with pytest.raises(ValueError, match="ratio"):
        GradzipCallback("topk:ratio=2")
    with pytest.raises(TypeError, match="engine_options"):
        GradzipCallback("sign", bucket_cap_mb=4)
    assert GradzipCallback("sign", dense_1d=True).engine_options == {"dense_1d": True}


if __name__ == "__main__":
    torch.set_num_threads(1)
    worker(Path(sys.argv[1]))
