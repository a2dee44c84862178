"""The memo: a markdown page that answers the question and justifies the pick from the numbers."""

from __future__ import annotations

import json

from zerokit.planner.advice import Plan, gb, hybrid_comparison, micro_batch_limit
from zerokit.planner.emit import emit_zerokit
from zerokit.planner.estimate import Estimate
from zerokit.planner.expert_degree import expert_section
from zerokit.planner.memory import (
    MUON_COMPANION,
    OPTIMIZER_STATE_BYTES,
    RankParams,
    block_activation_bytes,
    gradients_on_host,
    gradients_sharded,
    optimizer_state_bytes,
    output_activation_bytes,
    secondary_bytes,
    whole_tensor_fraction,
)
from zerokit.planner.peers import deepspeed_largest_layer, peer_estimates
from zerokit.planner.spec import GB, Training
from zerokit.planner.tensor_degree import tensor_section

STAGE_COLUMNS = ("stage", "fits", "parameters", "gradients", "optimizer state", "activations", "buffers",
                 "overhead", "total GB", "comm s", "exposed s", "compute s", "step s")


def _table(header: tuple[str, ...], rows: list[list[str]]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    return lines + ["| " + " | ".join(row) + " |" for row in rows]


def _g(n: float) -> str:
    return f"{n / GB:.2f}"


def stage_row(result: Estimate) -> list[str]:
    m = result.memory
    fits = "yes" if result.fits else ("GPU yes, host no" if result.fits_gpu else "no")
    return [f"ZeRO-{result.stage}" + (f" ({result.offload.name})" if result.offload.any else ""), fits,
            _g(m.parameters), _g(m.gradients), _g(m.optimizer_state), _g(m.activations), _g(m.buffers),
            _g(m.overhead), _g(m.total), f"{result.comm.seconds:.3f}", f"{result.exposed_comm_seconds:.3f}",
            f"{result.compute.seconds:.3f}", f"{result.step_seconds:.3f}"]


def question(p: Plan) -> str:
    s, t = p.scenario, p.scenario.training
    counts = s.counts
    trainable = "" if t.trainable.is_full else f", {counts.trainable / 1e9:.3g}B trainable"
    layout = "" if s.layout.name == "flat data parallel" else f", layout {s.layout.name}"
    return (f"Train {s.model.name} ({counts.total / 1e9:.3g}B parameters{trainable}) on {s.cluster.name}"
            f"{layout}, {t.precision} {t.optimizer}, sequence {t.seq_len}, micro-batch {t.micro_batch}, "
            f"gradient accumulation {t.grad_accum}: which ZeRO stage, will it fit, how long will communication "
            "take, and why?")


def answer(p: Plan) -> str:
    if p.pick is None:
        return "Nothing fits. " + p.reasons[0][0].upper() + p.reasons[0][1:] + "."
    pick = p.pick
    ckpt = "full activation checkpointing" if pick.training.checkpointing == "full" else "no activation checkpointing"
    return (f"**{pick.mode}, {pick.offload.name}, {ckpt}, micro-batch {pick.training.micro_batch}** "
            f"(largest that fits: {micro_batch_limit(p)}): {gb(pick.memory.total)} of the {gb(pick.usable)} usable "
            f"per GPU; communication {pick.comm.seconds:.2f} s per step against {pick.compute.seconds:.2f} s of "
            f"compute ({pick.exposed_comm_seconds:.2f} s exposed); predicted step {pick.step_seconds:.2f} s, "
            f"{pick.tokens_per_second:,.0f} tokens/s.")


def _state_arithmetic(rank: RankParams, t: Training) -> str:
    """K x trainable; Muon's blocks and AdamW's rest apart (See [Note: whole-tensor optimizers])."""
    k = optimizer_state_bytes(t)
    if t.optimizer != "muon":
        return f"K={k} B x {rank.trainable:,}"
    muon = round(rank.trainable * whole_tensor_fraction(rank, t))
    companion = OPTIMIZER_STATE_BYTES[(MUON_COMPANION, t.mixed)]
    return f"(K={k} B (Muon) x {muon:,} + K={companion} B (AdamW) x {rank.trainable - muon:,})"


def category_rows(result: Estimate) -> list[list[str]]:
    """Each category with the arithmetic that produced it."""
    s, t, m = result.scenario, result.training, result.memory
    rank, stage, n = s.rank, result.stage, s.shard
    by = f" / {n} ranks"
    params = ("0 (on the host)" if result.offload.params != "none"
              else f"{t.param_bytes} B x {rank.total:,}" + (by if stage == 3 else ""))
    secondary = secondary_bytes(rank, t, s.layout, stage)
    if secondary:
        params += f" + hpZ's secondary shard {_g(secondary)} (/ {s.layout.secondary} ranks)"
    sharded = gradients_sharded(stage, t)
    grads = ("0 (each reduced shard goes to the host)" if gradients_on_host(stage, t, result.offload)
             else f"{t.reduce_bytes} B ({t.reduce_dtype}) x {rank.trainable:,}{by}" if sharded
             else f"{t.grad_bytes} B x {rank.trainable:,}" + (f" + reduced shards {t.reduce_bytes} B x "
                                                              f"{rank.trainable:,}{by}" if stage == 2 else ""))
    optim = ("0 (on the host)" if result.offload.optimizer != "none"
             else _state_arithmetic(rank, t) + (by if stage >= 1 else ""))
    if rank.ep > 1:  # two parts, each over its own group: say how they split (See [Note: the expert degree])
        split = (f"; of these {rank.total - rank.experts:,} dense over {n} ranks and {rank.experts:,} of experts "
                 f"(E / {rank.ep}) over {n // rank.ep}")
        params, grads, optim = (how if how.startswith("0 (") else how + split for how in (params, grads, optim))
    return [["parameters", _g(m.parameters), params], ["gradients", _g(m.gradients), grads],
            ["optimizer_state", _g(m.optimizer_state), optim],
            ["activations", _g(m.activations), activation_how(result)],
            ["buffers", _g(m.buffers), buffer_how(result)],
            ["overhead", _g(m.overhead), "allowance for CUDA context, NCCL and workspaces (assumed)"
             + (", plus the backward's measured transient peak" if s.calibration is not None else "")],
            ["**total**", f"**{_g(m.total)}**", f"of {_g(result.usable)} usable ({_g(result.capacity)} capacity)"]]


def activation_how(result: Estimate) -> str:
    arch, t, calibration = result.scenario.model.architecture, result.training, result.scenario.calibration
    if arch is None:
        return "not modelled (parameter count only)"
    if calibration is not None:
        b, s = t.micro_batch, t.seq_len
        return (f"{arch.n_layers} blocks x {_g(calibration.block(b, s))} + outside the blocks "
                f"{_g(calibration.outside(b, s))}, measured on {calibration.model} ({calibration.device}, "
                f"{calibration.precision}) and extrapolated (calibration.py)")
    block = block_activation_bytes(arch, t)
    output = output_activation_bytes(arch, t)
    if t.checkpointing == "full":
        stored = t.act_bytes * t.tokens_per_micro_batch * arch.hidden
        return (f"{arch.n_layers} stored block inputs x {_g(stored)} + one recomputed block {_g(block)} "
                f"+ head and fp32 logits {_g(output)}")
    return f"{arch.n_layers} blocks x {_g(block)} + head and fp32 logits {_g(output)}"


def buffer_how(result: Estimate) -> str:
    t, rank = result.training, result.scenario.rank
    if result.stage == 3:
        return (f"root unit {rank.root:,} + two blocks of {rank.unit:,} params gathered ({t.param_bytes} B); "
                f"root and up to 3 blocks of gradients staged ({t.reduce_bytes} B)")
    return f"gradient buckets of {t.bucket_bytes / 2**20:.0f} MiB ({t.reduce_dtype}), up to 3 in flight"


def comm_rows(result: Estimate) -> list[list[str]]:
    return [[c.kind, f"{c.group} ({c.group_size})", c.link, c.phase, f"{c.calls:,}", f"{c.elements:,}",
             _g(c.bytes), _g(c.wire_bytes), f"{c.seconds:.3f}"] for c in result.comm.collectives]


def _pick_sections(p: Plan) -> list[str]:
    pick = p.pick
    out = ["", "## The pick, by category (bytes per GPU)", ""]
    out += _table(("category", "GB", "how"), category_rows(pick))
    out += ["", "## Communication per optimizer step", ""]
    out += _table(("collective", "group (size)", "link", "phase", "calls", "elements", "GB (logical)",
                   "GB sent per GPU", "seconds"), comm_rows(pick))
    stats = json.dumps(pick.comm.by_kind())
    c = pick.compute
    out += ["", f"`engine.comm_stats()` should grow by this much per optimizer step: `{stats}`.", "",
            f"Compute: {c.flops_per_token / 1e9:.1f} GFLOP per token, {c.flops / 1e12:.1f} TFLOP per GPU per step at "
            f"{p.scenario.assumptions.mfu:.0%} of "
            f"{pick.scenario.cluster.peak_flops(pick.training.precision) / 1e12:.0f} "
            f"TFLOPS = {c.seconds:.3f} s; optimizer step on the GPU {c.optimizer_seconds:.3f} s. Communication "
            f"{pick.comm.seconds:.3f} s, of which {pick.exposed_comm_seconds:.3f} s cannot hide behind compute."]
    if pick.offload.any:
        o, h = pick.offload_time, pick.host
        out += ["", "## Offload", "",
                f"- stays on the GPU: {gb(pick.memory.total)} (see the table above)",
                f"- host RAM per node: {gb(h.ram)} of {gb(h.ram_capacity)} ({gb(h.usable_ram)} usable)",
                f"- NVMe per node: {gb(h.nvme)} of {gb(h.nvme_capacity)}",
                f"- PCIe per GPU per step: {gb(o.pcie_down)} down, {gb(o.pcie_up)} up, {o.pcie_seconds:.3f} s",
                f"- NVMe per node per step: {gb(o.nvme_read)} read, {gb(o.nvme_write)} written, {o.nvme_seconds:.3f} s",
                f"- CPU optimizer step: {o.cpu_optimizer_seconds:.3f} s; offload adds {o.exposed_seconds:.3f} s "
                "per step"]
    return out


def _attempt_rows(p: Plan) -> list[list[str]]:
    return [[str(i + 1), a.label, f"mb {a.training.micro_batch}", _g(a.memory.total), _g(a.usable),
             _g(a.host.ram), "yes" if a.fits else "no"] for i, a in enumerate(p.attempts)]


def _alternative_rows(p: Plan) -> list[list[str]]:
    return [[a.scenario.layout.name, a.label, "yes" if a.fits else "no", _g(a.memory.total), _g(a.comm.wire_bytes),
             f"{a.comm.seconds:.3f}", f"{a.step_seconds:.3f}", f"{a.tokens_per_second:,.0f}"] for a in p.alternatives]


def hybrid_section(p: Plan) -> list[str]:
    """Multi-node: flat ZeRO-3, MiCS and hpZ side by side on this inter-node link and the other kind, with the
    bytes each sends across nodes and how much of its communication the compute cannot hide."""
    compared = hybrid_comparison(p)
    if not compared:
        return []
    pick = p.pick
    ckpt = "full" if pick.training.checkpointing == "full" else "no"
    rows, picks = [], []
    for link, planned, forms in compared:
        rows += [[link, f.mode, "yes" if f.fits else "no", _g(f.memory.total), _g(f.comm.cross_node_bytes),
                  f"{f.comm.seconds:.3f}", f"{f.exposed_comm_seconds:.3f}", f"{f.step_seconds:.3f}"] for f in forms]
        chosen = planned.pick
        picks.append(f"- the tree's pick on {link}: " + (f"{chosen.label}, micro-batch {chosen.training.micro_batch}, "
                                                        f"{gb(chosen.comm.cross_node_bytes)} across nodes, step "
                                                        f"{chosen.step_seconds:.3f} s" if chosen else "nothing fits"))
    out = ["", "## Across nodes: flat ZeRO-3, MiCS and hpZ", "",
           f"ZeRO-3 at micro-batch {pick.training.micro_batch}, {ckpt} activation checkpointing. \"across\": GB a GPU "
           "sends to other nodes per optimizer step (the average over ranks; See [Note: cross-node bytes per step] "
           "in planner/comms.py); \"exposed\": communication seconds the compute does not hide.", ""]
    out += _table(("inter-node link", "configuration", "fits", "GPU GB", "across GB", "comm s", "exposed s",
                   "step s"), rows)
    return out + [""] + picks


def _peer_rows(p: Plan) -> list[list[str]]:
    s = p.scenario
    arch = s.model.architecture
    largest = deepspeed_largest_layer(arch) if arch else 0
    ours = {2: next((e for e in p.stages if e.stage == 2), None), 3: next((e for e in p.stages if e.stage == 3), None)}
    rows = []
    for peer in peer_estimates(s.counts.total, largest, s.cluster.gpus_per_node, s.cluster.nodes, s.training.precision):
        stage = 2 if "zero2" in peer.tool else 3 if "zero3" in peer.tool else None
        mine = ours.get(stage) if peer.options in ("offload_optimizer=none", "no offload") else None
        rows.append([peer.tool, peer.options, _g(peer.gpu_bytes),
                     "-" if peer.host_bytes is None else _g(peer.host_bytes),
                     peer.formula, _g(mine.memory.model_states) if mine else "-"])
    return rows


def _assumptions(p: Plan) -> list[str]:
    s, a = p.scenario, p.scenario.assumptions
    c = s.cluster
    return [f"- GPU {c.gpu.name}: {c.gpu.source}", f"- intra-node link {c.intra_link.name}: {c.intra_link.source}",
            f"- inter-node link {c.inter_link.name} x {c.nics_per_node} per node: {c.inter_link.source}",
            f"- PCIe {c.pcie.name}: {c.pcie.source}", f"- host {c.host.name}: {c.host.source}",
            f"- model {s.model.name}: {s.model.source}",
            f"- MFU {a.mfu:.0%}, bandwidth efficiency {a.bandwidth_efficiency:.0%}, overhead allowance "
            f"{gb(a.overhead_bytes)} per GPU, headroom {p.policy.headroom:.0%} (all assumptions; override on the CLI)",
            f"- bytes per trainable parameter: {s.training.param_bytes} parameter + {s.training.grad_bytes} gradient "
            f"({s.training.reduce_bytes} once reduced and sharded, {s.training.reduce_dtype}) + "
            f"K={optimizer_state_bytes(s.training)} optimizer state ({s.training.optimizer}, {s.training.precision})",
            "- activations: Korthikanti et al. 2022 term-by-term count; compute: PaLM 6N + 12LHQT; communication: "
            "ring alpha-beta model (docs/planner.md)"]


def render_memo(p: Plan) -> str:
    out = ["# ZeRO plan: " + p.scenario.model.name + " on " + p.scenario.cluster.name, "",
           "**Question.** " + question(p), "", "**Answer.** " + answer(p), "", "## Why", ""]
    out += [f"- {reason}" for reason in p.reasons] + [f"- note: {note}" for note in p.notes]
    ckpt = p.stages[0].training.checkpointing if p.stages else "none"
    out += ["", f"## Every stage (no offload, {'full' if ckpt == 'full' else 'no'} activation checkpointing, "
                f"micro-batch {p.stages[0].training.micro_batch}; GB per GPU)", ""]
    out += _table(STAGE_COLUMNS, [stage_row(e) for e in p.stages])
    if p.pick is not None:
        out += _pick_sections(p)
    out += ["", "## Decision path", "", "See the tree in docs/planner.md; every configuration tried, in order:", ""]
    out += _table(("#", "configuration", "batch", "GPU GB", "usable GB", "host RAM GB", "fits"), _attempt_rows(p))
    out += hybrid_section(p)
    out += expert_section(p)
    out += tensor_section(p)
    if p.alternatives:
        out += ["", "## Hybrid layouts on paper", ""]
        out += _table(("layout", "configuration", "fits", "GPU GB", "GB sent per GPU", "comm s", "step s", "tokens/s"),
                      _alternative_rows(p))
    out += ["", "## How other estimators answer (model states only)", ""]
    out += _table(("tool", "options", "GPU GB", "host GB", "formula", "ours (model states)"), _peer_rows(p))
    out += ["", "They leave out activations, buffers and the CUDA context. DeepSpeed counts 18 bytes per sharded "
                "parameter (16-bit and fp32 gradient partitions; ours: reduce dtype + K), 4 bytes x its largest "
                "module at stage 3, and multiplies host memory by 1.5; accelerate reports the largest component, "
                "not the sum, on one device. See docs/planner.md.", "", "## Assumptions and sources", ""]
    out += _assumptions(p)
    if p.pick is not None:
        config = emit_zerokit(p.pick)
        out += ["", "## Config (zerokit, DeepSpeed-style keys)", "", "```json", json.dumps(config, indent=2), "```"]
    return "\n".join(out) + "\n"

