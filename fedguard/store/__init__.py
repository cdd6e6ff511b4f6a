"""The run folder and what it holds: file names and writers, the model card, the lock, checkpoints and resume,
the vault, saved observations."""
