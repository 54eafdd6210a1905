"""ml-collections configs for upstream model families: `--config=configs/<family>.py:<variant>`."""
