"""unbroken.Optimizer is a torch.optim.Optimizer over the wrapped one, driven by the manager.

The manager is a fake here (as torchft's optim_test.py mocks its Manager): these tests are
about the wrapper's contract with torch, not the exchange, which the integration tests run.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch

import unbroken
from unbroken.train.optimizer import Optimizer


class FakeManager:
    """The part of Manager the optimizer uses; sync_gradients answers what the test says."""

    def __init__(self, commit: bool = True, lr_scale: float = 1.0) -> None:
        self.answer = commit
        self.lr_scale = lr_scale
        self.calls: list[str] = []
        self.synced: list[list[torch.Tensor]] = []
        self.expected: int | None = None
        self.last_step_committed = False
        self.step = 0

    def start_step(self) -> None:
        self.calls.append("start_step")
        self.last_step_committed = False

    def expect_gradients(self, numel: int) -> None:
        self.expected = numel

    def sync_gradients(self, grads: list[torch.Tensor]) -> bool:
        self.calls.append("sync_gradients")
        self.synced.append(grads)
        return self.answer

    def request_next_quorum(self) -> None:
        self.calls.append("request_next_quorum")

    def commit(self) -> None:
        self.calls.append("commit")
        self.last_step_committed = True
        self.step += 1


def setup(
    commit: bool = True, lr_scale: float = 1.0, lr: float = 0.1
) -> tuple[torch.nn.Linear, torch.optim.AdamW, Optimizer, FakeManager]:
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 4)
    inner = torch.optim.AdamW(model.parameters(), lr=lr)
    manager = FakeManager(commit, lr_scale)
    return model, inner, Optimizer(inner, manager), manager  # type: ignore[arg-type]


def backward(model: torch.nn.Module, seed: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    loss = model(torch.randn(5, 3, generator=g)).pow(2).sum()
    loss.backward()
    return loss


def test_it_is_a_torch_optimizer_sharing_the_wrapped_ones_objects() -> None:
    model, inner, opt, manager = setup()
    assert isinstance(opt, torch.optim.Optimizer)
    assert opt.param_groups is inner.param_groups and opt.state is inner.state and opt.defaults is inner.defaults
    assert manager.expected == sum(p.numel() for p in model.parameters())
    assert unbroken.Optimizer is Optimizer


def test_a_committed_step_is_the_wrapped_optimizers_step() -> None:
    model, _, opt, manager = setup()
    reference = copy.deepcopy(model)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=0.1)
    for seed in range(3):
        opt.zero_grad()
        backward(model, seed)
        assert manager.last_step_committed is False
        assert opt.step() is None
        assert manager.last_step_committed is True
        ref_opt.zero_grad()
        backward(reference, seed)
        ref_opt.step()
    # The next step's quorum is asked for before the wrapped optimizer steps, never after a failed exchange.
    assert manager.calls == ["start_step", "sync_gradients", "request_next_quorum", "commit"] * 3
    for p, q in zip(model.parameters(), reference.parameters(), strict=False):
        assert torch.equal(p, q)


def test_step_returns_the_closures_loss() -> None:
    model, _, opt, manager = setup()
    opt.zero_grad()
    loss = backward(model)
    assert opt.step(lambda: loss) is loss
    assert manager.last_step_committed


def test_a_step_that_fails_its_exchange_changes_nothing() -> None:
    model, inner, opt, manager = setup(commit=False)
    before = [p.detach().clone() for p in model.parameters()]
    opt.zero_grad()
    backward(model)
    called: list[bool] = []
    assert opt.step(lambda: called.append(True)) is None
    assert not called, "the closure ran although the step was not applied"
    assert manager.calls == ["start_step", "sync_gradients"]
    assert manager.last_step_committed is False
    assert not inner.state, "the wrapped optimizer stepped"
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before, strict=False))


def test_a_parameter_without_a_gradient_is_exchanged_as_zeros() -> None:
    model, _, opt, manager = setup()
    opt.zero_grad()
    model(torch.randn(2, 3)).sum().backward()
    model.bias.grad = None
    opt.step()
    assert [tuple(g.shape) for g in manager.synced[0]] == [(4, 3), (4,)]
    assert torch.equal(manager.synced[0][1], torch.zeros(4))


def test_the_learning_rate_is_scaled_for_the_step_and_restored() -> None:
    model, inner, opt, _ = setup(lr_scale=0.5, lr=0.1)
    seen: list[float] = []
    inner.register_step_pre_hook(lambda o, *_: seen.append(o.param_groups[0]["lr"]))
    opt.zero_grad()
    backward(model)
    opt.step()
    assert seen == [pytest.approx(0.05)]
    assert inner.param_groups[0]["lr"] == 0.1


@pytest.mark.parametrize(
    "make",
    [
        lambda o: torch.optim.lr_scheduler.LambdaLR(o, lambda s: min(1.0, (s + 1) / 4)),
        lambda o: torch.optim.lr_scheduler.CosineAnnealingLR(o, T_max=5),
        lambda o: torch.optim.lr_scheduler.OneCycleLR(o, max_lr=0.5, total_steps=10),
        lambda o: torch.optim.lr_scheduler.SequentialLR(
            o,
            [torch.optim.lr_scheduler.LinearLR(o, 0.1, total_iters=2), torch.optim.lr_scheduler.ExponentialLR(o, 0.9)],
            milestones=[2],
        ),
    ],
    ids=["LambdaLR", "CosineAnnealingLR", "OneCycleLR", "SequentialLR"],
)
def test_schedulers_drive_the_wrapped_optimizers_learning_rate(make: Any) -> None:
    model, inner, opt, _ = setup()
    reference = copy.deepcopy(model)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=0.1)
    sched, ref_sched = make(opt), make(ref_opt)
    for seed in range(5):
        opt.zero_grad()
        backward(model, seed)
        opt.step()
        sched.step()
        ref_opt.zero_grad()
        backward(reference, seed)
        ref_opt.step()
        ref_sched.step()
        assert inner.param_groups[0]["lr"] == pytest.approx(ref_opt.param_groups[0]["lr"])
        assert sched.get_last_lr() == pytest.approx(ref_sched.get_last_lr())
    for p, q in zip(model.parameters(), reference.parameters(), strict=False):
        assert torch.equal(p, q)


def test_step_hooks_run_around_the_step() -> None:
    model, _, opt, manager = setup()
    order: list[str] = []
    opt.register_step_pre_hook(lambda o, a, k: order.append(f"pre:{o is opt}:{manager.calls[-1]}"))
    handle = opt.register_step_post_hook(lambda o, a, k: order.append(f"post:{manager.calls[-1]}"))
    opt.zero_grad()
    backward(model)
    opt.step()
    assert order == ["pre:True:start_step", "post:commit"]
    handle.remove()
    opt.zero_grad()
    opt.step()
    assert order == ["pre:True:start_step", "post:commit", "pre:True:start_step"]


def test_checkpointer_guard_accepts_it(tmp_path: Any) -> None:
    model, _, opt, _ = setup()
    with unbroken.Checkpointer(str(tmp_path / "ck")) as ck:
        ck.guard(opt)  # raised before: no register_step_pre_hook
        opt.zero_grad()
        backward(model)
        opt.step()


def test_added_param_groups_join_the_exchange() -> None:
    model, inner, opt, manager = setup()
    extra = torch.nn.Parameter(torch.ones(6))
    opt.add_param_group({"params": [extra], "lr": 1e-2})
    assert len(inner.param_groups) == 2 and inner.param_groups[1]["lr"] == 1e-2
    assert manager.expected == sum(p.numel() for p in model.parameters()) + 6
    opt.zero_grad()
    (model(torch.randn(2, 3)).sum() + extra.sum()).backward()
    opt.step()
    assert any(g is extra.grad for g in manager.synced[-1])
    assert not torch.equal(extra, torch.ones(6))


def test_state_dict_round_trips_like_the_wrapped_optimizers() -> None:
    model, inner, opt, _ = setup()
    opt.zero_grad()
    backward(model)
    opt.step()
    sd = opt.state_dict()
    assert str(sd) == str(inner.state_dict())
    _, inner2, opt2, _ = setup()
    opt2.load_state_dict(sd)
    assert str(inner2.state_dict()) == str(sd)
    for k, v in inner.state[next(iter(inner.state))].items():
        assert torch.equal(v, inner2.state[inner2.param_groups[0]["params"][0]][k])
    calls: list[str] = []
    opt.register_state_dict_post_hook(lambda o, s: calls.append("saved"))
    opt.state_dict()
    assert calls == ["saved"]
