"""Turn a model into an ordered list of layers and build stage modules from layer ranges.

A model is pipelined as a sequence of layers: an ``nn.Sequential``, a list of modules, or any
module that names its own blocks with a ``pipeline_layers()`` method. A stage is a contiguous
range of those layers; :class:`StageModule` runs it and keeps the full model's parameter
names, so a stage's ``state_dict()`` keys match the unpipelined model's.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator, Sequence
from numbers import Integral

from torch import Tensor, nn

from pipetrain.units import abbreviated

Layer = tuple[str, nn.Module]
"""One layer: its name in the full model and the module."""

StageOutput = Tensor | tuple[Tensor, ...]
"""What a layer (and so a stage) returns: a tensor or a tuple of tensors."""

_ACCEPTED_MODELS = (
    "an nn.Sequential, an nn.ModuleList, a list or tuple of nn.Module, or a module that "
    "defines pipeline_layers() returning [(name, module), ...]"
)


def to_layers(model: nn.Module | Sequence[nn.Module]) -> list[Layer]:
    """Return the model's layers in execution order as ``(name, module)`` pairs.

    Names are the layers' names in the full model: ``"0"``, ``"1"``, ... for a sequence,
    the keys of an ``nn.Sequential`` built from an ``OrderedDict``, or whatever a
    ``pipeline_layers()`` method returns (names may contain dots, such as ``"blocks.0"``).
    """
    pipeline_layers = getattr(model, "pipeline_layers", None)
    if isinstance(model, nn.Module) and callable(pipeline_layers):
        layers = _checked_pairs(pipeline_layers(), type(model).__name__)
    elif isinstance(model, (nn.Sequential, nn.ModuleList)):
        layers = list(model.named_children())
    elif isinstance(model, (list, tuple)):
        layers = [(str(index), module) for index, module in enumerate(model)]
    else:
        raise TypeError(
            f"cannot split a {type(model).__name__} into pipeline layers; pass {_ACCEPTED_MODELS}. "
            "Wrap the model's blocks in nn.Sequential(...) or add a pipeline_layers() method."
        )
    for name, module in layers:
        if not isinstance(module, nn.Module):
            raise TypeError(
                f"layer {name!r} is a {type(module).__name__}, not an nn.Module; "
                "every pipeline layer must be an nn.Module"
            )
    if not layers:
        raise ValueError(f"the {type(model).__name__} has no layers; a pipeline needs at least one")
    _check_unique_names(layers)
    return layers


def _checked_pairs(pairs: object, model_type: str) -> list[Layer]:
    """Validate what a ``pipeline_layers()`` method returned."""
    if not isinstance(pairs, (list, tuple)):
        raise TypeError(
            f"{model_type}.pipeline_layers() returned a {type(pairs).__name__}; "
            "it must return a list of (name, module) pairs"
        )
    layers = []
    for index, pair in enumerate(pairs):
        if not (isinstance(pair, tuple) and len(pair) == 2 and isinstance(pair[0], str)):
            raise TypeError(
                f"{model_type}.pipeline_layers() entry {index} is {pair!r}; "
                "each entry must be a (name: str, module: nn.Module) pair"
            )
        layers.append(pair)
    return layers


def _check_unique_names(layers: Sequence[Layer]) -> None:
    """Reject empty or repeated layer names, which would make parameter names ambiguous."""
    seen: set[str] = set()
    for name, _ in layers:
        if not name or "" in name.split("."):
            raise ValueError(f"layer name {name!r} is not a valid module path such as 'blocks.0'")
        if name in seen:
            raise ValueError(f"layer name {name!r} appears twice; layer names must be unique")
        seen.add(name)


def check_balance(balance: Sequence[int], num_layers: int) -> list[int]:
    """Check a balance (layers per stage) against the model's layer count; return it as a list."""
    checked = _positive_ints(balance)
    total = sum(checked)
    if total != num_layers:
        raise ValueError(
            f"balance {abbreviated(checked)} sums to {total} but the model has {num_layers} "
            "layers; "
            f"give layer counts per stage that add up to {num_layers}"
        )
    return checked


def stage_bounds(balance: Sequence[int]) -> list[tuple[int, int]]:
    """Return each stage's layer range ``(start, stop)`` for a balance, in stage order."""
    bounds = []
    start = 0
    for count in _positive_ints(balance):
        bounds.append((start, start + count))
        start += count
    return bounds


