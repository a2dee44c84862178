"""The memo's "Mixture of experts" section: the pick's configuration with and without each expert degree, by category.

Each row is one layout (flat, or ep = d for every degree the tree may try, or the one asked for) at one stage, with the
pick's offload, checkpointing and micro-batch, so the table shows what an expert degree changes: the experts'
parameters (and gradients, and optimizer state) that a stage leaves whole shrink by ep, the sharded ones do not (See
[Note: the expert degree] in memory.py), and the all-to-alls it adds ([Note: the expert exchange in the plan] in
comms.py).
"""

from __future__ import annotations

from dataclasses import replace

from zerokit.planner.advice import Plan, expert_degrees
from zerokit.planner.comms import Collective
from zerokit.planner.estimate import STAGES, Estimate, estimate
from zerokit.planner.spec import GB, Layout

HEADER = ("layout", "stage", "fits", "parameters", "gradients", "optimizer state", "activations", "buffers", "total GB",
          "all-to-all GB", "sent GB", "all-to-all s", "comm s", "step s")


def exchange(result: Estimate) -> Collective | None:
    """The expert group's all-to-alls of one step, if the layout has an expert degree."""
    return next((c for c in result.comm.collectives if c.kind == "all_to_all" and c.group == "ep"), None)


def expert_layouts(p: Plan) -> list[Layout]:
    """Flat and every expert degree the tree may try; or flat and the degree asked for."""
    asked = p.scenario.layout
    if asked.ep > 1:
        return [Layout(), asked]
    return [Layout()] + [Layout(ep=ep) for ep in expert_degrees(p.scenario)]


def expert_rows(p: Plan) -> list[Estimate]:
    """Each layout at every stage the pick's offload allows, at the pick's checkpointing and micro-batch."""
    pick = p.pick
    stages = [s for s in STAGES if (s >= 1 or not pick.offload.any) and (s == 3 or pick.offload.params == "none")]
    return [estimate(replace(pick.scenario, layout=layout), stage, pick.offload, headroom=p.policy.headroom)
            for layout in expert_layouts(p) for stage in stages]


def _row(e: Estimate) -> list[str]:
    m, a2a = e.memory, exchange(e)
    moved = [f"{a2a.bytes / GB:.2f}", f"{a2a.wire_bytes / GB:.2f}", f"{a2a.seconds:.3f}"] if a2a else ["0", "0", "0"]
    return [e.scenario.layout.name, f"ZeRO-{e.stage}", "yes" if e.fits else "no",
            *(f"{v / GB:.2f}" for v in (m.parameters, m.gradients, m.optimizer_state, m.activations, m.buffers,
                                        m.total)), *moved, f"{e.comm.seconds:.3f}", f"{e.step_seconds:.3f}"]


def expert_section(p: Plan) -> list[str]:
    """The memo's lines (none for a dense model or without a pick)."""
    arch = p.scenario.model.architecture
    if p.pick is None or arch is None or arch.experts is None:
        return []
    x, pick = arch.experts, p.pick
    checkpointing = "full" if pick.training.checkpointing == "full" else "no"
    routed = arch.routed_expert_params()
    out = ["", "## Mixture of experts: with and without an expert degree", "",
           f"{arch.moe_layers} MoE layers of {x.count} experts (top-{x.top_k}, width {x.ffn}, capacity factor "
           f"{x.capacity:g}): {routed / 1e9:.2f}B of the {arch.total_params() / 1e9:.2f}B parameters are routed "
           f"experts, {arch.active_params() / 1e9:.2f}B are active per token. Each row is the pick's configuration "
           f"({pick.offload.name}, {checkpointing} checkpointing, micro-batch "
           f"{pick.training.micro_batch}) in one layout; GB per GPU. An expert degree ep keeps E / ep experts on a "
           "GPU and shards them over their expert-data group of N / ep ranks, so it shrinks what a stage leaves "
           "whole, not what it shards (See [Note: the expert degree] in planner/memory.py); per MoE layer and "
           "micro-batch it adds two all-to-alls of the routed tokens (dispatch, combine) forward and two backward, "
           "(ep - 1) / ep of them sent.", ""]
    rows = [_row(e) for e in expert_rows(p)]
    out += ["| " + " | ".join(HEADER) + " |", "|" + "---|" * len(HEADER)]
    return out + ["| " + " | ".join(row) + " |" for row in rows]
