"""`python -m posttrain`: the `posttrain` command line."""

import sys

from posttrain.cli.main import main

sys.exit(main())
