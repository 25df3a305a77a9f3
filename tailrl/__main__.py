"""`python -m tailrl ...` runs the CLI, like the `tailrl` script."""

import sys

from tailrl.cli import main

sys.exit(main())
