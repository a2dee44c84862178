"""`zerokit plan`: which ZeRO stage, will it fit, how long communication takes, and why.

Presentation only: the numbers come from zerokit.planner (pure functions, no torch).
With --emit, stdout holds exactly the config (JSON, or Python for fsdp) and the summary goes to
stderr, so `zerokit plan ... --emit deepspeed > ds_config.json` works.
"""

from __future__ import annotations

import argparse
import importlib
import json
import math
import sys
from typing import NoReturn

from zerokit.planner import GPUS, HOSTS, LINKS, PRESETS, Architecture, Policy, emit, make_scenario, plan, plan_dict
from zerokit.planner.advice import Plan, hybrid_comparison, micro_batch_limit
from zerokit.planner.catalogue import GiB
from zerokit.planner.emit import DEFAULT_CLIPPING, TARGETS
from zerokit.planner.memo import render_memo
from zerokit.planner.spec import ATTENTION, GB, LORA_TARGETS, OPTIMIZERS, PRECISIONS

ARCH_KEYS = {"layers": "n_layers", "hidden": "hidden", "heads": "n_heads", "kv_heads": "n_kv_heads", "ffn": "ffn",
             "vocab": "vocab", "head_dim": "head_dim", "positions": "max_positions", "tied": "tied_embeddings",
             "gated": "gated_mlp", "layernorm": "layernorm", "bias": None, "dropout": "dropout"}
ARCH_REQUIRED = ("layers", "hidden", "heads", "ffn", "vocab")


def parse_arch(text: str) -> Architecture:
    """`layers=40,hidden=5120,heads=40,kv_heads=40,ffn=13824,vocab=32000[,gated=1,tied=0,...]`."""
    values: dict[str, int] = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        key, sep, raw = item.partition("=")
        if not sep or key not in ARCH_KEYS:
            raise ValueError(f"--arch item {item!r} is not key=value with a key among {', '.join(ARCH_KEYS)}")
        try:
            values[key] = int(float(raw))
        except ValueError:
            raise ValueError(f"--arch {key}={raw!r} must be a number") from None
    missing = [key for key in ARCH_REQUIRED if key not in values]
    if missing:
        raise ValueError(f"--arch is missing {', '.join(missing)} (required: {', '.join(ARCH_REQUIRED)})")
    fields = {ARCH_KEYS[k]: v for k, v in values.items() if ARCH_KEYS[k] is not None}
    fields.setdefault("n_kv_heads", values["heads"])
    for flag in ("tied_embeddings", "gated_mlp", "layernorm", "dropout"):
        if flag in fields:
            fields[flag] = bool(fields[flag])
    bias = bool(values.get("bias", 0))
    return Architecture(**fields, qkv_bias=bias, out_bias=bias, mlp_bias=bias)


def finite_float(text: str) -> float:
    """argparse type: float() accepts 'nan' and 'inf', which slip past every range check downstream."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"{text!r} is not a finite number")
    return value


def one_line_errors(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Make argparse's own errors (a bad choice, a missing model, a non-number) one line, like every
    other bad input: by default argparse prints the whole usage first, some 40 lines for `plan`.
    Its message already names the argument, the value and, for choices, what is accepted."""
    def error(message: str) -> NoReturn:
        parser.exit(2, f"{parser.prog}: error: {message}\n")

    parser.error = error  # an instance attribute: subparsers.add_parser cannot take a parser class
    return parser


def _float_or_none(value: float | None, scale: float) -> float | None:
    return None if value is None else value * scale


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("plan", help="pick a ZeRO stage and explain it (no GPU needed)",
                              description="Predict memory and communication per ZeRO stage, pick one, justify it.")
    one_line_errors(p)
    _model_arguments(p)
    _hardware_arguments(p)
    _training_arguments(p)
    add_measure_arguments(p)
    _output_arguments(p)
    return p


