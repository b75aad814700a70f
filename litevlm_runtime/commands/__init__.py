"""Sub-commands of `litevlm` (one module each; see cli.py)."""
