"""The `trainplan` command line: argument parsing, commands and their input checks."""
