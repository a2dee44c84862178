"""The decision procedure: which stage, whether to offload or recompute, and the largest micro-batch.

[Note: decision tree]
    for checkpointing in (none, full)            # full only if none fails (or as the user fixed it)
        1. lowest ZeRO stage 0..3 that fits on the GPU with headroom, nothing offloaded
        1a. else, for a mixture of experts, every expert degree inside the node at stages 0..3, the fastest that fits
        1b. else a degree d inside the node, smallest first: a sequence degree (Ulysses) and a tensor degree d,
            each at stages 0..3, the fastest that fits
        2. else offload tiers, each from the lowest stage it allows, with room on the host (each beside its
           expert degrees, for a mixture of experts):
           optimizer -> CPU (stage >= 1); + parameters -> CPU (stage 3);
           optimizer -> NVMe (stage >= 1); + parameters -> NVMe (stage 3)
    if nothing fits: say what was closest and how many GPUs stage 3 would need
    then: the largest micro-batch that fits the chosen configuration
Under pipeline parallelism every stage is tried, as zerokit.pipeline trains them (DeepSpeed's PipelineEngine
refuses ZeRO-2 and ZeRO-3); stage 2 then reduces once per optimizer step, and stage 3 is priced gathering per
micro-batch and gathering once per step (zerokit.pipeline's two settings) as two forms of its rung, the faster that
fits winning. The first configuration that fits is the pick; the reasons quote the numbers of everything tried
before it.

[Note: a tensor degree in the tree]
Where no stage fits on the GPU alone, flat or hybrid, the tree tries tensor parallelism inside the node before it
offloads: for each degree t dividing the node's GPUs and the heads (smallest first), stages 0-3 of ZeRO over the N /
t replicas, one rung with the sequence degree of the same value (See [Note: a sequence degree in the tree]): the
fastest that fits wins. A tensor group splits what ZeRO cannot: the activations (/ t), besides the model states (/ t
before ZeRO shards them); it costs four all-reduces of a block's activations per micro-batch on the node's links,
and a step trains 1 / t of the tokens at the same micro-batch, while an offload tier's step is bound by PCIe and the
host. So where activations, not states, overflow the GPU, a tensor degree is the rung that fits without
recomputation; the memo's "Inside the node" section still sets every degree beside the pick where a tensor degree is
not the pick. zerokit trains the pick as `tensor_parallel.autotp_size` (docs/tensor_parallel.md);
Policy(tensor="none") keeps the tree flat.

[Note: a sequence degree in the tree]
Where activations overflow the GPU (long sequences), a sequence degree sp splits them as a tensor degree of the same
value would (each rank keeps s / sp tokens, and attention's share of the heads), and moves less activation: four
all-to-alls of the rank's tokens per block each way ((sp - 1) / sp of q, k, v and the output), where a tensor group
all-reduces whole activations four times. But it splits no weight: ZeRO still shards and gathers the whole model
over every rank, for the tokens of world / sp sequences a step, where a tensor group gathers 1 / t of it. Which wins
depends on the model, the length and the stage (a tensor degree may fit at ZeRO-0, splitting the states itself, where
a sequence degree needs ZeRO-3 and trains faster there), so a degree's rung holds both forms at every stage (where
the heads allow each), the fastest that fits winning, as the hybrid forms of a stage do; both come before any offload
tier, which would move the model
states over PCIe and leave the activations where they were. A long sequence whose states fit but whose activations
do not is where a sequence degree is picked. zerokit trains it as `sequence_parallel_size` (docs/sequence_parallel.md);
Policy(sequence="none") leaves it out.

[Note: an expert degree in the tree]
For a mixture-of-experts model, where no flat stage fits on the GPU alone, the tree tries every expert degree ep
inside the node (dividing its GPUs and the experts) at stages 0-3 as one rung, the fastest that fits winning, before
the sequence and tensor degrees and any offload tier. An expert degree shrinks what ZeRO leaves whole at a stage, the
experts' parameters at stages 0-2 above all (E / ep experts a rank instead of E), and stage 3's gather unit (a block
with E / ep experts), but not what ZeRO shards, which is Psi / N_d a rank either way (See [Note: the expert degree]
in memory.py), nor the activations; it costs two all-to-alls of the routed tokens per MoE layer each way on the
node's links ([Note: the expert exchange in the plan] in comms.py) and saves the experts' gathers and reductions over
the whole data group. Where the model states alone overflow the GPU at every stage (Mixtral-8x7B fully trained on 8
GPUs of 80 GB: 18 bytes x 46.7B / 8 = 105 GB), no expert degree fits either, and each offload tier's rung holds its
flat form beside every expert degree, the fastest that fits winning: with the optimizer on the host an expert degree
keeps the stage-1 and -2 parameters on the GPU small enough where the flat form must go to stage 3 or offload the
parameters too. zerokit trains the pick as `expert_parallel_size`; Policy(expert="none") leaves it out.

[Note: hybrid sharding in the tree]
On more than one node (and a flat layout as asked), step 1 tries beside each flat stage its hybrid
forms: MiCS/HSDP (shard inside a node, replicas = nodes; stages 1-3) and hpZ (stage 3, a secondary copy
over k = gpus_per_node ranks). Each stage is one rung: the lowest rung where anything fits wins, and
within it the fastest predicted step (ties: the flat form, then the order above). A hybrid form holds more
per GPU (MiCS: state / s instead of / N; hpZ: + parameters / k) and sends fewer bytes across nodes, so
it wins where the inter-node link, not memory, limits the step. Offload tiers stay flat: their step is
bound by PCIe and the CPU, which a hybrid layout does not change.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass, replace

from zerokit.planner.catalogue import link
from zerokit.planner.estimate import STAGES, Estimate, Scenario, estimate, make_scenario
from zerokit.planner.spec import GB, Layout, Offload, Policy, splits_heads

OFFLOAD_TIERS = (Offload(optimizer="cpu"), Offload(optimizer="cpu", params="cpu"),
                 Offload(optimizer="nvme"), Offload(optimizer="nvme", params="nvme"))


@dataclass(frozen=True)
class Plan:
    scenario: Scenario
    policy: Policy
    pick: Estimate | None
    stages: tuple[Estimate, ...]
    """Every allowed stage without offload, at the pick's checkpointing and micro-batch."""
    attempts: tuple[Estimate, ...]
    """Everything estimated by the tree, in order, up to and including the pick."""
    max_micro_batch: int
    """Largest micro-batch the pick fits (0 without a pick, or without shapes: activations unknown)."""
    over_micro_batch: Estimate | None
    """The pick at max_micro_batch + 1, which does not fit (None if the search hit the policy cap)."""
    at_max_micro_batch: Estimate | None
    """The pick at max_micro_batch, when that is above the requested micro-batch."""
    runner_up: Estimate | None
    """The first fit with the other checkpointing choice at a lower stage or less offload."""
    alternatives: tuple[Estimate, ...]
    """Hybrid layouts on paper (multi-node only): HSDP, ZeRO-1 + pipeline, ZeRO-1 + tensor parallel."""
    rivals: tuple[Estimate, ...]
    """The other forms of the pick's rung that also fit (flat vs MiCS vs hpZ: See [Note: hybrid sharding in the
    tree]), slowest last."""
    reasons: tuple[str, ...]
    notes: tuple[str, ...]


