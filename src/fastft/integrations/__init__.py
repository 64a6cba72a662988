"""Integrations with other fault-tolerance stacks (DESIGN "Layout"). Each one is an optional
extra: importing it needs that stack installed."""