def _model_arguments(p: argparse.ArgumentParser) -> None:
    model = p.add_argument_group("model (give one of --model, --params, --arch; not needed with --check or "
                                 "--measure-device)")
    which = model.add_mutually_exclusive_group()
    which.add_argument("--model", help=f"preset ({', '.join(PRESETS)}) or a local config.json path")
    which.add_argument("--params", type=finite_float, help="parameter count, e.g. 13e9 (no activations then)")
    which.add_argument("--arch", help="shapes: layers=,hidden=,heads=,kv_heads=,ffn=,vocab=[,gated=1,tied=0,...]")
    model.add_argument("--trainable-fraction", type=finite_float, default=1.0, help="share of parameters that train")
    model.add_argument("--lora-rank", type=int, help="LoRA rank r; the base model is frozen")
    model.add_argument("--lora-targets", help=f"comma list of {','.join(LORA_TARGETS)} (default: all)")


def _hardware_arguments(p: argparse.ArgumentParser) -> None:
    hw = p.add_argument_group("hardware (catalogue keys; numbers override them)")
    hw.add_argument("--gpu", default="a100-80gb", choices=[*GPUS, "cpu"], help="cpu: a measured device (--device-file)")
    hw.add_argument("--gpus-per-node", type=int, default=8)
    hw.add_argument("--nodes", type=int, default=1)
    hw.add_argument("--intra-link", choices=list(LINKS), help="default: the GPU's (NVLink or PCIe)")
    hw.add_argument("--inter-link", choices=list(LINKS), help="default: the GPU's usual fabric")
    hw.add_argument("--nics-per-node", type=int, help="inter-node ports per node (default: one per GPU)")
    hw.add_argument("--host", choices=list(HOSTS), help="node type for RAM/NVMe (default: the GPU's DGX)")
    hw.add_argument("--gpu-memory-gib", type=finite_float)
    hw.add_argument("--peak-tflops", type=finite_float, help="dense peak for the chosen dtype")
    hw.add_argument("--intra-gb-per-s", type=finite_float, help="per GPU, per direction")
    hw.add_argument("--inter-gb-per-s", type=finite_float, help="per port, per direction")
    hw.add_argument("--intra-latency-us", type=finite_float)
    hw.add_argument("--inter-latency-us", type=finite_float)
    hw.add_argument("--host-ram-gib", type=finite_float)
    hw.add_argument("--host-mem-gb-per-s", type=finite_float, help="host RAM bandwidth, all sockets")
    hw.add_argument("--nvme-tb", type=finite_float)
    hw.add_argument("--nvme-read-gb-per-s", type=finite_float)
    hw.add_argument("--nvme-write-gb-per-s", type=finite_float)


def _training_arguments(p: argparse.ArgumentParser) -> None:
    train = p.add_argument_group("training")
    train.add_argument("--dtype", default="bf16", choices=PRECISIONS)
    train.add_argument("--optimizer", default="adamw", choices=OPTIMIZERS)
    train.add_argument("--seq-len", type=int, help="default: the model's context, at most 2048")
    train.add_argument("--micro-batch", type=int, default=1)
    train.add_argument("--grad-accum", type=int, default=1)
    train.add_argument("--checkpointing", default="auto", choices=("auto", "none", "full"),
                       help="auto: only if nothing fits without it")
    train.add_argument("--attention", default="flash", choices=ATTENTION)
    train.add_argument("--tiles", type=int, default=1,
                       help="tiled MLP and loss: slices of the sequence each is computed over (ALST's tiling)")
    train.add_argument("--reduce-dtype", default="fp32", choices=PRECISIONS, help="gradient communication dtype")
    train.add_argument("--bucket-mib", type=finite_float, default=25.0, help="gradient bucket size")
    train.add_argument("--no-overlap", action="store_true", help="reduce after backward, not during it")
    train.add_argument("--reduce-once-per-step", action="store_true",
                       help="stage 2: accumulate full gradients, reduce-scatter once per step")
    lay = p.add_argument_group("layout (default: flat data parallel over all GPUs)")
    lay.add_argument("--tp", type=int, default=1, help="tensor parallel degree (inside a node)")
    lay.add_argument("--pp", type=int, default=1, help="pipeline stages")
    lay.add_argument("--sp", type=int, default=1, help="Ulysses sequence parallel degree (sequence_parallel_size)")
    lay.add_argument("--ep", type=int, default=1,
                     help="expert parallel degree of a mixture-of-experts model (expert_parallel_size), inside the "
                          "data dimension")
    lay.add_argument("--replicas", type=int, default=1, help="HSDP/MiCS: copies of the shard group")
    lay.add_argument("--hpz", type=int, default=1, metavar="K",
                     help="ZeRO++ hpZ at stage 3: a secondary parameter copy over K ranks (zero_hpz_partition_size); "
                          "on several nodes the tree also tries MiCS and hpZ by itself")
    pol = p.add_argument_group("policy and assumptions")
    pol.add_argument("--headroom", type=finite_float, default=0.10, help="fraction of GPU memory left free")
    pol.add_argument("--offload", default="auto", choices=("auto", "none"))
    pol.add_argument("--tensor", default="auto", choices=("auto", "none"),
                     help="auto: where no stage fits on the GPU alone, try a tensor degree inside the node before "
                          "offloading; none: flat layouts only")
    pol.add_argument("--sequence", default="auto", choices=("auto", "none"),
                     help="auto: where no stage fits on the GPU alone, try a sequence degree inside the node (Ulysses) "
                          "before a tensor degree and offloading; none: never")
    pol.add_argument("--expert", default="auto", choices=("auto", "none"),
                     help="auto: for a mixture-of-experts model where no stage fits on the GPU alone, try an expert "
                          "degree inside the node before the sequence and tensor degrees and offloading, and beside "
                          "each offload tier; none: never")
    pol.add_argument("--max-micro-batch", type=int, default=1024)
    pol.add_argument("--mfu", type=finite_float, default=0.40, help="achieved / peak FLOPS")
    pol.add_argument("--bandwidth-efficiency", type=finite_float, default=0.80)
    pol.add_argument("--overhead-gb", type=finite_float, default=1.0, help="per-GPU allowance (CUDA context, NCCL)")


