"""`python -m specdec.cli ...`: the `specdec` command."""

from specdec.cli import main

main()
