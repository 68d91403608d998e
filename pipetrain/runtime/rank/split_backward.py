"""A backward split in two, input gradients first and weight gradients later, with no
gradient computed twice.

:func:`input_pass` differentiates a stage's outputs with respect to its inputs only. A
weight's gradient branches off that path at some autograd node on it (a linear layer's
matmul, a layer norm): the input pass keeps the gradient arriving at each such node, and
the :class:`WeightPass` later runs only those nodes' weight branches from what was kept.
Differentiating the outputs again with respect to the weights would instead recompute
every activation gradient between the outputs and the weights: on a transformer block that
is most of its backward.

The weight pass calls every branch node itself, inside one autograd graph task that knows
only the nodes on the weight side, so each node computes its weight outputs and not its
input one; a second engine call then carries those outputs to the weights' ``.grad``. Two
engine calls a pass whatever the number of branch points, and a weight reached from two
branch points (one lying below the other: a weight used twice on the path) gets each
point's share once. Where a branch point is a custom ``autograd.Function`` (which cannot
be called on its own), weights whose nodes share a branch point are differentiated
together instead, one engine call per group. Outputs from which no input can be reached
(a stage whose inputs need no gradient, a weight-only output) are differentiated whole by
the weight pass.
"""

from __future__ import annotations

from collections import defaultdict, deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.autograd.function import BackwardCFunction
from torch.autograd.graph import GradientEdge, Node, _engine_run_backward, get_gradient_edge

Tensors = tuple[torch.Tensor, ...]
Kept = tuple[torch.Tensor | None, ...]
_ACCUMULATE = torch._C._functions.AccumulateGrad  # type: ignore[attr-defined]


@dataclass
class _Branch:
    """A branch point and its outputs that lead to weights (output position, edge)."""

    node: Node
    edges: list[tuple[int, GradientEdge]]


class _CallBranches(torch.autograd.Function):
    """Calls the branch nodes from its backward. That runs inside a graph task whose only
    captures are the weight-side edges, and a node computes an output only where the task
    needs it: the input-path outputs are skipped."""

    @staticmethod
    def forward(
        ctx: Any, anchor: torch.Tensor, calls: list[tuple[_Branch, Kept]], results: list[Any]
    ) -> torch.Tensor:
        ctx.calls, ctx.results = calls, results
        return anchor.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        for branch, kept in ctx.calls:
            outputs = branch.node(*kept)
            ctx.results.extend(outputs[position] for position, _ in branch.edges)
        return grad, None, None


def _run_branches(
    branches: list[_Branch], kept: dict[Node, Kept], weights: list[torch.Tensor]
) -> None:
    """Every branch point's weight outputs from its kept gradient, into ``weights``'
    ``.grad``, in two engine calls."""
    calls = [(branch, kept[branch.node]) for branch in branches if branch.node in kept]
    calls = [(branch, grads) for branch, grads in calls if any(g is not None for g in grads)]
    if not calls:
        return
    edges = [edge for branch, _ in calls for _, edge in branch.edges]
    device = next(g.device for g in calls[0][1] if g is not None)
    anchor = torch.zeros((), device=device, requires_grad=True)
    results: list[torch.Tensor | None] = []
    trigger = _CallBranches.apply(anchor, calls, results)
    captures: tuple[torch.Tensor | GradientEdge, ...] = (anchor, *dict.fromkeys(edges))
    _run_engine((trigger,), (torch.ones_like(trigger),), captures, accumulate=False)
    pairs = [(edge, grad) for edge, grad in zip(edges, results) if grad is not None]
    if pairs:
        # the engine sums what several branch points send one node, in call order, and
        # reduces each gradient to its edge's shape (a bias's, broadcast over rows)
        _run_engine(
            tuple(edge for edge, _ in pairs),
            tuple(grad for _, grad in pairs),
            tuple(weights),
            accumulate=True,
        )


def _run_engine(
    roots: tuple[torch.Tensor | GradientEdge, ...],
    grads: tuple[torch.Tensor, ...],
    inputs: tuple[torch.Tensor | GradientEdge, ...],
    accumulate: bool,
) -> None:
    """One autograd engine call through the function ``torch.autograd.backward`` ends in,
    without its checks of every root against its gradient (20-100 µs a call, measured):
    these gradients come from the graph. The graph is kept: the weight-only outputs'
    backward may pass through the same nodes."""
    _engine_run_backward(
        roots, grads, True, False, inputs, allow_unreachable=True, accumulate_grad=accumulate
    )


@dataclass
class _Group:
    """Weights whose gradients leave the input path at the same branch points."""

    weights: list[torch.Tensor]
    nodes: list[Node]

    def run(self, kept: dict[Node, Kept]) -> None:
        edges: list[GradientEdge] = []
        grads: list[torch.Tensor] = []
        for node in self.nodes:
            for index, grad in enumerate(kept.get(node, ())):
                if grad is not None:
                    edges.append(GradientEdge(node, index))
                    grads.append(grad)
        if not edges:
            return
        # a branch point below another would also get the upper one's share: pin it
        handles = (
            [node.register_prehook(_returning(kept.get(node))) for node in self.nodes]
            if len(self.nodes) > 1
            else []
        )
        try:
            # kept: another group's run may pass through nodes this one runs
            torch.autograd.backward(edges, grads, inputs=self.weights, retain_graph=True)
        finally:
            for handle in handles:
                handle.remove()


