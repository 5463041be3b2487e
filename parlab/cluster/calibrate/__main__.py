"""``python -m parlab.cluster.calibrate``: the same as ``parlab calibrate``."""
from parlab.cluster.calibrate.measure import main

raise SystemExit(main())
