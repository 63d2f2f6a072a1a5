"""Randomized differential testing: small models and plans drawn from a grammar of real
model code, each checked against the single-device model.

A case is ``(seed, world)``. :func:`draw` turns it into a :class:`Config`, a flat record
of choices (sizes, the attention's and MLP's code, norms, RoPE, casts, in-place ops,
autocast / checkpoint regions, torch.compile, the plan); :func:`render` writes the config
as the Python source of a module (``Model``, ``PLAN``, ``inputs()``, ``DTYPE``) that a user
could have written, and :func:`load` executes it. The ranks rebuild the case from
``(seed, world)``, so a case is reproduced, printed and shrunk from those two numbers::

    python -m tests.helpers.fuzz show 17 --world 4          # the model, plan and inputs as code
    python -m tests.helpers.fuzz run --world 2 --cases 200  # a campaign, one JSON line per case
    python -m tests.helpers.fuzz one 17 --world 4           # run one case, print its verdict
    python -m tests.helpers.fuzz shrink 17 --world 4        # simplify while the verdict holds
    python -m tests.helpers.fuzz summary results.jsonl      # verdicts by class

:func:`run_case` (called on every rank of a ``RankPool``) runs the case on a process group
of its own with a short timeout, so a rank that crashes while the others wait in a
collective ends the case in seconds, not at the harness's timeout, and never raises: it
returns a verdict that :func:`combine` merges across ranks. Verdicts: ``pass``;
``fallback`` (parity holds, ``gm.fxtp.fallbacks`` is not empty); ``mismatch`` (a value,
dtype or shape differs from single device: the output, a gradient, a parameter after the
optimizer steps); ``crash`` (an exception from inside fxtp or the per-rank program; an
fxtp error such as ``ShardingError`` is ``rejected``); ``hang`` (a rank failed while the
others timed out waiting); ``leak`` (autocast or grad mode left changed after the case);
``generator`` (the single-device model itself failed: a bug of this file).

Tolerances are :func:`tests.helpers.parity.tolerance`'s for :attr:`Config.compare_dtype`: bf16 where
the case computes in bf16 (autocast, bf16 parameters or casts), where also an fp64 twin of
the single-device model measures how far bf16 rounding alone moves each value (see
:func:`_compare`); fp32 where an fp64 model computes some op in fp32.
"""
from __future__ import annotations

import argparse
import contextlib
import copy
import dataclasses
import datetime
import json
import linecache
import os
import random
import re
import sys
import time
import traceback
import warnings
from dataclasses import dataclass

import torch

DTYPES = {"float64": torch.float64, "float32": torch.float32, "bfloat16": torch.bfloat16}
# how long a rank waits for the others in a collective (ranks of a busy machine run apart)
GROUP_TIMEOUT_S = float(os.environ.get("FXTP_FUZZ_GROUP_TIMEOUT", 60))
AC = 'torch.autocast("cpu", dtype=torch.bfloat16)'


@dataclass(frozen=True)
class Config:
    """Every choice a case makes; :func:`render` writes it as code."""
    seed: int
    world: int
    dtype: str = "float64"          # the model's parameters: float64, float32, bfloat16
    batch: int = 2
    seq: int = 8
    dim: int = 16
    heads: int = 4
    kv_heads: int = 4
    head_dim: int = 4
    hidden: int = 32
    vocab: int = 32
    layers: int = 1
    inputs: str = "tokens"          # tokens (nn.Embedding) | features | features_proj
    embed_dropout: bool = False
    norm: str = "rmsnorm"           # layernorm | layernorm_nobias | rmsnorm | rmsnorm_hand
    final_norm: bool = True
    block: str = "pre"              # pre | post | parallel (GPT-J: one norm, attn + mlp)
    inplace_residual: bool = False  # a = attn(...); a.add_(x)
    qkv: str = "separate"           # separate | fused_split | fused_chunk | fused_unbind
    #                                 | fused_permute (timm) | fused_kv (q, then kv chunked)
    qkv_bias: bool = False
    o_bias: bool = False
    heads_view: str = "view"        # view | view_neg_head_dim (-1 for HD) | view_neg_heads
    #                                 | unflatten | reshape (global constants)
    rope: str = "none"              # none | half (rotate_half) | interleaved (pairs)
    rope_layout: str = "after_transpose"  # or before_transpose: (b, s, h, d) with cos[:, None]
    gqa_repeat: str = "repeat_interleave"  # | expand (HF repeat_kv) | repeat | enable_gqa
    core: str = "sdpa"              # sdpa | manual (softmax(q k^T) v)
    causal: bool = True
    mask_inplace: bool = False      # manual: scores.masked_fill_ rather than masked_fill
    softmax_fp32: bool = False      # manual: softmax(scores.float()).to(q.dtype)
    attn_dropout: bool = False      # manual: dropout on the probabilities
    merge_heads: str = "reshape"    # reshape | contiguous_view | flatten
    mlp: str = "plain"              # plain | swiglu | fused_swiglu (w13 chunked)
    act: str = "gelu"               # gelu | gelu_tanh | relu | silu
    mlp_bias: bool = False
    mlp_norm: bool = False          # a norm over the hidden (sharded) features
    mlp_scale_inplace: bool = False  # u = up(x); u.mul_(0.5)
    mlp_dropout: bool = False
    head_bias: bool = False
    output: str = "logits"          # logits | loss | sum | mean | amax
    loss_float: bool = False        # logits.float() before the loss / reduction
    loss_options: str = ""          # "" | ignore (targets with -100) | smoothing
    bf16_roundtrip: bool = False    # a = a.to(bf16).to(x.dtype) on the attention output
    autocast: str = "none"          # none | layers | attn | mlp | head (a bf16 region)
    checkpoint: str = "none"        # none | layers | mlp (use_reentrant=False regions)
    compile: str = "none"           # none | aot_eager | inductor (torch.compile(gm))
    plan_kind: str = "megatron"     # megatron | sp | random | mutated
    plan: tuple = ()                # ((module pattern, style source), ...)
    root_input: str = ""            # "" | a root PrepareModuleInput (Replicate -> Shard(1))
    steps: int = 3

    @property
    def compare_dtype(self) -> torch.dtype:
        """The dtype whose tolerance applies: bf16 where some op computes in bf16, fp32
        where an fp64 model computes some op in fp32 (``x.float()`` in a norm, the
        softmax or the loss), else the model's."""
        if self.low_precision:
            return torch.bfloat16
        if self.dtype == "float64" and (self.norm == "rmsnorm_hand" or self.loss_float or
                                        (self.softmax_fp32 and self.core == "manual")):
            return torch.float32
        return DTYPES[self.dtype]

    @property
    def low_precision(self) -> bool:
        """Some op computes in bf16: the comparison takes bf16's tolerance."""
        return self.dtype == "bfloat16" or self.bf16_roundtrip or (
            self.autocast != "none" and self.dtype != "float64")

    def features(self) -> list[str]:
        """Short tags of what the case exercises (for statistics and the CI slice)."""
        d = Config(self.seed, self.world)
        tags = [f"{f.name}={getattr(self, f.name)}" for f in dataclasses.fields(self)
                if f.name not in ("seed", "world", "plan", "batch", "seq", "dim", "hidden",
                                  "vocab", "head_dim", "steps")
                and getattr(self, f.name) != getattr(d, f.name)]
        if self.heads % self.world:
            tags.append("heads%world")
        if self.kv_heads < self.world:
            tags.append("kv<world")
        if self.hidden % self.world:
            tags.append("hidden%world")
        if self.vocab % self.world:
            tags.append("vocab%world")
        if self.seq % self.world:
            tags.append("seq%world")
        return tags

    def beyond_heads(self) -> str:
        """Why no rank can hold whole heads with every KV head its query heads use, or "":
        attention then cannot be computed head-parallel as planned, by fxtp (which gathers,
        and reports it) or by any peer (Megatron and vLLM refuse such head counts; DTensor's
        local views compute other numbers)."""
        if self.heads < self.world:
            return "fewer query heads than ranks"
        if self.kv_heads % self.world and self.world % self.kv_heads:
            return "KV heads neither a multiple nor a divisor of the world size"
        if self.kv_heads < self.heads and self.gqa_repeat == "repeat":
            return "KV heads tiled by repeat: each rank's query heads use KV heads of others"
        return ""


