"""Capture any ``nn.Module`` as a graph with :func:`torch.export.export`.

The model is exported once from a sample of its inputs (a tensor, a tuple, or a dict of
keyword inputs such as ``{"input_ids": ..., "attention_mask": ...}``) with every dimension
of every tensor input dynamic, so micro-batches of any size and sequence length run the
same graph. Inputs that are not tensors (``use_cache=False``) are fixed at capture. A
model whose ``forward`` takes ``use_cache`` and was not given it is captured with
``use_cache=False``: a training step has no use for a key/value cache.

A capture is of one mode, training or evaluation, whatever mode the model is in: dropout,
batch normalization and code branching on ``self.training`` take that mode's path. The
conditions on input shapes that export recorded (a branch on ``x.shape[1] > 8`` taken at
the sample's length) are kept: :meth:`Captured.check_guards` refuses inputs that break one.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import fx, nn
from torch.export import Dim
from torch.utils import _pytree as pytree

Inputs = torch.Tensor | Sequence[torch.Tensor] | Mapping[str, Any]
"""A model's inputs: one tensor, positional tensors, or keyword inputs by name."""


@dataclass
class Captured:
    """A captured model: its graph (parameters and buffers are the model's own objects,
    under their full-model names), the names of its tensor inputs in the order a step
    passes them, the constants fixed at capture, how its outputs nest, whether it was
    captured in training mode, and export's check of the conditions on input shapes."""

    module: fx.GraphModule
    input_names: list[str]
    constants: dict[fx.Node, Any]
    output_spec: pytree.TreeSpec
    keyword: bool
    training: bool = True
    guards: Callable[..., None] | None = None

    def check_guards(self, tensors: Sequence[torch.Tensor]) -> None:
        """Raise ValueError naming the condition if the tensor inputs ``tensors`` (in
        :attr:`input_names` order) break one the capture recorded: the graph would run
        the path the sample took, which is not the model's at these shapes."""
        if self.guards is None:
            return
        given = iter(tensors)
        placeholders = [n for n in self.module.graph.nodes if n.op == "placeholder"]
        flat = [self.constants[n] if n in self.constants else next(given) for n in placeholders]
        try:
            self.guards(*flat)
        except AssertionError as error:
            shapes = {
                name: list(t.shape) for name, t in zip(self.input_names, tensors, strict=False)
            }
            raise ValueError(
                f"inputs of shapes {shapes} break a condition the model was captured under "
                f"({error}): the graph holds only the path its sample took. Capture on a "
                "sample of these shapes (example_inputs=...), or keep inputs within the "
                "condition"
            ) from error


def _arguments(example: Inputs) -> tuple[tuple[Any, ...], dict[str, Any]]:
    if isinstance(example, torch.Tensor):
        return (example,), {}
    if isinstance(example, Mapping):
        return (), dict(example)
    if isinstance(example, Sequence) and not isinstance(example, (str, bytes)):
        return tuple(example), {}
    raise TypeError(
        f"example_inputs is a {type(example).__name__}; give a tensor, a tuple of tensors, "
        "or a dict of keyword inputs such as {'input_ids': ids[:2]}"
    )


def _dynamic(value: Any) -> Any:
    """Every dimension of a tensor dynamic; anything else fixed."""
    if isinstance(value, torch.Tensor):
        return dict.fromkeys(range(value.dim()), Dim.AUTO)
    if isinstance(value, (tuple, list)):
        return type(value)(_dynamic(v) for v in value)
    if isinstance(value, Mapping):
        return {k: _dynamic(v) for k, v in value.items()}
    return None


def _name(path: tuple[Any, ...]) -> str:
    """A readable name for an input's pytree path: ``input_ids`` or ``args[0]``."""
    where, *rest = path
    if where == pytree.SequenceKey(1) and len(rest) == 1:
        return str(rest[0].key)
    return ("args" if where == pytree.SequenceKey(0) else "kwargs") + pytree.keystr(tuple(rest))


@contextmanager
def _without_stack_traces(config: Any = torch.fx.config) -> Iterator[None]:
    """Nodes recorded without their stack traces: nothing reads them, and recording them
    took 12-19% of a 32-layer Llama's capture. Torch before 2.13 has no such setting in
    ``config`` and records them."""
    if not hasattr(config, "do_not_emit_stack_traces"):
        yield
        return
    before = config.do_not_emit_stack_traces
    config.do_not_emit_stack_traces = True
    try:
        yield
    finally:
        config.do_not_emit_stack_traces = before


