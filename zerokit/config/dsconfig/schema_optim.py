"""The `optimizer` and `scheduler` blocks: the types zerokit builds and each type's parameters.

Defaults are DeepSpeed 0.19.8's: FusedAdam's for Adam/AdamW (lr 1e-3, weight decay 0, where torch's AdamW
would decay by 0.01), torch's for SGD and Adagrad (DeepSpeed passes them through), MuonWithAuxAdam's for the
two halves of Muon, and each schedule class's own (deepspeed/runtime/lr_schedules.py).
"""

from __future__ import annotations

from zerokit.config.dsconfig.keys import Key, Kind, always, honoured, refused

OPTIMIZER_TYPES = ("Adam", "AdamW", "SGD", "Adagrad", "Muon")
SCHEDULER_TYPES = ("WarmupLR", "WarmupDecayLR", "WarmupCosineLR", "OneCycle", "LRRangeTest")
TORCH_INSTEAD = "pass a torch optimizer to initialize() instead"
REFUSED_OPTIMIZERS = {
    "Lamb": f"DeepSpeed's FusedLamb CUDA kernel; {TORCH_INSTEAD}",
    "Lion": f"DeepSpeed's fused Lion kernels; {TORCH_INSTEAD}",
    "OneBitAdam": "1-bit Adam's compressed communication, which DeepSpeed 0.19.8 removed and zerokit does not offer",
    "OneBitLamb": "1-bit LAMB's compressed communication, which DeepSpeed 0.19.8 removed and zerokit does not offer",
    "ZeroOneAdam": "0/1 Adam's compressed communication, which DeepSpeed 0.19.8 removed and zerokit does not offer",
    "MuAdam": f"the mup package's optimizers; {TORCH_INSTEAD}",
    "MuAdamW": f"the mup package's optimizers; {TORCH_INSTEAD}",
    "MuSGD": f"the mup package's optimizers; {TORCH_INSTEAD}",
}
OWN_SCHEDULE = "attach a torch LR scheduler to engine.optimizer instead"
P = "optimizer.params."
TORCH_FLAGS = "torch's own flag, passed through"


def _torch_flags(*names: str) -> tuple[Key, ...]:
    nullable = ("foreach", "fused")
    return tuple(honoured(P + name, Kind.BOOL, None if name in nullable else False, TORCH_FLAGS,
                          nullable=name in nullable) for name in names)


ADAM = (
    honoured(P + "lr", Kind.FLOAT, 1e-3, "learning rate"),
    honoured(P + "betas", Kind.PAIR, (0.9, 0.999), "Adam's (beta1, beta2)"),
    honoured(P + "eps", Kind.FLOAT, 1e-8, "Adam's epsilon"),
    honoured(P + "weight_decay", Kind.FLOAT, 0.0, "decoupled (AdamW) with adam_w_mode, L2 without"),
    honoured(P + "amsgrad", Kind.BOOL, False, "torch's AMSGrad variant"),
    *_torch_flags("foreach", "fused", "maximize", "capturable", "differentiable"),
    always(P + "torch_adam", "zerokit always steps torch's Adam/AdamW", Kind.BOOL, False),
    always(P + "set_grad_none", "zerokit frees gradients after each step", Kind.BOOL, True),
    always(P + "bias_correction", "torch's Adam always corrects bias", Kind.BOOL, True, (True,),
           "torch's Adam has no switch for it"),
    always(P + "fp32_optimizer_states", "zerokit keeps fp32 optimizer states", Kind.BOOL, True, (True,),
           "zerokit keeps fp32 optimizer states"),
    refused(P + "max_grad_norm", "clipping inside the optimizer", "set the top-level gradient_clipping instead, "
            "as DeepSpeed says", Kind.FLOAT, None),
)
ADAM_W_MODE = honoured(P + "adam_w_mode", Kind.BOOL, True, "true: decoupled weight decay (torch.optim.AdamW); "
                       "false: L2 (torch.optim.Adam)")
ADAMW_W_MODE = always(P + "adam_w_mode", "AdamW always decouples weight decay", Kind.BOOL, True, (True,),
                      "AdamW always decouples weight decay; use type Adam with adam_w_mode false for L2")
