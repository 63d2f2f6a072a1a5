"""Parallel styles: what a plan says about one module.

The constructors mirror ``torch.distributed.tensor.parallel`` (same keyword arguments and
defaults). fxtp tracks the true placement of every value, so a style reduces to a
:class:`ModuleSharding`: how the module's parameters are split and which layouts its
inputs and outputs must have at the module boundary. fxtp's graph always computes on local
tensors; ``use_local_output=False`` only makes a root output that is the module's output
come back as a DTensor, as torch's style hands it on (:mod:`fxtp.edges.dtensor_outputs`).
"""
from __future__ import annotations

import dataclasses
from typing import Optional, Sequence, Union

import torch.nn as nn
from torch.distributed.tensor import Partial, Placement, Replicate, Shard

from ..passes.errors import PlanError
from ..passes.graph import Layouts, ModuleSharding

def _check_placement(p, what: str):
    if p is None:
        return None
    if not isinstance(p, Placement):
        raise PlanError(f"{what} must be a torch.distributed.tensor placement "
                        f"(Shard(d), Replicate() or Partial()), got {p!r}")
    if isinstance(p, Partial) and p.reduce_op != "sum":
        raise PlanError(f"{what}: only Partial('sum') is supported, got {p!r}")
    return p


def _layouts(value, what: str) -> Layouts:
    if value is None:
        return None
    if isinstance(value, Placement):
        value = (value,)
    return tuple(_check_placement(p, f"{what}[{i}]") for i, p in enumerate(value))


def _kwarg_layouts(value, what: str) -> dict[str, Placement]:
    return {k: _check_placement(p, f"{what}[{k!r}]") for k, p in (value or {}).items()}


class ParallelStyle:
    """Base class. Subclasses implement :meth:`shard`."""

    def shard(self, fqn: str, module: nn.Module) -> ModuleSharding:
        raise NotImplementedError

    def __repr__(self):
        args = ", ".join(f"{k}={v!r}" for k, v in vars(self).items())
        return f"{type(self).__name__}({args})"

    def _unsupported(self, fqn: str, module: nn.Module, supported: str):
        name = fqn or "<root>"
        return PlanError(
            f"{type(self).__name__} cannot shard module '{name}' of type "
            f"{type(module).__name__}: it supports {supported}. Plan its child modules "
            f"instead, or use PrepareModuleInput/PrepareModuleOutput to change layouts "
            f"at this module's boundary.")


def shard_module(style: "ParallelStyle", fqn: str, module: nn.Module) -> ModuleSharding:
    """``style.shard(fqn, module)``, also through PEFT's ``ModulesToSaveWrapper`` (a head
    or embedding fine-tuned whole: ``modules_to_save=["lm_head"]``): the wrapped
    ``original_module`` and each adapter's trainable copy in ``modules_to_save`` are split
    as the style splits the module, and the wrapper's inputs and outputs laid out as its."""
    original = getattr(module, "original_module", None)
    copies = getattr(module, "modules_to_save", None)
    if not (isinstance(original, nn.Module) and isinstance(copies, nn.ModuleDict)):
        return style.shard(fqn, module)
    inner = style.shard(f"{fqn}.original_module", original)
    params = {f"original_module.{k}": p for k, p in inner.params.items()}
    for name, copy in copies.items():
        params.update(_params_under(style, fqn, f"modules_to_save.{name}", copy))
    return dataclasses.replace(inner, fqn=fqn, params=params)


def _params_under(style: "ParallelStyle", fqn: str, path: str, module: nn.Module) -> dict:
    """The placements ``style`` gives the parameters of ``module``, the submodule at
    ``path`` of module ``fqn``, by their paths below ``fqn``."""
    return {f"{path}.{k}": p for k, p in style.shard(f"{fqn}.{path}", module).params.items()}


def _lora(module: nn.Module):
    """PEFT's LoRA layer: its wrapped ``base_layer`` and its adapters' down (``lora_A``)
    and up (``lora_B``) projections by adapter name; ``None`` for any other module."""
    base, down, up = (getattr(module, n, None) for n in ("base_layer", "lora_A", "lora_B"))
    if isinstance(base, nn.Module) and isinstance(down, nn.ModuleDict) and \
            isinstance(up, nn.ModuleDict) and len(down):
        return base, down, up
    return None


