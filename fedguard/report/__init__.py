"""Run outputs: the per-round log, the run folder, image grids and the HTML report."""
