"""From what each rank returned to the summary, the ratios and the printed tables. Pure functions of
plain data: nothing here spawns, times or imports a peer.

Units: MiB (2**20 bytes) in the tables, bytes in the JSON. Ψ is the number of trainable parameters.
"""

from __future__ import annotations

import statistics
from typing import Any

from benchmarks.accounting import formula_bytes
from benchmarks.commcount import RING_FACTOR
from benchmarks.contenders import Contender
from benchmarks.workload import BenchSettings

MIB = 2**20
TIME_TARGET = 1.0  # zerokit's step time / the fastest peer's, at most
FORMULA_TOLERANCE_PERCENT = 2.0  # zerokit's model-state bytes within this of the ZeRO formula
LOSS_TOLERANCE = {"fp32": 1e-3, "bf16": 5e-2}  # |eval loss - reference's|; bf16 peers round differently


def summarize(contender: Contender, rounds: list[list[dict[str, Any]]], settings: BenchSettings,
              wall_seconds: list[float]) -> dict[str, Any]:
    """One contender's numbers from `rounds[r][rank]`. Times: per step the slowest rank's (the
    harness all-reduced them), the timed steps of all rounds pooled. Memory: the largest rank's, in
    the round where it was largest. States and losses: the last round (every round computes the
    same thing; `eval_loss_round_spread` shows that it did). Per-rank raw values are kept."""
    ranks = rounds[-1]
    first = ranks[0]
    numel = first["trainable_numel"]
    steps = [seconds for round_ in rounds for seconds in round_[0]["step_seconds"]]
    cpu_steps = [seconds for round_ in rounds for seconds in round_[0]["step_cpu_seconds"]]
    peaks = [[rank["peak_rss_growth_bytes"] for rank in round_] for round_ in rounds]
    states = [_peak_states(rank) for rank in ranks]
    largest = max(states, key=lambda s: sum(s.values()))
    after_step = max(sum(rank["states_after_step"].values()) for rank in ranks)
    formula = formula_bytes(numel, settings.dtype, contender.stage, settings.world_size)
    measured, expected = sum(largest.values()), sum(formula.values())
    eval_losses = [rank["eval_loss"] for rank in ranks]
    round_losses = [round_[0]["eval_loss"] for round_ in rounds]
    return {
        "name": contender.name, "stage": contender.stage, "family": contender.family, "note": contender.note,
        "trainable_numel": numel,
        "rounds": len(rounds),
        "wall_seconds_per_round": wall_seconds,
        "step_seconds": steps,
        "median_step_seconds": statistics.median(steps),
        "min_step_seconds": min(steps), "max_step_seconds": max(steps),
        "step_seconds_per_round": [round_[0]["step_seconds"] for round_ in rounds],
        "median_phase_seconds_rank0": {phase: statistics.median(
            seconds for round_ in rounds for seconds in round_[0]["phase_seconds"][phase])
            for phase in first["phase_seconds"]},
        "step_cpu_seconds": cpu_steps,
        "median_step_cpu_seconds": statistics.median(cpu_steps),
        "peak_rss_growth_bytes": max(max(per_rank) for per_rank in peaks),
        "peak_rss_growth_bytes_per_round_and_rank": peaks,
        "peak_method": first["peak_method"],
        "model_state_bytes": measured,
        "model_state_bytes_by_category": largest,
        "formula_bytes": expected,
        "formula_bytes_by_category": formula,
        "formula_deviation_percent": 100.0 * (measured - expected) / expected,
        "model_state_bytes_after_step": after_step,
        # zerokit lets its gradients go at the step (See [Note: gradients live from a window's first backward to
        # its step] in zerokit/stages/base.py): after it, the formula without them
        "formula_deviation_after_step_percent": 100.0 * (after_step - (expected - formula["gradients"])) /
        (expected - formula["gradients"]),
        "states_after_backward_per_rank": [rank["states_after_backward"] for rank in ranks],
        "states_after_step_per_rank": [rank["states_after_step"] for rank in ranks],
        "live_tensor_bytes_per_rank": [rank["live_tensor_bytes"] for rank in ranks],
        "comm_per_step": _comm(first["comm_per_step"], settings.world_size, numel),
        "eval_loss": eval_losses[0],
        "eval_loss_rank_spread": max(eval_losses) - min(eval_losses),
        "eval_loss_round_spread": max(round_losses) - min(round_losses),
        "train_losses_per_rank": [rank["train_losses"] for rank in ranks],
    }