SGD = (
    honoured(P + "lr", Kind.FLOAT, 1e-3, "learning rate"),
    honoured(P + "momentum", Kind.FLOAT, 0.0, "momentum factor"),
    honoured(P + "dampening", Kind.FLOAT, 0.0, "dampening for momentum"),
    honoured(P + "weight_decay", Kind.FLOAT, 0.0, "L2 penalty"),
    honoured(P + "nesterov", Kind.BOOL, False, "Nesterov momentum"),
    *_torch_flags("maximize", "foreach", "differentiable", "fused"),
)
ADAGRAD = (
    honoured(P + "lr", Kind.FLOAT, 1e-2, "learning rate"),
    honoured(P + "lr_decay", Kind.FLOAT, 0.0, "learning-rate decay"),
    honoured(P + "weight_decay", Kind.FLOAT, 0.0, "L2 penalty"),
    honoured(P + "initial_accumulator_value", Kind.FLOAT, 0.0, "starting sum of squares"),
    honoured(P + "eps", Kind.FLOAT, 1e-10, "epsilon"),
    *_torch_flags("foreach", "maximize", "differentiable", "fused"),
)
MUON = (
    honoured(P + "lr", Kind.FLOAT, None, "both halves' learning rate (absent: 0.02 for Muon, 3e-4 for the AdamW "
             "half, DeepSpeed's MuonWithAuxAdam defaults)"),
    honoured(P + "muon_lr", Kind.FLOAT, None, "learning rate of the Muon half (2-D hidden matrices)"),
    honoured(P + "adam_lr", Kind.FLOAT, None, "learning rate of the AdamW half (everything else)"),
    honoured(P + "momentum", Kind.FLOAT, 0.95, "Muon's momentum"),
    honoured(P + "weight_decay", Kind.FLOAT, 0.0, "decoupled weight decay of both halves"),
    honoured(P + "betas", Kind.PAIR, (0.9, 0.95), "the AdamW half's betas"),
    honoured(P + "eps", Kind.FLOAT, 1e-10, "the AdamW half's epsilon"),
    honoured(P + "adam_w_mode", Kind.BOOL, True, "the non-Muon half: AdamW (true) or Adam (false)"),
    always(P + "torch_adam", "zerokit always steps torch's AdamW for the non-Muon half", Kind.BOOL, False),
    always(P + "ns_method", "torch.optim.Muon runs the standard Newton-Schulz iteration; DeepSpeed's \"gram\" is a "
           "faster route to the same orthogonalisation", Kind.CHOICE, "gram", choices=("gram", "standard")),
    refused(P + "per_head_muon", "orthogonalising each attention head separately", "torch.optim.Muon "
            "orthogonalises whole matrices"),
)
OPTIMIZER_PARAMS: dict[str, dict[str, Key]] = {
    name: {key.name: key for key in table} for name, table in (
        ("Adam", (*ADAM, ADAM_W_MODE)), ("AdamW", (*ADAM, ADAMW_W_MODE)), ("SGD", SGD), ("Adagrad", ADAGRAD),
        ("Muon", MUON))
}

S = "scheduler.params."
LAST = always(S + "last_batch_iteration", "schedules start at step 0; resume one with its state_dict", Kind.INT,
              -1, (-1,), "resume a schedule with its state_dict, not by setting the start step")
