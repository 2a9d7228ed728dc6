"""Carrying a plan out on live ranks: the EP-group runtime, the idle pool, the engine protocol."""
