"""Vision-language models: a vision tower the plan leaves whole feeds image features into a
planned language model, whose attention mask lets image tokens see each other. Parity with
the single-device model in fp64, strict (no fallback), Megatron's collectives for the
language model and none for the tower."""
import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch._dynamo._trace_wrapped_higher_order_op import TransformGetItemToIndex

import fxtp
from fxtp import Replicate, Shard
from tests.helpers.models import DIM, HEADS, MLP
from tests.helpers.parity import TIGHT, check_parity

L, SEQ, IMAGE = 2, 12, 4  # layers, tokens, image tokens (positions 2 to 5)
MEGATRON = ({"all_reduce": 2 * L + 1}, {"all_reduce": 2 * L})


def image_token_mask(kinds: torch.Tensor) -> torch.Tensor:
    """(batch, 1, q, kv) attention mask: causal, and image tokens see every image token
    of their sample. Built as transformers' masks are: a mask function of (batch, head, q,
    kv) indices, vmapped over each, indexing ``kinds`` with tensors (torch's
    ``TransformGetItemToIndex``: an ``autograd.Function`` that export keeps as a call)."""
    def allowed(b, h, q, kv):
        return (kv <= q) | ((kinds[b, q] == 1) & (kinds[b, kv] == 1))
    batch, seq = kinds.shape
    for dim in range(4):  # over kv, q, the one head, batch
        dims = [None] * 4
        dims[3 - dim] = 0
        allowed = torch.vmap(allowed, in_dims=tuple(dims))
    idx = torch.arange(seq, device=kinds.device)
    with TransformGetItemToIndex():  # its vmap's result, last: the model reads it as it is
        return allowed(torch.arange(batch, device=kinds.device),
                       torch.arange(1, device=kinds.device), idx, idx)


class MaskedBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(DIM)
        self.wq, self.wk, self.wv, self.wo = (nn.Linear(DIM, DIM, bias=False) for _ in range(4))
        self.mlp = MLP(DIM)

    def forward(self, x, mask):
        b, t, _ = x.shape
        n = self.norm(x)
        q, k, v = (w(n).view(b, t, HEADS, -1).transpose(1, 2) for w in (self.wq, self.wk, self.wv))
        a = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        h = x + self.wo(a.transpose(1, 2).reshape(b, t, DIM))
        return h + self.mlp(h)


class LanguageModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(64, DIM)
        self.layers = nn.ModuleList(MaskedBlock() for _ in range(L))

    def forward(self, h, mask):
        for layer in self.layers:
            h = layer(h, mask)
        return h


class ImageTextModel(nn.Module):
    """Llava's shape: the parent embeds the tokens through its language model's embedding,
    writes the vision tower's features at the image tokens, builds the mask, then calls
    the language model (whose first nodes, the embedding, run before the mask's vmaps)."""

    def __init__(self):
        super().__init__()
        self.vision = nn.Sequential(nn.Linear(12, DIM), nn.GELU(), nn.Linear(DIM, DIM))
        self.lm = LanguageModel()

    def forward(self, ids, patches, kinds):
        h = self.lm.embed(ids)
        image = (kinds == 1)[..., None]
        h = h.masked_scatter(image, self.vision(patches).to(h.dtype))
        return self.lm(h, image_token_mask(kinds))


PLAN = {"lm.embed": fxtp.RowwiseParallel(input_layouts=Replicate()),
        "lm.layers.*.w[qkv]": fxtp.ColwiseParallel(),
        "lm.layers.*.wo": fxtp.RowwiseParallel(),
        "lm.layers.*.mlp.net1": fxtp.ColwiseParallel(),
        "lm.layers.*.mlp.net2": fxtp.RowwiseParallel()}


def image_text_inputs():
    ids = torch.randint(0, 64, (2, SEQ), generator=torch.Generator().manual_seed(0))
    kinds = torch.zeros(2, SEQ, dtype=torch.long)
    kinds[:, 2:2 + IMAGE] = 1
    patches = torch.randn(2, IMAGE, 12, generator=torch.Generator().manual_seed(1))
    return ids, patches, kinds


