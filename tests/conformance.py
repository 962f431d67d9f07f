"""Shared fixtures of the conformance suite: every compressor spec and a test model's shapes."""

from __future__ import annotations

import torch

from gradzip.spec import CONTROLLERS, REGISTRY, parse_spec

# One entry per compressor (three for the threshold: its two modes and its fixed-capacity form). Values are chosen so that every
# compressing spec really compresses the shapes below with 4 workers.
EXAMPLES = [
    "none",
    "fp16",
    "bf16",
    "topk:ratio=0.05",
    "randk:ratio=0.05,seed=3",
    "threshold:lam=2.5",
    "threshold:lam=2.5,capacity=0.05",
    "threshold:budget=0.02",
    "powersgd:rank=2",
    "qsgd:levels=4",
    "sign",
    "chunktopk:chunk=256,k=8",
    "chunktopk:chunk=100,k=10,bits=2",
    "binmean:bits=2",
    "binmean",
    "scatterq",
    "scatterq:bits=4",
    "sharedtopk:ratio=0.05,block=8",
    # Accordion is a compressor too; a short interval makes the tests cross a level switch.
    "accordion(steady=powersgd:rank=1,critical=powersgd:rank=2,eta=0.5,interval=2,per_layer=True,lr_drop=True)",
    "accordion(steady=topk:ratio=0.05,critical=topk:ratio=0.2,eta=0.5,interval=1,per_layer=False,lr_drop=True)",
    "schedule(gentle=none,aggressive=topk:ratio=0.05,gentle_steps=0-1;4-5,after_drop=0)",
    # auto: every decision is critical (a tiny eta), so the one gentle level is chosen at the
    # first one whatever the clock says: a switch at step 1 that real time cannot change. Its
    # probe message is no smaller than the tensors (12,868 bytes), so it never grows: how far
    # a smaller one grows depends on the measured times, and so would the bytes.
    "auto(levels=powersgd:rank=1|fp16,every=2,warmup=1,eta=1e-09,probe_bytes=16384)",
]


def _name(spec: str) -> str:
    head = spec.split("(", 1)[0]
    return head if head in CONTROLLERS else parse_spec(spec)[0]


#: Every spec the suite runs: the examples above, and every registered compressor that has
#: none, with its defaults (so a compressor added to the registry is tested without a line
#: here).
SPECS = EXAMPLES + [name for name in REGISTRY if name not in {_name(s) for s in EXAMPLES}]

# Whether the compressor is exact for the same inputs on every backend (all are: randomness
# comes from keyed generators), and how close the average of decoded messages must be to the
# averaged result (fp16/bf16 sum in low precision).
DECODE_TOL = {"fp16": 2e-3, "bf16": 2e-2,
              # at fp16 from its first decision (step 1) on
              "auto(levels=powersgd:rank=1|fp16,every=2,warmup=1,eta=1e-09,probe_bytes=16384)": 2e-3}

SHAPES = {
    "conv.weight": torch.Size([16, 8, 3, 3]),
    "conv.bias": torch.Size([16]),
    "fc.weight": torch.Size([32, 64]),
    "scale": torch.Size([1]),
}


def make_grads(workers: int, step: int, seed: int = 0, scale: float = 1.0) -> dict[str, torch.Tensor]:
    """Per-worker gradients ``[workers, *shape]`` that differ by step and worker."""
    gen = torch.Generator().manual_seed(seed * 1000 + step)
    return {n: scale * torch.randn(workers, *s, generator=gen) for n, s in SHAPES.items()}
