"""Carrying a plan out on live ranks: the EP-group runtime, its process groups and end rules, the
idle pool, the engine protocol."""
