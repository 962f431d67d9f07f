"""gradzip under the Hugging Face ``Trainer``: one callback.

``GradzipCallback`` registers gradzip's hook on the DDP model the Trainer builds, writes every
rank's hook state into each checkpoint folder and reads it back on
``trainer.train(resume_from_checkpoint=...)``. The model is a tiny GPT-2 built from a config
(no download) and the data random token sequences, so that the example runs anywhere.

Run (2 CPU processes; with GPUs, one per GPU)::

    torchrun --standalone --nproc-per-node 2 examples/transformers_trainer.py \\
        --compressor powersgd:rank=2 --steps 20 --output-dir /tmp/gradzip-trainer
    # the same command with --resume continues from the last checkpoint to --steps
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments
from transformers.trainer_utils import get_last_checkpoint

import gradzip.comm
from gradzip.integrations.transformers import GradzipCallback


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="gradzip under the Hugging Face Trainer")
    parser.add_argument("--compressor", default="powersgd:rank=2", help="any compressor spec")
    parser.add_argument("--steps", type=int, default=20, help="optimizer steps in all")
    parser.add_argument("--save-steps", type=int, default=10, help="a checkpoint every N steps")
    parser.add_argument("--output-dir", type=Path, default=Path("gradzip-trainer"))
    parser.add_argument("--resume", action="store_true",
                        help="continue from the last checkpoint in --output-dir")
    args = parser.parse_args(argv)
    for name in ("steps", "save_steps"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    return args


def tiny_gpt2() -> GPT2LMHeadModel:
    """A two-layer GPT-2 of 16-wide embeddings over a 64-token vocabulary, from a config."""
    config = GPT2Config(vocab_size=64, n_positions=32, n_embd=16, n_layer=2, n_head=2,
                        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    return GPT2LMHeadModel(config)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    torch.manual_seed(0)  # every rank builds the same model (DDP checks it)
    tokens = torch.randint(0, 64, (256, 24), generator=torch.Generator().manual_seed(0))
    data = [{"input_ids": row, "labels": row} for row in tokens]
    training = TrainingArguments(
        output_dir=str(args.output_dir), use_cpu=not torch.cuda.is_available(),
        per_device_train_batch_size=8, max_steps=args.steps, save_steps=args.save_steps,
        learning_rate=5e-3, report_to="none", disable_tqdm=True, seed=0,
        dataloader_num_workers=0, logging_steps=args.steps,
    )
    callback = GradzipCallback(args.compressor)
    trainer = Trainer(model=tiny_gpt2(), args=training, train_dataset=data, callbacks=[callback])
    resume = get_last_checkpoint(str(args.output_dir)) if args.resume else None
    if args.resume and resume is None:
        raise SystemExit(f"--resume: no checkpoint in {args.output_dir}")
    result = trainer.train(resume_from_checkpoint=resume)

    state = callback.state
    if trainer.is_world_process_zero():
        stats = state.stats
        where = f"resumed from {resume}; " if resume else ""
        print(f"{where}compressor {state.compressor.spec()} on {trainer.args.world_size} "
              f"processes, {trainer.state.global_step} steps, mean training loss "
              f"{result.training_loss:.4f}")
        print(f"bytes sent per rank: payload {stats['payload_bytes']} vs dense "
              f"{stats['dense_payload_bytes']}")
    # Leave the group together before exiting: with gloo, a rank that exits right after its
    # last collective can abort while tearing down.
    gradzip.comm.shutdown_process_group()


if __name__ == "__main__":
    main()
