"""`python -m ember` is the `ember` command."""

import sys

from ember.cli import main

sys.exit(main())
