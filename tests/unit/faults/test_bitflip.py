"""The bitflip fault: one bit of a gradient, a sum, a weight or a moment, flipped once."""

from __future__ import annotations

import time

import pytest
import torch

from unbroken.faults.bitflip import flip_bit, pick
from unbroken.faults.schedule import ScheduleError, parse_flag
from unbroken.faults.worker_chaos import WorkerChaos


def test_flip_bit_flips_exactly_one_bit_of_each_width() -> None:
    for dtype, bits in ((torch.float32, 32), (torch.bfloat16, 16), (torch.float64, 64), (torch.uint8, 8)):
        for bit in (0, bits - 2, bits - 1):
            t = torch.ones(5, dtype=dtype)
            before = t.clone()
            flip_bit(t, 7, bit)  # index 7 wraps to element 2
            assert not torch.equal(t.view(-1)[2:3], before[2:3]), (dtype, bit)
            assert torch.equal(torch.cat([t[:2], t[3:]]), torch.cat([before[:2], before[3:]]))
            flip_bit(t, 7, bit)
            assert torch.equal(t, before)  # the same flip undoes it
    with pytest.raises(ValueError, match="empty"):
        flip_bit(torch.zeros(0), 0, 1)


def test_sign_and_exponent_bits_of_a_float32() -> None:
    t = torch.tensor([1.5])
    flip_bit(t, 0, 31)
    assert t.item() == -1.5
    flip_bit(t, 0, 23)  # the exponent's lowest bit: 1.5 * 2**-1
    assert t.item() == -0.75


def test_pick_finds_a_weight_and_an_adam_moment() -> None:
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.Adam(model.parameters())
    model(torch.ones(1, 3)).sum().backward()
    opt.step()
    state = {"model": model.state_dict(), "optim": opt.state_dict(), "step": 1}
    assert pick(state, "weight").data_ptr() == model.weight.data_ptr()
    moment = pick(state, "moment")
    assert any(moment is s["exp_avg"] for s in opt.state.values())
    with pytest.raises(ValueError, match="no moment"):
        pick({"model": model.state_dict()}, "moment")
    with pytest.raises(ValueError, match="weight or a moment"):
        pick(state, "grad")


def test_schedule_checks_bitflip_parameters() -> None:
    f = parse_flag("bitflip:replica=1,step=4,where=result,bit=30,index=9")
    assert (f.where, f.bit, f.index, f.one_step) == ("result", 30, 9, True)
    assert parse_flag("bitflip:replica=0,step=1,where=grad").bit == 22
    with pytest.raises(ScheduleError, match="where= one of grad, result, weight, moment"):
        parse_flag("bitflip:replica=0,step=1,where=wire")
    with pytest.raises(ScheduleError, match="bit must be within"):
        parse_flag("bitflip:replica=0,step=1,where=grad,bit=64")
    with pytest.raises(ScheduleError, match="crash does not take where"):
        parse_flag("crash:replica=0,step=1,where=grad")
    with pytest.raises(ScheduleError, match="bit="):
        parse_flag("bitflip:replica=0,step=1,where=grad,bit=high")


def test_one_flip_per_fault_and_a_redo_of_the_step_meets_it_no_more() -> None:
    hook = WorkerChaos([parse_flag("bitflip:replica=0,step=2,where=result,bit=31")], 0, time.time())
    buf = torch.ones(4)
    hook.after_exchange(1, buf)
    assert torch.equal(buf, torch.ones(4))
    hook.after_exchange(2, buf)
    assert buf[0].item() == -1.0 and hook.flips == 1
    hook.after_exchange(2, buf)  # the step's redo
    hook.after_exchange(3, buf)
    assert buf[0].item() == -1.0 and hook.flips == 1


def test_a_lasting_flip_hits_every_step_of_its_duration_once() -> None:
    hook = WorkerChaos([parse_flag("bitflip:replica=0,step=0,where=grad,bit=31,duration_s=60")], 0, time.time())
    g = torch.ones(2)
    for step in (0, 0, 1, 2):
        hook.before_exchange(step, [0, 1], 8, [g])
    assert hook.flips == 3


def test_weight_and_moment_flips_land_in_the_bound_state_at_the_step_start() -> None:
    model = torch.nn.Linear(2, 2)
    opt = torch.optim.Adam(model.parameters())
    model(torch.ones(1, 2)).sum().backward()
    opt.step()
    hook = WorkerChaos(
        [
            parse_flag("bitflip:replica=0,step=3,where=weight,bit=31"),
            parse_flag("bitflip:replica=0,step=3,where=moment,bit=31"),
        ],
        0,
        time.time(),
    )
    w = model.weight.detach().clone()
    m = next(iter(opt.state.values()))["exp_avg"].clone()
    hook.start_step(3)  # not bound: nothing to flip yet
    assert hook.flips == 0
    hook.bind_state(lambda: {"model": model.state_dict(), "optim": opt.state_dict()})
    hook.start_step(3)
    assert hook.flips == 2
    assert model.weight[0, 0].item() == -w[0, 0].item()
    assert next(iter(opt.state.values()))["exp_avg"].view(-1)[0].item() == -m.view(-1)[0].item()
