"""Parameter helpers of the DDP adapter: the trainable ``(name, parameter)`` pairs of a model,
and moving a state tree between devices (checkpoints load on the CPU).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from gradzip._validate import check_grad_dtype

__all__ = ["named_trainable_parameters", "tree_to"]


def named_trainable_parameters(
    model_or_named_params: nn.Module | Iterable[tuple[str, torch.Tensor]],
) -> list[tuple[str, torch.Tensor]]:
    if isinstance(model_or_named_params, DistributedDataParallel):
        model_or_named_params = model_or_named_params.module
    if isinstance(model_or_named_params, nn.Module):
        pairs = list(model_or_named_params.named_parameters())
    elif isinstance(model_or_named_params, Iterable) and not isinstance(
        model_or_named_params, (str, torch.Tensor, Mapping)
    ):
        pairs = list(model_or_named_params)
        for item in pairs:
            if not (
                isinstance(item, tuple) and len(item) == 2 and isinstance(item[1], torch.Tensor)
            ):
                raise TypeError(
                    f"`model_or_named_params` must hold (name, parameter) pairs, got {item!r}"
                )
    else:
        raise TypeError(
            "`model_or_named_params` must be a module, a DistributedDataParallel model or "
            f"(name, parameter) pairs, got {type(model_or_named_params).__name__}"
        )
    pairs = [(str(n), p) for n, p in pairs if p.requires_grad]
    if not pairs:
        raise ValueError("`model_or_named_params` must hold at least one trainable parameter, got none")
    # DDP hands the hook a complex parameter's gradient as a real view of half its length
    # (the imaginary parts never reach the hook): refuse at registration, by dtype.
    for name, param in pairs:
        check_grad_dtype(name, param, "parameter")
    return pairs


def tree_to(tree: Any, device: torch.device) -> Any:
    """Move every tensor of a nested dict/list to ``device`` (checkpoints load on CPU)."""
    if isinstance(tree, torch.Tensor):
        return tree.to(device)
    if isinstance(tree, Mapping):
        return {k: tree_to(v, device) for k, v in tree.items()}
    if isinstance(tree, list):
        return [tree_to(v, device) for v in tree]
    return tree
