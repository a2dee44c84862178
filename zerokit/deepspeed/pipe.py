"""`deepspeed.pipe` is out of scope: zerokit is data parallel only."""

raise ImportError("deepspeed.pipe (PipelineModule, pipeline parallelism) is not offered by zerokit, which is data "
                  "parallel only: combine it with torch's own pipeline parallelism in model code")
