"""Tracing: a single-device ``nn.Module`` -> an ATen-level ``fx.GraphModule``.

Uses ``torch.export`` (non-strict) so ordinary Python model code traces; every node keeps
``nn_module_stack`` (module FQNs) in ``node.meta`` and ``val`` (a fake tensor with the
global shape). Modules named by the plan keep their call boundaries: :class:`ModuleCall`
says which graph values are their inputs and outputs.
"""
from __future__ import annotations

import collections
import contextlib
import re
import warnings
from typing import Iterable, Optional

import torch
import torch.fx as fx
import torch.fx.traceback as fx_traceback
from torch.fx.operator_schemas import normalize_function
import torch.utils.checkpoint as cp

from torch.fx.node import has_side_effect

from ..kernels.torch_compat import (HigherOrderOperator, enter_autocast, exit_autocast,
                                    lazy_graph_modules, pytree, without_source_lines)
from ..passes.errors import TraceError
from ..passes.graph import (AUTOCAST, EXPORT_GUARDS, MODE_REGION, REGION, STAMPED, ModuleCall,
                            call_key)
from .autograd_functions import call_kept_functions, keeping_functions
from .forward_state import judge_state_changes, watching_state
from .hooks import call_gradient_hooks, check_model_hooks, keeping_gradient_hooks
from .stamping import Shown, Stamper, Unstampable


@torch.library.custom_op("fxtp::boundary", mutates_args=())
def _boundary(x: torch.Tensor, fqn: str, kind: str, key: str) -> torch.Tensor:
    """Marks ``x`` as the ``kind`` ("arg", "kwarg" or "output") ``key`` of module ``fqn``'s
    call while tracing; every mark is removed from the traced graph."""
    return x.clone()


@_boundary.register_fake
def _(x, fqn, kind, key):
    return torch.empty_like(x)


_boundary.register_autograd(lambda ctx, grad: (grad, None, None, None))


def trace(model: torch.nn.Module, args: tuple, kwargs: Optional[dict],
          boundaries: Iterable[str], dynamic_shapes=None, checkpointed: Iterable[str] = (),
          blocks: Iterable[str] = (), plan: Optional[dict] = None, keep_stamps: bool = False
          ) -> tuple[fx.GraphModule, dict[str, ModuleCall]]:
    """Trace ``model(*args, **kwargs)``; return the graph module and the calls of the
    modules in ``boundaries`` (FQNs; ``""`` is the root, whose inputs are placeholders),
    keyed as :data:`~fxtp.passes.graph.LATER_CALL` says (:func:`calls_of` lists a
    module's).

    A module's call boundaries are each call's tensor arguments and outputs, marked while
    tracing by forward hooks (so arguments of any type, a dataclass or a ``BlockMask``,
    pass through). Activation-checkpoint regions (the model's non-reentrant
    ``torch.utils.checkpoint`` calls, and every call of the modules named in
    ``checkpointed``) are marked on their nodes for :mod:`fxtp.passes.recompute`; their
    options are ``gm.meta[REGION]``.

    ``blocks`` (FQNs) that are equivalent under ``plan`` (FQN -> style) are traced once
    and stamped (:mod:`fxtp.frontend.stamping`); ``gm.meta[STAMPED]``: block -> the block it was
    copied from. ``keep_stamps``: each stamped block stays one node (:meth:`Stamper.keep`),
    and its modules have no calls; else it is a copy of its reference's nodes.
    Nodes carry no ``stack_trace``: nothing reads it, and recording it is a fifth of the
    trace."""
    check_model_hooks(model)
    boundaries = tuple(b for b in boundaries if b)
    checkpointed = tuple(checkpointed)
    blocks = list(blocks)
    shown: set[str] = set()  # blocks traced although their kind is stamped
    while True:
        stamper = Stamper(model, blocks, plan or {}, (*boundaries, *checkpointed), shown)
        try:
            gm, calls = _trace(model, args, kwargs, boundaries, dynamic_shapes, checkpointed,
                               stamper, keep_stamps)
        except Shown as e:  # with the tensors of its kind this time: where one block is
            shown.update(stamper.same_kind(e.fqn))  # a variant, the next are likely to be
            continue
        except Unstampable as e:  # that kind of block is traced in full
            blocks = [b for b in blocks if b not in stamper.same_kind(e.fqn)]
            continue
        return gm, calls


