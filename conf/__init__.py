"""Hydra configuration, shipped inside the package as `scaffold.conf` (see pyproject.toml)."""
