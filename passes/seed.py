"""Seed pass: write the plan into the graph.

* parameters (``get_attr`` nodes) and root inputs (placeholders) get their placements;
* every module-boundary layout the plan asks for becomes a :func:`layout` node, an identity
  whose output placement is fixed (the rewrite turns it into collectives);
* a planned rowwise linear's bias is split off (``linear(x, w) + b``) so it is added once,
  after the partial sums are reduced.
"""
from __future__ import annotations

import torch
import torch.fx as fx
from torch.distributed.tensor import Placement, Replicate, Shard

from .context import PassContext
from .errors import PlanError
from .graph import (BOUNDARY, PLACEMENT, UNPLANNED, ModuleCall, ModuleSharding, attr,
                    calls_of, inside, layout, planned_placement, val)
from .placement import UnitShard, is_sharded, normalize

aten = torch.ops.aten


def seed(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    """Place ``gm``'s parameters and mark its planned modules' boundaries as the plan lays
    them out (``ctx.shardings`` for the modules ``ctx.calls`` has calls of; ``ctx.aliases``:
    parameter FQN -> every FQN of the same, tied, tensor)."""
    shardings, calls, world, aliases = ctx.shardings, ctx.calls, ctx.world, ctx.aliases
    graph = gm.graph
    for node in graph.nodes:
        if node.op == "get_attr" and isinstance(val(node), torch.Tensor):
            planned = _param_placement(node, shardings, aliases.get(node.target))
            node.meta[PLACEMENT] = Replicate() if planned is None else planned
            if planned is None and isinstance(attr(gm, node.target), torch.nn.Parameter):
                node.meta[UNPLANNED] = True
            owner = node.target.rpartition(".")[0]
            _deal_indivisible(node, world, f"parameter '{node.target}'", shardings.get(owner))
        elif node.op == "placeholder":
            node.meta[PLACEMENT] = Replicate()
    root = shardings.get("")
    if root is not None:
        _seed_root_inputs(gm, root, world)
    # Inputs first: an output marker then feeds the next module's input marker, so a value
    # passed between two planned modules is redistributed once per boundary, in order. A
    # module forward never called has no boundary: only its parameters are placed. Inner
    # modules' inputs are laid out first, so that an enclosing module's marker (the root's
    # included) wraps theirs: a value passed down is laid out by the outer plan, then the
    # inner, whatever order the plan lists them in.
    def calls_of_module(fqn):
        return calls_of(calls, fqn) or ([_root_call(gm)] if fqn == "" else [])
    for fqn, sharding in sorted(shardings.items(), key=lambda item: -_depth(item[0])):
        for call in calls_of_module(fqn):
            _constrain_inputs(graph, fqn, sharding, call, world)
    for fqn, sharding in shardings.items():
        for call in calls_of_module(fqn):
            _constrain_outputs(graph, fqn, sharding, call, world)
    _split_partial_bias(graph)
    graph.lint()
    return gm


def _param_placement(node, shardings, fqns) -> Placement | None:
    """The placement the plan gives a parameter under any of its (tied) names (``None``:
    none): names whose module the plan leaves out follow the others; planned names must
    agree."""
    planned = {}
    for fqn in fqns or [node.target]:
        p = planned_placement(shardings, fqn)
        if p is not None:
            planned[fqn] = normalize(p, val(node).dim())
    if len(set(map(str, planned.values()))) > 1:
        ways = ", ".join(f"'{f}' as {p}" for f, p in planned.items())
        raise PlanError(f"tied parameter {' = '.join(fqns)} is planned two ways ({ways}). "
                        f"Plan its modules so the shared weight is split the same way, e.g. "
                        f"the input embedding RowwiseParallel() (vocab rows, Shard(0)) and "
                        f"the output projection ColwiseParallel() (vocab rows, Shard(0)), or "
                        f"plan one of them and leave the other out: it follows the tie")
    return next(iter(planned.values()), None)


def _deal_indivisible(node, world, what, sharding=None, uneven=True):
    """A ``Shard`` on a static dim that does not divide by ``world`` becomes a
    :class:`UnitShard` of that dim's elements (dealt as ``torch.chunk`` deals them; never on
    ``uneven=False`` values, which are passed in as shards); a dim with fewer elements than
    ranks, or a strided one, is a :class:`PlanError`. Symbolic dims are left as they are."""
    p, shape = node.meta[PLACEMENT], val(node).shape
    if not is_sharded(p) or not isinstance(shape[p.dim], int) or shape[p.dim] % world == 0:
        return
    size = shape[p.dim]
    if uneven and isinstance(p, Shard) and size >= world:
        node.meta[PLACEMENT] = UnitShard(p.dim, size)
        if node.target is layout:
            node.args = (node.args[0], node.meta[PLACEMENT])
        return
    style = f" ({type(sharding.style).__name__})" if sharding else ""
    raise PlanError(f"{what}{style} is sharded on dim {p.dim} of size {size}, which "
                    f"{'is smaller than' if size < world else 'does not divide by'} the world "
                    f"size {world}; choose sizes divisible by {world} or leave this module "
                    f"out of the plan")


def _depth(fqn: str) -> int:
    return fqn.count(".") + 1 if fqn else 0


def _root_call(gm) -> ModuleCall:
    from ..kernels.torch_compat import pytree
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    args, kwargs = pytree.tree_unflatten(placeholders, gm.graph._codegen.pytree_info.in_spec)
    outputs = tuple(next(iter(reversed(gm.graph.nodes))).args[0])
    return ModuleCall(tuple(args), dict(kwargs), outputs)


def _seed_root_inputs(gm, root: ModuleSharding, world: int) -> None:
    call = _root_call(gm)
    pairs = list(zip(call.args, root.input_layouts or ()))
    pairs += [(call.kwargs.get(k), p) for k, p in root.input_kwarg_layouts.items()]
    for node, p in pairs:
        if node is not None and p is not None and val(node) is not None:
            node.meta[PLACEMENT] = normalize(p, val(node).dim())
            _deal_indivisible(node, world, f"root input '{node.name}'", uneven=False)


def _insert_layout(graph, node, placement, users, what, owner, world, at=None):
    """Feed ``users`` of ``node`` through a layout marker that sits in module ``owner``'s
    scope (a node whose ``nn_module_stack`` stands for it), right after ``node``, or right
    before ``at`` (a module's input is laid out where the module is called: after any
    in-place write into it before then)."""
    if not users:
        return
    with graph.inserting_before(at) if at is not None else graph.inserting_after(node):
        marker = graph.call_function(layout, (node, normalize(placement, val(node).dim())))
    marker.meta.update(val=val(node), nn_module_stack=dict(owner.meta.get("nn_module_stack", {})))
    marker.meta[BOUNDARY] = what
    marker.meta[PLACEMENT] = marker.args[1]
    _deal_indivisible(marker, world, f"the layout at {what}")
    for user in users:
        user.replace_input_with(node, marker)


def _is_tensor_arg(node, placement, fqn, what) -> bool:
    """Whether a boundary value takes a layout; a layout for a non-tensor is an error."""
    if placement is None:
        return False
    if not isinstance(node, fx.Node) or not isinstance(val(node), torch.Tensor):
        raise PlanError(f"the plan gives {what} of module '{fqn or '<root>'}' the layout "
                        f"{placement}, but that value is not a tensor ({node!r}); use None "
                        f"for it in the style's layouts")
    return True


def _constrain_inputs(graph, fqn, sharding, call: ModuleCall, world):
    targets = [(node, p, f"input {i}") for i, (node, p) in
               enumerate(zip(call.args, sharding.desired_inputs or ()))]
    targets += [(call.kwargs.get(k), p, f"input {k!r}") for k, p in sharding.desired_kwargs.items()]
    for node, p, what in targets:
        if not _is_tensor_arg(node, p, fqn, what):
            continue
        users = sorted(u for u in node.users if u.op != "output" and inside(u, fqn))
        _insert_layout(graph, node, p, users, f"{fqn or '<root>'} {what}", users and users[0],
                       world, users and users[0])


def _constrain_outputs(graph, fqn, sharding, call: ModuleCall, world):
    for i, (node, p) in enumerate(zip(call.outputs, sharding.desired_outputs or ())):
        if not _is_tensor_arg(node, p, fqn, f"output {i}"):
            continue
        users = [u for u in node.users if u.op == "output" or not inside(u, fqn)]
        _insert_layout(graph, node, p, users, f"{fqn or '<root>'} output {i}", node, world)


def _split_partial_bias(graph) -> None:
    """``linear(x, w, b)`` with ``w`` Shard(1), ``addmm(b, x, w)`` with ``w`` Shard(0):
    the matmul gives partial sums, so the bias is added after them, once, in the layer's
    output dtype (autocast casts a linear's bias with it, not an add's). When the module's
    output layout marker reads the matmul, the bias is added after the marker: the partial
    sums are reduced (all-reduce, or reduce-scatter to sequence shards) before the add."""
    for node in list(graph.nodes):
        if node.target is aten.linear.default and len(node.args) > 2 and \
                node.args[2] is not None and _sharded_on(node.args[1], 1):
            bias, matmul = node.args[2], (aten.linear.default, node.args[:2])
        elif node.target is aten.addmm.default and not node.kwargs and \
                _sharded_on(node.args[2], 0):
            bias, matmul = node.args[0], (aten.mm.default, node.args[1:3])
        else:
            continue
        with graph.inserting_before(node):
            product = graph.call_function(*matmul)
        product.meta.update(node.meta)
        node.replace_all_uses_with(product)
        summed = _output_marker(product) or product
        with graph.inserting_after(summed):
            add = graph.call_function(aten.add.Tensor, (summed, _cast_like(graph, bias, node)))
        add.meta.update(node.meta, val=val(summed))
        summed.replace_all_uses_with(add, delete_user_cb=lambda u: u is not add)
        graph.erase_node(node)


def _cast_like(graph, bias: fx.Node, layer: fx.Node) -> fx.Node:
    """``bias`` in ``layer``'s output dtype, cast where it is read (a no-op left out)."""
    dtype = val(layer).dtype
    if val(bias).dtype == dtype:
        return bias
    with graph.inserting_before(layer):
        cast = graph.call_function(aten._to_copy.default, (bias,), {"dtype": dtype})
    cast.meta.update(layer.meta, val=val(bias).to(dtype))
    return cast


def _output_marker(node):
    """The layout marker ``node`` reaches through its only users, views that keep its last
    dim (Conv1D views its 2-D product back to (batch, seq, features)), if any."""
    while len(node.users) == 1:
        (user,) = node.users
        if user.target is layout:
            return user
        if user.target not in (aten.view.default, aten.reshape.default) or \
                val(user).shape[-1] != val(node).shape[-1]:
            return None
        node = user
    return None


def _sharded_on(node, dim) -> bool:
    p = node.meta.get(PLACEMENT)
    return isinstance(p, (Shard, UnitShard)) and p.dim == dim
