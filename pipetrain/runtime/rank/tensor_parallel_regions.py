"""The regions of a captured stage's graph that tensor parallelism splits: :class:`GraphPass`.

A region runs from a colwise linear layer to the rowwise one closing it; in between each
mirror holds a part of every value. The pass rewrites each planned layer to read its
parameters' parts (``to_local()``, whose backward gives the DTensor gradient), calls the
two operators around the region (:data:`COPY` before a colwise layer's input, once per
input; :data:`REDUCE` after a rowwise layer, its bias added after the sum), and follows
which dimension of each value is split through the region's operations (pointwise ones,
views and reshapes, transposes, permutes, expands, slices, concatenation, attention),
rewriting a size written as a number (a head count: ``view(x, [b, s, 4, 8])`` becomes
``[b, s, 2, 8]`` on 2 mirrors). Anything else, or a split value leaving the stage, is
refused naming the operation: never computed wrongly.
"""

from __future__ import annotations

import math
import operator
import sys
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import fx

from pipetrain.runtime.rank.shard import local

COPY, REDUCE = "_tensor_parallel_copy", "_tensor_parallel_reduce"
"""The names of the stage's modules running the two operators."""

aten = torch.ops.aten
_LINEAR = aten.linear.default
_VIEWS = {aten.view.default, aten.reshape.default, aten._unsafe_view.default}
_SAME = {  # one tensor in, the same shape out, nothing mixed along any dimension
    aten.to.dtype, aten._to_copy.default, aten.clone.default, aten.contiguous.default,
    aten.alias.default, aten.detach.default, aten.dropout.default, aten.type_as.default,
}  # fmt: skip
_ATTENTION = {aten.scaled_dot_product_attention.default}


def _sizes(node: fx.Node) -> list[Any]:
    """The full (unsplit) shape of ``node``'s value as the capture recorded it (symbolic
    sizes as ``SymInt``)."""
    value = node.meta.get("val")
    if not isinstance(value, torch.Tensor):
        raise ValueError(f"tensor parallelism cannot follow {node.name}: its shape is unknown")
    return list(value.shape)


def _same(a: Any, b: Any) -> bool:
    """Whether two sizes are equal whatever the symbolic sizes are (no guard recorded)."""
    from torch.fx.experimental.symbolic_shapes import statically_known_true

    return bool(statically_known_true(a == b))