_HINTS = [  # (what torch.export's error says, what to change), the first that matches
    (r"Found <class 'transformers\.[\w.]*?\.(\w+Cache)'> in output, which is not a known type",
     "the model returns its key/value cache ({0}, use_cache=True). To train, trace without "
     "it: set model.config.use_cache = False before parallelize (or pass "
     "example_kwargs={{'use_cache': False}} and call the result with use_cache=False); to "
     "generate, use fxtp.parallelize_causal_lm, which shards a static cache."),
    (r"Found <class '([\w.]+)'> in output, which is not a known type",
     "the model returns a {0}, which torch.export cannot flatten: return tensors (or "
     "tuples, lists, dicts of them), or register the type with "
     "torch.utils._pytree.register_pytree_node."),
    (r"following model attribute: (\S*?)\.?lifted_tensor_\d+",  # a .data write in forward
     "module '{0:<root>}' changes a tensor in place through its .data in forward, which "
     "torch.export cannot trace (Gemma-3n's AltUp clips its coefficients so while "
     "training). Make that update outside forward, after optimizer.step(), or turn it off "
     "(Gemma-3n: config.altup_coef_clip = None)."),
    (r"mismatch between the structure of `inputs` and `dynamic_shapes`",
     "dynamic_shapes must follow example_inputs and example_kwargs: a tuple with one entry "
     "per positional input and then per keyword argument, or a dict by forward's argument "
     "names ({{'tokens': {{1: Dim('seq')}}, 'mask': ...}}), None for inputs with no dynamic "
     "dim."),
    (r'File "([^"]+)", line (\d+), in \w+\n\s*(assert\b[^\n]*)',
     "an assert on a tensor's value ({2}, {0}:{1}) needs the value, which torch.export "
     "cannot know while tracing: write it as torch._check(...) (checked when the program "
     "runs), or trace code without it (a library's export-friendly variant of the "
     "module)."),
    (r"shape '\[[^\]]*\]' is invalid for input of size",
     "a view's sizes do not fit its input. fxtp traces the single-device model at its "
     "global sizes: pass the model as built, not one whose head counts or widths were "
     "already divided by the tensor-parallel degree for DTensor (torchtune's "
     "prepare_mha_for_tp, a recipe setting local n_heads); else check that "
     "model(*example_inputs, **example_kwargs) runs."),
]


class _Groups(str):
    """A match group in a hint: ``{0:<root>}`` gives ``<root>`` where it is empty."""

    def __format__(self, spec):
        return str(self) or spec


def _hint(error: Exception) -> str:
    """What to change when torch.export failed with ``error``."""
    for pattern, hint in _HINTS:
        found = re.search(pattern, str(error))
        if found:
            return hint.format(*(_Groups(g.strip()) for g in found.groups()))
    moe = (" A mixture of experts looping over the experts a batch routes to is the "
           "usual case: pick an implementation without the loop (transformers: "
           "model.set_experts_implementation('batched_mm'), where the model offers it)."
           if type(error).__name__ == "GuardOnDataDependentSymNode" else "")
    return ("data-dependent Python control flow and non-tensor outputs are the usual "
            "causes; check that model(*example_inputs, **example_kwargs) runs, and rewrite "
            "branches on tensor values with torch.where / torch.cond." + moe)


