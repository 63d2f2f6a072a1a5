"""Overlap pass on inductor's post-grad ATen graphs (forward and backward alike).

Each functional collective is issued as soon as its inputs exist, and computation that
does not need its result is moved between the issue and the wait, so it runs while the
collective is in flight. With its default configuration inductor does not do this itself:
it waits right after each collective (its peak-memory reordering, which fxtp's backend turns
off, would also move the compute back before it). Inductor keeps a collective's buffers
alive until its wait, so any placement of the wait is safe. Collectives keep their relative
order, the same on every rank, and nodes with side effects (buffer updates) are never moved
or moved across. Inductor's fusion can still merge a moved node back across a collective.
"""
from __future__ import annotations

import torch.fx as fx

from ..kernels.torch_compat import CustomGraphPass, c10d_functional, get_hash_for_files

_c10d = c10d_functional
STARTS = frozenset({_c10d.all_reduce.default, _c10d.all_gather_into_tensor.default,
                    _c10d.reduce_scatter_tensor.default, _c10d.all_to_all_single.default})
WAIT = _c10d.wait_tensor.default


def overlap_collectives(graph: fx.Graph) -> None:
    issue_early(graph)
    wait_late(graph)
    graph.lint()


def issue_early(graph: fx.Graph) -> None:
    """Move the nodes before a collective that it does not depend on to right after it,
    back to the previous collective or the nodes already moved after that one."""
    floor = None
    for start in [n for n in graph.nodes if n.target in STARTS]:
        ancestors, independent = set(start.all_input_nodes), []
        node = start.prev
        while node is not floor and node.op not in ("placeholder", "root") and \
                not _barrier(node):
            if node in ancestors:
                ancestors.update(node.all_input_nodes)
            else:
                independent.append(node)
            node = node.prev
        for node in independent:  # nearest first, so they keep their order after it
            start.append(node)
        floor = independent[0] if independent else start


def wait_late(graph: fx.Graph) -> None:
    """Move the nodes between a wait and the next collective that do not depend on the
    wait to before it."""
    for wait in [n for n in graph.nodes if n.target is WAIT]:
        dependent, independent = {wait}, []
        node = wait.next
        while node.op != "output" and node.target not in STARTS and not _barrier(node):
            (dependent.add(node) if any(a in dependent for a in node.all_input_nodes)
             else independent.append(node))
            node = node.next
        for node in independent:
            wait.prepend(node)


def _barrier(node: fx.Node) -> bool:
    return node.target is not WAIT and node.target not in STARTS and node.is_impure()


class OverlapCollectives(CustomGraphPass):
    """:func:`overlap_collectives` as inductor's ``post_grad_custom_post_pass``."""

    def __call__(self, graph: fx.Graph) -> None:
        overlap_collectives(graph)

    def uuid(self) -> bytes:
        return get_hash_for_files((__file__,))
