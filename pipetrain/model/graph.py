"""The graph front-end: a captured model cut into segments, and stages built from them.

A model is captured in training mode (:mod:`~pipetrain.model.capture`) and cut into
segments (:mod:`~pipetrain.model.segments`); a stage is a range of segments. Its eval mode
runs a second capture, of the model's eval mode, made on first use and cut at the same
places, on the stage's own tensors: dropout (SDPA's attention dropout included), batch
normalization, routers and code branching on ``self.training`` run as ``model.eval()``
runs them. A parameter used on both sides of a cut (tied embeddings) is held by every
stage using it, under the name each uses.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import fx, nn

from pipetrain.model.capture import Captured, Inputs, capture, flatten_inputs
from pipetrain.model.segments import Segments

# export's region of a `with torch.autocast(device_type, ...)`; its first argument is the type
_WRAP_WITH_AUTOCAST = getattr(torch.ops.higher_order, "wrap_with_autocast", None)


class GraphStage(nn.Module):
    """A range of a captured model's operations, run as one stage.

    It holds the parameters and buffers its operations use, under the full model's names
    (shared with the model, not copied). ``forward(*tensors)`` takes the values crossing
    its first cut and returns a tuple: those crossing its last cut, or the model's outputs
    flattened (:meth:`GraphModel.outputs` nests them again). In eval mode it runs the
    model's eval-mode graph of the same range on its own tensors. A first stage refuses
    inputs that break a condition on shapes the capture recorded.
    """

    def __init__(
        self,
        root: nn.Module,
        graph: fx.Graph,
        model: nn.Module,
        guards: Callable[[Sequence[torch.Tensor]], None] | None = None,
        evaluation: Callable[[], tuple[tuple[str, ...], Callable[[], GraphStage]]] | None = None,
    ) -> None:
        """Adopt ``root``'s attributes that ``graph`` reads and compile it; ``model`` is
        the captured model, ``guards`` checks a first stage's inputs, ``evaluation`` names
        the inputs evaluation runs on now and builds the eval-mode stage of the same range
        for them (``None``: this is one)."""
        super().__init__()
        compiled = fx.GraphModule(root, graph)
        for name, child in compiled.named_children():
            self.add_module(name, child)
        for name, parameter in compiled.named_parameters(recurse=False):
            self.register_parameter(name, parameter)
        for name, buffer in compiled.named_buffers(recurse=False):
            self.register_buffer(name, buffer)
        # fx adopts export's lifted constants as buffers: they are no state of the model,
        # so they stay out of state dicts (and of the eval stage's borrowed tensors)
        self._constants: set[str] = set()
        for name, _ in self.named_buffers():
            path, _, leaf = name.rpartition(".")
            held = root.get_submodule(path)
            if leaf not in held._buffers:
                self._constants.add(name)
            if leaf not in held._buffers or leaf in held._non_persistent_buffers_set:
                self.get_submodule(path)._non_persistent_buffers_set.add(leaf)
        self._take_module_types(model)
        self._add_aliases(model)
        # the generated code reads attributes of its ``self``; run with this module as
        # ``self`` so that functional_call's swapped weights are the ones used
        self._code: Callable[..., Any] = type(compiled).forward
        self.code, self._graph = compiled.code, compiled.graph
        self._rewrites: list[Callable[[fx.Graph, GraphStage], None]] = []
        self._guards = guards
        self._evaluation = evaluation
        # the eval-mode stages made, by the inputs they take (a dict: no submodules)
        self._built: dict[tuple[str, ...], tuple[GraphStage, set[str]]] = {}

    def _take_module_types(self, model: nn.Module) -> None:
        """Give each container holding tensors its module's class and settings in the
        model, so that the module's own reset methods and a model's initializer can set a
        stage built on the meta device (the container keeps the tensors this stage uses,
        and the module's non-persistent buffers, which initializers read and set too)."""
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
            transient = original._non_persistent_buffers_set
            kept = {k: v for k, v in original._buffers.items() if k in transient}
            shell._buffers = {**_unset(original._buffers), **kept, **container._buffers}
            shell._non_persistent_buffers_set = set(container._non_persistent_buffers_set)
            shell._non_persistent_buffers_set.update(k for k in kept if kept[k] is not None)
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

    def rewrite(self, transform: Callable[[fx.Graph, GraphStage], None]) -> None:
        """Run the graph ``transform`` makes of a copy of this stage's (given this stage, to
        add the modules it calls) from now on, and that of each eval-mode stage it builds."""
        graph = fx.Graph()
        graph.output(graph.graph_copy(self._graph, {}))
        transform(graph, self)
        compiled = fx.GraphModule(self, graph)
        self._code, self.code, self._graph = type(compiled).forward, compiled.code, graph
        self._rewrites.append(transform)
        for stage, _ in self._built.values():
            stage.rewrite(transform)

    def _tensors(self) -> dict[str, torch.Tensor]:
        """Every name of this stage's parameters and buffers, with the tensor it holds now
        (a weight version's, inside functional_call)."""
        tensors: dict[str, torch.Tensor] = dict(self.named_parameters(remove_duplicate=False))
        tensors.update(
            (name, buffer)
            for name, buffer in self.named_buffers(remove_duplicate=False)
            if name not in self._constants
        )
        return tensors

    def _evaluation_stage(self) -> tuple[GraphStage, set[str]]:
        """The eval-mode stage for the inputs evaluated now, made on first use and pointed
        at this stage's tensors, and the names of those it reads."""
        assert self._evaluation is not None
        names, build = self._evaluation()
        if names not in self._built:
            stage = build()
            mine, reads = self._tensors(), set(stage._tensors())
            for name in reads:
                if name not in mine:
                    raise ValueError(
                        f"the model's eval mode reads {name!r}, which its training graph "
                        "does not use here, so this stage does not hold it; evaluate the "
                        "unpipelined model, or cut the model elsewhere"
                    )
                path, _, leaf = name.rpartition(".")
                owner = stage.get_submodule(path)
                if leaf in owner._parameters:
                    owner._parameters[leaf] = mine[name]  # type: ignore[assignment]
                else:
                    owner._buffers[leaf] = mine[name]
            if mine:  # its constants go where this stage's tensors are
                stage.to(next(iter(mine.values())).device)
            for transform in self._rewrites:
                stage.rewrite(transform)
            self._built[names] = stage, reads
        return self._built[names]

    def forward(self, *inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Run the stage's operations on the values crossing its first cut."""
        if not self.training and self._evaluation is not None:
            stage, reads = self._evaluation_stage()
            tensors = {name: t for name, t in self._tensors().items() if name in reads}
            evaluated: tuple[torch.Tensor, ...] = torch.func.functional_call(stage, tensors, inputs)
            return evaluated
        if self._guards is not None:
            self._guards(inputs)
        outputs: tuple[torch.Tensor, ...] = self._code(self, *inputs)
        return outputs


class GraphModel:
    """A model captured as a graph and cut into segments (see the module's docstring).

    ``layers`` are the segments as ``(name, module)`` pairs, runnable in order;
    :meth:`stage` builds the module of a segment range. ``model`` is captured in
    training mode whatever mode it is in; the eval-mode capture is made on first use.
    """

    def __init__(
        self,
        model: nn.Module,
        example_inputs: Inputs,
        split_points: Sequence[str] | None = None,
        *,
        captured: Captured | None = None,
    ) -> None:
        """Capture ``model`` on ``example_inputs`` (or take its training-mode capture
        ``captured``) and find its cuts."""
        self.model, self.example_inputs = model, example_inputs
        self.captured: Captured = captured or capture(model, example_inputs)
        self.split_points = None if split_points is None else list(split_points)
        self.segments = Segments(self.captured, model, self.split_points)
        self.names = self.segments.names
        self.split = split_points is not None
        self._evaluation: dict[tuple[str, ...], Segments] = {}
        self.evaluated: tuple[str, ...] = tuple(self.captured.input_names)
        """The tensor inputs evaluation runs on now (:meth:`evaluation_inputs` sets them)."""
        self.layers = [(name, self.stage(i, i + 1)) for i, name in enumerate(self.names)]

    def cut_at(self, split_points: Sequence[str]) -> GraphModel:
        """The same capture cut at ``split_points`` instead (no new capture)."""
        return GraphModel(self.model, self.example_inputs, split_points, captured=self.captured)

    def evaluation(self, names: tuple[str, ...]) -> Segments:
        """The model's eval-mode capture on the tensor inputs ``names`` (of a keyword
        model, some of those captured: labels left out), cut at the same places; made on
        first use."""
        if names not in self._evaluation:
            sample = self.example_inputs
            if isinstance(sample, Mapping) and names != tuple(self.captured.input_names):
                tensors = {k for k, v in sample.items() if isinstance(v, torch.Tensor)}
                sample = {k: v for k, v in sample.items() if k in names or k not in tensors}
            captured = capture(self.model, sample, training=False)
            segments = Segments(captured, self.model, self.split_points)
            if segments.names != self.names:
                raise ValueError(
                    f"the model's eval mode runs its blocks as {segments.names}, its "
                    f"training mode as {self.names}; evaluate the unpipelined model"
                )
            self._evaluation[names] = segments
        return self._evaluation[names]

    def evaluation_inputs(self, inputs: Inputs) -> tuple[tuple[str, ...], tuple[torch.Tensor, ...]]:
        """The names of the tensor inputs an evaluation is given and the tensors, in the
        order captured: a keyword model's may leave some out (labels, for its logits)."""
        if not self.captured.keyword or not isinstance(inputs, Mapping):
            return tuple(self.captured.input_names), self.inputs(inputs)
        names = tuple(n for n in self.captured.input_names if n in inputs)
        return names, flatten_inputs(self.captured, inputs, names)

    # what callers use -------------------------------------------------------------------
    def stage(self, start: int, stop: int, device: torch.device | None = None) -> GraphStage:
        """The module running segments ``start`` to ``stop - 1``; the devices its
        operations name (where tensors are made) are ``device``'s, when given."""
        if not 0 <= start < stop <= len(self.names):
            raise ValueError(f"segment range [{start}, {stop}) is outside 0..{len(self.names)}")
        return self._stage(self.segments, start, stop, device, evaluation=False)

    def _stage(
        self,
        segments: Segments,
        start: int,
        stop: int,
        device: torch.device | None,
        evaluation: bool,
    ) -> GraphStage:
        place = None if device is None else (lambda node: _place(node, device))
        graph = segments.graph(start, stop, place)
        captured = segments.captured
        guards = captured.check_guards if start == 0 else None
        evaluated = None
        if not evaluation:

            def evaluated() -> tuple[tuple[str, ...], Callable[[], GraphStage]]:
                names = self.evaluated
                return names, lambda: self._stage(
                    self.evaluation(names), start, stop, device, evaluation=True
                )

        stage = GraphStage(captured.module, graph, self.model, guards, evaluated)
        if device is not None:  # a higher-order operation's own graph names devices too
            _place_graphs_within(stage, device)
        return stage

    def crossing(self, segment: int) -> list[str]:
        """The names of the values crossing the cut before ``segment``."""
        return [value.name for value in self.segments.crossing(segment)]

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

    def outputs(self, tensors: Sequence[torch.Tensor], evaluation: bool = False) -> Any:
        """The last stage's flat outputs nested as the model returns them (``evaluation``:
        as its eval mode does on the inputs evaluated)."""
        captured = self.evaluation(self.evaluated).captured if evaluation else self.captured
        return torch.utils._pytree.tree_unflatten(list(tensors), captured.output_spec)


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
