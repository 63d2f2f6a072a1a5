"""Serving with a sharded KV cache: buffers written in place take the placement of what is
written into them, so each rank holds its heads' part of every cache, one module serves
prefill and every decode step (a dynamic sequence dim, each block traced once though the
trace takes the length from the model's input), and a decode step costs gpt-fast's two
all-reduces per layer and nothing else."""
import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.export import Dim

import fxtp
from fxtp.examples.gpt_fast import KVCache, ServeConfig, Transformer, generate, tp_plan
from fxtp.serving.causal_lm import static_cache_module
from fxtp.passes.graph import STAMPED
from fxtp.passes.placement import local_part
from fxtp.plans.styles import ColwiseParallel, RowwiseParallel
from tests.helpers import corpus
from tests.helpers.harness import pool_of

BATCH, PROMPT, NEW = 2, 8, 6


class PositionedCache(KVCache):
    """torchtune's ``KVCache``: it keeps its own write position in a buffer (``cache_pos``)
    that each update advances in place; ``input_pos`` is not read. (torchtune's also
    asserts on that position's value, which torch.export cannot trace.)"""

    def __init__(self, like: KVCache):
        batch, heads, length, head_dim = like.k_cache.shape
        super().__init__(batch, heads, length, head_dim, like.k_cache.dtype)
        self.register_buffer("cache_pos", torch.arange(length), persistent=False)

    def update(self, input_pos, k, v):
        n = k.shape[2]
        self.k_cache[:, :, self.cache_pos[:n]] = k
        self.v_cache[:, :, self.cache_pos[:n]] = v
        self.cache_pos.add_(n)
        return self.k_cache, self.v_cache


def serving_model(dtype=torch.float64, positioned=False, **config):
    torch.manual_seed(0)
    model = Transformer(ServeConfig(**config)).to(dtype)
    with torch.no_grad():  # the plain init gives near-uniform logits: argmax ties
        for p in model.parameters():
            p.normal_(0, 0.3)
    model.setup_caches(BATCH)
    if positioned:
        for layer in model.layers:
            layer.attention.kv_cache = PositionedCache(layer.attention.kv_cache)
    return model


def prompt(vocab=64):
    return torch.randint(0, vocab, (BATCH, PROMPT), generator=torch.Generator().manual_seed(7))


def parallelize_for_serving(model):
    seq = Dim("seq", min=1, max=model.config.max_seq_len)
    return fxtp.parallelize(model, tp_plan(), example_inputs=(prompt(), torch.arange(PROMPT)),
                            dynamic_shapes=({1: seq}, {0: seq}), strict=True)


def caches(module):
    return {name: b for name, b in module.named_buffers() if name.endswith("_cache")}


def generation_parity(rank, world, config, temperature):
    model = serving_model(**config)
    ref = copy.deepcopy(model)
    gm = parallelize_for_serving(model)
    assert gm.meta[STAMPED] == {f"layers.{i}": "layers.0" for i in range(1, len(model.layers))}
    sampling = dict(temperature=temperature, top_k=10 if temperature else None)
    tokens = generate(gm, prompt(), NEW, generator=torch.Generator().manual_seed(3),
                      **sampling)
    expected = generate(ref, prompt(), NEW, generator=torch.Generator().manual_seed(3),
                        **sampling)
    assert torch.equal(tokens, expected), (tokens, expected)
    held = caches(gm)
    assert held.keys() == caches(ref).keys()
    for name, cache in held.items():  # this rank's heads of the single-device cache
        placement = gm.fxtp.param_placements[name]
        torch.testing.assert_close(cache, local_part(ref.get_buffer(name), placement, rank,
                                                     world), rtol=1e-12, atol=1e-12)
    assert all(not b.any() for b in caches(model).values()), "the user's model was written"
    # state_dict() hands out the whole caches (DCP saves every rank's heads) and weights,
    # and loading a single-device state gives each rank its heads again
    state = gm.state_dict()
    for name in held:
        torch.testing.assert_close(state[name].full_tensor(), ref.get_buffer(name))
    for name, weight in ref.named_parameters():  # the fused wqkv's blocks gathered whole
        assert torch.equal(state[name].full_tensor(), weight), name
    fresh = parallelize_for_serving(serving_model(**config))
    fresh.load_state_dict(ref.state_dict())
    for name, cache in caches(fresh).items():
        placement = gm.fxtp.param_placements[name]
        assert torch.equal(cache, local_part(ref.get_buffer(name), placement, rank, world))
    with fxtp.count_collectives() as decode:
        gm(tokens[:, -1:], torch.tensor([PROMPT + NEW]))
    with fxtp.count_collectives() as prefill:
        gm(prompt(), torch.arange(PROMPT))
    return (dict(decode.counts), dict(prefill.counts),
            sum(c.numel() for c in held.values()), sum(c.numel() for c in caches(ref).values()))


