"""fxtp's parameters are ``DTensor`` s, its programs compute on plain local tensors
(:mod:`fxtp.edges.local_reads`) and optimizers step them locally (:mod:`fxtp.edges.local_steps`):
gradients, optimizer steps and state are those of the same program over plain parameters
(``dtensor_params=False``) bit for bit, a compiled call never sees a ``DTensor``, a
parameter's gradient is its read's (no copy), and the reads follow the parameters through
copies, conversions and ``requires_grad``."""
import copy

import pytest
import torch
import torch.fx as fx
import torch.nn.functional as F
from torch.distributed.tensor import DTensor, Replicate

import fxtp
from fxtp.examples.llama import Llama, LlamaConfig, llama_tp_plan
from fxtp.kernels.torch_compat import OWN_GRAD
from fxtp.passes.graph import attr
from tests.helpers.models import BATCH, DIM, MLP, SEQ

CFG = LlamaConfig(vocab_size=64, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=16)
TOKENS = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(0))
TARGETS = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(1))
OPTIMIZERS = {
    "adamw_foreach": lambda ps: torch.optim.AdamW(ps, lr=1e-2, foreach=True),
    "adamw_fused": lambda ps: torch.optim.AdamW(ps, lr=1e-2, fused=True),
    "sgd_momentum": lambda ps: torch.optim.SGD(ps, lr=1e-2, momentum=0.9),
}


def parallel(dtensor_params=True, dtype=torch.float32):
    torch.manual_seed(0)
    return fxtp.parallelize(Llama(CFG).to(dtype), llama_tp_plan(), example_inputs=(TOKENS,),
                            dtensor_params=dtensor_params)


def backward(model):
    F.cross_entropy(model(TOKENS).flatten(0, 1), TARGETS.flatten()).backward()


def local(t):
    return t._local_tensor if isinstance(t, DTensor) else t


def assert_same(got: dict, want: dict, what: str):
    assert got.keys() == want.keys()
    for name in want:
        assert torch.equal(local(got[name]), local(want[name])), f"{what} of {name}"


def grads(gm):
    return {n: p.grad for n, p in gm.named_parameters()}


def on_reads(gm) -> bool:
    """Is every parameter's gradient its read's, and none held apart?"""
    def shared(p):
        read = p._fxtp_read
        if read.grad is None:
            return p.grad is None
        return local(p.grad).data_ptr() == read.grad.data_ptr() and \
            OWN_GRAD.__get__(p) is None
    return all(map(shared, gm.parameters()))


def values(gm):
    return {n: p.detach() for n, p in gm.named_parameters()}


def test_the_program_reads_no_dtensor_while_the_parameters_are_dtensors(fake_group):
    fake_group(2)
    gm = parallel()
    assert all(isinstance(p, DTensor) for p in gm.parameters())
    graphs = [m for m in gm.modules() if isinstance(m, fx.GraphModule)]
    read = [n.target for m in graphs for n in m.graph.nodes
            if n.op == "get_attr" and isinstance(attr(m, n.target), DTensor)]
    assert read == []


def _recording(seen: list):
    def backend(graph, example_inputs):
        seen.append(example_inputs)
        return graph.forward
    return backend


def test_a_compiled_call_guards_and_runs_on_plain_tensors(fake_group):
    fake_group(2)
    gm = parallel()
    explained = torch._dynamo.explain(gm)(TOKENS)
    assert explained.graph_break_count == 0
    assert [str(g) for g in explained.out_guards if "DTENSOR" in str(g)] == []
    seen = []
    torch.compile(gm, backend=_recording(seen), fullgraph=True)(TOKENS)
    assert len(seen) == 1
    assert not [t for t in seen[0] if isinstance(t, DTensor)]


def test_a_compiled_call_compiles_no_frame_of_fxtps_own_code(fake_group):
    from pathlib import Path

    from torch._dynamo.convert_frame import input_codes

    from fxtp.kernels.torch_compat import run_as_python
    if not run_as_python(lambda: None):
        pytest.skip("this torch has no frame strategies: fxtp's hooks stay frames")
    fake_group(2)
    gm = parallel()
    torch._dynamo.reset()
    step = torch.compile(gm, backend="eager", fullgraph=True)
    for _ in range(3):
        step(TOKENS)
    root = Path(fxtp.__file__).resolve().parents[1]  # fxtp's hooks: Python, not frames
    codes = [ref() for ref in input_codes.seen if ref() is not None]
    assert [c.co_name for c in codes if Path(c.co_filename).is_relative_to(root)] == []
    assert "forward" in [c.co_name for c in codes]
    with pytest.raises(fxtp.InputError, match="input 'mask' was not given"):
        torch.compile(gm, backend="eager")(TOKENS, mask=None)  # still checked on every call