# --- drawing a case ------------------------------------------------------------------------

def _pick(rng: random.Random, weighted: dict):
    keys = list(weighted)
    return rng.choices(keys, weights=[weighted[k] for k in keys])[0]


def draw(seed: int, world: int) -> Config:
    """The case ``(seed, world)``: the same config in every process."""
    rng = random.Random(f"fxtp-fuzz:{seed}:{world}")
    c = {"seed": seed, "world": world}
    c["dtype"] = _pick(rng, {"float64": 50, "float32": 42, "bfloat16": 8})
    c["batch"] = _pick(rng, {2: 8, 1: 1, 3: 1})
    c["seq"] = _pick(rng, {8: 8, 4: 1, 6: 1})
    c["head_dim"] = _pick(rng, {4: 6, 8: 3, 2: 1})
    c["heads"] = _pick(rng, {2: 1, 4: 4, 6: 1, 8: 2} if world == 4 else
                       {2: 2, 4: 4, 6: 1, 8: 1})
    c["kv_heads"] = c["heads"]
    if rng.random() < 0.35:  # grouped-query / multi-query
        c["kv_heads"] = rng.choice([k for k in range(1, c["heads"]) if c["heads"] % k == 0])
    if c["kv_heads"] * c["head_dim"] < world:  # a PlanError: fewer features than ranks
        c["head_dim"] = 4
    c["dim"] = c["heads"] * c["head_dim"] if rng.random() < 0.7 else rng.choice([16, 24, 32])
    c["hidden"] = rng.choice([2, 3, 4]) * c["dim"] + _pick(rng, {0: 8, 1: 1, 2: 1})
    c["vocab"] = _pick(rng, {32: 5, 48: 2, 30: 2, 37: 1})
    c["layers"] = _pick(rng, {1: 4, 2: 4, 3: 2})
    c["inputs"] = _pick(rng, {"tokens": 6, "features": 2, "features_proj": 2})
    c["embed_dropout"] = rng.random() < 0.1
    c["norm"] = _pick(rng, {"layernorm": 3, "layernorm_nobias": 1, "rmsnorm": 3,
                            "rmsnorm_hand": 3})
    c["final_norm"] = rng.random() < 0.85
    c["block"] = _pick(rng, {"pre": 7, "post": 2, "parallel": 1})
    c["inplace_residual"] = c["block"] == "pre" and rng.random() < 0.15
    equal = c["kv_heads"] == c["heads"]
    c["qkv"] = _pick(rng, {"separate": 6, "fused_split": 2, "fused_kv": 1,
                           **({"fused_chunk": 1, "fused_unbind": 1, "fused_permute": 1}
                              if equal else {})})
    c["qkv_bias"] = rng.random() < 0.3
    c["o_bias"] = rng.random() < 0.3
    c["heads_view"] = _pick(rng, {"view": 4, "view_neg_head_dim": 2, "view_neg_heads": 2,
                                  "unflatten": 1, "reshape": 1})
    c["rope"] = _pick(rng, {"none": 4, "half": 4, "interleaved": 2})
    c["rope_layout"] = "after_transpose" if c["qkv"] == "fused_permute" or \
        rng.random() < 0.7 else "before_transpose"
    c["core"] = _pick(rng, {"sdpa": 6, "manual": 4})
    c["gqa_repeat"] = _pick(rng, {"repeat_interleave": 3, "expand": 3, "repeat": 1,
                                  **({"enable_gqa": 2} if c["core"] == "sdpa" else {})})
    c["causal"] = rng.random() < 0.8
    manual = c["core"] == "manual"
    c["mask_inplace"] = manual and c["causal"] and rng.random() < 0.4
    c["softmax_fp32"] = manual and rng.random() < 0.4
    c["attn_dropout"] = manual and rng.random() < 0.15
    c["merge_heads"] = _pick(rng, {"reshape": 4, "contiguous_view": 3, "flatten": 2})
    c["mlp"] = _pick(rng, {"plain": 4, "swiglu": 4, "fused_swiglu": 2})
    c["act"] = "silu" if c["mlp"] != "plain" and rng.random() < 0.7 else \
        _pick(rng, {"gelu": 3, "gelu_tanh": 1, "relu": 2, "silu": 2})
    c["mlp_bias"] = rng.random() < 0.3
    c["mlp_norm"] = rng.random() < 0.12
    c["mlp_scale_inplace"] = rng.random() < 0.12
    c["mlp_dropout"] = rng.random() < 0.1
    c["head_bias"] = rng.random() < 0.15
    c["output"] = _pick(rng, {"logits": 4, "loss": 5, "sum": 1, "mean": 1, "amax": 1})
    c["loss_float"] = rng.random() < 0.4
    c["loss_options"] = _pick(rng, {"": 6, "ignore": 2, "smoothing": 1}) \
        if c["output"] == "loss" else ""
    c["bf16_roundtrip"] = rng.random() < 0.05
    c["autocast"] = _pick(rng, {"none": 80, "layers": 8, "attn": 5, "mlp": 3, "head": 4})
    c["checkpoint"] = _pick(rng, {"none": 80, "layers": 12, "mlp": 8})
    c["compile"] = _pick(rng, {"none": 97, "aot_eager": 2, "inductor": 1})
    cfg = Config(**c)
    if cfg.low_precision and cfg.act == "relu":
        # bf16 rounding flips some of ReLU's mask, and a flipped element's gradient is a
        # whole term: fxtp's bf16 partial sums and single device's round apart, which is
        # not an error (no other rng draw depends on this)
        cfg = dataclasses.replace(cfg, act="gelu")
    if cfg.compile == "inductor" and cfg.dtype == "bfloat16":
        # torch's CPU inductor fails on some bf16 models on one device too ("conflicting
        # declaration of at_BFloat16_tmp_acc0_vec", seed 98 at 4 ranks): not fxtp's
        cfg = dataclasses.replace(cfg, compile="aot_eager")
    kind = _pick(rng, {"megatron": 4, "sp": 3, "random": 2, "mutated": 2})
    plan, root, redrawn = _draw_plan(rng, cfg, kind)
    kind = "mutated" if redrawn else kind  # one layer planned otherwise: no longer users'
    return dataclasses.replace(cfg, plan_kind=kind, plan=plan, root_input=root,
                               steps=1 if cfg.low_precision else 3)


def _attn_in(cfg: Config) -> list[str]:
    return {"separate": ["q", "k", "v"], "fused_kv": ["q", "kv"]}.get(cfg.qkv, ["qkv"])


def _mlp_in(cfg: Config) -> list[str]:
    return {"plain": ["up"], "swiglu": ["gate", "up"], "fused_swiglu": ["w13"]}[cfg.mlp]


def _norms(cfg: Config) -> list[str]:
    return ["norm1"] if cfg.block == "parallel" else ["norm1", "norm2"]


def module_names(cfg: Config) -> set[str]:
    """Every module FQN of the rendered model (the root is ``""``)."""
    names = {"", "layers", "head"}
    names |= {"embed"} if cfg.inputs == "tokens" else {"inp"} if cfg.inputs == "features_proj" \
        else set()
    names |= {"drop"} if cfg.embed_dropout else set()
    names |= {"norm"} if cfg.final_norm else set()
    for i in range(cfg.layers):
        p = f"layers.{i}"
        names |= {p, f"{p}.attn", f"{p}.mlp", f"{p}.attn.o", f"{p}.mlp.down"}
        names |= {f"{p}.{n}" for n in _norms(cfg)}
        names |= {f"{p}.attn.{n}" for n in _attn_in(cfg)}
        names |= {f"{p}.mlp.{n}" for n in _mlp_in(cfg)}
        names |= {f"{p}.attn.drop"} if cfg.attn_dropout else set()
        names |= {f"{p}.mlp.norm"} if cfg.mlp_norm else set()
        names |= {f"{p}.mlp.drop"} if cfg.mlp_dropout else set()
    return names