def _where(model: torch.nn.Module, error: BaseException) -> tuple[str, str]:
    """Where in ``model`` ``error`` was raised: the FQN of the innermost of its modules
    whose ``forward`` (or a method it called) was running, from the tracebacks of ``error``
    and of the errors it was raised from, and a phrase naming it for the message."""
    # by their __dict__, which export's proxies of modules share with them
    modules = {id(vars(m)): (n, m) for n, m in model.named_modules()}
    running, seen = {}, set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        tb = error.__traceback__
        while tb is not None:
            owner = tb.tb_frame.f_locals.get("self")
            if isinstance(owner, torch.nn.Module) and id(vars(owner)) in modules:
                name, module = modules[id(vars(owner))]
                running[name] = module
            tb = tb.tb_next
        error = error.__cause__ or error.__context__
    fqn = max(running, key=lambda n: n.count(".") + bool(n), default="")
    return fqn, f", in module '{fqn}' ({type(running[fqn]).__name__})" if fqn else ""


def _way_around(fqn: str, planned: Iterable[str], error: Exception, kwargs: dict) -> str:
    """For a size computed from a tensor's values (a vision tower cutting patches by image
    sizes, a model packing image features by them), where it happens in module ``fqn``
    with no module in it or around it planned, or in a model called with images: how to
    keep that code out of the traced program."""
    if type(error).__name__ != "GuardOnDataDependentSymNode":
        return ""
    def outside(path):
        return not any(f"{p}.".startswith(f"{path}.") or f"{path}.".startswith(f"{p}.")
                       for p in planned)
    parts = fqn.split(".") if fqn else []
    top = next((p for p in (".".join(parts[:i]) for i in range(1, len(parts) + 1))
                if outside(p)), None)  # the largest module around it the plan leaves whole
    images = sorted(k for k in kwargs or {} if k.startswith("pixel_values"))
    if top is None and not images:
        return ""
    what = (f"Module '{fqn}' is outside the plan (no module in it or around it is planned), "
            f"so it runs whole on every rank and need not be in the traced program"
            if top else f"The model computes sizes from its images ({', '.join(images)} "
            f"and the sizes passed with them) where it prepares the language model's input")
    return (f"\n{what}: compute that input before the parallelized model and pass it in. A "
            f"Hugging Face vision-language model: parallelize it with inputs_embeds (and "
            f"position_ids, where the model derives them from the images) as example inputs, "
            f"and compute those outside with the single-device model's "
            f"{repr(top) if top else 'vision tower'} and input embeddings; their gradients "
            f"reach them as on one device.")


def _layer_drop(model: torch.nn.Module, error: Exception) -> str:
    """For a model that skips layers at random while training (LayerDrop: fairseq's and
    Hugging Face's audio and encoder-decoder models, ``config.layerdrop``,
    ``encoder_layerdrop``, ``decoder_layerdrop``, or the same attribute on a module), the
    branch on that draw that torch.export cannot trace, and how to turn it off; else ""."""
    if type(error).__name__ != "GuardOnDataDependentSymNode" or not model.training:
        return ""
    found = {}
    for fqn, module in model.named_modules():
        for owner, prefix in ((module, fqn), (getattr(module, "config", None), "config")):
            for name, value in getattr(owner, "__dict__", {}).items():  # (a dict has none)
                if "layerdrop" in name.replace("_", "") and isinstance(value, float) and \
                        value > 0:
                    found.setdefault(f"{prefix}.{name}".lstrip("."), value)
    if not found:
        return ""
    settings = ", ".join(f"{k} = {v}" for k, v in found.items())
    return (f"the model skips layers at random while training (LayerDrop: {settings}): "
            f"whether a layer runs is a random draw, which a traced program cannot branch "
            f"on. Set it to 0.0 before parallelize, or parallelize the model in eval mode "
            f"to serve it.")


def _trace(model, args, kwargs, boundaries, dynamic_shapes, checkpointed, stamper,
           keep_stamps):
    # export's graph modules generate their code when first used, not at each of its steps
    with lazy_graph_modules(True), without_source_lines():
        return _export(model, args, kwargs, boundaries, dynamic_shapes, checkpointed,
                       stamper, keep_stamps)


