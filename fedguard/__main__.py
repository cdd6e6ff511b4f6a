"""``python -m fedguard`` is the ``fedguard`` command."""

import sys

from fedguard.cli import main

sys.exit(main())
