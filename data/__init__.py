"""The shipped library of fractal classes, inside the package as `scaffold.library` (see pyproject.toml)."""
