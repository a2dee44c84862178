"""Mixture-of-experts layers with expert parallelism: each rank of an expert group of `ep` ranks holds
num_experts / ep experts, and every token travels to the rank that holds its expert and back (issue 45, item 2).
The gate reproduces DeepSpeed's (deepspeed.moe, 0.19.8) so that a DeepSpeed MoE script trains the same.

- gate.py: DeepSpeed's top-1, top-2 and top-k gating (capacity, dropped tokens, the auxiliary loss, its noise), as
  functions from the gate's logits to each token's routes.
- dispatch.py: the exchanges that carry tokens to their experts' ranks and back, as autograd functions (a
  capacity-shaped buffer when tokens may be dropped, variable counts when none are), and the slot buffer's packing.
- groups.py: the process group of a rank's experts, made from the job's mesh (DeepSpeed's order).
- layer.py: ExpertParallelMoE, the layer a model holds in place of deepspeed.moe.layer.MoE.

    group = expert_parallel_group(ep=2)          # zerokit.parallel.experts.groups
    moe = ExpertParallelMoE(hidden, expert, num_experts=8, group=group, k=2)
    output, l_aux, exp_counts = moe(hidden_states)

Imported by submodule (from zerokit.parallel.experts.layer import ExpertParallelMoE); this face imports nothing.
"""
