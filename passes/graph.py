"""The graph vocabulary every pass shares: ``node.meta`` keys and their readers, the
module-boundary marker, call arguments by name, and what the plan and the trace hand the
passes (:class:`ModuleSharding`, :class:`ModuleCall`). Imports no pass.

``node.meta`` keys fxtp's passes write:

==============  ==========================================================================
``PLACEMENT``   the value's placement (a tuple for multi-output ops); propagate, rewrite
``INPUTS``      placements the node needs of its tensor inputs (``None``: as is)
``BOUNDARY``    ``"fqn input 0"`` on a module-boundary :func:`layout` marker; seed
``COLLECTIVE``  the kind of collective a rewrite node issues
``FALLBACK``    why an op was gathered to Replicate; propagate
``MODE_REGION``  on nodes of an inlined ``torch.autocast`` or ``torch.no_grad()`` region
                (between the calls entering and leaving its mode): they must stay there;
                trace
``AUTOCAST``    the autocast state (``device_type, dtype, enabled, cache_enabled``) of
                the innermost inlined autocast region a node is in; trace
``STAMP``       on a node standing for a whole block's call that runs the program of an
                equivalent block traced in full (:class:`Stamp`); trace
``PINNED``      the placement a fresh tensor (a factory's output) is made in, chosen for
                what is written into it (or ``Partial`` zeros partial sums are added
                into); propagation keeps it. buffers, aliases, unpin
``INTO_PARTIAL``  on an add or subtraction partial sums left unreduced may reach: it may add
                a replicated operand into a partial one (on one rank). unpin
``UNPLANNED``   on a parameter's ``get_attr`` that no style places: whole as far as the plan
                goes, though propagation may hold it as the shard its readers take. seed
``HELD_WHOLE``  on a parameter's ``get_attr`` the plan shards but every rank holds whole,
                its users reading their rows of it: why (uneven heads, a fused projection
                computed part by part). units, unfuse
``READS``       on a node computing with a parameter through its owner's plain reads: the
                parameter's path (relative to the graph's module). ``fxtp.edges.dtensor_params``
``REGION``      in ``node.meta["custom"]``: the number of the activation-checkpoint region
                the node is in (:mod:`~fxtp.passes.recompute`); trace
``MADE_BY``     while modules are outlined, on a module's placeholder for a collective
                its caller made of the module's other inputs: ``(target, args, kwargs)``
                of that collective over the placeholders (a block's input gradient
                sync), for the stamps inside to make it anew; modules
==============  ==========================================================================

``gm.meta`` keys:

=================  =======================================================================
``REGION``         each activation-checkpoint region's ``checkpoint`` options, by number;
                   trace (``fxtp.frontend.trace``)
``STAMPED``        a stamped block's FQN -> the FQN of the block it was copied from; trace
``EXPORT_GUARDS``  ``torch.export``'s guards on the inputs and the names of the inputs
                   they read (``(guards, names)``, or ``None``): with dynamic dims, what
                   the program assumes of their sizes (``x.size()[1] >= 5`` where the
                   model branched on it); trace
``FALLBACKS``      why each value the placements gather to Replicate is gathered (messages,
                   the ``torch.cond`` branches' included); propagate, and the trial passes
                   (unfuse, unpin, gather_early) where they keep what they tried
``RELAID``         whether the last relayout or trial pass changed a placement (propagation
                   must then run again); the relayouts, unfuse, unpin, gather_early
``DECOMPOSED``     the composite ops without a rule replaced by their decompositions, by
                   node name; decompose_unruled
``INLINED``        the FQNs of the modules to outline left inline (called more than once, or
                   not at all); outline_modules
``RECOMPUTED``     the modules a checkpoint region of this graph module calls (recomputed
                   whole with it); outline_checkpoints
=================  =======================================================================

Every pass is ``pass_(gm, ctx) -> gm`` (:class:`~fxtp.passes.context.PassContext`).

Every node also keeps export's ``val`` (a fake tensor with the *global* shape) and
``nn_module_stack`` (module FQNs).
"""
from __future__ import annotations