def _own_lora(module: nn.Module) -> bool:
    """A linear layer holding its own ``weight`` (and ``bias``, DoRA's ``magnitude``)
    beside a low-rank adapter's down (``lora_a``) and up (``lora_b``) ``nn.Linear``, as
    torchtune's ``LoRALinear`` and ``DoRALinear`` are."""
    own = dict(module.named_parameters(recurse=False))
    return isinstance(getattr(module, "lora_a", None), nn.Linear) and \
        isinstance(getattr(module, "lora_b", None), nn.Linear) and \
        own.keys() <= {"weight", "bias", "magnitude"} and own.get("weight") is not None and \
        own["weight"].dim() == 2


def _adapted(style: "ParallelStyle", fqn: str, base: nn.Module, split: nn.ModuleDict,
             side: str) -> dict:
    """The parameter placements of a LoRA layer under ``style``: its base layer's as the
    style gives them, and the adapters' projections on ``side`` (``lora_B`` colwise: the
    output features; ``lora_A`` rowwise: the input features) split the same way; the
    other side, r wide, is replicated."""
    params = _params_under(style, fqn, "base_layer", base)
    for name, projection in split.items():
        params.update(_params_under(style, fqn, f"{side}.{name}", projection))
    return params


def _is_transposed_linear(module: nn.Module) -> bool:
    """Hugging Face's ``Conv1D`` (GPT-2): a linear layer whose weight is (in, out)."""
    return type(module).__name__ == "Conv1D" and hasattr(module, "nf")


_SUPPORTED = ("nn.Linear, nn.Embedding, Conv1D, PEFT's LoRA layers around them and LoRA "
              "layers holding their own weight (torchtune's LoRALinear, DoRALinear)")


class ColwiseParallel(ParallelStyle):
    """Shard ``nn.Linear`` (and Hugging Face ``Conv1D``, and LoRA layers: PEFT's around a
    base layer, torchtune's holding their own weight) on output features, ``nn.Embedding``
    on the embedding dim.
    Input must be Replicate; output is Shard(-1) unless ``output_layouts`` says otherwise."""

    def __init__(self, *, input_layouts: Optional[Placement] = None,
                 output_layouts: Optional[Placement] = None, use_local_output: bool = True):
        self.input_layouts = _check_placement(input_layouts, "input_layouts") or Replicate()
        self.output_layouts = _check_placement(output_layouts, "output_layouts") or Shard(-1)
        self.use_local_output = use_local_output

    def shard(self, fqn, module):
        if isinstance(module, nn.Linear):
            params = {"weight": Shard(0), "bias": Shard(0)}
        elif isinstance(module, nn.Embedding) or _is_transposed_linear(module):
            params = {"weight": Shard(1), "bias": Shard(0)}
        elif (lora := _lora(module)) is not None:
            base, _, up = lora
            params = _adapted(self, fqn, base, up, "lora_B")
        elif _own_lora(module):  # the adapter's up projection and the magnitudes follow
            params = {"weight": Shard(0), "bias": Shard(0), "magnitude": Shard(0),
                      "lora_b.weight": Shard(0)}
        else:
            raise self._unsupported(fqn, module, _SUPPORTED)
        return ModuleSharding(fqn, self, params, input_layouts=(self.input_layouts,),
                              desired_inputs=(Replicate(),),
                              desired_outputs=(self.output_layouts,))


