"""A captured graph cut into segments, and the graph of a range of them.

The captured graph's operations are in execution order. Cuts may fall before each block
of the model's outermost ``nn.ModuleList`` or ``nn.Sequential`` (``transformer.h.3``,
``model.layers.7``) and after the last one, or, for a model without one, before each of
its top-level children; the operations between two cuts are a *segment*. ``split_points``
name the cuts instead, each segment then a stage.

What crosses a cut is every value made before it and used after it: the hidden state,
and also skip connections, masks, rotary tables, position ids and labels, which a stage
hands on to the next until the last one using them. A size (a symbolic int of the
captured graph) crosses as a one-element tensor.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import fx, nn

from pipetrain.model.capture import Captured


def _as_size(tensor: torch.Tensor) -> int:
    return int(tensor.item())


def _as_tensor(size: int) -> torch.Tensor:
    return torch.tensor(size, dtype=torch.int64)


class Segments:
    """``captured``'s operations cut into segments (see the module's docstring): their
    ``names``, the values crossing each cut, and the graph of a range of them."""

    def __init__(
        self, captured: Captured, model: nn.Module, split_points: Sequence[str] | None
    ) -> None:
        """Cut ``captured`` (a capture of ``model``) at ``split_points`` or its blocks."""
        self.captured = captured
        graph = captured.module.graph
        self._order = [
            n for n in graph.nodes if n.op in ("call_function", "call_module", "call_method")
        ]
        self._position = {node: index for index, node in enumerate(self._order)}
        self._inputs = [
            n for n in graph.nodes if n.op == "placeholder" and n not in captured.constants
        ]
        (output_node,) = [n for n in graph.nodes if n.op == "output"]
        self._outputs = list(output_node.args[0])
        self._output_node = output_node
        if split_points is not None:
            names, cuts = self._named_cuts(model, list(split_points))
        else:
            names, cuts = self._block_cuts(model)
        self.names, self._cuts = names, [*cuts, len(self._order)]

    # cuts -------------------------------------------------------------------------------
    def _first_use(self) -> dict[str, int]:
        """Each module path's first operation."""
        first: dict[str, int] = {}
        for index, node in enumerate(self._order):
            for path, _ in (node.meta.get("nn_module_stack") or {}).values():
                first.setdefault(path, index)
        return first

    def _last_use(self, prefix: str) -> int:
        return max(
            i
            for i, node in enumerate(self._order)
            if any(
                path == prefix or path.startswith(prefix + ".")
                for path, _ in (node.meta.get("nn_module_stack") or {}).values()
            )
        )

    def _named_cuts(self, model: nn.Module, points: list[str]) -> tuple[list[str], list[int]]:
        modules = dict(model.named_modules())
        first = self._first_use()
        cuts = [0]
        for point in points:
            if point not in modules:
                raise ValueError(
                    f"split point {point!r} is not a module of the {type(model).__name__}; "
                    "name modules by their path, e.g. 'transformer.h.3'"
                )
            if point not in first:
                raise ValueError(f"split point {point!r} never runs in the model's forward")
            if first[point] <= cuts[-1]:
                raise ValueError(
                    f"split point {point!r} runs before the previous split point or at the "
                    "start; give split points in the order the model runs them"
                )
            cuts.append(first[point])
        return ["start", *points], cuts

    def _block_cuts(self, model: nn.Module) -> tuple[list[str], list[int]]:
        blocks = _blocks(model)
        first = self._first_use()
        starts = sorted({(first[b], b) for b in blocks if b in first})
        if not starts:  # a model without blocks is one segment
            return ["model"], [0]
        names, cuts = [], []
        if starts[0][0] > 0:
            names, cuts = ["start"], [0]
        for position, block in starts:
            if not cuts or position > cuts[-1]:
                names.append(block)
                cuts.append(position)
        end = self._last_use(starts[-1][1]) + 1
        if end < len(self._order):
            names.append("end")
            cuts.append(end)
        return names, cuts

    # values crossing cuts ---------------------------------------------------------------
    def crossing(self, segment: int) -> list[fx.Node]:
        """The values crossing the cut before ``segment``: made before, used at or after."""
        if segment == 0:
            return list(self._inputs)
        cut = self._cuts[segment]
        made = self._inputs + self._order[:cut]
        return [
            value
            for value in made
            if any(
                user is self._output_node or self._position.get(user, -1) >= cut
                for user in value.users
            )
        ]

    def graph(
        self, start: int, stop: int, place: Callable[[fx.Node], None] | None = None
    ) -> fx.Graph:
        """The graph of segments ``start`` to ``stop - 1``: it takes the values crossing
        the cut before ``start`` and returns those crossing the one before ``stop`` (or the
        model's flat outputs); ``place`` adjusts each copied operation (its devices)."""
        graph = fx.Graph()
        env: dict[fx.Node, Any] = dict(self.captured.constants)
        for value in self.crossing(start):
            placeholder = graph.placeholder(value.name)
            placeholder.meta = dict(value.meta)  # its value as captured, for passes to read
            env[value] = (
                graph.call_function(_as_size, (placeholder,)) if _is_size(value) else placeholder
            )

        def lookup(node: fx.Node) -> Any:
            if node not in env and node.op == "get_attr":
                env[node] = graph.get_attr(node.target)  # type: ignore[arg-type]
            if node not in env:
                raise ValueError(
                    f"{node.name} is used in segments {start}..{stop - 1} but made nowhere "
                    "before them"
                )
            return env[node]

        for node in self._order[self._cuts[start] : self._cuts[stop]]:
            env[node] = copied = graph.node_copy(node, lookup)
            if place is not None:
                place(copied)
        if stop == len(self.names):
            graph.output(tuple(fx.map_arg(self._outputs, lookup)))
        else:
            crossing = []
            for value in self.crossing(stop):
                self._check_crossing(value, stop)
                made = lookup(value)
                crossing.append(
                    graph.call_function(_as_tensor, (made,)) if _is_size(value) else made
                )
            graph.output(tuple(crossing))
        graph.lint()
        return graph

    def _check_crossing(self, value: fx.Node, segment: int) -> None:
        kind = value.meta.get("val")
        if value.op == "placeholder" or isinstance(kind, (torch.Tensor, torch.SymInt, int)):
            return
        raise ValueError(
            f"{value.name} (a {type(kind).__name__}) would cross the cut before "
            f"{self.names[segment]!r}; only tensors and sizes can, so cut elsewhere"
        )


def _is_size(node: fx.Node) -> bool:
    return isinstance(node.meta.get("val"), (torch.SymInt, int)) and node.op != "placeholder"


def _blocks(model: nn.Module) -> list[str]:
    """The children of the model's outermost lists of modules, else its children."""
    lists = [
        name
        for name, module in model.named_modules()
        if isinstance(module, (nn.ModuleList, nn.Sequential)) and name
    ]
    outermost = [n for n in lists if not any(n.startswith(o + ".") for o in lists if o != n)]
    blocks = [f"{name}.{child}" for name in outermost for child, _ in _children(model, name)]
    return blocks or [name for name, _ in model.named_children()]


def _children(model: nn.Module, path: str) -> list[tuple[str, nn.Module]]:
    return list(operator.attrgetter(path)(model).named_children())
