"""Serving a Hugging Face causal LM: tensor-parallel with a static KV cache sharded by heads,
one module for prefill and decode, and Hugging Face's generation (greedy and sampling).

    gm = fxtp.parallelize_causal_lm(model, "auto", batch_size=1, max_cache_len=256)
    tokens = gm.generate(input_ids, max_new_tokens=64, do_sample=True, top_k=50)

The cache is transformers' ``StaticCache``, registered as its export wrapper
(``TorchExportableModuleWithStaticCache``) registers it: one key and one value buffer per
layer, written by ``index_copy_`` at ``cache_position``, each shaped as the model writes
it (:func:`static_cache_module`); linear-attention and state-space layers (Mamba, gated
delta nets, short convolutions) keep their conv and recurrent states as buffers too, and
take a program for decoding beside the one for prefill. fxtp places each buffer as what
is written into it, so each rank holds its KV heads (1/world of the cache) and its
channels of each state. ``DynamicCache`` (a Python list grown per step) is not module
state.
"""
from __future__ import annotations

import copy
import inspect
import types
import warnings

import torch
import torch.nn as nn
from torch.export import Dim

from ..passes.errors import PlanError, TraceError
from ..pipeline import parallelize
from ..plans.resolution import carried_plan

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
    ``plan`` is relative to ``model`` (``"auto"``: its own). The model is not modified.

    A model with linear-attention or state-space layers (their conv and recurrent state
    is module state too) takes one program for decoding (``T == 1``: the model's one-step
    recurrence) and one for prefill (``T >= 2``: its chunked form); they share every
    tensor, and ``gm`` calls the one a call's length takes."""
    wrapper = static_cache_module(model, batch_size, max_cache_len)
    if plan == "auto":
        plan = carried_plan(model)
    if not isinstance(plan, dict):
        raise PlanError("parallelize_causal_lm takes plan='auto' or a dict of FQN patterns "
                        f"under the model, got {plan!r}")
    device = next(model.parameters()).device

    def program(example: int, shortest: int):
        seq = Dim.DYNAMIC(min=shortest, max=max_cache_len)  # export guards what it assumes
        return parallelize(
            wrapper, {f"model.{key}": style for key, style in plan.items()}, mesh,
            example_inputs=(),
            example_kwargs=dict(input_ids=torch.zeros(batch_size, example, dtype=torch.long,
                                                      device=device),
                                cache_position=torch.arange(example, device=device)),
            dynamic_shapes={"input_ids": {1: seq}, "cache_position": {0: seq}} if
            example > 1 else None,
            **parallelize_kwargs)
    example = min(4, max_cache_len - 1)  # export specializes dims of size 0 and 1
    try:
        gm = program(example, 2 if wrapper.recurrent else 1)
    except TraceError as e:
        if "Constraints violated" not in str(e):
            raise
        warnings.warn(f"fxtp.parallelize_causal_lm: {type(model).__name__}'s forward takes "
                      f"the sequence length as a constant (a Python loop over it, such as "
                      f"a Mamba scan without its kernels), so no program serves every "
                      f"length: prefill runs the one-token program once per token")
        gm = program(1, 1)
        gm.forward = types.MethodType(_token_by_token(type(gm).forward), gm)
    else:
        if wrapper.recurrent:
            decode = program(1, 1)
            _share_tensors(gm, decode)
            object.__setattr__(gm, "decode_program", decode)  # not a submodule: no keys
            gm.forward = types.MethodType(_prefill_or_decode(type(gm).forward, decode), gm)
            gm._apply = types.MethodType(_applied_to_both(decode), gm)
    gm.generation_config = copy.deepcopy(model.generation_config)
    gm.generate = types.MethodType(generate, gm)
    return gm


def _token_by_token(one_token):
    """A forward that runs ``one_token`` (the module's own, traced for one token) on each
    token of a call in turn, and gives the logits of all."""
    def forward(self, input_ids, cache_position):
        return torch.cat([one_token(self, input_ids=input_ids[:, i:i + 1],
                                    cache_position=cache_position[i:i + 1])
                          for i in range(input_ids.shape[1])], 1)
    return forward


def _prefill_or_decode(prefill, decode: nn.Module):
    """A forward that runs ``decode`` for one token, ``prefill`` (the module's own) for
    more; ``decode`` is held by the function, not as a submodule (it shares every tensor
    of the module, under the same names)."""
    def forward(self, input_ids, cache_position):
        if input_ids.shape[1] == 1:
            return decode(input_ids=input_ids, cache_position=cache_position)
        return prefill(self, input_ids=input_ids, cache_position=cache_position)
    return forward


def _applied_to_both(decode: nn.Module):
    """``Module._apply`` (``to``, ``cuda``, ...) that shares the module's new tensors with
    ``decode`` again: it replaces buffers (and parameters, where their kinds change) by
    new tensors in the module it is applied to only."""
    def _apply(self, fn, recurse=True):
        type(self)._apply(self, fn, recurse)
        _share_tensors(self, decode)
        return self
    return _apply