class RowwiseParallel(ParallelStyle):
    """Shard ``nn.Linear`` on input features (input must be Shard(-1)) or ``nn.Embedding``
    on the vocabulary (input Replicate). The partial output is reduced to
    ``output_layouts``: all-reduce for Replicate, reduce-scatter for Shard."""

    def __init__(self, *, input_layouts: Optional[Placement] = None,
                 output_layouts: Optional[Placement] = None, use_local_output: bool = True):
        self.input_layouts = _check_placement(input_layouts, "input_layouts") or Shard(-1)
        self.output_layouts = _check_placement(output_layouts, "output_layouts") or Replicate()
        self.use_local_output = use_local_output

    def shard(self, fqn, module):
        if isinstance(module, nn.Linear):
            params, desired = {"weight": Shard(1), "bias": Replicate()}, Shard(-1)
        elif _is_transposed_linear(module):
            params, desired = {"weight": Shard(0), "bias": Replicate()}, Shard(-1)
        elif isinstance(module, nn.Embedding):  # vocab-sharded: masked local lookup
            params, desired = {"weight": Shard(0)}, Replicate()
        elif (lora := _lora(module)) is not None:
            base, down, _ = lora
            params = _adapted(self, fqn, base, down, "lora_A")
            desired = self.shard(f"{fqn}.base_layer", base).desired_inputs[0]
        elif _own_lora(module):  # the adapter's down projection follows
            params = {"weight": Shard(1), "bias": Replicate(), "magnitude": Replicate(),
                      "lora_a.weight": Shard(1)}
            desired = Shard(-1)
        else:
            raise self._unsupported(fqn, module, _SUPPORTED)
        return ModuleSharding(fqn, self, params, input_layouts=(self.input_layouts,),
                              desired_inputs=(desired,),
                              desired_outputs=(self.output_layouts,))


class ExpertTensorParallel(ParallelStyle):
    """Shard every expert of a mixture-of-experts module on its intermediate dim (Megatron's
    expert tensor parallelism; Hugging Face's ``moe_tp_experts``): each expert's input
    projection colwise, its output projection rowwise. The module holds the experts'
    weights stacked in 3-D parameters, as Hugging Face's ``*Experts`` do: ``gate_up_proj``
    (gate and up fused along the intermediate dim) or ``up_proj``, and ``down_proj``, each
    ``(experts, out, in)``, or ``(experts, in, out)`` where the module says
    ``is_transposed`` or its shapes do; biases ``(experts, out)``. Inputs (the hidden
    states and the routing) are taken Replicate; the partial output is reduced to
    ``output_layouts``. Like every style it only seeds placements: the program computed is
    the module's own, whatever its layout."""

    _IN = ("gate_up_proj", "up_proj")

    def __init__(self, *, output_layouts: Optional[Placement] = None):
        self.output_layouts = _check_placement(output_layouts, "output_layouts") or Replicate()

    def shard(self, fqn, module):
        weights = {n: p for n, p in module.named_parameters(recurse=False)}
        given = [n for n in self._IN if n in weights]
        if len(given) != 1 or "down_proj" not in weights or \
                any(weights[n].dim() != 3 for n in (*given, "down_proj")):
            raise self._unsupported(fqn, module, "modules holding their experts' weights "
                                    "as 3-D parameters: gate_up_proj or up_proj, and "
                                    "down_proj")
        out, inner = (2, 1) if _experts_transposed(fqn, module, weights[given[0]],
                                                   weights["down_proj"],
                                                   2 if given[0] == "gate_up_proj" else 1) \
            else (1, 2)
        params = {given[0]: Shard(out), f"{given[0]}_bias": Shard(1),
                  "down_proj": Shard(inner), "down_proj_bias": Replicate()}
        return ModuleSharding(fqn, self, params, input_layouts=(Replicate(),),
                              desired_inputs=(Replicate(),),
                              desired_outputs=(self.output_layouts,))


def _experts_transposed(fqn, module, up, down, fused: int) -> bool:
    """Whether experts' weights are stored ``(experts, in, out)``: as the module says
    (``is_transposed``, Hugging Face's experts implementations), else as their shapes do
    (the input projection's output dim is ``fused`` times the output projection's input)."""
    if hasattr(module, "is_transposed"):
        return bool(module.is_transposed)
    plain = up.shape[1] == fused * down.shape[2] and up.shape[2] == down.shape[1]
    transposed = up.shape[2] == fused * down.shape[1] and up.shape[1] == down.shape[2]
    if plain == transposed:
        raise PlanError(f"ExpertTensorParallel cannot tell how module '{fqn}' stores its "
                        f"experts' weights (shapes {tuple(up.shape)} and "
                        f"{tuple(down.shape)}): give it an is_transposed attribute")
    return transposed


