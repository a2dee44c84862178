"""`deepspeed.moe` for zerokit: DeepSpeed's MoE layer (layer.py) over zerokit's expert room
(zerokit/parallel/experts), and the parameter-group helpers its scripts call (utils.py). Imported by submodule, as
DeepSpeed's scripts do (`from deepspeed.moe.layer import MoE`); this face imports nothing."""