def test_compiled_blocks_take_plain_tensors(fake_group):
    fake_group(2)
    gm = parallel()
    seen = []
    fxtp.compile_blocks(gm, backend=_recording(seen), fullgraph=True)
    gm(TOKENS)
    assert seen and not [t for inputs in seen for t in inputs if isinstance(t, DTensor)]


def test_a_compiled_decode_step_compiles_once_across_positions(fake_group):
    from fxtp.examples.gpt_fast import ServeConfig, Transformer, tp_plan
    fake_group(2)
    cfg = ServeConfig(vocab_size=64, dim=32, n_layers=2, n_heads=2, n_kv_heads=2, hidden=64,
                      max_seq_len=16)
    model = Transformer(cfg)
    model.setup_caches(1)
    seq = torch.export.Dim("seq", min=1, max=cfg.max_seq_len)
    prompt = TOKENS[:1]
    gm = fxtp.parallelize(model, tp_plan(), example_inputs=(prompt, torch.arange(8)),
                          dynamic_shapes=({1: seq}, {0: seq}))
    seen = []
    step = torch.compile(gm, backend=_recording(seen), fullgraph=True)
    with torch.no_grad():
        for position in (8, 9, 10, 11):
            step(prompt[:, :1], torch.tensor([position]))
    assert len(seen) == 1


@pytest.mark.parametrize("hooked", [False, True], ids=["plain", "hooked"])
def test_gradients_accumulate_and_restart_after_zero_grad_as_over_plain_parameters(
        fake_group, hooked):
    fake_group(2)
    gm, plain = parallel(), parallel(dtensor_params=False)
    calls = []
    if hooked:  # a parameter's own hook sees its gradient, as a DTensor
        for p in gm.parameters():
            p.register_post_accumulate_grad_hook(
                lambda p: calls.append(isinstance(p.grad, DTensor)))
    for model in (gm, plain):
        backward(model)
        backward(model)
    assert calls == [True] * (2 * len(list(gm.parameters())) if hooked else 0)
    assert all(isinstance(g, DTensor) for g in grads(gm).values())
    assert on_reads(gm)
    assert_same(grads(gm), grads(plain), "accumulated gradient")
    for model in (gm, plain):
        model.zero_grad(set_to_none=True)
        backward(model)
    assert_same(grads(gm), grads(plain), "gradient after zero_grad")
    for model in (gm, plain):
        model.zero_grad(set_to_none=False)
        backward(model)
    assert_same(grads(gm), grads(plain), "gradient after zeroing in place")


def test_a_backward_after_one_that_raised_publishes_its_gradients(fake_group):
    fake_group(2)
    gm, plain = parallel(), parallel(dtensor_params=False)

    def fail(grad):
        raise RuntimeError("a hook failed")
    for model in (gm, plain):
        loss = F.cross_entropy(model(TOKENS).flatten(0, 1), TARGETS.flatten())
        out = model.layers[0].attention.wo.weight  # reached late in the backward
        handle = (out._fxtp_read if isinstance(out, DTensor) else out).register_hook(fail)
        with pytest.raises(RuntimeError, match="a hook failed"):
            loss.backward()
        handle.remove()
        model.zero_grad(set_to_none=True)
        backward(model)
    assert_same(grads(gm), grads(plain), "gradient after a backward that raised")
    assert on_reads(gm)


def test_a_held_gradient_that_cannot_be_added_to_raises_as_over_plain_parameters(fake_group):
    fake_group(2)
    gm, plain = parallel(), parallel(dtensor_params=False)
    for model in (gm, plain):
        stuck = model.layers[0].attention.wo.weight
        with torch.inference_mode():  # a held gradient that cannot be added to in place
            frozen = torch.zeros_like(local(stuck))
        stuck.grad = DTensor.__new__(DTensor, frozen, stuck._spec, requires_grad=False) \
            if isinstance(stuck, DTensor) else frozen
        with pytest.raises(RuntimeError, match="[Ii]nference"):
            backward(model)
    given = [{n: g for n, g in grads(m).items() if g is not None} for m in (gm, plain)]
    assert 0 < len(given[0]) < len(list(gm.parameters()))  # the backward stopped midway
    assert_same(*given, "gradients given before the one that raised")


