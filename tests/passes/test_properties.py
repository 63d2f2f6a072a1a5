"""Property: any stack of linear, norm, attention and activation layers under any plan the
styles accept trains like the single-device model (fp64 outputs, every gradient, and
parameters after two AdamW steps), at world sizes 2 and 4.

Hypothesis draws (model structure, plan) pairs as plain data in the test process; the
ranks build the model from them. Examples are derandomized (the same ones every run) and
bounded for the CI budget; raise ``MAX_EXAMPLES`` to search further locally."""
import os

import torch
import torch.nn as nn
import torch.nn.functional as F
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

import fxtp
from fxtp import Replicate, Shard
from tests.helpers import models
from tests.helpers.parity import check_parity, example

MAX_EXAMPLES = int(os.environ.get("FXTP_PROPERTY_EXAMPLES", 8))
B, T, HEADS = 2, 8, 4
ACTIVATIONS = {"relu": F.relu, "gelu": F.gelu, "silu": F.silu, "tanh": torch.tanh}
LINEAR_STYLES = [None, ("colwise", None), ("colwise", "R"), ("rowwise", None),
                 ("rowwise", "S1")]
LINEARS = {"mlp": ["up", "down"], "attention": ["wq", "wk", "wv", "wo"]}


class FeedForward(nn.Module):
    def __init__(self, dim, hidden, act, bias):
        super().__init__()
        self.act = act
        self.up, self.down = nn.Linear(dim, hidden, bias=bias), nn.Linear(hidden, dim, bias=bias)

    def forward(self, x):
        return self.down(ACTIVATIONS[self.act](self.up(x)))


class Activation(nn.Module):
    def __init__(self, act):
        super().__init__()
        self.act = act

    def forward(self, x):
        return ACTIVATIONS[self.act](x)


def make_layer(layer: dict, dim: int) -> nn.Module:
    kind = layer["kind"]
    if kind == "mlp":
        return FeedForward(dim, layer["hidden"], layer["act"], layer["bias"])
    if kind == "attention":
        return models.Attention(dim, HEADS, bias=layer["bias"])
    if kind == "layernorm":
        return nn.LayerNorm(dim)
    if kind == "rmsnorm":
        return nn.RMSNorm(dim)
    return Activation(layer["act"])


class Stack(nn.Module):
    """Layers from plain data, each applied as ``x = layer(x)`` or ``x = x + layer(x)``."""

    def __init__(self, spec: dict):
        super().__init__()
        self.layers = nn.ModuleList(make_layer(layer, spec["dim"]) for layer in spec["layers"])
        self.residual = [layer["residual"] for layer in spec["layers"]]

    def forward(self, x):
        for layer, residual in zip(self.layers, self.residual):
            x = x + layer(x) if residual else layer(x)
        return x


def make_style(style):
    kind, layout = style
    if kind == "sequence":
        return fxtp.SequenceParallel()
    output = {None: None, "R": Replicate(), "S1": Shard(1)}[layout]
    cls = fxtp.ColwiseParallel if kind == "colwise" else fxtp.RowwiseParallel
    return cls(output_layouts=output)


@st.composite
def stacks_and_plans(draw):
    """``(spec, plan)``: plan maps module FQNs to ``(style, output layout)``."""
    dim = draw(st.sampled_from([8, 16]))
    layers, plan = [], {}
    for i in range(draw(st.integers(1, 4))):
        kind = draw(st.sampled_from(["mlp", "attention", "layernorm", "rmsnorm", "act"]))
        layer = {"kind": kind, "residual": draw(st.booleans()), "bias": draw(st.booleans()),
                 "act": draw(st.sampled_from(sorted(ACTIVATIONS))),
                 "hidden": dim * draw(st.sampled_from([2, 4]))}
        layers.append(layer)
        for name in LINEARS.get(kind, []):
            style = draw(st.sampled_from(LINEAR_STYLES))
            if style:
                plan[f"layers.{i}.{name}"] = style
        if kind.endswith("norm") and draw(st.booleans()):
            plan[f"layers.{i}"] = ("sequence", None)
    assume(any(layer["kind"] != "act" for layer in layers))  # something to train
    return {"dim": dim, "layers": layers}, plan


def parity(rank, world, spec, plan):
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # fallbacks to gathered inputs are warned about
        check_parity(rank, world, lambda: Stack(spec),
                     {fqn: make_style(s) for fqn, s in plan.items()},
                     [example(B, T, spec["dim"])], dtype=torch.float64, steps=2)


@settings(max_examples=MAX_EXAMPLES, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(case=stacks_and_plans())
def test_random_stacks_under_random_plans_match_single_device(ranks, case):
    spec, plan = case
    ranks.run(parity, spec, plan)
