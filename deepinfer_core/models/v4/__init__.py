"""DeepSeek-V4: config, checkpoint format, model."""
