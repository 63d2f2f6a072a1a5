"""torch.compile on fxtp's programs, on 2 gloo ranks (CPU inductor): compiled training and
inference match eager with one graph and no graph break, inductor issues exactly fxtp's
collectives, and the "fxtp" backend issues fewer and overlaps them with compute.

Compiles are slow on CPU: models are one or two layers, every rank process shares one
inductor cache (tests/conftest.py), and each test compiles once."""
import copy
import re

import pytest
import torch

import fxtp
from fxtp.passes.errors import FxtpError
from tests.helpers import models, transformer_models as tm
from tests.helpers.compiled import check_compiled, collectives_in, forward_and_backward
from tests.helpers.parity import LR, example as _x, tolerance
from tests.model_code.test_transformers import TOKENS, llama_plan

B, T, D = models.BATCH, models.SEQ, models.DIM

def _llama_with_loss():
    from tests.helpers.models import WithLoss
    return WithLoss(tm.Llama(tm.LlamaConfig(n_layers=1)))


# name -> (model, plan, inputs[, input placements])
CASES = {
    "mlp": (models.MLP, models.MLP_PLAN, [_x(B, T, D)]),
    "llama": (lambda: tm.Llama(tm.LlamaConfig(n_layers=1)), llama_plan(), [TOKENS]),
    # tensor + sequence + loss parallel with the loss inside the graph
    "llama_sp_loss": (_llama_with_loss,
                      {f"lm.{k}": v for k, v in tm.llama_sp_plan(loss_parallel=True).items()},
                      [TOKENS, TOKENS.roll(-1, 1)]),
}


def train(rank, world, case, backend="inductor", dtype=torch.float32):
    make, plan, inputs, *placements = CASES[case] if isinstance(case, str) else case
    return check_compiled(rank, world, make, plan, inputs, backend=backend, dtype=dtype,
                          input_placements=placements[0] if placements else None)


# "llama" (TP alone) compiles with inductor in test_checkpointing.py, and with the backend
# in the -m slow test below; here it runs with -m slow only, to keep the suite's time
@pytest.mark.parametrize("case", [pytest.param(c, marks=pytest.mark.slow) if c == "llama" else c
                                  for c in CASES])
def test_compiled_training_matches_eager(ranks2, case):
    counts = ranks2.run(train, case)[0]
    assert counts["compiled"] == counts["eager"]  # inductor lowers every collective as is


@pytest.mark.slow  # 14-22 s; the tests below (and test_rule_regressions) run the backend
def test_fxtp_backend_trains_a_megatron_plan_like_eager(ranks2):
    """A Megatron plan leaves the backend's passes nothing to remove: same collectives."""
    counts = ranks2.run(train, "llama", "fxtp")[0]
    assert counts["compiled"] == counts["eager"]


def infer(rank, world):
    torch.manual_seed(0)
    x = _x(B, T, D)
    gm = fxtp.parallelize(models.MLP(), models.MLP_PLAN, example_inputs=(x,))
    compiled = torch.compile(gm, fullgraph=True)
    with torch.no_grad():
        out, codes = torch._inductor.utils.run_and_get_code(compiled, x)
        torch.testing.assert_close(out, gm(x), **tolerance(torch.float32, out))
    return collectives_in(codes)


def test_compiled_inference_matches_eager(ranks2):
    assert ranks2.run(infer)[0] == {"all_reduce": 1}


def redundant(rank, world, backend):
    """fp64: the passes sum in another order than eager (one all-reduce for a reduce-scatter
    and an all-gather), and fp32 Adam steps amplify that past fp32's step tolerance."""
    return train(rank, world, (models.Redundant, models.REDUNDANT_PLAN, [_x(B, T, D)]),
                 backend, torch.float64)


def test_fxtp_backend_compiles_fewer_collectives(ranks2):
    """models.Redundant's plan reduce-scatters a value only to gather it back, and two
    independent rowwise outputs each all-reduce: the backend's passes turn the round trip
    into one all-reduce (forward and backward) and bucket the two, and the result trains
    like eager."""
    counts = ranks2.run(redundant, "fxtp")[0]
    assert counts["eager"] == ({"reduce_scatter": 1, "all_gather": 1, "all_reduce": 3},
                               {"all_reduce": 2, "reduce_scatter": 1, "all_gather": 1})
    assert counts["compiled"] == ({"all_reduce": 3}, {"all_reduce": 3})


