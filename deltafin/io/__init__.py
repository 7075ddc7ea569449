"""Getting weights to the engine: from RAM (``ram``) or streamed from disk per layer (``stream``)."""