def _export(model, args, kwargs, boundaries, dynamic_shapes, checkpointed, stamper,
            keep_stamps):
    regions: dict[int, dict] = {}
    shapes: dict[str, tuple[int, int]] = {}
    kept: dict[str, type] = {}
    hooks: collections.OrderedDict = collections.OrderedDict()  # a handle's weak reference
    try:
        with fx_traceback.preserve_node_meta(), \
                _marking_checkpoints(model, checkpointed, regions), \
                _marking_boundaries(model, boundaries, shapes), stamper.tracing(), \
                keeping_functions(kept), keeping_gradient_hooks(hooks), \
                watching_state(model) as changes:
            ep = torch.export.export(model, tuple(args), kwargs=kwargs or {}, strict=False,
                                     dynamic_shapes=dynamic_shapes)
    except Shown:
        raise
    except Exception as e:  # noqa: BLE001 - re-raised with a hint
        if isinstance(e.__cause__ or e.__context__, Shown):  # raised inside export's code
            raise e.__cause__ or e.__context__ from None
        if type(e).__name__ == "UncapturedHigherOrderOpError":
            raise TraceError(
                f"fxtp could not trace {type(model).__name__}: {e}\nHint: a module the plan "
                f"names (or that checkpoint= names) is called inside a torch.cond branch, "
                f"whose tracing cannot run fxtp's boundary hooks; plan the modules around "
                f"the cond, not inside its branches.") from e
        fqn, where = _where(model, e)
        raise TraceError(
            f"fxtp could not trace {type(model).__name__} with torch.export (non-strict)"
            f"{where}: {type(e).__name__}: {e}\nHint: {_layer_drop(model, e) or _hint(e)}"
            f"{_way_around(fqn, boundaries, e, kwargs)}") from e
    judge_state_changes(model, changes)
    with warnings.catch_warnings():  # buffers read through a cache object: see below
        warnings.filterwarnings("ignore", message=r"A model attribute `\S*lifted_tensor_\d+` "
                                r"requires gradient")
        gm = ep.module()
    call_kept_functions(gm, kept)
    call_gradient_hooks(gm, hooks)
    if not keep_stamps:  # the copies of the reference's nodes read them
        stamper.hand_back(gm)
    _read_buffers_by_name(gm, model)
    _inline_regions(gm)
    stamped = stamper.keep(gm) if keep_stamps else stamper.expand(gm, shapes, regions)
    _reject_higher_order_ops(gm)
    export_guards = _take_export_guards(gm, guarded=bool(getattr(ep, "_guards_code", True)))
    gm = fx.GraphModule(gm, gm.graph)  # without export's input-shape check hooks
    if keep_stamps:  # after the copy above, which holds only the tensors the graph reads
        stamper.drop_unread(gm)
        stamper.hand_back(gm)
    gm.meta[REGION] = regions
    gm.meta[STAMPED] = stamped
    gm.meta[EXPORT_GUARDS] = export_guards
    return gm, _take_boundaries(gm.graph, shapes)


@contextlib.contextmanager
def _marking_boundaries(model: torch.nn.Module, fqns: Iterable[str], shapes: dict):
    """Mark the tensor arguments and outputs of every call of each module with
    :func:`_boundary`; ``shapes[key]``: (number of positional arguments, of output
    leaves), keyed by the FQN for the first call and ``fqn#n`` for the n-th
    (:data:`~fxtp.passes.graph.LATER_CALL`)."""
    def mark(value, fqn, kind, key):
        return torch.ops.fxtp.boundary(value, fqn, kind, str(key)) \
            if isinstance(value, torch.Tensor) else value

    called: dict[str, int] = {}  # FQN -> its calls so far
    running: dict[str, list[str]] = {}  # FQN -> the keys of its calls under way

    def before(fqn):
        def hook(module, args, kwargs):
            called[fqn] = called.get(fqn, 0) + 1
            key = call_key(fqn, called[fqn])
            shapes[key] = (len(args), 0)
            running.setdefault(fqn, []).append(key)
            return (tuple(mark(a, key, "arg", i) for i, a in enumerate(args)),
                    {k: mark(v, key, "kwarg", k) for k, v in kwargs.items()})
        return hook

    def after(fqn):
        def hook(module, args, kwargs, output):
            key = running[fqn].pop()
            leaves, spec = pytree.tree_flatten(output)
            shapes[key] = (shapes[key][0], len(leaves) or -1)
            return pytree.tree_unflatten([mark(v, key, "output", i)
                                          for i, v in enumerate(leaves)], spec)
        return hook
    hooks = []
    for fqn in fqns:
        module = model.get_submodule(fqn)
        hooks.append(module.register_forward_pre_hook(before(fqn), with_kwargs=True))
        hooks.append(module.register_forward_hook(after(fqn), with_kwargs=True))
    try:
        yield
    finally:
        for hook in hooks:
            hook.remove()