def test_a_backward_with_create_graph_gives_gradients_differentiable_again(fake_group):
    fake_group(2)
    x = torch.randn(BATCH, SEQ, DIM, dtype=torch.float64,
                    generator=torch.Generator().manual_seed(2))
    plan = {"net1": fxtp.ColwiseParallel(), "net2": fxtp.RowwiseParallel()}

    def mlp(dtensor_params):
        torch.manual_seed(0)
        return fxtp.parallelize(MLP().double(), plan, example_inputs=(x,),
                                dtensor_params=dtensor_params)
    gm, plain = mlp(True), mlp(False)
    for model in (gm, plain):
        model(x).square().sum().backward(create_graph=True)
    assert all(g.requires_grad for g in grads(gm).values())
    assert_same({n: g.detach() for n, g in grads(gm).items()},
                {n: g.detach() for n, g in grads(plain).items()}, "create_graph gradient")
    for model in (gm, plain):  # the gradients' own backward reaches the parameters again
        sum((g.to_local() if isinstance(g, DTensor) else g).square().sum()
            for g in grads(model).values()).backward()
    assert_same({n: g.detach() for n, g in grads(gm).items()},
                {n: g.detach() for n, g in grads(plain).items()}, "gradient of the gradient")
    assert on_reads(gm)


def test_a_reentrant_checkpoint_and_a_second_backward_publish_every_gradient(fake_group):
    fake_group(2)
    gm, plain = parallel(), parallel(dtensor_params=False)
    for model in (gm, plain):  # the parameters' backward runs in a backward of its own
        start = torch.zeros((), requires_grad=True)
        logits = torch.utils.checkpoint.checkpoint(lambda s, m=model: m(TOKENS) + s, start,
                                                   use_reentrant=True)
        loss = F.cross_entropy(logits.flatten(0, 1), TARGETS.flatten())
        loss.backward(retain_graph=True)
        loss.backward()
    assert all(g is not None for g in grads(gm).values())
    assert_same(grads(gm), grads(plain), "gradient of two backwards through a checkpoint")
    assert on_reads(gm)


def test_a_backward_run_inside_another_gives_its_gradients_when_it_ends(fake_group):
    fake_group(2)
    outer, inner = parallel(), parallel()
    given = []

    def run_inner(grad):  # the outer backward has reached some of its reads by now
        with torch.enable_grad():
            backward(inner)
        given.append([p.grad is not None for p in inner.parameters()])
    read = outer.layers[0].attention.wo.weight._fxtp_read  # reached late in the backward
    handle = read.register_hook(run_inner)
    backward(outer)
    handle.remove()
    assert given == [[True] * len(list(inner.parameters()))]
    assert all(p.grad is not None for p in outer.parameters())


def test_backwards_on_two_threads_each_publish_their_gradients(fake_group):
    import threading
    fake_group(2)
    models, plain = [parallel(), parallel()], parallel(dtensor_params=False)
    backward(plain)
    threads = [threading.Thread(target=backward, args=(m,)) for m in models]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for model in models:
        assert_same(grads(model), grads(plain), "gradient of a backward on a thread")
        assert on_reads(model)


@pytest.mark.parametrize("kind", OPTIMIZERS)
def test_optimizer_steps_are_those_over_plain_parameters_bit_for_bit(fake_group, kind):
    fake_group(2)
    gm, plain = parallel(), parallel(dtensor_params=False)
    opts = {id(m): OPTIMIZERS[kind](m.parameters()) for m in (gm, plain)}
    for _ in range(3):
        for model in (gm, plain):
            backward(model)
            opts[id(model)].step()
            opts[id(model)].zero_grad()
    assert_same(values(gm), values(plain), f"{kind} after 3 steps")
    opt = opts[id(gm)]
    for p in gm.parameters():
        for value in opt.state[p].values():
            if value.ndim:
                assert isinstance(value, DTensor) and value.placements == p.placements
    assert all(isinstance(p, DTensor) for g in opt.param_groups for p in g["params"])
    again = OPTIMIZERS[kind](gm.parameters())  # the state handed out resumes the run
    again.load_state_dict(opt.state_dict())
    for model, o in ((gm, again), (plain, opts[id(plain)])):
        backward(model)
        o.step()
    assert_same(values(gm), values(plain), f"{kind} resumed from its state_dict")


