"""Command line: `flexrl <command>`."""