def gb(n: float) -> str:
    return f"{n / GB:.1f} GB"


def allowed_stages(layout: Layout) -> tuple[int, ...]:
    """hpZ asked for is stage 3 only; under a pipeline every stage (zerokit.pipeline trains ZeRO 0-3)."""
    return (3,) if layout.secondary > 1 else STAGES


def hybrid_layouts(scenario: Scenario, stage: int) -> tuple[Layout, ...]:
    """The hybrid forms the tree tries beside flat ZeRO-`stage` (See [Note: hybrid sharding in the tree])."""
    cluster = scenario.cluster
    if cluster.nodes == 1 or scenario.layout != Layout():
        return ()
    forms = [Layout(replicas=cluster.nodes)] if stage >= 1 else []
    return tuple(forms + ([Layout(secondary=cluster.gpus_per_node)] if stage == 3 else []))


def tensor_degrees(scenario: Scenario) -> list[int]:
    """The degrees t > 1 a tensor group inside one node can take for this model: divisors of the node's GPUs that
    divide the attention and key-value heads (none for a layout asked for, or without the model's shapes)."""
    arch, cluster = scenario.model.architecture, scenario.cluster
    if arch is None or scenario.layout != Layout():
        return []
    heads = [arch.n_heads, arch.n_kv_heads]
    return [t for t in range(2, cluster.gpus_per_node + 1)
            if cluster.gpus_per_node % t == 0 and all(h % t == 0 for h in heads)]


