"""Training commands (one module per trainable part)."""
