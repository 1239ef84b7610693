"""dsv41-convert: hub safetensors checkpoint -> sharded Orbax checkpoint.

`convert_checkpoint` (library entry), `main` (the CLI, `python -m convert`), `build_plan` /
`verify_source` (the key table and coverage checks) and `ConversionError`.
"""

from convert.cli import main
from convert.plan import ConversionError, build_plan, verify_source
from convert.run import convert_checkpoint

__all__ = ["ConversionError", "build_plan", "convert_checkpoint", "main", "verify_source"]
