"""The graph front-end: a captured model cut into segments, and stages built from them.

The captured graph's operations are in execution order. Cuts may fall before each block
of the model's outermost ``nn.ModuleList`` or ``nn.Sequential`` (``transformer.h.3``,
``model.layers.7``) and after the last one, or, for a model without one, before each of
its top-level children; the operations between two cuts are a *segment*, and a stage is a
range of segments. ``split_points`` name the cuts instead, each segment then a stage.

What crosses a cut is every value made before it and used after it: the hidden state,
and also skip connections, masks, rotary tables, position ids and labels, which a stage
hands on to the next until the last one using them. A size (a symbolic int of the
captured graph) crosses as a one-element tensor. A parameter used on both sides of a cut
(tied embeddings) is held by every stage using it, under the name each uses.
"""

from __future__ import annotations

import copy
import operator
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import fx, nn

from pipetrain.model.capture import Captured, Inputs, capture, flatten_inputs

_aten = torch.ops.aten
# export's region of a `with torch.autocast(device_type, ...)`; its first argument is the type
_WRAP_WITH_AUTOCAST = getattr(torch.ops.higher_order, "wrap_with_autocast", None)
# operations whose behaviour follows train/eval mode, and the index of their flag
_MODE_FLAGS = {
    _aten.dropout.default: 2,
    _aten.feature_dropout.default: 2,
    _aten.alpha_dropout.default: 2,
    _aten.batch_norm.default: 5,
    _aten._native_batch_norm_legit.default: 5,
    _aten.instance_norm.default: 5,
}


def _as_size(tensor: torch.Tensor) -> int:
    return int(tensor.item())


def _as_tensor(size: int) -> torch.Tensor:
    return torch.tensor(size, dtype=torch.int64)


