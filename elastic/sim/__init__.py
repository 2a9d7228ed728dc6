"""The same plans on a cluster cost model: simulator, trace replay, calibration, reports, plots."""
