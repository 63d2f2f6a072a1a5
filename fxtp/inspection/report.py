"""The report :func:`fxtp.explain` returns: a readable table, and JSON with this schema.

``report.json`` (``Report.to_json()``; ``Report.from_json(text)`` reads it back and checks
every field's type). Sizes are bytes per rank; shapes are lists whose entries are ints, or
strings for symbolic (dynamic) dims such as ``"s52"``, whose sizes use the hints listed in
``summary.symbolic_dims``::

    {
      "schema_version": 2,
      "summary": {
        "world_size": int,
        "forward":  Totals,                        # Totals: {"counts": {kind: int},
        "backward": Totals,                        #   "bytes": {kind: int}}; kind:
                                                   #   "all_reduce", "all_gather",
                                                   #   "reduce_scatter"
        "bytes_per_step": int,                     # forward + backward, all kinds
        "param_bytes": int,                        # this rank's parameters (tied ones once)
        "param_bytes_unsharded": int,              # the single-device model's
        "layers": [{"layer": str, "forward": Totals, "backward": Totals,
                    "param_bytes": int, "param_bytes_unsharded": int}],
        "fallbacks": [{"node": str, "op": str, "module": str, "message": str}],
        "held_whole": [{"param": str,              # a parameter the plan shards that
                        "extra_bytes": int,        #   every rank holds whole: the bytes
                        "message": str}],          #   over its shard, and why
        "symbolic_dims": {expr: int}               # size hint used for each symbolic dim
      },
      "nodes": [{
        "name": str, "op": str,                    # op: "placeholder", "get_attr", "output",
                                                   # or the function ("aten.mm.default",
                                                   # "fxtp.all_gather")
        "module": str,                             # innermost module FQN, "" for the root
        "dtype": str | null,
        "global_shape": [int | str] | null,        # null: not one tensor (multi-output
        "local_shape": [int | str] | null,         #   nodes: see their getitem nodes)
        "placement": str,                          # "R", "P", "S(1)", "S(0)/3" (strided
                                                   #   in 3 blocks), "(S(1), R)", "-"
        "collective": str | null,                  # what fxtp inserted: "all_reduce",
                                                   # "reduce_scatter", "all_gather", "shard",
                                                   # "grad_sync", "grad_sync_bucket",
                                                   # "loss_parallel", "sharded_norm",
                                                   # "sharded_softmax"
                                                   #   (their local ops')
        "forward":  [{"kind": str, "bytes": int}], # the collectives it issues
        "backward": [{"kind": str, "bytes": int}],
        "fallback": str | null                     # why it was gathered to Replicate
      }]
    }

A layer is a module FQN up to its first list index (``layers.3``), or the module itself
when it is in no list (``tok_embeddings``); ``""`` is the root.
"""
from __future__ import annotations

import json
import math
import typing
from dataclasses import asdict, dataclass, field, fields, is_dataclass
from typing import Optional, Union

SCHEMA_VERSION = 2
Dim = Union[int, str]
ABBREVIATIONS = {"all_reduce": "AR", "all_gather": "AG", "reduce_scatter": "RS"}


@dataclass
class Comm:
    """One collective call on one rank: its kind and the bytes of its local input."""

    kind: str
    bytes: int


@dataclass
class NodeInfo:
    name: str
    op: str
    module: str
    dtype: Optional[str]
    global_shape: Optional[list[Dim]]
    local_shape: Optional[list[Dim]]
    placement: str
    collective: Optional[str] = None
    forward: list[Comm] = field(default_factory=list)
    backward: list[Comm] = field(default_factory=list)
    fallback: Optional[str] = None


@dataclass
class Totals:
    """Collectives by kind: number of calls and bytes per rank."""

    counts: dict[str, int] = field(default_factory=dict)
    bytes: dict[str, int] = field(default_factory=dict)

    def add(self, comms: list[Comm]) -> None:
        for c in comms:
            self.counts[c.kind] = self.counts.get(c.kind, 0) + 1
            self.bytes[c.kind] = self.bytes.get(c.kind, 0) + c.bytes

    def total_bytes(self) -> int:
        return sum(self.bytes.values())


