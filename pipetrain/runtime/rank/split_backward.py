"""A backward split in two, input gradients first and weight gradients later, with no
gradient computed twice.

:func:`input_pass` differentiates a stage's outputs with respect to its inputs only. A
weight's gradient branches off that path at some autograd node on it (a linear layer's
matmul, a layer norm): the input pass keeps the gradient arriving at each such node, and
the :class:`WeightPass` later runs only those nodes' weight branches from what was kept.
Differentiating the outputs again with respect to the weights would instead recompute
every activation gradient between the outputs and the weights: on a transformer block that
is most of its backward.

Weights whose nodes share a branch point are differentiated together; those reached from
two branch points of which one lies below the other (a weight used twice on the path) get
each branch point's kept gradient as it is, so the lower one is not counted twice. Outputs
from which no input can be reached (a stage whose inputs need no gradient, a weight-only
output) are differentiated whole by the weight pass.
"""

from __future__ import annotations

from collections import defaultdict, deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

import torch
from torch.autograd.graph import GradientEdge, Node, get_gradient_edge

Tensors = tuple[torch.Tensor, ...]
Kept = tuple[torch.Tensor | None, ...]


@dataclass
class _Group:
    """Weights whose gradients leave the input path at the same branch points."""

    weights: list[torch.Tensor]
    nodes: list[Node]
    kept: dict[Node, Kept] = field(default_factory=dict)

    def run(self) -> None:
        edges: list[GradientEdge] = []
        grads: list[torch.Tensor] = []
        for node in self.nodes:
            for index, grad in enumerate(self.kept.get(node, ())):
                if grad is not None:
                    edges.append(GradientEdge(node, index))
                    grads.append(grad)
        if not edges:
            return
        # a branch point below another would also get the upper one's share: pin it
        handles = (
            [node.register_prehook(_returning(self.kept.get(node))) for node in self.nodes]
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

    groups: list[_Group]
    whole: tuple[Tensors, Tensors]  # outputs no input is reached from, and their gradients
    weights: list[torch.Tensor]

    def run(self) -> None:
        """Accumulate the weight gradients into the weights' ``.grad``."""
        for group in self.groups:
            group.run()
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
    groups = _groups(weights, parents, on_input_path)
    whole = tuple((t, g) for t, g, node in zip(outputs, grads, roots) if node not in on_input_path)
    handles = [
        node.register_prehook(_keeping(group.kept, node))
        for group in groups
        for node in group.nodes
    ]
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
    return input_grads, WeightPass(groups, kept_outputs, weights)


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
