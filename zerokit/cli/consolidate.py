"""`zerokit consolidate`: a sharded checkpoint's full state dict, offline (no ranks, no GPU).

    zerokit consolidate ckpt model.safetensors                 # one file, fp32
    zerokit consolidate ckpt hf-model --format hf --dtype bf16 # a Hugging Face directory (what save_pretrained writes)
    zerokit consolidate ckpt adapters.safetensors --trainable-only

--format: hf, a directory transformers' from_pretrained loads (tied weights once, shards with an index past
--max-shard-size, config.json); safetensors, one file with every key of the model's state_dict. Default: from OUT
(a name ending in .safetensors is one file, anything else a directory).

CKPT is a save_dir (its `latest` tag, or --tag) or one checkpoint's directory, zerokit's or DeepSpeed's (ZeRO
stages 1-3: the weights DeepSpeed's zero_to_fp32 writes, tied weights included in one file). A zerokit checkpoint's
tensors are streamed part by part, so memory stays near one piece of the largest tensor whatever the model's
size (See [Note: consolidation streams] in zerokit/checkpoint/consolidate.py); a DeepSpeed checkpoint is read
whole, as zero_to_fp32 reads it.
"""

from __future__ import annotations

import argparse

from zerokit.cli.plan import one_line_errors


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("consolidate", help="write a checkpoint's full weights as safetensors",
                              description="Write a zerokit or DeepSpeed ZeRO checkpoint's full state dict as one "
                                          ".safetensors file or a Hugging Face model directory, offline.")
    checkpoint_arguments(p, out="a .safetensors file, or a directory (Hugging Face layout)")
    p.add_argument("--dtype", choices=("fp32", "bf16", "fp16"), default="fp32",
                   help="floating tensors in this dtype (default fp32: the fp32 masters exactly)")
    p.add_argument("--trainable-only", action="store_true", help="only trainable parameters (adapters)")
    p.add_argument("--format", choices=("hf", "safetensors"), default=None,
                   help="hf: a Hugging Face directory (tied weights once, an index past --max-shard-size); "
                        "safetensors: one file, every key (default: safetensors if OUT ends in .safetensors, else hf)")
    p.add_argument("--max-shard-size", default="5GB",
                   help="directory output: shard above this size (e.g. 5GB, 500MB, 2GiB; default 5GB)")
    return p


def checkpoint_arguments(p: argparse.ArgumentParser, out: str) -> None:
    """What every offline checkpoint command takes: the checkpoint (and --tag), and where to write (`out`: what
    it may be), with errors in one line."""
    one_line_errors(p)
    p.add_argument("checkpoint", help="a save_dir (with `latest`) or one checkpoint's directory")
    p.add_argument("out", help=out)
    p.add_argument("--tag", help="which checkpoint of the save_dir (default: the one `latest` names)")


def run(args: argparse.Namespace) -> int:
    from zerokit.checkpoint import consolidate  # torch is imported only for this command
    from zerokit.checkpoint.hf_layout import parse_size

    result = consolidate(args.checkpoint, args.out, tag=args.tag, dtype=args.dtype,
                         trainable_only=args.trainable_only, max_shard_bytes=parse_size(args.max_shard_size),
                         output_format=args.format)
    left_out = f", {len(result.skipped)} frozen tensors or buffers left out" if result.skipped else ""
    print(f"wrote {result.tensors} tensors, {result.bytes / 2**20:,.1f} MiB, in {result.seconds:.2f} s{left_out}:")
    for path in result.files:
        print(f"  {path}")
    return 0