def _attn_args(cfg: Config, placement: str) -> str:
    """A PrepareModuleInput layout tuple for the attention's arguments (x[, cos, sin])."""
    if cfg.rope == "none":
        return f"({placement},)"
    return f"({placement}, None, None)"


COLWISE, ROWWISE = "fxtp.ColwiseParallel()", "fxtp.RowwiseParallel()"
SP = "fxtp.SequenceParallel()"
POOLS = {
    "in_linear": ["fxtp.ColwiseParallel()", "fxtp.ColwiseParallel(output_layouts=Replicate())",
                  "fxtp.RowwiseParallel(input_layouts=Replicate())", None],
    "out_linear": ["fxtp.RowwiseParallel()", "fxtp.RowwiseParallel(input_layouts=Replicate())",
                   "fxtp.RowwiseParallel(output_layouts=Shard(1))",
                   "fxtp.ColwiseParallel(output_layouts=Replicate())", None],
    "norm": [SP, None],
    "embed": ["fxtp.RowwiseParallel(input_layouts=Replicate())",
              "fxtp.RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1))",
              "fxtp.ColwiseParallel(input_layouts=Replicate())",
              "fxtp.ColwiseParallel(input_layouts=Replicate(), output_layouts=Replicate())", None],
    "head": ["fxtp.ColwiseParallel()", "fxtp.ColwiseParallel(output_layouts=Replicate())",
             "fxtp.ColwiseParallel(use_local_output=False)",
             "fxtp.RowwiseParallel(input_layouts=Replicate())", None],
}


def _container(cfg: Config, which: str, rng: random.Random) -> str | None:
    src = rng.choice(["Replicate()", "Shard(1)", None])
    if src is None:
        return None
    args = _attn_args(cfg, "{}") if which == "attn" else "({},)"
    return (f"fxtp.PrepareModuleInput(input_layouts={args.format(src)}, "
            f"desired_input_layouts={args.format('Replicate()')})")


def _head_style(cfg: Config, rng: random.Random, sequence_sharded: bool) -> str:
    inp = "input_layouts=Shard(1), " if sequence_sharded else ""
    if cfg.output == "loss" and rng.random() < 0.6:  # loss parallel (torchtitan)
        return f"fxtp.ColwiseParallel({inp}use_local_output=False)"
    if cfg.output == "logits" and rng.random() < 0.4:  # the logits returned class-sharded
        return f"fxtp.ColwiseParallel({inp})".replace(", )", ")")
    return f"fxtp.ColwiseParallel({inp}output_layouts=Replicate())"


def _draw_plan(rng: random.Random, cfg: Config, kind: str) -> tuple[tuple, str, bool]:
    """A plan as users write them: Megatron's (colwise q/k/v/up, rowwise o/down, the
    embedding vocab-parallel, the head colwise, maybe loss parallel), torchtitan's sequence
    parallel one, a random choice of legal styles per module, or Megatron's / torchtitan's
    with one to three entries redrawn. Returns the plan's entries, the root input's layout,
    and whether one layer's entries were then redrawn (no longer a plan users write)."""
    lay = "layers.*"
    plan: dict[str, str | None] = {}
    base = "sp" if kind == "sp" or (kind == "mutated" and rng.random() < 0.5) else "megatron"
    attn_in, mlp_in = _attn_in(cfg), _mlp_in(cfg)
    if kind != "random":
        sp = base == "sp"
        if cfg.inputs == "tokens":
            plan["embed"] = ("fxtp.RowwiseParallel(input_layouts=Replicate(), "
                             "output_layouts=Shard(1))" if sp else
                             "fxtp.RowwiseParallel(input_layouts=Replicate())"
                             if rng.random() < 0.7 else None)
        if sp and cfg.embed_dropout:
            plan["drop"] = SP
        if len(attn_in) == 3 and rng.random() < 0.4:
            plan[f"{lay}.attn.[qkv]"] = COLWISE
        else:
            plan.update({f"{lay}.attn.{n}": COLWISE for n in attn_in})
        plan[f"{lay}.attn.o"] = "fxtp.RowwiseParallel(output_layouts=Shard(1))" if sp else ROWWISE
        plan.update({f"{lay}.mlp.{n}": COLWISE for n in mlp_in})
        plan[f"{lay}.mlp.down"] = "fxtp.RowwiseParallel(output_layouts=Shard(1))" if sp \
            else ROWWISE
        if sp:
            plan.update({f"{lay}.{n}": SP for n in _norms(cfg)})
            if cfg.final_norm:
                plan["norm"] = SP
            plan[f"{lay}.attn"] = (f"fxtp.PrepareModuleInput(input_layouts="
                                   f"{_attn_args(cfg, 'Shard(1)')}, desired_input_layouts="
                                   f"{_attn_args(cfg, 'Replicate()')})")
            plan[f"{lay}.mlp"] = ("fxtp.PrepareModuleInput(input_layouts=(Shard(1),), "
                                  "desired_input_layouts=(Replicate(),))")
        plan["head"] = _head_style(cfg, rng, sp and cfg.final_norm)
    if kind in ("random", "mutated"):
        slots = {f"{lay}.attn.{n}": "in_linear" for n in attn_in}
        slots.update({f"{lay}.mlp.{n}": "in_linear" for n in mlp_in})
        slots.update({f"{lay}.attn.o": "out_linear", f"{lay}.mlp.down": "out_linear",
                      "head": "head"})
        slots.update({f"{lay}.{n}": "norm" for n in _norms(cfg)})
        slots.update({"norm": "norm"} if cfg.final_norm else {})
        slots.update({f"{lay}.mlp.norm": "norm"} if cfg.mlp_norm else {})
        slots.update({"embed": "embed"} if cfg.inputs == "tokens" else {})
        slots.update({f"{lay}.attn": "attn", f"{lay}.mlp": "mlp"})
        names = list(slots) if kind == "random" else rng.sample(list(slots), rng.randint(1, 3))
        for name in names:
            pool = slots[name]
            if pool in ("attn", "mlp"):
                plan[name] = _container(cfg, pool, rng)
            else:
                plan[name] = rng.choice(POOLS[pool])
            if name.endswith(".attn.q") or name.endswith(".attn.k") or name.endswith(".attn.v"):
                plan.pop(f"{lay}.attn.[qkv]", None)
        if f"{lay}.attn.[qkv]" in plan and any(f"{lay}.attn.{n}" in plan for n in "qkv"):
            del plan[f"{lay}.attn.[qkv]"]
    redrawn = cfg.layers > 1 and rng.random() < 0.15
    if redrawn:  # one layer planned on its own
        i = rng.randrange(cfg.layers)
        for name in [n for n in plan if n.startswith(lay + ".")]:
            style = plan.pop(name)
            for j in range(cfg.layers):
                plan[name.replace("*", str(j))] = style if j != i else (
                    rng.choice(POOLS["in_linear"]) if style and "Colwise" in style else None)
    root = ""
    if cfg.inputs != "tokens" and base == "sp" and kind != "random" and rng.random() < 0.5:
        root = "Shard(1)" if rng.random() < 0.5 and cfg.seq % cfg.world == 0 else "Replicate()"
    return tuple((k, v) for k, v in plan.items() if v is not None), root, redrawn


# --- rendering a case as code ----------------------------------------------------------------

def _indent(lines: list[str], n: int) -> str:
    return "".join(" " * n + line + "\n" if line else "\n" for line in lines)


