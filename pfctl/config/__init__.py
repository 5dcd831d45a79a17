"""Typed configuration: recipes (YAML) + ``--set`` overrides + flags → validated objects.

Precedence, lowest first: schema defaults < recipe file < ``--set a.b=c`` < command flags.
Every section is a frozen pydantic model that forbids unknown keys, so a typo fails with
its dotted key path, the offending value, what is allowed and a close-match suggestion.
"""

from pfctl.config.load import dump_config, load_config, parse_override, resolve_recipe_path

__all__ = ["dump_config", "load_config", "parse_override", "resolve_recipe_path"]
