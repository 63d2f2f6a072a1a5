"""Stage dumps: what each stage of one ``parallelize`` call produced, as files.

``parallelize(..., dump_dir=d)`` or the environment variable ``FXTP_DUMP_DIR=d`` writes:

====================  ======================================================================
``01_traced.py``      the traced ATen graph's code
``02_placements.txt`` every node's placement after propagation (and the strided pass), the
                      placements it needs of its inputs, module boundaries and fallbacks
``03_rewritten.py``   the code with the collectives inserted (global shapes)
``04_localized.py``   this rank's final program
``report.txt``        :func:`fxtp.explain`'s report as a table
``report.json``       the same as JSON (schema: :mod:`fxtp.inspection.report`)
``graph.html``        one self-contained page: the summary, then the graph grouped by module
``error.txt``         only when a stage failed: the error (the stages before it are written)
====================  ======================================================================

A file whose content is the same on every rank of the group is written once (by rank 0);
one that differs (the rewritten and localized code name the rank) is written by every rank
as ``03_rewritten.rank1.py``. Ranks compare content hashes in one ``all_gather_object``
over the group at the end of ``parallelize``; on the fake backend (shape-only checks in
one process, ``python -m fxtp explain``) only this process's rank exists and it writes
every file under the shared name. After a failure ranks do not compare (another rank may not
get there): each writes what it has under its rank's names.
"""
from __future__ import annotations

import hashlib
import os
import pathlib
import traceback
from typing import Optional

import torch.distributed as dist
import torch.fx as fx

from ..kernels.torch_compat import resolve_process_group
from ..passes.graph import BOUNDARY, INPUTS
from ..passes.placement import describe

from ..plans.mesh import Group
from .explanation import explain, node_info
from .report import shape_text, table
from .report_html import render_html

ENV = "FXTP_DUMP_DIR"


class Dumper:
    """Collects each stage's files during ``parallelize`` and writes them on exit; does
    nothing when ``directory`` is ``None`` and ``FXTP_DUMP_DIR`` is unset."""

    def __init__(self, directory: Optional[str], group: Group):
        directory = directory or os.environ.get(ENV)
        self.directory = pathlib.Path(directory) if directory else None
        self.group = group
        self.files: dict[str, str] = {}

    def code(self, stage: str, gm: fx.GraphModule) -> None:
        """The code of ``gm``'s graph as it is now (passes leave recompiling to the end)."""
        if self.directory is not None:
            self._add(f"{stage}.py", gm.graph.python_code("self").src.lstrip("\n"))

    def placements(self, gm: fx.GraphModule) -> None:
        if self.directory is None:
            return
        rows = []
        for node in gm.graph.nodes:
            row = node_info(node, self.group.rank, self.group.world, {})
            needs = node.meta.get(INPUTS)
            note = node.meta.get(BOUNDARY) or row.fallback or ""
            rows.append([row.name, row.op, row.module or "<root>", shape_text(row.global_shape),
                         row.placement, "-" if needs is None else describe(tuple(needs)), note])
        self._add("placements.txt", table(["node", "op", "module", "global shape",
                                           "placement", "inputs needed", "note"], rows) + "\n")

    def report(self, gm: fx.GraphModule) -> None:
        if self.directory is None:
            return
        report = explain(gm)
        self.files.update({"report.txt": str(report), "report.json": report.to_json(),
                           "graph.html": render_html(report)})

    def _add(self, name: str, text: str) -> None:
        if self.directory is not None:
            stages = sum(1 for f in self.files if f[:2].isdigit())
            self.files[f"{stages + 1:02d}_{name}"] = text

    def __enter__(self) -> "Dumper":
        return self

    def __exit__(self, kind, error, tb) -> None:
        if self.directory is None:
            return
        self.directory.mkdir(parents=True, exist_ok=True)
        alone = self._alone()
        if error is not None:
            self.files["error.txt"] = "".join(traceback.format_exception(kind, error, tb))
            shared = dict.fromkeys(self.files, alone)
        else:
            shared = self._same_on_every_rank(alone)
        for name, text in self.files.items():
            stem, dot, suffix = name.partition(".")
            if shared[name]:
                if alone or self.group.rank == 0:
                    for stale in self.directory.glob(f"{stem}.rank*.{suffix}"):
                        stale.unlink()
                    _write(self.directory / name, text)
            else:
                _write(self.directory / f"{stem}.rank{self.group.rank}{dot}{suffix}", text)

    def _alone(self) -> bool:
        """Whether this process is the only rank (world size 1, or the fake backend)."""
        return self.group.world == 1 or dist.get_backend(_process_group(self.group)) == "fake"

    def _same_on_every_rank(self, alone: bool) -> dict[str, bool]:
        if alone:
            return dict.fromkeys(self.files, True)
        pg = _process_group(self.group)
        digests = {n: hashlib.sha256(t.encode()).hexdigest() for n, t in self.files.items()}
        everyone: list = [None] * self.group.world
        dist.all_gather_object(everyone, digests, group=pg)
        return {n: all(d == everyone[0].get(n) for d in (e.get(n) for e in everyone))
                for n in self.files}


def _process_group(group: Group) -> dist.ProcessGroup:
    return resolve_process_group(group.name)


def _write(path: pathlib.Path, text: str) -> None:
    """Write atomically (ranks of other groups may write the same shared file)."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)