@pytest.mark.parametrize("world,temperature", [(2, 0.0), (2, 0.8), (4, 0.0)],
                         ids=["world2-greedy", "world2-sampled", "world4-greedy"])
def test_generation_equals_single_device_with_each_rank_holding_its_heads_of_the_cache(
        pools, world, temperature):
    """gpt-fast's layout (fused ``wqkv``): each rank holds its rows of q, k and v."""
    config = dict(n_heads=8, n_kv_heads=4)
    decode, prefill, held, whole = pool_of(pools, world).run(generation_parity, config,
                                                              temperature)[0]
    layers = ServeConfig().n_layers
    assert decode == prefill == {"all_reduce": 2 * layers}  # no k / v gathers
    assert held * world == whole


def test_the_cache_written_by_index_copy_is_sharded_alike(ranks2):
    decode, _, held, whole = ranks2.run(
        generation_parity, dict(n_heads=8, n_kv_heads=4, cache_update="index_copy"), 0.0)[0]
    assert decode == {"all_reduce": 2 * ServeConfig().n_layers}
    assert held * 2 == whole


def test_a_cache_keeping_its_own_position_in_a_buffer_is_sharded_alike(ranks2):
    """The position buffer, advanced in place by each step, stays whole on every rank."""
    decode, _, held, whole = ranks2.run(
        generation_parity, dict(n_heads=8, n_kv_heads=4, positioned=True), 0.0)[0]
    assert decode == {"all_reduce": 2 * ServeConfig().n_layers}
    assert held * 2 == whole


def test_a_gqa_cache_follows_the_kv_head_layout_of_the_plan(ranks4):
    """2 KV heads at 4 ranks (separate q, k, v projections, torchtitan's layout): each KV
    head is held by the 2 ranks whose query heads use it, so each rank's cache is half the
    whole, and nothing is gathered."""
    decode, _, held, whole = ranks4.run(
        generation_parity, dict(n_heads=8, n_kv_heads=2, fused_qkv=False), 0.0)[0]
    assert decode == {"all_reduce": 2 * ServeConfig().n_layers}
    assert held * 2 == whole


def test_a_fused_wqkv_with_fewer_kv_heads_than_ranks_is_served_without_a_gather(ranks4):
    """gpt-fast's fused ``wqkv`` with 2 KV heads at 4 ranks (which ``tp.py`` refuses): q,
    k and v are computed part by part from the whole fused weight, each rank its query
    heads and the KV head they use, so each rank's cache is half the whole and decoding
    issues Megatron's all-reduces only."""
    decode, prefill, held, whole = ranks4.run(
        generation_parity, dict(n_heads=8, n_kv_heads=2), 0.0)[0]
    assert decode == prefill == {"all_reduce": 2 * ServeConfig().n_layers}
    assert held * 2 == whole


