"""Serving a Hugging Face causal LM: tensor-parallel with a static KV cache sharded by heads,
one module for prefill and decode, and Hugging Face's generation (greedy and sampling).

    gm = fxtp.parallelize_causal_lm(model, "auto", batch_size=1, max_cache_len=256)
    tokens = gm.generate(input_ids, max_new_tokens=64, do_sample=True, top_k=50)

The cache is transformers' ``StaticCache`` as its export wrapper
(``TorchExportableModuleWithStaticCache``) registers it: one key and one value buffer per
layer, written by ``index_copy_`` at ``cache_position``, each shaped as the model writes
it (:func:`static_cache_module`). fxtp places each buffer as what is written into it, so
each rank holds its KV heads (1/world of the cache). ``DynamicCache`` (a Python list grown
per step) and the state of linear-attention and state-space layers (Mamba, gated delta
nets), which branch between prefill and decoding, are not traceable as one program.
"""
from __future__ import annotations

import copy
import types

import torch
import torch.nn as nn
from torch.export import Dim

from .parallelize import parallelize
from .passes.errors import PlanError
from .plan import carried_plan

SAMPLING_OPTIONS = ("do_sample", "temperature", "top_k", "top_p", "max_new_tokens",
                    "max_length", "eos_token_id", "pad_token_id")
"""Generation options :func:`generate` follows; any other option set away from its default
(beam search, repetition penalty, ...) is an error naming it."""


def parallelize_causal_lm(model: nn.Module, plan="auto", mesh=None, *, batch_size: int,
                          max_cache_len: int, **parallelize_kwargs) -> torch.fx.GraphModule:
    """This rank's module of the Hugging Face causal LM ``model`` with a static KV cache
    for ``batch_size`` sequences of up to ``max_cache_len`` tokens:
    ``gm(input_ids=(batch, T), cache_position=(T,))`` -> logits, for any ``T`` (prefill and
    decode alike), and ``gm.generate(input_ids, **options)``, which is :func:`generate`.
    ``plan`` is relative to ``model`` (``"auto"``: its own). The model is not modified."""
    wrapper = static_cache_module(model, batch_size, max_cache_len)
    if plan == "auto":
        plan = carried_plan(model)
    if not isinstance(plan, dict):
        raise PlanError("parallelize_causal_lm takes plan='auto' or a dict of FQN patterns "
                        f"under the model, got {plan!r}")
    example = min(4, max_cache_len - 1)  # export specializes dims of size 0 and 1
    device = next(model.parameters()).device
    seq = Dim.DYNAMIC(min=1, max=max_cache_len)  # export guards what it must assume
    gm = parallelize(
        wrapper, {f"model.{key}": style for key, style in plan.items()}, mesh,
        example_inputs=(),
        example_kwargs=dict(input_ids=torch.zeros(batch_size, example, dtype=torch.long,
                                                  device=device),
                            cache_position=torch.arange(example, device=device)),
        dynamic_shapes={"input_ids": {1: seq}, "cache_position": {0: seq}},
        **parallelize_kwargs)
    gm.generation_config = copy.deepcopy(model.generation_config)
    gm.generate = types.MethodType(generate, gm)
    return gm


@torch.no_grad()
def static_cache_module(model: nn.Module, batch_size: int, max_cache_len: int) -> nn.Module:
    """transformers' export wrapper (``TorchExportableModuleWithStaticCache``) of ``model``
    with a ``StaticCache`` whose buffers have the shapes the model writes into them: each
    layer is allocated by one eager step of one token (as ``generate`` allocates it), not
    from the config's head counts, which do not fit latent attention (DeepSeek's MLA) or
    layers with heads of their own. The step's writes are then cleared. Sliding-window
    layers keep every position (their masks still see only the window), as in the
    wrapper."""
    from transformers.cache_utils import (DummyLayer, StaticCache, StaticLayer,
                                          StaticSlidingWindowLayer)
    from transformers.integrations.executorch import TorchExportableModuleWithStaticCache
    name = type(model).__name__
    advice = ("serve it with its own generate, or parallelize its forward without a cache "
              "(fxtp.parallelize(model, plan, ..., example_kwargs=dict(use_cache=False)))")
    try:
        cache = StaticCache(max_cache_len=max_cache_len, config=model.config.get_text_config())
    except Exception as e:  # noqa: BLE001 - named in the error
        raise PlanError(f"parallelize_causal_lm needs transformers' StaticCache for {name}, "
                        f"which it does not build ({type(e).__name__}: {e}); {advice}") from e
    for i, layer in enumerate(cache.layers):
        if isinstance(layer, StaticSlidingWindowLayer):
            cache.layers[i] = StaticLayer(max_cache_len)
        elif isinstance(layer, DummyLayer):  # a layer reading another's cache: none
            cache.layers[i] = StaticLayer(0)
        elif not isinstance(layer, StaticLayer):
            raise PlanError(
                f"parallelize_causal_lm serves a cache of keys and values per layer; "
                f"{name}'s layer {i} keeps a {type(layer).__name__}, whose state takes "
                f"another program for prefill than for decoding; {advice}")
    wrapper = TorchExportableModuleWithStaticCache.__new__(TorchExportableModuleWithStaticCache)
    nn.Module.__init__(wrapper)
    wrapper.model, wrapper.static_cache = model, cache
    device = next(model.parameters()).device
    first = torch.zeros(batch_size, 1, dtype=torch.long, device=device)
    try:
        with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
            wrapper(input_ids=first, cache_position=torch.zeros(1, dtype=torch.long,
                                                                device=device))
    except Exception as e:  # noqa: BLE001 - named in the error
        raise PlanError(f"{name} does not run on transformers' StaticCache, which "
                        f"parallelize_causal_lm serves it with ({type(e).__name__}: {e}); "
                        f"{advice}") from e
    for i, layer in enumerate(cache.layers):
        if not layer.is_initialized:  # never written
            nothing = torch.zeros(batch_size, 1, 1, 1, dtype=model.dtype, device=device)
            layer.lazy_initialization(nothing, nothing)
        layer.keys.zero_()
        layer.values.zero_()
        layer.cumulative_length.zero_()
        wrapper.register_buffer(f"key_cache_{i}", layer.keys, persistent=False)
        wrapper.register_buffer(f"value_cache_{i}", layer.values, persistent=False)
        wrapper.register_buffer(f"cumulative_length_{i}", layer.cumulative_length,
                                persistent=False)
    return wrapper