def _peak_states(rank: dict[str, Any]) -> dict[str, int]:
    """The larger of the two measuring points (after backward, after the step), by total bytes."""
    return max(rank["states_after_backward"], rank["states_after_step"], key=lambda s: sum(s.values()))


def _comm(per_step: dict, world_size: int, numel: int) -> dict[str, Any]:
    """Logical bytes per step by collective (zerokit's counting convention), their sum, and the
    bytes one rank sends on a ring."""
    logical = sum(counts["bytes"] for counts in per_step.values())
    wire = sum(RING_FACTOR[kind](world_size) * counts["bytes"] for kind, counts in per_step.items())
    return {"by_collective": per_step, "logical_bytes": logical, "wire_bytes_per_rank": wire,
            "logical_bytes_per_param": logical / numel}


def compare(summaries: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    """For each zerokit stage: its time and peak memory over the best peer doing the same stage."""
    rows = []
    for ours in (s for s in summaries.values() if s["family"] == "zerokit"):
        peers = [s for s in summaries.values()
                 if s["family"] not in ("zerokit", "reference") and s["stage"] == ours["stage"]]
        row: dict[str, Any] = {"zerokit": ours["name"], "stage": ours["stage"], "peers": [p["name"] for p in peers],
                               "formula_deviation_percent": ours["formula_deviation_percent"],
                               "formula_ok": abs(ours["formula_deviation_percent"]) <= FORMULA_TOLERANCE_PERCENT}
        if peers:
            fastest = min(peers, key=lambda p: p["median_step_seconds"])
            leanest = min(peers, key=lambda p: p["peak_rss_growth_bytes"])
            time_ratio = ours["median_step_seconds"] / fastest["median_step_seconds"]
            cheapest = min(peers, key=lambda p: p["median_step_cpu_seconds"])
            row.update(fastest_peer=fastest["name"], time_ratio=time_ratio, time_ok=time_ratio <= TIME_TARGET,
                       cheapest_cpu_peer=cheapest["name"],
                       cpu_time_ratio=ours["median_step_cpu_seconds"] / cheapest["median_step_cpu_seconds"],
                       leanest_peer=leanest["name"],
                       memory_ratio=ours["peak_rss_growth_bytes"] / leanest["peak_rss_growth_bytes"])
        rows.append(row)
    return rows


def check_losses(summaries: dict[str, dict[str, Any]], dtype: str) -> dict[str, Any]:
    """Every contender's eval loss beside the reference's (one process where it ran, else torch DDP): same
    init, same data, same optimizer, so a contender that trains wrong stands out."""
    if not summaries:
        return {}
    reference = summaries.get("single-process") or summaries.get("torch-ddp") or next(iter(summaries.values()))
    tolerance = LOSS_TOLERANCE[dtype]
    rows = {}
    for name, summary in summaries.items():
        delta = summary["eval_loss"] - reference["eval_loss"]
        train_delta = max(abs(a - b) for a, b in zip(_mean_train_losses(summary), _mean_train_losses(reference)))
        rows[name] = {"eval_loss": summary["eval_loss"], "delta": delta, "max_train_loss_delta": train_delta,
                      "ranks_agree": summary["eval_loss_rank_spread"] <= tolerance / 10,
                      "ok": abs(delta) <= tolerance and train_delta <= tolerance}
    return {"reference": reference["name"], "tolerance": tolerance, "contenders": rows}


def _mean_train_losses(summary: dict[str, Any]) -> list[float]:
    """Each step's loss averaged over the ranks: the loss of the union of their batches, which is what one
    process training on all of them (the single-process reference) reports."""
    per_rank = summary["train_losses_per_rank"]
    return [sum(losses) / len(losses) for losses in zip(*per_rank)]


# --- presentation -------------------------------------------------------------------------------

def _table(header: list[str], rows: list[list[str]], right_from: int = 1) -> str:
    widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(header))]
    def line(cells: list[str]) -> str:
        return "  ".join(cell.ljust(w) if i < right_from else cell.rjust(w)
                         for i, (cell, w) in enumerate(zip(cells, widths))).rstrip()
    return "\n".join([line(header), line(["-" * w for w in widths]), *map(line, rows)])


