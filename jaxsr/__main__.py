"""`python -m jaxsr`: the `jaxsr` command."""

import sys

from jaxsr.cli import main

sys.exit(main())
