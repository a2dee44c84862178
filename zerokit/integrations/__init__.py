"""zerokit inside training frameworks that are not DeepSpeed-shaped: each module here is one framework's plug-in,
importable only where that framework is installed (its extra: see zerokit/_support/extras.py).

    lightning.py   ZerokitStrategy for Lightning's Trainer ("zerokit_stage_1" .. "zerokit_stage_3")
    hf_trainer.py  the Hugging Face Trainer's save_model at stage 3, streamed (wrapped by deepspeed.initialize)
    accelerate_cp.py  accelerate's context parallelism (cp_size) as zerokit's Ulysses (hooked by deepspeed.install())

Hugging Face's Trainer and accelerate reach zerokit through zerokit.deepspeed.install() instead: they call
DeepSpeed by name.
"""
