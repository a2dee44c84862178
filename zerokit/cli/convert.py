"""`zerokit convert`: a zerokit checkpoint in another framework's layout, offline (no ranks, no GPU).

    zerokit convert ckpt ds_ckpt --to deepspeed-universal     # then DeepSpeed, with
                                                               # "checkpoint": {"load_universal": true}:
                                                               # engine.load_checkpoint("ds_ckpt")

CKPT is a save_dir (its `latest` tag, or --tag) or one checkpoint's directory; OUT is a new directory (absent or
empty: a checkpoint is never overwritten). DeepSpeed's universal layout is what its ds_to_universal.py writes, so
DeepSpeed resumes the run at any world size and ZeRO stage (See [Note: what DeepSpeed's universal loader reads] in
zerokit/checkpoint/deepspeed_export.py).
"""

from __future__ import annotations

import argparse

from zerokit.cli.consolidate import checkpoint_arguments

TARGETS = ("deepspeed-universal",)


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("convert", help="write a zerokit checkpoint in DeepSpeed's universal layout",
                              description="Write a zerokit checkpoint in another framework's checkpoint layout, "
                                          "offline: DeepSpeed's universal checkpoint (load_universal).")
    checkpoint_arguments(p, out="a new directory (absent or empty), the save_dir the other framework loads")
    p.add_argument("--to", required=True, help=f"the layout to write: {', '.join(TARGETS)}")
    p.add_argument("--unsafe-client-state", action="store_true",
                   help="unpickle a client_state holding types torch.load(weights_only=True) refuses (runs code "
                        "from the file: only for a checkpoint you trust)")
    return p


def run(args: argparse.Namespace) -> int:
    if args.to not in TARGETS:
        raise ValueError(f"--to {args.to!r} is not a layout this command writes; use {', '.join(TARGETS)}")
    from zerokit.checkpoint.deepspeed_export import convert_to_universal  # torch is imported only for this command

    result = convert_to_universal(args.checkpoint, args.out, tag=args.tag, weights_only=not args.unsafe_client_state)
    print(f"wrote {result.params} trainable parameters with their Adam state, {result.bytes / 2**20:,.1f} MiB, in "
          f"{result.seconds:.2f} s: {result.out / result.tag} (latest_universal names it)")
    print('DeepSpeed loads it with "checkpoint": {"load_universal": true}: '
          f"engine.load_checkpoint({str(result.out)!r})")
    if result.groups > 1:
        print(f"{result.groups} param groups: at ZeRO-3, DeepSpeed 0.19.8's universal load gives every group one "
              "shared Adam step tensor; after load_checkpoint, give each its own: for state in "
              "engine.optimizer.optimizer.state.values(): state['step'] = state['step'].clone()")
    return 0
