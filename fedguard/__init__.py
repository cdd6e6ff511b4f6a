"""fedguard: what a server can reconstruct from federated uploads, and which defense stops it."""

__version__ = "0.1.0"
