"""elastic: FlexFloor's contribution.

Planner half (pure Python over dataclasses, no torch): `trace`, `shape`, `plan`, and the prediction,
layout and schedule modules. Runtime half: carries plans out on an engine that implements
`elastic.interface.ElasticEngine`. `elastic` never imports `megatron_rl`.
"""
