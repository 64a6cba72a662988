"""A registered model's plain attributes are registered state (issue 61): found on the
script's own modules only, carried through a state dict (a heal's JSON header included),
and rolled back with a step."""

from __future__ import annotations

import json

import torch
from torch import nn

from fastft.runtime.state.attributes import ModuleAttributes, module_attributes
from fastft.runtime.state.registry import MODEL_ATTRIBUTES, StateRegistry


class Head(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(2, 2)
        self.temperature = 1.0
        self.shape = (2, 2)
        self._private = 3
        self.table = {"not": "plain"}  # (a dict: not a plain value)


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.head = Head()
        self.drop = nn.Dropout(0.1)  # (torch's: its p is a setting, not state)
        self.steps_seen = 0
        self.local_rank = 2  # (the process's own: not the job's state)
        self.name = "net"  # (a string: not state a step changes)


def test_only_the_scripts_modules_plain_values_are_found():
    found = module_attributes(Net())
    assert sorted(found) == ["head.shape", "head.temperature", "steps_seen"]


def test_they_round_trip_through_json_and_keep_a_tuple_a_tuple():
    a, b = Net(), Net()
    a.steps_seen, a.head.temperature = 7, 0.5
    state = json.loads(json.dumps(ModuleAttributes(module_attributes(a)).state_dict()))
    ModuleAttributes(module_attributes(b)).load_state_dict(state)
    assert (b.steps_seen, b.head.temperature, b.head.shape) == (7, 0.5, (2, 2))


def test_a_rolled_back_step_puts_the_attribute_back():
    net = Net()
    reg = StateRegistry()
    reg.register(model=net, optimizer=torch.optim.SGD(net.parameters(), lr=0.1))
    assert MODEL_ATTRIBUTES in reg.others
    reg.begin_step()
    net.steps_seen += 1
    reg.rollback()
    assert net.steps_seen == 0
    assert reg.state(0)["others"][MODEL_ATTRIBUTES]["steps_seen"] == 0