def sequence_degrees(scenario: Scenario) -> list[int]:
    """The degrees sp > 1 a sequence group inside one node can take for this model and length: divisors of the node's
    GPUs that split the heads (See splits_heads) and the sequence (none for a layout asked for, or without shapes)."""
    arch, cluster = scenario.model.architecture, scenario.cluster
    if arch is None or scenario.layout != Layout():
        return []
    return [sp for sp in range(2, cluster.gpus_per_node + 1)
            if cluster.gpus_per_node % sp == 0 and splits_heads(arch, sp) and scenario.training.seq_len % sp == 0
            and scenario.shard % sp == 0]


def expert_degrees(scenario: Scenario) -> list[int]:
    """The degrees ep > 1 an expert group inside one node can take: divisors of the node's GPUs that divide the
    experts and the data group (none for a dense model or a layout asked for)."""
    arch, cluster = scenario.model.architecture, scenario.cluster
    if arch is None or arch.experts is None or scenario.layout != Layout():
        return []
    return [ep for ep in range(2, cluster.gpus_per_node + 1)
            if cluster.gpus_per_node % ep == 0 and arch.experts.count % ep == 0 and scenario.shard % ep == 0]


def other_gathering(scenario: Scenario, stage: int) -> tuple[Scenario, ...]:
    """Stage 3 under a pipeline: the scenario with zerokit.pipeline's other stage3_gathering, the fastest that fits
    winning the rung (units held through the step: one gather of the stage per step, the stage's parameters live;
    gathered per micro-batch: 2m gathers, one unit live)."""
    if stage != 3 or scenario.layout.pp == 1:
        return ()
    other = "step" if scenario.training.stage3_gathering == "micro_batch" else "micro_batch"
    return (scenario.with_training(stage3_gathering=other),)


def _rungs(scenario: Scenario, policy: Policy) -> Iterator[tuple[tuple[Scenario, int, Offload], ...]]:
    """The tree's rungs in order; each is a flat configuration and its hybrid forms, tried together. See [Note:
    decision tree] and [Note: a tensor degree in the tree]."""
    stages = allowed_stages(scenario.layout)
    for stage in stages:
        forms = (scenario, *(replace(scenario, layout=layout) for layout in hybrid_layouts(scenario, stage)),
                 *other_gathering(scenario, stage))
        yield tuple((form, stage, Offload()) for form in forms)
    experts = [replace(scenario, layout=Layout(ep=ep)) for ep in
               (expert_degrees(scenario) if policy.expert == "auto" else [])]
    if experts:  # See [Note: an expert degree in the tree]
        yield tuple((form, stage, Offload()) for form in experts for stage in stages)
    sequence = sequence_degrees(scenario) if policy.sequence == "auto" else []
    tensor = tensor_degrees(scenario) if policy.tensor == "auto" else []
    for degree in sorted(set(sequence) | set(tensor)):  # See [Note: a sequence degree in the tree]
        layouts = [Layout(sp=degree)] if degree in sequence else []
        layouts += [Layout(tp=degree)] if degree in tensor else []
        yield tuple((replace(scenario, layout=layout), stage, Offload()) for layout in layouts for stage in stages)
    if policy.offload == "auto":
        for tier in OFFLOAD_TIERS:
            for stage in stages:
                if stage >= 1 and (tier.params == "none" or stage == 3):
                    yield tuple((form, stage, tier) for form in (scenario, *experts))


