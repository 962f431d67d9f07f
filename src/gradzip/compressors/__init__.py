"""Compression algorithms, one per module, and spec-string construction."""

from gradzip.compressors.base import Compressor, Job, StepContext
from gradzip.compressors.lowprec import BF16, FP16
from gradzip.compressors.none import NoCompression
from gradzip.compressors.powersgd import PowerSGD
from gradzip.compressors.qsgd import QSGD
from gradzip.compressors.randk import RandK
from gradzip.compressors.sign import Sign
from gradzip.compressors.spec import (
    REGISTRY,
    compressor_from_spec,
    describe_compressors,
    parse_spec,
)
from gradzip.compressors.threshold import HardThreshold
from gradzip.compressors.topk import TopK

__all__ = [
    "BF16",
    "FP16",
    "QSGD",
    "REGISTRY",
    "Compressor",
    "HardThreshold",
    "Job",
    "NoCompression",
    "PowerSGD",
    "RandK",
    "Sign",
    "StepContext",
    "TopK",
    "compressor_from_spec",
    "describe_compressors",
    "parse_spec",
]
