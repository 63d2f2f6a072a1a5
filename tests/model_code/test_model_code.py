"""Model code as other projects write it, beyond the layers a plan names: composite ops
torch keeps in the trace, fresh tensors filled by slice assignment (DeepSeek's MLA),
ops whose order varies between processes (a ``set`` iterated in ``forward``), and blocks
called more than once per step (recurrent models). Parity with the single-device model in
fp64 (forward, every gradient, 3 AdamW steps), strict (no fallback) unless a test is about
one, and the collectives each case needs."""
import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import fxtp
from fxtp.runtime.guards import structure_keys
from fxtp.passes.context import PassContext
from fxtp.passes.decompose import decompose_unruled
from fxtp.passes.graph import DECOMPOSED
from fxtp.passes.rules import rule_for
from tests.helpers.parity import check_parity, example

B, T, DIM, HEADS = 2, 8, 16, 4
HEAD = DIM // HEADS
ATTENTION = {"q": fxtp.ColwiseParallel(), "kv": fxtp.ColwiseParallel(),
             "o": fxtp.RowwiseParallel()}
MEGATRON = ({"all_reduce": 1}, {"all_reduce": 1})  # the row-parallel output; colwise inputs


def parity(rank, world, make, plan=ATTENTION, strict=True):
    return check_parity(rank, world, make, plan, [example(B, T, DIM)], dtype=torch.float64,
                        strict=strict)


class Projections(nn.Module):
    """The q, kv and o projections :data:`ATTENTION` plans; each case writes its forward."""

    def __init__(self):
        super().__init__()
        self.q = nn.Linear(DIM, DIM, bias=False)
        self.kv = nn.Linear(DIM, 2 * DIM, bias=False)
        self.o = nn.Linear(DIM, DIM, bias=False)


class CompositeViews(Projections):
    """Heads shaped with ``view_as`` / ``reshape_as`` / ``expand_as``, which the trace keeps
    as ops of their own (torch composes them of ``view`` and ``expand``)."""

    def __init__(self):
        super().__init__()
        self.gate = nn.Parameter(torch.randn(1, 1, HEADS, 1))

    def forward(self, x):
        q = self.q(x).view(B, T, HEADS, HEAD)
        k, v = self.kv(x).view(B, T, HEADS, 2 * HEAD).chunk(2, dim=-1)
        k = k.reshape_as(q)
        v = v.contiguous().view_as(q) * self.gate.expand_as(q)
        out = F.scaled_dot_product_attention(*(t.transpose(1, 2) for t in (q, k, v)))
        return self.o(out.transpose(1, 2).reshape_as(x))


def test_composite_ops_without_a_rule_are_placed_as_their_decomposition(ranks):
    """Megatron's collectives only: the per-head gate, which the plan leaves out and the
    model reads only on head shards, is held as this rank's heads (its gradient is this
    rank's alone, nothing to gather)."""
    assert ranks.run(parity, CompositeViews)[0] == MEGATRON


class MergedHeadsDropout(Projections):
    """fairseq's attention (XGLM, BART, OPT): heads merged into the batch for ``bmm``,
    dropout on the attention probabilities in that merged layout."""

    def forward(self, x):
        def merged(t):
            return t.view(B, T, HEADS, HEAD).transpose(1, 2).reshape(B * HEADS, T, HEAD)
        k, v = self.kv(x).chunk(2, dim=-1)
        scores = torch.bmm(merged(self.q(x)), merged(k).transpose(1, 2)) / HEAD ** 0.5
        probs = F.dropout(torch.softmax(scores, -1), p=0.3, training=True)
        out = torch.bmm(probs, merged(v)).view(B, HEADS, T, HEAD).transpose(1, 2)
        return self.o(out.reshape(B, T, DIM))


def test_dropout_on_heads_merged_into_the_batch_draws_each_ranks_blocks_of_the_mask(ranks):
    """The merged dim holds each batch row's heads, so a rank's heads are one block per
    row (``_StridedShard``): its mask is those blocks of the mask single-device dropout
    draws (parity with dropout on), not a gather."""
    assert ranks.run(parity, MergedHeadsDropout)[0] == MEGATRON


class SharedGate(CompositeViews):
    """The per-head gate also read whole (its mean scales the output)."""

    def forward(self, x):
        return super().forward(x) * self.gate.mean()


