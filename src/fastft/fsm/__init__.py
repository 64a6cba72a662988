"""The step state machine (pure): ``decide(state, event) -> (state, actions)``."""

from fastft.fsm.contract import *  # noqa: F403
from fastft.fsm.contract import __all__ as _contract_all
from fastft.fsm.table import TABLE, Rule, decide, initial_state

__all__ = [*_contract_all, "TABLE", "Rule", "decide", "initial_state"]