WARMUP_TYPE = honoured(S + "warmup_type", Kind.CHOICE, "log", "log or linear warm-up", choices=("log", "linear"))
WARMUP_STEPS = honoured(S + "warmup_num_steps", Kind.INT, 1000, "warm-up steps (at least 2, as DeepSpeed uses)")
TOTAL = honoured(S + "total_num_steps", Kind.INT, None, "total training steps (required)")
WARMUP_LR = (
    honoured(S + "warmup_min_lr", Kind.FLOATS, 0.0, "learning rate at step 0 (one number or one per group)"),
    WARMUP_STEPS, WARMUP_TYPE, LAST,
)
SCHEDULER_PARAMS: dict[str, dict[str, Key]] = {
    name: {key.name: key for key in table} for name, table in (
        ("WarmupLR", (*WARMUP_LR, honoured(S + "warmup_max_lr", Kind.FLOATS, None, "learning rate after warm-up "
                                           "(absent: the optimizer's lr)", nullable=True))),
        ("WarmupDecayLR", (*WARMUP_LR, TOTAL, honoured(S + "warmup_max_lr", Kind.FLOATS, 0.001, "learning rate "
                                                       "after warm-up, then linear decay to 0 at total_num_steps"))),
        ("WarmupCosineLR", (TOTAL, WARMUP_STEPS, WARMUP_TYPE, LAST,
                            honoured(S + "warmup_min_ratio", Kind.FLOAT, 0.0, "share of the optimizer's lr at step 0"),
                            honoured(S + "cos_min_ratio", Kind.FLOAT, 1e-4, "share of the lr at total_num_steps"))),
        ("OneCycle", (
            honoured(S + "cycle_min_lr", Kind.FLOATS, None, "lower learning rate of the cycle (required)"),
            honoured(S + "cycle_max_lr", Kind.FLOATS, None, "upper learning rate of the cycle (required)"),
            honoured(S + "decay_lr_rate", Kind.FLOAT, 0.0, "learning-rate decay after the cycle"),
            honoured(S + "cycle_first_step_size", Kind.INT, 2000, "steps of the rising half"),
            honoured(S + "cycle_second_step_size", Kind.INT, None, "steps of the falling half (absent: the "
                     "first's)", nullable=True),
            honoured(S + "cycle_first_stair_count", Kind.INT, 0, "stairs in the rising half (0: continuous)"),
            honoured(S + "cycle_second_stair_count", Kind.INT, None, "stairs in the falling half (absent: the "
                     "first's)", nullable=True),
            honoured(S + "decay_step_size", Kind.INT, 0, "steps per decay interval after the cycle (0: no decay)"),
            honoured(S + "cycle_momentum", Kind.BOOL, True, "cycle beta1 inversely to the lr (optimizers with betas)"),
            honoured(S + "cycle_min_mom", Kind.FLOATS, 0.8, "lower momentum of the cycle"),
            honoured(S + "cycle_max_mom", Kind.FLOATS, 0.9, "upper momentum of the cycle"),
            honoured(S + "decay_mom_rate", Kind.FLOAT, 0.0, "momentum decay after the cycle"), LAST)),
        ("LRRangeTest", (
            honoured(S + "lr_range_test_min_lr", Kind.FLOATS, 1e-3, "starting learning rate"),
            honoured(S + "lr_range_test_step_size", Kind.INT, 2000, "steps per increase"),
            honoured(S + "lr_range_test_step_rate", Kind.FLOAT, 1.0, "increase per step_size steps"),
            honoured(S + "lr_range_test_staircase", Kind.BOOL, False, "increase in stairs"), LAST)),
    )
}
REQUIRED_PARAMS = {"WarmupDecayLR": ("total_num_steps",), "WarmupCosineLR": ("total_num_steps",),
                   "OneCycle": ("cycle_min_lr", "cycle_max_lr")}


def canonical_type(kind: str, raw: str) -> str:
    """The type's canonical spelling; DeepSpeed matches its own optimizer names case-insensitively."""
    names = OPTIMIZER_TYPES if kind == "optimizer" else SCHEDULER_TYPES
    refused_names = REFUSED_OPTIMIZERS if kind == "optimizer" else {}
    for name in (*names, *refused_names):
        if raw.strip().lower() == name.lower():
            return name
    return raw


def params_table(kind: str, type_name: str) -> dict[str, Key]:
    return (OPTIMIZER_PARAMS if kind == "optimizer" else SCHEDULER_PARAMS)[type_name]


def default_of(kind: str, type_name: str, name: str):
    return params_table(kind, type_name)[name].default


__all__ = ["OPTIMIZER_TYPES", "SCHEDULER_TYPES", "REFUSED_OPTIMIZERS", "OWN_SCHEDULE", "OPTIMIZER_PARAMS",
           "SCHEDULER_PARAMS", "REQUIRED_PARAMS", "canonical_type", "params_table", "default_of"]