class SequenceParallel(ParallelStyle):
    """Run a module whose parameters act elementwise on the hidden dim (LayerNorm, RMSNorm,
    Dropout, ...) on activations sharded along ``sequence_dim``; its parameters stay
    replicated and their gradients are all-reduced in backward (one bucket for all of them).
    At the root, the input is what each rank passes: its sequence shard."""

    def __init__(self, *, sequence_dim: int = 1, use_local_output: bool = False):
        self.sequence_dim = sequence_dim
        self.use_local_output = use_local_output

    def shard(self, fqn, module):
        matrices = [n for n, p in module.named_parameters() if p.dim() != 1]
        if matrices:
            raise PlanError(
                f"SequenceParallel cannot shard module '{fqn or '<root>'}' of type "
                f"{type(module).__name__}: its parameter '{matrices[0]}' is not a 1-D "
                f"per-feature vector. SequenceParallel is for modules whose parameters act "
                f"elementwise on the hidden dim (LayerNorm, RMSNorm, Dropout); plan linear "
                f"layers with ColwiseParallel/RowwiseParallel (output_layouts=Shard("
                f"{self.sequence_dim}) to leave a rowwise output sequence-sharded).")
        layout = (Shard(self.sequence_dim),)
        return ModuleSharding(fqn, self, input_layouts=layout, desired_inputs=layout)


class PrepareModuleInput(ParallelStyle):
    """Redistribute a module's inputs to ``desired_input_layouts`` on entry.
    ``input_layouts`` declares what the inputs are; at the root it says what each rank
    passes (a Shard layout means every rank passes its local shard)."""

    def __init__(self, *, input_layouts: Union[Placement, Sequence, None] = None,
                 desired_input_layouts: Union[Placement, Sequence, None] = None,
                 input_kwarg_layouts: Optional[dict] = None,
                 desired_input_kwarg_layouts: Optional[dict] = None,
                 use_local_output: bool = False):
        self.input_layouts = _layouts(input_layouts, "input_layouts")
        self.desired_input_layouts = _layouts(desired_input_layouts, "desired_input_layouts")
        self.input_kwarg_layouts = _kwarg_layouts(input_kwarg_layouts, "input_kwarg_layouts")
        self.desired_input_kwarg_layouts = _kwarg_layouts(
            desired_input_kwarg_layouts, "desired_input_kwarg_layouts")
        self.use_local_output = use_local_output
        if (self.input_layouts is None) != (self.desired_input_layouts is None):
            raise PlanError("PrepareModuleInput: give input_layouts and "
                            "desired_input_layouts together")
        if self.input_layouts and len(self.input_layouts) != len(self.desired_input_layouts):
            raise PlanError("PrepareModuleInput: input_layouts and desired_input_layouts "
                            "must have the same length")
        if set(self.input_kwarg_layouts) != set(self.desired_input_kwarg_layouts):
            raise PlanError("PrepareModuleInput: input_kwarg_layouts and "
                            "desired_input_kwarg_layouts must name the same keyword arguments")

    def shard(self, fqn, module):
        return ModuleSharding(fqn, self, input_layouts=self.input_layouts,
                              input_kwarg_layouts=self.input_kwarg_layouts,
                              desired_inputs=self.desired_input_layouts,
                              desired_kwargs=self.desired_input_kwarg_layouts)


class PrepareModuleOutput(ParallelStyle):
    """Redistribute a module's outputs to ``desired_output_layouts`` on exit."""

    def __init__(self, *, output_layouts: Union[Placement, Sequence],
                 desired_output_layouts: Union[Placement, Sequence],
                 use_local_output: bool = True):
        self.output_layouts = _layouts(output_layouts, "output_layouts")
        self.desired_output_layouts = _layouts(desired_output_layouts,
                                               "desired_output_layouts")
        self.use_local_output = use_local_output
        if len(self.output_layouts) != len(self.desired_output_layouts):
            raise PlanError("PrepareModuleOutput: output_layouts and desired_output_layouts "
                            "must have the same length")

    def shard(self, fqn, module):
        return ModuleSharding(fqn, self, desired_outputs=self.desired_output_layouts)


