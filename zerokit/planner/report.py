"""Plans and estimates as plain dicts for `--json`: bytes, seconds and counts, no rounding."""

from __future__ import annotations

from dataclasses import asdict

from zerokit.planner.advice import Plan
from zerokit.planner.estimate import Estimate


def estimate_dict(result: Estimate) -> dict:
    s = result.scenario
    return {
        "label": result.label, "stage": result.stage, "offload": asdict(result.offload),
        "checkpointing": result.training.checkpointing, "micro_batch": result.training.micro_batch,
        "layout": asdict(s.layout) | {"dp_shard": s.shard},
        "fits": result.fits, "fits_gpu": result.fits_gpu, "capacity_bytes": result.capacity,
        "usable_bytes": result.usable, "memory_bytes": result.memory.as_dict(), "total_bytes": result.memory.total,
        "host": {"ram_bytes": result.host.ram, "nvme_bytes": result.host.nvme, "ram_capacity": result.host.ram_capacity,
                 "nvme_capacity": result.host.nvme_capacity, "fits": result.host.fits},
        "comm_stats_per_step": result.comm.by_kind(), "cross_node_bytes_per_step": result.comm.cross_node_bytes,
        "collectives": [asdict(c) for c in result.comm.collectives],
        "seconds": {"compute": result.compute.seconds, "communication": result.comm.seconds,
                    "exposed_communication": result.exposed_comm_seconds,
                    "gpu_optimizer": result.compute.optimizer_seconds,
                    "offload_exposed": result.offload_time.exposed_seconds, "step": result.step_seconds},
        "offload_traffic": asdict(result.offload_time),
        "flops_per_token": result.compute.flops_per_token, "tokens_per_second": result.tokens_per_second,
    }


def plan_dict(plan: Plan) -> dict:
    s = plan.scenario
    return {
        "model": {"name": s.model.name, "total_params": s.counts.total, "trainable_params": s.counts.trainable,
                  "source": s.model.source},
        "cluster": {"gpu": s.cluster.gpu.key, "gpus_per_node": s.cluster.gpus_per_node, "nodes": s.cluster.nodes,
                    "intra_link": s.cluster.intra_link.key, "inter_link": s.cluster.inter_link.key,
                    "host": s.cluster.host.key},
        "training": asdict(s.training), "assumptions": asdict(s.assumptions), "policy": asdict(plan.policy),
        "pick": estimate_dict(plan.pick) if plan.pick else None,
        "max_micro_batch": plan.max_micro_batch,
        "reasons": list(plan.reasons), "notes": list(plan.notes),
        "stages": [estimate_dict(e) for e in plan.stages],
        "attempts": [{"label": a.label, "micro_batch": a.training.micro_batch, "total_bytes": a.memory.total,
                      "fits": a.fits} for a in plan.attempts],
        "runner_up": estimate_dict(plan.runner_up) if plan.runner_up else None,
        "rivals": [estimate_dict(r) for r in plan.rivals],
        "alternatives": [estimate_dict(a) for a in plan.alternatives],
    }