def _norm_ctor(cfg: Config, size: str) -> str:
    return {"layernorm": f"nn.LayerNorm({size})",
            "layernorm_nobias": f"nn.LayerNorm({size}, bias=False)",
            "rmsnorm": f"nn.RMSNorm({size}, eps=1e-6)",
            "rmsnorm_hand": f"RMSNorm({size})"}[cfg.norm]


def _act(cfg: Config, t: str) -> str:
    return {"gelu": f"F.gelu({t})", "gelu_tanh": f'F.gelu({t}, approximate="tanh")',
            "relu": f"torch.relu({t})", "silu": f"F.silu({t})"}[cfg.act]


def _to_heads(cfg: Config, t: str, n: str) -> str:
    return {"view": f"{t}.view(b, s, {n}, HD)", "view_neg_head_dim": f"{t}.view(b, s, {n}, -1)",
            "view_neg_heads": f"{t}.view(b, s, -1, HD)",
            "unflatten": f"{t}.unflatten(-1, ({n}, HD))",
            "reshape": f"{t}.reshape(B, S, {n}, HD)"}[cfg.heads_view]


def _attention(cfg: Config) -> str:
    init = []
    qb, ob = cfg.qkv_bias, cfg.o_bias
    if cfg.qkv == "separate":
        init += [f"self.q = nn.Linear(D, H * HD, bias={qb})",
                 f"self.k = nn.Linear(D, KV * HD, bias={qb})",
                 f"self.v = nn.Linear(D, KV * HD, bias={qb})"]
    elif cfg.qkv == "fused_kv":
        init += [f"self.q = nn.Linear(D, H * HD, bias={qb})",
                 f"self.kv = nn.Linear(D, 2 * KV * HD, bias={qb})"]
    else:
        init += [f"self.qkv = nn.Linear(D, (H + 2 * KV) * HD, bias={qb})"]
    init.append(f"self.o = nn.Linear(H * HD, D, bias={ob})")
    if cfg.core == "manual" and cfg.causal:
        init.append('self.register_buffer("mask", torch.ones(S, S, dtype=torch.bool).triu(1), '
                    'persistent=False)')
    if cfg.attn_dropout:
        init.append("self.drop = nn.Dropout(0.1)")
    rope_args = ", cos, sin" if cfg.rope != "none" else ""
    fwd = ["b, s, _ = x.shape"]
    in_heads = False  # q, k, v already (b, h, s, d)
    if cfg.qkv == "separate":
        fwd.append("q, k, v = self.q(x), self.k(x), self.v(x)")
    elif cfg.qkv == "fused_kv":
        fwd.append("q = self.q(x)")
        fwd.append("k, v = self.kv(x).chunk(2, dim=-1)")
    elif cfg.qkv == "fused_split":
        fwd.append("q, k, v = self.qkv(x).split([H * HD, KV * HD, KV * HD], dim=-1)")
    elif cfg.qkv == "fused_chunk":
        fwd.append("q, k, v = self.qkv(x).chunk(3, dim=-1)")
    elif cfg.qkv == "fused_unbind":
        fwd.append("q, k, v = self.qkv(x).view(b, s, 3, H, HD).unbind(2)")
    else:  # timm's ViT
        fwd.append("q, k, v = self.qkv(x).reshape(b, s, 3, H, HD).permute(2, 0, 3, 1, 4)"
                   ".unbind(0)")
        in_heads = True
    if not in_heads:
        if cfg.qkv != "fused_unbind":
            fwd.append(f"q = {_to_heads(cfg, 'q', 'H')}")
            fwd.append(f"k = {_to_heads(cfg, 'k', 'KV')}")
            fwd.append(f"v = {_to_heads(cfg, 'v', 'KV')}")
        if cfg.rope != "none" and cfg.rope_layout == "before_transpose":
            fwd.append("cos, sin = cos[:s, None], sin[:s, None]")
            fwd.append("q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)")
        fwd.append("q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)")
    if cfg.rope != "none" and (in_heads or cfg.rope_layout == "after_transpose"):
        fwd.append("q, k = apply_rope(q, cos[:s], sin[:s]), apply_rope(k, cos[:s], sin[:s])")
    gqa = cfg.kv_heads != cfg.heads
    repeat = cfg.gqa_repeat if cfg.core == "sdpa" or cfg.gqa_repeat != "enable_gqa" \
        else "repeat_interleave"
    if gqa and repeat != "enable_gqa":
        for t in "kv":
            fwd.append({
                "repeat_interleave": f"{t} = {t}.repeat_interleave(H // KV, dim=1)",
                "expand": f"{t} = {t}[:, :, None].expand(b, KV, H // KV, s, HD)"
                          f".reshape(b, H, s, HD)",
                "repeat": f"{t} = {t}.repeat(1, H // KV, 1, 1)"}[repeat])
    if cfg.core == "sdpa":
        extra = ", enable_gqa=True" if gqa and repeat == "enable_gqa" else ""
        fwd.append(f"out = F.scaled_dot_product_attention(q, k, v, is_causal={cfg.causal}"
                   f"{extra})")
    else:
        fwd.append("scores = (q @ k.transpose(-2, -1)) * HD ** -0.5")
        if cfg.causal:
            fwd.append("scores.masked_fill_(self.mask[:s, :s], float('-inf'))"
                       if cfg.mask_inplace else
                       "scores = scores.masked_fill(self.mask[:s, :s], float('-inf'))")
        fwd.append("probs = F.softmax(scores.float(), dim=-1).to(q.dtype)" if cfg.softmax_fp32
                   else "probs = scores.softmax(dim=-1)")
        if cfg.attn_dropout:
            fwd.append("probs = self.drop(probs)")
        fwd.append("out = probs @ v")
    fwd.append({"reshape": "out = out.transpose(1, 2).reshape(b, s, H * HD)",
                "contiguous_view": "out = out.transpose(1, 2).contiguous().view(b, s, -1)",
                "flatten": "out = out.transpose(1, 2).flatten(2)"}[cfg.merge_heads])
    fwd.append("return self.o(out)")
    return ("class Attention(nn.Module):\n    def __init__(self):\n        super().__init__()\n"
            + _indent(init, 8) + f"\n    def forward(self, x{rope_args}):\n" + _indent(fwd, 8))


def _mlp(cfg: Config) -> str:
    b = cfg.mlp_bias
    init = {"plain": [f"self.up = nn.Linear(D, HIDDEN, bias={b})"],
            "swiglu": [f"self.gate = nn.Linear(D, HIDDEN, bias={b})",
                       f"self.up = nn.Linear(D, HIDDEN, bias={b})"],
            "fused_swiglu": [f"self.w13 = nn.Linear(D, 2 * HIDDEN, bias={b})"]}[cfg.mlp]
    if cfg.mlp_norm:
        init.append(f"self.norm = {_norm_ctor(cfg, 'HIDDEN')}")
    init.append(f"self.down = nn.Linear(HIDDEN, D, bias={b})")
    if cfg.mlp_dropout:
        init.append("self.drop = nn.Dropout(0.1)")
    fwd = []
    region = cfg.autocast == "mlp"
    up = {"plain": "self.up(x)", "swiglu": "self.up(x)", "fused_swiglu": None}[cfg.mlp]
    if cfg.mlp == "fused_swiglu":
        fwd.append("g, u = self.w13(x).chunk(2, dim=-1)")
    else:
        fwd.append(f"u = {up}")
    if cfg.mlp_scale_inplace and cfg.mlp != "fused_swiglu":  # not a view of a chunk
        fwd.append("u.mul_(0.5)")
    if cfg.mlp == "plain":
        fwd.append(f"h = {_act(cfg, 'u')}")
    elif cfg.mlp == "swiglu":
        fwd.append(f"h = {_act(cfg, 'self.gate(x)')} * u")
    else:
        fwd.append(f"h = {_act(cfg, 'g')} * u")
    if cfg.mlp_scale_inplace and cfg.mlp == "fused_swiglu":
        fwd.append("h.mul_(0.5)")
    if cfg.mlp_norm:
        fwd.append("h = self.norm(h)")
    fwd.append("out = self.down(h)")
    if cfg.mlp_dropout:
        fwd.append("out = self.drop(out)")
    if region:
        fwd = [f"with {AC}:"] + ["    " + line for line in fwd] + ["return out.to(x.dtype)"]
    else:
        fwd.append("return out")
    return ("class MLP(nn.Module):\n    def __init__(self):\n        super().__init__()\n"
            + _indent(init, 8) + "\n    def forward(self, x):\n" + _indent(fwd, 8))


