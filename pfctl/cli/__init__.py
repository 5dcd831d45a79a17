"""The Typer command line. Thin: parse options into a config, call ``pfctl.api``, render."""
