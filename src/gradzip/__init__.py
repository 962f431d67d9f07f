"""gradzip: compressed gradient communication for data-parallel PyTorch training."""

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
    Sign,
    TopK,
)
from gradzip.control import Accordion, BatchPlan, BatchSizeController, Schedule, critical_regime
from gradzip.engine import Engine
from gradzip.options import EngineOptions, Rule
from gradzip.outer import Outer, OuterOptimizer
from gradzip.plan import Auto
from gradzip.spec import compressor_from_spec, describe_compressors

__version__ = "0.1.0"

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
    "Sign",
    "SimulatedGroup",
    "TopK",
    "__version__",
    "compressor_from_spec",
    "critical_regime",
    "ddp",
    "describe_compressors",
    "plan",
]
