"""`deepspeed.ops` for zerokit: the optimizers scripts import from it (ops.adam), as torch optimizers."""
