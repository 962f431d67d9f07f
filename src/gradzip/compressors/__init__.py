"""Compression algorithms, one per module (spec strings and the registry: :mod:`gradzip.spec`)."""

from __future__ import annotations

from gradzip.compressors.base import Compressor, Job, StepContext
from gradzip.compressors.binmean import BinMean
from gradzip.compressors.chunktopk import ChunkTopK
from gradzip.compressors.lowprec import BF16, FP16
from gradzip.compressors.none import NoCompression
from gradzip.compressors.powersgd import PowerSGD
from gradzip.compressors.qsgd import QSGD
from gradzip.compressors.randk import RandK
from gradzip.compressors.scatterq import ScatterQuant
from gradzip.compressors.shared import SharedTopK
from gradzip.compressors.sign import Sign
from gradzip.compressors.threshold import HardThreshold
from gradzip.compressors.topk import TopK

__all__ = [
    "BF16",
    "FP16",
    "BinMean",
    "ChunkTopK",
    "QSGD",
    "Compressor",
    "HardThreshold",
    "Job",
    "NoCompression",
    "PowerSGD",
    "RandK",
    "ScatterQuant",
    "SharedTopK",
    "Sign",
    "StepContext",
    "TopK",
]
