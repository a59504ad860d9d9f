"""The `appliance` command line."""
from appliance.cli.main import build_parser, main

__all__ = ["build_parser", "main"]
