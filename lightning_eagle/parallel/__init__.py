"""Expert parallelism for the frozen K3 target and the up-front layout gates."""

from lightning_eagle.parallel.validate import UnsupportedLayoutError, validate_layout, validate_target_config

__all__ = ["UnsupportedLayoutError", "validate_layout", "validate_target_config"]