def format_report(settings: BenchSettings, summaries: dict[str, dict[str, Any]], comparisons: list[dict[str, Any]],
                  losses: dict[str, Any], skipped: dict[str, str], notes: dict[str, str]) -> str:
    parts = []
    if summaries:
        numel = next(iter(summaries.values()))["trainable_numel"]
        parts.append(f"model {settings.n_layer} layers x {settings.n_embd} wide, Ψ = {numel:,} trainable parameters; "
                     f"world size {settings.world_size}; {settings.dtype}; batch {settings.batch_size} x "
                     f"{settings.block_size} tokens per rank; buckets {settings.bucket_bytes / MIB:g} MiB; "
                     f"{settings.steps} timed steps after {settings.warmup} warm-up")
        parts.append(_contender_table(summaries, losses))
    if comparisons:
        parts.append(_ratio_table(comparisons, summaries))
    if losses:
        bad = [name for name, row in losses["contenders"].items() if not row["ok"] or not row["ranks_agree"]]
        verdict = "all agree" if not bad else "DISAGREE: " + ", ".join(bad)
        parts.append(f"loss check: eval loss on a shared batch after the last step, vs {losses['reference']} "
                     f"(tolerance {losses['tolerance']:g}, ranks must agree too): {verdict}")
    if skipped:
        parts.append("\n".join(f"skipped {name}: {reason}" for name, reason in skipped.items()))
    by_note: dict[str, list[str]] = {}
    for name, note in notes.items():
        by_note.setdefault(note, []).append(name)
    if by_note:
        parts.append("\n".join(f"{', '.join(names)}: {note}" for note, names in by_note.items()))
    return "\n\n".join(parts)


def _contender_table(summaries: dict[str, dict[str, Any]], losses: dict[str, Any]) -> str:
    header = ["contender", "stage", "step s median", "[min, max]", "CPU s", "peak RSS MiB", "states MiB",
              "formula MiB", "vs formula", "comm MiB/step (sent)", "eval loss", "Δ loss"]
    rows = []
    for name, s in summaries.items():
        comm = s["comm_per_step"]
        comm_cell = f"{comm['logical_bytes'] / MIB:.1f} ({comm['wire_bytes_per_rank'] / MIB:.1f})"
        rows.append([name, str(s["stage"]), f"{s['median_step_seconds']:.3f}",
                     f"[{s['min_step_seconds']:.3f}, {s['max_step_seconds']:.3f}]",
                     f"{s['median_step_cpu_seconds']:.3f}", f"{s['peak_rss_growth_bytes'] / MIB:.1f}", f"{s['model_state_bytes'] / MIB:.1f}",
                     f"{s['formula_bytes'] / MIB:.1f}", f"{s['formula_deviation_percent']:+.2f}%", comm_cell,
                     f"{s['eval_loss']:.6f}", f"{losses['contenders'][name]['delta']:+.1e}"])
    return _table(header, rows)


def _ratio_table(comparisons: list[dict[str, Any]], summaries: dict[str, dict[str, Any]]) -> str:
    header = ["stage", "zerokit", "step s", "fastest peer", "step s", "time ratio", "target", "CPU ratio",
              "peak RSS MiB", "leanest peer", "peak RSS MiB", "memory ratio", "states vs formula"]
    rows = []
    for row in comparisons:
        ours = summaries[row["zerokit"]]
        formula_cell = (f"{row['formula_deviation_percent']:+.2f}% {'ok' if row['formula_ok'] else 'OVER 2%'} "
                        f"({ours['formula_deviation_after_step_percent']:+.2f}% after step)")
        if "fastest_peer" not in row:
            rows.append([str(row["stage"]), row["zerokit"], f"{ours['median_step_seconds']:.3f}", "(no peer ran)",
                         "", "", "", "", f"{ours['peak_rss_growth_bytes'] / MIB:.1f}", "", "", "", formula_cell])
            continue
        fastest, leanest = summaries[row["fastest_peer"]], summaries[row["leanest_peer"]]
        rows.append([str(row["stage"]), row["zerokit"], f"{ours['median_step_seconds']:.3f}", row["fastest_peer"],
                     f"{fastest['median_step_seconds']:.3f}", f"{row['time_ratio']:.2f}x",
                     f"<= {TIME_TARGET:.2f}x {'ok' if row['time_ok'] else 'MISSED'}",
                     f"{row['cpu_time_ratio']:.2f}x vs {row['cheapest_cpu_peer']}",
                     f"{ours['peak_rss_growth_bytes'] / MIB:.1f}", row["leanest_peer"],
                     f"{leanest['peak_rss_growth_bytes'] / MIB:.1f}", f"{row['memory_ratio']:.2f}x", formula_cell])
    return _table(header, rows, right_from=2)

