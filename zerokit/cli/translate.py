"""`zerokit translate`: DeepSpeed `zero_optimization` <-> FSDP <-> zerokit, each mapping explained.

    zerokit translate ds_config.json                  # to FSDP and to zerokit
    zerokit translate zerokit.json --from zerokit     # to DeepSpeed and FSDP
    zerokit translate --fsdp FULL_SHARD CPUOffload param_dtype=bf16   # to DeepSpeed and zerokit

The mapping table is printed first; anything without an equivalent then ends the command with a
one-line error (exit code 2), so a script cannot miss it. DeepSpeed and zerokit files are read by
zerokit.config.dsconfig, the reader the engine uses: a key the engine would refuse, or a misspelt one, is the
same one-line error here.
"""

from __future__ import annotations

import argparse
import json

from zerokit.cli.plan import one_line_errors
from zerokit.planner.translate import (
    Translation,
    deepspeed_to_fsdp,
    deepspeed_to_zerokit,
    fsdp_to_deepspeed,
    parse_fsdp_terms,
    zerokit_to_deepspeed,
)
from zerokit._support.jsonfile import read_json_object


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("translate", help="map DeepSpeed / FSDP / zerokit configs onto each other",
                              description="Map a DeepSpeed (or zerokit) JSON config, or FSDP terms, to the others.")
    one_line_errors(p)
    p.add_argument("config", nargs="?", help="a DeepSpeed or zerokit JSON config file")
    p.add_argument("--from", dest="source", choices=("deepspeed", "zerokit"), default="deepspeed",
                   help="what the JSON file is (default deepspeed)")
    p.add_argument("--fsdp", nargs="+", metavar="TERM",
                   help="FSDP terms instead of a file: FULL_SHARD|SHARD_GRAD_OP|NO_SHARD|HYBRID_SHARD, CPUOffload, "
                        "ZeroRedundancyOptimizer, reshard_after_forward=, param_dtype=, reduce_dtype=, replicate=, "
                        "clip_grad_norm=, gradient_accumulation_steps=")
    p.add_argument("--json", action="store_true", help="print the translations as JSON")
    return p


def load_json(path: str) -> dict:
    config = read_json_object(path, "config file")
    return config


def translations(args: argparse.Namespace) -> list[Translation]:
    """Every translation the arguments ask for, partial ones included."""
    if args.fsdp and args.config:
        raise ValueError("give a config file or --fsdp terms, not both")
    if args.fsdp:
        to_ds = fsdp_to_deepspeed(parse_fsdp_terms(args.fsdp), allow_partial=True)
        return [to_ds, deepspeed_to_zerokit(to_ds.config, allow_partial=True)]
    if not args.config:
        raise ValueError("give a DeepSpeed/zerokit JSON config file or --fsdp TERM ...")
    config = load_json(args.config)
    if args.source == "zerokit":
        to_ds = zerokit_to_deepspeed(config, allow_partial=True)
        return [to_ds, deepspeed_to_fsdp(to_ds.config, allow_partial=True)]
    return [deepspeed_to_fsdp(config, allow_partial=True), deepspeed_to_zerokit(config, allow_partial=True)]


def render(result: Translation) -> list[str]:
    rows = [(m.source, m.target, m.kind, m.why) for m in result.mappings]
    widths = [max([len(h)] + [len(r[i]) for r in rows]) for i, h in enumerate(("from", "to", "kind", "why"))]
    widths = [min(w, 60) for w in widths[:3]] + [0]
    lines = [f"{result.source} -> {result.target}"]
    for row in [("from", "to", "kind", "why")] + rows:
        lines.append("  " + "  ".join(cell.ljust(w) if w else cell for cell, w in zip(row, widths)))
    lines.append(f"{result.target} config:")
    lines.append(json.dumps(result.config, indent=2))
    return lines


def run(args: argparse.Namespace) -> int:
    results = translations(args)
    if args.json:
        print(json.dumps([{"from": r.source, "to": r.target, "config": r.config,
                           "mappings": [m.__dict__ for m in r.mappings]} for r in results], indent=2))
    else:
        print("\n\n".join("\n".join(render(r)) for r in results))
    problems = [f"{r.source} -> {r.target}: " + "; ".join(f"{m.source} ({m.why})" for m in r.unmapped)
                for r in results if r.unmapped]
    if problems:  # printed by zerokit.cli as one line, exit code 2
        raise ValueError("no equivalent for " + " | ".join(problems))
    return 0