@dataclass
class Layer:
    layer: str
    forward: Totals = field(default_factory=Totals)
    backward: Totals = field(default_factory=Totals)
    param_bytes: int = 0
    param_bytes_unsharded: int = 0


@dataclass
class Fallback:
    node: str
    op: str
    module: str
    message: str


@dataclass
class HeldWhole:
    param: str
    extra_bytes: int
    message: str


@dataclass
class Summary:
    world_size: int
    forward: Totals
    backward: Totals
    bytes_per_step: int
    param_bytes: int
    param_bytes_unsharded: int
    layers: list[Layer]
    fallbacks: list[Fallback]
    held_whole: list[HeldWhole]
    symbolic_dims: dict[str, int]


@dataclass
class Report:
    summary: Summary
    nodes: list[NodeInfo]
    schema_version: int = SCHEMA_VERSION

    def to_dict(self) -> dict:
        return asdict(self)

    def to_json(self, indent: Optional[int] = 1) -> str:
        return json.dumps(self.to_dict(), indent=indent)

    @classmethod
    def from_dict(cls, data: dict) -> "Report":
        """Rebuild a report, checking every field against the schema (``TypeError``)."""
        if data.get("schema_version") != SCHEMA_VERSION:
            raise TypeError(f"report schema_version {data.get('schema_version')!r} is not "
                            f"{SCHEMA_VERSION}")
        return _load(cls, data, "report")

    @classmethod
    def from_json(cls, text: str) -> "Report":
        return cls.from_dict(json.loads(text))

    def __str__(self) -> str:
        return format_report(self)


