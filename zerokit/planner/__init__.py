"""The planner: which ZeRO stage, will it fit, how long communication takes, and why.

Pure Python (no torch, no process group). `plan()` runs the decision procedure, `estimate()`
prices one configuration; both take a `Scenario` or `make_scenario()`'s keyword arguments:

    from zerokit.planner import plan
    p = plan(model="llama2-13b", gpu="a100-80gb", gpus_per_node=8, seq_len=4096)
    p.pick.label, p.pick.memory.as_dict(), p.reasons

Memory uses the engine's categories (`engine.memory_stats()`), communication its collective
kinds and units (`engine.comm_stats()`). The accounting is written down in docs/planner.md.
"""

from zerokit.planner.advice import Plan, plan
from zerokit.planner.catalogue import GPUS, HOSTS, LINKS, Cluster, make_cluster
from zerokit.planner.comms import CommEstimate
from zerokit.planner.emit import emit
from zerokit.planner.estimate import Estimate, Scenario, estimate, make_scenario
from zerokit.planner.memo import render_memo
from zerokit.planner.memory import MemoryBreakdown
from zerokit.planner.models import PRESETS, Architecture, ModelSpec, from_hf_config
from zerokit.planner.report import estimate_dict, plan_dict
from zerokit.planner.spec import Assumptions, Layout, Offload, Policy, Trainable, Training
from zerokit.planner.translate import deepspeed_to_fsdp, deepspeed_to_zerokit, fsdp_to_deepspeed, zerokit_to_deepspeed

__all__ = ["Architecture", "Assumptions", "Cluster", "CommEstimate", "Estimate", "GPUS", "HOSTS", "LINKS", "Layout",
           "MemoryBreakdown", "ModelSpec", "Offload", "PRESETS", "Plan", "Policy", "Scenario", "Trainable", "Training",
           "deepspeed_to_fsdp", "deepspeed_to_zerokit", "emit", "estimate", "estimate_dict", "from_hf_config",
           "fsdp_to_deepspeed", "make_cluster", "make_scenario", "plan", "plan_dict", "render_memo",
           "zerokit_to_deepspeed"]