def _block(cfg: Config) -> str:
    init = [f"self.norm1 = {_norm_ctor(cfg, 'D')}", "self.attn = Attention()"]
    if cfg.block != "parallel":
        init.append(f"self.norm2 = {_norm_ctor(cfg, 'D')}")
    init.append("self.mlp = MLP()")
    args = ", cos, sin" if cfg.rope != "none" else ""

    def attn(x):
        return f"self.attn({x}{args})"

    def mlp(x):
        return f"checkpoint(self.mlp, {x}, use_reentrant=False)" if cfg.checkpoint == "mlp" \
            else f"self.mlp({x})"
    fwd = []
    if cfg.block == "parallel":
        fwd.append("n = self.norm1(x)")
        src = "n"
    elif cfg.block == "pre":
        src = "self.norm1(x)"
    else:
        src = "x"
    if cfg.autocast == "attn":
        fwd += [f"with {AC}:", f"    a = {attn(src)}", "a = a.to(x.dtype)"]
    else:
        fwd.append(f"a = {attn(src)}")
    if cfg.bf16_roundtrip:
        fwd.append("a = a.to(torch.bfloat16).to(x.dtype)")
    if cfg.block == "parallel":
        fwd.append(f"return x + a + {mlp('n')}")
    elif cfg.block == "pre":
        fwd += ["a.add_(x)", "h = a"] if cfg.inplace_residual else ["h = x + a"]
        fwd.append(f"return h + {mlp('self.norm2(h)')}")
    else:
        fwd.append("h = self.norm1(x + a)")
        fwd.append(f"return self.norm2(h + {mlp('h')})")
    return ("class Block(nn.Module):\n    def __init__(self):\n        super().__init__()\n"
            + _indent(init, 8) + f"\n    def forward(self, x{args}):\n" + _indent(fwd, 8))


def _model(cfg: Config) -> str:
    init = []
    if cfg.inputs == "tokens":
        init.append("self.embed = nn.Embedding(V, D)")
    elif cfg.inputs == "features_proj":
        init.append("self.inp = nn.Linear(D, D)")
    if cfg.embed_dropout:
        init.append("self.drop = nn.Dropout(0.1)")
    if cfg.rope != "none":
        init += ["cos, sin = rope_tables()",
                 'self.register_buffer("cos", cos, persistent=False)',
                 'self.register_buffer("sin", sin, persistent=False)']
    init.append("self.layers = nn.ModuleList(Block() for _ in range(L))")
    if cfg.final_norm:
        init.append(f"self.norm = {_norm_ctor(cfg, 'D')}")
    init.append(f"self.head = nn.Linear(D, V, bias={cfg.head_bias})")
    first = "tokens" if cfg.inputs == "tokens" else "x"
    sig = first + (", targets" if cfg.output == "loss" else "")
    fwd = [{"tokens": "h = self.embed(tokens)", "features": "h = x",
            "features_proj": "h = self.inp(x)"}[cfg.inputs]]
    if cfg.embed_dropout:
        fwd.append("h = self.drop(h)")
    args = ", self.cos, self.sin" if cfg.rope != "none" else ""
    call = f"checkpoint(layer, h{args}, use_reentrant=False)" if cfg.checkpoint == "layers" \
        else f"layer(h{args})"
    loop = ["for layer in self.layers:", f"    h = {call}"]
    if cfg.autocast == "layers":
        fwd += [f"with {AC}:"] + ["    " + line for line in loop]
        fwd.append("h = h.to(self.head.weight.dtype)")
    else:
        fwd += loop
    if cfg.final_norm:
        fwd.append("h = self.norm(h)")
    tail = ["logits = self.head(h)"]
    logits = "logits.float()" if cfg.loss_float else "logits"
    if cfg.output == "loss":
        opts = {"": "", "ignore": "", "smoothing": ", label_smoothing=0.1"}[cfg.loss_options]
        tail.append(f"return F.cross_entropy({logits}.flatten(0, 1), targets.flatten(){opts})")
    else:
        tail.append("return " + {"logits": logits, "sum": f"{logits}.sum(dim=1)",
                                 "mean": f"{logits}.mean(dim=-1)",
                                 "amax": f"{logits}.amax(dim=-1)"}[cfg.output])
    if cfg.autocast == "head":
        fwd += [f"with {AC}:"] + ["    " + line for line in tail]
    else:
        fwd += tail
    return ("class Model(nn.Module):\n    def __init__(self):\n        super().__init__()\n"
            + _indent(init, 8) + f"\n    def forward(self, {sig}):\n" + _indent(fwd, 8))


RMSNORM_SRC = '''class RMSNorm(nn.Module):
    def __init__(self, dim, eps=1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.type_as(x)
'''

ROPE_SRC = {"half": '''def rope_tables():
    inv = 1.0 / 10000 ** (torch.arange(0, HD, 2).float() / HD)
    freqs = torch.outer(torch.arange(S).float(), inv)
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos(), emb.sin()


def apply_rope(x, cos, sin):
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin
''', "interleaved": '''def rope_tables():
    inv = 1.0 / 10000 ** (torch.arange(0, HD, 2).float() / HD)
    freqs = torch.outer(torch.arange(S).float(), inv)
    return freqs.cos(), freqs.sin()


def apply_rope(x, cos, sin):
    x1, x2 = x.unflatten(-1, (-1, 2)).unbind(-1)
    return torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1).flatten(-2)
'''}


def render(cfg: Config) -> str:
    """The case as the source of a module: ``Model``, ``PLAN``, ``DTYPE``, ``inputs()``,
    ``INPUT_PLACEMENTS`` (what each rank passes: ``None`` whole, ``Shard(1)`` its part)."""
    names = module_names(cfg)
    plan_lines = [f"    {k!r}: {v}," for k, v in cfg.plan
                  if any(_matches(k, n) for n in names)]
    first_placement = "None"
    if cfg.root_input:
        passed = f"({cfg.root_input}, None)" if cfg.output == "loss" else cfg.root_input
        desired = "(Shard(1), None)" if cfg.output == "loss" else "Shard(1)"
        plan_lines.insert(0, f"    '': fxtp.PrepareModuleInput(input_layouts={passed}, "
                             f"desired_input_layouts={desired}),")
        first_placement = "Shard(1)" if cfg.root_input == "Shard(1)" else "None"
    parts = [f"# fxtp fuzz case seed={cfg.seed} world={cfg.world}: "
             f"python -m tests.helpers.fuzz show {cfg.seed} --world {cfg.world}",
             "import torch\nimport torch.nn as nn\nimport torch.nn.functional as F\n"
             "from torch.utils.checkpoint import checkpoint\n\nimport fxtp\n"
             "from fxtp import Replicate, Shard\n",
             f"B, S, D, H, KV, HD = {cfg.batch}, {cfg.seq}, {cfg.dim}, {cfg.heads}, "
             f"{cfg.kv_heads}, {cfg.head_dim}\n"
             f"HIDDEN, V, L = {cfg.hidden}, {cfg.vocab}, {cfg.layers}\n"
             f"DTYPE = torch.{cfg.dtype}\n"]
    if cfg.norm == "rmsnorm_hand":
        parts.append(RMSNORM_SRC)
    if cfg.rope != "none":
        parts.append(ROPE_SRC[cfg.rope])
    parts += [_attention(cfg), _mlp(cfg), _block(cfg), _model(cfg)]
    parts.append("PLAN = {\n" + "\n".join(plan_lines) + ("\n" if plan_lines else "") + "}\n")
    gen = ["g = torch.Generator().manual_seed(0)"]
    if cfg.inputs == "tokens":
        gen.append("first = torch.randint(0, V, (B, S), generator=g)")
    else:
        gen.append("first = torch.randn(B, S, D, generator=g)")
    if cfg.output == "loss":
        gen.append("targets = torch.randint(0, V, (B, S), generator=g)")
        if cfg.loss_options == "ignore":
            gen.append("targets[:, ::3] = -100")
        gen.append("return [first, targets]")
    else:
        gen.append("return [first]")
    parts.append("def inputs():\n" + _indent(gen, 4))
    extra = ", None" if cfg.output == "loss" else ""
    parts.append(f"INPUT_PLACEMENTS = [{first_placement}{extra}]\n")
    return "\n\n".join(p.rstrip("\n") + "\n" for p in parts)