def test_optimizer_state_set_between_steps_is_the_state_the_next_step_uses(fake_group):
    fake_group(2)
    gm, plain = parallel(), parallel(dtensor_params=False)
    opts = {id(m): torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (gm, plain)}
    for step in range(3):
        for model in (gm, plain):
            opt = opts[id(model)]
            backward(model)
            opt.step()
            opt.zero_grad()
            if step == 0:  # a value replaced, a value recomputed, a parameter's whole state
                for p in model.parameters():
                    opt.state[p]["exp_avg"] = torch.zeros_like(opt.state[p]["exp_avg"])
                    opt.state[p]["exp_avg_sq"] = opt.state[p]["exp_avg_sq"] * 4
                first = next(model.parameters())
                opt.state[first] = {k: v.clone() * 2 for k, v in opt.state[first].items()}
    assert_same(values(gm), values(plain), "after steps from state set between them")
    for p, q in zip(gm.parameters(), plain.parameters()):
        assert_same(opts[id(gm)].state[p], opts[id(plain)].state[q], "state after the steps")


@pytest.mark.parametrize("kind", OPTIMIZERS)
def test_an_optimizer_over_the_local_parameters_steps_as_over_plain_parameters(fake_group,
                                                                             kind):
    """The fast route: an optimizer built over ``fxtp.local_parameters(gm)`` steps the local
    shards themselves (no handover), bit for bit as over plain parameters, while the
    parameters stay ``DTensor`` s whose gradients are the ones stepped."""
    fake_group(2)
    gm, plain = parallel(), parallel(dtensor_params=False)
    reads = fxtp.local_parameters(gm)
    assert len(reads) == len(list(gm.parameters()))
    for read, p in zip(reads, gm.parameters()):
        assert not isinstance(read, DTensor) and read.data_ptr() == local(p).data_ptr()
    opts = {id(gm): OPTIMIZERS[kind](reads), id(plain): OPTIMIZERS[kind](plain.parameters())}
    for _ in range(3):
        for model in (gm, plain):
            backward(model)
            if model is gm:
                assert_same(grads(gm), {n: r.grad for n, r in
                                        zip(dict(gm.named_parameters()), reads)}, "gradient")
            opts[id(model)].step()
            opts[id(model)].zero_grad()
    assert_same(values(gm), values(plain), f"{kind} over the local parameters after 3 steps")
    assert all(p.grad is None for p in gm.parameters())


def test_a_step_over_local_parameters_of_a_module_moved_since_raises(fake_group):
    """A read taken before the parameters move to new storage (``to_empty``, ``.to(...)``)
    is no longer what the program reads: its step would be lost, so it raises, saying to
    take the local parameters again."""
    fake_group(2)
    gm = parallel()
    opt = torch.optim.SGD(fxtp.local_parameters(gm), lr=1e-2)
    backward(gm)
    opt.step()
    saved = copy.deepcopy(gm.state_dict())
    gm.to_empty(device="cpu")
    gm.load_state_dict(saved)
    backward(gm)
    with pytest.raises(fxtp.InputError, match=r"local_parameters\(gm\) again after the move"):
        opt.step()
    again = torch.optim.SGD(fxtp.local_parameters(gm), lr=1e-2)
    before = values(gm)
    again.step()
    assert not any(torch.equal(local(v), local(before[n])) for n, v in values(gm).items()
                   if v.grad is not None)


def test_an_optimizers_zero_grad_after_a_local_step_zeroes_or_drops_every_gradient(
        fake_group):
    fake_group(2)
    gm, plain = parallel(), parallel(dtensor_params=False)
    opts = {id(m): torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (gm, plain)}
    for model in (gm, plain):
        backward(model)
        opts[id(model)].step()
        opts[id(model)].zero_grad(set_to_none=False)
    assert all(isinstance(g, DTensor) and not local(g).any() for g in grads(gm).values())
    for model in (gm, plain):
        backward(model)  # into the zeroed gradients
    assert_same(grads(gm), grads(plain), "gradient after zeroing in place")
    assert on_reads(gm)
    for model in (gm, plain):
        opts[id(model)].step()
        opts[id(model)].zero_grad()
    assert all(g is None for g in grads(gm).values()) and on_reads(gm)
    assert all(isinstance(p, DTensor) for p in opts[id(gm)].param_groups[0]["params"])
    assert_same(values(gm), values(plain), "after two steps")


