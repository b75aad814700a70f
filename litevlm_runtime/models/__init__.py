"""Model definitions in plain PyTorch. Parameter names equal the upstream InternVL2.5 names, so a
checkpoint's state dict loads with `load_state_dict(strict=True)` and no renaming table."""