def capture(model: nn.Module, example_inputs: Inputs, training: bool = True) -> Captured:
    """Export ``model`` on ``example_inputs`` (a sample with at least 2 rows) as a graph of
    its training mode (``training=False``: its eval mode); the model's modules are left
    in the modes they were in.

    Raises ValueError for a sample that would fix the batch size, and RuntimeError naming
    the model when export fails.
    """
    # fresh tensors: export guards a view's base (``x._base``), which inputs made
    # otherwise (not slices of a batch) lack
    args, kwargs = pytree.tree_map_only(torch.Tensor, torch.clone, _arguments(example_inputs))
    if "use_cache" in inspect.signature(model.forward).parameters and "use_cache" not in kwargs:
        kwargs["use_cache"] = False
    tensors = [v for v in pytree.tree_leaves((args, kwargs)) if isinstance(v, torch.Tensor)]
    if not tensors:
        raise ValueError("example_inputs holds no tensor; give a sample of the model's inputs")
    for tensor in tensors:
        if tensor.dim() == 0 or tensor.shape[0] < 2:
            raise ValueError(
                f"an example input of shape {list(tensor.shape)} has fewer than 2 rows; give "
                "a sample of at least 2 rows (a batch of 1 would be fixed into the graph)"
            )
    bound = inspect.signature(model.forward).bind(*args, **kwargs).arguments
    dynamic = {name: _dynamic(value) for name, value in bound.items()}
    modes = [(m, m.training) for m in model.modules()]
    model.train(training)
    try:
        with _without_stack_traces():
            exported = torch.export.export(
                model, args, kwargs, dynamic_shapes=dynamic, strict=False
            )
    except Exception as error:  # export's own errors are many and unrelated
        name = type(model).__name__
        raise RuntimeError(
            f"torch.export could not capture the {name}: {error}{_hint(model, error)}"
        ) from error
    finally:
        for module_, mode in modes:
            module_.training = mode
    module = exported.module()
    assert isinstance(module, fx.GraphModule)
    leaves = pytree.tree_flatten_with_path((args, kwargs))[0]
    placeholders = [n for n in module.graph.nodes if n.op == "placeholder"]
    names, constants = [], {}
    for node, (path, value) in zip(placeholders, leaves):
        if isinstance(value, torch.Tensor):
            names.append(_name(path))
        else:
            constants[node] = value
    guards = None
    for node in list(module.graph.nodes):
        if node.op == "call_module" and node.target == "_guards_fn":
            # checked on a first stage's inputs instead (Captured.check_guards)
            guards = module.get_submodule("_guards_fn")
            module.graph.erase_node(node)
    spec = module._out_spec
    assert spec is not None  # an exported module always has one
    return Captured(module, names, constants, spec, not args, training, guards)


def _hint(model: nn.Module, error: Exception) -> str:
    """What to do about an export failure of ``model``."""
    data_dependent = "data-dependent" in str(error) or "GuardOnDataDependent" in repr(error)
    experts = getattr(getattr(model, "config", None), "_experts_implementation", None)
    if data_dependent and experts == "eager" and hasattr(model, "set_experts_implementation"):
        return (
            ". Its mixture-of-experts layers run the eager experts loop, whose sizes depend "
            'on the routing; call model.set_experts_implementation("batched_mm") before '
            "the pipeline (the same computation, which export captures)"
        )
    if data_dependent:
        return (
            ". The model's control flow or sizes depend on tensor values, which one graph "
            "cannot hold; make them independent of the values (torch.cond, masks), or give "
            "the model as a sequence of layers (nn.Sequential or pipeline_layers())"
        )
    return ". Give the model as a sequence of layers instead (nn.Sequential or pipeline_layers())"


def flatten_inputs(
    captured: Captured, inputs: Inputs, names: Sequence[str] | None = None
) -> tuple[torch.Tensor, ...]:
    """A step's inputs as the tuple of tensors the captured graph takes, checked against
    the names captured (of a keyword model, ``names``: those of them expected)."""
    args, kwargs = _arguments(inputs)
    if captured.keyword:
        expected = list(captured.input_names if names is None else names)
        given = {k: v for k, v in kwargs.items() if isinstance(v, torch.Tensor)}
        missing = [n for n in expected if n not in given]
        extra = [n for n in given if n not in expected]
        if missing or extra or args:
            raise ValueError(
                f"the inputs' tensors are {sorted(given)} but the model was captured with "
                f"{captured.input_names}; pass the same keyword inputs as example_inputs"
            )
        return tuple(given[n] for n in expected)
    values = [v for v in pytree.tree_leaves(args) if isinstance(v, torch.Tensor)]
    if len(values) != len(captured.input_names) or kwargs:
        raise ValueError(
            f"the model was captured with {len(captured.input_names)} positional tensor "
            f"inputs; got {len(values)} tensors"
            + (f" and keywords {sorted(kwargs)}" if kwargs else "")
        )
    return tuple(values)
