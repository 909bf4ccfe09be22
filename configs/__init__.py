"""The presets (NAME.yaml); installed as the package trainer2.configs so `--preset NAME` works from any directory."""
