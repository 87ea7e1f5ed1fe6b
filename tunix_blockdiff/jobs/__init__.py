"""Subcommands of the `tunix-blockdiff` command, one module each."""
