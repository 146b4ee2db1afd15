"""The model level: its config (config.py) and mixed precision (precision.py); import from the modules."""

__all__: list[str] = []