def test_a_step_where_some_parameters_have_no_gradient_is_that_over_plain_parameters(
        fake_group):
    fake_group(2)
    gm, plain = parallel(), parallel(dtensor_params=False)
    opts = {id(m): torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (gm, plain)}
    for _ in range(2):
        for model in (gm, plain):
            backward(model)
            model.layers[1].attention.wq.weight.grad = None
            opts[id(model)].step()
            opts[id(model)].zero_grad()
    assert_same(values(gm), values(plain), "after steps without wq's gradient")
    assert on_reads(gm)


def test_a_gradient_laid_out_otherwise_than_its_parameter_is_stepped_as_given(fake_group):
    fake_group(2)
    gm, plain = parallel(), parallel(dtensor_params=False)
    opts = {id(m): torch.optim.SGD(m.parameters(), lr=1e-2) for m in (gm, plain)}
    p = gm.layers[0].attention.wq.weight
    full = torch.randn(p.shape, generator=torch.Generator().manual_seed(2))
    replicated = DTensor.from_local(full, p.device_mesh, [Replicate()], run_check=False)
    for model in (gm, plain):
        backward(model)
    p.grad = replicated
    plain.layers[0].attention.wq.weight.grad = replicated.redistribute(
        p.device_mesh, p.placements).to_local()
    for model in (gm, plain):
        opts[id(model)].step()
    assert_same(values(gm), values(plain), "after a step with a replicated gradient")
    assert p.grad is replicated and p._fxtp_read.grad is None


def test_a_step_with_a_closure_and_one_after_a_step_that_raised_are_right(fake_group):
    fake_group(2)
    gm, plain = parallel(), parallel(dtensor_params=False)
    opts = {id(m): torch.optim.SGD(m.parameters(), lr=1e-2, momentum=0.9) for m in (gm, plain)}
    for model in (gm, plain):
        opt = opts[id(model)]

        def closure(model=model, opt=opt):
            opt.zero_grad()
            backward(model)
        opt.step(closure)
    assert_same(values(gm), values(plain), "after a step with a closure")

    def fail(optimizer, args, kwargs):
        raise RuntimeError("a hook failing mid-step")
    opt = opts[id(gm)]
    handle = opt.register_step_pre_hook(fail)
    backward(gm)
    with pytest.raises(RuntimeError, match="mid-step"):
        opt.step()
    handle.remove()
    backward(plain)
    for model in (gm, plain):  # the next step hands back what the failed one was handed
        opts[id(model)].step()
    assert_same(values(gm), values(plain), "after a failed step and a good one")
    assert all(isinstance(p, DTensor) for p in opt.param_groups[0]["params"])
    assert all(isinstance(v, DTensor) for s in opt.state.values() for v in s.values())


def test_requires_grad_set_on_the_module_or_the_parameter_is_followed(fake_group):
    fake_group(2)
    gm = parallel()
    compiled = torch.compile(gm, backend="aot_eager")
    gm.layers[0].requires_grad_(False)
    backward(compiled)
    assert all(p.grad is None for p in gm.layers[0].parameters())
    assert all(p.grad is not None for p in gm.layers[1].parameters())
    gm.zero_grad()
    gm.output.weight.requires_grad_(False)  # set directly: followed by an eager call
    backward(gm)
    assert gm.output.weight.grad is None and gm.norm.weight.grad is not None


def test_a_gradient_set_on_a_parameter_is_held_by_its_read_and_accumulated_into(fake_group):
    fake_group(2)
    gm, plain = parallel(), parallel(dtensor_params=False)
    p, q = gm.output.weight, plain.output.weight
    start = torch.randn(q.shape, generator=torch.Generator().manual_seed(3))
    given = DTensor.__new__(DTensor, start.clone(), p._spec, requires_grad=False)
    p.grad, q.grad = given, start.clone()
    for model in (gm, plain):
        backward(model)
    assert p.grad is given and on_reads(gm)  # the same DTensor, added to in place
    assert_same(grads(gm), grads(plain), "gradient accumulated into one set by hand")