def _output_arguments(p: argparse.ArgumentParser) -> None:
    out = p.add_argument_group("output")
    out.add_argument("--memo", metavar="PATH", help="write the markdown memo here")
    out.add_argument("--plot", metavar="PATH", help="write stacked bars per stage (needs matplotlib)")
    out.add_argument("--json", action="store_true", help="print the plan as JSON")
    out.add_argument("--emit", choices=TARGETS, help="print the config that implements the pick")
    out.add_argument("--gradient-clipping", type=finite_float, default=DEFAULT_CLIPPING, help="written by --emit")


def add_measure_arguments(p: argparse.ArgumentParser) -> None:
    """Flags that measure this machine or the user's model, or check a recorded run."""
    measure = p.add_argument_group("measure and check (these run torch on this machine)")
    measure.add_argument("--calibrate", action="store_true",
                         help="run the model (a config.json or preset, --calibration-layers blocks of it) at small "
                              "shapes here and plan with its measured activations and backward transients; with "
                              "--check, also train copies of the run's model at its stage and shape (resident "
                              "memory, and each phase's time read off the line through them)")
    measure.add_argument("--calibration", metavar="FILE", help="a calibration saved by --save-calibration")
    measure.add_argument("--save-calibration", metavar="FILE", help="write the calibration made by --calibrate")
    measure.add_argument("--calibration-layers", type=int, default=2, help="blocks of the model to run (default 2)")
    measure.add_argument("--measure-device", nargs="?", const="-", metavar="FILE",
                         help="time this machine (FLOPs, memory bandwidth, optimizer, gloo link) and print it; "
                              "write it to FILE if given")
    measure.add_argument("--threads", type=int, default=1, help="threads per rank when measuring (default 1)")
    measure.add_argument("--device-file", metavar="FILE",
                         help="a measured device (from --measure-device): --gpu cpu plans on it; --check times with it")
    measure.add_argument("--backend", choices=("nccl", "gloo"), help="default: gloo with --gpu cpu, else nccl")
    measure.add_argument("--optimizer-ns-per-element", type=finite_float,
                         help="the optimizer step's time per owned element (default: measured, or memory-bound)")
    measure.add_argument("--check", metavar="RUN", help="a run recorded by zerokit.profiling.record_run: print the "
                                                        "plan for its configuration beside it, category by category")


def _model(args: argparse.Namespace):
    if args.model is not None:
        return args.model
    if args.arch is not None:
        return parse_arch(args.arch)
    return args.params


