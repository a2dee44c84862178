"""What happens to stage 3's units: each is gathered (an all-gather of every rank's shard of its
buckets, trainable and frozen), its parameters pointed at the gathered buffers, and freed again, within
the live-element limit. *When* each of these happens is decided by the hooks (hooks.py).

[Note: a live limit below what the model needs]
stage3_max_live_parameters bounds the unsharded elements held at once; prefetches wait while they would
break it. A limit below what the model needs live at once (the root, the persistent units and the worst
chain of units a step holds) cannot be kept, and DeepSpeed does not try: its limit only holds back
prefetching, never a gather a module needs (axolotl's ZeRO-3 templates set it to 0, meaning "prefetch
nothing"). zerokit reads such a limit the same way, as that least amount, and says so at start-up: a memory
knob changes what is held, never what is computed, so it is not refused.
"""

from __future__ import annotations

import torch

from zerokit.comm import Communicator
from zerokit.config.typed import Stage3Policy
from zerokit.flat import Bucket, ShardedFlat
from zerokit.stages.agreement import RAISE, UnitAgreement
from zerokit.stages.units import Unit, ancestry


class UnitShards:
    def __init__(self, units: list[Unit], trainable: ShardedFlat, frozen: ShardedFlat, unit_of_bucket: list[int],
                 comm: Communicator, policy: Stage3Policy) -> None:
        """`unit_of_bucket[b]`: the unit that trainable bucket b belongs to; the frozen layout has one
        bucket per unit that has frozen parameters, keyed by the unit's index (its `group`)."""
        self.units, self.trainable, self.frozen = units, trainable, frozen
        self.comm, self.policy, self.rank = comm, policy, comm.rank
        self.buckets_of: list[list[Bucket]] = [[] for _ in units]
        for bucket in trainable.layout.buckets:
            self.buckets_of[unit_of_bucket[bucket.index]].append(bucket)
        self.frozen_of = {bucket.group: bucket for bucket in frozen.layout.buckets}
        self.unit_of_bucket = unit_of_bucket
        self.unit_numel = [sum(b.numel for b in buckets) for buckets in self.buckets_of]  # trainable, padded
        # Elements a unit holds while gathered: its trainable buckets and its frozen bucket, padded.
        self.gathered_numel = [self.unit_numel[u.index] + (self.frozen_of[u.index].numel if u.index in self.frozen_of
                                                             else 0) for u in units]
        self.persistent = {u.index for u in units if 0 < self.gathered_numel[u.index] < policy.persistence_threshold}
        self.live_numel = self.peak_live_numel = 0
        self.needed_live_numel = self._needed_live_numel()
        # See [Note: a live limit below what the model needs]
        self.live_limit = max(policy.max_live_parameters, self.needed_live_numel)
        # Every gather carries its unit (See [Note: stage-3 units every rank agrees on] in stages/agreement.py)
        # (not on torch's fake back-end, whose collectives move nothing: the planner's exact engine runs there)
        agree = comm.world_size > 1 and comm.backend != "fake"
        sizes = {self._gather_sizes(unit) for unit in units[1:]}
        self.agreement = UnitAgreement(comm.control, units, policy.skipped_units,
                                       wait_before_gather=len(sizes) > 1) if agree else None

    def parts(self, unit: Unit) -> list[tuple[ShardedFlat, Bucket]]:
        """The unit's buckets: its trainable ones, then its frozen one."""
        parts = [(self.trainable, bucket) for bucket in self.buckets_of[unit.index]]
        if unit.index in self.frozen_of:
            parts.append((self.frozen, self.frozen_of[unit.index]))
        return parts

    def _gather_sizes(self, unit: Unit) -> tuple[tuple[torch.dtype, int, int | None], ...]:
        """What the unit's gathers move, collective by collective: two ranks gathering units of equal sizes pair."""
        return tuple((flat.flat.dtype, bucket.numel, bucket.owner) for flat, bucket in self.parts(unit))

    def is_gathered(self, unit: Unit) -> bool:
        return all(flat.ready(bucket) for flat, bucket in self.parts(unit))

    def any_gathered(self, unit: Unit) -> bool:
        """Some of the unit is gathered or on its way (a prefetch was launched)."""
        return any(flat.has(bucket) for flat, bucket in self.parts(unit))

    def unshard(self, unit: Unit, async_op: bool = False) -> None:
        parts = self.parts(unit)
        missing = [(flat, bucket) for flat, bucket in parts if not flat.has(bucket)]
        if missing and not self._agreed(unit, async_op):
            return  # a prefetch that another rank's request displaced (skipped_units="gather")
        for flat, bucket in missing:
            self._count_live(unit, bucket.numel, async_op)
            flat.gather(bucket, self.comm, purpose=f"unit {unit.name!r}{' (prefetch)' if async_op else ''}")
        if not async_op:
            if self.agreement is not None:
                self.agreement.confirm(unit.index)  # every rank asked for this unit, before its data is used
            for flat, bucket in parts:
                flat.wait(bucket)
            for flat, bucket in parts:
                flat.point(bucket)

    def reshard(self, unit: Unit) -> None:
        """Free what the unit owns (a unit around it stays gathered); persistent units stay."""
        if unit.index in self.persistent:
            return
        if self.agreement is not None:
            self.agreement.confirm(unit.index)  # a prefetch never used: its gather still had to be the right one
        for flat, bucket in self.parts(unit):
            self.live_numel -= flat.free(bucket)
        for flat, bucket in self.parts(unit):
            flat.release(bucket)

    def prefetch(self, unit_index: int | None) -> None:
        """Start gathering a unit expected next, if it fits under both limits and is not on its way."""
        if unit_index is None:
            return
        unit = self.units[unit_index]
        numel = self.gathered_numel[unit_index]
        fits = self.live_numel + numel <= self.live_limit
        if fits and numel <= self.policy.prefetch_numel and not self.any_gathered(unit):
            self.unshard(unit, async_op=True)

    # --- agreement between ranks (See [Note: stage-3 units every rank agrees on]) --------------------------------
    def _agreed(self, unit: Unit, prefetch: bool) -> bool:
        """Announce the unit's gather ("raise"), or agree on it first ("gather"): False if it was displaced."""
        if self.agreement is None:
            return True
        if self.agreement.mode == RAISE:
            self.agreement.announce(unit.index, prefetch, self._serve)
            return True
        return self.agreement.agree(unit.index, prefetch, self._serve)

    def _serve(self, unit_index: int) -> None:
        """Gather a unit only because another rank asks for it now, or the order this rank follows promised it,
        and free it at once (one already here is gathered again in place, with the same values): every rank
        issues the same gathers."""
        unit = self.units[unit_index]
        for flat, bucket in self.parts(unit):
            purpose = f"unit {unit.name!r} (for another rank)"
            if flat.has(bucket):
                flat.regather(bucket, self.comm, purpose=purpose)
            else:
                self._count_live(unit, bucket.numel, async_op=False)
                flat.gather(bucket, self.comm, purpose=purpose)
                self.live_numel -= flat.free(bucket)

    def set_phase(self, phase: str) -> None:
        if self.agreement is not None:
            self.agreement.set_phase(phase)

    def end_phase(self) -> None:
        """This rank gathers nothing more in this forward or backward: say so to the others (and serve them)."""
        if self.agreement is not None:
            self.agreement.end_phase(self._serve)

    def release_all(self) -> None:
        for unit in self.units:
            self.reshard(unit)

    def _count_live(self, unit: Unit, numel: int, async_op: bool) -> None:
        """`numel` more unsharded elements; a gather that must happen now may not break the limit
        (a prefetch was checked against it before it was asked for)."""
        limit = self.live_limit
        if not async_op and self.live_numel + numel > limit:
            raise RuntimeError(f"rank {self.rank}: gathering unit {unit.name!r} would hold "
                               f"{self.live_numel + numel} unsharded elements, over the live limit {limit} "
                               f"(stage3_max_live_parameters={self.policy.max_live_parameters})")
        self.live_numel += numel
        self.peak_live_numel = max(self.peak_live_numel, self.live_numel)

    # --- after the shards change ---------------------------------------------------------------------
    def refresh_gathered(self) -> None:
        """The trainable shards were updated: buckets that stay gathered (persistent units, or all while
        pinned) are gathered again."""
        for bucket in self.trainable.layout.buckets:
            self.trainable.regather(bucket, self.comm)

    def drop_secondary(self) -> None:
        """The shards are about to change: hpZ's secondary copies go (See [Note: hpZ's secondary copy])."""
        self.trainable.drop_secondary()
        self.frozen.drop_secondary()

    def write_back(self) -> None:
        """The user changed gathered parameters in place: keep this rank's slice of each in its shard."""
        for flat in (self.frozen, self.trainable):
            for bucket in flat.layout.buckets:
                flat.write_back(bucket)

    def tensors(self) -> list[torch.Tensor]:
        return self.trainable.tensors()

    def _needed_live_numel(self) -> int:
        """Root and persistent units stay gathered. Besides them, at worst the unit computing is live with
        every unit around it (a chain of nested units; just the unit itself without nesting), plus one
        other unit whose last gradients are not all in yet: two units when none nest. Prefetches are
        not counted: they wait when they would not fit. A unit's size counts its frozen parameters too.
        See [Note: hooks around nested units] in hooks.py."""
        size = self.gathered_numel
        sharded = {i for i in range(1, len(self.units)) if i not in self.persistent}
        largest_first = sorted(sharded, key=lambda i: -size[i])
        worst = 0
        for index in sharded:
            chain = {j for j in ancestry(self.units, index) if j in sharded}
            other = next((size[k] for k in largest_first if k not in chain), 0)
            worst = max(worst, sum(size[j] for j in chain) + other)
        return size[0] + sum(size[i] for i in self.persistent if i) + worst

    def live_limit_lines(self) -> list[str]:
        """The start-up line for a stage3_max_live_parameters this model cannot keep to, if it is one."""
        limit = self.policy.max_live_parameters
        if limit >= self.needed_live_numel:
            return []
        return [f"zero_optimization.stage3_max_live_parameters={limit} is below the {self.needed_live_numel:,} "
                "elements this model needs live at once (root + persistent units + the largest chain of nested "
                f"units + one more unit): read as {self.needed_live_numel:,}, so no unit is prefetched beyond what "
                "the step needs (smaller units, stage3_unit_classes, lower it)"]