import collections
import functools
import inspect
from dataclasses import dataclass, field
from typing import Optional

import torch
import torch.fx as fx
from torch.distributed.tensor import Placement, Replicate

from ..kernels.torch_compat import OpOverload

PLACEMENT = "fxtp_placement"
INPUTS = "fxtp_input_placements"
BOUNDARY = "fxtp_boundary"
COLLECTIVE = "fxtp_collective"
FALLBACK = "fxtp_fallback"
MODE_REGION = "fxtp_mode_region"
AUTOCAST = "fxtp_autocast"
STAMP = "fxtp_stamp"
PINNED = "fxtp_pinned"
INTO_PARTIAL = "fxtp_into_partial"
UNPLANNED = "fxtp_unplanned"
HELD_WHOLE = "fxtp_held_whole"
READS = "fxtp_reads"
REGION = "fxtp_checkpoint"
STAMPED = "fxtp_stamped"
EXPORT_GUARDS = "fxtp_export_guards"
FALLBACKS = "fxtp_fallbacks"
RELAID = "fxtp_relaid"
DECOMPOSED = "fxtp_decomposed"
INLINED = "fxtp_inlined"
RECOMPUTED = "fxtp_recomputed"
MADE_BY = "fxtp_made_by"

Layouts = Optional[tuple[Optional[Placement], ...]]


# --- values --------------------------------------------------------------------------------

def val(node):
    """What a node computes, as traced: fxtp graphs keep ``val``, dynamo ``example_value``."""
    if not isinstance(node, fx.Node):
        return None
    return node.meta.get("val", node.meta.get("example_value"))


def is_tensor_node(arg) -> bool:
    return isinstance(val(arg), torch.Tensor)


def tensor_inputs(node: fx.Node) -> list[fx.Node]:
    """The node's tensor inputs in argument order (the order DimSpec inputs follow)."""
    found: list[fx.Node] = []
    fx.node.map_arg((node.args, node.kwargs),
                    lambda a: found.append(a) if is_tensor_node(a) else None)
    return found


def output_vals(node: fx.Node) -> list:
    v = val(node)
    return list(v) if isinstance(v, (tuple, list)) else [v]


def placement_of(node) -> Placement | tuple | None:
    return node.meta.get(PLACEMENT) if isinstance(node, fx.Node) else None


# --- modules -------------------------------------------------------------------------------

def module_fqns(node: fx.Node) -> list[str]:
    """FQNs of the modules a node was traced in, outermost first (root excluded)."""
    stack = node.meta.get("nn_module_stack") or {}
    return [path for path, _ in stack.values() if path]


def module_fqn(node: fx.Node) -> str:
    fqns = module_fqns(node)
    return fqns[-1] if fqns else ""


def list_block(fqn: str) -> str:
    """The block a module is in: its FQN up to the first list index (``layers.3.mlp`` ->
    ``layers.3``); ``""`` for a module in no list."""
    parts = fqn.split(".")
    index = next((i for i, p in enumerate(parts) if p.isdigit()), None)
    return ".".join(parts[:index + 1]) if index is not None else ""


def recompile_alone(gm: fx.GraphModule) -> None:
    """``gm.recompile()`` for a pass that edited ``gm``'s graph alone: the code of the
    graph modules below it is left as it is (``recompile`` regenerates all of it)."""
    gm.__dict__["_recompile_submodules"] = list  # called with no arguments: []
    try:
        gm.recompile()
    finally:
        del gm.__dict__["_recompile_submodules"]


def keep_on_copy(gm: fx.GraphModule, name: str) -> None:
    """Have ``copy.deepcopy(gm)`` carry ``gm``'s attribute ``name``, copied along with the
    rest (fx's copy keeps only the attributes its graph reads)."""
    key = fx.graph_module._USER_PRESERVED_ATTRIBUTES_KEY
    gm.meta[key] = {**gm.meta.get(key, {}), name: getattr(gm, name)}  # its own (copies share meta)


