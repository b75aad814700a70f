"""Model folders: checkpoints (single or sharded safetensors), config-independent loading helpers,
tokenizers, integrity manifests, presets and random-weight checkpoints."""