def test_a_gradient_autograd_puts_on_the_dtensor_itself_is_added_to_the_reads(fake_group):
    """User code computing with a parameter itself (a penalty on ``p.to_local()``) leaves
    its gradient on the ``DTensor``; ``.grad`` is the sum, and the step takes it."""
    fake_group(2)
    gm, plain = parallel(), parallel(dtensor_params=False)
    opts = {id(m): torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (gm, plain)}
    for _ in range(2):
        for model in (gm, plain):
            loss = F.cross_entropy(model(TOKENS).flatten(0, 1), TARGETS.flatten())
            penalty = sum(local_view(p).square().sum() for p in model.parameters())
            (loss + 1e-2 * penalty).backward()
        assert_same(grads(gm), grads(plain), "gradient of the program and a penalty")
        assert on_reads(gm)
        for model in (gm, plain):
            opts[id(model)].step()
            opts[id(model)].zero_grad()
    assert_same(values(gm), values(plain), "after steps with a penalty")


def local_view(p):
    return p.to_local() if isinstance(p, DTensor) else p


def test_gradients_outlive_requires_grad_set_again_a_copy_and_new_storage(fake_group):
    fake_group(2)
    gm = parallel()
    backward(gm)
    before = {n: local(g).clone() for n, g in grads(gm).items()}
    gm.requires_grad_(True)  # reads renewed
    assert_same(grads(gm), before, "gradient after requires_grad_")
    gm.to("cpu").float()  # torch's _apply, each parameter swapped for a new one as it is
    assert all(type(p) is type(q) for p, q in zip(gm.parameters(), parallel().parameters()))
    assert_same(grads(gm), before, "gradient after .to() and .float()")
    assert on_reads(gm)
    twin = copy.deepcopy(gm)
    assert_same(grads(twin), before, "a copy's gradient")
    assert all(a._local_tensor.data_ptr() != b._local_tensor.data_ptr()
               for a, b in zip(grads(twin).values(), grads(gm).values()))
    gm.to_empty(device="cpu")  # new storage for every parameter and gradient
    assert all(isinstance(g, DTensor) and g.shape == p.shape
               for p, g in zip(gm.parameters(), grads(gm).values()))
    source = parallel()  # as gm was
    gm.load_state_dict(source.state_dict())
    with torch.no_grad():  # the rotary tables, not in the state dict
        for mine, theirs in zip(gm.buffers(), source.buffers()):
            mine.copy_(theirs)
    for model in (gm, twin):
        model.zero_grad()
        backward(model)  # each accumulates on its own reads, from zero
        assert_same(grads(model), before, "gradient after zero_grad")
        assert on_reads(model)


def test_a_deep_copy_reads_and_trains_its_own_parameters(fake_group):
    fake_group(2)
    gm = parallel()
    before = gm(TOKENS).detach()
    twin = copy.deepcopy(gm)
    assert twin.state_dict().keys() == gm.state_dict().keys()  # the rotary tables left out
    with torch.no_grad():
        for p in twin.parameters():
            p.mul_(0.5)
    assert not torch.equal(twin(TOKENS), before)
    assert torch.equal(gm(TOKENS), before)
    backward(twin)
    assert all(p.grad is None for p in gm.parameters())
    assert all(p.grad is not None for p in twin.parameters())


def test_a_module_moved_to_new_storage_is_read_there_compiled(fake_group):
    """``to_empty`` swaps every parameter's tensors (``nn.Module._apply``); a compiled
    program reads the new ones, as loaded afterwards."""
    fake_group(2)
    gm, other = parallel(), parallel()
    with torch.no_grad():
        for p in other.parameters():
            p.add_(1.0)
    compiled = torch.compile(gm, backend="aot_eager")
    compiled(TOKENS)
    gm.to_empty(device="cpu")
    gm.load_state_dict(other.state_dict())
    with torch.no_grad():  # the rotary tables, not in the state dict
        for mine, theirs in zip(gm.buffers(), other.buffers()):
            mine.copy_(theirs)
    assert torch.equal(compiled(TOKENS), other(TOKENS))


def test_parameters_assigned_by_load_state_dict_are_read(fake_group):
    fake_group(2)
    gm, other = parallel(), parallel()
    with torch.no_grad():
        for p in other.parameters():
            p.add_(1.0)
    gm.load_state_dict(other.state_dict(), assign=True)
    assert torch.equal(gm(TOKENS), other(TOKENS))
    backward(gm)
    assert all(isinstance(p.grad, DTensor) for p in gm.parameters())
