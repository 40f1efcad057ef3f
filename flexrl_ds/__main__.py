"""`python -m flexrl_ds <command>` is the same as `flexrl <command>`."""

from flexrl_ds.cli.main import main

if __name__ == "__main__":
    raise SystemExit(main())