def _matches(pattern: str, name: str) -> bool:
    import fnmatch
    return fnmatch.fnmatchcase(name, pattern)


def load(cfg: Config) -> dict:
    """Execute the rendered source; tracebacks show its lines (it is in ``linecache``)."""
    source = render(cfg)
    filename = f"<fxtp-fuzz seed={cfg.seed} world={cfg.world}>"
    linecache.cache[filename] = (len(source), None, source.splitlines(True), filename)
    ns = {"__name__": f"fxtp_fuzz_{cfg.seed}_{cfg.world}"}
    exec(compile(source, filename, "exec"), ns)  # noqa: S102 - the generator's own code
    return ns


def case(seed: int, world: int, overrides: dict | None = None) -> Config:
    cfg = draw(seed, world)
    if overrides:
        cfg = dataclasses.replace(cfg, **{k: tuple(tuple(p) for p in v) if k == "plan" else v
                                          for k, v in overrides.items()})
    return cfg


# --- the check ---------------------------------------------------------------------------------

class Mismatch(Exception):
    """fxtp's result differs from the single-device model's."""

    def __init__(self, where: str, got: torch.Tensor, expected: torch.Tensor, message: str):
        self.detail = {"where": where, "got_dtype": str(got.dtype).removeprefix("torch."),
                       "expected_dtype": str(expected.dtype).removeprefix("torch."),
                       "got_shape": list(got.shape), "expected_shape": list(expected.shape)}
        kind = "shape" if got.shape != expected.shape else "dtype" \
            if got.dtype != expected.dtype else "value"
        if kind == "value":
            diff = (got.double() - expected.double()).abs()
            self.detail["max_abs_diff"] = float(diff.max()) if diff.numel() else 0.0
            self.detail["max_abs_expected"] = float(expected.double().abs().max()) \
                if expected.numel() else 0.0
        self.kind = kind
        super().__init__(f"{kind} mismatch at {where}: {message.splitlines()[0][:300]}")


def _compare(where, got, expected, noise=None, **tol):
    """``noise``: where the single-device program computes in bf16, the same value from
    its fp64 twin (no autocast, no bf16 rounding); the allowed error grows by twice the
    single-device program's own distance from it, so rounding that flips a ReLU or a
    max in both programs is not a mismatch, while a wrong result (off by whole terms,
    or of another dtype) still is."""
    if noise is not None and got.shape == expected.shape and noise.shape == expected.shape:
        own = (expected.double() - noise.double()).abs().max().item() if noise.numel() else 0
        tol = dict(tol, atol=tol["atol"] + 2 * own)
    try:
        torch.testing.assert_close(got, expected, **tol)
    except AssertionError as e:
        raise Mismatch(where, got, expected, str(e)) from None


def _state():
    return (torch.is_autocast_enabled("cpu"), str(torch.get_autocast_dtype("cpu")),
            torch.is_grad_enabled(), str(torch.get_default_dtype()))


def _reset_state():
    torch.set_autocast_enabled("cpu", False)
    torch.set_autocast_dtype("cpu", torch.bfloat16)
    torch.clear_autocast_cache()
    torch.set_grad_enabled(True)
    torch.set_default_dtype(torch.float32)


def _part(full, placement, rank, world):
    from tests.helpers.parity import local_part
    return None if full is None else local_part(full.detach(), placement, rank, world)


def differential(rank: int, world: int, cfg: Config, group, report: dict) -> None:
    """Train the case's model through fxtp and on one device side by side: outputs (values
    and dtype), every parameter and input gradient (values and dtype), and the parameters
    after ``cfg.steps`` AdamW steps. Raises :class:`Mismatch` on a difference; ``report``
    collects the phase reached and fxtp's fallbacks."""
    from tests.helpers.parity import (LR, local_of, local_part, noise_floor, step_like_reference,
                                      tolerance)
    import fxtp
    report["phase"] = "generate"
    ns = load(cfg)
    dtype, tol_dtype = DTYPES[cfg.dtype], cfg.compare_dtype
    torch.manual_seed(0)
    model = ns["Model"]().to(dtype)
    ref = copy.deepcopy(model)
    xs = [x.to(dtype) if x.is_floating_point() else x for x in ns["inputs"]()]
    placements = ns["INPUT_PLACEMENTS"]
    report["phase"] = "reference"
    torch.manual_seed(999)
    copy.deepcopy(ref)(*xs).float().sum().backward()  # the single-device program runs
    # the fp64 twin of a bf16 computation (not with dropout: fp64 draws other masks)
    twin = copy.deepcopy(ref).double() if tol_dtype == torch.bfloat16 and not (
        cfg.embed_dropout or cfg.attn_dropout or cfg.mlp_dropout) else None
    report["phase"] = "parallelize"
    gm = fxtp.parallelize(model, ns["PLAN"], group, example_inputs=xs)
    report["fallbacks"] = [str(f) for f in gm.fxtp.fallbacks]
    run = gm
    if cfg.compile != "none":
        report["phase"] = "compile"
        run = torch.compile(gm, backend=cfg.compile, fullgraph=True)
    params = dict(gm.named_parameters())
    report["phase"] = "run"
    if set(params) != {n for n, _ in ref.named_parameters()}:
        raise AssertionError(f"parameter names differ: {sorted(params)}")
    opt = torch.optim.AdamW(gm.parameters(), lr=LR)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=LR)
    out_placement = gm.fxtp.output_placements[0]
    for step in range(cfg.steps):
        report["phase"] = f"step {step} forward"
        full = [x.clone().requires_grad_(x.is_floating_point()) for x in xs]
        local = [local_part(x.detach(), p, rank, world).clone()
                 .requires_grad_(x.is_floating_point()) for x, p in zip(full, placements)]
        torch.manual_seed(1000 + step)
        out = local_of(run(*local))
        torch.manual_seed(1000 + step)
        ref_out = ref(*full)
        expected = local_part(ref_out, out_placement, rank, world)
        twin_out = None
        if twin is not None and step == 0:
            twin_full = [x.detach().double().requires_grad_() if x.is_floating_point() else x
                         for x in full]
            twin_out = twin(*twin_full)
        _compare(f"step {step} output", out, expected,
                 _part(twin_out, out_placement, rank, world),
                 **tolerance(tol_dtype, expected, step))
        report["phase"] = f"step {step} backward"
        weight = torch.randn(ref_out.shape, generator=torch.Generator().manual_seed(step),
                             dtype=ref_out.dtype)
        (ref_out * weight).sum().backward()
        if twin_out is not None:
            (twin_out * weight.double()).sum().backward()
        (out * local_part(weight, out_placement, rank, world)).sum().backward()
        floor = noise_floor([q.grad for q in ref.parameters()], tol_dtype)
        for name, p in params.items():
            ref_p = ref.get_parameter(name)
            if ref_p.grad is None:
                if p.grad is not None:
                    raise Mismatch(f"step {step} grad of {name}", local_of(p.grad), ref_p,
                                   "fxtp has a gradient, single device none")
                continue
            if p.grad is None:
                raise Mismatch(f"step {step} grad of {name}", ref_p.detach(), ref_p.grad,
                               "fxtp has no gradient")
            ref_grad = local_part(ref_p.grad, gm.fxtp.param_placements[name], rank, world)
            twin_grad = twin.get_parameter(name).grad if twin_out is not None else None
            _compare(f"step {step} grad of {name}", local_of(p.grad), ref_grad,
                     _part(twin_grad, gm.fxtp.param_placements[name], rank, world),
                     **tolerance(tol_dtype, ref_grad, step))
            step_like_reference(local_of(p.grad), ref_grad, floor)
        for i, (x, lx, pl) in enumerate(zip(full, local, placements)):
            if x.grad is not None:
                _compare(f"step {step} grad of input {i}", lx.grad,
                         local_part(x.grad, pl, rank, world), **tolerance(tol_dtype, x.grad, step))
        report["phase"] = f"step {step} optimizer"
        opt.step()
        ref_opt.step()
        opt.zero_grad()
        ref_opt.zero_grad()
    report["phase"] = "after steps"
    for name, p in params.items():
        expected = local_part(ref.get_parameter(name).detach(), gm.fxtp.param_placements[name],
                              rank, world)
        _compare(f"{name} after {cfg.steps} AdamW steps", local_of(p.detach()), expected,
                 **tolerance(tol_dtype, steps=cfg.steps))
    report["phase"] = "done"


