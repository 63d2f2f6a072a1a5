"""Every pass ``parallelize`` runs is ``pass_(gm, ctx) -> gm``: it edits the graph module it
is given, returns it, and leaves what it found in a ``node.meta`` / ``gm.meta`` key that
``fxtp.passes.graph`` documents."""
import inspect

import pytest

import fxtp
from fxtp.passes import graph, place as place_module
from fxtp.passes.context import PassContext
from fxtp.passes.decompose import decompose_unruled
from fxtp.passes.gather_early import gather_early
from fxtp.passes.localize import localize
from fxtp.passes.modules import generate_code, outline_modules, stamp_modules
from fxtp.passes.place import RELAYOUTS, place, propagate_and_relayout
from fxtp.passes.posing import copy_data_attributes, give_parameter_properties
from fxtp.passes.propagate import propagate
from fxtp.passes.recompute import copy_written_collectives, outline_checkpoints
from fxtp.passes.rehearse import rehearse
from fxtp.passes.rewrite import rewrite
from fxtp.passes.seed import seed
from fxtp.passes.unfuse import unfuse_splits
from fxtp.passes.unpin import unpin_layouts
from fxtp.passes.unused import drop_unused
from tests.helpers.parity import example

PASSES = [drop_unused, decompose_unruled, seed, propagate, *RELAYOUTS, unfuse_splits,
          unpin_layouts, gather_early, propagate_and_relayout, place, rewrite, localize,
          rehearse, copy_written_collectives, outline_modules, outline_checkpoints,
          generate_code, stamp_modules, copy_data_attributes, give_parameter_properties]


@pytest.mark.parametrize("pass_", PASSES, ids=lambda p: p.__name__)
def test_a_pass_takes_the_graph_module_and_the_context_and_returns_the_graph_module(pass_):
    signature = inspect.signature(pass_)
    assert list(signature.parameters) == ["gm", "ctx"]
    assert signature.parameters["ctx"].annotation in (PassContext, "PassContext")
    assert signature.return_annotation in ("fx.GraphModule", "bool")  # bool: a relayout's test


def test_the_meta_keys_the_passes_write_are_documented_in_one_table():
    names = [n for n in dir(graph) if n.isupper() and isinstance(getattr(graph, n), str)
             and getattr(graph, n).startswith("fxtp_")]
    assert {"FALLBACKS", "RELAID", "PLACEMENT", "REGION", "INLINED", "RECOMPUTED",
            "DECOMPOSED"} <= set(names)
    undocumented = [n for n in names if f"``{n}``" not in graph.__doc__]
    assert undocumented == []


def test_the_placing_passes_leave_the_fallbacks_and_whether_they_relaid_on_the_module(
        fake_group, monkeypatch):
    fake_group(2)
    seen = {}

    def recorded(pass_):
        def run(gm, ctx):
            out = pass_(gm, ctx)
            assert out is gm
            seen[pass_.__name__] = (list(gm.meta[graph.FALLBACKS]), gm.meta.get(graph.RELAID))
            return out
        return run
    monkeypatch.setattr(place_module, "TRIALS", tuple(map(recorded, place_module.TRIALS)))
    from tests.helpers import models
    gm = fxtp.parallelize(models.FusedStack(2, split="gqa"), models.FUSED_PLAN,
                          example_inputs=(example(2, 8, 16),))
    assert set(seen) == {"unfuse_splits", "unpin_layouts", "gather_early"}
    assert seen["gather_early"][0] == gm.fxtp.fallbacks == []
    assert all(isinstance(relaid, bool) for _, relaid in seen.values())