def _positive_ints(balance: Sequence[int]) -> list[int]:
    """Check that a balance is a non-empty sequence of integers >= 1."""
    if isinstance(balance, (str, bytes)) or not isinstance(balance, Sequence):
        raise TypeError(f"balance {balance!r} must be a sequence of layer counts, e.g. [3, 5]")
    if len(balance) == 0:
        raise ValueError("balance is empty; give at least one stage's layer count, e.g. [3, 5]")
    for index, count in enumerate(balance):
        if isinstance(count, bool) or not isinstance(count, Integral) or count < 1:
            raise ValueError(
                f"balance entry {count!r} at index {index} is not a positive integer; "
                "every stage needs at least one layer"
            )
    return [int(count) for count in balance]


class StageModule(nn.Module):
    """Runs a contiguous range of the model's layers in order, under the full model's names.

    Layers are registered under their full-model names (``"2"``, or ``"blocks.0"`` nested
    as ``blocks`` -> ``0``), so ``named_parameters()``, ``state_dict()`` and
    ``load_state_dict()`` use the same keys as the unpipelined model. The modules are
    shared with the model, not copied.
    """

    def __init__(self, layers: Sequence[Layer]) -> None:
        """Register ``layers`` (``(name, module)`` pairs, in execution order)."""
        super().__init__()
        if len(layers) == 0:
            raise ValueError("a stage needs at least one layer")
        _check_unique_names(layers)
        self._layer_list: list[Layer] = list(layers)
        self._containers: set[str] = set()
        for name, module in layers:
            self._register_layer(name, module)

    def _register_layer(self, name: str, module: nn.Module) -> None:
        """Register ``module`` at the dotted path ``name``, creating empty parent containers."""
        *parents, leaf = name.split(".")
        owner: nn.Module = self
        path = ""
        for part in parents:
            path = f"{path}.{part}" if path else part
            child = owner._modules.get(part)
            if child is None:
                child = nn.Module()
                owner.add_module(part, child)
                self._containers.add(path)
            elif path not in self._containers:
                raise ValueError(
                    f"layer {name!r} would be nested inside layer {path!r}; "
                    "a layer name must not be a prefix of another layer's name"
                )
            owner = child
        if leaf in owner._modules:
            raise ValueError(
                f"layer {name!r} clashes with the container of another layer; "
                "a layer name must not be a prefix of another layer's name"
            )
        owner.add_module(leaf, module)

    @property
    def layer_names(self) -> list[str]:
        """The stage's layer names in the full model, in execution order."""
        return [name for name, _ in self._layer_list]

    @property
    def layers(self) -> list[Layer]:
        """The stage's ``(name, module)`` pairs, in execution order."""
        return list(self._layer_list)

    def forward(self, *inputs: Tensor) -> StageOutput:
        """Run the layers in order and return the last layer's output."""
        return deque(self._outputs(inputs), maxlen=1)[0]

    def forward_layers(self, *inputs: Tensor) -> list[StageOutput]:
        """Run the layers in order and return every layer's output.

        A layer that returns a tuple (or list) of tensors feeds the next layer with it
        unpacked, ``layer(*outputs)``; lists are returned as tuples.
        """
        return list(self._outputs(inputs))

    def _outputs(self, inputs: tuple[Tensor, ...]) -> Iterator[StageOutput]:
        """Each layer's output in turn, each fed to the next layer (unpacked if a tuple)."""
        arguments = inputs
        for name, module in self._layer_list:
            output = _checked_output(name, module(*arguments))
            yield output
            arguments = output if isinstance(output, tuple) else (output,)


def _checked_output(name: str, output: object) -> StageOutput:
    """Return a layer's output as a tensor or tuple of tensors, or raise naming the layer."""
    if isinstance(output, Tensor):
        return output
    if isinstance(output, (tuple, list)) and all(isinstance(item, Tensor) for item in output):
        return tuple(output)
    if isinstance(output, (tuple, list)):
        kinds = ", ".join(type(item).__name__ for item in output)
        description = f"a {type(output).__name__} of ({kinds})"
    else:
        description = f"a {type(output).__name__}"
    raise TypeError(
        f"layer {name!r} returned {description}; a pipeline layer must return a Tensor "
        "or a tuple of Tensors (move other values into tensors or out of the layer)"
    )


def build_stage(model: nn.Module | Sequence[nn.Module], start: int, stop: int) -> StageModule:
    """The stage running layers ``start`` to ``stop - 1`` of ``model`` (modules are shared)."""
    layers = to_layers(model)
    if not (0 <= start < stop <= len(layers)):
        raise ValueError(
            f"layer range [{start}, {stop}) is not a non-empty range within the model's "
            f"{len(layers)} layers; use 0 <= start < stop <= {len(layers)}"
        )
    return StageModule(layers[start:stop])


__all__ = [
    "Layer",
    "StageModule",
    "StageOutput",
    "build_stage",
    "check_balance",
    "stage_bounds",
    "to_layers",
]