def _load(tp, value, where: str):
    """``value`` (parsed JSON) as type ``tp``, or a ``TypeError`` naming the field."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if is_dataclass(tp):
        if not isinstance(value, dict):
            raise TypeError(f"{where}: expected an object, got {value!r}")
        hints = typing.get_type_hints(tp)
        names = {f.name for f in fields(tp)}
        if set(value) != names:
            raise TypeError(f"{where}: fields {sorted(value)} are not {sorted(names)}")
        return tp(**{k: _load(hints[k], v, f"{where}.{k}") for k, v in value.items()})
    if origin is Union:
        for option in args:
            try:
                return _load(option, value, where)
            except TypeError:
                pass
        raise TypeError(f"{where}: {value!r} is none of {args}")
    if origin is list:
        if not isinstance(value, list):
            raise TypeError(f"{where}: expected a list, got {value!r}")
        return [_load(args[0], v, f"{where}[{i}]") for i, v in enumerate(value)]
    if origin is dict:
        if not isinstance(value, dict):
            raise TypeError(f"{where}: expected an object, got {value!r}")
        return {k: _load(args[1], v, f"{where}.{k}") for k, v in value.items()}
    if tp is type(None):
        if value is not None:
            raise TypeError(f"{where}: expected null, got {value!r}")
        return None
    if tp is int and isinstance(value, bool) or not isinstance(value, tp):
        raise TypeError(f"{where}: expected {tp.__name__}, got {value!r}")
    return value


# --- text ---------------------------------------------------------------------------------

def human_bytes(n: int) -> str:
    units, i, x = ("B", "KiB", "MiB", "GiB", "TiB"), 0, float(n)
    while x >= 1024 and i < len(units) - 1:
        x, i = x / 1024, i + 1
    return f"{n} B" if i == 0 else f"{math.floor(x * 10 + 0.5) / 10:.1f} {units[i]}"


def shape_text(shape: Optional[list]) -> str:
    """``(2, 16)``, ``(64,)``, ``-`` (no tensor)."""
    if shape is None:
        return "-"
    return "(" + ", ".join(map(str, shape)) + ("," if len(shape) == 1 else "") + ")"


def comms_text(comms: list[Comm]) -> str:
    return ", ".join(f"{ABBREVIATIONS.get(c.kind, c.kind)} {human_bytes(c.bytes)}"
                     for c in comms) or "-"


def totals_text(t: Totals) -> str:
    return ", ".join(f"{n} {ABBREVIATIONS.get(k, k)}" for k, n in sorted(t.counts.items())) \
        or "-"


def table(headers: list[str], rows: list[list[str]], right: tuple = ()) -> str:
    """Fixed-width columns; ``right``: indices of right-aligned columns."""
    widths = [max(len(str(r[i])) for r in [headers, *rows]) for i in range(len(headers))]

    def line(cells):
        return "  ".join(str(c).rjust(w) if i in right else str(c).ljust(w)
                         for i, (c, w) in enumerate(zip(cells, widths))).rstrip()
    return "\n".join([line(headers), line(["-" * w for w in widths]), *map(line, rows)])


def format_report(report: Report) -> str:
    s = report.summary
    nodes = table(
        ["node", "op", "module", "global shape", "local shape", "placement", "collective",
         "forward", "backward"],
        [[n.name, n.op, n.module or "<root>", shape_text(n.global_shape),
          shape_text(n.local_shape), n.placement, n.collective or "",
          comms_text(n.forward) if n.collective else "",
          comms_text(n.backward) if n.collective else ""] for n in report.nodes])
    kinds = sorted(set(s.forward.counts) | set(s.backward.counts))
    collectives = table(
        ["collective", "forward", "fwd bytes/rank", "backward", "bwd bytes/rank"],
        [[k, s.forward.counts.get(k, 0), human_bytes(s.forward.bytes.get(k, 0)),
          s.backward.counts.get(k, 0), human_bytes(s.backward.bytes.get(k, 0))]
         for k in kinds], right=(1, 2, 3, 4)) if kinds else "no collectives"
    layers = table(
        ["layer", "forward", "fwd bytes", "backward", "bwd bytes", "params/rank",
         "unsharded"],
        [[l.layer or "<root>", totals_text(l.forward), human_bytes(l.forward.total_bytes()),
          totals_text(l.backward), human_bytes(l.backward.total_bytes()),
          human_bytes(l.param_bytes), human_bytes(l.param_bytes_unsharded)]
         for l in s.layers], right=(2, 4, 5, 6))
    share = s.param_bytes / s.param_bytes_unsharded if s.param_bytes_unsharded else 1.0
    out = [f"fxtp.explain: {len(report.nodes)} nodes, world size {s.world_size}", "",
           nodes, "", "Collectives per step (bytes per rank; AR all_reduce, AG all_gather, "
           "RS reduce_scatter)", collectives,
           f"bytes per rank per step: {human_bytes(s.bytes_per_step)}" +
           (f" ({s.bytes_per_step} B)" if s.bytes_per_step >= 1024 else ""),
           f"parameters per rank: {human_bytes(s.param_bytes)} of "
           f"{human_bytes(s.param_bytes_unsharded)} unsharded ({share:.1%})", "",
           "Per layer", layers, "",
           "Fallbacks (ops gathered to Replicate): " + (
               "none" if not s.fallbacks else "".join(
                   f"\n  {f.node} ({f.op}) in '{f.module or '<root>'}': {f.message}"
                   for f in s.fallbacks))]
    if s.held_whole:
        out.append(f"Held whole on every rank though the plan shards them (+"
                   f"{human_bytes(sum(h.extra_bytes for h in s.held_whole))} a rank):")
        said = set()
        for h in s.held_whole:
            out.append(f"  {h.param} (+{human_bytes(h.extra_bytes)}): " +
                       ("as above" if h.message in said else h.message))
            said.add(h.message)
    if s.symbolic_dims:
        out.append("Symbolic dims (sizes and bytes use these hints): " +
                   ", ".join(f"{k}={v}" for k, v in s.symbolic_dims.items()))
    return "\n".join(out) + "\n"
