"""One rank of tests/test_hybrid.py's two-node job: MiCS at stage 3 over torchrun's nodes (the config names no
ranks_per_node: LOCAL_WORLD_SIZE gives it). Writes rank_<r>.json, or error_<r>.txt before exiting: torchrun stops a
node's other ranks as soon as one exits, so a failure must be on disk first."""

from __future__ import annotations

import json
import os
import sys
import traceback
from pathlib import Path

import torch
import torch.distributed as dist


def main(out: Path) -> None:
    import zerokit
    from zerokit.testing.parity import Case, engine_config, forward_loss, make_batch, make_model, make_optimizer

    case = Case("torchrun-s3", stage=3, steps=2, accumulation=2, mics_shard_size=2)
    rank = dist.get_rank()
    model = make_model(case)
    engine = zerokit.initialize(model, make_optimizer(case, model), engine_config(case))
    losses = []
    for step in range(case.steps):
        before = engine.comm_stats()
        for micro in range(case.accumulation):
            loss = forward_loss(engine, make_batch(case, step, micro, rank))
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
        after = engine.comm_stats()
    names = {name for name, _ in model.named_parameters()}
    params = {name: value.tolist() for name, value in engine.full_state_dict().items() if name in names}
    settings = engine.settings
    result = {"node": int(os.environ["GROUP_RANK"]), "losses": losses, "params": params,
              "settings": {"shard_size": settings.shard_size, "replicas": settings.replicas,
                           "ranks_per_node": settings.ranks_per_node},
              "cross_node": after["cross_node"]["bytes"] - before["cross_node"]["bytes"],
              "replica_bytes": after["mics_replica.all_reduce"]["bytes"] - before["mics_replica.all_reduce"]["bytes"]}
    (out / f"rank_{rank}.json").write_text(json.dumps(result))
    engine.close()


if __name__ == "__main__":
    torch.set_num_threads(1)
    out = Path(sys.argv[1])
    dist.init_process_group("gloo")
    try:
        main(out)
    except BaseException:
        (out / f"error_{os.environ.get('RANK', '?')}.txt").write_text(traceback.format_exc())
        raise
    finally:
        dist.destroy_process_group()