# --- verdicts ----------------------------------------------------------------------------------

_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_OURS = tuple(os.path.join(_ROOT, folder) + os.sep for folder in ("fxtp", "passes"))


def _frames(tb) -> list[traceback.FrameSummary]:
    return traceback.extract_tb(tb)


def _where(frames) -> str:
    """The innermost frame inside fxtp (``passes/rewrite.py:123 in fn``), else the
    innermost frame of all."""
    for f in reversed(frames):
        if f.filename.startswith(_OURS):
            return f"{os.path.relpath(f.filename, _ROOT)}:{f.lineno} in {f.name}"
    f = frames[-1] if frames else None
    return f"{os.path.basename(f.filename)}:{f.lineno} in {f.name}" if f else "?"


def _normalized(message: str) -> str:
    line = (message.strip().splitlines() or [""])[0]
    line = re.sub(r"'[^']*'", "'_'", line)
    line = re.sub(r"\[[^\]]*\]+", "[..]", line)  # tensor types and shapes
    return re.sub(r"\d+", "N", line)[:120]


def _timed_out(e: BaseException) -> bool:
    text = str(e).lower()
    return isinstance(e, RuntimeError) and ("timed out" in text or "timeout" in text) and \
        ("gloo" in text or "connection" in text or "wait" in text)


def verdict_of(e: BaseException, report: dict) -> dict:
    """A rank's verdict from the exception that ended its case."""
    import fxtp
    frames = _frames(e.__traceback__)
    phase = report.get("phase", "?")
    tb = "".join(traceback.format_exception(type(e), e, e.__traceback__))
    tail = "\n".join(tb.splitlines()[-40:])
    if isinstance(e, Mismatch):
        return {"status": "mismatch", "kind": e.kind, "detail": e.detail, "message": str(e),
                "bucket": f"mismatch-{e.kind}: {_normalized(e.detail['where'])}"
                          f" {e.detail['got_dtype']} vs {e.detail['expected_dtype']}",
                "phase": phase}
    if phase in ("generate", "reference"):
        status = "generator"
    elif _timed_out(e):
        status = "timeout"
    elif isinstance(e, fxtp.FxtpError):
        status = "rejected"
    else:
        status = "crash"
    inside = any(f.filename.startswith(_OURS) for f in frames)
    errors = [line.strip() for line in str(e).splitlines() if "error:" in line][:5]
    return {"status": status, "errors": errors, "phase": phase, "exception": type(e).__name__,
            "message": str(e)[:2000], "where": _where(frames), "inside_fxtp": inside,
            "bucket": f"{status}: {type(e).__name__} at {_where(frames).split(':')[0]}"
                      f" in {phase.split(' ')[0]}: {_normalized(str(e))}",
            "traceback": tail}


def run_case(rank: int, world: int, seed: int, overrides: dict | None = None,
             timeout_s: float = GROUP_TIMEOUT_S) -> dict:
    """Run case ``(seed, world)`` on this rank (through ``RankPool.run``) and return its
    verdict; never raises. The case runs on a new process group with a ``timeout_s``
    timeout, destroyed after, so a case whose ranks fell out of step cannot block the next."""
    import torch.distributed as dist
    _reset_state()
    start = time.time()
    report: dict = {"phase": "generate"}
    cfg = case(seed, world, overrides)
    if cfg.compile != "none":  # ranks compile at their own pace before the first collective
        timeout_s = max(timeout_s, 10 * GROUP_TIMEOUT_S)
    group = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=timeout_s))
    try:
        with warnings.catch_warnings():  # fallbacks are recorded in the verdict
            warnings.simplefilter("ignore")
            differential(rank, world, cfg, group, report)
        verdict = {"status": "fallback" if report.get("fallbacks") else "pass",
                   "bucket": "fallback" if report.get("fallbacks") else "pass"}
    except BaseException as e:  # noqa: BLE001 - every failure is a verdict
        verdict = verdict_of(e, report)
    left = _state()
    _reset_state()
    if left != _state():
        verdict["leaked"] = left
    verdict.update(rank=rank, seconds=round(time.time() - start, 2),
                   fallbacks=report.get("fallbacks", []))
    with contextlib.suppress(Exception):
        dist.destroy_process_group(group)
    # DeviceMesh equality ignores the group: DTensor's sharding-propagation cache would
    # hand a later DTensor on the same ranks this destroyed group's mesh
    from torch.distributed.tensor.debug import _clear_sharding_prop_cache
    _clear_sharding_prop_cache()
    return verdict


_RANK_ORDER = {"generator": 0, "crash": 1, "rejected": 2, "mismatch": 3, "timeout": 5,
               "fallback": 6, "pass": 7}


def combine(seed: int, world: int, verdicts: list[dict], overrides: dict | None = None) -> dict:
    """One verdict for the case from every rank's: the most telling failure (a crash over
    the other ranks' timeouts, which makes it a ``hang``), else a leak, else a pass."""
    worst = min(verdicts, key=lambda v: _RANK_ORDER.get(v["status"], 4))
    result = {"seed": seed, "world": world, **worst,
              "seconds": max(v["seconds"] for v in verdicts),
              "ranks": {v["rank"]: v["status"] for v in verdicts}}
    statuses = {v["status"] for v in verdicts}
    if "timeout" in statuses and len(statuses) > 1:
        result["hang"] = True
        result["bucket"] = "hang+" + result["bucket"]
    leaks = [v["leaked"] for v in verdicts if v.get("leaked")]
    if leaks:
        result["leaked"] = leaks[0]
        if worst["status"] in ("pass", "fallback"):
            result.update(status="leak", bucket=f"leak: {leaks[0]}")
        else:
            result["bucket"] += " +leak"
    try:
        result["features"] = case(seed, world, overrides).features()
    except Exception:  # noqa: BLE001
        result["features"] = []
    return result