class PrepareModuleInputOutput(ParallelStyle):
    """:class:`PrepareModuleInput` and :class:`PrepareModuleOutput` on one module."""

    def __init__(self, *, input_layouts=None, desired_input_layouts=None,
                 input_kwarg_layouts=None, desired_input_kwarg_layouts=None,
                 use_local_input: bool = False, output_layouts, desired_output_layouts,
                 use_local_output: bool = True):
        self.prepare_module_input = PrepareModuleInput(
            input_layouts=input_layouts, desired_input_layouts=desired_input_layouts,
            input_kwarg_layouts=input_kwarg_layouts,
            desired_input_kwarg_layouts=desired_input_kwarg_layouts,
            use_local_output=use_local_input)
        self.prepare_module_output = PrepareModuleOutput(
            output_layouts=output_layouts, desired_output_layouts=desired_output_layouts,
            use_local_output=use_local_output)

    def shard(self, fqn, module):
        sharding = self.prepare_module_input.shard(fqn, module)
        sharding.style = self
        sharding.desired_outputs = self.prepare_module_output.desired_output_layouts
        return sharding


def returns_dtensors(style: ParallelStyle) -> bool:
    """Whether torch's version of ``style`` hands its module's outputs on as DTensors:
    ``use_local_output=False`` on a style that lays out outputs (``PrepareModuleInput``'s
    is about the module's inputs)."""
    if isinstance(style, PrepareModuleInputOutput):
        style = style.prepare_module_output
    return not isinstance(style, PrepareModuleInput) and \
        getattr(style, "use_local_output", True) is False


def from_torch(style) -> Optional[ParallelStyle]:
    """The fxtp style with the same meaning as a ``torch.distributed.tensor.parallel`` style
    object, so torch plans are accepted verbatim; ``None`` for a style of another project's
    (read by :class:`~fxtp.plans.foreign_styles.ForeignStyle`)."""
    import torch.distributed.tensor.parallel as tp

    def one(layouts):
        return layouts[0] if layouts else None

    if isinstance(style, tp.ColwiseParallel):
        return ColwiseParallel(input_layouts=one(style.input_layouts),
                               output_layouts=one(style.output_layouts),
                               use_local_output=style.use_local_output)
    if isinstance(style, tp.RowwiseParallel):
        return RowwiseParallel(input_layouts=one(style.input_layouts),
                               output_layouts=one(style.output_layouts),
                               use_local_output=style.use_local_output)
    if isinstance(style, tp.SequenceParallel):
        return SequenceParallel(sequence_dim=style.sequence_sharding[0].dim,
                                use_local_output=style.use_local_output)
    if isinstance(style, tp.PrepareModuleInputOutput):
        inp, out = style.prepare_module_input, style.prepare_module_output
        return PrepareModuleInputOutput(
            input_layouts=inp.input_layouts, desired_input_layouts=inp.desired_input_layouts,
            input_kwarg_layouts=inp.input_kwarg_layouts,
            desired_input_kwarg_layouts=inp.desired_input_kwarg_layouts,
            use_local_input=inp.use_local_output, output_layouts=out.output_layouts,
            desired_output_layouts=out.desired_output_layouts,
            use_local_output=out.use_local_output)
    if isinstance(style, tp.PrepareModuleInput):
        return PrepareModuleInput(input_layouts=style.input_layouts,
                                  desired_input_layouts=style.desired_input_layouts,
                                  input_kwarg_layouts=style.input_kwarg_layouts,
                                  desired_input_kwarg_layouts=style.desired_input_kwarg_layouts,
                                  use_local_output=style.use_local_output)
    if isinstance(style, tp.PrepareModuleOutput):
        return PrepareModuleOutput(output_layouts=style.output_layouts,
                                   desired_output_layouts=style.desired_output_layouts,
                                   use_local_output=style.use_local_output)
    return None
