"""Per-process services shared by workers, spares and integrations: the environment
contract, the event log, the heartbeat, the exit sentinel, the spare's order, malloc
tuning and teardown. Imports nothing above :mod:`fastft.bus` and :mod:`fastft.inject`."""
