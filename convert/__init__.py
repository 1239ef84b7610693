"""dsv41-convert: hub safetensors checkpoint -> sharded Orbax checkpoint."""