def _take_boundaries(graph: fx.Graph, shapes: dict) -> dict[str, ModuleCall]:
    """Remove the boundary marks from ``graph``; return each marked module's call."""
    calls = {fqn: ModuleCall((None,) * n_args, {}, (None,) * max(n_out, 0))
             for fqn, (n_args, n_out) in shapes.items()}
    for node in list(graph.nodes):
        if node.target is not torch.ops.fxtp.boundary.default:
            continue
        value, fqn, kind, key = node.args
        call = calls[fqn]
        if kind == "arg":
            call.args = call.args[:int(key)] + (value,) + call.args[int(key) + 1:]
        elif kind == "kwarg":
            call.kwargs[key] = value
        else:
            call.outputs = call.outputs[:int(key)] + (value,) + call.outputs[int(key) + 1:]
        node.replace_all_uses_with(value)
        graph.erase_node(node)
    return calls


@contextlib.contextmanager
def _marking_checkpoints(model: torch.nn.Module, fqns: Iterable[str], regions: dict):
    """While tracing, mark the nodes of every checkpoint region (and of every call of the
    modules ``fqns``) with the region's number; ``regions`` gets each region's
    ``checkpoint`` options. A reentrant region (``use_reentrant=True``) is recomputed as a
    non-reentrant one: the same gradients where an input requires one, which reentrant
    checkpointing needs to compute any (``enable_input_require_grads``)."""
    def region(options):
        number = len(regions)
        regions[number] = options
        return fx_traceback.annotate({REGION: number})

    def checkpoint_region(fn, preserve_rng_state=True, context_fn=cp.noop_context_fn,
                          determinism_check=cp._DEFAULT_DETERMINISM_MODE, debug=False,
                          *args, **kwargs):
        with region(dict(preserve_rng_state=preserve_rng_state, context_fn=context_fn,
                         determinism_check=determinism_check, debug=debug)):
            yield

    entered: list = []

    def enter(*_):
        entered.append(region({}))
        entered[-1].__enter__()

    def leave(*_):
        entered.pop().__exit__(None, None, None)
    hooks = [h for fqn in fqns for h in (model.get_submodule(fqn).register_forward_pre_hook(enter),
                                         model.get_submodule(fqn).register_forward_hook(leave))]
    def reentrant(function, preserve_rng_state, *args):  # recomputed as a region too
        with region(dict(preserve_rng_state=preserve_rng_state)):
            return function(*args)

    original = cp._checkpoint_without_reentrant_generator
    cp._checkpoint_without_reentrant_generator = checkpoint_region
    cp.CheckpointFunction.apply = reentrant
    try:
        yield
    finally:
        cp._checkpoint_without_reentrant_generator = original
        del cp.CheckpointFunction.apply  # torch.autograd.Function's own again
        for hook in hooks:
            hook.remove()
        while entered:  # a trace stopped inside a module's call (a block to trace after
            entered.pop().__exit__(None, None, None)  # all): its region mark ends here


_HOP = torch.ops.higher_order