def _device(args: argparse.Namespace):
    """The measured device of --device-file, with the user's numbers over it."""
    if not args.device_file:
        return None
    from zerokit.planner.device import DeviceProfile

    return DeviceProfile.load(args.device_file).with_overrides(
        peak_flops=_float_or_none(args.peak_tflops, 1e12), memory_bandwidth=_float_or_none(args.host_mem_gb_per_s, 1e9),
        link_bandwidth=_float_or_none(args.intra_gb_per_s, 1e9),
        link_latency=_float_or_none(args.intra_latency_us, 1e-6))


def _calibration(args: argparse.Namespace, model):
    """--calibration FILE, or --calibrate (torch, lazily), or None."""
    from zerokit.planner.calibration import Calibration

    if args.calibration:
        return Calibration.load(args.calibration)
    if not args.calibrate:
        return None
    if not isinstance(model, str):
        raise ValueError("--calibrate needs --model (a preset or a config.json), which it builds and runs")
    calibrate = importlib.import_module("zerokit.profiling.calibrate")
    calibrate.set_threads(args.threads)
    result = calibrate.calibrate(model, precision=args.dtype, layers=args.calibration_layers)
    if args.save_calibration:
        result.save(args.save_calibration)
    return result


def scenario_from_args(args: argparse.Namespace):
    targets = tuple(t.strip() for t in args.lora_targets.split(",")) if args.lora_targets else None
    if args.bucket_mib <= 0:
        raise ValueError(f"--bucket-mib={args.bucket_mib:g} must be > 0")
    if args.overhead_gb < 0:
        raise ValueError(f"--overhead-gb={args.overhead_gb:g} must be >= 0")
    device = _device(args)
    per_element = None if args.optimizer_ns_per_element is None else args.optimizer_ns_per_element * 1e-9
    if per_element is None and device is not None:
        per_element = device.optimizer_seconds_per_element.get(args.optimizer)
    return make_scenario(
        _model(args), device=device, calibration=_calibration(args, _model(args)),
        backend=args.backend or ("gloo" if args.gpu == "cpu" else "nccl"), optimizer_seconds_per_element=per_element,
        gpu=args.gpu, gpus_per_node=args.gpus_per_node, nodes=args.nodes, precision=args.dtype,
        # under a pipeline stage 2 reduces once per optimizer step, as zerokit.pipeline does by default
        optimizer=args.optimizer, seq_len=args.seq_len, micro_batch=args.micro_batch, grad_accum=args.grad_accum,
        checkpointing="none" if args.checkpointing == "auto" else args.checkpointing, attention=args.attention,
        reduce_dtype=args.reduce_dtype, bucket_bytes=int(args.bucket_mib * 2**20), overlap_comm=not args.no_overlap,
        reduce_every_micro_step=not (args.reduce_once_per_step or args.pp > 1),
        trainable_fraction=args.trainable_fraction,
        lora_rank=args.lora_rank, lora_targets=targets, tp=args.tp, pp=args.pp, replicas=args.replicas,
        secondary=args.hpz, sp=args.sp, ep=args.ep, tiles=args.tiles,
        mfu=args.mfu, bandwidth_efficiency=args.bandwidth_efficiency, overhead_bytes=int(args.overhead_gb * GB),
        intra_link=args.intra_link, inter_link=args.inter_link, host_key=args.host, nics_per_node=args.nics_per_node,
        gpu_memory=None if args.gpu_memory_gib is None else int(args.gpu_memory_gib * GiB),
        peak_tflops=args.peak_tflops, intra_bandwidth=_float_or_none(args.intra_gb_per_s, 1e9),
        inter_bandwidth=_float_or_none(args.inter_gb_per_s, 1e9),
        intra_latency=_float_or_none(args.intra_latency_us, 1e-6),
        inter_latency=_float_or_none(args.inter_latency_us, 1e-6),
        host_ram=None if args.host_ram_gib is None else int(args.host_ram_gib * GiB),
        nvme_capacity=None if args.nvme_tb is None else int(args.nvme_tb * 1e12),
        nvme_read=_float_or_none(args.nvme_read_gb_per_s, 1e9),
        nvme_write=_float_or_none(args.nvme_write_gb_per_s, 1e9),
        ram_bandwidth=_float_or_none(args.host_mem_gb_per_s, 1e9))


HEADER = ("", "fits", "params", "grads", "optim", "activ", "buffers", "overhd", "total", "comm s", "exposed",
          "compute", "step s")


