"""`python -m oases COMMAND ...`: the `oases` command line (`oases plan`, `oases env`, `oases check-model`)."""

from oases.cli import main

raise SystemExit(main())
