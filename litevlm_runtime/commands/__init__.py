"""Sub-commands of `litevlm` (one module each; see cli.py). A command module imports the code it
runs inside its `run` function, not at its top: building the parser for every command, and
`litevlm --help`, then loads neither torch nor rclpy."""
