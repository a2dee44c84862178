"""zerokit/integrations/accelerate_cp.py in one process: the cut maybe_context_parallel makes, and what it refuses.
The training it serves is checked against one process in tests/test_sequence_parallel_scripts.py."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from zerokit.integrations.accelerate_cp import accelerate_cp_hooked, cut_in_place, hook_accelerate_cp, \
    ulysses_for_accelerate


def test_each_rank_holds_its_contiguous_piece_and_only_the_kept_buffers_stay_cut() -> None:
    tokens = torch.arange(24).reshape(2, 12)
    positions = torch.arange(12).expand(2, 12).contiguous()
    labels = tokens.clone()
    with cut_in_place([tokens, positions, labels], [1, 1, 1], {tokens, positions}, rank=2, ranks=3):
        assert tokens.tolist() == [[8, 9, 10, 11], [20, 21, 22, 23]]
        assert positions.tolist() == [[8, 9, 10, 11]] * 2
        assert labels.tolist() == tokens.tolist()
    assert tokens.shape == (2, 4) and positions.shape == (2, 4)
    assert labels.tolist() == torch.arange(24).reshape(2, 12).tolist()  # restored whole


def test_a_length_the_cp_size_does_not_divide_is_one_line() -> None:
    tokens = torch.arange(10).reshape(1, 10)
    with pytest.raises(ValueError, match=r"^a sequence of 10 tokens does not split over cp_size=4 ranks: pad"):
        with cut_in_place([tokens], [1], rank=0, ranks=4):
            pass
    assert tokens.shape == (1, 10)


def test_a_sequence_dimension_per_buffer() -> None:
    with pytest.raises(ValueError, match="got 2 buffer"):
        with cut_in_place([torch.zeros(1, 4), torch.zeros(1, 4)], [1], rank=0, ranks=2):
            pass


def test_tensor_parallelism_beside_context_parallelism_is_refused() -> None:
    accelerator = SimpleNamespace(parallelism_config=SimpleNamespace(cp_size=2, tp_size=2))
    with pytest.raises(ValueError, match=r"cp_size=2, tp_size=2\) under zerokit's DeepSpeed drop-in"):
        ulysses_for_accelerate(accelerator, ())


def test_accelerates_prepare_cp_is_replaced_once_and_an_fsdp_accelerator_keeps_torchs() -> None:
    pytest.importorskip("accelerate")
    hook_accelerate_cp()
    import accelerate.accelerator
    from accelerate.utils import DistributedType
    from torch.distributed.tensor.experimental import context_parallel

    assert accelerate_cp_hooked()
    replaced = accelerate.accelerator.Accelerator._prepare_cp
    hook_accelerate_cp()
    assert accelerate.accelerator.Accelerator._prepare_cp is replaced
    fsdp = SimpleNamespace(distributed_type=DistributedType.FSDP, torch_device_mesh={"cp": None},
                           parallelism_config=SimpleNamespace(cp_handler=SimpleNamespace(cp_comm_strategy="allgather")))
    assert replaced(fsdp) == ()
    assert fsdp._cp_context.func is context_parallel  # accelerate's own: torch's ring attention