def test_a_parameter_read_only_on_shards_is_held_as_that_shard(fake_group):
    """The plan leaves the gate out; read only on head shards it is held as this rank's
    heads. Read whole as well, it stays whole."""
    fake_group(4)
    gm = fxtp.parallelize(CompositeViews(), ATTENTION, example_inputs=(example(B, T, DIM),))
    assert gm.fxtp.param_placements["gate"] == fxtp.Shard(2)
    assert gm.gate.to_local().shape == (1, 1, HEADS // 4, 1)
    gm = fxtp.parallelize(SharedGate(), ATTENTION, example_inputs=(example(B, T, DIM),))
    assert gm.fxtp.param_placements["gate"] == fxtp.Replicate()
    assert gm.fxtp.fallbacks == []


def test_decomposition_replaces_only_composite_ops_that_have_no_rule():
    class M(nn.Module):
        def forward(self, x, y):
            return x.view_as(y), F.linear(x, y.flatten(1)), x.type_as(y)
    x, y = torch.randn(4, 8), torch.randn(4, 2, 4)
    gm = torch.export.export(M(), (x, y), strict=False).module()
    assert decompose_unruled(gm, PassContext(world=1)).meta[DECOMPOSED] == [
        "view_as (aten.view_as.default)"]
    targets = {n.target for n in gm.graph.nodes if n.op == "call_function"}
    assert torch.ops.aten.linear.default in targets and rule_for(torch.ops.aten.linear.default)
    assert torch.ops.aten.view.default in targets
    assert all(torch.equal(a, b) for a, b in zip(gm(x, y), M()(x, y)))


class LatentAttention(Projections):
    """DeepSeek's MLA key: a fresh ``new_empty`` tensor filled by slice assignment with the
    head-sharded per-head part and the rotary part every head shares."""

    def __init__(self):
        super().__init__()
        self.rope = nn.Linear(DIM, HEAD, bias=False)

    def forward(self, x):
        q = self.q(x).view(B, T, HEADS, HEAD).transpose(1, 2)
        kv = self.kv(x).view(B, T, HEADS, 2 * HEAD).transpose(1, 2)
        k_nope, v = kv.split([HEAD, HEAD], dim=-1)
        k_rope = self.rope(x).view(B, 1, T, HEAD)
        k = k_nope.new_empty(B, HEADS, T, 2 * HEAD)
        k[..., :HEAD] = k_nope
        k[..., HEAD:] = k_rope.expand(-1, HEADS, -1, -1)
        q = torch.cat([q, q], dim=-1)
        out = F.scaled_dot_product_attention(q, k, torch.cat([v, v], dim=-1))
        return self.o(out[..., :HEAD].transpose(1, 2).reshape(B, T, DIM))


def test_a_fresh_tensor_filled_by_slice_assignment_is_made_as_its_writes_are_placed(ranks):
    """The ``new_empty`` is made head-sharded: the sharded writes stay local, each rank
    expands the shared rotary part straight to its heads and writes them, so backward sums
    its heads' gradients and all-reduces that sum at the shared part's size (besides the
    input's gradient: two all-reduces, no gather at the heads' size)."""
    fwd, bwd = ranks.run(parity, LatentAttention)[0]
    assert (fwd, bwd) == ({"all_reduce": 1}, {"all_reduce": 2})


def made_sharded(rank, world):
    gm = fxtp.parallelize(LatentAttention(), ATTENTION, example_inputs=(example(B, T, DIM),))
    empty = next(n for n in gm.graph.nodes if n.target is torch.ops.aten.new_empty.default)
    return list(empty.args[1])


def test_the_fresh_tensor_holds_only_this_ranks_heads(ranks4):
    assert ranks4.run(made_sharded) == [[B, HEADS // 4, T, 2 * HEAD]] * 4


class SliceIntoAReplicatedValue(Projections):
    """A slice assignment of head-sharded values into a value read whole afterwards: what
    is written must be gathered, or the write would land in this rank's part only."""

    def forward(self, x):
        y = x.view(B, T, HEADS, HEAD).clone()
        y[..., :HEAD // 2] = self.kv(x).view(B, T, HEADS, 2 * HEAD)[..., :HEAD // 2]
        return self.o(self.q(x)) + y.view(B, T, DIM)


def test_a_slice_assignment_into_a_replicated_value_gathers_what_is_written(ranks):
    """The one fallback: a forward all-gather of the written heads (reported)."""
    assert ranks.run(parity, SliceIntoAReplicatedValue, ATTENTION, False)[0] == \
        ({"all_reduce": 1, "all_gather": 1}, {"all_reduce": 1})


class ChunkedHeads(Projections):
    """A gated delta-net's chunked form (Qwen3-Next's prefill): the sequence padded to a
    multiple of the chunk and cut into chunks, on head shards. With a dynamic length the
    padded length is ``t + Mod(-t, 4)``, which no product of the chunk dims is proven
    equal to."""

    def forward(self, x):
        b, t, _ = x.shape
        q = self.q(x).view(b, t, HEADS, HEAD).transpose(1, 2)
        q = F.pad(q, (0, 0, 0, (4 - t % 4) % 4))
        chunks = q.reshape(b, HEADS, -1, 4, HEAD).cumsum(3)
        h = chunks.reshape(b, HEADS, -1, HEAD)[:, :, :t] * self.kv(x)[..., DIM:].view(
            b, t, HEADS, HEAD).transpose(1, 2)
        return self.o(h.transpose(1, 2).reshape(b, t, DIM))


def chunked_heads(rank, world):
    from torch.export import Dim
    return check_parity(rank, world, ChunkedHeads, ATTENTION, [example(B, 6, DIM)],
                        dtype=torch.float64, strict=True,
                        inputs_per_step=[[example(B, t, DIM)] for t in (6, 5, 7)],
                        dynamic_shapes=({1: Dim.DYNAMIC(min=2, max=16)},))


def test_a_dynamic_length_cut_into_chunks_keeps_the_heads_sharded(ranks):
    assert ranks.run(chunked_heads)[0] == MEGATRON


def ranks_order(rank, world):
    """Model code whose independent ops run in another order on each rank, as iterating
    a ``set`` of strings does in processes with other hash seeds."""
    class Tables(Projections):
        def __init__(self):
            super().__init__()
            self.register_buffer("local", torch.linspace(0.5, 1.5, DIM))
            self.register_buffer("wide", torch.linspace(1.5, 0.5, DIM))

        def forward(self, x):
            kinds = sorted(["local", "wide"], reverse=dist.get_rank() % 2 == 1)
            # equal nodes (new_ones) read by different ops, in another order per rank
            scale = {kind: getattr(self, kind).cos() * x.new_ones(DIM) for kind in kinds}
            h = x * scale["local"] + x * scale["wide"]
            return self.o(self.q(h) * self.kv(h)[..., DIM:])
    return parity(rank, world, Tables)


def test_ranks_whose_traces_differ_in_the_order_of_independent_ops_run_rank_0s(ranks):
    assert ranks.run(ranks_order)[0] == MEGATRON


def ranks_convert_in_order(rank, world):
    """Hugging Face's masks per layer type, made in ``set`` order: each converts the shared
    position with ``.to``, so the one made second reads a conversion of a conversion (the
    same value), and which one that is differs per rank."""
    class Masks(Projections):
        def forward(self, x):
            kinds = sorted(["full", "window"], reverse=dist.get_rank() % 2 == 1)
            shared, masks = {"position": torch.arange(DIM)}, {}
            for kind in kinds:
                position = shared["position"] = shared["position"].to(torch.long)
                masks[kind] = position < (DIM if kind == "full" else DIM // 2)
            h = x.masked_fill(masks["window"], 0) + x.masked_fill(masks["full"], 1)
            return self.o(self.q(h) * self.kv(h)[..., DIM:])
    return parity(rank, world, Masks)


def test_ranks_whose_traces_convert_a_value_more_often_on_one_path_run_rank_0s(ranks):
    assert ranks.run(ranks_convert_in_order)[0] == MEGATRON


def test_structure_keys_ignore_names_and_the_order_of_independent_nodes():
    def trace(first):
        def f(x, y):
            a, b = (x.cos(), y.sin()) if first else (None, y.sin())
            a = a if first else x.cos()
            return a + b
        return torch.fx.symbolic_trace(f).graph
    one, other = structure_keys(trace(True)), structure_keys(trace(False))
    assert one != other and sorted(one) == sorted(other)


def test_structure_keys_tell_a_read_before_an_in_place_write_from_one_after():
    def f(x):
        before = torch.ops.aten.sin.default(x)
        torch.ops.aten.add_.Tensor(x, 1)
        return before, torch.ops.aten.sin.default(x)
    keys = structure_keys(torch.fx.symbolic_trace(f).graph)
    assert len(set(keys)) == len(keys)


class Recurrent(nn.Module):
    """Blocks applied in two cycles (HRM-style): each block is called twice per step."""

    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(Mixer() for _ in range(2))

    def forward(self, x):
        for _ in range(2):
            for layer in self.layers:
                x = x + layer(x)
        return x


class Mixer(nn.Module):
    def __init__(self):
        super().__init__()
        self.up = nn.Linear(DIM, 2 * DIM)
        self.down = nn.Linear(2 * DIM, DIM)

    def forward(self, x):
        return self.down(F.gelu(self.up(x)))


def test_blocks_called_more_than_once_per_step(ranks):
    """Megatron's collectives for each of the four calls."""
    plan = {"layers.*.up": fxtp.ColwiseParallel(), "layers.*.down": fxtp.RowwiseParallel()}
    assert ranks.run(parity, Recurrent, plan)[0] == ({"all_reduce": 4}, {"all_reduce": 4})


class ChunkedHead(nn.Module):
    """torchtune's chunked output (``set_num_output_chunks``, for its chunked
    cross-entropy): the head applied to each sequence chunk, one call per chunk."""

    def __init__(self):
        super().__init__()
        self.up = nn.Linear(DIM, DIM)
        self.output = nn.Linear(DIM, 4 * DIM, bias=False)

    def forward(self, x):
        return [self.output(chunk) for chunk in torch.relu(self.up(x)).chunk(4, dim=1)]


def chunked_parity(rank, world):
    torch.manual_seed(0)
    plan = {"up": fxtp.RowwiseParallel(input_layouts=fxtp.Replicate()),
            "output": fxtp.ColwiseParallel(output_layouts=fxtp.Replicate())}
    programs = []
    counts = check_parity(rank, world, ChunkedHead, plan, [example(B, T, DIM)],
                          dtype=torch.float64, strict=True, output=lambda o: torch.cat(o, 1),
                          post=programs.append)
    return programs[0].fxtp.output_placements, counts


def test_a_planned_module_called_several_times_lays_out_every_call(ranks):
    """Each call's output gets the style's layout (before, only the first call's did: the
    other chunks came back as each rank's vocab shard): one gather per chunk. Backward,
    the chunks' partial input gradients are summed once, on the value chunked (a split's
    gradient is its pieces put back together; it was one all-reduce per chunk)."""
    placements, (fwd, bwd) = ranks.run(chunked_parity)[0]
    assert placements == (fxtp.Replicate(),) * 4
    assert fwd == {"all_reduce": 1, "all_gather": 4}
    assert bwd == {"all_reduce": 1, "all_gather": 1}


class NoGradIndexer(CompositeViews):
    """DeepSeek-V3.2-style sparse attention (Dots3's): an indexer picks each query's keys
    under ``torch.no_grad()``, casting the hidden states to its own dtype on the way (a
    ``Tensor.to`` that changes nothing hands back the tensor itself), and a per-head gate
    read from the same hidden states afterwards gets its gradient."""

    def __init__(self):
        super().__init__()
        self.index = nn.Linear(DIM, DIM, bias=False)
        self.g = nn.Linear(DIM, HEADS, bias=False)

    def forward(self, x):
        with torch.no_grad():
            keys = self.index(x.to(self.index.weight.dtype))
            picked = (keys @ keys.transpose(-1, -2)).topk(T // 2, dim=-1).indices
            mask = torch.zeros(B, T, T, dtype=torch.bool).scatter(-1, picked, True)
        q = self.q(x).view(B, T, HEADS, HEAD).transpose(1, 2)
        k, v = self.kv(x).view(B, T, HEADS, 2 * HEAD).transpose(1, 2).chunk(2, dim=-1)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask.unsqueeze(1))
        gate = self.g(x).view(B, T, HEADS, 1).sigmoid()
        return self.o((out.transpose(1, 2) * gate).reshape(B, T, DIM))


def test_a_tensor_a_no_grad_region_hands_back_unchanged_keeps_its_gradient(ranks):
    """The gate's share of the input gradient was lost: export routes every later use of
    the cast hidden states through the no-grad region, whose outputs were all detached.
    Megatron's collectives, the gate's input gradient summed with the projections'."""
    plan = {**ATTENTION, "g": fxtp.ColwiseParallel()}
    assert ranks.run(parity, NoGradIndexer, plan)[0] == MEGATRON


class Expert(nn.Module):
    def __init__(self):
        super().__init__()
        self.w1 = nn.Linear(DIM, 2 * DIM, bias=False)
        self.w3 = nn.Linear(DIM, 2 * DIM, bias=False)
        self.w2 = nn.Linear(2 * DIM, DIM, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class ListMoE(nn.Module):
    """Mistral's reference mixture of experts (litgpt's too): experts in a ``ModuleList``,
    each taking its tokens, ``x[token_idx]``, chosen by top-2 routing."""

    def __init__(self, experts=4):
        super().__init__()
        self.gate = nn.Linear(DIM, experts, bias=False)
        self.experts = nn.ModuleList(Expert() for _ in range(experts))

    def forward(self, x):
        x = x.view(-1, DIM)
        probs, indices = torch.topk(self.gate(x), 2)
        probs = probs.softmax(dim=1)
        y = torch.zeros_like(x)
        for i, expert in enumerate(self.experts):
            token_idx, slot = torch.where(indices == i)
            y[token_idx] += probs[token_idx, slot, None] * expert(x[token_idx])
        return y.view(B, T, DIM)


SLICED_EXPERTS = {"experts.*.w1": fxtp.ColwiseParallel(), "experts.*.w3": fxtp.ColwiseParallel(),
                  "experts.*.w2": fxtp.RowwiseParallel()}


def test_experts_sliced_over_ranks_are_summed_once_forward_and_backward(ranks):
    """Each expert sliced Megatron-style (litgpt's and Mistral's recipe). Forward, each
    expert's partial output, scaled by its routing weight, is added into the zeros ``y``
    starts as, and ``y`` is reduced once (was: the plan's all-reduce of each expert's
    output, 4). Backward, each expert's sharded ``w1`` / ``w3`` give its tokens a partial
    gradient; the tokens' gradients are added up on ``x`` and summed once there (was: once
    per expert; top-2 routing gathers each token twice, so the one sum is also half the
    bytes). The routing weights, multiplied by partial outputs, get partial gradients:
    summed once, on the softmax all experts' weights are gathered from."""
    assert ranks.run(parity, ListMoE, SLICED_EXPERTS)[0] == ({"all_reduce": 1},
                                                            {"all_reduce": 2})


class ParallelBlock(nn.Module):
    """GPT-J's, GPT-NeoX's and Cohere's block: attention and MLP read the same normed input
    and both add to the residual, in either order of the sums."""

    def __init__(self, residual_first: bool):
        super().__init__()
        self.residual_first = residual_first
        self.ln = nn.LayerNorm(DIM)
        self.q, self.kv = nn.Linear(DIM, DIM), nn.Linear(DIM, 2 * DIM)
        self.o = nn.Linear(DIM, DIM)
        self.up, self.down = nn.Linear(DIM, 4 * DIM), nn.Linear(4 * DIM, DIM)

    def forward(self, x):
        h = self.ln(x)
        q = self.q(h).view(B, T, HEADS, HEAD).transpose(1, 2)
        k, v = self.kv(h).view(B, T, HEADS, 2 * HEAD).transpose(1, 2).chunk(2, dim=-1)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        attn = self.o(a.transpose(1, 2).reshape(B, T, DIM))
        mlp = self.down(F.gelu(self.up(h)))
        return x + attn + mlp if self.residual_first else attn + mlp + x


class ParallelStack(nn.Module):
    def __init__(self, residual_first: bool = False):
        super().__init__()
        self.layers = nn.ModuleList(ParallelBlock(residual_first) for _ in range(2))

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


class Fp32NormAfter(ParallelStack):
    """litgpt's final norm: computed in fp32 whatever the model's dtype (``x.float()``)."""

    def forward(self, x):
        x = super().forward(x).float()
        return (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5)).double()


def test_a_partial_sum_is_reduced_before_a_cast_narrows_it(ranks):
    """The last block's sum is still partial where the norm casts it to fp32: each rank's
    part rounded to fp32 would not sum to the rounded sum (fp32-sized errors in an fp64
    model). It is reduced in fp64 first, so the model matches single device tightly."""
    assert ranks.run(parity, Fp32NormAfter, PARALLEL_PLAN)[0] == \
        ({"all_reduce": 2}, {"all_reduce": 2})


class ResidualFirstStack(ParallelStack):
    def __init__(self):
        super().__init__(residual_first=True)


PARALLEL_PLAN = {"layers.*.q": fxtp.ColwiseParallel(), "layers.*.kv": fxtp.ColwiseParallel(),
                 "layers.*.o": fxtp.RowwiseParallel(), "layers.*.up": fxtp.ColwiseParallel(),
                 "layers.*.down": fxtp.RowwiseParallel()}
PARALLEL_SP_PLAN = {**PARALLEL_PLAN, "layers.*.ln": fxtp.SequenceParallel(),
                    "layers.*.o": fxtp.RowwiseParallel(output_layouts=fxtp.Shard(1)),
                    "layers.*.down": fxtp.RowwiseParallel(output_layouts=fxtp.Shard(1))}


@pytest.mark.parametrize("residual_first", [False, True], ids=["residual_last", "residual_first"])
def test_a_parallel_blocks_attention_and_mlp_are_reduced_once(ranks, residual_first):
    """The two row-parallel outputs (and their biases, added on one rank) are summed before
    they are reduced, and the residual is added into that sum: one all-reduce per layer
    (GPT-NeoX's and Megatron's hand-written parallel blocks do so), where the plan's
    layouts say two. Backward is Megatron's: the normed input's gradient, summed once."""
    make = ResidualFirstStack if residual_first else ParallelStack
    assert ranks.run(parity, make, PARALLEL_PLAN)[0] == ({"all_reduce": 2}, {"all_reduce": 2})


def test_a_sequence_parallel_parallel_block_reduce_scatters_once(ranks):
    """Under sequence parallelism the sum of the two partial outputs is reduce-scattered
    once per layer (the plan says twice) and added to the sequence-sharded residual; the
    input arrives whole, so the first layer adds it into the sum, and the last one's
    output, asked for whole, is all-reduced rather than reduce-scattered and gathered."""
    assert ranks.run(parity, ParallelStack, PARALLEL_SP_PLAN)[0] == (
        {"all_gather": 2, "reduce_scatter": 1, "all_reduce": 1},
        {"reduce_scatter": 2, "all_reduce": 2, "all_gather": 2})


class BatchNormed(nn.Module):
    """A BatchNorm over a colwise projection's channels (a convolutional or MLP-Mixer
    block's), then a rowwise projection. ``native_batch_norm`` updates its running
    statistics in place, which its schema does not mark."""

    def __init__(self):
        super().__init__()
        self.up, self.down = nn.Linear(DIM, 4 * DIM), nn.Linear(4 * DIM, DIM)
        self.bn = nn.BatchNorm1d(4 * DIM)

    def forward(self, x):
        h = self.bn(self.up(x).transpose(1, 2)).transpose(1, 2)
        return self.down(F.gelu(h))


BN_PLAN = {"up": fxtp.ColwiseParallel(), "down": fxtp.RowwiseParallel()}


def batch_norm_state(rank, world):
    """Parity over 3 steps; then the running statistics after a step and the outputs in
    eval mode (where they are read), against single device."""
    counts = parity(rank, world, BatchNormed, BN_PLAN)
    torch.manual_seed(0)
    model = BatchNormed().double()
    x = example(B, T, DIM).double()
    gm = fxtp.parallelize(model, BN_PLAN, example_inputs=(x,), strict=True)
    gm(x)
    model(x)
    held = {k: v.full_tensor() if hasattr(v, "full_tensor") else v
            for k, v in gm.state_dict().items()}
    for name, t in model.state_dict().items():
        torch.testing.assert_close(held[name], t, rtol=1e-9, atol=1e-11, msg=name)
    placements = {k: v.placements for k, v in gm.state_dict().items() if "running" in k}
    gm.eval()
    model.eval()
    torch.testing.assert_close(gm(x), model(x), rtol=1e-9, atol=1e-11)
    return counts, placements


def test_a_batch_norm_on_channel_shards_keeps_its_running_statistics_as_them(ranks):
    """Channels are independent: each rank normalizes and updates the statistics of its own
    (held as ``Shard(0)``; the state dict holds the whole), with no collective of its own.
    Before, the statistics stayed replicated and each rank updated only its part of them:
    the ranks' copies disagreed, silently, and eval mode read them."""
    counts, placements = ranks.run(batch_norm_state)[0]
    assert counts == MEGATRON
    assert placements == {"bn.running_mean": (fxtp.Shard(0),),
                          "bn.running_var": (fxtp.Shard(0),)}


class GroupNormedHeads(nn.Module):
    """Attention whose output is normalized per head by a GroupNorm with a group per head,
    as RWKV (``ln_x``) and RetNet write it, between the colwise projections and the rowwise
    output: on head shards each rank holds whole groups."""

    def __init__(self):
        super().__init__()
        self.q, self.kv = nn.Linear(DIM, DIM), nn.Linear(DIM, 2 * DIM)
        self.norm = nn.GroupNorm(HEADS, DIM)
        with torch.no_grad():
            self.norm.weight.copy_(torch.linspace(0.5, 1.5, DIM))
            self.norm.bias.copy_(torch.linspace(-0.2, 0.2, DIM))
        self.o = nn.Linear(DIM, DIM)

    def forward(self, x):
        b, t, _ = x.shape
        q = self.q(x).view(b, t, HEADS, HEAD).transpose(1, 2)
        k, v = (y.view(b, t, HEADS, HEAD).transpose(1, 2) for y in self.kv(x).chunk(2, -1))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2)
        return self.o(self.norm(y.reshape(b * t, DIM)).view(b, t, DIM))


def test_a_group_norm_over_heads_runs_on_head_shards(ranks):
    """Each rank normalizes its own heads' groups, its part of the weight and bias held as
    the heads are: Megatron's collectives and nothing else (before, the heads were
    gathered for the norm: a fallback)."""
    assert ranks.run(parity, GroupNormedHeads)[0] == MEGATRON


class SpectralNormed(nn.Module):
    """A spectral-normalized colwise projection: its power iteration runs under
    ``torch.no_grad()`` and writes its vectors (buffers) with ``out=``, which autograd
    refuses outside no_grad."""

    def __init__(self):
        super().__init__()
        self.q = nn.utils.parametrizations.spectral_norm(nn.Linear(DIM, DIM))
        self.o = nn.Linear(DIM, DIM)

    def forward(self, x):
        return self.o(F.gelu(self.q(x)))


SPECTRAL_PLAN = {"q": fxtp.ColwiseParallel(), "o": fxtp.RowwiseParallel()}


def spectral(rank, world):
    with pytest.warns(UserWarning, match=r"module 'q' computes its 'weight' by a "
                                         r"parametrization \(_SpectralNorm\)"):
        return parity(rank, world, SpectralNormed, SPECTRAL_PLAN)


def test_a_no_grad_region_runs_without_autograd(ranks):
    """Forward all-reduces once; backward also gathers the weight's gradient: the weight is
    computed whole from its spectral norm (the plan is told so), and the colwise layer
    takes its rows."""
    assert ranks.run(spectral)[0] == ({"all_reduce": 1}, {"all_reduce": 1, "all_gather": 1})


def modulate(h, shift, scale):
    return h * (1 + scale.unsqueeze(1)) + shift.unsqueeze(1)


class DiTBlock(nn.Module):
    """A diffusion transformer's block as facebookresearch/DiT writes it: adaptive layer
    norm, its shift, scale and gate per sample and feature cut from one projection of the
    conditioning by ``chunk``."""

    def __init__(self):
        super().__init__()
        self.norm1 = nn.LayerNorm(DIM, elementwise_affine=False)
        self.norm2 = nn.LayerNorm(DIM, elementwise_affine=False)
        self.qkv = nn.Linear(DIM, 3 * DIM)
        self.proj = nn.Linear(DIM, DIM)
        self.fc1 = nn.Linear(DIM, 4 * DIM)
        self.fc2 = nn.Linear(4 * DIM, DIM)
        self.adaLN_modulation = nn.Sequential(nn.SiLU(), nn.Linear(DIM, 6 * DIM))

    def attention(self, x):
        qkv = self.qkv(x).reshape(B, T, 3, HEADS, HEAD).permute(2, 0, 3, 1, 4)
        out = F.scaled_dot_product_attention(*qkv.unbind(0))
        return self.proj(out.transpose(1, 2).reshape(B, T, DIM))

    def forward(self, x, c):
        shift1, scale1, gate1, shift2, scale2, gate2 = self.adaLN_modulation(c).chunk(6, dim=1)
        x = x + gate1.unsqueeze(1) * self.attention(modulate(self.norm1(x), shift1, scale1))
        mlp = self.fc2(F.gelu(self.fc1(modulate(self.norm2(x), shift2, scale2)),
                              approximate="tanh"))
        return x + gate2.unsqueeze(1) * mlp


PATCH, CHANNELS, FREQUENCIES = 2, 3, 8


class DiT(nn.Module):
    """DiT's model around the blocks: a patch embedding (a strided convolution) plus a
    frozen positional embedding, a sinusoidal timestep embedding through an MLP, and a
    final layer with its own adaptive layer norm; none of them planned."""

    def __init__(self):
        super().__init__()
        self.x_embedder = nn.Conv2d(CHANNELS, DIM, PATCH, stride=PATCH)
        self.pos_embed = nn.Parameter(torch.randn(1, T, DIM), requires_grad=False)
        self.t_embedder = nn.Sequential(nn.Linear(FREQUENCIES, DIM), nn.SiLU(),
                                        nn.Linear(DIM, DIM))
        self.blocks = nn.ModuleList([DiTBlock(), DiTBlock()])
        self.norm_final = nn.LayerNorm(DIM, elementwise_affine=False)
        self.final_modulation = nn.Sequential(nn.SiLU(), nn.Linear(DIM, 2 * DIM))
        self.final = nn.Linear(DIM, PATCH * PATCH * CHANNELS)

    def forward(self, image, t):
        x = self.x_embedder(image).flatten(2).transpose(1, 2) + self.pos_embed
        half = FREQUENCIES // 2
        freqs = torch.exp(-9.2103 * torch.arange(half, dtype=t.dtype) / half)
        c = self.t_embedder(torch.cat([torch.cos(t[:, None] * freqs),
                                       torch.sin(t[:, None] * freqs)], dim=-1))
        for block in self.blocks:
            x = block(x, c)
        shift, scale = self.final_modulation(c).chunk(2, dim=1)
        return self.final(modulate(self.norm_final(x), shift, scale))


DIT_PLAN = {"blocks.*.qkv": fxtp.ColwiseParallel(), "blocks.*.proj": fxtp.RowwiseParallel(),
            "blocks.*.fc1": fxtp.ColwiseParallel(), "blocks.*.fc2": fxtp.RowwiseParallel()}


def dit(rank, world, modulation):
    plan = {**DIT_PLAN, "blocks.*.adaLN_modulation.1": modulation}
    image = example(B, CHANNELS, 2 * PATCH, T // 2 * PATCH)
    return check_parity(rank, world, DiT, plan, [image, example(B, seed=2) * 1000],
                        dtype=torch.float64, strict=True)


GATHERED_ONCE_A_BLOCK = ({"all_gather": 2, "all_reduce": 4}, {"all_reduce": 5})
"""Each block's modulation gathered where it is made, Megatron's all-reduces each way, and
backward the conditioning's gradient (both blocks' partial sums, reduced once)."""


def test_a_dits_modulation_gathered_where_it_is_made_costs_one_all_gather_a_block(ranks):
    """``ColwiseParallel(output_layouts=Replicate())`` on ``adaLN_modulation``: each rank
    keeps its rows of the (large) weight, and the small per-sample vectors are gathered
    where they are made."""
    replicated = fxtp.ColwiseParallel(output_layouts=fxtp.Replicate())
    assert ranks.run(dit, replicated)[0] == GATHERED_ONCE_A_BLOCK


def test_a_sharded_modulation_is_gathered_before_it_meets_the_residual_stream(ranks):
    """Left sharded (``ColwiseParallel()``), each ``chunk`` of the modulation is each rank's
    share of that chunk (DTensor's local output would be cut into the wrong pieces).
    Placed op by op, the modulated activations and the residual stream would run sharded
    by feature, to be gathered by each projection and by the unplanned final layer (10
    all-gathers forward, a fallback), and the unplanned patch embedding would be held
    sharded to feed them. Gathered where it is smallest, before ``chunk``, with the patch
    embedding whole again (else block 0 gathers its output), it costs what the replicated
    layout does (``passes/gather_early.py``)."""
    assert ranks.run(dit, fxtp.ColwiseParallel())[0] == GATHERED_ONCE_A_BLOCK
