"""Collectives: one protocol, a real process group and a simulated group of N workers.

Byte accounting lives here, because only the collective knows what it moves.
"""

from gradzip.comm.base import ByteMeter, Collective
from gradzip.comm.launch import free_port, run_processes
from gradzip.comm.simulated import SimulatedGroup, SingleWorker
from gradzip.comm.torch_dist import (
    ProcessGroupCollective,
    default_collective,
    shutdown_process_group,
)

__all__ = [
    "ByteMeter",
    "Collective",
    "ProcessGroupCollective",
    "SimulatedGroup",
    "SingleWorker",
    "default_collective",
    "free_port",
    "run_processes",
    "shutdown_process_group",
]