def own_method(gm: fx.GraphModule, name: str, function) -> None:
    """Make ``function`` ``gm``'s method ``name``, and that of every ``copy.deepcopy`` of
    it: set on the class fx makes for each ``GraphModule`` (a copy gets a class of its
    own)."""
    _set_on_class(gm, name, function)
    gm._register_deepcopy_hook(functools.partial(_set_on_class, name=name, function=function))


def _set_on_class(gm: fx.GraphModule, name: str, function) -> None:
    setattr(type(gm), name, function)


def attr(module: torch.nn.Module, target: str):
    """What a ``get_attr`` target (a dotted path) names in ``module``."""
    owner, _, name = target.rpartition(".")
    return getattr(module.get_submodule(owner), name)


def tied_attrs(gm: fx.GraphModule) -> set:
    """The ``get_attr`` nodes of tensors the graph reads under more than one name."""
    attrs = [n for n in gm.graph.nodes if n.op == "get_attr"]
    readers = collections.Counter(id(attr(gm, n.target)) for n in attrs)
    return {n for n in attrs if readers[id(attr(gm, n.target))] > 1}


def stack_upto(node: fx.Node, fqn: str) -> dict:
    """``node``'s ``nn_module_stack`` cut after ``fqn`` (empty for the root)."""
    stack = {}
    for key, (path, kind) in (node.meta.get("nn_module_stack") or {}).items():
        if not fqn:
            break
        stack[key] = (path, kind)
        if path == fqn:
            break
    return stack


def inside(node: fx.Node, fqn: str) -> bool:
    return fqn == "" or fqn in module_fqns(node)


# --- calls ---------------------------------------------------------------------------------

@functools.lru_cache(maxsize=None)
def _signature(fn) -> Optional[inspect.Signature]:
    try:
        return inspect.signature(fn)
    except (TypeError, ValueError):
        return None


def op_arg(node: fx.Node, i: int, name: str, default=None):
    """An op call's argument at position ``i``, or passed by ``name``, or ``default``."""
    return node.args[i] if len(node.args) > i else node.kwargs.get(name, default)


def hold_whole(param: fx.Node, why: str) -> None:
    """Lay ``param`` (a parameter's ``get_attr``) out whole on every rank, its users to
    read their rows of it; where it was sharded, say ``why`` (``HELD_WHOLE``)."""
    if not isinstance(param.meta[PLACEMENT], Replicate):
        param.meta[HELD_WHOLE] = why
    param.meta[PLACEMENT] = Replicate()


def transposed_matrix(value) -> Optional[fx.Node]:
    """The matrix ``value`` transposes (``x @ w.T``, as Falcon's linears multiply:
    ``w.t()``, ``w.T``, ``w.transpose(0, 1)``), else ``None``."""
    if not isinstance(value, fx.Node) or value.op != "call_function":
        return None
    aten = torch.ops.aten
    if value.target in (aten.t.default, aten.numpy_T.default) or \
            value.target is aten.transpose.int and sorted(value.args[1:3]) in ([0, 1], [-2, -1]):
        return value.args[0]
    return None


def call_args(node: fx.Node) -> Optional[dict]:
    """A Python function call's arguments by parameter name, defaults filled (``None`` for
    ops without a Python signature: read those through their schema)."""
    if node.op != "call_function" or isinstance(node.target, OpOverload):
        return None
    sig = _signature(node.target)
    if sig is None:
        return None
    bound = sig.bind(*node.args, **node.kwargs)
    bound.apply_defaults()
    return dict(bound.arguments)


def branches(gm: fx.GraphModule, node: fx.Node) -> list[fx.GraphModule]:
    """The branches of a ``torch.cond`` node (graphs the passes propagate, rewrite and
    localize like the main one); ``[]`` for any other node."""
    if node.target is not torch.ops.higher_order.cond:
        return []
    return [getattr(gm, a.target) for a in node.args[1:3]]


