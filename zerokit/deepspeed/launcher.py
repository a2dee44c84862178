"""The `deepspeed` launcher is out of scope: launch with torchrun."""

raise ImportError("the deepspeed launcher is not offered by zerokit: launch the same script with "
                  "`torchrun --nproc_per_node N train.py --deepspeed_config ds_config.json`")
