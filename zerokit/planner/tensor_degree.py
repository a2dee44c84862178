"""A tensor degree inside the node, beside the tree's pick (the memo's "Inside the node" section).

[Note: a tensor degree beside the pick]
Tensor parallelism over t GPUs of a node splits every block's matrices and its activations by t (memory.py: the
activations / t, the model states / t before ZeRO shards them over the N / t replicas), and costs four all-reduces
of a block's (s, b, h) activations per micro-batch, two in forward and two in backward, on the node's links
(comms.model_parallel); only the N / t replicas read distinct data, so a step trains 1 / t of the tokens at the same
micro-batch. The tree (advice.py) chooses among flat data-parallel stages; this asks, for each t that divides the
node's GPUs and the attention and key-value heads, every stage that fits with or without activation checkpointing
(as the policy allows), each at the largest micro-batch it fits, keeps the one that trains the most tokens per
second, and compares it with the pick at its own largest micro-batch. The memo says where a tensor degree would
change the pick: where one trains more tokens per second.
"""

from __future__ import annotations

from dataclasses import replace

from zerokit.planner.advice import Plan, largest_micro_batch, tensor_degrees
from zerokit.planner.estimate import Estimate, estimate
from zerokit.planner.spec import Layout


def tensor_options(p: Plan) -> list[Estimate]:
    """For each tensor degree: the stage and checkpointing that train the most tokens per second, at the largest
    micro-batch they fit (See [Note: a tensor degree beside the pick])."""
    found = []
    choices = ("none", "full") if p.policy.checkpointing == "auto" else (p.policy.checkpointing,)
    if p.pick is None:
        return []
    for t in tensor_degrees(p.scenario):
        trials = [replace(p.scenario.with_training(checkpointing=choice, micro_batch=1), layout=Layout(tp=t))
                  for choice in choices]
        fitting = [r for laid_out in trials for r in (estimate(laid_out, stage, headroom=p.policy.headroom)
                                                      for stage in range(4)) if r.fits]
        at_largest = [estimate(r.scenario.with_training(micro_batch=largest_micro_batch(r, p.policy)[0]), r.stage,
                               headroom=p.policy.headroom) for r in fitting]
        if at_largest:  # the fastest stage, each at the largest micro-batch it fits; ties: the lower stage
            found.append(max(at_largest, key=lambda r: (r.tokens_per_second, -r.stage)))
    return found


def pick_at_its_largest(p: Plan) -> Estimate:
    return p.at_max_micro_batch or p.pick


def tensor_section(p: Plan) -> list[str]:
    """The memo's rows: the pick at its largest micro-batch, then each tensor degree's; and whether one beats it."""
    options = tensor_options(p)
    if not options:
        return []
    base = pick_at_its_largest(p)
    rows = [_row(f"{base.scenario.layout.name} (the pick)", base)] + [_row(o.scenario.layout.name, o)
                                                                      for o in options]
    best = max(options, key=lambda o: o.tokens_per_second)
    verdict = (f"tp={best.scenario.layout.tp} with ZeRO-{best.stage} at micro-batch "
               f"{best.training.micro_batch} would change the pick: {best.tokens_per_second:,.0f} tokens/s against "
               f"{base.tokens_per_second:,.0f}" if best.tokens_per_second > base.tokens_per_second else
               f"no tensor degree trains more tokens per second than the pick ({base.tokens_per_second:,.0f}; the "
               f"best, tp={best.scenario.layout.tp}, {best.tokens_per_second:,.0f}): the pick stands")
    out = ["", "## Inside the node: a tensor degree", "",
           "Each tensor degree t dividing the node's GPUs and the heads, at its fastest stage and checkpointing and "
           "the largest micro-batch (See [Note: a tensor degree beside the pick] in planner/tensor_degree.py); "
           "activations and model states / t, four all-reduces of a block's activations per micro-batch on the "
           "node's links, N / t replicas reading data.", ""]
    header = ("layout", "configuration", "micro-batch", "GPU GB", "activations GB", "comm s", "step s", "tokens/s")
    out += ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    out += ["| " + " | ".join(row) + " |" for row in rows]
    return out + ["", f"- {verdict}"]


def _row(name: str, e: Estimate) -> list[str]:
    return [name, e.label, str(e.training.micro_batch), f"{e.memory.total / 1e9:.2f}",
            f"{e.memory.activations / 1e9:.2f}", f"{e.comm.seconds:.3f}", f"{e.step_seconds:.3f}",
            f"{e.tokens_per_second:,.0f}"]
