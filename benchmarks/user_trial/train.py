# A user's DeepSpeed script, written from docs/reliability.md ("Resume without bookkeeping") alone: it saves every
# few steps and loads nothing itself; the config's resume block brings it back after a torchrun restart.
# TRY_KILL="rank:step" makes that rank SIGKILL itself after that step in the first attempt (the test harness's doing).
import json, os, signal, sys
import torch
from torch import nn
import zerokit.deepspeed as deepspeed          # was: import deepspeed

out = sys.argv[1]
torch.manual_seed(0)
features = torch.randn(48, 16)
dataset = torch.utils.data.TensorDataset(features, features.sum(1, keepdim=True).sin(), torch.arange(48))
model = nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 1))
config = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2,
          "optimizer": {"type": "AdamW", "params": {"lr": 3e-3}},
          "zero_optimization": {"stage": 2}, "resume": {"load_dir": f"{out}/ckpt"}}
engine, _, loader, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), training_data=dataset,
                                            config=config)
kill_rank, kill_step = (int(v) for v in os.environ.get("TRY_KILL", "-1:-1").split(":"))
first_attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
total_steps, seen = 15, []
while engine.global_steps < total_steps:
    for x, y, index in loader:
        seen += index.tolist()
        loss = nn.functional.mse_loss(engine(x), y)
        engine.backward(loss)
        engine.step()
        if engine.was_step_applied() and engine.global_steps % 4 == 0:
            engine.save_checkpoint(f"{out}/ckpt")
        if first_attempt and engine.rank == kill_rank and engine.global_steps == kill_step and engine.was_step_applied():
            os.kill(os.getpid(), signal.SIGKILL)
        if engine.global_steps == total_steps:
            break
    loader.data_sampler.set_epoch(loader.data_sampler.epoch + 1)
attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
weights = [p.detach().clone() for p in engine.module.parameters()]
with open(f"{out}/rank{engine.rank}_attempt{attempt}.json", "w") as f:
    json.dump({"seen": seen, "weights": [w.flatten().tolist() for w in weights], "steps": engine.global_steps}, f)