def _inline_regions(gm: fx.GraphModule) -> None:
    """Inline the regions export wraps in a higher-order op, so their ops get placements
    like any other, keeping their meaning: the region's ops run between calls entering and
    leaving its mode (the functions dynamo's own graphs use for autocast), so each runs as
    on a single device, and are marked ``meta[MODE_REGION]`` so no pass moves them out.

    * ``torch.no_grad()`` / ``enable_grad()`` (Hugging Face computes rotary tables under
      no_grad; spectral norm's power iteration writes its vectors with ``out=``, which
      autograd refuses outside no_grad): outputs of a no-grad region are detached, so
      nothing in it gets gradients, except an input the region hands back as it is (a
      ``Tensor.to`` that changes nothing returns its tensor itself, gradient and all:
      DeepSeek-V3.2-style indexers cast the hidden states under no_grad, and export then
      routes every later use of them through the region);
    * ``torch.autocast(...)``: between ``_enter_autocast`` and ``_exit_autocast``.

    Nested regions are inlined inside out."""
    graph = gm.graph
    for node in list(graph.nodes):
        if node.target is _HOP.wrap_with_set_grad_enabled:
            (enabled, submod, *operands), state = node.args, None
            enter_fn, exit_fn, mode = _enter_grad_mode, _exit_grad_mode, (enabled,)
        elif node.target is _HOP.wrap_with_autocast:
            state, submod, operands = node.args[:4], node.args[4], node.args[5:]
            enter_fn, exit_fn, mode = enter_autocast, exit_autocast, tuple(state)
        else:
            continue
        region = getattr(gm, submod.target)
        _inline_regions(region)
        env = dict(zip([n for n in region.graph.nodes if n.op == "placeholder"], operands))
        with graph.inserting_before(node):
            enter = graph.call_function(enter_fn, mode)
            enter.meta["nn_module_stack"] = dict(node.meta.get("nn_module_stack", {}))
            for inner in region.graph.nodes:
                if inner.op == "placeholder":
                    continue
                if inner.op == "output":
                    outs = [env[o] for o in inner.args[0]]
                    break
                env[inner] = graph.node_copy(inner, lambda a: env[a])
                env[inner].meta[MODE_REGION] = True
                if state is not None:
                    env[inner].meta.setdefault(AUTOCAST, tuple(state))
            leave = graph.call_function(exit_fn, (enter,))
            leave.meta["nn_module_stack"] = enter.meta["nn_module_stack"]  # where it was entered
            if state is None and not enabled:
                detached = []
                for out in outs:
                    returned = _returned_input(out, operands)
                    if returned is None:
                        returned = graph.call_function(torch.ops.aten.detach.default, (out,))
                        returned.meta.update(out.meta)
                    detached.append(returned)
                outs = detached
        for user in list(node.users):
            user.replace_all_uses_with(outs[user.args[1]])
            graph.erase_node(user)
        graph.erase_node(node)
        graph.erase_node(submod)
        delattr(gm, submod.target)


@has_side_effect
def _enter_grad_mode(enabled: bool) -> bool:
    """Enter an inlined ``no_grad`` / ``enable_grad`` region; returns the mode to restore."""
    previous = torch.is_grad_enabled()
    torch.set_grad_enabled(enabled)
    return previous


@has_side_effect
def _exit_grad_mode(previous: bool) -> None:
    torch.set_grad_enabled(previous)


_RETURN_SELF = {torch.ops.aten.to.dtype, torch.ops.aten.to.dtype_layout,
                torch.ops.aten.to.device, torch.ops.aten.to.other}
"""``Tensor.to`` overloads: each returns its tensor itself where it changes nothing."""


def _returned_input(node: fx.Node, operands) -> Optional[fx.Node]:
    """The operand ``node`` is, through ``Tensor.to`` calls that change nothing (no copy,
    same dtype, device, layout and strides): eagerly, the very tensor, still requiring
    gradients under no_grad. ``None`` where ``node`` is a new tensor."""
    while isinstance(node, fx.Node) and node not in operands:
        if node.target not in _RETURN_SELF or normalize_function(
                node.target, node.args, node.kwargs,
                normalize_to_only_use_kwargs=True).kwargs.get("copy", False):
            return None
        source = node.args[0]
        new, old = node.meta.get("val"), getattr(source, "meta", {}).get("val")
        if not isinstance(new, torch.Tensor) or not isinstance(old, torch.Tensor) or \
                (new.dtype, new.device, new.layout, new.stride()) != \
                (old.dtype, old.device, old.layout, old.stride()):
            return None
        node = source
    return node if isinstance(node, fx.Node) else None


