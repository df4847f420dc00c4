"""DeepSeek-V2 / V3 / R1: config, checkpoint format, model."""