def overlap(rank, world, backend):
    """Kernels inductor's backward program runs between issuing a collective and waiting
    for it, per collective."""
    torch.manual_seed(0)
    x = _x(B, T, D, seed=rank).requires_grad_()
    gm = fxtp.parallelize(models.Redundant(), models.REDUNDANT_PLAN, example_inputs=(x,))
    compiled = torch.compile(gm, backend=backend, fullgraph=True)
    _, codes = torch._inductor.utils.run_and_get_code(
        lambda: compiled(x).sum().backward())
    (code,) = forward_and_backward(codes)[1]
    between, in_flight = [], False
    for line in code.splitlines():
        if re.search(r"_c10d_functional\.(?!wait)\w+\.default\(", line):
            between.append(0)
            in_flight = True
        elif "wait_tensor.default(" in line:
            in_flight = False
        elif in_flight and re.search(r"^\s+(extern_kernels\.\w+|cpp_fused_\w+)\(", line):
            between[-1] += 1
    return between


def test_fxtp_backend_overlaps_backward_collectives_with_compute(ranks2):
    """Inductor waits for each backward all-reduce right after issuing it; the backend
    issues it before the weight gradients that do not need it and waits after them."""
    assert set(ranks2.run(overlap, "inductor")[0]) == {0}
    assert all(n > 0 for n in ranks2.run(overlap, "fxtp")[0])


def plain_model(rank, world):
    """A plain MLP under torch.compile(backend="fxtp", options={"plan": ...}) against the
    same single-device model: AdamW steps, then inference."""
    torch.manual_seed(0)
    model = models.MLP()
    ref = copy.deepcopy(model)
    compiled = torch.compile(model, backend="fxtp", fullgraph=True,
                             options={"plan": models.MLP_PLAN, "mesh": None})
    optimizers = [torch.optim.AdamW(m.parameters(), lr=LR) for m in (model, ref)]
    counts = []
    for step in range(2):
        x = _x(B, T, D, seed=step)
        weight = _x(B, T, D, seed=10 + step)

        def fwd_bwd():
            out = compiled(x)
            (out * weight).sum().backward()
            return out
        if step == 0:
            out, codes = torch._inductor.utils.run_and_get_code(fwd_bwd)
            counts += [collectives_in(c) for c in forward_and_backward(codes)]
        else:
            out = fwd_bwd()
        expected = ref(x)
        (expected * weight).sum().backward()
        torch.testing.assert_close(out, expected, **tolerance(torch.float32, expected, step))
        for name, p in model.named_parameters():  # full gradients on every rank
            q = ref.get_parameter(name)
            torch.testing.assert_close(p.grad, q.grad, **tolerance(torch.float32, q.grad, step))
        for opt in optimizers:
            opt.step()
            opt.zero_grad()
    with torch.no_grad():
        x = _x(B, T, D, seed=5)
        out, codes = torch._inductor.utils.run_and_get_code(compiled, x)
        torch.testing.assert_close(out, ref(x), **tolerance(torch.float32, out, 2))
    return counts + [collectives_in(codes)]


def test_fxtp_backend_parallelizes_a_plain_model_inside_compile(ranks2):
    fwd, bwd, inference = ranks2.run(plain_model)[0]
    assert fwd == inference == {"all_reduce": 1}
    # training through this path: the sharded parameters' gradients are gathered, bucketed
    assert bwd == {"all_gather": 1}


def test_plan_option_needs_a_full_graph(fake_group):
    fake_group(2)
    compiled = torch.compile(models.MLP(), backend="fxtp", options={"plan": models.MLP_PLAN})
    with pytest.raises(Exception, match="fullgraph=True") as raised:
        compiled(_x(B, T, D))
    assert isinstance(raised.value.inner_exception, FxtpError)


def test_unknown_options_are_refused(fake_group):
    fake_group(2)
    compiled = torch.compile(models.MLP(), backend="fxtp", options={"plan": models.MLP_PLAN,
                                                                    "mseh": None})
    with pytest.raises(Exception, match=r"'plan' and 'mesh'; unexpected: \['mseh'\]") as raised:
        compiled(_x(B, T, D))
    assert isinstance(raised.value.inner_exception, FxtpError)