def _read_buffers_by_name(gm: fx.GraphModule, model: torch.nn.Module) -> None:
    """Reads of a buffer reached through a plain object (a Hugging Face ``StaticCache``
    layer's keys, which its export wrapper registers as buffers) are traced as reads of
    constants export lifts (``lifted_tensor_*``) that alias the buffer: they become reads
    of the buffer under its name, so passes that place or shard it (a KV cache) see every
    read and write, and the result holds one copy of it."""
    names = {*dict(model.named_parameters(remove_duplicate=False)),
             *dict(model.named_buffers(remove_duplicate=False))}

    def key(t):
        return (t.data_ptr(), t.storage_offset(), tuple(t.shape), tuple(t.stride()), t.dtype)
    def real(t):  # a tensor with storage (not meta, not a trace's fake)
        return type(t) in (torch.Tensor, torch.nn.Parameter) and not t.is_meta
    buffers = {key(b): fqn for fqn, b in gm.named_buffers(remove_duplicate=False)
               if fqn in names and real(b) and b.numel()}
    lifted = set()
    for node in gm.graph.nodes:
        if node.op != "get_attr" or node.target in names:
            continue
        owner, _, attr_name = node.target.rpartition(".")
        value = getattr(gm.get_submodule(owner), attr_name, None)
        fqn = buffers.get(key(value)) if real(value) and value.numel() else None
        if fqn is not None:
            node.target = fqn
            lifted.add((owner, attr_name))
    for owner, attr_name in lifted:
        module = gm.get_submodule(owner)
        module._buffers.pop(attr_name, None)
        module.__dict__.pop(attr_name, None)
    if lifted:
        gm.recompile()


def _reject_higher_order_ops(gm: fx.GraphModule) -> None:
    """Higher-order ops fxtp does not shard through are a :class:`TraceError` naming the op
    and the module, never a crash inside a pass."""
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.target not in (_HOP.cond, _HOP.flex_attention) \
                and isinstance(node.target, HigherOrderOperator):
            stack = node.meta.get("nn_module_stack") or {}
            fqn = next((path for path, _ in reversed(list(stack.values())) if path), "<root>")
            raise TraceError(
                f"module '{fqn}' calls the higher-order op {node.target.name()} "
                f"(node '{node.name}'), which fxtp cannot parallelize yet (it inlines "
                f"no_grad / enable_grad / autocast regions, keeps checkpoint regions, "
                f"propagates into torch.cond's branches and shards flex_attention by "
                f"heads). "
                f"Keep that code out of the planned model, or express it without "
                f"{node.target.name()}.")


def _take_export_guards(gm: fx.GraphModule, guarded: bool) -> Optional[tuple]:
    """Remove export's input guards and metadata asserts from ``gm``'s graph (fxtp's module
    takes local shards, whose shapes differ from the traced global ones); return the
    guards (export's ``_guards_fn``: what the trace assumed of dynamic sizes) and the names
    of the inputs they read, for :func:`fxtp.runtime.guards.guard_inputs` to check on global
    shapes, or ``None`` where export guarded nothing (``guarded``: its guards code is not
    empty)."""
    taken = None
    for node in list(gm.graph.nodes):
        if node.op == "call_module" and node.target == "_guards_fn":
            if guarded:
                taken = (gm._guards_fn, tuple(getattr(a, "name", "") for a in node.args))
            gm.graph.erase_node(node)
        elif node.target is torch.ops.aten._assert_tensor_metadata.default:
            gm.graph.erase_node(node)
    if hasattr(gm, "_guards_fn"):
        delattr(gm, "_guards_fn")
    gm.graph.lint()
    return taken
