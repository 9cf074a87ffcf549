"""`python -m jax_flash.benchmark`: runs the benchmark CLI."""

import sys

from jax_flash.benchmark.cli import main

sys.exit(main())
