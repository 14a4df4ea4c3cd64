"""`python -m oases.launch ...`: see oases.launch."""

from oases.launch import main

raise SystemExit(main())
