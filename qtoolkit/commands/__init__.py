"""The `qtool` subcommands, one module each: argument parsing and exit codes over the Python API."""
