"""A graph's state, to put back exactly after a trial a cost check rejects.

A trial (:func:`~fxtp.passes.program_cost.kept_if_cheaper`, the strided pass) places a
graph anew, and what it runs may add nodes, erase them (a norm decomposed into reductions)
and move them. :class:`Snapshot` records every node with its target, arguments and
``meta`` in order; :meth:`Snapshot.restore` erases the nodes made since, brings back the
very nodes erased since (objects other records name stay valid) and puts every node's
target, arguments, ``meta`` and place back.
"""
from __future__ import annotations

import torch.fx as fx


class Snapshot:
    def __init__(self, graph: fx.Graph):
        self.graph = graph
        self.nodes = list(graph.nodes)
        self.state = {n: (n.target, n.args, n.kwargs, dict(n.meta)) for n in self.nodes}

    def restore(self) -> None:
        graph = self.graph
        made = [n for n in graph.nodes if n not in self.state]
        for node in made:  # read by nothing once every node has its old arguments again
            node.args, node.kwargs = (), {}
        for node in self.nodes:
            if not node._erased:
                node.args, node.kwargs = (), {}
        for node in reversed(made):
            graph.erase_node(node)
        previous = graph._root
        for node in self.nodes:
            if node._erased:
                _revive(graph, node)
            if node._prev is not previous:
                previous.append(node)
            previous = node
        for node, (target, args, kwargs, meta) in self.state.items():
            node.target, node.args, node.kwargs = target, args, kwargs
            node.meta.clear()
            node.meta.update(meta)


def _revive(graph: fx.Graph, node: fx.Node) -> None:
    """Make an erased ``node`` a member of ``graph`` again, unlinked (its links still name
    the neighbours it had), for the caller to place."""
    node._prev = node._next = node
    node._erased = False
    graph._find_nodes_lookup_table.insert(node)
    graph._len += 1
