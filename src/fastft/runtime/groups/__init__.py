"""The groups a step reduces over: the epoch's data plane (process groups), shard groups
(HSDP), the sync policies (per step, every k, DiLoCo) and pipeline stages' flow."""