def image_text(rank, world, dtype):
    ids, patches, kinds = image_text_inputs()
    return check_parity(rank, world, ImageTextModel, PLAN, [], dtype=dtype, strict=True,
                        input_grads=False,
                        kwargs=dict(ids=ids, patches=patches.to(dtype), kinds=kinds))


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["fp64", "fp32"])
def test_a_language_model_called_after_vmapped_mask_functions(ranks, dtype):
    """The language model's call is placed after the mask's vmap levels are left (it was
    placed inside them, where its parameters' autograd functions refuse to run), and the
    mask functions' tensor indexing runs as torch's own kept function."""
    assert ranks.run(image_text, dtype)[0] == MEGATRON


def test_the_masks_indexing_is_one_call_outside_any_vmap_level_the_model_left(fake_group):
    fake_group(2)
    ids, patches, kinds = image_text_inputs()
    gm = fxtp.parallelize(ImageTextModel(), PLAN, example_inputs=(),
                          example_kwargs=dict(ids=ids, patches=patches, kinds=kinds))
    nodes = list(gm.graph.nodes)
    levels, depth_at_lm = 0, None
    for node in nodes:
        name = getattr(node.target, "__name__", str(node.target))
        levels += {"_vmap_increment_nesting": 1, "_vmap_decrement_nesting": -1}.get(name, 0)
        if node.op == "call_module" and node.target == "lm":
            depth_at_lm = levels
    assert depth_at_lm == 0
    assert sum(getattr(n.target, "__name__", "") == "ModIndex_apply" for n in nodes) == 2
    assert not gm.fxtp.fallbacks


class DroppingPadding(nn.Module):
    """SmolVLM's and Idefics-3's tower: images that are all zeros (batch padding) are
    dropped by a boolean mask, so the images' count is known only from their values; the
    kept ones are regrouped by views of that count and normalized by a (1, 12) mean
    broadcast over it."""

    def __init__(self):
        super().__init__()
        self.mean = nn.Parameter(torch.zeros(1, 12))
        self.patch = nn.Linear(12, DIM)
        self.lm = LanguageModel()

    def forward(self, ids, patches, kinds):
        real = (patches != 0).any(-1)
        kept = patches[real].view(-1, 4).flip(-1).reshape(-1, 12)  # a shuffle within patches
        features = self.patch(kept - self.mean)  # (images kept, 12) - (1, 12)
        h = self.lm.embed(ids)
        h = h.masked_scatter((kinds == 1)[..., None], features.to(h.dtype))
        return self.lm(h, image_token_mask(kinds))


def dropping_padding(rank, world):
    ids, patches, kinds = image_text_inputs()
    return check_parity(rank, world, DroppingPadding, PLAN, [], dtype=torch.float64,
                        strict=True, input_grads=False,
                        kwargs=dict(ids=ids, patches=patches.double(), kinds=kinds))


def test_a_count_known_only_from_values_broadcasts_without_a_guard(ranks2):
    """The elementwise rule compared a size-1 dim with the images' count, a size export
    knows only as a symbol (u0), and the view rule compared u0 with 3*u0: both raised a
    data-dependent guard error inside propagation. They now ask what is known statically,
    and compare sizes by their ratio."""
    assert ranks2.run(dropping_padding)[0] == MEGATRON


transformers = pytest.importorskip("transformers", reason="pip install -e '.[test]'")
TEXT = dict(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=L,
            num_attention_heads=8, num_key_value_heads=4, head_dim=4,
            max_position_embeddings=64, pad_token_id=0)
VISION = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
              image_size=16, patch_size=4)
IMAGE_TOKEN = 100


def llava():
    """CLIP's vision tower, a projector and Llama."""
    return transformers.LlavaForConditionalGeneration(transformers.LlavaConfig(
        text_config=transformers.LlamaConfig(**TEXT),
        vision_config=transformers.CLIPVisionConfig(**VISION), image_token_id=IMAGE_TOKEN,
        vision_feature_layer=-1, image_seq_length=16))


def paligemma():
    """SigLIP and Gemma, the image tokens' prefix attended bidirectionally."""
    return transformers.PaliGemmaForConditionalGeneration(transformers.PaliGemmaConfig(
        text_config=transformers.GemmaConfig(**TEXT),
        vision_config=transformers.SiglipVisionConfig(**VISION, projection_dim=32),
        image_token_id=IMAGE_TOKEN, projection_dim=32))