def _checkpointing_order(policy: Policy) -> tuple[str, ...]:
    return ("none", "full") if policy.checkpointing == "auto" else (policy.checkpointing,)


def _fastest(fits: list[Estimate]) -> tuple[Estimate, tuple[Estimate, ...]]:
    """The pick of a rung and the rest that fit, slowest last; ties go to the earlier form (flat first)."""
    ranked = sorted(fits, key=lambda e: e.step_seconds)  # sorted is stable: the flat form wins a tie
    return ranked[0], tuple(ranked[1:])


def _search(scenario: Scenario, policy: Policy,
            orders: tuple[str, ...]) -> tuple[Estimate | None, list[Estimate], tuple[Estimate, ...]]:
    """(pick, everything estimated, the pick's rivals on its rung)."""
    attempts = []
    for checkpointing in orders:
        trial = scenario.with_training(checkpointing=checkpointing)
        for rung in _rungs(trial, policy):
            results = [estimate(form, stage, offload, headroom=policy.headroom) for form, stage, offload in rung]
            attempts += results
            fits = [r for r in results if r.fits]
            if fits:
                pick, rivals = _fastest(fits)
                return pick, attempts, rivals
    return None, attempts, ()


def largest_micro_batch(pick: Estimate, policy: Policy) -> tuple[int, Estimate | None]:
    """Doubling, then bisection, over micro-batch sizes of the picked configuration."""
    def at(batch: int) -> Estimate:
        return estimate(pick.scenario.with_training(micro_batch=batch), pick.stage, pick.offload,
                        headroom=policy.headroom)

    good, bad = pick.training.micro_batch, None
    while bad is None and good < policy.max_micro_batch:
        trial = min(2 * good, policy.max_micro_batch)
        if at(trial).fits:
            good = trial
        else:
            bad = trial
    if bad is None:
        return good, None
    while bad - good > 1:
        middle = (good + bad) // 2
        good, bad = (middle, bad) if at(middle).fits else (good, middle)
    return good, at(good + 1)


def _order_key(result: Estimate) -> tuple[int, int]:
    tier = 0 if not result.offload.any else 1 + OFFLOAD_TIERS.index(result.offload)
    return tier, result.stage


def _runner_up(scenario: Scenario, policy: Policy, pick: Estimate) -> Estimate | None:
    if policy.checkpointing != "auto":
        return None
    other = "full" if pick.training.checkpointing == "none" else "none"
    found, _, _ = _search(scenario.with_training(micro_batch=pick.training.micro_batch), policy, (other,))
    return found if found is not None and _order_key(found) < _order_key(pick) else None


def hybrid_alternatives(scenario: Scenario, policy: Policy, checkpointing: str) -> tuple[Estimate, ...]:
    """On paper, for several nodes: shard inside a node and replicate across (HSDP); ZeRO-1 inside a
    node with pipeline stages across nodes; tensor parallel inside a node with ZeRO-1 across."""
    cluster = scenario.cluster
    if cluster.nodes == 1 or scenario.layout != Layout():
        return ()
    trial = scenario.with_training(checkpointing=checkpointing)
    options = ((Layout(replicas=cluster.nodes), (1, 2, 3)), (Layout(pp=cluster.nodes), (1,)),
               (Layout(tp=cluster.gpus_per_node), (1,)))
    found = []
    for layout, stages in options:
        try:
            laid_out = replace(trial, layout=layout)
        except ValueError:
            continue  # e.g. tp does not divide the heads; the layout is not possible for this model
        results = [estimate(laid_out, stage, headroom=policy.headroom) for stage in stages]
        found.append(next((r for r in results if r.fits), results[-1]))
    return tuple(found)


def _stage_table(scenario: Scenario, policy: Policy, checkpointing: str) -> tuple[Estimate, ...]:
    trial = scenario.with_training(checkpointing=checkpointing)
    return tuple(estimate(trial, stage, headroom=policy.headroom) for stage in allowed_stages(scenario.layout))


