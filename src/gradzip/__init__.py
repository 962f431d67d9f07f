"""gradzip: compressed gradient communication for data-parallel PyTorch training."""

import importlib
from typing import TYPE_CHECKING, Any

from gradzip import (
    ddp,  # the DDP hook adapter: gradzip.ddp.register
    plan,  # the cost model: gradzip.plan.plan / predict / choose
)
from gradzip.comm import Collective, ProcessGroupCollective, SimulatedGroup
from gradzip.compressors import (
    BF16,
    FP16,
    QSGD,
    BinMean,
    ChunkTopK,
    Compressor,
    HardThreshold,
    NoCompression,
    PowerSGD,
    RandK,
    ScatterQuant,
    SharedTopK,
    Sign,
    TopK,
)
from gradzip.control import Accordion, BatchPlan, BatchSizeController, Schedule, critical_regime
from gradzip.engine import Engine
from gradzip.options import EngineOptions, Rule
from gradzip.outer import Outer, OuterOptimizer, outer_defaults
from gradzip.plan import Auto
from gradzip.spec import compressor_from_spec, describe_compressors

if TYPE_CHECKING:  # loaded on first use (see __getattr__): it imports torch's FSDP2
    from gradzip.outer.sharded import ShardedOuter

__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    # gradzip.fsdp imports torch's FSDP2, which adds seconds to an import that most users
    # (DDP, the simulator, the runner) never need: it is loaded on first use.
    if name == "fsdp":
        return importlib.import_module("gradzip.fsdp")
    if name == "ShardedOuter":  # outer-step training of FSDP2 models: imports FSDP2 too
        return importlib.import_module("gradzip.outer.sharded").ShardedOuter
    raise AttributeError(f"module 'gradzip' has no attribute {name!r}")


__all__ = [
    "BF16",
    "Accordion",
    "Auto",
    "BatchPlan",
    "BatchSizeController",
    "BinMean",
    "ChunkTopK",
    "FP16",
    "QSGD",
    "Collective",
    "Compressor",
    "Engine",
    "EngineOptions",
    "HardThreshold",
    "NoCompression",
    "Outer",
    "OuterOptimizer",
    "PowerSGD",
    "ProcessGroupCollective",
    "RandK",
    "Rule",
    "Schedule",
    "ScatterQuant",
    "SharedTopK",
    "Sign",
    "ShardedOuter",
    "SimulatedGroup",
    "TopK",
    "__version__",
    "compressor_from_spec",
    "critical_regime",
    "ddp",
    "describe_compressors",
    "outer_defaults",
    "plan",
    "fsdp",
]