def layout(x: torch.Tensor, placement: Placement) -> torch.Tensor:
    """Marks a value that must have ``placement`` here (a module boundary the plan gives a
    layout); identity at run time, removed by the rewrite."""
    return x


# --- what the plan and the trace give the passes -------------------------------------------

@dataclass
class ModuleSharding:
    """The contract between a parallel style and the seed pass.

    ``params``: parameter path (relative to the module: ``weight``, ``base_layer.weight``)
    -> placement.
    ``input_layouts``: how each positional input is laid out when the module is the root
    (what every rank passes in). ``desired_inputs`` / ``desired_kwargs``: layouts the inputs
    are redistributed to on entry. ``desired_outputs``: layouts outputs are redistributed to
    on exit. ``None`` entries leave a value as it is.
    """

    fqn: str
    style: object
    params: dict[str, Placement] = field(default_factory=dict)
    input_layouts: Layouts = None
    input_kwarg_layouts: dict[str, Placement] = field(default_factory=dict)
    desired_inputs: Layouts = None
    desired_kwargs: dict[str, Placement] = field(default_factory=dict)
    desired_outputs: Layouts = None


def planned_placement(shardings: dict, fqn: str):
    """The placement ``shardings`` (module FQN -> :class:`ModuleSharding`) give parameter
    ``fqn``: its nearest planned ancestor's, which names it by its path below that module
    (``weight``, or ``base_layer.weight`` for a wrapper); ``None`` where none does."""
    parts = fqn.split(".")
    for i in range(len(parts) - 1, -1, -1):
        sharding, path = shardings.get(".".join(parts[:i])), ".".join(parts[i:])
        if sharding is not None and path in sharding.params:
            return sharding.params[path]
    return None


LATER_CALL = "#"
"""``fqn#n`` keys the n-th call (n >= 2) of module ``fqn`` among the traced calls; the
first call is keyed by the FQN alone. Each call's boundary gets the module's layouts."""


def call_key(fqn: str, n: int) -> str:
    """The key of the ``n``-th call (from 1) of module ``fqn``, as :data:`LATER_CALL`
    says."""
    return fqn if n == 1 else f"{fqn}{LATER_CALL}{n}"


def calls_of(calls: dict, fqn: str) -> list:
    """Every traced call of module ``fqn`` in ``calls`` (keyed as :data:`LATER_CALL` says),
    first to last."""
    later = sorted((k for k in calls if k.startswith(fqn + LATER_CALL)),
                   key=lambda k: int(k[len(fqn) + 1:]))
    return [calls[k] for k in ([fqn] if fqn in calls else []) + later]


def boundary_nodes(calls: dict) -> frozenset:
    """The graph values at every traced module call's boundary (arguments and results)."""
    return frozenset(n for c in calls.values() for n in (*c.args, *c.kwargs.values(),
                                                          *c.outputs))


@dataclass
class ModuleCall:
    """Graph values at one module's call boundary (``None`` for non-tensor values)."""

    args: tuple[Optional[fx.Node], ...] = ()
    kwargs: dict[str, Optional[fx.Node]] = field(default_factory=dict)
    outputs: tuple[Optional[fx.Node], ...] = ()


@dataclass(eq=False)
class Stamp:
    """A block call the trace kept as one node (``meta[STAMP]``): it runs the program of
    block ``reference``, whose arguments and results pass through the :func:`stamp_edge`
    nodes ``inputs`` (in the stamp node's argument order) and ``outputs`` (in the stamp's
    output order). The passes treat the node as that block: its inputs must arrive placed
    as the reference's did, and its outputs are placed as the reference's are."""

    reference: str
    inputs: list
    outputs: list


def stamp_edge(x: torch.Tensor) -> torch.Tensor:
    """Marks a value entering or leaving the program of a block other blocks are stamped
    from (:class:`Stamp`'s ``inputs`` and ``outputs``); identity, placed as its input,
    removed before outlining (:func:`~fxtp.passes.modules.outline_modules`)."""
    return x