def plan(scenario: Scenario | None = None, policy: Policy | None = None, **scenario_kwargs) -> Plan:
    """Pick a configuration for `scenario` (or make_scenario()'s keyword arguments)."""
    scenario = scenario or make_scenario(**scenario_kwargs)
    policy = policy or Policy()
    pick, attempts, rivals = _search(scenario, policy, _checkpointing_order(policy))
    shrunk = scenario
    while pick is None and shrunk.training.micro_batch > 1:  # the requested micro-batch fits nowhere
        shrunk = shrunk.with_training(micro_batch=shrunk.training.micro_batch // 2)
        pick, more, rivals = _search(shrunk, policy, _checkpointing_order(policy))
        attempts += more
    checkpointing = pick.training.checkpointing if pick else _checkpointing_order(policy)[-1]
    # A bare parameter count has no activations, so every micro-batch would "fit": do not search.
    searchable = pick is not None and scenario.model.architecture is not None
    max_batch, over = largest_micro_batch(pick, policy) if searchable else (0, None)
    at_max = None
    if pick and max_batch > pick.training.micro_batch:
        at_max = estimate(pick.scenario.with_training(micro_batch=max_batch), pick.stage, pick.offload,
                          headroom=policy.headroom)
    runner_up = _runner_up(scenario, policy, pick) if pick else None
    asked = replace(pick.scenario, layout=scenario.layout) if pick else scenario  # the pick's, laid out as asked
    stages = _stage_table(asked, policy, checkpointing)
    alternatives = hybrid_alternatives(asked, policy, checkpointing)
    draft = Plan(scenario, policy, pick, stages, tuple(attempts), max_batch, over, at_max, runner_up, alternatives,
                 rivals, (), ())
    return replace(draft, reasons=tuple(reasons(draft)), notes=tuple(notes(draft)))


def other_inter_link(scenario: Scenario) -> str:
    """The memo compares InfiniBand with Ethernet: 100 Gb Ethernet for an InfiniBand cluster, else HDR."""
    return "eth-100g" if scenario.cluster.inter_link.key.startswith("ib") else "ib-hdr"


def hybrid_comparison(p: Plan) -> tuple[tuple[str, Plan, tuple[Estimate, ...]], ...]:
    """Multi-node: for this cluster's inter-node link and the other kind (See other_inter_link), the plan and
    flat / MiCS / hpZ ZeRO-3 at the pick's checkpointing and micro-batch (() on one node or without a pick)."""
    if p.pick is None or p.scenario.cluster.nodes == 1 or p.scenario.layout != Layout():
        return ()
    other = replace(p.scenario, cluster=replace(p.scenario.cluster, inter_link=link(other_inter_link(p.scenario))))
    out = []
    for scenario, planned in ((p.scenario, p), (other, None)):
        planned = planned or plan(scenario, p.policy)
        trial = scenario.with_training(checkpointing=p.pick.training.checkpointing,
                                       micro_batch=p.pick.training.micro_batch)
        forms = (trial, *(replace(trial, layout=layout) for layout in hybrid_layouts(trial, 3)))
        out.append((scenario.cluster.inter_link.name, planned,
                    tuple(estimate(form, 3, headroom=p.policy.headroom) for form in forms)))
    return tuple(out)


# --- reasons, from the numbers ------------------------------------------------------------------

def _biggest(result: Estimate, count: int = 2) -> str:
    parts = sorted(result.memory.as_dict().items(), key=lambda kv: -kv[1])[:count]
    return " and ".join(f"{name.replace('_', ' ')} {gb(value)}" for name, value in parts)


def _usable(result: Estimate, policy: Policy) -> str:
    return f"{gb(result.usable)} usable ({gb(result.capacity)} x {1 - policy.headroom:.2f})"


def _failure(result: Estimate, policy: Policy) -> str:
    if not result.fits_gpu:
        return (f"{result.label} needs {gb(result.memory.total)} per GPU ({_biggest(result)}), over the "
                f"{_usable(result, policy)}")
    return (f"{result.label} fits the GPU but needs {gb(result.host.ram)} host RAM and {gb(result.host.nvme)} "
            f"NVMe per node, over {gb(result.host.usable_ram)} RAM / {gb(result.host.nvme_capacity)} NVMe")


def _comm_reason(pick: Estimate) -> str:
    comm, compute = pick.comm.seconds, pick.compute.seconds
    if comm == 0:
        return f"no data-parallel communication (one replica); compute {compute:.2f} s per step"
    links = sorted({c.link for c in pick.comm.per_step()})
    verdict = ("hides behind compute" if pick.exposed_comm_seconds <= 0.05 * compute
               else f"leaves {pick.exposed_comm_seconds:.2f} s exposed")
    return (f"communication {comm:.2f} s per step ({gb(pick.comm.wire_bytes)} sent per GPU over "
            f"{', '.join(links)}) vs compute {compute:.2f} s: it {verdict}; predicted step {pick.step_seconds:.2f} s")


def _offload_reason(pick: Estimate) -> str:
    host, time = pick.host, pick.offload_time
    return (f"offload puts {gb(host.ram)} in host RAM (of {gb(host.ram_capacity)}) and {gb(host.nvme)} on NVMe "
            f"per node; per step it moves {gb(time.pcie_down + time.pcie_up)} over PCIe per GPU "
            f"({time.pcie_seconds:.2f} s), the CPU optimizer takes {time.cpu_optimizer_seconds:.2f} s"
            + (f" and NVMe {time.nvme_seconds:.2f} s" if time.nvme_seconds else ""))


def micro_batch_limit(p: Plan) -> str:
    """The largest micro-batch as the summary and the memo state it."""
    if p.max_micro_batch == 0:
        return "unknown without the model's shapes" if p.pick is not None else "none"
    return f"at least {p.max_micro_batch}, the search cap" if p.over_micro_batch is None else str(p.max_micro_batch)


def _micro_batch_reason(p: Plan) -> str:
    if p.max_micro_batch == 0:
        return ("largest micro-batch: not estimated, since activations (what grows with the micro-batch) are not "
                "modelled for a bare parameter count")
    if p.over_micro_batch is None:
        return f"largest micro-batch that fits: at least {p.max_micro_batch} (the search cap)"
    return (f"largest micro-batch that fits: {p.max_micro_batch} (micro-batch {p.max_micro_batch + 1} "
            f"needs {gb(p.over_micro_batch.memory.total)})")


def reasons(p: Plan) -> list[str]:
    if p.pick is None:
        return _no_fit_reasons(p)
    pick, out = p.pick, []
    for tried in p.attempts:
        if not tried.fits and not tried.offload.any and tried.training.checkpointing == pick.training.checkpointing:
            out.append(_failure(tried, p.policy))
    if pick.training.checkpointing == "full" and p.policy.checkpointing == "auto":
        tried = sum(1 for a in p.attempts if a.training.checkpointing == "none")
        out.append(f"nothing fits without activation checkpointing ({tried} configurations tried), so every "
                   "block's input is stored and the block recomputed in backward")
    if pick.offload.any:
        ckpt = pick.training.checkpointing
        skipped = [a for a in p.attempts if not a.fits and a.offload.any and a.training.checkpointing == ckpt
                   and (a.offload, a.stage) != (pick.offload, pick.stage)]  # not the pick's own rung's other forms
        if skipped:
            out.append(f"cheaper offload tiers do not fit either: {_failure(skipped[-1], p.policy)}")
    if pick.scenario.layout.tp > 1 and p.scenario.layout == Layout():
        out.append(_tensor_reason(p))
    if pick.scenario.layout.sp > 1 and p.scenario.layout == Layout():
        out.append(_sequence_reason(p))
    if pick.scenario.layout.ep > 1 and p.scenario.layout == Layout():
        out.append(_expert_reason(p))
    out.append(f"{pick.label} fits: {gb(pick.memory.total)} of {_usable(pick, p.policy)}, "
               f"{gb(pick.usable - pick.memory.total)} to spare; largest parts {_biggest(pick)}")
    out.append(_comm_reason(pick))
    out += _hybrid_reasons(p)
    if pick.offload.any:
        out.append(_offload_reason(pick))
    out.append(_micro_batch_reason(p))
    if p.at_max_micro_batch is not None:
        big = p.at_max_micro_batch
        out.append(f"at micro-batch {p.max_micro_batch} a step takes {big.step_seconds:.2f} s "
                   f"({big.tokens_per_second:,.0f} tokens/s vs {pick.tokens_per_second:,.0f} at micro-batch "
                   f"{pick.training.micro_batch}; exposed communication {big.exposed_comm_seconds:.2f} s)")
    if p.runner_up is not None:
        r = p.runner_up
        out.append(f"{r.label} also fits ({gb(r.memory.total)}) but its predicted step is {r.step_seconds:.2f} s "
                   f"vs {pick.step_seconds:.2f} s; the tree turns to recomputation only when no stage or offload "
                   "tier fits without it")
    return out


def _tensor_reason(p: Plan) -> str:
    """Why a tensor degree: no flat stage fit on the GPU alone (See [Note: a tensor degree in the tree])."""
    pick = p.pick
    t = pick.scenario.layout.tp
    flat = next((a for a in p.attempts if a.stage == pick.stage and a.scenario.layout == Layout()
                 and a.offload == pick.offload and a.training == pick.training), None)
    split = (f"activations {gb(flat.memory.activations)} -> {gb(pick.memory.activations)}, model states "
             f"{gb(flat.memory.model_states)} -> {gb(pick.memory.model_states)} per GPU" if flat else
             f"activations and model states / {t}")
    return (f"no stage fits flat on the GPU alone, so the tree tries tensor parallelism inside the node before "
            f"offloading: tp={t} splits every block's matrices over {t} GPUs ({split}) at the cost of four all-"
            f"reduces of a block's activations per micro-batch on {pick.scenario.cluster.intra_link.name}, with "
            f"{pick.scenario.cluster.world // t} replicas reading data (zerokit: tensor_parallel.autotp_size={t})")


def _sequence_reason(p: Plan) -> str:
    """Why a sequence degree: no flat stage fit on the GPU alone (See [Note: a sequence degree in the tree])."""
    pick = p.pick
    sp = pick.scenario.layout.sp
    flat = next((a for a in p.attempts if a.stage == pick.stage and a.scenario.layout == Layout()
                 and a.offload == pick.offload and a.training == pick.training), None)
    split = f"activations {gb(flat.memory.activations)} -> {gb(pick.memory.activations)} per GPU" if flat else \
        f"activations / {sp}"
    return (f"no stage fits flat on the GPU alone, so the tree tries sequence and tensor degrees inside the node "
            f"before offloading, the fastest form that fits winning: sp={sp} keeps {pick.training.seq_len // sp} of "
            f"each sequence's {pick.training.seq_len} tokens on a GPU ({split}) at the cost of four all-to-alls of "
            f"its tokens per block each way on {pick.scenario.cluster.intra_link.name}, with "
            f"{pick.scenario.cluster.world // sp} replicas reading data (zerokit: sequence_parallel_size={sp})")


def _expert_reason(p: Plan) -> str:
    """Why an expert degree (See [Note: an expert degree in the tree])."""
    pick = p.pick
    ep, arch = pick.scenario.layout.ep, pick.scenario.model.architecture
    flat = next((a for a in p.attempts if a.stage == pick.stage and a.scenario.layout == Layout()
                 and a.offload == pick.offload and a.training == pick.training), None)
    buffers = (f", buffers {gb(flat.memory.buffers)} -> {gb(pick.memory.buffers)}"
               if flat and gb(flat.memory.buffers) != gb(pick.memory.buffers) else "")
    split = (f"parameters {gb(flat.memory.parameters)} -> {gb(pick.memory.parameters)}, model states "
             f"{gb(flat.memory.model_states)} -> {gb(pick.memory.model_states)}{buffers} per GPU against the flat form"
             if flat else "the experts / ep")
    exchange = next((c for c in pick.comm.collectives if c.kind == "all_to_all" and c.group == "ep"), None)
    cost = (f"{exchange.calls} all-to-alls per step (dispatch and combine, forward and backward, per MoE layer) of "
            f"{gb(exchange.bytes)} routed tokens, {gb(exchange.wire_bytes)} leaving each GPU over {exchange.link} in "
            f"{exchange.seconds:.3f} s on the compute path" if exchange else "no all-to-all")
    where = ("no flat stage fits with nothing offloaded, so the tree tries expert degrees inside the node" if not
             pick.offload.any else f"flat ZeRO-{pick.stage} does not fit beside {pick.offload.name}, and its rung "
             "holds the expert degrees inside the node")
    group = pick.scenario.shard // ep
    ranks = f"{group} rank{'s' * (group > 1)}"
    return (f"{where}: ep={ep} keeps {arch.experts.count // ep} of each MoE layer's {arch.experts.count} experts on a "
            f"GPU ({split}), ZeRO sharding them over their expert-data group of {ranks} and the rest over all "
            f"{pick.scenario.shard}; it costs {cost} (zerokit: expert_parallel_size={ep})")


def _crossing(result: Estimate) -> str:
    return (f"{result.label.split(',')[0]}: {gb(result.comm.cross_node_bytes)} across nodes per GPU per step, "
            f"{result.exposed_comm_seconds:.2f} s of communication exposed, step {result.step_seconds:.2f} s")


def _hybrid_reasons(p: Plan) -> list[str]:
    """Why the pick's form (flat, MiCS, hpZ) beat the others on its rung (See [Note: hybrid sharding in the
    tree]), or what kept a hybrid form off it."""
    pick = p.pick
    rung = [a for a in p.attempts if a.stage == pick.stage and a.offload == pick.offload
            and a.training.checkpointing == pick.training.checkpointing and a is not pick
            and a.scenario.layout.tp == pick.scenario.layout.tp]
    if not rung:
        return []
    out = [f"fastest of the forms of ZeRO-{pick.stage} that fit: {_crossing(pick)}"]
    out += [f"beside it {_crossing(r)}" for r in p.rivals]
    out += [f"{r.label.split(',')[0]} does not fit: {gb(r.memory.total)} per GPU over {gb(r.usable)} usable"
            for r in rung if not r.fits]
    return out


def stage3_gpus_needed(result: Estimate) -> int:
    """GPUs in the shard group for model states alone to leave room for the rest (rough)."""
    rest = result.memory.activations + result.memory.buffers + result.memory.overhead
    room = result.usable - rest
    states = result.memory.model_states * result.scenario.shard
    return math.ceil(states / room) if room > 0 else 0


def _no_fit_reasons(p: Plan) -> list[str]:
    closest = min(p.attempts, key=lambda a: a.memory.total)
    out = [f"nothing fits: the closest is {_failure(closest, p.policy)}"]
    needed = stage3_gpus_needed(closest)
    if needed:
        out.append(f"ZeRO-3 would need about {needed} GPUs in the shard group for this micro-batch")
    else:
        out.append("activations and buffers alone exceed the GPU: shorten the sequence or add tensor parallelism")
    return out


def notes(p: Plan) -> list[str]:
    scenario, out = p.scenario, []
    arch = scenario.model.architecture
    if arch is None:
        out.append("only a parameter count was given: activations and the stage-3 gather unit are not modelled "
                   "(give a preset, --arch or a config.json)")
    elif scenario.model.context and scenario.training.seq_len > scenario.model.context:
        out.append(f"seq len {scenario.training.seq_len} is beyond the model's trained context "
                   f"{scenario.model.context}")
    if scenario.training.attention == "eager" and arch is not None:
        out.append("eager attention stores the a x s x s softmax per block; fused (flash/SDPA) attention does not")
    if p.pick is not None and p.pick.compute.bubble > 0:
        out.append(f"pipeline bubble {p.pick.compute.bubble:.0%} of each step with {scenario.training.grad_accum} "
                   "micro-batches; raise gradient accumulation to shrink it")
    if p.pick is not None and p.pick.training.micro_batch != scenario.training.micro_batch:
        out.append(f"the requested micro-batch {scenario.training.micro_batch} fits nowhere; planned with "
                   f"{p.pick.training.micro_batch}")
    return out
