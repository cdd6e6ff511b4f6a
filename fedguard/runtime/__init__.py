"""The Flower runtime: the ServerApp and ClientApp, the simulation and its launcher, the processes a run starts,
stopping a run, and what Ray ships to its workers."""
