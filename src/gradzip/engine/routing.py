"""Which compressor reduces which tensor: the engine's main compressor and its rules'.

A :class:`Router` is fixed when the engine is built (names, shapes and options decide every
route, see :func:`gradzip.options.route`) and holds no state of its own: the compressors'
states live in the engine, as one list indexed by route (``states[0]`` the main compressor's,
``states[i + 1]`` rule ``i``'s, ``{}`` for a dense rule), so the engine snapshots, rolls back
and checkpoints them all alike.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from gradzip.comm.base import Collective
from gradzip.compressors.base import Compressor, Job, StepContext
from gradzip.options import DENSE_ROUTE, MAIN_ROUTE, EngineOptions, route

__all__ = ["Router", "idle_rule"]


def idle_rule(shapes: Mapping[str, torch.Size], options: EngineOptions) -> str | None:
    """Why a rule of ``options`` decides no parameter of ``shapes``, or ``None``.

    A rule that matches no name (a typo in its glob, a pattern written for another model), or
    whose every match is decided before it (``min_numel``, ``dense_1d``, an earlier rule), does
    nothing at all; accepting it silently would leave the user believing those tensors are
    compressed as the rule says. Precedence is :func:`~gradzip.options.route`'s.
    """
    rules = options.routing_rules()
    sugar = len(rules) - len(options.rules)
    names = list(shapes)
    decider: dict[str, str | int | None] = {}  # "min_numel", an index into rules, or None
    for name in names:
        shape = torch.Size(shapes[name])
        if shape.numel() < options.min_numel:
            decider[name] = "min_numel"
        else:
            decider[name] = next((j for j, r in enumerate(rules) if r.matches(name, shape)), None)
    for i, rule in enumerate(options.rules):
        if any(d == i + sugar for d in decider.values()):
            continue
        matched = [n for n in names if rule.matches(n, torch.Size(shapes[n]))]
        if not matched:
            listed = ", ".join(names[:6]) + (", ..." if len(names) > 6 else "")
            return (f"rule {rule.describe()!r} must match a parameter, but its glob matches none "
                    f"of this model's ({listed or 'none'})")
        first = matched[0]
        by = decider[first]
        if by == "min_numel":
            why = f"`min_numel={options.min_numel}`"
        elif by == 0 and sugar:
            why = "`dense_1d`"
        else:
            why = f"rule {rules[by].describe()!r}"  # type: ignore[index]
        return (f"rule {rule.describe()!r} must decide a parameter, but every parameter it "
                f"matches is decided before it, e.g. {first!r} by {why}")
    return None


class Router:
    """The routes of one engine's tensors and the calls into each compressor.

    Args:
        shapes: the engine's parameters.
        compressor: the main compressor.
        options: the engine's options (``rules``, ``min_numel``, ``dense_1d``,
            ``error_feedback``).

    Raises:
        ValueError: a rule that decides no parameter (see :func:`idle_rule`), named.
    """

    def __init__(
        self, shapes: Mapping[str, torch.Size], compressor: Compressor, options: EngineOptions
    ) -> None:
        self.shapes = dict(shapes)
        self.compressor = compressor
        #: Each rule's compressor (``None`` for a dense rule), in rule order.
        self.rule_compressors: tuple[Compressor | None, ...] = tuple(
            rule.compressor for rule in options.rules
        )
        idle = idle_rule(self.shapes, options)
        if idle:
            raise ValueError(idle)
        self.routes = route(self.shapes, options)
        #: Tensors sent by one exact all-reduce, without residual.
        self.dense_names = frozenset(n for n, r in self.routes.items() if r == DENSE_ROUTE)
        #: Tensors that keep a residual: error feedback is decided per compressor.
        self.feedback_names = frozenset(
            n for n, r in self.routes.items()
            if r != DENSE_ROUTE and options.feedback_for(self.compressor_of(r))
        )

    def shapes_of(self, where: int) -> dict[str, torch.Size]:
        """The tensors routed to ``where``."""
        return {n: s for n, s in self.shapes.items() if self.routes[n] == where}

    def compressor_of(self, where: int) -> Compressor:
        """The compressor of route ``where`` (the main one or a rule's)."""
        found = self.compressor if where == MAIN_ROUTE else self.rule_compressors[where - 1]
        assert found is not None, where  # a dense rule's tensors take DENSE_ROUTE
        return found

    def fresh_state(self, where: int, comm: Collective) -> Any:
        """The fresh state of route ``where``'s compressor for the group of ``comm`` (its
        ``init_group_state``: the sharded exchange's owner residuals depend on the group)."""
        return self.compressor_of(where).init_group_state(
            self.shapes_of(where), comm.world_size, comm.local_workers)

    def fresh_rule_states(self, comm: Collective) -> list[Any]:
        """Each rule's fresh state (``{}`` for a dense rule) for the group of ``comm``."""
        return [{} if c is None else self.fresh_state(i + 1, comm)
                for i, c in enumerate(self.rule_compressors)]

    def in_use(self) -> list[int]:
        """The compressors' routes in a fixed order, rules first, then the main one: every
        rank issues their collectives in this same sequence."""
        return [i + 1 for i, c in enumerate(self.rule_compressors) if c is not None] + [MAIN_ROUTE]

    def reduce(
        self, jobs: Sequence[Job], states: list[Any], comm: Collective, ctx: StepContext
    ) -> None:
        """Hand each compressor the jobs routed to it, with its state (``states[route]``)."""
        for where in self.in_use():
            mine = [j for j in jobs if self.routes[j.name] == where]
            if mine:
                self.compressor_of(where).reduce(mine, states[where], comm, ctx)

    def begin_step(self, states: list[Any], comm: Collective, ctx: StepContext) -> None:
        """Every compressor's beginning of step, in :meth:`in_use` order (collectives in one
        sequence on every rank)."""
        for where in self.in_use():
            self.compressor_of(where).begin_step(states[where], comm, ctx)

    def end_step(self, states: list[Any], ctx: StepContext) -> None:
        """Every compressor's end of step (also those that received no tensor this step)."""
        for where in self.in_use():
            self.compressor_of(where).end_step(states[where], ctx)
