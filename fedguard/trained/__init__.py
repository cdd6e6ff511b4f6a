"""The trained networks' shared plumbing: their training (``fitting``)."""
