"""Plan resolution and style arguments: wildcards, root styles, and errors that name the
module and say how to fix the plan. None of these need a process group."""
import inspect

import pytest
import torch.distributed.tensor.parallel as torch_tp
import torch.nn as nn

import fxtp
from fxtp.plans.resolution import resolve_plan
from tests.helpers import models


def test_wildcard_keys_match_each_part_with_fnmatch():
    resolved = resolve_plan(models.Stack(n_layers=3), models.STACK_PLAN)
    assert sorted(resolved) == sorted(
        f"layers.{i}.{m}" for i in range(3)
        for m in ("attention.wq", "attention.wk", "attention.wv", "attention.wo",
                  "feed_forward.net1", "feed_forward.net2"))


def test_character_class_and_root_key():
    seq = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 4))
    assert sorted(resolve_plan(seq, {"[1-2]": fxtp.ColwiseParallel()})) == ["1", "2"]
    assert list(resolve_plan(nn.Linear(4, 4), fxtp.ColwiseParallel())) == [""]
    assert list(resolve_plan(seq, {"": fxtp.PrepareModuleInput()})) == [""]


UNMATCHED = r"'layers\.\*\.attention\.wz'.*closest.*layers\.\d\.attention\.w[qkvo]"


def test_a_key_that_matches_nothing_is_skipped_with_a_warning_naming_the_closest_fqns():
    """As torch's parallelize_module: plans are shared between model variants."""
    with pytest.warns(UserWarning, match=UNMATCHED + ".*skipping it"):
        resolved = resolve_plan(models.Stack(), {"layers.*.attention.wz": fxtp.ColwiseParallel(),
                                                 "layers.*.attention.wq": fxtp.ColwiseParallel()})
    assert sorted(resolved) == ["layers.0.attention.wq", "layers.1.attention.wq"]


def test_under_strict_a_key_that_matches_nothing_is_an_error():
    with pytest.raises(fxtp.PlanError, match=UNMATCHED + r".*\(strict=True\)"):
        resolve_plan(models.Stack(), {"layers.*.attention.wz": fxtp.ColwiseParallel()},
                     strict=True)


def test_two_keys_matching_one_module_is_an_error():
    with pytest.raises(fxtp.PlanError, match=r"'net1' is matched by plan keys 'net1' and 'net\*'"):
        resolve_plan(models.MLP(), {"net1": fxtp.ColwiseParallel(),
                                    "net*": fxtp.RowwiseParallel()})


@pytest.mark.parametrize("style", [fxtp.ColwiseParallel(), fxtp.RowwiseParallel()])
def test_a_style_on_a_module_type_it_cannot_shard_names_fqn_and_type(style):
    with pytest.raises(fxtp.PlanError, match=r"module 'layers\.0\.attention' of type "
                                             r"Attention.*Plan its child modules"):
        resolve_plan(models.Stack(), {"layers.0.attention": style})


def test_non_style_values_and_non_placements_are_rejected():
    with pytest.raises(fxtp.PlanError, match=r"plan\['net1'\] must be an fxtp parallel style"):
        resolve_plan(models.MLP(), {"net1": 3})  # strings are Hugging Face plan strings
    with pytest.raises(fxtp.PlanError, match="output_layouts must be a torch.distributed"):
        fxtp.ColwiseParallel(output_layouts=-1)
    with pytest.raises(fxtp.PlanError, match="same length"):
        fxtp.PrepareModuleInput(input_layouts=(fxtp.Shard(0), None),
                                desired_input_layouts=(fxtp.Replicate(),))


@pytest.mark.parametrize("name", ["ColwiseParallel", "RowwiseParallel", "PrepareModuleInput",
                                  "PrepareModuleOutput", "PrepareModuleInputOutput",
                                  "SequenceParallel"])
def test_style_constructors_mirror_torch(name):
    ours = inspect.signature(getattr(fxtp, name))
    theirs = inspect.signature(getattr(torch_tp, name))
    assert [(p.name, p.kind, p.default) for p in ours.parameters.values()] == \
           [(p.name, p.kind, p.default) for p in theirs.parameters.values()]


def test_placements_are_torchs_own_classes():
    from torch.distributed.tensor import Partial, Replicate, Shard
    assert (fxtp.Shard, fxtp.Replicate, fxtp.Partial) == (Shard, Replicate, Partial)