def test_the_cache_at_world_8_holds_an_eighth(fake_group):
    fake_group(8)
    model = serving_model(torch.float32, n_heads=8, n_kv_heads=8, dim=64)
    gm = parallelize_for_serving(model)
    assert gm.fxtp.fallbacks == []
    for name, cache in caches(gm).items():
        whole = model.get_buffer(name)
        assert cache.shape == (whole.shape[0], whole.shape[1] // 8, *whole.shape[2:])
        assert cache.stride() == torch.empty(cache.shape).stride()  # not the whole's


class SliceCacheAttention(nn.Module):
    """Meta's original Llama cache: ``cache[:, start:start + T] = k`` (batch, seq, heads,
    head_dim), read back as ``cache[:, :start + T]``."""

    def __init__(self, dim=32, heads=4, max_seq_len=16, start=4):
        super().__init__()
        self.heads, self.head_dim, self.start = heads, dim // heads, start
        self.wq, self.wk, self.wv = (nn.Linear(dim, dim, bias=False) for _ in range(3))
        self.wo = nn.Linear(dim, dim, bias=False)
        shape = (2, max_seq_len, heads, dim // heads)
        self.register_buffer("cache_k", torch.randn(shape))
        self.register_buffer("cache_v", torch.randn(shape))

    def forward(self, x):
        b, t, _ = x.shape
        q, k, v = (w(x).view(b, t, self.heads, self.head_dim) for w in (self.wq, self.wk, self.wv))
        end = self.start + t
        self.cache_k[:, self.start:end] = k
        self.cache_v[:, self.start:end] = v
        keys, values = self.cache_k[:, :end], self.cache_v[:, :end]
        y = F.scaled_dot_product_attention(q.transpose(1, 2), keys.transpose(1, 2),
                                           values.transpose(1, 2))
        return self.wo(y.transpose(1, 2).reshape(b, t, -1))


def slice_cache_parity(rank, world):
    torch.manual_seed(0)
    model = SliceCacheAttention().double()
    ref = copy.deepcopy(model)
    plan = {"w[qkv]": ColwiseParallel(), "wo": RowwiseParallel()}
    x = torch.randn(2, 3, 32, dtype=torch.float64)
    gm = fxtp.parallelize(model, plan, example_inputs=(x,), strict=True)
    with fxtp.count_collectives() as forward:
        out = gm(x)
    torch.testing.assert_close(out, ref(x), rtol=1e-12, atol=1e-12)
    for name in ("cache_k", "cache_v"):
        torch.testing.assert_close(gm.get_buffer(name), ref.get_buffer(name).chunk(world, 2)[rank])
    return dict(forward.counts)


def test_a_cache_written_by_slice_assignment_is_sharded_by_heads(ranks2):
    assert ranks2.run(slice_cache_parity)[0] == {"all_reduce": 1}


def hf_generation_parity(rank, world, options, make="hf_llama", dtype=torch.float64,
                         then=None):
    """Generate with ``make``'s model and its parallelized one; the decoding step's
    collectives, the cache elements this rank holds and the whole cache's, the layer count,
    and ``then(gm)`` where given."""
    import warnings
    from tests.helpers import corpus
    warnings.filterwarnings("ignore", message=".*attention mask.*")
    torch.manual_seed(0)
    model = getattr(corpus, make)().to(dtype)
    if hasattr(model, "set_experts_implementation"):
        model.set_experts_implementation("batched_mm")  # the one with an fp64 kernel
    with torch.no_grad():  # away from near-uniform logits (argmax ties)
        for p in model.parameters():
            p.normal_(0, 0.3)
    gm = fxtp.parallelize_causal_lm(model, batch_size=BATCH, max_cache_len=32, strict=True)
    ids = torch.randint(3, corpus.VOCAB, (BATCH, 5), generator=torch.Generator().manual_seed(1))
    torch.manual_seed(5)
    tokens = gm.generate(ids, max_new_tokens=NEW, **options)
    torch.manual_seed(5)
    expected = model.generate(ids, max_new_tokens=NEW, **options)
    assert torch.equal(tokens, expected), (tokens, expected)
    held = sum(b.numel() for n, b in gm.named_buffers() if "_cache_" in n)
    whole = sum(b.numel() for n, b in static_cache_module(model, BATCH, 32).named_buffers()
                if "_cache_" in n)
    with fxtp.count_collectives() as decode:
        gm(input_ids=tokens[:, -1:], cache_position=torch.tensor([tokens.shape[1]]))
    found = dict(decode.counts), held, whole, model.config.num_hidden_layers
    return found if then is None else (*found, then(gm))


@pytest.mark.parametrize("options", [dict(do_sample=False),
                                     dict(do_sample=True, temperature=0.8, top_k=10, top_p=0.9)],
                         ids=["greedy", "sampled"])
def test_a_hugging_face_llama_generates_as_its_own_generate_does(ranks2, options):
    decode, held, whole, layers = ranks2.run(hf_generation_parity, options)[0]
    # two all-reduces per layer; the vocab-sharded embedding's all-reduce and the head's
    # gather of the logits (Hugging Face's plan)
    assert decode == {"all_reduce": 2 * layers + 1, "all_gather": 1}
    assert held * 2 == whole


def test_a_mixture_of_experts_generates_as_its_own_generate_does(ranks2):
    """Qwen3-MoE under its own plan (experts sharded, its keys for dense MLPs it lacks
    skipped; fp32: the grouped matmul has no fp64 kernel): an all-reduce per layer for
    attention and one for the experts."""
    decode, held, whole, layers = ranks2.run(hf_generation_parity, dict(do_sample=False),
                                             "hf_qwen3_moe", torch.float32)[0]
    assert decode == {"all_reduce": 2 * layers + 1, "all_gather": 1}
    assert held * 2 == whole


def test_latent_attention_generates_as_its_own_generate_does(ranks2):
    """DeepSeek-V2's cache holds, per layer, the compressed latent (16) and the rotary key
    (4) that every head reads, one "head" each, which the config's head counts do not
    give: the cache is shaped by what the model writes. Every head reads it, so every
    rank holds all of it (as DeepSeek's own inference does under TP); decoding costs the
    attention's and the MLPs' all-reduces, the embedding's and the logits' gather."""
    decode, held, whole, layers = ranks2.run(hf_generation_parity, dict(do_sample=False),
                                             "hf_deepseek_v2")[0]
    assert decode == {"all_reduce": 2 * layers + 1, "all_gather": 1}
    assert held == whole


def test_a_length_export_guards_rather_than_proves_still_serves_every_length(ranks2):
    """Aria's experts make export assume ``T * min(32, 32 * T) == 32 * T``, true for every
    length but not proven from the range: the length is traced ``Dim.DYNAMIC`` and the
    assumption checked per call, so prefill and decoding run at parity."""
    decode, held, whole, layers = ranks2.run(hf_generation_parity, dict(do_sample=False),
                                             "hf_aria_text")[0]
    assert decode == {"all_reduce": 2 * layers + 1, "all_gather": 1}
    assert held * 2 == whole


def programs_share_tensors(gm) -> tuple[bool, bool]:
    """Whether the decoding program reads the module's own buffers, before and after
    ``_apply`` (``to`` / ``cuda``) replaced them and its parameters by new tensors."""
    decode = gm.decode_program
    shared = lambda: all(decode.get_buffer(n) is b for n, b in gm.named_buffers())  # noqa: E731
    before = shared()
    gm._apply(lambda t: t.clone())
    return before, shared() and all(decode.get_parameter(n) is p
                                    for n, p in gm.named_parameters())


def test_a_hybrid_of_linear_and_full_attention_generates_as_its_own_generate_does(ranks2):
    """Qwen3-Next: its gated delta-net keeps a conv and a recurrent state, which take the
    one-step recurrence for a token and the chunked form for more: one program each,
    sharing every tensor (also once ``to`` / ``cuda`` replaced them: one cache, one set of
    states), each state cleared where a sequence starts. Under its own plan the delta-net's
    projections gather their outputs (``colwise_gather_output``): a decoding step costs
    their 3 all-gathers and the logits' one, and all-reduces for the attention's output,
    the experts of each layer and the embedding; the full-attention layer's cache is
    sharded by heads, the linear layer's states are whole."""
    decode, held, whole, layers, shared = ranks2.run(
        hf_generation_parity, dict(do_sample=False), "hf_qwen3_next", torch.float64,
        programs_share_tensors)[0]
    assert decode == {"all_reduce": 1 + layers + 1, "all_gather": 3 + 1}
    assert held * 2 == whole
    assert shared == (True, True)


def test_a_model_whose_forward_fixes_the_length_prefills_token_by_token(ranks2):
    """Jamba's Mamba scan (torch's, without kernels) loops over the sequence in Python, so
    export takes the length as a constant: prefill runs the one-token program per token,
    with a warning saying why, and generates as the model's own ``generate()``."""
    (decode, held, whole, layers), said = ranks2.run(parity_and_warnings, "hf_jamba")[0]
    assert any("JambaForCausalLM's forward takes the sequence length as a constant" in m
               for m in said), said
    # up to transformers 5.24 its own plan shards the experts alone: attention (and its
    # cache) is whole, a decode step costs the experts' and the embedding's all-reduces and
    # the logits' gather; since 5.25 it shards attention alone: the cache is held by heads,
    # and a decode step costs the attention's all-reduce instead of the experts'
    assert decode == {"all_reduce": 2, "all_gather": 1}
    assert held == (whole // 2 if corpus.shards_attention(corpus.hf_jamba()) else whole)


def parity_and_warnings(rank, world, make):
    import warnings
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        found = hf_generation_parity(rank, world, dict(do_sample=False), make)
    return found, [str(w.message) for w in caught]


def test_generation_options_it_does_not_follow_are_an_error(fake_group):
    from tests.helpers import corpus
    fake_group(1)
    gm = fxtp.parallelize_causal_lm(corpus.hf_llama(), batch_size=1, max_cache_len=16)
    with pytest.raises(fxtp.PlanError, match="num_beams"):
        fxtp.generate(gm, torch.ones(1, 4, dtype=torch.long), max_new_tokens=2, num_beams=2)


def test_compiled_decoding_compiles_once_for_every_position(fake_group):
    """``torch.compile(gm, fullgraph=True)`` serves every decode step from one graph (the
    position is a tensor, the cache is module state) and decodes as the eager module."""
    from torch._dynamo.utils import counters
    fake_group(2)
    eager, compiled = (parallelize_for_serving(serving_model(torch.float32, n_heads=8,
                                                             n_kv_heads=4)) for _ in range(2))
    torch._dynamo.reset()
    counters.clear()
    tokens = generate(compiled, prompt(), NEW, decode=torch.compile(compiled, fullgraph=True))
    assert counters["stats"]["unique_graphs"] == 1
    assert torch.equal(tokens, generate(eager, prompt(), NEW))
    for (name, cache), (_, expected) in zip(caches(compiled).items(), caches(eager).items()):
        torch.testing.assert_close(cache, expected, msg=name)
