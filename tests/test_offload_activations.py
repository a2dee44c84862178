"""DeepSpeed's activation_checkpointing block: checkpointed functions, their activations in host memory, and
zerokit's checkpoint_units (issue 10)."""

from __future__ import annotations

import torch

import zerokit
from zerokit.config.typed import ActivationCheckpointing
from zerokit.engine import activations
from zerokit.testing.models import Block, TinyGPT, TinyGPTConfig, lm_loss, param_groups


def train(config: dict, steps: int = 3) -> tuple[list[float], dict[str, torch.Tensor], int]:
    """Losses, final weights, and how often a Block's forward ran (counted by a forward pre-hook of its MLP: torch's
    non-reentrant recomputation runs pre-hooks again but not forward hooks)."""
    torch.manual_seed(0)
    model = TinyGPT(TinyGPTConfig())
    calls = [0]
    for block in model.blocks:
        block.mlp.register_forward_pre_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))
    engine = zerokit.initialize(model, torch.optim.AdamW(param_groups(model), lr=1e-2), config)
    losses = []
    for step in range(steps):
        tokens = torch.randint(0, 67, (2, 17), generator=torch.Generator().manual_seed(step))
        loss = lm_loss(engine(tokens[:, :-1]), tokens)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses, engine.full_state_dict(), calls[0]


def test_checkpoint_units_recomputes_every_unit_and_trains_the_same(one_process) -> None:
    """Each Block unit's forward runs twice a step (again in backward), and training is bit for bit what it is
    without checkpointing: the recomputation gives the same activations."""
    stage3 = {"zero_optimization": {"stage": 3, "stage3_min_unit_params": 1000}}
    plain = train(stage3)
    checkpointed = train({**stage3, "activation_checkpointing": {"checkpoint_units": True, "cpu_checkpointing": True}})
    assert checkpointed[2] == 2 * plain[2] == 2 * 3 * 2  # 2 blocks, 3 steps
    assert checkpointed[0] == plain[0]
    assert all(torch.equal(checkpointed[1][k], plain[1][k]) for k in plain[1])


def test_checkpoint_keeps_gradients_with_activations_in_host_memory() -> None:
    """The function runs again in backward over the host copies of its inputs; gradients are unchanged."""
    block = Block(TinyGPTConfig())
    x = torch.randn(2, 8, 24, requires_grad=True)
    expected = torch.autograd.grad(block(x).square().sum(), [x, *block.parameters()])
    calls = [0]
    handle = block.mlp.register_forward_pre_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))
    checkpointer = activations.ActivationCheckpointer(ActivationCheckpointing(cpu_checkpointing=True))
    try:
        with checkpointer.running():
            got = torch.autograd.grad(activations.checkpoint(block, x).square().sum(), [x, *block.parameters()])
    finally:
        handle.remove()
    assert calls[0] == 2
    assert all(torch.equal(a, b) for a, b in zip(got, expected))


def test_partitioning_keys_say_they_change_nothing_here() -> None:
    checkpointer = activations.ActivationCheckpointer(ActivationCheckpointing(partition_activations=True,
                                                                             number_checkpoints=4))
    lines = checkpointer.startup_lines()
    assert lines and "nothing to partition with one rank per model replica" in lines[0]
