"""The `fedguard` command and what its subcommands run: the CLI, the sweep, the offline attack."""
