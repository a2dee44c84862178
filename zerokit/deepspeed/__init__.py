"""DeepSpeed's training API on zerokit: a DeepSpeed script switches by changing its import lines only.

    import zerokit.deepspeed as deepspeed                  # was: import deepspeed
    import zerokit.deepspeed.comm as dist                  # was: import deepspeed.comm as dist
    from zerokit.deepspeed.accelerator import get_accelerator

    parser = deepspeed.add_config_arguments(argparse.ArgumentParser())
    engine, optimizer, loader, scheduler = deepspeed.initialize(args=parser.parse_args(), model=model,
                                                                model_parameters=model.parameters(),
                                                                training_data=dataset)

Launch with torchrun (the deepspeed launcher is out of scope). For frameworks that import deepspeed themselves
(Hugging Face Trainer, accelerate, Lightning), install() (aliases.py) makes `import deepspeed` resolve here.
What each module covers: start.py (initialize,
add_config_arguments), distributed.py (init_distributed), engine.py (the engine's DeepSpeed methods), comm.py,
accelerator.py, zero.py (Init, GatheredParameters), utils.py, ops/adam.py, autotp.py (tp_model_init: AutoTP
training, split by zerokit/parallel/tensor), pipe.py (PipelineModule: pipeline parallelism at ZeRO 0-3). MoE layers, the
inference engine and DeepSpeed's kernels are refused in one line naming them.
"""

from zerokit.deepspeed import checkpointing, comm, zero
from zerokit.deepspeed.accelerator import get_accelerator
from zerokit.deepspeed.aliases import distribution_version, install
from zerokit.deepspeed.autotp import tp_model_init
from zerokit.deepspeed.distributed import init_distributed
from zerokit.deepspeed.engine import DeepSpeedEngine
from zerokit.deepspeed.start import add_config_arguments, initialize
from zerokit.deepspeed.utils import log_dist, logger

# Imported with the package, as `import deepspeed` imports them: frameworks read deepspeed.runtime.* and
# deepspeed.ops.* as attributes after `import deepspeed` alone.
from zerokit.deepspeed import checkpoint, ops, runtime, utils  # noqa: E402,F401

__version__ = distribution_version()  # DeepSpeed's version with zerokit's as its local part (frameworks read it)

OUT_OF_SCOPE = {
    "init_inference": "DeepSpeed's inference engine (generate inside engine.unsharded() instead)",
    "InferenceEngine": "DeepSpeed's inference engine",
    "DeepSpeedHybridEngine": "DeepSpeed's RLHF hybrid engine",
    "DeepSpeedTransformerLayer": "DeepSpeed's fused transformer kernels",
    "DeepSpeedTransformerConfig": "DeepSpeed's fused transformer kernels",
    "launcher": "the deepspeed launcher (launch with torchrun)",
}


def __getattr__(name: str):
    if name == "moe":  # deepspeed.moe, as scripts reach it after `import deepspeed`; imported on first use
        import zerokit.deepspeed.moe as moe
        return moe
    if name in ("PipelineModule", "pipe"):  # deepspeed.PipelineModule, as DeepSpeed exports it; imported on first use
        import zerokit.deepspeed.pipe as pipe
        return pipe if name == "pipe" else pipe.PipelineModule
    if name in OUT_OF_SCOPE:
        raise ImportError(f"deepspeed.{name} is not offered by zerokit: {OUT_OF_SCOPE[name]} is out of scope")
    raise AttributeError(f"module 'zerokit.deepspeed' has no attribute {name!r}")


__all__ = ["install", "initialize", "add_config_arguments", "init_distributed", "DeepSpeedEngine", "comm", "zero",
           "tp_model_init",
           "checkpointing",
           "get_accelerator", "log_dist", "logger"]