def run(pool, seed: int, overrides: dict | None = None, timeout: float | None = None) -> dict:
    """Run one case on ``pool`` (a ``tests.helpers.harness.RankPool``); a pool that timed out as a
    whole is restarted by the harness and the case is a ``hang``."""
    if timeout is None:
        timeout = 900.0 if case(seed, pool.world, overrides).compile != "none" else 240.0
    try:
        verdicts = pool.run(run_case, seed, overrides, timeout=timeout)
    except AssertionError as e:  # the harness: a rank died or the whole pool timed out
        return {"seed": seed, "world": pool.world, "status": "hang",
                "bucket": "hang: the pool timed out or a rank died",
                "message": str(e)[-2000:],
                "features": case(seed, pool.world, overrides).features()}
    return combine(seed, pool.world, verdicts, overrides)


FAILING = ("crash", "rejected", "mismatch", "hang", "timeout", "leak", "generator")


# --- shrinking ------------------------------------------------------------------------------

SIMPLER = [("compile", "none"), ("autocast", "none"), ("checkpoint", "none"), ("layers", 1),
           ("rope", "none"), ("bf16_roundtrip", False), ("embed_dropout", False),
           ("mlp_dropout", False), ("attn_dropout", False), ("mlp_norm", False),
           ("mlp_scale_inplace", False), ("inplace_residual", False), ("mlp", "plain"),
           ("qkv", "separate"), ("core", "sdpa"), ("kv_heads", None), ("heads_view", "view"),
           ("merge_heads", "reshape"), ("block", "pre"), ("final_norm", False),
           ("inputs", "features"), ("output", "sum"), ("loss_float", False),
           ("loss_options", ""), ("qkv_bias", False), ("o_bias", False), ("mlp_bias", False),
           ("head_bias", False), ("causal", False), ("softmax_fp32", False),
           ("mask_inplace", False), ("act", "gelu"), ("norm", "rmsnorm"),
           ("root_input", ""), ("dtype", "float64"), ("batch", 1), ("steps", 1)]


def shrink(pool, seed: int, target: str | None = None, log=print,
           overrides: dict | None = None) -> tuple[dict, dict]:
    """Greedily simplify case ``seed`` (one choice at a time, then one plan entry at a
    time) while its verdict stays in the same bucket. Returns (overrides, verdict)."""
    overrides = dict(overrides or {})
    first = run(pool, seed, overrides)
    bucket = target or first["bucket"]
    log(f"shrinking seed {seed} world {pool.world}: {bucket}")
    cfg, last = case(seed, pool.world), first

    def same(trial):
        v = run(pool, seed, trial)
        return v if v["bucket"] == bucket else None
    for name, value in SIMPLER:
        value = cfg.heads if name == "kv_heads" else value
        if getattr(dataclasses.replace(cfg, **overrides), name) == value:
            continue
        trial = {**overrides, name: value}
        v = same(trial)
        if v:
            overrides, last = trial, v
            log(f"  {name}={value!r}: kept")
    plan = list(dataclasses.replace(cfg, **overrides).plan)
    for entry in list(plan):
        trial_plan = [e for e in plan if e != entry]
        v = same({**overrides, "plan": trial_plan})
        if v:
            plan, overrides, last = trial_plan, {**overrides, "plan": trial_plan}, v
            log(f"  plan entry {entry[0]!r} dropped")
    return overrides, last


# --- command line --------------------------------------------------------------------------

def _pool(world: int):
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    sys.path.insert(0, _ROOT)
    from tests.helpers.harness import RankPool
    return RankPool(world)


def summarize(rows: list[dict]) -> str:
    from collections import Counter, defaultdict
    by_world = Counter(r["world"] for r in rows)
    statuses = Counter((r["world"], r["status"]) for r in rows)
    buckets = defaultdict(list)
    for r in rows:
        if r["status"] in FAILING:
            buckets[r["bucket"]].append(r)
    lines = [f"cases: {dict(by_world)}",
             "statuses: " + ", ".join(f"w{w} {s}: {n}" for (w, s), n in sorted(statuses.items()))]
    for b, rs in sorted(buckets.items(), key=lambda kv: -len(kv[1])):
        seeds = ", ".join(f"{r['seed']}@{r['world']}" for r in rs[:12])
        lines.append(f"{len(rs):4d}  {b}\n      seeds: {seeds}")
    gathers = defaultdict(list)
    for r in rows:
        kind = next((f.split("=")[1] for f in r.get("features", ()) if
                     f.startswith("plan_kind=")), "megatron")
        mine = "written by users" if kind in ("megatron", "sp") else "random or mutated"
        beyond = case(r["seed"], r["world"]).beyond_heads() if r.get("fallbacks") else ""
        mine = f"{mine}; {beyond}" if beyond else mine
        for message in dict.fromkeys(_gather_class(m) for m in r.get("fallbacks", ())):
            gathers[(mine, message)].append(r)
    if gathers:
        lines.append("fallbacks by plan (users': defects, unless their heads cannot be dealt; "
                     "random or mutated: often the plan's own redistribution):")
    for (mine, b), rs in sorted(gathers.items(), key=lambda kv: (kv[0][0], -len(kv[1]))):
        seeds = ", ".join(f"{r['seed']}@{r['world']}" for r in rs[:12])
        lines.append(f"{len(rs):4d}  [{mine}] {b}\n      seeds: {seeds}")
    return "\n".join(lines)


def _gather_class(message: str) -> str:
    """A fallback's op, the kind of module it is in and why, without names and sizes."""
    op = message.split(" ", 1)[0]
    module = re.search(r"in module '([^']*)'", message)
    where = re.sub(r"\d+", "N", module.group(1)) if module else "?"
    why = message.rsplit(": ", 1)[-1] if ": " in message else ""
    return f"{op} in {where}: {re.sub(r'[0-9]+', 'N', why)[:70]}"


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m tests.helpers.fuzz", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("show")
    p.add_argument("seed", type=int)
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--overrides", default=None, help="JSON of Config fields")
    p = sub.add_parser("one")
    p.add_argument("seed", type=int)
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--overrides", default=None)
    p = sub.add_parser("run")
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--start", type=int, default=0)
    p.add_argument("--cases", type=int, default=100)
    p.add_argument("--out", default=None, help="append one JSON line per case")
    p.add_argument("--minutes", type=float, default=None, help="stop after this long")
    p.add_argument("--overrides", default=None, help="JSON of Config fields for every case")
    p = sub.add_parser("shrink")
    p.add_argument("seed", type=int)
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--overrides", default=None, help="JSON of Config fields to start from")
    p = sub.add_parser("summary")
    p.add_argument("files", nargs="+")
    a = parser.parse_args(argv)
    if a.cmd == "show":
        cfg = case(a.seed, a.world, json.loads(a.overrides) if a.overrides else None)
        print(render(cfg))
        print("# features:", ", ".join(cfg.features()))
        return
    if a.cmd == "summary":
        rows = [json.loads(line) for f in a.files for line in open(f) if line.strip()]
        print(summarize(rows))
        return
    pool = _pool(a.world)
    try:
        if a.cmd == "one":
            print(json.dumps(run(pool, a.seed, json.loads(a.overrides) if a.overrides
                                 else None), indent=1))
        elif a.cmd == "shrink":
            overrides, v = shrink(pool, a.seed, overrides=json.loads(a.overrides)
                                  if a.overrides else None)
            print(json.dumps({"overrides": overrides, "verdict": v}, indent=1, default=str))
            print(render(case(a.seed, a.world, overrides)))
        else:
            deadline = time.time() + 60 * a.minutes if a.minutes else None
            out = open(a.out, "a") if a.out else None
            for seed in range(a.start, a.start + a.cases):
                if deadline and time.time() > deadline:
                    break
                v = run(pool, seed, json.loads(a.overrides) if a.overrides else None)
                print(f"seed {seed} world {a.world}: {v['status']:9s} {v.get('seconds', '-'):>6}s"
                      f"  {v['bucket'][:150]}", flush=True)
                if out:
                    out.write(json.dumps(v, default=str) + "\n")
                    out.flush()
    finally:
        pool.close()


if __name__ == "__main__":
    main()