@torch.no_grad()
def generate(module, input_ids: torch.Tensor, **options) -> torch.Tensor:
    """``input_ids`` followed by the generated tokens, as Hugging Face's ``generate`` gives
    them for ``options`` over ``module.generation_config`` (greedy, or sampling with
    temperature, top-k and top-p; stopping at ``max_new_tokens`` / ``max_length`` and
    when every sequence has given an end-of-sequence token, finished ones padded).
    ``module``: :func:`parallelize_causal_lm`'s result (or the same wrapper unparallelized).
    Sampling draws from torch's global generator, as ``generate`` does: seed it alike on
    every rank (the logits are the same on every rank, so then are the tokens)."""
    from transformers import GenerationConfig
    from transformers.generation.logits_process import (LogitsProcessorList,
                                                        TemperatureLogitsWarper,
                                                        TopKLogitsWarper, TopPLogitsWarper)
    config = copy.deepcopy(getattr(module, "generation_config", None) or GenerationConfig())
    unknown = config.update(**options)
    # unset fields take generate's defaults (top_k 50, max_length 20, ...)
    defaults = GenerationConfig._get_default_generation_params()
    value = lambda key: getattr(config, key, None) if getattr(config, key, None) is not None \
        else defaults.get(key)  # noqa: E731
    unsupported = sorted({*unknown} | {key for key in _SEARCH_OPTIONS
                                       if value(key) not in (None, defaults.get(key))})
    if unsupported:
        raise PlanError(f"fxtp.generate does not follow the generation option(s) "
                        f"{', '.join(unsupported)}; it supports {', '.join(SAMPLING_OPTIONS)}")
    batch, length = input_ids.shape
    new = config.max_new_tokens if config.max_new_tokens is not None else \
        value("max_length") - length
    warpers = LogitsProcessorList()
    if value("do_sample"):  # Hugging Face's order
        if value("temperature") != 1.0:
            warpers.append(TemperatureLogitsWarper(value("temperature")))
        if value("top_k") != 0:
            warpers.append(TopKLogitsWarper(value("top_k"), min_tokens_to_keep=1))
        if value("top_p") < 1.0:
            warpers.append(TopPLogitsWarper(value("top_p"), min_tokens_to_keep=1))
    eos = config.eos_token_id
    eos = torch.tensor([eos] if isinstance(eos, int) else (eos or []), device=input_ids.device)
    pad = config.pad_token_id if config.pad_token_id is not None else \
        (int(eos[0]) if len(eos) else 0)
    unfinished = torch.ones(batch, dtype=torch.bool, device=input_ids.device)
    tokens = input_ids
    logits = module(input_ids=input_ids, cache_position=torch.arange(length,
                                                                      device=input_ids.device))
    for step in range(new):
        scores = warpers(tokens, logits[:, -1].float())
        if value("do_sample"):
            chosen = torch.multinomial(torch.softmax(scores, -1), 1).squeeze(1)
        else:
            chosen = scores.argmax(-1)
        if len(eos):
            chosen = torch.where(unfinished, chosen, pad)
            unfinished &= ~torch.isin(chosen, eos)
        tokens = torch.cat([tokens, chosen[:, None]], 1)
        if step + 1 == new or not unfinished.any():
            break
        logits = module(input_ids=chosen[:, None],
                        cache_position=torch.tensor([length + step], device=input_ids.device))
    return tokens


_SEARCH_OPTIONS = ("num_beams", "num_beam_groups", "penalty_alpha", "repetition_penalty",
                   "no_repeat_ngram_size", "bad_words_ids", "min_length", "min_new_tokens",
                   "min_p", "typical_p", "epsilon_cutoff", "eta_cutoff",
                   "encoder_repetition_penalty", "length_penalty", "suppress_tokens",
                   "begin_suppress_tokens", "forced_bos_token_id", "forced_eos_token_id",
                   "sequence_bias", "guidance_scale", "num_return_sequences")