def gemma3():
    """SigLIP and Gemma-3: its masks are vmapped mask functions (image tokens see each
    other), its q / k norms act on head shards."""
    return transformers.Gemma3ForConditionalGeneration(transformers.Gemma3Config(
        text_config=transformers.Gemma3TextConfig(**TEXT),
        vision_config=transformers.SiglipVisionConfig(**VISION), image_token_id=IMAGE_TOKEN,
        mm_tokens_per_image=4))


def smolvlm():
    """SigLIP, a pixel shuffle and Llama; padding images are dropped by their values."""
    return transformers.SmolVLMForConditionalGeneration(transformers.SmolVLMConfig(
        text_config=dict(TEXT, model_type="llama"), vision_config=VISION,
        image_token_id=IMAGE_TOKEN, scale_factor=2))


# (image tokens, what the model's norms compute in: Gemma's in fp32 whatever the model's
# dtype, so the ranks' partial sums round as fp32 does, compared at its tolerance)
FAMILIES = {llava: (16, None), paligemma: (16, torch.float32), gemma3: (4, torch.float32),
            smolvlm: (4, None)}


def vision_language(rank, world, make):
    images, compare = FAMILIES[make]
    ids = torch.randint(1, 90, (2, 24), generator=torch.Generator().manual_seed(0))
    ids[:, 2:2 + images] = IMAGE_TOKEN
    pixels = torch.randn(2, 3, 16, 16, generator=torch.Generator().manual_seed(1),
                         dtype=torch.float64)
    kwargs = dict(input_ids=ids, use_cache=False,  # SmolVLM's: (batch, images, 3, h, w)
                  pixel_values=pixels[:, None] if make is smolvlm else pixels)
    if make in (paligemma, gemma3):
        kwargs["token_type_ids"] = (ids == IMAGE_TOKEN).long()
    return check_parity(rank, world, make, "auto", [], dtype=torch.float64, strict=True,
                        input_grads=False, kwargs=kwargs, output=lambda out: out.logits,
                        compare_dtype=compare)


VLM = {  # Megatron's for the language model under the plan it carries, the tower whole
    llava: ({"all_reduce": 2 * L + 1, "all_gather": 1}, {"all_reduce": 2 * L + 1}),
    paligemma: ({"all_reduce": 2 * L + 1, "all_gather": 1}, {"all_reduce": 2 * L + 1}),
    # and Gemma-3's q / k norm weights' partial gradients, one bucket per block
    gemma3: ({"all_reduce": 2 * L + 1, "all_gather": 1}, {"all_reduce": 3 * L + 1}),
    smolvlm: ({"all_reduce": 2 * L + 1, "all_gather": 1}, {"all_reduce": 2 * L + 1}),
}


@pytest.mark.parametrize("make", list(VLM), ids=lambda make: make.__name__)
def test_vision_language_models_under_their_own_plan(ranks2, make):
    assert ranks2.run(vision_language, make)[0] == VLM[make]


def qwen2_vl():
    """Qwen2-VL: its vision tower cuts patches by the images' grid sizes (values torch.export
    cannot trace), and its M-RoPE position ids are computed from them."""
    return transformers.Qwen2VLForConditionalGeneration(transformers.Qwen2VLConfig(
        text_config=dict(TEXT, rope_parameters=dict(rope_type="default", rope_theta=10000.0,
                                                    mrope_section=[1, 1, 0])),
        vision_config=dict(depth=2, embed_dim=32, hidden_size=32, num_heads=4, patch_size=2,
                           spatial_merge_size=2, temporal_patch_size=2, mlp_ratio=2),
        image_token_id=IMAGE_TOKEN, vision_start_token_id=101, vision_end_token_id=102))


def qwen2_vl_inputs():
    ids = torch.randint(1, 90, (2, 24), generator=torch.Generator().manual_seed(0))
    ids[:, 2:6] = IMAGE_TOKEN  # a 4 x 4 grid of patches, merged 2 x 2: 4 image tokens
    return dict(input_ids=ids, mm_token_type_ids=(ids == IMAGE_TOKEN).long(),
                image_grid_thw=torch.tensor([[1, 4, 4], [1, 4, 4]]),
                pixel_values=torch.randn(32, 24, generator=torch.Generator().manual_seed(1),
                                         dtype=torch.float64))