class GraphPass:
    """The rewrite of one graph (see the module's docstring): ``plan`` holds the full names
    of the planned linear modules a stage holds, ``degree`` the mirrors."""

    def __init__(self, graph: fx.Graph, plan: Mapping[str, str], degree: int) -> None:
        self.graph, self.plan, self.degree = graph, plan, degree
        self.split: dict[fx.Node, int] = {}  # a value of a region: its split dimension
        self.copies: dict[fx.Node, fx.Node] = {}  # a colwise layer's input: its copy

    def _refuse(self, node: fx.Node, why: str) -> ValueError:
        code = f"{node.target}({', '.join(str(a) for a in node.args)})"
        return ValueError(
            f"tensor parallelism cannot split {node.name} = {code}: {why}; change "
            "tensor_parallel_plan (or the stage cuts), or use tensor_parallel=1"
        )

    def _planned(self, node: Any) -> tuple[str, str] | None:
        """(module, style) of a planned parameter read by ``node``."""
        if isinstance(node, fx.Node) and node.op == "get_attr":
            module, _, leaf = str(node.target).rpartition(".")
            if module in self.plan:
                return module, leaf
        return None

    def run(self) -> None:
        """Rewrite the graph in place, or raise ValueError naming what cannot be split."""
        for node in self.graph.nodes:
            if self._planned(node) and any(
                user.target is not _LINEAR or node not in user.args[1:] for user in node.users
            ):
                raise self._refuse(node, "a planned parameter is used other than by its layer")
        used: set[str] = set()
        for node in list(self.graph.nodes):
            planned = self._planned(node.args[1]) if node.target is _LINEAR else None
            if planned is None:
                self._follow(node)
            else:
                used.add(planned[0])
                self._linear(node, self.plan[planned[0]])
        unused = sorted(set(self.plan) - used)
        if unused:
            raise ValueError(
                f"tensor-parallel plan entry {unused[0]!r} names a layer this stage's graph does "
                "not run as a linear operation of its own (inside a region such as autocast's); "
                "leave it out of tensor_parallel_plan, or use tensor_parallel=1"
            )
        self.graph.lint()

    def _local_of(self, node: Any, before: fx.Node) -> fx.Node:
        """A node reading ``node``'s (a planned parameter's) part on this mirror."""
        with self.graph.inserting_before(before):
            return self.graph.call_function(local, (node,))

    def _linear(self, node: fx.Node, style: str) -> None:
        x, weight, *rest = node.args
        bias: Any = rest[0] if rest else None
        if not isinstance(x, fx.Node):
            raise self._refuse(node, "its input is no tensor")
        if style == "colwise":
            if x in self.split:
                raise self._refuse(node, "a colwise layer's input is already split")
            if x not in self.copies:  # before its first colwise layer: every later one's too
                with self.graph.inserting_before(node):
                    self.copies[x] = self.graph.call_module(COPY, (x,))
            args = [self.copies[x], self._local_of(weight, node)]
            if bias is not None:
                args.append(self._local_of(bias, node))
            node.args = tuple(args)
            self.split[node] = len(_sizes(node)) - 1
            return
        if self.split.get(x) != len(_sizes(x)) - 1:
            raise self._refuse(node, "a rowwise layer's input must be a colwise layer's output")
        node.args = (x, self._local_of(weight, node))
        with self.graph.inserting_after(node):
            summed = self.graph.call_module(REDUCE, (node,))
        node.replace_all_uses_with(summed, delete_user_cb=lambda user: user is not summed)
        if bias is not None:
            with self.graph.inserting_after(summed):
                local_bias = self._local_of(bias, node)
                added = self.graph.call_function(operator.add, (summed, local_bias))
            summed.replace_all_uses_with(added, delete_user_cb=lambda user: user is not added)

    def _follow(self, node: fx.Node) -> None:
        """Record the split dimension of ``node``'s value when it takes a split one,
        rewriting its sizes where they are written out; raise where it cannot."""
        inputs = [a for a in node.all_input_nodes if a in self.split]
        if not inputs:
            return
        if node.op == "output":
            raise self._refuse(
                inputs[0], "a split value leaves the stage (no rowwise layer closes its region)"
            )
        target, args = node.target, node.args
        if node.op != "call_function":
            raise self._refuse(node, "an operation tensor parallelism does not follow")
        first: Any = args[0]
        if target is aten._assert_tensor_metadata.default:
            return
        if target is aten.sym_size.int:
            if self._dims(first, [args[1]]) == [self.split[first]]:
                raise self._refuse(node, "the size of a split dimension is read")
            return
        if target in _SAME or torch.Tag.pointwise in getattr(target, "tags", ()):
            self.split[node] = self._pointwise(node)
        elif target in _VIEWS:
            self.split[node] = self._view(node, first)
        elif target is aten.expand.default:
            self.split[node] = self._expand(node, first)
        elif target is aten.transpose.int:
            d, (a, b) = self.split[first], self._dims(first, args[1:3])
            self.split[node] = b if d == a else a if d == b else d
        elif target is aten.permute.default:
            order = self._dims(first, args[1])
            self.split[node] = order.index(self.split[first])
        elif target is aten.unsqueeze.default:
            (dim,) = self._dims(node, [args[1]])
            self.split[node] = self.split[first] + (dim <= self.split[first])
        elif target is aten.slice.Tensor:
            self.split[node] = self._slice(node, first)
        elif target is aten.cat.default:
            self.split[node] = self._cat(node)
        elif target in _ATTENTION:
            self.split[node] = self._attention(node)
        else:
            raise self._refuse(node, "an operation tensor parallelism does not follow")

    def _dims(self, node: Any, dims: Any) -> list[int]:
        rank = len(_sizes(node))
        return [d % rank for d in dims]

    def _pointwise(self, node: fx.Node) -> int:
        """A pointwise operation: the split dimension aligned from the right; any other
        input must broadcast along it."""
        out = _sizes(node)
        found: set[int] = set()
        for arg in node.all_input_nodes:
            if arg in self.split:
                found.add(self.split[arg] + len(out) - len(_sizes(arg)))
        if len(found) != 1:
            raise self._refuse(node, "its inputs are split along different dimensions")
        (d,) = found
        for arg in node.all_input_nodes:
            if arg not in self.split:
                sizes = _sizes(arg)
                at = d - (len(out) - len(sizes))
                if at >= 0 and not _same(sizes[at], 1):
                    raise self._refuse(
                        node,
                        f"{arg.name}, whole on every mirror, meets a split value along its "
                        f"dimension {at}",
                    )
        return d

    def _divided(self, node: fx.Node, position: int, sizes: Sequence[Any]) -> list[Any]:
        """``node``'s size list with the split dimension's written size divided."""
        written = list(sizes)
        size = written[position]
        if isinstance(size, int) and size != -1:
            if size % self.degree:
                raise self._refuse(
                    node, f"its size {size} does not divide by {self.degree} mirrors"
                )
            written[position] = size // self.degree
        elif not isinstance(size, int):
            raise self._refuse(node, "the split dimension's size is computed in the graph")
        return written

    def _view(self, node: fx.Node, source: fx.Node) -> int:
        d, before, after = self.split[source], _sizes(source), _sizes(node)
        prefix = math.prod(before[:d])
        for k in range(len(after)):
            if _same(math.prod(after[:k]), prefix) and not _same(after[k], 1):
                if not isinstance(after[k], int) or after[k] % self.degree:  # a head count
                    raise self._refuse(
                        node, f"its dimension of {after[k]} does not divide by {self.degree}"
                    )
                sizes: Any = node.args[1]
                node.args = (source, self._divided(node, k, sizes))
                return k
        raise self._refuse(node, "it mixes the split dimension with another")

    def _expand(self, node: fx.Node, source: fx.Node) -> int:
        before, after = _sizes(source), _sizes(node)
        k = self.split[source] + len(after) - len(before)
        sizes: Any = node.args[1]
        node.args = (source, self._divided(node, k, sizes), *node.args[2:])
        return k

    def _slice(self, node: fx.Node, source: fx.Node) -> int:
        (dim,) = self._dims(source, [node.args[1] if len(node.args) > 1 else 0])
        whole = list(node.args[2:4]) in ([], [0], [0, sys.maxsize], [None, None])
        if dim == self.split[source] and not whole:
            raise self._refuse(node, "it slices the split dimension")
        return self.split[source]

    def _cat(self, node: fx.Node) -> int:
        args: Any = node.args
        found = {self.split.get(part, -1) for part in args[0]}
        (dim,) = self._dims(node, [args[1] if len(args) > 1 else 0])
        if len(found) != 1 or -1 in found or dim in found:
            raise self._refuse(node, "it joins values not split alike, or along their split")
        return found.pop()

    def _attention(self, node: fx.Node) -> int:
        args: Any = node.args
        if any(self.split.get(t) != 1 for t in args[:3]):
            raise self._refuse(node, "attention needs its query, key and value split by heads")
        mask = args[3] if len(args) > 3 else node.kwargs.get("attn_mask")
        if isinstance(mask, fx.Node) and not _same(
            _sizes(mask)[-3] if len(_sizes(mask)) >= 3 else 1, 1
        ):
            raise self._refuse(node, "its mask differs between heads")
        return 1