class GraphStage(nn.Module):
    """A range of a captured model's operations, run as one stage.

    It holds the parameters and buffers its operations use, under the full model's names
    (shared with the model, not copied). ``forward(*tensors)`` takes the values crossing
    its first cut and returns a tuple: those crossing its last cut, or the model's outputs
    flattened (:meth:`GraphModel.outputs` nests them again). In eval mode, dropout and
    batch normalization run as the model's eval mode would.
    """

    def __init__(
        self, root: nn.Module, graph: fx.Graph, evaluation: fx.Graph, model: nn.Module
    ) -> None:
        """Adopt ``root``'s attributes that ``graph`` reads and compile both graphs;
        ``model`` is the captured model."""
        super().__init__()
        training = fx.GraphModule(root, graph)
        for name, child in training.named_children():
            self.add_module(name, child)
        for name, parameter in training.named_parameters(recurse=False):
            self.register_parameter(name, parameter)
        for name, buffer in training.named_buffers(recurse=False):
            self.register_buffer(name, buffer)
        for name, _ in self.named_buffers():
            path, _, leaf = name.rpartition(".")
            if leaf in root.get_submodule(path)._non_persistent_buffers_set:
                self.get_submodule(path)._non_persistent_buffers_set.add(leaf)
        self._take_module_types(model)
        self._add_aliases(model)
        # the generated code reads attributes of its ``self``; run with this module as
        # ``self`` so that functional_call's swapped weights are the ones used
        self._code: Callable[..., Any] = type(training).forward
        self._eval_code: Callable[..., Any] = type(fx.GraphModule(root, evaluation)).forward
        self.code = training.code

    def _take_module_types(self, model: nn.Module) -> None:
        """Give each container holding tensors its module's class and settings in the
        model, so that the module's own reset methods can initialize a stage built on the
        meta device (the container keeps only the tensors this stage uses)."""
        for path, container in list(self.named_modules()):
            if not path or not (container._parameters or container._buffers):
                continue
            try:
                original = model.get_submodule(path)
            except AttributeError:
                continue
            shell = copy.copy(original)
            # the original's unset tensors (a Linear's bias=None) stay unset, not missing
            shell._parameters = {**_unset(original._parameters), **container._parameters}
            shell._buffers = {**_unset(original._buffers), **container._buffers}
            shell._non_persistent_buffers_set = set(container._non_persistent_buffers_set)
            shell._modules = dict(container._modules)
            parent, _, name = path.rpartition(".")
            self.get_submodule(parent).add_module(name, shell)

    def _add_aliases(self, model: nn.Module) -> None:
        """Hold each tied parameter under every name it has in the model (the graph reads
        it under one), so state dicts and weight files use any of them."""
        mine = {id(p) for p in self.parameters()}
        held = dict(self.named_parameters(remove_duplicate=False))
        for name, parameter in model.named_parameters(remove_duplicate=False):
            if id(parameter) in mine and name not in held:
                path, _, leaf = name.rpartition(".")
                owner: nn.Module = self
                for part in path.split(".") if path else []:
                    if part not in owner._modules:
                        owner.add_module(part, nn.Module())
                    owner = owner._modules[part]  # type: ignore[assignment]
                owner.register_parameter(leaf, parameter)

    def forward(self, *inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Run the stage's operations on the values crossing its first cut."""
        run = self._code if self.training else self._eval_code
        outputs: tuple[torch.Tensor, ...] = run(self, *inputs)
        return outputs


class GraphModel:
    """A model captured as a graph and cut into segments (see the module's docstring).

    ``layers`` are the segments as ``(name, module)`` pairs, runnable in order;
    :meth:`stage` builds the module of a segment range.
    """

    def __init__(
        self,
        model: nn.Module,
        example_inputs: Inputs,
        split_points: Sequence[str] | None = None,
    ) -> None:
        """Capture ``model`` on ``example_inputs`` and find its cuts."""
        self.model = model
        self.captured: Captured = capture(model, example_inputs)
        graph = self.captured.module.graph
        self._order = [
            n for n in graph.nodes if n.op in ("call_function", "call_module", "call_method")
        ]
        self._position = {node: index for index, node in enumerate(self._order)}
        self._inputs = [
            n for n in graph.nodes if n.op == "placeholder" and n not in self.captured.constants
        ]
        (output_node,) = [n for n in graph.nodes if n.op == "output"]
        self._outputs = list(output_node.args[0])
        self._output_node = output_node
        if split_points is not None:
            names, cuts = self._named_cuts(model, list(split_points))
        else:
            names, cuts = self._block_cuts(model)
        self.names, self._cuts = names, [*cuts, len(self._order)]
        self.split = split_points is not None
        self.layers = [(name, self.stage(i, i + 1)) for i, name in enumerate(names)]

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
    def _crossing(self, segment: int) -> list[fx.Node]:
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

    def _graph(
        self, start: int, stop: int, evaluation: bool, device: torch.device | None
    ) -> fx.Graph:
        graph = fx.Graph()
        env: dict[fx.Node, Any] = dict(self.captured.constants)
        for value in self._crossing(start):
            placeholder = graph.placeholder(value.name)
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
            if evaluation and _counts_batches(node):
                env[node] = lookup(node.args[0])  # eval-mode batch norm counts nothing
                continue
            env[node] = copied = graph.node_copy(node, lookup)
            if device is not None:  # devices fixed at capture become the stage's
                _place(copied, device)
            flag = _MODE_FLAGS.get(node.target)
            if evaluation and flag is not None and len(copied.args) > flag:
                copied.args = (*copied.args[:flag], False, *copied.args[flag + 1 :])
        if stop == len(self.names):
            graph.output(tuple(fx.map_arg(self._outputs, lookup)))
        else:
            crossing = []
            for value in self._crossing(stop):
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

    # what callers use -------------------------------------------------------------------
    def stage(self, start: int, stop: int, device: torch.device | None = None) -> GraphStage:
        """The module running segments ``start`` to ``stop - 1``; the devices its
        operations name (where tensors are made) are ``device``'s, when given."""
        if not 0 <= start < stop <= len(self.names):
            raise ValueError(f"segment range [{start}, {stop}) is outside 0..{len(self.names)}")
        root = self.captured.module
        training, evaluation = (self._graph(start, stop, mode, device) for mode in (False, True))
        stage = GraphStage(root, training, evaluation, self.model)
        if device is not None:  # a higher-order operation's own graph names devices too
            _place_graphs_within(stage, device)
        return stage

    def crossing(self, segment: int) -> list[str]:
        """The names of the values crossing the cut before ``segment``."""
        return [value.name for value in self._crossing(segment)]

    def parameter_sizes(self) -> list[float] | None:
        """Each segment's parameter count (plus one, so that an empty segment weighs
        something), for a default cut balanced by parameters; ``None`` at split points,
        which give one segment per stage."""
        if self.split:
            return None
        return [float(sum(p.numel() for p in module.parameters()) + 1) for _, module in self.layers]

    def inputs(self, inputs: Inputs) -> tuple[torch.Tensor, ...]:
        """A step's inputs as the tensors the first stage takes."""
        return flatten_inputs(self.captured, inputs)

    def outputs(self, tensors: Sequence[torch.Tensor]) -> Any:
        """The last stage's flat outputs nested as the model returns them."""
        return torch.utils._pytree.tree_unflatten(list(tensors), self.captured.output_spec)


def _place(node: fx.Node, device: torch.device) -> None:
    """Make every device ``node`` names (where it makes tensors, what it asserts of
    them, the device type of an autocast region) ``device``'s."""
    node.args = _on_device(node.args, device)
    node.kwargs = _on_device(node.kwargs, device)
    if node.target is _WRAP_WITH_AUTOCAST and node.args:
        node.args = (device.type, *node.args[1:])


def _module_on_device(module: fx.GraphModule, device: torch.device) -> fx.GraphModule:
    """A copy of a higher-order operation's graph module with its devices ``device``'s."""
    graph = fx.Graph()
    graph.output(graph.graph_copy(module.graph, {}))
    for node in graph.nodes:
        _place(node, device)
    placed = fx.GraphModule(module, graph)
    _place_graphs_within(placed, device)
    return placed


def _place_graphs_within(module: nn.Module, device: torch.device) -> None:
    """Replace each graph module among ``module``'s children by a copy on ``device``."""
    for name, child in list(module.named_children()):
        if isinstance(child, fx.GraphModule):
            module.add_module(name, _module_on_device(child, device))


def _on_device(value: Any, device: torch.device) -> Any:
    """``value`` with every device in it replaced by ``device``."""
    if isinstance(value, torch.device):
        return device
    if isinstance(value, (tuple, list)):
        return type(value)(_on_device(v, device) for v in value)
    if isinstance(value, dict):
        return {k: _on_device(v, device) for k, v in value.items()}
    return value


def _unset(tensors: dict[str, Any]) -> dict[str, Any]:
    return {name: None for name, tensor in tensors.items() if tensor is None}


def _counts_batches(node: fx.Node) -> bool:
    """Batch norm's in-place count of the batches it has seen (training mode only)."""
    counter = node.args[0] if node.args else None
    return (
        node.target is _aten.add_.Tensor
        and isinstance(counter, fx.Node)
        and counter.op == "get_attr"
        and str(counter.target).endswith("num_batches_tracked")
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