def test_a_tower_computing_sizes_from_values_is_named_with_the_way_around_it(fake_group):
    fake_group(2)
    with pytest.raises(fxtp.TraceError) as error:
        fxtp.parallelize(qwen2_vl().double(), "auto", example_inputs=(),
                         example_kwargs=dict(qwen2_vl_inputs(), use_cache=False))
    message = str(error.value)
    assert "in module 'model.visual.blocks.0.attn'" in message
    assert "outside the plan" in message and "'model.visual'" in message
    assert "inputs_embeds" in message and "position_ids" in message


class OnEmbeddings(nn.Module):
    """The language side of a vision-language model, called as the hint says: on the
    embeddings (image features written in) and the position ids the model derives."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, inputs_embeds, position_ids):
        return self.model(inputs_embeds=inputs_embeds, position_ids=position_ids,
                          use_cache=False).logits


def language_side(rank, world):
    """The tower and the embeddings run on the single-device model outside; the
    parallelized model takes what they give, the embedding it does not call held sharded."""
    torch.manual_seed(0)
    model = qwen2_vl().double()
    kwargs = qwen2_vl_inputs()
    with torch.no_grad():
        whole = model(**kwargs, use_cache=False).logits
        features = model.model.get_image_features(
            kwargs["pixel_values"], kwargs["image_grid_thw"]).pooler_output
        embeds = model.get_input_embeddings()(kwargs["input_ids"]).masked_scatter(
            (kwargs["input_ids"] == IMAGE_TOKEN)[..., None], torch.cat(list(features)))
        positions = model.model.compute_3d_position_ids(
            input_ids=kwargs["input_ids"], image_grid_thw=kwargs["image_grid_thw"],
            mm_token_type_ids=kwargs["mm_token_type_ids"], inputs_embeds=embeds,
            attention_mask=None, cache=None)
        torch.testing.assert_close(OnEmbeddings(model)(embeds, positions), whole, **TIGHT)
    state, uncalled = model.state_dict(), []

    def made():
        made = qwen2_vl()
        made.load_state_dict(state)
        return OnEmbeddings(made)

    def no_fallback(gm):
        assert not gm.fxtp.fallbacks
        uncalled.extend(gm.fxtp.uncalled)
    with pytest.warns(UserWarning, match="'model.model.language_model.embed_tokens' is named "
                                         "by the plan but forward did not call it"):
        counts = check_parity(rank, world, made, "auto", [embeds], dtype=torch.float64,
                              kwargs=dict(position_ids=positions), post=no_fallback)
    return counts, uncalled


def test_a_vision_language_model_on_embeddings_made_outside(ranks2):
    """Parity of the logits, every parameter of the language model and the gradient of the
    embeddings (which the single-device tower's backward takes from there); the embedding
    the plan names is not called: a warning, its weight held by vocabulary rows."""
    counts, uncalled = ranks2.run(language_side)[0]
    assert counts == ({"all_reduce": 2 * L, "all_gather": 1}, {"all_reduce": 2 * L + 1})
    assert uncalled == ["model.model.language_model.embed_tokens"]


def test_a_planned_module_forward_does_not_call_is_refused_under_strict(fake_group):
    fake_group(2)
    model = OnEmbeddings(llava())
    embeds = torch.randn(2, 8, TEXT["hidden_size"])
    with pytest.raises(fxtp.PlanError, match="'model.model.language_model.embed_tokens' is "
                                             "named by the plan but forward did not call it"):
        fxtp.parallelize(model, "auto", example_inputs=(embeds, None), strict=True)
    with pytest.warns(UserWarning, match="holds as its style splits them"):
        gm = fxtp.parallelize(model, "auto", example_inputs=(embeds, None))
    weight = "model.model.language_model.embed_tokens.weight"
    whole = model.get_parameter(weight)
    assert gm.fxtp.param_placements[weight] == Shard(0)  # vocabulary rows, as DTensor's
    assert gm.get_parameter(weight).shape == whole.shape  # a DTensor: global shape
    assert torch.equal(gm.get_parameter(weight).to_local(), whole.detach().chunk(2)[0])


def two_d(rank, world):
    """Llava on a (dp 2, tp 2) mesh, torchtitan's recipe: checkpointing and FSDP2 on the
    blocks of both towers, picked by class, and on the root; each dp rank its half of the
    batch, against the single-device model on the whole batch."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import \
        apply_activation_checkpointing
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from tests.helpers.parity import LR, noise_floor, tolerance
    from tests.helpers.parity import full
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    torch.manual_seed(0)
    model = llava().double()
    ref = copy.deepcopy(model)
    ids = torch.randint(1, 90, (4, 24), generator=torch.Generator().manual_seed(0))
    ids[:, 2:18] = IMAGE_TOKEN
    batch = dict(input_ids=ids, use_cache=False, pixel_values=torch.randn(
        4, 3, 16, 16, generator=torch.Generator().manual_seed(1), dtype=torch.float64))
    dp = mesh["dp"].get_local_rank()
    mine = {k: v.chunk(2)[dp] if torch.is_tensor(v) else v for k, v in batch.items()}
    gm = fxtp.parallelize(model, "auto", mesh["tp"], example_inputs=(), example_kwargs=mine,
                          strict=True)
    kinds = (transformers.models.clip.modeling_clip.CLIPEncoderLayer,
             transformers.models.llama.modeling_llama.LlamaDecoderLayer)
    apply_activation_checkpointing(gm, check_fn=lambda m: isinstance(m, kinds))
    blocks = [m for m in gm.modules() if isinstance(m, kinds)]
    for block in blocks:
        fully_shard(block, mesh=mesh["dp"])
    fully_shard(gm, mesh=mesh["dp"])
    opt, ref_opt = (torch.optim.AdamW(m.parameters(), lr=LR) for m in (gm, ref))
    params = {n.replace("_checkpoint_wrapped_module.", ""): p for n, p in gm.named_parameters()}
    for step in range(3):
        out, ref_out = gm(**mine).logits, ref(**batch).logits
        torch.testing.assert_close(out, ref_out.chunk(2)[dp],
                                   **tolerance(torch.float64, ref_out, step))
        out.square().mean().backward()
        ref_out.square().mean().backward()  # the mean over the global batch
        if step == 0:  # a true zero (a key bias's) is rounding noise either side
            floor = noise_floor([p.grad for p in ref.parameters() if p.grad is not None],
                                torch.float64)
            for name, p in params.items():
                torch.testing.assert_close(full(p.grad), ref.get_parameter(name).grad,
                                           rtol=TIGHT["rtol"], atol=max(TIGHT["atol"], floor),
                                           msg=lambda m: f"grad of {name}: {m}")
        opt.step()
        ref_opt.step()
        opt.zero_grad()
        ref_opt.zero_grad()
    for name, p in params.items():
        torch.testing.assert_close(full(p.detach()), ref.get_parameter(name).detach(),
                                   **tolerance(torch.float64, steps=3),
                                   msg=lambda m: f"{name} after 3 AdamW steps: {m}")
    return len(blocks)


def test_a_vision_language_model_trains_under_fsdp2_per_block_on_a_2d_mesh(ranks4):
    assert ranks4.run(two_d) == [2 * L] * 4  # CLIP's two blocks and Llama's two


def llava_next():
    """Llava-NeXT: image features packed by the values of ``image_sizes`` (any resolution),
    in the model's own code around the planned language model."""
    return transformers.LlavaNextForConditionalGeneration(transformers.LlavaNextConfig(
        text_config=transformers.LlamaConfig(**TEXT),
        vision_config=transformers.CLIPVisionConfig(**VISION), image_token_index=IMAGE_TOKEN,
        vision_feature_layer=-1, image_grid_pinpoints=[[16, 16]]))


def test_sizes_from_images_in_the_models_own_code_are_named_with_the_way_around(fake_group):
    fake_group(2)
    ids = torch.randint(1, 90, (2, 48), generator=torch.Generator().manual_seed(0))
    pixels = torch.randn(2, 2, 3, 16, 16, generator=torch.Generator().manual_seed(1))
    with pytest.raises(fxtp.TraceError) as error:
        fxtp.parallelize(llava_next(), "auto", example_inputs=(), example_kwargs=dict(
            input_ids=ids, pixel_values=pixels, image_sizes=torch.tensor([[16, 16]] * 2),
            use_cache=False))
    message = str(error.value)
    assert "in module 'model' (LlavaNextModel)" in message
    assert "computes sizes from its images (pixel_values" in message
    assert "inputs_embeds" in message and "vision tower" in message
