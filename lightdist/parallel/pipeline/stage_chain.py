"""Stages cut by torch's tracer, rewritten so that each takes what the one before it returns, and the model call's
arguments that it reads.

``pipeline()`` cuts a traced forward into stage modules that read their inputs wherever they were computed: the
rotary table the first stage slices, or a mask it builds, is read by every later stage. torch's ``PipelineStage``
hands a stage only the outputs of the stage before it. So every value a stage reads is passed on, unchanged, by each
stage between the one that makes it and the one that reads it: with four stages the table goes 0 -> 1 -> 2 -> 3.

The model call's arguments are not passed on: the first stage takes them all, in order, and a later stage that reads
one (a loss computed in the model from its ``targets``) takes it after what it is handed, from the microbatch's model
call (``trace_stages``), which the schedule hands every stage: nothing is sent through the stages between.
"""

from __future__ import annotations

from torch import fx

__all__ = ["chain_stages"]


def chain_stages(split: fx.Graph, stages: list[fx.GraphModule]) -> None:
    """Rewrite ``stages`` in place, which ``split`` (``Pipe.split_gm.graph``) calls in order, into a chain: the first
    takes the model call's arguments, in order; each later one what the one before returns, then the call's
    arguments it reads, in the order of ``split``'s call of it."""
    order = {node: position for position, node in enumerate(split.nodes)}
    calls = [node for node in split.nodes if node.op == "call_module"]
    made_by = {call: stage for stage, call in enumerate(calls)}

    def made_at(value: fx.Node) -> int:
        return made_by[value.args[0] if value.op == "call_function" else value]  # getitem(call, index), or call

    last_read = {value: stage for stage, call in enumerate(calls) for value in call.args if value.op != "placeholder"}
    entering = [[node for node in split.nodes if node.op == "placeholder"]]
    for stage in range(1, len(calls)):
        live = [value for value, last in last_read.items() if made_at(value) < stage <= last]
        arguments = [value for value in calls[stage].args if value.op == "placeholder"]
        entering.append(sorted(live, key=order.__getitem__) + arguments)
    for stage, (call, module) in enumerate(zip(calls, stages, strict=True)):
        inputs = _take(module.graph, dict(zip(call.args, _placeholders(module.graph), strict=True)), entering[stage])
        if stage < len(calls) - 1:
            handed_on = [value for value in entering[stage + 1] if value.op != "placeholder"]
            _return(module.graph, call, inputs, handed_on)
        module.graph.lint()
        module.recompile()


def _placeholders(graph: fx.Graph) -> list[fx.Node]:
    return [node for node in graph.nodes if node.op == "placeholder"]


def _take(graph: fx.Graph, read: dict[fx.Node, fx.Node], values: list[fx.Node]) -> dict[fx.Node, fx.Node]:
    """Make ``graph``'s parameters ``values``, in order: those it reads (``read``: each value's placeholder) and those
    it only passes on. Returns each value's new placeholder."""
    first = next(iter(graph.nodes))
    taken = {}
    for value in values:
        with graph.inserting_before(first):
            taken[value] = graph.placeholder(value.name)
        if value in read:
            taken[value].meta = dict(read[value].meta)
    for value, old in read.items():
        old.replace_all_uses_with(taken[value])
        graph.erase_node(old)
    return taken


def _return(graph: fx.Graph, call: fx.Node, inputs: dict[fx.Node, fx.Node], values: list[fx.Node]) -> None:
    """Make ``graph`` (the stage ``call`` runs) return ``values``, in order: its own outputs and what it passes on."""
    output = next(node for node in graph.nodes if node.op == "output")
    (returned,) = output.args

    def node_of(value: fx.Node) -> fx.Node:
        if value in inputs:
            return inputs[value]
        if value is call:  # the stage's one output
            return returned
        return returned[value.args[1]]  # getitem(call, index): one of its outputs

    nodes = [node_of(value) for value in values]
    output.args = (nodes[0] if len(nodes) == 1 else tuple(nodes),)
