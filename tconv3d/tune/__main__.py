"""python -m tconv3d.tune: tune a shape set's keys on this GPU into autotune_configs/<device>.json (tuner.py)."""

import sys

from .tuner import main

sys.exit(main())
