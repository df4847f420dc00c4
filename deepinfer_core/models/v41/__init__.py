"""DeepSeek-V4.1: config, Engram, DSpark, checkpoint format, model."""
