"""``python -m fedguard`` is the ``fedguard`` command."""

import sys

from fedguard.commands.cli import main

sys.exit(main())
