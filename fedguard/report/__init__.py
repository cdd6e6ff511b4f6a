"""Run outputs: the per-round log and the run folder."""