def format_table(p: Plan) -> list[str]:
    rows = [HEADER]
    shown = list(p.stages) + ([p.pick] if p.pick is not None and p.pick.offload.any else [])
    for e in shown:
        m = e.memory
        name = f"ZeRO-{e.stage}" + (f"+ep={e.scenario.layout.ep}" if e.scenario.layout.ep > 1 else "") + (
            "+offload" if e.offload.any else "")
        rows.append((name, "yes" if e.fits else "no", *(f"{v / GB:.2f}" for v in m.as_dict().values()),
                     f"{m.total / GB:.2f}", f"{e.comm.seconds:.3f}", f"{e.exposed_comm_seconds:.3f}",
                     f"{e.compute.seconds:.3f}", f"{e.step_seconds:.3f}"))
    widths = [max(len(row[i]) for row in rows) for i in range(len(HEADER))]
    return ["  ".join(cell.ljust(w) if i == 0 else cell.rjust(w) for i, (cell, w) in enumerate(zip(row, widths)))
            for row in rows]


def summary(p: Plan) -> list[str]:
    s, t = p.scenario, p.scenario.training
    reference = p.stages[0]
    ckpt = reference.training.checkpointing
    lines = [f"zerokit plan: {s.model.name} ({s.counts.total / 1e9:.3g}B parameters, "
             f"{s.counts.trainable / 1e9:.3g}B trainable) on {s.cluster.name}",
             f"{t.precision} {t.optimizer}, seq {t.seq_len}, micro-batch {reference.training.micro_batch}, "
             f"grad-accum {t.grad_accum}, layout {s.layout.name}; usable per GPU {reference.usable / GB:.1f} GB = "
             f"{reference.capacity / GB:.1f} GB x (1 - {p.policy.headroom:.2f})", "",
             f"GB per GPU by category, {'full' if ckpt == 'full' else 'no'} activation checkpointing, no offload:"]
    lines += format_table(p) + [""]
    if p.pick is None:
        lines.append("pick: nothing fits")
    else:
        lines.append(f"pick: {p.pick.label}, micro-batch {p.pick.training.micro_batch} "
                     f"(largest that fits: {micro_batch_limit(p)})")
    lines += ["why:"] + [f"  - {r}" for r in p.reasons]
    lines += across_nodes(p)
    lines += (["notes:"] + [f"  - {n}" for n in p.notes]) if p.notes else []
    return lines


def across_nodes(p: Plan) -> list[str]:
    """Several nodes: flat ZeRO-3, MiCS and hpZ on this inter-node link and the other kind (the memo's table)."""
    compared = hybrid_comparison(p)
    if not compared:
        return []
    rows = [("inter-node link", "ZeRO-3 form", "fits", "across GB", "comm s", "exposed s", "step s")]
    for link, _, forms in compared:
        rows += [(link, f.mode, "yes" if f.fits else "no", f"{f.comm.cross_node_bytes / GB:.2f}",
                  f"{f.comm.seconds:.3f}", f"{f.exposed_comm_seconds:.3f}", f"{f.step_seconds:.3f}") for f in forms]
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    table = ["  " + "  ".join(cell.ljust(w) if i < 2 else cell.rjust(w) for i, (cell, w) in enumerate(zip(row, widths)))
             for row in rows]
    picks = [f"  pick on {link}: " + (f"{planned.pick.label}, {planned.pick.comm.cross_node_bytes / GB:.2f} GB across, "
                                      f"step {planned.pick.step_seconds:.3f} s" if planned.pick else "nothing fits")
             for link, planned, _ in compared]
    return ["across nodes (GB a GPU sends to other nodes per step; exposed: comm the compute does not hide):",
            *table, *picks]