def _share_tensors(source: nn.Module, target: nn.Module) -> None:
    """Make every parameter and buffer of ``target`` the one ``source`` holds under the
    same name (two programs of one model: the same shards, the same placements)."""
    mine, theirs = source.fxtp.param_placements, target.fxtp.param_placements
    differ = sorted(n for n in mine.keys() | theirs.keys() if mine.get(n) != theirs.get(n))
    if differ:
        raise PlanError(f"parallelize_causal_lm traced the prefill and the decoding program "
                        f"with other layouts for {differ[:4]}: they cannot share them")
    tensors = {**dict(source.named_parameters(remove_duplicate=False)),
               **dict(source.named_buffers(remove_duplicate=False))}
    for fqn, t in [*target.named_parameters(remove_duplicate=False),
                   *target.named_buffers(remove_duplicate=False)]:
        owner, _, name = fqn.rpartition(".")
        held = target.get_submodule(owner)
        table = held._parameters if name in held._parameters else held._buffers
        table[name] = tensors[fqn]


class StaticCacheLM(nn.Module):
    """``model`` serving from a transformers ``StaticCache``, as its export wrapper
    (``TorchExportableModuleWithStaticCache``) does: ``forward(input_ids,
    cache_position)`` -> logits, the cache's tensors registered as buffers
    (``key_cache_i``, ``value_cache_i``, ``cumulative_length_i``; ``conv_state_i_j``,
    ``recurrent_state_i_j`` of linear-attention and state-space layers). A call at
    position 0 starts a sequence: the recurrent states are cleared (attention layers
    are overwritten from there and masked past it)."""

    def __init__(self, model: nn.Module, cache, recurrent: bool):
        super().__init__()
        self.model, self.static_cache, self.recurrent = model, cache, recurrent
        parameters = inspect.signature(type(model).forward).parameters
        self._cache_argument = "cache" if "cache" in parameters else "past_key_values"

    def forward(self, input_ids: torch.Tensor, cache_position: torch.Tensor) -> torch.Tensor:
        for name, state in self.named_buffers(recurse=False):
            if name.startswith("cumulative_length_"):
                state.copy_(cache_position[0])
            elif name.startswith(("conv_state_", "recurrent_state_")):
                state.mul_(cache_position[0] > 0)
        out = self.model(input_ids=input_ids, attention_mask=None, use_cache=True,
                         **{self._cache_argument: self.static_cache})
        return out.logits if hasattr(out, "logits") else out.last_hidden_state


@torch.no_grad()
def static_cache_module(model: nn.Module, batch_size: int, max_cache_len: int
                        ) -> StaticCacheLM:
    """:class:`StaticCacheLM` of ``model`` with a ``StaticCache`` whose tensors have the
    shapes the model writes into them: each layer is allocated by one eager step of one
    token (as ``generate`` allocates it), not from the config's head counts, which do not
    fit latent attention (DeepSeek's MLA) or layers with heads of their own. The step's
    writes are then cleared. Sliding-window layers keep every position (their masks still
    see only the window), as in transformers' export wrapper."""
    from transformers import cache_utils
    name = type(model).__name__
    advice = ("serve it with its own generate, or parallelize its forward without a cache "
              "(fxtp.parallelize(model, plan, ..., example_kwargs=dict(use_cache=False)))")
    try:
        cache = cache_utils.StaticCache(max_cache_len=max_cache_len,
                                        config=model.config.get_text_config())
    except Exception as e:  # noqa: BLE001 - named in the error
        raise PlanError(f"parallelize_causal_lm needs transformers' StaticCache for {name}, "
                        f"which it does not build ({type(e).__name__}: {e}); {advice}") from e
    recurrent = getattr(cache_utils, "LinearAttentionLayer", ())
    for i, layer in enumerate(cache.layers):
        if isinstance(layer, cache_utils.StaticSlidingWindowLayer):
            cache.layers[i] = cache_utils.StaticLayer(max_cache_len)
        elif isinstance(layer, cache_utils.DummyLayer):  # reads another layer's cache
            cache.layers[i] = cache_utils.StaticLayer(0)
        elif not isinstance(layer, (cache_utils.StaticLayer, recurrent)) or \
                isinstance(layer, cache_utils.DynamicLayer):
            raise PlanError(f"parallelize_causal_lm serves a cache of keys and values, and of "
                            f"linear-attention states, per layer; {name}'s layer {i} keeps a "
                            f"{type(layer).__name__}; {advice}")
    wrapper = StaticCacheLM(model, cache, any(isinstance(layer, recurrent)
                                              for layer in cache.layers))
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
        if isinstance(layer, recurrent):
            for kind in ("conv", "recurrent"):
                for j, state in getattr(layer, f"{kind}_states").items():
                    if state is not None:
                        wrapper.register_buffer(f"{kind}_state_{i}_{j}", state.zero_(),
                                                persistent=False)
            continue
        if not layer.is_initialized:  # never written
            nothing = torch.zeros(batch_size, 1, 1, 1, dtype=model.dtype, device=device)
            layer.lazy_initialization(nothing, nothing)
        for kind, tensor in (("key_cache", layer.keys), ("value_cache", layer.values),
                             ("cumulative_length", layer.cumulative_length)):
            wrapper.register_buffer(f"{kind}_{i}", tensor.zero_(), persistent=False)
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
