"""`deepspeed.moe` is out of scope: zerokit trains MoE models written in plain torch, without expert parallelism."""

raise ImportError("deepspeed.moe (MoE layers with expert parallelism) is not offered by zerokit: write the experts "
                  "as plain torch modules, which zerokit shards like any other (tokens are not routed across ranks)")