def run(args: argparse.Namespace) -> int:
    if args.measure_device:
        return measure_device(args)
    if args.check:
        return check_run(args)
    if args.model is None and args.arch is None and args.params is None:
        raise ValueError("give the model: --model, --params or --arch (or --check RUN, or --measure-device)")
    scenario = scenario_from_args(args)
    policy = Policy(headroom=args.headroom, checkpointing=args.checkpointing, offload=args.offload,
                    tensor=args.tensor, sequence=args.sequence, expert=args.expert,
                    max_micro_batch=args.max_micro_batch)
    result = plan(scenario, policy)
    emitted = None
    if args.emit:
        if result.pick is None:
            raise ValueError("nothing fits, so there is no config to emit; see `zerokit plan` without --emit")
        emitted = emit(result.pick, args.emit, args.gradient_clipping)
    if args.memo:
        with open(args.memo, "w") as handle:
            handle.write(render_memo(result))
    if args.plot:
        from zerokit.planner.plot import plot_plan  # matplotlib only when asked for
        plot_plan(result, args.plot)
    _print(result, args, emitted)
    return 0 if result.pick is not None else 1


def _print(result: Plan, args: argparse.Namespace, emitted) -> None:
    if args.json:
        document = plan_dict(result)
        if emitted is not None:
            document["config"] = {"target": emitted.target, "config": emitted.config, "notes": list(emitted.notes)}
        print(json.dumps(document, indent=2))
        return
    human = sys.stderr if emitted is not None else sys.stdout
    print("\n".join(summary(result)), file=human)
    for path, what in ((args.memo, "memo"), (args.plot, "plot")):
        if path:
            print(f"wrote {what}: {path}", file=human)
    if emitted is not None:
        for note in emitted.notes:
            print(f"note: {note}", file=sys.stderr)
        config = emitted.config
        print(config if isinstance(config, str) else json.dumps(config, indent=2), end="" if isinstance(config, str)
              else "\n")


def measure_device(args: argparse.Namespace) -> int:
    device = importlib.import_module("zerokit.profiling.device").measure_device(threads=args.threads)
    print(f"device: {device.name} ({device.source})")
    for dtype, flops in sorted(device.peak_flops.items()):
        print(f"  matmul peak {dtype}: {flops / 1e9:,.1f} GFLOP/s per rank")
    print(f"  memory bandwidth: {device.memory_bandwidth / 1e9:.1f} GB/s (copy, read + write)")
    print(f"  gloo link: {device.link_bandwidth / 1e9:.2f} GB/s, {device.link_latency * 1e6:.0f} us per ring step")
    for name, seconds in sorted(device.optimizer_seconds_per_element.items()):
        print(f"  optimizer {name}: {seconds * 1e9:.2f} ns per fp32 element")
    print(f"  a rank's resident memory before its model: {device.resident_bytes / 2**20:,.0f} MiB; "
          f"memory shared by the ranks: {device.memory_bytes / 2**30:,.1f} GiB")
    if args.measure_device != "-":
        device.save(args.measure_device)
        print(f"wrote device: {args.measure_device}")
    return 0


def check_run(args: argparse.Namespace) -> int:
    """--check RUN: the plan for the run's configuration beside what it measured (zerokit/planner/check.py)."""
    from zerokit.planner.calibration import Calibration
    from zerokit.planner.check import check_rows, format_rows

    record = json.loads(_read(args.check))
    calibration = Calibration.load(args.calibration) if args.calibration else None
    if calibration is None and args.calibrate:
        report = importlib.import_module("zerokit.profiling.report")
        importlib.import_module("zerokit.profiling.calibrate").set_threads(args.threads)
        calibration = report.calibrate_for_record(record, layers=args.calibration_layers)
        if args.save_calibration:
            calibration.save(args.save_calibration)
    mfu = args.mfu if args.mfu != 0.40 else None  # the GPU default is no guess for a CPU: measure unless given
    rows = check_rows(record, calibration, _device(args), mfu)
    if args.json:
        print(json.dumps([row.as_dict() for row in rows], indent=2))
    else:
        setup = record["setup"]
        print(f"zerokit plan --check {args.check}: stage {setup['stage']}, {setup['precision']}, {setup['world']} "
              f"{setup['backend']} ranks, micro-batch {record['micro_batch']}, seq {record['seq_len']}")
        print("\n".join(format_rows(rows)))
    if args.memo:
        with open(args.memo, "a") as handle:
            handle.write("\n## Predicted vs measured: " + args.check + "\n\n```\n" + "\n".join(format_rows(rows))
                         + "\n```\n")
    return 0


def _read(path: str) -> str:
    try:
        with open(path) as handle:
            return handle.read()
    except OSError as error:
        raise ValueError(f"run record {path!r} cannot be read: {error.strerror}") from None