@dataclass
class WeightPass:
    """What the weight gradients of one micro-batch need after its input pass."""

    branches: list[_Branch]  # every branch point a node that can be called on its own
    groups: list[_Group]  # otherwise: one engine call per group
    kept: dict[Node, Kept]  # the gradient arriving at each branch point in the input pass
    whole: tuple[Tensors, Tensors]  # outputs no input is reached from, and their gradients
    weights: list[torch.Tensor]

    def run(self) -> None:
        """Accumulate the weight gradients into the weights' ``.grad``."""
        _run_branches(self.branches, self.kept, self.weights)
        for group in self.groups:
            group.run(self.kept)
        outputs, grads = self.whole
        if outputs and self.weights:
            torch.autograd.backward(outputs, grads, inputs=self.weights)


def input_pass(
    outputs: Tensors, grads: Tensors, inputs: Sequence[torch.Tensor], weights: list[torch.Tensor]
) -> tuple[tuple[torch.Tensor | None, ...], WeightPass]:
    """The gradients of ``inputs`` (``None`` where unused) from ``outputs`` and their
    gradients ``grads``, and the pass that later gives ``weights`` theirs."""
    roots = [get_gradient_edge(t).node for t in outputs]
    parents = _parents(roots)
    on_input_path = _reached(
        [get_gradient_edge(t).node for t in inputs], parents, stop=frozenset()
    )[0]
    branches = _branches(weights, parents, on_input_path)
    groups = [] if branches is not None else _groups(weights, parents, on_input_path)
    points = (
        [branch.node for branch in branches]
        if branches is not None
        else [node for group in groups for node in group.nodes]
    )
    whole = tuple((t, g) for t, g, node in zip(outputs, grads, roots) if node not in on_input_path)
    kept: dict[Node, Kept] = {}
    handles = [node.register_prehook(_keeping(kept, node)) for node in points]
    try:
        input_grads = (
            torch.autograd.grad(outputs, inputs, grads, retain_graph=True, allow_unused=True)
            if inputs and len(whole) < len(outputs)
            else tuple(None for _ in inputs)
        )
    finally:
        for handle in handles:
            handle.remove()
    kept_outputs = tuple(t for t, _ in whole), tuple(g for _, g in whole)
    return input_grads, WeightPass(branches or [], groups, kept, kept_outputs, weights)


def _parents(roots: Iterable[Node]) -> dict[Node, list[Node]]:
    """Every node of the graph below ``roots`` with the nodes whose gradients flow into it."""
    parents: dict[Node, list[Node]] = defaultdict(list)
    queue = deque(dict.fromkeys(roots))
    seen = set(queue)
    while queue:
        node = queue.popleft()
        for child, _ in node.next_functions:
            if child is None:
                continue
            parents[child].append(node)
            if child not in seen:
                seen.add(child)
                queue.append(child)
    return parents


def _reached(
    starts: Iterable[Node], parents: dict[Node, list[Node]], stop: frozenset[Node]
) -> tuple[set[Node], set[Node]]:
    """The nodes whose gradients flow into ``starts``, directly or not, not going past
    ``stop``; and the nodes of ``stop`` met."""
    reached = set(starts)
    met: set[Node] = set()
    queue = deque(reached)
    while queue:
        for parent in parents.get(queue.popleft(), ()):
            if parent in stop:
                met.add(parent)
            elif parent not in reached:
                reached.add(parent)
                queue.append(parent)
    return reached, met


def _branches(
    weights: list[torch.Tensor], parents: dict[Node, list[Node]], on_input_path: set[Node]
) -> list[_Branch] | None:
    """The input-path nodes the weights' gradients branch off at, in the engine's order
    (later-made nodes first), each with its outputs that lead to weights; ``None`` where
    one is a custom function's node, which cannot be called on its own."""
    wanted = {id(w) for w in weights if w.requires_grad}
    # the graph's own accumulators, not get_gradient_edge's: it runs an operation a weight
    accumulators = [
        node
        for node in parents
        if type(node) is _ACCUMULATE and id(node.variable) in wanted  # type: ignore[attr-defined]
    ]
    weight_side, met = _reached(accumulators, parents, frozenset(on_input_path))
    if any(isinstance(node, BackwardCFunction) for node in met):
        return None
    return [
        _Branch(node, [
            (position, GradientEdge(child, index))
            for position, (child, index) in enumerate(node.next_functions)
            if child in weight_side
        ])
        for node in sorted(met, key=lambda node: -node._sequence_nr())
    ]  # fmt: skip


def _groups(
    weights: list[torch.Tensor], parents: dict[Node, list[Node]], on_input_path: set[Node]
) -> list[_Group]:
    """The weights grouped by the input-path nodes their gradients branch off at (weights
    sharing one such node in one group)."""
    stop = frozenset(on_input_path)
    owner: dict[Node, _Group] = {}
    for weight in weights:
        if not weight.requires_grad:
            continue
        accumulator = get_gradient_edge(weight).node
        met = _reached([accumulator], parents, stop)[1] if accumulator in parents else set()
        if not met:
            continue  # unused, or reached only from outputs the weight pass takes whole
        joined = {id(owner[node]): owner[node] for node in met if node in owner}
        group = _Group([weight], list(met))
        for other in joined.values():
            group.weights.extend(other.weights)
            group.nodes.extend(n for n in other.nodes if n not in met)
        for node in group.nodes:
            owner[node] = group
    return list({id(g): g for g in owner.values()}.values())


def _keeping(kept: dict[Node, Kept], node: Node) -> Callable[[Kept], None]:
    def hook(grad_outputs: Kept) -> None:
        kept[node] = grad_outputs

    return hook


def _returning(kept: Kept | None) -> Callable[[Kept], Kept]:
    def hook(grad_outputs: Kept) -> Kept:
        return kept if kept is not None else grad_outputs

    return hook
